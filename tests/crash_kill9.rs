//! Crash test: a child process appends to a partition and is killed with SIGKILL at a
//! random moment; the parent reopens the directory and checks that every append the
//! child reported as done is there, at its offset, with its bytes, and that new appends
//! continue right after. Several rounds on the same directory, in async and sync flush
//! modes, with small segments so kills land during rolls too.
//!
//! The child is this same test binary, re-run with `--exact crash_child_appender`.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tidelog::partition::{Isolation, PartitionLog, SystemClock};
use tidelog::record::{BatchBuilder, BatchIter, Compression, RecordRef};
use tidelog::topic_config::{FlushMode, TopicConfig};
use tidelog::types::{LeaderEpoch, Offset};

const DIR_ENV: &str = "TIDELOG_CRASH_CHILD_DIR";
const MODE_ENV: &str = "TIDELOG_CRASH_CHILD_MODE";
const ROUND_ENV: &str = "TIDELOG_CRASH_CHILD_ROUND";

fn config(mode: &str) -> TopicConfig {
    TopicConfig {
        segment_bytes: 64 * 1024,
        index_interval_bytes: 512,
        flush_mode: if mode == "sync" {
            FlushMode::Sync
        } else {
            FlushMode::Async
        },
        ..TopicConfig::default()
    }
}

fn value(round: u32, seq: u64, i: usize) -> Vec<u8> {
    let mut v = format!("r{round}-s{seq}-i{i}-").into_bytes();
    v.resize(100 + (seq as usize % 7) * 40, b'v');
    v
}

fn records_per_batch(seq: u64) -> usize {
    1 + (seq % 5) as usize
}

/// Runs in the child process only: appends until killed (bounded in count and time).
#[test]
#[ignore = "helper process for kill9_during_appends_never_loses_acknowledged_batches"]
fn crash_child_appender() {
    let Ok(dir) = std::env::var(DIR_ENV) else {
        return;
    };
    let mode = std::env::var(MODE_ENV).unwrap();
    let round: u32 = std::env::var(ROUND_ENV).unwrap().parse().unwrap();
    let log = PartitionLog::open(Path::new(&dir), config(&mode), Arc::new(SystemClock)).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {}", log.log_end_offset().0).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    for seq in 0..1_000_000u64 {
        if Instant::now() > deadline {
            break;
        }
        let mut b = BatchBuilder::new(Compression::None);
        for i in 0..records_per_batch(seq) {
            let v = value(round, seq, i);
            b.push(RecordRef {
                timestamp: 1,
                key: None,
                value: Some(&v),
                headers: &[],
            });
        }
        let info = log
            .append_as_leader(&mut b.build(0).unwrap(), LeaderEpoch(round as i32))
            .unwrap();
        writeln!(
            out,
            "ACK {seq} {} {}",
            info.first_offset.0, info.last_offset.0
        )
        .unwrap();
        out.flush().unwrap();
    }
}

struct Ack {
    round: u32,
    seq: u64,
    first: u64,
    last: u64,
}

fn seed() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// xorshift: enough randomness for kill timing without a dependency.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn kill9_during_appends_never_loses_acknowledged_batches() {
    let mut rng = seed() | 1;
    eprintln!("seed {rng}");
    for mode in ["async", "sync"] {
        let dir = tempfile::tempdir().unwrap();
        let mut acks: Vec<Ack> = Vec::new();
        for round in 0..4u32 {
            let mut child = Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "crash_child_appender",
                    "--ignored",
                    "--nocapture",
                    "--test-threads",
                    "1",
                ])
                .env(DIR_ENV, dir.path())
                .env(MODE_ENV, mode)
                .env(ROUND_ENV, round.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let stdout = child.stdout.take().unwrap();
            let (first_ack_tx, first_ack_rx) = std::sync::mpsc::channel::<()>();
            let reader = std::thread::spawn(move || {
                let mut lines = Vec::new();
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if line.contains("ACK ") {
                        let _ = first_ack_tx.send(());
                    }
                    lines.push(line);
                }
                lines
            });
            // Wait (bounded) until the child is appending, then kill it at a random moment.
            let started = first_ack_rx.recv_timeout(Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(next(&mut rng) % 300));
            child.kill().unwrap();
            child.wait().unwrap();
            assert!(
                started.is_ok(),
                "round {round}: the child appended nothing within 10 s"
            );
            let lines = reader.join().unwrap();
            let ready: u64 = lines
                .iter()
                .find_map(|l| l.split("READY ").nth(1))
                .unwrap_or_else(|| panic!("child never became ready ({} lines)", lines.len()))
                .trim()
                .parse()
                .unwrap();
            // Every earlier acknowledged batch must have survived the previous kill.
            let expected_end = acks.last().map_or(0, |a| a.last + 1);
            assert!(
                ready >= expected_end,
                "round {round}: log end {ready} < acknowledged {expected_end}"
            );
            // libtest's "test name ... " prefix shares the first line: find markers anywhere.
            for line in &lines {
                let Some(ack) = line.split("ACK ").nth(1) else {
                    continue;
                };
                let parts: Vec<&str> = std::iter::once("ACK")
                    .chain(ack.split_whitespace())
                    .collect();
                if parts.len() == 4 {
                    acks.push(Ack {
                        round,
                        seq: parts[1].parse().unwrap(),
                        first: parts[2].parse().unwrap(),
                        last: parts[3].parse().unwrap(),
                    });
                }
            }
            assert!(
                acks.iter().any(|a| a.round == round),
                "round {round} appended nothing"
            );
        }
        verify(dir.path(), mode, &acks);
    }
}

fn verify(dir: &Path, mode: &str, acks: &[Ack]) {
    let log = PartitionLog::open(dir, config(mode), Arc::new(SystemClock)).unwrap();
    assert!(log.segment_count() > 1, "kills should have spanned rolls");
    for ack in acks {
        let data = log
            .read(Offset(ack.first), 1 << 20, Isolation::LogEnd)
            .unwrap();
        let batch = BatchIter::new(&data.records).next().unwrap().unwrap();
        assert_eq!(
            batch.header().base_offset as u64,
            ack.first,
            "{mode} seq {}",
            ack.seq
        );
        assert_eq!(batch.header().last_offset() as u64, ack.last);
        assert_eq!(batch.header().partition_leader_epoch, ack.round as i32);
        let records = batch.records(1 << 20).unwrap();
        for (i, r) in records.iter().enumerate() {
            assert_eq!(r.value.as_deref(), Some(&value(ack.round, ack.seq, i)[..]));
        }
    }
    // Acknowledged batches tile the offsets with no gap (an unacknowledged batch written
    // just before a kill may follow the last acknowledgement of a round; the next round
    // then continues after it).
    let end = log.log_end_offset().0;
    let last = acks.last().unwrap();
    assert!(end > last.last);
    let info = {
        let mut b = BatchBuilder::new(Compression::None);
        b.push(RecordRef {
            timestamp: 1,
            key: None,
            value: Some(b"after"),
            headers: &[],
        });
        log.append_as_leader(&mut b.build(0).unwrap(), LeaderEpoch(99))
            .unwrap()
    };
    assert_eq!(info.first_offset.0, end);
}
