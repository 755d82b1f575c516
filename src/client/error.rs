//! The client's error: a machine-readable code and a message, from the server or local.

use crate::error_code::ErrorCode;

/// A failed client call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ClientError {
    /// What kind of failure.
    pub code: ErrorCode,
    /// What and why.
    pub message: String,
    /// When the server said a retry is pointless sooner than this.
    pub retry_after: Option<std::time::Duration>,
}

impl ClientError {
    /// A new error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    /// The error a partition's result carries (`error_code` is a `tidelog.v1.ErrorCode`
    /// value), or None when it succeeded.
    pub fn from_partition(error_code: i32, message: &str) -> Option<Self> {
        if error_code == 0 {
            return None;
        }
        let code =
            crate::api::status::from_wire(error_code).unwrap_or(ErrorCode::UnknownServerError);
        Some(Self::new(code, message))
    }

    /// Whether retrying may help.
    pub fn is_retriable(&self) -> bool {
        self.code.is_retriable()
    }
}

impl From<tonic::Status> for ClientError {
    /// A failed call: the code the status carries (or one derived from its gRPC code).
    fn from(status: tonic::Status) -> Self {
        let mut e = ClientError::new(
            crate::api::status::code_of(&status),
            status.message().to_owned(),
        );
        e.retry_after = crate::api::status::retry_after_of(&status);
        e
    }
}
