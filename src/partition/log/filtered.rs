//! Filtered reads: only the records that pass a [`RecordFilter`], plus the offset to go on
//! from, so a consumer never reads a skipped range twice and its position (and committed
//! offset, and lag) moves past records it does not want.
//!
//! - A tag expression is served from the segments' tag indexes: the scan reads 12-byte
//!   entries, and only batches holding a record whose tag hash matches are read from the
//!   log, CRC-checked and decoded; each such record is re-checked exactly (hashes collide).
//! - A SQL expression needs every record's properties: batches are read in order and
//!   decoded. The work per read is bounded, so a filter that matches little returns an
//!   empty answer with a later offset rather than scanning the whole log at once.
//!
//! Matching records are returned as record batches: a batch whose records all pass is sent
//! as stored; otherwise its passing records are re-encoded (uncompressed, keeping their
//! offsets, timestamps, keys, values and headers) into a batch of their own.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;

use crate::filter::RecordFilter;
use crate::record::{keep_records, BatchIter, RecordBatch};
use crate::segment::{read_header_at, read_vec_at_most};
use crate::types::Offset;

use super::{FetchData, Isolation, LogError, PartitionLog, ReadOptions, READ_ATTEMPTS};

/// Most tag-index entries one read scans (12 MiB of index).
const TAG_SCAN_ENTRIES_MAX: usize = 1 << 20;
/// Bytes of log one filtered read may read beyond `max_bytes` of output: reading stops
/// at `max(max_bytes * 4, this)`.
const READ_BUDGET_MIN: usize = 16 << 20;
/// Bytes a SQL read asks for at a time.
const SQL_CHUNK_BYTES: usize = 1 << 20;

/// Batches of one segment that hold candidate records, as planned under the lock.
struct Plan {
    file: Arc<std::fs::File>,
    path: std::path::PathBuf,
    size: u64,
    /// (position, offset of its first candidate), in log order, each position once.
    batches: Vec<(u64, u64)>,
}

impl PartitionLog {
    /// Reads the records at or after `offset` that pass `filter`, up to about `max_bytes`
    /// of them (at least one batch when one is found), never past the `isolation` bound.
    /// [`FetchData::next_offset`] says where to continue.
    pub fn read_filtered(
        &self,
        offset: Offset,
        max_bytes: usize,
        isolation: Isolation,
        filter: &RecordFilter,
    ) -> Result<FetchData, LogError> {
        match filter.tag_hashes() {
            Some(hashes) => {
                for _ in 0..READ_ATTEMPTS {
                    let generation = self.generation.load(Ordering::Acquire);
                    let read =
                        self.read_by_tag_index(offset.0, max_bytes, isolation, filter, &hashes)?;
                    if self.generation.load(Ordering::Acquire) == generation {
                        return Ok(read);
                    }
                }
                // Truncations kept racing with us: answer with nothing, going nowhere.
                let data = self.read_with(offset, 0, isolation, ReadOptions::default())?;
                Ok(FetchData {
                    records: Bytes::new(),
                    next_offset: Some(offset),
                    ..data
                })
            }
            None => self.read_by_scan(offset.0, max_bytes, isolation, filter),
        }
    }

    fn read_by_tag_index(
        &self,
        offset: u64,
        max_bytes: usize,
        isolation: Isolation,
        filter: &RecordFilter,
        hashes: &std::collections::BTreeSet<u32>,
    ) -> Result<FetchData, LogError> {
        let (plans, scan_end, data) = {
            let state = self.state.read();
            self.check_online(&state)?;
            let (data, bound) = state.plan_read(offset, isolation)?;
            let mut plans = Vec::new();
            let mut scan_end = bound.max(offset);
            let mut scanned = 0usize;
            let first_base = state
                .segments
                .range(..=offset)
                .next_back()
                .map_or(offset, |(&b, _)| b);
            'segments: for (_, segment) in state.segments.range(first_base..bound.max(first_base)) {
                let mut plan: Option<Plan> = None;
                for entry in segment.tag_entries_from(offset) {
                    if entry.offset >= bound {
                        break;
                    }
                    if scanned == TAG_SCAN_ENTRIES_MAX {
                        scan_end = entry.offset;
                        if let Some(plan) = plan.take() {
                            plans.push(plan);
                        }
                        break 'segments;
                    }
                    scanned += 1;
                    if !hashes.contains(&entry.hash) {
                        continue;
                    }
                    let position = u64::from(entry.position);
                    let plan = match &mut plan {
                        Some(plan) => plan,
                        None => plan.insert(Plan {
                            file: segment.log_handle()?,
                            path: segment.log_path().to_path_buf(),
                            size: segment.size(),
                            batches: Vec::new(),
                        }),
                    };
                    if plan.batches.last().is_none_or(|&(p, _)| p != position) {
                        plan.batches.push((position, entry.offset));
                    }
                }
                if let Some(plan) = plan {
                    plans.push(plan);
                }
            }
            (plans, scan_end, data)
        };
        let mut out = Vec::new();
        let mut bytes_read = 0u64;
        let budget = max_bytes.saturating_mul(4).max(READ_BUDGET_MIN) as u64;
        let mut next_offset = scan_end;
        'plans: for plan in &plans {
            for &(position, first_candidate) in &plan.batches {
                // The first candidate batch is always read, so every read makes progress.
                if bytes_read >= budget || (!out.is_empty() && out.len() >= max_bytes) {
                    next_offset = first_candidate;
                    break 'plans;
                }
                let header = read_header_at(&plan.file, plan.size, position).map_err(|e| {
                    self.filtered_read_error(&plan.path, position, offset, e.to_string())
                })?;
                let Some(header) = header else {
                    // The segment shrank under us: a truncation, which the caller retries.
                    return Ok(FetchData {
                        next_offset: Some(Offset(offset)),
                        ..data
                    });
                };
                let bytes = read_vec_at_most(&plan.file, position, header.total_size(), false)
                    .map_err(|e| LogError::io(&plan.path, e))?;
                bytes_read += bytes.len() as u64;
                let (batch, _) = RecordBatch::parse(&bytes).map_err(|e| {
                    self.filtered_read_error(&plan.path, position, offset, e.to_string())
                })?;
                batch.verify_crc().map_err(|e| {
                    self.filtered_read_error(&plan.path, position, offset, e.to_string())
                })?;
                keep_passing(&batch, offset, scan_end, filter, &mut out)
                    .map_err(|e| self.filtered_read_error(&plan.path, position, offset, e))?;
            }
        }
        metrics::counter!("tidelog_filtered_read_bytes_total").increment(bytes_read);
        Ok(FetchData {
            records: Bytes::from(out),
            next_offset: Some(Offset(next_offset)),
            ..data
        })
    }

    fn read_by_scan(
        &self,
        offset: u64,
        max_bytes: usize,
        isolation: Isolation,
        filter: &RecordFilter,
    ) -> Result<FetchData, LogError> {
        let budget = max_bytes.saturating_mul(4).max(READ_BUDGET_MIN) as u64;
        let mut out = Vec::new();
        let mut at = offset;
        let mut bytes_read = 0u64;
        let mut first: Option<FetchData> = None;
        let mut aborted = Vec::new();
        loop {
            let data = self.read_with(
                Offset(at),
                SQL_CHUNK_BYTES,
                isolation,
                ReadOptions::default(),
            )?;
            if first.is_none() {
                first = Some(FetchData {
                    records: Bytes::new(),
                    ..data.clone()
                });
            }
            aborted.extend(data.aborted_transactions.iter().copied());
            if data.records.is_empty() {
                break;
            }
            bytes_read += data.records.len() as u64;
            for batch in BatchIter::new(&data.records) {
                let batch = batch.map_err(|e| LogError::Corrupt {
                    path: self.dir.clone(),
                    reason: format!("a batch read at offset {at}: {e}"),
                })?;
                let end = batch.header().next_offset() as u64;
                keep_passing(&batch, at, u64::MAX, filter, &mut out).map_err(|reason| {
                    LogError::Corrupt {
                        path: self.dir.clone(),
                        reason: format!("a batch read at offset {at}: {reason}"),
                    }
                })?;
                at = end;
            }
            if out.len() >= max_bytes || bytes_read >= budget {
                break;
            }
        }
        let data = first.expect("read at least once");
        metrics::counter!("tidelog_filtered_read_bytes_total").increment(bytes_read);
        // Every chunk's aborted transactions, each once (ordered by marker).
        aborted.sort_by_key(|a| (a.last_offset, a.producer_id));
        aborted.dedup();
        Ok(FetchData {
            records: Bytes::from(out),
            next_offset: Some(Offset(at)),
            aborted_transactions: aborted,
            ..data
        })
    }

    fn filtered_read_error(
        &self,
        path: &std::path::Path,
        position: u64,
        offset: u64,
        reason: String,
    ) -> LogError {
        let reason = format!("batch at position {position}: {reason}");
        // Not recorded as log damage: a truncation racing with the read, or a tag-index
        // entry that disagrees with the log, look the same here; the caller retries on a
        // generation change, and a plain read of the range finds real damage.
        let _ = offset;
        LogError::Corrupt {
            path: path.to_path_buf(),
            reason,
        }
    }
}

/// Appends the records of `batch` in `[from, until)` that pass `filter` ([`keep_records`]).
fn keep_passing(
    batch: &RecordBatch<'_>,
    from: u64,
    until: u64,
    filter: &RecordFilter,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    keep_records(
        batch,
        |r| {
            let offset = r.offset as u64;
            offset >= from && offset < until && filter.matches(r)
        },
        out,
    )
    .map(|_| ())
}
