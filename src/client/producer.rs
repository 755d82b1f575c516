//! The producer: per-partition batching (`batch_size`, `linger`), acks, at most one batch
//! in flight per partition (so retries never reorder a partition) and a bound on batches in
//! flight overall, retries of retriable errors with a metadata refresh, and the
//! partitioners of [`super::partitioner`].
//!
//! Send modes, as RocketMQ names them: [`Producer::send_sync`] waits for the
//! acknowledgement; [`Producer::send`] (async) returns a future of it, and
//! [`Producer::send_with_callback`] calls a closure with it; [`Producer::send_oneway`]
//! fires and forgets (its batches go with acks=0). The records of a partition are encoded
//! client-side into one RecordBatch per request.
//!
//! Idempotence (on by default, for acks 1 and all): the producer gets a producer id from
//! the cluster and numbers each partition's records; a retried batch carries the same
//! numbers, so the leader recognises a batch it already holds and answers with its
//! original offsets instead of writing it twice. With one batch in flight per partition,
//! retries never reorder either. When a batch finally fails (its outcome unknown), the
//! producer takes a new producer id, so later batches start a fresh sequence.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::admin::AdminClient;
use super::cluster::Cluster;
use super::error::ClientError;
use super::partitioner::{Partitioner, Partitioning};
use crate::api::proto::broker_client::BrokerClient;
use crate::api::proto::{PartitionProduceData, ProduceRequest, TopicProduceData};
use crate::error_code::ErrorCode;
use crate::record::{BatchBuilder, Compression, RecordRef};

/// Producer settings (Kafka's names in snake case).
#[derive(Debug, Clone)]
pub struct ProducerConfig {
    /// 0, 1 or -1 (all).
    pub acks: i32,
    /// A partition's batch is sent once it holds this many bytes.
    pub batch_size: usize,
    /// ... or once its oldest record waited this long.
    pub linger: Duration,
    /// Batches in flight over all partitions.
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

type Delivery = oneshot::Sender<Result<RecordMetadata, ClientError>>;

struct Pending {
    record: ProducerRecord,
    partition: u32,
    done: Delivery,
    oneway: bool,
}

enum Command {
    Send(ProducerRecord, Delivery, bool),
    Flush(oneshot::Sender<()>),
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
    tx: mpsc::Sender<Command>,
    task: tokio::task::JoinHandle<()>,
    shared: Arc<Shared>,
}

struct Shared {
    cluster: Cluster,
    admin: AdminClient,
    config: ProducerConfig,
    partitioner: Partitioner,
    in_flight: Semaphore,
    identity: tokio::sync::Mutex<Option<Identity>>,
    generation: std::sync::atomic::AtomicU64,
}

impl Shared {
    /// The current producer id, asking the cluster for one when there is none.
    async fn identity(&self) -> Result<Identity, ClientError> {
        let mut guard = self.identity.lock().await;
        if let Some(identity) = *guard {
            return Ok(identity);
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
        let mut guard = self.identity.lock().await;
        if guard.is_some_and(|i| i.generation == generation) {
            *guard = None;
        }
    }
}

/// Batches queued per partition before the accumulator waits.
const PARTITION_QUEUE_BATCHES: usize = 64;

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl Producer {
    /// A producer for the cluster at `bootstrap`.
    pub fn new(bootstrap: Vec<String>, config: ProducerConfig) -> Self {
        let shared = Arc::new(Shared {
            cluster: Cluster::new(bootstrap.clone(), Duration::from_secs(30)),
            admin: AdminClient::new(bootstrap, Duration::from_secs(30)),
            partitioner: Partitioner::new(config.partitioning),
            in_flight: Semaphore::new(config.max_in_flight.max(1)),
            identity: tokio::sync::Mutex::new(None),
            generation: std::sync::atomic::AtomicU64::new(0),
            config,
        });
        let (tx, rx) = mpsc::channel(4096);
        let task = tokio::spawn(accumulate(shared.clone(), rx));
        Self { tx, task, shared }
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
    /// failed).
    pub async fn send(
        &self,
        record: ProducerRecord,
    ) -> impl std::future::Future<Output = Result<RecordMetadata, ClientError>> {
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

    async fn queue(
        &self,
        record: ProducerRecord,
        oneway: bool,
    ) -> impl std::future::Future<Output = Result<RecordMetadata, ClientError>> {
        let (done, rx) = oneshot::channel();
        let queued = self.tx.send(Command::Send(record, done, oneway)).await;
        async move {
            if queued.is_err() {
                return Err(ClientError::new(
                    ErrorCode::UnknownServerError,
                    "producer is closed",
                ));
            }
            rx.await.unwrap_or_else(|_| {
                Err(ClientError::new(
                    ErrorCode::UnknownServerError,
                    "producer stopped before delivery",
                ))
            })
        }
    }

    /// Sends every queued record now (without waiting for linger).
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The background task: groups records per partition and dispatches batches.
async fn accumulate(shared: Arc<Shared>, mut rx: mpsc::Receiver<Command>) {
    let mut batches: HashMap<(String, u32), (Vec<Pending>, usize, Instant)> = HashMap::new();
    let mut senders: HashMap<(String, u32), mpsc::Sender<Vec<Pending>>> = HashMap::new();
    let linger = shared.config.linger;
    let mut tick = tokio::time::interval(linger.max(Duration::from_millis(1)));
    loop {
        tokio::select! {
            command = rx.recv() => match command {
                None => {
                    for (key, (records, _, _)) in batches.drain() {
                        dispatch(&shared, &mut senders, key, records).await;
                    }
                    return;
                }
                Some(Command::Flush(done)) => {
                    for (key, (records, _, _)) in batches.drain() {
                        dispatch(&shared, &mut senders, key, records).await;
                    }
                    let _ = done.send(());
                }
                Some(Command::Send(record, done, oneway)) => {
                    let partition = match resolve_partition(&shared, &record).await {
                        Ok(p) => p,
                        Err(e) => {
                            let _ = done.send(Err(e));
                            continue;
                        }
                    };
                    let size = record.key.as_ref().map_or(0, |k| k.len())
                        + record.value.as_ref().map_or(0, |v| v.len())
                        + 24;
                    let key = (record.topic.clone(), partition);
                    let entry = batches.entry(key.clone()).or_insert_with(|| (Vec::new(), 0, Instant::now()));
                    entry.0.push(Pending { record, partition, done, oneway });
                    entry.1 += size;
                    if entry.1 >= shared.config.batch_size {
                        if let Some((records, _, _)) = batches.remove(&key) {
                            dispatch(&shared, &mut senders, key, records).await;
                        }
                    }
                }
            },
            _ = tick.tick() => {
                let due: Vec<(String, u32)> = batches
                    .iter()
                    .filter(|(_, (_, _, since))| since.elapsed() >= linger)
                    .map(|(k, _)| k.clone())
                    .collect();
                for key in due {
                    if let Some((records, _, _)) = batches.remove(&key) {
                        dispatch(&shared, &mut senders, key, records).await;
                    }
                }
            }
        }
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
    let count = route.leaders.len() as u32;
    match record.partition {
        Some(p) if p >= count => Err(ClientError::new(
            ErrorCode::UnknownTopicOrPartition,
            format!(
                "topic '{}' has {count} partitions; there is no partition {p}",
                record.topic
            ),
        )),
        Some(p) => Ok(p),
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
            None => Ok(shared.partitioner.partition(record.key.as_deref(), count)),
        },
    }
}

/// Queues a batch on its partition's sender, which sends batches one at a time, in order.
async fn dispatch(
    shared: &Arc<Shared>,
    senders: &mut HashMap<(String, u32), mpsc::Sender<Vec<Pending>>>,
    key: (String, u32),
    records: Vec<Pending>,
) {
    if records.iter().all(|p| p.record.key.is_none()) {
        shared.partitioner.batch_done();
    }
    let sender = senders.entry(key.clone()).or_insert_with(|| {
        let (tx, rx) = mpsc::channel(PARTITION_QUEUE_BATCHES);
        tokio::spawn(partition_sender(shared.clone(), key.clone(), rx));
        tx
    });
    if let Err(mpsc::error::SendError(records)) = sender.send(records).await {
        for p in records {
            let _ = p.done.send(Err(ClientError::new(
                ErrorCode::UnknownServerError,
                "partition sender stopped",
            )));
        }
    }
}

/// Sends one partition's batches in order, one in flight at a time.
async fn partition_sender(
    shared: Arc<Shared>,
    key: (String, u32),
    mut rx: mpsc::Receiver<Vec<Pending>>,
) {
    // (generation of the producer id, next sequence) for this partition.
    let mut sequence: (u64, i32) = (0, 0);
    while let Some(records) = rx.recv().await {
        let Ok(_permit) = shared.in_flight.acquire().await else {
            return;
        };
        let acks = if records.iter().all(|p| p.oneway) {
            0
        } else {
            shared.config.acks
        };
        let producer = if shared.config.enable_idempotence && acks != 0 {
            match shared.identity().await {
                Ok(identity) => {
                    if identity.generation != sequence.0 {
                        sequence = (identity.generation, 0);
                    }
                    Some((identity, sequence.1))
                }
                Err(e) => {
                    for p in records {
                        let _ = p.done.send(Err(e.clone()));
                    }
                    continue;
                }
            }
        } else {
            None
        };
        let result = send_batch(&shared, &key.0, key.1, &records, acks, producer).await;
        if let Some((identity, first)) = producer {
            match &result {
                Ok(_) => {
                    sequence.1 = first.wrapping_add(records.len() as i32) & i32::MAX;
                }
                Err(e) => {
                    tracing::debug!(topic = %key.0, partition = key.1, error = %e, "batch failed; taking a new producer id");
                    shared.abandon_identity(identity.generation).await;
                }
            }
        }
        for (i, p) in records.into_iter().enumerate() {
            let r = result.clone().map(|base| RecordMetadata {
                partition: p.partition,
                offset: if base < 0 { -1 } else { base + i as i64 },
            });
            let _ = p.done.send(r);
        }
    }
}

fn encode(
    records: &[Pending],
    compression: Compression,
    producer: Option<(Identity, i32)>,
) -> Result<Bytes, ClientError> {
    let now = now_ms();
    let mut builder = BatchBuilder::new(compression);
    if let Some((identity, first)) = producer {
        builder = builder.producer(identity.producer_id, identity.epoch, first);
    }
    let mut headers: Vec<(&str, Option<&[u8]>)> = Vec::new();
    for p in records {
        headers.clear();
        headers.extend(
            p.record
                .headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_deref())),
        );
        builder.push(RecordRef {
            timestamp: p.record.timestamp_ms.unwrap_or(now),
            key: p.record.key.as_deref(),
            value: p.record.value.as_deref(),
            headers: &headers,
        });
    }
    builder.build(0).map(Bytes::from).map_err(|e| {
        ClientError::new(
            ErrorCode::InvalidRequest,
            format!("cannot encode records: {e}"),
        )
    })
}

/// Sends one batch, retrying retriable errors (with the same bytes, so an idempotent
/// batch keeps its sequence numbers); returns the base offset.
async fn send_batch(
    shared: &Shared,
    topic: &str,
    partition: u32,
    records: &[Pending],
    acks: i32,
    producer: Option<(Identity, i32)>,
) -> Result<i64, ClientError> {
    let bytes = encode(records, shared.config.compression, producer)?;
    let deadline = Instant::now() + shared.config.delivery_timeout;
    let mut attempt = 0u32;
    loop {
        let outcome = async {
            let leader = shared.cluster.leader(topic, partition).await?;
            let channel = shared.cluster.connection().channel(&leader)?;
            let request = ProduceRequest {
                acks: Some(acks),
                timeout_ms: shared.config.request_timeout.as_millis() as u32,
                topics: vec![TopicProduceData {
                    topic: topic.to_owned(),
                    partitions: vec![PartitionProduceData {
                        partition,
                        records: Vec::new(),
                        record_batches: bytes.clone(),
                        compression: 0,
                    }],
                }],
            };
            let mut client = BrokerClient::new(channel);
            let response =
                tokio::time::timeout(shared.config.request_timeout, client.produce(request))
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
                    .map_err(ClientError::from)?
                    .into_inner();
            let p = response
                .topics
                .first()
                .and_then(|t| t.partitions.first())
                .ok_or_else(|| {
                    ClientError::new(ErrorCode::UnknownServerError, "empty produce response")
                })?;
            if let Some(e) = ClientError::from_partition(p.error_code, &p.error_message) {
                return Err(e);
            }
            Ok(p.base_offset)
        }
        .await;
        match outcome {
            Ok(base) => return Ok(base),
            Err(e)
                if e.is_retriable()
                    && attempt < shared.config.retries
                    && Instant::now() < deadline =>
            {
                attempt += 1;
                tracing::debug!(%topic, partition, error = %e, attempt, "produce failed; retrying");
                let _ = shared.cluster.refresh(topic).await;
                tokio::time::sleep(shared.config.retry_backoff).await;
            }
            Err(e) => return Err(e),
        }
    }
}
