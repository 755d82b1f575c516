//! Push consumption with the real binary: the broker never sends more than the client's
//! window (records and bytes) and sends exactly what returned credit allows; bad
//! subscriptions get coded errors; a silent client is dropped; push group members killed
//! with kill -9 skip no record; orderly listeners keep offset order per partition and
//! retry in place (a concurrent one does not keep order); a push consumer follows a
//! partition whose leader was killed.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{binary, cli, eventually, BrokerCluster};
use tidelog::api::proto::broker_client::BrokerClient;
use tidelog::api::proto::{
    subscribe_request, subscribe_response, FetchPartition, FetchTopic, SubscribeCredit,
    SubscribeHeartbeat, SubscribeRequest, SubscribeResponse, SubscribeStart,
};
use tidelog::api::status::code_of;
use tidelog::client::producer::{Producer, ProducerConfig, ProducerRecord};
use tidelog::client::AdminClient;
use tidelog::error_code::ErrorCode;
use tokio::sync::mpsc;

/// Sends values `v{from}..v{to}` (unkeyed, `size` bytes each at least) and waits for every
/// acknowledgement.
async fn produce(bootstrap: &[String], topic: &str, from: usize, to: usize, size: usize) {
    let producer = Producer::new(
        bootstrap.to_vec(),
        ProducerConfig {
            acks: -1,
            linger: Duration::from_millis(5),
            ..Default::default()
        },
    );
    let mut futures = Vec::new();
    for i in from..to {
        let mut value = format!("v{i}");
        if value.len() < size {
            value.push(' ');
            value.push_str(&"x".repeat(size - value.len()));
        }
        let record = ProducerRecord {
            topic: topic.into(),
            value: Some(Bytes::from(value)),
            ..Default::default()
        };
        futures.push(producer.send(record).await);
    }
    for f in futures {
        f.await.expect("acknowledged");
    }
    producer.flush().await;
}

/// A raw subscription: requests go in through `tx`, responses come out of `rx`.
struct RawStream {
    tx: mpsc::Sender<SubscribeRequest>,
    rx: tonic::Streaming<SubscribeResponse>,
}

async fn open(bootstrap: &str, start: SubscribeStart) -> Result<RawStream, tonic::Status> {
    let (tx, requests) = mpsc::channel(16);
    tx.send(SubscribeRequest {
        message: Some(subscribe_request::Message::Start(start)),
    })
    .await
    .unwrap();
    let outbound =
        futures_util::stream::unfold(
            requests,
            |mut r| async move { r.recv().await.map(|m| (m, r)) },
        );
    let mut client = BrokerClient::connect(format!("http://{bootstrap}"))
        .await
        .unwrap();
    let rx = client.subscribe(outbound).await?.into_inner();
    Ok(RawStream { tx, rx })
}

fn start_at(topic: &str, offset: i64, records: u32, bytes: u32, raw: bool) -> SubscribeStart {
    SubscribeStart {
        topics: vec![FetchTopic {
            topic: topic.into(),
            partitions: vec![FetchPartition {
                partition: 0,
                fetch_offset: offset,
                partition_max_bytes: 0,
            }],
        }],
        window_records: records,
        window_bytes: bytes,
        heartbeat_interval_ms: 5000,
        raw_batches: raw,
        ..Default::default()
    }
}

/// What arrived within `wait`: (offsets, records counted, window bytes taken).
async fn collect(stream: &mut RawStream, wait: Duration) -> (Vec<i64>, u64, u64) {
    let (mut offsets, mut count, mut bytes) = (Vec::new(), 0u64, 0u64);
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(message) = tokio::time::timeout_at(deadline, stream.rx.message()).await {
        let Some(message) = message.expect("stream open") else {
            break;
        };
        if let Some(subscribe_response::Message::Records(r)) = message.message {
            count += u64::from(r.record_count);
            bytes += r.window_bytes;
            if r.record_batches.is_empty() {
                offsets.extend(r.records.iter().map(|c| c.offset));
            } else {
                let decoded =
                    tidelog::record::decode_data_records(&r.record_batches, 1 << 26).unwrap();
                offsets.extend(decoded.iter().map(|c| c.offset));
            }
        }
    }
    (offsets, count, bytes)
}

async fn credit(stream: &RawStream, records: u64, bytes: u64) {
    stream
        .tx
        .send(SubscribeRequest {
            message: Some(subscribe_request::Message::Credit(SubscribeCredit {
                records: records as u32,
                bytes,
            })),
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_sends_exactly_what_the_window_allows() {
    let (_dir, _server, bootstrap) = common::server_with_topic("w", 1).await;
    produce(std::slice::from_ref(&bootstrap), "w", 0, 300, 300).await;

    // A window of 7 records: exactly 7 arrive (decoded), then nothing until credit.
    let mut s = open(&bootstrap, start_at("w", 0, 7, 1 << 20, false))
        .await
        .unwrap();
    let (offsets, count, bytes) = collect(&mut s, Duration::from_millis(1500)).await;
    assert_eq!(offsets, (0..7).collect::<Vec<_>>());
    assert_eq!(count, 7);
    // Credit for 5 of them: exactly 5 more, continuing where the first ones ended.
    credit(&s, 5, bytes / 2).await;
    let (more, count, _) = collect(&mut s, Duration::from_millis(1500)).await;
    assert_eq!(more, (7..12).collect::<Vec<_>>());
    assert_eq!(count, 5);
    // Returning more than is outstanding breaks the protocol: a coded error ends it.
    credit(&s, 1000, 0).await;
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match s.rx.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return None,
                Err(status) => return Some(status),
            }
        }
    })
    .await
    .expect("the stream ends");
    let status = ended.expect("with an error status");
    assert_eq!(code_of(&status), ErrorCode::InvalidRequest);
    assert!(
        status.message().contains("outstanding"),
        "{}",
        status.message()
    );

    // A byte window smaller than a batch: every push fits the bytes still free, and
    // returning credit as records arrive delivers every record once, in order.
    let window = 2048u64;
    let mut s = open(&bootstrap, start_at("w", 0, 1000, window as u32, true))
        .await
        .unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < 300 && Instant::now() < deadline {
        let message = tokio::time::timeout(Duration::from_secs(5), s.rx.message())
            .await
            .unwrap_or_else(|_| panic!("records stopped after {} of 300", got.len()))
            .unwrap()
            .unwrap();
        if let Some(subscribe_response::Message::Records(r)) = message.message {
            assert!(
                r.window_bytes <= window,
                "a push of {} bytes exceeds the {window}-byte window",
                r.window_bytes
            );
            let decoded = tidelog::record::decode_data_records(&r.record_batches, 1 << 26).unwrap();
            // The first batch may start before the position; a gap or repeat fails below.
            for r in decoded {
                if r.offset >= got.len() as i64 {
                    got.push(r.offset);
                }
            }
            credit(&s, r.record_count.into(), r.window_bytes).await;
        }
    }
    assert_eq!(got, (0..300).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_subscriptions_get_coded_errors_and_silent_clients_are_dropped() {
    let (_dir, _server, bootstrap) = common::server_with_topic("b", 1).await;
    for (start, field) in [
        (start_at("b", 0, 0, 1 << 20, true), "window_records"),
        (start_at("b", 0, 10, 100, true), "window_bytes"),
        (start_at("b", -1, 10, 1 << 20, true), "fetch_offset"),
        (
            SubscribeStart {
                heartbeat_interval_ms: 10,
                ..start_at("b", 0, 10, 1 << 20, true)
            },
            "heartbeat_interval_ms",
        ),
    ] {
        let status = open(&bootstrap, start).await.err().expect("refused");
        assert_eq!(code_of(&status), ErrorCode::InvalidRequest, "{field}");
        assert!(status.message().contains(field), "{}", status.message());
    }
    // A subscription to a partition that does not exist: it is reported and dropped.
    let mut s = open(&bootstrap, start_at("nope", 0, 10, 1 << 20, true))
        .await
        .unwrap();
    let first = s.rx.message().await.unwrap().unwrap();
    match first.message {
        Some(subscribe_response::Message::PartitionError(e)) => {
            assert_eq!(
                tidelog::api::status::from_wire(e.error_code),
                Some(ErrorCode::UnknownTopicOrPartition)
            );
        }
        other => panic!("expected a partition error, got {other:?}"),
    }
    // Heartbeats flow while there is nothing to push; a client that sends nothing for
    // three intervals is dropped with REQUEST_TIMED_OUT.
    let mut s = open(
        &bootstrap,
        SubscribeStart {
            heartbeat_interval_ms: 200,
            ..start_at("b", 0, 10, 1 << 20, true)
        },
    )
    .await
    .unwrap();
    let started = Instant::now();
    let mut beats = 0;
    let status = loop {
        match tokio::time::timeout(Duration::from_secs(5), s.rx.message())
            .await
            .expect("the broker speaks within 5 s")
        {
            Ok(Some(m)) => {
                assert!(matches!(
                    m.message,
                    Some(subscribe_response::Message::Heartbeat(_))
                ));
                beats += 1;
            }
            Ok(None) => panic!("ended without a status"),
            Err(status) => break status,
        }
    };
    assert!(beats >= 2, "{beats} heartbeats");
    assert_eq!(code_of(&status), ErrorCode::RequestTimedOut);
    assert!(started.elapsed() < Duration::from_secs(4));
    // A client that heartbeats stays.
    let mut s = open(
        &bootstrap,
        SubscribeStart {
            heartbeat_interval_ms: 200,
            ..start_at("b", 0, 10, 1 << 20, true)
        },
    )
    .await
    .unwrap();
    let tx = s.tx.clone();
    let beating = tokio::spawn(async move {
        loop {
            let beat = SubscribeRequest {
                message: Some(subscribe_request::Message::Heartbeat(SubscribeHeartbeat {})),
            };
            if tx.send(beat).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
    });
    let (offsets, _, _) = collect(&mut s, Duration::from_secs(2)).await;
    assert!(offsets.is_empty());
    produce(std::slice::from_ref(&bootstrap), "b", 0, 3, 10).await;
    let (offsets, _, _) = collect(&mut s, Duration::from_secs(2)).await;
    assert_eq!(
        offsets,
        vec![0, 1, 2],
        "records pushed as they are committed"
    );
    beating.abort();
}

/// A `tidelog consume --push` process writing JSON lines to a file.
fn member(dir: &Path, name: &str, bootstrap: &str, args: &[&str]) -> (Child, std::path::PathBuf) {
    let out = dir.join(format!("{name}.out"));
    let child = Command::new(binary())
        .args([
            "consume",
            "--bootstrap",
            bootstrap,
            "--output",
            "json",
            "--push",
        ])
        .args(args)
        .stdout(Stdio::from(std::fs::File::create(&out).unwrap()))
        .stderr(Stdio::from(
            std::fs::File::create(dir.join(format!("{name}.err"))).unwrap(),
        ))
        .spawn()
        .unwrap();
    (child, out)
}

/// (partition, offset, value index) of each line of a member's output.
fn lines_of(path: &Path) -> Vec<(u32, i64, usize)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            let value = v["value"].as_str().unwrap();
            let index = value[1..].split(' ').next().unwrap().parse().unwrap();
            (
                v["partition"].as_u64().unwrap() as u32,
                v["offset"].as_i64().unwrap(),
                index,
            )
        })
        .collect()
}

/// Value indexes of the records a member's output shows arriving through a retry topic.
fn retried_indexes(path: &Path) -> BTreeSet<usize> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| {
            v["topic"]
                .as_str()
                .is_some_and(|t| t.starts_with("_retry."))
        })
        .map(|v| {
            v["value"].as_str().unwrap()[1..]
                .split(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}

/// The group's total lag, once it has committed offsets for `partitions` partitions,
/// with the records it nacked that have not come back yet (waiting in the timers or in
/// its retry topic).
fn total_lag(bootstrap: &str, group: &str, partitions: usize) -> Option<i64> {
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
    let offsets = d["offsets"].as_array()?;
    if offsets.len() < partitions {
        return None;
    }
    let lag: i64 = offsets
        .iter()
        .map(|o| o["lag"].as_i64())
        .sum::<Option<i64>>()?;
    let retries = d["retry"]["retry_scheduled"].as_i64()? + d["retry"]["retry_ready"].as_i64()?;
    Some(lag + retries)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn push_members_killed_with_kill9_skip_no_record() {
    const RECORDS: usize = 30_000;
    let (dir, _server, bootstrap) = common::server_with_topic("k", 6).await;
    let group_args = [
        "--topic",
        "k",
        "--group",
        "pk",
        "--from-beginning",
        "--session-timeout-ms",
        "3000",
        "--auto-commit-interval-ms",
        "200",
        "--workers",
        "8",
        // Every 50th record is answered "later" first and comes back through the
        // group's retry topic 1 s on: at any time some records are not done though later
        // ones are.
        "--nack-every",
        "50",
    ];
    let mut members = Vec::new();
    members.push(member(dir.path(), "a", &bootstrap, &group_args));
    members.push(member(dir.path(), "b", &bootstrap, &group_args));
    let producing = {
        let bootstrap = bootstrap.clone();
        // Paced (ten bursts over about 3 s), so "a" dies mid-stream, after commits.
        tokio::spawn(async move {
            for burst in 0..10 {
                let from = burst * RECORDS / 10;
                produce(
                    std::slice::from_ref(&bootstrap),
                    "k",
                    from,
                    from + RECORDS / 10,
                    100,
                )
                .await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };
    // Once "a" has printed some records, kill it; a third member joins.
    let a_out = members[0].1.clone();
    eventually("member a consumes", Duration::from_secs(60), || async {
        (lines_of(&a_out).len() > 2000).then_some(())
    })
    .await;
    members[0].0.kill().unwrap();
    members[0].0.wait().unwrap();
    let mut tail = group_args.to_vec();
    tail.extend(["--timeout-ms", "8000"]);
    members.push(member(dir.path(), "c", &bootstrap, &tail));
    producing.await.unwrap();
    eventually(
        "the group's lag reaches 0",
        Duration::from_secs(120),
        || async { (total_lag(&bootstrap, "pk", 6) == Some(0)).then_some(()) },
    )
    .await;
    for (child, _) in members.iter_mut().skip(1) {
        let _ = child.kill();
        let _ = child.wait();
    }
    let outputs: Vec<Vec<(u32, i64, usize)>> =
        members.iter().map(|(_, out)| lines_of(out)).collect();
    let seen: BTreeSet<usize> = outputs.iter().flatten().map(|r| r.2).collect();
    let missing: Vec<usize> = (0..RECORDS)
        .filter(|i| !seen.contains(i))
        .take(10)
        .collect();
    assert!(missing.is_empty(), "records never processed: {missing:?}");
    // At least once: what "a" did since its last commit comes again, nothing else. The
    // survivors hand partitions over with a commit of what is done, so between them each
    // record comes once (unless one lost its membership, which it logs).
    let survivors: Vec<&(u32, i64, usize)> = outputs[1..].iter().flatten().collect();
    let lost_membership = members[1..].iter().any(|(_, out)| {
        std::fs::read_to_string(out.with_extension("err"))
            .unwrap()
            .contains("lost with the membership")
    });
    let mut counts: BTreeMap<usize, usize> = BTreeMap::new();
    for r in &survivors {
        *counts.entry(r.2).or_default() += 1;
    }
    let twice: Vec<usize> = counts
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(i, _)| *i)
        .collect();
    if !lost_membership {
        // Except the records "a" nacked before it died: it scheduled their retries but
        // did not commit past them, so they come back both ways (at least once). Each
        // such record comes once from its topic and once from the retry topic, and "a"
        // nacked at most one in 50 of its deliveries.
        let retried: BTreeSet<usize> = members[1..]
            .iter()
            .flat_map(|(_, out)| retried_indexes(out))
            .collect();
        assert!(
            twice.iter().all(|i| counts[i] == 2 && retried.contains(i)),
            "b and c processed records twice between them, not through a retry: {:?}",
            twice
                .iter()
                .filter(|i| counts[*i] > 2 || !retried.contains(*i))
                .take(10)
                .collect::<Vec<_>>()
        );
        let a_nacked_at_most = outputs[0].len() / 49 + 1;
        assert!(
            twice.len() <= a_nacked_at_most,
            "{} records came twice between b and c; \"a\" nacked at most {a_nacked_at_most}",
            twice.len()
        );
    }
    // Each record again is one "a" processed, or one it nacked (see above).
    let again = outputs.iter().map(Vec::len).sum::<usize>() - RECORDS;
    assert!(
        again <= outputs[0].len() + twice.len(),
        "{again} records came twice, more than the {} 'a' processed and the {} it nacked",
        outputs[0].len(),
        twice.len()
    );
}

/// Orderly: per partition, offsets in order, each once, though every 300th record is
/// answered "later" first. Concurrent with the same nacks: every record once, but a nacked
/// record comes after later ones of its partition (the check above can fail).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orderly_listeners_keep_partition_order_and_retry_in_place() {
    const RECORDS: usize = 3000;
    let (dir, _server, bootstrap) = common::server_with_topic("o", 3).await;
    produce(std::slice::from_ref(&bootstrap), "o", 0, RECORDS, 10).await;
    let in_order = |rows: &[(u32, i64, usize)]| -> Result<(), String> {
        let mut next: BTreeMap<u32, i64> = BTreeMap::new();
        for (p, o, _) in rows {
            let expected = next.entry(*p).or_insert(0);
            if *o != *expected {
                return Err(format!(
                    "partition {p}: offset {o} where {expected} was next"
                ));
            }
            *expected += 1;
        }
        Ok(())
    };
    for (mode, group) in [("--orderly", "ord"), ("", "conc")] {
        let records = RECORDS.to_string();
        let mut args = vec![
            "--topic",
            "o",
            "--group",
            group,
            "--from-beginning",
            "--workers",
            "4",
            "--nack-every",
            "300",
            "--max-messages",
            &records,
        ];
        if !mode.is_empty() {
            args.push(mode);
        }
        let (mut child, out) = member(dir.path(), group, &bootstrap, &args);
        let status = eventually("the consumer finishes", Duration::from_secs(120), || {
            let done = child.try_wait().unwrap();
            async move { done }
        })
        .await;
        assert!(status.success(), "{group} failed");
        let rows = lines_of(&out);
        let indexes: BTreeSet<usize> = rows.iter().map(|r| r.2).collect();
        assert_eq!(rows.len(), RECORDS, "{group}: each record once");
        assert_eq!(indexes.len(), RECORDS, "{group}: each record once");
        let order = in_order(&rows);
        if mode == "--orderly" {
            order.unwrap();
        } else {
            assert!(order.is_err(), "concurrent nacks reorder records");
        }
        assert_eq!(
            total_lag(&bootstrap, group, 3),
            Some(0),
            "{group} committed all"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_push_consumer_follows_a_killed_leader() {
    const RECORDS: usize = 6000;
    let mut c = BrokerCluster::start_with(3, &[("TIDELOG_REPLICA_LAG_TIME_MAX_MS", "1500")]);
    let admin = AdminClient::new(vec![c.controller_address()], Duration::from_secs(10));
    admin
        .create_topic("f", Some(2), Some(3), Default::default())
        .await
        .unwrap();
    let leaders = eventually(
        "partitions led, replicas in sync",
        Duration::from_secs(30),
        || async {
            let t = admin.describe_topics(vec!["f".into()]).await.ok()?;
            let t = t.topics.first()?.topic.clone()?;
            t.partitions
                .iter()
                .all(|p| p.leader.is_some() && p.isr.len() == 3)
                .then(|| {
                    t.partitions
                        .iter()
                        .map(|p| p.leader.unwrap())
                        .collect::<Vec<_>>()
                })
        },
    )
    .await;
    let bootstrap = c.bootstrap();
    let joined = bootstrap.join(",");
    let dir = tempfile::tempdir().unwrap();
    let (mut child, out) = member(
        dir.path(),
        "f",
        &joined,
        &[
            "--topic",
            "f",
            "--group",
            "pf",
            "--from-beginning",
            "--timeout-ms",
            "20000",
        ],
    );
    produce(&bootstrap, "f", 0, RECORDS / 2, 50).await;
    eventually(
        "the first half is consumed",
        Duration::from_secs(60),
        || async { (lines_of(&out).len() >= RECORDS / 2).then_some(()) },
    )
    .await;
    let victim = leaders[0];
    c.brokers[victim as usize - 1].as_mut().unwrap().kill9();
    produce(&bootstrap, "f", RECORDS / 2, RECORDS, 50).await;
    let seen = eventually(
        "every record is consumed",
        Duration::from_secs(90),
        || async {
            let seen: BTreeSet<usize> = lines_of(&out).into_iter().map(|r| r.2).collect();
            (seen.len() == RECORDS).then_some(seen)
        },
    )
    .await;
    assert_eq!(seen, (0..RECORDS).collect());
    let _ = child.kill();
    let _ = child.wait();
}

/// What the listener of [`a_listener_that_sleeps_and_fails_at_random`] saw.
#[derive(Default)]
struct Seen {
    /// (partition, offset, key, sequence) of each successful delivery, in order.
    done: Vec<(u32, i64, String, u64)>,
    /// Records of each partition in the listener now, and the most ever at once.
    inside: BTreeMap<u32, usize>,
    most_inside: usize,
    attempts: u64,
}

/// A listener that sleeps 0-2 ms and answers "later" for about one first attempt in 12
/// and one second attempt in 3 (pseudo-random from the record, so runs repeat).
struct Flaky(std::sync::Arc<std::sync::Mutex<Seen>>);

#[tonic::async_trait]
impl tidelog::client::push_consumer::MessageListener for Flaky {
    async fn consume(
        &self,
        record: &tidelog::client::consumer::ConsumerRecord,
        attempt: u32,
    ) -> tidelog::client::push_consumer::ConsumeResult {
        use tidelog::client::push_consumer::ConsumeResult;
        {
            let mut s = self.0.lock().unwrap();
            s.attempts += 1;
            let n = s.inside.entry(record.partition).or_default();
            *n += 1;
            let n = *n;
            s.most_inside = s.most_inside.max(n);
        }
        let h = (record.offset as u64 + 1)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(u64::from(record.partition) << 40)
            .rotate_left(attempt * 7);
        tokio::time::sleep(Duration::from_millis(h % 3)).await;
        let fail = match attempt {
            1 => h.is_multiple_of(12),
            2 => h.is_multiple_of(3),
            _ => false,
        };
        let mut s = self.0.lock().unwrap();
        *s.inside.get_mut(&record.partition).unwrap() -= 1;
        if fail {
            return ConsumeResult::Later;
        }
        let text =
            String::from_utf8_lossy(record.value.as_deref().unwrap_or_default()).into_owned();
        let (key, seq) = text.split_once(':').expect("key:seq");
        // A record answered "later" in concurrent mode comes back from the group's
        // retry topic: count it at its first position.
        let (_, partition, offset) = tidelog::client::retry::RetryInfo::of(record).origin;
        s.done
            .push((partition, offset, key.to_owned(), seq.parse().unwrap()));
        ConsumeResult::Success
    }
}

/// The listener test: 6 partitions of keyed records carrying per-key sequence
/// numbers; a listener that sleeps at random and sometimes answers "later". Orderly:
/// never two records of a partition in the listener at once, each partition's records
/// done in offset order and each key's in sequence order, each once, none skipped.
/// Concurrent with 16 workers ("later" records come back through the group's retry
/// topic): every record done (at least once), and the group's lag
/// reaches 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_listener_that_sleeps_and_fails_at_random() {
    use std::sync::{Arc, Mutex};
    use tidelog::client::group_consumer::{GroupConfig, OffsetReset};
    use tidelog::client::push_consumer::{ListenMode, PushConfig, PushConsumer};
    const RECORDS: u64 = 2400;
    const KEYS: u64 = 24;
    let (_dir, _server, bootstrap) = common::server_with_topic("seq", 6).await;
    let producer = Producer::new(vec![bootstrap.clone()], ProducerConfig::default());
    let mut futures = Vec::new();
    for i in 0..RECORDS {
        let (key, seq) = (i % KEYS, i / KEYS);
        futures.push(
            producer
                .send(ProducerRecord {
                    topic: "seq".into(),
                    key: Some(Bytes::from(format!("k{key}"))),
                    value: Some(Bytes::from(format!("k{key}:{seq}"))),
                    ..Default::default()
                })
                .await,
        );
    }
    for f in futures {
        f.await.expect("acknowledged");
    }
    drop(producer);

    for (mode, group) in [
        (ListenMode::Orderly, "seq-ord"),
        (ListenMode::Concurrent, "seq-conc"),
    ] {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let consumer = PushConsumer::start(
            vec![bootstrap.clone()],
            PushConfig {
                group: GroupConfig {
                    group: group.into(),
                    topics: vec!["seq".into()],
                    auto_offset_reset: OffsetReset::Earliest,
                    auto_commit_interval: Duration::from_millis(200),
                    ..Default::default()
                },
                mode,
                workers: 16,
                local_retries: 10,
                retry_pause: Duration::from_millis(10),
                orderly_retry_pause: Duration::from_millis(10),
                ..Default::default()
            },
            Arc::new(Flaky(seen.clone())),
        )
        .unwrap();
        eventually("every record done", Duration::from_secs(120), || {
            let done = seen.lock().unwrap().done.len() as u64;
            async move { (done >= RECORDS).then_some(()) }
        })
        .await;
        // Commits catch up with what is done.
        eventually("lag 0", Duration::from_secs(30), || async {
            (total_lag(&bootstrap, group, 6)? == 0).then_some(())
        })
        .await;
        consumer.shutdown().await.unwrap();
        let s = seen.lock().unwrap();
        assert!(
            s.attempts > RECORDS + RECORDS / 20,
            "{group}: the listener failed some records ({} attempts)",
            s.attempts
        );
        let distinct: BTreeSet<(u32, i64)> = s.done.iter().map(|(p, o, ..)| (*p, *o)).collect();
        assert_eq!(distinct.len() as u64, RECORDS, "{group}: every record done");
        if mode == ListenMode::Orderly {
            assert_eq!(s.most_inside, 1, "one record of a partition at a time");
            assert_eq!(s.done.len() as u64, RECORDS, "each record done once");
            let mut next_offset: BTreeMap<u32, i64> = BTreeMap::new();
            let mut next_seq: BTreeMap<&str, u64> = BTreeMap::new();
            for (p, o, key, seq) in &s.done {
                let want = next_offset.entry(*p).or_insert(0);
                assert_eq!(o, want, "partition {p} in offset order");
                *want += 1;
                let want = next_seq.entry(key.as_str()).or_insert(0);
                assert_eq!(seq, want, "key {key} in sequence order");
                *want += 1;
            }
        } else {
            assert!(
                s.most_inside > 1,
                "concurrent: a partition's records run together"
            );
        }
    }
}
