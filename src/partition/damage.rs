//! Damaged data in a partition directory: what it is, how recovery classifies it, and the
//! record of offset gaps left by `tidelog repair`.
//!
//! Invariants:
//! - Recovery cuts bytes only for a [`DamageKind::TornTail`]: a garbage suffix of the
//!   last segment, at or above the recovery point, after which no valid batch follows.
//!   That is what an interrupted write leaves, and it holds nothing that was on disk
//!   before the crash.
//! - Everything else ([`DamageKind::Corrupt`], [`DamageKind::MissingOffsets`],
//!   [`DamageKind::OverlappingSegment`]) is kept byte for byte: the partition refuses to
//!   open with [`super::LogError::Damaged`] carrying a [`DamageReport`], and only an
//!   explicit `tidelog repair --execute` (or, later, a re-fetch from a replica) changes
//!   the files.
//! - The decision is the pure function [`classify`], tested without I/O.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use crate::segment::SegmentDamage;

use super::checkpoint;

/// Offset gaps that `tidelog repair` left on purpose (dropped damaged ranges), so the next
/// open accepts them instead of reporting missing offsets. One `from to` line per gap,
/// `[from, to)`, in the checkpoint format.
pub const OFFSET_GAPS_FILE: &str = "offset-gaps";

/// What kind of damage a range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DamageKind {
    /// A garbage or incomplete suffix of the last segment above the recovery point, with
    /// no valid batch after it: an interrupted write. Recovery cuts it (as Kafka does).
    TornTail,
    /// Bytes that fail CRC or structure checks where the data was durable (a sealed
    /// segment, below the recovery point, a clean shutdown) or where valid batches follow.
    Corrupt,
    /// Segment files do not cover these offsets (a segment file is missing).
    MissingOffsets,
    /// A segment starts below the end of the previous one.
    OverlappingSegment,
}

impl DamageKind {
    /// A stable lower-case name for logs and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::TornTail => "torn_tail",
            Self::Corrupt => "corrupt",
            Self::MissingOffsets => "missing_offsets",
            Self::OverlappingSegment => "overlapping_segment",
        }
    }
}

/// One damaged range of a partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedRange {
    /// What kind of damage.
    pub kind: DamageKind,
    /// The segment `.log` file holding it.
    pub file: PathBuf,
    /// Base offset of that segment.
    pub segment_base_offset: u64,
    /// First damaged byte.
    pub start_position: u64,
    /// Where valid data resumes in the file (the file size when none does).
    pub end_position: u64,
    /// First offset that may be lost.
    pub first_offset: u64,
    /// Offset where valid data resumes (exclusive end of the lost offsets); `None` when
    /// nothing valid follows in this segment.
    pub resume_offset: Option<u64>,
    /// What is wrong.
    pub reason: String,
}

impl DamagedRange {
    /// Builds a range from what a segment scan found.
    pub fn from_segment(kind: DamageKind, file: &Path, base: u64, d: &SegmentDamage) -> Self {
        Self {
            kind,
            file: file.to_path_buf(),
            segment_base_offset: base,
            start_position: d.start_position,
            end_position: d.end_position,
            first_offset: d.first_offset,
            resume_offset: d.resume_offset,
            reason: d.reason.clone(),
        }
    }

    /// Damaged bytes.
    pub fn bytes(&self) -> u64 {
        self.end_position - self.start_position
    }
}

impl fmt::Display for DamagedRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} in {} bytes {}..{} (offsets {}..{}): {}",
            self.kind.name(),
            self.file.display(),
            self.start_position,
            self.end_position,
            self.first_offset,
            self.resume_offset
                .map_or_else(|| "end of segment".to_string(), |o| o.to_string()),
            self.reason
        )
    }
}

/// Every damaged range recovery found and refused to cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamageReport {
    /// The partition directory.
    pub dir: PathBuf,
    /// The ranges, in log order.
    pub ranges: Vec<DamagedRange>,
}

impl fmt::Display for DamageReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} damaged range(s) in {}",
            self.ranges.len(),
            self.dir.display()
        )?;
        if let Some(first) = self.ranges.first() {
            write!(f, "; first: {first}")?;
        }
        Ok(())
    }
}

/// Where a damaged range sits, as [`classify`] needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DamageFacts {
    /// The range is in the last (active) segment.
    pub in_last_segment: bool,
    /// A valid batch follows the range in its segment.
    pub valid_batch_follows: bool,
    /// First offset of the range.
    pub first_offset: u64,
    /// The recovery point (every offset below it was flushed); `None` after a clean
    /// shutdown, when everything was flushed.
    pub recovery_point: Option<u64>,
}

/// Decides whether recovery may cut a damaged range: only a suffix of the active segment,
/// above the recovery point, that nothing valid follows (a torn write). Anything else is
/// corruption of data that was durable or is followed by acknowledged data: never cut.
pub fn classify(facts: DamageFacts) -> DamageKind {
    let above_recovery_point = facts
        .recovery_point
        .is_some_and(|rp| facts.first_offset >= rp);
    if facts.in_last_segment && !facts.valid_batch_follows && above_recovery_point {
        DamageKind::TornTail
    } else {
        DamageKind::Corrupt
    }
}

/// Reads the offset gaps `repair` recorded; none when the file does not exist.
pub fn read_gaps(dir: &Path) -> io::Result<Vec<(u64, u64)>> {
    let Some(lines) = checkpoint::read(&dir.join(OFFSET_GAPS_FILE))? else {
        return Ok(Vec::new());
    };
    lines
        .iter()
        .map(|line| {
            let mut parts = line.split_whitespace().map(str::parse::<u64>);
            match (parts.next(), parts.next(), parts.next()) {
                (Some(Ok(from)), Some(Ok(to)), None) if from < to => Ok((from, to)),
                _ => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad offset gap line {line:?}"),
                )),
            }
        })
        .collect()
}

/// Writes the offset gaps atomically, sorted and merged.
pub fn write_gaps(dir: &Path, gaps: &[(u64, u64)]) -> io::Result<()> {
    let mut gaps = gaps.to_vec();
    gaps.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(gaps.len());
    for (from, to) in gaps {
        match merged.last_mut() {
            Some(last) if from <= last.1 => last.1 = last.1.max(to),
            _ => merged.push((from, to)),
        }
    }
    let lines: Vec<String> = merged.iter().map(|(f, t)| format!("{f} {t}")).collect();
    checkpoint::write(&dir.join(OFFSET_GAPS_FILE), &lines)
}

/// True when `[from, to)` lies inside one recorded gap.
pub fn gap_is_recorded(gaps: &[(u64, u64)], from: u64, to: u64) -> bool {
    gaps.iter().any(|&(f, t)| f <= from && to <= t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(last: bool, follows: bool, first: u64, rp: Option<u64>) -> DamageFacts {
        DamageFacts {
            in_last_segment: last,
            valid_batch_follows: follows,
            first_offset: first,
            recovery_point: rp,
        }
    }

    #[test]
    fn only_an_unflushed_garbage_suffix_of_the_active_segment_is_a_torn_tail() {
        assert_eq!(
            classify(facts(true, false, 10, Some(10))),
            DamageKind::TornTail
        );
        assert_eq!(
            classify(facts(true, false, 10, Some(0))),
            DamageKind::TornTail
        );
        // Valid data after it: acknowledged records would be lost.
        assert_eq!(
            classify(facts(true, true, 10, Some(0))),
            DamageKind::Corrupt
        );
        // A sealed segment.
        assert_eq!(
            classify(facts(false, false, 10, Some(0))),
            DamageKind::Corrupt
        );
        // Below the recovery point: it was flushed.
        assert_eq!(
            classify(facts(true, false, 9, Some(10))),
            DamageKind::Corrupt
        );
        // After a clean shutdown everything was flushed.
        assert_eq!(classify(facts(true, false, 10, None)), DamageKind::Corrupt);
    }

    #[test]
    fn gaps_round_trip_merged() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read_gaps(dir.path()).unwrap().is_empty());
        write_gaps(dir.path(), &[(20, 30), (5, 10), (10, 12)]).unwrap();
        let gaps = read_gaps(dir.path()).unwrap();
        assert_eq!(gaps, [(5, 12), (20, 30)]);
        assert!(gap_is_recorded(&gaps, 6, 12));
        assert!(!gap_is_recorded(&gaps, 4, 12));
        assert!(!gap_is_recorded(&gaps, 12, 20));
    }
}
