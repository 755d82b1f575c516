//! Server-side partition assignment strategies (pure functions): range, round-robin,
//! sticky, consistent-hash and rack-aware. Broadcast groups do not use them (every member gets every
//! partition).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

/// A topic partition.
pub type TopicPartition = (String, u32);

/// An assignment strategy, chosen per group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// Per topic, contiguous ranges of partitions, members in id order (Kafka's range).
    #[default]
    Range,
    /// All partitions dealt to members in turn.
    RoundRobin,
    /// Balanced, moving as few partitions as possible from their current owners.
    Sticky,
    /// Partitions on a hash ring of members: a member leaving moves only its partitions.
    ConsistentHash,
    /// Each member first gets partitions with a replica in its rack, then the rest are
    /// spread evenly (RocketMQ's same-machine-room strategy).
    RackAware,
}

impl Strategy {
    /// The name used in requests and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Range => "range",
            Strategy::RoundRobin => "round-robin",
            Strategy::Sticky => "sticky",
            Strategy::ConsistentHash => "consistent-hash",
            Strategy::RackAware => "rack-aware",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" | "range" => Ok(Strategy::Range),
            "round-robin" | "roundrobin" => Ok(Strategy::RoundRobin),
            "sticky" => Ok(Strategy::Sticky),
            "consistent-hash" => Ok(Strategy::ConsistentHash),
            "rack-aware" => Ok(Strategy::RackAware),
            other => Err(format!(
                "unknown assignment strategy '{other}': use range, round-robin, sticky, consistent-hash or rack-aware"
            )),
        }
    }
}

/// What the assignor knows of a member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberSpec {
    /// Orders members and places them on the hash ring (a stable instance id when given).
    pub key: String,
    /// The topics it subscribes to.
    pub topics: BTreeSet<String>,
    /// What it holds now (sticky keeps it where it can).
    pub owned: BTreeSet<TopicPartition>,
    /// Its rack, if it declared one (rack-aware).
    pub rack: Option<String>,
}

/// The racks holding a replica of each partition (rack-aware; others ignore it).
pub type ReplicaRacks = BTreeMap<TopicPartition, BTreeSet<String>>;

/// Assigns the partitions of `topics` (name → partition count) to `members`; every
/// partition of a subscribed topic goes to exactly one member subscribed to it. Returns
/// each member's partitions by key.
pub fn assign(
    strategy: Strategy,
    members: &[MemberSpec],
    topics: &BTreeMap<String, u32>,
    racks: &ReplicaRacks,
) -> BTreeMap<String, BTreeSet<TopicPartition>> {
    let mut sorted: Vec<&MemberSpec> = members.iter().collect();
    sorted.sort_by(|a, b| a.key.cmp(&b.key));
    let mut out: BTreeMap<String, BTreeSet<TopicPartition>> = sorted
        .iter()
        .map(|m| (m.key.clone(), BTreeSet::new()))
        .collect();
    match strategy {
        Strategy::Range => range(&sorted, topics, &mut out),
        Strategy::RoundRobin => round_robin(&sorted, topics, &mut out),
        Strategy::Sticky => sticky(&sorted, topics, &mut out),
        Strategy::ConsistentHash => consistent_hash(&sorted, topics, &mut out),
        Strategy::RackAware => rack_aware(&sorted, topics, racks, &mut out),
    }
    out
}

/// Rack-aware: as even as round-robin (members get `n / members` partitions, and
/// `n % members` of them one more), and within that, every partition that has a replica
/// in a subscribed member's rack goes to such a member when one has room. Partitions are placed scarcest first (those with
/// the fewest same-rack members), each to the least-loaded same-rack member; what is left
/// goes to the least-loaded subscriber.
fn rack_aware(
    members: &[&MemberSpec],
    topics: &BTreeMap<String, u32>,
    racks: &ReplicaRacks,
    out: &mut BTreeMap<String, BTreeSet<TopicPartition>>,
) {
    let partitions = all_partitions(members, topics);
    if members.is_empty() {
        return;
    }
    let (base, mut extra) = (
        partitions.len() / members.len(),
        partitions.len() % members.len(),
    );
    let local = |tp: &TopicPartition, m: &MemberSpec| {
        m.topics.contains(&tp.0)
            && m.rack
                .as_ref()
                .is_some_and(|r| racks.get(tp).is_some_and(|rs| rs.contains(r)))
    };
    let mut order: Vec<(usize, &TopicPartition)> = partitions
        .iter()
        .map(|tp| (members.iter().filter(|m| local(tp, m)).count(), tp))
        .collect();
    order.sort_by_key(|(n, tp)| (*n == 0, *n, (*tp).clone()));
    let mut left = Vec::new();
    for (_, tp) in order {
        let target = members
            .iter()
            .filter(|m| {
                let held = out[&m.key].len();
                local(tp, m) && (held < base || (held == base && extra > 0))
            })
            .min_by_key(|m| (out[&m.key].len(), m.key.clone()));
        match target {
            Some(m) => {
                let set = out.get_mut(&m.key).expect("entry");
                if set.len() == base {
                    extra -= 1;
                }
                set.insert(tp.clone());
            }
            None => left.push(tp),
        }
    }
    for tp in left {
        give_to_least_loaded(members, tp, out);
    }
}

/// Gives `tp` to the subscribed member holding the fewest partitions (ties: lowest key).
fn give_to_least_loaded(
    members: &[&MemberSpec],
    tp: &TopicPartition,
    out: &mut BTreeMap<String, BTreeSet<TopicPartition>>,
) {
    let target = members
        .iter()
        .filter(|m| m.topics.contains(&tp.0))
        .min_by_key(|m| (out[&m.key].len(), m.key.clone()));
    if let Some(m) = target {
        out.get_mut(&m.key).expect("entry").insert(tp.clone());
    }
}

fn subscribers<'a>(members: &[&'a MemberSpec], topic: &str) -> Vec<&'a MemberSpec> {
    members
        .iter()
        .copied()
        .filter(|m| m.topics.contains(topic))
        .collect()
}

fn all_partitions(members: &[&MemberSpec], topics: &BTreeMap<String, u32>) -> Vec<TopicPartition> {
    topics
        .iter()
        .filter(|(t, _)| members.iter().any(|m| m.topics.contains(*t)))
        .flat_map(|(t, n)| (0..*n).map(move |p| (t.clone(), p)))
        .collect()
}

fn range(
    members: &[&MemberSpec],
    topics: &BTreeMap<String, u32>,
    out: &mut BTreeMap<String, BTreeSet<TopicPartition>>,
) {
    for (topic, &count) in topics {
        let subs = subscribers(members, topic);
        if subs.is_empty() {
            continue;
        }
        let (each, extra) = (count / subs.len() as u32, count % subs.len() as u32);
        let mut next = 0;
        for (i, m) in subs.iter().enumerate() {
            let n = each + u32::from((i as u32) < extra);
            let set = out.get_mut(&m.key).expect("every member has an entry");
            set.extend((next..next + n).map(|p| (topic.clone(), p)));
            next += n;
        }
    }
}

fn round_robin(
    members: &[&MemberSpec],
    topics: &BTreeMap<String, u32>,
    out: &mut BTreeMap<String, BTreeSet<TopicPartition>>,
) {
    let mut turn = 0usize;
    for tp in all_partitions(members, topics) {
        for step in 0..members.len() {
            let m = members[(turn + step) % members.len()];
            if m.topics.contains(&tp.0) {
                out.get_mut(&m.key).expect("entry").insert(tp);
                turn = (turn + step + 1) % members.len();
                break;
            }
        }
    }
}

fn sticky(
    members: &[&MemberSpec],
    topics: &BTreeMap<String, u32>,
    out: &mut BTreeMap<String, BTreeSet<TopicPartition>>,
) {
    let partitions = all_partitions(members, topics);
    if members.is_empty() {
        return;
    }
    let quota = partitions.len().div_ceil(members.len());
    let valid: BTreeSet<&TopicPartition> = partitions.iter().collect();
    let mut taken: BTreeSet<TopicPartition> = BTreeSet::new();
    // Keep what members hold, up to the quota.
    for m in members {
        let set = out.get_mut(&m.key).expect("entry");
        for tp in &m.owned {
            if set.len() >= quota {
                break;
            }
            if valid.contains(tp) && m.topics.contains(&tp.0) && taken.insert(tp.clone()) {
                set.insert(tp.clone());
            }
        }
    }
    // The rest to the least-loaded eligible member.
    for tp in partitions.iter().filter(|tp| !taken.contains(*tp)) {
        give_to_least_loaded(members, tp, out);
    }
    // Even out: move from the fullest to the emptiest while they differ by more than one.
    loop {
        let Some(max) = members
            .iter()
            .max_by_key(|m| (out[&m.key].len(), m.key.clone()))
        else {
            return;
        };
        let movable = members
            .iter()
            .filter(|m| out[&m.key].len() + 1 < out[&max.key].len())
            .min_by_key(|m| (out[&m.key].len(), m.key.clone()))
            .and_then(|min| {
                let tp = out[&max.key]
                    .iter()
                    .rev()
                    .find(|tp| min.topics.contains(&tp.0))?
                    .clone();
                Some((min.key.clone(), tp))
            });
        let Some((to, tp)) = movable else { return };
        out.get_mut(&max.key).expect("entry").remove(&tp);
        out.get_mut(&to).expect("entry").insert(tp);
    }
}

/// Virtual nodes per member on the hash ring.
const VIRTUAL_NODES: u32 = 64;

fn ring_hash(text: &str) -> u32 {
    crc32c::crc32c(text.as_bytes())
}

fn consistent_hash(
    members: &[&MemberSpec],
    topics: &BTreeMap<String, u32>,
    out: &mut BTreeMap<String, BTreeSet<TopicPartition>>,
) {
    let mut ring: Vec<(u32, &MemberSpec)> = members
        .iter()
        .flat_map(|m| (0..VIRTUAL_NODES).map(move |i| (ring_hash(&format!("{}#{i}", m.key)), *m)))
        .collect();
    ring.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.key.cmp(&b.1.key)));
    if ring.is_empty() {
        return;
    }
    for tp in all_partitions(members, topics) {
        let h = ring_hash(&format!("{}-{}", tp.0, tp.1));
        let start = ring.partition_point(|(v, _)| *v < h);
        let owner = (0..ring.len())
            .map(|i| ring[(start + i) % ring.len()].1)
            .find(|m| m.topics.contains(&tp.0));
        if let Some(m) = owner {
            out.get_mut(&m.key).expect("entry").insert(tp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert, prop_assert_eq, proptest};

    fn member(key: &str, topics: &[&str], owned: &[(&str, u32)]) -> MemberSpec {
        MemberSpec {
            key: key.to_owned(),
            topics: topics.iter().map(|t| t.to_string()).collect(),
            owned: owned.iter().map(|(t, p)| (t.to_string(), *p)).collect(),
            rack: None,
        }
    }

    fn topics(list: &[(&str, u32)]) -> BTreeMap<String, u32> {
        list.iter().map(|(t, n)| (t.to_string(), *n)).collect()
    }

    fn parts(a: &BTreeMap<String, BTreeSet<TopicPartition>>, key: &str) -> Vec<String> {
        a[key].iter().map(|(t, p)| format!("{t}-{p}")).collect()
    }

    #[test]
    fn range_gives_contiguous_ranges_per_topic() {
        let m = [member("a", &["t", "u"], &[]), member("b", &["t", "u"], &[])];
        let a = assign(
            Strategy::Range,
            &m,
            &topics(&[("t", 3), ("u", 2)]),
            &ReplicaRacks::new(),
        );
        assert_eq!(parts(&a, "a"), ["t-0", "t-1", "u-0"]);
        assert_eq!(parts(&a, "b"), ["t-2", "u-1"]);
    }

    #[test]
    fn round_robin_deals_in_turn_and_skips_unsubscribed_members() {
        let m = [
            member("a", &["t"], &[]),
            member("b", &["t", "u"], &[]),
            member("c", &["u"], &[]),
        ];
        let a = assign(
            Strategy::RoundRobin,
            &m,
            &topics(&[("t", 3), ("u", 2)]),
            &ReplicaRacks::new(),
        );
        assert_eq!(parts(&a, "a"), ["t-0", "t-2"]);
        assert_eq!(parts(&a, "b"), ["t-1", "u-0"]);
        assert_eq!(parts(&a, "c"), ["u-1"]);
    }

    #[test]
    fn more_members_than_partitions_leaves_some_idle() {
        let m: Vec<MemberSpec> = (0..5)
            .map(|i| member(&format!("m{i}"), &["t"], &[]))
            .collect();
        for s in [
            Strategy::Range,
            Strategy::RoundRobin,
            Strategy::Sticky,
            Strategy::ConsistentHash,
            Strategy::RackAware,
        ] {
            let a = assign(s, &m, &topics(&[("t", 2)]), &ReplicaRacks::new());
            assert_eq!(a.values().map(BTreeSet::len).sum::<usize>(), 2, "{s}");
            assert!(a.values().all(|v| v.len() <= 2), "{s}");
        }
    }

    #[test]
    fn sticky_moves_only_what_balance_needs() {
        let t = topics(&[("t", 6)]);
        let before = assign(
            Strategy::Sticky,
            &[
                member("a", &["t"], &[]),
                member("b", &["t"], &[]),
                member("c", &["t"], &[]),
            ],
            &t,
            &ReplicaRacks::new(),
        );
        // c leaves: a and b keep theirs and split c's.
        let owned = |k: &str| -> Vec<(&str, u32)> {
            before[k].iter().map(|(t, p)| (t.as_str(), *p)).collect()
        };
        let after = assign(
            Strategy::Sticky,
            &[
                member("a", &["t"], &owned("a")),
                member("b", &["t"], &owned("b")),
            ],
            &t,
            &ReplicaRacks::new(),
        );
        assert!(before["a"].is_subset(&after["a"]));
        assert!(before["b"].is_subset(&after["b"]));
        assert_eq!(after["a"].len() + after["b"].len(), 6);
        assert_eq!(after["a"].len(), 3);
        // d joins: it gets 2 (balance), and only 2 partitions move.
        let owned_a: Vec<(&str, u32)> = after["a"].iter().map(|(t, p)| (t.as_str(), *p)).collect();
        let owned_b: Vec<(&str, u32)> = after["b"].iter().map(|(t, p)| (t.as_str(), *p)).collect();
        let joined = assign(
            Strategy::Sticky,
            &[
                member("a", &["t"], &owned_a),
                member("b", &["t"], &owned_b),
                member("d", &["t"], &[]),
            ],
            &t,
            &ReplicaRacks::new(),
        );
        assert_eq!(joined["d"].len(), 2);
        assert!(joined["a"].is_subset(&after["a"]));
        assert!(joined["b"].is_subset(&after["b"]));
    }

    #[test]
    fn consistent_hash_moves_only_the_leavers_partitions() {
        let t = topics(&[("t", 64)]);
        let all: Vec<MemberSpec> = (0..4)
            .map(|i| member(&format!("m{i}"), &["t"], &[]))
            .collect();
        let before = assign(Strategy::ConsistentHash, &all, &t, &ReplicaRacks::new());
        assert!(
            before.values().all(|v| !v.is_empty()),
            "every member gets some"
        );
        let after = assign(
            Strategy::ConsistentHash,
            &all[..3],
            &t,
            &ReplicaRacks::new(),
        );
        for k in ["m0", "m1", "m2"] {
            assert!(before[k].is_subset(&after[k]), "{k} kept its partitions");
        }
    }

    #[test]
    fn rack_aware_gives_each_member_its_racks_partitions() {
        let t = topics(&[("t", 6)]);
        // Partition p lives in rack p % 3 only (replication factor 1).
        let racks: ReplicaRacks = (0..6)
            .map(|p| {
                (
                    ("t".to_owned(), p),
                    [["a", "b", "c"][p as usize % 3].to_string()].into(),
                )
            })
            .collect();
        let m: Vec<MemberSpec> = ["a", "b", "c"]
            .iter()
            .map(|r| MemberSpec {
                rack: Some((*r).to_owned()),
                ..member(&format!("m-{r}"), &["t"], &[])
            })
            .collect();
        let a = assign(Strategy::RackAware, &m, &t, &racks);
        assert_eq!(parts(&a, "m-a"), ["t-0", "t-3"]);
        assert_eq!(parts(&a, "m-b"), ["t-1", "t-4"]);
        assert_eq!(parts(&a, "m-c"), ["t-2", "t-5"]);
        // Two members in rack a, none in c: a's partitions stay in a, the rest spread.
        let m2 = [
            MemberSpec {
                rack: Some("a".into()),
                ..member("x", &["t"], &[])
            },
            MemberSpec {
                rack: Some("a".into()),
                ..member("y", &["t"], &[])
            },
            MemberSpec {
                rack: Some("b".into()),
                ..member("z", &["t"], &[])
            },
        ];
        let a = assign(Strategy::RackAware, &m2, &t, &racks);
        assert!(a.values().all(|s| s.len() == 2), "{a:?}");
        let in_a: BTreeSet<u32> = a["x"].iter().chain(&a["y"]).map(|(_, p)| *p).collect();
        assert!(in_a.contains(&0) && in_a.contains(&3), "{a:?}");
        assert!(
            a["z"].contains(&("t".to_owned(), 1)) && a["z"].contains(&("t".to_owned(), 4)),
            "{a:?}"
        );
        // No racks at all: still balanced.
        let plain: Vec<MemberSpec> = (0..4)
            .map(|i| member(&format!("m{i}"), &["t"], &[]))
            .collect();
        let a = assign(Strategy::RackAware, &plain, &t, &racks);
        assert!(a.values().all(|s| (1..=2).contains(&s.len())), "{a:?}");
    }

    proptest! {
        /// Every partition of a subscribed topic goes to exactly one subscribed member; with
        /// equal subscriptions range, round-robin and sticky are balanced within one.
        #[test]
        fn every_partition_exactly_once(
            members in 1usize..7,
            counts in proptest::collection::vec(1u32..9, 1..4),
            strategy in 0usize..5,
            owned_seed in proptest::collection::vec((0usize..4, 0u32..9), 0..12),
        ) {
            let names: Vec<String> = (0..counts.len()).map(|i| format!("t{i}")).collect();
            let t: BTreeMap<String, u32> = names.iter().cloned().zip(counts.iter().copied()).collect();
            let specs: Vec<MemberSpec> = (0..members)
                .map(|i| MemberSpec {
                    key: format!("m{i}"),
                    topics: names.iter().cloned().collect(),
                    owned: owned_seed
                        .iter()
                        .filter(|(m, _)| *m == i)
                        .map(|(_, p)| (names[0].clone(), *p))
                        .collect(),
                    rack: Some(format!("r{}", i % 3)),
                })
                .collect();
            let strategy = [Strategy::Range, Strategy::RoundRobin, Strategy::Sticky, Strategy::ConsistentHash, Strategy::RackAware][strategy];
            // Partition p of every topic has its replicas in racks r{p % 4} and r{(p + 1) % 4}.
            let racks: ReplicaRacks = t
                .iter()
                .flat_map(|(name, n)| (0..*n).map(move |p| ((name.clone(), p), [format!("r{}", p % 4), format!("r{}", (p + 1) % 4)].into())))
                .collect();
            let a = assign(strategy, &specs, &t, &racks);
            let mut seen = BTreeSet::new();
            for set in a.values() {
                for tp in set {
                    prop_assert!(seen.insert(tp.clone()), "{:?} twice", tp);
                }
            }
            let total: u32 = counts.iter().sum();
            prop_assert_eq!(seen.len() as u32, total);
            if matches!(strategy, Strategy::RoundRobin | Strategy::Sticky | Strategy::RackAware) {
                let sizes: Vec<usize> = a.values().map(BTreeSet::len).collect();
                prop_assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{:?}", sizes);
            }
        }
    }
}
