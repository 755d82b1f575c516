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
//!
//! Transactions (Kafka's rules): a producer's first transactional batch opens its
//! transaction at that batch's offset; a marker (control batch, written only by the
//! coordinator) closes it. A marker's epoch may be newer than the producer's (the
//! coordinator fenced it): the entry takes the new epoch and the old one is fenced. The
//! first offset of the earliest open transaction bounds what read-committed consumers
//! see ([`ProducerStateTable::first_unstable_offset`]); an abort yields an
//! [`AbortedTxn`] for the partition's aborted-transaction index.

use std::collections::{BTreeSet, HashMap, VecDeque};
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
    /// First offset of its open transaction in this partition.
    #[serde(default)]
    pub txn_first_offset: Option<u64>,
    /// Its last finished transaction, so a truncation that cuts the marker off opens the
    /// transaction again (a marker above the high watermark can be truncated; only the
    /// last one, because the coordinator waits for each marker to commit).
    #[serde(default)]
    pub last_txn: Option<FinishedTxn>,
    /// Epoch of the coordinator that wrote its last marker (-1: none).
    #[serde(default = "no_coordinator_epoch")]
    pub coordinator_epoch: i32,
    /// Markers written for it here (a transactional write verified with the coordinator
    /// is refused if one came in while it was being verified).
    #[serde(default)]
    pub markers: u64,
}

fn no_coordinator_epoch() -> i32 {
    -1
}

/// A finished transaction of one producer in one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinishedTxn {
    /// Offset of its first record.
    pub first_offset: u64,
    /// Offset of its marker.
    pub marker_offset: u64,
    /// Committed (true) or aborted.
    pub committed: bool,
}

/// What [`ProducerStateTable::txn_guard`] took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnGuard {
    /// The producer.
    pub producer_id: i64,
    /// Markers written for it when the guard was taken.
    pub markers: u64,
}

/// An aborted transaction, as the aborted-transaction index keeps it (Kafka's
/// `.txnindex` entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbortedTxn {
    /// Its producer.
    pub producer_id: i64,
    /// Offset of its first record.
    pub first_offset: u64,
    /// Offset of its abort marker.
    pub last_offset: u64,
    /// The last stable offset right after the abort.
    pub last_stable_offset: u64,
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
    /// A batch or marker does not fit the producer's transaction state.
    #[error("producer {producer_id}: {reason}")]
    InvalidTxnState {
        /// The producer id.
        producer_id: i64,
        /// What does not fit.
        reason: String,
    },
    /// A marker comes from an older coordinator than the last marker did.
    #[error("producer {producer_id}: marker from coordinator epoch {got}, but coordinator epoch {current} wrote the last one")]
    CoordinatorFenced {
        /// The producer id.
        producer_id: i64,
        /// The last marker's coordinator epoch.
        current: i32,
        /// This marker's.
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
    /// Open transactions by first offset (derived from `producers`).
    #[serde(skip)]
    open: BTreeSet<(u64, i64)>,
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

    /// Checks that a new (not duplicate) batch fits the producer's transaction state: a
    /// producer with an open transaction writes only transactional batches in it.
    pub fn check_transactional(
        &self,
        producer_id: i64,
        epoch: i16,
        transactional: bool,
    ) -> Result<(), SequenceError> {
        let Some(entry) = self.producers.get(&producer_id) else {
            return Ok(());
        };
        match entry.txn_first_offset {
            Some(first) if !transactional => Err(SequenceError::InvalidTxnState {
                producer_id,
                reason: format!(
                    "a non-transactional batch while its transaction from offset {first} is open"
                ),
            }),
            Some(first) if epoch != entry.epoch => Err(SequenceError::InvalidTxnState {
                producer_id,
                reason: format!(
                    "a batch at epoch {epoch} while its transaction of epoch {} from offset {first} is open (the coordinator ends it first)",
                    entry.epoch
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Records an appended batch.
    pub fn record(&mut self, producer_id: i64, epoch: i16, batch: ProducerBatch) {
        let entry = self.entry(producer_id, epoch);
        if epoch != entry.epoch {
            entry.epoch = epoch;
            entry.batches.clear();
        }
        entry.batches.push_back(batch);
        while entry.batches.len() > RETAINED_BATCHES {
            entry.batches.pop_front();
        }
    }

    fn entry(&mut self, producer_id: i64, epoch: i16) -> &mut ProducerEntry {
        self.producers
            .entry(producer_id)
            .or_insert_with(|| ProducerEntry {
                epoch,
                batches: VecDeque::new(),
                txn_first_offset: None,
                last_txn: None,
                coordinator_epoch: -1,
                markers: 0,
            })
    }

    /// Records an appended transactional batch starting at `first_offset` (after
    /// [`ProducerStateTable::record`]): it opens the producer's transaction unless one is
    /// open.
    pub fn record_transactional(&mut self, producer_id: i64, first_offset: u64) {
        let Some(entry) = self.producers.get_mut(&producer_id) else {
            return;
        };
        if entry.txn_first_offset.is_none() {
            entry.txn_first_offset = Some(first_offset);
            self.open.insert((first_offset, producer_id));
        }
    }

    /// Checks a marker of `producer_id` at `epoch` from coordinator epoch
    /// `coordinator_epoch`: an older producer epoch or coordinator epoch is fenced.
    pub fn check_marker(
        &self,
        producer_id: i64,
        epoch: i16,
        coordinator_epoch: i32,
    ) -> Result<(), SequenceError> {
        let Some(entry) = self.producers.get(&producer_id) else {
            return Ok(());
        };
        if epoch < entry.epoch {
            return Err(SequenceError::FencedEpoch {
                producer_id,
                current: entry.epoch,
                got: epoch,
            });
        }
        if coordinator_epoch < entry.coordinator_epoch {
            return Err(SequenceError::CoordinatorFenced {
                producer_id,
                current: entry.coordinator_epoch,
                got: coordinator_epoch,
            });
        }
        Ok(())
    }

    /// Records a marker written at `offset`: it closes the producer's open transaction
    /// (an abort returns the index entry) and takes a newer epoch.
    pub fn record_marker(
        &mut self,
        producer_id: i64,
        epoch: i16,
        marker: crate::record::control::ControlMarker,
        offset: u64,
    ) -> Option<AbortedTxn> {
        let entry = self.entry(producer_id, epoch);
        if epoch > entry.epoch {
            entry.epoch = epoch;
            entry.batches.clear();
        }
        entry.coordinator_epoch = entry.coordinator_epoch.max(marker.coordinator_epoch);
        entry.markers += 1;
        let first = entry.txn_first_offset.take()?;
        entry.last_txn = Some(FinishedTxn {
            first_offset: first,
            marker_offset: offset,
            committed: marker.commit,
        });
        self.open.remove(&(first, producer_id));
        (!marker.commit).then(|| AbortedTxn {
            producer_id,
            first_offset: first,
            last_offset: offset,
            last_stable_offset: self
                .first_unstable_offset()
                .map_or(offset + 1, |o| o.min(offset + 1)),
        })
    }

    /// A guard for a transactional write of `producer_id` about to be verified with its
    /// coordinator: the markers written for it so far.
    pub fn txn_guard(&self, producer_id: i64) -> TxnGuard {
        TxnGuard {
            producer_id,
            markers: self.producers.get(&producer_id).map_or(0, |e| e.markers),
        }
    }

    /// Refuses a guarded write when a marker ended the producer's transaction since the
    /// guard was taken and no transaction of it is open now: the coordinator's answer is
    /// stale, and the write would open a transaction that nobody ends (KIP-890's
    /// verification guard).
    pub fn check_guard(&self, guard: &TxnGuard) -> Result<(), SequenceError> {
        let Some(entry) = self.producers.get(&guard.producer_id) else {
            return Ok(());
        };
        if entry.txn_first_offset.is_none() && entry.markers != guard.markers {
            return Err(SequenceError::InvalidTxnState {
                producer_id: guard.producer_id,
                reason: "its transaction ended while this write was being verified with the coordinator; nothing was written".into(),
            });
        }
        Ok(())
    }

    /// First offset of the earliest open transaction.
    pub fn first_unstable_offset(&self) -> Option<u64> {
        self.open.first().map(|(o, _)| *o)
    }

    /// Open transactions: (first offset, producer id), earliest first.
    pub fn open_transactions(&self) -> impl Iterator<Item = (u64, i64)> + '_ {
        self.open.iter().copied()
    }

    /// The entry of `producer_id`.
    pub fn get(&self, producer_id: i64) -> Option<&ProducerEntry> {
        self.producers.get(&producer_id)
    }

    /// Forgets batches at or above `offset` (the log was truncated there): transactions
    /// opened there are gone, and one whose marker was cut off is open again.
    pub fn truncate_to(&mut self, offset: u64) {
        for entry in self.producers.values_mut() {
            entry.batches.retain(|b| b.first_offset < offset);
            if entry.txn_first_offset.is_some_and(|f| f >= offset) {
                entry.txn_first_offset = None;
            }
            if let Some(t) = entry.last_txn.filter(|t| t.marker_offset >= offset) {
                entry.last_txn = None;
                if t.first_offset < offset {
                    entry.txn_first_offset = Some(t.first_offset);
                }
            }
        }
        self.producers.retain(|_, e| {
            !e.batches.is_empty()
                || e.txn_first_offset.is_some()
                || e.last_txn.is_some()
                || e.coordinator_epoch >= 0
        });
        self.reindex();
    }

    /// Rebuilds the open-transaction index from the entries.
    fn reindex(&mut self) {
        self.open = self
            .producers
            .iter()
            .filter_map(|(id, e)| e.txn_first_offset.map(|f| (f, *id)))
            .collect();
    }

    /// Forgets everything (the log restarted empty).
    pub fn clear(&mut self) {
        self.producers.clear();
        self.open.clear();
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
        Ok(mut s) => {
            s.table.reindex();
            Some((s.table, s.offset))
        }
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
