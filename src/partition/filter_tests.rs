//! Tag index and filtered reads: filtered answers equal a model's, whatever the batching,
//! compression, segment rolls, hash collisions or crashes.

use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::filter::{tag_hash, RecordFilter, SqlFilter, TagFilter};
use crate::record::tag::TAG_HEADER;
use crate::record::{BatchBuilder, BatchIter, Compression, RecordRef};
use crate::topic_config::TopicConfig;
use crate::types::{LeaderEpoch, Offset};

const T0: i64 = 1_764_670_000_000;
/// Two tags whose hashes collide (CRC32C 0x33d88c2a).
const COLLIDING: (&str, &str) = ("T1371838", "T2000402");

/// One record to write: its tag (if any) and a `region` property.
#[derive(Debug, Clone)]
struct Rec {
    tag: Option<String>,
    region: &'static str,
}

fn build(records: &[Rec], first_index: usize, compression: Compression) -> Vec<u8> {
    let mut b = BatchBuilder::new(compression);
    for (i, r) in records.iter().enumerate() {
        let value = format!("v{}", first_index + i);
        let mut headers: Vec<(&str, Option<&[u8]>)> = vec![("region", Some(r.region.as_bytes()))];
        if let Some(t) = &r.tag {
            headers.push((TAG_HEADER, Some(t.as_bytes())));
        }
        b.push(RecordRef {
            timestamp: T0,
            key: None,
            value: Some(value.as_bytes()),
            headers: &headers,
        });
    }
    b.build(0).unwrap()
}

fn config(small: bool) -> TopicConfig {
    if small {
        TopicConfig {
            segment_bytes: 2048,
            index_interval_bytes: 128,
            segment_index_bytes: 240,
            ..TopicConfig::default()
        }
    } else {
        TopicConfig::default()
    }
}

fn open(dir: &Path, config: TopicConfig) -> PartitionLog {
    PartitionLog::open(dir, config, Arc::new(SystemClock)).unwrap()
}

/// Writes `records` in batches of `batch` records; returns them by offset.
fn write(log: &PartitionLog, records: &[Rec], batch: usize, compression: Compression) {
    for (i, chunk) in records.chunks(batch.max(1)).enumerate() {
        let mut bytes = build(chunk, i * batch.max(1), compression);
        log.append_as_leader(&mut bytes, LeaderEpoch(0)).unwrap();
    }
}

/// Follows filtered reads from 0 to the log end: the offsets returned, checking that
/// every read moves on and returns only offsets at or after where it started.
fn read_filtered_all(log: &PartitionLog, filter: &RecordFilter, max_bytes: usize) -> Vec<u64> {
    let end = log.log_end_offset().0;
    let mut next = 0u64;
    let mut out = Vec::new();
    for _ in 0..100_000 {
        if next >= end {
            return out;
        }
        let data = log
            .read_filtered(Offset(next), max_bytes, Isolation::LogEnd, filter)
            .unwrap();
        let continue_at = data
            .next_offset
            .expect("filtered reads say where to go on")
            .0;
        for b in BatchIter::new(&data.records) {
            let b = b.unwrap();
            b.verify_crc().unwrap();
            for r in b.records(1 << 20).unwrap() {
                let offset = r.offset as u64;
                assert!(
                    offset >= next && offset < continue_at,
                    "{offset} outside [{next}, {continue_at})"
                );
                out.push(offset);
            }
        }
        assert!(continue_at > next, "no progress at {next}");
        next = continue_at;
    }
    panic!("filtered reads never reached the end");
}

fn expected(records: &[Rec], keep: impl Fn(&Rec) -> bool) -> Vec<u64> {
    records
        .iter()
        .enumerate()
        .filter(|(_, r)| keep(r))
        .map(|(i, _)| i as u64)
        .collect()
}

fn tags(list: &[&str]) -> RecordFilter {
    RecordFilter::Tag(TagFilter::parse(&list.join(" || ")).unwrap())
}

fn rec_strategy() -> impl Strategy<Value = Rec> {
    (
        prop_oneof![
            Just(None),
            Just(Some("A")),
            Just(Some("B")),
            Just(Some("C"))
        ],
        prop_oneof![Just("eu"), Just("us")],
    )
        .prop_map(|(tag, region)| Rec {
            tag: tag.map(str::to_owned),
            region,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Tag and SQL filters return exactly the model's records, in order, for any batching,
    /// codec, segment size and read size.
    #[test]
    fn filtered_reads_return_exactly_the_matching_records(
        records in proptest::collection::vec(rec_strategy(), 1..300),
        batch in 1usize..20,
        lz4 in any::<bool>(),
        small in any::<bool>(),
        max_bytes in 1usize..3000,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let log = open(dir.path(), config(small));
        let codec = if lz4 { Compression::Lz4 } else { Compression::None };
        write(&log, &records, batch, codec);
        let is = |r: &Rec, t: &str| r.tag.as_deref() == Some(t);
        prop_assert_eq!(read_filtered_all(&log, &tags(&["A"]), max_bytes), expected(&records, |r| is(r, "A")));
        prop_assert_eq!(
            read_filtered_all(&log, &tags(&["A", "C"]), max_bytes),
            expected(&records, |r| is(r, "A") || is(r, "C"))
        );
        let sql = RecordFilter::Sql(SqlFilter::parse("region = 'eu' AND TAGS IN ('B', 'C')").unwrap());
        prop_assert_eq!(
            read_filtered_all(&log, &sql, max_bytes),
            expected(&records, |r| r.region == "eu" && (is(r, "B") || is(r, "C")))
        );
        prop_assert_eq!(read_filtered_all(&log, &tags(&["Z"]), max_bytes), Vec::<u64>::new());
    }
}

#[test]
fn colliding_tags_are_told_apart() {
    let (a, b) = COLLIDING;
    assert_eq!(tag_hash(a), tag_hash(b), "the pair must collide");
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), config(false));
    let records: Vec<Rec> = (0..200)
        .map(|i| Rec {
            tag: Some(if i % 3 == 0 { a } else { b }.to_owned()),
            region: "eu",
        })
        .collect();
    write(&log, &records, 7, Compression::None);
    assert_eq!(
        read_filtered_all(&log, &tags(&[a]), 500),
        expected(&records, |r| r.tag.as_deref() == Some(a))
    );
}

#[test]
fn a_filtered_read_stops_at_the_high_watermark_and_skips_untagged_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let log = open(dir.path(), config(false));
    let mut records: Vec<Rec> = (0..100)
        .map(|_| Rec {
            tag: None,
            region: "us",
        })
        .collect();
    records[40].tag = Some("A".into());
    write(&log, &records, 10, Compression::None);
    log.set_high_watermark(Offset(30));
    let hw = log.high_watermark().0;
    let data = log
        .read_filtered(Offset(0), 1 << 20, Isolation::HighWatermark, &tags(&["A"]))
        .unwrap();
    assert!(data.records.is_empty());
    assert_eq!(
        data.next_offset,
        Some(Offset(hw)),
        "moves to the bound, not past it"
    );
}

/// The tag index is rebuilt after a crash and after damage, and a clean load notices an
/// index that lost its last entries.
#[test]
fn the_tag_index_is_rebuilt_when_lost_damaged_or_short() {
    for damage in ["delete", "zeros", "short", "crash"] {
        // For "delete", the last records are untagged: a missing file must be noticed as
        // missing, not by the tail check. (A file that lost entries before the tail is not
        // detected: see docs/storage-format.md.)
        let untagged_from = if damage == "delete" { 100 } else { 120 };
        let records: Vec<Rec> = (0..120)
            .map(|i| Rec {
                tag: (i % 4 != 3 && i < untagged_from).then(|| ["A", "B", "C"][i % 3].to_owned()),
                region: "eu",
            })
            .collect();
        let want = expected(&records, |r| r.tag.as_deref() == Some("B"));
        for small in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let log = open(dir.path(), config(small));
            write(&log, &records, 5, Compression::None);
            if damage == "crash" {
                drop(log);
            } else {
                log.close().unwrap();
            }
            for entry in std::fs::read_dir(dir.path()).unwrap() {
                let path = entry.unwrap().path();
                if path.extension().is_some_and(|e| e == "tagindex") {
                    let len = std::fs::metadata(&path).unwrap().len();
                    match damage {
                        "delete" => std::fs::remove_file(&path).unwrap(),
                        "zeros" => std::fs::write(&path, vec![0u8; len as usize]).unwrap(),
                        "short" if len >= 12 => {
                            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                            f.set_len(len - 12).unwrap();
                        }
                        _ => {}
                    }
                }
            }
            let log = open(dir.path(), config(small));
            assert_eq!(
                read_filtered_all(&log, &tags(&["B"]), 300),
                want,
                "{damage} small={small}"
            );
        }
    }
}

#[test]
fn follower_appends_index_tags_too() {
    let dir = tempfile::tempdir().unwrap();
    let leader = open(&dir.path().join("l"), config(true));
    let records: Vec<Rec> = (0..80)
        .map(|i| Rec {
            tag: (i % 2 == 0).then(|| "A".to_owned()),
            region: "eu",
        })
        .collect();
    write(&leader, &records, 3, Compression::None);
    let follower = open(&dir.path().join("f"), config(true));
    let mut at = 0;
    while at < leader.log_end_offset().0 {
        let data = leader.read(Offset(at), 700, Isolation::LogEnd).unwrap();
        let info = follower.append_as_follower(&data.records).unwrap();
        at = info.last_offset.0 + 1;
    }
    let filter = tags(&["A"]);
    assert_eq!(
        read_filtered_all(&follower, &filter, 200),
        read_filtered_all(&leader, &filter, 200)
    );
}

#[test]
fn one_request_with_more_tags_than_an_index_holds_spans_segments() {
    let dir = tempfile::tempdir().unwrap();
    // Room for 20 tag entries per segment.
    let log = open(dir.path(), config(true));
    let records: Vec<Rec> = (0..90)
        .map(|_| Rec {
            tag: Some("A".to_owned()),
            region: "eu",
        })
        .collect();
    // Nine batches of ten in one request.
    let mut request = Vec::new();
    for (i, chunk) in records.chunks(10).enumerate() {
        request.extend(build(chunk, i * 10, Compression::None));
    }
    log.append_as_leader(&mut request, LeaderEpoch(0)).unwrap();
    assert_eq!(
        read_filtered_all(&log, &tags(&["A"]), 100),
        (0..90).collect::<Vec<_>>()
    );
    // A single batch with more tagged records than a segment's index is refused.
    let mut huge = build(&records[..30], 0, Compression::None);
    let end = log.log_end_offset();
    let e = log.append_as_leader(&mut huge, LeaderEpoch(0)).unwrap_err();
    assert!(e.to_string().contains("tag index holds at most"), "{e}");
    assert_eq!(
        log.log_end_offset(),
        end,
        "nothing of the refused batch was written"
    );
}
