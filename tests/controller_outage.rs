//! The data plane without the controller quorum: 3 controllers and 3 brokers, a topic
//! with replication factor 3 and `min.insync.replicas=2`, idempotent acks=all producers
//! and a consumer group, while every controller is killed -9. Producers keep being
//! acknowledged, a new producer process starts, a new member joins the group, consumers
//! keep reading, and admin writes fail fast with the retriable CONTROLLER_UNAVAILABLE.
//! After the controllers return no leadership has moved and every acknowledged record is
//! stored exactly once, in order. A second test also loses a broker during the outage.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{eventually, read_all, BrokerCluster};
use parking_lot::Mutex;
use tidelog::api::proto::TopicState;
use tidelog::client::group_consumer::{GroupConfig, GroupConsumer, OffsetReset};
use tidelog::client::producer::{Producer, ProducerConfig, ProducerRecord};
use tidelog::client::AdminClient;

const TOPIC: &str = "outage";
const PARTITIONS: u32 = 6;

/// The two tests each run six processes: one at a time on a small machine.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long every controller stays down (`OUTAGE_TEST_SECS`, default 60).
fn outage() -> Duration {
    Duration::from_secs(
        std::env::var("OUTAGE_TEST_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(60),
    )
}

/// One acknowledged record: when it was sent and acknowledged, and where it landed.
#[derive(Debug, Clone)]
struct Ack {
    value: String,
    partition: u32,
    offset: i64,
    sent: Instant,
    acked: Instant,
}

/// An idempotent acks=all producer sending `prefix-N` records one at a time (so order
/// per partition is the send order) until stopped.
struct Writer {
    acks: Arc<Mutex<Vec<Ack>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    /// Keyed records over every partition, or round robin over `partitions` when given.
    fn start(
        bootstrap: Vec<String>,
        prefix: &'static str,
        acks: i32,
        partitions: Option<Vec<u32>>,
    ) -> Writer {
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let producer = Producer::new(
            bootstrap,
            ProducerConfig {
                acks,
                linger: Duration::from_millis(1),
                request_timeout: Duration::from_secs(2),
                retry_backoff: Duration::from_millis(100),
                delivery_timeout: Duration::from_secs(300),
                enable_idempotence: acks == -1,
                ..Default::default()
            },
        );
        let task = {
            let (log, stop) = (log.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let value = format!("{prefix}-{i}");
                    let sent = Instant::now();
                    let m = producer
                        .send_sync(ProducerRecord {
                            topic: TOPIC.to_owned(),
                            partition: partitions.as_ref().map(|ps| ps[i as usize % ps.len()]),
                            key: Some(Bytes::from(format!("k{}", i % 64))),
                            value: Some(Bytes::from(value.clone())),
                            ..Default::default()
                        })
                        .await
                        .unwrap_or_else(|e| panic!("{value} not delivered: {e}"));
                    log.lock().push(Ack {
                        value,
                        partition: m.partition,
                        offset: m.offset,
                        sent,
                        acked: Instant::now(),
                    });
                    i += 1;
                    // About 200 records/s: a steady load whose rate says whether writes
                    // flow, not how fast this machine is.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        };
        Writer {
            acks: log,
            stop,
            task,
        }
    }

    /// Acknowledgements in `[from, to)`: count and p99 latency (ms).
    fn window(&self, from: Instant, to: Instant) -> (usize, f64) {
        let log = self.acks.lock();
        let mut latencies: Vec<f64> = log
            .iter()
            .filter(|a| a.acked >= from && a.acked < to)
            .map(|a| (a.acked - a.sent).as_secs_f64() * 1000.0)
            .collect();
        latencies.sort_by(f64::total_cmp);
        let p99 = latencies
            .get((latencies.len() * 99 / 100).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN);
        (latencies.len(), p99)
    }

    async fn finish(self) -> Vec<Ack> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.expect("writer");
        Arc::try_unwrap(self.acks)
            .map(|m| m.into_inner())
            .unwrap_or_else(|a| a.lock().clone())
    }
}

/// A group member polling in a task; counts what it read.
struct Member {
    read: Arc<Mutex<Vec<(u32, i64)>>>,
    assigned: Arc<Mutex<usize>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Member {
    fn start(bootstrap: Vec<String>, name: &str) -> Member {
        let read = Arc::new(Mutex::new(Vec::new()));
        let assigned = Arc::new(Mutex::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut consumer = GroupConsumer::new(
            bootstrap,
            GroupConfig {
                group: "outage-readers".into(),
                topics: vec![TOPIC.into()],
                client_id: name.into(),
                session_timeout: Duration::from_secs(10),
                auto_commit_interval: Duration::from_secs(1),
                auto_offset_reset: OffsetReset::Earliest,
                ..Default::default()
            },
        );
        let task = {
            let (read, assigned, stop) = (read.clone(), assigned.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(records) = consumer.poll(Duration::from_millis(200)).await {
                        read.lock()
                            .extend(records.iter().map(|r| (r.partition, r.offset)));
                    }
                    *assigned.lock() = consumer.assignment().len();
                }
                let _ = consumer.close().await;
            })
        };
        Member {
            read,
            assigned,
            stop,
            task,
        }
    }

    fn count(&self) -> usize {
        self.read.lock().len()
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = tokio::time::timeout(Duration::from_secs(20), self.task).await;
    }
}

fn admin(c: &BrokerCluster) -> AdminClient {
    AdminClient::new(c.bootstrap(), Duration::from_secs(20))
}

async fn topic(c: &BrokerCluster) -> TopicState {
    admin(c)
        .describe_topics(vec![TOPIC.to_owned()])
        .await
        .expect("describe")
        .topics
        .remove(0)
        .topic
        .expect("topic")
}

/// Creates the topic and waits until every partition is led with its full ISR.
async fn create_topic(c: &BrokerCluster) -> TopicState {
    admin(c)
        .create_topic(
            TOPIC,
            Some(PARTITIONS),
            Some(3),
            [("min.insync.replicas".to_owned(), "2".to_owned())].into(),
        )
        .await
        .expect("create topic");
    eventually("every replica in sync", Duration::from_secs(30), || async {
        let t = topic(c).await;
        t.partitions
            .iter()
            .all(|p| p.leader.is_some() && p.isr.len() == 3)
            .then_some(t)
    })
    .await
}

/// Runs `tidelog ARGS` with `input` on stdin; returns (success, stderr, elapsed).
fn run_cli(args: &[&str], input: &str) -> (bool, String, Duration) {
    let started = Instant::now();
    let (ok, _, stderr) = common::cli_stdin(args, input);
    (ok, stderr, started.elapsed())
}

/// `tidelog topics create --topic later` through the brokers.
fn create_later_topic(bootstrap: &[String]) -> (bool, String, Duration) {
    run_cli(
        &[
            "topics",
            "create",
            "--bootstrap",
            &bootstrap.join(","),
            "--topic",
            "later",
        ],
        "",
    )
}

/// Every acknowledged record is stored exactly once at its acknowledged place, and each
/// writer's records are in send order within a partition.
fn verify(acks: &[Ack], stored: &[(u32, i64, String)]) {
    let mut at: BTreeMap<(u32, i64), &str> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for (p, o, v) in stored {
        at.insert((*p, *o), v);
        assert!(seen.insert(v.as_str()), "{v} is stored twice");
    }
    for a in acks {
        assert_eq!(
            at.get(&(a.partition, a.offset)).copied(),
            Some(a.value.as_str()),
            "{} acknowledged at {}@{} is not there",
            a.value,
            a.partition,
            a.offset
        );
    }
    let mut last: BTreeMap<(String, u32), (u64, i64)> = BTreeMap::new();
    for a in acks {
        let (prefix, n) = a.value.rsplit_once('-').unwrap();
        let n: u64 = n.parse().unwrap();
        if let Some((prev_n, prev_offset)) =
            last.insert((prefix.to_owned(), a.partition), (n, a.offset))
        {
            assert!(
                n > prev_n && a.offset > prev_offset,
                "{prefix}: record {n} at offset {} follows record {prev_n} at {prev_offset} in partition {}",
                a.offset,
                a.partition
            );
        }
    }
}

/// The topic as the controllers describe it (None while they do not answer).
async fn controllers_view(c: &BrokerCluster) -> Option<TopicState> {
    AdminClient::new(c.controller_addresses(), Duration::from_secs(2))
        .describe_topics(vec![TOPIC.to_owned()])
        .await
        .ok()?
        .topics
        .pop()?
        .topic
}

fn leaders(t: &TopicState) -> Vec<(Option<i32>, i32)> {
    t.partitions
        .iter()
        .map(|p| (p.leader, p.leader_epoch))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_data_plane_keeps_serving_while_every_controller_is_down() {
    let _serial = SERIAL.lock().await;
    let mut c = BrokerCluster::build(3, 3, &[], false);
    let before = create_topic(&c).await;
    let bootstrap = c.bootstrap();
    let p1 = Writer::start(bootstrap.clone(), "p1", -1, None);
    let p2 = Writer::start(bootstrap.clone(), "p2", -1, None);
    let members: Vec<Member> = (0..3)
        .map(|i| Member::start(bootstrap.clone(), &format!("m{i}")))
        .collect();
    eventually(
        "every member has partitions",
        Duration::from_secs(30),
        || async { members.iter().all(|m| *m.assigned.lock() > 0).then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let baseline_start = Instant::now();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let baseline_end = Instant::now();

    // Every controller dies.
    for id in 1..=3 {
        c.controllers.kill9(id);
    }
    let down_at = Instant::now();
    let read_before = members.iter().map(Member::count).sum::<usize>();
    // Past the brokers' session timeout (3 s) and their old lease.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during_start = Instant::now();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let during_end = Instant::now();

    // A new producer process starts and writes.
    let lines: String = (0..20).map(|i| format!("new-{i}\n")).collect();
    let (ok, err, new_producer_took) = run_cli(
        &[
            "produce",
            "--bootstrap",
            &bootstrap.join(","),
            "--topic",
            TOPIC,
            "--acks",
            "all",
        ],
        &lines,
    );
    assert!(ok, "a new producer works during the outage: {err}");
    // An admin write fails at once with the retriable code.
    let (ok, err, admin_took) = create_later_topic(&bootstrap);
    assert!(!ok, "creating a topic needs the controllers");
    assert!(
        err.contains("CONTROLLER_UNAVAILABLE"),
        "the admin error names the outage: {err}"
    );
    assert!(
        admin_took < Duration::from_secs(5),
        "admin writes fail fast, not after a timeout: {admin_took:?}"
    );
    // A new member joins the group and gets partitions.
    let newcomer = Member::start(bootstrap.clone(), "m-new");
    eventually(
        "the new member gets partitions",
        Duration::from_secs(30),
        || async { (*newcomer.assigned.lock() > 0).then_some(()) },
    )
    .await;
    // Topic listings still answer, from the brokers' metadata.
    assert_eq!(leaders(&topic(&c).await), leaders(&before));
    let remaining = outage().saturating_sub(down_at.elapsed());
    tokio::time::sleep(remaining).await;
    let read_during = members.iter().map(Member::count).sum::<usize>() - read_before;
    assert!(read_during > 0, "consumers keep reading during the outage");

    // The controllers return.
    for id in 1..=3 {
        c.controllers.start_node(id);
    }
    let back_at = Instant::now();
    let healed = eventually("the cluster heals", Duration::from_secs(60), || async {
        let t = controllers_view(&c).await?;
        t.partitions.iter().all(|p| p.isr.len() == 3).then_some(t)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let after_end = Instant::now();
    assert_eq!(
        leaders(&healed),
        leaders(&before),
        "no leadership moved, and no leader epoch changed"
    );
    let (ok, err, _) = create_later_topic(&bootstrap);
    assert!(ok, "admin writes work again: {err}");

    let mut figures = Vec::new();
    for (name, w) in [("p1", &p1), ("p2", &p2)] {
        let (before_n, before_p99) = w.window(baseline_start, baseline_end);
        let (during_n, during_p99) = w.window(during_start, during_end);
        let (after_n, after_p99) = w.window(back_at, after_end);
        let rate = |n: usize, from: Instant, to: Instant| n as f64 / (to - from).as_secs_f64();
        let (r_before, r_during, r_after) = (
            rate(before_n, baseline_start, baseline_end),
            rate(during_n, during_start, during_end),
            rate(after_n, back_at, after_end),
        );
        figures.push(format!(
            "{name}: before {r_before:.0}/s p99 {before_p99:.1} ms; during {r_during:.0}/s p99 {during_p99:.1} ms; after {r_after:.0}/s p99 {after_p99:.1} ms"
        ));
        assert!(
            r_during >= r_before / 2.0,
            "{name} keeps being acknowledged during the outage: {r_during:.0}/s vs {r_before:.0}/s before"
        );
    }
    eprintln!(
        "outage figures: {}; a new producer process took {new_producer_took:?}; a refused admin write took {admin_took:?}",
        figures.join("; ")
    );

    let mut acks = p1.finish().await;
    acks.extend(p2.finish().await);
    for m in members {
        m.stop().await;
    }
    newcomer.stop().await;
    let stored = read_all(&bootstrap, TOPIC, PARTITIONS).await;
    verify(&acks, &stored);
    for i in 0..20 {
        assert!(
            stored.iter().any(|(_, _, v)| *v == format!("new-{i}")),
            "new-{i} from the producer started during the outage is stored"
        );
    }
}

/// A broker dies while no controller can fence it: partitions it led have no leader
/// until the controllers return, and partitions whose ISR holds it keep serving reads
/// and acks=1 writes, while acks=all writes wait for the ISR rule (the dead broker stays
/// in the ISR until a controller removes it). Once the controllers return, they fence
/// it, elect leaders, shrink the ISRs, and every waiting acks=all record is delivered
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_lost_during_the_outage_is_fenced_when_the_controllers_return() {
    let _serial = SERIAL.lock().await;
    let mut c = BrokerCluster::build(3, 3, &[], false);
    let before = create_topic(&c).await;
    let bootstrap = c.bootstrap();
    // Broker 3 will die during the outage; the acks=1 writer uses the partitions the
    // others lead.
    let dead = 3;
    let live_led: Vec<u32> = before
        .partitions
        .iter()
        .filter(|p| p.leader != Some(dead))
        .map(|p| p.partition)
        .collect();
    let all = Writer::start(bootstrap.clone(), "all", -1, None);
    let one = Writer::start(bootstrap.clone(), "one", 1, Some(live_led.clone()));
    tokio::time::sleep(Duration::from_secs(3)).await;
    for id in 1..=3 {
        c.controllers.kill9(id);
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    // Broker 3 dies too; nobody can fence it.
    c.brokers[dead as usize - 1].take().unwrap().kill9();
    let died_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let window_start = Instant::now();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let window_end = Instant::now();
    // acks=1 writes to partitions led by live brokers keep being acknowledged.
    let (one_n, _) = one.window(window_start, window_end);
    assert!(
        one_n > 0,
        "acks=1 writes to partitions led by live brokers continue"
    );
    // acks=all waits: the dead broker is still in every ISR.
    let (all_n, _) = all.window(window_start, window_end);
    eprintln!(
        "with a broker lost during the outage: acks=1 {one_n} acknowledged in 8 s, acks=all {all_n}"
    );
    // Reads of live-led partitions keep working.
    let mut consumer =
        tidelog::client::consumer::Consumer::new(bootstrap.clone(), Duration::from_secs(10));
    consumer
        .assign(
            TOPIC,
            live_led[0],
            tidelog::client::consumer::StartAt::Earliest,
        )
        .await
        .expect("assign");
    let got = consumer
        .poll(Duration::from_secs(5))
        .await
        .expect("fetch during the outage");
    assert!(!got.is_empty(), "reads keep working");

    for id in 1..=3 {
        c.controllers.start_node(id);
    }
    let healed = eventually(
        "leaders move off the dead broker",
        Duration::from_secs(60),
        || async {
            let t = controllers_view(&c).await?;
            t.partitions
                .iter()
                .all(|p| p.leader.is_some() && p.leader != Some(dead) && !p.isr.contains(&dead))
                .then_some(t)
        },
    )
    .await;
    for (b, h) in before.partitions.iter().zip(&healed.partitions) {
        if b.leader != Some(dead) {
            assert_eq!(
                b.leader, h.leader,
                "partition {} kept its live leader",
                b.partition
            );
        }
    }
    // acks=all flows again.
    let resumed = Instant::now();
    eventually("acks=all resumes", Duration::from_secs(30), || async {
        (all.window(resumed, Instant::now()).0 > 0).then_some(())
    })
    .await;
    eprintln!(
        "acks=all resumed {:?} after the broker died",
        died_at.elapsed()
    );
    let acks_all = all.finish().await;
    let acks_one = one.finish().await;
    // The dead broker returns and catches up; then every acks=all record is checked.
    c.start_broker(dead);
    let stored = read_all(&bootstrap, TOPIC, PARTITIONS).await;
    verify(&acks_all, &stored);
    let lost_one = acks_one
        .iter()
        .filter(|a| {
            !stored
                .iter()
                .any(|(p, o, v)| *p == a.partition && *o == a.offset && *v == a.value)
        })
        .count();
    eprintln!("acks=1 records lost: {lost_one} of {}", acks_one.len());
}
