//! The consumer's push mode ([`super::consumer::Consumer::enable_push`]): instead of
//! fetch requests, one `Broker.Subscribe` stream per leader broker pushes the assigned
//! partitions' records as they are committed.
//!
//! The feed places each assigned partition on the stream of its leader (opening the
//! stream with the first partition, adding later ones with SubscribeAssign) and takes it
//! off again when the partition is unassigned or moved by a seek. A partition whose
//! leader moved, or whose stream broke, is placed again at its position after a metadata
//! refresh: the stream resumes exactly where the records handed out end. Window space is
//! given back as records are handed out by `poll`, so the client holds at most one
//! window of records per broker that the application has not taken.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;

use super::cluster::Cluster;
use super::consumer::ConsumerRecord;
use super::error::ClientError;
use crate::api::broker_service::PARTITIONS_PER_REQUEST_MAX;
use crate::api::proto::broker_client::BrokerClient;
use crate::api::proto::{
    subscribe_request, subscribe_response, FetchPartition, FetchTopic, IsolationLevel,
    RecordFilter, SubscribeAssign, SubscribeCredit, SubscribeHeartbeat, SubscribeRequest,
    SubscribeStart, SubscribeUnassign, TopicPartitions,
};
use crate::api::status::code_of;
use crate::error_code::ErrorCode;

/// A topic partition.
type Tp = (String, u32);

/// Largest pushed message the feed accepts.
const MESSAGE_BYTES_MAX: usize = 64 * 1024 * 1024;
/// How long a broker whose stream broke is left alone before the feed opens another.
const REOPEN_BACKOFF: Duration = Duration::from_millis(500);

/// Push settings: the window each broker may fill, and the heartbeat interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushSettings {
    /// Records the client takes in per broker before it gives credit back.
    pub window_records: u32,
    /// Bytes likewise (1 KiB to 50 MiB).
    pub window_bytes: u32,
    /// Heartbeats each way; a side silent for 3 intervals is taken as gone.
    pub heartbeat: Duration,
}

impl Default for PushSettings {
    fn default() -> Self {
        Self {
            window_records: 1000,
            window_bytes: 8 * 1024 * 1024,
            heartbeat: Duration::from_secs(3),
        }
    }
}

/// What a stream's reader task reports.
enum Event {
    Records {
        broker: String,
        stream: u64,
        assignment: u64,
        topic: String,
        partition: u32,
        batches: Bytes,
        next_offset: i64,
        count: u32,
        bytes: u64,
    },
    PartitionError {
        assignment: u64,
        topic: String,
        partition: u32,
        error: ClientError,
    },
    Closed {
        broker: String,
        stream: u64,
        error: ClientError,
    },
}

/// One open subscription stream.
struct Stream {
    id: u64,
    requests: mpsc::Sender<SubscribeRequest>,
    task: tokio::task::JoinHandle<()>,
    /// Window space taken in and not yet returned: (records, bytes).
    owed: (u32, u64),
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The push side of a consumer.
pub struct PushFeed {
    settings: PushSettings,
    filter: Option<RecordFilter>,
    read_committed: bool,
    streams: HashMap<String, Stream>,
    /// Where each placed partition is streamed from: broker, stream id, assignment id.
    placed: BTreeMap<Tp, (String, u64, u64)>,
    /// Partitions to take off and place again (moved by a seek).
    moved: BTreeSet<Tp>,
    /// Brokers whose stream broke, and when.
    broken: HashMap<String, Instant>,
    next_stream: u64,
    next_assignment: u64,
    events_tx: mpsc::UnboundedSender<Event>,
    events: mpsc::UnboundedReceiver<Event>,
    /// An error met after records were already taken in: raised by the next poll, so
    /// those records are returned first.
    pending_error: Option<ClientError>,
}

impl PushFeed {
    /// A feed with `settings`, pushing only records that pass `filter`.
    pub fn new(settings: PushSettings, filter: Option<RecordFilter>) -> Self {
        let (events_tx, events) = mpsc::unbounded_channel();
        Self {
            settings,
            filter,
            read_committed: false,
            streams: HashMap::new(),
            placed: BTreeMap::new(),
            moved: BTreeSet::new(),
            broken: HashMap::new(),
            next_stream: 0,
            next_assignment: 0,
            events_tx,
            events,
            pending_error: None,
        }
    }

    /// A filter for streams opened from now on (the consumer's streams are reopened).
    pub fn set_filter(&mut self, filter: Option<RecordFilter>) {
        self.filter = filter;
        self.streams.clear();
        self.placed.clear();
    }

    /// Read committed records only (Kafka's `isolation.level=read_committed`), for
    /// streams opened from now on (the consumer's streams are reopened on a change).
    pub fn set_read_committed(&mut self, on: bool) {
        if self.read_committed != on {
            self.read_committed = on;
            self.streams.clear();
            self.placed.clear();
        }
    }

    /// Notes that a partition's position was set from outside (assign or seek): its
    /// stream restarts there.
    pub fn moved(&mut self, topic: &str, partition: u32) {
        self.moved.insert((topic.to_owned(), partition));
    }

    /// Pushed records of `positions`' partitions, waiting up to `max_wait`; advances
    /// positions past what it returns.
    pub async fn poll(
        &mut self,
        cluster: &Cluster,
        positions: &mut BTreeMap<Tp, i64>,
        max_wait: Duration,
    ) -> Result<Vec<ConsumerRecord>, ClientError> {
        if let Some(e) = self.pending_error.take() {
            return Err(e);
        }
        self.place(cluster, positions).await?;
        let mut out = Vec::new();
        let mut stale = BTreeSet::new();
        let deadline = tokio::time::Instant::now() + max_wait;
        // Wait for the first event, then take whatever else is there.
        let first = match tokio::time::timeout_at(deadline, self.events.recv()).await {
            Ok(Some(e)) => Some(e),
            _ => None,
        };
        let mut next = first;
        while let Some(event) = next {
            if let Err(e) = self.take(event, positions, &mut out, &mut stale) {
                // Positions already moved past `out`: hand it out, fail the next poll.
                if out.is_empty() {
                    return Err(e);
                }
                self.pending_error = Some(e);
                break;
            }
            next = self.events.try_recv().ok();
            if out.len() >= 100_000 {
                break;
            }
        }
        self.give_credit().await;
        for topic in stale {
            let _ = cluster.refresh(&topic).await;
        }
        Ok(out)
    }

    /// Handles one event.
    fn take(
        &mut self,
        event: Event,
        positions: &mut BTreeMap<Tp, i64>,
        out: &mut Vec<ConsumerRecord>,
        stale: &mut BTreeSet<String>,
    ) -> Result<(), ClientError> {
        match event {
            Event::Records {
                broker,
                stream,
                assignment,
                topic,
                partition,
                batches,
                next_offset,
                count,
                bytes,
            } => {
                // Handed out (or dropped as stale): either way the window space is free.
                if let Some(s) = self.streams.get_mut(&broker).filter(|s| s.id == stream) {
                    s.owed.0 = s.owed.0.saturating_add(count);
                    s.owed.1 = s.owed.1.saturating_add(bytes);
                }
                let key = (topic, partition);
                let current = self.placed.get(&key).map(|p| p.2) == Some(assignment);
                let Some(position) = positions.get_mut(&key).filter(|_| current) else {
                    return Ok(());
                };
                if !self.moved.contains(&key) {
                    let records = crate::record::decode_data_records_shared(
                        &batches,
                        crate::partition::MAX_UNCOMPRESSED_BATCH_BYTES,
                    )
                    .map_err(|e| {
                        ClientError::new(ErrorCode::CorruptMessage, format!("pushed batch: {e}"))
                    })?;
                    for r in records {
                        if r.offset < *position {
                            continue;
                        }
                        *position = r.offset + 1;
                        out.push(ConsumerRecord::from_stored(key.0.clone(), key.1, r));
                    }
                    *position = (*position).max(next_offset);
                }
            }
            Event::PartitionError {
                assignment,
                topic,
                partition,
                error,
            } => {
                let key = (topic, partition);
                if self.placed.get(&key).map(|p| p.2) == Some(assignment) {
                    self.placed.remove(&key);
                    if !error.is_retriable() && positions.contains_key(&key) {
                        return Err(error);
                    }
                    stale.insert(key.0);
                }
            }
            Event::Closed {
                broker,
                stream,
                error,
            } => {
                if self.streams.get(&broker).is_some_and(|s| s.id == stream) {
                    tracing::debug!(%broker, error = %error, "push stream closed; placing its partitions again");
                    self.streams.remove(&broker);
                    self.broken.insert(broker.clone(), Instant::now());
                    let gone: Vec<Tp> = self
                        .placed
                        .iter()
                        .filter(|(_, (b, id, _))| *b == broker && *id == stream)
                        .map(|(k, _)| k.clone())
                        .collect();
                    for k in gone {
                        stale.insert(k.0.clone());
                        self.placed.remove(&k);
                    }
                    if !error.is_retriable() {
                        return Err(error);
                    }
                }
            }
        }
        Ok(())
    }

    /// Returns the window space taken in since the last poll: one credit per stream.
    async fn give_credit(&mut self) {
        for s in self.streams.values_mut() {
            let (records, bytes) = std::mem::take(&mut s.owed);
            if records == 0 && bytes == 0 {
                continue;
            }
            let credit = SubscribeRequest {
                message: Some(subscribe_request::Message::Credit(SubscribeCredit {
                    records,
                    bytes,
                })),
            };
            // A closed stream is noticed by its reader task.
            let _ = s.requests.send(credit).await;
        }
    }

    /// Matches the streams to `positions`: takes off partitions no longer assigned (or
    /// moved), places the others on their leader's stream.
    async fn place(
        &mut self,
        cluster: &Cluster,
        positions: &BTreeMap<Tp, i64>,
    ) -> Result<(), ClientError> {
        let mut off: HashMap<String, Vec<Tp>> = HashMap::new();
        let placed: Vec<Tp> = self.placed.keys().cloned().collect();
        for key in placed {
            if !positions.contains_key(&key) || self.moved.contains(&key) {
                let (broker, _, _) = self.placed.remove(&key).expect("listed");
                off.entry(broker).or_default().push(key);
            }
        }
        self.moved.clear();
        for (broker, keys) in off {
            if let Some(s) = self.streams.get(&broker) {
                let unassign = SubscribeRequest {
                    message: Some(subscribe_request::Message::Unassign(SubscribeUnassign {
                        topics: group_by_topic(keys.iter().map(|k| (k.clone(), ())))
                            .into_iter()
                            .map(|(topic, ps)| TopicPartitions {
                                topic,
                                partitions: ps.into_iter().map(|(p, _)| p).collect(),
                            })
                            .collect(),
                    })),
                };
                let _ = s.requests.send(unassign).await;
            }
        }
        let mut by_broker: HashMap<String, Vec<(Tp, i64)>> = HashMap::new();
        for (key, offset) in positions {
            if self.placed.contains_key(key) {
                continue;
            }
            match cluster.leader(&key.0, key.1).await {
                Ok(leader) => by_broker
                    .entry(leader)
                    .or_default()
                    .push((key.clone(), *offset)),
                Err(e) if e.is_retriable() => {}
                Err(e) => return Err(e),
            }
        }
        for (broker, parts) in by_broker {
            let held = self.placed.values().filter(|p| p.0 == broker).count();
            if held + parts.len() > PARTITIONS_PER_REQUEST_MAX {
                return Err(ClientError::new(
                    ErrorCode::InvalidConfig,
                    format!(
                        "push mode streams at most {PARTITIONS_PER_REQUEST_MAX} partitions per broker; {} are led by {broker}: consume them with fetches",
                        held + parts.len()
                    ),
                ));
            }
            if self
                .broken
                .get(&broker)
                .is_some_and(|t| t.elapsed() < REOPEN_BACKOFF)
            {
                continue;
            }
            let topics: Vec<FetchTopic> = group_by_topic(parts.iter().cloned())
                .into_iter()
                .map(|(topic, ps)| FetchTopic {
                    topic,
                    partitions: ps
                        .into_iter()
                        .map(|(partition, offset)| FetchPartition {
                            partition,
                            fetch_offset: offset,
                            partition_max_bytes: 0,
                        })
                        .collect(),
                })
                .collect();
            self.next_assignment += 1;
            let assignment = self.next_assignment;
            let id = match self.streams.get(&broker) {
                Some(s) => {
                    let assign = SubscribeRequest {
                        message: Some(subscribe_request::Message::Assign(SubscribeAssign {
                            topics,
                            assignment_id: assignment,
                        })),
                    };
                    if s.requests.send(assign).await.is_err() {
                        continue;
                    }
                    s.id
                }
                None => {
                    let stream = self.open(cluster, &broker, topics, assignment)?;
                    let id = stream.id;
                    self.streams.insert(broker.clone(), stream);
                    id
                }
            };
            for (key, _) in parts {
                self.placed.insert(key, (broker.clone(), id, assignment));
            }
        }
        Ok(())
    }

    /// Opens a stream to `broker` starting with `topics`.
    fn open(
        &mut self,
        cluster: &Cluster,
        broker: &str,
        topics: Vec<FetchTopic>,
        assignment: u64,
    ) -> Result<Stream, ClientError> {
        self.next_stream += 1;
        let id = self.next_stream;
        let channel = cluster.connection().channel(broker)?;
        let (requests, rx) = mpsc::channel::<SubscribeRequest>(1024);
        let start = SubscribeRequest {
            message: Some(subscribe_request::Message::Start(SubscribeStart {
                topics,
                filter: self.filter.clone(),
                window_records: self.settings.window_records,
                window_bytes: self.settings.window_bytes,
                heartbeat_interval_ms: self.settings.heartbeat.as_millis() as u32,
                raw_batches: true,
                assignment_id: assignment,
                isolation: if self.read_committed {
                    IsolationLevel::ReadCommitted as i32
                } else {
                    IsolationLevel::ReadUncommitted as i32
                },
            })),
        };
        requests
            .try_send(start)
            .expect("a new channel has room for the start");
        let events = self.events_tx.clone();
        let heartbeats = requests.clone();
        let interval = self.settings.heartbeat;
        let broker = broker.to_owned();
        let task = tokio::spawn(async move {
            let outbound = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|m| (m, rx))
            });
            let error = run_stream(
                channel, outbound, heartbeats, interval, &events, &broker, id,
            )
            .await;
            let _ = events.send(Event::Closed {
                broker,
                stream: id,
                error,
            });
        });
        Ok(Stream {
            id,
            requests,
            task,
            owed: (0, 0),
        })
    }
}

/// Reads one stream until it ends; returns why it ended.
async fn run_stream(
    channel: tonic::transport::Channel,
    outbound: impl futures_util::Stream<Item = SubscribeRequest> + Send + 'static,
    heartbeats: mpsc::Sender<SubscribeRequest>,
    interval: Duration,
    events: &mpsc::UnboundedSender<Event>,
    broker: &str,
    id: u64,
) -> ClientError {
    let opened = BrokerClient::new(channel)
        .max_decoding_message_size(MESSAGE_BYTES_MAX)
        .subscribe(outbound)
        .await;
    let mut inbound = match opened {
        Ok(r) => r.into_inner(),
        Err(status) => return ClientError::new(code_of(&status), status.message().to_owned()),
    };
    let mut ticker = tokio::time::interval(interval);
    let mut last_heard = Instant::now();
    loop {
        tokio::select! {
            message = inbound.message() => {
                let message = match message {
                    Ok(Some(m)) => m,
                    Ok(None) => return ClientError::new(ErrorCode::NetworkException, format!("{broker} ended the push stream")),
                    Err(status) => return ClientError::new(code_of(&status), status.message().to_owned()),
                };
                last_heard = Instant::now();
                let event = match message.message {
                    Some(subscribe_response::Message::Records(r)) => Event::Records {
                        broker: broker.to_owned(),
                        stream: id,
                        assignment: r.assignment_id,
                        topic: r.topic,
                        partition: r.partition,
                        batches: r.record_batches,
                        next_offset: r.next_fetch_offset,
                        count: r.record_count,
                        bytes: r.window_bytes,
                    },
                    Some(subscribe_response::Message::PartitionError(e)) => Event::PartitionError {
                        assignment: e.assignment_id,
                        topic: e.topic,
                        partition: e.partition,
                        error: ClientError::from_partition(e.error_code, &e.error_message)
                            .unwrap_or_else(|| ClientError::new(ErrorCode::UnknownServerError, "partition error without a code")),
                    },
                    _ => continue,
                };
                if events.send(event).is_err() {
                    return ClientError::new(ErrorCode::NetworkException, "the consumer is gone");
                }
            }
            _ = ticker.tick() => {
                if last_heard.elapsed() > interval * 3 {
                    return ClientError::new(ErrorCode::NetworkException, format!("{broker} sent nothing for 3 heartbeat intervals"));
                }
                let beat = SubscribeRequest {
                    message: Some(subscribe_request::Message::Heartbeat(SubscribeHeartbeat {})),
                };
                let _ = heartbeats.try_send(beat);
            }
        }
    }
}

/// `(topic, partition)` pairs with a value, grouped by topic in order.
fn group_by_topic<V>(items: impl IntoIterator<Item = (Tp, V)>) -> BTreeMap<String, Vec<(u32, V)>> {
    let mut out: BTreeMap<String, Vec<(u32, V)>> = BTreeMap::new();
    for ((topic, partition), v) in items {
        out.entry(topic).or_default().push((partition, v));
    }
    out
}
