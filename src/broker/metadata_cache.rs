//! The broker's copy of the cluster metadata, kept current by long-polling the
//! controllers (`controller_link`), and read by every request.

use parking_lot::RwLock;
use tokio::sync::watch;

use crate::controller::model::{MetadataChange, MetadataImage, PartitionRecord, TopicRecord};
use crate::types::BrokerId;

/// Metadata as of `version`.
pub struct MetadataCache {
    image: RwLock<(MetadataImage, u64)>,
    version: watch::Sender<u64>,
}

impl Default for MetadataCache {
    fn default() -> Self {
        Self {
            image: RwLock::new((MetadataImage::default(), 0)),
            version: watch::channel(0).0,
        }
    }
}

impl MetadataCache {
    /// Replaces the whole image.
    pub fn replace(&self, image: MetadataImage, version: u64) {
        *self.image.write() = (image, version);
        self.version.send_replace(version);
    }

    /// Applies changes in order; `version` is the version after them.
    pub fn apply(&self, changes: Vec<MetadataChange>, version: u64) {
        {
            let mut guard = self.image.write();
            let image = &mut guard.0;
            for change in changes {
                match change {
                    MetadataChange::ClusterId(id) => image.cluster_id = Some(id),
                    MetadataChange::Broker(b) => {
                        image.brokers.insert(b.id, b);
                    }
                    MetadataChange::Topic(t) => {
                        image.topics.insert(t.name.clone(), t);
                    }
                    MetadataChange::TopicDeleted { name, id } => {
                        if image.topics.get(&name).is_some_and(|t| t.id == id) {
                            image.topics.remove(&name);
                        }
                    }
                    MetadataChange::Partition {
                        topic,
                        topic_id,
                        partition,
                    } => {
                        if let Some(t) = image.topics.get_mut(&topic) {
                            if t.id == topic_id {
                                let i = partition.partition as usize;
                                if i < t.partitions.len() {
                                    t.partitions[i] = partition;
                                }
                            }
                        }
                    }
                }
            }
            guard.1 = version.max(guard.1);
        }
        self.version.send_replace(version);
    }

    /// The version held.
    pub fn version(&self) -> u64 {
        self.image.read().1
    }

    /// A receiver that changes with the version.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Runs `f` on the image.
    pub fn read<T>(&self, f: impl FnOnce(&MetadataImage) -> T) -> T {
        f(&self.image.read().0)
    }

    /// A topic.
    pub fn topic(&self, name: &str) -> Option<TopicRecord> {
        self.image.read().0.topics.get(name).cloned()
    }

    /// A partition and its topic's id.
    pub fn partition(&self, topic: &str, partition: u32) -> Option<(String, PartitionRecord)> {
        let guard = self.image.read();
        let t = guard.0.topics.get(topic)?;
        Some((t.id.clone(), t.partitions.get(partition as usize)?.clone()))
    }

    /// A broker's address.
    pub fn broker_address(&self, id: BrokerId) -> Option<String> {
        self.image
            .read()
            .0
            .brokers
            .get(&id)
            .map(|b| b.address.clone())
    }

    /// Where followers fetch from broker `id`: its internal listener (its client address
    /// for a registration that named none).
    pub fn broker_internal_address(&self, id: BrokerId) -> Option<String> {
        self.image.read().0.brokers.get(&id).map(|b| {
            if b.internal_address.is_empty() {
                b.address.clone()
            } else {
                b.internal_address.clone()
            }
        })
    }
}
