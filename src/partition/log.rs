//! [`PartitionLog`]: the thread-safe log of one partition.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::RwLock;

use crate::record::{set_base_offset, set_partition_leader_epoch, BatchIter};
use crate::segment::{read_vec_at_most, LogSegment};
use crate::topic_config::{FlushMode, TopicConfig};
use crate::types::{LeaderEpoch, Offset};

use super::checkpoint;
use super::clock::Clock;
use super::damage::{DamageKind, DamagedRange};
use super::epoch_cache::LeaderEpochCache;
use super::group_commit::GroupCommit;
use super::loader::{self, segment_config, DirLock, OffsetsCheckpoint, CLEAN_SHUTDOWN_FILE};
use super::producer_state::{
    self, AbortedTxn, ProducerBatch, ProducerStateTable, SequenceCheck, TxnGuard,
};
use super::retention::{segments_to_delete, SegmentSummary};
use super::txn_index::AbortedIndex;
use crate::record::control::{decode_marker, marker_batch, ControlMarker};
mod filtered;

use super::validate::{validate_batches, BatchMeta};
use super::LogError;
use crate::record::tag::TagMark;
use crate::segment::TAG_ENTRY_SIZE;

/// Where the records of an append landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendInfo {
    /// Offset of the first record appended.
    pub first_offset: Offset,
    /// Offset of the last record appended.
    pub last_offset: Offset,
    /// Records appended.
    pub record_count: u64,
    /// Largest record timestamp appended.
    pub max_timestamp: i64,
    /// Bytes appended.
    pub size_bytes: u64,
    /// The batches were an idempotent producer's retry of batches already in the log:
    /// nothing was written, and the offsets are those of the first write.
    pub duplicate: bool,
}

/// How far a read may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// Consumers: only batches wholly below the high watermark.
    HighWatermark,
    /// Followers: everything up to the log end.
    LogEnd,
    /// Read-committed consumers: only batches wholly below the last stable offset (the
    /// first offset of the earliest open transaction, capped by the high watermark); the
    /// read also returns the aborted transactions overlapping what it read.
    Committed,
}

/// How a read may go about it ([`PartitionLog::read_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOptions {
    /// Check the CRC of every returned batch (default). Whole batches are returned
    /// either way, and lengths and offsets are always checked.
    pub verify_crc: bool,
    /// Never wait for the disk: fail with [`LogError::NotCached`] unless every byte is in
    /// the page cache, so an async task can serve the common case itself and hand only
    /// cold reads to a blocking thread.
    pub cached_only: bool,
}

impl Default for ReadOptions {
    fn default() -> Self {
        Self {
            verify_crc: true,
            cached_only: false,
        }
    }
}

/// The bytes of a read and the log's offsets at that moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchData {
    /// Whole, CRC-checked record batches; the first holds the requested offset (and may
    /// start before it). Empty when nothing is readable yet. A filtered read returns only
    /// passing records, possibly re-batched, from the requested offset on.
    pub records: Bytes,
    /// High watermark when the read was planned.
    pub high_watermark: Offset,
    /// Log start offset when the read was planned.
    pub log_start_offset: Offset,
    /// Log end offset when the read was planned.
    pub log_end_offset: Offset,
    /// Set by filtered reads: where the next read continues (every record below it was
    /// returned or filtered out). Plain reads continue after their last batch.
    pub next_offset: Option<Offset>,
    /// Last stable offset when the read was planned (the high watermark when no
    /// transaction is open).
    pub last_stable_offset: Offset,
    /// [`Isolation::Committed`] reads: the aborted transactions overlapping the returned
    /// records, ordered by marker; the consumer drops their records.
    pub aborted_transactions: Vec<AbortedTxn>,
}

impl FetchData {
    /// [`FetchData::aborted_transactions`] as a reader drops them.
    pub fn aborted_ranges(&self) -> crate::record::control::AbortedRanges {
        crate::record::control::AbortedRanges::new(
            self.aborted_transactions
                .iter()
                .map(|a| (a.producer_id, a.first_offset as i64, a.last_offset as i64))
                .collect(),
        )
    }

    /// No records, with the log's offsets.
    pub fn empty(
        high_watermark: Offset,
        log_start_offset: Offset,
        log_end_offset: Offset,
        last_stable_offset: Offset,
    ) -> Self {
        Self {
            records: Bytes::new(),
            high_watermark,
            log_start_offset,
            log_end_offset,
            next_offset: None,
            last_stable_offset,
            aborted_transactions: Vec::new(),
        }
    }
}

/// What one retention pass deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RetentionOutcome {
    /// Segments deleted.
    pub deleted_segments: usize,
    /// Bytes freed.
    pub deleted_bytes: u64,
    /// Log start offset afterwards.
    pub log_start_offset: Offset,
}

struct LogState {
    segments: BTreeMap<u64, LogSegment>,
    config: TopicConfig,
    log_start_offset: u64,
    high_watermark: u64,
    epochs: LeaderEpochCache,
    producers: ProducerStateTable,
    /// Aborted transactions, per segment (the `.txnindex` files).
    aborted: AbortedIndex,
    /// The producer table changed since its snapshot was written.
    producers_dirty: bool,
    unflushed_messages: u64,
    last_flush_ms: i64,
    /// A segment file was created since the last directory fsync.
    dir_dirty: bool,
    /// Clock time the active segment was created (the roll basis while it is empty).
    active_created_ms: i64,
    /// First fatal error; set once, never cleared while open.
    offline: Option<String>,
}

impl LogState {
    fn active(&self) -> &LogSegment {
        self.segments
            .last_key_value()
            .expect("a log always has a segment")
            .1
    }

    fn active_mut(&mut self) -> &mut LogSegment {
        self.segments
            .last_entry()
            .expect("a log always has a segment")
            .into_mut()
    }

    fn log_end_offset(&self) -> u64 {
        self.active().next_offset()
    }

    /// The first offset of the earliest open transaction, capped by the high watermark.
    fn last_stable_offset(&self) -> u64 {
        self.producers
            .first_unstable_offset()
            .map_or(self.high_watermark, |o| o.min(self.high_watermark))
    }

    /// The base offset of the segment holding `offset`.
    fn segment_base_of(&self, offset: u64) -> u64 {
        self.segments
            .range(..=offset)
            .next_back()
            .map_or(0, |(b, _)| *b)
    }

    /// The segment holding `offset`, skipping segments that end at or before it.
    /// The offsets a read from `offset` reports (no records yet) and the offset it may not
    /// pass; `OffsetOutOfRange` outside `[log start, log end]`.
    fn plan_read(&self, offset: u64, isolation: Isolation) -> Result<(FetchData, u64), LogError> {
        let log_end = self.log_end_offset();
        if offset < self.log_start_offset || offset > log_end {
            return Err(LogError::OffsetOutOfRange {
                requested: offset,
                log_start_offset: self.log_start_offset,
                log_end_offset: log_end,
            });
        }
        let last_stable = self.last_stable_offset();
        let bound = match isolation {
            Isolation::HighWatermark => self.high_watermark,
            Isolation::LogEnd => log_end,
            Isolation::Committed => last_stable,
        };
        let aborted_transactions = if isolation == Isolation::Committed && offset < bound {
            self.aborted.overlapping(offset, bound)
        } else {
            Vec::new()
        };
        let data = FetchData {
            records: Bytes::new(),
            high_watermark: Offset(self.high_watermark),
            log_start_offset: Offset(self.log_start_offset),
            log_end_offset: Offset(log_end),
            next_offset: None,
            last_stable_offset: Offset(last_stable),
            aborted_transactions,
        };
        Ok((data, bound))
    }

    fn segment_for(&self, offset: u64) -> Option<&LogSegment> {
        let (_, floor) = self.segments.range(..=offset).next_back()?;
        if offset < floor.next_offset() {
            return Some(floor);
        }
        self.segments
            .range(offset + 1..)
            .map(|(_, s)| s)
            .find(|s| !s.is_empty())
    }
}

/// The offsets most callers want, readable without the lock: every write guard
/// ([`StateGuard`]) republishes them when it is dropped, so they never lag a finished
/// mutation. Each value is current on its own; a caller needing several that agree reads
/// them under the lock.
#[derive(Debug, Default)]
struct PublishedOffsets {
    log_start: AtomicU64,
    log_end: AtomicU64,
    high_watermark: AtomicU64,
}

impl PublishedOffsets {
    fn publish(&self, state: &LogState) {
        self.log_start
            .store(state.log_start_offset, Ordering::Release);
        self.log_end
            .store(state.log_end_offset(), Ordering::Release);
        self.high_watermark
            .store(state.high_watermark, Ordering::Release);
    }
}

/// The log's write lock; publishes the offsets on drop.
struct StateGuard<'a> {
    state: parking_lot::RwLockWriteGuard<'a, LogState>,
    published: &'a PublishedOffsets,
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = LogState;
    fn deref(&self) -> &LogState {
        &self.state
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut LogState {
        &mut self.state
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        self.published.publish(&self.state);
    }
}

/// The log of one partition, shared between threads.
pub struct PartitionLog {
    dir: PathBuf,
    name: String,
    clock: Arc<dyn Clock>,
    state: RwLock<LogState>,
    /// Offsets published by every write (lock-free reads).
    published: PublishedOffsets,
    group_commit: GroupCommit,
    /// Bumped by every truncation; a read that saw it move retries.
    generation: AtomicU64,
    /// When a full disk was last logged (ms), so repeats stay quiet.
    no_space_logged_ms: AtomicI64,
    /// The offsets the checkpoint file holds (after this process wrote it), so a periodic
    /// checkpoint of an unchanged partition writes nothing. Held while the file is
    /// written, so writers never interleave (lock order: the state lock first).
    written_checkpoint: parking_lot::Mutex<Option<OffsetsCheckpoint>>,
    /// Held while the producer-state snapshot is written (lock order: state first).
    snapshot_io: parking_lot::Mutex<()>,
    /// Whether the last shutdown was clean (recovery was skipped).
    opened_clean: bool,
    /// Corrupt batches reads met while open (bounded; see [`PartitionLog::damage_seen`]).
    read_damage: parking_lot::Mutex<Vec<DamagedRange>>,
    /// Tests only: the mutation step that fails next.
    #[cfg(test)]
    fault: parking_lot::Mutex<Option<FaultSite>>,
    _lock: Arc<File>,
}

/// Steps of a mutation where tests inject an I/O failure (a no-op outside tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultSite {
    /// Renaming a segment's files to `.deleted`.
    MarkDeleted,
    /// Creating a new segment.
    CreateSegment,
    /// Truncating the segment that becomes the active one.
    TruncateSegment,
    /// Removing `.deleted` files.
    DeleteFiles,
    /// An fsync of the segment files.
    Fsync,
}

/// Most corrupt-read reports kept per partition.
const READ_DAMAGE_MAX: usize = 64;

impl std::fmt::Debug for PartitionLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionLog")
            .field("dir", &self.dir)
            .finish()
    }
}

/// How often a read retries when truncations keep racing with it.
const READ_ATTEMPTS: usize = 4;

impl PartitionLog {
    /// Opens (or creates) the partition in `dir`, recovering it after a crash.
    /// Locks `dir` itself ([`DirLock::Own`]).
    pub fn open(dir: &Path, config: TopicConfig, clock: Arc<dyn Clock>) -> Result<Self, LogError> {
        Self::open_with(dir, config, clock, &DirLock::Own)
    }

    /// [`PartitionLog::open`] under the given lock (a broker passes its data-dir lock).
    pub fn open_with(
        dir: &Path,
        config: TopicConfig,
        clock: Arc<dyn Clock>,
        lock: &DirLock,
    ) -> Result<Self, LogError> {
        let log = Self::open_segments(dir, config, clock, lock)?;
        log.rebuild_producer_state()?;
        Ok(log)
    }

    /// Loads the producer-state snapshot and replays the batches after it.
    fn rebuild_producer_state(&self) -> Result<(), LogError> {
        let snapshot = producer_state::load_snapshot(&self.dir);
        let (start, end) = (self.log_start_offset(), self.log_end_offset());
        let (mut table, from) = match snapshot {
            Some((table, covered)) => (table, covered),
            // No snapshot: replay the whole log, so transactions opened in any segment
            // (and the aborted index they rebuild) are known; a partition keeps a snapshot
            // from its first checkpoint on, so this runs once, after a loss.
            None => (ProducerStateTable::default(), start.0),
        };
        if from > end.0 {
            table.truncate_to(end.0);
        }
        let mut next = Offset(from.clamp(start.0, end.0));
        // Aborts at or after the replay's start are written again as it meets them.
        let mut aborts: Vec<AbortedTxn> = Vec::new();
        {
            let mut state = self.write_state();
            let r = state
                .aborted
                .truncate_from(&self.dir, next.0)
                .map_err(|e| LogError::io(&self.dir, e));
            self.step(&mut state, r)?;
        }
        while next < end {
            let data = match self.read(next, 1 << 20, Isolation::LogEnd) {
                Ok(data) => data,
                Err(e) => {
                    // Reads report the damage to whoever asks; the state stays partial.
                    tracing::warn!(partition = %self.name, offset = next.0, error = %e, "producer state replay stopped");
                    break;
                }
            };
            let mut last = None;
            for batch in BatchIter::new(&data.records) {
                let Ok(batch) = batch else { break };
                let h = batch.header();
                last = Some(h.last_offset() as u64);
                if h.producer_id >= 0 && h.last_offset() as u64 >= next.0 {
                    let marker = if h.is_control() {
                        match decode_marker(&batch) {
                            Ok(m) => Some(m),
                            Err(e) => {
                                tracing::warn!(partition = %self.name, offset = h.base_offset, error = %e, "skipping an undecodable transaction marker");
                                continue;
                            }
                        }
                    } else {
                        None
                    };
                    let meta = BatchMeta::of(h, 0, marker);
                    aborts.extend(apply_to_table(&mut table, &meta, h.base_offset as u64));
                }
            }
            match last {
                Some(l) => next = Offset(l + 1),
                None => break,
            }
        }
        if !table.is_empty() {
            tracing::debug!(partition = %self.name, producers = table.len(), "producer state rebuilt");
        }
        let mut state = self.write_state();
        state.producers = table;
        state.producers_dirty = !aborts.is_empty();
        for entry in aborts {
            let base = state.segment_base_of(entry.last_offset);
            let r = state
                .aborted
                .append(&self.dir, base, entry)
                .map_err(|e| LogError::io(&self.dir, e));
            self.step(&mut state, r)?;
        }
        Ok(())
    }

    fn open_segments(
        dir: &Path,
        config: TopicConfig,
        clock: Arc<dyn Clock>,
        lock: &DirLock,
    ) -> Result<Self, LogError> {
        let loaded = loader::load(dir, &config, lock)?;
        let bases: Vec<u64> = loaded.segments.keys().copied().collect();
        let aborted = AbortedIndex::load(dir, &bases).map_err(|e| LogError::io(dir, e))?;
        let name = dir
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let now = clock.now_ms();
        let log_end = loaded
            .segments
            .last_key_value()
            .expect("at least one segment")
            .1
            .next_offset();
        let log = Self {
            dir: dir.to_path_buf(),
            name,
            published: PublishedOffsets::default(),
            state: RwLock::new(LogState {
                segments: loaded.segments,
                config,
                log_start_offset: loaded.log_start_offset,
                high_watermark: loaded.high_watermark,
                epochs: loaded.epochs,
                producers: ProducerStateTable::default(),
                aborted,
                producers_dirty: false,
                unflushed_messages: 0,
                last_flush_ms: now,
                dir_dirty: false,
                active_created_ms: now,
                offline: None,
            }),
            clock,
            group_commit: GroupCommit::new(log_end),
            generation: AtomicU64::new(0),
            no_space_logged_ms: AtomicI64::new(i64::MIN / 2),
            written_checkpoint: parking_lot::Mutex::new(None),
            snapshot_io: parking_lot::Mutex::new(()),
            opened_clean: loaded.was_clean,
            read_damage: parking_lot::Mutex::new(Vec::new()),
            #[cfg(test)]
            fault: parking_lot::Mutex::new(None),
            _lock: loaded.lock,
        };
        log.published.publish(&log.state.read());
        Ok(log)
    }

    /// The write lock; the offsets are republished when it is released.
    fn write_state(&self) -> StateGuard<'_> {
        StateGuard {
            state: self.state.write(),
            published: &self.published,
        }
    }

    /// True when the previous shutdown was clean and recovery was skipped.
    pub fn opened_after_clean_shutdown(&self) -> bool {
        self.opened_clean
    }

    /// The partition directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// First offset in the log (lock-free).
    pub fn log_start_offset(&self) -> Offset {
        Offset(self.published.log_start.load(Ordering::Acquire))
    }

    /// Offset the next appended record gets (lock-free).
    pub fn log_end_offset(&self) -> Offset {
        Offset(self.published.log_end.load(Ordering::Acquire))
    }

    /// Offset below which consumers may read (lock-free).
    pub fn high_watermark(&self) -> Offset {
        Offset(self.published.high_watermark.load(Ordering::Acquire))
    }

    /// Every offset below this is on disk.
    pub fn recovery_point(&self) -> Offset {
        Offset(self.group_commit.durable())
    }

    /// Sets the high watermark, clamped into `[log_start_offset, log_end_offset]`;
    /// returns the value set. The replication layer decides the value.
    pub fn set_high_watermark(&self, offset: Offset) -> Offset {
        let mut state = self.write_state();
        let hw = offset
            .0
            .clamp(state.log_start_offset, state.log_end_offset());
        state.high_watermark = hw;
        Offset(hw)
    }

    /// The current topic config.
    pub fn config(&self) -> TopicConfig {
        self.state.read().config.clone()
    }

    /// The topic's `min.insync.replicas` (read per produce; no config clone).
    pub fn min_insync_replicas(&self) -> u32 {
        self.state.read().config.min_insync_replicas
    }

    /// Applies a changed topic config (takes effect on the next append, roll or pass).
    pub fn update_config(&self, config: TopicConfig) {
        self.write_state().config = config;
    }

    /// Number of segments.
    pub fn segment_count(&self) -> usize {
        self.state.read().segments.len()
    }

    /// Base offsets of the segments, oldest first.
    pub fn segment_base_offsets(&self) -> Vec<Offset> {
        self.state
            .read()
            .segments
            .keys()
            .map(|&b| Offset(b))
            .collect()
    }

    /// Bytes in all segment files.
    pub fn size_bytes(&self) -> u64 {
        self.state
            .read()
            .segments
            .values()
            .map(LogSegment::size)
            .sum()
    }

    /// The newest leader epoch in the log, if any.
    pub fn latest_epoch(&self) -> Option<LeaderEpoch> {
        self.state.read().epochs.latest_epoch()
    }

    /// Kafka's OffsetsForLeaderEpoch answer: the largest epoch `<= epoch` this log knows and
    /// the offset where it ends. `None` when the epoch is unknown (see
    /// [`LeaderEpochCache::end_offset_for`]).
    pub fn end_offset_for_epoch(&self, epoch: LeaderEpoch) -> Option<(LeaderEpoch, Offset)> {
        let state = self.state.read();
        state
            .epochs
            .end_offset_for(epoch, Offset(state.log_end_offset()))
    }

    /// Records that `epoch` starts at the current log end: a new leader calls this as it
    /// takes over, so a follower asking where the previous epoch ended gets the answer
    /// even before the new leader has written anything.
    pub fn assign_leader_epoch(&self, epoch: LeaderEpoch) -> Result<(), LogError> {
        let mut state = self.write_state();
        self.check_online(&state)?;
        let end = Offset(state.log_end_offset());
        if state.epochs.assign(epoch, end) {
            self.persist_epochs_locked(&mut state)?;
        }
        Ok(())
    }

    /// The epoch entries, oldest first.
    pub fn epoch_entries(&self) -> Vec<super::EpochEntry> {
        self.state.read().epochs.entries().to_vec()
    }

    fn check_online(&self, state: &LogState) -> Result<(), LogError> {
        match &state.offline {
            Some(reason) => Err(LogError::Offline {
                partition: self.name.clone(),
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Records a fatal error: the partition refuses everything from now on.
    fn go_offline(&self, state: &mut LogState, error: &LogError) {
        if state.offline.is_none() {
            tracing::error!(partition = %self.name, %error, "partition going offline after a fatal error");
            state.offline = Some(error.to_string());
        }
    }

    /// Runs the result of one fallible step of a mutation: any error takes the partition
    /// offline, because the step may have changed files the in-memory state no longer
    /// describes.
    fn step<T>(
        &self,
        state: &mut LogState,
        result: Result<T, impl Into<LogError>>,
    ) -> Result<T, LogError> {
        result.map_err(|e| {
            let error = e.into();
            self.go_offline(state, &error);
            error
        })
    }

    /// Tests only: makes the next `site` step fail with an I/O error.
    #[cfg(test)]
    pub(crate) fn inject_fault(&self, site: FaultSite) {
        *self.fault.lock() = Some(site);
    }

    #[cfg(test)]
    fn fault(&self, site: FaultSite) -> Result<(), LogError> {
        let mut fault = self.fault.lock();
        if *fault == Some(site) {
            *fault = None;
            return Err(LogError::io(
                &self.dir,
                std::io::Error::other(format!("injected fault at {site:?}")),
            ));
        }
        Ok(())
    }

    #[cfg(not(test))]
    #[inline(always)]
    fn fault(&self, _site: FaultSite) -> Result<(), LogError> {
        Ok(())
    }

    /// Why the partition is offline, `None` while it is online.
    pub fn offline_reason(&self) -> Option<String> {
        self.state.read().offline.clone()
    }

    /// Corrupt batches that reads met since the partition opened (a clean start trusts
    /// sealed segments, so damage there shows up only when read). Each is also logged
    /// once at `error`. The broker reports them like an open-time [`LogError::Damaged`].
    pub fn damage_seen(&self) -> Vec<DamagedRange> {
        self.read_damage.lock().clone()
    }

    /// Whether a read met a corrupt batch since the partition opened (no copy).
    pub fn has_read_damage(&self) -> bool {
        !self.read_damage.lock().is_empty()
    }

    fn record_read_damage(&self, file: &Path, position: u64, offset: u64, reason: &str) {
        let mut seen = self.read_damage.lock();
        if seen.len() >= READ_DAMAGE_MAX
            || seen
                .iter()
                .any(|d| d.file == file && d.start_position == position)
        {
            return;
        }
        tracing::error!(partition = %self.name, path = %file.display(), position, offset, %reason, "read met a corrupt batch; run `tidelog repair` on this partition (offline)");
        seen.push(DamagedRange {
            kind: DamageKind::Corrupt,
            file: file.to_path_buf(),
            segment_base_offset: file
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.parse().ok())
                .unwrap_or(0),
            start_position: position,
            end_position: position,
            first_offset: offset,
            resume_offset: None,
            reason: reason.to_string(),
        });
    }

    /// Writes the epoch cache; a failure is fatal like any failed write.
    fn persist_epochs_locked(&self, state: &mut LogState) -> Result<(), LogError> {
        if let Err(e) = state.epochs.persist() {
            let error = LogError::io(&self.dir, e);
            self.go_offline(state, &error);
            return Err(error);
        }
        Ok(())
    }

    /// Appends batches from a client as the leader: validates them, assigns offsets from
    /// the log end (rewriting each batch's base offset and leader epoch in `batches`, which
    /// keeps the CRCs valid), and writes them. With `flush.mode=sync` it returns only once
    /// the records are on disk. Nothing is written when validation fails.
    pub fn append_as_leader(
        &self,
        batches: &mut [u8],
        leader_epoch: LeaderEpoch,
    ) -> Result<AppendInfo, LogError> {
        let (info, durable_target) = self.append_as_leader_deferred(batches, leader_epoch)?;
        if let Some(target) = durable_target {
            self.wait_durable(target)?;
        }
        Ok(info)
    }

    /// [`PartitionLog::append_as_leader`] without the fsync wait: the write goes to the
    /// page cache only, so an async caller may run it on its own task. When the flush
    /// policy wants the records on disk before they are acknowledged, the offset to
    /// pass to [`PartitionLog::sync_to`] (on a blocking thread) comes back too.
    pub fn append_as_leader_deferred(
        &self,
        batches: &mut [u8],
        leader_epoch: LeaderEpoch,
    ) -> Result<(AppendInfo, Option<u64>), LogError> {
        self.append_as_leader_guarded(batches, leader_epoch, &[])
    }

    /// A guard for a transactional write of `producer_id` that is about to be verified
    /// with the coordinator (see [`PartitionLog::append_as_leader_guarded`]).
    pub fn txn_guard(&self, producer_id: i64) -> TxnGuard {
        self.state.read().producers.txn_guard(producer_id)
    }

    /// [`PartitionLog::append_as_leader_deferred`] refusing the write (INVALID_TXN_STATE)
    /// when a marker ended a guarded producer's transaction after its guard was taken.
    pub fn append_as_leader_guarded(
        &self,
        batches: &mut [u8],
        leader_epoch: LeaderEpoch,
        guards: &[TxnGuard],
    ) -> Result<(AppendInfo, Option<u64>), LogError> {
        let max_message_bytes = self.state.read().config.max_message_bytes;
        // CPU-heavy checks (CRC, decompression) before taking the write lock.
        let validated = validate_batches(batches, max_message_bytes, true)?;
        let metas = &validated.metas;
        // A batch must fit one segment's tag index: refused before anything is written.
        let tag_capacity = self.state.read().config.segment_index_bytes / TAG_ENTRY_SIZE;
        for (i, _) in metas.iter().enumerate() {
            let n = validated
                .tags
                .iter()
                .filter(|t| t.batch as usize == i)
                .count();
            if n > tag_capacity {
                return Err(LogError::InvalidRecord {
                    reason: format!(
                        "batch {i} holds {n} tagged records; a segment's tag index holds at most {tag_capacity} (segment.index.bytes / 12)"
                    ),
                });
            }
        }
        let mut state = self.write_state();
        self.check_online(&state)?;
        for guard in guards {
            state.producers.check_guard(guard)?;
        }
        if let Some(duplicate) = Self::check_sequences(&state, metas)? {
            // A retry is acknowledged like the original: on disk first under sync mode.
            let sync = state.config.flush_mode == FlushMode::Sync;
            return Ok((duplicate, sync.then_some(duplicate.last_offset.0 + 1)));
        }
        let first = state.log_end_offset();
        let mut next = first;
        let mut bases = Vec::with_capacity(metas.len());
        for meta in metas {
            let batch = &mut batches[meta.position..];
            set_base_offset(batch, next as i64);
            set_partition_leader_epoch(batch, leader_epoch.0);
            bases.push(next);
            next += meta.offset_span;
        }
        if state.epochs.assign(leader_epoch, Offset(first)) {
            self.persist_epochs_locked(&mut state)?;
        }
        let info = self.write_locked(&mut state, batches, metas, &validated.tags, first, next)?;
        for (meta, base) in metas.iter().zip(bases) {
            self.record_producer(&mut state, meta, base)?;
        }
        Ok((info, self.after_append(state, next)))
    }

    /// Blocks until every offset below `target` is on disk (group commit); see
    /// [`PartitionLog::append_as_leader_deferred`].
    pub fn sync_to(&self, target: u64) -> Result<(), LogError> {
        self.wait_durable(target)
    }

    /// Appends batches copied from the leader as a follower: they keep their offsets and
    /// epochs and must start exactly at the log end.
    pub fn append_as_follower(&self, batches: &[u8]) -> Result<AppendInfo, LogError> {
        let max_message_bytes = self.state.read().config.max_message_bytes;
        // A leader may hold batches above this follower's limit (config changed later):
        // copy them anyway rather than stall replication.
        let validated = validate_batches(batches, max_message_bytes.max(1 << 30), false)?;
        let metas = &validated.metas;
        let mut state = self.write_state();
        self.check_online(&state)?;
        let first = state.log_end_offset();
        let mut next = first;
        for meta in metas {
            if meta.base_offset != next {
                return Err(LogError::NonContiguousAppend {
                    expected: next,
                    got: meta.base_offset,
                });
            }
            next += meta.offset_span;
        }
        let mut epochs_changed = false;
        for meta in metas {
            epochs_changed |= state.epochs.assign(
                LeaderEpoch(meta.partition_leader_epoch),
                Offset(meta.base_offset),
            );
        }
        if epochs_changed {
            self.persist_epochs_locked(&mut state)?;
        }
        let info = self.write_locked(&mut state, batches, metas, &validated.tags, first, next)?;
        for meta in metas {
            self.record_producer(&mut state, meta, meta.base_offset)?;
        }
        if let Some(target) = self.after_append(state, next) {
            self.wait_durable(target)?;
        }
        Ok(info)
    }

    /// Checks idempotent producers' sequences. `Some` when every batch is a retry of
    /// batches already in the log (nothing to write; their original offsets); an error
    /// when any batch is out of order or fenced, or when retries and new batches mix.
    fn check_sequences(
        state: &LogState,
        metas: &[BatchMeta],
    ) -> Result<Option<AppendInfo>, LogError> {
        let mut duplicates: Vec<ProducerBatch> = Vec::new();
        let mut scratch: Option<ProducerStateTable> = None;
        for meta in metas.iter().filter(|m| m.producer_id >= 0) {
            let table = scratch.as_ref().unwrap_or(&state.producers);
            let last_seq = meta.base_sequence.wrapping_add(meta.offset_span as i32 - 1);
            let check = table.check(
                meta.producer_id,
                meta.producer_epoch,
                meta.base_sequence,
                last_seq,
            )?;
            if check == SequenceCheck::Append {
                table.check_transactional(
                    meta.producer_id,
                    meta.producer_epoch,
                    meta.transactional,
                )?;
            }
            match check {
                SequenceCheck::Duplicate(b) => duplicates.push(b),
                SequenceCheck::Append if metas.len() > 1 => {
                    // Later batches of the same request are checked against this one.
                    let table = scratch.get_or_insert_with(|| state.producers.clone());
                    table.record(
                        meta.producer_id,
                        meta.producer_epoch,
                        ProducerBatch {
                            first_seq: meta.base_sequence,
                            last_seq,
                            first_offset: 0,
                            last_offset: 0,
                        },
                    );
                    if meta.transactional {
                        table.record_transactional(meta.producer_id, 0);
                    }
                }
                SequenceCheck::Append => {}
            }
        }
        if duplicates.is_empty() {
            return Ok(None);
        }
        if duplicates.len() != metas.len() {
            return Err(LogError::InvalidRecord {
                reason: "a request mixes retried batches with new ones".into(),
            });
        }
        let first = duplicates.first().expect("non-empty");
        let last = duplicates.last().expect("non-empty");
        Ok(Some(AppendInfo {
            first_offset: Offset(first.first_offset),
            last_offset: Offset(last.last_offset),
            record_count: metas.iter().map(|m| m.record_count).sum(),
            max_timestamp: metas.iter().map(|m| m.max_timestamp).max().unwrap_or(-1),
            size_bytes: 0,
            duplicate: true,
        }))
    }

    /// Records a producer's batch written at `base_offset` (and an abort in the
    /// aborted-transaction index).
    fn record_producer(
        &self,
        state: &mut LogState,
        meta: &BatchMeta,
        base_offset: u64,
    ) -> Result<(), LogError> {
        if meta.producer_id < 0 {
            return Ok(());
        }
        state.producers_dirty = true;
        let aborted = apply_to_table(&mut state.producers, meta, base_offset);
        if let Some(entry) = aborted {
            let base = state.segment_base_of(entry.last_offset);
            let r = state
                .aborted
                .append(&self.dir, base, entry)
                .map_err(|e| LogError::io(&self.dir, e));
            self.step(state, r)?;
        }
        Ok(())
    }

    /// Appends the marker ending `producer_id`'s transaction as the leader (only the
    /// transaction coordinator calls this). Like
    /// [`PartitionLog::append_as_leader_deferred`], it returns the offset to make durable
    /// when the flush policy wants it. A marker of an older producer epoch or coordinator
    /// epoch than the partition has seen is refused.
    pub fn append_marker_deferred(
        &self,
        producer_id: i64,
        producer_epoch: i16,
        marker: ControlMarker,
        leader_epoch: LeaderEpoch,
    ) -> Result<(AppendInfo, Option<u64>), LogError> {
        let mut batch = marker_batch(producer_id, producer_epoch, marker, self.clock.now_ms());
        let validated = validate_batches(&batch, usize::MAX, false)?;
        let mut state = self.write_state();
        self.check_online(&state)?;
        state
            .producers
            .check_marker(producer_id, producer_epoch, marker.coordinator_epoch)?;
        let first = state.log_end_offset();
        set_base_offset(&mut batch, first as i64);
        set_partition_leader_epoch(&mut batch, leader_epoch.0);
        if state.epochs.assign(leader_epoch, Offset(first)) {
            self.persist_epochs_locked(&mut state)?;
        }
        let metas = &validated.metas;
        let info = self.write_locked(&mut state, &batch, metas, &[], first, first + 1)?;
        self.record_producer(&mut state, &metas[0], first)?;
        Ok((info, self.after_append(state, first + 1)))
    }

    /// [`PartitionLog::append_marker_deferred`], waiting for the flush policy.
    pub fn append_marker(
        &self,
        producer_id: i64,
        producer_epoch: i16,
        marker: ControlMarker,
        leader_epoch: LeaderEpoch,
    ) -> Result<AppendInfo, LogError> {
        let (info, durable) =
            self.append_marker_deferred(producer_id, producer_epoch, marker, leader_epoch)?;
        if let Some(target) = durable {
            self.wait_durable(target)?;
        }
        Ok(info)
    }

    /// The last stable offset: below it, no transaction is open.
    pub fn last_stable_offset(&self) -> Offset {
        Offset(self.state.read().last_stable_offset())
    }

    /// Whether `producer_id` has an open transaction in this partition.
    pub fn has_open_transaction(&self, producer_id: i64) -> bool {
        self.state
            .read()
            .producers
            .get(producer_id)
            .is_some_and(|e| e.txn_first_offset.is_some())
    }

    /// The sequence `producer_id`'s next batch at `epoch` must start at (0 for a new
    /// producer or epoch): a coordinator writing on a producer's behalf (the group
    /// coordinator's transactional offset commits) continues its sequence.
    pub fn next_sequence(&self, producer_id: i64, epoch: i16) -> i32 {
        let state = self.state.read();
        match state.producers.get(producer_id) {
            Some(e) if e.epoch == epoch => e
                .batches
                .back()
                .map_or(0, |b| producer_state::next_sequence(b.last_seq)),
            _ => 0,
        }
    }

    /// Open transactions: (first offset, producer id), earliest first.
    pub fn open_transactions(&self) -> Vec<(Offset, i64)> {
        self.state
            .read()
            .producers
            .open_transactions()
            .map(|(o, p)| (Offset(o), p))
            .collect()
    }

    /// The aborted transactions whose markers lie in the segment at `base` (`dump-log`).
    pub fn aborted_transactions_of_segment(&self, base: Offset) -> Vec<AbortedTxn> {
        self.state.read().aborted.entries_of(base.0).to_vec()
    }

    /// Rolls if needed and writes validated, numbered batches (with their tagged records)
    /// to the active segment. Batches whose tagged records overflow the active segment's
    /// tag index start a new segment (in one request, only with very many tiny records).
    fn write_locked(
        &self,
        state: &mut LogState,
        data: &[u8],
        metas: &[BatchMeta],
        tags: &[TagMark],
        first: u64,
        next: u64,
    ) -> Result<AppendInfo, LogError> {
        let max_timestamp = metas.iter().map(|m| m.max_timestamp).max().unwrap_or(-1);
        let record_count = metas.iter().map(|m| m.record_count).sum();
        if self.should_roll(state, data.len() as u64, next - 1, max_timestamp) {
            self.roll_locked(state)?;
        }
        let (mut batch_from, mut tag_from) = (0usize, 0usize);
        while batch_from < metas.len() {
            let (batch_to, tag_to) = tag_chunk(
                tags,
                batch_from,
                tag_from,
                metas.len(),
                state.active().tag_room(),
            );
            if batch_to == batch_from {
                if state.active().is_empty() {
                    let n = tags[tag_from..]
                        .iter()
                        .take_while(|t| t.batch as usize == batch_from)
                        .count();
                    return Err(LogError::InvalidRecord {
                        reason: format!(
                            "batch {batch_from} holds {n} tagged records; a segment's tag index holds at most {} (segment.index.bytes / 12)",
                            state.active().tag_room()
                        ),
                    });
                }
                self.roll_locked(state)?;
                continue;
            }
            let start = metas[batch_from].position;
            let end = metas.get(batch_to).map_or(data.len(), |m| m.position);
            let chunk_tags: Vec<TagMark>;
            let chunk_tags = if batch_from == 0 {
                &tags[tag_from..tag_to]
            } else {
                chunk_tags = tags[tag_from..tag_to]
                    .iter()
                    .map(|t| TagMark {
                        batch: t.batch - batch_from as u32,
                        ..*t
                    })
                    .collect();
                &chunk_tags
            };
            if let Err(e) = state.active_mut().append(&data[start..end], chunk_tags) {
                let error = LogError::from(e);
                if error.is_no_space() {
                    self.warn_no_space(&error);
                } else if matches!(error, LogError::Io { .. }) {
                    self.go_offline(state, &error);
                }
                return Err(error);
            }
            (batch_from, tag_from) = (batch_to, tag_to);
        }
        state.unflushed_messages += record_count;
        Ok(AppendInfo {
            first_offset: Offset(first),
            last_offset: Offset(next - 1),
            record_count,
            max_timestamp,
            size_bytes: data.len() as u64,
            duplicate: false,
        })
    }

    /// Applies the flush policy after an append and releases the lock: the offset the
    /// caller must make durable before acknowledging, if the policy wants an fsync.
    fn after_append(&self, state: StateGuard<'_>, next: u64) -> Option<u64> {
        let sync = state.config.flush_mode == FlushMode::Sync
            || state.unflushed_messages >= state.config.flush_messages;
        drop(state);
        sync.then_some(next)
    }

    fn should_roll(
        &self,
        state: &LogState,
        append_bytes: u64,
        last_offset: u64,
        max_timestamp: i64,
    ) -> bool {
        let active = state.active();
        if active.is_empty() {
            return false;
        }
        let config = &state.config;
        let elapsed_ms = match active.first_batch_timestamp() {
            Some(first) if first >= 0 => max_timestamp.saturating_sub(first),
            _ => self.clock.now_ms().saturating_sub(state.active_created_ms),
        };
        active.size() + append_bytes > config.segment_bytes
            || elapsed_ms > config.segment_ms
            || active.indexes_full()
            || !active.can_hold_offset(last_offset)
    }

    fn roll_locked(&self, state: &mut LogState) -> Result<(), LogError> {
        let next = state.log_end_offset();
        if state.active().is_empty() {
            return Ok(());
        }
        let result = state
            .active_mut()
            .seal()
            .and_then(|()| LogSegment::create(&self.dir, next, segment_config(&state.config)));
        match result {
            Ok(segment) => {
                state.segments.insert(next, segment);
                state.dir_dirty = true;
                state.active_created_ms = self.clock.now_ms();
                tracing::info!(partition = %self.name, base_offset = next, "rolled to a new segment");
                Ok(())
            }
            Err(e) => {
                // A full disk fails the roll before the old segment changed in a way that
                // matters (sealing again and retrying is safe): no need to go offline.
                let error = LogError::from(e);
                if error.is_no_space() {
                    self.warn_no_space(&error);
                } else {
                    self.go_offline(state, &error);
                }
                Err(error)
            }
        }
    }

    /// Logs a write refused for want of space, at most once a minute per partition.
    pub fn warn_no_space(&self, error: &LogError) {
        let now = self.clock.now_ms();
        let last = self.no_space_logged_ms.swap(now, Ordering::Relaxed);
        if now - last >= 60_000 {
            tracing::warn!(partition = %self.name, %error, "disk full: writes refused until space is freed; reads go on");
        }
    }

    /// Seals the active segment and starts a new one at the log end (no-op when the
    /// active segment is empty).
    pub fn roll(&self) -> Result<(), LogError> {
        let mut state = self.write_state();
        self.check_online(&state)?;
        self.roll_locked(&mut state)
    }

    /// Blocks until every offset below `target` is on disk, sharing fsyncs with other
    /// waiters (group commit).
    fn wait_durable(&self, target: u64) -> Result<(), LogError> {
        self.group_commit
            .wait_durable(target, || self.flush_pass())
            .map_err(|reason| LogError::Offline {
                partition: self.name.clone(),
                reason,
            })
    }

    /// One flush: fsyncs every segment that may hold data above the recovery point.
    /// Returns the offset covered, or `None` when a truncation raced with it.
    fn flush_pass(&self) -> Result<Option<u64>, String> {
        let generation = self.generation.load(Ordering::Acquire);
        let durable = self.group_commit.durable();
        let (end, files, dir_dirty) = {
            let mut state = self.write_state();
            if let Some(reason) = &state.offline {
                return Err(reason.clone());
            }
            let first_dirty = state
                .segments
                .range(..=durable)
                .next_back()
                .map_or(0, |(&b, _)| b);
            let files: Result<Vec<(PathBuf, Arc<File>)>, LogError> = state
                .segments
                .range(first_dirty..)
                .map(|(_, s)| Ok((s.log_path().to_path_buf(), s.log_handle()?)))
                .collect();
            state.unflushed_messages = 0;
            state.last_flush_ms = self.clock.now_ms();
            let dir_dirty = std::mem::take(&mut state.dir_dirty);
            (state.log_end_offset(), files, dir_dirty)
        };
        let started = std::time::Instant::now();
        let mut result = self.fault(FaultSite::Fsync).and_then(|()| {
            files?
                .iter()
                .try_for_each(|(path, file)| file.sync_data().map_err(|e| LogError::io(path, e)))
        });
        if result.is_ok() && dir_dirty {
            result = checkpoint::sync_dir(&self.dir).map_err(|e| LogError::io(&self.dir, e));
        }
        metrics::histogram!("tidelog_log_flush_duration_seconds")
            .record(started.elapsed().as_secs_f64());
        if let Err(error) = result {
            let mut state = self.write_state();
            self.go_offline(&mut state, &error);
            return Err(error.to_string());
        }
        if self.generation.load(Ordering::Acquire) != generation {
            return Ok(None);
        }
        Ok(Some(end))
    }

    /// Flushes everything appended so far to disk.
    pub fn flush(&self) -> Result<(), LogError> {
        let end = self.state.read().log_end_offset();
        self.wait_durable(end)
    }

    /// Flushes if unflushed data is older than `flush.ms` (call periodically).
    pub fn maybe_flush(&self) -> Result<bool, LogError> {
        let due = {
            let state = self.state.read();
            state.unflushed_messages > 0
                && self.clock.now_ms().saturating_sub(state.last_flush_ms) >= state.config.flush_ms
        };
        if due {
            self.flush()?;
        }
        Ok(due)
    }

    /// Reads whole batches starting with the one that holds `offset`, up to `max_bytes`
    /// (but always at least one batch when one is readable), never past the bound set by
    /// `isolation`. Every returned batch has a valid CRC.
    pub fn read(
        &self,
        offset: Offset,
        max_bytes: usize,
        isolation: Isolation,
    ) -> Result<FetchData, LogError> {
        self.read_with(offset, max_bytes, isolation, ReadOptions::default())
    }

    /// [`PartitionLog::read`] with [`ReadOptions`]: a broker serving consumers (which
    /// check CRCs themselves) skips the CRC check, and an async caller asks for a read
    /// that never waits for the disk ([`LogError::NotCached`] instead).
    pub fn read_with(
        &self,
        offset: Offset,
        max_bytes: usize,
        isolation: Isolation,
        options: ReadOptions,
    ) -> Result<FetchData, LogError> {
        for _ in 0..READ_ATTEMPTS {
            let generation = self.generation.load(Ordering::Acquire);
            if let Some(data) = self.read_once(offset.0, max_bytes, isolation, options)? {
                if self.generation.load(Ordering::Acquire) == generation {
                    return Ok(data);
                }
            }
        }
        // Truncations kept racing with us; answer with nothing rather than risk stale bytes.
        let state = self.state.read();
        Ok(FetchData {
            records: Bytes::new(),
            high_watermark: Offset(state.high_watermark),
            log_start_offset: Offset(state.log_start_offset),
            log_end_offset: Offset(state.log_end_offset()),
            next_offset: None,
            last_stable_offset: Offset(state.last_stable_offset()),
            aborted_transactions: Vec::new(),
        })
    }

    fn read_once(
        &self,
        offset: u64,
        max_bytes: usize,
        isolation: Isolation,
        options: ReadOptions,
    ) -> Result<Option<FetchData>, LogError> {
        let ReadOptions {
            verify_crc,
            cached_only,
        } = options;
        // Locate the bytes under the read lock; read them after releasing it.
        let (file, path, position, first_size, segment_end, bound, mut data) = {
            let state = self.state.read();
            self.check_online(&state)?;
            let (data, bound) = state.plan_read(offset, isolation)?;
            if offset >= bound {
                return Ok(Some(data));
            }
            let Some(segment) = state.segment_for(offset) else {
                return Ok(Some(data));
            };
            let location = match segment.find_batch_with(offset, cached_only) {
                Ok(Some(location)) => location,
                Ok(None) => return Ok(Some(data)),
                Err(e) => {
                    let e = LogError::from(e);
                    if let LogError::Corrupt { path, reason } = &e {
                        self.record_read_damage(path, 0, offset, reason);
                    }
                    return Err(e);
                }
            };
            (
                segment.log_handle()?,
                segment.log_path().to_path_buf(),
                location.position,
                location.header.total_size(),
                segment.size(),
                bound,
                data,
            )
        };
        let want = max_bytes
            .max(first_size)
            .min((segment_end - position) as usize);
        let mut buf = match read_vec_at_most(&file, position, want, cached_only) {
            Ok(buf) => buf,
            Err(e) if cached_only && e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(LogError::NotCached)
            }
            Err(e) => return Err(LogError::io(&path, e)),
        };
        let n = buf.len();
        // Keep whole, valid batches below the bound, within max_bytes (the first always).
        let mut keep = 0usize;
        for batch in BatchIter::new(&buf) {
            let Ok(batch) = batch else {
                // A partial batch at the end of the window: stop before it.
                break;
            };
            let h = batch.header();
            if h.last_offset() as u64 >= bound || (keep > 0 && keep + h.total_size() > max_bytes) {
                break;
            }
            let checked = if verify_crc {
                batch.verify_crc()
            } else {
                Ok(())
            };
            if let Err(e) = checked {
                if keep > 0 {
                    // Serve what is good; the next fetch starting here reports the damage.
                    break;
                }
                let reason = format!("batch at position {}: {e}", position + keep as u64);
                self.record_read_damage(&path, position + keep as u64, offset, &reason);
                return Err(LogError::Corrupt { path, reason });
            }
            keep += h.total_size();
        }
        if keep == 0 && n < first_size {
            // The file is shorter than the batch the index promised: a truncation raced.
            return Ok(None);
        }
        buf.truncate(keep);
        if !data.aborted_transactions.is_empty() {
            // Only the transactions overlapping the returned batches.
            let end = BatchIter::new(&buf)
                .filter_map(Result::ok)
                .last()
                .map_or(offset, |b| b.header().last_offset() as u64 + 1);
            data.aborted_transactions.retain(|a| a.first_offset < end);
        }
        data.records = Bytes::from(buf);
        Ok(Some(data))
    }

    /// The segment (by base offset) and byte position of the batch holding `offset`, or
    /// `None` when `offset` is at or past the log end or below the log start.
    pub fn position_of(&self, offset: Offset) -> Result<Option<(Offset, u64)>, LogError> {
        let state = self.state.read();
        self.check_online(&state)?;
        if offset.0 < state.log_start_offset {
            return Ok(None);
        }
        let Some(segment) = state.segment_for(offset.0) else {
            return Ok(None);
        };
        Ok(segment
            .find_batch(offset.0)?
            .map(|location| (Offset(segment.base_offset()), location.position)))
    }

    /// The first offset whose record timestamp is `>= timestamp`, with that timestamp's
    /// segment search (Kafka's ListOffsets by time). `None` when every record is older.
    pub fn offset_for_timestamp(&self, timestamp: i64) -> Result<Option<Offset>, LogError> {
        let state = self.state.read();
        self.check_online(&state)?;
        for segment in state.segments.values() {
            if segment.max_timestamp() < timestamp {
                continue;
            }
            if let Some(offset) =
                segment.find_offset_by_timestamp(timestamp, super::MAX_UNCOMPRESSED_BATCH_BYTES)?
            {
                return Ok(Some(Offset(offset.max(state.log_start_offset))));
            }
        }
        Ok(None)
    }

    /// The first committed record with the largest timestamp, and that timestamp
    /// (Kafka's ListOffsets max timestamp); `None` for a log without committed records.
    /// Segments are compared by their largest timestamp: a segment whose largest one is
    /// not committed yet (the active segment's tail) is left out until it is.
    pub fn offset_of_max_timestamp(&self) -> Result<Option<(Offset, i64)>, LogError> {
        let state = self.state.read();
        self.check_online(&state)?;
        let mut best: Option<(Offset, i64)> = None;
        for segment in state.segments.values() {
            let max = segment.max_timestamp();
            if max < 0 || best.is_some_and(|(_, ts)| max <= ts) {
                continue;
            }
            if let Some(offset) =
                segment.find_offset_by_timestamp(max, super::MAX_UNCOMPRESSED_BATCH_BYTES)?
            {
                if offset >= state.log_start_offset && offset < state.high_watermark {
                    best = Some((Offset(offset), max));
                }
            }
        }
        Ok(best)
    }

    /// Deletes whole segments by `retention.ms` / `retention.bytes`, never at or above
    /// the high watermark, and moves the log start offset. Rolls first when the active
    /// segment itself has expired.
    pub fn apply_retention(&self) -> Result<RetentionOutcome, LogError> {
        let mut state = self.write_state();
        self.check_online(&state)?;
        let summaries: Vec<SegmentSummary> = state
            .segments
            .values()
            .map(|s| SegmentSummary {
                next_offset: s.next_offset(),
                size: s.size(),
                max_timestamp: s.max_timestamp(),
            })
            .collect();
        let count = segments_to_delete(
            &summaries,
            self.clock.now_ms(),
            state.config.retention_ms,
            state.config.retention_bytes,
            state.high_watermark,
        );
        let mut outcome = RetentionOutcome {
            log_start_offset: Offset(state.log_start_offset),
            ..RetentionOutcome::default()
        };
        if count == 0 {
            return Ok(outcome);
        }
        if count == state.segments.len() {
            self.roll_locked(&mut state)?;
        }
        let doomed: Vec<u64> = state.segments.keys().take(count).copied().collect();
        let removed = self.mark_deleted_locked(&mut state, &doomed)?;
        outcome.deleted_bytes = removed.iter().map(LogSegment::size).sum();
        outcome.deleted_segments = removed.len();
        let new_start = *state
            .segments
            .keys()
            .next()
            .expect("the active segment remains");
        state.log_start_offset = state.log_start_offset.max(new_start);
        let r = state
            .aborted
            .drop_segments_below(&self.dir, new_start)
            .map_err(|e| LogError::io(&self.dir, e));
        self.step(&mut state, r)?;
        let log_start = state.log_start_offset;
        outcome.log_start_offset = Offset(log_start);
        if state.epochs.truncate_from_start(Offset(log_start)) {
            self.persist_epochs_locked(&mut state)?;
        }
        let r = self.write_checkpoint_locked(&state);
        self.step(&mut state, r)?;
        drop(state);
        self.delete_removed(removed)?;
        tracing::info!(partition = %self.name, deleted_segments = outcome.deleted_segments, deleted_bytes = outcome.deleted_bytes, log_start_offset = outcome.log_start_offset.0, "retention deleted segments");
        Ok(outcome)
    }

    /// Moves the log start up to `offset` (never past the high watermark): records below
    /// it are gone for readers, and segments wholly below it are deleted (Kafka's
    /// DeleteRecords). Returns the log start afterwards.
    pub fn advance_log_start(&self, offset: Offset) -> Result<Offset, LogError> {
        let mut state = self.write_state();
        self.check_online(&state)?;
        let target = offset.0.min(state.high_watermark);
        if target <= state.log_start_offset {
            return Ok(Offset(state.log_start_offset));
        }
        if state.active().next_offset() <= target && !state.active().is_empty() {
            self.roll_locked(&mut state)?;
        }
        let doomed: Vec<u64> = state
            .segments
            .iter()
            .filter(|(_, s)| s.next_offset() <= target)
            .map(|(&b, _)| b)
            .filter(|&b| Some(&b) != state.segments.keys().next_back())
            .collect();
        let removed = self.mark_deleted_locked(&mut state, &doomed)?;
        state.log_start_offset = target;
        if state.epochs.truncate_from_start(Offset(target)) {
            self.persist_epochs_locked(&mut state)?;
        }
        let r = self.write_checkpoint_locked(&state);
        self.step(&mut state, r)?;
        drop(state);
        let deleted = removed.len();
        self.delete_removed(removed)?;
        tracing::debug!(partition = %self.name, log_start_offset = target, deleted_segments = deleted, "log start advanced");
        Ok(Offset(target))
    }

    /// Removes every record at or above `offset` (cutting at the start of the batch that
    /// holds it) so the log ends at or below `offset`. A target below the log start
    /// empties the log and restarts it there.
    pub fn truncate_to(&self, offset: Offset) -> Result<(), LogError> {
        let mut state = self.write_state();
        self.check_online(&state)?;
        if offset.0 >= state.log_end_offset() {
            return Ok(());
        }
        if offset.0 < state.log_start_offset {
            drop(state);
            return self.truncate_fully_and_start_at(offset);
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        let first_base = *state
            .segments
            .keys()
            .next()
            .expect("a log always has a segment");
        let doomed: Vec<u64> = state
            .segments
            .range(offset.0..)
            .map(|(&b, _)| b)
            .filter(|&b| b > first_base)
            .collect();
        let removed = self.mark_deleted_locked(&mut state, &doomed)?;
        let r = self.fault(FaultSite::TruncateSegment).and_then(|()| {
            let active = state.active_mut();
            active.truncate_to(offset.0)?;
            active.unseal()?;
            Ok::<_, LogError>(())
        });
        self.step(&mut state, r)?;
        let end = state.log_end_offset();
        state.high_watermark = state.high_watermark.min(end);
        state.producers.truncate_to(end);
        let r = state
            .aborted
            .truncate_from(&self.dir, end)
            .map_err(|e| LogError::io(&self.dir, e));
        self.step(&mut state, r)?;
        // The snapshot on disk may cover the removed records: replace it now, or a crash
        // after the log grows past it again would restore their producers.
        let r = self.save_producers_locked(&mut state);
        self.step(&mut state, r)?;
        if state.epochs.truncate_from_end(Offset(end)) {
            self.persist_epochs_locked(&mut state)?;
        }
        self.group_commit.truncated_to(end);
        // Persist the lowered recovery point so a crash recovers the new tail.
        let r = self.write_checkpoint_locked(&state);
        self.step(&mut state, r)?;
        drop(state);
        self.delete_removed(removed)?;
        tracing::info!(partition = %self.name, target = offset.0, log_end_offset = end, "truncated log");
        Ok(())
    }

    /// Renames the files of the segments `bases` (never all of them) to `.deleted`, newest
    /// first, then takes them out of the map and returns them for
    /// [`PartitionLog::delete_removed`]. A failure part-way takes the partition offline
    /// with the map unchanged (every segment still readable through its open handle); on
    /// disk the renamed ones are the newest, so the next open sees a contiguous log.
    fn mark_deleted_locked(
        &self,
        state: &mut LogState,
        bases: &[u64],
    ) -> Result<Vec<LogSegment>, LogError> {
        debug_assert!(bases.len() < state.segments.len(), "the map never empties");
        for base in bases.iter().rev() {
            let r = self.fault(FaultSite::MarkDeleted).and_then(|()| {
                match state.segments.get_mut(base) {
                    Some(segment) => segment.mark_deleted().map_err(LogError::from),
                    None => Ok(()),
                }
            });
            self.step(state, r)?;
        }
        Ok(bases
            .iter()
            .filter_map(|base| state.segments.remove(base))
            .collect())
    }

    /// Removes the files of segments taken out of the map (outside the lock); a failure
    /// takes the partition offline (the `.deleted` files are removed on the next open).
    fn delete_removed(&self, removed: Vec<LogSegment>) -> Result<(), LogError> {
        for segment in removed {
            let r = self
                .fault(FaultSite::DeleteFiles)
                .and_then(|()| segment.delete().map_err(LogError::from));
            if let Err(error) = r {
                self.go_offline(&mut self.write_state(), &error);
                return Err(error);
            }
        }
        Ok(())
    }

    /// Deletes every segment and restarts the log, empty, at `offset` (a follower that fell
    /// behind the leader's log start).
    ///
    /// Order, so that no failure leaves the map empty or half-swapped: rename every old
    /// segment to `.deleted` (newest first), create the new segment, swap the map, then
    /// persist epochs and offsets, and only then remove the old files. Any failure takes
    /// the partition offline; until the swap the old segments stay in the map.
    pub fn truncate_fully_and_start_at(&self, offset: Offset) -> Result<(), LogError> {
        let mut state = self.write_state();
        self.check_online(&state)?;
        self.generation.fetch_add(1, Ordering::AcqRel);
        let bases: Vec<u64> = state.segments.keys().copied().collect();
        for base in bases.iter().rev() {
            let r = self.fault(FaultSite::MarkDeleted).and_then(|()| {
                match state.segments.get_mut(base) {
                    Some(segment) => segment.mark_deleted().map_err(LogError::from),
                    None => Ok(()),
                }
            });
            self.step(&mut state, r)?;
        }
        let r = self.fault(FaultSite::CreateSegment).and_then(|()| {
            LogSegment::create(&self.dir, offset.0, segment_config(&state.config))
                .map_err(LogError::from)
        });
        let segment = self.step(&mut state, r)?;
        let old = std::mem::replace(&mut state.segments, BTreeMap::from([(offset.0, segment)]));
        state.log_start_offset = offset.0;
        state.high_watermark = offset.0;
        state.active_created_ms = self.clock.now_ms();
        state.epochs.clear();
        state.producers.clear();
        let r = state
            .aborted
            .clear(&self.dir)
            .map_err(|e| LogError::io(&self.dir, e));
        self.step(&mut state, r)?;
        let r = self.save_producers_locked(&mut state);
        self.step(&mut state, r)?;
        self.group_commit.reset(offset.0);
        self.persist_epochs_locked(&mut state)?;
        let r = self.write_checkpoint_locked(&state);
        self.step(&mut state, r)?;
        let r = checkpoint::sync_dir(&self.dir).map_err(|e| LogError::io(&self.dir, e));
        self.step(&mut state, r)?;
        drop(state);
        self.delete_removed(old.into_values().collect())?;
        tracing::info!(partition = %self.name, offset = offset.0, "log restarted empty");
        Ok(())
    }

    /// The offsets a checkpoint records, from the published values.
    fn published_checkpoint(&self) -> OffsetsCheckpoint {
        let log_end = self.log_end_offset().0;
        OffsetsCheckpoint {
            recovery_point: self.group_commit.durable().min(log_end),
            high_watermark: self.high_watermark().0,
            log_start_offset: self.log_start_offset().0,
        }
    }

    /// Writes the offsets checkpoint unless the file already holds these offsets. The
    /// values are read while the file lock is held, so the last writer always writes the
    /// latest offsets. Mutations call it under the state lock after publishing.
    fn write_checkpoint(&self, force: bool) -> Result<(), LogError> {
        let mut written = self.written_checkpoint.lock();
        let offsets = self.published_checkpoint();
        if !force && *written == Some(offsets) {
            return Ok(());
        }
        loader::write_offsets(&self.dir, &offsets).map_err(|e| LogError::io(&self.dir, e))?;
        *written = Some(offsets);
        Ok(())
    }

    /// [`PartitionLog::write_checkpoint`] from a mutation holding the write lock: its
    /// changes are published first.
    fn write_checkpoint_locked(&self, state: &LogState) -> Result<(), LogError> {
        self.published.publish(state);
        self.write_checkpoint(true)
    }

    /// Releases the `.log` descriptors of sealed, flushed segments not read since the
    /// previous call (call periodically); returns how many were released. Reads reopen
    /// them, so descriptors follow the segments in use, not the segment count.
    pub fn close_idle_files(&self) -> usize {
        let durable = self.group_commit.durable();
        let state = self.state.read();
        let sealed = state.segments.len().saturating_sub(1);
        state
            .segments
            .values()
            .take(sealed)
            .filter(|s| s.next_offset() <= durable && s.close_if_idle())
            .count()
    }

    /// Number of segments holding an open descriptor.
    pub fn open_files(&self) -> usize {
        let state = self.state.read();
        state.segments.values().filter(|s| s.is_open()).count()
    }

    /// Persists the recovery point, high watermark and log start, and the producer state
    /// (call periodically). Only what changed since the last checkpoint is written, and
    /// files are written outside the partition's lock: the offsets come from the published
    /// values, the producer table is copied under a short write lock.
    pub fn checkpoint(&self) -> Result<(), LogError> {
        self.write_checkpoint(false)?;
        let taken = {
            if !self.state.read().producers_dirty {
                return Ok(());
            }
            let mut state = self.write_state();
            if !std::mem::take(&mut state.producers_dirty) {
                return Ok(());
            }
            let generation = self.generation.load(Ordering::Acquire);
            // The snapshot covers the aborts below its offset: their entries must be on
            // disk first (recovery rebuilds only those at or after it).
            let dir = self.dir.clone();
            let r = state
                .aborted
                .sync(&dir)
                .map_err(|e| LogError::io(&self.dir, e));
            self.step(&mut state, r)?;
            (state.producers.clone(), state.log_end_offset(), generation)
        };
        let (table, end, generation) = taken;
        let io = self.snapshot_io.lock();
        // A truncation since the copy wrote its own snapshot: this one is stale.
        if self.generation.load(Ordering::Acquire) != generation {
            return Ok(());
        }
        let written = producer_state::save_snapshot(&self.dir, &table, end);
        drop(io);
        written.map_err(|e| {
            self.write_state().producers_dirty = true;
            LogError::io(&self.dir, e)
        })
    }

    /// Writes the producer-state snapshot under the write lock (truncations, close).
    fn save_producers_locked(&self, state: &mut LogState) -> Result<(), LogError> {
        state
            .aborted
            .sync(&self.dir)
            .map_err(|e| LogError::io(&self.dir, e))?;
        let _io = self.snapshot_io.lock();
        producer_state::save_snapshot(&self.dir, &state.producers, state.log_end_offset())
            .map_err(|e| LogError::io(&self.dir, e))?;
        state.producers_dirty = false;
        Ok(())
    }

    /// Clean shutdown of a log this caller alone holds; see [`PartitionLog::close_in_place`].
    pub fn close(self) -> Result<(), LogError> {
        self.close_in_place()
    }

    /// Clean shutdown: flushes everything, trims the active segment's indexes, writes the
    /// checkpoints and the clean-shutdown marker. The next open skips recovery. The log
    /// refuses everything afterwards, so a request or task that still holds it cannot
    /// change the files behind the marker.
    pub fn close_in_place(&self) -> Result<(), LogError> {
        self.flush()?;
        let mut state = self.write_state();
        self.check_online(&state)?;
        for segment in state.segments.values() {
            segment.flush_all()?;
        }
        state.active_mut().seal()?;
        self.persist_epochs_locked(&mut state)?;
        self.write_checkpoint_locked(&state)?;
        self.save_producers_locked(&mut state)?;
        let marker = self.dir.join(CLEAN_SHUTDOWN_FILE);
        fs::write(&marker, b"").map_err(|e| LogError::io(&marker, e))?;
        checkpoint::sync_dir(&self.dir).map_err(|e| LogError::io(&self.dir, e))?;
        state.offline = Some("closed: the broker is shutting down".to_owned());
        tracing::info!(partition = %self.name, log_end_offset = state.log_end_offset(), "partition closed cleanly");
        Ok(())
    }
}

/// The batches `[batch_from, batch_to)` (and their tags `[tag_from, tag_to)`) that fit
/// `room` tag-index entries: the next chunk of an append.
/// Applies one batch of a producer (a data batch or a marker) written at `base_offset`
/// to `table`; an abort marker returns its index entry.
fn apply_to_table(
    table: &mut ProducerStateTable,
    meta: &BatchMeta,
    base_offset: u64,
) -> Option<AbortedTxn> {
    if let Some(marker) = meta.marker {
        return table.record_marker(meta.producer_id, meta.producer_epoch, marker, base_offset);
    }
    table.record(
        meta.producer_id,
        meta.producer_epoch,
        ProducerBatch {
            first_seq: meta.base_sequence,
            last_seq: meta.base_sequence.wrapping_add(meta.offset_span as i32 - 1),
            first_offset: base_offset,
            last_offset: base_offset + meta.offset_span - 1,
        },
    );
    if meta.transactional {
        table.record_transactional(meta.producer_id, base_offset);
    }
    None
}

fn tag_chunk(
    tags: &[TagMark],
    batch_from: usize,
    tag_from: usize,
    batches: usize,
    room: usize,
) -> (usize, usize) {
    let (mut batch_to, mut tag_to) = (batch_from, tag_from);
    while batch_to < batches {
        let n = tags[tag_to..]
            .iter()
            .take_while(|t| t.batch as usize == batch_to)
            .count();
        if tag_to + n - tag_from > room {
            break;
        }
        tag_to += n;
        batch_to += 1;
    }
    (batch_to, tag_to)
}

#[cfg(test)]
mod lock_free_tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::partition::SystemClock;

    #[test]
    fn offsets_are_read_while_a_writer_holds_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let log = Arc::new(
            PartitionLog::open(dir.path(), TopicConfig::default(), Arc::new(SystemClock)).unwrap(),
        );
        log.set_high_watermark(Offset(0));
        let held = log.state.write();
        let (tx, rx) = mpsc::channel();
        let reader = Arc::clone(&log);
        let thread = std::thread::spawn(move || {
            let offsets = (
                reader.log_start_offset(),
                reader.log_end_offset(),
                reader.high_watermark(),
            );
            tx.send(offsets).unwrap();
        });
        let offsets = rx.recv_timeout(Duration::from_secs(5));
        drop(held);
        thread.join().unwrap();
        assert_eq!(
            offsets.expect("offset reads blocked behind the write lock"),
            (Offset(0), Offset(0), Offset(0))
        );
    }
}
