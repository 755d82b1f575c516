//! The broker's write permission as partition leader, from what its heartbeats last said.
//!
//! Safety of acknowledged writes does not rest on this: under `acks=all` a leader that was
//! replaced cannot commit anything, because its in-sync followers learn the new leader
//! epoch and stop fetching from it, so its high watermark stops (docs/replication.md). What
//! this adds is a narrower window for `acks=1`/`acks=0` writes on a leader that is about to
//! learn that it was replaced:
//!
//! - **Answered** (a heartbeat sent at `t` was answered "not fenced"): the controllers
//!   cannot fence the broker before `t + session timeout`; writes are allowed until 90% of
//!   that (clock-rate slack).
//! - **Fenced**: a controller said so, or the registration was lost: writes are refused at
//!   once, until a heartbeat unfences the broker *and* it has applied the metadata version
//!   of that answer (which holds every leadership that moved meanwhile).
//! - **Lapsed** (no answer for longer than the lease): the next heartbeat decides. If it
//!   is answered, as above (after a lapse the metadata of the answer must be applied too,
//!   since the controllers may have fenced and unfenced the broker unheard). If it reaches
//!   no controller (the quorum is down or cut off), writes are allowed again: no controller
//!   can elect another leader without the followers learning it, so `acks=all` stays safe,
//!   and the data plane keeps serving through a controller outage. Until one of the two
//!   happens a write waits ([`LeaseCheck::Pending`]); so a broker resuming from a pause
//!   asks before it writes.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

/// Session timeout assumed until a controller has told us its own.
const DEFAULT_SESSION: Duration = Duration::from_secs(9);

#[derive(Debug)]
struct State {
    /// Writes are allowed without asking until then (from the last answered heartbeat).
    valid_until: Option<Instant>,
    /// Metadata version the broker must have applied before writes are allowed.
    min_metadata_version: u64,
    fenced: bool,
    /// When the latest heartbeat that reached no controller was sent.
    last_unanswered_sent: Option<Instant>,
    /// When the latest answered heartbeat was sent.
    last_answered_sent: Option<Instant>,
}

/// What [`LeaderLease::check`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseCheck {
    /// Writes are allowed.
    Granted,
    /// Writes are refused, and why.
    Refused(String),
    /// The next heartbeat decides; wait with [`LeaderLease::changed`].
    Pending,
}

/// Whether this broker may lead right now.
#[derive(Debug)]
pub struct LeaderLease {
    state: Mutex<State>,
    changed: Notify,
}

impl Default for LeaderLease {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                valid_until: None,
                min_metadata_version: 0,
                fenced: true,
                last_unanswered_sent: None,
                last_answered_sent: None,
            }),
            changed: Notify::new(),
        }
    }
}

impl LeaderLease {
    /// Takes in a heartbeat answer: the heartbeat was sent at `sent_at`; the controller
    /// said `fenced`, at `metadata_version`, with this session timeout (0: unknown).
    pub fn on_heartbeat(
        &self,
        sent_at: Instant,
        fenced: bool,
        metadata_version: u64,
        session_timeout: Duration,
    ) {
        {
            let mut state = self.state.lock();
            state.last_answered_sent =
                Some(state.last_answered_sent.map_or(sent_at, |t| t.max(sent_at)));
            if fenced {
                state.fenced = true;
                state.valid_until = None;
            } else {
                // After being fenced, or after a lapse (the controllers may have fenced and
                // unfenced us meanwhile without our hearing of it), leaderships may have
                // moved: the metadata must catch up before writes count.
                let lapsed = state.valid_until.is_none_or(|until| sent_at >= until);
                if state.fenced || lapsed {
                    state.fenced = false;
                    state.min_metadata_version = metadata_version;
                }
                let session = if session_timeout.is_zero() {
                    DEFAULT_SESSION
                } else {
                    session_timeout
                };
                let until = sent_at + session.mul_f64(0.9);
                state.valid_until = Some(state.valid_until.map_or(until, |u| u.max(until)));
            }
        }
        self.changed.notify_waiters();
    }

    /// Takes in a heartbeat sent at `sent_at` that reached no controller (refused,
    /// timed out, or no quorum to answer it).
    pub fn on_heartbeat_unanswered(&self, sent_at: Instant) {
        {
            let mut state = self.state.lock();
            state.last_unanswered_sent = Some(
                state
                    .last_unanswered_sent
                    .map_or(sent_at, |t| t.max(sent_at)),
            );
        }
        self.changed.notify_waiters();
    }

    /// Marks the broker fenced (registration lost).
    pub fn revoke(&self) {
        {
            let mut state = self.state.lock();
            state.fenced = true;
            state.valid_until = None;
        }
        self.changed.notify_waiters();
    }

    /// False once the controllers count as down: the lease lapsed and a heartbeat sent
    /// since reached no controller (a single failed heartbeat, e.g. during a Raft
    /// election, does not count).
    pub fn controllers_reachable(&self) -> bool {
        !unreachable_after_lapse(&self.state.lock())
    }

    /// Whether the broker may accept writes now, holding `metadata_version`.
    pub fn check(&self, metadata_version: u64) -> LeaseCheck {
        let state = self.state.lock();
        decide(&state, Instant::now(), metadata_version)
    }

    /// Resolves when any heartbeat outcome arrives. Create it before [`Self::check`] so
    /// an outcome in between is not missed.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }
}

/// Whether the lease lapsed and a heartbeat sent since then reached no controller (with
/// none answered after it).
fn unreachable_after_lapse(state: &State) -> bool {
    let Some(until) = state.valid_until else {
        return false;
    };
    state
        .last_unanswered_sent
        .is_some_and(|u| u >= until && state.last_answered_sent.is_none_or(|a| a <= u))
}

/// The write permission at `now` (pure: see the module doc).
fn decide(state: &State, now: Instant, metadata_version: u64) -> LeaseCheck {
    if state.fenced {
        return LeaseCheck::Refused("this broker is fenced by the controllers".to_owned());
    }
    if metadata_version < state.min_metadata_version {
        return LeaseCheck::Refused(format!(
            "this broker has not caught up with the controllers' metadata yet (at version {metadata_version}, needs {})",
            state.min_metadata_version
        ));
    }
    let Some(until) = state.valid_until else {
        return LeaseCheck::Refused("this broker has no session with the controllers".to_owned());
    };
    if now < until {
        return LeaseCheck::Granted;
    }
    // Lapsed: a heartbeat sent since then that reached no controller (and none answered
    // after it) means the controllers are unreachable, not that we were replaced.
    if unreachable_after_lapse(state) {
        LeaseCheck::Granted
    } else {
        LeaseCheck::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn fenced_until_a_heartbeat_unfences_and_the_metadata_catches_up() {
        let lease = LeaderLease::default();
        assert!(matches!(lease.check(100), LeaseCheck::Refused(_)));
        let t0 = Instant::now();
        lease.on_heartbeat(t0, false, 10, MINUTE);
        assert!(matches!(lease.check(9), LeaseCheck::Refused(_)));
        assert_eq!(lease.check(10), LeaseCheck::Granted);
        // A later heartbeat does not raise the metadata requirement.
        lease.on_heartbeat(t0, false, 50, MINUTE);
        assert_eq!(lease.check(10), LeaseCheck::Granted);
        // Fenced by a controller: refused at once, whatever else happened.
        lease.on_heartbeat(Instant::now(), true, 60, MINUTE);
        let LeaseCheck::Refused(why) = lease.check(100) else {
            panic!("fenced")
        };
        assert!(why.contains("fenced"));
        lease.on_heartbeat_unanswered(Instant::now());
        assert!(matches!(lease.check(100), LeaseCheck::Refused(_)));
        lease.on_heartbeat(Instant::now(), false, 70, MINUTE);
        assert!(matches!(lease.check(69), LeaseCheck::Refused(_)));
        assert_eq!(lease.check(70), LeaseCheck::Granted);
    }

    #[test]
    fn a_lapse_waits_for_the_next_heartbeat() {
        let lease = LeaderLease::default();
        let long_ago = Instant::now() - Duration::from_secs(10);
        lease.on_heartbeat(long_ago, false, 0, Duration::from_secs(5));
        assert_eq!(lease.check(0), LeaseCheck::Pending, "lapsed: ask first");
        // A heartbeat sent before the lapse that failed late (e.g. across a pause) says
        // nothing about now.
        lease.on_heartbeat_unanswered(long_ago + Duration::from_secs(1));
        assert_eq!(lease.check(0), LeaseCheck::Pending);
        // Answered after the lapse: the metadata of the answer must be applied first.
        lease.on_heartbeat(Instant::now(), false, 40, Duration::from_secs(5));
        assert!(matches!(lease.check(39), LeaseCheck::Refused(_)));
        assert_eq!(lease.check(40), LeaseCheck::Granted);
    }

    #[test]
    fn controllers_unreachable_after_a_lapse_allow_writes() {
        let lease = LeaderLease::default();
        let long_ago = Instant::now() - Duration::from_secs(10);
        lease.on_heartbeat(long_ago, false, 5, Duration::from_secs(5));
        assert!(lease.controllers_reachable());
        lease.on_heartbeat_unanswered(Instant::now());
        assert!(!lease.controllers_reachable());
        assert_eq!(
            lease.check(5),
            LeaseCheck::Granted,
            "the quorum is down: keep serving"
        );
        // The quorum returns: its answer counts again, metadata first.
        lease.on_heartbeat(Instant::now(), false, 9, Duration::from_secs(5));
        assert!(lease.controllers_reachable());
        assert!(matches!(lease.check(5), LeaseCheck::Refused(_)));
        assert_eq!(lease.check(9), LeaseCheck::Granted);
    }

    #[test]
    fn an_unanswered_heartbeat_within_the_lease_changes_nothing() {
        let lease = LeaderLease::default();
        lease.on_heartbeat(Instant::now(), false, 1, MINUTE);
        lease.on_heartbeat_unanswered(Instant::now());
        assert_eq!(lease.check(1), LeaseCheck::Granted);
        assert!(
            lease.controllers_reachable(),
            "one failed heartbeat (an election) is not an outage"
        );
    }
}
