//! One `__timers` partition's timers as its leader holds them, built by applying the
//! partition's records in offset order: at load (a scan of the log) and live (each record
//! once it is appended), through the same [`TimerState::apply`]. Pure: no I/O, no clock.

use std::collections::{BTreeMap, HashMap};

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
    /// Pending timers: (due, schedule offset) -> target.
    pending: BTreeMap<(i64, u64), TargetIx>,
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
                self.pending.insert((s.due_ms, offset), ix);
            }
            Some(Entry::Intent(i)) => {
                for (o, d) in i.offsets.iter().zip(&i.dues) {
                    self.pending.remove(&(*d, *o));
                }
                let ix = self.target_ix(&i.topic, i.partition);
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
            }
            Some(Entry::Done(d)) => {
                let ix = self.target_ix(&d.topic, d.partition);
                if let Some(last) = self.last_intent.get_mut(&ix) {
                    if last.offset == d.intent_offset {
                        last.confirmed = true;
                    }
                }
            }
            Some(Entry::Cancel(c)) => {
                self.pending.remove(&(c.due_ms, c.offset));
            }
            Some(Entry::Dropped(d)) => {
                for (o, due) in d.offsets.iter().zip(&d.dues) {
                    self.pending.remove(&(*due, *o));
                }
            }
            Some(Entry::Owner(o)) => {
                self.owner = Some((o.producer_id, o.producer_epoch as i16));
                self.next_seq.clear();
            }
        }
    }

    /// Whether the timer is pending (not delivered, claimed, cancelled or dropped).
    pub fn is_pending(&self, offset: u64, due_ms: i64) -> bool {
        self.pending.contains_key(&(due_ms, offset))
    }

    /// Pending timers.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// No pending timers.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
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

    /// Due timers (due at or before `now_ms`) in due order, at most `limit`, skipping
    /// targets whose last batch is unconfirmed (they wait for it: one batch in flight per
    /// target keeps the sequence order). Looks at no more than `scan_max` timers.
    pub fn due(&self, now_ms: i64, limit: usize, scan_max: usize) -> Vec<DueTimer> {
        self.pending
            .range(..=(now_ms, u64::MAX))
            .take(scan_max)
            .filter(|(_, t)| self.last_intent.get(t).is_none_or(|l| l.confirmed))
            .take(limit)
            .map(|(&(due_ms, offset), &target)| DueTimer {
                due_ms,
                offset,
                target,
            })
            .collect()
    }

    /// The earliest due time among pending timers.
    pub fn next_due(&self) -> Option<i64> {
        self.pending.keys().next().map(|(d, _)| *d)
    }

    /// Pending timers per target topic.
    pub fn pending_by_topic(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for ix in self.pending.values() {
            *out.entry(self.targets[*ix as usize].0.clone()).or_default() += 1;
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
        assert_eq!(
            due.iter().map(|d| d.offset).collect::<Vec<_>>(),
            vec![2, 3, 1]
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
            let mut replay = TimerState::default();
            for (o, r) in log.iter().enumerate() {
                replay.apply(o as u64, r);
            }
            prop_assert_eq!(&live.pending, &replay.pending);
            prop_assert_eq!(live.unconfirmed(), replay.unconfirmed());
            for o in claimed {
                prop_assert!(!live.pending.iter().any(|((_, off), _)| *off == o));
            }
        }
    }
}
