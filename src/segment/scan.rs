//! Sequential batch scanning of a `.log` file through a reusable buffer.
//!
//! Used by recovery (validate every batch), by index rebuilds, by offset lookups (hop
//! from an index hint to the batch holding an offset) and by `dump-log`. The scanner
//! distinguishes a clean end of data, an incomplete batch at the end (a torn write), and
//! a corrupt one, so each caller can decide whether to truncate, report or fail.

use std::fs::File;
use std::io;

use crate::record::{
    peek_total_size, BatchHeader, RecordBatch, RecordError, HEADER_LEN, LOG_OVERHEAD,
};

use super::log_file::read_at_most;

/// What stopped a scan before the end of the range.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// The batch at `position` does not fit before the end of the range: a torn write,
    /// or a length field pointing past the end of the file.
    #[error("incomplete batch at position {position}: needs {needed} bytes, {available} left")]
    Incomplete {
        /// Where the batch starts.
        position: u64,
        /// Bytes the batch claims.
        needed: u64,
        /// Bytes left in the range.
        available: u64,
    },
    /// The bytes at `position` are not a valid batch.
    #[error("corrupt batch at position {position}: {source}")]
    Corrupt {
        /// Where the batch starts.
        position: u64,
        /// What is wrong with it.
        #[source]
        source: RecordError,
    },
    /// The batch at `position` is larger than any batch may be.
    #[error("batch at position {position} claims {size} bytes, above the limit of {limit}")]
    Oversized {
        /// Where the batch starts.
        position: u64,
        /// Claimed size.
        size: u64,
        /// Largest size accepted.
        limit: u64,
    },
    /// Reading the file failed.
    #[error("read failed at position {position}: {source}")]
    Io {
        /// Where the read started.
        position: u64,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

impl ScanError {
    /// Position of the batch that stopped the scan.
    pub fn position(&self) -> u64 {
        match self {
            Self::Incomplete { position, .. }
            | Self::Corrupt { position, .. }
            | Self::Oversized { position, .. }
            | Self::Io { position, .. } => *position,
        }
    }
}

/// Reads and decodes the header of the batch starting at `position`; `Ok(None)` when
/// `position` is at or past `end`. Used for index checks and offset lookups, which need a
/// header, not a whole batch.
pub fn read_header_at(
    file: &File,
    end: u64,
    position: u64,
) -> Result<Option<BatchHeader>, ScanError> {
    read_header_at_with(file, end, position, false)
}

/// [`read_header_at`]; with `cached_only`, an I/O error of kind `WouldBlock` instead of
/// waiting for the disk.
pub fn read_header_at_with(
    file: &File,
    end: u64,
    position: u64,
    cached_only: bool,
) -> Result<Option<BatchHeader>, ScanError> {
    if position >= end {
        return Ok(None);
    }
    let mut buf = [0u8; HEADER_LEN];
    let n = super::log_file::read_at_most_with(file, position, &mut buf, cached_only)
        .map_err(|source| ScanError::Io { position, source })?;
    BatchHeader::parse(&buf[..n])
        .map(Some)
        .map_err(|source| ScanError::Corrupt { position, source })
}

/// One batch found by the scanner.
#[derive(Debug, Clone, Copy)]
pub struct ScannedBatch<'a> {
    /// Byte position of the batch in the file.
    pub position: u64,
    /// The batch (header decoded, bytes borrowed from the scanner's buffer).
    pub batch: RecordBatch<'a>,
}

impl ScannedBatch<'_> {
    /// The decoded header.
    pub fn header(&self) -> &BatchHeader {
        self.batch.header()
    }
}

/// Reads whole batches from `[start, end)` of a file, one after another.
pub struct BatchScanner<'f> {
    file: &'f File,
    /// File position of `buf[0]`.
    buf_position: u64,
    buf: Vec<u8>,
    /// Index in `buf` of the next batch.
    cursor: usize,
    end: u64,
    max_batch_bytes: u64,
}

/// Default read-ahead of the scanner.
const READ_AHEAD: usize = 64 * 1024;

impl<'f> BatchScanner<'f> {
    /// Scans `[start, end)` of `file`, refusing batches larger than `max_batch_bytes`.
    pub fn new(file: &'f File, start: u64, end: u64, max_batch_bytes: u64) -> Self {
        Self {
            file,
            buf_position: start,
            buf: Vec::with_capacity(READ_AHEAD),
            cursor: 0,
            end,
            max_batch_bytes,
        }
    }

    /// File position of the next batch.
    pub fn position(&self) -> u64 {
        self.buf_position + self.cursor as u64
    }

    /// Makes at least `want` bytes from the cursor available (fewer at the end of the range).
    fn fill(&mut self, want: usize) -> Result<usize, ScanError> {
        let available = self.buf.len() - self.cursor;
        if available >= want {
            return Ok(available);
        }
        // Move the unread tail to the front, then read more after it.
        self.buf.drain(..self.cursor);
        self.buf_position += self.cursor as u64;
        self.cursor = 0;
        let read_end = self.buf_position + self.buf.len() as u64;
        let left_in_range = self.end.saturating_sub(read_end);
        let target = want.max(READ_AHEAD);
        let to_read = (target - self.buf.len()).min(left_in_range as usize);
        let old_len = self.buf.len();
        self.buf.resize(old_len + to_read, 0);
        let n = read_at_most(self.file, read_end, &mut self.buf[old_len..]).map_err(|source| {
            ScanError::Io {
                position: read_end,
                source,
            }
        })?;
        self.buf.truncate(old_len + n);
        Ok(self.buf.len())
    }

    /// The next batch, `Ok(None)` at the end of the range. The CRC is not checked.
    pub fn next_batch(&mut self) -> Result<Option<ScannedBatch<'_>>, ScanError> {
        let position = self.position();
        if position >= self.end {
            return Ok(None);
        }
        let available = self.fill(LOG_OVERHEAD)?;
        if available == 0 {
            return Ok(None);
        }
        let left = self.end - position;
        let size = match peek_total_size(&self.buf[self.cursor..]) {
            Some(size) => size as u64,
            None if available < LOG_OVERHEAD => {
                return Err(ScanError::Incomplete {
                    position,
                    needed: LOG_OVERHEAD as u64,
                    available: left,
                })
            }
            None => {
                return Err(ScanError::Corrupt {
                    position,
                    source: RecordError::Malformed {
                        field: "batch_length",
                        reason: "negative batch length".into(),
                    },
                })
            }
        };
        if size > self.max_batch_bytes {
            return Err(ScanError::Oversized {
                position,
                size,
                limit: self.max_batch_bytes,
            });
        }
        if size > left {
            return Err(ScanError::Incomplete {
                position,
                needed: size,
                available: left,
            });
        }
        let available = self.fill(size as usize)?;
        if (available as u64) < size {
            return Err(ScanError::Incomplete {
                position,
                needed: size,
                available: available as u64,
            });
        }
        let start = self.cursor;
        match RecordBatch::parse(&self.buf[start..start + size as usize]) {
            Ok((batch, _)) => {
                self.cursor += size as usize;
                Ok(Some(ScannedBatch { position, batch }))
            }
            Err(source) => Err(ScanError::Corrupt { position, source }),
        }
    }
}

/// A byte range of a `.log` file that does not hold valid batches where valid batches
/// must be: a batch that fails its CRC or structure checks, or that breaks the offset
/// order, up to the next valid batch (or to the end of the file when none follows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentDamage {
    /// Where the bad bytes start (the position a batch was expected at).
    pub start_position: u64,
    /// Where valid batches resume; the end of the scanned range when none follows.
    pub end_position: u64,
    /// The offset the bad batch should have started with: the first offset possibly lost.
    pub first_offset: u64,
    /// Base offset of the valid batch found at `end_position`; `None` when no valid batch
    /// follows the damage (a garbage suffix, which is what a torn write looks like).
    pub resume_offset: Option<u64>,
    /// What was wrong at `start_position`.
    pub reason: String,
}

/// What [`verify_batches`] found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VerifiedRange {
    /// Valid batches seen (before and after damage).
    pub batches: u64,
    /// Offset after the last valid batch.
    pub next_offset: u64,
    /// End of the valid prefix: the start of the first damage, or the end of the range.
    pub valid_prefix_end: u64,
    /// Every damaged range, in file order.
    pub damage: Vec<SegmentDamage>,
}

/// Largest number of damaged ranges one scan records before giving up on the rest of the
/// range (reported as one last range to the end): bounds the report and the work.
pub const MAX_DAMAGED_RANGES: usize = 1024;

/// Validates every batch of `[start, end)`: each must parse, fit, have a valid CRC, start
/// exactly at the offset after the previous one (the first at `first_offset`) and end
/// below `offset_limit`. Every valid batch goes to `visit` with its position, in order.
///
/// Unlike a plain scan, damage does not end the walk: after a bad batch the scan searches
/// forward ([`find_next_valid_batch`]) for the next valid batch whose base offset is not
/// below the expected one, records the skipped range, and continues from there. Only
/// read failures are errors.
pub fn verify_batches(
    file: &File,
    start: u64,
    end: u64,
    first_offset: u64,
    offset_limit: u64,
    max_batch_bytes: u64,
    visit: &mut dyn FnMut(u64, &RecordBatch<'_>),
) -> Result<VerifiedRange, ScanError> {
    let mut out = VerifiedRange {
        next_offset: first_offset,
        valid_prefix_end: end,
        ..VerifiedRange::default()
    };
    let mut scanner = BatchScanner::new(file, start, end, max_batch_bytes);
    loop {
        let position = scanner.position();
        let problem = match scanner.next_batch() {
            Ok(None) => break,
            Ok(Some(scanned)) => {
                let h = *scanned.header();
                if let Err(e) = scanned.batch.verify_crc() {
                    Some(format!("batch at position {position}: {e}"))
                } else if h.base_offset as u64 != out.next_offset
                    || h.last_offset() as u64 >= offset_limit
                {
                    Some(format!(
                        "batch at position {position} has offsets {}..={}, expected to start at {}",
                        h.base_offset,
                        h.last_offset(),
                        out.next_offset
                    ))
                } else {
                    visit(position, &scanned.batch);
                    out.batches += 1;
                    out.next_offset = h.next_offset() as u64;
                    None
                }
            }
            Err(e @ ScanError::Io { .. }) => return Err(e),
            Err(e) => Some(e.to_string()),
        };
        let Some(reason) = problem else { continue };
        if out.damage.is_empty() {
            out.valid_prefix_end = position;
        }
        let resume = if out.damage.len() + 1 >= MAX_DAMAGED_RANGES {
            None
        } else {
            find_next_valid_batch(
                file,
                position + 1,
                end,
                out.next_offset,
                offset_limit,
                max_batch_bytes,
            )?
        };
        out.damage.push(SegmentDamage {
            start_position: position,
            end_position: resume.map_or(end, |(p, _)| p),
            first_offset: out.next_offset,
            resume_offset: resume.map(|(_, h)| h.base_offset as u64),
            reason,
        });
        let Some((resume_position, h)) = resume else {
            break;
        };
        out.next_offset = h.base_offset as u64;
        scanner = BatchScanner::new(file, resume_position, end, max_batch_bytes);
    }
    Ok(out)
}

/// Searches `[from, end)` for the first position where a whole valid batch starts: its
/// header parses, it fits before `end`, its CRC validates, its base offset is at least
/// `min_base_offset` and its last offset below `offset_limit`. Used to resynchronize after
/// damage (recovery, `repair`, `dump-log`). Reads the range once in windows; only
/// candidates whose header checks pass are read whole.
pub fn find_next_valid_batch(
    file: &File,
    from: u64,
    end: u64,
    min_base_offset: u64,
    offset_limit: u64,
    max_batch_bytes: u64,
) -> Result<Option<(u64, BatchHeader)>, ScanError> {
    const WINDOW: usize = 1 << 20;
    let mut buf = vec![0u8; WINDOW];
    let mut window_start = from;
    while window_start + HEADER_LEN as u64 <= end {
        let want = (WINDOW as u64).min(end - window_start) as usize;
        let n =
            read_at_most(file, window_start, &mut buf[..want]).map_err(|source| ScanError::Io {
                position: window_start,
                source,
            })?;
        if n < HEADER_LEN {
            return Ok(None);
        }
        for i in 0..=n - HEADER_LEN {
            // Cheap filter first: the magic byte.
            if buf[i + 16] as i8 != crate::record::MAGIC {
                continue;
            }
            let Ok(h) = BatchHeader::parse(&buf[i..n]) else {
                continue;
            };
            let position = window_start + i as u64;
            let size = h.total_size() as u64;
            if size > max_batch_bytes
                || position + size > end
                || (h.base_offset as u64) < min_base_offset
                || h.last_offset() as u64 >= offset_limit
            {
                continue;
            }
            let valid = if i + size as usize <= n {
                RecordBatch::parse(&buf[i..i + size as usize])
                    .is_ok_and(|(b, _)| b.verify_crc().is_ok())
            } else {
                let mut whole = vec![0u8; size as usize];
                let got = read_at_most(file, position, &mut whole)
                    .map_err(|source| ScanError::Io { position, source })?;
                got == whole.len()
                    && RecordBatch::parse(&whole).is_ok_and(|(b, _)| b.verify_crc().is_ok())
            };
            if valid {
                return Ok(Some((position, h)));
            }
        }
        if window_start + n as u64 >= end {
            break;
        }
        // Overlap windows so a header straddling the boundary is seen whole.
        window_start += (n - HEADER_LEN + 1) as u64;
    }
    Ok(None)
}
