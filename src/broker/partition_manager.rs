//! The partitions this broker stores: opened, created and deleted to match the metadata.
//!
//! Each partition lives in `<data-dir>/<topic>-<partition>/`, with a `partition.metadata`
//! file naming the topic id, so a topic deleted and created again under the same name never
//! inherits the old data. Directories of topics that no longer exist are deleted (renamed
//! `*.deleted` first, then removed). All methods do blocking file I/O: call them off the
//! async runtime.
//!
//! One lock for the whole data directory (`<data-dir>/.lock`, held from [`PartitionManager::new`]
//! until the manager is dropped) keeps a second process out of every partition, at the
//! cost of one descriptor instead of one per partition.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;
use tokio::sync::watch;

use crate::controller::model::{BrokerState, MetadataImage, PartitionRecord};
use crate::partition::repair::set_aside_from_first_damage;
use crate::partition::{
    lock_data_dir, Clock, DamageReport, DirLock, LogError, PartitionLog, SystemClock,
};
use crate::replication::fetcher::PartitionLookup;
pub use crate::replication::LocalPartition;
use crate::topic_config::TopicConfig;
use crate::types::BrokerId;

const TOPIC_ID_FILE: &str = "partition.metadata";

/// Partitions by (topic, partition).
pub struct PartitionManager {
    data_dir: PathBuf,
    /// The data-directory lock every partition shares.
    lock: DirLock,
    broker_id: BrokerId,
    clock: Arc<dyn Clock>,
    partitions: RwLock<HashMap<(String, u32), Arc<LocalPartition>>>,
    /// Assigned partitions that failed to open, by (topic, partition): their topic ids.
    unopened: RwLock<HashMap<(String, u32), String>>,
    /// Bumped after every append and every high-watermark advance, so fetches waiting
    /// for data wake up.
    appended: Arc<watch::Sender<u64>>,
}

fn parse_dir_name(name: &str) -> Option<(&str, u32)> {
    let (topic, partition) = name.rsplit_once('-')?;
    Some((topic, partition.parse().ok()?))
}

impl PartitionManager {
    /// A manager for partitions under `data_dir`; fails when another process holds it.
    pub fn new(data_dir: &Path, broker_id: BrokerId) -> Result<Self, LogError> {
        let lock = DirLock::DataDir(lock_data_dir(data_dir)?);
        Ok(Self {
            data_dir: data_dir.to_owned(),
            lock,
            broker_id,
            clock: Arc::new(SystemClock),
            partitions: RwLock::new(HashMap::new()),
            unopened: RwLock::new(HashMap::new()),
            appended: Arc::new(watch::channel(0).0),
        })
    }

    /// The partition, if stored here.
    pub fn get(&self, topic: &str, partition: u32) -> Option<Arc<LocalPartition>> {
        self.partitions
            .read()
            .get(&(topic.to_owned(), partition))
            .cloned()
    }

    /// Every partition stored here.
    pub fn all(&self) -> Vec<Arc<LocalPartition>> {
        self.partitions.read().values().cloned().collect()
    }

    /// Replicas assigned here that cannot serve, as (topic id, partition): those that
    /// failed to open, went offline after an I/O error, or met a corrupt batch on a read.
    /// The controllers move leadership and ISR membership away from them.
    pub fn offline_replicas(&self) -> Vec<(String, u32)> {
        let mut offline: Vec<(String, u32)> = self
            .unopened
            .read()
            .iter()
            .map(|((_, partition), id)| (id.clone(), *partition))
            .collect();
        offline.extend(
            self.partitions
                .read()
                .values()
                .filter(|lp| lp.log.offline_reason().is_some() || lp.log.has_read_damage())
                .map(|lp| (lp.topic_id.clone(), lp.partition)),
        );
        offline.sort();
        offline
    }

    /// Wakes fetches waiting for data.
    pub fn notify_appended(&self) {
        self.appended.send_modify(|v| *v += 1);
    }

    /// A receiver that changes after every append.
    pub fn subscribe_appends(&self) -> watch::Receiver<u64> {
        self.appended.subscribe()
    }

    /// Opens what `image` assigns to this broker and deletes what it no longer holds.
    /// Returns the partitions that failed to open, with why.
    pub fn reconcile(&self, image: &MetadataImage) -> Vec<(String, LogError)> {
        let mut failures = Vec::new();
        let mut wanted: HashMap<(String, u32), (String, TopicConfig, &PartitionRecord)> =
            HashMap::new();
        for t in image.topics.values() {
            let config =
                TopicConfig::from_pairs(t.config.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                    .unwrap_or_default();
            for p in &t.partitions {
                if p.replicas.contains(&self.broker_id) {
                    wanted.insert(
                        (t.name.clone(), p.partition),
                        (t.id.clone(), config.clone(), p),
                    );
                }
            }
        }
        // Close and delete partitions no longer assigned here (or of a re-created topic).
        let stale: Vec<Arc<LocalPartition>> = self
            .partitions
            .read()
            .values()
            .filter(|lp| {
                wanted
                    .get(&(lp.topic.clone(), lp.partition))
                    .is_none_or(|(id, _, _)| *id != lp.topic_id)
            })
            .cloned()
            .collect();
        for lp in stale {
            self.partitions
                .write()
                .remove(&(lp.topic.clone(), lp.partition));
            tracing::info!(partition = %lp.name(), "deleting partition: no longer assigned to this broker");
            let dir = lp.log.dir().to_owned();
            drop(lp);
            delete_dir(&dir);
        }
        let is_live = |b| {
            image
                .brokers
                .get(&b)
                .is_some_and(|r| r.state == BrokerState::Unfenced)
        };
        for ((topic, partition), (topic_id, config, record)) in &wanted {
            let (topic, partition, topic_id) = (topic.clone(), *partition, topic_id.clone());
            let key = (topic.clone(), partition);
            let refetch = may_refetch_damaged(self.broker_id, record, is_live);
            let opened = match self.get(&topic, partition) {
                Some(lp) => {
                    if lp.log.config() != *config {
                        lp.log.update_config(config.clone());
                    }
                    let failed = lp.log.offline_reason();
                    if !refetch || (failed.is_none() && !lp.log.has_read_damage()) {
                        continue;
                    }
                    let seen = lp.log.damage_seen();
                    // Another in-sync copy leads: replace this one with what its files
                    // hold, cut at any damage.
                    self.partitions.write().remove(&key);
                    let report = match failed {
                        Some(reason) => {
                            tracing::warn!(partition = %lp.name(), %reason, "reopening an offline partition now that another replica leads it");
                            None
                        }
                        None => {
                            if let Err(e) = lp.log.close_in_place() {
                                tracing::warn!(partition = %lp.name(), error = %e, "closing a damaged partition failed");
                            }
                            Some(DamageReport {
                                dir: lp.log.dir().to_owned(),
                                ranges: seen,
                            })
                        }
                    };
                    drop(lp);
                    match report {
                        Some(report) => {
                            self.cut_and_open(&topic, partition, &topic_id, config.clone(), &report)
                        }
                        None => {
                            self.open_or_cut(&topic, partition, &topic_id, config.clone(), true)
                        }
                    }
                }
                None => self.open_or_cut(&topic, partition, &topic_id, config.clone(), refetch),
            };
            match opened {
                Ok(lp) => {
                    self.unopened.write().remove(&key);
                    self.partitions.write().insert(key, Arc::new(lp));
                }
                Err(e) => {
                    self.unopened.write().insert(key, topic_id);
                    failures.push((format!("{topic}-{partition}"), e));
                }
            }
        }
        self.unopened.write().retain(|key, id| {
            wanted
                .get(key)
                .is_some_and(|(wanted_id, _, _)| wanted_id == id)
        });
        if image.cluster_id.is_some() {
            self.delete_strays(image);
        }
        failures
    }

    /// Opens a partition; when its data is damaged and `refetch` allows, cuts it (see
    /// [`Self::cut_and_open`]).
    fn open_or_cut(
        &self,
        topic: &str,
        partition: u32,
        topic_id: &str,
        config: TopicConfig,
        refetch: bool,
    ) -> Result<LocalPartition, LogError> {
        match self.open(topic, partition, topic_id, config.clone()) {
            Err(LogError::Damaged(report)) if refetch => {
                self.cut_and_open(topic, partition, topic_id, config, &report)
            }
            other => other,
        }
    }

    /// Cuts a damaged partition at its first damage (setting the rest aside, nothing
    /// deleted) and opens what is left, so the follower re-fetches the rest from the
    /// leader. Only for a replica [`may_refetch_damaged`] allows.
    fn cut_and_open(
        &self,
        topic: &str,
        partition: u32,
        topic_id: &str,
        config: TopicConfig,
        report: &DamageReport,
    ) -> Result<LocalPartition, LogError> {
        let now = self.clock.now_ms().max(0) as u64;
        let aside = set_aside_from_first_damage(report, now)?;
        tracing::warn!(
            partition = %format!("{topic}-{partition}"),
            cut_offset = aside.cut_offset,
            files = aside.files,
            quarantine = %aside.quarantine.display(),
            "damaged partition cut at its first damage to re-fetch the rest from the leader; the files set aside are kept for inspection"
        );
        self.open(topic, partition, topic_id, config)
    }

    fn open(
        &self,
        topic: &str,
        partition: u32,
        topic_id: &str,
        config: TopicConfig,
    ) -> Result<LocalPartition, LogError> {
        let dir = self.data_dir.join(format!("{topic}-{partition}"));
        let id_file = dir.join(TOPIC_ID_FILE);
        if let Ok(stored) = std::fs::read_to_string(&id_file) {
            if stored.trim() != topic_id {
                tracing::info!(dir = %dir.display(), "deleting the data of an earlier topic with this name");
                delete_dir(&dir);
            }
        }
        let log = PartitionLog::open_with(&dir, config, self.clock.clone(), &self.lock)?;
        if !id_file.exists() {
            crate::controller::log_store::write_atomically(
                &id_file,
                format!("{topic_id}\n").as_bytes(),
            )
            .map_err(|source| LogError::Io {
                path: id_file.clone(),
                source,
            })?;
        }
        // Per partition at debug: the loader logs what it recovered, and the replica manager one
        // line per topic for the roles taken.
        tracing::debug!(partition = %format!("{topic}-{partition}"), log_end_offset = log.log_end_offset().0, "partition opened");
        Ok(LocalPartition::new(topic, topic_id, partition, log)
            .notify_readable(self.appended.clone()))
    }

    /// Deletes partition directories whose topic no longer exists.
    fn delete_strays(&self, image: &MetadataImage) {
        let Ok(entries) = std::fs::read_dir(&self.data_dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if name.ends_with(".deleted") {
                delete_dir(&path);
                continue;
            }
            if name.ends_with(".quarantine") {
                // Damaged data set aside for an operator: never deleted here.
                continue;
            }
            let Some((topic, partition)) = parse_dir_name(name) else {
                continue;
            };
            if !path.join(TOPIC_ID_FILE).exists() || self.get(topic, partition).is_some() {
                continue;
            }
            let assigned = image.topics.get(topic).is_some_and(|t| {
                t.partitions
                    .get(partition as usize)
                    .is_some_and(|p| p.replicas.contains(&self.broker_id))
            });
            if !assigned {
                tracing::info!(dir = %path.display(), "deleting the directory of a deleted topic");
                delete_dir(&path);
            }
        }
    }

    /// Closes every partition cleanly (flush, checkpoints, clean-shutdown marker).
    pub fn close_all(&self) {
        let all: Vec<Arc<LocalPartition>> =
            self.partitions.write().drain().map(|(_, v)| v).collect();
        for lp in all {
            // A request or fetcher may still hold the partition: the closed log refuses
            // it from now on, so the clean-shutdown marker stays true.
            if let Err(e) = lp.log.close_in_place() {
                tracing::error!(partition = %lp.name(), error = %e, "clean close failed");
            }
        }
    }
}

/// Whether a replica whose data is damaged may cut its log at the damage and re-fetch the
/// rest: another live broker leads the partition and `me` is out of its ISR, so every
/// acknowledged record is held elsewhere and the leader's log is the one to follow (a
/// follower truncates to the leader's log in any case). Otherwise the partition stays
/// offline for the controllers to move it, or for `tidelog repair`.
pub fn may_refetch_damaged(
    me: BrokerId,
    p: &PartitionRecord,
    is_live: impl Fn(BrokerId) -> bool,
) -> bool {
    matches!(p.leader, Some(l) if l != me && is_live(l)) && !p.isr.contains(&me)
}

impl PartitionLookup for PartitionManager {
    fn partition(&self, topic: &str, partition: u32) -> Option<Arc<LocalPartition>> {
        self.get(topic, partition)
    }
}

fn delete_dir(dir: &Path) {
    let doomed = if dir.extension().is_some_and(|e| e == "deleted") {
        dir.to_owned()
    } else {
        let target = dir.with_file_name(format!(
            "{}.{}.deleted",
            dir.file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("partition"),
            uuid::Uuid::new_v4().simple()
        ));
        if std::fs::rename(dir, &target).is_err() {
            dir.to_owned()
        } else {
            target
        }
    };
    if let Err(e) = std::fs::remove_dir_all(&doomed) {
        tracing::warn!(dir = %doomed.display(), error = %e, "could not delete a partition directory");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::model::{BrokerRecord, TopicRecord};
    use crate::record::{BatchBuilder, Compression, RecordRef};
    use crate::types::LeaderEpoch;

    const ME: BrokerId = BrokerId(1);
    const OTHER: BrokerId = BrokerId(2);

    /// Topic `t` (id `tid`), one partition on brokers 2 and 1, led by 2, with `isr`.
    fn image(isr: &[BrokerId]) -> MetadataImage {
        let mut image = MetadataImage::default();
        for id in [ME, OTHER] {
            image.brokers.insert(
                id,
                BrokerRecord {
                    id,
                    address: String::new(),
                    rack: None,
                    internal_address: String::new(),
                    kafka_address: None,
                    incarnation_id: String::new(),
                    epoch: 1,
                    state: BrokerState::Unfenced,
                },
            );
        }
        image.topics.insert(
            "t".to_owned(),
            TopicRecord {
                id: "tid".to_owned(),
                name: "t".to_owned(),
                replication_factor: 2,
                config: Default::default(),
                partitions: vec![PartitionRecord {
                    partition: 0,
                    replicas: vec![OTHER, ME],
                    isr: isr.to_vec(),
                    leader: Some(OTHER),
                    leader_epoch: 0,
                    partition_epoch: 0,
                    adding_replicas: Vec::new(),
                    removing_replicas: Vec::new(),
                    offline_replicas: Vec::new(),
                }],
            },
        );
        image
    }

    fn append(lp: &LocalPartition, n: usize) -> Result<(), LogError> {
        let mut b = BatchBuilder::new(Compression::None);
        for _ in 0..n {
            b.push(RecordRef {
                timestamp: 0,
                key: None,
                value: Some(b"v"),
                headers: &[],
            });
        }
        let mut batch = b.build(lp.log.log_end_offset().0 as i64).unwrap();
        lp.log
            .append_as_leader(&mut batch, LeaderEpoch(0))
            .map(|_| ())
    }

    #[test]
    fn a_failed_replica_is_reported_and_reopened_only_once_another_copy_leads() {
        let dir = tempfile::tempdir().unwrap();
        let manager = PartitionManager::new(dir.path(), ME).unwrap();
        assert!(manager.reconcile(&image(&[OTHER, ME])).is_empty());
        let first = manager.get("t", 0).unwrap();
        append(&first, 3).unwrap();
        crate::segment::fail_next_append(0, libc::EIO);
        assert!(append(&first, 1).is_err());
        assert!(first.log.offline_reason().is_some());
        assert_eq!(manager.offline_replicas(), vec![("tid".to_owned(), 0)]);
        // Still in the ISR: the controllers have not moved it yet, so it stays as it is.
        assert!(manager.reconcile(&image(&[OTHER, ME])).is_empty());
        assert!(Arc::ptr_eq(&first, &manager.get("t", 0).unwrap()));
        // Out of the ISR with another live leader: reopened from its files.
        assert!(manager.reconcile(&image(&[OTHER])).is_empty());
        let second = manager.get("t", 0).unwrap();
        assert!(!Arc::ptr_eq(&first, &second));
        assert!(second.log.offline_reason().is_none());
        assert_eq!(second.log.log_end_offset().0, 3);
        assert!(manager.offline_replicas().is_empty());
    }

    #[test]
    fn may_refetch_only_from_another_live_leader_when_out_of_the_isr() {
        let image = image(&[OTHER]);
        let p = &image.topics["t"].partitions[0];
        assert!(may_refetch_damaged(ME, p, |_| true));
        assert!(!may_refetch_damaged(ME, p, |b| b != OTHER));
        assert!(!may_refetch_damaged(OTHER, p, |_| true));
        let mut in_isr = p.clone();
        in_isr.isr.push(ME);
        assert!(!may_refetch_damaged(ME, &in_isr, |_| true));
        let mut leaderless = p.clone();
        leaderless.leader = None;
        assert!(!may_refetch_damaged(ME, &leaderless, |_| true));
    }
}
