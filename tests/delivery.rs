//! The producer's delivery guarantees against a real server: an idempotent producer whose
//! requests time out and are retried (the server is paused with SIGSTOP while they are in
//! flight) still leaves every record exactly once, at the offset it was acknowledged with;
//! and the send modes (sync, async, callback, oneway) and a custom partition selector.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{read_all, Proc};
use tidelog::client::producer::{PartitionSelector, Producer, ProducerConfig, ProducerRecord};

fn record(topic: &str, value: String) -> ProducerRecord {
    ProducerRecord {
        topic: topic.to_owned(),
        value: Some(Bytes::from(value)),
        ..Default::default()
    }
}

/// Runs the pause scenario; returns the acknowledged (value -> (partition, offset)) and
/// everything the topic holds afterwards.
async fn produce_through_pauses(
    server: &Proc,
    bootstrap: &str,
    topic: &str,
    idempotent: bool,
) -> (BTreeMap<String, (u32, i64)>, Vec<(u32, i64, String)>) {
    let producer = Arc::new(Producer::new(
        vec![bootstrap.to_owned()],
        ProducerConfig {
            acks: -1,
            linger: Duration::from_millis(2),
            request_timeout: Duration::from_millis(300),
            retry_backoff: Duration::from_millis(50),
            delivery_timeout: Duration::from_secs(60),
            enable_idempotence: idempotent,
            ..Default::default()
        },
    ));
    let writer = {
        let producer = producer.clone();
        let topic = topic.to_owned();
        tokio::spawn(async move {
            let mut pending = Vec::new();
            for i in 0..3000 {
                let value = format!("v{i}");
                pending.push((value.clone(), producer.send(record(&topic, value)).await));
                if i % 100 == 0 {
                    tokio::time::sleep(Duration::from_millis(15)).await;
                }
            }
            let mut acked = BTreeMap::new();
            for (value, outcome) in pending {
                let m = outcome.await.expect("every record is delivered");
                acked.insert(value, (m.partition, m.offset));
            }
            acked
        })
    };
    // Pause the server three times while requests are in flight: they time out on the
    // client, are retried, and the originals are processed when the server resumes.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(120)).await;
        server.signal(libc::SIGSTOP);
        tokio::time::sleep(Duration::from_millis(900)).await;
        server.signal(libc::SIGCONT);
    }
    let acked = writer.await.unwrap();
    let stored = read_all(&[bootstrap.to_owned()], topic, 3).await;
    (acked, stored)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retried_requests_never_duplicate_with_idempotence() {
    let (_dir, server, bootstrap) = common::server_with_topic("idem", 3).await;

    let (acked, stored) = produce_through_pauses(&server, &bootstrap, "idem", true).await;
    assert_eq!(acked.len(), 3000);
    let mut seen: BTreeMap<&str, (u32, i64)> = BTreeMap::new();
    for (p, o, v) in &stored {
        assert!(
            seen.insert(v.as_str(), (*p, *o)).is_none(),
            "record {v} stored twice"
        );
    }
    assert_eq!(stored.len(), 3000, "every record stored exactly once");
    for (v, at) in &acked {
        assert_eq!(
            seen.get(v.as_str()),
            Some(at),
            "{v} is at its acknowledged offset"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn send_modes_and_a_custom_partition_selector() {
    let (_dir, _server, bootstrap) = common::server_with_topic("modes", 4).await;
    // The selector sends a record to the partition named by its value's last digit.
    let producer = Producer::new(
        vec![bootstrap.clone()],
        ProducerConfig {
            partition_selector: Some(PartitionSelector::new(|r, n| {
                let v = r.value.as_ref().unwrap();
                u32::from(v[v.len() - 1] - b'0') % n
            })),
            ..Default::default()
        },
    );
    // sync
    let m = producer
        .send_sync(record("modes", "sync-1".into()))
        .await
        .unwrap();
    assert_eq!((m.partition, m.offset), (1, 0));
    // async
    let future = producer.send(record("modes", "async-2".into())).await;
    let m = future.await.unwrap();
    assert_eq!((m.partition, m.offset), (2, 0));
    // callback
    let (tx, rx) = tokio::sync::oneshot::channel();
    producer
        .send_with_callback(record("modes", "callback-3".into()), move |r| {
            let _ = tx.send(r);
        })
        .await;
    let m = rx.await.unwrap().unwrap();
    assert_eq!((m.partition, m.offset), (3, 0));
    // oneway: nothing to wait for; it arrives all the same.
    producer
        .send_oneway(record("modes", "oneway-0".into()))
        .await;
    producer.flush().await;
    let stored = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let all = read_all(std::slice::from_ref(&bootstrap), "modes", 4).await;
            if all.len() == 4 {
                return all;
            }
        }
    })
    .await
    .expect("the oneway record arrives");
    let by_value: BTreeMap<&str, (u32, i64)> = stored
        .iter()
        .map(|(p, o, v)| (v.as_str(), (*p, *o)))
        .collect();
    assert_eq!(by_value["oneway-0"], (0, 0));
    assert_eq!(by_value["sync-1"], (1, 0));
}

/// The same pauses without idempotence do write retried batches twice: proof that the
/// scenario above really retries requests the server had already received.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_retries_duplicate_without_idempotence() {
    let (_dir, server, bootstrap) = common::server_with_topic("dup", 3).await;
    let (acked, stored) = produce_through_pauses(&server, &bootstrap, "dup", false).await;
    assert_eq!(acked.len(), 3000);
    assert!(
        stored.len() > acked.len(),
        "expected duplicates from retries without idempotence, stored {}",
        stored.len()
    );
}

/// Sends from several tasks at once to one partition, in small batches so that many are
/// queued behind each other: every record is acknowledged, each task's records at
/// increasing offsets in the order it sent them, all together at the contiguous offsets
/// 0..n, and the log holds each value at the offset it was acknowledged with.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_sends_to_one_partition_get_contiguous_offsets_in_send_order() {
    let (_dir, _server, bootstrap) = common::server_with_topic("order", 2).await;
    let producer = Arc::new(Producer::new(
        vec![bootstrap.clone()],
        ProducerConfig {
            acks: -1,
            batch_size: 300,
            linger: Duration::from_millis(1),
            ..Default::default()
        },
    ));
    const TASKS: usize = 4;
    const PER_TASK: usize = 500;
    let mut writers = Vec::new();
    for t in 0..TASKS {
        let producer = producer.clone();
        writers.push(tokio::spawn(async move {
            let mut futures = Vec::with_capacity(PER_TASK);
            for i in 0..PER_TASK {
                let mut r = record("order", format!("t{t}-{i}"));
                r.partition = Some(1);
                futures.push(producer.send(r).await);
            }
            let mut offsets = Vec::with_capacity(PER_TASK);
            for f in futures {
                let m = f.await.expect("acknowledged");
                assert_eq!(m.partition, 1);
                offsets.push(m.offset);
            }
            offsets
        }));
    }
    let mut acked: BTreeMap<i64, String> = BTreeMap::new();
    for (t, w) in writers.into_iter().enumerate() {
        let offsets = w.await.unwrap();
        assert!(
            offsets.windows(2).all(|w| w[0] < w[1]),
            "task {t}: offsets follow send order: {offsets:?}"
        );
        for (i, o) in offsets.into_iter().enumerate() {
            assert!(
                acked.insert(o, format!("t{t}-{i}")).is_none(),
                "offset {o} twice"
            );
        }
    }
    let all: Vec<i64> = acked.keys().copied().collect();
    assert_eq!(all, (0..(TASKS * PER_TASK) as i64).collect::<Vec<_>>());
    let stored = read_all(std::slice::from_ref(&bootstrap), "order", 2).await;
    assert_eq!(stored.len(), TASKS * PER_TASK);
    for (p, o, v) in stored {
        assert_eq!(p, 1);
        assert_eq!(acked.get(&o), Some(&v), "offset {o}");
    }
}

/// With a linger far beyond the test, only flush sends: when it returns, every record
/// sent before it is acknowledged and stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flush_sends_and_completes_everything_sent_before_it() {
    let (_dir, _server, bootstrap) = common::server_with_topic("flush", 3).await;
    let producer = Producer::new(
        vec![bootstrap.clone()],
        ProducerConfig {
            linger: Duration::from_secs(3600),
            batch_size: 1 << 20,
            partitioning: tidelog::client::partitioner::Partitioning::RoundRobin,
            ..Default::default()
        },
    );
    let mut futures = Vec::new();
    for i in 0..300 {
        futures.push(producer.send(record("flush", format!("f{i}"))).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        futures.iter().all(|f| f.try_result().is_none()),
        "nothing is sent before the linger ends or a flush"
    );
    tokio::time::timeout(Duration::from_secs(20), producer.flush())
        .await
        .expect("flush returns");
    for f in &futures {
        assert!(
            matches!(f.try_result(), Some(Ok(_))),
            "acknowledged when flush returns"
        );
    }
    let stored = read_all(std::slice::from_ref(&bootstrap), "flush", 3).await;
    assert_eq!(stored.len(), 300);
}
