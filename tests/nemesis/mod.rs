//! The randomized fault test ("nemesis"): 3 controllers and 3 brokers in their own
//! network namespaces, a topic with replication factor 3 and `min.insync.replicas=2`,
//! idempotent acks=all writers and group consumers, while a seeded schedule kills (-9),
//! pauses, partitions and fills the disks of nodes. Afterwards everything heals, the
//! cluster must get its full ISR back, the brokers stop, and the checker compares what
//! the clients saw with every replica's files (see `checker`).
//!
//! One run is [`run`]: it returns a [`Report`] (faults, records checked, anomalies,
//! recovery time) and leaves nothing behind (processes, mounts, namespaces), keeping
//! the data and logs only when it found an anomaly.

pub mod checker;
pub mod cluster;
pub mod load;
pub mod netns;
pub mod schedule;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tidelog::broker::group::offsets::{self, OFFSETS_TOPIC};
use tidelog::client::AdminClient;
use tidelog::partition::{Isolation, PartitionLog, SystemClock};
use tidelog::topic_config::TopicConfig;
use tidelog::types::Offset;

use checker::{Anomaly, History, Replica};
use cluster::{Cluster, BROKERS, CONTROLLERS};
use load::{Member, Writer, GROUP, PARTITIONS, TOPIC};
use schedule::{Event, Fault};

/// The binary under test.
pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_tidelog")
}

/// Idempotent acks=all writers.
const WRITERS: u32 = 4;
/// Group members.
const MEMBERS: u32 = 2;
/// How long the cluster may take to get its full ISR back after healing.
const RECOVERY_MAX: Duration = Duration::from_secs(90);

/// What one run found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub seed: u64,
    pub faults: usize,
    pub fault_kinds: BTreeMap<&'static str, usize>,
    /// Acknowledged records, each checked on every in-sync replica.
    pub acked: usize,
    /// Sends that failed (unknown outcome; checked for duplicates only).
    pub failed_sends: usize,
    /// Records stored (distinct values on the fullest replicas).
    pub stored: usize,
    /// Records the consumers read (each checked against the log).
    pub consumed: usize,
    /// Commits in the group's offsets log.
    pub commits: usize,
    pub anomalies: Vec<Anomaly>,
    /// From healing to a full ISR everywhere.
    pub recovery: Option<Duration>,
    /// Nodes that exited by themselves, or not cleanly on SIGTERM.
    pub crashes: Vec<String>,
    /// Where the data and logs were kept (anomalies only).
    pub kept: Option<PathBuf>,
}

impl Report {
    /// Records checked: acknowledgements (on every replica), stored and consumed records.
    pub fn records_checked(&self) -> usize {
        self.acked + self.stored + self.consumed
    }

    /// The one line `scripts/nemesis` parses.
    pub fn summary_line(&self) -> String {
        let kinds: Vec<String> = self
            .fault_kinds
            .iter()
            .map(|(k, n)| format!("{k}:{n}"))
            .collect();
        format!(
            "NEMESIS-RESULT seed={} faults={} records={} acked={} failed_sends={} stored={} consumed={} commits={} anomalies={} recovery_ms={} crashes={} kinds={}",
            self.seed,
            self.faults,
            self.records_checked(),
            self.acked,
            self.failed_sends,
            self.stored,
            self.consumed,
            self.commits,
            self.anomalies.len(),
            self.recovery.map_or(-1, |d| d.as_millis() as i64),
            self.crashes.len(),
            kinds.join(",")
        )
    }
}

/// A fault in effect: what to undo.
struct Active {
    fault: Fault,
    /// Links it cuts.
    cuts: BTreeSet<(usize, usize)>,
}

/// Runs seed `seed` with faults over `window`; `run_no` keeps namespace names distinct
/// between runs of one process.
pub fn run(seed: u64, window: Duration, run_no: u32) -> Result<Report> {
    let events = schedule::generate(seed, window);
    eprintln!(
        "nemesis: seed {seed}, {} faults over {window:?}:",
        events.len()
    );
    for e in &events {
        eprintln!(
            "  {:>6} ms .. {:>6} ms  {}",
            e.start.as_millis(),
            e.end.as_millis(),
            e.fault
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("runtime")?;
    let mut cluster = Cluster::start(run_no)?;
    let bootstrap = cluster.bootstrap();
    let controllers = cluster.controller_addresses();
    let mut report = Report {
        seed,
        ..Default::default()
    };
    let outcome = rt.block_on(setup(&bootstrap, &controllers));
    if let Err(e) = outcome {
        cluster.keep_files();
        return Err(e.context(format!("seed {seed}: setup")));
    }
    let (writers, members) = rt.block_on(async {
        let writers: Vec<Writer> = (0..WRITERS)
            .map(|i| Writer::start(bootstrap.clone(), i))
            .collect();
        let members: Vec<Member> = (0..MEMBERS)
            .map(|i| Member::start(bootstrap.clone(), i))
            .collect();
        (writers, members)
    });
    let assigned = poll_until(Duration::from_secs(30), || {
        members.iter().all(|m| m.assigned() > 0)
    });
    if !assigned {
        bail!("seed {seed}: the group members got no partitions within 30 s");
    }

    // The faults.
    let started = Instant::now();
    apply_schedule(&rt, &mut cluster, &events, started, &mut report)?;
    let waited = started.elapsed();
    eprintln!(
        "nemesis: seed {seed}: schedule done after {waited:?}; {} records acknowledged so far",
        writers.iter().map(Writer::acked).sum::<usize>()
    );

    // Heal everything, then wait for a full ISR.
    let healed_at = Instant::now();
    heal_all(&mut cluster)?;
    let (recovery, recovery_note, view) = rt.block_on(wait_for_recovery(&controllers, true));
    report.recovery = recovery.map(|_| healed_at.elapsed());
    eprintln!(
        "nemesis: seed {seed}: recovery {:?} {recovery_note}",
        report.recovery
    );
    // Some load on the healed cluster, then the writers stop and the readers catch up.
    std::thread::sleep(Duration::from_secs(3));
    let (acks, failures) = rt.block_on(async {
        let mut acks = Vec::new();
        let mut failures = Vec::new();
        for w in writers {
            let (a, f) = w.finish().await;
            acks.extend(a);
            failures.extend(f);
        }
        (acks, failures)
    });
    let mut last_acked: BTreeMap<u32, i64> = BTreeMap::new();
    for a in &acks {
        let e = last_acked.entry(a.partition).or_insert(a.offset);
        *e = (*e).max(a.offset);
    }
    poll_until(Duration::from_secs(20), || {
        let mut read: BTreeMap<u32, i64> = BTreeMap::new();
        for m in &members {
            for (p, o) in m.positions() {
                let e = read.entry(p).or_insert(o);
                *e = (*e).max(o);
            }
        }
        last_acked
            .iter()
            .all(|(p, o)| read.get(p).is_some_and(|r| r >= o))
    });
    let (consumed, poll_errors) = rt.block_on(async {
        let mut all = Vec::new();
        let mut errors = 0;
        for m in members {
            let (c, e) = m.finish().await;
            all.extend(c);
            errors += e;
        }
        (all, errors)
    });
    cluster.reap_crashed();
    let high_watermarks = rt.block_on(leader_high_watermarks(&bootstrap));

    // Stop the brokers and read every replica.
    for b in CONTROLLERS..CONTROLLERS + BROKERS {
        if let Err(e) = cluster.terminate(b) {
            report.crashes.push(e.to_string());
        }
    }
    report.crashes.extend(cluster.unexpected_exits());
    let mut history = History {
        acks,
        high_watermarks,
        consumed,
        recovery: report.recovery,
        recovery_note,
        ..Default::default()
    };
    for p in 0..PARTITIONS {
        let mut replicas = Vec::new();
        for id in 1..=BROKERS as i32 {
            let dir = cluster
                .broker_data_dir(id as usize)
                .join(format!("{TOPIC}-{p}"));
            let (records, hw) = read_replica(&dir)?;
            let e = history.high_watermarks.entry(p).or_insert(hw);
            *e = (*e).max(hw);
            replicas.push(Replica {
                broker: id,
                in_isr: view.isr.get(&p).is_some_and(|s| s.contains(&id)),
                records,
            });
        }
        history.replicas.insert(p, replicas);
    }
    let offsets_partition = offsets::partition_for(GROUP, view.offsets_partitions.max(1));
    for id in 1..=BROKERS as i32 {
        let dir = cluster
            .broker_data_dir(id as usize)
            .join(format!("{OFFSETS_TOPIC}-{offsets_partition}"));
        history.commits.push((id, read_commits(&dir)?));
    }
    report.acked = history.acks.len();
    report.failed_sends = failures.len();
    report.stored = history
        .replicas
        .values()
        .map(|rs| rs.iter().map(|r| r.records.len()).max().unwrap_or(0))
        .sum();
    report.consumed = history.consumed.len();
    report.commits = history.commits.first().map_or(0, |(_, c)| c.len());
    report.anomalies = checker::check(&history);
    eprintln!(
        "nemesis: seed {seed}: {} acknowledged, {} failed sends, {} consumer poll errors",
        report.acked, report.failed_sends, poll_errors
    );
    if !report.anomalies.is_empty() {
        for a in report.anomalies.iter().take(50) {
            eprintln!("nemesis: seed {seed}: ANOMALY {a}");
        }
        report.kept = Some(cluster.keep_files());
        eprintln!(
            "nemesis: seed {seed}: data and logs kept in {}",
            report
                .kept
                .as_ref()
                .map_or(String::new(), |p| p.display().to_string())
        );
    }
    for c in &report.crashes {
        eprintln!("nemesis: seed {seed}: node exit: {c}");
    }
    drop(cluster);
    rt.shutdown_timeout(Duration::from_secs(5));
    Ok(report)
}

/// Polls `done` every 100 ms for up to `within`; whether it became true.
fn poll_until(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if done() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Creates the topic and waits until every partition is led with its full ISR.
async fn setup(bootstrap: &[String], controllers: &[String]) -> Result<()> {
    let admin = AdminClient::new(bootstrap.to_vec(), Duration::from_secs(20));
    admin
        .create_topic(
            TOPIC,
            Some(PARTITIONS),
            Some(3),
            [("min.insync.replicas".to_owned(), "2".to_owned())].into(),
        )
        .await
        .context("create topic")?;
    let (ok, note, _) = wait_for_recovery(controllers, false).await;
    if ok.is_none() {
        bail!("the new topic did not get its full ISR: {note}");
    }
    Ok(())
}

/// What the controllers said last about the topic.
#[derive(Debug, Default)]
struct View {
    /// ISR per partition of [`TOPIC`].
    isr: BTreeMap<u32, BTreeSet<i32>>,
    /// Partitions of the offsets topic (0: not described).
    offsets_partitions: u32,
}

/// Waits (up to [`RECOVERY_MAX`]) until the controllers show every partition of the
/// topic (and with `with_offsets`, the group's offsets partition) led with all three
/// replicas in sync. Returns (Some(()) when it did, what it saw last, the last view).
async fn wait_for_recovery(
    controllers: &[String],
    with_offsets: bool,
) -> (Option<()>, String, View) {
    let admin = AdminClient::new(controllers.to_vec(), Duration::from_secs(2));
    let deadline = Instant::now() + RECOVERY_MAX;
    let mut view = View::default();
    loop {
        let mut lagging = Vec::new();
        let mut names = vec![TOPIC];
        if with_offsets {
            names.push(OFFSETS_TOPIC);
        }
        let mut answered = true;
        for name in names {
            let described = admin
                .describe_topics(vec![name.to_owned()])
                .await
                .ok()
                .and_then(|mut r| r.topics.pop())
                .and_then(|d| d.topic);
            let Some(t) = described else {
                answered = false;
                lagging.push(format!("{name}: not described"));
                continue;
            };
            let count = t.partitions.len() as u32;
            if name == OFFSETS_TOPIC {
                view.offsets_partitions = count;
            }
            for p in &t.partitions {
                let relevant = name == TOPIC || p.partition == offsets::partition_for(GROUP, count);
                if relevant && (p.leader.is_none() || p.isr.len() < BROKERS) {
                    lagging.push(format!(
                        "{name}-{}: leader {:?} isr {:?}",
                        p.partition, p.leader, p.isr
                    ));
                }
                if name == TOPIC {
                    view.isr
                        .insert(p.partition, p.isr.iter().copied().collect());
                }
            }
        }
        if answered && lagging.is_empty() {
            return (Some(()), "full ISR".into(), view);
        }
        if Instant::now() > deadline {
            return (None, lagging.join("; "), view);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Each partition's high watermark as its leader reports it (best effort).
async fn leader_high_watermarks(bootstrap: &[String]) -> BTreeMap<u32, i64> {
    let admin = AdminClient::new(bootstrap.to_vec(), Duration::from_secs(5));
    let mut out = BTreeMap::new();
    if let Ok(topics) = admin
        .describe_topics_with_offsets(vec![TOPIC.to_owned()])
        .await
    {
        for d in topics {
            for o in d.offsets {
                out.insert(o.partition, o.high_watermark);
            }
        }
    }
    out
}

/// Plays `events` from `started`: applies each fault at its start and undoes it at its
/// end; crashed nodes are noticed as it goes.
fn apply_schedule(
    rt: &tokio::runtime::Runtime,
    cluster: &mut Cluster,
    events: &[Event],
    started: Instant,
    report: &mut Report,
) -> Result<()> {
    // (when, is_end, event index); ends first at equal times.
    let mut actions: Vec<(Duration, bool, usize)> = events
        .iter()
        .enumerate()
        .flat_map(|(i, e)| [(e.start, false, i), (e.end, true, i)])
        .collect();
    actions.sort_by_key(|(t, end, i)| (*t, !*end, *i));
    let mut active: BTreeMap<usize, Active> = BTreeMap::new();
    for (at, end, i) in actions {
        while started.elapsed() < at {
            std::thread::sleep((at - started.elapsed()).min(Duration::from_millis(100)));
            cluster.reap_crashed();
        }
        let t = started.elapsed().as_millis();
        if end {
            let Some(a) = active.remove(&i) else { continue };
            eprintln!("nemesis: {t:>6} ms heal  {}", a.fault);
            undo(cluster, &a.fault)?;
        } else {
            let fault = resolve(rt, cluster, &events[i].fault);
            eprintln!("nemesis: {t:>6} ms fault {fault}");
            let cuts = apply(cluster, &fault)?;
            report.faults += 1;
            *report
                .fault_kinds
                .entry(events[i].fault.kind())
                .or_default() += 1;
            active.insert(i, Active { fault, cuts });
        }
        let cuts: BTreeSet<(usize, usize)> = active
            .values()
            .flat_map(|a| a.cuts.iter().copied())
            .collect();
        cluster.net.set_cuts(cuts)?;
    }
    Ok(())
}

/// Turns "the controller leader" into a node, asking the controllers who leads now
/// (controller 1 when none answers).
fn resolve(rt: &tokio::runtime::Runtime, cluster: &Cluster, fault: &Fault) -> Fault {
    if *fault != Fault::IsolateControllerLeader {
        return fault.clone();
    }
    let controllers = cluster.controller_addresses();
    let leader = rt.block_on(async {
        let admin = AdminClient::new(controllers, Duration::from_secs(2));
        tokio::time::timeout(Duration::from_secs(3), admin.describe_cluster())
            .await
            .ok()
            .and_then(|r| r.ok())
            .and_then(|r| r.leader)
    });
    let index = leader
        .and_then(|id| usize::try_from(id).ok())
        .filter(|id| (1..=CONTROLLERS).contains(id))
        .map_or(0, |id| id - 1);
    Fault::Isolate(index)
}

/// Starts `fault`; returns the links it cuts.
fn apply(cluster: &mut Cluster, fault: &Fault) -> Result<BTreeSet<(usize, usize)>> {
    let all: Vec<usize> = (0..CONTROLLERS + BROKERS).collect();
    Ok(match fault {
        Fault::Kill(i) => {
            cluster.kill9(*i);
            BTreeSet::new()
        }
        Fault::Pause(i) => {
            cluster.pause(*i);
            BTreeSet::new()
        }
        Fault::Isolate(i) => netns::Network::pairs(&[*i], &all),
        Fault::IsolateControllerLeader => unreachable!("resolved before"),
        Fault::CutBrokers(a, b) => netns::Network::pairs(&[*a], &[*b]),
        Fault::Split { controller, broker } => {
            let minority = [*controller, *broker];
            let majority: Vec<usize> = all
                .iter()
                .copied()
                .filter(|n| !minority.contains(n))
                .collect();
            netns::Network::pairs(&minority, &majority)
        }
        Fault::DiskFull(i) => {
            let left = cluster.fill_disk(*i - CONTROLLERS + 1)?;
            eprintln!("nemesis: {} has {left} bytes free", cluster.name(*i));
            BTreeSet::new()
        }
    })
}

/// Ends `fault` (the links come back through `set_cuts`).
fn undo(cluster: &mut Cluster, fault: &Fault) -> Result<()> {
    match fault {
        Fault::Kill(i) => cluster.restart(*i)?,
        Fault::Pause(i) => cluster.resume(*i),
        Fault::DiskFull(i) => {
            cluster.free_disk(*i - CONTROLLERS + 1);
            cluster.kill9(*i);
            cluster.restart(*i)?;
        }
        Fault::Isolate(_)
        | Fault::IsolateControllerLeader
        | Fault::CutBrokers(..)
        | Fault::Split { .. } => {}
    }
    Ok(())
}

/// Ends every fault: links, disks, paused and dead processes.
fn heal_all(cluster: &mut Cluster) -> Result<()> {
    cluster.net.heal()?;
    for id in 1..=BROKERS {
        cluster.free_disk(id);
    }
    cluster.resume_and_restart_all()
}

/// Every record of a stopped broker's copy of a partition, and its high watermark.
fn read_replica(dir: &Path) -> Result<(Vec<(i64, String)>, i64)> {
    let mut out = Vec::new();
    let hw = read_log(dir, |r| {
        out.push((
            r.offset,
            String::from_utf8_lossy(r.value.as_deref().unwrap_or_default()).into_owned(),
        ))
    })?;
    Ok((out, hw))
}

/// The group's commits of [`TOPIC`] in a stopped broker's copy of its offsets partition.
fn read_commits(dir: &Path) -> Result<Vec<(u32, i64)>> {
    let mut out = Vec::new();
    if !dir.exists() {
        return Ok(out);
    }
    read_log(dir, |r| {
        if let Some((key, Some(value))) = offsets::decode(r) {
            if key.group == GROUP && key.topic == TOPIC {
                out.push((key.partition, value.offset));
            }
        }
    })?;
    Ok(out)
}

/// Calls `each` for every record of the partition log in `dir`, in offset order;
/// returns its high watermark.
fn read_log(dir: &Path, mut each: impl FnMut(&tidelog::record::Record)) -> Result<i64> {
    let log = PartitionLog::open(dir, TopicConfig::default(), Arc::new(SystemClock))
        .with_context(|| format!("open {}", dir.display()))?;
    let mut next = log.log_start_offset();
    let end = log.log_end_offset();
    // Bounded: every round moves `next` forward by at least one.
    while next < end {
        let data = log
            .read(next, 1 << 20, Isolation::LogEnd)
            .with_context(|| format!("read {} at {}", dir.display(), next.0))?;
        let records = tidelog::record::decode_data_records(&data.records, 64 << 20)
            .with_context(|| format!("decode {}", dir.display()))?;
        let mut last = None;
        for r in &records {
            if r.offset as u64 >= next.0 {
                each(r);
                last = Some(r.offset as u64);
            }
        }
        next = Offset(last.map_or(next.0 + 1, |o| o + 1));
    }
    Ok(log.high_watermark().0 as i64)
}
