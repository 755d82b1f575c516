//! The producer: records are encoded into per-partition batches by the
//! [`super::accumulator`] as they are sent (`batch_size`, `linger`, `buffer_memory`), and
//! one sender task sends ready batches, grouped per leader into one produce request of
//! many partitions, with acks, at most one batch in flight per partition (so retries never
//! reorder a partition), a bound on batches in flight overall, retries of retriable errors
//! after a metadata refresh, and the partitioners of [`super::partitioner`].
//!
//! Send modes, as RocketMQ names them: [`Producer::send_sync`] waits for the
//! acknowledgement; [`Producer::send`] (async) returns a [`RecordFuture`] of it, and
//! [`Producer::send_with_callback`] calls a closure with it; [`Producer::send_oneway`]
//! fires and forgets (batches holding only oneway records go with acks=0).
//!
//! The hot path of `send` does not await when the topic's metadata is cached and the
//! buffer has room: it picks the partition, reserves the record's bytes and appends it to
//! the partition's open batch under a short lock. The record's future is its batch's one
//! completion plus its index in the batch.
//!
//! Idempotence (on by default, for acks 1 and all): the producer gets a producer id from
//! the cluster and numbers each partition's records when their batch is drained; a
//! retried batch is resent byte for byte with the same numbers, so the leader recognises a
//! batch it already holds and answers with its original offsets instead of writing it
//! twice. With one batch in flight per partition, retries never reorder either: the next
//! batch of a partition is drained only after the previous one is acknowledged or has
//! finally failed. When a batch finally fails (its outcome unknown), the producer takes a
//! new producer id, so later batches start a fresh sequence.
//!
//! Fault avoidance (on by default, [`super::fault`]): records that may go to any partition
//! (no key, no explicit partition, no selector) skip partitions led by a broker whose
//! requests recently failed or stalled, and such records' batches still queued for those
//! partitions move to a partition led by another broker. A batch already sent stays on
//! its partition when idempotent (retried byte for byte, so never written twice); without
//! idempotence, where a retry may duplicate anyway, a failed one is retried on another
//! broker's partition (RocketMQ's `retryAnotherBrokerWhenNotStoreOK`). Keyed records keep
//! their partition and wait for it.
//!
//! Why not Kafka's five in flight per partition: produce requests are gRPC calls, which a
//! server runs concurrently, so two in flight for a partition may be appended in either
//! order; and a leader accepts any first sequence from a producer id it does not know.
//! Together, a later batch could be written while the earlier one is refused — a reorder
//! that sequence numbers alone cannot prevent here.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::task::JoinSet;

use super::accumulator::{
    self, record_size_bound, Accumulator, AccumulatorConfig, BatchResult, DrainedBatch,
};
use super::admin::AdminClient;
use super::cluster::Cluster;
use super::error::ClientError;
use super::fault::{self, FaultTracker, Outcome};
use super::group_consumer::GroupMetadata;
use super::groups::GroupsAdmin;
use super::partitioner::{Partitioner, Partitioning};
use super::transactions::{CheckVerdict, TransactionCheck, TransactionChecker, TxnClient};
use crate::api::proto::txn_check_answer;
use crate::api::proto::{
    CommittedOffset, PartitionProduceData, ProduceRequest, ProduceResponse, TopicProduceData,
    TxnCheckAnswer, TxnCheckOutcome, TxnCheckVerdict,
};
use crate::error_code::ErrorCode;
use crate::record::tag::{check_tag, TAG_HEADER};
use crate::record::{BatchBuilder, Compression, RecordRef};
use crate::topic_config::TopicConfig;

mod schedule;
pub use schedule::{Due, Scheduled};

/// Partitions one produce request may name (the broker's limit).
const PARTITIONS_PER_REQUEST_MAX: usize = 1_000;

/// Producer settings (Kafka's names in snake case).
#[derive(Debug, Clone)]
pub struct ProducerConfig {
    /// 0, 1 or -1 (all).
    pub acks: i32,
    /// A partition's batch is sent once it holds this many bytes.
    pub batch_size: usize,
    /// While a partition's request is in flight, its open batch keeps filling up to this
    /// many bytes instead of queueing batches of `batch_size` behind it (never beyond
    /// `max_request_size`, nor 7/8 of the topic's `max.message.bytes`), so one partition
    /// moves a large batch per round trip. At most `batch_size` disables it.
    pub batch_size_max: usize,
    /// ... or once its oldest record waited this long.
    pub linger: Duration,
    /// Batches in flight over all partitions (each partition has at most one).
    pub max_in_flight: usize,
    /// Retries of a batch on retriable errors.
    pub retries: u32,
    /// Pause between retries.
    pub retry_backoff: Duration,
    /// A record fails once it could not be delivered within this time.
    pub delivery_timeout: Duration,
    /// How records without a partition are spread.
    pub partitioning: Partitioning,
    /// Compression of each batch.
    pub compression: Compression,
    /// Idempotent producing (no duplicates from retries); ignored with acks=0.
    pub enable_idempotence: bool,
    /// How long one produce attempt may take before it is retried.
    pub request_timeout: Duration,
    /// Picks the partition of records without one (instead of `partitioning`).
    pub partition_selector: Option<PartitionSelector>,
    /// Bytes that records waiting to be sent or acknowledged may hold; `send` waits
    /// (backpressure) while they would exceed it (Kafka's `buffer.memory`).
    pub buffer_memory: usize,
    /// Largest produce request in bytes of batches (Kafka's `max.request.size`); a batch
    /// larger than this goes alone.
    pub max_request_size: usize,
    /// Records that may go to any partition avoid brokers whose requests recently failed
    /// or stalled (RocketMQ's `sendLatencyFaultEnable`; see [`super::fault`]).
    pub fault_avoidance: bool,
    /// Kafka's `transactional.id`: the producer writes in transactions
    /// ([`Producer::init_transactions`], [`Producer::begin_transaction`],
    /// [`Producer::commit_transaction`]); a new instance with the same id fences this one.
    pub transactional_id: Option<String>,
    /// An open transaction is aborted by the coordinator after this long (Kafka's
    /// `transaction.timeout.ms`).
    pub transaction_timeout: Duration,
}

/// A custom partition selector: given the record and the partition count, the partition.
#[derive(Clone)]
pub struct PartitionSelector(pub Arc<SelectPartition>);

/// The function behind a [`PartitionSelector`].
pub type SelectPartition = dyn Fn(&ProducerRecord, u32) -> u32 + Send + Sync;

impl std::fmt::Debug for PartitionSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PartitionSelector(..)")
    }
}

impl PartitionSelector {
    /// A selector from a closure.
    pub fn new(f: impl Fn(&ProducerRecord, u32) -> u32 + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }
}

impl Default for ProducerConfig {
    fn default() -> Self {
        Self {
            acks: -1,
            batch_size: 16 * 1024,
            batch_size_max: 1024 * 1024,
            linger: Duration::from_millis(5),
            max_in_flight: 16,
            retries: u32::MAX,
            retry_backoff: Duration::from_millis(100),
            delivery_timeout: Duration::from_secs(120),
            partitioning: Partitioning::Sticky,
            compression: Compression::None,
            enable_idempotence: true,
            request_timeout: Duration::from_secs(30),
            partition_selector: None,
            buffer_memory: 32 * 1024 * 1024,
            max_request_size: 1024 * 1024,
            fault_avoidance: true,
            transactional_id: None,
            transaction_timeout: Duration::from_secs(60),
        }
    }
}

/// A record to send.
#[derive(Debug, Clone, Default)]
pub struct ProducerRecord {
    /// Topic.
    pub topic: String,
    /// Explicit partition, or None for the partitioner.
    pub partition: Option<u32>,
    /// Key (None: null).
    pub key: Option<Bytes>,
    /// Value (None: null).
    pub value: Option<Bytes>,
    /// Headers.
    pub headers: Vec<(String, Option<Bytes>)>,
    /// The record's tag (for tag filters), stored as the `tidelog.tag` header.
    pub tag: Option<String>,
    /// Timestamp (ms); now when None.
    pub timestamp_ms: Option<i64>,
}

/// Where an acknowledged record landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordMetadata {
    /// Partition.
    pub partition: u32,
    /// Offset (-1 with acks=0).
    pub offset: i64,
}

/// The future outcome of one sent record: its batch's completion and its index in it.
///
/// `Unpin` and allocation-free: waiting registers the task's waker with the batch.
#[derive(Debug)]
pub struct RecordFuture {
    state: RecordState,
}

#[derive(Debug)]
enum RecordState {
    Batch {
        batch: Arc<BatchResult>,
        index: u32,
        registered: Option<Waker>,
    },
    Failed(ClientError),
}

impl RecordFuture {
    fn failed(e: ClientError) -> Self {
        Self {
            state: RecordState::Failed(e),
        }
    }

    /// The outcome if it is known now, without waiting.
    pub fn try_result(&self) -> Option<Result<RecordMetadata, ClientError>> {
        match &self.state {
            RecordState::Failed(e) => Some(Err(e.clone())),
            RecordState::Batch { batch, index, .. } => batch
                .outcome()
                .map(|o| metadata(&o.result, *index, batch.partition())),
        }
    }

    /// When the outcome arrived (None while pending, or when the record never joined a
    /// batch): lets a caller measure latency without waiting on every record.
    pub fn completed_at(&self) -> Option<Instant> {
        match &self.state {
            RecordState::Failed(_) => None,
            RecordState::Batch { batch, .. } => batch.outcome().map(|o| o.at),
        }
    }
}

fn metadata(
    result: &Result<i64, ClientError>,
    index: u32,
    partition: u32,
) -> Result<RecordMetadata, ClientError> {
    match result {
        Ok(base) => Ok(RecordMetadata {
            partition,
            offset: if *base < 0 {
                -1
            } else {
                base + i64::from(index)
            },
        }),
        Err(e) => Err(e.clone()),
    }
}

impl Future for RecordFuture {
    type Output = Result<RecordMetadata, ClientError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.state {
            RecordState::Failed(e) => Poll::Ready(Err(e.clone())),
            RecordState::Batch {
                batch,
                index,
                registered,
            } => match batch.register(cx.waker(), registered) {
                Some(o) => Poll::Ready(metadata(&o.result, *index, batch.partition())),
                None => Poll::Pending,
            },
        }
    }
}

/// The idempotent producer identity, replaced after a batch finally fails.
#[derive(Debug, Clone, Copy)]
struct Identity {
    producer_id: i64,
    epoch: i16,
    /// Bumped with every new id; partitions restart their sequence when it changes.
    generation: u64,
}

/// A producer; cheap to share behind an `Arc`.
pub struct Producer {
    shared: Arc<Shared>,
    /// The sender task; aborted (with its requests) when the producer is dropped.
    sender: tokio::task::JoinHandle<()>,
    /// The check-back task of a transactional producer with a checker.
    checker: parking_lot::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

struct Shared {
    cluster: Cluster,
    admin: AdminClient,
    config: ProducerConfig,
    partitioner: Partitioner,
    accumulator: Accumulator,
    faults: FaultTracker,
    identity: tokio::sync::Mutex<Option<Identity>>,
    generation: std::sync::atomic::AtomicU64,
    /// The transaction of a transactional producer.
    txn: Option<TxnSession>,
}

/// A transactional producer's side of its transactions.
struct TxnSession {
    id: String,
    client: TxnClient,
    /// Commits offsets inside transactions, at group coordinators.
    groups: GroupsAdmin,
    state: tokio::sync::Mutex<TxnLocal>,
}

#[derive(Default)]
struct TxnLocal {
    /// `init_transactions` succeeded.
    ready: bool,
    /// A transaction is open.
    open: bool,
    /// Partitions added to the open transaction.
    partitions: std::collections::HashSet<(String, u32)>,
    /// Groups whose offsets were added to the open transaction.
    groups: std::collections::HashSet<String>,
    /// Why the open transaction can only be aborted (a step of it failed).
    abort_only: Option<String>,
    /// Counts the transactions begun (names the local transaction a check was about).
    seq: u64,
    /// Failed batches counted when the transaction began.
    failed_at_begin: u64,
    /// Fenced (a newer instance) or otherwise unusable: every call fails with this.
    fatal: Option<ClientError>,
}

impl Shared {
    /// The current producer id, asking the cluster for one when there is none.
    async fn identity(&self) -> Result<Identity, ClientError> {
        let mut guard = self.identity.lock().await;
        if let Some(identity) = *guard {
            return Ok(identity);
        }
        if self.txn.is_some() {
            return Err(ClientError::new(
                ErrorCode::InvalidTxnState,
                "a transactional producer gets its producer id from init_transactions",
            ));
        }
        let r = self.admin.init_producer_id().await?;
        let identity = Identity {
            producer_id: r.producer_id,
            epoch: r.producer_epoch as i16,
            generation: self
                .generation
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                + 1,
        };
        tracing::debug!(producer_id = identity.producer_id, "idempotent producer id");
        *guard = Some(identity);
        Ok(identity)
    }

    /// Drops the producer id of `generation` (a batch under it failed for good).
    async fn abandon_identity(&self, generation: u64) {
        if self.txn.is_some() {
            // A transactional producer keeps its id: the failure fails the transaction,
            // which the application aborts.
            return;
        }
        let mut guard = self.identity.lock().await;
        if guard.is_some_and(|i| i.generation == generation) {
            *guard = None;
        }
    }

    /// How much longer records that may go anywhere avoid `topic`/`partition` (None:
    /// they do not): as long as its broker is avoided; for ever while it has no leader.
    fn leader_avoided_for(&self, topic: &str, partition: u32) -> Option<Duration> {
        self.cluster.check_leader(topic, partition, |l| match l {
            Some(l) => self.faults.avoided_for(l),
            None => Some(Duration::MAX),
        })
    }

    /// Whether records that may go anywhere avoid `topic`/`partition` now.
    fn leader_avoided(&self, topic: &str, partition: u32) -> bool {
        self.leader_avoided_for(topic, partition).is_some()
    }

    /// The partition for a record that may go anywhere, given the partitioner's choice:
    /// the first from it whose leader is not avoided (the sticky partitioner continues
    /// there).
    fn avoid_faults(&self, topic: &str, preferred: u32, count: u32) -> u32 {
        if !self.config.fault_avoidance || !self.faults.any() {
            return preferred;
        }
        let p = fault::best_partition(preferred, count, fault::SEND_PROBES, |p| {
            self.leader_avoided_for(topic, p)
        });
        if p != preferred {
            self.partitioner.stick_to(p);
        }
        p
    }

    /// The partition for `record` from cached metadata, or None when the topic's routes
    /// are not cached (the caller resolves them, awaiting).
    fn cached_partition(&self, record: &ProducerRecord) -> Option<Result<u32, ClientError>> {
        let count = self.cluster.cached_partition_count(&record.topic)?;
        Some(choose_partition(self, record, count))
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl Producer {
    /// A producer for the cluster at `bootstrap`.
    pub fn new(bootstrap: Vec<String>, config: ProducerConfig) -> Self {
        let bootstrap_for_txn = bootstrap.clone();
        let shared = Arc::new(Shared {
            cluster: Cluster::new(bootstrap.clone(), Duration::from_secs(30)),
            admin: AdminClient::new(bootstrap, Duration::from_secs(30)),
            partitioner: Partitioner::new(config.partitioning),
            accumulator: Accumulator::new(AccumulatorConfig {
                batch_size: config.batch_size.max(1),
                linger: config.linger,
                buffer_memory: config.buffer_memory,
                compression: config.compression,
                drain_bytes_max: config.max_request_size,
            }),
            faults: FaultTracker::default(),
            identity: tokio::sync::Mutex::new(None),
            generation: std::sync::atomic::AtomicU64::new(0),
            txn: config.transactional_id.clone().map(|id| TxnSession {
                id,
                client: TxnClient::new(bootstrap_for_txn.clone(), config.request_timeout),
                groups: GroupsAdmin::new(bootstrap_for_txn.clone(), config.request_timeout),
                state: tokio::sync::Mutex::new(TxnLocal::default()),
            }),
            config,
        });
        let sender = tokio::spawn(Sender::new(shared.clone()).run());
        Self {
            shared,
            sender,
            checker: parking_lot::Mutex::new(None),
        }
    }

    /// The partition count of `topic` (like Kafka's `partitionsFor`): fails at once with
    /// UNKNOWN_TOPIC_OR_PARTITION when the cluster does not know the topic (after one
    /// short wait for a topic created a moment ago), so a caller can refuse a bad topic
    /// before sending anything.
    pub async fn partitions_for(&self, topic: &str) -> Result<u32, ClientError> {
        let probe = ProducerRecord {
            topic: topic.to_owned(),
            partition: Some(0),
            ..Default::default()
        };
        resolve_partition(&self.shared, &probe).await?;
        Ok(self.shared.cluster.route(topic).await?.leaders.len() as u32)
    }

    /// Async send: queues a record; the future resolves when it is acknowledged (or
    /// failed). Waits only for metadata not cached yet and for buffer memory.
    pub async fn send(&self, record: ProducerRecord) -> RecordFuture {
        self.queue(record, false).await
    }

    /// Sync send: queues a record and waits for its acknowledgement.
    pub async fn send_sync(&self, record: ProducerRecord) -> Result<RecordMetadata, ClientError> {
        self.queue(record, false).await.await
    }

    /// Async send with a callback, called (on a runtime task) with the outcome.
    pub async fn send_with_callback(
        &self,
        record: ProducerRecord,
        callback: impl FnOnce(Result<RecordMetadata, ClientError>) + Send + 'static,
    ) {
        let outcome = self.queue(record, false).await;
        tokio::spawn(async move { callback(outcome.await) });
    }

    /// Oneway send: queues a record and forgets it. Batches holding only oneway records go
    /// with acks=0: nothing reports whether they arrived.
    pub async fn send_oneway(&self, record: ProducerRecord) {
        drop(self.queue(record, true).await);
    }

    async fn queue(&self, record: ProducerRecord, oneway: bool) -> RecordFuture {
        let shared = &self.shared;
        let partition = match shared.cached_partition(&record) {
            Some(p) => p,
            None => resolve_partition(shared, &record).await,
        };
        let partition = match partition {
            Ok(p) => p,
            Err(e) => return RecordFuture::failed(e),
        };
        if let Some(txn) = &shared.txn {
            if oneway {
                return RecordFuture::failed(ClientError::new(
                    ErrorCode::InvalidTxnState,
                    "a transactional producer cannot send oneway (acks=0)",
                ));
            }
            if let Err(e) = self.join_transaction(txn, &record.topic, partition).await {
                return RecordFuture::failed(e);
            }
        }
        // No allocation for the common record without headers.
        let mut headers: Vec<(&str, Option<&[u8]>)> = record
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_deref()))
            .collect();
        if let Some(tag) = &record.tag {
            let refused = check_tag(tag).err().or_else(|| {
                headers
                    .iter()
                    .any(|(k, _)| *k == TAG_HEADER)
                    .then(|| format!("and a '{TAG_HEADER}' header are both given; give one"))
            });
            if let Some(why) = refused {
                return RecordFuture::failed(ClientError::new(
                    ErrorCode::InvalidRecord,
                    format!("tag {why}"),
                ));
            }
            headers.push((TAG_HEADER, Some(tag.as_bytes())));
        }
        let (key, value) = (record.key.as_deref(), record.value.as_deref());
        // A transaction's records stay in the partitions added to it.
        let movable = record.partition.is_none()
            && key.is_none()
            && shared.config.partition_selector.is_none()
            && shared.txn.is_none();
        let reserved = record_size_bound(key, value, &headers);
        if let Err(e) = shared.accumulator.reserve(reserved).await {
            return RecordFuture::failed(e);
        }
        let appended = shared.accumulator.append(
            &record.topic,
            partition,
            RecordRef {
                timestamp: record.timestamp_ms.unwrap_or_else(now_ms),
                key,
                value,
                headers: &headers,
            },
            reserved,
            (oneway, movable),
        );
        if appended.sealed_keyless {
            shared.partitioner.batch_done();
        }
        RecordFuture {
            state: RecordState::Batch {
                batch: appended.result,
                index: appended.index,
                registered: None,
            },
        }
    }

    /// Sends every queued record now (without waiting for linger) and waits until every
    /// record sent before the call is acknowledged or failed.
    pub async fn flush(&self) {
        self.shared.accumulator.flush().await;
    }

    fn session(&self) -> Result<&TxnSession, ClientError> {
        self.shared.txn.as_ref().ok_or_else(|| {
            ClientError::new(
                ErrorCode::InvalidTxnState,
                "not a transactional producer: set transactional_id",
            )
        })
    }

    /// Registers the transactional id with its coordinator: takes its producer id and a
    /// new epoch, which fences every older instance (their open transaction is aborted,
    /// their writes refused with INVALID_PRODUCER_EPOCH or PRODUCER_FENCED). Call once,
    /// before the first transaction.
    pub async fn init_transactions(&self) -> Result<(), ClientError> {
        let txn = self.session()?;
        let mut state = txn.state.lock().await;
        self.reinit(txn, &mut state).await
    }

    /// Takes a producer id and a new epoch for the transactional id; sequences restart.
    async fn reinit(&self, txn: &TxnSession, state: &mut TxnLocal) -> Result<(), ClientError> {
        let timeout_ms = self
            .shared
            .config
            .transaction_timeout
            .as_millis()
            .min(u32::MAX as u128) as u32;
        let (producer_id, epoch) = txn.client.init_producer_id(&txn.id, timeout_ms).await?;
        *self.shared.identity.lock().await = Some(Identity {
            producer_id,
            epoch,
            generation: self
                .shared
                .generation
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                + 1,
        });
        tracing::debug!(transactional_id = %txn.id, producer_id, epoch, "transactional producer ready");
        *state = TxnLocal {
            ready: true,
            ..TxnLocal::default()
        };
        Ok(())
    }

    /// Opens a transaction: every record sent until the commit or abort belongs to it.
    pub async fn begin_transaction(&self) -> Result<(), ClientError> {
        let txn = self.session()?;
        let mut state = txn.state.lock().await;
        check_usable(&state)?;
        if state.open {
            return Err(ClientError::new(
                ErrorCode::InvalidTxnState,
                "a transaction is open already: commit or abort it first",
            ));
        }
        state.open = true;
        state.seq += 1;
        state.partitions.clear();
        state.groups.clear();
        state.abort_only = None;
        state.failed_at_begin = self.shared.accumulator.failed_batches();
        Ok(())
    }

    /// Adds the record's partition to the open transaction before its first record.
    async fn join_transaction(
        &self,
        txn: &TxnSession,
        topic: &str,
        partition: u32,
    ) -> Result<(), ClientError> {
        let mut state = txn
            .open_state("no open transaction: call begin_transaction before sending")
            .await?;
        let key = (topic.to_owned(), partition);
        if state.partitions.contains(&key) {
            return Ok(());
        }
        let identity = self.identity_now().await?;
        if let Err(e) = txn
            .client
            .add_partitions(&txn.id, identity, std::slice::from_ref(&key))
            .await
        {
            note_fatal(&mut state, &e);
            return Err(e);
        }
        state.partitions.insert(key);
        Ok(())
    }

    async fn identity_now(&self) -> Result<(i64, i16), ClientError> {
        self.shared
            .identity
            .lock()
            .await
            .map(|i| (i.producer_id, i.epoch))
            .ok_or_else(|| {
                ClientError::new(ErrorCode::InvalidTxnState, "call init_transactions first")
            })
    }

    /// Commits a consumer group member's `offsets` inside the open transaction (Kafka's
    /// `sendOffsetsToTransaction`): they become the group's committed offsets when the
    /// transaction commits, together with its records, and never if it aborts. This is
    /// the consume-transform-produce loop's exactly-once step: the input's position and
    /// the output move together. `member` is
    /// [`GroupConsumer::group_metadata`](super::group_consumer::GroupConsumer::group_metadata);
    /// a member that lost its partitions is refused (FENCED_MEMBER_EPOCH), and then the
    /// transaction can only be aborted.
    pub async fn send_offsets_to_transaction(
        &self,
        offsets: Vec<CommittedOffset>,
        member: &GroupMetadata,
    ) -> Result<(), ClientError> {
        let txn = self.session()?;
        let mut state = txn
            .open_state("no open transaction: call begin_transaction before sending offsets")
            .await?;
        if offsets.is_empty() {
            return Ok(());
        }
        let identity = self.identity_now().await?;
        if !state.groups.contains(&member.group) {
            if let Err(e) = txn
                .client
                .add_offsets(&txn.id, identity, &member.group)
                .await
            {
                note_fatal(&mut state, &e);
                return Err(e);
            }
            state.groups.insert(member.group.clone());
        }
        if let Err(e) = txn
            .groups
            .commit_in_transaction(member, offsets, &txn.id, identity)
            .await
        {
            note_fatal(&mut state, &e);
            state.abort_only = Some(format!(
                "committing offsets of group '{}' failed: {e}",
                member.group
            ));
            return Err(e);
        }
        Ok(())
    }

    /// Commits the open transaction: sends every queued record, and once all are
    /// acknowledged has the coordinator commit; read-committed consumers then see them
    /// all. When any record of the transaction failed, nothing is committed: the call
    /// fails with INVALID_TXN_STATE and the application aborts.
    pub async fn commit_transaction(&self) -> Result<(), ClientError> {
        self.end_transaction(true).await
    }

    /// Aborts the open transaction: its records are never shown to read-committed
    /// consumers.
    pub async fn abort_transaction(&self) -> Result<(), ClientError> {
        self.end_transaction(false).await
    }

    async fn end_transaction(&self, commit: bool) -> Result<(), ClientError> {
        let txn = self.session()?;
        let mut state = txn.open_state("no open transaction to end").await?;
        self.shared.accumulator.flush().await;
        let failed = self.shared.accumulator.failed_batches() - state.failed_at_begin;
        if commit && failed > 0 {
            return Err(ClientError::new(
                ErrorCode::InvalidTxnState,
                format!("{failed} batches of the transaction failed; abort it"),
            ));
        }
        if let Some(why) = state.abort_only.as_ref().filter(|_| commit) {
            return Err(ClientError::new(
                ErrorCode::InvalidTxnState,
                format!("{why}; abort the transaction"),
            ));
        }
        if !state.partitions.is_empty() || !state.groups.is_empty() {
            let identity = self.identity_now().await?;
            if let Err(e) = txn.client.end(&txn.id, identity, commit).await {
                note_fatal(&mut state, &e);
                return Err(e);
            }
        }
        state.open = false;
        state.partitions.clear();
        state.groups.clear();
        state.abort_only = None;
        if failed > 0 {
            // A batch that never reached its partition left a gap in this epoch's
            // sequence numbers: take a new epoch, whose sequences start at 0 (KIP-360).
            self.reinit(txn, &mut state).await?;
        }
        Ok(())
    }

    /// Registers `checker` to answer the coordinator's checks of transactions this
    /// producer leaves open (RocketMQ's transactional message): when one stays open past
    /// the broker's `transaction_check_interval_ms`, the coordinator asks the checker
    /// whether the local transaction behind it committed, and commits or aborts it as it
    /// answers; after `transaction_check_max` checks without either it aborts. So an
    /// application may write its database row and its messages, and let a crash between
    /// the two be settled by its own records. The producer keeps a stream open to the
    /// coordinator (re-opened after failures) until it is dropped. Call after
    /// `init_transactions`.
    pub async fn set_transaction_checker(
        &self,
        checker: Arc<dyn TransactionChecker>,
    ) -> Result<(), ClientError> {
        let txn = self.session()?;
        check_usable(&*txn.state.lock().await)?;
        let task = tokio::spawn(check_back(self.shared.clone(), checker));
        if let Some(old) = self.checker.lock().replace(task) {
            old.abort();
        }
        Ok(())
    }

    /// Whether this producer writes in transactions.
    pub fn is_transactional(&self) -> bool {
        self.shared.txn.is_some()
    }
}

/// Keeps the check-back stream of a transactional producer open and answers its checks
/// with `checker`; a transaction the coordinator ends on a verdict is closed locally too.
async fn check_back(shared: Arc<Shared>, checker: Arc<dyn TransactionChecker>) {
    let Some(txn) = shared.txn.as_ref() else {
        return;
    };
    // Which local transaction each checked one was (by its start): an "ended" notice
    // closes the local transaction only if it is still that one.
    let mut checked: std::collections::VecDeque<(i64, u64)> = std::collections::VecDeque::new();
    loop {
        let identity = shared
            .identity
            .lock()
            .await
            .map(|i| (i.producer_id, i.epoch));
        let Some(identity) = identity else {
            tokio::time::sleep(CHECK_RECONNECT).await;
            continue;
        };
        let (answers, mut checks) = match txn.client.open_checks(&txn.id, identity).await {
            Ok(stream) => stream,
            Err(e) if is_fenced(&e) => {
                tracing::warn!(transactional_id = %txn.id, error = %e, "the transaction checker stops: the producer is fenced");
                return;
            }
            Err(e) => {
                tracing::debug!(transactional_id = %txn.id, error = %e, "opening the check stream");
                tokio::time::sleep(CHECK_RECONNECT).await;
                continue;
            }
        };
        while let Ok(Some(c)) = checks.message().await {
            if let Some(committed) = c.ended_committed {
                let mut state = txn.state.lock().await;
                let was = checked
                    .iter()
                    .find(|(started, _)| *started == c.transaction_start_ms)
                    .map(|(_, seq)| *seq);
                if state.open && was == Some(state.seq) {
                    tracing::info!(transactional_id = %txn.id, committed, "the coordinator ended the open transaction on a check");
                    state.open = false;
                    state.partitions.clear();
                    state.groups.clear();
                    state.abort_only = None;
                }
                continue;
            }
            {
                let state = txn.state.lock().await;
                if state.open
                    && !checked
                        .iter()
                        .any(|(started, _)| *started == c.transaction_start_ms)
                {
                    checked.push_back((c.transaction_start_ms, state.seq));
                    if checked.len() > 64 {
                        checked.pop_front();
                    }
                }
            }
            let check = TransactionCheck {
                transactional_id: txn.id.clone(),
                started_ms: c.transaction_start_ms,
                partitions: c
                    .topics
                    .iter()
                    .flat_map(|t| t.partitions.iter().map(|p| (t.topic.clone(), *p)))
                    .collect(),
                attempt: c.attempt,
            };
            let verdict = match checker.check(check).await {
                CheckVerdict::Commit => TxnCheckVerdict::Commit,
                CheckVerdict::Rollback => TxnCheckVerdict::Rollback,
                CheckVerdict::Unknown => TxnCheckVerdict::Unknown,
            };
            let answer = TxnCheckAnswer {
                message: Some(txn_check_answer::Message::Outcome(TxnCheckOutcome {
                    transaction_start_ms: c.transaction_start_ms,
                    verdict: verdict as i32,
                })),
            };
            if answers.send(answer).await.is_err() {
                break;
            }
        }
        tokio::time::sleep(CHECK_RECONNECT).await;
    }
}

/// Pause before a check stream is opened again.
const CHECK_RECONNECT: Duration = Duration::from_secs(1);

fn is_fenced(e: &ClientError) -> bool {
    matches!(
        e.code,
        ErrorCode::ProducerFenced
            | ErrorCode::InvalidProducerIdMapping
            | ErrorCode::InvalidProducerEpoch
    )
}

impl TxnSession {
    /// The local state, locked, when a transaction is open and the producer usable;
    /// `closed` says what was tried without an open transaction.
    async fn open_state(
        &self,
        closed: &str,
    ) -> Result<tokio::sync::MutexGuard<'_, TxnLocal>, ClientError> {
        let state = self.state.lock().await;
        check_usable(&state)?;
        if !state.open {
            return Err(ClientError::new(ErrorCode::InvalidTxnState, closed));
        }
        Ok(state)
    }
}

/// Fails unless the producer was initialised and is not fenced.
fn check_usable(state: &TxnLocal) -> Result<(), ClientError> {
    if let Some(e) = &state.fatal {
        return Err(e.clone());
    }
    if !state.ready {
        return Err(ClientError::new(
            ErrorCode::InvalidTxnState,
            "call init_transactions first",
        ));
    }
    Ok(())
}

/// Remembers an error after which the producer cannot go on (it was fenced).
fn note_fatal(state: &mut TxnLocal, e: &ClientError) {
    if is_fenced(e) {
        state.fatal = Some(e.clone());
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.sender.abort();
        if let Some(task) = self.checker.lock().take() {
            task.abort();
        }
        self.shared.accumulator.fail_all(&accumulator::closed());
    }
}

async fn resolve_partition(shared: &Shared, record: &ProducerRecord) -> Result<u32, ClientError> {
    let route = match shared.cluster.route(&record.topic).await {
        Ok(r) => r,
        Err(e) if e.code == ErrorCode::UnknownTopicOrPartition => {
            // A topic created a moment ago may not have reached the broker yet.
            tokio::time::sleep(Duration::from_millis(300)).await;
            shared.cluster.refresh(&record.topic).await?
        }
        Err(e) => return Err(e),
    };
    choose_partition(shared, record, route.leaders.len() as u32)
}

/// The partition of `record` among `count`: explicit, from the selector, or the
/// partitioner's.
fn choose_partition(
    shared: &Shared,
    record: &ProducerRecord,
    count: u32,
) -> Result<u32, ClientError> {
    match record.partition {
        Some(p) if p >= count => Err(ClientError::new(
            ErrorCode::UnknownTopicOrPartition,
            format!(
                "topic '{}' has {count} partitions; there is no partition {p}",
                record.topic
            ),
        )),
        Some(p) => Ok(p),
        None if count == 0 => Err(ClientError::new(
            ErrorCode::UnknownTopicOrPartition,
            format!("topic '{}' has no partitions", record.topic),
        )),
        None => match &shared.config.partition_selector {
            Some(select) => {
                let p = (select.0)(record, count);
                if p >= count {
                    return Err(ClientError::new(
                        ErrorCode::UnknownTopicOrPartition,
                        format!(
                            "the partition selector chose partition {p}, but topic '{}' has {count}",
                            record.topic
                        ),
                    ));
                }
                Ok(p)
            }
            None => {
                let p = shared.partitioner.partition(record.key.as_deref(), count);
                Ok(match record.key {
                    Some(_) => p,
                    None => shared.avoid_faults(&record.topic, p, count),
                })
            }
        },
    }
}

/// A drained batch, encoded, between its first send and its completion.
struct InFlight {
    batch: DrainedBatch,
    /// Its record count.
    count: i64,
    /// Batches of the same partition sent right after it in the same payload, with
    /// their record counts (the broker appends them together, or none of them).
    more: Vec<(DrainedBatch, i64)>,
    payload: Bytes,
    acks: i32,
    /// The producer id generation it was numbered under (None: not idempotent).
    generation: Option<u64>,
    attempts: u32,
    /// Waiting to be resent at this time (None: a request is out).
    retry_at: Option<Instant>,
}

/// What a produce request task sends: one batch of one partition.
struct Outgoing {
    key: u64,
    topic: String,
    partition: u32,
    payload: Bytes,
}

/// The sender's per-partition state.
#[derive(Debug, Default, Clone, Copy)]
struct PartitionSend {
    /// A batch of the partition is in flight or waiting to be retried.
    muted: bool,
    /// (generation of the producer id, next sequence).
    sequence: (u64, i32),
}

/// The sender task: drains ready batches, sends them grouped per leader, completes or
/// retries them. Owns the state only it changes (muted partitions, sequences, batches in
/// flight), so that needs no lock.
struct Sender {
    shared: Arc<Shared>,
    partitions: HashMap<String, Vec<PartitionSend>>,
    /// Batches out of the accumulator and not complete, by batch id.
    in_flight: HashMap<u64, InFlight>,
    /// The batches each request task carries, to fail them should the task die.
    requests: HashMap<tokio::task::Id, Vec<u64>>,
    tasks: JoinSet<Vec<(u64, Result<i64, ClientError>)>>,
    /// When queued batches were last moved off avoided brokers.
    moved_at: Option<Instant>,
}

impl Sender {
    fn new(shared: Arc<Shared>) -> Self {
        Self {
            shared,
            partitions: HashMap::new(),
            in_flight: HashMap::new(),
            requests: HashMap::new(),
            tasks: JoinSet::new(),
            moved_at: None,
        }
    }

    fn partition(&mut self, topic: &str, partition: u32) -> &mut PartitionSend {
        if !self.partitions.contains_key(topic) {
            self.partitions.insert(topic.to_owned(), Vec::new());
        }
        let list = self
            .partitions
            .get_mut(topic)
            .unwrap_or_else(|| unreachable!("inserted above"));
        if list.len() <= partition as usize {
            list.resize(partition as usize + 1, PartitionSend::default());
        }
        &mut list[partition as usize]
    }

    /// Marks a partition as having a batch out (or not), and lets its next batch grow
    /// meanwhile ([`ProducerConfig::batch_size_max`]).
    fn set_muted(&mut self, topic: &str, partition: u32, muted: bool) {
        self.partition(topic, partition).muted = muted;
        let grow_to = if muted {
            let config = &self.shared.config;
            let max_message_bytes = self
                .shared
                .cluster
                .cached_max_message_bytes(topic)
                .unwrap_or_else(|| TopicConfig::default().max_message_bytes);
            config
                .batch_size_max
                .min(config.max_request_size)
                .min(max_message_bytes / 8 * 7)
        } else {
            0
        };
        self.shared
            .accumulator
            .set_growth(topic, partition, grow_to);
    }

    async fn run(mut self) {
        loop {
            let next = self.send_ready().await;
            tokio::select! {
                joined = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                    match joined {
                        Some(Ok((id, results))) => {
                            self.requests.remove(&id);
                            for (key, result) in results {
                                self.finish(key, result).await;
                            }
                        }
                        Some(Err(e)) => {
                            let keys = self.requests.remove(&e.id()).unwrap_or_default();
                            let error = ClientError::new(
                                ErrorCode::UnknownServerError,
                                format!("produce request task failed: {e}"),
                            );
                            for key in keys {
                                self.finish(key, Err(error.clone())).await;
                            }
                        }
                        None => {}
                    }
                }
                () = self.shared.accumulator.woken() => {}
                () = sleep_until(next) => {}
            }
        }
    }

    /// Sends what is due: retries whose backoff passed, then ready batches of partitions
    /// with nothing in flight. Returns when to look again.
    async fn send_ready(&mut self) -> Option<Instant> {
        let now = Instant::now();
        self.move_off_avoided(now);
        let config = &self.shared.config;
        let in_flight_max = config.max_in_flight.max(1);
        // While a broker is avoided, look again soon: queued batches may have to move.
        let mut next: Option<Instant> = (config.fault_avoidance && self.shared.faults.any())
            .then(|| now + Duration::from_millis(100));
        let mut outgoing: Vec<u64> = Vec::new();
        for (key, f) in &mut self.in_flight {
            match f.retry_at {
                Some(at) if at <= now => {
                    f.retry_at = None;
                    outgoing.push(*key);
                }
                Some(at) => next = Some(next.map_or(at, |n| n.min(at))),
                None => {}
            }
        }
        let mut count = self.in_flight.len();
        let partitions = &self.partitions;
        let (drained, linger_end) = self.shared.accumulator.drain(now, |topic, partition| {
            let muted = partitions
                .get(topic)
                .and_then(|l| l.get(partition as usize))
                .is_some_and(|p| p.muted);
            let take = accumulator::may_drain(true, muted, count, in_flight_max);
            count += usize::from(take);
            take
        });
        if let Some(at) = linger_end {
            next = Some(next.map_or(at, |n| n.min(at)));
        }
        if !drained.is_empty() {
            outgoing.extend(self.start(drained).await);
        }
        if !outgoing.is_empty() {
            self.dispatch(outgoing);
        }
        next
    }

    /// Moves queued batches that may go anywhere off partitions whose leader is avoided,
    /// to the next partition whose leader is not (at most every 100 ms: it looks at every
    /// partition's queue).
    fn move_off_avoided(&mut self, now: Instant) {
        let shared = &self.shared;
        if !shared.config.fault_avoidance
            || !shared.faults.any()
            || self
                .moved_at
                .is_some_and(|at| now < at + Duration::from_millis(100))
        {
            return;
        }
        self.moved_at = Some(now);
        for (topic, from) in shared.accumulator.partitions_with_movable() {
            let Some(count) = shared.cluster.cached_partition_count(&topic) else {
                continue;
            };
            if from >= count || !shared.leader_avoided(&topic, from) {
                continue;
            }
            let to = fault::best_partition((from + 1) % count, count, count, |p| {
                shared.leader_avoided_for(&topic, p)
            });
            if to != from && !shared.leader_avoided(&topic, to) {
                let moved = shared.accumulator.move_batches(&topic, from, to);
                tracing::debug!(%topic, from, to, moved, "queued batches moved off an avoided broker");
            }
        }
    }

    /// Without idempotence, a failed batch that may go anywhere and whose leader is now
    /// avoided is retried on the next partition whose leader is not, when nothing of that
    /// partition is in flight (a retry may duplicate without idempotence anyway).
    fn retry_elsewhere(&mut self, f: &mut InFlight) {
        let shared = self.shared.clone();
        let (topic, from) = (f.batch.topic.clone(), f.batch.partition);
        if !shared.config.fault_avoidance
            || f.generation.is_some()
            || !f.batch.movable
            || f.more.iter().any(|(b, _)| !b.movable)
            || !shared.leader_avoided(&topic, from)
        {
            return;
        }
        let Some(count) = shared.cluster.cached_partition_count(&topic) else {
            return;
        };
        let busy = |p: u32| {
            let muted = self
                .partitions
                .get(&topic)
                .and_then(|l| l.get(p as usize))
                .is_some_and(|s| s.muted);
            if muted {
                Some(Duration::MAX)
            } else {
                shared.leader_avoided_for(&topic, p)
            }
        };
        let to = fault::best_partition((from + 1) % count, count, count, busy);
        if to == from || busy(to).is_some() {
            return;
        }
        tracing::debug!(%topic, from, to, "retrying a failed batch on another broker's partition");
        self.set_muted(&topic, from, false);
        self.set_muted(&topic, to, true);
        f.batch.move_to(to);
        for (batch, _) in &mut f.more {
            batch.move_to(to);
        }
    }

    /// Numbers (when idempotent) and encodes drained batches; returns their keys.
    async fn start(&mut self, drained: Vec<DrainedBatch>) -> Vec<u64> {
        let shared = self.shared.clone();
        let config = &shared.config;
        let idempotent = config.enable_idempotence && config.acks != 0;
        let identity = if idempotent && drained.iter().any(|b| !b.oneway) {
            Some(self.shared.identity().await)
        } else {
            None
        };
        let mut keys = Vec::with_capacity(drained.len());
        // The request entry a following batch of the same partition joins.
        let mut last: Option<u64> = None;
        for mut batch in drained {
            if batch.keyless_unsealed {
                self.shared.partitioner.batch_done();
            }
            let acks = if batch.oneway { 0 } else { config.acks };
            let builder =
                std::mem::replace(&mut batch.builder, BatchBuilder::new(Compression::None));
            let count = builder.len() as i32;
            let (builder, numbered) = match (&identity, acks) {
                (Some(Err(e)), a) if a != 0 => {
                    self.shared.accumulator.complete(&batch, Err(e.clone()));
                    continue;
                }
                (Some(Ok(identity)), a) if a != 0 => {
                    let state = self.partition(&batch.topic, batch.partition);
                    if state.sequence.0 != identity.generation {
                        state.sequence = (identity.generation, 0);
                    }
                    let first = state.sequence.1;
                    state.sequence.1 = first.wrapping_add(count) & i32::MAX;
                    (
                        builder
                            .producer(identity.producer_id, identity.epoch, first)
                            .transactional(self.shared.txn.is_some()),
                        Some((identity.generation, first)),
                    )
                }
                _ => (builder, None),
            };
            let payload = match builder.build(0) {
                Ok(bytes) => Bytes::from(bytes),
                Err(e) => {
                    // Its numbers go to the next batch: no gap (none after it has any yet),
                    // and nothing may follow it into the request before it.
                    if let Some((_, first)) = numbered {
                        self.partition(&batch.topic, batch.partition).sequence.1 = first;
                    }
                    last = None;
                    let e = ClientError::new(
                        ErrorCode::InvalidRequest,
                        format!("cannot encode records: {e}"),
                    );
                    self.shared.accumulator.complete(&batch, Err(e));
                    continue;
                }
            };
            let generation = numbered.map(|(generation, _)| generation);
            let joined = last.and_then(|k| self.in_flight.get_mut(&k)).filter(|f| {
                batch.follows
                    && f.acks == acks
                    && f.generation == generation
                    && f.batch.topic == batch.topic
                    && f.batch.partition == batch.partition
            });
            if let Some(f) = joined {
                // (No copy of what is there: the payload is not shared yet.)
                let mut joint = Vec::from(std::mem::take(&mut f.payload));
                joint.extend_from_slice(&payload);
                f.payload = Bytes::from(joint);
                f.more.push((batch, count.into()));
                continue;
            }
            self.set_muted(&batch.topic, batch.partition, true);
            let key = batch.id();
            keys.push(key);
            last = Some(key);
            self.in_flight.insert(
                key,
                InFlight {
                    batch,
                    count: count.into(),
                    more: Vec::new(),
                    payload,
                    acks,
                    generation,
                    attempts: 0,
                    retry_at: None,
                },
            );
        }
        keys
    }

    /// Groups batches per (leader, acks) into requests of at most `max_request_size`
    /// bytes and spawns one task per request.
    fn dispatch(&mut self, keys: Vec<u64>) {
        let max_bytes = self.shared.config.max_request_size.max(1);
        let mut groups: HashMap<(String, i32), Vec<Vec<Outgoing>>> = HashMap::new();
        let mut leaderless: Vec<(i32, Outgoing)> = Vec::new();
        for key in keys {
            let Some(f) = self.in_flight.get(&key) else {
                continue;
            };
            let out = Outgoing {
                key,
                topic: f.batch.topic.clone(),
                partition: f.batch.partition,
                payload: f.payload.clone(),
            };
            match self
                .shared
                .cluster
                .cached_leader(&f.batch.topic, f.batch.partition)
            {
                Some(leader) => {
                    let requests = groups.entry((leader, f.acks)).or_default();
                    let open = requests.last().is_some_and(|r| {
                        r.len() < PARTITIONS_PER_REQUEST_MAX
                            && r.iter().map(|o| o.payload.len()).sum::<usize>() + out.payload.len()
                                <= max_bytes
                    });
                    if open {
                        if let Some(r) = requests.last_mut() {
                            r.push(out);
                        }
                    } else {
                        requests.push(vec![out]);
                    }
                }
                None => leaderless.push((f.acks, out)),
            }
        }
        let requests = groups
            .into_iter()
            .flat_map(|((leader, acks), rs)| {
                rs.into_iter().map(move |r| (Some(leader.clone()), acks, r))
            })
            .chain(
                leaderless
                    .into_iter()
                    .map(|(acks, o)| (None, acks, vec![o])),
            );
        for (leader, acks, batches) in requests {
            let keys = batches.iter().map(|o| o.key).collect();
            let handle = self
                .tasks
                .spawn(produce(self.shared.clone(), leader, acks, batches));
            self.requests.insert(handle.id(), keys);
        }
    }

    /// Completes a batch, or schedules its retry with the same bytes.
    async fn finish(&mut self, key: u64, result: Result<i64, ClientError>) {
        let Some(mut f) = self.in_flight.remove(&key) else {
            return;
        };
        let shared = self.shared.clone();
        let config = &shared.config;
        match result {
            Err(e)
                if e.is_retriable()
                    && f.attempts < config.retries
                    && Instant::now() < f.batch.created + config.delivery_timeout =>
            {
                f.attempts += 1;
                tracing::debug!(topic = %f.batch.topic, partition = f.batch.partition, error = %e, attempt = f.attempts, "produce failed; retrying");
                self.retry_elsewhere(&mut f);
                f.retry_at = Some(Instant::now() + config.retry_backoff);
                self.in_flight.insert(key, f);
            }
            result => {
                if let (Err(e), Some(generation)) = (&result, f.generation) {
                    tracing::debug!(topic = %f.batch.topic, partition = f.batch.partition, error = %e, "batch failed; taking a new producer id");
                    self.shared.abandon_identity(generation).await;
                }
                let parts =
                    std::iter::once((&f.batch, f.count)).chain(f.more.iter().map(|(b, n)| (b, *n)));
                let mut at = result;
                for (batch, n) in parts {
                    self.shared.accumulator.complete(batch, at.clone());
                    // The next batch starts after this one's records (-1: acks=0).
                    at = at.map(|o| if o < 0 { o } else { o + n });
                }
                self.set_muted(&f.batch.topic, f.batch.partition, false);
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// One produce request: its batches' results (base offset or error), after a metadata
/// refresh of every topic that had a retriable error.
async fn produce(
    shared: Arc<Shared>,
    leader: Option<String>,
    acks: i32,
    batches: Vec<Outgoing>,
) -> Vec<(u64, Result<i64, ClientError>)> {
    let leader = match (leader, batches.first()) {
        (Some(l), _) => Ok(l),
        (None, Some(b)) => shared.cluster.leader(&b.topic, b.partition).await,
        (None, None) => Err(ClientError::new(
            ErrorCode::InvalidRequest,
            "a produce request without batches",
        )),
    };
    let response = match leader {
        Ok(leader) => {
            watched(
                &shared,
                &leader,
                send_request(&shared, &leader, acks, &batches),
            )
            .await
        }
        Err(e) => Err(e),
    };
    let results: Vec<(u64, Result<i64, ClientError>)> = match response {
        Ok(response) => batches
            .iter()
            .map(|b| (b.key, answer(&response, &b.topic, b.partition)))
            .collect(),
        Err(e) => batches.iter().map(|b| (b.key, Err(e.clone()))).collect(),
    };
    let mut refreshed: Vec<&str> = Vec::new();
    for (b, (_, r)) in batches.iter().zip(&results) {
        if r.as_ref().is_err_and(ClientError::is_retriable)
            && !refreshed.contains(&b.topic.as_str())
        {
            refreshed.push(&b.topic);
            let _ = shared.cluster.refresh(&b.topic).await;
        }
    }
    results
}

/// Runs a produce request to `broker`, telling the fault tracker how it goes: as it
/// stalls (at each latency level while unanswered) and how it ended.
async fn watched(
    shared: &Shared,
    broker: &str,
    request: impl Future<Output = Result<ProduceResponse, ClientError>>,
) -> Result<ProduceResponse, ClientError> {
    if !shared.config.fault_avoidance {
        return request.await;
    }
    let started = Instant::now();
    let mut request = std::pin::pin!(request);
    let mut levels = fault::stall_levels();
    let result = loop {
        let Some(level) = levels.next() else {
            break request.await;
        };
        tokio::select! {
            r = &mut request => break r,
            () = tokio::time::sleep_until((started + level).into()) => {
                if shared.faults.record(broker, level, Outcome::Waiting) {
                    shared.accumulator.wake_sender();
                }
            }
        }
    };
    let outcome = match &result {
        Ok(r) if !refused_by_fault(r) => Outcome::Answered,
        Err(e) if !e.is_retriable() => Outcome::Answered,
        _ => Outcome::Failed,
    };
    if shared.faults.record(broker, started.elapsed(), outcome) {
        shared.accumulator.wake_sender();
    }
    result
}

/// Whether a produce response refused a partition for a fault of the broker (not enough
/// replicas, a storage error, a timeout) rather than stale metadata (not the leader, an
/// unknown partition), which a metadata refresh mends.
fn refused_by_fault(response: &ProduceResponse) -> bool {
    response
        .topics
        .iter()
        .flat_map(|t| &t.partitions)
        .filter_map(|p| ClientError::from_partition(p.error_code, &p.error_message))
        .any(|e| {
            e.is_retriable()
                && !matches!(
                    e.code,
                    ErrorCode::NotLeaderOrFollower | ErrorCode::UnknownTopicOrPartition
                )
        })
}

async fn send_request(
    shared: &Shared,
    leader: &str,
    acks: i32,
    batches: &[Outgoing],
) -> Result<ProduceResponse, ClientError> {
    let channel = shared.cluster.connection().channel(leader)?;
    let mut topics: Vec<TopicProduceData> = Vec::new();
    for b in batches {
        let data = PartitionProduceData {
            partition: b.partition,
            records: Vec::new(),
            record_batches: b.payload.clone(),
            compression: 0,
        };
        match topics.iter_mut().find(|t| t.topic == b.topic) {
            Some(t) => t.partitions.push(data),
            None => topics.push(TopicProduceData {
                topic: b.topic.clone(),
                partitions: vec![data],
            }),
        }
    }
    let request = ProduceRequest {
        transactional_id: shared.txn.as_ref().map(|t| t.id.clone()),
        acks: Some(acks),
        timeout_ms: shared.config.request_timeout.as_millis() as u32,
        topics,
    };
    call_produce(shared, channel, request).await
}

/// One Produce call on `channel`, given up after the request timeout.
async fn call_produce(
    shared: &Shared,
    channel: tonic::transport::Channel,
    request: ProduceRequest,
) -> Result<ProduceResponse, ClientError> {
    tokio::time::timeout(
        shared.config.request_timeout,
        super::raw_call::produce(channel, request),
    )
    .await
    .map_err(|_| {
        ClientError::new(
            ErrorCode::RequestTimedOut,
            format!(
                "no produce answer within {} ms",
                shared.config.request_timeout.as_millis()
            ),
        )
    })?
    .map_err(ClientError::from)
}

/// A partition's result in a produce response: its base offset, or its error.
fn answer(response: &ProduceResponse, topic: &str, partition: u32) -> Result<i64, ClientError> {
    let p = response
        .topics
        .iter()
        .filter(|t| t.topic == topic)
        .flat_map(|t| &t.partitions)
        .find(|p| p.partition == partition)
        .ok_or_else(|| {
            ClientError::new(
                ErrorCode::UnknownServerError,
                format!("the produce response has no result for {topic}-{partition}"),
            )
        })?;
    match ClientError::from_partition(p.error_code, &p.error_message) {
        Some(e) => Err(e),
        None => Ok(p.base_offset),
    }
}
