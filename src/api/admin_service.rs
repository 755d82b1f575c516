//! The public `tidelog.v1.Admin` service as a controller serves it. Writes go to the Raft
//! leader (forwarded by followers); reads are linearizable on the leader, forwarded there by
//! followers, and answered from the local image only when no leader is known.

use std::sync::Arc;
use std::time::Duration;

use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use super::controller_service::{catch_up, forward_to_leader, route, status_to_proto, Route};
use super::convert;
use super::forward::{forwarded, PeerChannels};
use super::proto::admin_client::AdminClient;
use super::proto::admin_server::Admin;
use super::proto::controller_client::ControllerClient;
use super::proto::{
    AlterTopicRequest, AlterTopicResponse, BrokerStatus, ControllerStatus, CreateTopicRequest,
    CreateTopicResponse, DeleteTopicRequest, DeleteTopicResponse, DescribeClusterRequest,
    DescribeClusterResponse, DescribeTopicsRequest, DescribeTopicsResponse, ElectLeadersRequest,
    ElectLeadersResponse, InitProducerIdRequest, InitProducerIdResponse, ListTopicsRequest,
    ListTopicsResponse, NodeStatusRequest,
};
use crate::controller::command::Reassignment;
use crate::controller::node::{NewTopic, TopicAlteration};
use crate::controller::validation;
use crate::controller::{ControllerError, ControllerNode};
use crate::error_code::ErrorCode;
use crate::types::BrokerId;

/// How long `cluster describe` waits for each peer's status.
const PEER_STATUS_TIMEOUT: Duration = Duration::from_secs(1);

/// Who calls a service: decides whether reserved internal topics may be changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Callers {
    /// A client port: reserved topics (`__*`) are refused.
    Clients,
    /// The internal listener: authenticated nodes, which create `__consumer_offsets`.
    Nodes,
}

/// Serves the Admin service of one controller.
pub struct ControllerAdminService {
    node: Arc<ControllerNode>,
    peers: Arc<PeerChannels>,
    callers: Callers,
}

impl ControllerAdminService {
    /// A service over `node` for `callers`, forwarding through `peers`.
    pub fn new(node: Arc<ControllerNode>, peers: Arc<PeerChannels>, callers: Callers) -> Self {
        Self {
            node,
            peers,
            callers,
        }
    }

    /// Refuses a client's `action` on a reserved internal topic.
    fn check_may_change(&self, topic: &str, action: &str) -> Result<(), Status> {
        if self.callers == Callers::Nodes {
            return Ok(());
        }
        validation::check_client_may_change(topic, action)
            .map_err(|e| ControllerError::from(e).into())
    }

    fn leader_client(&self, address: &str) -> Result<AdminClient<Channel>, Status> {
        Ok(AdminClient::new(self.peers.get(address)?))
    }

    /// Before a local read: a barrier on the leader; nothing when no leader is known.
    async fn read_barrier_if_leader(&self) -> Result<(), Status> {
        match self.node.read_barrier().await {
            Ok(()) | Err(ControllerError::NotController { leader: None, .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn describe_cluster_locally(&self) -> DescribeClusterResponse {
        let own = self.node.status().await;
        let is_leader = own.leader == Some(own.id);
        let mut tasks = tokio::task::JoinSet::new();
        for (id, address) in self.node.peers() {
            if *id == own.id {
                continue;
            }
            let (id, address) = (*id, address.clone());
            let channel = self.peers.get(&address);
            tasks.spawn(async move {
                let unreachable = |error: String| ControllerStatus {
                    id,
                    address: address.clone(),
                    role: "unreachable".to_owned(),
                    error,
                    ..Default::default()
                };
                let channel = match channel {
                    Ok(c) => c,
                    Err(e) => return unreachable(e.message().to_owned()),
                };
                let mut request = Request::new(NodeStatusRequest {});
                request.set_timeout(PEER_STATUS_TIMEOUT);
                let mut client = ControllerClient::new(channel);
                match tokio::time::timeout(PEER_STATUS_TIMEOUT, client.node_status(request)).await {
                    Ok(Ok(r)) => r
                        .into_inner()
                        .status
                        .unwrap_or_else(|| unreachable("empty answer".to_owned())),
                    Ok(Err(status)) => unreachable(status.message().to_owned()),
                    Err(_) => unreachable("timed out".to_owned()),
                }
            });
        }
        let mut own_proto = status_to_proto(&own);
        if is_leader {
            own_proto.lag = Some(0);
        }
        let mut controllers = vec![own_proto];
        while let Some(done) = tasks.join_next().await {
            if let Ok(mut status) = done {
                if is_leader {
                    status.lag = own
                        .matched
                        .get(&status.id)
                        .map(|m| own.last_log_index.saturating_sub(*m));
                }
                controllers.push(status);
            }
        }
        controllers.sort_by_key(|c| c.id);
        let ages = if is_leader {
            self.node.heartbeat_ages()
        } else {
            Default::default()
        };
        let (cluster_id, version, brokers, under_replicated, offline) =
            self.node.store().read(|image, version| {
                let brokers = image
                    .brokers
                    .values()
                    .map(|b| BrokerStatus {
                        broker: Some(convert::broker_to_proto(b)),
                        last_heartbeat_age_ms: ages.get(&b.id).copied(),
                        under_replicated_partitions: image
                            .topics
                            .values()
                            .flat_map(|t| &t.partitions)
                            .filter(|p| p.leader == Some(b.id) && p.isr.len() < p.replicas.len())
                            .count() as u32,
                    })
                    .collect();
                (
                    image.cluster_id.clone().unwrap_or_default(),
                    version,
                    brokers,
                    image.under_replicated_partitions() as u32,
                    image.offline_partitions() as u32,
                )
            });
        DescribeClusterResponse {
            cluster_id,
            leader: own.leader,
            metadata_version: version,
            controllers,
            brokers,
            under_replicated_partitions: under_replicated,
            offline_partitions: offline,
        }
    }
}

#[tonic::async_trait]
impl Admin for ControllerAdminService {
    async fn create_topic(
        &self,
        request: Request<CreateTopicRequest>,
    ) -> Result<Response<CreateTopicResponse>, Status> {
        self.check_may_change(&request.get_ref().name, "create")?;
        forward_to_leader!(self, request, create_topic, catch_up);
        let r = request.into_inner();
        let (topic, metadata_version) = self
            .node
            .create_topic(NewTopic {
                name: r.name,
                partitions: r.partitions,
                replication_factor: r.replication_factor,
                config: r.config,
                validate_only: r.validate_only,
            })
            .await?;
        Ok(Response::new(CreateTopicResponse {
            topic: Some(convert::topic_to_proto(&topic)),
            metadata_version,
        }))
    }

    async fn list_topics(
        &self,
        request: Request<ListTopicsRequest>,
    ) -> Result<Response<ListTopicsResponse>, Status> {
        forward_to_leader!(self, request, list_topics);
        self.read_barrier_if_leader().await?;
        let response = self.node.store().read(convert::list_topics_response);
        Ok(Response::new(response))
    }

    async fn describe_topics(
        &self,
        request: Request<DescribeTopicsRequest>,
    ) -> Result<Response<DescribeTopicsResponse>, Status> {
        forward_to_leader!(self, request, describe_topics);
        self.read_barrier_if_leader().await?;
        let names = request.into_inner().topics;
        let response = self
            .node
            .store()
            .read(|image, version| convert::describe_topics_response(image, version, &names))
            .map_err(|missing| {
                Status::from(ControllerError::rejected(
                    ErrorCode::UnknownTopicOrPartition,
                    missing,
                ))
            })?;
        Ok(Response::new(response))
    }

    async fn alter_topic(
        &self,
        request: Request<AlterTopicRequest>,
    ) -> Result<Response<AlterTopicResponse>, Status> {
        self.check_may_change(&request.get_ref().name, "alter")?;
        forward_to_leader!(self, request, alter_topic, catch_up);
        let r = request.into_inner();
        let (topic, metadata_version) = self
            .node
            .alter_topic(TopicAlteration {
                name: r.name,
                partitions: r.partitions,
                set_config: r.set_config,
                delete_config: r.delete_config,
                reassignments: r
                    .reassignments
                    .iter()
                    .map(|a| Reassignment {
                        partition: a.partition,
                        replicas: a.replicas.iter().map(|&b| BrokerId(b)).collect(),
                    })
                    .collect(),
            })
            .await?;
        Ok(Response::new(AlterTopicResponse {
            topic: Some(convert::topic_to_proto(&topic)),
            metadata_version,
        }))
    }

    async fn init_producer_id(
        &self,
        request: Request<InitProducerIdRequest>,
    ) -> Result<Response<InitProducerIdResponse>, Status> {
        forward_to_leader!(self, request, init_producer_id);
        let (producer_id, _) = self.node.allocate_producer_id().await?;
        Ok(Response::new(InitProducerIdResponse {
            producer_id,
            producer_epoch: 0,
        }))
    }

    async fn elect_leaders(
        &self,
        request: Request<ElectLeadersRequest>,
    ) -> Result<Response<ElectLeadersResponse>, Status> {
        forward_to_leader!(self, request, elect_leaders, catch_up);
        let (elected, metadata_version) = self
            .node
            .elect_preferred_leaders(request.into_inner().topics)
            .await?;
        Ok(Response::new(ElectLeadersResponse {
            elected: elected as u32,
            metadata_version,
        }))
    }

    async fn delete_topic(
        &self,
        request: Request<DeleteTopicRequest>,
    ) -> Result<Response<DeleteTopicResponse>, Status> {
        self.check_may_change(&request.get_ref().name, "delete")?;
        forward_to_leader!(self, request, delete_topic, catch_up);
        let metadata_version = self.node.delete_topic(&request.into_inner().name).await?;
        Ok(Response::new(DeleteTopicResponse { metadata_version }))
    }

    async fn describe_cluster(
        &self,
        request: Request<DescribeClusterRequest>,
    ) -> Result<Response<DescribeClusterResponse>, Status> {
        if let Route::Leader(address) = route(&self.node, &request) {
            let forwarded_call = self
                .leader_client(&address)?
                .describe_cluster(forwarded(request.into_inner()))
                .await;
            if let Ok(response) = forwarded_call {
                return Ok(response);
            }
            // The leader is unreachable: describe what this node can see.
        }
        Ok(Response::new(self.describe_cluster_locally().await))
    }
}
