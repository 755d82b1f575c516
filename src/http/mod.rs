//! The HTTP port of every role (`http_listen`): Prometheus metrics at `/metrics`, health
//! probes at `/health/live` and `/health/ready`, and the web [`console`] at `/`, served by
//! axum on the process's runtime.
//!
//! Counters and histograms are recorded where things happen, through the `metrics`
//! facade (a no-op until [`install_recorder`] runs, so libraries and tests pay nothing);
//! gauges that describe state (offsets per partition, Raft indexes, process figures) are
//! read when `/metrics` is scraped ([`gauges`]). Names and labels are listed in
//! `docs/operations.md`.

pub mod console;
pub mod gauges;
pub mod health;

use std::sync::{Arc, OnceLock};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

pub use health::Roles;

/// Latency buckets in seconds, shared by every histogram: 100 µs to 30 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide Prometheus recorder (once; later calls return the same
/// handle).
pub fn install_recorder() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .expect("non-empty buckets");
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics may be empty");
            }
            gauges::describe();
            handle
        })
        .clone()
}

/// What the HTTP handlers read.
#[derive(Clone)]
struct AppState {
    metrics: PrometheusHandle,
    roles: Arc<Roles>,
}

/// Connections the HTTP port holds at once; more are closed on accept.
const HTTP_CONNECTIONS_MAX: usize = 1024;
/// A connection that is not answered for this long is closed (a client that opens
/// connections and goes silent, or trickles a request at any pace, cannot hold them).
const HTTP_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The HTTP port's listener: at most [`HTTP_CONNECTIONS_MAX`] connections, each closed
/// after [`HTTP_IDLE_TIMEOUT`] idle (through [`crate::net::Conn`], as the gRPC ports).
struct HttpListener {
    listener: tokio::net::TcpListener,
    slots: Arc<tokio::sync::Semaphore>,
    logs: crate::net::LogLimiter,
}

impl axum::serve::Listener for HttpListener {
    type Io = crate::net::Conn;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(a) => a,
                Err(e) => {
                    // E.g. out of file descriptors: back off instead of spinning.
                    if self.logs.allow("accept-error") {
                        tracing::warn!(listener = "http", error = %e, "accept failed");
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            match self.slots.clone().try_acquire_owned() {
                Ok(permit) => {
                    let conn = crate::net::Conn::new(stream, permit, HTTP_IDLE_TIMEOUT, "http")
                        .idle_until_answered();
                    return (conn, peer);
                }
                Err(_) => {
                    if self.logs.allow("limit") {
                        tracing::warn!(
                            listener = "http",
                            limit = HTTP_CONNECTIONS_MAX,
                            "connection limit reached; closing new connections"
                        );
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

/// Serves the HTTP port on `listener` until `cancel`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    roles: Roles,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    let state = AppState {
        metrics: install_recorder(),
        roles: Arc::new(roles),
    };
    let app = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/health/live", get(live))
        .route("/health/ready", get(ready))
        .with_state(state.clone())
        .merge(console::router(console::Console::new(
            state.roles.client_address,
            state.roles.broker.is_some(),
            &state.roles.console_hosts,
        )));
    let listener = HttpListener {
        listener,
        slots: Arc::new(tokio::sync::Semaphore::new(HTTP_CONNECTIONS_MAX)),
        logs: crate::net::LogLimiter::default(),
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(cancel.cancelled_owned())
        .await
}

async fn metrics_page(State(state): State<AppState>) -> impl IntoResponse {
    gauges::refresh(&state.roles).await;
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

async fn live() -> impl IntoResponse {
    Json(serde_json::json!({ "status": "live" }))
}

async fn ready(State(state): State<AppState>) -> impl IntoResponse {
    let (ready, detail) = state.roles.readiness().await;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(detail))
}
