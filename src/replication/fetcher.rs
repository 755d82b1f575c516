//! A follower's fetcher: one task per leader broker, fetching every partition this broker
//! follows there in one request.
//!
//! A partition starts in the truncating phase: the fetcher asks the leader where the
//! follower's latest epoch ends (OffsetsForLeaderEpoch), truncates there (see
//! [`super::truncation`]), then fetches from its log end. Each fetch reports the
//! follower's log end to the leader and brings back batches and the leader's high
//! watermark. Appends and truncations check, under the partition's role lock, that the
//! partition still follows this leader in this epoch, so nothing fetched lands after a
//! role change.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use super::replica::{LocalPartition, ReplicaError};
use super::truncation::{next_step, TruncationStep};
use crate::api::proto::replication_client::ReplicationClient;
use crate::api::proto::{
    LeaderEpochQuery, OffsetsForLeaderEpochRequest, ReplicaFetchPartition, ReplicaFetchRequest,
};
use crate::api::status::from_wire;
use crate::error_code::ErrorCode;
use crate::types::{BrokerId, LeaderEpoch, Offset};

/// Finds the partitions stored on this broker.
pub trait PartitionLookup: Send + Sync + 'static {
    /// The partition, if stored here.
    fn partition(&self, topic: &str, partition: u32) -> Option<Arc<LocalPartition>>;
}

/// How a fetcher fetches.
#[derive(Debug, Clone)]
pub struct FetcherConfig {
    /// This (the follower) broker.
    pub broker_id: BrokerId,
    /// Longest the leader holds a fetch with nothing new.
    pub max_wait: Duration,
    /// Most bytes per response.
    pub max_bytes: usize,
    /// Most bytes per partition in a response.
    pub partition_max_bytes: usize,
    /// Pause after an error.
    pub backoff: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Asking where `ask` (or the log's latest epoch) ends on the leader.
    Truncating { ask: Option<LeaderEpoch> },
    /// Fetching from the log end.
    Fetching,
}

#[derive(Debug, Clone)]
struct Followed {
    topic_id: String,
    epoch: LeaderEpoch,
    phase: Phase,
    /// Skipped until then (after an error).
    paused_until: Option<Instant>,
}

type Key = (String, u32);

/// A running fetcher for one leader broker.
pub struct Fetcher {
    leader: BrokerId,
    address: String,
    partitions: Arc<Mutex<HashMap<Key, Followed>>>,
    wake: Arc<Notify>,
    cancel: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Fetcher {
    /// Starts fetching from `leader` at `address`.
    pub fn start(
        leader: BrokerId,
        address: String,
        config: FetcherConfig,
        lookup: Arc<dyn PartitionLookup>,
        channel: Channel,
    ) -> Self {
        let mut fetcher = Self {
            leader,
            address,
            partitions: Arc::default(),
            wake: Arc::new(Notify::new()),
            cancel: CancellationToken::new(),
            task: None,
        };
        let task = FetchLoop {
            leader,
            config,
            lookup,
            client: ReplicationClient::new(channel)
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX),
            partitions: fetcher.partitions.clone(),
            wake: fetcher.wake.clone(),
        };
        fetcher.task = Some(tokio::spawn(task.run(fetcher.cancel.clone())));
        fetcher
    }

    /// The leader's address this fetcher uses.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The leader broker.
    pub fn leader(&self) -> BrokerId {
        self.leader
    }

    /// Follows a partition in `epoch` (truncating first); replaces an older entry.
    pub fn add(&self, topic: &str, topic_id: &str, partition: u32, epoch: LeaderEpoch) {
        self.partitions.lock().insert(
            (topic.to_owned(), partition),
            Followed {
                topic_id: topic_id.to_owned(),
                epoch,
                phase: Phase::Truncating { ask: None },
                paused_until: None,
            },
        );
        self.wake.notify_one();
    }

    /// Stops following a partition.
    pub fn remove(&self, topic: &str, partition: u32) {
        self.partitions
            .lock()
            .remove(&(topic.to_owned(), partition));
    }

    /// The partitions followed.
    pub fn followed(&self) -> Vec<(String, u32)> {
        self.partitions.lock().keys().cloned().collect()
    }

    /// Stops the task.
    pub fn stop(&self) {
        self.cancel.cancel();
    }

    /// Stops the task and waits until it has ended (an append in progress finishes).
    pub async fn stop_and_wait(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Fetcher {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

struct FetchLoop {
    leader: BrokerId,
    config: FetcherConfig,
    lookup: Arc<dyn PartitionLookup>,
    client: ReplicationClient<Channel>,
    partitions: Arc<Mutex<HashMap<Key, Followed>>>,
    wake: Arc<Notify>,
}

/// Time allowed on top of the long-poll for a fetch's round trip.
const RPC_SLACK: Duration = Duration::from_secs(10);

impl FetchLoop {
    async fn run(mut self, cancel: CancellationToken) {
        // Failures in a row: one WARN when the leader broker stops answering, one INFO
        // when it answers again (each failure itself is logged at debug).
        let mut failing_since: Option<Instant> = None;
        loop {
            if cancel.is_cancelled() {
                return;
            }
            let now = Instant::now();
            let (mut truncating, mut fetching, mut next_pause) = (Vec::new(), Vec::new(), None);
            for (key, f) in self.partitions.lock().iter() {
                match f.paused_until {
                    Some(t) if t > now => {
                        next_pause = Some(next_pause.map_or(t, |n: Instant| n.min(t)));
                        continue;
                    }
                    _ => {}
                }
                match f.phase {
                    Phase::Truncating { ask } => truncating.push((key.clone(), f.clone(), ask)),
                    Phase::Fetching => fetching.push((key.clone(), f.clone())),
                }
            }
            let result = if !truncating.is_empty() {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = self.truncate(truncating) => r,
                }
            } else if !fetching.is_empty() {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = self.fetch(fetching) => r,
                }
            } else {
                let wait = next_pause.map_or(Duration::from_secs(3600), |t| t - now);
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(wait) => {}
                }
                Ok(())
            };
            if result.is_ok() {
                if let Some(since) = failing_since.take() {
                    tracing::info!(leader = %self.leader, down_ms = since.elapsed().as_millis() as u64, "leader broker answers replica fetches again");
                }
            }
            if let Err(e) = result {
                if failing_since.is_none() {
                    failing_since = Some(Instant::now());
                    tracing::warn!(leader = %self.leader, error = %e, "leader broker does not answer replica fetches; retrying");
                }
                tracing::debug!(leader = %self.leader, error = %e, "replica fetch failed");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(self.config.backoff) => {}
                }
            }
        }
    }

    /// Updates a followed partition if it is still followed in `epoch`.
    fn update(&self, key: &Key, epoch: LeaderEpoch, f: impl FnOnce(&mut Followed)) {
        if let Some(entry) = self.partitions.lock().get_mut(key) {
            if entry.epoch == epoch {
                f(entry);
            }
        }
    }

    fn pause(&self, key: &Key, epoch: LeaderEpoch) {
        let until = Instant::now() + self.config.backoff;
        self.update(key, epoch, |e| e.paused_until = Some(until));
    }

    async fn truncate(
        &mut self,
        partitions: Vec<(Key, Followed, Option<LeaderEpoch>)>,
    ) -> Result<(), tonic::Status> {
        let mut queries = Vec::new();
        let mut asked = HashMap::new();
        for (key, f, ask) in partitions {
            let Some(local) = self.lookup.partition(&key.0, key.1) else {
                self.partitions.lock().remove(&key);
                continue;
            };
            let Some(epoch) = ask.or_else(|| local.log.latest_epoch()) else {
                // An empty log has nothing to disagree about.
                self.update(&key, f.epoch, |e| e.phase = Phase::Fetching);
                continue;
            };
            queries.push(LeaderEpochQuery {
                topic: key.0.clone(),
                partition: key.1,
                current_leader_epoch: f.epoch.0,
                leader_epoch: epoch.0,
            });
            asked.insert(key, (f, epoch, local));
        }
        if queries.is_empty() {
            return Ok(());
        }
        let response = self
            .client
            .offsets_for_leader_epoch(tonic::Request::new(OffsetsForLeaderEpochRequest {
                replica_id: self.config.broker_id.0,
                partitions: queries,
            }))
            .await?
            .into_inner();
        for answer in response.partitions {
            let key = (answer.topic.clone(), answer.partition);
            let Some((f, epoch, local)) = asked.remove(&key) else {
                continue;
            };
            if let Some(code) = from_wire(answer.error_code) {
                tracing::debug!(partition = %local.name(), %code, message = %answer.error_message, "epoch lookup refused");
                self.pause(&key, f.epoch);
                continue;
            }
            let leader_answer = (answer.leader_epoch >= 0 && answer.end_offset >= 0).then_some({
                (
                    LeaderEpoch(answer.leader_epoch),
                    Offset(answer.end_offset as u64),
                )
            });
            let step = next_step(
                epoch,
                leader_answer,
                |e| local.log.end_offset_for_epoch(e),
                local.log.high_watermark(),
            );
            match step {
                TruncationStep::Ask(older) => {
                    self.update(&key, f.epoch, |e| {
                        e.phase = Phase::Truncating { ask: Some(older) }
                    });
                }
                TruncationStep::TruncateTo(offset) => {
                    let leader = self.leader;
                    let target = local.clone();
                    let result = tokio::task::spawn_blocking(move || {
                        target.truncate_as_follower(leader, f.epoch, offset, false)
                    })
                    .await;
                    match result {
                        Ok(Ok(Some(end))) => {
                            tracing::info!(partition = %local.name(), leader = %self.leader, leader_epoch = %f.epoch, truncated_to = end.0, "follower truncated; fetching");
                            self.update(&key, f.epoch, |e| e.phase = Phase::Fetching);
                        }
                        Ok(Ok(None)) => {}
                        Ok(Err(e)) => {
                            tracing::warn!(partition = %local.name(), error = %e, "truncation failed");
                            self.pause(&key, f.epoch);
                        }
                        Err(e) => {
                            tracing::warn!(partition = %local.name(), error = %e, "truncation task failed");
                            self.pause(&key, f.epoch);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    async fn fetch(&mut self, partitions: Vec<(Key, Followed)>) -> Result<(), tonic::Status> {
        let mut wanted = Vec::with_capacity(partitions.len());
        let mut sent = HashMap::with_capacity(partitions.len());
        for (key, f) in partitions {
            let Some(local) = self.lookup.partition(&key.0, key.1) else {
                self.partitions.lock().remove(&key);
                continue;
            };
            let offset = local.log.log_end_offset();
            wanted.push(ReplicaFetchPartition {
                topic: key.0.clone(),
                topic_id: f.topic_id.clone(),
                partition: key.1,
                leader_epoch: f.epoch.0,
                fetch_offset: offset.as_i64(),
                max_bytes: self.config.partition_max_bytes as u32,
                high_watermark: Some(local.log.high_watermark().as_i64()),
            });
            sent.insert(key, (f, offset, local));
        }
        if wanted.is_empty() {
            return Ok(());
        }
        let mut request = tonic::Request::new(ReplicaFetchRequest {
            replica_id: self.config.broker_id.0,
            max_wait_ms: self.config.max_wait.as_millis() as u32,
            max_bytes: self.config.max_bytes as u32,
            partitions: wanted,
        });
        request.set_timeout(self.config.max_wait + RPC_SLACK);
        let response = self.client.replica_fetch(request).await?.into_inner();
        for p in response.partitions {
            let key = (p.topic.clone(), p.partition);
            let Some((f, offset, local)) = sent.remove(&key) else {
                continue;
            };
            match from_wire(p.error_code) {
                None => {
                    let leader = self.leader;
                    let hw = Offset(p.high_watermark.max(0) as u64);
                    let start = Offset(p.log_start_offset.max(0) as u64);
                    let target = local.clone();
                    let result = tokio::task::spawn_blocking(move || {
                        target.append_as_follower(leader, f.epoch, &p.records, hw, start)
                    })
                    .await
                    .unwrap_or_else(|e| {
                        Err(ReplicaError::new(
                            ErrorCode::UnknownServerError,
                            format!("append task: {e}"),
                        ))
                    });
                    if let Err(e) = result {
                        tracing::warn!(partition = %local.name(), error = %e, "follower append failed; truncating again");
                        self.update(&key, f.epoch, |e| {
                            e.phase = Phase::Truncating { ask: None };
                            e.paused_until = Some(Instant::now() + self.config.backoff);
                        });
                    }
                }
                Some(ErrorCode::OffsetOutOfRange) if p.log_start_offset > offset.as_i64() => {
                    // Fell behind the leader's retention: start over at its log start.
                    let start = Offset(p.log_start_offset as u64);
                    let leader = self.leader;
                    let target = local.clone();
                    tracing::warn!(partition = %local.name(), fetch_offset = offset.0, leader_log_start = start.0, "behind the leader's log start; restarting the log there");
                    let _ = tokio::task::spawn_blocking(move || {
                        target.truncate_as_follower(leader, f.epoch, start, true)
                    })
                    .await;
                }
                Some(ErrorCode::OffsetOutOfRange) => {
                    self.update(&key, f.epoch, |e| e.phase = Phase::Truncating { ask: None });
                }
                Some(code) => {
                    tracing::debug!(partition = %local.name(), %code, message = %p.error_message, "replica fetch refused");
                    self.pause(&key, f.epoch);
                }
            }
        }
        Ok(())
    }
}
