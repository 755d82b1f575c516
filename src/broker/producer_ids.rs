//! Idempotent producer ids that this broker hands out itself, from blocks it reserved at
//! the controllers in advance (Kafka's KIP-730), so a new producer can start while the
//! controller quorum is down.
//!
//! Invariants: every id handed out comes from a block the controllers committed to this
//! broker, and is handed out at most once (ids left in a block when the broker stops are
//! never used: 2^63 ids make that free). A new block is asked for as soon as fewer than
//! half a block's ids remain, so an outage has a whole half block to live on; when no id
//! is left, [`ProducerIdBlocks::next`] waits a bounded time and then fails with the
//! retriable `CONTROLLER_UNAVAILABLE`.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::error::BrokerError;
use crate::error_code::ErrorCode;

/// How many ids a broker reserves at a time (Kafka's block size).
pub const DEFAULT_BLOCK_SIZE: u32 = 1000;

/// The ids reserved for this broker and not handed out yet.
#[derive(Debug)]
pub struct ProducerIdBlocks {
    blocks: Mutex<VecDeque<Range<i64>>>,
    block_size: u32,
    /// Wakes the task that reserves blocks.
    needed: Notify,
    /// Wakes callers waiting for an id.
    added: Notify,
}

impl ProducerIdBlocks {
    /// No ids yet; blocks of `block_size` are asked for.
    pub fn new(block_size: u32) -> Self {
        Self {
            blocks: Mutex::new(VecDeque::new()),
            block_size: block_size.max(1),
            needed: Notify::new(),
            added: Notify::new(),
        }
    }

    /// How many ids one reservation asks for.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Ids left.
    pub fn remaining(&self) -> u64 {
        remaining(&self.blocks.lock())
    }

    /// Whether a new block should be reserved now: fewer than half a block remains.
    pub fn wants_block(&self) -> bool {
        wants_block(self.remaining(), self.block_size)
    }

    /// Adds the block `[first, first + count)` the controllers reserved.
    pub fn add_block(&self, first: i64, count: u32) {
        if count == 0 {
            return;
        }
        self.blocks
            .lock()
            .push_back(first..first.saturating_add(i64::from(count)));
        self.added.notify_waiters();
    }

    /// The next id, if any is left; asks for a new block when running low.
    pub fn take(&self) -> Option<i64> {
        let (id, left) = {
            let mut blocks = self.blocks.lock();
            let id = loop {
                let front = blocks.front_mut()?;
                if let Some(id) = front.next() {
                    break id;
                }
                blocks.pop_front();
            };
            (id, remaining(&blocks))
        };
        if wants_block(left, self.block_size) {
            self.needed.notify_one();
        }
        Some(id)
    }

    /// The next id, waiting up to `wait` for a block when none is left.
    pub async fn next(&self, wait: Duration) -> Result<i64, BrokerError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let added = self.added.notified();
            tokio::pin!(added);
            added.as_mut().enable();
            if let Some(id) = self.take() {
                return Ok(id);
            }
            self.needed.notify_one();
            if tokio::time::timeout_at(deadline, added).await.is_err() {
                return Err(BrokerError::new(
                    ErrorCode::ControllerUnavailable,
                    format!(
                        "this broker has no producer ids left and could not reserve more from the controllers within {} ms",
                        wait.as_millis()
                    ),
                ));
            }
        }
    }

    /// Returns when a block should be reserved (at once if one should be now).
    pub async fn block_needed(&self) {
        let needed = self.needed.notified();
        tokio::pin!(needed);
        needed.as_mut().enable();
        if self.wants_block() {
            return;
        }
        needed.await;
    }
}

fn remaining(blocks: &VecDeque<Range<i64>>) -> u64 {
    blocks
        .iter()
        .map(|r| u64::try_from(r.end.saturating_sub(r.start)).unwrap_or(0))
        .sum()
}

/// Whether `remaining` ids are few enough to reserve another block of `block_size`.
fn wants_block(remaining: u64, block_size: u32) -> bool {
    remaining < u64::from(block_size).div_ceil(2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_come_from_reserved_blocks_once_each() {
        let blocks = ProducerIdBlocks::new(4);
        assert!(blocks.wants_block());
        assert_eq!(blocks.take(), None);
        blocks.add_block(100, 4);
        blocks.add_block(500, 4);
        let mut seen = HashSet::new();
        let mut ids = Vec::new();
        while let Some(id) = blocks.take() {
            assert!(seen.insert(id), "{id} handed out twice");
            ids.push(id);
        }
        assert_eq!(ids, vec![100, 101, 102, 103, 500, 501, 502, 503]);
    }

    #[test]
    fn a_block_is_wanted_below_half_a_block() {
        let blocks = ProducerIdBlocks::new(10);
        blocks.add_block(0, 10);
        for _ in 0..5 {
            assert!(!blocks.wants_block());
            blocks.take();
        }
        // 5 left: still half.
        assert!(!blocks.wants_block());
        blocks.take();
        assert!(blocks.wants_block(), "4 of 10 left");
    }

    #[tokio::test]
    async fn next_waits_for_a_block_then_gives_up_with_a_retriable_code() {
        let blocks = std::sync::Arc::new(ProducerIdBlocks::new(10));
        let e = blocks.next(Duration::from_millis(50)).await.unwrap_err();
        assert_eq!(e.code, ErrorCode::ControllerUnavailable);
        assert!(e.code.is_retriable());
        let waiter = {
            let blocks = blocks.clone();
            tokio::spawn(async move { blocks.next(Duration::from_secs(10)).await })
        };
        blocks.block_needed().await;
        blocks.add_block(7, 10);
        assert_eq!(waiter.await.unwrap().unwrap(), 7);
    }
}
