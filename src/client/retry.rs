//! Consumer retry with backoff and dead letters (RocketMQ's `%RETRY%` and `%DLQ%` topics).
//!
//! A group member that cannot handle a record yet nacks it ([`Retrier::nack`]): a copy is
//! scheduled (a durable timer) into the group's retry topic `_retry.<group>`, due after
//! the backoff of its redelivery number; the group's members read that topic along with
//! their own, so the copy comes back to the group, and the original partition's position
//! moves on at once. After `max.reconsume.times` redeliveries a record still refused goes
//! to the dead-letter topic `_dlq.<group>` instead, with the reason in a header.
//!
//! The policy is the retry topic's config (`reconsume.backoff.ms`, `max.reconsume.times`),
//! so it is per group, durable, and shown and changed like any topic config. Delivery is
//! at least once: a member that fails between scheduling the copy and committing past
//! the original delivers the original again.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;

use super::admin::AdminClient;
use super::consumer::ConsumerRecord;
use super::error::ClientError;
use super::producer::{Due, Producer, ProducerConfig, ProducerRecord};
use crate::api::proto::AlterTopicRequest;
use crate::error_code::ErrorCode;
use crate::record::delay::{ORIGINAL_TIMESTAMP_HEADER, TIMER_ID_HEADER};
use crate::topic_config::TopicConfig;

pub use crate::topic_config::{DLQ_TOPIC_PREFIX, RETRY_TOPIC_PREFIX};
/// Header: the topic the record was first read from.
pub const ORIGIN_TOPIC_HEADER: &str = "tidelog.retry.origin.topic";
/// Header: its partition there.
pub const ORIGIN_PARTITION_HEADER: &str = "tidelog.retry.origin.partition";
/// Header: its offset there.
pub const ORIGIN_OFFSET_HEADER: &str = "tidelog.retry.origin.offset";
/// Header: how many times the record was redelivered (1 on the first retry).
pub const RECONSUME_TIMES_HEADER: &str = "tidelog.retry.reconsume.times";
/// Header: when each nack happened, ms since the epoch, comma-separated.
pub const HISTORY_HEADER: &str = "tidelog.retry.history";
/// Header (dead letters): why the record went to the dead-letter topic.
pub const DLQ_REASON_HEADER: &str = "tidelog.dlq.reason";
/// Header (replayed dead letters): `TOPIC-PARTITION@OFFSET` of the dead letter.
pub const REPLAYED_FROM_HEADER: &str = "tidelog.dlq.replayed.from";

/// How long a member trusts the policy it read from the retry topic.
const POLICY_TTL: Duration = Duration::from_secs(30);

/// The group's retry topic; INVALID_REQUEST when the group name cannot be in a topic name.
pub fn retry_topic(group: &str) -> Result<String, ClientError> {
    derived_topic(RETRY_TOPIC_PREFIX, group)
}

/// The group's dead-letter topic; INVALID_REQUEST as for [`retry_topic`].
pub fn dlq_topic(group: &str) -> Result<String, ClientError> {
    derived_topic(DLQ_TOPIC_PREFIX, group)
}

/// The memberless group whose committed offsets on the dead-letter topic say how far
/// `groups dlq replay` got.
pub fn replay_cursor_group(group: &str) -> String {
    format!("_dlq-replay.{group}")
}

/// Longest topic name the cluster accepts.
const TOPIC_NAME_LEN_MAX: usize = 249;

fn derived_topic(prefix: &str, group: &str) -> Result<String, ClientError> {
    let name = format!("{prefix}{group}");
    let problem = if name.len() > TOPIC_NAME_LEN_MAX {
        Some(format!("it is longer than {TOPIC_NAME_LEN_MAX} characters"))
    } else {
        name.chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
            .map(|c| {
                format!(
                    "it contains {c:?}; topic names allow ASCII letters, digits, '.', '_' and '-'"
                )
            })
    };
    match problem {
        Some(why) => Err(ClientError::new(
            ErrorCode::InvalidRequest,
            format!(
                "group '{}' cannot retry: its retry and dead-letter topics would be named '{}', and {why}",
                group.escape_debug(),
                name.escape_debug()
            ),
        )),
        None => Ok(name),
    }
}

/// When to redeliver and when to give up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The pause before redelivery n is entry n (1-based); the last one beyond the list.
    pub backoff_ms: Vec<u64>,
    /// Redeliveries before a record still refused becomes a dead letter.
    pub max_reconsume_times: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        let c = TopicConfig::default();
        Self {
            backoff_ms: c.reconsume_backoff_ms,
            max_reconsume_times: c.max_reconsume_times,
        }
    }
}

impl RetryPolicy {
    /// The policy a retry topic's config sets (defaults for what it does not; other
    /// keys are not looked at).
    pub fn from_config(config: &BTreeMap<String, String>) -> Result<Self, ClientError> {
        let c = TopicConfig::from_pairs(
            config
                .iter()
                .filter(|(k, _)| *k == "reconsume.backoff.ms" || *k == "max.reconsume.times")
                .map(|(k, v)| (k.as_str(), v.as_str())),
        )
        .map_err(|e| ClientError::new(ErrorCode::InvalidConfig, e.to_string()))?;
        Ok(Self {
            backoff_ms: c.reconsume_backoff_ms,
            max_reconsume_times: c.max_reconsume_times,
        })
    }

    /// The retry topic config entries of this policy (validated as the broker will).
    pub fn to_config(&self) -> Result<BTreeMap<String, String>, ClientError> {
        let backoff = self
            .backoff_ms
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let config = BTreeMap::from([
            ("reconsume.backoff.ms".to_owned(), backoff),
            (
                "max.reconsume.times".to_owned(),
                self.max_reconsume_times.to_string(),
            ),
        ]);
        Self::from_config(&config)?;
        Ok(config)
    }
}

/// What a nack does with a record that was redelivered `reconsume_times` times so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NackStep {
    /// Redeliver it (redelivery number `reconsume_times`) after `delay_ms`.
    Retry {
        /// The redelivery number this will be.
        reconsume_times: u32,
        /// The backoff.
        delay_ms: u64,
    },
    /// Its redeliveries are used up: a dead letter.
    DeadLetter,
}

/// The decision of a nack (pure).
pub fn next_step(reconsume_times: u32, policy: &RetryPolicy) -> NackStep {
    if reconsume_times >= policy.max_reconsume_times {
        return NackStep::DeadLetter;
    }
    let next = reconsume_times + 1;
    let index = (next as usize - 1).min(policy.backoff_ms.len().saturating_sub(1));
    NackStep::Retry {
        reconsume_times: next,
        delay_ms: policy.backoff_ms.get(index).copied().unwrap_or(1_000),
    }
}

/// Where a redelivered record came from and how often it was redelivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryInfo {
    /// Topic, partition and offset of the first delivery.
    pub origin: (String, u32, i64),
    /// Redeliveries so far (0 for a record read from its own topic).
    pub reconsume_times: u32,
    /// When each nack happened (ms since the epoch).
    pub history: Vec<i64>,
    /// Dead letters: why.
    pub dead_letter_reason: Option<String>,
}

fn header<'a>(headers: &'a [(String, Option<Bytes>)], key: &str) -> Option<&'a str> {
    headers
        .iter()
        .rev()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| std::str::from_utf8(v.as_deref()?).ok())
}

impl RetryInfo {
    /// A record read for the first time: its own position, no redeliveries.
    pub fn fresh(record: &ConsumerRecord) -> Self {
        Self {
            origin: (record.topic.clone(), record.partition, record.offset),
            reconsume_times: 0,
            history: Vec::new(),
            dead_letter_reason: None,
        }
    }

    /// The retry headers of `record`, or its own position when it has none (a header that
    /// does not parse counts as absent). Trust them only on records of a group's retry
    /// or dead-letter topic: any producer can set headers.
    pub fn of(record: &ConsumerRecord) -> Self {
        let h = &record.headers;
        let origin = match (
            header(h, ORIGIN_TOPIC_HEADER),
            header(h, ORIGIN_PARTITION_HEADER).and_then(|p| p.parse().ok()),
            header(h, ORIGIN_OFFSET_HEADER).and_then(|o| o.parse().ok()),
        ) {
            (Some(t), Some(p), Some(o)) => (t.to_owned(), p, o),
            _ => (record.topic.clone(), record.partition, record.offset),
        };
        Self {
            origin,
            reconsume_times: header(h, RECONSUME_TIMES_HEADER)
                .and_then(|n| n.parse().ok())
                .unwrap_or(0),
            history: header(h, HISTORY_HEADER)
                .map(|s| s.split(',').filter_map(|t| t.parse().ok()).collect())
                .unwrap_or_default(),
            dead_letter_reason: header(h, DLQ_REASON_HEADER).map(str::to_owned),
        }
    }
}

/// Headers a copy must not carry over: the retry headers (set anew) and the headers a
/// timer delivery adds (added anew).
fn is_replaced_header(key: &str) -> bool {
    key.starts_with("tidelog.retry.")
        || key.starts_with("tidelog.dlq.")
        || key == ORIGINAL_TIMESTAMP_HEADER
        || key == TIMER_ID_HEADER
}

/// The record's headers a copy carries over (the application's).
fn kept_headers(record: &ConsumerRecord) -> Vec<(String, Option<Bytes>)> {
    record
        .headers
        .iter()
        .filter(|(k, _)| !is_replaced_header(k))
        .cloned()
        .collect()
}

/// The record's first timestamp: a timer delivery moved the original to a header.
fn original_timestamp(record: &ConsumerRecord) -> i64 {
    header(&record.headers, ORIGINAL_TIMESTAMP_HEADER)
        .and_then(|t| t.parse().ok())
        .unwrap_or(record.timestamp_ms)
}

/// Nack times a record's history header keeps (the most recent).
pub const HISTORY_MAX: usize = 64;

/// A copy of `record` (whose retry state is `info`) for `topic` with its retry headers
/// for `reconsume_times` redeliveries, a nack at `now_ms` added to its history (the last
/// [`HISTORY_MAX`] kept), and `extra` headers (pure). It keeps the record's first
/// timestamp, for a timer delivery, which moves it to a header.
pub fn retry_copy(
    record: &ConsumerRecord,
    info: &RetryInfo,
    topic: &str,
    reconsume_times: u32,
    now_ms: i64,
    extra: &[(&str, String)],
) -> ProducerRecord {
    let mut history = info.history.clone();
    history.push(now_ms);
    let history = &history[history.len().saturating_sub(HISTORY_MAX)..];
    let mut headers = kept_headers(record);
    let history = history
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let (origin_topic, origin_partition, origin_offset) = info.origin.clone();
    for (k, v) in [
        (ORIGIN_TOPIC_HEADER, origin_topic),
        (ORIGIN_PARTITION_HEADER, origin_partition.to_string()),
        (ORIGIN_OFFSET_HEADER, origin_offset.to_string()),
        (RECONSUME_TIMES_HEADER, reconsume_times.to_string()),
        (HISTORY_HEADER, history),
    ]
    .into_iter()
    .chain(extra.iter().map(|(k, v)| (*k, v.clone())))
    {
        headers.push((k.to_owned(), Some(Bytes::from(v))));
    }
    ProducerRecord {
        topic: topic.to_owned(),
        partition: None,
        key: record.key.clone(),
        value: record.value.clone(),
        headers,
        tag: record.tag.clone(),
        timestamp_ms: Some(original_timestamp(record)),
    }
}

/// `copy` appended now rather than delivered by a timer: stamped now, with its first
/// timestamp in the `tidelog.delay.original.timestamp` header (so time-based retention
/// counts from now).
fn stamped_now(mut copy: ProducerRecord) -> ProducerRecord {
    if let Some(original) = copy.timestamp_ms.take() {
        copy.headers.push((
            ORIGINAL_TIMESTAMP_HEADER.to_owned(),
            Some(Bytes::from(original.to_string())),
        ));
    }
    copy
}

/// A dead letter for the group's dead-letter topic `topic` (pure): [`retry_copy`] with
/// the reason, stamped now.
pub fn dead_letter_copy(
    record: &ConsumerRecord,
    info: &RetryInfo,
    topic: &str,
    now_ms: i64,
    reason: String,
) -> ProducerRecord {
    stamped_now(retry_copy(
        record,
        info,
        topic,
        info.reconsume_times,
        now_ms,
        &[(DLQ_REASON_HEADER, reason)],
    ))
}

/// A dead letter sent back to the topic and partition it was first read from, with the
/// retry and dead-letter headers dropped, so it starts over, and the dead letter's
/// position in `tidelog.dlq.replayed.from`; stamped now (pure).
pub fn replay_copy(record: &ConsumerRecord) -> ProducerRecord {
    let info = RetryInfo::of(record);
    let mut headers = kept_headers(record);
    headers.push((
        REPLAYED_FROM_HEADER.to_owned(),
        Some(Bytes::from(format!(
            "{}-{}@{}",
            record.topic, record.partition, record.offset
        ))),
    ));
    stamped_now(ProducerRecord {
        topic: info.origin.0,
        partition: Some(info.origin.1),
        key: record.key.clone(),
        value: record.value.clone(),
        headers,
        tag: record.tag.clone(),
        timestamp_ms: Some(original_timestamp(record)),
    })
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// What a nack did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NackOutcome {
    /// A copy is scheduled into the retry topic.
    Retried {
        /// Its redelivery number.
        reconsume_times: u32,
        /// The backoff.
        delay: Duration,
        /// The scheduled record's id.
        id: String,
    },
    /// The record went to the dead-letter topic.
    DeadLettered {
        /// The dead-letter topic.
        topic: String,
        /// Its partition there.
        partition: u32,
        /// Its offset there.
        offset: i64,
    },
}

/// A group's retry and dead-letter writer, shared by its consumer and listener tasks.
pub struct Retrier {
    group: String,
    bootstrap: Vec<String>,
    admin: AdminClient,
    producer: tokio::sync::OnceCell<Producer>,
    /// The policy read from the retry topic, and when.
    policy: Mutex<Option<(RetryPolicy, Instant)>>,
    /// Topics known to exist.
    created: Mutex<BTreeSet<String>>,
}

impl Retrier {
    /// The retrier of `group` on the cluster at `bootstrap`.
    pub fn new(bootstrap: Vec<String>, group: &str) -> Self {
        Self {
            group: group.to_owned(),
            admin: AdminClient::new(bootstrap.clone(), Duration::from_secs(30)),
            bootstrap,
            producer: tokio::sync::OnceCell::new(),
            policy: Mutex::new(None),
            created: Mutex::new(BTreeSet::new()),
        }
    }

    /// The group.
    pub fn group(&self) -> &str {
        &self.group
    }

    async fn producer(&self) -> &Producer {
        self.producer
            .get_or_init(|| async {
                Producer::new(
                    self.bootstrap.clone(),
                    ProducerConfig {
                        linger: Duration::ZERO,
                        ..ProducerConfig::default()
                    },
                )
            })
            .await
    }

    /// Makes `policy` the group's (on its retry topic, created when missing with
    /// `partitions`, None: the cluster default).
    pub async fn set_policy(
        &self,
        policy: &RetryPolicy,
        partitions: Option<u32>,
    ) -> Result<(), ClientError> {
        let topic = retry_topic(&self.group)?;
        let config = policy.to_config()?;
        let created = self
            .admin
            .create_topic(&topic, partitions, None, config.clone())
            .await;
        match created {
            Ok(_) => {}
            Err(e) if e.code == ErrorCode::TopicAlreadyExists => {
                self.admin
                    .alter_topic(AlterTopicRequest {
                        name: topic.clone(),
                        set_config: config.into_iter().collect(),
                        ..AlterTopicRequest::default()
                    })
                    .await?;
            }
            Err(e) => return Err(e),
        }
        self.created.lock().insert(topic);
        *self.policy.lock() = Some((policy.clone(), Instant::now()));
        Ok(())
    }

    /// The group's policy: its retry topic's config (defaults while there is none).
    pub async fn policy(&self) -> Result<RetryPolicy, ClientError> {
        if let Some((p, at)) = &*self.policy.lock() {
            if at.elapsed() < POLICY_TTL {
                return Ok(p.clone());
            }
        }
        let topic = retry_topic(&self.group)?;
        let policy = match self.admin.describe_topics(vec![topic]).await {
            Ok(r) => match r.topics.first().and_then(|d| d.topic.as_ref()) {
                Some(t) => RetryPolicy::from_config(&t.config)?,
                None => RetryPolicy::default(),
            },
            Err(e) if e.code == ErrorCode::UnknownTopicOrPartition => RetryPolicy::default(),
            Err(e) => return Err(e),
        };
        *self.policy.lock() = Some((policy.clone(), Instant::now()));
        Ok(policy)
    }

    /// Creates `topic` unless it exists (`partitions`: None for the cluster default).
    async fn ensure_topic(&self, topic: &str, partitions: Option<u32>) -> Result<(), ClientError> {
        if self.created.lock().contains(topic) {
            return Ok(());
        }
        match self
            .admin
            .create_topic(topic, partitions, None, BTreeMap::new())
            .await
        {
            Ok(_) => {}
            Err(e) if e.code == ErrorCode::TopicAlreadyExists => {}
            Err(e) => return Err(e),
        }
        self.created.lock().insert(topic.to_owned());
        Ok(())
    }

    /// Sends `record` back to the group after its backoff, or to the dead-letter topic
    /// (with `reason`) when its redeliveries are used up. Returns once the copy is
    /// durable (acks=all); the caller then counts the record as done.
    pub async fn nack(
        &self,
        record: &ConsumerRecord,
        reason: &str,
    ) -> Result<NackOutcome, ClientError> {
        let policy = self.policy().await?;
        let retry = retry_topic(&self.group)?;
        // Only the group's own retry topic carries retry state this group set.
        let info = if record.topic == retry {
            RetryInfo::of(record)
        } else {
            RetryInfo::fresh(record)
        };
        let now = now_ms();
        let producer = self.producer().await;
        let why = match next_step(info.reconsume_times, &policy) {
            NackStep::Retry {
                reconsume_times,
                delay_ms,
            } => {
                // As many partitions as the record's topic: retries spread like the
                // originals.
                let partitions = producer.partitions_for(&record.topic).await.ok();
                self.ensure_topic(&retry, partitions).await?;
                let copy = retry_copy(record, &info, &retry, reconsume_times, now, &[]);
                match producer.schedule(copy, Due::DelayMs(delay_ms as i64)).await {
                    Ok(scheduled) => {
                        return Ok(NackOutcome::Retried {
                            reconsume_times,
                            delay: Duration::from_millis(delay_ms),
                            id: scheduled.id,
                        })
                    }
                    // A backoff the brokers refuse (beyond their max_delay_ms): a dead
                    // letter that says so, rather than a record retried forever here.
                    Err(e) if e.code == ErrorCode::InvalidDelay => format!(
                        "{reason}; its retry after {delay_ms} ms was refused: {}",
                        e.message
                    ),
                    Err(e) => return Err(e),
                }
            }
            NackStep::DeadLetter => format!(
                "{reason} (redelivered {} times; max.reconsume.times is {})",
                info.reconsume_times, policy.max_reconsume_times
            ),
        };
        let topic = dlq_topic(&self.group)?;
        self.ensure_topic(&topic, Some(1)).await?;
        let at = producer
            .send_sync(dead_letter_copy(record, &info, &topic, now, why))
            .await?;
        Ok(NackOutcome::DeadLettered {
            topic,
            partition: at.partition,
            offset: at.offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(headers: Vec<(&str, &str)>) -> ConsumerRecord {
        ConsumerRecord {
            topic: "orders".into(),
            partition: 2,
            offset: 40,
            timestamp_ms: 1_000,
            key: Some(Bytes::from_static(b"k")),
            value: Some(Bytes::from_static(b"v")),
            headers: headers
                .into_iter()
                .map(|(k, v)| (k.to_owned(), Some(Bytes::from(v.to_owned()))))
                .collect(),
            tag: Some("T".into()),
        }
    }

    #[test]
    fn the_levels_are_used_in_order_then_the_dead_letter_topic() {
        let policy = RetryPolicy {
            backoff_ms: vec![1_000, 5_000],
            max_reconsume_times: 3,
        };
        let steps: Vec<NackStep> = (0..4).map(|n| next_step(n, &policy)).collect();
        assert_eq!(
            steps,
            vec![
                NackStep::Retry {
                    reconsume_times: 1,
                    delay_ms: 1_000
                },
                NackStep::Retry {
                    reconsume_times: 2,
                    delay_ms: 5_000
                },
                NackStep::Retry {
                    reconsume_times: 3,
                    delay_ms: 5_000
                },
                NackStep::DeadLetter,
            ]
        );
        let none = RetryPolicy {
            backoff_ms: vec![1],
            max_reconsume_times: 0,
        };
        assert_eq!(next_step(0, &none), NackStep::DeadLetter);
    }

    /// The headers of `copy` as a timer delivers it: its first timestamp (1000 here) in
    /// a header.
    fn delivered(copy: &ProducerRecord) -> Vec<(String, Option<Bytes>)> {
        let mut headers = copy.headers.clone();
        headers.push((
            ORIGINAL_TIMESTAMP_HEADER.into(),
            Some(Bytes::from_static(b"1000")),
        ));
        headers
    }

    #[test]
    fn copies_keep_the_record_and_carry_origin_and_history() {
        let first = record(vec![("app", "1")]);
        let copy = retry_copy(&first, &RetryInfo::fresh(&first), "_retry.g", 1, 5_000, &[]);
        assert_eq!(copy.topic, "_retry.g");
        assert_eq!(copy.key, first.key);
        assert_eq!(copy.value, first.value);
        assert_eq!(copy.tag, first.tag);
        assert_eq!(copy.timestamp_ms, Some(1_000));
        // As the consumer reads it back after the timer delivered it.
        let mut again = record(vec![]);
        again.topic = "_retry.g".into();
        again.partition = 0;
        again.offset = 7;
        again.timestamp_ms = 6_000;
        again.headers = delivered(&copy);
        let info = RetryInfo::of(&again);
        assert_eq!(info.origin, ("orders".into(), 2, 40));
        assert_eq!(info.reconsume_times, 1);
        assert_eq!(info.history, vec![5_000]);
        let second = retry_copy(&again, &RetryInfo::of(&again), "_retry.g", 2, 9_000, &[]);
        assert_eq!(second.timestamp_ms, Some(1_000));
        again.headers = delivered(&second);
        let info = RetryInfo::of(&again);
        assert_eq!(info.origin, ("orders".into(), 2, 40));
        assert_eq!(info.reconsume_times, 2);
        assert_eq!(info.history, vec![5_000, 9_000]);
        // Each header once; the application's header kept.
        let keys: Vec<&str> = again.headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys.iter().filter(|k| **k == HISTORY_HEADER).count(), 1);
        assert_eq!(
            keys.iter()
                .filter(|k| **k == ORIGINAL_TIMESTAMP_HEADER)
                .count(),
            1
        );
        assert!(keys.contains(&"app"));
        // A dead letter is stamped now, its first timestamp in a header.
        let dead = dead_letter_copy(&again, &RetryInfo::of(&again), "_dlq.g", 9_500, "r".into());
        assert_eq!(dead.timestamp_ms, None);
        assert!(dead
            .headers
            .iter()
            .any(|(k, v)| k == ORIGINAL_TIMESTAMP_HEADER && v.as_deref() == Some(&b"1000"[..])));
        assert!(dead.headers.iter().any(|(k, _)| k == DLQ_REASON_HEADER));
        // A replay goes back to the first topic and partition without the retry headers.
        let replay = replay_copy(&again);
        assert_eq!(replay.topic, "orders");
        assert_eq!(replay.partition, Some(2));
        assert_eq!(replay.timestamp_ms, None);
        assert!(replay
            .headers
            .iter()
            .all(|(k, _)| !k.starts_with("tidelog.retry.")));
        assert!(replay.headers.iter().any(|(k, _)| k == "app"));
        assert!(replay
            .headers
            .iter()
            .any(|(k, _)| k == REPLAYED_FROM_HEADER));
    }

    #[test]
    fn the_history_keeps_the_latest_nacks() {
        let mut r = record(vec![]);
        let mut info = RetryInfo::fresh(&r);
        for n in 0..100 {
            let copy = retry_copy(&r, &info, "_retry.g", n + 1, i64::from(n), &[]);
            r.headers = copy.headers;
            info = RetryInfo::of(&r);
        }
        assert_eq!(info.history.len(), HISTORY_MAX);
        assert_eq!(info.history.last(), Some(&99));
        assert_eq!(info.reconsume_times, 100);
    }

    #[test]
    fn group_names_that_cannot_name_a_topic_are_refused() {
        assert_eq!(retry_topic("g-1").unwrap(), "_retry.g-1");
        assert_eq!(dlq_topic("g-1").unwrap(), "_dlq.g-1");
        let e = retry_topic("my group").unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidRequest);
        assert!(e.message.contains("_retry.my group"), "{}", e.message);
        assert!(retry_topic(&"g".repeat(249)).is_err());
    }

    proptest! {
        #[test]
        fn a_record_always_ends_in_the_dead_letter_topic(
            levels in proptest::collection::vec(0u64..10_000_000, 1..20),
            max in 0u32..40,
        ) {
            let policy = RetryPolicy { backoff_ms: levels.clone(), max_reconsume_times: max };
            let mut n = 0;
            while let NackStep::Retry { reconsume_times, delay_ms } = next_step(n, &policy) {
                prop_assert_eq!(reconsume_times, n + 1);
                prop_assert!(levels.contains(&delay_ms));
                n = reconsume_times;
            }
            prop_assert_eq!(n, max);
        }

        #[test]
        fn retry_headers_never_panic_on_garbage(values in proptest::collection::vec(".*", 5)) {
            let mut r = record(vec![]);
            for (k, v) in [ORIGIN_TOPIC_HEADER, ORIGIN_PARTITION_HEADER, ORIGIN_OFFSET_HEADER, RECONSUME_TIMES_HEADER, HISTORY_HEADER].iter().zip(values) {
                r.headers.push((k.to_string(), Some(Bytes::from(v))));
            }
            let info = RetryInfo::of(&r);
            let _ = retry_copy(&r, &info, "_retry.g", 1, 0, &[]);
            let _ = replay_copy(&r);
        }
    }
}
