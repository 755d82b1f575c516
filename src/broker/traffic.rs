//! Cached handles of the traffic counters (`tidelog_records_in_total`, `_bytes_in_total`,
//! `_records_out_total`, `_bytes_out_total`), one set per topic, or per partition with
//! `metrics_per_partition`: the produce and fetch paths look a set up without building
//! label strings.

use std::collections::HashMap;
use std::sync::Arc;

use metrics::Counter;
use parking_lot::RwLock;

/// One topic's (or partition's) counters.
pub struct Counters {
    /// Records appended by producers.
    pub records_in: Counter,
    /// Batch bytes appended by producers.
    pub bytes_in: Counter,
    /// Records sent to consumers.
    pub records_out: Counter,
    /// Batch bytes sent to consumers.
    pub bytes_out: Counter,
}

/// The counters by topic (and partition).
#[derive(Default)]
pub struct Traffic {
    per_partition: bool,
    sets: RwLock<HashMap<String, Vec<Option<Arc<Counters>>>>>,
}

impl Traffic {
    /// Counters labelled by topic, and by partition when `per_partition`.
    pub fn new(per_partition: bool) -> Self {
        Self {
            per_partition,
            sets: RwLock::new(HashMap::new()),
        }
    }

    /// The counters of `topic`'s `partition`.
    pub fn of(&self, topic: &str, partition: u32) -> Arc<Counters> {
        let slot = if self.per_partition {
            partition as usize
        } else {
            0
        };
        if let Some(c) = self
            .sets
            .read()
            .get(topic)
            .and_then(|v| v.get(slot))
            .and_then(Clone::clone)
        {
            return c;
        }
        let mut labels = vec![("topic", topic.to_owned())];
        if self.per_partition {
            labels.push(("partition", partition.to_string()));
        }
        let counters = Arc::new(Counters {
            records_in: metrics::counter!("tidelog_records_in_total", &labels),
            bytes_in: metrics::counter!("tidelog_bytes_in_total", &labels),
            records_out: metrics::counter!("tidelog_records_out_total", &labels),
            bytes_out: metrics::counter!("tidelog_bytes_out_total", &labels),
        });
        let mut sets = self.sets.write();
        let v = sets.entry(topic.to_owned()).or_default();
        if v.len() <= slot {
            v.resize(slot + 1, None);
        }
        v[slot].get_or_insert(counters).clone()
    }
}
