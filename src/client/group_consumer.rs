//! The group consumer: subscribe to topics (or a pattern) as a member of a consumer group;
//! the group's coordinator assigns partitions (server-side), and the consumer reads them
//! from their committed offsets.
//!
//! A background task heartbeats to the coordinator and keeps the latest assignment; each
//! `poll` first reconciles with it: partitions taken away are committed (with auto commit)
//! and released, new ones start at their committed offset (or per `auto_offset_reset`).
//! The next heartbeat reports what the consumer holds, which is what lets the coordinator
//! hand released partitions to other members: no two members read a partition at once.
//! Delivery is at least once: records returned by `poll` count as consumed when the
//! positions are committed (automatically every `auto_commit_interval`, on revocation
//! and at `close`, or by `commit_sync` / `commit_async`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;
use tonic::transport::Channel;

use super::connection::Connection;
use super::consumer::{Consumer, ConsumerFilter, ConsumerRecord, StartAt};
use super::error::ClientError;
use super::retry::{self, NackOutcome, Retrier, RetryPolicy};
use crate::api::proto::groups_client::GroupsClient;
use crate::api::proto::{
    CommittedOffset, FindCoordinatorRequest, GroupHeartbeatRequest, OffsetCommitRequest,
    OffsetFetchRequest, TopicPartitions,
};
use crate::error_code::ErrorCode;

/// A topic partition.
pub type TopicPartition = (String, u32);

/// Where to start a partition without a committed offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffsetReset {
    /// The log start.
    Earliest,
    /// The end: only new records.
    Latest,
    /// Fail the poll.
    None,
}

/// Group consumer settings (Kafka's names in snake case).
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// The group.
    pub group: String,
    /// Topics to subscribe to.
    pub topics: Vec<String>,
    /// A pattern: topics whose whole name matches are subscribed too.
    pub topic_regex: Option<String>,
    /// range, round-robin, sticky, consistent-hash or rack-aware.
    pub strategy: String,
    /// Every member reads every partition; offsets are kept per `instance_id`.
    pub broadcast: bool,
    /// A stable name for this member (needed to resume broadcast offsets).
    pub instance_id: String,
    /// A name shown in `groups describe`.
    pub client_id: String,
    /// The coordinator drops the member after this long without a heartbeat.
    pub session_timeout: Duration,
    /// Commit positions automatically.
    pub auto_commit: bool,
    /// How often auto commit runs.
    pub auto_commit_interval: Duration,
    /// Start of partitions without a committed offset.
    pub auto_offset_reset: OffsetReset,
    /// This member's rack (Kafka's `client.rack`): the rack-aware strategy gives it the
    /// partitions with a replica in this rack first, and fetches go to an in-sync
    /// replica in this rack when the leader is in another (KIP-392).
    pub rack: Option<String>,
    /// The group's retry policy, written to its retry topic when the member starts
    /// (None: keep what the group has, defaults for a new one). Broadcast groups do not
    /// retry.
    pub retry_policy: Option<RetryPolicy>,
    /// Kafka's `isolation.level=read_committed`: read only committed records (see
    /// [`Consumer::set_read_committed`]); the member tells the coordinator, so the group's
    /// lag is measured against the last stable offset.
    pub read_committed: bool,
}

impl Default for GroupConfig {
    fn default() -> Self {
        Self {
            group: String::new(),
            topics: Vec::new(),
            topic_regex: None,
            strategy: "range".into(),
            broadcast: false,
            instance_id: String::new(),
            client_id: "tidelog".into(),
            session_timeout: Duration::from_secs(45),
            auto_commit: true,
            auto_commit_interval: Duration::from_secs(5),
            auto_offset_reset: OffsetReset::Latest,
            rack: None,
            retry_policy: None,
            read_committed: false,
        }
    }
}

/// A group member as a transactional producer names it when committing the member's
/// positions inside its transaction (Kafka's `ConsumerGroupMetadata`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupMetadata {
    /// The group.
    pub group: String,
    /// The member id (empty: not a member yet).
    pub member_id: String,
    /// The member epoch.
    pub member_epoch: i32,
}

/// How long a member waits for offsets committed inside a transaction to settle (the
/// transaction commits, aborts, or times out) before its fetch of them fails.
const UNSTABLE_WAIT_MAX: Duration = Duration::from_secs(120);

#[derive(Debug, Default)]
struct Membership {
    member_id: String,
    epoch: i32,
    /// The latest assignment from the coordinator.
    target: BTreeSet<TopicPartition>,
    /// What the consumer side holds (reported in heartbeats).
    owned: BTreeSet<TopicPartition>,
    /// The coordinator dropped this member (session expired, or fenced): `owned` is no
    /// longer ours, and is released without a commit at the next reconciliation.
    lost: bool,
    /// The coordinator's address, once found.
    coordinator: Option<String>,
    /// A fatal error for the next poll.
    failed: Option<ClientError>,
    leaving: bool,
}

struct Shared {
    config: GroupConfig,
    /// The topics the member asks for: the configured ones and the group's retry topic.
    subscription: Vec<String>,
    /// The group's retry topic and its nacks (None for broadcast groups: they do not
    /// retry).
    retry_topic: Option<String>,
    retrier: Option<Arc<Retrier>>,
    connection: Connection,
    membership: Mutex<Membership>,
    wake: Notify,
    /// Held by a heartbeat for its whole round trip and by a reconciliation: a heartbeat
    /// never reports a holding that a reconciliation is about to change.
    exchange: tokio::sync::Mutex<()>,
    /// Reads committed records only (told to the coordinator in heartbeats).
    read_committed: AtomicBool,
}

impl Shared {
    async fn coordinator(&self) -> Result<GroupsClient<Channel>, ClientError> {
        let known = self.membership.lock().coordinator.clone();
        let address = match known {
            Some(a) => a,
            None => {
                let group = self.config.group.clone();
                let r = self
                    .connection
                    .call("find coordinator", |c| {
                        let group = group.clone();
                        async move {
                            GroupsClient::new(c)
                                .find_coordinator(FindCoordinatorRequest { group })
                                .await
                        }
                    })
                    .await?;
                self.membership.lock().coordinator = Some(r.address.clone());
                r.address
            }
        };
        Ok(GroupsClient::new(self.connection.channel(&address)?))
    }

    fn forget_coordinator(&self) {
        self.membership.lock().coordinator = None;
    }

    /// One heartbeat; returns how long to wait before the next.
    async fn heartbeat(&self) -> Duration {
        let _exchange = self.exchange.lock().await;
        let (member_id, epoch, owned, leaving) = {
            let m = self.membership.lock();
            let owned = if m.lost {
                BTreeSet::new()
            } else {
                m.owned.clone()
            };
            (m.member_id.clone(), m.epoch, owned, m.leaving)
        };
        let request = GroupHeartbeatRequest {
            group: self.config.group.clone(),
            member_id: member_id.clone(),
            member_epoch: if leaving { -1 } else { epoch },
            instance_id: self.config.instance_id.clone(),
            client_id: self.config.client_id.clone(),
            topics: self.subscription.clone(),
            topic_regex: self.config.topic_regex.clone().unwrap_or_default(),
            strategy: self.config.strategy.clone(),
            broadcast: self.config.broadcast,
            session_timeout_ms: self.config.session_timeout.as_millis() as u32,
            owned: to_list(&owned),
            rack: self.config.rack.clone().unwrap_or_default(),
            read_committed: self.read_committed.load(Ordering::Relaxed),
        };
        let outcome = async {
            let mut client = self.coordinator().await?;
            tokio::time::timeout(Duration::from_secs(10), client.group_heartbeat(request))
                .await
                .map_err(|_| ClientError::new(ErrorCode::RequestTimedOut, "heartbeat timed out"))?
                .map_err(ClientError::from)
        }
        .await;
        let backoff = Duration::from_millis(200);
        match outcome {
            Ok(r) => {
                let r = r.into_inner();
                let mut m = self.membership.lock();
                if leaving {
                    return Duration::from_secs(3600);
                }
                m.member_id = r.member_id;
                m.epoch = r.member_epoch;
                m.target = to_set(&r.assignment);
                Duration::from_millis(u64::from(r.heartbeat_interval_ms.max(50)))
            }
            Err(e)
                if matches!(
                    e.code,
                    ErrorCode::UnknownMemberId | ErrorCode::FencedMemberEpoch
                ) =>
            {
                tracing::info!(group = %self.config.group, error = %e, "rejoining the group");
                let mut m = self.membership.lock();
                m.member_id.clear();
                m.epoch = 0;
                m.target.clear();
                m.lost = !m.owned.is_empty();
                Duration::ZERO
            }
            Err(e) if e.is_retriable() || e.code == ErrorCode::NotCoordinator => {
                tracing::debug!(group = %self.config.group, error = %e, "heartbeat failed; finding the coordinator again");
                self.forget_coordinator();
                backoff
            }
            Err(e) => {
                self.membership.lock().failed = Some(e);
                backoff * 5
            }
        }
    }
}

fn to_list(set: &BTreeSet<TopicPartition>) -> Vec<TopicPartitions> {
    let mut by_topic: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (t, p) in set {
        by_topic.entry(t).or_default().push(*p);
    }
    by_topic
        .into_iter()
        .map(|(topic, partitions)| TopicPartitions {
            topic: topic.to_owned(),
            partitions,
        })
        .collect()
}

fn to_set(list: &[TopicPartitions]) -> BTreeSet<TopicPartition> {
    list.iter()
        .flat_map(|t| t.partitions.iter().map(|p| (t.topic.clone(), *p)))
        .collect()
}

/// What a layer above the group consumer (the push consumer's listener pool) says about
/// partitions: how far their records are done, and when they change hands.
pub trait PartitionHooks: Send + Sync {
    /// The first offset of `tp` whose record is not done yet (`None`: all handed-out
    /// records are): commits never pass it.
    fn commit_floor(&self, tp: &TopicPartition) -> Option<i64>;
    /// Runs before revoked partitions are committed and released (it may wait, bounded,
    /// for their records in progress).
    fn before_release<'a>(
        &'a self,
        partitions: &'a BTreeSet<TopicPartition>,
    ) -> futures_util::future::BoxFuture<'a, ()>;
    /// The partitions went with a lost membership: their work is not committed.
    fn lost(&self, partitions: &BTreeSet<TopicPartition>);
}

/// A member of a consumer group.
pub struct GroupConsumer {
    shared: Arc<Shared>,
    consumer: Consumer,
    /// Paused partitions and their positions.
    paused: BTreeMap<TopicPartition, i64>,
    last_commit: Instant,
    /// Positions as last committed.
    committed: BTreeMap<TopicPartition, i64>,
    /// How many times the partitions were lost with the membership.
    lost_count: u64,
    task: tokio::task::JoinHandle<()>,
    hooks: Option<Arc<dyn PartitionHooks>>,
    /// `config.retry_policy`, until the first poll writes it.
    policy_to_set: Option<RetryPolicy>,
}

impl GroupConsumer {
    /// Joins `config.group` through the cluster at `bootstrap`. Unless the group is a
    /// broadcast one, the member also reads the group's retry topic (see [`Self::nack`]).
    pub fn new(bootstrap: Vec<String>, config: GroupConfig) -> Self {
        let retry_topic = (!config.broadcast)
            .then(|| retry::retry_topic(&config.group).ok())
            .flatten();
        let mut subscription = config.topics.clone();
        subscription.extend(retry_topic.clone());
        let policy_to_set = config
            .retry_policy
            .clone()
            .filter(|_| retry_topic.is_some());
        let config_read_committed = config.read_committed;
        let shared = Arc::new(Shared {
            connection: Connection::new(bootstrap.clone(), Duration::from_secs(30)),
            subscription,
            retrier: retry_topic
                .is_some()
                .then(|| Arc::new(Retrier::new(bootstrap.clone(), &config.group))),
            retry_topic,
            config,
            membership: Mutex::new(Membership::default()),
            wake: Notify::new(),
            exchange: tokio::sync::Mutex::new(()),
            read_committed: AtomicBool::new(config_read_committed),
        });
        let task = {
            let shared = shared.clone();
            tokio::spawn(async move {
                loop {
                    let wait = shared.heartbeat().await;
                    tokio::select! {
                        _ = shared.wake.notified() => {}
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            })
        };
        let rack = shared.config.rack.clone();
        Self {
            shared,
            consumer: {
                let mut c = Consumer::new(bootstrap, Duration::from_secs(30));
                c.set_rack(rack);
                c.set_read_committed(config_read_committed);
                c
            },
            paused: BTreeMap::new(),
            last_commit: Instant::now(),
            committed: BTreeMap::new(),
            lost_count: 0,
            task,
            hooks: None,
            policy_to_set,
        }
    }

    /// The group's retry and dead-letter writer (None for broadcast groups), for tasks
    /// that nack on their own (the push consumer's listeners).
    pub fn retrier(&self) -> Option<Arc<Retrier>> {
        self.shared.retrier.clone()
    }

    /// Negatively acknowledges a record this member polled: a copy comes back to the
    /// group (through its retry topic) after the backoff of its redelivery number, or goes
    /// to the group's dead-letter topic once `max.reconsume.times` is used up. Returns
    /// once that copy is durable; the record itself counts as consumed (the partition's
    /// committed offset moves past it). `reason` is kept with a dead letter.
    /// INVALID_REQUEST for broadcast groups: as in RocketMQ, they do not retry.
    pub async fn nack(
        &self,
        record: &ConsumerRecord,
        reason: &str,
    ) -> Result<NackOutcome, ClientError> {
        match &self.shared.retrier {
            Some(r) => r.nack(record, reason).await,
            None => Err(ClientError::new(
                ErrorCode::InvalidRequest,
                if self.shared.config.broadcast {
                    format!(
                        "group '{}' is a broadcast group: broadcast groups do not retry, so a record cannot be nacked",
                        self.shared.config.group
                    )
                } else {
                    retry::retry_topic(&self.shared.config.group)
                        .err()
                        .map(|e| e.message)
                        .unwrap_or_default()
                },
            )),
        }
    }

    /// Receives records in push mode ([`Consumer::enable_push`]).
    pub fn enable_push(&mut self, settings: super::push_feed::PushSettings) {
        self.consumer.enable_push(settings);
    }

    /// Sets the hooks that hold commits back to work done and see partitions change
    /// hands ([`PartitionHooks`]).
    pub fn set_hooks(&mut self, hooks: Arc<dyn PartitionHooks>) {
        self.hooks = Some(hooks);
    }

    /// The partitions this member holds now.
    pub fn assignment(&self) -> BTreeSet<TopicPartition> {
        self.shared.membership.lock().owned.clone()
    }

    /// How many times this member lost its partitions with its membership (its session
    /// expired, or it was fenced). Each time, the records after the last commit are
    /// delivered again: a poll that sees this number grow starts over at the committed
    /// offsets.
    pub fn partitions_lost(&self) -> u64 {
        self.lost_count
    }

    /// The member id the coordinator gave (empty until the first answer).
    pub fn member_id(&self) -> String {
        self.shared.membership.lock().member_id.clone()
    }

    /// Takes in the coordinator's latest assignment: releases (after committing, with
    /// auto commit) what moved away, starts what is new at its committed offset.
    async fn reconcile(&mut self) -> Result<(), ClientError> {
        let shared = self.shared.clone();
        let _exchange = shared.exchange.lock().await;
        let (target, owned, failed, lost) = {
            let mut m = self.shared.membership.lock();
            let lost = std::mem::take(&mut m.lost).then(|| std::mem::take(&mut m.owned));
            (m.target.clone(), m.owned.clone(), m.failed.take(), lost)
        };
        if let Some(lost) = lost {
            // Another member may hold these already: committing our positions could move
            // its offsets back. Drop them; they restart from the committed offsets.
            tracing::info!(group = %self.shared.config.group, partitions = lost.len(), "partitions lost with the membership; released without a commit");
            self.lost_count += 1;
            if let Some(hooks) = &self.hooks {
                hooks.lost(&lost);
            }
            for tp in &lost {
                self.consumer.unassign(&tp.0, tp.1);
                self.paused.remove(tp);
                self.committed.remove(tp);
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if target == owned {
            return Ok(());
        }
        let revoked: BTreeSet<TopicPartition> = owned.difference(&target).cloned().collect();
        if !revoked.is_empty() {
            if let Some(hooks) = self.hooks.clone() {
                hooks.before_release(&revoked).await;
            }
            if self.shared.config.auto_commit {
                if let Err(e) = self.commit_partitions(&revoked).await {
                    tracing::warn!(error = %e, "commit of revoked partitions failed");
                }
            }
            for tp in &revoked {
                self.consumer.unassign(&tp.0, tp.1);
                self.paused.remove(tp);
            }
        }
        let added: BTreeSet<TopicPartition> = target.difference(&owned).cloned().collect();
        if !added.is_empty() {
            let committed = self.fetch_committed(&added).await?;
            for tp in &added {
                let is_retry_topic = self.shared.retry_topic.as_ref() == Some(&tp.0);
                let start = match committed.get(tp) {
                    Some(&o) => StartAt::Offset(o),
                    // Retries scheduled before the member first held the partition are
                    // the group's: read them all.
                    None if is_retry_topic => StartAt::Earliest,
                    None => match self.shared.config.auto_offset_reset {
                        OffsetReset::Earliest => StartAt::Earliest,
                        OffsetReset::Latest => StartAt::Latest,
                        OffsetReset::None => {
                            return Err(ClientError::new(
                                ErrorCode::OffsetOutOfRange,
                                format!(
                                    "{}-{}: no committed offset for group '{}' and auto_offset_reset is none",
                                    tp.0, tp.1, self.shared.config.group
                                ),
                            ))
                        }
                    },
                };
                self.consumer.assign(&tp.0, tp.1, start).await?;
                if let Some(&o) = committed.get(tp) {
                    self.committed.insert(tp.clone(), o);
                }
            }
        }
        let now_owned: BTreeSet<TopicPartition> =
            owned.difference(&revoked).cloned().chain(added).collect();
        self.shared.membership.lock().owned = now_owned;
        // Tell the coordinator at once, so released partitions move on quickly.
        self.shared.wake.notify_one();
        Ok(())
    }

    async fn fetch_committed(
        &self,
        partitions: &BTreeSet<TopicPartition>,
    ) -> Result<BTreeMap<TopicPartition, i64>, ClientError> {
        let request = OffsetFetchRequest {
            group: self.shared.config.group.clone(),
            instance_id: if self.shared.config.broadcast {
                self.instance_key()
            } else {
                String::new()
            },
            partitions: to_list(partitions),
            // Offsets pending in an open transaction answer UNSTABLE_OFFSET_COMMIT: wait
            // for the settled ones, so a pipeline taking over never re-reads or skips.
            require_stable: true,
        };
        let unstable_until = Instant::now() + UNSTABLE_WAIT_MAX;
        let mut attempts = 0;
        while attempts < 50 {
            let result = async {
                let mut client = self.shared.coordinator().await?;
                client
                    .offset_fetch(request.clone())
                    .await
                    .map_err(ClientError::from)
            }
            .await;
            match result {
                Ok(r) => {
                    return Ok(r
                        .into_inner()
                        .offsets
                        .into_iter()
                        .map(|o| ((o.topic, o.partition), o.offset))
                        .collect())
                }
                Err(e)
                    if e.code == ErrorCode::UnstableOffsetCommit
                        && Instant::now() < unstable_until =>
                {
                    tracing::debug!(error = %e, "waiting for a transaction's offsets to settle");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) if e.is_retriable() => {
                    attempts += 1;
                    self.shared.forget_coordinator();
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e),
            }
        }
        Err(ClientError::new(
            ErrorCode::RequestTimedOut,
            "could not fetch committed offsets",
        ))
    }

    fn instance_key(&self) -> String {
        let m = self.shared.membership.lock();
        if self.shared.config.instance_id.is_empty() {
            m.member_id.clone()
        } else {
            self.shared.config.instance_id.clone()
        }
    }

    /// Fetches only records that pass `filter` ([`Consumer::set_filter`]); committed
    /// offsets move past the records it skips, so the group's lag reaches 0.
    pub fn set_filter(&mut self, filter: Option<ConsumerFilter>) -> Result<(), ClientError> {
        self.consumer.set_filter(filter)
    }

    /// Kafka's `isolation.level` ([`Consumer::set_read_committed`]); the next heartbeat
    /// tells the coordinator ([`GroupConfig::read_committed`]).
    pub fn set_read_committed(&mut self, on: bool) {
        self.shared.read_committed.store(on, Ordering::Relaxed);
        self.shared.wake.notify_one();
        self.consumer.set_read_committed(on);
    }

    /// Reads the next records of the assigned partitions, waiting up to `max_wait`.
    pub async fn poll(&mut self, max_wait: Duration) -> Result<Vec<ConsumerRecord>, ClientError> {
        if let (Some(policy), Some(retrier)) = (&self.policy_to_set, &self.shared.retrier) {
            // A retry topic made here gets as many partitions as the first topic.
            let partitions = match self.shared.config.topics.first() {
                Some(t) => self.consumer.partition_count(t).await.ok(),
                None => None,
            };
            retrier.set_policy(policy, partitions).await?;
            self.policy_to_set = None;
        }
        self.reconcile().await?;
        if self.shared.config.auto_commit
            && self.last_commit.elapsed() >= self.shared.config.auto_commit_interval
        {
            if let Err(e) = self.commit_sync().await {
                tracing::warn!(error = %e, "auto commit failed");
            }
        }
        if self.consumer.positions().is_empty() {
            tokio::time::sleep(max_wait.min(Duration::from_millis(100))).await;
            return Ok(Vec::new());
        }
        self.consumer.poll(max_wait).await
    }

    /// Commits the positions of every held partition and waits for the answer.
    pub async fn commit_sync(&mut self) -> Result<(), ClientError> {
        let owned = self.shared.membership.lock().owned.clone();
        self.commit_partitions(&owned).await
    }

    /// Commits in the background; failures are logged.
    pub fn commit_async(&mut self) {
        let offsets = self.offsets_to_commit(&self.shared.membership.lock().owned.clone());
        let shared = self.shared.clone();
        tokio::spawn(async move {
            if let Err(e) = commit(&shared, offsets).await {
                tracing::warn!(error = %e, "async commit failed");
            }
        });
        self.last_commit = Instant::now();
    }

    fn offsets_to_commit(&self, partitions: &BTreeSet<TopicPartition>) -> Vec<CommittedOffset> {
        self.positions_of(partitions)
            .filter(|o| self.committed.get(&(o.topic.clone(), o.partition)) != Some(&o.offset))
            .collect()
    }

    /// The position to commit of each of `partitions` held.
    fn positions_of<'a>(
        &'a self,
        partitions: &'a BTreeSet<TopicPartition>,
    ) -> impl Iterator<Item = CommittedOffset> + 'a {
        partitions.iter().filter_map(|tp| {
            let mut position = *self
                .consumer
                .positions()
                .get(tp)
                .or_else(|| self.paused.get(tp))?;
            if let Some(floor) = self.hooks.as_ref().and_then(|h| h.commit_floor(tp)) {
                position = position.min(floor);
            }
            Some(CommittedOffset {
                topic: tp.0.clone(),
                partition: tp.1,
                offset: position,
                metadata: String::new(),
            })
        })
    }

    /// The positions of every held partition: what a consume-transform-produce loop
    /// commits inside its transaction with
    /// [`Producer::send_offsets_to_transaction`](super::Producer::send_offsets_to_transaction)
    /// (with `auto_commit` off, so that nothing else commits them).
    pub fn positions(&self) -> Vec<CommittedOffset> {
        let owned = self.shared.membership.lock().owned.clone();
        self.positions_of(&owned).collect()
    }

    /// Who this member is, for committing offsets inside a transaction: the group
    /// coordinator refuses offsets from a member that lost its partitions (a zombie
    /// pipeline), as Kafka's KIP-447 does.
    pub fn group_metadata(&self) -> GroupMetadata {
        let m = self.shared.membership.lock();
        GroupMetadata {
            group: self.shared.config.group.clone(),
            member_id: m.member_id.clone(),
            member_epoch: m.epoch,
        }
    }

    async fn commit_partitions(
        &mut self,
        partitions: &BTreeSet<TopicPartition>,
    ) -> Result<(), ClientError> {
        let offsets = self.offsets_to_commit(partitions);
        self.last_commit = Instant::now();
        if offsets.is_empty() {
            return Ok(());
        }
        commit(&self.shared, offsets.clone()).await?;
        for o in offsets {
            self.committed.insert((o.topic, o.partition), o.offset);
        }
        Ok(())
    }

    /// Moves a held partition's position.
    pub async fn seek(
        &mut self,
        topic: &str,
        partition: u32,
        to: StartAt,
    ) -> Result<(), ClientError> {
        self.consumer.seek(topic, partition, to).await
    }

    /// Stops fetching a held partition (it stays assigned).
    pub fn pause(&mut self, topic: &str, partition: u32) {
        let tp = (topic.to_owned(), partition);
        if let Some(&position) = self.consumer.positions().get(&tp) {
            self.consumer.unassign(topic, partition);
            self.paused.insert(tp, position);
        }
    }

    /// Fetches a paused partition again, from where it stopped.
    pub async fn resume(&mut self, topic: &str, partition: u32) -> Result<(), ClientError> {
        if let Some(position) = self.paused.remove(&(topic.to_owned(), partition)) {
            self.consumer
                .assign(topic, partition, StartAt::Offset(position))
                .await?;
        }
        Ok(())
    }

    /// Commits (with auto commit) and leaves the group.
    pub async fn close(mut self) -> Result<(), ClientError> {
        let committed = if self.shared.config.auto_commit {
            self.commit_sync().await
        } else {
            Ok(())
        };
        self.task.abort();
        self.shared.membership.lock().leaving = true;
        self.shared.heartbeat().await;
        committed
    }
}

impl Drop for GroupConsumer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn commit(shared: &Shared, offsets: Vec<CommittedOffset>) -> Result<(), ClientError> {
    for _ in 0..50 {
        let (member_id, member_epoch, lost) = {
            let m = shared.membership.lock();
            (m.member_id.clone(), m.epoch, m.lost)
        };
        if member_id.is_empty() || lost {
            return Err(ClientError::new(
                ErrorCode::UnknownMemberId,
                format!(
                    "not a member of group '{}' (yet); nothing committed",
                    shared.config.group
                ),
            ));
        }
        let request = OffsetCommitRequest {
            group: shared.config.group.clone(),
            member_id,
            member_epoch,
            offsets: offsets.clone(),
            ..OffsetCommitRequest::default()
        };
        let result = async {
            let mut client = shared.coordinator().await?;
            client
                .offset_commit(request)
                .await
                .map_err(ClientError::from)
        }
        .await;
        match result {
            Ok(_) => return Ok(()),
            Err(e) if e.is_retriable() => {
                shared.forget_coordinator();
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    }
    Err(ClientError::new(
        ErrorCode::RequestTimedOut,
        "could not commit offsets",
    ))
}
