//! `tidelog transactions copy`: an exactly-once copier (like Kafka's transactional
//! message copier). It reads a topic in a consumer group (read-committed) and writes each
//! record to another topic, committing the output records and the group's input
//! positions in one transaction per poll, so however often it is killed and restarted,
//! the output holds each input record exactly once.

use std::time::{Duration, Instant};

use serde_json::json;

use super::progress::Progress;
use super::{CliError, OutputFormat};
use crate::client::consumer::StartAt;
use crate::client::group_consumer::{GroupConfig, GroupConsumer, OffsetReset};
use crate::client::producer::{Producer, ProducerConfig, ProducerRecord};
use crate::client::ClientError;
use crate::error_code::ErrorCode;

/// What to copy, and how.
#[derive(Debug, Clone)]
pub struct CopySpec {
    /// Topic read.
    pub from: String,
    /// Topic written.
    pub to: String,
    /// The consumer group whose committed offsets are the copier's input positions.
    pub group: String,
    /// The producer's transactional id (one per copier instance).
    pub transactional_id: String,
    /// Stop after this long without a new input record (`None`: run until killed).
    pub idle_exit: Option<Duration>,
    /// Transaction timeout.
    pub transaction_timeout: Duration,
    /// Session timeout in the group.
    pub session_timeout: Duration,
}

/// Totals of a run.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    records: u64,
    transactions: u64,
    aborted: u64,
}

/// Runs the copier until it is idle for `spec.idle_exit` (or for ever).
pub async fn copy(
    bootstrap: Vec<String>,
    spec: CopySpec,
    output: OutputFormat,
) -> Result<(), CliError> {
    let producer = Producer::new(
        bootstrap.clone(),
        ProducerConfig {
            acks: -1,
            transactional_id: Some(spec.transactional_id.clone()),
            transaction_timeout: spec.transaction_timeout,
            ..ProducerConfig::default()
        },
    );
    let out_partitions = producer.partitions_for(&spec.to).await?;
    // Fences an earlier instance and ends its transaction before this one reads the
    // group's offsets.
    producer.init_transactions().await?;
    let mut consumer = GroupConsumer::new(
        bootstrap,
        GroupConfig {
            group: spec.group.clone(),
            topics: vec![spec.from.clone()],
            auto_commit: false,
            auto_offset_reset: OffsetReset::Earliest,
            session_timeout: spec.session_timeout,
            ..GroupConfig::default()
        },
    );
    consumer.set_read_committed(true);
    let mut totals = Totals::default();
    let mut progress = Progress::new();
    let mut last_input = Instant::now();
    loop {
        let records = consumer.poll(Duration::from_millis(500)).await?;
        if records.is_empty() {
            if spec
                .idle_exit
                .is_some_and(|idle| last_input.elapsed() >= idle)
            {
                break;
            }
            continue;
        }
        last_input = Instant::now();
        let count = records.len() as u64;
        let first: Vec<(String, u32, i64)> = first_offsets(&records);
        match copy_once(&producer, &consumer, records, &spec.to, out_partitions).await {
            Ok(()) => {
                totals.records += count;
                totals.transactions += 1;
            }
            Err(e) if is_fatal(&e) => return Err(e.into()),
            Err(e) => {
                // Abort it and read its records again. When even the abort fails, the
                // outcome is unknown (a commit may have gone through): stop, and a
                // restart resumes from the group's committed offsets.
                tracing::warn!(error = %e, "a copy transaction failed; aborting and re-reading");
                totals.aborted += 1;
                if let Err(abort) = producer.abort_transaction().await {
                    return Err(CliError::new(
                        abort.code.as_str(),
                        format!("a copy transaction failed ({e}) and could not be aborted ({}); restart the copier to resume from the committed offsets", abort.message),
                    ));
                }
                for (topic, partition, offset) in first {
                    consumer
                        .seek(&topic, partition, StartAt::Offset(offset))
                        .await
                        .ok();
                }
            }
        }
        progress.update(|| {
            format!(
                "copied {} records in {} transactions",
                totals.records, totals.transactions
            )
        });
    }
    progress.finish();
    consumer.close().await.ok();
    match output {
        OutputFormat::Json => println!(
            "{}",
            json!({"records": totals.records, "transactions": totals.transactions, "aborted": totals.aborted})
        ),
        OutputFormat::Table => println!(
            "copied {} records from {} to {} in {} transactions ({} aborted and retried)",
            totals.records, spec.from, spec.to, totals.transactions, totals.aborted
        ),
    }
    Ok(())
}

/// One transaction: the records to the output topic (input partition `p` to output
/// partition `p mod n`, which keeps each input partition's order), then the positions.
async fn copy_once(
    producer: &Producer,
    consumer: &GroupConsumer,
    records: Vec<crate::client::consumer::ConsumerRecord>,
    to: &str,
    out_partitions: u32,
) -> Result<(), ClientError> {
    producer.begin_transaction().await?;
    for r in records {
        let future = producer
            .send(ProducerRecord {
                topic: to.to_owned(),
                partition: Some(r.partition % out_partitions.max(1)),
                key: r.key,
                value: r.value,
                headers: r.headers,
                tag: None,
                timestamp_ms: Some(r.timestamp_ms),
            })
            .await;
        drop(future);
    }
    producer
        .send_offsets_to_transaction(consumer.positions(), &consumer.group_metadata())
        .await?;
    producer.commit_transaction().await
}

/// The first offset of each partition among `records` (where to re-read after an abort).
fn first_offsets(records: &[crate::client::consumer::ConsumerRecord]) -> Vec<(String, u32, i64)> {
    let mut out: Vec<(String, u32, i64)> = Vec::new();
    for r in records {
        if !out
            .iter()
            .any(|(t, p, _)| *t == r.topic && *p == r.partition)
        {
            out.push((r.topic.clone(), r.partition, r.offset));
        }
    }
    out
}

/// Errors after which this instance cannot go on (it was fenced by a newer one).
fn is_fatal(e: &ClientError) -> bool {
    matches!(
        e.code,
        ErrorCode::ProducerFenced
            | ErrorCode::InvalidProducerIdMapping
            | ErrorCode::InvalidProducerEpoch
            | ErrorCode::TransactionalIdNotFound
    )
}
