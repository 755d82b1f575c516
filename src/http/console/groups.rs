//! Consumer group pages: the list, and a group's members, assignments and lag, with a
//! form that resets an empty group's committed offsets.

use std::collections::{BTreeMap, BTreeSet};

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Form;
use maud::{html, Markup};

use super::render::{self, url_part, Section};
use super::{see_other, status_of, Browser, Console, CALL_TIMEOUT};
use crate::api::proto::{CommittedOffset, DescribeGroupResponse};
use crate::client::error::ClientError;
use crate::client::groups::GroupsAdmin;
use crate::error_code::ErrorCode;

async fn groups_admin(console: &Console) -> Result<GroupsAdmin, ClientError> {
    Ok(GroupsAdmin::new(
        console.data_bootstrap().await?,
        CALL_TIMEOUT,
    ))
}

/// `GET /groups`.
pub async fn list(State(console): State<Console>, browser: Browser) -> Response {
    let groups = match groups_admin(&console).await {
        Ok(admin) => admin.list().await,
        Err(e) => Err(e),
    };
    let (status, body) = match &groups {
        Err(e) => (status_of(e), render::error_box(e)),
        Ok(list) => (
            StatusCode::OK,
            html! {
                @if list.is_empty() {
                    p.meta { "No consumer groups yet: a group appears when a consumer joins or commits." }
                } @else {
                    table #groups {
                        thead { tr { th { "Group" } th { "Type" } th { "State" } th.num { "Members" } th.num { "Coordinator" } } }
                        tbody {
                            @for g in list {
                                tr {
                                    td { a href=(group_link(&g.group)) { @if g.group.trim().is_empty() { "(" (g.group.len()) " spaces)" } @else { (g.group) } } }
                                    td { (g.group_type) }
                                    td { span.badge { (g.state) } }
                                    td.num { (g.members) }
                                    td.num { (g.coordinator_id) }
                                }
                            }
                        }
                    }
                }
            },
        ),
    };
    browser.page(
        status,
        render::page(Section::Groups, "Consumer groups", body),
    )
}

/// Whether a group in `state` has no members, so its offsets may be reset.
fn is_empty_state(state: &str) -> bool {
    state.eq_ignore_ascii_case("empty") || state.eq_ignore_ascii_case("dead")
}

/// The group page's address. Group names are any string (`..` included), so the name
/// goes in the query, which browsers never resolve as a path.
fn group_link(group: &str) -> String {
    format!("/group?name={}", url_part(group))
}

/// The group a request names (`?name=`).
#[derive(serde::Deserialize)]
pub struct GroupName {
    name: String,
}

/// `GET /group?name=G`.
pub async fn show(
    State(console): State<Console>,
    browser: Browser,
    Query(GroupName { name: group }): Query<GroupName>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let title = format!("Group {group}");
    let loaded = async {
        let d = groups_admin(&console).await?.describe(&group).await?;
        let ends = lag_ends(&console, &d).await;
        Ok::<_, ClientError>((d, ends))
    };
    let (d, ends) = match loaded.await {
        Ok(v) => v,
        Err(e) => {
            return browser.page(
                status_of(&e),
                render::page(Section::Groups, &title, render::error_box(&e)),
            )
        }
    };
    let body = html! {
        @if let Some(n) = query.get("reset").and_then(|n| n.parse::<u32>().ok()) {
            (render::notice(&format!("Committed new offsets for {n} partitions.")))
        }
        (summary(&d, &ends))
        @if is_empty_state(&d.state) {
            h2 { "Reset offsets" }
            (reset_form(&browser.token, &d))
        } @else {
            p.meta { "Offsets can be reset while the group has no members." }
        }
    };
    browser.page(StatusCode::OK, render::page(Section::Groups, &title, body))
}

/// Where the group's lag is measured to, for each partition it has an offset for: the
/// high watermark, or the last stable offset for a group that reads committed records.
/// Asked through Admin per topic (never creating a topic that was deleted since); a
/// topic or leader that does not answer leaves its partitions out.
async fn lag_ends(console: &Console, d: &DescribeGroupResponse) -> BTreeMap<(String, u32), i64> {
    let topics: BTreeSet<&str> = d.offsets.iter().map(|o| o.topic.as_str()).collect();
    let asked = futures_util::future::join_all(
        topics
            .into_iter()
            .map(|t| async move { (t, console.partition_offsets(t).await) }),
    )
    .await;
    let mut out = BTreeMap::new();
    for (topic, answer) in asked {
        if let Ok((_, offsets)) = answer {
            for (p, o) in offsets {
                let end = if d.isolation == "read_committed" {
                    o.last_stable_offset
                } else {
                    o.high_watermark
                };
                out.insert((topic.to_owned(), p), end);
            }
        }
    }
    out
}

fn summary(d: &DescribeGroupResponse, ends: &BTreeMap<(String, u32), i64>) -> Markup {
    let lag = |o: &CommittedOffset| {
        ends.get(&(o.topic.clone(), o.partition))
            .map(|end| (end - o.offset).max(0))
    };
    let total: i64 = d.offsets.iter().filter_map(lag).sum();
    html! {
        section.cards {
            div.card { span.label { "State" } span.value #state { (d.state) } }
            div.card { span.label { "Type" } span.value { (d.group_type) } }
            div.card { span.label { "Members" } span.value #members { (d.members.len()) } }
            div.card { span.label { "Total lag" } span.value #total-lag { (total) } }
        }
        p.meta { "Strategy " (d.strategy) ", epoch " (d.group_epoch) @if d.broadcast { ", broadcast" } @if d.isolation == "read_committed" { ", reads committed records (lag to the last stable offset)" } }
        h2 { "Members" }
        @if d.members.is_empty() { p.meta { "No members." } } @else {
            table #group-members {
                thead { tr { th { "Member" } th { "Client" } th { "Instance" } th.num { "Epoch" } th { "Assignment" } } }
                tbody {
                    @for m in &d.members {
                        tr {
                            td { code { (m.member_id) } }
                            td { (m.client_id) }
                            td { (m.instance_id) }
                            td.num { (m.member_epoch) }
                            td { @for a in &m.assignment { div { (a.topic) ": " (a.partitions.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ")) } } }
                        }
                    }
                }
            }
        }
        h2 { "Committed offsets and lag" }
        @if d.offsets.is_empty() { p.meta { "No committed offsets." } } @else {
            table #group-offsets {
                thead { tr { th { "Topic" } th.num { "Partition" } th.num { "Committed" } th.num { (if d.isolation == "read_committed" { "Last stable offset" } else { "High watermark" }) } th.num { "Lag" } } }
                tbody {
                    @for o in &d.offsets {
                        tr data-topic=(o.topic) data-partition=(o.partition) {
                            td { a href={"/topics/" (url_part(&o.topic))} { (o.topic) } }
                            td.num { (o.partition) }
                            td.num { (o.offset) }
                            td.num { (ends.get(&(o.topic.clone(), o.partition)).map(|e| e.to_string()).unwrap_or_else(|| "–".into())) }
                            td.num.lag { (lag(o).map(|l| l.to_string()).unwrap_or_else(|| "–".into())) }
                        }
                    }
                }
            }
        }
    }
}

fn reset_form(token: &str, d: &DescribeGroupResponse) -> Markup {
    let topics: BTreeSet<&str> = d.offsets.iter().map(|o| o.topic.as_str()).collect();
    html! {
        form #reset-offsets method="post" action={"/group/reset-offsets?name=" (url_part(&d.group))} {
            (render::csrf_field(token))
            label { "Topic (every partition)"
                input name="topic" list="group-topics" required value=(topics.iter().next().copied().unwrap_or_default());
                datalist #group-topics { @for t in &topics { option value=(t) {} } }
            }
            label { "To"
                select name="to" {
                    option value="earliest" { "earliest" }
                    option value="latest" { "latest" }
                    option value="offset" { "offset…" }
                }
            }
            label { "Offset (for “offset…”)" input name="offset" type="number" min="0"; }
            button type="submit" { "Reset offsets" }
        }
    }
}

/// Where a reset moves each partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Earliest,
    Latest,
    Offset(i64),
}

fn target(form: &BTreeMap<String, String>) -> Result<Target, ClientError> {
    let bad = |why: String| ClientError::new(ErrorCode::InvalidRequest, why);
    match form.get("to").map(String::as_str) {
        Some("earliest") => Ok(Target::Earliest),
        Some("latest") => Ok(Target::Latest),
        Some("offset") => {
            let text = form.get("offset").map(|s| s.trim()).unwrap_or_default();
            text.parse::<i64>()
                .ok()
                .filter(|o| *o >= 0)
                .map(Target::Offset)
                .ok_or_else(|| {
                    bad(format!(
                        "offset: expected an offset, 0 or more, not '{text}'"
                    ))
                })
        }
        other => Err(bad(format!(
            "to: expected earliest, latest or offset, not '{}'",
            other.unwrap_or_default()
        ))),
    }
}

/// The offset a partition with log bounds `[earliest, latest]` is reset to (kept inside
/// them, as `tidelog groups reset-offsets` does).
fn new_offset(to: Target, earliest: i64, latest: i64) -> i64 {
    match to {
        Target::Earliest => earliest,
        Target::Latest => latest.max(earliest),
        Target::Offset(o) => o.clamp(earliest, latest.max(earliest)),
    }
}

/// `POST /group/reset-offsets?name=G`: topic, to (earliest|latest|offset), offset.
pub async fn reset(
    State(console): State<Console>,
    browser: Browser,
    Query(GroupName { name: group }): Query<GroupName>,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    if let Some(refused) = browser.refusal(&console, &form) {
        return refused;
    }
    let attempt = async {
        let to = target(&form)?;
        let topic = form
            .get("topic")
            .map(|s| s.trim())
            .unwrap_or_default()
            .to_owned();
        let (count, bounds) = console.partition_offsets(&topic).await?;
        let mut offsets = Vec::new();
        for partition in 0..count {
            let b = bounds.get(&partition).ok_or_else(|| {
                ClientError::new(
                    ErrorCode::NotLeaderOrFollower,
                    format!("the leader of {topic}-{partition} did not answer; nothing was reset"),
                )
            })?;
            let (earliest, latest) = (b.log_start_offset, b.high_watermark);
            offsets.push(CommittedOffset {
                topic: topic.clone(),
                partition,
                offset: new_offset(to, earliest, latest),
                metadata: String::new(),
            });
        }
        groups_admin(&console).await?.reset(&group, offsets).await?;
        Ok::<_, ClientError>(count)
    };
    match attempt.await {
        Ok(n) => see_other(&format!("{}&reset={n}", group_link(&group))),
        Err(e) => browser.page(
            status_of(&e),
            render::page(
                Section::Groups,
                &format!("Group {group}"),
                html! {
                    (render::error_box(&e))
                    p { a href=(group_link(&group)) { "← Back to the group" } }
                },
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_targets_stay_inside_the_log() {
        assert_eq!(new_offset(Target::Earliest, 5, 10), 5);
        assert_eq!(new_offset(Target::Latest, 5, 10), 10);
        assert_eq!(new_offset(Target::Offset(7), 5, 10), 7);
        assert_eq!(new_offset(Target::Offset(1), 5, 10), 5);
        assert_eq!(new_offset(Target::Offset(99), 5, 10), 10);
        let form = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            target(&form(&[("to", "offset"), ("offset", "3")])).unwrap(),
            Target::Offset(3)
        );
        assert!(target(&form(&[("to", "offset"), ("offset", "-3")]))
            .unwrap_err()
            .message
            .starts_with("offset"));
        assert!(target(&form(&[("to", "sideways")]))
            .unwrap_err()
            .message
            .starts_with("to"));
        assert!(is_empty_state("Empty") && is_empty_state("empty") && !is_empty_state("stable"));
    }
}
