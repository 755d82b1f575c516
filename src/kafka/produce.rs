//! Produce: each partition's record batches go, as the client encoded them, to the
//! broker's append path (the checks gRPC pre-encoded batches get: CRC, size, magic,
//! timestamps, idempotent producer sequences); every partition answers with its own
//! error. acks=0 gets no response, as in Kafka.

use std::time::Duration;

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::produce_response::{
    LeaderIdAndEpoch, PartitionProduceResponse, TopicProduceResponse,
};
use kafka_protocol::messages::{BrokerId, ProduceRequest, ProduceResponse};
use kafka_protocol::protocol::StrBytes;

use super::errors::kafka_code;
use super::KafkaHandler;
use crate::broker::node::Acks;
use crate::broker::BrokerError;

/// Longest an acks=all produce waits when the request's timeout is not positive.
const PRODUCE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);

fn partition_error(index: i32, code: i16, message: String) -> PartitionProduceResponse {
    PartitionProduceResponse::default()
        .with_index(index)
        .with_error_code(code)
        .with_base_offset(-1)
        .with_log_append_time_ms(-1)
        .with_log_start_offset(-1)
        .with_error_message(Some(StrBytes::from_string(message)))
        .with_current_leader(
            LeaderIdAndEpoch::default()
                .with_leader_id(BrokerId(-1))
                .with_leader_epoch(-1),
        )
}

impl KafkaHandler {
    /// Appends every partition's batches (concurrently: acks=all waits overlap); `None`
    /// for acks=0.
    pub async fn produce(&self, r: ProduceRequest) -> Option<ProduceResponse> {
        let acks = match r.acks {
            -1 => Some(Acks::All),
            0 | 1 => Some(Acks::Leader),
            _ => None,
        };
        let timeout = if r.timeout_ms > 0 {
            Duration::from_millis(r.timeout_ms as u64)
        } else {
            PRODUCE_TIMEOUT_DEFAULT
        };
        let transactional_id = r
            .transactional_id
            .as_ref()
            .map(|t| t.to_string())
            .filter(|t| !t.is_empty());
        let transactional_id = transactional_id.as_deref();
        let mut pending = Vec::new();
        for (t, topic) in r.topic_data.iter().enumerate() {
            for p in &topic.partition_data {
                let name = topic.name.0.as_str();
                pending.push(async move {
                    let outcome = match (acks, &p.records) {
                        (None, _) => Err((
                            ResponseError::InvalidRequiredAcks.code(),
                            format!("acks must be 0, 1 or -1, got {}", r.acks),
                        )),
                        (_, None) => Err((
                            ResponseError::CorruptMessage.code(),
                            "no records".to_owned(),
                        )),
                        _ if crate::controller::validation::is_reserved_topic(name) => Err((
                            ResponseError::InvalidTopicException.code(),
                            crate::controller::validation::check_client_may_change(name, "produce to")
                                .err()
                                .map(|e| e.message)
                                .unwrap_or_default(),
                        )),
                        (Some(acks), Some(records)) if p.index >= 0 => self
                            .node
                            .produce_as(
                                name,
                                p.index as u32,
                                records.to_vec(),
                                acks,
                                timeout,
                                transactional_id,
                            )
                            .await
                            .map_err(|e: BrokerError| (kafka_code(e.code), e.message)),
                        _ => Err((
                            ResponseError::UnknownTopicOrPartition.code(),
                            format!("partition {} does not exist", p.index),
                        )),
                    };
                    let response = match outcome {
                        Ok(produced) => PartitionProduceResponse::default()
                            .with_index(p.index)
                            .with_base_offset(produced.base_offset.map_or(-1, |o| o.as_i64()))
                            .with_log_append_time_ms(-1)
                            .with_log_start_offset(produced.log_start_offset.as_i64())
                            .with_current_leader(
                                LeaderIdAndEpoch::default()
                                    .with_leader_id(BrokerId(-1))
                                    .with_leader_epoch(-1),
                            ),
                        Err((code, message)) => {
                            tracing::debug!(topic = name, partition = p.index, code, %message, "Kafka produce failed");
                            partition_error(p.index, code, message)
                        }
                    };
                    (t, response)
                });
            }
        }
        let outcomes = futures_util::future::join_all(pending).await;
        if r.acks == 0 {
            return None;
        }
        let mut responses: Vec<TopicProduceResponse> = r
            .topic_data
            .iter()
            .map(|t| TopicProduceResponse::default().with_name(t.name.clone()))
            .collect();
        for (t, partition) in outcomes {
            responses[t].partition_responses.push(partition);
        }
        Some(ProduceResponse::default().with_responses(responses))
    }
}
