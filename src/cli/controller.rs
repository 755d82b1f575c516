//! `tidelog controller`: flags of the controller role.

use std::path::PathBuf;

use super::CliError;
use crate::config::{self, ControllerConfig};

/// Flags of `tidelog controller`; each overrides the config file and `TIDELOG_*` variables.
#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    /// This controller's id; must appear in --peers.
    #[arg(long)]
    pub node_id: Option<u64>,
    /// Address to serve clients on (default 127.0.0.1:9293).
    #[arg(long)]
    pub listen: Option<String>,
    /// Address of the internal listener, for the other nodes (default: the --listen port + 100).
    #[arg(long)]
    pub internal_listen: Option<String>,
    /// Every controller's internal listener as id=host:port, comma-separated.
    #[arg(long)]
    pub peers: Option<String>,
    /// A file holding the secret all nodes of the cluster share (>= 16 bytes).
    #[arg(long)]
    pub cluster_secret_file: Option<PathBuf>,
    /// Where the Raft log and snapshots live (default ./tidelog-data).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// HTTP address for /metrics and /health/* (`none`: off); default off.
    #[arg(long)]
    pub http_listen: Option<String>,
    /// A TOML file of settings (see config/tidelog.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

impl ControllerArgs {
    /// The layered configuration.
    pub fn load(&self) -> Result<ControllerConfig, CliError> {
        let mut config: ControllerConfig = config::load(
            self.config.as_deref(),
            &[
                ("node_id", self.node_id.map(|v| v.to_string())),
                ("listen", self.listen.clone()),
                ("internal_listen", self.internal_listen.clone()),
                ("http_listen", self.http_listen.clone()),
                ("peers", self.peers.clone()),
                (
                    "cluster_secret_file",
                    self.cluster_secret_file
                        .as_ref()
                        .map(|d| d.display().to_string()),
                ),
                (
                    "data_dir",
                    self.data_dir.as_ref().map(|d| d.display().to_string()),
                ),
            ],
            &config::known_settings(),
        )
        .map_err(|e| CliError::new("INVALID_CONFIG", e.0))?;
        if config.peers.is_empty() {
            // A single controller needs no peer list.
            let internal = config
                .internal_listen_address()
                .map_err(|e| CliError::new("INVALID_CONFIG", e.0))?;
            config.peers = format!("{}={internal}", config.node_id);
        }
        config
            .validate()
            .map_err(|e| CliError::new("INVALID_CONFIG", e.0))?;
        Ok(config)
    }
}

/// Runs the controller role until SIGTERM or Ctrl-C.
pub fn run(args: &ControllerArgs) -> Result<(), CliError> {
    let config = args.load()?;
    super::client_args::block_on(crate::roles::controller::run(config))?
        .map_err(|e| CliError::new("STARTUP_FAILED", e.to_string()))
}
