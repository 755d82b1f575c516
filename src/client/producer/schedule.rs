//! Scheduled (delayed) records: [`Producer::schedule`] and [`Producer::cancel_scheduled`].
//! They go in requests of their own (one per partition of a batch), not through the
//! accumulator: a scheduled record is stored in `__timers` by the broker, not appended
//! to its partition's batch.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::{answer, call_produce, resolve_partition, Producer, ProducerRecord};
use crate::api::proto::broker_client::BrokerClient;
use crate::api::proto::{
    CancelScheduledRequest, Header, PartitionProduceData, ProduceRequest, Record, TopicProduceData,
};
use crate::client::error::ClientError;
use crate::error_code::ErrorCode;
/// When a scheduled record is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// This many milliseconds after the broker receives it.
    DelayMs(i64),
    /// At this time (ms since the epoch).
    AtMs(i64),
}

/// Where a scheduled record waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    /// The partition it will be appended to.
    pub partition: u32,
    /// Its id, for [`Producer::cancel_scheduled`].
    pub id: String,
}

/// A record of a [`Producer::schedule_batch`] call: its index there, its wire form and
/// about how many bytes it takes.
type Pending = (usize, Record, usize);

/// Most records [`Producer::schedule_batch`] sends in one request.
const SCHEDULED_PER_REQUEST_MAX: usize = 1_000;

impl Producer {
    /// Schedules `record`: it stays invisible to consumers until `due`, then the cluster
    /// appends it to its partition (chosen now, as for [`Producer::send`]) exactly once,
    /// with its key, value, headers and tag, its timestamp set to the delivery time and
    /// the original one in the `tidelog.delay.original.timestamp` header. Waits until the
    /// schedule is replicated (acks=all). Retriable failures are retried until the
    /// delivery timeout.
    pub async fn schedule(
        &self,
        record: ProducerRecord,
        due: Due,
    ) -> Result<Scheduled, ClientError> {
        let mut scheduled = self.schedule_batch(vec![(record, due)]).await?;
        scheduled.pop().ok_or_else(|| {
            ClientError::new(
                ErrorCode::UnknownServerError,
                "the produce response has no scheduled record id",
            )
        })
    }

    /// Schedules many records as [`Producer::schedule`] does, in one request per
    /// partition (up to 1,000 records or `max_request_size` bytes each), all partitions
    /// at once; returns their ids in input order. A partition that fails fails the call
    /// (records of other partitions may be scheduled).
    pub async fn schedule_batch(
        &self,
        records: Vec<(ProducerRecord, Due)>,
    ) -> Result<Vec<Scheduled>, ClientError> {
        let shared = &self.shared;
        // Per (topic, partition): (input index, wire record, its size) in input order.
        let mut groups: BTreeMap<(String, u32), Vec<Pending>> = BTreeMap::new();
        let count = records.len();
        for (i, (record, due)) in records.into_iter().enumerate() {
            let partition = resolve_partition(shared, &record).await?;
            let (delay_ms, deliver_at_ms) = match due {
                Due::DelayMs(ms) => (Some(ms), None),
                Due::AtMs(ms) => (None, Some(ms)),
            };
            let size = record.key.as_ref().map_or(0, |k| k.len())
                + record.value.as_ref().map_or(0, |v| v.len())
                + record
                    .headers
                    .iter()
                    .map(|(k, v)| k.len() + v.as_ref().map_or(0, |v| v.len()))
                    .sum::<usize>()
                + 64;
            let wire = Record {
                key: record.key,
                value: record.value,
                headers: record
                    .headers
                    .into_iter()
                    .map(|(key, value)| Header { key, value })
                    .collect(),
                timestamp_ms: record.timestamp_ms,
                tag: record.tag,
                delay_ms,
                deliver_at_ms,
            };
            groups
                .entry((record.topic, partition))
                .or_default()
                .push((i, wire, size));
        }
        let mut requests = Vec::new();
        for ((topic, partition), entries) in groups {
            let mut chunk: Vec<Pending> = Vec::new();
            let mut bytes = 0;
            for entry in entries {
                if !chunk.is_empty()
                    && (chunk.len() >= SCHEDULED_PER_REQUEST_MAX
                        || bytes + entry.2 > shared.config.max_request_size)
                {
                    requests.push((topic.clone(), partition, std::mem::take(&mut chunk)));
                    bytes = 0;
                }
                bytes += entry.2;
                chunk.push(entry);
            }
            if !chunk.is_empty() {
                requests.push((topic.clone(), partition, chunk));
            }
        }
        let answers = futures_util::future::join_all(requests.into_iter().map(
            |(topic, partition, chunk)| async move {
                let (indexes, wire): (Vec<usize>, Vec<Record>) =
                    chunk.into_iter().map(|(i, r, _)| (i, r)).unzip();
                let ids = self.send_scheduled(&topic, partition, wire).await?;
                Ok::<_, ClientError>((partition, indexes, ids))
            },
        ))
        .await;
        let mut out: Vec<Option<Scheduled>> = vec![None; count];
        for answer in answers {
            let (partition, indexes, ids) = answer?;
            if ids.len() != indexes.len() {
                return Err(ClientError::new(
                    ErrorCode::UnknownServerError,
                    format!(
                        "the produce response has {} scheduled record ids for {} records",
                        ids.len(),
                        indexes.len()
                    ),
                ));
            }
            for (i, id) in indexes.into_iter().zip(ids) {
                out[i] = Some(Scheduled { partition, id });
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// One scheduling request for `records` of `topic`-`partition` (acks=all), retried
    /// while it certainly wrote nothing; the records' ids.
    async fn send_scheduled(
        &self,
        topic: &str,
        partition: u32,
        records: Vec<Record>,
    ) -> Result<Vec<String>, ClientError> {
        let shared = &self.shared;
        let request = ProduceRequest {
            transactional_id: None,
            acks: Some(-1),
            timeout_ms: shared.config.request_timeout.as_millis() as u32,
            topics: vec![TopicProduceData {
                topic: topic.to_owned(),
                partitions: vec![PartitionProduceData {
                    partition,
                    records,
                    record_batches: Default::default(),
                    compression: 0,
                }],
            }],
        };
        let deadline = Instant::now() + shared.config.delivery_timeout;
        let mut backoff = Duration::from_millis(100);
        loop {
            let outcome: Result<Vec<String>, ClientError> = async {
                let leader = shared.cluster.leader(topic, partition).await?;
                let channel = shared.cluster.connection().channel(&leader)?;
                let response = call_produce(shared, channel, request.clone()).await?;
                answer(&response, topic, partition)?;
                Ok(response
                    .topics
                    .into_iter()
                    .flat_map(|t| t.partitions)
                    .find(|p| p.partition == partition)
                    .map(|p| p.scheduled_ids)
                    .unwrap_or_default())
            }
            .await;
            match outcome {
                Ok(ids) => return Ok(ids),
                // Only failures that wrote nothing are retried: after a timeout or a
                // broken connection the records may be scheduled already, and a retry
                // would schedule them twice.
                Err(e) if wrote_nothing(e.code) && Instant::now() + backoff < deadline => {
                    if e.code == ErrorCode::NotLeaderOrFollower {
                        let _ = shared.cluster.refresh(topic).await;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Cancels a scheduled record that is not due yet, by the id [`Producer::schedule`]
    /// returned. UNKNOWN_SCHEDULED_RECORD when no pending record has that id.
    pub async fn cancel_scheduled(&self, id: &str) -> Result<(), ClientError> {
        let id = id.to_owned();
        self.shared
            .cluster
            .connection()
            .call("cancel scheduled record", move |channel| {
                let id = id.clone();
                async move {
                    BrokerClient::new(channel)
                        .cancel_scheduled(CancelScheduledRequest { id })
                        .await
                }
            })
            .await
            .map(|_| ())
    }
}

/// Whether a failed schedule certainly wrote nothing, so a retry cannot schedule twice.
fn wrote_nothing(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::NotLeaderOrFollower
            | ErrorCode::UnknownTopicOrPartition
            | ErrorCode::NotEnoughReplicas
            | ErrorCode::ControllerUnavailable
            | ErrorCode::ClusterNotReady
            | ErrorCode::UnknownLeaderEpoch
    )
}
