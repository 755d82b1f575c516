//! A full disk under a running standalone server: writes are refused with
//! KAFKA_STORAGE_ERROR while reads of what is stored go on, and once space is freed the
//! same process takes writes again (no restart), with no gap and nothing lost.
//!
//! Needs root and `mkfs.ext4` (the data directory is a small loop-mounted ext4 disk).
//! Without them the test prints why and passes, unless NEMESIS_REQUIRE=1 (CI sets it).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{eventually, fetch_partition0, free_ports, Proc, FAST_RAFT};
use tidelog::api::proto::broker_client::BrokerClient;
use tidelog::api::proto::{PartitionProduceData, ProduceRequest, Record, TopicProduceData};
use tidelog::api::status::from_wire;
use tidelog::client::AdminClient;
use tidelog::error_code::ErrorCode;

/// A loop-mounted ext4 disk, unmounted on drop.
struct Disk {
    mount: PathBuf,
}

impl Disk {
    fn make(dir: &Path, mib: u32) -> Result<Disk, String> {
        // SAFETY: getuid(2) has no preconditions.
        if unsafe { libc::getuid() } != 0 {
            return Err("not root".into());
        }
        let image = dir.join("disk.img");
        let mount = dir.join("mnt");
        std::fs::create_dir_all(&mount).map_err(|e| e.to_string())?;
        let file = std::fs::File::create(&image).map_err(|e| e.to_string())?;
        file.set_len(u64::from(mib) << 20)
            .map_err(|e| e.to_string())?;
        run("mkfs.ext4", &["-q", "-F", "-m", "0", path(&image)])?;
        run("mount", &["-o", "loop", path(&image), path(&mount)])?;
        Ok(Disk { mount })
    }

    /// Fills the disk with `filler` until the file system refuses more.
    fn fill(&self) -> PathBuf {
        let filler = self.mount.join("filler");
        let mut file = std::fs::File::create(&filler).unwrap();
        let chunk = vec![7u8; 64 * 1024];
        use std::io::Write;
        while file.write_all(&chunk).is_ok() {}
        let _ = file.sync_all();
        filler
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        let _ = run("umount", &["-l", path(&self.mount)]);
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

async fn produce(address: &str, value: &str) -> Result<i64, (ErrorCode, String)> {
    let mut client = BrokerClient::connect(format!("http://{address}"))
        .await
        .map_err(|e| (ErrorCode::NetworkException, e.to_string()))?;
    let r = client
        .produce(ProduceRequest {
            transactional_id: None,
            acks: Some(1),
            timeout_ms: 5_000,
            topics: vec![TopicProduceData {
                topic: "full".into(),
                partitions: vec![PartitionProduceData {
                    partition: 0,
                    records: vec![Record {
                        value: Some(value.as_bytes().to_vec().into()),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
            }],
        })
        .await
        .map_err(|s| (tidelog::api::status::code_of(&s), s.message().to_owned()))?
        .into_inner();
    let p = &r.topics[0].partitions[0];
    match from_wire(p.error_code) {
        None => Ok(p.base_offset),
        Some(code) => Err((code, p.error_message.clone())),
    }
}

async fn read_values(address: &str) -> Vec<String> {
    let mut values = Vec::new();
    loop {
        // Reads go on while the disk is full (the helper asserts each fetch succeeds).
        let (records, _) = fetch_partition0(address, "full", values.len() as i64, 0, 0).await;
        if records.is_empty() {
            return values;
        }
        for (offset, value) in records {
            assert_eq!(offset, values.len() as i64, "no gap");
            values.push(value);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_writes_serves_reads_and_recovers_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let disk = match Disk::make(dir.path(), 48) {
        Ok(disk) => disk,
        Err(why) if std::env::var("NEMESIS_REQUIRE").is_err() => {
            eprintln!("skipped: cannot make a loop-mounted disk ({why})");
            return;
        }
        Err(why) => panic!("NEMESIS_REQUIRE is set but no disk could be made: {why}"),
    };
    let port = free_ports(1)[0];
    // Data on the small disk, the server's log beside it (so it can say what happened).
    let args = vec![
        "--data-dir".to_owned(),
        path(&disk.mount.join("data")).to_owned(),
        "--listen".to_owned(),
        format!("127.0.0.1:{port}"),
    ];
    let env: Vec<(&str, &str)> = FAST_RAFT
        .iter()
        .copied()
        .chain([("TIDELOG_OFFSETS_TOPIC_NUM_PARTITIONS", "1")])
        .collect();
    let server = Proc::start("standalone", &args, &env, dir.path());
    let address = format!("127.0.0.1:{port}");
    AdminClient::new(vec![address.clone()], Duration::from_secs(10))
        .create_topic(
            "full",
            Some(1),
            Some(1),
            [("segment.bytes".to_owned(), "65536".to_owned())].into(),
        )
        .await
        .unwrap();
    let value = |i: usize| format!("{i:05}-{}", "v".repeat(1000));
    let mut written = 0;
    while written < 50 {
        if produce(&address, &value(written)).await.is_ok() {
            written += 1;
        } else {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // The controller's own Raft log shares this disk in standalone: a Raft write on a full
    // disk stops the process (exit 70, for a supervisor to restart), as KRaft halts. Fill
    // only once its start-up writes are done; the broker's writes are what this tests.
    eventually("the controller settles", Duration::from_secs(30), || {
        let settled = server.stderr().contains("now the active controller");
        async move { settled.then_some(()) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let filler = disk.fill();
    // Writes are refused with a retriable storage error (more than a segment's worth, so
    // rolls meet the full disk too); nothing half-written shows up.
    let mut refused = 0;
    for _ in 0..200 {
        match produce(&address, &value(written)).await {
            Ok(_) => written += 1,
            Err((code, message)) => {
                assert_eq!(
                    code,
                    ErrorCode::KafkaStorageError,
                    "{message}; server log: {}",
                    server.stderr_tail()
                );
                refused += 1;
            }
        }
    }
    assert!(
        refused > 0,
        "the full disk refused nothing ({written} written)"
    );
    let stored = read_values(&address).await;
    assert_eq!(stored.len(), written, "reads go on while the disk is full");

    std::fs::remove_file(&filler).unwrap();
    let offset = eventually(
        "writes resume once space is freed",
        Duration::from_secs(30),
        || {
            let (address, v) = (address.clone(), value(written));
            async move { produce(&address, &v).await.ok() }
        },
    )
    .await;
    assert_eq!(offset, written as i64, "the next offset, no gap");
    written += 1;
    for _ in 0..100 {
        produce(&address, &value(written))
            .await
            .expect("space is back");
        written += 1;
    }
    let stored = read_values(&address).await;
    assert_eq!(stored, (0..written).map(value).collect::<Vec<_>>());
    let log = server.stderr();
    assert!(
        log.matches("disk full").count() <= 3,
        "one warning per partition per minute: {log}"
    );
    drop(server);
}
