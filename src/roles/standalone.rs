//! `tidelog standalone`: a single-voter controller quorum and broker 1 in one process,
//! serving clients on one port: the zero-setup default. The broker talks to its controller
//! over loopback gRPC, exactly as a separate broker would, through an internal listener
//! that by default is an ephemeral loopback port guarded by a random secret (only this
//! process can use it); set `internal_listen` (and `cluster_secret_file`) to let other
//! nodes in. The controller's Raft log and snapshots live in `<data-dir>/metadata/`,
//! partitions in `<data-dir>/<topic>-<partition>/`.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::broker::{AdvertisedAddresses, BrokerRuntime};
use super::{announce_ready, bind, node_secret, shutdown_signal, RoleError};
use crate::api::admin_service::{Callers, ControllerAdminService};
use crate::api::broker_service::BrokerService;
use crate::api::code_layer::CodeLayer;
use crate::api::controller_service::ControllerService;
use crate::api::forward::PeerChannels;
use crate::api::port_guard::RefuseInternalLayer;
use crate::api::proto::admin_server::AdminServer;
use crate::api::proto::broker_server::BrokerServer;
use crate::api::proto::controller_server::ControllerServer;
use crate::api::proto::raft_server::RaftServer;
use crate::api::raft_service::RaftService;
use crate::api::request_metrics::RequestMetricsLayer;
use crate::config::{BrokerConfig, ControllerConfig};
use crate::controller::ControllerNode;
use crate::net::node_auth::ClusterSecret;

/// Runs controller and broker in one process until SIGTERM or Ctrl-C. `controller` and
/// `broker` come from the same configuration layers; listen addresses and data directory
/// are the broker's.
pub async fn run(
    mut controller: ControllerConfig,
    mut broker: BrokerConfig,
) -> Result<(), RoleError> {
    // Installed before any server runs: metric handles made before it would be no-ops.
    let http = crate::config::optional_listen(
        &broker.http_listen,
        Some(crate::config::STANDALONE_HTTP_LISTEN),
    );
    if http.is_some() {
        crate::http::install_recorder();
    }
    super::fd_limit::raise_and_log();
    let private = broker.internal_listen.is_empty();
    let (internal_bind, secret) = if private {
        ("127.0.0.1:0", Arc::new(ClusterSecret::random()))
    } else {
        let secret = node_secret(&broker.cluster_secret_file, &broker.internal_listen)?;
        (broker.internal_listen.as_str(), secret)
    };
    let (listener, address) = bind(&broker.listen).await?;
    let (internal_listener, internal_address) = bind(internal_bind).await?;
    let kafka = super::broker::bind_kafka(
        broker.kafka_listen_address(Some(crate::config::STANDALONE_KAFKA_LISTEN)),
    )
    .await?;
    let advertised = AdvertisedAddresses::of(
        &broker,
        address,
        internal_address,
        kafka.as_ref().map(|k| k.1),
    );
    controller.node_id = 1;
    controller.listen = advertised.client.clone();
    controller.peers = format!("1={}", advertised.internal);
    controller.data_dir = broker.data_dir.join("metadata");
    controller.validate()?;
    broker.controllers = advertised.internal.clone();
    let node = ControllerNode::start(&controller, secret.clone()).await?;
    let runtime = BrokerRuntime::new(&broker, advertised, secret.clone())?;
    let cancel = CancellationToken::new();
    let server_cancel = CancellationToken::new();
    let tasks = TaskTracker::new();
    tasks.spawn(node.clone().run_housekeeping(cancel.clone()));
    tasks.spawn(node.clone().watch_core(cancel.clone()));
    let peers = Arc::new(PeerChannels::new(secret.clone()));
    let (broker_service, admin_service, replication_service, groups_service) =
        runtime.services(Some(ControllerAdminService::new(
            node.clone(),
            peers.clone(),
            Callers::Clients,
        )));
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<BrokerServer<BrokerService>>().await;
    let (reflection, reflection_alpha) = super::reflection(super::BROKER_SERVICES)?;
    let client = super::server_builder()
        .layer(RequestMetricsLayer)
        .layer(CodeLayer)
        .layer(RefuseInternalLayer)
        .add_service(broker_service)
        .add_service(admin_service)
        .add_service(groups_service)
        .add_service(runtime.txn_service())
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .serve_with_incoming_shutdown(
            crate::net::serve_incoming(
                listener,
                broker.listener_limits(),
                "standalone",
                None,
                server_cancel.clone(),
            ),
            server_cancel.clone().cancelled_owned(),
        );
    let internal = super::server_builder()
        .layer(CodeLayer)
        .add_service(RaftServer::new(RaftService::new(node.clone())))
        .add_service(ControllerServer::new(ControllerService::new(
            node.clone(),
            peers.clone(),
        )))
        .add_service(AdminServer::new(ControllerAdminService::new(
            node.clone(),
            peers.clone(),
            Callers::Nodes,
        )))
        .add_service(replication_service)
        .add_service(runtime.timer_service())
        .add_service(runtime.txn_marker_service())
        .serve_with_incoming_shutdown(
            crate::net::serve_incoming(
                internal_listener,
                broker.listener_limits(),
                "standalone internal",
                Some(secret),
                server_cancel.clone(),
            ),
            server_cancel.clone().cancelled_owned(),
        );
    let server = tokio::spawn(async move { tokio::try_join!(client, internal).map(|_| ()) });
    let stop = shutdown_signal();
    let roles = crate::http::Roles {
        controller: Some(node.clone()),
        broker: Some(runtime.http_role()),
        client_address: Some(address),
        console_hosts: crate::config::host_list(&broker.http_allowed_hosts),
    };
    super::start_http(http, roles, &tasks, cancel.clone()).await?;
    runtime.start(&tasks, &cancel).await?;
    if let Some((listener, kafka_address)) = kafka {
        let local = ControllerAdminService::new(node.clone(), peers.clone(), Callers::Clients);
        runtime.serve_kafka(listener, Some(local), &tasks, &cancel);
        tracing::info!(%kafka_address, "serving Kafka clients");
    }
    tracing::info!(%address, %internal_address, data_dir = %broker.data_dir.display(), "standalone started");
    announce_ready("standalone", address);
    let result = runtime
        .run_until_stopped(server, stop, cancel, server_cancel, tasks)
        .await;
    node.shutdown().await;
    tracing::info!("standalone stopped");
    result
}
