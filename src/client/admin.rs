//! The admin client: topics and cluster state, through any broker or controller.

use std::collections::BTreeMap;
use std::time::Duration;

use super::connection::Connection;
use super::error::ClientError;
use crate::api::proto::admin_client::AdminClient as Grpc;
use crate::api::proto::{
    AlterTopicRequest, AlterTopicResponse, CreateTopicRequest, CreateTopicResponse,
    DeleteTopicRequest, DescribeClusterRequest, DescribeClusterResponse, DescribeTopicsRequest,
    DescribeTopicsResponse, ElectLeadersRequest, ElectLeadersResponse, InitProducerIdRequest,
    InitProducerIdResponse, ListTopicsRequest, ListTopicsResponse, TopicDescription,
};
use crate::error_code::ErrorCode;

/// How long `describe_topics_with_offsets` waits for each leader broker.
const OFFSETS_FAN_OUT_TIMEOUT: Duration = Duration::from_secs(2);

/// Admin answers come from the controllers' authoritative metadata: an unknown topic
/// is final, unlike for produce and fetch, where metadata may still be propagating. A
/// controller outage is reported at once (the code stays retriable for the caller):
/// an operator should not wait a whole timeout to learn that the quorum is down.
fn retriable(code: ErrorCode) -> bool {
    code.is_retriable()
        && code != ErrorCode::UnknownTopicOrPartition
        && code != ErrorCode::ControllerUnavailable
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

    /// A node's client of the controllers' internal listeners at `controllers`,
    /// authenticating with `secret` (brokers forward admin calls this way).
    pub fn internal(
        controllers: Vec<String>,
        timeout: Duration,
        secret: std::sync::Arc<crate::net::node_auth::ClusterSecret>,
    ) -> Self {
        Self {
            connection: Connection::internal(controllers, timeout, secret),
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
        let request = DescribeTopicsRequest { topics: names };
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

    /// Describes topics (all when `names` is empty) with each partition's log start, high
    /// watermark and log end, asked of the broker that leads it, and the delayed records
    /// each broker's timers hold for them (best effort: a broker that does not answer
    /// quickly is left out).
    pub async fn describe_topics_with_offsets(
        &self,
        names: Vec<String>,
    ) -> Result<Vec<TopicDescription>, ClientError> {
        let mut topics = self.describe_topics(names.clone()).await?.topics;
        // Per broker to ask: the topics it leads a partition of with offsets missing.
        let mut ask: BTreeMap<i32, Vec<String>> = BTreeMap::new();
        for d in &topics {
            let Some(t) = &d.topic else { continue };
            for p in &t.partitions {
                let known = d.offsets.iter().any(|o| o.partition == p.partition);
                if let (false, Some(leader)) = (known, p.leader) {
                    let list = ask.entry(leader).or_default();
                    if !list.contains(&t.name) {
                        list.push(t.name.clone());
                    }
                }
            }
        }
        let Ok(cluster) = self.describe_cluster().await else {
            return Ok(topics);
        };
        let answered: Vec<i32> = topics
            .iter()
            .flat_map(|d| d.scheduled.iter().map(|s| s.broker_id))
            .collect();
        let all: Vec<String> = topics
            .iter()
            .filter_map(|d| Some(d.topic.as_ref()?.name.clone()))
            .collect();
        for b in cluster.brokers.iter().filter_map(|b| b.broker.as_ref()) {
            if !answered.contains(&b.id) {
                ask.insert(b.id, all.clone());
            }
        }
        // All at once, each bounded: a broker that does not answer quickly is left out.
        let answers = futures_util::future::join_all(ask.into_iter().filter_map(|(id, names)| {
            let address = cluster
                .brokers
                .iter()
                .filter_map(|b| b.broker.as_ref())
                .find(|b| b.id == id && b.state == "unfenced")?
                .address
                .clone();
            Some(async move {
                let direct = AdminClient::new(vec![address], OFFSETS_FAN_OUT_TIMEOUT);
                let answer =
                    tokio::time::timeout(OFFSETS_FAN_OUT_TIMEOUT, direct.describe_topics(names))
                        .await;
                (id, answer)
            })
        }))
        .await;
        for (id, answer) in answers {
            let Ok(Ok(answer)) = answer else {
                continue;
            };
            for theirs in answer.topics {
                let Some(mine) = topics.iter_mut().find(|d| {
                    d.topic.as_ref().map(|t| &t.name) == theirs.topic.as_ref().map(|t| &t.name)
                }) else {
                    continue;
                };
                let led: Vec<u32> = theirs
                    .topic
                    .iter()
                    .flat_map(|t| &t.partitions)
                    .filter(|p| p.leader == Some(id))
                    .map(|p| p.partition)
                    .collect();
                for o in theirs.offsets {
                    if led.contains(&o.partition)
                        && !mine.offsets.iter().any(|m| m.partition == o.partition)
                    {
                        mine.offsets.push(o);
                    }
                }
                for s in theirs.scheduled {
                    if s.broker_id == id && !mine.scheduled.iter().any(|m| m.broker_id == id) {
                        mine.scheduled.push(s);
                    }
                }
            }
        }
        Ok(topics)
    }

    /// A new idempotent producer id.
    pub async fn init_producer_id(&self) -> Result<InitProducerIdResponse, ClientError> {
        self.connection
            .call("init producer id", |c| async move {
                Grpc::new(c)
                    .init_producer_id(InitProducerIdRequest {})
                    .await
            })
            .await
    }

    /// Preferred-leader election over `topics` (all when empty).
    pub async fn elect_leaders(
        &self,
        topics: Vec<String>,
    ) -> Result<ElectLeadersResponse, ClientError> {
        let request = ElectLeadersRequest { topics };
        self.connection
            .call_retrying("elect leaders", retriable, |c| {
                let r = request.clone();
                async move { Grpc::new(c).elect_leaders(r).await }
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
