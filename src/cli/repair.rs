//! `tidelog repair`: offline repair of a partition whose data is damaged.
//!
//! ```text
//! tidelog repair --data-dir DIR (--topic T --partition P | PARTITION-DIR) [--execute]
//! ```
//!
//! Without `--execute` it prints exactly what it would drop (file, byte positions, offset
//! range, offsets/records, bytes) and what it keeps, and changes nothing. With
//! `--execute` it drops only the damaged ranges (valid batches after a damaged range are
//! kept with their offsets; see `partition::repair`), then opens the partition to prove
//! it loads, and closes it cleanly. A directory locked by a running server is refused.
//!
//! Exit status: 0 when the partition is (now) clean, non-zero when damage remains
//! (a dry run that found damage) or anything failed.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::json;

use crate::partition::repair::{self, RepairPlan};
use crate::partition::{LogError, PartitionLog, SystemClock};
use crate::topic_config::TopicConfig;

use super::{CliError, OutputFormat};

/// Arguments of `tidelog repair`.
#[derive(Debug, clap::Args)]
pub struct RepairArgs {
    /// The broker's data directory.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Topic of the partition to repair (with --partition and --data-dir).
    #[arg(long, requires = "partition", requires = "data_dir")]
    pub topic: Option<String>,
    /// Partition number (with --topic).
    #[arg(long, requires = "topic")]
    pub partition: Option<u32>,
    /// The partition directory itself, instead of --topic/--partition.
    #[arg(conflicts_with = "topic")]
    pub path: Option<PathBuf>,
    /// Apply the plan. Without it, nothing is changed.
    #[arg(long)]
    pub execute: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

fn partition_dir(args: &RepairArgs) -> Result<PathBuf, CliError> {
    match (&args.path, &args.topic, args.partition, &args.data_dir) {
        (Some(path), None, None, _) => Ok(path.clone()),
        (None, Some(topic), Some(partition), Some(data_dir)) => {
            Ok(data_dir.join(format!("{topic}-{partition}")))
        }
        _ => Err(CliError::new(
            "INVALID_ARGUMENT",
            "name the partition with --data-dir DIR --topic T --partition P, or its directory",
        )),
    }
}

fn log_error(e: LogError) -> CliError {
    let code = match &e {
        LogError::DirectoryLocked { .. } => "PARTITION_IN_USE",
        LogError::Damaged(_) | LogError::Corrupt { .. } => "CORRUPT_MESSAGE",
        _ => "KAFKA_STORAGE_ERROR",
    };
    let message = match &e {
        LogError::DirectoryLocked { path } => format!(
            "{} is locked by a running server: stop it (or move the partition away) before repairing",
            path.display()
        ),
        other => other.to_string(),
    };
    CliError::new(code, message)
}

fn print_plan(plan: &RepairPlan, output: OutputFormat) {
    for d in &plan.drops {
        match output {
            OutputFormat::Json => println!(
                "{}",
                json!({
                    "action": "drop",
                    "kind": d.kind.name(),
                    "file": d.file.display().to_string(),
                    "start_position": d.damage.start_position,
                    "end_position": d.damage.end_position,
                    "bytes": d.bytes(),
                    "first_offset": d.damage.first_offset,
                    "end_offset": d.end_offset,
                    "offsets": d.offsets(),
                    "reason": d.damage.reason,
                })
            ),
            OutputFormat::Table => println!(
                "drop {}: {} bytes {}..{} ({} bytes), offsets {}..{} ({} records): {}",
                d.kind.name(),
                d.file.display(),
                d.damage.start_position,
                d.damage.end_position,
                d.bytes(),
                d.damage.first_offset,
                d.end_offset,
                d.offsets(),
                d.damage.reason
            ),
        }
    }
    for segment in &plan.segments {
        for run in segment.runs.iter().skip(1) {
            match output {
                OutputFormat::Json => println!(
                    "{}",
                    json!({
                        "action": "keep",
                        "file": segment.file.display().to_string(),
                        "start_position": run.start_position,
                        "end_position": run.end_position,
                        "first_offset": run.first_offset,
                        "end_offset": run.next_offset,
                        "new_segment_base_offset": run.first_offset,
                    })
                ),
                OutputFormat::Table => println!(
                    "keep {}: bytes {}..{}, offsets {}..{} as segment {:020}.log",
                    segment.file.display(),
                    run.start_position,
                    run.end_position,
                    run.first_offset,
                    run.next_offset,
                    run.first_offset
                ),
            }
        }
    }
    for (from, to) in &plan.missing {
        match output {
            OutputFormat::Json => println!(
                "{}",
                json!({"action": "record_gap", "first_offset": from, "end_offset": to,
                       "reason": "no segment file holds these offsets"})
            ),
            OutputFormat::Table => println!(
                "missing offsets {from}..{to}: no segment file holds them (recorded as a gap)"
            ),
        }
    }
    for overlap in &plan.overlaps {
        match output {
            OutputFormat::Json => println!("{}", json!({"action": "refuse", "reason": overlap})),
            OutputFormat::Table => println!("cannot repair: {overlap}"),
        }
    }
}

/// Runs the subcommand.
pub fn run(args: &RepairArgs) -> Result<(), CliError> {
    let dir = partition_dir(args)?;
    let plan = repair::plan(&dir).map_err(log_error)?;
    if args.output == OutputFormat::Table {
        println!(
            "partition {}: {} segments, {} valid batches checked",
            dir.display(),
            plan.segments_checked,
            plan.valid_batches
        );
    }
    print_plan(&plan, args.output);
    if plan.is_clean() {
        if args.output == OutputFormat::Table {
            println!("no damage found; nothing to do");
        }
        return Ok(());
    }
    if !args.execute {
        if args.output == OutputFormat::Table {
            println!("dry run: nothing was changed; run again with --execute to apply");
        }
        return Err(CliError::new(
            "CORRUPT_MESSAGE",
            format!(
                "{}: {} damaged range(s) found (dry run, nothing changed)",
                dir.display(),
                plan.drops.len() + plan.missing.len() + plan.overlaps.len()
            ),
        ));
    }
    let outcome = repair::execute(&plan).map_err(log_error)?;
    drop(plan);
    // Prove the result opens: full validation (recovery point 0), then a clean close.
    let log = PartitionLog::open(&dir, TopicConfig::default(), Arc::new(SystemClock))
        .map_err(log_error)?;
    let (start, end) = (log.log_start_offset().0, log.log_end_offset().0);
    log.close().map_err(log_error)?;
    match args.output {
        OutputFormat::Json => println!(
            "{}",
            json!({"action": "done", "created": outcome.created, "removed": outcome.removed,
                   "dropped_bytes": outcome.dropped_bytes, "log_start_offset": start,
                   "log_end_offset": end})
        ),
        OutputFormat::Table => println!(
            "repaired: dropped {} bytes, {} new segment(s), {} removed; the partition opens with offsets {start}..{end}",
            outcome.dropped_bytes,
            outcome.created.len(),
            outcome.removed.len()
        ),
    }
    Ok(())
}
