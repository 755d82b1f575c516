//! The internal listener: Raft, broker lifecycle and replication are refused on client
//! ports with a code, and served on the internal port only to nodes holding the cluster
//! secret (issue 11, item 1).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{internal_of, node_secret, run_to_exit, BrokerCluster};
use tidelog::api::proto::controller_client::ControllerClient as ControllerGrpc;
use tidelog::api::proto::raft_client::RaftClient;
use tidelog::api::proto::replication_client::ReplicationClient;
use tidelog::api::proto::{
    BrokerHeartbeatRequest, NodeStatusRequest, RaftPayload, RegisterBrokerRequest,
    ReplicaFetchPartition, ReplicaFetchRequest,
};
use tidelog::api::status::code_of;
use tidelog::client::AdminClient;
use tidelog::error_code::ErrorCode;
use tidelog::net::node_auth::{internal_channel, ClusterSecret};
use tonic::transport::{Channel, Endpoint};

/// A Vote with a huge term, as an attacker would send to take leadership away.
fn hostile_vote() -> RaftPayload {
    let vote = openraft::raft::VoteRequest::<u64>::new(openraft::Vote::new(1024, 9), None);
    RaftPayload {
        json: serde_json::to_vec(&vote).unwrap().into(),
    }
}

async fn plain_channel(address: &str) -> Channel {
    Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy()
}

#[track_caller]
fn assert_refused<T: std::fmt::Debug>(what: &str, result: Result<T, tonic::Status>) {
    match result {
        Ok(r) => panic!("{what} was served on a client port: {r:?}"),
        Err(status) => assert_eq!(
            code_of(&status),
            ErrorCode::ClusterAuthorizationFailed,
            "{what}: {status:?}"
        ),
    }
}

async fn controller_term(admin: &AdminClient) -> u64 {
    admin
        .describe_cluster()
        .await
        .expect("describe cluster")
        .controllers
        .iter()
        .map(|c| c.term)
        .max()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_ports_refuse_internal_services_with_a_code() {
    let c = BrokerCluster::start(1);
    let admin = AdminClient::new(vec![c.controller_address()], Duration::from_secs(10));
    let term_before = controller_term(&admin).await;
    for address in [c.controller_address(), c.broker_address(1)] {
        let channel = plain_channel(&address).await;
        assert_refused(
            "Raft.Vote",
            RaftClient::new(channel.clone()).vote(hostile_vote()).await,
        );
        assert_refused(
            "Raft.AppendEntries",
            RaftClient::new(channel.clone())
                .append_entries(RaftPayload {
                    json: b"{}".to_vec().into(),
                })
                .await,
        );
        assert_refused(
            "Controller.RegisterBroker",
            ControllerGrpc::new(channel.clone())
                .register_broker(RegisterBrokerRequest {
                    broker_id: 66,
                    address: "127.0.0.1:1".to_owned(),
                    internal_address: "127.0.0.1:2".to_owned(),
                    rack: None,
                    incarnation_id: "impostor".to_owned(),
                    kafka_address: None,
                })
                .await,
        );
        assert_refused(
            "Controller.BrokerHeartbeat(want_shut_down)",
            ControllerGrpc::new(channel.clone())
                .broker_heartbeat(BrokerHeartbeatRequest {
                    broker_id: 1,
                    broker_epoch: 0,
                    metadata_version: 0,
                    want_fence: false,
                    want_shut_down: true,
                    offline_replicas: Vec::new(),
                })
                .await,
        );
        assert_refused(
            "Replication.ReplicaFetch",
            ReplicationClient::new(channel.clone())
                .replica_fetch(ReplicaFetchRequest {
                    replica_id: 1,
                    max_wait_ms: 0,
                    max_bytes: 1024,
                    partitions: vec![ReplicaFetchPartition {
                        topic: "t".to_owned(),
                        topic_id: String::new(),
                        partition: 0,
                        leader_epoch: 0,
                        fetch_offset: 0,
                        max_bytes: 1024,
                        high_watermark: None,
                    }],
                })
                .await,
        );
    }
    // Nothing changed: no term inflation, no impostor broker.
    let described = admin.describe_cluster().await.unwrap();
    assert_eq!(controller_term(&admin).await, term_before);
    assert!(
        described
            .brokers
            .iter()
            .all(|b| b.broker.as_ref().is_some_and(|b| b.id != 66)),
        "{described:?}"
    );
    // Public services still work on the same ports.
    admin.list_topics().await.expect("Admin on the client port");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_internal_port_serves_only_nodes_holding_the_secret() {
    let c = BrokerCluster::start(1);
    let internal = internal_of(&c.controller_address());
    // The right secret: served.
    let good = internal_channel(&internal, node_secret(), Duration::from_secs(2)).unwrap();
    let status = ControllerGrpc::new(good)
        .node_status(NodeStatusRequest {})
        .await
        .expect("a node with the secret is served");
    assert!(status.into_inner().status.is_some());
    // A wrong secret: refused at the handshake, nothing served.
    let wrong = Arc::new(ClusterSecret::from_bytes(b"not the cluster secret at all").unwrap());
    let bad = internal_channel(&internal, wrong, Duration::from_secs(2)).unwrap();
    let err = ControllerGrpc::new(bad)
        .node_status(NodeStatusRequest {})
        .await
        .expect_err("a node without the secret is refused");
    assert_eq!(code_of(&err), ErrorCode::NetworkException, "{err:?}");
    // A plain gRPC client (no handshake): refused too.
    let plain = plain_channel(&internal).await;
    let err = RaftClient::new(plain)
        .vote(hostile_vote())
        .await
        .expect_err("a plain client is refused on the internal port");
    assert_ne!(code_of(&err), ErrorCode::UnknownServerError, "{err:?}");
    // The controller logged both, naming what knocked.
    let stderr = c.controllers.procs[0].as_ref().unwrap().stderr();
    assert!(
        stderr.contains("does not hold the cluster secret")
            || stderr.contains("not an authenticated tidelog node"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_pointed_at_a_client_port_says_why_it_cannot_register() {
    let c = BrokerCluster::start(1);
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_ports(1)[0];
    let listen = format!("127.0.0.1:{port}");
    let data = dir.path().display().to_string();
    let secret = c.secret_args();
    let started = Instant::now();
    let (ok, exited, err, _) = run_to_exit(
        &[
            "broker",
            "--broker-id",
            "2",
            "--listen",
            &listen,
            // The controller's client port, not its internal one.
            "--controllers",
            &c.controller_address(),
            "--data-dir",
            &data,
            &secret[0],
            &secret[1],
        ],
        &[("TIDELOG_REGISTRATION_TIMEOUT_MS", "3000")],
        Duration::from_secs(30),
    );
    assert!(
        exited && !ok,
        "registration through a client port must fail"
    );
    assert!(
        err.contains("not a tidelog internal listener"),
        "the error should say what is wrong: {err}"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_node_reachable_from_other_hosts_needs_a_secret() {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_ports(1)[0];
    let data = dir.path().display().to_string();
    let listen = format!("127.0.0.1:{port}");
    // A controller that must refuse to start; returns its stderr.
    let refused = |extra: &[&str]| {
        let out = std::process::Command::new(common::binary())
            .args(["controller", "--listen", &listen, "--data-dir", &data])
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{extra:?} must be refused");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // Never bound: the check comes first.
    let err = refused(&["--internal-listen", "10.255.255.1:9393"]);
    assert!(err.contains("cluster_secret_file must be set"), "{err}");
    // A secret that is too short is refused too.
    let short = dir.path().join("short.secret");
    std::fs::write(&short, "short").unwrap();
    let err = refused(&["--cluster-secret-file", &short.display().to_string()]);
    assert!(err.contains("at least 16 are needed"), "{err}");
}
