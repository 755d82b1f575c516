//! The `tidelog.v1.Raft` service: hands peer controllers' Raft RPCs to openraft.

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::{Request, Response, Status};

use super::proto::raft_server::Raft;
use super::proto::RaftPayload;
use crate::controller::ControllerNode;

/// Serves Raft RPCs for one controller.
pub struct RaftService {
    node: Arc<ControllerNode>,
}

impl RaftService {
    /// A service over `node`.
    pub fn new(node: Arc<ControllerNode>) -> Self {
        Self { node }
    }
}

fn decode<T: DeserializeOwned>(request: Request<RaftPayload>) -> Result<T, Status> {
    serde_json::from_slice(&request.into_inner().json)
        .map_err(|e| Status::invalid_argument(format!("undecodable raft request: {e}")))
}

fn encode<T: Serialize>(value: &T) -> Result<Response<RaftPayload>, Status> {
    serde_json::to_vec(value)
        .map(|json| Response::new(RaftPayload { json: json.into() }))
        .map_err(|e| Status::internal(format!("unencodable raft response: {e}")))
}

#[tonic::async_trait]
impl Raft for RaftService {
    async fn append_entries(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode(request)?;
        encode(&self.node.raft().append_entries(rpc).await)
    }

    async fn vote(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode(request)?;
        encode(&self.node.raft().vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode(request)?;
        encode(&self.node.raft().install_snapshot(rpc).await)
    }
}
