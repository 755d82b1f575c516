//! Server-side filtering with the real binary: 100,000 records with 10 tags and two
//! properties; `tidelog consume --filter-tag/--filter-sql` gets exactly the matching records
//! in offset order per partition; a group with a filter survives a killed member and its
//! lag reaches 0 though it skipped 90% of the log; colliding tag hashes are told apart; a
//! kill -9 while appending tagged records leaves a tag index that `dump-log` finds equal
//! to the log, and filtered reads stay exact after the restart.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use common::{binary, cli, eventually, free_ports, standalone, standalone_with, Proc};
use tidelog::client::producer::{Producer, ProducerConfig, ProducerRecord};
use tidelog::client::AdminClient;

const RECORDS: usize = 100_000;
const PARTITIONS: u32 = 6;

/// What record `i` carries: tag `T{i % 10}`, region `eu` for even `i`, amount `i % 500`.
fn tag_of(i: usize) -> String {
    format!("T{}", i % 10)
}
fn region_of(i: usize) -> &'static str {
    if i.is_multiple_of(2) {
        "eu"
    } else {
        "us"
    }
}
fn amount_of(i: usize) -> usize {
    i % 500
}

/// Sends records `from..to` of the pattern above (value `v{i}`) and waits for every ack.
async fn produce(
    bootstrap: &str,
    topic: &str,
    from: usize,
    to: usize,
    tag: impl Fn(usize) -> String,
) {
    let producer = Producer::new(
        vec![bootstrap.to_owned()],
        ProducerConfig {
            acks: -1,
            linger: Duration::from_millis(5),
            ..Default::default()
        },
    );
    let mut futures = Vec::new();
    for i in from..to {
        let record = ProducerRecord {
            topic: topic.into(),
            value: Some(Bytes::from(format!("v{i}"))),
            headers: vec![
                ("region".into(), Some(Bytes::from(region_of(i)))),
                ("amount".into(), Some(Bytes::from(amount_of(i).to_string()))),
            ],
            tag: Some(tag(i)),
            ..Default::default()
        };
        futures.push(producer.send(record).await);
    }
    for f in futures {
        f.await.expect("acknowledged");
    }
    producer.flush().await;
}

/// `tidelog consume` from the beginning with `extra` flags until idle: every record as
/// (partition, offset, value index, tag).
fn consume(bootstrap: &str, topic: &str, extra: &[&str]) -> Vec<(u32, i64, usize, String)> {
    let mut args = vec![
        "consume",
        "--bootstrap",
        bootstrap,
        "--topic",
        topic,
        "--from-beginning",
        "--output",
        "json",
        "--timeout-ms",
        "3000",
    ];
    args.extend_from_slice(extra);
    let (ok, out, err) = cli(&args);
    assert!(ok, "consume {extra:?}: {err}");
    parse_lines(&out)
}

/// The complete lines of `out`: a member's output file is read while it is being
/// written, and its last line may not be whole yet.
fn parse_lines(out: &str) -> Vec<(u32, i64, usize, String)> {
    out.split_inclusive('\n')
        .filter_map(|l| l.strip_suffix('\n'))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{e}: line {l:?} of the output:\n{out}"));
            (
                v["partition"].as_u64().unwrap() as u32,
                v["offset"].as_i64().unwrap(),
                v["value"].as_str().unwrap()[1..].parse().unwrap(),
                v["tag"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// Checks that `got` holds each record index passing `keep` exactly once, nothing else,
/// in offset order per partition.
#[track_caller]
fn assert_exactly(got: &[(u32, i64, usize, String)], keep: impl Fn(usize) -> bool, what: &str) {
    let mut last: BTreeMap<u32, i64> = BTreeMap::new();
    for (p, o, i, tag) in got {
        assert!(keep(*i), "{what}: record v{i} (tag {tag}) does not match");
        assert_eq!(*tag, tag_of(*i), "{what}: v{i} came back with tag {tag}");
        let previous = last.insert(*p, *o);
        assert!(
            previous.is_none_or(|prev| prev < *o),
            "{what}: partition {p} offset {o} after {previous:?}"
        );
    }
    let indexes: BTreeSet<usize> = got.iter().map(|r| r.2).collect();
    let want: BTreeSet<usize> = (0..RECORDS).filter(|&i| keep(i)).collect();
    assert_eq!(indexes.len(), got.len(), "{what}: a record came twice");
    assert_eq!(indexes, want, "{what}: not exactly the matching records");
}

fn total_lag(bootstrap: &str, group: &str) -> Option<i64> {
    let (ok, out, _) = cli(&[
        "groups",
        "describe",
        "--group",
        group,
        "--bootstrap",
        bootstrap,
        "--output",
        "json",
    ]);
    let d: serde_json::Value = serde_json::from_str(ok.then_some(&out)?).ok()?;
    d["offsets"]
        .as_array()?
        .iter()
        .map(|o| o["lag"].as_i64())
        .sum()
}

fn member(dir: &Path, name: &str, bootstrap: &str, args: &[&str]) -> (Child, std::path::PathBuf) {
    let out = dir.join(format!("{name}.out"));
    let child = Command::new(binary())
        .args(["consume", "--bootstrap", bootstrap, "--output", "json"])
        .args(args)
        .stdout(Stdio::from(std::fs::File::create(&out).unwrap()))
        .stderr(Stdio::from(
            std::fs::File::create(dir.join(format!("{name}.err"))).unwrap(),
        ))
        .spawn()
        .unwrap();
    (child, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn filtered_consumers_get_exactly_the_matching_records() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone_with(
        dir.path(),
        port,
        &[("TIDELOG_OFFSETS_TOPIC_NUM_PARTITIONS", "2")],
    );
    let bootstrap = format!("127.0.0.1:{port}");
    let admin = AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    admin
        .create_topic("tags", Some(PARTITIONS), Some(1), Default::default())
        .await
        .unwrap();

    // A group of two filtered members; one is killed -9 while the second half arrives.
    let group_args = [
        "--topic",
        "tags",
        "--group",
        "t5",
        "--from-beginning",
        "--filter-tag",
        "T5",
        "--timeout-ms",
        "6000",
        "--session-timeout-ms",
        "2000",
        "--auto-commit-interval-ms",
        "300",
    ];
    let (mut killed, killed_out) = member(dir.path(), "m0", &bootstrap, &group_args);
    let (mut survivor, survivor_out) = member(dir.path(), "m1", &bootstrap, &group_args);
    let read = |path: &Path| parse_lines(&std::fs::read_to_string(path).unwrap_or_default());
    eventually(
        "two members with three partitions each",
        Duration::from_secs(30),
        || async {
            let (ok, out, _) = cli(&[
                "groups",
                "describe",
                "--group",
                "t5",
                "--bootstrap",
                &bootstrap,
                "--output",
                "json",
            ]);
            let d: serde_json::Value = serde_json::from_str(ok.then_some(&out)?).ok()?;
            let sizes: Vec<usize> = d["members"]
                .as_array()?
                .iter()
                .map(|m| {
                    m["assignment"].as_array().map_or(0, |a| {
                        a.iter()
                            .map(|t| t["partitions"].as_array().map_or(0, Vec::len))
                            .sum()
                    })
                })
                .collect();
            (d["state"] == "stable" && sizes == vec![3, 3]).then_some(())
        },
    )
    .await;
    produce(&bootstrap, "tags", 0, RECORDS / 2, tag_of).await;
    eventually("both members read", Duration::from_secs(30), || async {
        (!read(&killed_out).is_empty() && !read(&survivor_out).is_empty()).then_some(())
    })
    .await;
    killed.kill().unwrap();
    let _ = killed.wait();
    produce(&bootstrap, "tags", RECORDS / 2, RECORDS, tag_of).await;

    let is = |i: usize, t: &str| tag_of(i) == t;
    assert_exactly(
        &consume(&bootstrap, "tags", &["--filter-tag", "T3"]),
        |i| is(i, "T3"),
        "one tag",
    );
    assert_exactly(
        &consume(&bootstrap, "tags", &["--filter-tag", "T1 || T4 || T7"]),
        |i| is(i, "T1") || is(i, "T4") || is(i, "T7"),
        "three tags",
    );
    assert_exactly(
        &consume(
            &bootstrap,
            "tags",
            &["--filter-sql", "region = 'eu' AND amount > 400"],
        ),
        |i| region_of(i) == "eu" && amount_of(i) > 400,
        "SQL",
    );
    assert_exactly(
        &consume(
            &bootstrap,
            "tags",
            &[
                "--filter-sql",
                "TAGS IN ('T2', 'T8') AND amount BETWEEN 10 AND 20",
            ],
        ),
        |i| (is(i, "T2") || is(i, "T8")) && (10..=20).contains(&amount_of(i)),
        "SQL over the tag",
    );

    // The survivor ends by itself after 6 s without records, committing on the way out.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while survivor.try_wait().unwrap().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "the survivor never went idle"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut union = read(&killed_out);
    union.extend(read(&survivor_out));
    for (_, _, i, tag) in &union {
        assert!(
            is(*i, "T5") && tag == "T5",
            "the group got v{i} tagged {tag}"
        );
    }
    let got: BTreeSet<usize> = union.iter().map(|r| r.2).collect();
    let want: BTreeSet<usize> = (0..RECORDS).filter(|&i| is(i, "T5")).collect();
    assert_eq!(got, want, "the group lost or invented records");
    assert_eq!(
        total_lag(&bootstrap, "t5"),
        Some(0),
        "committed offsets move past filtered-out records"
    );

    // A bad expression is refused before anything is read, pointing at the problem.
    let (ok, _, err) = cli(&[
        "consume",
        "--bootstrap",
        &bootstrap,
        "--topic",
        "tags",
        "--filter-sql",
        "amount >",
        "--timeout-ms",
        "1000",
    ]);
    assert!(!ok && err.contains("INVALID_FILTER_EXPRESSION"), "{err}");
    let (ok, _, err) = cli(&[
        "consume",
        "--bootstrap",
        &bootstrap,
        "--topic",
        "tags",
        "--filter-tag",
        "A || ",
        "--timeout-ms",
        "1000",
    ]);
    assert!(
        !ok && err.contains("INVALID_FILTER_EXPRESSION") && err.contains("tag 2"),
        "{err}"
    );
}

/// Two tags whose CRC32C hashes are equal: the tag index cannot tell them apart, the
/// exact re-check must.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colliding_tag_hashes_deliver_only_the_exact_tag() {
    let (a, b) = ("T1371838", "T2000402");
    assert_eq!(tidelog::filter::tag_hash(a), tidelog::filter::tag_hash(b));
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone(dir.path(), port);
    let bootstrap = format!("127.0.0.1:{port}");
    let admin = AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    admin
        .create_topic("c", Some(1), Some(1), Default::default())
        .await
        .unwrap();
    produce(&bootstrap, "c", 0, 3000, |i| {
        if i % 3 == 0 { a } else { b }.to_owned()
    })
    .await;
    // A bad filter sent straight to the broker (the CLI checks before sending) is refused
    // as a whole with its own code, naming the problem.
    let mut broker =
        tidelog::api::proto::broker_client::BrokerClient::connect(format!("http://{bootstrap}"))
            .await
            .unwrap();
    let refused = broker
        .fetch(tidelog::api::proto::FetchRequest {
            topics: vec![tidelog::api::proto::FetchTopic {
                topic: "c".into(),
                partitions: vec![tidelog::api::proto::FetchPartition::default()],
            }],
            filter: Some(tidelog::api::proto::RecordFilter {
                expression: Some(tidelog::api::proto::record_filter::Expression::Sql(
                    "amount BETWEEN 1".into(),
                )),
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        tidelog::api::status::code_of(&refused),
        tidelog::error_code::ErrorCode::InvalidFilterExpression
    );
    assert!(
        refused.message().contains("SQL filter"),
        "{}",
        refused.message()
    );
    let got = consume(&bootstrap, "c", &["--filter-tag", a]);
    let indexes: Vec<usize> = got.iter().map(|r| r.2).collect();
    assert_eq!(
        indexes,
        (0..3000).filter(|i| i % 3 == 0).collect::<Vec<_>>()
    );
    assert!(got.iter().all(|r| r.3 == a));
}

/// kill -9 while tagged records are being appended: after the restart `dump-log` finds
/// every segment's tag index equal to its log, and filtered reads are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_tag_index_matches_the_log_after_kill9() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let mut server: Proc = standalone(dir.path(), port);
    let bootstrap = format!("127.0.0.1:{port}");
    let admin = AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    let mut config = BTreeMap::new();
    config.insert("segment.bytes".to_owned(), "65536".to_owned());
    admin
        .create_topic("k", Some(1), Some(1), config)
        .await
        .unwrap();
    let writer = {
        let bootstrap = bootstrap.clone();
        tokio::spawn(async move {
            let producer = Producer::new(
                vec![bootstrap],
                ProducerConfig {
                    acks: 1,
                    linger: Duration::from_millis(1),
                    delivery_timeout: Duration::from_secs(3),
                    ..Default::default()
                },
            );
            let mut acked = Vec::new();
            for i in 0..1_000_000usize {
                let record = ProducerRecord {
                    topic: "k".into(),
                    value: Some(Bytes::from(format!("v{i}"))),
                    tag: (i % 3 != 0).then(|| tag_of(i)),
                    ..Default::default()
                };
                match producer.send_sync(record).await {
                    Ok(m) => acked.push((m.offset, i)),
                    Err(_) => break,
                }
            }
            acked
        })
    };
    tokio::time::sleep(Duration::from_millis(2500)).await;
    server.kill9();
    let acked = writer.await.unwrap();
    assert!(
        acked.len() > 100,
        "only {} records were acknowledged",
        acked.len()
    );
    let partition_dir = dir.path().join("data").join("k-0");
    drop(server);
    let mut server = standalone(dir.path(), port);
    // Recovery rewrote the indexes; read them with the server up (it keeps them mapped).
    let records = consume(&bootstrap, "k", &["--filter-tag", "T4 || T7"]);
    let want: Vec<usize> = acked
        .iter()
        .map(|&(_, i)| i)
        .filter(|&i| i % 3 != 0 && (i % 10 == 4 || i % 10 == 7))
        .collect();
    let got: Vec<usize> = records.iter().map(|r| r.2).collect();
    // Records written but not acknowledged before the kill may be there too.
    let got_set: BTreeSet<usize> = got.iter().copied().collect();
    assert_eq!(got_set.len(), got.len(), "a record came twice");
    assert!(
        want.iter().all(|i| got_set.contains(i)),
        "filtered reads lost acknowledged records"
    );
    assert!(got
        .iter()
        .all(|&i| i % 3 != 0 && (i % 10 == 4 || i % 10 == 7)));
    assert!(got.windows(2).all(|w| w[0] < w[1]), "out of order");
    server.terminate();
    let mut args = vec!["dump-log", "--output", "json"];
    let current: Vec<String> = std::fs::read_dir(&partition_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "tagindex"))
        .map(|p| p.display().to_string())
        .collect();
    assert!(!current.is_empty(), "tagged records made tag indexes");
    args.extend(current.iter().map(String::as_str));
    let (ok, out, err) = cli(&args);
    assert!(
        ok,
        "dump-log found the tag index and the log disagreeing: {err}"
    );
    let entries = out
        .lines()
        .filter(|l| l.contains("\"matches_log\":true"))
        .count();
    let tagged = acked.iter().filter(|&&(_, i)| i % 3 != 0).count();
    assert!(
        entries >= tagged,
        "{entries} index entries for {tagged} acknowledged tagged records"
    );
}
