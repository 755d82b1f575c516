//! The command-line contract (docs/cli.md) against a real standalone server: idempotent
//! topic creation and deletion, binary-safe output, header lists, reset-offsets plans,
//! perf consume on a drained topic, and exit codes.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{binary, cli, free_ports, standalone};
use tidelog::client::producer::{Producer, ProducerConfig, ProducerRecord};

/// `tidelog args...`; returns (exit code, stdout, stderr).
fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(binary())
        .args(args)
        .env_remove("TIDELOG_BOOTSTRAP")
        .stdin(Stdio::null())
        .output()
        .expect("run tidelog");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn send(bootstrap: &str, topic: &str, partition: u32, records: Vec<ProducerRecord>) {
    let producer = Producer::new(vec![bootstrap.to_owned()], ProducerConfig::default());
    for mut r in records {
        r.topic = topic.to_owned();
        r.partition = Some(partition);
        producer.send_sync(r).await.expect("acknowledged");
    }
}

fn values(n: usize) -> Vec<ProducerRecord> {
    (0..n)
        .map(|i| ProducerRecord {
            value: Some(Bytes::from(format!("v{i}"))),
            ..Default::default()
        })
        .collect()
}

/// Committed offsets of `group` by (topic, partition), from `groups describe --output json`.
fn committed(b: &str, group: &str) -> Vec<(String, u64, i64)> {
    let (ok, out, err) = cli(&[
        "groups",
        "describe",
        "--group",
        group,
        "--bootstrap",
        b,
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let mut list: Vec<(String, u64, i64)> = v["offsets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                o["topic"].as_str().unwrap().to_owned(),
                o["partition"].as_u64().unwrap(),
                o["committed_offset"].as_i64().unwrap(),
            )
        })
        .collect();
    list.sort();
    list
}

#[test]
fn topics_create_if_not_exists_and_delete_if_exists_are_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone(dir.path(), port);
    let b = format!("127.0.0.1:{port}");

    let (code, out, err) = run(&["topics", "create", "--topic", "t", "--bootstrap", &b]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("(1 partition, replication factor 1)"), "{out}");
    let (code, _, err) = run(&["topics", "create", "--topic", "t", "--bootstrap", &b]);
    assert_eq!(code, 1);
    assert!(err.starts_with("error: TOPIC_ALREADY_EXISTS:"), "{err}");
    let (code, out, err) = run(&[
        "topics",
        "create",
        "--topic",
        "t",
        "--partitions",
        "4",
        "--if-not-exists",
        "--bootstrap",
        &b,
        "--output",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["created"], false);
    assert_eq!(v["partitions"], 1, "the existing topic is left as it was");

    let (code, _, err) = run(&["topics", "delete", "--topic", "nosuch", "--bootstrap", &b]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with("error: UNKNOWN_TOPIC_OR_PARTITION:"),
        "{err}"
    );
    let (code, out, err) = run(&[
        "topics",
        "delete",
        "--topic",
        "nosuch",
        "--if-exists",
        "--bootstrap",
        &b,
        "--output",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), r#"{"name":"nosuch","deleted":false}"#);
    let (code, _, err) = run(&[
        "topics",
        "delete",
        "--topic",
        "t",
        "--if-exists",
        "--bootstrap",
        &b,
    ]);
    assert_eq!(code, 0, "{err}");

    // A healthy single node has nothing under-replicated or unavailable.
    run(&[
        "topics",
        "create",
        "--topic",
        "u",
        "--partitions",
        "2",
        "--bootstrap",
        &b,
    ]);
    for flag in ["--under-replicated-partitions", "--unavailable-partitions"] {
        let (code, out, err) = run(&["topics", "describe", flag, "--bootstrap", &b]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(out, "", "{flag}");
    }
    let (_, out, _) = run(&["topics", "describe", "--topic", "u", "--bootstrap", &b]);
    assert_eq!(out.lines().count(), 3, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_escapes_binary_bytes_and_keeps_duplicate_headers() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone(dir.path(), port);
    let b = format!("127.0.0.1:{port}");
    assert!(cli(&["topics", "create", "--topic", "bin", "--bootstrap", &b]).0);
    send(
        &b,
        "bin",
        0,
        vec![ProducerRecord {
            key: Some(Bytes::from_static(&[0xfe, b'k'])),
            value: Some(Bytes::from_static(&[0xff, b'a', 0x80])),
            headers: vec![
                ("h".to_owned(), Some(Bytes::from_static(b"1"))),
                ("h".to_owned(), Some(Bytes::from_static(b"2"))),
            ],
            timestamp_ms: Some(1_700_000_000_000),
            ..Default::default()
        }],
    )
    .await;
    let common = [
        "consume",
        "--topic",
        "bin",
        "--from-beginning",
        "--max-messages",
        "1",
        "--bootstrap",
        &b,
    ];
    let mut table: Vec<&str> = common.to_vec();
    table.extend([
        "--print-key",
        "--print-headers",
        "--print-timestamp",
        "--print-offset",
    ]);
    let (ok, out, err) = cli(&table);
    assert!(ok, "{err}");
    assert!(!out.contains('\u{fffd}'), "{out}");
    assert_eq!(
        out,
        "CreateTime:1700000000000\t0:0\th:1,h:2\t\\xfek\t\\xffa\\x80\n"
    );

    let mut json_args: Vec<&str> = common.to_vec();
    json_args.extend(["--output", "json"]);
    let (ok, out, err) = cli(&json_args);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        v["headers"],
        serde_json::json!([{"key": "h", "value": "1"}, {"key": "h", "value": "2"}])
    );
    assert_eq!(v["value"], serde_json::json!({"base64": "/2GA"}));
    assert_eq!(v["timestamp"], 1_700_000_000_000i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_offsets_plans_by_default_and_changes_only_with_execute() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone(dir.path(), port);
    let b = format!("127.0.0.1:{port}");
    assert!(
        cli(&[
            "topics",
            "create",
            "--topic",
            "t",
            "--partitions",
            "3",
            "--bootstrap",
            &b
        ])
        .0
    );
    for p in 0..3 {
        send(&b, "t", p, values(10)).await;
    }
    // The group reads everything: committed 10 everywhere.
    let (ok, _, err) = cli(&[
        "consume",
        "--topic",
        "t",
        "--group",
        "g",
        "--from-beginning",
        "--max-messages",
        "30",
        "--bootstrap",
        &b,
    ]);
    assert!(ok, "{err}");
    let all_at = |o: i64| (0..3).map(|p| ("t".to_owned(), p, o)).collect::<Vec<_>>();
    assert_eq!(committed(&b, "g"), all_at(10));

    // A plan changes nothing.
    let (code, out, err) = run(&[
        "groups",
        "reset-offsets",
        "--group",
        "g",
        "--topic",
        "t",
        "--to-earliest",
        "--bootstrap",
        &b,
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out,
        "GROUP\tTOPIC\tPARTITION\tCURRENT-OFFSET\tNEW-OFFSET\ng\tt\t0\t10\t0\ng\tt\t1\t10\t0\ng\tt\t2\t10\t0\n"
    );
    assert!(err.contains("Dry run"), "{err}");
    assert_eq!(committed(&b, "g"), all_at(10));

    // --execute on partitions 0 and 2 only, shifted back by 4 (and clamped at 0 for -40).
    let (code, out, err) = run(&[
        "groups",
        "reset-offsets",
        "--group",
        "g",
        "--topic",
        "t:0,2",
        "--shift-by",
        "-4",
        "--execute",
        "--bootstrap",
        &b,
        "--output",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["executed"], true);
    assert_eq!(v["offsets"].as_array().unwrap().len(), 2);
    assert_eq!(
        committed(&b, "g"),
        vec![
            ("t".to_owned(), 0, 6),
            ("t".to_owned(), 1, 10),
            ("t".to_owned(), 2, 6)
        ]
    );
    let (code, _, err) = run(&[
        "groups",
        "reset-offsets",
        "--group",
        "g",
        "--topic",
        "t:1",
        "--shift-by",
        "-40",
        "--execute",
        "--bootstrap",
        &b,
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(committed(&b, "g")[1], ("t".to_owned(), 1, 0));

    // By time: everything was written within the last hour; nothing after 2099.
    let (_, out, _) = run(&[
        "groups",
        "reset-offsets",
        "--group",
        "g",
        "--topic",
        "t:0",
        "--by-duration",
        "PT1H",
        "--bootstrap",
        &b,
    ]);
    assert!(out.ends_with("g\tt\t0\t6\t0\n"), "{out}");
    let (_, out, _) = run(&[
        "groups",
        "reset-offsets",
        "--group",
        "g",
        "--topic",
        "t:0",
        "--to-datetime",
        "2099-01-01T00:00:00Z",
        "--bootstrap",
        &b,
    ]);
    assert!(out.ends_with("g\tt\t0\t6\t10\n"), "{out}");

    // Usage errors exit 2; a partition the topic lacks exits 1.
    let (code, _, _) = run(&[
        "groups",
        "reset-offsets",
        "--group",
        "g",
        "--topic",
        "t",
        "--bootstrap",
        &b,
    ]);
    assert_eq!(code, 2);
    let (code, _, _) = run(&[
        "groups",
        "reset-offsets",
        "--group",
        "g",
        "--topic",
        "t",
        "--to-datetime",
        "yesterday",
        "--bootstrap",
        &b,
    ]);
    assert_eq!(code, 2);
    let (code, _, err) = run(&[
        "groups",
        "reset-offsets",
        "--group",
        "g",
        "--topic",
        "t:7",
        "--to-earliest",
        "--bootstrap",
        &b,
    ]);
    assert_eq!(code, 1);
    assert!(
        err.starts_with("error: UNKNOWN_TOPIC_OR_PARTITION:"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perf_consume_stops_with_a_summary_when_the_topic_is_drained() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone(dir.path(), port);
    let b = format!("127.0.0.1:{port}");
    assert!(
        cli(&[
            "topics",
            "create",
            "--topic",
            "t",
            "--partitions",
            "2",
            "--bootstrap",
            &b
        ])
        .0
    );
    send(&b, "t", 0, values(7)).await;
    send(&b, "t", 1, values(5)).await;
    for group in [None, Some("perf")] {
        let mut args = vec![
            "perf",
            "consume",
            "--topic",
            "t",
            "--num-records",
            "1000",
            "--request-timeout-ms",
            "5000",
            "--bootstrap",
            &b,
            "--output",
            "json",
        ];
        if let Some(g) = group {
            args.extend(["--group", g]);
        }
        let started = Instant::now();
        let (code, out, err) = run(&args);
        assert_eq!(code, 0, "{group:?}: {err}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{group:?}: took {:?}",
            started.elapsed()
        );
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["records"], 12, "{group:?}: {out}");
        assert_eq!(v["end"], "drained", "{group:?}: {out}");
    }
}

#[test]
fn usage_errors_exit_2_and_help_documents_the_exit_codes() {
    let (code, _, _) = run(&["topics", "create", "--no-such-flag"]);
    assert_eq!(code, 2);
    let (code, _, _) = run(&["no-such-command"]);
    assert_eq!(code, 2);
    for args in [
        vec!["--help"],
        vec!["topics", "create", "--help"],
        vec!["groups", "reset-offsets", "--help"],
    ] {
        let (code, out, _) = run(&args);
        assert_eq!(code, 0);
        assert!(out.contains("Exit codes: 0 success; 1"), "{args:?}: {out}");
        assert!(out.contains("docs/cli.md"), "{args:?}");
    }
    assert!(std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("docs/cli.md")
        .exists());
}

/// Long CLI work shows progress on a terminal (a pseudo-terminal from util-linux's
/// `script`) and nothing of it when stderr is piped.
#[test]
fn perf_shows_progress_on_a_terminal_and_stays_quiet_when_piped() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone(dir.path(), port);
    let b = format!("127.0.0.1:{port}");
    // About 2.5 s at 1,000 records/s: the progress line is drawn after the first second.
    let args = [
        "perf",
        "produce",
        "--topic",
        "progress",
        "--num-records",
        "2500",
        "--record-size",
        "100",
        "--throughput",
        "1000",
        "--bootstrap",
        &b,
    ];
    assert!(cli(&["topics", "create", "--topic", "progress", "--bootstrap", &b]).0);
    let (code, out, err) = run(&args);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("records/s"), "a summary: {out}");
    assert!(
        !err.contains("acknowledged") && !err.contains('\r'),
        "no progress when piped: {err:?}"
    );
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipping the terminal half: util-linux's script is not installed");
        return;
    }
    let command = std::iter::once(binary().to_owned())
        .chain(args.iter().map(|a| a.to_string()))
        .collect::<Vec<_>>()
        .join(" ");
    let out = Command::new("script")
        .args(["-qefc", &command, "/dev/null"])
        .env_remove("TIDELOG_BOOTSTRAP")
        .stdin(Stdio::null())
        .output()
        .expect("run script");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{shown}");
    assert!(
        shown.contains("\x1b[K")
            && shown.contains("/2500 (")
            && shown.contains("records acknowledged"),
        "a progress line on a terminal: {shown:?}"
    );
}

/// Tags and properties: `produce --tag/--property` store them (the tag as the
/// `tidelog.tag` header), `consume --output json` shows `tag` apart from the headers, and
/// a bad tag is refused naming the rule, writing nothing.
#[test]
fn records_carry_a_tag_and_properties() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone(dir.path(), port);
    let b = format!("127.0.0.1:{port}");
    assert!(cli(&["topics", "create", "--topic", "tagged", "--bootstrap", &b]).0);
    let produce = |extra: &[&str], line: &str| {
        let mut child = Command::new(binary())
            .args(["produce", "--topic", "tagged", "--bootstrap", &b])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        writeln!(child.stdin.take().unwrap(), "{line}").unwrap();
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert_eq!(
        produce(&["--tag", "TagA", "--property", "region=eu"], "a").0,
        Some(0)
    );
    assert_eq!(produce(&[], "b").0, Some(0));
    let (code, err) = produce(&["--tag", "two words"], "c");
    assert_eq!(code, Some(1));
    assert!(
        err.starts_with("error: INVALID_RECORD: --tag 'two words' holds ' '"),
        "{err}"
    );
    let (code, out, err) = run(&[
        "consume",
        "--topic",
        "tagged",
        "--from-beginning",
        "--max-messages",
        "3",
        "--timeout-ms",
        "3000",
        "--output",
        "json",
        "--bootstrap",
        &b,
    ]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "the refused record was not written: {out}");
    assert_eq!(lines[0]["tag"], "TagA");
    assert_eq!(
        lines[0]["headers"],
        serde_json::json!([{"key": "region", "value": "eu"}])
    );
    assert!(lines[1].get("tag").is_none(), "{out}");
}

/// After a restart, `groups list` shows every group with committed offsets, not only
/// those a client has used since (the coordinator loads its offsets partitions to list).
#[test]
fn groups_are_listed_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let b = format!("127.0.0.1:{port}");
    let mut server = standalone(dir.path(), port);
    assert!(cli(&["topics", "create", "--topic", "listed", "--bootstrap", &b]).0);
    let (code, _, err) = run(&["produce", "--topic", "listed", "--bootstrap", &b]);
    assert_eq!(code, 0, "{err}");
    for g in ["ga", "gb", "gc"] {
        let (code, _, err) = run(&[
            "consume",
            "--topic",
            "listed",
            "--group",
            g,
            "--from-beginning",
            "--timeout-ms",
            "1500",
            "--bootstrap",
            &b,
        ]);
        assert_eq!(code, 0, "{err}");
    }
    server.terminate();
    let _server = standalone(dir.path(), port);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, out, err) = run(&["groups", "list", "--bootstrap", &b]);
        if code == 0 && out.lines().collect::<Vec<_>>() == ["ga", "gb", "gc"] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "groups list after a restart: {out} {err}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}
