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
use crate::broker::node::Acks;
use crate::broker::timer::codec::{Schedule, TimerId};
use crate::broker::timer::{TimerPeers, Timers};
use crate::broker::{BrokerError, BrokerNode};
use crate::error_code::ErrorCode;
use crate::net::node_auth::ClusterSecret;
use crate::types::BrokerId;

fn status_of(e: BrokerError) -> Status {
    error_status(
        e.code,
        e.message,
        e.leader.as_ref().map(|(_, a)| a.as_str()),
    )
}

fn error_of(s: Status) -> BrokerError {
    BrokerError::new(code_of(&s), s.message().to_owned())
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
            let ids = client?
                .schedule(request)
                .await
                .map_err(error_of)?
                .into_inner()
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
            client?
                .cancel(TimerCancelRequest { id: id.to_string() })
                .await
                .map_err(error_of)?;
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
            client?
                .deliver(TimerDeliverRequest {
                    topic,
                    partition,
                    record_batch: batch.into(),
                })
                .await
                .map_err(error_of)?;
            Ok(())
        }
        .boxed()
    }
}
