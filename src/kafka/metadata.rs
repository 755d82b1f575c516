//! Metadata: brokers (their Kafka addresses), topics with ids, partitions with leaders,
//! epochs, replicas and ISR, from this broker's metadata cache, as the gRPC Metadata call
//! answers. Unknown topics are created first when `auto_create_topics_enable` and the
//! client allows it, through the same Admin path as a CreateTopics.

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::metadata_response::{
    MetadataResponseBroker, MetadataResponsePartition, MetadataResponseTopic,
};
use kafka_protocol::messages::{BrokerId, MetadataRequest, MetadataResponse, TopicName};
use kafka_protocol::protocol::StrBytes;

use super::KafkaHandler;
use crate::api::proto::admin_server::Admin;
use crate::api::proto::CreateTopicRequest;
use crate::controller::model::{MetadataImage, TopicRecord};
use crate::controller::validation;

/// `host:port` split for the wire (brackets of an IPv6 host removed); `None` when the
/// address has no numeric port.
pub fn host_port(address: &str) -> Option<(String, i32)> {
    let (host, port) = address.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host.to_owned(), i32::from(port)))
}

/// A topic id (a UUID string in the metadata) for the wire; nil when it does not parse.
pub fn topic_uuid(id: &str) -> uuid::Uuid {
    uuid::Uuid::parse_str(id).unwrap_or_default()
}

/// The name of the topic whose id is `id`, if this broker knows it.
pub fn topic_name_of(image: &MetadataImage, id: uuid::Uuid) -> Option<String> {
    image
        .topics
        .values()
        .find(|t| topic_uuid(&t.id) == id)
        .map(|t| t.name.clone())
}

fn topic_entry(t: &TopicRecord) -> MetadataResponseTopic {
    let partitions = t
        .partitions
        .iter()
        .map(|p| {
            let ids = |v: &[crate::types::BrokerId]| v.iter().map(|b| BrokerId(b.0)).collect();
            MetadataResponsePartition::default()
                .with_error_code(if p.leader.is_some() {
                    0
                } else {
                    ResponseError::LeaderNotAvailable.code()
                })
                .with_partition_index(p.partition as i32)
                .with_leader_id(BrokerId(p.leader.map_or(-1, |l| l.0)))
                .with_leader_epoch(p.leader_epoch)
                .with_replica_nodes(ids(&p.replicas))
                .with_isr_nodes(ids(&p.isr))
        })
        .collect();
    MetadataResponseTopic::default()
        .with_name(Some(TopicName(StrBytes::from_string(t.name.clone()))))
        .with_topic_id(topic_uuid(&t.id))
        .with_is_internal(validation::is_reserved_topic(&t.name))
        .with_partitions(partitions)
}

fn error_topic(name: String, error: ResponseError) -> MetadataResponseTopic {
    MetadataResponseTopic::default()
        .with_error_code(error.code())
        .with_name(Some(TopicName(StrBytes::from_string(name))))
}

impl KafkaHandler {
    /// Answers Metadata (v0: an empty topic list means every topic; v1+: null does).
    pub async fn metadata(&self, r: MetadataRequest, version: i16) -> MetadataResponse {
        let requested = match r.topics {
            None => None,
            Some(t) if t.is_empty() && version == 0 => None,
            Some(t) => Some(t),
        };
        // Topics named by id (v10+) are looked up; unknown ids are reported by id.
        let mut wanted: Option<Vec<Result<String, uuid::Uuid>>> = requested.map(|topics| {
            self.node.metadata().read(|image| {
                topics
                    .into_iter()
                    .map(|t| match t.name {
                        Some(name) => Ok(name.0.to_string()),
                        None => topic_name_of(image, t.topic_id).ok_or(t.topic_id),
                    })
                    .collect()
            })
        });
        let may_create = version < 4 || r.allow_auto_topic_creation;
        if let (true, true, Some(w)) = (self.auto_create, may_create, &wanted) {
            for name in w.iter().filter_map(|n| n.as_ref().ok()) {
                let creatable = !validation::is_reserved_topic(name)
                    && validation::validate_topic_name(name).is_ok()
                    && self.node.metadata().topic(name).is_none();
                if creatable {
                    let request = CreateTopicRequest {
                        name: name.clone(),
                        ..Default::default()
                    };
                    match self.admin.create_topic(tonic::Request::new(request)).await {
                        Ok(_) => {
                            tracing::info!(topic = %name, "auto-created topic (Kafka Metadata)")
                        }
                        Err(e) => {
                            tracing::debug!(topic = %name, error = %e.message(), "auto-create failed")
                        }
                    }
                }
            }
        }
        let me = self.node.id();
        self.node.metadata().read(|image| {
            let brokers: Vec<MetadataResponseBroker> = image
                .unfenced_brokers()
                .filter_map(|b| {
                    let (host, port) = host_port(b.kafka_address.as_deref()?)?;
                    Some(
                        MetadataResponseBroker::default()
                            .with_node_id(BrokerId(b.id.0))
                            .with_host(StrBytes::from_string(host))
                            .with_port(port)
                            .with_rack(b.rack.clone().map(StrBytes::from_string)),
                    )
                })
                .collect();
            let topics = match wanted.take() {
                None => image.topics.values().map(topic_entry).collect(),
                Some(w) => w
                    .into_iter()
                    .map(|n| match n {
                        Ok(name) => match image.topics.get(&name) {
                            Some(t) => topic_entry(t),
                            None if validation::validate_topic_name(&name).is_err() => {
                                error_topic(name, ResponseError::InvalidTopicException)
                            }
                            None => error_topic(name, ResponseError::UnknownTopicOrPartition),
                        },
                        Err(id) => MetadataResponseTopic::default()
                            .with_error_code(ResponseError::UnknownTopicId.code())
                            .with_topic_id(id),
                    })
                    .collect(),
            };
            MetadataResponse::default()
                .with_brokers(brokers)
                .with_cluster_id(image.cluster_id.clone().map(StrBytes::from_string))
                // Any broker takes admin requests (it forwards them to the controllers).
                .with_controller_id(BrokerId(me.0))
                .with_topics(topics)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_split_into_host_and_port() {
        assert_eq!(
            host_port("127.0.0.1:9092"),
            Some(("127.0.0.1".into(), 9092))
        );
        assert_eq!(host_port("[::1]:19092"), Some(("::1".into(), 19092)));
        assert_eq!(
            host_port("kafka.example:1"),
            Some(("kafka.example".into(), 1))
        );
        assert_eq!(host_port("nope"), None);
        assert_eq!(host_port("h:99999"), None);
    }
}
