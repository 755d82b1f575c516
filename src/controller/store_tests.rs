//! Tests of the persistent Raft stores: openraft's conformance suite, reopen after every
//! kind of write, torn and corrupt tails, purge and truncation on disk, and snapshots.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::testing::{StoreBuilder, Suite};
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, RaftLogReader, RaftSnapshotBuilder};

use super::command::MetadataCommand;
use super::log_store::LogStore;
use super::raft_types::{StorageError, TypeConfig};
use super::state_machine::StateMachine;
use crate::types::BrokerId;

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachine, tempfile::TempDir> for Builder {
    async fn build(&self) -> Result<(tempfile::TempDir, LogStore, StateMachine), StorageError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = LogStore::open(dir.path()).expect("open log");
        let sm = StateMachine::open(dir.path(), 100).expect("open sm");
        Ok((dir, log, sm))
    }
}

#[test]
fn passes_the_openraft_storage_suite() {
    Suite::test_all(Builder).expect("suite");
}

fn log_id(term: u64, index: u64) -> LogId<u64> {
    LogId::new(CommittedLeaderId::new(term, 1), index)
}

fn entry(term: u64, index: u64) -> Entry<TypeConfig> {
    Entry {
        log_id: log_id(term, index),
        payload: EntryPayload::Normal(MetadataCommand::RegisterBroker {
            id: BrokerId(index as i32),
            address: format!("127.0.0.1:{index}"),
            rack: None,
            incarnation_id: "x".repeat(40),
            internal_address: format!("127.0.0.1:{}", index + 100),
            kafka_address: None,
        }),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Appends through openraft's interface, waiting for the flush.
async fn append(log: &mut LogStore, entries: Vec<Entry<TypeConfig>>) {
    use openraft::storage::RaftLogStorageExt;
    log.blocking_append(entries).await.expect("append");
}

async fn indexes(log: &mut LogStore) -> Vec<u64> {
    log.try_get_log_entries(..)
        .await
        .unwrap()
        .iter()
        .map(|e| e.log_id.index)
        .collect()
}

fn segment_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("log"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

#[test]
fn entries_vote_purge_and_truncation_survive_reopen() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let mut log = LogStore::open_with_segment_bytes(dir.path(), 4096).unwrap();
        append(&mut log, (1..=100).map(|i| entry(1, i)).collect()).await;
        assert!(segment_files(dir.path()).len() > 3, "small segments roll");
        let vote = openraft::Vote::new(3, 2);
        log.save_vote(&vote).await.unwrap();
        log.purge(log_id(1, 40)).await.unwrap();
        log.truncate(log_id(1, 91)).await.unwrap();
        append(&mut log, (91..=95).map(|i| entry(2, i)).collect()).await;
        drop(log);

        let mut log = LogStore::open_with_segment_bytes(dir.path(), 4096).unwrap();
        assert_eq!(indexes(&mut log).await, (41..=95).collect::<Vec<_>>());
        assert_eq!(log.read_vote().await.unwrap(), Some(vote));
        let state = log.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(log_id(1, 40)));
        assert_eq!(state.last_log_id, Some(log_id(2, 95)));
        let entries = log.try_get_log_entries(90..92).await.unwrap();
        assert_eq!(entries[0].log_id, log_id(1, 90));
        assert_eq!(entries[1].log_id, log_id(2, 91));
        // Purged segments are gone from disk: the first file starts after index 1.
        let first = segment_files(dir.path())[0].clone();
        assert_ne!(first.file_name().unwrap(), "00000000000000000001.wal");
    });
}

#[test]
fn a_torn_or_corrupt_tail_is_cut_and_the_log_reopens() {
    runtime().block_on(async {
        for damage in ["torn", "flipped", "garbage"] {
            let dir = tempfile::tempdir().unwrap();
            let mut log = LogStore::open(dir.path()).unwrap();
            append(&mut log, (1..=10).map(|i| entry(1, i)).collect()).await;
            drop(log);
            let file = segment_files(dir.path())[0].clone();
            let len = std::fs::metadata(&file).unwrap().len();
            match damage {
                "torn" => {
                    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
                    f.set_len(len - 7).unwrap();
                }
                "flipped" => {
                    let mut bytes = std::fs::read(&file).unwrap();
                    let at = bytes.len() - 3;
                    bytes[at] ^= 0x40;
                    std::fs::write(&file, bytes).unwrap();
                }
                _ => {
                    let mut f = std::fs::OpenOptions::new()
                        .append(true)
                        .open(&file)
                        .unwrap();
                    f.write_all(&[0xff; 5]).unwrap();
                }
            }
            let mut log = LogStore::open(dir.path()).unwrap();
            let want: Vec<u64> = if damage == "garbage" {
                (1..=10).collect()
            } else {
                (1..=9).collect()
            };
            assert_eq!(indexes(&mut log).await, want, "{damage}");
            // The repaired log takes appends again.
            let next = want.last().unwrap() + 1;
            append(&mut log, vec![entry(1, next)]).await;
            drop(log);
            let mut log = LogStore::open(dir.path()).unwrap();
            assert_eq!(indexes(&mut log).await.last(), Some(&next), "{damage}");
        }
    });
}

#[test]
fn corruption_before_later_segments_is_an_error() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let mut log = LogStore::open_with_segment_bytes(dir.path(), 4096).unwrap();
        append(&mut log, (1..=60).map(|i| entry(1, i)).collect()).await;
        drop(log);
        let first = segment_files(dir.path())[0].clone();
        let mut bytes = std::fs::read(&first).unwrap();
        bytes[20] ^= 0x01;
        std::fs::write(&first, bytes).unwrap();
        let err = LogStore::open_with_segment_bytes(dir.path(), 4096)
            .err()
            .expect("must refuse");
        let text = err.to_string();
        assert!(
            text.contains("CRC") && text.contains("later segments"),
            "{text}"
        );
    });
}

#[test]
fn snapshots_restore_the_image_after_reopen() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let mut sm = StateMachine::open(dir.path(), 100).unwrap();
        sm.apply((1..=5).map(|i| entry(1, i))).await.unwrap();
        let mut builder = sm.get_snapshot_builder().await;
        let snapshot = builder.build_snapshot().await.unwrap();
        assert_eq!(snapshot.meta.last_log_id, Some(log_id(1, 5)));
        drop(sm);
        let mut sm = StateMachine::open(dir.path(), 100).unwrap();
        let (applied, _) = sm.applied_state().await.unwrap();
        assert_eq!(applied, Some(log_id(1, 5)));
        let brokers: BTreeMap<_, _> = sm.store().read(|image, _| image.brokers.clone());
        assert_eq!(brokers.len(), 5);
        assert!(sm.get_current_snapshot().await.unwrap().is_some());
        // A damaged snapshot file is reported, not loaded.
        let path = dir.path().join("snapshot.bin");
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 0x10;
        std::fs::write(&path, bytes).unwrap();
        let err = StateMachine::open(dir.path(), 100)
            .err()
            .expect("must refuse");
        assert!(err.to_string().contains("CRC"), "{err}");
    });
}

#[test]
fn metadata_history_answers_deltas_or_a_full_image() {
    use super::state_machine::MetadataDelta;
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let mut sm = StateMachine::open(dir.path(), 3).unwrap();
        sm.apply((1..=5).map(|i| entry(1, i))).await.unwrap();
        let store = sm.store();
        match store.delta_since(3, 100) {
            MetadataDelta::Changes { changes, version } => {
                assert_eq!(version, 5);
                assert_eq!(
                    changes.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
                    vec![4, 5]
                );
            }
            other => panic!("expected changes, got {other:?}"),
        }
        // Only 3 versions are kept: version 1 is too old for a delta.
        assert!(matches!(
            store.delta_since(1, 100),
            MetadataDelta::Full { version: 5, .. }
        ));
        assert!(matches!(
            store.delta_since(0, 100),
            MetadataDelta::Full { .. }
        ));
        assert!(matches!(
            store.delta_since(9, 100),
            MetadataDelta::Full { .. }
        ));
        match store.delta_since(5, 100) {
            MetadataDelta::Changes { changes, .. } => assert!(changes.is_empty()),
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn inverted_ranges_read_nothing_instead_of_panicking() {
    runtime().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let mut log = LogStore::open(dir.path()).unwrap();
        append(&mut log, (1..=10).map(|i| entry(1, i)).collect()).await;
        #[allow(clippy::reversed_empty_ranges)]
        let inverted = log.try_get_log_entries(8..3).await.unwrap();
        assert!(inverted.is_empty());
        use std::ops::Bound::Excluded;
        let empty = log
            .try_get_log_entries((Excluded(5u64), Excluded(5u64)))
            .await
            .unwrap();
        assert!(empty.is_empty());
        assert_eq!(log.try_get_log_entries(3..=5).await.unwrap().len(), 3);
    });
}
