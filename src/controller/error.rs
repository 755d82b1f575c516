//! Errors of the controller: one serializable error for requests (it travels through the
//! Raft log as a command's result), kept apart from fatal start-up failures.

use crate::error_code::ErrorCode;
use crate::types::NodeId;

/// A request the controller refused, with a machine-readable code. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[error("{code}: {message}")]
pub struct MetadataError {
    /// What kind of failure, and whether to retry.
    pub code: ErrorCode,
    /// Which field, which limit, which value.
    pub message: String,
    /// When retrying sooner is pointless: after this long the answer may change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

impl MetadataError {
    /// A new error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retry_after_ms: None,
        }
    }

    /// The same error, telling the caller when a retry may succeed.
    pub fn with_retry_after(mut self, after: std::time::Duration) -> Self {
        self.retry_after_ms = Some(u64::try_from(after.as_millis()).unwrap_or(u64::MAX));
        self
    }
}

/// Why a controller request failed.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// The request was refused; nothing changed.
    #[error(transparent)]
    Rejected(#[from] MetadataError),
    /// This node is not the Raft leader; `leader` is the leader's id and address if known.
    #[error("NOT_CONTROLLER: controller {node_id} is not the Raft leader{}", leader_text(.leader))]
    NotController {
        /// This node.
        node_id: NodeId,
        /// The leader, when known.
        leader: Option<(NodeId, String)>,
    },
    /// The request did not finish in time; it may still take effect.
    #[error("REQUEST_TIMED_OUT: {0}")]
    Timeout(String),
    /// Raft or storage failed.
    #[error("UNKNOWN_SERVER_ERROR: {0}")]
    Internal(String),
}

fn leader_text(leader: &Option<(NodeId, String)>) -> String {
    match leader {
        Some((id, addr)) => format!("; the leader is controller {id} (internal address {addr})"),
        None => "; no leader is known (an election may be running)".to_owned(),
    }
}

impl ControllerError {
    /// The machine-readable code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            ControllerError::Rejected(e) => e.code,
            ControllerError::NotController { .. } => ErrorCode::NotController,
            ControllerError::Timeout(_) => ErrorCode::RequestTimedOut,
            ControllerError::Internal(_) => ErrorCode::UnknownServerError,
        }
    }

    /// The message without the code prefix.
    pub fn message(&self) -> String {
        match self {
            ControllerError::Rejected(e) => e.message.clone(),
            other => {
                let text = other.to_string();
                match text.split_once(": ") {
                    Some((_, rest)) => rest.to_owned(),
                    None => text,
                }
            }
        }
    }

    /// Shorthand for a rejection.
    pub fn rejected(code: ErrorCode, message: impl Into<String>) -> Self {
        ControllerError::Rejected(MetadataError::new(code, message))
    }
}

/// Why a controller could not start. Fatal: the process exits with this message.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// The flags or configuration contradict each other or what is on disk.
    #[error("{0}")]
    Config(String),
    /// The data directory could not be read or written.
    #[error("data directory {path}: {source}")]
    Io {
        /// The file or directory.
        path: std::path::PathBuf,
        /// The I/O failure.
        #[source]
        source: std::io::Error,
    },
    /// The Raft log or snapshot on disk is unusable.
    #[error("{0}")]
    Corrupt(String),
    /// openraft refused to start.
    #[error("raft: {0}")]
    Raft(String),
}
