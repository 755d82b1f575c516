//! The public `tidelog.v1.Broker` service: produce, fetch, list offsets and metadata.
//! Records arrive as fields (any language) or as encoded RecordBatch bytes (fast clients);
//! per-partition failures are reported in the response, each with its error code.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tonic::{Request, Response, Status};

use super::convert;
use super::proto::broker_server::Broker;
use super::proto::{
    self, BrokerAddress, CancelScheduledRequest, CancelScheduledResponse, ConsumedRecord,
    FetchPartitionResponse, FetchRequest, FetchResponse, FetchTopicResponse,
    ListOffsetsPartitionResponse, ListOffsetsRequest, ListOffsetsResponse,
    ListOffsetsTopicResponse, MetadataRequest, MetadataResponse, PartitionProduceResponse,
    ProduceRequest, ProduceResponse, SubscribeRequest, TopicProduceResponse,
};
use super::push_service::{PushStream, PUSH_SESSIONS_MAX};
use super::status::{error_status, to_wire};
use super::timer_service::TimerFront;
use crate::broker::node::{now_ms, Acks, FetchTarget, OffsetQuery};
use crate::broker::timer::codec::TimerId;
use crate::broker::timer::schedule_entry;
use crate::broker::{BrokerError, BrokerNode};
use crate::client::AdminClient;
use crate::controller::validation;
use crate::error_code::ErrorCode;
use crate::filter::{RecordFilter, SqlFilter, TagFilter};
use crate::partition::{FetchData, MAX_UNCOMPRESSED_BATCH_BYTES};
use crate::record::control::AbortedRanges;
use crate::record::tag::{check_tag, split_tag, TAG_HEADER};
use crate::record::{decode_committed_records, BatchBuilder, BatchIter, Compression, RecordRef};

/// How long an acks=all produce waits for replication when the request gives no timeout.
const PRODUCE_TIMEOUT_DEFAULT_MS: u64 = 30_000;

/// Most partitions one Produce, Fetch or ListOffsets request may name: bounds the work
/// and the response one request can cause (clients split larger sets).
pub const PARTITIONS_PER_REQUEST_MAX: usize = 1_000;

/// Default fetch response bound when the request gives none.
const FETCH_BYTES_DEFAULT: usize = 50 * 1024 * 1024;

/// Serves the Broker service of one broker.
pub struct BrokerService {
    node: BrokerNode,
    /// Set when `auto_create_topics_enable`: creates unknown topics named in Metadata.
    auto_create: Option<AdminClient>,
    /// Bounds the acks=0 appends still running after their answer was sent.
    acks0_in_flight: Arc<tokio::sync::Semaphore>,
    /// Bounds the push subscriptions served at once.
    push_sessions: Arc<tokio::sync::Semaphore>,
    /// Durable timers for records produced with a delay; without them such records are
    /// refused.
    timers: Option<Arc<TimerFront>>,
}

/// Most acks=0 appends running at once after their answer; further acks=0 produces wait
/// for one to finish before they are answered (backpressure instead of unbounded tasks).
pub const ACKS0_IN_FLIGHT_MAX: usize = 1024;

impl BrokerService {
    /// A service over `node`; `auto_create` creates unknown topics on first use.
    pub fn new(node: BrokerNode, auto_create: Option<AdminClient>) -> Self {
        Self {
            node,
            auto_create,
            acks0_in_flight: Arc::new(tokio::sync::Semaphore::new(ACKS0_IN_FLIGHT_MAX)),
            push_sessions: Arc::new(tokio::sync::Semaphore::new(PUSH_SESSIONS_MAX)),
            timers: None,
        }
    }

    /// Schedules records produced with a delay through `timers`.
    pub fn with_timers(mut self, timers: Arc<TimerFront>) -> Self {
        self.timers = Some(timers);
        self
    }

    /// Creates `names` with the default partition count and replication factor, then waits
    /// (up to 5 s) until this broker's metadata holds them.
    async fn auto_create(&self, admin: &AdminClient, names: &[String]) {
        for name in names {
            match admin
                .create_topic(name, None, None, Default::default())
                .await
            {
                Ok(_) => tracing::info!(topic = %name, "auto-created topic"),
                Err(e) if e.code == ErrorCode::TopicAlreadyExists => {}
                Err(e) => {
                    tracing::warn!(topic = %name, error = %e, "auto-create failed");
                    return;
                }
            }
        }
        let mut version = self.node.metadata().subscribe();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !names
            .iter()
            .all(|n| self.node.metadata().topic(n).is_some())
        {
            if tokio::time::timeout_at(deadline, version.changed())
                .await
                .is_err()
            {
                return;
            }
        }
    }
}

/// The codec a produce request names; an unknown enum value is refused, never stored
/// uncompressed in silence.
fn compression(partition: u32, c: i32) -> Result<Compression, BrokerError> {
    let Ok(wire) = proto::Compression::try_from(c) else {
        return Err(BrokerError::new(
            ErrorCode::InvalidRequest,
            format!(
                "partition {partition}: compression {c} is not a known codec (0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd)"
            ),
        ));
    };
    Ok(match wire {
        proto::Compression::None => Compression::None,
        proto::Compression::Gzip => Compression::Gzip,
        proto::Compression::Snappy => Compression::Snappy,
        proto::Compression::Lz4 => Compression::Lz4,
        proto::Compression::Zstd => Compression::Zstd,
    })
}

/// Refuses more than [`PARTITIONS_PER_REQUEST_MAX`] partitions in one `request`.
fn check_partition_count(request: &str, count: usize) -> Result<(), Status> {
    if count > PARTITIONS_PER_REQUEST_MAX {
        return Err(error_status(
            ErrorCode::InvalidRequest,
            format!(
                "{request} names {count} partitions; the limit is {PARTITIONS_PER_REQUEST_MAX} per request: split it"
            ),
            None,
        ));
    }
    Ok(())
}

/// Encodes the records of one partition as one batch.
fn encode_records(data: &proto::PartitionProduceData) -> Result<Vec<u8>, BrokerError> {
    if !data.record_batches.is_empty() {
        if !data.records.is_empty() {
            return Err(BrokerError::new(
                ErrorCode::InvalidRequest,
                "give either records or record_batches, not both",
            ));
        }
        return Ok(data.record_batches.to_vec());
    }
    if data.records.is_empty() {
        return Err(BrokerError::new(
            ErrorCode::InvalidRequest,
            format!("partition {}: no records", data.partition),
        ));
    }
    let now = now_ms();
    let mut builder = BatchBuilder::new(compression(data.partition, data.compression)?);
    let mut header_buf: Vec<(&str, Option<&[u8]>)> = Vec::new();
    for (i, r) in data.records.iter().enumerate() {
        if let Some(ts) = r.timestamp_ms.filter(|ts| *ts < 0) {
            return Err(BrokerError::new(
                ErrorCode::InvalidRecord,
                format!(
                    "partition {}: record {i} has timestamp_ms {ts}; timestamps must be >= 0 (leave it out for the broker's clock)",
                    data.partition
                ),
            ));
        }
        header_buf.clear();
        header_buf.extend(
            r.headers
                .iter()
                .map(|h| (h.key.as_str(), h.value.as_deref())),
        );
        if let Some(tag) = &r.tag {
            let refuse = |why: String| {
                BrokerError::new(
                    ErrorCode::InvalidRecord,
                    format!("partition {}: record {i}: tag {why}", data.partition),
                )
            };
            check_tag(tag).map_err(refuse)?;
            if r.headers.iter().any(|h| h.key == TAG_HEADER) {
                return Err(refuse(format!(
                    "and a '{TAG_HEADER}' header are both given; give one"
                )));
            }
            header_buf.push((TAG_HEADER, Some(tag.as_bytes())));
        }
        builder.push(RecordRef {
            timestamp: r.timestamp_ms.unwrap_or(now),
            key: r.key.as_deref(),
            value: r.value.as_deref(),
            headers: &header_buf,
        });
    }
    builder.build(0).map_err(|e| {
        BrokerError::new(
            ErrorCode::InvalidRequest,
            format!("cannot encode records: {e}"),
        )
    })
}

fn leader_fields(e: &BrokerError) -> (Option<i32>, Option<String>) {
    match &e.leader {
        Some((id, addr)) => (Some(id.0), Some(addr.clone())),
        None => (None, None),
    }
}

/// The request's filter, parsed; `None` when it keeps every record.
pub(crate) fn parse_filter(
    filter: Option<&proto::RecordFilter>,
) -> Result<Option<Arc<RecordFilter>>, Status> {
    use proto::record_filter::Expression;
    let parsed = match filter.and_then(|f| f.expression.as_ref()) {
        None => return Ok(None),
        Some(Expression::Tag(text)) => TagFilter::parse(text).map(RecordFilter::Tag),
        Some(Expression::Sql(text)) => SqlFilter::parse(text).map(RecordFilter::Sql),
    }
    .map_err(|e| {
        error_status(
            ErrorCode::InvalidFilterExpression,
            format!("filter: {e}"),
            None,
        )
    })?;
    Ok((!parsed.keeps_everything()).then(|| Arc::new(parsed)))
}

/// Where the consumer of `d` (read from `from`) continues: the filter's offset, else after
/// the last batch returned, else where it asked.
fn next_fetch_offset(d: &FetchData, from: u64) -> i64 {
    if let Some(next) = d.next_offset {
        return next.as_i64();
    }
    let mut next = from;
    for batch in BatchIter::new(&d.records) {
        match batch {
            Ok(b) => next = next.max(b.header().next_offset() as u64),
            Err(_) => break,
        }
    }
    next as i64
}

/// Whether a request's `isolation` is READ_COMMITTED; INVALID_REQUEST for a value that
/// is no isolation level.
pub(crate) fn read_committed_of(what: &str, isolation: i32) -> Result<bool, Status> {
    match proto::IsolationLevel::try_from(isolation) {
        Ok(level) => Ok(level == proto::IsolationLevel::ReadCommitted),
        Err(_) => Err(error_status(
            ErrorCode::InvalidRequest,
            format!("{what}: isolation must be READ_UNCOMMITTED (0) or READ_COMMITTED (1), got {isolation}"),
            None,
        )),
    }
}

/// Decodes the records of `batches` at or after `from`, leaving out `aborted` ones.
pub(crate) fn decode_records(
    batches: &Bytes,
    from: u64,
    aborted: &AbortedRanges,
) -> Result<Vec<ConsumedRecord>, BrokerError> {
    let records = decode_committed_records(batches, MAX_UNCOMPRESSED_BATCH_BYTES, aborted)
        .map_err(|e| BrokerError::new(ErrorCode::CorruptMessage, format!("stored batch: {e}")))?;
    Ok(records
        .into_iter()
        .filter(|r| r.offset as u64 >= from)
        .map(|r| {
            // The tag header shows as `tag` (an invalid one stays a plain header).
            let (tag, headers) = split_tag(r.headers);
            ConsumedRecord {
                offset: r.offset,
                timestamp_ms: r.timestamp,
                key: r.key,
                value: r.value,
                headers: headers
                    .into_iter()
                    .map(|h| proto::Header {
                        key: h.key,
                        value: h.value,
                    })
                    .collect(),
                tag,
            }
        })
        .collect())
}

#[tonic::async_trait]
impl Broker for BrokerService {
    async fn produce(
        &self,
        request: Request<ProduceRequest>,
    ) -> Result<Response<ProduceResponse>, Status> {
        self.produce_response(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn fetch(
        &self,
        request: Request<FetchRequest>,
    ) -> Result<Response<FetchResponse>, Status> {
        self.fetch_response(request.into_inner())
            .await
            .map(Response::new)
    }

    type SubscribeStream = PushStream;

    async fn subscribe(
        &self,
        request: Request<tonic::Streaming<SubscribeRequest>>,
    ) -> Result<Response<PushStream>, Status> {
        self.subscribe_stream(request.into_inner())
            .await
            .map(Response::new)
    }

    async fn cancel_scheduled(
        &self,
        request: Request<CancelScheduledRequest>,
    ) -> Result<Response<CancelScheduledResponse>, Status> {
        let text = request.into_inner().id;
        let Some(front) = &self.timers else {
            return Err(error_status(
                ErrorCode::UnknownScheduledRecord,
                "this server schedules no records",
                None,
            ));
        };
        let id: TimerId = text
            .parse()
            .map_err(|e: String| error_status(ErrorCode::UnknownScheduledRecord, e, None))?;
        front
            .timers()
            .cancel(id)
            .await
            .map_err(|e| error_status(e.code, e.message, None))?;
        Ok(Response::new(CancelScheduledResponse {}))
    }

    async fn list_offsets(
        &self,
        request: Request<ListOffsetsRequest>,
    ) -> Result<Response<ListOffsetsResponse>, Status> {
        let r = request.into_inner();
        check_partition_count(
            "list-offsets request",
            r.topics.iter().map(|t| t.partitions.len()).sum(),
        )?;
        let read_committed = read_committed_of("list-offsets request", r.isolation)?;
        let mut topics = Vec::new();
        for t in r.topics {
            let mut partitions = Vec::new();
            for p in t.partitions {
                let query = match p.timestamp_ms {
                    -2 => OffsetQuery::Earliest,
                    -1 if read_committed => OffsetQuery::LastStable,
                    -1 => OffsetQuery::Latest,
                    -3 => OffsetQuery::MaxTimestamp,
                    ts if ts >= 0 => OffsetQuery::Timestamp(ts),
                    ts => {
                        return Err(error_status(
                            ErrorCode::InvalidRequest,
                            format!("timestamp_ms must be -3, -2, -1 or >= 0, got {ts}"),
                            None,
                        ))
                    }
                };
                partitions.push(
                    match self.node.list_offset(&t.topic, p.partition, query).await {
                        Ok((offset, timestamp_ms)) => ListOffsetsPartitionResponse {
                            partition: p.partition,
                            offset,
                            timestamp_ms,
                            ..Default::default()
                        },
                        Err(e) => {
                            let (leader_id, leader_address) = leader_fields(&e);
                            ListOffsetsPartitionResponse {
                                partition: p.partition,
                                error_code: to_wire(e.code),
                                error_message: e.message,
                                offset: -1,
                                timestamp_ms: -1,
                                leader_id,
                                leader_address,
                            }
                        }
                    },
                );
            }
            topics.push(ListOffsetsTopicResponse {
                topic: t.topic,
                partitions,
            });
        }
        Ok(Response::new(ListOffsetsResponse { topics }))
    }

    async fn metadata(
        &self,
        request: Request<MetadataRequest>,
    ) -> Result<Response<MetadataResponse>, Status> {
        let wanted = request.into_inner().topics;
        if let Some(admin) = &self.auto_create {
            // Reserved internal topics are never auto-created for a client.
            let missing: Vec<String> = wanted
                .iter()
                .filter(|n| !validation::is_reserved_topic(n))
                .filter(|n| self.node.metadata().topic(n).is_none())
                .cloned()
                .collect();
            if !missing.is_empty() {
                self.auto_create(admin, &missing).await;
            }
        }
        let cache = self.node.metadata();
        let version = cache.version();
        let response = cache.read(|image| {
            let brokers = image
                .unfenced_brokers()
                .map(|b| BrokerAddress {
                    id: b.id.0,
                    address: b.address.clone(),
                    rack: b.rack.clone(),
                })
                .collect();
            let (topics, unknown_topics) = if wanted.is_empty() {
                (
                    image.topics.values().map(convert::topic_to_proto).collect(),
                    Vec::new(),
                )
            } else {
                let mut found = Vec::new();
                let mut unknown = Vec::new();
                for name in &wanted {
                    match image.topics.get(name) {
                        Some(t) => found.push(convert::topic_to_proto(t)),
                        None => unknown.push(name.clone()),
                    }
                }
                (found, unknown)
            };
            MetadataResponse {
                cluster_id: image.cluster_id.clone().unwrap_or_default(),
                brokers,
                topics,
                unknown_topics,
                metadata_version: version,
            }
        });
        Ok(Response::new(response))
    }
}

impl BrokerService {
    /// Answers a Produce request: the tonic handler's work, shared with the listener's
    /// path that reads record batches from the request's frames in place
    /// (`api::fast_path`).
    pub async fn produce_response(&self, r: ProduceRequest) -> Result<ProduceResponse, Status> {
        if r.topics.is_empty() {
            return Err(error_status(
                ErrorCode::InvalidRequest,
                "produce request names no topic",
                None,
            ));
        }
        check_partition_count(
            "produce request",
            r.topics.iter().map(|t| t.partitions.len()).sum(),
        )?;
        // A request without acks gets the durable default, as Kafka's producer does.
        let acks = r.acks.unwrap_or(-1);
        if !matches!(acks, -1..=1) {
            return Err(error_status(
                ErrorCode::InvalidRequest,
                format!("acks must be 0, 1 or -1 (all), got {acks}"),
                None,
            ));
        }
        let timeout = Duration::from_millis(if r.timeout_ms == 0 {
            PRODUCE_TIMEOUT_DEFAULT_MS
        } else {
            u64::from(r.timeout_ms)
        });
        // Every partition at once: acks=all waits overlap instead of adding up.
        let mut pending = Vec::new();
        let transactional_id = r.transactional_id.as_deref();
        for t in &r.topics {
            for p in &t.partitions {
                let topic = t.topic.as_str();
                pending.push(async move {
                    let outcome = self
                        .produce_partition(topic, p, acks, timeout, transactional_id)
                        .await;
                    (topic, p.partition, outcome)
                });
            }
        }
        let outcomes = futures_util::future::join_all(pending).await;
        let mut topics: Vec<TopicProduceResponse> = Vec::with_capacity(r.topics.len());
        for (topic, partition, outcome) in outcomes {
            let response = match outcome {
                Ok((base, start, scheduled_ids)) => PartitionProduceResponse {
                    partition,
                    base_offset: base,
                    log_start_offset: start,
                    scheduled_ids,
                    ..Default::default()
                },
                Err(e) => {
                    let (leader_id, leader_address) = leader_fields(&e);
                    PartitionProduceResponse {
                        partition,
                        error_code: to_wire(e.code),
                        error_message: e.message,
                        base_offset: -1,
                        log_start_offset: -1,
                        leader_id,
                        leader_address,
                        scheduled_ids: Vec::new(),
                    }
                }
            };
            match topics.last_mut() {
                Some(last) if last.topic == topic => last.partitions.push(response),
                _ => topics.push(TopicProduceResponse {
                    topic: topic.to_owned(),
                    partitions: vec![response],
                }),
            }
        }
        Ok(ProduceResponse { topics })
    }

    /// Serves a Subscribe call: the tonic handler's work, shared with the listener's path
    /// that sends pushed record batches without copying them (`api::fast_path`).
    pub async fn subscribe_stream(
        &self,
        inbound: tonic::Streaming<SubscribeRequest>,
    ) -> Result<PushStream, Status> {
        super::push_service::subscribe(self.node.clone(), self.push_sessions.clone(), inbound).await
    }

    /// Answers a Fetch request: the tonic handler's work, shared with the listener's
    /// path that sends record batches without copying them (`api::fast_path`).
    pub async fn fetch_response(&self, r: FetchRequest) -> Result<FetchResponse, Status> {
        let max_bytes = if r.max_bytes == 0 {
            FETCH_BYTES_DEFAULT
        } else {
            r.max_bytes as usize
        };
        check_partition_count(
            "fetch request",
            r.topics.iter().map(|t| t.partitions.len()).sum(),
        )?;
        let filter = parse_filter(r.filter.as_ref())?;
        let read_committed = read_committed_of("fetch request", r.isolation)?;
        let mut targets = Vec::new();
        for t in &r.topics {
            for p in &t.partitions {
                if p.fetch_offset < 0 {
                    return Err(error_status(
                        ErrorCode::InvalidRequest,
                        format!(
                            "{}-{}: fetch_offset must be >= 0, got {}",
                            t.topic, p.partition, p.fetch_offset
                        ),
                        None,
                    ));
                }
                targets.push(FetchTarget {
                    topic: t.topic.clone(),
                    partition: p.partition,
                    offset: p.fetch_offset as u64,
                    max_bytes: if p.partition_max_bytes == 0 {
                        max_bytes
                    } else {
                        p.partition_max_bytes as usize
                    },
                    filter: filter.clone(),
                    follower_ok: r.read_from_follower,
                    read_committed,
                });
            }
        }
        if targets.is_empty() {
            return Err(error_status(
                ErrorCode::InvalidRequest,
                "fetch request names no partition",
                None,
            ));
        }
        let results = self
            .node
            .fetch(
                targets.clone(),
                Duration::from_millis(r.max_wait_ms.into()),
                r.min_bytes as usize,
                max_bytes,
            )
            .await;
        let mut topics: Vec<FetchTopicResponse> = Vec::new();
        for (target, result) in targets.into_iter().zip(results) {
            let response = match result.and_then(|d| {
                let records = if r.raw_batches {
                    Vec::new()
                } else {
                    decode_records(&d.records, target.offset, &d.aborted_ranges())?
                };
                Ok((d, records))
            }) {
                Ok((d, records)) => FetchPartitionResponse {
                    partition: target.partition,
                    next_fetch_offset: next_fetch_offset(&d, target.offset),
                    high_watermark: d.high_watermark.as_i64(),
                    log_start_offset: d.log_start_offset.as_i64(),
                    log_end_offset: d.log_end_offset.as_i64(),
                    last_stable_offset: d.last_stable_offset.as_i64(),
                    aborted_transactions: if r.raw_batches {
                        d.aborted_transactions
                            .iter()
                            .map(|a| proto::AbortedTransaction {
                                producer_id: a.producer_id,
                                first_offset: a.first_offset as i64,
                                last_offset: a.last_offset as i64,
                            })
                            .collect()
                    } else {
                        Vec::new()
                    },
                    record_batches: if r.raw_batches {
                        d.records
                    } else {
                        Bytes::new()
                    },
                    records,
                    ..Default::default()
                },
                Err(e) => {
                    let (leader_id, leader_address) = leader_fields(&e);
                    FetchPartitionResponse {
                        partition: target.partition,
                        error_code: to_wire(e.code),
                        error_message: e.message,
                        high_watermark: -1,
                        log_start_offset: -1,
                        log_end_offset: -1,
                        leader_id,
                        leader_address,
                        ..Default::default()
                    }
                }
            };
            match topics.iter_mut().find(|t| t.topic == target.topic) {
                Some(t) => t.partitions.push(response),
                None => topics.push(FetchTopicResponse {
                    topic: target.topic,
                    partitions: vec![response],
                }),
            }
        }
        Ok(FetchResponse { topics })
    }

    /// One partition of a Produce: appended, or, when its records carry a delay, scheduled
    /// (every record is checked before anything is written).
    async fn produce_partition(
        &self,
        topic: &str,
        p: &proto::PartitionProduceData,
        acks: i32,
        timeout: Duration,
        transactional_id: Option<&str>,
    ) -> Result<(i64, i64, Vec<String>), BrokerError> {
        let delayed = |r: &proto::Record| r.delay_ms.is_some() || r.deliver_at_ms.is_some();
        if !p.records.iter().any(delayed) {
            return self
                .produce_one(
                    topic,
                    p.partition,
                    encode_records(p)?,
                    (acks, timeout),
                    transactional_id,
                )
                .await;
        }
        validation::check_client_may_change(topic, "produce to")
            .map_err(|e| BrokerError::new(e.code, e.message))?;
        let Some(front) = &self.timers else {
            return Err(BrokerError::new(
                ErrorCode::InvalidRequest,
                "this server does not schedule delayed records",
            ));
        };
        if !p.records.iter().all(delayed) {
            // Scheduling and appending cannot fail or succeed together: a retry after a
            // failed append would schedule the delayed ones twice.
            return Err(BrokerError::new(
                ErrorCode::InvalidRequest,
                format!(
                    "partition {}: some records have delay_ms or deliver_at_ms and some do not; send scheduled records in a request (or partition entry) of their own",
                    p.partition
                ),
            ));
        }
        let now = now_ms();
        let mut entries = Vec::with_capacity(p.records.len());
        for (i, r) in p.records.iter().enumerate().filter(|(_, r)| delayed(r)) {
            let due = front
                .timers()
                .due_time(now, r.delay_ms, r.deliver_at_ms)
                .map_err(|why| {
                    BrokerError::new(
                        ErrorCode::InvalidDelay,
                        format!(
                            "partition {}: record {i}: {why}; nothing was written",
                            p.partition
                        ),
                    )
                })?;
            let mut headers: Vec<(String, Option<Bytes>)> = r
                .headers
                .iter()
                .map(|h| (h.key.clone(), h.value.clone()))
                .collect();
            if let Some(tag) = &r.tag {
                headers.push((TAG_HEADER.to_owned(), Some(Bytes::from(tag.clone()))));
            }
            let entry = schedule_entry(
                topic,
                p.partition,
                due,
                r.timestamp_ms.unwrap_or(now),
                r.key.clone(),
                r.value.clone(),
                headers,
            );
            front.check_size(&entry, i)?;
            entries.push(entry);
        }
        // Every record passes the same checks as an appended one (tags, timestamps,
        // sizes) before anything is written.
        encode_records(p)?;
        let ids = front.schedule(topic, p.partition, entries).await?;
        let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
        Ok((-1, -1, ids))
    }

    async fn produce_one(
        &self,
        topic: &str,
        partition: u32,
        bytes: Vec<u8>,
        (acks, timeout): (i32, Duration),
        transactional_id: Option<&str>,
    ) -> Result<(i64, i64, Vec<String>), BrokerError> {
        validation::check_client_may_change(topic, "produce to")
            .map_err(|e| BrokerError::new(e.code, e.message))?;
        if acks == 0 {
            // Checked now so a misdirected acks=0 produce is at least logged.
            self.node.leader_partition(topic, partition)?;
            let node = self.node.clone();
            let (topic, owned) = (topic.to_owned(), bytes);
            let permit = self
                .acks0_in_flight
                .clone()
                .acquire_owned()
                .await
                .expect("the semaphore is never closed");
            tokio::spawn(async move {
                let _permit = permit;
                if let Err(e) = node
                    .produce(&topic, partition, owned, Acks::Leader, timeout)
                    .await
                {
                    tracing::debug!(error = %e, "acks=0 produce failed");
                }
            });
            return Ok((-1, -1, Vec::new()));
        }
        let acks = if acks == -1 { Acks::All } else { Acks::Leader };
        let produced = self
            .node
            .produce_as(topic, partition, bytes, acks, timeout, transactional_id)
            .await?;
        Ok((
            produced.base_offset.map_or(-1, |o| o.as_i64()),
            produced.log_start_offset.as_i64(),
            produced.scheduled_ids,
        ))
    }
}
