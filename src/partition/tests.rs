//! Partition log tests: behaviour, crash recovery, and random operation sequences checked
//! against an in-memory model.

use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::record::{BatchBuilder, BatchIter, Compression, RecordBatch, RecordRef};
use crate::topic_config::{FlushMode, TopicConfig};
use crate::types::{LeaderEpoch, Offset};

const T0: i64 = 1_764_670_000_000;

/// A batch of `n` records whose values are `"{tag}-{i}"` padded to `value_len` bytes.
fn batch(tag: &str, n: usize, value_len: usize, timestamp: i64) -> Vec<u8> {
    let mut b = BatchBuilder::new(Compression::None);
    for i in 0..n {
        let mut v = format!("{tag}-{i}").into_bytes();
        v.resize(value_len.max(v.len()), b'.');
        b.push(RecordRef {
            timestamp,
            key: Some(tag.as_bytes()),
            value: Some(&v),
            headers: &[],
        });
    }
    b.build(0).unwrap()
}

fn small_config() -> TopicConfig {
    TopicConfig {
        segment_bytes: 4096,
        index_interval_bytes: 256,
        segment_index_bytes: 4096,
        ..TopicConfig::default()
    }
}

fn open(dir: &Path, config: TopicConfig) -> PartitionLog {
    PartitionLog::open(dir, config, Arc::new(SystemClock)).unwrap()
}

/// Compares record lists by length and first difference, without printing them whole.
#[track_caller]
fn assert_records(actual: &[(u64, Vec<u8>)], expected: &[(u64, Vec<u8>)], context: &str) {
    if let Some(i) = actual.iter().zip(expected).position(|(a, e)| a != e) {
        panic!(
            "{context}: record {i} differs: offset {} {:?} vs expected offset {} {:?}",
            actual[i].0,
            String::from_utf8_lossy(&actual[i].1[..actual[i].1.len().min(16)]),
            expected[i].0,
            String::from_utf8_lossy(&expected[i].1[..expected[i].1.len().min(16)])
        );
    }
    assert_eq!(actual.len(), expected.len(), "{context}: record count");
}

/// Every (offset, value) readable from `from`, following fetches to the log end.
fn read_all(log: &PartitionLog, from: u64) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut next = from;
    let end = log.log_end_offset().0;
    while next < end {
        let data = log.read(Offset(next), 1000, Isolation::LogEnd).unwrap();
        assert!(
            !data.records.is_empty(),
            "no progress at offset {next} (end {end})"
        );
        for b in BatchIter::new(&data.records) {
            for r in b.unwrap().records(1 << 20).unwrap() {
                if r.offset as u64 >= next {
                    assert_eq!(r.offset as u64, next, "offsets must be contiguous");
                    out.push((r.offset as u64, r.value.unwrap().to_vec()));
                    next += 1;
                }
            }
        }
    }
    out
}

#[test]
fn append_assigns_offsets_and_stamps_the_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), TopicConfig::default());
    let info = log
        .append_as_leader(&mut batch("a", 3, 10, T0), LeaderEpoch(4))
        .unwrap();
    assert_eq!(
        (info.first_offset, info.last_offset),
        (Offset(0), Offset(2))
    );
    let info = log
        .append_as_leader(&mut batch("b", 2, 10, T0), LeaderEpoch(4))
        .unwrap();
    assert_eq!(
        (info.first_offset, info.last_offset),
        (Offset(3), Offset(4))
    );
    assert_eq!(log.log_end_offset(), Offset(5));
    let data = log.read(Offset(3), 1 << 20, Isolation::LogEnd).unwrap();
    let (b, _) = RecordBatch::parse(&data.records).unwrap();
    assert_eq!(b.header().base_offset, 3);
    assert_eq!(b.header().partition_leader_epoch, 4);
    b.verify_crc().unwrap();
    assert_eq!(log.latest_epoch(), Some(LeaderEpoch(4)));
    assert_eq!(
        log.end_offset_for_epoch(LeaderEpoch(4)),
        Some((LeaderEpoch(4), Offset(5)))
    );
}

#[test]
fn consumers_never_read_past_the_high_watermark() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), TopicConfig::default());
    log.append_as_leader(&mut batch("a", 3, 10, T0), LeaderEpoch(0))
        .unwrap();
    log.append_as_leader(&mut batch("b", 3, 10, T0), LeaderEpoch(0))
        .unwrap();
    assert_eq!(log.high_watermark(), Offset(0));
    let data = log
        .read(Offset(0), 1 << 20, Isolation::HighWatermark)
        .unwrap();
    assert!(data.records.is_empty());
    log.set_high_watermark(Offset(3));
    let data = log
        .read(Offset(0), 1 << 20, Isolation::HighWatermark)
        .unwrap();
    assert_eq!(BatchIter::new(&data.records).count(), 1);
    assert_eq!(data.high_watermark, Offset(3));
    // A high watermark inside a batch hides that whole batch.
    log.set_high_watermark(Offset(5));
    let data = log
        .read(Offset(3), 1 << 20, Isolation::HighWatermark)
        .unwrap();
    assert!(data.records.is_empty());
    // Followers read everything.
    let data = log.read(Offset(0), 1 << 20, Isolation::LogEnd).unwrap();
    assert_eq!(BatchIter::new(&data.records).count(), 2);
    // Clamped to the log end.
    assert_eq!(log.set_high_watermark(Offset(100)), Offset(6));
}

#[test]
fn a_read_returns_at_least_one_whole_batch() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), TopicConfig::default());
    log.append_as_leader(&mut batch("big", 10, 500, T0), LeaderEpoch(0))
        .unwrap();
    log.append_as_leader(&mut batch("next", 1, 10, T0), LeaderEpoch(0))
        .unwrap();
    let data = log.read(Offset(4), 10, Isolation::LogEnd).unwrap();
    let batches: Vec<_> = BatchIter::new(&data.records).map(|b| b.unwrap()).collect();
    assert_eq!(batches.len(), 1);
    assert!(data.records.len() > 5000);
    assert_eq!(batches[0].header().base_offset, 0);
}

#[test]
fn out_of_range_reads_carry_both_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), TopicConfig::default());
    log.append_as_leader(&mut batch("a", 3, 10, T0), LeaderEpoch(0))
        .unwrap();
    match log.read(Offset(4), 100, Isolation::LogEnd) {
        Err(LogError::OffsetOutOfRange {
            requested: 4,
            log_start_offset: 0,
            log_end_offset: 3,
        }) => {}
        other => panic!("{other:?}"),
    }
    // Reading exactly at the log end is fine: nothing yet.
    assert!(log
        .read(Offset(3), 100, Isolation::LogEnd)
        .unwrap()
        .records
        .is_empty());
}

#[test]
fn oversized_and_invalid_batches_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = TopicConfig {
        max_message_bytes: 1024,
        ..TopicConfig::default()
    };
    let log = open(dir.path(), config);
    let mut big = batch("x", 5, 400, T0);
    let size = big.len();
    match log.append_as_leader(&mut big, LeaderEpoch(0)) {
        Err(LogError::RecordTooLarge {
            size: s,
            limit: 1024,
        }) => assert_eq!(s, size),
        other => panic!("{other:?}"),
    }
    let mut good = batch("ok", 1, 10, T0);
    let mut corrupt = good.clone();
    let last = corrupt.len() - 1;
    corrupt[last] ^= 0xff;
    // A valid batch followed by a corrupt one: the whole request is refused.
    let mut both = good.clone();
    both.extend_from_slice(&corrupt);
    let err = log.append_as_leader(&mut both, LeaderEpoch(0)).unwrap_err();
    assert!(matches!(err, LogError::InvalidRecord { .. }), "{err}");
    assert!(err.to_string().contains("batch 1"), "{err}");
    let mut truncated = good[..good.len() - 3].to_vec();
    assert!(matches!(
        log.append_as_leader(&mut truncated, LeaderEpoch(0)),
        Err(LogError::InvalidRecord { .. })
    ));
    assert!(matches!(
        log.append_as_leader(&mut [], LeaderEpoch(0)),
        Err(LogError::InvalidRecord { .. })
    ));
    assert_eq!(log.log_end_offset(), Offset(0));
    assert_eq!(log.size_bytes(), 0);
    log.append_as_leader(&mut good, LeaderEpoch(0)).unwrap();
    assert_eq!(log.log_end_offset(), Offset(1));
}

#[test]
fn compressed_batches_are_held_to_max_message_bytes_after_decompression() {
    let dir = tempfile::tempdir().unwrap();
    let config = TopicConfig {
        max_message_bytes: 1 << 20,
        ..TopicConfig::default()
    };
    let log = open(dir.path(), config);
    for codec in [
        Compression::Gzip,
        Compression::Snappy,
        Compression::Lz4,
        Compression::Zstd,
    ] {
        let value = vec![0u8; 8 << 20];
        let mut b = BatchBuilder::new(codec);
        b.push(RecordRef {
            timestamp: T0,
            key: None,
            value: Some(&value),
            headers: &[],
        });
        let mut bomb = b.build(0).unwrap();
        // Small enough to pass the check on the batch as sent.
        assert!(bomb.len() < 1 << 20, "{codec}: {}", bomb.len());
        match log.append_as_leader(&mut bomb, LeaderEpoch(0)) {
            Err(LogError::UncompressedTooLarge {
                codec: name,
                compressed_size,
                limit,
                reached,
            }) => {
                assert_eq!(
                    (name, compressed_size, limit),
                    (codec.name(), bomb.len(), 1 << 20)
                );
                assert!(reached > limit && reached < 2 << 20, "{codec}: {reached}");
            }
            other => panic!("{codec}: expected UncompressedTooLarge, got {other:?}"),
        }
        // Just under the limit is accepted.
        let value = vec![0u8; 1000 << 10];
        let mut b = BatchBuilder::new(codec);
        b.push(RecordRef {
            timestamp: T0,
            key: None,
            value: Some(&value),
            headers: &[],
        });
        log.append_as_leader(&mut b.build(0).unwrap(), LeaderEpoch(0))
            .unwrap();
    }
    assert_eq!(log.log_end_offset(), Offset(4));
}

#[test]
fn follower_appends_keep_offsets_and_epochs() {
    let dir = tempfile::tempdir().unwrap();
    let leader_dir = tempfile::tempdir().unwrap();
    let leader = open(leader_dir.path(), TopicConfig::default());
    leader
        .append_as_leader(&mut batch("a", 2, 10, T0), LeaderEpoch(1))
        .unwrap();
    leader
        .append_as_leader(&mut batch("b", 2, 10, T0), LeaderEpoch(3))
        .unwrap();
    let fetched = leader.read(Offset(0), 1 << 20, Isolation::LogEnd).unwrap();

    let follower = open(dir.path(), TopicConfig::default());
    let second = {
        let mut it = BatchIter::new(&fetched.records);
        it.next();
        it.next().unwrap().unwrap().as_bytes().to_vec()
    };
    assert!(matches!(
        follower.append_as_follower(&second),
        Err(LogError::NonContiguousAppend {
            expected: 0,
            got: 2
        })
    ));
    follower.append_as_follower(&fetched.records).unwrap();
    assert_eq!(follower.log_end_offset(), Offset(4));
    assert_eq!(follower.epoch_entries(), leader.epoch_entries());
    assert_eq!(
        follower.end_offset_for_epoch(LeaderEpoch(2)),
        Some((LeaderEpoch(1), Offset(2)))
    );
}

#[test]
fn rolls_on_segment_bytes_and_reads_across_segments() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), small_config());
    for i in 0..40 {
        log.append_as_leader(&mut batch(&format!("r{i}"), 2, 200, T0), LeaderEpoch(0))
            .unwrap();
    }
    assert!(log.segment_count() >= 5, "{}", log.segment_count());
    let all = read_all(&log, 0);
    assert_eq!(all.len(), 80);
    assert!(all[79].1.starts_with(b"r39-1"));
    // Every offset is found by a direct read, too.
    for offset in 0..80u64 {
        let data = log.read(Offset(offset), 1, Isolation::LogEnd).unwrap();
        let (b, _) = RecordBatch::parse(&data.records).unwrap();
        assert!(
            b.header().base_offset as u64 <= offset && offset <= b.header().last_offset() as u64
        );
    }
}

#[test]
fn rolls_on_segment_ms_using_record_timestamps() {
    let dir = tempfile::tempdir().unwrap();
    let config = TopicConfig {
        segment_ms: 1000,
        ..TopicConfig::default()
    };
    let clock = Arc::new(ManualClock::new(T0));
    let log = PartitionLog::open(dir.path(), config, clock).unwrap();
    log.append_as_leader(&mut batch("a", 1, 10, T0), LeaderEpoch(0))
        .unwrap();
    log.append_as_leader(&mut batch("b", 1, 10, T0 + 1000), LeaderEpoch(0))
        .unwrap();
    assert_eq!(log.segment_count(), 1);
    log.append_as_leader(&mut batch("c", 1, 10, T0 + 1001), LeaderEpoch(0))
        .unwrap();
    assert_eq!(log.segment_base_offsets(), vec![Offset(0), Offset(2)]);
}

#[test]
fn rolls_when_the_index_is_full() {
    let dir = tempfile::tempdir().unwrap();
    let config = TopicConfig {
        index_interval_bytes: 0,
        segment_index_bytes: 24, // three offset-index entries, two time-index entries
        ..TopicConfig::default()
    };
    let log = open(dir.path(), config);
    for i in 0..12 {
        log.append_as_leader(&mut batch("i", 1, 10, T0 + i), LeaderEpoch(0))
            .unwrap();
    }
    assert!(log.segment_count() >= 3, "{}", log.segment_count());
    assert_eq!(read_all(&log, 0).len(), 12);
}

#[test]
fn time_retention_deletes_old_segments_below_the_high_watermark() {
    let dir = tempfile::tempdir().unwrap();
    let config = TopicConfig {
        retention_ms: 10_000,
        ..small_config()
    };
    let clock = Arc::new(ManualClock::new(T0));
    let log = PartitionLog::open(dir.path(), config, clock.clone()).unwrap();
    for i in 0..30 {
        log.append_as_leader(&mut batch("t", 2, 200, T0 + i * 100), LeaderEpoch(0))
            .unwrap();
    }
    let segments = log.segment_count();
    assert!(segments > 3);
    clock.set(T0 + 100_000);
    // Nothing is below the high watermark yet.
    assert_eq!(log.apply_retention().unwrap().deleted_segments, 0);
    log.set_high_watermark(log.log_end_offset());
    let outcome = log.apply_retention().unwrap();
    // Everything expired: the active segment is rolled and deleted too.
    assert_eq!(outcome.deleted_segments, segments);
    assert_eq!(log.log_start_offset(), Offset(60));
    assert_eq!(log.log_end_offset(), Offset(60));
    assert!(matches!(
        log.read(Offset(0), 100, Isolation::LogEnd),
        Err(LogError::OffsetOutOfRange {
            log_start_offset: 60,
            ..
        })
    ));
    log.append_as_leader(&mut batch("after", 1, 10, T0 + 100_000), LeaderEpoch(0))
        .unwrap();
    assert_eq!(read_all(&log, 60).len(), 1);
    // Deleted files are gone from the directory.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.ends_with(".deleted")), "{names:?}");
    assert!(
        !names.iter().any(|n| n == "00000000000000000000.log"),
        "{names:?}"
    );
}

#[test]
fn size_retention_keeps_the_log_under_retention_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let config = TopicConfig {
        retention_bytes: 8000,
        retention_ms: -1,
        ..small_config()
    };
    let log = open(dir.path(), config);
    for _ in 0..60 {
        log.append_as_leader(&mut batch("s", 2, 200, T0), LeaderEpoch(0))
            .unwrap();
    }
    log.set_high_watermark(log.log_end_offset());
    let before = log.size_bytes();
    let sizes: Vec<u64> = {
        let bases = log.segment_base_offsets();
        bases
            .iter()
            .map(|b| {
                std::fs::metadata(dir.path().join(format!("{:020}.log", b.0)))
                    .unwrap()
                    .len()
            })
            .collect()
    };
    let outcome = log.apply_retention().unwrap();
    assert!(outcome.deleted_segments > 0);
    // Kafka's rule: a segment goes only if the log stays at or above the limit without it.
    let after = log.size_bytes();
    assert!(
        after >= 8000,
        "deleted too much: {after} of {before}, {sizes:?}"
    );
    assert!(
        after - sizes[outcome.deleted_segments] < 8000,
        "deleted too little: {after} of {before}, {sizes:?}"
    );
    let start = log.log_start_offset();
    assert_eq!(read_all(&log, start.0).len() as u64, 120 - start.0);
}

#[test]
fn truncate_to_cuts_whole_batches_and_epochs() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), small_config());
    for i in 0..20 {
        let epoch = if i < 10 { 1 } else { 2 };
        log.append_as_leader(&mut batch("x", 3, 100, T0), LeaderEpoch(epoch))
            .unwrap();
    }
    log.set_high_watermark(Offset(50));
    // 34 is inside the batch 33..=35: the cut is at 33, and epoch 2 (from 30) stays.
    log.truncate_to(Offset(34)).unwrap();
    assert_eq!(log.log_end_offset(), Offset(33));
    assert_eq!(log.high_watermark(), Offset(33));
    assert_eq!(log.latest_epoch(), Some(LeaderEpoch(2)));
    // Cutting at 30 removes every record of epoch 2, so the epoch goes too.
    log.truncate_to(Offset(30)).unwrap();
    assert_eq!(log.latest_epoch(), Some(LeaderEpoch(1)));
    log.truncate_to(Offset(27)).unwrap();
    assert_eq!(log.log_end_offset(), Offset(27));
    assert_eq!(log.latest_epoch(), Some(LeaderEpoch(1)));
    let info = log
        .append_as_leader(&mut batch("y", 1, 10, T0), LeaderEpoch(3))
        .unwrap();
    assert_eq!(info.first_offset, Offset(27));
    let all = read_all(&log, 0);
    assert_eq!(all.len(), 28);
    assert!(all[27].1.starts_with(b"y-0"));
    drop(log);
    // The truncation survives a crash (no clean close).
    let log = open(dir.path(), small_config());
    assert_eq!(log.log_end_offset(), Offset(28));
    assert_records(&read_all(&log, 0), &all, "after crash");
}

#[test]
fn truncate_fully_restarts_the_log_at_an_offset() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), small_config());
    for _ in 0..10 {
        log.append_as_leader(&mut batch("x", 3, 100, T0), LeaderEpoch(1))
            .unwrap();
    }
    log.truncate_fully_and_start_at(Offset(1000)).unwrap();
    assert_eq!(log.log_start_offset(), Offset(1000));
    assert_eq!(log.log_end_offset(), Offset(1000));
    assert_eq!(log.latest_epoch(), None);
    assert_eq!(log.segment_count(), 1);
    let info = log
        .append_as_leader(&mut batch("y", 2, 10, T0), LeaderEpoch(5))
        .unwrap();
    assert_eq!(info.first_offset, Offset(1000));
    log.close().unwrap();
    let log = open(dir.path(), small_config());
    assert_eq!(log.log_start_offset(), Offset(1000));
    assert_eq!(read_all(&log, 1000).len(), 2);
}

#[test]
fn clean_close_skips_recovery_and_keeps_everything() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), small_config());
    for i in 0..25 {
        log.append_as_leader(&mut batch("c", 2, 150, T0 + i), LeaderEpoch(2))
            .unwrap();
    }
    log.set_high_watermark(Offset(40));
    let before = read_all(&log, 0);
    log.close().unwrap();
    let log = open(dir.path(), small_config());
    assert!(log.opened_after_clean_shutdown());
    assert_eq!(log.high_watermark(), Offset(40));
    assert_records(&read_all(&log, 0), &before, "reopen");
    assert_eq!(log.offset_for_timestamp(T0 + 10).unwrap(), Some(Offset(20)));
    drop(log);
    let log = open(dir.path(), small_config());
    assert!(!log.opened_after_clean_shutdown());
    assert_records(&read_all(&log, 0), &before, "reopen");
}

#[test]
fn a_second_open_of_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _log = open(dir.path(), TopicConfig::default());
    match PartitionLog::open(dir.path(), TopicConfig::default(), Arc::new(SystemClock)) {
        Err(LogError::DirectoryLocked { .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn offset_for_timestamp_finds_the_first_record_at_or_after() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), small_config());
    for i in 0..50 {
        log.append_as_leader(&mut batch("t", 1, 200, T0 + i * 10), LeaderEpoch(0))
            .unwrap();
    }
    assert_eq!(log.offset_for_timestamp(T0).unwrap(), Some(Offset(0)));
    assert_eq!(log.offset_for_timestamp(T0 + 5).unwrap(), Some(Offset(1)));
    assert_eq!(
        log.offset_for_timestamp(T0 + 250).unwrap(),
        Some(Offset(25))
    );
    assert_eq!(
        log.offset_for_timestamp(T0 + 490).unwrap(),
        Some(Offset(49))
    );
    assert_eq!(log.offset_for_timestamp(T0 + 491).unwrap(), None);
}

#[test]
fn max_timestamp_is_the_first_committed_record_with_the_largest_timestamp() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), small_config());
    assert_eq!(log.offset_of_max_timestamp().unwrap(), None, "empty");
    for i in 0..50 {
        // Offsets 20 and 30 share the largest timestamp; 45 is larger but uncommitted.
        let ts = match i {
            20 | 30 => T0 + 10_000,
            45 => T0 + 20_000,
            _ => T0 + i * 10,
        };
        log.append_as_leader(&mut batch("t", 1, 200, ts), LeaderEpoch(0))
            .unwrap();
    }
    assert_eq!(
        log.offset_of_max_timestamp().unwrap(),
        None,
        "nothing committed"
    );
    log.set_high_watermark(Offset(40));
    assert_eq!(
        log.offset_of_max_timestamp().unwrap(),
        Some((Offset(20), T0 + 10_000))
    );
    log.set_high_watermark(Offset(50));
    assert_eq!(
        log.offset_of_max_timestamp().unwrap(),
        Some((Offset(45), T0 + 20_000))
    );
}

#[test]
fn sync_mode_appends_from_many_threads() {
    let dir = tempfile::tempdir().unwrap();
    let config = TopicConfig {
        flush_mode: FlushMode::Sync,
        ..small_config()
    };
    let log = Arc::new(open(dir.path(), config));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let log = log.clone();
            std::thread::spawn(move || {
                for i in 0..25 {
                    let info = log
                        .append_as_leader(
                            &mut batch(&format!("{t}-{i}"), 1, 50, T0),
                            LeaderEpoch(0),
                        )
                        .unwrap();
                    assert!(log.recovery_point() > info.last_offset);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(log.log_end_offset(), Offset(100));
    assert_eq!(read_all(&log, 0).len(), 100);
}

// ---- crash recovery ----

fn active_log_file(dir: &Path) -> std::path::PathBuf {
    let mut logs: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    logs.sort();
    logs.pop().unwrap()
}

/// Writes `batches` batches, crashes (drop without close), and returns what was written.
fn write_and_crash(dir: &Path, config: &TopicConfig, batches: usize) -> Vec<(u64, Vec<u8>)> {
    let log = open(dir, config.clone());
    for i in 0..batches {
        log.append_as_leader(
            &mut batch(&format!("b{i}"), 3, 60, T0 + i as i64),
            LeaderEpoch(1),
        )
        .unwrap();
    }
    let all = read_all(&log, 0);
    drop(log);
    all
}

#[test]
fn a_torn_last_batch_is_cut_at_every_byte_position() {
    let config = small_config();
    let template = tempfile::tempdir().unwrap();
    let written = write_and_crash(template.path(), &config, 12);
    let active = active_log_file(template.path());
    let full = std::fs::read(&active).unwrap();
    let last_batch_start = BatchIter::new(&full)
        .map(|b| b.unwrap().as_bytes().len())
        .collect::<Vec<_>>()
        .iter()
        .rev()
        .skip(1)
        .sum::<usize>();
    let last_batch_records = 3;
    for cut in last_batch_start..full.len() {
        let dir = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(template.path()).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
        let target = dir.path().join(active.file_name().unwrap());
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&target)
            .unwrap();
        f.set_len(cut as u64).unwrap();
        drop(f);
        let log = open(dir.path(), config.clone());
        let expected = &written[..written.len() - last_batch_records];
        assert_records(&read_all(&log, 0), expected, &format!("cut at {cut}"));
        let info = log
            .append_as_leader(&mut batch("new", 1, 10, T0), LeaderEpoch(2))
            .unwrap();
        assert_eq!(info.first_offset.0, expected.len() as u64, "cut at {cut}");
    }
}

#[test]
fn garbage_after_the_last_batch_is_cut() {
    let config = small_config();
    let dir = tempfile::tempdir().unwrap();
    let written = write_and_crash(dir.path(), &config, 5);
    let active = active_log_file(dir.path());
    let mut bytes = std::fs::read(&active).unwrap();
    bytes.extend_from_slice(&[0u8; 100]);
    bytes.extend_from_slice(&[0xab; 77]);
    std::fs::write(&active, &bytes).unwrap();
    let log = open(dir.path(), config);
    assert_records(&read_all(&log, 0), &written, "garbage");
}

/// Start position and size of every batch in a `.log` file.
fn batch_spans(bytes: &[u8]) -> Vec<(usize, usize)> {
    let mut at = 0;
    BatchIter::new(bytes)
        .map(|b| {
            let len = b.unwrap().as_bytes().len();
            at += len;
            (at - len, len)
        })
        .collect()
}

#[test]
fn a_length_pointing_past_the_end_of_the_last_batch_is_cut() {
    let config = small_config();
    let dir = tempfile::tempdir().unwrap();
    let written = write_and_crash(dir.path(), &config, 3);
    let active = active_log_file(dir.path());
    let mut bytes = std::fs::read(&active).unwrap();
    let (last_start, _) = batch_spans(&bytes)[2];
    // The last batch's length now claims a gigabyte: a torn write of its header.
    bytes[last_start + 8..last_start + 12].copy_from_slice(&(1i32 << 30).to_be_bytes());
    std::fs::write(&active, &bytes).unwrap();
    let log = open(dir.path(), config);
    let per_batch = written.len() / 3;
    assert_records(&read_all(&log, 0), &written[..2 * per_batch], "length");
}

#[test]
fn a_bad_length_followed_by_valid_batches_is_reported_not_cut() {
    let config = small_config();
    let dir = tempfile::tempdir().unwrap();
    let written = write_and_crash(dir.path(), &config, 3);
    let active = active_log_file(dir.path());
    let mut bytes = std::fs::read(&active).unwrap();
    let spans = batch_spans(&bytes);
    // The second batch's length now claims a gigabyte; the third is intact.
    bytes[spans[1].0 + 8..spans[1].0 + 12].copy_from_slice(&(1i32 << 30).to_be_bytes());
    std::fs::write(&active, &bytes).unwrap();
    let report = match PartitionLog::open(dir.path(), config, Arc::new(SystemClock)) {
        Err(LogError::Damaged(report)) => report,
        other => panic!("expected a damage report, got {other:?}"),
    };
    let per_batch = (written.len() / 3) as u64;
    assert_eq!(report.ranges.len(), 1, "{report}");
    let range = &report.ranges[0];
    assert_eq!(range.kind, DamageKind::Corrupt);
    assert_eq!(
        (range.start_position, range.end_position),
        (spans[1].0 as u64, spans[2].0 as u64)
    );
    assert_eq!(
        (range.first_offset, range.resume_offset),
        (per_batch, Some(2 * per_batch))
    );
    assert_eq!(std::fs::read(&active).unwrap(), bytes, "nothing was cut");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A flipped byte anywhere in the active segment, then a crash: in the last batch it
    /// looks like a torn write and recovery cuts exactly that batch; in an earlier batch
    /// (valid batches follow) the open fails with a damage report naming that batch and
    /// the file is left as it was. A flip in the leader-epoch field (outside the CRC by
    /// design) leaves the data intact. Nothing damaged is ever served.
    #[test]
    fn a_flipped_byte_in_the_active_segment_is_never_served(at in any::<prop::sample::Index>(), mask in 1u8..=255) {
        let config = TopicConfig { segment_bytes: 1 << 20, ..small_config() };
        let dir = tempfile::tempdir().unwrap();
        let written = write_and_crash(dir.path(), &config, 6);
        let active = active_log_file(dir.path());
        let mut bytes = std::fs::read(&active).unwrap();
        let i = at.index(bytes.len());
        bytes[i] ^= mask;
        std::fs::write(&active, &bytes).unwrap();
        let batch_len = bytes.len() / 6;
        let damaged_batch = i / batch_len;
        let offset_in_batch = i % batch_len;
        match PartitionLog::open(dir.path(), config, Arc::new(SystemClock)) {
            Ok(log) => {
                let recovered = read_all(&log, 0);
                assert_records(&recovered, &written[..recovered.len()], "flip");
                if (12..16).contains(&offset_in_batch) {
                    // partition_leader_epoch: not covered by the CRC; the data is intact.
                    prop_assert_eq!(recovered.len(), written.len());
                } else {
                    prop_assert_eq!(damaged_batch, 5, "only the last batch may be cut");
                    prop_assert_eq!(recovered.len(), 15);
                }
            }
            Err(LogError::Damaged(report)) => {
                prop_assert!(damaged_batch < 5, "{}", report);
                prop_assert_eq!(report.ranges.len(), 1);
                let r = &report.ranges[0];
                prop_assert_eq!(r.start_position, (damaged_batch * batch_len) as u64);
                prop_assert_eq!(r.end_position, ((damaged_batch + 1) * batch_len) as u64);
                prop_assert_eq!(r.first_offset, damaged_batch as u64 * 3);
                prop_assert_eq!(r.resume_offset, Some(damaged_batch as u64 * 3 + 3));
                prop_assert_eq!(std::fs::read(&active).unwrap(), bytes);
            }
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }
}

/// Every (offset, value) readable from `from` to the log end, allowing offset gaps.
fn read_all_with_gaps(log: &PartitionLog, from: u64) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut next = from;
    let end = log.log_end_offset().0;
    while next < end {
        let data = log.read(Offset(next), 1000, Isolation::LogEnd).unwrap();
        assert!(!data.records.is_empty(), "no progress at offset {next}");
        for b in BatchIter::new(&data.records) {
            for r in b.unwrap().records(1 << 20).unwrap() {
                if r.offset as u64 >= next {
                    out.push((r.offset as u64, r.value.unwrap().to_vec()));
                    next = r.offset as u64 + 1;
                }
            }
        }
    }
    out
}

/// Every file of a directory with its bytes, sorted by name.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

/// What was written, the damaged file, and the damaged batch's (position, size).
type SealedFlip = (Vec<(u64, Vec<u8>)>, std::path::PathBuf, (usize, usize));

/// A 4-segment log written and then crashed (recovery point 0), with one byte flipped
/// inside the records of the third batch of the second (sealed) segment. Returns what
/// was written, the damaged file, and the damaged batch's (position, size).
fn sealed_segment_flip(dir: &Path, config: &TopicConfig) -> SealedFlip {
    let log = open(dir, config.clone());
    for i in 0..40 {
        log.append_as_leader(&mut batch(&format!("s{i}"), 2, 150, T0 + i), LeaderEpoch(0))
            .unwrap();
    }
    let written = read_all(&log, 0);
    let bases = log.segment_base_offsets();
    assert!(bases.len() >= 4, "{bases:?}");
    drop(log); // unclean: no clean-shutdown marker
    let damaged = dir.join(format!("{:020}.log", bases[1].0));
    let mut bytes = std::fs::read(&damaged).unwrap();
    let span = batch_spans(&bytes)[2];
    bytes[span.0 + span.1 - 20] ^= 0x10;
    std::fs::write(&damaged, &bytes).unwrap();
    (written, damaged, span)
}

#[test]
fn a_flipped_byte_in_a_sealed_segment_loses_no_later_segment_after_an_unclean_restart() {
    let config = small_config();
    let dir = tempfile::tempdir().unwrap();
    let (written, damaged, span) = sealed_segment_flip(dir.path(), &config);
    let before = snapshot(dir.path());
    let report = match PartitionLog::open(dir.path(), config.clone(), Arc::new(SystemClock)) {
        Err(LogError::Damaged(report)) => report,
        Ok(log) => panic!(
            "opened with log end {} of {}: damage was cut instead of reported",
            log.log_end_offset().0,
            written.len()
        ),
        Err(e) => panic!("expected a damage report, got {e}"),
    };
    assert_eq!(report.ranges.len(), 1, "{report}");
    let range = &report.ranges[0];
    assert_eq!(range.kind, DamageKind::Corrupt);
    assert_eq!(range.file, damaged);
    assert_eq!(
        (range.start_position, range.end_position),
        (span.0 as u64, (span.0 + span.1) as u64)
    );
    let damaged_base: u64 = damaged
        .file_stem()
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(range.first_offset, damaged_base + 4);
    assert_eq!(range.resume_offset, Some(damaged_base + 6));
    // Every segment file is still there, byte for byte (indexes may be rebuilt).
    let logs = |files: &[(String, Vec<u8>)]| -> Vec<(String, Vec<u8>)> {
        files
            .iter()
            .filter(|(n, _)| n.ends_with(".log"))
            .cloned()
            .collect()
    };
    assert_eq!(logs(&snapshot(dir.path())), logs(&before));
    // And it keeps being reported, not silently accepted, on the next try.
    assert!(matches!(
        PartitionLog::open(dir.path(), config, Arc::new(SystemClock)),
        Err(LogError::Damaged(_))
    ));
}

#[test]
fn repair_dry_run_changes_nothing_and_execute_keeps_every_valid_record() {
    let config = small_config();
    let dir = tempfile::tempdir().unwrap();
    let (written, damaged, span) = sealed_segment_flip(dir.path(), &config);
    // Recovery indexes the segments first; the dry run must then change nothing at all.
    let _ = PartitionLog::open(dir.path(), config.clone(), Arc::new(SystemClock));
    let before = snapshot(dir.path());
    let plan = repair::plan(dir.path()).unwrap();
    assert_eq!(plan.drops.len(), 1);
    let drop_action = plan.drops[0].clone();
    assert_eq!(drop_action.file, damaged);
    assert_eq!(drop_action.damage.start_position, span.0 as u64);
    assert_eq!(drop_action.bytes(), span.1 as u64);
    assert_eq!(drop_action.offsets(), 2);
    drop(plan);
    assert_eq!(snapshot(dir.path()), before, "a dry run changes nothing");

    let plan = repair::plan(dir.path()).unwrap();
    repair::execute(&plan).unwrap();
    drop(plan);
    let log = open(dir.path(), config.clone());
    let lost = drop_action.damage.first_offset..drop_action.end_offset;
    let expected: Vec<_> = written
        .iter()
        .filter(|(o, _)| !lost.contains(o))
        .cloned()
        .collect();
    assert_eq!(expected.len(), written.len() - 2);
    assert_records(&read_all_with_gaps(&log, 0), &expected, "after repair");
    assert_eq!(log.log_end_offset().0, written.len() as u64);
    // A read inside the dropped range lands on the next record.
    let data = log.read(Offset(lost.start), 1, Isolation::LogEnd).unwrap();
    let (b, _) = RecordBatch::parse(&data.records).unwrap();
    assert_eq!(b.header().base_offset as u64, lost.end);
    let info = log
        .append_as_leader(&mut batch("after", 1, 10, T0), LeaderEpoch(1))
        .unwrap();
    assert_eq!(info.first_offset.0, written.len() as u64);
    // The repaired partition survives a crash and a clean restart alike.
    drop(log);
    let log = open(dir.path(), config.clone());
    assert_eq!(read_all_with_gaps(&log, 0).len(), expected.len() + 1);
    log.close().unwrap();
    let log = open(dir.path(), config);
    assert_eq!(read_all_with_gaps(&log, 0).len(), expected.len() + 1);
    assert!(
        repair::plan(dir.path()).is_err(),
        "the open partition is locked"
    );
}

#[test]
fn a_clean_restart_reports_a_corrupt_batch_in_the_tail_it_reads() {
    let config = small_config();
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), config.clone());
    for i in 0..5 {
        log.append_as_leader(&mut batch(&format!("c{i}"), 2, 20, T0), LeaderEpoch(0))
            .unwrap();
    }
    log.close().unwrap();
    let active = active_log_file(dir.path());
    let mut bytes = std::fs::read(&active).unwrap();
    let spans = batch_spans(&bytes);
    // The last batch: after a clean shutdown even a damaged suffix is not a torn write.
    bytes[spans[4].0 + 40] ^= 0x01;
    std::fs::write(&active, &bytes).unwrap();
    match PartitionLog::open(dir.path(), config, Arc::new(SystemClock)) {
        Err(LogError::Damaged(report)) => {
            assert_eq!(report.ranges.len(), 1, "{report}");
            assert_eq!(report.ranges[0].start_position, spans[4].0 as u64);
            assert_eq!(report.ranges[0].first_offset, 8);
        }
        other => panic!("expected a damage report, got {other:?}"),
    }
    assert_eq!(std::fs::read(&active).unwrap(), bytes, "nothing was cut");
}

#[test]
fn deleted_or_corrupt_index_files_are_rebuilt() {
    let config = small_config();
    for damage in ["delete", "garbage", "zeros"] {
        for clean in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let log = open(dir.path(), config.clone());
            for i in 0..40 {
                log.append_as_leader(&mut batch(&format!("i{i}"), 2, 150, T0 + i), LeaderEpoch(0))
                    .unwrap();
            }
            let written = read_all(&log, 0);
            if clean {
                log.close().unwrap();
            } else {
                drop(log);
            }
            for entry in std::fs::read_dir(dir.path()).unwrap() {
                let path = entry.unwrap().path();
                let ext = path.extension().map(|e| e.to_string_lossy().into_owned());
                if ext.as_deref() == Some("index") || ext.as_deref() == Some("timeindex") {
                    match damage {
                        "delete" => std::fs::remove_file(&path).unwrap(),
                        "garbage" => std::fs::write(&path, [0x5a; 96]).unwrap(),
                        _ => std::fs::write(&path, [0u8; 96]).unwrap(),
                    }
                }
            }
            let log = open(dir.path(), config.clone());
            assert_records(
                &read_all(&log, 0),
                &written,
                &format!("{damage} clean={clean}"),
            );
            for offset in 0..80u64 {
                let data = log.read(Offset(offset), 1, Isolation::LogEnd).unwrap();
                let (b, _) = RecordBatch::parse(&data.records).unwrap();
                assert!(
                    b.header().base_offset as u64 <= offset
                        && offset <= b.header().last_offset() as u64
                );
            }
            assert_eq!(
                log.offset_for_timestamp(T0 + 20).unwrap(),
                Some(Offset(40)),
                "{damage} clean={clean}"
            );
        }
    }
}

#[test]
fn a_corrupt_sealed_segment_is_reported_on_read_not_served() {
    let config = small_config();
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), config.clone());
    for i in 0..40 {
        log.append_as_leader(&mut batch(&format!("s{i}"), 2, 150, T0), LeaderEpoch(0))
            .unwrap();
    }
    log.close().unwrap();
    // Damage a record byte in the first (sealed) segment after a clean shutdown.
    let first = dir.path().join("00000000000000000000.log");
    let mut bytes = std::fs::read(&first).unwrap();
    bytes[100] ^= 0x01;
    std::fs::write(&first, &bytes).unwrap();
    let log = open(dir.path(), config);
    // Without the CRC check (a broker serving consumers, which check it) the batch is
    // returned as stored, whole, and the consumer's check catches it.
    let unchecked = log
        .read_with(
            Offset(0),
            1 << 20,
            Isolation::LogEnd,
            ReadOptions {
                verify_crc: false,
                cached_only: false,
            },
        )
        .unwrap();
    let first_batch = BatchIter::new(&unchecked.records).next().unwrap().unwrap();
    assert!(first_batch.verify_crc().is_err());
    match log.read(Offset(0), 1 << 20, Isolation::LogEnd) {
        Err(LogError::Corrupt { path, reason }) => {
            assert!(path.ends_with("00000000000000000000.log"));
            assert!(reason.contains("CRC"), "{reason}");
        }
        other => panic!("expected a corruption error, got {other:?}"),
    }
    // The server knows too, not only the client that fetched.
    let seen = log.damage_seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(seen[0].file.ends_with("00000000000000000000.log"));
    assert_eq!((seen[0].start_position, seen[0].first_offset), (0, 0));
}

#[test]
fn a_corrupt_epoch_checkpoint_is_rebuilt_from_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), small_config());
    log.append_as_leader(&mut batch("a", 2, 10, T0), LeaderEpoch(1))
        .unwrap();
    log.append_as_leader(&mut batch("b", 2, 10, T0), LeaderEpoch(4))
        .unwrap();
    let entries = log.epoch_entries();
    log.close().unwrap();
    std::fs::write(dir.path().join("leader-epoch-checkpoint"), "garbage").unwrap();
    let log = open(dir.path(), small_config());
    assert_eq!(log.epoch_entries(), entries);
}

#[test]
fn leftover_temporary_and_deleted_files_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    write_and_crash(dir.path(), &small_config(), 2);
    std::fs::write(dir.path().join("log-offsets-checkpoint.tmp"), "x").unwrap();
    std::fs::write(dir.path().join("00000000000000000099.log.deleted"), "x").unwrap();
    std::fs::write(dir.path().join("00000000000000000077.index"), "x").unwrap();
    let log = open(dir.path(), small_config());
    assert_eq!(log.log_end_offset(), Offset(6));
    for name in [
        "log-offsets-checkpoint.tmp",
        "00000000000000000099.log.deleted",
        "00000000000000000077.index",
    ] {
        assert!(!dir.path().join(name).exists(), "{name}");
    }
}

// ---- random operation sequences against a model ----

#[derive(Debug, Clone)]
enum Op {
    Append { records: usize, value_len: usize },
    Roll,
    TruncateTo(u64),
    Reopen { clean: bool },
    Read(u64),
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1usize..5, 0usize..300).prop_map(|(records, value_len)| Op::Append { records, value_len }),
        1 => Just(Op::Roll),
        1 => (0u64..100).prop_map(Op::TruncateTo),
        1 => any::<bool>().prop_map(|clean| Op::Reopen { clean }),
        2 => (0u64..100).prop_map(Op::Read),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn random_operations_match_a_vec_model(ops in proptest::collection::vec(arb_op(), 1..40)) {
        let dir = tempfile::tempdir().unwrap();
        let config = TopicConfig { segment_bytes: 2048, index_interval_bytes: 128, segment_index_bytes: 256, ..TopicConfig::default() };
        let mut log = Some(open(dir.path(), config.clone()));
        // The model: value of every record, by offset; and batch boundaries.
        let mut model: Vec<Vec<u8>> = Vec::new();
        let mut batch_starts: Vec<u64> = Vec::new();
        let mut serial = 0;
        for op in ops {
            let l = log.as_ref().unwrap();
            match op {
                Op::Append { records, value_len } => {
                    serial += 1;
                    let tag = format!("s{serial}");
                    let info = l.append_as_leader(&mut batch(&tag, records, value_len, T0), LeaderEpoch(0)).unwrap();
                    prop_assert_eq!(info.first_offset.0, model.len() as u64);
                    batch_starts.push(model.len() as u64);
                    for i in 0..records {
                        let mut v = format!("{tag}-{i}").into_bytes();
                        v.resize(value_len.max(v.len()), b'.');
                        model.push(v);
                    }
                }
                Op::Roll => l.roll().unwrap(),
                Op::TruncateTo(target) => {
                    l.truncate_to(Offset(target)).unwrap();
                    if (target as usize) < model.len() {
                        // Cut at the start of the batch holding the target.
                        let cut = *batch_starts.iter().rev().find(|&&s| s <= target).unwrap_or(&0);
                        model.truncate(cut as usize);
                        batch_starts.retain(|&s| s < cut);
                    }
                }
                Op::Reopen { clean } => {
                    let l = log.take().unwrap();
                    if clean { l.close().unwrap() } else { drop(l) }
                    log = Some(open(dir.path(), config.clone()));
                }
                Op::Read(offset) => {
                    let result = l.read(Offset(offset), 500, Isolation::LogEnd);
                    if offset > model.len() as u64 {
                        let is_out_of_range = matches!(result, Err(LogError::OffsetOutOfRange { .. }));
                        prop_assert!(is_out_of_range);
                    } else {
                        let data = result.unwrap();
                        prop_assert_eq!(data.records.is_empty(), offset == model.len() as u64);
                        if let Some(first) = BatchIter::new(&data.records).next() {
                            // The first batch holds the offset, and its record there is the model's.
                            let records = first.unwrap().records(1 << 20).unwrap();
                            let found = records.iter().find(|r| r.offset as u64 == offset);
                            prop_assert!(found.is_some(), "offset {} not in the first batch", offset);
                            let value = found.unwrap().value.as_deref().unwrap();
                            prop_assert_eq!(value, &model[offset as usize][..]);
                        }
                    }
                }
            }
            let l = log.as_ref().unwrap();
            prop_assert_eq!(l.log_end_offset().0, model.len() as u64);
        }
        let l = log.as_ref().unwrap();
        let all = read_all(l, 0);
        prop_assert_eq!(all.len(), model.len());
        for (offset, value) in all {
            prop_assert_eq!(&value, &model[offset as usize]);
        }
    }
}

#[test]
fn async_flush_policy_follows_flush_messages_and_flush_ms() {
    let dir = tempfile::tempdir().unwrap();
    let config = TopicConfig {
        flush_messages: 5,
        flush_ms: 1000,
        ..TopicConfig::default()
    };
    let clock = Arc::new(ManualClock::new(T0));
    let log = PartitionLog::open(dir.path(), config, clock.clone()).unwrap();
    log.append_as_leader(&mut batch("a", 3, 10, T0), LeaderEpoch(0))
        .unwrap();
    assert_eq!(
        log.recovery_point(),
        Offset(0),
        "3 records < flush.messages"
    );
    log.append_as_leader(&mut batch("b", 2, 10, T0), LeaderEpoch(0))
        .unwrap();
    assert_eq!(log.recovery_point(), Offset(5), "flush.messages reached");
    log.append_as_leader(&mut batch("c", 1, 10, T0), LeaderEpoch(0))
        .unwrap();
    assert!(!log.maybe_flush().unwrap(), "flush.ms not yet due");
    assert_eq!(log.recovery_point(), Offset(5));
    clock.advance(1000);
    assert!(log.maybe_flush().unwrap());
    assert_eq!(log.recovery_point(), Offset(6));
    assert!(!log.maybe_flush().unwrap(), "nothing left to flush");
}

/// A batch of `n` records of idempotent producer `pid` starting at sequence `seq`.
fn producer_batch(tag: &str, n: usize, pid: i64, epoch: i16, seq: i32) -> Vec<u8> {
    let mut b = BatchBuilder::new(Compression::None).producer(pid, epoch, seq);
    for i in 0..n {
        let v = format!("{tag}-{i}");
        b.push(RecordRef {
            timestamp: T0,
            key: None,
            value: Some(v.as_bytes()),
            headers: &[],
        });
    }
    b.build(0).unwrap()
}

/// A producer's request carries several batches of one partition back to back
/// (`client::accumulator::DRAIN_BATCHES_MAX` of them at most): a retry of the whole
/// request is recognised while it holds no more than the batches the log keeps per
/// producer, and refused beyond that, although it was written.
#[test]
fn a_retried_request_of_several_batches_is_recognised_up_to_the_kept_batches() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), TopicConfig::default());
    let request = |pid: i64, batches: usize| -> Vec<u8> {
        (0..batches)
            .flat_map(|i| producer_batch(&format!("r{i}"), 3, pid, 0, 3 * i as i32))
            .collect()
    };
    let kept = producer_state::RETAINED_BATCHES;
    let first = log
        .append_as_leader(&mut request(7, kept), LeaderEpoch(0))
        .unwrap();
    assert!(!first.duplicate);
    assert_eq!(log.log_end_offset(), Offset(3 * kept as u64));
    let retry = log
        .append_as_leader(&mut request(7, kept), LeaderEpoch(0))
        .unwrap();
    assert!(retry.duplicate, "a retry of {kept} batches is recognised");
    assert_eq!(
        (retry.first_offset, retry.last_offset),
        (Offset(0), Offset(3 * kept as u64 - 1))
    );
    assert_eq!(log.log_end_offset(), Offset(3 * kept as u64));

    let end = log.log_end_offset();
    log.append_as_leader(&mut request(8, kept + 1), LeaderEpoch(0))
        .unwrap();
    let retry = log.append_as_leader(&mut request(8, kept + 1), LeaderEpoch(0));
    assert!(
        matches!(retry, Err(LogError::Sequence(_))),
        "the first of {} batches is forgotten: {retry:?}",
        kept + 1
    );
    assert_eq!(log.log_end_offset(), Offset(end.0 + 3 * (kept as u64 + 1)));
}

#[test]
fn idempotent_retries_are_not_written_twice_even_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), TopicConfig::default());
    let first = log
        .append_as_leader(&mut producer_batch("a", 3, 9, 0, 0), LeaderEpoch(0))
        .unwrap();
    assert!(!first.duplicate);
    let second = log
        .append_as_leader(&mut producer_batch("b", 2, 9, 0, 3), LeaderEpoch(0))
        .unwrap();
    assert_eq!(second.first_offset, Offset(3));
    // A retry of the first batch: its original offsets, nothing written.
    let retry = log
        .append_as_leader(&mut producer_batch("a", 3, 9, 0, 0), LeaderEpoch(0))
        .unwrap();
    assert!(retry.duplicate);
    assert_eq!(
        (retry.first_offset, retry.last_offset),
        (Offset(0), Offset(2))
    );
    assert_eq!(log.log_end_offset(), Offset(5));
    // A gap is refused and writes nothing.
    let gap = log.append_as_leader(&mut producer_batch("c", 1, 9, 0, 7), LeaderEpoch(0));
    assert!(
        matches!(
            gap,
            Err(LogError::Sequence(
                producer_state::SequenceError::OutOfOrder { expected: 5, .. }
            ))
        ),
        "{gap:?}"
    );
    assert_eq!(log.log_end_offset(), Offset(5));
    // After a crash (no clean close, no snapshot) the state is rebuilt from the log.
    drop(log);
    let log = open(dir.path(), TopicConfig::default());
    let retry = log
        .append_as_leader(&mut producer_batch("b", 2, 9, 0, 3), LeaderEpoch(0))
        .unwrap();
    assert!(retry.duplicate, "state rebuilt from the log after a crash");
    assert_eq!(retry.first_offset, Offset(3));
    // After a clean close it comes from the snapshot.
    log.close().unwrap();
    let log = open(dir.path(), TopicConfig::default());
    assert!(
        log.append_as_leader(&mut producer_batch("b", 2, 9, 0, 3), LeaderEpoch(0))
            .unwrap()
            .duplicate
    );
    // Truncation forgets the batches it removes: the same batch may be written again.
    log.truncate_to(Offset(3)).unwrap();
    let again = log
        .append_as_leader(&mut producer_batch("b", 2, 9, 0, 3), LeaderEpoch(1))
        .unwrap();
    assert!(!again.duplicate);
    assert_eq!(again.first_offset, Offset(3));
    // Followers record what they copy, so a later leader dedupes too.
    let follower_dir = tempfile::tempdir().unwrap();
    let follower = open(follower_dir.path(), TopicConfig::default());
    let data = log.read(Offset(0), 1 << 20, Isolation::LogEnd).unwrap();
    follower.append_as_follower(&data.records).unwrap();
    assert!(
        follower
            .append_as_leader(&mut producer_batch("b", 2, 9, 0, 3), LeaderEpoch(2))
            .unwrap()
            .duplicate
    );
}

#[test]
fn advancing_the_log_start_hides_and_deletes_what_is_below() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), small_config());
    for i in 0..40 {
        log.append_as_leader(&mut batch(&format!("d{i}"), 2, 150, T0), LeaderEpoch(0))
            .unwrap();
    }
    let segments = log.segment_count();
    assert!(segments > 3);
    // Never past the high watermark.
    log.set_high_watermark(Offset(30));
    assert_eq!(log.advance_log_start(Offset(50)).unwrap(), Offset(30));
    assert!(
        log.segment_count() < segments,
        "whole segments below are deleted"
    );
    assert!(matches!(
        log.read(Offset(29), 1 << 20, Isolation::LogEnd),
        Err(LogError::OffsetOutOfRange {
            log_start_offset: 30,
            ..
        })
    ));
    assert_eq!(read_all(&log, 30).first().map(|r| r.0), Some(30));
    // It survives a reopen, and never moves back.
    drop(log);
    let log = open(dir.path(), small_config());
    assert_eq!(log.log_start_offset(), Offset(30));
    assert_eq!(log.advance_log_start(Offset(10)).unwrap(), Offset(30));
}

// ---- failed mutations ----

/// A log of several segments, for truncation tests.
fn multi_segment_log(dir: &Path) -> (PartitionLog, Vec<(u64, Vec<u8>)>) {
    let log = open(dir, small_config());
    for i in 0..30 {
        log.append_as_leader(&mut batch(&format!("m{i}"), 2, 150, T0 + i), LeaderEpoch(0))
            .unwrap();
    }
    let written = read_all(&log, 0);
    assert!(log.segment_count() >= 3);
    (log, written)
}

#[test]
fn a_failed_truncation_takes_the_partition_offline_and_never_panics() {
    use super::log::FaultSite;
    let cases: [(&str, FaultSite); 6] = [
        ("truncate_to", FaultSite::MarkDeleted),
        ("truncate_to", FaultSite::TruncateSegment),
        ("truncate_to", FaultSite::DeleteFiles),
        ("truncate_fully", FaultSite::MarkDeleted),
        ("truncate_fully", FaultSite::CreateSegment),
        ("truncate_fully", FaultSite::DeleteFiles),
    ];
    for (op, site) in cases {
        let context = format!("{op} failing at {site:?}");
        let dir = tempfile::tempdir().unwrap();
        let (log, written) = multi_segment_log(dir.path());
        log.inject_fault(site);
        let result = match op {
            "truncate_to" => log.truncate_to(Offset(5)),
            _ => log.truncate_fully_and_start_at(Offset(1000)),
        };
        assert!(
            result.is_err(),
            "{context}: the injected fault must surface"
        );
        assert!(log.offline_reason().is_some(), "{context}: must go offline");
        // Nothing panics and every call answers.
        let _ = (
            log.log_end_offset(),
            log.log_start_offset(),
            log.high_watermark(),
        );
        let _ = (log.segment_count(), log.size_bytes(), log.latest_epoch());
        assert!(log.segment_count() > 0, "{context}");
        assert!(
            matches!(
                log.read(Offset(0), 1000, Isolation::LogEnd),
                Err(LogError::Offline { .. })
            ),
            "{context}"
        );
        assert!(
            matches!(
                log.append_as_leader(&mut batch("x", 1, 10, T0), LeaderEpoch(0)),
                Err(LogError::Offline { .. })
            ),
            "{context}"
        );
        assert!(log.truncate_to(Offset(0)).is_err(), "{context}");
        // The files on disk reopen as either the old log or a prefix of it.
        drop(log);
        let log = open(dir.path(), small_config());
        let end = log.log_end_offset().0;
        if log.log_start_offset().0 == 1000 {
            assert_eq!(end, 1000, "{context}");
        } else {
            assert_records(&read_all(&log, 0), &written[..end as usize], &context);
        }
    }
}

#[test]
fn a_log_closed_while_still_held_refuses_writes_and_reopens_clean() {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(open(dir.path(), small_config()));
    log.append_as_leader(&mut batch("h", 2, 100, T0), LeaderEpoch(1))
        .unwrap();
    let held = log.clone(); // a request or a fetcher still holding the partition
    log.close_in_place().unwrap();
    let late = held.append_as_leader(&mut batch("late", 2, 100, T0), LeaderEpoch(1));
    assert!(
        matches!(late, Err(LogError::Offline { .. })),
        "a closed log takes no writes: {late:?}"
    );
    drop((log, held));
    let log = open(dir.path(), small_config());
    assert!(log.opened_after_clean_shutdown());
    assert_eq!(log.log_end_offset(), Offset(2));
}

// ---- storage faults at random points ----

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A write fails at a random point (EIO or ENOSPC, after writing none, part or all
    /// of its bytes) or an fsync fails. Nothing panics; a full disk leaves the partition
    /// online, readable and writable again once space returns; any other fault takes it
    /// offline. After a reopen (recovery), every acknowledged record is at its offset,
    /// and at most the unacknowledged append follows.
    #[test]
    fn storage_faults_never_lose_acknowledged_records(
        before in 0usize..40,
        fault in 0u8..4,
        written in 0usize..420,
        after in 0usize..8,
    ) {
        use super::log::FaultSite;
        let dir = tempfile::tempdir().unwrap();
        let config = TopicConfig { flush_mode: FlushMode::Sync, ..small_config() };
        let log = open(dir.path(), config.clone());
        let append = |log: &PartitionLog, i: usize| {
            log.append_as_leader(&mut batch(&format!("f{i}"), 2, 150, T0 + i as i64), LeaderEpoch(0))
        };
        for i in 0..before {
            append(&log, i).unwrap();
        }
        let mut acked = read_all(&log, 0);
        match fault {
            0 => crate::segment::fail_next_append(written, libc::EIO),
            1 => crate::segment::fail_next_append(written, libc::ENOSPC),
            2 => crate::segment::fail_next_append(0, libc::ENOSPC),
            _ => log.inject_fault(FaultSite::Fsync),
        }
        prop_assert!(append(&log, before).is_err(), "the fault surfaces");
        let no_space = fault == 1 || fault == 2;
        prop_assert_eq!(log.offline_reason().is_none(), no_space);
        if no_space {
            assert_records(&read_all(&log, 0), &acked, "reads go on on a full disk");
            for j in 0..after {
                append(&log, before + 1 + j).unwrap();
            }
            let now = read_all(&log, 0);
            prop_assert_eq!(now.len(), acked.len() + 2 * after);
            assert_records(&now[..acked.len()], &acked, "writes resume after the old end");
            acked = now;
        } else {
            let refused = matches!(append(&log, 99), Err(LogError::Offline { .. }));
            prop_assert!(refused, "an offline partition refuses writes");
        }
        drop(log);
        let log = open(dir.path(), config);
        let recovered = read_all(&log, 0);
        prop_assert!(recovered.len() >= acked.len(), "{} < {}", recovered.len(), acked.len());
        prop_assert!(recovered.len() <= acked.len() + 2, "only the failed append may follow");
        assert_records(&recovered[..acked.len()], &acked, "acknowledged records survive");
        append(&log, 1000).unwrap();
    }
}

#[test]
fn a_checkpoint_of_an_unchanged_partition_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), small_config());
    log.append_as_leader(&mut batch("c", 2, 100, T0), LeaderEpoch(1))
        .unwrap();
    log.flush().unwrap();
    log.checkpoint().unwrap();
    let file = dir.path().join(super::loader::OFFSETS_CHECKPOINT);
    assert!(file.exists());
    // Gone behind the log's back: an unchanged partition does not write it again...
    std::fs::remove_file(&file).unwrap();
    log.checkpoint().unwrap();
    assert!(
        !file.exists(),
        "an idle partition's checkpoint wrote the file"
    );
    // ...a changed one does.
    log.set_high_watermark(Offset(2));
    log.checkpoint().unwrap();
    assert!(file.exists());
}

#[test]
fn a_truncation_replaces_the_producer_snapshot_so_a_crash_forgets_removed_batches() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), TopicConfig::default());
    log.append_as_leader(&mut producer_batch("a", 3, 9, 0, 0), LeaderEpoch(0))
        .unwrap();
    log.append_as_leader(&mut producer_batch("b", 2, 9, 0, 3), LeaderEpoch(0))
        .unwrap();
    // The periodic snapshot covers offsets 0..5, including producer 9's seq 3..=4.
    log.checkpoint().unwrap();
    // A new leader's log differs from offset 3: truncate, then the log grows past the
    // snapshot's offset with another producer's records.
    log.truncate_to(Offset(3)).unwrap();
    log.append_as_leader(&mut producer_batch("x", 4, 11, 0, 0), LeaderEpoch(1))
        .unwrap();
    assert_eq!(log.log_end_offset(), Offset(7));
    drop(log); // crash: no clean close
    let log = open(dir.path(), TopicConfig::default());
    let again = log
        .append_as_leader(&mut producer_batch("b", 2, 9, 0, 3), LeaderEpoch(1))
        .unwrap();
    assert!(
        !again.duplicate,
        "a batch removed by truncation came back from a stale producer snapshot"
    );
    assert!(
        log.append_as_leader(&mut producer_batch("x", 4, 11, 0, 0), LeaderEpoch(1))
            .unwrap()
            .duplicate,
        "producer 11's batch written after the truncation is remembered"
    );
}

#[test]
fn sealed_segments_hold_a_descriptor_only_while_read() {
    let dir = tempfile::tempdir().unwrap();
    let (log, written) = multi_segment_log(dir.path());
    let segments = log.segment_count();
    log.close().unwrap();
    for clean in [true, false] {
        let log = open(dir.path(), small_config());
        assert_eq!(log.opened_after_clean_shutdown(), clean);
        assert_eq!(
            log.open_files(),
            1,
            "only the active segment is open (clean: {clean}, segments {segments})"
        );
        assert_records(&read_all(&log, 0), &written, "read after open");
        assert_eq!(log.open_files(), segments, "reads reopened every segment");
        // Read since the last sweep: kept; idle for a whole interval: released.
        assert_eq!(log.close_idle_files(), 0);
        assert_eq!(log.close_idle_files(), segments - 1);
        assert_eq!(log.open_files(), 1);
        assert_records(&read_all(&log, 0), &written, "read after release");
        drop(log); // unclean, for the second round
    }
}

const CACHED_ONLY: ReadOptions = ReadOptions {
    verify_crc: true,
    cached_only: true,
};

#[test]
fn a_cache_only_read_serves_cached_bytes_and_refuses_cold_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (log, written) = multi_segment_log(dir.path());
    let probe = std::fs::File::open(dir.path().join("00000000000000000000.log")).unwrap();
    if crate::segment::read_vec_at_most(&probe, 0, 1, true).is_err() {
        // No RWF_NOWAIT on this file system: every fetch takes the blocking path.
        assert!(matches!(
            log.read_with(Offset(0), 1 << 20, Isolation::LogEnd, CACHED_ONLY),
            Err(LogError::NotCached)
        ));
        return;
    }
    // Just written: in the page cache.
    let cached = log
        .read_with(Offset(0), 1 << 20, Isolation::LogEnd, CACHED_ONLY)
        .unwrap();
    assert_eq!(
        cached,
        log.read(Offset(0), 1 << 20, Isolation::LogEnd).unwrap()
    );
    // Evicted from the page cache (flushed, then dropped with POSIX_FADV_DONTNEED):
    // the cache-only read refuses instead of waiting for the disk; a normal read works.
    log.flush().unwrap();
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "log") {
            let file = std::fs::File::open(&path).unwrap();
            file.sync_all().unwrap();
            use std::os::fd::AsRawFd;
            // SAFETY: a plain advisory call on an open descriptor.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
    match log.read_with(Offset(0), 1 << 20, Isolation::LogEnd, CACHED_ONLY) {
        Err(LogError::NotCached) => {}
        // Some file systems (tmpfs) keep everything in memory: nothing to evict.
        Ok(data) => assert!(!data.records.is_empty()),
        Err(e) => panic!("{e}"),
    }
    assert_records(&read_all(&log, 0), &written, "normal reads after eviction");
}
