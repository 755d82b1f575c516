//! Code generated from `proto/tidelog/v1/*.proto` by `build.rs`.
#![allow(missing_docs, clippy::all, clippy::pedantic)]

tonic::include_proto!("tidelog.v1");

/// The encoded descriptor set of every proto file, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("tidelog_descriptor");
