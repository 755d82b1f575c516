//! The overview page: controllers with their Raft role, brokers with state and rack,
//! topic and partition counts, under-replicated and offline partitions.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use maud::html;

use super::render::{self, Section};
use super::{status_of, Browser, Console};

/// `GET /`.
pub async fn overview(State(console): State<Console>, browser: Browser) -> Response {
    let admin = match console.admin() {
        Ok(a) => a,
        Err(e) => {
            return browser.page(
                status_of(&e),
                render::page(Section::Overview, "Cluster", render::error_box(&e)),
            )
        }
    };
    let (cluster, topics) = tokio::join!(admin.describe_cluster(), admin.list_topics());
    let cluster = match cluster {
        Ok(c) => c,
        Err(e) => {
            return browser.page(
                status_of(&e),
                render::page(Section::Overview, "Cluster", render::error_box(&e)),
            )
        }
    };
    let (topic_count, partition_count) = match &topics {
        Ok(t) => (
            Some(t.topics.len()),
            Some(
                t.topics
                    .iter()
                    .map(|t| u64::from(t.partitions))
                    .sum::<u64>(),
            ),
        ),
        Err(_) => (None, None),
    };
    let brokers: Vec<_> = cluster
        .brokers
        .iter()
        .filter_map(|b| b.broker.as_ref().map(|s| (s, b)))
        .collect();
    let unfenced = brokers
        .iter()
        .filter(|(b, _)| b.state == "unfenced")
        .count();
    let leader = cluster
        .leader
        .map(|l| l.to_string())
        .unwrap_or_else(|| "none".into());
    let body = html! {
        @if let Err(e) = &topics { (render::error_box(e)) }
        section.cards {
            div.card { span.label { "Controller leader" } span.value #controller-leader { (leader) } }
            div.card { span.label { "Brokers unfenced" } span.value #brokers-unfenced { (unfenced) " / " (brokers.len()) } }
            div.card { span.label { "Topics" } span.value #topic-count { (opt(topic_count)) } }
            div.card { span.label { "Partitions" } span.value #partition-count { (opt(partition_count)) } }
            div.card.warn[cluster.under_replicated_partitions > 0] {
                span.label { "Under-replicated" }
                span.value #under-replicated { (cluster.under_replicated_partitions) }
            }
            div.card.bad[cluster.offline_partitions > 0] {
                span.label { "Offline" }
                span.value #offline { (cluster.offline_partitions) }
            }
        }
        p.meta { "Cluster " code { (cluster.cluster_id) } ", metadata version " (cluster.metadata_version) }
        h2 { "Controllers" }
        table #controllers {
            thead { tr { th { "Id" } th { "Address" } th { "Raft role" } th.num { "Term" } th.num { "Commit index" } th.num { "Applied index" } th.num { "Lag" } } }
            tbody {
                @for c in &cluster.controllers {
                    tr {
                        td { (c.id) }
                        td { (c.address) }
                        td { span.badge.(c.role.as_str()) { (c.role) } @if !c.error.is_empty() { " " span.note { (c.error) } } }
                        td.num { (c.term) }
                        td.num { (c.commit_index) }
                        td.num { (c.applied_index) }
                        td.num { (opt(c.lag)) }
                    }
                }
            }
        }
        h2 { "Brokers" }
        table #brokers {
            thead { tr { th { "Id" } th { "Address" } th { "Kafka address" } th { "Rack" } th { "State" } th.num { "Epoch" } th.num { "Last heartbeat" } th.num { "Under-replicated" } } }
            tbody {
                @for (b, status) in &brokers {
                    tr {
                        td { (b.id) }
                        td { (b.address) }
                        td { (b.kafka_address.as_deref().unwrap_or("–")) }
                        td { (b.rack.as_deref().unwrap_or("–")) }
                        td { span.badge.(b.state.as_str()) { (b.state) } }
                        td.num { (b.epoch) }
                        td.num { @if let Some(ms) = status.last_heartbeat_age_ms { (ms) " ms ago" } @else { "–" } }
                        td.num { (status.under_replicated_partitions) }
                    }
                }
            }
        }
    };
    browser.page(
        StatusCode::OK,
        render::page(Section::Overview, "Cluster", body),
    )
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "–".into())
}
