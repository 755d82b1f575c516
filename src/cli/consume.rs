//! `tidelog consume`: prints records of one topic, like `kafka-console-consumer.sh`, until
//! `--max-messages` or until no record arrived for `--timeout-ms`.

use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::client_args::{block_on, ClientArgs};
use super::dump_log::bytes_json;
use super::{CliError, OutputFormat};
use crate::client::consumer::{Consumer, StartAt};

/// Flags of `tidelog consume`.
#[derive(Debug, clap::Args)]
pub struct ConsumeArgs {
    /// The topic.
    #[arg(long)]
    topic: String,
    /// Read only this partition (default: all).
    #[arg(long)]
    partition: Option<u32>,
    /// Start at the earliest offset (default: only new records).
    #[arg(long, conflicts_with = "offset")]
    from_beginning: bool,
    /// Start at this offset (needs --partition).
    #[arg(long, requires = "partition")]
    offset: Option<i64>,
    /// Stop after this many records.
    #[arg(long)]
    max_messages: Option<u64>,
    /// Stop when no record arrived for this long (ms); default: never.
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// Print the key before the value (table output).
    #[arg(long)]
    print_key: bool,
    /// Print the partition and offset before the value (table output).
    #[arg(long)]
    print_offset: bool,
    #[command(flatten)]
    client: ClientArgs,
}

fn text(b: &Option<bytes::Bytes>) -> String {
    match b {
        None => "null".to_owned(),
        Some(b) => String::from_utf8_lossy(b).into_owned(),
    }
}

/// Runs `tidelog consume`.
pub fn run(args: &ConsumeArgs) -> Result<(), CliError> {
    let bootstrap = args.client.addresses()?;
    let timeout = args.client.timeout();
    let output = args.client.output;
    block_on(async move {
        let mut consumer = Consumer::new(bootstrap, timeout);
        let partitions: Vec<u32> = match args.partition {
            Some(p) => vec![p],
            None => (0..consumer.partition_count(&args.topic).await?).collect(),
        };
        for p in partitions {
            let start = match (args.offset, args.from_beginning) {
                (Some(o), _) => StartAt::Offset(o),
                (None, true) => StartAt::Earliest,
                (None, false) => StartAt::Latest,
            };
            consumer.assign(&args.topic, p, start).await?;
        }
        let idle_limit = args.timeout_ms.map(Duration::from_millis);
        let mut last_record = Instant::now();
        let mut printed = 0u64;
        loop {
            let wait = idle_limit
                .map(|l| {
                    l.saturating_sub(last_record.elapsed())
                        .min(Duration::from_millis(500))
                })
                .unwrap_or(Duration::from_millis(500));
            let records = consumer.poll(wait).await?;
            if !records.is_empty() {
                last_record = Instant::now();
            }
            for r in records {
                match output {
                    OutputFormat::Json => {
                        let headers: Map<String, Value> = r
                            .headers
                            .iter()
                            .map(|(k, v)| (k.clone(), bytes_json(v.as_deref())))
                            .collect();
                        println!(
                            "{}",
                            json!({
                                "topic": r.topic, "partition": r.partition, "offset": r.offset,
                                "timestamp": r.timestamp_ms,
                                "key": bytes_json(r.key.as_deref()),
                                "value": bytes_json(r.value.as_deref()),
                                "headers": headers,
                            })
                        );
                    }
                    OutputFormat::Table => {
                        let mut line = String::new();
                        if args.print_offset {
                            line.push_str(&format!("{}:{}\t", r.partition, r.offset));
                        }
                        if args.print_key {
                            line.push_str(&text(&r.key));
                            line.push('\t');
                        }
                        line.push_str(&text(&r.value));
                        println!("{line}");
                    }
                }
                printed += 1;
                if args.max_messages.is_some_and(|m| printed >= m) {
                    return Ok(());
                }
            }
            if idle_limit.is_some_and(|l| last_record.elapsed() >= l) {
                return Ok(());
            }
        }
    })?
}
