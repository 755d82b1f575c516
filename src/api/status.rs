//! Errors on the wire: every failure is a gRPC status whose trailing metadata carries the
//! machine-readable code (`tidelog-error-code`), whether to retry (`tidelog-retriable`)
//! and, for requests that reached the wrong node, where to go (`tidelog-leader-hint`).

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use crate::controller::{ControllerError, MetadataError};
use crate::error_code::ErrorCode;

/// Metadata key holding the [`ErrorCode`] name.
pub const ERROR_CODE_KEY: &str = "tidelog-error-code";
/// Metadata key holding "true" or "false".
pub const RETRIABLE_KEY: &str = "tidelog-retriable";
/// Metadata key holding the address of the node to retry at.
pub const LEADER_HINT_KEY: &str = "tidelog-leader-hint";
/// Metadata key holding how many milliseconds a retry is pointless for (when known).
pub const RETRY_AFTER_KEY: &str = "tidelog-retry-after-ms";
/// Request metadata set on requests one controller forwards to another (never forwarded twice).
pub const FORWARDED_KEY: &str = "tidelog-forwarded";

fn grpc_code(code: ErrorCode) -> Code {
    match code {
        ErrorCode::UnknownTopicOrPartition
        | ErrorCode::BrokerNotRegistered
        | ErrorCode::GroupIdNotFound
        | ErrorCode::UnknownScheduledRecord => Code::NotFound,
        ErrorCode::NotCoordinator | ErrorCode::CoordinatorLoadInProgress => Code::Unavailable,
        ErrorCode::UnknownMemberId
        | ErrorCode::FencedMemberEpoch
        | ErrorCode::GroupNotEmpty
        | ErrorCode::IllegalGeneration
        | ErrorCode::RebalanceInProgress
        | ErrorCode::MemberIdRequired
        | ErrorCode::FencedInstanceId
        | ErrorCode::GroupSubscribedToTopic => Code::FailedPrecondition,
        ErrorCode::TopicAlreadyExists | ErrorCode::DuplicateBrokerRegistration => {
            Code::AlreadyExists
        }
        ErrorCode::InvalidTopic
        | ErrorCode::InvalidPartitions
        | ErrorCode::InvalidReplicationFactor
        | ErrorCode::InvalidConfig
        | ErrorCode::InvalidRequest
        | ErrorCode::InvalidReplicaAssignment
        | ErrorCode::OutOfOrderSequenceNumber
        | ErrorCode::InvalidProducerEpoch
        | ErrorCode::RecordTooLarge
        | ErrorCode::InvalidRecord
        | ErrorCode::InconsistentGroupProtocol
        | ErrorCode::InvalidSessionTimeout
        | ErrorCode::InvalidFilterExpression
        | ErrorCode::InvalidDelay
        | ErrorCode::InvalidTransactionTimeout
        | ErrorCode::CorruptMessage => Code::InvalidArgument,
        ErrorCode::OffsetOutOfRange => Code::OutOfRange,
        ErrorCode::RequestTimedOut => Code::DeadlineExceeded,
        ErrorCode::NotController
        | ErrorCode::NotLeaderOrFollower
        | ErrorCode::NotEnoughReplicas
        | ErrorCode::NotEnoughReplicasAfterAppend
        | ErrorCode::UnknownLeaderEpoch
        | ErrorCode::ClusterNotReady
        | ErrorCode::ControllerUnavailable
        | ErrorCode::NetworkException
        | ErrorCode::KafkaStorageError
        | ErrorCode::ConcurrentTransactions
        | ErrorCode::UnstableOffsetCommit => Code::Unavailable,
        ErrorCode::StaleBrokerEpoch
        | ErrorCode::FencedLeaderEpoch
        | ErrorCode::InvalidUpdateVersion
        | ErrorCode::IneligibleReplica
        | ErrorCode::InconsistentTopicId
        | ErrorCode::InvalidTxnState
        | ErrorCode::ProducerFenced
        | ErrorCode::TransactionalIdNotFound
        | ErrorCode::InvalidProducerIdMapping
        | ErrorCode::TransactionCoordinatorFenced => Code::FailedPrecondition,
        ErrorCode::ClusterAuthorizationFailed => Code::PermissionDenied,
        ErrorCode::PartitionLimitExceeded
        | ErrorCode::PushSessionLimitExceeded
        | ErrorCode::ScheduledRecordLimitExceeded => Code::ResourceExhausted,
        ErrorCode::UnknownServerError => Code::Internal,
    }
}

/// Longest status message sent: it travels in an HTTP/2 header (`grpc-message`), and a
/// message echoing a huge input (a 20,000-byte topic name) would break the response.
pub const STATUS_MESSAGE_BYTES_MAX: usize = 2048;

/// `message` cut to [`STATUS_MESSAGE_BYTES_MAX`] bytes at a character boundary, saying so.
fn bounded(mut message: String) -> String {
    if message.len() > STATUS_MESSAGE_BYTES_MAX {
        let mut cut = STATUS_MESSAGE_BYTES_MAX - 32;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        let total = message.len();
        message.truncate(cut);
        message.push_str(&format!("… ({total} bytes in all)"));
    }
    message
}

/// A status carrying `code`, `message` and an optional leader hint.
pub fn error_status(
    code: ErrorCode,
    message: impl Into<String>,
    leader_hint: Option<&str>,
) -> Status {
    let mut status = Status::new(grpc_code(code), bounded(message.into()));
    let md = status.metadata_mut();
    md.insert(ERROR_CODE_KEY, MetadataValue::from_static(code.as_str()));
    md.insert(
        RETRIABLE_KEY,
        MetadataValue::from_static(if code.is_retriable() { "true" } else { "false" }),
    );
    if let Some(hint) = leader_hint.and_then(|h| h.parse().ok()) {
        md.insert(LEADER_HINT_KEY, hint);
    }
    status
}

impl From<ControllerError> for Status {
    fn from(e: ControllerError) -> Status {
        let hint = match &e {
            ControllerError::NotController {
                leader: Some((_, addr)),
                ..
            } => Some(addr.clone()),
            _ => None,
        };
        let mut status = error_status(e.code(), e.message(), hint.as_deref());
        if let ControllerError::Rejected(MetadataError {
            retry_after_ms: Some(ms),
            ..
        }) = &e
        {
            if let Ok(v) = ms.to_string().parse() {
                status.metadata_mut().insert(RETRY_AFTER_KEY, v);
            }
        }
        status
    }
}

/// How long the status says a retry is pointless for, if it says.
pub fn retry_after_of(status: &Status) -> Option<std::time::Duration> {
    status
        .metadata()
        .get(RETRY_AFTER_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .map(std::time::Duration::from_millis)
}

/// Reads the error code a status carries; statuses without one (transport failures) map
/// from their gRPC code.
pub fn code_of(status: &Status) -> ErrorCode {
    if let Some(code) = status
        .metadata()
        .get(ERROR_CODE_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok())
    {
        return code;
    }
    match status.code() {
        Code::DeadlineExceeded => ErrorCode::RequestTimedOut,
        // No server answered with a status of its own: the connection failed (refused,
        // reset, closed mid-request). Retriable, and honest about what happened.
        Code::Unavailable | Code::Cancelled => ErrorCode::NetworkException,
        Code::Unknown if is_transport_failure(status.message()) => ErrorCode::NetworkException,
        Code::InvalidArgument | Code::Unimplemented => ErrorCode::InvalidRequest,
        _ => ErrorCode::UnknownServerError,
    }
}

/// Whether a status message without a tidelog code is the transport's own (tonic and
/// hyper report broken connections as `Unknown` with such messages).
pub(crate) fn is_transport_failure(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    [
        "transport error",
        "connection",
        "broken pipe",
        "h2 protocol error",
        "stream closed",
        "error trying to connect",
        "tcp connect error",
        "operation was canceled",
    ]
    .iter()
    .any(|needle| m.contains(needle))
}

/// An error code as the `tidelog.v1.ErrorCode` wire value.
pub fn to_wire(code: ErrorCode) -> i32 {
    super::proto::ErrorCode::from_str_name(code.as_str())
        .unwrap_or(super::proto::ErrorCode::UnknownServerError) as i32
}

/// A `tidelog.v1.ErrorCode` wire value as an error code (`None` for NONE).
pub fn from_wire(value: i32) -> Option<ErrorCode> {
    let wire = super::proto::ErrorCode::try_from(value).ok()?;
    if wire == super::proto::ErrorCode::None {
        return None;
    }
    Some(
        wire.as_str_name()
            .parse()
            .unwrap_or(ErrorCode::UnknownServerError),
    )
}

/// The leader hint a status carries, if any.
pub fn leader_hint_of(status: &Status) -> Option<String> {
    status
        .metadata()
        .get(LEADER_HINT_KEY)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_failures_are_retriable_network_errors() {
        for status in [
            Status::unavailable(
                "error trying to connect: tcp connect error: Connection refused (os error 111)",
            ),
            Status::unknown("transport error"),
            Status::unknown("h2 protocol error: error reading a body from connection"),
            Status::cancelled("operation was canceled"),
        ] {
            let code = code_of(&status);
            assert_eq!(code, ErrorCode::NetworkException, "{status:?}");
            assert!(code.is_retriable());
        }
        assert_eq!(
            code_of(&Status::unknown("boom")),
            ErrorCode::UnknownServerError
        );
        assert_eq!(
            code_of(&Status::deadline_exceeded("late")),
            ErrorCode::RequestTimedOut
        );
    }

    #[test]
    fn codes_survive_the_status() {
        for code in ErrorCode::ALL {
            let s = error_status(*code, "why", Some("127.0.0.1:1"));
            assert_eq!(code_of(&s), *code);
            assert_eq!(leader_hint_of(&s).as_deref(), Some("127.0.0.1:1"));
            assert_eq!(s.message(), "why");
            let long = error_status(ErrorCode::InvalidTopic, "é".repeat(20_000), None);
            assert!(
                long.message().len() <= STATUS_MESSAGE_BYTES_MAX,
                "{}",
                long.message().len()
            );
            assert!(long.message().ends_with("(40000 bytes in all)"));
        }
    }
}
