//! The sparse offset index of one segment (`NNNN.index`).
//!
//! Each 8-byte entry maps a batch's base offset to its byte position in the `.log` file:
//!
//! ```text
//! relative_offset  u32 big-endian   base_offset_of_batch - segment_base_offset
//! position         u32 big-endian   byte position of that batch in the .log file
//! ```
//!
//! An entry is added for the first batch written after `index.interval.bytes` bytes
//! without one, so entries are sparse and both columns strictly increase. A lookup finds
//! the last entry at or below the target; the reader scans forward from its position.
//! The index is a hint that is rebuilt, never trusted, after an unclean shutdown.

use std::io;
use std::path::Path;

use super::index_file::IndexFile;

/// Bytes per offset-index entry.
pub const OFFSET_ENTRY_SIZE: usize = 8;

/// A position hint: the batch at `position` starts at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffsetPosition {
    /// Absolute offset of the batch's first record.
    pub offset: u64,
    /// Byte position of the batch in the log file.
    pub position: u32,
}

/// Sparse offset -> file position index of one segment.
#[derive(Debug)]
pub struct OffsetIndex {
    file: IndexFile,
    base_offset: u64,
}

impl OffsetIndex {
    /// Opens or creates the index file of the segment starting at `base_offset`.
    pub fn open(path: &Path, base_offset: u64, max_bytes: usize, active: bool) -> io::Result<Self> {
        Ok(Self {
            file: IndexFile::open(path, OFFSET_ENTRY_SIZE, max_bytes, active)?,
            base_offset,
        })
    }

    fn decode(&self, raw: &[u8]) -> OffsetPosition {
        let relative = u32::from_be_bytes(raw[0..4].try_into().expect("4 bytes"));
        let position = u32::from_be_bytes(raw[4..8].try_into().expect("4 bytes"));
        OffsetPosition {
            offset: self.base_offset + u64::from(relative),
            position,
        }
    }

    /// Entry `slot`.
    pub fn entry(&self, slot: usize) -> OffsetPosition {
        self.decode(self.file.entry(slot))
    }

    /// Number of entries.
    pub fn entries(&self) -> usize {
        self.file.entries()
    }

    /// The last entry, if any.
    pub fn last_entry(&self) -> Option<OffsetPosition> {
        self.entries().checked_sub(1).map(|s| self.entry(s))
    }

    /// True when no entry fits anymore (the segment must roll).
    pub fn is_full(&self) -> bool {
        self.file.is_full()
    }

    /// Adds an entry. `offset` must exceed the last entry's and fit in 32 bits relative
    /// to the base; `position` must exceed the last entry's.
    pub fn append(&mut self, offset: u64, position: u32) -> std::io::Result<()> {
        if let Some(last) = self.last_entry() {
            assert!(
                offset > last.offset && position > last.position,
                "offset index entries must increase: ({offset}, {position}) after {last:?}"
            );
        }
        let relative = u32::try_from(offset - self.base_offset).expect("relative offset fits u32");
        let mut raw = [0u8; OFFSET_ENTRY_SIZE];
        raw[0..4].copy_from_slice(&relative.to_be_bytes());
        raw[4..8].copy_from_slice(&position.to_be_bytes());
        self.file.push(&raw)
    }

    /// The last entry whose offset is `<= offset`, or the segment start.
    pub fn lookup(&self, offset: u64) -> OffsetPosition {
        match self
            .file
            .last_slot_at_or_below(offset, |raw| self.decode(raw).offset)
        {
            Some(slot) => self.entry(slot),
            None => OffsetPosition {
                offset: self.base_offset,
                position: 0,
            },
        }
    }

    /// Removes every entry whose offset is `>= offset`.
    pub fn truncate_to(&mut self, offset: u64) {
        let keep = match self
            .file
            .last_slot_at_or_below(offset, |raw| self.decode(raw).offset)
        {
            Some(slot) if self.entry(slot).offset < offset => slot + 1,
            Some(slot) => slot,
            None => 0,
        };
        self.file.truncate_entries(keep);
    }

    /// Removes every entry whose position is `>= position`.
    pub fn truncate_to_position(&mut self, position: u32) {
        let keep = (0..self.entries())
            .take_while(|&s| self.entry(s).position < position)
            .count();
        self.file.truncate_entries(keep);
    }

    /// Checks that entries strictly increase and point inside a log of `log_size` bytes.
    /// Returns a description of the first problem.
    pub fn sanity_check(&self, log_size: u64) -> Result<(), String> {
        let mut previous: Option<OffsetPosition> = None;
        for slot in 0..self.entries() {
            let e = self.entry(slot);
            if u64::from(e.position) >= log_size.max(1) {
                return Err(format!(
                    "entry {slot} points to position {} past the log end {log_size}",
                    e.position
                ));
            }
            if let Some(p) = previous {
                if e.offset <= p.offset || e.position <= p.position {
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

    /// Resizes the preallocated capacity to `max_bytes` (making the index active again).
    pub fn resize(&mut self, max_bytes: usize) -> io::Result<()> {
        self.file.resize(max_bytes / OFFSET_ENTRY_SIZE)
    }

    /// Shrinks the file to its entries (on seal and close).
    pub fn trim(&mut self) -> io::Result<()> {
        self.file.trim()
    }

    /// Writes dirty pages to disk.
    pub fn flush(&self) -> io::Result<()> {
        self.file.flush()
    }

    /// The underlying file.
    pub fn file(&self) -> &IndexFile {
        &self.file
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
        fn lookup_agrees_with_a_linear_scan(
            gaps in proptest::collection::vec((1u64..1000, 1u32..5000), 0..300),
            probes in proptest::collection::vec(0u64..400_000, 1..50),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let base = 1_000u64;
            let mut index = OffsetIndex::open(&dir.path().join("i"), base, 1 << 20, true).unwrap();
            let mut model = Vec::new();
            let (mut off, mut pos) = (base, 0u32);
            for (g, p) in gaps {
                off += g;
                pos += p;
                index.append(off, pos).unwrap();
                model.push(OffsetPosition { offset: off, position: pos });
            }
            for probe in probes {
                let target = base + probe;
                let expected = model
                    .iter()
                    .rev()
                    .find(|e| e.offset <= target)
                    .copied()
                    .unwrap_or(OffsetPosition { offset: base, position: 0 });
                prop_assert_eq!(index.lookup(target), expected);
            }
            // Reopening the trimmed file sees the same entries.
            index.trim().unwrap();
            drop(index);
            let reopened = OffsetIndex::open(&dir.path().join("i"), base, 1 << 20, false).unwrap();
            prop_assert_eq!(reopened.entries(), model.len());
            prop_assert!(reopened.sanity_check(u64::MAX).is_ok());
        }
    }

    #[test]
    fn truncate_removes_entries_at_and_above() {
        let dir = tempfile::tempdir().unwrap();
        let mut index = OffsetIndex::open(&dir.path().join("i"), 0, 1024, true).unwrap();
        for i in 1..=10u64 {
            index.append(i * 10, i as u32 * 100).unwrap();
        }
        index.truncate_to(50);
        assert_eq!(index.entries(), 4);
        assert_eq!(index.last_entry().unwrap().offset, 40);
        index.truncate_to(41);
        assert_eq!(index.entries(), 4);
        index.truncate_to_position(300);
        assert_eq!(index.entries(), 2);
    }

    #[test]
    fn untrimmed_preallocated_file_fails_the_sanity_check() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("i");
        {
            let mut index = OffsetIndex::open(&path, 0, 1024, true).unwrap();
            index.append(5, 100).unwrap();
            index.append(9, 200).unwrap();
            // dropped without trim: a crash leaves the preallocated zeros
        }
        let index = OffsetIndex::open(&path, 0, 1024, false).unwrap();
        assert_eq!(index.entries(), 128);
        assert!(index.sanity_check(10_000).is_err());
    }

    #[test]
    fn full_index_reports_full() {
        let dir = tempfile::tempdir().unwrap();
        let mut index = OffsetIndex::open(&dir.path().join("i"), 0, 16, true).unwrap();
        index.append(1, 1).unwrap();
        assert!(!index.is_full());
        index.append(2, 2).unwrap();
        assert!(index.is_full());
    }
}
