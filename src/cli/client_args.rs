//! Flags shared by every client subcommand.

use std::time::Duration;

use super::{CliError, OutputFormat};
use crate::client::connection::parse_bootstrap;
use crate::client::ClientError;

/// `--bootstrap`, `--output` and `--request-timeout-ms`.
#[derive(Debug, Clone, clap::Args)]
pub struct ClientArgs {
    /// Brokers or controllers to start from, comma-separated.
    #[arg(
        long,
        env = "TIDELOG_BOOTSTRAP",
        default_value = "127.0.0.1:9292",
        global = true
    )]
    pub bootstrap: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table, global = true)]
    pub output: OutputFormat,
    /// How long one request may take, retries included (ms).
    #[arg(long, default_value_t = 30_000, global = true)]
    pub request_timeout_ms: u64,
}

impl ClientArgs {
    /// The bootstrap addresses.
    pub fn addresses(&self) -> Result<Vec<String>, CliError> {
        parse_bootstrap(&self.bootstrap).map_err(CliError::from)
    }

    /// The per-request deadline.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

impl From<ClientError> for CliError {
    fn from(e: ClientError) -> Self {
        CliError::new(e.code.as_str(), e.message)
    }
}

/// Runs an async subcommand on a fresh runtime.
pub fn block_on<F: std::future::Future>(future: F) -> Result<F::Output, CliError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| {
            CliError::new(
                "UNKNOWN_SERVER_ERROR",
                format!("cannot start the async runtime: {e}"),
            )
        })?;
    Ok(runtime.block_on(future))
}

/// Parses repeated `k=v` flags.
pub fn parse_pairs(
    flag: &str,
    pairs: &[String],
) -> Result<std::collections::BTreeMap<String, String>, CliError> {
    let mut out = std::collections::BTreeMap::new();
    for p in pairs {
        let Some((k, v)) = p.split_once('=') else {
            return Err(CliError::new(
                "INVALID_REQUEST",
                format!("{flag} '{p}' is not key=value"),
            ));
        };
        out.insert(k.trim().to_owned(), v.trim().to_owned());
    }
    Ok(out)
}

/// Kafka's `isolation.level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum Isolation {
    /// Everything below the high watermark, open and aborted transactions included.
    ReadUncommitted,
    /// Committed transactions only, below the last stable offset.
    ReadCommitted,
}

impl Isolation {
    /// Its name as the CLI and JSON output spell it.
    pub fn name(self) -> &'static str {
        match self {
            Isolation::ReadUncommitted => "read_uncommitted",
            Isolation::ReadCommitted => "read_committed",
        }
    }
}
