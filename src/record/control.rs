//! Transaction markers: Kafka's control batches.
//!
//! A marker is a batch with the transactional and control attributes set, the producer
//! id and epoch of the transaction it ends, base sequence -1, and one record:
//!
//! ```text
//! key    version i16 (0)  type i16 (0 = abort, 1 = commit)
//! value  version i16 (0)  coordinator_epoch i32
//! ```
//!
//! Only the transaction coordinator writes markers (through the partition's leader);
//! clients never may. Consumers never see them as records.

use bytes::Bytes;

use super::{
    BatchBuilder, BatchHeader, BatchIter, Compression, RecordBatch, RecordError, RecordRef,
};

/// How a transaction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlMarker {
    /// Commit (true) or abort.
    pub commit: bool,
    /// Epoch of the coordinator that decided (its `__transaction_state` leader epoch).
    pub coordinator_epoch: i32,
}

/// Control record type of an abort marker.
pub const CONTROL_ABORT: i16 = 0;
/// Control record type of a commit marker.
pub const CONTROL_COMMIT: i16 = 1;

/// The marker batch (base offset 0) ending `producer_id`'s transaction at `epoch`.
pub fn marker_batch(
    producer_id: i64,
    producer_epoch: i16,
    marker: ControlMarker,
    timestamp_ms: i64,
) -> Vec<u8> {
    let kind = if marker.commit {
        CONTROL_COMMIT
    } else {
        CONTROL_ABORT
    };
    let mut key = [0u8; 4];
    key[2..4].copy_from_slice(&kind.to_be_bytes());
    let mut value = [0u8; 6];
    value[2..6].copy_from_slice(&marker.coordinator_epoch.to_be_bytes());
    let mut b = BatchBuilder::new(Compression::None)
        .producer(producer_id, producer_epoch, -1)
        .transactional(true)
        .control();
    b.push(RecordRef {
        timestamp: timestamp_ms.max(0),
        key: Some(&key),
        value: Some(&value),
        headers: &[],
    });
    b.build(0).expect("one small record always encodes")
}

/// The marker a control batch holds; an error names what is malformed.
pub fn decode_marker(batch: &RecordBatch<'_>) -> Result<ControlMarker, RecordError> {
    let malformed = |reason: String| RecordError::Malformed {
        field: "control record",
        reason,
    };
    let mut found = None;
    batch.for_each_record(1 << 16, |r| {
        if found.is_none() {
            found = Some((r.key.map(<[u8]>::to_vec), r.value.map(<[u8]>::to_vec)));
        }
        Ok(())
    })?;
    let Some((Some(key), value)) = found else {
        return Err(malformed(
            "a control batch needs a record with a key".into(),
        ));
    };
    if key.len() < 4 {
        return Err(malformed(format!("key of {} bytes, need 4", key.len())));
    }
    let kind = i16::from_be_bytes([key[2], key[3]]);
    let commit = match kind {
        CONTROL_ABORT => false,
        CONTROL_COMMIT => true,
        other => return Err(malformed(format!("unknown control type {other}"))),
    };
    let coordinator_epoch = match value {
        Some(v) if v.len() >= 6 => i32::from_be_bytes([v[2], v[3], v[4], v[5]]),
        _ => -1,
    };
    Ok(ControlMarker {
        commit,
        coordinator_epoch,
    })
}

/// Aborted transactions of a fetched range, as (producer id, first offset, marker offset):
/// a read-committed reader drops every transactional batch of that producer between the
/// two. Offsets alone decide, so it works on filtered (re-batched) reads too, where the
/// markers themselves are not returned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AbortedRanges(Vec<(i64, i64, i64)>);

impl AbortedRanges {
    /// From (producer id, first offset, last offset) triples.
    pub fn new(mut ranges: Vec<(i64, i64, i64)>) -> Self {
        ranges.sort_unstable();
        Self(ranges)
    }

    /// True when nothing was aborted.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the batch belongs to an aborted transaction.
    pub fn is_aborted(&self, h: &BatchHeader) -> bool {
        if !h.is_transactional() || h.is_control() || self.0.is_empty() {
            return false;
        }
        let from = self.0.partition_point(|(p, _, _)| *p < h.producer_id);
        self.0[from..]
            .iter()
            .take_while(|(p, _, _)| *p == h.producer_id)
            .any(|(_, first, last)| *first <= h.base_offset && h.last_offset() <= *last)
    }

    /// `batches` (whole batches back to back) without control batches and the batches of
    /// these aborted transactions: what a read-committed reader is shown, for a server
    /// that sends it batches as stored. Shares `batches` when nothing is left out; from a
    /// damaged batch on, the rest is kept as it is (the reader's CRC check reports it).
    pub fn strip(&self, batches: &Bytes) -> Bytes {
        let mut kept: Option<Vec<u8>> = None;
        let mut at = 0;
        for batch in BatchIter::new(batches) {
            let Ok(b) = batch else { break };
            let bytes = b.as_bytes();
            let drop = b.header().is_control() || self.is_aborted(b.header());
            match (&mut kept, drop) {
                (None, true) => kept = Some(batches[..at].to_vec()),
                (Some(out), false) => out.extend_from_slice(bytes),
                _ => {}
            }
            at += bytes.len();
        }
        match kept {
            None => batches.clone(),
            Some(mut out) => {
                out.extend_from_slice(&batches[at..]);
                Bytes::from(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn markers_round_trip(pid in 0i64..i64::MAX, epoch in 0i16..i16::MAX, commit: bool, ce in -1i32..i32::MAX, ts in 0i64..1i64 << 45) {
            let bytes = marker_batch(pid, epoch, ControlMarker { commit, coordinator_epoch: ce }, ts);
            let (batch, rest) = RecordBatch::parse(&bytes).unwrap();
            prop_assert!(rest.is_empty());
            batch.verify_crc().unwrap();
            let h = batch.header();
            prop_assert!(h.is_control() && h.is_transactional());
            prop_assert_eq!((h.producer_id, h.producer_epoch, h.base_sequence, h.record_count), (pid, epoch, -1, 1));
            prop_assert_eq!(decode_marker(&batch).unwrap(), ControlMarker { commit, coordinator_epoch: ce });
        }
    }

    /// One batch of a generated log: plain records, a transactional batch of producer 1
    /// or 2, or that producer's marker (true: commit).
    #[derive(Debug, Clone)]
    enum Step {
        Plain(usize),
        Txn(i64, usize),
        Marker(i64, bool),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1usize..4).prop_map(Step::Plain),
            (1i64..3, 1usize..4).prop_map(|(p, n)| Step::Txn(p, n)),
            (1i64..3, any::<bool>()).prop_map(|(p, c)| Step::Marker(p, c)),
        ]
    }

    proptest! {
        /// `strip` leaves exactly the non-control batches outside aborted transactions,
        /// whole and in order, and shares the buffer when it leaves nothing out.
        #[test]
        fn strip_keeps_what_a_read_committed_reader_sees(steps in proptest::collection::vec(step(), 0..24)) {
            let (mut log, mut expected) = (Vec::new(), Vec::new());
            let mut open: std::collections::HashMap<i64, i64> = Default::default();
            let mut ranges = Vec::new();
            let mut offset = 0i64;
            for s in &steps {
                let (mut bytes, keep) = match *s {
                    Step::Marker(pid, commit) => {
                        if let Some(first) = open.remove(&pid) {
                            if !commit {
                                ranges.push((pid, first, offset));
                            }
                        }
                        (marker_batch(pid, 0, ControlMarker { commit, coordinator_epoch: 0 }, 1), false)
                    }
                    Step::Plain(n) | Step::Txn(_, n) => {
                        let pid = match *s { Step::Txn(p, _) => p, _ => -1 };
                        if pid >= 0 {
                            open.entry(pid).or_insert(offset);
                        }
                        let mut b = BatchBuilder::new(Compression::None)
                            .producer(pid, 0, if pid >= 0 { 0 } else { -1 })
                            .transactional(pid >= 0);
                        for _ in 0..n {
                            b.push(RecordRef { timestamp: 1, key: None, value: Some(b"v"), headers: &[] });
                        }
                        (b.build(0).unwrap(), true)
                    }
                };
                crate::record::set_base_offset(&mut bytes, offset);
                offset = RecordBatch::parse(&bytes).unwrap().0.header().next_offset();
                log.push((bytes, keep));
            }
            let aborted = AbortedRanges::new(ranges.clone());
            let all = Bytes::from(log.iter().flat_map(|(b, _)| b.clone()).collect::<Vec<u8>>());
            for (bytes, keep) in &log {
                let h = *RecordBatch::parse(bytes).unwrap().0.header();
                let in_abort = ranges.iter().any(|(p, f, l)| *p == h.producer_id && *f <= h.base_offset && h.base_offset <= *l);
                if *keep && !in_abort {
                    expected.extend_from_slice(bytes);
                }
            }
            let stripped = aborted.strip(&all);
            prop_assert_eq!(&stripped[..], &expected[..]);
            if expected.len() == all.len() {
                prop_assert_eq!(stripped.as_ptr(), all.as_ptr());
            }
        }
    }

    #[test]
    fn aborted_ranges_cover_only_their_producers_transactional_batches() {
        let batch = |pid: i64, base: i64, n: usize, txn: bool| {
            let mut b = BatchBuilder::new(Compression::None)
                .producer(pid, 0, 0)
                .transactional(txn);
            for _ in 0..n {
                b.push(RecordRef {
                    timestamp: 1,
                    key: None,
                    value: Some(b"v"),
                    headers: &[],
                });
            }
            let bytes = b.build(base).unwrap();
            *RecordBatch::parse(&bytes).unwrap().0.header()
        };
        let aborted = AbortedRanges::new(vec![(7, 10, 20), (3, 0, 5)]);
        assert!(aborted.is_aborted(&batch(7, 10, 3, true)));
        assert!(aborted.is_aborted(&batch(7, 15, 5, true)));
        assert!(
            !aborted.is_aborted(&batch(7, 21, 1, true)),
            "after the marker"
        );
        assert!(
            !aborted.is_aborted(&batch(7, 5, 1, true)),
            "before the transaction"
        );
        assert!(
            !aborted.is_aborted(&batch(8, 12, 1, true)),
            "another producer"
        );
        assert!(
            !aborted.is_aborted(&batch(7, 12, 1, false)),
            "not transactional"
        );
        assert!(aborted.is_aborted(&batch(3, 0, 2, true)));
        assert!(!AbortedRanges::default().is_aborted(&batch(7, 12, 1, true)));
    }

    #[test]
    fn a_bad_control_type_is_an_error() {
        let mut b = BatchBuilder::new(Compression::None).control();
        b.push(RecordRef {
            timestamp: 0,
            key: Some(&[0, 0, 0, 7]),
            value: None,
            headers: &[],
        });
        let bytes = b.build(0).unwrap();
        let (batch, _) = RecordBatch::parse(&bytes).unwrap();
        assert!(decode_marker(&batch).is_err());
    }
}
