//! One broker's request handling: produce, fetch and list offsets against the partitions it
//! stores, checked against the metadata it follows. No gRPC types here.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::BrokerError;
use super::lease::{LeaderLease, LeaseCheck};
use super::metadata_cache::MetadataCache;
use super::partition_manager::{LocalPartition, PartitionManager};
use super::producer_ids::ProducerIdBlocks;
use crate::controller::model::BrokerState;
use crate::error_code::ErrorCode;
use crate::filter::RecordFilter;
use crate::partition::producer_state::TxnGuard;
use crate::partition::{FetchData, Isolation, LogError, ReadOptions};
use crate::record::control::ControlMarker;
use crate::replication::isr_queue::IsrChangeQueue;
use crate::replication::{IsrChange, Role};
use crate::topic_config::TopicConfig;
use crate::types::{BrokerId, LeaderEpoch, Offset};

/// Longest a write waits for a lapsed lease to be confirmed or given up by a heartbeat.
const LEASE_PENDING_WAIT_MAX: Duration = Duration::from_secs(5);

/// Limits of the broker's request handling.
#[derive(Debug, Clone)]
pub struct BrokerLimits {
    /// Longest a fetch may wait for data.
    pub fetch_wait_max: Duration,
    /// Largest fetch response.
    pub fetch_bytes_max: usize,
    /// Check batch CRCs on consumer fetches (config `verify_crc_on_read`).
    pub verify_crc_on_read: bool,
    /// Label the records/bytes in/out counters with the partition too (config
    /// `metrics_per_partition`).
    pub metrics_per_partition: bool,
}

impl Default for BrokerLimits {
    fn default() -> Self {
        Self {
            fetch_wait_max: Duration::from_secs(30),
            fetch_bytes_max: 50 * 1024 * 1024,
            verify_crc_on_read: false,
            metrics_per_partition: false,
        }
    }
}

/// A follower fetch pass: each partition's read, and the ISR changes the follower's
/// progress calls for.
type ReplicaReads = (Vec<Result<FetchData, BrokerError>>, Vec<Option<IsrChange>>);

/// Why a read gave no answer.
enum ReadFailure {
    /// A cache-only read met bytes not in the page cache.
    NotCached,
    /// A failure to report.
    Broker(BrokerError),
}

impl From<BrokerError> for ReadFailure {
    fn from(e: BrokerError) -> Self {
        Self::Broker(e)
    }
}

/// What a produce to one partition returned.
#[derive(Debug, Clone)]
pub struct Produced {
    /// Offset of the first record; `None` when the batches were scheduled instead.
    pub base_offset: Option<Offset>,
    /// The log start offset after the append.
    pub log_start_offset: Offset,
    /// The ids of the records scheduled instead of appended (batches with scheduling
    /// headers, see [`BatchScheduler`]).
    pub scheduled_ids: Vec<String>,
}

/// Takes client batches whose records carry scheduling headers (`tidelog.delay.ms`,
/// `tidelog.deliver.at.ms`) and schedules them (the durable timers, which sit above this
/// module); returns the scheduled records' ids.
pub trait BatchScheduler: Send + Sync + 'static {
    /// Schedules every record of `batches` for `topic`-`partition`.
    fn schedule_batches(
        &self,
        topic: String,
        partition: u32,
        batches: Vec<u8>,
    ) -> futures_util::future::BoxFuture<'static, Result<Vec<String>, BrokerError>>;
}

/// Answers whether a partition is in a transactional id's open transaction (the
/// transaction coordinator, which sits above this module).
pub trait TxnVerifier: Send + Sync + 'static {
    /// Ok when `topic`-`partition` was added to `transactional_id`'s open transaction of
    /// `producer_id` at `producer_epoch`.
    fn verify(
        &self,
        transactional_id: String,
        producer_id: i64,
        producer_epoch: i16,
        topic: String,
        partition: u32,
    ) -> futures_util::future::BoxFuture<'static, Result<(), BrokerError>>;
}

/// Hears of transaction markers this broker wrote (the group coordinator settles offsets
/// committed inside transactions).
pub trait MarkerObserver: Send + Sync + 'static {
    /// `producer_id`'s marker is on every in-sync replica of `topic`-`partition`.
    fn marker_written(
        &self,
        topic: &str,
        partition: u32,
        producer_id: i64,
        commit: bool,
    ) -> futures_util::future::BoxFuture<'static, ()>;
}

/// How many replicas must hold a produce before it is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acks {
    /// The leader's log (acks=1).
    Leader,
    /// Every in-sync replica: the high watermark passed the records (acks=all, -1).
    All,
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
    /// Only records passing this filter (`None`: every record).
    pub filter: Option<Arc<RecordFilter>>,
    /// An in-sync follower may answer, up to the high watermark it knows (KIP-392).
    pub follower_ok: bool,
    /// Read committed: stop at the last stable offset and return the aborted
    /// transactions overlapping the records.
    pub read_committed: bool,
}

/// Which offset ListOffsets asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffsetQuery {
    /// The log start offset.
    Earliest,
    /// The high watermark (the next offset a consumer will see).
    Latest,
    /// The last stable offset (the end a read-committed consumer sees: before the
    /// earliest open transaction).
    LastStable,
    /// The first offset whose timestamp is at or after this (ms).
    Timestamp(i64),
    /// The first record with the largest timestamp.
    MaxTimestamp,
}

/// One partition of a follower's fetch.
#[derive(Debug, Clone)]
pub struct ReplicaFetchTarget {
    /// Topic.
    pub topic: String,
    /// The topic id the follower stores (a fetch across a delete and re-create of the
    /// same name must not count as progress on the new topic).
    pub topic_id: String,
    /// Partition.
    pub partition: u32,
    /// The leader epoch the follower believes current.
    pub leader_epoch: LeaderEpoch,
    /// The follower's log end.
    pub fetch_offset: u64,
    /// Most bytes for this partition.
    pub max_bytes: usize,
    /// The high watermark the follower knows (None: it did not say).
    pub known_high_watermark: Option<i64>,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A running broker's request handling; cheap to clone (shared state behind `Arc`s).
#[derive(Clone)]
pub struct BrokerNode {
    id: BrokerId,
    metadata: Arc<MetadataCache>,
    partitions: Arc<PartitionManager>,
    limits: BrokerLimits,
    lease: Arc<LeaderLease>,
    isr_changes: Arc<IsrChangeQueue>,
    producer_ids: Arc<ProducerIdBlocks>,
    /// Records and bytes in and out, per topic (or partition).
    traffic: Arc<super::traffic::Traffic>,
    /// Where batches with scheduling headers go, once the timers are set up.
    scheduler: Arc<std::sync::OnceLock<Arc<dyn BatchScheduler>>>,
    txn_verifier: Arc<std::sync::OnceLock<Arc<dyn TxnVerifier>>>,
    marker_observer: Arc<std::sync::OnceLock<Arc<dyn MarkerObserver>>>,
}

impl BrokerNode {
    /// A broker `id` serving `partitions` as `metadata` says. ISR changes its leaders
    /// decide go to `isr_changes`; `lease` says whether it may accept writes; new
    /// idempotent producers get ids from `producer_ids`.
    pub fn new(
        id: BrokerId,
        metadata: Arc<MetadataCache>,
        partitions: Arc<PartitionManager>,
        limits: BrokerLimits,
        lease: Arc<LeaderLease>,
        isr_changes: Arc<IsrChangeQueue>,
        producer_ids: Arc<ProducerIdBlocks>,
    ) -> Self {
        Self {
            id,
            metadata,
            partitions,
            traffic: Arc::new(super::traffic::Traffic::new(limits.metrics_per_partition)),
            limits,
            lease,
            isr_changes,
            producer_ids,
            scheduler: Arc::default(),
            txn_verifier: Arc::default(),
            marker_observer: Arc::default(),
        }
    }

    /// Asks `verifier` before a producer's first transactional batch in a partition. Set
    /// once; later calls are ignored.
    pub fn set_txn_verifier(&self, verifier: Arc<dyn TxnVerifier>) {
        let _ = self.txn_verifier.set(verifier);
    }

    /// Tells `observer` of every transaction marker written here (once, at start-up).
    pub fn set_marker_observer(&self, observer: Arc<dyn MarkerObserver>) {
        let _ = self.marker_observer.set(observer);
    }

    /// Sets who schedules batches with scheduling headers (once, at start-up).
    pub fn set_scheduler(&self, scheduler: Arc<dyn BatchScheduler>) {
        let _ = self.scheduler.set(scheduler);
    }

    /// Producer ids this broker hands out itself.
    pub fn producer_ids(&self) -> &Arc<ProducerIdBlocks> {
        &self.producer_ids
    }

    /// Whether the controllers answered this broker's latest heartbeat.
    pub fn controllers_reachable(&self) -> bool {
        self.lease.controllers_reachable()
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

    /// The local partition if this broker leads it now, with the epoch it leads.
    pub fn leader_partition(
        &self,
        topic: &str,
        partition: u32,
    ) -> Result<(Arc<LocalPartition>, LeaderEpoch), BrokerError> {
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
        let local = self.partitions.get(topic, partition);
        match local.as_ref().and_then(|l| l.leader_epoch()) {
            Some(epoch) if epoch.0 == p.leader_epoch => Ok((local.expect("checked"), epoch)),
            _ => Err(BrokerError::new(
                ErrorCode::NotLeaderOrFollower,
                format!(
                    "{topic}-{partition}: broker {} is taking over leader epoch {} (not ready yet)",
                    self.id, p.leader_epoch
                ),
            )),
        }
    }

    /// The local partition a consumer fetch may read: the leader's; with `follower_ok`
    /// also an in-sync follower's (of the current leader epoch, in the ISR), which
    /// serves up to the high watermark it learnt from the leader (KIP-392). The flag
    /// says whether this broker leads.
    fn readable_partition(
        &self,
        topic: &str,
        partition: u32,
        follower_ok: bool,
    ) -> Result<(Arc<LocalPartition>, bool), BrokerError> {
        let refused = match self.leader_partition(topic, partition) {
            Ok((local, _)) => return Ok((local, true)),
            Err(e) if follower_ok && e.code == ErrorCode::NotLeaderOrFollower => e,
            Err(e) => return Err(e),
        };
        match self.in_sync_follower(topic, partition) {
            Some(local) => Ok((local, false)),
            None => Err(refused),
        }
    }

    /// The local partition when this broker follows it in the ISR, in the current
    /// leader epoch: a follower that may serve consumers (KIP-392).
    pub fn in_sync_follower(&self, topic: &str, partition: u32) -> Option<Arc<LocalPartition>> {
        let (_, p) = self.metadata.partition(topic, partition)?;
        let local = self.partitions.get(topic, partition)?;
        let following = matches!(
            &*local.role(),
            Role::Follower { leader, leader_epoch }
                if Some(*leader) == p.leader && leader_epoch.0 == p.leader_epoch
        );
        (following && p.isr.contains(&self.id)).then_some(local)
    }

    /// The in-sync follower a Kafka consumer in `rack` reading `topic`/`partition` at
    /// `offset` should fetch from (KIP-392's rack-aware selector, for the Kafka listener's
    /// `preferred_read_replica`): None unless this broker leads it, the leader is in
    /// another rack, and an in-sync follower in `rack` can serve `offset` (within the
    /// leader's log start and that follower's last reported log end, as Kafka checks, so
    /// an out-of-range offset is answered here) and is reachable by Kafka clients
    /// (unfenced, with a Kafka listener).
    pub fn preferred_read_replica(
        &self,
        topic: &str,
        partition: u32,
        rack: &str,
        offset: u64,
    ) -> Option<BrokerId> {
        let local = self.partitions.get(topic, partition)?;
        if offset < local.log.log_start_offset().0 {
            return None;
        }
        self.metadata.read(|image| {
            let p = image
                .topics
                .get(topic)?
                .partitions
                .get(partition as usize)?;
            if p.leader != Some(self.id) {
                return None;
            }
            let rack_of = |b: &BrokerId| image.brokers.get(b).and_then(|r| r.rack.as_deref());
            let reachable = |b: &BrokerId| {
                image
                    .brokers
                    .get(b)
                    .is_some_and(|r| r.state == BrokerState::Unfenced && r.kafka_address.is_some())
            };
            let followers = p
                .isr
                .iter()
                .filter(|b| **b != self.id && reachable(b))
                .filter(|b| {
                    local
                        .follower_log_end(**b)
                        .is_some_and(|end| end.0 >= offset)
                })
                .map(|b| (*b, rack_of(b)));
            crate::replication::rack::read_replica(Some(rack), rack_of(&self.id), followers)
        })
    }

    /// The configuration of `topic` (the defaults while it is unknown).
    pub fn topic_config(&self, topic: &str) -> TopicConfig {
        self.metadata
            .topic(topic)
            .and_then(|t| {
                TopicConfig::from_pairs(t.config.iter().map(|(k, v)| (k.as_str(), v.as_str()))).ok()
            })
            .unwrap_or_default()
    }

    /// Appends encoded batches to a partition this broker leads. With [`Acks::All`] it
    /// first checks the ISR against `min.insync.replicas` (writing nothing when it is too
    /// small) and then waits, up to `timeout`, until every in-sync replica holds them.
    pub async fn produce(
        &self,
        topic: &str,
        partition: u32,
        batches: Vec<u8>,
        acks: Acks,
        timeout: Duration,
    ) -> Result<Produced, BrokerError> {
        self.produce_as(topic, partition, batches, acks, timeout, None)
            .await
    }

    /// [`BrokerNode::produce`] for a producer that may write transactional batches:
    /// they need its `transactional_id`, and a producer's first one in this partition
    /// is accepted only once the coordinator confirms the partition is in its open
    /// transaction (Kafka's KIP-890), so no client can open a transaction here that no
    /// coordinator would end.
    pub async fn produce_as(
        &self,
        topic: &str,
        partition: u32,
        mut batches: Vec<u8>,
        acks: Acks,
        timeout: Duration,
        transactional_id: Option<&str>,
    ) -> Result<Produced, BrokerError> {
        // Fail fast on a partition we do not lead; then the lease; then look again, as
        // the metadata may have moved while the lease was confirmed.
        self.leader_partition(topic, partition)?;
        self.wait_for_write_permission(topic, partition, timeout)
            .await?;
        let (local, epoch) = self.leader_partition(topic, partition)?;
        let guards = self
            .verify_transactional(&local, topic, partition, &batches, transactional_id)
            .await?;
        let min_isr = local.log.min_insync_replicas() as usize;
        if acks == Acks::All {
            let isr = local.isr_size(epoch).unwrap_or(0);
            if isr < min_isr {
                return Err(BrokerError::new(
                    ErrorCode::NotEnoughReplicas,
                    format!("{topic}-{partition}: {isr} in-sync replicas, min.insync.replicas is {min_isr}; nothing was written"),
                ));
            }
        }
        // A page-cache write on this task: a hand-off to the blocking pool per produce
        // cost more than the write itself. Only an fsync the flush policy asks for goes
        // to a blocking thread.
        let (info, durable_target) =
            match local.append_as_leader_guarded(&mut batches, epoch, &guards) {
                // Scheduling headers: validation refused the batches before writing anything;
                // the timers take them.
                Err(e) if e.code == ErrorCode::InvalidDelay => {
                    let Some(scheduler) = self.scheduler.get() else {
                        return Err(e.into());
                    };
                    let ids = scheduler
                        .schedule_batches(topic.to_owned(), partition, batches)
                        .await?;
                    return Ok(Produced {
                        base_offset: None,
                        log_start_offset: local.log.log_start_offset(),
                        scheduled_ids: ids,
                    });
                }
                r => r?,
            };
        if !info.duplicate {
            let counters = self.traffic.of(topic, partition);
            counters.records_in.increment(info.record_count);
            counters.bytes_in.increment(batches.len() as u64);
        }
        if let Some(target) = durable_target {
            let replica = local.clone();
            tokio::task::spawn_blocking(move || replica.sync_to(target))
                .await
                .map_err(|e| {
                    BrokerError::new(ErrorCode::UnknownServerError, format!("fsync task: {e}"))
                })??;
        }
        self.partitions.notify_appended();
        if acks == Acks::All {
            local
                .wait_committed(epoch, info.last_offset.plus(1), min_isr, timeout)
                .await?;
        }
        Ok(Produced {
            base_offset: Some(info.first_offset),
            log_start_offset: local.log.log_start_offset(),
            scheduled_ids: Vec::new(),
        })
    }

    /// Checks the transactional batches of a produce (see [`BrokerNode::produce_as`]);
    /// returns the guards the append checks, so that a marker written while the
    /// coordinator was asked makes the append fail rather than open a transaction that
    /// nobody ends.
    async fn verify_transactional(
        &self,
        local: &LocalPartition,
        topic: &str,
        partition: u32,
        batches: &[u8],
        transactional_id: Option<&str>,
    ) -> Result<Vec<TxnGuard>, BrokerError> {
        let mut producers: Vec<(i64, i16)> = crate::record::BatchIter::new(batches)
            .filter_map(Result::ok)
            .map(|b| *b.header())
            .filter(|h| h.is_transactional() && !h.is_control())
            .map(|h| (h.producer_id, h.producer_epoch))
            .collect();
        producers.dedup();
        if producers.is_empty() {
            return Ok(Vec::new());
        }
        let guards: Vec<TxnGuard> = producers
            .iter()
            .map(|(producer_id, _)| local.log.txn_guard(*producer_id))
            .collect();
        let Some(id) = transactional_id.filter(|id| !id.is_empty()) else {
            return Err(BrokerError::new(
                ErrorCode::InvalidRecord,
                format!("{topic}-{partition}: a transactional batch (attribute bit 4) needs the request's transactional_id; only transactional producers write them"),
            ));
        };
        for (producer_id, producer_epoch) in producers {
            if local.log.has_open_transaction(producer_id) {
                continue;
            }
            let verifier = self.txn_verifier.get().ok_or_else(|| {
                BrokerError::new(
                    ErrorCode::InvalidTxnState,
                    "this broker has no transaction coordinator",
                )
            })?;
            verifier
                .verify(
                    id.to_owned(),
                    producer_id,
                    producer_epoch,
                    topic.to_owned(),
                    partition,
                )
                .await?;
        }
        Ok(guards)
    }

    /// Appends the marker ending `producer_id`'s transaction to a partition this broker
    /// leads and waits, up to `timeout`, until every in-sync replica holds it (the
    /// coordinator counts a transaction complete only then).
    pub async fn write_marker(
        &self,
        topic: &str,
        partition: u32,
        producer_id: i64,
        producer_epoch: i16,
        marker: ControlMarker,
        timeout: Duration,
    ) -> Result<(), BrokerError> {
        self.leader_partition(topic, partition)?;
        self.wait_for_write_permission(topic, partition, timeout)
            .await?;
        let (local, epoch) = self.leader_partition(topic, partition)?;
        let min_isr = local.log.min_insync_replicas() as usize;
        let (info, durable_target) =
            local.append_marker_deferred(producer_id, producer_epoch, marker, epoch)?;
        if let Some(target) = durable_target {
            let replica = local.clone();
            tokio::task::spawn_blocking(move || replica.sync_to(target))
                .await
                .map_err(|e| {
                    BrokerError::new(ErrorCode::UnknownServerError, format!("fsync task: {e}"))
                })??;
        }
        self.partitions.notify_appended();
        local
            .wait_committed(epoch, info.last_offset.plus(1), min_isr, timeout)
            .await?;
        if let Some(observer) = self.marker_observer.get() {
            observer
                .marker_written(topic, partition, producer_id, marker.commit)
                .await;
        }
        Ok(())
    }

    /// Counts records and bytes a consumer fetch sends.
    fn count_out(&self, targets: &[FetchTarget], results: &[Result<FetchData, BrokerError>]) {
        for (target, result) in targets.iter().zip(results) {
            let Ok(data) = result else { continue };
            if data.records.is_empty() {
                continue;
            }
            let counters = self.traffic.of(&target.topic, target.partition);
            counters
                .records_out
                .increment(crate::record::count_records(&data.records));
            counters.bytes_out.increment(data.records.len() as u64);
        }
    }

    /// Waits (at most `timeout`, and never longer than [`LEASE_PENDING_WAIT_MAX`]) until
    /// the lease allows writes; see [`LeaderLease`].
    async fn wait_for_write_permission(
        &self,
        topic: &str,
        partition: u32,
        timeout: Duration,
    ) -> Result<(), BrokerError> {
        let deadline = tokio::time::Instant::now() + timeout.min(LEASE_PENDING_WAIT_MAX);
        loop {
            let changed = self.lease.changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let why = match self.lease.check(self.metadata.version()) {
                LeaseCheck::Granted => return Ok(()),
                LeaseCheck::Refused(why) => why,
                LeaseCheck::Pending => {
                    if tokio::time::timeout_at(deadline, changed).await.is_ok() {
                        continue;
                    }
                    "this broker's session with the controllers lapsed and is not confirmed yet"
                        .to_owned()
                }
            };
            return Err(BrokerError::new(
                ErrorCode::NotLeaderOrFollower,
                format!("{topic}-{partition}: {why}; refusing writes"),
            ));
        }
    }

    /// Reads one target; `None` when `cached_only` and its bytes are not in the page cache.
    fn read_one(
        &self,
        target: &FetchTarget,
        cached_only: bool,
    ) -> Option<Result<FetchData, BrokerError>> {
        match self.read_one_inner(target, cached_only) {
            Err(ReadFailure::NotCached) => None,
            Err(ReadFailure::Broker(e)) => Some(Err(e)),
            Ok(data) => Some(Ok(data)),
        }
    }

    fn read_one_inner(
        &self,
        target: &FetchTarget,
        cached_only: bool,
    ) -> Result<FetchData, ReadFailure> {
        let (local, leads) =
            self.readable_partition(&target.topic, target.partition, target.follower_ok)?;
        let hw = local.log.high_watermark();
        let end = local.log.log_end_offset();
        let start = local.log.log_start_offset();
        if target.offset < start.0 {
            // Checked before a state-only answer too, as Kafka does, so a consumer below
            // the log start is told even when the budget is spent or it is redirected.
            return Err(ReadFailure::Broker(BrokerError::new(
                ErrorCode::OffsetOutOfRange,
                format!(
                    "{}: offset {} is below the log start {}",
                    local.name(),
                    target.offset,
                    start.0
                ),
            )));
        }
        if target.offset > end.0 {
            let error = if leads {
                BrokerError::new(
                    ErrorCode::OffsetOutOfRange,
                    format!(
                        "{}: offset {} is beyond the log end {} (high watermark {}, log start {})",
                        local.name(),
                        target.offset,
                        end.0,
                        hw.0,
                        local.log.log_start_offset().0
                    ),
                )
            } else {
                // Beyond this follower's log (the consumer read further at the leader):
                // the leader answers that, be it records or OFFSET_OUT_OF_RANGE. Between
                // the high watermark and the log end a follower is only a round trip
                // behind: the fetch waits, as at the log end.
                BrokerError::new(
                    ErrorCode::NotLeaderOrFollower,
                    format!(
                        "{}: follower {} holds records up to {} only, not offset {}; fetch from the leader",
                        local.name(),
                        self.id,
                        end.0,
                        target.offset
                    ),
                )
            };
            return Err(ReadFailure::Broker(error));
        }
        let isolation = if target.read_committed {
            Isolation::Committed
        } else {
            Isolation::HighWatermark
        };
        let stable = if target.read_committed {
            local.log.last_stable_offset()
        } else {
            hw
        };
        if target.offset >= stable.0 || target.max_bytes == 0 {
            // The partition's state only: nothing committed there yet (a consumer waiting
            // at the end, or a new leader whose high watermark has not caught up with the
            // old one's), or the response budget went to earlier partitions.
            return Ok(FetchData::empty(hw, start, end, stable));
        }
        let read = match target.filter.as_deref() {
            // Filtered reads go to a blocking thread: they may read many batches.
            Some(_) if cached_only => return Err(ReadFailure::NotCached),
            Some(filter) => {
                local
                    .log
                    .read_filtered(Offset(target.offset), target.max_bytes, isolation, filter)
            }
            None => local.log.read_with(
                Offset(target.offset),
                target.max_bytes,
                isolation,
                ReadOptions {
                    verify_crc: self.limits.verify_crc_on_read,
                    cached_only,
                },
            ),
        };
        read.map_err(|e| match e {
            LogError::NotCached => ReadFailure::NotCached,
            e => ReadFailure::Broker(BrokerError::from_log(&local.name(), e)),
        })
    }

    /// Reads every target in order within one response budget of `max_bytes` (each
    /// partition's own limit applies too). As in Kafka (KIP-74), only a partition reached
    /// with budget left returns at least one whole batch, even past the budget; once the
    /// budget is spent the rest return no records (callers rotate the order, so every
    /// partition gets its turn).
    /// `None` when `cached_only` and some bytes are not in the page cache.
    fn read_all(
        &self,
        targets: &[FetchTarget],
        max_bytes: usize,
        cached_only: bool,
    ) -> Option<Vec<Result<FetchData, BrokerError>>> {
        let mut budget = max_bytes;
        targets
            .iter()
            .map(|t| {
                let mut t = t.clone();
                // 0 once spent (`max_bytes` is at least 1, so the first always reads).
                t.max_bytes = t.max_bytes.min(budget);
                let r = self.read_one(&t, cached_only)?;
                if let Ok(d) = &r {
                    budget = budget.saturating_sub(d.records.len());
                }
                Some(r)
            })
            .collect()
    }

    /// [`BrokerNode::read_all`] on this task when everything is in the page cache (the
    /// common case: a copy, cheaper than a thread hand-off), else on a blocking thread so
    /// a disk read never stalls other requests.
    async fn read_all_fast(
        &self,
        targets: &[FetchTarget],
        max_bytes: usize,
    ) -> Vec<Result<FetchData, BrokerError>> {
        match self.read_all(targets, max_bytes, true) {
            Some(results) => results,
            None => self.read_all_blocking(targets, max_bytes).await,
        }
    }

    /// Reads each target; waits up to `max_wait` until `min_bytes` are available in total
    /// (`min_bytes` 0 answers at once, as in Kafka), and counts what it returns in the
    /// traffic metrics.
    ///
    /// A filtered target that finds nothing moves on: the next pass reads from where the
    /// filter got to, and every answer for it carries its `next_offset`.
    pub async fn fetch(
        &self,
        targets: Vec<FetchTarget>,
        max_wait: Duration,
        min_bytes: usize,
        max_bytes: usize,
    ) -> Vec<Result<FetchData, BrokerError>> {
        self.fetch_inner(targets, max_wait, (min_bytes, max_bytes), true)
            .await
    }

    /// [`BrokerNode::fetch`] without counting: a push session sends part of what it reads
    /// and counts that itself ([`BrokerNode::count_pushed`]).
    pub async fn fetch_for_push(
        &self,
        targets: Vec<FetchTarget>,
        max_wait: Duration,
        max_bytes: usize,
    ) -> Vec<Result<FetchData, BrokerError>> {
        self.fetch_inner(targets, max_wait, (1, max_bytes), false)
            .await
    }

    /// Counts records and bytes a push session sent for one partition.
    pub fn count_pushed(&self, topic: &str, partition: u32, records: u64, bytes: u64) {
        let counters = self.traffic.of(topic, partition);
        counters.records_out.increment(records);
        counters.bytes_out.increment(bytes);
    }

    async fn fetch_inner(
        &self,
        mut targets: Vec<FetchTarget>,
        max_wait: Duration,
        (min_bytes, max_bytes): (usize, usize),
        count: bool,
    ) -> Vec<Result<FetchData, BrokerError>> {
        let deadline = Instant::now() + max_wait.min(self.limits.fetch_wait_max);
        let max_bytes = max_bytes.clamp(1, self.limits.fetch_bytes_max);
        loop {
            // Subscribed before reading, so an advance during the read is not missed.
            // Each partition wakes only the fetches that name it.
            let mut changes: Vec<_> = targets
                .iter()
                .filter_map(|t| self.partitions.get(&t.topic, t.partition))
                .map(|lp| lp.subscribe())
                .collect();
            let mut results = self.read_all_fast(&targets, max_bytes).await;
            for (target, result) in targets.iter_mut().zip(&mut results) {
                if let (Some(_), Ok(data)) = (&target.filter, result) {
                    let next = data
                        .next_offset
                        .map_or(target.offset, |n| n.0.max(target.offset));
                    data.next_offset = Some(Offset(next));
                    // Only a pass that found nothing moves on: records found are answered
                    // (a later pass would read past them).
                    if data.records.is_empty() {
                        target.offset = next;
                    }
                }
            }
            let total: usize = results
                .iter()
                .map(|r| r.as_ref().map_or(0, |d| d.records.len()))
                .sum();
            let any_error = results.iter().any(Result::is_err);
            if total >= min_bytes || any_error || changes.is_empty() || Instant::now() >= deadline {
                if count {
                    self.count_out(&targets, &results);
                }
                return results;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let any_change =
                futures_util::future::select_all(changes.iter_mut().map(|c| Box::pin(c.changed())));
            let _ = tokio::time::timeout(left, any_change).await;
        }
    }

    /// [`BrokerNode::read_all`] on a blocking thread: one hand-off per fetch pass, not per
    /// partition. Reads hit the page cache almost always; the blocking thread keeps a cold
    /// read from stalling other requests.
    async fn read_all_blocking(
        &self,
        targets: &[FetchTarget],
        max_bytes: usize,
    ) -> Vec<Result<FetchData, BrokerError>> {
        let this = self.clone();
        let batch = targets.to_vec();
        tokio::task::spawn_blocking(move || {
            this.read_all(&batch, max_bytes, false)
                .expect("reads that may wait always answer")
        })
        .await
        .unwrap_or_else(|e| {
            let error = BrokerError::new(ErrorCode::UnknownServerError, format!("read task: {e}"));
            vec![Err(error); targets.len()]
        })
    }

    /// Serves a follower's fetch: records each partition's fetch offset as the follower's
    /// progress (which may advance the high watermark or call for an ISR expansion), and
    /// reads up to the log end. Waits up to `max_wait` when there is nothing new, unless
    /// a partition's high watermark is above the one the follower knows: then it answers
    /// at once, so a follower (and consumers reading from it, KIP-392) learns it even on
    /// a quiet partition (Kafka's fetch-session rule).
    pub async fn replica_fetch(
        &self,
        follower: BrokerId,
        targets: Vec<ReplicaFetchTarget>,
        max_wait: Duration,
        max_bytes: usize,
    ) -> Vec<Result<FetchData, BrokerError>> {
        let deadline = Instant::now() + max_wait.min(self.limits.fetch_wait_max);
        let max_bytes = max_bytes.clamp(1, self.limits.fetch_bytes_max);
        let mut appended = self.partitions.subscribe_appends();
        loop {
            appended.borrow_and_update();
            // On this task when the bytes are in the page cache (recording the follower's
            // progress twice, if a cold read sends the pass to a blocking thread, is
            // harmless: the same offset again).
            let (results, changes) =
                match self.replica_read_all(follower, &targets, max_bytes, true) {
                    Some(read) => read,
                    None => {
                        let this = self.clone();
                        let batch = targets.clone();
                        tokio::task::spawn_blocking(move || {
                            this.replica_read_all(follower, &batch, max_bytes, false)
                                .expect("reads that may wait always answer")
                        })
                        .await
                        .unwrap_or_else(|e| {
                            let error = BrokerError::new(
                                ErrorCode::UnknownServerError,
                                format!("read task: {e}"),
                            );
                            (vec![Err(error); targets.len()], Vec::new())
                        })
                    }
                };
            // (A high watermark this moved wakes waiting consumers by itself.)
            for change in changes.into_iter().flatten() {
                self.isr_changes.push(change);
            }
            let total: usize = results
                .iter()
                .map(|r| r.as_ref().map_or(1, |d| d.records.len()))
                .sum();
            let news = results.iter().zip(&targets).any(|(r, t)| {
                r.as_ref().is_ok_and(|d| {
                    t.known_high_watermark
                        .is_some_and(|known| d.high_watermark.as_i64() > known)
                })
            });
            if total > 0 || news || Instant::now() >= deadline {
                return results;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left, appended.changed()).await;
        }
    }

    #[allow(clippy::type_complexity)]
    fn replica_read_all(
        &self,
        follower: BrokerId,
        targets: &[ReplicaFetchTarget],
        max_bytes: usize,
        cached_only: bool,
    ) -> Option<ReplicaReads> {
        let mut budget = max_bytes;
        let mut changes = Vec::new();
        let mut not_cached = false;
        let results = targets
            .iter()
            .map(|t| {
                let Some(local) = self.partitions.get(&t.topic, t.partition) else {
                    return Err(BrokerError::new(
                        ErrorCode::NotLeaderOrFollower,
                        format!(
                            "{}-{}: not stored on broker {}",
                            t.topic, t.partition, self.id
                        ),
                    ));
                };
                if t.topic_id != local.topic_id {
                    return Err(BrokerError::new(
                        ErrorCode::InconsistentTopicId,
                        format!(
                            "{}: the follower fetches topic id '{}', broker {} stores '{}'",
                            local.name(),
                            t.topic_id,
                            self.id,
                            local.topic_id
                        ),
                    ));
                }
                let end = local.log.log_end_offset();
                let start = local.log.log_start_offset();
                if t.fetch_offset > end.0 || t.fetch_offset < start.0 {
                    local.check_follower_fetch(follower, t.leader_epoch)?;
                    return Err(BrokerError::new(
                        ErrorCode::OffsetOutOfRange,
                        format!(
                            "{}: fetch offset {} is outside the leader's log [{}, {}]",
                            local.name(),
                            t.fetch_offset,
                            start.0,
                            end.0
                        ),
                    ));
                }
                let change = local.record_follower_fetch(
                    follower,
                    t.leader_epoch,
                    Offset(t.fetch_offset),
                    now_ms(),
                )?;
                changes.push(change);
                let data = if t.fetch_offset == end.0 {
                    {
                        let hw = local.log.high_watermark();
                        FetchData::empty(hw, start, end, hw)
                    }
                } else {
                    let (offset, max) = (Offset(t.fetch_offset), t.max_bytes.min(budget).max(1));
                    // Followers always get CRC-checked batches: corruption is found at
                    // the leader, not spread.
                    let options = ReadOptions {
                        verify_crc: true,
                        cached_only,
                    };
                    let read = local.log.read_with(offset, max, Isolation::LogEnd, options);
                    match read {
                        Err(LogError::NotCached) => {
                            not_cached = true;
                            {
                                let hw = local.log.high_watermark();
                                FetchData::empty(hw, start, end, hw)
                            }
                        }
                        r => r.map_err(|e| BrokerError::from_log(&local.name(), e))?,
                    }
                };
                budget = budget.saturating_sub(data.records.len());
                Ok(data)
            })
            .collect();
        (!not_cached).then_some((results, changes))
    }

    /// Where `epoch` ends in the log of a partition this broker leads in `current_epoch`
    /// (OffsetsForLeaderEpoch): the largest epoch `<= epoch` the log holds, and its end.
    pub fn epoch_end_offset(
        &self,
        follower: BrokerId,
        topic: &str,
        partition: u32,
        current_epoch: LeaderEpoch,
        epoch: LeaderEpoch,
    ) -> Result<Option<(LeaderEpoch, Offset)>, BrokerError> {
        let Some(local) = self.partitions.get(topic, partition) else {
            return Err(BrokerError::new(
                ErrorCode::NotLeaderOrFollower,
                format!("{topic}-{partition}: not stored on broker {}", self.id),
            ));
        };
        local.check_follower_fetch(follower, current_epoch)?;
        Ok(local.log.end_offset_for_epoch(epoch))
    }

    /// Earliest, latest or by-timestamp offset of a partition this broker leads.
    pub async fn list_offset(
        &self,
        topic: &str,
        partition: u32,
        query: OffsetQuery,
    ) -> Result<(i64, i64), BrokerError> {
        let (local, _) = self.leader_partition(topic, partition)?;
        match query {
            OffsetQuery::Earliest => Ok((local.log.log_start_offset().as_i64(), -1)),
            OffsetQuery::Latest => Ok((local.log.high_watermark().as_i64(), -1)),
            OffsetQuery::LastStable => Ok((local.log.last_stable_offset().as_i64(), -1)),
            OffsetQuery::MaxTimestamp | OffsetQuery::Timestamp(_) => {
                // Both read the segments' time indexes: off the async threads.
                tokio::task::spawn_blocking(move || {
                    let found = match query {
                        OffsetQuery::Timestamp(ts) => local.log.offset_for_timestamp(ts).map(|o| {
                            o.filter(|o| *o < local.log.high_watermark())
                                .map(|o| (o, ts))
                        }),
                        _ => local.log.offset_of_max_timestamp(),
                    };
                    match found {
                        Ok(Some((o, ts))) => Ok((o.as_i64(), ts)),
                        Ok(None) => Ok((-1, -1)),
                        Err(e) => Err(BrokerError::from_log(&local.name(), e)),
                    }
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
