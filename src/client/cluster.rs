//! The client's view of the cluster: which broker leads each partition, fetched from any
//! bootstrap broker with the Metadata RPC and refreshed on NOT_LEADER_OR_FOLLOWER.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::RwLock;

use super::connection::Connection;
use super::error::ClientError;
use crate::api::proto::broker_client::BrokerClient;
use crate::api::proto::MetadataRequest;
use crate::error_code::ErrorCode;
use crate::replication::rack::read_replica;
use crate::topic_config::TopicConfig;

/// A topic's partitions and their leaders' addresses (None: no leader now).
#[derive(Debug, Clone)]
pub struct TopicRoute {
    /// Leader address per partition.
    pub leaders: Vec<Option<String>>,
    /// Per partition, its in-sync replicas other than the leader: (address, rack).
    pub followers: Vec<Vec<(String, Option<String>)>>,
    /// Per partition, the leader's rack.
    pub leader_racks: Vec<Option<String>>,
    /// The topic's `max.message.bytes`: the largest batch its partitions accept.
    pub max_message_bytes: usize,
}

/// Routes to partition leaders.
pub struct Cluster {
    connection: Connection,
    routes: RwLock<HashMap<String, TopicRoute>>,
}

impl Cluster {
    /// A view of the cluster at `bootstrap`.
    pub fn new(bootstrap: Vec<String>, timeout: Duration) -> Self {
        Self {
            connection: Connection::new(bootstrap, timeout),
            routes: RwLock::new(HashMap::new()),
        }
    }

    /// The connection (channels are shared by every client on it).
    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    /// Fetches fresh routes for `topic`.
    pub async fn refresh(&self, topic: &str) -> Result<TopicRoute, ClientError> {
        let request = MetadataRequest {
            topics: vec![topic.to_owned()],
        };
        let response = self
            .connection
            .call("metadata", |c| {
                let r = request.clone();
                async move {
                    BrokerClient::new(c)
                        .max_decoding_message_size(64 * 1024 * 1024)
                        .metadata(r)
                        .await
                }
            })
            .await?;
        let Some(t) = response.topics.into_iter().find(|t| t.name == topic) else {
            return Err(ClientError::new(
                ErrorCode::UnknownTopicOrPartition,
                format!("topic '{topic}' does not exist"),
            ));
        };
        let brokers: HashMap<i32, (String, Option<String>)> = response
            .brokers
            .into_iter()
            .map(|b| (b.id, (b.address, b.rack)))
            .collect();
        let route = TopicRoute {
            leaders: t
                .partitions
                .iter()
                .map(|p| p.leader.and_then(|l| Some(brokers.get(&l)?.0.clone())))
                .collect(),
            followers: t
                .partitions
                .iter()
                .map(|p| {
                    p.isr
                        .iter()
                        .filter(|b| Some(**b) != p.leader)
                        .filter_map(|b| brokers.get(b).cloned())
                        .collect()
                })
                .collect(),
            leader_racks: t
                .partitions
                .iter()
                .map(|p| p.leader.and_then(|l| brokers.get(&l)?.1.clone()))
                .collect(),
            max_message_bytes: max_message_bytes(&t.config),
        };
        self.routes.write().insert(topic.to_owned(), route.clone());
        Ok(route)
    }

    /// Cached routes for `topic`, fetched on first use.
    pub async fn route(&self, topic: &str) -> Result<TopicRoute, ClientError> {
        if let Some(r) = self.routes.read().get(topic).cloned() {
            return Ok(r);
        }
        self.refresh(topic).await
    }

    /// The partition count of `topic` if its routes are cached: the producer's hot path,
    /// which neither awaits nor clones the route.
    pub fn cached_partition_count(&self, topic: &str) -> Option<u32> {
        self.routes
            .read()
            .get(topic)
            .map(|r| r.leaders.len() as u32)
    }

    /// The `max.message.bytes` of `topic` if its routes are cached.
    pub fn cached_max_message_bytes(&self, topic: &str) -> Option<usize> {
        self.routes.read().get(topic).map(|r| r.max_message_bytes)
    }

    /// The cached leader of one partition, if known.
    pub fn cached_leader(&self, topic: &str, partition: u32) -> Option<String> {
        self.routes
            .read()
            .get(topic)
            .and_then(|r| r.leaders.get(partition as usize).cloned().flatten())
    }

    /// `check` of the cached leader of one partition (None: no leader, or not cached),
    /// without cloning it: the producer's hot path under fault avoidance.
    pub fn check_leader<T>(
        &self,
        topic: &str,
        partition: u32,
        check: impl Fn(Option<&str>) -> T,
    ) -> T {
        let routes = self.routes.read();
        let leader = routes
            .get(topic)
            .and_then(|r| r.leaders.get(partition as usize))
            .and_then(|l| l.as_deref());
        check(leader)
    }

    /// The address a consumer in `rack` fetches one partition from when it may read
    /// from followers: an in-sync follower in its rack when the leader is elsewhere
    /// ([`read_replica`]), else the leader (refreshing once when unknown). The flag says
    /// whether it is a follower.
    pub async fn read_address(
        &self,
        topic: &str,
        partition: u32,
        rack: Option<&str>,
    ) -> Result<(String, bool), ClientError> {
        if rack.is_some() {
            let route = self.route(topic).await?;
            let i = partition as usize;
            if route.leaders.get(i).is_some_and(Option::is_some) {
                let leader_rack = route.leader_racks.get(i).and_then(|r| r.as_deref());
                let followers = route
                    .followers
                    .get(i)
                    .into_iter()
                    .flatten()
                    .map(|(address, r)| (address, r.as_deref()));
                if let Some(address) = read_replica(rack, leader_rack, followers) {
                    return Ok((address.clone(), true));
                }
            }
        }
        Ok((self.leader(topic, partition).await?, false))
    }

    /// The leader of one partition (refreshing once when unknown).
    pub async fn leader(&self, topic: &str, partition: u32) -> Result<String, ClientError> {
        let route = self.route(topic).await?;
        let count = route.leaders.len() as u32;
        if partition >= count {
            return Err(ClientError::new(
                ErrorCode::UnknownTopicOrPartition,
                format!(
                    "topic '{topic}' has {count} partitions; there is no partition {partition}"
                ),
            ));
        }
        if let Some(Some(addr)) = route.leaders.get(partition as usize) {
            return Ok(addr.clone());
        }
        let route = self.refresh(topic).await?;
        route
            .leaders
            .get(partition as usize)
            .cloned()
            .flatten()
            .ok_or_else(|| {
                ClientError::new(
                    ErrorCode::NotLeaderOrFollower,
                    format!("{topic}-{partition} has no leader right now"),
                )
            })
    }
}

/// A topic's `max.message.bytes` from its config (the default when unset or unreadable).
fn max_message_bytes(config: &std::collections::BTreeMap<String, String>) -> usize {
    let default = TopicConfig::default().max_message_bytes;
    config
        .get("max.message.bytes")
        .map_or(default, |v| v.parse().unwrap_or(default))
}
