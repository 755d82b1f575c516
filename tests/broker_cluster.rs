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
