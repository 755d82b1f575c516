//! The metadata state machine: applies committed commands to the [`MetadataImage`], keeps
//! a bounded history of changes for brokers that follow metadata, and takes and installs
//! snapshots.
//!
//! The image lives in memory and is shared with request handlers through
//! [`MetadataStore`]; what survives a restart is the latest snapshot
//! (`<data-dir>/raft/snapshot.bin`) plus the Raft log after it, which openraft re-applies.
//! Snapshot file layout: `b"TLSNAP1\n"`, `u32 LE` meta length, the snapshot meta in JSON,
//! `u32 LE` data length, the data (a [`SnapshotState`] in JSON), and a `u32 LE` CRC32C of
//! everything before it. It is replaced atomically.

use std::collections::VecDeque;
use std::io::{self, Cursor};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    BasicNode, EntryPayload, RaftSnapshotBuilder, SnapshotMeta, StorageIOError, StoredMembership,
};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::command::{CommandOutput, CommandResult};
use super::log_store::write_atomically;
use super::model::{MetadataChange, MetadataImage};
use super::raft_types::{Entry, LogId, StorageError, TypeConfig};
use crate::types::NodeId;

/// The latest snapshot's file in the Raft directory.
pub const SNAPSHOT_FILE: &str = "snapshot.bin";

const SNAPSHOT_MAGIC: &[u8; 8] = b"TLSNAP1\n";

/// What a snapshot holds: the image and where in the log it was taken.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SnapshotState {
    /// The last entry the image includes.
    pub last_applied: Option<LogId>,
    /// The membership in effect at that entry.
    pub last_membership: StoredMembership<NodeId, BasicNode>,
    /// The metadata.
    pub image: MetadataImage,
}

struct Applied {
    state: SnapshotState,
    /// Changes by version, oldest first; covers versions after `history_floor`.
    history: VecDeque<(u64, Vec<MetadataChange>)>,
    history_floor: u64,
}

/// The applied metadata, shared between the state machine and request handlers.
pub struct MetadataStore {
    applied: RwLock<Applied>,
    version: watch::Sender<u64>,
    history_max: usize,
}

/// The answer to "what changed since version v".
#[derive(Debug, Clone)]
pub enum MetadataDelta {
    /// The caller must replace its image (it is too far behind, or asked for one).
    Full {
        /// The whole image.
        image: MetadataImage,
        /// Its version.
        version: u64,
    },
    /// The changes after the caller's version, oldest first.
    Changes {
        /// `(version, change)` pairs.
        changes: Vec<(u64, MetadataChange)>,
        /// The version after applying them.
        version: u64,
    },
}

impl MetadataStore {
    fn new(state: SnapshotState, history_max: usize) -> Self {
        let version = state.last_applied.map_or(0, |l| l.index);
        Self {
            applied: RwLock::new(Applied {
                state,
                history: VecDeque::new(),
                history_floor: version,
            }),
            version: watch::channel(version).0,
            history_max,
        }
    }

    /// Runs `f` on the current image and its version.
    pub fn read<T>(&self, f: impl FnOnce(&MetadataImage, u64) -> T) -> T {
        let applied = self.applied.read();
        f(
            &applied.state.image,
            applied.state.last_applied.map_or(0, |l| l.index),
        )
    }

    /// The version (log index) of the last applied entry.
    pub fn version(&self) -> u64 {
        *self.version.borrow()
    }

    /// Waits until the applied version exceeds `since`, or `timeout` passes; returns the
    /// version then.
    pub async fn wait_for_version_above(&self, since: u64, timeout: std::time::Duration) -> u64 {
        let mut rx = self.version.subscribe();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|v| *v > since)).await;
        let v = *rx.borrow();
        v
    }

    /// The changes after `since`, or a full image when they are no longer all kept (or
    /// `since` is 0 or ahead of this controller).
    pub fn delta_since(&self, since: u64, changes_max: usize) -> MetadataDelta {
        let applied = self.applied.read();
        let version = applied.state.last_applied.map_or(0, |l| l.index);
        let full = || MetadataDelta::Full {
            image: applied.state.image.clone(),
            version,
        };
        if since == 0 || since < applied.history_floor || since > version {
            return full();
        }
        let mut changes = Vec::new();
        for (v, list) in applied.history.iter().filter(|(v, _)| *v > since) {
            changes.extend(list.iter().map(|c| (*v, c.clone())));
            if changes.len() > changes_max {
                return full();
            }
        }
        MetadataDelta::Changes { changes, version }
    }

    fn record(&self, applied: &mut Applied, version: u64, changes: Vec<MetadataChange>) {
        if !changes.is_empty() {
            applied.history.push_back((version, changes));
        }
        while applied.history.len() > self.history_max {
            if let Some((v, _)) = applied.history.pop_front() {
                applied.history_floor = v;
            }
        }
    }
}

/// The latest snapshot (meta and encoded data), shared with the snapshot builder.
type CurrentSnapshot = Arc<Mutex<Option<(SnapshotMeta<NodeId, BasicNode>, Vec<u8>)>>>;

/// The openraft state machine over a [`MetadataStore`].
pub struct StateMachine {
    store: Arc<MetadataStore>,
    snapshot_path: PathBuf,
    current: CurrentSnapshot,
}

/// Builds snapshots for openraft; shares the state machine's store.
pub struct SnapshotBuilder {
    store: Arc<MetadataStore>,
    snapshot_path: PathBuf,
    current: CurrentSnapshot,
}

/// A snapshot file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct SnapshotError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong.
    pub reason: String,
}

fn encode_snapshot(meta: &SnapshotMeta<NodeId, BasicNode>, data: &[u8]) -> io::Result<Vec<u8>> {
    let meta = serde_json::to_vec(meta).map_err(io::Error::other)?;
    let mut out = Vec::with_capacity(meta.len() + data.len() + 20);
    out.extend_from_slice(SNAPSHOT_MAGIC);
    out.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    out.extend_from_slice(&meta);
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(data);
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

type DecodedSnapshot = (SnapshotMeta<NodeId, BasicNode>, Vec<u8>, SnapshotState);

fn decode_snapshot(bytes: &[u8]) -> Result<DecodedSnapshot, String> {
    if bytes.len() < 20 || &bytes[..8] != SNAPSHOT_MAGIC {
        return Err("not a snapshot file (bad magic or too short)".to_owned());
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32c::crc32c(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err("CRC mismatch".to_owned());
    }
    let mut pos = 8;
    let mut take = |what: &str| -> Result<&[u8], String> {
        let len = body
            .get(pos..pos + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
            .ok_or(format!("truncated {what} length"))?;
        let part = body
            .get(pos + 4..pos + 4 + len)
            .ok_or(format!("truncated {what}"))?;
        pos += 4 + len;
        Ok(part)
    };
    let meta = serde_json::from_slice(take("meta")?).map_err(|e| format!("meta: {e}"))?;
    let data = take("data")?.to_vec();
    let state = serde_json::from_slice(&data).map_err(|e| format!("data: {e}"))?;
    Ok((meta, data, state))
}

impl StateMachine {
    /// Loads the latest snapshot under `raft_dir` (if any) as the starting state.
    pub fn open(raft_dir: &Path, history_max: usize) -> Result<Self, SnapshotError> {
        let snapshot_path = raft_dir.join(SNAPSHOT_FILE);
        let (state, current) = match std::fs::read(&snapshot_path) {
            Ok(bytes) => {
                let (meta, data, state) =
                    decode_snapshot(&bytes).map_err(|reason| SnapshotError {
                        path: snapshot_path.clone(),
                        reason,
                    })?;
                (state, Some((meta, data)))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => (SnapshotState::default(), None),
            Err(e) => {
                return Err(SnapshotError {
                    path: snapshot_path,
                    reason: e.to_string(),
                })
            }
        };
        Ok(Self {
            store: Arc::new(MetadataStore::new(state, history_max)),
            snapshot_path,
            current: Arc::new(Mutex::new(current)),
        })
    }

    /// The shared, applied metadata.
    pub fn store(&self) -> Arc<MetadataStore> {
        self.store.clone()
    }
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let (data, last_applied, last_membership) = {
            let applied = self.store.applied.read();
            let data = serde_json::to_vec(&applied.state)
                .map_err(|e| StorageIOError::read_state_machine(&e))?;
            (
                data,
                applied.state.last_applied,
                applied.state.last_membership.clone(),
            )
        };
        let snapshot_id = match last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id.term, l.leader_id.node_id, l.index),
            None => "empty".to_owned(),
        };
        let meta = SnapshotMeta {
            last_log_id: last_applied,
            last_membership,
            snapshot_id,
        };
        let path = self.snapshot_path.clone();
        let (meta_w, data_w) = (meta.clone(), data.clone());
        tokio::task::spawn_blocking(move || {
            write_atomically(&path, &encode_snapshot(&meta_w, &data_w)?)
        })
        .await
        .map_err(|e| StorageIOError::write_snapshot(None, &e))?
        .map_err(|e| StorageIOError::write_snapshot(None, &e))?;
        *self.current.lock() = Some((meta.clone(), data.clone()));
        tracing::info!(snapshot = %meta.snapshot_id, bytes = data.len(), "metadata snapshot written");
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId>, StoredMembership<NodeId, BasicNode>), StorageError> {
        let applied = self.store.applied.read();
        Ok((
            applied.state.last_applied,
            applied.state.last_membership.clone(),
        ))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<CommandResult>, StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let mut results = Vec::new();
        let last = {
            let mut applied = self.store.applied.write();
            for entry in entries {
                let version = entry.log_id.index;
                applied.state.last_applied = Some(entry.log_id);
                let result = match entry.payload {
                    EntryPayload::Blank => Ok(CommandOutput::Done),
                    EntryPayload::Normal(cmd) => {
                        let (result, changes) = applied.state.image.apply(&cmd, version);
                        if let Err(e) = &result {
                            tracing::debug!(version, error = %e, "command rejected at apply");
                        }
                        self.store.record(&mut applied, version, changes);
                        result
                    }
                    EntryPayload::Membership(m) => {
                        applied.state.last_membership =
                            StoredMembership::new(Some(entry.log_id), m);
                        Ok(CommandOutput::Done)
                    }
                };
                results.push(result);
            }
            applied.state.last_applied.map_or(0, |l| l.index)
        };
        self.store.version.send_replace(last);
        Ok(results)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            store: self.store.clone(),
            snapshot_path: self.snapshot_path.clone(),
            current: self.current.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        let mut state: SnapshotState = serde_json::from_slice(&data)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        state.last_applied = meta.last_log_id;
        state.last_membership = meta.last_membership.clone();
        let path = self.snapshot_path.clone();
        let bytes = encode_snapshot(meta, &data)
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        tokio::task::spawn_blocking(move || write_atomically(&path, &bytes))
            .await
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        let version = meta.last_log_id.map_or(0, |l| l.index);
        {
            let mut applied = self.store.applied.write();
            applied.state = state;
            applied.history.clear();
            applied.history_floor = version;
        }
        *self.current.lock() = Some((meta.clone(), data));
        self.store.version.send_replace(version);
        tracing::info!(snapshot = %meta.snapshot_id, version, "installed metadata snapshot from the leader");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        Ok(self.current.lock().as_ref().map(|(meta, data)| Snapshot {
            meta: meta.clone(),
            snapshot: Box::new(Cursor::new(data.clone())),
        }))
    }
}
