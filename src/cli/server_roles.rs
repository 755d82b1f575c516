//! `tidelog broker` and `tidelog standalone`: flags of the broker roles.

use std::path::PathBuf;

use super::client_args::block_on;
use super::CliError;
use crate::config::{self, BrokerConfig, ControllerConfig};

/// Flags of `tidelog broker`; each overrides the config file and `TIDELOG_*` variables.
#[derive(Debug, clap::Args)]
pub struct BrokerArgs {
    /// This broker's id (>= 0).
    #[arg(long)]
    pub broker_id: Option<i32>,
    /// Address to serve clients on (default 127.0.0.1:9292).
    #[arg(long)]
    pub listen: Option<String>,
    /// Address of the internal listener, where other brokers fetch (default: the --listen port + 100).
    #[arg(long)]
    pub internal_listen: Option<String>,
    /// The controllers' internal listeners, comma-separated (default 127.0.0.1:9393).
    #[arg(long)]
    pub controllers: Option<String>,
    /// A file holding the secret all nodes of the cluster share (>= 16 bytes).
    #[arg(long)]
    pub cluster_secret_file: Option<PathBuf>,
    /// Where partitions live (default ./tidelog-data).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// This broker's rack, for rack-aware placement.
    #[arg(long)]
    pub rack: Option<String>,
    /// HTTP address for /metrics and /health/* (`none`: off); default off.
    #[arg(long)]
    pub http_listen: Option<String>,
    /// Address to serve Kafka's binary protocol on (default: none; `none` turns it off).
    #[arg(long)]
    pub kafka_listen: Option<String>,
    /// Address Kafka clients are told to use (default: the --kafka-listen address).
    #[arg(long)]
    pub kafka_advertised_address: Option<String>,
    /// A TOML file of settings (see config/tidelog.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

/// Flags of `tidelog standalone`.
#[derive(Debug, clap::Args)]
pub struct StandaloneArgs {
    /// Where metadata and partitions live (default ./tidelog-data).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Address to serve clients on (default 127.0.0.1:9292).
    #[arg(long)]
    pub listen: Option<String>,
    /// Address of an internal listener for other nodes (default: a private loopback port
    /// only this process uses).
    #[arg(long)]
    pub internal_listen: Option<String>,
    /// A file holding the secret all nodes of the cluster share (>= 16 bytes).
    #[arg(long)]
    pub cluster_secret_file: Option<PathBuf>,
    /// HTTP address for /metrics and /health/* (`none`: off); default 127.0.0.1:9644.
    #[arg(long)]
    pub http_listen: Option<String>,
    /// Address to serve Kafka's binary protocol on (default 127.0.0.1:9092; `none` turns
    /// it off).
    #[arg(long)]
    pub kafka_listen: Option<String>,
    /// Address Kafka clients are told to use (default: the --kafka-listen address).
    #[arg(long)]
    pub kafka_advertised_address: Option<String>,
    /// A TOML file of settings (see config/tidelog.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

fn load<T: serde::Serialize + serde::de::DeserializeOwned + Default>(
    file: Option<&std::path::Path>,
    flags: &[(&str, Option<String>)],
) -> Result<T, CliError> {
    config::load(file, flags, &config::known_settings())
        .map_err(|e| CliError::new("INVALID_CONFIG", e.0))
}

/// Runs the broker role until SIGTERM or Ctrl-C.
pub fn run_broker(args: &BrokerArgs) -> Result<(), CliError> {
    let config: BrokerConfig = load(
        args.config.as_deref(),
        &[
            ("broker_id", args.broker_id.map(|v| v.to_string())),
            ("listen", args.listen.clone()),
            ("internal_listen", args.internal_listen.clone()),
            ("http_listen", args.http_listen.clone()),
            ("controllers", args.controllers.clone()),
            (
                "cluster_secret_file",
                args.cluster_secret_file
                    .as_ref()
                    .map(|d| d.display().to_string()),
            ),
            (
                "data_dir",
                args.data_dir.as_ref().map(|d| d.display().to_string()),
            ),
            ("rack", args.rack.clone()),
            ("kafka_listen", args.kafka_listen.clone()),
            (
                "kafka_advertised_address",
                args.kafka_advertised_address.clone(),
            ),
        ],
    )?;
    config
        .validate()
        .map_err(|e| CliError::new("INVALID_CONFIG", e.0))?;
    block_on(crate::roles::broker::run(config))?
        .map_err(|e| CliError::new("STARTUP_FAILED", e.to_string()))
}

/// Runs controller and broker in one process until SIGTERM or Ctrl-C.
pub fn run_standalone(args: &StandaloneArgs) -> Result<(), CliError> {
    // No defaults here: they live in the defaults layer, under the file and variables.
    let flags = [
        ("listen", args.listen.clone()),
        ("internal_listen", args.internal_listen.clone()),
        ("http_listen", args.http_listen.clone()),
        (
            "cluster_secret_file",
            args.cluster_secret_file
                .as_ref()
                .map(|d| d.display().to_string()),
        ),
        (
            "data_dir",
            args.data_dir.as_ref().map(|d| d.display().to_string()),
        ),
        ("kafka_listen", args.kafka_listen.clone()),
        (
            "kafka_advertised_address",
            args.kafka_advertised_address.clone(),
        ),
    ];
    let broker: BrokerConfig = load(args.config.as_deref(), &flags)?;
    let controller: ControllerConfig = load(args.config.as_deref(), &flags)?;
    broker
        .validate()
        .map_err(|e| CliError::new("INVALID_CONFIG", e.0))?;
    block_on(crate::roles::standalone::run(controller, broker))?
        .map_err(|e| CliError::new("STARTUP_FAILED", e.to_string()))
}
