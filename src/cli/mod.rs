//! Command-line tools, one file per subcommand family. `main.rs` only parses and
//! dispatches; everything a subcommand does lives here.

pub mod client_args;
pub mod cluster;
pub mod consume;
pub mod controller;
pub mod dlq;
pub mod dump_log;
pub mod groups;
pub mod logging;
pub mod perf;
pub mod produce;
pub mod progress;
pub mod repair;
pub mod scheduled;
pub mod server_roles;
pub mod text;
pub mod topics;
pub mod transactions;
pub mod txn_copy;

use std::fmt;

/// How a subcommand prints its results (`--output`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OutputFormat {
    /// Human-readable lines.
    #[default]
    Table,
    /// One JSON object per line, in the shapes of docs/cli.md.
    Json,
}

/// A failure a subcommand reports as `error: <CODE>: <message>` with a non-zero exit.
#[derive(Debug)]
pub struct CliError {
    /// Machine-readable code, e.g. `CORRUPT_MESSAGE`.
    pub code: &'static str,
    /// What failed and why.
    pub message: String,
}

impl CliError {
    /// A new error with `code`.
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "error: {}: {}", self.code, self.message)
    }
}

impl std::error::Error for CliError {}
