//! `tidelog dump-log FILE...`: decode segment files, like Kafka's `kafka-dump-log.sh`.
//!
//! - `.log`: every batch with its header fields and whether its CRC is valid;
//!   `--print-data` adds the records. A batch whose CRC fails but that can be framed is
//!   printed with `crc_valid: false`. Bytes that cannot be framed as a batch are reported
//!   with the skipped range, and the dump resynchronizes on the next position where a
//!   whole batch with a valid CRC starts, so everything readable after damage is listed.
//! - `.index` / `.timeindex`: every entry, each checked against the segment's `.log`
//!   when it is beside the index.
//! - `.tagindex`: every entry with the tag the log holds at its offset, and every tagged
//!   record of the log that has no entry (the index must hold exactly the tagged records).
//! - `.txnindex`: every aborted transaction (producer id, first offset, marker offset,
//!   last stable offset); an entry that does not decode is reported.
//!
//! Exits non-zero when any file is damaged, after printing everything readable.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use base64::Engine;

use crate::partition::txn_index::{decode_entry, TXN_ENTRY_SIZE, TXN_INDEX_SUFFIX};
use serde_json::{json, Map, Value};

use crate::partition::MAX_UNCOMPRESSED_BATCH_BYTES;
use crate::record::tag::{tag_hash, tag_of};
use crate::record::{BatchHeader, Record, RecordBatch};
use crate::segment::{
    find_next_valid_batch, read_header_at, BatchScanner, ScanError, ScannedBatch, INDEX_SUFFIX,
    LOG_SUFFIX, OFFSET_ENTRY_SIZE, TAG_ENTRY_SIZE, TAG_INDEX_SUFFIX, TIME_ENTRY_SIZE,
    TIME_INDEX_SUFFIX,
};

use super::{CliError, OutputFormat};

/// Arguments of `tidelog dump-log`.
#[derive(Debug, clap::Args)]
pub struct DumpLogArgs {
    /// Segment files to decode: `.log`, `.index`, `.timeindex` or `.tagindex`.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Also decode and print every record of each batch.
    #[arg(long)]
    pub print_data: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

/// Runs the subcommand; `Err` when any file was damaged or unreadable.
pub fn run(args: &DumpLogArgs) -> Result<(), CliError> {
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let mut problems = Vec::new();
    for path in &args.files {
        let kind = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let result = match kind {
            LOG_SUFFIX => dump_log_file(path, args, &mut out),
            INDEX_SUFFIX | TIME_INDEX_SUFFIX => dump_index_file(path, kind, args.output, &mut out),
            TAG_INDEX_SUFFIX => dump_tag_index_file(path, args.output, &mut out),
            TXN_INDEX_SUFFIX => dump_txn_index_file(path, args.output, &mut out),
            _ => Err(CliError::new(
                "INVALID_ARGUMENT",
                format!(
                    "{}: not a .log, .index, .timeindex, .tagindex or .txnindex file",
                    path.display()
                ),
            )),
        };
        match result {
            Ok(found) => problems.extend(found),
            Err(e) => problems.push(e),
        }
    }
    out.flush()
        .map_err(|e| CliError::new("IO_ERROR", e.to_string()))?;
    match problems.len() {
        0 => Ok(()),
        1 => Err(problems.remove(0)),
        n => Err(CliError::new(
            problems[0].code,
            format!("{} (and {} more problems)", problems[0].message, n - 1),
        )),
    }
}

fn write_line(out: &mut impl Write, line: &str) -> Result<(), CliError> {
    writeln!(out, "{line}").map_err(|e| CliError::new("IO_ERROR", e.to_string()))
}

fn open(path: &Path) -> Result<File, CliError> {
    File::open(path).map_err(|e| {
        CliError::new(
            "INVALID_ARGUMENT",
            format!("cannot open {}: {e}", path.display()),
        )
    })
}

/// Base offset from a segment file name (`00000000000000000042.log` -> 42).
fn base_offset_of(path: &Path) -> Result<u64, CliError> {
    path.file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            CliError::new(
                "INVALID_ARGUMENT",
                format!(
                    "{}: file name is not a 20-digit base offset",
                    path.display()
                ),
            )
        })
}

/// Renders bytes as UTF-8 text when valid, else `{"base64": "..."}`; `None` as null.
pub fn bytes_json(bytes: Option<&[u8]>) -> Value {
    match bytes {
        None => Value::Null,
        Some(b) => match std::str::from_utf8(b) {
            Ok(s) => Value::String(s.to_owned()),
            Err(_) => json!({ "base64": base64::engine::general_purpose::STANDARD.encode(b) }),
        },
    }
}

fn bytes_text(bytes: Option<&[u8]>) -> String {
    match bytes_json(bytes) {
        Value::String(s) => s,
        other => other.to_string(),
    }
}

/// One record as JSON, in the `dump-log` / `consume` shape.
pub fn record_json(record: &Record) -> Value {
    let headers: Map<String, Value> = record
        .headers
        .iter()
        .map(|h| (h.key.clone(), bytes_json(h.value.as_deref())))
        .collect();
    json!({
        "offset": record.offset,
        "timestamp": record.timestamp,
        "key": bytes_json(record.key.as_deref()),
        "value": bytes_json(record.value.as_deref()),
        "headers": headers,
    })
}

fn header_json(position: u64, h: &BatchHeader, crc_valid: bool) -> Map<String, Value> {
    let compression = h.compression().map_or("unknown", |c| c.name());
    let value = json!({
        "base_offset": h.base_offset,
        "last_offset": h.last_offset(),
        "count": h.record_count,
        "position": position,
        "size": h.total_size(),
        "leader_epoch": h.partition_leader_epoch,
        "magic": h.magic,
        "crc": h.crc,
        "crc_valid": crc_valid,
        "compression": compression,
        "base_timestamp": h.base_timestamp,
        "max_timestamp": h.max_timestamp,
        "producer_id": h.producer_id,
        "producer_epoch": h.producer_epoch,
        "base_sequence": h.base_sequence,
        "transactional": h.is_transactional(),
        "control": h.is_control(),
    });
    match value {
        Value::Object(map) => map,
        _ => unreachable!("json! of an object literal is an object"),
    }
}

fn dump_log_file(
    path: &Path,
    args: &DumpLogArgs,
    out: &mut impl Write,
) -> Result<Vec<CliError>, CliError> {
    let file = open(path)?;
    let size = file
        .metadata()
        .map_err(|e| CliError::new("IO_ERROR", format!("{}: {e}", path.display())))?
        .len();
    if args.output == OutputFormat::Table {
        write_line(out, &format!("Dumping {}", path.display()))?;
    }
    let mut problems = Vec::new();
    let mut scanner = BatchScanner::new(&file, 0, size, u64::MAX);
    loop {
        match scanner.next_batch() {
            Ok(Some(scanned)) => {
                if let Some(problem) = print_batch(path, &scanned, args, out)? {
                    problems.push(problem);
                }
            }
            Ok(None) => break,
            Err(e) => {
                let position = e.position();
                // Resynchronize: the next position where a whole batch with a valid CRC
                // starts. Everything in between is reported as skipped.
                let resume = match &e {
                    ScanError::Io { .. } => None,
                    _ => find_next_valid_batch(&file, position + 1, size, 0, u64::MAX, u64::MAX)
                        .map_err(|e| CliError::new("IO_ERROR", format!("{}: {e}", path.display())))?
                        .map(|(p, _)| p),
                };
                let skipped_end = resume.unwrap_or(size);
                let message = format!(
                    "{}: {e}; skipped bytes {position}..{skipped_end}",
                    path.display()
                );
                if args.output == OutputFormat::Json {
                    write_line(
                        out,
                        &json!({
                            "position": position,
                            "error": e.to_string(),
                            "skipped_bytes": skipped_end - position,
                            "resume_position": resume,
                        })
                        .to_string(),
                    )?;
                } else {
                    write_line(
                        out,
                        &format!(
                            "position: {position} error: {e} skipped: {position}..{skipped_end} ({} bytes){}",
                            skipped_end - position,
                            if resume.is_some() { ", resuming at the next valid batch" } else { "" }
                        ),
                    )?;
                }
                problems.push(CliError::new("CORRUPT_MESSAGE", message));
                match resume {
                    Some(next) => scanner = BatchScanner::new(&file, next, size, u64::MAX),
                    None => break,
                }
            }
        }
    }
    Ok(problems)
}

fn print_batch(
    path: &Path,
    scanned: &ScannedBatch<'_>,
    args: &DumpLogArgs,
    out: &mut impl Write,
) -> Result<Option<CliError>, CliError> {
    let batch: &RecordBatch<'_> = &scanned.batch;
    let h = scanned.header();
    let crc_valid = batch.verify_crc().is_ok();
    let mut problem = (!crc_valid).then(|| {
        CliError::new(
            "CORRUPT_MESSAGE",
            format!(
                "{}: batch at position {} has an invalid CRC",
                path.display(),
                scanned.position
            ),
        )
    });
    let records = args
        .print_data
        .then(|| batch.records(MAX_UNCOMPRESSED_BATCH_BYTES));
    if let Some(Err(e)) = &records {
        problem.get_or_insert_with(|| {
            CliError::new(
                "CORRUPT_MESSAGE",
                format!(
                    "{}: batch at position {}: {e}",
                    path.display(),
                    scanned.position
                ),
            )
        });
    }
    match args.output {
        OutputFormat::Json => {
            let mut map = header_json(scanned.position, h, crc_valid);
            match records {
                Some(Ok(records)) => {
                    map.insert(
                        "records".into(),
                        Value::Array(records.iter().map(record_json).collect()),
                    );
                }
                Some(Err(e)) => {
                    map.insert("records_error".into(), Value::String(e.to_string()));
                }
                None => {}
            }
            write_line(out, &Value::Object(map).to_string())?;
        }
        OutputFormat::Table => {
            write_line(
                out,
                &format!(
                    "baseOffset: {} lastOffset: {} count: {} baseSequence: {} lastSequence: {} producerId: {} producerEpoch: {} partitionLeaderEpoch: {} isTransactional: {} isControl: {} position: {} CreateTime: {} size: {} magic: {} compresscodec: {} crc: {} isvalid: {}",
                    h.base_offset,
                    h.last_offset(),
                    h.record_count,
                    h.base_sequence,
                    if h.base_sequence < 0 { -1 } else { h.base_sequence.wrapping_add(h.last_offset_delta) },
                    h.producer_id,
                    h.producer_epoch,
                    h.partition_leader_epoch,
                    h.is_transactional(),
                    h.is_control(),
                    scanned.position,
                    h.max_timestamp,
                    h.total_size(),
                    h.magic,
                    h.compression().map_or("unknown", |c| c.name()),
                    h.crc,
                    crc_valid
                ),
            )?;
            match records {
                Some(Ok(records)) => {
                    for r in &records {
                        let headers: Vec<String> = r
                            .headers
                            .iter()
                            .map(|x| format!("{}:{}", x.key, bytes_text(x.value.as_deref())))
                            .collect();
                        write_line(
                            out,
                            &format!(
                                "| offset: {} CreateTime: {} keySize: {} valueSize: {} key: {} payload: {} headers: [{}]",
                                r.offset,
                                r.timestamp,
                                r.key.as_ref().map_or(-1, |k| k.len() as i64),
                                r.value.as_ref().map_or(-1, |v| v.len() as i64),
                                bytes_text(r.key.as_deref()),
                                bytes_text(r.value.as_deref()),
                                headers.join(", ")
                            ),
                        )?;
                    }
                }
                Some(Err(e)) => write_line(out, &format!("| records cannot be decoded: {e}"))?,
                None => {}
            }
        }
    }
    Ok(problem)
}

fn dump_index_file(
    path: &Path,
    kind: &str,
    output: OutputFormat,
    out: &mut impl Write,
) -> Result<Vec<CliError>, CliError> {
    let base = base_offset_of(path)?;
    let bytes = read_index(path)?;
    let log_path = path.with_extension(LOG_SUFFIX);
    let log = File::open(&log_path).ok();
    let log_size = log
        .as_ref()
        .and_then(|f| f.metadata().ok())
        .map_or(0, |m| m.len());
    // All batch headers of the log, for checking time-index offsets.
    let mut batches = Vec::new();
    if let Some(log) = &log {
        let mut scanner = BatchScanner::new(log, 0, log_size, u64::MAX);
        while let Ok(Some(b)) = scanner.next_batch() {
            batches.push(*b.header());
        }
    }
    if output == OutputFormat::Table {
        write_line(out, &format!("Dumping {}", path.display()))?;
    }
    let entry_size = if kind == INDEX_SUFFIX {
        OFFSET_ENTRY_SIZE
    } else {
        TIME_ENTRY_SIZE
    };
    let mut mismatches = 0usize;
    let mut previous: Option<(u64, i64)> = None;
    // An active segment's index is preallocated: slots past the written ones are zero
    // (a zero entry can only be the first: offsets strictly increase). List only the
    // written entries.
    let written = bytes
        .chunks_exact(entry_size)
        .enumerate()
        .position(|(slot, raw)| slot > 0 && raw.iter().all(|b| *b == 0))
        .unwrap_or(bytes.len() / entry_size);
    for (slot, raw) in bytes.chunks_exact(entry_size).take(written).enumerate() {
        let (fields, matches) = if kind == INDEX_SUFFIX {
            let offset =
                base + u64::from(u32::from_be_bytes(raw[0..4].try_into().expect("4 bytes")));
            let position = u64::from(u32::from_be_bytes(raw[4..8].try_into().expect("4 bytes")));
            let increasing = previous.is_none_or(|(o, p)| offset > o && position as i64 > p);
            previous = Some((offset, position as i64));
            let matches = log.as_ref().map(|l| {
                increasing
                    && read_header_at(l, log_size, position)
                        .ok()
                        .flatten()
                        .is_some_and(|h| h.base_offset as u64 == offset)
            });
            (
                json!({ "slot": slot, "offset": offset, "position": position }),
                matches,
            )
        } else {
            let timestamp = i64::from_be_bytes(raw[0..8].try_into().expect("8 bytes"));
            let offset =
                base + u64::from(u32::from_be_bytes(raw[8..12].try_into().expect("4 bytes")));
            let increasing = previous.is_none_or(|(o, t)| offset >= o && timestamp > t);
            previous = Some((offset, timestamp));
            let matches = log.as_ref().map(|_| {
                increasing
                    && batches.iter().any(|h| {
                        (h.base_offset as u64..=h.last_offset() as u64).contains(&offset)
                            && h.max_timestamp <= timestamp
                    })
            });
            (
                json!({ "slot": slot, "timestamp": timestamp, "offset": offset }),
                matches,
            )
        };
        if matches == Some(false) {
            mismatches += 1;
        }
        let mut map = match fields {
            Value::Object(map) => map,
            _ => unreachable!("object literal"),
        };
        if let Some(m) = matches {
            map.insert("matches_log".into(), Value::Bool(m));
        }
        print_entry(map, output, out)?;
    }
    let trailing = bytes.len() % entry_size;
    let mut problems = Vec::new();
    if mismatches > 0 {
        problems.push(CliError::new(
            "CORRUPT_INDEX",
            format!(
                "{}: {mismatches} entries do not match {} (a broker rebuilds such an index on startup)",
                path.display(),
                log_path.display()
            ),
        ));
    }
    if trailing != 0 {
        problems.push(CliError::new(
            "CORRUPT_INDEX",
            format!(
                "{}: {trailing} trailing bytes are not a whole entry",
                path.display()
            ),
        ));
    }
    if log.is_none() && output == OutputFormat::Table {
        write_line(
            out,
            &format!("({} not found: entries not checked)", log_path.display()),
        )?;
    }
    Ok(problems)
}

/// One tagged record as the log holds it: (position of its batch, tag hash, tag).
type LoggedTag = (u64, u32, String);

/// Dumps a `.txnindex`: every aborted transaction; entries that do not decode (or a
/// partial tail) are reported as damage.
fn dump_txn_index_file(
    path: &Path,
    output: OutputFormat,
    out: &mut impl Write,
) -> Result<Vec<CliError>, CliError> {
    let bytes = read_index(path)?;
    if output == OutputFormat::Table {
        write_line(out, &format!("Dumping {}", path.display()))?;
    }
    let mut problems = Vec::new();
    for (i, chunk) in bytes.chunks(TXN_ENTRY_SIZE).enumerate() {
        let position = i * TXN_ENTRY_SIZE;
        let Some(e) = decode_entry(chunk) else {
            problems.push(CliError::new(
                "CORRUPT_MESSAGE",
                format!(
                    "{}: entry at byte {position} ({} bytes) does not decode",
                    path.display(),
                    chunk.len()
                ),
            ));
            continue;
        };
        let line = match output {
            OutputFormat::Json => json!({
                "position": position,
                "producer_id": e.producer_id,
                "first_offset": e.first_offset,
                "last_offset": e.last_offset,
                "last_stable_offset": e.last_stable_offset,
            })
            .to_string(),
            OutputFormat::Table => format!(
                "producerId: {} firstOffset: {} lastOffset: {} lastStableOffset: {}",
                e.producer_id, e.first_offset, e.last_offset, e.last_stable_offset
            ),
        };
        write_line(out, &line)?;
    }
    Ok(problems)
}

/// Dumps a `.tagindex`: every entry with the tag the log holds at its offset, then any
/// tagged record of the log the index lacks. Both kinds of disagreement are reported.
fn dump_tag_index_file(
    path: &Path,
    output: OutputFormat,
    out: &mut impl Write,
) -> Result<Vec<CliError>, CliError> {
    let base = base_offset_of(path)?;
    let bytes = read_index(path)?;
    let log_path = path.with_extension(LOG_SUFFIX);
    // The tagged records of the log beside the index, by offset.
    let logged: Option<std::collections::BTreeMap<u64, LoggedTag>> =
        File::open(&log_path).ok().map(|log| {
            let size = log.metadata().map_or(0, |m| m.len());
            let mut found = std::collections::BTreeMap::new();
            let mut scanner = BatchScanner::new(&log, 0, size, u64::MAX);
            while let Ok(Some(b)) = scanner.next_batch() {
                let _ = b.batch.for_each_record(MAX_UNCOMPRESSED_BATCH_BYTES, |r| {
                    if let Some(tag) = tag_of(r.headers()) {
                        found.insert(r.offset as u64, (b.position, tag_hash(tag), tag.to_owned()));
                    }
                    Ok(())
                });
            }
            found
        });
    if output == OutputFormat::Table {
        write_line(out, &format!("Dumping {}", path.display()))?;
    }
    let mut mismatches = 0usize;
    let mut indexed = std::collections::BTreeSet::new();
    let mut previous: Option<u64> = None;
    for (slot, raw) in bytes.chunks_exact(TAG_ENTRY_SIZE).enumerate() {
        let word = |at: usize| u32::from_be_bytes(raw[at..at + 4].try_into().expect("4 bytes"));
        let (offset, position, hash) = (base + u64::from(word(0)), word(4), word(8));
        if hash == 0 {
            // The preallocated zeros of an active segment: no entry from here on.
            break;
        }
        let increasing = previous.is_none_or(|p| offset > p);
        previous = Some(offset);
        indexed.insert(offset);
        let mut map = Map::new();
        map.insert("slot".into(), json!(slot));
        map.insert("offset".into(), json!(offset));
        map.insert("position".into(), json!(position));
        map.insert("hash".into(), json!(format!("{hash:08x}")));
        if let Some(logged) = &logged {
            let at = logged.get(&offset);
            let matches =
                increasing && at.is_some_and(|(p, h, _)| *p == u64::from(position) && *h == hash);
            if let Some((_, _, tag)) = at {
                map.insert("tag".into(), json!(tag));
            }
            map.insert("matches_log".into(), Value::Bool(matches));
            mismatches += usize::from(!matches);
        }
        print_entry(map, output, out)?;
    }
    let mut problems = Vec::new();
    let missing: Vec<u64> = logged
        .iter()
        .flat_map(|l| l.keys())
        .filter(|o| !indexed.contains(o))
        .copied()
        .collect();
    for offset in &missing {
        let mut map = Map::new();
        map.insert("missing_offset".into(), json!(offset));
        if let Some((_, _, tag)) = logged.as_ref().and_then(|l| l.get(offset)) {
            map.insert("tag".into(), json!(tag));
        }
        print_entry(map, output, out)?;
    }
    if mismatches > 0 || !missing.is_empty() {
        problems.push(CliError::new(
            "CORRUPT_INDEX",
            format!(
                "{}: {mismatches} entries do not match {} and {} tagged records have no entry (a broker rebuilds such an index on startup)",
                path.display(),
                log_path.display(),
                missing.len()
            ),
        ));
    }
    if bytes.len() % TAG_ENTRY_SIZE != 0 {
        problems.push(CliError::new(
            "CORRUPT_INDEX",
            format!(
                "{}: {} trailing bytes are not a whole entry",
                path.display(),
                bytes.len() % TAG_ENTRY_SIZE
            ),
        ));
    }
    if logged.is_none() && output == OutputFormat::Table {
        write_line(
            out,
            &format!("({} not found: entries not checked)", log_path.display()),
        )?;
    }
    Ok(problems)
}

fn read_index(path: &Path) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|e| {
        CliError::new(
            "INVALID_ARGUMENT",
            format!("cannot read {}: {e}", path.display()),
        )
    })
}

/// Prints one index entry as a JSON object or a `key: value` line.
fn print_entry(
    map: Map<String, Value>,
    output: OutputFormat,
    out: &mut impl Write,
) -> Result<(), CliError> {
    match output {
        OutputFormat::Json => write_line(out, &Value::Object(map).to_string()),
        OutputFormat::Table => {
            let text: Vec<String> = map.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            write_line(out, &text.join(" "))
        }
    }
}
