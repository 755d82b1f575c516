//! `tidelog perf produce|consume`: load generators like Kafka's perf-test tools. A
//! progress line redrawn every second on stderr when it is a terminal; a summary at the end (records/s, MB/s, the
//! process's own CPU seconds and CPU seconds per GB and, for produce, latency percentiles
//! from send to acknowledgement).
//!
//! The produce loop costs little per record, so that the figures measure the client
//! library rather than the tool: the payload is built once, and latency comes from the
//! acknowledgement time of each record's batch (no task or timer per record), kept for
//! every record or, above [`LATENCY_SAMPLES_MAX`] records, for an even sample.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::progress::{fraction, Progress};

use bytes::Bytes;
use serde_json::json;

use super::client_args::{block_on, ClientArgs, Isolation};
use super::produce::parse_acks;
use super::{CliError, OutputFormat};
use crate::client::consumer::{Consumer, ConsumerFilter, StartAt};
use crate::client::group_consumer::{GroupConfig, GroupConsumer, OffsetReset};
use crate::client::groups::GroupsAdmin;
use crate::client::producer::{Producer, ProducerConfig, ProducerRecord, RecordFuture};
use crate::client::push_feed::PushSettings;
use crate::record::Compression;

/// Latencies kept at most (4 bytes each); above, every n-th record is sampled.
const LATENCY_SAMPLES_MAX: u64 = 10_000_000;

/// Records sent but not yet seen acknowledged, at most (the producer's buffer_memory
/// bounds them first for all but tiny records).
const OUTSTANDING_MAX: usize = 200_000;

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
        /// Batch compression: none, gzip, snappy, lz4 or zstd.
        #[arg(long, default_value = "none")]
        compression: String,
        /// Tag record i with `T{(i / R) % N}` (0: no tags; R is --tag-run), for measuring
        /// filtered consumption.
        #[arg(long, default_value_t = 0)]
        tags: u64,
        /// Consecutive records sharing a tag (1: tags round-robin, so every batch holds
        /// every tag; larger: batches of one tag, as when producers tag by source).
        #[arg(long, default_value_t = 1)]
        tag_run: u64,
        /// Schedule every record (delayed records, acks=all) with a delay of up to this
        /// many ms, spread evenly from --delay-ms-min; each carries its due time in the
        /// `perf.due.ms` header. Always acks=all, no compression; --throughput is not
        /// applied.
        #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(0..=DELAY_MS_MAX))]
        delay_ms_max: Option<u64>,
        /// The shortest delay with --delay-ms-max.
        #[arg(long, value_name = "MS", default_value_t = 0, requires = "delay_ms_max",
              value_parser = clap::value_parser!(u64).range(0..=DELAY_MS_MAX))]
        delay_ms_min: u64,
        /// Produce in transactions of this many records each (a transactional producer,
        /// acks=all), committing each; the summary adds the commit latency (from a
        /// transaction's first send to its commit's acknowledgement).
        #[arg(long, value_name = "N", conflicts_with = "delay_ms_max",
              value_parser = clap::value_parser!(u64).range(1..))]
        transaction_records: Option<u64>,
    },
    /// Consume records from the beginning and measure throughput; stops after
    /// --num-records, or when every partition read is at its end.
    Consume {
        /// The topic.
        #[arg(long)]
        topic: String,
        /// Stop after this many records (or earlier, when the topic is drained).
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
        /// Only records with these tags (`T1 || T2`); --num-records counts matches.
        #[arg(long, value_name = "EXPR", conflicts_with = "filter_sql")]
        filter_tag: Option<String>,
        /// Only records passing this SQL92 expression over properties.
        #[arg(long, value_name = "EXPR")]
        filter_sql: Option<String>,
        /// Receive records over push streams (Broker.Subscribe) instead of fetches.
        #[arg(long)]
        push: bool,
        /// Do not stop at the topic's end: wait for --num-records (a producer is running;
        /// for end-to-end latency). Still stops on --idle-ms or the request timeout.
        #[arg(long)]
        follow: bool,
        /// read_uncommitted (every record) or read_committed (committed transactions only,
        /// up to the last stable offset).
        #[arg(long, value_enum, default_value_t = Isolation::ReadUncommitted)]
        isolation: Isolation,
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
            compression,
            tags,
            tag_run,
            delay_ms_max,
            delay_ms_min,
            transaction_records,
        } => {
            let compression = Compression::from_name(compression).ok_or_else(|| {
                CliError::new(
                    "INVALID_REQUEST",
                    format!(
                        "--compression '{compression}' is not one of none, gzip, snappy, lz4, zstd"
                    ),
                )
            })?;
            let acks = parse_acks(acks)?;
            if transaction_records.is_some() && acks != -1 {
                return Err(CliError::new(
                    "INVALID_REQUEST",
                    "--transaction-records needs --acks all",
                ));
            }
            let config = ProducerConfig {
                acks,
                batch_size: *batch_size,
                linger: Duration::from_millis(*linger_ms),
                max_in_flight: 64,
                compression,
                transactional_id: transaction_records
                    .map(|_| format!("tidelog-perf-{}-{}", std::process::id(), now_ms())),
                ..Default::default()
            };
            if let Some(max) = delay_ms_max {
                return block_on(produce_scheduled(
                    bootstrap,
                    config,
                    topic,
                    *num_records,
                    *record_size,
                    (*delay_ms_min, *max),
                    output,
                ))?;
            }
            block_on(produce(
                bootstrap,
                config,
                topic,
                *num_records,
                *record_size,
                (
                    *throughput,
                    (*tags, (*tag_run).max(1)),
                    *transaction_records,
                ),
                output,
            ))?
        }
        PerfCommand::Consume {
            topic,
            num_records,
            group,
            idle_ms,
            filter_tag,
            filter_sql,
            push,
            follow,
            isolation,
        } => {
            let filter = match (filter_tag, filter_sql) {
                (Some(t), _) => Some(ConsumerFilter::Tag(t.clone())),
                (None, Some(s)) => Some(ConsumerFilter::Sql(s.clone())),
                (None, None) => None,
            };
            if let Some(f) = &filter {
                f.check()?;
            }
            block_on(consume(
                bootstrap,
                args.client.timeout(),
                topic,
                (*num_records, idle_ms.map(Duration::from_millis), *follow),
                (group.clone(), filter, *push),
                *isolation == Isolation::ReadCommitted,
                output,
            ))?
        }
    }
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    f64::from(sorted[i]) / 1000.0
}

/// CPU seconds (user + system) this process has used so far.
fn cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole `rusage` through the pointer, which points to one.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return 0.0;
    }
    // SAFETY: zero-initialised and, as rc == 0, filled in by getrusage.
    let usage = unsafe { usage.assume_init() };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// CPU seconds per GB (1e9 bytes) of records; 0 when no bytes moved.
fn cpu_per_gb(cpu: f64, bytes: f64) -> f64 {
    if bytes > 0.0 {
        cpu / (bytes / 1e9)
    } else {
        0.0
    }
}

/// Counts of a produce run and its latency samples.
struct ProduceTally {
    acked: u64,
    failures: u64,
    first_error: Option<String>,
    stride: u64,
    latencies_us: Vec<u32>,
}

impl ProduceTally {
    fn settle(&mut self, i: u64, sent: Instant, future: RecordFuture) {
        match future.try_result() {
            Some(Ok(_)) => {
                self.acked += 1;
                if i.is_multiple_of(self.stride) {
                    let at = future.completed_at().unwrap_or_else(Instant::now);
                    let us = at.saturating_duration_since(sent).as_micros();
                    self.latencies_us
                        .push(u32::try_from(us).unwrap_or(u32::MAX));
                }
            }
            Some(Err(e)) => {
                self.failures += 1;
                self.first_error.get_or_insert_with(|| e.to_string());
            }
            None => {
                self.failures += 1;
                self.first_error
                    .get_or_insert_with(|| "settled before its outcome".to_owned());
            }
        }
    }
}

async fn produce(
    bootstrap: Vec<String>,
    config: ProducerConfig,
    topic: &str,
    num_records: u64,
    record_size: usize,
    (throughput, (tags, tag_run), transaction_records): (i64, (u64, u64), Option<u64>),
    output: OutputFormat,
) -> Result<(), CliError> {
    let producer = Producer::new(bootstrap, config);
    if transaction_records.is_some() {
        producer.init_transactions().await?;
    }
    // Per transaction: its first send, for the commit latency.
    let mut txn_started: Option<Instant> = None;
    let mut commits_us: Vec<u32> = Vec::new();
    let tag_names: Vec<String> = (0..tags).map(|t| format!("T{t}")).collect();
    // A bad topic fails here, with its own code, before anything is measured.
    producer.partitions_for(topic).await?;
    let value = Bytes::from(
        (0..record_size)
            .map(|i| b'a' + (i % 26) as u8)
            .collect::<Vec<u8>>(),
    );
    let stride = num_records.div_ceil(LATENCY_SAMPLES_MAX).max(1);
    let mut tally = ProduceTally {
        acked: 0,
        failures: 0,
        first_error: None,
        stride,
        latencies_us: Vec::with_capacity(num_records.div_ceil(stride) as usize),
    };
    // (index, send time, outcome), in send order.
    let mut outstanding: VecDeque<(u64, Instant, RecordFuture)> = VecDeque::new();
    let cpu_start = cpu_seconds();
    let start = Instant::now();
    let mut last_report = start;
    let mut progress = Progress::new();
    let mut acked_at_report = 0u64;
    for i in 0..num_records {
        if throughput > 0 {
            let due = start + Duration::from_secs_f64(i as f64 / throughput as f64);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                tokio::time::sleep(wait).await;
            }
        }
        let sent = Instant::now();
        if transaction_records.is_some() && txn_started.is_none() {
            producer.begin_transaction().await?;
            txn_started = Some(sent);
        }
        let ack = producer
            .send(ProducerRecord {
                topic: topic.to_owned(),
                value: Some(value.clone()),
                tag: (tags > 0).then(|| tag_names[((i / tag_run) % tags) as usize].clone()),
                ..Default::default()
            })
            .await;
        outstanding.push_back((i, sent, ack));
        while outstanding
            .front()
            .is_some_and(|(_, _, f)| f.try_result().is_some())
        {
            if let Some((i, sent, f)) = outstanding.pop_front() {
                tally.settle(i, sent, f);
            }
        }
        if outstanding.len() > OUTSTANDING_MAX {
            if let Some((i, sent, mut f)) = outstanding.pop_front() {
                let _ = (&mut f).await;
                tally.settle(i, sent, f);
            }
        }
        if let Some(n) = transaction_records {
            if (i + 1).is_multiple_of(n) || i + 1 == num_records {
                producer.commit_transaction().await?;
                if let Some(started) = txn_started.take() {
                    let us = started.elapsed().as_micros();
                    commits_us.push(u32::try_from(us).unwrap_or(u32::MAX));
                }
            }
        }
        if i.is_multiple_of(1024) && last_report.elapsed() >= Duration::from_secs(1) {
            let rate = (tally.acked - acked_at_report) as f64 / last_report.elapsed().as_secs_f64();
            progress.force(&format!(
                "{} records acknowledged, {rate:.0} records/s ({:.1} MB/s)",
                fraction(tally.acked, num_records),
                rate * record_size as f64 / 1e6
            ));
            last_report = Instant::now();
            acked_at_report = tally.acked;
        }
    }
    producer.flush().await;
    while let Some((i, sent, mut f)) = outstanding.pop_front() {
        let _ = (&mut f).await;
        tally.settle(i, sent, f);
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_start;
    progress.finish();
    if transaction_records.is_some() {
        commits_us.sort_unstable();
        let commits = json!({
            "transactions": commits_us.len(),
            "commit_latency_ms": {
                "p50": percentile(&commits_us, 0.50),
                "p99": percentile(&commits_us, 0.99),
                "max": percentile(&commits_us, 1.0),
            },
        });
        match output {
            OutputFormat::Json => println!("{commits}"),
            OutputFormat::Table => println!(
                "{} transactions committed; commit latency {:.2} ms 50th, {:.2} ms 99th, {:.2} ms max.",
                commits_us.len(),
                percentile(&commits_us, 0.50),
                percentile(&commits_us, 0.99),
                percentile(&commits_us, 1.0),
            ),
        }
    }
    report_produce(tally, secs, cpu, record_size, output)
}

/// Prints a produce run's summary; fails when records failed.
fn report_produce(
    tally: ProduceTally,
    secs: f64,
    cpu: f64,
    record_size: usize,
    output: OutputFormat,
) -> Result<(), CliError> {
    let ProduceTally {
        acked,
        failures,
        first_error,
        mut latencies_us,
        ..
    } = tally;
    latencies_us.sort_unstable();
    let rate = acked as f64 / secs;
    let bytes = acked as f64 * record_size as f64;
    let summary = json!({
        "records": acked,
        "failed": failures,
        "seconds": secs,
        "records_per_sec": rate,
        "mb_per_sec": rate * record_size as f64 / 1e6,
        "latency_ms": {
            "avg": if latencies_us.is_empty() { 0.0 } else { latencies_us.iter().map(|l| u64::from(*l)).sum::<u64>() as f64 / latencies_us.len() as f64 / 1000.0 },
            "p50": percentile(&latencies_us, 0.50),
            "p95": percentile(&latencies_us, 0.95),
            "p99": percentile(&latencies_us, 0.99),
            "p99_9": percentile(&latencies_us, 0.999),
            "max": percentile(&latencies_us, 1.0),
        },
        "cpu_seconds": cpu,
        "cpu_seconds_per_gb": cpu_per_gb(cpu, bytes),
    });
    match output {
        OutputFormat::Json => println!("{summary}"),
        OutputFormat::Table => println!(
            "{acked} records sent, {rate:.1} records/sec ({:.2} MB/sec), {:.2} ms avg latency, {:.2} ms max latency, {:.2} ms 50th, {:.2} ms 95th, {:.2} ms 99th, {:.2} ms 99.9th. CPU {cpu:.2} s ({:.2} s/GB).",
            summary["mb_per_sec"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["avg"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["max"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["p50"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["p95"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["p99"].as_f64().unwrap_or(0.0),
            summary["latency_ms"]["p99_9"].as_f64().unwrap_or(0.0),
            cpu_per_gb(cpu, bytes),
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

/// Longest delay `perf produce` asks for (the brokers' default `max_delay_ms`, 40 days).
const DELAY_MS_MAX: u64 = 40 * 24 * 3600 * 1000;

/// Records per `schedule_batch` call of `perf produce --delay-ms-max`.
const SCHEDULE_CHUNK: u64 = 500;
/// `schedule_batch` calls in flight at once.
const SCHEDULE_IN_FLIGHT: usize = 8;
/// Header of each scheduled perf record: its due time (ms since the epoch), so a consumer
/// can measure delivery lateness.
pub const PERF_DUE_HEADER: &str = "perf.due.ms";

/// `perf produce --delay-ms-max`: schedules every record (acks=all) with a delay from
/// `delays.0` to `delays.1` ms, spread evenly by a hash of its index, in
/// [`SCHEDULE_CHUNK`]-record batches; latency is each batch's.
async fn produce_scheduled(
    bootstrap: Vec<String>,
    config: ProducerConfig,
    topic: &str,
    num_records: u64,
    record_size: usize,
    delays: (u64, u64),
    output: OutputFormat,
) -> Result<(), CliError> {
    use crate::client::producer::Due;
    use futures_util::StreamExt;
    let producer = Producer::new(bootstrap, config);
    producer.partitions_for(topic).await?;
    let value = Bytes::from(
        (0..record_size)
            .map(|i| b'a' + (i % 26) as u8)
            .collect::<Vec<u8>>(),
    );
    let (min, max) = (delays.0.min(delays.1), delays.0.max(delays.1));
    let mut tally = ProduceTally {
        acked: 0,
        failures: 0,
        first_error: None,
        stride: 1,
        latencies_us: Vec::new(),
    };
    let mut in_flight = futures_util::stream::FuturesUnordered::new();
    let cpu_start = cpu_seconds();
    let start = Instant::now();
    let mut progress = Progress::new();
    let mut settle = |tally: &mut ProduceTally, (n, sent, r): (u64, Instant, Result<_, _>)| {
        match r {
            Ok(_) => {
                tally.acked += n;
                let us = u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX);
                tally
                    .latencies_us
                    .extend(std::iter::repeat_n(us, n as usize));
            }
            Err(e) => {
                tally.failures += n;
                let e: crate::client::ClientError = e;
                tally.first_error.get_or_insert_with(|| e.to_string());
            }
        }
        progress.update(|| {
            format!(
                "{} records scheduled",
                fraction(tally.acked + tally.failures, num_records)
            )
        });
    };
    let mut next = 0u64;
    while next < num_records {
        let n = SCHEDULE_CHUNK.min(num_records - next);
        let now = now_ms();
        let records: Vec<(ProducerRecord, Due)> = (next..next + n)
            .map(|i| {
                let spread = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
                let due = now + (min + spread % (max - min + 1)) as i64;
                let record = ProducerRecord {
                    topic: topic.to_owned(),
                    value: Some(value.clone()),
                    headers: vec![(
                        PERF_DUE_HEADER.to_owned(),
                        Some(Bytes::from(due.to_string())),
                    )],
                    ..Default::default()
                };
                (record, Due::AtMs(due))
            })
            .collect();
        next += n;
        let producer = &producer;
        in_flight.push(async move {
            let sent = Instant::now();
            (n, sent, producer.schedule_batch(records).await)
        });
        if in_flight.len() >= SCHEDULE_IN_FLIGHT {
            if let Some(done) = in_flight.next().await {
                settle(&mut tally, done);
            }
        }
    }
    while let Some(done) = in_flight.next().await {
        settle(&mut tally, done);
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_start;
    progress.finish();
    report_produce(tally, secs, cpu, record_size, output)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Where `perf consume` reads from.
enum PerfSource {
    Assigned(Consumer),
    Group(GroupConsumer),
}

/// How `perf consume` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConsumeEnd {
    /// `--num-records` were read.
    Count,
    /// Every partition read was at its end (the high watermark, checked twice).
    Drained,
    /// `--idle-ms` passed without a record.
    Idle,
}

impl ConsumeEnd {
    fn as_str(self) -> &'static str {
        match self {
            ConsumeEnd::Count => "count",
            ConsumeEnd::Drained => "drained",
            ConsumeEnd::Idle => "idle",
        }
    }
}

/// The high watermark of each partition of `topic`.
async fn end_offsets(
    consumer: &Consumer,
    topic: &str,
    partitions: u32,
) -> Result<BTreeMap<(String, u32), i64>, CliError> {
    let mut ends = BTreeMap::new();
    for p in 0..partitions {
        ends.insert(
            (topic.to_owned(), p),
            consumer.list_offset(topic, p, -1).await?,
        );
    }
    Ok(ends)
}

/// True when every partition in `positions` has reached its end in `ends`.
fn caught_up<'a>(
    mut positions: impl Iterator<Item = (&'a (String, u32), i64)>,
    ends: &BTreeMap<(String, u32), i64>,
) -> bool {
    positions.all(|(tp, next)| ends.get(tp).is_none_or(|end| next >= *end))
}

async fn consume(
    bootstrap: Vec<String>,
    timeout: Duration,
    topic: &str,
    (num_records, idle, follow): (u64, Option<Duration>, bool),
    (group, filter, push): (Option<String>, Option<ConsumerFilter>, bool),
    read_committed: bool,
    output: OutputFormat,
) -> Result<(), CliError> {
    // Offsets are looked up with a plain consumer in both modes (read committed: the
    // ends are the last stable offsets).
    let mut lookup = Consumer::new(bootstrap.clone(), timeout);
    lookup.set_read_committed(read_committed);
    let partitions = lookup.partition_count(topic).await?;
    let mut ends = end_offsets(&lookup, topic, partitions).await?;
    // Next offset to read per partition; for a group member, from the group's committed
    // offsets (or the earliest) of the partitions it is given.
    let mut next: BTreeMap<(String, u32), i64> = BTreeMap::new();
    let mut source = match &group {
        Some(group) => {
            let admin = GroupsAdmin::new(bootstrap.clone(), timeout);
            let committed = super::groups::committed_offsets(&admin, group).await?;
            for p in 0..partitions {
                let tp = (topic.to_owned(), p);
                let start = match committed.get(&tp) {
                    Some(o) => *o,
                    None => lookup.list_offset(topic, p, -2).await?,
                };
                next.insert(tp, start);
            }
            PerfSource::Group(GroupConsumer::new(
                bootstrap,
                GroupConfig {
                    group: group.clone(),
                    topics: vec![topic.to_owned()],
                    auto_offset_reset: OffsetReset::Earliest,
                    client_id: format!("tidelog-perf-{}", std::process::id()),
                    session_timeout: Duration::from_secs(10),
                    ..GroupConfig::default()
                },
            ))
        }
        None => {
            let mut consumer = Consumer::new(bootstrap, timeout);
            for p in 0..partitions {
                consumer.assign(topic, p, StartAt::Earliest).await?;
            }
            PerfSource::Assigned(consumer)
        }
    };
    match &mut source {
        PerfSource::Assigned(c) => {
            c.set_filter(filter)?;
            c.set_read_committed(read_committed);
        }
        PerfSource::Group(g) => {
            g.set_filter(filter)?;
            g.set_read_committed(read_committed);
        }
    }
    if push {
        match &mut source {
            PerfSource::Assigned(c) => c.enable_push(PushSettings::default()),
            PerfSource::Group(g) => g.enable_push(PushSettings::default()),
        }
    }
    // End-to-end latency of each record: from its CreateTime to its arrival here, in µs
    // (meaningful when consuming while a producer runs; clocks are the same host's).
    let mut latencies: Vec<u32> = Vec::new();
    let stride = num_records.div_ceil(LATENCY_SAMPLES_MAX).max(1);
    let cpu_start = cpu_seconds();
    let mut start = Instant::now();
    let (mut records, mut bytes) = (0u64, 0u64);
    let mut last_report = Instant::now();
    let mut progress = Progress::new();
    let (mut records_at_report, mut bytes_at_report) = (0u64, 0u64);
    let mut last_data = Instant::now();
    let end = loop {
        if records >= num_records {
            break ConsumeEnd::Count;
        }
        let batch = match &mut source {
            PerfSource::Assigned(c) => c.poll(Duration::from_millis(500)).await?,
            PerfSource::Group(g) => g.poll(Duration::from_millis(500)).await?,
        };
        if batch.is_empty() {
            // At the end of what we read? Check against fresh ends before stopping, so
            // records produced meanwhile are still read.
            let at_end = match &source {
                PerfSource::Assigned(c) => {
                    caught_up(c.positions().iter().map(|(k, v)| (k, *v)), &ends)
                }
                PerfSource::Group(g) => {
                    let owned = g.assignment();
                    !owned.is_empty()
                        && caught_up(
                            next.iter()
                                .filter(|(tp, _)| owned.contains(*tp))
                                .map(|(k, v)| (k, *v)),
                            &ends,
                        )
                }
            };
            if at_end && !follow {
                let fresh = end_offsets(&lookup, topic, partitions).await?;
                if fresh == ends {
                    break ConsumeEnd::Drained;
                }
                ends = fresh;
            }
            if records > 0 && idle.is_some_and(|i| last_data.elapsed() >= i) {
                break ConsumeEnd::Idle;
            }
            if last_data.elapsed() > timeout {
                return Err(CliError::new(
                    "REQUEST_TIMED_OUT",
                    format!(
                        "only {records} of {num_records} records arrived{}; none for {} ms",
                        if follow {
                            ""
                        } else {
                            " and the topic is not at its end"
                        },
                        timeout.as_millis()
                    ),
                ));
            }
        } else {
            last_data = Instant::now();
            if follow && records == 0 {
                // Following a producer: the rate counts from the first record, not
                // from however long the producer took to start.
                start = last_data;
            }
        }
        for r in batch {
            if records == num_records {
                break;
            }
            records += 1;
            if records % stride == 0 {
                let age_ms = crate::broker::node::now_ms()
                    .saturating_sub(r.timestamp_ms)
                    .max(0);
                latencies.push(u32::try_from(age_ms.saturating_mul(1000)).unwrap_or(u32::MAX));
            }
            next.insert((r.topic.clone(), r.partition), r.offset + 1);
            bytes += r.value.map_or(0, |v| v.len() as u64) + r.key.map_or(0, |k| k.len() as u64);
        }
        if last_report.elapsed() >= Duration::from_secs(1) {
            // The rate of the last interval, not the average since the start (which decays
            // while the topic is idle).
            let secs = last_report.elapsed().as_secs_f64();
            progress.force(&format!(
                "{} records consumed, {:.0} records/s ({:.1} MB/s)",
                fraction(records, num_records),
                (records - records_at_report) as f64 / secs,
                (bytes - bytes_at_report) as f64 / 1e6 / secs
            ));
            last_report = Instant::now();
            (records_at_report, bytes_at_report) = (records, bytes);
        }
    };
    // The time spent reading: until the last record (not the final checks for more).
    let secs = if records > 0 {
        last_data.duration_since(start).as_secs_f64().max(1e-3)
    } else {
        start.elapsed().as_secs_f64()
    };
    let cpu = cpu_seconds() - cpu_start;
    if let PerfSource::Group(g) = source {
        g.close().await?;
    }
    latencies.sort_unstable();
    let (p50, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
    let summary = json!({
        "records": records,
        "seconds": secs,
        "records_per_sec": records as f64 / secs,
        "mb_per_sec": bytes as f64 / 1e6 / secs,
        "end_to_end_ms_p50": p50,
        "end_to_end_ms_p99": p99,
        "end": end.as_str(),
        "cpu_seconds": cpu,
        "cpu_seconds_per_gb": cpu_per_gb(cpu, bytes as f64),
    });
    progress.finish();
    match output {
        OutputFormat::Json => println!("{summary}"),
        OutputFormat::Table => println!(
            "{records} records consumed in {secs:.2} s, {:.1} records/sec ({:.2} MB/sec){}. CPU {cpu:.2} s ({:.2} s/GB). End-to-end (CreateTime to here) p50 {p50:.0} ms, p99 {p99:.0} ms.",
            records as f64 / secs,
            bytes as f64 / 1e6 / secs,
            match end {
                ConsumeEnd::Count => "",
                ConsumeEnd::Drained => "; the topic is drained",
                ConsumeEnd::Idle => "; stopped after --idle-ms without records",
            },
            cpu_per_gb(cpu, bytes as f64),
        ),
    }
    Ok(())
}
