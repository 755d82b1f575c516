//! The one table from tidelog's [`ErrorCode`]s to the Kafka error codes Kafka clients
//! understand. A pure function with an exhaustive match: a new tidelog code does not
//! compile until it has a Kafka code here.

use kafka_protocol::error::ResponseError;

use crate::error_code::ErrorCode;

/// The Kafka error a client expects for `code`. Where Kafka has the same error the code
/// is the same; otherwise the closest one with the same retriability (the message sent
/// alongside, where the API has one, keeps tidelog's wording).
pub fn kafka_error(code: ErrorCode) -> ResponseError {
    use ErrorCode as C;
    use ResponseError as K;
    match code {
        C::UnknownServerError => K::UnknownServerError,
        C::UnknownTopicOrPartition => K::UnknownTopicOrPartition,
        C::NotLeaderOrFollower => K::NotLeaderOrFollower,
        C::NotEnoughReplicas => K::NotEnoughReplicas,
        C::OffsetOutOfRange => K::OffsetOutOfRange,
        C::RecordTooLarge => K::MessageTooLarge,
        C::InvalidTopic => K::InvalidTopicException,
        C::TopicAlreadyExists => K::TopicAlreadyExists,
        C::RequestTimedOut => K::RequestTimedOut,
        C::NotController => K::NotController,
        C::InvalidPartitions => K::InvalidPartitions,
        C::InvalidReplicationFactor => K::InvalidReplicationFactor,
        C::InvalidConfig => K::InvalidConfig,
        C::InvalidRequest => K::InvalidRequest,
        C::StaleBrokerEpoch => K::StaleBrokerEpoch,
        C::BrokerNotRegistered => K::BrokerIdNotRegistered,
        C::FencedLeaderEpoch => K::FencedLeaderEpoch,
        C::InvalidUpdateVersion => K::InvalidUpdateVersion,
        C::IneligibleReplica => K::IneligibleReplica,
        C::DuplicateBrokerRegistration => K::DuplicateBrokerRegistration,
        C::CorruptMessage => K::CorruptMessage,
        C::KafkaStorageError => K::KafkaStorageError,
        C::InvalidReplicaAssignment => K::InvalidReplicaAssignment,
        // No quorum leader yet: Kafka clients retry admin calls on NOT_CONTROLLER.
        C::ClusterNotReady => K::NotController,
        C::NotEnoughReplicasAfterAppend => K::NotEnoughReplicasAfterAppend,
        C::UnknownLeaderEpoch => K::UnknownLeaderEpoch,
        C::OutOfOrderSequenceNumber => K::OutOfOrderSequenceNumber,
        C::NotCoordinator => K::NotCoordinator,
        C::CoordinatorLoadInProgress => K::CoordinatorLoadInProgress,
        C::UnknownMemberId => K::UnknownMemberId,
        C::FencedMemberEpoch => K::FencedMemberEpoch,
        C::GroupNotEmpty => K::NonEmptyGroup,
        C::GroupIdNotFound => K::GroupIdNotFound,
        C::NetworkException => K::NetworkException,
        // Kafka answers a metadata change the controller did not finish in time so.
        C::ControllerUnavailable => K::RequestTimedOut,
        C::InvalidProducerEpoch => K::InvalidProducerEpoch,
        C::ClusterAuthorizationFailed => K::ClusterAuthorizationFailed,
        C::InconsistentTopicId => K::InconsistentTopicId,
        C::InvalidRecord => K::InvalidRecord,
        // Kafka has no such limit; a refused placement is its nearest kin.
        C::PartitionLimitExceeded => K::PolicyViolation,
        C::IllegalGeneration => K::IllegalGeneration,
        C::RebalanceInProgress => K::RebalanceInProgress,
        C::InconsistentGroupProtocol => K::InconsistentGroupProtocol,
        C::InvalidSessionTimeout => K::InvalidSessionTimeout,
        C::MemberIdRequired => K::MemberIdRequired,
        C::FencedInstanceId => K::FencedInstanceId,
        C::GroupSubscribedToTopic => K::GroupSubscribedToTopic,
        // Kafka clients send no filters; the nearest kin if one ever shows.
        C::InvalidFilterExpression => K::InvalidRequest,
        // Kafka has no push subscriptions; a retriable throttle is its nearest kin.
        C::PushSessionLimitExceeded => K::ThrottlingQuotaExceeded,
        // A bad delay header: the record is refused, as Kafka refuses a bad record.
        C::InvalidDelay => K::InvalidRecord,
        // Kafka clients cannot cancel scheduled records; the nearest kin.
        C::UnknownScheduledRecord => K::InvalidRequest,
        // A retriable throttle, as for push sessions.
        C::ScheduledRecordLimitExceeded => K::ThrottlingQuotaExceeded,
        C::InvalidTxnState => K::InvalidTxnState,
        C::ProducerFenced => K::ProducerFenced,
        C::ConcurrentTransactions => K::ConcurrentTransactions,
        C::TransactionalIdNotFound => K::TransactionalIdNotFound,
        C::InvalidTransactionTimeout => K::InvalidTransactionTimeout,
        C::InvalidProducerIdMapping => K::InvalidProducerIdMapping,
        C::TransactionCoordinatorFenced => K::TransactionCoordinatorFenced,
        C::UnstableOffsetCommit => K::UnstableOffsetCommit,
    }
}

/// [`kafka_error`] as the wire's `i16`.
pub fn kafka_code(code: ErrorCode) -> i16 {
    kafka_error(code).code()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Codes whose retriability differs from Kafka's own table, on purpose: Kafka marks
    /// these non-retriable (or retriable) from its side of the protocol, while tidelog
    /// describes what a retry after a metadata refresh achieves. Kafka clients act on
    /// the Kafka code, so the difference only shows in tidelog's own clients.
    const RETRIABILITY_DIFFERS: &[ErrorCode] = &[
        ErrorCode::FencedLeaderEpoch,
        ErrorCode::InvalidUpdateVersion,
        ErrorCode::IneligibleReplica,
        ErrorCode::CorruptMessage,
        // Kafka's table marks it non-retriable, but every Kafka client retries it (the
        // previous transaction completes in a moment).
        ErrorCode::ConcurrentTransactions,
    ];

    #[test]
    fn every_code_maps_to_a_kafka_error_with_the_same_retriability() {
        let mut differ = Vec::new();
        for code in ErrorCode::ALL {
            let k = kafka_error(*code);
            assert!(k.code() != 0, "{code} maps to success");
            assert!(
                !matches!(k, ResponseError::Unknown(_)),
                "{code} maps to a code Kafka does not define"
            );
            if k.is_retriable() != code.is_retriable() {
                differ.push(*code);
            }
        }
        assert_eq!(differ, RETRIABILITY_DIFFERS, "retriability differs");
    }

    #[test]
    fn the_common_codes_are_kafkas_own() {
        assert_eq!(kafka_code(ErrorCode::NotLeaderOrFollower), 6);
        assert_eq!(kafka_code(ErrorCode::UnknownTopicOrPartition), 3);
        assert_eq!(kafka_code(ErrorCode::OffsetOutOfRange), 1);
        assert_eq!(kafka_code(ErrorCode::NotEnoughReplicas), 19);
        assert_eq!(kafka_code(ErrorCode::RecordTooLarge), 10);
        assert_eq!(kafka_code(ErrorCode::OutOfOrderSequenceNumber), 45);
    }
}
