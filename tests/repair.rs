//! `tidelog repair` run as a real binary on a partition with a corrupt sealed segment, and
//! a server that finds the only copy of a partition damaged.

mod common;

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

/// The only copy of a partition is damaged: the standalone server keeps it offline (no
/// byte cut) and says so in `cluster describe` and `topics describe`, instead of showing a
/// healthy leader.
#[test]
fn the_only_damaged_copy_stays_offline_and_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_ports(1)[0];
    let b = format!("127.0.0.1:{port}");
    let mut server = common::standalone(dir.path(), port);
    let (ok, _, err) = common::cli(&[
        "topics",
        "create",
        "--topic",
        "only",
        "--partitions",
        "1",
        "--config",
        "segment.bytes=2048",
        "--bootstrap",
        &b,
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = common::cli(&[
        "perf",
        "produce",
        "--topic",
        "only",
        "--num-records",
        "300",
        "--record-size",
        "100",
        "--acks",
        "all",
        "--bootstrap",
        &b,
    ]);
    assert!(ok, "{err}");
    assert!(server.terminate().success());
    let first = dir
        .path()
        .join("data")
        .join("only-0")
        .join(format!("{:020}.log", 0));
    let mut bytes = std::fs::read(&first).unwrap();
    let at = bytes.len() - 3;
    bytes[at] ^= 0xff;
    std::fs::write(&first, &bytes).unwrap();

    let _server = common::standalone(dir.path(), port);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let cluster = loop {
        let (ok, out, err) =
            common::cli(&["cluster", "describe", "--output", "json", "--bootstrap", &b]);
        if ok {
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            if v["offline_partitions"] == 1 {
                break v;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never reported offline: {out}{err}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(cluster["offline_partitions"], 1, "{cluster}");
    let (ok, out, err) = common::cli(&["topics", "describe", "--topic", "only", "--bootstrap", &b]);
    assert!(ok, "{err}");
    assert!(out.contains("Offline: 1"), "{out}");
    let (ok, out, _) = common::cli(&[
        "topics",
        "describe",
        "--unavailable-partitions",
        "--bootstrap",
        &b,
    ]);
    assert!(ok && out.contains("Partition: 0"), "{out}");
    // Nothing was cut: the damaged file is as it was.
    assert!(std::fs::read(&first).unwrap() == bytes);
}
