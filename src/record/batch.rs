//! One Kafka RecordBatch (magic 2): the 61-byte header and a view over the whole batch.
//!
//! Layout (all integers big-endian):
//!
//! ```text
//! offset  size  field
//!      0     8  base_offset
//!      8     4  batch_length            bytes after this field (total size - 12)
//!     12     4  partition_leader_epoch  outside the CRC: a broker may rewrite it
//!     16     1  magic                   always 2
//!     17     4  crc                     CRC32C of bytes 21..end
//!     21     2  attributes              bits 0-2 compression, 3 timestamp type,
//!                                       4 transactional, 5 control
//!     23     4  last_offset_delta
//!     27     8  base_timestamp
//!     35     8  max_timestamp
//!     43     8  producer_id
//!     51     2  producer_epoch
//!     53     4  base_sequence
//!     57     4  record_count
//!     61     …  records (compressed as one block when compression != none)
//! ```
//!
//! The base offset and leader epoch sit before the CRC'd region, so a broker assigns
//! offsets by rewriting them in place without recomputing the CRC.

use super::compression::READ_CHUNK;
use bytes::Bytes;

use super::{Compression, Record, RecordError, RecordView};

/// Size of the fixed batch header.
pub const HEADER_LEN: usize = 61;
/// Bytes before `batch_length` ends: `base_offset` + `batch_length`.
pub const LOG_OVERHEAD: usize = 12;
/// The only record format this crate reads and writes.
pub const MAGIC: i8 = 2;
/// Where the CRC'd region starts (the attributes field).
pub const CRC_START: usize = 21;

const ATTR_COMPRESSION_MASK: i16 = 0x07;
const ATTR_TIMESTAMP_TYPE: i16 = 0x08;
pub(crate) const ATTR_TRANSACTIONAL: i16 = 0x10;
pub(crate) const ATTR_CONTROL: i16 = 0x20;

/// The fixed header of a batch, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    /// Offset of the first record.
    pub base_offset: i64,
    /// Bytes after the `batch_length` field.
    pub batch_length: i32,
    /// Leader epoch of the broker that appended the batch (-1 when unset).
    pub partition_leader_epoch: i32,
    /// Record format version; 2 for every batch this crate accepts.
    pub magic: i8,
    /// Stored CRC32C of bytes 21..end.
    pub crc: u32,
    /// Compression, timestamp type, transactional and control flags.
    pub attributes: i16,
    /// `last_offset - base_offset`.
    pub last_offset_delta: i32,
    /// Timestamp of the first record; record timestamps are deltas from it.
    pub base_timestamp: i64,
    /// Largest record timestamp in the batch.
    pub max_timestamp: i64,
    /// Idempotent producer id, -1 when none.
    pub producer_id: i64,
    /// Idempotent producer epoch, -1 when none.
    pub producer_epoch: i16,
    /// Sequence number of the first record, -1 when none.
    pub base_sequence: i32,
    /// Number of records in the batch.
    pub record_count: i32,
}

fn be_i64(b: &[u8], at: usize) -> i64 {
    i64::from_be_bytes(b[at..at + 8].try_into().expect("8-byte slice"))
}
fn be_i32(b: &[u8], at: usize) -> i32 {
    i32::from_be_bytes(b[at..at + 4].try_into().expect("4-byte slice"))
}
fn be_i16(b: &[u8], at: usize) -> i16 {
    i16::from_be_bytes(b[at..at + 2].try_into().expect("2-byte slice"))
}

/// Records in the whole batches at the start of `buf`, by their headers' counts (a
/// trailing partial batch counts nothing); no CRC or record decoding.
pub fn count_records(buf: &[u8]) -> u64 {
    let mut total = 0u64;
    let mut at = 0usize;
    while buf.len() - at >= HEADER_LEN {
        let length = be_i32(buf, at + 8);
        let Some(end) = usize::try_from(length)
            .ok()
            .and_then(|l| (at + 12).checked_add(l))
            .filter(|end| *end <= buf.len() && *end >= at + HEADER_LEN)
        else {
            break;
        };
        total += u64::try_from(be_i32(buf, at + 57)).unwrap_or(0);
        at = end;
    }
    total
}

impl BatchHeader {
    /// Decodes the header from the first [`HEADER_LEN`] bytes of `buf`.
    ///
    /// Checks only what the header alone can tell: enough bytes, magic 2, a batch length
    /// that covers the header, and a non-negative base offset and record count.
    pub fn parse(buf: &[u8]) -> Result<Self, RecordError> {
        if buf.len() < HEADER_LEN {
            return Err(RecordError::Truncated {
                needed: HEADER_LEN,
                available: buf.len(),
            });
        }
        let header = Self {
            base_offset: be_i64(buf, 0),
            batch_length: be_i32(buf, 8),
            partition_leader_epoch: be_i32(buf, 12),
            magic: buf[16] as i8,
            crc: u32::from_be_bytes(buf[17..21].try_into().expect("4-byte slice")),
            attributes: be_i16(buf, 21),
            last_offset_delta: be_i32(buf, 23),
            base_timestamp: be_i64(buf, 27),
            max_timestamp: be_i64(buf, 35),
            producer_id: be_i64(buf, 43),
            producer_epoch: be_i16(buf, 51),
            base_sequence: be_i32(buf, 53),
            record_count: be_i32(buf, 57),
        };
        header.check()?;
        Ok(header)
    }

    fn check(&self) -> Result<(), RecordError> {
        if self.magic != MAGIC {
            return Err(RecordError::UnsupportedMagic(self.magic));
        }
        if (self.batch_length as i64) < (HEADER_LEN - LOG_OVERHEAD) as i64 {
            return Err(RecordError::Malformed {
                field: "batch_length",
                reason: format!(
                    "{} is shorter than the header ({} bytes)",
                    self.batch_length,
                    HEADER_LEN - LOG_OVERHEAD
                ),
            });
        }
        if self.base_offset < 0 {
            return Err(RecordError::Malformed {
                field: "base_offset",
                reason: format!("negative base offset {}", self.base_offset),
            });
        }
        if self.record_count < 0 || self.last_offset_delta < 0 {
            return Err(RecordError::Malformed {
                field: "record_count",
                reason: format!(
                    "record_count {} / last_offset_delta {} must not be negative",
                    self.record_count, self.last_offset_delta
                ),
            });
        }
        self.compression()?;
        Ok(())
    }

    /// Total size of the batch on disk, header included.
    pub fn total_size(&self) -> usize {
        self.batch_length as usize + LOG_OVERHEAD
    }

    /// Offset of the last record (`base_offset + last_offset_delta`).
    pub fn last_offset(&self) -> i64 {
        self.base_offset + i64::from(self.last_offset_delta)
    }

    /// Offset right after the batch.
    pub fn next_offset(&self) -> i64 {
        self.last_offset() + 1
    }

    /// Compression codec of the records block.
    pub fn compression(&self) -> Result<Compression, RecordError> {
        Compression::from_attribute(self.attributes & ATTR_COMPRESSION_MASK)
    }

    /// True when timestamps were set by the broker (LogAppendTime).
    pub fn is_log_append_time(&self) -> bool {
        self.attributes & ATTR_TIMESTAMP_TYPE != 0
    }

    /// True for batches written inside a transaction.
    pub fn is_transactional(&self) -> bool {
        self.attributes & ATTR_TRANSACTIONAL != 0
    }

    /// True for control batches (transaction markers).
    pub fn is_control(&self) -> bool {
        self.attributes & ATTR_CONTROL != 0
    }

    /// Writes the header into the first [`HEADER_LEN`] bytes of `out` (CRC as stored).
    pub fn write(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&self.base_offset.to_be_bytes());
        out[8..12].copy_from_slice(&self.batch_length.to_be_bytes());
        out[12..16].copy_from_slice(&self.partition_leader_epoch.to_be_bytes());
        out[16] = self.magic as u8;
        out[17..21].copy_from_slice(&self.crc.to_be_bytes());
        out[21..23].copy_from_slice(&self.attributes.to_be_bytes());
        out[23..27].copy_from_slice(&self.last_offset_delta.to_be_bytes());
        out[27..35].copy_from_slice(&self.base_timestamp.to_be_bytes());
        out[35..43].copy_from_slice(&self.max_timestamp.to_be_bytes());
        out[43..51].copy_from_slice(&self.producer_id.to_be_bytes());
        out[51..53].copy_from_slice(&self.producer_epoch.to_be_bytes());
        out[53..57].copy_from_slice(&self.base_sequence.to_be_bytes());
        out[57..61].copy_from_slice(&self.record_count.to_be_bytes());
    }
}

/// Reads only the total size of the batch starting at `buf` (needs 12 bytes).
///
/// Used by scanners that must know how far to read before the full header is there.
pub fn peek_total_size(buf: &[u8]) -> Option<usize> {
    if buf.len() < LOG_OVERHEAD {
        return None;
    }
    let len = be_i32(buf, 8);
    (len >= 0).then(|| len as usize + LOG_OVERHEAD)
}

/// Rewrites the base offset of the batch at the start of `batch` (outside the CRC).
pub fn set_base_offset(batch: &mut [u8], base_offset: i64) {
    batch[0..8].copy_from_slice(&base_offset.to_be_bytes());
}

/// Rewrites the partition leader epoch of the batch at the start of `batch` (outside the CRC).
pub fn set_partition_leader_epoch(batch: &mut [u8], epoch: i32) {
    batch[12..16].copy_from_slice(&epoch.to_be_bytes());
}

/// CRC32C of a batch's CRC'd region (`batch[21..]`).
pub fn compute_crc(batch: &[u8]) -> u32 {
    crc32c::crc32c(&batch[CRC_START..])
}

/// A complete batch borrowed from a buffer: header plus exactly `total_size` bytes.
#[derive(Debug, Clone, Copy)]
pub struct RecordBatch<'a> {
    header: BatchHeader,
    bytes: &'a [u8],
}

impl<'a> RecordBatch<'a> {
    /// Splits the first complete batch off `buf`, returning it and the rest.
    ///
    /// Fails with [`RecordError::Truncated`] when `buf` holds only part of the batch, and
    /// with a format error when the header is invalid. The CRC is not checked here; call
    /// [`RecordBatch::verify_crc`] or [`RecordBatch::validate`].
    pub fn parse(buf: &'a [u8]) -> Result<(Self, &'a [u8]), RecordError> {
        let header = BatchHeader::parse(buf)?;
        let size = header.total_size();
        if buf.len() < size {
            return Err(RecordError::Truncated {
                needed: size,
                available: buf.len(),
            });
        }
        let (bytes, rest) = buf.split_at(size);
        Ok((Self { header, bytes }, rest))
    }

    /// The decoded header.
    pub fn header(&self) -> &BatchHeader {
        &self.header
    }

    /// The whole batch, header included.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// CRC32C recomputed over the batch.
    pub fn computed_crc(&self) -> u32 {
        compute_crc(self.bytes)
    }

    /// Fails with [`RecordError::CrcMismatch`] unless the stored CRC matches the bytes.
    pub fn verify_crc(&self) -> Result<(), RecordError> {
        let computed = self.computed_crc();
        if computed != self.header.crc {
            return Err(RecordError::CrcMismatch {
                stored: self.header.crc,
                computed,
            });
        }
        Ok(())
    }

    /// Checks the CRC, then decodes every record and checks that the count and the offset
    /// deltas agree with the header. `max_uncompressed_bytes` bounds decompression.
    /// Returns the size of the records block after decompression.
    pub fn validate(&self, max_uncompressed_bytes: usize) -> Result<usize, RecordError> {
        self.verify_crc()?;
        self.for_each_record(max_uncompressed_bytes, |_| Ok(()))
    }

    /// The records block, decompressed when the batch is compressed.
    pub fn records_block(
        &self,
        max_uncompressed_bytes: usize,
    ) -> Result<std::borrow::Cow<'a, [u8]>, RecordError> {
        let raw = &self.bytes[HEADER_LEN..];
        match self.header.compression()? {
            Compression::None => Ok(std::borrow::Cow::Borrowed(raw)),
            codec => Ok(std::borrow::Cow::Owned(
                codec.decompress(raw, max_uncompressed_bytes)?,
            )),
        }
    }

    /// Decodes every record, in order, with absolute offsets.
    pub fn records(&self, max_uncompressed_bytes: usize) -> Result<Vec<Record>, RecordError> {
        let mut out = Vec::with_capacity(self.header.record_count.clamp(0, 4096) as usize);
        self.for_each_record(max_uncompressed_bytes, |r| {
            out.push(r.to_record());
            Ok(())
        })?;
        Ok(out)
    }

    /// Decodes every record in place, in order, and hands each view to `visit`. Checks
    /// that the count and offset deltas agree with the header.
    ///
    /// A compressed block is decoded as a stream with a hard cap of
    /// `max_uncompressed_bytes` decompressed bytes (see [`Compression::decoder`]): only
    /// the record being decoded is held in memory, so validating a decompression bomb
    /// costs at most the cap, never its expanded size. Returns the decompressed size of
    /// the records block (the stored size when uncompressed).
    pub fn for_each_record(
        &self,
        max_uncompressed_bytes: usize,
        mut visit: impl FnMut(RecordView<'_>) -> Result<(), RecordError>,
    ) -> Result<usize, RecordError> {
        let raw = &self.bytes[HEADER_LEN..];
        let codec = self.header.compression()?;
        let mut records = RecordChecker::new(&self.header);
        if codec == Compression::None {
            let mut rest: &[u8] = raw;
            while !records.done() {
                let (record, remaining) =
                    RecordView::decode(rest, self.header.base_offset, self.header.base_timestamp)?;
                records.check(&record)?;
                rest = remaining;
                visit(record)?;
            }
            return records.finish(rest.len()).map(|()| raw.len());
        }
        let mut decoder = codec.decoder(raw, max_uncompressed_bytes)?;
        let mut buf: Vec<u8> = Vec::new();
        let mut start = 0usize;
        let mut at_end = false;
        while !records.done() {
            // Read until the buffer holds the whole next record (or the block ends).
            while !at_end && !holds_whole_record(&buf[start..]) {
                if start > 0 {
                    buf.drain(..start);
                    start = 0;
                }
                at_end = decoder.read_some(&mut buf, max_uncompressed_bytes, READ_CHUNK)? == 0;
            }
            let (record, remaining) = RecordView::decode(
                &buf[start..],
                self.header.base_offset,
                self.header.base_timestamp,
            )?;
            records.check(&record)?;
            start = buf.len() - remaining.len();
            visit(record)?;
        }
        let mut left = buf.len() - start;
        if left == 0 && !at_end {
            left = decoder.read_some(&mut buf, max_uncompressed_bytes, READ_CHUNK)?;
        }
        records.finish(left).map(|()| decoder.produced())
    }
}

/// True when `buf` starts with a complete record (its varint length and that many bytes),
/// or with bytes that can never become one (the decoder then reports the error).
fn holds_whole_record(buf: &[u8]) -> bool {
    let mut reader = super::varint::Reader::new(buf);
    match reader.varint("record.length") {
        Ok(length) if length >= 0 => buf.len() - reader.position() >= length as usize,
        Ok(_) => true,
        // Five bytes that do not end a varint will not end one later either.
        Err(_) => buf.len() >= 5,
    }
}

/// Checks the records of a batch against its header as they are decoded.
struct RecordChecker<'h> {
    header: &'h BatchHeader,
    index: i32,
    last_delta: i64,
}

impl<'h> RecordChecker<'h> {
    fn new(header: &'h BatchHeader) -> Self {
        Self {
            header,
            index: 0,
            last_delta: -1,
        }
    }

    fn done(&self) -> bool {
        self.index >= self.header.record_count
    }

    fn check(&mut self, record: &RecordView<'_>) -> Result<(), RecordError> {
        let h = self.header;
        let delta = record.offset - h.base_offset;
        if delta <= self.last_delta || delta > i64::from(h.last_offset_delta) {
            return Err(RecordError::Malformed {
                field: "offset_delta",
                reason: format!(
                    "record {} has offset delta {delta}, not increasing within 0..={}",
                    self.index, h.last_offset_delta
                ),
            });
        }
        self.last_delta = delta;
        self.index += 1;
        Ok(())
    }

    fn finish(&self, bytes_left: usize) -> Result<(), RecordError> {
        if bytes_left != 0 {
            return Err(RecordError::Malformed {
                field: "record_count",
                reason: format!(
                    "bytes left after the {} records the header announces",
                    self.header.record_count
                ),
            });
        }
        Ok(())
    }
}

/// Iterates over the complete batches of a buffer, stopping at the first error.
pub struct BatchIter<'a> {
    rest: &'a [u8],
    failed: bool,
}

impl<'a> BatchIter<'a> {
    /// Iterates over `buf`, which should hold whole batches back to back.
    pub fn new(buf: &'a [u8]) -> Self {
        Self {
            rest: buf,
            failed: false,
        }
    }

    /// Bytes not yet consumed (after an error: from the failing batch on).
    pub fn remaining(&self) -> &'a [u8] {
        self.rest
    }
}

impl<'a> Iterator for BatchIter<'a> {
    type Item = Result<RecordBatch<'a>, RecordError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() || self.failed {
            return None;
        }
        match RecordBatch::parse(self.rest) {
            Ok((batch, rest)) => {
                self.rest = rest;
                Some(Ok(batch))
            }
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

/// Decodes every record of `buf` (whole batches back to back, as a fetch returns them):
/// each batch's CRC is checked and control batches are skipped.
///
/// `max_uncompressed_bytes` caps the decompressed bytes of **all** compressed batches
/// together (each batch gets what the ones before it left), so one call never inflates
/// more than that, however many small bombs `buf` holds. Uncompressed batches are not
/// counted: their records are no larger than `buf` itself.
pub fn decode_data_records(
    buf: &[u8],
    max_uncompressed_bytes: usize,
) -> Result<Vec<super::Record>, RecordError> {
    decode_data_records_with(buf, max_uncompressed_bytes, |_| false, |r, _| r.to_record())
}

/// [`decode_data_records`] for a read-committed reader: the batches of `aborted`
/// transactions are left out too.
pub fn decode_committed_records(
    buf: &[u8],
    max_uncompressed_bytes: usize,
    aborted: &super::control::AbortedRanges,
) -> Result<Vec<super::Record>, RecordError> {
    decode_data_records_with(
        buf,
        max_uncompressed_bytes,
        |h| aborted.is_aborted(h),
        |r, _| r.to_record(),
    )
}

/// [`decode_data_records`] without copying: records of uncompressed batches share
/// `buf`'s memory (compressed ones are decoded into their own), so a record kept alive
/// keeps the whole of `buf` alive, as a fetch buffer in librdkafka does.
pub fn decode_data_records_shared(
    buf: &Bytes,
    max_uncompressed_bytes: usize,
) -> Result<Vec<super::Record>, RecordError> {
    decode_shared_records_skipping(buf, max_uncompressed_bytes, |_| false)
}

/// [`decode_data_records_shared`] leaving out the batches `skip` names (a read-committed
/// reader's aborted transactions).
pub fn decode_shared_records_skipping(
    buf: &Bytes,
    max_uncompressed_bytes: usize,
    skip: impl Fn(&BatchHeader) -> bool,
) -> Result<Vec<super::Record>, RecordError> {
    decode_data_records_with(buf, max_uncompressed_bytes, skip, |r, compressed| {
        if compressed {
            r.to_record()
        } else {
            r.to_shared_record(buf)
        }
    })
}

fn decode_data_records_with(
    buf: &[u8],
    max_uncompressed_bytes: usize,
    skip: impl Fn(&BatchHeader) -> bool,
    record: impl Fn(&RecordView<'_>, bool) -> Record,
) -> Result<Vec<super::Record>, RecordError> {
    // Sized once from the headers: growing a vector of thousands of records by doubling
    // copied it several times over, into freshly faulted memory (docs/performance.md).
    // Capped by what the bytes can hold (a stored record takes at least 7 bytes), so
    // headers claiming more cannot make it large.
    let declared: usize = BatchIter::new(buf)
        .map_while(Result::ok)
        .map(|b| b.header().record_count.clamp(0, 4096) as usize)
        .sum();
    let mut out = Vec::with_capacity(declared.min(buf.len() / 7));
    let mut budget = max_uncompressed_bytes;
    for batch in BatchIter::new(buf) {
        let batch = batch?;
        batch.verify_crc()?;
        if batch.header().is_control() || skip(batch.header()) {
            continue;
        }
        let compressed = batch.header().compression()? != Compression::None;
        out.reserve(batch.header().record_count.clamp(0, 4096) as usize);
        let used = batch.for_each_record(budget, |r| {
            out.push(record(&r, compressed));
            Ok(())
        })?;
        if compressed {
            budget -= used;
        }
    }
    Ok(out)
}
