//! The public `tidelog.v1.Groups` service: coordinator lookup, member heartbeats, offset
//! commits and fetches, and group administration.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};

use super::proto::groups_server::Groups;
use super::proto::{
    CommittedOffset, DeleteGroupRequest, DeleteGroupResponse, DescribeGroupRequest,
    DescribeGroupResponse, FindCoordinatorRequest, FindCoordinatorResponse, GroupHeartbeatRequest,
    GroupHeartbeatResponse, GroupMember, GroupSummary, ListGroupsRequest, ListGroupsResponse,
    OffsetCommitRequest, OffsetCommitResponse, OffsetFetchRequest, OffsetFetchResponse,
    TopicPartitions,
};
use super::status::error_status;
use crate::broker::group::assignor::TopicPartition;
use crate::broker::group::coordinator::{Committer, Heartbeat, TxnCommit};
use crate::broker::group::offsets::{self, OffsetKey, OffsetValue, OFFSETS_TOPIC};
use crate::broker::group::GroupCoordinator;
use crate::broker::{BrokerError, BrokerNode};
use crate::client::AdminClient;
use crate::error_code::ErrorCode;
use crate::types::BrokerId;

/// Serves the Groups service of one broker.
pub struct GroupsService {
    node: BrokerNode,
    coordinator: Arc<GroupCoordinator>,
    admin: AdminClient,
}

fn status(e: BrokerError) -> Status {
    error_status(e.code, e.message, None)
}

fn committed(k: OffsetKey, v: OffsetValue) -> CommittedOffset {
    CommittedOffset {
        topic: k.topic,
        partition: k.partition,
        offset: v.offset,
        metadata: v.metadata,
    }
}

/// An empty member id commits administratively (the group must have no members).
fn committer(member_id: String, epoch: i32) -> Committer {
    if member_id.is_empty() {
        Committer::Admin { instance: None }
    } else {
        Committer::Member {
            id: member_id,
            epoch,
        }
    }
}

fn to_set(list: &[TopicPartitions]) -> BTreeSet<TopicPartition> {
    list.iter()
        .flat_map(|t| t.partitions.iter().map(|p| (t.topic.clone(), *p)))
        .collect()
}

fn to_list(set: &BTreeSet<TopicPartition>) -> Vec<TopicPartitions> {
    let mut by_topic: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (t, p) in set {
        by_topic.entry(t).or_default().push(*p);
    }
    by_topic
        .into_iter()
        .map(|(topic, partitions)| TopicPartitions {
            topic: topic.to_owned(),
            partitions,
        })
        .collect()
}

impl GroupsService {
    /// A service over `node` and its coordinator; `admin` creates `__consumer_offsets`.
    pub fn new(node: BrokerNode, coordinator: Arc<GroupCoordinator>, admin: AdminClient) -> Self {
        Self {
            node,
            coordinator,
            admin,
        }
    }

    /// The coordinator this service serves through.
    pub fn coordinator(&self) -> &Arc<GroupCoordinator> {
        &self.coordinator
    }

    /// Creates `__consumer_offsets` if it does not exist, and waits until this broker's
    /// metadata shows it with leaders.
    async fn ensure_offsets_topic(&self) -> Result<(), BrokerError> {
        let settings = self.coordinator.settings();
        super::internal_topics::ensure(
            &self.node,
            &self.admin,
            super::internal_topics::InternalTopic {
                name: OFFSETS_TOPIC,
                partitions: settings.offsets_partitions,
                replication_factor: settings.offsets_replication_factor,
                config: [("segment.bytes".to_owned(), (100 * 1024 * 1024).to_string())].into(),
                not_ready: ErrorCode::CoordinatorLoadInProgress,
            },
        )
        .await
    }

    /// The coordinator of `group` (creating `__consumer_offsets` on first use): the
    /// leader of the group's offsets partition, and that partition.
    pub async fn locate(&self, group: &str) -> Result<(BrokerId, u32), BrokerError> {
        if group.is_empty() {
            return Err(BrokerError::new(
                ErrorCode::InvalidRequest,
                "group must not be empty",
            ));
        }
        self.ensure_offsets_topic().await?;
        let t = self.node.metadata().topic(OFFSETS_TOPIC).ok_or_else(|| {
            BrokerError::new(ErrorCode::CoordinatorLoadInProgress, "no offsets topic")
        })?;
        let partition = offsets::partition_for(group, t.partitions.len() as u32);
        let leader = t.partitions[partition as usize].leader.ok_or_else(|| {
            BrokerError::new(
                ErrorCode::CoordinatorLoadInProgress,
                format!("{OFFSETS_TOPIC}-{partition} has no leader right now"),
            )
        })?;
        // A coordinator just elected answers once it has taken the partition over, so
        // the client's first group request does not meet COORDINATOR_LOAD_IN_PROGRESS.
        if leader == self.node.id() {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while self
                .node
                .leader_partition(OFFSETS_TOPIC, partition)
                .is_err()
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok((leader, partition))
    }
}

#[tonic::async_trait]
impl Groups for GroupsService {
    async fn find_coordinator(
        &self,
        request: Request<FindCoordinatorRequest>,
    ) -> Result<Response<FindCoordinatorResponse>, Status> {
        let group = request.into_inner().group;
        let (leader, partition) = self.locate(&group).await.map_err(status)?;
        let address = self
            .node
            .metadata()
            .broker_address(leader)
            .unwrap_or_default();
        Ok(Response::new(FindCoordinatorResponse {
            coordinator_id: leader.0,
            address,
            partition,
        }))
    }

    async fn group_heartbeat(
        &self,
        request: Request<GroupHeartbeatRequest>,
    ) -> Result<Response<GroupHeartbeatResponse>, Status> {
        let r = request.into_inner();
        let answer = self
            .coordinator
            .heartbeat(Heartbeat {
                group: r.group,
                member_id: r.member_id,
                member_epoch: r.member_epoch,
                instance_id: r.instance_id,
                client_id: r.client_id,
                topics: Some(r.topics),
                topic_regex: Some(r.topic_regex),
                strategy: r.strategy,
                broadcast: r.broadcast,
                session_timeout_ms: r.session_timeout_ms,
                owned: Some(to_set(&r.owned)),
                rack: Some(r.rack),
                read_committed: r.read_committed,
            })
            .await
            .map_err(status)?;
        Ok(Response::new(GroupHeartbeatResponse {
            member_id: answer.member_id,
            member_epoch: answer.member_epoch,
            heartbeat_interval_ms: answer.heartbeat_interval.as_millis() as u32,
            assignment: to_list(&answer.assignment),
        }))
    }

    async fn offset_commit(
        &self,
        request: Request<OffsetCommitRequest>,
    ) -> Result<Response<OffsetCommitResponse>, Status> {
        let r = request.into_inner();
        let entries = r
            .offsets
            .into_iter()
            .map(|o| (o.topic, o.partition, o.offset, o.metadata))
            .collect();
        let who = committer(r.member_id, r.member_epoch);
        if r.transactional_id.is_empty() {
            self.coordinator
                .commit(&r.group, who, entries)
                .await
                .map_err(status)?;
        } else {
            let producer_epoch = i16::try_from(r.producer_epoch).map_err(|_| {
                error_status(
                    ErrorCode::InvalidRequest,
                    format!("producer_epoch {} is out of range", r.producer_epoch),
                    None,
                )
            })?;
            let txn = TxnCommit {
                transactional_id: r.transactional_id,
                producer_id: r.producer_id,
                producer_epoch,
            };
            self.coordinator
                .commit_transactional(&r.group, who, entries, txn)
                .await
                .map_err(status)?;
        }
        Ok(Response::new(OffsetCommitResponse {}))
    }

    async fn offset_fetch(
        &self,
        request: Request<OffsetFetchRequest>,
    ) -> Result<Response<OffsetFetchResponse>, Status> {
        let r = request.into_inner();
        let offsets = self
            .coordinator
            .fetch_offsets(
                &r.group,
                &r.instance_id,
                &to_set(&r.partitions),
                r.require_stable,
            )
            .await
            .map_err(status)?;
        Ok(Response::new(OffsetFetchResponse {
            offsets: offsets.into_iter().map(|(k, v)| committed(k, v)).collect(),
        }))
    }

    async fn list_groups(
        &self,
        _request: Request<ListGroupsRequest>,
    ) -> Result<Response<ListGroupsResponse>, Status> {
        let groups = self
            .coordinator
            .list()
            .await
            .into_iter()
            .map(|g| GroupSummary {
                group: g.name,
                state: g.state,
                members: g.members as u32,
                coordinator_id: self.node.id().0,
                group_type: g.kind.to_owned(),
            })
            .collect();
        Ok(Response::new(ListGroupsResponse { groups }))
    }

    async fn describe_group(
        &self,
        request: Request<DescribeGroupRequest>,
    ) -> Result<Response<DescribeGroupResponse>, Status> {
        let group = request.into_inner().group;
        let d = self.coordinator.describe(&group).await.map_err(status)?;
        let reads_committed: BTreeSet<&str> = d
            .consumer_members
            .iter()
            .filter(|m| m.read_committed)
            .map(|m| m.id.as_str())
            .collect();
        Ok(Response::new(DescribeGroupResponse {
            group,
            state: d.state,
            strategy: if d.kind == "classic" {
                d.protocol.1.clone()
            } else {
                d.strategy.to_string()
            },
            group_type: d.kind.to_owned(),
            broadcast: d.broadcast,
            group_epoch: d.epoch,
            members: d
                .members
                .into_iter()
                .map(
                    |(member_id, instance_id, client_id, member_epoch, a)| GroupMember {
                        read_committed: reads_committed.contains(member_id.as_str()),
                        member_id,
                        instance_id,
                        client_id,
                        member_epoch,
                        assignment: to_list(&a),
                    },
                )
                .collect(),
            offsets: d
                .offsets
                .into_iter()
                .filter(|(k, _)| k.instance.is_empty())
                .map(|(k, v)| committed(k, v))
                .collect(),
            isolation: if d.read_committed {
                "read_committed"
            } else {
                "read_uncommitted"
            }
            .to_owned(),
        }))
    }

    async fn delete_group(
        &self,
        request: Request<DeleteGroupRequest>,
    ) -> Result<Response<DeleteGroupResponse>, Status> {
        let group = request.into_inner().group;
        self.coordinator.delete(&group).await.map_err(status)?;
        Ok(Response::new(DeleteGroupResponse {}))
    }
}
