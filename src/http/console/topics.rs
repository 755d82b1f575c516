//! Topic pages: the list (with search), creating, deleting (after confirmation) and a
//! topic's configuration and partitions.

use std::collections::{BTreeMap, HashMap};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Form;
use maud::{html, Markup};

use super::render::{self, url_part, Section};
use super::{see_other, status_of, Browser, Console};
use crate::client::error::ClientError;
use crate::error_code::ErrorCode;

/// `GET /topics[?q=TEXT][&created=T][&deleted=T]`.
pub async fn list(
    State(console): State<Console>,
    browser: Browser,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let search = query.get("q").map(|s| s.trim()).unwrap_or_default();
    let topics = match console.admin() {
        Ok(a) => a.list_topics().await,
        Err(e) => Err(e),
    };
    let mut status = StatusCode::OK;
    let body = html! {
        @if let Some(t) = query.get("created").filter(|t| is_topic_name(t)) { (render::notice(&format!("Created topic {t}."))) }
        @if let Some(t) = query.get("deleted").filter(|t| is_topic_name(t)) { (render::notice(&format!("Deleted topic {t}."))) }
        form.search method="get" action="/topics" {
            input #filter type="search" name="q" value=(search) placeholder="Search topics" autocomplete="off";
            button type="submit" { "Search" }
        }
        @match &topics {
            Err(e) => { (render::error_box(e)) }
            Ok(t) => {
                @let shown: Vec<_> = t.topics.iter().filter(|t| t.name.to_lowercase().contains(&search.to_lowercase())).collect();
                table #topics data-filter="filter" {
                    thead { tr { th { "Name" } th.num { "Partitions" } th.num { "Replication factor" } th { "Id" } } }
                    tbody {
                        @for t in &shown {
                            tr data-name=(t.name) {
                                td { a href={"/topics/" (url_part(&t.name))} { (t.name) } }
                                td.num { (t.partitions) }
                                td.num { (t.replication_factor) }
                                td { code { (t.id) } }
                            }
                        }
                    }
                }
                @if shown.is_empty() { p.meta { "No topics" @if !search.is_empty() { " match " q { (search) } } "." } }
            }
        }
        h2 { "Create a topic" }
        (create_form(&browser.token, &BTreeMap::new()))
    };
    if let Err(e) = &topics {
        status = status_of(e);
    }
    browser.page(status, render::page(Section::Topics, "Topics", body))
}

/// The create form, filled with `values` (after a refused attempt).
fn create_form(token: &str, values: &BTreeMap<String, String>) -> Markup {
    let v = |k: &str| values.get(k).cloned().unwrap_or_default();
    html! {
        form #create-topic method="post" action="/topics" {
            (render::csrf_field(token))
            label { "Name" input name="name" required pattern="[a-zA-Z0-9._\\-]{1,249}" value=(v("name")); }
            label { "Partitions" input name="partitions" type="number" min="1" placeholder="broker default" value=(v("partitions")); }
            label { "Replication factor" input name="replication_factor" type="number" min="1" placeholder="broker default" value=(v("replication_factor")); }
            label.wide { "Configs (one key=value per line)" textarea name="config" rows="3" placeholder="retention.ms=86400000" { (v("config")) } }
            button type="submit" { "Create topic" }
        }
    }
}

/// `POST /topics`: name, partitions, replication_factor, config (`k=v` lines).
pub async fn create(
    State(console): State<Console>,
    browser: Browser,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    if let Some(refused) = browser.refusal(&console, &form) {
        return refused;
    }
    let name = form
        .get("name")
        .map(|s| s.trim())
        .unwrap_or_default()
        .to_owned();
    let attempt = async {
        let partitions = number_field(&form, "partitions")?;
        let replication_factor = number_field(&form, "replication_factor")?;
        let config = config_lines(form.get("config").map(String::as_str).unwrap_or_default())?;
        console
            .admin()?
            .create_topic(&name, partitions, replication_factor, config)
            .await
    };
    match attempt.await {
        Ok(_) => see_other(&format!("/topics?created={}", url_part(&name))),
        Err(e) => browser.page(
            status_of(&e),
            render::page(
                Section::Topics,
                "Create a topic",
                html! { (render::error_box(&e)) (create_form(&browser.token, &form)) },
            ),
        ),
    }
}

/// Refuses a name no topic can have before asking the cluster about it.
pub fn check_topic_name(name: &str) -> Result<(), ClientError> {
    if is_topic_name(name) {
        return Ok(());
    }
    let shown: String = name.chars().take(64).collect();
    Err(ClientError::new(
        ErrorCode::InvalidTopic,
        format!(
            "'{shown}'{} is not a topic name: 1 to 249 of a-z A-Z 0-9 . _ -",
            if shown.len() < name.len() { "…" } else { "" }
        ),
    ))
}

/// Whether `name` could be a topic's (so a notice naming it was not made up by a link).
fn is_topic_name(name: &str) -> bool {
    (1..=249).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// An optional positive number from a form field; a malformed one is an error naming it.
fn number_field(form: &BTreeMap<String, String>, field: &str) -> Result<Option<u32>, ClientError> {
    match form.get(field).map(|s| s.trim()).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(s) => s
            .parse::<u32>()
            .ok()
            .filter(|n| *n >= 1)
            .map(Some)
            .ok_or_else(|| {
                ClientError::new(
                    ErrorCode::InvalidRequest,
                    format!("{field} must be a whole number, 1 or more, not '{s}'"),
                )
            }),
    }
}

/// `key=value` lines (blank lines ignored) as a config map; a line without `=` or a
/// repeated key is an error naming it.
pub fn config_lines(text: &str) -> Result<BTreeMap<String, String>, ClientError> {
    let mut out = BTreeMap::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let Some((k, v)) = line.split_once('=') else {
            return Err(ClientError::new(
                ErrorCode::InvalidConfig,
                format!("config line '{line}' is not key=value"),
            ));
        };
        if out
            .insert(k.trim().to_owned(), v.trim().to_owned())
            .is_some()
        {
            return Err(ClientError::new(
                ErrorCode::InvalidConfig,
                format!("config key '{}' is given twice", k.trim()),
            ));
        }
    }
    Ok(out)
}

/// `GET /topics/{topic}`: configuration and partitions with offsets and sizes.
pub async fn show(
    State(console): State<Console>,
    browser: Browser,
    Path(topic): Path<String>,
) -> Response {
    let described = match (check_topic_name(&topic), console.admin()) {
        (Err(e), _) | (_, Err(e)) => Err(e),
        (Ok(()), Ok(a)) => a.describe_topics_with_offsets(vec![topic.clone()]).await,
    };
    let found = described.map(|list| {
        list.into_iter()
            .find(|d| d.topic.as_ref().is_some_and(|t| t.name == topic))
    });
    let d = match found {
        Ok(Some(d)) => d,
        Ok(None) => {
            let e = ClientError::new(
                ErrorCode::UnknownTopicOrPartition,
                format!("there is no topic '{topic}'"),
            );
            return browser.page(
                status_of(&e),
                render::page(Section::Topics, &topic, render::error_box(&e)),
            );
        }
        Err(e) => {
            return browser.page(
                status_of(&e),
                render::page(Section::Topics, &topic, render::error_box(&e)),
            )
        }
    };
    let Some(t) = d.topic.as_ref() else {
        return browser.page(
            StatusCode::NOT_FOUND,
            render::page(Section::Topics, &topic, html! {}),
        );
    };
    let offsets: BTreeMap<u32, _> = d.offsets.iter().map(|o| (o.partition, o)).collect();
    let total_size: u64 = d.offsets.iter().map(|o| o.size_bytes).sum();
    let records: i64 = d
        .offsets
        .iter()
        .map(|o| (o.high_watermark - o.log_start_offset).max(0))
        .sum();
    let messages = format!("/topics/{}/messages", url_part(&t.name));
    let body = html! {
        p.actions {
            a.button href=(messages) { "Browse messages" }
            " "
            a.button.danger href={"/topics/" (url_part(&t.name)) "/delete"} { "Delete topic…" }
        }
        section.cards {
            div.card { span.label { "Partitions" } span.value { (t.partitions.len()) } }
            div.card { span.label { "Replication factor" } span.value { (t.replication_factor) } }
            div.card { span.label { "Records" } span.value #records { (records) } }
            div.card { span.label { "Size (leaders)" } span.value { (render::size(total_size)) } }
        }
        p.meta { "Id " code { (t.id) } }
        h2 { "Partitions" }
        table #partitions {
            thead { tr {
                th.num { "Partition" } th.num { "Leader" } th.num { "Leader epoch" } th { "Replicas" } th { "ISR" }
                th.num { "Log start" } th.num { "High watermark" } th.num { "Log end" } th.num { "Size" }
            } }
            tbody {
                @for p in &t.partitions {
                    @let o = offsets.get(&p.partition);
                    @let under = p.isr.len() < p.replicas.len();
                    tr.warn[under].bad[p.leader.is_none()] {
                        td.num { a href={(messages) "?partition=" (p.partition)} { (p.partition) } }
                        td.num { @if let Some(l) = p.leader { (l) } @else { "none" } }
                        td.num { (p.leader_epoch) }
                        td { (render::ids(&p.replicas))
                            @if !p.adding_replicas.is_empty() { " " span.note { "adding " (render::ids(&p.adding_replicas)) } }
                            @if !p.removing_replicas.is_empty() { " " span.note { "removing " (render::ids(&p.removing_replicas)) } }
                            @if !p.offline_replicas.is_empty() { " " span.note { "offline " (render::ids(&p.offline_replicas)) } } }
                        td { (render::ids(&p.isr)) }
                        @if let Some(o) = o {
                            td.num { (o.log_start_offset) }
                            td.num { (o.high_watermark) }
                            td.num { (o.log_end_offset) }
                            td.num { (render::size(o.size_bytes)) }
                        } @else {
                            td.num colspan="4" { span.note { "leader did not answer" } }
                        }
                    }
                }
            }
        }
        h2 { "Configuration" }
        @if t.config.is_empty() {
            p.meta { "No topic overrides: every setting is the broker default." }
        } @else {
            table #config {
                thead { tr { th { "Key" } th { "Value" } } }
                tbody { @for (k, v) in &t.config { tr { td { code { (k) } } td { (v) } } } }
            }
        }
    };
    browser.page(StatusCode::OK, render::page(Section::Topics, &t.name, body))
}

/// `GET /topics/{topic}/delete`: asks to type the name before deleting.
pub async fn confirm_delete(browser: Browser, Path(topic): Path<String>) -> Response {
    browser.page(
        StatusCode::OK,
        render::page(
            Section::Topics,
            &format!("Delete topic {topic}"),
            confirm_form(&browser.token, &topic),
        ),
    )
}

fn confirm_form(token: &str, topic: &str) -> Markup {
    html! {
        p { "Deleting a topic removes all its partitions and records on every broker. It cannot be undone." }
        form #delete-topic method="post" action={"/topics/" (url_part(topic)) "/delete"} {
            (render::csrf_field(token))
            label { "Type the topic name, " code { (topic) } ", to confirm" input name="confirm" autocomplete="off" required; }
            button.danger type="submit" { "Delete topic" }
            " " a href={"/topics/" (url_part(topic))} { "Cancel" }
        }
    }
}

/// `POST /topics/{topic}/delete` with `confirm` equal to the name.
pub async fn delete(
    State(console): State<Console>,
    browser: Browser,
    Path(topic): Path<String>,
    Form(form): Form<BTreeMap<String, String>>,
) -> Response {
    if let Some(refused) = browser.refusal(&console, &form) {
        return refused;
    }
    let attempt = async {
        if form.get("confirm").map(|s| s.trim()) != Some(topic.as_str()) {
            return Err(ClientError::new(
                ErrorCode::InvalidRequest,
                "confirm: type the topic name exactly to delete it",
            ));
        }
        console.admin()?.delete_topic(&topic).await
    };
    match attempt.await {
        Ok(_) => see_other(&format!("/topics?deleted={}", url_part(&topic))),
        Err(e) => browser.page(
            status_of(&e),
            render::page(
                Section::Topics,
                &format!("Delete topic {topic}"),
                html! { (render::error_box(&e)) (confirm_form(&browser.token, &topic)) },
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_lines_parse_and_refuse_with_the_line() {
        let c = config_lines("retention.ms=1000\n\n  cleanup.policy = delete \n").unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c["cleanup.policy"], "delete");
        let e = config_lines("retention.ms").unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidConfig);
        assert!(e.message.contains("retention.ms"));
        assert!(config_lines("a=1\na=2").is_err());
        let form = |v: &str| BTreeMap::from([("partitions".to_owned(), v.to_owned())]);
        assert_eq!(number_field(&form(" 3 "), "partitions").unwrap(), Some(3));
        assert_eq!(number_field(&form(""), "partitions").unwrap(), None);
        for bad in ["0", "-1", "many", "99999999999"] {
            assert!(number_field(&form(bad), "partitions")
                .unwrap_err()
                .message
                .starts_with("partitions"));
        }
        assert!(is_topic_name("a.b_c-1") && !is_topic_name("a b") && !is_topic_name(""));
    }
}
