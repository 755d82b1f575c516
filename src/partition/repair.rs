//! Offline repair of a damaged partition directory (`tidelog repair`).
//!
//! [`plan`] reads every segment (CRC and offset checks, resynchronizing after damage, as
//! recovery does) and changes nothing; [`execute`] applies the plan. The choice made for
//! a damaged range in the middle of the log is to drop **only that range**: the valid
//! batches after it are kept with their offsets, moved into a new segment file named by
//! their first offset, and the dropped offsets are recorded as a gap in `offset-gaps` so
//! the loader accepts the hole (readers skip it as they skip compacted offsets in Kafka).
//! Truncating at the first damage instead would throw away every acknowledged record
//! after it, which is the loss this command exists to avoid.
//!
//! Invariants and failure:
//! - Holds the partition's `.lock` for the whole run: a directory in use by a server is
//!   refused ([`super::LogError::DirectoryLocked`]).
//! - Never rewrites a valid batch: valid runs are copied byte for byte (new files are
//!   written as `*.tmp`, fsynced, renamed, and the directory fsynced) before the damaged
//!   file is cut; an interruption between the rename and the cut leaves an overlap that
//!   the next open reports (no data is lost; rerun after inspecting).
//! - Afterwards indexes of touched segments are deleted and the recovery point is reset
//!   to 0, so the next open validates every batch and rebuilds every index.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::segment::{
    read_at_most, remove_if_exists, segment_file, verify_batches, SegmentDamage, INDEX_SUFFIXES,
    LOG_SUFFIX, MAX_SEGMENT_BYTES,
};

use super::checkpoint;
use super::damage::{self, DamageKind};
use super::loader::{write_offsets, OffsetsCheckpoint, CLEAN_SHUTDOWN_FILE, LOCK_FILE};
use super::LogError;

/// A run of valid batches inside one segment file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidRun {
    /// First byte of the run.
    pub start_position: u64,
    /// Byte after the run.
    pub end_position: u64,
    /// Offset of its first batch.
    pub first_offset: u64,
    /// Offset after its last batch.
    pub next_offset: u64,
}

/// One range `repair` drops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropAction {
    /// What kind of damage it is.
    pub kind: DamageKind,
    /// The segment file.
    pub file: PathBuf,
    /// The damage as found.
    pub damage: SegmentDamage,
    /// Offsets dropped: `[damage.first_offset, end_offset)`.
    pub end_offset: u64,
}

impl DropAction {
    /// Offsets (records, in a log without gaps) dropped.
    pub fn offsets(&self) -> u64 {
        self.end_offset.saturating_sub(self.damage.first_offset)
    }

    /// Bytes dropped.
    pub fn bytes(&self) -> u64 {
        self.damage.end_position - self.damage.start_position
    }
}

/// What repair does to one damaged segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentRepair {
    /// The segment's base offset.
    pub base_offset: u64,
    /// Its `.log` file.
    pub file: PathBuf,
    /// Valid runs, in file order; the first stays in the file (cut after it), every
    /// later one becomes a new segment named by its first offset.
    pub runs: Vec<ValidRun>,
}

/// Everything repair would do.
#[derive(Debug)]
pub struct RepairPlan {
    /// The partition directory.
    pub dir: PathBuf,
    /// Ranges dropped, in log order.
    pub drops: Vec<DropAction>,
    /// Offsets no segment holds (a lost segment file): recorded as gaps, nothing to drop.
    pub missing: Vec<(u64, u64)>,
    /// Segments that overlap the previous one: repair refuses to guess which copy is right.
    pub overlaps: Vec<String>,
    /// Segments to split or cut.
    pub segments: Vec<SegmentRepair>,
    /// Segments checked.
    pub segments_checked: usize,
    /// Valid batches seen.
    pub valid_batches: u64,
    _lock: Vec<File>,
}

impl RepairPlan {
    /// True when nothing needs repair.
    pub fn is_clean(&self) -> bool {
        self.drops.is_empty() && self.missing.is_empty() && self.overlaps.is_empty()
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> LogError + '_ {
    move |e| LogError::Io {
        path: path.to_path_buf(),
        source: e,
    }
}

/// Takes the directory lock without creating anything; `None` when no `.lock` exists
/// (no server has the directory open then).
fn lock(dir: &Path) -> Result<Option<File>, LogError> {
    let path = dir.join(LOCK_FILE);
    let file = match OpenOptions::new().write(true).open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LogError::Io { path, source: e }),
    };
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(fs::TryLockError::WouldBlock) => Err(LogError::DirectoryLocked {
            path: dir.to_path_buf(),
        }),
        Err(fs::TryLockError::Error(e)) => Err(LogError::Io { path, source: e }),
    }
}

fn segment_bases(dir: &Path) -> Result<Vec<u64>, LogError> {
    let mut bases = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".log")) else {
            continue;
        };
        if stem.len() == 20 && stem.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(base) = stem.parse() {
                bases.push(base);
            }
        }
    }
    bases.sort_unstable();
    Ok(bases)
}

/// Inspects `dir` and says what [`execute`] would do. Reads only; holds the lock.
pub fn plan(dir: &Path) -> Result<RepairPlan, LogError> {
    if !dir.is_dir() {
        return Err(LogError::Io {
            path: dir.to_path_buf(),
            source: io::Error::new(io::ErrorKind::NotFound, "not a partition directory"),
        });
    }
    // The partition's own lock (tools, older brokers) and the broker's data-dir lock.
    let mut lock: Vec<File> = lock(dir)?.into_iter().collect();
    if let Some(data_dir) = dir.parent() {
        lock.extend(self::lock(data_dir)?);
    }
    let bases = segment_bases(dir)?;
    let gaps = damage::read_gaps(dir).map_err(io_err(dir))?;
    let mut plan = RepairPlan {
        dir: dir.to_path_buf(),
        drops: Vec::new(),
        missing: Vec::new(),
        overlaps: Vec::new(),
        segments: Vec::new(),
        segments_checked: bases.len(),
        valid_batches: 0,
        _lock: lock,
    };
    let mut expected: Option<u64> = None;
    for (i, &base) in bases.iter().enumerate() {
        let path = segment_file(dir, base, LOG_SUFFIX);
        match expected {
            Some(next) if next < base && !damage::gap_is_recorded(&gaps, next, base) => {
                plan.missing.push((next, base));
            }
            Some(next) if next > base => plan.overlaps.push(format!(
                "{} starts at offset {base}, below the end of the previous segment ({next})",
                path.display()
            )),
            _ => {}
        }
        let next_base = bases.get(i + 1).copied();
        let file = File::open(&path).map_err(io_err(&path))?;
        let size = file.metadata().map_err(io_err(&path))?.len();
        let limit = next_base
            .unwrap_or(u64::MAX)
            .min(base.saturating_add(u64::from(u32::MAX) + 1));
        let verified = verify_batches(
            &file,
            0,
            size,
            base,
            limit,
            MAX_SEGMENT_BYTES,
            &mut |_, _| {},
        )
        .map_err(|e| LogError::Io {
            path: path.clone(),
            source: io::Error::other(e.to_string()),
        })?;
        plan.valid_batches += verified.batches;
        expected = Some(verified.next_offset);
        if verified.damage.is_empty() {
            continue;
        }
        let last_segment = next_base.is_none();
        let mut runs = Vec::new();
        let (mut run_start, mut run_first) = (0u64, base);
        for (j, d) in verified.damage.iter().enumerate() {
            runs.push(ValidRun {
                start_position: run_start,
                end_position: d.start_position,
                first_offset: run_first,
                next_offset: d.first_offset,
            });
            let end_offset = d
                .resume_offset
                .or(next_base)
                .unwrap_or(d.first_offset)
                .max(d.first_offset);
            let torn = last_segment && d.resume_offset.is_none();
            plan.drops.push(DropAction {
                kind: if torn {
                    DamageKind::TornTail
                } else {
                    DamageKind::Corrupt
                },
                file: path.clone(),
                damage: d.clone(),
                end_offset,
            });
            if let Some(resume) = d.resume_offset {
                run_start = d.end_position;
                run_first = resume;
                if j + 1 == verified.damage.len() {
                    runs.push(ValidRun {
                        start_position: run_start,
                        end_position: size,
                        first_offset: run_first,
                        next_offset: verified.next_offset,
                    });
                }
            }
        }
        plan.segments.push(SegmentRepair {
            base_offset: base,
            file: path,
            runs,
        });
    }
    Ok(plan)
}

/// What [`execute`] changed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RepairOutcome {
    /// New segment files written (valid runs moved out of damaged segments).
    pub created: Vec<PathBuf>,
    /// Segment files removed (nothing valid was left in them).
    pub removed: Vec<PathBuf>,
    /// Bytes dropped.
    pub dropped_bytes: u64,
}

/// Applies `plan`: moves valid runs out of damaged segments, cuts or removes the damaged
/// files, records the dropped offsets as gaps, drops the touched indexes and forces a
/// full recovery on the next open. Refuses plans with overlapping segments.
pub fn execute(plan: &RepairPlan) -> Result<RepairOutcome, LogError> {
    let dir = &plan.dir;
    if let Some(overlap) = plan.overlaps.first() {
        return Err(LogError::Corrupt {
            path: dir.clone(),
            reason: format!("overlapping segments need a manual decision: {overlap}"),
        });
    }
    let mut outcome = RepairOutcome::default();
    for segment in &plan.segments {
        let src = File::open(&segment.file).map_err(io_err(&segment.file))?;
        // 1. Copy every later run to its own new segment (tmp, fsync, rename).
        let mut keeps_name = segment
            .runs
            .first()
            .is_some_and(|r| r.end_position > r.start_position);
        for run in segment.runs.iter().skip(1) {
            let target = segment_file(dir, run.first_offset, LOG_SUFFIX);
            let tmp = target.with_extension("log.tmp");
            copy_range(&src, run.start_position, run.end_position, &tmp)?;
            if run.first_offset == segment.base_offset {
                // The damaged file held nothing valid before this run: replace it.
                keeps_name = true;
            }
            fs::rename(&tmp, &target).map_err(io_err(&target))?;
            outcome.created.push(target);
        }
        checkpoint::sync_dir(dir).map_err(io_err(dir))?;
        // 2. Cut the damaged file after its first run, or remove it when that is empty.
        let first_end = segment.runs.first().map_or(0, |r| r.end_position);
        let replaced = segment
            .runs
            .iter()
            .skip(1)
            .any(|r| r.first_offset == segment.base_offset);
        if !replaced {
            if keeps_name {
                let file = OpenOptions::new()
                    .write(true)
                    .open(&segment.file)
                    .map_err(io_err(&segment.file))?;
                file.set_len(first_end).map_err(io_err(&segment.file))?;
                file.sync_all().map_err(io_err(&segment.file))?;
            } else {
                remove_if_exists(&segment.file).map_err(io_err(&segment.file))?;
                outcome.removed.push(segment.file.clone());
            }
        }
        for suffix in INDEX_SUFFIXES {
            let index = segment_file(dir, segment.base_offset, suffix);
            remove_if_exists(&index).map_err(io_err(&index))?;
        }
    }
    outcome.dropped_bytes = plan.drops.iter().map(DropAction::bytes).sum();
    // 3. Record the holes so the loader accepts them.
    let mut gaps = damage::read_gaps(dir).map_err(io_err(dir))?;
    gaps.extend(
        plan.drops
            .iter()
            .filter(|d| d.kind != DamageKind::TornTail && d.end_offset > d.damage.first_offset)
            .map(|d| (d.damage.first_offset, d.end_offset)),
    );
    gaps.extend(plan.missing.iter().copied());
    if !gaps.is_empty() {
        damage::write_gaps(dir, &gaps).map_err(io_err(dir))?;
    }
    // 4. Force full validation on the next open: no clean marker, recovery point 0.
    force_recovery_from(dir, 0)?;
    Ok(outcome)
}

/// Makes the next open validate every batch from `offset` on (and rebuild those
/// indexes): removes the clean-shutdown marker and lowers the recovery point to `offset`.
fn force_recovery_from(dir: &Path, offset: u64) -> Result<(), LogError> {
    let marker = dir.join(CLEAN_SHUTDOWN_FILE);
    remove_if_exists(&marker).map_err(io_err(&marker))?;
    let offsets = super::loader::read_offsets_lenient(dir);
    write_offsets(
        dir,
        &OffsetsCheckpoint {
            recovery_point: offsets.recovery_point.min(offset),
            ..offsets
        },
    )
    .map_err(io_err(dir))?;
    checkpoint::sync_dir(dir).map_err(io_err(dir))
}

/// Copies `[start, end)` of `src` to a new file `to`, fsynced.
fn copy_range(src: &File, start: u64, end: u64, to: &Path) -> Result<(), LogError> {
    let mut out = File::create(to).map_err(io_err(to))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut position = start;
    while position < end {
        let want = ((end - position) as usize).min(buf.len());
        let n = read_at_most(src, position, &mut buf[..want]).map_err(io_err(to))?;
        if n == 0 {
            return Err(LogError::Io {
                path: to.to_path_buf(),
                source: io::Error::new(io::ErrorKind::UnexpectedEof, "source file shrank"),
            });
        }
        out.write_all(&buf[..n]).map_err(io_err(to))?;
        position += n as u64;
    }
    out.sync_all().map_err(io_err(to))
}

/// What [`set_aside_from_first_damage`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetAside {
    /// Where the set-aside files went (beside the partition directory).
    pub quarantine: PathBuf,
    /// The log now ends here: the first offset of the first damaged range.
    pub cut_offset: u64,
    /// Segment files moved or copied into the quarantine.
    pub files: usize,
}

/// Cuts the log at its first damaged range so the partition can open and re-fetch the
/// rest from the leader, as a follower does. Used only when an in-sync replica elsewhere
/// holds every acknowledged record (the broker decides). Nothing is deleted: every segment
/// file from the damaged one on is moved (or, for the damaged one, copied whole before it
/// is cut) into `<partition>.<unix-ms>.quarantine/` beside the partition directory, for an
/// operator to inspect and delete. The touched indexes are dropped and the recovery point
/// is moved to the cut segment, so the next open validates it and rebuilds them.
pub fn set_aside_from_first_damage(
    report: &damage::DamageReport,
    now_ms: u64,
) -> Result<SetAside, LogError> {
    let dir = &report.dir;
    let Some(first) = report
        .ranges
        .iter()
        .min_by_key(|r| (r.segment_base_offset, r.start_position))
    else {
        return Err(LogError::Corrupt {
            path: dir.clone(),
            reason: "a damage report without ranges".to_owned(),
        });
    };
    let (base, cut_at) = (first.segment_base_offset, first.start_position);
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("partition");
    let quarantine = dir.with_file_name(format!("{name}.{now_ms}.quarantine"));
    fs::create_dir_all(&quarantine).map_err(io_err(&quarantine))?;
    let mut files = 0;
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        let Some((b, suffix)) = segment_file_name(&path) else {
            continue;
        };
        let target = quarantine.join(path.file_name().expect("a file name"));
        if b > base || (b == base && cut_at == 0) {
            fs::rename(&path, &target).map_err(io_err(&path))?;
            files += 1;
        } else if b == base && suffix == LOG_SUFFIX {
            let src = File::open(&path).map_err(io_err(&path))?;
            let len = src.metadata().map_err(io_err(&path))?.len();
            copy_range(&src, 0, len, &target)?;
            files += 1;
            let file = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(io_err(&path))?;
            file.set_len(cut_at).map_err(io_err(&path))?;
            file.sync_all().map_err(io_err(&path))?;
        } else if b == base {
            remove_if_exists(&path).map_err(io_err(&path))?;
        }
    }
    checkpoint::sync_dir(&quarantine).map_err(io_err(&quarantine))?;
    // Gaps past the cut describe files that are gone.
    let gaps = damage::read_gaps(dir).map_err(io_err(dir))?;
    let kept: Vec<(u64, u64)> = gaps
        .iter()
        .filter(|(from, _)| *from < first.first_offset)
        .map(|&(from, to)| (from, to.min(first.first_offset)))
        .collect();
    if kept != gaps {
        damage::write_gaps(dir, &kept).map_err(io_err(dir))?;
    }
    force_recovery_from(dir, base)?;
    if let Some(parent) = dir.parent() {
        checkpoint::sync_dir(parent).map_err(io_err(parent))?;
    }
    Ok(SetAside {
        quarantine,
        cut_offset: first.first_offset,
        files,
    })
}

/// `(base offset, suffix)` of a segment's file (`<20 digits>.<suffix>`).
fn segment_file_name(path: &Path) -> Option<(u64, &str)> {
    let (stem, suffix) = path.file_name()?.to_str()?.split_once('.')?;
    if stem.len() != 20 || !stem.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((stem.parse().ok()?, suffix))
}
