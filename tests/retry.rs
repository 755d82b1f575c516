//! Consumer retry with backoff and dead-letter topics, against a real standalone server:
//! nacked records come back to the group after their backoff without holding up their
//! partition; records nacked past `max.reconsume.times` become dead letters that
//! `groups dlq` lists, shows and replays; delayed records show in `topics describe`.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{cli, cli_stdin, eventually, server_with_topic};
use tidelog::client::group_consumer::{GroupConfig, GroupConsumer, OffsetReset};
use tidelog::client::producer::{Producer, ProducerConfig, ProducerRecord};
use tidelog::client::retry::{NackOutcome, RetryInfo, RetryPolicy};

fn json_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The test: a consumer nacks one record three times, then accepts it. It is
/// delivered four times, the gaps follow the group's backoff levels (± 1 s), every
/// redelivery names its first position and count, and the partition's other records are
/// neither held up nor delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_nacked_three_times_comes_back_after_each_backoff() {
    const RECORDS: usize = 20;
    let (_dir, _server, bootstrap) = server_with_topic("orders", 1).await;
    let producer = Producer::new(vec![bootstrap.clone()], ProducerConfig::default());
    for i in 0..RECORDS {
        producer
            .send_sync(ProducerRecord {
                topic: "orders".into(),
                value: Some(Bytes::from(format!("r-{i}"))),
                ..Default::default()
            })
            .await
            .expect("produce");
    }
    let levels = [1_000u64, 2_000, 3_000];
    let mut consumer = GroupConsumer::new(
        vec![bootstrap.clone()],
        GroupConfig {
            group: "billing".into(),
            topics: vec!["orders".into()],
            auto_offset_reset: OffsetReset::Earliest,
            auto_commit_interval: Duration::from_millis(200),
            retry_policy: Some(RetryPolicy {
                backoff_ms: levels.to_vec(),
                max_reconsume_times: 16,
            }),
            ..Default::default()
        },
    );
    let started = Instant::now();
    // value -> (time, reconsume count, origin) of each delivery
    let mut deliveries: BTreeMap<String, Vec<(Duration, RetryInfo)>> = BTreeMap::new();
    let mut nacked_at = Vec::new();
    while started.elapsed() < Duration::from_secs(40) {
        let records = consumer
            .poll(Duration::from_millis(100))
            .await
            .expect("poll");
        for r in records {
            let value = String::from_utf8_lossy(r.value.as_deref().unwrap()).into_owned();
            let info = RetryInfo::of(&r);
            deliveries
                .entry(value.clone())
                .or_default()
                .push((started.elapsed(), info.clone()));
            if value == "r-5" && info.reconsume_times < 3 {
                let outcome = consumer.nack(&r, "not yet").await.expect("nack");
                match outcome {
                    NackOutcome::Retried {
                        reconsume_times,
                        delay,
                        ..
                    } => {
                        assert_eq!(reconsume_times, info.reconsume_times + 1);
                        assert_eq!(
                            delay,
                            Duration::from_millis(levels[info.reconsume_times as usize])
                        );
                    }
                    other => panic!("a retry, not {other:?}"),
                }
                nacked_at.push(started.elapsed());
            }
        }
        if deliveries.get("r-5").is_some_and(|d| d.len() == 4) && deliveries.len() == RECORDS {
            break;
        }
    }
    let five = &deliveries["r-5"];
    assert_eq!(five.len(), 4, "delivered four times: {five:?}");
    for (n, (at, info)) in five.iter().enumerate() {
        assert_eq!(info.reconsume_times, n as u32, "delivery {n}");
        assert_eq!(info.origin, ("orders".to_owned(), 0, 5), "delivery {n}");
        if n > 0 {
            let gap = at.saturating_sub(nacked_at[n - 1]);
            let want = Duration::from_millis(levels[n - 1]);
            assert!(
                gap + Duration::from_secs(1) >= want && gap <= want + Duration::from_secs(1),
                "redelivery {n} came {gap:?} after the nack; the backoff is {want:?}"
            );
            assert_eq!(info.history.len(), n, "one nack time per redelivery");
        }
    }
    // Not held up: every other record arrived once, before the first redelivery.
    for (value, d) in &deliveries {
        if value != "r-5" {
            assert_eq!(d.len(), 1, "{value} delivered once");
            assert!(d[0].0 < five[1].0, "{value} came before r-5's first retry");
        }
    }
    consumer.close().await.expect("close");
    // The original partition is fully committed, and so is the retry topic.
    let (ok, out, err) = cli(&[
        "groups",
        "describe",
        "--group",
        "billing",
        "--bootstrap",
        &bootstrap,
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    let d: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    for o in d["offsets"].as_array().unwrap() {
        assert_eq!(o["lag"], 0, "{o}");
    }
    assert!(d["offsets"]
        .as_array()
        .unwrap()
        .iter()
        .any(|o| o["topic"] == "_retry.billing"));
    assert_eq!(d["retry"]["dead_letters"], 0, "{d}");
    assert_eq!(d["retry"]["retry_scheduled"], 0, "{d}");

    // A pattern subscription does not pick up other groups' retry topics.
    let mut everything = GroupConsumer::new(
        vec![bootstrap.clone()],
        GroupConfig {
            group: "all".into(),
            topic_regex: Some(".*".into()),
            ..Default::default()
        },
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let held = loop {
        let _ = everything.poll(Duration::from_millis(100)).await;
        let held = everything.assignment();
        if held.iter().any(|(t, _)| t == "orders") {
            break held;
        }
        assert!(
            Instant::now() < deadline,
            "the pattern member never got orders"
        );
    };
    assert!(
        held.iter().all(|(t, _)| !t.starts_with("_retry.")),
        "{held:?}"
    );
}

/// The test, from the shell: a record nacked every time goes to the group's
/// dead-letter topic after `--max-reconsume-times`; `groups dlq list|show` show it with
/// its history and reason, `groups describe` counts it, and `groups dlq replay` sends it
/// back to its topic, where a healthy consumer of the group reads it (once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_always_nacked_becomes_a_dead_letter_that_replay_brings_back() {
    let (_dir, _server, bootstrap) = server_with_topic("jobs", 1).await;
    let b = bootstrap.as_str();
    let (ok, _, err) = cli_stdin(
        &["produce", "--topic", "jobs", "--bootstrap", b],
        "poison\n",
    );
    assert!(ok, "{err}");
    let (ok, out, err) = cli(&[
        "consume",
        "--topic",
        "jobs",
        "--group",
        "workers",
        "--from-beginning",
        "--nack-every",
        "1",
        "--max-reconsume-times",
        "3",
        "--retry-backoff-ms",
        "300",
        "--timeout-ms",
        "5000",
        "--bootstrap",
        b,
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "", "nacked records are not printed");

    let list = |expect_replayed: bool| {
        let (ok, out, err) = cli(&[
            "groups",
            "dlq",
            "list",
            "--group",
            "workers",
            "--bootstrap",
            b,
            "--output",
            "json",
        ]);
        assert!(ok, "{err}");
        let lines = json_lines(&out);
        assert_eq!(lines.len(), 1, "one dead letter: {out}");
        let l = &lines[0];
        assert_eq!(l["topic"], "_dlq.workers");
        assert_eq!(l["origin"]["topic"], "jobs");
        assert_eq!(l["origin"]["partition"], 0);
        assert_eq!(l["origin"]["offset"], 0);
        assert_eq!(l["reconsume_times"], 3);
        assert_eq!(l["nacked_at"].as_array().unwrap().len(), 4, "{l}");
        assert!(
            l["reason"]
                .as_str()
                .unwrap()
                .contains("max.reconsume.times is 3"),
            "{l}"
        );
        assert_eq!(l["replayed"], expect_replayed);
    };
    list(false);
    let (ok, out, err) = cli(&[
        "groups",
        "dlq",
        "show",
        "--group",
        "workers",
        "--offset",
        "0",
        "--bootstrap",
        b,
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("Value: poison"), "{out}");
    assert!(out.contains("Nack 4:"), "{out}");
    assert!(out.contains("Origin: jobs-0@0"), "{out}");
    let describe = || {
        let (ok, out, err) = cli(&[
            "groups",
            "describe",
            "--group",
            "workers",
            "--bootstrap",
            b,
            "--output",
            "json",
        ]);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()
    };
    let d = describe();
    assert_eq!(d["retry"]["dead_letters"], 1, "{d}");
    assert_eq!(d["retry"]["dead_letters_not_replayed"], 1, "{d}");

    let replay = || {
        let (ok, out, err) = cli(&[
            "groups",
            "dlq",
            "replay",
            "--group",
            "workers",
            "--bootstrap",
            b,
        ]);
        assert!(ok, "{err}");
        out
    };
    let out = replay();
    assert!(out.contains("Replayed 1 dead letter"), "{out}");
    list(true);
    assert_eq!(describe()["retry"]["dead_letters_not_replayed"], 0);
    // Replayed once only.
    let out = replay();
    assert!(out.contains("Replayed 0 dead letters"), "{out}");

    // A healthy member of the group reads it back, fresh: no retry headers.
    let (ok, out, err) = cli(&[
        "consume",
        "--topic",
        "jobs",
        "--group",
        "workers",
        "--max-messages",
        "1",
        "--timeout-ms",
        "15000",
        "--bootstrap",
        b,
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 1, "{out}");
    assert_eq!(lines[0]["value"], "poison");
    assert_eq!(lines[0]["topic"], "jobs");
    assert_eq!(lines[0]["offset"], 1);
    let headers = lines[0]["headers"].to_string();
    assert!(headers.contains("tidelog.dlq.replayed.from"), "{headers}");
    assert!(!headers.contains("tidelog.retry."), "{headers}");
}

/// Bad input changes nothing and names the problem: a nack in a broadcast group, a
/// reconsume limit beyond its range, a zero --nack-every, replay of an offset that holds
/// no dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_input_is_checked() {
    let (_dir, _server, bootstrap) = server_with_topic("in", 1).await;
    let b = bootstrap.as_str();
    let (ok, _, err) = cli_stdin(&["produce", "--topic", "in", "--bootstrap", b], "x\n");
    assert!(ok, "{err}");
    let consume = |extra: &[&str]| {
        let mut args = vec![
            "consume",
            "--topic",
            "in",
            "--from-beginning",
            "--timeout-ms",
            "3000",
            "--bootstrap",
            b,
        ];
        args.extend_from_slice(extra);
        cli(&args)
    };
    let (ok, _, err) = consume(&["--group", "bc", "--broadcast", "--nack-every", "1"]);
    assert!(!ok);
    assert!(
        err.contains("INVALID_REQUEST") && err.contains("broadcast"),
        "{err}"
    );
    let (ok, _, err) = consume(&["--group", "g", "--max-reconsume-times", "10001"]);
    assert!(!ok);
    assert!(
        err.contains("INVALID_CONFIG") && err.contains("max.reconsume.times"),
        "{err}"
    );
    let (ok, _, err) = consume(&["--group", "g", "--nack-every", "0"]);
    assert!(!ok, "{err}");
    // Nothing was created for the refused group.
    let (ok, out, _) = cli(&["topics", "list", "--bootstrap", b]);
    assert!(ok);
    assert!(!out.contains("_retry.g"), "{out}");
    let (ok, _, err) = cli(&[
        "groups",
        "dlq",
        "replay",
        "--group",
        "g",
        "--offset",
        "3",
        "--bootstrap",
        b,
    ]);
    assert!(!ok);
    assert!(err.contains("UNKNOWN_TOPIC_OR_PARTITION"), "{err}");
}

/// `topics describe` counts a topic's delayed records still pending, and the count falls
/// as they are delivered or cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_describe_counts_pending_delayed_records() {
    let (_dir, _server, bootstrap) = server_with_topic("later", 2).await;
    let b = bootstrap.as_str();
    let (ok, out, err) = cli_stdin(
        &[
            "produce",
            "--topic",
            "later",
            "--delay-ms",
            "600000",
            "--bootstrap",
            b,
            "--output",
            "json",
        ],
        "a\nb\nc\n",
    );
    assert!(ok, "{err}");
    let ids: Vec<String> = json_lines(&out)
        .iter()
        .map(|l| l["scheduled_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), 3);
    let pending = || {
        let (ok, out, err) = cli(&[
            "topics",
            "describe",
            "--topic",
            "later",
            "--bootstrap",
            b,
            "--output",
            "json",
        ]);
        assert!(ok, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        v["topics"][0]["scheduled_pending"].as_u64().unwrap()
    };
    eventually("3 pending", Duration::from_secs(20), || async {
        (pending() == 3).then_some(())
    })
    .await;
    let (ok, _, err) = cli(&["scheduled", "cancel", "--id", &ids[0], "--bootstrap", b]);
    assert!(ok, "{err}");
    eventually("2 pending", Duration::from_secs(20), || async {
        (pending() == 2).then_some(())
    })
    .await;
    let (ok, out, _) = cli(&["topics", "describe", "--topic", "later", "--bootstrap", b]);
    assert!(ok);
    assert!(out.contains("Scheduled: 2"), "{out}");
}

/// `consume --nack-every` from the shell: the nacked record comes back through the retry
/// topic, and the JSON line of the redelivery says where it was first read and how often
/// it came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_shows_where_a_redelivery_came_from() {
    let (_dir, _server, bootstrap) = server_with_topic("shell", 1).await;
    let b = bootstrap.as_str();
    let (ok, _, err) = cli_stdin(&["produce", "--topic", "shell", "--bootstrap", b], "a\nb\n");
    assert!(ok, "{err}");
    let (ok, out, err) = cli(&[
        "consume",
        "--topic",
        "shell",
        "--group",
        "sh",
        "--from-beginning",
        "--nack-every",
        "2",
        "--retry-backoff-ms",
        "200",
        "--max-messages",
        "2",
        "--timeout-ms",
        "15000",
        "--bootstrap",
        b,
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 2, "{out}");
    assert_eq!(lines[0]["value"], "a");
    assert!(lines[0].get("retry").is_none(), "{}", lines[0]);
    assert_eq!(lines[1]["value"], "b");
    assert_eq!(lines[1]["topic"], "_retry.sh");
    assert_eq!(lines[1]["retry"]["reconsume_times"], 1, "{}", lines[1]);
    assert_eq!(lines[1]["retry"]["origin"]["topic"], "shell");
    assert_eq!(lines[1]["retry"]["origin"]["offset"], 1);
}
