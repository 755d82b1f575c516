//! `tidelog broker`: stores partitions and serves produce, fetch, list offsets, metadata
//! and admin. [`BrokerRuntime`] is shared with `standalone`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{announce_ready, bind, node_secret, shutdown_signal, RoleError};
use crate::api::admin_service::ControllerAdminService;
use crate::api::broker_admin_service::{AdminBackend, BrokerAdminService};
use crate::api::broker_service::BrokerService;
use crate::api::code_layer::CodeLayer;
use crate::api::fast_path::FastPath;
use crate::api::groups_service::GroupsService;
use crate::api::port_guard::RefuseInternalLayer;
use crate::api::proto::admin_server::AdminServer;
use crate::api::proto::broker_server::BrokerServer;
use crate::api::proto::groups_server::GroupsServer;
use crate::api::proto::replication_server::ReplicationServer;
use crate::api::proto::timers_server::TimersServer;
use crate::api::proto::transactions_server::TransactionsServer;
use crate::api::proto::txn_markers_server::TxnMarkersServer;
use crate::api::replication_service::ReplicationService;
use crate::api::request_metrics::RequestMetricsLayer;
use crate::api::timer_service::{TimerFront, TimerPeerClient, TimerService};
use crate::api::txn_service::{
    CoordinatorVerifier, MarkerPeerClient, TxnMarkerService, TxnService,
};
use crate::broker::controller_link::{BrokerIdentity, ControllerLink};
use crate::broker::group::{GroupCoordinator, GroupSettings};
use crate::broker::lease::LeaderLease;
use crate::broker::metadata_cache::MetadataCache;
use crate::broker::node::BrokerLimits;
use crate::broker::partition_manager::PartitionManager;
use crate::broker::producer_ids::{ProducerIdBlocks, DEFAULT_BLOCK_SIZE as PRODUCER_ID_BLOCK_SIZE};
use crate::broker::replica_manager::{ReplicaManager, ReplicationSettings};
use crate::broker::timer::{TimerSettings, Timers};
use crate::broker::txn::{TxnCoordinator, TxnSettings};
use crate::broker::BrokerNode;
use crate::client::connection::parse_bootstrap;
use crate::client::AdminClient;
use crate::config::{BrokerConfig, ConfigLoadError};
use crate::kafka::{KafkaHandler, KafkaLimits};
use crate::net::node_auth::ClusterSecret;
use crate::replication::isr_queue::IsrChangeQueue;
use crate::types::BrokerId;

/// A broker's state and background tasks.
pub struct BrokerRuntime {
    node: BrokerNode,
    groups: Arc<GroupCoordinator>,
    link: Arc<ControllerLink>,
    replicas: Arc<ReplicaManager>,
    controllers: Vec<String>,
    secret: Arc<ClusterSecret>,
    config: BrokerConfig,
    timers: Arc<Timers>,
    timer_front: Arc<TimerFront>,
    txns: Arc<TxnCoordinator>,
}

/// Where a broker is reached: clients at `client`, other brokers at `internal`.
#[derive(Debug, Clone)]
pub struct AdvertisedAddresses {
    /// The client port's address.
    pub client: String,
    /// The internal listener's address.
    pub internal: String,
    /// The Kafka listener's address, when there is one.
    pub kafka: Option<String>,
}

impl AdvertisedAddresses {
    /// The configured advertised addresses, or the bound ones.
    pub fn of(
        config: &BrokerConfig,
        client: std::net::SocketAddr,
        internal: std::net::SocketAddr,
        kafka: Option<std::net::SocketAddr>,
    ) -> Self {
        let or = |configured: &str, bound: std::net::SocketAddr| {
            if configured.is_empty() {
                bound.to_string()
            } else {
                configured.to_owned()
            }
        };
        Self {
            client: or(&config.advertised_address, client),
            internal: or(&config.internal_advertised_address, internal),
            kafka: kafka.map(|k| or(&config.kafka_advertised_address, k)),
        }
    }
}

impl BrokerRuntime {
    /// Builds the broker (nothing runs yet). `advertised` are the addresses it registers;
    /// it talks to other nodes with `secret`.
    pub fn new(
        config: &BrokerConfig,
        advertised: AdvertisedAddresses,
        secret: Arc<ClusterSecret>,
    ) -> Result<Self, RoleError> {
        config.validate()?;
        let controllers = parse_bootstrap(&config.controllers).map_err(|e| {
            RoleError::Config(ConfigLoadError(format!("controllers: {}", e.message)))
        })?;
        std::fs::create_dir_all(&config.data_dir).map_err(|source| RoleError::Listen {
            what: "cannot create data directory",
            address: config.data_dir.display().to_string(),
            source,
        })?;
        let id = BrokerId(config.broker_id);
        let metadata = Arc::new(MetadataCache::default());
        let partitions =
            Arc::new(PartitionManager::new(&config.data_dir, id).map_err(RoleError::DataDir)?);
        let lease = Arc::new(LeaderLease::default());
        let producer_ids = Arc::new(ProducerIdBlocks::new(PRODUCER_ID_BLOCK_SIZE));
        let isr_changes = Arc::new(IsrChangeQueue::default());
        let node = BrokerNode::new(
            id,
            metadata.clone(),
            partitions.clone(),
            BrokerLimits {
                fetch_wait_max: Duration::from_millis(config.fetch_max_wait_ms),
                fetch_bytes_max: config.fetch_max_bytes,
                verify_crc_on_read: config.verify_crc_on_read,
                metrics_per_partition: config.metrics_per_partition,
            },
            lease.clone(),
            isr_changes.clone(),
            producer_ids,
        );
        let replicas = Arc::new(ReplicaManager::new(
            id,
            metadata.clone(),
            partitions.clone(),
            ReplicationSettings {
                replica_lag_time_max: Duration::from_millis(config.replica_lag_time_max_ms),
                fetch_wait_max: Duration::from_millis(config.replica_fetch_wait_max_ms),
                fetch_max_bytes: config.replica_fetch_response_max_bytes,
                fetch_partition_max_bytes: config.replica_fetch_max_bytes,
                retention_check_interval: Duration::from_millis(
                    config.log_retention_check_interval_ms,
                ),
                ..ReplicationSettings::default()
            },
            isr_changes,
            secret.clone(),
        ));
        let link = Arc::new(ControllerLink::new(
            controllers.clone(),
            secret.clone(),
            BrokerIdentity {
                id,
                address: advertised.client,
                internal_address: advertised.internal,
                kafka_address: advertised.kafka,
                rack: (!config.rack.is_empty()).then(|| config.rack.clone()),
            },
            Duration::from_millis(config.broker_heartbeat_interval_ms),
            metadata,
            partitions,
            replicas.clone(),
            lease,
        ));
        let groups = GroupCoordinator::new(
            node.clone(),
            GroupSettings {
                offsets_partitions: config.offsets_topic_num_partitions,
                offsets_replication_factor: config.offsets_topic_replication_factor,
                session_timeout_min: Duration::from_millis(config.group_min_session_timeout_ms),
                session_timeout_max: Duration::from_millis(config.group_max_session_timeout_ms),
                cleanup_min_records: config.offsets_cleanup_min_records,
                session_timeout_default: Duration::from_millis(
                    config.group_consumer_session_timeout_ms,
                ),
                initial_rebalance_delay: Duration::from_millis(
                    config.group_initial_rebalance_delay_ms,
                ),
                ..GroupSettings::default()
            },
        );
        node.set_marker_observer(groups.marker_observer());
        let timers = Arc::new(Timers::new(
            node.clone(),
            TimerSettings {
                partitions: config.timers_topic_num_partitions,
                replication_factor: config.timers_topic_replication_factor,
                max_delay: Duration::from_millis(config.max_delay_ms),
                max_pending_per_partition: config.timers_max_pending_per_partition,
                ..TimerSettings::default()
            },
            Arc::new(TimerPeerClient::new(node.clone(), secret.clone())),
        ));
        let timer_front = Arc::new(TimerFront::new(
            node.clone(),
            timers.clone(),
            AdminClient::internal(controllers.clone(), Duration::from_secs(30), secret.clone()),
        ));
        node.set_scheduler(Arc::new(timer_front.clone()));
        let txns = TxnCoordinator::new(
            node.clone(),
            TxnSettings {
                partitions: config.transaction_state_log_num_partitions,
                replication_factor: config.transaction_state_log_replication_factor,
                timeout_max_ms: config.transaction_max_timeout_ms,
                timeout_default_ms: config.transaction_max_timeout_ms.min(60_000),
                id_expiration: Duration::from_millis(config.transactional_id_expiration_ms),
                check_interval: Duration::from_millis(config.transaction_check_interval_ms),
                check_max: config.transaction_check_max,
                ..TxnSettings::default()
            },
            Arc::new(MarkerPeerClient::new(node.clone(), secret.clone())),
        );
        node.set_txn_verifier(Arc::new(CoordinatorVerifier::new(
            node.clone(),
            txns.clone(),
            secret.clone(),
        )));
        Ok(Self {
            txns,
            timer_front,
            timers,
            node,
            groups,
            link,
            replicas,
            controllers,
            secret,
            config: config.clone(),
        })
    }

    /// The broker's gRPC services: Broker, Admin and Groups for the client port,
    /// Replication for the internal one. Admin calls go to `local` when given
    /// (standalone), else to the controllers.
    pub fn services(
        &self,
        local: Option<ControllerAdminService>,
    ) -> (
        FastPath<BrokerServer<BrokerService>>,
        AdminServer<BrokerAdminService>,
        ReplicationServer<ReplicationService>,
        GroupsServer<GroupsService>,
    ) {
        let controllers = || {
            AdminClient::internal(
                self.controllers.clone(),
                Duration::from_secs(30),
                self.secret.clone(),
            )
        };
        let auto_create = self.config.auto_create_topics_enable.then(controllers);
        let service = Arc::new(
            BrokerService::new(self.node.clone(), auto_create)
                .with_timers(self.timer_front.clone()),
        );
        let response_bytes_max = self.config.fetch_max_bytes + 1024 * 1024;
        let broker = FastPath::new(
            BrokerServer::from_arc(service.clone())
                .max_decoding_message_size(self.config.max_request_bytes)
                .max_encoding_message_size(response_bytes_max),
            service,
            self.config.max_request_bytes,
            response_bytes_max,
        );
        let admin = AdminServer::new(self.admin_service(local));
        let replication = ReplicationServer::new(ReplicationService::new(self.node.clone()))
            .max_decoding_message_size(self.config.max_request_bytes)
            .max_encoding_message_size(self.config.replica_fetch_response_max_bytes + 1024 * 1024);
        let groups = GroupsServer::new(GroupsService::new(
            self.node.clone(),
            self.groups.clone(),
            controllers(),
        ));
        (broker, admin, replication, groups)
    }

    /// The public Transactions service.
    pub fn txn_service(&self) -> TransactionsServer<TxnService> {
        TransactionsServer::new(self.txn_front())
    }

    fn txn_front(&self) -> TxnService {
        TxnService::new(
            self.node.clone(),
            self.txns.clone(),
            AdminClient::internal(
                self.controllers.clone(),
                Duration::from_secs(30),
                self.secret.clone(),
            ),
        )
    }

    /// The internal TxnMarkers service (markers from other brokers' coordinators).
    pub fn txn_marker_service(&self) -> TxnMarkersServer<TxnMarkerService> {
        TxnMarkersServer::new(TxnMarkerService::new(self.node.clone(), self.txns.clone()))
    }

    /// The internal Timers service (scheduling, cancelling and delivering delayed records
    /// between brokers).
    pub fn timer_service(&self) -> TimersServer<TimerService> {
        TimersServer::new(TimerService::new(self.node.clone(), self.timers.clone()))
            .max_decoding_message_size(self.config.max_request_bytes)
    }

    /// The Admin service as this broker serves it: calls go to `local` when given
    /// (standalone), else to the controllers.
    pub fn admin_service(&self, local: Option<ControllerAdminService>) -> BrokerAdminService {
        let backend = match local {
            Some(service) => AdminBackend::Local(Box::new(service)),
            None => AdminBackend::Remote(Box::new(AdminClient::internal(
                self.controllers.clone(),
                Duration::from_secs(30),
                self.secret.clone(),
            ))),
        };
        BrokerAdminService::new(backend, self.node.clone()).with_timers(self.timers.clone())
    }

    /// Serves Kafka clients on `listener` (tasks owned by `tasks`, stopped by `cancel`);
    /// topic changes go through [`BrokerRuntime::admin_service`] with `local`.
    pub fn serve_kafka(
        &self,
        listener: tokio::net::TcpListener,
        local: Option<ControllerAdminService>,
        tasks: &TaskTracker,
        cancel: &CancellationToken,
    ) {
        let handler = Arc::new(KafkaHandler {
            node: self.node.clone(),
            groups: GroupsService::new(
                self.node.clone(),
                self.groups.clone(),
                AdminClient::internal(
                    self.controllers.clone(),
                    Duration::from_secs(30),
                    self.secret.clone(),
                ),
            ),
            txns: self.txn_front(),
            admin: self.admin_service(local),
            auto_create: self.config.auto_create_topics_enable,
        });
        let limits = KafkaLimits {
            request_bytes_max: self.config.socket_request_max_bytes,
            idle_timeout: Duration::from_millis(self.config.connections_max_idle_ms),
            connections_max: self.config.connections_max,
        };
        tasks.spawn(crate::kafka::serve(
            listener,
            handler,
            limits,
            tasks.clone(),
            cancel.clone(),
        ));
    }

    /// Registers, loads metadata, opens partitions, then keeps heartbeating and following
    /// metadata in tasks owned by `tasks` until `cancel`.
    pub async fn start(
        &self,
        tasks: &TaskTracker,
        cancel: &CancellationToken,
    ) -> Result<(), RoleError> {
        let deadline = Instant::now() + Duration::from_millis(self.config.registration_timeout_ms);
        self.link
            .register(deadline)
            .await
            .map_err(|e| RoleError::Register(e.to_string()))?;
        loop {
            match self.link.poll_metadata(Duration::ZERO).await {
                Ok(()) => break,
                Err(e) if e.is_retriable() && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(RoleError::Register(e.to_string())),
            }
        }
        self.link.reconcile().await;
        self.link
            .wait_unfenced(deadline)
            .await
            .map_err(|e| RoleError::Register(e.to_string()))?;
        tasks.spawn(
            self.replicas
                .clone()
                .run_isr_changes(self.link.clone(), cancel.clone()),
        );
        tasks.spawn(self.replicas.clone().run_maintenance(cancel.clone()));
        let (groups, group_cancel) = (self.groups.clone(), cancel.clone());
        tasks.spawn(async move {
            let mut last_compaction = Instant::now();
            loop {
                tokio::select! {
                    _ = group_cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
                groups.expire_members().await;
                if last_compaction.elapsed() >= Duration::from_secs(10) {
                    last_compaction = Instant::now();
                    groups.compact_offsets().await;
                }
            }
        });
        tasks.spawn(
            self.link
                .clone()
                .run_producer_id_blocks(self.node.producer_ids().clone(), cancel.clone()),
        );
        tasks.spawn(self.timers.clone().run(cancel.clone()));
        tasks.spawn(
            self.txns
                .clone()
                .run(Duration::from_millis(500), cancel.clone()),
        );
        tasks.spawn(self.link.clone().run_metadata(cancel.clone()));
        tasks.spawn(self.link.clone().run_heartbeats(cancel.clone()));
        Ok(())
    }

    /// Controlled shutdown: moves leaderships away, then (after the caller stops the
    /// server and tasks) [`BrokerRuntime::close`].
    pub async fn hand_off(&self) {
        self.link
            .controlled_shutdown(Duration::from_millis(
                self.config.controlled_shutdown_timeout_ms,
            ))
            .await;
    }

    /// Serves until `stop` (or until the server fails), then shuts down in order:
    /// controlled shutdown, background tasks, the gRPC server (in-flight requests finish,
    /// for at most [`DRAIN_TIMEOUT`]), the fetchers, the partitions.
    pub async fn run_until_stopped(
        &self,
        mut server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
        stop: impl std::future::Future<Output = ()>,
        cancel: CancellationToken,
        server_cancel: CancellationToken,
        tasks: TaskTracker,
    ) -> Result<(), RoleError> {
        tokio::select! {
            _ = stop => {}
            result = &mut server => {
                cancel.cancel();
                self.close().await;
                return match result {
                    Ok(Err(e)) => Err(e.into()),
                    _ => Ok(()),
                };
            }
        }
        self.hand_off().await;
        cancel.cancel();
        tasks.close();
        tasks.wait().await;
        server_cancel.cancel();
        if tokio::time::timeout(DRAIN_TIMEOUT, server).await.is_err() {
            tracing::warn!(
                timeout_ms = DRAIN_TIMEOUT.as_millis() as u64,
                "requests still running at shutdown; closing the partitions under them"
            );
        }
        self.close().await;
        Ok(())
    }

    /// What the HTTP port reads of this broker.
    pub fn http_role(&self) -> crate::http::health::BrokerRole {
        crate::http::health::BrokerRole {
            node: self.node.clone(),
            link: self.link.clone(),
            groups: self.groups.clone(),
            timers: self.timers.clone(),
        }
    }

    /// Stops the fetchers and closes every partition cleanly.
    pub async fn close(&self) {
        self.replicas.stop().await;
        let partitions = self.node.partitions().clone();
        let _ = tokio::task::spawn_blocking(move || partitions.close_all()).await;
    }
}

/// Longest a shutdown waits for in-flight requests (a long-polling fetch ends at once
/// when the server stops; a produce waiting for acks=all ends within its timeout).
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Binds the Kafka listener at `address`, if one is configured; a failure stops the role
/// with the address in the error, as for the gRPC listener.
pub async fn bind_kafka(
    address: Option<String>,
) -> Result<Option<(tokio::net::TcpListener, std::net::SocketAddr)>, RoleError> {
    let Some(address) = address else {
        return Ok(None);
    };
    let bound = bind(&address).await.map_err(|e| match e {
        RoleError::Listen {
            address, source, ..
        } => RoleError::Listen {
            what: "cannot serve Kafka clients (kafka_listen; `none` turns it off) on",
            address,
            source,
        },
        other => other,
    })?;
    Ok(Some(bound))
}

/// Runs a broker until SIGTERM or Ctrl-C.
pub async fn run(config: BrokerConfig) -> Result<(), RoleError> {
    // Installed before any server runs: metric handles made before it would be no-ops.
    let http = crate::config::optional_listen(&config.http_listen, None);
    if http.is_some() {
        crate::http::install_recorder();
    }
    super::fd_limit::raise_and_log();
    config.validate()?;
    let internal_listen = config.internal_listen_address()?;
    let secret = node_secret(&config.cluster_secret_file, &internal_listen)?;
    let (listener, address) = bind(&config.listen).await?;
    let (internal_listener, internal_address) = bind(&internal_listen).await?;
    let kafka = bind_kafka(config.kafka_listen_address(None)).await?;
    let advertised = AdvertisedAddresses::of(
        &config,
        address,
        internal_address,
        kafka.as_ref().map(|k| k.1),
    );
    let runtime = BrokerRuntime::new(&config, advertised, secret.clone())?;
    let cancel = CancellationToken::new();
    let server_cancel = CancellationToken::new();
    let tasks = TaskTracker::new();
    let (broker, admin, replication, groups) = runtime.services(None);
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<BrokerServer<BrokerService>>().await;
    let (reflection, reflection_alpha) = super::reflection(super::BROKER_SERVICES)?;
    let client = super::server_builder()
        .layer(RequestMetricsLayer)
        .layer(CodeLayer)
        .layer(RefuseInternalLayer)
        .add_service(broker)
        .add_service(admin)
        .add_service(groups)
        .add_service(runtime.txn_service())
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .serve_with_incoming_shutdown(
            crate::net::serve_incoming(
                listener,
                config.listener_limits(),
                "broker",
                None,
                server_cancel.clone(),
            ),
            server_cancel.clone().cancelled_owned(),
        );
    let internal = super::server_builder()
        .layer(CodeLayer)
        .add_service(replication)
        .add_service(runtime.timer_service())
        .add_service(runtime.txn_marker_service())
        .serve_with_incoming_shutdown(
            crate::net::serve_incoming(
                internal_listener,
                config.listener_limits(),
                "broker internal",
                Some(secret),
                server_cancel.clone(),
            ),
            server_cancel.clone().cancelled_owned(),
        );
    let server = tokio::spawn(async move { tokio::try_join!(client, internal).map(|_| ()) });
    let stop = shutdown_signal();
    let roles = crate::http::Roles {
        controller: None,
        broker: Some(runtime.http_role()),
        client_address: Some(address),
        console_hosts: crate::config::host_list(&config.http_allowed_hosts),
    };
    super::start_http(http, roles, &tasks, cancel.clone()).await?;
    runtime.start(&tasks, &cancel).await?;
    if let Some((listener, kafka_address)) = kafka {
        runtime.serve_kafka(listener, None, &tasks, &cancel);
        tracing::info!(%kafka_address, "serving Kafka clients");
    }
    tracing::info!(broker_id = config.broker_id, %address, %internal_address, data_dir = %config.data_dir.display(), "broker started");
    announce_ready("broker", address);
    let result = runtime
        .run_until_stopped(server, stop, cancel, server_cancel, tasks)
        .await;
    tracing::info!("broker stopped");
    result
}
