//! Builds a RecordBatch from records: the encoder that mirrors [`super::RecordBatch`].

use super::batch::{
    BatchHeader, ATTR_CONTROL, ATTR_TRANSACTIONAL, CRC_START, HEADER_LEN, LOG_OVERHEAD, MAGIC,
};
use super::record_codec::{encode_record, RecordRef};
use super::{Compression, RecordError};

/// Accumulates records and encodes them as one batch.
///
/// Offsets in the built batch start at the base offset given to [`BatchBuilder::build`];
/// a broker rewrites it when it appends. Timestamps are stored as deltas from the first
/// record's timestamp.
#[derive(Debug, Clone)]
pub struct BatchBuilder {
    compression: Compression,
    records: Vec<u8>,
    count: i32,
    last_offset_delta: i32,
    base_timestamp: i64,
    max_timestamp: i64,
    producer_id: i64,
    producer_epoch: i16,
    base_sequence: i32,
    partition_leader_epoch: i32,
    /// Transactional and control attribute bits.
    flags: i16,
}

impl BatchBuilder {
    /// An empty batch with the given codec and no producer id.
    pub fn new(compression: Compression) -> Self {
        Self {
            compression,
            records: Vec::new(),
            count: 0,
            last_offset_delta: -1,
            base_timestamp: -1,
            max_timestamp: -1,
            producer_id: -1,
            producer_epoch: -1,
            base_sequence: -1,
            partition_leader_epoch: -1,
            flags: 0,
        }
    }

    /// The same with room for `records_bytes` of encoded records, so that filling a batch
    /// of known size (the producer's `batch_size`) never reallocates and copies.
    pub fn with_capacity(compression: Compression, records_bytes: usize) -> Self {
        Self {
            records: Vec::with_capacity(records_bytes),
            ..Self::new(compression)
        }
    }

    /// Sets the idempotent producer fields.
    pub fn producer(mut self, producer_id: i64, producer_epoch: i16, base_sequence: i32) -> Self {
        self.producer_id = producer_id;
        self.producer_epoch = producer_epoch;
        self.base_sequence = base_sequence;
        self
    }

    /// Marks the batch as written inside a transaction (attribute bit 4).
    pub fn transactional(mut self, on: bool) -> Self {
        self.flags = if on {
            self.flags | ATTR_TRANSACTIONAL
        } else {
            self.flags & !ATTR_TRANSACTIONAL
        };
        self
    }

    /// Marks the batch as a control batch (attribute bit 5; transaction markers).
    pub(crate) fn control(mut self) -> Self {
        self.flags |= ATTR_CONTROL;
        self
    }

    /// Sets the partition leader epoch written into the header (default -1).
    pub fn partition_leader_epoch(mut self, epoch: i32) -> Self {
        self.partition_leader_epoch = epoch;
        self
    }

    /// Adds a record at the next offset delta.
    pub fn push(&mut self, record: RecordRef<'_>) {
        self.push_at(self.last_offset_delta + 1, record);
    }

    /// Adds a record at an explicit offset delta, which must exceed the previous one.
    ///
    /// # Panics
    /// When `offset_delta` does not increase: that is a bug in the caller.
    pub fn push_at(&mut self, offset_delta: i32, record: RecordRef<'_>) {
        assert!(
            offset_delta > self.last_offset_delta,
            "offset deltas must increase: {offset_delta} after {}",
            self.last_offset_delta
        );
        if self.count == 0 {
            self.base_timestamp = record.timestamp;
            self.max_timestamp = record.timestamp;
        }
        self.max_timestamp = self.max_timestamp.max(record.timestamp);
        encode_record(
            &mut self.records,
            &record,
            offset_delta,
            record.timestamp.wrapping_sub(self.base_timestamp),
        );
        self.count += 1;
        self.last_offset_delta = offset_delta;
    }

    /// Number of records added.
    pub fn len(&self) -> usize {
        self.count as usize
    }

    /// True when no record was added.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Size of the batch if built without compression.
    pub fn uncompressed_size(&self) -> usize {
        HEADER_LEN + self.records.len()
    }

    /// Encodes the batch with `base_offset` as its first offset.
    pub fn build(&self, base_offset: i64) -> Result<Vec<u8>, RecordError> {
        if self.count == 0 {
            return Err(RecordError::EmptyBatch);
        }
        let mut out;
        match self.compression {
            Compression::None => {
                out = Vec::with_capacity(HEADER_LEN + self.records.len());
                out.resize(HEADER_LEN, 0);
                out.extend_from_slice(&self.records);
            }
            codec => {
                let block = codec.compress(&self.records)?;
                out = Vec::with_capacity(HEADER_LEN + block.len());
                out.resize(HEADER_LEN, 0);
                out.extend_from_slice(&block);
            }
        }
        let batch_length =
            i32::try_from(out.len() - LOG_OVERHEAD).map_err(|_| RecordError::Malformed {
                field: "batch_length",
                reason: format!("batch of {} bytes exceeds 2 GiB", out.len()),
            })?;
        let mut header = BatchHeader {
            base_offset,
            batch_length,
            partition_leader_epoch: self.partition_leader_epoch,
            magic: MAGIC,
            crc: 0,
            attributes: self.compression.attribute() | self.flags,
            last_offset_delta: self.last_offset_delta,
            base_timestamp: self.base_timestamp,
            max_timestamp: self.max_timestamp,
            producer_id: self.producer_id,
            producer_epoch: self.producer_epoch,
            base_sequence: self.base_sequence,
            record_count: self.count,
        };
        header.write(&mut out);
        header.crc = crc32c::crc32c(&out[CRC_START..]);
        out[17..21].copy_from_slice(&header.crc.to_be_bytes());
        Ok(out)
    }
}
