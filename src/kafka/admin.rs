//! Topic administration and producer ids: CreateTopics, DeleteTopics, CreatePartitions,
//! DescribeConfigs and (non-transactional) InitProducerId. Changes go through the Admin
//! service that gRPC clients call on this broker, so they get the same checks (reserved
//! topics, names, placement limits), the same forwarding to the controllers and the same
//! wait until this broker has opened a new topic's partitions.

use std::collections::{BTreeMap, HashSet};

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::create_partitions_response::CreatePartitionsTopicResult;
use kafka_protocol::messages::create_topics_response::CreatableTopicResult;
use kafka_protocol::messages::delete_topics_response::DeletableTopicResult;
use kafka_protocol::messages::describe_configs_response::{
    DescribeConfigsResourceResult, DescribeConfigsResult,
};
use kafka_protocol::messages::{
    CreatePartitionsRequest, CreatePartitionsResponse, CreateTopicsRequest, CreateTopicsResponse,
    DeleteTopicsRequest, DeleteTopicsResponse, DescribeConfigsRequest, DescribeConfigsResponse,
    InitProducerIdRequest, InitProducerIdResponse, ProducerId, TopicName,
};
use kafka_protocol::protocol::StrBytes;
use tonic::Request;

use super::errors::kafka_code;
use super::metadata::{topic_name_of, topic_uuid};
use super::KafkaHandler;
use crate::api::proto::{self, admin_server::Admin};
use crate::api::status::code_of;
use crate::topic_config::TopicConfig;

/// DescribeConfigs resource types.
const RESOURCE_TOPIC: i8 = 2;
const RESOURCE_BROKER: i8 = 4;
/// DescribeConfigs config sources.
const SOURCE_DYNAMIC_TOPIC: i8 = 1;
const SOURCE_DEFAULT: i8 = 5;

fn text(s: String) -> Option<StrBytes> {
    Some(StrBytes::from_string(s))
}

/// The Kafka code and message of a failed Admin call.
fn failure(status: &tonic::Status) -> (i16, Option<StrBytes>) {
    (
        kafka_code(code_of(status)),
        text(status.message().to_owned()),
    )
}

impl KafkaHandler {
    /// InitProducerId: for an idempotent producer a fresh id (epoch 0) from the block
    /// this broker reserved; for a transactional one, from its coordinator.
    pub async fn init_producer_id(&self, r: InitProducerIdRequest) -> InitProducerIdResponse {
        let refused = InitProducerIdResponse::default()
            .with_producer_id(ProducerId(-1))
            .with_producer_epoch(-1);
        if let Some(id) = r.transactional_id.as_ref().filter(|t| !t.0.is_empty()) {
            return self.init_transactional_producer(&r, id.as_str()).await;
        }
        match self
            .admin
            .init_producer_id(Request::new(proto::InitProducerIdRequest {}))
            .await
        {
            Ok(r) => {
                let r = r.into_inner();
                InitProducerIdResponse::default()
                    .with_producer_id(ProducerId(r.producer_id))
                    .with_producer_epoch(r.producer_epoch as i16)
            }
            Err(status) => refused.with_error_code(failure(&status).0),
        }
    }

    /// CreateTopics (partition count and replication factor -1 take the defaults).
    pub async fn create_topics(&self, r: CreateTopicsRequest) -> CreateTopicsResponse {
        let mut seen = HashSet::new();
        let duplicates: HashSet<String> = r
            .topics
            .iter()
            .map(|t| t.name.0.to_string())
            .filter(|n| !seen.insert(n.clone()))
            .collect();
        let mut results = Vec::with_capacity(r.topics.len());
        for t in r.topics {
            let name = t.name.0.to_string();
            let result = CreatableTopicResult::default()
                .with_name(t.name.clone())
                .with_num_partitions(-1)
                .with_replication_factor(-1);
            let refuse = |code: i16, message: &str| {
                result
                    .clone()
                    .with_error_code(code)
                    .with_error_message(text(message.to_owned()))
            };
            if duplicates.contains(&name) {
                results.push(refuse(
                    ResponseError::InvalidRequest.code(),
                    "the topic is named more than once in this request",
                ));
                continue;
            }
            if !t.assignments.is_empty() {
                results.push(refuse(
                    ResponseError::InvalidReplicaAssignment.code(),
                    "explicit replica assignments are not supported; give a partition count and replication factor",
                ));
                continue;
            }
            let mut config = BTreeMap::new();
            for c in &t.configs {
                if let Some(v) = &c.value {
                    config.insert(c.name.to_string(), v.to_string());
                }
            }
            let request = proto::CreateTopicRequest {
                name: name.clone(),
                partitions: u32::try_from(t.num_partitions).ok(),
                replication_factor: u32::try_from(t.replication_factor).ok(),
                config: config.into_iter().collect(),
                validate_only: r.validate_only,
            };
            results.push(match self.admin.create_topic(Request::new(request)).await {
                Ok(response) => match response.into_inner().topic {
                    Some(state) => result
                        .with_topic_id(topic_uuid(&state.id))
                        .with_num_partitions(state.partitions.len() as i32)
                        .with_replication_factor(state.replication_factor as i16),
                    None => result,
                },
                Err(status) => {
                    let (code, message) = failure(&status);
                    result.with_error_code(code).with_error_message(message)
                }
            });
        }
        CreateTopicsResponse::default().with_topics(results)
    }

    /// DeleteTopics, by name (and by id from v6).
    pub async fn delete_topics(
        &self,
        r: DeleteTopicsRequest,
        version: i16,
    ) -> DeleteTopicsResponse {
        let named: Vec<(Option<String>, uuid::Uuid)> = if version >= 6 {
            self.node.metadata().read(|image| {
                r.topics
                    .iter()
                    .map(|t| match &t.name {
                        Some(n) => (Some(n.0.to_string()), t.topic_id),
                        None => (topic_name_of(image, t.topic_id), t.topic_id),
                    })
                    .collect()
            })
        } else {
            r.topic_names
                .iter()
                .map(|n| (Some(n.0.to_string()), uuid::Uuid::nil()))
                .collect()
        };
        let mut responses = Vec::with_capacity(named.len());
        for (name, id) in named {
            let result = DeletableTopicResult::default()
                .with_name(name.clone().map(|n| TopicName(StrBytes::from_string(n))))
                .with_topic_id(id);
            let Some(name) = name else {
                responses.push(result.with_error_code(ResponseError::UnknownTopicId.code()));
                continue;
            };
            let request = proto::DeleteTopicRequest { name };
            responses.push(match self.admin.delete_topic(Request::new(request)).await {
                Ok(_) => result,
                Err(status) => {
                    let (code, message) = failure(&status);
                    result.with_error_code(code).with_error_message(message)
                }
            });
        }
        DeleteTopicsResponse::default().with_responses(responses)
    }

    /// CreatePartitions: raises partition counts (explicit assignments are refused).
    pub async fn create_partitions(&self, r: CreatePartitionsRequest) -> CreatePartitionsResponse {
        let mut results = Vec::with_capacity(r.topics.len());
        for t in r.topics {
            let name = t.name.0.to_string();
            let result = CreatePartitionsTopicResult::default().with_name(t.name.clone());
            if t.assignments.is_some() {
                results.push(
                    result
                        .with_error_code(ResponseError::InvalidReplicaAssignment.code())
                        .with_error_message(text(
                            "explicit replica assignments are not supported".to_owned(),
                        )),
                );
                continue;
            }
            let Ok(count) = u32::try_from(t.count) else {
                results.push(result.with_error_code(ResponseError::InvalidPartitions.code()));
                continue;
            };
            if r.validate_only {
                // Nothing to change: check what the Admin service would refuse first.
                let current = self
                    .node
                    .metadata()
                    .topic(&name)
                    .map(|t| t.partitions.len());
                let code = match current {
                    None => ResponseError::UnknownTopicOrPartition.code(),
                    Some(n) if count as usize <= n => ResponseError::InvalidPartitions.code(),
                    Some(_) => 0,
                };
                results.push(result.with_error_code(code));
                continue;
            }
            let request = proto::AlterTopicRequest {
                name,
                partitions: Some(count),
                ..Default::default()
            };
            results.push(match self.admin.alter_topic(Request::new(request)).await {
                Ok(_) => result,
                Err(status) => {
                    let (code, message) = failure(&status);
                    result.with_error_code(code).with_error_message(message)
                }
            });
        }
        CreatePartitionsResponse::default().with_results(results)
    }

    /// DescribeConfigs: a topic's effective settings (its overrides marked as dynamic
    /// topic configs, the rest as defaults); brokers have none to show yet.
    pub fn describe_configs(&self, r: DescribeConfigsRequest) -> DescribeConfigsResponse {
        let results = r
            .resources
            .into_iter()
            .map(|res| {
                let result = DescribeConfigsResult::default()
                    .with_resource_type(res.resource_type)
                    .with_resource_name(res.resource_name.clone());
                match res.resource_type {
                    RESOURCE_BROKER => result,
                    RESOURCE_TOPIC => {
                        let Some(topic) = self.node.metadata().topic(&res.resource_name) else {
                            return result
                                .with_error_code(ResponseError::UnknownTopicOrPartition.code())
                                .with_error_message(text(format!(
                                    "topic '{}' does not exist",
                                    &*res.resource_name
                                )));
                        };
                        let effective = TopicConfig::from_pairs(
                            topic.config.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                        )
                        .unwrap_or_default()
                        .to_pairs();
                        let wanted = |k: &str| {
                            res.configuration_keys
                                .as_ref()
                                .is_none_or(|keys| keys.iter().any(|w| &**w == k))
                        };
                        let configs = effective
                            .into_iter()
                            .filter(|(k, _)| wanted(k))
                            .map(|(k, v)| {
                                let source = if topic.config.contains_key(&k) {
                                    SOURCE_DYNAMIC_TOPIC
                                } else {
                                    SOURCE_DEFAULT
                                };
                                DescribeConfigsResourceResult::default()
                                    .with_name(StrBytes::from_string(k))
                                    .with_value(text(v))
                                    .with_config_source(source)
                            })
                            .collect();
                        result.with_configs(configs)
                    }
                    _ => result
                        .with_error_code(ResponseError::InvalidRequest.code())
                        .with_error_message(text(
                            "only topic and broker resources are supported".to_owned(),
                        )),
                }
            })
            .collect();
        DescribeConfigsResponse::default().with_results(results)
    }
}
