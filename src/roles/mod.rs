//! The long-running roles (`controller`, `broker`, `standalone`):
//! wiring of configuration, node, gRPC server, background tasks and shutdown.
//!
//! Every role binds its listener first (so a taken port fails at once), prints
//! `tidelog <role> ready on <ADDR>` on stdout when it serves, and stops cleanly on SIGTERM
//! or Ctrl-C: it stops accepting requests, cancels its background tasks and waits for them.

pub mod broker;
pub mod controller;
pub mod standalone;

use std::net::SocketAddr;

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

/// Accepted connections of `listener`, with TCP_NODELAY (small RPCs must not wait for
/// Nagle's algorithm and delayed ACKs: that adds up to 40 ms per round trip).
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
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

/// Prints the ready line scripts and tests wait for.
pub fn announce_ready(role: &str, address: SocketAddr) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "tidelog {role} ready on {address}");
    let _ = out.flush();
}
