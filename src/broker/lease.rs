//! The broker's leader lease: a broker may accept writes as a partition leader only while
//! the controllers cannot have fenced it yet.
//!
//! The controller fences a broker `session_timeout` after the last heartbeat it *received*;
//! every heartbeat is received after it was *sent*, so until `sent + session_timeout` the
//! broker is certainly not fenced. The lease runs to 90% of that (clock-rate slack). After
//! being fenced (or after any lapse of the lease), the broker must also have applied the metadata version it was unfenced
//! at, which already holds every leadership that moved away while it was fenced. So a
//! broker paused or cut off longer than its session refuses produce with
//! NOT_LEADER_OR_FOLLOWER instead of accepting writes another leader will never see.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Session timeout assumed until a controller has told us its own.
const DEFAULT_SESSION: Duration = Duration::from_secs(9);

#[derive(Debug)]
struct State {
    valid_until: Option<Instant>,
    /// Metadata version the broker must have applied before the lease counts.
    min_metadata_version: u64,
    fenced: bool,
}

/// Whether this broker may lead right now.
#[derive(Debug)]
pub struct LeaderLease {
    state: Mutex<State>,
}

impl Default for LeaderLease {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                valid_until: None,
                min_metadata_version: 0,
                fenced: true,
            }),
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
        let mut state = self.state.lock();
        if fenced {
            state.fenced = true;
            state.valid_until = None;
            return;
        }
        // After being fenced, or after a lapse (the controllers may have fenced and
        // unfenced us meanwhile without our hearing of it), leaderships may have moved:
        // the metadata must catch up before the lease counts.
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

    /// Marks the broker fenced (registration lost).
    pub fn revoke(&self) {
        let mut state = self.state.lock();
        state.fenced = true;
        state.valid_until = None;
    }

    /// `Ok` when the broker may accept writes, holding `metadata_version`; otherwise why not.
    pub fn check(&self, metadata_version: u64) -> Result<(), String> {
        let state = self.state.lock();
        if state.fenced {
            return Err("this broker is fenced by the controllers".to_owned());
        }
        match state.valid_until {
            Some(until) if Instant::now() < until => {}
            _ => {
                return Err(
                    "this broker's session with the controllers has lapsed (no heartbeat answered in time)"
                        .to_owned(),
                )
            }
        }
        if metadata_version < state.min_metadata_version {
            return Err(format!(
                "this broker was fenced and has not caught up with the metadata yet (at version {metadata_version}, needs {})",
                state.min_metadata_version
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_runs_out_and_needs_metadata_after_fencing() {
        let lease = LeaderLease::default();
        assert!(
            lease.check(100).is_err(),
            "fenced until a heartbeat says otherwise"
        );
        let t0 = Instant::now();
        lease.on_heartbeat(t0, false, 10, Duration::from_secs(60));
        assert!(lease.check(9).is_err(), "metadata older than the unfencing");
        assert!(lease.check(10).is_ok());
        // A later heartbeat does not raise the metadata requirement.
        lease.on_heartbeat(t0, false, 50, Duration::from_secs(60));
        assert!(lease.check(10).is_ok());
        // An old heartbeat whose lease has run out.
        let stale = LeaderLease::default();
        stale.on_heartbeat(
            Instant::now() - Duration::from_secs(10),
            false,
            0,
            Duration::from_secs(5),
        );
        assert!(stale.check(0).unwrap_err().contains("lapsed"));
        // A lapse (e.g. the process was paused) then a renewal: the metadata of the
        // renewal must be applied first, even though no answer ever said "fenced".
        stale.on_heartbeat(Instant::now(), false, 40, Duration::from_secs(5));
        assert!(stale.check(39).is_err());
        assert!(stale.check(40).is_ok());
        lease.on_heartbeat(Instant::now(), true, 60, Duration::from_secs(60));
        assert!(lease.check(100).unwrap_err().contains("fenced"));
        lease.on_heartbeat(Instant::now(), false, 70, Duration::from_secs(60));
        assert!(lease.check(69).is_err());
        assert!(lease.check(70).is_ok());
    }
}
