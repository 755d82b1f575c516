//! Committed offsets as records of `__consumer_offsets`: the key names the group, the
//! member instance (broadcast groups only), the topic and the partition; the value holds
//! the offset and metadata; a null value (tombstone) deletes. The latest record of a key
//! wins. Both are JSON, so `tidelog dump-log --print-data` shows them readably.

use serde::{Deserialize, Serialize};

use crate::record::{BatchBuilder, Compression, Record, RecordRef};

/// The internal topic.
pub const OFFSETS_TOPIC: &str = "__consumer_offsets";

/// What a committed offset is for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct OffsetKey {
    /// The group.
    #[serde(rename = "g")]
    pub group: String,
    /// The member instance (broadcast groups); empty otherwise.
    #[serde(rename = "i", default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
    /// The topic.
    #[serde(rename = "t")]
    pub topic: String,
    /// The partition.
    #[serde(rename = "p")]
    pub partition: u32,
}

/// A committed offset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffsetValue {
    /// The next offset to consume.
    #[serde(rename = "o")]
    pub offset: i64,
    /// Client metadata.
    #[serde(rename = "m", default)]
    pub metadata: String,
    /// When it was committed (ms).
    #[serde(rename = "ts", default)]
    pub timestamp: i64,
}

/// Longest commit metadata a client may attach (Kafka's `offset.metadata.max.bytes`).
pub const METADATA_BYTES_MAX: usize = 4096;

/// Room a batch keeps for a record's framing besides its key and value (varints,
/// attributes, header count): generous, so a batch never exceeds its budget.
const RECORD_OVERHEAD_MAX: usize = 32;

/// Encodes commits (`None`: delete) as record batches of at most `batch_bytes_max` each
/// (the offsets topic's `max.message.bytes`), concatenated: any number of offsets can be
/// written in one append. A single record larger than the budget gets a batch of its own
/// (and the append refuses it).
pub fn encode(
    entries: &[(OffsetKey, Option<OffsetValue>)],
    now_ms: i64,
    batch_bytes_max: usize,
) -> Vec<u8> {
    encode_as(entries, now_ms, batch_bytes_max, None)
}

/// A producer writing offsets inside its transaction: id, epoch, first sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnProducer {
    /// Producer id.
    pub producer_id: i64,
    /// Producer epoch.
    pub producer_epoch: i16,
    /// Sequence of the first record written.
    pub first_sequence: i32,
}

/// [`encode`] as transactional batches of `producer` (`None`: plain batches); the
/// sequences continue across the batches.
pub fn encode_as(
    entries: &[(OffsetKey, Option<OffsetValue>)],
    now_ms: i64,
    batch_bytes_max: usize,
    producer: Option<TxnProducer>,
) -> Vec<u8> {
    let mut sequence = producer.map_or(0, |p| p.first_sequence);
    let fresh = |sequence: i32| match producer {
        None => BatchBuilder::new(Compression::None),
        Some(p) => BatchBuilder::new(Compression::None)
            .producer(p.producer_id, p.producer_epoch, sequence)
            .transactional(true),
    };
    let mut out = Vec::new();
    let mut builder = fresh(sequence);
    for (k, v) in entries {
        let key = serde_json::to_vec(k).expect("serializable");
        let value = v
            .as_ref()
            .map(|v| serde_json::to_vec(v).expect("serializable"));
        let size = key.len() + value.as_ref().map_or(0, Vec::len) + RECORD_OVERHEAD_MAX;
        if !builder.is_empty() && builder.uncompressed_size() + size > batch_bytes_max {
            out.extend(builder.build(0).expect("not empty"));
            sequence = crate::partition::producer_state::next_sequence(
                sequence.wrapping_add(builder.len() as i32 - 1),
            );
            builder = fresh(sequence);
        }
        builder.push(RecordRef {
            timestamp: now_ms,
            key: Some(&key),
            value: value.as_deref(),
            headers: &[],
        });
    }
    if !builder.is_empty() {
        out.extend(builder.build(0).expect("not empty"));
    }
    out
}

/// Decodes one record of the offsets topic; `None` for records it does not recognise.
pub fn decode(record: &Record) -> Option<(OffsetKey, Option<OffsetValue>)> {
    let key: OffsetKey = serde_json::from_slice(record.key.as_deref()?).ok()?;
    let value = match &record.value {
        None => None,
        Some(v) => Some(serde_json::from_slice(v).ok()?),
    };
    Some((key, value))
}

/// The offsets partition of a group: a stable hash of its name modulo the partition count.
pub fn partition_for(group: &str, partitions: u32) -> u32 {
    crc32c::crc32c(group.as_bytes()) % partitions.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::decode_data_records;

    #[test]
    fn commits_and_tombstones_round_trip() {
        let k = OffsetKey {
            group: "g".into(),
            instance: String::new(),
            topic: "t".into(),
            partition: 3,
        };
        let v = OffsetValue {
            offset: 42,
            metadata: "m".into(),
            timestamp: 7,
        };
        let bytes = encode(
            &[(k.clone(), Some(v.clone())), (k.clone(), None)],
            7,
            1 << 20,
        );
        let records = decode_data_records(&bytes, 1 << 20).unwrap();
        assert_eq!(decode(&records[0]), Some((k.clone(), Some(v))));
        assert_eq!(decode(&records[1]), Some((k, None)));
        assert_eq!(partition_for("g", 50), partition_for("g", 50));
        assert!(partition_for("another", 50) < 50);
    }

    #[test]
    fn transactional_offsets_continue_the_producers_sequence_across_batches() {
        let entries: Vec<(OffsetKey, Option<OffsetValue>)> = (0..300)
            .map(|p| {
                let key = OffsetKey {
                    group: "g".into(),
                    instance: String::new(),
                    topic: "t".into(),
                    partition: p,
                };
                let value = OffsetValue {
                    offset: 1,
                    metadata: String::new(),
                    timestamp: 1,
                };
                (key, Some(value))
            })
            .collect();
        let producer = TxnProducer {
            producer_id: 7,
            producer_epoch: 3,
            first_sequence: 40,
        };
        let bytes = encode_as(&entries, 1, 4096, Some(producer));
        let mut next = 40;
        let mut batches = 0;
        for batch in crate::record::BatchIter::new(&bytes) {
            let h = *batch.unwrap().header();
            assert!(h.is_transactional());
            assert_eq!((h.producer_id, h.producer_epoch), (7, 3));
            assert_eq!(h.base_sequence, next);
            next += h.record_count;
            batches += 1;
        }
        assert!(batches > 1, "{batches} batches");
        assert_eq!(next, 340);
    }

    #[test]
    fn many_offsets_are_split_into_batches_within_the_budget() {
        let entries: Vec<(OffsetKey, Option<OffsetValue>)> = (0..20_000)
            .map(|p| {
                let key = OffsetKey {
                    group: "a-group-with-a-longish-name".into(),
                    instance: String::new(),
                    topic: "orders.eu-west".into(),
                    partition: p,
                };
                let value = OffsetValue {
                    offset: i64::from(p) * 1000,
                    metadata: "x".repeat((p % 50) as usize),
                    timestamp: 1,
                };
                (key, Some(value))
            })
            .collect();
        let budget = 64 * 1024;
        let bytes = encode(&entries, 7, budget);
        let mut batches = 0;
        for batch in crate::record::BatchIter::new(&bytes) {
            let batch = batch.unwrap();
            let size = batch.as_bytes().len();
            assert!(size <= budget, "a batch of {size} bytes");
            batches += 1;
        }
        assert!(batches > 10, "{batches} batches");
        let records = decode_data_records(&bytes, 1 << 30).unwrap();
        let decoded: Vec<_> = records.iter().map(|r| decode(r).unwrap()).collect();
        assert_eq!(decoded, entries);
    }
}
