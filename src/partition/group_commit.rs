//! Group commit for `flush.mode=sync`: many appenders, one fsync at a time.
//!
//! An appender that needs its data durable calls [`GroupCommit::wait_durable`] with the
//! offset after its records. If no flush is running it becomes the flusher: it flushes
//! everything appended so far (its own records and everyone else's) and wakes the
//! others. If a flush is running it waits; when that flush ends, either its records are
//! covered or it starts the next flush. So N concurrent appenders share roughly one fsync
//! per flush duration instead of paying one each.

use parking_lot::{Condvar, Mutex};

#[derive(Debug)]
struct State {
    /// Every offset below this is on disk.
    durable: u64,
    flushing: bool,
    /// Set by a failed flush: the partition is offline and no waiter may succeed.
    failed: Option<String>,
}

/// Coordinates fsyncs between appenders of one partition.
#[derive(Debug)]
pub struct GroupCommit {
    state: Mutex<State>,
    flushed: Condvar,
}

impl GroupCommit {
    /// Starts with every offset below `durable` on disk.
    pub fn new(durable: u64) -> Self {
        Self {
            state: Mutex::new(State {
                durable,
                flushing: false,
                failed: None,
            }),
            flushed: Condvar::new(),
        }
    }

    /// The offset below which everything is on disk (the recovery point).
    pub fn durable(&self) -> u64 {
        self.state.lock().durable
    }

    /// Lowers the durable offset after a truncation to `end`.
    pub fn truncated_to(&self, end: u64) {
        let mut state = self.state.lock();
        state.durable = state.durable.min(end);
    }

    /// Resets the durable offset (the log was replaced by an empty one at `start`).
    pub fn reset(&self, start: u64) {
        self.state.lock().durable = start;
    }

    /// Blocks until every offset below `target` is on disk. `flush` makes everything
    /// appended so far durable and returns the offset it covered, or `None` when a
    /// truncation raced with it (nothing is credited; the loop flushes again).
    pub fn wait_durable(
        &self,
        target: u64,
        flush: impl Fn() -> Result<Option<u64>, String>,
    ) -> Result<(), String> {
        let mut state = self.state.lock();
        loop {
            if let Some(reason) = &state.failed {
                return Err(reason.clone());
            }
            if state.durable >= target {
                return Ok(());
            }
            if state.flushing {
                self.flushed.wait(&mut state);
                continue;
            }
            state.flushing = true;
            drop(state);
            let result = flush();
            state = self.state.lock();
            state.flushing = false;
            match result {
                Ok(Some(covered)) => state.durable = state.durable.max(covered),
                Ok(None) => {}
                Err(reason) => state.failed = Some(reason),
            }
            self.flushed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    #[test]
    fn concurrent_waiters_share_flushes() {
        let gc = Arc::new(GroupCommit::new(0));
        let appended = Arc::new(AtomicU64::new(0));
        let flushes = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (gc, appended, flushes) = (gc.clone(), appended.clone(), flushes.clone());
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        let end = appended.fetch_add(1, Ordering::SeqCst) + 1;
                        gc.wait_durable(end, || {
                            flushes.fetch_add(1, Ordering::SeqCst);
                            let covered = appended.load(Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_micros(200));
                            Ok(Some(covered))
                        })
                        .unwrap();
                        assert!(gc.durable() >= end);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // 400 appends; with 8 appenders sharing, far fewer flushes than appends.
        assert!(flushes.load(Ordering::SeqCst) < 400);
        assert_eq!(gc.durable(), 400);
    }

    #[test]
    fn a_failed_flush_fails_every_waiter() {
        let gc = GroupCommit::new(0);
        assert!(gc.wait_durable(1, || Err("disk gone".into())).is_err());
        assert!(gc.wait_durable(1, || Ok(Some(1))).is_err());
    }
}
