//! ApiVersions, the table of what this listener serves, and SaslHandshake.
//!
//! Only what is implemented is advertised; the ranges are those librdkafka 2.x,
//! kafka-python, aiokafka and the Java client 3.x/4.x negotiate within. A request for
//! any other API closes the connection (as Kafka does for an API it does not know).

use kafka_protocol::messages::api_versions_response::ApiVersion;
use kafka_protocol::messages::{ApiKey, ApiVersionsResponse, SaslHandshakeResponse};

/// Every served API with its lowest and highest version.
pub const SUPPORTED: &[(ApiKey, i16, i16)] = &[
    (ApiKey::Produce, 3, 11),
    (ApiKey::Fetch, 4, 17),
    (ApiKey::ListOffsets, 1, 7),
    (ApiKey::Metadata, 0, 12),
    (ApiKey::SaslHandshake, 0, 1),
    (ApiKey::ApiVersions, 0, 4),
    (ApiKey::CreateTopics, 2, 7),
    (ApiKey::DeleteTopics, 1, 6),
    (ApiKey::InitProducerId, 0, 4),
    (ApiKey::OffsetForLeaderEpoch, 2, 4),
    (ApiKey::DescribeConfigs, 1, 4),
    (ApiKey::CreatePartitions, 0, 3),
    (ApiKey::FindCoordinator, 0, 6),
    (ApiKey::JoinGroup, 0, 9),
    (ApiKey::SyncGroup, 0, 5),
    (ApiKey::Heartbeat, 0, 4),
    (ApiKey::LeaveGroup, 0, 5),
    (ApiKey::OffsetCommit, 2, 9),
    (ApiKey::OffsetFetch, 1, 9),
    (ApiKey::OffsetDelete, 0, 0),
    (ApiKey::DescribeGroups, 0, 5),
    (ApiKey::ListGroups, 0, 5),
    (ApiKey::DeleteGroups, 0, 2),
    (ApiKey::ConsumerGroupHeartbeat, 0, 1),
    (ApiKey::ConsumerGroupDescribe, 0, 1),
    (ApiKey::IncrementalAlterConfigs, 0, 1),
    (ApiKey::AlterConfigs, 0, 2),
    (ApiKey::DescribeCluster, 0, 1),
    (ApiKey::ElectLeaders, 0, 2),
    (ApiKey::AlterPartitionReassignments, 0, 0),
    (ApiKey::ListPartitionReassignments, 0, 0),
    (ApiKey::DeleteRecords, 0, 2),
    // Transactions: AddPartitionsToTxn and EndTxn up to the client versions before
    // KIP-890's broker-side changes (v4+), which clients fall back from.
    (ApiKey::AddPartitionsToTxn, 0, 3),
    (ApiKey::AddOffsetsToTxn, 0, 3),
    (ApiKey::EndTxn, 0, 3),
    (ApiKey::TxnOffsetCommit, 0, 3),
    (ApiKey::DescribeTransactions, 0, 0),
    (ApiKey::ListTransactions, 0, 1),
];

/// The versions of `api` this listener serves, if any.
pub fn advertised(api: ApiKey) -> Option<(i16, i16)> {
    SUPPORTED
        .iter()
        .find(|(k, _, _)| *k == api)
        .map(|(_, min, max)| (*min, *max))
}

/// The ApiVersions answer; `error` is UNSUPPORTED_VERSION for a too-new request (then
/// encoded at v0 by the caller).
pub fn api_versions(error: i16) -> ApiVersionsResponse {
    ApiVersionsResponse::default()
        .with_error_code(error)
        .with_api_keys(
            SUPPORTED
                .iter()
                .map(|(k, min, max)| {
                    ApiVersion::default()
                        .with_api_key(*k as i16)
                        .with_min_version(*min)
                        .with_max_version(*max)
                })
                .collect(),
        )
}

/// SaslHandshake: no SASL mechanism is enabled (authentication is a later issue), so
/// every mechanism is refused, with the empty list of enabled ones.
pub fn sasl_handshake() -> SaslHandshakeResponse {
    SaslHandshakeResponse::default()
        .with_error_code(kafka_protocol::error::ResponseError::UnsupportedSaslMechanism.code())
        .with_mechanisms(Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertised_ranges_are_within_what_the_codecs_know() {
        for (k, min, max) in SUPPORTED {
            let codec = k.valid_versions();
            assert!(min <= max, "{k:?}");
            assert!(
                *min >= codec.min && *max <= codec.max,
                "{k:?} {min}..={max} outside the codec's {codec}"
            );
        }
    }

    #[test]
    fn transaction_apis_are_advertised_up_to_the_client_versions() {
        // v4+ of these two are KIP-890's broker-side forms: clients use v3.
        assert_eq!(advertised(ApiKey::AddPartitionsToTxn), Some((0, 3)));
        assert_eq!(advertised(ApiKey::EndTxn), Some((0, 3)));
        for k in [ApiKey::AddOffsetsToTxn, ApiKey::TxnOffsetCommit] {
            assert!(advertised(k).is_some(), "{k:?}");
        }
        // Broker-to-broker only: never from clients.
        assert!(advertised(ApiKey::WriteTxnMarkers).is_none());
    }
}
