//! Kafka's RecordBatch v2 format: the one codec for record bytes on disk and on the wire.
//!
//! [`RecordBatch`] parses a batch borrowed from a buffer (header, CRC check, records),
//! [`BatchBuilder`] encodes one, [`Compression`] implements the codecs in Kafka's
//! framing. Everything that reads or writes batch bytes (segments, partitions, the client,
//! `dump-log`) goes through this module, so there is exactly one parser for the format.
//!
//! Decoding never panics on bad input: every length is checked against the buffer and
//! every failure is a [`RecordError`] naming the field.

mod batch;
mod builder;
mod compression;
pub mod control;
pub mod delay;
mod rebatch;
mod record_codec;
pub mod tag;

/// Largest decompressed records block a reader of stored batches inflates (followers'
/// validation, recovery's tag index, `dump-log`, decoded and filtered fetches, timestamp
/// lookups). Client batches are held to the topic's `max.message.bytes` instead.
pub const MAX_UNCOMPRESSED_BATCH_BYTES: usize = 64 << 20;
pub mod varint;

pub use batch::{
    compute_crc, count_records, decode_committed_records, decode_data_records,
    decode_data_records_shared, decode_shared_records_skipping, peek_total_size, set_base_offset,
    set_partition_leader_epoch, BatchHeader, BatchIter, RecordBatch, CRC_START, HEADER_LEN,
    LOG_OVERHEAD, MAGIC,
};
pub use builder::BatchBuilder;
pub use compression::Compression;
pub use rebatch::keep_records;
pub use record_codec::{encode_record, Header, Record, RecordRef, RecordView};

/// Why a batch or record could not be decoded or encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The buffer ends before the batch does.
    #[error("truncated batch: need {needed} bytes, have {available}")]
    Truncated {
        /// Bytes the batch needs.
        needed: usize,
        /// Bytes present.
        available: usize,
    },
    /// The magic byte is not 2.
    #[error("unsupported record batch magic {0} (only magic 2 is supported)")]
    UnsupportedMagic(i8),
    /// Attribute bits 0-2 name no known codec.
    #[error("unknown compression codec id {0}")]
    UnknownCompression(i16),
    /// The stored CRC does not match the bytes.
    #[error("CRC mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    CrcMismatch {
        /// CRC in the header.
        stored: u32,
        /// CRC of the bytes.
        computed: u32,
    },
    /// A field holds an impossible value.
    #[error("malformed {field}: {reason}")]
    Malformed {
        /// The field, e.g. `record.key`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A codec failed.
    #[error("{codec} error: {reason}")]
    Compression {
        /// Codec name.
        codec: &'static str,
        /// The codec's message.
        reason: String,
    },
    /// Decompression would exceed the allowed size.
    #[error(
        "{codec} block decompresses to more than the limit of {limit} bytes (stopped at {reached})"
    )]
    DecompressedTooLarge {
        /// Codec name.
        codec: &'static str,
        /// The limit in bytes.
        limit: usize,
        /// Decompressed bytes produced (or declared by the next block) when decoding
        /// stopped: always above `limit`.
        reached: usize,
    },
    /// A batch was built with no records.
    #[error("a batch needs at least one record")]
    EmptyBatch,
}

#[cfg(test)]
mod tests;
