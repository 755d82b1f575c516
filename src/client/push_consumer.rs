//! The push consumer: a consumer group member that receives records over push streams
//! and runs a [`MessageListener`] on each, as RocketMQ's push consumer does.
//!
//! - **Concurrent** ([`ListenMode::Concurrent`]): records run on a pool of `workers`
//!   tasks in any order. A record the listener answers [`ConsumeResult::Later`] for is
//!   nacked: it comes back through the group's retry topic after a backoff, or goes to
//!   its dead-letter topic ([`super::retry`]), and its partition moves on. Broadcast
//!   groups (which do not retry), and nacks that fail, retry here after `retry_pause`,
//!   up to `local_retries` times; then the record is given up (logged and counted in
//!   [`PushStats::given_up`]).
//! - **Orderly** ([`ListenMode::Orderly`]): each partition has at most one record in the
//!   listener at a time, in offset order (a per-partition queue drained by one task, as
//!   RocketMQ's per-queue lock). `Later` retries the same record in place after
//!   `orderly_retry_pause`, as often as it takes, holding up only its partition.
//!
//! Commits never pass a record that is not done: the group consumer commits, per
//! partition, the lowest offset still queued or in the listener (or its position when
//! none is), so a crash re-delivers every record not processed and skips none. A revoked
//! partition's records in the listener may finish, retries included (up to `release_wait`), before its
//! offset is committed and it is handed over; its queued records are dropped and
//! delivered to the next owner.
//!
//! Flow control: a partition with `partition_buffer_max` records not done is paused (its
//! stream stops) until half of them are, and the push window bounds what the client
//! holds beyond that.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{Notify, Semaphore};

use super::consumer::{ConsumerFilter, ConsumerRecord};
use super::error::ClientError;
use super::group_consumer::{GroupConfig, GroupConsumer, PartitionHooks, TopicPartition};
use super::push_feed::PushSettings;
use super::retry::{NackOutcome, Retrier};

/// What the listener made of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumeResult {
    /// Done: its offset may be committed.
    Success,
    /// Not now: deliver it again later.
    Later,
    /// Not done and not to be retried here: the record stays uncommitted (the
    /// partition's next owner, or this member's next session, gets it again). Only for
    /// a listener that is shutting down: the partition's commits stop at the record, so
    /// it stalls until the consumer shuts down or the partition moves.
    Abandon,
}

/// The application's record handler.
#[tonic::async_trait]
pub trait MessageListener: Send + Sync + 'static {
    /// Handles one record; `attempt` is 1 on the first delivery here.
    async fn consume(&self, record: &ConsumerRecord, attempt: u32) -> ConsumeResult;
}

/// How records are handed to the listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenMode {
    /// On a worker pool, in any order.
    Concurrent,
    /// One record of a partition at a time, in offset order.
    Orderly,
}

/// Push consumer settings.
#[derive(Debug, Clone)]
pub struct PushConfig {
    /// The group membership (auto commit is on: it commits what is done).
    pub group: GroupConfig,
    /// Concurrent or orderly.
    pub mode: ListenMode,
    /// Records in the listener at once, over all partitions.
    pub workers: usize,
    /// The push window per broker.
    pub push: PushSettings,
    /// Records not done (queued or in the listener) at which a partition is paused.
    pub partition_buffer_max: usize,
    /// Concurrent mode: how many times a `Later` record is retried here before it is
    /// given up.
    pub local_retries: u32,
    /// Concurrent mode: the pause before such a retry.
    pub retry_pause: Duration,
    /// Orderly mode: the pause before a `Later` record is retried in place.
    pub orderly_retry_pause: Duration,
    /// How long a revoked partition's records in the listener may take to finish before
    /// it is committed and handed over (and how long `shutdown` waits).
    pub release_wait: Duration,
    /// A server-side filter.
    pub filter: Option<ConsumerFilter>,
}

impl Default for PushConfig {
    fn default() -> Self {
        Self {
            group: GroupConfig::default(),
            mode: ListenMode::Concurrent,
            workers: 20,
            push: PushSettings::default(),
            partition_buffer_max: 1000,
            local_retries: 3,
            retry_pause: Duration::from_millis(200),
            orderly_retry_pause: Duration::from_secs(1),
            release_wait: Duration::from_secs(10),
            filter: None,
        }
    }
}

/// Counters of a push consumer.
#[derive(Debug, Default)]
pub struct PushStats {
    /// Records handed to the listener (first attempts).
    pub delivered: AtomicU64,
    /// Records the listener finished with `Success`.
    pub succeeded: AtomicU64,
    /// `Later` answers.
    pub later: AtomicU64,
    /// Concurrent records given up after `local_retries` retries.
    pub given_up: AtomicU64,
    /// `Later` records sent to the retry topic.
    pub retried: AtomicU64,
    /// `Later` records sent to the dead-letter topic.
    pub dead_lettered: AtomicU64,
}

/// Records of one partition that are not done.
#[derive(Debug, Default)]
struct Progress {
    /// A new number (never reused) each time the partition is held: work of an older
    /// holding is ignored.
    holding: u64,
    /// Offsets queued or in the listener.
    unfinished: BTreeSet<i64>,
    /// Orderly: records waiting for their turn.
    queue: VecDeque<ConsumerRecord>,
    /// Orderly: a task is draining the queue.
    draining: bool,
    /// Records in the listener now.
    running: usize,
    /// Paused for a full buffer.
    paused: bool,
    /// Being revoked: nothing new starts; records in the listener (retries included)
    /// may finish.
    releasing: bool,
    /// Released: the next record starts a new holding.
    released: bool,
}

/// State shared by the dispatcher, the listener tasks and the group consumer's hooks.
struct Shared {
    config: PushConfig,
    listener: Arc<dyn MessageListener>,
    /// Nacks `Later` records (None: broadcast group).
    retrier: Option<Arc<Retrier>>,
    workers: Arc<Semaphore>,
    progress: Mutex<BTreeMap<TopicPartition, Progress>>,
    /// Rung whenever a record finishes or is dropped.
    finished: Notify,
    stats: PushStats,
    stopping: AtomicBool,
    /// `shutdown` was called.
    stop_requested: AtomicBool,
    tasks: Mutex<tokio::task::JoinSet<()>>,
    /// Source of holding numbers: never reused, so work of an old holding never matches
    /// a new one (even after a partition's entry was removed).
    holdings: AtomicU64,
}

impl Shared {
    /// A holding number not used before.
    fn new_holding(&self) -> u64 {
        self.holdings.fetch_add(1, Ordering::Relaxed)
    }

    /// Marks `record` done (if its holding is still current).
    fn finish(&self, tp: &TopicPartition, holding: u64, offset: i64) {
        let mut all = self.progress.lock();
        if let Some(p) = all.get_mut(tp).filter(|p| p.holding == holding) {
            p.unfinished.remove(&offset);
            p.running = p.running.saturating_sub(1);
        }
        drop(all);
        self.finished.notify_waiters();
    }

    /// Gives up a record without finishing it (it stays uncommitted).
    fn abandon(&self, tp: &TopicPartition, holding: u64) {
        let mut all = self.progress.lock();
        if let Some(p) = all.get_mut(tp).filter(|p| p.holding == holding) {
            p.running = p.running.saturating_sub(1);
        }
        drop(all);
        self.finished.notify_waiters();
    }

    /// Whether a record of `holding` on `tp` may be retried: not stopping and not
    /// released. A partition being revoked keeps retrying within `release_wait`, so
    /// what its listener finishes is committed before the hand-over.
    fn may_retry(&self, tp: &TopicPartition, holding: u64) -> bool {
        !self.stopping.load(Ordering::Relaxed)
            && self
                .progress
                .lock()
                .get(tp)
                .is_some_and(|p| p.holding == holding)
    }

    /// Waits until none of `partitions` has a record in the listener, at most `limit`.
    async fn wait_idle(&self, partitions: Option<&BTreeSet<TopicPartition>>, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let finished = self.finished.notified();
            let busy = self
                .progress
                .lock()
                .iter()
                .filter(|(tp, _)| partitions.is_none_or(|ps| ps.contains(*tp)))
                .any(|(_, p)| p.running > 0);
            if !busy || tokio::time::timeout_at(deadline, finished).await.is_err() {
                return;
            }
        }
    }

    /// Releases `partitions`: queued records are dropped (they stay unfinished, so the
    /// commit stops at the first of them) and later work of this holding is ignored.
    fn release(&self, partitions: &BTreeSet<TopicPartition>) {
        let mut all = self.progress.lock();
        for tp in partitions {
            if let Some(p) = all.get_mut(tp) {
                p.queue.clear();
                p.holding = self.new_holding();
                // Records of the old holding still in the listener no longer count.
                p.running = 0;
                p.releasing = false;
                p.released = true;
            }
        }
    }
}

/// The hooks the group consumer calls.
struct Hooks(Arc<Shared>);

impl PartitionHooks for Hooks {
    fn commit_floor(&self, tp: &TopicPartition) -> Option<i64> {
        self.0
            .progress
            .lock()
            .get(tp)
            .and_then(|p| p.unfinished.first().copied())
    }

    fn before_release<'a>(
        &'a self,
        partitions: &'a BTreeSet<TopicPartition>,
    ) -> futures_util::future::BoxFuture<'a, ()> {
        Box::pin(async move {
            // Stop queued work and retries first, then let what is in the listener
            // finish.
            {
                let mut all = self.0.progress.lock();
                for tp in partitions {
                    if let Some(p) = all.get_mut(tp) {
                        p.queue.clear();
                        p.releasing = true;
                    }
                }
            }
            self.0
                .wait_idle(Some(partitions), self.0.config.release_wait)
                .await;
            self.0.release(partitions);
        })
    }

    fn lost(&self, partitions: &BTreeSet<TopicPartition>) {
        self.0.release(partitions);
        let mut all = self.0.progress.lock();
        for tp in partitions {
            all.remove(tp);
        }
    }
}

/// A running push consumer.
pub struct PushConsumer {
    shared: Arc<Shared>,
    stop: Arc<Notify>,
    dispatcher: tokio::task::JoinHandle<Result<(), ClientError>>,
}

impl PushConsumer {
    /// Joins the group of `config` through `bootstrap` and starts handing its records to
    /// `listener`. Refused when the filter does not parse or `workers` is 0.
    pub fn start(
        bootstrap: Vec<String>,
        config: PushConfig,
        listener: Arc<dyn MessageListener>,
    ) -> Result<Self, ClientError> {
        if config.workers == 0 || config.partition_buffer_max == 0 {
            return Err(ClientError::new(
                crate::error_code::ErrorCode::InvalidConfig,
                "workers and partition_buffer_max must be at least 1",
            ));
        }
        let mut group_config = config.group.clone();
        group_config.auto_commit = true;
        let mut group = GroupConsumer::new(bootstrap, group_config);
        group.set_filter(config.filter.clone())?;
        group.enable_push(config.push);
        let shared = Arc::new(Shared {
            retrier: group.retrier(),
            workers: Arc::new(Semaphore::new(config.workers)),
            config,
            listener,
            progress: Mutex::new(BTreeMap::new()),
            finished: Notify::new(),
            stats: PushStats::default(),
            stopping: AtomicBool::new(false),
            stop_requested: AtomicBool::new(false),
            tasks: Mutex::new(tokio::task::JoinSet::new()),
            holdings: AtomicU64::new(1),
        });
        group.set_hooks(Arc::new(Hooks(shared.clone())));
        let stop = Arc::new(Notify::new());
        let dispatcher = tokio::spawn(dispatch(group, shared.clone(), stop.clone()));
        Ok(Self {
            shared,
            stop,
            dispatcher,
        })
    }

    /// The counters.
    pub fn stats(&self) -> &PushStats {
        &self.shared.stats
    }

    /// Whether the consumer stopped by itself (a fatal error: [`PushConsumer::shutdown`]
    /// returns it).
    pub fn is_finished(&self) -> bool {
        self.dispatcher.is_finished()
    }

    /// Stops taking records, lets those in the listener finish (up to `release_wait`;
    /// the rest are abandoned and not committed), commits what is done and leaves the
    /// group.
    pub async fn shutdown(self) -> Result<(), ClientError> {
        self.shared.stop_requested.store(true, Ordering::Relaxed);
        self.stop.notify_one();
        match self.dispatcher.await {
            Ok(r) => r,
            Err(e) => Err(ClientError::new(
                crate::error_code::ErrorCode::UnknownServerError,
                format!("push dispatcher: {e}"),
            )),
        }
    }
}

/// The dispatcher: polls the group consumer (which reconciles the assignment, commits
/// and receives pushed records) and hands records to the listener.
async fn dispatch(
    mut group: GroupConsumer,
    shared: Arc<Shared>,
    stop: Arc<Notify>,
) -> Result<(), ClientError> {
    let outcome = loop {
        if shared.stop_requested.load(Ordering::Relaxed) {
            break Ok(());
        }
        // Not raced against the stop: a poll cut short could lose records it already
        // moved the positions past.
        let records = match group.poll(Duration::from_millis(200)).await {
            Ok(r) => r,
            Err(e) if e.is_retriable() => {
                tracing::debug!(error = %e, "push consumer poll failed; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            Err(e) => break Err(e),
        };
        let concurrent = register(&shared, records);
        // Waiting for a worker must not hold up a stop (a registered record not handed
        // over stays unfinished: it is not committed).
        let handed = async {
            for (holding, record) in concurrent {
                hand_over(&shared, holding, record).await;
            }
        };
        tokio::select! {
            _ = handed => {}
            _ = stop.notified() => break Ok(()),
        }
        pause_or_resume(&mut group, &shared).await;
        let mut tasks = shared.tasks.lock();
        while tasks.try_join_next().is_some() {}
    };
    // Shutdown: no new work; let the listener finish (bounded), abandon the rest.
    shared.stopping.store(true, Ordering::Relaxed);
    shared.wait_idle(None, shared.config.release_wait).await;
    shared.tasks.lock().abort_all();
    let closed = group.close().await;
    outcome.and(closed)
}

/// Counts `records` as not done, before anything can commit past them; returns each
/// with its holding. Orderly records are queued (and a drain task started) here.
fn register(shared: &Arc<Shared>, records: Vec<ConsumerRecord>) -> Vec<(u64, ConsumerRecord)> {
    let mut concurrent = Vec::new();
    let mut all = shared.progress.lock();
    for record in records {
        let tp = (record.topic.clone(), record.partition);
        let p = all.entry(tp.clone()).or_insert_with(|| Progress {
            holding: shared.new_holding(),
            ..Progress::default()
        });
        if p.released {
            // Held again: a new holding (work of the old one is ignored).
            *p = Progress {
                holding: p.holding,
                ..Progress::default()
            };
        }
        p.unfinished.insert(record.offset);
        if shared.config.mode == ListenMode::Concurrent {
            concurrent.push((p.holding, record));
            continue;
        }
        p.queue.push_back(record);
        if !p.draining {
            p.draining = true;
            let (s, holding) = (shared.clone(), p.holding);
            shared
                .tasks
                .lock()
                .spawn(async move { drain_in_order(s, tp, holding).await });
        }
    }
    concurrent
}

/// Runs a registered concurrent record once a worker is free.
async fn hand_over(shared: &Arc<Shared>, holding: u64, record: ConsumerRecord) {
    let tp = (record.topic.clone(), record.partition);
    let Ok(permit) = shared.workers.clone().acquire_owned().await else {
        return;
    };
    {
        let mut all = shared.progress.lock();
        match all
            .get_mut(&tp)
            .filter(|p| p.holding == holding && !p.releasing)
        {
            Some(p) => p.running += 1,
            None => return,
        }
    }
    let s = shared.clone();
    shared.tasks.lock().spawn(async move {
        let _permit = permit;
        run_concurrent(&s, &tp, holding, record).await;
    });
}

/// One concurrent record: the listener; a `Later` record is nacked (or, when that is
/// not possible, retried here a bounded number of times).
async fn run_concurrent(
    shared: &Shared,
    tp: &TopicPartition,
    holding: u64,
    record: ConsumerRecord,
) {
    shared.stats.delivered.fetch_add(1, Ordering::Relaxed);
    let attempts = shared.config.local_retries.saturating_add(1);
    for attempt in 1..=attempts {
        if attempt > 1 && !shared.may_retry(tp, holding) {
            shared.abandon(tp, holding);
            return;
        }
        match call(&*shared.listener, &record, attempt).await {
            ConsumeResult::Success => {
                shared.stats.succeeded.fetch_add(1, Ordering::Relaxed);
                shared.finish(tp, holding, record.offset);
                return;
            }
            ConsumeResult::Abandon => {
                shared.abandon(tp, holding);
                return;
            }
            ConsumeResult::Later => {
                shared.stats.later.fetch_add(1, Ordering::Relaxed);
                if nack(shared, &record).await {
                    shared.finish(tp, holding, record.offset);
                    return;
                }
                if attempt < attempts {
                    tokio::time::sleep(shared.config.retry_pause).await;
                }
            }
        }
    }
    shared.stats.given_up.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(
        topic = %record.topic, partition = record.partition, offset = record.offset, attempts,
        "the listener answered Later every time; giving the record up"
    );
    shared.finish(tp, holding, record.offset);
}

/// Nacks a `Later` record through the group's retry topic; false when the group does
/// not retry or the nack failed (the caller retries locally).
async fn nack(shared: &Shared, record: &ConsumerRecord) -> bool {
    let Some(retrier) = &shared.retrier else {
        return false;
    };
    match retrier.nack(record, "the listener answered Later").await {
        Ok(NackOutcome::Retried { .. }) => {
            shared.stats.retried.fetch_add(1, Ordering::Relaxed);
            true
        }
        Ok(NackOutcome::DeadLettered { .. }) => {
            shared.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
            true
        }
        Err(e) => {
            tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, error = %e, "nack failed; retrying the record here");
            false
        }
    }
}

/// The listener on one record; a panic counts as `Later`.
async fn call(
    listener: &dyn MessageListener,
    record: &ConsumerRecord,
    attempt: u32,
) -> ConsumeResult {
    use futures_util::FutureExt;
    std::panic::AssertUnwindSafe(listener.consume(record, attempt))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| {
            tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, "the listener panicked; delivering the record again later");
            ConsumeResult::Later
        })
}

/// Orderly: runs a partition's queued records one at a time, in order, retrying a
/// `Later` record in place.
async fn drain_in_order(shared: Arc<Shared>, tp: TopicPartition, holding: u64) {
    loop {
        let record = {
            let mut all = shared.progress.lock();
            let Some(p) = all.get_mut(&tp).filter(|p| p.holding == holding) else {
                return;
            };
            if p.releasing || shared.stopping.load(Ordering::Relaxed) {
                p.draining = false;
                return;
            }
            match p.queue.pop_front() {
                Some(r) => {
                    p.running += 1;
                    r
                }
                None => {
                    p.draining = false;
                    return;
                }
            }
        };
        let Ok(_permit) = shared.workers.clone().acquire_owned().await else {
            return;
        };
        shared.stats.delivered.fetch_add(1, Ordering::Relaxed);
        let mut attempt = 1u32;
        loop {
            match call(&*shared.listener, &record, attempt).await {
                ConsumeResult::Success => {
                    shared.stats.succeeded.fetch_add(1, Ordering::Relaxed);
                    shared.finish(&tp, holding, record.offset);
                    break;
                }
                ConsumeResult::Abandon => {
                    if let Some(p) = shared
                        .progress
                        .lock()
                        .get_mut(&tp)
                        .filter(|p| p.holding == holding)
                    {
                        p.draining = false;
                    }
                    shared.abandon(&tp, holding);
                    return;
                }
                ConsumeResult::Later => {}
            }
            shared.stats.later.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(shared.config.orderly_retry_pause).await;
            if !shared.may_retry(&tp, holding) {
                // Released or stopping: the next owner delivers it (not committed).
                shared.abandon(&tp, holding);
                return;
            }
            attempt = attempt.saturating_add(1);
        }
    }
}

/// Pauses partitions with a full buffer and resumes those drained to half; forgets
/// partitions no longer held.
async fn pause_or_resume(group: &mut GroupConsumer, shared: &Shared) {
    let held = group.assignment();
    let max = shared.config.partition_buffer_max;
    let mut pause = Vec::new();
    let mut resume = Vec::new();
    {
        let mut all = shared.progress.lock();
        all.retain(|tp, p| held.contains(tp) || p.running > 0);
        for (tp, p) in all.iter_mut() {
            let n = p.unfinished.len();
            if !p.paused && n >= max {
                p.paused = true;
                pause.push(tp.clone());
            } else if p.paused && n <= max / 2 {
                p.paused = false;
                resume.push(tp.clone());
            }
        }
    }
    for (topic, partition) in pause {
        group.pause(&topic, partition);
    }
    for (topic, partition) in resume {
        if let Err(e) = group.resume(&topic, partition).await {
            tracing::warn!(%topic, partition, error = %e, "resuming a partition failed");
        }
    }
}
