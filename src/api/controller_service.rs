//! The `tidelog.v1.Controller` service (broker lifecycle and metadata) and the routing
//! shared with the controller's admin service: a follower forwards leader-only requests to
//! the Raft leader and, before answering, waits until its own image reaches the version
//! the leader reported, so a client reading through the same node sees its own writes.

use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};

use super::convert;
use super::forward::{forwarded, is_forwarded, PeerChannels};
use super::proto::controller_client::ControllerClient;
use super::proto::controller_server::Controller;
use super::proto::{
    AllocateProducerIdsRequest, AllocateProducerIdsResponse, AlterPartitionRequest,
    AlterPartitionResponse, BrokerHeartbeatRequest, BrokerHeartbeatResponse, ControllerStatus,
    FetchMetadataRequest, FetchMetadataResponse, NodeStatusRequest, NodeStatusResponse,
    RegisterBrokerRequest, RegisterBrokerResponse,
};
use crate::controller::command::{MetadataCommand, ReplicaRef};
use crate::controller::node::{Heartbeat, NodeStatus};
use crate::controller::state_machine::MetadataDelta;
use crate::controller::{ControllerError, ControllerNode};
use crate::types::BrokerId;

/// Longest a FetchMetadata long-poll may wait.
pub const FETCH_METADATA_WAIT_MAX: Duration = Duration::from_secs(30);

/// Most changes in one incremental FetchMetadata answer; beyond it a full image is sent.
pub const FETCH_METADATA_CHANGES_MAX: usize = 10_000;

/// How long a follower waits to catch up with a write it forwarded before answering.
const CATCH_UP_WAIT: Duration = Duration::from_secs(2);

/// Where a request is handled.
pub(crate) enum Route {
    /// Here.
    Local,
    /// At the leader, at this address.
    Leader(String),
}

/// Decides whether `node` handles a leader-only request itself or forwards it.
pub(crate) fn route<T>(node: &ControllerNode, request: &Request<T>) -> Route {
    if is_forwarded(request) {
        return Route::Local;
    }
    match node.ensure_leader() {
        Err(ControllerError::NotController {
            leader: Some((_, address)),
            ..
        }) => Route::Leader(address),
        _ => Route::Local,
    }
}

/// In a handler: when a leader-only request reached a follower, forward it to the leader
/// and return the leader's answer (with `catch_up`: after waiting until this node has
/// applied the version the answer reports).
macro_rules! forward_to_leader {
    ($self:ident, $request:ident, $method:ident, catch_up) => {
        if let Route::Leader(address) = route(&$self.node, &$request) {
            let response = $self
                .leader_client(&address)?
                .$method(forwarded($request.into_inner()))
                .await?;
            catch_up(&$self.node, response.get_ref().metadata_version).await;
            return Ok(response);
        }
    };
    ($self:ident, $request:ident, $method:ident) => {
        if let Route::Leader(address) = route(&$self.node, &$request) {
            return $self
                .leader_client(&address)?
                .$method(forwarded($request.into_inner()))
                .await;
        }
    };
}
pub(crate) use forward_to_leader;

/// Waits (bounded) until `node` has applied `version`.
pub(crate) async fn catch_up(node: &ControllerNode, version: u64) {
    if version > 0 && node.store().version() < version {
        node.store()
            .wait_for_version_above(version - 1, CATCH_UP_WAIT)
            .await;
    }
}

/// A node's status on the wire; `lag` is filled in by the leader.
pub(crate) fn status_to_proto(s: &NodeStatus) -> ControllerStatus {
    ControllerStatus {
        id: s.id,
        address: s.address.clone(),
        role: s.role.to_owned(),
        term: s.term,
        commit_index: s.commit_index,
        applied_index: s.applied_index,
        lag: None,
        error: String::new(),
    }
}

/// Serves the Controller service of one controller.
pub struct ControllerService {
    node: Arc<ControllerNode>,
    peers: Arc<PeerChannels>,
}

impl ControllerService {
    /// A service over `node`, forwarding through `peers`.
    pub fn new(node: Arc<ControllerNode>, peers: Arc<PeerChannels>) -> Self {
        Self { node, peers }
    }

    fn leader_client(
        &self,
        address: &str,
    ) -> Result<ControllerClient<tonic::transport::Channel>, Status> {
        Ok(ControllerClient::new(self.peers.get(address)?))
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn register_broker(
        &self,
        request: Request<RegisterBrokerRequest>,
    ) -> Result<Response<RegisterBrokerResponse>, Status> {
        forward_to_leader!(self, request, register_broker, catch_up);
        let r = request.into_inner();
        let (broker_epoch, cluster_id, metadata_version) = self
            .node
            .register_broker(
                BrokerId(r.broker_id),
                r.address,
                r.internal_address,
                r.kafka_address,
                r.rack,
                r.incarnation_id,
            )
            .await?;
        Ok(Response::new(RegisterBrokerResponse {
            broker_epoch,
            cluster_id,
            metadata_version,
        }))
    }

    async fn broker_heartbeat(
        &self,
        request: Request<BrokerHeartbeatRequest>,
    ) -> Result<Response<BrokerHeartbeatResponse>, Status> {
        forward_to_leader!(self, request, broker_heartbeat);
        let r = request.into_inner();
        let outcome = self
            .node
            .broker_heartbeat(Heartbeat {
                broker_id: BrokerId(r.broker_id),
                broker_epoch: r.broker_epoch,
                want_fence: r.want_fence,
                want_shut_down: r.want_shut_down,
                offline_replicas: r
                    .offline_replicas
                    .into_iter()
                    .map(|o| ReplicaRef {
                        topic_id: o.topic_id,
                        partition: o.partition,
                    })
                    .collect(),
            })
            .await?;
        Ok(Response::new(BrokerHeartbeatResponse {
            fenced: outcome.fenced,
            in_controlled_shutdown: outcome.in_controlled_shutdown,
            should_shut_down: outcome.should_shut_down,
            metadata_version: outcome.metadata_version,
            session_timeout_ms: u32::try_from(outcome.session_timeout.as_millis())
                .unwrap_or(u32::MAX),
        }))
    }

    async fn allocate_producer_ids(
        &self,
        request: Request<AllocateProducerIdsRequest>,
    ) -> Result<Response<AllocateProducerIdsResponse>, Status> {
        forward_to_leader!(self, request, allocate_producer_ids);
        let r = request.into_inner();
        self.node
            .check_broker_epoch(BrokerId(r.broker_id), r.broker_epoch)
            .await?;
        let (first, metadata_version) = self.node.allocate_producer_ids(r.count).await?;
        Ok(Response::new(AllocateProducerIdsResponse {
            first_producer_id: first,
            count: r.count,
            metadata_version,
        }))
    }

    async fn alter_partition(
        &self,
        request: Request<AlterPartitionRequest>,
    ) -> Result<Response<AlterPartitionResponse>, Status> {
        forward_to_leader!(self, request, alter_partition, catch_up);
        let r = request.into_inner();
        let cmd = MetadataCommand::AlterPartition {
            broker_id: BrokerId(r.broker_id),
            broker_epoch: r.broker_epoch,
            topic: r.topic,
            topic_id: r.topic_id,
            partition: r.partition,
            leader_epoch: r.leader_epoch,
            partition_epoch: r.partition_epoch,
            new_isr: r.new_isr.into_iter().map(BrokerId).collect(),
        };
        let (partition, metadata_version) = self.node.alter_partition(cmd).await?;
        Ok(Response::new(AlterPartitionResponse {
            partition: Some(convert::partition_to_proto(&partition)),
            metadata_version,
        }))
    }

    async fn fetch_metadata(
        &self,
        request: Request<FetchMetadataRequest>,
    ) -> Result<Response<FetchMetadataResponse>, Status> {
        let r = request.into_inner();
        let store = self.node.store();
        let since = r.since_version;
        if since != 0 && since >= store.version() {
            let wait = Duration::from_millis(r.max_wait_ms.into()).min(FETCH_METADATA_WAIT_MAX);
            store.wait_for_version_above(since, wait).await;
        }
        if since > store.version() {
            // The caller learned a newer version elsewhere; never send it backwards.
            return Ok(Response::new(FetchMetadataResponse {
                version: since,
                image: None,
                changes: Vec::new(),
            }));
        }
        let response = match store.delta_since(since, FETCH_METADATA_CHANGES_MAX) {
            MetadataDelta::Full { image, version } => FetchMetadataResponse {
                version,
                image: Some(convert::image_to_proto(&image)),
                changes: Vec::new(),
            },
            MetadataDelta::Changes { changes, version } => FetchMetadataResponse {
                version,
                image: None,
                changes: changes
                    .iter()
                    .map(|(v, c)| convert::change_to_proto(*v, c))
                    .collect(),
            },
        };
        Ok(Response::new(response))
    }

    async fn node_status(
        &self,
        _request: Request<NodeStatusRequest>,
    ) -> Result<Response<NodeStatusResponse>, Status> {
        Ok(Response::new(NodeStatusResponse {
            status: Some(status_to_proto(&self.node.status().await)),
        }))
    }
}
