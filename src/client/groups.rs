//! Group administration for the CLI: find a group's coordinator, list, describe (with lag),
//! reset offsets and delete groups; and a transactional producer's offset commits.

use std::collections::BTreeMap;
use std::time::Duration;

use tonic::transport::Channel;

use super::admin::AdminClient;
use super::connection::Connection;
use super::consumer::Consumer;
use super::error::ClientError;
use super::group_consumer::GroupMetadata;
use crate::api::proto::groups_client::GroupsClient;
use crate::api::proto::{
    CommittedOffset, DeleteGroupRequest, DescribeGroupRequest, DescribeGroupResponse,
    FindCoordinatorRequest, GroupSummary, ListGroupsRequest, OffsetCommitRequest,
};

/// Most ListOffsets calls [`GroupsAdmin::log_ends`] has out at once.
pub const LOG_ENDS_IN_FLIGHT: usize = 32;

/// Group administration through the cluster at some bootstrap addresses.
pub struct GroupsAdmin {
    connection: Connection,
    bootstrap: Vec<String>,
    timeout: Duration,
}

impl GroupsAdmin {
    /// An admin client; calls give up after `timeout`.
    pub fn new(bootstrap: Vec<String>, timeout: Duration) -> Self {
        Self {
            connection: Connection::new(bootstrap.clone(), timeout),
            bootstrap,
            timeout,
        }
    }

    async fn coordinator(&self, group: &str) -> Result<GroupsClient<Channel>, ClientError> {
        let group = group.to_owned();
        let r = self
            .connection
            .call("find coordinator", |c| {
                let group = group.clone();
                async move {
                    GroupsClient::new(c)
                        .find_coordinator(FindCoordinatorRequest { group })
                        .await
                }
            })
            .await?;
        Ok(GroupsClient::new(self.connection.channel(&r.address)?))
    }

    /// Every group, from every live broker.
    pub async fn list(&self) -> Result<Vec<GroupSummary>, ClientError> {
        let cluster = AdminClient::new(self.bootstrap.clone(), self.timeout)
            .describe_cluster()
            .await?;
        let mut out = Vec::new();
        for b in cluster.brokers.iter().filter_map(|b| b.broker.as_ref()) {
            if b.state != "unfenced" {
                continue;
            }
            let Ok(channel) = self.connection.channel(&b.address) else {
                continue;
            };
            let mut client = GroupsClient::new(channel);
            let call = client.list_groups(ListGroupsRequest {});
            if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(5), call).await {
                out.extend(r.into_inner().groups);
            }
        }
        out.sort_by(|a, b| a.group.cmp(&b.group));
        Ok(out)
    }

    /// Runs `call` at the group's coordinator, finding it again after retriable errors
    /// (a coordinator moving or still loading) until the timeout.
    async fn at_coordinator<T, F, Fut>(&self, group: &str, call: F) -> Result<T, ClientError>
    where
        F: Fn(GroupsClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = std::time::Instant::now() + self.timeout;
        loop {
            let result = async {
                let client = self.coordinator(group).await?;
                Ok::<_, ClientError>(call(client).await?.into_inner())
            }
            .await;
            match result {
                Err(e) if e.is_retriable() && std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => return other,
            }
        }
    }

    /// A group's members, assignments and committed offsets.
    pub async fn describe(&self, group: &str) -> Result<DescribeGroupResponse, ClientError> {
        let request = DescribeGroupRequest {
            group: group.to_owned(),
        };
        self.at_coordinator(group, |mut c| {
            let r = request.clone();
            async move { c.describe_group(r).await }
        })
        .await
    }

    /// The high watermark of each partition (for lag); with `read_committed`, its last
    /// stable offset. Up to [`LOG_ENDS_IN_FLIGHT`] partitions are asked at once.
    pub async fn log_ends(
        &self,
        partitions: &[(String, u32)],
        read_committed: bool,
    ) -> Result<BTreeMap<(String, u32), i64>, ClientError> {
        use futures_util::{StreamExt, TryStreamExt};
        let mut consumer = Consumer::new(self.bootstrap.clone(), self.timeout);
        consumer.set_read_committed(read_committed);
        let consumer = &consumer;
        futures_util::stream::iter(partitions)
            .map(|(t, p)| async move { Ok(((t.clone(), *p), consumer.list_offset(t, *p, -1).await?)) })
            .buffered(LOG_ENDS_IN_FLIGHT)
            .try_collect()
            .await
    }

    /// Sets committed offsets of a group without members.
    pub async fn reset(
        &self,
        group: &str,
        offsets: Vec<CommittedOffset>,
    ) -> Result<(), ClientError> {
        let request = OffsetCommitRequest {
            group: group.to_owned(),
            member_id: String::new(),
            member_epoch: -1,
            offsets,
            ..OffsetCommitRequest::default()
        };
        self.at_coordinator(group, |mut c| {
            let r = request.clone();
            async move { c.offset_commit(r).await }
        })
        .await
        .map(|_| ())
    }

    /// Commits `offsets` as `member` inside the transaction of `transactional_id`
    /// (`producer`: its id and epoch), which holds the group already (AddOffsets): they
    /// take effect when it commits.
    pub async fn commit_in_transaction(
        &self,
        member: &GroupMetadata,
        offsets: Vec<CommittedOffset>,
        transactional_id: &str,
        producer: (i64, i16),
    ) -> Result<(), ClientError> {
        let request = OffsetCommitRequest {
            group: member.group.clone(),
            member_id: member.member_id.clone(),
            member_epoch: member.member_epoch,
            offsets,
            transactional_id: transactional_id.to_owned(),
            producer_id: producer.0,
            producer_epoch: i32::from(producer.1),
        };
        self.at_coordinator(&member.group, |mut c| {
            let r = request.clone();
            async move { c.offset_commit(r).await }
        })
        .await
        .map(|_| ())
    }

    /// Deletes a group without members.
    pub async fn delete(&self, group: &str) -> Result<(), ClientError> {
        let request = DeleteGroupRequest {
            group: group.to_owned(),
        };
        self.at_coordinator(group, |mut c| {
            let r = request.clone();
            async move { c.delete_group(r).await }
        })
        .await
        .map(|_| ())
    }
}
