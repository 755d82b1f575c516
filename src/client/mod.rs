//! The Rust client: the CLI uses only this.
//!
//! - [`admin`]: topics and cluster state;
//! - [`producer`], [`accumulator`], [`partitioner`]: batching producer (records encoded into
//!   per-partition batches as they are sent) and Kafka-compatible partitioning;
//! - [`consumer`]: manual assignment, seek and poll;
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
pub mod group_consumer;
pub mod groups;
pub mod partitioner;
pub mod producer;

pub use admin::AdminClient;
pub use error::ClientError;
