//! What a new user trips over, against the real binary: data commands bootstrapped from
//! a controller, configuration typos refused with the closest key, `standalone` taking
//! `listen` from its file and environment, a duplicate broker id failing fast, bad
//! topics and partitions answered at once, gRPC reflection (v1 and v1alpha) listing the
//! public services, and an acks=all producer losing nothing when a leader is killed -9.

mod common;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{binary, cli, free_ports, read_all, run_to_exit, BrokerCluster, Proc};
use futures_util::StreamExt;
use tidelog::client::AdminClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_commands_work_with_a_controller_as_bootstrap() {
    let c = BrokerCluster::start(2);
    let controller = c.controller_address();
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--bootstrap",
        &controller,
        "--topic",
        "via-controller",
        "--partitions",
        "2",
        "--replication-factor",
        "2",
    ]);
    assert!(ok, "{err}");
    let out = Command::new(binary())
        .args([
            "produce",
            "--bootstrap",
            &controller,
            "--topic",
            "via-controller",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(b"one\ntwo\nthree\n")?;
            child.wait_with_output()
        })
        .unwrap();
    assert!(
        out.status.success(),
        "produce through a controller: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (ok, out, err) = cli(&[
        "consume",
        "--bootstrap",
        &controller,
        "--topic",
        "via-controller",
        "--from-beginning",
        "--max-messages",
        "3",
        "--timeout-ms",
        "10000",
    ]);
    assert!(ok, "consume through a controller: {err}");
    let mut got: Vec<&str> = out.lines().collect();
    got.sort_unstable();
    assert_eq!(got, vec!["one", "three", "two"]);
    let (ok, _, err) = cli(&[
        "consume",
        "--bootstrap",
        &controller,
        "--topic",
        "via-controller",
        "--group",
        "g1",
        "--from-beginning",
        "--max-messages",
        "3",
        "--timeout-ms",
        "10000",
    ]);
    assert!(ok, "a group consumer through a controller: {err}");
    let (ok, out, err) = cli(&[
        "groups",
        "describe",
        "--bootstrap",
        &controller,
        "--group",
        "g1",
    ]);
    assert!(ok, "groups describe through a controller: {err}");
    assert!(out.contains("via-controller"), "{out}");
}

#[test]
fn configuration_typos_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("broker.toml");
    std::fs::write(&file, "auto_create_topic_enable = true\n").unwrap();
    let data = dir.path().join("data");
    let data = data.to_str().unwrap();
    let (ok, exited, err, _) = run_to_exit(
        &[
            "broker",
            "--config",
            file.to_str().unwrap(),
            "--data-dir",
            data,
        ],
        &[],
        Duration::from_secs(10),
    );
    assert!(exited && !ok, "a typo in the file stops the broker");
    assert!(err.contains("auto_create_topic_enable"), "{err}");
    assert!(err.contains("broker.toml"), "{err}");
    assert!(
        err.contains("auto_create_topics_enable"),
        "names the closest key: {err}"
    );

    std::fs::write(&file, "auto_create_topics_enable = \"yes\"\n").unwrap();
    let (ok, exited, err, _) = run_to_exit(
        &[
            "standalone",
            "--config",
            file.to_str().unwrap(),
            "--data-dir",
            data,
        ],
        &[],
        Duration::from_secs(10),
    );
    assert!(exited && !ok, "a string for a boolean is refused");
    assert!(err.contains("true or false"), "{err}");

    let (ok, exited, err, _) = run_to_exit(
        &["controller", "--data-dir", data],
        &[("TIDELOG_RAFT_HEARTBEAT_INTERVAL", "100")],
        Duration::from_secs(10),
    );
    assert!(exited && !ok, "an unknown variable stops the controller");
    assert!(
        err.contains("TIDELOG_RAFT_HEARTBEAT_INTERVAL")
            && err.contains("TIDELOG_RAFT_HEARTBEAT_INTERVAL_MS"),
        "{err}"
    );
}

#[test]
fn standalone_takes_listen_from_its_file_and_environment() {
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports(2);
    let from_env = format!("127.0.0.1:{}", ports[0]);
    let data = dir.path().join("a");
    let p = Proc::start(
        "standalone",
        &["--data-dir".into(), data.display().to_string()],
        &[("TIDELOG_LISTEN", from_env.as_str())],
        dir.path(),
    );
    assert_eq!(p.ready_address, from_env);
    drop(p);
    let from_file = format!("127.0.0.1:{}", ports[1]);
    let file = dir.path().join("standalone.toml");
    std::fs::write(&file, format!("listen = \"{from_file}\"\n")).unwrap();
    let data = dir.path().join("b");
    let p = Proc::start(
        "standalone",
        &[
            "--data-dir".into(),
            data.display().to_string(),
            "--config".into(),
            file.display().to_string(),
        ],
        &[],
        dir.path(),
    );
    assert_eq!(p.ready_address, from_file);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_broker_with_a_live_id_fails_fast() {
    let c = BrokerCluster::start(1);
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let listen = format!("127.0.0.1:{port}");
    let controllers = c.controller_internal_addresses().join(",");
    let data = dir.path().display().to_string();
    let secret = c.secret_args();
    // The cluster's session timeout is 3 s: the second process must give up soon after.
    let (ok, exited, err, took) = run_to_exit(
        &[
            "broker",
            "--broker-id",
            "1",
            "--listen",
            &listen,
            "--controllers",
            &controllers,
            "--data-dir",
            &data,
            &secret[0],
            &secret[1],
        ],
        &[],
        Duration::from_secs(30),
    );
    assert!(exited && !ok, "a duplicate broker id is an error");
    assert!(err.contains("DUPLICATE_BROKER_REGISTRATION"), "{err}");
    assert!(err.contains("in use by another live process"), "{err}");
    assert!(took < Duration::from_secs(12), "gave up after {took:?}");
    let waits = err.matches("waiting for its session to expire").count();
    assert!(waits <= 1, "logged the wait {waits} times:\n{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_topics_and_partitions_are_answered_at_once() {
    let c = BrokerCluster::start(1);
    let b = c.broker_address(1);
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--bootstrap",
        &b,
        "--topic",
        "two",
        "--partitions",
        "2",
    ]);
    assert!(ok, "{err}");
    let (ok, exited, err, took) = run_to_exit(
        &[
            "perf",
            "produce",
            "--bootstrap",
            &b,
            "--topic",
            "nosuch",
            "--num-records",
            "1000",
            "--record-size",
            "10",
        ],
        &[],
        Duration::from_secs(20),
    );
    assert!(exited && !ok);
    assert!(
        err.starts_with("error: UNKNOWN_TOPIC_OR_PARTITION"),
        "{err}"
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
    let (ok, exited, err, took) = run_to_exit(
        &[
            "consume",
            "--bootstrap",
            &b,
            "--topic",
            "two",
            "--partition",
            "7",
        ],
        &[],
        Duration::from_secs(20),
    );
    assert!(exited && !ok);
    assert!(
        err.contains("UNKNOWN_TOPIC_OR_PARTITION") && err.contains("2 partitions"),
        "{err}"
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_public_services_in_v1_and_v1alpha() {
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
    let c = BrokerCluster::start(1);
    for address in [c.broker_address(1), c.controller_address()] {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = ServerReflectionClient::new(channel);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = client
            .server_reflection_info(futures_util::stream::iter(vec![request]))
            .await
            .expect("v1alpha reflection")
            .into_inner();
        let answer = answers.next().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
            panic!("no service list: {answer:?}")
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        assert!(names.contains(&"tidelog.v1.Admin".to_owned()), "{names:?}");
        assert!(
            names.contains(&"grpc.health.v1.Health".to_owned()),
            "{names:?}"
        );
        for internal in [
            "tidelog.v1.Raft",
            "tidelog.v1.Controller",
            "tidelog.v1.Replication",
        ] {
            assert!(
                !names.contains(&internal.to_owned()),
                "{internal} listed: {names:?}"
            );
        }
    }
}

/// `tidelog perf produce --acks all` while the leader of a partition is killed -9: the
/// idempotent producer retries through the transport errors and the new leader, and the
/// run ends with every record acknowledged, none lost and none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perf_produce_acks_all_survives_a_leader_kill_9() {
    let mut c = BrokerCluster::start_with(3, &[("TIDELOG_REPLICA_LAG_TIME_MAX_MS", "2000")]);
    let admin = AdminClient::new(c.bootstrap(), Duration::from_secs(20));
    admin
        .create_topic(
            "kill",
            Some(3),
            Some(3),
            BTreeMap::from([("min.insync.replicas".to_owned(), "2".to_owned())]),
        )
        .await
        .unwrap();
    let t = common::eventually("all replicas in sync", Duration::from_secs(30), || async {
        let t = admin
            .describe_topics(vec!["kill".into()])
            .await
            .ok()?
            .topics
            .remove(0)
            .topic?;
        t.partitions
            .iter()
            .all(|p| p.leader.is_some() && p.isr.len() == 3)
            .then_some(t)
    })
    .await;
    const RECORDS: usize = 100_000;
    let bootstrap = c.bootstrap().join(",");
    let records = RECORDS.to_string();
    let perf = Command::new(binary())
        .args([
            "perf",
            "produce",
            "--bootstrap",
            &bootstrap,
            "--topic",
            "kill",
            "--num-records",
            &records,
            "--record-size",
            "100",
            "--acks",
            "all",
            "--throughput",
            "5000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let victim = t.partitions[0].leader.unwrap();
    c.brokers[victim as usize - 1].take().unwrap().kill9();
    let out = tokio::task::spawn_blocking(move || perf.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "perf produce through a leader kill: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stored = read_all(&c.bootstrap(), "kill", 3).await;
    assert_eq!(stored.len(), RECORDS, "every record exactly once");
}
