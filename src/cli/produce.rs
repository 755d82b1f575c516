//! `tidelog produce`: one record per stdin line, like `kafka-console-producer.sh`. Exits 0
//! only when every record was acknowledged (with acks 0: sent).

use std::io::BufRead;

use bytes::Bytes;
use serde_json::json;

use super::client_args::{block_on, ClientArgs};
use super::{CliError, OutputFormat};
use crate::client::producer::{Due, Producer, ProducerConfig, ProducerRecord};

/// Flags of `tidelog produce`.
#[derive(Debug, clap::Args)]
pub struct ProduceArgs {
    /// The topic.
    #[arg(long)]
    topic: String,
    /// Send every record to this partition (default: by key, else sticky).
    #[arg(long)]
    partition: Option<u32>,
    /// The key of every record.
    #[arg(long, conflicts_with = "parse_key")]
    key: Option<String>,
    /// Split each line into key and value at --key-separator.
    #[arg(long)]
    parse_key: bool,
    /// Separator between key and value with --parse-key.
    #[arg(long, default_value = "\t")]
    key_separator: String,
    /// 0, 1 or all.
    #[arg(long, default_value = "all")]
    acks: String,
    /// A header for every record as key=value (repeatable; order and repeated keys kept).
    #[arg(long = "header")]
    headers: Vec<String>,
    /// A user property for every record as key=value (RocketMQ's name for a header:
    /// properties are headers, matched by SQL filters; repeatable).
    #[arg(long = "property")]
    properties: Vec<String>,
    /// A tag for every record (for tag filters; stored as the `tidelog.tag` header).
    #[arg(long)]
    tag: Option<String>,
    /// Deliver every record this many ms from now instead of at once (a scheduled record:
    /// invisible to consumers until then; prints its id with --output json).
    #[arg(long, conflicts_with = "deliver_at", allow_negative_numbers = true)]
    delay_ms: Option<i64>,
    /// Deliver every record at this time (RFC 3339, e.g. 2026-12-24T18:00:00Z).
    #[arg(long)]
    deliver_at: Option<String>,
    /// How long a record may take to be acknowledged, retries included (ms).
    #[arg(long, default_value_t = 120_000)]
    timeout_ms: u64,
    /// Bytes per partition batch.
    #[arg(long, default_value_t = 16_384)]
    batch_size: usize,
    /// How long a batch waits for more records (ms).
    #[arg(long, default_value_t = 5)]
    linger_ms: u64,
    /// Write every record of this run in one transaction of this transactional id
    /// (fencing an earlier producer of it), committed once all are acknowledged.
    #[arg(long, value_name = "ID", conflicts_with_all = ["delay_ms", "deliver_at"])]
    transactional_id: Option<String>,
    /// With --transactional-id: abort the transaction instead of committing it (its
    /// records stay invisible to read_committed consumers).
    #[arg(long, requires = "transactional_id")]
    abort: bool,
    #[command(flatten)]
    client: ClientArgs,
}

/// Parses `--acks`.
pub fn parse_acks(acks: &str) -> Result<i32, CliError> {
    match acks {
        "0" => Ok(0),
        "1" => Ok(1),
        "all" | "-1" => Ok(-1),
        other => Err(CliError::new(
            "INVALID_REQUEST",
            format!("--acks must be 0, 1 or all, got '{other}'"),
        )),
    }
}

/// Runs `tidelog produce`.
pub fn run(args: &ProduceArgs) -> Result<(), CliError> {
    let acks = parse_acks(&args.acks)?;
    // In the order given, repeated keys kept: headers are a list, not a map.
    let headers: Vec<(String, Option<Bytes>)> = args
        .headers
        .iter()
        .map(|h| ("--header", h))
        .chain(args.properties.iter().map(|p| ("--property", p)))
        .map(|(flag, h)| match h.split_once('=') {
            Some((k, v)) => Ok((k.trim().to_owned(), Some(Bytes::from(v.trim().to_owned())))),
            None => Err(CliError::new(
                "INVALID_REQUEST",
                format!("{flag} '{h}' is not key=value"),
            )),
        })
        .collect::<Result<_, _>>()?;
    if let Some(tag) = &args.tag {
        crate::record::tag::check_tag(tag)
            .map_err(|why| CliError::new("INVALID_RECORD", format!("--tag '{tag}' {why}")))?;
    }
    let due = match (args.delay_ms, &args.deliver_at) {
        (Some(ms), _) if ms < 0 => {
            return Err(CliError::new(
                "INVALID_DELAY",
                format!("--delay-ms is {ms}; it must be >= 0"),
            ))
        }
        (Some(ms), _) => Some(Due::DelayMs(ms)),
        (None, Some(at)) => Some(Due::AtMs(crate::time_text::parse_rfc3339_ms(at).map_err(
            |e| CliError::new("INVALID_DELAY", format!("--deliver-at '{at}': {e}")),
        )?)),
        (None, None) => None,
    };
    let config = ProducerConfig {
        acks,
        batch_size: args.batch_size,
        linger: std::time::Duration::from_millis(args.linger_ms),
        delivery_timeout: std::time::Duration::from_millis(args.timeout_ms),
        transactional_id: args.transactional_id.clone(),
        ..Default::default()
    };
    if args.transactional_id.is_some() && acks != -1 {
        return Err(CliError::new(
            "INVALID_REQUEST",
            "--transactional-id needs --acks all",
        ));
    }
    let bootstrap = args.client.addresses()?;
    let output = args.client.output;
    block_on(async move {
        let producer = Producer::new(bootstrap, config);
        producer.partitions_for(&args.topic).await?;
        if producer.is_transactional() {
            producer.init_transactions().await?;
            producer.begin_transaction().await?;
        }
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(1024);
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                if tx.blocking_send(line).is_err() {
                    break;
                }
            }
        });
        let producer = std::sync::Arc::new(producer);
        let mut pending = std::collections::VecDeque::new();
        let mut scheduled = std::collections::VecDeque::new();
        let report_scheduled = |r: Result<
            Result<crate::client::producer::Scheduled, crate::client::ClientError>,
            tokio::task::JoinError,
        >,
                                failed: &mut Option<CliError>,
                                acknowledged: &mut u64| match r {
            Ok(Ok(s)) => {
                *acknowledged += 1;
                if output == OutputFormat::Json {
                    println!(
                        "{}",
                        json!({"topic": args.topic, "partition": s.partition, "scheduled_id": s.id})
                    );
                }
            }
            Ok(Err(e)) => {
                if failed.is_none() {
                    *failed = Some(e.into());
                }
            }
            Err(e) => {
                if failed.is_none() {
                    *failed = Some(CliError::new("UNKNOWN_SERVER_ERROR", e.to_string()));
                }
            }
        };
        let mut failed: Option<CliError> = None;
        let mut acknowledged = 0u64;
        let report = |r: Result<
            crate::client::producer::RecordMetadata,
            crate::client::ClientError,
        >,
                      failed: &mut Option<CliError>,
                      acknowledged: &mut u64| match r {
            Ok(m) => {
                *acknowledged += 1;
                if output == OutputFormat::Json {
                    println!(
                        "{}",
                        json!({"topic": args.topic, "partition": m.partition, "offset": m.offset})
                    );
                }
            }
            Err(e) => {
                if failed.is_none() {
                    *failed = Some(e.into());
                }
            }
        };
        while let Some(line) = rx.recv().await {
            let line = line.map_err(|e| CliError::new("INVALID_REQUEST", format!("stdin: {e}")))?;
            let (key, value) = if args.parse_key {
                match line.split_once(args.key_separator.as_str()) {
                    Some((k, v)) => (Some(k.to_owned()), v.to_owned()),
                    None => {
                        return Err(CliError::new(
                            "INVALID_REQUEST",
                            format!(
                                "line {:?} has no key separator {:?}",
                                line, args.key_separator
                            ),
                        ))
                    }
                }
            } else {
                (args.key.clone(), line)
            };
            let record = ProducerRecord {
                topic: args.topic.clone(),
                partition: args.partition,
                key: key.map(Bytes::from),
                value: Some(Bytes::from(value)),
                headers: headers.clone(),
                tag: args.tag.clone(),
                timestamp_ms: None,
            };
            if let Some(due) = due {
                // Scheduled records go one request each; a window of them in flight.
                scheduled.push_back(tokio::spawn({
                    let producer = producer.clone();
                    async move { producer.schedule(record, due).await }
                }));
                while scheduled.len() > 64 {
                    let r = scheduled.pop_front().expect("non-empty").await;
                    report_scheduled(r, &mut failed, &mut acknowledged);
                }
                continue;
            }
            pending.push_back(producer.send(record).await);
            // Report in order, without holding more than a window of futures.
            while pending.len() > 10_000 {
                let r = pending.pop_front().expect("non-empty").await;
                report(r, &mut failed, &mut acknowledged);
            }
        }
        producer.flush().await;
        while let Some(f) = scheduled.pop_front() {
            report_scheduled(f.await, &mut failed, &mut acknowledged);
        }
        while let Some(f) = pending.pop_front() {
            report(f.await, &mut failed, &mut acknowledged);
        }
        if producer.is_transactional() {
            if failed.is_some() || args.abort {
                producer.abort_transaction().await?;
            } else {
                producer.commit_transaction().await?;
            }
        }
        match failed {
            Some(e) => Err(e),
            None => {
                if output == OutputFormat::Table {
                    let what = if due.is_some() {
                        "scheduled"
                    } else {
                        "acknowledged"
                    };
                    eprintln!("{acknowledged} records {what}");
                }
                Ok(())
            }
        }
    })?
}
