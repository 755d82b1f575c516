//! `tidelog dump-log` run as a real binary against Kafka batches written by an
//! independent implementation, damaged copies of them, and partition index files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use serde_json::Value;
use tidelog::partition::{PartitionLog, SystemClock};
use tidelog::record::{BatchBuilder, Compression, RecordRef};
use tidelog::topic_config::TopicConfig;
use tidelog::types::LeaderEpoch;

fn vectors() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/kafka-record-batches")
}

fn dump(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tidelog"))
        .arg("dump-log")
        .args(args)
        .output()
        .expect("run tidelog")
}

fn json_lines(bytes: &[u8]) -> Vec<Value> {
    String::from_utf8(bytes.to_vec())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn decodes_independent_vectors_exactly() {
    for name in ["basic", "codecs"] {
        let log = vectors().join(format!("{name}.log"));
        let out = dump(&["--output", "json", "--print-data", log.to_str().unwrap()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let expected = json_lines(&std::fs::read(vectors().join(format!("{name}.json"))).unwrap());
        let actual = json_lines(&out.stdout);
        assert_eq!(actual.len(), expected.len(), "{name}");
        for (a, e) in actual.iter().zip(&expected) {
            assert_eq!(a, e, "{name}");
        }
    }
}

#[test]
fn a_corrupt_byte_is_reported_not_hidden() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("00000000000000000000.log");
    let mut bytes = std::fs::read(vectors().join("basic.log")).unwrap();
    bytes[150] ^= 0x40; // inside the second batch's records
    std::fs::write(&path, &bytes).unwrap();
    let out = dump(&["--output", "json", path.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: CORRUPT_MESSAGE: "), "{stderr}");
    let lines = json_lines(&out.stdout);
    let valid: Vec<bool> = lines
        .iter()
        .map(|l| l["crc_valid"].as_bool().unwrap())
        .collect();
    assert_eq!(valid, [true, false, true]);
}

#[test]
fn a_truncated_file_reports_the_incomplete_batch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("00000000000000000000.log");
    let bytes = std::fs::read(vectors().join("basic.log")).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let out = dump(&["--output", "json", "--print-data", path.to_str().unwrap()]);
    assert!(!out.status.success());
    let lines = json_lines(&out.stdout);
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[2]["position"], 212);
    assert!(
        lines[2]["error"].as_str().unwrap().contains("incomplete"),
        "{}",
        lines[2]
    );
    // Table output on garbage: no panic, a clear error.
    std::fs::write(&path, [0xffu8; 40]).unwrap();
    let out = dump(&[path.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("CORRUPT_MESSAGE"));
}

/// A partition in `dir` with `records` one-record batches of 150 bytes (timestamps from
/// 1000) and an index entry every 100 bytes; left open.
fn indexed_log(dir: &Path, records: i64) -> PartitionLog {
    let config = TopicConfig {
        index_interval_bytes: 100,
        ..TopicConfig::default()
    };
    let log = PartitionLog::open(dir, config, Arc::new(SystemClock)).unwrap();
    for i in 0..records {
        let mut b = BatchBuilder::new(Compression::None);
        b.push(RecordRef {
            timestamp: 1_000 + i,
            key: None,
            value: Some(&[b'x'; 150]),
            headers: &[],
        });
        log.append_as_leader(&mut b.build(0).unwrap(), LeaderEpoch(0))
            .unwrap();
    }
    log
}

#[test]
fn index_files_are_dumped_and_checked_against_their_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = indexed_log(dir.path(), 20);
    log.close().unwrap();
    let index = dir.path().join("00000000000000000000.index");
    let out = dump(&["--output", "json", index.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let entries = json_lines(&out.stdout);
    assert!(entries.len() >= 10, "{}", entries.len());
    assert!(entries.iter().all(|e| e["matches_log"] == true));
    let timeindex = dir.path().join("00000000000000000000.timeindex");
    let out = dump(&["--output", "json", timeindex.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = json_lines(&out.stdout).pop().unwrap();
    assert_eq!(last["timestamp"], 1019);
    assert_eq!(last["offset"], 19);

    // Point an entry at the middle of a batch.
    let mut bytes = std::fs::read(&index).unwrap();
    bytes[7] ^= 0x01;
    std::fs::write(&index, &bytes).unwrap();
    let out = dump(&["--output", "json", index.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("CORRUPT_INDEX"));
    assert!(json_lines(&out.stdout)
        .iter()
        .any(|e| e["matches_log"] == false));
}

#[test]
fn unknown_file_kinds_and_missing_files_fail_clearly() {
    let out = dump(&["/nonexistent/00000000000000000000.log"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).starts_with("error: INVALID_ARGUMENT: cannot open")
    );
    let out = dump(&["Cargo.toml"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a .log"));
}

#[test]
fn damage_in_the_middle_is_skipped_and_every_later_batch_listed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("00000000000000000000.log");
    let bytes = std::fs::read(vectors().join("basic.log")).unwrap();
    let clean = json_lines(
        &dump(&[
            "--output",
            "json",
            vectors().join("basic.log").to_str().unwrap(),
        ])
        .stdout,
    );
    assert_eq!(clean.len(), 3);
    let second = clean[1]["position"].as_u64().unwrap() as usize;
    let third = clean[2]["position"].as_u64().unwrap() as usize;
    // The second batch's length field is garbage: it cannot even be framed.
    let mut damaged = bytes.clone();
    damaged[second + 8..second + 12].copy_from_slice(&0x7fff_fff0i32.to_be_bytes());
    std::fs::write(&path, &damaged).unwrap();
    let out = dump(&["--output", "json", "--print-data", path.to_str().unwrap()]);
    assert!(!out.status.success(), "damage must fail the exit status");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("CORRUPT_MESSAGE"), "{stderr}");
    assert!(
        stderr.contains(&format!("skipped bytes {second}..{third}")),
        "{stderr}"
    );
    let lines = json_lines(&out.stdout);
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(lines[0], {
        let mut l = json_lines(
            &dump(&[
                "--output",
                "json",
                "--print-data",
                vectors().join("basic.log").to_str().unwrap(),
            ])
            .stdout,
        );
        l.remove(0)
    });
    assert_eq!(lines[1]["position"], second);
    assert_eq!(lines[1]["skipped_bytes"], third - second);
    assert_eq!(lines[1]["resume_position"], third);
    assert_eq!(lines[2]["position"], third);
    assert_eq!(lines[2]["crc_valid"], true);
    assert!(lines[2]["records"]
        .as_array()
        .is_some_and(|r| !r.is_empty()));
}

/// The active segment's preallocated index lists only the entries written so far, and
/// `dump-log ... | head` ends quietly instead of failing on the closed pipe.
#[test]
fn an_active_index_lists_only_written_entries_and_a_closed_pipe_is_quiet() {
    let dir = tempfile::tempdir().unwrap();
    let log = indexed_log(dir.path(), 3000);
    log.flush().unwrap();
    // Still open: the index file is preallocated past its entries.
    let index = dir.path().join("00000000000000000000.index");
    let out = dump(&["--output", "json", index.to_str().unwrap()]);
    let entries = json_lines(&out.stdout);
    assert!(!entries.is_empty());
    assert!(
        entries.iter().all(|e| e["matches_log"] == true),
        "no preallocated zero slot is listed: {:?}",
        entries.last()
    );
    let slots = std::fs::metadata(&index).unwrap().len() as usize / 8;
    assert!(entries.len() < slots, "{} of {slots} slots", entries.len());

    let segment = dir.path().join("00000000000000000000.log");
    let script = format!(
        "{} dump-log --print-data {} | head -n 1 > /dev/null",
        env!("CARGO_BIN_EXE_tidelog"),
        segment.display()
    );
    let out = Command::new("bash")
        .args(["-c", &format!("set -o pipefail; {script}")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("Broken pipe") && !stderr.contains("IO_ERROR"),
        "{stderr}"
    );
    drop(log);
}
