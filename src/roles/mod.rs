//! The long-running roles (`controller`, `broker`, `standalone`):
//! wiring of configuration, node, gRPC servers, background tasks and shutdown.
//!
//! Every role binds its listeners first (so a taken port fails at once), prints
//! `tidelog <role> ready on <ADDR>` (the client port) on stdout when it serves, and stops
//! cleanly on SIGTERM or Ctrl-C: it stops accepting requests, cancels its background tasks
//! and waits for them.
//!
//! Each role serves two ports. The client port serves the public services and refuses
//! the internal ones ([`crate::api::port_guard`]); the internal port serves only the
//! internal services (Raft, broker lifecycle, replication, and Admin for calls forwarded
//! by other nodes), to nodes that pass the handshake of [`crate::net::node_auth`].

pub mod broker;
pub mod controller;
pub mod fd_limit;
pub mod standalone;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::net::node_auth::ClusterSecret;

use tonic_reflection::server::{v1, v1alpha};

/// Public services a broker (and `standalone`) lists through reflection.
pub const BROKER_SERVICES: &[&str] = &[
    "tidelog.v1.Broker",
    "tidelog.v1.Admin",
    "tidelog.v1.Groups",
    "tidelog.v1.Transactions",
    "grpc.health.v1.Health",
];
/// Public services a controller lists through reflection.
pub const CONTROLLER_SERVICES: &[&str] = &["tidelog.v1.Admin", "grpc.health.v1.Health"];

/// gRPC reflection, v1 and v1alpha (grpcurl before 1.8.8 and Python's grpcio-reflection
/// speak only v1alpha), listing `public` services and the reflection service itself;
/// internal services (Raft, broker lifecycle, replication) are not listed.
#[allow(clippy::type_complexity)]
pub fn reflection(
    public: &[&str],
) -> Result<
    (
        v1::ServerReflectionServer<impl v1::ServerReflection>,
        v1alpha::ServerReflectionServer<impl v1alpha::ServerReflection>,
    ),
    RoleError,
> {
    let builder = |reflection_name: &str| {
        let mut b = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::api::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name(reflection_name);
        for name in public {
            b = b.with_service_name(*name);
        }
        b
    };
    let error = |e: tonic_reflection::server::Error| {
        RoleError::Register(format!("reflection service: {e}"))
    };
    Ok((
        builder("grpc.reflection.v1.ServerReflection")
            .build_v1()
            .map_err(error)?,
        builder("grpc.reflection.v1alpha.ServerReflection")
            .build_v1alpha()
            .map_err(error)?,
    ))
}

/// Why a role stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    /// Configuration or start-up failed.
    #[error(transparent)]
    Startup(#[from] crate::controller::StartupError),
    /// The configuration could not be loaded.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigLoadError),
    /// The listener could not be bound or served.
    #[error("{what} {address}: {source}")]
    Listen {
        /// What was being done.
        what: &'static str,
        /// The address.
        address: String,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// The data directory is in use by another process, or cannot be locked.
    #[error("data directory: {0}")]
    DataDir(#[source] crate::partition::LogError),
    /// The broker could not register with the controllers or load metadata.
    #[error("{0}")]
    Register(String),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
}

/// Binds `address` for a gRPC server.
pub async fn bind(address: &str) -> Result<(tokio::net::TcpListener, SocketAddr), RoleError> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|source| RoleError::Listen {
            what: "cannot listen on",
            address: address.to_owned(),
            source,
        })?;
    let local = listener.local_addr().map_err(|source| RoleError::Listen {
        what: "no local address for",
        address: address.to_owned(),
        source,
    })?;
    Ok((listener, local))
}

/// Binds the HTTP port (console, metrics, health) when `address` is set and serves it in a task
/// of `tasks` until `cancel`; returns the bound address. A bind failure stops the role,
/// as for its other listeners.
pub async fn start_http(
    address: Option<String>,
    roles: crate::http::Roles,
    tasks: &tokio_util::task::TaskTracker,
    cancel: tokio_util::sync::CancellationToken,
) -> Result<Option<SocketAddr>, RoleError> {
    let Some(address) = address else {
        return Ok(None);
    };
    crate::http::install_recorder();
    let (listener, local) = bind(&address).await?;
    tasks.spawn(async move {
        if let Err(e) = crate::http::serve(listener, roles, cancel).await {
            tracing::error!(%local, error = %e, "HTTP server failed");
        }
    });
    tracing::info!(%local, "serving the console, /metrics and /health on HTTP");
    Ok(Some(local))
}

/// How often a server pings a connection that has been quiet (HTTP/2 keepalive).
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a ping may go unanswered before the connection is closed: a peer that died,
/// froze or was cut off does not hold a connection (and its slot) forever.
pub const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// A gRPC server builder with the settings every listener shares.
pub fn server_builder() -> tonic::transport::Server {
    use crate::net::{
        HTTP2_CONNECTION_WINDOW_BYTES, HTTP2_FRAME_BYTES_MAX, HTTP2_STREAM_WINDOW_BYTES,
    };
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .initial_stream_window_size(HTTP2_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(HTTP2_CONNECTION_WINDOW_BYTES)
        .max_frame_size(HTTP2_FRAME_BYTES_MAX)
}

/// Installs the SIGTERM handler now (so a signal right after the ready line is caught) and
/// returns a future that resolves on SIGTERM or SIGINT.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    async move {
        match term {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops this process");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        tracing::info!("shutdown requested");
    }
}

/// The cluster secret of a node whose internal listener is `internal` (as configured,
/// checked before binding): read from `file`; without one, the well-known key of an
/// unauthenticated cluster, allowed only when the internal listener is on loopback (with
/// a warning).
pub fn node_secret(file: &str, internal: &str) -> Result<Arc<ClusterSecret>, RoleError> {
    if !file.is_empty() {
        return ClusterSecret::from_file(std::path::Path::new(file))
            .map(Arc::new)
            .map_err(|e| RoleError::Config(crate::config::ConfigLoadError(e)));
    }
    if !is_loopback(internal) {
        return Err(RoleError::Config(crate::config::ConfigLoadError(format!(
            "the internal listener {internal} is reachable from other hosts, so cluster_secret_file must be set (a file with a secret of at least 16 bytes that every node shares; see docs/operations.md)"
        ))));
    }
    tracing::warn!(%internal, "no cluster_secret_file: internal RPCs on loopback are not authenticated (any local process can call them); set cluster_secret_file to require the cluster secret");
    Ok(Arc::new(ClusterSecret::unauthenticated()))
}

/// Whether `address` (`host:port`) can only be reached from this machine.
fn is_loopback(address: &str) -> bool {
    if let Ok(a) = address.parse::<SocketAddr>() {
        return a.ip().is_loopback();
    }
    address
        .rsplit_once(':')
        .is_some_and(|(host, _)| host.eq_ignore_ascii_case("localhost"))
}

/// Prints the ready line scripts and tests wait for.
pub fn announce_ready(role: &str, address: SocketAddr) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "tidelog {role} ready on {address}");
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_internal_listeners_may_go_without_a_secret() {
        assert!(is_loopback("127.0.0.1:9393"));
        assert!(is_loopback("[::1]:9393"));
        assert!(is_loopback("localhost:9393"));
        assert!(!is_loopback("0.0.0.0:9393"));
        assert!(!is_loopback("10.1.2.3:9393"));
        assert!(!is_loopback("controller-1:9393"));
        assert!(node_secret("", "10.1.2.3:9393").is_err());
        assert!(!node_secret("", "127.0.0.1:0").unwrap().is_authenticated());
    }
}
