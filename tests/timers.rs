//! Delayed and scheduled records with the real binary: each arrives exactly once and never
//! before it is due, through kill -9 of a standalone, of brokers leading the timer data
//! in a 3-broker cluster, and of the whole cluster; cancelled records never arrive; bad
//! delays and unknown ids get coded errors and write nothing.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{cli, eventually, free_ports, standalone, BrokerCluster};
use tidelog::api::proto::broker_client::BrokerClient;
use tidelog::api::proto::{
    PartitionProduceData, PartitionProduceResponse, ProduceRequest, Record, TopicProduceData,
};
use tidelog::api::status::to_wire;
use tidelog::client::producer::{Due, Producer, ProducerConfig, ProducerRecord};
use tidelog::client::AdminClient;
use tidelog::error_code::ErrorCode;

/// Per delivered value, each copy: (partition, delivery timestamp, original timestamp).
type Delivered = BTreeMap<String, Vec<(u32, i64, Option<String>)>>;

/// Every record of `topic` until `expected` arrived (or `within` passed), as
/// value -> (partition, delivery timestamp, original-timestamp header) per copy.
async fn collect(
    bootstrap: &[String],
    topic: &str,
    partitions: u32,
    expected: usize,
    within: Duration,
) -> Delivered {
    let mut consumer =
        tidelog::client::consumer::Consumer::new(bootstrap.to_vec(), Duration::from_secs(20));
    for p in 0..partitions {
        consumer
            .assign(topic, p, tidelog::client::consumer::StartAt::Earliest)
            .await
            .expect("assign");
    }
    let mut out = Delivered::new();
    let mut seen = 0;
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let batch = match consumer.poll(Duration::from_millis(300)).await {
            Ok(b) => b,
            Err(e) if e.is_retriable() => {
                tokio::time::sleep(Duration::from_millis(300)).await;
                continue;
            }
            Err(e) => panic!("poll: {e}"),
        };
        for r in batch {
            let original = r
                .headers
                .iter()
                .find(|(k, _)| k == "tidelog.delay.original.timestamp")
                .and_then(|(_, v)| v.as_ref())
                .map(|v| String::from_utf8_lossy(v).into_owned());
            out.entry(String::from_utf8_lossy(&r.value.unwrap()).into_owned())
                .or_default()
                .push((r.partition, r.timestamp_ms, original));
            seen += 1;
        }
        if seen >= expected {
            // A little longer: a duplicate would show up now.
            let extra = consumer
                .poll(Duration::from_millis(1500))
                .await
                .unwrap_or_default();
            for r in extra {
                out.entry(String::from_utf8_lossy(&r.value.unwrap()).into_owned())
                    .or_default()
                    .push((r.partition, r.timestamp_ms, None));
            }
            break;
        }
    }
    out
}

/// Checks that every scheduled value arrived exactly once, at or after its due time
/// (values are `i:due_ms`), and nothing else arrived; returns lateness p50 and p99 (ms).
fn check_exactly_once(got: &Delivered, scheduled: &BTreeMap<String, u32>) -> (i64, i64) {
    let mut missing = Vec::new();
    let mut lateness = Vec::new();
    for (value, partition) in scheduled {
        match got.get(value).map(Vec::as_slice) {
            None | Some([]) => missing.push(value.clone()),
            Some([(p, ts, _)]) => {
                assert_eq!(
                    p, partition,
                    "{value} went to partition {p}, not {partition}"
                );
                let due: i64 = value.split(':').nth(1).unwrap().parse().unwrap();
                assert!(
                    *ts >= due,
                    "{value} was delivered at {ts}, before it was due"
                );
                lateness.push(ts - due);
            }
            Some(copies) => panic!("{value} arrived {} times: {copies:?}", copies.len()),
        }
    }
    assert!(
        missing.is_empty(),
        "{} of {} scheduled records never arrived, e.g. {:?}",
        missing.len(),
        scheduled.len(),
        &missing[..missing.len().min(5)]
    );
    let unexpected: Vec<_> = got.keys().filter(|v| !scheduled.contains_key(*v)).collect();
    assert!(
        unexpected.is_empty(),
        "records that were not scheduled arrived: {unexpected:?}"
    );
    lateness.sort_unstable();
    let at = |q: f64| lateness[((lateness.len() - 1) as f64 * q) as usize];
    (at(0.5), at(0.99))
}

fn producer(bootstrap: &[String]) -> Producer {
    Producer::new(
        bootstrap.to_vec(),
        ProducerConfig {
            delivery_timeout: Duration::from_secs(60),
            ..Default::default()
        },
    )
}

/// Schedules `n` records (`i:due_ms`, key `k{i}`) with delays from `min_ms` to `max_ms`;
/// returns value -> partition.
async fn schedule_many(
    producer: &Producer,
    topic: &str,
    n: usize,
    min_ms: i64,
    max_ms: i64,
) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    let mut pending = futures_util::stream::FuturesUnordered::new();
    for i in 0..n {
        let delay = min_ms + (i as i64 * 7919) % (max_ms - min_ms + 1);
        let due = now_ms() + delay;
        let value = format!("{i}:{due}");
        let record = ProducerRecord {
            topic: topic.into(),
            key: Some(Bytes::from(format!("k{i}"))),
            value: Some(Bytes::from(value.clone())),
            headers: vec![("h".into(), Some(Bytes::from("v")))],
            tag: Some("T".into()),
            ..Default::default()
        };
        // Due at `due` exactly, so the value's due time is the one the broker uses.
        pending.push(async move {
            let s = producer.schedule(record, Due::AtMs(due)).await;
            (value, s)
        });
        if pending.len() >= 32 {
            let (value, s) = futures_util::StreamExt::next(&mut pending).await.unwrap();
            out.insert(value, s.expect("schedule").partition);
        }
    }
    while let Some((value, s)) = futures_util::StreamExt::next(&mut pending).await {
        out.insert(value, s.expect("schedule").partition);
    }
    out
}

/// One Produce of `records` to `topic`-`partition` over raw gRPC; the partition's answer.
async fn produce_raw(
    client: &mut BrokerClient<tonic::transport::Channel>,
    topic: &str,
    partition: u32,
    records: Vec<Record>,
) -> PartitionProduceResponse {
    let request = ProduceRequest {
        transactional_id: None,
        acks: Some(-1),
        timeout_ms: 5_000,
        topics: vec![TopicProduceData {
            topic: topic.into(),
            partitions: vec![PartitionProduceData {
                partition,
                records,
                ..Default::default()
            }],
        }],
    };
    client.produce(request).await.unwrap().into_inner().topics[0].partitions[0].clone()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scheduled_records_arrive_once_on_time_and_survive_kill9() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let bootstrap = vec![format!("127.0.0.1:{port}")];
    let mut server = standalone(dir.path(), port);
    let admin = AdminClient::new(bootstrap.clone(), Duration::from_secs(20));
    admin
        .create_topic("delayed", Some(3), Some(1), Default::default())
        .await
        .unwrap();
    let producer = producer(&bootstrap);

    // Cancelled records never arrive; a second cancel, or an unknown id, is refused.
    let mut cancelled = Vec::new();
    for i in 0..10 {
        let record = ProducerRecord {
            topic: "delayed".into(),
            value: Some(Bytes::from(format!("cancelled-{i}"))),
            ..Default::default()
        };
        let s = producer
            .schedule(record, Due::DelayMs(3_000))
            .await
            .unwrap();
        producer.cancel_scheduled(&s.id).await.unwrap();
        cancelled.push(s.id);
    }
    let again = producer.cancel_scheduled(&cancelled[0]).await.unwrap_err();
    assert_eq!(again.code, ErrorCode::UnknownScheduledRecord, "{again}");
    let unknown = producer.cancel_scheduled("0-999999-1").await.unwrap_err();
    assert_eq!(unknown.code, ErrorCode::UnknownScheduledRecord, "{unknown}");
    let garbage = producer.cancel_scheduled("not-an-id").await.unwrap_err();
    assert_eq!(garbage.code, ErrorCode::UnknownScheduledRecord, "{garbage}");

    // Bad delays: coded errors naming the field, nothing written anywhere.
    let mut client = BrokerClient::connect(format!("http://{}", bootstrap[0]))
        .await
        .unwrap();
    for (delay_ms, deliver_at_ms, field) in [
        (Some(-1), None, "delay_ms"),
        (Some(41 * 24 * 3600 * 1000), None, "max.delay.ms"),
        (None, Some(now_ms() + 41 * 24 * 3600 * 1000), "max.delay.ms"),
        (Some(10), Some(now_ms()), "not both"),
    ] {
        let records = vec![
            Record {
                value: Some(Bytes::from("good")),
                delay_ms: Some(100),
                ..Default::default()
            },
            Record {
                value: Some(Bytes::from("bad")),
                delay_ms,
                deliver_at_ms,
                ..Default::default()
            },
        ];
        let p = produce_raw(&mut client, "delayed", 0, records).await;
        assert_eq!(
            p.error_code,
            to_wire(ErrorCode::InvalidDelay),
            "{delay_ms:?}/{deliver_at_ms:?}: {p:?}"
        );
        assert!(p.error_message.contains(field), "{}", p.error_message);
    }

    // Scheduled and plain records in one partition entry: refused, nothing written.
    let records = vec![
        Record {
            value: Some(Bytes::from("plain")),
            ..Default::default()
        },
        Record {
            value: Some(Bytes::from("later")),
            delay_ms: Some(10),
            ..Default::default()
        },
    ];
    let p = produce_raw(&mut client, "delayed", 1, records).await;
    assert_eq!(p.error_code, to_wire(ErrorCode::InvalidRequest), "{p:?}");

    // 300 records due within 0.5 to 4 s; a kill -9 while they are pending.
    let scheduled = schedule_many(&producer, "delayed", 300, 500, 4_000).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    server.kill9();
    server = standalone(dir.path(), port);
    let got = collect(
        &bootstrap,
        "delayed",
        3,
        scheduled.len(),
        Duration::from_secs(60),
    )
    .await;
    let (p50, p99) = check_exactly_once(&got, &scheduled);
    println!("standalone with a kill -9: lateness p50 {p50} ms, p99 {p99} ms");
    for copies in got.values() {
        let original = copies[0].2.as_deref().expect("original timestamp header");
        assert!(original.parse::<i64>().is_ok(), "{original}");
    }

    // The CLI: schedule with --delay-ms, cancel with `scheduled cancel`.
    let out = common::cli_stdin(
        &[
            "produce",
            "--topic",
            "delayed",
            "--delay-ms",
            "60000",
            "--output",
            "json",
            "--bootstrap",
            &bootstrap[0],
        ],
        "later\n",
    );
    assert!(out.0, "{}", out.2);
    let line: serde_json::Value = serde_json::from_str(out.1.trim()).unwrap();
    let id = line["scheduled_id"]
        .as_str()
        .expect("scheduled_id")
        .to_owned();
    let (ok, _, err) = cli(&[
        "scheduled",
        "cancel",
        "--id",
        &id,
        "--bootstrap",
        &bootstrap[0],
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = cli(&[
        "scheduled",
        "cancel",
        "--id",
        &id,
        "--bootstrap",
        &bootstrap[0],
    ]);
    assert!(!ok && err.contains("UNKNOWN_SCHEDULED_RECORD"), "{err}");
    for bad in ["-5", "999999999999"] {
        let (ok, _, err) = common::cli_stdin(
            &[
                "produce",
                "--topic",
                "delayed",
                "--delay-ms",
                bad,
                "--bootstrap",
                &bootstrap[0],
            ],
            "x\n",
        );
        assert!(
            !ok && err.contains("INVALID_DELAY"),
            "--delay-ms {bad}: {err}"
        );
    }
    drop(server);
}

/// A controller and three brokers with `topic` (6 partitions, replication factor 3).
async fn cluster_with_topic(topic: &str) -> (BrokerCluster, Vec<String>) {
    let cluster = BrokerCluster::start(3);
    let bootstrap = cluster.bootstrap();
    let admin = AdminClient::new(bootstrap.clone(), Duration::from_secs(30));
    eventually("3 brokers", Duration::from_secs(30), || async {
        admin
            .create_topic(topic, Some(6), Some(3), Default::default())
            .await
            .ok()
    })
    .await;
    (cluster, bootstrap)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scheduled_records_survive_killed_timer_leaders() {
    let (mut cluster, bootstrap) = cluster_with_topic("later").await;
    let producer = producer(&bootstrap);
    let scheduled = schedule_many(&producer, "later", 10_000, 1_000, 20_000).await;
    // Two brokers, each leading some `__timers` partitions, killed with -9 in turn while
    // timers are pending; each comes back before the next goes.
    for id in [1, 2] {
        tokio::time::sleep(Duration::from_secs(2)).await;
        cluster.brokers[id as usize - 1].as_mut().unwrap().kill9();
        tokio::time::sleep(Duration::from_secs(4)).await;
        cluster.start_broker(id);
    }
    let got = collect(
        &bootstrap,
        "later",
        6,
        scheduled.len(),
        Duration::from_secs(120),
    )
    .await;
    let (p50, p99) = check_exactly_once(&got, &scheduled);
    println!("3 brokers, two leaders killed: lateness p50 {p50} ms, p99 {p99} ms");
}

/// The whole cluster (its controller and three brokers) killed with -9 while 1,000
/// timers are pending and kept down while some fall due: after the restart every record
/// arrives exactly once, never early; those due while it was down at once, the rest on
/// time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scheduled_records_survive_a_restart_of_the_whole_cluster() {
    let (mut cluster, bootstrap) = cluster_with_topic("restart").await;
    let producer = producer(&bootstrap);
    let scheduled = schedule_many(&producer, "restart", 1_000, 4_000, 20_000).await;
    drop(producer);
    for id in 1..=3 {
        cluster.brokers[id as usize - 1].as_mut().unwrap().kill9();
    }
    cluster.controllers.kill9(1);
    let down_at = now_ms();
    tokio::time::sleep(Duration::from_secs(8)).await;
    cluster.controllers.start_node(1);
    for id in 1..=3i32 {
        cluster.start_broker(id);
    }
    let up_at = now_ms();
    let got = collect(
        &bootstrap,
        "restart",
        6,
        scheduled.len(),
        Duration::from_secs(120),
    )
    .await;
    let (p50, p99) = check_exactly_once(&got, &scheduled);
    let due_while_down = scheduled
        .keys()
        .filter(|v| v.split(':').nth(1).unwrap().parse::<i64>().unwrap() < up_at)
        .count();
    assert!(
        due_while_down > 0,
        "some fell due while the cluster was down"
    );
    // When the ones due while the cluster was down arrived, after the restart.
    let mut after_restart: Vec<i64> = got
        .iter()
        .filter(|(v, _)| v.split(':').nth(1).unwrap().parse::<i64>().unwrap() < up_at)
        .map(|(_, copies)| copies[0].1 - up_at)
        .collect();
    after_restart.sort_unstable();
    println!(
        "whole cluster down {} ms: {due_while_down} records fell due meanwhile and arrived within {} ms of the restart; lateness over all: p50 {p50} ms, p99 {p99} ms",
        up_at - down_at,
        after_restart.last().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_timers_partition_refuses_more_with_a_code() {
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports(2);
    let bootstrap = vec![format!("127.0.0.1:{}", ports[0])];
    let http = format!("127.0.0.1:{}", ports[1]);
    let _server = common::standalone_with(
        dir.path(),
        ports[0],
        &[
            ("TIDELOG_TIMERS_TOPIC_NUM_PARTITIONS", "1"),
            ("TIDELOG_TIMERS_MAX_PENDING_PER_PARTITION", "5"),
            ("TIDELOG_HTTP_LISTEN", &http),
        ],
    );
    let admin = AdminClient::new(bootstrap.clone(), Duration::from_secs(20));
    admin
        .create_topic("full", Some(1), Some(1), Default::default())
        .await
        .unwrap();
    let producer = producer(&bootstrap);
    let record = || ProducerRecord {
        topic: "full".into(),
        value: Some(Bytes::from("v")),
        ..Default::default()
    };
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.push(
            producer
                .schedule(record(), Due::DelayMs(600_000))
                .await
                .unwrap()
                .id,
        );
    }
    let refused = producer
        .schedule(record(), Due::DelayMs(600_000))
        .await
        .unwrap_err();
    assert_eq!(
        refused.code,
        ErrorCode::ScheduledRecordLimitExceeded,
        "{refused}"
    );
    assert!(refused.message.contains("limit of 5"), "{refused}");
    // The broker exports what is pending per topic (as of its mover's last pass).
    eventually(
        "tidelog_timers_pending 5",
        Duration::from_secs(10),
        || async {
            let (_, body) = common::http_get(&http, "/metrics").ok()?;
            body.lines()
                .any(|l| l == "tidelog_timers_pending{topic=\"full\"} 5")
                .then_some(())
        },
    )
    .await;
    // A cancel makes room again.
    producer.cancel_scheduled(&ids[0]).await.unwrap();
    producer
        .schedule(record(), Due::DelayMs(600_000))
        .await
        .unwrap();
}
