//! The clients of a run: idempotent acks=all writers and group consumers, all in the
//! test process, each recording what it saw for the checker.
//!
//! A writer sends `w<writer>-<seq>` values one at a time (so its acknowledged records
//! are in send order), round robin over the partitions, and records each
//! acknowledgement (partition, offset) and each failure (an unknown outcome: the record
//! may or may not be stored, but at most once). A consumer records every record it
//! reads with its member session: a session of a partition lasts while the member holds
//! it without a break (losing the membership is a break: the member starts over at the
//! committed offsets), and within one its offsets must only grow.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tidelog::client::group_consumer::{GroupConfig, GroupConsumer, OffsetReset};
use tidelog::client::producer::{Producer, ProducerConfig, ProducerRecord};

use super::checker::{Ack, Consumed};

/// The topic every client uses.
pub const TOPIC: &str = "nemesis";
/// Its partitions.
pub const PARTITIONS: u32 = 6;
/// The consumer group.
pub const GROUP: &str = "nemesis-readers";

/// The value of `writer`'s record `seq`.
pub fn value_of(writer: u32, seq: u64) -> String {
    format!("w{writer}-{seq}")
}

/// A writer task.
pub struct Writer {
    acks: Arc<Mutex<Vec<Ack>>>,
    failures: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    /// Starts writer `id` against `bootstrap`.
    pub fn start(bootstrap: Vec<String>, id: u32) -> Writer {
        let acks = Arc::new(Mutex::new(Vec::new()));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let producer = Producer::new(
            bootstrap,
            ProducerConfig {
                acks: -1,
                linger: Duration::from_millis(1),
                request_timeout: Duration::from_secs(2),
                retry_backoff: Duration::from_millis(100),
                delivery_timeout: Duration::from_secs(12),
                enable_idempotence: true,
                ..Default::default()
            },
        );
        let task = {
            let (acks, failures, stop) = (acks.clone(), failures.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seq = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let value = value_of(id, seq);
                    let partition = ((seq + u64::from(id)) % u64::from(PARTITIONS)) as u32;
                    let outcome = producer
                        .send_sync(ProducerRecord {
                            topic: TOPIC.to_owned(),
                            partition: Some(partition),
                            value: Some(Bytes::from(value.clone())),
                            ..Default::default()
                        })
                        .await;
                    match outcome {
                        Ok(m) => acks.lock().push(Ack {
                            writer: id,
                            seq,
                            partition: m.partition,
                            offset: m.offset,
                        }),
                        Err(e) => {
                            failures.lock().push(format!("{value}: {e}"));
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                    seq += 1;
                    // A steady load (a few hundred records/s over all writers): enough to
                    // catch losses, light enough for a 2-core machine under faults.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        };
        Writer {
            acks,
            failures,
            stop,
            task,
        }
    }

    /// Acknowledgements so far.
    pub fn acked(&self) -> usize {
        self.acks.lock().len()
    }

    /// Stops (waiting up to 30 s for the send in flight) and returns (acks, failures).
    pub async fn finish(self) -> (Vec<Ack>, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        if tokio::time::timeout(Duration::from_secs(30), &mut { self.task })
            .await
            .is_err()
        {
            eprintln!("nemesis: a writer did not stop within 30 s");
        }
        let acks = self.acks.lock().clone();
        let failures = self.failures.lock().clone();
        (acks, failures)
    }
}

/// A group member polling in a task.
pub struct Member {
    consumed: Arc<Mutex<Vec<Consumed>>>,
    assigned: Arc<Mutex<usize>>,
    errors: Arc<Mutex<usize>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Member {
    /// Starts member `id` of [`GROUP`].
    pub fn start(bootstrap: Vec<String>, id: u32) -> Member {
        let consumed = Arc::new(Mutex::new(Vec::new()));
        let assigned = Arc::new(Mutex::new(0));
        let errors = Arc::new(Mutex::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut consumer = GroupConsumer::new(
            bootstrap,
            GroupConfig {
                group: GROUP.into(),
                topics: vec![TOPIC.into()],
                client_id: format!("m{id}"),
                session_timeout: Duration::from_secs(6),
                auto_commit_interval: Duration::from_millis(500),
                auto_offset_reset: OffsetReset::Earliest,
                ..Default::default()
            },
        );
        let task = {
            let (consumed, assigned, errors, stop) = (
                consumed.clone(),
                assigned.clone(),
                errors.clone(),
                stop.clone(),
            );
            tokio::spawn(async move {
                // Per partition: the session it is read in now.
                let mut sessions: std::collections::BTreeMap<u32, u64> = Default::default();
                let mut next_session = 0u64;
                let mut lost = 0;
                while !stop.load(Ordering::SeqCst) {
                    let polled = consumer.poll(Duration::from_millis(200)).await;
                    // Partitions lost with the membership restart at the committed
                    // offsets (at-least-once): every session ends.
                    if consumer.partitions_lost() != lost {
                        lost = consumer.partitions_lost();
                        sessions.clear();
                    }
                    // The records of this poll were fetched under the assignment it
                    // reconciled to; a partition absent from it ends its session.
                    let now: Vec<u32> = consumer
                        .assignment()
                        .into_iter()
                        .filter(|(t, _)| t == TOPIC)
                        .map(|(_, p)| p)
                        .collect();
                    sessions.retain(|p, _| now.contains(p));
                    *assigned.lock() = now.len();
                    match polled {
                        Ok(records) => {
                            let mut log = consumed.lock();
                            for r in records {
                                let session = *sessions.entry(r.partition).or_insert_with(|| {
                                    next_session += 1;
                                    next_session
                                });
                                log.push(Consumed {
                                    member: id,
                                    session,
                                    partition: r.partition,
                                    offset: r.offset,
                                    value: r
                                        .value
                                        .as_deref()
                                        .map(|v| String::from_utf8_lossy(v).into_owned())
                                        .unwrap_or_default(),
                                });
                            }
                        }
                        Err(_) => {
                            *errors.lock() += 1;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
                let _ = tokio::time::timeout(Duration::from_secs(10), consumer.close()).await;
            })
        };
        Member {
            consumed,
            assigned,
            errors,
            stop,
            task,
        }
    }

    /// Partitions held now.
    pub fn assigned(&self) -> usize {
        *self.assigned.lock()
    }

    /// The highest offset read per partition so far.
    pub fn positions(&self) -> std::collections::BTreeMap<u32, i64> {
        let mut out = std::collections::BTreeMap::new();
        for c in self.consumed.lock().iter() {
            let e = out.entry(c.partition).or_insert(c.offset);
            *e = (*e).max(c.offset);
        }
        out
    }

    /// Stops (bounded) and returns (records read, poll errors).
    pub async fn finish(self) -> (Vec<Consumed>, usize) {
        self.stop.store(true, Ordering::SeqCst);
        if tokio::time::timeout(Duration::from_secs(30), &mut { self.task })
            .await
            .is_err()
        {
            eprintln!("nemesis: a consumer did not stop within 30 s");
        }
        let consumed = self.consumed.lock().clone();
        let errors = *self.errors.lock();
        (consumed, errors)
    }
}
