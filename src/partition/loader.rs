//! Opening a partition directory: locking, cleanup, segment discovery, and either a clean
//! load or crash recovery.
//!
//! Rules (also in `docs/storage-format.md`):
//! 1. Make sure no other process has the directory open: take an exclusive lock on its
//!    own `.lock` ([`DirLock::Own`], tools and tests), or rely on the lock the caller holds
//!    on the whole data directory ([`DirLock::DataDir`], a broker: one descriptor for all
//!    its partitions); fail if another opener holds it.
//! 2. Delete leftovers: `*.tmp` (interrupted checkpoint writes) and `*.deleted`
//!    (interrupted segment deletes), and index files whose `.log` is gone.
//! 3. With a `.clean-shutdown` marker, trust the files: check each index, rebuild any that
//!    fails, and read each segment's tail. The marker is removed before anything else.
//!    The tail read checks CRCs; a segment that fails is validated whole as in rule 4.
//! 4. Without it, recover every segment from the one holding the recovery point (always
//!    at least the last one): validate every batch and rebuild indexes. Damage does not
//!    stop the scan: it resynchronizes on the next valid batch and records the range.
//!    A leader-epoch checkpoint that cannot be read forces recovery of all segments,
//!    which rebuilds it.
//! 5. Each damaged range is classified by [`damage::classify`]: a garbage suffix of the
//!    last segment at or above the recovery point, with no valid batch after it, is a
//!    torn write and is cut (only after every segment was checked). Anything else (damage
//!    in a sealed segment, below the recovery point, after a clean shutdown, or followed
//!    by valid batches) is corruption: no byte and no segment is removed, and the open
//!    fails with [`LogError::Damaged`] listing every range (file, positions, offsets), so
//!    the broker can report the partition offline and an operator can run
//!    `tidelog repair`.
//! 6. Segments must be contiguous, except across gaps `repair` recorded in
//!    `offset-gaps`; a missing range or an overlap is reported as damage (rule 5),
//!    never "fixed" by deleting segments.
//! 7. Sealed segments release their `.log` descriptor once loaded; a read reopens it and
//!    [`crate::partition::PartitionLog::close_idle_files`] releases it again when idle,
//!    so a partition's descriptors do not grow with its segment count.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::Path;
use std::sync::Arc;

use crate::segment::{
    remove_if_exists, segment_file, LogSegment, SegmentConfig, SegmentDamage, SegmentError,
    DELETED_SUFFIX, INDEX_SUFFIXES, LOG_SUFFIX,
};
use crate::topic_config::TopicConfig;
use crate::types::{LeaderEpoch, Offset};

use super::checkpoint;
use super::damage::{self, DamageFacts, DamageKind, DamageReport, DamagedRange};
use super::epoch_cache::LeaderEpochCache;
use super::LogError;

/// Present only between a clean close and the next open.
pub const CLEAN_SHUTDOWN_FILE: &str = ".clean-shutdown";
/// Held (flock) while the partition is open.
pub const LOCK_FILE: &str = ".lock";
/// Recovery point, high watermark and log start offset.
pub const OFFSETS_CHECKPOINT: &str = "log-offsets-checkpoint";

/// Offsets persisted between runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OffsetsCheckpoint {
    /// Every offset below it was flushed to disk.
    pub recovery_point: u64,
    /// The last high watermark written.
    pub high_watermark: u64,
    /// The log start offset.
    pub log_start_offset: u64,
}

/// Writes the offsets checkpoint atomically.
pub fn write_offsets(dir: &Path, offsets: &OffsetsCheckpoint) -> io::Result<()> {
    checkpoint::write(
        &dir.join(OFFSETS_CHECKPOINT),
        &[
            format!("recovery_point {}", offsets.recovery_point),
            format!("high_watermark {}", offsets.high_watermark),
            format!("log_start_offset {}", offsets.log_start_offset),
        ],
    )
}

/// The offsets checkpoint, or zeros when it is missing or unreadable (for `repair`, which
/// only lowers the recovery point).
pub(super) fn read_offsets_lenient(dir: &Path) -> OffsetsCheckpoint {
    read_offsets(dir).ok().flatten().unwrap_or_default()
}

fn read_offsets(dir: &Path) -> io::Result<Option<OffsetsCheckpoint>> {
    let Some(lines) = checkpoint::read(&dir.join(OFFSETS_CHECKPOINT))? else {
        return Ok(None);
    };
    let mut offsets = OffsetsCheckpoint::default();
    for line in &lines {
        let mut parts = line.split_whitespace();
        let (Some(key), Some(value), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad line {line:?}"),
            ));
        };
        let value: u64 = value.parse().map_err(|_| {
            io::Error::new(io::ErrorKind::InvalidData, format!("bad line {line:?}"))
        })?;
        match key {
            "recovery_point" => offsets.recovery_point = value,
            "high_watermark" => offsets.high_watermark = value,
            "log_start_offset" => offsets.log_start_offset = value,
            _ => {}
        }
    }
    Ok(Some(offsets))
}

/// A loaded partition directory.
pub struct Loaded {
    /// Segments by base offset; the last is active.
    pub segments: BTreeMap<u64, LogSegment>,
    /// First offset in the log.
    pub log_start_offset: u64,
    /// High watermark from the checkpoint, clamped into the log.
    pub high_watermark: u64,
    /// The leader-epoch cache, consistent with the log.
    pub epochs: LeaderEpochCache,
    /// The directory lock (own or shared), held while the partition is open.
    pub lock: Arc<File>,
    /// True when the last shutdown was clean.
    pub was_clean: bool,
}

/// Builds the segment settings from a topic config.
pub fn segment_config(config: &TopicConfig) -> SegmentConfig {
    SegmentConfig {
        index_interval_bytes: config.index_interval_bytes,
        index_max_bytes: config.segment_index_bytes,
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> LogError + '_ {
    move |e| LogError::io(path, e)
}

/// How a partition directory is kept to one process.
#[derive(Debug, Clone)]
pub enum DirLock {
    /// Lock the partition directory's own `.lock` while it is open.
    Own,
    /// The caller holds [`lock_data_dir`] on the directory above it.
    DataDir(Arc<File>),
}

/// Locks `<data_dir>/.lock` for as long as the returned file lives: the broker's one
/// lock for all its partitions. Fails with [`LogError::DirectoryLocked`] when another
/// process holds it.
pub fn lock_data_dir(data_dir: &Path) -> Result<Arc<File>, LogError> {
    fs::create_dir_all(data_dir).map_err(io_err(data_dir))?;
    lock_dir(data_dir).map(Arc::new)
}

fn lock_dir(dir: &Path) -> Result<File, LogError> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err(&path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(fs::TryLockError::WouldBlock) => Err(LogError::DirectoryLocked {
            path: dir.to_path_buf(),
        }),
        Err(fs::TryLockError::Error(e)) => Err(LogError::io(&path, e)),
    }
}

/// Removes leftovers and returns the base offsets of the segments present, sorted.
fn discover_segments(dir: &Path) -> Result<Vec<u64>, LogError> {
    let mut logs = Vec::new();
    let mut indexes = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let path = entry.path();
        if name.ends_with(".tmp") || name.ends_with(&format!(".{DELETED_SUFFIX}")) {
            tracing::info!(path = %path.display(), "removing leftover file");
            remove_if_exists(&path).map_err(io_err(&path))?;
            continue;
        }
        let Some((stem, suffix)) = name.split_once('.') else {
            continue;
        };
        if stem.len() != 20 || !stem.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(base) = stem.parse::<u64>() else {
            continue;
        };
        match suffix {
            LOG_SUFFIX => logs.push(base),
            s if INDEX_SUFFIXES.contains(&s) => indexes.push((base, path)),
            _ => {}
        }
    }
    logs.sort_unstable();
    for (base, path) in indexes {
        if logs.binary_search(&base).is_err() {
            tracing::warn!(path = %path.display(), "removing index file without a log file");
            remove_if_exists(&path).map_err(io_err(&path))?;
        }
    }
    Ok(logs)
}

/// Opens `dir` (creating it if needed) and brings its log to a consistent state.
pub fn load(dir: &Path, config: &TopicConfig, lock: &DirLock) -> Result<Loaded, LogError> {
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let lock = match lock {
        DirLock::Own => Arc::new(lock_dir(dir)?),
        DirLock::DataDir(held) => held.clone(),
    };
    let name = dir
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let marker = dir.join(CLEAN_SHUTDOWN_FILE);
    let mut clean = marker.exists();
    if clean {
        fs::remove_file(&marker).map_err(io_err(&marker))?;
        checkpoint::sync_dir(dir).map_err(io_err(dir))?;
    }
    let offsets = match read_offsets(dir) {
        Ok(offsets) => offsets,
        Err(e) => {
            tracing::warn!(partition = %name, error = %e, "offsets checkpoint unreadable; recovering the whole log");
            clean = false;
            None
        }
    };
    let mut epochs_unreadable = false;
    let mut epochs = match LeaderEpochCache::load(dir) {
        Ok(epochs) => epochs,
        Err(e) => {
            epochs_unreadable = true;
            tracing::warn!(partition = %name, error = %e, "leader-epoch checkpoint unreadable; rebuilding it from the log");
            clean = false;
            LeaderEpochCache::empty(dir)
        }
    };
    // Without a trustworthy checkpoint, recover from the very start.
    let recovery_point = offsets.map_or(0, |o| o.recovery_point);
    let full_recovery = offsets.is_none() || epochs_unreadable;
    let seg_config = segment_config(config);
    let bases = discover_segments(dir)?;
    // Nothing on disk yet: a brand-new partition, neither clean nor recovered.
    let new = bases.is_empty() && offsets.is_none();
    let mut segments = BTreeMap::new();

    if bases.is_empty() {
        let start = offsets.map_or(0, |o| o.log_start_offset);
        segments.insert(start, LogSegment::create(dir, start, seg_config)?);
    } else {
        let recover_from = if full_recovery {
            bases[0]
        } else {
            // The segment holding the recovery point, but never past the last one.
            bases
                .iter()
                .rev()
                .find(|&&b| b <= recovery_point)
                .copied()
                .unwrap_or(bases[0])
                .min(*bases.last().expect("non-empty"))
        };
        let gaps = damage::read_gaps(dir).map_err(io_err(dir))?;
        // After a clean shutdown everything was flushed: no damage is a torn write.
        let recovery_point = (!clean).then_some(if full_recovery { 0 } else { recovery_point });
        let mut expected_next: Option<u64> = None;
        let mut damaged: Vec<DamagedRange> = Vec::new();
        let mut torn_tail: Option<(u64, SegmentDamage)> = None;
        for (i, &base) in bases.iter().enumerate() {
            let log_path = segment_file(dir, base, LOG_SUFFIX);
            match expected_next {
                Some(next) if next < base && !damage::gap_is_recorded(&gaps, next, base) => {
                    damaged.push(DamagedRange {
                        kind: DamageKind::MissingOffsets,
                        file: log_path.clone(),
                        segment_base_offset: base,
                        start_position: 0,
                        end_position: 0,
                        first_offset: next,
                        resume_offset: Some(base),
                        reason: format!(
                            "no segment holds offsets {next}..{base}: the previous segment ends at {next}"
                        ),
                    });
                }
                Some(next) if next > base => {
                    damaged.push(DamagedRange {
                        kind: DamageKind::OverlappingSegment,
                        file: log_path.clone(),
                        segment_base_offset: base,
                        start_position: 0,
                        end_position: 0,
                        first_offset: base,
                        resume_offset: Some(next),
                        reason: format!(
                            "segment starts at offset {base}, below the end of the previous one ({next})"
                        ),
                    });
                }
                _ => {}
            }
            let active = i + 1 == bases.len();
            let mut segment = LogSegment::open(dir, base, seg_config, active)?;
            let must_recover = !clean && (base >= recover_from || active);
            let found = if must_recover {
                recover_segment(&name, &mut segment, &mut epochs)?
            } else {
                match segment.load() {
                    Ok(rebuilt) => {
                        if rebuilt {
                            tracing::warn!(partition = %name, base_offset = base, "index failed its check and was rebuilt");
                        }
                        Vec::new()
                    }
                    Err(SegmentError::Corrupt { reason, .. }) => {
                        tracing::warn!(partition = %name, base_offset = base, %reason, "segment failed to load; validating every batch");
                        recover_segment(&name, &mut segment, &mut epochs)?
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            for d in found {
                let kind = damage::classify(DamageFacts {
                    in_last_segment: active,
                    valid_batch_follows: d.resume_offset.is_some(),
                    first_offset: d.first_offset,
                    recovery_point,
                });
                if kind == DamageKind::TornTail {
                    torn_tail = Some((base, d));
                } else {
                    tracing::error!(partition = %name, path = %log_path.display(), start_position = d.start_position, end_position = d.end_position, first_offset = d.first_offset, resume_offset = d.resume_offset, reason = %d.reason, "corrupt data in a segment; keeping it and every later segment");
                    damaged.push(DamagedRange::from_segment(kind, &log_path, base, &d));
                }
            }
            if !active {
                // Rebuilt indexes are at full capacity; sealed segments keep them trimmed.
                segment.seal()?;
                // Sealed segments hold no descriptor until read (rule 7).
                segment.release_file();
            }
            expected_next = Some(segment.next_offset());
            segments.insert(base, segment);
        }
        if !damaged.is_empty() {
            // Nothing was cut or deleted: report it all and stay closed until repaired.
            if let Some((base, d)) = &torn_tail {
                damaged.push(DamagedRange::from_segment(
                    DamageKind::TornTail,
                    &segment_file(dir, *base, LOG_SUFFIX),
                    *base,
                    d,
                ));
            }
            let report = DamageReport {
                dir: dir.to_path_buf(),
                ranges: damaged,
            };
            tracing::error!(partition = %name, ranges = report.ranges.len(), %report, "partition not opened: damaged data needs `tidelog repair` or a replica");
            return Err(LogError::Damaged(Box::new(report)));
        }
        if let Some((base, d)) = torn_tail {
            if let Some(segment) = segments.get_mut(&base) {
                let cut = segment.truncate_log_at(d.start_position)?;
                tracing::warn!(
                    partition = %name,
                    base_offset = base,
                    position = d.start_position,
                    truncated_bytes = cut,
                    problem = %d.reason,
                    "recovery cut a torn write off the end of the log"
                );
            }
        }
        // The last segment may have been opened as sealed: make it active.
        if let Some((_, last)) = segments.iter_mut().next_back() {
            last.unseal()?;
        }
    }

    let (&first_base, _) = segments.first_key_value().expect("at least one segment");
    let log_end = segments
        .last_key_value()
        .expect("at least one segment")
        .1
        .next_offset();
    let log_start_offset = offsets
        .map_or(first_base, |o| o.log_start_offset.max(first_base))
        .min(log_end);
    let high_watermark = offsets
        .map_or(log_start_offset, |o| o.high_watermark)
        .clamp(log_start_offset, log_end);
    epochs.truncate_from_end(Offset(log_end));
    epochs.truncate_from_start(Offset(log_start_offset));
    if !clean {
        // Everything kept was validated; make it durable so the recovery point is true.
        let sealed = segments.len() - 1;
        for (i, segment) in segments.values().enumerate() {
            segment.flush_all()?;
            if i < sealed {
                segment.release_file();
            }
        }
        checkpoint::sync_dir(dir).map_err(io_err(dir))?;
    }
    epochs.persist().map_err(io_err(dir))?;
    write_offsets(
        dir,
        &OffsetsCheckpoint {
            recovery_point: log_end,
            high_watermark,
            log_start_offset,
        },
    )
    .map_err(io_err(dir))?;
    if new {
        tracing::debug!(partition = %name, log_start_offset, "partition created");
    } else {
        tracing::info!(
            partition = %name,
            clean,
            recovered = !clean,
            segments = segments.len(),
        log_start_offset,
        log_end_offset = log_end,
            high_watermark,
            "partition loaded"
        );
    }
    Ok(Loaded {
        segments,
        log_start_offset,
        high_watermark,
        epochs,
        lock,
        was_clean: clean,
    })
}

/// Re-validates one segment and rebuilds its indexes; returns the damage found (nothing
/// is cut here).
fn recover_segment(
    name: &str,
    segment: &mut LogSegment,
    epochs: &mut LeaderEpochCache,
) -> Result<Vec<SegmentDamage>, LogError> {
    let outcome = segment.recover(|h| {
        epochs.assign(
            LeaderEpoch(h.partition_leader_epoch),
            Offset(h.base_offset as u64),
        );
    })?;
    if !outcome.damage.is_empty() {
        tracing::warn!(
            partition = %name,
            base_offset = segment.base_offset(),
            damaged_ranges = outcome.damage.len(),
            valid_prefix_end = outcome.valid_prefix_end,
            "recovery found damage"
        );
    }
    Ok(outcome.damage)
}
