//! Replica placement for new partitions: a pure function of the live brokers, their racks
//! and the replicas and leaderships they already hold.
//!
//! Brokers are ordered least-loaded first (fewest replicas, then fewest leaderships, then
//! lowest id) and interleaved by rack (r0, r1, r2, r0, ...). The new partitions' replicas
//! are laid along that order cyclically: partition `p` takes the `rf` brokers starting at
//! slot `p * rf`. So replica counts stay within one of each other (the least loaded fill
//! first), and with racks of equal size every partition spans `min(rf, racks)` racks.
//! Each partition's leader (its first replica) is the member leading the fewest partitions.

use std::collections::BTreeMap;

use super::model::MetadataImage;
use crate::types::BrokerId;

/// A broker that can take replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The broker.
    pub id: BrokerId,
    /// Its rack, if configured.
    pub rack: Option<String>,
}

/// Replicas and leaderships each broker holds.
#[derive(Debug, Clone, Default)]
pub struct Load {
    replicas: BTreeMap<BrokerId, usize>,
    leaders: BTreeMap<BrokerId, usize>,
}

impl Load {
    /// The load of every partition in `image`.
    pub fn of(image: &MetadataImage) -> Self {
        let mut load = Load::default();
        for p in image.topics.values().flat_map(|t| &t.partitions) {
            for r in &p.replicas {
                *load.replicas.entry(*r).or_default() += 1;
            }
            if let Some(first) = p.replicas.first() {
                // The preferred leader is what placement balances.
                *load.leaders.entry(*first).or_default() += 1;
            }
        }
        load
    }

    /// Counts partitions placed but not yet in the image.
    pub fn add(&mut self, assignments: &[Vec<BrokerId>]) {
        for replicas in assignments {
            for r in replicas {
                *self.replicas.entry(*r).or_default() += 1;
            }
            if let Some(first) = replicas.first() {
                *self.leaders.entry(*first).or_default() += 1;
            }
        }
    }

    fn replicas(&self, b: BrokerId) -> usize {
        self.replicas.get(&b).copied().unwrap_or(0)
    }

    fn leaders(&self, b: BrokerId) -> usize {
        self.leaders.get(&b).copied().unwrap_or(0)
    }
}

/// The live brokers of `image`, as placement candidates.
pub fn candidates(image: &MetadataImage) -> Vec<Candidate> {
    image
        .unfenced_brokers()
        .map(|b| Candidate {
            id: b.id,
            rack: b.rack.clone(),
        })
        .collect()
}

/// Orders brokers least-loaded first, interleaved by rack.
fn slot_order<'a>(brokers: &'a [Candidate], load: &Load) -> Vec<&'a Candidate> {
    let key = |b: &Candidate| (load.replicas(b.id), load.leaders(b.id), b.id);
    let mut by_rack: BTreeMap<Option<&str>, Vec<&Candidate>> = BTreeMap::new();
    for b in brokers {
        by_rack.entry(b.rack.as_deref()).or_default().push(b);
    }
    let mut racks: Vec<Vec<&Candidate>> = by_rack.into_values().collect();
    for rack in &mut racks {
        rack.sort_by_key(|b| key(b));
        rack.reverse(); // pop() yields the least loaded
    }
    racks.sort_by_key(|r| r.last().map(|b| key(b)));
    let mut order = Vec::with_capacity(brokers.len());
    while order.len() < brokers.len() {
        for rack in racks.iter_mut() {
            if let Some(b) = rack.pop() {
                order.push(b);
            }
        }
    }
    order
}

/// Places `partitions` new partitions of `replication_factor` replicas each; the first
/// replica of each is its preferred leader. `load` is updated as partitions are placed.
/// The caller has checked `1 <= replication_factor <= brokers.len()`.
pub fn place(
    brokers: &[Candidate],
    load: &mut Load,
    partitions: u32,
    replication_factor: u32,
) -> Vec<Vec<BrokerId>> {
    assert!(replication_factor as usize <= brokers.len() && replication_factor >= 1);
    let order: Vec<BrokerId> = slot_order(brokers, load).iter().map(|b| b.id).collect();
    let n = order.len();
    let rf = replication_factor as usize;
    let mut out = Vec::with_capacity(partitions as usize);
    for p in 0..partitions as usize {
        let mut replicas: Vec<BrokerId> = (0..rf).map(|j| order[(p * rf + j) % n]).collect();
        let leader_at = (0..rf)
            .min_by_key(|j| (load.leaders(replicas[*j]), *j))
            .expect("rf >= 1");
        replicas.swap(0, leader_at);
        load.add(std::slice::from_ref(&replicas));
        out.push(replicas);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use proptest::prelude::*;

    fn brokers(n: i32, racks: usize) -> Vec<Candidate> {
        (1..=n)
            .map(|i| Candidate {
                id: BrokerId(i),
                rack: (racks > 0).then(|| format!("r{}", i as usize % racks)),
            })
            .collect()
    }

    fn spread(counts: &BTreeMap<BrokerId, usize>, brokers: &[Candidate]) -> usize {
        let all: Vec<usize> = brokers
            .iter()
            .map(|b| counts.get(&b.id).copied().unwrap_or(0))
            .collect();
        all.iter().max().unwrap() - all.iter().min().unwrap()
    }

    proptest! {
        /// One topic on a fresh cluster: no partition has a broker twice, and replica and
        /// leader counts per broker are within one of each other.
        #[test]
        fn one_topic_is_balanced(n in 1i32..10, partitions in 1u32..60, rf in 1u32..4) {
            let rf = rf.min(n as u32);
            let brokers = brokers(n, 0);
            let mut load = Load::default();
            let placed = place(&brokers, &mut load, partitions, rf);
            prop_assert_eq!(placed.len(), partitions as usize);
            for replicas in &placed {
                let distinct: BTreeSet<_> = replicas.iter().collect();
                prop_assert_eq!(distinct.len(), rf as usize);
            }
            prop_assert!(spread(&load.replicas, &brokers) <= 1, "replicas {:?}", load.replicas);
            prop_assert!(spread(&load.leaders, &brokers) <= 1, "leaders {:?}", load.leaders);
        }

        /// Topics of different replication factors one after another: replica and leader
        /// counts stay within two per broker (both cannot always stay within one: a topic
        /// with replication factor 1 adds a replica and a leadership to the same broker).
        #[test]
        fn topic_sequences_stay_balanced(
            n in 1i32..9,
            topics in prop::collection::vec((1u32..25, 1u32..4), 1..6),
        ) {
            let brokers = brokers(n, 0);
            let mut load = Load::default();
            for (partitions, rf) in topics {
                let rf = rf.min(n as u32);
                place(&brokers, &mut load, partitions, rf);
                prop_assert!(spread(&load.replicas, &brokers) <= 2, "replicas {:?}", load.replicas);
                prop_assert!(spread(&load.leaders, &brokers) <= 2, "leaders {:?}", load.leaders);
            }
        }

        /// With racks of equal size, every partition spans min(rf, racks) racks.
        #[test]
        fn replicas_spread_over_racks(
            racks in 2usize..4,
            per_rack in 1i32..4,
            partitions in 1u32..30,
            rf in 1u32..4,
        ) {
            let n = racks as i32 * per_rack;
            let rf = rf.min(n as u32);
            let brokers = brokers(n, racks);
            let mut load = Load::default();
            for replicas in place(&brokers, &mut load, partitions, rf) {
                let used: BTreeSet<_> = replicas
                    .iter()
                    .map(|id| brokers.iter().find(|b| b.id == *id).unwrap().rack.clone())
                    .collect();
                prop_assert_eq!(used.len(), (rf as usize).min(racks));
            }
            prop_assert!(spread(&load.leaders, &brokers) <= 1, "leaders {:?}", load.leaders);
        }
    }

    #[test]
    fn least_loaded_brokers_fill_first() {
        let brokers = brokers(3, 0);
        let mut load = Load::default();
        load.add(&[vec![BrokerId(1)], vec![BrokerId(1)], vec![BrokerId(3)]]);
        let placed = place(&brokers, &mut load, 2, 1);
        assert_eq!(placed, vec![vec![BrokerId(2)], vec![BrokerId(3)]]);
    }
}
