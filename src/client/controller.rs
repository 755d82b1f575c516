//! The broker's client of the controller quorum: registration, heartbeats, ISR changes
//! and metadata long-polls, failing over between controllers.

use std::sync::Arc;
use std::time::Duration;

use super::connection::Connection;
use super::error::ClientError;
use crate::api::proto::controller_client::ControllerClient as Grpc;
use crate::api::proto::{
    AllocateProducerIdsRequest, AllocateProducerIdsResponse, AlterPartitionRequest,
    AlterPartitionResponse, BrokerHeartbeatRequest, BrokerHeartbeatResponse, FetchMetadataRequest,
    FetchMetadataResponse, RegisterBrokerRequest, RegisterBrokerResponse,
};
use crate::net::node_auth::ClusterSecret;

/// Talks to the Controller service of a quorum.
pub struct ControllerClient {
    connection: Connection,
}

impl ControllerClient {
    /// A client for the controllers' internal listeners at `addresses`, authenticating
    /// with `secret`; calls give up after `timeout`.
    pub fn new(addresses: Vec<String>, timeout: Duration, secret: Arc<ClusterSecret>) -> Self {
        Self {
            connection: Connection::internal(addresses, timeout, secret),
        }
    }

    /// Registers a broker process.
    pub async fn register_broker(
        &self,
        request: RegisterBrokerRequest,
    ) -> Result<RegisterBrokerResponse, ClientError> {
        self.connection
            .call("register broker", |c| {
                let r = request.clone();
                async move { Grpc::new(c).register_broker(r).await }
            })
            .await
    }

    /// Sends one heartbeat.
    pub async fn heartbeat(
        &self,
        request: BrokerHeartbeatRequest,
    ) -> Result<BrokerHeartbeatResponse, ClientError> {
        self.connection
            .call("broker heartbeat", |c| {
                let request = request.clone();
                async move { Grpc::new(c).broker_heartbeat(request).await }
            })
            .await
    }

    /// Reserves a block of producer ids for a broker.
    pub async fn allocate_producer_ids(
        &self,
        request: AllocateProducerIdsRequest,
    ) -> Result<AllocateProducerIdsResponse, ClientError> {
        self.connection
            .call("allocate producer ids", |c| async move {
                Grpc::new(c).allocate_producer_ids(request).await
            })
            .await
    }

    /// Proposes an ISR change.
    pub async fn alter_partition(
        &self,
        request: AlterPartitionRequest,
    ) -> Result<AlterPartitionResponse, ClientError> {
        self.connection
            .call("alter partition", |c| {
                let r = request.clone();
                async move { Grpc::new(c).alter_partition(r).await }
            })
            .await
    }

    /// The changes after `since_version`, waiting up to `max_wait` for one.
    pub async fn fetch_metadata(
        &self,
        since_version: u64,
        max_wait: Duration,
    ) -> Result<FetchMetadataResponse, ClientError> {
        let request = FetchMetadataRequest {
            since_version,
            max_wait_ms: max_wait.as_millis().min(u32::MAX as u128) as u32,
        };
        self.connection
            .call("fetch metadata", |c| async move {
                Grpc::new(c).fetch_metadata(request).await
            })
            .await
    }
}
