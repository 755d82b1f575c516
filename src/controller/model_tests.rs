//! Tests of the metadata rules: elections on fence, unfence and shutdown, AlterPartition
//! guards, and invariants under random command sequences.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::command::{CommandOutput, MetadataCommand, ReplicaRef};
use super::model::{BrokerState, MetadataImage, PartitionRecord};
use crate::error_code::ErrorCode;
use crate::types::BrokerId;

struct Harness {
    image: MetadataImage,
    version: u64,
}

impl Harness {
    fn new() -> Self {
        Self {
            image: MetadataImage::default(),
            version: 0,
        }
    }

    fn apply(&mut self, cmd: MetadataCommand) -> Result<CommandOutput, ErrorCode> {
        self.version += 1;
        let (result, _) = self.image.apply(&cmd, self.version);
        self.image.check_invariants().expect("invariants");
        result.map_err(|e| e.code)
    }

    fn epoch(&self, id: i32) -> u64 {
        self.image.brokers[&BrokerId(id)].epoch
    }

    fn live_broker(&mut self, id: i32) {
        self.apply(MetadataCommand::RegisterBroker {
            id: BrokerId(id),
            address: format!("127.0.0.1:{}", 9000 + id),
            rack: None,
            incarnation_id: format!("inc-{id}-{}", self.version),
            internal_address: format!("127.0.0.1:{}", 9100 + id),
            kafka_address: None,
        })
        .unwrap();
        let epoch = self.epoch(id);
        self.apply(MetadataCommand::UnfenceBroker {
            id: BrokerId(id),
            epoch,
        })
        .unwrap();
    }

    fn topic(&mut self, name: &str, assignments: &[&[i32]], config: &[(&str, &str)]) {
        self.apply(MetadataCommand::CreateTopic {
            name: name.to_owned(),
            id: format!("id-{name}"),
            replication_factor: assignments[0].len() as u32,
            config: config
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            assignments: assignments
                .iter()
                .map(|r| r.iter().map(|b| BrokerId(*b)).collect())
                .collect(),
        })
        .unwrap();
    }

    fn partition(&self, topic: &str, p: usize) -> PartitionRecord {
        self.image.topics[topic].partitions[p].clone()
    }

    fn fence(&mut self, id: i32) {
        let epoch = self.epoch(id);
        self.apply(MetadataCommand::FenceBroker {
            id: BrokerId(id),
            epoch,
        })
        .unwrap();
    }

    fn unfence(&mut self, id: i32) {
        let epoch = self.epoch(id);
        self.apply(MetadataCommand::UnfenceBroker {
            id: BrokerId(id),
            epoch,
        })
        .unwrap();
    }

    /// `id` reports these partitions of topic `t` offline (and every other one usable).
    fn offline(&mut self, id: i32, partitions: &[u32]) -> Result<CommandOutput, ErrorCode> {
        let epoch = self.epoch(id);
        self.apply(MetadataCommand::SetOfflineReplicas {
            id: BrokerId(id),
            epoch,
            replicas: partitions
                .iter()
                .map(|p| ReplicaRef {
                    topic_id: "id-t".to_owned(),
                    partition: *p,
                })
                .collect(),
        })
    }

    fn alter_isr(
        &mut self,
        topic: &str,
        p: usize,
        isr: &[i32],
    ) -> Result<CommandOutput, ErrorCode> {
        let part = self.partition(topic, p);
        let leader = part.leader.expect("a leader");
        let broker_epoch = self.epoch(leader.0);
        self.apply(MetadataCommand::AlterPartition {
            broker_id: leader,
            broker_epoch,
            topic: topic.to_owned(),
            topic_id: format!("id-{topic}"),
            partition: p as u32,
            leader_epoch: part.leader_epoch,
            partition_epoch: part.partition_epoch,
            new_isr: isr.iter().map(|b| BrokerId(*b)).collect(),
        })
    }
}

fn ids(v: &[BrokerId]) -> Vec<i32> {
    v.iter().map(|b| b.0).collect()
}

#[test]
fn fencing_the_leader_elects_the_next_isr_member_and_bumps_the_epoch() {
    let mut h = Harness::new();
    for b in 1..=3 {
        h.live_broker(b);
    }
    h.topic("t", &[&[1, 2, 3]], &[]);
    let before = h.partition("t", 0);
    assert_eq!(before.leader, Some(BrokerId(1)));
    h.fence(1);
    let after = h.partition("t", 0);
    assert_eq!(after.leader, Some(BrokerId(2)));
    assert_eq!(ids(&after.isr), vec![2, 3]);
    assert_eq!(after.leader_epoch, before.leader_epoch + 1);
    assert!(after.partition_epoch > before.partition_epoch);
    assert_eq!(h.image.brokers[&BrokerId(1)].state, BrokerState::Fenced);
}

#[test]
fn last_isr_member_fenced_leaves_the_partition_leaderless_until_it_returns() {
    let mut h = Harness::new();
    for b in 1..=2 {
        h.live_broker(b);
    }
    h.topic("t", &[&[1, 2]], &[]);
    h.alter_isr("t", 0, &[1]).unwrap();
    h.fence(1);
    let p = h.partition("t", 0);
    assert_eq!(
        p.leader, None,
        "broker 2 is out of sync: no unclean election"
    );
    assert_eq!(ids(&p.isr), vec![1]);
    h.unfence(1);
    let back = h.partition("t", 0);
    assert_eq!(back.leader, Some(BrokerId(1)));
    assert_eq!(back.leader_epoch, p.leader_epoch + 1);
}

#[test]
fn unclean_election_only_when_the_topic_allows_it() {
    let mut h = Harness::new();
    for b in 1..=2 {
        h.live_broker(b);
    }
    h.topic(
        "u",
        &[&[1, 2]],
        &[("unclean.leader.election.enable", "true")],
    );
    h.alter_isr("u", 0, &[1]).unwrap();
    h.fence(1);
    let p = h.partition("u", 0);
    assert_eq!(p.leader, Some(BrokerId(2)));
    assert_eq!(ids(&p.isr), vec![2]);
}

#[test]
fn controlled_shutdown_moves_leadership_only_to_live_isr_members() {
    let mut h = Harness::new();
    for b in 1..=3 {
        h.live_broker(b);
    }
    h.topic("rf3", &[&[1, 2, 3]], &[]);
    h.topic("rf1", &[&[1]], &[]);
    let epoch = h.epoch(1);
    h.apply(MetadataCommand::BeginControlledShutdown {
        id: BrokerId(1),
        epoch,
    })
    .unwrap();
    assert_eq!(h.partition("rf3", 0).leader, Some(BrokerId(2)));
    assert_eq!(ids(&h.partition("rf3", 0).isr), vec![2, 3]);
    assert_eq!(
        h.partition("rf1", 0).leader,
        Some(BrokerId(1)),
        "nobody else to take it"
    );
    h.fence(1);
    assert_eq!(h.partition("rf1", 0).leader, None);
}

#[test]
fn new_incarnation_fences_the_old_process() {
    let mut h = Harness::new();
    h.live_broker(1);
    h.topic("t", &[&[1]], &[]);
    let old_epoch = h.epoch(1);
    h.apply(MetadataCommand::RegisterBroker {
        id: BrokerId(1),
        address: "127.0.0.1:9001".to_owned(),
        rack: None,
        incarnation_id: "restarted".to_owned(),
        internal_address: "127.0.0.1:9101".to_owned(),
        kafka_address: None,
    })
    .unwrap();
    assert!(h.epoch(1) > old_epoch);
    assert_eq!(h.partition("t", 0).leader, None);
    let stale = h.apply(MetadataCommand::UnfenceBroker {
        id: BrokerId(1),
        epoch: old_epoch,
    });
    assert_eq!(stale, Err(ErrorCode::StaleBrokerEpoch));
    h.unfence(1);
    assert_eq!(h.partition("t", 0).leader, Some(BrokerId(1)));
}

#[test]
fn alter_partition_is_guarded_by_epochs_and_membership() {
    let mut h = Harness::new();
    for b in 1..=3 {
        h.live_broker(b);
    }
    h.topic("t", &[&[1, 2, 3]], &[]);
    let p = h.partition("t", 0);
    let base = |isr: &[i32], partition_epoch: i32, leader_epoch: i32, broker: i32| {
        MetadataCommand::AlterPartition {
            broker_id: BrokerId(broker),
            broker_epoch: 0,
            topic: "t".to_owned(),
            topic_id: "id-t".to_owned(),
            partition: 0,
            leader_epoch,
            partition_epoch,
            new_isr: isr.iter().map(|b| BrokerId(*b)).collect(),
        }
    };
    let with_epoch = |mut c: MetadataCommand, h: &Harness| {
        if let MetadataCommand::AlterPartition {
            broker_id,
            broker_epoch,
            ..
        } = &mut c
        {
            *broker_epoch = h.image.brokers[broker_id].epoch;
        }
        c
    };
    let stale = with_epoch(base(&[1, 2], p.partition_epoch - 1, p.leader_epoch, 1), &h);
    assert_eq!(h.apply(stale), Err(ErrorCode::InvalidUpdateVersion));
    let not_leader = with_epoch(base(&[2, 3], p.partition_epoch, p.leader_epoch, 2), &h);
    assert_eq!(h.apply(not_leader), Err(ErrorCode::NotLeaderOrFollower));
    let without_leader = with_epoch(base(&[2, 3], p.partition_epoch, p.leader_epoch, 1), &h);
    assert_eq!(h.apply(without_leader), Err(ErrorCode::InvalidRequest));
    let outsider = with_epoch(base(&[1, 7], p.partition_epoch, p.leader_epoch, 1), &h);
    assert_eq!(h.apply(outsider), Err(ErrorCode::IneligibleReplica));
    let old_leader_epoch = with_epoch(base(&[1], p.partition_epoch, p.leader_epoch - 1, 1), &h);
    assert_eq!(h.apply(old_leader_epoch), Err(ErrorCode::FencedLeaderEpoch));
    assert_eq!(h.partition("t", 0), p, "rejected changes change nothing");
    h.alter_isr("t", 0, &[1, 2]).unwrap();
    assert_eq!(h.partition("t", 0).partition_epoch, p.partition_epoch + 1);
    // A fenced broker cannot rejoin the ISR.
    h.fence(3);
    assert_eq!(
        h.alter_isr("t", 0, &[1, 2, 3]),
        Err(ErrorCode::IneligibleReplica)
    );
}

#[test]
fn topic_commands_validate_names_and_assignments() {
    let mut h = Harness::new();
    h.live_broker(1);
    h.topic("t", &[&[1]], &[]);
    let dup = MetadataCommand::CreateTopic {
        name: "t".to_owned(),
        id: "x".to_owned(),
        replication_factor: 1,
        config: BTreeMap::new(),
        assignments: vec![vec![BrokerId(1)]],
    };
    assert_eq!(h.apply(dup), Err(ErrorCode::TopicAlreadyExists));
    let unknown_broker = MetadataCommand::CreateTopic {
        name: "u".to_owned(),
        id: "x".to_owned(),
        replication_factor: 1,
        config: BTreeMap::new(),
        assignments: vec![vec![BrokerId(9)]],
    };
    assert_eq!(
        h.apply(unknown_broker),
        Err(ErrorCode::InvalidReplicaAssignment)
    );
    let wrong_id = MetadataCommand::DeleteTopic {
        name: "t".to_owned(),
        id: "not-its-id".to_owned(),
    };
    assert_eq!(h.apply(wrong_id), Err(ErrorCode::UnknownTopicOrPartition));
    assert!(h.image.topics.contains_key("t"));
}

#[test]
fn an_offline_replica_loses_leadership_and_isr_unless_it_is_the_last_copy() {
    let mut h = Harness::new();
    for b in 1..=3 {
        h.live_broker(b);
    }
    h.topic("t", &[&[1, 2, 3], &[1, 2, 3]], &[]);
    h.alter_isr("t", 1, &[1]).unwrap();
    let before = h.partition("t", 0);
    assert_eq!(h.offline(1, &[0, 1]), Ok(CommandOutput::Count(2)));
    // Another in-sync copy exists: leadership moves, the offline copy leaves the ISR.
    let p0 = h.partition("t", 0);
    assert_eq!(p0.leader, Some(BrokerId(2)));
    assert_eq!(ids(&p0.isr), vec![2, 3]);
    assert_eq!(ids(&p0.offline_replicas), vec![1]);
    assert_eq!(p0.leader_epoch, before.leader_epoch + 1);
    // The only in-sync copy: it stays leader (and in the ISR), counted offline.
    let p1 = h.partition("t", 1);
    assert_eq!(p1.leader, Some(BrokerId(1)));
    assert_eq!(ids(&p1.isr), vec![1]);
    assert_eq!(h.image.offline_partitions(), 1);
    // The same report again changes nothing.
    assert_eq!(h.offline(1, &[0, 1]), Ok(CommandOutput::Count(0)));
    // An offline replica is never elected and never joins the ISR.
    h.fence(2);
    h.fence(3);
    assert_eq!(h.partition("t", 0).leader, None);
    h.unfence(3);
    assert_eq!(h.partition("t", 0).leader, Some(BrokerId(3)));
    assert_eq!(
        h.alter_isr("t", 0, &[3, 1]),
        Err(ErrorCode::IneligibleReplica)
    );
    // Reported usable again: it may rejoin.
    assert_eq!(h.offline(1, &[]), Ok(CommandOutput::Count(2)));
    assert!(h.partition("t", 0).offline_replicas.is_empty());
    assert_eq!(h.image.offline_partitions(), 0);
    h.alter_isr("t", 0, &[3, 1]).unwrap();
}

#[test]
fn a_new_incarnation_clears_its_offline_reports() {
    let mut h = Harness::new();
    for b in 1..=2 {
        h.live_broker(b);
    }
    h.topic("t", &[&[1, 2]], &[]);
    h.offline(2, &[0]).unwrap();
    assert_eq!(ids(&h.partition("t", 0).offline_replicas), vec![2]);
    h.live_broker(2);
    assert!(h.partition("t", 0).offline_replicas.is_empty());
}

#[derive(Debug, Clone)]
enum Op {
    Fence(i32),
    Unfence(i32),
    Shutdown(i32),
    Reregister(i32),
    ShrinkIsr(usize),
    ExpandIsr(usize),
    Offline(i32, Vec<u32>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1i32..=4).prop_map(Op::Fence),
        (1i32..=4).prop_map(Op::Unfence),
        (1i32..=4).prop_map(Op::Shutdown),
        (1i32..=4).prop_map(Op::Reregister),
        (0usize..6).prop_map(Op::ShrinkIsr),
        (0usize..6).prop_map(Op::ExpandIsr),
        ((1i32..=4), prop::collection::vec(0u32..6, 0..3)).prop_map(|(b, ps)| Op::Offline(b, ps)),
    ]
}

proptest! {
    /// Any sequence of broker state changes and ISR changes keeps the invariants; leader
    /// epochs never go back; a partition has a leader exactly when a live ISR member
    /// exists (no unclean elections here), and that leader is live.
    #[test]
    fn random_lifecycles_keep_the_invariants(ops in prop::collection::vec(op(), 1..60)) {
        let mut h = Harness::new();
        for b in 1..=4 {
            h.live_broker(b);
        }
        h.topic("t", &[&[1, 2, 3], &[2, 3, 4], &[3, 4, 1], &[4, 1, 2], &[1, 2, 3], &[2, 3, 4]], &[]);
        for op in ops {
            let before: Vec<PartitionRecord> = h.image.topics["t"].partitions.clone();
            let _ = match op {
                Op::Fence(b) => { let e = h.epoch(b); h.apply(MetadataCommand::FenceBroker { id: BrokerId(b), epoch: e }) }
                Op::Unfence(b) => { let e = h.epoch(b); h.apply(MetadataCommand::UnfenceBroker { id: BrokerId(b), epoch: e }) }
                Op::Shutdown(b) => { let e = h.epoch(b); h.apply(MetadataCommand::BeginControlledShutdown { id: BrokerId(b), epoch: e }) }
                Op::Reregister(b) => h.apply(MetadataCommand::RegisterBroker {
                    id: BrokerId(b), address: "a:1".to_owned(), rack: None,
                    incarnation_id: format!("i{}", h.version), internal_address: "a:2".to_owned(), kafka_address: None,
                }),
                Op::Offline(b, ps) => h.offline(b, &ps),
                Op::ShrinkIsr(p) => {
                    let part = h.partition("t", p);
                    match part.leader {
                        Some(l) => h.alter_isr("t", p, &[l.0]),
                        None => Ok(CommandOutput::Done),
                    }
                }
                Op::ExpandIsr(p) => {
                    let part = h.partition("t", p);
                    match part.leader {
                        Some(l) => {
                            let mut isr = vec![l.0];
                            isr.extend(part.replicas.iter().map(|b| b.0).filter(|b| *b != l.0 && h.image.brokers[&BrokerId(*b)].state == BrokerState::Unfenced && !part.offline_replicas.contains(&BrokerId(*b))));
                            h.alter_isr("t", p, &isr)
                        }
                        None => Ok(CommandOutput::Done),
                    }
                }
            };
            for (old, new) in before.iter().zip(&h.image.topics["t"].partitions) {
                prop_assert!(new.leader_epoch >= old.leader_epoch);
                prop_assert!(new.partition_epoch >= old.partition_epoch);
                if new.leader != old.leader {
                    prop_assert!(new.leader_epoch > old.leader_epoch);
                }
            }
            for p in &h.image.topics["t"].partitions {
                if let Some(l) = p.leader {
                    prop_assert_ne!(h.image.brokers[&l].state, BrokerState::Fenced);
                }
                let live_in_isr = p.isr.iter().any(|b| h.image.brokers[b].state == BrokerState::Unfenced && !p.offline_replicas.contains(b));
                if p.leader.is_none() {
                    prop_assert!(!live_in_isr, "leaderless with a live, usable ISR member: {:?}", p);
                }
                if p.isr.len() > 1 {
                    prop_assert!(p.isr.iter().all(|b| !p.offline_replicas.contains(b)), "an offline replica in a larger ISR: {:?}", p);
                }
            }
        }
    }
}
