//! Conversions between the controller's model and the proto types.

use crate::api::proto;
use crate::controller::model::{
    BrokerRecord, BrokerState, MetadataChange, MetadataImage, PartitionRecord, TopicRecord,
};
use crate::types::BrokerId;

fn ids(v: &[BrokerId]) -> Vec<i32> {
    v.iter().map(|b| b.0).collect()
}

fn broker_ids(v: &[i32]) -> Vec<BrokerId> {
    v.iter().map(|b| BrokerId(*b)).collect()
}

/// A partition on the wire.
pub fn partition_to_proto(p: &PartitionRecord) -> proto::PartitionState {
    proto::PartitionState {
        partition: p.partition,
        leader: p.leader.map(|b| b.0),
        leader_epoch: p.leader_epoch,
        replicas: ids(&p.replicas),
        isr: ids(&p.isr),
        partition_epoch: p.partition_epoch,
        adding_replicas: ids(&p.adding_replicas),
        removing_replicas: ids(&p.removing_replicas),
        offline_replicas: ids(&p.offline_replicas),
    }
}

/// A partition from the wire.
pub fn partition_from_proto(p: &proto::PartitionState) -> PartitionRecord {
    PartitionRecord {
        partition: p.partition,
        replicas: broker_ids(&p.replicas),
        isr: broker_ids(&p.isr),
        leader: p.leader.map(BrokerId),
        leader_epoch: p.leader_epoch,
        partition_epoch: p.partition_epoch,
        adding_replicas: broker_ids(&p.adding_replicas),
        removing_replicas: broker_ids(&p.removing_replicas),
        offline_replicas: broker_ids(&p.offline_replicas),
    }
}

/// A topic on the wire.
pub fn topic_to_proto(t: &TopicRecord) -> proto::TopicState {
    proto::TopicState {
        name: t.name.clone(),
        id: t.id.clone(),
        replication_factor: t.replication_factor,
        config: t.config.clone(),
        partitions: t.partitions.iter().map(partition_to_proto).collect(),
    }
}

/// A topic from the wire.
pub fn topic_from_proto(t: &proto::TopicState) -> TopicRecord {
    TopicRecord {
        id: t.id.clone(),
        name: t.name.clone(),
        replication_factor: t.replication_factor,
        config: t.config.clone(),
        partitions: t.partitions.iter().map(partition_from_proto).collect(),
    }
}

/// A broker on the wire.
pub fn broker_to_proto(b: &BrokerRecord) -> proto::BrokerState {
    proto::BrokerState {
        id: b.id.0,
        address: b.address.clone(),
        rack: b.rack.clone(),
        incarnation_id: b.incarnation_id.clone(),
        epoch: b.epoch,
        state: b.state.as_str().to_owned(),
        internal_address: b.internal_address.clone(),
        kafka_address: b.kafka_address.clone(),
    }
}

/// A broker from the wire (an unknown state reads as fenced).
pub fn broker_from_proto(b: &proto::BrokerState) -> BrokerRecord {
    BrokerRecord {
        id: BrokerId(b.id),
        address: b.address.clone(),
        rack: b.rack.clone(),
        internal_address: b.internal_address.clone(),
        kafka_address: b.kafka_address.clone(),
        incarnation_id: b.incarnation_id.clone(),
        epoch: b.epoch,
        state: match b.state.as_str() {
            "unfenced" => BrokerState::Unfenced,
            "shutting_down" => BrokerState::ShuttingDown,
            _ => BrokerState::Fenced,
        },
    }
}

/// A whole image on the wire.
pub fn image_to_proto(image: &MetadataImage) -> proto::MetadataImage {
    proto::MetadataImage {
        cluster_id: image.cluster_id.clone().unwrap_or_default(),
        brokers: image.brokers.values().map(broker_to_proto).collect(),
        topics: image.topics.values().map(topic_to_proto).collect(),
    }
}

/// A whole image from the wire.
pub fn image_from_proto(image: &proto::MetadataImage) -> MetadataImage {
    MetadataImage {
        cluster_id: (!image.cluster_id.is_empty()).then(|| image.cluster_id.clone()),
        brokers: image
            .brokers
            .iter()
            .map(|b| (BrokerId(b.id), broker_from_proto(b)))
            .collect(),
        topics: image
            .topics
            .iter()
            .map(|t| (t.name.clone(), topic_from_proto(t)))
            .collect(),
        // Producer ids are handed out by the controllers only; brokers never need it.
        next_producer_id: 0,
    }
}

/// One change on the wire.
pub fn change_to_proto(version: u64, change: &MetadataChange) -> proto::MetadataChange {
    use proto::metadata_change::Change;
    let change = match change {
        MetadataChange::ClusterId(id) => Change::ClusterId(id.clone()),
        MetadataChange::Broker(b) => Change::Broker(broker_to_proto(b)),
        MetadataChange::Topic(t) => Change::Topic(topic_to_proto(t)),
        MetadataChange::TopicDeleted { name, id } => Change::TopicDeleted(proto::TopicDeleted {
            name: name.clone(),
            id: id.clone(),
        }),
        MetadataChange::Partition {
            topic,
            topic_id,
            partition,
        } => Change::Partition(proto::PartitionChanged {
            topic: topic.clone(),
            topic_id: topic_id.clone(),
            partition: Some(partition_to_proto(partition)),
        }),
    };
    proto::MetadataChange {
        version,
        change: Some(change),
    }
}

/// One change from the wire; `None` when the message carries no change.
pub fn change_from_proto(c: &proto::MetadataChange) -> Option<MetadataChange> {
    use proto::metadata_change::Change;
    Some(match c.change.as_ref()? {
        Change::ClusterId(id) => MetadataChange::ClusterId(id.clone()),
        Change::Broker(b) => MetadataChange::Broker(broker_from_proto(b)),
        Change::Topic(t) => MetadataChange::Topic(topic_from_proto(t)),
        Change::TopicDeleted(d) => MetadataChange::TopicDeleted {
            name: d.name.clone(),
            id: d.id.clone(),
        },
        Change::Partition(p) => MetadataChange::Partition {
            topic: p.topic.clone(),
            topic_id: p.topic_id.clone(),
            partition: partition_from_proto(p.partition.as_ref()?),
        },
    })
}

/// The ListTopics answer for `image` at `version`.
pub fn list_topics_response(image: &MetadataImage, version: u64) -> proto::ListTopicsResponse {
    proto::ListTopicsResponse {
        topics: image
            .topics
            .values()
            .map(|t| proto::TopicSummary {
                name: t.name.clone(),
                id: t.id.clone(),
                partitions: t.partitions.len() as u32,
                replication_factor: t.replication_factor,
            })
            .collect(),
        metadata_version: version,
    }
}

/// The DescribeTopics answer for `names` (every topic when empty) from `image` at
/// `version`, without offsets; `Err` names the first topic that does not exist.
pub fn describe_topics_response(
    image: &MetadataImage,
    version: u64,
    names: &[String],
) -> Result<proto::DescribeTopicsResponse, String> {
    let topics: Vec<&TopicRecord> = if names.is_empty() {
        image.topics.values().collect()
    } else {
        names
            .iter()
            .map(|n| {
                image
                    .topics
                    .get(n)
                    .ok_or_else(|| format!("topic '{n}' does not exist"))
            })
            .collect::<Result<_, _>>()?
    };
    Ok(proto::DescribeTopicsResponse {
        topics: topics
            .into_iter()
            .map(|t| proto::TopicDescription {
                topic: Some(topic_to_proto(t)),
                offsets: Vec::new(),
                scheduled: Vec::new(),
            })
            .collect(),
        metadata_version: version,
    })
}
