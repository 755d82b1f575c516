//! The Kafka listener against real Kafka clients: kcat, confluent-kafka (librdkafka),
//! kafka-python and aiokafka talk to a real `tidelog standalone` (and a 3-broker cluster):
//! produce, consume in groups of both protocols, administer; records and committed
//! offsets cross between the Kafka and gRPC doors; bad frames close only their own
//! connection.
//!
//! The clients come from `.ci/kafka-clients` (Debian's kcat; a venv with the Python clients
//! at `$KAFKA_CLIENTS_VENV`, default `~/.cache/tidelog/kafka-clients-venv`). Without them a
//! test prints why and passes, unless `KAFKA_CLIENTS_REQUIRE=1` (CI sets it): then it fails.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use common::{cli, free_ports, read_all, BrokerCluster, Proc, FAST_RAFT};
use kafka_protocol::messages::{ApiKey, ApiVersionsRequest, MetadataRequest, RequestHeader};
use kafka_protocol::protocol::{Encodable, StrBytes};
use serde_json::Value;
use tidelog::client::partitioner::partition_for_key;

/// The Kafka clients, or why they are missing.
struct Clients {
    python: PathBuf,
}

fn clients() -> Option<Clients> {
    let venv = common::venv_dir("KAFKA_CLIENTS_VENV", "kafka-clients-venv");
    let python = venv.join("bin/python");
    let why = if Command::new("kcat").arg("-V").output().is_err() {
        Some("kcat is not installed".to_owned())
    } else if !Command::new(&python)
        .args(["-c", "import confluent_kafka, kafka, aiokafka"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        Some(format!(
            "no venv with confluent-kafka, kafka-python and aiokafka at {}",
            venv.display()
        ))
    } else {
        None
    };
    common::available(why, "KAFKA_CLIENTS_REQUIRE", ".ci/kafka-clients")
        .then_some(Clients { python })
}

/// A standalone serving gRPC and Kafka on free ports.
struct Server {
    _proc: Proc,
    grpc: String,
    kafka: String,
    _dir: tempfile::TempDir,
}

fn start() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports(2);
    let (grpc, kafka) = (
        format!("127.0.0.1:{}", ports[0]),
        format!("127.0.0.1:{}", ports[1]),
    );
    let args = vec![
        "--data-dir".to_owned(),
        dir.path().join("data").display().to_string(),
        "--listen".to_owned(),
        grpc.clone(),
        "--kafka-listen".to_owned(),
        kafka.clone(),
    ];
    let mut env = FAST_RAFT.to_vec();
    // Consumer-protocol members of a killed process leave within seconds; a classic
    // group's first generation waits a second for the others.
    env.push(("TIDELOG_GROUP_CONSUMER_SESSION_TIMEOUT_MS", "6000"));
    env.push(("TIDELOG_GROUP_INITIAL_REBALANCE_DELAY_MS", "1000"));
    let proc = Proc::start("standalone", &args, &env, dir.path());
    Server {
        _proc: proc,
        grpc,
        kafka,
        _dir: dir,
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/kafka_clients.py")
}

/// Runs the confluent-kafka helper; returns its stdout lines parsed as JSON.
fn python(c: &Clients, args: &[&str]) -> Vec<Value> {
    let out = Command::new(&c.python)
        .arg(script())
        .args(args)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "kafka_clients.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

/// kcat reading every partition from the beginning to the end, as JSON objects: `-C`
/// without a group, or as a member of `group` (`-G`, committing on exit).
fn kcat_consume(bootstrap: &str, topic: &str, group: Option<&str>) -> Vec<Value> {
    let mut args = vec!["-b", bootstrap];
    match group {
        None => args.extend(["-C", "-t", topic, "-o", "beginning"]),
        Some(g) => args.extend(["-G", g, topic, "-X", "auto.offset.reset=earliest"]),
    }
    args.extend(["-e", "-J", "-q"]);
    let out = Command::new("kcat").args(&args).output().expect("run kcat");
    assert!(
        out.status.success(),
        "kcat {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("kcat json"))
        .collect()
}

/// A consumed record: partition, offset, key, value, headers, timestamp.
type Consumed = (u64, i64, String, String, Vec<(String, String)>, i64);

/// Parses the record lines the Python helper prints.
fn parse_records(lines: &[Value]) -> Vec<Consumed> {
    lines
        .iter()
        .filter(|r| r.get("value").is_some())
        .map(|r| {
            (
                r["partition"].as_u64().unwrap(),
                r["offset"].as_i64().unwrap(),
                r["key"].as_str().unwrap().to_owned(),
                r["value"].as_str().unwrap().to_owned(),
                r["headers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|h| {
                        (
                            h[0].as_str().unwrap().to_owned(),
                            h[1].as_str().unwrap().to_owned(),
                        )
                    })
                    .collect(),
                r["timestamp"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// Records k0..k9999 each once, with value, partition (Kafka's murmur2), timestamp and
/// headers as the producers wrote them.
fn check_10000(records: &[Consumed]) {
    assert_eq!(records.len(), 10_000, "every record once");
    let mut seen = HashSet::new();
    for (partition, offset, key, value, headers, ts) in records {
        let i: i64 = key[1..].parse().unwrap();
        assert!(seen.insert(i), "{key} twice");
        assert_eq!(value, &format!("v{i}"));
        assert_eq!(
            *partition as u32,
            partition_for_key(key.as_bytes(), 6),
            "{key}"
        );
        assert_eq!(*ts, 1_700_000_000_000 + i, "{key} timestamp");
        assert_eq!(
            headers,
            &vec![
                ("h".to_owned(), i.to_string()),
                ("dup".to_owned(), "a".to_owned()),
                ("dup".to_owned(), "b".to_owned()),
            ],
            "{key} headers"
        );
        assert!(*offset >= 0);
    }
}

/// `tidelog groups describe` (gRPC) shows the offsets a Kafka group committed: every
/// partition of `topic` committed up to its log end.
fn assert_group_at_end(s: &Server, group: &str, topic: &str, partitions: usize) {
    let (ok, out, err) = cli(&[
        "groups",
        "describe",
        "--bootstrap",
        &s.grpc,
        "--group",
        group,
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    let d: Value = serde_json::from_str(out.trim()).unwrap();
    let offsets: Vec<&Value> = d["offsets"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["topic"] == topic)
        .collect();
    assert_eq!(offsets.len(), partitions, "{group}: {d}");
    for o in offsets {
        assert_eq!(o["committed_offset"], o["log_end_offset"], "{group}: {o}");
        assert_eq!(o["lag"], 0, "{group}: {o}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confluent_kafka_and_kcat_round_trip_10000_keyed_records() {
    let Some(c) = clients() else { return };
    let s = start();
    python(&c, &["create", &s.kafka, "k6", "6"]);
    let acked = python(&c, &["produce", &s.kafka, "k6", "10000", "none"]);
    assert_eq!(acked.len(), 10_000);
    // Every key where Kafka's default partitioner (murmur2) puts it.
    for a in &acked {
        let key = a["key"].as_str().unwrap();
        assert_eq!(
            a["partition"].as_u64().unwrap() as u32,
            partition_for_key(key.as_bytes(), 6),
            "{key}"
        );
    }
    // A classic-protocol group consumer, committing as it goes.
    let consumed = parse_records(&python(
        &c,
        &["group_consume", &s.kafka, "k6", "cg", "10000", "classic"],
    ));
    check_10000(&consumed);
    assert_group_at_end(&s, "cg", "k6", 6);
    // kcat as a group member (classic protocol); it commits as it leaves.
    let kcat: Vec<Consumed> = kcat_consume(&s.kafka, "k6", Some("kcat-group"))
        .into_iter()
        .map(|r| {
            let h = r["headers"].as_array().cloned().unwrap_or_default();
            (
                r["partition"].as_u64().unwrap(),
                r["offset"].as_i64().unwrap(),
                r["key"].as_str().unwrap().to_owned(),
                r["payload"].as_str().unwrap().to_owned(),
                h.chunks(2)
                    .map(|p| {
                        (
                            p[0].as_str().unwrap().to_owned(),
                            p[1].as_str().unwrap().to_owned(),
                        )
                    })
                    .collect(),
                r["ts"].as_i64().unwrap(),
            )
        })
        .collect();
    check_10000(&kcat);
    assert_group_at_end(&s, "kcat-group", "k6", 6);
    // The acknowledged offsets are where both consumers found the records.
    let acked: BTreeMap<String, (u64, i64)> = acked
        .iter()
        .map(|a| {
            (
                a["key"].as_str().unwrap().to_owned(),
                (
                    a["partition"].as_u64().unwrap(),
                    a["offset"].as_i64().unwrap(),
                ),
            )
        })
        .collect();
    for (p, o, k, ..) in &kcat {
        assert_eq!(acked[k], (*p, *o), "{k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_cross_between_grpc_and_kafka_clients() {
    let Some(_c) = clients() else { return };
    let s = start();
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--bootstrap",
        &s.grpc,
        "--topic",
        "x",
        "--partitions",
        "1",
    ]);
    assert!(ok, "{err}");
    // gRPC in (tidelog's CLI), Kafka out (kcat).
    let mut produce = Command::new(common::binary())
        .args([
            "produce",
            "--bootstrap",
            &s.grpc,
            "--topic",
            "x",
            "--parse-key",
            "--key-separator",
            ":",
            "--header",
            "src=grpc",
            "--acks",
            "all",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let lines: String = (0..50).map(|i| format!("g{i}:value {i}\n")).collect();
    produce
        .stdin
        .take()
        .unwrap()
        .write_all(lines.as_bytes())
        .unwrap();
    assert!(produce.wait().unwrap().success());
    let out = kcat_consume(&s.kafka, "x", None);
    assert_eq!(out.len(), 50);
    for (i, r) in out.iter().enumerate() {
        assert_eq!(r["offset"].as_i64().unwrap(), i as i64);
        assert_eq!(r["key"].as_str().unwrap(), format!("g{i}"));
        assert_eq!(r["payload"].as_str().unwrap(), format!("value {i}"));
        assert_eq!(r["headers"], serde_json::json!(["src", "grpc"]));
    }
    // Kafka in (kcat), gRPC out (tidelog consume).
    let mut kcat = Command::new("kcat")
        .args(["-b", &s.kafka, "-P", "-t", "x", "-K", ":", "-H", "src=kcat"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let lines: String = (0..30).map(|i| format!("c{i}:from kcat {i}\n")).collect();
    kcat.stdin
        .take()
        .unwrap()
        .write_all(lines.as_bytes())
        .unwrap();
    assert!(kcat.wait().unwrap().success());
    let (ok, out, err) = cli(&[
        "consume",
        "--bootstrap",
        &s.grpc,
        "--topic",
        "x",
        "--from-beginning",
        "--output",
        "json",
        "--max-messages",
        "80",
        "--timeout-ms",
        "5000",
    ]);
    assert!(ok, "{err}");
    let records: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 80);
    for (i, r) in records[50..].iter().enumerate() {
        assert_eq!(r["offset"].as_i64().unwrap(), 50 + i as i64);
        assert_eq!(r["key"].as_str().unwrap(), format!("c{i}"));
        assert_eq!(r["value"].as_str().unwrap(), format!("from kcat {i}"));
        assert_eq!(
            r["headers"],
            serde_json::json!([{"key": "src", "value": "kcat"}])
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_python_and_aiokafka_create_produce_and_consume_in_groups() {
    let Some(c) = clients() else { return };
    let s = start();
    for client in ["kafka-python", "aiokafka"] {
        let topic = format!("t-{client}");
        let out = python(&c, &["roundtrip", client, &s.kafka, &topic, "10000"]);
        let acks: Vec<&Value> = out.iter().filter(|l| l.get("ack").is_some()).collect();
        assert_eq!(acks.len(), 10_000, "{client}: every record acknowledged");
        for a in &acks {
            let key = a["ack"].as_str().unwrap();
            assert_eq!(
                a["partition"].as_u64().unwrap() as u32,
                partition_for_key(key.as_bytes(), 6),
                "{client}: {key} in the partition Kafka's partitioner picks"
            );
        }
        check_10000(&parse_records(&out));
        assert_group_at_end(&s, &format!("{client}-group"), &topic, 6);
    }
}

/// One running group member (the Python helper's `member`), its output read as it comes.
struct Member {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<Value>,
    seen: Vec<Value>,
}

impl Member {
    fn start(c: &Clients, bootstrap: &str, topic: &str, group: &str, protocol: &str) -> Member {
        let mut child = Command::new(&c.python)
            .arg(script())
            .args(["member", bootstrap, topic, group, protocol, "10"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start member");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
            }
        });
        Member {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    fn drain(&mut self) {
        self.seen.extend(self.lines.try_iter());
    }

    fn records(&self) -> impl Iterator<Item = (u64, i64)> + '_ {
        self.seen
            .iter()
            .filter(|v| v.get("key").is_some())
            .map(|v| {
                (
                    v["partition"].as_u64().unwrap(),
                    v["offset"].as_i64().unwrap(),
                )
            })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_group_members_share_a_topic_and_lose_nothing_when_one_is_killed() {
    let Some(c) = clients() else { return };
    let s = start();
    for protocol in ["classic", "consumer"] {
        let topic = format!("shared-{protocol}");
        let group = format!("three-{protocol}");
        python(&c, &["create", &s.kafka, &topic, "6"]);
        let acked = python(&c, &["produce", &s.kafka, &topic, "6000", "none"]);
        assert_eq!(acked.len(), 6000);
        let all: HashSet<(u64, i64)> = acked
            .iter()
            .map(|a| {
                (
                    a["partition"].as_u64().unwrap(),
                    a["offset"].as_i64().unwrap(),
                )
            })
            .collect();
        let mut members: Vec<Member> = (0..3)
            .map(|_| Member::start(&c, &s.kafka, &topic, &group, protocol))
            .collect();
        // Kill one member once it has processed a share of the records.
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        loop {
            members[0].drain();
            if members[0].records().count() >= 300 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{protocol}: member 0 never got 300 records: {:?}",
                members[0].seen.iter().take(5).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        members[0].child.kill().unwrap();
        members[0].child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        members[0].drain();
        for m in &mut members[1..] {
            assert!(
                m.child.wait().unwrap().success(),
                "{protocol}: a member failed"
            );
            m.drain();
        }
        // At least once: together they read every record.
        let read: HashSet<(u64, i64)> = members.iter().flat_map(|m| m.records()).collect();
        let missing: Vec<_> = all.difference(&read).take(5).collect();
        assert!(missing.is_empty(), "{protocol}: never read {missing:?}");
        // Nothing lost: what the killed member read past its last commit of a partition,
        // a survivor read again.
        let mut committed: BTreeMap<u64, i64> = BTreeMap::new();
        for v in &members[0].seen {
            if let Some(pc) = v.get("committed") {
                committed.insert(pc[0].as_u64().unwrap(), pc[1].as_i64().unwrap());
            }
        }
        let survivors: HashSet<(u64, i64)> =
            members[1..].iter().flat_map(|m| m.records()).collect();
        // (The kill may land between a commit and its line: the last record the killed
        // member printed of a partition may be committed without our knowing.)
        let mut last: BTreeMap<u64, i64> = BTreeMap::new();
        for (p, o) in members[0].records() {
            last.insert(p, o);
        }
        for (p, o) in members[0].records() {
            let c = committed.get(&p).copied().unwrap_or(0);
            let maybe_committed = o == c && last.get(&p) == Some(&o);
            if o >= c && !maybe_committed {
                assert!(
                    survivors.contains(&(p, o)),
                    "{protocol}: {p}@{o} was read but not committed by the killed member (its last commit of {p}: {c}), and no survivor read it"
                );
            }
        }
        assert!(
            members[1..].iter().all(|m| m.records().count() > 0),
            "{protocol}: every survivor took part"
        );
        assert_group_at_end(&s, &group, &topic, 6);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_committed_over_grpc_are_seen_by_kafka_clients() {
    let Some(c) = clients() else { return };
    let s = start();
    python(&c, &["create", &s.kafka, "cross", "3"]);
    python(&c, &["produce", &s.kafka, "cross", "300", "none"]);
    // tidelog's group consumer reads 120 records and commits them.
    let (ok, out, err) = cli(&[
        "consume",
        "--bootstrap",
        &s.grpc,
        "--topic",
        "cross",
        "--group",
        "shared",
        "--from-beginning",
        "--max-messages",
        "120",
        "--timeout-ms",
        "10000",
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 120);
    let (ok, out, err) = cli(&[
        "groups",
        "describe",
        "--bootstrap",
        &s.grpc,
        "--group",
        "shared",
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    let d: Value = serde_json::from_str(out.trim()).unwrap();
    let grpc: BTreeMap<i64, i64> = d["offsets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                o["partition"].as_i64().unwrap(),
                o["committed_offset"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(grpc.values().sum::<i64>(), 120, "{d}");
    // A Kafka client's OffsetFetch sees the same offsets.
    let kafka: BTreeMap<i64, i64> = python(&c, &["committed", &s.kafka, "shared", "cross", "3"])
        .iter()
        .filter(|v| v["offset"].as_i64().unwrap() >= 0)
        .map(|v| {
            (
                v["partition"].as_i64().unwrap(),
                v["offset"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(kafka, grpc);
    // And a Kafka group member carries on from there: exactly the other 180 records.
    let rest = python(
        &c,
        &[
            "group_consume",
            &s.kafka,
            "cross",
            "shared",
            "180",
            "classic",
        ],
    );
    assert_eq!(rest.len(), 180);
    for r in &rest {
        let (p, o) = (
            r["partition"].as_i64().unwrap(),
            r["offset"].as_i64().unwrap(),
        );
        assert!(
            o >= grpc.get(&p).copied().unwrap_or(0),
            "{p}@{o} was already committed"
        );
    }
    assert_group_at_end(&s, "shared", "cross", 3);
    // The Kafka side lists and describes the group, then deletes it once empty.
    let groups = python(&c, &["groups", &s.kafka, "shared"]);
    assert_eq!(
        groups[0]["listed"],
        serde_json::json!(["shared"]),
        "{groups:?}"
    );
    assert_eq!(groups[1]["state"], "EMPTY", "{groups:?}");
    assert_eq!(groups[2]["deleted"], true, "{groups:?}");
    let (ok, _, err) = cli(&[
        "groups",
        "describe",
        "--bootstrap",
        &s.grpc,
        "--group",
        "shared",
    ]);
    assert!(!ok && err.contains("GROUP_ID_NOT_FOUND"), "{err}");
}

/// The leader of `topic`-0, from `topics describe`.
fn leader_of(c: &BrokerCluster, topic: &str) -> Option<i32> {
    let live: Vec<String> = (1..=3)
        .filter(|id| c.brokers[*id as usize - 1].is_some())
        .map(|id| c.broker_address(id))
        .collect();
    let (ok, out, _) = cli(&[
        "topics",
        "describe",
        "--bootstrap",
        &live.join(","),
        "--topic",
        topic,
        "--output",
        "json",
    ]);
    if !ok {
        return None;
    }
    let v: Value = serde_json::from_str(out.trim()).ok()?;
    v["topics"][0]["partitions"][0]["leader"]
        .as_i64()
        .map(|l| l as i32)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_kafka_producer_loses_and_duplicates_nothing_when_leaders_die() {
    let Some(c) = clients() else { return };
    let mut cluster = BrokerCluster::start(3);
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--bootstrap",
        &cluster.bootstrap().join(","),
        "--topic",
        "durable",
        "--partitions",
        "1",
        "--replication-factor",
        "3",
        "--config",
        "min.insync.replicas=2",
    ]);
    assert!(ok, "{err}");
    let bootstrap: Vec<String> = (1..=3).map(|id| cluster.broker_kafka_address(id)).collect();
    let n = 20_000;
    let mut producer = Command::new(&c.python)
        .arg(script())
        .args([
            "produce_through_failures",
            &bootstrap.join(","),
            "durable",
            &n.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = producer.stdout.take().unwrap();
    let (tx, acks) = std::sync::mpsc::channel::<Value>();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if let Ok(v) = serde_json::from_str(&line) {
                let _ = tx.send(v);
            }
        }
    });
    let mut acked: Vec<Value> = Vec::new();
    // Twice: once some records are acknowledged, kill -9 the leader, then restart it.
    for round in 1..=2 {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while acked.len() < round * n / 3 {
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: acks stalled at {}",
                acked.len()
            );
            acked.extend(acks.recv_timeout(Duration::from_secs(60)).ok());
        }
        let leader = leader_of(&cluster, "durable").expect("a leader");
        cluster.brokers[leader as usize - 1]
            .as_mut()
            .unwrap()
            .kill9();
        cluster.brokers[leader as usize - 1] = None;
        // Another replica takes over while the producer keeps sending.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if leader_of(&cluster, "durable").is_some_and(|l| l != leader) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: no new leader"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        cluster.start_broker(leader);
    }
    let status = producer.wait().unwrap();
    acked.extend(acks.try_iter());
    let mut err = String::new();
    producer
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "producer failed: {err}");
    assert_eq!(acked.len(), n, "every record acknowledged");
    // Read back from whoever leads now, once all three replicas are in sync again.
    let records = read_all(&cluster.bootstrap(), "durable", 1).await;
    let values: Vec<u64> = records.iter().map(|(_, _, v)| v.parse().unwrap()).collect();
    let offsets: BTreeMap<u64, i64> = records
        .iter()
        .map(|(_, o, v)| (v.parse().unwrap(), *o))
        .collect();
    assert_eq!(
        values.len(),
        n,
        "exactly once: no record lost, none written twice"
    );
    assert!(
        values.windows(2).all(|w| w[0] < w[1]),
        "in the order they were sent"
    );
    for a in &acked {
        let i = a["ack"].as_u64().unwrap();
        assert_eq!(
            offsets.get(&i),
            Some(&a["offset"].as_i64().unwrap()),
            "record {i} at its acknowledged offset"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_admin_clients_alter_configs_delete_records_and_set_group_offsets() {
    let Some(c) = clients() else { return };
    let s = start();
    python(&c, &["create", &s.kafka, "adm", "2"]);
    python(&c, &["produce", &s.kafka, "adm", "400", "none"]);
    let out = python(&c, &["admin", &s.kafka, "adm"]);
    let out0 = out.clone();
    assert_eq!(out.len(), 5, "{out:?}");
    assert_eq!(out[0]["retention.ms"], "3600000", "{out:?}");
    assert_eq!(
        out[0]["bad"], "INVALID_CONFIG",
        "an invalid value is refused"
    );
    assert_eq!(out[1]["nodes"], 1);
    assert_eq!(out[2]["elect"]["adm-0"], "ELECTION_NOT_NEEDED");
    assert_eq!(out[3]["low_watermark"]["0"], 40);
    assert_eq!(out[3]["earliest"]["0"], 40);
    assert_eq!(out[4]["group_offsets"]["1"], 77);
    // The gRPC side sees the same topic config, log start and group offset.
    let (ok, out, err) = cli(&[
        "topics",
        "describe",
        "--bootstrap",
        &s.grpc,
        "--topic",
        "adm",
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    let d: Value = serde_json::from_str(out.trim()).unwrap();
    let t = &d["topics"][0];
    assert_eq!(t["config"]["retention.ms"], "3600000", "{t}");
    assert_eq!(t["partitions"][0]["log_start_offset"], 40, "{t}");
    // The producer's timestamps grow: partition 1's largest is its last record.
    let end1 = t["partitions"][1]["high_watermark"].as_i64().unwrap();
    assert_eq!(out0[3]["max_timestamp"][0], end1 - 1, "{out0:?}");
    assert!(out0[3]["max_timestamp"][1].as_i64().unwrap() >= 1_700_000_000_000);
    let (ok, out, err) = cli(&[
        "groups",
        "describe",
        "--bootstrap",
        &s.grpc,
        "--group",
        "admin-group",
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    let d: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(d["offsets"][0]["committed_offset"], 77, "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_compression_codec_from_librdkafka_reads_back_over_grpc() {
    let Some(c) = clients() else { return };
    let s = start();
    for codec in ["gzip", "snappy", "lz4", "zstd"] {
        let topic = format!("z-{codec}");
        python(&c, &["create", &s.kafka, &topic, "2"]);
        let acked = python(&c, &["produce", &s.kafka, &topic, "500", codec]);
        assert_eq!(acked.len(), 500, "{codec}");
        let records = read_all(std::slice::from_ref(&s.grpc), &topic, 2).await;
        let values: HashSet<String> = records.into_iter().map(|(_, _, v)| v).collect();
        let expected: HashSet<String> = (0..500).map(|i| format!("v{i}")).collect();
        assert_eq!(values, expected, "{codec}");
        // The reverse: tidelog's producer compresses, librdkafka (kcat) decompresses.
        let back = format!("back-{codec}");
        let (ok, _, err) = cli(&[
            "topics",
            "create",
            "--bootstrap",
            &s.grpc,
            "--topic",
            &back,
            "--partitions",
            "2",
        ]);
        assert!(ok, "{err}");
        let (ok, _, err) = cli(&[
            "perf",
            "produce",
            "--bootstrap",
            &s.grpc,
            "--topic",
            &back,
            "--num-records",
            "500",
            "--record-size",
            "100",
            "--compression",
            codec,
        ]);
        assert!(ok, "{codec}: {err}");
        let read = kcat_consume(&s.kafka, &back, None);
        assert_eq!(read.len(), 500, "{codec}: kcat read every record");
        assert!(
            read.iter().all(|r| r["payload"]
                .as_str()
                .is_some_and(|p| p.len() == 100 && p.starts_with("abcdefghijklmnopqrstuvwxyz"))),
            "{codec}: payloads intact"
        );
    }
}

/// A request frame (size prefix included) as a Kafka client encodes it.
fn request<R: Encodable>(api: ApiKey, version: i16, correlation_id: i32, body: &R) -> Vec<u8> {
    let header = RequestHeader::default()
        .with_request_api_key(api as i16)
        .with_request_api_version(version)
        .with_correlation_id(correlation_id)
        .with_client_id(Some(StrBytes::from_static_str("raw")));
    let mut payload = BytesMut::new();
    header
        .encode(&mut payload, api.request_header_version(version))
        .unwrap();
    body.encode(&mut payload, version).unwrap();
    let mut out = BytesMut::new();
    out.put_i32(payload.len() as i32);
    out.extend_from_slice(&payload);
    out.to_vec()
}

/// Reads one response frame; returns its correlation id.
fn read_response(stream: &mut TcpStream) -> std::io::Result<i32> {
    let mut size = [0u8; 4];
    stream.read_exact(&mut size)?;
    let mut body = vec![0u8; i32::from_be_bytes(size) as usize];
    stream.read_exact(&mut body)?;
    Ok(i32::from_be_bytes([body[0], body[1], body[2], body[3]]))
}

/// True once the server has closed `stream` (reads hit the end or an error).
fn closed_by_server(stream: &mut TcpStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 64];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                )
            }
        }
    }
}

#[test]
fn bad_frames_close_their_connection_only() {
    // Raw frames need no Kafka client: this test always runs.
    let s = start();
    let connect = || {
        let c = TcpStream::connect(&s.kafka).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c
    };
    // A well-behaved connection, kept open throughout; pipelined requests are answered
    // in order.
    let mut good = connect();
    let mut both = request(ApiKey::ApiVersions, 3, 1, &ApiVersionsRequest::default());
    both.extend(request(
        ApiKey::Metadata,
        12,
        2,
        &MetadataRequest::default(),
    ));
    good.write_all(&both).unwrap();
    assert_eq!(read_response(&mut good).unwrap(), 1);
    assert_eq!(read_response(&mut good).unwrap(), 2);

    // A too-new ApiVersions is answered (v0 body, UNSUPPORTED_VERSION), not closed.
    let mut c = connect();
    // (kafka-protocol cannot encode v99: the frame by hand, header v2 with no client id.)
    c.write_all(&[0, 0, 0, 11, 0, 18, 0, 99, 0, 0, 0, 5, 0xff, 0xff, 0])
        .unwrap();
    let mut size = [0u8; 4];
    c.read_exact(&mut size).unwrap();
    let mut body = vec![0u8; i32::from_be_bytes(size) as usize];
    c.read_exact(&mut body).unwrap();
    assert_eq!(&body[..4], &5i32.to_be_bytes());
    assert_eq!(&body[4..6], &35i16.to_be_bytes(), "UNSUPPORTED_VERSION");

    let mut random = vec![0u8; 4096];
    let mut x: u32 = 0x9e37_79b9;
    for b in random.iter_mut() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *b = x as u8;
    }
    let mut truncated = request(ApiKey::Metadata, 12, 3, &MetadataRequest::default());
    truncated[3] += 40; // the size prefix claims 40 bytes that never come
    let mut unknown_api = request(ApiKey::Metadata, 1, 4, &MetadataRequest::default());
    unknown_api[4..6].copy_from_slice(&1000i16.to_be_bytes());
    let mut group_api = request(ApiKey::Metadata, 1, 4, &MetadataRequest::default());
    group_api[4..6].copy_from_slice(&(ApiKey::JoinGroup as i16).to_be_bytes());
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        ("random bytes", random, false),
        (
            "2 GiB size prefix",
            vec![0x7f, 0xff, 0xff, 0xff, 0, 3, 0, 1],
            false,
        ),
        (
            "negative size prefix",
            vec![0xff, 0xff, 0xff, 0xff, 0, 3],
            false,
        ),
        ("truncated request", truncated, true),
        ("unknown API key", unknown_api, false),
        ("unadvertised API (JoinGroup)", group_api, false),
        (
            "malformed body",
            vec![0, 0, 0, 10, 0, 3, 0, 1, 0, 0, 0, 9, 0xff, 0x7f],
            false,
        ),
    ];
    for (what, bytes, half_close) in cases {
        let mut c = connect();
        let _ = c.write_all(&bytes);
        if half_close {
            let _ = c.shutdown(std::net::Shutdown::Write);
        }
        assert!(closed_by_server(&mut c), "{what}: the server closes it");
        // The good connection still works.
        good.write_all(&request(
            ApiKey::Metadata,
            9,
            10,
            &MetadataRequest::default(),
        ))
        .unwrap();
        assert_eq!(read_response(&mut good).unwrap(), 10, "after {what}");
    }
    // And new connections are served.
    let mut fresh = connect();
    fresh
        .write_all(&request(
            ApiKey::ApiVersions,
            0,
            11,
            &ApiVersionsRequest::default(),
        ))
        .unwrap();
    assert_eq!(read_response(&mut fresh).unwrap(), 11);
}

#[test]
fn a_taken_kafka_port_stops_the_server_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let kafka = taken.local_addr().unwrap().to_string();
    let port = free_ports(1)[0];
    let (ok, exited, err, _) = common::run_to_exit(
        &[
            "standalone",
            "--data-dir",
            dir.path().to_str().unwrap(),
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--kafka-listen",
            &kafka,
        ],
        &[],
        Duration::from_secs(20),
    );
    assert!(exited && !ok, "a taken Kafka port stops the process");
    assert!(err.contains("Kafka") && err.contains(&kafka), "{err}");
}

/// kcat with `client.rack=b` reading `topic` from `offset` to the end (`-e`), with
/// `auto.offset.reset=earliest`: the values it printed, sorted. Killed after 60 s (a
/// consumer sent back and forth between a leader and a follower never reaches the end).
fn kcat_from_rack_b(kafka: &str, topic: &str, offset: &str) -> Vec<String> {
    let mut child = Command::new("kcat")
        .args([
            "-b",
            kafka,
            "-C",
            "-t",
            topic,
            "-o",
            offset,
            "-e",
            "-q",
            "-f",
            "%s\n",
            "-X",
            "client.rack=b",
            "-X",
            "auto.offset.reset=earliest",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kcat");
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kcat -o {offset} with client.rack=b did not reach the end in 60 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut got: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    got.sort();
    got
}

/// Fetch from a follower with a real Kafka client (KIP-392): brokers in racks a, b, c, a
/// topic with a replica of each partition on every broker; kcat with `client.rack=b`
/// reads every record, nearly all of it from broker 2 (the leaders name it as the
/// preferred read replica), which `tidelog_bytes_out_total` shows. After DeleteRecords
/// moved every log start, kcat at offset 0 is told OFFSET_OUT_OF_RANGE (by the leader,
/// not sent to the follower) and resets to the earliest offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kcat_with_a_rack_reads_from_the_follower_in_its_rack() {
    let Some(clients) = clients() else { return };
    let c = BrokerCluster::build_in_racks(1, 3, &[], false, &["a", "b", "c"]);
    let grpc = c.bootstrap().join(",");
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--bootstrap",
        &grpc,
        "--topic",
        "near",
        "--partitions",
        "3",
        "--replication-factor",
        "3",
    ]);
    assert!(ok, "{err}");
    // Keyed, so every partition gets about a third (DeleteRecords below cuts 100 each).
    let input: String = (0..3000).map(|i| format!("k{i}\tvalue-{i}\n")).collect();
    let mut produce = Command::new(common::binary())
        .args([
            "produce",
            "--topic",
            "near",
            "--parse-key",
            "--acks",
            "all",
            "--bootstrap",
            &grpc,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    produce
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = produce.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    common::eventually("every replica in sync", Duration::from_secs(30), || async {
        let (ok, out, _) = cli(&[
            "topics",
            "describe",
            "--topic",
            "near",
            "--output",
            "json",
            "--bootstrap",
            &grpc,
        ]);
        let v: Value = serde_json::from_str(&out).ok().filter(|_| ok)?;
        v["topics"][0]["partitions"]
            .as_array()?
            .iter()
            .all(|p| p["isr"].as_array().is_some_and(|i| i.len() == 3))
            .then_some(())
    })
    .await;
    let kafka: Vec<String> = (1..=3).map(|id| c.broker_kafka_address(id)).collect();
    let kafka = kafka.join(",");
    let got = kcat_from_rack_b(&kafka, "near", "beginning");
    let mut want: Vec<String> = (0..3000).map(|i| format!("value-{i}")).collect();
    want.sort();
    assert_eq!(got, want, "every record once");
    let served: Vec<f64> = common::bytes_out_per_broker(&c, "near");
    let total: f64 = served.iter().sum();
    assert!(
        served[1] > 3000.0 * 10.0 && served[1] >= 0.9 * total,
        "broker 2 (rack b) served kcat in rack b: {served:?}"
    );

    let low = python(&clients, &["delete_records", &kafka, "near", "3", "100"]);
    assert_eq!(low[0], serde_json::json!({"0": 100, "1": 100, "2": 100}));
    // Followers take the new log start from their next fetch.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let got = kcat_from_rack_b(&kafka, "near", "0");
    assert_eq!(
        got.len(),
        3000 - 300,
        "reset to the log start of each partition"
    );
}

/// Kafka clients schedule records with the reserved `tidelog.delay.ms` header: kcat's
/// records stay invisible until due, then arrive once each with their original timestamp;
/// an idempotent producer's scheduled batch is refused and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_clients_schedule_records_with_the_delay_header() {
    let Some(_clients) = clients() else { return };
    let s = start();
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--bootstrap",
        &s.grpc,
        "--topic",
        "later",
        "--partitions",
        "2",
    ]);
    assert!(ok, "{err}");
    let input: String = (0..20).map(|i| format!("late-{i}\n")).collect();
    let sent = std::time::Instant::now();
    let mut child = Command::new("kcat")
        .args([
            "-P",
            "-b",
            &s.kafka,
            "-t",
            "later",
            "-H",
            "tidelog.delay.ms=2000",
            "-q",
        ])
        .stdin(Stdio::piped())
        .spawn()
        .expect("kcat");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "kcat -P failed");
    if sent.elapsed() < Duration::from_millis(1500) {
        assert!(
            kcat_consume(&s.kafka, "later", None).is_empty(),
            "scheduled records were visible before they were due"
        );
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let records = loop {
        let r = kcat_consume(&s.kafka, "later", None);
        if r.len() >= 20 || std::time::Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(sent.elapsed() >= Duration::from_secs(2));
    let mut values: Vec<String> = records
        .iter()
        .map(|r| r["payload"].as_str().unwrap().to_owned())
        .collect();
    values.sort();
    let mut expected: Vec<String> = (0..20).map(|i| format!("late-{i}")).collect();
    expected.sort();
    assert_eq!(values, expected, "each scheduled record exactly once");
    let headers = records[0]["headers"].as_array().expect("headers").clone();
    let names: Vec<&str> = headers
        .iter()
        .step_by(2)
        .filter_map(|h| h.as_str())
        .collect();
    assert!(
        names.contains(&"tidelog.delay.original.timestamp") && !names.contains(&"tidelog.delay.ms"),
        "{headers:?}"
    );

    // An idempotent producer cannot schedule (its sequence would skip the records):
    // kcat reports the failure and nothing arrives.
    let out = Command::new("sh")
        .args([
            "-c",
            &format!(
                "echo idem | kcat -P -b {} -t later -H tidelog.delay.ms=10 -X enable.idempotence=true 2>&1",
                s.kafka
            ),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    // Kafka's INVALID_RECORD, as librdkafka words it.
    assert!(text.contains("failed to validate record"), "{text}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(kcat_consume(&s.kafka, "later", None).len(), 20);
}

/// Transactions from librdkafka: an aborted transaction is invisible to read-committed
/// readers (tidelog's and kcat's), and an exactly-once copy (a read-committed group
/// consumer plus a transactional producer committing the group's offsets in each
/// transaction) copies every record once, with the group at the end afterwards; the
/// transactions show in `tidelog transactions list`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confluent_kafka_transactions_copy_exactly_once_and_abort() {
    let Some(c) = clients() else { return };
    let s = start();
    python(&c, &["create", &s.kafka, "eos-in", "3"]);
    python(&c, &["create", &s.kafka, "eos-out", "3"]);
    python(&c, &["produce", &s.kafka, "eos-in", "600", "none"]);
    let aborted = python(&c, &["txn_abort", &s.kafka, "eos-in", "30"]);
    assert_eq!(aborted[0]["aborted"], 30);
    let copied = python(
        &c,
        &[
            "eos_copy",
            &s.kafka,
            "eos-in",
            "eos-out",
            "eos",
            "py-copier",
            "4",
        ],
    );
    // The copier read committed: the aborted records never reached it.
    assert_eq!(copied[0]["copied"], 600, "{copied:?}");
    assert!(copied[0]["transactions"].as_i64().unwrap() >= 1);
    assert_group_at_end(&s, "eos", "eos-in", 3);
    // Every input record exactly once, in the same partition and order.
    let input = read_all(std::slice::from_ref(&s.grpc), "eos-in", 3).await;
    let committed_input: Vec<(u32, String)> = input
        .iter()
        .filter(|(_, _, v)| !v.starts_with("aborted-"))
        .map(|(p, _, v)| (*p, v.clone()))
        .collect();
    assert_eq!(committed_input.len(), 600);
    assert_eq!(
        input.len(),
        630,
        "read_uncommitted sees the aborted records"
    );
    let mut reader =
        tidelog::client::consumer::Consumer::new(vec![s.grpc.clone()], Duration::from_secs(20));
    reader.set_read_committed(true);
    let mut output: Vec<(u32, String)> = Vec::new();
    for p in 0..3 {
        reader
            .assign("eos-out", p, tidelog::client::consumer::StartAt::Earliest)
            .await
            .unwrap();
    }
    let mut idle = 0;
    while idle < 4 {
        let batch = reader.poll(Duration::from_millis(300)).await.unwrap();
        idle = if batch.is_empty() { idle + 1 } else { 0 };
        output.extend(batch.into_iter().map(|r| {
            (
                r.partition,
                String::from_utf8_lossy(&r.value.unwrap()).into_owned(),
            )
        }));
    }
    // Per partition in offset order (stable sorts keep each partition's order).
    output.sort_by_key(|(p, _)| *p);
    let mut want = committed_input.clone();
    want.sort_by_key(|(p, _)| *p);
    assert_eq!(output, want);
    // kcat reading committed sees no aborted record of the input.
    let out = Command::new("kcat")
        .args([
            "-b",
            &s.kafka,
            "-C",
            "-t",
            "eos-in",
            "-o",
            "beginning",
            "-e",
            "-q",
            "-X",
            "isolation.level=read_committed",
            "-f",
            "%s\\n",
        ])
        .output()
        .expect("run kcat");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 600);
    assert!(!text.contains("aborted-"));
    // Both transactional ids are known to the coordinator, each's last transaction
    // ended as it should.
    let (ok, out, err) = cli(&[
        "transactions",
        "list",
        "--bootstrap",
        &s.grpc,
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    let list: Value = serde_json::from_str(out.trim()).unwrap();
    let state_of = |id: &str| {
        list["transactions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["transactional_id"] == id)
            .map(|t| t["state"].as_str().unwrap().to_owned())
    };
    assert_eq!(
        state_of("py-aborter").as_deref(),
        Some("CompleteAbort"),
        "{list}"
    );
    assert_eq!(
        state_of("py-copier").as_deref(),
        Some("CompleteCommit"),
        "{list}"
    );
}
