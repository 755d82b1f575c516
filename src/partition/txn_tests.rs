//! Transactions in one partition: the last stable offset, markers, the aborted index,
//! fencing, and their recovery, truncation and replication.

use std::path::Path;
use std::sync::Arc;

use super::*;
use crate::record::control::{AbortedRanges, ControlMarker};
use crate::record::{decode_committed_records, BatchBuilder, Compression, RecordRef};
use crate::topic_config::TopicConfig;
use crate::types::{LeaderEpoch, Offset};

const E: LeaderEpoch = LeaderEpoch(0);

fn open(dir: &Path) -> PartitionLog {
    PartitionLog::open(
        dir,
        TopicConfig {
            segment_bytes: 2048,
            ..TopicConfig::default()
        },
        Arc::new(SystemClock),
    )
    .unwrap()
}

/// `n` records `"{tag}-{i}"` of producer `pid` at `seq`, transactional or not.
fn batch(pid: i64, epoch: i16, seq: i32, n: usize, txn: bool, tag: &str) -> Vec<u8> {
    let mut b = BatchBuilder::new(Compression::None)
        .producer(pid, epoch, seq)
        .transactional(txn);
    for i in 0..n {
        let v = format!("{tag}-{i}");
        b.push(RecordRef {
            timestamp: 1_764_670_000_000,
            key: None,
            value: Some(v.as_bytes()),
            headers: &[],
        });
    }
    b.build(0).unwrap()
}

fn append(log: &PartitionLog, mut bytes: Vec<u8>) -> AppendInfo {
    let info = log.append_as_leader(&mut bytes, E).unwrap();
    log.set_high_watermark(log.log_end_offset());
    info
}

fn marker(log: &PartitionLog, pid: i64, epoch: i16, commit: bool) -> AppendInfo {
    let info = log
        .append_marker(
            pid,
            epoch,
            ControlMarker {
                commit,
                coordinator_epoch: 0,
            },
            E,
        )
        .unwrap();
    log.set_high_watermark(log.log_end_offset());
    info
}

/// Values a read-committed consumer sees from 0, as the client decodes them.
fn committed_values(log: &PartitionLog) -> Vec<String> {
    let mut out = Vec::new();
    let mut next = 0;
    loop {
        let d = log
            .read(Offset(next), 1 << 20, Isolation::Committed)
            .unwrap();
        if d.records.is_empty() {
            return out;
        }
        let aborted = AbortedRanges::new(
            d.aborted_transactions
                .iter()
                .map(|a| (a.producer_id, a.first_offset as i64, a.last_offset as i64))
                .collect(),
        );
        for r in decode_committed_records(&d.records, 1 << 20, &aborted).unwrap() {
            if r.offset as u64 >= next {
                out.push(String::from_utf8(r.value.unwrap().to_vec()).unwrap());
            }
        }
        next = crate::record::BatchIter::new(&d.records)
            .map(|b| b.unwrap().header().next_offset() as u64)
            .last()
            .unwrap();
    }
}

#[test]
fn read_committed_stops_at_open_transactions_and_drops_aborted_ones() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    append(&log, batch(-1, -1, -1, 2, false, "plain")); // 0, 1
    append(&log, batch(7, 0, 0, 2, true, "a")); // 2, 3: transaction of 7 opens
    append(&log, batch(8, 0, 0, 1, true, "b")); // 4: transaction of 8 opens
    append(&log, batch(-1, -1, -1, 1, false, "late")); // 5
    assert_eq!(log.last_stable_offset(), Offset(2));
    assert_eq!(
        log.open_transactions(),
        vec![(Offset(2), 7), (Offset(4), 8)]
    );
    assert_eq!(committed_values(&log), ["plain-0", "plain-1"]);
    marker(&log, 7, 0, false); // 6: abort 7
    assert_eq!(log.last_stable_offset(), Offset(4));
    marker(&log, 8, 0, true); // 7: commit 8
    assert_eq!(log.last_stable_offset(), log.high_watermark());
    assert_eq!(
        committed_values(&log),
        ["plain-0", "plain-1", "b-0", "late-0"]
    );
    // Read uncommitted sees every data record, markers never.
    let all = log
        .read(Offset(0), 1 << 20, Isolation::HighWatermark)
        .unwrap();
    assert!(all.aborted_transactions.is_empty());
    assert_eq!(
        crate::record::decode_data_records(&all.records, 1 << 20)
            .unwrap()
            .len(),
        6
    );
    // The index names the abort, for reads overlapping it only.
    let d = log.read(Offset(2), 1 << 20, Isolation::Committed).unwrap();
    assert_eq!(
        d.aborted_transactions,
        vec![AbortedTxn {
            producer_id: 7,
            first_offset: 2,
            last_offset: 6,
            last_stable_offset: 4
        }]
    );
    assert!(log
        .read(Offset(7), 1 << 20, Isolation::Committed)
        .unwrap()
        .aborted_transactions
        .is_empty());
    // The producer goes on in its epoch with its next transaction.
    append(&log, batch(7, 0, 2, 1, true, "c"));
    assert_eq!(log.last_stable_offset(), Offset(8));
}

#[test]
fn transaction_rules_refuse_what_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    append(&log, batch(7, 0, 0, 1, true, "a"));
    // A plain batch inside the producer's open transaction.
    let mut plain = batch(7, 0, 1, 1, false, "x");
    assert!(matches!(
        log.append_as_leader(&mut plain, E),
        Err(LogError::Sequence(
            producer_state::SequenceError::InvalidTxnState { .. }
        ))
    ));
    // Clients never write control batches, nor transactional ones without a producer.
    let mut control = crate::record::control::marker_batch(
        7,
        0,
        ControlMarker {
            commit: true,
            coordinator_epoch: 0,
        },
        0,
    );
    assert!(matches!(
        log.append_as_leader(&mut control, E),
        Err(LogError::RefusedRecord { .. })
    ));
    let mut anonymous = batch(-1, -1, -1, 1, true, "x");
    assert!(matches!(
        log.append_as_leader(&mut anonymous, E),
        Err(LogError::RefusedRecord { .. })
    ));
    // The coordinator fences the producer: its abort marker carries a newer epoch.
    marker(&log, 7, 1, false);
    let mut old = batch(7, 0, 1, 1, true, "zombie");
    assert!(matches!(
        log.append_as_leader(&mut old, E),
        Err(LogError::Sequence(
            producer_state::SequenceError::FencedEpoch { .. }
        ))
    ));
    // A marker from an older epoch, or an older coordinator, is refused.
    assert!(log
        .append_marker(
            7,
            0,
            ControlMarker {
                commit: true,
                coordinator_epoch: 0
            },
            E
        )
        .is_err());
    log.append_marker(
        7,
        1,
        ControlMarker {
            commit: false,
            coordinator_epoch: 3,
        },
        E,
    )
    .unwrap();
    assert!(matches!(
        log.append_marker(
            7,
            1,
            ControlMarker {
                commit: false,
                coordinator_epoch: 2
            },
            E
        ),
        Err(LogError::Sequence(
            producer_state::SequenceError::CoordinatorFenced { .. }
        ))
    ));
    // The new instance starts its epoch at sequence 0.
    append(&log, batch(7, 1, 0, 1, true, "new"));
    assert_eq!(log.last_stable_offset().0, log.log_end_offset().0 - 1);
}

#[test]
fn open_transactions_and_aborts_survive_a_crash_and_a_torn_index() {
    let dir = tempfile::tempdir().unwrap();
    let expected;
    {
        let log = open(dir.path());
        // Enough batches to roll segments, so the transactions span several.
        for i in 0..30 {
            append(&log, batch(7, 0, i * 3, 3, true, &format!("a{i}")));
            append(&log, batch(-1, -1, -1, 2, false, &format!("p{i}")));
            if i % 3 == 2 {
                marker(&log, 7, 0, i % 2 == 0);
            }
        }
        append(&log, batch(9, 0, 0, 1, true, "open"));
        assert!(log.segment_count() > 3);
        log.checkpoint().unwrap();
        // More after the snapshot: replay must redo these.
        append(&log, batch(7, 0, 90, 1, true, "after"));
        marker(&log, 7, 0, false);
        marker(&log, 9, 0, true);
        append(&log, batch(10, 0, 0, 1, true, "open10"));
        expected = (
            committed_values(&log),
            log.last_stable_offset(),
            log.open_transactions(),
        );
        assert!(
            expected.0.iter().any(|v| v.starts_with("a2-")),
            "a committed transaction"
        );
        assert!(
            !expected.0.iter().any(|v| v.starts_with("a3-")),
            "an aborted one"
        );
        assert!(
            expected.0.iter().any(|v| v == "open-0"),
            "a later committed one"
        );
        assert!(
            !expected.0.iter().any(|v| v == "after-0"),
            "aborted after the snapshot"
        );
        assert_eq!(expected.2.len(), 1, "one open transaction");
        // Dropped without close: a crash.
    }
    // Reopened, the high watermark comes from the last checkpoint; as a leader would, the
    // tests move it to the log end.
    let reopen = || {
        let log = open(dir.path());
        log.set_high_watermark(log.log_end_offset());
        log
    };
    let log = reopen();
    assert_eq!(
        (
            committed_values(&log),
            log.last_stable_offset(),
            log.open_transactions()
        ),
        expected,
        "after a crash"
    );
    drop(log);
    // The entry written after the snapshot never reached the disk (a crash before the
    // page cache was written back): replay from the snapshot writes it again.
    let last_index = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "txnindex"))
        .max()
        .unwrap();
    let len = std::fs::metadata(&last_index).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&last_index)
        .unwrap();
    f.set_len(len - 34).unwrap();
    drop(f);
    // ... and a torn write left a few bytes of garbage.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&last_index)
        .unwrap();
    std::io::Write::write_all(&mut f, &[0xff; 5]).unwrap();
    drop(f);
    let log = reopen();
    assert_eq!(
        (
            committed_values(&log),
            log.last_stable_offset(),
            log.open_transactions()
        ),
        expected,
        "after losing the index's tail"
    );
    // A snapshot now covers the rewritten entry: it must be whole in the file.
    log.checkpoint().unwrap();
    drop(log);
    let log = reopen();
    assert_eq!(
        (
            committed_values(&log),
            log.last_stable_offset(),
            log.open_transactions()
        ),
        expected,
        "once more"
    );
}

#[test]
fn truncation_reopens_a_transaction_whose_marker_it_cuts() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    append(&log, batch(7, 0, 0, 2, true, "a")); // 0, 1
    let m = marker(&log, 7, 0, false); // 2
    assert_eq!(log.last_stable_offset(), Offset(3));
    log.truncate_to(m.first_offset).unwrap();
    assert_eq!(
        log.last_stable_offset(),
        Offset(0).min(log.high_watermark())
    );
    assert_eq!(log.open_transactions(), vec![(Offset(0), 7)]);
    assert!(log.aborted_transactions_of_segment(Offset(0)).is_empty());
    // The new leader's marker closes it again.
    log.set_high_watermark(log.log_end_offset());
    marker(&log, 7, 0, true);
    assert_eq!(committed_values(&log), ["a-0", "a-1"]);
    // Truncating the whole transaction away leaves nothing open.
    log.truncate_to(Offset(0)).unwrap();
    assert!(log.open_transactions().is_empty());
}

#[test]
fn a_follower_copying_the_leader_tracks_the_same_transactions() {
    let leader_dir = tempfile::tempdir().unwrap();
    let follower_dir = tempfile::tempdir().unwrap();
    let leader = open(leader_dir.path());
    let follower = open(follower_dir.path());
    append(&leader, batch(7, 0, 0, 2, true, "a"));
    append(&leader, batch(8, 0, 0, 2, true, "b"));
    marker(&leader, 7, 0, false);
    while follower.log_end_offset() < leader.log_end_offset() {
        let d = leader
            .read(follower.log_end_offset(), 1 << 20, Isolation::LogEnd)
            .unwrap();
        follower.append_as_follower(&d.records).unwrap();
    }
    follower.set_high_watermark(follower.log_end_offset());
    assert_eq!(follower.open_transactions(), leader.open_transactions());
    assert_eq!(follower.last_stable_offset(), leader.last_stable_offset());
    assert_eq!(
        follower.aborted_transactions_of_segment(Offset(0)),
        leader.aborted_transactions_of_segment(Offset(0))
    );
}

#[test]
fn without_a_snapshot_replay_finds_transactions_opened_in_earlier_segments() {
    let dir = tempfile::tempdir().unwrap();
    let expected;
    {
        let log = open(dir.path());
        append(&log, batch(7, 0, 0, 3, true, "early")); // opens in the first segment
        for i in 0..80 {
            append(&log, batch(-1, -1, -1, 2, false, &format!("p{i}")));
        }
        append(&log, batch(8, 0, 0, 1, true, "open")); // still open at the crash
        assert!(log.segment_count() > 2);
        marker(&log, 7, 0, false); // in the active segment
        expected = (committed_values(&log), log.open_transactions());
        assert!(!expected.0.iter().any(|v| v.starts_with("early")));
        // Dropped before any checkpoint: no producer snapshot on disk.
    }
    assert!(!dir.path().join(producer_state::SNAPSHOT_FILE).exists());
    let log = open(dir.path());
    log.set_high_watermark(log.log_end_offset());
    assert_eq!((committed_values(&log), log.open_transactions()), expected);
}

#[test]
fn a_marker_written_while_a_write_was_verified_refuses_the_write() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path());
    // Transaction 1 of producer 7: a batch, then (while a second write is being verified
    // with the coordinator) its abort marker.
    append(&log, batch(7, 0, 0, 2, true, "t1"));
    let guard = log.txn_guard(7);
    marker(&log, 7, 0, false);
    let mut late = batch(7, 0, 2, 1, true, "late");
    let e = log
        .append_as_leader_guarded(&mut late, E, &[guard])
        .unwrap_err();
    assert!(
        matches!(
            e,
            LogError::Sequence(producer_state::SequenceError::InvalidTxnState { .. })
        ),
        "{e}"
    );
    // Nothing was written and no transaction is open: the LSO is not held.
    assert!(!log.has_open_transaction(7));
    assert_eq!(log.last_stable_offset(), log.log_end_offset());
    // A guard taken after the marker (a new transaction, verified afresh) passes.
    let guard = log.txn_guard(7);
    let mut next = batch(7, 0, 2, 1, true, "t2");
    log.append_as_leader_guarded(&mut next, E, &[guard])
        .unwrap();
    assert!(log.has_open_transaction(7));
    // So does a guard of a producer that had no marker in between.
    let guard = log.txn_guard(8);
    let mut other = batch(8, 0, 0, 1, true, "p8");
    log.append_as_leader_guarded(&mut other, E, &[guard])
        .unwrap();
}
