//! A memory-mapped file of fixed-size entries: the storage under both segment indexes.
//!
//! The file is preallocated to its capacity while the segment is active, so appends are
//! stores into the mapping, and trimmed to exactly `entries * entry_size` bytes when the
//! segment is sealed or closed. After a crash a file may still carry its preallocated
//! zeros; the typed indexes on top detect that in their sanity checks and the segment
//! rebuilds them from the log.
//!
//! No descriptor stays open: the file is opened to size and map it, then closed (a
//! mapping outlives its descriptor), so an index costs a mapping, not a file handle.
//! A partition with thousands of siblings keeps one descriptor (its active `.log`).

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use memmap2::{MmapMut, MmapOptions};

/// The unit in which [`IndexFile::truncate_entries`] skips ranges that are already zero
/// (a page on common systems; reading a hole allocates nothing).
const ZERO_CHECK_BYTES: usize = 4096;

/// Fixed-size entries in a memory-mapped file.
#[derive(Debug)]
pub struct IndexFile {
    path: PathBuf,
    mmap: Option<MmapMut>,
    entry_size: usize,
    entries: usize,
    capacity: usize,
    /// Bytes from the start known to be allocated on disk: pages of the sparse
    /// preallocation are allocated (fallocate) before the first store into them, so a full
    /// disk fails a push with ENOSPC instead of faulting the process with SIGBUS.
    allocated: usize,
}

impl IndexFile {
    /// Opens or creates `path`. Every whole entry in an existing file counts as an entry
    /// (the caller validates them). The mapping is resized to `max_bytes` (rounded down to
    /// whole entries) when `active`, else kept at the file's size.
    pub fn open(
        path: &Path,
        entry_size: usize,
        max_bytes: usize,
        active: bool,
    ) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let len = file.metadata()?.len() as usize;
        let entries = len / entry_size;
        let mut index = Self {
            path: path.to_path_buf(),
            mmap: None,
            entry_size,
            entries,
            capacity: entries,
            allocated: 0,
        };
        let capacity = if active {
            (max_bytes / entry_size).max(entries)
        } else {
            entries
        };
        index.remap_with(&file, capacity)?;
        Ok(index)
    }

    /// Path of the file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of entries written.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Entries the mapping has room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// True when no entry fits anymore.
    pub fn is_full(&self) -> bool {
        self.entries >= self.capacity
    }

    /// Entry size in bytes.
    pub fn entry_size(&self) -> usize {
        self.entry_size
    }

    /// Bytes of entry `slot`.
    pub fn entry(&self, slot: usize) -> &[u8] {
        debug_assert!(slot < self.entries);
        let at = slot * self.entry_size;
        &self.mmap.as_ref().expect("mapped when entries > 0")[at..at + self.entry_size]
    }

    /// Appends one entry. The caller checks [`IndexFile::is_full`] first. Fails (writing
    /// nothing) when the disk has no room for the entry's page.
    pub fn push(&mut self, entry: &[u8]) -> io::Result<()> {
        assert_eq!(entry.len(), self.entry_size);
        assert!(!self.is_full(), "index {} is full", self.path.display());
        let at = self.entries * self.entry_size;
        self.allocate(at + self.entry_size)?;
        self.mmap.as_mut().expect("mapped when capacity > 0")[at..at + self.entry_size]
            .copy_from_slice(entry);
        self.entries += 1;
        Ok(())
    }

    /// Makes sure the bytes up to `end` are allocated on disk, a page at a time.
    fn allocate(&mut self, end: usize) -> io::Result<()> {
        if end <= self.allocated {
            return Ok(());
        }
        let from = end.saturating_sub(1) / ZERO_CHECK_BYTES * ZERO_CHECK_BYTES;
        let to = (from + ZERO_CHECK_BYTES).min(self.capacity * self.entry_size);
        // Opened for the call only (indexes keep no descriptor): once per page, that is
        // once per 512 offset-index entries.
        let file = OpenOptions::new().write(true).open(&self.path)?;
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fallocate(3) on a descriptor owned by `file`, alive for the call.
        let rc = unsafe {
            libc::posix_fallocate(
                file.as_raw_fd(),
                from as libc::off_t,
                (to - from) as libc::off_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        self.allocated = to;
        Ok(())
    }

    /// Forgets every entry from `slot` on (their bytes are zeroed).
    ///
    /// Only pages holding a non-zero byte are written: after a crash the "entries" past
    /// the real ones are the preallocated zeros of a sparse file, and writing zeros over
    /// them would allocate the whole preallocation on disk (10 MiB per index, for every
    /// partition recovered) and, on a full disk, fault the process with SIGBUS.
    pub fn truncate_entries(&mut self, slot: usize) {
        if slot >= self.entries {
            return;
        }
        let from = slot * self.entry_size;
        let to = self.entries * self.entry_size;
        if let Some(map) = self.mmap.as_mut() {
            for chunk in map[from..to].chunks_mut(ZERO_CHECK_BYTES) {
                if chunk.iter().any(|b| *b != 0) {
                    chunk.fill(0);
                }
            }
        }
        self.entries = slot;
    }

    /// Changes the capacity (entries) and the file length to match.
    pub fn resize(&mut self, capacity: usize) -> io::Result<()> {
        self.remap(capacity.max(self.entries))
    }

    /// Shrinks the file to exactly the entries written.
    pub fn trim(&mut self) -> io::Result<()> {
        self.remap(self.entries)
    }

    /// Writes the mapping's dirty pages to disk.
    pub fn flush(&self) -> io::Result<()> {
        match &self.mmap {
            Some(map) => map.flush(),
            None => Ok(()),
        }
    }

    fn remap(&mut self, capacity: usize) -> io::Result<()> {
        let file = OpenOptions::new().read(true).write(true).open(&self.path)?;
        self.remap_with(&file, capacity)
    }

    fn remap_with(&mut self, file: &File, capacity: usize) -> io::Result<()> {
        if let Some(map) = self.mmap.take() {
            map.flush()?;
        }
        let len = capacity * self.entry_size;
        if file.metadata()?.len() != len as u64 {
            file.set_len(len as u64)?;
        }
        self.capacity = capacity;
        self.allocated = self.allocated.min(len);
        if len > 0 {
            // SAFETY: the file is owned by this partition (directory lock) and only this
            // struct changes its length, so the mapping never outlives the bytes under it.
            self.mmap = Some(unsafe { MmapOptions::new().len(len).map_mut(file)? });
        }
        Ok(())
    }

    /// Binary search: the last slot whose key (`key(slot)`) is `<= target`, if any.
    ///
    /// Keys must be non-decreasing over slots.
    pub fn last_slot_at_or_below<K: Ord>(
        &self,
        target: K,
        key: impl Fn(&[u8]) -> K,
    ) -> Option<usize> {
        let (mut lo, mut hi) = (0usize, self.entries);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if key(self.entry(mid)) <= target {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo.checked_sub(1)
    }

    /// Removes the file from disk (the mapping stays valid until drop).
    pub fn delete(&self) -> io::Result<()> {
        remove_if_exists(&self.path)
    }

    /// Renames the file, e.g. to add the `.deleted` suffix.
    pub fn rename(&mut self, to: &Path) -> io::Result<()> {
        std::fs::rename(&self.path, to)?;
        self.path = to.to_path_buf();
        Ok(())
    }
}

/// Deletes `path`, treating "already gone" as success.
pub fn remove_if_exists(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Bytes the file really occupies on disk.
    fn allocated(path: &Path) -> u64 {
        std::fs::metadata(path).unwrap().blocks() * 512
    }

    #[test]
    fn truncating_the_zeros_a_crash_left_allocates_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("00000000000000000000.index");
        let max_bytes = 8 << 20;
        {
            // An active index with two entries, then a crash: the file keeps its
            // preallocated (sparse) length.
            let mut index = IndexFile::open(&path, 8, max_bytes, true).unwrap();
            index.push(&[1; 8]).unwrap();
            index.push(&[2; 8]).unwrap();
            index.flush().unwrap();
        }
        let before = allocated(&path);
        assert!(before < 1 << 20, "preallocation is sparse: {before} bytes");
        let mut index = IndexFile::open(&path, 8, max_bytes, true).unwrap();
        assert_eq!(
            index.entries(),
            max_bytes / 8,
            "every slot counts until validated"
        );
        // The typed index finds the zeros after entry 2 and truncates there.
        index.truncate_entries(2);
        index.flush().unwrap();
        assert_eq!(index.entries(), 2);
        let after = allocated(&path);
        assert!(
            after < 1 << 20,
            "truncation wrote the whole preallocation: {after} bytes allocated"
        );
        // Real entries past the slot are still zeroed.
        index.push(&[3; 8]).unwrap();
        index.truncate_entries(2);
        drop(index);
        let index = IndexFile::open(&path, 8, max_bytes, false).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[16..24], &[0; 8]);
        drop(index);
    }
}
