//! The transaction coordinator (docs/transactions.md): the coordinator of a
//! transactional id is the leader of partition `crc32c(id) % N` of the internal, replicated
//! `__transaction_state` topic, as a group's is of `__consumer_offsets`.
//!
//! - [`state`]: the state machine of one id, as pure decisions;
//! - [`coordinator`]: requests, the log of states, markers, timeouts, failover and
//!   check-back (asking a live producer whether its local transaction committed).

pub mod coordinator;
pub mod state;

pub use coordinator::{
    CheckEvent, CheckVerdict, MarkerPeers, TxnCoordinator, TxnDescription, TxnSettings, TXN_TOPIC,
};
