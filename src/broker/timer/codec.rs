//! What `__timers` records hold (each record's value is one [`TimerRecord`], protobuf), the
//! ids handed to producers, and which `__timers` partition holds a target's timers.
//!
//! A partition's log is the whole truth about its timers: `Schedule` records are the
//! pending records themselves; an `Intent` claims due ones for one delivery batch (written
//! before the batch is sent, with the producer id, epoch and sequence it is sent with);
//! `Done` confirms a delivery; `Cancel` and `Dropped` retire a timer without delivery;
//! `Owner` records the producer id and epoch of each leadership.

use bytes::Bytes;

/// The internal topic holding pending timers and the movers' progress.
pub const TIMERS_TOPIC: &str = "__timers";

/// One `__timers` record.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TimerRecord {
    /// What it records.
    #[prost(oneof = "Entry", tags = "1, 2, 3, 4, 5, 6")]
    pub entry: Option<Entry>,
}

/// The kinds of `__timers` records.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Entry {
    /// A record waiting for its due time.
    #[prost(message, tag = "1")]
    Schedule(Schedule),
    /// Due timers claimed for one delivery batch.
    #[prost(message, tag = "2")]
    Intent(Intent),
    /// A delivery batch arrived.
    #[prost(message, tag = "3")]
    Done(Done),
    /// A timer cancelled before it was due.
    #[prost(message, tag = "4")]
    Cancel(Cancel),
    /// The producer id and epoch a new leader delivers with.
    #[prost(message, tag = "5")]
    Owner(Owner),
    /// Timers given up (their topic or partition no longer exists).
    #[prost(message, tag = "6")]
    Dropped(Dropped),
}

/// A record header.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Header {
    /// Name.
    #[prost(string, tag = "1")]
    pub key: String,
    /// Value; absent for a null value.
    #[prost(bytes = "bytes", optional, tag = "2")]
    pub value: Option<Bytes>,
}

/// A scheduled record: where it goes, when, and the record itself.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Schedule {
    /// Target topic.
    #[prost(string, tag = "1")]
    pub topic: String,
    /// Target partition.
    #[prost(uint32, tag = "2")]
    pub partition: u32,
    /// When it is due (ms since the epoch).
    #[prost(int64, tag = "3")]
    pub due_ms: i64,
    /// The record's own timestamp (kept in a header on delivery).
    #[prost(int64, tag = "4")]
    pub timestamp_ms: i64,
    /// Key.
    #[prost(bytes = "bytes", optional, tag = "5")]
    pub key: Option<Bytes>,
    /// Value.
    #[prost(bytes = "bytes", optional, tag = "6")]
    pub value: Option<Bytes>,
    /// Headers (the tag among them).
    #[prost(message, repeated, tag = "7")]
    pub headers: Vec<Header>,
}

/// Due timers claimed for one delivery batch to one target partition.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Intent {
    /// Target topic.
    #[prost(string, tag = "1")]
    pub topic: String,
    /// Target partition.
    #[prost(uint32, tag = "2")]
    pub partition: u32,
    /// Producer id of the batch.
    #[prost(int64, tag = "3")]
    pub producer_id: i64,
    /// Its producer epoch.
    #[prost(int32, tag = "4")]
    pub producer_epoch: i32,
    /// Sequence of its first record.
    #[prost(int32, tag = "5")]
    pub base_sequence: i32,
    /// The `Schedule` offsets delivered, in batch order.
    #[prost(uint64, repeated, tag = "6")]
    pub offsets: Vec<u64>,
    /// Their due times, in the same order.
    #[prost(int64, repeated, tag = "7")]
    pub dues: Vec<i64>,
}

/// A delivery batch arrived at its target.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Done {
    /// Target topic.
    #[prost(string, tag = "1")]
    pub topic: String,
    /// Target partition.
    #[prost(uint32, tag = "2")]
    pub partition: u32,
    /// Offset of its `Intent`.
    #[prost(uint64, tag = "3")]
    pub intent_offset: u64,
}

/// A timer cancelled before it was due.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Cancel {
    /// Offset of its `Schedule`.
    #[prost(uint64, tag = "1")]
    pub offset: u64,
    /// Its due time.
    #[prost(int64, tag = "2")]
    pub due_ms: i64,
}

/// The producer id and epoch of a leadership.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Owner {
    /// Producer id.
    #[prost(int64, tag = "1")]
    pub producer_id: i64,
    /// Producer epoch.
    #[prost(int32, tag = "2")]
    pub producer_epoch: i32,
}

/// Timers given up without delivery.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Dropped {
    /// Target topic.
    #[prost(string, tag = "1")]
    pub topic: String,
    /// Target partition.
    #[prost(uint32, tag = "2")]
    pub partition: u32,
    /// The `Schedule` offsets.
    #[prost(uint64, repeated, tag = "3")]
    pub offsets: Vec<u64>,
    /// Their due times.
    #[prost(int64, repeated, tag = "4")]
    pub dues: Vec<i64>,
    /// Why.
    #[prost(string, tag = "5")]
    pub reason: String,
}

/// The `__timers` partition that holds the timers of `topic`-`partition`: CRC32C of
/// `topic`, mixed with the partition, modulo `count`. Every timer of one target
/// partition lives in one `__timers` partition, so one mover delivers them in due order.
pub fn timer_partition_for(topic: &str, partition: u32, count: u32) -> u32 {
    let h = crc32c::crc32c_append(crc32c::crc32c(topic.as_bytes()), &partition.to_be_bytes());
    h % count.max(1)
}

/// A scheduled record's id: its `__timers` partition, offset and due time, printed as
/// `P-OFFSET-DUE_MS`. The due time lets a cancel find the timer without an index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TimerId {
    /// `__timers` partition.
    pub partition: u32,
    /// Offset of its `Schedule` record.
    pub offset: u64,
    /// Due time (ms).
    pub due_ms: i64,
}

impl std::fmt::Display for TimerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}-{}", self.partition, self.offset, self.due_ms)
    }
}

impl std::str::FromStr for TimerId {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("'{s}' is not a scheduled record id (PARTITION-OFFSET-DUE_MS)");
        let mut parts = s.splitn(3, '-');
        let mut next = || parts.next().ok_or_else(bad);
        let (p, o, d) = (next()?, next()?, next()?);
        Ok(TimerId {
            partition: p.parse().map_err(|_| bad())?,
            offset: o.parse().map_err(|_| bad())?,
            due_ms: d.parse().map_err(|_| bad())?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use prost::Message;

    proptest! {
        #[test]
        fn ids_round_trip(partition in any::<u32>(), offset in any::<u64>(), due_ms in 0i64..i64::MAX) {
            let id = TimerId { partition, offset, due_ms };
            prop_assert_eq!(id.to_string().parse::<TimerId>(), Ok(id));
        }

        #[test]
        fn any_id_text_parses_or_is_refused(s in ".{0,40}") {
            let _ = s.parse::<TimerId>();
        }

        #[test]
        fn timer_partitions_are_in_range(topic in "[a-z]{1,20}", p in any::<u32>(), n in 1u32..100) {
            prop_assert!(timer_partition_for(&topic, p, n) < n);
        }
    }

    #[test]
    fn records_round_trip() {
        let r = TimerRecord {
            entry: Some(Entry::Intent(Intent {
                topic: "t".into(),
                partition: 3,
                producer_id: 7,
                producer_epoch: 2,
                base_sequence: 10,
                offsets: vec![1, 5],
                dues: vec![100, 90],
            })),
        };
        assert_eq!(TimerRecord::decode(r.encode_to_vec().as_slice()), Ok(r));
        assert!("1-2".parse::<TimerId>().is_err());
        assert!("1-2-x".parse::<TimerId>().is_err());
        assert!("-1-2-3".parse::<TimerId>().is_err());
    }
}
