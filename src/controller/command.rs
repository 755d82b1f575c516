//! The typed commands of the metadata state machine: every change to cluster metadata is
//! one of these, committed through Raft and applied by [`super::model::MetadataImage::apply`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::MetadataError;
use super::model::PartitionRecord;
use crate::types::BrokerId;

/// A change to the metadata, as stored in the Raft log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetadataCommand {
    /// Sets the cluster id if none is set (proposed by the first leader).
    InitCluster {
        /// A new UUID.
        cluster_id: String,
    },
    /// A broker process starts; a new incarnation fences the previous process's
    /// leaderships. The broker starts fenced; its epoch is this entry's log index.
    RegisterBroker {
        /// The broker's id.
        id: BrokerId,
        /// Where it serves.
        address: String,
        /// Its rack.
        rack: Option<String>,
        /// Unique per process start.
        incarnation_id: String,
        /// Its internal listener (replication).
        #[serde(default)]
        internal_address: String,
        /// Its Kafka listener, if it serves one.
        #[serde(default)]
        kafka_address: Option<String>,
    },
    /// The broker is ready: it may lead, and takes leaderless partitions it is eligible for.
    UnfenceBroker {
        /// The broker.
        id: BrokerId,
        /// Its registration epoch.
        epoch: u64,
    },
    /// The broker missed its session timeout (or finished a controlled shutdown).
    FenceBroker {
        /// The broker.
        id: BrokerId,
        /// Its registration epoch.
        epoch: u64,
    },
    /// The broker is stopping: move its leaderships to other in-sync replicas.
    BeginControlledShutdown {
        /// The broker.
        id: BrokerId,
        /// Its registration epoch.
        epoch: u64,
    },
    /// A broker's full list of replicas it holds but cannot serve (damaged data, failed
    /// storage): they leave ISRs and leaderships; replicas missing from the list are
    /// usable again.
    SetOfflineReplicas {
        /// The broker.
        id: BrokerId,
        /// Its registration epoch.
        epoch: u64,
        /// Its offline replicas.
        replicas: Vec<ReplicaRef>,
    },
    /// Creates a topic with a placement computed by the leader.
    CreateTopic {
        /// The topic's name.
        name: String,
        /// A new UUID.
        id: String,
        /// Replicas per partition.
        replication_factor: u32,
        /// Validated per-topic configuration.
        config: BTreeMap<String, String>,
        /// Each partition's replicas, the preferred leader first.
        assignments: Vec<Vec<BrokerId>>,
    },
    /// Adds partitions to a topic and/or replaces its configuration, atomically.
    AlterTopic {
        /// The topic's name.
        topic: String,
        /// The topic's id (guards against a delete and re-create in between).
        topic_id: String,
        /// The whole new configuration, when it changes.
        config: Option<BTreeMap<String, String>>,
        /// Replicas of the partitions to append (none: the count stays).
        new_partitions: Vec<Vec<BrokerId>>,
    },
    /// Deletes a topic.
    DeleteTopic {
        /// The topic's name.
        name: String,
        /// The topic's id.
        id: String,
    },
    /// A partition leader changes its ISR.
    AlterPartition {
        /// The leader asking.
        broker_id: BrokerId,
        /// Its registration epoch.
        broker_epoch: u64,
        /// The topic.
        topic: String,
        /// The topic's id.
        topic_id: String,
        /// The partition.
        partition: u32,
        /// The leader epoch the leader holds.
        leader_epoch: i32,
        /// The partition epoch the leader holds.
        partition_epoch: i32,
        /// The proposed ISR.
        new_isr: Vec<BrokerId>,
    },
    /// Moves partitions to new replica sets: targets join as replicas, and once all of a
    /// partition's targets are in its ISR the others leave.
    ReassignPartitions {
        /// The topic.
        topic: String,
        /// The topic's id.
        topic_id: String,
        /// The partitions to move.
        reassignments: Vec<Reassignment>,
    },
    /// Hands out `count` idempotent producer ids (the first is returned).
    AllocateProducerIds {
        /// How many.
        count: u32,
    },
    /// Hands leadership to each partition's preferred replica where it is live and in
    /// sync (Kafka's preferred leader election).
    ElectPreferredLeaders {
        /// The topics to consider; empty for all.
        topics: Vec<String>,
    },
}

/// One partition of a topic, named by the topic's id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ReplicaRef {
    /// The topic's id.
    pub topic_id: String,
    /// The partition.
    pub partition: u32,
}

/// One partition's target replicas in a reassignment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reassignment {
    /// The partition.
    pub partition: u32,
    /// Its target replicas, preferred leader first.
    pub replicas: Vec<BrokerId>,
}

/// What an applied command produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommandOutput {
    /// Applied; nothing to return.
    Done,
    /// The broker epoch of a registration.
    BrokerEpoch(u64),
    /// A partition's new state.
    Partition(PartitionRecord),
    /// How many items the command changed.
    Count(u64),
    /// The first of the producer ids allocated.
    ProducerIds(i64),
}

/// The result a command returns through Raft to the node that proposed it.
pub type CommandResult = Result<CommandOutput, MetadataError>;
