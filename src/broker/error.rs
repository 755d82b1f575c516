//! The broker's request error: a machine-readable code and a message naming the field,
//! value and limit.

use crate::error_code::ErrorCode;
use crate::partition::LogError;
use crate::replication::ReplicaError;
use crate::types::BrokerId;

/// A failed broker operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct BrokerError {
    /// What kind of failure.
    pub code: ErrorCode,
    /// What and why.
    pub message: String,
    /// For NOT_LEADER_OR_FOLLOWER: the current leader's id and address, when known.
    pub leader: Option<(BrokerId, String)>,
}

impl BrokerError {
    /// A new error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            leader: None,
        }
    }

    /// A partition-log failure, classified.
    pub fn from_log(partition: &str, e: LogError) -> Self {
        ReplicaError::from_log(partition, e).into()
    }
}

impl From<ReplicaError> for BrokerError {
    fn from(e: ReplicaError) -> Self {
        Self::new(e.code, e.message)
    }
}
