//! Push subscriptions: the broker side of a stream that pushes records of a set of
//! partitions as they are committed, within a window the client grants.
//!
//! [`PushWindow`] does the credit accounting (records and bytes sent and not yet given
//! back), [`cut_to_room`] trims a read to what the window allows (re-batching when the
//! room ends inside a batch), and [`PushSession`] runs the reads: each [`PushSession::next`]
//! is one pass over the partitions that waits, like a long-poll fetch, until records are
//! committed or the heartbeat interval passes. [`PushControl`] is the handle the request
//! side uses to give credit back and change the partitions while a pass waits.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::node::FetchTarget;
use super::{BrokerError, BrokerNode};
use crate::error_code::ErrorCode;
use crate::filter::RecordFilter;
use crate::record::{keep_records, BatchIter};
use crate::types::Offset;

/// Most records a client may hold unacknowledged.
pub const WINDOW_RECORDS_MAX: u32 = 1_000_000;
/// Smallest and largest byte window.
pub const WINDOW_BYTES_MIN: u32 = 1024;
/// Largest byte window (a fetch's largest answer).
pub const WINDOW_BYTES_MAX: u32 = 50 * 1024 * 1024;
/// Heartbeat interval bounds and default.
pub const HEARTBEAT_MIN: Duration = Duration::from_millis(100);
/// Longest heartbeat interval a client may ask for.
pub const HEARTBEAT_MAX: Duration = Duration::from_secs(30);
/// The interval when the client gives none.
pub const HEARTBEAT_DEFAULT: Duration = Duration::from_secs(3);

/// What the broker may still send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// Records.
    pub records: u64,
    /// Bytes.
    pub bytes: u64,
    /// Nothing is outstanding: one record larger than the room may go alone (or it could
    /// never be delivered).
    pub alone_ok: bool,
}

/// Credit accounting of one subscription: a window of records and bytes, minus what was
/// sent and not given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushWindow {
    records: u64,
    bytes: u64,
    out_records: u64,
    out_bytes: u64,
}

impl PushWindow {
    /// A window of `records` and `bytes`, both checked against their bounds.
    pub fn new(records: u32, bytes: u32) -> Result<Self, BrokerError> {
        if !(1..=WINDOW_RECORDS_MAX).contains(&records) {
            return Err(BrokerError::new(
                ErrorCode::InvalidRequest,
                format!("window_records must be 1..={WINDOW_RECORDS_MAX}, got {records}"),
            ));
        }
        if !(WINDOW_BYTES_MIN..=WINDOW_BYTES_MAX).contains(&bytes) {
            return Err(BrokerError::new(
                ErrorCode::InvalidRequest,
                format!(
                    "window_bytes must be {WINDOW_BYTES_MIN}..={WINDOW_BYTES_MAX}, got {bytes}"
                ),
            ));
        }
        Ok(Self {
            records: records.into(),
            bytes: bytes.into(),
            out_records: 0,
            out_bytes: 0,
        })
    }

    /// What may be sent now; `None` when the window is full.
    pub fn room(&self) -> Option<Room> {
        let records = self.records.saturating_sub(self.out_records);
        let bytes = self.bytes.saturating_sub(self.out_bytes);
        let alone_ok = self.out_records == 0 && self.out_bytes == 0;
        (records > 0 && (bytes > 0 || alone_ok)).then_some(Room {
            records,
            bytes,
            alone_ok,
        })
    }

    /// Counts a pushed message.
    pub fn take(&mut self, records: u64, bytes: u64) {
        self.out_records += records;
        self.out_bytes += bytes;
    }

    /// Takes back space of a push that was never sent (at most what is outstanding).
    pub fn give_back_lost(&mut self, records: u64, bytes: u64) {
        self.out_records = self.out_records.saturating_sub(records);
        self.out_bytes = self.out_bytes.saturating_sub(bytes);
    }

    /// Counts what the client gave back; more than is outstanding is a client bug.
    pub fn give_back(&mut self, records: u64, bytes: u64) -> Result<(), BrokerError> {
        if records > self.out_records || bytes > self.out_bytes {
            return Err(BrokerError::new(
                ErrorCode::InvalidRequest,
                format!(
                    "credit of {records} records and {bytes} bytes returns more than is outstanding ({} records, {} bytes)",
                    self.out_records, self.out_bytes
                ),
            ));
        }
        self.out_records -= records;
        self.out_bytes -= bytes;
        Ok(())
    }
}

/// A read trimmed to the room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut {
    /// Whole batches, the last one possibly re-batched to end early.
    pub batches: Bytes,
    /// Records in `batches` (as the batch headers count them).
    pub records: u64,
    /// Where the partition continues when the cut ended early (`None`: the whole read
    /// was taken).
    pub ends_at: Option<u64>,
}

/// The longest prefix of `data` (batches read from `from`) that fits `room`: whole
/// batches while they fit; when the next one does not, the records of it that do (its
/// records before `from` are dropped in that case). A record larger than the byte room
/// goes alone only when [`Room::alone_ok`]. An empty cut means: wait for credit.
pub fn cut_to_room(data: &Bytes, from: u64, room: Room) -> Result<Cut, String> {
    // Batches wholly before `from` (none in a read, which starts at the batch holding
    // it) are skipped.
    let mut start = 0usize;
    let mut taken = 0usize;
    let mut records = 0u64;
    let mut last_next = from;
    for batch in BatchIter::new(data) {
        let batch = batch.map_err(|e| e.to_string())?;
        let h = batch.header();
        let count = u64::try_from(h.record_count).unwrap_or(0);
        let size = batch.as_bytes().len();
        if taken == 0 && h.next_offset() as u64 <= from {
            start += size;
            continue;
        }
        if records + count <= room.records && (taken + size) as u64 <= room.bytes {
            taken += size;
            records += count;
            last_next = last_next.max(h.next_offset() as u64);
            continue;
        }
        if taken > 0 {
            return Ok(Cut {
                batches: data.slice(start..start + taken),
                records,
                ends_at: Some(last_next),
            });
        }
        // The room ends inside this first batch: re-batch the records that fit.
        return cut_inside(&batch, from, room);
    }
    Ok(Cut {
        batches: data.slice(start..start + taken),
        records,
        ends_at: None,
    })
}

/// The first records of `batch` from `from` that fit `room` (one alone when
/// [`Room::alone_ok`]), as a batch of their own.
fn cut_inside(
    batch: &crate::record::RecordBatch<'_>,
    from: u64,
    room: Room,
) -> Result<Cut, String> {
    let empty = Cut {
        batches: Bytes::new(),
        records: 0,
        ends_at: Some(from),
    };
    let mut offsets = Vec::new();
    batch
        .for_each_record(crate::record::MAX_UNCOMPRESSED_BATCH_BYTES, |r| {
            if r.offset as u64 >= from {
                offsets.push(r.offset as u64);
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    // Fit by records first, then shrink by bytes (halving).
    let mut want = offsets
        .len()
        .min(usize::try_from(room.records).unwrap_or(usize::MAX));
    while want > 0 {
        let last = offsets[want - 1];
        let mut out = Vec::new();
        let kept = keep_records(
            batch,
            |r| (from..=last).contains(&(r.offset as u64)),
            &mut out,
        )?;
        if out.len() as u64 <= room.bytes || (kept == 1 && room.alone_ok) {
            return Ok(Cut {
                batches: Bytes::from(out),
                records: kept.into(),
                ends_at: Some(last + 1),
            });
        }
        want = if want == 1 { 0 } else { want / 2 };
    }
    Ok(empty)
}

/// What one pass of a subscription produced.
#[derive(Debug)]
pub enum PushEvent {
    /// Records of a partition (or, with none, a filter's progress to `next_offset`).
    Records {
        /// Topic.
        topic: String,
        /// Partition.
        partition: u32,
        /// Record batches.
        batches: Bytes,
        /// Records in them (taken from the window).
        records: u64,
        /// The offset the read started at (the first batch may begin before it).
        from: u64,
        /// Where the partition continues.
        next_offset: u64,
        /// The partition's high watermark.
        high_watermark: Offset,
        /// The assignment that placed the partition.
        assignment: u64,
    },
    /// The partition left the subscription.
    Failed {
        /// Topic.
        topic: String,
        /// Partition.
        partition: u32,
        /// Why.
        error: BrokerError,
        /// The assignment that placed the partition.
        assignment: u64,
    },
}

#[derive(Debug)]
struct State {
    /// Next offset and assignment id of each partition.
    positions: BTreeMap<(String, u32), (u64, u64)>,
    window: PushWindow,
    /// Bumped by every assignment change: a pass started before one drops its reads.
    generation: u64,
}

/// The request side's handle on a subscription.
#[derive(Clone)]
pub struct PushControl {
    state: Arc<Mutex<State>>,
    /// Credit came back or the partitions changed.
    changed: Arc<Notify>,
}

impl PushControl {
    /// Gives window space back.
    pub fn give_back(&self, records: u64, bytes: u64) -> Result<(), BrokerError> {
        self.state.lock().window.give_back(records, bytes)?;
        self.changed.notify_one();
        Ok(())
    }

    /// Adds partitions, or moves ones already subscribed, to these offsets; messages
    /// about them carry `assignment`.
    pub fn assign(
        &self,
        partitions: impl IntoIterator<Item = ((String, u32), u64)>,
        assignment: u64,
    ) {
        let mut s = self.state.lock();
        s.positions
            .extend(partitions.into_iter().map(|(k, o)| (k, (o, assignment))));
        s.generation += 1;
        drop(s);
        self.changed.notify_one();
    }

    /// Removes partitions.
    pub fn unassign<'a>(&self, partitions: impl IntoIterator<Item = &'a (String, u32)>) {
        let mut s = self.state.lock();
        for p in partitions {
            s.positions.remove(p);
        }
        s.generation += 1;
        drop(s);
        self.changed.notify_one();
    }

    /// A push of `records` and `bytes` for `partition` (placed by `assignment`) could not
    /// be delivered: its window space comes back and the partition leaves the
    /// subscription, unless it was placed again since.
    pub fn fail(&self, partition: &(String, u32), assignment: u64, records: u64, bytes: u64) {
        let mut s = self.state.lock();
        s.window.give_back_lost(records, bytes);
        if s.positions
            .get(partition)
            .is_some_and(|p| p.1 == assignment)
        {
            s.positions.remove(partition);
            s.generation += 1;
        }
        drop(s);
        self.changed.notify_one();
    }

    /// How many partitions are subscribed.
    pub fn partition_count(&self) -> usize {
        self.state.lock().positions.len()
    }
}

/// The read side of one subscription.
pub struct PushSession {
    node: BrokerNode,
    filter: Option<Arc<RecordFilter>>,
    read_committed: bool,
    control: PushControl,
    /// Bumped per pass: each pass starts at a different partition, so one with a backlog
    /// cannot take the room of every pass.
    rotation: usize,
    /// Stored bytes per record pushed so far (smoothed), so a pass reads about what the
    /// record room lets it send rather than the whole byte room.
    bytes_per_record: u64,
}

impl PushSession {
    /// A subscription on `node` with `window`, reading through `filter`; with
    /// `read_committed`, only committed records (up to the last stable offset, without
    /// aborted transactions and markers).
    pub fn new(
        node: BrokerNode,
        window: PushWindow,
        filter: Option<Arc<RecordFilter>>,
        read_committed: bool,
    ) -> (Self, PushControl) {
        let control = PushControl {
            state: Arc::new(Mutex::new(State {
                positions: BTreeMap::new(),
                window,
                generation: 0,
            })),
            changed: Arc::new(Notify::new()),
        };
        let session = Self {
            node,
            filter,
            read_committed,
            control: control.clone(),
            rotation: 0,
            bytes_per_record: INITIAL_BYTES_PER_RECORD,
        };
        (session, control)
    }

    /// One pass: waits up to `wait` for committed records (or for credit, when the window
    /// is full) and returns what to push, already counted against the window. Empty when
    /// nothing came within `wait`.
    pub async fn next(&mut self, wait: Duration) -> Vec<PushEvent> {
        self.rotation = self.rotation.wrapping_add(1);
        let (plan, room, generation) = {
            let s = self.control.state.lock();
            let mut plan: Vec<(FetchTarget, u64)> = s
                .positions
                .iter()
                .map(|((topic, partition), (offset, assignment))| {
                    let target = FetchTarget {
                        topic: topic.clone(),
                        partition: *partition,
                        offset: *offset,
                        max_bytes: usize::MAX,
                        filter: self.filter.clone(),
                        follower_ok: false,
                        read_committed: self.read_committed,
                    };
                    (target, *assignment)
                })
                .collect();
            if !plan.is_empty() {
                let len = plan.len();
                plan.rotate_left(self.rotation % len);
            }
            (plan, s.window.room(), s.generation)
        };
        let Some(room) = room.filter(|_| !plan.is_empty()) else {
            // Nothing to read, or no credit: wait for either to change.
            let _ = tokio::time::timeout(wait, self.control.changed.notified()).await;
            return Vec::new();
        };
        // A change of partitions interrupts the wait; credit does not need to (there is
        // room already).
        let read_bytes = read_budget(room, self.bytes_per_record) as usize;
        let targets: Vec<FetchTarget> = plan.iter().map(|(t, _)| t.clone()).collect();
        let results = tokio::select! {
            r = self.node.fetch_for_push(targets, wait, read_bytes) => r,
            _ = self.wait_for_reassignment(generation) => return Vec::new(),
        };
        let (events, held_back) = self.take_results(plan, results);
        let (mut records, mut bytes) = (0u64, 0u64);
        for e in &events {
            if let PushEvent::Records {
                topic,
                partition,
                batches,
                records: n,
                ..
            } = e
            {
                self.node
                    .count_pushed(topic, *partition, *n, batches.len() as u64);
                records += n;
                bytes += batches.len() as u64;
            }
        }
        if records > 0 {
            // Three parts the old estimate, one part this pass.
            self.bytes_per_record = (3 * self.bytes_per_record + bytes.div_ceil(records)) / 4;
        }
        if events.is_empty() && held_back {
            let _ = tokio::time::timeout(wait, self.control.changed.notified()).await;
        }
        events
    }

    /// Turns a pass's reads into events, counted against the window; also says whether
    /// records were left for lack of room.
    fn take_results(
        &self,
        plan: Vec<(FetchTarget, u64)>,
        results: Vec<Result<crate::partition::FetchData, BrokerError>>,
    ) -> (Vec<PushEvent>, bool) {
        let mut s = self.control.state.lock();
        let mut events = Vec::new();
        // Records were there but did not fit the room left: wait for credit.
        let mut held_back = false;
        for ((target, assignment), result) in plan.into_iter().zip(results) {
            let key = (target.topic, target.partition);
            // Moved or removed while the read ran: its answer is for a stale position.
            if s.positions.get(&key) != Some(&(target.offset, assignment)) {
                continue;
            }
            let data = match result {
                Ok(d) => d,
                Err(error) => {
                    s.positions.remove(&key);
                    events.push(PushEvent::Failed {
                        topic: key.0,
                        partition: key.1,
                        error,
                        assignment,
                    });
                    continue;
                }
            };
            let (records, filtered_to) = if target.read_committed && !data.records.is_empty() {
                // Aborted transactions and markers are left out, and the position moves
                // past them as past filtered records.
                let read_to = next_offset_after(&data.records, target.offset, None);
                let kept = data.aborted_ranges().strip(&data.records);
                let filtered_to = data.next_offset.map_or(read_to, |o| o.0.max(read_to));
                (kept, Some(filtered_to))
            } else {
                (data.records.clone(), data.next_offset.map(|o| o.0))
            };
            let cut = match s.window.room() {
                Some(room) if !records.is_empty() => {
                    match cut_to_room(&records, target.offset, room) {
                        Ok(c) => c,
                        Err(reason) => {
                            s.positions.remove(&key);
                            events.push(PushEvent::Failed {
                                topic: key.0.clone(),
                                partition: key.1,
                                error: BrokerError::new(
                                    ErrorCode::CorruptMessage,
                                    format!("{}-{}: stored batch: {reason}", key.0, key.1),
                                ),
                                assignment,
                            });
                            continue;
                        }
                    }
                }
                // Nothing read, or the window filled up with earlier partitions.
                _ => Cut {
                    batches: Bytes::new(),
                    records: 0,
                    ends_at: if records.is_empty() {
                        None
                    } else {
                        Some(target.offset)
                    },
                },
            };
            let next = match cut.ends_at {
                Some(at) => at,
                None => next_offset_after(&records, target.offset, filtered_to),
            };
            if cut.records == 0 && next <= target.offset {
                held_back |= !records.is_empty();
                continue;
            }
            s.window.take(cut.records, cut.batches.len() as u64);
            s.positions.insert(key.clone(), (next, assignment));
            events.push(PushEvent::Records {
                topic: key.0,
                partition: key.1,
                batches: cut.batches,
                records: cut.records,
                from: target.offset,
                next_offset: next,
                high_watermark: data.high_watermark,
                assignment,
            });
        }
        (events, held_back)
    }

    async fn wait_for_reassignment(&self, generation: u64) {
        loop {
            let changed = self.control.changed.notified();
            if self.control.state.lock().generation != generation {
                return;
            }
            changed.await;
        }
    }
}

/// Bytes a pass's first guess assumes per record (1 KiB records and their batch share).
const INITIAL_BYTES_PER_RECORD: u64 = 1100;

/// Bytes a pass reads: about what the record room can carry (a quarter more, plus a
/// batch's worth), within the byte room. Reading the whole byte room when few records
/// fit would read, and throw away, several times what is sent.
pub fn read_budget(room: Room, bytes_per_record: u64) -> u64 {
    let by_records = room
        .records
        .saturating_mul(bytes_per_record.max(1))
        .saturating_mul(5)
        / 4
        + 64 * 1024;
    by_records
        .min(room.bytes)
        .clamp(1, u64::from(WINDOW_BYTES_MAX))
}

/// Where a partition read from `from` continues after `batches`: past the last batch, or
/// further when a filter skipped records (`filtered_to`).
pub fn next_offset_after(batches: &[u8], from: u64, filtered_to: Option<u64>) -> u64 {
    let mut next = from.max(filtered_to.unwrap_or(0));
    for batch in BatchIter::new(batches) {
        match batch {
            Ok(b) => next = next.max(b.header().next_offset() as u64),
            Err(_) => break,
        }
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{BatchBuilder, Compression, RecordRef};
    use proptest::prelude::*;

    fn batches(sizes: &[usize], value_len: usize) -> (Bytes, Vec<i64>) {
        let mut out = Vec::new();
        let mut offsets = Vec::new();
        let mut base = 0i64;
        let value = vec![7u8; value_len];
        for &n in sizes {
            let mut b = BatchBuilder::new(Compression::None);
            for i in 0..n {
                b.push(RecordRef {
                    timestamp: 1,
                    key: None,
                    value: Some(&value),
                    headers: &[],
                });
                offsets.push(base + i as i64);
            }
            out.extend_from_slice(&b.build(base).unwrap());
            base += n as i64;
        }
        (Bytes::from(out), offsets)
    }

    proptest! {
        #[test]
        fn a_pass_reads_within_the_byte_room_and_about_what_the_record_room_carries(
            records in 0u64..2_000_000,
            bytes in 1u64..(64 << 20),
            per_record in 0u64..(2 << 20),
        ) {
            let room = Room { records, bytes, alone_ok: false };
            let read = read_budget(room, per_record);
            prop_assert!(read >= 1);
            prop_assert!(read <= bytes.min(u64::from(WINDOW_BYTES_MAX)));
            let carried = records.saturating_mul(per_record.max(1));
            prop_assert!(read >= carried.min(bytes).min(u64::from(WINDOW_BYTES_MAX)));
        }
    }

    #[test]
    fn the_default_window_reads_a_thousand_records_not_eight_mebibytes() {
        let room = Room {
            records: 1000,
            bytes: 8 << 20,
            alone_ok: true,
        };
        let read = read_budget(room, INITIAL_BYTES_PER_RECORD);
        assert!(read < 2 << 20, "{read}");
    }

    fn offsets_of(data: &[u8]) -> Vec<i64> {
        crate::record::decode_data_records(data, 1 << 20)
            .unwrap()
            .into_iter()
            .map(|r| r.offset)
            .collect()
    }

    #[test]
    fn window_counts_and_refuses_over_returns() {
        let mut w = PushWindow::new(10, 2048).unwrap();
        assert_eq!(
            w.room(),
            Some(Room {
                records: 10,
                bytes: 2048,
                alone_ok: true
            })
        );
        w.take(10, 100);
        assert_eq!(w.room(), None);
        assert!(w.give_back(11, 0).is_err());
        w.give_back(4, 50).unwrap();
        assert_eq!(
            w.room(),
            Some(Room {
                records: 4,
                bytes: 1998,
                alone_ok: false
            })
        );
        assert!(PushWindow::new(0, 2048).is_err());
        assert!(PushWindow::new(1, 10).is_err());
        assert!(PushWindow::new(1, WINDOW_BYTES_MAX + 1).is_err());
    }

    #[test]
    fn a_push_never_sent_frees_its_space() {
        let mut w = PushWindow::new(10, 2048).unwrap();
        w.take(6, 1000);
        // The failed push (3 records, 600 bytes) is not outstanding any more; the client
        // may still return the other 3 records and 400 bytes, not more.
        w.give_back_lost(3, 600);
        assert!(w.give_back(4, 0).is_err());
        w.give_back(3, 400).unwrap();
        assert_eq!(
            w.room().map(|r| (r.records, r.bytes, r.alone_ok)),
            Some((10, 2048, true))
        );
        // More than outstanding saturates: a bug upstream cannot make room appear twice.
        w.give_back_lost(5, 5000);
        assert_eq!(w.room().map(|r| (r.records, r.bytes)), Some((10, 2048)));
    }

    #[test]
    fn a_record_larger_than_the_window_goes_alone_only_when_nothing_is_out() {
        let (data, _) = batches(&[3], 4000);
        let mut room = Room {
            records: 10,
            bytes: 1024,
            alone_ok: false,
        };
        assert_eq!(cut_to_room(&data, 0, room).unwrap().records, 0);
        room.alone_ok = true;
        let cut = cut_to_room(&data, 0, room).unwrap();
        assert_eq!(cut.records, 1);
        assert_eq!(offsets_of(&cut.batches), vec![0]);
        assert_eq!(cut.ends_at, Some(1));
    }

    proptest! {
        /// A cut never exceeds the room (but for the one record alone), is a prefix of
        /// the records from `from`, and says where to continue.
        #[test]
        fn cuts_fit_the_room_and_continue_where_they_end(
            sizes in proptest::collection::vec(1usize..20, 1..6),
            value_len in 1usize..300,
            from_pick in 0usize..100,
            records in 1u64..40,
            bytes in 1u64..8000,
            alone_ok: bool,
        ) {
            let (data, all) = batches(&sizes, value_len);
            let from = all[from_pick % all.len()] as u64;
            let room = Room { records, bytes, alone_ok };
            let cut = cut_to_room(&data, from, room).unwrap();
            let got: Vec<i64> = offsets_of(&cut.batches).into_iter().filter(|o| *o as u64 >= from).collect();
            let expected: Vec<i64> = all.iter().copied().filter(|o| *o as u64 >= from).take(got.len()).collect();
            prop_assert_eq!(&got, &expected);
            prop_assert_eq!(crate::record::count_records(&cut.batches), cut.records);
            if cut.records > 0 {
                prop_assert!(cut.records <= records);
                prop_assert!(cut.batches.len() as u64 <= bytes || (alone_ok && cut.records == 1));
            }
            match cut.ends_at {
                None => prop_assert_eq!(got.len(), all.iter().filter(|o| **o as u64 >= from).count()),
                Some(at) => prop_assert_eq!(at, got.last().map_or(from, |l| *l as u64 + 1)),
            }
            // Progress: with nothing outstanding, a cut takes at least one record.
            if alone_ok {
                prop_assert!(!got.is_empty());
            }
        }
    }
}
