//! Consumer groups with real processes: members are `tidelog consume --group` processes
//! whose output is collected; one is killed -9 and its partitions move to the others
//! without losing a record; broadcast members each get everything; committed offsets
//! survive the loss of the coordinator's broker; `groups describe` shows the lag.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{
    binary, cli, eventually, free_ports, standalone_with, BrokerCluster, Proc, FAST_RAFT,
};
use tidelog::api::proto::groups_client::GroupsClient;
use tidelog::api::proto::{
    CommittedOffset, FindCoordinatorRequest, GroupHeartbeatRequest, OffsetCommitRequest,
    OffsetFetchRequest, TopicPartitions,
};
use tidelog::api::status::code_of;
use tidelog::client::AdminClient;
use tidelog::error_code::ErrorCode;

/// A `tidelog consume --group` process writing JSON lines to a file.
struct Member {
    child: Child,
    out: PathBuf,
}

impl Member {
    fn start(dir: &Path, name: &str, bootstrap: &str, extra: &[&str]) -> Member {
        let out = dir.join(format!("{name}.out"));
        let file = std::fs::File::create(&out).unwrap();
        let err = std::fs::File::create(dir.join(format!("{name}.err"))).unwrap();
        let child = Command::new(binary())
            .args(["consume", "--bootstrap", bootstrap, "--output", "json"])
            .args(extra)
            .stdout(Stdio::from(file))
            .stderr(Stdio::from(err))
            .spawn()
            .unwrap();
        Member { child, out }
    }

    /// (partition, offset, value) of every record printed so far.
    fn records(&self) -> Vec<(u32, i64, String)> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|v| {
                (
                    v["partition"].as_u64().unwrap() as u32,
                    v["offset"].as_i64().unwrap(),
                    v["value"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }

    fn wait(&mut self, within: Duration) -> bool {
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn produce(bootstrap: &str, topic: &str, from: usize, to: usize) {
    let input: String = (from..to).map(|i| format!("k{i}:v{i}\n")).collect();
    let mut child = Command::new(binary())
        .args([
            "produce",
            "--bootstrap",
            bootstrap,
            "--topic",
            topic,
            "--parse-key",
            "--key-separator",
            ":",
            "--acks",
            "all",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn try_describe(bootstrap: &str, group: &str) -> Option<serde_json::Value> {
    let (ok, out, _) = cli(&[
        "groups",
        "describe",
        "--group",
        group,
        "--bootstrap",
        bootstrap,
        "--output",
        "json",
    ]);
    ok.then(|| serde_json::from_str(&out).unwrap())
}

fn describe(bootstrap: &str, group: &str) -> serde_json::Value {
    let (ok, out, err) = cli(&[
        "groups",
        "describe",
        "--group",
        group,
        "--bootstrap",
        bootstrap,
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    serde_json::from_str(&out).unwrap()
}

fn total_lag(d: &serde_json::Value) -> i64 {
    d["offsets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["lag"].as_i64().unwrap())
        .sum()
}

/// Three members share 6 partitions; each record goes to exactly one of them. One is
/// killed -9: after its session times out its partitions move to the others, which start
/// at its last commit: nothing is lost, and the only records read twice are the killed
/// member's records after its last commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_share_partitions_and_survive_a_killed_member() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone_with(
        dir.path(),
        port,
        &[("TIDELOG_OFFSETS_TOPIC_NUM_PARTITIONS", "4")],
    );
    let bootstrap = format!("127.0.0.1:{port}");
    let admin = AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    admin
        .create_topic("work", Some(6), Some(1), Default::default())
        .await
        .unwrap();
    let args = [
        "--topic",
        "work",
        "--group",
        "workers",
        "--from-beginning",
        "--timeout-ms",
        "12000",
        "--session-timeout-ms",
        "2000",
        "--auto-commit-interval-ms",
        "300",
    ];
    let mut members: Vec<Member> = (0..3)
        .map(|i| Member::start(dir.path(), &format!("m{i}"), &bootstrap, &args))
        .collect();
    // Every member holds two partitions before any data arrives.
    eventually(
        "three members with two partitions each",
        Duration::from_secs(30),
        || async {
            let d = try_describe(&bootstrap, "workers")?;
            let members = d["members"].as_array()?;
            let sizes: Vec<usize> = members
                .iter()
                .map(|m| {
                    m["assignment"].as_array().map_or(0, |a| {
                        a.iter()
                            .map(|t| t["partitions"].as_array().unwrap().len())
                            .sum()
                    })
                })
                .collect();
            (d["state"] == "stable" && sizes == vec![2, 2, 2]).then_some(())
        },
    )
    .await;
    produce(&bootstrap, "work", 0, 3000);
    eventually(
        "the first 3000 are read",
        Duration::from_secs(30),
        || async {
            let n: usize = members.iter().map(|m| m.records().len()).sum();
            (n >= 3000).then_some(())
        },
    )
    .await;
    let first: Vec<Vec<(u32, i64, String)>> = members.iter().map(Member::records).collect();
    let mut owner: BTreeMap<String, usize> = BTreeMap::new();
    for (i, records) in first.iter().enumerate() {
        for (_, _, v) in records {
            assert!(
                owner.insert(v.clone(), i).is_none(),
                "{v} read by two members"
            );
        }
    }
    assert_eq!(owner.len(), 3000);
    // Let auto commit run, then kill member 0 and produce more.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let killed_partitions: BTreeSet<u32> = first[0].iter().map(|(p, _, _)| *p).collect();
    members[0].child.kill().unwrap();
    let _ = members[0].child.wait();
    produce(&bootstrap, "work", 3000, 6000);
    eventually(
        "all 6000 read by the survivors",
        Duration::from_secs(60),
        || async {
            let seen: BTreeSet<String> = members
                .iter()
                .flat_map(|m| m.records())
                .map(|(_, _, v)| v)
                .collect();
            (seen.len() == 6000).then_some(())
        },
    )
    .await;
    for m in &mut members[1..] {
        assert!(
            m.wait(Duration::from_secs(30)),
            "member exits cleanly after idling"
        );
    }
    // Duplicates: only records of the killed member's partitions, read by it and again by
    // a survivor.
    let all: Vec<(usize, (u32, i64, String))> = members
        .iter()
        .enumerate()
        .flat_map(|(i, m)| m.records().into_iter().map(move |r| (i, r)))
        .collect();
    let mut count: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, (_, _, v)) in &all {
        count.entry(v.as_str()).or_default().push(*i);
    }
    for (i, (p, _, v)) in &all {
        let readers = &count[v.as_str()];
        if readers.len() > 1 {
            assert!(
                readers.len() == 2 && readers.contains(&0) && killed_partitions.contains(p),
                "{v} (partition {p}) read by members {readers:?}, member {i}"
            );
        }
    }
    // Once everyone is gone the group is empty with nothing left to read.
    let d = describe(&bootstrap, "workers");
    assert_eq!(total_lag(&d), 0, "{d}");
    assert_eq!(d["state"], "empty");
}

/// Broadcast: every member reads every record; offsets are kept per member instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broadcast_members_each_get_everything() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone_with(
        dir.path(),
        port,
        &[("TIDELOG_OFFSETS_TOPIC_NUM_PARTITIONS", "4")],
    );
    let bootstrap = format!("127.0.0.1:{port}");
    AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10))
        .create_topic("news", Some(3), Some(1), Default::default())
        .await
        .unwrap();
    produce(&bootstrap, "news", 0, 300);
    let mut members: Vec<Member> = (0..3)
        .map(|i| {
            let name = format!("b{i}");
            Member::start(
                dir.path(),
                &name,
                &bootstrap,
                &[
                    "--topic",
                    "news",
                    "--group",
                    "fans",
                    "--broadcast",
                    "--instance-id",
                    &name,
                    "--from-beginning",
                    "--timeout-ms",
                    "3000",
                ],
            )
        })
        .collect();
    for m in &mut members {
        assert!(m.wait(Duration::from_secs(60)), "member exits after idling");
        let values: BTreeSet<String> = m.records().into_iter().map(|(_, _, v)| v).collect();
        assert_eq!(values.len(), 300);
        assert_eq!(m.records().len(), 300, "each record once per member");
    }
    // A restarted member resumes from its own offsets: nothing new to read.
    let mut again = Member::start(
        dir.path(),
        "b0-again",
        &bootstrap,
        &[
            "--topic",
            "news",
            "--group",
            "fans",
            "--broadcast",
            "--instance-id",
            "b0",
            "--from-beginning",
            "--timeout-ms",
            "2000",
        ],
    );
    assert!(again.wait(Duration::from_secs(30)));
    assert!(
        again.records().is_empty(),
        "resumed from b0's committed offsets"
    );
}

/// Committed offsets live in __consumer_offsets with replication factor 3: they survive
/// kill -9 of the coordinator's broker; `groups describe` reports lag after produce and
/// after commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn offsets_survive_the_coordinators_broker() {
    let c = BrokerCluster::start_with(3, &[("TIDELOG_OFFSETS_TOPIC_NUM_PARTITIONS", "3")]);
    let mut c = c;
    let bootstrap = c.broker_address(1);
    AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10))
        .create_topic("ledger", Some(2), Some(3), Default::default())
        .await
        .unwrap();
    produce(&bootstrap, "ledger", 0, 500);
    let mut reader = Member::start(
        c.dir.path(),
        "reader",
        &bootstrap,
        &[
            "--topic",
            "ledger",
            "--group",
            "audit",
            "--from-beginning",
            "--max-messages",
            "200",
        ],
    );
    assert!(
        reader.wait(Duration::from_secs(60)),
        "reader stops after 200"
    );
    assert_eq!(reader.records().len(), 200);
    let d = describe(&bootstrap, "audit");
    assert_eq!(total_lag(&d), 300, "500 produced, 200 committed: {d}");
    produce(&bootstrap, "ledger", 500, 600);
    assert_eq!(
        total_lag(&describe(&bootstrap, "audit")),
        400,
        "lag grows with produce"
    );

    // Kill the coordinator's broker; another broker takes over the offsets partition.
    let mut groups = GroupsClient::connect(format!("http://{bootstrap}"))
        .await
        .unwrap();
    let coordinator = groups
        .find_coordinator(FindCoordinatorRequest {
            group: "audit".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .coordinator_id;
    c.brokers[coordinator as usize - 1]
        .as_mut()
        .unwrap()
        .kill9();
    let survivor = c.broker_address(if coordinator == 1 { 2 } else { 1 });
    let d = eventually(
        "a new coordinator answers",
        Duration::from_secs(60),
        || async {
            let (ok, out, _) = cli(&[
                "groups",
                "describe",
                "--group",
                "audit",
                "--bootstrap",
                &survivor,
                "--output",
                "json",
            ]);
            ok.then(|| serde_json::from_str::<serde_json::Value>(&out).unwrap())
        },
    )
    .await;
    assert_eq!(total_lag(&d), 400, "committed offsets survived: {d}");
    // The rest is read from the committed position: exactly the 400 not yet committed.
    let mut rest = Member::start(
        c.dir.path(),
        "rest",
        &survivor,
        &[
            "--topic",
            "ledger",
            "--group",
            "audit",
            "--timeout-ms",
            "4000",
        ],
    );
    assert!(rest.wait(Duration::from_secs(60)));
    let first: BTreeSet<String> = reader.records().into_iter().map(|(_, _, v)| v).collect();
    let second: BTreeSet<String> = rest.records().into_iter().map(|(_, _, v)| v).collect();
    assert_eq!(second.len(), 400);
    assert!(first.is_disjoint(&second));
    assert_eq!(total_lag(&describe(&survivor, "audit")), 0);
    c.start_broker(coordinator);
}

/// Superseded commits are cleaned up: the offsets partition's log start moves past them,
/// and the latest commit of every key survives, also across a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn superseded_commits_are_cleaned_up() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let args = vec![
        "--data-dir".to_owned(),
        dir.path().join("data").display().to_string(),
        "--listen".to_owned(),
        format!("127.0.0.1:{port}"),
    ];
    let env: Vec<(&str, &str)> = FAST_RAFT
        .iter()
        .copied()
        .chain([
            ("TIDELOG_OFFSETS_TOPIC_NUM_PARTITIONS", "1"),
            ("TIDELOG_OFFSETS_CLEANUP_MIN_RECORDS", "50"),
        ])
        .collect();
    let mut server = Proc::start("standalone", &args, &env, dir.path());
    let bootstrap = format!("127.0.0.1:{port}");
    AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10))
        .create_topic("c", Some(2), Some(1), Default::default())
        .await
        .unwrap();
    let admin =
        tidelog::client::groups::GroupsAdmin::new(vec![bootstrap.clone()], Duration::from_secs(10));
    for i in 0..100i64 {
        let offsets = (0..2)
            .map(|p| tidelog::api::proto::CommittedOffset {
                topic: "c".into(),
                partition: p,
                offset: i * 10 + i64::from(p),
                metadata: String::new(),
            })
            .collect();
        admin.reset("keeper", offsets).await.unwrap();
    }
    let topics = AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10));
    eventually(
        "the offsets log start moves",
        Duration::from_secs(40),
        || async {
            let d = topics
                .describe_topics_with_offsets(vec!["__consumer_offsets".into()])
                .await
                .ok()?;
            let o = d[0].offsets.first()?;
            (o.log_start_offset >= 200).then_some(())
        },
    )
    .await;
    let committed = |d: &serde_json::Value| -> Vec<i64> {
        d["offsets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["committed_offset"].as_i64().unwrap())
            .collect()
    };
    assert_eq!(committed(&describe(&bootstrap, "keeper")), vec![990, 991]);
    assert!(server.terminate().success());
    let _server = Proc::start("standalone", &args, &env, dir.path());
    let d = eventually("the group is back", Duration::from_secs(30), || async {
        try_describe(&bootstrap, "keeper")
    })
    .await;
    assert_eq!(
        committed(&d),
        vec![990, 991],
        "latest commits survive the clean-up and a restart"
    );
}

/// One heartbeat of a member driven by hand; returns (member id, epoch, assignment).
async fn beat(
    groups: &mut GroupsClient<tonic::transport::Channel>,
    member: &str,
    epoch: i32,
    owned: &[u32],
) -> (String, i32, Vec<u32>) {
    let r = groups
        .group_heartbeat(GroupHeartbeatRequest {
            group: "g".into(),
            member_id: member.into(),
            member_epoch: epoch,
            topics: vec!["moves".into()],
            session_timeout_ms: 30_000,
            owned: vec![TopicPartitions {
                topic: "moves".into(),
                partitions: owned.to_vec(),
            }],
            ..Default::default()
        })
        .await
        .expect("heartbeat")
        .into_inner();
    let assignment = r.assignment.iter().flat_map(|t| t.partitions.clone());
    (r.member_id, r.member_epoch, assignment.collect())
}

async fn commit_at(
    groups: &mut GroupsClient<tonic::transport::Channel>,
    member: &str,
    epoch: i32,
    partition: u32,
    offset: i64,
) -> Result<(), tonic::Status> {
    groups
        .offset_commit(OffsetCommitRequest {
            group: "g".into(),
            member_id: member.into(),
            member_epoch: epoch,
            offsets: vec![CommittedOffset {
                topic: "moves".into(),
                partition,
                offset,
                metadata: String::new(),
            }],
            ..Default::default()
        })
        .await
        .map(|_| ())
}

/// A member commits only the partitions it holds or was given: once a partition moved to
/// another member, the first member's late commit of it is refused and the new holder's
/// offset stays; a member that rejoins (its session lost) cannot claim its old partitions
/// by listing them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_cannot_commit_a_partition_it_gave_up() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let _server = standalone_with(dir.path(), port, &[]);
    let bootstrap = format!("127.0.0.1:{port}");
    AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10))
        .create_topic("moves", Some(2), Some(1), Default::default())
        .await
        .unwrap();
    let mut groups = GroupsClient::connect(format!("http://{bootstrap}"))
        .await
        .unwrap();
    eventually("the coordinator is ready", Duration::from_secs(30), || {
        let mut groups = groups.clone();
        async move {
            groups
                .find_coordinator(FindCoordinatorRequest { group: "g".into() })
                .await
                .ok()?;
            groups
                .offset_fetch(OffsetFetchRequest {
                    group: "g".into(),
                    ..Default::default()
                })
                .await
                .ok()
        }
    })
    .await;

    // A alone gets both partitions and takes them.
    let (a, mut a_epoch, a_target) = beat(&mut groups, "", 0, &[]).await;
    assert_eq!(a_target, vec![0, 1]);
    (_, a_epoch, _) = beat(&mut groups, &a, a_epoch, &[0, 1]).await;
    commit_at(&mut groups, &a, a_epoch, 1, 10).await.unwrap();

    // B joins; A gives up one partition, which B then takes.
    let (b, mut b_epoch, _) = beat(&mut groups, "", 0, &[]).await;
    let mut a_held = vec![0, 1];
    let mut b_held = Vec::new();
    for _ in 0..20 {
        let (_, e, target) = beat(&mut groups, &a, a_epoch, &a_held).await;
        (a_epoch, a_held) = (e, target);
        let (_, e, target) = beat(&mut groups, &b, b_epoch, &b_held).await;
        (b_epoch, b_held) = (e, target);
        if a_held.len() == 1 && b_held.len() == 1 {
            break;
        }
    }
    assert_eq!(a_held.len() + b_held.len(), 2, "A {a_held:?} B {b_held:?}");
    let moved = b_held[0];
    // B's heartbeat above reported nothing held yet; now it does.
    (_, b_epoch, _) = beat(&mut groups, &b, b_epoch, &b_held).await;
    commit_at(&mut groups, &b, b_epoch, moved, 50)
        .await
        .unwrap();

    // A's late commit of the partition it gave up is refused and changes nothing.
    let err = commit_at(&mut groups, &a, a_epoch, moved, 5)
        .await
        .unwrap_err();
    assert_eq!(code_of(&err), ErrorCode::FencedMemberEpoch, "{err:?}");
    assert!(err.message().contains("does not hold"), "{err:?}");
    let committed = |groups: &mut GroupsClient<tonic::transport::Channel>| {
        let mut groups = groups.clone();
        async move {
            groups
                .offset_fetch(OffsetFetchRequest {
                    group: "g".into(),
                    partitions: vec![TopicPartitions {
                        topic: "moves".into(),
                        partitions: vec![moved],
                    }],
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .offsets[0]
                .offset
        }
    };
    assert_eq!(committed(&mut groups).await, 50);

    // A rejoins as a new member listing B's partition as held: it holds nothing, so its
    // commit of that partition is refused too.
    let (a2, a2_epoch, _) = beat(&mut groups, "", 0, &[moved]).await;
    let err = commit_at(&mut groups, &a2, a2_epoch, moved, 7)
        .await
        .unwrap_err();
    assert_eq!(code_of(&err), ErrorCode::FencedMemberEpoch, "{err:?}");
    assert_eq!(committed(&mut groups).await, 50);
}

/// Rack-aware assignment: 3 brokers in racks a, b, c; a 6-partition topic with one replica
/// per partition; 3 members in racks a, b, c with `--strategy rack-aware`: each member
/// holds exactly the partitions whose replica lives in its rack. (Range would give member
/// i partitions 2i and 2i+1, whatever their racks.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rack_aware_members_get_the_partitions_of_their_rack() {
    let c = BrokerCluster::build_in_racks(1, 3, &[], false, &["a", "b", "c"]);
    let bootstrap = c.bootstrap().join(",");
    let admin = AdminClient::new(c.bootstrap(), Duration::from_secs(20));
    eventually("the topic is created", Duration::from_secs(30), || async {
        admin
            .create_topic("racked", Some(6), Some(1), Default::default())
            .await
            .ok()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut members = BTreeMap::new();
    // Kept alive to the end: dropping a Member kills its process.
    let mut running = Vec::new();
    for rack in ["a", "b", "c"] {
        let m = Member::start(
            dir.path(),
            rack,
            &bootstrap,
            &[
                "--topic",
                "racked",
                "--group",
                "ra",
                "--strategy",
                "rack-aware",
                "--rack",
                rack,
                "--timeout-ms",
                "60000",
            ],
        );
        members.insert(format!("tidelog-consume-{}", m.child.id()), rack);
        running.push(m);
    }
    let (ok, out, err) = cli(&[
        "topics",
        "describe",
        "--topic",
        "racked",
        "--bootstrap",
        &bootstrap,
        "--output",
        "json",
    ]);
    assert!(ok, "{err}");
    let d: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rack_of_broker = |b: i64| ["a", "b", "c"][b as usize - 1];
    let partition_rack: BTreeMap<u64, &str> = d["topics"][0]["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["partition"].as_u64().unwrap(),
                rack_of_broker(p["replicas"][0].as_i64().unwrap()),
            )
        })
        .collect();
    let per_rack: BTreeMap<&str, usize> =
        partition_rack.values().fold(BTreeMap::new(), |mut m, r| {
            *m.entry(*r).or_default() += 1;
            m
        });
    assert_eq!(
        per_rack.values().copied().collect::<Vec<_>>(),
        [2, 2, 2],
        "placement spreads racks"
    );
    let assignment = eventually("three members, stable", Duration::from_secs(40), || async {
        let d = try_describe(&bootstrap, "ra")?;
        let list = d["members"].as_array()?;
        if d["state"] != "stable" || list.len() != 3 {
            return None;
        }
        let mut out: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
        for m in list {
            let parts: BTreeSet<u64> = m["assignment"]
                .as_array()?
                .iter()
                .flat_map(|t| t["partitions"].as_array().cloned().unwrap_or_default())
                .filter_map(|p| p.as_u64())
                .collect();
            out.insert(m["client_id"].as_str()?.to_owned(), parts);
        }
        (out.values().map(BTreeSet::len).sum::<usize>() == 6).then_some(out)
    })
    .await;
    for (client, parts) in &assignment {
        let rack = members[client];
        for p in parts {
            assert_eq!(
                partition_rack[p], rack,
                "member in rack {rack} got partition {p} of rack {}",
                partition_rack[p]
            );
        }
        assert_eq!(parts.len(), 2, "{assignment:?}");
    }
}
