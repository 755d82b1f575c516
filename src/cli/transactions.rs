//! `tidelog transactions list|describe`, like `kafka-transactions.sh`: the state,
//! partitions, age and producer id/epoch of transactional ids; and `copy`, the
//! exactly-once copier ([`super::txn_copy`]).

use std::time::Duration;

use serde_json::{json, Value};

use super::client_args::{block_on, ClientArgs};
use super::txn_copy::{copy, CopySpec};
use super::{CliError, OutputFormat};
use crate::api::proto::TransactionDescription;
use crate::broker::node::now_ms;
use crate::client::transactions::TxnClient;

/// `tidelog transactions ...`.
#[derive(Debug, clap::Args)]
pub struct TransactionsArgs {
    #[command(subcommand)]
    command: TransactionsCommand,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Debug, clap::Subcommand)]
enum TransactionsCommand {
    /// Every transactional id of the cluster (from every broker's coordinator).
    List {
        /// Only ids in this state (Empty, Ongoing, PrepareCommit, PrepareAbort,
        /// CompleteCommit, CompleteAbort); repeatable.
        #[arg(long)]
        state: Vec<String>,
    },
    /// One transactional id: state, partitions of its open transaction, its age, producer
    /// id and epoch, coordinator.
    Describe {
        /// The transactional id.
        #[arg(long)]
        transactional_id: String,
    },
    /// Copies a topic to another exactly once: reads it in a consumer group
    /// (read_committed) and commits each poll's output records together with the group's
    /// input positions in one transaction, so a copier killed and restarted never loses
    /// or duplicates a record.
    Copy {
        /// Topic to read.
        #[arg(long)]
        from: String,
        /// Topic to write (input partition p goes to partition p mod its partition count).
        #[arg(long)]
        to: String,
        /// Consumer group holding the copier's input positions.
        #[arg(long)]
        group: String,
        /// Transactional id of the copier's producer (a restarted copier reuses it,
        /// fencing the old instance).
        #[arg(long)]
        transactional_id: String,
        /// Stop after this long without a new input record (ms); default: run until
        /// interrupted.
        #[arg(long)]
        idle_exit_ms: Option<u64>,
        /// Transaction timeout (ms): a copier killed mid-transaction holds read-committed
        /// readers of the output back at most this long.
        #[arg(long, default_value_t = 60_000)]
        transaction_timeout_ms: u64,
        /// The copier's session timeout in its group (ms): a killed copier's partitions
        /// move to the others after this long.
        #[arg(long, default_value_t = 10_000)]
        session_timeout_ms: u64,
    },
}

fn to_json(t: &TransactionDescription, now: i64) -> Value {
    let partitions: Vec<Value> = t
        .topics
        .iter()
        .map(|p| json!({"topic": p.topic, "partitions": p.partitions}))
        .collect();
    json!({
        "transactional_id": t.transactional_id,
        "state": t.state,
        "producer_id": t.producer_id,
        "producer_epoch": t.producer_epoch,
        "timeout_ms": t.transaction_timeout_ms,
        "start_time_ms": (t.start_time_ms >= 0).then_some(t.start_time_ms),
        "age_ms": (t.start_time_ms >= 0).then(|| now.saturating_sub(t.start_time_ms)),
        "coordinator": t.coordinator_id,
        "partitions": partitions,
    })
}

fn print_table(list: &[TransactionDescription], now: i64) {
    println!(
        "{:<32} {:<15} {:>12} {:>6} {:>10} {:>11}  PARTITIONS",
        "TRANSACTIONAL_ID", "STATE", "PRODUCER_ID", "EPOCH", "AGE_MS", "COORDINATOR"
    );
    for t in list {
        let age = if t.start_time_ms >= 0 {
            now.saturating_sub(t.start_time_ms).to_string()
        } else {
            "-".to_owned()
        };
        let partitions: Vec<String> = t
            .topics
            .iter()
            .flat_map(|p| p.partitions.iter().map(move |n| format!("{}-{n}", p.topic)))
            .collect();
        println!(
            "{:<32} {:<15} {:>12} {:>6} {:>10} {:>11}  {}",
            t.transactional_id,
            t.state,
            t.producer_id,
            t.producer_epoch,
            age,
            t.coordinator_id,
            partitions.join(",")
        );
    }
}

/// Runs `tidelog transactions`.
pub fn run(args: &TransactionsArgs) -> Result<(), CliError> {
    if let TransactionsCommand::Copy {
        from,
        to,
        group,
        transactional_id,
        idle_exit_ms,
        transaction_timeout_ms,
        session_timeout_ms,
    } = &args.command
    {
        let spec = CopySpec {
            from: from.clone(),
            to: to.clone(),
            group: group.clone(),
            transactional_id: transactional_id.clone(),
            idle_exit: idle_exit_ms.map(Duration::from_millis),
            transaction_timeout: Duration::from_millis(*transaction_timeout_ms),
            session_timeout: Duration::from_millis(*session_timeout_ms),
        };
        let bootstrap = args.client.addresses()?;
        return block_on(copy(bootstrap, spec, args.client.output))?;
    }
    let client = TxnClient::new(args.client.addresses()?, args.client.timeout());
    let output = args.client.output;
    block_on(async move {
        let list = match &args.command {
            TransactionsCommand::List { state } => client.list(state).await?,
            TransactionsCommand::Describe { transactional_id } => {
                vec![client.describe(transactional_id).await?]
            }
            TransactionsCommand::Copy { .. } => unreachable!("handled above"),
        };
        let now = now_ms();
        match (output, &args.command) {
            (OutputFormat::Json, TransactionsCommand::List { .. }) => {
                let list: Vec<Value> = list.iter().map(|t| to_json(t, now)).collect();
                println!("{}", json!({ "transactions": list }));
            }
            (OutputFormat::Json, TransactionsCommand::Describe { .. }) => {
                println!("{}", to_json(&list[0], now));
            }
            (OutputFormat::Table, _) => print_table(&list, now),
            (OutputFormat::Json, TransactionsCommand::Copy { .. }) => unreachable!("handled above"),
        }
        Ok::<(), CliError>(())
    })?
}
