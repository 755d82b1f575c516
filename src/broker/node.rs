//! One broker's request handling: produce, fetch and list offsets against the partitions it
//! stores, checked against the metadata it follows. No gRPC types here.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::BrokerError;
use super::metadata_cache::MetadataCache;
use super::partition_manager::{LocalPartition, PartitionManager};
use crate::error_code::ErrorCode;
use crate::partition::{FetchData, Isolation};
use crate::types::{BrokerId, LeaderEpoch, Offset};

/// Limits of the broker's request handling.
#[derive(Debug, Clone)]
pub struct BrokerLimits {
    /// Longest a fetch may wait for data.
    pub fetch_wait_max: Duration,
    /// Largest fetch response.
    pub fetch_bytes_max: usize,
}

impl Default for BrokerLimits {
    fn default() -> Self {
        Self {
            fetch_wait_max: Duration::from_secs(30),
            fetch_bytes_max: 50 * 1024 * 1024,
        }
    }
}

/// What a produce to one partition returned.
#[derive(Debug, Clone, Copy)]
pub struct Produced {
    /// Offset of the first record.
    pub base_offset: Offset,
    /// The log start offset after the append.
    pub log_start_offset: Offset,
}

/// One partition of a fetch.
#[derive(Debug, Clone)]
pub struct FetchTarget {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: u32,
    /// First offset wanted.
    pub offset: u64,
    /// Most bytes for this partition.
    pub max_bytes: usize,
}

/// Which offset ListOffsets asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffsetQuery {
    /// The log start offset.
    Earliest,
    /// The high watermark (the next offset a consumer will see).
    Latest,
    /// The first offset whose timestamp is at or after this (ms).
    Timestamp(i64),
}

/// A running broker's request handling; cheap to clone (shared state behind `Arc`s).
#[derive(Clone)]
pub struct BrokerNode {
    id: BrokerId,
    metadata: Arc<MetadataCache>,
    partitions: Arc<PartitionManager>,
    limits: BrokerLimits,
}

impl BrokerNode {
    /// A broker `id` serving `partitions` as `metadata` says.
    pub fn new(
        id: BrokerId,
        metadata: Arc<MetadataCache>,
        partitions: Arc<PartitionManager>,
        limits: BrokerLimits,
    ) -> Self {
        Self {
            id,
            metadata,
            partitions,
            limits,
        }
    }

    /// This broker's id.
    pub fn id(&self) -> BrokerId {
        self.id
    }

    /// The metadata this broker follows.
    pub fn metadata(&self) -> &Arc<MetadataCache> {
        &self.metadata
    }

    /// The partitions stored here.
    pub fn partitions(&self) -> &Arc<PartitionManager> {
        &self.partitions
    }

    /// The local partition if this broker leads it now, with the leader epoch.
    pub fn leader_partition(
        &self,
        topic: &str,
        partition: u32,
    ) -> Result<(Arc<LocalPartition>, LeaderEpoch, usize), BrokerError> {
        let Some((_, p)) = self.metadata.partition(topic, partition) else {
            let message = match self.metadata.topic(topic) {
                Some(t) => format!(
                    "topic '{topic}' has {} partitions; there is no partition {partition}",
                    t.partitions.len()
                ),
                None => format!("topic '{topic}' does not exist"),
            };
            return Err(BrokerError::new(
                ErrorCode::UnknownTopicOrPartition,
                message,
            ));
        };
        if p.leader != Some(self.id) {
            let mut e = BrokerError::new(
                ErrorCode::NotLeaderOrFollower,
                match p.leader {
                    Some(l) => format!(
                        "broker {} does not lead {topic}-{partition}; broker {l} does",
                        self.id
                    ),
                    None => format!("{topic}-{partition} has no leader right now"),
                },
            );
            e.leader = p
                .leader
                .and_then(|l| Some((l, self.metadata.broker_address(l)?)));
            return Err(e);
        }
        let Some(local) = self.partitions.get(topic, partition) else {
            return Err(BrokerError::new(
                ErrorCode::NotLeaderOrFollower,
                format!("{topic}-{partition} is not open on broker {} yet", self.id),
            ));
        };
        Ok((local, LeaderEpoch(p.leader_epoch), p.isr.len()))
    }

    /// Appends encoded batches to a partition this broker leads.
    pub async fn produce(
        &self,
        topic: &str,
        partition: u32,
        mut batches: Vec<u8>,
    ) -> Result<Produced, BrokerError> {
        let (local, epoch, isr_len) = self.leader_partition(topic, partition)?;
        let partitions = self.partitions.clone();
        let result = tokio::task::spawn_blocking(move || {
            let info = local.log.append_as_leader(&mut batches, epoch);
            let info = info.map_err(|e| BrokerError::from_log(&local.name(), e))?;
            if isr_len <= 1 {
                partitions.advance_single_replica_high_watermark(&local);
            }
            Ok(Produced {
                base_offset: info.first_offset,
                log_start_offset: local.log.log_start_offset(),
            })
        })
        .await
        .map_err(|e| {
            BrokerError::new(ErrorCode::UnknownServerError, format!("append task: {e}"))
        })?;
        if result.is_ok() {
            self.partitions.notify_appended();
        }
        result
    }

    fn read_one(&self, target: &FetchTarget) -> Result<FetchData, BrokerError> {
        let (local, _, _) = self.leader_partition(&target.topic, target.partition)?;
        let hw = local.log.high_watermark();
        if target.offset == hw.0 {
            // Nothing new yet: not an error (a consumer waiting at the end).
            return Ok(FetchData {
                records: bytes::Bytes::new(),
                high_watermark: hw,
                log_start_offset: local.log.log_start_offset(),
                log_end_offset: local.log.log_end_offset(),
            });
        }
        if target.offset > hw.0 {
            return Err(BrokerError::new(
                ErrorCode::OffsetOutOfRange,
                format!(
                    "{}: offset {} is beyond the high watermark {} (log start {})",
                    local.name(),
                    target.offset,
                    hw.0,
                    local.log.log_start_offset().0
                ),
            ));
        }
        local
            .log
            .read(
                Offset(target.offset),
                target.max_bytes,
                Isolation::HighWatermark,
            )
            .map_err(|e| BrokerError::from_log(&local.name(), e))
    }

    /// Reads each target; waits up to `max_wait` until `min_bytes` are available in total.
    pub async fn fetch(
        &self,
        targets: Vec<FetchTarget>,
        max_wait: Duration,
        min_bytes: usize,
        max_bytes: usize,
    ) -> Vec<Result<FetchData, BrokerError>> {
        let deadline = Instant::now() + max_wait.min(self.limits.fetch_wait_max);
        let max_bytes = max_bytes.clamp(1, self.limits.fetch_bytes_max);
        let mut appended = self.partitions.subscribe_appends();
        loop {
            appended.borrow_and_update();
            let mut budget = max_bytes;
            let mut results = Vec::with_capacity(targets.len());
            let mut total = 0usize;
            let mut any_error = false;
            for t in &targets {
                let mut t = t.clone();
                t.max_bytes = t.max_bytes.min(budget).max(1);
                let r = self.read_blocking(t).await;
                match &r {
                    Ok(d) => {
                        total += d.records.len();
                        budget = budget.saturating_sub(d.records.len());
                    }
                    Err(_) => any_error = true,
                }
                results.push(r);
            }
            if total >= min_bytes.max(1) || any_error || Instant::now() >= deadline {
                return results;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left, appended.changed()).await;
        }
    }

    async fn read_blocking(&self, target: FetchTarget) -> Result<FetchData, BrokerError> {
        // Reads hit the page cache almost always; a blocking thread keeps a cold read
        // from stalling other requests.
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.read_one(&target))
            .await
            .unwrap_or_else(|e| {
                Err(BrokerError::new(
                    ErrorCode::UnknownServerError,
                    format!("read task: {e}"),
                ))
            })
    }

    /// Earliest, latest or by-timestamp offset of a partition this broker leads.
    pub async fn list_offset(
        &self,
        topic: &str,
        partition: u32,
        query: OffsetQuery,
    ) -> Result<(i64, i64), BrokerError> {
        let (local, _, _) = self.leader_partition(topic, partition)?;
        match query {
            OffsetQuery::Earliest => Ok((local.log.log_start_offset().as_i64(), -1)),
            OffsetQuery::Latest => Ok((local.log.high_watermark().as_i64(), -1)),
            OffsetQuery::Timestamp(ts) => {
                tokio::task::spawn_blocking(move || match local.log.offset_for_timestamp(ts) {
                    Ok(Some(o)) if o < local.log.high_watermark() => Ok((o.as_i64(), ts)),
                    Ok(_) => Ok((-1, -1)),
                    Err(e) => Err(BrokerError::from_log(&local.name(), e)),
                })
                .await
                .unwrap_or_else(|e| {
                    Err(BrokerError::new(
                        ErrorCode::UnknownServerError,
                        format!("lookup task: {e}"),
                    ))
                })
            }
        }
    }
}
