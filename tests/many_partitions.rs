//! Many partitions on one broker, against the real binary: they all open, produce works
//! on a sample, descriptors stay near one per partition, and the per-broker partition
//! limit refuses a topic that would pass it, creating nothing.
//!
//! `MANY_PARTITIONS_COUNT` sets the count (default 1,000 to keep `cargo test` quick);
//! `scripts/many_partitions.sh` runs it with 10,000 and prints the time.

mod common;

use std::time::{Duration, Instant};

use common::{cli, free_ports, standalone_with};
use tidelog::api::proto::broker_client::BrokerClient;
use tidelog::api::proto::{PartitionProduceData, ProduceRequest, Record, TopicProduceData};

/// Resident memory of `pid` (KiB).
fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn open_descriptors(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_partitions_open_with_about_one_descriptor_each() {
    let partitions: u32 = std::env::var("MANY_PARTITIONS_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000);
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let server = standalone_with(dir.path(), port, &[("RUST_LOG", "warn")]);
    let bootstrap = format!("127.0.0.1:{port}");
    let baseline = open_descriptors(server.pid());
    let rss_before = rss_kib(server.pid());

    let started = Instant::now();
    // PARTITIONS_PER_TOPIC_MAX is 10,000: one topic holds them all.
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--bootstrap",
        &bootstrap,
        "--topic",
        "many",
        "--partitions",
        &partitions.to_string(),
    ]);
    assert!(ok, "{err}");
    let data = dir.path().join("data");
    let opened = common::eventually(
        "every partition directory",
        Duration::from_secs(600),
        || {
            let data = data.clone();
            async move {
                let n = std::fs::read_dir(&data)
                    .ok()?
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("many-"))
                    .count();
                (n == partitions as usize).then_some(n)
            }
        },
    )
    .await;
    assert_eq!(opened, partitions as usize);

    // Produce to a sample, spread over the range: each answers with an offset.
    let client = BrokerClient::connect(format!("http://{bootstrap}"))
        .await
        .unwrap();
    let sample: Vec<u32> = (0..partitions)
        .step_by((partitions as usize / 50).max(1))
        .collect();
    let request = ProduceRequest {
        transactional_id: None,
        acks: Some(-1),
        timeout_ms: 30_000,
        topics: vec![TopicProduceData {
            topic: "many".into(),
            partitions: sample
                .iter()
                .map(|&partition| PartitionProduceData {
                    partition,
                    records: vec![Record {
                        value: Some(b"v".to_vec().into()),
                        ..Default::default()
                    }],
                    ..Default::default()
                })
                .collect(),
        }],
    };
    let dirs_after = started.elapsed();
    let produced = common::eventually("produce to the sample", Duration::from_secs(600), || {
        let mut client = client.clone();
        let request = request.clone();
        async move {
            let r = match client.produce(request).await {
                Ok(r) => r.into_inner(),
                Err(_) => return None,
            };
            r.topics[0]
                .partitions
                .iter()
                .all(|p| p.error_code == 0 && p.base_offset >= 0)
                .then_some(r)
        }
    })
    .await;
    assert_eq!(produced.topics[0].partitions.len(), sample.len());
    let elapsed = started.elapsed();

    let descriptors = open_descriptors(server.pid());
    let rss_after = rss_kib(server.pid());
    eprintln!(
        "{partitions} partitions: directories after {dirs_after:?}, all open and producing after {elapsed:?}; {descriptors} descriptors (baseline {baseline}); resident memory {rss_before} KiB before, {rss_after} KiB after ({} KiB per partition)",
        rss_after.saturating_sub(rss_before) / u64::from(partitions.max(1))
    );
    // One per partition (the active .log) plus a margin for sockets, Raft and
    // __consumer_offsets; the old layout needed four per partition.
    let bound = baseline + partitions as usize + 200;
    assert!(
        descriptors <= bound,
        "{descriptors} descriptors for {partitions} partitions; expected at most {bound}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_beyond_max_partitions_per_broker_is_refused_and_nothing_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone_with(
        dir.path(),
        port,
        &[("TIDELOG_MAX_PARTITIONS_PER_BROKER", "100")],
    );
    let bootstrap = format!("127.0.0.1:{port}");
    let create = |topic: &str, partitions: &str| {
        cli(&[
            "topics",
            "create",
            "--bootstrap",
            &bootstrap,
            "--topic",
            topic,
            "--partitions",
            partitions,
        ])
    };
    let (ok, _, err) = create("first", "60");
    assert!(ok, "{err}");
    let (ok, _, err) = create("second", "41");
    assert!(!ok, "a topic passing the limit was created");
    assert!(err.contains("PARTITION_LIMIT_EXCEEDED"), "{err}");
    assert!(
        err.contains("broker 1 101 replicas") && err.contains("max_partitions_per_broker is 100"),
        "{err}"
    );
    let (_, topics, _) = cli(&["topics", "list", "--bootstrap", &bootstrap]);
    assert!(!topics.contains("second"), "{topics}");
    let (ok, _, err) = cli(&[
        "topics",
        "alter",
        "--bootstrap",
        &bootstrap,
        "--topic",
        "first",
        "--partitions",
        "101",
    ]);
    assert!(!ok, "partitions added past the limit");
    assert!(err.contains("PARTITION_LIMIT_EXCEEDED"), "{err}");
    let (ok, _, err) = create("second", "40");
    assert!(ok, "up to the limit is fine: {err}");
}
