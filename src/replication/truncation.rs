//! Where a follower truncates before it fetches from a new leader (Kafka's KIP-101 and
//! KIP-279), as a pure function of the two logs' leader-epoch histories.
//!
//! The follower asks the leader where its latest epoch ends. If the leader knows that
//! epoch, the logs agree up to the smaller of the two ends of it. If the leader only knows
//! an older epoch, the follower looks at where *it* ends that older epoch; if the follower
//! does not hold that epoch either, it asks again about its own epoch before it. Each
//! epoch is written by exactly one leader, so two logs holding the same epoch agree on its
//! records up to the shorter one's end.

use crate::types::{LeaderEpoch, Offset};

/// What the follower does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TruncationStep {
    /// Cut the log at this offset (a no-op when the log already ends there), then fetch.
    TruncateTo(Offset),
    /// Ask the leader about this (older) epoch.
    Ask(LeaderEpoch),
}

/// The next step after the leader answered `asked` with `leader_answer` (the largest epoch
/// `<= asked` it holds and that epoch's end; `None` when it holds none).
///
/// `local_end_for` is the follower's own answer to the same question (see
/// [`crate::partition::PartitionLog::end_offset_for_epoch`]); `local_high_watermark` is
/// the fallback when nothing is known in common: records below it were committed, so the
/// leader holds them.
pub fn next_step(
    asked: LeaderEpoch,
    leader_answer: Option<(LeaderEpoch, Offset)>,
    local_end_for: impl Fn(LeaderEpoch) -> Option<(LeaderEpoch, Offset)>,
    local_high_watermark: Offset,
) -> TruncationStep {
    let Some((leader_epoch, leader_end)) = leader_answer else {
        return TruncationStep::TruncateTo(local_high_watermark);
    };
    let target = if leader_epoch < asked {
        leader_epoch
    } else {
        asked
    };
    match local_end_for(target) {
        Some((local_epoch, local_end)) if local_epoch == target => {
            TruncationStep::TruncateTo(leader_end.min(local_end))
        }
        // We do not hold the leader's epoch: the logs may still agree on an older one.
        Some((local_epoch, _)) if local_epoch < target && local_epoch.0 >= 0 => {
            TruncationStep::Ask(local_epoch)
        }
        _ => TruncationStep::TruncateTo(local_high_watermark),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::LeaderEpochCache;
    use proptest::prelude::*;
    use std::path::Path;

    /// A log as the epoch of each offset.
    fn cache_of(log: &[i32]) -> LeaderEpochCache {
        let mut cache = LeaderEpochCache::empty(Path::new("/nonexistent"));
        for (offset, &epoch) in log.iter().enumerate() {
            cache.assign(LeaderEpoch(epoch), Offset(offset as u64));
        }
        cache
    }

    /// Runs the whole exchange; returns the truncation offset and the number of questions.
    fn truncation_point(leader: &[i32], follower: &[i32], follower_hw: u64) -> (u64, usize) {
        let (lc, fc) = (cache_of(leader), cache_of(follower));
        let leader_end = Offset(leader.len() as u64);
        let follower_end = Offset(follower.len() as u64);
        let Some(mut asked) = fc.latest_epoch() else {
            return (0, 0);
        };
        for round in 1..=64 {
            let answer = lc.end_offset_for(asked, leader_end);
            match next_step(
                asked,
                answer,
                |e| fc.end_offset_for(e, follower_end),
                Offset(follower_hw),
            ) {
                TruncationStep::TruncateTo(o) => return (o.0.min(follower_end.0), round),
                TruncationStep::Ask(e) => {
                    assert!(e < asked, "questions must go to older epochs");
                    asked = e;
                }
            }
        }
        panic!("no answer after 64 rounds");
    }

    #[test]
    fn old_leader_drops_its_uncommitted_tail() {
        // Both wrote epoch 0 to offset 5; the old leader (follower now) appended 3 more in
        // epoch 0; the new leader began epoch 1 at offset 5.
        let leader = [0, 0, 0, 0, 0, 1, 1];
        let follower = [0, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(truncation_point(&leader, &follower, 3).0, 5);
    }

    #[test]
    fn follower_behind_keeps_everything() {
        let leader = [0, 0, 1, 1, 2, 2];
        let follower = [0, 0, 1];
        assert_eq!(truncation_point(&leader, &follower, 0).0, 3);
    }

    #[test]
    fn epochs_the_leader_never_saw_are_skipped_by_asking_again() {
        // The follower led epochs 2 and 4 alone; the leader led 3 and 5.
        let leader = [0, 0, 1, 3, 3, 5];
        let follower = [0, 0, 1, 2, 2, 4];
        assert_eq!(truncation_point(&leader, &follower, 1), (3, 2));
    }

    /// Builds two logs that share a prefix and then diverge the way real epoch histories
    /// can: the writer of the last shared epoch may hold more of it, and every later epoch
    /// belongs to one side only.
    fn histories() -> impl Strategy<Value = (Vec<i32>, Vec<i32>, usize)> {
        (
            proptest::collection::vec(1usize..4, 1..5),
            0usize..4,
            any::<bool>(),
            proptest::collection::vec((any::<bool>(), 1usize..4), 0..6),
        )
            .prop_map(|(common, extra, leader_wrote_last, later)| {
                let mut shared = Vec::new();
                for (epoch, n) in common.iter().enumerate() {
                    shared.extend(std::iter::repeat_n(epoch as i32, *n));
                }
                let last = common.len() as i32 - 1;
                let (mut leader, mut follower) = (shared.clone(), shared.clone());
                let writer = if leader_wrote_last {
                    &mut leader
                } else {
                    &mut follower
                };
                writer.extend(std::iter::repeat_n(last, extra));
                for (i, (to_leader, n)) in later.iter().enumerate() {
                    let epoch = last + 1 + i as i32;
                    let side = if *to_leader {
                        &mut leader
                    } else {
                        &mut follower
                    };
                    side.extend(std::iter::repeat_n(epoch, *n));
                }
                // The leader holds the newest epoch of all.
                let newest = last + 1 + later.len() as i32;
                leader.push(newest);
                (leader, follower, shared.len())
            })
    }

    proptest! {
        /// The follower truncates exactly to where the two logs stop agreeing: it keeps
        /// nothing the leader lacks, and loses nothing they share (so no committed record).
        #[test]
        fn truncates_to_the_longest_common_prefix((leader, follower, shared) in histories(), hw_frac in 0.0f64..=1.0) {
            let common = leader.iter().zip(&follower).take_while(|(a, b)| a == b).count();
            prop_assert!(common >= shared);
            let hw = (shared as f64 * hw_frac) as u64;
            let (point, _) = truncation_point(&leader, &follower, hw);
            prop_assert_eq!(point as usize, common, "leader {:?} follower {:?}", leader, follower);
        }
    }
}
