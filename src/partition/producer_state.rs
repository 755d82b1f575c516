//! Idempotent producers: per producer id, its epoch and its last few batches' sequence
//! ranges and offsets, so a leader recognises a retried batch (and answers with the
//! offsets it got the first time) and refuses one that skips or reorders sequences.
//!
//! Kafka's rules, per partition and producer id:
//! - an unknown producer id starts wherever its first batch says;
//! - an older epoch is fenced (`InvalidProducerEpoch`); a newer one must start at
//!   sequence 0 and replaces the entry;
//! - in the same epoch, a batch equal to one of the last [`RETAINED_BATCHES`] is a
//!   duplicate; the next batch must start right after the last one (sequences wrap at
//!   `i32::MAX`); anything else is out of order.
//!
//! The table is kept by leaders and followers alike (followers record what they copy), so a
//! new leader dedupes retries of batches its predecessor wrote. It is saved as
//! `producer-state.snapshot` (with the log offset it covers) at checkpoints, and rebuilt at
//! open by replaying batches after that offset.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Batches remembered per producer for duplicate detection (Kafka keeps 5).
pub const RETAINED_BATCHES: usize = 5;

/// The snapshot file in a partition directory.
pub const SNAPSHOT_FILE: &str = "producer-state.snapshot";

/// One appended batch of a producer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerBatch {
    /// Sequence of its first record.
    pub first_seq: i32,
    /// Sequence of its last record.
    pub last_seq: i32,
    /// Offset of its first record.
    pub first_offset: u64,
    /// Offset of its last record.
    pub last_offset: u64,
}

/// What the log knows of one producer id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerEntry {
    /// Its current epoch.
    pub epoch: i16,
    /// Its last batches, oldest first.
    pub batches: VecDeque<ProducerBatch>,
}

/// The verdict on an incoming batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SequenceCheck {
    /// New: append it.
    Append,
    /// Already appended at these offsets: do not append again.
    Duplicate(ProducerBatch),
}

/// Why a batch was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SequenceError {
    /// The batch does not continue the producer's sequence.
    #[error("producer {producer_id}: sequence {got} does not follow {last} (expected {expected})")]
    OutOfOrder {
        /// The producer id.
        producer_id: i64,
        /// The last sequence appended.
        last: i32,
        /// The sequence expected next.
        expected: i32,
        /// The batch's first sequence.
        got: i32,
    },
    /// The batch's producer epoch is older than the current one.
    #[error("producer {producer_id}: epoch {got} is older than the current {current} (fenced by a newer producer)")]
    FencedEpoch {
        /// The producer id.
        producer_id: i64,
        /// The current epoch.
        current: i16,
        /// The batch's epoch.
        got: i16,
    },
    /// A newer epoch must start at sequence 0.
    #[error("producer {producer_id}: a new epoch {epoch} must start at sequence 0, not {got}")]
    NewEpochNotAtZero {
        /// The producer id.
        producer_id: i64,
        /// The new epoch.
        epoch: i16,
        /// The batch's first sequence.
        got: i32,
    },
}

/// The next sequence after `seq` (wrapping like Kafka's).
pub fn next_sequence(seq: i32) -> i32 {
    if seq == i32::MAX {
        0
    } else {
        seq + 1
    }
}

/// Every producer's state in one partition.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerStateTable {
    producers: HashMap<i64, ProducerEntry>,
}

impl ProducerStateTable {
    /// Checks an incoming batch of `producer_id` (epoch, sequences `first_seq..=last_seq`).
    pub fn check(
        &self,
        producer_id: i64,
        epoch: i16,
        first_seq: i32,
        last_seq: i32,
    ) -> Result<SequenceCheck, SequenceError> {
        let Some(entry) = self.producers.get(&producer_id) else {
            return Ok(SequenceCheck::Append);
        };
        if epoch < entry.epoch {
            return Err(SequenceError::FencedEpoch {
                producer_id,
                current: entry.epoch,
                got: epoch,
            });
        }
        if epoch > entry.epoch {
            if first_seq != 0 {
                return Err(SequenceError::NewEpochNotAtZero {
                    producer_id,
                    epoch,
                    got: first_seq,
                });
            }
            return Ok(SequenceCheck::Append);
        }
        if let Some(b) = entry
            .batches
            .iter()
            .find(|b| b.first_seq == first_seq && b.last_seq == last_seq)
        {
            return Ok(SequenceCheck::Duplicate(*b));
        }
        match entry.batches.back() {
            Some(last) if first_seq != next_sequence(last.last_seq) => {
                Err(SequenceError::OutOfOrder {
                    producer_id,
                    last: last.last_seq,
                    expected: next_sequence(last.last_seq),
                    got: first_seq,
                })
            }
            _ => Ok(SequenceCheck::Append),
        }
    }

    /// Records an appended batch.
    pub fn record(&mut self, producer_id: i64, epoch: i16, batch: ProducerBatch) {
        let entry = self
            .producers
            .entry(producer_id)
            .or_insert_with(|| ProducerEntry {
                epoch,
                batches: VecDeque::new(),
            });
        if epoch != entry.epoch {
            entry.epoch = epoch;
            entry.batches.clear();
        }
        entry.batches.push_back(batch);
        while entry.batches.len() > RETAINED_BATCHES {
            entry.batches.pop_front();
        }
    }

    /// Forgets batches at or above `offset` (the log was truncated there).
    pub fn truncate_to(&mut self, offset: u64) {
        for entry in self.producers.values_mut() {
            entry.batches.retain(|b| b.first_offset < offset);
        }
        self.producers.retain(|_, e| !e.batches.is_empty());
    }

    /// Forgets everything (the log restarted empty).
    pub fn clear(&mut self) {
        self.producers.clear();
    }

    /// Number of producers known.
    pub fn len(&self) -> usize {
        self.producers.len()
    }

    /// True when no producer is known.
    pub fn is_empty(&self) -> bool {
        self.producers.is_empty()
    }
}

#[derive(Serialize, Deserialize)]
struct Snapshot {
    /// Every batch below this offset is reflected in `table`.
    offset: u64,
    table: ProducerStateTable,
}

fn snapshot_path(dir: &Path) -> PathBuf {
    dir.join(SNAPSHOT_FILE)
}

/// Writes the table, covering the log below `offset`, atomically.
pub fn save_snapshot(dir: &Path, table: &ProducerStateTable, offset: u64) -> io::Result<()> {
    let body = serde_json::to_vec(&Snapshot {
        offset,
        table: table.clone(),
    })
    .map_err(io::Error::other)?;
    let tmp = dir.join(format!("{SNAPSHOT_FILE}.tmp"));
    std::fs::write(&tmp, &body)?;
    std::fs::rename(&tmp, snapshot_path(dir))
}

/// Loads the saved table and the offset it covers; `None` when there is none or it is
/// unreadable (the caller replays the log instead).
pub fn load_snapshot(dir: &Path) -> Option<(ProducerStateTable, u64)> {
    let bytes = std::fs::read(snapshot_path(dir)).ok()?;
    match serde_json::from_slice::<Snapshot>(&bytes) {
        Ok(s) => Some((s.table, s.offset)),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "unreadable producer-state snapshot; rebuilding from the log");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(first_seq: i32, last_seq: i32, first_offset: u64) -> ProducerBatch {
        ProducerBatch {
            first_seq,
            last_seq,
            first_offset,
            last_offset: first_offset + (last_seq - first_seq) as u64,
        }
    }

    #[test]
    fn duplicates_and_gaps_are_recognised() {
        let mut t = ProducerStateTable::default();
        assert_eq!(t.check(7, 0, 0, 9), Ok(SequenceCheck::Append));
        t.record(7, 0, batch(0, 9, 100));
        assert_eq!(t.check(7, 0, 10, 19), Ok(SequenceCheck::Append));
        t.record(7, 0, batch(10, 19, 110));
        // A retry of either batch is a duplicate with its original offsets.
        assert_eq!(
            t.check(7, 0, 0, 9),
            Ok(SequenceCheck::Duplicate(batch(0, 9, 100)))
        );
        assert_eq!(
            t.check(7, 0, 10, 19),
            Ok(SequenceCheck::Duplicate(batch(10, 19, 110)))
        );
        // A gap or a replay of something partial is out of order.
        assert!(matches!(
            t.check(7, 0, 25, 30),
            Err(SequenceError::OutOfOrder { expected: 20, .. })
        ));
        assert!(matches!(
            t.check(7, 0, 5, 9),
            Err(SequenceError::OutOfOrder { .. })
        ));
        // Epochs: older fenced, newer must start at 0.
        assert!(matches!(
            t.check(7, -1, 20, 20),
            Err(SequenceError::FencedEpoch { .. })
        ));
        assert!(matches!(
            t.check(7, 1, 20, 20),
            Err(SequenceError::NewEpochNotAtZero { .. })
        ));
        assert_eq!(t.check(7, 1, 0, 0), Ok(SequenceCheck::Append));
        // Another producer is independent.
        assert_eq!(t.check(8, 0, 42, 42), Ok(SequenceCheck::Append));
    }

    #[test]
    fn only_the_last_batches_are_remembered_and_truncation_forgets() {
        let mut t = ProducerStateTable::default();
        for i in 0..10 {
            t.record(1, 0, batch(i * 10, i * 10 + 9, (i * 10) as u64));
        }
        assert!(matches!(
            t.check(1, 0, 0, 9),
            Err(SequenceError::OutOfOrder { .. })
        ));
        assert!(matches!(
            t.check(1, 0, 50, 59),
            Ok(SequenceCheck::Duplicate(_))
        ));
        t.truncate_to(80);
        assert_eq!(t.check(1, 0, 80, 89), Ok(SequenceCheck::Append));
        t.truncate_to(0);
        assert!(t.is_empty());
        assert_eq!(next_sequence(i32::MAX), 0);
    }

    #[test]
    fn snapshots_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = ProducerStateTable::default();
        t.record(3, 2, batch(0, 4, 10));
        save_snapshot(dir.path(), &t, 15).unwrap();
        assert_eq!(load_snapshot(dir.path()), Some((t, 15)));
        std::fs::write(dir.path().join(SNAPSHOT_FILE), b"garbage").unwrap();
        assert_eq!(load_snapshot(dir.path()), None);
    }
}
