//! The public `tidelog.v1.Admin` service as a broker serves it: every call goes to the
//! controllers through the admin client (which finds the Raft leader), and DescribeTopics
//! gains the offsets (log start, high watermark, log end) of the partitions this broker
//! leads.

use tonic::{Request, Response, Status};

use super::admin_service::ControllerAdminService;
use super::proto::admin_server::Admin;
use super::proto::{
    AlterTopicRequest, AlterTopicResponse, CreateTopicRequest, CreateTopicResponse,
    DeleteTopicRequest, DeleteTopicResponse, DescribeClusterRequest, DescribeClusterResponse,
    DescribeTopicsRequest, DescribeTopicsResponse, ElectLeadersRequest, ElectLeadersResponse,
    InitProducerIdRequest, InitProducerIdResponse, ListTopicsRequest, ListTopicsResponse,
    PartitionOffsets,
};
use super::status::error_status;
use crate::broker::BrokerNode;
use crate::client::{AdminClient, ClientError};

/// Where a broker's admin calls go.
pub enum AdminBackend {
    /// To the controllers over gRPC.
    Remote(AdminClient),
    /// To the controller in this process (`standalone`).
    Local(Box<ControllerAdminService>),
}

/// Serves the Admin service on a broker.
pub struct BrokerAdminService {
    backend: AdminBackend,
    node: BrokerNode,
}

impl BrokerAdminService {
    /// A service forwarding to `backend`.
    pub fn new(backend: AdminBackend, node: BrokerNode) -> Self {
        Self { backend, node }
    }
}

impl BrokerAdminService {
    /// Waits (up to 5 s) until this broker holds metadata `version` and has opened the
    /// partitions of `topic` assigned to it, so a client that produces right after
    /// creating a topic through this broker does not race the partition's creation.
    async fn wait_until_open(&self, topic: &str, version: u64) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        let me = self.node.id();
        loop {
            let cache = self.node.metadata();
            let ready = cache.version() >= version
                && cache.topic(topic).is_some_and(|t| {
                    t.partitions
                        .iter()
                        .filter(|p| p.replicas.contains(&me))
                        .all(|p| self.node.partitions().get(topic, p.partition).is_some())
                });
            if ready || tokio::time::Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}

fn status(e: ClientError) -> Status {
    error_status(e.code, e.message, None)
}

/// Calls `$method` on the backend: the client's method for Remote, the service's for Local.
macro_rules! via_backend {
    ($self:ident, $method:ident, $request:expr, $client:ident => $remote:expr) => {
        match &$self.backend {
            AdminBackend::Remote($client) => $remote.await.map_err(status)?,
            AdminBackend::Local(service) => {
                service.$method(Request::new($request)).await?.into_inner()
            }
        }
    };
}

#[tonic::async_trait]
impl Admin for BrokerAdminService {
    async fn create_topic(
        &self,
        request: Request<CreateTopicRequest>,
    ) -> Result<Response<CreateTopicResponse>, Status> {
        let r = request.into_inner();
        let response =
            via_backend!(self, create_topic, r.clone(), c => c.create_topic_request(r.clone()));
        if let Some(topic) = &response.topic {
            if !r.validate_only {
                self.wait_until_open(&topic.name, response.metadata_version)
                    .await;
            }
        }
        Ok(Response::new(response))
    }

    async fn list_topics(
        &self,
        _request: Request<ListTopicsRequest>,
    ) -> Result<Response<ListTopicsResponse>, Status> {
        let response = via_backend!(self, list_topics, ListTopicsRequest {}, c => c.list_topics());
        Ok(Response::new(response))
    }

    async fn describe_topics(
        &self,
        request: Request<DescribeTopicsRequest>,
    ) -> Result<Response<DescribeTopicsResponse>, Status> {
        let r = request.into_inner();
        let mut response =
            via_backend!(self, describe_topics, r.clone(), c => c.describe_topics(r.names.clone()));
        for d in &mut response.topics {
            let Some(t) = &d.topic else { continue };
            for p in &t.partitions {
                if p.leader != Some(self.node.id().0) {
                    continue;
                }
                if let Some(local) = self.node.partitions().get(&t.name, p.partition) {
                    d.offsets.push(PartitionOffsets {
                        partition: p.partition,
                        log_start_offset: local.log.log_start_offset().as_i64(),
                        high_watermark: local.log.high_watermark().as_i64(),
                        log_end_offset: local.log.log_end_offset().as_i64(),
                    });
                }
            }
        }
        Ok(Response::new(response))
    }

    async fn alter_topic(
        &self,
        request: Request<AlterTopicRequest>,
    ) -> Result<Response<AlterTopicResponse>, Status> {
        let r = request.into_inner();
        let response = via_backend!(self, alter_topic, r.clone(), c => c.alter_topic(r.clone()));
        Ok(Response::new(response))
    }

    async fn init_producer_id(
        &self,
        request: Request<InitProducerIdRequest>,
    ) -> Result<Response<InitProducerIdResponse>, Status> {
        let r = request.into_inner();
        let response = via_backend!(self, init_producer_id, r, c => c.init_producer_id());
        Ok(Response::new(response))
    }

    async fn elect_leaders(
        &self,
        request: Request<ElectLeadersRequest>,
    ) -> Result<Response<ElectLeadersResponse>, Status> {
        let r = request.into_inner();
        let response =
            via_backend!(self, elect_leaders, r.clone(), c => c.elect_leaders(r.topics.clone()));
        Ok(Response::new(response))
    }

    async fn delete_topic(
        &self,
        request: Request<DeleteTopicRequest>,
    ) -> Result<Response<DeleteTopicResponse>, Status> {
        let r = request.into_inner();
        let response = match &self.backend {
            AdminBackend::Remote(c) => DeleteTopicResponse {
                metadata_version: c.delete_topic(&r.name).await.map_err(status)?,
            },
            AdminBackend::Local(service) => {
                service.delete_topic(Request::new(r)).await?.into_inner()
            }
        };
        Ok(Response::new(response))
    }

    async fn describe_cluster(
        &self,
        _request: Request<DescribeClusterRequest>,
    ) -> Result<Response<DescribeClusterResponse>, Status> {
        let response = via_backend!(self, describe_cluster, DescribeClusterRequest {}, c => c.describe_cluster());
        Ok(Response::new(response))
    }
}
