//! Code generated from `proto/tidelog/v1/*.proto` by `build.rs`.
#![allow(missing_docs, clippy::all, clippy::pedantic)]

tonic::include_proto!("tidelog.v1");

/// The encoded descriptor set of every proto file, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("tidelog_descriptor");

/// The HTTP path of `tidelog.v1.Broker/Fetch`, whose answer the broker sends in pieces
/// (`api::fast_path`) and the client decodes from its frames in place
/// (`client::raw_call`).
pub const FETCH_PATH: &str = "/tidelog.v1.Broker/Fetch";

/// The HTTP path of `tidelog.v1.Broker/Produce`, whose request the broker decodes from
/// its frames in place (`api::fast_path`).
pub const PRODUCE_PATH: &str = "/tidelog.v1.Broker/Produce";

/// The HTTP path of `tidelog.v1.Broker/Subscribe`, whose pushed record batches the
/// broker sends in pieces (`api::fast_path`).
pub const SUBSCRIBE_PATH: &str = "/tidelog.v1.Broker/Subscribe";

/// Where a FetchResponse keeps its record batches: sent in pieces by the broker.
pub const FETCH_RESPONSE: Nested<FetchResponse, FetchTopicResponse, FetchPartitionResponse> =
    Nested {
        tags: NestedTags {
            topics: 1,
            partitions: 2,
            bytes: 8,
        },
        topics: |m| &mut m.topics,
        partitions: |t| &mut t.partitions,
        large: |p| &mut p.record_batches,
    };

/// Where a ProduceRequest keeps its record batches: sent in pieces by the client.
pub const PRODUCE_REQUEST: Nested<ProduceRequest, TopicProduceData, PartitionProduceData> =
    Nested {
        tags: NestedTags {
            topics: 3,
            partitions: 2,
            bytes: 3,
        },
        topics: |m| &mut m.topics,
        partitions: |t| &mut t.partitions,
        large: |p| &mut p.record_batches,
    };

use crate::net::grpc_pieces::{Nested, NestedTags};
