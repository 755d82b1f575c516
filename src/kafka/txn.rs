//! Transactions over Kafka's protocol, on the broker's one transaction coordinator:
//! InitProducerId with a transactional id, AddPartitionsToTxn (v0-3, the client's
//! version), AddOffsetsToTxn, EndTxn, TxnOffsetCommit (through the group coordinator),
//! DescribeTransactions and ListTransactions. FindCoordinator's key type 1 is in
//! [`super::groups`]; transactional Produce in [`super::produce`]. A transaction begun
//! here is the one `tidelog transactions describe` shows, and the reverse.

use std::collections::BTreeSet;

use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::add_partitions_to_txn_response::{
    AddPartitionsToTxnPartitionResult, AddPartitionsToTxnTopicResult,
};
use kafka_protocol::messages::describe_transactions_response::{self as dtr, TopicData};
use kafka_protocol::messages::list_transactions_response as ltr;
use kafka_protocol::messages::txn_offset_commit_response::{
    TxnOffsetCommitResponsePartition, TxnOffsetCommitResponseTopic,
};
use kafka_protocol::messages::{
    AddOffsetsToTxnRequest, AddOffsetsToTxnResponse, AddPartitionsToTxnRequest,
    AddPartitionsToTxnResponse, DescribeTransactionsRequest, DescribeTransactionsResponse,
    EndTxnRequest, EndTxnResponse, InitProducerIdRequest, InitProducerIdResponse,
    ListTransactionsRequest, ListTransactionsResponse, ProducerId, TopicName, TransactionalId,
    TxnOffsetCommitRequest, TxnOffsetCommitResponse,
};
use kafka_protocol::protocol::StrBytes;

use super::errors::kafka_code;
use super::groups::commit_code;
use super::KafkaHandler;
use crate::broker::group::coordinator::{Committer, TxnCommit};
use crate::broker::txn::state::{TxnPartition, TxnState};
use crate::broker::txn::TxnDescription;
use crate::broker::BrokerError;
use crate::error_code::ErrorCode;

fn s(v: impl Into<String>) -> StrBytes {
    StrBytes::from_string(v.into())
}

/// Kafka's code for a coordinator error. A coordinator that moved or is loading is
/// NOT_COORDINATOR / COORDINATOR_LOAD_IN_PROGRESS, which clients answer by finding it
/// again; the rest are tidelog's own mapping.
fn txn_code(e: &BrokerError) -> i16 {
    match e.code {
        ErrorCode::NotLeaderOrFollower => ResponseError::NotCoordinator.code(),
        ErrorCode::NotEnoughReplicas
        | ErrorCode::NotEnoughReplicasAfterAppend
        | ErrorCode::RequestTimedOut
        | ErrorCode::KafkaStorageError => ResponseError::CoordinatorNotAvailable.code(),
        code => kafka_code(code),
    }
}

impl KafkaHandler {
    /// InitProducerId of a transactional producer: its producer id and a new epoch from
    /// the id's coordinator (fencing older instances, aborting their transaction).
    pub(super) async fn init_transactional_producer(
        &self,
        r: &InitProducerIdRequest,
        id: &str,
    ) -> InitProducerIdResponse {
        let failed = |code: i16| {
            InitProducerIdResponse::default()
                .with_error_code(code)
                .with_producer_id(ProducerId(-1))
                .with_producer_epoch(-1)
        };
        let Ok(timeout_ms) = u32::try_from(r.transaction_timeout_ms) else {
            return failed(ResponseError::InvalidTransactionTimeout.code());
        };
        if timeout_ms == 0 {
            return failed(ResponseError::InvalidTransactionTimeout.code());
        }
        match self
            .txns
            .coordinator()
            .init_producer_id(id, timeout_ms)
            .await
        {
            Ok((producer_id, epoch)) => InitProducerIdResponse::default()
                .with_producer_id(ProducerId(producer_id))
                .with_producer_epoch(epoch),
            Err(e) => {
                tracing::debug!(transactional_id = id, error = %e, "Kafka InitProducerId refused");
                failed(txn_code(&e))
            }
        }
    }

    /// AddPartitionsToTxn v0-3: all partitions are added together; when some cannot be
    /// (an unknown partition), they get their error and the others
    /// OPERATION_NOT_ATTEMPTED, as in Kafka.
    pub async fn add_partitions_to_txn(
        &self,
        r: AddPartitionsToTxnRequest,
    ) -> AddPartitionsToTxnResponse {
        let id = r.v3_and_below_transactional_id.to_string();
        let mut asked: Vec<(TopicName, Vec<i32>)> = Vec::new();
        let mut partitions: BTreeSet<TxnPartition> = BTreeSet::new();
        let mut own_errors: Vec<(String, i32, i16)> = Vec::new();
        for t in r.v3_and_below_topics {
            let name = t.name.to_string();
            let count = self
                .node
                .metadata()
                .topic(&name)
                .map_or(0, |t| t.partitions.len());
            for p in &t.partitions {
                // Internal topics are written by their coordinators only.
                let code = if name.starts_with("__") {
                    ResponseError::TopicAuthorizationFailed.code()
                } else {
                    match u32::try_from(*p) {
                        Ok(i) if (i as usize) < count => {
                            partitions.insert((name.clone(), i));
                            continue;
                        }
                        _ => ResponseError::UnknownTopicOrPartition.code(),
                    }
                };
                own_errors.push((name.clone(), *p, code));
            }
            asked.push((t.name, t.partitions));
        }
        let outcome = if !own_errors.is_empty() {
            ResponseError::OperationNotAttempted.code()
        } else if partitions.is_empty() {
            0
        } else {
            match self
                .txns
                .coordinator()
                .add_partitions(
                    &id,
                    r.v3_and_below_producer_id.0,
                    r.v3_and_below_producer_epoch,
                    partitions,
                )
                .await
            {
                Ok(()) => 0,
                Err(e) => {
                    tracing::debug!(transactional_id = id, error = %e, "Kafka AddPartitionsToTxn refused");
                    txn_code(&e)
                }
            }
        };
        let results = asked
            .into_iter()
            .map(|(name, ps)| {
                let results = ps
                    .into_iter()
                    .map(|p| {
                        let code = own_errors
                            .iter()
                            .find(|(t, q, _)| t == name.as_str() && *q == p)
                            .map_or(outcome, |(_, _, c)| *c);
                        AddPartitionsToTxnPartitionResult::default()
                            .with_partition_index(p)
                            .with_partition_error_code(code)
                    })
                    .collect();
                AddPartitionsToTxnTopicResult::default()
                    .with_name(name)
                    .with_results_by_partition(results)
            })
            .collect();
        AddPartitionsToTxnResponse::default().with_results_by_topic_v3_and_below(results)
    }

    /// AddOffsetsToTxn: the group's offsets partition joins the transaction.
    pub async fn add_offsets_to_txn(&self, r: AddOffsetsToTxnRequest) -> AddOffsetsToTxnResponse {
        let id = r.transactional_id.to_string();
        let code = match self
            .txns
            .coordinator()
            .add_offsets(&id, r.producer_id.0, r.producer_epoch, r.group_id.as_str())
            .await
        {
            Ok(()) => 0,
            Err(e) => {
                tracing::debug!(transactional_id = id, error = %e, "Kafka AddOffsetsToTxn refused");
                txn_code(&e)
            }
        };
        AddOffsetsToTxnResponse::default().with_error_code(code)
    }

    /// EndTxn: commit or abort.
    pub async fn end_txn(&self, r: EndTxnRequest) -> EndTxnResponse {
        let id = r.transactional_id.to_string();
        let code = match self
            .txns
            .coordinator()
            .end_txn(&id, r.producer_id.0, r.producer_epoch, r.committed)
            .await
        {
            Ok(()) => 0,
            Err(e) => {
                tracing::debug!(transactional_id = id, error = %e, "Kafka EndTxn refused");
                txn_code(&e)
            }
        };
        EndTxnResponse::default()
            .with_error_code(code)
            .with_producer_id(ProducerId(-1))
            .with_producer_epoch(-1)
    }

    /// TxnOffsetCommit: the group coordinator holds the offsets until the transaction's
    /// marker settles them. Members are checked as for OffsetCommit (v3+ sends the
    /// member id and generation: a zombie is refused).
    pub async fn txn_offset_commit(&self, r: TxnOffsetCommitRequest) -> TxnOffsetCommitResponse {
        let group = r.group_id.to_string();
        let (entries, answers) = self.plan_commit(r.topics.into_iter().map(|t| {
            let partitions = t
                .partitions
                .into_iter()
                .map(|p| (p.partition_index, p.committed_offset, p.committed_metadata))
                .collect();
            (t.name, partitions)
        }));
        let outcome = if entries.is_empty() {
            0
        } else {
            let who = Committer::Kafka {
                id: r.member_id.to_string(),
                instance: r.group_instance_id.map(|i| i.to_string()),
                generation: r.generation_id,
            };
            let txn = TxnCommit {
                transactional_id: r.transactional_id.to_string(),
                producer_id: r.producer_id.0,
                producer_epoch: r.producer_epoch,
            };
            match self
                .groups
                .coordinator()
                .commit_transactional(&group, who, entries, txn)
                .await
            {
                Ok(()) => 0,
                Err(e) => {
                    tracing::debug!(group, error = %e, "Kafka TxnOffsetCommit refused");
                    match e.code {
                        // A member that lost its partitions or generation: Kafka's
                        // clients abort the transaction (CommitFailedException).
                        ErrorCode::FencedMemberEpoch
                        | ErrorCode::RebalanceInProgress
                        | ErrorCode::IllegalGeneration => ResponseError::IllegalGeneration.code(),
                        ErrorCode::InvalidProducerEpoch
                        | ErrorCode::ProducerFenced
                        | ErrorCode::InvalidTxnState
                        | ErrorCode::InvalidProducerIdMapping
                        | ErrorCode::TransactionalIdNotFound
                        | ErrorCode::InvalidRecord => kafka_code(e.code),
                        _ => commit_code(&group, &e),
                    }
                }
            }
        };
        TxnOffsetCommitResponse::default().with_topics(
            answers
                .into_iter()
                .map(|(name, ps)| {
                    TxnOffsetCommitResponseTopic::default()
                        .with_name(name)
                        .with_partitions(
                            ps.into_iter()
                                .map(|(i, code)| {
                                    TxnOffsetCommitResponsePartition::default()
                                        .with_partition_index(i)
                                        .with_error_code(code.unwrap_or(outcome))
                                })
                                .collect(),
                        )
                })
                .collect(),
        )
    }

    /// DescribeTransactions: the ids this broker coordinates (others: NOT_COORDINATOR).
    pub async fn describe_transactions(
        &self,
        r: DescribeTransactionsRequest,
    ) -> DescribeTransactionsResponse {
        let ids: Vec<String> = r.transactional_ids.iter().map(|i| i.to_string()).collect();
        let found = self.txns.coordinator().describe(&ids).await;
        let states = r
            .transactional_ids
            .into_iter()
            .zip(found)
            .map(|(id, result)| match result {
                Ok(d) => described(id, &d),
                Err(e) => dtr::TransactionState::default()
                    .with_transactional_id(id)
                    .with_error_code(txn_code(&e))
                    .with_transaction_state(s(""))
                    .with_producer_id(ProducerId(-1))
                    .with_producer_epoch(-1)
                    .with_transaction_start_time_ms(-1),
            })
            .collect();
        DescribeTransactionsResponse::default().with_transaction_states(states)
    }

    /// ListTransactions: the ids this broker coordinates, filtered by state, producer id
    /// and (v1) how long they have been open.
    pub async fn list_transactions(&self, r: ListTransactionsRequest) -> ListTransactionsResponse {
        let mut states = Vec::new();
        let mut unknown = Vec::new();
        for f in &r.state_filters {
            match TxnState::parse(f.as_str()) {
                Some(state) => states.push(state),
                None => unknown.push(f.clone()),
            }
        }
        if !unknown.is_empty() && states.is_empty() {
            // Only unknown states asked for: nothing matches.
            return ListTransactionsResponse::default().with_unknown_state_filters(unknown);
        }
        let now = crate::broker::node::now_ms();
        let listed = self
            .txns
            .coordinator()
            .list(&states)
            .await
            .into_iter()
            .filter(|d| {
                r.producer_id_filters.is_empty()
                    || r.producer_id_filters
                        .iter()
                        .any(|p| p.0 == d.meta.producer_id)
            })
            .filter(|d| {
                r.duration_filter < 0
                    || (d.meta.started_ms >= 0
                        && now.saturating_sub(d.meta.started_ms) >= r.duration_filter)
            })
            .map(|d| {
                ltr::TransactionState::default()
                    .with_transactional_id(TransactionalId(s(d.id.clone())))
                    .with_producer_id(ProducerId(d.meta.producer_id))
                    .with_transaction_state(s(d.meta.state.name()))
            })
            .collect();
        ListTransactionsResponse::default()
            .with_unknown_state_filters(unknown)
            .with_transaction_states(listed)
    }
}

/// One id as DescribeTransactions shows it.
fn described(id: TransactionalId, d: &TxnDescription) -> dtr::TransactionState {
    let mut topics: Vec<TopicData> = Vec::new();
    for (topic, p) in &d.meta.partitions {
        match topics.last_mut() {
            Some(t) if t.topic.as_str() == topic => t.partitions.push(*p as i32),
            _ => topics.push(
                TopicData::default()
                    .with_topic(TopicName(s(topic.clone())))
                    .with_partitions(vec![*p as i32]),
            ),
        }
    }
    dtr::TransactionState::default()
        .with_transactional_id(id)
        .with_transaction_state(s(d.meta.state.name()))
        .with_transaction_timeout_ms(d.meta.timeout_ms.min(i32::MAX as u32) as i32)
        .with_transaction_start_time_ms(d.meta.started_ms)
        .with_producer_id(ProducerId(d.meta.producer_id))
        .with_producer_epoch(d.meta.producer_epoch)
        .with_topics(topics)
}
