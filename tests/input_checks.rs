//! Input the server must refuse with a specific code, changing nothing, against the real
//! binary: reserved internal topics changed by a client, `min.insync.replicas` above the
//! replication factor, unknown compression values, negative timestamps and transactional
//! batches, too many partitions in one request, a fetch's byte budget across partitions,
//! and requests tonic refuses before a
//! handler runs (too large, not protobuf), which must still carry a tidelog code.

mod common;

use std::process::{Command, Stdio};

use common::{binary, cli, free_ports, standalone, standalone_with, Proc};
use tidelog::api::proto::broker_client::BrokerClient;
use tidelog::api::proto::groups_client::GroupsClient;
use tidelog::api::proto::{
    FetchPartition, FetchRequest, FetchTopic, FindCoordinatorRequest, ListOffsetsPartition,
    ListOffsetsRequest, ListOffsetsTopic, PartitionProduceData, ProduceRequest, Record,
    TopicProduceData,
};
use tidelog::api::status::{code_of, from_wire, ERROR_CODE_KEY};
use tidelog::error_code::ErrorCode;
use tidelog::record::{compute_crc, BatchBuilder, Compression, RecordRef};

fn create(bootstrap: &str, topic: &str, extra: &[&str]) -> (bool, String) {
    let mut args = vec![
        "topics",
        "create",
        "--bootstrap",
        bootstrap,
        "--topic",
        topic,
    ];
    args.extend_from_slice(extra);
    let (ok, _, err) = cli(&args);
    (ok, err)
}

fn start(dir: &std::path::Path) -> (Proc, String) {
    let port = free_ports(1)[0];
    let server = standalone(dir, port);
    (server, format!("127.0.0.1:{port}"))
}

async fn broker(bootstrap: &str) -> BrokerClient<tonic::transport::Channel> {
    BrokerClient::connect(format!("http://{bootstrap}"))
        .await
        .unwrap()
        .max_encoding_message_size(usize::MAX)
}

/// The latest offset of `topic`-0.
async fn log_end(bootstrap: &str, topic: &str) -> i64 {
    let r = broker(bootstrap)
        .await
        .list_offsets(ListOffsetsRequest {
            topics: vec![ListOffsetsTopic {
                topic: topic.into(),
                partitions: vec![ListOffsetsPartition {
                    partition: 0,
                    timestamp_ms: -1,
                }],
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    r.topics[0].partitions[0].offset
}

fn produce_request(topic: &str, data: PartitionProduceData) -> ProduceRequest {
    ProduceRequest {
        transactional_id: None,
        acks: Some(1),
        timeout_ms: 5_000,
        topics: vec![TopicProduceData {
            topic: topic.into(),
            partitions: vec![data],
        }],
    }
}

/// Produces `data` to `topic`-0; returns the partition's error code and message.
async fn produce_error(
    bootstrap: &str,
    topic: &str,
    data: PartitionProduceData,
) -> (ErrorCode, String) {
    let r = broker(bootstrap)
        .await
        .produce(produce_request(topic, data))
        .await
        .unwrap()
        .into_inner();
    let p = &r.topics[0].partitions[0];
    let code = from_wire(p.error_code).unwrap_or_else(|| panic!("accepted: {p:?}"));
    (code, p.error_message.clone())
}

fn batch_with(timestamp: i64, attributes_or: i16) -> Vec<u8> {
    let mut builder = BatchBuilder::new(Compression::None);
    builder.push(RecordRef {
        timestamp,
        key: None,
        value: Some(b"v"),
        headers: &[],
    });
    let mut bytes = builder.build(0).unwrap();
    if attributes_or != 0 {
        let attributes = i16::from_be_bytes([bytes[21], bytes[22]]) | attributes_or;
        bytes[21..23].copy_from_slice(&attributes.to_be_bytes());
        let crc = compute_crc(&bytes);
        bytes[17..21].copy_from_slice(&crc.to_be_bytes());
    }
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_may_not_change_reserved_internal_topics() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, bootstrap) = start(dir.path());
    for name in ["__consumer_offsets", "__transaction_state"] {
        let (ok, err) = create(&bootstrap, name, &[]);
        assert!(!ok, "a client created {name}");
        assert!(err.contains("INVALID_TOPIC"), "{err}");
        assert!(err.contains("reserved for internal topics"), "{err}");
    }
    let (_, topics, _) = cli(&["topics", "list", "--bootstrap", &bootstrap]);
    assert!(!topics.contains("__"), "{topics}");

    // The broker's own path still creates __consumer_offsets.
    let mut groups = GroupsClient::connect(format!("http://{bootstrap}"))
        .await
        .unwrap();
    groups
        .find_coordinator(FindCoordinatorRequest { group: "g".into() })
        .await
        .unwrap();
    let (_, topics, _) = cli(&["topics", "list", "--bootstrap", &bootstrap]);
    assert!(topics.contains("__consumer_offsets"), "{topics}");

    for args in [
        vec!["topics", "delete", "--topic", "__consumer_offsets"],
        vec![
            "topics",
            "alter",
            "--topic",
            "__consumer_offsets",
            "--partitions",
            "60",
        ],
    ] {
        let mut args = args.clone();
        args.extend(["--bootstrap", &bootstrap]);
        let (ok, _, err) = cli(&args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains("INVALID_TOPIC"), "{args:?}: {err}");
    }
    let (_, topics, _) = cli(&["topics", "list", "--bootstrap", &bootstrap]);
    assert!(topics.contains("__consumer_offsets"), "{topics}");

    // Nor may clients write into one.
    let mut child = std::process::Command::new(common::binary())
        .args([
            "produce",
            "--topic",
            "__consumer_offsets",
            "--partition",
            "0",
            "--bootstrap",
            &bootstrap,
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    writeln!(child.stdin.take().unwrap(), "garbage").unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a client wrote into __consumer_offsets"
    );
    assert!(
        err.contains("INVALID_TOPIC") && err.contains("internal topics"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_insync_replicas_above_the_replication_factor_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, bootstrap) = start(dir.path());
    let (ok, err) = create(&bootstrap, "t", &["--config", "min.insync.replicas=2"]);
    assert!(
        !ok,
        "created with min.insync.replicas=2 > replication factor 1"
    );
    assert!(err.contains("INVALID_CONFIG"), "{err}");
    assert!(err.contains("min.insync.replicas 2"), "{err}");
    let (_, topics, _) = cli(&["topics", "list", "--bootstrap", &bootstrap]);
    assert!(!topics.lines().any(|l| l.trim() == "t"), "{topics}");

    let (ok, err) = create(&bootstrap, "t", &[]);
    assert!(ok, "{err}");
    let (ok, _, err) = cli(&[
        "topics",
        "alter",
        "--bootstrap",
        &bootstrap,
        "--topic",
        "t",
        "--config",
        "min.insync.replicas=3",
    ]);
    assert!(!ok, "altered to min.insync.replicas=3");
    assert!(err.contains("INVALID_CONFIG"), "{err}");
}

fn record(timestamp_ms: Option<i64>) -> Record {
    Record {
        value: Some(b"v".to_vec().into()),
        timestamp_ms,
        ..Default::default()
    }
}

fn raw(bytes: Vec<u8>) -> PartitionProduceData {
    PartitionProduceData {
        partition: 0,
        record_batches: bytes.into(),
        ..Default::default()
    }
}

/// A standalone with topic `t` (1 partition).
async fn with_topic(dir: &std::path::Path) -> (Proc, String) {
    let (server, bootstrap) = start(dir);
    let (ok, err) = create(&bootstrap, "t", &[]);
    assert!(ok, "{err}");
    (server, bootstrap)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_compression_values_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, bootstrap) = with_topic(dir.path()).await;
    let (code, message) = produce_error(
        &bootstrap,
        "t",
        PartitionProduceData {
            partition: 0,
            records: vec![record(None)],
            compression: 9,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(code, ErrorCode::InvalidRequest, "{message}");
    assert!(message.contains("compression 9"), "{message}");
    assert_eq!(
        log_end(&bootstrap, "t").await,
        0,
        "a refused batch was written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_timestamps_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, bootstrap) = with_topic(dir.path()).await;
    let (code, message) = produce_error(
        &bootstrap,
        "t",
        PartitionProduceData {
            partition: 0,
            records: vec![record(Some(1)), record(Some(-5))],
            ..Default::default()
        },
    )
    .await;
    assert_eq!(code, ErrorCode::InvalidRecord, "{message}");
    assert!(
        message.contains("record 1 has timestamp_ms -5"),
        "{message}"
    );
    for timestamp in [-7, -1] {
        let (code, message) = produce_error(&bootstrap, "t", raw(batch_with(timestamp, 0))).await;
        assert_eq!(code, ErrorCode::InvalidRecord, "{message}");
        assert!(
            message.contains(&format!("timestamp {timestamp}")),
            "{message}"
        );
    }
    assert_eq!(
        log_end(&bootstrap, "t").await,
        0,
        "a refused batch was written"
    );
    // The same batch with a valid timestamp is accepted.
    let r = broker(&bootstrap)
        .await
        .produce(produce_request("t", raw(batch_with(1_000, 0))))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.topics[0].partitions[0].error_code, 0);
    assert_eq!(log_end(&bootstrap, "t").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_and_control_batches_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, bootstrap) = with_topic(dir.path()).await;
    for (attribute, needle) in [(0x10, "transactional"), (0x20, "control")] {
        let (code, message) =
            produce_error(&bootstrap, "t", raw(batch_with(1_000, attribute))).await;
        assert_eq!(code, ErrorCode::InvalidRecord, "{message}");
        assert!(message.contains(needle), "{needle}: {message}");
    }
    assert_eq!(
        log_end(&bootstrap, "t").await,
        0,
        "a refused batch was written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_naming_too_many_partitions_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, bootstrap) = start(dir.path());
    assert!(create(&bootstrap, "t", &[]).0);
    let fetch = |n: u32| FetchRequest {
        max_wait_ms: 0,
        topics: vec![FetchTopic {
            topic: "t".into(),
            partitions: (0..n)
                .map(|partition| FetchPartition {
                    partition,
                    fetch_offset: 0,
                    partition_max_bytes: 0,
                })
                .collect(),
        }],
        ..Default::default()
    };
    for n in [1_001, 100_000] {
        let status = broker(&bootstrap).await.fetch(fetch(n)).await.unwrap_err();
        assert_eq!(code_of(&status), ErrorCode::InvalidRequest, "{status:?}");
        assert!(
            status.metadata().get(ERROR_CODE_KEY).is_some(),
            "{status:?}"
        );
        assert!(
            status.message().contains(&format!("names {n} partitions"))
                && status.message().contains("limit is 1000"),
            "{}",
            status.message()
        );
    }
    // At the limit the request is served (unknown partitions answer per partition).
    let r = broker(&bootstrap).await.fetch(fetch(1_000)).await.unwrap();
    assert_eq!(r.into_inner().topics[0].partitions.len(), 1_000);

    let produce = ProduceRequest {
        transactional_id: None,
        acks: Some(1),
        timeout_ms: 5_000,
        topics: vec![TopicProduceData {
            topic: "t".into(),
            partitions: (0..1_001)
                .map(|partition| PartitionProduceData {
                    partition,
                    records: vec![Record::default()],
                    ..Default::default()
                })
                .collect(),
        }],
    };
    let status = broker(&bootstrap).await.produce(produce).await.unwrap_err();
    assert_eq!(code_of(&status), ErrorCode::InvalidRequest, "{status:?}");
    assert!(status.message().contains("limit is 1000"), "{status:?}");
    assert_eq!(log_end(&bootstrap, "t").await, 0);
}

/// A message that is not a ProduceRequest: field 1 (acks, a varint) as a string.
#[derive(Clone, PartialEq, prost::Message)]
struct NotAProduceRequest {
    #[prost(string, tag = "1")]
    text: String,
}

/// A standalone with topic `t` that accepts requests of at most 64 KiB.
async fn with_small_requests(dir: &std::path::Path) -> (Proc, String) {
    let port = free_ports(1)[0];
    let server = standalone_with(dir, port, &[("TIDELOG_MAX_REQUEST_BYTES", "65536")]);
    let bootstrap = format!("127.0.0.1:{port}");
    let (ok, err) = create(&bootstrap, "t", &[]);
    assert!(ok, "{err}");
    (server, bootstrap)
}

fn coded(status: &tonic::Status) -> Option<&str> {
    status
        .metadata()
        .get(ERROR_CODE_KEY)
        .map(|v| v.to_str().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_above_max_request_bytes_carries_a_tidelog_code() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, bootstrap) = with_small_requests(dir.path()).await;
    // 100 MiB: tonic refuses it before the handler runs.
    let big = produce_request(
        "t",
        PartitionProduceData {
            partition: 0,
            records: vec![Record {
                value: Some(vec![7u8; 100 << 20].into()),
                ..Default::default()
            }],
            ..Default::default()
        },
    );
    let status = broker(&bootstrap).await.produce(big).await.unwrap_err();
    assert_eq!(coded(&status), Some("INVALID_REQUEST"), "{status:?}");
    assert!(status.message().contains("65536"), "{status:?}");
    assert_eq!(log_end(&bootstrap, "t").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_protobuf_carries_a_tidelog_code() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, bootstrap) = with_topic(dir.path()).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{bootstrap}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let status = grpc
        .unary::<_, tidelog::api::proto::ProduceResponse, _>(
            tonic::Request::new(NotAProduceRequest {
                text: "hello".into(),
            }),
            "/tidelog.v1.Broker/Produce".parse().unwrap(),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(coded(&status), Some("INVALID_REQUEST"), "{status:?}");
    assert_eq!(log_end(&bootstrap, "t").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_shows_the_code_of_a_request_above_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, bootstrap) = with_small_requests(dir.path()).await;
    let out = Command::new(binary())
        .args(["produce", "--bootstrap", &bootstrap, "--topic", "t"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            let line = format!("{}\n", "x".repeat(100_000));
            child.stdin.take().unwrap().write_all(line.as_bytes())?;
            child.wait_with_output()
        })
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("INVALID_REQUEST"), "{err}");
}

/// A fetch's `max_bytes` bounds the whole response, as KIP-74 has it: only the first
/// partition with records may exceed it (one whole batch), the rest answer no records
/// once it is spent. Before, every partition returned a batch, so one request naming many
/// partitions could make the broker read and send about 1,000 batches whatever it asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_response_stays_within_max_bytes_across_partitions() {
    const PARTITIONS: u32 = 20;
    let dir = tempfile::tempdir().unwrap();
    let (_server, bootstrap) = start(dir.path());
    assert!(create(&bootstrap, "b", &["--partitions", &PARTITIONS.to_string()]).0);
    let value = vec![b'x'; 64 * 1024];
    // New partitions take a moment to have a leader: resend to those not yet written.
    let mut left: Vec<u32> = (0..PARTITIONS).collect();
    for _ in 0..100 {
        let produce = ProduceRequest {
            transactional_id: None,
            acks: Some(-1),
            timeout_ms: 5_000,
            topics: vec![TopicProduceData {
                topic: "b".into(),
                partitions: left
                    .iter()
                    .map(|&partition| PartitionProduceData {
                        partition,
                        records: vec![Record {
                            value: Some(value.clone().into()),
                            ..Default::default()
                        }],
                        ..Default::default()
                    })
                    .collect(),
            }],
        };
        let r = broker(&bootstrap).await.produce(produce).await.unwrap();
        let written: Vec<u32> = r.into_inner().topics[0]
            .partitions
            .iter()
            .filter(|p| p.error_code == 0)
            .map(|p| p.partition)
            .collect();
        left.retain(|p| !written.contains(p));
        if left.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(left.is_empty(), "partitions never written: {left:?}");
    for max_bytes in [1, 100 * 1024] {
        let r = broker(&bootstrap)
            .await
            .fetch(FetchRequest {
                max_wait_ms: 0,
                max_bytes,
                raw_batches: true,
                topics: vec![FetchTopic {
                    topic: "b".into(),
                    partitions: (0..PARTITIONS)
                        .map(|partition| FetchPartition {
                            partition,
                            fetch_offset: 0,
                            partition_max_bytes: 0,
                        })
                        .collect(),
                }],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let parts = &r.topics[0].partitions;
        assert_eq!(parts.len(), PARTITIONS as usize);
        let with_records: Vec<u32> = parts
            .iter()
            .filter(|p| !p.record_batches.is_empty())
            .map(|p| p.partition)
            .collect();
        // 1 byte: the first partition alone (its batch exceeds the budget); 100 KiB: the
        // first one's 64 KiB batch leaves room for one more.
        let expected = if max_bytes == 1 { 1 } else { 2 };
        assert_eq!(
            with_records.len(),
            expected,
            "max_bytes {max_bytes}: {with_records:?}"
        );
        assert!(parts
            .iter()
            .all(|p| p.error_code == 0 && p.high_watermark == 1));
    }
}

/// An isolation level that is neither READ_UNCOMMITTED nor READ_COMMITTED is refused with
/// INVALID_REQUEST naming the field, in Fetch and ListOffsets (Subscribe shares the check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_isolation_levels_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, bootstrap) = with_topic(dir.path()).await;
    let partitions = vec![FetchPartition {
        partition: 0,
        fetch_offset: 0,
        partition_max_bytes: 0,
    }];
    for isolation in [0, 1, 2, -1] {
        let fetch = FetchRequest {
            max_wait_ms: 0,
            topics: vec![FetchTopic {
                topic: "t".into(),
                partitions: partitions.clone(),
            }],
            isolation,
            ..Default::default()
        };
        let offsets = ListOffsetsRequest {
            topics: vec![ListOffsetsTopic {
                topic: "t".into(),
                partitions: vec![ListOffsetsPartition {
                    partition: 0,
                    timestamp_ms: -1,
                }],
            }],
            isolation,
        };
        let fetched = broker(&bootstrap).await.fetch(fetch).await;
        let listed = broker(&bootstrap).await.list_offsets(offsets).await;
        if isolation == 0 || isolation == 1 {
            assert!(fetched.is_ok() && listed.is_ok(), "isolation {isolation}");
            continue;
        }
        for status in [fetched.unwrap_err(), listed.unwrap_err()] {
            assert_eq!(code_of(&status), ErrorCode::InvalidRequest, "{status:?}");
            assert!(
                status.message().contains(&format!(
                    "isolation must be READ_UNCOMMITTED (0) or READ_COMMITTED (1), got {isolation}"
                )),
                "{}",
                status.message()
            );
        }
    }
}
