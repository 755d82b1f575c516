//! One partition's log: ordered segments, offsets, appends, reads, roll, retention,
//! truncation, leader epochs, flushing and crash recovery.
//!
//! [`PartitionLog`] is safe to share between threads. Exactly one append, truncation,
//! roll or retention runs at a time (a write lock held only for in-memory work and the
//! `write` to the page cache); reads take the lock only to locate their bytes and read
//! them afterwards, so a slow reader never holds up the writer. fsyncs happen outside the
//! lock, shared between appenders by group commit.
//!
//! Offsets: `log_start_offset <= high_watermark <= log_end_offset`. Consumers read below
//! the high watermark, followers up to the log end.
//!
//! Failure: an I/O error while writing, flushing or in any step of a mutation (roll,
//! truncation, retention, log-start moves) takes the partition offline (every later call
//! fails with [`LogError::Offline`], see [`PartitionLog::offline_reason`]); it is never
//! retried, because the state of the files is no longer known. Mutations order their
//! steps so a failure never leaves the segment map empty or half-swapped.
//!
//! Damaged bytes are never served. Recovery cuts only a torn write at the end of the log;
//! any other damage makes [`PartitionLog::open`] fail with [`LogError::Damaged`] (which
//! files, byte ranges, offsets), keeping every byte, until `tidelog repair`
//! ([`repair`]) drops exactly the damaged ranges. Reads that meet a corrupt batch answer
//! [`LogError::Corrupt`] and record it ([`PartitionLog::damage_seen`]).

mod checkpoint;
mod clock;
pub mod damage;
mod epoch_cache;
mod group_commit;
mod loader;
mod log;
pub mod producer_state;
pub mod repair;
mod retention;
pub mod txn_index;
mod validate;

use std::path::PathBuf;

pub use clock::{Clock, ManualClock, SystemClock};
pub use damage::{DamageKind, DamageReport, DamagedRange};
pub use epoch_cache::{EpochEntry, LeaderEpochCache};
pub use loader::{lock_data_dir, DirLock};
pub use log::{AppendInfo, FetchData, Isolation, PartitionLog, ReadOptions, RetentionOutcome};
pub use producer_state::AbortedTxn;
pub use retention::{segments_to_delete, SegmentSummary};
pub use validate::MAX_UNCOMPRESSED_BATCH_BYTES;

use crate::segment::SegmentError;
use crate::topic_config::ConfigError;

/// Why a partition operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A cache-only read ([`ReadOptions::cached_only`]) found bytes that are not in the
    /// page cache; the caller reads again on a blocking thread. Never sent to clients.
    #[error("the data is not in the page cache")]
    NotCached,
    /// The requested offset is outside the log.
    #[error(
        "offset {requested} is out of range: the log holds [{log_start_offset}, {log_end_offset})"
    )]
    OffsetOutOfRange {
        /// The offset asked for.
        requested: u64,
        /// First offset in the log.
        log_start_offset: u64,
        /// Offset after the last record.
        log_end_offset: u64,
    },
    /// A batch is larger than `max.message.bytes`.
    #[error("record batch of {size} bytes exceeds max.message.bytes={limit}")]
    RecordTooLarge {
        /// Batch size in bytes.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A compressed batch decompresses to more than `max.message.bytes`: the streaming
    /// check stopped once the output passed the limit (a decompression bomb, or a batch
    /// the producer should have split). Nothing was written.
    #[error(
        "record batch of {compressed_size} bytes ({codec}) decompresses to more than max.message.bytes={limit}: decoding stopped at {reached} bytes"
    )]
    UncompressedTooLarge {
        /// Codec of the batch.
        codec: &'static str,
        /// Size of the batch as sent.
        compressed_size: usize,
        /// The limit on its decompressed records block.
        limit: usize,
        /// Decompressed bytes when decoding stopped (above `limit`).
        reached: usize,
    },
    /// Bytes from a client or leader are not valid batches; nothing was written.
    #[error("invalid record batch: {reason}")]
    InvalidRecord {
        /// What is wrong.
        reason: String,
    },
    /// A well-formed client batch breaks a record rule (a negative timestamp, the control
    /// attribute, the transactional one without a producer); nothing was written.
    #[error("record batch refused: {reason}")]
    RefusedRecord {
        /// Which rule, naming the batch, record and field.
        reason: String,
    },
    /// A client batch holds records with a scheduling header (`tidelog.delay.ms`,
    /// `tidelog.deliver.at.ms`): they go to the timers, not to the log; nothing was
    /// written.
    #[error("record batch holds scheduled records: {reason}")]
    ScheduledRecords {
        /// Which batch and record.
        reason: String,
    },
    /// A follower append does not continue the log.
    #[error("follower append starts at offset {got}, but the log ends at {expected}")]
    NonContiguousAppend {
        /// The log end offset.
        expected: u64,
        /// The first offset offered.
        got: u64,
    },
    /// Bytes on disk failed validation where they must be valid.
    #[error("corrupt data in {path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Opening found damaged data it must not cut off (corruption in the middle of the
    /// log, in a sealed segment, or below the recovery point). Nothing was changed on
    /// disk; the report says which files, positions and offsets. The partition stays
    /// offline until `tidelog repair` (or a replica) fixes it.
    #[error("partition data is damaged: {0}")]
    Damaged(Box<damage::DamageReport>),
    /// An earlier fatal error took the partition offline.
    #[error("partition {partition} is offline after a fatal error: {reason}")]
    Offline {
        /// The partition directory name.
        partition: String,
        /// The first fatal error.
        reason: String,
    },
    /// Another process (or another open in this one) holds the directory.
    #[error("partition directory {path} is locked by another process")]
    DirectoryLocked {
        /// The directory.
        path: PathBuf,
    },
    /// The topic config is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An idempotent producer's batch skips, reorders or is fenced; nothing was written.
    #[error(transparent)]
    Sequence(#[from] producer_state::SequenceError),
    /// A file operation failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl LogError {
    fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// Whether this is a full disk (ENOSPC, or a quota): a write that failed for it left
    /// nothing half-done, so the partition keeps serving reads and takes writes again once
    /// space is freed.
    pub fn is_no_space(&self) -> bool {
        matches!(
            self,
            Self::Io { source, .. }
                if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
        )
    }
}

impl From<SegmentError> for LogError {
    fn from(e: SegmentError) -> Self {
        match e {
            // Only cache-only reads ask not to wait; regular files never say WouldBlock.
            e if e.would_block() => Self::NotCached,
            SegmentError::Io { path, source } => Self::Io { path, source },
            SegmentError::Corrupt { path, reason } => Self::Corrupt { path, reason },
            SegmentError::InvalidAppend(reason) => Self::InvalidRecord { reason },
            SegmentError::SegmentFull { path, size, append } => Self::InvalidRecord {
                reason: format!(
                    "append of {append} bytes to {} ({size} bytes) would pass 2 GiB",
                    path.display()
                ),
            },
        }
    }
}

#[cfg(test)]
mod filter_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod txn_tests;
