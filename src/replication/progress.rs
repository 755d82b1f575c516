//! The leader's bookkeeping of its followers, and the rules built on it (pure functions,
//! no I/O): Kafka's caught-up time, the high watermark, and when the ISR shrinks or grows.

use crate::types::{BrokerId, Offset};

/// What the leader knows of one follower, from its fetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FollowerProgress {
    /// The follower's log end offset: the offset of its latest fetch. Zero until the first
    /// fetch after this broker became leader (unknown counts as nothing replicated).
    pub log_end_offset: Offset,
    /// The last time (ms) the follower was known to hold everything the leader held.
    pub last_caught_up_ms: i64,
    /// When the previous fetch arrived (ms).
    pub last_fetch_ms: i64,
    /// The leader's log end offset when the previous fetch arrived.
    pub last_fetch_leader_log_end: Offset,
}

impl FollowerProgress {
    /// A follower as seen by a leader that took over at `now_ms`: it gets the full lag time
    /// to show up before it counts as lagging.
    pub fn new(now_ms: i64) -> Self {
        Self {
            log_end_offset: Offset(0),
            last_caught_up_ms: now_ms,
            last_fetch_ms: now_ms,
            last_fetch_leader_log_end: Offset(0),
        }
    }

    /// Records a fetch at `fetch_offset` arriving at `now_ms` while the leader's log ends at
    /// `leader_log_end`. Kafka's rule: a follower fetching at the leader's end is caught up
    /// now; one fetching at or past where the leader ended at its previous fetch was caught
    /// up at that previous fetch.
    pub fn on_fetch(&mut self, fetch_offset: Offset, leader_log_end: Offset, now_ms: i64) {
        if fetch_offset >= leader_log_end {
            self.last_caught_up_ms = self.last_caught_up_ms.max(now_ms);
        } else if fetch_offset >= self.last_fetch_leader_log_end {
            self.last_caught_up_ms = self.last_caught_up_ms.max(self.last_fetch_ms);
        }
        self.log_end_offset = fetch_offset;
        self.last_fetch_ms = now_ms;
        self.last_fetch_leader_log_end = leader_log_end;
    }

    /// True when the follower has not been caught up for longer than `max_lag_ms`.
    pub fn is_lagging(&self, now_ms: i64, max_lag_ms: i64) -> bool {
        now_ms - self.last_caught_up_ms > max_lag_ms
    }
}

/// The high watermark the ISR allows: the smallest log end offset among `isr` (the leader's
/// own is `leader_log_end`), never below `current` (it never moves backwards on a leader).
/// A member with no progress yet counts as offset 0, which holds the watermark still.
pub fn high_watermark(
    current: Offset,
    leader: BrokerId,
    leader_log_end: Offset,
    isr: &[BrokerId],
    progress: impl Fn(BrokerId) -> Option<FollowerProgress>,
) -> Offset {
    let min = isr
        .iter()
        .map(|&b| {
            if b == leader {
                leader_log_end
            } else {
                progress(b).map_or(Offset(0), |p| p.log_end_offset.min(leader_log_end))
            }
        })
        .min()
        .unwrap_or(leader_log_end);
    current.max(min)
}

/// The ISR the high watermark must respect while a change is in flight: the committed ISR
/// plus any member a pending change adds (Kafka's "maximal ISR"). A member being removed
/// still counts until the removal is committed; one being added counts at once, so the
/// watermark never passes records a soon-to-be member lacks.
pub fn maximal_isr(committed: &[BrokerId], pending: Option<&[BrokerId]>) -> Vec<BrokerId> {
    let mut all = committed.to_vec();
    for b in pending.unwrap_or_default() {
        if !all.contains(b) {
            all.push(*b);
        }
    }
    all
}

/// The ISR members (other than the leader) that have lagged for longer than `max_lag_ms`.
pub fn lagging_members(
    isr: &[BrokerId],
    leader: BrokerId,
    now_ms: i64,
    max_lag_ms: i64,
    progress: impl Fn(BrokerId) -> Option<FollowerProgress>,
) -> Vec<BrokerId> {
    isr.iter()
        .copied()
        .filter(|&b| b != leader)
        .filter(|&b| progress(b).is_none_or(|p| p.is_lagging(now_ms, max_lag_ms)))
        .collect()
}

/// True when a follower outside the ISR may join it: it holds everything up to the high
/// watermark and everything the current leader epoch wrote before it began (so its log
/// agrees with the leader's up to there).
pub fn may_join_isr(
    progress: &FollowerProgress,
    high_watermark: Offset,
    leader_epoch_start: Offset,
) -> bool {
    progress.log_end_offset >= high_watermark && progress.log_end_offset >= leader_epoch_start
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    const LEADER: BrokerId = BrokerId(1);

    fn at(leo: u64) -> FollowerProgress {
        FollowerProgress {
            log_end_offset: Offset(leo),
            ..FollowerProgress::new(0)
        }
    }

    #[test]
    fn high_watermark_is_the_slowest_isr_member() {
        let p: HashMap<BrokerId, FollowerProgress> =
            [(BrokerId(2), at(7)), (BrokerId(3), at(9))].into();
        let isr = [LEADER, BrokerId(2), BrokerId(3)];
        let hw = high_watermark(Offset(0), LEADER, Offset(10), &isr, |b| p.get(&b).copied());
        assert_eq!(hw, Offset(7));
        // A member outside the ISR does not hold it back.
        let hw = high_watermark(Offset(0), LEADER, Offset(10), &isr[..2], |b| {
            p.get(&b).copied()
        });
        assert_eq!(hw, Offset(7));
        let hw = high_watermark(Offset(0), LEADER, Offset(10), &[LEADER, BrokerId(3)], |b| {
            p.get(&b).copied()
        });
        assert_eq!(hw, Offset(9));
        // A member that has not fetched yet holds it still, but never moves it back.
        let hw = high_watermark(Offset(5), LEADER, Offset(10), &[LEADER, BrokerId(4)], |b| {
            p.get(&b).copied()
        });
        assert_eq!(hw, Offset(5));
        // Leader alone: its log end.
        assert_eq!(
            high_watermark(Offset(3), LEADER, Offset(10), &[LEADER], |_| None),
            Offset(10)
        );
    }

    #[test]
    fn caught_up_time_follows_kafkas_rule() {
        let mut p = FollowerProgress::new(0);
        // Fetching at the leader's end: caught up now.
        p.on_fetch(Offset(10), Offset(10), 100);
        assert_eq!(p.last_caught_up_ms, 100);
        // Behind the leader's end, but at or past where the leader was at the previous
        // fetch: caught up as of that previous fetch.
        p.on_fetch(Offset(10), Offset(20), 200);
        assert_eq!(p.last_caught_up_ms, 100);
        p.on_fetch(Offset(20), Offset(30), 300);
        assert_eq!(p.last_caught_up_ms, 200);
        // Falling further behind: no progress.
        p.on_fetch(Offset(25), Offset(40), 400);
        assert_eq!(p.last_caught_up_ms, 200);
        assert!(p.is_lagging(1_000, 500));
        assert!(!p.is_lagging(600, 500));
    }

    #[test]
    fn lagging_members_excludes_the_leader_and_counts_silent_ones() {
        let mut p: HashMap<BrokerId, FollowerProgress> = HashMap::new();
        p.insert(BrokerId(2), FollowerProgress::new(1_000));
        p.insert(BrokerId(3), FollowerProgress::new(0));
        let isr = [LEADER, BrokerId(2), BrokerId(3), BrokerId(4)];
        let lagging = lagging_members(&isr, LEADER, 1_500, 1_000, |b| p.get(&b).copied());
        assert_eq!(lagging, vec![BrokerId(3), BrokerId(4)]);
    }

    #[test]
    fn joining_needs_the_high_watermark_and_the_epoch_start() {
        assert!(may_join_isr(&at(10), Offset(10), Offset(8)));
        assert!(!may_join_isr(&at(9), Offset(10), Offset(8)));
        assert!(!may_join_isr(&at(10), Offset(5), Offset(12)));
    }

    proptest! {
        /// Whatever the fetch history, the watermark never passes any ISR member's log end
        /// (unless it was already there), never exceeds the leader's, and never decreases.
        #[test]
        fn high_watermark_bounds(
            fetches in proptest::collection::vec((2i32..5, 0u64..100), 0..60),
            leader_appends in proptest::collection::vec(0u64..10, 60),
        ) {
            let isr = [LEADER, BrokerId(2), BrokerId(3), BrokerId(4)];
            let mut progress: HashMap<BrokerId, FollowerProgress> = HashMap::new();
            let mut leader_end = 0u64;
            let mut hw = Offset(0);
            for (i, (follower, offset)) in fetches.into_iter().enumerate() {
                leader_end += leader_appends[i];
                let offset = offset.min(leader_end);
                progress
                    .entry(BrokerId(follower))
                    .or_insert_with(|| FollowerProgress::new(0))
                    .on_fetch(Offset(offset), Offset(leader_end), i as i64);
                let next = high_watermark(hw, LEADER, Offset(leader_end), &isr, |b| {
                    progress.get(&b).copied()
                });
                prop_assert!(next >= hw);
                prop_assert!(next.0 <= leader_end);
                if next > hw {
                    for b in &isr[1..] {
                        let leo = progress.get(b).map_or(0, |p| p.log_end_offset.0);
                        prop_assert!(next.0 <= leo, "hw {} passed member {} at {}", next, b, leo);
                    }
                }
                hw = next;
            }
        }

        /// The maximal ISR holds every committed member and every pending one, once each.
        #[test]
        fn maximal_isr_is_the_union(
            committed in proptest::collection::btree_set(1i32..8, 1..5),
            pending in proptest::collection::btree_set(1i32..8, 1..5),
        ) {
            let c: Vec<BrokerId> = committed.iter().map(|&b| BrokerId(b)).collect();
            let p: Vec<BrokerId> = pending.iter().map(|&b| BrokerId(b)).collect();
            let m = maximal_isr(&c, Some(&p));
            let union: std::collections::BTreeSet<i32> = committed.union(&pending).copied().collect();
            prop_assert_eq!(m.len(), union.len());
            for b in union {
                prop_assert!(m.contains(&BrokerId(b)));
            }
        }
    }
}
