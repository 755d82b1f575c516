//! Durable timers: records produced with a delay wait in the replicated internal topic
//! `__timers` and are appended to their target partition when due, exactly once.
//!
//! - **Scheduling.** The timers of a target partition live in one `__timers` partition
//!   ([`codec::timer_partition_for`]); its leader appends a `Schedule` record (acks=all)
//!   and the record's id names that partition, offset and due time.
//! - **Moving.** The leader of each `__timers` partition runs a mover: it loads the
//!   partition ([`state::TimerState`], a replay of its log), records an `Owner` (the
//!   producer id it delivers with, and a producer epoch one above the last leader's, so a
//!   deposed leader's late sends are fenced), then delivers due timers: per target, it
//!   first appends an `Intent` (acks=all) naming the timers, the producer id, epoch and
//!   sequence, then sends one idempotent batch to the target's leader, then records
//!   `Done`. A new leader resends the one unconfirmed batch per target with the same
//!   producer id, epoch and sequence, which the target's producer state recognises when
//!   it did arrive: each record lands once.
//! - **Cancelling** appends a `Cancel` while the timer is still pending.

pub mod codec;
pub mod state;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use prost::Message;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::codec::{
    timer_partition_for, Done, Dropped, Entry, Intent, Owner, Schedule, TimerId, TimerRecord,
    TIMERS_TOPIC,
};
use self::state::{plan_batches, DueTimer, TimerState};
use crate::broker::error::BrokerError;
use crate::broker::node::{now_ms, Acks, BrokerNode};
use crate::error_code::ErrorCode;
use crate::partition::Isolation;
use crate::record::{decode_data_records, BatchBuilder, Compression, RecordRef};
use crate::replication::replica::LocalPartition;
use crate::types::{BrokerId, LeaderEpoch, Offset};

pub use crate::record::delay::{ORIGINAL_TIMESTAMP_HEADER, TIMER_ID_HEADER};

/// Largest batch the timers append to `__timers` (more records go in more batches).
const APPEND_BATCH_BYTES: usize = 1 << 20;

/// `max.message.bytes` of `__timers`: a scheduled record as large as any topic allows
/// (up to this) fits one batch.
pub const TIMERS_MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Timer settings of a broker.
#[derive(Debug, Clone)]
pub struct TimerSettings {
    /// Partitions of `__timers` when it is created.
    pub partitions: u32,
    /// Its replication factor (capped at the live brokers).
    pub replication_factor: u32,
    /// Longest delay a record may ask for.
    pub max_delay: Duration,
    /// Most records per delivery batch.
    pub batch_records: usize,
    /// Pause before a failed delivery is tried again.
    pub retry_backoff: Duration,
    /// How long an append to `__timers` or a delivery may wait for replication.
    pub write_timeout: Duration,
    /// Most pending timers per `__timers` partition (memory: about 30 bytes each).
    pub max_pending_per_partition: usize,
}

impl Default for TimerSettings {
    fn default() -> Self {
        Self {
            partitions: 12,
            replication_factor: 3,
            max_delay: Duration::from_secs(40 * 24 * 3600),
            batch_records: 500,
            retry_backoff: Duration::from_millis(500),
            write_timeout: Duration::from_secs(10),
            max_pending_per_partition: 2_000_000,
        }
    }
}

/// What the timers need from other brokers (implemented over their internal listeners).
pub trait TimerPeers: Send + Sync + 'static {
    /// Has `broker`, the leader of `__timers` partition `partition`, schedule `entries`.
    fn schedule(
        &self,
        broker: BrokerId,
        partition: u32,
        entries: Vec<Schedule>,
    ) -> BoxFuture<'static, Result<Vec<TimerId>, BrokerError>>;
    /// Has `broker`, the leader of the id's `__timers` partition, cancel it.
    fn cancel(&self, broker: BrokerId, id: TimerId) -> BoxFuture<'static, Result<(), BrokerError>>;
    /// Has `broker`, the leader of `topic`-`partition`, append `batch` with acks=all.
    fn deliver(
        &self,
        broker: BrokerId,
        topic: String,
        partition: u32,
        batch: Vec<u8>,
    ) -> BoxFuture<'static, Result<(), BrokerError>>;
}

/// A loaded `__timers` partition this broker leads.
struct Loaded {
    epoch: LeaderEpoch,
    local: Arc<LocalPartition>,
    state: TimerState,
}

/// One `__timers` partition's slot. Its lock is held by appends to the partition and by
/// the load, so a schedule appended around a leadership change is either in the log the
/// load replays or applied to the loaded state, never lost between them.
#[derive(Default)]
struct Slot {
    loaded: tokio::sync::Mutex<Option<Loaded>>,
    wake: Notify,
    /// Pending timers per target topic as of the mover's last pass (read by metrics
    /// without waiting for `loaded`, which appends hold).
    pending: Mutex<BTreeMap<String, u64>>,
}

/// The timers of a broker.
pub struct Timers {
    node: BrokerNode,
    settings: TimerSettings,
    peers: Arc<dyn TimerPeers>,
    slots: Mutex<HashMap<u32, Arc<Slot>>>,
}

impl Timers {
    /// Timers over `node`, reaching other brokers through `peers`.
    pub fn new(node: BrokerNode, settings: TimerSettings, peers: Arc<dyn TimerPeers>) -> Self {
        Self {
            node,
            settings,
            peers,
            slots: Mutex::default(),
        }
    }

    /// The settings.
    pub fn settings(&self) -> &TimerSettings {
        &self.settings
    }

    fn slot(&self, partition: u32) -> Arc<Slot> {
        self.slots.lock().entry(partition).or_default().clone()
    }

    /// The due time of a record produced at `now_ms` with `delay_ms` or `deliver_at_ms`
    /// (one of them): checked against the limits, naming the field.
    pub fn due_time(
        &self,
        now_ms: i64,
        delay_ms: Option<i64>,
        deliver_at_ms: Option<i64>,
    ) -> Result<i64, String> {
        let max = self.settings.max_delay.as_millis() as i64;
        match (delay_ms, deliver_at_ms) {
            (Some(_), Some(_)) => Err("give delay_ms or deliver_at_ms, not both".into()),
            (Some(d), None) if d < 0 => Err(format!("delay_ms is {d}; it must be >= 0")),
            (Some(d), None) if d > max => Err(format!(
                "delay_ms is {d}; the limit (max.delay.ms) is {max}"
            )),
            (Some(d), None) => Ok(now_ms.saturating_add(d)),
            (None, Some(at)) if at < 0 => Err(format!("deliver_at_ms is {at}; it must be >= 0")),
            (None, Some(at)) if at.saturating_sub(now_ms) > max => Err(format!(
                "deliver_at_ms {at} is {} ms ahead; the limit (max.delay.ms) is {max}",
                at - now_ms
            )),
            (None, Some(at)) => Ok(at),
            (None, None) => Err("neither delay_ms nor deliver_at_ms is given".into()),
        }
    }

    /// The `__timers` partition count, when the topic exists.
    pub fn partition_count(&self) -> Option<u32> {
        self.node
            .metadata()
            .topic(TIMERS_TOPIC)
            .map(|t| t.partitions.len() as u32)
    }

    /// Schedules records for `topic`-`partition` (which must exist); returns their ids.
    /// `__timers` must exist.
    pub async fn schedule(
        &self,
        topic: &str,
        partition: u32,
        entries: Vec<Schedule>,
    ) -> Result<Vec<TimerId>, BrokerError> {
        if self.node.metadata().partition(topic, partition).is_none() {
            return Err(BrokerError::new(
                ErrorCode::UnknownTopicOrPartition,
                format!("{topic}-{partition} does not exist"),
            ));
        }
        let count = self.partition_count().ok_or_else(|| {
            BrokerError::new(
                ErrorCode::UnknownTopicOrPartition,
                format!("{TIMERS_TOPIC} does not exist yet"),
            )
        })?;
        let tp = timer_partition_for(topic, partition, count);
        match self.timers_leader(tp)? {
            leader if leader == self.node.id() => self.schedule_local(tp, entries).await,
            leader => self.peers.schedule(leader, tp, entries).await,
        }
    }

    fn timers_leader(&self, partition: u32) -> Result<BrokerId, BrokerError> {
        self.node
            .metadata()
            .partition(TIMERS_TOPIC, partition)
            .and_then(|(_, p)| p.leader)
            .ok_or_else(|| {
                BrokerError::new(
                    ErrorCode::NotLeaderOrFollower,
                    format!("{TIMERS_TOPIC}-{partition} has no leader right now"),
                )
            })
    }

    /// Appends `entries` to `__timers` partition `partition`, which this broker leads.
    pub async fn schedule_local(
        &self,
        partition: u32,
        entries: Vec<Schedule>,
    ) -> Result<Vec<TimerId>, BrokerError> {
        let slot = self.slot(partition);
        let mut guard = slot.loaded.lock().await;
        let loaded = self.current(partition, &mut guard)?;
        let max = self.settings.max_pending_per_partition;
        if loaded.state.len() + entries.len() > max {
            return Err(BrokerError::new(
                ErrorCode::ScheduledRecordLimitExceeded,
                format!(
                    "{TIMERS_TOPIC}-{partition} holds {} pending scheduled records; with these {} it would pass its limit of {max} (timers_max_pending_per_partition); nothing was written",
                    loaded.state.len(),
                    entries.len()
                ),
            ));
        }
        let records: Vec<TimerRecord> = entries
            .into_iter()
            .map(|s| TimerRecord {
                entry: Some(Entry::Schedule(s)),
            })
            .collect();
        let base = match self.append(partition, &records, Acks::All).await {
            Ok(base) => base,
            Err(e) => {
                // The records may be in the log anyway (a replication timeout): the state
                // no longer matches it, so the mover reloads it from the log.
                *guard = None;
                slot.wake.notify_one();
                return Err(e);
            }
        };
        let mut ids = Vec::with_capacity(records.len());
        for (i, r) in records.iter().enumerate() {
            let offset = base + i as u64;
            loaded.state.apply(offset, r);
            if let Some(Entry::Schedule(s)) = &r.entry {
                ids.push(TimerId {
                    partition,
                    offset,
                    due_ms: s.due_ms,
                });
            }
        }
        drop(guard);
        slot.wake.notify_one();
        Ok(ids)
    }

    /// Cancels a pending scheduled record.
    pub async fn cancel(&self, id: TimerId) -> Result<(), BrokerError> {
        let count = self.partition_count().unwrap_or(0);
        if id.partition >= count {
            return Err(unknown_id(id));
        }
        match self.timers_leader(id.partition)? {
            leader if leader == self.node.id() => self.cancel_local(id).await,
            leader => self.peers.cancel(leader, id).await,
        }
    }

    /// Cancels a pending scheduled record of a `__timers` partition this broker leads.
    pub async fn cancel_local(&self, id: TimerId) -> Result<(), BrokerError> {
        let slot = self.slot(id.partition);
        let mut guard = slot.loaded.lock().await;
        let loaded = self.current(id.partition, &mut guard)?;
        if !loaded.state.is_pending(id.offset, id.due_ms) {
            return Err(unknown_id(id));
        }
        let record = TimerRecord {
            entry: Some(Entry::Cancel(codec::Cancel {
                offset: id.offset,
                due_ms: id.due_ms,
            })),
        };
        match self
            .append(id.partition, std::slice::from_ref(&record), Acks::All)
            .await
        {
            Ok(offset) => {
                loaded.state.apply(offset, &record);
                Ok(())
            }
            Err(e) => {
                *guard = None;
                slot.wake.notify_one();
                Err(e)
            }
        }
    }

    /// Pending timers per target topic, over the `__timers` partitions this broker leads.
    /// (As of each mover's last pass.)
    pub fn pending_by_topic(&self) -> BTreeMap<String, u64> {
        let slots: Vec<Arc<Slot>> = self.slots.lock().values().cloned().collect();
        let mut out = BTreeMap::new();
        for slot in slots {
            for (t, n) in slot.pending.lock().iter() {
                *out.entry(t.clone()).or_default() += n;
            }
        }
        out
    }

    /// The loaded state of `partition` if it is loaded for the epoch this broker leads it
    /// in now.
    fn current<'a>(
        &self,
        partition: u32,
        guard: &'a mut Option<Loaded>,
    ) -> Result<&'a mut Loaded, BrokerError> {
        let (_, epoch) = self.node.leader_partition(TIMERS_TOPIC, partition)?;
        match guard.as_mut() {
            Some(l) if l.epoch == epoch => Ok(l),
            _ => Err(BrokerError::new(
                ErrorCode::NotLeaderOrFollower,
                format!(
                    "{TIMERS_TOPIC}-{partition}: broker {} is loading its timers; retry shortly",
                    self.node.id()
                ),
            )),
        }
    }

    /// Appends `records` to `__timers` partition `partition`; the first one's offset.
    async fn append(
        &self,
        partition: u32,
        records: &[TimerRecord],
        acks: Acks,
    ) -> Result<u64, BrokerError> {
        let now = now_ms();
        // Batches of up to 1 MiB each (a batch holds at least one record); the records
        // get consecutive offsets across them.
        let mut batch = Vec::new();
        let mut builder = BatchBuilder::new(Compression::None);
        let values: Vec<Vec<u8>> = records.iter().map(|r| r.encode_to_vec()).collect();
        let encode = |builder: &BatchBuilder| {
            builder.build(0).map_err(|e| {
                BrokerError::new(
                    ErrorCode::UnknownServerError,
                    format!("cannot encode timer records: {e}"),
                )
            })
        };
        for v in &values {
            if !builder.is_empty() && builder.uncompressed_size() + v.len() > APPEND_BATCH_BYTES {
                batch.extend(encode(&builder)?);
                builder = BatchBuilder::new(Compression::None);
            }
            builder.push(RecordRef {
                timestamp: now,
                key: None,
                value: Some(v),
                headers: &[],
            });
        }
        batch.extend(encode(&builder)?);
        let produced = self
            .node
            .produce(
                TIMERS_TOPIC,
                partition,
                batch,
                acks,
                self.settings.write_timeout,
            )
            .await?;
        produced.base_offset.map(|o| o.0).ok_or_else(|| {
            BrokerError::new(
                ErrorCode::UnknownServerError,
                format!("{TIMERS_TOPIC}-{partition}: timer records were not appended"),
            )
        })
    }

    /// Runs until `cancel`: starts a mover for each `__timers` partition this broker
    /// comes to lead.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        type Mover = (LeaderEpoch, CancellationToken, tokio::task::JoinHandle<()>);
        let mut movers: HashMap<u32, Mover> = HashMap::new();
        let mut version = self.node.metadata().subscribe();
        loop {
            let count = self.partition_count().unwrap_or(0);
            let mut led = HashMap::new();
            for p in 0..count {
                if let Ok((_, epoch)) = self.node.leader_partition(TIMERS_TOPIC, p) {
                    led.insert(p, epoch);
                }
            }
            // A mover ends on its own only when it saw its leadership end; one that
            // ended otherwise (a panic) is started again.
            movers.retain(|p, (epoch, token, task)| {
                let keep = led.get(p) == Some(epoch) && !task.is_finished();
                if !keep {
                    token.cancel();
                }
                keep
            });
            for (p, epoch) in led {
                if movers.contains_key(&p) {
                    continue;
                }
                let token = cancel.child_token();
                let me = self.clone();
                let task = tokio::spawn({
                    let token = token.clone();
                    async move { me.mover(p, epoch, token).await }
                });
                movers.insert(p, (epoch, token, task));
            }
            // Metadata changes start and stop movers; the tick catches a partition whose
            // local replica became leader after the metadata said so.
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = version.changed() => {}
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
        for (_, (_, token, task)) in movers {
            token.cancel();
            let _ = task.await;
        }
    }

    /// Loads `__timers` partition `partition` for leader epoch `epoch` and delivers its
    /// due timers until the leadership ends or `cancel`.
    async fn mover(self: Arc<Self>, partition: u32, epoch: LeaderEpoch, cancel: CancellationToken) {
        let slot = self.slot(partition);
        let mut backoff = Duration::from_millis(100);
        let mut memo = Memo::default();
        let mut warned = RateLimit::default();
        while !cancel.is_cancelled() {
            let loaded = slot
                .loaded
                .lock()
                .await
                .as_ref()
                .is_some_and(|l| l.epoch == epoch);
            if !loaded {
                // First, or after an append whose outcome is unknown: replay the log.
                memo.retry_at.clear();
                if let Err(e) = self.load(partition, epoch, &slot).await {
                    tracing::warn!(partition, %epoch, error = %e, "loading timers failed; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
                backoff = Duration::from_millis(100);
            }
            let wait = match self.move_once(partition, epoch, &slot, &mut memo).await {
                Ok(wait) => wait,
                Err(e) => {
                    if warned.allow() {
                        tracing::warn!(partition, error = %e, "delivering timers failed; retrying");
                    }
                    self.settings.retry_backoff
                }
            };
            if self
                .node
                .leader_partition(TIMERS_TOPIC, partition)
                .map(|(_, e)| e)
                .ok()
                != Some(epoch)
            {
                break;
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = slot.wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
        // Leadership over: forget the state, unless a newer epoch's mover holds it.
        let mut guard = slot.loaded.lock().await;
        if guard.as_ref().is_some_and(|l| l.epoch == epoch) {
            *guard = None;
            slot.pending.lock().clear();
        }
    }

    /// Replays the partition's log into a new state, then records this leadership's
    /// `Owner`.
    async fn load(
        &self,
        partition: u32,
        epoch: LeaderEpoch,
        slot: &Slot,
    ) -> Result<(), BrokerError> {
        let mut guard = slot.loaded.lock().await;
        let (local, now_epoch) = self.node.leader_partition(TIMERS_TOPIC, partition)?;
        if now_epoch != epoch {
            return Err(BrokerError::new(
                ErrorCode::NotLeaderOrFollower,
                format!("{TIMERS_TOPIC}-{partition}: leader epoch moved on"),
            ));
        }
        let started = std::time::Instant::now();
        let replica = local.clone();
        let mut state = tokio::task::spawn_blocking(move || replay(&replica))
            .await
            .map_err(|e| {
                BrokerError::new(ErrorCode::UnknownServerError, format!("load task: {e}"))
            })??;
        let (producer_id, producer_epoch) = match state.owner() {
            Some((pid, e)) if e < i16::MAX => (pid, e + 1),
            _ => (
                self.node
                    .producer_ids()
                    .next(self.settings.write_timeout)
                    .await?,
                0,
            ),
        };
        let owner = TimerRecord {
            entry: Some(Entry::Owner(Owner {
                producer_id,
                producer_epoch: producer_epoch.into(),
            })),
        };
        let offset = self
            .append(partition, std::slice::from_ref(&owner), Acks::All)
            .await?;
        state.apply(offset, &owner);
        tracing::info!(
            partition,
            %epoch,
            pending = state.len(),
            unconfirmed = state.unconfirmed().len(),
            producer_id,
            producer_epoch,
            ms = started.elapsed().as_millis() as u64,
            "loaded timers"
        );
        *guard = Some(Loaded {
            epoch,
            local,
            state,
        });
        Ok(())
    }

    /// One pass: claims due timers, delivers them and the unconfirmed batches whose retry
    /// time came, records what arrived. Returns how long to sleep before the next pass.
    async fn move_once(
        &self,
        partition: u32,
        epoch: LeaderEpoch,
        slot: &Slot,
        memo: &mut Memo,
    ) -> Result<Duration, BrokerError> {
        let retry_at = &mut memo.retry_at;
        let now = Instant::now();
        let mut work: Vec<(u64, Intent)> = Vec::new();
        let mut dropped: Vec<TimerRecord> = Vec::new();
        let local;
        {
            let mut guard = slot.loaded.lock().await;
            let loaded = guard.as_mut().filter(|l| l.epoch == epoch).ok_or_else(|| {
                BrokerError::new(ErrorCode::NotLeaderOrFollower, "timers not loaded")
            })?;
            local = loaded.local.clone();
            // Batches whose arrival is unknown, when their pause is over, and once their
            // intent is committed (after a reload an intent may sit above the high
            // watermark: a successor that never got it will claim its timers again, so
            // nothing of it is sent before it is committed).
            let committed = local.log.high_watermark().0;
            for l in loaded.state.unconfirmed() {
                let ix = loaded.state.target_ix(&l.intent.topic, l.intent.partition);
                if l.offset < committed && retry_at.get(&ix).is_none_or(|t| *t <= now) {
                    work.push((l.offset, l.intent));
                }
            }
            // Newly due timers: one intent per batch, appended before anything is sent.
            // The records are read first, to cut each batch to what its target accepts.
            let due = loaded
                .state
                .due(now_ms(), 10_000, self.settings.batch_records);
            let planned = plan_batches(&due, self.settings.batch_records);
            let offsets: Vec<u64> = planned
                .iter()
                .flat_map(|(_, b)| b.iter().map(|d| d.offset))
                .collect();
            let schedules = if offsets.is_empty() {
                HashMap::new()
            } else {
                let replica = local.clone();
                tokio::task::spawn_blocking(move || read_schedules(&replica, &offsets))
                    .await
                    .map_err(|e| {
                        BrokerError::new(ErrorCode::UnknownServerError, format!("read task: {e}"))
                    })??
            };
            let (pid, pepoch) = loaded.state.owner().expect("loaded states have an owner");
            let mut intents = Vec::new();
            for (ix, batch) in planned {
                let (topic, p) = loaded.state.target(ix);
                if !self.target_exists(topic, p) {
                    let since = *memo.missing_since.entry(ix).or_insert(now);
                    if now.duration_since(since) >= TARGET_GONE_AFTER {
                        dropped.push(dropped_record(
                            topic,
                            p,
                            &batch,
                            "the target partition no longer exists",
                        ));
                    }
                    continue;
                }
                memo.missing_since.remove(&ix);
                let (batch, missing): (Vec<DueTimer>, Vec<DueTimer>) = batch
                    .iter()
                    .partition(|d| schedules.contains_key(&d.offset));
                if !missing.is_empty() {
                    dropped.push(dropped_record(
                        topic,
                        p,
                        &missing,
                        "the scheduled record is no longer in the log (deleted by retention?)",
                    ));
                }
                if batch.is_empty() {
                    continue;
                }
                let limit = self.node.topic_config(topic).max_message_bytes;
                let batch = cut_to_bytes(&batch, &schedules, limit);
                intents.push(TimerRecord {
                    entry: Some(Entry::Intent(Intent {
                        topic: topic.to_owned(),
                        partition: p,
                        producer_id: pid,
                        producer_epoch: pepoch.into(),
                        base_sequence: loaded.state.next_seq(ix),
                        offsets: batch.iter().map(|d| d.offset).collect(),
                        dues: batch.iter().map(|d| d.due_ms).collect(),
                    })),
                });
            }
            let retire: Vec<TimerRecord> = dropped.drain(..).chain(intents).collect();
            if !retire.is_empty() {
                let base = match self.append(partition, &retire, Acks::All).await {
                    Ok(base) => base,
                    Err(e) => {
                        *guard = None;
                        return Err(e);
                    }
                };
                for (i, r) in retire.iter().enumerate() {
                    loaded.state.apply(base + i as u64, r);
                    match &r.entry {
                        Some(Entry::Intent(intent)) => work.push((base + i as u64, intent.clone())),
                        Some(Entry::Dropped(d)) => tracing::error!(
                            topic = %d.topic,
                            partition = d.partition,
                            records = d.offsets.len(),
                            reason = %d.reason,
                            "dropped due scheduled records"
                        ),
                        _ => {}
                    }
                }
            }
        }
        // Deliver every batch at once (one per target), outside the lock.
        let sends = work.into_iter().map(|(offset, intent)| {
            let local = local.clone();
            async move {
                let result = self.deliver(partition, &local, &intent).await;
                (offset, intent, result)
            }
        });
        let results = futures_util::future::join_all(sends).await;
        let mut done = Vec::new();
        let mut guard = slot.loaded.lock().await;
        let loaded = guard
            .as_mut()
            .filter(|l| l.epoch == epoch)
            .ok_or_else(|| BrokerError::new(ErrorCode::NotLeaderOrFollower, "timers not loaded"))?;
        let mut first_error = None;
        let mut reissue = Vec::new();
        for (offset, intent, result) in results {
            let ix = loaded.state.target_ix(&intent.topic, intent.partition);
            match result {
                Ok(()) => {
                    retry_at.remove(&ix);
                    done.push(done_record(intent, offset));
                }
                Err(e)
                    if !self.target_exists(&intent.topic, intent.partition)
                        && memo
                            .missing_since
                            .get(&ix)
                            .is_some_and(|t| now.duration_since(*t) >= TARGET_GONE_AFTER) =>
                {
                    // The target was deleted: its claimed records are given up (confirmed,
                    // so the target is not retried).
                    retry_at.remove(&ix);
                    tracing::warn!(topic = %intent.topic, partition = intent.partition, records = intent.offsets.len(), error = %e, "target gone; dropping its scheduled records");
                    done.push(done_record(intent, offset));
                }
                Err(e)
                    if matches!(
                        e.code,
                        ErrorCode::OutOfOrderSequenceNumber | ErrorCode::InvalidProducerEpoch
                    ) && Some((intent.producer_id, intent.producer_epoch as i16))
                        != loaded.state.owner() =>
                {
                    // A previous leadership's batch the target cannot place (its producer
                    // state lost that producer, e.g. after an unclean election): send the
                    // records again under this leadership's producer epoch.
                    tracing::warn!(topic = %intent.topic, partition = intent.partition, error = %e, "resending an earlier leader's timer batch under a new producer epoch");
                    let (pid, pepoch) = loaded.state.owner().expect("loaded");
                    reissue.push(TimerRecord {
                        entry: Some(Entry::Intent(Intent {
                            producer_id: pid,
                            producer_epoch: pepoch.into(),
                            base_sequence: loaded.state.next_seq(ix),
                            ..intent
                        })),
                    });
                }
                Err(e) if !e.code.is_retriable() => {
                    // The target refuses the batch for good (it shrank max.message.bytes,
                    // the records are gone from the log, ...): give the records up rather
                    // than block the target forever.
                    retry_at.remove(&ix);
                    tracing::error!(topic = %intent.topic, partition = intent.partition, records = intent.offsets.len(), error = %e, "a target refuses scheduled records; dropping them");
                    done.push(done_record(intent, offset));
                }
                Err(e) => {
                    retry_at.insert(ix, now + self.settings.retry_backoff);
                    first_error.get_or_insert(e);
                }
            }
        }
        let records: Vec<TimerRecord> = done.into_iter().chain(reissue).collect();
        if !records.is_empty() {
            // A lost Done costs only a resend the target dedupes; a reissued intent must be
            // durable before its batch is sent, so both wait for replication.
            match self.append(partition, &records, Acks::All).await {
                Ok(base) => {
                    for (i, r) in records.iter().enumerate() {
                        loaded.state.apply(base + i as u64, r);
                    }
                }
                Err(e) => {
                    *guard = None;
                    return Err(e);
                }
            }
        }
        // Sleep until the next timer a pass could claim falls due, or the next retry;
        // not at all when an unconfirmed batch may go now (a reissued one).
        *slot.pending.lock() = loaded.state.pending_by_topic();
        let next_due = loaded.state.next_due();
        let committed = loaded.local.log.high_watermark().0;
        let ready_now = loaded.state.unconfirmed().iter().any(|l| {
            let ix = loaded.state.target_ix(&l.intent.topic, l.intent.partition);
            l.offset < committed && retry_at.get(&ix).is_none_or(|t| *t <= Instant::now())
        });
        drop(guard);
        if let Some(e) = first_error {
            return Err(e);
        }
        if ready_now {
            return Ok(Duration::ZERO);
        }
        let until_due = next_due.map_or(Duration::from_secs(1), |d| {
            Duration::from_millis((d - now_ms()).clamp(0, 1000) as u64)
        });
        let until_retry = retry_at.values().min().map_or(Duration::from_secs(1), |t| {
            t.saturating_duration_since(Instant::now())
        });
        Ok(until_due.min(until_retry))
    }

    fn target_exists(&self, topic: &str, partition: u32) -> bool {
        self.node.metadata().partition(topic, partition).is_some()
    }

    /// Sends the batch of `intent` to its target's leader.
    async fn deliver(
        &self,
        partition: u32,
        local: &Arc<LocalPartition>,
        intent: &Intent,
    ) -> Result<(), BrokerError> {
        let replica = local.clone();
        let offsets = intent.offsets.clone();
        let schedules = tokio::task::spawn_blocking(move || read_schedules(&replica, &offsets))
            .await
            .map_err(|e| {
                BrokerError::new(ErrorCode::UnknownServerError, format!("read task: {e}"))
            })??;
        if let Some(o) = intent.offsets.iter().find(|o| !schedules.contains_key(o)) {
            return Err(BrokerError::new(
                ErrorCode::CorruptMessage,
                format!(
                    "{TIMERS_TOPIC}-{partition}: scheduled record {o} is no longer in the log (deleted by retention?)"
                ),
            ));
        }
        let batch = delivery_batch(partition, intent, &schedules, now_ms())?;
        let leader = self
            .node
            .metadata()
            .partition(&intent.topic, intent.partition)
            .and_then(|(_, p)| p.leader)
            .ok_or_else(|| {
                BrokerError::new(
                    ErrorCode::NotLeaderOrFollower,
                    format!(
                        "{}-{} has no leader right now",
                        intent.topic, intent.partition
                    ),
                )
            })?;
        if leader == self.node.id() {
            self.node
                .produce(
                    &intent.topic,
                    intent.partition,
                    batch,
                    Acks::All,
                    self.settings.write_timeout,
                )
                .await
                .map(|_| ())
        } else {
            self.peers
                .deliver(leader, intent.topic.clone(), intent.partition, batch)
                .await
        }
    }
}

/// What a mover remembers between passes (not in the log).
#[derive(Default)]
struct Memo {
    /// Targets whose last batch failed, and when to send it again.
    retry_at: HashMap<state::TargetIx, Instant>,
    /// Targets the metadata does not show, since when: their timers are dropped only
    /// after [`TARGET_GONE_AFTER`] (a new topic may not have reached this broker yet).
    missing_since: HashMap<state::TargetIx, Instant>,
}

/// How long a target must be missing from the metadata before its timers are dropped.
const TARGET_GONE_AFTER: Duration = Duration::from_secs(60);

/// A log line at most every 10 s.
#[derive(Default)]
struct RateLimit(Option<std::time::Instant>);

impl RateLimit {
    fn allow(&mut self) -> bool {
        let now = std::time::Instant::now();
        if self
            .0
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(10))
        {
            return false;
        }
        self.0 = Some(now);
        true
    }
}

fn unknown_id(id: TimerId) -> BrokerError {
    BrokerError::new(
        ErrorCode::UnknownScheduledRecord,
        format!("no pending scheduled record has id {id}: it is unknown, or was delivered or cancelled already"),
    )
}

/// The `Done` record confirming `intent` (at `offset`).
fn done_record(intent: Intent, offset: u64) -> TimerRecord {
    TimerRecord {
        entry: Some(Entry::Done(Done {
            topic: intent.topic,
            partition: intent.partition,
            intent_offset: offset,
        })),
    }
}

fn dropped_record(topic: &str, partition: u32, batch: &[DueTimer], reason: &str) -> TimerRecord {
    TimerRecord {
        entry: Some(Entry::Dropped(Dropped {
            topic: topic.to_owned(),
            partition,
            offsets: batch.iter().map(|d| d.offset).collect(),
            dues: batch.iter().map(|d| d.due_ms).collect(),
            reason: reason.to_owned(),
        })),
    }
}

/// Every timer record of the partition's log, applied in order.
fn replay(local: &LocalPartition) -> Result<TimerState, BrokerError> {
    let mut state = TimerState::default();
    local.replay_records(|r| match r.value.as_deref().map(TimerRecord::decode) {
        Some(Ok(t)) => state.apply(r.offset as u64, &t),
        _ => {
            tracing::warn!(partition = %local.name(), offset = r.offset, "skipping an undecodable timer record")
        }
    })?;
    Ok(state)
}

/// The `Schedule` records at `offsets` (any order), by offset; an offset whose record is
/// gone (below the log start) or is not a `Schedule` is left out.
fn read_schedules(
    local: &LocalPartition,
    offsets: &[u64],
) -> Result<HashMap<u64, Schedule>, BrokerError> {
    let start = local.log.log_start_offset().0;
    let mut wanted: Vec<u64> = offsets.iter().copied().filter(|o| *o >= start).collect();
    wanted.sort_unstable();
    let mut out = HashMap::with_capacity(wanted.len());
    let mut i = 0;
    while i < wanted.len() {
        let data = local
            .log
            .read(Offset(wanted[i]), 1 << 20, Isolation::LogEnd)
            .map_err(|e| BrokerError::from_log(&local.name(), e))?;
        let records = decode_data_records(&data.records, 64 << 20)
            .map_err(|e| BrokerError::new(ErrorCode::CorruptMessage, e.to_string()))?;
        let Some(last) = records.last().map(|r| r.offset as u64) else {
            break;
        };
        let by_offset: HashMap<u64, &crate::record::Record> =
            records.iter().map(|r| (r.offset as u64, r)).collect();
        while i < wanted.len() && wanted[i] <= last {
            let o = wanted[i];
            let schedule = by_offset
                .get(&o)
                .and_then(|r| r.value.as_deref())
                .and_then(|v| TimerRecord::decode(v).ok())
                .and_then(|t| match t.entry {
                    Some(Entry::Schedule(s)) => Some(s),
                    _ => None,
                });
            if let Some(schedule) = schedule {
                out.insert(o, schedule);
            }
            i += 1;
        }
    }
    Ok(out)
}

/// The idempotent batch that delivers `intent`'s records: each keeps its key, value and
/// headers, gets `now_ms` as its timestamp and two headers, its original timestamp and
/// its scheduled record id.
pub fn delivery_batch(
    timers_partition: u32,
    intent: &Intent,
    schedules: &HashMap<u64, Schedule>,
    now_ms: i64,
) -> Result<Vec<u8>, BrokerError> {
    let mut builder = BatchBuilder::new(Compression::None).producer(
        intent.producer_id,
        intent.producer_epoch as i16,
        intent.base_sequence,
    );
    for (offset, due_ms) in intent.offsets.iter().zip(&intent.dues) {
        let s = &schedules[offset];
        let original = s.timestamp_ms.to_string();
        let id = TimerId {
            partition: timers_partition,
            offset: *offset,
            due_ms: *due_ms,
        }
        .to_string();
        let mut headers: Vec<(&str, Option<&[u8]>)> = s
            .headers
            .iter()
            .map(|h| (h.key.as_str(), h.value.as_deref()))
            .collect();
        headers.push((ORIGINAL_TIMESTAMP_HEADER, Some(original.as_bytes())));
        headers.push((TIMER_ID_HEADER, Some(id.as_bytes())));
        builder.push(RecordRef {
            timestamp: now_ms,
            key: s.key.as_deref(),
            value: s.value.as_deref(),
            headers: &headers,
        });
    }
    builder.build(0).map_err(|e| {
        BrokerError::new(
            ErrorCode::UnknownServerError,
            format!("cannot encode a delivery batch: {e}"),
        )
    })
}

/// Bytes a scheduled record takes in its delivery batch, at most (its key, value and
/// headers, the two headers delivery adds, and record framing).
pub fn delivered_size(s: &Schedule) -> usize {
    let headers: usize = s
        .headers
        .iter()
        .map(|h| h.key.len() + h.value.as_ref().map_or(0, Bytes::len) + 10)
        .sum();
    s.key.as_ref().map_or(0, Bytes::len) + s.value.as_ref().map_or(0, Bytes::len) + headers + 160
}

/// The longest prefix of `batch` whose delivery batch fits `limit` bytes (at least one
/// timer: a record was checked against its target's limit when it was scheduled).
pub fn cut_to_bytes(
    batch: &[DueTimer],
    schedules: &HashMap<u64, Schedule>,
    limit: usize,
) -> Vec<DueTimer> {
    let mut total = crate::record::HEADER_LEN;
    let mut out = Vec::new();
    for d in batch {
        let size = schedules.get(&d.offset).map_or(0, delivered_size);
        if !out.is_empty() && total + size > limit {
            break;
        }
        total += size;
        out.push(*d);
    }
    out
}

/// A `Schedule` for a record (without its scheduling headers).
pub fn schedule_entry(
    topic: &str,
    partition: u32,
    due_ms: i64,
    timestamp_ms: i64,
    key: Option<Bytes>,
    value: Option<Bytes>,
    headers: Vec<(String, Option<Bytes>)>,
) -> Schedule {
    Schedule {
        topic: topic.to_owned(),
        partition,
        due_ms,
        timestamp_ms,
        key,
        value,
        // Scheduling headers are consumed here: the delivered record must not be
        // scheduled again.
        headers: headers
            .into_iter()
            .filter(|(key, _)| !crate::record::delay::is_delay_header(key))
            .map(|(key, value)| codec::Header { key, value })
            .collect(),
    }
}
