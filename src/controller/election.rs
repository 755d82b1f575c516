//! Leader election for one partition: a pure function of its replicas, ISR and which
//! brokers are alive.

use super::model::PartitionRecord;
use crate::types::BrokerId;

/// The outcome of an election.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Election {
    /// A live in-sync replica: no acknowledged record can be lost.
    Clean(BrokerId),
    /// A live replica outside the ISR (only when unclean election is enabled): records
    /// acknowledged by the old ISR may be lost; the ISR restarts as just this broker.
    Unclean(BrokerId),
    /// Nobody eligible is alive: the partition stays offline.
    None,
}

/// Elects a leader in replica order (the preferred replica first), from the live ISR
/// members, or, only if `unclean` is set and none is alive, from the live replicas.
/// A replica its broker reported offline is never elected.
pub fn elect_leader(
    partition: &PartitionRecord,
    is_live: impl Fn(BrokerId) -> bool,
    unclean: bool,
) -> Election {
    let is_live = |b: BrokerId| is_live(b) && !partition.offline_replicas.contains(&b);
    if let Some(b) = partition
        .replicas
        .iter()
        .copied()
        .find(|b| partition.isr.contains(b) && is_live(*b))
    {
        return Election::Clean(b);
    }
    if unclean {
        if let Some(b) = partition.replicas.iter().copied().find(|b| is_live(*b)) {
            return Election::Unclean(b);
        }
    }
    Election::None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition(replicas: &[i32], isr: &[i32]) -> PartitionRecord {
        PartitionRecord {
            partition: 0,
            replicas: replicas.iter().map(|b| BrokerId(*b)).collect(),
            isr: isr.iter().map(|b| BrokerId(*b)).collect(),
            leader: None,
            leader_epoch: 0,
            partition_epoch: 0,
            adding_replicas: Vec::new(),
            removing_replicas: Vec::new(),
            offline_replicas: Vec::new(),
        }
    }

    #[test]
    fn prefers_replica_order_among_live_isr_members() {
        let p = partition(&[3, 1, 2], &[1, 2, 3]);
        assert_eq!(
            elect_leader(&p, |_| true, false),
            Election::Clean(BrokerId(3))
        );
        assert_eq!(
            elect_leader(&p, |b| b != BrokerId(3), false),
            Election::Clean(BrokerId(1))
        );
    }

    #[test]
    fn never_elects_an_offline_replica() {
        let mut p = partition(&[1, 2, 3], &[1, 2]);
        p.offline_replicas = vec![BrokerId(1)];
        assert_eq!(
            elect_leader(&p, |_| true, false),
            Election::Clean(BrokerId(2))
        );
        p.offline_replicas = vec![BrokerId(1), BrokerId(2)];
        assert_eq!(elect_leader(&p, |_| true, false), Election::None);
        assert_eq!(
            elect_leader(&p, |_| true, true),
            Election::Unclean(BrokerId(3))
        );
    }

    #[test]
    fn never_elects_outside_the_isr_unless_unclean() {
        let p = partition(&[1, 2, 3], &[1]);
        let live = |b: BrokerId| b != BrokerId(1);
        assert_eq!(elect_leader(&p, live, false), Election::None);
        assert_eq!(elect_leader(&p, live, true), Election::Unclean(BrokerId(2)));
        assert_eq!(elect_leader(&p, |_| false, true), Election::None);
    }
}
