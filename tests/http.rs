//! The HTTP port with real processes: `/metrics` parsed by a Prometheus text parser and
//! checked against what was produced and consumed; `/health/live` and `/health/ready`,
//! including a broker cut off from its controllers.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{cli, eventually, free_ports, http_get, BrokerCluster, Proc};
use prometheus_parse::{Sample, Scrape, Value};

/// Scrapes `/metrics` at `address` and parses it.
fn scrape(address: &str) -> Scrape {
    let (status, body) = http_get(address, "/metrics").expect("GET /metrics");
    assert_eq!(status, 200, "{body}");
    Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).expect("Prometheus text format")
}

/// The samples of `name` whose labels include `labels`.
fn samples<'a>(scrape: &'a Scrape, name: &str, labels: &[(&str, &str)]) -> Vec<&'a Sample> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .collect()
}

/// The sum of the counter or gauge values of `name` with `labels`.
fn sum(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    samples(scrape, name, labels)
        .iter()
        .map(|s| match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            _ => 0.0,
        })
        .sum()
}

#[test]
fn standalone_metrics_count_what_was_produced_and_consumed() {
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports(2);
    let bootstrap = format!("127.0.0.1:{}", ports[0]);
    let http = format!("127.0.0.1:{}", ports[1]);
    let _server = Proc::start(
        "standalone",
        &[
            "--data-dir".into(),
            dir.path().join("data").display().to_string(),
            "--listen".into(),
            bootstrap.clone(),
            "--http-listen".into(),
            http.clone(),
        ],
        &[
            common::FAST_RAFT,
            &[("TIDELOG_METRICS_PER_PARTITION", "true")],
        ]
        .concat(),
        dir.path(),
    );
    let (status, body) = http_get(&http, "/health/live").unwrap();
    assert_eq!((status, body.contains("live")), (200, true), "{body}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let ready = loop {
        let (status, body) = http_get(&http, "/health/ready").unwrap();
        if status == 200 {
            break body;
        }
        assert_eq!(status, 503, "{body}");
        assert!(std::time::Instant::now() < deadline, "never ready: {body}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let ready: serde_json::Value = serde_json::from_str(&ready).unwrap();
    assert_eq!(ready["broker"]["ready"], true, "{ready}");
    assert_eq!(ready["controller"]["ready"], true, "{ready}");

    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--topic",
        "metered",
        "--partitions",
        "3",
        "--bootstrap",
        &bootstrap,
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = cli(&[
        "perf",
        "produce",
        "--topic",
        "metered",
        "--num-records",
        "1000",
        "--record-size",
        "100",
        "--acks",
        "all",
        "--bootstrap",
        &bootstrap,
    ]);
    assert!(ok, "{err}");
    let (ok, out, err) = cli(&[
        "consume",
        "--topic",
        "metered",
        "--from-beginning",
        "--timeout-ms",
        "2000",
        "--bootstrap",
        &bootstrap,
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 1000);

    let m = scrape(&http);
    let topic = [("topic", "metered")];
    assert_eq!(sum(&m, "tidelog_records_in_total", &topic), 1000.0);
    // metrics_per_partition: one series per partition.
    assert_eq!(samples(&m, "tidelog_records_in_total", &topic).len(), 3);
    assert!(sum(&m, "tidelog_bytes_in_total", &topic) > 100_000.0);
    // The console consumer may re-read a partition's tail; never fewer than were stored.
    assert!(sum(&m, "tidelog_records_out_total", &topic) >= 1000.0);
    assert!(sum(&m, "tidelog_bytes_out_total", &topic) > 100_000.0);
    assert_eq!(sum(&m, "tidelog_partition_log_end_offset", &topic), 1000.0);
    assert_eq!(sum(&m, "tidelog_partition_high_watermark", &topic), 1000.0);
    assert!(sum(&m, "tidelog_partition_size_bytes", &topic) > 100_000.0);
    assert_eq!(sum(&m, "tidelog_raft_is_leader", &[]), 1.0);
    assert!(sum(&m, "tidelog_raft_elections_total", &[]) >= 1.0);
    assert_eq!(
        samples(&m, "tidelog_raft_snapshot_size_bytes", &[]).len(),
        1
    );
    assert!(sum(&m, "tidelog_metadata_version", &[]) > 0.0);
    assert!(sum(&m, "tidelog_partitions_leader", &[]) >= 3.0);
    assert_eq!(sum(&m, "tidelog_partitions_under_replicated", &[]), 0.0);
    assert_eq!(
        sum(&m, "tidelog_cluster_brokers", &[("state", "unfenced")]),
        1.0
    );
    assert!(sum(&m, "tidelog_process_open_fds", &[]) > 0.0);
    assert!(sum(&m, "tidelog_process_resident_memory_bytes", &[]) > 1e6);
    assert_eq!(sum(&m, "tidelog_build_info", &[]), 1.0);
    let produce = [("protocol", "grpc"), ("api", "Produce")];
    assert!(sum(&m, "tidelog_requests_total", &produce) >= 1.0);
    let histogram = samples(&m, "tidelog_request_duration_seconds", &produce);
    assert!(
        histogram
            .iter()
            .any(|s| matches!(&s.value, Value::Histogram(buckets) if !buckets.is_empty())),
        "Produce latency is a histogram: {histogram:?}"
    );
    // A group reads everything and commits: its committed offsets and lag show.
    let (ok, out, err) = cli(&[
        "consume",
        "--topic",
        "metered",
        "--group",
        "readers",
        "--from-beginning",
        "--timeout-ms",
        "3000",
        "--bootstrap",
        &bootstrap,
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 1000);
    let m = scrape(&http);
    let group = [("group", "readers"), ("topic", "metered")];
    assert_eq!(sum(&m, "tidelog_group_committed_offset", &group), 1000.0);
    assert_eq!(sum(&m, "tidelog_group_lag", &group), 0.0);
    assert_eq!(samples(&m, "tidelog_group_lag", &group).len(), 3);
    assert!(sum(&m, "tidelog_group_commits_total", &[("group", "readers")]) >= 1.0);
    // The member's join and its leaving were each a new group epoch.
    assert!(
        sum(
            &m,
            "tidelog_group_rebalances_total",
            &[("group", "readers")]
        ) >= 2.0
    );
    // Calls to methods no service serves share one label: a client cannot add series.
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let channel = tonic::transport::Channel::from_shared(format!("http://{bootstrap}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut grpc = tonic::client::Grpc::new(channel);
        for i in 0..20 {
            grpc.ready().await.unwrap();
            let path: tonic::codegen::http::uri::PathAndQuery =
                format!("/made.Up/Method{i}").parse().unwrap();
            let answer = grpc
                .unary::<(), (), _>(
                    tonic::Request::new(()),
                    path,
                    tonic_prost::ProstCodec::default(),
                )
                .await;
            assert!(answer.is_err());
        }
    });
    let m = scrape(&http);
    assert!(
        samples(&m, "tidelog_requests_total", &[]).iter().all(|s| !s
            .labels
            .get("api")
            .unwrap_or_default()
            .starts_with("Method")),
        "a made-up method got its own series"
    );
    assert!(sum(&m, "tidelog_requests_total", &[("api", "unknown")]) >= 20.0);
    // A refused call is counted by its code.
    let (ok, _, _) = cli(&[
        "topics",
        "describe",
        "--topic",
        "missing",
        "--bootstrap",
        &bootstrap,
    ]);
    assert!(!ok);
    let m = scrape(&http);
    let errors: BTreeMap<String, f64> = samples(&m, "tidelog_request_errors_total", &[])
        .iter()
        .map(|s| {
            let code = s.labels.get("code").unwrap_or_default().to_owned();
            let v = match s.value {
                Value::Counter(v) => v,
                _ => 0.0,
            };
            (code, v)
        })
        .collect();
    assert!(
        errors
            .get("UNKNOWN_TOPIC_OR_PARTITION")
            .is_some_and(|v| *v >= 1.0),
        "{errors:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_counts_under_replicated_partitions_and_a_cut_off_broker_is_not_ready() {
    let mut c = BrokerCluster::build(1, 3, &[("TIDELOG_REPLICA_LAG_TIME_MAX_MS", "1500")], true);
    let bootstrap = c.bootstrap().join(",");
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--topic",
        "watched",
        "--partitions",
        "3",
        "--replication-factor",
        "3",
        "--bootstrap",
        &bootstrap,
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = cli(&[
        "perf",
        "produce",
        "--topic",
        "watched",
        "--num-records",
        "30",
        "--record-size",
        "10",
        "--acks",
        "all",
        "--bootstrap",
        &bootstrap,
    ]);
    assert!(ok, "{err}");
    // Per topic by default: no partition label, and the leaders' counts add up.
    let scrapes: Vec<Scrape> = (1..=3).map(|b| scrape(&c.broker_http_address(b))).collect();
    let total: f64 = scrapes
        .iter()
        .map(|m| sum(m, "tidelog_records_in_total", &[("topic", "watched")]))
        .sum();
    assert_eq!(total, 30.0);
    assert!(scrapes
        .iter()
        .all(|m| samples(m, "tidelog_records_in_total", &[])
            .iter()
            .all(|s| s.labels.get("partition").is_none())));
    for b in 1..=3 {
        let address = c.broker_http_address(b);
        eventually("every broker ready", Duration::from_secs(20), || {
            let address = address.clone();
            async move { (http_get(&address, "/health/ready").ok()?.0 == 200).then_some(()) }
        })
        .await;
    }
    // Each leader shows its followers' lag: 3 partitions x 2 followers, all caught up.
    eventually("followers caught up", Duration::from_secs(20), || {
        let scrapes: Vec<Scrape> = (1..=3).map(|b| scrape(&c.broker_http_address(b))).collect();
        let series: usize = scrapes
            .iter()
            .map(|m| samples(m, "tidelog_replica_lag_records", &[("topic", "watched")]).len())
            .sum();
        let lag: f64 = scrapes
            .iter()
            .map(|m| sum(m, "tidelog_replica_lag_records", &[("topic", "watched")]))
            .sum();
        async move { (series == 6 && lag == 0.0).then_some(()) }
    })
    .await;
    // Broker 3 stops: the leaders of partitions it followed count them under-replicated.
    c.brokers[2].as_mut().unwrap().kill9();
    eventually(
        "the leaders see broker 3 falling behind",
        Duration::from_secs(30),
        || {
            let behind: f64 = (1..=2)
                .map(|b| {
                    sum(
                        &scrape(&c.broker_http_address(b)),
                        "tidelog_replica_lag_seconds",
                        &[("follower", "3")],
                    )
                })
                .sum();
            async move { (behind > 1.0).then_some(()) }
        },
    )
    .await;
    eventually(
        "under-replicated partitions on the remaining leaders",
        Duration::from_secs(30),
        || {
            let total: f64 = (1..=2)
                .map(|b| {
                    sum(
                        &scrape(&c.broker_http_address(b)),
                        "tidelog_partitions_under_replicated",
                        &[],
                    )
                })
                .sum();
            async move { (total > 0.0).then_some(()) }
        },
    )
    .await;
    // Broker 1 loses its controllers: not ready, and ready again once they answer.
    c.links[0].as_ref().unwrap().cut();
    let address = c.broker_http_address(1);
    let body = eventually("broker 1 not ready", Duration::from_secs(30), || {
        let address = address.clone();
        async move {
            let (status, body) = http_get(&address, "/health/ready").ok()?;
            (status == 503).then_some(body)
        }
    })
    .await;
    assert!(body.contains("controllers"), "{body}");
    c.links[0].as_ref().unwrap().heal();
    eventually("broker 1 ready again", Duration::from_secs(30), || {
        let address = address.clone();
        async move { (http_get(&address, "/health/ready").ok()?.0 == 200).then_some(()) }
    })
    .await;
}

/// The HTTP port closes connections that go silent or trickle a request a byte at a
/// time (slowloris), and keeps serving others meanwhile.
#[test]
fn the_http_port_closes_silent_and_trickling_connections() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports(2);
    let http = format!("127.0.0.1:{}", ports[1]);
    let _server = Proc::start(
        "standalone",
        &[
            "--data-dir".into(),
            dir.path().join("data").display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{}", ports[0]),
            "--http-listen".into(),
            http.clone(),
            "--kafka-listen".into(),
            "none".into(),
        ],
        common::FAST_RAFT,
        dir.path(),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while http_get(&http, "/health/live").map(|r| r.0).unwrap_or(0) != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "the HTTP port never answered"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let started = std::time::Instant::now();
    let mut silent = std::net::TcpStream::connect(&http).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    // Clients that never finish a request: one byte every 2 s, and a 40-byte header
    // line every 2 s (reads alone never keep a connection open). Each writes until the
    // server closes the connection; true when it did.
    let trickle = |chunk: &'static [u8]| {
        let http = http.clone();
        std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(&http).unwrap();
            if s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                .is_err()
            {
                return true;
            }
            for _ in 0..30 {
                if s.write_all(chunk).is_err() {
                    return true;
                }
                std::thread::sleep(Duration::from_secs(2));
            }
            false
        })
    };
    let tricklers = [
        trickle(b"X"),
        trickle(b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n"),
    ];
    // Others are served meanwhile.
    assert_eq!(http_get(&http, "/health/live").unwrap().0, 200);
    let mut buf = [0u8; 16];
    let n = silent.read(&mut buf).unwrap_or(0);
    assert_eq!(
        n, 0,
        "the silent connection got data instead of being closed"
    );
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(50),
        "closed only after {waited:?}"
    );
    for t in tricklers {
        assert!(t.join().unwrap(), "a trickling connection was never closed");
    }
}
