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
    if position >= end {
        return Ok(None);
    }
    let mut buf = [0u8; HEADER_LEN];
    let n = read_at_most(file, position, &mut buf)
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
