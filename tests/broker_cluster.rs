//! Brokers and standalone as real processes: produce and consume through the CLI and the
//! Rust client, partitions spread over brokers, kill -9 of a broker under load, whole
//! cluster restarts, and bad input.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{binary, cli, eventually, free_ports, read_all, standalone, BrokerCluster};
use tidelog::api::proto::broker_client::BrokerClient;
use tidelog::api::proto::{
    FetchPartition, FetchRequest, FetchTopic, PartitionProduceData, ProduceRequest, Record,
    TopicProduceData,
};
use tidelog::client::consumer::Consumer;
use tidelog::client::partitioner::partition_for_key;
use tidelog::client::producer::{Producer, ProducerConfig, ProducerRecord};
use tidelog::error_code::ErrorCode;

/// Runs `tidelog produce` with `input` on stdin; returns (success, stdout, stderr).
fn produce_cli(args: &[&str], input: &str) -> (bool, String, String) {
    let mut child = Command::new(binary())
        .arg("produce")
        .args(args)
        .env_remove("TIDELOG_BOOTSTRAP")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn standalone_round_trips_10000_keyed_records_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let mut server = standalone(dir.path(), port);
    let b = format!("127.0.0.1:{port}");
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--topic",
        "events",
        "--partitions",
        "3",
        "--bootstrap",
        &b,
    ]);
    assert!(ok, "{err}");
    let input: String = (0..10_000)
        .map(|i| format!("key-{}\tvalue-{i}\n", i % 500))
        .collect();
    let (ok, out, err) = produce_cli(
        &[
            "--topic",
            "events",
            "--parse-key",
            "--output",
            "json",
            "--bootstrap",
            &b,
        ],
        &input,
    );
    assert!(ok, "produce failed: {err}");
    let acks = json_lines(&out);
    assert_eq!(acks.len(), 10_000);

    let consume = |b: &str| {
        let (ok, out, err) = cli(&[
            "consume",
            "--topic",
            "events",
            "--from-beginning",
            "--timeout-ms",
            "2000",
            "--output",
            "json",
            "--bootstrap",
            b,
        ]);
        assert!(ok, "consume failed: {err}");
        json_lines(&out)
    };
    let check = |records: &[serde_json::Value]| {
        assert_eq!(records.len(), 10_000);
        let mut values = BTreeSet::new();
        let mut offsets: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for r in records {
            let value = r["value"].as_str().unwrap().to_owned();
            let key = r["key"].as_str().unwrap();
            let partition = r["partition"].as_u64().unwrap();
            assert_eq!(
                partition as u32,
                partition_for_key(key.as_bytes(), 3),
                "{key} is placed as Kafka's partitioner places it"
            );
            assert!(values.insert(value.clone()), "{value} delivered twice");
            offsets
                .entry(partition)
                .or_default()
                .push(r["offset"].as_u64().unwrap());
        }
        for (p, mut list) in offsets {
            list.sort_unstable();
            let expected: Vec<u64> = (0..list.len() as u64).collect();
            assert_eq!(
                list, expected,
                "partition {p} offsets are contiguous from 0"
            );
        }
    };
    check(&consume(&b));
    // Acknowledged offsets are where the records are.
    let records = consume(&b);
    let at: BTreeMap<(u64, u64), String> = records
        .iter()
        .map(|r| {
            (
                (
                    r["partition"].as_u64().unwrap(),
                    r["offset"].as_u64().unwrap(),
                ),
                r["value"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    for (i, a) in acks.iter().enumerate() {
        let key = (
            a["partition"].as_u64().unwrap(),
            a["offset"].as_u64().unwrap(),
        );
        assert_eq!(at[&key], format!("value-{i}"));
    }
    // A clean restart keeps everything.
    let status = server.terminate();
    assert!(status.success(), "{}", server.stderr_tail());
    let _server = standalone(dir.path(), port);
    check(&consume(&b));
}

async fn wait_all_partitions_led(bootstrap: &[String], topic: &str, partitions: usize) {
    let consumer = Consumer::new(bootstrap.to_vec(), Duration::from_secs(5));
    eventually(
        "every partition has a leader",
        Duration::from_secs(30),
        || {
            let c = &consumer;
            async move {
                let n = c.partition_count(topic).await.ok()?;
                (n as usize == partitions).then_some(())
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_brokers_serve_a_twelve_partition_topic_through_any_bootstrap() {
    let c = BrokerCluster::start(3);
    let b1 = c.broker_address(1);
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--topic",
        "wide",
        "--partitions",
        "12",
        "--bootstrap",
        &b1,
    ]);
    assert!(ok, "{err}");
    let (ok, out, _) = cli(&[
        "topics",
        "describe",
        "--topic",
        "wide",
        "--output",
        "json",
        "--bootstrap",
        &b1,
    ]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let leaders: BTreeMap<i64, usize> = v["topics"][0]["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .fold(BTreeMap::new(), |mut m, p| {
            *m.entry(p["leader"].as_i64().unwrap()).or_default() += 1;
            m
        });
    assert_eq!(
        leaders.values().copied().collect::<Vec<_>>(),
        vec![4, 4, 4],
        "{leaders:?}"
    );
    wait_all_partitions_led(&c.bootstrap(), "wide", 12).await;

    // Produce through broker 1 only; the client finds each partition's leader.
    let input: String = (0..3000).map(|i| format!("k{i}\tv{i}\n")).collect();
    let (ok, out, err) = produce_cli(
        &[
            "--topic",
            "wide",
            "--parse-key",
            "--output",
            "json",
            "--bootstrap",
            &b1,
        ],
        &input,
    );
    assert!(ok, "{err}");
    assert_eq!(json_lines(&out).len(), 3000);
    // Consume through broker 3 only.
    let b3 = c.broker_address(3);
    let (ok, out, err) = cli(&[
        "consume",
        "--topic",
        "wide",
        "--from-beginning",
        "--timeout-ms",
        "2000",
        "--output",
        "json",
        "--bootstrap",
        &b3,
    ]);
    assert!(ok, "{err}");
    let got: BTreeSet<String> = json_lines(&out)
        .iter()
        .map(|r| r["value"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(got.len(), 3000);

    // A broker that does not lead a partition says who does.
    let meta = v["topics"][0]["partitions"][0].clone();
    let leader = meta["leader"].as_i64().unwrap() as i32;
    let other = (1..=3).find(|b| *b != leader).unwrap();
    let mut client = BrokerClient::connect(format!("http://{}", c.broker_address(other)))
        .await
        .unwrap();
    let produce = |topic: &str, partition: u32, value: Vec<u8>| ProduceRequest {
        transactional_id: None,
        acks: Some(1),
        timeout_ms: 1000,
        topics: vec![TopicProduceData {
            topic: topic.to_owned(),
            partitions: vec![PartitionProduceData {
                partition,
                records: vec![Record {
                    value: Some(value.into()),
                    ..Default::default()
                }],
                ..Default::default()
            }],
        }],
    };
    let r = client
        .produce(produce("wide", 0, b"x".to_vec()))
        .await
        .unwrap()
        .into_inner();
    let p = &r.topics[0].partitions[0];
    assert_eq!(
        p.error_code,
        tidelog::api::proto::ErrorCode::NotLeaderOrFollower as i32,
        "{p:?}"
    );
    assert_eq!(p.leader_id, Some(leader));
    assert_eq!(
        p.leader_address.as_deref(),
        Some(c.broker_address(leader).as_str())
    );

    // Bad input: each a clear code, nothing written, the broker keeps serving.
    let mut lead = BrokerClient::connect(format!("http://{}", c.broker_address(leader)))
        .await
        .unwrap();
    let unknown = lead
        .produce(produce("nope", 0, b"x".to_vec()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        unknown.topics[0].partitions[0].error_code,
        tidelog::api::proto::ErrorCode::UnknownTopicOrPartition as i32
    );
    let huge = lead
        .produce(produce("wide", 0, vec![7u8; 2 * 1024 * 1024]))
        .await
        .unwrap()
        .into_inner();
    let hp = &huge.topics[0].partitions[0];
    assert_eq!(
        hp.error_code,
        tidelog::api::proto::ErrorCode::RecordTooLarge as i32,
        "{hp:?}"
    );
    assert!(
        hp.error_message.contains("max.message.bytes"),
        "{}",
        hp.error_message
    );
    let empty = lead
        .produce(ProduceRequest {
            transactional_id: None,
            acks: Some(1),
            timeout_ms: 1000,
            topics: vec![],
        })
        .await
        .unwrap_err();
    assert_eq!(
        tidelog::api::status::code_of(&empty),
        ErrorCode::InvalidRequest
    );
    let far = lead
        .fetch(FetchRequest {
            max_wait_ms: 0,
            min_bytes: 1,
            max_bytes: 0,
            topics: vec![FetchTopic {
                topic: "wide".into(),
                partitions: vec![FetchPartition {
                    partition: 0,
                    fetch_offset: 1_000_000,
                    partition_max_bytes: 0,
                }],
            }],
            raw_batches: false,
            filter: None,
            read_from_follower: false,
            isolation: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let fp = &far.topics[0].partitions[0];
    assert_eq!(
        fp.error_code,
        tidelog::api::proto::ErrorCode::OffsetOutOfRange as i32
    );
    assert!(
        fp.error_message.contains("high watermark"),
        "{}",
        fp.error_message
    );
    let after = read_all(&c.bootstrap(), "wide", 12).await;
    assert_eq!(after.len(), 3000, "rejected requests wrote nothing");

    // A request that leaves acks out is acknowledged as acks=all (with a real offset),
    // never silently sent fire-and-forget (acks=0 answers offset -1).
    let defaulted = lead
        .produce(ProduceRequest {
            acks: None,
            ..produce("wide", 0, b"durable".to_vec())
        })
        .await
        .unwrap()
        .into_inner();
    let dp = &defaulted.topics[0].partitions[0];
    assert_eq!(dp.error_code, 0, "{dp:?}");
    assert!(dp.base_offset >= 0, "acks defaults to all: {dp:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_records_survive_broker_kill_9_and_cluster_restart() {
    let mut c = BrokerCluster::start(3);
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--topic",
        "orders",
        "--partitions",
        "6",
        "--bootstrap",
        &c.broker_address(1),
    ]);
    assert!(ok, "{err}");
    wait_all_partitions_led(&c.bootstrap(), "orders", 6).await;
    let producer = Arc::new(Producer::new(
        c.bootstrap(),
        ProducerConfig {
            acks: 1,
            linger: Duration::from_millis(2),
            delivery_timeout: Duration::from_secs(60),
            retry_backoff: Duration::from_millis(100),
            ..Default::default()
        },
    ));
    let total = 6000u32;
    let writer = {
        let producer = producer.clone();
        tokio::spawn(async move {
            let mut futures = Vec::new();
            for i in 0..total {
                let record = ProducerRecord {
                    topic: "orders".into(),
                    key: Some(Bytes::from(format!("key-{i}"))),
                    value: Some(Bytes::from(format!("order-{i}"))),
                    ..Default::default()
                };
                futures.push((i, producer.send(record).await));
                if i % 200 == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            let mut acked = Vec::new();
            for (i, f) in futures {
                if let Ok(m) = f.await {
                    acked.push((format!("order-{i}"), m.partition, m.offset));
                }
            }
            acked
        })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    c.brokers[1].as_mut().unwrap().kill9();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    c.start_broker(2);
    let acked = writer.await.unwrap();
    assert!(
        acked.len() > (total as usize) / 2,
        "most records acknowledged: {}",
        acked.len()
    );

    let verify = |log: Vec<(u32, i64, String)>, acked: &[(String, u32, i64)]| {
        let at: BTreeMap<(u32, i64), String> =
            log.iter().map(|(p, o, v)| ((*p, *o), v.clone())).collect();
        assert_eq!(at.len(), log.len(), "no offset is read twice");
        for (value, p, o) in acked {
            assert_eq!(at.get(&(*p, *o)), Some(value), "acked {value} at {p}:{o}");
        }
        let mut per_partition: BTreeMap<u32, Vec<i64>> = BTreeMap::new();
        for (p, o, _) in &log {
            per_partition.entry(*p).or_default().push(*o);
        }
        for (p, mut offsets) in per_partition {
            offsets.sort_unstable();
            assert_eq!(
                offsets,
                (0..offsets.len() as i64).collect::<Vec<_>>(),
                "partition {p} has no gaps"
            );
        }
        let acked_values: BTreeSet<&String> = acked.iter().map(|(v, _, _)| v).collect();
        assert_eq!(
            acked_values.len(),
            acked.len(),
            "no record acknowledged twice"
        );
    };
    verify(read_all(&c.bootstrap(), "orders", 6).await, &acked);

    // Restart the whole cluster: everything acknowledged is back.
    for b in c.brokers.iter_mut() {
        let status = b.as_mut().unwrap().terminate();
        assert!(status.success());
    }
    c.controllers.stop(1);
    c.controllers.start_node(1);
    for id in 1..=3 {
        c.start_broker(id);
    }
    wait_all_partitions_led(&c.bootstrap(), "orders", 6).await;
    verify(read_all(&c.bootstrap(), "orders", 6).await, &acked);
}

/// Fault avoidance: with one of three brokers paused (SIGSTOP), records without a key
/// keep being acknowledged by the other two within seconds, while a keyed record whose
/// partition the paused broker leads waits for it and is delivered when it resumes.
/// Every record of the idempotent producer ends in the log exactly once. A producer
/// without idempotence also gets its batches that were on their way to the paused
/// broker acknowledged elsewhere (retried on another broker's partition), at least once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unkeyed_sends_go_around_a_paused_broker_and_keyed_ones_wait() {
    let c = BrokerCluster::start(3);
    let b1 = c.broker_address(1);
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--topic",
        "around",
        "--partitions",
        "6",
        "--replication-factor",
        "1",
        "--bootstrap",
        &b1,
    ]);
    assert!(ok, "{err}");
    wait_all_partitions_led(&c.bootstrap(), "around", 6).await;
    let (ok, out, _) = cli(&[
        "topics",
        "describe",
        "--topic",
        "around",
        "--output",
        "json",
        "--bootstrap",
        &b1,
    ]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let led_by_2: BTreeSet<u32> = v["topics"][0]["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["leader"].as_i64() == Some(2))
        .map(|p| p["partition"].as_u64().unwrap() as u32)
        .collect();
    assert_eq!(led_by_2.len(), 2, "{out}");
    let config = ProducerConfig {
        acks: -1,
        linger: Duration::from_millis(5),
        request_timeout: Duration::from_secs(2),
        retry_backoff: Duration::from_millis(100),
        delivery_timeout: Duration::from_secs(90),
        ..Default::default()
    };
    let producer = Producer::new(c.bootstrap(), config.clone());
    let plain = Producer::new(
        c.bootstrap(),
        ProducerConfig {
            enable_idempotence: false,
            ..config
        },
    );
    let unkeyed = |i: usize| ProducerRecord {
        topic: "around".into(),
        value: Some(Bytes::from(format!("u{i}"))),
        ..Default::default()
    };
    // Healthy: every broker takes records.
    let mut sent = Vec::new();
    for i in 0..300 {
        sent.push(producer.send(unkeyed(i)).await);
        if i % 10 == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    for f in sent.drain(..) {
        f.await.expect("delivered while all brokers run");
    }

    c.brokers[1].as_ref().unwrap().signal(libc::SIGSTOP);
    let paused = std::time::Instant::now();
    let key = (0..)
        .map(|k| format!("key-{k}"))
        .find(|k| led_by_2.contains(&partition_for_key(k.as_bytes(), 6)))
        .unwrap();
    let keyed = producer
        .send(ProducerRecord {
            topic: "around".into(),
            key: Some(Bytes::from(key.clone())),
            value: Some(Bytes::from("keyed")),
            ..Default::default()
        })
        .await;
    // Unkeyed records for 6 s; those sent 2 s after the pause or later are the ones that
    // must not wait (before, a batch may be on its way to the paused broker).
    let mut early = Vec::new();
    let mut late = Vec::new();
    let mut plain_sent = Vec::new();
    let mut i = 300;
    while paused.elapsed() < Duration::from_secs(6) {
        plain_sent.push(
            plain
                .send(ProducerRecord {
                    topic: "around".into(),
                    value: Some(Bytes::from(format!("p{i}"))),
                    ..Default::default()
                })
                .await,
        );
        let f = producer.send(unkeyed(i)).await;
        if paused.elapsed() < Duration::from_secs(2) {
            early.push(f);
        } else {
            late.push((i, f));
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let within = tokio::time::timeout(Duration::from_secs(10), async {
        let mut partitions = BTreeSet::new();
        for (i, f) in late.drain(..) {
            let m = f.await.unwrap_or_else(|e| panic!("u{i}: {e}"));
            partitions.insert(m.partition);
        }
        for f in plain_sent.drain(..) {
            let m = f.await.expect("without idempotence: retried elsewhere");
            assert!(!led_by_2.contains(&m.partition), "{m:?}");
        }
        partitions
    })
    .await;
    let still_paused = paused.elapsed();
    let partitions = within.unwrap_or_else(|_| {
        panic!("records sent 2 s after the pause (or any of the producer without idempotence) were not all acknowledged by the other brokers within 10 s")
    });
    assert!(
        partitions.is_disjoint(&led_by_2),
        "records went to the paused broker's partitions: {partitions:?}"
    );
    assert!(
        keyed.try_result().is_none(),
        "the keyed record waits for its partition's broker"
    );
    eprintln!(
        "unkeyed records acknowledged around the paused broker; {:.1} s after the pause",
        still_paused.as_secs_f64()
    );

    c.brokers[1].as_ref().unwrap().signal(libc::SIGCONT);
    let m = keyed
        .await
        .expect("the keyed record is delivered after the resume");
    assert!(led_by_2.contains(&m.partition));
    for f in early {
        f.await.expect("early records are delivered too");
    }
    drop(producer);
    drop(plain);
    let log = read_all(&c.bootstrap(), "around", 6).await;
    let (plain_values, values): (Vec<&String>, Vec<&String>) = log
        .iter()
        .map(|(_, _, v)| v)
        .partition(|v| v.starts_with('p'));
    let distinct: BTreeSet<&&String> = values.iter().collect();
    assert_eq!(distinct.len(), values.len(), "no record twice");
    assert_eq!(values.len(), i + 1, "every record, and the keyed one");
    let plain_distinct: BTreeSet<&&String> = plain_values.iter().collect();
    assert_eq!(
        plain_distinct.len(),
        i - 300,
        "every record without idempotence"
    );
}

/// Fetch from a follower (KIP-392): brokers in racks a, b, c; a topic whose three
/// partitions have a replica on every broker, led one by each. A consumer in rack b reads
/// every record, all of them served by broker 2 (the other brokers serve no consumer
/// bytes); a consumer without a rack reads from the leaders, so all three serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_with_a_rack_reads_from_the_replica_in_its_rack() {
    let c = BrokerCluster::build_in_racks(1, 3, &[], false, &["a", "b", "c"]);
    let b1 = c.broker_address(1);
    let bootstrap = c.bootstrap().join(",");
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--topic",
        "near",
        "--partitions",
        "3",
        "--replication-factor",
        "3",
        "--bootstrap",
        &b1,
    ]);
    assert!(ok, "{err}");
    wait_all_partitions_led(&c.bootstrap(), "near", 3).await;
    let input: String = (0..3000).map(|i| format!("k{i}\tvalue-{i}\n")).collect();
    let (ok, _, err) = produce_cli(
        &[
            "--topic",
            "near",
            "--parse-key",
            "--acks",
            "all",
            "--bootstrap",
            &bootstrap,
        ],
        &input,
    );
    assert!(ok, "{err}");
    let leaders: BTreeSet<i64> =
        eventually("every replica in sync", Duration::from_secs(30), || async {
            let (ok, out, _) = cli(&[
                "topics",
                "describe",
                "--topic",
                "near",
                "--output",
                "json",
                "--bootstrap",
                &b1,
            ]);
            let v: serde_json::Value = serde_json::from_str(&out).ok().filter(|_| ok)?;
            let parts = v["topics"][0]["partitions"].as_array()?.clone();
            parts
                .iter()
                .all(|p| p["isr"].as_array().is_some_and(|i| i.len() == 3))
                .then(|| parts.iter().filter_map(|p| p["leader"].as_i64()).collect())
        })
        .await;
    assert_eq!(leaders.len(), 3, "one partition led by each broker");
    for id in 1..=3 {
        assert_eq!(common::bytes_out(&c.broker_http_address(id), "near"), 0.0);
    }

    let consume = |rack: Option<&str>| {
        let mut args = vec![
            "consume",
            "--topic",
            "near",
            "--from-beginning",
            "--max-messages",
            "3000",
            "--timeout-ms",
            "20000",
            "--print-key",
            "--bootstrap",
            &bootstrap,
        ];
        if let Some(r) = rack {
            args.extend(["--rack", r]);
        }
        let (ok, out, err) = cli(&args);
        assert!(ok, "{err}");
        let mut got: Vec<String> = out.lines().map(str::to_owned).collect();
        got.sort();
        let mut want: Vec<String> = (0..3000).map(|i| format!("k{i}\tvalue-{i}")).collect();
        want.sort();
        assert_eq!(got, want, "every record once");
    };
    consume(Some("b"));
    let served: Vec<f64> = common::bytes_out_per_broker(&c, "near");
    // Nearly all: a follower that refuses a fetch once (say, an ISR change under load)
    // sends its partition to the leader for a while, which is correct.
    let total: f64 = served.iter().sum();
    assert!(
        served[1] > 3000.0 * 10.0 && served[1] >= 0.9 * total,
        "broker 2 (rack b) served the rack-b consumer: {served:?}"
    );

    consume(None);
    let after: Vec<f64> = common::bytes_out_per_broker(&c, "near");
    assert!(
        after[0] > 0.0 && after[2] > 0.0,
        "without a rack the leaders serve: {after:?}"
    );
}
