//! The group coordinator on a broker: it coordinates the groups whose `__consumer_offsets`
//! partition this broker leads. Membership lives in memory (members re-join after a
//! coordinator change); committed offsets are appended to the offsets partition with
//! acks=all and loaded back from it when the broker takes the partition's leadership.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use super::assignor::{Strategy, TopicPartition};
use super::offsets::{self, OffsetKey, OffsetValue, OFFSETS_TOPIC};
use super::state::{GroupState, Member};
use crate::broker::error::BrokerError;
use crate::broker::node::{now_ms, Acks, BrokerNode};
use crate::error_code::ErrorCode;
use crate::partition::Isolation;
use crate::record::decode_data_records;
use crate::types::{LeaderEpoch, Offset};

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
        }
    }
}

/// One group as the coordinator holds it.
#[derive(Debug, Default)]
struct Group {
    state: GroupState,
    offsets: BTreeMap<OffsetKey, OffsetValue>,
}

#[derive(Default)]
struct Inner {
    /// Offsets partitions loaded, with the leader epoch they were loaded in.
    loaded: HashMap<u32, LeaderEpoch>,
    /// Groups of loaded partitions.
    groups: BTreeMap<String, Group>,
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
    /// Topics by name.
    pub topics: Vec<String>,
    /// Topic pattern.
    pub topic_regex: String,
    /// Strategy name.
    pub strategy: String,
    /// Broadcast group.
    pub broadcast: bool,
    /// Session timeout asked for (0: default).
    pub session_timeout_ms: u32,
    /// Partitions held.
    pub owned: BTreeSet<TopicPartition>,
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
    /// "empty", "stable" or "reconciling".
    pub state: String,
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
    /// Committed offsets.
    pub offsets: Vec<(OffsetKey, i64)>,
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
                if e.code == ErrorCode::NotLeaderOrFollower {
                    e.code = ErrorCode::NotCoordinator;
                    e.message = format!(
                        "broker {} does not coordinate group '{group}': {}",
                        self.node.id(),
                        e.message
                    );
                }
                e
            })?;
        if inner.loaded.get(&partition) == Some(&epoch) {
            return Ok(partition);
        }
        // New leadership of this partition: forget what we had, load the commits.
        let count = self
            .node
            .metadata()
            .topic(OFFSETS_TOPIC)
            .map_or(1, |t| t.partitions.len() as u32);
        inner
            .groups
            .retain(|name, _| offsets::partition_for(name, count) != partition);
        let loaded = tokio::task::spawn_blocking(move || {
            let mut out: BTreeMap<OffsetKey, OffsetValue> = BTreeMap::new();
            let end = local.log.log_end_offset();
            let mut next = local.log.log_start_offset();
            while next < end {
                let data = local
                    .log
                    .read(next, 1 << 20, Isolation::LogEnd)
                    .map_err(|e| BrokerError::from_log(&local.name(), e))?;
                let records = decode_data_records(&data.records, 64 << 20)
                    .map_err(|e| error(ErrorCode::CorruptMessage, e.to_string()))?;
                let Some(last) = records.last().map(|r| r.offset) else {
                    break;
                };
                for r in records.iter().filter(|r| r.offset as u64 >= next.0) {
                    match offsets::decode(r) {
                        Some((k, Some(v))) => {
                            out.insert(k, v);
                        }
                        Some((k, None)) => {
                            out.remove(&k);
                        }
                        None => {}
                    }
                }
                next = Offset(last as u64 + 1);
            }
            Ok::<_, BrokerError>(out)
        })
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
        inner.loaded.insert(partition, epoch);
        tracing::info!(partition, %epoch, offsets = n, "loaded committed offsets");
        Ok(partition)
    }

    /// The subscribed topics of `state`'s members with their partition counts.
    fn subscribed_topics(&self, state: &GroupState) -> BTreeMap<String, u32> {
        let patterns: Vec<regex::Regex> = state
            .members
            .values()
            .filter_map(|m| m.regex.as_deref())
            .filter_map(|r| regex::Regex::new(&format!("^(?:{r})$")).ok())
            .collect();
        self.node.metadata().read(|image| {
            image
                .topics
                .values()
                .filter(|t| t.name != OFFSETS_TOPIC)
                .filter(|t| {
                    state.members.values().any(|m| m.topics.contains(&t.name))
                        || patterns.iter().any(|p| p.is_match(&t.name))
                })
                .map(|t| (t.name.clone(), t.partitions.len() as u32))
                .collect()
        })
    }

    /// A member's heartbeat: join, stay or leave; returns what it should hold.
    pub async fn heartbeat(&self, hb: Heartbeat) -> Result<HeartbeatAnswer, BrokerError> {
        let strategy: Strategy = hb
            .strategy
            .parse()
            .map_err(|e: String| error(ErrorCode::InvalidRequest, e))?;
        if !hb.topic_regex.is_empty() {
            regex::Regex::new(&hb.topic_regex).map_err(|e| {
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
        if session < self.settings.session_timeout_min
            || session > self.settings.session_timeout_max
        {
            return Err(error(
                ErrorCode::InvalidRequest,
                format!(
                    "session_timeout_ms {} is outside [{}, {}]",
                    session.as_millis(),
                    self.settings.session_timeout_min.as_millis(),
                    self.settings.session_timeout_max.as_millis()
                ),
            ));
        }
        let mut inner = self.inner.lock().await;
        self.own(&mut inner, &hb.group).await?;
        let group = inner.groups.entry(hb.group.clone()).or_default();
        let state = &mut group.state;
        if hb.member_epoch == -1 {
            if state.remove(&hb.member_id) {
                tracing::info!(group = %hb.group, member = %hb.member_id, "member left");
            }
            return Ok(HeartbeatAnswer {
                member_id: hb.member_id,
                member_epoch: -1,
                heartbeat_interval: Duration::ZERO,
                assignment: BTreeSet::new(),
            });
        }
        let joining = hb.member_id.is_empty();
        let member_id = if joining {
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
            let id = uuid::Uuid::new_v4().to_string();
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
        let topics: BTreeSet<String> = hb.topics.iter().cloned().collect();
        let regex = (!hb.topic_regex.is_empty()).then(|| hb.topic_regex.clone());
        let member = state.members.get_mut(&member_id).expect("present");
        let changed = member.topics != topics || member.regex != regex;
        member.topics = topics;
        member.regex = regex;
        member.report_owned(joining, hb.owned);
        member.session_timeout = session;
        member.last_seen = Instant::now();
        if changed {
            state.bump();
        }
        let subscribed = self.subscribed_topics(state);
        state.set_topics(subscribed);
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
    pub async fn expire_members(&self) {
        let mut inner = self.inner.lock().await;
        let now = Instant::now();
        for (name, group) in inner.groups.iter_mut() {
            for id in group.state.expire(now) {
                tracing::info!(group = %name, member = %id, "member session expired; reassigning its partitions");
            }
        }
    }

    /// Commits offsets. `member_id` empty with epoch -1 is an administrative commit,
    /// allowed only while the group has no members.
    pub async fn commit(
        &self,
        group: &str,
        member_id: &str,
        member_epoch: i32,
        instance_for_broadcast: Option<String>,
        entries: Vec<(String, u32, i64, String)>,
    ) -> Result<(), BrokerError> {
        // The lock is held across the append, so the log and the memory see commits in
        // the same order (and the offsets clean-up snapshots a consistent view).
        let mut inner = self.inner.lock().await;
        let (partition, keys) = {
            let partition = self.own(&mut inner, group).await?;
            let g = inner.groups.entry(group.to_owned()).or_default();
            let instance = if member_id.is_empty() {
                if !g.state.members.is_empty() {
                    return Err(error(
                        ErrorCode::GroupNotEmpty,
                        format!(
                            "group '{group}' has {} active members; offsets can only be reset while it has none",
                            g.state.members.len()
                        ),
                    ));
                }
                instance_for_broadcast.unwrap_or_default()
            } else {
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
        self.append(partition, &keys).await?;
        metrics::counter!("tidelog_group_commits_total", "group" => group.to_owned()).increment(1);
        let g = inner.groups.entry(group.to_owned()).or_default();
        for (k, v) in keys {
            if let Some(v) = v {
                g.offsets.insert(k, v);
            }
        }
        Ok(())
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

    /// Committed offsets of `group` (of `instance` for broadcast groups), optionally only
    /// for `wanted` partitions.
    pub async fn fetch_offsets(
        &self,
        group: &str,
        instance: &str,
        wanted: &BTreeSet<TopicPartition>,
    ) -> Result<Vec<(OffsetKey, OffsetValue)>, BrokerError> {
        let mut inner = self.inner.lock().await;
        self.own(&mut inner, group).await?;
        let Some(g) = inner.groups.get(group) else {
            return Ok(Vec::new());
        };
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
        Ok(GroupDescription {
            state: g.state.state_name().to_owned(),
            strategy: g.state.strategy,
            broadcast: g.state.broadcast,
            epoch: g.state.epoch,
            members: g
                .state
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
                .collect(),
            offsets: g
                .offsets
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        })
    }

    /// Every group this broker coordinates, with its member count, epoch and committed
    /// offsets (for metrics).
    pub async fn snapshot(&self) -> Vec<GroupSnapshot> {
        let coordinated: Vec<String> = self.list().await.into_iter().map(|g| g.0).collect();
        let inner = self.inner.lock().await;
        coordinated
            .into_iter()
            .filter_map(|name| {
                let g = inner.groups.get(&name)?;
                Some(GroupSnapshot {
                    members: g.state.members.len(),
                    epoch: g.state.epoch,
                    offsets: g
                        .offsets
                        .iter()
                        .map(|(k, v)| (k.clone(), v.offset))
                        .collect(),
                    name,
                })
            })
            .collect()
    }

    /// The groups this broker coordinates: (name, state, members).
    pub async fn list(&self) -> Vec<(String, String, usize)> {
        let inner = self.inner.lock().await;
        let count = self
            .node
            .metadata()
            .topic(OFFSETS_TOPIC)
            .map_or(1, |t| t.partitions.len() as u32);
        inner
            .groups
            .iter()
            .filter(|(name, _)| {
                let p = offsets::partition_for(name, count);
                self.node.leader_partition(OFFSETS_TOPIC, p).is_ok()
                    && inner.loaded.contains_key(&p)
            })
            .map(|(name, g)| {
                (
                    name.clone(),
                    g.state.state_name().to_owned(),
                    g.state.members.len(),
                )
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
            if !g.state.members.is_empty() {
                return Err(error(
                    ErrorCode::GroupNotEmpty,
                    format!(
                        "group '{group}' has {} active members; stop them first",
                        g.state.members.len()
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

    /// Cleans up superseded commits: for each offsets partition this broker leads whose
    /// log holds many more records than live offsets, appends every live offset again
    /// and moves the log start to that copy, so older commits and tombstones are dropped
    /// (the latest commit per key survives).
    pub async fn compact_offsets(&self) {
        let inner = self.inner.lock().await;
        let count = self
            .node
            .metadata()
            .topic(OFFSETS_TOPIC)
            .map_or(1, |t| t.partitions.len() as u32);
        let partitions: Vec<(u32, LeaderEpoch)> =
            inner.loaded.iter().map(|(p, e)| (*p, *e)).collect();
        for (partition, epoch) in partitions {
            let Ok((local, current)) = self.node.leader_partition(OFFSETS_TOPIC, partition) else {
                continue;
            };
            if current != epoch {
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
