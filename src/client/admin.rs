//! The admin client: topics and cluster state, through any broker or controller.

use std::collections::BTreeMap;
use std::time::Duration;

use super::connection::Connection;
use super::error::ClientError;
use crate::api::proto::admin_client::AdminClient as Grpc;
use crate::api::proto::{
    AlterTopicRequest, AlterTopicResponse, CreateTopicRequest, CreateTopicResponse,
    DeleteTopicRequest, DescribeClusterRequest, DescribeClusterResponse, DescribeTopicsRequest,
    DescribeTopicsResponse, ListTopicsRequest, ListTopicsResponse,
};
use crate::error_code::ErrorCode;

/// Admin answers come from the controllers' authoritative metadata: an unknown topic
/// is final, unlike for produce and fetch, where metadata may still be propagating.
fn retriable(code: ErrorCode) -> bool {
    code.is_retriable() && code != ErrorCode::UnknownTopicOrPartition
}

/// Talks to the Admin service of a cluster.
pub struct AdminClient {
    connection: Connection,
}

impl AdminClient {
    /// A client for the cluster at `bootstrap`; each call gives up after `timeout`.
    pub fn new(bootstrap: Vec<String>, timeout: Duration) -> Self {
        Self {
            connection: Connection::new(bootstrap, timeout),
        }
    }

    /// Creates a topic.
    pub async fn create_topic(
        &self,
        name: &str,
        partitions: Option<u32>,
        replication_factor: Option<u32>,
        config: BTreeMap<String, String>,
    ) -> Result<CreateTopicResponse, ClientError> {
        let request = CreateTopicRequest {
            name: name.to_owned(),
            partitions,
            replication_factor,
            config,
            validate_only: false,
        };
        self.connection
            .call_retrying("create topic", retriable, |c| {
                let r = request.clone();
                async move { Grpc::new(c).create_topic(r).await }
            })
            .await
    }

    /// Creates a topic from a full request (validate-only included).
    pub async fn create_topic_request(
        &self,
        request: CreateTopicRequest,
    ) -> Result<CreateTopicResponse, ClientError> {
        self.connection
            .call_retrying("create topic", retriable, |c| {
                let r = request.clone();
                async move { Grpc::new(c).create_topic(r).await }
            })
            .await
    }

    /// Lists topics.
    pub async fn list_topics(&self) -> Result<ListTopicsResponse, ClientError> {
        self.connection
            .call_retrying("list topics", retriable, |c| async move {
                Grpc::new(c).list_topics(ListTopicsRequest {}).await
            })
            .await
    }

    /// Describes the named topics (all when `names` is empty).
    pub async fn describe_topics(
        &self,
        names: Vec<String>,
    ) -> Result<DescribeTopicsResponse, ClientError> {
        let request = DescribeTopicsRequest { names };
        self.connection
            .call_retrying("describe topics", retriable, |c| {
                let r = request.clone();
                async move { Grpc::new(c).describe_topics(r).await }
            })
            .await
    }

    /// Adds partitions and/or changes configuration.
    pub async fn alter_topic(
        &self,
        request: AlterTopicRequest,
    ) -> Result<AlterTopicResponse, ClientError> {
        self.connection
            .call_retrying("alter topic", retriable, |c| {
                let r = request.clone();
                async move { Grpc::new(c).alter_topic(r).await }
            })
            .await
    }

    /// Deletes a topic; returns the metadata version at which it is gone.
    pub async fn delete_topic(&self, name: &str) -> Result<u64, ClientError> {
        let request = DeleteTopicRequest {
            name: name.to_owned(),
        };
        self.connection
            .call_retrying("delete topic", retriable, |c| {
                let r = request.clone();
                async move { Grpc::new(c).delete_topic(r).await }
            })
            .await
            .map(|r| r.metadata_version)
    }

    /// Controllers, brokers and partition health.
    pub async fn describe_cluster(&self) -> Result<DescribeClusterResponse, ClientError> {
        self.connection
            .call_retrying("describe cluster", retriable, |c| async move {
                Grpc::new(c)
                    .describe_cluster(DescribeClusterRequest {})
                    .await
            })
            .await
    }
}
