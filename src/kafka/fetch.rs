//! Fetch: one long-polling read over every named partition through the broker's fetch
//! (max wait, min bytes, response and per-partition byte limits), returning the stored
//! batches unchanged. Topics are named by id from v13. Read-committed reads (isolation
//! level 1) stop at the last stable offset and carry the aborted transactions overlapping
//! the returned batches, which the client drops (its markers come with the batches).
//!
//! Fetch from a follower (KIP-392): from v11 a consumer's fetch may be served by an
//! in-sync follower (up to the high watermark it knows), and a leader asked by a consumer
//! with a `rack_id` names an in-sync follower in that rack as `preferred_read_replica`
//! (with no records, answered at once) when it is itself in another rack; the client then
//! fetches from that follower.
//!
//! Fetch sessions (KIP-227) are refused: every answer carries session id 0, which tells
//! the client that no session was created, so it keeps sending full fetches; a request
//! for an existing session gets FETCH_SESSION_ID_NOT_FOUND, after which clients start
//! over with a full fetch.

use std::time::Duration;

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::fetch_response::{
    AbortedTransaction, FetchableTopicResponse, PartitionData,
};
use kafka_protocol::messages::{BrokerId, FetchRequest, FetchResponse, ProducerId, TopicName};
use kafka_protocol::protocol::StrBytes;

use super::errors::kafka_code;
use super::metadata::topic_name_of;
use super::KafkaHandler;
use crate::broker::node::FetchTarget;
use crate::error_code::ErrorCode;

/// Checks a client's `current_leader_epoch` (-1: none given) against this broker's
/// metadata, as Kafka does: older is fenced, newer means this broker lags.
pub fn check_leader_epoch(
    handler: &KafkaHandler,
    topic: &str,
    partition: i32,
    client_epoch: i32,
) -> Result<(), i16> {
    if client_epoch < 0 || partition < 0 {
        return Ok(());
    }
    let Some((_, p)) = handler.node.metadata().partition(topic, partition as u32) else {
        return Ok(()); // the fetch itself reports the unknown partition
    };
    match client_epoch.cmp(&p.leader_epoch) {
        std::cmp::Ordering::Less => Err(kafka_code(ErrorCode::FencedLeaderEpoch)),
        std::cmp::Ordering::Greater => Err(kafka_code(ErrorCode::UnknownLeaderEpoch)),
        std::cmp::Ordering::Equal => Ok(()),
    }
}

fn error_partition(index: i32, code: i16) -> PartitionData {
    PartitionData::default()
        .with_partition_index(index)
        .with_error_code(code)
        .with_high_watermark(-1)
        .with_last_stable_offset(-1)
        .with_log_start_offset(-1)
        .with_preferred_read_replica(BrokerId(-1))
        .with_records(Some(bytes::Bytes::new()))
}

impl KafkaHandler {
    /// Answers Fetch.
    pub async fn fetch(&self, r: FetchRequest, version: i16) -> FetchResponse {
        if r.session_id != 0 {
            return FetchResponse::default()
                .with_error_code(ResponseError::FetchSessionIdNotFound.code())
                .with_session_id(0);
        }
        // Resolve names (by id from v13) and pre-check each partition; `slots` keeps the
        // request's order, each either a target index or a ready error.
        let mut targets: Vec<FetchTarget> = Vec::new();
        // Per target, the follower a rack-aware consumer is sent to (KIP-392).
        let mut preferred_replicas: Vec<Option<crate::types::BrokerId>> = Vec::new();
        let consumer_rack: &str = if version >= 11 { &r.rack_id } else { "" };
        let mut topics: Vec<(FetchableTopicResponse, Vec<Result<usize, PartitionData>>)> =
            Vec::new();
        for t in &r.topics {
            let name = if version >= 13 {
                self.node
                    .metadata()
                    .read(|image| topic_name_of(image, t.topic_id))
            } else {
                Some(t.topic.0.to_string())
            };
            let mut entry = FetchableTopicResponse::default();
            if version >= 13 {
                entry = entry.with_topic_id(t.topic_id);
            } else {
                entry = entry.with_topic(t.topic.clone());
            }
            let mut slots = Vec::new();
            for p in &t.partitions {
                let Some(name) = &name else {
                    slots.push(Err(error_partition(
                        p.partition,
                        ResponseError::UnknownTopicId.code(),
                    )));
                    continue;
                };
                if p.partition < 0 {
                    slots.push(Err(error_partition(
                        p.partition,
                        ResponseError::UnknownTopicOrPartition.code(),
                    )));
                    continue;
                }
                if p.fetch_offset < 0 {
                    slots.push(Err(error_partition(
                        p.partition,
                        ResponseError::OffsetOutOfRange.code(),
                    )));
                    continue;
                }
                if let Err(code) =
                    check_leader_epoch(self, name, p.partition, p.current_leader_epoch)
                {
                    slots.push(Err(error_partition(p.partition, code)));
                    continue;
                }
                let preferred = if consumer_rack.is_empty() {
                    None
                } else {
                    self.node.preferred_read_replica(
                        name,
                        p.partition as u32,
                        consumer_rack,
                        p.fetch_offset as u64,
                    )
                };
                slots.push(Ok(targets.len()));
                // Redirected partitions read nothing here (their state only).
                preferred_replicas.push(preferred);
                targets.push(FetchTarget {
                    topic: name.clone(),
                    partition: p.partition as u32,
                    offset: p.fetch_offset as u64,
                    max_bytes: if preferred.is_some() {
                        0
                    } else {
                        p.partition_max_bytes.max(1) as usize
                    },
                    filter: None,
                    follower_ok: version >= 11,
                    read_committed: r.isolation_level == 1,
                });
            }
            topics.push((entry, slots));
        }
        // A redirect is answered at once, as Kafka does.
        let max_wait = if preferred_replicas.iter().any(Option::is_some) {
            0
        } else {
            r.max_wait_ms.max(0) as u64
        };
        let results = if targets.is_empty() {
            Vec::new()
        } else {
            self.node
                .fetch(
                    targets.clone(),
                    Duration::from_millis(max_wait),
                    r.min_bytes.max(0) as usize,
                    if r.max_bytes > 0 {
                        r.max_bytes as usize
                    } else {
                        usize::MAX
                    },
                )
                .await
        };
        let mut results: Vec<Option<_>> = results.into_iter().map(Some).collect();
        let responses = topics
            .into_iter()
            .map(|(entry, slots)| {
                let partitions = slots
                    .into_iter()
                    .map(|slot| match slot {
                        Err(ready) => ready,
                        Ok(i) => {
                            let index = targets[i].partition as i32;
                            match results.get_mut(i).and_then(Option::take) {
                                Some(Ok(d)) => PartitionData::default()
                                    .with_partition_index(index)
                                    .with_high_watermark(d.high_watermark.as_i64())
                                    .with_last_stable_offset(d.last_stable_offset.as_i64())
                                    .with_log_start_offset(d.log_start_offset.as_i64())
                                    .with_aborted_transactions(Some(
                                        d.aborted_transactions
                                            .iter()
                                            .map(|a| {
                                                AbortedTransaction::default()
                                                    .with_producer_id(ProducerId(a.producer_id))
                                                    .with_first_offset(a.first_offset as i64)
                                            })
                                            .collect(),
                                    ))
                                    .with_preferred_read_replica(BrokerId(
                                        preferred_replicas[i].map_or(-1, |b| b.0),
                                    ))
                                    .with_records(Some(d.records)),
                                Some(Err(e)) => {
                                    error_partition(index, self.fetch_error_code(&targets[i], &e))
                                }
                                None => {
                                    error_partition(index, ResponseError::UnknownServerError.code())
                                }
                            }
                        }
                    })
                    .collect();
                entry.with_partitions(partitions)
            })
            .collect();
        FetchResponse::default()
            .with_session_id(0)
            .with_responses(responses)
    }
}

impl KafkaHandler {
    /// The Kafka error code of a failed partition read. An in-sync follower asked for an
    /// offset beyond its log answers OFFSET_OUT_OF_RANGE, as Kafka's followers do: Kafka
    /// clients take that from a preferred read replica as "go back to the leader" (which
    /// answers records or the real OFFSET_OUT_OF_RANGE), where NOT_LEADER_OR_FOLLOWER
    /// would keep them at the follower until their metadata ages out.
    fn fetch_error_code(&self, target: &FetchTarget, e: &crate::broker::BrokerError) -> i16 {
        let beyond_follower_log = e.code == ErrorCode::NotLeaderOrFollower
            && target.follower_ok
            && self
                .node
                .in_sync_follower(&target.topic, target.partition)
                .is_some();
        if beyond_follower_log {
            kafka_code(ErrorCode::OffsetOutOfRange)
        } else {
            kafka_code(e.code)
        }
    }
}

/// A topic name for the wire.
pub fn wire_name(name: &str) -> TopicName {
    TopicName(StrBytes::from_string(name.to_owned()))
}
