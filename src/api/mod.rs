//! gRPC services: proto <-> domain conversion and error mapping only. Handlers call into
//! [`crate::controller`] (and, later, the broker) and translate results.

pub mod admin_service;
pub mod broker_admin_service;
pub mod broker_service;
pub mod code_layer;
pub mod codec;
pub mod controller_service;
pub mod convert;
pub mod fast_path;
pub mod forward;
pub mod groups_service;
pub mod internal_topics;
pub mod port_guard;
pub mod proto;
pub mod push_service;
pub mod raft_service;
pub mod replication_service;
pub mod request_metrics;
pub mod status;
pub mod timer_service;
pub mod txn_service;
