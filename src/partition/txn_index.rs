//! The aborted-transaction index: per segment, a `NNNN.txnindex` file of the transactions
//! aborted by markers in that segment (Kafka's format, 34 bytes per entry, big-endian):
//!
//! ```text
//! version              i16   0
//! producer_id          i64
//! first_offset         i64   the transaction's first record
//! last_offset          i64   its abort marker
//! last_stable_offset   i64   the partition's LSO right after the abort
//! ```
//!
//! A read-committed fetch returns the entries overlapping what it read, so the consumer
//! drops the aborted records. The entries are kept in memory too (aborts are rare: 34 bytes
//! each). The files are written with each abort marker and fsynced before the
//! producer-state snapshot that covers them is saved; recovery drops the entries at or
//! after the snapshot's offset and replay writes them again, so the files always match
//! the log.

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::producer_state::AbortedTxn;

/// File suffix.
pub const TXN_INDEX_SUFFIX: &str = "txnindex";
/// Bytes per entry.
pub const TXN_ENTRY_SIZE: usize = 34;

/// The index file of the segment at `base`.
pub fn txn_index_path(dir: &Path, base: u64) -> PathBuf {
    dir.join(format!("{base:020}.{TXN_INDEX_SUFFIX}"))
}

/// Encodes one entry.
pub fn encode_entry(e: &AbortedTxn) -> [u8; TXN_ENTRY_SIZE] {
    let mut out = [0u8; TXN_ENTRY_SIZE];
    out[2..10].copy_from_slice(&e.producer_id.to_be_bytes());
    out[10..18].copy_from_slice(&(e.first_offset as i64).to_be_bytes());
    out[18..26].copy_from_slice(&(e.last_offset as i64).to_be_bytes());
    out[26..34].copy_from_slice(&(e.last_stable_offset as i64).to_be_bytes());
    out
}

/// Decodes one entry; `None` when its version or offsets make no sense.
pub fn decode_entry(b: &[u8]) -> Option<AbortedTxn> {
    let b: &[u8; TXN_ENTRY_SIZE] = b.get(..TXN_ENTRY_SIZE)?.try_into().ok()?;
    let word = |at: usize| i64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let (first, last, lso) = (word(10), word(18), word(26));
    if i16::from_be_bytes([b[0], b[1]]) != 0 || first < 0 || last < first || lso < 0 {
        return None;
    }
    Some(AbortedTxn {
        producer_id: word(2),
        first_offset: first as u64,
        last_offset: last as u64,
        last_stable_offset: lso as u64,
    })
}

/// Every segment's aborted transactions.
#[derive(Debug, Default)]
pub struct AbortedIndex {
    /// By segment base offset; entries in marker order.
    segments: BTreeMap<u64, Vec<AbortedTxn>>,
    /// Segments whose file was written since the last sync.
    dirty: Vec<u64>,
}

impl AbortedIndex {
    /// Loads the files of the segments at `bases`; removes files of other segments (left
    /// by a crash during deletion). An unreadable entry ends its file's list: recovery
    /// rebuilds what the producer-state replay covers.
    pub fn load(dir: &Path, bases: &[u64]) -> io::Result<Self> {
        let mut segments = BTreeMap::new();
        for entry in fs::read_dir(dir)? {
            let path = entry?.path();
            let Some(base) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(&format!(".{TXN_INDEX_SUFFIX}")))
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            if bases.binary_search(&base).is_err() {
                fs::remove_file(&path)?;
                continue;
            }
            let bytes = fs::read(&path)?;
            let list: Vec<AbortedTxn> = bytes
                .chunks(TXN_ENTRY_SIZE)
                .map_while(decode_entry)
                .collect();
            if list.len() * TXN_ENTRY_SIZE != bytes.len() {
                // Cut the bad tail so later entries line up; replay rewrites what it covers.
                tracing::warn!(file = %path.display(), kept = list.len(), "aborted-transaction index has a bad tail; cutting it (replay writes the entries after the producer snapshot again)");
                let f = OpenOptions::new().write(true).open(&path)?;
                f.set_len((list.len() * TXN_ENTRY_SIZE) as u64)?;
                f.sync_all()?;
            }
            if !list.is_empty() {
                segments.insert(base, list);
            }
        }
        Ok(Self {
            segments,
            dirty: Vec::new(),
        })
    }

    /// Records an abort whose marker lies in the segment at `base`.
    pub fn append(&mut self, dir: &Path, base: u64, entry: AbortedTxn) -> io::Result<()> {
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(txn_index_path(dir, base))?;
        f.write_all(&encode_entry(&entry))?;
        self.segments.entry(base).or_default().push(entry);
        if !self.dirty.contains(&base) {
            self.dirty.push(base);
        }
        Ok(())
    }

    /// Fsyncs the files written since the last call.
    pub fn sync(&mut self, dir: &Path) -> io::Result<()> {
        for base in std::mem::take(&mut self.dirty) {
            match fs::File::open(txn_index_path(dir, base)) {
                Ok(f) => f.sync_all()?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Drops the entries whose marker is at or after `offset` (the log was truncated there,
    /// or replay writes them again), rewriting the files that change.
    pub fn truncate_from(&mut self, dir: &Path, offset: u64) -> io::Result<()> {
        let bases: Vec<u64> = self.segments.keys().copied().collect();
        for base in bases {
            let list = self.segments.get_mut(&base).expect("listed");
            let keep = list.iter().take_while(|e| e.last_offset < offset).count();
            if keep == list.len() {
                continue;
            }
            list.truncate(keep);
            let path = txn_index_path(dir, base);
            if keep == 0 {
                self.segments.remove(&base);
                crate::segment::remove_if_exists(&path)?;
            } else {
                let f = OpenOptions::new().write(true).open(&path)?;
                f.set_len((keep * TXN_ENTRY_SIZE) as u64)?;
                f.sync_all()?;
            }
        }
        Ok(())
    }

    /// Forgets the segments below `base` (deleted by retention), removing their files.
    pub fn drop_segments_below(&mut self, dir: &Path, base: u64) -> io::Result<()> {
        let below: Vec<u64> = self.segments.range(..base).map(|(b, _)| *b).collect();
        for b in below {
            self.segments.remove(&b);
            crate::segment::remove_if_exists(&txn_index_path(dir, b))?;
        }
        Ok(())
    }

    /// Forgets everything, removing the files.
    pub fn clear(&mut self, dir: &Path) -> io::Result<()> {
        self.drop_segments_below(dir, u64::MAX)?;
        self.dirty.clear();
        Ok(())
    }

    /// Aborted transactions overlapping `[from, to)`: marker at or after `from`, first
    /// record before `to`; ordered by marker.
    pub fn overlapping(&self, from: u64, to: u64) -> Vec<AbortedTxn> {
        let mut out = Vec::new();
        // An entry's marker lies in its segment, so segments ending before `from` hold
        // none; start at the segment holding `from`.
        let start = self
            .segments
            .range(..=from)
            .next_back()
            .map_or(0, |(b, _)| *b);
        for list in self.segments.range(start..).map(|(_, l)| l) {
            for e in list {
                if e.last_offset >= from && e.first_offset < to {
                    out.push(*e);
                }
            }
        }
        out
    }

    /// Every entry of the segment at `base` (for `dump-log`).
    pub fn entries_of(&self, base: u64) -> &[AbortedTxn] {
        self.segments.get(&base).map_or(&[], Vec::as_slice)
    }

    /// Entries in all.
    pub fn len(&self) -> usize {
        self.segments.values().map(Vec::len).sum()
    }

    /// True when no transaction was aborted.
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn abort(pid: i64, first: u64, last: u64) -> AbortedTxn {
        AbortedTxn {
            producer_id: pid,
            first_offset: first,
            last_offset: last,
            last_stable_offset: last + 1,
        }
    }

    proptest! {
        #[test]
        fn entries_round_trip(pid: i64, first in 0u64..1 << 62, len in 0u64..1 << 20, lso in 0u64..1 << 62) {
            let e = AbortedTxn { producer_id: pid, first_offset: first, last_offset: first + len, last_stable_offset: lso };
            prop_assert_eq!(decode_entry(&encode_entry(&e)), Some(e));
        }

        #[test]
        fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = decode_entry(&bytes);
        }
    }

    #[test]
    fn files_follow_appends_truncation_and_deletion() {
        let dir = tempfile::tempdir().unwrap();
        let mut idx = AbortedIndex::default();
        idx.append(dir.path(), 0, abort(1, 2, 10)).unwrap();
        idx.append(dir.path(), 0, abort(2, 5, 12)).unwrap();
        idx.append(dir.path(), 100, abort(1, 101, 120)).unwrap();
        idx.sync(dir.path()).unwrap();
        assert_eq!(
            idx.overlapping(11, 200),
            vec![abort(2, 5, 12), abort(1, 101, 120)]
        );
        assert_eq!(idx.overlapping(0, 5), vec![abort(1, 2, 10)]);
        assert!(idx.overlapping(13, 101).is_empty());
        // A stray file of a segment that no longer exists is removed at load.
        std::fs::write(
            txn_index_path(dir.path(), 50),
            encode_entry(&abort(9, 50, 51)),
        )
        .unwrap();
        let loaded = AbortedIndex::load(dir.path(), &[0, 100]).unwrap();
        assert_eq!(loaded.len(), 3);
        assert!(!txn_index_path(dir.path(), 50).exists());
        idx.truncate_from(dir.path(), 12).unwrap();
        assert_eq!(idx.len(), 1);
        assert!(!txn_index_path(dir.path(), 100).exists());
        let loaded = AbortedIndex::load(dir.path(), &[0, 100]).unwrap();
        assert_eq!(loaded.overlapping(0, u64::MAX), vec![abort(1, 2, 10)]);
        idx.drop_segments_below(dir.path(), 100).unwrap();
        assert!(idx.is_empty() && !txn_index_path(dir.path(), 0).exists());
    }

    #[test]
    fn a_torn_tail_keeps_the_whole_entries() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = encode_entry(&abort(1, 2, 10)).to_vec();
        bytes.extend_from_slice(&[0, 0, 1]);
        std::fs::write(txn_index_path(dir.path(), 0), bytes).unwrap();
        let idx = AbortedIndex::load(dir.path(), &[0]).unwrap();
        assert_eq!(idx.entries_of(0), &[abort(1, 2, 10)]);
    }
}
