//! One `__timers` partition's timers as its leader holds them, built by applying the
//! partition's records in offset order: at load (a scan of the log) and live (each record
//! once it is appended), through the same [`TimerState::apply`]. Pure: no I/O, no clock.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::codec::{Entry, Intent, TimerRecord};

/// A target partition, as an index into [`TimerState`]'s table of targets (pending timers
/// are many, targets few: 4 bytes per timer instead of a name).
pub type TargetIx = u32;

/// A due timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DueTimer {
    /// Its due time (ms).
    pub due_ms: i64,
    /// Offset of its `Schedule` record.
    pub offset: u64,
    /// Where it goes.
    pub target: TargetIx,
}

/// The last delivery batch claimed for a target, and whether it is known to have arrived.
#[derive(Debug, Clone, PartialEq)]
pub struct LastIntent {
    /// Offset of the `Intent` record.
    pub offset: u64,
    /// The intent.
    pub intent: Intent,
    /// A `Done` for it, or a later intent for the same target, was recorded.
    pub confirmed: bool,
}

/// The timers of one `__timers` partition.
#[derive(Debug, Default)]
pub struct TimerState {
    /// Pending timers per target: (due, schedule offset).
    pending: HashMap<TargetIx, BTreeSet<(i64, u64)>>,
    /// How many timers are pending in all.
    count: usize,
    /// The earliest pending due time of every target that may be claimed now (its last
    /// batch is confirmed), so a pass finds claimable timers without walking past the
    /// ones of blocked targets.
    heads: BTreeSet<(i64, TargetIx)>,
    /// Each target's entry in `heads`.
    head_of: HashMap<TargetIx, i64>,
    targets: Vec<(String, u32)>,
    target_ix: HashMap<(String, u32), TargetIx>,
    /// Per target, its last intent. At most one per target is unconfirmed: a mover claims
    /// nothing new for a target until its last batch arrived, so a new leader redoes at
    /// most that one (with the producer id, epoch and sequence it records, which the target
    /// partition's producer state dedupes if it did arrive).
    last_intent: HashMap<TargetIx, LastIntent>,
    /// The current leadership's producer id and epoch.
    owner: Option<(i64, i16)>,
    /// Next sequence per target under `owner`.
    next_seq: HashMap<TargetIx, i32>,
}

impl TimerState {
    /// The index of a target, added when new.
    pub fn target_ix(&mut self, topic: &str, partition: u32) -> TargetIx {
        if let Some(ix) = self.target_ix.get(&(topic.to_owned(), partition)) {
            return *ix;
        }
        let ix = self.targets.len() as TargetIx;
        self.targets.push((topic.to_owned(), partition));
        self.target_ix.insert((topic.to_owned(), partition), ix);
        ix
    }

    /// The target behind an index.
    pub fn target(&self, ix: TargetIx) -> (&str, u32) {
        let (t, p) = &self.targets[ix as usize];
        (t, *p)
    }

    /// Applies the record at `offset`.
    pub fn apply(&mut self, offset: u64, record: &TimerRecord) {
        match &record.entry {
            None => {}
            Some(Entry::Schedule(s)) => {
                let ix = self.target_ix(&s.topic, s.partition);
                if self
                    .pending
                    .entry(ix)
                    .or_default()
                    .insert((s.due_ms, offset))
                {
                    self.count += 1;
                }
                self.reindex(ix);
            }
            Some(Entry::Intent(i)) => {
                let ix = self.target_ix(&i.topic, i.partition);
                self.remove(ix, i.offsets.iter().zip(&i.dues));
                if self.owner == Some((i.producer_id, i.producer_epoch as i16)) {
                    self.next_seq
                        .insert(ix, next_sequence(i.base_sequence, i.offsets.len()));
                }
                self.last_intent.insert(
                    ix,
                    LastIntent {
                        offset,
                        intent: i.clone(),
                        confirmed: false,
                    },
                );
                self.reindex(ix);
            }
            Some(Entry::Done(d)) => {
                let ix = self.target_ix(&d.topic, d.partition);
                if let Some(last) = self.last_intent.get_mut(&ix) {
                    if last.offset == d.intent_offset {
                        last.confirmed = true;
                    }
                }
                self.reindex(ix);
            }
            Some(Entry::Cancel(c)) => {
                if let Some(ix) = self.target_of(c.offset, c.due_ms) {
                    self.remove(ix, [(&c.offset, &c.due_ms)]);
                }
            }
            Some(Entry::Dropped(d)) => {
                let ix = self.target_ix(&d.topic, d.partition);
                self.remove(ix, d.offsets.iter().zip(&d.dues));
            }
            Some(Entry::Owner(o)) => {
                self.owner = Some((o.producer_id, o.producer_epoch as i16));
                self.next_seq.clear();
            }
        }
    }

    /// Takes timers of `target` out of the pending ones.
    fn remove<'a>(
        &mut self,
        target: TargetIx,
        timers: impl IntoIterator<Item = (&'a u64, &'a i64)>,
    ) {
        if let Some(set) = self.pending.get_mut(&target) {
            for (o, d) in timers {
                if set.remove(&(*d, *o)) {
                    self.count -= 1;
                }
            }
        }
        self.reindex(target);
    }

    /// Puts `target`'s entry in `heads` right: its earliest pending due time when it may
    /// be claimed, none when it has nothing pending or waits for a batch.
    fn reindex(&mut self, target: TargetIx) {
        if let Some(due) = self.head_of.remove(&target) {
            self.heads.remove(&(due, target));
        }
        let blocked = self.last_intent.get(&target).is_some_and(|l| !l.confirmed);
        if blocked {
            return;
        }
        if let Some(&(due, _)) = self.pending.get(&target).and_then(|s| s.first()) {
            self.heads.insert((due, target));
            self.head_of.insert(target, due);
        }
    }

    /// The target holding a pending timer (looked up by its id's offset and due time: a
    /// cancel, which is rare, pays a look at each target).
    fn target_of(&self, offset: u64, due_ms: i64) -> Option<TargetIx> {
        self.pending
            .iter()
            .find(|(_, set)| set.contains(&(due_ms, offset)))
            .map(|(ix, _)| *ix)
    }

    /// Whether the timer is pending (not delivered, claimed, cancelled or dropped).
    pub fn is_pending(&self, offset: u64, due_ms: i64) -> bool {
        self.target_of(offset, due_ms).is_some()
    }

    /// Pending timers.
    pub fn len(&self) -> usize {
        self.count
    }

    /// No pending timers.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The current producer id and epoch, once an `Owner` was applied.
    pub fn owner(&self) -> Option<(i64, i16)> {
        self.owner
    }

    /// The sequence the next batch to `target` starts at under the current owner.
    pub fn next_seq(&self, target: TargetIx) -> i32 {
        self.next_seq.get(&target).copied().unwrap_or(0)
    }

    /// Intents not known to have arrived, oldest first.
    pub fn unconfirmed(&self) -> Vec<LastIntent> {
        let mut v: Vec<_> = self
            .last_intent
            .values()
            .filter(|l| !l.confirmed)
            .cloned()
            .collect();
        v.sort_by_key(|l| l.offset);
        v
    }

    /// Due timers (due at or before `now_ms`) of the targets that may be claimed (their
    /// last batch is confirmed: one batch in flight per target keeps the sequence order),
    /// at most `limit` in all and `per_target` per target, grouped by target in the order
    /// of their earliest due time, each target's in due order.
    pub fn due(&self, now_ms: i64, limit: usize, per_target: usize) -> Vec<DueTimer> {
        let mut out = Vec::new();
        for &(_, target) in self.heads.range(..=(now_ms, TargetIx::MAX)) {
            if out.len() >= limit {
                break;
            }
            let room = per_target.min(limit - out.len());
            let set = &self.pending[&target];
            out.extend(
                set.range(..=(now_ms, u64::MAX))
                    .take(room)
                    .map(|&(due_ms, offset)| DueTimer {
                        due_ms,
                        offset,
                        target,
                    }),
            );
        }
        out
    }

    /// The earliest due time among timers that may be claimed now.
    pub fn next_due(&self) -> Option<i64> {
        self.heads.first().map(|(d, _)| *d)
    }

    /// Pending timers per target topic.
    pub fn pending_by_topic(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for (ix, set) in &self.pending {
            if !set.is_empty() {
                *out.entry(self.targets[*ix as usize].0.clone()).or_default() += set.len() as u64;
            }
        }
        out
    }
}

/// The sequence after a batch of `count` records starting at `base` (sequences wrap at
/// `i32::MAX` to 0, as in Kafka).
pub fn next_sequence(base: i32, count: usize) -> i32 {
    ((i64::from(base) + count as i64) % (i64::from(i32::MAX) + 1)) as i32
}

/// Splits due timers into delivery batches: per target, in due order, at most
/// `max_records` each. Targets keep the order of their first due timer.
pub fn plan_batches(due: &[DueTimer], max_records: usize) -> Vec<(TargetIx, Vec<DueTimer>)> {
    let mut out: Vec<(TargetIx, Vec<DueTimer>)> = Vec::new();
    let mut open: HashMap<TargetIx, usize> = HashMap::new();
    for d in due {
        match open.get(&d.target) {
            Some(&i) if out[i].1.len() < max_records.max(1) => out[i].1.push(*d),
            Some(_) => {}
            None => {
                open.insert(d.target, out.len());
                out.push((d.target, vec![*d]));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::codec::{Cancel, Done, Owner, Schedule};
    use super::*;
    use proptest::prelude::*;

    fn schedule(topic: &str, partition: u32, due_ms: i64) -> TimerRecord {
        TimerRecord {
            entry: Some(Entry::Schedule(Schedule {
                topic: topic.into(),
                partition,
                due_ms,
                ..Default::default()
            })),
        }
    }

    fn intent(state: &mut TimerState, due: &[DueTimer]) -> TimerRecord {
        let (pid, epoch) = state.owner().unwrap();
        let (topic, partition) = state.target(due[0].target);
        TimerRecord {
            entry: Some(Entry::Intent(Intent {
                topic: topic.into(),
                partition,
                producer_id: pid,
                producer_epoch: epoch.into(),
                base_sequence: state.next_seq(due[0].target),
                offsets: due.iter().map(|d| d.offset).collect(),
                dues: due.iter().map(|d| d.due_ms).collect(),
            })),
        }
    }

    fn owner(pid: i64, epoch: i32) -> TimerRecord {
        TimerRecord {
            entry: Some(Entry::Owner(Owner {
                producer_id: pid,
                producer_epoch: epoch,
            })),
        }
    }

    #[test]
    fn a_claimed_target_waits_for_its_batch() {
        let mut s = TimerState::default();
        s.apply(0, &owner(7, 0));
        s.apply(1, &schedule("a", 0, 100));
        s.apply(2, &schedule("a", 0, 50));
        s.apply(3, &schedule("b", 1, 60));
        assert!(s.due(40, 10, 100).is_empty());
        let due = s.due(100, 10, 100);
        // Grouped by target, targets in the order of their earliest due time.
        assert_eq!(
            due.iter().map(|d| d.offset).collect::<Vec<_>>(),
            vec![2, 1, 3]
        );
        let batches = plan_batches(&due, 10);
        assert_eq!(batches.len(), 2);
        let a = intent(&mut s, &batches[0].1);
        s.apply(4, &a);
        assert_eq!(s.next_seq(batches[0].0), 2);
        // "a" is blocked until its batch is confirmed; "b" is not.
        assert_eq!(
            s.due(100, 10, 100)
                .iter()
                .map(|d| d.offset)
                .collect::<Vec<_>>(),
            vec![3]
        );
        assert_eq!(s.unconfirmed().len(), 1);
        s.apply(5, &schedule("a", 0, 70));
        assert_eq!(s.due(100, 10, 100).len(), 1);
        s.apply(
            6,
            &TimerRecord {
                entry: Some(Entry::Done(Done {
                    topic: "a".into(),
                    partition: 0,
                    intent_offset: 4,
                })),
            },
        );
        assert!(s.unconfirmed().is_empty());
        assert_eq!(s.due(100, 10, 100).len(), 2);
        // A new owner starts every target's sequence at 0.
        s.apply(7, &owner(7, 1));
        assert_eq!(s.next_seq(batches[0].0), 0);
    }

    #[test]
    fn cancel_removes_exactly_one_timer() {
        let mut s = TimerState::default();
        s.apply(1, &schedule("a", 0, 100));
        s.apply(2, &schedule("a", 0, 100));
        assert!(s.is_pending(1, 100));
        s.apply(
            3,
            &TimerRecord {
                entry: Some(Entry::Cancel(Cancel {
                    offset: 1,
                    due_ms: 100,
                })),
            },
        );
        assert!(!s.is_pending(1, 100));
        assert!(s.is_pending(2, 100));
        assert_eq!(s.pending_by_topic().get("a"), Some(&1));
    }

    #[test]
    fn sequences_wrap() {
        assert_eq!(next_sequence(i32::MAX, 1), 0);
        assert_eq!(next_sequence(i32::MAX - 1, 3), 1);
        assert_eq!(next_sequence(5, 10), 15);
    }

    proptest! {
        /// However schedules, claims, confirmations and cancels interleave, a load that
        /// replays the log from scratch reaches the same state as the live mover, and no
        /// timer is both pending and claimed.
        #[test]
        fn replay_matches_live(ops in proptest::collection::vec((0u8..4, 0i64..50, 0u32..3), 1..80)) {
            let mut live = TimerState::default();
            let mut log: Vec<TimerRecord> = Vec::new();
            let push = |live: &mut TimerState, log: &mut Vec<TimerRecord>, r: TimerRecord| {
                live.apply(log.len() as u64, &r);
                log.push(r);
            };
            push(&mut live, &mut log, owner(1, 0));
            let mut claimed: Vec<u64> = Vec::new();
            for (op, due, p) in ops {
                match op {
                    0 | 1 => push(&mut live, &mut log, schedule("t", p, due)),
                    2 => {
                        let due = live.due(due, 5, 100);
                        for (_, b) in plan_batches(&due, 3) {
                            claimed.extend(b.iter().map(|d| d.offset));
                            let r = intent(&mut live, &b);
                            push(&mut live, &mut log, r);
                        }
                    }
                    _ => {
                        for l in live.unconfirmed() {
                            let r = TimerRecord { entry: Some(Entry::Done(Done {
                                topic: l.intent.topic.clone(),
                                partition: l.intent.partition,
                                intent_offset: l.offset,
                            }))};
                            push(&mut live, &mut log, r);
                        }
                    }
                }
            }
            // What a pass may claim: every due timer of every target not waiting for a
            // batch, and nothing else.
            for now in [0i64, 25, 50] {
                let mut got: Vec<(i64, u64)> = live
                    .due(now, usize::MAX, usize::MAX)
                    .iter()
                    .map(|d| (d.due_ms, d.offset))
                    .collect();
                got.sort_unstable();
                let mut want: Vec<(i64, u64)> = live
                    .pending
                    .iter()
                    .filter(|(ix, _)| live.last_intent.get(ix).is_none_or(|l| l.confirmed))
                    .flat_map(|(_, set)| set.iter().copied())
                    .filter(|(d, _)| *d <= now)
                    .collect();
                want.sort_unstable();
                prop_assert_eq!(got, want);
            }
            let mut replay = TimerState::default();
            for (o, r) in log.iter().enumerate() {
                replay.apply(o as u64, r);
            }
            prop_assert_eq!(&live.pending, &replay.pending);
            prop_assert_eq!(live.unconfirmed(), replay.unconfirmed());
            for o in claimed {
                prop_assert!(!live.pending.values().any(|set| set.iter().any(|(_, off)| *off == o)));
            }
        }
    }
}
