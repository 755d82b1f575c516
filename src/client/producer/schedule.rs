//! Scheduled (delayed) records: [`Producer::schedule`] and [`Producer::cancel_scheduled`].
//! They go one request per record, not through the accumulator: a scheduled record is
//! stored in `__timers` by the broker, not appended to its partition's batch.

use std::time::{Duration, Instant};

use super::{answer, resolve_partition, Producer, ProducerRecord};
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
        let shared = &self.shared;
        let partition = resolve_partition(shared, &record).await?;
        let (delay_ms, deliver_at_ms) = match due {
            Due::DelayMs(ms) => (Some(ms), None),
            Due::AtMs(ms) => (None, Some(ms)),
        };
        let wire = Record {
            key: record.key.clone(),
            value: record.value.clone(),
            headers: record
                .headers
                .iter()
                .map(|(key, value)| Header {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
            timestamp_ms: record.timestamp_ms,
            tag: record.tag.clone(),
            delay_ms,
            deliver_at_ms,
        };
        let request = ProduceRequest {
            acks: Some(-1),
            timeout_ms: shared.config.request_timeout.as_millis() as u32,
            topics: vec![TopicProduceData {
                topic: record.topic.clone(),
                partitions: vec![PartitionProduceData {
                    partition,
                    records: vec![wire],
                    record_batches: Default::default(),
                    compression: 0,
                }],
            }],
        };
        let deadline = Instant::now() + shared.config.delivery_timeout;
        let mut backoff = Duration::from_millis(100);
        loop {
            let outcome = async {
                let leader = shared.cluster.leader(&record.topic, partition).await?;
                let channel = shared.cluster.connection().channel(&leader)?;
                let response = tokio::time::timeout(
                    shared.config.request_timeout,
                    BrokerClient::new(channel).produce(request.clone()),
                )
                .await
                .map_err(|_| {
                    ClientError::new(
                        ErrorCode::RequestTimedOut,
                        format!(
                            "no produce answer within {} ms",
                            shared.config.request_timeout.as_millis()
                        ),
                    )
                })?
                .map_err(ClientError::from)?
                .into_inner();
                answer(&response, &record.topic, partition)?;
                response
                    .topics
                    .iter()
                    .flat_map(|t| &t.partitions)
                    .find_map(|p| p.scheduled_ids.first().cloned())
                    .ok_or_else(|| {
                        ClientError::new(
                            ErrorCode::UnknownServerError,
                            "the produce response has no scheduled record id",
                        )
                    })
            }
            .await;
            match outcome {
                Ok(id) => return Ok(Scheduled { partition, id }),
                // Only failures that wrote nothing are retried: after a timeout or a
                // broken connection the record may be scheduled already, and a retry
                // would schedule it twice.
                Err(e) if wrote_nothing(e.code) && Instant::now() + backoff < deadline => {
                    if e.code == ErrorCode::NotLeaderOrFollower {
                        let _ = shared.cluster.refresh(&record.topic).await;
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
