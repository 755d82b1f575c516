//! The state of one transactional id and the pure decisions on it (Kafka's transaction
//! state machine, without `Dead` and `PrepareEpochFence`: a fence here is an abort at a
//! bumped epoch).
//!
//! ```text
//! Empty ──add──▶ Ongoing ──end(commit)──▶ PrepareCommit ──markers──▶ CompleteCommit
//!   ▲              │    └──end(abort) / timeout / fence──▶ PrepareAbort ──markers──▶ CompleteAbort
//!   └──init────────┴──────────────────────────── (init or add from Complete*) ◀───────┘
//! ```
//!
//! A `Prepare*` state is the durable decision: once written to `__transaction_state` the
//! transaction ends that way whatever fails, because a new coordinator finishes it.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::broker::BrokerError;
use crate::error_code::ErrorCode;

/// Where a transaction stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TxnState {
    /// No transaction open.
    Empty,
    /// Open: partitions were added.
    Ongoing,
    /// Committing: the markers are being written.
    PrepareCommit,
    /// Aborting: the markers are being written.
    PrepareAbort,
    /// The last transaction committed.
    CompleteCommit,
    /// The last transaction aborted.
    CompleteAbort,
}

impl TxnState {
    /// Kafka's name of the state.
    pub fn name(self) -> &'static str {
        match self {
            Self::Empty => "Empty",
            Self::Ongoing => "Ongoing",
            Self::PrepareCommit => "PrepareCommit",
            Self::PrepareAbort => "PrepareAbort",
            Self::CompleteCommit => "CompleteCommit",
            Self::CompleteAbort => "CompleteAbort",
        }
    }

    /// The state named `name` (case-insensitive).
    pub fn parse(name: &str) -> Option<Self> {
        [
            Self::Empty,
            Self::Ongoing,
            Self::PrepareCommit,
            Self::PrepareAbort,
            Self::CompleteCommit,
            Self::CompleteAbort,
        ]
        .into_iter()
        .find(|s| s.name().eq_ignore_ascii_case(name))
    }

    /// Whether markers are being written.
    pub fn is_prepare(self) -> bool {
        matches!(self, Self::PrepareCommit | Self::PrepareAbort)
    }
}

/// A topic partition in a transaction.
pub type TxnPartition = (String, u32);

/// What the coordinator keeps of one transactional id (also its record in
/// `__transaction_state`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxnMeta {
    /// Its producer id.
    pub producer_id: i64,
    /// Its current epoch.
    pub producer_epoch: i16,
    /// Aborted after this long open.
    pub timeout_ms: u32,
    /// Where it stands.
    pub state: TxnState,
    /// Partitions of the open (or completing) transaction.
    pub partitions: BTreeSet<TxnPartition>,
    /// When the open transaction started (ms; -1: none).
    pub started_ms: i64,
    /// When the state last changed (ms).
    pub updated_ms: i64,
}

fn error(code: ErrorCode, message: String) -> BrokerError {
    BrokerError::new(code, message)
}

/// Largest epoch handed out before the id moves to a new producer id.
pub const EPOCH_MAX: i16 = i16::MAX - 1;

/// What `InitProducerId` does to an existing id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitDecision {
    /// Hand out this state (epoch bumped, or a new producer id needed when `None`).
    Ready(Option<TxnMeta>),
    /// Abort the open transaction at a bumped epoch first (fencing the old instance),
    /// then the client retries.
    FenceAndAbort(TxnMeta),
}

/// `InitProducerId` for an id in `current` (`None`: new id).
pub fn init(
    current: Option<&TxnMeta>,
    timeout_ms: u32,
    now: i64,
) -> Result<InitDecision, BrokerError> {
    let Some(m) = current else {
        return Ok(InitDecision::Ready(None));
    };
    match m.state {
        TxnState::PrepareCommit | TxnState::PrepareAbort => Err(error(
            ErrorCode::ConcurrentTransactions,
            format!(
                "the previous transaction of producer {} is completing ({}); retry",
                m.producer_id,
                m.state.name()
            ),
        )),
        TxnState::Ongoing => Ok(InitDecision::FenceAndAbort(prepare(
            m,
            false,
            bump(m.producer_epoch),
            now,
        ))),
        TxnState::Empty | TxnState::CompleteCommit | TxnState::CompleteAbort => {
            if m.producer_epoch >= EPOCH_MAX {
                return Ok(InitDecision::Ready(None));
            }
            Ok(InitDecision::Ready(Some(TxnMeta {
                producer_epoch: m.producer_epoch + 1,
                timeout_ms,
                state: TxnState::Empty,
                partitions: BTreeSet::new(),
                started_ms: -1,
                updated_ms: now,
                ..m.clone()
            })))
        }
    }
}

fn bump(epoch: i16) -> i16 {
    epoch.saturating_add(1).min(EPOCH_MAX)
}

/// A fresh id's state at producer id `producer_id`.
pub fn fresh(producer_id: i64, timeout_ms: u32, now: i64) -> TxnMeta {
    TxnMeta {
        producer_id,
        producer_epoch: 0,
        timeout_ms,
        state: TxnState::Empty,
        partitions: BTreeSet::new(),
        started_ms: -1,
        updated_ms: now,
    }
}

/// Checks that the request's producer id and epoch are the id's current ones.
pub fn check_producer(
    id: &str,
    m: &TxnMeta,
    producer_id: i64,
    epoch: i16,
) -> Result<(), BrokerError> {
    if producer_id != m.producer_id {
        return Err(error(
            ErrorCode::InvalidProducerIdMapping,
            format!(
                "transactional id '{id}' holds producer id {}, not {producer_id}",
                m.producer_id
            ),
        ));
    }
    if epoch != m.producer_epoch {
        return Err(error(
            ErrorCode::ProducerFenced,
            format!(
                "transactional id '{id}' is at epoch {}; epoch {epoch} is fenced (a newer instance, or an abort after a timeout)",
                m.producer_epoch
            ),
        ));
    }
    Ok(())
}

/// The state after adding `partitions`; `None` when nothing changes (all added already).
pub fn add_partitions(
    id: &str,
    m: &TxnMeta,
    producer_id: i64,
    epoch: i16,
    partitions: &BTreeSet<TxnPartition>,
    now: i64,
) -> Result<Option<TxnMeta>, BrokerError> {
    check_producer(id, m, producer_id, epoch)?;
    if m.state.is_prepare() {
        return Err(error(
            ErrorCode::ConcurrentTransactions,
            format!(
                "transactional id '{id}': the previous transaction is completing ({}); retry",
                m.state.name()
            ),
        ));
    }
    if m.state == TxnState::Ongoing && partitions.is_subset(&m.partitions) {
        return Ok(None);
    }
    let mut next = m.clone();
    if m.state != TxnState::Ongoing {
        next.partitions.clear();
        next.started_ms = now;
        next.state = TxnState::Ongoing;
    }
    next.partitions.extend(partitions.iter().cloned());
    next.updated_ms = now;
    Ok(Some(next))
}

/// What `EndTxn` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndDecision {
    /// Write this `Prepare*` state, then the markers.
    Prepare(TxnMeta),
    /// Already ended this way (a retry): answer at once.
    Done,
}

/// `EndTxn(commit)` on `m`.
pub fn end(
    id: &str,
    m: &TxnMeta,
    producer_id: i64,
    epoch: i16,
    commit: bool,
    now: i64,
) -> Result<EndDecision, BrokerError> {
    check_producer(id, m, producer_id, epoch)?;
    let verb = if commit { "commit" } else { "abort" };
    match (m.state, commit) {
        (TxnState::Ongoing, _) => Ok(EndDecision::Prepare(prepare(m, commit, epoch, now))),
        (TxnState::CompleteCommit, true) | (TxnState::CompleteAbort, false) => {
            Ok(EndDecision::Done)
        }
        (TxnState::PrepareCommit, true) | (TxnState::PrepareAbort, false) => Err(error(
            ErrorCode::ConcurrentTransactions,
            format!("transactional id '{id}': the {verb} is completing; retry"),
        )),
        (TxnState::Empty, false) => Ok(EndDecision::Done),
        (state, _) => Err(error(
            ErrorCode::InvalidTxnState,
            format!(
                "transactional id '{id}' cannot {verb}: its transaction is {} (begin one by adding partitions first)",
                state.name()
            ),
        )),
    }
}

/// The `Prepare*` state deciding `m`'s open transaction at `epoch`.
pub fn prepare(m: &TxnMeta, commit: bool, epoch: i16, now: i64) -> TxnMeta {
    TxnMeta {
        producer_epoch: epoch,
        state: if commit {
            TxnState::PrepareCommit
        } else {
            TxnState::PrepareAbort
        },
        updated_ms: now,
        ..m.clone()
    }
}

/// The `Complete*` state after `m`'s markers are all written.
pub fn complete(m: &TxnMeta, now: i64) -> TxnMeta {
    TxnMeta {
        state: if m.state == TxnState::PrepareCommit {
            TxnState::CompleteCommit
        } else {
            TxnState::CompleteAbort
        },
        partitions: BTreeSet::new(),
        started_ms: -1,
        updated_ms: now,
        ..m.clone()
    }
}

/// Whether an open transaction has run past its timeout at `now`; the coordinator then
/// aborts it at a bumped epoch, fencing the producer.
pub fn timed_out(m: &TxnMeta, now: i64) -> bool {
    m.state == TxnState::Ongoing && now.saturating_sub(m.started_ms) > i64::from(m.timeout_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(list: &[(&str, u32)]) -> BTreeSet<TxnPartition> {
        list.iter().map(|(t, p)| (t.to_string(), *p)).collect()
    }

    #[test]
    fn a_transaction_goes_round_and_retries_are_answered() {
        let m = fresh(7, 60_000, 0);
        let open = add_partitions("t", &m, 7, 0, &parts(&[("a", 0)]), 10)
            .unwrap()
            .unwrap();
        assert_eq!((open.state, open.started_ms), (TxnState::Ongoing, 10));
        // Adding what is there changes nothing; more partitions join.
        assert_eq!(
            add_partitions("t", &open, 7, 0, &parts(&[("a", 0)]), 11).unwrap(),
            None
        );
        let open = add_partitions("t", &open, 7, 0, &parts(&[("b", 1)]), 12)
            .unwrap()
            .unwrap();
        assert_eq!(open.partitions.len(), 2);
        let EndDecision::Prepare(p) = end("t", &open, 7, 0, true, 20).unwrap() else {
            panic!("prepare expected");
        };
        assert_eq!(p.state, TxnState::PrepareCommit);
        // While completing: the same end retries, the other is refused, adds wait.
        assert_eq!(
            end("t", &p, 7, 0, true, 21).unwrap_err().code,
            ErrorCode::ConcurrentTransactions
        );
        assert_eq!(
            end("t", &p, 7, 0, false, 21).unwrap_err().code,
            ErrorCode::InvalidTxnState
        );
        assert_eq!(
            add_partitions("t", &p, 7, 0, &parts(&[("a", 0)]), 21)
                .unwrap_err()
                .code,
            ErrorCode::ConcurrentTransactions
        );
        let done = complete(&p, 30);
        assert_eq!(done.state, TxnState::CompleteCommit);
        assert!(done.partitions.is_empty());
        assert_eq!(end("t", &done, 7, 0, true, 31).unwrap(), EndDecision::Done);
        assert_eq!(
            end("t", &done, 7, 0, false, 31).unwrap_err().code,
            ErrorCode::InvalidTxnState
        );
        // The next transaction starts afresh.
        let next = add_partitions("t", &done, 7, 0, &parts(&[("c", 0)]), 40)
            .unwrap()
            .unwrap();
        assert_eq!(next.partitions, parts(&[("c", 0)]));
    }

    #[test]
    fn bad_requests_get_their_codes() {
        let m = fresh(7, 60_000, 0);
        assert_eq!(
            end("t", &m, 7, 0, true, 1).unwrap_err().code,
            ErrorCode::InvalidTxnState,
            "commit without begin"
        );
        assert_eq!(end("t", &m, 7, 0, false, 1).unwrap(), EndDecision::Done);
        assert_eq!(
            add_partitions("t", &m, 8, 0, &parts(&[("a", 0)]), 1)
                .unwrap_err()
                .code,
            ErrorCode::InvalidProducerIdMapping
        );
        assert_eq!(
            add_partitions("t", &m, 7, 1, &parts(&[("a", 0)]), 1)
                .unwrap_err()
                .code,
            ErrorCode::ProducerFenced
        );
    }

    #[test]
    fn init_bumps_the_epoch_and_fences_an_open_transaction() {
        let m = fresh(7, 60_000, 0);
        let InitDecision::Ready(Some(n)) = init(Some(&m), 1000, 5).unwrap() else {
            panic!("ready expected");
        };
        assert_eq!((n.producer_epoch, n.timeout_ms), (1, 1000));
        let open = add_partitions("t", &n, 7, 1, &parts(&[("a", 0)]), 6)
            .unwrap()
            .unwrap();
        let InitDecision::FenceAndAbort(f) = init(Some(&open), 1000, 7).unwrap() else {
            panic!("fence expected");
        };
        assert_eq!((f.state, f.producer_epoch), (TxnState::PrepareAbort, 2));
        assert_eq!(
            f.partitions, open.partitions,
            "the markers go to its partitions"
        );
        assert_eq!(
            init(Some(&f), 1000, 8).unwrap_err().code,
            ErrorCode::ConcurrentTransactions
        );
        let InitDecision::Ready(Some(again)) = init(Some(&complete(&f, 9)), 1000, 9).unwrap()
        else {
            panic!("ready expected");
        };
        assert_eq!(again.producer_epoch, 3);
        // An exhausted epoch moves to a new producer id.
        let old = TxnMeta {
            producer_epoch: EPOCH_MAX,
            ..m
        };
        assert_eq!(
            init(Some(&old), 1000, 9).unwrap(),
            InitDecision::Ready(None)
        );
    }

    #[test]
    fn only_open_transactions_time_out() {
        let m = fresh(7, 1000, 0);
        assert!(!timed_out(&m, 10_000));
        let open = add_partitions("t", &m, 7, 0, &parts(&[("a", 0)]), 100)
            .unwrap()
            .unwrap();
        assert!(!timed_out(&open, 1100));
        assert!(timed_out(&open, 1101));
    }
}
