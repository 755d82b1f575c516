//! `tidelog controller`: one member of the metadata quorum.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{announce_ready, bind, shutdown_signal, RoleError};
use crate::api::admin_service::ControllerAdminService;
use crate::api::controller_service::ControllerService;
use crate::api::forward::PeerChannels;
use crate::api::proto::admin_server::AdminServer;
use crate::api::proto::controller_server::ControllerServer;
use crate::api::proto::raft_server::RaftServer;
use crate::api::raft_service::RaftService;
use crate::config::ControllerConfig;
use crate::controller::ControllerNode;

/// Largest gRPC message between controllers (Raft batches and snapshot chunks).
const RAFT_MESSAGE_BYTES_MAX: usize = 64 * 1024 * 1024;

/// Runs a controller until SIGTERM or Ctrl-C.
pub async fn run(config: ControllerConfig) -> Result<(), RoleError> {
    config.validate()?;
    let (listener, address) = bind(&config.listen).await?;
    let node = ControllerNode::start(&config).await?;
    let cancel = CancellationToken::new();
    let tasks = TaskTracker::new();
    tasks.spawn(node.clone().run_housekeeping(cancel.clone()));
    let server = tasks.spawn(serve(
        node.clone(),
        listener,
        config.listener_limits(),
        cancel.clone(),
    ));
    tracing::info!(node_id = node.id(), %address, data_dir = %config.data_dir.display(), "controller started");
    let stop = shutdown_signal();
    announce_ready("controller", address);
    tokio::select! {
        _ = stop => {}
        result = server => {
            if let Ok(Err(e)) = result {
                cancel.cancel();
                node.shutdown().await;
                return Err(e);
            }
        }
    }
    cancel.cancel();
    tasks.close();
    tasks.wait().await;
    node.shutdown().await;
    tracing::info!("controller stopped");
    Ok(())
}

/// Serves the controller's gRPC services on `listener` (within `limits`) until `cancel`.
pub async fn serve(
    node: Arc<ControllerNode>,
    listener: tokio::net::TcpListener,
    limits: crate::net::ListenerLimits,
    cancel: CancellationToken,
) -> Result<(), RoleError> {
    let peers = Arc::new(PeerChannels::default());
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<AdminServer<ControllerAdminService>>()
        .await;
    let (reflection, reflection_alpha) = super::reflection(super::CONTROLLER_SERVICES)?;
    tonic::transport::Server::builder()
        .add_service(
            RaftServer::new(RaftService::new(node.clone()))
                .max_decoding_message_size(RAFT_MESSAGE_BYTES_MAX)
                .max_encoding_message_size(RAFT_MESSAGE_BYTES_MAX),
        )
        .add_service(ControllerServer::new(ControllerService::new(
            node.clone(),
            peers.clone(),
        )))
        .add_service(AdminServer::new(ControllerAdminService::new(node, peers)))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .serve_with_incoming_shutdown(
            crate::net::serve_incoming(listener, limits, "controller", cancel.clone()),
            cancel.cancelled_owned(),
        )
        .await?;
    Ok(())
}
