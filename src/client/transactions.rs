//! Transactions from the client side: the coordinator RPCs with their retries
//! ([`TxnClient`]), used by the transactional [`super::Producer`] and by the CLI
//! (`tidelog transactions list|describe`).

use std::time::{Duration, Instant};

use tonic::transport::Channel;

use super::admin::AdminClient;
use super::connection::Connection;
use super::error::ClientError;
use crate::api::proto::transactions_client::TransactionsClient;
use crate::api::proto::txn_check_answer;
use crate::api::proto::{
    AddOffsetsToTxnRequest, AddPartitionsToTxnRequest, DescribeTransactionsRequest, EndTxnRequest,
    FindTxnCoordinatorRequest, InitTxnProducerRequest, ListTransactionsRequest,
    TransactionDescription, TxnCheck, TxnCheckAnswer, TxnCheckRegister, TxnTopicPartitions,
};
use crate::error_code::ErrorCode;

/// What a producer's checker is asked: did the local transaction behind this open
/// transaction commit? (RocketMQ's transaction check-back.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransactionCheck {
    /// The transactional id.
    pub transactional_id: String,
    /// When the transaction began (ms since the epoch, the coordinator's clock).
    pub started_ms: i64,
    /// Its partitions.
    pub partitions: Vec<(String, u32)>,
    /// 1 for its first check.
    pub attempt: u32,
}

/// A checker's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckVerdict {
    /// The local transaction committed: commit this one.
    Commit,
    /// The local transaction rolled back: abort this one.
    Rollback,
    /// Not known yet: ask again later (after `transaction_check_max` such answers the
    /// coordinator aborts).
    Unknown,
}

/// Answers the coordinator's checks of a producer's transactions left open (see
/// [`super::Producer::set_transaction_checker`]).
pub trait TransactionChecker: Send + Sync + 'static {
    /// Looks up the local transaction behind `check`.
    fn check(
        &self,
        check: TransactionCheck,
    ) -> futures_util::future::BoxFuture<'static, CheckVerdict>;
}

/// A check-back stream at a coordinator: answers go in, checks come out.
pub type CheckStream = (
    tokio::sync::mpsc::Sender<TxnCheckAnswer>,
    tonic::Streaming<TxnCheck>,
);

/// How long a retriable transaction call keeps retrying.
const RETRY_BACKOFF: Duration = Duration::from_millis(100);

/// The coordinator calls of one transactional id, or of the whole cluster.
pub struct TxnClient {
    connection: Connection,
    bootstrap: Vec<String>,
    timeout: Duration,
}

impl TxnClient {
    /// A client of the cluster at `bootstrap`; calls give up after `timeout`.
    pub fn new(bootstrap: Vec<String>, timeout: Duration) -> Self {
        Self {
            connection: Connection::new(bootstrap.clone(), timeout),
            bootstrap,
            timeout,
        }
    }

    async fn coordinator(&self, id: &str) -> Result<TransactionsClient<Channel>, ClientError> {
        let id = id.to_owned();
        let r = self
            .connection
            .call("find transaction coordinator", |c| {
                let transactional_id = id.clone();
                async move {
                    TransactionsClient::new(c)
                        .find_coordinator(FindTxnCoordinatorRequest { transactional_id })
                        .await
                }
            })
            .await?;
        Ok(TransactionsClient::new(
            self.connection.channel(&r.address)?,
        ))
    }

    /// Runs `call` at `id`'s coordinator, finding it again after retriable errors (a
    /// coordinator moving or loading, a previous transaction completing) until the timeout.
    async fn at_coordinator<T, F, Fut>(&self, id: &str, call: F) -> Result<T, ClientError>
    where
        F: Fn(TransactionsClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = Instant::now() + self.timeout;
        loop {
            let result = async {
                let client = self.coordinator(id).await?;
                Ok::<_, ClientError>(call(client).await?.into_inner())
            }
            .await;
            match result {
                Err(e) if e.is_retriable() && Instant::now() < deadline => {
                    tracing::debug!(transactional_id = id, error = %e, "retrying a transaction call");
                    tokio::time::sleep(RETRY_BACKOFF).await;
                }
                other => return other,
            }
        }
    }

    /// A producer id and a new epoch for `id` (fencing older instances).
    pub async fn init_producer_id(
        &self,
        id: &str,
        timeout_ms: u32,
    ) -> Result<(i64, i16), ClientError> {
        let request = InitTxnProducerRequest {
            transactional_id: id.to_owned(),
            transaction_timeout_ms: timeout_ms,
        };
        let r = self
            .at_coordinator(id, |mut c| {
                let r = request.clone();
                async move { c.init_producer_id(r).await }
            })
            .await?;
        let epoch = i16::try_from(r.producer_epoch).map_err(|_| {
            ClientError::new(
                ErrorCode::UnknownServerError,
                format!("producer epoch {} out of range", r.producer_epoch),
            )
        })?;
        Ok((r.producer_id, epoch))
    }

    /// Adds partitions to `id`'s open transaction.
    pub async fn add_partitions(
        &self,
        id: &str,
        producer: (i64, i16),
        partitions: &[(String, u32)],
    ) -> Result<(), ClientError> {
        let mut topics: Vec<TxnTopicPartitions> = Vec::new();
        for (topic, p) in partitions {
            match topics.iter_mut().find(|t| &t.topic == topic) {
                Some(t) => t.partitions.push(*p),
                None => topics.push(TxnTopicPartitions {
                    topic: topic.clone(),
                    partitions: vec![*p],
                }),
            }
        }
        let request = AddPartitionsToTxnRequest {
            transactional_id: id.to_owned(),
            producer_id: producer.0,
            producer_epoch: i32::from(producer.1),
            topics,
        };
        self.at_coordinator(id, |mut c| {
            let r = request.clone();
            async move { c.add_partitions(r).await }
        })
        .await
        .map(|_| ())
    }

    /// Adds consumer group `group`'s offsets to `id`'s open transaction.
    pub async fn add_offsets(
        &self,
        id: &str,
        producer: (i64, i16),
        group: &str,
    ) -> Result<(), ClientError> {
        let request = AddOffsetsToTxnRequest {
            transactional_id: id.to_owned(),
            producer_id: producer.0,
            producer_epoch: i32::from(producer.1),
            group: group.to_owned(),
        };
        self.at_coordinator(id, |mut c| {
            let r = request.clone();
            async move { c.add_offsets(r).await }
        })
        .await
        .map(|_| ())
    }

    /// Opens the check-back stream of producer `producer` of `id` at its coordinator.
    pub async fn open_checks(
        &self,
        id: &str,
        producer: (i64, i16),
    ) -> Result<CheckStream, ClientError> {
        let mut client = self.coordinator(id).await?;
        let (answers, outbound) = tokio::sync::mpsc::channel::<TxnCheckAnswer>(16);
        answers
            .send(TxnCheckAnswer {
                message: Some(txn_check_answer::Message::Register(TxnCheckRegister {
                    transactional_id: id.to_owned(),
                    producer_id: producer.0,
                    producer_epoch: i32::from(producer.1),
                })),
            })
            .await
            .map_err(|_| ClientError::new(ErrorCode::NetworkException, "check stream closed"))?;
        let outbound = futures_util::stream::unfold(outbound, |mut rx| async move {
            rx.recv().await.map(|m| (m, rx))
        });
        let checks = client.checks(outbound).await?.into_inner();
        Ok((answers, checks))
    }

    /// Commits (`commit`) or aborts `id`'s open transaction.
    pub async fn end(
        &self,
        id: &str,
        producer: (i64, i16),
        commit: bool,
    ) -> Result<(), ClientError> {
        let request = EndTxnRequest {
            transactional_id: id.to_owned(),
            producer_id: producer.0,
            producer_epoch: i32::from(producer.1),
            commit,
        };
        self.at_coordinator(id, |mut c| {
            let r = request.clone();
            async move { c.end_txn(r).await }
        })
        .await
        .map(|_| ())
    }

    /// The state of `id` at its coordinator.
    pub async fn describe(&self, id: &str) -> Result<TransactionDescription, ClientError> {
        let request = DescribeTransactionsRequest {
            transactional_ids: vec![id.to_owned()],
        };
        let r = self
            .at_coordinator(id, |mut c| {
                let r = request.clone();
                async move { c.describe_transactions(r).await }
            })
            .await?;
        r.transactions.into_iter().next().ok_or_else(|| {
            ClientError::new(
                ErrorCode::TransactionalIdNotFound,
                format!("transactional id '{id}' is unknown"),
            )
        })
    }

    /// Every transactional id (in `states`, when not empty), from every live broker.
    pub async fn list(
        &self,
        states: &[String],
    ) -> Result<Vec<TransactionDescription>, ClientError> {
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
            let mut client = TransactionsClient::new(channel);
            let call = client.list_transactions(ListTransactionsRequest {
                states: states.to_vec(),
            });
            match tokio::time::timeout(Duration::from_secs(5), call).await {
                Ok(Ok(r)) => out.extend(r.into_inner().transactions),
                Ok(Err(status)) if status.code() == tonic::Code::InvalidArgument => {
                    return Err(status.into())
                }
                _ => {}
            }
        }
        out.sort_by(|a, b| a.transactional_id.cmp(&b.transactional_id));
        Ok(out)
    }
}
