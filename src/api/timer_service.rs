//! The internal `Timers` service (scheduling and cancelling at a `__timers` leader,
//! delivering due batches to a target leader) and its client side, [`TimerPeerClient`],
//! through which a broker's [`Timers`] reach other brokers.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use prost::Message;
use tonic::{Request, Response, Status};

use super::forward::PeerChannels;
use super::proto::timers_client::TimersClient;
use super::proto::timers_server::Timers as TimersRpc;
use super::proto::{
    TimerCancelRequest, TimerCancelResponse, TimerDeliverRequest, TimerDeliverResponse,
    TimerScheduleRequest, TimerScheduleResponse,
};
use super::status::{code_of, error_status};
use crate::broker::node::{now_ms, Acks, BatchScheduler};
use crate::broker::timer::codec::{Schedule, TimerId, TIMERS_TOPIC};
use crate::broker::timer::{
    delivered_size, schedule_entry, TimerPeers, Timers, TIMERS_MAX_MESSAGE_BYTES,
};
use crate::broker::{BrokerError, BrokerNode};
use crate::client::AdminClient;
use crate::error_code::ErrorCode;
use crate::net::node_auth::ClusterSecret;
use crate::record::delay::delay_of;
use crate::record::{BatchIter, HEADER_LEN};
use crate::types::BrokerId;

fn status_of(e: BrokerError) -> Status {
    error_status(
        e.code,
        e.message,
        e.leader.as_ref().map(|(_, a)| a.as_str()),
    )
}

pub(crate) fn error_of(s: Status) -> BrokerError {
    BrokerError::new(code_of(&s), s.message().to_owned())
}

/// Longest a call to another broker's Timers service may take (a delivery waits for its
/// target's replication, up to the write timeout, 10 s): a peer that vanished without
/// closing its connection must not hold a mover.
const PEER_CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// `call` bounded by [`PEER_CALL_TIMEOUT`].
pub(crate) async fn bounded<T>(
    what: &str,
    call: impl std::future::Future<Output = Result<Response<T>, Status>>,
) -> Result<T, BrokerError> {
    match tokio::time::timeout(PEER_CALL_TIMEOUT, call).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(status)) => Err(error_of(status)),
        Err(_) => Err(BrokerError::new(
            ErrorCode::RequestTimedOut,
            format!("{what}: no answer within {} s", PEER_CALL_TIMEOUT.as_secs()),
        )),
    }
}

/// Serves `Timers` on the internal listener.
pub struct TimerService {
    node: BrokerNode,
    timers: Arc<Timers>,
}

impl TimerService {
    /// A service over `node` and its timers.
    pub fn new(node: BrokerNode, timers: Arc<Timers>) -> Self {
        Self { node, timers }
    }
}

#[tonic::async_trait]
impl TimersRpc for TimerService {
    async fn schedule(
        &self,
        request: Request<TimerScheduleRequest>,
    ) -> Result<Response<TimerScheduleResponse>, Status> {
        let r = request.into_inner();
        let entries = r
            .entries
            .iter()
            .map(|e| Schedule::decode(e.as_ref()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                error_status(
                    ErrorCode::InvalidRequest,
                    format!("undecodable scheduled record: {e}"),
                    None,
                )
            })?;
        let ids = self
            .timers
            .schedule_local(r.timers_partition, entries)
            .await
            .map_err(status_of)?;
        Ok(Response::new(TimerScheduleResponse {
            ids: ids.iter().map(ToString::to_string).collect(),
        }))
    }

    async fn cancel(
        &self,
        request: Request<TimerCancelRequest>,
    ) -> Result<Response<TimerCancelResponse>, Status> {
        let id: TimerId = request
            .into_inner()
            .id
            .parse()
            .map_err(|e: String| error_status(ErrorCode::UnknownScheduledRecord, e, None))?;
        self.timers.cancel_local(id).await.map_err(status_of)?;
        Ok(Response::new(TimerCancelResponse {}))
    }

    async fn deliver(
        &self,
        request: Request<TimerDeliverRequest>,
    ) -> Result<Response<TimerDeliverResponse>, Status> {
        let r = request.into_inner();
        self.node
            .produce(
                &r.topic,
                r.partition,
                r.record_batch.to_vec(),
                Acks::All,
                self.timers.settings().write_timeout,
            )
            .await
            .map_err(status_of)?;
        Ok(Response::new(TimerDeliverResponse {}))
    }
}

/// Reaches other brokers' `Timers` services over their internal listeners.
pub struct TimerPeerClient {
    node: BrokerNode,
    channels: PeerChannels,
}

impl TimerPeerClient {
    /// A client that authenticates with `secret`.
    pub fn new(node: BrokerNode, secret: Arc<ClusterSecret>) -> Self {
        Self {
            node,
            channels: PeerChannels::new(secret),
        }
    }

    fn client(
        &self,
        broker: BrokerId,
    ) -> Result<TimersClient<tonic::transport::Channel>, BrokerError> {
        let address = self
            .node
            .metadata()
            .broker_internal_address(broker)
            .ok_or_else(|| {
                BrokerError::new(
                    ErrorCode::NotLeaderOrFollower,
                    format!("broker {broker} has no known internal address"),
                )
            })?;
        let channel = self.channels.get(&address).map_err(error_of)?;
        Ok(TimersClient::new(channel))
    }
}

impl TimerPeers for TimerPeerClient {
    fn schedule(
        &self,
        broker: BrokerId,
        partition: u32,
        entries: Vec<Schedule>,
    ) -> BoxFuture<'static, Result<Vec<TimerId>, BrokerError>> {
        let client = self.client(broker);
        async move {
            let request = TimerScheduleRequest {
                timers_partition: partition,
                entries: entries.iter().map(|e| e.encode_to_vec().into()).collect(),
            };
            let ids = bounded("scheduling at a peer", client?.schedule(request))
                .await?
                .ids;
            ids.iter()
                .map(|s| {
                    s.parse::<TimerId>()
                        .map_err(|e| BrokerError::new(ErrorCode::UnknownServerError, e))
                })
                .collect()
        }
        .boxed()
    }

    fn cancel(&self, broker: BrokerId, id: TimerId) -> BoxFuture<'static, Result<(), BrokerError>> {
        let client = self.client(broker);
        async move {
            let mut client = client?;
            bounded(
                "cancelling at a peer",
                client.cancel(TimerCancelRequest { id: id.to_string() }),
            )
            .await?;
            Ok(())
        }
        .boxed()
    }

    fn deliver(
        &self,
        broker: BrokerId,
        topic: String,
        partition: u32,
        batch: Vec<u8>,
    ) -> BoxFuture<'static, Result<(), BrokerError>> {
        let client = self.client(broker);
        async move {
            let mut client = client?;
            bounded(
                "delivering to a peer",
                client.deliver(TimerDeliverRequest {
                    topic,
                    partition,
                    record_batch: batch.into(),
                }),
            )
            .await?;
            Ok(())
        }
        .boxed()
    }
}

/// The timers as the front doors use them: creates `__timers` on first use, checks
/// scheduled records against their topic's limits, and takes batches with scheduling
/// headers from [`crate::broker::BrokerNode::produce`].
pub struct TimerFront {
    node: BrokerNode,
    timers: Arc<Timers>,
    admin: AdminClient,
}

impl TimerFront {
    /// A front for `timers`; `admin` creates `__timers`.
    pub fn new(node: BrokerNode, timers: Arc<Timers>, admin: AdminClient) -> Self {
        Self {
            node,
            timers,
            admin,
        }
    }

    /// The timers.
    pub fn timers(&self) -> &Arc<Timers> {
        &self.timers
    }

    /// Refuses `entry` (record `index` of `partition`) when its delivery would not fit
    /// its topic's `max.message.bytes`.
    pub fn check_size(&self, entry: &Schedule, index: usize) -> Result<(), BrokerError> {
        let size = delivered_size(entry) + HEADER_LEN;
        let limit = self
            .node
            .topic_config(&entry.topic)
            .max_message_bytes
            .min(TIMERS_MAX_MESSAGE_BYTES);
        if size > limit {
            return Err(BrokerError::new(
                ErrorCode::RecordTooLarge,
                format!(
                    "partition {}: record {index} takes up to {size} bytes when delivered; the limit (max.message.bytes) is {limit}; nothing was written",
                    entry.partition
                ),
            ));
        }
        Ok(())
    }

    /// Schedules `entries` for `topic`-`partition`, creating `__timers` first if need be.
    pub async fn schedule(
        &self,
        topic: &str,
        partition: u32,
        entries: Vec<Schedule>,
    ) -> Result<Vec<TimerId>, BrokerError> {
        if self.timers.partition_count().is_none() {
            let settings = self.timers.settings();
            super::internal_topics::ensure(
                &self.node,
                &self.admin,
                super::internal_topics::InternalTopic {
                    name: TIMERS_TOPIC,
                    partitions: settings.partitions,
                    replication_factor: settings.replication_factor,
                    config: timers_topic_config(settings.max_delay),
                    not_ready: ErrorCode::NotLeaderOrFollower,
                },
            )
            .await?;
        }
        self.timers.schedule(topic, partition, entries).await
    }

    /// The `Schedule`s of client batches: each record due per its scheduling headers
    /// (at once without one). Idempotent batches are refused: their sequence numbers
    /// would skip the records the partition never receives.
    fn entries_of(
        &self,
        topic: &str,
        partition: u32,
        batches: &[u8],
    ) -> Result<Vec<Schedule>, BrokerError> {
        let now = now_ms();
        let refuse = |why: String| {
            BrokerError::new(
                ErrorCode::InvalidDelay,
                format!("{topic}-{partition}: {why}; nothing was written"),
            )
        };
        let mut entries = Vec::new();
        for (b, batch) in BatchIter::new(batches).enumerate() {
            let batch = batch.map_err(|e| refuse(format!("batch {b}: {e}")))?;
            let h = *batch.header();
            if h.producer_id >= 0 {
                return Err(refuse(format!(
                    "batch {b} holds scheduled records but comes from an idempotent producer (id {}); schedule from a producer without idempotence (Kafka: enable.idempotence=false), as its sequence numbers would skip the scheduled records",
                    h.producer_id
                )));
            }
            let mut failure = None;
            batch
                .for_each_record(TIMERS_MAX_MESSAGE_BYTES, |r| {
                    if failure.is_some() {
                        return Ok(());
                    }
                    let index = (r.offset - h.base_offset) as usize;
                    let due = delay_of(r.headers()).and_then(|(delay, at)| {
                        if delay.is_none() && at.is_none() {
                            Ok(now)
                        } else {
                            self.timers.due_time(now, delay, at)
                        }
                    });
                    match due {
                        Ok(due) => {
                            let entry = schedule_entry(
                                topic,
                                partition,
                                due,
                                r.timestamp,
                                r.key.map(bytes::Bytes::copy_from_slice),
                                r.value.map(bytes::Bytes::copy_from_slice),
                                r.headers()
                                    .map(|(k, v)| {
                                        (k.to_owned(), v.map(bytes::Bytes::copy_from_slice))
                                    })
                                    .collect(),
                            );
                            match self.check_size(&entry, index) {
                                Ok(()) => entries.push(entry),
                                Err(e) => failure = Some(e),
                            }
                        }
                        Err(why) => {
                            failure = Some(refuse(format!("batch {b} record {index}: {why}")))
                        }
                    }
                    Ok(())
                })
                .map_err(|e| refuse(format!("batch {b}: {e}")))?;
            if let Some(e) = failure {
                return Err(e);
            }
        }
        Ok(entries)
    }
}

impl BatchScheduler for Arc<TimerFront> {
    fn schedule_batches(
        &self,
        topic: String,
        partition: u32,
        batches: Vec<u8>,
    ) -> BoxFuture<'static, Result<Vec<String>, BrokerError>> {
        let front = self.clone();
        async move {
            let entries = front.entries_of(&topic, partition, &batches)?;
            let ids = front.schedule(&topic, partition, entries).await?;
            Ok(ids.iter().map(ToString::to_string).collect())
        }
        .boxed()
    }
}

/// `__timers`'s configuration: segments small enough for retention to free space soon,
/// kept a week beyond the longest delay (a record is delivered before its segment can go),
/// and batches as large as any scheduled record.
fn timers_topic_config(
    max_delay: std::time::Duration,
) -> std::collections::BTreeMap<String, String> {
    [
        ("segment.bytes".to_owned(), (64 * 1024 * 1024).to_string()),
        (
            "retention.ms".to_owned(),
            (max_delay.as_millis() as u64 + 7 * 24 * 3600 * 1000).to_string(),
        ),
        ("retention.bytes".to_owned(), "-1".to_owned()),
        (
            "max.message.bytes".to_owned(),
            TIMERS_MAX_MESSAGE_BYTES.to_string(),
        ),
    ]
    .into()
}
