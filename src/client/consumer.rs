//! The consumer with manual assignment: assign partitions, seek (earliest, latest, or an
//! offset), and poll. One fetch per broker per poll, all in parallel; a partition whose
//! leader moved is re-routed after a metadata refresh.
//!
//! With a rack ([`Consumer::set_rack`], Kafka's `client.rack`), a partition whose leader
//! is in another rack is fetched from an in-sync follower in the consumer's rack when
//! there is one (KIP-392): it serves records up to the high watermark it knows. A
//! follower that refuses or fails a fetch sends that partition back to its leader for
//! [`FOLLOWER_RETRY_AFTER`].

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::cluster::Cluster;
use super::error::ClientError;
use super::push_feed::{PushFeed, PushSettings};
use crate::api::broker_service::PARTITIONS_PER_REQUEST_MAX;
use crate::api::proto::broker_client::BrokerClient;
use crate::api::proto::{
    record_filter, FetchPartition, FetchRequest, FetchTopic, IsolationLevel, ListOffsetsPartition,
    ListOffsetsRequest, ListOffsetsTopic, RecordFilter,
};
use crate::api::status::code_of;
use crate::error_code::ErrorCode;
use crate::record::control::AbortedRanges;
use crate::record::tag::split_tag;

/// Largest response the consumer accepts (fetches are bounded by `max_bytes` below it).
const RESPONSE_BYTES_MAX: usize = 64 * 1024 * 1024;

/// After a follower failed a fetch of a partition, its leader serves it this long.
pub const FOLLOWER_RETRY_AFTER: Duration = Duration::from_secs(30);

/// Where to start reading a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartAt {
    /// The log start offset.
    Earliest,
    /// The high watermark: only records produced from now on.
    Latest,
    /// This offset.
    Offset(i64),
}

/// A record read from a partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerRecord {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: u32,
    /// Offset.
    pub offset: i64,
    /// Timestamp (ms).
    pub timestamp_ms: i64,
    /// Key (None: null).
    pub key: Option<Bytes>,
    /// Value (None: null).
    pub value: Option<Bytes>,
    /// Headers (without the `tidelog.tag` header when it holds the tag).
    pub headers: Vec<(String, Option<Bytes>)>,
    /// The record's tag.
    pub tag: Option<String>,
}

impl ConsumerRecord {
    /// A stored record of `topic`-`partition`, its tag taken out of its headers.
    pub fn from_stored(topic: String, partition: u32, r: crate::record::Record) -> Self {
        let (tag, headers) = split_tag(r.headers);
        Self {
            topic,
            partition,
            offset: r.offset,
            timestamp_ms: r.timestamp,
            key: r.key,
            value: r.value,
            headers: headers.into_iter().map(|h| (h.key, h.value)).collect(),
            tag,
        }
    }
}

/// A consumer of assigned partitions.
pub struct Consumer {
    cluster: Cluster,
    positions: BTreeMap<(String, u32), i64>,
    max_bytes: u32,
    filter: Option<RecordFilter>,
    /// Push mode: records arrive on subscription streams instead of fetches.
    push: Option<PushFeed>,
    /// Bumped per poll: each fetch starts at a different partition, so a partition with
    /// a backlog cannot take every response's byte budget.
    rotation: usize,
    /// The consumer's rack: fetch from an in-sync replica there (KIP-392).
    rack: Option<String>,
    /// Partitions read from their leader until then, after a follower failed them.
    leader_only: BTreeMap<(String, u32), Instant>,
    /// Read committed: only records of committed transactions (and non-transactional
    /// ones), up to the last stable offset.
    read_committed: bool,
}

/// A server-side filter a consumer subscribes with ([`Consumer::set_filter`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsumerFilter {
    /// `*`, `TagA` or `TagA || TagB || ...`.
    Tag(String),
    /// A SQL92-style expression over properties, e.g. `region = 'eu' AND amount > 100`.
    Sql(String),
}

impl ConsumerFilter {
    /// Parses the expression as the broker will, so a bad one is refused before any
    /// fetch, with [`ErrorCode::InvalidFilterExpression`] and a message naming the problem.
    pub fn check(&self) -> Result<(), ClientError> {
        let checked = match self {
            ConsumerFilter::Tag(text) => crate::filter::TagFilter::parse(text).map(|_| ()),
            ConsumerFilter::Sql(text) => crate::filter::SqlFilter::parse(text).map(|_| ()),
        };
        checked.map_err(|e| {
            ClientError::new(ErrorCode::InvalidFilterExpression, format!("filter: {e}"))
        })
    }
}

impl Consumer {
    /// A consumer for the cluster at `bootstrap`; requests give up after `timeout`.
    pub fn new(bootstrap: Vec<String>, timeout: Duration) -> Self {
        Self {
            cluster: Cluster::new(bootstrap, timeout),
            positions: BTreeMap::new(),
            max_bytes: 8 * 1024 * 1024,
            filter: None,
            push: None,
            rotation: 0,
            rack: None,
            leader_only: BTreeMap::new(),
            read_committed: false,
        }
    }

    /// Kafka's `isolation.level`: `true` reads only committed transactions (records of
    /// open transactions wait, aborted ones are never returned); `false` (the default)
    /// reads everything below the high watermark. In push mode the brokers push only
    /// committed records.
    pub fn set_read_committed(&mut self, on: bool) {
        self.read_committed = on;
        if let Some(feed) = &mut self.push {
            feed.set_read_committed(on);
        }
    }

    /// The consumer's rack (Kafka's `client.rack`): partitions whose leader is in another
    /// rack are fetched from an in-sync follower in this one when there is one (not in
    /// push mode, whose streams come from leaders).
    pub fn set_rack(&mut self, rack: Option<String>) {
        self.rack = rack.filter(|r| !r.is_empty());
    }

    /// Switches to push mode: from the next poll, each leader broker pushes the assigned
    /// partitions' records over one `Subscribe` stream as they are committed, within the
    /// window of `settings` (see [`PushFeed`]). `poll` then returns what has arrived.
    pub fn enable_push(&mut self, settings: PushSettings) {
        let mut feed = PushFeed::new(settings, self.filter.clone());
        feed.set_read_committed(self.read_committed);
        self.push = Some(feed);
    }

    /// Fetches only records that pass `filter` (`None`: every record). The broker skips
    /// the others, and positions move past them, so a group's committed offsets and lag
    /// do too. Refused (and nothing changed) when the expression does not parse.
    pub fn set_filter(&mut self, filter: Option<ConsumerFilter>) -> Result<(), ClientError> {
        if let Some(f) = &filter {
            f.check()?;
        }
        self.filter = filter.map(|f| RecordFilter {
            expression: Some(match f {
                ConsumerFilter::Tag(t) => record_filter::Expression::Tag(t),
                ConsumerFilter::Sql(s) => record_filter::Expression::Sql(s),
            }),
        });
        if let Some(feed) = &mut self.push {
            feed.set_filter(self.filter.clone());
        }
        Ok(())
    }

    /// Bounds each fetch response to about `bytes` (at least one batch is returned).
    pub fn set_max_bytes(&mut self, bytes: u32) {
        self.max_bytes = bytes.max(1);
    }

    /// The number of partitions of `topic`.
    pub async fn partition_count(&self, topic: &str) -> Result<u32, ClientError> {
        Ok(self.cluster.refresh(topic).await?.leaders.len() as u32)
    }

    /// Assigns `partition` of `topic`, starting at `start`.
    pub async fn assign(
        &mut self,
        topic: &str,
        partition: u32,
        start: StartAt,
    ) -> Result<(), ClientError> {
        // An unknown topic or a partition past the topic's count is answered at once
        // (from fresh metadata), not retried until a timeout.
        let count = self.cluster.refresh(topic).await?.leaders.len() as u32;
        if partition >= count {
            return Err(ClientError::new(
                ErrorCode::UnknownTopicOrPartition,
                format!(
                    "topic '{topic}' has {count} partition{}; there is no partition {partition}",
                    if count == 1 { "" } else { "s" }
                ),
            ));
        }
        let offset = match start {
            StartAt::Offset(o) => o,
            StartAt::Earliest => self.list_offset(topic, partition, -2).await?,
            StartAt::Latest => self.list_offset(topic, partition, -1).await?,
        };
        self.positions.insert((topic.to_owned(), partition), offset);
        if let Some(feed) = &mut self.push {
            feed.moved(topic, partition);
        }
        Ok(())
    }

    /// Moves an assigned partition's position (like [`Consumer::assign`] again).
    pub async fn seek(
        &mut self,
        topic: &str,
        partition: u32,
        to: StartAt,
    ) -> Result<(), ClientError> {
        if !self.positions.contains_key(&(topic.to_owned(), partition)) {
            return Err(ClientError::new(
                ErrorCode::InvalidRequest,
                format!("{topic}-{partition} is not assigned to this consumer"),
            ));
        }
        self.assign(topic, partition, to).await
    }

    /// Stops reading a partition.
    pub fn unassign(&mut self, topic: &str, partition: u32) {
        self.positions.remove(&(topic.to_owned(), partition));
    }

    /// The next offset to read of each assigned partition.
    pub fn positions(&self) -> &BTreeMap<(String, u32), i64> {
        &self.positions
    }

    /// ListOffsets at the partition's leader: -2 earliest, -1 latest (the high
    /// watermark; for a read-committed consumer the last stable offset), otherwise the
    /// first offset at or after a timestamp.
    pub async fn list_offset(
        &self,
        topic: &str,
        partition: u32,
        timestamp_ms: i64,
    ) -> Result<i64, ClientError> {
        for _ in 0..50 {
            let leader = match self.cluster.leader(topic, partition).await {
                Ok(l) => l,
                Err(e) if e.is_retriable() => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let channel = self.cluster.connection().channel(&leader)?;
            let request = ListOffsetsRequest {
                topics: vec![ListOffsetsTopic {
                    topic: topic.to_owned(),
                    partitions: vec![ListOffsetsPartition {
                        partition,
                        timestamp_ms,
                    }],
                }],
                isolation: if self.read_committed {
                    IsolationLevel::ReadCommitted as i32
                } else {
                    IsolationLevel::ReadUncommitted as i32
                },
            };
            let response = BrokerClient::new(channel)
                .list_offsets(request)
                .await
                .map_err(ClientError::from)?
                .into_inner();
            let p = response
                .topics
                .first()
                .and_then(|t| t.partitions.first())
                .ok_or_else(|| {
                    ClientError::new(ErrorCode::UnknownServerError, "empty list-offsets response")
                })?;
            let Some(e) = ClientError::from_partition(p.error_code, &p.error_message) else {
                return Ok(p.offset);
            };
            if !e.is_retriable() {
                return Err(e);
            }
            self.cluster.refresh(topic).await?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(ClientError::new(
            ErrorCode::RequestTimedOut,
            format!("{topic}-{partition}: no leader answered list-offsets"),
        ))
    }

    /// Fetches from every assigned partition, waiting up to `max_wait` for data; advances
    /// positions past what it returns.
    pub async fn poll(&mut self, max_wait: Duration) -> Result<Vec<ConsumerRecord>, ClientError> {
        if let Some(feed) = &mut self.push {
            return feed
                .poll(&self.cluster, &mut self.positions, max_wait)
                .await;
        }
        let now = Instant::now();
        self.leader_only.retain(|_, until| *until > now);
        // Per broker: (topic, partition, offset, read from a follower).
        let mut by_leader: BTreeMap<String, Vec<(String, u32, i64, bool)>> = BTreeMap::new();
        for ((topic, partition), offset) in &self.positions {
            let rack = match self.rack.as_deref() {
                Some(r)
                    if self.leader_only.is_empty()
                        || !self.leader_only.contains_key(&(topic.clone(), *partition)) =>
                {
                    Some(r)
                }
                _ => None,
            };
            match self.cluster.read_address(topic, *partition, rack).await {
                Ok((broker, follower)) => by_leader.entry(broker).or_default().push((
                    topic.clone(),
                    *partition,
                    *offset,
                    follower,
                )),
                Err(e) if e.is_retriable() => {}
                Err(e) => return Err(e),
            }
        }
        if by_leader.is_empty() {
            tokio::time::sleep(max_wait.min(Duration::from_millis(200))).await;
            return Ok(Vec::new());
        }
        let mut tasks = tokio::task::JoinSet::new();
        self.rotation = self.rotation.wrapping_add(1);
        let rotation = self.rotation;
        // One request per leader and per PARTITIONS_PER_REQUEST_MAX partitions.
        let requests = by_leader.into_iter().flat_map(|(leader, mut parts)| {
            let len = parts.len();
            parts.rotate_left(rotation % len);
            parts
                .chunks(PARTITIONS_PER_REQUEST_MAX)
                .map(|chunk| (leader.clone(), chunk.to_vec()))
                .collect::<Vec<_>>()
        });
        for (leader, parts) in requests {
            let channel = self.cluster.connection().channel(&leader)?;
            let followed: Vec<(String, u32)> = parts
                .iter()
                .filter(|p| p.3)
                .map(|p| (p.0.clone(), p.1))
                .collect();
            let mut topics: Vec<FetchTopic> = Vec::new();
            for (topic, partition, offset, _) in parts {
                let fp = FetchPartition {
                    partition,
                    fetch_offset: offset,
                    partition_max_bytes: 0,
                };
                match topics.iter_mut().find(|t| t.topic == topic) {
                    Some(t) => t.partitions.push(fp),
                    None => topics.push(FetchTopic {
                        topic,
                        partitions: vec![fp],
                    }),
                }
            }
            let request = FetchRequest {
                max_wait_ms: max_wait.as_millis().min(u32::MAX as u128) as u32,
                min_bytes: 1,
                max_bytes: self.max_bytes,
                topics,
                // Stored batches travel as they are and are decoded here: no per-record
                // protobuf messages on either side.
                raw_batches: true,
                filter: self.filter.clone(),
                read_from_follower: !followed.is_empty(),
                isolation: if self.read_committed {
                    IsolationLevel::ReadCommitted as i32
                } else {
                    IsolationLevel::ReadUncommitted as i32
                },
            };
            tasks.spawn(async move {
                let r = super::raw_call::fetch(channel, request, RESPONSE_BYTES_MAX).await;
                (followed, r)
            });
        }
        let mut out = Vec::new();
        let mut stale_topics = Vec::new();
        let retry_followers_at = Instant::now() + FOLLOWER_RETRY_AFTER;
        while let Some(joined) = tasks.join_next().await {
            let (followed, response) = match joined {
                Ok((followed, Ok(r))) => (followed, r),
                Ok((followed, Err(status))) => {
                    let e = ClientError::new(code_of(&status), status.message().to_owned());
                    if !followed.is_empty() {
                        // The followers' broker failed: their leaders serve them a while
                        // (with fresh metadata: the follower may have left the ISR).
                        tracing::debug!(error = %e, "a follower fetch failed; reading from leaders");
                        for key in followed {
                            stale_topics.push(key.0.clone());
                            self.leader_only.insert(key, retry_followers_at);
                        }
                    }
                    if e.is_retriable() {
                        continue;
                    }
                    return Err(e);
                }
                Err(e) => {
                    return Err(ClientError::new(
                        ErrorCode::UnknownServerError,
                        e.to_string(),
                    ))
                }
            };
            for t in response.topics {
                for p in t.partitions {
                    if let Some(e) = ClientError::from_partition(p.error_code, &p.error_message) {
                        let key = (t.topic.clone(), p.partition);
                        if followed.contains(&key) {
                            // The leader answers what this follower could not.
                            tracing::debug!(topic = %t.topic, partition = p.partition, error = %e, "a follower refused a fetch; reading from the leader");
                            self.leader_only.insert(key, retry_followers_at);
                            stale_topics.push(t.topic.clone());
                            continue;
                        }
                        if e.is_retriable() {
                            stale_topics.push(t.topic.clone());
                            continue;
                        }
                        return Err(e);
                    }
                    let key = (t.topic.clone(), p.partition);
                    let aborted = AbortedRanges::new(
                        p.aborted_transactions
                            .iter()
                            .map(|a| (a.producer_id, a.first_offset, a.last_offset))
                            .collect(),
                    );
                    let decoded = crate::record::decode_shared_records_skipping(
                        &p.record_batches,
                        crate::partition::MAX_UNCOMPRESSED_BATCH_BYTES,
                        |h| aborted.is_aborted(h),
                    )
                    .map_err(|e| {
                        ClientError::new(ErrorCode::CorruptMessage, format!("fetched batch: {e}"))
                    })?;
                    out.reserve(decoded.len());
                    for r in decoded {
                        if let Some(pos) = self.positions.get_mut(&key) {
                            if r.offset < *pos {
                                continue;
                            }
                            *pos = r.offset + 1;
                        }
                        out.push(ConsumerRecord::from_stored(t.topic.clone(), p.partition, r));
                    }
                    // Past records a filter skipped (0 from a broker that does not say).
                    if let Some(pos) = self.positions.get_mut(&key) {
                        *pos = (*pos).max(p.next_fetch_offset);
                    }
                }
            }
        }
        stale_topics.sort_unstable();
        stale_topics.dedup();
        for topic in stale_topics {
            let _ = self.cluster.refresh(&topic).await;
        }
        Ok(out)
    }
}
