//! Cluster administration over Kafka's protocol: AlterConfigs and IncrementalAlterConfigs
//! (topic configs), DescribeCluster, ElectLeaders (preferred), AlterPartitionReassignments
//! and ListPartitionReassignments, DeleteRecords. Changes go through the Admin service
//! gRPC clients call, so they get the same validation; DeleteRecords moves the leader's
//! log start, which followers take over as they fetch.

use std::collections::{BTreeMap, BTreeSet};

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::alter_configs_response::AlterConfigsResourceResponse as AlterResult;
use kafka_protocol::messages::alter_partition_reassignments_response::{
    ReassignablePartitionResponse, ReassignableTopicResponse,
};
use kafka_protocol::messages::delete_records_response::{
    DeleteRecordsPartitionResult, DeleteRecordsTopicResult,
};
use kafka_protocol::messages::describe_cluster_response::DescribeClusterBroker;
use kafka_protocol::messages::elect_leaders_response::{PartitionResult, ReplicaElectionResult};
use kafka_protocol::messages::incremental_alter_configs_response::AlterConfigsResourceResponse as IncrementalResult;
use kafka_protocol::messages::list_partition_reassignments_response::{
    OngoingPartitionReassignment, OngoingTopicReassignment,
};
use kafka_protocol::messages::{
    AlterConfigsRequest, AlterConfigsResponse, AlterPartitionReassignmentsRequest,
    AlterPartitionReassignmentsResponse, BrokerId, DeleteRecordsRequest, DeleteRecordsResponse,
    DescribeClusterRequest, DescribeClusterResponse, ElectLeadersRequest, ElectLeadersResponse,
    IncrementalAlterConfigsRequest, IncrementalAlterConfigsResponse,
    ListPartitionReassignmentsRequest, ListPartitionReassignmentsResponse, TopicName,
};
use kafka_protocol::protocol::StrBytes;
use tonic::Request;

use super::errors::kafka_code;
use super::metadata::host_port;
use super::KafkaHandler;
use crate::api::proto::{self, admin_server::Admin};
use crate::api::status::code_of;
use crate::broker::BrokerError;
use crate::error_code::ErrorCode;
use crate::topic_config::TopicConfig;
use crate::types::Offset;

/// Config resource type of a topic.
const RESOURCE_TOPIC: i8 = 2;
/// IncrementalAlterConfigs operations.
const OP_SET: i8 = 0;
const OP_DELETE: i8 = 1;
/// ElectLeaders election type of a preferred-replica election.
const ELECTION_PREFERRED: i8 = 0;

fn text(s: impl Into<String>) -> Option<StrBytes> {
    Some(StrBytes::from_string(s.into()))
}

/// A topic config change: keys to set, keys to delete.
type ConfigChange = (BTreeMap<String, String>, Vec<String>);

impl KafkaHandler {
    /// Applies (or with `validate_only`, checks) a topic config change; the Kafka error
    /// and message on failure.
    async fn change_topic_config(
        &self,
        resource_type: i8,
        topic: &str,
        change: Result<ConfigChange, String>,
        validate_only: bool,
    ) -> Result<(), (i16, String)> {
        if resource_type != RESOURCE_TOPIC {
            return Err((
                ResponseError::InvalidRequest.code(),
                "only topic configs can be altered (broker configs are static: set them in the config file)".to_owned(),
            ));
        }
        let (set, delete) = change.map_err(|m| (ResponseError::InvalidConfig.code(), m))?;
        let Some(current) = self.node.metadata().topic(topic) else {
            return Err((
                ResponseError::UnknownTopicOrPartition.code(),
                format!("topic '{topic}' does not exist"),
            ));
        };
        // Check the result as the controllers will, so validate-only answers truly.
        let mut after = current.config.clone();
        for k in &delete {
            after.remove(k);
        }
        after.extend(set.clone());
        TopicConfig::from_pairs(after.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .map_err(|e| (ResponseError::InvalidConfig.code(), e.to_string()))?;
        if validate_only {
            return Ok(());
        }
        let request = proto::AlterTopicRequest {
            name: topic.to_owned(),
            set_config: set.into_iter().collect(),
            delete_config: delete,
            ..Default::default()
        };
        self.admin
            .alter_topic(Request::new(request))
            .await
            .map(|_| ())
            .map_err(|s| (kafka_code(code_of(&s)), s.message().to_owned()))
    }

    /// IncrementalAlterConfigs: SET and DELETE of topic configs (APPEND and SUBTRACT apply
    /// to list-valued configs, which topics do not have).
    pub async fn incremental_alter_configs(
        &self,
        r: IncrementalAlterConfigsRequest,
    ) -> IncrementalAlterConfigsResponse {
        let mut responses = Vec::with_capacity(r.resources.len());
        for res in r.resources {
            let mut set = BTreeMap::new();
            let mut delete = Vec::new();
            let mut bad = None;
            for c in &res.configs {
                match (c.config_operation, &c.value) {
                    (OP_SET, Some(v)) => {
                        set.insert(c.name.to_string(), v.to_string());
                    }
                    (OP_DELETE, _) => delete.push(c.name.to_string()),
                    (OP_SET, None) => bad = Some(format!("SET of '{}' has no value", &*c.name)),
                    (op, _) => {
                        bad = Some(format!(
                            "operation {op} on '{}' is not supported (topic configs take SET and DELETE)",
                            &*c.name
                        ))
                    }
                }
            }
            let change = match bad {
                Some(m) => Err(m),
                None => Ok((set, delete)),
            };
            let outcome = self
                .change_topic_config(
                    res.resource_type,
                    &res.resource_name,
                    change,
                    r.validate_only,
                )
                .await;
            let result = IncrementalResult::default()
                .with_resource_type(res.resource_type)
                .with_resource_name(res.resource_name);
            responses.push(match outcome {
                Ok(()) => result,
                Err((code, m)) => result.with_error_code(code).with_error_message(text(m)),
            });
        }
        IncrementalAlterConfigsResponse::default().with_responses(responses)
    }

    /// AlterConfigs: the resource's configs become exactly those given (others return to
    /// their defaults).
    pub async fn alter_configs(&self, r: AlterConfigsRequest) -> AlterConfigsResponse {
        let mut responses = Vec::with_capacity(r.resources.len());
        for res in r.resources {
            let set: BTreeMap<String, String> = res
                .configs
                .iter()
                .filter_map(|c| Some((c.name.to_string(), c.value.as_ref()?.to_string())))
                .collect();
            let delete: Vec<String> = self
                .node
                .metadata()
                .topic(&res.resource_name)
                .map(|t| {
                    t.config
                        .keys()
                        .filter(|k| !set.contains_key(*k))
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            let outcome = self
                .change_topic_config(
                    res.resource_type,
                    &res.resource_name,
                    Ok((set, delete)),
                    r.validate_only,
                )
                .await;
            let result = AlterResult::default()
                .with_resource_type(res.resource_type)
                .with_resource_name(res.resource_name);
            responses.push(match outcome {
                Ok(()) => result,
                Err((code, m)) => result.with_error_code(code).with_error_message(text(m)),
            });
        }
        AlterConfigsResponse::default().with_responses(responses)
    }

    /// DescribeCluster: the live brokers' Kafka addresses (with fenced ones when asked),
    /// the cluster id; this broker stands in as the controller (it forwards).
    pub fn describe_cluster(&self, r: DescribeClusterRequest) -> DescribeClusterResponse {
        let me = self.node.id();
        self.node.metadata().read(|image| {
            let brokers = image
                .brokers
                .values()
                .filter(|b| {
                    r.include_fenced_brokers
                        || b.state == crate::controller::model::BrokerState::Unfenced
                })
                .filter_map(|b| {
                    let (host, port) = host_port(b.kafka_address.as_deref()?)?;
                    Some(
                        DescribeClusterBroker::default()
                            .with_broker_id(BrokerId(b.id.0))
                            .with_host(StrBytes::from_string(host))
                            .with_port(port)
                            .with_rack(b.rack.clone().map(StrBytes::from_string))
                            .with_is_fenced(
                                b.state != crate::controller::model::BrokerState::Unfenced,
                            ),
                    )
                })
                .collect();
            DescribeClusterResponse::default()
                .with_endpoint_type(1)
                .with_cluster_id(StrBytes::from_string(
                    image.cluster_id.clone().unwrap_or_default(),
                ))
                .with_controller_id(BrokerId(me.0))
                .with_brokers(brokers)
                .with_cluster_authorized_operations(i32::MIN)
        })
    }

    /// ElectLeaders (preferred only): each partition's first replica takes the lead where
    /// it is alive and in sync. Per partition: success, ELECTION_NOT_NEEDED when it
    /// already led, PREFERRED_LEADER_NOT_AVAILABLE when it still does not.
    pub async fn elect_leaders(&self, r: ElectLeadersRequest) -> ElectLeadersResponse {
        if r.election_type != ELECTION_PREFERRED {
            return ElectLeadersResponse::default()
                .with_error_code(ResponseError::InvalidRequest.code());
        }
        // The partitions asked for (null: all), with whether their preferred replica led.
        let leaders = |wanted: &Option<Vec<(String, Vec<i32>)>>| {
            self.node.metadata().read(|image| {
                let mut out: BTreeMap<String, Vec<(i32, Option<bool>)>> = BTreeMap::new();
                let preferred_leads = |t: &str, p: i32| {
                    let rec = image
                        .topics
                        .get(t)?
                        .partitions
                        .get(usize::try_from(p).ok()?)?;
                    Some(rec.leader.is_some() && rec.leader == rec.replicas.first().copied())
                };
                match wanted {
                    None => {
                        for t in image.topics.values() {
                            out.insert(
                                t.name.clone(),
                                (0..t.partitions.len() as i32)
                                    .map(|p| (p, preferred_leads(&t.name, p)))
                                    .collect(),
                            );
                        }
                    }
                    Some(w) => {
                        for (t, ps) in w {
                            out.insert(
                                t.clone(),
                                ps.iter().map(|p| (*p, preferred_leads(t, *p))).collect(),
                            );
                        }
                    }
                }
                out
            })
        };
        let wanted: Option<Vec<(String, Vec<i32>)>> = r.topic_partitions.map(|tps| {
            tps.into_iter()
                .map(|t| (t.topic.to_string(), t.partitions))
                .collect()
        });
        let before = leaders(&wanted);
        let topics: Vec<String> = before
            .iter()
            .filter(|(_, ps)| ps.iter().any(|(_, led)| *led == Some(false)))
            .map(|(t, _)| t.clone())
            .collect();
        let mut failure = None;
        if !topics.is_empty() {
            let request = proto::ElectLeadersRequest { topics };
            if let Err(s) = self.admin.elect_leaders(Request::new(request)).await {
                failure = Some((kafka_code(code_of(&s)), s.message().to_owned()));
            }
        }
        let after = leaders(&wanted);
        let results = before
            .into_iter()
            .map(|(t, ps)| {
                let now = after.get(&t);
                let partition_result = ps
                    .into_iter()
                    .map(|(p, led)| {
                        let leads = now
                            .and_then(|n| n.iter().find(|(q, _)| *q == p))
                            .and_then(|(_, l)| *l);
                        let (code, message) = match (led, leads, &failure) {
                            (None, _, _) => (
                                ResponseError::UnknownTopicOrPartition.code(),
                                format!("{t}-{p} does not exist"),
                            ),
                            (Some(true), _, _) => (
                                ResponseError::ElectionNotNeeded.code(),
                                "the preferred replica already leads".to_owned(),
                            ),
                            (_, Some(true), _) => (0, String::new()),
                            (_, _, Some((code, m))) => (*code, m.clone()),
                            _ => (
                                ResponseError::PreferredLeaderNotAvailable.code(),
                                "the preferred replica is not alive and in sync".to_owned(),
                            ),
                        };
                        PartitionResult::default()
                            .with_partition_id(p)
                            .with_error_code(code)
                            .with_error_message((code != 0).then(|| StrBytes::from_string(message)))
                    })
                    .collect();
                ReplicaElectionResult::default()
                    .with_topic(TopicName(StrBytes::from_string(t)))
                    .with_partition_result(partition_result)
            })
            .collect();
        ElectLeadersResponse::default().with_replica_election_results(results)
    }

    /// AlterPartitionReassignments: moves partitions to new replica sets (cancelling a
    /// reassignment is refused: tidelog finishes what it started).
    pub async fn alter_partition_reassignments(
        &self,
        r: AlterPartitionReassignmentsRequest,
    ) -> AlterPartitionReassignmentsResponse {
        let mut responses = Vec::with_capacity(r.topics.len());
        for t in r.topics {
            let name = t.name.to_string();
            let mut moves = Vec::new();
            let mut answers: Vec<(i32, Option<(i16, String)>)> = Vec::new();
            for p in &t.partitions {
                match (&p.replicas, u32::try_from(p.partition_index)) {
                    (None, _) => answers.push((
                        p.partition_index,
                        Some((
                            ResponseError::NoReassignmentInProgress.code(),
                            "cancelling a reassignment is not supported".to_owned(),
                        )),
                    )),
                    (Some(_), Err(_)) => answers.push((
                        p.partition_index,
                        Some((ResponseError::UnknownTopicOrPartition.code(), String::new())),
                    )),
                    (Some(replicas), Ok(index)) => {
                        moves.push(proto::PartitionReassignment {
                            partition: index,
                            replicas: replicas.iter().map(|b| b.0).collect(),
                        });
                        answers.push((p.partition_index, None));
                    }
                }
            }
            let outcome = if moves.is_empty() {
                None
            } else {
                let request = proto::AlterTopicRequest {
                    name,
                    reassignments: moves,
                    ..Default::default()
                };
                self.admin
                    .alter_topic(Request::new(request))
                    .await
                    .err()
                    .map(|s| (kafka_code(code_of(&s)), s.message().to_owned()))
            };
            let partitions = answers
                .into_iter()
                .map(|(i, own)| {
                    let (code, message) = own.or_else(|| outcome.clone()).unwrap_or_default();
                    ReassignablePartitionResponse::default()
                        .with_partition_index(i)
                        .with_error_code(code)
                        .with_error_message((code != 0).then(|| StrBytes::from_string(message)))
                })
                .collect();
            responses.push(
                ReassignableTopicResponse::default()
                    .with_name(t.name)
                    .with_partitions(partitions),
            );
        }
        AlterPartitionReassignmentsResponse::default().with_responses(responses)
    }

    /// ListPartitionReassignments: partitions with replicas being added or removed.
    pub fn list_partition_reassignments(
        &self,
        r: ListPartitionReassignmentsRequest,
    ) -> ListPartitionReassignmentsResponse {
        let wanted: Option<BTreeMap<String, BTreeSet<i32>>> = r.topics.map(|ts| {
            ts.into_iter()
                .map(|t| {
                    (
                        t.name.to_string(),
                        t.partition_indexes.into_iter().collect(),
                    )
                })
                .collect()
        });
        let topics = self.node.metadata().read(|image| {
            image
                .topics
                .values()
                .filter(|t| wanted.as_ref().is_none_or(|w| w.contains_key(&t.name)))
                .filter_map(|t| {
                    let partitions: Vec<OngoingPartitionReassignment> = t
                        .partitions
                        .iter()
                        .filter(|p| {
                            !p.adding_replicas.is_empty() || !p.removing_replicas.is_empty()
                        })
                        .filter(|p| {
                            wanted.as_ref().is_none_or(|w| {
                                w.get(&t.name)
                                    .is_some_and(|ps| ps.contains(&(p.partition as i32)))
                            })
                        })
                        .map(|p| {
                            let ids = |v: &[crate::types::BrokerId]| {
                                v.iter().map(|b| BrokerId(b.0)).collect()
                            };
                            OngoingPartitionReassignment::default()
                                .with_partition_index(p.partition as i32)
                                .with_replicas(ids(&p.replicas))
                                .with_adding_replicas(ids(&p.adding_replicas))
                                .with_removing_replicas(ids(&p.removing_replicas))
                        })
                        .collect();
                    (!partitions.is_empty()).then(|| {
                        OngoingTopicReassignment::default()
                            .with_name(TopicName(StrBytes::from_string(t.name.clone())))
                            .with_partitions(partitions)
                    })
                })
                .collect()
        });
        ListPartitionReassignmentsResponse::default().with_topics(topics)
    }

    /// DeleteRecords: moves each partition's log start up to the offset (-1: the high
    /// watermark) on its leader; the answer is the new log start.
    pub async fn delete_records(&self, r: DeleteRecordsRequest) -> DeleteRecordsResponse {
        let mut topics = Vec::with_capacity(r.topics.len());
        for t in r.topics {
            let name = t.name.to_string();
            let mut partitions = Vec::with_capacity(t.partitions.len());
            for p in t.partitions {
                let answer = DeleteRecordsPartitionResult::default()
                    .with_partition_index(p.partition_index)
                    .with_low_watermark(-1);
                partitions.push(
                    match self
                        .delete_records_of(&name, p.partition_index, p.offset)
                        .await
                    {
                        Ok(start) => answer.with_low_watermark(start),
                        Err(code) => answer.with_error_code(code),
                    },
                );
            }
            topics.push(
                DeleteRecordsTopicResult::default()
                    .with_name(t.name)
                    .with_partitions(partitions),
            );
        }
        DeleteRecordsResponse::default().with_topics(topics)
    }

    async fn delete_records_of(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
    ) -> Result<i64, i16> {
        let partition =
            u32::try_from(partition).map_err(|_| ResponseError::UnknownTopicOrPartition.code())?;
        let (local, _) = self
            .node
            .leader_partition(topic, partition)
            .map_err(|e| kafka_code(e.code))?;
        let hw = local.log.high_watermark().as_i64();
        let target = match offset {
            -1 => hw,
            o if (0..=hw).contains(&o) => o,
            _ => return Err(ResponseError::OffsetOutOfRange.code()),
        };
        tokio::task::spawn_blocking(move || {
            local
                .log
                .advance_log_start(Offset(target as u64))
                .map(|s| s.as_i64())
                .map_err(|e| kafka_code(BrokerError::from_log(&local.name(), e).code))
        })
        .await
        .unwrap_or(Err(kafka_code(ErrorCode::UnknownServerError)))
    }
}
