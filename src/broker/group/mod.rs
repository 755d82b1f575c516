//! Consumer groups (DESIGN §6): the coordinator of a group is the broker leading its
//! `__consumer_offsets` partition; assignment is computed there (KIP-848 style).
//!
//! - [`assignor`]: range, round-robin, sticky, consistent-hash (pure);
//! - [`state`]: one group's members, epochs and reconciliation (pure);
//! - [`offsets`]: committed offsets as records of `__consumer_offsets`;
//! - [`coordinator`]: the coordinator: heartbeats, commits, loading, expiry.

pub mod assignor;
pub mod classic;
pub mod coordinator;
pub mod offsets;
pub mod state;

pub use coordinator::{GroupCoordinator, GroupSettings};
