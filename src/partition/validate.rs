//! Checks on batches before they reach a segment.
//!
//! A leader accepts batches from clients: each must be a complete, CRC-valid magic-2
//! batch no larger than `max.message.bytes`, with records whose count and offset deltas
//! agree with the header. A compressed batch's records block must also decompress to no
//! more than `max.message.bytes` ([`LogError::UncompressedTooLarge`]): it is checked by a
//! streaming decode that stops at the limit, so a decompression bomb costs at most the
//! limit in memory and CPU, never its expanded size. A follower
//! accepts batches copied from its leader: same format checks, plus offsets that continue
//! its log exactly.
//!
//! A client batch must also keep the record rules ([`LogError::RefusedRecord`]): no
//! control attribute (only the transaction coordinator writes markers), the transactional
//! attribute only with a producer id and epoch, and no negative timestamp, in any record
//! or in `max_timestamp`.

use crate::record::control::{decode_marker, ControlMarker};
use crate::record::delay::is_delay_header;
use crate::record::tag::{record_tag_hash, TagMark};
use crate::record::{peek_total_size, BatchHeader, RecordBatch, RecordError, LOG_OVERHEAD};

use super::LogError;

pub use crate::record::MAX_UNCOMPRESSED_BATCH_BYTES;

/// What validation learned about one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchMeta {
    /// Byte position of the batch in the caller's buffer.
    pub position: usize,
    /// Offsets the batch spans (`last_offset_delta + 1`).
    pub offset_span: u64,
    /// Records in the batch.
    pub record_count: u64,
    /// Largest record timestamp.
    pub max_timestamp: i64,
    /// Offset of the batch as it arrived (meaningful for follower appends).
    pub base_offset: u64,
    /// Partition leader epoch as it arrived.
    pub partition_leader_epoch: i32,
    /// Idempotent producer id (-1: none).
    pub producer_id: i64,
    /// Its epoch.
    pub producer_epoch: i16,
    /// Sequence of the first record.
    pub base_sequence: i32,
    /// Written inside a transaction.
    pub transactional: bool,
    /// The marker of a control batch.
    pub marker: Option<ControlMarker>,
}

impl BatchMeta {
    /// The meta of the batch with header `h` at `position` (`marker`: its decoded
    /// marker, for control batches).
    pub fn of(h: &BatchHeader, position: usize, marker: Option<ControlMarker>) -> Self {
        Self {
            position,
            offset_span: h.last_offset_delta as u64 + 1,
            record_count: h.record_count as u64,
            max_timestamp: h.max_timestamp,
            base_offset: h.base_offset as u64,
            partition_leader_epoch: h.partition_leader_epoch,
            producer_id: h.producer_id,
            producer_epoch: h.producer_epoch,
            base_sequence: h.base_sequence,
            transactional: h.is_transactional(),
            marker,
        }
    }
}

/// What validation learned about a request's batches.
#[derive(Debug, Default)]
pub struct Validated {
    /// One per batch, in order.
    pub metas: Vec<BatchMeta>,
    /// Every tagged record, for the segment's tag index (found while the records were
    /// decoded for their checks anyway).
    pub tags: Vec<TagMark>,
}

/// Validates every batch in `buf`. `from_client` adds the checks a leader applies to
/// client batches (contiguous deltas from 0, no control batches).
pub fn validate_batches(
    buf: &[u8],
    max_message_bytes: usize,
    from_client: bool,
) -> Result<Validated, LogError> {
    if buf.is_empty() {
        return Err(LogError::InvalidRecord {
            reason: "the request holds no record batch".into(),
        });
    }
    let mut metas = Vec::new();
    let mut tags = Vec::new();
    let mut scheduled: Option<String> = None;
    let mut position = 0usize;
    while position < buf.len() {
        let rest = &buf[position..];
        let invalid = |reason: String| LogError::InvalidRecord {
            reason: format!("batch {} at byte {position}: {reason}", metas.len()),
        };
        let size = peek_total_size(rest).ok_or_else(|| {
            invalid(format!(
                "{} trailing bytes are not a batch header (need {LOG_OVERHEAD})",
                rest.len()
            ))
        })?;
        if size > max_message_bytes {
            return Err(LogError::RecordTooLarge {
                size,
                limit: max_message_bytes,
            });
        }
        let (batch, _) = RecordBatch::parse(rest).map_err(|e| invalid(e.to_string()))?;
        // A client's batch is bounded by max.message.bytes after decompression too; a
        // follower copies what its leader already accepted.
        let uncompressed_limit = if from_client {
            max_message_bytes
        } else {
            MAX_UNCOMPRESSED_BATCH_BYTES.max(max_message_bytes)
        };
        batch.verify_crc().map_err(|e| invalid(e.to_string()))?;
        // A client's records must carry real timestamps: the time index and retention.ms
        // rely on them (Kafka's -1 "no timestamp" is refused too; the records API leaves
        // timestamp_ms out to get the broker's clock).
        let mut negative_timestamp = None;
        let base_offset = batch.header().base_offset;
        batch
            .for_each_record(uncompressed_limit, |r| {
                if from_client && r.timestamp < 0 && negative_timestamp.is_none() {
                    negative_timestamp = Some((r.offset - base_offset, r.timestamp));
                }
                if from_client
                    && scheduled.is_none()
                    && r.headers().any(|(k, _)| is_delay_header(k))
                {
                    scheduled = Some(format!(
                        "batch {} record {} carries a scheduling header",
                        metas.len(),
                        r.offset - base_offset
                    ));
                }
                if let Some(hash) = record_tag_hash(&r) {
                    tags.push(TagMark {
                        batch: metas.len() as u32,
                        offset_delta: (r.offset - base_offset) as u32,
                        hash,
                    });
                }
                Ok(())
            })
            .map_err(|e| match e {
                RecordError::DecompressedTooLarge {
                    codec,
                    limit,
                    reached,
                } => LogError::UncompressedTooLarge {
                    codec,
                    compressed_size: size,
                    limit,
                    reached,
                },
                e => invalid(e.to_string()),
            })?;
        let h = batch.header();
        if from_client {
            if h.record_count == 0
                || i64::from(h.last_offset_delta) != i64::from(h.record_count) - 1
            {
                return Err(invalid(format!(
                    "record_count {} and last_offset_delta {} must describe offsets 0..n-1",
                    h.record_count, h.last_offset_delta
                )));
            }
            let refused = |reason: String| LogError::RefusedRecord {
                reason: format!("batch {} at byte {position}: {reason}", metas.len()),
            };
            if h.is_control() {
                return Err(refused(
                    "the control attribute (bit 5) is set; clients may not write control batches"
                        .into(),
                ));
            }
            if h.is_transactional() && (h.producer_id < 0 || h.producer_epoch < 0) {
                return Err(refused(format!(
                    "the transactional attribute (bit 4) is set without a producer (id {}, epoch {}); transactional batches need the id and epoch InitProducerId gave",
                    h.producer_id, h.producer_epoch
                )));
            }
            if let Some((index, timestamp)) = negative_timestamp {
                return Err(refused(format!(
                    "record {index} has timestamp {timestamp}; client timestamps must be >= 0 (ms since the epoch)"
                )));
            }
            if h.max_timestamp < 0 {
                return Err(refused(format!(
                    "max_timestamp is {}; client timestamps must be >= 0 (ms since the epoch)",
                    h.max_timestamp
                )));
            }
        }
        let marker = if h.is_control() {
            Some(decode_marker(&batch).map_err(|e| invalid(e.to_string()))?)
        } else {
            None
        };
        metas.push(BatchMeta::of(h, position, marker));
        position += size;
    }
    if let Some(reason) = scheduled {
        return Err(LogError::ScheduledRecords { reason });
    }
    Ok(Validated { metas, tags })
}
