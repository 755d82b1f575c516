//! One segment: a `.log` file with its `.index`, `.timeindex` and `.tagindex`, named by
//! base offset.
//!
//! Invariants, checked on append and re-established by recovery:
//! - batches are contiguous: the first starts at the base offset, each next one at the
//!   previous one's last offset + 1;
//! - every offset is below `base_offset + 2^32` and every position below 2^31, so both
//!   fit the indexes' 32-bit relative fields;
//! - index entries only point at batch starts and strictly increase;
//! - the tag index holds exactly the segment's tagged records.
//!
//! Segments know nothing of roll or retention policy; the partition decides those.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::record::tag::{collect_tag_marks, TagMark};
use crate::record::{
    BatchHeader, BatchIter, RecordBatch, HEADER_LEN, MAX_UNCOMPRESSED_BATCH_BYTES,
};

use super::log_file::{read_at_most_with, LogFile};
use super::offset_index::{OffsetIndex, OffsetPosition};
use super::scan::{read_header_at_with, verify_batches, BatchScanner, ScanError, SegmentDamage};
use super::tag_index::{TagEntry, TagIndex};
use super::time_index::TimeIndex;
use super::SegmentError;

/// Suffix of a segment's record file.
pub const LOG_SUFFIX: &str = "log";
/// Suffix of a segment's offset index.
pub const INDEX_SUFFIX: &str = "index";
/// Suffix of a segment's time index.
pub const TIME_INDEX_SUFFIX: &str = "timeindex";
/// Suffix of a segment's tag index.
pub const TAG_INDEX_SUFFIX: &str = "tagindex";
/// Suffixes of every index file a segment keeps beside its `.log`.
pub const INDEX_SUFFIXES: [&str; 3] = [INDEX_SUFFIX, TIME_INDEX_SUFFIX, TAG_INDEX_SUFFIX];
/// Suffix added to files scheduled for deletion.
pub const DELETED_SUFFIX: &str = "deleted";
/// Largest batch a scan accepts: anything bigger cannot have been written by us.
const MAX_SCAN_BATCH_BYTES: u64 = i32::MAX as u64;
/// Largest position the offset index can hold.
pub const MAX_SEGMENT_BYTES: u64 = i32::MAX as u64;

/// Path of a segment file: `<dir>/<base offset, 20 digits>.<suffix>`.
pub fn segment_file(dir: &Path, base_offset: u64, suffix: &str) -> PathBuf {
    dir.join(format!("{base_offset:020}.{suffix}"))
}

/// Settings a segment needs; the partition derives them from its topic config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentConfig {
    /// Bytes of batches between offset-index entries.
    pub index_interval_bytes: u64,
    /// Preallocated size of each index file; a full index forces a roll.
    pub index_max_bytes: usize,
}

/// Where a batch sits in the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLocation {
    /// Byte position of the batch in the `.log` file.
    pub position: u64,
    /// Its header.
    pub header: BatchHeader,
}

/// What recovery found in a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryOutcome {
    /// Valid batches found (before and after any damage).
    pub batches: u64,
    /// End of the valid prefix: the start of the first damage, or the file size.
    pub valid_prefix_end: u64,
    /// Damaged ranges, in file order (empty when the segment is intact).
    pub damage: Vec<SegmentDamage>,
}

/// One segment of a partition log.
#[derive(Debug)]
pub struct LogSegment {
    base_offset: u64,
    log: LogFile,
    offset_index: OffsetIndex,
    time_index: TimeIndex,
    tag_index: TagIndex,
    /// False when opening created the tag index (a segment written before tag indexes
    /// existed, or a deleted file): a load must rebuild it from the log.
    tag_index_existed: bool,
    config: SegmentConfig,
    bytes_since_index_entry: u64,
    next_offset: u64,
    max_timestamp: i64,
    offset_of_max_timestamp: u64,
    /// Max timestamp of the first batch: the basis for `segment.ms` rolls.
    first_batch_timestamp: Option<i64>,
}

impl LogSegment {
    /// Creates a new, empty, active segment starting at `base_offset`. Existing files with
    /// the same name are replaced.
    pub fn create(
        dir: &Path,
        base_offset: u64,
        config: SegmentConfig,
    ) -> Result<Self, SegmentError> {
        for suffix in std::iter::once(LOG_SUFFIX).chain(INDEX_SUFFIXES) {
            let path = segment_file(dir, base_offset, suffix);
            super::index_file::remove_if_exists(&path).map_err(|e| SegmentError::io(&path, e))?;
        }
        Self::open(dir, base_offset, config, true)
    }

    /// Opens a segment's files as they are. Call [`LogSegment::load`] (trusting a clean
    /// shutdown) or [`LogSegment::recover`] (after a crash) before using it.
    pub fn open(
        dir: &Path,
        base_offset: u64,
        config: SegmentConfig,
        active: bool,
    ) -> Result<Self, SegmentError> {
        let log_path = segment_file(dir, base_offset, LOG_SUFFIX);
        let index_path = segment_file(dir, base_offset, INDEX_SUFFIX);
        let time_path = segment_file(dir, base_offset, TIME_INDEX_SUFFIX);
        let log = LogFile::open(&log_path).map_err(|e| SegmentError::io(&log_path, e))?;
        let offset_index =
            OffsetIndex::open(&index_path, base_offset, config.index_max_bytes, active)
                .map_err(|e| SegmentError::io(&index_path, e))?;
        let time_index = TimeIndex::open(&time_path, base_offset, config.index_max_bytes, active)
            .map_err(|e| SegmentError::io(&time_path, e))?;
        let tag_path = segment_file(dir, base_offset, TAG_INDEX_SUFFIX);
        let tag_index_existed = tag_path.exists();
        let tag_index = TagIndex::open(&tag_path, base_offset, config.index_max_bytes, active)
            .map_err(|e| SegmentError::io(&tag_path, e))?;
        Ok(Self {
            base_offset,
            log,
            offset_index,
            time_index,
            tag_index,
            tag_index_existed,
            config,
            bytes_since_index_entry: 0,
            next_offset: base_offset,
            max_timestamp: -1,
            offset_of_max_timestamp: base_offset,
            first_batch_timestamp: None,
        })
    }

    /// Offset of the segment's first record (and its file name).
    pub fn base_offset(&self) -> u64 {
        self.base_offset
    }

    /// Offset after the segment's last record.
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    /// Bytes in the `.log` file.
    pub fn size(&self) -> u64 {
        self.log.size()
    }

    /// True when the segment holds no batch.
    pub fn is_empty(&self) -> bool {
        self.log.size() == 0
    }

    /// Largest record timestamp in the segment, -1 when empty.
    pub fn max_timestamp(&self) -> i64 {
        self.max_timestamp
    }

    /// Max timestamp of the first batch, the basis for time-based rolling.
    pub fn first_batch_timestamp(&self) -> Option<i64> {
        self.first_batch_timestamp
    }

    /// Path of the `.log` file.
    pub fn log_path(&self) -> &Path {
        self.log.path()
    }

    /// A shared handle to the `.log` file for reads outside the partition's lock
    /// (reopening the file if its descriptor was released).
    pub fn log_handle(&self) -> Result<Arc<File>, SegmentError> {
        self.log
            .handle()
            .map_err(|e| SegmentError::io(self.log.path(), e))
    }

    /// Releases the `.log` descriptor when it was not used since the previous call (a
    /// sealed segment nobody reads); the next use reopens it. Returns true when released.
    pub fn close_if_idle(&self) -> bool {
        self.log.close_if_idle()
    }

    /// Releases the `.log` descriptor now; the next use reopens it.
    pub fn release_file(&self) {
        self.log.release();
    }

    /// True while the `.log` descriptor is open.
    pub fn is_open(&self) -> bool {
        self.log.is_open()
    }

    /// True when an index has no room for another entry.
    pub fn indexes_full(&self) -> bool {
        self.offset_index.is_full() || self.time_index.is_full()
    }

    /// Tagged records the tag index still has room for: an append with more must go to a
    /// new segment.
    pub fn tag_room(&self) -> usize {
        self.tag_index.room()
    }

    /// The tag index entries from the first record at or after `offset`.
    pub fn tag_entries_from(&self, offset: u64) -> impl Iterator<Item = TagEntry> + '_ {
        let first = self.tag_index.first_slot_at_or_after(offset);
        (first..self.tag_index.entries()).map(|slot| self.tag_index.entry(slot))
    }

    /// True when a batch ending at `last_offset` still fits the 32-bit relative offsets.
    pub fn can_hold_offset(&self, last_offset: u64) -> bool {
        last_offset >= self.base_offset && last_offset - self.base_offset <= u64::from(u32::MAX)
    }

    /// Appends batches that the caller validated and numbered; `data` holds whole batches
    /// whose first starts at [`LogSegment::next_offset`], and `tags` every tagged record
    /// among them (in order; at most [`LogSegment::tag_room`]).
    pub fn append(&mut self, data: &[u8], tags: &[TagMark]) -> Result<(), SegmentError> {
        let start = self.log.size();
        if tags.len() > self.tag_index.room() {
            return Err(SegmentError::InvalidAppend(format!(
                "{} tagged records do not fit the tag index's room for {}",
                tags.len(),
                self.tag_index.room()
            )));
        }
        if start + data.len() as u64 > MAX_SEGMENT_BYTES {
            return Err(SegmentError::SegmentFull {
                path: self.log.path().to_path_buf(),
                size: start,
                append: data.len() as u64,
            });
        }
        let mut headers = Vec::new();
        let mut expected = self.next_offset;
        for batch in BatchIter::new(data) {
            let batch = batch.map_err(|e| SegmentError::InvalidAppend(e.to_string()))?;
            let h = *batch.header();
            if h.base_offset as u64 != expected || !self.can_hold_offset(h.last_offset() as u64) {
                return Err(SegmentError::InvalidAppend(format!(
                    "batch {}..={} does not follow offset {} in segment {}",
                    h.base_offset,
                    h.last_offset(),
                    expected,
                    self.base_offset
                )));
            }
            expected = h.next_offset() as u64;
            headers.push(h);
        }
        // Written before anything in memory changes: a failed write (a full disk) leaves
        // the segment as it was, its file cut back to the old end.
        if let Err(e) = self.log.append(data) {
            if let Err(cut) = self.log.truncate_to(start) {
                return Err(SegmentError::io(self.log.path(), cut));
            }
            return Err(SegmentError::io(self.log.path(), e));
        }
        let mut positions = Vec::with_capacity(headers.len());
        let mut position = start;
        for h in &headers {
            positions.push(position);
            position += h.total_size() as u64;
        }
        let tags_before = self.tag_index.entries();
        for mark in tags {
            let batch = mark.batch as usize;
            let (Some(h), Some(&position)) = (headers.get(batch), positions.get(batch)) else {
                return Err(SegmentError::InvalidAppend(format!(
                    "a tag names batch {batch} of {}",
                    headers.len()
                )));
            };
            let entry = TagEntry {
                offset: h.base_offset as u64 + u64::from(mark.offset_delta),
                position: position as u32,
                hash: mark.hash,
            };
            if let Err(e) = self.tag_index.append(entry) {
                // A full disk: undo the write so the log and its tag index still agree.
                self.tag_index.file_mut().truncate_entries(tags_before);
                if let Err(cut) = self.log.truncate_to(start) {
                    return Err(SegmentError::io(self.log.path(), cut));
                }
                return Err(SegmentError::io(self.tag_index.file().path(), e));
            }
        }
        for (h, &position) in headers.iter().zip(&positions) {
            self.track_batch(position, h);
        }
        Ok(())
    }

    /// Adds the tag-index entries of a stored batch at `position` (recovery, rebuilds),
    /// growing the index if a smaller `index_max_bytes` than the writer's left no room.
    fn index_tags_of(&mut self, position: u64, batch: &RecordBatch<'_>) -> io::Result<()> {
        let mut marks = Vec::new();
        if let Err(e) = collect_tag_marks(batch, 0, MAX_UNCOMPRESSED_BATCH_BYTES, &mut marks) {
            // CRC-valid but undecodable records cannot have been accepted by validation.
            tracing::warn!(path = %self.log.path().display(), position, error = %e, "records of a stored batch do not decode; its tags are not indexed");
            return Ok(());
        }
        let base = batch.header().base_offset as u64;
        for mark in marks {
            if self.tag_index.room() == 0 {
                let grown = (self.tag_index.entries() * 2).max(1024);
                self.tag_index
                    .resize(grown * super::tag_index::TAG_ENTRY_SIZE)?;
            }
            self.tag_index.append(TagEntry {
                offset: base + u64::from(mark.offset_delta),
                position: position as u32,
                hash: mark.hash,
            })?;
        }
        Ok(())
    }

    /// Updates indexes and in-memory state for a batch at `position`.
    fn track_batch(&mut self, position: u64, h: &BatchHeader) {
        let last_offset = h.last_offset() as u64;
        if h.max_timestamp > self.max_timestamp {
            self.max_timestamp = h.max_timestamp;
            self.offset_of_max_timestamp = last_offset;
        }
        if self.first_batch_timestamp.is_none() {
            self.first_batch_timestamp = Some(h.max_timestamp);
        }
        if self.bytes_since_index_entry > self.config.index_interval_bytes
            && !self.offset_index.is_full()
        {
            // Index entries are hints (a lookup scans on from the entry before): one the
            // disk has no room for is skipped, and the next batch tries again.
            let indexed = self
                .offset_index
                .append(h.base_offset as u64, position as u32)
                .and_then(|()| {
                    self.time_index
                        .maybe_append(self.max_timestamp, self.offset_of_max_timestamp)
                });
            if indexed.is_ok() {
                self.bytes_since_index_entry = 0;
            }
        }
        self.bytes_since_index_entry += h.total_size() as u64;
        self.next_offset = last_offset + 1;
    }

    /// Trusts the files after a clean shutdown: checks the indexes (rebuilding them if
    /// they fail) and reads the tail after the last index entry to find the segment's end.
    /// Returns true when the indexes had to be rebuilt.
    pub fn load(&mut self) -> Result<bool, SegmentError> {
        let size = self.log.size();
        let index_ok = self.offset_index.sanity_check(size).is_ok()
            && self.offset_index.last_entry().is_none_or(|e| {
                self.header_at(e.position as u64)
                    .ok()
                    .flatten()
                    .map(|h| h.base_offset as u64)
                    == Some(e.offset)
            });
        if !index_ok {
            return self.rebuild_indexes().map(|_| true);
        }
        let tail_tags = self.scan_tail()?;
        if self.time_index.sanity_check(self.next_offset).is_err() || !self.tag_index_ok(&tail_tags)
        {
            return self.rebuild_indexes().map(|_| true);
        }
        Ok(false)
    }

    /// Whether the tag index passes its checks and agrees with the log's tail (the batches
    /// [`LogSegment::scan_tail`] just read, whose tagged records are `tail_tags`).
    fn tag_index_ok(&self, tail_tags: &[TagEntry]) -> bool {
        if !self.tag_index_existed && self.log.size() > 0 {
            tracing::warn!(path = %self.log.path().display(), "segment has no tag index; rebuilding it");
            return false;
        }
        if let Err(why) = self
            .tag_index
            .sanity_check(self.log.size(), self.next_offset)
        {
            tracing::warn!(path = %self.log.path().display(), %why, "tag index failed its check");
            return false;
        }
        let tail_start = self
            .offset_index
            .last_entry()
            .map_or(self.base_offset, |e| e.offset);
        let indexed: Vec<TagEntry> = self.tag_entries_from(tail_start).collect();
        indexed == tail_tags
    }

    /// Rebuilds the indexes by scanning (and CRC-checking) the whole log; fails with
    /// [`SegmentError::Corrupt`] on the first damage (nothing is cut).
    fn rebuild_indexes(&mut self) -> Result<(), SegmentError> {
        let outcome = self.scan_and_index()?;
        if let Some(d) = outcome.damage.first() {
            return Err(SegmentError::Corrupt {
                path: self.log.path().to_path_buf(),
                reason: d.reason.clone(),
            });
        }
        Ok(())
    }

    /// Recomputes next offset, max timestamp and index spacing from the last index entry to
    /// the end of the log; returns the tagged records found there.
    fn scan_tail(&mut self) -> Result<Vec<TagEntry>, SegmentError> {
        let from = self.offset_index.last_entry().unwrap_or(OffsetPosition {
            offset: self.base_offset,
            position: 0,
        });
        if let Some(t) = self.time_index.last_entry() {
            self.max_timestamp = t.timestamp;
            self.offset_of_max_timestamp = t.offset;
        } else {
            self.max_timestamp = -1;
            self.offset_of_max_timestamp = self.base_offset;
        }
        self.next_offset = from.offset;
        self.bytes_since_index_entry = 0;
        self.first_batch_timestamp = None;
        if from.position > 0 {
            // The first batch's timestamp is needed for time-based rolling.
            self.first_batch_timestamp = self.header_at(0)?.map(|h| h.max_timestamp);
        }
        let file = self.log_handle()?;
        let mut scanner = BatchScanner::new(
            &file,
            from.position as u64,
            self.log.size(),
            MAX_SCAN_BATCH_BYTES,
        );
        let mut first = from.position > 0;
        let mut tail_tags = Vec::new();
        loop {
            let batch = scanner.next_batch().map_err(|e| self.scan_error(e))?;
            let Some(batch) = batch else { break };
            let h = *batch.header();
            // The tail is read whole anyway: check it, so a clean start notices damage there.
            if let Err(e) = batch.batch.verify_crc() {
                return Err(SegmentError::Corrupt {
                    path: self.log.path().to_path_buf(),
                    reason: format!("batch at position {}: {e}", batch.position),
                });
            }
            if h.base_offset as u64 != self.next_offset {
                return Err(SegmentError::Corrupt {
                    path: self.log.path().to_path_buf(),
                    reason: format!(
                        "batch at position {} starts at offset {}, expected {}",
                        batch.position, h.base_offset, self.next_offset
                    ),
                });
            }
            if h.max_timestamp > self.max_timestamp {
                self.max_timestamp = h.max_timestamp;
                self.offset_of_max_timestamp = h.last_offset() as u64;
            }
            if !first {
                self.first_batch_timestamp = Some(h.max_timestamp);
                first = true;
            }
            let mut marks = Vec::new();
            if collect_tag_marks(&batch.batch, 0, MAX_UNCOMPRESSED_BATCH_BYTES, &mut marks).is_ok()
            {
                tail_tags.extend(marks.iter().map(|m| TagEntry {
                    offset: h.base_offset as u64 + u64::from(m.offset_delta),
                    position: batch.position as u32,
                    hash: m.hash,
                }));
            }
            self.bytes_since_index_entry += h.total_size() as u64;
            self.next_offset = h.next_offset() as u64;
        }
        Ok(tail_tags)
    }

    fn scan_error(&self, e: ScanError) -> SegmentError {
        SegmentError::Corrupt {
            path: self.log.path().to_path_buf(),
            reason: e.to_string(),
        }
    }

    /// Re-validates every batch (CRC, contiguous offsets) and rebuilds the indexes from
    /// the valid ones. Damage does not stop the scan: each damaged range is skipped up to
    /// the next valid batch and reported in the outcome, and nothing is cut here. The
    /// caller decides (see `partition::loader`): a garbage suffix of the active segment is
    /// a torn write and is cut with [`LogSegment::truncate_log_at`]; anything else is
    /// corruption, reported and kept. `visit` sees every valid batch header in order (the
    /// partition rebuilds its leader-epoch cache from them).
    pub fn recover(
        &mut self,
        mut visit: impl FnMut(&BatchHeader),
    ) -> Result<RecoveryOutcome, SegmentError> {
        self.scan_and_index_with(&mut visit)
    }

    /// Cuts the `.log` file at `position` (a torn tail found by [`LogSegment::recover`],
    /// whose indexes already stop there) and makes the cut durable.
    pub fn truncate_log_at(&mut self, position: u64) -> Result<u64, SegmentError> {
        let removed = self.log.size().saturating_sub(position);
        if removed > 0 {
            self.log
                .truncate_to(position)
                .map_err(|e| SegmentError::io(self.log.path(), e))?;
            self.flush_log()?;
        }
        Ok(removed)
    }

    fn scan_and_index(&mut self) -> Result<RecoveryOutcome, SegmentError> {
        self.scan_and_index_with(&mut |_| {})
    }

    fn scan_and_index_with(
        &mut self,
        visit: &mut dyn FnMut(&BatchHeader),
    ) -> Result<RecoveryOutcome, SegmentError> {
        // Full capacity while rebuilding; the caller trims sealed segments afterwards.
        self.unseal()?;
        self.offset_index.reset();
        self.time_index.reset();
        self.tag_index.reset();
        self.tag_index_existed = true;
        self.bytes_since_index_entry = 0;
        self.next_offset = self.base_offset;
        self.max_timestamp = -1;
        self.offset_of_max_timestamp = self.base_offset;
        self.first_batch_timestamp = None;
        let file = self.log_handle()?;
        let size = self.log.size();
        let offset_limit = self.base_offset.saturating_add(u64::from(u32::MAX) + 1);
        let mut tag_error = None;
        let verified = verify_batches(
            &file,
            0,
            size,
            self.base_offset,
            offset_limit,
            MAX_SCAN_BATCH_BYTES,
            &mut |position, batch| {
                let h = *batch.header();
                visit(&h);
                if tag_error.is_none() {
                    tag_error = self.index_tags_of(position, batch).err();
                }
                self.track_batch(position, &h);
            },
        )
        .map_err(|e| match e {
            ScanError::Io { position, source } => SegmentError::io(
                self.log.path(),
                io::Error::new(source.kind(), format!("at position {position}: {source}")),
            ),
            other => self.scan_error(other),
        })?;
        if let Some(e) = tag_error {
            return Err(SegmentError::io(self.tag_index.file().path(), e));
        }
        Ok(RecoveryOutcome {
            batches: verified.batches,
            valid_prefix_end: verified.valid_prefix_end,
            damage: verified.damage,
        })
    }

    /// Reads the header of the batch at `position`; `Ok(None)` at the end of the log.
    pub fn header_at(&self, position: u64) -> Result<Option<BatchHeader>, SegmentError> {
        self.header_at_with(position, false)
    }

    fn header_at_with(
        &self,
        position: u64,
        cached_only: bool,
    ) -> Result<Option<BatchHeader>, SegmentError> {
        let file = self.log_handle()?;
        read_header_at_with(&file, self.log.size(), position, cached_only).map_err(|e| match e {
            ScanError::Io { source, .. } => SegmentError::io(self.log.path(), source),
            other => self.scan_error(other),
        })
    }

    /// Finds the batch holding `offset` (the first batch whose last offset is `>= offset`),
    /// scanning headers forward from the index hint. `None` when `offset` is past the end.
    pub fn find_batch(&self, offset: u64) -> Result<Option<BatchLocation>, SegmentError> {
        self.find_batch_with(offset, false)
    }

    /// [`LogSegment::find_batch`]; with `cached_only` its reads fail with an I/O error of
    /// kind `WouldBlock` instead of waiting for the disk (the index is memory-mapped and
    /// small: a cold index page is the one wait left).
    pub fn find_batch_with(
        &self,
        offset: u64,
        cached_only: bool,
    ) -> Result<Option<BatchLocation>, SegmentError> {
        if offset >= self.next_offset {
            return Ok(None);
        }
        let hint = self.offset_index.lookup(offset);
        // One small read checks the hint and, with large batches, usually answers.
        match self.header_at_with(hint.position as u64, cached_only) {
            Ok(Some(h)) if hint.position == 0 || h.base_offset as u64 == hint.offset => {
                if h.last_offset() as u64 >= offset {
                    return Ok(Some(BatchLocation {
                        position: hint.position as u64,
                        header: h,
                    }));
                }
                self.find_batch_from(
                    hint.position as u64 + h.total_size() as u64,
                    offset,
                    cached_only,
                )
            }
            Err(e) if hint.position == 0 || e.would_block() => Err(e),
            _ => {
                // A stale index (e.g. a crash after a truncation) must not send us into
                // the middle of a batch: fall back to the segment start.
                tracing::warn!(path = %self.log.path().display(), ?hint, "offset index entry does not match the log; scanning from the segment start");
                self.find_batch_from(0, offset, cached_only)
            }
        }
    }

    fn find_batch_from(
        &self,
        start: u64,
        offset: u64,
        cached_only: bool,
    ) -> Result<Option<BatchLocation>, SegmentError> {
        // Header hops through a small buffer: one read covers several small batches.
        const WINDOW: usize = 8 * 1024;
        let mut buf = [0u8; WINDOW];
        let (mut buf_pos, mut buf_len) = (0u64, 0usize);
        let mut position = start;
        let end = self.log.size();
        let file = self.log_handle()?;
        while position < end {
            let in_buf =
                position >= buf_pos && position + HEADER_LEN as u64 <= buf_pos + buf_len as u64;
            if !in_buf {
                let want = WINDOW.min((end - position) as usize);
                buf_len = read_at_most_with(&file, position, &mut buf[..want], cached_only)
                    .map_err(|e| SegmentError::io(self.log.path(), e))?;
                buf_pos = position;
            }
            let at = (position - buf_pos) as usize;
            let header =
                BatchHeader::parse(&buf[at..buf_len]).map_err(|e| SegmentError::Corrupt {
                    path: self.log.path().to_path_buf(),
                    reason: format!("batch header at position {position}: {e}"),
                })?;
            if header.last_offset() as u64 >= offset {
                return Ok(Some(BatchLocation { position, header }));
            }
            position += header.total_size() as u64;
        }
        Ok(None)
    }

    /// The first offset whose record timestamp is `>= timestamp`, if the segment has one.
    pub fn find_offset_by_timestamp(
        &self,
        timestamp: i64,
        max_uncompressed_bytes: usize,
    ) -> Result<Option<u64>, SegmentError> {
        if self.max_timestamp < timestamp {
            return Ok(None);
        }
        let start_offset = self
            .time_index
            .last_entry_before(timestamp)
            .map_or(self.base_offset, |e| e.offset);
        let Some(start) = self.find_batch(start_offset)? else {
            return Ok(None);
        };
        let file = self.log_handle()?;
        let mut scanner =
            BatchScanner::new(&file, start.position, self.log.size(), MAX_SCAN_BATCH_BYTES);
        while let Some(batch) = scanner.next_batch().map_err(|e| self.scan_error(e))? {
            if batch.header().max_timestamp < timestamp {
                continue;
            }
            let records =
                batch
                    .batch
                    .records(max_uncompressed_bytes)
                    .map_err(|e| SegmentError::Corrupt {
                        path: self.log.path().to_path_buf(),
                        reason: format!("batch at position {}: {e}", batch.position),
                    })?;
            if let Some(r) = records.iter().find(|r| r.timestamp >= timestamp) {
                return Ok(Some(r.offset as u64));
            }
        }
        Ok(None)
    }

    /// Removes every batch holding an offset `>= offset` (cutting at the start of the batch
    /// that holds `offset`). Returns the bytes removed.
    pub fn truncate_to(&mut self, offset: u64) -> Result<u64, SegmentError> {
        let Some(location) = self.find_batch(offset)? else {
            return Ok(0);
        };
        let removed = self.log.size() - location.position;
        self.log
            .truncate_to(location.position)
            .map_err(|e| SegmentError::io(self.log.path(), e))?;
        self.offset_index
            .truncate_to_position(location.position as u32);
        self.time_index
            .truncate_to(location.header.base_offset as u64);
        self.tag_index
            .truncate_to(location.header.base_offset as u64);
        self.scan_tail()?;
        // Make the shortened files durable before anything is appended after them.
        self.flush_all()?;
        Ok(removed)
    }

    /// Prepares the segment to stop being active: a final time-index entry for the max
    /// timestamp, indexes trimmed to their entries.
    pub fn seal(&mut self) -> Result<(), SegmentError> {
        let path = self.log.path().to_path_buf();
        if self.max_timestamp >= 0 && !self.time_index.is_full() {
            self.time_index
                .maybe_append(self.max_timestamp, self.offset_of_max_timestamp)
                .map_err(|e| SegmentError::io(&path, e))?;
        }
        self.offset_index
            .trim()
            .map_err(|e| SegmentError::io(&path, e))?;
        self.time_index
            .trim()
            .map_err(|e| SegmentError::io(&path, e))?;
        // Trimming writes the entries to disk: a sealed segment's tag index is as durable
        // as its log once the log is flushed (the tag index cannot be rebuilt lazily).
        self.tag_index
            .trim()
            .map_err(|e| SegmentError::io(&path, e))?;
        Ok(())
    }

    /// Makes the segment active again (after a truncation back into it).
    pub fn unseal(&mut self) -> Result<(), SegmentError> {
        let path = self.log.path().to_path_buf();
        self.offset_index
            .resize(self.config.index_max_bytes)
            .map_err(|e| SegmentError::io(&path, e))?;
        self.time_index
            .resize(self.config.index_max_bytes)
            .map_err(|e| SegmentError::io(&path, e))?;
        let tag_bytes = self
            .config
            .index_max_bytes
            .max(self.tag_index.entries() * super::tag_index::TAG_ENTRY_SIZE);
        self.tag_index
            .resize(tag_bytes)
            .map_err(|e| SegmentError::io(&path, e))
    }

    /// fdatasync of the `.log` file.
    pub fn flush_log(&self) -> Result<(), SegmentError> {
        self.log
            .flush()
            .map_err(|e| SegmentError::io(self.log.path(), e))
    }

    /// Flushes the log and both index mappings.
    pub fn flush_all(&self) -> Result<(), SegmentError> {
        self.flush_log()?;
        let path = self.log.path();
        self.offset_index
            .flush()
            .map_err(|e| SegmentError::io(path, e))?;
        self.time_index
            .flush()
            .map_err(|e| SegmentError::io(path, e))?;
        self.tag_index
            .flush()
            .map_err(|e| SegmentError::io(path, e))
    }

    /// Renames all four files with the `.deleted` suffix (the first step of a delete).
    pub fn mark_deleted(&mut self) -> Result<(), SegmentError> {
        let with_suffix = |p: &Path| PathBuf::from(format!("{}.{DELETED_SUFFIX}", p.display()));
        let log_to = with_suffix(self.log.path());
        self.log
            .rename(&log_to)
            .map_err(|e| SegmentError::io(&log_to, e))?;
        let index_to = with_suffix(self.offset_index.file().path());
        self.offset_index
            .file_mut()
            .rename(&index_to)
            .map_err(|e| SegmentError::io(&index_to, e))?;
        let time = self.time_index.file_mut();
        let time_to = with_suffix(time.path());
        time.rename(&time_to)
            .map_err(|e| SegmentError::io(&time_to, e))?;
        let tags = self.tag_index.file_mut();
        let tags_to = with_suffix(tags.path());
        tags.rename(&tags_to)
            .map_err(|e| SegmentError::io(&tags_to, e))?;
        Ok(())
    }

    /// Removes the segment's files (open handles stay readable until dropped).
    pub fn delete(self) -> Result<(), SegmentError> {
        self.log
            .delete()
            .map_err(|e| SegmentError::io(self.log.path(), e))?;
        let index = self.offset_index.file();
        index
            .delete()
            .map_err(|e| SegmentError::io(index.path(), e))?;
        let mut time_index = self.time_index;
        let time = time_index.file_mut();
        time.delete()
            .map_err(|e| SegmentError::io(time.path(), e))?;
        let tags = self.tag_index.file();
        tags.delete().map_err(|e| SegmentError::io(tags.path(), e))
    }
}
