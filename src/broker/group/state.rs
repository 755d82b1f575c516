//! One consumer group's membership and assignment, as its coordinator holds it (no I/O).
//!
//! Server-side assignment after Kafka's KIP-848: the group epoch grows with every change
//! of membership, subscriptions or partition counts; the target assignment is computed
//! for it; each member converges on its target through heartbeats. A member first gives
//! up partitions its target no longer holds (its answer omits them); it gets a new
//! partition only once no other member reports holding it or was last told to hold it, so
//! no two members own a partition at once. A member's epoch becomes the group epoch when it holds its whole
//! target. Broadcast groups give every member every partition.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::assignor::{assign, MemberSpec, ReplicaRacks, Strategy, TopicPartition};

/// A member of a group.
#[derive(Debug, Clone)]
pub struct Member {
    /// Given by the coordinator at join.
    pub id: String,
    /// A stable name chosen by the client (may be empty).
    pub instance_id: String,
    /// The client's name, for display.
    pub client_id: String,
    /// Its epoch: the group epoch of the last target it fully reached.
    pub epoch: i32,
    /// Subscribed topics (explicit names).
    pub topics: BTreeSet<String>,
    /// Subscribed topic pattern.
    pub regex: Option<String>,
    /// What it reported holding at its last heartbeat.
    pub owned: BTreeSet<TopicPartition>,
    /// What it was told to hold at its last heartbeat.
    pub assignment: BTreeSet<TopicPartition>,
    /// Its rack (client.rack), for the rack-aware strategy.
    pub rack: Option<String>,
    /// It reads committed records only (isolation level read_committed).
    pub read_committed: bool,
    /// Session timeout.
    pub session_timeout: Duration,
    /// Its last heartbeat.
    pub last_seen: Instant,
}

impl Member {
    /// The key the assignors order and hash members by.
    pub fn key(&self) -> String {
        if self.instance_id.is_empty() {
            self.id.clone()
        } else {
            self.instance_id.clone()
        }
    }

    /// Takes in the holding a heartbeat reported. A member can hold only what it was
    /// given: a joining member holds nothing, whatever it reports (it may be a restarted
    /// process, or one whose session expired, still listing its old partitions).
    pub fn report_owned(&mut self, joining: bool, reported: BTreeSet<TopicPartition>) {
        self.owned = if joining {
            BTreeSet::new()
        } else {
            reported
                .into_iter()
                .filter(|tp| self.owned.contains(tp) || self.assignment.contains(tp))
                .collect()
        };
    }

    /// Whether the member may commit an offset of `tp`: it holds it, or was given it.
    pub fn may_commit(&self, tp: &TopicPartition) -> bool {
        self.owned.contains(tp) || self.assignment.contains(tp)
    }
}

/// A group's membership and target assignment.
#[derive(Debug, Clone)]
pub struct GroupState {
    /// The strategy (set by the first member).
    pub strategy: Strategy,
    /// Every member gets every partition.
    pub broadcast: bool,
    /// Grows with every change that can change the assignment.
    pub epoch: i32,
    /// Members by id.
    pub members: BTreeMap<String, Member>,
    /// The subscribed topics and their partition counts the target was computed for.
    pub topics: BTreeMap<String, u32>,
    /// The racks of each subscribed partition's replicas (used by rack-aware).
    pub racks: ReplicaRacks,
    /// The target assignment by member key, for `target_epoch`.
    pub target: BTreeMap<String, BTreeSet<TopicPartition>>,
    /// The group epoch `target` belongs to.
    pub target_epoch: i32,
    /// Whether the members, when it last had any, read committed records only: an
    /// emptied group keeps its lag measured as its members saw it.
    pub read_committed: bool,
}

impl Default for GroupState {
    fn default() -> Self {
        Self {
            strategy: Strategy::Range,
            broadcast: false,
            epoch: 0,
            members: BTreeMap::new(),
            topics: BTreeMap::new(),
            racks: ReplicaRacks::new(),
            target: BTreeMap::new(),
            target_epoch: -1,
            read_committed: false,
        }
    }
}

impl GroupState {
    /// "empty", "stable" (every member holds its target at the group epoch) or
    /// "reconciling".
    pub fn state_name(&self) -> &'static str {
        if self.members.is_empty() {
            "empty"
        } else if self.target_epoch == self.epoch
            && self.members.values().all(|m| m.epoch == self.epoch)
        {
            "stable"
        } else {
            "reconciling"
        }
    }

    /// Bumps the group epoch (membership or subscriptions changed).
    pub fn bump(&mut self) {
        self.epoch += 1;
    }

    /// Removes a member; true when it was there.
    pub fn remove(&mut self, member_id: &str) -> bool {
        let removed = self.members.remove(member_id).is_some();
        if removed {
            self.bump();
        }
        removed
    }

    /// Removes members whose sessions ran out by `now`; returns their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        let expired: Vec<String> = self
            .members
            .values()
            .filter(|m| now.duration_since(m.last_seen) > m.session_timeout)
            .map(|m| m.id.clone())
            .collect();
        for id in &expired {
            self.remove(id);
        }
        expired
    }

    /// Takes in the subscribed topics' partition counts (`topics`, computed by the caller
    /// from the members' subscriptions); bumps the epoch when they changed.
    pub fn set_topics(&mut self, topics: BTreeMap<String, u32>, racks: ReplicaRacks) {
        if topics != self.topics {
            self.topics = topics;
            self.bump();
        }
        if racks != self.racks {
            self.racks = racks;
            if self.strategy == Strategy::RackAware {
                self.bump();
            }
        }
    }

    /// Recomputes the target for the current epoch if needed.
    fn refresh_target(&mut self) {
        if self.target_epoch == self.epoch {
            return;
        }
        let specs: Vec<MemberSpec> = self
            .members
            .values()
            .map(|m| MemberSpec {
                key: m.key(),
                topics: self.member_topics(m),
                owned: m.owned.clone(),
                rack: m.rack.clone(),
            })
            .collect();
        self.target = if self.broadcast {
            specs
                .iter()
                .map(|s| {
                    let all = self
                        .topics
                        .iter()
                        .filter(|(t, _)| s.topics.contains(*t))
                        .flat_map(|(t, n)| (0..*n).map(move |p| (t.clone(), p)))
                        .collect();
                    (s.key.clone(), all)
                })
                .collect()
        } else {
            assign(self.strategy, &specs, &self.topics, &self.racks)
        };
        self.target_epoch = self.epoch;
    }

    /// The topics of `self.topics` a member subscribes to (by name or pattern).
    fn member_topics(&self, m: &Member) -> BTreeSet<String> {
        let pattern = m
            .regex
            .as_deref()
            .and_then(|r| regex::Regex::new(&format!("^(?:{r})$")).ok());
        self.topics
            .keys()
            .filter(|t| m.topics.contains(*t) || pattern.as_ref().is_some_and(|p| p.is_match(t)))
            .cloned()
            .collect()
    }

    /// Moves `member_id` towards its target; returns what it should hold now and updates
    /// its epoch when it holds the whole target.
    pub fn reconcile(&mut self, member_id: &str) -> BTreeSet<TopicPartition> {
        self.refresh_target();
        let Some(member) = self.members.get(member_id) else {
            return BTreeSet::new();
        };
        let target = self.target.get(&member.key()).cloned().unwrap_or_default();
        let owned = member.owned.clone();
        let assignment: BTreeSet<TopicPartition> = if self.broadcast {
            target.clone()
        } else if !owned.is_subset(&target) {
            // Give up what moved away first; nothing new meanwhile.
            owned.intersection(&target).cloned().collect()
        } else {
            // Held: what another member reports holding, or was told to hold and has not
            // answered for yet (it may be taking it up right now).
            let held_by_others: BTreeSet<&TopicPartition> = self
                .members
                .values()
                .filter(|m| m.id != member_id)
                .flat_map(|m| m.owned.iter().chain(&m.assignment))
                .collect();
            target
                .iter()
                .filter(|tp| owned.contains(*tp) || !held_by_others.contains(tp))
                .cloned()
                .collect()
        };
        let epoch = self.epoch;
        let member = self.members.get_mut(member_id).expect("checked above");
        if assignment == target {
            member.epoch = epoch;
        }
        member.assignment = assignment.clone();
        assignment
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_hold_and_commit_only_what_they_were_given() {
        let tp = |p: u32| ("t".to_owned(), p);
        let mut m = member("a");
        m.report_owned(true, [tp(0), tp(1)].into());
        assert!(m.owned.is_empty(), "a joining member holds nothing");
        assert!(!m.may_commit(&tp(0)));
        m.assignment = [tp(0)].into();
        assert!(m.may_commit(&tp(0)), "given, not yet reported");
        m.report_owned(false, [tp(0), tp(1)].into());
        assert_eq!(m.owned, [tp(0)].into(), "never given partition 1");
        m.assignment.clear();
        assert!(m.may_commit(&tp(0)), "revoked but still held");
        m.report_owned(false, BTreeSet::new());
        assert!(!m.may_commit(&tp(0)), "released");
        m.report_owned(false, [tp(0)].into());
        assert!(
            m.owned.is_empty(),
            "a released partition cannot be claimed back"
        );
    }

    fn member(id: &str) -> Member {
        Member {
            id: id.to_owned(),
            instance_id: String::new(),
            client_id: String::new(),
            epoch: 0,
            topics: ["t".to_owned()].into(),
            regex: None,
            owned: BTreeSet::new(),
            assignment: BTreeSet::new(),
            rack: None,
            read_committed: false,
            session_timeout: Duration::from_secs(10),
            last_seen: Instant::now(),
        }
    }

    fn tps(v: &[u32]) -> BTreeSet<TopicPartition> {
        v.iter().map(|p| ("t".to_owned(), *p)).collect()
    }

    /// Simulates a member's heartbeat: it reports what it holds, keeps the answer.
    fn heartbeat(g: &mut GroupState, id: &str) -> BTreeSet<TopicPartition> {
        let a = g.reconcile(id);
        g.members.get_mut(id).unwrap().owned = a.clone();
        a
    }

    #[test]
    fn a_partition_moves_only_after_its_owner_gave_it_up() {
        let mut g = GroupState::default();
        g.members.insert("a".into(), member("a"));
        g.bump();
        g.set_topics([("t".to_owned(), 4)].into(), ReplicaRacks::new());
        assert_eq!(heartbeat(&mut g, "a"), tps(&[0, 1, 2, 3]));
        assert_eq!(g.members["a"].epoch, g.epoch);
        // b joins: the target splits 2/2, but b gets nothing while a still holds them.
        g.members.insert("b".into(), member("b"));
        g.bump();
        assert!(g.reconcile("b").is_empty());
        assert_eq!(g.state_name(), "reconciling");
        // a gives up its half...
        assert_eq!(heartbeat(&mut g, "a"), tps(&[0, 1]));
        // ...and only then does b receive it.
        assert_eq!(heartbeat(&mut g, "b"), tps(&[2, 3]));
        heartbeat(&mut g, "a");
        assert_eq!(g.state_name(), "stable");
        // Never two owners at once along the way.
        let a = &g.members["a"].owned;
        let b = &g.members["b"].owned;
        assert!(a.is_disjoint(b));
    }

    #[test]
    fn a_partition_just_handed_out_is_not_handed_out_again() {
        let mut g = GroupState::default();
        g.members.insert("a".into(), member("a"));
        g.set_topics([("t".to_owned(), 2)].into(), ReplicaRacks::new());
        // a is told to take both but has not answered yet (it reports nothing held).
        assert_eq!(g.reconcile("a"), tps(&[0, 1]));
        g.members.insert("b".into(), member("b"));
        g.bump();
        assert!(
            g.reconcile("b").is_empty(),
            "a may be taking them up right now"
        );
        // a's next heartbeat (still holding nothing) drops its half; then b gets it.
        assert_eq!(g.reconcile("a"), tps(&[0]));
        assert_eq!(g.reconcile("b"), tps(&[1]));
    }

    #[test]
    fn expired_members_leave_and_their_partitions_move() {
        let mut g = GroupState::default();
        let mut old = member("a");
        old.session_timeout = Duration::from_millis(10);
        old.last_seen = Instant::now() - Duration::from_secs(1);
        g.members.insert("a".into(), old);
        g.members.insert("b".into(), member("b"));
        g.set_topics([("t".to_owned(), 2)].into(), ReplicaRacks::new());
        heartbeat(&mut g, "a");
        heartbeat(&mut g, "b");
        assert_eq!(g.expire(Instant::now()), vec!["a".to_owned()]);
        assert_eq!(heartbeat(&mut g, "b"), tps(&[0, 1]));
    }

    #[test]
    fn broadcast_gives_everyone_everything() {
        let mut g = GroupState {
            broadcast: true,
            ..GroupState::default()
        };
        for id in ["a", "b", "c"] {
            g.members.insert(id.into(), member(id));
        }
        g.set_topics([("t".to_owned(), 3)].into(), ReplicaRacks::new());
        for id in ["a", "b", "c"] {
            assert_eq!(heartbeat(&mut g, id), tps(&[0, 1, 2]));
        }
        assert_eq!(g.state_name(), "stable");
    }

    #[test]
    fn patterns_subscribe_to_matching_topics() {
        let mut g = GroupState::default();
        let mut m = member("a");
        m.topics.clear();
        m.regex = Some("orders-.*".into());
        g.members.insert("a".into(), m);
        g.set_topics(
            [("orders-eu".to_owned(), 1), ("users".to_owned(), 1)].into(),
            ReplicaRacks::new(),
        );
        let a = heartbeat(&mut g, "a");
        assert_eq!(a, [("orders-eu".to_owned(), 0)].into());
    }
}
