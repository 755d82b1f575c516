//! `tidelog perf produce|consume`: load generators like Kafka's perf-test tools. A
//! progress line every second on stderr; a summary at the end (records/s, MB/s and, for
//! produce, latency percentiles from send to acknowledgement).

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::json;

use super::client_args::{block_on, ClientArgs};
use super::produce::parse_acks;
use super::{CliError, OutputFormat};
use crate::client::consumer::{Consumer, StartAt};
use crate::client::group_consumer::{GroupConfig, GroupConsumer, OffsetReset};
use crate::client::producer::{Producer, ProducerConfig, ProducerRecord};

/// `tidelog perf ...`.
#[derive(Debug, clap::Args)]
pub struct PerfArgs {
    #[command(subcommand)]
    command: PerfCommand,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Debug, clap::Subcommand)]
enum PerfCommand {
    /// Produce records as fast as allowed and measure throughput and latency.
    Produce {
        /// The topic (must exist).
        #[arg(long)]
        topic: String,
        /// How many records.
        #[arg(long)]
        num_records: u64,
        /// Value size in bytes.
        #[arg(long)]
        record_size: usize,
        /// 0, 1 or all.
        #[arg(long, default_value = "1")]
        acks: String,
        /// Records per second, or -1 for no limit.
        #[arg(long, default_value_t = -1, allow_hyphen_values = true)]
        throughput: i64,
        /// Bytes per partition batch.
        #[arg(long, default_value_t = 65_536)]
        batch_size: usize,
        /// How long a batch waits for more records (ms).
        #[arg(long, default_value_t = 5)]
        linger_ms: u64,
    },
    /// Consume records from the beginning and measure throughput.
    Consume {
        /// The topic.
        #[arg(long)]
        topic: String,
        /// Stop after this many records.
        #[arg(long)]
        num_records: u64,
        /// Consume as a member of this group (partitions from the coordinator, from the
        /// group's committed offsets or the earliest; commits at the end).
        #[arg(long)]
        group: Option<String>,
        /// Stop (successfully) when no record arrived for this long, reporting what was
        /// read until the last record: for group members whose share is not known.
        #[arg(long)]
        idle_ms: Option<u64>,
    },
}

/// Runs `tidelog perf ...`.
pub fn run(args: &PerfArgs) -> Result<(), CliError> {
    let bootstrap = args.client.addresses()?;
    let output = args.client.output;
    match &args.command {
        PerfCommand::Produce {
            topic,
            num_records,
            record_size,
            acks,
            throughput,
            batch_size,
            linger_ms,
        } => {
            let config = ProducerConfig {
                acks: parse_acks(acks)?,
                batch_size: *batch_size,
                linger: Duration::from_millis(*linger_ms),
                max_in_flight: 64,
                ..Default::default()
            };
            block_on(produce(
                bootstrap,
                config,
                topic,
                *num_records,
                *record_size,
                *throughput,
                output,
            ))?
        }
        PerfCommand::Consume {
            topic,
            num_records,
            group,
            idle_ms,
        } => block_on(consume(
            bootstrap,
            args.client.timeout(),
            topic,
            (*num_records, idle_ms.map(Duration::from_millis)),
            group.clone(),
            output,
        ))?,
    }
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

async fn produce(
    bootstrap: Vec<String>,
    config: ProducerConfig,
    topic: &str,
    num_records: u64,
    record_size: usize,
    throughput: i64,
    output: OutputFormat,
) -> Result<(), CliError> {
    let producer = Producer::new(bootstrap, config);
    // A bad topic fails here, with its own code, before anything is measured.
    producer.partitions_for(topic).await?;
    let value = Bytes::from(
        (0..record_size)
            .map(|i| b'a' + (i % 26) as u8)
            .collect::<Vec<u8>>(),
    );
    let start = Instant::now();
    let mut latencies_us: Vec<u64> = Vec::with_capacity(num_records.min(10_000_000) as usize);
    let mut outstanding = tokio::task::JoinSet::new();
    let mut failures = 0u64;
    let mut first_error: Option<String> = None;
    let mut last_report = Instant::now();
    let mut acked_at_report = 0usize;
    let window = 200_000;
    let mut collect = |r: Result<(Duration, bool, String), tokio::task::JoinError>,
                       lat: &mut Vec<u64>| match r {
        Ok((d, true, _)) => lat.push(d.as_micros() as u64),
        Ok((_, false, e)) => {
            failures += 1;
            first_error.get_or_insert(e);
        }
        Err(e) => {
            failures += 1;
            first_error.get_or_insert(e.to_string());
        }
    };
    for i in 0..num_records {
        if throughput > 0 {
            let due = start + Duration::from_secs_f64(i as f64 / throughput as f64);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                tokio::time::sleep(wait).await;
            }
        }
        let sent = Instant::now();
        let ack = producer
            .send(ProducerRecord {
                topic: topic.to_owned(),
                value: Some(value.clone()),
                ..Default::default()
            })
            .await;
        outstanding.spawn(async move {
            match ack.await {
                Ok(_) => (sent.elapsed(), true, String::new()),
                Err(e) => (sent.elapsed(), false, e.to_string()),
            }
        });
        while outstanding.len() > window {
            if let Some(r) = outstanding.join_next().await {
                collect(r, &mut latencies_us);
            }
        }
        while let Some(r) = outstanding.try_join_next() {
            collect(r, &mut latencies_us);
        }
        if last_report.elapsed() >= Duration::from_secs(1) {
            let acked = latencies_us.len();
            let rate = (acked - acked_at_report) as f64 / last_report.elapsed().as_secs_f64();
            eprintln!(
                "{acked} records acknowledged, {rate:.0} records/s ({:.1} MB/s)",
                rate * record_size as f64 / 1e6
            );
            last_report = Instant::now();
            acked_at_report = acked;
        }
    }
    producer.flush().await;
    while let Some(r) = outstanding.join_next().await {
        collect(r, &mut latencies_us);
    }
    let secs = start.elapsed().as_secs_f64();
    latencies_us.sort_unstable();
    let acked = latencies_us.len() as u64;
    let rate = acked as f64 / secs;
    let summary = json!({
        "records": acked,
        "failed": failures,
        "seconds": secs,
        "records_per_sec": rate,
        "mb_per_sec": rate * record_size as f64 / 1e6,
        "latency_ms": {
            "avg": if acked == 0 { 0.0 } else { latencies_us.iter().sum::<u64>() as f64 / acked as f64 / 1000.0 },
            "p50": percentile(&latencies_us, 0.50),
            "p95": percentile(&latencies_us, 0.95),
            "p99": percentile(&latencies_us, 0.99),
            "p99_9": percentile(&latencies_us, 0.999),
            "max": percentile(&latencies_us, 1.0),
        }
    });
    match output {
        OutputFormat::Json => println!("{summary}"),
        OutputFormat::Table => println!(
            "{acked} records sent, {rate:.1} records/sec ({:.2} MB/sec), {:.2} ms avg latency, {:.2} ms max latency, {:.2} ms 50th, {:.2} ms 95th, {:.2} ms 99th, {:.2} ms 99.9th.",
            summary["mb_per_sec"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["avg"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["max"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["p50"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["p95"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["p99"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["p99_9"].as_f64().unwrap_or(0.0),
        ),
    }
    match first_error {
        Some(e) => Err(CliError::new(
            "REQUEST_TIMED_OUT",
            format!("{failures} records failed; first failure: {e}"),
        )),
        None => Ok(()),
    }
}

/// Where `perf consume` reads from.
enum PerfSource {
    Assigned(Consumer),
    Group(GroupConsumer),
}

async fn consume(
    bootstrap: Vec<String>,
    timeout: Duration,
    topic: &str,
    (num_records, idle): (u64, Option<Duration>),
    group: Option<String>,
    output: OutputFormat,
) -> Result<(), CliError> {
    let mut source = match group {
        Some(group) => PerfSource::Group(GroupConsumer::new(
            bootstrap,
            GroupConfig {
                group,
                topics: vec![topic.to_owned()],
                auto_offset_reset: OffsetReset::Earliest,
                client_id: format!("tidelog-perf-{}", std::process::id()),
                session_timeout: Duration::from_secs(10),
                ..GroupConfig::default()
            },
        )),
        None => {
            let mut consumer = Consumer::new(bootstrap, timeout);
            for p in 0..consumer.partition_count(topic).await? {
                consumer.assign(topic, p, StartAt::Earliest).await?;
            }
            PerfSource::Assigned(consumer)
        }
    };
    let start = Instant::now();
    let (mut records, mut bytes) = (0u64, 0u64);
    let mut last_report = Instant::now();
    let mut last_data = Instant::now();
    while records < num_records {
        let batch = match &mut source {
            PerfSource::Assigned(c) => c.poll(Duration::from_millis(500)).await?,
            PerfSource::Group(g) => g.poll(Duration::from_millis(500)).await?,
        };
        if batch.is_empty() && records > 0 && idle.is_some_and(|i| last_data.elapsed() >= i) {
            break;
        }
        if batch.is_empty() && last_data.elapsed() > timeout {
            return Err(CliError::new(
                "REQUEST_TIMED_OUT",
                format!(
                    "only {records} of {num_records} records arrived; none for {} ms",
                    timeout.as_millis()
                ),
            ));
        }
        if !batch.is_empty() {
            last_data = Instant::now();
        }
        for r in batch {
            if records == num_records {
                break;
            }
            records += 1;
            bytes += r.value.map_or(0, |v| v.len() as u64) + r.key.map_or(0, |k| k.len() as u64);
        }
        if last_report.elapsed() >= Duration::from_secs(1) {
            eprintln!(
                "{records} records consumed, {:.0} records/s",
                records as f64 / start.elapsed().as_secs_f64()
            );
            last_report = Instant::now();
        }
    }
    let secs = if records < num_records {
        // Stopped by --idle-ms: the time until the last record.
        last_data.duration_since(start).as_secs_f64()
    } else {
        start.elapsed().as_secs_f64()
    };
    if let PerfSource::Group(g) = source {
        g.close().await?;
    }
    let summary = json!({
        "records": records,
        "seconds": secs,
        "records_per_sec": records as f64 / secs,
        "mb_per_sec": bytes as f64 / 1e6 / secs,
    });
    match output {
        OutputFormat::Json => println!("{summary}"),
        OutputFormat::Table => println!(
            "{records} records consumed in {secs:.2} s, {:.1} records/sec ({:.2} MB/sec).",
            records as f64 / secs,
            bytes as f64 / 1e6 / secs
        ),
    }
    Ok(())
}
