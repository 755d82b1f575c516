//! Newtypes for values that must never be mixed up.

use std::fmt;

/// A record's position in a partition's log: 0, 1, 2, … with no gaps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Offset(pub u64);

impl Offset {
    /// The offset as a plain number.
    pub fn value(self) -> u64 {
        self.0
    }

    /// The offset as Kafka's signed wire type.
    pub fn as_i64(self) -> i64 {
        self.0 as i64
    }

    /// The offset `n` records later.
    pub fn plus(self, n: u64) -> Offset {
        Offset(self.0 + n)
    }
}

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The epoch of a partition's leadership; bumped by the controller on every leader change.
///
/// Kafka's wire type is a signed 32-bit integer with -1 for "no epoch"; batches written by
/// clients carry -1 until the leader stamps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct LeaderEpoch(pub i32);

impl LeaderEpoch {
    /// No epoch: what clients put in a batch, and what lookups of unknown epochs return.
    pub const UNDEFINED: LeaderEpoch = LeaderEpoch(-1);
}

impl fmt::Display for LeaderEpoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A broker's id, unique in a cluster (Kafka's `broker.id`, a signed 32-bit integer).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct BrokerId(pub i32);

impl fmt::Display for BrokerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Displays a list of broker ids as `[1, 2, 3]`, for log fields (`isr = %BrokerIds(&isr)`),
/// where `?isr` would print `[BrokerId(1), BrokerId(2), BrokerId(3)]`.
pub struct BrokerIds<'a>(pub &'a [BrokerId]);

impl fmt::Display for BrokerIds<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, b) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            b.fmt(f)?;
        }
        f.write_str("]")
    }
}

/// A controller's id in the Raft quorum (`--node-id`).
pub type NodeId = u64;

#[cfg(test)]
mod broker_ids_tests {
    use super::*;

    #[test]
    fn broker_id_lists_display_as_plain_numbers() {
        let isr = [BrokerId(1), BrokerId(2), BrokerId(3)];
        assert_eq!(BrokerIds(&isr).to_string(), "[1, 2, 3]");
        assert_eq!(BrokerIds(&[]).to_string(), "[]");
    }
}
