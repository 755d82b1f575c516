//! Gives every stored partition the role the metadata assigns (leader, follower, idle),
//! runs one fetcher per leader broker this broker follows, sends the ISR changes its
//! leaders decide to the controllers, and runs the periodic work on logs: the ISR lag
//! check, time-based flushes, checkpoints and retention.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::controller_link::ControllerLink;
use super::metadata_cache::MetadataCache;
use super::node::now_ms;
use super::partition_manager::{LocalPartition, PartitionManager};
use crate::controller::model::PartitionRecord;
use crate::net::node_auth::{internal_channel, ClusterSecret};
use crate::replication::fetcher::{Fetcher, FetcherConfig, PartitionLookup};
use crate::replication::isr_queue::IsrChangeQueue;
use crate::replication::PartitionAssignment;
use crate::types::{BrokerId, BrokerIds, LeaderEpoch};

/// How often sealed segments not read since the previous sweep release their descriptor.
pub const IDLE_FILE_SWEEP_INTERVAL: Duration = Duration::from_secs(60);

/// Replication settings of a broker.
#[derive(Debug, Clone)]
pub struct ReplicationSettings {
    /// A follower not caught up for this long leaves the ISR (`replica.lag.time.max.ms`).
    pub replica_lag_time_max: Duration,
    /// Longest a follower's fetch waits at the leader.
    pub fetch_wait_max: Duration,
    /// Most bytes per follower fetch response.
    pub fetch_max_bytes: usize,
    /// Most bytes per partition in a follower fetch response.
    pub fetch_partition_max_bytes: usize,
    /// Pause after a failed fetch.
    pub fetch_backoff: Duration,
    /// How often retention runs over every partition.
    pub retention_check_interval: Duration,
}

impl Default for ReplicationSettings {
    fn default() -> Self {
        Self {
            replica_lag_time_max: Duration::from_secs(30),
            fetch_wait_max: Duration::from_millis(500),
            fetch_max_bytes: 16 * 1024 * 1024,
            fetch_partition_max_bytes: 4 * 1024 * 1024,
            fetch_backoff: Duration::from_millis(200),
            retention_check_interval: Duration::from_secs(300),
        }
    }
}

/// A stored partition and what the metadata says of it (topic id and record).
type Decision = (Arc<LocalPartition>, Option<(String, PartitionRecord)>);

/// The partitions of one topic whose role on this broker changed in one metadata update.
#[derive(Default)]
struct RoleChanges {
    leader: Vec<u32>,
    follower: Vec<u32>,
}

impl RoleChanges {
    /// One INFO line per role: `became leader topic=t partitions=0-49`.
    fn log(&mut self, topic: &str) {
        if !self.leader.is_empty() {
            self.leader.sort_unstable();
            tracing::info!(topic, partitions = %partition_ranges(&self.leader), count = self.leader.len(), "became leader");
        }
        if !self.follower.is_empty() {
            self.follower.sort_unstable();
            tracing::info!(topic, partitions = %partition_ranges(&self.follower), count = self.follower.len(), "became follower");
        }
    }
}

/// Sorted partition numbers as ranges: `[0, 1, 2, 5, 7, 8]` -> `0-2,5,7-8`.
fn partition_ranges(sorted: &[u32]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        if !out.is_empty() {
            out.push(',');
        }
        if end == start {
            out.push_str(&start.to_string());
        } else {
            out.push_str(&format!("{start}-{end}"));
        }
        i += 1;
    }
    out
}

/// Where a partition's role is decided to go.
struct Following {
    topic: String,
    topic_id: String,
    partition: u32,
    leader: BrokerId,
    epoch: LeaderEpoch,
    /// The role just changed: start over (truncate first).
    restart: bool,
}

/// Roles, fetchers and ISR proposals of one broker.
pub struct ReplicaManager {
    id: BrokerId,
    metadata: Arc<MetadataCache>,
    partitions: Arc<PartitionManager>,
    settings: ReplicationSettings,
    /// Authenticates fetchers at leaders' internal listeners.
    secret: Arc<ClusterSecret>,
    fetchers: tokio::sync::Mutex<HashMap<BrokerId, Fetcher>>,
    isr_changes: Arc<IsrChangeQueue>,
}

impl ReplicaManager {
    /// A manager for broker `id`; ISR changes are queued on `isr_changes`.
    pub fn new(
        id: BrokerId,
        metadata: Arc<MetadataCache>,
        partitions: Arc<PartitionManager>,
        settings: ReplicationSettings,
        isr_changes: Arc<IsrChangeQueue>,
        secret: Arc<ClusterSecret>,
    ) -> Self {
        Self {
            id,
            metadata,
            partitions,
            settings,
            secret,
            fetchers: tokio::sync::Mutex::new(HashMap::new()),
            isr_changes,
        }
    }

    /// Gives every stored partition the role the metadata assigns, and starts, changes and
    /// stops fetchers to match.
    pub async fn apply_metadata(&self) {
        let mut fetchers = self.fetchers.lock().await;
        let decisions: Vec<Decision> = self
            .partitions
            .all()
            .into_iter()
            .map(|lp| {
                let assigned = self.metadata.partition(&lp.topic, lp.partition);
                (lp, assigned)
            })
            .collect();
        let me = self.id;
        let following = tokio::task::spawn_blocking(move || {
            let now = now_ms();
            let mut following = Vec::new();
            // Role changes per topic, logged as one line each (a topic may have thousands
            // of partitions; the per-partition lines are at debug).
            let mut changed: BTreeMap<String, RoleChanges> = BTreeMap::new();
            for (lp, assigned) in decisions {
                let Some((topic_id, p)) = assigned.filter(|(id, _)| *id == lp.topic_id) else {
                    lp.become_idle();
                    continue;
                };
                let epoch = LeaderEpoch(p.leader_epoch);
                match p.leader {
                    Some(leader) if leader == me => {
                        let assignment = PartitionAssignment {
                            leader_epoch: epoch,
                            partition_epoch: p.partition_epoch,
                            replicas: p.replicas.clone(),
                            isr: p.isr.clone(),
                        };
                        match lp.become_leader(me, &assignment, now) {
                            Ok(true) => changed
                                .entry(lp.topic.clone())
                                .or_default()
                                .leader
                                .push(lp.partition),
                            Ok(false) => {}
                            Err(e) => {
                                tracing::error!(partition = %lp.name(), error = %e, "cannot take over leadership");
                            }
                        }
                    }
                    Some(leader) if p.replicas.contains(&me) => {
                        let restart = lp.become_follower(leader, epoch);
                        if restart {
                            changed
                                .entry(lp.topic.clone())
                                .or_default()
                                .follower
                                .push(lp.partition);
                        }
                        following.push(Following {
                            topic: lp.topic.clone(),
                            topic_id,
                            partition: lp.partition,
                            leader,
                            epoch,
                            restart,
                        });
                    }
                    _ => {
                        lp.become_idle();
                    }
                }
            }
            for (topic, c) in &mut changed {
                c.log(topic);
            }
            following
        })
        .await
        .unwrap_or_default();

        // Fetchers: one per leader broker, at its current internal address.
        let mut wanted: HashMap<BrokerId, Vec<Following>> = HashMap::new();
        for f in following {
            wanted.entry(f.leader).or_default().push(f);
        }
        fetchers.retain(|leader, fetcher| {
            let address = self.metadata.broker_internal_address(*leader);
            let keep = wanted.contains_key(leader) && address.as_deref() == Some(fetcher.address());
            if !keep {
                fetcher.stop();
            }
            keep
        });
        for (leader, list) in &wanted {
            if !fetchers.contains_key(leader) {
                let Some(address) = self.metadata.broker_internal_address(*leader) else {
                    continue;
                };
                let channel = match internal_channel(
                    &address,
                    self.secret.clone(),
                    Duration::from_secs(3),
                ) {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(%leader, %address, error = %e, "leader address is not usable");
                        continue;
                    }
                };
                let config = FetcherConfig {
                    broker_id: self.id,
                    max_wait: self.settings.fetch_wait_max,
                    max_bytes: self.settings.fetch_max_bytes,
                    partition_max_bytes: self.settings.fetch_partition_max_bytes,
                    backoff: self.settings.fetch_backoff,
                };
                let lookup: Arc<dyn PartitionLookup> = self.partitions.clone();
                tracing::info!(%leader, %address, "starting replica fetcher");
                fetchers.insert(
                    *leader,
                    Fetcher::start(*leader, address, config, lookup, channel),
                );
                for f in list {
                    fetchers[leader].add(&f.topic, &f.topic_id, f.partition, f.epoch);
                }
                continue;
            }
            let fetcher = &fetchers[leader];
            let present: Vec<(String, u32)> = fetcher.followed();
            for f in list {
                if f.restart || !present.contains(&(f.topic.clone(), f.partition)) {
                    fetcher.add(&f.topic, &f.topic_id, f.partition, f.epoch);
                }
            }
        }
        // Partitions no longer followed from a given leader.
        for (leader, fetcher) in fetchers.iter() {
            let keep: Vec<(String, u32)> = wanted
                .get(leader)
                .map(|l| l.iter().map(|f| (f.topic.clone(), f.partition)).collect())
                .unwrap_or_default();
            for key in fetcher.followed() {
                if !keep.contains(&key) {
                    fetcher.remove(&key.0, key.1);
                }
            }
        }
    }

    /// Sends queued ISR changes to the controllers until `cancel`, one request each (at
    /// most one in flight per partition, since a partition proposes one change at a
    /// time), and tells the partition how it went.
    pub async fn run_isr_changes(
        self: Arc<Self>,
        link: Arc<ControllerLink>,
        cancel: CancellationToken,
    ) {
        let mut in_flight = tokio::task::JoinSet::new();
        loop {
            let changes = tokio::select! {
                _ = cancel.cancelled() => return,
                c = self.isr_changes.take() => c,
                Some(_) = in_flight.join_next() => continue,
            };
            for change in changes {
                let this = self.clone();
                let link = link.clone();
                in_flight.spawn(async move {
                    let result = link.alter_partition(&change).await;
                    let Some(lp) = this.partitions.get(&change.topic, change.partition) else {
                        return;
                    };
                    match result {
                        Ok(p) => {
                            let kind = if p.isr.len() < lp.leader_isr().map_or(0, |i| i.len()) {
                                "shrink"
                            } else {
                                "expand"
                            };
                            metrics::counter!("tidelog_isr_changes_total", "change" => kind)
                                .increment(1);
                            lp.isr_change_done(&change, Some((p.isr, p.partition_epoch)), now_ms());
                        }
                        Err(e) => {
                            tracing::info!(partition = %lp.name(), proposed = %BrokerIds(&change.new_isr), error = %e, "ISR change refused");
                            lp.isr_change_done(&change, None, now_ms());
                        }
                    }
                });
            }
        }
    }

    /// Periodic work until `cancel`: the ISR lag check (every quarter of the lag time),
    /// time-based flushes and checkpoints (every second), retention, and releasing the
    /// descriptors of sealed segments nobody read for a sweep interval.
    pub async fn run_maintenance(self: Arc<Self>, cancel: CancellationToken) {
        let lag = self.settings.replica_lag_time_max;
        let tick = (lag / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let mut last_housekeeping = Instant::now();
        let mut last_retention = Instant::now();
        let mut last_idle_sweep = Instant::now();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(tick) => {}
            }
            let now = now_ms();
            for lp in self.partitions.all() {
                if let Some(change) = lp.check_lagging(now, lag.as_millis() as i64) {
                    self.isr_changes.push(change);
                }
            }
            if last_housekeeping.elapsed() >= Duration::from_secs(1) {
                last_housekeeping = Instant::now();
                let retention = last_retention.elapsed() >= self.settings.retention_check_interval;
                if retention {
                    last_retention = Instant::now();
                }
                let idle_sweep = last_idle_sweep.elapsed() >= IDLE_FILE_SWEEP_INTERVAL;
                if idle_sweep {
                    last_idle_sweep = Instant::now();
                }
                let partitions = self.partitions.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    for lp in partitions.all() {
                        if let Err(e) = lp.log.maybe_flush() {
                            tracing::error!(partition = %lp.name(), error = %e, "flush failed");
                        }
                        match lp.log.checkpoint() {
                            Err(e) if e.is_no_space() => lp.log.warn_no_space(&e),
                            Err(e) => {
                                tracing::warn!(partition = %lp.name(), error = %e, "checkpoint failed")
                            }
                            Ok(()) => {}
                        }
                        if idle_sweep {
                            lp.log.close_idle_files();
                        }
                        if retention {
                            if let Err(e) = lp.log.apply_retention() {
                                tracing::warn!(partition = %lp.name(), error = %e, "retention failed");
                            }
                        }
                    }
                })
                .await;
            }
        }
    }

    /// Stops every fetcher and waits until they have ended.
    pub async fn stop(&self) {
        let fetchers: Vec<Fetcher> = self.fetchers.lock().await.drain().map(|(_, f)| f).collect();
        futures_util::future::join_all(fetchers.into_iter().map(Fetcher::stop_and_wait)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::partition_ranges;

    #[test]
    fn partition_lists_collapse_into_ranges() {
        assert_eq!(partition_ranges(&[]), "");
        assert_eq!(partition_ranges(&[3]), "3");
        assert_eq!(partition_ranges(&(0..50).collect::<Vec<_>>()), "0-49");
        assert_eq!(partition_ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }
}
