//! The leader-epoch cache: for each leader epoch, the first offset written in it.
//!
//! Persisted in `leader-epoch-checkpoint` (see [`super::checkpoint`]), one entry per line:
//! `<epoch> <start_offset>`. Both columns strictly increase. Replication uses
//! [`LeaderEpochCache::end_offset_for`] to find where a follower's log diverges from the
//! leader's (Kafka's KIP-101 / KIP-279).

use std::io;
use std::path::{Path, PathBuf};

use crate::types::{LeaderEpoch, Offset};

use super::checkpoint;

/// File name of the cache inside a partition directory.
pub const FILE_NAME: &str = "leader-epoch-checkpoint";

/// One epoch and the offset its leader started writing at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochEntry {
    /// The leader epoch.
    pub epoch: LeaderEpoch,
    /// First offset written under it.
    pub start_offset: Offset,
}

/// Epoch -> start offset, in memory and on disk.
#[derive(Debug)]
pub struct LeaderEpochCache {
    path: PathBuf,
    entries: Vec<EpochEntry>,
}

impl LeaderEpochCache {
    /// Loads the cache from `dir`; a missing file is an empty cache.
    pub fn load(dir: &Path) -> io::Result<Self> {
        let path = dir.join(FILE_NAME);
        let mut entries = Vec::new();
        if let Some(lines) = checkpoint::read(&path)? {
            for line in lines {
                let mut parts = line.split_whitespace();
                let parsed = (|| {
                    let epoch: i32 = parts.next()?.parse().ok()?;
                    let start: u64 = parts.next()?.parse().ok()?;
                    parts.next().is_none().then_some((epoch, start))
                })();
                let (epoch, start) = parsed.ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("{}: bad line {line:?}", path.display()),
                    )
                })?;
                let entry = EpochEntry {
                    epoch: LeaderEpoch(epoch),
                    start_offset: Offset(start),
                };
                if let Some(last) = entries.last() {
                    let last: &EpochEntry = last;
                    if entry.epoch <= last.epoch || entry.start_offset < last.start_offset {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("{}: entries do not increase at {line:?}", path.display()),
                        ));
                    }
                }
                entries.push(entry);
            }
        }
        Ok(Self { path, entries })
    }

    /// An empty cache that will be stored in `dir`.
    pub fn empty(dir: &Path) -> Self {
        Self {
            path: dir.join(FILE_NAME),
            entries: Vec::new(),
        }
    }

    /// All entries, oldest first.
    pub fn entries(&self) -> &[EpochEntry] {
        &self.entries
    }

    /// The newest epoch, if any.
    pub fn latest_epoch(&self) -> Option<LeaderEpoch> {
        self.entries.last().map(|e| e.epoch)
    }

    /// Records that `epoch` starts at `start_offset`. Epochs not newer than the latest are
    /// ignored. Returns true when the cache changed (the caller persists it).
    pub fn assign(&mut self, epoch: LeaderEpoch, start_offset: Offset) -> bool {
        if epoch.0 < 0 || self.latest_epoch().is_some_and(|latest| epoch <= latest) {
            return false;
        }
        // An entry starting at or after the new one belongs to a log suffix that is gone.
        self.entries.retain(|e| e.start_offset < start_offset);
        self.entries.push(EpochEntry {
            epoch,
            start_offset,
        });
        true
    }

    /// Kafka's `endOffsetFor`: the largest epoch `<= requested` this log knows, and the
    /// offset where it ended (the next epoch's start, or `log_end` for the latest). `None`
    /// when `requested` is undefined or newer than every known epoch.
    pub fn end_offset_for(
        &self,
        requested: LeaderEpoch,
        log_end: Offset,
    ) -> Option<(LeaderEpoch, Offset)> {
        if requested.0 < 0 {
            return None;
        }
        if self.latest_epoch() == Some(requested) {
            return Some((requested, log_end));
        }
        let higher = self.entries.iter().find(|e| e.epoch > requested)?;
        let floor = self.entries.iter().rev().find(|e| e.epoch <= requested);
        Some((floor.map_or(requested, |f| f.epoch), higher.start_offset))
    }

    /// Drops epochs that start at or after `end` (the log was truncated to `end`).
    /// Returns true when the cache changed.
    pub fn truncate_from_end(&mut self, end: Offset) -> bool {
        let before = self.entries.len();
        self.entries.retain(|e| e.start_offset < end);
        self.entries.len() != before
    }

    /// Drops epochs wholly before `start` (the log start moved); the epoch that spans
    /// `start` now starts there. Returns true when the cache changed.
    pub fn truncate_from_start(&mut self, start: Offset) -> bool {
        let spanning = self.entries.iter().rposition(|e| e.start_offset <= start);
        match spanning {
            Some(i) if i > 0 || self.entries[0].start_offset < start => {
                self.entries.drain(..i);
                self.entries[0].start_offset = start;
                true
            }
            _ => false,
        }
    }

    /// Forgets every epoch.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Writes the cache to its checkpoint file, atomically and durably.
    pub fn persist(&self) -> io::Result<()> {
        let lines: Vec<String> = self
            .entries
            .iter()
            .map(|e| format!("{} {}", e.epoch.0, e.start_offset.0))
            .collect();
        checkpoint::write(&self.path, &lines)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cache(entries: &[(i32, u64)]) -> LeaderEpochCache {
        let mut c = LeaderEpochCache::empty(Path::new("/nonexistent"));
        for &(e, o) in entries {
            assert!(c.assign(LeaderEpoch(e), Offset(o)));
        }
        c
    }

    #[test]
    fn end_offset_follows_kafka_semantics() {
        let c = cache(&[(1, 0), (3, 10), (4, 25)]);
        let end = |e| c.end_offset_for(LeaderEpoch(e), Offset(40));
        assert_eq!(end(4), Some((LeaderEpoch(4), Offset(40))));
        assert_eq!(end(3), Some((LeaderEpoch(3), Offset(25))));
        // An epoch this log never saw maps to the largest epoch below it.
        assert_eq!(end(2), Some((LeaderEpoch(1), Offset(10))));
        assert_eq!(end(0), Some((LeaderEpoch(0), Offset(0))));
        assert_eq!(end(5), None);
        assert_eq!(end(-1), None);
    }

    #[test]
    fn truncation_from_both_ends() {
        let mut c = cache(&[(1, 0), (3, 10), (4, 25)]);
        assert!(c.truncate_from_end(Offset(25)));
        assert_eq!(c.latest_epoch(), Some(LeaderEpoch(3)));
        assert!(c.truncate_from_start(Offset(12)));
        assert_eq!(
            c.entries(),
            &[EpochEntry {
                epoch: LeaderEpoch(3),
                start_offset: Offset(12)
            }]
        );
        assert!(!c.truncate_from_start(Offset(12)));
    }

    #[test]
    fn persists_and_reloads() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = LeaderEpochCache::load(dir.path()).unwrap();
        c.assign(LeaderEpoch(2), Offset(0));
        c.assign(LeaderEpoch(5), Offset(7));
        c.persist().unwrap();
        let again = LeaderEpochCache::load(dir.path()).unwrap();
        assert_eq!(again.entries(), c.entries());
    }

    proptest! {
        /// Against a model that keeps every (epoch, offset) pair and answers by brute force.
        #[test]
        fn end_offset_matches_a_brute_force_model(
            steps in proptest::collection::vec((1i32..4, 0u64..20), 1..20),
            probe in 0i32..80,
        ) {
            let mut c = LeaderEpochCache::empty(Path::new("/x"));
            let (mut epoch, mut offset) = (0i32, 0u64);
            let mut model = Vec::new();
            for (de, doff) in steps {
                epoch += de;
                offset += doff;
                c.assign(LeaderEpoch(epoch), Offset(offset));
                model.retain(|&(_, o)| o < offset);
                model.push((epoch, offset));
            }
            let log_end = Offset(offset + 5);
            let expected = if model.last().map(|m| m.0) == Some(probe) {
                Some((LeaderEpoch(probe), log_end))
            } else {
                model.iter().find(|m| m.0 > probe).map(|higher| {
                    let floor = model.iter().rev().find(|m| m.0 <= probe).map_or(probe, |m| m.0);
                    (LeaderEpoch(floor), Offset(higher.1))
                })
            };
            prop_assert_eq!(c.end_offset_for(LeaderEpoch(probe), log_end), expected);
        }
    }
}
