//! The public `tidelog.v1.Admin` service as a broker serves it: calls go to the
//! controllers through the admin client (which finds the Raft leader), and DescribeTopics
//! gains the offsets (log start, high watermark, log end) of the partitions this broker
//! leads. InitProducerId is answered here, from the ids the broker reserved in advance.
//!
//! While no controller answers the broker's heartbeats, metadata changes (create, alter,
//! delete, elect) fail at once with the retriable `CONTROLLER_UNAVAILABLE`, and topic
//! listings and descriptions are answered from the broker's last metadata image.

use tonic::{Request, Response, Status};

use super::admin_service::ControllerAdminService;
use super::convert;
use super::proto::admin_server::Admin;
use super::proto::{
    AlterTopicRequest, AlterTopicResponse, CreateTopicRequest, CreateTopicResponse,
    DeleteTopicRequest, DeleteTopicResponse, DescribeClusterRequest, DescribeClusterResponse,
    DescribeTopicsRequest, DescribeTopicsResponse, ElectLeadersRequest, ElectLeadersResponse,
    InitProducerIdRequest, InitProducerIdResponse, ListTopicsRequest, ListTopicsResponse,
    PartitionOffsets, ScheduledPending,
};
use super::status::error_status;
use crate::broker::timer::Timers;
use crate::broker::BrokerNode;
use crate::client::{AdminClient, ClientError};
use crate::controller::validation;
use crate::error_code::ErrorCode;
use std::sync::Arc;

/// How long InitProducerId waits for a block of ids when the broker has none left.
const PRODUCER_ID_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Where a broker's admin calls go.
pub enum AdminBackend {
    /// To the controllers over gRPC.
    Remote(Box<AdminClient>),
    /// To the controller in this process (`standalone`).
    Local(Box<ControllerAdminService>),
}

/// Serves the Admin service on a broker.
pub struct BrokerAdminService {
    backend: AdminBackend,
    node: BrokerNode,
    /// This broker's timers: topic descriptions count their pending delayed records.
    timers: Option<Arc<Timers>>,
}

impl BrokerAdminService {
    /// A service forwarding to `backend`.
    pub fn new(backend: AdminBackend, node: BrokerNode) -> Self {
        Self {
            backend,
            node,
            timers: None,
        }
    }

    /// Topic descriptions include the pending delayed records of `timers`.
    pub fn with_timers(mut self, timers: Arc<Timers>) -> Self {
        self.timers = Some(timers);
        self
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

impl BrokerAdminService {
    /// True when calls go to remote controllers that do not answer right now.
    fn controllers_down(&self) -> bool {
        matches!(self.backend, AdminBackend::Remote(_)) && !self.node.controllers_reachable()
    }

    /// Refuses a client's `action` on a reserved internal topic (the broker's own paths,
    /// such as creating `__consumer_offsets`, go to the controllers' internal listener).
    fn check_may_change(topic: &str, action: &str) -> Result<(), Status> {
        validation::check_client_may_change(topic, action)
            .map_err(|e| error_status(e.code, e.message, None))
    }

    /// Refuses a metadata change at once while the controllers are down.
    fn check_controllers(&self, what: &str) -> Result<(), Status> {
        if self.controllers_down() {
            return Err(error_status(
                ErrorCode::ControllerUnavailable,
                format!("cannot {what}: no controller answers this broker; produce and fetch keep working, retry the change once the controllers are back"),
                None,
            ));
        }
        Ok(())
    }

    /// Topic listing from this broker's metadata image.
    fn list_topics_cached(&self) -> ListTopicsResponse {
        let metadata = self.node.metadata();
        let version = metadata.version();
        metadata.read(|image| convert::list_topics_response(image, version))
    }

    /// Topic descriptions from this broker's metadata image.
    fn describe_topics_cached(&self, names: &[String]) -> Result<DescribeTopicsResponse, Status> {
        let metadata = self.node.metadata();
        let version = metadata.version();
        metadata
            .read(|image| convert::describe_topics_response(image, version, names))
            .map_err(|missing| error_status(ErrorCode::UnknownTopicOrPartition, missing, None))
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
        Self::check_may_change(&r.name, "create")?;
        self.check_controllers("create a topic")?;
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
        if self.controllers_down() {
            return Ok(Response::new(self.list_topics_cached()));
        }
        let response = via_backend!(self, list_topics, ListTopicsRequest {}, c => c.list_topics());
        Ok(Response::new(response))
    }

    async fn describe_topics(
        &self,
        request: Request<DescribeTopicsRequest>,
    ) -> Result<Response<DescribeTopicsResponse>, Status> {
        let r = request.into_inner();
        let mut response = if self.controllers_down() {
            self.describe_topics_cached(&r.topics)?
        } else {
            via_backend!(self, describe_topics, r.clone(), c => c.describe_topics(r.topics.clone()))
        };
        let pending = self.timers.as_ref().map(|t| t.pending_by_topic());
        for d in &mut response.topics {
            let Some(t) = &d.topic else { continue };
            if let Some(pending) = &pending {
                d.scheduled.push(ScheduledPending {
                    broker_id: self.node.id().0,
                    records: pending.get(&t.name).copied().unwrap_or(0),
                });
            }
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
                        size_bytes: local.log.size_bytes(),
                        last_stable_offset: local.log.last_stable_offset().as_i64(),
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
        Self::check_may_change(&r.name, "alter")?;
        self.check_controllers("alter a topic")?;
        let response = via_backend!(self, alter_topic, r.clone(), c => c.alter_topic(r.clone()));
        Ok(Response::new(response))
    }

    async fn init_producer_id(
        &self,
        request: Request<InitProducerIdRequest>,
    ) -> Result<Response<InitProducerIdResponse>, Status> {
        let _ = request;
        let producer_id = self
            .node
            .producer_ids()
            .next(PRODUCER_ID_WAIT)
            .await
            .map_err(|e| error_status(e.code, e.message, None))?;
        Ok(Response::new(InitProducerIdResponse {
            producer_id,
            producer_epoch: 0,
        }))
    }

    async fn elect_leaders(
        &self,
        request: Request<ElectLeadersRequest>,
    ) -> Result<Response<ElectLeadersResponse>, Status> {
        let r = request.into_inner();
        self.check_controllers("elect leaders")?;
        let response =
            via_backend!(self, elect_leaders, r.clone(), c => c.elect_leaders(r.topics.clone()));
        Ok(Response::new(response))
    }

    async fn delete_topic(
        &self,
        request: Request<DeleteTopicRequest>,
    ) -> Result<Response<DeleteTopicResponse>, Status> {
        let r = request.into_inner();
        Self::check_may_change(&r.name, "delete")?;
        self.check_controllers("delete a topic")?;
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
