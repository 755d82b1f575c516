//! Creating an internal topic (`__consumer_offsets`, `__timers`) on first use.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::broker::{BrokerError, BrokerNode};
use crate::client::AdminClient;
use crate::controller::model::BrokerState;
use crate::error_code::ErrorCode;

/// How an internal topic is created.
#[derive(Debug, Clone)]
pub struct InternalTopic<'a> {
    /// Its name.
    pub name: &'a str,
    /// Partitions.
    pub partitions: u32,
    /// Replication factor, capped at the live brokers.
    pub replication_factor: u32,
    /// Topic configuration.
    pub config: BTreeMap<String, String>,
    /// The code when it is not ready within 10 s (retriable).
    pub not_ready: ErrorCode,
}

/// Creates the topic unless it exists, then waits (up to 10 s) until this broker's
/// metadata shows every partition with a leader.
pub async fn ensure(
    node: &BrokerNode,
    admin: &AdminClient,
    topic: InternalTopic<'_>,
) -> Result<(), BrokerError> {
    let name = topic.name;
    if node.metadata().topic(name).is_none() {
        let live = node.metadata().read(|image| {
            image
                .brokers
                .values()
                .filter(|b| b.state == BrokerState::Unfenced)
                .count() as u32
        });
        let rf = topic.replication_factor.min(live.max(1));
        match admin
            .create_topic(name, Some(topic.partitions), Some(rf), topic.config)
            .await
        {
            Ok(_) => tracing::info!(
                partitions = topic.partitions,
                replication_factor = rf,
                "created {name}"
            ),
            Err(e) if e.code == ErrorCode::TopicAlreadyExists => {}
            Err(e) => return Err(BrokerError::new(e.code, e.message)),
        }
    }
    let mut version = node.metadata().subscribe();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ready = node
            .metadata()
            .topic(name)
            .is_some_and(|t| t.partitions.iter().all(|p| p.leader.is_some()));
        if ready {
            return Ok(());
        }
        if tokio::time::timeout_at(deadline, version.changed())
            .await
            .is_err()
        {
            return Err(BrokerError::new(
                topic.not_ready,
                format!("{name} is not ready yet"),
            ));
        }
    }
}
