//! The metadata controller: an openraft quorum whose state machine holds the cluster
//! metadata (brokers, topics, partitions, leaders, ISRs).
//!
//! - [`raft_types`]: the openraft type configuration;
//! - [`command`]: the typed commands of the state machine;
//! - [`model`]: the metadata image and the rules that change it;
//! - [`election`], [`placement`], [`validation`]: pure decisions the leader makes;
//! - [`log_store`], [`state_machine`]: what openraft persists, under `<data-dir>/raft/`;
//! - [`network`]: Raft RPCs to peer controllers over gRPC;
//! - [`node`]: one running controller and the operations its APIs offer.
//!
//! The controller knows nothing of segments or partitions' data: only of who holds what.

pub mod command;
pub mod election;
pub mod error;
pub mod log_store;
pub mod model;
pub mod network;
pub mod node;
pub mod placement;
pub mod raft_types;
pub mod state_machine;
pub mod validation;

pub use error::{ControllerError, MetadataError, StartupError};
pub use node::ControllerNode;

#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod store_tests;
