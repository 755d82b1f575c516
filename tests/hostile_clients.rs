//! Hostile clients against one standalone server, one after another: garbage bytes
//! instead of HTTP/2, a flood of half-open handshakes above the connection cap, garbage
//! frames after a valid preface, internal RPCs on the client port, a decompression bomb
//! and a request above the size limit. After each the server still answers with codes,
//! and at the end every record acknowledged before the attacks is still at its offset.
//! (Each defence also has its own focused test: net, internal_listener, input_checks.)

mod common;

use std::time::{Duration, Instant};

use common::{fetch_partition0, free_ports, standalone_with};
use tidelog::api::proto::broker_client::BrokerClient;
use tidelog::api::proto::raft_client::RaftClient;
use tidelog::api::proto::{
    PartitionProduceData, ProduceRequest, RaftPayload, Record, TopicProduceData,
};
use tidelog::api::status::{code_of, from_wire};
use tidelog::client::AdminClient;
use tidelog::error_code::ErrorCode;
use tidelog::record::{BatchBuilder, Compression, RecordRef};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const HANDSHAKE_TIMEOUT_MS: u64 = 1000;
const CONNECTIONS_MAX: usize = 100;

fn produce_request(records: Vec<Record>, raw: Vec<u8>) -> ProduceRequest {
    ProduceRequest {
        transactional_id: None,
        acks: Some(-1),
        timeout_ms: 5_000,
        topics: vec![TopicProduceData {
            topic: "target".into(),
            partitions: vec![PartitionProduceData {
                partition: 0,
                records,
                record_batches: raw.into(),
                ..Default::default()
            }],
        }],
    }
}

async fn client(address: &str) -> BrokerClient<tonic::transport::Channel> {
    BrokerClient::connect(format!("http://{address}"))
        .await
        .expect("a well-behaved client still connects")
        .max_encoding_message_size(usize::MAX)
}

/// Produces `value` (acks=all); the error code of the partition or the call, if any.
async fn produce(address: &str, value: &str) -> Result<i64, ErrorCode> {
    let record = Record {
        value: Some(value.as_bytes().to_vec().into()),
        ..Default::default()
    };
    let r = client(address)
        .await
        .produce(produce_request(vec![record], Vec::new()))
        .await
        .map_err(|s| code_of(&s))?
        .into_inner();
    let p = &r.topics[0].partitions[0];
    from_wire(p.error_code).map_or(Ok(p.base_offset), Err)
}

/// Reads until `stream` is closed by the server; false if it stays open past `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_neither_break_the_server_nor_lose_records() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let address = format!("127.0.0.1:{port}");
    let handshake = HANDSHAKE_TIMEOUT_MS.to_string();
    let connections = CONNECTIONS_MAX.to_string();
    let server = standalone_with(
        dir.path(),
        port,
        &[
            (
                "TIDELOG_CONNECTION_HANDSHAKE_TIMEOUT_MS",
                handshake.as_str(),
            ),
            ("TIDELOG_CONNECTIONS_MAX", connections.as_str()),
            ("TIDELOG_MAX_REQUEST_BYTES", "4194304"),
        ],
    );
    AdminClient::new(vec![address.clone()], Duration::from_secs(10))
        .create_topic("target", Some(1), Some(1), Default::default())
        .await
        .unwrap();
    let mut acked = Vec::new();
    while acked.len() < 100 {
        let value = format!("keep-{}", acked.len());
        if let Ok(offset) = produce(&address, &value).await {
            acked.push((offset, value));
        }
    }

    // 1. Garbage instead of HTTP/2: closed, and logged without a flood.
    for i in 0..20u8 {
        let mut s = TcpStream::connect(&address).await.unwrap();
        let garbage: Vec<u8> = (0..512).map(|j| (j as u8).wrapping_mul(31) ^ i).collect();
        let _ = s.write_all(&garbage).await;
        assert!(
            closed_within(&mut s, Duration::from_secs(10)).await,
            "a connection sending garbage is closed"
        );
    }

    // 2. Half-open handshakes above the connection cap: each is closed after the handshake
    // timeout, and a well-behaved client gets through once they are.
    let mut flood = Vec::new();
    for _ in 0..CONNECTIONS_MAX * 2 {
        if let Ok(mut s) = TcpStream::connect(&address).await {
            let _ = s.write_all(b"PRI * HTTP/2.0\r\n").await;
            flood.push(s);
        }
    }
    let started = Instant::now();
    for s in &mut flood {
        assert!(
            closed_within(s, Duration::from_millis(HANDSHAKE_TIMEOUT_MS * 10)).await,
            "a half-open handshake is closed after the timeout"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(30));
    drop(flood);
    assert_eq!(produce(&address, "after-flood").await.map(|_| ()), Ok(()));

    // 3. A valid preface followed by garbage frames: the connection ends, the server not.
    let mut s = TcpStream::connect(&address).await.unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    let _ = s.write_all(&[0xff; 4096]).await;
    assert!(closed_within(&mut s, Duration::from_secs(10)).await);

    // 4. Internal RPCs on the client port: refused with a code, nothing changes.
    let mut raft = RaftClient::connect(format!("http://{address}"))
        .await
        .unwrap();
    let refused = raft
        .vote(RaftPayload {
            json: b"{}".to_vec().into(),
        })
        .await
        .unwrap_err();
    assert_eq!(code_of(&refused), ErrorCode::ClusterAuthorizationFailed);

    // 5. A decompression bomb: 60 MiB of zeros in a small gzip batch.
    let zeros = vec![0u8; 60 << 20];
    let mut bomb = BatchBuilder::new(Compression::Gzip);
    bomb.push(RecordRef {
        timestamp: 1_764_670_000_000,
        key: None,
        value: Some(&zeros),
        headers: &[],
    });
    let bomb = bomb.build(0).unwrap();
    assert!(
        bomb.len() < 1 << 20,
        "the bomb is small: {} bytes",
        bomb.len()
    );
    let r = client(&address)
        .await
        .produce(produce_request(Vec::new(), bomb))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        from_wire(r.topics[0].partitions[0].error_code),
        Some(ErrorCode::RecordTooLarge),
        "{}",
        r.topics[0].partitions[0].error_message
    );

    // 6. A request above max_request_bytes: refused with a code.
    let big = Record {
        value: Some(vec![1u8; 8 << 20].into()),
        ..Default::default()
    };
    let err = client(&address)
        .await
        .produce(produce_request(vec![big], Vec::new()))
        .await
        .unwrap_err();
    assert_eq!(code_of(&err), ErrorCode::InvalidRequest, "{err:?}");

    // The server is up, small, and every acknowledged record is where it was.
    let rss = rss_kib(server.pid());
    assert!(rss < 1 << 20, "resident memory {rss} KiB after the attacks");
    let mut seen = Vec::new();
    while seen.len() < acked.len() {
        let (records, _) = fetch_partition0(&address, "target", seen.len() as i64, 0, 0).await;
        assert!(!records.is_empty(), "records missing after {}", seen.len());
        seen.extend(records);
    }
    assert_eq!(&seen[..acked.len()], &acked[..]);
    let log = server.stderr();
    assert!(
        log.lines().count() < 400,
        "the attacks flooded the log: {} lines",
        log.lines().count()
    );
}

/// A connection that opened HTTP/2 and then only idles is closed after
/// `connections_max_idle_ms`; a gRPC channel that idled that long still works (it
/// reconnects), and one in use is never cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_and_clients_reconnect() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let address = format!("127.0.0.1:{port}");
    let _server = standalone_with(
        dir.path(),
        port,
        &[("TIDELOG_CONNECTIONS_MAX_IDLE_MS", "2000")],
    );
    AdminClient::new(vec![address.clone()], Duration::from_secs(10))
        .create_topic("idle", Some(1), Some(1), Default::default())
        .await
        .unwrap();
    // The HTTP/2 preface and an empty SETTINGS frame, then silence.
    let mut quiet = TcpStream::connect(&address).await.unwrap();
    quiet
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let opened = Instant::now();
    assert!(
        closed_within(&mut quiet, Duration::from_secs(15)).await,
        "an idle HTTP/2 connection stays open"
    );
    let after = opened.elapsed();
    assert!(
        after >= Duration::from_millis(1500),
        "closed after {after:?}, before the idle timeout"
    );
    // One channel, used, idle past the timeout, used again.
    let mut channel = client(&address).await;
    let mut offsets = Vec::new();
    for round in 0..2 {
        let request = produce_request(
            vec![Record {
                value: Some(format!("round-{round}").into_bytes().into()),
                ..Default::default()
            }],
            Vec::new(),
        );
        let mut request = request;
        request.topics[0].topic = "idle".to_owned();
        let response = match channel.produce(request.clone()).await {
            Ok(r) => r,
            // The call that finds its connection closed may fail once; the next reconnects.
            Err(_) => channel.produce(request).await.expect("reconnected"),
        };
        let p = &response.into_inner().topics[0].partitions[0];
        assert_eq!(p.error_code, 0, "{}", p.error_message);
        offsets.push(p.base_offset);
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    assert_eq!(offsets, vec![0, 1]);
}
