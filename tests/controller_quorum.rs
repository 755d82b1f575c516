//! The controller quorum as real processes on loopback: elections, kill -9 of the leader,
//! whole-quorum restarts, broker fencing, bad input, and the bounded Raft log.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{cli, controller_client, eventually, Controllers, FakeBroker};
use tidelog::api::proto::{
    AlterPartitionRequest, BrokerHeartbeatRequest, DescribeClusterResponse, PartitionState,
    RegisterBrokerRequest, TopicState,
};
use tidelog::client::{AdminClient, ClientError};
use tidelog::error_code::ErrorCode;

fn admin(addresses: Vec<String>) -> AdminClient {
    AdminClient::new(addresses, Duration::from_secs(20))
}

async fn describe(addresses: Vec<String>) -> Option<DescribeClusterResponse> {
    AdminClient::new(addresses, Duration::from_secs(2))
        .describe_cluster()
        .await
        .ok()
}

/// Waits until the running controllers agree on a leader that is itself running.
async fn wait_for_leader(c: &Controllers) -> u64 {
    let live = c.live_addresses();
    eventually(
        "a raft leader among the running controllers",
        Duration::from_secs(30),
        || {
            let live = live.clone();
            async move {
                let d = describe(live.clone()).await?;
                let leader = d.leader?;
                let leader_address = d
                    .controllers
                    .iter()
                    .find(|s| s.id == leader)?
                    .address
                    .clone();
                (live.contains(&leader_address) && !d.cluster_id.is_empty()).then_some(leader)
            }
        },
    )
    .await
}

async fn unfenced_brokers(addresses: Vec<String>) -> usize {
    describe(addresses)
        .await
        .map(|d| {
            d.brokers
                .iter()
                .filter(|b| b.broker.as_ref().is_some_and(|b| b.state == "unfenced"))
                .count()
        })
        .unwrap_or(0)
}

async fn wait_unfenced(addresses: &[String], n: usize) {
    eventually("brokers unfenced", Duration::from_secs(20), || {
        let a = addresses.to_vec();
        async move { (unfenced_brokers(a).await >= n).then_some(()) }
    })
    .await
}

async fn topic_names(client: &AdminClient) -> BTreeSet<String> {
    client
        .list_topics()
        .await
        .expect("list topics")
        .topics
        .into_iter()
        .map(|t| t.name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_controllers_survive_leader_kill_9_and_full_restart() {
    let mut c = Controllers::start(3, &[]);
    let leader = wait_for_leader(&c).await;
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    let follower_only = vec![c.address(follower)];
    let brokers = [
        FakeBroker::start(follower_only.clone(), 1).await,
        FakeBroker::start(follower_only.clone(), 2).await,
        FakeBroker::start(follower_only.clone(), 3).await,
    ];
    wait_unfenced(&follower_only, 3).await;

    // 50 topics through a follower: 5 with the CLI, the rest with the client.
    let bootstrap = c.address(follower);
    for i in 0..5 {
        let name = format!("topic-{i:02}");
        let (ok, _, err) = cli(&[
            "topics",
            "create",
            "--topic",
            &name,
            "--partitions",
            "3",
            "--replication-factor",
            "3",
            "--bootstrap",
            &bootstrap,
        ]);
        assert!(ok, "create {name}: {err}");
    }
    let through_follower = admin(follower_only.clone());
    for i in 5..50 {
        through_follower
            .create_topic(&format!("topic-{i:02}"), Some(3), Some(2), BTreeMap::new())
            .await
            .expect("create through follower");
    }
    let before = through_follower
        .describe_topics(vec![])
        .await
        .expect("describe")
        .topics;
    assert_eq!(before.len(), 50);

    // kill -9 the leader; a new one takes writes.
    let killed_at = Instant::now();
    c.kill9(leader);
    let survivors = admin(c.live_addresses());
    survivors
        .create_topic("after-failover", Some(1), Some(1), BTreeMap::new())
        .await
        .expect("a write after the leader died");
    let failover = killed_at.elapsed();
    assert!(
        failover < Duration::from_secs(15),
        "failover took {failover:?}"
    );
    let new_leader = wait_for_leader(&c).await;
    assert_ne!(new_leader, leader);
    let names = topic_names(&survivors).await;
    assert_eq!(names.len(), 51);
    for i in 50..60 {
        survivors
            .create_topic(&format!("topic-{i:02}"), Some(2), Some(3), BTreeMap::new())
            .await
            .expect("create after failover");
    }

    // The killed node restarts and catches up.
    c.start_node(leader);
    let version = survivors.list_topics().await.unwrap().metadata_version;
    let restarted = controller_client(&[c.address(leader)], Duration::from_secs(5));
    eventually(
        "the restarted controller catches up",
        Duration::from_secs(30),
        || {
            let r = &restarted;
            async move {
                let m = r.fetch_metadata(0, Duration::ZERO).await.ok()?;
                let image = m.image?;
                (m.version >= version && image.topics.len() == 61).then_some(())
            }
        },
    )
    .await;

    // Stop all three, restart them: the metadata is intact (same ids, same placement).
    for id in 1..=3 {
        c.stop(id);
    }
    for id in 1..=3 {
        c.start_node(id);
    }
    wait_for_leader(&c).await;
    let all = admin(c.live_addresses());
    let after = all.describe_topics(vec![]).await.expect("describe").topics;
    assert_eq!(after.len(), 61);
    let by_name: BTreeMap<String, TopicState> = after
        .into_iter()
        .filter_map(|d| d.topic)
        .map(|t| (t.name.clone(), t))
        .collect();
    for d in before {
        let t = d.topic.unwrap();
        let now = &by_name[&t.name];
        assert_eq!(now.id, t.id, "{} kept its id", t.name);
        let replicas = |t: &TopicState| {
            t.partitions
                .iter()
                .map(|p| p.replicas.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(replicas(now), replicas(&t), "{} kept its placement", t.name);
    }
    let d = describe(c.live_addresses()).await.unwrap();
    assert_eq!(d.brokers.len(), 3, "brokers are still registered");
    drop(brokers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_controllers_tolerate_the_loss_of_any_two() {
    let mut c = Controllers::start(5, &[]);
    let leader = wait_for_leader(&c).await;
    let _broker = FakeBroker::start(c.live_addresses(), 1).await;
    wait_unfenced(&c.live_addresses(), 1).await;
    // Round 1: the leader and one follower die.
    let follower = (1..=5).find(|id| *id != leader).unwrap();
    c.kill9(leader);
    c.kill9(follower);
    let client = admin(c.live_addresses());
    client
        .create_topic("with-three-left", Some(2), Some(1), BTreeMap::new())
        .await
        .expect("3 of 5 still commit");
    c.start_node(leader);
    c.start_node(follower);
    // Round 2: two other followers die.
    let leader = wait_for_leader(&c).await;
    let others: Vec<u64> = (1..=5).filter(|id| *id != leader).take(2).collect();
    for id in &others {
        c.kill9(*id);
    }
    let client = admin(c.live_addresses());
    client
        .create_topic("again-with-three", Some(1), Some(1), BTreeMap::new())
        .await
        .expect("any 3 of 5 commit");
    assert_eq!(topic_names(&client).await.len(), 2);
    // A third loss stops writes: no quorum.
    let third = (1..=5)
        .find(|id| *id != leader && !others.contains(id))
        .unwrap();
    c.kill9(third);
    let short = AdminClient::new(c.live_addresses(), Duration::from_secs(3));
    let err = short
        .create_topic("no-quorum", Some(1), Some(1), BTreeMap::new())
        .await
        .expect_err("2 of 5 cannot commit");
    assert!(err.is_retriable(), "{err}");
    for id in others.iter().chain([third].iter()) {
        c.start_node(*id);
    }
    wait_for_leader(&c).await;
    let client = admin(c.live_addresses());
    let names = topic_names(&client).await;
    assert!(names.contains("with-three-left") && names.contains("again-with-three"));
}

fn partition(t: &TopicState, p: u32) -> PartitionState {
    t.partitions[p as usize].clone()
}

async fn topic(client: &AdminClient, name: &str) -> TopicState {
    client
        .describe_topics(vec![name.to_owned()])
        .await
        .expect("describe")
        .topics
        .remove(0)
        .topic
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_broker_is_fenced_and_its_partitions_move_to_the_isr() {
    let c = Controllers::start(1, &[("TIDELOG_BROKER_SESSION_TIMEOUT_MS", "1500")]);
    wait_for_leader(&c).await;
    let addrs = c.live_addresses();
    let b1 = FakeBroker::start(addrs.clone(), 1).await;
    let b2 = FakeBroker::start(addrs.clone(), 2).await;
    let _b3 = FakeBroker::start(addrs.clone(), 3).await;
    wait_unfenced(&addrs, 3).await;
    let client = admin(addrs.clone());
    client
        .create_topic("replicated", Some(6), Some(3), BTreeMap::new())
        .await
        .unwrap();
    client
        .create_topic("single", Some(3), Some(1), BTreeMap::new())
        .await
        .unwrap();
    let before = topic(&client, "replicated").await;
    let single_before = topic(&client, "single").await;
    let led_by_1: Vec<u32> = before
        .partitions
        .iter()
        .filter(|p| p.leader == Some(1))
        .map(|p| p.partition)
        .collect();
    assert!(
        !led_by_1.is_empty(),
        "placement spreads leaders: {before:?}"
    );
    let single_on_1: Vec<u32> = single_before
        .partitions
        .iter()
        .filter(|p| p.replicas == vec![1])
        .map(|p| p.partition)
        .collect();
    assert_eq!(
        single_on_1.len(),
        1,
        "one of three single-replica partitions per broker"
    );

    // AlterPartition: a stale partition epoch is refused, a current one accepted.
    let controllers = controller_client(&addrs, Duration::from_secs(5));
    let p = partition(&before, led_by_1[0]);
    let mut request = AlterPartitionRequest {
        broker_id: 1,
        broker_epoch: b1.epoch,
        topic: "replicated".to_owned(),
        topic_id: before.id.clone(),
        partition: p.partition,
        leader_epoch: p.leader_epoch,
        partition_epoch: p.partition_epoch + 7,
        new_isr: vec![1, p.replicas.iter().copied().find(|b| *b != 1).unwrap()],
    };
    let stale: ClientError = controllers
        .alter_partition(request.clone())
        .await
        .unwrap_err();
    assert_eq!(stale.code, ErrorCode::InvalidUpdateVersion);
    request.partition_epoch = p.partition_epoch;
    let shrunk = controllers.alter_partition(request.clone()).await.unwrap();
    let shrunk = shrunk.partition.unwrap();
    assert_eq!(shrunk.isr, request.new_isr);
    assert_eq!(shrunk.partition_epoch, p.partition_epoch + 1);

    // Broker 1 goes silent: fenced; its partitions move within their ISR with a new epoch.
    b1.beating.store(false, Ordering::SeqCst);
    eventually("broker 1 fenced", Duration::from_secs(15), || {
        let a = addrs.clone();
        async move {
            let d = describe(a).await?;
            let b = d
                .brokers
                .iter()
                .find(|b| b.broker.as_ref().unwrap().id == 1)?;
            (b.broker.as_ref().unwrap().state == "fenced").then_some(())
        }
    })
    .await;
    let after = topic(&client, "replicated").await;
    for p in &led_by_1 {
        let (old, new) = (partition(&before, *p), partition(&after, *p));
        let leader = new.leader.expect("an ISR member took over");
        assert_ne!(leader, 1);
        assert!(new.leader_epoch > old.leader_epoch, "{old:?} -> {new:?}");
        assert!(!new.isr.contains(&1), "fenced broker left the ISR: {new:?}");
        if *p == shrunk.partition {
            assert_eq!(new.isr, vec![leader], "only the in-sync follower may lead");
            assert_eq!(
                Some(leader),
                request.new_isr.iter().copied().find(|b| *b != 1)
            );
        }
    }
    // The single-replica partition on broker 1 has nobody in sync: leaderless, not unclean.
    let single = topic(&client, "single").await;
    let lonely = partition(&single, single_on_1[0]);
    assert_eq!(lonely.leader, None, "{lonely:?}");
    assert_eq!(lonely.isr, vec![1]);

    // Broker 1 comes back (same epoch): it is unfenced and leads its partition again.
    b1.beating.store(true, Ordering::SeqCst);
    eventually(
        "broker 1 leads its partition again",
        Duration::from_secs(15),
        || {
            let client = &client;
            let p = single_on_1[0];
            let old_epoch = lonely.leader_epoch;
            async move {
                let t = topic(client, "single").await;
                let q = partition(&t, p);
                (q.leader == Some(1) && q.leader_epoch > old_epoch).then_some(())
            }
        },
    )
    .await;

    // A different process claiming broker 2 while it is alive is refused.
    let dup = controllers
        .register_broker(RegisterBrokerRequest {
            broker_id: b2.id,
            address: "127.0.0.1:1".to_owned(),
            internal_address: "127.0.0.1:2".to_owned(),
            rack: None,
            incarnation_id: "impostor".to_owned(),
            kafka_address: None,
        })
        .await
        .unwrap_err();
    assert_eq!(dup.code, ErrorCode::DuplicateBrokerRegistration, "{dup}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controlled_shutdown_hands_leadership_off_before_the_broker_goes() {
    let c = Controllers::start(1, &[]);
    wait_for_leader(&c).await;
    let addrs = c.live_addresses();
    let b1 = FakeBroker::start(addrs.clone(), 1).await;
    let _b2 = FakeBroker::start(addrs.clone(), 2).await;
    wait_unfenced(&addrs, 2).await;
    let client = admin(addrs.clone());
    client
        .create_topic("t", Some(4), Some(2), BTreeMap::new())
        .await
        .unwrap();
    b1.beating.store(false, Ordering::SeqCst);
    let controllers = controller_client(&addrs, Duration::from_secs(5));
    let answer = controllers
        .heartbeat(BrokerHeartbeatRequest {
            broker_id: 1,
            broker_epoch: b1.epoch,
            metadata_version: 0,
            want_fence: false,
            want_shut_down: true,
            offline_replicas: Vec::new(),
        })
        .await
        .unwrap();
    assert!(answer.should_shut_down);
    let t = topic(&client, "t").await;
    for p in &t.partitions {
        assert_eq!(p.leader, Some(2), "{p:?}");
        assert_eq!(p.isr, vec![2]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_admin_requests_fail_clearly_and_change_nothing() {
    let c = Controllers::start(1, &[]);
    wait_for_leader(&c).await;
    let addrs = c.live_addresses();
    let _b1 = FakeBroker::start(addrs.clone(), 1).await;
    let _b2 = FakeBroker::start(addrs.clone(), 2).await;
    wait_unfenced(&addrs, 2).await;
    let b = addrs[0].as_str();
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--topic",
        "good",
        "--partitions",
        "2",
        "--bootstrap",
        b,
    ]);
    assert!(ok, "{err}");
    let (_, before, _) = cli(&["topics", "describe", "--output", "json", "--bootstrap", b]);
    let long = "x".repeat(250);
    let cases: &[(&[&str], &str, &str)] = &[
        (
            &["topics", "create", "--topic", "bad name"],
            "INVALID_TOPIC",
            "' '",
        ),
        (
            &["topics", "create", "--topic", &long],
            "INVALID_TOPIC",
            "249",
        ),
        (
            &["topics", "create", "--topic", "good"],
            "TOPIC_ALREADY_EXISTS",
            "good",
        ),
        (
            &["topics", "create", "--topic", "z", "--partitions", "0"],
            "INVALID_PARTITIONS",
            "got 0",
        ),
        (
            &[
                "topics",
                "create",
                "--topic",
                "z",
                "--replication-factor",
                "0",
            ],
            "INVALID_REPLICATION_FACTOR",
            "got 0",
        ),
        (
            &[
                "topics",
                "create",
                "--topic",
                "z",
                "--replication-factor",
                "3",
            ],
            "INVALID_REPLICATION_FACTOR",
            "2 live",
        ),
        (
            &["topics", "create", "--topic", "z", "--config", "no.such=1"],
            "INVALID_CONFIG",
            "no.such",
        ),
        (
            &[
                "topics",
                "create",
                "--topic",
                "z",
                "--config",
                "retention.ms=soon",
            ],
            "INVALID_CONFIG",
            "retention.ms",
        ),
        (
            &["topics", "alter", "--topic", "good", "--partitions", "1"],
            "INVALID_PARTITIONS",
            "only grow",
        ),
        (
            &[
                "topics",
                "alter",
                "--topic",
                "good",
                "--config",
                "segment.bytes=1",
            ],
            "INVALID_CONFIG",
            "segment.bytes",
        ),
        (
            &["topics", "alter", "--topic", "nope", "--partitions", "3"],
            "UNKNOWN_TOPIC_OR_PARTITION",
            "nope",
        ),
        (
            &["topics", "delete", "--topic", "nope"],
            "UNKNOWN_TOPIC_OR_PARTITION",
            "nope",
        ),
        (
            &["topics", "describe", "--topic", "nope"],
            "UNKNOWN_TOPIC_OR_PARTITION",
            "nope",
        ),
    ];
    for (args, code, detail) in cases {
        let mut full = args.to_vec();
        full.extend(["--bootstrap", b]);
        let (ok, _, err) = cli(&full);
        assert!(!ok, "{args:?} should fail");
        let line = err.lines().last().unwrap_or_default();
        assert!(
            line.starts_with(&format!("error: {code}: ")),
            "{args:?}: {err}"
        );
        assert!(line.contains(detail), "{args:?}: {line}");
    }
    let (_, after, _) = cli(&["topics", "describe", "--output", "json", "--bootstrap", b]);
    assert_eq!(before, after, "nothing changed");

    // Good alterations work and show up.
    let (ok, _, err) = cli(&[
        "topics",
        "alter",
        "--topic",
        "good",
        "--partitions",
        "4",
        "--config",
        "retention.ms=60000",
        "--bootstrap",
        b,
    ]);
    assert!(ok, "{err}");
    let (ok, out, _) = cli(&[
        "topics",
        "describe",
        "--topic",
        "good",
        "--output",
        "json",
        "--bootstrap",
        b,
    ]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["topics"][0]["partitions"].as_array().unwrap().len(), 4);
    assert_eq!(v["topics"][0]["config"]["retention.ms"], "60000");
    let (ok, _, _) = cli(&["topics", "delete", "--topic", "good", "--bootstrap", b]);
    assert!(ok);
    let (_, out, _) = cli(&["topics", "list", "--output", "json", "--bootstrap", b]);
    assert_eq!(out.trim(), r#"{"topics":[]}"#);
}

#[test]
fn startup_refuses_identities_that_contradict_the_data_directory() {
    let mut c = Controllers::start(1, &[]);
    c.stop(1);
    let dir = c.data_dir(1).display().to_string();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(common::binary())
            .arg("controller")
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let addr = c.address(1);
    let err = run(&[
        "--node-id",
        "4",
        "--listen",
        &addr,
        "--peers",
        &format!("1={addr}"),
        "--data-dir",
        &dir,
    ]);
    assert!(err.contains("node_id 4 is not in peers"), "{err}");
    let err = run(&[
        "--node-id",
        "2",
        "--listen",
        &addr,
        "--peers",
        &format!("2={addr}"),
        "--data-dir",
        &dir,
    ]);
    assert!(err.contains("belongs to controller 1"), "{err}");
    let other = format!("1={addr},2=127.0.0.1:1");
    let err = run(&[
        "--node-id",
        "1",
        "--listen",
        &addr,
        "--peers",
        &other,
        "--data-dir",
        &dir,
    ]);
    assert!(err.contains("disagrees with the membership"), "{err}");
    // With the right flags it starts again.
    c.start_node(1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_log_stays_bounded_by_the_snapshot_policy() {
    let mut c = Controllers::start(
        1,
        &[
            ("TIDELOG_RAFT_SNAPSHOT_ENTRIES", "200"),
            ("TIDELOG_RAFT_ENTRIES_KEPT_AFTER_SNAPSHOT", "50"),
            ("TIDELOG_RAFT_LOG_SEGMENT_BYTES", "16384"),
        ],
    );
    wait_for_leader(&c).await;
    let addrs = c.live_addresses();
    let _b = FakeBroker::start(addrs.clone(), 1).await;
    wait_unfenced(&addrs, 1).await;
    let client = Arc::new(admin(addrs.clone()));
    client
        .create_topic("churn", Some(1), Some(1), BTreeMap::new())
        .await
        .unwrap();
    let log_dir = c.data_dir(1).join("raft").join("log");
    let log_bytes = || -> u64 {
        std::fs::read_dir(&log_dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum()
    };
    let mut sizes = Vec::new();
    for round in 0..4 {
        let mut tasks = tokio::task::JoinSet::new();
        for worker in 0..4 {
            let client = client.clone();
            tasks.spawn(async move {
                for i in 0..200 {
                    let value = (round * 100_000 + worker * 1000 + i + 1000).to_string();
                    client
                        .alter_topic(tidelog::api::proto::AlterTopicRequest {
                            name: "churn".to_owned(),
                            partitions: None,
                            set_config: [("retention.ms".to_owned(), value)].into(),
                            delete_config: vec![],
                            reassignments: vec![],
                        })
                        .await
                        .expect("alter");
                }
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
        sizes.push(log_bytes());
    }
    // 3,200 writes; at most snapshot interval + kept entries + one segment stay on disk.
    let entry_bytes_max = 600;
    let bound = (200 + 50) * entry_bytes_max + 16384 * 2;
    for s in &sizes {
        assert!(
            *s < bound as u64,
            "raft log grew to {s} bytes (sizes {sizes:?}, bound {bound})"
        );
    }
    assert!(c.data_dir(1).join("raft").join("snapshot.bin").exists());
    // The snapshot and the remaining log restore the same state.
    c.stop(1);
    c.start_node(1);
    wait_for_leader(&c).await;
    let t = topic(&admin(c.live_addresses()), "churn").await;
    assert_eq!(t.config["retention.ms"].len(), 6, "{:?}", t.config);
}

/// The lines of `text` after the first `skip` bytes.
fn lines_after(text: &str, skip: usize) -> Vec<String> {
    text.get(skip..)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_peer_controller_is_logged_once_and_its_return_once() {
    let mut c = Controllers::start(3, &[]);
    let leader = wait_for_leader(&c).await;
    let follower = (1..=3).find(|id| *id != leader).unwrap();
    let leader_proc = |c: &Controllers| c.procs[leader as usize - 1].as_ref().unwrap().stderr();
    // Late answers of the election (openraft warns about votes it ignores) belong to the
    // election, not to the dead peer: start counting once the leader's log is quiet.
    let mut before = leader_proc(&c).len();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = leader_proc(&c).len();
        if now == before {
            break;
        }
        before = now;
    }

    c.kill9(follower);
    let gone = format!("peer={follower}");
    eventually(
        "the leader notices the dead peer",
        Duration::from_secs(10),
        || {
            let text = leader_proc(&c);
            let seen = lines_after(&text, before)
                .iter()
                .any(|l| l.contains("controller peer not answering") && l.contains(&gone));
            async move { seen.then_some(()) }
        },
    )
    .await;
    // openraft retries the dead peer every 500 ms: give it a dozen retries to log.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let during = lines_after(&leader_proc(&c), before);
    let loud: Vec<&String> = during
        .iter()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .collect();
    assert_eq!(
        during
            .iter()
            .filter(|l| l.contains("controller peer not answering"))
            .count(),
        1,
        "{during:#?}"
    );
    assert!(
        loud.len() <= 3,
        "{} WARN/ERROR lines: {loud:#?}",
        loud.len()
    );
    assert!(
        during.iter().all(|l| l.len() <= 300),
        "long lines: {during:#?}"
    );

    let mark = leader_proc(&c).len();
    c.start_node(follower);
    eventually(
        "the leader logs the peer's return",
        Duration::from_secs(10),
        || {
            let back = lines_after(&leader_proc(&c), mark)
                .iter()
                .filter(|l| l.contains("controller peer answering again") && l.contains(&gone))
                .count();
            async move { (back == 1).then_some(()) }
        },
    )
    .await;
}
