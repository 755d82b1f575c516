//! Replication (DESIGN §4, Kafka's ISR protocol): the leader side (followers' progress,
//! high watermark, ISR changes, acks=all waits) and the follower side (one fetcher per
//! leader broker, truncation by leader epoch before fetching).
//!
//! - [`progress`]: pure rules: caught-up time, high watermark, ISR shrink and expand;
//! - [`truncation`]: pure rule: where a follower cuts its log for a new leader;
//! - [`rack`]: pure rule: the replica a consumer in a rack reads from (KIP-392);
//! - [`replica`]: [`LocalPartition`], one stored partition with its role;
//! - [`fetcher`]: a follower's fetch loop against one leader broker;
//! - [`isr_queue`]: ISR changes waiting for the controllers, one per partition.
//!
//! Nothing here talks to the controller: ISR changes leave as [`IsrChange`]s for the
//! broker to send.

pub mod fetcher;
pub mod isr_queue;
pub mod progress;
pub mod rack;
pub mod replica;
pub mod truncation;

pub use replica::{IsrChange, LocalPartition, PartitionAssignment, ReplicaError, Role};
