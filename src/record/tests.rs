use super::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct OwnedRecord {
    timestamp: i64,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

fn arb_bytes() -> impl Strategy<Value = Option<Vec<u8>>> {
    proptest::option::of(proptest::collection::vec(any::<u8>(), 0..300))
}

fn arb_record() -> impl Strategy<Value = OwnedRecord> {
    (
        0i64..4_000_000_000_000,
        arb_bytes(),
        arb_bytes(),
        proptest::collection::vec(("[a-z]{0,8}", arb_bytes()), 0..4),
    )
        .prop_map(|(timestamp, key, value, headers)| OwnedRecord {
            timestamp,
            key,
            value,
            headers,
        })
}

fn arb_codec() -> impl Strategy<Value = Compression> {
    proptest::sample::select(Compression::ALL.to_vec())
}

fn build(codec: Compression, records: &[OwnedRecord], base_offset: i64) -> Vec<u8> {
    let mut builder = BatchBuilder::new(codec);
    for r in records {
        let headers: Vec<(&str, Option<&[u8]>)> = r
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_deref()))
            .collect();
        builder.push(RecordRef {
            timestamp: r.timestamp,
            key: r.key.as_deref(),
            value: r.value.as_deref(),
            headers: &headers,
        });
    }
    builder.build(base_offset).unwrap()
}

const LIMIT: usize = 64 << 20;

proptest! {
    #[test]
    fn built_batches_decode_to_the_same_records(
        codec in arb_codec(),
        records in proptest::collection::vec(arb_record(), 1..40),
        base_offset in 0i64..1 << 50,
    ) {
        let bytes = build(codec, &records, base_offset);
        let (batch, rest) = RecordBatch::parse(&bytes).unwrap();
        prop_assert!(rest.is_empty());
        batch.validate(LIMIT).unwrap();
        let h = batch.header();
        prop_assert_eq!(h.compression().unwrap(), codec);
        prop_assert_eq!(h.record_count as usize, records.len());
        prop_assert_eq!(h.last_offset(), base_offset + records.len() as i64 - 1);
        prop_assert_eq!(h.max_timestamp, records.iter().map(|r| r.timestamp).max().unwrap());
        let decoded = batch.records(LIMIT).unwrap();
        for (i, (d, r)) in decoded.iter().zip(&records).enumerate() {
            prop_assert_eq!(d.offset, base_offset + i as i64);
            prop_assert_eq!(d.timestamp, r.timestamp);
            prop_assert_eq!(d.key.as_deref(), r.key.as_deref());
            prop_assert_eq!(d.value.as_deref(), r.value.as_deref());
            let headers: Vec<(String, Option<Vec<u8>>)> = d
                .headers
                .iter()
                .map(|h| (h.key.clone(), h.value.as_ref().map(|v| v.to_vec())))
                .collect();
            prop_assert_eq!(&headers, &r.headers);
        }
    }

    #[test]
    fn any_flipped_byte_in_the_crc_region_is_detected(
        codec in arb_codec(),
        records in proptest::collection::vec(arb_record(), 1..5),
        at in any::<prop::sample::Index>(),
        mask in 1u8..=255,
    ) {
        let mut bytes = build(codec, &records, 0);
        let i = CRC_START + at.index(bytes.len() - CRC_START);
        bytes[i] ^= mask;
        // Either the header no longer parses or the CRC check fails: never silent.
        if let Ok((batch, _)) = RecordBatch::parse(&bytes) {
            prop_assert!(batch.verify_crc().is_err());
        }
    }

    #[test]
    fn rewriting_offset_and_epoch_keeps_the_crc_valid(
        records in proptest::collection::vec(arb_record(), 1..5),
        base in 0i64..1 << 60,
        epoch in any::<i32>(),
    ) {
        let mut bytes = build(Compression::None, &records, 0);
        set_base_offset(&mut bytes, base);
        set_partition_leader_epoch(&mut bytes, epoch);
        let (batch, _) = RecordBatch::parse(&bytes).unwrap();
        prop_assert!(batch.verify_crc().is_ok());
        prop_assert_eq!(batch.header().base_offset, base);
        prop_assert_eq!(batch.header().partition_leader_epoch, epoch);
        prop_assert_eq!(batch.records(LIMIT).unwrap()[0].offset, base);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        for batch in BatchIter::new(&bytes) {
            let Ok(batch) = batch else { break };
            let _ = batch.validate(1 << 20);
            let _ = batch.records(1 << 20);
        }
    }

    #[test]
    fn valid_header_with_garbage_records_never_panics(
        garbage in proptest::collection::vec(any::<u8>(), 0..200),
        count in 0i32..10,
        codec in arb_codec(),
    ) {
        let mut bytes = build(Compression::None, &[OwnedRecord {
            timestamp: 1, key: None, value: None, headers: vec![],
        }], 0);
        bytes.truncate(HEADER_LEN);
        bytes.extend_from_slice(&garbage);
        let len = (bytes.len() - LOG_OVERHEAD) as i32;
        bytes[8..12].copy_from_slice(&len.to_be_bytes());
        bytes[57..61].copy_from_slice(&count.to_be_bytes());
        bytes[21..23].copy_from_slice(&codec.attribute().to_be_bytes());
        let crc = compute_crc(&bytes);
        bytes[17..21].copy_from_slice(&crc.to_be_bytes());
        let (batch, _) = RecordBatch::parse(&bytes).unwrap();
        let _ = batch.validate(1 << 20);
    }
}

#[test]
fn truncated_batch_reports_needed_bytes() {
    let bytes = build(
        Compression::None,
        &[OwnedRecord {
            timestamp: 5,
            key: Some(b"k".to_vec()),
            value: Some(b"v".to_vec()),
            headers: vec![],
        }],
        0,
    );
    for cut in 0..bytes.len() {
        let err = RecordBatch::parse(&bytes[..cut]).unwrap_err();
        assert!(
            matches!(err, RecordError::Truncated { .. }),
            "cut {cut}: {err}"
        );
    }
}

#[test]
fn wrong_magic_is_rejected() {
    let mut bytes = build(
        Compression::None,
        &[OwnedRecord {
            timestamp: 5,
            key: None,
            value: None,
            headers: vec![],
        }],
        0,
    );
    bytes[16] = 1;
    assert_eq!(
        RecordBatch::parse(&bytes).unwrap_err(),
        RecordError::UnsupportedMagic(1)
    );
}

fn vector(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/data/kafka-record-batches/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Re-encoding the independent implementation's uncompressed batches with our builder
/// must give the same bytes, CRC included.
#[test]
fn builder_reproduces_kafka_python_batches_byte_for_byte() {
    let log = vector("basic.log");
    let mut count = 0;
    for batch in BatchIter::new(&log) {
        let batch = batch.unwrap();
        let h = *batch.header();
        let records = batch.records(LIMIT).unwrap();
        let mut builder = BatchBuilder::new(Compression::None)
            .producer(h.producer_id, h.producer_epoch, h.base_sequence)
            .partition_leader_epoch(h.partition_leader_epoch);
        for r in &records {
            let headers: Vec<(&str, Option<&[u8]>)> = r
                .headers
                .iter()
                .map(|x| (x.key.as_str(), x.value.as_deref()))
                .collect();
            builder.push_at(
                (r.offset - h.base_offset) as i32,
                RecordRef {
                    timestamp: r.timestamp,
                    key: r.key.as_deref(),
                    value: r.value.as_deref(),
                    headers: &headers,
                },
            );
        }
        assert_eq!(builder.build(h.base_offset).unwrap(), batch.as_bytes());
        count += 1;
    }
    assert_eq!(count, 3);
}

#[test]
fn compressed_vectors_decode_and_reencode_identically() {
    let log = vector("codecs.log");
    let mut seen = Vec::new();
    for batch in BatchIter::new(&log) {
        let batch = batch.unwrap();
        batch.validate(LIMIT).unwrap();
        let codec = batch.header().compression().unwrap();
        seen.push(codec);
        let records = batch.records(LIMIT).unwrap();
        let owned: Vec<OwnedRecord> = records
            .iter()
            .map(|r| OwnedRecord {
                timestamp: r.timestamp,
                key: r.key.as_ref().map(|b| b.to_vec()),
                value: r.value.as_ref().map(|b| b.to_vec()),
                headers: r
                    .headers
                    .iter()
                    .map(|h| (h.key.clone(), h.value.as_ref().map(|v| v.to_vec())))
                    .collect(),
            })
            .collect();
        // Offsets in these vectors are contiguous from the first record's offset.
        let first = records[0].offset;
        let ours = build(codec, &owned, first);
        let (again, _) = RecordBatch::parse(&ours).unwrap();
        again.validate(LIMIT).unwrap();
        assert_eq!(again.records(LIMIT).unwrap(), records, "{codec}");
    }
    assert_eq!(
        seen,
        [
            Compression::Snappy,
            Compression::Lz4,
            Compression::Zstd,
            Compression::Gzip
        ]
    );
}

/// A batch of one record whose value is `len` zeros.
fn zeros_batch(codec: Compression, len: usize) -> Vec<u8> {
    let value = vec![0u8; len];
    let mut builder = BatchBuilder::new(codec);
    builder.push(RecordRef {
        timestamp: 1,
        key: None,
        value: Some(&value),
        headers: &[],
    });
    builder.build(0).unwrap()
}

#[test]
fn validating_a_bomb_stops_at_the_cap_for_every_codec() {
    for codec in Compression::ALL.into_iter().skip(1) {
        let bytes = zeros_batch(codec, 8 << 20);
        assert!(bytes.len() < 1 << 20, "{codec}: {} bytes", bytes.len());
        let (batch, _) = RecordBatch::parse(&bytes).unwrap();
        match batch.validate(1 << 20) {
            Err(RecordError::DecompressedTooLarge { limit, reached, .. }) => {
                assert_eq!(limit, 1 << 20, "{codec}");
                assert!(reached < 2 << 20, "{codec}: inflated to {reached}");
            }
            other => panic!("{codec}: {other:?}"),
        }
        assert!(batch.records(1 << 20).is_err(), "{codec}");
        // Within the cap it decodes, streamed.
        let n = batch.validate(9 << 20).unwrap();
        assert!(n > 8 << 20, "{codec}: {n}");
        assert_eq!(
            batch.records(9 << 20).unwrap()[0]
                .value
                .as_ref()
                .unwrap()
                .len(),
            8 << 20
        );
    }
}

#[test]
fn decode_data_records_caps_all_batches_together() {
    for codec in Compression::ALL.into_iter().skip(1) {
        let mut fetch = Vec::new();
        for base in 0..4 {
            let mut b = zeros_batch(codec, 400 << 10);
            set_base_offset(&mut b, base);
            fetch.extend_from_slice(&b);
        }
        // Each batch alone fits 1 MiB; the four together do not.
        assert!(
            matches!(
                decode_data_records(&fetch, 1 << 20),
                Err(RecordError::DecompressedTooLarge { limit, .. }) if limit < 1 << 20
            ),
            "{codec}"
        );
        assert_eq!(
            decode_data_records(&fetch, 2 << 20).unwrap().len(),
            4,
            "{codec}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Validation accepts a compressed batch exactly when its records block decompresses
    /// to no more than the cap, for every codec.
    #[test]
    fn validation_accepts_exactly_the_batches_within_the_cap(
        codec in proptest::sample::select(Compression::ALL[1..].to_vec()),
        len in 0usize..200_000,
        cap in 1usize..200_000,
    ) {
        let plain = zeros_batch(Compression::None, len);
        let block = plain.len() - HEADER_LEN;
        let bytes = zeros_batch(codec, len);
        let (batch, _) = RecordBatch::parse(&bytes).unwrap();
        match batch.validate(cap) {
            Ok(n) => prop_assert!(block <= cap && n == block),
            Err(RecordError::DecompressedTooLarge { limit, .. }) => {
                prop_assert!(block > cap && limit == cap)
            }
            Err(e) => prop_assert!(false, "{}", e),
        }
    }
}

proptest! {
    /// `count_records` sums the counts of the whole batches and never reads past the end.
    #[test]
    fn count_records_counts_whole_batches(
        sizes in proptest::collection::vec(1usize..20, 1..5),
        cut in 0usize..200,
        garbage in proptest::collection::vec(any::<u8>(), 0..100),
    ) {
        let mut buf = Vec::new();
        let mut next = 0i64;
        for n in &sizes {
            let records: Vec<OwnedRecord> = (0..*n)
                .map(|i| OwnedRecord { timestamp: i as i64, key: None, value: Some(vec![1; 10]), headers: Vec::new() })
                .collect();
            buf.extend(build(Compression::None, &records, next));
            next += *n as i64;
        }
        prop_assert_eq!(count_records(&buf), sizes.iter().sum::<usize>() as u64);
        let last = *sizes.last().unwrap() as u64;
        let cut_at = buf.len() - 1 - cut.min(buf.len() - 1).min(20);
        prop_assert_eq!(count_records(&buf[..cut_at]), sizes.iter().sum::<usize>() as u64 - last);
        // Arbitrary bytes never make it read out of bounds.
        let _ = count_records(&garbage);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// The shared decode returns what the copying one does, and records of uncompressed
    /// batches point into the fetched buffer instead of copies.
    #[test]
    fn shared_decode_matches_and_does_not_copy(
        batches in proptest::collection::vec(
            (arb_codec(), proptest::collection::vec(arb_record(), 1..10)),
            1..5,
        ),
    ) {
        let mut fetch = Vec::new();
        let mut base = 0i64;
        for (codec, records) in &batches {
            fetch.extend_from_slice(&build(*codec, records, base));
            base += records.len() as i64;
        }
        let fetch = bytes::Bytes::from(fetch);
        let copied = decode_data_records(&fetch, LIMIT).unwrap();
        let shared = decode_data_records_shared(&fetch, LIMIT).unwrap();
        prop_assert_eq!(&shared, &copied);
        let inside = |b: &bytes::Bytes| fetch.as_ptr_range().contains(&b.as_ptr());
        let mut records = shared.iter();
        for (codec, batch) in &batches {
            for _ in batch {
                let r = records.next().unwrap();
                let parts = r.key.iter().chain(&r.value).chain(r.headers.iter().flat_map(|h| &h.value));
                for part in parts.filter(|p| !p.is_empty()) {
                    prop_assert_eq!(inside(part), *codec == Compression::None, "{}", codec);
                }
            }
        }
    }
}
