//! The producer's record accumulator: per partition, a queue of batches that records are
//! encoded into as they are sent (Kafka's `RecordAccumulator`).
//!
//! `append` finds the partition's open batch under a short per-partition lock and encodes
//! the record straight into its [`BatchBuilder`]: no per-record channel message, task or
//! allocation beyond the batch buffer's growth. Every record of a batch shares one
//! [`BatchResult`]; a record's outcome is the batch's outcome plus its index in it.
//!
//! Invariants:
//! - only the last batch of a partition's queue is open; the ones before it are sealed
//!   (full), so the front is always the oldest and drains first: a partition's records
//!   leave in the order they were appended;
//! - a record is admitted only after reserving an upper bound of its encoded size from the
//!   buffer pool (`buffer_memory` bytes), released when its batch completes, so the bytes
//!   held by unsent or unacknowledged batches never exceed `buffer_memory` (a record larger
//!   than the whole pool is refused);
//! - a batch completes exactly once (the first outcome wins), waking every record future
//!   waiting on it.
//!
//! The decisions (does a record fit, is a batch ready, when to look again) are pure
//! functions, tested without I/O; the sender in [`super::producer`] drains ready batches.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Waker;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tokio::sync::{Notify, Semaphore};

use super::error::ClientError;
use crate::error_code::ErrorCode;
use crate::record::{BatchBuilder, Compression, RecordRef};

/// Bytes a new batch's buffer starts with at most (its `batch_size` below that), so a
/// huge `batch_size` does not allocate a huge buffer for every partition.
const BATCH_PREALLOCATE_MAX: usize = 1024 * 1024;

/// What the accumulator needs of the producer's settings.
#[derive(Debug, Clone, Copy)]
pub struct AccumulatorConfig {
    /// A batch is full (ready) at this many bytes of records.
    pub batch_size: usize,
    /// A batch that is not full is ready once its first record waited this long.
    pub linger: Duration,
    /// Bytes that unsent and unacknowledged records may hold in all; `append` waits above.
    pub buffer_memory: usize,
    /// Codec of every batch.
    pub compression: Compression,
    /// A drain takes a partition's ready batches behind its front too, up to this many
    /// bytes in all (they go in one request, one round trip); at most `batch_size` takes
    /// only the front.
    pub drain_bytes_max: usize,
}

/// An upper bound of a record's encoded size in a batch (varints at their longest), so
/// that reserving it from the buffer pool never under-counts.
pub fn record_size_bound(
    key: Option<&[u8]>,
    value: Option<&[u8]>,
    headers: &[(&str, Option<&[u8]>)],
) -> usize {
    // length (5) + attributes (1) + timestamp delta (10) + offset delta (5)
    // + key length (5) + value length (5) + header count (5).
    let mut bytes = 36 + key.map_or(0, <[u8]>::len) + value.map_or(0, <[u8]>::len);
    for (k, v) in headers {
        bytes += 10 + k.len() + v.map_or(0, <[u8]>::len);
    }
    bytes
}

/// Whether a record of `record_bytes` joins an open batch of `batch_records` records and
/// `batch_bytes` bytes: it always does when the batch is empty (a record larger than
/// `batch_size` gets a batch of its own), otherwise only when the batch stays within
/// `batch_size`.
pub fn fits(
    batch_records: usize,
    batch_bytes: usize,
    record_bytes: usize,
    batch_size: usize,
) -> bool {
    batch_records == 0 || batch_bytes + record_bytes <= batch_size
}

/// The size an open batch fills up to: `batch_size`, or `grow_to` while its partition
/// has a request out, when that is larger (pure). Filling batches while the earlier
/// one is out, instead of queueing batches of `batch_size`, lets one partition move a
/// large batch per round trip with one request in flight (like a linger that lasts as
/// long as the round trip). A batch past `batch_size` is ready all the same.
pub fn fill_limit(batch_size: usize, grow_to: usize) -> usize {
    batch_size.max(grow_to)
}

/// Batches of one partition a drain takes at most: the broker recognises a retried
/// batch among a producer's last 5 per partition (`RETAINED_BATCHES`), so a retried
/// request of more could be refused as out of order although it was written.
pub const DRAIN_BATCHES_MAX: usize = crate::partition::producer_state::RETAINED_BATCHES;

/// Whether a partition's front batch may be sent: when it is full, when its first record
/// has waited `linger`, or when a flush is waiting for it.
pub fn is_ready(full: bool, age: Duration, linger: Duration, flushing: bool) -> bool {
    full || flushing || age >= linger
}

/// Whether the sender may take a partition's ready front batch now: not while an earlier
/// batch of the same partition is in flight or waiting to be retried (`muted`: one batch
/// in flight per partition keeps its order), and not beyond the sender's budget of
/// batches in flight.
pub fn may_drain(ready: bool, muted: bool, in_flight: usize, in_flight_max: usize) -> bool {
    ready && !muted && in_flight < in_flight_max
}

/// How a batch ended: its base offset (-1 with acks=0) or the error, and when.
#[derive(Debug, Clone)]
pub struct BatchOutcome {
    /// Base offset of the batch, or why it failed.
    pub result: Result<i64, ClientError>,
    /// When the outcome arrived (for latency measurements).
    pub at: Instant,
}

/// The one completion every record of a batch shares.
#[derive(Debug, Default)]
pub struct BatchResult {
    outcome: OnceLock<BatchOutcome>,
    /// Tasks waiting for the outcome; drained when it is set.
    wakers: Mutex<Vec<Waker>>,
    /// The partition the batch goes to (changed when fault avoidance moves it).
    partition: AtomicU32,
}

impl BatchResult {
    fn for_partition(partition: u32) -> Self {
        Self {
            partition: AtomicU32::new(partition),
            ..Self::default()
        }
    }

    /// The partition the batch went (or goes) to.
    pub fn partition(&self) -> u32 {
        self.partition.load(Ordering::Acquire)
    }

    /// The outcome, once there is one.
    pub fn outcome(&self) -> Option<&BatchOutcome> {
        self.outcome.get()
    }

    /// Sets the outcome (the first one wins) and wakes the waiters; false when it was
    /// already set.
    fn complete(&self, result: Result<i64, ClientError>) -> bool {
        let set = self
            .outcome
            .set(BatchOutcome {
                result,
                at: Instant::now(),
            })
            .is_ok();
        if set {
            // Taken under the lock a waiter registers under, after the outcome is set:
            // a waiter either sees the outcome or is in this list.
            let wakers = std::mem::take(&mut *self.wakers.lock());
            for w in wakers {
                w.wake();
            }
        }
        set
    }

    /// Registers `waker` unless the outcome is already there (then returns it).
    /// `registered` is the waker this caller registered before: it is not added twice.
    pub fn register(&self, waker: &Waker, registered: &mut Option<Waker>) -> Option<&BatchOutcome> {
        let mut wakers = self.wakers.lock();
        if let Some(o) = self.outcome.get() {
            return Some(o);
        }
        if registered.as_ref().is_none_or(|w| !w.will_wake(waker)) {
            wakers.push(waker.clone());
            *registered = Some(waker.clone());
        }
        None
    }
}

/// Where an appended record went.
#[derive(Debug)]
pub struct Appended {
    /// Its batch's completion.
    pub result: Arc<BatchResult>,
    /// Its index in the batch (offset = base offset + index).
    pub index: u32,
    /// A batch of keyless records was sealed (full): the sticky partitioner moves on.
    pub sealed_keyless: bool,
}

/// A batch taken by the sender: its records, encoded, and what completing it needs.
#[derive(Debug)]
pub struct DrainedBatch {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: u32,
    /// The records (producer fields still unset).
    pub builder: BatchBuilder,
    /// Completion shared by its records.
    pub result: Arc<BatchResult>,
    /// Bytes it holds of the buffer pool.
    pub reserved: usize,
    /// When its first record was appended.
    pub created: Instant,
    /// Every record was sent oneway (the batch goes with acks=0).
    pub oneway: bool,
    /// Every record is keyless and the batch was not sealed full: draining it moves the
    /// sticky partitioner on.
    pub keyless_unsealed: bool,
    /// Every record may go to any partition (fault avoidance may move the batch).
    pub movable: bool,
    /// Drained right behind the previous batch of the list, of the same partition: it
    /// goes in the same request, after it.
    pub follows: bool,
    id: u64,
}

impl DrainedBatch {
    /// Unique among the producer's batches.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Sends the batch to `partition` instead (fault avoidance; only a movable batch
    /// whose bytes do not depend on its partition).
    pub fn move_to(&mut self, partition: u32) {
        self.partition = partition;
        self.result.partition.store(partition, Ordering::Release);
    }
}

/// A batch being filled or waiting in its partition's queue.
#[derive(Debug)]
struct Batch {
    id: u64,
    builder: BatchBuilder,
    /// Reserved (upper-bound) bytes of its records.
    bytes: usize,
    created: Instant,
    /// No more records go in.
    sealed: bool,
    /// Full while keyless: the sticky partitioner moved on already.
    moved_on: bool,
    oneway: bool,
    keyless: bool,
    movable: bool,
    result: Arc<BatchResult>,
}

impl Batch {
    /// Sealed, or holding `batch_size` bytes (a growing batch stays open past that).
    fn is_full(&self, batch_size: usize) -> bool {
        self.sealed || self.bytes >= batch_size
    }
}

/// One partition's batches, oldest first; only the last may be open.
#[derive(Debug, Default)]
struct PartitionQueue {
    batches: VecDeque<Batch>,
    /// While the sender has a request of this partition out: how far its open batch may
    /// fill ([`fill_limit`]); 0 otherwise.
    grow_to: usize,
}

/// The per-partition batch queues, the buffer pool, and the sender's wake-up.
pub struct Accumulator {
    config: AccumulatorConfig,
    /// Per topic, per partition number.
    topics: RwLock<HashMap<String, Vec<Arc<Mutex<PartitionQueue>>>>>,
    /// Free bytes of `buffer_memory`, one permit per byte.
    memory: Semaphore,
    /// Batches not completed yet, for flush and close.
    incomplete: Mutex<HashMap<u64, Arc<BatchResult>>>,
    next_batch_id: AtomicU64,
    /// Flushes waiting: every batch is ready while this is non-zero.
    flushing: AtomicUsize,
    /// Batches completed with an error, ever (a transaction that had one cannot commit).
    failed: AtomicU64,
    /// Wakes the sender: a batch was created or sealed, or a flush began.
    wakeup: Notify,
}

impl std::fmt::Debug for Accumulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accumulator")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Decrements the flush counter when a flush ends (or its future is dropped).
struct FlushGuard<'a>(&'a AtomicUsize);

impl Drop for FlushGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Accumulator {
    /// An empty accumulator.
    pub fn new(config: AccumulatorConfig) -> Self {
        let memory = config.buffer_memory.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            config: AccumulatorConfig {
                buffer_memory: memory,
                ..config
            },
            topics: RwLock::new(HashMap::new()),
            memory: Semaphore::new(memory),
            incomplete: Mutex::new(HashMap::new()),
            next_batch_id: AtomicU64::new(0),
            flushing: AtomicUsize::new(0),
            failed: AtomicU64::new(0),
            wakeup: Notify::new(),
        }
    }

    /// Reserves `bytes` of the buffer pool for a record, waiting while the pool is
    /// exhausted (backpressure). Fails for a record larger than the whole pool.
    pub async fn reserve(&self, bytes: usize) -> Result<(), ClientError> {
        if bytes > self.config.buffer_memory {
            return Err(ClientError::new(
                ErrorCode::RecordTooLarge,
                format!(
                    "a record of up to {bytes} bytes exceeds buffer_memory ({} bytes)",
                    self.config.buffer_memory
                ),
            ));
        }
        // buffer_memory is at most Semaphore::MAX_PERMITS; larger requests were refused.
        let permits = u32::try_from(bytes).map_err(|_| {
            ClientError::new(
                ErrorCode::RecordTooLarge,
                format!("a record of up to {bytes} bytes exceeds 4 GiB"),
            )
        })?;
        if let Ok(p) = self.memory.try_acquire_many(permits) {
            p.forget();
            return Ok(());
        }
        match self.memory.acquire_many(permits).await {
            Ok(p) => {
                p.forget();
                Ok(())
            }
            Err(_) => Err(closed()),
        }
    }

    /// Bytes of the buffer pool free now.
    pub fn available_memory(&self) -> usize {
        self.memory.available_permits()
    }

    /// Appends a record to `topic`/`partition`'s open batch (opening one when there is
    /// none or the record does not fit), encoding it into the batch. `reserved` is what
    /// the caller reserved for it with [`Accumulator::reserve`]; `movable`: the record may
    /// go to any partition (no key, no explicit partition).
    pub fn append(
        &self,
        topic: &str,
        partition: u32,
        record: RecordRef<'_>,
        reserved: usize,
        (oneway, movable): (bool, bool),
    ) -> Appended {
        let queue = self.queue(topic, partition);
        let mut q = queue.lock();
        let mut sealed_keyless = false;
        let mut wake = false;
        let limit = fill_limit(self.config.batch_size, q.grow_to);
        let open = match q.batches.back_mut() {
            Some(b) if !b.sealed && fits(b.builder.len(), b.bytes, reserved, limit) => true,
            Some(b) => {
                if !b.sealed {
                    b.sealed = true;
                    sealed_keyless = b.keyless && !b.moved_on;
                    // Sealing the front: it is ready now.
                    wake = q.batches.len() == 1;
                }
                false
            }
            None => false,
        };
        if !open {
            let id = self.next_batch_id.fetch_add(1, Ordering::Relaxed);
            let result = Arc::new(BatchResult::for_partition(partition));
            self.incomplete.lock().insert(id, result.clone());
            q.batches.push_back(Batch {
                id,
                builder: BatchBuilder::with_capacity(
                    self.config.compression,
                    self.config.batch_size.min(BATCH_PREALLOCATE_MAX),
                ),
                bytes: 0,
                created: Instant::now(),
                sealed: false,
                moved_on: false,
                oneway: true,
                keyless: true,
                movable: true,
                result,
            });
            wake |= q.batches.len() == 1;
        }
        let Some(batch) = q.batches.back_mut() else {
            unreachable!("the queue holds an open batch here")
        };
        let index = batch.builder.len() as u32;
        let was_full = batch.bytes >= self.config.batch_size;
        batch.builder.push(record);
        batch.bytes += reserved;
        batch.oneway &= oneway;
        batch.keyless &= record.key.is_none();
        batch.movable &= movable;
        // A growing batch is ready at batch_size but stays open up to its limit; keyless
        // records move on to another partition at batch_size all the same.
        let full = batch.bytes >= self.config.batch_size;
        if batch.bytes >= limit {
            batch.sealed = true;
        }
        if full && !was_full && batch.keyless {
            sealed_keyless = true;
            batch.moved_on = true;
        }
        let result = batch.result.clone();
        // Only a change at the front (a new front batch, or the front sealed) matters to the
        // sender: a batch behind the front is looked at when the front leaves, as the
        // sender drains again after every completion.
        wake |= full && !was_full && q.batches.len() == 1;
        drop(q);
        if wake {
            self.wakeup.notify_one();
        }
        Appended {
            result,
            index,
            sealed_keyless,
        }
    }

    /// The queue of a partition, created on first use.
    fn queue(&self, topic: &str, partition: u32) -> Arc<Mutex<PartitionQueue>> {
        if let Some(q) = self
            .topics
            .read()
            .get(topic)
            .and_then(|v| v.get(partition as usize))
        {
            return q.clone();
        }
        let mut topics = self.topics.write();
        let list = topics.entry(topic.to_owned()).or_default();
        while list.len() <= partition as usize {
            list.push(Arc::default());
        }
        list[partition as usize].clone()
    }

    /// Takes the front batch of every partition that `may_take(topic, partition)` allows
    /// and whose front batch is ready at `now`, with the full batches right behind it up
    /// to `drain_bytes_max` in all (marked [`DrainedBatch::follows`]); returns them, in
    /// queue order within a partition, and the next time a batch not ready now will be
    /// (its linger end).
    pub fn drain(
        &self,
        now: Instant,
        mut may_take: impl FnMut(&str, u32) -> bool,
    ) -> (Vec<DrainedBatch>, Option<Instant>) {
        let flushing = self.flushing.load(Ordering::Acquire) > 0;
        let mut drained = Vec::new();
        let mut next: Option<Instant> = None;
        let topics = self.topics.read();
        for (topic, partitions) in topics.iter() {
            for (partition, queue) in partitions.iter().enumerate() {
                let partition = partition as u32;
                let mut q = queue.lock();
                let Some(front) = q.batches.front() else {
                    continue;
                };
                let ready = is_ready(
                    front.is_full(self.config.batch_size),
                    now.saturating_duration_since(front.created),
                    self.config.linger,
                    flushing,
                );
                if !ready {
                    let at = front.created + self.config.linger;
                    next = Some(next.map_or(at, |n| n.min(at)));
                    continue;
                }
                if !may_take(topic, partition) {
                    continue;
                }
                let mut bytes = 0;
                let mut taken = 0;
                let mut follows = false;
                while let Some(b) = q.batches.pop_front() {
                    // Reserved record bytes plus the batch header: the request's size.
                    bytes += b.bytes + crate::record::HEADER_LEN;
                    taken += 1;
                    let oneway = b.oneway;
                    drained.push(DrainedBatch {
                        topic: topic.clone(),
                        partition,
                        builder: b.builder,
                        result: b.result,
                        reserved: b.bytes,
                        created: b.created,
                        oneway,
                        keyless_unsealed: b.keyless && !b.sealed && !b.moved_on,
                        movable: b.movable,
                        follows,
                        id: b.id,
                    });
                    follows = true;
                    // The next joins if it is full too, goes with the same acks, and fits.
                    let joins = q.batches.front().is_some_and(|n| {
                        n.is_full(self.config.batch_size)
                            && n.oneway == oneway
                            && taken < DRAIN_BATCHES_MAX
                            && bytes + n.bytes + crate::record::HEADER_LEN
                                <= self.config.drain_bytes_max
                    });
                    if !joins {
                        break;
                    }
                }
            }
        }
        (drained, next)
    }

    /// Lets `topic`/`partition`'s open batch fill up to `grow_to` bytes (the sender has a
    /// request of it out), or only to `batch_size` again (`grow_to` 0: nothing out).
    pub fn set_growth(&self, topic: &str, partition: u32, grow_to: usize) {
        self.queue(topic, partition).lock().grow_to = grow_to;
    }

    /// The partitions holding queued batches that may move (fault avoidance).
    pub fn partitions_with_movable(&self) -> Vec<(String, u32)> {
        let topics = self.topics.read();
        let mut found = Vec::new();
        for (topic, partitions) in topics.iter() {
            for (partition, queue) in partitions.iter().enumerate() {
                if queue.lock().batches.iter().any(|b| b.movable) {
                    found.push((topic.clone(), partition as u32));
                }
            }
        }
        found
    }

    /// Moves `topic`/`from`'s queued movable batches (never sent: nothing numbered them)
    /// to the queue of partition `to`, sealed, ahead of `to`'s open batch, keeping their
    /// order. Returns how many moved.
    pub fn move_batches(&self, topic: &str, from: u32, to: u32) -> usize {
        if from == to {
            return 0;
        }
        let moved: Vec<Batch> = {
            let queue = self.queue(topic, from);
            let mut q = queue.lock();
            let (moved, kept): (VecDeque<Batch>, VecDeque<Batch>) = std::mem::take(&mut q.batches)
                .into_iter()
                .partition(|b| b.movable);
            q.batches = kept;
            moved.into()
        };
        let count = moved.len();
        if count == 0 {
            return 0;
        }
        let queue = self.queue(topic, to);
        let mut q = queue.lock();
        let open = q.batches.back().is_some_and(|b| !b.sealed);
        let at = q.batches.len() - usize::from(open);
        for (i, mut b) in moved.into_iter().enumerate() {
            b.sealed = true;
            b.result.partition.store(to, Ordering::Release);
            q.batches.insert(at + i, b);
        }
        drop(q);
        self.wakeup.notify_one();
        count
    }

    /// Completes a drained batch: its records' futures resolve, its bytes return to the
    /// pool. A second completion of the same batch changes nothing.
    pub fn complete(&self, batch: &DrainedBatch, result: Result<i64, ClientError>) {
        self.complete_parts(batch.id, &batch.result, batch.reserved, result);
    }

    fn complete_parts(
        &self,
        id: u64,
        batch: &BatchResult,
        reserved: usize,
        result: Result<i64, ClientError>,
    ) {
        let failed = result.is_err();
        if batch.complete(result) {
            if failed {
                self.failed.fetch_add(1, Ordering::AcqRel);
            }
            self.incomplete.lock().remove(&id);
            self.memory.add_permits(reserved);
        }
    }

    /// Wakes the sender (a broker became avoided: queued batches may move).
    pub fn wake_sender(&self) {
        self.wakeup.notify_one();
    }

    /// Waits until the sender is woken (a batch was created or sealed, or a flush began).
    pub async fn woken(&self) {
        self.wakeup.notified().await;
    }

    /// Makes every batch ready and waits until all batches that exist now are complete
    /// (acknowledged or failed).
    pub async fn flush(&self) {
        self.flushing.fetch_add(1, Ordering::AcqRel);
        let _guard = FlushGuard(&self.flushing);
        let waiting: Vec<Arc<BatchResult>> = self.incomplete.lock().values().cloned().collect();
        self.wakeup.notify_one();
        for batch in waiting {
            BatchWait {
                batch: &batch,
                registered: None,
            }
            .await;
        }
    }

    /// Fails every incomplete batch with `error` (the producer is closing).
    pub fn fail_all(&self, error: &ClientError) {
        let all: Vec<(u64, Arc<BatchResult>)> = self.incomplete.lock().drain().collect();
        for (_, batch) in all {
            batch.complete(Err(error.clone()));
        }
        self.memory.close();
    }

    /// Batches completed with an error since the accumulator was made.
    pub fn failed_batches(&self) -> u64 {
        self.failed.load(Ordering::Acquire)
    }

    /// Number of batches not completed yet.
    pub fn incomplete_batches(&self) -> usize {
        self.incomplete.lock().len()
    }
}

/// The error of a record sent to, or waiting in, a closed producer.
pub fn closed() -> ClientError {
    ClientError::new(
        ErrorCode::UnknownServerError,
        "producer stopped before delivery",
    )
}

/// Waits for a batch's outcome.
struct BatchWait<'a> {
    batch: &'a BatchResult,
    registered: Option<Waker>,
}

impl std::future::Future for BatchWait<'_> {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        let this = &mut *self;
        match this.batch.register(cx.waker(), &mut this.registered) {
            Some(_) => std::task::Poll::Ready(()),
            None => std::task::Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn config(batch_size: usize, buffer_memory: usize) -> AccumulatorConfig {
        AccumulatorConfig {
            batch_size,
            linger: Duration::from_millis(5),
            buffer_memory,
            compression: Compression::None,
            drain_bytes_max: 0,
        }
    }

    fn record(value: &[u8]) -> RecordRef<'_> {
        RecordRef {
            timestamp: 1_764_670_000_000,
            key: None,
            value: Some(value),
            headers: &[],
        }
    }

    #[test]
    fn the_size_bound_is_never_below_the_encoded_size() {
        proptest!(|(key in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..300)),
                    value in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..3000)),
                    header_keys in proptest::collection::vec("[a-z]{0,20}", 0..4),
                    timestamp in any::<i64>())| {
            let headers: Vec<(&str, Option<&[u8]>)> =
                header_keys.iter().map(|k| (k.as_str(), Some(k.as_bytes()))).collect();
            let r = RecordRef { timestamp, key: key.as_deref(), value: value.as_deref(), headers: &headers };
            let mut encoded = Vec::new();
            // The worst case: a large timestamp delta and offset delta.
            crate::record::encode_record(&mut encoded, &r, i32::MAX, timestamp);
            prop_assert!(record_size_bound(r.key, r.value, &headers) >= encoded.len());
        });
    }

    #[test]
    fn a_record_fits_an_empty_batch_always_and_a_full_one_never() {
        proptest!(|(records in 0usize..100, bytes in 0usize..100_000, size in 1usize..100_000, batch in 1usize..100_000)| {
            let f = fits(records, bytes, size, batch);
            if records == 0 {
                prop_assert!(f);
            } else {
                prop_assert_eq!(f, bytes + size <= batch);
            }
        });
    }

    #[test]
    fn readiness_full_lingered_or_flushing() {
        let linger = Duration::from_millis(5);
        assert!(!is_ready(false, Duration::from_millis(4), linger, false));
        assert!(is_ready(false, Duration::from_millis(5), linger, false));
        assert!(is_ready(true, Duration::ZERO, linger, false));
        assert!(is_ready(false, Duration::ZERO, linger, true));
        assert!(may_drain(true, false, 3, 4));
        assert!(
            !may_drain(true, true, 0, 4),
            "muted: one in flight per partition"
        );
        assert!(
            !may_drain(true, false, 4, 4),
            "the in-flight budget is spent"
        );
        assert!(!may_drain(false, false, 0, 4));
    }

    /// Random appends, drains and completions against a model: batches never exceed
    /// batch_size (unless one record alone does), a partition drains in append order and
    /// only its front batch, reserved bytes return to the pool exactly once.
    #[test]
    fn appends_and_drains_match_a_model() {
        proptest!(ProptestConfig::with_cases(64), |(ops in proptest::collection::vec((0u32..3, 1usize..400, any::<bool>()), 1..200))| {
            let batch_size = 1000;
            let acc = Accumulator::new(config(batch_size, 1 << 20));
            let mut appended: Vec<Vec<usize>> = vec![Vec::new(); 3];
            let mut drained: Vec<Vec<usize>> = vec![Vec::new(); 3];
            let mut reserved_total = 0;
            for (n, (partition, len, drain)) in ops.into_iter().enumerate() {
                let value = vec![b'x'; len];
                let reserved = record_size_bound(None, Some(&value), &[]);
                prop_assert!(acc.memory.try_acquire_many(reserved as u32).map(|p| p.forget()).is_ok());
                reserved_total += reserved;
                let a = acc.append("t", partition, record(&value), reserved, (false, false));
                prop_assert!(a.index as usize <= appended[partition as usize].len() - drained[partition as usize].len());
                appended[partition as usize].push(n);
                if drain {
                    // Flush semantics: everything ready; one batch per partition per round.
                    acc.flushing.fetch_add(1, Ordering::AcqRel);
                    let (batches, _) = acc.drain(Instant::now(), |_, _| true);
                    acc.flushing.fetch_sub(1, Ordering::AcqRel);
                    let mut seen = std::collections::BTreeSet::new();
                    for b in &batches {
                        prop_assert!(seen.insert(b.partition), "one batch per partition per drain");
                        prop_assert!(b.reserved <= batch_size || b.builder.len() == 1);
                        let p = b.partition as usize;
                        let start = drained[p].len();
                        let taken: Vec<usize> = appended[p][start..start + b.builder.len()].to_vec();
                        drained[p].extend(taken);
                        acc.complete(b, Ok(0));
                        acc.complete(b, Ok(7));
                        reserved_total -= b.reserved;
                        prop_assert_eq!(b.result.outcome().map(|o| o.result.clone()), Some(Ok(0)));
                    }
                    prop_assert_eq!(acc.available_memory(), (1 << 20) - reserved_total);
                }
            }
            // Drain the rest.
            loop {
                acc.flushing.fetch_add(1, Ordering::AcqRel);
                let (batches, _) = acc.drain(Instant::now(), |_, _| true);
                acc.flushing.fetch_sub(1, Ordering::AcqRel);
                if batches.is_empty() {
                    break;
                }
                for b in &batches {
                    let p = b.partition as usize;
                    let start = drained[p].len();
                    let taken: Vec<usize> = appended[p][start..start + b.builder.len()].to_vec();
                    drained[p].extend(taken);
                    acc.complete(b, Ok(0));
                }
            }
            prop_assert_eq!(&drained, &appended);
            prop_assert_eq!(acc.available_memory(), 1 << 20);
            prop_assert_eq!(acc.incomplete_batches(), 0);
        });
    }

    #[test]
    fn a_batch_is_sealed_at_batch_size_and_drains_before_linger() {
        let acc = Accumulator::new(config(3000, 1 << 20));
        let value = vec![b'x'; 1000];
        let reserved = record_size_bound(None, Some(&value), &[]);
        let t0 = Instant::now();
        let first = acc.append("t", 0, record(&value), reserved, (false, false));
        assert_eq!(first.index, 0);
        let (none, next) = acc.drain(t0, |_, _| true);
        assert!(none.is_empty(), "one record, linger not over");
        assert!(
            next.is_some_and(|n| n > t0),
            "looks again at the linger end"
        );
        acc.append("t", 0, record(&value), reserved, (false, false));
        // The third does not fit (3 x 1036 > 3000): it seals the first batch.
        let third = acc.append("t", 0, record(&value), reserved, (false, false));
        assert_eq!(third.index, 0, "starts the second batch");
        assert!(third.sealed_keyless);
        let (batches, _) = acc.drain(t0, |_, _| true);
        assert_eq!(batches.len(), 1);
        assert_eq!(batches[0].builder.len(), 2);
        // A muted partition is not drained even when ready.
        let (batches, _) = acc.drain(t0 + Duration::from_secs(1), |_, _| false);
        assert!(batches.is_empty());
        let (batches, _) = acc.drain(t0 + Duration::from_secs(1), |_, _| true);
        assert_eq!(batches.len(), 1, "lingered long enough");
    }

    /// An accumulator of 3000-byte batches draining up to `drain_bytes_max`, a 1000-byte
    /// value and the bytes a record of it reserves (1036: two fill a batch).
    fn kib_records(drain_bytes_max: usize) -> (Accumulator, Vec<u8>, usize) {
        let acc = Accumulator::new(AccumulatorConfig {
            drain_bytes_max,
            ..config(3000, 1 << 20)
        });
        let value = vec![b'x'; 1000];
        let reserved = record_size_bound(None, Some(&value), &[]);
        (acc, value, reserved)
    }

    #[test]
    fn batches_grow_while_their_partition_has_a_request_out() {
        assert_eq!(fill_limit(3000, 0), 3000);
        assert_eq!(fill_limit(3000, 10_000), 10_000);
        assert_eq!(fill_limit(3000, 1000), 3000, "never below batch_size");

        let (acc, value, reserved) = kib_records(7000);
        let t0 = Instant::now();
        // A request of partition 0 is out: the open batch fills past batch_size.
        acc.set_growth("t", 0, 10_000);
        for i in 0..9 {
            let a = acc.append("t", 0, record(&value), reserved, (false, false));
            assert_eq!(a.index, i, "record {i} joins the one growing batch");
            // Keyless records move on at batch_size (3 x 1036 >= 3000), once.
            assert_eq!(a.sealed_keyless, i == 2, "record {i}");
        }
        // Past batch_size it is ready (not waiting for its linger)...
        let (batches, _) = acc.drain(t0, |_, _| true);
        assert_eq!(batches.len(), 1);
        assert_eq!(batches[0].builder.len(), 9);
        assert!(
            !batches[0].keyless_unsealed,
            "the partitioner moved on already"
        );
        // ... and at its limit it is sealed: the tenth record opens a new batch, which
        // grows too although another is queued ahead of it.
        for _ in 0..9 {
            acc.append("t", 0, record(&value), reserved, (false, false));
        }
        for i in 0..9 {
            let a = acc.append("t", 0, record(&value), reserved, (false, false));
            assert_eq!(a.index, i, "9 x 1036 + 1036 > 10,000: a second batch");
            assert_eq!(a.sealed_keyless, i == 2, "record {i} of the second");
        }
        // Nothing out any more: batches are sealed at batch_size again.
        acc.set_growth("t", 0, 0);
        let (batches, _) = acc.drain(t0, |_, _| true);
        assert_eq!(batches.len(), 1, "9 KiB batches: one fills a 7 KiB request");
        let (batches, _) = acc.drain(t0, |_, _| true);
        assert_eq!(batches[0].builder.len(), 9);
        acc.append("t", 0, record(&value), reserved, (false, false));
        acc.append("t", 0, record(&value), reserved, (false, false));
        let third = acc.append("t", 0, record(&value), reserved, (false, false));
        assert_eq!(third.index, 0, "sealed at 2 records, as without growth");
        assert!(third.sealed_keyless);
    }

    #[test]
    fn a_drain_takes_at_most_what_the_broker_recognises_as_a_retry() {
        let (acc, value, reserved) = kib_records(1 << 20);
        for _ in 0..30 {
            acc.append("t", 0, record(&value), reserved, (false, false));
        }
        let (batches, _) = acc.drain(Instant::now(), |_, _| true);
        assert_eq!(batches.len(), DRAIN_BATCHES_MAX);
        assert_eq!(DRAIN_BATCHES_MAX, 5);
    }

    #[test]
    fn a_drain_takes_the_full_batches_behind_the_front_up_to_its_limit() {
        let (acc, value, reserved) = kib_records(7000);
        let t0 = Instant::now();
        // 9 records: four sealed batches of 2 and an open one of 1.
        for _ in 0..9 {
            acc.append("t", 0, record(&value), reserved, (false, false));
        }
        acc.append("t", 1, record(&value), reserved, (false, false));
        let (batches, _) = acc.drain(t0, |_, _| true);
        let taken: Vec<(u32, usize, bool)> = batches
            .iter()
            .map(|b| (b.partition, b.builder.len(), b.follows))
            .collect();
        // 3 x 2072 bytes fit 7000; partition 1's lone record is not ready yet.
        assert_eq!(taken, [(0, 2, false), (0, 2, true), (0, 2, true)]);
        let (batches, _) = acc.drain(t0, |_, _| true);
        assert_eq!(batches.len(), 1, "the open batch behind is not full");
        assert_eq!(batches[0].builder.len(), 2);
        let (batches, _) = acc.drain(t0 + Duration::from_secs(1), |_, _| true);
        assert_eq!(batches.len(), 2, "each partition's lingered open batch");
        assert!(batches.iter().all(|b| !b.follows && b.builder.len() == 1));
    }

    #[test]
    fn moved_batches_go_ahead_of_the_open_batch_and_keyed_ones_stay() {
        let acc = Accumulator::new(config(3000, 1 << 20));
        let value = vec![b'x'; 1000];
        let reserved = record_size_bound(None, Some(&value), &[]);
        let keyed = RecordRef {
            key: Some(b"k"),
            ..record(&value)
        };
        // Two records fill a batch. Partition 0: [m m] [m k] [k k] [m], open at the end.
        let moved_first = acc.append("t", 0, record(&value), reserved, (false, true));
        acc.append("t", 0, record(&value), reserved, (false, true));
        acc.append("t", 0, record(&value), reserved, (false, true));
        let stays = acc.append("t", 0, keyed, reserved, (false, false));
        acc.append("t", 0, keyed, reserved, (false, false));
        acc.append("t", 0, keyed, reserved, (false, false));
        let moved_last = acc.append("t", 0, record(&value), reserved, (false, true));
        // Partition 1: an open batch that must stay last (open).
        let open = acc.append("t", 1, keyed, reserved, (false, false));
        assert_eq!(
            acc.partitions_with_movable(),
            vec![("t".to_owned(), 0)],
            "only partition 0 holds movable batches"
        );
        assert_eq!(acc.move_batches("t", 0, 1), 2);
        assert!(acc.partitions_with_movable() == vec![("t".to_owned(), 1)]);
        assert_eq!(moved_first.result.partition(), 1);
        assert_eq!(moved_last.result.partition(), 1);
        assert_eq!(stays.result.partition(), 0);
        let t = Instant::now() + Duration::from_secs(1);
        let mut order = Vec::new();
        loop {
            let (batches, _) = acc.drain(t, |_, _| true);
            if batches.is_empty() {
                break;
            }
            for b in batches {
                order.push((b.partition, b.builder.len(), b.movable));
                acc.complete(&b, Ok(0));
            }
        }
        order.sort_by_key(|(p, ..)| *p);
        assert_eq!(
            order,
            vec![
                (0, 2, false),
                (0, 2, false),
                (1, 2, true),
                (1, 1, true),
                (1, 1, false)
            ],
            "partition 1: the moved batches in their order, then its open batch"
        );
        assert_eq!(open.result.partition(), 1);
        assert_eq!(acc.incomplete_batches(), 0, "every batch drained once");
    }

    #[tokio::test]
    async fn appends_wait_for_memory_and_resume_when_a_batch_completes() {
        let value = vec![b'x'; 1000];
        let reserved = record_size_bound(None, Some(&value), &[]);
        let acc = Arc::new(Accumulator::new(config(1 << 20, 2 * reserved)));
        acc.reserve(reserved).await.unwrap();
        acc.append("t", 0, record(&value), reserved, (false, false));
        acc.reserve(reserved).await.unwrap();
        acc.append("t", 0, record(&value), reserved, (false, false));
        let blocked = {
            let acc = acc.clone();
            tokio::spawn(async move { acc.reserve(reserved).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !blocked.is_finished(),
            "the pool is exhausted: the third record waits"
        );
        acc.flushing.fetch_add(1, Ordering::AcqRel);
        let (batches, _) = acc.drain(Instant::now(), |_, _| true);
        assert_eq!(batches.len(), 1);
        acc.complete(&batches[0], Ok(0));
        tokio::time::timeout(Duration::from_secs(5), blocked)
            .await
            .expect("resumes once the batch's bytes return")
            .unwrap()
            .unwrap();
        let too_big = acc.reserve(3 * reserved).await;
        assert_eq!(too_big.unwrap_err().code, ErrorCode::RecordTooLarge);
    }

    #[tokio::test]
    async fn flush_waits_for_every_batch_that_exists() {
        let acc = Arc::new(Accumulator::new(AccumulatorConfig {
            linger: Duration::from_secs(3600),
            ..config(1 << 20, 1 << 20)
        }));
        let value = vec![b'x'; 10];
        let a = acc.append("t", 0, record(&value), 100, (false, false));
        acc.append("t", 1, record(&value), 100, (false, false));
        let (none, _) = acc.drain(Instant::now(), |_, _| true);
        assert!(none.is_empty(), "not ready before the linger ends");
        let flush = {
            let acc = acc.clone();
            tokio::spawn(async move { acc.flush().await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (batches, _) = acc.drain(Instant::now(), |_, _| true);
        assert_eq!(batches.len(), 2, "a flush makes every batch ready");
        acc.complete(&batches[0], Ok(0));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!flush.is_finished(), "one batch is still incomplete");
        acc.complete(&batches[1], Ok(0));
        tokio::time::timeout(Duration::from_secs(5), flush)
            .await
            .expect("flush returns once all are complete")
            .unwrap();
        assert!(a.result.outcome().is_some());
    }
}
