//! The sparse time index of one segment (`NNNN.timeindex`).
//!
//! Each 12-byte entry records the largest timestamp seen so far in the segment and the
//! offset of the record that carries it:
//!
//! ```text
//! timestamp        i64 big-endian   max timestamp so far (ms)
//! relative_offset  u32 big-endian   offset of that record - segment_base_offset
//! ```
//!
//! An entry is added with each offset-index entry when the maximum grew, and once more
//! when the segment is sealed, so timestamps strictly increase and offsets never fall.
//! Every record at or before an entry's offset has a timestamp at or below the entry's.

use std::io;
use std::path::Path;

use super::index_file::IndexFile;

/// Bytes per time-index entry.
pub const TIME_ENTRY_SIZE: usize = 12;

/// A time index entry: the max timestamp up to `offset` is `timestamp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimestampOffset {
    /// Max timestamp in milliseconds.
    pub timestamp: i64,
    /// Absolute offset of the record with that timestamp.
    pub offset: u64,
}

/// Sparse timestamp -> offset index of one segment.
#[derive(Debug)]
pub struct TimeIndex {
    file: IndexFile,
    base_offset: u64,
}

impl TimeIndex {
    /// Opens or creates the time index of the segment starting at `base_offset`.
    pub fn open(path: &Path, base_offset: u64, max_bytes: usize, active: bool) -> io::Result<Self> {
        Ok(Self {
            file: IndexFile::open(path, TIME_ENTRY_SIZE, max_bytes, active)?,
            base_offset,
        })
    }

    fn decode(&self, raw: &[u8]) -> TimestampOffset {
        let timestamp = i64::from_be_bytes(raw[0..8].try_into().expect("8 bytes"));
        let relative = u32::from_be_bytes(raw[8..12].try_into().expect("4 bytes"));
        TimestampOffset {
            timestamp,
            offset: self.base_offset + u64::from(relative),
        }
    }

    /// Entry `slot`.
    pub fn entry(&self, slot: usize) -> TimestampOffset {
        self.decode(self.file.entry(slot))
    }

    /// Number of entries.
    pub fn entries(&self) -> usize {
        self.file.entries()
    }

    /// The last entry, if any.
    pub fn last_entry(&self) -> Option<TimestampOffset> {
        self.entries().checked_sub(1).map(|s| self.entry(s))
    }

    /// True when no entry fits anymore.
    pub fn is_full(&self) -> bool {
        self.file.is_full()
    }

    /// Adds an entry if `timestamp` exceeds the last entry's; returns whether it did.
    pub fn maybe_append(&mut self, timestamp: i64, offset: u64) -> std::io::Result<bool> {
        if let Some(last) = self.last_entry() {
            if timestamp <= last.timestamp {
                return Ok(false);
            }
            debug_assert!(offset >= last.offset);
        }
        if self.file.is_full() {
            return Ok(false);
        }
        let relative = u32::try_from(offset - self.base_offset).expect("relative offset fits u32");
        let mut raw = [0u8; TIME_ENTRY_SIZE];
        raw[0..8].copy_from_slice(&timestamp.to_be_bytes());
        raw[8..12].copy_from_slice(&relative.to_be_bytes());
        self.file.push(&raw)?;
        Ok(true)
    }

    /// The last entry whose timestamp is strictly below `timestamp`: every record up to
    /// its offset is older than `timestamp`, so a search can start there.
    pub fn last_entry_before(&self, timestamp: i64) -> Option<TimestampOffset> {
        let target = timestamp.checked_sub(1)?;
        self.file
            .last_slot_at_or_below(target, |raw| self.decode(raw).timestamp)
            .map(|slot| self.entry(slot))
    }

    /// Removes every entry whose offset is `>= offset`.
    pub fn truncate_to(&mut self, offset: u64) {
        let keep = (0..self.entries())
            .take_while(|&s| self.entry(s).offset < offset)
            .count();
        self.file.truncate_entries(keep);
    }

    /// Checks that timestamps strictly increase, offsets never fall, and every offset is
    /// below `next_offset`.
    pub fn sanity_check(&self, next_offset: u64) -> Result<(), String> {
        let mut previous: Option<TimestampOffset> = None;
        for slot in 0..self.entries() {
            let e = self.entry(slot);
            if e.offset >= next_offset.max(self.base_offset + 1) {
                return Err(format!(
                    "entry {slot} offset {} is past the log end {next_offset}",
                    e.offset
                ));
            }
            if let Some(p) = previous {
                if e.timestamp <= p.timestamp || e.offset < p.offset {
                    return Err(format!("entry {slot} {e:?} does not increase after {p:?}"));
                }
            }
            previous = Some(e);
        }
        Ok(())
    }

    /// Drops every entry.
    pub fn reset(&mut self) {
        self.file.truncate_entries(0);
    }

    /// Resizes the preallocated capacity to `max_bytes`.
    pub fn resize(&mut self, max_bytes: usize) -> io::Result<()> {
        self.file.resize(max_bytes / TIME_ENTRY_SIZE)
    }

    /// Shrinks the file to its entries.
    pub fn trim(&mut self) -> io::Result<()> {
        self.file.trim()
    }

    /// Writes dirty pages to disk.
    pub fn flush(&self) -> io::Result<()> {
        self.file.flush()
    }

    /// The underlying file, mutably (rename, delete).
    pub fn file_mut(&mut self) -> &mut IndexFile {
        &mut self.file
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn last_entry_before_agrees_with_a_linear_scan(
            steps in proptest::collection::vec((0i64..50, 0u64..20), 0..200),
            probes in proptest::collection::vec(-10i64..6000, 1..40),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let mut index = TimeIndex::open(&dir.path().join("t"), 100, 1 << 20, true).unwrap();
            let mut model: Vec<TimestampOffset> = Vec::new();
            let (mut ts, mut off) = (0i64, 100u64);
            for (dt, doff) in steps {
                ts += dt;
                off += doff;
                if index.maybe_append(ts, off).unwrap() {
                    model.push(TimestampOffset { timestamp: ts, offset: off });
                }
            }
            for w in model.windows(2) {
                prop_assert!(w[0].timestamp < w[1].timestamp);
            }
            for probe in probes {
                let expected = model.iter().rev().find(|e| e.timestamp < probe).copied();
                prop_assert_eq!(index.last_entry_before(probe), expected);
            }
        }
    }
}
