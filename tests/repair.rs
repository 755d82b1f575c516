//! `tidelog repair` run as a real binary on a partition with a corrupt sealed segment.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;

use tidelog::partition::{Isolation, LogError, PartitionLog, SystemClock};
use tidelog::record::{BatchBuilder, BatchIter, Compression, RecordRef};
use tidelog::topic_config::TopicConfig;
use tidelog::types::{LeaderEpoch, Offset};

fn repair(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tidelog"))
        .arg("repair")
        .args(args)
        .output()
        .expect("run tidelog")
}

fn config() -> TopicConfig {
    TopicConfig {
        segment_bytes: 4096,
        index_interval_bytes: 256,
        segment_index_bytes: 4096,
        ..TopicConfig::default()
    }
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect();
    out.sort();
    out
}

fn values(log: &PartitionLog) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut next = log.log_start_offset().0;
    while next < log.log_end_offset().0 {
        let data = log.read(Offset(next), 4096, Isolation::LogEnd).unwrap();
        for batch in BatchIter::new(&data.records) {
            for r in batch.unwrap().records(1 << 20).unwrap() {
                if r.offset as u64 >= next {
                    next = r.offset as u64 + 1;
                    out.push((r.offset as u64, r.value.unwrap().to_vec()));
                }
            }
        }
    }
    out
}

#[test]
fn repair_shows_the_plan_refuses_a_locked_directory_and_keeps_records_after_the_damage() {
    let data_dir = tempfile::tempdir().unwrap();
    let dir = data_dir.path().join("t-0");
    let log = PartitionLog::open(&dir, config(), Arc::new(SystemClock)).unwrap();
    for i in 0..40 {
        let mut b = BatchBuilder::new(Compression::None);
        let value = format!("value-{i}-{}", "x".repeat(300));
        b.push(RecordRef {
            timestamp: 1_000 + i,
            key: None,
            value: Some(value.as_bytes()),
            headers: &[],
        });
        log.append_as_leader(&mut b.build(0).unwrap(), LeaderEpoch(0))
            .unwrap();
    }
    let written = values(&log);
    let bases = log.segment_base_offsets();
    drop(log); // crash: no clean-shutdown marker
    let damaged = dir.join(format!("{:020}.log", bases[1].0));
    let mut bytes = std::fs::read(&damaged).unwrap();
    bytes[200] ^= 0x04; // inside the first batch of the second segment
    std::fs::write(&damaged, &bytes).unwrap();
    assert!(matches!(
        PartitionLog::open(&dir, config(), Arc::new(SystemClock)),
        Err(LogError::Damaged(_))
    ));

    // Dry run: the plan, a non-zero exit, and not one byte changed.
    let before = files(&dir);
    let out = repair(&[dir.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains(&format!("drop corrupt: {} bytes 0..", damaged.display())),
        "{stdout}"
    );
    assert!(stdout.contains("(1 records)"), "{stdout}");
    assert!(stdout.contains("dry run: nothing was changed"), "{stdout}");
    assert_eq!(files(&dir), before);

    // A directory a server holds is refused.
    let lock = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(".lock"))
        .unwrap();
    lock.try_lock().unwrap();
    let out = repair(&[
        "--data-dir",
        data_dir.path().to_str().unwrap(),
        "--topic",
        "t",
        "--partition",
        "0",
        "--execute",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: PARTITION_IN_USE: "), "{stderr}");
    assert_eq!(files(&dir), before);
    drop(lock);

    // Execute: only the damaged batch goes; the partition opens with everything else.
    let out = repair(&[
        "--data-dir",
        data_dir.path().to_str().unwrap(),
        "--topic",
        "t",
        "--partition",
        "0",
        "--execute",
    ]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let log = PartitionLog::open(&dir, config(), Arc::new(SystemClock)).unwrap();
    let lost = bases[1].0;
    let expected: Vec<_> = written
        .iter()
        .filter(|(o, _)| *o != lost)
        .cloned()
        .collect();
    assert_eq!(values(&log), expected);
    assert_eq!(log.log_end_offset().0, written.len() as u64);
    drop(log);
    // Nothing left to repair.
    let out = repair(&[dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
