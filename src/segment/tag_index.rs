//! The tag index of one segment (`NNNN.tagindex`): one entry per tagged record, so a
//! filtered fetch finds the records with a tag by reading hashes, never record values
//! (the role RocketMQ's consume queue plays for tag filtering).
//!
//! Each 12-byte entry:
//!
//! ```text
//! relative_offset  u32 big-endian   record offset - segment_base_offset
//! position         u32 big-endian   byte position of the record's batch in the .log
//! tag_hash         u32 big-endian   record::tag::tag_hash of the tag (never 0)
//! ```
//!
//! Entries follow the log: offsets strictly increase, positions never fall. Untagged
//! records have no entry, so an untagged topic pays nothing. Unlike the sparse indexes this
//! one is dense over tagged records, so it must be complete: it is written with every
//! append, rebuilt with the others by recovery, flushed with the log when the segment is
//! sealed, and checked against the log's tail on a clean load.

use std::io;
use std::path::Path;

use super::index_file::IndexFile;

/// Bytes per tag-index entry.
pub const TAG_ENTRY_SIZE: usize = 12;

/// A tagged record: its offset, its batch's position, its tag's hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagEntry {
    /// Absolute offset of the record.
    pub offset: u64,
    /// Byte position of the batch holding it.
    pub position: u32,
    /// Hash of its tag.
    pub hash: u32,
}

/// Tag hashes of one segment's tagged records.
#[derive(Debug)]
pub struct TagIndex {
    file: IndexFile,
    base_offset: u64,
}

impl TagIndex {
    /// Opens or creates the tag index of the segment starting at `base_offset`.
    pub fn open(path: &Path, base_offset: u64, max_bytes: usize, active: bool) -> io::Result<Self> {
        Ok(Self {
            file: IndexFile::open(path, TAG_ENTRY_SIZE, max_bytes, active)?,
            base_offset,
        })
    }

    /// Entry `slot`.
    pub fn entry(&self, slot: usize) -> TagEntry {
        let raw = self.file.entry(slot);
        let word = |at: usize| u32::from_be_bytes(raw[at..at + 4].try_into().expect("4 bytes"));
        TagEntry {
            offset: self.base_offset + u64::from(word(0)),
            position: word(4),
            hash: word(8),
        }
    }

    /// Number of entries.
    pub fn entries(&self) -> usize {
        self.file.entries()
    }

    /// Entries that still fit before the index is full.
    pub fn room(&self) -> usize {
        self.file.capacity() - self.file.entries()
    }

    /// Appends an entry; the caller made sure there is [`TagIndex::room`]. Fails (adding
    /// nothing) when the disk has no room for the entry's page.
    pub fn append(&mut self, entry: TagEntry) -> io::Result<()> {
        let relative =
            u32::try_from(entry.offset - self.base_offset).expect("relative offset fits u32");
        let mut raw = [0u8; TAG_ENTRY_SIZE];
        raw[0..4].copy_from_slice(&relative.to_be_bytes());
        raw[4..8].copy_from_slice(&entry.position.to_be_bytes());
        raw[8..12].copy_from_slice(&entry.hash.to_be_bytes());
        self.file.push(&raw)
    }

    /// The first slot whose offset is `>= offset` (`entries()` when none is).
    pub fn first_slot_at_or_after(&self, offset: u64) -> usize {
        match offset.checked_sub(1) {
            None => 0,
            Some(below) => self
                .file
                .last_slot_at_or_below(below, |raw| {
                    self.base_offset
                        + u64::from(u32::from_be_bytes(raw[0..4].try_into().expect("4 bytes")))
                })
                .map_or(0, |slot| slot + 1),
        }
    }

    /// Removes every entry whose offset is `>= offset`.
    pub fn truncate_to(&mut self, offset: u64) {
        let keep = self.first_slot_at_or_after(offset);
        self.file.truncate_entries(keep);
    }

    /// Checks that offsets strictly increase below `next_offset`, positions never fall and
    /// stay below `log_size`, and no hash is 0 (the preallocated zeros a crash may leave).
    pub fn sanity_check(&self, log_size: u64, next_offset: u64) -> Result<(), String> {
        let mut previous: Option<TagEntry> = None;
        for slot in 0..self.entries() {
            let e = self.entry(slot);
            if e.hash == 0 {
                return Err(format!("entry {slot} has hash 0"));
            }
            if e.offset >= next_offset || u64::from(e.position) >= log_size {
                return Err(format!(
                    "entry {slot} {e:?} is past the log end (offset {next_offset}, {log_size} bytes)"
                ));
            }
            if let Some(p) = previous {
                if e.offset <= p.offset || e.position < p.position {
                    return Err(format!("entry {slot} {e:?} does not follow {p:?}"));
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
        self.file.resize(max_bytes / TAG_ENTRY_SIZE)
    }

    /// Shrinks the file to its entries (and writes them to disk).
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
        fn lookups_and_truncation_agree_with_a_model(
            steps in proptest::collection::vec((1u64..20, 0u32..300, 1u32..5), 0..200),
            probes in proptest::collection::vec(0u64..4000, 1..40),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let mut index = TagIndex::open(&dir.path().join("t"), 100, 1 << 20, true).unwrap();
            let mut model = Vec::new();
            let (mut offset, mut position) = (100u64, 0u32);
            for (step, grow, hash) in steps {
                offset += step;
                position += grow;
                let e = TagEntry { offset, position, hash };
                index.append(e).unwrap();
                model.push(e);
            }
            prop_assert!(index.sanity_check(u64::from(position) + 1, offset + 1).is_ok());
            for probe in probes {
                let expected = model.iter().position(|e| e.offset >= probe).unwrap_or(model.len());
                prop_assert_eq!(index.first_slot_at_or_after(probe), expected);
            }
            let cut = model.get(model.len() / 2).map_or(0, |e| e.offset);
            index.truncate_to(cut);
            model.retain(|e| e.offset < cut);
            prop_assert_eq!(index.entries(), model.len());
            for (slot, e) in model.iter().enumerate() {
                prop_assert_eq!(index.entry(slot), *e);
            }
        }
    }

    #[test]
    fn preallocated_zeros_fail_the_check() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        {
            let mut index = TagIndex::open(&path, 0, 4096, true).unwrap();
            index
                .append(TagEntry {
                    offset: 3,
                    position: 0,
                    hash: 7,
                })
                .unwrap();
        }
        // Reopened untrimmed, as after a crash: the zeros count as entries until checked.
        let index = TagIndex::open(&path, 0, 4096, true).unwrap();
        assert!(index.entries() > 1);
        assert!(index.sanity_check(100, 10).unwrap_err().contains("hash 0"));
    }
}
