//! The Rust client: the CLI uses only this.
//!
//! - [`admin`]: topics and cluster state;
//! - [`producer`], [`accumulator`], [`partitioner`], [`fault`]: batching producer (records
//!   encoded into per-partition batches as they are sent), Kafka-compatible partitioning,
//!   and avoidance of slow or failing brokers;
//! - [`consumer`]: manual assignment, seek and poll;
//! - [`push_feed`]: the consumer's push mode (records pushed over Subscribe streams);
//! - [`push_consumer`]: a group member that runs a listener on pushed records
//!   (concurrently or in order per partition);
//! - [`retry`]: nacks: retry topics with backoff, and dead-letter topics;
//! - [`cluster`]: partition leaders from the Metadata RPC;
//! - [`controller`]: the broker's side of the broker lifecycle API;
//! - [`connection`]: bootstrap lists, channels, and the shared retry loop.

pub mod accumulator;
pub mod admin;
pub mod cluster;
pub mod connection;
pub mod consumer;
pub mod controller;
pub mod error;
pub mod fault;
pub mod group_consumer;
pub mod groups;
pub mod partitioner;
pub mod producer;
pub mod push_consumer;
pub mod push_feed;
pub mod raw_call;
pub mod retry;
pub mod transactions;

pub use admin::AdminClient;
pub use error::ClientError;
