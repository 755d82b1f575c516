//! Per-topic settings under Kafka's names, with defaults, units and validation.
//!
//! Both the partition log (roll, retention, flush, size limits) and, later, the
//! controller (validating `topics create --config k=v`) read this one definition, so a
//! key means the same thing everywhere. Every error names the key and the allowed range.

use std::collections::BTreeMap;
use std::fmt;

/// How appends reach the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlushMode {
    /// Acknowledge once in the page cache; flush by `flush.messages` / `flush.ms`
    /// (durability from replication, like Kafka).
    #[default]
    Async,
    /// fdatasync before acknowledging, with group commit (RocketMQ's SYNC_FLUSH).
    Sync,
}

/// Settings of one topic, applied to each of its partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicConfig {
    /// `segment.bytes`: roll when the active segment would pass this size.
    pub segment_bytes: u64,
    /// `segment.ms`: roll when the active segment spans more than this many ms.
    pub segment_ms: i64,
    /// `segment.index.bytes`: preallocated size of each index file.
    pub segment_index_bytes: usize,
    /// `index.interval.bytes`: bytes of batches between offset-index entries.
    pub index_interval_bytes: u64,
    /// `retention.ms`: delete segments whose newest record is older; -1 keeps forever.
    pub retention_ms: i64,
    /// `retention.bytes`: delete oldest segments while the log is larger; -1 unlimited.
    pub retention_bytes: i64,
    /// `max.message.bytes`: largest batch accepted, in bytes, both as sent and after
    /// decompression of its records block (`RECORD_TOO_LARGE` either way).
    pub max_message_bytes: usize,
    /// `flush.messages`: fsync after this many unflushed records (async mode).
    pub flush_messages: u64,
    /// `flush.ms`: fsync when unflushed data is older than this (async mode).
    pub flush_ms: i64,
    /// `flush.mode`: `async` (default) or `sync`.
    pub flush_mode: FlushMode,
    /// `min.insync.replicas`: replicas that must hold a record before `acks=all` succeeds.
    pub min_insync_replicas: u32,
    /// `unclean.leader.election.enable`: allow a leader from outside the ISR.
    pub unclean_leader_election: bool,
    /// `reconsume.backoff.ms`: on a group's retry topic, the pause before redelivery
    /// number n is the nth entry (the last one beyond the list).
    pub reconsume_backoff_ms: Vec<u64>,
    /// `max.reconsume.times`: on a group's retry topic, redeliveries before a record
    /// that is still refused goes to the group's dead-letter topic.
    pub max_reconsume_times: u32,
}

/// The retry topic of consumer group G is this prefix and G (`client::retry`).
pub const RETRY_TOPIC_PREFIX: &str = "_retry.";
/// The dead-letter topic of consumer group G is this prefix and G.
pub const DLQ_TOPIC_PREFIX: &str = "_dlq.";

/// Whether `name` is a consumer group's retry or dead-letter topic: pattern
/// subscriptions leave them out (a group reads its own retry topic by name).
pub fn is_group_retry_topic(name: &str) -> bool {
    name.starts_with(RETRY_TOPIC_PREFIX) || name.starts_with(DLQ_TOPIC_PREFIX)
}

/// RocketMQ's retry levels, from 1 s to 2 h (`reconsume.backoff.ms` by default).
pub const RECONSUME_BACKOFF_DEFAULT_MS: [u64; 18] = [
    1_000, 5_000, 10_000, 30_000, 60_000, 120_000, 180_000, 240_000, 300_000, 360_000, 420_000,
    480_000, 540_000, 600_000, 1_200_000, 1_800_000, 3_600_000, 7_200_000,
];
/// Most entries `reconsume.backoff.ms` may list.
pub const RECONSUME_LEVELS_MAX: usize = 64;
/// Longest entry of `reconsume.backoff.ms`: the longest delay a timer takes (40 days).
pub const RECONSUME_BACKOFF_MAX_MS: u64 = 40 * DAY_MS as u64;
/// Largest `max.reconsume.times`.
pub const MAX_RECONSUME_TIMES_MAX: u32 = 10_000;

/// Largest size of a segment: positions in the offset index are 32-bit.
pub const SEGMENT_BYTES_MAX: u64 = i32::MAX as u64;
const DAY_MS: i64 = 24 * 60 * 60 * 1000;

impl Default for TopicConfig {
    fn default() -> Self {
        Self {
            segment_bytes: 1 << 30,
            segment_ms: 7 * DAY_MS,
            segment_index_bytes: 10 << 20,
            index_interval_bytes: 4096,
            retention_ms: 7 * DAY_MS,
            retention_bytes: -1,
            max_message_bytes: 1 << 20,
            flush_messages: u64::MAX,
            flush_ms: i64::MAX,
            flush_mode: FlushMode::Async,
            min_insync_replicas: 1,
            unclean_leader_election: false,
            reconsume_backoff_ms: RECONSUME_BACKOFF_DEFAULT_MS.to_vec(),
            max_reconsume_times: 16,
        }
    }
}

/// A rejected config key or value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid config {key}={value}: {reason}")]
pub struct ConfigError {
    /// The key as given.
    pub key: String,
    /// The value as given.
    pub value: String,
    /// What is allowed.
    pub reason: String,
}

/// Every key this module accepts, with a one-line description.
pub const KEYS: &[(&str, &str)] = &[
    (
        "segment.bytes",
        "segment size before a roll, bytes [64, 2147483647]",
    ),
    ("segment.ms", "segment age before a roll, ms [1, ..]"),
    (
        "segment.index.bytes",
        "preallocated index size, bytes [16, 2147483647]",
    ),
    (
        "index.interval.bytes",
        "bytes between offset-index entries [0, 2147483647]",
    ),
    (
        "retention.ms",
        "age after which segments are deleted, ms, -1 = forever",
    ),
    (
        "retention.bytes",
        "log size above which old segments are deleted, -1 = unlimited",
    ),
    (
        "max.message.bytes",
        "largest batch accepted, bytes [64, 1073741824]",
    ),
    (
        "flush.messages",
        "records between fsyncs in async mode [1, ..]",
    ),
    ("flush.ms", "ms between fsyncs in async mode [0, ..]"),
    ("flush.mode", "async | sync"),
    (
        "min.insync.replicas",
        "replicas needed for acks=all [1, ..]",
    ),
    ("unclean.leader.election.enable", "true | false"),
    (
        "reconsume.backoff.ms",
        "retry topics: pause before each redelivery, ms, comma-separated (1 to 64 entries)",
    ),
    (
        "max.reconsume.times",
        "retry topics: redeliveries before the dead-letter topic [0, 10000]",
    ),
];

fn parse_int<T: std::str::FromStr + PartialOrd + fmt::Display + Copy>(
    key: &str,
    value: &str,
    min: T,
    max: T,
) -> Result<T, ConfigError> {
    let err = |reason: String| ConfigError {
        key: key.to_owned(),
        value: value.to_owned(),
        reason,
    };
    let parsed: T = value
        .trim()
        .parse()
        .map_err(|_| err(format!("not an integer in [{min}, {max}]")))?;
    if parsed < min || parsed > max {
        return Err(err(format!("must be in [{min}, {max}]")));
    }
    Ok(parsed)
}

fn parse_limit(key: &str, value: &str, min: i64) -> Result<i64, ConfigError> {
    let v = parse_int(key, value, -1, i64::MAX)?;
    if v != -1 && v < min {
        return Err(ConfigError {
            key: key.to_owned(),
            value: value.to_owned(),
            reason: format!("must be -1 (unlimited) or at least {min}"),
        });
    }
    Ok(v)
}

/// A comma-separated list of 1 to [`RECONSUME_LEVELS_MAX`] delays in ms.
fn parse_levels(key: &str, value: &str) -> Result<Vec<u64>, ConfigError> {
    let levels = value
        .split(',')
        .map(|v| parse_int(key, v, 0, RECONSUME_BACKOFF_MAX_MS))
        .collect::<Result<Vec<u64>, _>>()?;
    if levels.len() > RECONSUME_LEVELS_MAX {
        return Err(ConfigError {
            key: key.to_owned(),
            value: value.to_owned(),
            reason: format!(
                "lists {} delays; the limit is {RECONSUME_LEVELS_MAX}",
                levels.len()
            ),
        });
    }
    Ok(levels)
}

impl TopicConfig {
    /// Defaults overridden by `pairs`; fails on the first unknown key or bad value.
    pub fn from_pairs<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, ConfigError> {
        let mut config = Self::default();
        for (k, v) in pairs {
            config.set(k, v)?;
        }
        Ok(config)
    }

    /// Sets one key from its string form.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        match key {
            "segment.bytes" => self.segment_bytes = parse_int(key, value, 64, SEGMENT_BYTES_MAX)?,
            "segment.ms" => self.segment_ms = parse_int(key, value, 1, i64::MAX)?,
            "segment.index.bytes" => {
                self.segment_index_bytes = parse_int(key, value, 16, i32::MAX as usize)?
            }
            "index.interval.bytes" => {
                self.index_interval_bytes = parse_int(key, value, 0, i32::MAX as u64)?
            }
            "retention.ms" => self.retention_ms = parse_limit(key, value, 0)?,
            "retention.bytes" => self.retention_bytes = parse_limit(key, value, 0)?,
            "max.message.bytes" => self.max_message_bytes = parse_int(key, value, 64, 1 << 30)?,
            "flush.messages" => self.flush_messages = parse_int(key, value, 1, u64::MAX)?,
            "flush.ms" => self.flush_ms = parse_int(key, value, 0, i64::MAX)?,
            "flush.mode" => {
                self.flush_mode = match value.trim() {
                    "async" => FlushMode::Async,
                    "sync" => FlushMode::Sync,
                    _ => {
                        return Err(ConfigError {
                            key: key.into(),
                            value: value.into(),
                            reason: "must be async or sync".into(),
                        })
                    }
                }
            }
            "min.insync.replicas" => self.min_insync_replicas = parse_int(key, value, 1, u32::MAX)?,
            "unclean.leader.election.enable" => {
                self.unclean_leader_election = match value.trim() {
                    "true" => true,
                    "false" => false,
                    _ => {
                        return Err(ConfigError {
                            key: key.into(),
                            value: value.into(),
                            reason: "must be true or false".into(),
                        })
                    }
                }
            }
            "reconsume.backoff.ms" => self.reconsume_backoff_ms = parse_levels(key, value)?,
            "max.reconsume.times" => {
                self.max_reconsume_times = parse_int(key, value, 0, MAX_RECONSUME_TIMES_MAX)?
            }
            _ => {
                return Err(ConfigError {
                    key: key.into(),
                    value: value.into(),
                    reason: format!(
                        "unknown key; known keys: {}",
                        KEYS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
                    ),
                })
            }
        }
        Ok(())
    }

    /// Every key with its current value, as strings (for `topics describe`).
    pub fn to_pairs(&self) -> BTreeMap<String, String> {
        let mode = match self.flush_mode {
            FlushMode::Async => "async",
            FlushMode::Sync => "sync",
        };
        [
            ("segment.bytes", self.segment_bytes.to_string()),
            ("segment.ms", self.segment_ms.to_string()),
            ("segment.index.bytes", self.segment_index_bytes.to_string()),
            (
                "index.interval.bytes",
                self.index_interval_bytes.to_string(),
            ),
            ("retention.ms", self.retention_ms.to_string()),
            ("retention.bytes", self.retention_bytes.to_string()),
            ("max.message.bytes", self.max_message_bytes.to_string()),
            ("flush.messages", self.flush_messages.to_string()),
            ("flush.ms", self.flush_ms.to_string()),
            ("flush.mode", mode.to_string()),
            ("min.insync.replicas", self.min_insync_replicas.to_string()),
            (
                "unclean.leader.election.enable",
                self.unclean_leader_election.to_string(),
            ),
            (
                "reconsume.backoff.ms",
                self.reconsume_backoff_ms
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            ("max.reconsume.times", self.max_reconsume_times.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_round_trips_through_its_string_form() {
        let config = TopicConfig::default();
        let pairs = config.to_pairs();
        assert_eq!(pairs.len(), KEYS.len());
        let again =
            TopicConfig::from_pairs(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))).unwrap();
        assert_eq!(again, config);
    }

    #[test]
    fn errors_name_the_key_and_the_range() {
        let err = TopicConfig::from_pairs([("segment.bytes", "10")]).unwrap_err();
        assert_eq!(err.key, "segment.bytes");
        assert!(err.reason.contains("[64, 2147483647]"), "{err}");
        let err = TopicConfig::from_pairs([("retention.ms", "-5")]).unwrap_err();
        assert!(err.reason.contains("-1"), "{err}");
        let err = TopicConfig::from_pairs([("no.such.key", "1")]).unwrap_err();
        assert!(err.reason.contains("unknown key"), "{err}");
        let err = TopicConfig::from_pairs([("flush.mode", "later")]).unwrap_err();
        assert!(err.to_string().contains("flush.mode=later"), "{err}");
    }

    #[test]
    fn valid_values_are_applied() {
        let c = TopicConfig::from_pairs([
            ("flush.mode", "sync"),
            ("retention.bytes", "1000"),
            ("min.insync.replicas", "2"),
        ])
        .unwrap();
        assert_eq!(c.flush_mode, FlushMode::Sync);
        assert_eq!(c.retention_bytes, 1000);
        assert_eq!(c.min_insync_replicas, 2);
    }

    #[test]
    fn reconsume_levels_parse_and_are_bounded() {
        let c = TopicConfig::from_pairs([
            ("reconsume.backoff.ms", "500, 1000,2000"),
            ("max.reconsume.times", "3"),
        ])
        .unwrap();
        assert_eq!(c.reconsume_backoff_ms, vec![500, 1000, 2000]);
        assert_eq!(c.max_reconsume_times, 3);
        for bad in ["", "1,,2", "-1", "1,x", &["1"; 65].join(",")] {
            let err = TopicConfig::from_pairs([("reconsume.backoff.ms", bad)]).unwrap_err();
            assert_eq!(err.key, "reconsume.backoff.ms", "{bad:?}");
        }
        let too_long = (RECONSUME_BACKOFF_MAX_MS + 1).to_string();
        assert!(TopicConfig::from_pairs([("reconsume.backoff.ms", too_long.as_str())]).is_err());
        assert!(TopicConfig::from_pairs([("max.reconsume.times", "10001")]).is_err());
    }
}
