//! `tidelog groups dlq list|show|replay`: a group's dead letters (records nacked past
//! `max.reconsume.times`, in `_dlq.<group>`), and sending them back to their topics.
//!
//! Replay progress is the committed offset of the memberless group `_dlq-replay.<group>`
//! on the dead-letter topic: each dead letter is replayed once, and `list` shows which
//! were.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::groups::committed_offsets;
use super::progress::{fraction, Progress};
use super::text::{headers_json, headers_table, json_bytes, table_text};
use super::{CliError, OutputFormat};
use crate::api::proto::CommittedOffset;
use crate::client::consumer::{Consumer, ConsumerRecord, StartAt};
use crate::client::groups::GroupsAdmin;
use crate::client::producer::{Producer, ProducerConfig};
use crate::client::retry::{dlq_topic, replay_copy, replay_cursor_group, RetryInfo};
use crate::client::ClientError;
use crate::error_code::ErrorCode;
use crate::time_text::format_rfc3339_ms;

/// `groups dlq ...`.
#[derive(Debug, clap::Subcommand)]
pub enum DlqCommand {
    /// One line per dead letter: position, first topic/partition/offset, redeliveries,
    /// whether it was replayed, and the reason.
    List {
        /// The group.
        #[arg(long)]
        group: String,
    },
    /// Dead letters in full: headers, key, value, and when each nack happened.
    Show(Letters),
    /// Send dead letters back to the topic and partition they were first read from,
    /// without their retry headers (so they get a fresh set of retries): every one not
    /// replayed yet, or only the one at --offset (even if it was replayed before).
    Replay(Letters),
}

/// The dead letters a `show` or `replay` is about.
#[derive(Debug, clap::Args)]
pub struct Letters {
    /// The group.
    #[arg(long)]
    group: String,
    /// Only the dead letter at this offset.
    #[arg(long)]
    offset: Option<i64>,
    /// The dead-letter topic's partition of --offset.
    #[arg(long, default_value_t = 0, requires = "offset")]
    partition: u32,
}

/// Runs `groups dlq ...`.
pub async fn run(
    command: &DlqCommand,
    bootstrap: Vec<String>,
    timeout: Duration,
    output: OutputFormat,
) -> Result<(), CliError> {
    let admin = GroupsAdmin::new(bootstrap.clone(), timeout);
    match command {
        DlqCommand::List { group } => {
            let letters = read_dead_letters(&bootstrap, timeout, group, Start::Earliest).await?;
            let cursor = replay_cursor(&admin, group).await?;
            if output == OutputFormat::Table {
                println!("PARTITION\tOFFSET\tTIME\tORIGIN\tRECONSUMED\tREPLAYED\tREASON");
            }
            for r in &letters {
                let replayed = cursor.get(&r.partition).is_some_and(|c| r.offset < *c);
                let info = RetryInfo::of(r);
                match output {
                    OutputFormat::Json => println!("{}", summary_json(r, &info, replayed)),
                    OutputFormat::Table => println!(
                        "{}\t{}\t{}\t{}-{}@{}\t{}\t{}\t{}",
                        r.partition,
                        r.offset,
                        format_rfc3339_ms(r.timestamp_ms),
                        info.origin.0,
                        info.origin.1,
                        info.origin.2,
                        info.reconsume_times,
                        if replayed { "yes" } else { "no" },
                        info.dead_letter_reason.as_deref().unwrap_or("")
                    ),
                }
            }
        }
        DlqCommand::Show(Letters {
            group,
            offset,
            partition,
        }) => {
            let from = match offset {
                Some(o) => Start::One(*partition, *o),
                None => Start::Earliest,
            };
            let letters = read_dead_letters(&bootstrap, timeout, group, from).await?;
            let cursor = replay_cursor(&admin, group).await?;
            for r in &letters {
                let replayed = cursor.get(&r.partition).is_some_and(|c| r.offset < *c);
                let info = RetryInfo::of(r);
                match output {
                    OutputFormat::Json => {
                        let mut v = summary_json(r, &info, replayed);
                        v["key"] = json_bytes(r.key.as_deref());
                        v["value"] = json_bytes(r.value.as_deref());
                        v["headers"] = headers_json(&r.headers);
                        v["tag"] = json!(r.tag);
                        println!("{v}");
                    }
                    OutputFormat::Table => print_letter(r, &info, replayed),
                }
            }
        }
        DlqCommand::Replay(Letters {
            group,
            offset,
            partition,
        }) => {
            let cursor = replay_cursor(&admin, group).await?;
            let from = match offset {
                Some(o) => Start::One(*partition, *o),
                None => Start::Cursor(&cursor),
            };
            let letters = read_dead_letters(&bootstrap, timeout, group, from).await?;
            let producer = Producer::new(bootstrap.clone(), ProducerConfig::default());
            let mut progress = Progress::new();
            let total = letters.len() as u64;
            // Per partition: the cursor after what was replayed. One --offset moves it
            // only when it is the next letter the cursor was at (the ones before it are
            // still to be replayed).
            let mut next: BTreeMap<u32, i64> = BTreeMap::new();
            let mut sent = Ok(());
            for (i, r) in letters.iter().enumerate() {
                if let Err(e) = producer.send_sync(replay_copy(r)).await {
                    sent = Err(e);
                    break;
                }
                if offset.is_none() || cursor.get(&r.partition).copied().unwrap_or(0) == r.offset {
                    next.insert(r.partition, r.offset + 1);
                }
                progress.update(|| format!("replayed {}", fraction(i as u64 + 1, total)));
            }
            progress.finish();
            // What was sent is recorded even when a send failed, so a rerun does not
            // send it twice.
            let topic = dlq_topic(group)?;
            let offsets: Vec<CommittedOffset> = next
                .into_iter()
                .map(|(partition, offset)| CommittedOffset {
                    topic: topic.clone(),
                    partition,
                    offset,
                    metadata: String::new(),
                })
                .collect();
            if !offsets.is_empty() {
                admin.reset(&replay_cursor_group(group), offsets).await?;
            }
            sent?;
            match output {
                OutputFormat::Json => println!("{}", json!({"group": group, "replayed": total})),
                OutputFormat::Table => println!(
                    "Replayed {total} dead letter{} of group {group} to their topics.",
                    if total == 1 { "" } else { "s" }
                ),
            }
        }
    }
    Ok(())
}

/// A group's retries and dead letters, for `groups describe`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RetryCounts {
    /// Nacked records waiting for their backoff.
    pub scheduled: u64,
    /// Redeliveries in the retry topic not consumed yet.
    pub ready: u64,
    /// Records in the dead-letter topic.
    pub dead_letters: u64,
    /// Of those, not replayed yet.
    pub not_replayed: u64,
}

impl RetryCounts {
    /// As JSON, with the topic names.
    pub fn to_json(&self, group: &str) -> Value {
        json!({
            "retry_topic": crate::client::retry::retry_topic(group).ok(),
            "dlq_topic": dlq_topic(group).ok(),
            "retry_scheduled": self.scheduled,
            "retry_ready": self.ready,
            "dead_letters": self.dead_letters,
            "dead_letters_not_replayed": self.not_replayed,
        })
    }
}

/// Counts `group`'s retries and dead letters (`committed`: the group's offsets); zero for
/// a group that never nacked (or whose name cannot name its topics).
pub async fn retry_counts(
    bootstrap: &[String],
    timeout: Duration,
    group: &str,
    committed: &BTreeMap<(String, u32), i64>,
) -> Result<RetryCounts, CliError> {
    let (Ok(retry), Ok(dlq)) = (crate::client::retry::retry_topic(group), dlq_topic(group)) else {
        return Ok(RetryCounts::default());
    };
    let admin = crate::client::AdminClient::new(bootstrap.to_vec(), timeout);
    let mut counts = RetryCounts::default();
    let cursor = replay_cursor(&GroupsAdmin::new(bootstrap.to_vec(), timeout), group).await?;
    for topic in [retry, dlq] {
        let described = match admin
            .describe_topics_with_offsets(vec![topic.clone()])
            .await
        {
            Ok(d) => d,
            Err(e) if e.code == ErrorCode::UnknownTopicOrPartition => continue,
            Err(e) => return Err(e.into()),
        };
        for d in described {
            let is_retry = topic.starts_with(crate::client::retry::RETRY_TOPIC_PREFIX);
            if is_retry {
                counts.scheduled += d.scheduled.iter().map(|s| s.records).sum::<u64>();
            }
            for o in &d.offsets {
                let start = o.log_start_offset;
                let unread = |from: Option<&i64>| {
                    (o.high_watermark - from.copied().unwrap_or(start).max(start)).max(0) as u64
                };
                if is_retry {
                    counts.ready += unread(committed.get(&(topic.clone(), o.partition)));
                } else {
                    counts.dead_letters += unread(None);
                    counts.not_replayed += unread(cursor.get(&o.partition));
                }
            }
        }
    }
    Ok(counts)
}

/// The dead letter's position, origin, redeliveries and reason as JSON.
fn summary_json(r: &ConsumerRecord, info: &RetryInfo, replayed: bool) -> Value {
    json!({
        "topic": r.topic, "partition": r.partition, "offset": r.offset,
        "timestamp": r.timestamp_ms,
        "origin": {"topic": info.origin.0, "partition": info.origin.1, "offset": info.origin.2},
        "reconsume_times": info.reconsume_times,
        "nacked_at": info.history,
        "reason": info.dead_letter_reason,
        "replayed": replayed,
    })
}

/// `dlq show` as text: one block per dead letter.
fn print_letter(r: &ConsumerRecord, info: &RetryInfo, replayed: bool) {
    println!("Dead letter {}-{}@{}", r.topic, r.partition, r.offset);
    println!(
        "\tOrigin: {}-{}@{}\tReconsumed: {}\tReplayed: {}",
        info.origin.0,
        info.origin.1,
        info.origin.2,
        info.reconsume_times,
        if replayed { "yes" } else { "no" }
    );
    println!(
        "\tReason: {}",
        info.dead_letter_reason.as_deref().unwrap_or("")
    );
    for (i, at) in info.history.iter().enumerate() {
        println!("\tNack {}: {}", i + 1, format_rfc3339_ms(*at));
    }
    println!("\tHeaders: {}", headers_table(&r.headers));
    if let Some(tag) = &r.tag {
        println!("\tTag: {tag}");
    }
    println!("\tKey: {}", table_text(r.key.as_deref()));
    println!("\tValue: {}", table_text(r.value.as_deref()));
}

/// Where replay stopped, per partition of the dead-letter topic.
async fn replay_cursor(admin: &GroupsAdmin, group: &str) -> Result<BTreeMap<u32, i64>, CliError> {
    let topic = dlq_topic(group)?;
    Ok(committed_offsets(admin, &replay_cursor_group(group))
        .await?
        .into_iter()
        .filter(|((t, _), _)| *t == topic)
        .map(|((_, p), o)| (p, o))
        .collect())
}

/// Where [`read_dead_letters`] starts.
enum Start<'a> {
    /// Each partition's log start.
    Earliest,
    /// Each partition's replay cursor (its log start where it has none).
    Cursor(&'a BTreeMap<u32, i64>),
    /// Only the dead letter at this partition and offset.
    One(u32, i64),
}

/// The dead letters of `group` from `from` up to the end of its topic (none yet: an
/// empty list).
async fn read_dead_letters(
    bootstrap: &[String],
    timeout: Duration,
    group: &str,
    from: Start<'_>,
) -> Result<Vec<ConsumerRecord>, CliError> {
    let topic = dlq_topic(group)?;
    let one = match from {
        Start::One(p, o) => Some((p, o)),
        _ => None,
    };
    let mut consumer = Consumer::new(bootstrap.to_vec(), timeout);
    let partitions = match consumer.partition_count(&topic).await {
        Ok(n) => n,
        Err(e) if e.code == ErrorCode::UnknownTopicOrPartition && one.is_none() => {
            return Ok(vec![])
        }
        Err(e) => return Err(e.into()),
    };
    if let Some((p, _)) = one.filter(|(p, _)| *p >= partitions) {
        return Err(ClientError::new(
            ErrorCode::UnknownTopicOrPartition,
            format!("{topic} has {partitions} partitions; there is no partition {p}"),
        )
        .into());
    }
    let mut ends = BTreeMap::new();
    for p in 0..partitions {
        if one.is_some_and(|(op, _)| op != p) {
            continue;
        }
        let end = consumer.list_offset(&topic, p, -1).await?;
        let start = match from {
            Start::One(_, o) => {
                if o >= end || o < 0 {
                    return Err(ClientError::new(
                        ErrorCode::OffsetOutOfRange,
                        format!("{topic}-{p} has no dead letter at offset {o} (its end is {end})"),
                    )
                    .into());
                }
                ends.insert(p, o + 1);
                StartAt::Offset(o)
            }
            Start::Cursor(cursor) => {
                ends.insert(p, end);
                let start = consumer.list_offset(&topic, p, -2).await?;
                match cursor.get(&p) {
                    Some(&c) if c >= end => continue,
                    Some(&c) if c > start => StartAt::Offset(c),
                    _ => StartAt::Earliest,
                }
            }
            Start::Earliest => {
                ends.insert(p, end);
                StartAt::Earliest
            }
        };
        consumer.assign(&topic, p, start).await?;
    }
    let mut out = Vec::new();
    let mut last_progress = Instant::now();
    loop {
        let unfinished = ends.iter().any(|(p, end)| {
            consumer
                .positions()
                .get(&(topic.clone(), *p))
                .is_some_and(|pos| pos < end)
        });
        if !unfinished {
            break;
        }
        if last_progress.elapsed() > timeout {
            return Err(ClientError::new(
                ErrorCode::RequestTimedOut,
                format!(
                    "reading {topic} made no progress for {} ms",
                    timeout.as_millis()
                ),
            )
            .into());
        }
        let records = consumer.poll(Duration::from_millis(500)).await?;
        if !records.is_empty() {
            last_progress = Instant::now();
        }
        out.extend(
            records
                .into_iter()
                .filter(|r| ends.get(&r.partition).is_some_and(|end| r.offset < *end)),
        );
    }
    if let Some((p, o)) = one {
        out.retain(|r| r.partition == p && r.offset == o);
        if out.is_empty() {
            return Err(ClientError::new(
                ErrorCode::OffsetOutOfRange,
                format!("{topic}-{p} has no dead letter at offset {o} (deleted by retention?)"),
            )
            .into());
        }
    }
    Ok(out)
}
