//! ListOffsets (earliest, latest, by timestamp, max timestamp) and OffsetForLeaderEpoch (where a leader
//! epoch ends: clients ask after a leader change to detect truncation), on partitions
//! this broker leads.

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::list_offsets_response::{
    ListOffsetsPartitionResponse, ListOffsetsTopicResponse,
};
use kafka_protocol::messages::offset_for_leader_epoch_response::{
    EpochEndOffset, OffsetForLeaderTopicResult,
};
use kafka_protocol::messages::{
    ListOffsetsRequest, ListOffsetsResponse, OffsetForLeaderEpochRequest,
    OffsetForLeaderEpochResponse,
};

use super::errors::kafka_code;
use super::fetch::check_leader_epoch;
use super::KafkaHandler;
use crate::broker::node::OffsetQuery;
use crate::types::LeaderEpoch;

/// ListOffsets' special timestamps.
const EARLIEST: i64 = -2;
const LATEST: i64 = -1;
const MAX_TIMESTAMP: i64 = -3;

impl KafkaHandler {
    /// Answers ListOffsets.
    pub async fn list_offsets(&self, r: ListOffsetsRequest) -> ListOffsetsResponse {
        let mut topics = Vec::with_capacity(r.topics.len());
        for t in r.topics {
            let name = t.name.0.to_string();
            let mut partitions = Vec::with_capacity(t.partitions.len());
            for p in t.partitions {
                let answer = ListOffsetsPartitionResponse::default()
                    .with_partition_index(p.partition_index)
                    .with_timestamp(-1)
                    .with_offset(-1)
                    .with_leader_epoch(-1);
                let query = match p.timestamp {
                    EARLIEST => OffsetQuery::Earliest,
                    // A read-committed consumer's end is the last stable offset.
                    LATEST if r.isolation_level == 1 => OffsetQuery::LastStable,
                    LATEST => OffsetQuery::Latest,
                    MAX_TIMESTAMP => OffsetQuery::MaxTimestamp,
                    ts if ts >= 0 => OffsetQuery::Timestamp(ts),
                    _ => {
                        partitions
                            .push(answer.with_error_code(ResponseError::UnsupportedVersion.code()));
                        continue;
                    }
                };
                if p.partition_index < 0 {
                    partitions.push(
                        answer.with_error_code(ResponseError::UnknownTopicOrPartition.code()),
                    );
                    continue;
                }
                if let Err(code) =
                    check_leader_epoch(self, &name, p.partition_index, p.current_leader_epoch)
                {
                    partitions.push(answer.with_error_code(code));
                    continue;
                }
                partitions.push(
                    match self
                        .node
                        .list_offset(&name, p.partition_index as u32, query)
                        .await
                    {
                        Ok((offset, timestamp)) => {
                            answer.with_offset(offset).with_timestamp(timestamp)
                        }
                        Err(e) => answer.with_error_code(kafka_code(e.code)),
                    },
                );
            }
            topics.push(
                ListOffsetsTopicResponse::default()
                    .with_name(t.name)
                    .with_partitions(partitions),
            );
        }
        ListOffsetsResponse::default().with_topics(topics)
    }

    /// Answers OffsetForLeaderEpoch: the largest epoch at or below the asked one that the
    /// leader's log holds, and where it ends (-1, -1 when the log holds none).
    pub fn offset_for_leader_epoch(
        &self,
        r: OffsetForLeaderEpochRequest,
    ) -> OffsetForLeaderEpochResponse {
        let topics = r
            .topics
            .into_iter()
            .map(|t| {
                let name = t.topic.0.to_string();
                let partitions = t
                    .partitions
                    .into_iter()
                    .map(|p| {
                        let answer = EpochEndOffset::default()
                            .with_partition(p.partition)
                            .with_leader_epoch(-1)
                            .with_end_offset(-1);
                        if p.partition < 0 {
                            return answer
                                .with_error_code(ResponseError::UnknownTopicOrPartition.code());
                        }
                        if let Err(code) =
                            check_leader_epoch(self, &name, p.partition, p.current_leader_epoch)
                        {
                            return answer.with_error_code(code);
                        }
                        match self.node.leader_partition(&name, p.partition as u32) {
                            Err(e) => answer.with_error_code(kafka_code(e.code)),
                            Ok((local, _)) => {
                                match local.log.end_offset_for_epoch(LeaderEpoch(p.leader_epoch)) {
                                    Some((epoch, end)) => answer
                                        .with_leader_epoch(epoch.0)
                                        .with_end_offset(end.as_i64()),
                                    None => answer,
                                }
                            }
                        }
                    })
                    .collect();
                OffsetForLeaderTopicResult::default()
                    .with_topic(t.topic)
                    .with_partitions(partitions)
            })
            .collect();
        OffsetForLeaderEpochResponse::default().with_topics(topics)
    }
}
