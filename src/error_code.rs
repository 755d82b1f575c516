//! The machine-readable error codes every API failure carries (DESIGN §7).
//!
//! Each code says whether a client should retry: retriable codes describe a transient
//! state (no leader yet, a stale cache, a timeout) that a retry, possibly after a metadata
//! refresh, can get past; the others describe a request that will fail again unchanged.

use std::fmt;
use std::str::FromStr;

macro_rules! error_codes {
    ($($variant:ident = $name:literal, $retriable:literal, $doc:literal;)*) => {
        /// A machine-readable error code; the names match `tidelog.v1.ErrorCode`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        #[serde(rename_all = "SCREAMING_SNAKE_CASE")]
        pub enum ErrorCode {
            $(#[doc = $doc] $variant,)*
        }

        impl ErrorCode {
            /// Every code, in wire order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code's name, e.g. `TOPIC_ALREADY_EXISTS`.
            pub fn as_str(self) -> &'static str {
                match self { $(ErrorCode::$variant => $name,)* }
            }

            /// True when the same request may succeed if retried (after a backoff or a
            /// metadata refresh).
            pub fn is_retriable(self) -> bool {
                match self { $(ErrorCode::$variant => $retriable,)* }
            }

            /// What the code means, for docs and `--help`.
            pub fn description(self) -> &'static str {
                match self { $(ErrorCode::$variant => $doc,)* }
            }
        }

        impl FromStr for ErrorCode {
            type Err = ();
            fn from_str(s: &str) -> Result<Self, ()> {
                match s { $($name => Ok(ErrorCode::$variant),)* _ => Err(()) }
            }
        }
    };
}

error_codes! {
    UnknownServerError = "UNKNOWN_SERVER_ERROR", false, "An unexpected server failure; the message says what.";
    UnknownTopicOrPartition = "UNKNOWN_TOPIC_OR_PARTITION", true, "The topic or partition does not exist (yet: metadata may be propagating).";
    NotLeaderOrFollower = "NOT_LEADER_OR_FOLLOWER", true, "This broker does not lead the partition; refresh metadata and retry at the leader.";
    NotEnoughReplicas = "NOT_ENOUGH_REPLICAS", true, "Fewer in-sync replicas than min.insync.replicas; nothing was written.";
    OffsetOutOfRange = "OFFSET_OUT_OF_RANGE", false, "The offset is outside [log start, log end].";
    RecordTooLarge = "RECORD_TOO_LARGE", false, "A batch exceeds max.message.bytes, as sent or after decompression.";
    InvalidTopic = "INVALID_TOPIC", false, "The topic name is not [a-zA-Z0-9._-]{1,249} or is reserved.";
    TopicAlreadyExists = "TOPIC_ALREADY_EXISTS", false, "A topic with this name exists.";
    RequestTimedOut = "REQUEST_TIMED_OUT", true, "The request did not complete within its timeout; it may or may not have taken effect.";
    NotController = "NOT_CONTROLLER", true, "This node is not the active controller and could not forward; retry at the leader hint.";
    InvalidPartitions = "INVALID_PARTITIONS", false, "The partition count is 0, above the limit, or below the current count.";
    InvalidReplicationFactor = "INVALID_REPLICATION_FACTOR", false, "The replication factor is 0 or above the number of live brokers.";
    InvalidConfig = "INVALID_CONFIG", false, "An unknown configuration key or an invalid value.";
    InvalidRequest = "INVALID_REQUEST", false, "A malformed request: a missing or out-of-range field.";
    StaleBrokerEpoch = "STALE_BROKER_EPOCH", false, "The broker epoch is not the current registration's; the broker must register again.";
    BrokerNotRegistered = "BROKER_NOT_REGISTERED", false, "No broker with this id is registered.";
    FencedLeaderEpoch = "FENCED_LEADER_EPOCH", false, "The leader epoch is older than the current one.";
    InvalidUpdateVersion = "INVALID_UPDATE_VERSION", true, "The partition epoch is stale: another change came first; refresh and retry.";
    IneligibleReplica = "INELIGIBLE_REPLICA", true, "A proposed ISR member is fenced or not a replica.";
    DuplicateBrokerRegistration = "DUPLICATE_BROKER_REGISTRATION", false, "Another live process holds this broker id.";
    CorruptMessage = "CORRUPT_MESSAGE", false, "Stored or sent bytes fail their CRC or structure checks.";
    KafkaStorageError = "KAFKA_STORAGE_ERROR", true, "A disk failure took the replica offline.";
    InvalidReplicaAssignment = "INVALID_REPLICA_ASSIGNMENT", false, "An explicit replica assignment names unknown brokers or repeats one.";
    ClusterNotReady = "CLUSTER_NOT_READY", true, "The controller quorum has not finished starting (no leader or no cluster id yet).";
    NotEnoughReplicasAfterAppend = "NOT_ENOUGH_REPLICAS_AFTER_APPEND", true, "The records were written, but the ISR shrank below min.insync.replicas before they were committed; a retry may write them twice.";
    UnknownLeaderEpoch = "UNKNOWN_LEADER_EPOCH", true, "The leader epoch is newer than this broker knows: its metadata is behind; retry.";
    OutOfOrderSequenceNumber = "OUT_OF_ORDER_SEQUENCE_NUMBER", false, "An idempotent producer's batch does not continue its sequence (a batch before it was lost); nothing was written.";
    NotCoordinator = "NOT_COORDINATOR", true, "This broker does not coordinate the group (any more); find the coordinator again.";
    CoordinatorLoadInProgress = "COORDINATOR_LOAD_IN_PROGRESS", true, "The coordinator is loading the group's offsets; retry shortly.";
    UnknownMemberId = "UNKNOWN_MEMBER_ID", false, "The group has no member with this id (it left or its session expired); join again.";
    FencedMemberEpoch = "FENCED_MEMBER_EPOCH", false, "The member epoch is not the member's current one, or the member commits a partition it does not hold (it lost it); join again.";
    GroupNotEmpty = "GROUP_NOT_EMPTY", false, "The group has active members; stop them first.";
    GroupIdNotFound = "GROUP_ID_NOT_FOUND", false, "No such group.";
    NetworkException = "NETWORK_EXCEPTION", true, "The connection failed or broke (refused, reset, closed mid-request): the server may be down or restarting; the request may or may not have taken effect. Retry, after a metadata refresh for partition requests.";
    ControllerUnavailable = "CONTROLLER_UNAVAILABLE", true, "No controller answers (the quorum is down or cut off): metadata changes such as creating topics wait until it returns; produce and fetch keep working.";
    InvalidProducerEpoch = "INVALID_PRODUCER_EPOCH", false, "The producer epoch is older than the current one (a newer producer took over), or a new epoch does not start at sequence 0.";
    ClusterAuthorizationFailed = "CLUSTER_AUTHORIZATION_FAILED", false, "An internal (node-to-node) service was called on a client port; internal services are served only on the internal listener, to nodes holding the cluster secret.";
    InconsistentTopicId = "INCONSISTENT_TOPIC_ID", true, "The topic id does not match this broker's partition: the topic was deleted and re-created under the same name; refresh metadata.";
    InvalidRecord = "INVALID_RECORD", false, "A client batch breaks a record rule: a negative timestamp, the control attribute (only the transaction coordinator writes markers), or the transactional attribute without a producer id and epoch; nothing was written.";
    PartitionLimitExceeded = "PARTITION_LIMIT_EXCEEDED", false, "Placing the new partitions would give a broker more replicas than max_partitions_per_broker allows; nothing was created. Delete topics or add brokers first.";
    IllegalGeneration = "ILLEGAL_GENERATION", false, "The generation id is not the group's current one: the group rebalanced without this member; join again.";
    RebalanceInProgress = "REBALANCE_IN_PROGRESS", false, "The group is rebalancing; a classic-protocol member joins again.";
    InconsistentGroupProtocol = "INCONSISTENT_GROUP_PROTOCOL", false, "The member's protocol type or assignors match none of the group's members, or the group uses the other group protocol (classic or consumer) while it has members.";
    InvalidSessionTimeout = "INVALID_SESSION_TIMEOUT", false, "The session timeout is outside the broker's group session timeout bounds.";
    MemberIdRequired = "MEMBER_ID_REQUIRED", false, "A new classic-protocol member must join again with the member id this answer carries.";
    FencedInstanceId = "FENCED_INSTANCE_ID", false, "Another process joined with this group.instance.id; this one is fenced.";
    GroupSubscribedToTopic = "GROUP_SUBSCRIBED_TO_TOPIC", false, "The group's members subscribe to the topic; its offsets cannot be deleted while they do.";
    InvalidFilterExpression = "INVALID_FILTER_EXPRESSION", false, "A fetch's tag or SQL filter expression does not parse or breaks a limit; the message points at the problem. Nothing was read.";
    PushSessionLimitExceeded = "PUSH_SESSION_LIMIT_EXCEEDED", true, "The broker serves its maximum of 1,024 push subscriptions already; retry later (or at another broker), or consume with Fetch.";
    InvalidDelay = "INVALID_DELAY", false, "A record's delay_ms or deliver_at_ms is negative, beyond max_delay_ms, or both are given; nothing was written.";
    UnknownScheduledRecord = "UNKNOWN_SCHEDULED_RECORD", false, "No pending scheduled record has this id: it is malformed or unknown, or the record was delivered or cancelled already.";
    ScheduledRecordLimitExceeded = "SCHEDULED_RECORD_LIMIT_EXCEEDED", true, "The timers partition for the record's target holds its maximum of pending scheduled records (timers_max_pending_per_partition); nothing was written. Retry once some fell due, or raise the limit.";
    InvalidTxnState = "INVALID_TXN_STATE", false, "The request does not fit the transaction's state: a non-transactional write inside an open transaction, EndTxn without an open transaction, or commit after abort; nothing changed.";
    ProducerFenced = "PRODUCER_FENCED", false, "A newer instance initialised this transactional id (or the coordinator aborted a timed-out transaction and bumped the epoch): this producer is fenced; close it.";
    ConcurrentTransactions = "CONCURRENT_TRANSACTIONS", true, "The transactional id's previous transaction is still completing (its markers are being written); retry shortly.";
    TransactionalIdNotFound = "TRANSACTIONAL_ID_NOT_FOUND", false, "No such transactional id at its coordinator: call InitProducerId first.";
    InvalidTransactionTimeout = "INVALID_TRANSACTION_TIMEOUT", false, "The transaction timeout is 0 or above transaction_max_timeout_ms.";
    InvalidProducerIdMapping = "INVALID_PRODUCER_ID_MAPPING", false, "The producer id is not the one the transactional id holds (it expired or was re-initialised): call InitProducerId again.";
    TransactionCoordinatorFenced = "TRANSACTION_COORDINATOR_FENCED", false, "A transaction marker came from an older coordinator than the partition has seen (the coordinator moved); the new coordinator completes the transaction.";
    UnstableOffsetCommit = "UNSTABLE_OFFSET_COMMIT", true, "The group has offsets committed inside a transaction that has not completed yet (its markers are being written); retry shortly to read the settled offset.";
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for code in ErrorCode::ALL {
            assert_eq!(code.as_str().parse::<ErrorCode>(), Ok(*code));
        }
        assert!("NOPE".parse::<ErrorCode>().is_err());
    }

    #[test]
    fn every_code_is_documented_in_api_md() {
        let doc = include_str!("../docs/api.md");
        for code in ErrorCode::ALL {
            let retriable = if code.is_retriable() { "yes" } else { "no" };
            let row = format!("| `{}` | {retriable} |", code.as_str());
            assert!(
                doc.contains(&row),
                "docs/api.md lacks the row for {}",
                code.as_str()
            );
        }
    }

    #[test]
    fn names_match_the_proto_enum() {
        for code in ErrorCode::ALL {
            let wire = crate::api::proto::ErrorCode::from_str_name(code.as_str());
            assert!(
                wire.is_some(),
                "{} missing from common.proto",
                code.as_str()
            );
        }
    }
}
