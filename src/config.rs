//! Typed configuration of the server roles, layered with the `config` crate:
//! built-in defaults < `--config FILE` (TOML) < `TIDELOG_*` environment variables <
//! command-line flags. Keys are the field names below (`TIDELOG_<KEY>` in upper case in
//! the environment); `config/tidelog.toml` lists every key with its default and unit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::types::NodeId;

/// A configuration that could not be loaded; the message names the key and the limit.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigLoadError(pub String);

/// Settings of a controller (and of the controller half of `standalone`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ControllerConfig {
    /// This controller's id in the quorum.
    pub node_id: NodeId,
    /// The gRPC address clients use (Admin).
    pub listen: String,
    /// The internal listener (Raft, broker lifecycle, forwarded admin calls); empty: the
    /// host of `listen` with its port + 100.
    pub internal_listen: String,
    /// The HTTP port (console, metrics, health); empty or `none`: off.
    pub http_listen: String,
    /// Host names the web console answers besides IP literals and `localhost`,
    /// comma-separated (e.g. `console.example.com`); guards against DNS rebinding.
    pub http_allowed_hosts: String,
    /// Every voter's internal listener as `id=host:port`, comma-separated (including
    /// this node).
    pub peers: String,
    /// A file holding the secret every node of the cluster shares (at least 16 bytes);
    /// required unless the internal listener is on loopback.
    pub cluster_secret_file: String,
    /// Where the Raft log, votes and snapshots live.
    pub data_dir: PathBuf,
    /// A broker without a heartbeat for this long is fenced (ms).
    pub broker_session_timeout_ms: u64,
    /// Raft leader heartbeat interval (ms).
    pub raft_heartbeat_interval_ms: u64,
    /// Raft election timeout, lower bound (ms).
    pub raft_election_timeout_min_ms: u64,
    /// Raft election timeout, upper bound (ms).
    pub raft_election_timeout_max_ms: u64,
    /// Take a snapshot after this many log entries since the last one.
    pub raft_snapshot_entries: u64,
    /// Log entries kept after a snapshot (so slightly lagging followers need no snapshot).
    pub raft_entries_kept_after_snapshot: u64,
    /// A Raft log segment file rolls beyond this size (bytes).
    pub raft_log_segment_bytes: u64,
    /// Metadata versions kept for incremental FetchMetadata answers.
    pub metadata_history_max: usize,
    /// How long a metadata write may take before REQUEST_TIMED_OUT (ms).
    pub write_timeout_ms: u64,
    /// How often the active controller hands leaderships back to preferred replicas that
    /// are alive and in sync again (ms; 0 turns automatic preferred-leader election off).
    pub leader_imbalance_check_interval_ms: u64,
    /// Most connections open at once on the listener.
    pub connections_max: usize,
    /// Longest a new connection may take to open with the HTTP/2 preface (ms).
    pub connection_handshake_timeout_ms: u64,
    /// An established connection that carries only keepalives this long is closed (ms;
    /// Kafka's `connections.max.idle.ms`).
    pub connections_max_idle_ms: u64,
    /// Most partition replicas placement gives one broker; creating topics or adding
    /// partitions beyond it fails with PARTITION_LIMIT_EXCEEDED.
    pub max_partitions_per_broker: usize,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        Self {
            node_id: 1,
            listen: "127.0.0.1:9293".to_owned(),
            internal_listen: String::new(),
            http_listen: String::new(),
            http_allowed_hosts: String::new(),
            peers: String::new(),
            cluster_secret_file: String::new(),
            data_dir: PathBuf::from("./tidelog-data"),
            broker_session_timeout_ms: 9_000,
            raft_heartbeat_interval_ms: 200,
            raft_election_timeout_min_ms: 1_000,
            raft_election_timeout_max_ms: 2_000,
            raft_snapshot_entries: 10_000,
            raft_entries_kept_after_snapshot: 1_000,
            raft_log_segment_bytes: 8 * 1024 * 1024,
            metadata_history_max: 10_000,
            write_timeout_ms: 10_000,
            leader_imbalance_check_interval_ms: 30_000,
            connections_max: 10_000,
            connection_handshake_timeout_ms: 10_000,
            connections_max_idle_ms: 600_000,
            max_partitions_per_broker: 20_000,
        }
    }
}

impl ControllerConfig {
    /// The listener's limits.
    pub fn listener_limits(&self) -> crate::net::ListenerLimits {
        crate::net::ListenerLimits {
            connections_max: self.connections_max,
            handshake_timeout: std::time::Duration::from_millis(
                self.connection_handshake_timeout_ms,
            ),
            idle_timeout: std::time::Duration::from_millis(self.connections_max_idle_ms),
        }
    }

    /// The address the internal listener binds.
    pub fn internal_listen_address(&self) -> Result<String, ConfigLoadError> {
        internal_listen_of(&self.listen, &self.internal_listen)
    }

    /// The peer list as a map; fails on a malformed entry or a repeated id.
    pub fn peer_map(&self) -> Result<BTreeMap<NodeId, String>, ConfigLoadError> {
        parse_peers(&self.peers)
    }

    /// Checks ranges and relations between keys.
    pub fn validate(&self) -> Result<(), ConfigLoadError> {
        let bad = |m: String| Err(ConfigLoadError(m));
        if self.connections_max == 0 || self.connection_handshake_timeout_ms < 10 {
            return bad(format!(
                "connections_max must be >= 1 and connection_handshake_timeout_ms >= 10 (got {}, {})",
                self.connections_max, self.connection_handshake_timeout_ms
            ));
        }
        if self.connections_max_idle_ms < 1_000 {
            return bad(format!(
                "connections_max_idle_ms must be at least 1000, got {}",
                self.connections_max_idle_ms
            ));
        }
        if self.max_partitions_per_broker == 0 {
            return bad("max_partitions_per_broker must be at least 1".to_owned());
        }
        if self.raft_heartbeat_interval_ms == 0 {
            return bad("raft_heartbeat_interval_ms must be at least 1".to_owned());
        }
        if self.raft_election_timeout_min_ms <= self.raft_heartbeat_interval_ms {
            return bad(format!(
                "raft_election_timeout_min_ms ({}) must exceed raft_heartbeat_interval_ms ({})",
                self.raft_election_timeout_min_ms, self.raft_heartbeat_interval_ms
            ));
        }
        if self.raft_election_timeout_max_ms <= self.raft_election_timeout_min_ms {
            return bad(format!(
                "raft_election_timeout_max_ms ({}) must exceed raft_election_timeout_min_ms ({})",
                self.raft_election_timeout_max_ms, self.raft_election_timeout_min_ms
            ));
        }
        if self.broker_session_timeout_ms < 100 {
            return bad(format!(
                "broker_session_timeout_ms must be at least 100, got {}",
                self.broker_session_timeout_ms
            ));
        }
        if self.raft_snapshot_entries == 0 {
            return bad("raft_snapshot_entries must be at least 1".to_owned());
        }
        if self.raft_log_segment_bytes < 4096 {
            return bad(format!(
                "raft_log_segment_bytes must be at least 4096, got {}",
                self.raft_log_segment_bytes
            ));
        }
        if self.metadata_history_max == 0 {
            return bad("metadata_history_max must be at least 1".to_owned());
        }
        let peers = self.peer_map()?;
        if peers.is_empty() {
            return bad("peers must list every controller as id=host:port".to_owned());
        }
        if !peers.contains_key(&self.node_id) {
            return bad(format!(
                "node_id {} is not in peers ({})",
                self.node_id,
                peers
                    .keys()
                    .map(|k| k.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Ok(())
    }
}

/// Settings of a broker (and of the broker half of `standalone`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BrokerConfig {
    /// This broker's id (>= 0), unique in the cluster.
    pub broker_id: i32,
    /// The gRPC address clients use.
    pub listen: String,
    /// The address clients use to reach it; the bound address when empty.
    pub advertised_address: String,
    /// The internal listener (replication: other brokers fetch here); empty: the host of
    /// `listen` with its port + 100.
    pub internal_listen: String,
    /// The address other brokers use to reach the internal listener; the bound address
    /// when empty.
    pub internal_advertised_address: String,
    /// The HTTP port (console, metrics, health); `none`: off; empty: off for a broker, and
    /// [`STANDALONE_HTTP_LISTEN`] for `standalone`.
    pub http_listen: String,
    /// Host names the web console answers besides IP literals and `localhost`,
    /// comma-separated (e.g. `console.example.com`); guards against DNS rebinding.
    pub http_allowed_hosts: String,
    /// The controllers' internal listeners, comma-separated.
    pub controllers: String,
    /// A file holding the secret every node of the cluster shares (at least 16 bytes);
    /// required unless the internal listener is on loopback.
    pub cluster_secret_file: String,
    /// Where partitions live, one directory each.
    pub data_dir: PathBuf,
    /// This broker's rack, for rack-aware placement; empty for none.
    pub rack: String,
    /// Interval between heartbeats to the controllers (ms).
    pub broker_heartbeat_interval_ms: u64,
    /// Create unknown topics on first produce or metadata request (1 partition, 1 replica).
    pub auto_create_topics_enable: bool,
    /// Largest request a client may send (bytes).
    pub max_request_bytes: usize,
    /// Longest a fetch may wait for data (ms).
    pub fetch_max_wait_ms: u64,
    /// Largest fetch response (bytes).
    pub fetch_max_bytes: usize,
    /// Check the CRC of every batch a consumer fetch returns (Kafka leaves it to the
    /// consumers, and tidelog's clients check it; recovery and follower appends always
    /// check). Off by default.
    pub verify_crc_on_read: bool,
    /// Label the records/bytes in/out counters of `/metrics` with the partition as well
    /// as the topic (more series: one per partition).
    pub metrics_per_partition: bool,
    /// How long to wait for the controllers to register this broker at start (ms).
    pub registration_timeout_ms: u64,
    /// How long a controlled shutdown may take before the broker stops anyway (ms).
    pub controlled_shutdown_timeout_ms: u64,
    /// A follower that has not caught up with its leader for this long leaves the ISR (ms;
    /// Kafka's `replica.lag.time.max.ms`).
    pub replica_lag_time_max_ms: u64,
    /// Longest a follower's fetch waits at the leader when there is nothing new (ms).
    pub replica_fetch_wait_max_ms: u64,
    /// Most bytes per partition in one follower fetch.
    pub replica_fetch_max_bytes: usize,
    /// Most bytes in one follower fetch response.
    pub replica_fetch_response_max_bytes: usize,
    /// How often retention (`retention.ms`, `retention.bytes`) runs over every partition (ms).
    pub log_retention_check_interval_ms: u64,
    /// Partitions of `__consumer_offsets` when it is created (on first group use).
    pub offsets_topic_num_partitions: u32,
    /// Replication factor of `__consumer_offsets` (capped at the live brokers).
    pub offsets_topic_replication_factor: u32,
    /// Smallest session timeout a group member may ask for (ms).
    pub group_min_session_timeout_ms: u64,
    /// Largest session timeout a group member may ask for (ms).
    pub group_max_session_timeout_ms: u64,
    /// An offsets partition's superseded commits are cleaned up once it holds this many
    /// records (and four times its live offsets).
    pub offsets_cleanup_min_records: u64,
    /// Session timeout of consumer-protocol members that do not ask for one (Kafka's
    /// `group.consumer.session.timeout.ms`; KIP-848 clients never do) (ms).
    pub group_consumer_session_timeout_ms: u64,
    /// How long a classic group starting from empty waits for more members before its
    /// first generation (Kafka's `group.initial.rebalance.delay.ms`) (ms).
    pub group_initial_rebalance_delay_ms: u64,
    /// Partitions of `__timers` (pending delayed records) when it is created (on first
    /// use); each has a mover on its leader.
    pub timers_topic_num_partitions: u32,
    /// Replication factor of `__timers` (capped at the live brokers).
    pub timers_topic_replication_factor: u32,
    /// Longest delay a record may ask for (ms; RocketMQ's `timerMaxDelaySec`).
    pub max_delay_ms: u64,
    /// Most pending scheduled records per `__timers` partition (about 30 bytes of memory
    /// each on its leader).
    pub timers_max_pending_per_partition: usize,
    /// Partitions of `__transaction_state` when it is created (on first transactional
    /// use); the leader of `crc32c(transactional id) % N` coordinates the id.
    pub transaction_state_log_num_partitions: u32,
    /// Replication factor of `__transaction_state` (capped at the live brokers).
    pub transaction_state_log_replication_factor: u32,
    /// Largest transaction timeout a producer may ask for (ms; Kafka's
    /// `transaction.max.timeout.ms`).
    pub transaction_max_timeout_ms: u32,
    /// A transactional id idle this long is forgotten (ms; Kafka's
    /// `transactional.id.expiration.ms`).
    pub transactional_id_expiration_ms: u64,
    /// A transaction open this long is checked back with its producer when the producer
    /// registered a checker, and again after each further interval (ms; RocketMQ's
    /// `transactionCheckInterval`).
    pub transaction_check_interval_ms: u64,
    /// Checks without a verdict before such a transaction is aborted (RocketMQ's
    /// `transactionCheckMax`).
    pub transaction_check_max: u32,
    /// Most connections open at once on the listener.
    pub connections_max: usize,
    /// Longest a new connection may take to open with the HTTP/2 preface (ms).
    pub connection_handshake_timeout_ms: u64,
    /// An established connection that carries only keepalives this long is closed (ms;
    /// Kafka's `connections.max.idle.ms`).
    pub connections_max_idle_ms: u64,
    /// Where to serve Kafka's binary protocol: `host:port`, `none` for no Kafka listener,
    /// or empty for the role's default (`standalone`: 127.0.0.1:9092; `broker`: none).
    pub kafka_listen: String,
    /// The address Kafka clients are told to use (in Metadata answers); the Kafka
    /// listener's bound address when empty.
    pub kafka_advertised_address: String,
    /// Largest Kafka request a client may send (bytes; Kafka's `socket.request.max.bytes`);
    /// a larger one closes its connection.
    pub socket_request_max_bytes: usize,
}

/// The `kafka_listen` value that turns the Kafka listener off.
pub const KAFKA_LISTEN_NONE: &str = "none";
/// Where `standalone` serves Kafka clients unless `kafka_listen` says otherwise.
pub const STANDALONE_KAFKA_LISTEN: &str = "127.0.0.1:9092";

impl Default for BrokerConfig {
    fn default() -> Self {
        Self {
            broker_id: 1,
            listen: "127.0.0.1:9292".to_owned(),
            advertised_address: String::new(),
            internal_listen: String::new(),
            internal_advertised_address: String::new(),
            http_listen: String::new(),
            http_allowed_hosts: String::new(),
            controllers: "127.0.0.1:9393".to_owned(),
            cluster_secret_file: String::new(),
            data_dir: PathBuf::from("./tidelog-data"),
            rack: String::new(),
            broker_heartbeat_interval_ms: 1_000,
            auto_create_topics_enable: false,
            max_request_bytes: 64 * 1024 * 1024,
            fetch_max_wait_ms: 30_000,
            fetch_max_bytes: 50 * 1024 * 1024,
            verify_crc_on_read: false,
            metrics_per_partition: false,
            registration_timeout_ms: 60_000,
            controlled_shutdown_timeout_ms: 10_000,
            replica_lag_time_max_ms: 30_000,
            replica_fetch_wait_max_ms: 500,
            replica_fetch_max_bytes: 4 * 1024 * 1024,
            replica_fetch_response_max_bytes: 16 * 1024 * 1024,
            log_retention_check_interval_ms: 300_000,
            offsets_topic_num_partitions: 50,
            offsets_topic_replication_factor: 3,
            group_min_session_timeout_ms: 500,
            group_max_session_timeout_ms: 300_000,
            offsets_cleanup_min_records: 10_000,
            group_consumer_session_timeout_ms: 45_000,
            group_initial_rebalance_delay_ms: 3_000,
            timers_topic_num_partitions: 12,
            timers_topic_replication_factor: 3,
            max_delay_ms: 40 * 24 * 3600 * 1000,
            timers_max_pending_per_partition: 2_000_000,
            transaction_state_log_num_partitions: 50,
            transaction_state_log_replication_factor: 3,
            transaction_max_timeout_ms: 900_000,
            transactional_id_expiration_ms: 7 * 24 * 3600 * 1000,
            transaction_check_interval_ms: 60_000,
            transaction_check_max: 15,
            connections_max: 10_000,
            connection_handshake_timeout_ms: 10_000,
            connections_max_idle_ms: 600_000,
            kafka_listen: String::new(),
            kafka_advertised_address: String::new(),
            socket_request_max_bytes: 100 * 1024 * 1024,
        }
    }
}

impl BrokerConfig {
    /// The address the Kafka listener binds, if any: `kafka_listen`, or `role_default`
    /// when it is empty; `none` turns it off.
    pub fn kafka_listen_address(&self, role_default: Option<&str>) -> Option<String> {
        match self.kafka_listen.trim() {
            "" => role_default.map(str::to_owned),
            KAFKA_LISTEN_NONE => None,
            address => Some(address.to_owned()),
        }
    }

    /// The client listener's limits.
    pub fn listener_limits(&self) -> crate::net::ListenerLimits {
        crate::net::ListenerLimits {
            connections_max: self.connections_max,
            handshake_timeout: std::time::Duration::from_millis(
                self.connection_handshake_timeout_ms,
            ),
            idle_timeout: std::time::Duration::from_millis(self.connections_max_idle_ms),
        }
    }

    /// The address the internal listener binds.
    pub fn internal_listen_address(&self) -> Result<String, ConfigLoadError> {
        internal_listen_of(&self.listen, &self.internal_listen)
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<(), ConfigLoadError> {
        let bad = |m: String| Err(ConfigLoadError(m));
        if self.connections_max == 0 || self.connection_handshake_timeout_ms < 10 {
            return bad(format!(
                "connections_max must be >= 1 and connection_handshake_timeout_ms >= 10 (got {}, {})",
                self.connections_max, self.connection_handshake_timeout_ms
            ));
        }
        if self.connections_max_idle_ms < 1_000 {
            return bad(format!(
                "connections_max_idle_ms must be at least 1000, got {}",
                self.connections_max_idle_ms
            ));
        }
        if self.broker_id < 0 {
            return bad(format!("broker_id must be >= 0, got {}", self.broker_id));
        }
        if self.broker_heartbeat_interval_ms == 0 {
            return bad("broker_heartbeat_interval_ms must be at least 1".to_owned());
        }
        if self.max_request_bytes < 1024 {
            return bad(format!(
                "max_request_bytes must be at least 1024, got {}",
                self.max_request_bytes
            ));
        }
        if self.fetch_max_bytes < 1024 {
            return bad(format!(
                "fetch_max_bytes must be at least 1024, got {}",
                self.fetch_max_bytes
            ));
        }
        if self.replica_lag_time_max_ms < 100 {
            return bad(format!(
                "replica_lag_time_max_ms must be at least 100, got {}",
                self.replica_lag_time_max_ms
            ));
        }
        if self.replica_fetch_max_bytes < 1024
            || self.replica_fetch_response_max_bytes < self.replica_fetch_max_bytes
        {
            return bad(format!(
                "replica_fetch_max_bytes must be at least 1024 and at most replica_fetch_response_max_bytes, got {} and {}",
                self.replica_fetch_max_bytes, self.replica_fetch_response_max_bytes
            ));
        }
        if !(1..=1_000).contains(&self.timers_topic_num_partitions)
            || self.timers_topic_replication_factor == 0
        {
            return bad(format!(
                "timers_topic_num_partitions must be 1 to 1000 and timers_topic_replication_factor at least 1, got {} and {}",
                self.timers_topic_num_partitions, self.timers_topic_replication_factor
            ));
        }
        if !(1..=1_000).contains(&self.transaction_state_log_num_partitions)
            || self.transaction_state_log_replication_factor == 0
            || self.transaction_max_timeout_ms == 0
            || self.transactional_id_expiration_ms == 0
            || self.transaction_check_interval_ms == 0
        {
            return bad(format!(
                "transaction_state_log_num_partitions must be 1 to 1000, and transaction_state_log_replication_factor, transaction_max_timeout_ms, transactional_id_expiration_ms and transaction_check_interval_ms at least 1, got {}, {}, {}, {} and {}",
                self.transaction_state_log_num_partitions,
                self.transaction_state_log_replication_factor,
                self.transaction_max_timeout_ms,
                self.transactional_id_expiration_ms,
                self.transaction_check_interval_ms
            ));
        }
        if self.timers_max_pending_per_partition == 0 {
            return bad("timers_max_pending_per_partition must be at least 1, got 0".to_owned());
        }
        if self.max_delay_ms == 0 || self.max_delay_ms > 365 * 24 * 3600 * 1000 {
            return bad(format!(
                "max_delay_ms must be 1 to 31536000000 (a year), got {}",
                self.max_delay_ms
            ));
        }
        if !(1..=10_000).contains(&self.offsets_topic_num_partitions) {
            return bad(format!(
                "offsets_topic_num_partitions must be 1 to 10000, got {}",
                self.offsets_topic_num_partitions
            ));
        }
        if self.offsets_topic_replication_factor == 0
            || self.group_min_session_timeout_ms == 0
            || self.group_min_session_timeout_ms > self.group_max_session_timeout_ms
            || self.group_consumer_session_timeout_ms < self.group_min_session_timeout_ms
            || self.group_consumer_session_timeout_ms > self.group_max_session_timeout_ms
        {
            return bad(format!(
                "offsets_topic_replication_factor must be >= 1, group_min_session_timeout_ms in 1..=group_max_session_timeout_ms and group_consumer_session_timeout_ms within them (got {}, {}, {}, {})",
                self.offsets_topic_replication_factor,
                self.group_min_session_timeout_ms,
                self.group_max_session_timeout_ms,
                self.group_consumer_session_timeout_ms
            ));
        }
        if self.log_retention_check_interval_ms == 0 {
            return bad("log_retention_check_interval_ms must be at least 1".to_owned());
        }
        if !(1024..=i32::MAX as usize).contains(&self.socket_request_max_bytes) {
            return bad(format!(
                "socket_request_max_bytes must be 1024 to 2147483647, got {}",
                self.socket_request_max_bytes
            ));
        }
        Ok(())
    }
}

/// A comma-separated list of host names, trimmed, without empty entries.
pub fn host_list(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `standalone`'s HTTP port when `http_listen` is not set.
pub const STANDALONE_HTTP_LISTEN: &str = "127.0.0.1:9644";

/// The address an optional listener binds: `None` when it is off (`none`, or empty
/// without a default).
pub fn optional_listen(value: &str, default: Option<&str>) -> Option<String> {
    match value.trim() {
        "none" => None,
        "" => default.map(str::to_owned),
        v => Some(v.to_owned()),
    }
}

/// Offset from a client port to the internal port when `internal_listen` is not set.
pub const INTERNAL_PORT_OFFSET: u16 = 100;

/// `internal` when set; else `listen` with its port + [`INTERNAL_PORT_OFFSET`] (an
/// ephemeral port 0 stays 0).
pub fn internal_listen_of(listen: &str, internal: &str) -> Result<String, ConfigLoadError> {
    if !internal.is_empty() {
        return Ok(internal.to_owned());
    }
    let bad = || {
        ConfigLoadError(format!(
            "internal_listen is not set and listen '{listen}' is not host:port with a port below {}; set internal_listen",
            u16::MAX - INTERNAL_PORT_OFFSET + 1
        ))
    };
    let (host, port) = listen.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let internal_port = match port {
        0 => 0,
        p => p.checked_add(INTERNAL_PORT_OFFSET).ok_or_else(bad)?,
    };
    Ok(format!("{host}:{internal_port}"))
}

/// Parses `1=host:port,2=host:port`.
pub fn parse_peers(text: &str) -> Result<BTreeMap<NodeId, String>, ConfigLoadError> {
    let mut peers = BTreeMap::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((id, addr)) = item.split_once('=') else {
            return Err(ConfigLoadError(format!(
                "peers: '{item}' is not id=host:port"
            )));
        };
        let id: NodeId = id.trim().parse().map_err(|_| {
            ConfigLoadError(format!(
                "peers: '{id}' in '{item}' is not a node id (an integer)"
            ))
        })?;
        let addr = addr.trim();
        if addr.parse::<std::net::SocketAddr>().is_err() && !addr.contains(':') {
            return Err(ConfigLoadError(format!(
                "peers: '{addr}' in '{item}' is not host:port"
            )));
        }
        if peers.insert(id, addr.to_owned()).is_some() {
            return Err(ConfigLoadError(format!(
                "peers: node id {id} is listed twice"
            )));
        }
    }
    Ok(peers)
}

/// `TIDELOG_*` variables that are not server settings (the client subcommands read them).
const CLIENT_VARIABLES: &[&str] = &["bootstrap"];

/// The keys of `T` (its serialized field names) with their default values.
pub fn defaults_of<T: Serialize + Default>() -> serde_json::Map<String, serde_json::Value> {
    match serde_json::to_value(T::default()) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    }
}

/// Every server setting with its default: the broker's and the controller's (one file
/// may configure both roles, as `standalone` does).
pub fn known_settings() -> serde_json::Map<String, serde_json::Value> {
    let mut all = defaults_of::<ControllerConfig>();
    all.extend(defaults_of::<BrokerConfig>());
    all
}

/// The known key closest to `key` (by edit distance), if any is close enough to be a
/// likely typo.
pub fn closest_key<'a>(key: &str, known: impl Iterator<Item = &'a String>) -> Option<&'a str> {
    known
        .map(|k| (edit_distance(key, k), k))
        .filter(|(d, k)| *d <= (k.len() / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.as_str())
}

/// Levenshtein distance between two strings (by bytes; keys are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (diagonal + usize::from(ca != cb))
                .min(above + 1)
                .min(row[j] + 1);
            diagonal = above;
        }
    }
    row[b.len()]
}

/// Checks one setting from `source` against the known keys and their defaults' types.
fn check_setting(
    key: &str,
    value: &config::Value,
    source: &str,
    known: &serde_json::Map<String, serde_json::Value>,
    from_env: bool,
) -> Result<(), ConfigLoadError> {
    let Some(default) = known.get(key) else {
        let hint = closest_key(key, known.keys())
            .map(|k| {
                if from_env {
                    format!("; did you mean TIDELOG_{}?", k.to_ascii_uppercase())
                } else {
                    format!("; did you mean '{k}'?")
                }
            })
            .unwrap_or_default();
        let name = if from_env {
            format!("TIDELOG_{}", key.to_ascii_uppercase())
        } else {
            format!("'{key}'")
        };
        return Err(ConfigLoadError(format!(
            "unknown setting {name} in {source}{hint} (config/tidelog.toml lists every setting)"
        )));
    };
    let text = value.to_string();
    let wrong = |expected: &str| {
        Err(ConfigLoadError(format!(
            "{key} in {source} must be {expected}, got {text:?}"
        )))
    };
    use config::ValueKind;
    match (default, &value.kind) {
        (serde_json::Value::Bool(_), ValueKind::Boolean(_)) => Ok(()),
        (serde_json::Value::Bool(_), ValueKind::String(s)) if from_env => {
            if s == "true" || s == "false" {
                Ok(())
            } else {
                wrong("true or false")
            }
        }
        (serde_json::Value::Bool(_), _) => wrong("true or false"),
        (serde_json::Value::Number(_), ValueKind::I64(_) | ValueKind::U64(_)) => Ok(()),
        (serde_json::Value::Number(_), ValueKind::String(s)) if from_env => {
            if s.parse::<i128>().is_ok() {
                Ok(())
            } else {
                wrong("a whole number")
            }
        }
        (serde_json::Value::Number(_), _) => wrong("a whole number"),
        (serde_json::Value::String(_), ValueKind::String(_)) => Ok(()),
        (serde_json::Value::String(_), _) if from_env => Ok(()),
        (serde_json::Value::String(_), _) => wrong("a string"),
        _ => Ok(()),
    }
}

/// Loads `T` from its defaults, then `file`, then `TIDELOG_*` variables, then `flags`
/// (only the flags the user gave). Every key in the file and every `TIDELOG_*` variable
/// must be one of `known` (with a value of the default's type): anything else is refused,
/// naming the key, where it came from and the closest known key.
pub fn load<T>(
    file: Option<&Path>,
    flags: &[(&str, Option<String>)],
    known: &serde_json::Map<String, serde_json::Value>,
) -> Result<T, ConfigLoadError>
where
    T: Serialize + DeserializeOwned + Default,
{
    let err = |e: config::ConfigError| ConfigLoadError(e.to_string());
    let defaults = config::Config::try_from(&T::default()).map_err(err)?;
    let mut builder = config::Config::builder().add_source(defaults);
    if let Some(path) = file {
        if !path.exists() {
            return Err(ConfigLoadError(format!(
                "config file {} does not exist",
                path.display()
            )));
        }
        let source = config::File::from(path)
            .format(config::FileFormat::Toml)
            .required(true);
        let table = config::Source::collect(&source)
            .map_err(|e| ConfigLoadError(format!("{}: {e}", path.display())))?;
        for (key, value) in &table {
            check_setting(key, value, &path.display().to_string(), known, false)?;
        }
        builder = builder.add_source(source);
    }
    for (name, value) in std::env::vars() {
        let Some(key) = name.strip_prefix("TIDELOG_") else {
            continue;
        };
        let key = key.to_ascii_lowercase();
        if CLIENT_VARIABLES.contains(&key.as_str()) {
            continue;
        }
        let value = config::Value::new(None, config::ValueKind::String(value));
        check_setting(&key, &value, "the environment", known, true)?;
    }
    builder = builder.add_source(
        config::Environment::with_prefix("TIDELOG")
            .prefix_separator("_")
            .try_parsing(true),
    );
    for (key, value) in flags {
        if let Some(v) = value {
            builder = builder.set_override(*key, v.clone()).map_err(err)?;
        }
    }
    builder.build().map_err(err)?.try_deserialize().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sample_file_lists_every_setting() {
        let text = include_str!("../config/tidelog.toml");
        for key in known_settings().keys() {
            let listed = text.lines().any(|l| {
                l.trim_start_matches('#')
                    .trim_start()
                    .starts_with(&format!("{key} ="))
            });
            assert!(listed, "config/tidelog.toml lacks {key}");
        }
    }

    #[test]
    fn the_internal_port_defaults_to_the_client_port_plus_100() {
        assert_eq!(
            internal_listen_of("127.0.0.1:9292", "").unwrap(),
            "127.0.0.1:9392"
        );
        assert_eq!(internal_listen_of("[::1]:9293", "").unwrap(), "[::1]:9393");
        assert_eq!(
            internal_listen_of("127.0.0.1:0", "").unwrap(),
            "127.0.0.1:0"
        );
        assert_eq!(internal_listen_of("a:1", "b:2").unwrap(), "b:2");
        assert!(internal_listen_of("127.0.0.1:65500", "").is_err());
        assert!(internal_listen_of("nonsense", "").is_err());
    }

    #[test]
    fn peers_parse_and_reject_bad_entries() {
        let p = parse_peers("1=127.0.0.1:1, 2=127.0.0.1:2").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[&2], "127.0.0.1:2");
        assert!(parse_peers("1=a:1,1=b:2").unwrap_err().0.contains("twice"));
        assert!(parse_peers("x=a:1")
            .unwrap_err()
            .0
            .contains("not a node id"));
        assert!(parse_peers("1").is_err());
    }

    #[test]
    fn layers_apply_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            "broker_session_timeout_ms = 5000\nraft_snapshot_entries = 7\n",
        )
        .unwrap();
        let c: ControllerConfig = load(
            Some(&file),
            &[
                ("raft_snapshot_entries", Some("9".to_owned())),
                ("listen", None),
            ],
            &known_settings(),
        )
        .unwrap();
        assert_eq!(c.broker_session_timeout_ms, 5000);
        assert_eq!(c.raft_snapshot_entries, 9);
        assert_eq!(c.listen, "127.0.0.1:9293");
    }

    #[test]
    fn unknown_keys_and_wrong_types_are_refused_with_the_closest_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        let attempt = |text: &str| {
            std::fs::write(&file, text).unwrap();
            load::<BrokerConfig>(Some(&file), &[], &known_settings())
        };
        let e = attempt("auto_create_topic_enable = true\n").unwrap_err().0;
        assert!(e.contains("'auto_create_topic_enable'"), "{e}");
        assert!(e.contains("c.toml"), "{e}");
        assert!(
            e.contains("did you mean 'auto_create_topics_enable'"),
            "{e}"
        );
        let e = attempt("auto_create_topics_enable = \"yes\"\n")
            .unwrap_err()
            .0;
        assert!(
            e.contains("auto_create_topics_enable") && e.contains("true or false"),
            "{e}"
        );
        let e = attempt("fetch_max_bytes = \"lots\"\n").unwrap_err().0;
        assert!(
            e.contains("fetch_max_bytes") && e.contains("whole number"),
            "{e}"
        );
        // A controller key in a broker's file is a real setting (one file may serve both).
        let c = attempt("auto_create_topics_enable = true\nraft_snapshot_entries = 5\n").unwrap();
        assert!(c.auto_create_topics_enable);
    }

    #[test]
    fn closest_key_finds_typos_only() {
        let known = known_settings();
        assert_eq!(closest_key("listn", known.keys()), Some("listen"));
        assert_eq!(closest_key("data-dir", known.keys()), Some("data_dir"));
        assert_eq!(closest_key("completely_unrelated_name", known.keys()), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
    }

    #[test]
    fn validation_names_the_key() {
        let c = ControllerConfig {
            peers: "2=127.0.0.1:1".to_owned(),
            ..Default::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .0
            .contains("node_id 1 is not in peers"));
        let c = ControllerConfig {
            peers: "1=127.0.0.1:1".to_owned(),
            raft_election_timeout_min_ms: 100,
            ..Default::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .0
            .contains("raft_election_timeout_min_ms"));
    }
}
