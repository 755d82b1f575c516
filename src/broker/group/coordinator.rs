//! The group coordinator on a broker: it coordinates the groups whose `__consumer_offsets`
//! partition this broker leads. Membership lives in memory (members re-join after a
//! coordinator change); committed offsets are appended to the offsets partition with
//! acks=all and loaded back from it when the broker takes the partition's leadership.
//!
//! Offsets committed inside a producer's transaction (Kafka's TxnOffsetCommit) are
//! appended as that producer's transactional records and held pending until the
//! transaction's marker reaches the offsets partition: a commit marker makes them the
//! group's offsets, an abort drops them. Replay applies the same rule to the log.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{oneshot, Mutex};

use super::assignor::{ReplicaRacks, Strategy, TopicPartition};
use super::classic::{self, ClassicGroup, JoinAnswer, JoinRequest, Reply};
use super::offsets::{self, OffsetKey, OffsetValue, OFFSETS_TOPIC};
use super::state::{GroupState, Member};
use crate::broker::error::BrokerError;
use crate::broker::node::{now_ms, Acks, BrokerNode, MarkerObserver};
use crate::error_code::ErrorCode;
use crate::replication::replica::{LocalPartition, Replayed};
use crate::types::LeaderEpoch;

/// Group coordination settings of a broker.
#[derive(Debug, Clone)]
pub struct GroupSettings {
    /// Partitions of `__consumer_offsets` when it is created.
    pub offsets_partitions: u32,
    /// Its replication factor (capped at the live brokers).
    pub offsets_replication_factor: u32,
    /// Smallest and largest session timeout a member may ask for.
    pub session_timeout_min: Duration,
    /// See above.
    pub session_timeout_max: Duration,
    /// Session timeout when a member asks for none.
    pub session_timeout_default: Duration,
    /// How long a commit may wait for replication.
    pub commit_timeout: Duration,
    /// An offsets partition is cleaned up once it holds this many records (and four
    /// times its live offsets).
    pub cleanup_min_records: u64,
    /// How long a classic group starting from empty waits for more members before its
    /// first generation (Kafka's `group.initial.rebalance.delay.ms`).
    pub initial_rebalance_delay: Duration,
}

impl Default for GroupSettings {
    fn default() -> Self {
        Self {
            offsets_partitions: 50,
            offsets_replication_factor: 3,
            session_timeout_min: Duration::from_millis(500),
            session_timeout_max: Duration::from_secs(300),
            session_timeout_default: Duration::from_secs(45),
            commit_timeout: Duration::from_secs(10),
            cleanup_min_records: 10_000,
            initial_rebalance_delay: Duration::from_secs(3),
        }
    }
}

/// One group as the coordinator holds it. A group is of one protocol at a time, as in
/// Kafka 4: `consumer` (server-side assignment: gRPC members and Kafka's KIP-848) while
/// `state` has members, `classic` (JoinGroup/SyncGroup) while `classic` has.
#[derive(Debug, Default)]
struct Group {
    state: GroupState,
    classic: ClassicGroup,
    offsets: BTreeMap<OffsetKey, OffsetValue>,
    /// Offsets committed inside open transactions, by producer id.
    pending: BTreeMap<i64, BTreeMap<OffsetKey, OffsetValue>>,
}

impl Group {
    fn member_count(&self) -> usize {
        self.state.members.len() + self.classic.members.len()
    }

    /// Whether its lag is measured against last stable offsets: a consumer member (or,
    /// with none now, one it last had) reads committed records only. Kept in memory: a
    /// group without members forgets it when its coordinator moves.
    fn reads_committed(&self) -> bool {
        if self.state.members.is_empty() {
            self.state.read_committed
        } else {
            self.state.members.values().any(|m| m.read_committed)
        }
    }

    /// `classic` when it has classic members or only ever had those; else `consumer`.
    fn kind(&self) -> &'static str {
        if !self.classic.is_empty()
            || (self.state.members.is_empty() && self.classic.generation > 0)
        {
            "classic"
        } else {
            "consumer"
        }
    }

    fn state_name(&self) -> &'static str {
        if self.kind() == "classic" {
            self.classic.state_name()
        } else {
            self.state.state_name()
        }
    }
}

/// A JoinGroup or SyncGroup waiting for its answer: (group, member id, is a SyncGroup).
type Waiter = (String, String, bool);

#[derive(Default)]
struct Inner {
    /// Offsets partitions loaded, with the leader epoch they were loaded in.
    loaded: HashMap<u32, LeaderEpoch>,
    /// Groups of loaded partitions.
    groups: BTreeMap<String, Group>,
    /// Classic requests waiting for their answers.
    waiters: HashMap<Waiter, oneshot::Sender<Reply>>,
}

impl Inner {
    /// Hands completed answers to the requests waiting for them.
    fn deliver(&mut self, group: &str, replies: Vec<Reply>) {
        for reply in replies {
            let key = match &reply {
                Reply::Join(id, _) => (group.to_owned(), id.clone(), false),
                Reply::Sync(id, _) => (group.to_owned(), id.clone(), true),
            };
            if let Some(tx) = self.waiters.remove(&key) {
                let _ = tx.send(reply);
            }
        }
    }
}

/// Who commits offsets.
#[derive(Debug, Clone)]
pub enum Committer {
    /// An operator resetting offsets of a group without members; for broadcast groups, of
    /// one member instance.
    Admin {
        /// The broadcast instance, if any.
        instance: Option<String>,
    },
    /// A consumer-protocol member at its member epoch.
    Member {
        /// Member id.
        id: String,
        /// Its epoch.
        epoch: i32,
    },
    /// A Kafka client: a classic member at its generation, a KIP-848 member at its epoch,
    /// or (empty id, negative generation) a client committing for a group without members.
    Kafka {
        /// Member id.
        id: String,
        /// `group.instance.id`.
        instance: Option<String>,
        /// Generation (classic) or member epoch (consumer).
        generation: i32,
    },
}

/// The transaction an offset commit belongs to (Kafka's TxnOffsetCommit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnCommit {
    /// The producer's transactional id.
    pub transactional_id: String,
    /// Its producer id.
    pub producer_id: i64,
    /// Its epoch.
    pub producer_epoch: i16,
}

/// A heartbeat, as the service hands it over.
#[derive(Debug, Clone, Default)]
pub struct Heartbeat {
    /// Group.
    pub group: String,
    /// Member id (empty: join).
    pub member_id: String,
    /// Member epoch (-1: leave).
    pub member_epoch: i32,
    /// Stable instance name.
    pub instance_id: String,
    /// Client name.
    pub client_id: String,
    /// Topics by name (`None`: unchanged since the last heartbeat).
    pub topics: Option<Vec<String>>,
    /// Topic pattern, empty for none (`None`: unchanged).
    pub topic_regex: Option<String>,
    /// Strategy name.
    pub strategy: String,
    /// Broadcast group.
    pub broadcast: bool,
    /// Session timeout asked for (0: default).
    pub session_timeout_ms: u32,
    /// Partitions held (`None`: unchanged since the last heartbeat).
    pub owned: Option<BTreeSet<TopicPartition>>,
    /// The member's rack, empty for none (`None`: unchanged).
    pub rack: Option<String>,
    /// The member reads committed records only.
    pub read_committed: bool,
}

/// The answer to a heartbeat.
#[derive(Debug, Clone)]
pub struct HeartbeatAnswer {
    /// Member id.
    pub member_id: String,
    /// Member epoch.
    pub member_epoch: i32,
    /// When to heartbeat next.
    pub heartbeat_interval: Duration,
    /// What to hold.
    pub assignment: BTreeSet<TopicPartition>,
}

/// A group's description.
#[derive(Debug, Clone)]
pub struct GroupDescription {
    /// Consumer protocol: "empty", "stable" or "reconciling"; classic: Kafka's state
    /// names ("Empty", "PreparingRebalance", "CompletingRebalance", "Stable").
    pub state: String,
    /// "consumer" or "classic".
    pub kind: &'static str,
    /// Classic groups: the protocol type and the chosen protocol (assignor).
    pub protocol: (String, String),
    /// Classic groups: the members as they joined (metadata and assignment bytes).
    pub classic_members: Vec<classic::ClassicMember>,
    /// Consumer groups: the members with their subscriptions.
    pub consumer_members: Vec<Member>,
    /// Consumer groups: the target assignment by member key, and its epoch.
    pub targets: (i32, BTreeMap<String, BTreeSet<TopicPartition>>),
    /// Strategy.
    pub strategy: Strategy,
    /// Broadcast.
    pub broadcast: bool,
    /// Group epoch.
    pub epoch: i32,
    /// Members: (id, instance, client, epoch, assignment).
    pub members: Vec<(String, String, String, i32, BTreeSet<TopicPartition>)>,
    /// Committed offsets.
    pub offsets: Vec<(OffsetKey, OffsetValue)>,
    /// A member reads committed records only: lag is measured against the last stable
    /// offset.
    pub read_committed: bool,
}

/// A group as ListGroups shows it.
#[derive(Debug, Clone)]
pub struct GroupListing {
    /// Its name.
    pub name: String,
    /// Its state (see [`GroupDescription::state`]).
    pub state: String,
    /// Members now.
    pub members: usize,
    /// "consumer" or "classic".
    pub kind: &'static str,
    /// The members' protocol type ("consumer" for consumers).
    pub protocol_type: String,
}

/// One coordinated group, for metrics.
#[derive(Debug, Clone)]
pub struct GroupSnapshot {
    /// Its name.
    pub name: String,
    /// Members now.
    pub members: usize,
    /// Group epoch (bumped by every membership or subscription change).
    pub epoch: i32,
    /// Rebalances since this broker took the group over: new group epochs of a consumer
    /// group plus completed join phases (generations) of a classic one.
    pub rebalances: u64,
    /// Committed offsets.
    pub offsets: Vec<(OffsetKey, i64)>,
    /// A member reads committed records only.
    pub read_committed: bool,
}

/// The coordinator of one broker.
pub struct GroupCoordinator {
    node: BrokerNode,
    settings: GroupSettings,
    inner: Mutex<Inner>,
}

fn error(code: ErrorCode, message: impl Into<String>) -> BrokerError {
    BrokerError::new(code, message)
}

fn unknown_member(group: &str, member_id: &str) -> BrokerError {
    error(
        ErrorCode::UnknownMemberId,
        format!("group '{group}' has no member '{member_id}'"),
    )
}

impl GroupCoordinator {
    /// A coordinator serving through `node`.
    pub fn new(node: BrokerNode, settings: GroupSettings) -> Arc<Self> {
        Arc::new(Self {
            node,
            settings,
            inner: Mutex::new(Inner::default()),
        })
    }

    /// The settings.
    pub fn settings(&self) -> &GroupSettings {
        &self.settings
    }

    /// The partition count of `__consumer_offsets` (1 before it exists).
    fn offsets_partition_count(&self) -> u32 {
        self.node
            .metadata()
            .topic(OFFSETS_TOPIC)
            .map_or(1, |t| t.partitions.len() as u32)
    }

    /// The offsets partition of `group`, from the topic's current partition count.
    pub fn offsets_partition(&self, group: &str) -> Result<u32, BrokerError> {
        let t = self.node.metadata().topic(OFFSETS_TOPIC).ok_or_else(|| {
            error(
                ErrorCode::NotCoordinator,
                format!("{OFFSETS_TOPIC} does not exist yet; ask FindCoordinator first"),
            )
        })?;
        Ok(offsets::partition_for(group, t.partitions.len() as u32))
    }

    /// Checks that this broker coordinates `group` and that its partition is loaded;
    /// returns the partition.
    async fn own(&self, inner: &mut Inner, group: &str) -> Result<u32, BrokerError> {
        if group.is_empty() || group.len() > 255 {
            return Err(error(
                ErrorCode::InvalidRequest,
                format!("group must be 1 to 255 bytes, got {}", group.len()),
            ));
        }
        let partition = self.offsets_partition(group)?;
        let (local, epoch) = self
            .node
            .leader_partition(OFFSETS_TOPIC, partition)
            .map_err(|e| {
                let mut e = e;
                let me = self.node.id();
                let leads = self.node.metadata().topic(OFFSETS_TOPIC).is_some_and(|t| {
                    t.partitions
                        .get(partition as usize)
                        .is_some_and(|p| p.leader == Some(me))
                });
                if e.code == ErrorCode::NotLeaderOrFollower && leads {
                    // Elected but still taking the partition over: Kafka clients wait.
                    e.code = ErrorCode::CoordinatorLoadInProgress;
                } else if e.code == ErrorCode::NotLeaderOrFollower {
                    e.code = ErrorCode::NotCoordinator;
                    e.message = format!(
                        "broker {} does not coordinate group '{group}': {}",
                        self.node.id(),
                        e.message
                    );
                }
                e
            })?;
        self.load(inner, partition, local, epoch).await?;
        Ok(partition)
    }

    /// Loads the committed offsets of offsets partition `partition`, which this broker
    /// leads as `local` in `epoch`, unless they are loaded for that epoch already.
    async fn load(
        &self,
        inner: &mut Inner,
        partition: u32,
        local: Arc<LocalPartition>,
        epoch: LeaderEpoch,
    ) -> Result<(), BrokerError> {
        if inner.loaded.get(&partition) == Some(&epoch) {
            return Ok(());
        }
        // New leadership of this partition: forget what we had, load the commits.
        let count = self.offsets_partition_count();
        inner
            .groups
            .retain(|name, _| offsets::partition_for(name, count) != partition);
        inner
            .waiters
            .retain(|(name, _, _), _| offsets::partition_for(name, count) != partition);
        let (loaded, pending) = tokio::task::spawn_blocking(move || replay(&local))
            .await
            .map_err(|e| error(ErrorCode::UnknownServerError, format!("load task: {e}")))??;
        let n = loaded.len();
        for (k, v) in loaded {
            inner
                .groups
                .entry(k.group.clone())
                .or_default()
                .offsets
                .insert(k, v);
        }
        for (producer_id, entries) in pending {
            for (k, v) in entries {
                inner
                    .groups
                    .entry(k.group.clone())
                    .or_default()
                    .pending
                    .entry(producer_id)
                    .or_default()
                    .insert(k, v);
            }
        }
        inner.loaded.insert(partition, epoch);
        tracing::info!(partition, %epoch, offsets = n, "loaded committed offsets");
        Ok(())
    }

    /// The subscribed topics of `state`'s members with their partition counts.
    /// The topics the group's members subscribe to, with partition counts, and the racks
    /// of each of their partitions' replicas.
    fn subscribed_topics(&self, state: &GroupState) -> (BTreeMap<String, u32>, ReplicaRacks) {
        let patterns: Vec<regex::Regex> = state
            .members
            .values()
            .filter_map(|m| m.regex.as_deref())
            .filter_map(|r| regex::Regex::new(&format!("^(?:{r})$")).ok())
            .collect();
        self.node.metadata().read(|image| {
            let subscribed: Vec<_> = image
                .topics
                .values()
                .filter(|t| !crate::controller::validation::is_reserved_topic(&t.name))
                .filter(|t| {
                    state.members.values().any(|m| m.topics.contains(&t.name))
                        || (!crate::topic_config::is_group_retry_topic(&t.name)
                            && patterns.iter().any(|p| p.is_match(&t.name)))
                })
                .collect();
            let mut racks = ReplicaRacks::new();
            if state.strategy == Strategy::RackAware {
                for t in &subscribed {
                    for p in &t.partitions {
                        let of_replicas = p
                            .replicas
                            .iter()
                            .filter_map(|b| image.brokers.get(b)?.rack.clone())
                            .collect();
                        racks.insert((t.name.clone(), p.partition), of_replicas);
                    }
                }
            }
            let topics = subscribed
                .iter()
                .map(|t| (t.name.clone(), t.partitions.len() as u32))
                .collect();
            (topics, racks)
        })
    }

    /// A member's heartbeat: join, stay or leave; returns what it should hold.
    pub async fn heartbeat(&self, hb: Heartbeat) -> Result<HeartbeatAnswer, BrokerError> {
        let strategy: Strategy = hb
            .strategy
            .parse()
            .map_err(|e: String| error(ErrorCode::InvalidRequest, e))?;
        if let Some(r) = hb.topic_regex.as_deref().filter(|r| !r.is_empty()) {
            regex::Regex::new(r).map_err(|e| {
                error(
                    ErrorCode::InvalidRequest,
                    format!("topic_regex is not a valid pattern: {e}"),
                )
            })?;
        }
        let session = if hb.session_timeout_ms == 0 {
            self.settings.session_timeout_default
        } else {
            Duration::from_millis(u64::from(hb.session_timeout_ms))
        };
        self.check_session_timeout(session)?;
        let mut inner = self.inner.lock().await;
        self.own(&mut inner, &hb.group).await?;
        let group = inner.groups.entry(hb.group.clone()).or_default();
        if !group.classic.is_empty() {
            return Err(error(
                ErrorCode::InconsistentGroupProtocol,
                format!(
                    "group '{}' is a classic group with {} members; it takes consumer-protocol members once it is empty",
                    hb.group,
                    group.classic.members.len()
                ),
            ));
        }
        let state = &mut group.state;
        if hb.member_epoch < 0 {
            if state.remove(&hb.member_id) {
                tracing::info!(group = %hb.group, member = %hb.member_id, "member left");
            }
            return Ok(HeartbeatAnswer {
                member_id: hb.member_id,
                member_epoch: hb.member_epoch,
                heartbeat_interval: Duration::ZERO,
                assignment: BTreeSet::new(),
            });
        }
        // Epoch 0 joins: with no id (the coordinator names the member) or with one the
        // client chose (KIP-848 v1); a known member joining again starts afresh.
        // (A member's epoch stays 0 until it first holds its whole target, so epoch 0
        // from a known member at epoch 0 is an ordinary heartbeat.)
        let joining = hb.member_id.is_empty()
            || (hb.member_epoch == 0
                && state
                    .members
                    .get(&hb.member_id)
                    .is_none_or(|m| m.epoch != 0));
        if joining && hb.topics.is_none() {
            return Err(error(
                ErrorCode::InvalidRequest,
                "a joining member must send its subscribed topics",
            ));
        }
        if hb.member_id.len() > 255 {
            return Err(error(
                ErrorCode::InvalidRequest,
                format!(
                    "member_id must be at most 255 bytes, got {}",
                    hb.member_id.len()
                ),
            ));
        }
        let member_id = if joining {
            if state.remove(&hb.member_id) {
                tracing::info!(group = %hb.group, member = %hb.member_id, "member joined again");
            }
            if state.members.is_empty() {
                state.strategy = strategy;
                state.broadcast = hb.broadcast;
            } else if state.broadcast != hb.broadcast {
                return Err(error(
                    ErrorCode::InvalidRequest,
                    format!(
                        "group '{}' is {}a broadcast group",
                        hb.group,
                        if state.broadcast { "" } else { "not " }
                    ),
                ));
            }
            // A new process with the same instance id replaces the old member.
            if !hb.instance_id.is_empty() {
                let previous: Vec<String> = state
                    .members
                    .values()
                    .filter(|m| m.instance_id == hb.instance_id)
                    .map(|m| m.id.clone())
                    .collect();
                for id in previous {
                    state.remove(&id);
                }
            }
            let id = if hb.member_id.is_empty() {
                uuid::Uuid::new_v4().to_string()
            } else {
                hb.member_id.clone()
            };
            state.members.insert(
                id.clone(),
                Member {
                    id: id.clone(),
                    instance_id: hb.instance_id.clone(),
                    client_id: hb.client_id.clone(),
                    epoch: 0,
                    topics: BTreeSet::new(),
                    regex: None,
                    owned: BTreeSet::new(),
                    assignment: BTreeSet::new(),
                    rack: None,
                    read_committed: hb.read_committed,
                    session_timeout: session,
                    last_seen: Instant::now(),
                },
            );
            state.bump();
            tracing::info!(group = %hb.group, member = %id, client = %hb.client_id, "member joined");
            id
        } else {
            let Some(m) = state.members.get(&hb.member_id) else {
                return Err(error(
                    ErrorCode::UnknownMemberId,
                    format!(
                        "group '{}' has no member {} (it left or its session expired)",
                        hb.group, hb.member_id
                    ),
                ));
            };
            if m.epoch != hb.member_epoch {
                return Err(error(
                    ErrorCode::FencedMemberEpoch,
                    format!(
                        "member {} sent epoch {}, its epoch is {}",
                        hb.member_id, hb.member_epoch, m.epoch
                    ),
                ));
            }
            hb.member_id.clone()
        };
        let member = state.members.get_mut(&member_id).expect("present");
        let topics: BTreeSet<String> = match hb.topics {
            Some(t) => t.into_iter().collect(),
            None => member.topics.clone(),
        };
        let regex = match hb.topic_regex {
            Some(r) => (!r.is_empty()).then_some(r),
            None => member.regex.clone(),
        };
        let rack = match hb.rack {
            Some(r) => (!r.is_empty()).then_some(r),
            None => member.rack.clone(),
        };
        let changed = member.topics != topics || member.regex != regex || member.rack != rack;
        member.topics = topics;
        member.regex = regex;
        member.rack = rack;
        member.read_committed = hb.read_committed;
        let owned = hb.owned.unwrap_or_else(|| member.owned.clone());
        member.report_owned(joining, owned);
        member.session_timeout = session;
        member.last_seen = Instant::now();
        state.read_committed = state.members.values().any(|m| m.read_committed);
        if changed {
            state.bump();
        }
        let (subscribed, racks) = self.subscribed_topics(state);
        state.set_topics(subscribed, racks);
        let assignment = state.reconcile(&member_id);
        let member_epoch = state.members[&member_id].epoch;
        // A member still converging on its target asks again soon (its partitions may be
        // released any moment); a settled one every fifth of its session, at most 1 s.
        let heartbeat_interval = if member_epoch != state.epoch {
            Duration::from_millis(100)
        } else {
            (session / 5).clamp(Duration::from_millis(100), Duration::from_secs(1))
        };
        Ok(HeartbeatAnswer {
            member_id,
            member_epoch,
            heartbeat_interval,
            assignment,
        })
    }

    /// Removes members whose sessions ran out (call periodically).
    ///
    /// A tick that waited for the coordinator (behind a slow commit, say) expires no
    /// session: the heartbeats that waited alongside it have not been counted yet. It also
    /// unloads the groups of offsets partitions this broker no longer leads, which answers
    /// their waiting requests with NOT_COORDINATOR.
    pub async fn expire_members(&self) {
        let asked = Instant::now();
        let mut inner = self.inner.lock().await;
        let now = Instant::now();
        let expire = now.duration_since(asked) < Duration::from_millis(200);
        self.unload_lost(&mut inner);
        let mut completed = Vec::new();
        for (name, group) in inner.groups.iter_mut() {
            if expire {
                for id in group.state.expire(now) {
                    tracing::info!(group = %name, member = %id, "member session expired; reassigning its partitions");
                }
            }
            let (replies, expired) = group.classic.tick(now, expire);
            for id in expired {
                tracing::info!(group = %name, member = %id, "classic member session expired; rebalancing");
            }
            if !replies.is_empty() {
                completed.push((name.clone(), replies));
            }
        }
        for (name, replies) in completed {
            inner.deliver(&name, replies);
        }
    }

    /// Forgets the groups (and their waiting requests) of offsets partitions this broker
    /// stopped leading, or leads in a newer epoch than it loaded them in.
    fn unload_lost(&self, inner: &mut Inner) {
        let lost: Vec<u32> = inner
            .loaded
            .iter()
            .filter(|(p, epoch)| {
                self.node
                    .leader_partition(OFFSETS_TOPIC, **p)
                    .map_or(true, |(_, current)| current != **epoch)
            })
            .map(|(p, _)| *p)
            .collect();
        if lost.is_empty() {
            return;
        }
        let count = self.offsets_partition_count();
        for p in &lost {
            inner.loaded.remove(p);
            tracing::info!(
                partition = p,
                "no longer coordinating the groups of this offsets partition"
            );
        }
        inner
            .groups
            .retain(|name, _| !lost.contains(&offsets::partition_for(name, count)));
        inner
            .waiters
            .retain(|(name, _, _), _| !lost.contains(&offsets::partition_for(name, count)));
    }

    /// Checks a member's session timeout against the broker's bounds.
    fn check_session_timeout(&self, session: Duration) -> Result<(), BrokerError> {
        if session < self.settings.session_timeout_min
            || session > self.settings.session_timeout_max
        {
            return Err(error(
                ErrorCode::InvalidSessionTimeout,
                format!(
                    "session timeout {} ms is outside [{}, {}] ms",
                    session.as_millis(),
                    self.settings.session_timeout_min.as_millis(),
                    self.settings.session_timeout_max.as_millis()
                ),
            ));
        }
        Ok(())
    }

    /// Waits for the answer of a waiting classic request; a coordinator that stops
    /// coordinating the group drops it (NOT_COORDINATOR: the client finds the new one).
    async fn wait(rx: oneshot::Receiver<Reply>) -> Result<Reply, BrokerError> {
        rx.await.map_err(|_| {
            error(
                ErrorCode::NotCoordinator,
                "this broker stopped coordinating the group (or the request was superseded); find the coordinator again",
            )
        })
    }

    /// A classic JoinGroup; waits until the join phase ends. Returns the member id (also
    /// for MEMBER_ID_REQUIRED) and the answer.
    pub async fn join_classic(
        &self,
        group: &str,
        req: JoinRequest,
    ) -> (String, Result<JoinAnswer, BrokerError>) {
        let member_id = req.member_id.clone();
        let rx = match self.start_join(group, req).await {
            Ok(rx) => rx,
            Err(e) => return (member_id, Err(e)),
        };
        match Self::wait(rx).await {
            Ok(Reply::Join(id, answer)) => (id, answer),
            Ok(Reply::Sync(id, _)) => (
                id,
                Err(error(
                    ErrorCode::UnknownServerError,
                    "a sync answer for a join",
                )),
            ),
            Err(e) => (member_id, Err(e)),
        }
    }

    async fn start_join(
        &self,
        group: &str,
        req: JoinRequest,
    ) -> Result<oneshot::Receiver<Reply>, BrokerError> {
        self.check_session_timeout(req.session_timeout)?;
        let mut inner = self.inner.lock().await;
        self.own(&mut inner, group).await?;
        let g = inner.groups.entry(group.to_owned()).or_default();
        if !g.state.members.is_empty() {
            return Err(error(
                ErrorCode::InconsistentGroupProtocol,
                format!(
                    "group '{group}' is a consumer-protocol group with {} members; classic members can join once it is empty",
                    g.state.members.len()
                ),
            ));
        }
        g.classic.initial_delay = self.settings.initial_rebalance_delay;
        let client = req.client_id.clone();
        let new_id = format!(
            "{}-{}",
            if client.is_empty() { "member" } else { &client },
            uuid::Uuid::new_v4()
        );
        let (id, replies) = match g.classic.join(req, new_id, Instant::now()) {
            Ok(joined) => joined,
            Err(e) => {
                // A refused join to a group nobody uses leaves nothing behind.
                if g.member_count() == 0
                    && g.classic.is_empty()
                    && g.classic.generation == 0
                    && g.offsets.is_empty()
                    && g.pending.is_empty()
                {
                    inner.groups.remove(group);
                }
                return Err(e);
            }
        };
        let (tx, rx) = oneshot::channel();
        inner
            .waiters
            .insert((group.to_owned(), id.clone(), false), tx);
        tracing::debug!(group, member = %id, client = %client, "classic member joining");
        inner.deliver(group, replies);
        Ok(rx)
    }

    /// A classic SyncGroup; waits for the leader's assignment. Returns this member's.
    #[allow(clippy::too_many_arguments)]
    pub async fn sync_classic(
        &self,
        group: &str,
        member_id: &str,
        instance: Option<&str>,
        generation: i32,
        protocol_type: Option<&str>,
        protocol: Option<&str>,
        assignments: Vec<(String, Bytes)>,
    ) -> Result<Bytes, BrokerError> {
        let rx = {
            let mut inner = self.inner.lock().await;
            self.own(&mut inner, group).await?;
            let g = inner
                .groups
                .get_mut(group)
                .ok_or_else(|| unknown_member(group, member_id))?;
            let replies = g.classic.sync(
                member_id,
                instance,
                generation,
                protocol_type,
                protocol,
                assignments,
                Instant::now(),
            )?;
            let (tx, rx) = oneshot::channel();
            inner
                .waiters
                .insert((group.to_owned(), member_id.to_owned(), true), tx);
            inner.deliver(group, replies);
            rx
        };
        match Self::wait(rx).await? {
            Reply::Sync(_, answer) => answer,
            Reply::Join(..) => Err(error(
                ErrorCode::UnknownServerError,
                "a join answer for a sync",
            )),
        }
    }

    /// A classic Heartbeat.
    pub async fn heartbeat_classic(
        &self,
        group: &str,
        member_id: &str,
        instance: Option<&str>,
        generation: i32,
    ) -> Result<(), BrokerError> {
        let mut inner = self.inner.lock().await;
        self.own(&mut inner, group).await?;
        let g = inner
            .groups
            .get_mut(group)
            .ok_or_else(|| unknown_member(group, member_id))?;
        g.classic
            .heartbeat(member_id, instance, generation, Instant::now())
    }

    /// A classic LeaveGroup of `members` (member id, instance id): one result each.
    pub async fn leave_classic(
        &self,
        group: &str,
        members: &[(String, Option<String>)],
    ) -> Result<Vec<Result<(), BrokerError>>, BrokerError> {
        let mut inner = self.inner.lock().await;
        self.own(&mut inner, group).await?;
        let Some(g) = inner.groups.get_mut(group) else {
            return Ok(members
                .iter()
                .map(|(id, _)| Err(unknown_member(group, id)))
                .collect());
        };
        let (results, replies) = g.classic.leave(members, Instant::now());
        for ((id, _), r) in members.iter().zip(&results) {
            if r.is_ok() {
                tracing::info!(group, member = %id, "classic member left");
            }
        }
        inner.deliver(group, replies);
        Ok(results)
    }

    /// Commits offsets as `who`. Each entry: topic, partition, offset, metadata.
    pub async fn commit(
        &self,
        group: &str,
        who: Committer,
        entries: Vec<(String, u32, i64, String)>,
    ) -> Result<(), BrokerError> {
        self.commit_as(group, who, entries, None).await
    }

    /// [`GroupCoordinator::commit`] inside `txn` (Kafka's TxnOffsetCommit): the offsets
    /// take effect when the transaction commits, and vanish if it aborts. The
    /// transaction must hold the group's offsets partition (AddOffsetsToTxn).
    pub async fn commit_transactional(
        &self,
        group: &str,
        who: Committer,
        entries: Vec<(String, u32, i64, String)>,
        txn: TxnCommit,
    ) -> Result<(), BrokerError> {
        self.commit_as(group, who, entries, Some(txn)).await
    }

    async fn commit_as(
        &self,
        group: &str,
        who: Committer,
        entries: Vec<(String, u32, i64, String)>,
        txn: Option<TxnCommit>,
    ) -> Result<(), BrokerError> {
        // The lock is held across the append, so the log and the memory see commits in
        // the same order (and the offsets clean-up snapshots a consistent view).
        let mut inner = self.inner.lock().await;
        let (partition, keys) = {
            let partition = self.own(&mut inner, group).await?;
            let g = inner.groups.entry(group.to_owned()).or_default();
            let who = match who {
                // No member id and no generation: a client committing for a group without
                // members (a Kafka "simple" consumer, or a tool).
                Committer::Kafka {
                    ref id,
                    generation,
                    ref instance,
                } if id.is_empty() && generation < 0 && instance.is_none() => {
                    if g.member_count() > 0 {
                        return Err(error(
                            ErrorCode::UnknownMemberId,
                            format!(
                                "group '{group}' has {} active members; commit as one of them",
                                g.member_count()
                            ),
                        ));
                    }
                    Committer::Admin { instance: None }
                }
                // A Kafka commit from a member of the consumer protocol, by its epoch.
                Committer::Kafka { id, generation, .. } if g.state.members.contains_key(&id) => {
                    Committer::Member {
                        id,
                        epoch: generation,
                    }
                }
                Committer::Kafka {
                    id,
                    instance,
                    generation,
                } => {
                    g.classic
                        .check_commit(&id, instance.as_deref(), generation, Instant::now())?;
                    Committer::Kafka {
                        id,
                        instance,
                        generation,
                    }
                }
                other => other,
            };
            let instance = match who {
                Committer::Kafka { .. } => String::new(),
                Committer::Admin { instance } => {
                    if g.member_count() > 0 {
                        return Err(error(
                            ErrorCode::GroupNotEmpty,
                            format!(
                                "group '{group}' has {} active members; offsets can only be reset while it has none",
                                g.member_count()
                            ),
                        ));
                    }
                    instance.unwrap_or_default()
                }
                Committer::Member {
                    id: ref member_id,
                    epoch: member_epoch,
                } => {
                    let Some(m) = g.state.members.get(member_id) else {
                        return Err(error(
                            ErrorCode::UnknownMemberId,
                            format!("group '{group}' has no member {member_id}"),
                        ));
                    };
                    // A commit may overtake the answer that raised the member's epoch.
                    if member_epoch > m.epoch || member_epoch < 0 {
                        return Err(error(
                            ErrorCode::FencedMemberEpoch,
                            format!(
                                "member {member_id} sent epoch {member_epoch}, its epoch is {}",
                                m.epoch
                            ),
                        ));
                    }
                    if let Some((topic, p, _, _)) = entries
                        .iter()
                        .find(|(t, p, _, _)| !m.may_commit(&(t.clone(), *p)))
                    {
                        // A member that lost the partition (its session expired, or it was
                        // reassigned) must not move the new holder's position back.
                        return Err(error(
                            ErrorCode::FencedMemberEpoch,
                            format!(
                                "member {member_id} does not hold {topic}-{p} (it was never given it, or gave it up); nothing committed"
                            ),
                        ));
                    }
                    if g.state.broadcast {
                        m.key()
                    } else {
                        String::new()
                    }
                }
            };
            let now = now_ms();
            let keys: Vec<(OffsetKey, Option<OffsetValue>)> = entries
                .into_iter()
                .map(|(topic, p, offset, metadata)| {
                    (
                        OffsetKey {
                            group: group.to_owned(),
                            instance: instance.clone(),
                            topic,
                            partition: p,
                        },
                        Some(OffsetValue {
                            offset,
                            metadata,
                            timestamp: now,
                        }),
                    )
                })
                .collect();
            (partition, keys)
        };
        if let Some((k, v)) = keys.iter().find_map(|(k, v)| {
            v.as_ref()
                .filter(|v| v.metadata.len() > offsets::METADATA_BYTES_MAX)
                .map(|v| (k, v))
        }) {
            return Err(error(
                ErrorCode::InvalidRequest,
                format!(
                    "{}-{}: metadata is {} bytes; the limit is {}",
                    k.topic,
                    k.partition,
                    v.metadata.len(),
                    offsets::METADATA_BYTES_MAX
                ),
            ));
        }
        if keys
            .iter()
            .any(|(_, v)| v.as_ref().is_some_and(|v| v.offset < 0))
        {
            return Err(error(
                ErrorCode::InvalidRequest,
                "committed offsets must be >= 0",
            ));
        }
        if keys.is_empty() {
            return Ok(());
        }
        let Some(txn) = txn else {
            self.append(partition, &keys).await?;
            metrics::counter!("tidelog_group_commits_total", "group" => group.to_owned())
                .increment(1);
            let g = inner.groups.entry(group.to_owned()).or_default();
            for (k, v) in keys {
                if let Some(v) = v {
                    g.offsets.insert(k, v);
                }
            }
            return Ok(());
        };
        self.append_transactional(partition, &keys, &txn).await?;
        metrics::counter!("tidelog_group_commits_total", "group" => group.to_owned()).increment(1);
        let pending = inner
            .groups
            .entry(group.to_owned())
            .or_default()
            .pending
            .entry(txn.producer_id)
            .or_default();
        for (k, v) in keys {
            if let Some(v) = v {
                pending.insert(k, v);
            }
        }
        Ok(())
    }

    /// Appends offsets as `txn`'s transactional records, continuing its producer's
    /// sequence in the offsets partition (the caller holds the coordinator's lock, so no
    /// other write of this producer interleaves).
    async fn append_transactional(
        &self,
        partition: u32,
        entries: &[(OffsetKey, Option<OffsetValue>)],
        txn: &TxnCommit,
    ) -> Result<(), BrokerError> {
        let (local, _) = self.node.leader_partition(OFFSETS_TOPIC, partition)?;
        let producer = offsets::TxnProducer {
            producer_id: txn.producer_id,
            producer_epoch: txn.producer_epoch,
            first_sequence: local.log.next_sequence(txn.producer_id, txn.producer_epoch),
        };
        let batch_bytes_max = self.node.topic_config(OFFSETS_TOPIC).max_message_bytes;
        let batch = offsets::encode_as(entries, now_ms(), batch_bytes_max, Some(producer));
        self.node
            .produce_as(
                OFFSETS_TOPIC,
                partition,
                batch,
                Acks::All,
                self.settings.commit_timeout,
                Some(&txn.transactional_id),
            )
            .await
            .map(|_| ())
    }

    /// The observer to give [`BrokerNode::set_marker_observer`]: markers reaching an
    /// offsets partition settle its pending transactional offsets.
    pub fn marker_observer(self: &Arc<Self>) -> Arc<dyn MarkerObserver> {
        Arc::new(OffsetsMarkers(Arc::downgrade(self)))
    }

    /// A transaction marker of `producer_id` reached offsets partition `partition`
    /// (every in-sync replica holds it): its pending offsets take effect (commit) or are
    /// dropped (abort).
    pub async fn transaction_ended(&self, partition: u32, producer_id: i64, commit: bool) {
        let mut inner = self.inner.lock().await;
        if !inner.loaded.contains_key(&partition) {
            // Not loaded here: loading replays the marker.
            return;
        }
        let count = self.offsets_partition_count();
        for (name, g) in inner.groups.iter_mut() {
            if offsets::partition_for(name, count) != partition {
                continue;
            }
            if let Some(entries) = g.pending.remove(&producer_id) {
                if commit {
                    g.offsets.extend(entries);
                }
            }
        }
    }

    async fn append(
        &self,
        partition: u32,
        entries: &[(OffsetKey, Option<OffsetValue>)],
    ) -> Result<(), BrokerError> {
        let batch_bytes_max = self.node.topic_config(OFFSETS_TOPIC).max_message_bytes;
        let batch = offsets::encode(entries, now_ms(), batch_bytes_max);
        self.node
            .produce(
                OFFSETS_TOPIC,
                partition,
                batch,
                Acks::All,
                self.settings.commit_timeout,
            )
            .await
            .map(|_| ())
    }

    /// Every committed offset of `group` (instance "") and, read under the same lock,
    /// the partitions with offsets pending in open transactions (Kafka's OffsetFetch
    /// answers those UNSTABLE_OFFSET_COMMIT one by one).
    pub async fn offsets_and_unstable(
        &self,
        group: &str,
    ) -> Result<(Vec<(OffsetKey, OffsetValue)>, BTreeSet<TopicPartition>), BrokerError> {
        let mut inner = self.inner.lock().await;
        self.own(&mut inner, group).await?;
        let Some(g) = inner.groups.get(group) else {
            return Ok((Vec::new(), BTreeSet::new()));
        };
        let offsets = g
            .offsets
            .iter()
            .filter(|(k, _)| k.instance.is_empty())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let unstable = g
            .pending
            .values()
            .flat_map(BTreeMap::keys)
            .map(|k| (k.topic.clone(), k.partition))
            .collect();
        Ok((offsets, unstable))
    }

    /// Committed offsets of `group` (of `instance` for broadcast groups), optionally only
    /// for `wanted` partitions.
    /// With `require_stable`, a partition with offsets pending in an open transaction
    /// answers the retriable UNSTABLE_OFFSET_COMMIT (Kafka's KIP-447): a consumer taking
    /// over after a pipeline's crash starts from the settled offset.
    pub async fn fetch_offsets(
        &self,
        group: &str,
        instance: &str,
        wanted: &BTreeSet<TopicPartition>,
        require_stable: bool,
    ) -> Result<Vec<(OffsetKey, OffsetValue)>, BrokerError> {
        let mut inner = self.inner.lock().await;
        self.own(&mut inner, group).await?;
        let Some(g) = inner.groups.get(group) else {
            return Ok(Vec::new());
        };
        if require_stable {
            let unstable = g.pending.values().flat_map(BTreeMap::keys).find(|k| {
                k.instance == instance
                    && (wanted.is_empty() || wanted.contains(&(k.topic.clone(), k.partition)))
            });
            if let Some(k) = unstable {
                return Err(error(
                    ErrorCode::UnstableOffsetCommit,
                    format!(
                        "group '{group}': {}-{} has an offset committed inside a transaction that has not completed yet; retry",
                        k.topic, k.partition
                    ),
                ));
            }
        }
        Ok(g.offsets
            .iter()
            .filter(|(k, _)| k.instance == instance)
            .filter(|(k, _)| wanted.is_empty() || wanted.contains(&(k.topic.clone(), k.partition)))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    /// Describes a group.
    pub async fn describe(&self, group: &str) -> Result<GroupDescription, BrokerError> {
        let mut inner = self.inner.lock().await;
        self.own(&mut inner, group).await?;
        let Some(g) = inner.groups.get(group) else {
            return Err(error(
                ErrorCode::GroupIdNotFound,
                format!("group '{group}' does not exist"),
            ));
        };
        let classic = g.kind() == "classic";
        let protocol = g.classic.protocol.clone().unwrap_or_default();
        let members = if classic {
            g.classic
                .members
                .values()
                .map(|m| {
                    (
                        m.id.clone(),
                        m.instance_id.clone().unwrap_or_default(),
                        m.client_id.clone(),
                        g.classic.generation,
                        if g.classic.protocol_type.as_deref() == Some("consumer") {
                            classic::consumer_assignment(&m.assignment)
                        } else {
                            BTreeSet::new()
                        },
                    )
                })
                .collect()
        } else {
            g.state
                .members
                .values()
                .map(|m| {
                    (
                        m.id.clone(),
                        m.instance_id.clone(),
                        m.client_id.clone(),
                        m.epoch,
                        m.assignment.clone(),
                    )
                })
                .collect()
        };
        Ok(GroupDescription {
            state: g.state_name().to_owned(),
            kind: g.kind(),
            protocol: (
                g.classic.protocol_type.clone().unwrap_or_default(),
                protocol,
            ),
            classic_members: g.classic.members.values().cloned().collect(),
            consumer_members: g.state.members.values().cloned().collect(),
            targets: (g.state.target_epoch, g.state.target.clone()),
            strategy: g.state.strategy,
            broadcast: g.state.broadcast,
            epoch: if classic {
                g.classic.generation
            } else {
                g.state.epoch
            },
            members,
            offsets: g
                .offsets
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            read_committed: g.reads_committed(),
        })
    }

    /// Every group this broker coordinates, with its member count, epoch and committed
    /// offsets (for metrics).
    pub async fn snapshot(&self) -> Vec<GroupSnapshot> {
        let coordinated: Vec<String> = self.list().await.into_iter().map(|g| g.name).collect();
        let inner = self.inner.lock().await;
        coordinated
            .into_iter()
            .filter_map(|name| {
                let g = inner.groups.get(&name)?;
                Some(GroupSnapshot {
                    members: g.member_count(),
                    epoch: g.state.epoch.max(g.classic.generation),
                    rebalances: u64::try_from(g.state.epoch).unwrap_or(0)
                        + u64::try_from(g.classic.generation).unwrap_or(0),
                    offsets: g
                        .offsets
                        .iter()
                        .map(|(k, v)| (k.clone(), v.offset))
                        .collect(),
                    read_committed: g.reads_committed(),
                    name,
                })
            })
            .collect()
    }

    /// The groups this broker coordinates.
    pub async fn list(&self) -> Vec<GroupListing> {
        let count = self.offsets_partition_count();
        // Groups not used since this broker took their partition over are listed too:
        // load every offsets partition it leads (a partition that fails to load is left
        // out, and logged), taking the lock per partition so that heartbeats and commits
        // go on between loads.
        for p in 0..count {
            if let Ok((local, epoch)) = self.node.leader_partition(OFFSETS_TOPIC, p) {
                let mut inner = self.inner.lock().await;
                if let Err(e) = self.load(&mut inner, p, local, epoch).await {
                    tracing::debug!(partition = p, error = %e, "cannot load committed offsets to list groups");
                }
            }
        }
        let inner = self.inner.lock().await;
        inner
            .groups
            .iter()
            .filter(|(name, _)| {
                let p = offsets::partition_for(name, count);
                self.node.leader_partition(OFFSETS_TOPIC, p).is_ok()
                    && inner.loaded.contains_key(&p)
            })
            .map(|(name, g)| GroupListing {
                name: name.clone(),
                state: g.state_name().to_owned(),
                members: g.member_count(),
                kind: g.kind(),
                protocol_type: g
                    .classic
                    .protocol_type
                    .clone()
                    .filter(|_| g.kind() == "classic")
                    .unwrap_or_else(|| "consumer".to_owned()),
            })
            .collect()
    }

    /// Deletes a group without members, and its offsets (tombstones).
    pub async fn delete(&self, group: &str) -> Result<(), BrokerError> {
        let mut inner = self.inner.lock().await;
        let (partition, keys) = {
            let partition = self.own(&mut inner, group).await?;
            let Some(g) = inner.groups.get(group) else {
                return Err(error(
                    ErrorCode::GroupIdNotFound,
                    format!("group '{group}' does not exist"),
                ));
            };
            if g.member_count() > 0 || !g.classic.is_empty() {
                return Err(error(
                    ErrorCode::GroupNotEmpty,
                    format!(
                        "group '{group}' has {} active members; stop them first",
                        g.member_count()
                    ),
                ));
            }
            if !g.pending.is_empty() {
                return Err(error(
                    ErrorCode::GroupNotEmpty,
                    format!(
                        "group '{group}' has offsets committed inside {} open transactions; end them first",
                        g.pending.len()
                    ),
                ));
            }
            let keys: Vec<(OffsetKey, Option<OffsetValue>)> =
                g.offsets.keys().map(|k| (k.clone(), None)).collect();
            (partition, keys)
        };
        if !keys.is_empty() {
            self.append(partition, &keys).await?;
        }
        inner.groups.remove(group);
        Ok(())
    }

    /// Deletes committed offsets of `partitions` (Kafka's OffsetDelete), refusing those of
    /// topics the group's members subscribe to; one result per partition.
    pub async fn delete_offsets(
        &self,
        group: &str,
        partitions: &[TopicPartition],
    ) -> Result<Vec<Result<(), BrokerError>>, BrokerError> {
        let mut inner = self.inner.lock().await;
        let partition = self.own(&mut inner, group).await?;
        let Some(g) = inner.groups.get(group) else {
            return Err(error(
                ErrorCode::GroupIdNotFound,
                format!("group '{group}' does not exist"),
            ));
        };
        let mut subscribed: BTreeSet<String> = g.state.topics.keys().cloned().collect();
        if g.classic.protocol_type.as_deref() == Some("consumer") {
            let protocol = g.classic.protocol.clone().unwrap_or_default();
            for m in g.classic.members.values() {
                subscribed.extend(classic::consumer_subscription(&m.metadata(&protocol)));
            }
        }
        let mut results = Vec::with_capacity(partitions.len());
        let mut tombstones = Vec::new();
        for (topic, p) in partitions {
            if subscribed.contains(topic) {
                results.push(Err(error(
                    ErrorCode::GroupSubscribedToTopic,
                    format!("group '{group}' has members subscribed to '{topic}'"),
                )));
                continue;
            }
            tombstones.extend(
                g.offsets
                    .keys()
                    .filter(|k| k.topic == *topic && k.partition == *p)
                    .map(|k| (k.clone(), None)),
            );
            results.push(Ok(()));
        }
        if !tombstones.is_empty() {
            self.append(partition, &tombstones).await?;
            let g = inner.groups.get_mut(group).expect("checked");
            for (k, _) in tombstones {
                g.offsets.remove(&k);
            }
        }
        Ok(results)
    }

    /// Cleans up superseded commits: for each offsets partition this broker leads whose
    /// log holds many more records than live offsets, appends every live offset again
    /// and moves the log start to that copy, so older commits and tombstones are dropped
    /// (the latest commit per key survives).
    pub async fn compact_offsets(&self) {
        let inner = self.inner.lock().await;
        let count = self.offsets_partition_count();
        let partitions: Vec<(u32, LeaderEpoch)> =
            inner.loaded.iter().map(|(p, e)| (*p, *e)).collect();
        for (partition, epoch) in partitions {
            let Ok((local, current)) = self.node.leader_partition(OFFSETS_TOPIC, partition) else {
                continue;
            };
            if current != epoch {
                continue;
            }
            // Moving the log start past a transaction's records before its marker would
            // lose them on the next load.
            if inner.groups.iter().any(|(name, g)| {
                offsets::partition_for(name, count) == partition && !g.pending.is_empty()
            }) {
                continue;
            }
            let live: Vec<(OffsetKey, Option<OffsetValue>)> = inner
                .groups
                .iter()
                .filter(|(name, _)| offsets::partition_for(name, count) == partition)
                .flat_map(|(_, g)| g.offsets.iter().map(|(k, v)| (k.clone(), Some(v.clone()))))
                .collect();
            let held = local.log.log_end_offset().0 - local.log.log_start_offset().0;
            if held <= (live.len() as u64 * 4).max(self.settings.cleanup_min_records) {
                continue;
            }
            let start = local.log.log_end_offset();
            if !live.is_empty() {
                if let Err(e) = self.append(partition, &live).await {
                    tracing::warn!(partition, error = %e, "offsets clean-up: rewrite failed");
                    continue;
                }
            }
            let log = local.clone();
            let outcome =
                tokio::task::spawn_blocking(move || log.log.advance_log_start(start)).await;
            match outcome {
                Ok(Ok(s)) => tracing::info!(
                    partition,
                    live = live.len(),
                    dropped = held,
                    log_start_offset = s.0,
                    "cleaned up superseded offset commits"
                ),
                Ok(Err(e)) => tracing::warn!(partition, error = %e, "offsets clean-up failed"),
                Err(e) => tracing::warn!(partition, error = %e, "offsets clean-up task failed"),
            }
        }
    }
}

/// Settles transactional offsets when markers reach an offsets partition (weak: the node
/// holding it is held by the coordinator).
struct OffsetsMarkers(std::sync::Weak<GroupCoordinator>);

impl MarkerObserver for OffsetsMarkers {
    fn marker_written(
        &self,
        topic: &str,
        partition: u32,
        producer_id: i64,
        commit: bool,
    ) -> futures_util::future::BoxFuture<'static, ()> {
        let coordinator = self.0.upgrade().filter(|_| topic == OFFSETS_TOPIC);
        Box::pin(async move {
            if let Some(c) = coordinator {
                c.transaction_ended(partition, producer_id, commit).await;
            }
        })
    }
}

/// Committed offsets of an offsets partition's log, and those pending in transactions
/// still open at its end (by producer id).
type Replay = (
    BTreeMap<OffsetKey, OffsetValue>,
    BTreeMap<i64, BTreeMap<OffsetKey, OffsetValue>>,
);

/// Reads an offsets partition: the latest commit of each key wins; a transaction's
/// commits count from its commit marker, and not at all after an abort.
fn replay(local: &LocalPartition) -> Result<Replay, BrokerError> {
    let mut out: BTreeMap<OffsetKey, OffsetValue> = BTreeMap::new();
    let mut pending: BTreeMap<i64, BTreeMap<OffsetKey, OffsetValue>> = BTreeMap::new();
    local.replay(|item| match item {
        Replayed::Record {
            record,
            transaction,
        } => match (offsets::decode(record), transaction) {
            (Some((k, Some(v))), Some(producer_id)) => {
                pending.entry(producer_id).or_default().insert(k, v);
            }
            (Some((k, Some(v))), None) => {
                out.insert(k, v);
            }
            (Some((k, None)), _) => {
                out.remove(&k);
            }
            (None, _) => {}
        },
        Replayed::Marker {
            producer_id,
            commit,
        } => {
            if let Some(entries) = pending.remove(&producer_id) {
                if commit {
                    out.extend(entries);
                }
            }
        }
    })?;
    Ok((out, pending))
}
