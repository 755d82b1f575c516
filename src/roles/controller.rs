//! `tidelog controller`: one member of the metadata quorum.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{announce_ready, bind, node_secret, shutdown_signal, RoleError};
use crate::api::admin_service::{Callers, ControllerAdminService};
use crate::api::code_layer::CodeLayer;
use crate::api::controller_service::ControllerService;
use crate::api::forward::PeerChannels;
use crate::api::port_guard::RefuseInternalLayer;
use crate::api::proto::admin_server::AdminServer;
use crate::api::proto::controller_server::ControllerServer;
use crate::api::proto::raft_server::RaftServer;
use crate::api::raft_service::RaftService;
use crate::api::request_metrics::RequestMetricsLayer;
use crate::config::ControllerConfig;
use crate::controller::ControllerNode;
use crate::net::node_auth::ClusterSecret;

/// Largest gRPC message between controllers (Raft batches and snapshot chunks).
const RAFT_MESSAGE_BYTES_MAX: usize = 64 * 1024 * 1024;

/// Runs a controller until SIGTERM or Ctrl-C.
pub async fn run(mut config: ControllerConfig) -> Result<(), RoleError> {
    // Installed before any server runs: metric handles made before it would be no-ops.
    let http = crate::config::optional_listen(&config.http_listen, None);
    if http.is_some() {
        crate::http::install_recorder();
    }
    config.validate()?;
    let internal_listen = config.internal_listen_address()?;
    let secret = node_secret(&config.cluster_secret_file, &internal_listen)?;
    let (listener, address) = bind(&config.listen).await?;
    let (internal_listener, internal_address) = bind(&internal_listen).await?;
    config.listen = address.to_string();
    let node = ControllerNode::start(&config, secret.clone()).await?;
    let cancel = CancellationToken::new();
    let tasks = TaskTracker::new();
    tasks.spawn(node.clone().run_housekeeping(cancel.clone()));
    tasks.spawn(node.clone().watch_core(cancel.clone()));
    let roles = crate::http::Roles {
        controller: Some(node.clone()),
        broker: None,
        client_address: Some(address),
        console_hosts: crate::config::host_list(&config.http_allowed_hosts),
    };
    super::start_http(http, roles, &tasks, cancel.clone()).await?;
    let server = tasks.spawn(serve(
        node.clone(),
        Listeners {
            client: listener,
            internal: internal_listener,
            limits: config.listener_limits(),
        },
        secret,
        cancel.clone(),
    ));
    tracing::info!(node_id = node.id(), %address, %internal_address, data_dir = %config.data_dir.display(), "controller started");
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

/// A controller's two bound ports.
pub struct Listeners {
    /// Clients: Admin, health, reflection.
    pub client: tokio::net::TcpListener,
    /// Nodes: Raft, Controller, forwarded Admin.
    pub internal: tokio::net::TcpListener,
    /// Limits of each.
    pub limits: crate::net::ListenerLimits,
}

/// Serves the controller's gRPC services on its two ports until `cancel`.
pub async fn serve(
    node: Arc<ControllerNode>,
    listeners: Listeners,
    secret: Arc<ClusterSecret>,
    cancel: CancellationToken,
) -> Result<(), RoleError> {
    let peers = Arc::new(PeerChannels::new(secret.clone()));
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<AdminServer<ControllerAdminService>>()
        .await;
    let (reflection, reflection_alpha) = super::reflection(super::CONTROLLER_SERVICES)?;
    let client = super::server_builder()
        .layer(RequestMetricsLayer)
        .layer(CodeLayer)
        .layer(RefuseInternalLayer)
        .add_service(AdminServer::new(ControllerAdminService::new(
            node.clone(),
            peers.clone(),
            Callers::Clients,
        )))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .serve_with_incoming_shutdown(
            crate::net::serve_incoming(
                listeners.client,
                listeners.limits,
                "controller",
                None,
                cancel.clone(),
            ),
            cancel.clone().cancelled_owned(),
        );
    let internal = super::server_builder()
        .layer(CodeLayer)
        .add_service(
            RaftServer::new(RaftService::new(node.clone()))
                .max_decoding_message_size(RAFT_MESSAGE_BYTES_MAX)
                .max_encoding_message_size(RAFT_MESSAGE_BYTES_MAX),
        )
        .add_service(ControllerServer::new(ControllerService::new(
            node.clone(),
            peers.clone(),
        )))
        .add_service(AdminServer::new(ControllerAdminService::new(
            node,
            peers,
            Callers::Nodes,
        )))
        .serve_with_incoming_shutdown(
            crate::net::serve_incoming(
                listeners.internal,
                listeners.limits,
                "controller internal",
                Some(secret),
                cancel.clone(),
            ),
            cancel.cancelled_owned(),
        );
    tokio::try_join!(client, internal)?;
    Ok(())
}
