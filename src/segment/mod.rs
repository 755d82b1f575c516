//! One segment of a partition's log: the `.log` file of record batches, its sparse
//! `.index` (offset -> position) and `.timeindex` (timestamp -> offset), and its dense
//! `.tagindex` (tagged record -> batch position and tag hash).
//!
//! Synchronous std I/O only: no async runtime, no network. Byte layouts are documented on
//! each type and in `docs/storage-format.md`. Indexes are hints: they are checked when
//! loaded, verified when used, and rebuilt from the log when they disagree with it.

mod index_file;
mod log_file;
#[cfg(test)]
pub(crate) use log_file::fail_next_append;
mod log_segment;
mod offset_index;
mod scan;
mod tag_index;
mod time_index;

use std::io;
use std::path::{Path, PathBuf};

pub use index_file::remove_if_exists;
pub use log_file::{read_at_most, read_at_most_with, read_vec_at_most, LogFile};
pub use log_segment::{
    segment_file, BatchLocation, LogSegment, RecoveryOutcome, SegmentConfig, DELETED_SUFFIX,
    INDEX_SUFFIX, INDEX_SUFFIXES, LOG_SUFFIX, MAX_SEGMENT_BYTES, TAG_INDEX_SUFFIX,
    TIME_INDEX_SUFFIX,
};
pub use offset_index::{OffsetIndex, OffsetPosition, OFFSET_ENTRY_SIZE};
pub use scan::{
    find_next_valid_batch, read_header_at, verify_batches, BatchScanner, ScanError, ScannedBatch,
    SegmentDamage, VerifiedRange, MAX_DAMAGED_RANGES,
};
pub use tag_index::{TagEntry, TagIndex, TAG_ENTRY_SIZE};
pub use time_index::{TimeIndex, TimestampOffset, TIME_ENTRY_SIZE};

/// Why a segment operation failed.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    /// A file operation failed: fatal for the partition.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The file holds bytes that are not valid batches where valid batches must be.
    #[error("corrupt segment {path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The caller handed over batches that break the segment's invariants (a bug).
    #[error("invalid append: {0}")]
    InvalidAppend(String),
    /// The append would push positions past what the index can address.
    #[error("segment {path} is full: {size} bytes + {append} would pass 2 GiB")]
    SegmentFull {
        /// The file.
        path: PathBuf,
        /// Current size.
        size: u64,
        /// Bytes to append.
        append: u64,
    },
}

impl SegmentError {
    /// A cache-only read found bytes that are not in the page cache.
    pub fn would_block(&self) -> bool {
        matches!(self, Self::Io { source, .. } if source.kind() == io::ErrorKind::WouldBlock)
    }

    /// An I/O error on `path`.
    pub fn io(path: &Path, source: io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}
