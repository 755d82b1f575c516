//! Transactions against real servers: atomic writes over partitions of two topics seen
//! whole (or never) by read-committed consumers, fencing of an older instance, the
//! coordinator's timeout abort, and coded refusals of bad requests.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{cli, free_ports, standalone};
use futures_util::future::BoxFuture;
use tidelog::client::consumer::{Consumer, StartAt};
use tidelog::client::groups::GroupsAdmin;
use tidelog::client::producer::{Producer, ProducerConfig, ProducerRecord};
use tidelog::client::transactions::{
    CheckVerdict, TransactionCheck, TransactionChecker, TxnClient,
};
use tidelog::client::AdminClient;
use tidelog::error_code::ErrorCode;

/// A standalone server with topics `a` and `b` of 3 partitions each.
async fn server() -> (tempfile::TempDir, common::Proc, String) {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let proc = standalone(dir.path(), port);
    let bootstrap = format!("127.0.0.1:{port}");
    let admin = AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    for t in ["a", "b"] {
        admin
            .create_topic(t, Some(3), Some(1), Default::default())
            .await
            .unwrap();
    }
    (dir, proc, bootstrap)
}

fn transactional(bootstrap: &str, id: &str, timeout: Duration) -> Producer {
    Producer::new(
        vec![bootstrap.to_owned()],
        ProducerConfig {
            transactional_id: Some(id.to_owned()),
            transaction_timeout: timeout,
            linger: Duration::from_millis(1),
            ..Default::default()
        },
    )
}

fn record(topic: &str, partition: u32, value: String) -> ProducerRecord {
    ProducerRecord {
        topic: topic.into(),
        partition: Some(partition),
        value: Some(Bytes::from(value)),
        ..Default::default()
    }
}

/// Every record of topics `a` and `b` from the start, per partition in offset order, read
/// until three polls in a row bring nothing.
async fn read(bootstrap: &str, committed: bool) -> BTreeMap<(String, u32), Vec<String>> {
    let mut consumer = Consumer::new(vec![bootstrap.to_owned()], Duration::from_secs(20));
    consumer.set_read_committed(committed);
    for t in ["a", "b"] {
        for p in 0..3 {
            consumer.assign(t, p, StartAt::Earliest).await.unwrap();
        }
    }
    let mut out: BTreeMap<(String, u32), Vec<String>> = BTreeMap::new();
    let mut idle = 0;
    while idle < 3 {
        let records = consumer.poll(Duration::from_millis(300)).await.unwrap();
        if records.is_empty() {
            idle += 1;
        }
        for r in records {
            idle = 0;
            out.entry((r.topic.clone(), r.partition))
                .or_default()
                .push(String::from_utf8(r.value.unwrap().to_vec()).unwrap());
        }
    }
    out
}

/// The test: 1,000 transactions over 6 partitions of two topics, each committed
/// or aborted at random. A read-committed consumer sees exactly the committed records,
/// each once and in order; a read-uncommitted one sees them all; control batches never
/// reach either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_committed_sees_exactly_the_committed_transactions() {
    const TRANSACTIONS: u64 = 1_000;
    let (dir, _server, bootstrap) = server().await;
    let producer = transactional(&bootstrap, "pipeline", Duration::from_secs(60));
    producer.init_transactions().await.unwrap();
    let mut expected_committed: BTreeMap<(String, u32), Vec<String>> = BTreeMap::new();
    let mut expected_all: BTreeMap<(String, u32), Vec<String>> = BTreeMap::new();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut commits = 0;
    for t in 0..TRANSACTIONS {
        producer.begin_transaction().await.unwrap();
        let mut written = Vec::new();
        for i in 0..(1 + next() % 4) {
            let topic = if next() % 2 == 0 { "a" } else { "b" };
            let partition = (next() % 3) as u32;
            let value = format!("t{t}-{i}");
            drop(producer.send(record(topic, partition, value.clone())).await);
            written.push(((topic.to_owned(), partition), value));
        }
        let commit = next() % 3 != 0;
        if commit {
            producer.commit_transaction().await.unwrap();
            commits += 1;
        } else {
            producer.abort_transaction().await.unwrap();
        }
        for (key, value) in written {
            if commit {
                expected_committed
                    .entry(key.clone())
                    .or_default()
                    .push(value.clone());
            }
            expected_all.entry(key).or_default().push(value);
        }
    }
    assert!(commits > 500 && commits < 800, "{commits} commits");
    let committed = read(&bootstrap, true).await;
    assert_eq!(committed, expected_committed, "read_committed");
    let all = read(&bootstrap, false).await;
    assert_eq!(all, expected_all, "read_uncommitted");
    // The CLI sees the same with --isolation read_committed.
    let (ok, out, err) = cli(&[
        "consume",
        "--bootstrap",
        &bootstrap,
        "--topic",
        "a",
        "--from-beginning",
        "--timeout-ms",
        "2000",
        "--isolation",
        "read_committed",
    ]);
    assert!(ok, "{err}");
    let cli_values: BTreeSet<&str> = out.lines().collect();
    let expected_a: BTreeSet<&str> = expected_committed
        .iter()
        .filter(|((t, _), _)| t == "a")
        .flat_map(|(_, v)| v.iter().map(String::as_str))
        .collect();
    assert_eq!(cli_values, expected_a);
    // dump-log shows the markers and the aborted-transaction index.
    let partition_dir = dir.path().join("data").join("a-0");
    let txnindex = std::fs::read_dir(&partition_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "txnindex"))
        .expect("a .txnindex in a-0");
    let (ok, out, err) = cli(&["dump-log", "--output", "json", txnindex.to_str().unwrap()]);
    assert!(ok, "{err}");
    let entries: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!entries.is_empty());
    assert!(entries
        .iter()
        .all(|e| e["first_offset"].as_u64() < e["last_offset"].as_u64()));
    let log = txnindex.with_extension("log");
    let (ok, out, err) = cli(&["dump-log", "--output", "json", log.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("\"control\":true"), "markers are listed");
}

/// An open transaction holds read-committed consumers back (the records after it too)
/// until the coordinator aborts it at its timeout; the aborted producer is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_transaction_is_aborted_at_its_timeout_and_fenced() {
    let (_dir, _server, bootstrap) = server().await;
    let stuck = transactional(&bootstrap, "stuck", Duration::from_secs(2));
    stuck.init_transactions().await.unwrap();
    stuck.begin_transaction().await.unwrap();
    stuck
        .send_sync(record("a", 0, "open".into()))
        .await
        .unwrap();
    let plain = Producer::new(vec![bootstrap.clone()], ProducerConfig::default());
    plain
        .send_sync(record("a", 0, "after".into()))
        .await
        .unwrap();
    let d = common::cli_json(&[
        "transactions",
        "describe",
        "--bootstrap",
        &bootstrap,
        "--transactional-id",
        "stuck",
        "--output",
        "json",
    ]);
    assert_eq!(d["state"], "Ongoing", "{d}");
    assert_eq!(d["partitions"][0]["topic"], "a", "{d}");
    // Held back while open: the plain record behind it too.
    let early = read(&bootstrap, true).await;
    assert!(early.is_empty(), "{early:?}");
    // The coordinator aborts it after 2 s; then the plain record shows, the open one never.
    common::eventually(
        "the timed-out transaction is aborted",
        Duration::from_secs(20),
        || {
            let bootstrap = bootstrap.clone();
            async move {
                let seen = read(&bootstrap, true).await;
                (seen.get(&("a".to_owned(), 0)) == Some(&vec!["after".to_owned()])).then_some(())
            }
        },
    )
    .await;
    let e = stuck.commit_transaction().await.unwrap_err();
    assert_eq!(e.code, ErrorCode::ProducerFenced, "{e}");
    let (ok, out, _) = cli(&[
        "transactions",
        "list",
        "--bootstrap",
        &bootstrap,
        "--state",
        "CompleteAbort",
    ]);
    assert!(ok && out.contains("stuck"), "{out}");
}

/// A new instance of a transactional id fences the old one: its open transaction is
/// aborted, its writes and its commit are refused, and only the new instance's records
/// are committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_instance_fences_the_old_one() {
    let (_dir, _server, bootstrap) = server().await;
    let old = transactional(&bootstrap, "app", Duration::from_secs(60));
    old.init_transactions().await.unwrap();
    old.begin_transaction().await.unwrap();
    old.send_sync(record("a", 1, "old-1".into())).await.unwrap();
    let new = transactional(&bootstrap, "app", Duration::from_secs(60));
    new.init_transactions().await.unwrap();
    // The old epoch is refused by the partition and by the coordinator.
    let write = old.send_sync(record("a", 1, "old-2".into())).await;
    assert!(
        matches!(write, Err(ref e) if matches!(e.code, ErrorCode::InvalidProducerEpoch | ErrorCode::ProducerFenced)),
        "{write:?}"
    );
    let e = old.commit_transaction().await.unwrap_err();
    assert!(
        matches!(
            e.code,
            ErrorCode::InvalidTxnState | ErrorCode::ProducerFenced
        ),
        "{e}"
    );
    new.begin_transaction().await.unwrap();
    new.send_sync(record("a", 1, "new-1".into())).await.unwrap();
    new.commit_transaction().await.unwrap();
    let seen = read(&bootstrap, true).await;
    assert_eq!(
        seen.get(&("a".to_owned(), 1)),
        Some(&vec!["new-1".to_owned()])
    );
}

/// Bad requests get their codes and change nothing a read-committed consumer sees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_transaction_requests_get_coded_errors() {
    let (_dir, _server, bootstrap) = server().await;
    let client = TxnClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    // Unknown id.
    let e = client.end("nobody", (1, 0), true).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::TransactionalIdNotFound, "{e}");
    let (pid, epoch) = client.init_producer_id("bad", 0).await.unwrap();
    // Commit without begin.
    let e = client.end("bad", (pid, epoch), true).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidTxnState, "{e}");
    // A nonexistent partition, an internal topic.
    let e = client
        .add_partitions("bad", (pid, epoch), &[("a".into(), 7)])
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::UnknownTopicOrPartition, "{e}");
    let e = client
        .add_partitions("bad", (pid, epoch), &[("__transaction_state".into(), 0)])
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidRequest, "{e}");
    // A fenced epoch and a wrong producer id.
    client.init_producer_id("bad", 0).await.unwrap();
    let e = client
        .add_partitions("bad", (pid, epoch), &[("a".into(), 0)])
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::ProducerFenced, "{e}");
    let e = client
        .add_partitions("bad", (pid + 1000, epoch + 1), &[("a".into(), 0)])
        .await
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidProducerIdMapping, "{e}");
    // A timeout above the maximum, an empty id.
    let e = client.init_producer_id("bad", 3_600_000).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidTransactionTimeout, "{e}");
    let e = client.init_producer_id("", 0).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidRequest, "{e}");
    // A producer used without init, or sending outside a transaction.
    let p = transactional(&bootstrap, "lazy", Duration::from_secs(60));
    let e = p.begin_transaction().await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidTxnState, "{e}");
    p.init_transactions().await.unwrap();
    let e = p.send_sync(record("a", 0, "x".into())).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidTxnState, "{e}");
    let e = p.commit_transaction().await.unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidTxnState, "{e}");
    assert!(read(&bootstrap, true).await.is_empty());
}

/// A transactional batch is accepted only from a transactional producer, in a partition
/// added to its open transaction: a client cannot open a transaction that no coordinator
/// would end (read-committed consumers would wait behind it for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_batches_outside_a_transaction_are_refused() {
    use tidelog::api::proto::broker_client::BrokerClient;
    use tidelog::api::proto::{PartitionProduceData, ProduceRequest, TopicProduceData};
    use tidelog::record::{BatchBuilder, Compression, RecordRef};

    let (_dir, _server, bootstrap) = server().await;
    let client = TxnClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    let (pid, epoch) = client.init_producer_id("raw", 0).await.unwrap();
    let mut b = BatchBuilder::new(Compression::None)
        .producer(pid, epoch, 0)
        .transactional(true);
    b.push(RecordRef {
        timestamp: 1,
        key: None,
        value: Some(b"sneaky"),
        headers: &[],
    });
    let batch = b.build(0).unwrap();
    let broker = BrokerClient::connect(format!("http://{bootstrap}"))
        .await
        .unwrap();
    let produce = |id: Option<&str>| {
        let request = ProduceRequest {
            acks: Some(-1),
            timeout_ms: 5_000,
            transactional_id: id.map(str::to_owned),
            topics: vec![TopicProduceData {
                topic: "a".into(),
                partitions: vec![PartitionProduceData {
                    partition: 0,
                    record_batches: batch.clone().into(),
                    ..Default::default()
                }],
            }],
        };
        let mut broker = broker.clone();
        async move {
            let r = broker.produce(request).await.unwrap().into_inner();
            let code = r.topics[0].partitions[0].error_code;
            tidelog::api::status::from_wire(code)
        }
    };
    // Without a transactional id; with one whose transaction does not hold the partition.
    assert_eq!(produce(None).await, Some(ErrorCode::InvalidRecord));
    assert_eq!(produce(Some("raw")).await, Some(ErrorCode::InvalidTxnState));
    // (Its state partition may still be taking leadership: a retriable answer, retried.)
    let mut unknown = produce(Some("nobody")).await;
    for _ in 0..100 {
        if unknown != Some(ErrorCode::CoordinatorLoadInProgress) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        unknown = produce(Some("nobody")).await;
    }
    assert_eq!(unknown, Some(ErrorCode::TransactionalIdNotFound));
    // Nothing was written and nothing holds read-committed consumers back.
    let plain = Producer::new(vec![bootstrap.clone()], ProducerConfig::default());
    plain
        .send_sync(record("a", 0, "plain".into()))
        .await
        .unwrap();
    let seen = read(&bootstrap, true).await;
    assert_eq!(
        seen.get(&("a".to_owned(), 0)),
        Some(&vec!["plain".to_owned()])
    );
    // Once added, the same batch is accepted.
    client
        .add_partitions("raw", (pid, epoch), &[("a".into(), 0)])
        .await
        .unwrap();
    assert_eq!(produce(Some("raw")).await, None);
}

/// Records of `topic` (3 partitions) from the start, read committed or not, as
/// (partition, value) in offset order per partition.
async fn read_topic(bootstrap: &str, topic: &str, committed: bool) -> Vec<(u32, String)> {
    let mut consumer = Consumer::new(vec![bootstrap.to_owned()], Duration::from_secs(20));
    consumer.set_read_committed(committed);
    for p in 0..3 {
        consumer.assign(topic, p, StartAt::Earliest).await.unwrap();
    }
    let mut out = Vec::new();
    let mut idle = 0;
    while idle < 4 {
        let records = consumer.poll(Duration::from_millis(300)).await.unwrap();
        idle = if records.is_empty() { idle + 1 } else { 0 };
        for r in records {
            out.push((
                r.partition,
                String::from_utf8(r.value.unwrap().to_vec()).unwrap(),
            ));
        }
    }
    out
}

/// Sends `sig` to a child process.
fn signal(child: &std::process::Child, sig: i32) {
    // SAFETY: kill(2) on the pid of a child this test spawned and has not reaped.
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
}

/// The sum of `topic`'s high watermarks (3 partitions).
async fn log_end(bootstrap: &str, topic: &str) -> i64 {
    let consumer = Consumer::new(vec![bootstrap.to_owned()], Duration::from_secs(20));
    let mut sum = 0;
    for p in 0..3 {
        sum += consumer.list_offset(topic, p, -1).await.unwrap();
    }
    sum
}

/// The sum of `topic`'s last stable offsets (3 partitions).
async fn last_stable(bootstrap: &str, topic: &str) -> i64 {
    let mut consumer = Consumer::new(vec![bootstrap.to_owned()], Duration::from_secs(20));
    consumer.set_read_committed(true);
    let mut sum = 0;
    for p in 0..3 {
        sum += consumer.list_offset(topic, p, -1).await.unwrap();
    }
    sum
}

/// A copier process, killed when dropped (also when the test fails).
struct Copier(std::process::Child);

impl Drop for Copier {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `tidelog transactions copy` from `in` to `out` as its own process.
fn start_copier(bootstrap: &str, log: &std::path::Path) -> Copier {
    let args = [
        "transactions",
        "copy",
        "--from",
        "in",
        "--to",
        "out",
        "--group",
        "copier",
        "--transactional-id",
        "copier-1",
        "--transaction-timeout-ms",
        "20000",
        "--session-timeout-ms",
        "3000",
        "--bootstrap",
        bootstrap,
    ];
    std::process::Command::new(common::binary())
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .map(Copier)
        .expect("spawn the copier")
}

/// The exactly-once pipeline: a consume-transform-produce copier (reading `in` in a
/// group, writing `out`, committing the group's positions inside each transaction) is
/// killed -9 three times while input keeps arriving; after the last restart drains the
/// input, `out` holds every input record exactly once, in each partition's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exactly_once_copier_survives_three_kill9s() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone(dir.path(), port);
    let bootstrap = format!("127.0.0.1:{port}");
    let admin = AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    for t in ["in", "out"] {
        admin
            .create_topic(t, Some(3), Some(1), Default::default())
            .await
            .unwrap();
    }
    // Input keeps arriving while the copier is killed and restarted.
    let feeder = {
        let bootstrap = bootstrap.clone();
        tokio::spawn(async move {
            let producer = Producer::new(
                vec![bootstrap],
                ProducerConfig {
                    linger: Duration::from_millis(2),
                    ..Default::default()
                },
            );
            let mut sent = 0u32;
            for round in 0..300u32 {
                for i in 0..40u32 {
                    let n = round * 40 + i;
                    producer
                        .send_sync(record("in", n % 3, format!("r{n:06}")))
                        .await
                        .unwrap();
                    sent += 1;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            sent
        })
    };
    let txns = TxnClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    let mut kills = 0;
    let mut seen_before = log_end(&bootstrap, "out").await;
    while kills < 3 {
        let log = dir.path().join(format!("copier-{kills}.stderr"));
        let copier = start_copier(&bootstrap, &log);
        // Once it has made progress since it started, kill it inside a transaction:
        // stop it at varying moments until its transaction is open (for the first and
        // last kill, with the group's offsets already in it), then SIGKILL.
        let progressed = common::eventually("the copier copies", Duration::from_secs(60), || {
            let bootstrap = bootstrap.clone();
            async move {
                let n = log_end(&bootstrap, "out").await;
                (n > seen_before).then_some(n)
            }
        })
        .await;
        let with_offsets = kills != 1;
        let mut hit = None;
        for attempt in 0..400u64 {
            tokio::time::sleep(Duration::from_millis(3 + attempt * 7 % 31)).await;
            signal(&copier.0, libc::SIGSTOP);
            let open = txns
                .describe("copier-1")
                .await
                .ok()
                .filter(|d| d.state == "Ongoing")
                .filter(|d| {
                    !with_offsets || d.topics.iter().any(|t| t.topic == "__consumer_offsets")
                });
            // Records of the open transaction are in the output already.
            if let Some(d) = open {
                if last_stable(&bootstrap, "out").await < log_end(&bootstrap, "out").await {
                    hit = Some(d.topics);
                    break;
                }
            }
            signal(&copier.0, libc::SIGCONT);
        }
        drop(copier);
        let hit = hit.expect("the copier was never caught inside a transaction");
        println!("kill {kills} inside a transaction over {hit:?}");
        kills += 1;
        seen_before = progressed;
        assert!(
            !feeder.is_finished(),
            "the input ran out before kill {kills}"
        );
    }
    let sent = feeder.await.unwrap();
    let log = dir.path().join("copier-last.stderr");
    let mut copier = start_copier(&bootstrap, &log);
    // It runs until the group's committed offsets reach the input's end (lag 0).
    let groups = GroupsAdmin::new(vec![bootstrap.clone()], Duration::from_secs(10));
    let end = log_end(&bootstrap, "in").await;
    common::eventually("the copier catches up", Duration::from_secs(180), || {
        let groups = &groups;
        async move {
            let d = groups.describe("copier").await.ok()?;
            let committed: i64 = d
                .offsets
                .iter()
                .filter(|o| o.topic == "in")
                .map(|o| o.offset)
                .sum();
            (committed == end).then_some(())
        }
    })
    .await;
    assert!(
        copier.0.try_wait().unwrap().is_none(),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    drop(copier);
    let input = read_topic(&bootstrap, "in", false).await;
    assert_eq!(input.len(), sent as usize);
    let output = read_topic(&bootstrap, "out", true).await;
    // Exactly once: the same multiset of values ...
    let mut want: Vec<&str> = input.iter().map(|(_, v)| v.as_str()).collect();
    let mut got: Vec<&str> = output.iter().map(|(_, v)| v.as_str()).collect();
    want.sort_unstable();
    got.sort_unstable();
    let duplicates = got.windows(2).filter(|w| w[0] == w[1]).count();
    assert_eq!(duplicates, 0, "{duplicates} records copied twice");
    assert_eq!(got.len(), want.len(), "records lost or duplicated");
    assert_eq!(got, want);
    // ... and each input partition's order kept in its output partition.
    for p in 0..3 {
        let of = |list: &[(u32, String)]| -> Vec<String> {
            list.iter()
                .filter(|(q, _)| *q == p)
                .map(|(_, v)| v.clone())
                .collect()
        };
        assert_eq!(of(&output), of(&input), "partition {p}");
    }
    // The kills left aborted output behind, which read_committed never showed.
    let uncommitted = read_topic(&bootstrap, "out", false).await.len();
    assert!(uncommitted > output.len(), "no kill left aborted output");
    println!(
        "copied {} records; {} written in all (aborted ones included)",
        output.len(),
        uncommitted
    );
}

/// Answers every check with a fixed verdict (`None`: never answers), counting checks.
struct FixedChecker {
    verdict: Option<CheckVerdict>,
    checks: Arc<AtomicU32>,
}

impl TransactionChecker for FixedChecker {
    fn check(&self, _check: TransactionCheck) -> BoxFuture<'static, CheckVerdict> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        match self.verdict {
            Some(v) => Box::pin(async move { v }),
            None => Box::pin(std::future::pending()),
        }
    }
}

/// RocketMQ-style check-back: producers that begin a transaction, write, and never end
/// it are asked by the coordinator; "commit" makes the records visible, "rollback" never
/// does, and a producer that never gives a verdict (silent, or "unknown") is aborted
/// after `transaction_check_max` checks, long before the transaction's timeout. A
/// producer without a checker is not asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_back_settles_transactions_their_producers_left_open() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = common::standalone_with(
        dir.path(),
        port,
        &[
            ("TIDELOG_TRANSACTION_CHECK_INTERVAL_MS", "1000"),
            ("TIDELOG_TRANSACTION_CHECK_MAX", "3"),
        ],
    );
    let bootstrap = format!("127.0.0.1:{port}");
    let admin = AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    for t in ["a", "b"] {
        admin
            .create_topic(t, Some(3), Some(1), Default::default())
            .await
            .unwrap();
    }
    let cases: [(&str, Option<Option<CheckVerdict>>); 5] = [
        ("commits", Some(Some(CheckVerdict::Commit))),
        ("rolls-back", Some(Some(CheckVerdict::Rollback))),
        ("silent", Some(None)),
        ("unsure", Some(Some(CheckVerdict::Unknown))),
        ("unchecked", None),
    ];
    let mut producers = Vec::new();
    for (i, (id, verdict)) in cases.iter().enumerate() {
        let p = transactional(&bootstrap, id, Duration::from_secs(120));
        p.init_transactions().await.unwrap();
        let checks = Arc::new(AtomicU32::new(0));
        if let Some(verdict) = verdict {
            p.set_transaction_checker(Arc::new(FixedChecker {
                verdict: *verdict,
                checks: checks.clone(),
            }))
            .await
            .unwrap();
        }
        p.begin_transaction().await.unwrap();
        for n in 0..3 {
            p.send_sync(record("a", (i % 3) as u32, format!("{id}-{n}")))
                .await
                .unwrap();
        }
        producers.push((p, checks));
    }
    let txns = TxnClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    for (id, want) in [
        ("commits", "CompleteCommit"),
        ("rolls-back", "CompleteAbort"),
        ("silent", "CompleteAbort"),
        ("unsure", "CompleteAbort"),
    ] {
        common::eventually(
            &format!("{id} ends as {want}"),
            Duration::from_secs(30),
            || {
                let txns = &txns;
                async move { (txns.describe(id).await.ok()?.state == want).then_some(()) }
            },
        )
        .await;
    }
    // Not asked without a checker: still open (its timeout is minutes away).
    assert_eq!(txns.describe("unchecked").await.unwrap().state, "Ongoing");
    // Its partition's last stable offset stays at its first record: `topics describe`
    // shows it, and read-committed ListOffsets answers it for "latest".
    let d = common::cli_json(&[
        "topics",
        "describe",
        "--topic",
        "a",
        "--bootstrap",
        &bootstrap,
        "--output",
        "json",
    ]);
    let p1 = &d["topics"][0]["partitions"][1];
    let (lso, hw) = (
        p1["last_stable_offset"].as_i64().unwrap(),
        p1["high_watermark"].as_i64().unwrap(),
    );
    assert!(lso < hw, "{p1}");
    let mut committed = Consumer::new(vec![bootstrap.clone()], Duration::from_secs(10));
    committed.set_read_committed(true);
    assert_eq!(committed.list_offset("a", 1, -1).await.unwrap(), lso);
    let uncommitted = Consumer::new(vec![bootstrap.clone()], Duration::from_secs(10));
    assert_eq!(uncommitted.list_offset("a", 1, -1).await.unwrap(), hw);
    let (ok, out, _) = cli(&[
        "topics",
        "describe",
        "--topic",
        "a",
        "--bootstrap",
        &bootstrap,
    ]);
    assert!(ok && out.contains(&format!("LastStable: {lso}")), "{out}");
    assert_eq!(producers[4].1.load(Ordering::SeqCst), 0);
    // "unknown" was asked exactly transaction_check_max times; the silent one at least
    // once (its checker never returned).
    assert_eq!(producers[3].1.load(Ordering::SeqCst), 3);
    assert!(producers[2].1.load(Ordering::SeqCst) >= 1);
    // The committing producer learned its transaction ended and carries on.
    let committer = &producers[0].0;
    common::eventually("the producer learns", Duration::from_secs(10), || async {
        committer.begin_transaction().await.ok()
    })
    .await;
    committer
        .send_sync(record("b", 0, "commits-next".into()))
        .await
        .unwrap();
    committer.commit_transaction().await.unwrap();
    // The unchecked one is aborted so the read below can reach the end.
    producers[4].0.abort_transaction().await.unwrap();
    let seen: BTreeSet<String> = read(&bootstrap, true)
        .await
        .into_values()
        .flatten()
        .collect();
    let want: BTreeSet<String> = ["commits-0", "commits-1", "commits-2", "commits-next"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(seen, want);
}

/// Leader of each partition of `topic` (by partition), once every partition has a leader
/// and `isr` in-sync replicas.
async fn leaders(admin: &AdminClient, topic: &str, isr: usize) -> Vec<i32> {
    common::eventually(
        "every partition led and fully in sync",
        Duration::from_secs(30),
        || async move {
            let d = admin.describe_topics(vec![topic.to_owned()]).await.ok()?;
            let t = d.topics.first()?.topic.clone()?;
            t.partitions
                .iter()
                .map(|p| p.leader.filter(|_| p.isr.len() == isr))
                .collect::<Option<Vec<i32>>>()
        },
    )
    .await
}

/// The failover test. A transaction over the three partitions of a topic
/// replicated on three brokers is committed while broker B (leading one of them, and not
/// the coordinator) is paused: the coordinator's broker A makes the decision durable in
/// `__transaction_state` (PrepareCommit) but cannot write B's marker. A is killed -9 right
/// then. After failover (B still paused), the new coordinator C completes the commit:
/// every partition gets its marker, the producer's commit call returns Ok, and a
/// read-committed consumer sees the transaction whole, between the one before and one
/// the same producer commits after (with B back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_decided_before_the_coordinator_dies_completes_after_failover() {
    let mut c = common::BrokerCluster::start_with(
        3,
        &[
            // Long enough that A is killed while the paused B still leads its partition,
            // short enough for a quick failover.
            ("TIDELOG_BROKER_SESSION_TIMEOUT_MS", "8000"),
            // The coordinator's state write waits for the paused follower this long.
            ("TIDELOG_REPLICA_LAG_TIME_MAX_MS", "1000"),
            ("TIDELOG_TRANSACTION_STATE_LOG_NUM_PARTITIONS", "3"),
        ],
    );
    let all = c.bootstrap();
    let admin = AdminClient::new(all.clone(), Duration::from_secs(10));
    admin
        .create_topic("d", Some(3), Some(3), Default::default())
        .await
        .unwrap();
    let led_by = leaders(&admin, "d", 3).await;
    let txns = TxnClient::new(all.clone(), Duration::from_secs(30));
    txns.init_producer_id("failover", 300_000).await.unwrap();
    let a = txns.describe("failover").await.unwrap().coordinator_id;
    let (b_partition, b) = led_by
        .iter()
        .enumerate()
        .map(|(p, l)| (p as u32, *l))
        .find(|(_, l)| *l != a)
        .unwrap_or_else(|| panic!("every partition of d is led by the coordinator {a}"));
    let cc = (1..=3).find(|id| *id != a && *id != b).unwrap();
    // Bootstrapped without B: a call to a paused broker would wait out its timeout.
    let producer = Arc::new(Producer::new(
        vec![c.broker_address(cc), c.broker_address(a)],
        ProducerConfig {
            transactional_id: Some("failover".into()),
            transaction_timeout: Duration::from_secs(300),
            linger: Duration::from_millis(1),
            request_timeout: Duration::from_secs(40),
            ..Default::default()
        },
    ));
    producer.init_transactions().await.unwrap();
    let write = |txn: u32| {
        let producer = producer.clone();
        async move {
            producer.begin_transaction().await.unwrap();
            let mut acks = Vec::new();
            for p in 0..3 {
                for i in 0..10 {
                    acks.push(producer.send(record("d", p, format!("t{txn}-{i}"))).await);
                }
            }
            producer.flush().await;
            for ack in acks {
                ack.await.unwrap();
            }
        }
    };
    write(1).await;
    producer.commit_transaction().await.unwrap();
    // Transaction 2: every record is on all three replicas; then B pauses and the
    // commit begins.
    write(2).await;
    c.brokers[b as usize - 1]
        .as_ref()
        .unwrap()
        .signal(libc::SIGSTOP);
    let commit = tokio::spawn({
        let producer = producer.clone();
        async move { producer.commit_transaction().await }
    });
    let at_a = TxnClient::new(
        vec![c.broker_address(a), c.broker_address(cc)],
        Duration::from_secs(5),
    );
    common::eventually(
        "the coordinator decides to commit",
        Duration::from_secs(30),
        || async {
            let d = at_a.describe("failover").await.ok()?;
            (d.state == "PrepareCommit" && d.coordinator_id == a).then_some(())
        },
    )
    .await;
    c.brokers[a as usize - 1].as_mut().unwrap().kill9();
    // B stays paused until the commit is complete: a marker request of A's queued at B
    // cannot land, and B's partition moves to C with A's. Only C is left to finish the
    // commit: taking over `__transaction_state`, it finds PrepareCommit and writes every
    // marker. The producer's commit call rides out the failover.
    tokio::time::timeout(Duration::from_secs(60), commit)
        .await
        .expect("commit returns")
        .unwrap()
        .unwrap();
    let at_c = TxnClient::new(vec![c.broker_address(cc)], Duration::from_secs(10));
    let d = at_c.describe("failover").await.unwrap();
    assert_eq!(d.state, "CompleteCommit", "{d:?}");
    assert_eq!(d.coordinator_id, cc, "{d:?}");
    let mut lso_reader = Consumer::new(vec![c.broker_address(cc)], Duration::from_secs(10));
    lso_reader.set_read_committed(true);
    let hw_reader = Consumer::new(vec![c.broker_address(cc)], Duration::from_secs(10));
    for p in 0..3 {
        let lso = lso_reader.list_offset("d", p, -1).await.unwrap();
        let hw = hw_reader.list_offset("d", p, -1).await.unwrap();
        assert_eq!(lso, hw, "d-{p} (B led d-{b_partition})");
    }
    c.brokers[b as usize - 1]
        .as_ref()
        .unwrap()
        .signal(libc::SIGCONT);
    let survivor = c.broker_address(cc);
    write(3).await;
    producer.commit_transaction().await.unwrap();
    let expected: Vec<String> = (1..=3)
        .flat_map(|t| (0..10).map(move |i| format!("t{t}-{i}")))
        .collect();
    for committed in [true, false] {
        let seen = read_topic(&survivor, "d", committed).await;
        for p in 0..3 {
            let values: Vec<String> = seen
                .iter()
                .filter(|(q, _)| *q == p)
                .map(|(_, v)| v.clone())
                .collect();
            assert_eq!(values, expected, "d-{p}, read_committed={committed}");
        }
    }
}

/// Values per partition of the first `max` records `tidelog consume args...` prints
/// (JSON lines) from the beginning of topic `a` (it gives up after 30 s without one).
fn consume_values(bootstrap: &str, max: usize, args: &[&str]) -> BTreeMap<u32, Vec<String>> {
    let max = max.to_string();
    let mut all = vec![
        "consume",
        "--bootstrap",
        bootstrap,
        "--topic",
        "a",
        "--from-beginning",
        "--max-messages",
        &max,
        "--timeout-ms",
        "30000",
        "--output",
        "json",
    ];
    all.extend_from_slice(args);
    let (ok, out, err) = cli(&all);
    assert!(ok, "{err}");
    let mut values: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        values
            .entry(v["partition"].as_u64().unwrap() as u32)
            .or_default()
            .push(v["value"].as_str().unwrap().to_owned());
    }
    values
}

/// The group `g` as `groups describe` shows it (JSON), with `extra` flags.
fn describe_group(bootstrap: &str, g: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "groups",
        "describe",
        "--bootstrap",
        bootstrap,
        "--group",
        g,
        "--output",
        "json",
    ];
    args.extend_from_slice(extra);
    common::cli_json(&args)
}

/// Push consumers read committed too: assigned (`consume --push`) and in a group
/// (`consume --push --group`), they get the committed records only, never an aborted
/// transaction's or an open one's, in order; a group whose members read committed has its
/// lag measured against the last stable offset (0 once it consumed every committed
/// record while a transaction stays open), and `--isolation read_uncommitted` shows the
/// lag against the high watermark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_consumers_read_committed_and_group_lag_counts_to_the_last_stable_offset() {
    let (_dir, _server, bootstrap) = server().await;
    let txn = transactional(&bootstrap, "push-rc", Duration::from_secs(120));
    txn.init_transactions().await.unwrap();
    let plain = Producer::new(vec![bootstrap.clone()], ProducerConfig::default());
    let in_txn = |prefix: &'static str| {
        let txn = &txn;
        async move {
            txn.begin_transaction().await.unwrap();
            for p in 0..3 {
                for i in 0..5 {
                    txn.send(record("a", p, format!("{prefix}{p}-{i}"))).await;
                }
            }
            txn.flush().await;
        }
    };
    in_txn("c").await;
    txn.commit_transaction().await.unwrap();
    in_txn("x").await;
    txn.abort_transaction().await.unwrap();
    for p in 0..3 {
        plain
            .send_sync(record("a", p, format!("plain{p}")))
            .await
            .unwrap();
    }
    // Left open: it holds back what follows it too.
    in_txn("o").await;
    for p in 0..3 {
        plain
            .send_sync(record("a", p, format!("late{p}")))
            .await
            .unwrap();
    }
    let committed: BTreeMap<u32, Vec<String>> = (0..3)
        .map(|p| {
            let mut v: Vec<String> = (0..5).map(|i| format!("c{p}-{i}")).collect();
            v.push(format!("plain{p}"));
            (p, v)
        })
        .collect();
    let everything = consume_values(&bootstrap, 3 * 17, &["--push"]);
    assert_eq!(everything[&0].len(), 5 + 5 + 1 + 5 + 1, "{everything:?}");
    let assigned = consume_values(
        &bootstrap,
        3 * 6,
        &["--push", "--isolation", "read_committed"],
    );
    assert_eq!(
        assigned, committed,
        "consume --push --isolation read_committed"
    );
    // The next 6 records of each partition, read by a push consumer of group `rc`.
    let read_in_group = || {
        consume_values(
            &bootstrap,
            3 * 6,
            &[
                "--push",
                "--group",
                "rc",
                "--orderly",
                "--isolation",
                "read_committed",
            ],
        )
    };
    let grouped = read_in_group();
    assert_eq!(
        grouped, committed,
        "consume --push --group --isolation read_committed"
    );
    // The group consumed up to the last stable offset: no lag as it reads; the open
    // transaction and the record behind it are lag to a read-uncommitted reader.
    let d = describe_group(&bootstrap, "rc", &[]);
    assert_eq!(d["isolation"], "read_committed", "{d}");
    for o in d["offsets"].as_array().unwrap() {
        assert_eq!(o["lag"], 0, "{d}");
        assert_eq!(o["committed_offset"], o["last_stable_offset"], "{d}");
        assert_eq!(
            o["log_end_offset"].as_i64().unwrap() - o["last_stable_offset"].as_i64().unwrap(),
            6,
            "{d}"
        );
    }
    let d = describe_group(&bootstrap, "rc", &["--isolation", "read_uncommitted"]);
    assert_eq!(d["isolation"], "read_uncommitted", "{d}");
    assert!(
        d["offsets"]
            .as_array()
            .unwrap()
            .iter()
            .all(|o| o["lag"] == 6),
        "{d}"
    );
    // Once the transaction commits, the group reads on: its records and the one behind.
    txn.commit_transaction().await.unwrap();
    let rest = read_in_group();
    for p in 0..3u32 {
        let mut want: Vec<String> = (0..5).map(|i| format!("o{p}-{i}")).collect();
        want.push(format!("late{p}"));
        assert_eq!(rest.get(&p), Some(&want), "{rest:?}");
    }
    let d = describe_group(&bootstrap, "rc", &[]);
    assert!(
        d["offsets"]
            .as_array()
            .unwrap()
            .iter()
            .all(|o| o["lag"] == 0),
        "{d}"
    );
}
