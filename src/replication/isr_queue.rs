//! ISR changes waiting to be sent to the controllers.
//!
//! Bounded by construction: at most one change per partition waits (a partition proposes
//! one change at a time, and a newer proposal replaces an older one still queued), so the
//! queue never holds more entries than the broker leads partitions.

use std::collections::BTreeMap;

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::IsrChange;

/// The queue; cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct IsrChangeQueue {
    pending: Mutex<BTreeMap<(String, u32), IsrChange>>,
    ready: Notify,
}

impl IsrChangeQueue {
    /// Queues `change`, replacing a queued change of the same partition.
    pub fn push(&self, change: IsrChange) {
        self.pending
            .lock()
            .insert((change.topic.clone(), change.partition), change);
        self.ready.notify_one();
    }

    /// Takes every queued change, waiting until there is at least one.
    pub async fn take(&self) -> Vec<IsrChange> {
        loop {
            let changes: Vec<IsrChange> = std::mem::take(&mut *self.pending.lock())
                .into_values()
                .collect();
            if !changes.is_empty() {
                return changes;
            }
            self.ready.notified().await;
        }
    }

    /// How many changes wait.
    pub fn len(&self) -> usize {
        self.pending.lock().len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{BrokerId, LeaderEpoch};

    fn change(partition: u32, isr: &[i32]) -> IsrChange {
        IsrChange {
            topic: "t".into(),
            topic_id: "id".into(),
            partition,
            leader_epoch: LeaderEpoch(1),
            partition_epoch: 1,
            new_isr: isr.iter().map(|b| BrokerId(*b)).collect(),
        }
    }

    #[tokio::test]
    async fn one_change_per_partition_waits_and_the_newest_wins() {
        let q = IsrChangeQueue::default();
        for round in 0..1000 {
            q.push(change(round % 3, &[1, 2]));
        }
        q.push(change(0, &[1]));
        assert_eq!(q.len(), 3);
        let taken = q.take().await;
        assert_eq!(taken.len(), 3);
        assert_eq!(taken[0].new_isr, vec![BrokerId(1)]);
        assert!(q.is_empty());
        // A push after the take wakes the next one.
        q.push(change(1, &[1, 2, 3]));
        assert_eq!(q.take().await.len(), 1);
    }
}
