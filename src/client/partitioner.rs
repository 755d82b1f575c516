//! Choosing a partition for a record: explicit, by key (murmur2 exactly as Kafka's default
//! partitioner, so a key lands in the same partition number as with a Kafka client),
//! round-robin, or sticky for records without a key.

use std::sync::atomic::{AtomicU32, Ordering};

/// Kafka's murmur2 (`org.apache.kafka.common.utils.Utils.murmur2`).
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = SEED ^ (len as u32);
    let chunks = len / 4;
    for i in 0..chunks {
        let b = &data[i * 4..i * 4 + 4];
        let mut k = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = &data[chunks * 4..];
    if tail.len() >= 3 {
        h ^= (tail[2] as u32) << 16;
    }
    if tail.len() >= 2 {
        h ^= (tail[1] as u32) << 8;
    }
    if !tail.is_empty() {
        h ^= tail[0] as u32;
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition Kafka's default partitioner picks for `key`.
pub fn partition_for_key(key: &[u8], partitions: u32) -> u32 {
    ((murmur2(key) & 0x7fff_ffff) as u32) % partitions
}

/// How records without an explicit partition are spread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Partitioning {
    /// Keyed records by murmur2(key); records without a key stick to one partition per batch.
    #[default]
    Sticky,
    /// Keyed records by murmur2(key); records without a key round-robin.
    RoundRobin,
}

/// Picks partitions; one per producer.
#[derive(Debug, Default)]
pub struct Partitioner {
    mode: Partitioning,
    counter: AtomicU32,
}

impl Partitioner {
    /// A partitioner in `mode`.
    pub fn new(mode: Partitioning) -> Self {
        Self {
            mode,
            counter: AtomicU32::new(0),
        }
    }

    /// The partition for a record with `key` among `partitions`.
    pub fn partition(&self, key: Option<&[u8]>, partitions: u32) -> u32 {
        if let Some(k) = key {
            return partition_for_key(k, partitions);
        }
        match self.mode {
            Partitioning::RoundRobin => self.counter.fetch_add(1, Ordering::Relaxed) % partitions,
            Partitioning::Sticky => self.counter.load(Ordering::Relaxed) % partitions,
        }
    }

    /// The sticky partitioner continues on `partition` (fault avoidance moved it off the
    /// one it had); round-robin is left as it is.
    pub fn stick_to(&self, partition: u32) {
        if self.mode == Partitioning::Sticky {
            self.counter.store(partition, Ordering::Relaxed);
        }
    }

    /// A batch of keyless records was sent: the sticky partitioner moves on.
    pub fn batch_done(&self) {
        if self.mode == Partitioning::Sticky {
            self.counter.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur2_matches_kafka() {
        // Values computed by Kafka's Utils.murmur2.
        for (key, want) in [
            ("1", -1993445489),
            ("12", 126087238),
            ("123", -267702483),
            ("1234", -1614185708),
            ("12345", -1188365604),
        ] {
            assert_eq!(murmur2(key.as_bytes()), want, "{key}");
        }
    }

    #[test]
    fn keys_spread_and_stay_put() {
        let p = Partitioner::new(Partitioning::RoundRobin);
        assert_eq!(p.partition(Some(b"k"), 6), p.partition(Some(b"k"), 6));
        let seen: std::collections::BTreeSet<u32> = (0..6).map(|_| p.partition(None, 6)).collect();
        assert_eq!(seen.len(), 6);
    }
}
