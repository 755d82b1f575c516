//! The cluster metadata image and the deterministic rules that change it.
//!
//! Every change is a [`MetadataCommand`] committed through Raft and applied here in log
//! order by every controller, so every controller holds the same image at the same
//! version (the log index of the last applied entry). [`MetadataImage::check`] is the
//! single place a command is validated: the Raft leader calls it before proposing (so a bad
//! request never reaches the log) and [`MetadataImage::apply`] calls it again, because two
//! commands checked against the same image can conflict once both are in the log.
//!
//! Invariants kept by `apply` (and asserted in tests):
//! - a partition's leader, when set, is in its ISR, and its ISR is a subset of its replicas;
//! - the ISR is never empty: the last member stays even when it is fenced, so it (and only
//!   it, unless unclean election is enabled) can lead again when it returns;
//! - the leader epoch grows on every leader change; the partition epoch on every change;
//! - a replica its broker reported offline is never elected and sits in the ISR only as
//!   its last member (the only copy of acknowledged data, kept for an operator).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::command::{CommandOutput, MetadataCommand};
use super::election::{elect_leader, Election};
use super::error::MetadataError;
use crate::error_code::ErrorCode;
use crate::types::BrokerId;

/// A broker's place in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BrokerState {
    /// Registered but not serving: missed heartbeats, or not ready yet. Leads nothing.
    Fenced,
    /// Alive and caught up: may lead partitions and sit in ISRs.
    Unfenced,
    /// Stopping: its leaderships are being moved away; it takes no new ones.
    ShuttingDown,
}

impl BrokerState {
    /// The name used in APIs and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            BrokerState::Fenced => "fenced",
            BrokerState::Unfenced => "unfenced",
            BrokerState::ShuttingDown => "shutting_down",
        }
    }
}

/// A registered broker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrokerRecord {
    /// The broker's id.
    pub id: BrokerId,
    /// Where clients and other brokers reach it.
    pub address: String,
    /// Its rack, for placement.
    pub rack: Option<String>,
    /// Where other brokers fetch from it (its internal listener); empty in records from
    /// before internal listeners existed.
    #[serde(default)]
    pub internal_address: String,
    /// Where Kafka clients reach it; `None` when it serves no Kafka listener (and in
    /// records from before Kafka listeners existed).
    #[serde(default)]
    pub kafka_address: Option<String>,
    /// Chosen by the broker process at start; a new one means a restarted process.
    pub incarnation_id: String,
    /// The metadata version of the registration; heartbeats must carry it.
    pub epoch: u64,
    /// Fenced, unfenced or shutting down.
    pub state: BrokerState,
}

/// One partition's replicas and leadership.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionRecord {
    /// The partition's number within its topic.
    pub partition: u32,
    /// The brokers holding a copy, the preferred leader first.
    pub replicas: Vec<BrokerId>,
    /// The in-sync replicas; never empty.
    pub isr: Vec<BrokerId>,
    /// The leader, if an eligible replica is alive.
    pub leader: Option<BrokerId>,
    /// Bumped on every leader change (including to no leader).
    pub leader_epoch: i32,
    /// Bumped on every change of leader or ISR.
    pub partition_epoch: i32,
    /// During a reassignment: target replicas that are not replicas yet (they are in
    /// `replicas` while they catch up).
    #[serde(default)]
    pub adding_replicas: Vec<BrokerId>,
    /// During a reassignment: replicas that leave once every target replica is in sync.
    #[serde(default)]
    pub removing_replicas: Vec<BrokerId>,
    /// Replicas whose broker reported its copy unusable (damaged or failed storage). They
    /// are never elected and never join the ISR until their broker reports them usable.
    #[serde(default)]
    pub offline_replicas: Vec<BrokerId>,
}

impl PartitionRecord {
    /// The replicas a reassignment in progress moves to (the replicas when none runs).
    pub fn target_replicas(&self) -> Vec<BrokerId> {
        self.replicas
            .iter()
            .copied()
            .filter(|b| !self.removing_replicas.contains(b))
            .collect()
    }

    /// True while a reassignment runs.
    pub fn is_reassigning(&self) -> bool {
        !self.adding_replicas.is_empty() || !self.removing_replicas.is_empty()
    }
}

/// A topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopicRecord {
    /// A UUID, new for each creation of the name.
    pub id: String,
    /// The topic's name.
    pub name: String,
    /// Replicas per partition.
    pub replication_factor: u32,
    /// Per-topic overrides of the defaults (Kafka's key names).
    pub config: BTreeMap<String, String>,
    /// Partitions `0..n`, in order.
    pub partitions: Vec<PartitionRecord>,
}

impl TopicRecord {
    /// Whether unclean leader election is enabled for this topic.
    pub fn unclean_election_enabled(&self) -> bool {
        self.config
            .get("unclean.leader.election.enable")
            .is_some_and(|v| v == "true")
    }
}

/// One change applied to the image, as sent to brokers following metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetadataChange {
    /// The cluster id was set.
    ClusterId(String),
    /// A broker was registered or changed state.
    Broker(BrokerRecord),
    /// A topic was created, gained partitions, or changed configuration.
    Topic(TopicRecord),
    /// A topic was deleted.
    TopicDeleted {
        /// Its name.
        name: String,
        /// Its id.
        id: String,
    },
    /// A partition's leader or ISR changed.
    Partition {
        /// The topic's name.
        topic: String,
        /// The topic's id.
        topic_id: String,
        /// The partition's new state.
        partition: PartitionRecord,
    },
}

/// The whole cluster metadata: what every controller holds and brokers mirror.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetadataImage {
    /// Set once, by the first Raft leader.
    pub cluster_id: Option<String>,
    /// Registered brokers by id.
    pub brokers: BTreeMap<BrokerId, BrokerRecord>,
    /// Topics by name.
    pub topics: BTreeMap<String, TopicRecord>,
    /// The next idempotent producer id to hand out.
    #[serde(default)]
    pub next_producer_id: i64,
}

/// Starts moving `p` to `target`: the targets become replicas (first, in order), the
/// others are marked for removal.
fn start_reassignment(p: &mut PartitionRecord, target: &[BrokerId]) {
    let mut replicas = target.to_vec();
    replicas.extend(p.replicas.iter().copied().filter(|b| !target.contains(b)));
    p.removing_replicas = p
        .replicas
        .iter()
        .copied()
        .filter(|b| !target.contains(b))
        .collect();
    p.replicas = replicas;
    p.adding_replicas = target
        .iter()
        .copied()
        .filter(|b| !p.isr.contains(b))
        .collect();
}

/// Finishes a reassignment once every target replica is in the ISR: the removed replicas
/// leave the replica set and the ISR, and the leader moves to a target if it is leaving.
fn advance_reassignment(p: &mut PartitionRecord, is_live: impl Fn(BrokerId) -> bool) {
    if !p.is_reassigning() {
        return;
    }
    let target = p.target_replicas();
    p.adding_replicas = target
        .iter()
        .copied()
        .filter(|b| !p.isr.contains(b))
        .collect();
    if !p.adding_replicas.is_empty() {
        return;
    }
    let remaining_isr: Vec<BrokerId> = p
        .isr
        .iter()
        .copied()
        .filter(|b| target.contains(b))
        .collect();
    p.replicas = target;
    p.removing_replicas.clear();
    p.isr = remaining_isr;
    if p.leader.is_some_and(|l| !p.replicas.contains(&l)) {
        p.leader = match elect_leader(p, is_live, false) {
            Election::Clean(b) => Some(b),
            _ => None,
        };
    }
}

/// The preferred replica (the first target replica) when it should take over: it is live,
/// in sync, and not the leader already.
pub fn preferred_leader(
    p: &PartitionRecord,
    is_live: impl Fn(BrokerId) -> bool,
) -> Option<BrokerId> {
    let preferred = *p.target_replicas().first()?;
    (p.leader != Some(preferred)
        && p.isr.contains(&preferred)
        && !p.offline_replicas.contains(&preferred)
        && is_live(preferred))
    .then_some(preferred)
}

/// `broker`'s replica of `p` becomes offline (or usable again); returns the partition's
/// next state, or `None` when nothing changes. An offline replica leaves the ISR unless
/// it is the last member (the only copy of acknowledged data stays its leader, offline,
/// for an operator to repair), and its leadership moves to another live in-sync replica.
/// A replica usable again leads a leaderless partition it is in sync for.
pub fn mark_replica(
    p: &PartitionRecord,
    broker: BrokerId,
    offline: bool,
    is_live: impl Fn(BrokerId) -> bool,
) -> Option<PartitionRecord> {
    let marked = p.offline_replicas.contains(&broker);
    let mut next = p.clone();
    if !offline {
        if !marked {
            return None;
        }
        next.offline_replicas.retain(|b| *b != broker);
        if next.leader.is_none() {
            // It may be the live in-sync replica a leaderless partition waits for.
            if let Election::Clean(b) = elect_leader(&next, is_live, false) {
                next.leader = Some(b);
            }
        }
        return Some(next);
    }
    let in_isr = p.isr.contains(&broker) && p.isr.len() > 1;
    if marked && !in_isr && p.leader != Some(broker) {
        return None;
    }
    if !marked {
        next.offline_replicas.push(broker);
    }
    if in_isr {
        next.isr.retain(|b| *b != broker);
    }
    if p.leader == Some(broker) && next.isr.len() < p.isr.len() {
        // Clean election only: the offline copy may have lost records that others hold.
        next.leader = match elect_leader(&next, |b| b != broker && is_live(b), false) {
            Election::Clean(b) => Some(b),
            _ => None,
        };
    }
    (next != *p).then_some(next)
}

fn reject(code: ErrorCode, message: impl Into<String>) -> Result<(), MetadataError> {
    Err(MetadataError::new(code, message))
}

impl MetadataImage {
    /// Brokers that may take replicas and leaderships.
    pub fn unfenced_brokers(&self) -> impl Iterator<Item = &BrokerRecord> {
        self.brokers
            .values()
            .filter(|b| b.state == BrokerState::Unfenced)
    }

    fn is_live(&self, id: BrokerId) -> bool {
        self.brokers
            .get(&id)
            .is_some_and(|b| b.state == BrokerState::Unfenced)
    }

    fn topic_with_id(&self, name: &str, id: &str) -> Result<&TopicRecord, MetadataError> {
        match self.topics.get(name) {
            Some(t) if id.is_empty() || t.id == id => Ok(t),
            _ => Err(MetadataError::new(
                ErrorCode::UnknownTopicOrPartition,
                format!("topic '{name}' does not exist"),
            )),
        }
    }

    fn broker_with_epoch(&self, id: BrokerId, epoch: u64) -> Result<&BrokerRecord, MetadataError> {
        let Some(broker) = self.brokers.get(&id) else {
            return Err(MetadataError::new(
                ErrorCode::BrokerNotRegistered,
                format!("broker {id} is not registered"),
            ));
        };
        if broker.epoch != epoch {
            return Err(MetadataError::new(
                ErrorCode::StaleBrokerEpoch,
                format!(
                    "broker {id} sent epoch {epoch}, but its current registration has epoch {}",
                    broker.epoch
                ),
            ));
        }
        Ok(broker)
    }

    fn check_assignments(
        &self,
        assignments: &[Vec<BrokerId>],
        replication_factor: u32,
    ) -> Result<(), MetadataError> {
        for (i, replicas) in assignments.iter().enumerate() {
            if replicas.len() != replication_factor as usize {
                return reject(
                    ErrorCode::InvalidReplicaAssignment,
                    format!(
                        "partition {i} has {} replicas, expected {replication_factor}",
                        replicas.len()
                    ),
                );
            }
            let distinct: BTreeSet<_> = replicas.iter().collect();
            if distinct.len() != replicas.len() {
                return reject(
                    ErrorCode::InvalidReplicaAssignment,
                    format!("partition {i} names a broker twice: {replicas:?}"),
                );
            }
            if let Some(unknown) = replicas.iter().find(|b| !self.brokers.contains_key(b)) {
                return reject(
                    ErrorCode::InvalidReplicaAssignment,
                    format!("partition {i} names broker {unknown}, which is not registered"),
                );
            }
        }
        Ok(())
    }

    /// Whether `cmd` can be applied to this image; the error says which field and why.
    pub fn check(&self, cmd: &MetadataCommand) -> Result<(), MetadataError> {
        match cmd {
            MetadataCommand::InitCluster { .. } => Ok(()),
            MetadataCommand::SetOfflineReplicas { id, epoch, .. } => {
                self.broker_with_epoch(*id, *epoch)?;
                Ok(())
            }
            MetadataCommand::AllocateProducerIds { count } => {
                if *count == 0 || *count > 1_000_000 {
                    return reject(
                        ErrorCode::InvalidRequest,
                        format!("producer ids are allocated 1 to 1000000 at a time, not {count}"),
                    );
                }
                Ok(())
            }
            MetadataCommand::RegisterBroker { id, address, .. } => {
                if id.0 < 0 {
                    return reject(
                        ErrorCode::InvalidRequest,
                        format!("broker_id must be >= 0, got {id}"),
                    );
                }
                if address.is_empty() {
                    return reject(ErrorCode::InvalidRequest, "address must not be empty");
                }
                Ok(())
            }
            MetadataCommand::UnfenceBroker { id, epoch }
            | MetadataCommand::FenceBroker { id, epoch }
            | MetadataCommand::BeginControlledShutdown { id, epoch } => {
                self.broker_with_epoch(*id, *epoch).map(|_| ())
            }
            MetadataCommand::CreateTopic {
                name,
                replication_factor,
                config,
                assignments,
                ..
            } => {
                super::validation::validate_topic_name(name)?;
                if self.topics.contains_key(name) {
                    return reject(
                        ErrorCode::TopicAlreadyExists,
                        format!("topic '{name}' already exists"),
                    );
                }
                if assignments.is_empty() {
                    return reject(ErrorCode::InvalidPartitions, "a topic needs >= 1 partition");
                }
                super::validation::validate_topic_config(config)?;
                self.check_assignments(assignments, *replication_factor)
            }
            MetadataCommand::AlterTopic {
                topic,
                topic_id,
                config,
                new_partitions,
            } => {
                let t = self.topic_with_id(topic, topic_id)?;
                if let Some(config) = config {
                    super::validation::validate_topic_config(config)?;
                }
                let total = t.partitions.len() + new_partitions.len();
                if total > super::validation::PARTITIONS_PER_TOPIC_MAX as usize {
                    return reject(
                        ErrorCode::InvalidPartitions,
                        format!(
                            "topic '{topic}' would have {total} partitions; the limit is {}",
                            super::validation::PARTITIONS_PER_TOPIC_MAX
                        ),
                    );
                }
                self.check_assignments(new_partitions, t.replication_factor)
            }
            MetadataCommand::DeleteTopic { name, id } => self.topic_with_id(name, id).map(|_| ()),
            MetadataCommand::ReassignPartitions {
                topic,
                topic_id,
                reassignments,
            } => {
                let t = self.topic_with_id(topic, topic_id)?;
                if reassignments.is_empty() {
                    return reject(ErrorCode::InvalidRequest, "no partition to reassign");
                }
                let mut seen = BTreeSet::new();
                for r in reassignments {
                    if t.partitions.get(r.partition as usize).is_none() {
                        return reject(
                            ErrorCode::UnknownTopicOrPartition,
                            format!(
                                "topic '{topic}' has {} partitions; there is no partition {}",
                                t.partitions.len(),
                                r.partition
                            ),
                        );
                    }
                    if !seen.insert(r.partition) {
                        return reject(
                            ErrorCode::InvalidRequest,
                            format!("partition {} is reassigned twice", r.partition),
                        );
                    }
                    if r.replicas.is_empty() {
                        return reject(
                            ErrorCode::InvalidReplicaAssignment,
                            format!(
                                "partition {}: the target replica list is empty",
                                r.partition
                            ),
                        );
                    }
                    let distinct: BTreeSet<_> = r.replicas.iter().collect();
                    if distinct.len() != r.replicas.len() {
                        return reject(
                            ErrorCode::InvalidReplicaAssignment,
                            format!(
                                "partition {}: the target replicas repeat a broker: {:?}",
                                r.partition,
                                r.replicas.iter().map(|b| b.0).collect::<Vec<_>>()
                            ),
                        );
                    }
                    if let Some(b) = r.replicas.iter().find(|b| !self.brokers.contains_key(b)) {
                        return reject(
                            ErrorCode::InvalidReplicaAssignment,
                            format!("partition {}: broker {b} is not registered", r.partition),
                        );
                    }
                }
                Ok(())
            }
            MetadataCommand::ElectPreferredLeaders { topics } => {
                for name in topics {
                    if !self.topics.contains_key(name) {
                        return reject(
                            ErrorCode::UnknownTopicOrPartition,
                            format!("topic '{name}' does not exist"),
                        );
                    }
                }
                Ok(())
            }
            MetadataCommand::AlterPartition {
                broker_id,
                broker_epoch,
                topic,
                topic_id,
                partition,
                leader_epoch,
                partition_epoch,
                new_isr,
            } => {
                let broker = self.broker_with_epoch(*broker_id, *broker_epoch)?;
                if broker.state == BrokerState::Fenced {
                    return reject(
                        ErrorCode::StaleBrokerEpoch,
                        format!("broker {broker_id} is fenced"),
                    );
                }
                let t = self.topic_with_id(topic, topic_id)?;
                let Some(p) = t.partitions.get(*partition as usize) else {
                    return reject(
                        ErrorCode::UnknownTopicOrPartition,
                        format!("topic '{topic}' has no partition {partition}"),
                    );
                };
                if *leader_epoch < p.leader_epoch {
                    return reject(
                        ErrorCode::FencedLeaderEpoch,
                        format!(
                            "{topic}-{partition}: leader epoch {leader_epoch} is older than the current {}",
                            p.leader_epoch
                        ),
                    );
                }
                if p.leader != Some(*broker_id) || *leader_epoch != p.leader_epoch {
                    return reject(
                        ErrorCode::NotLeaderOrFollower,
                        format!(
                            "{topic}-{partition}: broker {broker_id} does not lead epoch {leader_epoch}"
                        ),
                    );
                }
                if *partition_epoch != p.partition_epoch {
                    return reject(
                        ErrorCode::InvalidUpdateVersion,
                        format!(
                            "{topic}-{partition}: partition epoch {partition_epoch} is not the current {}",
                            p.partition_epoch
                        ),
                    );
                }
                if p.offline_replicas.contains(broker_id) {
                    return reject(
                        ErrorCode::IneligibleReplica,
                        format!("{topic}-{partition}: the leader {broker_id} reported its replica offline"),
                    );
                }
                if !new_isr.contains(broker_id) {
                    return reject(
                        ErrorCode::InvalidRequest,
                        format!(
                            "{topic}-{partition}: the new ISR must contain the leader {broker_id}"
                        ),
                    );
                }
                let distinct: BTreeSet<_> = new_isr.iter().collect();
                if distinct.len() != new_isr.len() {
                    return reject(
                        ErrorCode::InvalidRequest,
                        format!("{topic}-{partition}: the new ISR repeats a broker: {new_isr:?}"),
                    );
                }
                for member in new_isr {
                    if !p.isr.contains(member) && p.offline_replicas.contains(member) {
                        return reject(
                            ErrorCode::IneligibleReplica,
                            format!("{topic}-{partition}: broker {member} reported its replica offline and cannot join the ISR"),
                        );
                    }
                    if !p.replicas.contains(member) {
                        return reject(
                            ErrorCode::IneligibleReplica,
                            format!("{topic}-{partition}: broker {member} is not a replica"),
                        );
                    }
                    if !p.isr.contains(member) && !self.is_live(*member) {
                        return reject(
                            ErrorCode::IneligibleReplica,
                            format!("{topic}-{partition}: broker {member} is fenced and cannot join the ISR"),
                        );
                    }
                }
                Ok(())
            }
        }
    }

    /// Checks and applies `cmd` as the entry at `version`; returns the command's result and
    /// the changes it made (none when it was rejected).
    pub fn apply(
        &mut self,
        cmd: &MetadataCommand,
        version: u64,
    ) -> (Result<CommandOutput, MetadataError>, Vec<MetadataChange>) {
        if let Err(e) = self.check(cmd) {
            return (Err(e), Vec::new());
        }
        let mut changes = Vec::new();
        let output = match cmd {
            MetadataCommand::AllocateProducerIds { count } => {
                let first = self.next_producer_id;
                self.next_producer_id += i64::from(*count);
                CommandOutput::ProducerIds(first)
            }
            MetadataCommand::InitCluster { cluster_id } => {
                if self.cluster_id.is_none() {
                    self.cluster_id = Some(cluster_id.clone());
                    changes.push(MetadataChange::ClusterId(cluster_id.clone()));
                }
                CommandOutput::Done
            }
            MetadataCommand::RegisterBroker {
                id,
                address,
                rack,
                incarnation_id,
                internal_address,
                kafka_address,
            } => {
                if let Some(existing) = self.brokers.get(id) {
                    if existing.incarnation_id == *incarnation_id {
                        return (Ok(CommandOutput::BrokerEpoch(existing.epoch)), changes);
                    }
                    // A new process took over the id: the old one is gone, and so are
                    // its reports of offline replicas (the new one reports its own).
                    self.fence_partitions(*id, &mut changes);
                    let live = self.live_set();
                    self.update_partitions(&mut changes, |_, p| {
                        mark_replica(p, *id, false, |b| b != *id && live.contains(&b))
                    });
                }
                let record = BrokerRecord {
                    id: *id,
                    address: address.clone(),
                    rack: rack.clone(),
                    internal_address: internal_address.clone(),
                    kafka_address: kafka_address.clone(),
                    incarnation_id: incarnation_id.clone(),
                    epoch: version,
                    state: BrokerState::Fenced,
                };
                self.brokers.insert(*id, record.clone());
                changes.push(MetadataChange::Broker(record));
                CommandOutput::BrokerEpoch(version)
            }
            MetadataCommand::UnfenceBroker { id, .. } => {
                self.set_broker_state(*id, BrokerState::Unfenced, &mut changes);
                self.elect_leaderless(*id, &mut changes);
                CommandOutput::Done
            }
            MetadataCommand::FenceBroker { id, .. } => {
                self.set_broker_state(*id, BrokerState::Fenced, &mut changes);
                self.fence_partitions(*id, &mut changes);
                CommandOutput::Done
            }
            MetadataCommand::BeginControlledShutdown { id, .. } => {
                self.set_broker_state(*id, BrokerState::ShuttingDown, &mut changes);
                self.move_leadership_off(*id, &mut changes);
                CommandOutput::Done
            }
            MetadataCommand::SetOfflineReplicas { id, replicas, .. } => {
                let offline: BTreeSet<(&str, u32)> = replicas
                    .iter()
                    .map(|r| (r.topic_id.as_str(), r.partition))
                    .collect();
                let live = self.live_set();
                let mut count = 0u64;
                self.update_partitions(&mut changes, |t, p| {
                    if !p.replicas.contains(id) {
                        return None;
                    }
                    let next = mark_replica(
                        p,
                        *id,
                        offline.contains(&(t.id.as_str(), p.partition)),
                        |b| live.contains(&b),
                    )?;
                    count += 1;
                    Some(next)
                });
                CommandOutput::Count(count)
            }
            MetadataCommand::CreateTopic {
                name,
                id,
                replication_factor,
                config,
                assignments,
            } => {
                let partitions = assignments
                    .iter()
                    .enumerate()
                    .map(|(i, replicas)| self.new_partition(i as u32, replicas))
                    .collect();
                let topic = TopicRecord {
                    id: id.clone(),
                    name: name.clone(),
                    replication_factor: *replication_factor,
                    config: config.clone(),
                    partitions,
                };
                self.topics.insert(name.clone(), topic.clone());
                changes.push(MetadataChange::Topic(topic));
                CommandOutput::Done
            }
            MetadataCommand::AlterTopic {
                topic,
                config,
                new_partitions,
                ..
            } => {
                let start = self.topics[topic].partitions.len();
                let new: Vec<_> = new_partitions
                    .iter()
                    .enumerate()
                    .map(|(i, replicas)| self.new_partition((start + i) as u32, replicas))
                    .collect();
                let t = self.topics.get_mut(topic).expect("checked");
                t.partitions.extend(new);
                if let Some(config) = config {
                    t.config = config.clone();
                }
                changes.push(MetadataChange::Topic(t.clone()));
                CommandOutput::Done
            }
            MetadataCommand::DeleteTopic { name, .. } => {
                let t = self.topics.remove(name).expect("checked");
                changes.push(MetadataChange::TopicDeleted {
                    name: t.name,
                    id: t.id,
                });
                CommandOutput::Done
            }
            MetadataCommand::ReassignPartitions {
                topic,
                reassignments,
                ..
            } => {
                let live = self.live_set();
                let t = self.topics.get_mut(topic).expect("checked");
                for r in reassignments {
                    let p = &mut t.partitions[r.partition as usize];
                    let mut next = p.clone();
                    start_reassignment(&mut next, &r.replicas);
                    advance_reassignment(&mut next, |b| live.contains(&b));
                    if next.leader != p.leader {
                        next.leader_epoch += 1;
                    }
                    next.partition_epoch += 1;
                    *p = next.clone();
                    changes.push(MetadataChange::Partition {
                        topic: t.name.clone(),
                        topic_id: t.id.clone(),
                        partition: next,
                    });
                }
                CommandOutput::Done
            }
            MetadataCommand::ElectPreferredLeaders { topics } => {
                let live = self.live_set();
                let mut elected = 0u64;
                self.update_partitions(&mut changes, |t, p| {
                    if !topics.is_empty() && !topics.contains(&t.name) {
                        return None;
                    }
                    let preferred = preferred_leader(p, |b| live.contains(&b))?;
                    elected += 1;
                    let mut next = p.clone();
                    next.leader = Some(preferred);
                    Some(next)
                });
                CommandOutput::Count(elected)
            }
            MetadataCommand::AlterPartition {
                topic,
                partition,
                new_isr,
                ..
            } => {
                let live = self.live_set();
                let t = self.topics.get_mut(topic).expect("checked");
                let p = &mut t.partitions[*partition as usize];
                let before = p.leader;
                p.isr = new_isr.clone();
                advance_reassignment(p, |b| live.contains(&b));
                if p.leader != before {
                    p.leader_epoch += 1;
                }
                p.partition_epoch += 1;
                let out = p.clone();
                changes.push(MetadataChange::Partition {
                    topic: t.name.clone(),
                    topic_id: t.id.clone(),
                    partition: out.clone(),
                });
                CommandOutput::Partition(out)
            }
        };
        (Ok(output), changes)
    }

    fn new_partition(&self, partition: u32, replicas: &[BrokerId]) -> PartitionRecord {
        let live: Vec<BrokerId> = replicas
            .iter()
            .copied()
            .filter(|b| self.is_live(*b))
            .collect();
        let (isr, leader) = if live.is_empty() {
            (replicas.to_vec(), None)
        } else {
            (live.clone(), Some(live[0]))
        };
        PartitionRecord {
            partition,
            replicas: replicas.to_vec(),
            isr,
            leader,
            leader_epoch: 0,
            partition_epoch: 0,
            adding_replicas: Vec::new(),
            removing_replicas: Vec::new(),
            offline_replicas: Vec::new(),
        }
    }

    fn set_broker_state(
        &mut self,
        id: BrokerId,
        state: BrokerState,
        changes: &mut Vec<MetadataChange>,
    ) {
        let broker = self.brokers.get_mut(&id).expect("checked");
        if broker.state != state {
            broker.state = state;
            changes.push(MetadataChange::Broker(broker.clone()));
        }
    }

    /// Runs `decide` on every partition and records the partitions it changed.
    fn update_partitions(
        &mut self,
        changes: &mut Vec<MetadataChange>,
        mut decide: impl FnMut(&TopicRecord, &PartitionRecord) -> Option<PartitionRecord>,
    ) {
        for t in self.topics.values_mut() {
            for i in 0..t.partitions.len() {
                if let Some(mut next) = decide(t, &t.partitions[i]) {
                    let p = &t.partitions[i];
                    if next.leader != p.leader {
                        next.leader_epoch = p.leader_epoch + 1;
                    }
                    next.partition_epoch = p.partition_epoch + 1;
                    changes.push(MetadataChange::Partition {
                        topic: t.name.clone(),
                        topic_id: t.id.clone(),
                        partition: next.clone(),
                    });
                    t.partitions[i] = next;
                }
            }
        }
    }

    fn live_set(&self) -> BTreeSet<BrokerId> {
        self.unfenced_brokers().map(|b| b.id).collect()
    }

    /// `gone` stopped: it leaves every ISR it is not the last member of, and every
    /// partition it led gets a new leader from the ISR (or none).
    fn fence_partitions(&mut self, gone: BrokerId, changes: &mut Vec<MetadataChange>) {
        let live = self.live_set();
        self.update_partitions(changes, |t, p| {
            if p.leader != Some(gone) && !(p.isr.contains(&gone) && p.isr.len() > 1) {
                return None;
            }
            let mut next = p.clone();
            if p.isr.len() > 1 {
                next.isr.retain(|b| *b != gone);
            }
            if p.leader == Some(gone) {
                match elect_leader(
                    &next,
                    |b| b != gone && live.contains(&b),
                    t.unclean_election_enabled(),
                ) {
                    Election::Clean(b) => next.leader = Some(b),
                    Election::Unclean(b) => {
                        next.leader = Some(b);
                        next.isr = vec![b];
                    }
                    Election::None => next.leader = None,
                }
            }
            Some(next)
        });
    }

    /// `stopping` is shutting down cleanly: hand each of its leaderships to another live
    /// ISR member and leave the ISRs where others remain. Partitions with no other live
    /// in-sync replica stay with it until it is fenced.
    fn move_leadership_off(&mut self, stopping: BrokerId, changes: &mut Vec<MetadataChange>) {
        let live = self.live_set();
        self.update_partitions(changes, |_, p| {
            let others_live = p.isr.iter().any(|b| *b != stopping && live.contains(b));
            if !p.isr.contains(&stopping) || !others_live {
                return None;
            }
            let mut next = p.clone();
            next.isr.retain(|b| *b != stopping);
            if p.leader == Some(stopping) {
                // Clean election only: moving leadership never loses data.
                if let Election::Clean(b) = elect_leader(&next, |b| live.contains(&b), false) {
                    next.leader = Some(b);
                }
            }
            Some(next)
        });
    }

    /// `back` was unfenced: it leads every leaderless partition it is eligible for.
    fn elect_leaderless(&mut self, back: BrokerId, changes: &mut Vec<MetadataChange>) {
        self.update_partitions(changes, |t, p| {
            if p.leader.is_some() || !p.replicas.contains(&back) {
                return None;
            }
            let mut next = p.clone();
            match elect_leader(p, |b| b == back, t.unclean_election_enabled()) {
                Election::Clean(b) => next.leader = Some(b),
                Election::Unclean(b) => {
                    next.leader = Some(b);
                    next.isr = vec![b];
                }
                Election::None => return None,
            }
            Some(next)
        });
    }

    /// Partitions whose ISR is smaller than their replica set.
    pub fn under_replicated_partitions(&self) -> usize {
        self.topics
            .values()
            .flat_map(|t| &t.partitions)
            .filter(|p| p.isr.len() < p.replicas.len())
            .count()
    }

    /// Partitions without a usable leader: none, or one whose replica is offline.
    pub fn offline_partitions(&self) -> usize {
        self.topics
            .values()
            .flat_map(|t| &t.partitions)
            .filter(|p| p.leader.is_none_or(|l| p.offline_replicas.contains(&l)))
            .count()
    }

    /// Asserts the invariants in the module doc; used by tests after every command.
    pub fn check_invariants(&self) -> Result<(), String> {
        for t in self.topics.values() {
            for p in &t.partitions {
                let at = format!("{}-{}", t.name, p.partition);
                if p.isr.is_empty() {
                    return Err(format!("{at}: empty ISR"));
                }
                if let Some(l) = p.leader {
                    if !p.isr.contains(&l) {
                        return Err(format!("{at}: leader {l} not in ISR {:?}", p.isr));
                    }
                }
                if let Some(b) = p.isr.iter().find(|b| !p.replicas.contains(b)) {
                    return Err(format!("{at}: ISR member {b} is not a replica"));
                }
                if p.isr.len() > 1 {
                    if let Some(b) = p.isr.iter().find(|b| p.offline_replicas.contains(b)) {
                        return Err(format!("{at}: offline replica {b} in ISR {:?}", p.isr));
                    }
                }
            }
        }
        Ok(())
    }
}
