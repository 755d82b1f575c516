//! Re-batching: the records of a stored batch that a predicate keeps, as one batch of
//! their own (filtered reads, push windows that end inside a batch).

use super::MAX_UNCOMPRESSED_BATCH_BYTES;
use super::{BatchBuilder, Compression, RecordBatch, RecordRef, RecordView};

/// Appends to `out` the records of `batch` that `keep` accepts and returns how many: the
/// batch as stored when it keeps them all, else a new uncompressed batch holding only
/// those records with their offsets, timestamps, keys, values and headers (and the
/// batch's leader epoch). `keep` is called twice per record and must answer the same.
pub fn keep_records(
    batch: &RecordBatch<'_>,
    mut keep: impl FnMut(&RecordView<'_>) -> bool,
    out: &mut Vec<u8>,
) -> Result<u32, String> {
    let h = *batch.header();
    let (mut kept, mut first_kept) = (0u32, None);
    batch
        .for_each_record(MAX_UNCOMPRESSED_BATCH_BYTES, |r| {
            if keep(&r) {
                kept += 1;
                first_kept.get_or_insert(r.offset);
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    let Some(base) = first_kept else {
        return Ok(0);
    };
    if i64::from(kept) == i64::from(h.record_count) {
        out.extend_from_slice(batch.as_bytes());
        return Ok(kept);
    }
    // The producer and transactional flag stay, so a read-committed consumer can still
    // tell the records of aborted transactions.
    let sequence = if h.producer_id >= 0 && h.base_sequence >= 0 {
        h.base_sequence
            .wrapping_add((base - h.base_offset) as i32)
            .max(0)
    } else {
        -1
    };
    let mut builder = BatchBuilder::new(Compression::None)
        .partition_leader_epoch(h.partition_leader_epoch)
        .producer(h.producer_id, h.producer_epoch, sequence)
        .transactional(h.is_transactional());
    batch
        .for_each_record(MAX_UNCOMPRESSED_BATCH_BYTES, |r| {
            if keep(&r) {
                let headers: Vec<(&str, Option<&[u8]>)> = r.headers().collect();
                builder.push_at(
                    (r.offset - base) as i32,
                    RecordRef {
                        timestamp: r.timestamp,
                        key: r.key,
                        value: r.value,
                        headers: &headers,
                    },
                );
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    out.extend_from_slice(&builder.build(base).map_err(|e| e.to_string())?);
    Ok(kept)
}
