//! The broker role: the partitions it stores, the metadata it follows, and the handling of
//! produce, fetch and list-offsets requests (no gRPC types in the request path; the link to
//! the controllers uses the Rust client).
//!
//! - [`metadata_cache`]: the broker's copy of the cluster metadata;
//! - [`partition_manager`]: opens, creates and deletes partition logs to match it;
//! - [`node`]: request handling;
//! - [`group`]: consumer group coordination and committed offsets;
//! - [`lease`]: whether the broker may accept writes (fenced, answered, or controllers
//!   unreachable);
//! - [`producer_ids`]: idempotent producer ids from blocks reserved in advance;
//! - [`txn`]: the transaction coordinator (`__transaction_state`, markers, timeouts);
//! - [`push`]: push subscriptions (credit windows, reads as records are committed);
//! - [`replica_manager`]: partition roles from the metadata, fetchers, ISR proposals;
//! - [`controller_link`]: registration, heartbeats, metadata long-poll, controlled shutdown.

pub mod controller_link;
pub mod error;
pub mod group;
pub mod lease;
pub mod metadata_cache;
pub mod node;
pub mod partition_manager;
pub mod producer_ids;
pub mod push;
pub mod replica_manager;
pub mod timer;
pub mod traffic;
pub mod txn;

pub use error::BrokerError;
pub use node::BrokerNode;
