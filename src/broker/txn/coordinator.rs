//! [`TxnCoordinator`]: serves the transactional ids whose `__transaction_state` partition
//! this broker leads.
//!
//! Each change of an id's state is appended (key: the id, value: [`TxnMeta`] as JSON)
//! with acks=all before it takes effect, so a new leader of the partition replays the
//! log and carries on; a transaction it finds in `PrepareCommit`/`PrepareAbort` it
//! completes. Completing writes a marker to every partition of the transaction (through
//! each partition's leader, acks=all), then appends `CompleteCommit`/`CompleteAbort`.
//! The coordinator epoch on the markers is the leader epoch of the state partition, so a
//! partition refuses markers of a deposed coordinator.
//!
//! An id is busy while a change of it is being appended or its markers written: other
//! requests for it get the retriable `CONCURRENT_TRANSACTIONS` rather than waiting,
//! so no lock is held across I/O.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::state::{self, EndDecision, InitDecision, TxnMeta, TxnPartition, TxnState};
use crate::broker::error::BrokerError;
use crate::broker::group::offsets::{self, OFFSETS_TOPIC};
use crate::broker::node::{now_ms, Acks, BrokerNode};
use crate::error_code::ErrorCode;
use crate::record::control::ControlMarker;
use crate::record::{BatchBuilder, Compression, RecordRef};
use crate::replication::replica::LocalPartition;
use crate::types::{BrokerId, LeaderEpoch};

/// The internal topic of transaction states.
pub const TXN_TOPIC: &str = "__transaction_state";

/// Longest transactional id.
pub const TRANSACTIONAL_ID_MAX: usize = 255;

/// Transaction settings of a broker.
#[derive(Debug, Clone)]
pub struct TxnSettings {
    /// Partitions of `__transaction_state` when it is created.
    pub partitions: u32,
    /// Its replication factor (capped at the live brokers).
    pub replication_factor: u32,
    /// Timeout of a transaction whose producer asks for none.
    pub timeout_default_ms: u32,
    /// Largest timeout a producer may ask for.
    pub timeout_max_ms: u32,
    /// How long a state append or a marker may wait for replication.
    pub write_timeout: Duration,
    /// An id idle this long is forgotten (Kafka's `transactional.id.expiration.ms`); the
    /// topic's retention drops its records too.
    pub id_expiration: Duration,
    /// A transaction open this long is checked back with its producer, if the producer
    /// registered a checker, and again after each further interval (RocketMQ's
    /// `transactionCheckInterval`).
    pub check_interval: Duration,
    /// Checks without a verdict before the transaction is aborted (RocketMQ's
    /// `transactionCheckMax`).
    pub check_max: u32,
}

impl Default for TxnSettings {
    fn default() -> Self {
        Self {
            partitions: 50,
            replication_factor: 3,
            timeout_default_ms: 60_000,
            timeout_max_ms: 900_000,
            write_timeout: Duration::from_secs(10),
            id_expiration: Duration::from_secs(7 * 24 * 3600),
            check_interval: Duration::from_secs(60),
            check_max: 15,
        }
    }
}

/// What the coordinator needs from other brokers (over their internal listeners).
pub trait MarkerPeers: Send + Sync + 'static {
    /// Has `broker` append the marker ending `producer_id`'s transaction to each of
    /// `partitions` (which it leads); one result per partition.
    fn write_markers(
        &self,
        broker: BrokerId,
        producer_id: i64,
        producer_epoch: i16,
        marker: ControlMarker,
        partitions: Vec<TxnPartition>,
    ) -> BoxFuture<'static, Result<Vec<Result<(), BrokerError>>, BrokerError>>;
}

/// One id as `describe` and `list` show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnDescription {
    /// The transactional id.
    pub id: String,
    /// Its state.
    pub meta: TxnMeta,
}

/// What the coordinator tells a producer's check-back stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckEvent {
    /// Did the local transaction behind the open transaction started at `started_ms`
    /// commit?
    Check {
        /// The transaction's start (ms).
        started_ms: i64,
        /// Its partitions.
        partitions: Vec<TxnPartition>,
        /// 1 for its first check.
        attempt: u32,
    },
    /// The transaction started at `started_ms` ended without the producer's EndTxn.
    Ended {
        /// The transaction's start (ms).
        started_ms: i64,
        /// Whether it committed.
        committed: bool,
    },
}

/// How a producer answered a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckVerdict {
    /// Its local transaction committed: commit.
    Commit,
    /// Its local transaction rolled back: abort.
    Rollback,
    /// Not known yet: ask again later.
    Unknown,
}

/// A live producer's check-back stream.
struct Checker {
    producer_id: i64,
    epoch: i16,
    session: u64,
    events: tokio::sync::mpsc::Sender<CheckEvent>,
}

/// Checks sent for an id's open transaction.
#[derive(Debug, Clone, Copy)]
struct ChecksSent {
    started_ms: i64,
    sent: u32,
}

/// Most check events queued for one producer.
const CHECK_QUEUE: usize = 16;

#[derive(Default)]
struct Inner {
    /// State partitions loaded, at the leader epoch they were loaded for.
    loaded: HashMap<u32, LeaderEpoch>,
    /// Every id of the loaded partitions.
    txns: HashMap<String, TxnMeta>,
}

/// The transaction coordinator of one broker.
pub struct TxnCoordinator {
    node: BrokerNode,
    settings: TxnSettings,
    peers: Arc<dyn MarkerPeers>,
    inner: Mutex<Inner>,
    /// Ids with a change or markers in flight.
    busy: parking_lot::Mutex<HashSet<String>>,
    /// Producers that answer checks, by transactional id.
    checkers: parking_lot::Mutex<HashMap<String, Checker>>,
    /// Checks sent per id (for its current open transaction).
    checks: parking_lot::Mutex<HashMap<String, ChecksSent>>,
    next_session: std::sync::atomic::AtomicU64,
}

fn error(code: ErrorCode, message: impl Into<String>) -> BrokerError {
    BrokerError::new(code, message)
}

/// The `__transaction_state` partition of `id` among `partitions`.
pub fn partition_for(id: &str, partitions: u32) -> u32 {
    crc32c::crc32c(id.as_bytes()) % partitions.max(1)
}

/// Marks an id busy until dropped.
struct Busy<'a> {
    coordinator: &'a TxnCoordinator,
    id: String,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.coordinator.busy.lock().remove(&self.id);
    }
}

impl TxnCoordinator {
    /// A coordinator serving through `node`, reaching other brokers through `peers`.
    pub fn new(node: BrokerNode, settings: TxnSettings, peers: Arc<dyn MarkerPeers>) -> Arc<Self> {
        Arc::new(Self {
            node,
            settings,
            peers,
            inner: Mutex::new(Inner::default()),
            busy: parking_lot::Mutex::new(HashSet::new()),
            checkers: parking_lot::Mutex::new(HashMap::new()),
            checks: parking_lot::Mutex::new(HashMap::new()),
            next_session: std::sync::atomic::AtomicU64::new(1),
        })
    }

    /// The settings.
    pub fn settings(&self) -> &TxnSettings {
        &self.settings
    }

    /// The state partition of `id`, from the topic's current partition count.
    pub fn state_partition(&self, id: &str) -> Result<u32, BrokerError> {
        check_id(id)?;
        let t = self.node.metadata().topic(TXN_TOPIC).ok_or_else(|| {
            error(
                ErrorCode::NotCoordinator,
                format!("{TXN_TOPIC} does not exist yet; ask FindCoordinator first"),
            )
        })?;
        Ok(partition_for(id, t.partitions.len() as u32))
    }

    /// Checks that this broker coordinates `id` and that its partition is loaded; returns
    /// the coordinator epoch (the state partition's leader epoch).
    async fn own(&self, id: &str) -> Result<(u32, LeaderEpoch), BrokerError> {
        let partition = self.state_partition(id)?;
        let (local, epoch) =
            self.node
                .leader_partition(TXN_TOPIC, partition)
                .map_err(|mut e| {
                    let me = self.node.id();
                    let elected = self.node.metadata().topic(TXN_TOPIC).is_some_and(|t| {
                        t.partitions
                            .get(partition as usize)
                            .is_some_and(|p| p.leader == Some(me))
                    });
                    if e.code == ErrorCode::NotLeaderOrFollower && elected {
                        e.code = ErrorCode::CoordinatorLoadInProgress;
                    } else if e.code == ErrorCode::NotLeaderOrFollower {
                        e.code = ErrorCode::NotCoordinator;
                        e.message = format!(
                            "broker {me} does not coordinate transactional id '{id}': {}",
                            e.message
                        );
                    }
                    e
                })?;
        self.load(partition, local, epoch).await?;
        Ok((partition, epoch))
    }

    /// Loads the states of partition `partition` unless loaded for `epoch` already.
    async fn load(
        &self,
        partition: u32,
        local: Arc<LocalPartition>,
        epoch: LeaderEpoch,
    ) -> Result<(), BrokerError> {
        if self.inner.lock().await.loaded.get(&partition) == Some(&epoch) {
            return Ok(());
        }
        let loaded = tokio::task::spawn_blocking(move || replay(&local))
            .await
            .map_err(|e| error(ErrorCode::UnknownServerError, format!("load task: {e}")))??;
        let count = self
            .node
            .metadata()
            .topic(TXN_TOPIC)
            .map_or(1, |t| t.partitions.len() as u32);
        let mut inner = self.inner.lock().await;
        if inner.loaded.get(&partition) == Some(&epoch) {
            return Ok(());
        }
        inner
            .txns
            .retain(|id, _| partition_for(id, count) != partition);
        let n = loaded.len();
        let pending = loaded.values().filter(|m| m.state.is_prepare()).count();
        inner.txns.extend(loaded);
        inner.loaded.insert(partition, epoch);
        tracing::info!(partition, %epoch, ids = n, completing = pending, "loaded transaction states");
        Ok(())
    }

    /// Marks `id` busy, or answers CONCURRENT_TRANSACTIONS; returns its state.
    async fn take(&self, id: &str) -> Result<(Busy<'_>, Option<TxnMeta>), BrokerError> {
        if !self.busy.lock().insert(id.to_owned()) {
            return Err(error(
                ErrorCode::ConcurrentTransactions,
                format!("transactional id '{id}' has a change in flight; retry"),
            ));
        }
        let busy = Busy {
            coordinator: self,
            id: id.to_owned(),
        };
        let current = self.inner.lock().await.txns.get(id).cloned();
        Ok((busy, current))
    }

    /// Appends `meta` as `id`'s state (acks=all), then takes it in memory.
    async fn store(&self, partition: u32, id: &str, meta: &TxnMeta) -> Result<(), BrokerError> {
        let value = serde_json::to_vec(meta).expect("serializable");
        let mut b = BatchBuilder::new(Compression::None);
        b.push(RecordRef {
            timestamp: now_ms(),
            key: Some(id.as_bytes()),
            value: Some(&value),
            headers: &[],
        });
        let batch = b.build(0).expect("one record");
        self.node
            .produce(
                TXN_TOPIC,
                partition,
                batch,
                Acks::All,
                self.settings.write_timeout,
            )
            .await?;
        self.inner
            .lock()
            .await
            .txns
            .insert(id.to_owned(), meta.clone());
        Ok(())
    }

    /// A producer id and a new epoch for `id`; an open transaction of an older instance
    /// is aborted first (at a bumped epoch, fencing it).
    pub async fn init_producer_id(
        &self,
        id: &str,
        timeout_ms: u32,
    ) -> Result<(i64, i16), BrokerError> {
        let timeout_ms = if timeout_ms == 0 {
            self.settings.timeout_default_ms
        } else {
            timeout_ms
        };
        if timeout_ms > self.settings.timeout_max_ms {
            return Err(error(
                ErrorCode::InvalidTransactionTimeout,
                format!(
                    "transaction_timeout_ms {timeout_ms} is above transaction_max_timeout_ms {}",
                    self.settings.timeout_max_ms
                ),
            ));
        }
        let (partition, coordinator_epoch) = self.own(id).await?;
        let (busy, current) = self.take(id).await?;
        let now = now_ms();
        let mut decision = state::init(current.as_ref(), timeout_ms, now)?;
        if let InitDecision::FenceAndAbort(prepare) = decision {
            // The old instance's transaction ends before the new one starts.
            tracing::info!(
                transactional_id = id,
                producer_id = prepare.producer_id,
                epoch = prepare.producer_epoch,
                "fencing a producer: aborting its open transaction"
            );
            self.store(partition, id, &prepare).await?;
            self.complete(partition, id, &prepare, coordinator_epoch)
                .await?;
            let completed = state::complete(&prepare, now_ms());
            decision = state::init(Some(&completed), timeout_ms, now_ms())?;
        }
        let meta = match decision {
            InitDecision::Ready(Some(meta)) => meta,
            InitDecision::Ready(None) => {
                let pid = self
                    .node
                    .producer_ids()
                    .next(Duration::from_secs(5))
                    .await?;
                state::fresh(pid, timeout_ms, now)
            }
            InitDecision::FenceAndAbort(_) => unreachable!("completed above"),
        };
        self.store(partition, id, &meta).await?;
        drop(busy);
        Ok((meta.producer_id, meta.producer_epoch))
    }

    /// Adds `partitions` to `id`'s transaction (opening it).
    pub async fn add_partitions(
        &self,
        id: &str,
        producer_id: i64,
        producer_epoch: i16,
        partitions: BTreeSet<TxnPartition>,
    ) -> Result<(), BrokerError> {
        for (topic, p) in &partitions {
            if topic.starts_with("__") {
                return Err(error(
                    ErrorCode::InvalidRequest,
                    format!("{topic}-{p}: internal topics cannot be written in a transaction"),
                ));
            }
            if self.node.metadata().partition(topic, *p).is_none() {
                return Err(error(
                    ErrorCode::UnknownTopicOrPartition,
                    format!("{topic}-{p} does not exist; nothing was added to the transaction"),
                ));
            }
        }
        self.add(id, producer_id, producer_epoch, partitions).await
    }

    /// Adds consumer group `group`'s offsets partition to `id`'s transaction (Kafka's
    /// AddOffsetsToTxn), so the group coordinator may commit offsets inside it and the
    /// transaction's marker settles them.
    pub async fn add_offsets(
        &self,
        id: &str,
        producer_id: i64,
        producer_epoch: i16,
        group: &str,
    ) -> Result<(), BrokerError> {
        if group.is_empty() || group.len() > 255 {
            return Err(error(
                ErrorCode::InvalidRequest,
                format!("group must be 1 to 255 bytes, got {}", group.len()),
            ));
        }
        let count = self
            .node
            .metadata()
            .topic(OFFSETS_TOPIC)
            .map(|t| t.partitions.len() as u32)
            .ok_or_else(|| {
                error(
                    ErrorCode::NotCoordinator,
                    format!(
                        "{OFFSETS_TOPIC} does not exist yet; find the group's coordinator first"
                    ),
                )
            })?;
        let partition = (
            OFFSETS_TOPIC.to_owned(),
            offsets::partition_for(group, count),
        );
        self.add(id, producer_id, producer_epoch, BTreeSet::from([partition]))
            .await
    }

    async fn add(
        &self,
        id: &str,
        producer_id: i64,
        producer_epoch: i16,
        partitions: BTreeSet<TxnPartition>,
    ) -> Result<(), BrokerError> {
        let (partition, _) = self.own(id).await?;
        let (busy, current) = self.take(id).await?;
        let current = current.ok_or_else(|| not_found(id))?;
        if let Some(next) = state::add_partitions(
            id,
            &current,
            producer_id,
            producer_epoch,
            &partitions,
            now_ms(),
        )? {
            self.store(partition, id, &next).await?;
        }
        drop(busy);
        Ok(())
    }

    /// Ok when `topic`-`partition` is in `id`'s open transaction of `producer_id` at
    /// `producer_epoch` (a partition leader asks before a producer's first transactional
    /// batch there).
    pub async fn verify(
        &self,
        id: &str,
        producer_id: i64,
        producer_epoch: i16,
        topic: &str,
        partition: u32,
    ) -> Result<(), BrokerError> {
        self.own(id).await?;
        let current = self.inner.lock().await.txns.get(id).cloned();
        let m = current.ok_or_else(|| not_found(id))?;
        state::check_producer(id, &m, producer_id, producer_epoch)?;
        if m.state != TxnState::Ongoing || !m.partitions.contains(&(topic.to_owned(), partition)) {
            return Err(error(
                ErrorCode::InvalidTxnState,
                format!(
                    "{topic}-{partition} is not in an open transaction of '{id}' ({}): add the partition to the transaction before writing to it",
                    m.state.name()
                ),
            ));
        }
        Ok(())
    }

    /// Commits or aborts `id`'s transaction. Answers once the decision is durable and,
    /// unless a partition's leader is unreachable, its markers are written (else the
    /// coordinator keeps trying; the producer's next transaction waits for it).
    pub async fn end_txn(
        &self,
        id: &str,
        producer_id: i64,
        producer_epoch: i16,
        commit: bool,
    ) -> Result<(), BrokerError> {
        self.end_txn_started(id, producer_id, producer_epoch, commit, None)
            .await
    }

    /// [`TxnCoordinator::end_txn`]; with `started`, only if the open transaction is the
    /// one that started then (a check's verdict never ends a newer transaction).
    async fn end_txn_started(
        &self,
        id: &str,
        producer_id: i64,
        producer_epoch: i16,
        commit: bool,
        started: Option<i64>,
    ) -> Result<(), BrokerError> {
        let (partition, coordinator_epoch) = self.own(id).await?;
        let (busy, current) = self.take(id).await?;
        let current = current.ok_or_else(|| not_found(id))?;
        if let Some(started) = started {
            if current.state != TxnState::Ongoing || current.started_ms != started {
                return Err(error(
                    ErrorCode::InvalidTxnState,
                    format!("transactional id '{id}': the transaction that began at {started} ms is no longer open"),
                ));
            }
        }
        let prepare = match state::end(id, &current, producer_id, producer_epoch, commit, now_ms())?
        {
            EndDecision::Done => return Ok(()),
            EndDecision::Prepare(p) => p,
        };
        self.store(partition, id, &prepare).await?;
        if let Err(e) = self
            .complete(partition, id, &prepare, coordinator_epoch)
            .await
        {
            tracing::warn!(transactional_id = id, error = %e, "markers not written yet; the coordinator retries");
        }
        drop(busy);
        Ok(())
    }

    /// Writes the markers of a `Prepare*` state, then its `Complete*` state.
    async fn complete(
        &self,
        partition: u32,
        id: &str,
        prepare: &TxnMeta,
        coordinator_epoch: LeaderEpoch,
    ) -> Result<(), BrokerError> {
        let marker = ControlMarker {
            commit: prepare.state == TxnState::PrepareCommit,
            coordinator_epoch: coordinator_epoch.0,
        };
        let mut by_leader: BTreeMap<BrokerId, Vec<TxnPartition>> = BTreeMap::new();
        for (topic, p) in &prepare.partitions {
            match self.node.metadata().partition(topic, *p) {
                // Deleted since: nothing left to mark.
                None => continue,
                Some((_, state)) => {
                    let leader = state.leader.ok_or_else(|| {
                        error(
                            ErrorCode::NotLeaderOrFollower,
                            format!("{topic}-{p} has no leader right now"),
                        )
                    })?;
                    by_leader
                        .entry(leader)
                        .or_default()
                        .push((topic.clone(), *p));
                }
            }
        }
        let me = self.node.id();
        let writes = by_leader.into_iter().map(|(leader, parts)| {
            let (pid, epoch) = (prepare.producer_id, prepare.producer_epoch);
            async move {
                let results = if leader == me {
                    let local = parts.iter().map(|(t, p)| {
                        self.node
                            .write_marker(t, *p, pid, epoch, marker, self.settings.write_timeout)
                    });
                    futures_util::future::join_all(local).await
                } else {
                    self.peers
                        .write_markers(leader, pid, epoch, marker, parts.clone())
                        .await?
                };
                for ((t, p), r) in parts.iter().zip(results) {
                    match r {
                        Ok(()) => {}
                        // The partition saw a newer epoch or coordinator: this transaction
                        // was completed there already (a newer instance cannot start
                        // before it is), or the topic is gone.
                        Err(e) if matches!(
                            e.code,
                            ErrorCode::InvalidProducerEpoch
                                | ErrorCode::TransactionCoordinatorFenced
                                | ErrorCode::UnknownTopicOrPartition
                        ) =>
                        {
                            tracing::debug!(topic = %t, partition = p, error = %e, "marker not needed");
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok::<(), BrokerError>(())
            }
        });
        for r in futures_util::future::join_all(writes).await {
            r?;
        }
        let done = state::complete(prepare, now_ms());
        self.store(partition, id, &done).await?;
        metrics::counter!(
            "tidelog_transactions_completed_total",
            "result" => if marker.commit { "commit" } else { "abort" }
        )
        .increment(1);
        Ok(())
    }

    /// One housekeeping pass: loads the state partitions this broker leads, completes
    /// transactions left in `Prepare*` (after a failover or a failed marker write),
    /// aborts those past their timeout (fencing their producer), forgets idle ids.
    pub async fn tick(&self) {
        let me = self.node.id();
        let led: Vec<u32> = self
            .node
            .metadata()
            .topic(TXN_TOPIC)
            .map_or_else(Vec::new, |t| {
                t.partitions
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.leader == Some(me))
                    .map(|(i, _)| i as u32)
                    .collect()
            });
        for partition in &led {
            if let Ok((local, epoch)) = self.node.leader_partition(TXN_TOPIC, *partition) {
                if let Err(e) = self.load(*partition, local, epoch).await {
                    tracing::debug!(partition, error = %e, "loading transaction states");
                }
            }
        }
        let now = now_ms();
        let expire_ms = self.settings.id_expiration.as_millis() as i64;
        let work: Vec<(String, TxnMeta)> = {
            let mut inner = self.inner.lock().await;
            // Partitions led no more: forget them (a later leadership reloads).
            let count = self
                .node
                .metadata()
                .topic(TXN_TOPIC)
                .map_or(1, |t| t.partitions.len() as u32);
            inner.loaded.retain(|p, _| led.contains(p));
            let loaded: HashSet<u32> = inner.loaded.keys().copied().collect();
            inner.txns.retain(|id, m| {
                loaded.contains(&partition_for(id, count))
                    && (m.state == TxnState::Ongoing
                        || m.state.is_prepare()
                        || now.saturating_sub(m.updated_ms) < expire_ms)
            });
            // A transaction whose producer answers checks is ended by the checks (at most
            // check_max intervals), not by its timeout: the producer is alive.
            let checked: HashSet<String> = self
                .checkers
                .lock()
                .iter()
                .filter(|(id, c)| {
                    inner.txns.get(*id).is_some_and(|m| {
                        m.producer_id == c.producer_id && m.producer_epoch == c.epoch
                    })
                })
                .map(|(id, _)| id.clone())
                .collect();
            inner
                .txns
                .iter()
                .filter(|(id, m)| {
                    m.state.is_prepare() || (state::timed_out(m, now) && !checked.contains(*id))
                })
                .map(|(id, m)| (id.clone(), m.clone()))
                .collect()
        };
        for (id, m) in work {
            if let Err(e) = self.finish(&id, m).await {
                tracing::debug!(transactional_id = %id, error = %e, "completing a transaction");
            }
        }
        self.check_back(now).await;
    }

    /// Registers a live producer of `id` to answer checks of its open transactions;
    /// returns the session (for [`TxnCoordinator::unregister_checker`]) and the events
    /// to send it. A newer registration of the id replaces the older one.
    pub async fn register_checker(
        &self,
        id: &str,
        producer_id: i64,
        producer_epoch: i16,
    ) -> Result<(u64, tokio::sync::mpsc::Receiver<CheckEvent>), BrokerError> {
        self.own(id).await?;
        let current = self.inner.lock().await.txns.get(id).cloned();
        let m = current.ok_or_else(|| not_found(id))?;
        state::check_producer(id, &m, producer_id, producer_epoch)?;
        let session = self
            .next_session
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (events, receiver) = tokio::sync::mpsc::channel(CHECK_QUEUE);
        self.checkers.lock().insert(
            id.to_owned(),
            Checker {
                producer_id,
                epoch: producer_epoch,
                session,
                events,
            },
        );
        tracing::debug!(
            transactional_id = id,
            producer_id,
            "transaction checker registered"
        );
        Ok((session, receiver))
    }

    /// Forgets the checker of `id` registered as `session` (its stream ended).
    pub fn unregister_checker(&self, id: &str, session: u64) {
        let mut checkers = self.checkers.lock();
        if checkers.get(id).is_some_and(|c| c.session == session) {
            checkers.remove(id);
        }
    }

    /// A producer's verdict on the transaction of `id` started at `started_ms`: commit or
    /// abort it (a verdict on a transaction that is no longer open is ignored).
    pub async fn answer_check(
        &self,
        id: &str,
        producer_id: i64,
        producer_epoch: i16,
        started_ms: i64,
        verdict: CheckVerdict,
    ) -> Result<(), BrokerError> {
        let commit = match verdict {
            CheckVerdict::Commit => true,
            CheckVerdict::Rollback => false,
            CheckVerdict::Unknown => return Ok(()),
        };
        self.end_checked(
            id,
            producer_id,
            producer_epoch,
            started_ms,
            commit,
            "the producer's verdict",
        )
        .await
    }

    /// Ends a checked transaction if it is still the open one, then tells the checker.
    async fn end_checked(
        &self,
        id: &str,
        producer_id: i64,
        producer_epoch: i16,
        started_ms: i64,
        commit: bool,
        why: &str,
    ) -> Result<(), BrokerError> {
        let deadline = tokio::time::Instant::now() + self.settings.write_timeout;
        loop {
            let open = self.inner.lock().await.txns.get(id).is_some_and(|m| {
                m.state == TxnState::Ongoing
                    && m.started_ms == started_ms
                    && m.producer_id == producer_id
                    && m.producer_epoch == producer_epoch
            });
            if !open {
                return Ok(());
            }
            match self
                .end_txn_started(id, producer_id, producer_epoch, commit, Some(started_ms))
                .await
            {
                // Another change of the id is in flight: wait for it, then look again.
                Err(e)
                    if e.code == ErrorCode::ConcurrentTransactions
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e),
                Ok(()) => break,
            }
        }
        tracing::info!(
            transactional_id = id,
            producer_id,
            commit,
            why,
            "a checked transaction ended"
        );
        self.checks.lock().remove(id);
        let checker = self.checkers.lock().get(id).map(|c| c.events.clone());
        if let Some(events) = checker {
            let _ = events.try_send(CheckEvent::Ended {
                started_ms,
                committed: commit,
            });
        }
        Ok(())
    }

    /// Checks back open transactions whose producers registered checkers: one check per
    /// `check_interval` of age; after `check_max` checks without a verdict, an abort.
    async fn check_back(&self, now: i64) {
        let interval_ms = self.settings.check_interval.as_millis() as i64;
        let open: Vec<(String, TxnMeta)> = {
            let inner = self.inner.lock().await;
            let mut checkers = self.checkers.lock();
            // A checker of an older epoch or producer was fenced: end its stream.
            // Not loaded here any more (the coordinator moved), or forgotten: end its
            // stream too, so the producer registers at the new coordinator.
            checkers.retain(|id, c| {
                inner
                    .txns
                    .get(id)
                    .is_some_and(|m| m.producer_id == c.producer_id && m.producer_epoch == c.epoch)
            });
            inner
                .txns
                .iter()
                .filter(|(id, m)| {
                    m.state == TxnState::Ongoing && m.started_ms >= 0 && checkers.contains_key(*id)
                })
                .map(|(id, m)| (id.clone(), m.clone()))
                .collect()
        };
        for (id, m) in open {
            let sent = {
                let mut checks = self.checks.lock();
                let entry = checks.entry(id.clone()).or_insert(ChecksSent {
                    started_ms: m.started_ms,
                    sent: 0,
                });
                if entry.started_ms != m.started_ms {
                    *entry = ChecksSent {
                        started_ms: m.started_ms,
                        sent: 0,
                    };
                }
                entry.sent
            };
            let due = m.started_ms + interval_ms * (i64::from(sent) + 1);
            if now < due {
                continue;
            }
            if sent >= self.settings.check_max {
                let why = format!("{sent} checks without a verdict");
                if let Err(e) = self
                    .end_checked(
                        &id,
                        m.producer_id,
                        m.producer_epoch,
                        m.started_ms,
                        false,
                        &why,
                    )
                    .await
                {
                    tracing::debug!(transactional_id = %id, error = %e, "aborting an unanswered transaction");
                }
                continue;
            }
            let events = self.checkers.lock().get(&id).map(|c| c.events.clone());
            let Some(events) = events else { continue };
            let check = CheckEvent::Check {
                started_ms: m.started_ms,
                partitions: m.partitions.iter().cloned().collect(),
                attempt: sent + 1,
            };
            // A full queue (a producer not reading) counts as a check without a verdict.
            let _ = events.try_send(check);
            if let Some(c) = self.checks.lock().get_mut(&id) {
                c.sent += 1;
            }
            metrics::counter!("tidelog_transaction_checks_total").increment(1);
        }
        // Forget counts of transactions that are no longer open.
        let inner = self.inner.lock().await;
        self.checks.lock().retain(|id, c| {
            inner
                .txns
                .get(id)
                .is_some_and(|m| m.state == TxnState::Ongoing && m.started_ms == c.started_ms)
        });
    }

    /// Completes `m` (a `Prepare*` state), or aborts it when it timed out.
    async fn finish(&self, id: &str, m: TxnMeta) -> Result<(), BrokerError> {
        let (partition, coordinator_epoch) = self.own(id).await?;
        let (busy, current) = self.take(id).await?;
        // It may have moved on while the pass was planned.
        if current.as_ref() != Some(&m) {
            return Ok(());
        }
        let prepare = if m.state.is_prepare() {
            m
        } else {
            tracing::info!(
                transactional_id = id,
                producer_id = m.producer_id,
                timeout_ms = m.timeout_ms,
                "aborting a transaction past its timeout"
            );
            let p = state::prepare(
                &m,
                false,
                (m.producer_epoch + 1).min(state::EPOCH_MAX),
                now_ms(),
            );
            self.store(partition, id, &p).await?;
            p
        };
        self.complete(partition, id, &prepare, coordinator_epoch)
            .await?;
        drop(busy);
        Ok(())
    }

    /// Runs [`TxnCoordinator::tick`] every `interval` until `cancel`.
    pub async fn run(self: Arc<Self>, interval: Duration, cancel: CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
            self.tick().await;
        }
    }

    /// The states of `ids` this broker coordinates (an id it does not: NOT_COORDINATOR;
    /// unknown: TRANSACTIONAL_ID_NOT_FOUND).
    pub async fn describe(&self, ids: &[String]) -> Vec<Result<TxnDescription, BrokerError>> {
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let r = match self.own(id).await {
                Err(e) => Err(e),
                Ok(_) => self
                    .inner
                    .lock()
                    .await
                    .txns
                    .get(id)
                    .map(|m| TxnDescription {
                        id: id.clone(),
                        meta: m.clone(),
                    })
                    .ok_or_else(|| not_found(id)),
            };
            out.push(r);
        }
        out
    }

    /// Every id this broker coordinates (in `states`, when not empty), by id.
    pub async fn list(&self, states: &[TxnState]) -> Vec<TxnDescription> {
        self.tick_loads().await;
        let inner = self.inner.lock().await;
        let mut out: Vec<TxnDescription> = inner
            .txns
            .iter()
            .filter(|(_, m)| states.is_empty() || states.contains(&m.state))
            .map(|(id, m)| TxnDescription {
                id: id.clone(),
                meta: m.clone(),
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Loads every state partition this broker leads (so `list` is complete).
    async fn tick_loads(&self) {
        let me = self.node.id();
        let Some(t) = self.node.metadata().topic(TXN_TOPIC) else {
            return;
        };
        for (i, p) in t.partitions.iter().enumerate() {
            if p.leader != Some(me) {
                continue;
            }
            if let Ok((local, epoch)) = self.node.leader_partition(TXN_TOPIC, i as u32) {
                let _ = self.load(i as u32, local, epoch).await;
            }
        }
    }
}

fn not_found(id: &str) -> BrokerError {
    error(
        ErrorCode::TransactionalIdNotFound,
        format!("transactional id '{id}' is unknown: call InitProducerId first"),
    )
}

fn check_id(id: &str) -> Result<(), BrokerError> {
    if id.is_empty() || id.len() > TRANSACTIONAL_ID_MAX {
        return Err(error(
            ErrorCode::InvalidRequest,
            format!(
                "transactional_id must be 1 to {TRANSACTIONAL_ID_MAX} bytes, got {}",
                id.len()
            ),
        ));
    }
    Ok(())
}

/// The last state of every id in a state partition's log.
fn replay(local: &LocalPartition) -> Result<HashMap<String, TxnMeta>, BrokerError> {
    let mut out = HashMap::new();
    local.replay_records(|r| {
        let Some(id) = r.key.as_deref().and_then(|k| std::str::from_utf8(k).ok()) else {
            return;
        };
        match r.value.as_deref().map(serde_json::from_slice::<TxnMeta>) {
            Some(Ok(m)) => {
                out.insert(id.to_owned(), m);
            }
            None => {
                out.remove(id);
            }
            Some(Err(e)) => {
                tracing::warn!(partition = %local.name(), offset = r.offset, error = %e, "skipping an undecodable transaction state");
            }
        }
    })?;
    Ok(out)
}
