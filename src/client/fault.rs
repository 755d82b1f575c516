//! Latency-based fault avoidance for the producer (RocketMQ's `sendLatencyFaultEnable`
//! with `retryAnotherBrokerWhenNotStoreOK`): a broker whose produce requests fail or are
//! slow is avoided for a while by records that may go to any partition (no key, no
//! explicit partition, no selector), and their batches still waiting to be sent move to a
//! partition led by another broker.
//!
//! What the avoidance never does: move a batch that was already sent. Its outcome is
//! unknown until the broker answers, and an idempotent producer retries it byte for byte
//! on the same partition, so a record is never written twice; it is delivered when the
//! broker answers or its partition gets a new leader.
//!
//! The periods follow RocketMQ's latency levels, shortened ten-fold (RocketMQ avoids a
//! broker that took 550 ms for 30 s; here 3 s): a request still unanswered counts as slow
//! as it already is, so a paused broker is avoided 550 ms after a request stalls, not
//! when its request timeout ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// (latency at least, avoid for), slowest first.
const LEVELS: [(Duration, Duration); 5] = [
    (Duration::from_secs(15), Duration::from_secs(60)),
    (Duration::from_secs(3), Duration::from_secs(18)),
    (Duration::from_secs(2), Duration::from_secs(12)),
    (Duration::from_secs(1), Duration::from_secs(6)),
    (Duration::from_millis(550), Duration::from_secs(3)),
];

/// Avoidance after a failed request (connection refused, timeout, not the leader).
pub const FAILURE_AVOIDANCE: Duration = Duration::from_secs(10);

/// How long to avoid a broker whose request took (or has been waiting) `latency` and
/// `failed` or not: zero when it answered quickly.
pub fn avoidance(latency: Duration, failed: bool) -> Duration {
    let by_latency = LEVELS
        .iter()
        .find(|(at_least, _)| latency >= *at_least)
        .map_or(Duration::ZERO, |(_, avoid)| *avoid);
    if failed {
        by_latency.max(FAILURE_AVOIDANCE)
    } else {
        by_latency
    }
}

/// The latencies at which an unanswered request marks its broker slower, in order.
pub fn stall_levels() -> impl Iterator<Item = Duration> {
    LEVELS.iter().rev().map(|(at_least, _)| *at_least)
}

/// Partitions a send looks at for one whose leader is not avoided (leaders alternate
/// between brokers, so a few suffice; a bound keeps a send cheap when every broker is
/// avoided).
pub const SEND_PROBES: u32 = 16;

/// Among `count` partitions, the first of `probes` from `preferred` onwards (wrapping)
/// whose leader is not avoided (`avoided_for` gives None); when all of them are avoided,
/// the one whose avoidance ends first (a merely slow broker before a stalled or failed
/// one), the earliest in that order on ties.
pub fn best_partition(
    preferred: u32,
    count: u32,
    probes: u32,
    avoided_for: impl Fn(u32) -> Option<Duration>,
) -> u32 {
    let mut best: Option<(Duration, u32)> = None;
    for p in (0..count.min(probes).max(1)).map(|i| (preferred + i) % count.max(1)) {
        match avoided_for(p) {
            None => return p,
            Some(left) if best.is_none_or(|(b, _)| left < b) => best = Some((left, p)),
            Some(_) => {}
        }
    }
    best.map_or(preferred, |(_, p)| p)
}

/// Brokers to avoid and until when; shared by a producer's sender and its `send`s.
#[derive(Debug)]
pub struct FaultTracker {
    until: Mutex<HashMap<String, Instant>>,
    /// When the last avoidance ends, in ms after `base` (0: none): the hot path's
    /// lock-free check, false again once every avoidance has lapsed.
    ends_ms: AtomicU64,
    base: Instant,
}

impl Default for FaultTracker {
    fn default() -> Self {
        Self {
            until: Mutex::new(HashMap::new()),
            ends_ms: AtomicU64::new(0),
            base: Instant::now(),
        }
    }
}

impl FaultTracker {
    /// Records a request to `broker` that took `latency` (or is still waiting after it).
    /// A quick answer clears the broker; a slow or failed request avoids it for the
    /// period [`avoidance`] gives, never shortening a longer one still running unless it
    /// was answered. Returns true when the broker was not avoided before.
    pub fn record(&self, broker: &str, latency: Duration, outcome: Outcome) -> bool {
        let now = Instant::now();
        let avoid = avoidance(latency, outcome == Outcome::Failed);
        let mut until = self.until.lock();
        until.retain(|_, u| *u > now);
        let mut started = false;
        if avoid.is_zero() {
            if outcome == Outcome::Answered && until.remove(broker).is_some() {
                tracing::info!(%broker, "broker answers quickly again; sending to it");
            }
        } else {
            let end = now + avoid;
            match until.get_mut(broker) {
                Some(u) if outcome == Outcome::Answered => *u = end,
                Some(u) => *u = (*u).max(end),
                None => {
                    tracing::info!(%broker, latency_ms = latency.as_millis() as u64, failed = outcome == Outcome::Failed, avoid_ms = avoid.as_millis() as u64, "avoiding a slow or failing broker for records that may go anywhere");
                    until.insert(broker.to_owned(), end);
                    started = true;
                }
            }
        }
        let ends = until
            .values()
            .max()
            .map_or(0, |u| u.duration_since(self.base).as_millis() as u64 + 1);
        self.ends_ms.store(ends, Ordering::Release);
        started
    }

    /// Whether any broker may be avoided now (a lock-free check for the hot path).
    pub fn any(&self) -> bool {
        let ends = self.ends_ms.load(Ordering::Acquire);
        ends > 0 && (self.base.elapsed().as_millis() as u64) < ends
    }

    /// How much longer `broker` is avoided (None: not avoided).
    pub fn avoided_for(&self, broker: &str) -> Option<Duration> {
        if !self.any() {
            return None;
        }
        let now = Instant::now();
        self.until
            .lock()
            .get(broker)
            .filter(|u| **u > now)
            .map(|u| *u - now)
    }
}

/// How a request to a broker went, as far as avoidance cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Answered (an error that is not the broker's fault counts as an answer).
    Answered,
    /// Failed in a way that says the broker cannot take writes now.
    Failed,
    /// Not answered yet.
    Waiting,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn quick_answers_are_not_avoided_and_slow_ones_grow_with_latency() {
        assert_eq!(avoidance(Duration::from_millis(549), false), Duration::ZERO);
        assert_eq!(
            avoidance(Duration::from_millis(550), false),
            Duration::from_secs(3)
        );
        assert_eq!(
            avoidance(Duration::from_millis(2500), false),
            Duration::from_secs(12)
        );
        assert_eq!(
            avoidance(Duration::from_secs(100), false),
            Duration::from_secs(60)
        );
        assert_eq!(avoidance(Duration::ZERO, true), FAILURE_AVOIDANCE);
        assert_eq!(
            avoidance(Duration::from_secs(20), true),
            Duration::from_secs(60)
        );
    }

    #[test]
    fn stall_levels_rise() {
        let levels: Vec<Duration> = stall_levels().collect();
        assert!(levels.windows(2).all(|w| w[0] < w[1]), "{levels:?}");
        assert_eq!(levels[0], Duration::from_millis(550));
    }

    proptest! {
        #[test]
        fn avoidance_never_falls_as_latency_rises(a in 0u64..100_000, b in 0u64..100_000, failed: bool) {
            let (lo, hi) = (a.min(b), a.max(b));
            prop_assert!(avoidance(Duration::from_millis(lo), failed) <= avoidance(Duration::from_millis(hi), failed));
        }

        #[test]
        fn best_partition_skips_only_avoided_partitions(preferred in 0u32..64, count in 1u32..64, mask: u64, lefts in proptest::collection::vec(1u64..5, 64)) {
            let preferred = preferred % count;
            let avoided = |p: u32| mask & (1 << p) != 0;
            let avoided_for = |p: u32| avoided(p).then(|| Duration::from_secs(lefts[p as usize]));
            let p = best_partition(preferred, count, count, avoided_for);
            prop_assert!(p < count);
            prop_assert_eq!(best_partition(preferred, count, 1, avoided_for), preferred);
            if (0..count).all(avoided) {
                // The avoidance ending first, the earliest from `preferred` among equals.
                let least = (0..count).map(|q| lefts[q as usize]).min().unwrap();
                prop_assert_eq!(lefts[p as usize], least);
                let mut q = preferred;
                while q != p {
                    prop_assert!(lefts[q as usize] > least);
                    q = (q + 1) % count;
                }
            } else {
                prop_assert!(!avoided(p));
                // Nothing available was skipped between `preferred` and `p`.
                let mut q = preferred;
                while q != p {
                    prop_assert!(avoided(q));
                    q = (q + 1) % count;
                }
            }
        }
    }

    #[test]
    fn a_quick_success_clears_a_broker_and_a_stall_does_not() {
        let t = FaultTracker::default();
        assert!(!t.any());
        t.record("b1", Duration::from_millis(600), Outcome::Waiting);
        let slow = t.avoided_for("b1").expect("avoided");
        assert!(slow <= Duration::from_secs(3) && t.avoided_for("b2").is_none());
        t.record("b1", Duration::from_millis(10), Outcome::Waiting);
        assert!(
            t.avoided_for("b1").is_some(),
            "a request still waiting clears nothing"
        );
        t.record("b1", Duration::from_millis(10), Outcome::Failed);
        assert!(t.avoided_for("b1").expect("avoided") > Duration::from_secs(3));
        t.record("b1", Duration::from_millis(10), Outcome::Answered);
        assert!(t.avoided_for("b1").is_none() && !t.any());
        assert!(t.record("b2", Duration::from_secs(1), Outcome::Failed));
        assert!(!t.record("b2", Duration::from_secs(2), Outcome::Waiting));
    }

    #[test]
    fn any_turns_false_when_every_avoidance_lapsed_without_another_record() {
        let t = FaultTracker::default();
        t.record("b1", Duration::from_millis(600), Outcome::Waiting);
        assert!(t.any());
        // Pretend the avoidance ended: the check needs no further record or lookup.
        t.ends_ms.store(1, Ordering::Release);
        std::thread::sleep(Duration::from_millis(2));
        assert!(!t.any() && t.avoided_for("b1").is_none());
    }
}
