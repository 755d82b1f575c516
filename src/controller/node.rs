//! One controller: its Raft instance, the applied metadata, and the operations the
//! controller APIs offer (topic admin, broker lifecycle, status).
//!
//! Writes are decided on the Raft leader: it validates against its image (after a
//! linearizable read barrier, so a new leader never decides on a stale image), computes
//! placements, and proposes one command; the state machine checks it again at apply time.
//! Broker liveness is leader-local memory, as in KRaft: heartbeats are not written to the
//! log; only state changes (fence, unfence, shutdown) are. A new leader gives every broker
//! a fresh session, so a leader change never fences a live broker.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, ServerState, SnapshotPolicy};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use super::command::{CommandOutput, MetadataCommand, Reassignment, ReplicaRef};
use super::error::{ControllerError, MetadataError, StartupError};
use super::log_store::LogStore;
use super::model::{BrokerState, MetadataImage, PartitionRecord, TopicRecord};
use super::network::Network;
use super::placement::{self, Load};
use super::raft_types::MetadataRaft;
use super::state_machine::{MetadataStore, StateMachine, SNAPSHOT_FILE};
use super::validation;
use crate::config::ControllerConfig;
use crate::error_code::ErrorCode;
use crate::types::{BrokerId, NodeId};

/// How often the leader looks for expired broker sessions.
const HOUSEKEEPING_INTERVAL: Duration = Duration::from_millis(200);

/// A topic to create.
#[derive(Debug, Clone, Default)]
pub struct NewTopic {
    /// The name.
    pub name: String,
    /// Partitions; `None` means 1.
    pub partitions: Option<u32>,
    /// Replicas per partition; `None` means 1.
    pub replication_factor: Option<u32>,
    /// Per-topic configuration.
    pub config: BTreeMap<String, String>,
    /// Only validate and place.
    pub validate_only: bool,
}

/// Changes to a topic.
#[derive(Debug, Clone, Default)]
pub struct TopicAlteration {
    /// The topic.
    pub name: String,
    /// The new partition count, if it changes.
    pub partitions: Option<u32>,
    /// Keys to set.
    pub set_config: BTreeMap<String, String>,
    /// Keys to remove (back to the default).
    pub delete_config: Vec<String>,
    /// Partitions to move to other replicas.
    pub reassignments: Vec<Reassignment>,
}

/// What a heartbeat tells the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeartbeatOutcome {
    /// The broker may not lead or serve.
    pub fenced: bool,
    /// Its leaderships are being moved away.
    pub in_controlled_shutdown: bool,
    /// It may stop now.
    pub should_shut_down: bool,
    /// The metadata version after the heartbeat.
    pub metadata_version: u64,
    /// How long a broker's session lasts without heartbeats.
    pub session_timeout: Duration,
}

/// A broker's heartbeat.
#[derive(Debug, Clone)]
pub struct Heartbeat {
    /// The broker.
    pub broker_id: BrokerId,
    /// Its registration epoch.
    pub broker_epoch: u64,
    /// It is not ready to serve.
    pub want_fence: bool,
    /// It is stopping.
    pub want_shut_down: bool,
    /// Every replica it holds but cannot serve.
    pub offline_replicas: Vec<ReplicaRef>,
}

/// This controller's view of itself (for `cluster describe`).
#[derive(Debug, Clone)]
pub struct NodeStatus {
    /// Its id.
    pub id: NodeId,
    /// Its address.
    pub address: String,
    /// Leader, follower, candidate, learner or shutdown.
    pub role: &'static str,
    /// Current term.
    pub term: u64,
    /// Highest log index known committed.
    pub commit_index: u64,
    /// Last applied index (the metadata version).
    pub applied_index: u64,
    /// Last log index.
    pub last_log_index: u64,
    /// The leader, when known.
    pub leader: Option<NodeId>,
    /// Last log index covered by the latest snapshot.
    pub snapshot_index: u64,
    /// Size of the latest snapshot file (0 before the first).
    pub snapshot_bytes: u64,
    /// On the leader: each follower's matched index.
    pub matched: BTreeMap<NodeId, u64>,
}

/// A running controller.
pub struct ControllerNode {
    id: NodeId,
    /// Every controller's internal address, by id.
    peers: BTreeMap<NodeId, String>,
    /// Where clients reach this controller.
    client_address: String,
    raft: MetadataRaft,
    store: Arc<MetadataStore>,
    log_store: LogStore,
    session_timeout: Duration,
    write_timeout: Duration,
    /// How often preferred leaders are restored (zero: never).
    leader_imbalance_interval: Duration,
    /// Leader-side: when each broker was last heard from.
    heartbeats: Mutex<HashMap<BrokerId, Instant>>,
    /// Leader-side: brokers that registered or heartbeated since this node became leader
    /// (the others only have the grace session a new leader gives).
    heard: Mutex<std::collections::HashSet<BrokerId>>,
    /// Leader-side: placements proposed but not yet applied, counted by placement.
    pending_placements: Mutex<Vec<(u64, Vec<Vec<BrokerId>>)>>,
    next_pending_id: Mutex<u64>,
    data_dir: PathBuf,
    /// Most replicas placement gives one broker (`max_partitions_per_broker`).
    partitions_per_broker_max: usize,
}

fn role_name(state: ServerState) -> &'static str {
    match state {
        ServerState::Leader => "leader",
        ServerState::Follower => "follower",
        ServerState::Candidate => "candidate",
        ServerState::Learner => "learner",
        ServerState::Shutdown => "shutdown",
    }
}

/// Checks (or records) which node a data directory belongs to.
fn claim_data_dir(data_dir: &std::path::Path, node_id: NodeId) -> Result<(), StartupError> {
    let io = |path: PathBuf| move |source| StartupError::Io { path, source };
    std::fs::create_dir_all(data_dir).map_err(io(data_dir.to_owned()))?;
    let path = data_dir.join("controller-node-id");
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let stored: NodeId = text.trim().parse().map_err(|_| {
                StartupError::Corrupt(format!(
                    "{}: '{}' is not a node id",
                    path.display(),
                    text.trim()
                ))
            })?;
            if stored != node_id {
                return Err(StartupError::Config(format!(
                    "data directory {} belongs to controller {stored}, not --node-id {node_id}",
                    data_dir.display()
                )));
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            super::log_store::write_atomically(&path, format!("{node_id}\n").as_bytes())
                .map_err(io(path.clone()))
        }
        Err(e) => Err(io(path)(e)),
    }
}

impl ControllerNode {
    /// Opens the data directory, starts Raft and, on a fresh quorum, initializes it with the
    /// configured peers (internal addresses, reached with `secret`). Fails when the peers'
    /// ids disagree with the stored membership; addresses may change (the configured ones
    /// are used).
    pub async fn start(
        config: &ControllerConfig,
        secret: Arc<crate::net::node_auth::ClusterSecret>,
    ) -> Result<Arc<Self>, StartupError> {
        config.validate().map_err(|e| StartupError::Config(e.0))?;
        let peers = config.peer_map().map_err(|e| StartupError::Config(e.0))?;
        claim_data_dir(&config.data_dir, config.node_id)?;
        let raft_dir = config.data_dir.join("raft");
        let log_store = LogStore::open_with_segment_bytes(&raft_dir, config.raft_log_segment_bytes)
            .map_err(|e| StartupError::Corrupt(e.to_string()))?;
        let state_machine = StateMachine::open(&raft_dir, config.metadata_history_max)
            .map_err(|e| StartupError::Corrupt(e.to_string()))?;
        let store = state_machine.store();
        let raft_config = openraft::Config {
            cluster_name: "tidelog-controllers".to_owned(),
            heartbeat_interval: config.raft_heartbeat_interval_ms,
            election_timeout_min: config.raft_election_timeout_min_ms,
            election_timeout_max: config.raft_election_timeout_max_ms,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(config.raft_snapshot_entries),
            max_in_snapshot_log_to_keep: config.raft_entries_kept_after_snapshot,
            purge_batch_size: 256,
            max_payload_entries: 1024,
            ..Default::default()
        }
        .validate()
        .map_err(|e| StartupError::Config(e.to_string()))?;
        let raft = MetadataRaft::new(
            config.node_id,
            Arc::new(raft_config),
            Network::new(peers.clone(), secret),
            log_store.clone(),
            state_machine,
        )
        .await
        .map_err(|e| StartupError::Raft(e.to_string()))?;
        let wanted: BTreeMap<NodeId, BasicNode> = peers
            .iter()
            .map(|(id, addr)| (*id, BasicNode::new(addr)))
            .collect();
        let initialized = raft
            .is_initialized()
            .await
            .map_err(|e| StartupError::Raft(e.to_string()))?;
        if initialized {
            let stored: BTreeMap<NodeId, String> = raft
                .metrics()
                .borrow()
                .membership_config
                .nodes()
                .map(|(id, n)| (*id, n.addr.clone()))
                .collect();
            if !stored.keys().eq(peers.keys()) {
                let _ = raft.shutdown().await;
                return Err(StartupError::Config(format!(
                    "--peers {} disagrees with the membership stored in {}: {}",
                    format_peers(&peers),
                    config.data_dir.display(),
                    format_peers(&stored)
                )));
            }
            if stored != peers {
                tracing::info!(stored = %format_peers(&stored), peers = %format_peers(&peers), "controller addresses differ from the stored membership; using --peers");
            }
        } else {
            tracing::info!(peers = %format_peers(&peers), "initializing a new controller quorum");
            if let Err(e) = raft.initialize(wanted).await {
                // Another peer may have initialized us first; that is fine.
                tracing::debug!(error = %e, "initialize");
            }
        }
        Ok(Arc::new(Self {
            id: config.node_id,
            peers,
            client_address: config.listen.clone(),
            raft,
            store,
            log_store,
            session_timeout: Duration::from_millis(config.broker_session_timeout_ms),
            write_timeout: Duration::from_millis(config.write_timeout_ms),
            leader_imbalance_interval: Duration::from_millis(
                config.leader_imbalance_check_interval_ms,
            ),
            heartbeats: Mutex::new(HashMap::new()),
            heard: Mutex::new(Default::default()),
            pending_placements: Mutex::new(Vec::new()),
            next_pending_id: Mutex::new(0),
            data_dir: config.data_dir.clone(),
            partitions_per_broker_max: config.max_partitions_per_broker,
        }))
    }

    /// This controller's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// Every controller's internal address by id.
    pub fn peers(&self) -> &BTreeMap<NodeId, String> {
        &self.peers
    }

    /// The Raft handle (for the Raft RPC service).
    pub fn raft(&self) -> &MetadataRaft {
        &self.raft
    }

    /// The applied metadata.
    pub fn store(&self) -> &Arc<MetadataStore> {
        &self.store
    }

    /// Bytes of Raft log on disk.
    pub fn raft_log_bytes(&self) -> u64 {
        self.log_store.disk_bytes()
    }

    /// The data directory.
    pub fn data_dir(&self) -> &std::path::Path {
        &self.data_dir
    }

    /// The leader's id and internal address, if known.
    pub fn leader(&self) -> Option<(NodeId, String)> {
        let leader = self.raft.metrics().borrow().current_leader?;
        Some((leader, self.peers.get(&leader)?.clone()))
    }

    fn is_leader(&self) -> bool {
        self.raft.metrics().borrow().current_leader == Some(self.id)
    }

    fn not_controller(&self) -> ControllerError {
        ControllerError::NotController {
            node_id: self.id,
            leader: self.leader().filter(|(id, _)| *id != self.id),
        }
    }

    /// Fails with NOT_CONTROLLER unless this node leads.
    pub fn ensure_leader(&self) -> Result<(), ControllerError> {
        if self.is_leader() {
            Ok(())
        } else {
            Err(self.not_controller())
        }
    }

    /// Fails with NOT_CONTROLLER unless this node leads, then waits until its image holds
    /// every committed entry, so reads and decisions see all earlier writes.
    pub async fn read_barrier(&self) -> Result<(), ControllerError> {
        self.ensure_leader()?;
        match tokio::time::timeout(self.write_timeout, self.raft.ensure_linearizable()).await {
            Err(_) => Err(ControllerError::Timeout(
                "could not confirm leadership with a quorum in time".to_owned(),
            )),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(RaftError::APIError(_))) => Err(self.not_controller()),
            Ok(Err(e)) => Err(ControllerError::Internal(e.to_string())),
        }
    }

    /// Proposes `cmd` and waits for it to be applied here; returns its output and version.
    pub async fn propose(
        &self,
        cmd: MetadataCommand,
    ) -> Result<(CommandOutput, u64), ControllerError> {
        let started = Instant::now();
        let written = tokio::time::timeout(self.write_timeout, self.raft.client_write(cmd)).await;
        metrics::histogram!("tidelog_controller_write_duration_seconds")
            .record(started.elapsed().as_secs_f64());
        match written {
            Err(_) => Err(ControllerError::Timeout(format!(
                "the metadata write was not committed within {} ms",
                self.write_timeout.as_millis()
            ))),
            Ok(Ok(response)) => match response.data {
                Ok(output) => Ok((output, response.log_id.index)),
                Err(e) => Err(ControllerError::Rejected(e)),
            },
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
                Err(ControllerError::NotController {
                    node_id: self.id,
                    leader: f
                        .leader_id
                        .and_then(|id| Some((id, self.peers.get(&id)?.clone()))),
                })
            }
            Ok(Err(e)) => Err(ControllerError::Internal(e.to_string())),
        }
    }

    fn check(&self, cmd: &MetadataCommand) -> Result<(), ControllerError> {
        self.store
            .read(|image, _| image.check(cmd))
            .map_err(ControllerError::Rejected)
    }

    /// [`Self::check`] without a read barrier first (the hot path); a rejection is
    /// confirmed after a barrier, because a newly elected leader may not have applied
    /// everything committed yet.
    async fn check_confirmed(&self, cmd: &MetadataCommand) -> Result<(), ControllerError> {
        if self.check(cmd).is_ok() {
            return Ok(());
        }
        self.read_barrier().await?;
        self.check(cmd)
    }

    /// Places partitions counting what is in the image and what is being proposed.
    fn place(
        &self,
        partitions: u32,
        replication_factor: u32,
    ) -> Result<(u64, Vec<Vec<BrokerId>>), ControllerError> {
        let (candidates, mut load) = self
            .store
            .read(|image, _| (placement::candidates(image), Load::of(image)));
        validation::validate_replication_factor(replication_factor, candidates.len())?;
        let mut pending = self.pending_placements.lock();
        for (_, assignments) in pending.iter() {
            load.add(assignments);
        }
        let before = load.clone();
        let assignments = placement::place(&candidates, &mut load, partitions, replication_factor);
        // Placement spreads evenly, so a broker over the limit means every choice would be.
        if let Some((broker, count)) =
            before.over_limit(&assignments, self.partitions_per_broker_max)
        {
            return Err(ControllerError::rejected(
                ErrorCode::PartitionLimitExceeded,
                format!(
                    "placing {partitions} partitions x {replication_factor} replicas would give broker {broker} {count} replicas; max_partitions_per_broker is {}",
                    self.partitions_per_broker_max
                ),
            ));
        }
        let mut next = self.next_pending_id.lock();
        *next += 1;
        pending.push((*next, assignments.clone()));
        Ok((*next, assignments))
    }

    fn forget_placement(&self, id: u64) {
        self.pending_placements.lock().retain(|(p, _)| *p != id);
    }

    /// Creates a topic; returns it and the version at which it exists.
    pub async fn create_topic(&self, req: NewTopic) -> Result<(TopicRecord, u64), ControllerError> {
        validation::validate_topic_name(&req.name)?;
        let partitions = req.partitions.unwrap_or(1);
        validation::validate_partition_count(partitions)?;
        let replication_factor = req.replication_factor.unwrap_or(1);
        validation::validate_topic_config(&req.config)?;
        validation::validate_min_insync_replicas(&req.config, replication_factor)?;
        self.read_barrier().await?;
        if self
            .store
            .read(|image, _| image.topics.contains_key(&req.name))
        {
            return Err(ControllerError::rejected(
                ErrorCode::TopicAlreadyExists,
                format!("topic '{}' already exists", req.name),
            ));
        }
        let (pending, assignments) = self.place(partitions, replication_factor)?;
        let cmd = MetadataCommand::CreateTopic {
            name: req.name.clone(),
            id: uuid::Uuid::new_v4().to_string(),
            replication_factor,
            config: req.config.clone(),
            assignments,
        };
        let result = self.create_checked(&req, cmd).await;
        self.forget_placement(pending);
        result
    }

    async fn reassign(
        &self,
        topic: &TopicRecord,
        reassignments: Vec<Reassignment>,
    ) -> Result<(TopicRecord, u64), ControllerError> {
        let cmd = MetadataCommand::ReassignPartitions {
            topic: topic.name.clone(),
            topic_id: topic.id.clone(),
            reassignments,
        };
        self.check(&cmd)?;
        let (_, version) = self.propose(cmd).await?;
        tracing::info!(topic = %topic.name, "partition reassignment started");
        self.topic_at(&topic.name, version)
    }

    /// A new idempotent producer id (epoch 0) and the metadata version.
    pub async fn allocate_producer_id(&self) -> Result<(i64, u64), ControllerError> {
        self.allocate_producer_ids(1).await
    }

    /// Reserves `count` consecutive producer ids; returns the first and the metadata
    /// version. Brokers reserve blocks so they can start producers without the quorum.
    pub async fn allocate_producer_ids(&self, count: u32) -> Result<(i64, u64), ControllerError> {
        match self
            .propose(MetadataCommand::AllocateProducerIds { count })
            .await?
        {
            (CommandOutput::ProducerIds(id), version) => Ok((id, version)),
            _ => Err(ControllerError::Internal(
                "producer id allocation returned no id".to_owned(),
            )),
        }
    }

    /// Checks that `broker_id` is registered with `broker_epoch` (on a fresh image when
    /// the local one disagrees).
    pub async fn check_broker_epoch(
        &self,
        broker_id: BrokerId,
        broker_epoch: u64,
    ) -> Result<(), ControllerError> {
        let current = |image: &MetadataImage| image.brokers.get(&broker_id).map(|b| b.epoch);
        if self.store.read(|image, _| current(image)) != Some(broker_epoch) {
            self.read_barrier().await?;
        }
        match self.store.read(|image, _| current(image)) {
            None => Err(MetadataError::new(
                ErrorCode::BrokerNotRegistered,
                format!("broker {broker_id} is not registered"),
            )
            .into()),
            Some(epoch) if epoch != broker_epoch => Err(MetadataError::new(
                ErrorCode::StaleBrokerEpoch,
                format!(
                    "broker {broker_id} sent epoch {broker_epoch}, but its current registration has epoch {epoch}"
                ),
            )
            .into()),
            Some(_) => Ok(()),
        }
    }

    /// Preferred-leader election over `topics` (all when empty); returns how many
    /// partitions changed leader and the metadata version.
    pub async fn elect_preferred_leaders(
        &self,
        topics: Vec<String>,
    ) -> Result<(u64, u64), ControllerError> {
        self.read_barrier().await?;
        let cmd = MetadataCommand::ElectPreferredLeaders { topics };
        self.check(&cmd)?;
        match self.propose(cmd).await? {
            (CommandOutput::Count(n), version) => Ok((n, version)),
            (_, version) => Ok((0, version)),
        }
    }

    async fn create_checked(
        &self,
        req: &NewTopic,
        cmd: MetadataCommand,
    ) -> Result<(TopicRecord, u64), ControllerError> {
        self.check(&cmd)?;
        if req.validate_only {
            let mut scratch = MetadataImage {
                brokers: self.store.read(|image, _| image.brokers.clone()),
                ..Default::default()
            };
            let (_, version) = (scratch.apply(&cmd, 0), self.store.version());
            return Ok((scratch.topics[&req.name].clone(), version));
        }
        let (_, version) = self.propose(cmd).await?;
        self.topic_at(&req.name, version)
    }

    fn topic_at(&self, name: &str, version: u64) -> Result<(TopicRecord, u64), ControllerError> {
        self.store.read(|image, v| match image.topics.get(name) {
            Some(t) => Ok((t.clone(), v.max(version))),
            None => Err(ControllerError::rejected(
                ErrorCode::UnknownTopicOrPartition,
                format!("topic '{name}' was deleted concurrently"),
            )),
        })
    }

    /// Adds partitions and/or changes configuration, atomically.
    pub async fn alter_topic(
        &self,
        req: TopicAlteration,
    ) -> Result<(TopicRecord, u64), ControllerError> {
        self.read_barrier().await?;
        let current = self
            .store
            .read(|image, _| image.topics.get(&req.name).cloned());
        let Some(current) = current else {
            return Err(ControllerError::rejected(
                ErrorCode::UnknownTopicOrPartition,
                format!("topic '{}' does not exist", req.name),
            ));
        };
        let have = current.partitions.len() as u32;
        let add = match req.partitions {
            Some(n) if n < have => {
                return Err(ControllerError::rejected(
                    ErrorCode::InvalidPartitions,
                    format!(
                        "topic '{}' has {have} partitions; the count can only grow (asked for {n})",
                        req.name
                    ),
                ))
            }
            Some(n) => {
                validation::validate_partition_count(n)?;
                n - have
            }
            None => 0,
        };
        let config = if req.set_config.is_empty() && req.delete_config.is_empty() {
            None
        } else {
            let mut config = current.config.clone();
            for key in &req.delete_config {
                if !crate::topic_config::KEYS.iter().any(|(k, _)| k == key) {
                    return Err(ControllerError::rejected(
                        ErrorCode::InvalidConfig,
                        format!("cannot delete config '{key}': unknown key"),
                    ));
                }
                config.remove(key);
            }
            config.extend(req.set_config.clone());
            validation::validate_topic_config(&config)?;
            validation::validate_min_insync_replicas(&config, current.replication_factor)?;
            Some(config)
        };
        if add == 0 && config.is_none() {
            if req.reassignments.is_empty() {
                return Ok((current, self.store.version()));
            }
            return self.reassign(&current, req.reassignments).await;
        }
        let (pending, new_partitions) = if add > 0 {
            self.place(add, current.replication_factor)?
        } else {
            (0, Vec::new())
        };
        let cmd = MetadataCommand::AlterTopic {
            topic: req.name.clone(),
            topic_id: current.id.clone(),
            config,
            new_partitions,
        };
        let result = async {
            self.check(&cmd)?;
            let (_, version) = self.propose(cmd).await?;
            self.topic_at(&req.name, version)
        }
        .await;
        self.forget_placement(pending);
        let (topic, version) = result?;
        if req.reassignments.is_empty() {
            return Ok((topic, version));
        }
        self.reassign(&topic, req.reassignments).await
    }

    /// Deletes a topic; returns the version at which it is gone.
    pub async fn delete_topic(&self, name: &str) -> Result<u64, ControllerError> {
        self.read_barrier().await?;
        let id = self
            .store
            .read(|image, _| image.topics.get(name).map(|t| t.id.clone()));
        let Some(id) = id else {
            return Err(ControllerError::rejected(
                ErrorCode::UnknownTopicOrPartition,
                format!("topic '{name}' does not exist"),
            ));
        };
        let cmd = MetadataCommand::DeleteTopic {
            name: name.to_owned(),
            id,
        };
        self.check(&cmd)?;
        Ok(self.propose(cmd).await?.1)
    }

    /// Registers a broker process; returns its epoch, the cluster id and the version.
    pub async fn register_broker(
        &self,
        id: BrokerId,
        address: String,
        internal_address: String,
        kafka_address: Option<String>,
        rack: Option<String>,
        incarnation_id: String,
    ) -> Result<(u64, String, u64), ControllerError> {
        self.read_barrier().await?;
        if incarnation_id.is_empty() {
            return Err(ControllerError::rejected(
                ErrorCode::InvalidRequest,
                "incarnation_id must not be empty",
            ));
        }
        if internal_address.is_empty() {
            return Err(ControllerError::rejected(
                ErrorCode::InvalidRequest,
                "internal_address must name the broker's internal listener (host:port)",
            ));
        }
        let existing = self.store.read(|image, _| image.brokers.get(&id).cloned());
        if let Some(b) = &existing {
            if b.incarnation_id == incarnation_id {
                self.heartbeats.lock().insert(id, Instant::now());
                self.heard.lock().insert(id);
                let (cluster_id, version) = self.cluster_id_and_version();
                return Ok((b.epoch, cluster_id, version));
            }
            let age = self.heartbeats.lock().get(&id).map(|t| t.elapsed());
            // Only a heartbeat this leader received proves the old process alive.
            let heard = self.heard.lock().contains(&id);
            if b.state != BrokerState::Fenced
                && heard
                && age.is_some_and(|a| a < self.session_timeout)
            {
                let age = age.unwrap_or_default();
                return Err(MetadataError::new(
                    ErrorCode::DuplicateBrokerRegistration,
                    format!(
                        "broker {id} is held by a live process at {} (incarnation {}, heard from {} ms ago); \
                         its session of {} ms must expire first",
                        b.address,
                        b.incarnation_id,
                        age.as_millis(),
                        self.session_timeout.as_millis()
                    ),
                )
                .with_retry_after(self.session_timeout.saturating_sub(age))
                .into());
            }
        }
        let cmd = MetadataCommand::RegisterBroker {
            id,
            address,
            internal_address,
            kafka_address,
            rack,
            incarnation_id,
        };
        self.check(&cmd)?;
        let (output, _) = self.propose(cmd).await?;
        let CommandOutput::BrokerEpoch(epoch) = output else {
            return Err(ControllerError::Internal(
                "registration returned no epoch".to_owned(),
            ));
        };
        self.heartbeats.lock().insert(id, Instant::now());
        self.heard.lock().insert(id);
        let (cluster_id, version) = self.cluster_id_and_version();
        tracing::info!(broker_id = %id, epoch, "broker registered");
        Ok((epoch, cluster_id, version))
    }

    fn cluster_id_and_version(&self) -> (String, u64) {
        self.store
            .read(|image, v| (image.cluster_id.clone().unwrap_or_default(), v))
    }

    /// Handles a broker heartbeat on the leader.
    pub async fn broker_heartbeat(
        &self,
        hb: Heartbeat,
    ) -> Result<HeartbeatOutcome, ControllerError> {
        self.ensure_leader()?;
        let known = self.store.read(|image, _| {
            image
                .brokers
                .get(&hb.broker_id)
                .is_some_and(|b| b.epoch == hb.broker_epoch)
        });
        if !known {
            // Confirm on a fresh image before telling a broker to register again.
            self.read_barrier().await?;
        }
        let state = self
            .store
            .read(|image, _| match image.brokers.get(&hb.broker_id) {
                None => Err(MetadataError::new(
                    ErrorCode::BrokerNotRegistered,
                    format!("broker {} is not registered", hb.broker_id),
                )),
                Some(b) if b.epoch != hb.broker_epoch => Err(MetadataError::new(
                    ErrorCode::StaleBrokerEpoch,
                    format!(
                        "broker {} sent epoch {}, but its current registration has epoch {}",
                        hb.broker_id, hb.broker_epoch, b.epoch
                    ),
                )),
                Some(b) => Ok(b.state),
            })?;
        self.heartbeats.lock().insert(hb.broker_id, Instant::now());
        self.heard.lock().insert(hb.broker_id);
        let (id, epoch) = (hb.broker_id, hb.broker_epoch);
        // Before unfencing: a replica reported offline must not be elected on the way.
        // A failure here must not fail the heartbeat (the broker's lease depends on it):
        // the next heartbeat reports the same list again.
        if let Err(e) = self
            .update_offline_replicas(id, epoch, &hb.offline_replicas)
            .await
        {
            tracing::warn!(broker_id = %id, error = %e, "could not record the broker's offline replicas; retrying on its next heartbeat");
        }
        let mut state = state;
        let mut should_shut_down = false;
        if hb.want_shut_down {
            if state == BrokerState::Unfenced {
                self.propose(MetadataCommand::BeginControlledShutdown { id, epoch })
                    .await?;
                tracing::info!(broker_id = %id, "controlled shutdown: leaderships moved");
                state = BrokerState::ShuttingDown;
            }
            if state == BrokerState::ShuttingDown {
                self.propose(MetadataCommand::FenceBroker { id, epoch })
                    .await?;
                state = BrokerState::Fenced;
            }
            should_shut_down = true;
        } else if state == BrokerState::Fenced && !hb.want_fence {
            self.propose(MetadataCommand::UnfenceBroker { id, epoch })
                .await?;
            tracing::info!(broker_id = %id, "broker unfenced");
            state = BrokerState::Unfenced;
        }
        Ok(HeartbeatOutcome {
            fenced: state == BrokerState::Fenced,
            in_controlled_shutdown: state == BrokerState::ShuttingDown,
            should_shut_down,
            metadata_version: self.store.version(),
            session_timeout: self.session_timeout,
        })
    }

    /// Commits `broker`'s report of offline replicas when it differs from the metadata
    /// (replicas of partitions it does not hold are ignored).
    async fn update_offline_replicas(
        &self,
        id: BrokerId,
        epoch: u64,
        reported: &[ReplicaRef],
    ) -> Result<(), ControllerError> {
        let (current, wanted) = self.store.read(|image, _| {
            let mut current = std::collections::BTreeSet::new();
            let mut wanted = std::collections::BTreeSet::new();
            for t in image.topics.values() {
                for p in t.partitions.iter().filter(|p| p.replicas.contains(&id)) {
                    let r = ReplicaRef {
                        topic_id: t.id.clone(),
                        partition: p.partition,
                    };
                    if p.offline_replicas.contains(&id) {
                        current.insert(r.clone());
                    }
                    if reported.contains(&r) {
                        wanted.insert(r);
                    }
                }
            }
            (current, wanted)
        });
        if current == wanted {
            return Ok(());
        }
        tracing::warn!(broker_id = %id, offline = wanted.len(), was = current.len(), "broker reports a new set of offline replicas");
        self.propose(MetadataCommand::SetOfflineReplicas {
            id,
            epoch,
            replicas: wanted.into_iter().collect(),
        })
        .await?;
        Ok(())
    }

    /// Applies an ISR change proposed by a partition leader.
    pub async fn alter_partition(
        &self,
        cmd: MetadataCommand,
    ) -> Result<(PartitionRecord, u64), ControllerError> {
        if !matches!(cmd, MetadataCommand::AlterPartition { .. }) {
            return Err(ControllerError::Internal(
                "not an AlterPartition".to_owned(),
            ));
        }
        self.ensure_leader()?;
        self.check_confirmed(&cmd).await?;
        match self.propose(cmd).await? {
            (CommandOutput::Partition(p), version) => Ok((p, version)),
            _ => Err(ControllerError::Internal(
                "AlterPartition returned no partition".to_owned(),
            )),
        }
    }

    /// Milliseconds since the leader last heard from each broker (leader only).
    pub fn heartbeat_ages(&self) -> HashMap<BrokerId, u64> {
        self.heartbeats
            .lock()
            .iter()
            .map(|(id, t)| (*id, t.elapsed().as_millis() as u64))
            .collect()
    }

    /// This node's Raft status.
    pub async fn status(&self) -> NodeStatus {
        let committed = self
            .raft
            .with_raft_state(|st| st.committed.map_or(0, |l| l.index))
            .await
            .ok();
        let m = self.raft.metrics().borrow().clone();
        let matched = m
            .replication
            .as_ref()
            .map(|r| {
                r.iter()
                    .map(|(id, l)| (*id, l.map_or(0, |l| l.index)))
                    .collect()
            })
            .unwrap_or_default();
        let applied = m.last_applied.map_or(0, |l| l.index);
        NodeStatus {
            id: self.id,
            address: self.client_address.clone(),
            role: role_name(m.state),
            term: m.current_term,
            commit_index: committed.unwrap_or(applied).max(applied),
            applied_index: applied,
            last_log_index: m.last_log_index.unwrap_or(0),
            leader: m.current_leader,
            snapshot_index: m.snapshot.map_or(0, |l| l.index),
            snapshot_bytes: std::fs::metadata(self.data_dir.join("raft").join(SNAPSHOT_FILE))
                .map_or(0, |f| f.len()),
            matched,
        }
    }

    /// Leader duties until `cancel`: set the cluster id once, and fence brokers whose
    /// session expired. A newly elected leader first gives every broker a fresh session.
    pub async fn run_housekeeping(self: Arc<Self>, cancel: CancellationToken) {
        let mut led_term: Option<u64> = None;
        let mut tick = tokio::time::interval(HOUSEKEEPING_INTERVAL);
        let mut last_rebalance = Instant::now();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let (is_leader, term) = {
                let m = self.raft.metrics().borrow().clone();
                (
                    m.current_leader == Some(self.id) && m.state == ServerState::Leader,
                    m.current_term,
                )
            };
            if !is_leader {
                led_term = None;
                continue;
            }
            if led_term != Some(term) {
                if self.read_barrier().await.is_err() {
                    continue;
                }
                led_term = Some(term);
                let ids: Vec<BrokerId> =
                    self.store.read(|i, _| i.brokers.keys().copied().collect());
                let now = Instant::now();
                let mut hb = self.heartbeats.lock();
                hb.clear();
                hb.extend(ids.into_iter().map(|id| (id, now)));
                self.heard.lock().clear();
                tracing::info!(
                    node_id = self.id,
                    term,
                    "this controller is now the active controller"
                );
            }
            if self.store.read(|i, _| i.cluster_id.is_none()) {
                let cluster_id = uuid::Uuid::new_v4().to_string();
                if let Err(e) = self
                    .propose(MetadataCommand::InitCluster { cluster_id })
                    .await
                {
                    tracing::warn!(error = %e, "could not set the cluster id");
                }
            }
            self.fence_expired().await;
            if !self.leader_imbalance_interval.is_zero()
                && last_rebalance.elapsed() >= self.leader_imbalance_interval
            {
                last_rebalance = Instant::now();
                self.restore_preferred_leaders().await;
            }
        }
    }

    /// Hands leaderships back to preferred replicas that are alive and in sync again, so
    /// leaders stay balanced after failures.
    async fn restore_preferred_leaders(&self) {
        let due = self.store.read(|image, _| {
            let live: std::collections::BTreeSet<BrokerId> = image
                .brokers
                .values()
                .filter(|b| b.state == BrokerState::Unfenced)
                .map(|b| b.id)
                .collect();
            image
                .topics
                .values()
                .flat_map(|t| &t.partitions)
                .any(|p| super::model::preferred_leader(p, |b| live.contains(&b)).is_some())
        });
        if !due {
            return;
        }
        match self
            .propose(MetadataCommand::ElectPreferredLeaders { topics: Vec::new() })
            .await
        {
            Ok((CommandOutput::Count(n), _)) if n > 0 => {
                tracing::info!(
                    partitions = n,
                    "leadership handed back to preferred replicas"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "preferred leader election failed"),
        }
    }

    async fn fence_expired(&self) {
        let live: Vec<(BrokerId, u64)> = self.store.read(|image, _| {
            image
                .brokers
                .values()
                .filter(|b| b.state != BrokerState::Fenced)
                .map(|b| (b.id, b.epoch))
                .collect()
        });
        for (id, epoch) in live {
            let age = {
                let mut hb = self.heartbeats.lock();
                hb.entry(id).or_insert_with(Instant::now).elapsed()
            };
            if age > self.session_timeout {
                tracing::info!(broker_id = %id, silent_ms = age.as_millis() as u64, "fencing broker: session expired");
                if let Err(e) = self
                    .propose(MetadataCommand::FenceBroker { id, epoch })
                    .await
                {
                    tracing::warn!(broker_id = %id, error = %e, "could not fence broker");
                }
            }
        }
    }

    /// Until `cancel`: exits the process (status 70) if the Raft core stops on its own —
    /// a panic or a fatal storage error — so that a supervisor restarts this controller
    /// instead of it serving on as a zombie that still answers but decides nothing.
    pub async fn watch_core(self: Arc<Self>, cancel: CancellationToken) {
        let mut metrics = self.raft.metrics();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                changed = metrics.changed() => {
                    if changed.is_ok() {
                        continue;
                    }
                    if cancel.is_cancelled() {
                        return;
                    }
                    tracing::error!(node_id = self.id, "the Raft core stopped unexpectedly (a panic or a fatal storage error); exiting so that a supervisor restarts this controller");
                    std::process::exit(70);
                }
            }
        }
    }

    /// Stops Raft.
    pub async fn shutdown(&self) {
        if let Err(e) = self.raft.shutdown().await {
            tracing::warn!(error = %e, "raft shutdown");
        }
    }
}

fn format_peers(peers: &BTreeMap<NodeId, String>) -> String {
    peers
        .iter()
        .map(|(id, addr)| format!("{id}={addr}"))
        .collect::<Vec<_>>()
        .join(",")
}
