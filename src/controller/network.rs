//! Raft RPCs between controllers over gRPC (`tidelog.v1.Raft`), carrying openraft's own
//! request and response types as JSON.
//!
//! Each peer gets one lazily connected channel; a failed connection surfaces as
//! `Unreachable` so openraft backs off, and a peer's Raft error comes back as `RemoteError`.
//!
//! Logging: openraft retries an unreachable peer every 500 ms and reports each failure
//! itself (an ERROR line of several hundred characters each time); those reports are
//! filtered out (see `cli::logging`) and this module logs what an operator needs instead:
//! one WARN when a peer stops answering and one INFO when it answers again
//! ([`PeerHealth`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
use tonic::transport::Channel;

use super::raft_types::TypeConfig;
use crate::api::proto::raft_client::RaftClient;
use crate::api::proto::RaftPayload;
use crate::net::node_auth::{internal_channel, ClusterSecret};
use crate::types::NodeId;

/// How long a new connection to a peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Longest error text kept in a log line or in the error handed to openraft.
const ERROR_CHARS_MAX: usize = 160;

/// Creates one [`PeerConnection`] per target controller, to the internal address
/// configured for it (`--peers`; the address stored in the membership only when the
/// target is not configured), authenticated with the cluster secret.
#[derive(Debug, Clone)]
pub struct Network {
    health: Arc<PeerHealth>,
    peers: Arc<std::collections::BTreeMap<NodeId, String>>,
    secret: Arc<ClusterSecret>,
}

impl Network {
    /// A network to `peers` (internal addresses by id) that authenticates with `secret`.
    pub fn new(
        peers: std::collections::BTreeMap<NodeId, String>,
        secret: Arc<ClusterSecret>,
    ) -> Self {
        Self {
            health: Arc::default(),
            peers: Arc::new(peers),
            secret,
        }
    }
}

/// Whether each peer answered its last RPC, shared by every connection to it (openraft
/// makes a new one per replication stream and per election), so that a peer going away
/// is logged once, not once per failed RPC.
#[derive(Debug, Default)]
pub struct PeerHealth {
    /// Peers whose last RPC failed, with when they stopped answering.
    down_since: parking_lot::Mutex<HashMap<NodeId, Instant>>,
}

impl PeerHealth {
    /// Records a failed RPC; logs a WARN only when `target` was answering until now.
    /// Returns true when that happened (a transition).
    pub fn failed(&self, target: NodeId, address: &str, error: &str) -> bool {
        let newly_down = {
            let mut down = self.down_since.lock();
            match down.entry(target) {
                std::collections::hash_map::Entry::Occupied(_) => false,
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(Instant::now());
                    true
                }
            }
        };
        if newly_down {
            tracing::warn!(peer = target, %address, %error, "controller peer not answering; retrying quietly until it does");
        }
        newly_down
    }

    /// Records an answer; logs an INFO only when `target` had stopped answering.
    /// Returns true when that happened (a transition).
    pub fn answered(&self, target: NodeId, address: &str) -> bool {
        let since = self.down_since.lock().remove(&target);
        if let Some(since) = since {
            tracing::info!(peer = target, %address, down_ms = since.elapsed().as_millis() as u64, "controller peer answering again");
        }
        since.is_some()
    }
}

/// `text` cut to [`ERROR_CHARS_MAX`] characters, on one line.
fn short(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    match line.char_indices().nth(ERROR_CHARS_MAX) {
        Some((i, _)) => format!("{}...", &line[..i]),
        None => line.to_owned(),
    }
}

/// A gRPC failure in few words: the code and the first line of the message.
fn describe_status(status: &tonic::Status) -> String {
    short(&format!("{:?}: {}", status.code(), status.message()))
}

/// The Raft RPC client of one peer controller.
pub struct PeerConnection {
    target: NodeId,
    client: Option<RaftClient<Channel>>,
    address: String,
    health: Arc<PeerHealth>,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerConnection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerConnection {
        let address = self.peers.get(&target).unwrap_or(&node.addr).clone();
        let client = internal_channel(&address, self.secret.clone(), CONNECT_TIMEOUT)
            .ok()
            .map(RaftClient::new);
        PeerConnection {
            target,
            client,
            address,
            health: self.health.clone(),
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
        // Give up at the soft deadline, before openraft drops the call at the hard one, so
        // that a peer that stops answering (rather than refusing) is noticed here too.
        let ttl = option.soft_ttl();
        let mut req = tonic::Request::new(RaftPayload { json: json.into() });
        req.set_timeout(ttl);
        let call = async {
            match method {
                Method::AppendEntries => client.append_entries(req).await,
                Method::Vote => client.vote(req).await,
                Method::InstallSnapshot => client.install_snapshot(req).await,
            }
        };
        let response = match tokio::time::timeout(ttl, call).await {
            Ok(r) => r,
            Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                "no answer within {} ms",
                ttl.as_millis()
            ))),
        };
        let payload = match response {
            Ok(r) => r.into_inner(),
            Err(status) => {
                let what = format!(
                    "controller {} at {}: {}",
                    self.target,
                    self.address,
                    describe_status(&status)
                );
                self.health
                    .failed(self.target, &self.address, &describe_status(&status));
                let e = std::io::Error::other(what);
                return Err(match status.code() {
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded => {
                        RPCError::Unreachable(Unreachable::new(&e))
                    }
                    _ => RPCError::Network(NetworkError::new(&e)),
                });
            }
        };
        self.health.answered(self.target, &self.address);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_going_away_and_coming_back_is_two_transitions() {
        let health = PeerHealth::default();
        assert!(health.failed(2, "127.0.0.1:9393", "Unavailable: tcp connect error"));
        for _ in 0..100 {
            assert!(!health.failed(2, "127.0.0.1:9393", "Unavailable: tcp connect error"));
        }
        assert!(!health.answered(3, "127.0.0.1:9394"));
        assert!(health.answered(2, "127.0.0.1:9393"));
        assert!(!health.answered(2, "127.0.0.1:9393"));
    }

    #[test]
    fn errors_are_cut_to_one_short_line() {
        let long = format!("{}\nsecond line", "x".repeat(1000));
        let s = short(&long);
        assert_eq!(s.chars().count(), ERROR_CHARS_MAX + 3);
        assert!(!s.contains('\n'));
    }
}
