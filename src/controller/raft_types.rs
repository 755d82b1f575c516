//! The openraft type configuration of the controller quorum.

use std::io::Cursor;

use super::command::{CommandResult, MetadataCommand};
use crate::types::NodeId;

openraft::declare_raft_types!(
    /// Raft types of the metadata quorum: commands in, command results out, controllers
    /// addressed by [`openraft::BasicNode`] (their gRPC address), snapshots in memory.
    pub TypeConfig:
        D = MetadataCommand,
        R = CommandResult,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The Raft handle of a controller.
pub type MetadataRaft = openraft::Raft<TypeConfig>;

/// A log id in this quorum.
pub type LogId = openraft::LogId<NodeId>;

/// A storage failure as openraft reports it.
pub type StorageError = openraft::StorageError<NodeId>;

/// A log entry of this quorum.
pub type Entry = openraft::Entry<TypeConfig>;
