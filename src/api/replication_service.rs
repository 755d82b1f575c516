//! The internal `tidelog.v1.Replication` service: follower fetches and leader-epoch
//! lookups, served by partition leaders for their followers.

use std::time::Duration;

use tonic::{Request, Response, Status};

use super::proto::replication_server::Replication;
use super::proto::{
    LeaderEpochEndOffset, OffsetsForLeaderEpochRequest, OffsetsForLeaderEpochResponse,
    ReplicaFetchPartitionResponse, ReplicaFetchRequest, ReplicaFetchResponse,
};
use super::status::{error_status, to_wire};
use crate::broker::node::ReplicaFetchTarget;
use crate::broker::BrokerNode;
use crate::error_code::ErrorCode;
use crate::types::{BrokerId, LeaderEpoch};

/// Serves replication requests of one broker.
pub struct ReplicationService {
    node: BrokerNode,
}

impl ReplicationService {
    /// A service over `node`.
    pub fn new(node: BrokerNode) -> Self {
        Self { node }
    }
}

#[tonic::async_trait]
impl Replication for ReplicationService {
    async fn replica_fetch(
        &self,
        request: Request<ReplicaFetchRequest>,
    ) -> Result<Response<ReplicaFetchResponse>, Status> {
        let r = request.into_inner();
        if r.replica_id < 0 || r.replica_id == self.node.id().0 {
            return Err(error_status(
                ErrorCode::InvalidRequest,
                format!(
                    "replica_id must be another broker's id, got {}",
                    r.replica_id
                ),
                None,
            ));
        }
        let mut targets = Vec::with_capacity(r.partitions.len());
        for p in &r.partitions {
            if p.fetch_offset < 0 {
                return Err(error_status(
                    ErrorCode::InvalidRequest,
                    format!(
                        "{}-{}: fetch_offset must be >= 0, got {}",
                        p.topic, p.partition, p.fetch_offset
                    ),
                    None,
                ));
            }
            targets.push(ReplicaFetchTarget {
                topic: p.topic.clone(),
                topic_id: p.topic_id.clone(),
                partition: p.partition,
                leader_epoch: LeaderEpoch(p.leader_epoch),
                fetch_offset: p.fetch_offset as u64,
                max_bytes: (p.max_bytes as usize).max(1),
                known_high_watermark: p.high_watermark,
            });
        }
        let results = self
            .node
            .replica_fetch(
                BrokerId(r.replica_id),
                targets,
                Duration::from_millis(u64::from(r.max_wait_ms)),
                (r.max_bytes as usize).max(1),
            )
            .await;
        let partitions = r
            .partitions
            .iter()
            .zip(results)
            .map(|(p, result)| match result {
                Ok(data) => ReplicaFetchPartitionResponse {
                    topic: p.topic.clone(),
                    partition: p.partition,
                    high_watermark: data.high_watermark.as_i64(),
                    log_start_offset: data.log_start_offset.as_i64(),
                    log_end_offset: data.log_end_offset.as_i64(),
                    records: data.records,
                    ..Default::default()
                },
                Err(e) => {
                    let (start, end) =
                        self.node
                            .partitions()
                            .get(&p.topic, p.partition)
                            .map_or((-1, -1), |l| {
                                (
                                    l.log.log_start_offset().as_i64(),
                                    l.log.log_end_offset().as_i64(),
                                )
                            });
                    ReplicaFetchPartitionResponse {
                        topic: p.topic.clone(),
                        partition: p.partition,
                        error_code: to_wire(e.code),
                        error_message: e.message,
                        high_watermark: -1,
                        log_start_offset: start,
                        log_end_offset: end,
                        ..Default::default()
                    }
                }
            })
            .collect();
        Ok(Response::new(ReplicaFetchResponse { partitions }))
    }

    async fn offsets_for_leader_epoch(
        &self,
        request: Request<OffsetsForLeaderEpochRequest>,
    ) -> Result<Response<OffsetsForLeaderEpochResponse>, Status> {
        let r = request.into_inner();
        let partitions = r
            .partitions
            .iter()
            .map(|q| {
                let result = self.node.epoch_end_offset(
                    BrokerId(r.replica_id),
                    &q.topic,
                    q.partition,
                    LeaderEpoch(q.current_leader_epoch),
                    LeaderEpoch(q.leader_epoch),
                );
                match result {
                    Ok(answer) => LeaderEpochEndOffset {
                        topic: q.topic.clone(),
                        partition: q.partition,
                        leader_epoch: answer.map_or(-1, |(e, _)| e.0),
                        end_offset: answer.map_or(-1, |(_, o)| o.as_i64()),
                        ..Default::default()
                    },
                    Err(e) => LeaderEpochEndOffset {
                        topic: q.topic.clone(),
                        partition: q.partition,
                        error_code: to_wire(e.code),
                        error_message: e.message,
                        leader_epoch: -1,
                        end_offset: -1,
                    },
                }
            })
            .collect();
        Ok(Response::new(OffsetsForLeaderEpochResponse { partitions }))
    }
}
