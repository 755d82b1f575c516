//! Log output of every subcommand: `tracing` to stderr, filtered by `RUST_LOG` (default
//! `info,openraft=warn`).
//!
//! One filter on top: openraft reports every failed RPC to a peer controller itself, every
//! 500 ms for as long as the peer is down, in lines of several hundred characters: a WARN
//! and an ERROR from `openraft::replication` and a WARN from its replication handler.
//! Those reports are dropped (storage errors, which openraft also reports there, are kept);
//! `controller::network` logs one WARN when a peer stops answering and one INFO when it
//! answers again instead. A `RUST_LOG` that names `openraft::replication` or
//! `openraft::engine` turns the filter off, to see them all.

use tracing::{Level, Metadata};
use tracing_subscriber::filter::{filter_fn, EnvFilter, FilterExt};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The filter without `RUST_LOG`.
pub const DEFAULT_FILTER: &str = "info,openraft=warn";

/// openraft's replication stream: per-RPC failures at WARN (every error) and ERROR (field
/// `err`: network errors; storage errors carry `error` and are kept).
const REPLICATION_TARGET: &str = "openraft::replication";

/// openraft's leader-side progress handler: "update progress error" at WARN per failure.
const PROGRESS_TARGET: &str = "openraft::engine::handler::replication_handler";

/// Installs the global subscriber; call once, first thing in `main`.
pub fn init() {
    let rust_log = std::env::var("RUST_LOG").ok();
    let env = rust_log
        .as_deref()
        .and_then(|s| EnvFilter::try_new(s).ok())
        .unwrap_or_else(|| EnvFilter::new(DEFAULT_FILTER));
    let quiet =
        !rust_log.is_some_and(|s| s.contains(REPLICATION_TARGET) || s.contains("openraft::engine"));
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(env.and(filter_fn(move |m| !quiet || keep(m))));
    tracing_subscriber::registry().with(layer).init();
}

/// False for openraft's per-RPC failure reports.
fn keep(m: &Metadata<'_>) -> bool {
    if !m.is_event() {
        return true;
    }
    let level = *m.level();
    match m.target() {
        REPLICATION_TARGET if level == Level::WARN => false,
        REPLICATION_TARGET if level == Level::ERROR => m.fields().field("err").is_none(),
        PROGRESS_TARGET if level == Level::WARN => false,
        _ => true,
    }
}
