//! Controller benchmarks against real processes on loopback (not criterion: each figure
//! needs a running 3-node quorum):
//! - metadata writes per second through the quorum: concurrent (pipelined) topic creations
//!   of 3 partitions x 3 replicas, at several concurrency levels, median of 3 runs;
//! - failover: kill -9 of the Raft leader to the first accepted write, median of 5 runs;
//! - Raft log size on disk after many small writes (snapshot policy at its defaults).
//!
//! Run: `cargo bench --bench controller` (TIDELOG_BENCH_CHURN_WRITES overrides the
//! 100,000 writes of the last phase).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Controllers, FakeBroker};
use tidelog::api::proto::AlterTopicRequest;
use tidelog::client::AdminClient;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

async fn leader(c: &Controllers) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let client = AdminClient::new(c.live_addresses(), Duration::from_secs(2));
        if let Ok(d) = client.describe_cluster().await {
            if let Some(l) = d.leader {
                let addr = c.address(l);
                if c.live_addresses().contains(&addr) {
                    return l;
                }
            }
        }
        assert!(Instant::now() < deadline, "no leader");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Creates topics from `concurrency` tasks for `window`; returns creations per second.
async fn create_rate(
    client: Arc<AdminClient>,
    tag: &str,
    concurrency: usize,
    window: Duration,
) -> f64 {
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..concurrency {
        let client = client.clone();
        let tag = tag.to_owned();
        tasks.spawn(async move {
            let mut done = 0u64;
            while start.elapsed() < window {
                client
                    .create_topic(
                        &format!("{tag}-{worker}-{done}"),
                        Some(3),
                        Some(3),
                        BTreeMap::new(),
                    )
                    .await
                    .expect("create");
                done += 1;
            }
            done
        });
    }
    let mut total = 0;
    while let Some(n) = tasks.join_next().await {
        total += n.expect("task");
    }
    total as f64 / start.elapsed().as_secs_f64()
}

fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return; // `cargo test --benches` probes: nothing to list or test here.
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        // Production Raft timings (heartbeat 200 ms, election timeout 1-2 s).
        let mut c = Controllers::start_with(3, &[], false);
        leader(&c).await;
        let _brokers = [
            FakeBroker::start(c.live_addresses(), 1).await,
            FakeBroker::start(c.live_addresses(), 2).await,
            FakeBroker::start(c.live_addresses(), 3).await,
        ];
        tokio::time::sleep(Duration::from_secs(1)).await;
        let client = Arc::new(AdminClient::new(c.live_addresses(), Duration::from_secs(30)));

        println!("metadata writes through a 3-node quorum (create topic, 3 partitions x 3 replicas)");
        for concurrency in [1, 16, 64] {
            let runs: Vec<f64> = {
                let mut v = Vec::new();
                for run in 0..3 {
                    let tag = format!("c{concurrency}r{run}");
                    v.push(create_rate(client.clone(), &tag, concurrency, Duration::from_secs(3)).await);
                }
                v
            };
            println!(
                "  concurrency {concurrency:>3}: median {:>8.0} writes/s   (runs: {})",
                median(runs.clone()),
                runs.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ")
            );
        }

        println!("failover: kill -9 of the leader -> first accepted write");
        let mut times = Vec::new();
        for run in 0..5 {
            let l = leader(&c).await;
            let survivors: Vec<String> = c
                .live_addresses()
                .into_iter()
                .filter(|a| *a != c.address(l))
                .collect();
            let client = AdminClient::new(survivors, Duration::from_secs(30));
            let t0 = Instant::now();
            c.kill9(l);
            client
                .create_topic(&format!("failover-{run}"), Some(1), Some(3), BTreeMap::new())
                .await
                .expect("write after failover");
            let took = t0.elapsed().as_secs_f64() * 1000.0;
            println!("  run {run}: {took:.0} ms (killed controller {l})");
            times.push(took);
            c.start_node(l);
            leader(&c).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        println!("  median {:.0} ms", median(times));

        let writes: usize = std::env::var("TIDELOG_BENCH_CHURN_WRITES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100_000);
        println!("raft log size after {writes} config writes (snapshot every 10,000 entries, 1,000 kept)");
        client.create_topic("churn", Some(1), Some(3), BTreeMap::new()).await.expect("churn topic");
        let start = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        let workers = 64;
        for worker in 0..workers {
            let client = client.clone();
            tasks.spawn(async move {
                for i in (worker..writes).step_by(workers) {
                    client
                        .alter_topic(AlterTopicRequest {
                            name: "churn".to_owned(),
                            partitions: None,
                            set_config: [("retention.ms".to_owned(), (1000 + i).to_string())].into(),
                            delete_config: vec![],
                            reassignments: vec![],
                        })
                        .await
                        .expect("alter");
                }
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.expect("task");
        }
        let secs = start.elapsed().as_secs_f64();
        println!("  {writes} writes in {secs:.1} s ({:.0} writes/s at concurrency {workers})", writes as f64 / secs);
        for id in 1..=3u64 {
            let raft = c.data_dir(id).join("raft");
            println!(
                "  controller {id}: raft log {} KiB in {} segment(s), snapshot {} KiB",
                dir_bytes(&raft.join("log")) / 1024,
                std::fs::read_dir(raft.join("log")).map(|d| d.count()).unwrap_or(0),
                std::fs::metadata(raft.join("snapshot.bin")).map(|m| m.len() / 1024).unwrap_or(0)
            );
        }
    });
}
