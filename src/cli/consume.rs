//! `tidelog consume`: prints records of one topic, like `kafka-console-consumer.sh`, until
//! `--max-messages` or until no record arrived for `--timeout-ms`. With `--group` it reads
//! as a member of a consumer group (partitions assigned by the coordinator, positions
//! committed every `--auto-commit-interval-ms` and at exit, exactly up to the last printed
//! record).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use super::client_args::{block_on, ClientArgs, Isolation};
use super::text::{headers_json, headers_table, json_bytes, table_text};
use super::{CliError, OutputFormat};
use crate::client::consumer::{Consumer, ConsumerFilter, ConsumerRecord, StartAt};
use crate::client::group_consumer::{GroupConfig, GroupConsumer, OffsetReset};
use crate::client::push_consumer::{
    ConsumeResult, ListenMode, MessageListener, PushConfig, PushConsumer,
};
use crate::client::push_feed::PushSettings;
use crate::client::retry::{Retrier, RetryInfo, RetryPolicy, RETRY_TOPIC_PREFIX};
use crate::client::ClientError;

/// Where records come from: assigned partitions, or a group membership.
enum Source {
    Assigned(Consumer),
    Group(GroupConsumer),
}

impl Source {
    async fn poll(&mut self, wait: Duration) -> Result<Vec<ConsumerRecord>, ClientError> {
        match self {
            Source::Assigned(c) => c.poll(wait).await,
            Source::Group(g) => g.poll(wait).await,
        }
    }

    /// Stops reading: a group member rewinds to the first record not printed, commits and
    /// leaves.
    async fn finish(self, unprinted: &[ConsumerRecord]) -> Result<(), ClientError> {
        let Source::Group(mut g) = self else {
            return Ok(());
        };
        let mut first: std::collections::BTreeMap<(String, u32), i64> = Default::default();
        for r in unprinted {
            first
                .entry((r.topic.clone(), r.partition))
                .or_insert(r.offset);
        }
        for ((topic, partition), offset) in first {
            g.seek(&topic, partition, StartAt::Offset(offset)).await?;
        }
        g.close().await
    }
}

/// Flags of `tidelog consume`.
#[derive(Debug, clap::Args)]
pub struct ConsumeArgs {
    /// The topic.
    #[arg(long)]
    topic: String,
    /// Read only this partition (default: all).
    #[arg(long, conflicts_with = "group")]
    partition: Option<u32>,
    /// Read as a member of this consumer group (committed offsets; --from-beginning then
    /// only applies to partitions without a committed offset).
    #[arg(long)]
    group: Option<String>,
    /// With --group: range, round-robin, sticky, consistent-hash or rack-aware.
    #[arg(long, default_value = "range", requires = "group")]
    strategy: String,
    /// This consumer's rack (client.rack): partitions whose leader is in another rack are
    /// fetched from an in-sync replica in this rack when there is one (KIP-392; not with
    /// --push); with `--group --strategy rack-aware` the member gets the partitions with a
    /// replica in this rack first.
    #[arg(long)]
    rack: Option<String>,
    /// With --group: every member reads every partition (offsets kept per --instance-id).
    #[arg(long, requires = "group")]
    broadcast: bool,
    /// With --group: a stable name for this member.
    #[arg(long, requires = "group")]
    instance_id: Option<String>,
    /// With --group: the coordinator drops this member after this long without a heartbeat.
    #[arg(long, default_value_t = 10_000, requires = "group")]
    session_timeout_ms: u64,
    /// With --group: how often positions are committed.
    #[arg(long, default_value_t = 1_000, requires = "group")]
    auto_commit_interval_ms: u64,
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
    /// Print the record's timestamp before the value, as `CreateTime:<ms>` (table output).
    #[arg(long)]
    print_timestamp: bool,
    /// Print the record's headers before the value, as `k1:v1,k2:v2` or `NO_HEADERS`
    /// (table output).
    #[arg(long)]
    print_headers: bool,
    /// Only records with one of these tags: `TagA` or `'TagA || TagB'` (`*`: all). The
    /// broker filters with its tag index; positions and commits move past the rest.
    #[arg(long, value_name = "EXPR", conflicts_with = "filter_sql")]
    filter_tag: Option<String>,
    /// Only records whose properties (headers; `TAGS` is the tag) pass this SQL92
    /// expression, e.g. `"region = 'eu' AND amount > 100"`.
    #[arg(long, value_name = "EXPR")]
    filter_sql: Option<String>,
    /// read_committed: only records of committed transactions (and non-transactional
    /// ones), up to the last stable offset; read_uncommitted (default): everything below
    /// the high watermark.
    #[arg(long, value_enum, default_value_t = Isolation::ReadUncommitted)]
    isolation: Isolation,
    /// Receive records pushed by the brokers over Subscribe streams (credit-based flow
    /// control) instead of fetching. With --group, a listener pool handles them (see
    /// --workers, --orderly) and commits only records it finished.
    #[arg(long)]
    push: bool,
    /// With --push --group: one record of a partition at a time, in offset order; a
    /// record answered "later" (--nack-every) is retried in place.
    #[arg(long, requires = "push", requires = "group")]
    orderly: bool,
    /// With --push --group: records handled at once.
    #[arg(long, default_value_t = 20, requires = "push", requires = "group")]
    workers: usize,
    /// With --group: nack every Nth record delivered (redeliveries count), to try
    /// retries from the shell: it comes back through the group's retry topic after a
    /// backoff, or goes to its dead-letter topic (with --push --orderly: retried in
    /// place instead). Nacked records are not printed.
    #[arg(long, value_name = "N", requires = "group", value_parser = clap::value_parser!(u64).range(1..))]
    nack_every: Option<u64>,
    /// With --group: set the group's redeliveries before its dead-letter topic
    /// (`max.reconsume.times` of its retry topic; default 16).
    #[arg(
        long,
        value_name = "N",
        requires = "group",
        conflicts_with = "broadcast"
    )]
    max_reconsume_times: Option<u32>,
    /// With --group: set one fixed backoff before every redelivery of the group, instead
    /// of the levels 1s 5s 10s 30s 1m ... 2h (`reconsume.backoff.ms` of its retry topic).
    #[arg(
        long,
        value_name = "MS",
        requires = "group",
        conflicts_with = "broadcast"
    )]
    retry_backoff_ms: Option<u64>,
    #[command(flatten)]
    client: ClientArgs,
}

/// Runs `tidelog consume`.
pub fn run(args: &ConsumeArgs) -> Result<(), CliError> {
    let bootstrap = args.client.addresses()?;
    let timeout = args.client.timeout();
    let output = args.client.output;
    let filter = match (&args.filter_tag, &args.filter_sql) {
        (Some(tag), _) => Some(ConsumerFilter::Tag(tag.clone())),
        (None, Some(sql)) => Some(ConsumerFilter::Sql(sql.clone())),
        (None, None) => None,
    };
    if let Some(f) = &filter {
        // Refused before connecting: the error points at the problem.
        f.check()?;
    }
    if let (true, Some(group)) = (args.push, &args.group) {
        return block_on(push_group(args, bootstrap, group.clone(), filter))?;
    }
    block_on(async move {
        let mut source = match &args.group {
            Some(group) => {
                let mut config = group_config(args, group);
                config.retry_policy = retry_policy(args, &bootstrap, group).await?;
                Source::Group(GroupConsumer::new(bootstrap, config))
            }
            None => {
                let mut consumer = Consumer::new(bootstrap, timeout);
                consumer.set_rack(args.rack.clone());
                // Before the start offsets are looked up: "latest" is the last stable
                // offset for a read-committed consumer.
                consumer.set_read_committed(args.isolation == Isolation::ReadCommitted);
                if args.push {
                    consumer.enable_push(PushSettings::default());
                }
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
                Source::Assigned(consumer)
            }
        };
        // The isolation level is set above: the group's through its config.
        match &mut source {
            Source::Assigned(c) => c.set_filter(filter)?,
            Source::Group(g) => g.set_filter(filter)?,
        }
        let mut delivered = 0u64;
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
            let records = source.poll(wait).await?;
            if !records.is_empty() {
                last_record = Instant::now();
            }
            for (i, r) in records.iter().enumerate() {
                delivered += 1;
                if let (Some(every), Source::Group(g)) = (args.nack_every, &source) {
                    if delivered.is_multiple_of(every) {
                        g.nack(r, "consume --nack-every").await?;
                        continue;
                    }
                }
                println!("{}", record_line(&LineArgs::of(args), output, r));
                printed += 1;
                if args.max_messages.is_some_and(|m| printed >= m) {
                    source.finish(&records[i + 1..]).await?;
                    return Ok(());
                }
            }
            if idle_limit.is_some_and(|l| last_record.elapsed() >= l) {
                source.finish(&[]).await?;
                return Ok(());
            }
        }
    })?
}

/// The retry policy `args` set for the group: the group's current one with the flags
/// given applied (None without such flags).
async fn retry_policy(
    args: &ConsumeArgs,
    bootstrap: &[String],
    group: &str,
) -> Result<Option<RetryPolicy>, ClientError> {
    if args.max_reconsume_times.is_none() && args.retry_backoff_ms.is_none() {
        return Ok(None);
    }
    let mut policy = Retrier::new(bootstrap.to_vec(), group).policy().await?;
    if let Some(n) = args.max_reconsume_times {
        policy.max_reconsume_times = n;
    }
    if let Some(ms) = args.retry_backoff_ms {
        policy.backoff_ms = vec![ms];
    }
    // Refused before the member joins.
    policy.to_config()?;
    Ok(Some(policy))
}

/// The group membership `args` ask for.
fn group_config(args: &ConsumeArgs, group: &str) -> GroupConfig {
    GroupConfig {
        group: group.to_owned(),
        topics: vec![args.topic.clone()],
        strategy: args.strategy.clone(),
        broadcast: args.broadcast,
        instance_id: args.instance_id.clone().unwrap_or_default(),
        client_id: format!("tidelog-consume-{}", std::process::id()),
        session_timeout: Duration::from_millis(args.session_timeout_ms),
        auto_commit: true,
        auto_commit_interval: Duration::from_millis(args.auto_commit_interval_ms),
        auto_offset_reset: if args.from_beginning {
            OffsetReset::Earliest
        } else {
            OffsetReset::Latest
        },
        rack: args.rack.clone(),
        read_committed: args.isolation == Isolation::ReadCommitted,
        ..GroupConfig::default()
    }
}

/// The table columns asked for (owned, for the push listener).
#[derive(Debug, Clone, Copy)]
struct LineArgs {
    print_timestamp: bool,
    print_offset: bool,
    print_headers: bool,
    print_key: bool,
}

impl LineArgs {
    fn of(args: &ConsumeArgs) -> Self {
        Self {
            print_timestamp: args.print_timestamp,
            print_offset: args.print_offset,
            print_headers: args.print_headers,
            print_key: args.print_key,
        }
    }

    /// One record as printed: a JSON object or a table line.
    fn line(&self, output: OutputFormat, r: &ConsumerRecord) -> String {
        record_line(self, output, r)
    }
}

/// One record as printed: a JSON object or a table line.
fn record_line(args: &LineArgs, output: OutputFormat, r: &ConsumerRecord) -> String {
    match output {
        OutputFormat::Json => {
            let mut line = json!({
                "topic": r.topic, "partition": r.partition, "offset": r.offset,
                "timestamp": r.timestamp_ms,
                "key": json_bytes(r.key.as_deref()),
                "value": json_bytes(r.value.as_deref()),
                "headers": headers_json(&r.headers),
            });
            if let Some(tag) = &r.tag {
                line["tag"] = json!(tag);
            }
            if r.topic.starts_with(RETRY_TOPIC_PREFIX) {
                // A redelivery: where it was first read, and how often it came back.
                let info = RetryInfo::of(r);
                line["retry"] = json!({
                    "reconsume_times": info.reconsume_times,
                    "origin": {"topic": info.origin.0, "partition": info.origin.1,
                               "offset": info.origin.2},
                });
            }
            line.to_string()
        }
        OutputFormat::Table => table_line(args, r),
    }
}

/// The listener of `consume --push --group`: prints each record it is given, up to
/// `--max-messages` (records past it are abandoned, so they are not committed),
/// answering "later" on the first delivery (here) of every `--nack-every`th record.
struct PrintListener {
    line: Box<dyn Fn(&ConsumerRecord) -> String + Send + Sync>,
    max: Option<u64>,
    nack_every: Option<u64>,
    first_deliveries: AtomicU64,
    printed: AtomicU64,
    last_printed: parking_lot::Mutex<Instant>,
}

#[tonic::async_trait]
impl MessageListener for PrintListener {
    async fn consume(&self, record: &ConsumerRecord, attempt: u32) -> ConsumeResult {
        if attempt == 1 {
            let n = self.first_deliveries.fetch_add(1, Ordering::Relaxed) + 1;
            if self.nack_every.is_some_and(|every| n.is_multiple_of(every)) {
                return ConsumeResult::Later;
            }
        }
        let line = (self.line)(record);
        // The count and the print under one lock: never more than --max-messages. A
        // record past it is abandoned (not committed, not retried).
        let mut last = self.last_printed.lock();
        if self
            .max
            .is_some_and(|m| self.printed.load(Ordering::Relaxed) >= m)
        {
            return ConsumeResult::Abandon;
        }
        println!("{line}");
        self.printed.fetch_add(1, Ordering::Relaxed);
        *last = Instant::now();
        ConsumeResult::Success
    }
}

/// `consume --push --group`: a push consumer whose listener prints.
async fn push_group(
    args: &ConsumeArgs,
    bootstrap: Vec<String>,
    group: String,
    filter: Option<ConsumerFilter>,
) -> Result<(), CliError> {
    let output = args.client.output;
    let line_args = LineArgs::of(args);
    let listener = Arc::new(PrintListener {
        line: Box::new(move |r| line_args.line(output, r)),
        max: args.max_messages,
        nack_every: args.nack_every.filter(|n| *n > 0),
        first_deliveries: AtomicU64::new(0),
        printed: AtomicU64::new(0),
        last_printed: parking_lot::Mutex::new(Instant::now()),
    });
    let mut group_config = group_config(args, &group);
    group_config.retry_policy = retry_policy(args, &bootstrap, &group).await?;
    let config = PushConfig {
        group: group_config,
        mode: if args.orderly {
            ListenMode::Orderly
        } else {
            ListenMode::Concurrent
        },
        workers: args.workers,
        filter,
        ..PushConfig::default()
    };
    let consumer = PushConsumer::start(bootstrap, config, listener.clone())?;
    let idle_limit = args.timeout_ms.map(Duration::from_millis);
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let done = args
            .max_messages
            .is_some_and(|m| listener.printed.load(Ordering::Relaxed) >= m);
        let idle = idle_limit.is_some_and(|l| listener.last_printed.lock().elapsed() >= l);
        if done || idle || consumer.is_finished() {
            break;
        }
    }
    consumer.shutdown().await?;
    Ok(())
}

/// One record as a table line: the fields asked for, tab-separated, in
/// kafka-console-consumer's order (timestamp, partition:offset, headers, key, value).
fn table_line(args: &LineArgs, r: &ConsumerRecord) -> String {
    let mut line = String::new();
    if args.print_timestamp {
        line.push_str(&format!("CreateTime:{}\t", r.timestamp_ms));
    }
    if args.print_offset {
        line.push_str(&format!("{}:{}\t", r.partition, r.offset));
    }
    if args.print_headers {
        line.push_str(&headers_table(&r.headers));
        line.push('\t');
    }
    if args.print_key {
        line.push_str(&table_text(r.key.as_deref()));
        line.push('\t');
    }
    line.push_str(&table_text(r.value.as_deref()));
    line
}
