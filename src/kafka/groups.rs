//! Consumer groups over Kafka's protocol, on the broker's one group coordinator:
//! FindCoordinator; the classic protocol (JoinGroup, SyncGroup, Heartbeat, LeaveGroup);
//! the consumer protocol of KIP-848 (ConsumerGroupHeartbeat, ConsumerGroupDescribe),
//! which is the server-side assignment tidelog's own clients use; OffsetCommit,
//! OffsetFetch, OffsetDelete; DescribeGroups, ListGroups, DeleteGroups. Offsets committed
//! here are the ones `tidelog groups describe` shows, and the reverse.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::consumer_group_describe_response::{
    self as cgd, ConsumerGroupDescribeResponse,
};
use kafka_protocol::messages::consumer_group_heartbeat_response::{
    self as cgh, ConsumerGroupHeartbeatResponse,
};
use kafka_protocol::messages::delete_groups_response::DeletableGroupResult;
use kafka_protocol::messages::describe_groups_response::{DescribedGroup, DescribedGroupMember};
use kafka_protocol::messages::find_coordinator_response::Coordinator;
use kafka_protocol::messages::join_group_response::JoinGroupResponseMember;
use kafka_protocol::messages::leave_group_response::MemberResponse;
use kafka_protocol::messages::list_groups_response::ListedGroup;
use kafka_protocol::messages::offset_commit_response::{
    OffsetCommitResponsePartition, OffsetCommitResponseTopic,
};
use kafka_protocol::messages::offset_delete_response::{
    OffsetDeleteResponsePartition, OffsetDeleteResponseTopic,
};
use kafka_protocol::messages::offset_fetch_response::{
    OffsetFetchResponseGroup, OffsetFetchResponsePartition, OffsetFetchResponsePartitions,
    OffsetFetchResponseTopic, OffsetFetchResponseTopics,
};
use kafka_protocol::messages::{
    BrokerId, ConsumerGroupDescribeRequest, ConsumerGroupHeartbeatRequest,
    ConsumerProtocolAssignment, DeleteGroupsRequest, DeleteGroupsResponse, DescribeGroupsRequest,
    DescribeGroupsResponse, FindCoordinatorRequest, FindCoordinatorResponse, GroupId,
    HeartbeatRequest, HeartbeatResponse, JoinGroupRequest, JoinGroupResponse, LeaveGroupRequest,
    LeaveGroupResponse, ListGroupsRequest, ListGroupsResponse, OffsetCommitRequest,
    OffsetCommitResponse, OffsetDeleteRequest, OffsetDeleteResponse, OffsetFetchRequest,
    OffsetFetchResponse, SyncGroupRequest, SyncGroupResponse, TopicName,
};
use kafka_protocol::protocol::{Encodable, StrBytes};

use super::errors::kafka_code;
use super::metadata::{host_port, topic_name_of, topic_uuid};
use super::KafkaHandler;
use crate::broker::group::assignor::TopicPartition;
use crate::broker::group::classic::JoinRequest;
use crate::broker::group::coordinator::{Committer, GroupDescription, Heartbeat};
use crate::broker::group::offsets::METADATA_BYTES_MAX;
use crate::broker::BrokerError;
use crate::error_code::ErrorCode;

/// FindCoordinator's key type for groups.
const KEY_TYPE_GROUP: i8 = 0;
/// FindCoordinator's key type for transactional ids.
const KEY_TYPE_TRANSACTION: i8 = 1;

fn s(v: impl Into<String>) -> StrBytes {
    StrBytes::from_string(v.into())
}

/// The Kafka code of a group operation's failure; an empty or overlong group id is
/// Kafka's INVALID_GROUP_ID.
fn group_code(group: &str, e: &BrokerError) -> i16 {
    if e.code == ErrorCode::InvalidRequest && (group.is_empty() || group.len() > 255) {
        ResponseError::InvalidGroupId.code()
    } else {
        kafka_code(e.code)
    }
}

/// The Kafka code of a failed commit, as Kafka's coordinator answers: a failure to
/// write the offsets log is the coordinator being unavailable (clients retry); a
/// consumer-protocol member's epoch mismatch is STALE_MEMBER_EPOCH (clients refresh it).
pub(super) fn commit_code(group: &str, e: &BrokerError) -> i16 {
    match e.code {
        ErrorCode::NotEnoughReplicas
        | ErrorCode::NotEnoughReplicasAfterAppend
        | ErrorCode::RequestTimedOut
        | ErrorCode::KafkaStorageError
        | ErrorCode::UnknownTopicOrPartition => ResponseError::CoordinatorNotAvailable.code(),
        ErrorCode::NotLeaderOrFollower => ResponseError::NotCoordinator.code(),
        ErrorCode::RecordTooLarge => ResponseError::InvalidCommitOffsetSize.code(),
        ErrorCode::FencedMemberEpoch => ResponseError::StaleMemberEpoch.code(),
        _ => group_code(group, e),
    }
}

/// One partition of an OffsetFetch answer: index, offset (-1: none), metadata, error.
type FetchedOffset = (i32, i64, String, i16);

/// A commit's answer per topic: each partition with its own error, if it has one.
pub(super) type CommitAnswers = Vec<(TopicName, Vec<(i32, Option<i16>)>)>;

/// A duration in ms from the wire; negative is `None`.
fn millis(ms: i32) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

/// Kafka's name of a consumer-protocol group state.
fn consumer_state(state: &str) -> &'static str {
    match state {
        "empty" => "Empty",
        "stable" => "Stable",
        _ => "Reconciling",
    }
}

/// The state name a Kafka client expects for a listed or described group.
fn kafka_state(kind: &str, state: &str) -> String {
    if kind == "classic" {
        state.to_owned()
    } else {
        consumer_state(state).to_owned()
    }
}

/// An assignment as `consumer`-protocol bytes (ConsumerProtocolAssignment v0), so that
/// Kafka tools can show a consumer-protocol member's partitions.
fn assignment_bytes(set: &BTreeSet<TopicPartition>) -> Bytes {
    let mut by_topic: BTreeMap<&str, Vec<i32>> = BTreeMap::new();
    for (t, p) in set {
        by_topic.entry(t).or_default().push(*p as i32);
    }
    let a = ConsumerProtocolAssignment::default().with_assigned_partitions(
        by_topic
            .into_iter()
            .map(|(t, ps)| {
                kafka_protocol::messages::consumer_protocol_assignment::TopicPartition::default()
                    .with_topic(TopicName(s(t)))
                    .with_partitions(ps)
            })
            .collect(),
    );
    let mut out = BytesMut::new();
    out.extend_from_slice(&0i16.to_be_bytes());
    match a.encode(&mut out, 0) {
        Ok(()) => out.freeze(),
        Err(_) => Bytes::new(),
    }
}

impl KafkaHandler {
    /// The coordinator of one key as (error, message, node, host, port).
    async fn coordinator_of(&self, key: &str, key_type: i8) -> (i16, String, i32, String, i32) {
        let located = match key_type {
            KEY_TYPE_GROUP => self.groups.locate(key).await,
            KEY_TYPE_TRANSACTION => self.txns.locate(key).await,
            _ => {
                return (
                    ResponseError::InvalidRequest.code(),
                    format!("key type {key_type} is not served (0: group, 1: transaction)"),
                    -1,
                    String::new(),
                    -1,
                )
            }
        };
        let located = match located {
            Ok((leader, _)) => self
                .node
                .metadata()
                .read(|image| {
                    image
                        .brokers
                        .get(&leader)
                        .and_then(|b| b.kafka_address.clone())
                })
                .and_then(|a| host_port(&a))
                .map(|(host, port)| (leader, host, port))
                .ok_or_else(|| {
                    (
                        ResponseError::CoordinatorNotAvailable.code(),
                        format!("coordinator broker {} has no Kafka listener", leader.0),
                    )
                }),
            // Anything but a bad group id is the coordinator being unavailable for now
            // (Kafka clients retry that; other codes would fail them for good).
            Err(e) => Err((
                match group_code(key, &e) {
                    code if code == ResponseError::InvalidGroupId.code() => code,
                    _ => ResponseError::CoordinatorNotAvailable.code(),
                },
                e.message,
            )),
        };
        match located {
            Ok((leader, host, port)) => (0, String::new(), leader.0, host, port),
            Err((code, message)) => (code, message, -1, String::new(), -1),
        }
    }

    /// Answers FindCoordinator (v4+: a batch of keys).
    pub async fn find_coordinator(
        &self,
        r: FindCoordinatorRequest,
        version: i16,
    ) -> FindCoordinatorResponse {
        if version >= 4 {
            let mut coordinators = Vec::with_capacity(r.coordinator_keys.len());
            for key in r.coordinator_keys {
                let (code, message, node, host, port) =
                    self.coordinator_of(key.as_str(), r.key_type).await;
                coordinators.push(
                    Coordinator::default()
                        .with_key(key)
                        .with_node_id(BrokerId(node))
                        .with_host(s(host))
                        .with_port(port)
                        .with_error_code(code)
                        .with_error_message((code != 0).then(|| s(message))),
                );
            }
            return FindCoordinatorResponse::default().with_coordinators(coordinators);
        }
        let (code, message, node, host, port) =
            self.coordinator_of(r.key.as_str(), r.key_type).await;
        FindCoordinatorResponse::default()
            .with_error_code(code)
            .with_error_message((code != 0).then(|| s(message)))
            .with_node_id(BrokerId(node))
            .with_host(s(host))
            .with_port(port)
    }

    /// Answers JoinGroup; waits until the group's join phase ends.
    pub async fn join_group(
        &self,
        r: JoinGroupRequest,
        version: i16,
        client_id: &str,
        peer: SocketAddr,
    ) -> JoinGroupResponse {
        let group = r.group_id.to_string();
        let failed = |code: i16, member: String| {
            JoinGroupResponse::default()
                .with_error_code(code)
                .with_generation_id(-1)
                .with_member_id(s(member))
        };
        let session = millis(r.session_timeout_ms);
        // v0 has no rebalance timeout: it is the session timeout.
        let rebalance = if version == 0 {
            session
        } else {
            millis(r.rebalance_timeout_ms)
        };
        let (Some(session), Some(rebalance)) = (session, rebalance) else {
            return failed(
                ResponseError::InvalidSessionTimeout.code(),
                r.member_id.to_string(),
            );
        };
        let req = JoinRequest {
            member_id: r.member_id.to_string(),
            instance_id: r.group_instance_id.map(|i| i.to_string()),
            client_id: client_id.to_owned(),
            client_host: format!("/{}", peer.ip()),
            session_timeout: session,
            rebalance_timeout: rebalance,
            protocol_type: r.protocol_type.to_string(),
            protocols: r
                .protocols
                .into_iter()
                .map(|p| (p.name.to_string(), p.metadata))
                .collect(),
            require_known_member_id: version >= 4,
            supports_skip_assignment: version >= 9,
        };
        let (member, answer) = self.groups.coordinator().join_classic(&group, req).await;
        match answer {
            Err(e) => failed(group_code(&group, &e), member),
            Ok(a) => JoinGroupResponse::default()
                .with_generation_id(a.generation)
                .with_protocol_type(Some(s(a.protocol_type)))
                .with_protocol_name(Some(s(a.protocol)))
                .with_leader(s(a.leader))
                .with_skip_assignment(a.skip_assignment)
                .with_member_id(s(member))
                .with_members(
                    a.members
                        .into_iter()
                        .map(|(id, instance, metadata)| {
                            JoinGroupResponseMember::default()
                                .with_member_id(s(id))
                                .with_group_instance_id(instance.map(s))
                                .with_metadata(metadata)
                        })
                        .collect(),
                ),
        }
    }

    /// Answers SyncGroup; a follower waits for the leader's assignment.
    pub async fn sync_group(&self, r: SyncGroupRequest) -> SyncGroupResponse {
        let group = r.group_id.to_string();
        let result = self
            .groups
            .coordinator()
            .sync_classic(
                &group,
                r.member_id.as_str(),
                r.group_instance_id.as_deref(),
                r.generation_id,
                r.protocol_type.as_deref(),
                r.protocol_name.as_deref(),
                r.assignments
                    .into_iter()
                    .map(|a| (a.member_id.to_string(), a.assignment))
                    .collect(),
            )
            .await;
        match result {
            Ok(assignment) => SyncGroupResponse::default()
                .with_protocol_type(r.protocol_type)
                .with_protocol_name(r.protocol_name)
                .with_assignment(assignment),
            Err(e) => SyncGroupResponse::default().with_error_code(group_code(&group, &e)),
        }
    }

    /// Answers Heartbeat.
    pub async fn heartbeat(&self, r: HeartbeatRequest) -> HeartbeatResponse {
        let group = r.group_id.to_string();
        let result = self
            .groups
            .coordinator()
            .heartbeat_classic(
                &group,
                r.member_id.as_str(),
                r.group_instance_id.as_deref(),
                r.generation_id,
            )
            .await;
        HeartbeatResponse::default().with_error_code(match result {
            Ok(()) => 0,
            Err(e) => group_code(&group, &e),
        })
    }

    /// Answers LeaveGroup (v3+: a batch of members, each with its own error).
    pub async fn leave_group(&self, r: LeaveGroupRequest, version: i16) -> LeaveGroupResponse {
        let group = r.group_id.to_string();
        let leaving: Vec<(String, Option<String>)> = if version >= 3 {
            r.members
                .iter()
                .map(|m| {
                    (
                        m.member_id.to_string(),
                        m.group_instance_id.as_ref().map(|i| i.to_string()),
                    )
                })
                .collect()
        } else {
            vec![(r.member_id.to_string(), None)]
        };
        match self
            .groups
            .coordinator()
            .leave_classic(&group, &leaving)
            .await
        {
            Err(e) => LeaveGroupResponse::default().with_error_code(group_code(&group, &e)),
            Ok(results) if version < 3 => LeaveGroupResponse::default().with_error_code(
                results
                    .first()
                    .and_then(|r| r.as_ref().err())
                    .map_or(0, |e| kafka_code(e.code)),
            ),
            Ok(results) => LeaveGroupResponse::default().with_members(
                leaving
                    .into_iter()
                    .zip(results)
                    .map(|((id, instance), r)| {
                        MemberResponse::default()
                            .with_member_id(s(id))
                            .with_group_instance_id(instance.map(s))
                            .with_error_code(r.err().map_or(0, |e| kafka_code(e.code)))
                    })
                    .collect(),
            ),
        }
    }

    /// Answers OffsetCommit: partitions of unknown topics and overlong metadata fail on
    /// their own; the rest commit together (or fail together, with the group's error).
    pub async fn offset_commit(&self, r: OffsetCommitRequest) -> OffsetCommitResponse {
        let group = r.group_id.to_string();
        let (entries, answers) = self.plan_commit(r.topics.into_iter().map(|t| {
            let partitions = t
                .partitions
                .into_iter()
                .map(|p| (p.partition_index, p.committed_offset, p.committed_metadata))
                .collect();
            (t.name, partitions)
        }));
        let outcome = if entries.is_empty() {
            0
        } else {
            let who = Committer::Kafka {
                id: r.member_id.to_string(),
                instance: r.group_instance_id.map(|i| i.to_string()),
                generation: r.generation_id_or_member_epoch,
            };
            match self.groups.coordinator().commit(&group, who, entries).await {
                Ok(()) => 0,
                Err(e) => {
                    tracing::debug!(group, error = %e, "Kafka OffsetCommit refused");
                    commit_code(&group, &e)
                }
            }
        };
        OffsetCommitResponse::default().with_topics(
            answers
                .into_iter()
                .map(|(name, ps)| {
                    OffsetCommitResponseTopic::default()
                        .with_name(name)
                        .with_partitions(
                            ps.into_iter()
                                .map(|(i, code)| {
                                    OffsetCommitResponsePartition::default()
                                        .with_partition_index(i)
                                        .with_error_code(code.unwrap_or(outcome))
                                })
                                .collect(),
                        )
                })
                .collect(),
        )
    }

    /// Checks each partition of a commit: the valid ones become entries (topic,
    /// partition, offset, metadata) to commit together, the others get their own error.
    pub(super) fn plan_commit(
        &self,
        topics: impl Iterator<Item = (TopicName, Vec<(i32, i64, Option<StrBytes>)>)>,
    ) -> (Vec<(String, u32, i64, String)>, CommitAnswers) {
        let mut entries = Vec::new();
        let mut answers: CommitAnswers = Vec::new();
        for (topic, partitions_asked) in topics {
            let name = topic.to_string();
            let partitions = self
                .node
                .metadata()
                .topic(&name)
                .map(|t| t.partitions.len());
            let mut out = Vec::with_capacity(partitions_asked.len());
            for (index, offset, metadata) in partitions_asked {
                let metadata = metadata.map(|m| m.to_string()).unwrap_or_default();
                let code = match (partitions, u32::try_from(index)) {
                    (Some(n), Ok(i)) if (i as usize) < n => {
                        if metadata.len() > METADATA_BYTES_MAX {
                            Some(ResponseError::OffsetMetadataTooLarge.code())
                        } else if offset < 0 {
                            Some(ResponseError::InvalidCommitOffsetSize.code())
                        } else {
                            entries.push((name.clone(), i, offset, metadata));
                            None
                        }
                    }
                    _ => Some(ResponseError::UnknownTopicOrPartition.code()),
                };
                out.push((index, code));
            }
            answers.push((topic, out));
        }
        (entries, answers)
    }

    /// One group's committed offsets for OffsetFetch: (topic, [(partition, offset,
    /// metadata)]) for `topics` (`None`: every committed partition), or the group error.
    async fn fetch_group_offsets(
        &self,
        group: &str,
        topics: Option<Vec<(String, Vec<i32>)>>,
        require_stable: bool,
    ) -> Result<Vec<(String, Vec<FetchedOffset>)>, i16> {
        let (committed, mut unstable) = self
            .groups
            .coordinator()
            .offsets_and_unstable(group)
            .await
            .map_err(|e| group_code(group, &e))?;
        // KIP-447: a partition with an offset pending in an open transaction answers
        // UNSTABLE_OFFSET_COMMIT, and the client asks again.
        if !require_stable {
            unstable.clear();
        }
        let mut by_topic: BTreeMap<String, BTreeMap<i32, (i64, String)>> = BTreeMap::new();
        for (k, v) in committed {
            by_topic
                .entry(k.topic)
                .or_default()
                .insert(k.partition as i32, (v.offset, v.metadata));
        }
        let answer = |t: &str, p: i32, found: Option<&(i64, String)>| {
            if u32::try_from(p).is_ok_and(|q| unstable.contains(&(t.to_owned(), q))) {
                return (
                    p,
                    -1,
                    String::new(),
                    ResponseError::UnstableOffsetCommit.code(),
                );
            }
            match found {
                Some((o, m)) => (p, *o, m.clone(), 0),
                None => (p, -1, String::new(), 0),
            }
        };
        Ok(match topics {
            None => by_topic
                .iter()
                .map(|(t, ps)| {
                    let ps = ps.iter().map(|(p, v)| answer(t, *p, Some(v))).collect();
                    (t.clone(), ps)
                })
                .collect(),
            Some(wanted) => wanted
                .into_iter()
                .map(|(t, ps)| {
                    let have = by_topic.get(&t);
                    let ps = ps
                        .into_iter()
                        .map(|p| answer(&t, p, have.and_then(|h| h.get(&p))))
                        .collect();
                    (t, ps)
                })
                .collect(),
        })
    }

    /// Answers OffsetFetch (v8+: several groups at once).
    pub async fn offset_fetch(&self, r: OffsetFetchRequest, version: i16) -> OffsetFetchResponse {
        if version >= 8 {
            let mut groups = Vec::with_capacity(r.groups.len());
            for g in r.groups {
                let wanted = g.topics.map(|ts| {
                    ts.into_iter()
                        .map(|t| (t.name.to_string(), t.partition_indexes))
                        .collect()
                });
                let fetched = self
                    .fetch_group_offsets(g.group_id.as_str(), wanted, r.require_stable)
                    .await;
                let answer = match fetched {
                    Err(code) => OffsetFetchResponseGroup::default().with_error_code(code),
                    Ok(topics) => OffsetFetchResponseGroup::default().with_topics(
                        topics
                            .into_iter()
                            .map(|(t, ps)| {
                                OffsetFetchResponseTopics::default()
                                    .with_name(TopicName(s(t)))
                                    .with_partitions(
                                        ps.into_iter()
                                            .map(|(p, o, m, code)| {
                                                OffsetFetchResponsePartitions::default()
                                                    .with_partition_index(p)
                                                    .with_committed_offset(o)
                                                    .with_committed_leader_epoch(-1)
                                                    .with_metadata(Some(s(m)))
                                                    .with_error_code(code)
                                            })
                                            .collect(),
                                    )
                            })
                            .collect(),
                    ),
                };
                groups.push(answer.with_group_id(g.group_id));
            }
            return OffsetFetchResponse::default().with_groups(groups);
        }
        let wanted = r.topics.map(|ts| {
            ts.into_iter()
                .map(|t| (t.name.to_string(), t.partition_indexes))
                .collect()
        });
        let fetched = self
            .fetch_group_offsets(r.group_id.as_str(), wanted, r.require_stable)
            .await;
        match fetched {
            Err(code) => OffsetFetchResponse::default().with_error_code(code),
            Ok(topics) => OffsetFetchResponse::default().with_topics(
                topics
                    .into_iter()
                    .map(|(t, ps)| {
                        OffsetFetchResponseTopic::default()
                            .with_name(TopicName(s(t)))
                            .with_partitions(
                                ps.into_iter()
                                    .map(|(p, o, m, code)| {
                                        OffsetFetchResponsePartition::default()
                                            .with_partition_index(p)
                                            .with_committed_offset(o)
                                            .with_committed_leader_epoch(-1)
                                            .with_metadata(Some(s(m)))
                                            .with_error_code(code)
                                    })
                                    .collect(),
                            )
                    })
                    .collect(),
            ),
        }
    }

    /// Answers OffsetDelete.
    pub async fn offset_delete(&self, r: OffsetDeleteRequest) -> OffsetDeleteResponse {
        let group = r.group_id.to_string();
        let mut wanted: Vec<TopicPartition> = Vec::new();
        for t in &r.topics {
            for p in &t.partitions {
                if let Ok(i) = u32::try_from(p.partition_index) {
                    wanted.push((t.name.to_string(), i));
                }
            }
        }
        let results = match self
            .groups
            .coordinator()
            .delete_offsets(&group, &wanted)
            .await
        {
            Ok(r) => r,
            Err(e) => {
                return OffsetDeleteResponse::default().with_error_code(group_code(&group, &e))
            }
        };
        let mut results = results.into_iter();
        OffsetDeleteResponse::default().with_topics(
            r.topics
                .into_iter()
                .map(|t| {
                    let partitions = t
                        .partitions
                        .iter()
                        .map(|p| {
                            let code = if p.partition_index < 0 {
                                ResponseError::UnknownTopicOrPartition.code()
                            } else {
                                match results.next() {
                                    Some(Err(e)) => kafka_code(e.code),
                                    _ => 0,
                                }
                            };
                            OffsetDeleteResponsePartition::default()
                                .with_partition_index(p.partition_index)
                                .with_error_code(code)
                        })
                        .collect();
                    OffsetDeleteResponseTopic::default()
                        .with_name(t.name)
                        .with_partitions(partitions)
                })
                .collect(),
        )
    }

    /// Answers DescribeGroups: classic groups with their members' metadata and
    /// assignments (when stable, as Kafka), consumer-protocol groups with their members'
    /// assignments in the `consumer` protocol's format; an unknown group is `Dead`.
    pub async fn describe_groups(&self, r: DescribeGroupsRequest) -> DescribeGroupsResponse {
        let mut groups = Vec::with_capacity(r.groups.len());
        for id in r.groups {
            let group = id.to_string();
            let answer = match self.groups.coordinator().describe(&group).await {
                Ok(d) => described(d),
                Err(e) if e.code == ErrorCode::GroupIdNotFound => DescribedGroup::default()
                    .with_group_state(s("Dead"))
                    .with_protocol_type(s("")),
                Err(e) => DescribedGroup::default().with_error_code(group_code(&group, &e)),
            };
            groups.push(
                answer
                    .with_group_id(id)
                    .with_authorized_operations(i32::MIN),
            );
        }
        DescribeGroupsResponse::default().with_groups(groups)
    }

    /// Answers ListGroups: the groups this broker coordinates (clients ask every broker),
    /// filtered by state (v4+) and type (v5+), case-insensitively.
    pub async fn list_groups(&self, r: ListGroupsRequest) -> ListGroupsResponse {
        let states: Vec<String> = r.states_filter.iter().map(|s| s.to_lowercase()).collect();
        let types: Vec<String> = r.types_filter.iter().map(|s| s.to_lowercase()).collect();
        let groups = self
            .groups
            .coordinator()
            .list()
            .await
            .into_iter()
            .filter(|g| {
                states.is_empty() || states.contains(&kafka_state(g.kind, &g.state).to_lowercase())
            })
            .filter(|g| types.is_empty() || types.iter().any(|t| t == g.kind))
            .map(|g| {
                ListedGroup::default()
                    .with_group_state(s(kafka_state(g.kind, &g.state)))
                    .with_group_id(GroupId(s(g.name)))
                    .with_protocol_type(s(g.protocol_type))
                    .with_group_type(s(g.kind))
            })
            .collect();
        ListGroupsResponse::default().with_groups(groups)
    }

    /// Answers DeleteGroups: each group without members loses its offsets.
    pub async fn delete_groups(&self, r: DeleteGroupsRequest) -> DeleteGroupsResponse {
        let mut results = Vec::with_capacity(r.groups_names.len());
        for id in r.groups_names {
            let group = id.to_string();
            let code = match self.groups.coordinator().delete(&group).await {
                Ok(()) => 0,
                Err(e) => group_code(&group, &e),
            };
            results.push(
                DeletableGroupResult::default()
                    .with_group_id(id)
                    .with_error_code(code),
            );
        }
        DeleteGroupsResponse::default().with_results(results)
    }

    /// Answers ConsumerGroupHeartbeat (KIP-848) with the same server-side assignment
    /// tidelog's clients get: partitions travel by topic id.
    pub async fn consumer_group_heartbeat(
        &self,
        r: ConsumerGroupHeartbeatRequest,
        client_id: &str,
    ) -> ConsumerGroupHeartbeatResponse {
        let group = r.group_id.to_string();
        let failed = |code: i16, message: String| {
            ConsumerGroupHeartbeatResponse::default()
                .with_error_code(code)
                .with_error_message(Some(s(message)))
        };
        let strategy = match r.server_assignor.as_deref() {
            None | Some("uniform") => "sticky".to_owned(),
            Some("range") => "range".to_owned(),
            Some(other) => {
                return failed(
                    ResponseError::UnsupportedAssignor.code(),
                    format!("server assignor '{other}' is not served: use uniform or range"),
                )
            }
        };
        let owned = r.topic_partitions.map(|tps| {
            self.node.metadata().read(|image| {
                tps.iter()
                    .filter_map(|t| Some((topic_name_of(image, t.topic_id)?, &t.partitions)))
                    .flat_map(|(name, ps)| {
                        ps.iter()
                            .filter_map(|p| u32::try_from(*p).ok())
                            .map(move |p| (name.clone(), p))
                    })
                    .collect::<BTreeSet<TopicPartition>>()
            })
        });
        let hb = Heartbeat {
            group: group.clone(),
            member_id: r.member_id.to_string(),
            member_epoch: r.member_epoch,
            instance_id: r.instance_id.map(|i| i.to_string()).unwrap_or_default(),
            client_id: client_id.to_owned(),
            topics: r
                .subscribed_topic_names
                .map(|ts| ts.into_iter().map(|t| t.to_string()).collect()),
            topic_regex: r.subscribed_topic_regex.map(|x| x.to_string()),
            strategy,
            broadcast: false,
            session_timeout_ms: 0,
            owned,
            rack: r.rack_id.map(|x| x.to_string()),
            // KIP-848 members do not tell their isolation level.
            read_committed: false,
        };
        match self.groups.coordinator().heartbeat(hb).await {
            Err(e) => failed(group_code(&group, &e), e.message),
            Ok(a) => {
                let assignment = self.node.metadata().read(|image| {
                    let mut by_topic: BTreeMap<&str, Vec<i32>> = BTreeMap::new();
                    for (t, p) in &a.assignment {
                        by_topic.entry(t).or_default().push(*p as i32);
                    }
                    by_topic
                        .into_iter()
                        .filter_map(|(t, ps)| {
                            let id = topic_uuid(&image.topics.get(t)?.id);
                            Some(
                                cgh::TopicPartitions::default()
                                    .with_topic_id(id)
                                    .with_partitions(ps),
                            )
                        })
                        .collect()
                });
                ConsumerGroupHeartbeatResponse::default()
                    .with_member_id(Some(s(a.member_id)))
                    .with_member_epoch(a.member_epoch)
                    .with_heartbeat_interval_ms(a.heartbeat_interval.as_millis() as i32)
                    .with_assignment(Some(
                        cgh::Assignment::default().with_topic_partitions(assignment),
                    ))
            }
        }
    }

    /// Answers ConsumerGroupDescribe; a classic group is GROUP_ID_NOT_FOUND here, as in
    /// Kafka (DescribeGroups describes it).
    pub async fn consumer_group_describe(
        &self,
        r: ConsumerGroupDescribeRequest,
    ) -> ConsumerGroupDescribeResponse {
        let mut groups = Vec::with_capacity(r.group_ids.len());
        for id in r.group_ids {
            let group = id.to_string();
            let answer = match self.groups.coordinator().describe(&group).await {
                Ok(d) if d.kind == "classic" => cgd::DescribedGroup::default()
                    .with_error_code(ResponseError::GroupIdNotFound.code())
                    .with_error_message(Some(s(format!("group '{group}' is a classic group")))),
                Ok(d) => self.consumer_described(d),
                Err(e) => cgd::DescribedGroup::default()
                    .with_error_code(group_code(&group, &e))
                    .with_error_message(Some(s(e.message))),
            };
            groups.push(
                answer
                    .with_group_id(id)
                    .with_authorized_operations(i32::MIN),
            );
        }
        ConsumerGroupDescribeResponse::default().with_groups(groups)
    }

    fn consumer_described(&self, d: GroupDescription) -> cgd::DescribedGroup {
        let assignment = |set: &BTreeSet<TopicPartition>| {
            self.node.metadata().read(|image| {
                let mut by_topic: BTreeMap<&str, Vec<i32>> = BTreeMap::new();
                for (t, p) in set {
                    by_topic.entry(t).or_default().push(*p as i32);
                }
                cgd::Assignment::default().with_topic_partitions(
                    by_topic
                        .into_iter()
                        .map(|(t, ps)| {
                            cgd::TopicPartitions::default()
                                .with_topic_id(
                                    image
                                        .topics
                                        .get(t)
                                        .map_or_else(uuid::Uuid::nil, |r| topic_uuid(&r.id)),
                                )
                                .with_topic_name(TopicName(s(t)))
                                .with_partitions(ps)
                        })
                        .collect(),
                )
            })
        };
        let (target_epoch, targets) = &d.targets;
        let members = d
            .consumer_members
            .iter()
            .map(|m| {
                cgd::Member::default()
                    .with_member_id(s(m.id.clone()))
                    .with_instance_id((!m.instance_id.is_empty()).then(|| s(m.instance_id.clone())))
                    .with_member_epoch(m.epoch)
                    .with_client_id(s(m.client_id.clone()))
                    .with_client_host(s(""))
                    .with_subscribed_topic_names(
                        m.topics.iter().map(|t| TopicName(s(t.clone()))).collect(),
                    )
                    .with_subscribed_topic_regex(m.regex.clone().map(s))
                    .with_assignment(assignment(&m.assignment))
                    .with_target_assignment(assignment(
                        targets.get(&m.key()).unwrap_or(&BTreeSet::new()),
                    ))
                    .with_member_type(1)
            })
            .collect();
        cgd::DescribedGroup::default()
            .with_group_state(s(consumer_state(&d.state)))
            .with_group_epoch(d.epoch)
            .with_assignment_epoch(*target_epoch)
            .with_assignor_name(s(d.strategy.to_string()))
            .with_members(members)
    }
}

/// A DescribeGroups entry for a described group.
fn described(d: GroupDescription) -> DescribedGroup {
    if d.kind == "classic" {
        let stable = d.state == "Stable";
        let (protocol_type, protocol) = d.protocol;
        let members = d
            .classic_members
            .into_iter()
            .map(|m| {
                let (metadata, assignment) = if stable {
                    (m.metadata(&protocol), m.assignment.clone())
                } else {
                    (Bytes::new(), Bytes::new())
                };
                DescribedGroupMember::default()
                    .with_member_id(s(m.id))
                    .with_group_instance_id(m.instance_id.map(s))
                    .with_client_id(s(m.client_id))
                    .with_client_host(s(m.client_host))
                    .with_member_metadata(metadata)
                    .with_member_assignment(assignment)
            })
            .collect();
        return DescribedGroup::default()
            .with_group_state(s(d.state))
            .with_protocol_type(s(protocol_type))
            .with_protocol_data(s(if stable { protocol } else { String::new() }))
            .with_members(members);
    }
    let members = d
        .consumer_members
        .iter()
        .map(|m| {
            DescribedGroupMember::default()
                .with_member_id(s(m.id.clone()))
                .with_group_instance_id(
                    (!m.instance_id.is_empty()).then(|| s(m.instance_id.clone())),
                )
                .with_client_id(s(m.client_id.clone()))
                .with_member_assignment(assignment_bytes(&m.assignment))
        })
        .collect();
    DescribedGroup::default()
        .with_group_state(s(consumer_state(&d.state)))
        .with_protocol_type(s("consumer"))
        .with_protocol_data(s(d.strategy.to_string()))
        .with_members(members)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::group::classic::consumer_assignment;

    #[test]
    fn consumer_protocol_assignments_round_trip() {
        let set: BTreeSet<TopicPartition> = [
            ("a".to_owned(), 0),
            ("a".to_owned(), 3),
            ("b".to_owned(), 1),
        ]
        .into();
        assert_eq!(consumer_assignment(&assignment_bytes(&set)), set);
        assert!(consumer_assignment(b"\x00").is_empty());
        assert!(consumer_assignment(b"\x00\x00\xff\xff\xff\x7f").is_empty());
        // A count of 2^31-1 with nothing behind it: an error, not an abort.
        assert!(consumer_assignment(b"\x00\x00\x00\x01\x7f\xff\xff\xff").is_empty());
        assert!(consumer_assignment(b"\x00\x00\x7f\xff\xff\xff").is_empty());
    }

    #[test]
    fn group_states_use_kafkas_names() {
        assert_eq!(kafka_state("consumer", "empty"), "Empty");
        assert_eq!(kafka_state("consumer", "reconciling"), "Reconciling");
        assert_eq!(
            kafka_state("classic", "PreparingRebalance"),
            "PreparingRebalance"
        );
    }
}
