//! Framing: a Kafka request is a big-endian `i32` size, then a request header (API key,
//! API version, correlation id, client id, tagged fields from header v2) and the body; a
//! response is a size, a response header (correlation id, tagged fields from header v1)
//! and the body. The size prefix is split off by the connection's codec (which refuses
//! sizes above `socket_request_max_bytes`); this module parses what follows and encodes
//! responses, with `kafka-protocol`'s codecs. It never panics on what a peer sends: every
//! malformed frame is a [`FrameError`] and closes that connection.

use bytes::{BufMut, Bytes, BytesMut};
use kafka_protocol::messages::{
    AddOffsetsToTxnRequest, AddPartitionsToTxnRequest, AlterConfigsRequest,
    AlterPartitionReassignmentsRequest, ApiKey, ApiVersionsRequest, ConsumerGroupDescribeRequest,
    ConsumerGroupHeartbeatRequest, CreatePartitionsRequest, CreateTopicsRequest,
    DeleteGroupsRequest, DeleteRecordsRequest, DeleteTopicsRequest, DescribeClusterRequest,
    DescribeConfigsRequest, DescribeGroupsRequest, DescribeTransactionsRequest,
    ElectLeadersRequest, EndTxnRequest, FetchRequest, FindCoordinatorRequest, HeartbeatRequest,
    IncrementalAlterConfigsRequest, InitProducerIdRequest, JoinGroupRequest, LeaveGroupRequest,
    ListGroupsRequest, ListOffsetsRequest, ListPartitionReassignmentsRequest,
    ListTransactionsRequest, MetadataRequest, OffsetCommitRequest, OffsetDeleteRequest,
    OffsetFetchRequest, OffsetForLeaderEpochRequest, ProduceRequest, RequestHeader, ResponseHeader,
    SaslHandshakeRequest, SyncGroupRequest, TxnOffsetCommitRequest,
};
use kafka_protocol::protocol::{Decodable, Encodable};

use super::api_versions::advertised;

/// Why a frame closes its connection.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// Shorter than the fixed part of a request header.
    #[error("a {0}-byte request is shorter than a request header (8 bytes)")]
    TooShort(usize),
    /// An API key this listener does not serve (not advertised in ApiVersions).
    #[error("API key {0} is not supported")]
    UnknownApi(i16),
    /// An API this listener serves, at a version it does not.
    #[error("{api:?} version {version} is not supported (supported: {min}..={max})")]
    UnsupportedVersion {
        /// The API.
        api: ApiKey,
        /// The version asked for.
        version: i16,
        /// Lowest supported.
        min: i16,
        /// Highest supported.
        max: i16,
    },
    /// The header or body does not decode at the version it names.
    #[error("malformed {api:?} v{version} request: {reason}")]
    Malformed {
        /// The API.
        api: ApiKey,
        /// Its version.
        version: i16,
        /// What the decoder said.
        reason: String,
    },
}

/// A decoded request body, one variant per API this listener serves.
#[derive(Debug)]
pub enum Body {
    /// ApiVersions.
    ApiVersions(ApiVersionsRequest),
    /// Metadata.
    Metadata(MetadataRequest),
    /// Produce.
    Produce(ProduceRequest),
    /// Fetch.
    Fetch(FetchRequest),
    /// ListOffsets.
    ListOffsets(ListOffsetsRequest),
    /// OffsetForLeaderEpoch.
    OffsetForLeaderEpoch(OffsetForLeaderEpochRequest),
    /// InitProducerId.
    InitProducerId(InitProducerIdRequest),
    /// CreateTopics.
    CreateTopics(CreateTopicsRequest),
    /// DeleteTopics.
    DeleteTopics(DeleteTopicsRequest),
    /// CreatePartitions.
    CreatePartitions(CreatePartitionsRequest),
    /// DescribeConfigs.
    DescribeConfigs(DescribeConfigsRequest),
    /// SaslHandshake.
    SaslHandshake(SaslHandshakeRequest),
    /// FindCoordinator.
    FindCoordinator(FindCoordinatorRequest),
    /// JoinGroup.
    JoinGroup(JoinGroupRequest),
    /// SyncGroup.
    SyncGroup(SyncGroupRequest),
    /// Heartbeat.
    Heartbeat(HeartbeatRequest),
    /// LeaveGroup.
    LeaveGroup(LeaveGroupRequest),
    /// OffsetCommit.
    OffsetCommit(OffsetCommitRequest),
    /// OffsetFetch.
    OffsetFetch(OffsetFetchRequest),
    /// OffsetDelete.
    OffsetDelete(OffsetDeleteRequest),
    /// DescribeGroups.
    DescribeGroups(DescribeGroupsRequest),
    /// ListGroups.
    ListGroups(ListGroupsRequest),
    /// DeleteGroups.
    DeleteGroups(DeleteGroupsRequest),
    /// ConsumerGroupHeartbeat.
    ConsumerGroupHeartbeat(ConsumerGroupHeartbeatRequest),
    /// ConsumerGroupDescribe.
    ConsumerGroupDescribe(ConsumerGroupDescribeRequest),
    /// AddPartitionsToTxn.
    AddPartitionsToTxn(AddPartitionsToTxnRequest),
    /// AddOffsetsToTxn.
    AddOffsetsToTxn(AddOffsetsToTxnRequest),
    /// EndTxn.
    EndTxn(EndTxnRequest),
    /// TxnOffsetCommit.
    TxnOffsetCommit(TxnOffsetCommitRequest),
    /// DescribeTransactions.
    DescribeTransactions(DescribeTransactionsRequest),
    /// ListTransactions.
    ListTransactions(ListTransactionsRequest),
    /// IncrementalAlterConfigs.
    IncrementalAlterConfigs(IncrementalAlterConfigsRequest),
    /// AlterConfigs.
    AlterConfigs(AlterConfigsRequest),
    /// DescribeCluster.
    DescribeCluster(DescribeClusterRequest),
    /// ElectLeaders.
    ElectLeaders(ElectLeadersRequest),
    /// AlterPartitionReassignments.
    AlterPartitionReassignments(AlterPartitionReassignmentsRequest),
    /// ListPartitionReassignments.
    ListPartitionReassignments(ListPartitionReassignmentsRequest),
    /// DeleteRecords.
    DeleteRecords(DeleteRecordsRequest),
}

/// One parsed request.
#[derive(Debug)]
pub enum Request {
    /// A request this listener serves.
    Served {
        /// Its header.
        header: RequestHeader,
        /// The API (from the header).
        api: ApiKey,
        /// Its body (boxed: bodies are large and vary in size).
        body: Box<Body>,
    },
    /// ApiVersions at a version above ours: answered with a v0 body carrying
    /// UNSUPPORTED_VERSION and our versions, so the client retries lower (KIP-511).
    ApiVersionsTooNew {
        /// To echo.
        correlation_id: i32,
    },
}

impl Request {
    /// The correlation id to answer with.
    pub fn correlation_id(&self) -> i32 {
        match self {
            Request::Served { header, .. } => header.correlation_id,
            Request::ApiVersionsTooNew { correlation_id } => *correlation_id,
        }
    }
}

/// Parses one frame (without its size prefix).
pub fn parse_request(frame: Bytes) -> Result<Request, FrameError> {
    if frame.len() < 8 {
        return Err(FrameError::TooShort(frame.len()));
    }
    let key = i16::from_be_bytes([frame[0], frame[1]]);
    let version = i16::from_be_bytes([frame[2], frame[3]]);
    let correlation_id = i32::from_be_bytes([frame[4], frame[5], frame[6], frame[7]]);
    let api = ApiKey::try_from(key).map_err(|_| FrameError::UnknownApi(key))?;
    let Some((min, max)) = advertised(api) else {
        return Err(FrameError::UnknownApi(key));
    };
    if version < min || version > max {
        if api == ApiKey::ApiVersions && version > max {
            return Ok(Request::ApiVersionsTooNew { correlation_id });
        }
        return Err(FrameError::UnsupportedVersion {
            api,
            version,
            min,
            max,
        });
    }
    let malformed = |e: anyhow::Error| FrameError::Malformed {
        api,
        version,
        reason: format!("{e:#}"),
    };
    let mut buf = frame;
    let header =
        RequestHeader::decode(&mut buf, api.request_header_version(version)).map_err(malformed)?;
    let body = decode_body(api, version, &mut buf).map_err(malformed)?;
    Ok(Request::Served {
        header,
        api,
        body: Box::new(body),
    })
}

fn decode_body(api: ApiKey, version: i16, buf: &mut Bytes) -> anyhow::Result<Body> {
    Ok(match api {
        ApiKey::ApiVersions => Body::ApiVersions(Decodable::decode(buf, version)?),
        ApiKey::Metadata => Body::Metadata(Decodable::decode(buf, version)?),
        ApiKey::Produce => Body::Produce(Decodable::decode(buf, version)?),
        ApiKey::Fetch => Body::Fetch(Decodable::decode(buf, version)?),
        ApiKey::ListOffsets => Body::ListOffsets(Decodable::decode(buf, version)?),
        ApiKey::OffsetForLeaderEpoch => {
            Body::OffsetForLeaderEpoch(Decodable::decode(buf, version)?)
        }
        ApiKey::InitProducerId => Body::InitProducerId(Decodable::decode(buf, version)?),
        ApiKey::CreateTopics => Body::CreateTopics(Decodable::decode(buf, version)?),
        ApiKey::DeleteTopics => Body::DeleteTopics(Decodable::decode(buf, version)?),
        ApiKey::CreatePartitions => Body::CreatePartitions(Decodable::decode(buf, version)?),
        ApiKey::DescribeConfigs => Body::DescribeConfigs(Decodable::decode(buf, version)?),
        ApiKey::SaslHandshake => Body::SaslHandshake(Decodable::decode(buf, version)?),
        ApiKey::FindCoordinator => Body::FindCoordinator(Decodable::decode(buf, version)?),
        ApiKey::JoinGroup => Body::JoinGroup(Decodable::decode(buf, version)?),
        ApiKey::SyncGroup => Body::SyncGroup(Decodable::decode(buf, version)?),
        ApiKey::Heartbeat => Body::Heartbeat(Decodable::decode(buf, version)?),
        ApiKey::LeaveGroup => Body::LeaveGroup(Decodable::decode(buf, version)?),
        ApiKey::OffsetCommit => Body::OffsetCommit(Decodable::decode(buf, version)?),
        ApiKey::OffsetFetch => Body::OffsetFetch(Decodable::decode(buf, version)?),
        ApiKey::OffsetDelete => Body::OffsetDelete(Decodable::decode(buf, version)?),
        ApiKey::DescribeGroups => Body::DescribeGroups(Decodable::decode(buf, version)?),
        ApiKey::ListGroups => Body::ListGroups(Decodable::decode(buf, version)?),
        ApiKey::DeleteGroups => Body::DeleteGroups(Decodable::decode(buf, version)?),
        ApiKey::ConsumerGroupHeartbeat => {
            Body::ConsumerGroupHeartbeat(Decodable::decode(buf, version)?)
        }
        ApiKey::ConsumerGroupDescribe => {
            Body::ConsumerGroupDescribe(Decodable::decode(buf, version)?)
        }
        ApiKey::IncrementalAlterConfigs => {
            Body::IncrementalAlterConfigs(Decodable::decode(buf, version)?)
        }
        ApiKey::AlterConfigs => Body::AlterConfigs(Decodable::decode(buf, version)?),
        ApiKey::DescribeCluster => Body::DescribeCluster(Decodable::decode(buf, version)?),
        ApiKey::ElectLeaders => Body::ElectLeaders(Decodable::decode(buf, version)?),
        ApiKey::AlterPartitionReassignments => {
            Body::AlterPartitionReassignments(Decodable::decode(buf, version)?)
        }
        ApiKey::ListPartitionReassignments => {
            Body::ListPartitionReassignments(Decodable::decode(buf, version)?)
        }
        ApiKey::DeleteRecords => Body::DeleteRecords(Decodable::decode(buf, version)?),
        ApiKey::AddPartitionsToTxn => Body::AddPartitionsToTxn(Decodable::decode(buf, version)?),
        ApiKey::AddOffsetsToTxn => Body::AddOffsetsToTxn(Decodable::decode(buf, version)?),
        ApiKey::EndTxn => Body::EndTxn(Decodable::decode(buf, version)?),
        ApiKey::TxnOffsetCommit => Body::TxnOffsetCommit(Decodable::decode(buf, version)?),
        ApiKey::DescribeTransactions => {
            Body::DescribeTransactions(Decodable::decode(buf, version)?)
        }
        ApiKey::ListTransactions => Body::ListTransactions(Decodable::decode(buf, version)?),
        other => anyhow::bail!("{other:?} is advertised but has no decoder"),
    })
}

/// Encodes a whole response frame: size prefix, header (at the version `api` and
/// `version` call for) and `body`.
pub fn encode_response<B: Encodable>(
    api: ApiKey,
    version: i16,
    correlation_id: i32,
    body: &B,
) -> anyhow::Result<Bytes> {
    let header = ResponseHeader::default().with_correlation_id(correlation_id);
    let header_version = api.response_header_version(version);
    let size = header.compute_size(header_version)? + body.compute_size(version)?;
    let size_prefix = i32::try_from(size)
        .map_err(|_| anyhow::anyhow!("a {size}-byte response does not fit the size prefix"))?;
    let mut out = BytesMut::with_capacity(4 + size);
    out.put_i32(size_prefix);
    header.encode(&mut out, header_version)?;
    body.encode(&mut out, version)?;
    Ok(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kafka_protocol::messages::RequestHeader;
    use kafka_protocol::protocol::StrBytes;
    use proptest::prelude::*;

    /// A request frame (without size prefix) as a client encodes it.
    pub(crate) fn client_frame<R: Encodable>(api: ApiKey, version: i16, body: &R) -> Bytes {
        let header = RequestHeader::default()
            .with_request_api_key(api as i16)
            .with_request_api_version(version)
            .with_correlation_id(7)
            .with_client_id(Some(StrBytes::from_static_str("test")));
        let mut out = BytesMut::new();
        header
            .encode(&mut out, api.request_header_version(version))
            .unwrap();
        body.encode(&mut out, version).unwrap();
        out.freeze()
    }

    #[test]
    fn a_metadata_request_round_trips() {
        for version in [0, 4, 9, 12] {
            let frame = client_frame(ApiKey::Metadata, version, &MetadataRequest::default());
            let Request::Served { header, api, body } = parse_request(frame).unwrap() else {
                panic!("served");
            };
            assert_eq!(api, ApiKey::Metadata);
            assert_eq!(header.correlation_id, 7);
            assert!(matches!(*body, Body::Metadata(_)));
        }
    }

    #[test]
    fn short_unknown_and_unsupported_frames_are_errors() {
        assert_eq!(
            parse_request(Bytes::from_static(&[0, 3, 0])).unwrap_err(),
            FrameError::TooShort(3)
        );
        // WriteTxnMarkers (27) is a real Kafka API this listener does not serve (it is
        // broker-to-broker).
        let frame = Bytes::from_static(&[0, 27, 0, 1, 0, 0, 0, 1, 0, 0]);
        assert_eq!(
            parse_request(frame).unwrap_err(),
            FrameError::UnknownApi(27)
        );
        let frame = Bytes::from_static(&[0x7f, 0x7f, 0, 0, 0, 0, 0, 1]);
        assert!(matches!(
            parse_request(frame).unwrap_err(),
            FrameError::UnknownApi(_)
        ));
        let frame = client_frame(ApiKey::Metadata, 13, &MetadataRequest::default());
        assert!(matches!(
            parse_request(frame).unwrap_err(),
            FrameError::UnsupportedVersion { .. }
        ));
    }

    #[test]
    fn a_too_new_api_versions_is_answered_not_refused() {
        let frame = Bytes::from_static(&[0, 18, 0, 99, 0, 0, 0, 42, 0, 0]);
        let r = parse_request(frame).unwrap();
        assert!(matches!(
            r,
            Request::ApiVersionsTooNew { correlation_id: 42 }
        ));
    }

    #[test]
    fn a_truncated_body_is_malformed() {
        let frame = client_frame(ApiKey::Produce, 9, &ProduceRequest::default());
        let cut = frame.slice(..frame.len() - 2);
        assert!(matches!(
            parse_request(cut).unwrap_err(),
            FrameError::Malformed { .. }
        ));
    }

    #[test]
    fn a_huge_array_count_is_an_error_not_an_abort() {
        // Metadata v1: header (key 3, v1, correlation 1, client id null), then a topics
        // array claiming 2^31-1 entries with no bytes behind it.
        let frame =
            Bytes::from_static(&[0, 3, 0, 1, 0, 0, 0, 1, 0xff, 0xff, 0x7f, 0xff, 0xff, 0xff]);
        assert!(matches!(
            parse_request(frame).unwrap_err(),
            FrameError::Malformed { .. }
        ));
        // Fetch v12 (flexible): a compact topics array claiming 2^32-2 entries.
        let mut frame = client_frame(ApiKey::Fetch, 12, &FetchRequest::default()).to_vec();
        let topics_at = frame.len() - 4; // topics, forgotten, rack id, tagged fields
        frame.truncate(topics_at);
        frame.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(matches!(
            parse_request(Bytes::from(frame)).unwrap_err(),
            FrameError::Malformed { .. }
        ));
    }

    #[test]
    fn responses_carry_size_and_correlation_id() {
        let body = kafka_protocol::messages::SaslHandshakeResponse::default();
        let out = encode_response(ApiKey::SaslHandshake, 1, 99, &body).unwrap();
        let size = i32::from_be_bytes([out[0], out[1], out[2], out[3]]) as usize;
        assert_eq!(size, out.len() - 4);
        assert_eq!(&out[4..8], &99i32.to_be_bytes());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_request(Bytes::from(bytes));
        }

        #[test]
        fn random_bodies_behind_valid_headers_never_panic(
            which in 0usize..32,
            version in 0i16..18,
            body in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            let keys = [0i16, 1, 2, 3, 18, 19, 20, 22, 23, 32, 37, 17,
                        8, 9, 10, 11, 12, 13, 14, 15, 16, 42, 47, 68, 69,
                        44, 33, 60, 43, 45, 46, 21];
            let mut frame = Vec::new();
            frame.extend_from_slice(&keys[which].to_be_bytes());
            frame.extend_from_slice(&version.to_be_bytes());
            frame.extend_from_slice(&1i32.to_be_bytes());
            frame.extend_from_slice(&body);
            let _ = parse_request(Bytes::from(frame));
        }
    }
}
