//! `tidelog standalone`: a single-voter controller quorum and broker 1 in one process, on
//! one port: the zero-setup default. The broker talks to its controller over loopback
//! gRPC, exactly as a separate broker would; the controller's Raft log and snapshots live
//! in `<data-dir>/metadata/`, partitions in `<data-dir>/<topic>-<partition>/`.

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::broker::BrokerRuntime;
use super::{announce_ready, bind, shutdown_signal, RoleError};
use crate::api::admin_service::ControllerAdminService;
use crate::api::broker_service::BrokerService;
use crate::api::controller_service::ControllerService;
use crate::api::forward::PeerChannels;
use crate::api::proto::broker_server::BrokerServer;
use crate::api::proto::controller_server::ControllerServer;
use crate::api::proto::raft_server::RaftServer;
use crate::api::raft_service::RaftService;
use crate::config::{BrokerConfig, ControllerConfig};
use crate::controller::ControllerNode;

/// Runs controller and broker in one process until SIGTERM or Ctrl-C. `controller` and
/// `broker` come from the same configuration layers; listen address and data directory are
/// the broker's.
pub async fn run(
    mut controller: ControllerConfig,
    mut broker: BrokerConfig,
) -> Result<(), RoleError> {
    let (listener, address) = bind(&broker.listen).await?;
    let advertised = if broker.advertised_address.is_empty() {
        address.to_string()
    } else {
        broker.advertised_address.clone()
    };
    controller.node_id = 1;
    controller.listen = advertised.clone();
    controller.peers = format!("1={advertised}");
    controller.data_dir = broker.data_dir.join("metadata");
    controller.validate()?;
    broker.controllers = advertised.clone();
    let node = ControllerNode::start(&controller).await?;
    let runtime = BrokerRuntime::new(&broker, advertised)?;
    let cancel = CancellationToken::new();
    let server_cancel = CancellationToken::new();
    let tasks = TaskTracker::new();
    tasks.spawn(node.clone().run_housekeeping(cancel.clone()));
    let peers = std::sync::Arc::new(PeerChannels::default());
    let (broker_service, admin_service, replication_service, groups_service) = runtime.services(
        Some(ControllerAdminService::new(node.clone(), peers.clone())),
    );
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<BrokerServer<BrokerService>>().await;
    let (reflection, reflection_alpha) = super::reflection(super::BROKER_SERVICES)?;
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RaftServer::new(RaftService::new(node.clone())))
            .add_service(ControllerServer::new(ControllerService::new(
                node.clone(),
                peers,
            )))
            .add_service(broker_service)
            .add_service(admin_service)
            .add_service(replication_service)
            .add_service(groups_service)
            .add_service(health_service)
            .add_service(reflection)
            .add_service(reflection_alpha)
            .serve_with_incoming_shutdown(
                crate::net::serve_incoming(
                    listener,
                    broker.listener_limits(),
                    "standalone",
                    server_cancel.clone(),
                ),
                server_cancel.clone().cancelled_owned(),
            ),
    );
    let stop = shutdown_signal();
    runtime.start(&tasks, &cancel).await?;
    tracing::info!(%address, data_dir = %broker.data_dir.display(), "standalone started");
    announce_ready("standalone", address);
    let result = runtime
        .run_until_stopped(server, stop, cancel, server_cancel, tasks)
        .await;
    node.shutdown().await;
    tracing::info!("standalone stopped");
    result
}
