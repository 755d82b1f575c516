//! The `Transactions` service (public) and `TxnMarkers` (internal): gRPC over the
//! broker's [`TxnCoordinator`], and the client the coordinator reaches other brokers'
//! markers service with.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use tonic::{Request, Response, Status, Streaming};

use super::forward::PeerChannels;
use super::internal_topics::{self, InternalTopic};
use super::proto::transactions_server::Transactions;
use super::proto::txn_check_answer;
use super::proto::txn_markers_client::TxnMarkersClient;
use super::proto::txn_markers_server::TxnMarkers;
use super::proto::{
    AddOffsetsToTxnRequest, AddOffsetsToTxnResponse, AddPartitionsToTxnRequest,
    AddPartitionsToTxnResponse, DescribeTransactionsRequest, DescribeTransactionsResponse,
    EndTxnRequest, EndTxnResponse, FindTxnCoordinatorRequest, FindTxnCoordinatorResponse,
    InitTxnProducerRequest, InitTxnProducerResponse, ListTransactionsRequest,
    ListTransactionsResponse, TransactionDescription, TxnCheck, TxnCheckAnswer, TxnCheckVerdict,
    TxnMarker, TxnMarkerResult, TxnTopicPartitions, VerifyTxnPartitionRequest,
    VerifyTxnPartitionResponse, WriteTxnMarkersRequest, WriteTxnMarkersResponse,
};
use super::status::{error_status, to_wire};
use super::timer_service::{bounded, error_of};
use crate::broker::node::TxnVerifier;
use crate::broker::txn::coordinator::partition_for;
use crate::broker::txn::state::{TxnMeta, TxnPartition, TxnState};
use crate::broker::txn::{
    CheckEvent, CheckVerdict, MarkerPeers, TxnCoordinator, TxnDescription, TXN_TOPIC,
};
use crate::broker::{BrokerError, BrokerNode};
use crate::client::AdminClient;
use crate::error_code::ErrorCode;
use crate::net::node_auth::ClusterSecret;
use crate::record::control::ControlMarker;
use crate::types::BrokerId;

fn status(e: BrokerError) -> Status {
    error_status(e.code, e.message, None)
}

fn epoch_of(epoch: i32) -> Result<i16, Status> {
    i16::try_from(epoch).map_err(|_| {
        error_status(
            ErrorCode::InvalidRequest,
            format!("producer_epoch {epoch} is out of range"),
            None,
        )
    })
}

/// Serves `Transactions` on the client listener.
pub struct TxnService {
    node: BrokerNode,
    coordinator: Arc<TxnCoordinator>,
    admin: AdminClient,
}

impl TxnService {
    /// A service over `coordinator`; `admin` creates `__transaction_state`.
    pub fn new(node: BrokerNode, coordinator: Arc<TxnCoordinator>, admin: AdminClient) -> Self {
        Self {
            node,
            coordinator,
            admin,
        }
    }

    /// The coordinator behind the service.
    pub fn coordinator(&self) -> &Arc<TxnCoordinator> {
        &self.coordinator
    }

    /// The coordinator of `id` (creating `__transaction_state` on first use) and its
    /// state partition.
    pub async fn locate(&self, id: &str) -> Result<(BrokerId, u32), BrokerError> {
        self.coordinator.state_partition(id).or_else(|e| {
            if e.code == ErrorCode::NotCoordinator {
                Ok(0)
            } else {
                Err(e)
            }
        })?;
        let settings = self.coordinator.settings();
        internal_topics::ensure(
            &self.node,
            &self.admin,
            InternalTopic {
                name: TXN_TOPIC,
                partitions: settings.partitions,
                replication_factor: settings.replication_factor,
                config: [
                    ("segment.bytes".to_owned(), (100 * 1024 * 1024).to_string()),
                    (
                        "retention.ms".to_owned(),
                        settings.id_expiration.as_millis().to_string(),
                    ),
                    ("min.insync.replicas".to_owned(), "1".to_owned()),
                ]
                .into(),
                not_ready: ErrorCode::CoordinatorLoadInProgress,
            },
        )
        .await?;
        let t = self.node.metadata().topic(TXN_TOPIC).ok_or_else(|| {
            BrokerError::new(
                ErrorCode::CoordinatorLoadInProgress,
                "no transaction state topic",
            )
        })?;
        let partition = partition_for(id, t.partitions.len() as u32);
        let leader = t.partitions[partition as usize].leader.ok_or_else(|| {
            BrokerError::new(
                ErrorCode::CoordinatorLoadInProgress,
                format!("{TXN_TOPIC}-{partition} has no leader right now"),
            )
        })?;
        if leader == self.node.id() {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while self.node.leader_partition(TXN_TOPIC, partition).is_err()
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok((leader, partition))
    }
}

/// The wire form of a description.
pub fn describe_wire(d: &TxnDescription, coordinator: BrokerId) -> TransactionDescription {
    TransactionDescription {
        transactional_id: d.id.clone(),
        state: d.meta.state.name().to_owned(),
        producer_id: d.meta.producer_id,
        producer_epoch: i32::from(d.meta.producer_epoch),
        transaction_timeout_ms: d.meta.timeout_ms,
        start_time_ms: d.meta.started_ms,
        topics: by_topic(&d.meta),
        coordinator_id: coordinator.0,
    }
}

fn by_topic(m: &TxnMeta) -> Vec<TxnTopicPartitions> {
    by_topic_of(m.partitions.iter())
}

fn by_topic_of<'a>(
    partitions: impl IntoIterator<Item = &'a TxnPartition>,
) -> Vec<TxnTopicPartitions> {
    let mut out: Vec<TxnTopicPartitions> = Vec::new();
    for (topic, p) in partitions {
        match out.last_mut() {
            Some(t) if &t.topic == topic => t.partitions.push(*p),
            _ => out.push(TxnTopicPartitions {
                topic: topic.clone(),
                partitions: vec![*p],
            }),
        }
    }
    out
}

#[tonic::async_trait]
impl Transactions for TxnService {
    async fn find_coordinator(
        &self,
        request: Request<FindTxnCoordinatorRequest>,
    ) -> Result<Response<FindTxnCoordinatorResponse>, Status> {
        let id = request.into_inner().transactional_id;
        let (leader, partition) = self.locate(&id).await.map_err(status)?;
        let address = self
            .node
            .metadata()
            .broker_address(leader)
            .unwrap_or_default();
        Ok(Response::new(FindTxnCoordinatorResponse {
            coordinator_id: leader.0,
            address,
            partition,
        }))
    }

    async fn init_producer_id(
        &self,
        request: Request<InitTxnProducerRequest>,
    ) -> Result<Response<InitTxnProducerResponse>, Status> {
        let r = request.into_inner();
        let (producer_id, epoch) = self
            .coordinator
            .init_producer_id(&r.transactional_id, r.transaction_timeout_ms)
            .await
            .map_err(status)?;
        Ok(Response::new(InitTxnProducerResponse {
            producer_id,
            producer_epoch: i32::from(epoch),
        }))
    }

    async fn add_partitions(
        &self,
        request: Request<AddPartitionsToTxnRequest>,
    ) -> Result<Response<AddPartitionsToTxnResponse>, Status> {
        let r = request.into_inner();
        let partitions: BTreeSet<TxnPartition> = r
            .topics
            .iter()
            .flat_map(|t| t.partitions.iter().map(|p| (t.topic.clone(), *p)))
            .collect();
        if partitions.is_empty() {
            return Err(error_status(
                ErrorCode::InvalidRequest,
                "add partitions names no partition",
                None,
            ));
        }
        self.coordinator
            .add_partitions(
                &r.transactional_id,
                r.producer_id,
                epoch_of(r.producer_epoch)?,
                partitions,
            )
            .await
            .map_err(status)?;
        Ok(Response::new(AddPartitionsToTxnResponse {}))
    }

    async fn add_offsets(
        &self,
        request: Request<AddOffsetsToTxnRequest>,
    ) -> Result<Response<AddOffsetsToTxnResponse>, Status> {
        let r = request.into_inner();
        self.coordinator
            .add_offsets(
                &r.transactional_id,
                r.producer_id,
                epoch_of(r.producer_epoch)?,
                &r.group,
            )
            .await
            .map_err(status)?;
        Ok(Response::new(AddOffsetsToTxnResponse {}))
    }

    async fn end_txn(
        &self,
        request: Request<EndTxnRequest>,
    ) -> Result<Response<EndTxnResponse>, Status> {
        let r = request.into_inner();
        self.coordinator
            .end_txn(
                &r.transactional_id,
                r.producer_id,
                epoch_of(r.producer_epoch)?,
                r.commit,
            )
            .await
            .map_err(status)?;
        Ok(Response::new(EndTxnResponse {}))
    }

    async fn describe_transactions(
        &self,
        request: Request<DescribeTransactionsRequest>,
    ) -> Result<Response<DescribeTransactionsResponse>, Status> {
        let ids = request.into_inner().transactional_ids;
        let mut transactions = Vec::new();
        for (id, r) in ids.iter().zip(self.coordinator.describe(&ids).await) {
            match r {
                Ok(d) => transactions.push(describe_wire(&d, self.node.id())),
                // One id: its error is the answer.
                Err(e) if ids.len() == 1 => return Err(status(e)),
                Err(e) => tracing::debug!(transactional_id = %id, error = %e, "describe"),
            }
        }
        Ok(Response::new(DescribeTransactionsResponse { transactions }))
    }

    async fn list_transactions(
        &self,
        request: Request<ListTransactionsRequest>,
    ) -> Result<Response<ListTransactionsResponse>, Status> {
        let mut states = Vec::new();
        for s in request.into_inner().states {
            states.push(TxnState::parse(&s).ok_or_else(|| {
                error_status(
                    ErrorCode::InvalidRequest,
                    format!("unknown transaction state '{s}' (Empty, Ongoing, PrepareCommit, PrepareAbort, CompleteCommit, CompleteAbort)"),
                    None,
                )
            })?);
        }
        let transactions = self
            .coordinator
            .list(&states)
            .await
            .iter()
            .map(|d| describe_wire(d, self.node.id()))
            .collect();
        Ok(Response::new(ListTransactionsResponse { transactions }))
    }

    type ChecksStream = CheckStream;

    async fn checks(
        &self,
        request: Request<Streaming<TxnCheckAnswer>>,
    ) -> Result<Response<Self::ChecksStream>, Status> {
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(CHECK_REGISTER_WAIT, inbound.message())
            .await
            .map_err(|_| {
                error_status(
                    ErrorCode::RequestTimedOut,
                    format!(
                        "no TxnCheckRegister within {} s",
                        CHECK_REGISTER_WAIT.as_secs()
                    ),
                    None,
                )
            })??;
        let Some(txn_check_answer::Message::Register(register)) = first.and_then(|m| m.message)
        else {
            return Err(error_status(
                ErrorCode::InvalidRequest,
                "the first message of a check stream must be a TxnCheckRegister",
                None,
            ));
        };
        let id = register.transactional_id;
        let producer_id = register.producer_id;
        let epoch = epoch_of(register.producer_epoch)?;
        let (session, mut events) = self
            .coordinator
            .register_checker(&id, producer_id, epoch)
            .await
            .map_err(status)?;
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<TxnCheck, Status>>(CHECK_QUEUE);
        let coordinator = self.coordinator.clone();
        // Answers: each verdict ends (or leaves open) the transaction it names.
        let reader = {
            let coordinator = coordinator.clone();
            let id = id.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                while let Ok(Some(message)) = inbound.message().await {
                    let Some(txn_check_answer::Message::Outcome(o)) = message.message else {
                        let _ = tx
                            .send(Err(error_status(
                                ErrorCode::InvalidRequest,
                                "only TxnCheckOutcome may follow the registration",
                                None,
                            )))
                            .await;
                        return;
                    };
                    let verdict = match TxnCheckVerdict::try_from(o.verdict) {
                        Ok(TxnCheckVerdict::Commit) => CheckVerdict::Commit,
                        Ok(TxnCheckVerdict::Rollback) => CheckVerdict::Rollback,
                        _ => CheckVerdict::Unknown,
                    };
                    if let Err(e) = coordinator
                        .answer_check(&id, producer_id, epoch, o.transaction_start_ms, verdict)
                        .await
                    {
                        tracing::debug!(transactional_id = %id, error = %e, "a check verdict was not applied");
                    }
                }
            })
        };
        tokio::spawn(async move {
            loop {
                let event = tokio::select! {
                    e = events.recv() => e,
                    _ = tx.closed() => None,
                };
                let Some(event) = event else { break };
                let message = match event {
                    CheckEvent::Check {
                        started_ms,
                        partitions,
                        attempt,
                    } => TxnCheck {
                        transaction_start_ms: started_ms,
                        topics: by_topic_of(&partitions),
                        attempt,
                        ended_committed: None,
                    },
                    CheckEvent::Ended {
                        started_ms,
                        committed,
                    } => TxnCheck {
                        transaction_start_ms: started_ms,
                        topics: Vec::new(),
                        attempt: 0,
                        ended_committed: Some(committed),
                    },
                };
                if tx.send(Ok(message)).await.is_err() {
                    break;
                }
            }
            reader.abort();
            coordinator.unregister_checker(&id, session);
        });
        let stream =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The stream of checks a producer reads.
pub type CheckStream =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<TxnCheck, Status>> + Send>>;

/// How long a check stream may take to register.
const CHECK_REGISTER_WAIT: Duration = Duration::from_secs(10);

/// Checks queued for one producer's stream.
const CHECK_QUEUE: usize = 16;

/// Serves `TxnMarkers` on the internal listener.
pub struct TxnMarkerService {
    node: BrokerNode,
    coordinator: Arc<TxnCoordinator>,
}

impl TxnMarkerService {
    /// Markers written through `node`; verifications answered by `coordinator`.
    pub fn new(node: BrokerNode, coordinator: Arc<TxnCoordinator>) -> Self {
        Self { node, coordinator }
    }
}

#[tonic::async_trait]
impl TxnMarkers for TxnMarkerService {
    async fn write_markers(
        &self,
        request: Request<WriteTxnMarkersRequest>,
    ) -> Result<Response<WriteTxnMarkersResponse>, Status> {
        let r = request.into_inner();
        let epoch = epoch_of(r.producer_epoch)?;
        let marker = ControlMarker {
            commit: r.commit,
            coordinator_epoch: r.coordinator_epoch,
        };
        let timeout = self.coordinator.settings().write_timeout;
        let writes = r.partitions.iter().map(|p| {
            self.node
                .write_marker(&p.topic, p.partition, r.producer_id, epoch, marker, timeout)
        });
        let results = futures_util::future::join_all(writes)
            .await
            .into_iter()
            .zip(&r.partitions)
            .map(|(result, p)| match result {
                Ok(()) => TxnMarkerResult {
                    topic: p.topic.clone(),
                    partition: p.partition,
                    ..Default::default()
                },
                Err(e) => TxnMarkerResult {
                    topic: p.topic.clone(),
                    partition: p.partition,
                    error_code: to_wire(e.code),
                    error_message: e.message,
                },
            })
            .collect();
        Ok(Response::new(WriteTxnMarkersResponse { results }))
    }

    async fn verify(
        &self,
        request: Request<VerifyTxnPartitionRequest>,
    ) -> Result<Response<VerifyTxnPartitionResponse>, Status> {
        let r = request.into_inner();
        self.coordinator
            .verify(
                &r.transactional_id,
                r.producer_id,
                epoch_of(r.producer_epoch)?,
                &r.topic,
                r.partition,
            )
            .await
            .map_err(status)?;
        Ok(Response::new(VerifyTxnPartitionResponse {}))
    }
}

/// Answers a partition leader's "is this partition in the transaction?" at the id's
/// coordinator: this broker's, or another's over its internal listener.
pub struct CoordinatorVerifier {
    node: BrokerNode,
    coordinator: Arc<TxnCoordinator>,
    channels: PeerChannels,
}

impl CoordinatorVerifier {
    /// A verifier reaching other brokers with `secret`.
    pub fn new(
        node: BrokerNode,
        coordinator: Arc<TxnCoordinator>,
        secret: Arc<ClusterSecret>,
    ) -> Self {
        Self {
            node,
            coordinator,
            channels: PeerChannels::new(secret),
        }
    }
}

impl TxnVerifier for CoordinatorVerifier {
    fn verify(
        &self,
        transactional_id: String,
        producer_id: i64,
        producer_epoch: i16,
        topic: String,
        partition: u32,
    ) -> BoxFuture<'static, Result<(), BrokerError>> {
        let coordinator = self.coordinator.clone();
        let leader = coordinator
            .state_partition(&transactional_id)
            .and_then(|p| {
                self.node
                    .metadata()
                    .partition(TXN_TOPIC, p)
                    .and_then(|(_, s)| s.leader)
                    .ok_or_else(|| {
                        BrokerError::new(
                            ErrorCode::NotCoordinator,
                            format!("{TXN_TOPIC}-{p} has no leader right now"),
                        )
                    })
            });
        let me = self.node.id();
        let channel = match &leader {
            Ok(l) if *l != me => Some(
                self.node
                    .metadata()
                    .broker_internal_address(*l)
                    .ok_or_else(|| {
                        BrokerError::new(
                            ErrorCode::NotCoordinator,
                            format!("broker {l} has no known internal address"),
                        )
                    })
                    .and_then(|a| self.channels.get(&a).map_err(error_of)),
            ),
            _ => None,
        };
        async move {
            leader?;
            match channel {
                None => {
                    coordinator
                        .verify(
                            &transactional_id,
                            producer_id,
                            producer_epoch,
                            &topic,
                            partition,
                        )
                        .await
                }
                Some(channel) => {
                    let request = VerifyTxnPartitionRequest {
                        transactional_id,
                        producer_id,
                        producer_epoch: i32::from(producer_epoch),
                        topic,
                        partition,
                    };
                    let mut client = TxnMarkersClient::new(channel?);
                    bounded(
                        "verifying a transaction at its coordinator",
                        client.verify(request),
                    )
                    .await
                    .map(|_| ())
                }
            }
        }
        .boxed()
    }
}

/// Reaches other brokers' `TxnMarkers` services over their internal listeners.
pub struct MarkerPeerClient {
    node: BrokerNode,
    channels: PeerChannels,
}

impl MarkerPeerClient {
    /// A client that authenticates with `secret`.
    pub fn new(node: BrokerNode, secret: Arc<ClusterSecret>) -> Self {
        Self {
            node,
            channels: PeerChannels::new(secret),
        }
    }
}

impl MarkerPeers for MarkerPeerClient {
    fn write_markers(
        &self,
        broker: BrokerId,
        producer_id: i64,
        producer_epoch: i16,
        marker: ControlMarker,
        partitions: Vec<TxnPartition>,
    ) -> BoxFuture<'static, Result<Vec<Result<(), BrokerError>>, BrokerError>> {
        let address = self.node.metadata().broker_internal_address(broker);
        let channel = address
            .ok_or_else(|| {
                BrokerError::new(
                    ErrorCode::NotLeaderOrFollower,
                    format!("broker {broker} has no known internal address"),
                )
            })
            .and_then(|a| self.channels.get(&a).map_err(error_of));
        async move {
            let request = WriteTxnMarkersRequest {
                producer_id,
                producer_epoch: i32::from(producer_epoch),
                commit: marker.commit,
                coordinator_epoch: marker.coordinator_epoch,
                partitions: partitions
                    .iter()
                    .map(|(topic, partition)| TxnMarker {
                        topic: topic.clone(),
                        partition: *partition,
                    })
                    .collect(),
            };
            let mut client = TxnMarkersClient::new(channel?);
            let response =
                bounded("writing markers at a peer", client.write_markers(request)).await?;
            Ok(response
                .results
                .into_iter()
                .map(|r| match super::status::from_wire(r.error_code) {
                    None => Ok(()),
                    Some(code) => Err(BrokerError::new(code, r.error_message)),
                })
                .collect())
        }
        .boxed()
    }
}
