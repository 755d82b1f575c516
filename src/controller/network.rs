//! Raft RPCs between controllers over gRPC (`tidelog.v1.Raft`), carrying openraft's own
//! request and response types as JSON.
//!
//! Each peer gets one lazily connected channel; a failed connection surfaces as
//! `Unreachable` so openraft backs off, and a peer's Raft error comes back as `RemoteError`.

use std::time::Duration;

use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::transport::{Channel, Endpoint};

use super::raft_types::TypeConfig;
use crate::api::proto::raft_client::RaftClient;
use crate::api::proto::RaftPayload;
use crate::types::NodeId;

/// How long a new connection to a peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Creates one [`PeerConnection`] per target controller.
#[derive(Debug, Clone, Default)]
pub struct Network;

/// The Raft RPC client of one peer controller.
pub struct PeerConnection {
    target: NodeId,
    client: Option<RaftClient<Channel>>,
    address: String,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerConnection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerConnection {
        let client = Endpoint::from_shared(format!("http://{}", node.addr))
            .ok()
            .map(|e| {
                RaftClient::new(
                    e.connect_timeout(CONNECT_TIMEOUT)
                        .tcp_nodelay(true)
                        .connect_lazy(),
                )
            });
        PeerConnection {
            target,
            client,
            address: node.addr.clone(),
        }
    }
}

type RpcResult<T, E> = Result<T, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>;

impl PeerConnection {
    async fn call<Req, Resp, E>(
        &mut self,
        method: Method,
        request: &Req,
        option: RPCOption,
    ) -> RpcResult<Resp, E>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let Some(client) = self.client.as_mut() else {
            let e = std::io::Error::other(format!("invalid peer address '{}'", self.address));
            return Err(RPCError::Unreachable(Unreachable::new(&e)));
        };
        let json =
            serde_json::to_vec(request).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let mut req = tonic::Request::new(RaftPayload { json: json.into() });
        req.set_timeout(option.hard_ttl());
        let response = match method {
            Method::AppendEntries => client.append_entries(req).await,
            Method::Vote => client.vote(req).await,
            Method::InstallSnapshot => client.install_snapshot(req).await,
        };
        let payload = match response {
            Ok(r) => r.into_inner(),
            Err(status) => {
                return Err(match status.code() {
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded => {
                        RPCError::Unreachable(Unreachable::new(&status))
                    }
                    _ => RPCError::Network(NetworkError::new(&status)),
                })
            }
        };
        let result: Result<Resp, RaftError<NodeId, E>> = serde_json::from_slice(&payload.json)
            .map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

#[derive(Clone, Copy)]
enum Method {
    AppendEntries,
    Vote,
    InstallSnapshot,
}

impl RaftNetwork<TypeConfig> for PeerConnection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, openraft::error::Infallible> {
        self.call(Method::AppendEntries, &rpc, option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, InstallSnapshotError> {
        self.call(Method::InstallSnapshot, &rpc, option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, openraft::error::Infallible> {
        self.call(Method::Vote, &rpc, option).await
    }
}
