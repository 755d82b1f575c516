//! [`LocalPartition`]: one partition stored on this broker, its log and its replication
//! role (leader with its followers' progress, follower of some leader, or idle).
//!
//! The role sits behind a read-write lock. Appends (as leader or follower) and
//! truncations hold it for reading and check the role first; role changes take it for
//! writing. So once a broker stops leading an epoch, no append of that epoch can land,
//! and no fetched batch lands after the partition stopped following that leader.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use tokio::sync::watch;

use super::progress::{self, FollowerProgress};
use crate::error_code::ErrorCode;
use crate::partition::producer_state::SequenceError;
use crate::partition::{AppendInfo, LogError, PartitionLog};
use crate::types::{BrokerId, BrokerIds, LeaderEpoch, Offset};

/// A replication failure: a code and a message naming the partition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ReplicaError {
    /// What kind of failure.
    pub code: ErrorCode,
    /// What and why.
    pub message: String,
}

impl ReplicaError {
    /// A new error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// A partition-log failure, classified.
    pub fn from_log(partition: &str, e: LogError) -> Self {
        let code = match &e {
            LogError::OffsetOutOfRange { .. } => ErrorCode::OffsetOutOfRange,
            LogError::RecordTooLarge { .. } | LogError::UncompressedTooLarge { .. } => {
                ErrorCode::RecordTooLarge
            }
            LogError::InvalidRecord { .. } | LogError::Corrupt { .. } => ErrorCode::CorruptMessage,
            LogError::RefusedRecord { .. } => ErrorCode::InvalidRecord,
            LogError::ScheduledRecords { .. } => ErrorCode::InvalidDelay,
            LogError::NonContiguousAppend { .. } => ErrorCode::InvalidRequest,
            LogError::Config(_) => ErrorCode::InvalidConfig,
            LogError::Sequence(SequenceError::OutOfOrder { .. }) => {
                ErrorCode::OutOfOrderSequenceNumber
            }
            LogError::Sequence(SequenceError::InvalidTxnState { .. }) => ErrorCode::InvalidTxnState,
            LogError::Sequence(SequenceError::CoordinatorFenced { .. }) => {
                ErrorCode::TransactionCoordinatorFenced
            }
            LogError::Sequence(_) => ErrorCode::InvalidProducerEpoch,
            LogError::NotCached => ErrorCode::RequestTimedOut,
            LogError::Offline { .. }
            | LogError::Damaged(_)
            | LogError::DirectoryLocked { .. }
            | LogError::Io { .. } => ErrorCode::KafkaStorageError,
        };
        Self::new(code, format!("{partition}: {e}"))
    }
}

/// The controller's view of a partition, as a leader needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionAssignment {
    /// The leader epoch.
    pub leader_epoch: LeaderEpoch,
    /// The partition epoch (guards ISR changes).
    pub partition_epoch: i32,
    /// All replicas, preferred leader first.
    pub replicas: Vec<BrokerId>,
    /// The committed ISR.
    pub isr: Vec<BrokerId>,
}

/// An ISR change a leader wants the controller to commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IsrChange {
    /// Topic name.
    pub topic: String,
    /// Topic id.
    pub topic_id: String,
    /// Partition.
    pub partition: u32,
    /// The leader epoch the change was decided in.
    pub leader_epoch: LeaderEpoch,
    /// The partition epoch the change is based on.
    pub partition_epoch: i32,
    /// The proposed ISR.
    pub new_isr: Vec<BrokerId>,
}

/// A leader's mutable view: the committed ISR, a pending change, and its followers.
#[derive(Debug)]
pub struct LeaderView {
    /// The partition epoch of `isr`.
    pub partition_epoch: i32,
    /// All replicas.
    pub replicas: Vec<BrokerId>,
    /// The committed ISR.
    pub isr: Vec<BrokerId>,
    /// An ISR change sent to the controller and not answered yet.
    pub pending_isr: Option<Vec<BrokerId>>,
    /// When (ms) the last proposal failed; no new one for a short while after.
    pub last_failure_ms: Option<i64>,
    /// Each follower's progress.
    pub followers: HashMap<BrokerId, FollowerProgress>,
}

/// The leader side of a partition.
#[derive(Debug)]
pub struct LeaderState {
    /// This broker.
    pub broker: BrokerId,
    /// The epoch this broker leads.
    pub epoch: LeaderEpoch,
    /// The log end when this epoch began.
    pub epoch_start: Offset,
    /// The ISR and followers.
    pub view: Mutex<LeaderView>,
}

/// What this broker does for a partition.
#[derive(Debug)]
pub enum Role {
    /// Neither leads nor follows (just opened, or the partition has no leader).
    Idle,
    /// Leads it.
    Leader(LeaderState),
    /// Copies it from `leader`.
    Follower {
        /// The leader.
        leader: BrokerId,
        /// The epoch it leads.
        leader_epoch: LeaderEpoch,
    },
}

/// After a failed ISR proposal, wait this long before proposing again.
const PROPOSAL_BACKOFF_MS: i64 = 500;

/// What [`LocalPartition::replay`] hands over, in log order.
#[derive(Debug)]
pub enum Replayed<'a> {
    /// A data record; `transaction` is the producer id when its batch is transactional.
    Record {
        /// The record.
        record: &'a crate::record::Record,
        /// The producer whose transaction it belongs to, if any.
        transaction: Option<i64>,
    },
    /// A marker ending `producer_id`'s transaction.
    Marker {
        /// The producer.
        producer_id: i64,
        /// Commit (else abort).
        commit: bool,
    },
}

/// One partition stored here.
pub struct LocalPartition {
    /// The topic's name.
    pub topic: String,
    /// The topic's id.
    pub topic_id: String,
    /// The partition number.
    pub partition: u32,
    /// Its log.
    pub log: PartitionLog,
    role: RwLock<Role>,
    /// Bumped whenever the high watermark advances or the role changes.
    changed: watch::Sender<u64>,
    /// Shared with the broker's other partitions: bumped whenever the high watermark
    /// advances, so consumer fetches waiting on any set of partitions wake.
    readable: Option<Arc<watch::Sender<u64>>>,
}

impl LocalPartition {
    /// Calls `f` with every data record of the log, from its start to its end, in order
    /// (a coordinator or mover loading its state from an internal topic). Blocking.
    pub fn replay_records(
        &self,
        mut f: impl FnMut(&crate::record::Record),
    ) -> Result<(), ReplicaError> {
        self.replay(|item| {
            if let Replayed::Record { record, .. } = item {
                f(record);
            }
        })
    }

    /// Like [`LocalPartition::replay_records`], with the transactions: each record says
    /// which producer's transaction it belongs to, and transaction markers come too (the
    /// group coordinator settles offsets committed inside transactions). Blocking.
    pub fn replay(&self, mut f: impl FnMut(Replayed<'_>)) -> Result<(), ReplicaError> {
        let corrupt = |e: crate::record::RecordError| {
            ReplicaError::new(ErrorCode::CorruptMessage, e.to_string())
        };
        let end = self.log.log_end_offset();
        let mut next = self.log.log_start_offset();
        while next < end {
            let data = self
                .log
                .read(next, 1 << 20, crate::partition::Isolation::LogEnd)
                .map_err(|e| ReplicaError::from_log(&self.name(), e))?;
            let mut last = None;
            for batch in crate::record::BatchIter::new(&data.records) {
                let batch = batch.map_err(corrupt)?;
                batch.verify_crc().map_err(corrupt)?;
                let h = batch.header();
                last = Some(h.last_offset() as u64);
                if (h.last_offset() as u64) < next.0 {
                    continue;
                }
                if h.is_control() {
                    let marker = crate::record::control::decode_marker(&batch).map_err(corrupt)?;
                    f(Replayed::Marker {
                        producer_id: h.producer_id,
                        commit: marker.commit,
                    });
                    continue;
                }
                let txn = h.is_transactional().then_some(h.producer_id);
                batch
                    .for_each_record(crate::partition::MAX_UNCOMPRESSED_BATCH_BYTES, |r| {
                        if r.offset as u64 >= next.0 {
                            f(Replayed::Record {
                                record: &r.to_record(),
                                transaction: txn,
                            });
                        }
                        Ok(())
                    })
                    .map_err(corrupt)?;
            }
            let Some(last) = last else {
                break;
            };
            next = Offset(last + 1);
        }
        Ok(())
    }

    /// A partition that is idle until the metadata gives it a role.
    pub fn new(topic: &str, topic_id: &str, partition: u32, log: PartitionLog) -> Self {
        Self {
            topic: topic.to_owned(),
            topic_id: topic_id.to_owned(),
            partition,
            log,
            role: RwLock::new(Role::Idle),
            changed: watch::channel(0).0,
            readable: None,
        }
    }

    /// Also bumps `readable` whenever the high watermark advances (whatever moved it: a
    /// follower's fetch, an ISR change, a new leadership).
    pub fn notify_readable(mut self, readable: Arc<watch::Sender<u64>>) -> Self {
        self.readable = Some(readable);
        self
    }

    /// `topic-partition`, for messages.
    pub fn name(&self) -> String {
        format!("{}-{}", self.topic, self.partition)
    }

    /// The role, locked for reading.
    pub fn role(&self) -> RwLockReadGuard<'_, Role> {
        self.role.read()
    }

    /// The epoch this broker leads, if it leads.
    pub fn leader_epoch(&self) -> Option<LeaderEpoch> {
        match &*self.role.read() {
            Role::Leader(l) => Some(l.epoch),
            _ => None,
        }
    }

    /// The log end the leader last heard from `follower` (None unless this broker leads
    /// and has heard from it).
    pub fn follower_log_end(&self, follower: BrokerId) -> Option<Offset> {
        match &*self.role.read() {
            Role::Leader(l) => l
                .view
                .lock()
                .followers
                .get(&follower)
                .map(|p| p.log_end_offset),
            _ => None,
        }
    }

    /// A receiver that changes when the high watermark advances or the role changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// Leads `assignment` from now on (or, already leading its epoch, takes in a newer
    /// partition epoch). Returns true when the role changed.
    pub fn become_leader(
        &self,
        broker: BrokerId,
        assignment: &PartitionAssignment,
        now_ms: i64,
    ) -> Result<bool, LogError> {
        let mut role = self.role.write();
        if let Role::Leader(l) = &*role {
            if l.epoch == assignment.leader_epoch {
                let mut view = l.view.lock();
                if assignment.partition_epoch > view.partition_epoch {
                    view.partition_epoch = assignment.partition_epoch;
                    view.isr = assignment.isr.clone();
                    view.replicas = assignment.replicas.clone();
                    view.pending_isr = None;
                    view.followers
                        .retain(|b, _| assignment.replicas.contains(b));
                    for &b in &assignment.replicas {
                        if b != broker {
                            view.followers
                                .entry(b)
                                .or_insert_with(|| FollowerProgress::new(now_ms));
                        }
                    }
                    drop(view);
                    self.advance_high_watermark(l);
                    self.bump();
                }
                return Ok(false);
            }
        }
        self.log.assign_leader_epoch(assignment.leader_epoch)?;
        let followers = assignment
            .replicas
            .iter()
            .filter(|&&b| b != broker)
            .map(|&b| (b, FollowerProgress::new(now_ms)))
            .collect();
        let leader = LeaderState {
            broker,
            epoch: assignment.leader_epoch,
            epoch_start: self.log.log_end_offset(),
            view: Mutex::new(LeaderView {
                partition_epoch: assignment.partition_epoch,
                replicas: assignment.replicas.clone(),
                isr: assignment.isr.clone(),
                pending_isr: None,
                last_failure_ms: None,
                followers,
            }),
        };
        self.advance_high_watermark(&leader);
        tracing::debug!(partition = %self.name(), leader_epoch = %assignment.leader_epoch, log_end_offset = leader.epoch_start.0, high_watermark = self.log.high_watermark().0, "became leader");
        *role = Role::Leader(leader);
        drop(role);
        self.bump();
        Ok(true)
    }

    /// Follows `leader` in `leader_epoch` from now on. Returns true when the role changed
    /// (the caller then starts fetching, truncating first).
    pub fn become_follower(&self, leader: BrokerId, leader_epoch: LeaderEpoch) -> bool {
        let mut role = self.role.write();
        if let Role::Follower {
            leader: l,
            leader_epoch: e,
        } = &*role
        {
            if *l == leader && *e == leader_epoch {
                return false;
            }
        }
        tracing::debug!(partition = %self.name(), %leader, %leader_epoch, "became follower");
        *role = Role::Follower {
            leader,
            leader_epoch,
        };
        drop(role);
        self.bump();
        true
    }

    /// Stops leading and following. Returns true when the role changed.
    pub fn become_idle(&self) -> bool {
        let mut role = self.role.write();
        if matches!(*role, Role::Idle) {
            return false;
        }
        *role = Role::Idle;
        drop(role);
        self.bump();
        true
    }

    /// True when this broker follows `leader` in `epoch` right now.
    pub fn follows(&self, leader: BrokerId, epoch: LeaderEpoch) -> bool {
        matches!(&*self.role.read(), Role::Follower { leader: l, leader_epoch: e } if *l == leader && *e == epoch)
    }

    /// Appends a client's batches if this broker leads `epoch`, without the fsync the
    /// flush policy may want (a page-cache write, cheap enough for an async task). With
    /// `Some(target)` the caller runs [`Replica::sync_to`] on a blocking thread before
    /// acknowledging; until then the high watermark does not cover the records.
    pub fn append_as_leader_deferred(
        &self,
        batches: &mut [u8],
        epoch: LeaderEpoch,
    ) -> Result<(AppendInfo, Option<u64>), ReplicaError> {
        self.append_as_leader_guarded(batches, epoch, &[])
    }

    /// [`Replica::append_as_leader_deferred`] with transaction guards (see
    /// [`PartitionLog::append_as_leader_guarded`]).
    pub fn append_as_leader_guarded(
        &self,
        batches: &mut [u8],
        epoch: LeaderEpoch,
        guards: &[crate::partition::producer_state::TxnGuard],
    ) -> Result<(AppendInfo, Option<u64>), ReplicaError> {
        self.append_leading(epoch, |log| {
            log.append_as_leader_guarded(batches, epoch, guards)
        })
    }

    /// Runs a deferred leader append if this broker leads `epoch`; moves the high
    /// watermark when no fsync is pending.
    fn append_leading(
        &self,
        epoch: LeaderEpoch,
        append: impl FnOnce(&PartitionLog) -> Result<(AppendInfo, Option<u64>), LogError>,
    ) -> Result<(AppendInfo, Option<u64>), ReplicaError> {
        let role = self.role.read();
        let Role::Leader(leader) = &*role else {
            return Err(self.not_leader());
        };
        if leader.epoch != epoch {
            return Err(self.not_leader());
        }
        let (info, durable_target) =
            append(&self.log).map_err(|e| ReplicaError::from_log(&self.name(), e))?;
        if durable_target.is_none() {
            self.advance_high_watermark(leader);
        }
        Ok((info, durable_target))
    }

    /// [`Replica::append_as_leader_deferred`] for a transaction marker (the coordinator's
    /// commit or abort of `producer_id`'s transaction).
    pub fn append_marker_deferred(
        &self,
        producer_id: i64,
        producer_epoch: i16,
        marker: crate::record::control::ControlMarker,
        epoch: LeaderEpoch,
    ) -> Result<(AppendInfo, Option<u64>), ReplicaError> {
        self.append_leading(epoch, |log| {
            log.append_marker_deferred(producer_id, producer_epoch, marker, epoch)
        })
    }

    /// Makes every offset below `target` durable, then lets the high watermark cover it
    /// (the second half of [`Replica::append_as_leader_deferred`]).
    pub fn sync_to(&self, target: u64) -> Result<(), ReplicaError> {
        self.log
            .sync_to(target)
            .map_err(|e| ReplicaError::from_log(&self.name(), e))?;
        if let Role::Leader(leader) = &*self.role.read() {
            self.advance_high_watermark(leader);
        }
        Ok(())
    }

    /// Appends batches fetched from `leader` in `epoch`, if this broker still follows it
    /// there; batches wholly below the log end are skipped. Returns the new log end, or
    /// `None` when the role changed meanwhile (the batches are dropped).
    pub fn append_as_follower(
        &self,
        leader: BrokerId,
        epoch: LeaderEpoch,
        batches: &[u8],
        leader_high_watermark: Offset,
        leader_log_start: Offset,
    ) -> Result<Option<Offset>, ReplicaError> {
        let role = self.role.read();
        if !matches!(&*role, Role::Follower { leader: l, leader_epoch: e } if *l == leader && *e == epoch)
        {
            return Ok(None);
        }
        let end = self.log.log_end_offset();
        let from = skip_batches_below(batches, end.0);
        if from < batches.len() {
            self.log
                .append_as_follower(&batches[from..])
                .map_err(|e| ReplicaError::from_log(&self.name(), e))?;
        }
        let end = self.log.log_end_offset();
        let before = self.log.high_watermark();
        if self.log.set_high_watermark(leader_high_watermark.min(end)) > before {
            // Consumers fetching from this follower (KIP-392) wait for it.
            self.bump();
        }
        if leader_log_start > self.log.log_start_offset() {
            // The leader deleted records (retention or DeleteRecords): so do we.
            self.log
                .advance_log_start(leader_log_start)
                .map_err(|e| ReplicaError::from_log(&self.name(), e))?;
        }
        Ok(Some(end))
    }

    /// Truncates to `offset` if this broker still follows `leader` in `epoch`. Returns the
    /// new log end, or `None` when the role changed meanwhile.
    pub fn truncate_as_follower(
        &self,
        leader: BrokerId,
        epoch: LeaderEpoch,
        offset: Offset,
        restart_empty: bool,
    ) -> Result<Option<Offset>, ReplicaError> {
        let role = self.role.read();
        if !matches!(&*role, Role::Follower { leader: l, leader_epoch: e } if *l == leader && *e == epoch)
        {
            return Ok(None);
        }
        let result = if restart_empty {
            self.log.truncate_fully_and_start_at(offset)
        } else {
            self.log.truncate_to(offset)
        };
        result.map_err(|e| ReplicaError::from_log(&self.name(), e))?;
        Ok(Some(self.log.log_end_offset()))
    }

    fn not_leader(&self) -> ReplicaError {
        ReplicaError::new(
            ErrorCode::NotLeaderOrFollower,
            format!("{}: this broker no longer leads this epoch", self.name()),
        )
    }

    /// Recomputes the high watermark; wakes waiters when it moved.
    fn advance_high_watermark(&self, leader: &LeaderState) -> bool {
        let view = leader.view.lock();
        self.advance_high_watermark_locked(leader, &view)
    }

    fn advance_high_watermark_locked(&self, leader: &LeaderState, view: &LeaderView) -> bool {
        let isr = progress::maximal_isr(&view.isr, view.pending_isr.as_deref());
        let current = self.log.high_watermark();
        let hw = progress::high_watermark(
            current,
            leader.broker,
            self.log.log_end_offset(),
            &isr,
            |b| view.followers.get(&b).copied(),
        );
        if hw > current {
            self.log.set_high_watermark(hw);
            self.bump();
            if let Some(readable) = &self.readable {
                readable.send_modify(|v| *v += 1);
            }
            true
        } else {
            false
        }
    }

    /// Checks a follower's fetch against the role: this broker must lead exactly the epoch
    /// the follower names, and the follower must be a replica.
    pub fn check_follower_fetch(
        &self,
        follower: BrokerId,
        epoch: LeaderEpoch,
    ) -> Result<(), ReplicaError> {
        let role = self.role.read();
        let Role::Leader(leader) = &*role else {
            return Err(ReplicaError::new(
                ErrorCode::NotLeaderOrFollower,
                format!("{}: this broker does not lead it", self.name()),
            ));
        };
        if epoch < leader.epoch {
            return Err(ReplicaError::new(
                ErrorCode::FencedLeaderEpoch,
                format!(
                    "{}: leader epoch {epoch} is older than the current {}",
                    self.name(),
                    leader.epoch
                ),
            ));
        }
        if epoch > leader.epoch {
            return Err(ReplicaError::new(
                ErrorCode::UnknownLeaderEpoch,
                format!(
                    "{}: leader epoch {epoch} is newer than this leader's {}",
                    self.name(),
                    leader.epoch
                ),
            ));
        }
        if !leader.view.lock().replicas.contains(&follower) {
            return Err(ReplicaError::new(
                ErrorCode::NotLeaderOrFollower,
                format!("{}: broker {follower} is not a replica", self.name()),
            ));
        }
        Ok(())
    }

    /// Records a follower's fetch at `fetch_offset`: updates its progress and the high
    /// watermark, and returns an ISR expansion to propose when the follower has caught up.
    pub fn record_follower_fetch(
        &self,
        follower: BrokerId,
        epoch: LeaderEpoch,
        fetch_offset: Offset,
        now_ms: i64,
    ) -> Result<Option<IsrChange>, ReplicaError> {
        self.check_follower_fetch(follower, epoch)?;
        let role = self.role.read();
        let Role::Leader(leader) = &*role else {
            return Err(self.not_leader());
        };
        let mut view = leader.view.lock();
        let leader_end = self.log.log_end_offset();
        view.followers
            .entry(follower)
            .or_insert_with(|| FollowerProgress::new(now_ms))
            .on_fetch(fetch_offset, leader_end, now_ms);
        if self.advance_high_watermark_locked(leader, &view) {
            // Consumers wait on appends; a moved watermark is as good as one for them.
        }
        let in_isr =
            progress::maximal_isr(&view.isr, view.pending_isr.as_deref()).contains(&follower);
        if in_isr || !self.may_propose(&view, now_ms) {
            return Ok(None);
        }
        let p = view.followers[&follower];
        if !progress::may_join_isr(&p, self.log.high_watermark(), leader.epoch_start) {
            return Ok(None);
        }
        let mut new_isr = view.isr.clone();
        new_isr.push(follower);
        Ok(Some(self.propose(leader, &mut view, new_isr)))
    }

    /// An ISR shrink to propose when members have lagged longer than `max_lag_ms`.
    pub fn check_lagging(&self, now_ms: i64, max_lag_ms: i64) -> Option<IsrChange> {
        let role = self.role.read();
        let Role::Leader(leader) = &*role else {
            return None;
        };
        let mut view = leader.view.lock();
        if !self.may_propose(&view, now_ms) {
            return None;
        }
        let lagging =
            progress::lagging_members(&view.isr, leader.broker, now_ms, max_lag_ms, |b| {
                view.followers.get(&b).copied()
            });
        if lagging.is_empty() {
            return None;
        }
        tracing::info!(partition = %self.name(), lagging = %BrokerIds(&lagging), max_lag_ms, "followers lag: proposing to shrink the ISR");
        let new_isr = view
            .isr
            .iter()
            .copied()
            .filter(|b| !lagging.contains(b))
            .collect();
        Some(self.propose(leader, &mut view, new_isr))
    }

    fn may_propose(&self, view: &LeaderView, now_ms: i64) -> bool {
        view.pending_isr.is_none()
            && view
                .last_failure_ms
                .is_none_or(|t| now_ms - t >= PROPOSAL_BACKOFF_MS)
    }

    fn propose(
        &self,
        leader: &LeaderState,
        view: &mut LeaderView,
        new_isr: Vec<BrokerId>,
    ) -> IsrChange {
        view.pending_isr = Some(new_isr.clone());
        IsrChange {
            topic: self.topic.clone(),
            topic_id: self.topic_id.clone(),
            partition: self.partition,
            leader_epoch: leader.epoch,
            partition_epoch: view.partition_epoch,
            new_isr,
        }
    }

    /// The controller committed (`Some`) or refused (`None`) the pending ISR change.
    pub fn isr_change_done(
        &self,
        change: &IsrChange,
        committed: Option<(Vec<BrokerId>, i32)>,
        now_ms: i64,
    ) {
        let role = self.role.read();
        let Role::Leader(leader) = &*role else {
            return;
        };
        if leader.epoch != change.leader_epoch {
            return;
        }
        let mut view = leader.view.lock();
        match committed {
            Some((isr, partition_epoch)) if partition_epoch > view.partition_epoch => {
                tracing::info!(partition = %self.name(), isr = %BrokerIds(&isr), partition_epoch, "ISR changed");
                view.isr = isr;
                view.partition_epoch = partition_epoch;
                view.pending_isr = None;
            }
            Some(_) => view.pending_isr = None,
            None => {
                view.pending_isr = None;
                view.last_failure_ms = Some(now_ms);
            }
        }
        self.advance_high_watermark_locked(leader, &view);
        drop(view);
        self.bump();
    }

    /// The committed ISR size if this broker leads `epoch`.
    pub fn isr_size(&self, epoch: LeaderEpoch) -> Option<usize> {
        match &*self.role.read() {
            Role::Leader(l) if l.epoch == epoch => Some(l.view.lock().isr.len()),
            _ => None,
        }
    }

    /// Waits until the high watermark reaches `end` while this broker leads `epoch`
    /// (acks=all). Fails with NOT_LEADER_OR_FOLLOWER when leadership is lost, with
    /// NOT_ENOUGH_REPLICAS_AFTER_APPEND when the ISR shrank below `min_isr` first, and
    /// with REQUEST_TIMED_OUT after `timeout`.
    pub async fn wait_committed(
        &self,
        epoch: LeaderEpoch,
        end: Offset,
        min_isr: usize,
        timeout: std::time::Duration,
    ) -> Result<(), ReplicaError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changes = self.changed.subscribe();
        loop {
            changes.borrow_and_update();
            let Some(isr) = self.isr_size(epoch) else {
                return Err(ReplicaError::new(
                    ErrorCode::NotLeaderOrFollower,
                    format!(
                        "{}: leadership moved before the records were committed; they may or may not survive",
                        self.name()
                    ),
                ));
            };
            if self.log.high_watermark() >= end {
                if isr < min_isr {
                    return Err(ReplicaError::new(
                        ErrorCode::NotEnoughReplicasAfterAppend,
                        format!(
                            "{}: written, but the ISR shrank to {isr}, below min.insync.replicas {min_isr}",
                            self.name()
                        ),
                    ));
                }
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                return Err(ReplicaError::new(
                    ErrorCode::RequestTimedOut,
                    format!(
                        "{}: not replicated to the ISR within {} ms (high watermark {}, needed {})",
                        self.name(),
                        timeout.as_millis(),
                        self.log.high_watermark().0,
                        end.0
                    ),
                ));
            }
        }
    }

    /// For `topics describe`: the leader's ISR as it acts on it (committed), if leading.
    pub fn leader_isr(&self) -> Option<Vec<BrokerId>> {
        match &*self.role.read() {
            Role::Leader(l) => Some(l.view.lock().isr.clone()),
            _ => None,
        }
    }
}

/// The byte position of the first batch in `batches` whose last offset is at or above
/// `end` (a follower skips what it already holds).
fn skip_batches_below(batches: &[u8], end: u64) -> usize {
    let mut position = 0;
    for batch in crate::record::BatchIter::new(batches) {
        let Ok(batch) = batch else {
            break;
        };
        if batch.header().last_offset() >= end as i64 {
            break;
        }
        position += batch.as_bytes().len();
    }
    position
}
