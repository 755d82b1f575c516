//! A classic-protocol group (Kafka's JoinGroup, SyncGroup, Heartbeat and LeaveGroup with
//! client-side assignors), as its coordinator holds it: a pure state machine, with time
//! passed in and no I/O.
//!
//! A rebalance has two phases. In *preparing*, every member must join (again) within the
//! rebalance timeout; the phase ends when all have, or at the deadline (members that did
//! not rejoin are dropped; static members keep their place). A group that starts from
//! empty waits `initial_delay` first, so members starting together land in one
//! generation. The generation then grows, a protocol supported by every member is chosen
//! by vote, and each waiting join is answered; the leader's answer lists every member's
//! metadata. In *completing*, the leader sends the assignment with its SyncGroup, which
//! answers every member's SyncGroup; the group is then *stable* until a member joins,
//! leaves, changes its protocols or misses its session.
//!
//! Long-polling requests (JoinGroup, SyncGroup) are answered through [`Reply`]s: each call
//! returns the replies it completed, for the coordinator to deliver to waiting requests.
//! Static members (`group.instance.id`) that restart take their old place without a
//! rebalance when their protocols are unchanged; the old process is fenced.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use kafka_protocol::messages::{ConsumerProtocolAssignment, ConsumerProtocolSubscription};
use kafka_protocol::protocol::Decodable;

use super::assignor::TopicPartition;
use crate::broker::error::BrokerError;
use crate::error_code::ErrorCode;

fn error(code: ErrorCode, message: impl Into<String>) -> BrokerError {
    BrokerError::new(code, message)
}

/// A JoinGroup, as the coordinator hands it over.
#[derive(Debug, Clone)]
pub struct JoinRequest {
    /// Member id (empty: a new member).
    pub member_id: String,
    /// `group.instance.id` of a static member.
    pub instance_id: Option<String>,
    /// Client id, for display.
    pub client_id: String,
    /// Client address, for display.
    pub client_host: String,
    /// Session timeout (already checked against the broker's bounds).
    pub session_timeout: Duration,
    /// Rebalance timeout.
    pub rebalance_timeout: Duration,
    /// Protocol type (`consumer` for consumers).
    pub protocol_type: String,
    /// Supported protocols (assignors) in preference order, with their metadata.
    pub protocols: Vec<(String, Bytes)>,
    /// JoinGroup v4+: a new member first gets its id with MEMBER_ID_REQUIRED (KIP-394).
    pub require_known_member_id: bool,
    /// JoinGroup v9+: a static leader may rejoin without a rebalance (KIP-814).
    pub supports_skip_assignment: bool,
}

/// What a member's JoinGroup is answered with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinAnswer {
    /// The new generation.
    pub generation: i32,
    /// Protocol type.
    pub protocol_type: String,
    /// The chosen protocol.
    pub protocol: String,
    /// The leader's member id.
    pub leader: String,
    /// The leader computes no assignment (a static leader rejoined a stable group).
    pub skip_assignment: bool,
    /// Members with their metadata for the chosen protocol (leader only; empty for others).
    pub members: Vec<(String, Option<String>, Bytes)>,
}

/// An answer for a waiting request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// The JoinGroup of this member id.
    Join(String, Result<JoinAnswer, BrokerError>),
    /// The SyncGroup of this member id: its assignment.
    Sync(String, Result<Bytes, BrokerError>),
}

/// One member.
#[derive(Debug, Clone)]
pub struct ClassicMember {
    /// Its id (given by the coordinator).
    pub id: String,
    /// `group.instance.id`, for static members.
    pub instance_id: Option<String>,
    /// Client id.
    pub client_id: String,
    /// Client address.
    pub client_host: String,
    /// Session timeout.
    pub session_timeout: Duration,
    /// Rebalance timeout.
    pub rebalance_timeout: Duration,
    /// Protocols in preference order, with metadata.
    pub protocols: Vec<(String, Bytes)>,
    /// Its assignment from the leader (for the current generation).
    pub assignment: Bytes,
    /// Last sign of life.
    pub last_seen: Instant,
    /// A JoinGroup of this member waits for the rebalance.
    pub awaiting_join: bool,
    /// A SyncGroup of this member waits for the leader's.
    pub awaiting_sync: bool,
}

impl ClassicMember {
    fn protocol_names(&self) -> BTreeSet<&str> {
        self.protocols.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Its metadata for `protocol`.
    pub fn metadata(&self, protocol: &str) -> Bytes {
        self.protocols
            .iter()
            .find(|(n, _)| n == protocol)
            .map(|(_, m)| m.clone())
            .unwrap_or_default()
    }
}

/// Where the group is in its rebalance cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// No members.
    Empty,
    /// Waiting for members to join; ends at `deadline`, not before `not_before`.
    Preparing {
        /// Latest end.
        deadline: Instant,
        /// Earliest end (the initial delay of a group that started empty).
        not_before: Instant,
    },
    /// Waiting for the leader's assignment until `deadline`.
    Completing {
        /// Latest end.
        deadline: Instant,
    },
    /// Every member has its assignment.
    Stable,
}

/// A classic group.
#[derive(Debug, Clone)]
pub struct ClassicGroup {
    /// Phase.
    pub phase: Phase,
    /// Generation (grows with each completed join phase).
    pub generation: i32,
    /// Protocol type of the members.
    pub protocol_type: Option<String>,
    /// The chosen protocol of the current generation.
    pub protocol: Option<String>,
    /// The leader's member id.
    pub leader: Option<String>,
    /// Members by id.
    pub members: BTreeMap<String, ClassicMember>,
    /// Ids handed out with MEMBER_ID_REQUIRED, until they expire.
    pub pending: BTreeMap<String, Instant>,
    /// How long a group starting from empty waits for more members.
    pub initial_delay: Duration,
}

impl Default for ClassicGroup {
    fn default() -> Self {
        Self::new(Duration::ZERO)
    }
}

impl ClassicGroup {
    /// An empty group waiting `initial_delay` before its first generation.
    pub fn new(initial_delay: Duration) -> Self {
        Self {
            phase: Phase::Empty,
            generation: 0,
            protocol_type: None,
            protocol: None,
            leader: None,
            members: BTreeMap::new(),
            pending: BTreeMap::new(),
            initial_delay,
        }
    }

    /// Kafka's name of the state: Empty, PreparingRebalance, CompletingRebalance, Stable.
    pub fn state_name(&self) -> &'static str {
        match self.phase {
            Phase::Empty => "Empty",
            Phase::Preparing { .. } => "PreparingRebalance",
            Phase::Completing { .. } => "CompletingRebalance",
            Phase::Stable => "Stable",
        }
    }

    /// No members and no member about to join.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty() && self.pending.is_empty()
    }

    fn by_instance(&self, instance: &str) -> Option<String> {
        self.members
            .values()
            .find(|m| m.instance_id.as_deref() == Some(instance))
            .map(|m| m.id.clone())
    }

    /// Protocols every member supports.
    fn common_protocols(&self) -> Option<BTreeSet<&str>> {
        let mut all = self.members.values().map(|m| m.protocol_names());
        let first = all.next()?;
        Some(all.fold(first, |acc, p| acc.intersection(&p).copied().collect()))
    }

    /// Checks a joining member's protocols against the group's members (other than itself).
    fn check_protocols(&self, req: &JoinRequest) -> Result<(), BrokerError> {
        if req.protocol_type.is_empty() || req.protocols.is_empty() {
            return Err(error(
                ErrorCode::InconsistentGroupProtocol,
                "protocol_type and protocols must not be empty",
            ));
        }
        let others: Vec<&ClassicMember> = self
            .members
            .values()
            .filter(|m| m.id != req.member_id)
            .collect();
        if others.is_empty() {
            return Ok(());
        }
        if self.protocol_type.as_deref() != Some(&req.protocol_type) {
            return Err(error(
                ErrorCode::InconsistentGroupProtocol,
                format!(
                    "the group's protocol type is '{}', the member's '{}'",
                    self.protocol_type.as_deref().unwrap_or(""),
                    req.protocol_type
                ),
            ));
        }
        let mut common: BTreeSet<&str> = others[0].protocol_names();
        for m in &others[1..] {
            common = common.intersection(&m.protocol_names()).copied().collect();
        }
        if !req
            .protocols
            .iter()
            .any(|(n, _)| common.contains(n.as_str()))
        {
            return Err(error(
                ErrorCode::InconsistentGroupProtocol,
                format!(
                    "none of the member's assignors {:?} is supported by every member (common: {:?})",
                    req.protocols.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                    common
                ),
            ));
        }
        Ok(())
    }

    /// Checks that `member_id` is a member and, for static members, still the instance's
    /// current one.
    fn check_member(&self, member_id: &str, instance: Option<&str>) -> Result<(), BrokerError> {
        if let Some(instance) = instance {
            if let Some(current) = self.by_instance(instance) {
                if current != member_id {
                    return Err(error(
                        ErrorCode::FencedInstanceId,
                        format!(
                            "instance '{instance}' is now member {current}; {member_id} is fenced"
                        ),
                    ));
                }
            }
        }
        if !self.members.contains_key(member_id) {
            return Err(error(
                ErrorCode::UnknownMemberId,
                format!("the group has no member '{member_id}' (it left or its session expired)"),
            ));
        }
        Ok(())
    }

    /// A JoinGroup. Returns the member id the request waits under and the replies completed
    /// (which may include this member's own answer).
    pub fn join(
        &mut self,
        req: JoinRequest,
        new_id: String,
        now: Instant,
    ) -> Result<(String, Vec<Reply>), BrokerError> {
        self.check_protocols(&req)?;
        let mut replies = Vec::new();
        if req.member_id.is_empty() {
            if let Some(instance) = req.instance_id.clone() {
                if let Some(old) = self.by_instance(&instance) {
                    return Ok(self.rejoin_static(req, old, new_id, now));
                }
            } else if req.require_known_member_id {
                self.pending
                    .insert(new_id.clone(), now + req.session_timeout);
                replies.push(Reply::Join(
                    new_id.clone(),
                    Err(error(
                        ErrorCode::MemberIdRequired,
                        "join again with the member id this answer carries",
                    )),
                ));
                return Ok((new_id, replies));
            }
            self.add_member(req, new_id.clone(), now, &mut replies);
            return Ok((new_id, replies));
        }
        let id = req.member_id.clone();
        if self.pending.remove(&id).is_some() {
            self.add_member(req, id.clone(), now, &mut replies);
            return Ok((id, replies));
        }
        self.check_member(&id, req.instance_id.as_deref())?;
        let member = self.members.get_mut(&id).expect("checked");
        let same = member.protocols == req.protocols;
        member.last_seen = now;
        member.session_timeout = req.session_timeout;
        member.rebalance_timeout = req.rebalance_timeout;
        member.client_id = req.client_id;
        member.client_host = req.client_host;
        member.protocols = req.protocols;
        let is_leader = self.leader.as_deref() == Some(id.as_str());
        match self.phase {
            Phase::Completing { .. } if same => {
                replies.push(Reply::Join(id.clone(), Ok(self.answer(is_leader, false))));
            }
            Phase::Stable if same && !is_leader => {
                replies.push(Reply::Join(id.clone(), Ok(self.answer(false, false))));
            }
            Phase::Preparing { .. } => {
                self.members.get_mut(&id).expect("checked").awaiting_join = true;
                self.maybe_complete_join(now, &mut replies);
            }
            _ => {
                self.members.get_mut(&id).expect("checked").awaiting_join = true;
                self.prepare(now, &mut replies);
                self.maybe_complete_join(now, &mut replies);
            }
        }
        Ok((id, replies))
    }

    /// A static member restarted (same instance, no member id): it takes the old member's
    /// place under `new_id`; the old id is fenced.
    fn rejoin_static(
        &mut self,
        req: JoinRequest,
        old: String,
        new_id: String,
        now: Instant,
    ) -> (String, Vec<Reply>) {
        let mut replies = Vec::new();
        let mut member = self.members.remove(&old).expect("found by instance");
        let fenced = || {
            error(
                ErrorCode::FencedInstanceId,
                format!("a new process joined as this member's instance; {old} is fenced"),
            )
        };
        if member.awaiting_join {
            replies.push(Reply::Join(old.clone(), Err(fenced())));
        }
        if member.awaiting_sync {
            replies.push(Reply::Sync(old.clone(), Err(fenced())));
        }
        // Metadata changes with every restart (owned partitions, generation): what matters
        // is whether the member supports the same protocols.
        let same =
            member.protocol_names() == req.protocols.iter().map(|(n, _)| n.as_str()).collect();
        let was_leader = self.leader.as_deref() == Some(old.as_str());
        if was_leader {
            self.leader = Some(new_id.clone());
        }
        member.id = new_id.clone();
        member.client_id = req.client_id;
        member.client_host = req.client_host;
        member.session_timeout = req.session_timeout;
        member.rebalance_timeout = req.rebalance_timeout;
        member.protocols = req.protocols;
        member.last_seen = now;
        member.awaiting_join = false;
        member.awaiting_sync = false;
        self.members.insert(new_id.clone(), member);
        // Only a stable group keeps its assignment: during a sync phase the leader's
        // assignment would name the old member id (Kafka rebalances then too).
        let quiet =
            same && self.phase == Phase::Stable && (!was_leader || req.supports_skip_assignment);
        if quiet {
            let answer = self.answer(was_leader, was_leader);
            replies.push(Reply::Join(new_id.clone(), Ok(answer)));
        } else {
            self.members
                .get_mut(&new_id)
                .expect("inserted")
                .awaiting_join = true;
            if !matches!(self.phase, Phase::Preparing { .. }) {
                self.prepare(now, &mut replies);
            }
            self.maybe_complete_join(now, &mut replies);
        }
        (new_id, replies)
    }

    fn add_member(&mut self, req: JoinRequest, id: String, now: Instant, replies: &mut Vec<Reply>) {
        if self.members.is_empty() {
            self.protocol_type = Some(req.protocol_type.clone());
        }
        self.members.insert(
            id.clone(),
            ClassicMember {
                id,
                instance_id: req.instance_id,
                client_id: req.client_id,
                client_host: req.client_host,
                session_timeout: req.session_timeout,
                rebalance_timeout: req.rebalance_timeout,
                protocols: req.protocols,
                assignment: Bytes::new(),
                last_seen: now,
                awaiting_join: true,
                awaiting_sync: false,
            },
        );
        if !matches!(self.phase, Phase::Preparing { .. }) {
            self.prepare(now, replies);
        }
        self.maybe_complete_join(now, replies);
    }

    /// The join answer for `id` in the current generation.
    fn answer(&self, with_members: bool, skip_assignment: bool) -> JoinAnswer {
        let protocol = self.protocol.clone().unwrap_or_default();
        JoinAnswer {
            generation: self.generation,
            protocol_type: self.protocol_type.clone().unwrap_or_default(),
            leader: self.leader.clone().unwrap_or_default(),
            skip_assignment,
            members: if with_members {
                self.members
                    .values()
                    .map(|m| (m.id.clone(), m.instance_id.clone(), m.metadata(&protocol)))
                    .collect()
            } else {
                Vec::new()
            },
            protocol,
        }
    }

    /// Starts a rebalance: waiting SyncGroups are told to rejoin, assignments are dropped.
    fn prepare(&mut self, now: Instant, replies: &mut Vec<Reply>) {
        let rebalance = self
            .members
            .values()
            .map(|m| m.rebalance_timeout)
            .max()
            .unwrap_or_default();
        let not_before = if self.phase == Phase::Empty {
            now + self.initial_delay.min(rebalance)
        } else {
            now
        };
        for m in self.members.values_mut() {
            if m.awaiting_sync {
                m.awaiting_sync = false;
                replies.push(Reply::Sync(
                    m.id.clone(),
                    Err(error(
                        ErrorCode::RebalanceInProgress,
                        "the group started rebalancing; join again",
                    )),
                ));
            }
            m.assignment = Bytes::new();
        }
        self.phase = Phase::Preparing {
            deadline: now + rebalance,
            not_before,
        };
    }

    /// Ends the join phase if every member (and pending member) has joined, or the
    /// deadline passed.
    fn maybe_complete_join(&mut self, now: Instant, replies: &mut Vec<Reply>) {
        let Phase::Preparing {
            deadline,
            not_before,
        } = self.phase
        else {
            return;
        };
        let all_joined = self.pending.is_empty() && self.members.values().all(|m| m.awaiting_join);
        if (all_joined && now >= not_before) || now >= deadline {
            self.complete_join(now, replies);
        }
    }

    fn complete_join(&mut self, now: Instant, replies: &mut Vec<Reply>) {
        // Dynamic members that did not rejoin are gone; static ones keep their place.
        self.members
            .retain(|_, m| m.awaiting_join || m.instance_id.is_some());
        self.generation = self.generation.checked_add(1).unwrap_or(1);
        if self.members.is_empty() {
            self.phase = Phase::Empty;
            self.protocol = None;
            self.leader = None;
            return;
        }
        self.protocol = self.choose_protocol();
        let leader_stays = self
            .leader
            .as_ref()
            .and_then(|l| self.members.get(l))
            .is_some_and(|m| m.awaiting_join);
        if !leader_stays {
            self.leader = self
                .members
                .values()
                .find(|m| m.awaiting_join)
                .or_else(|| self.members.values().next())
                .map(|m| m.id.clone());
        }
        let rebalance = self
            .members
            .values()
            .map(|m| m.rebalance_timeout)
            .max()
            .unwrap_or_default();
        self.phase = Phase::Completing {
            deadline: now + rebalance,
        };
        let waiting: Vec<String> = self
            .members
            .values()
            .filter(|m| m.awaiting_join)
            .map(|m| m.id.clone())
            .collect();
        for id in waiting {
            let is_leader = self.leader.as_deref() == Some(id.as_str());
            let answer = self.answer(is_leader, false);
            let m = self.members.get_mut(&id).expect("listed");
            m.awaiting_join = false;
            m.last_seen = now;
            replies.push(Reply::Join(id, Ok(answer)));
        }
    }

    /// The protocol every member supports that most members prefer (ties: by name).
    fn choose_protocol(&self) -> Option<String> {
        let common = self.common_protocols()?;
        let mut votes: BTreeMap<&str, usize> = BTreeMap::new();
        for m in self.members.values() {
            if let Some((name, _)) = m
                .protocols
                .iter()
                .find(|(n, _)| common.contains(n.as_str()))
            {
                *votes.entry(name.as_str()).or_default() += 1;
            }
        }
        let best = votes.values().copied().max()?;
        votes
            .into_iter()
            .find(|(_, v)| *v == best)
            .map(|(n, _)| n.to_owned())
    }

    /// A SyncGroup; the leader's carries the assignment. Returns the replies completed.
    #[allow(clippy::too_many_arguments)]
    pub fn sync(
        &mut self,
        member_id: &str,
        instance: Option<&str>,
        generation: i32,
        protocol_type: Option<&str>,
        protocol: Option<&str>,
        assignments: Vec<(String, Bytes)>,
        now: Instant,
    ) -> Result<Vec<Reply>, BrokerError> {
        self.check_member(member_id, instance)?;
        if generation != self.generation {
            return Err(self.illegal_generation(generation));
        }
        if protocol_type.is_some_and(|t| Some(t) != self.protocol_type.as_deref())
            || protocol.is_some_and(|p| Some(p) != self.protocol.as_deref())
        {
            return Err(error(
                ErrorCode::InconsistentGroupProtocol,
                format!(
                    "the group uses protocol type '{}' and protocol '{}'",
                    self.protocol_type.as_deref().unwrap_or(""),
                    self.protocol.as_deref().unwrap_or("")
                ),
            ));
        }
        let mut replies = Vec::new();
        match self.phase {
            Phase::Empty => {
                return Err(error(ErrorCode::UnknownMemberId, "the group is empty"));
            }
            Phase::Preparing { .. } => {
                return Err(error(
                    ErrorCode::RebalanceInProgress,
                    "the group is rebalancing; join again",
                ));
            }
            Phase::Stable => {
                let m = self.members.get_mut(member_id).expect("checked");
                m.last_seen = now;
                replies.push(Reply::Sync(member_id.to_owned(), Ok(m.assignment.clone())));
            }
            Phase::Completing { .. } => {
                let m = self.members.get_mut(member_id).expect("checked");
                m.awaiting_sync = true;
                m.last_seen = now;
                if self.leader.as_deref() == Some(member_id) {
                    let mut given: BTreeMap<String, Bytes> = assignments.into_iter().collect();
                    for m in self.members.values_mut() {
                        m.assignment = given.remove(&m.id).unwrap_or_default();
                    }
                    self.phase = Phase::Stable;
                    for m in self.members.values_mut() {
                        if m.awaiting_sync {
                            m.awaiting_sync = false;
                            m.last_seen = now;
                            replies.push(Reply::Sync(m.id.clone(), Ok(m.assignment.clone())));
                        }
                    }
                }
            }
        }
        Ok(replies)
    }

    fn illegal_generation(&self, generation: i32) -> BrokerError {
        error(
            ErrorCode::IllegalGeneration,
            format!(
                "generation {generation} is not the group's current generation {}",
                self.generation
            ),
        )
    }

    /// A Heartbeat.
    pub fn heartbeat(
        &mut self,
        member_id: &str,
        instance: Option<&str>,
        generation: i32,
        now: Instant,
    ) -> Result<(), BrokerError> {
        self.check_member(member_id, instance)?;
        if generation != self.generation {
            return Err(self.illegal_generation(generation));
        }
        self.members.get_mut(member_id).expect("checked").last_seen = now;
        match self.phase {
            Phase::Preparing { .. } => Err(error(
                ErrorCode::RebalanceInProgress,
                "the group is rebalancing; join again",
            )),
            _ => Ok(()),
        }
    }

    /// A LeaveGroup of `leaving` (member id, instance id); one result each, and the replies
    /// completed.
    pub fn leave(
        &mut self,
        leaving: &[(String, Option<String>)],
        now: Instant,
    ) -> (Vec<Result<(), BrokerError>>, Vec<Reply>) {
        let mut replies = Vec::new();
        let mut results = Vec::new();
        let mut removed = false;
        for (member_id, instance) in leaving {
            let id = match instance {
                Some(instance) => match self.by_instance(instance) {
                    Some(current) if member_id.is_empty() || *member_id == current => Ok(current),
                    Some(current) => Err(error(
                        ErrorCode::FencedInstanceId,
                        format!("instance '{instance}' is member {current}, not {member_id}"),
                    )),
                    None => Err(error(
                        ErrorCode::UnknownMemberId,
                        format!("the group has no member with instance '{instance}'"),
                    )),
                },
                None if self.pending.remove(member_id).is_some() => {
                    results.push(Ok(()));
                    continue;
                }
                None if self.members.contains_key(member_id) => Ok(member_id.clone()),
                None => Err(error(
                    ErrorCode::UnknownMemberId,
                    format!("the group has no member '{member_id}'"),
                )),
            };
            results.push(id.map(|id| {
                let m = self.members.remove(&id).expect("found");
                self.answer_removed(&m, &mut replies);
                removed = true;
            }));
        }
        if removed {
            self.after_removal(now, &mut replies);
        } else {
            self.maybe_complete_join(now, &mut replies);
        }
        (results, replies)
    }

    fn answer_removed(&self, m: &ClassicMember, replies: &mut Vec<Reply>) {
        let gone = || error(ErrorCode::UnknownMemberId, "the member left the group");
        if m.awaiting_join {
            replies.push(Reply::Join(m.id.clone(), Err(gone())));
        }
        if m.awaiting_sync {
            replies.push(Reply::Sync(m.id.clone(), Err(gone())));
        }
    }

    fn after_removal(&mut self, now: Instant, replies: &mut Vec<Reply>) {
        if self.members.is_empty() && self.pending.is_empty() {
            if self.phase != Phase::Empty {
                self.complete_join(now, replies);
            }
            return;
        }
        if !matches!(self.phase, Phase::Preparing { .. }) {
            self.prepare(now, replies);
        }
        self.maybe_complete_join(now, replies);
    }

    /// Time passes: expires members whose session ran out and pending ids, ends phases
    /// whose deadline passed. Returns the replies completed and the expired member ids.
    /// With `expire` false, no session runs out in this tick (the caller could not watch
    /// the sessions meanwhile, e.g. heartbeats waited behind a slow commit).
    pub fn tick(&mut self, now: Instant, expire: bool) -> (Vec<Reply>, Vec<String>) {
        let mut replies = Vec::new();
        if expire {
            self.pending.retain(|_, expires| *expires > now);
        }
        let expired: Vec<String> = self
            .members
            .values()
            .filter(|m| expire && !m.awaiting_join && !m.awaiting_sync)
            .filter(|m| now.saturating_duration_since(m.last_seen) > m.session_timeout)
            .map(|m| m.id.clone())
            .collect();
        for id in &expired {
            self.members.remove(id);
        }
        if let Phase::Completing { deadline } = self.phase {
            if now >= deadline {
                // The leader never sent the assignment: whoever did not sync is dropped.
                let silent: Vec<String> = self
                    .members
                    .values()
                    .filter(|m| !m.awaiting_sync)
                    .map(|m| m.id.clone())
                    .collect();
                for id in silent {
                    self.members.remove(&id);
                }
                self.after_removal(now, &mut replies);
                return (replies, expired);
            }
        }
        if !expired.is_empty() {
            self.after_removal(now, &mut replies);
        } else {
            self.maybe_complete_join(now, &mut replies);
        }
        (replies, expired)
    }

    /// Whether an OffsetCommit from `member_id` at `generation` may commit (and counts as
    /// a heartbeat). Generation -1 with no member id commits for a group without members.
    pub fn check_commit(
        &mut self,
        member_id: &str,
        instance: Option<&str>,
        generation: i32,
        now: Instant,
    ) -> Result<(), BrokerError> {
        if generation < 0 && member_id.is_empty() {
            if self.members.is_empty() {
                return Ok(());
            }
            return Err(error(
                ErrorCode::UnknownMemberId,
                format!(
                    "the group has {} active members; commit as one of them",
                    self.members.len()
                ),
            ));
        }
        self.check_member(member_id, instance)?;
        if generation != self.generation {
            return Err(self.illegal_generation(generation));
        }
        if matches!(self.phase, Phase::Completing { .. }) {
            return Err(error(
                ErrorCode::RebalanceInProgress,
                "the group is completing a rebalance; commit after SyncGroup",
            ));
        }
        self.members.get_mut(member_id).expect("checked").last_seen = now;
        Ok(())
    }
}

/// Decodes `consumer`-protocol bytes (a big-endian version, then the body) at their
/// version, or at the newest this codec knows for a newer one (the format only grows).
fn decode_consumer<T: Decodable>(bytes: &[u8], newest: i16) -> Option<T> {
    let mut buf = Bytes::copy_from_slice(bytes);
    if buf.len() < 2 {
        return None;
    }
    let version = i16::from_be_bytes([buf[0], buf[1]]);
    buf.advance(2);
    T::decode(&mut buf, version.clamp(0, newest)).ok()
}

/// The partitions of a `consumer`-protocol assignment (as the leader's assignor wrote it);
/// empty when the bytes are not one.
pub fn consumer_assignment(bytes: &[u8]) -> BTreeSet<TopicPartition> {
    decode_consumer::<ConsumerProtocolAssignment>(bytes, 3)
        .map(|a| {
            a.assigned_partitions
                .iter()
                .flat_map(|t| {
                    t.partitions
                        .iter()
                        .filter_map(|p| u32::try_from(*p).ok())
                        .map(|p| (t.topic.to_string(), p))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The topics of a `consumer`-protocol subscription; empty when the bytes are not one.
pub fn consumer_subscription(bytes: &[u8]) -> BTreeSet<String> {
    decode_consumer::<ConsumerProtocolSubscription>(bytes, 3)
        .map(|s| s.topics.iter().map(|t| t.to_string()).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const DELAY: Duration = Duration::from_millis(3000);

    fn req(member_id: &str, protocols: &[&str]) -> JoinRequest {
        JoinRequest {
            member_id: member_id.to_owned(),
            instance_id: None,
            client_id: "c".to_owned(),
            client_host: "/127.0.0.1".to_owned(),
            session_timeout: Duration::from_secs(10),
            rebalance_timeout: Duration::from_secs(30),
            protocol_type: "consumer".to_owned(),
            protocols: protocols
                .iter()
                .map(|p| ((*p).to_owned(), Bytes::from(format!("meta-{p}"))))
                .collect(),
            require_known_member_id: true,
            supports_skip_assignment: true,
        }
    }

    fn code(r: &Result<impl std::fmt::Debug, BrokerError>) -> Option<ErrorCode> {
        r.as_ref().err().map(|e| e.code)
    }

    fn joins(replies: &[Reply]) -> BTreeMap<String, Result<JoinAnswer, ErrorCode>> {
        replies
            .iter()
            .filter_map(|r| match r {
                Reply::Join(id, a) => Some((id.clone(), a.clone().map_err(|e| e.code))),
                Reply::Sync(..) => None,
            })
            .collect()
    }

    fn syncs(replies: &[Reply]) -> BTreeMap<String, Result<Bytes, ErrorCode>> {
        replies
            .iter()
            .filter_map(|r| match r {
                Reply::Sync(id, a) => Some((id.clone(), a.clone().map_err(|e| e.code))),
                Reply::Join(..) => None,
            })
            .collect()
    }

    /// Two dynamic members through MEMBER_ID_REQUIRED, the initial delay, join and sync.
    fn stable_pair(t0: Instant) -> (ClassicGroup, String, String) {
        let mut g = ClassicGroup::new(DELAY);
        let (a, r) = g.join(req("", &["range"]), "a".into(), t0).unwrap();
        assert_eq!(joins(&r)["a"], Err(ErrorCode::MemberIdRequired));
        assert!(g.members.is_empty() && g.pending.contains_key("a"));
        let (_, r) = g.join(req(&a, &["range"]), "x".into(), t0).unwrap();
        assert!(r.is_empty(), "waits for the initial delay");
        let (_, r) = g
            .join(req("", &["range", "roundrobin"]), "b".into(), t0)
            .unwrap();
        assert_eq!(joins(&r)["b"], Err(ErrorCode::MemberIdRequired));
        let (b, r) = g
            .join(req("b", &["roundrobin", "range"]), "y".into(), t0)
            .unwrap();
        assert!(r.is_empty());
        assert_eq!(
            g.tick(t0 + DELAY / 2, true).0.len(),
            0,
            "not before the delay"
        );
        let (r, _) = g.tick(t0 + DELAY, true);
        let j = joins(&r);
        assert_eq!(j.len(), 2);
        let la = j["a"].as_ref().unwrap();
        let lb = j["b"].as_ref().unwrap();
        assert_eq!((la.generation, lb.generation), (1, 1));
        assert_eq!(la.protocol, "range", "one vote each: the tie goes by name");
        assert_eq!(la.leader, "a");
        assert_eq!(la.members.len(), 2, "the leader sees every member");
        assert!(lb.members.is_empty());
        assert_eq!(g.state_name(), "CompletingRebalance");
        let r = g
            .sync(
                &b,
                None,
                1,
                Some("consumer"),
                Some("range"),
                vec![],
                t0 + DELAY,
            )
            .unwrap();
        assert!(r.is_empty(), "a follower waits for the leader");
        let given = vec![
            ("a".to_owned(), Bytes::from("A")),
            ("b".to_owned(), Bytes::from("B")),
        ];
        let r = g.sync(&a, None, 1, None, None, given, t0 + DELAY).unwrap();
        let s = syncs(&r);
        assert_eq!(s["a"], Ok(Bytes::from("A")));
        assert_eq!(s["b"], Ok(Bytes::from("B")));
        assert_eq!(g.state_name(), "Stable");
        (g, a, b)
    }

    #[test]
    fn two_members_join_sync_and_become_stable() {
        stable_pair(Instant::now());
    }

    #[test]
    fn heartbeats_tell_members_to_rejoin_during_a_rebalance() {
        let t0 = Instant::now();
        let (mut g, a, b) = stable_pair(t0);
        let now = t0 + DELAY;
        assert!(g.heartbeat(&a, None, 1, now).is_ok());
        assert_eq!(
            code(&g.heartbeat(&a, None, 0, now)),
            Some(ErrorCode::IllegalGeneration)
        );
        assert_eq!(
            code(&g.heartbeat("zz", None, 1, now)),
            Some(ErrorCode::UnknownMemberId)
        );
        // A third member joins: the others learn of it from their heartbeats.
        let (c, r) = g.join(req("", &["range"]), "c".into(), now).unwrap();
        assert!(!r.is_empty());
        g.join(req(&c, &["range"]), "-".into(), now).unwrap();
        assert_eq!(g.state_name(), "PreparingRebalance");
        assert_eq!(
            code(&g.heartbeat(&b, None, 1, now)),
            Some(ErrorCode::RebalanceInProgress)
        );
        let (_, r) = g.join(req(&a, &["range"]), "-".into(), now).unwrap();
        assert!(r.is_empty(), "b has not rejoined yet");
        let (_, r) = g.join(req(&b, &["range"]), "-".into(), now).unwrap();
        let j = joins(&r);
        assert_eq!(
            j.len(),
            3,
            "no initial delay for a group that was not empty"
        );
        assert!(j.values().all(|a| a.as_ref().unwrap().generation == 2));
        assert_eq!(j[&a].as_ref().unwrap().leader, a, "the leader stays");
    }

    #[test]
    fn a_silent_member_is_expired_and_one_that_does_not_rejoin_is_dropped() {
        let t0 = Instant::now();
        let (mut g, a, b) = stable_pair(t0);
        let mut now = t0 + DELAY;
        // a keeps beating, b goes quiet past its 10 s session.
        for _ in 0..11 {
            now += Duration::from_secs(1);
            g.heartbeat(&a, None, 1, now).unwrap();
            g.tick(now, true);
        }
        assert!(!g.members.contains_key(&b));
        assert_eq!(g.state_name(), "PreparingRebalance");
        let (_, r) = g.join(req(&a, &["range"]), "-".into(), now).unwrap();
        assert_eq!(joins(&r)[&a].as_ref().unwrap().generation, 2);
        // Now a stops answering after the join: the sync phase times out.
        let (r, _) = g.tick(now + Duration::from_secs(31), true);
        assert!(r.is_empty());
        assert_eq!(g.state_name(), "Empty");
        assert!(g.members.is_empty());
    }

    #[test]
    fn a_member_that_misses_the_join_deadline_is_dropped() {
        let t0 = Instant::now();
        let (mut g, a, b) = stable_pair(t0);
        let now = t0 + DELAY;
        let (_, r) = g
            .join(req(&a, &["roundrobin", "range"]), "-".into(), now)
            .unwrap();
        assert!(
            r.is_empty(),
            "changed protocols start a rebalance; b must rejoin"
        );
        // b heartbeats (REBALANCE_IN_PROGRESS) but never rejoins.
        let later = now + Duration::from_secs(29);
        assert!(g.heartbeat(&b, None, 1, later).is_err());
        let (r, _) = g.tick(now + Duration::from_secs(30), true);
        let j = joins(&r);
        assert_eq!(j.len(), 1);
        assert_eq!(j[&a].as_ref().unwrap().members.len(), 1);
        assert!(!g.members.contains_key(&b));
    }

    #[test]
    fn a_restarted_static_member_takes_its_place_without_a_rebalance() {
        let t0 = Instant::now();
        let mut g = ClassicGroup::new(Duration::ZERO);
        let mut r1 = req("", &["range"]);
        r1.instance_id = Some("i1".into());
        let (old, r) = g.join(r1.clone(), "m1".into(), t0).unwrap();
        assert!(
            joins(&r)[&old].is_ok(),
            "static members need no MEMBER_ID_REQUIRED"
        );
        g.sync(
            &old,
            Some("i1"),
            1,
            None,
            None,
            vec![(old.clone(), Bytes::from("P"))],
            t0,
        )
        .unwrap();
        let (new, r) = g.join(r1.clone(), "m2".into(), t0).unwrap();
        let answer = joins(&r)[&new].clone().unwrap();
        assert_eq!(answer.generation, 1, "no rebalance");
        assert!(answer.skip_assignment, "it was the leader");
        assert_eq!(g.state_name(), "Stable");
        let r = g.sync(&new, Some("i1"), 1, None, None, vec![], t0).unwrap();
        assert_eq!(syncs(&r)[&new], Ok(Bytes::from("P")), "its old assignment");
        assert_eq!(
            code(&g.heartbeat(&old, Some("i1"), 1, t0)),
            Some(ErrorCode::FencedInstanceId)
        );
        // A restart carries new metadata (owned partitions, generation): still quiet.
        let mut changed = r1.clone();
        changed.protocols = vec![("range".to_owned(), Bytes::from("other bytes"))];
        let (newer, r) = g.join(changed, "m2b".into(), t0).unwrap();
        assert_eq!(joins(&r)[&newer].as_ref().unwrap().generation, 1);
        // An older client (no skip_assignment) that led: a rebalance.
        r1.supports_skip_assignment = false;
        let (newer, r) = g.join(r1, "m3".into(), t0).unwrap();
        assert_eq!(joins(&r)[&newer].as_ref().unwrap().generation, 2);
    }

    #[test]
    fn a_static_member_restarting_mid_sync_starts_a_rebalance() {
        let t0 = Instant::now();
        let mut g = ClassicGroup::new(Duration::ZERO);
        let mut r1 = req("", &["range"]);
        r1.instance_id = Some("i1".into());
        let (old, _) = g.join(r1.clone(), "m1".into(), t0).unwrap();
        assert_eq!(g.state_name(), "CompletingRebalance");
        // It restarts before its SyncGroup: the leader's assignment would name `old`.
        let (new, r) = g.join(r1, "m2".into(), t0).unwrap();
        let j = joins(&r);
        let answer = j[&new].clone().unwrap();
        assert_eq!(answer.generation, 2, "a new generation");
        assert!(!answer.skip_assignment, "the new leader assigns");
        assert!(!g.members.contains_key(&old));
    }

    #[test]
    fn leaving_rebalances_and_the_last_leave_empties_the_group() {
        let t0 = Instant::now();
        let (mut g, a, b) = stable_pair(t0);
        let (res, _) = g.leave(&[(b.clone(), None), ("nobody".into(), None)], t0);
        assert!(res[0].is_ok());
        assert_eq!(code(&res[1]), Some(ErrorCode::UnknownMemberId));
        assert_eq!(g.state_name(), "PreparingRebalance");
        let (_, r) = g.join(req(&a, &["range"]), "-".into(), t0).unwrap();
        assert_eq!(joins(&r)[&a].as_ref().unwrap().generation, 2);
        let (res, _) = g.leave(&[(a, None)], t0);
        assert!(res[0].is_ok());
        assert_eq!(g.state_name(), "Empty");
        assert_eq!(g.generation, 3);
    }

    #[test]
    fn commits_check_member_and_generation() {
        let t0 = Instant::now();
        let mut empty = ClassicGroup::new(DELAY);
        assert!(
            empty.check_commit("", None, -1, t0).is_ok(),
            "a group without members"
        );
        let (mut g, a, _) = stable_pair(t0);
        assert!(g.check_commit(&a, None, 1, t0).is_ok());
        assert_eq!(
            code(&g.check_commit(&a, None, 0, t0)),
            Some(ErrorCode::IllegalGeneration)
        );
        assert_eq!(
            code(&g.check_commit("", None, -1, t0)),
            Some(ErrorCode::UnknownMemberId)
        );
        assert_eq!(
            code(&g.check_commit("q", None, 1, t0)),
            Some(ErrorCode::UnknownMemberId)
        );
    }

    #[test]
    fn members_without_a_common_protocol_are_refused() {
        let t0 = Instant::now();
        let (mut g, _, _) = stable_pair(t0);
        let r = g.join(req("", &["sticky"]), "z".into(), t0);
        assert_eq!(code(&r), Some(ErrorCode::InconsistentGroupProtocol));
        let mut other = req("", &["range"]);
        other.protocol_type = "connect".into();
        assert_eq!(
            code(&g.join(other, "z".into(), t0)),
            Some(ErrorCode::InconsistentGroupProtocol)
        );
        assert!(g.pending.is_empty(), "a refused join changes nothing");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Join(usize, bool),
        Sync(usize),
        Beat(usize),
        Leave(usize),
        Tick(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..4, any::<bool>()).prop_map(|(m, s)| Op::Join(m, s)),
            (0usize..4).prop_map(Op::Sync),
            (0usize..4).prop_map(Op::Beat),
            (0usize..4).prop_map(Op::Leave),
            (0u64..40_000).prop_map(Op::Tick),
        ]
    }

    proptest! {
        /// Random members joining, syncing, beating, leaving and time passing: the
        /// generation never goes back, a settled group has a leader among its members,
        /// every waiting request is eventually answered exactly once, and nothing panics.
        #[test]
        fn random_lifecycles_keep_the_invariants(ops in proptest::collection::vec(op(), 1..80)) {
            let t0 = Instant::now();
            let mut now = t0;
            let mut g = ClassicGroup::new(Duration::from_millis(500));
            let mut ids: Vec<String> = vec![String::new(); 4];
            let mut waiting_join: BTreeSet<String> = BTreeSet::new();
            let mut waiting_sync: BTreeSet<String> = BTreeSet::new();
            let mut n = 0;
            let settle = |replies: Vec<Reply>, wj: &mut BTreeSet<String>, ws: &mut BTreeSet<String>| {
                for r in replies {
                    match r {
                        Reply::Join(id, _) => { wj.remove(&id); }
                        Reply::Sync(id, _) => { ws.remove(&id); }
                    }
                }
            };
            for op in ops {
                let generation = g.generation;
                match op {
                    Op::Join(m, statik) => {
                        n += 1;
                        let mut r = req(&ids[m], &["range"]);
                        r.instance_id = statik.then(|| format!("i{m}"));
                        if let Ok((id, replies)) = g.join(r, format!("id{n}"), now) {
                            waiting_join.insert(id.clone());
                            ids[m] = id;
                            settle(replies, &mut waiting_join, &mut waiting_sync);
                        }
                    }
                    Op::Sync(m) => {
                        let given = g.members.keys().map(|k| (k.clone(), Bytes::from(k.clone()))).collect();
                        if let Ok(replies) = g.sync(&ids[m], None, g.generation, None, None, given, now) {
                            waiting_sync.insert(ids[m].clone());
                            settle(replies, &mut waiting_join, &mut waiting_sync);
                        }
                    }
                    Op::Beat(m) => { let _ = g.heartbeat(&ids[m], None, g.generation, now); }
                    Op::Leave(m) => {
                        let (_, replies) = g.leave(&[(ids[m].clone(), None)], now);
                        settle(replies, &mut waiting_join, &mut waiting_sync);
                    }
                    Op::Tick(ms) => {
                        now += Duration::from_millis(ms);
                        let (replies, _) = g.tick(now, true);
                        settle(replies, &mut waiting_join, &mut waiting_sync);
                    }
                }
                prop_assert!(g.generation >= generation);
                if matches!(g.phase, Phase::Completing { .. } | Phase::Stable) {
                    prop_assert!(g.leader.as_ref().is_some_and(|l| g.members.contains_key(l)));
                    prop_assert!(g.members.values().all(|m| !m.awaiting_join));
                }
                if g.phase == Phase::Stable {
                    prop_assert!(g.members.values().all(|m| !m.awaiting_sync));
                }
                if g.phase == Phase::Empty {
                    prop_assert!(g.members.is_empty());
                }
                // A member still waiting is one the group knows is waiting.
                for id in &waiting_join {
                    prop_assert!(g.members.get(id).is_some_and(|m| m.awaiting_join) || (!g.members.contains_key(id) && !g.pending.contains_key(id)));
                }
            }
            // Long after: every join still waiting on a member is answered.
            let (replies, _) = g.tick(now + Duration::from_secs(3600), true);
            settle(replies, &mut waiting_join, &mut waiting_sync);
            let (replies, _) = g.tick(now + Duration::from_secs(7200), true);
            settle(replies, &mut waiting_join, &mut waiting_sync);
            prop_assert!(waiting_join.iter().all(|id| !g.members.contains_key(id)));
            prop_assert!(g.members.values().all(|m| !m.awaiting_join && !m.awaiting_sync));
        }
    }
}
