//! `tidelog scheduled cancel`: cancels scheduled (delayed) records before they are due.

use serde_json::json;

use super::client_args::{block_on, ClientArgs};
use super::{CliError, OutputFormat};
use crate::client::producer::{Producer, ProducerConfig};

/// Flags of `tidelog scheduled`.
#[derive(Debug, clap::Args)]
pub struct ScheduledArgs {
    #[command(subcommand)]
    command: ScheduledCommand,
}

#[derive(Debug, clap::Subcommand)]
enum ScheduledCommand {
    /// Cancel scheduled records that are not due yet, by the ids `produce --delay-ms`
    /// printed. Fails with UNKNOWN_SCHEDULED_RECORD for an id that is not pending.
    Cancel {
        /// A scheduled record's id (repeatable).
        #[arg(long = "id", required = true)]
        ids: Vec<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// Runs `tidelog scheduled`.
pub fn run(args: &ScheduledArgs) -> Result<(), CliError> {
    match &args.command {
        ScheduledCommand::Cancel { ids, client } => {
            let bootstrap = client.addresses()?;
            let output = client.output;
            block_on(async move {
                let producer = Producer::new(bootstrap, ProducerConfig::default());
                for id in ids {
                    producer.cancel_scheduled(id).await?;
                    match output {
                        OutputFormat::Json => println!("{}", json!({"cancelled": id})),
                        OutputFormat::Table => println!("cancelled {id}"),
                    }
                }
                Ok::<(), CliError>(())
            })?
        }
    }
}
