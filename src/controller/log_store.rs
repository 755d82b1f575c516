//! The controller's persistent Raft log: append-only segment files plus a small metadata
//! file, under `<data-dir>/raft/`.
//!
//! Files:
//! - `log/<first index, 20 digits>.wal`: entries in index order, each framed as
//!   `[u32 LE payload length][u32 LE CRC32C of payload][payload: the entry in JSON]`.
//!   A segment rolls once it exceeds [`SEGMENT_BYTES_MAX`].
//! - `meta.json`: the vote and the last purged log id, replaced atomically (write a
//!   temporary file, fsync, rename, fsync the directory).
//!
//! Contract (openraft's): an append is acknowledged (`LogFlushed`) only after fdatasync, so
//! a vote or an entry the leader counted is never lost. On open, a torn or corrupt frame at
//! the tail of the last segment is cut off (it was never acknowledged); corruption anywhere
//! else is an error, because acknowledged entries follow it. Purge records the new purge
//! point before deleting whole segments; truncation deletes later segments before cutting
//! the one that holds the first removed entry, so a crash at any point leaves a log that
//! opens. All unpurged entries are also held in memory: the snapshot policy bounds them.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{RaftLogReader, StorageIOError, Vote};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use super::raft_types::{Entry, LogId, StorageError, TypeConfig};
use crate::types::NodeId;

/// A segment rolls once it is larger than this (the default of `raft_log_segment_bytes`).
pub const SEGMENT_BYTES_MAX: u64 = 8 * 1024 * 1024;

/// Largest accepted frame payload; anything larger is treated as corruption.
const FRAME_PAYLOAD_MAX: u32 = 256 * 1024 * 1024;

const FRAME_HEADER_BYTES: u64 = 8;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct LogMeta {
    vote: Option<Vote<NodeId>>,
    last_purged: Option<LogId>,
}

struct StoredEntry {
    log_id: LogId,
    /// First index of the segment holding it.
    segment: u64,
    /// Byte position of its frame in that segment.
    position: u64,
}

struct Segment {
    path: PathBuf,
    file: File,
    len: u64,
}

struct Inner {
    dir: PathBuf,
    meta: LogMeta,
    entries: BTreeMap<u64, StoredEntry>,
    /// Segments by the index of the first entry written to them.
    segments: BTreeMap<u64, Segment>,
    segment_bytes_max: u64,
}

/// The Raft log store; cheap to clone (clones share one log).
///
/// File state sits behind a mutex held during writes and fsyncs (on a blocking thread);
/// readers use `readable`, a copy of the unpurged entries updated after each write, so a
/// replication read never waits for an fsync.
#[derive(Clone)]
pub struct LogStore {
    inner: Arc<Mutex<Inner>>,
    readable: Arc<RwLock<BTreeMap<u64, Entry>>>,
}

fn io_err(e: io::Error) -> StorageError {
    StorageIOError::write_logs(&e).into()
}

fn segment_path(dir: &Path, first_index: u64) -> PathBuf {
    dir.join("log").join(format!("{first_index:020}.wal"))
}

/// Writes `bytes` to `path` atomically and durably.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Fsyncs a directory so that renames and new files in it are durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// A problem found while opening the log.
#[derive(Debug, thiserror::Error)]
pub enum LogOpenError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The failure.
        #[source]
        source: io::Error,
    },
    /// The log is damaged where acknowledged entries follow.
    #[error("{path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

fn at(path: &Path) -> impl FnOnce(io::Error) -> LogOpenError + '_ {
    move |source| LogOpenError::Io {
        path: path.to_owned(),
        source,
    }
}

impl LogStore {
    /// Opens (or creates) the log under `dir`, repairing a torn tail.
    pub fn open(dir: &Path) -> Result<Self, LogOpenError> {
        Self::open_with_segment_bytes(dir, SEGMENT_BYTES_MAX)
    }

    /// [`LogStore::open`] with a custom roll size (tests use small segments).
    pub fn open_with_segment_bytes(
        dir: &Path,
        segment_bytes_max: u64,
    ) -> Result<Self, LogOpenError> {
        let log_dir = dir.join("log");
        fs::create_dir_all(&log_dir).map_err(at(&log_dir))?;
        let meta_path = dir.join("meta.json");
        let meta: LogMeta = match fs::read(&meta_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| LogOpenError::Corrupt {
                path: meta_path.clone(),
                reason: format!("unreadable: {e}"),
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => LogMeta::default(),
            Err(e) => return Err(at(&meta_path)(e)),
        };
        let mut firsts = Vec::new();
        for item in fs::read_dir(&log_dir).map_err(at(&log_dir))? {
            let path = item.map_err(at(&log_dir))?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if let Some(first) = name
                .strip_suffix(".wal")
                .and_then(|s| s.parse::<u64>().ok())
            {
                firsts.push(first);
            } else if name.ends_with(".tmp") {
                let _ = fs::remove_file(&path);
            }
        }
        firsts.sort_unstable();
        let purged_index = meta.last_purged.map(|l| l.index);
        let mut readable = BTreeMap::new();
        let mut inner = Inner {
            dir: dir.to_owned(),
            meta,
            entries: BTreeMap::new(),
            segments: BTreeMap::new(),
            segment_bytes_max,
        };
        for (n, first) in firsts.iter().enumerate() {
            let is_last = n + 1 == firsts.len();
            let path = segment_path(dir, *first);
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(at(&path))?;
            let mut bytes = Vec::new();
            file.read_to_end(&mut bytes).map_err(at(&path))?;
            let mut pos = 0usize;
            let mut bad = None;
            while pos < bytes.len() {
                match decode_frame(&bytes[pos..]) {
                    Ok((entry, used)) => {
                        let index = entry.log_id.index;
                        if purged_index.is_none_or(|p| index > p) {
                            let expected = match inner.entries.last_key_value() {
                                Some((last, _)) => Some(last + 1),
                                None => purged_index.map(|p| p + 1),
                            };
                            if let Some(expected) = expected {
                                if index != expected {
                                    return Err(LogOpenError::Corrupt {
                                        path,
                                        reason: format!(
                                            "entry {index} at byte {pos}, expected entry {expected}"
                                        ),
                                    });
                                }
                            }
                            inner.entries.insert(
                                index,
                                StoredEntry {
                                    log_id: entry.log_id,
                                    segment: *first,
                                    position: pos as u64,
                                },
                            );
                            readable.insert(index, entry);
                        }
                        pos += used;
                    }
                    Err(reason) => {
                        bad = Some(reason);
                        break;
                    }
                }
            }
            if let Some(reason) = bad {
                if !is_last {
                    return Err(LogOpenError::Corrupt {
                        path,
                        reason: format!("{reason} at byte {pos}, and later segments exist"),
                    });
                }
                tracing::warn!(
                    path = %path.display(),
                    position = pos,
                    %reason,
                    "cutting a torn or corrupt tail off the raft log (never acknowledged)"
                );
                file.set_len(pos as u64).map_err(at(&path))?;
                file.sync_all().map_err(at(&path))?;
            }
            inner.segments.insert(
                *first,
                Segment {
                    path,
                    file,
                    len: pos as u64,
                },
            );
        }
        Ok(Self {
            inner: Arc::new(Mutex::new(inner)),
            readable: Arc::new(RwLock::new(readable)),
        })
    }

    /// Bytes of all segment files (what the snapshot policy keeps bounded).
    pub fn disk_bytes(&self) -> u64 {
        self.inner.lock().segments.values().map(|s| s.len).sum()
    }

    /// Number of segment files.
    pub fn segment_count(&self) -> usize {
        self.inner.lock().segments.len()
    }
}

/// Decodes one frame; returns the entry and the bytes it used, or why it is unusable.
fn decode_frame(bytes: &[u8]) -> Result<(Entry, usize), String> {
    if bytes.len() < FRAME_HEADER_BYTES as usize {
        return Err("torn frame header".to_owned());
    }
    let len = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
    let crc = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
    if len == 0 || len > FRAME_PAYLOAD_MAX {
        return Err(format!("frame length {len} out of range"));
    }
    let end = FRAME_HEADER_BYTES as usize + len as usize;
    if bytes.len() < end {
        return Err("torn frame payload".to_owned());
    }
    let payload = &bytes[FRAME_HEADER_BYTES as usize..end];
    if crc32c::crc32c(payload) != crc {
        return Err("frame CRC mismatch".to_owned());
    }
    let entry = serde_json::from_slice(payload).map_err(|e| format!("undecodable entry: {e}"))?;
    Ok((entry, end))
}

fn encode_frame(entry: &Entry, out: &mut Vec<u8>) -> io::Result<()> {
    let payload = serde_json::to_vec(entry).map_err(io::Error::other)?;
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(())
}

impl Inner {
    fn save_meta(&self) -> io::Result<()> {
        let bytes = serde_json::to_vec(&self.meta).map_err(io::Error::other)?;
        write_atomically(&self.dir.join("meta.json"), &bytes)
    }

    fn append(&mut self, entries: &[Entry]) -> io::Result<()> {
        let mut touched: Vec<u64> = Vec::new();
        let mut created = false;
        let mut frame = Vec::new();
        for entry in entries {
            let index = entry.log_id.index;
            let roll = match self.segments.last_key_value() {
                Some((_, s)) => s.len >= self.segment_bytes_max,
                None => true,
            };
            if roll {
                let path = segment_path(&self.dir, index);
                let file = OpenOptions::new()
                    .create(true)
                    .truncate(true)
                    .read(true)
                    .write(true)
                    .open(&path)?;
                self.segments.insert(index, Segment { path, file, len: 0 });
                created = true;
            }
            let (first, segment) = self.segments.iter_mut().next_back().expect("a segment");
            frame.clear();
            encode_frame(entry, &mut frame)?;
            write_at(&segment.file, &frame, segment.len)?;
            let position = segment.len;
            segment.len += frame.len() as u64;
            if touched.last() != Some(first) {
                touched.push(*first);
            }
            self.entries.insert(
                index,
                StoredEntry {
                    log_id: entry.log_id,
                    segment: *first,
                    position,
                },
            );
        }
        for first in touched {
            self.segments[&first].file.sync_data()?;
        }
        if created {
            sync_dir(&self.dir.join("log"))?;
        }
        Ok(())
    }

    fn truncate(&mut self, since: u64) -> io::Result<()> {
        let Some(first_removed) = self.entries.get(&since) else {
            return Ok(());
        };
        let (segment, position) = (first_removed.segment, first_removed.position);
        let later: Vec<u64> = self
            .segments
            .range(segment + 1..)
            .map(|(k, _)| *k)
            .rev()
            .collect();
        for first in later {
            let s = self.segments.remove(&first).expect("listed");
            fs::remove_file(&s.path)?;
        }
        let s = self.segments.get_mut(&segment).expect("entry's segment");
        s.file.set_len(position)?;
        s.file.sync_all()?;
        s.len = position;
        sync_dir(&self.dir.join("log"))?;
        self.entries.split_off(&since);
        Ok(())
    }

    fn purge(&mut self, upto: LogId) -> io::Result<()> {
        self.meta.last_purged = Some(upto);
        self.save_meta()?;
        self.entries = self.entries.split_off(&(upto.index + 1));
        // A segment can go once the next one starts at or below upto + 1: all of its
        // entries are purged. The newest segment always stays (appends go there).
        let firsts: Vec<u64> = self.segments.keys().copied().collect();
        for pair in firsts.windows(2) {
            if pair[1] <= upto.index + 1 {
                let s = self.segments.remove(&pair[0]).expect("listed");
                fs::remove_file(&s.path)?;
            }
        }
        Ok(())
    }
}

fn write_at(file: &File, bytes: &[u8], position: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.write_all_at(bytes, position)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        // BTreeMap::range panics on an inverted range; such a request reads nothing.
        if is_inverted(&range) {
            return Ok(Vec::new());
        }
        Ok(self
            .readable
            .read()
            .range(range)
            .map(|(_, e)| e.clone())
            .collect())
    }
}

/// Whether `range` starts after it ends (or is `(x, x)` exclusive at both ends), which
/// `BTreeMap::range` refuses with a panic.
fn is_inverted<RB: RangeBounds<u64>>(range: &RB) -> bool {
    use std::ops::Bound::{Excluded, Included, Unbounded};
    match (range.start_bound(), range.end_bound()) {
        (Unbounded, _) | (_, Unbounded) => false,
        (Included(s), Included(e)) => s > e,
        (Included(s), Excluded(e)) | (Excluded(s), Included(e)) => s > e,
        (Excluded(s), Excluded(e)) => s >= e,
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let inner = self.inner.lock();
        let last_purged_log_id = inner.meta.last_purged;
        let last_log_id = inner
            .entries
            .last_key_value()
            .map(|(_, s)| s.log_id)
            .or(last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        let inner = self.inner.clone();
        let vote = *vote;
        tokio::task::spawn_blocking(move || {
            let mut inner = inner.lock();
            inner.meta.vote = Some(vote);
            inner.save_meta()
        })
        .await
        .map_err(|e| StorageIOError::write_vote(&e))?
        .map_err(|e| StorageIOError::write_vote(&e).into())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        Ok(self.inner.lock().meta.vote)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        let (inner, readable) = (self.inner.clone(), self.readable.clone());
        // Awaiting here keeps appends in order; the fsync runs off the async workers.
        let result = tokio::task::spawn_blocking(move || {
            let mut inner = inner.lock();
            inner.append(&entries)?;
            readable
                .write()
                .extend(entries.into_iter().map(|e| (e.log_id.index, e)));
            Ok::<(), io::Error>(())
        })
        .await
        .map_err(|e| StorageError::from(StorageIOError::write_logs(&e)))?;
        match result {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                let error = io_err(io::Error::new(e.kind(), e.to_string()));
                callback.log_io_completed(Err(e));
                Err(error)
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let (inner, readable) = (self.inner.clone(), self.readable.clone());
        tokio::task::spawn_blocking(move || {
            let mut inner = inner.lock();
            inner.truncate(log_id.index)?;
            readable.write().split_off(&log_id.index);
            Ok::<(), io::Error>(())
        })
        .await
        .map_err(|e| StorageError::from(StorageIOError::write_logs(&e)))?
        .map_err(io_err)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let (inner, readable) = (self.inner.clone(), self.readable.clone());
        tokio::task::spawn_blocking(move || {
            let mut inner = inner.lock();
            inner.purge(log_id)?;
            let mut readable = readable.write();
            *readable = readable.split_off(&(log_id.index + 1));
            Ok::<(), io::Error>(())
        })
        .await
        .map_err(|e| StorageError::from(StorageIOError::write_logs(&e)))?
        .map_err(io_err)
    }
}
