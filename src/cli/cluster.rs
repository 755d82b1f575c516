//! `tidelog cluster describe`: controllers (Raft role, term, indexes, lag) and brokers.

use serde_json::{json, Value};

use super::client_args::{block_on, ClientArgs};
use super::{CliError, OutputFormat};
use crate::api::proto::DescribeClusterResponse;
use crate::client::AdminClient;

/// `tidelog cluster ...`.
#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    #[command(subcommand)]
    command: ClusterCommand,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Debug, clap::Subcommand)]
enum ClusterCommand {
    /// Show the controller quorum and the brokers.
    Describe,
}

/// Runs `tidelog cluster ...`.
pub fn run(args: &ClusterArgs) -> Result<(), CliError> {
    let client = AdminClient::new(args.client.addresses()?, args.client.timeout());
    let output = args.client.output;
    block_on(async move {
        match args.command {
            ClusterCommand::Describe => {
                let r = client.describe_cluster().await?;
                match output {
                    OutputFormat::Json => println!("{}", cluster_json(&r)),
                    OutputFormat::Table => print_table(&r),
                }
            }
        }
        Ok(())
    })?
}

fn cluster_json(r: &DescribeClusterResponse) -> Value {
    let controllers: Vec<Value> = r
        .controllers
        .iter()
        .map(|c| {
            let mut v = json!({
                "id": c.id, "address": c.address, "role": c.role, "term": c.term,
                "commit_index": c.commit_index, "applied_index": c.applied_index, "lag": c.lag,
            });
            if !c.error.is_empty() {
                v["error"] = json!(c.error);
            }
            v
        })
        .collect();
    let brokers: Vec<Value> = r
        .brokers
        .iter()
        .map(|s| {
            let b = s.broker.clone().unwrap_or_default();
            json!({
                "id": b.id, "address": b.address, "kafka_address": b.kafka_address,
                "rack": b.rack, "epoch": b.epoch,
                "state": b.state, "last_heartbeat_age_ms": s.last_heartbeat_age_ms,
                "under_replicated_partitions": s.under_replicated_partitions,
            })
        })
        .collect();
    json!({
        "cluster_id": r.cluster_id,
        "leader": r.leader,
        "metadata_version": r.metadata_version,
        "controllers": controllers,
        "brokers": brokers,
        "under_replicated_partitions": r.under_replicated_partitions,
        "offline_partitions": r.offline_partitions,
    })
}

fn print_table(r: &DescribeClusterResponse) {
    let leader = r.leader.map_or("none".to_owned(), |l| l.to_string());
    println!("Cluster id: {}", r.cluster_id);
    println!(
        "Metadata version: {}   Raft leader: {}   Under-replicated partitions: {}   Offline partitions: {}",
        r.metadata_version, leader, r.under_replicated_partitions, r.offline_partitions
    );
    println!();
    println!(
        "{:<4} {:<22} {:<12} {:>6} {:>10} {:>10} {:>6}",
        "ID", "ADDRESS", "ROLE", "TERM", "COMMIT", "APPLIED", "LAG"
    );
    for c in &r.controllers {
        let lag = c.lag.map_or("-".to_owned(), |l| l.to_string());
        println!(
            "{:<4} {:<22} {:<12} {:>6} {:>10} {:>10} {:>6}{}",
            c.id,
            c.address,
            c.role,
            c.term,
            c.commit_index,
            c.applied_index,
            lag,
            if c.error.is_empty() {
                String::new()
            } else {
                format!("  ({})", c.error)
            }
        );
    }
    println!();
    if r.brokers.is_empty() {
        println!("No brokers registered.");
        return;
    }
    println!(
        "{:<6} {:<22} {:<22} {:<10} {:>10} {:<14} {:>16}",
        "BROKER", "ADDRESS", "KAFKA_ADDRESS", "RACK", "EPOCH", "STATE", "HEARTBEAT_AGE_MS"
    );
    for s in &r.brokers {
        let b = s.broker.clone().unwrap_or_default();
        println!(
            "{:<6} {:<22} {:<22} {:<10} {:>10} {:<14} {:>16}",
            b.id,
            b.address,
            b.kafka_address.unwrap_or_else(|| "-".to_owned()),
            b.rack.unwrap_or_else(|| "-".to_owned()),
            b.epoch,
            b.state,
            s.last_heartbeat_age_ms
                .map_or("-".to_owned(), |a| a.to_string())
        );
    }
}
