//! tidelog: a Kafka-style, partition-replicated log service.
//!
//! Layers, each depending only on those below it:
//! - [`record`]: Kafka's RecordBatch v2 codec, the one parser of record bytes;
//! - [`segment`]: one segment's `.log`, `.index` and `.timeindex` files;
//! - [`partition`]: one partition's log: segments, offsets, roll, retention, truncation,
//!   recovery, leader epochs, flushing;
//! - [`replication`]: leaders, followers, high watermark and ISR (Kafka's protocol);
//! - [`controller`]: the Raft quorum holding cluster metadata;
//! - [`api`]: the gRPC services and their proto types;
//! - [`net`]: listeners: the HTTP/2 handshake check, connection limits;
//! - [`kafka`]: Kafka's binary protocol, a second front door onto the broker;
//! - [`cli`]: the command-line tools.

pub mod api;
pub mod broker;
pub mod cli;
pub mod client;
pub mod config;
pub mod controller;
pub mod error_code;
pub mod filter;
pub mod http;
pub mod kafka;
pub mod net;
pub mod partition;
pub mod record;
pub mod replication;
pub mod roles;
pub mod segment;
pub mod time_text;
pub mod topic_config;
pub mod types;
