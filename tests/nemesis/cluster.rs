//! The cluster under test: 3 controllers and 3 brokers, each a real `tidelog` process in
//! its own network namespace ([`Network`]), each broker's data directory on its own small
//! ext4 file system (a sparse image on a loop device) so a disk-full fault can fill it. Processes are started, killed -9, paused,
//! resumed and restarted by the schedule; every one the cluster started is killed and
//! reaped by `Drop` (SIGKILL also ends a stopped process), then the disks are
//! unmounted and the namespaces deleted, even when the test panics.
//!
//! Node indices: 0..3 are controllers 1..=3, 3..6 are brokers 1..=3.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::netns::{self, Network};

/// Controllers, then brokers.
pub const CONTROLLERS: usize = 3;
/// Brokers.
pub const BROKERS: usize = 3;
/// Every node's client port (each node has its own address).
pub const CLIENT_PORT: u16 = 9000;
/// Every node's internal port.
pub const INTERNAL_PORT: u16 = 9100;
/// The size of each broker's data disk (a sparse ext4 image on a loop device).
const BROKER_DISK_BYTES: u64 = 256 << 20;

/// Environment for every node: fast Raft, quick fencing and ISR changes, so faults of a
/// few seconds have effects the checker can see. Only real settings (the server refuses
/// unknown `TIDELOG_*` variables).
const ENV: &[(&str, &str)] = &[
    ("TIDELOG_RAFT_HEARTBEAT_INTERVAL_MS", "100"),
    ("TIDELOG_RAFT_ELECTION_TIMEOUT_MIN_MS", "600"),
    ("TIDELOG_RAFT_ELECTION_TIMEOUT_MAX_MS", "1200"),
    ("TIDELOG_BROKER_SESSION_TIMEOUT_MS", "3000"),
    ("TIDELOG_BROKER_HEARTBEAT_INTERVAL_MS", "300"),
    ("TIDELOG_REPLICA_LAG_TIME_MAX_MS", "2000"),
    ("TIDELOG_LEADER_IMBALANCE_CHECK_INTERVAL_MS", "5000"),
];

/// Run directories are `<tmp>/tidelog-nemesis-<pid>-*`: the pid tells a stale one.
pub const DIR_PREFIX: &str = "tidelog-nemesis-";

/// A file in a run directory that was kept on purpose.
const KEPT_MARKER: &str = "KEPT";

/// The shared secret of the cluster (internal listeners are not on loopback here).
const SECRET: &str = "tidelog nemesis cluster secret 0123456789";

/// What a node is doing, as far as the test knows.
enum State {
    Running(Child),
    Paused(Child),
    Down,
}

/// One node: how to start it and its process.
struct Node {
    role: &'static str,
    args: Vec<String>,
    state: State,
    log: PathBuf,
    /// Exits the test did not cause (crashes), with their status.
    unexpected_exits: Vec<String>,
}

/// The running cluster.
pub struct Cluster {
    nodes: Vec<Node>,
    /// Broker data disks mounted (unmounted on drop).
    mounts: Vec<PathBuf>,
    /// The network; dropped after the processes are gone.
    pub net: Network,
    dir: Option<tempfile::TempDir>,
    root: PathBuf,
}

impl Cluster {
    /// Builds the network and the mounts and starts every node, waiting until each
    /// announces it serves.
    pub fn start(run: u32) -> Result<Cluster> {
        let net = Network::create(CONTROLLERS + BROKERS, run)?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("{}{}-", DIR_PREFIX, std::process::id()))
            .tempdir()
            .context("tempdir")?;
        let root = dir.path().to_owned();
        let secret = root.join("cluster.secret");
        std::fs::write(&secret, SECRET).context("secret file")?;
        let mut cluster = Cluster {
            nodes: Vec::new(),
            mounts: Vec::new(),
            net,
            dir: Some(dir),
            root: root.clone(),
        };
        let peers = (0..CONTROLLERS)
            .map(|i| format!("{}={}", i + 1, cluster.internal_address(i)))
            .collect::<Vec<_>>()
            .join(",");
        let controllers = (0..CONTROLLERS)
            .map(|i| cluster.internal_address(i))
            .collect::<Vec<_>>()
            .join(",");
        for i in 0..CONTROLLERS + BROKERS {
            let common = |cluster: &Cluster, data: &Path| {
                vec![
                    "--listen".to_owned(),
                    cluster.client_address(i),
                    "--internal-listen".to_owned(),
                    cluster.internal_address(i),
                    "--data-dir".to_owned(),
                    data.display().to_string(),
                    "--cluster-secret-file".to_owned(),
                    secret.display().to_string(),
                ]
            };
            let (role, args) = if i < CONTROLLERS {
                let data = root.join(format!("controller-{}", i + 1));
                let mut args = vec!["--node-id".to_owned(), (i + 1).to_string()];
                args.extend(common(&cluster, &data));
                args.extend(["--peers".to_owned(), peers.clone()]);
                ("controller", args)
            } else {
                let id = i - CONTROLLERS + 1;
                let data = cluster.broker_data_dir(id);
                std::fs::create_dir_all(&data).context("broker data dir")?;
                let image = root.join(format!("broker-{id}.ext4"));
                std::fs::File::create(&image)
                    .and_then(|f| f.set_len(BROKER_DISK_BYTES))
                    .context("disk image")?;
                let image = image.display().to_string();
                // No blocks reserved for root: the brokers run as root, and a full disk must be
                // full for them.
                netns::run("mkfs.ext4", &["-q", "-F", "-m", "0", &image])?;
                netns::run(
                    "mount",
                    &["-o", "loop", &image, &data.display().to_string()],
                )?;
                cluster.mounts.push(data.clone());
                let mut args = vec!["--broker-id".to_owned(), id.to_string()];
                args.extend(common(&cluster, &data));
                args.extend(["--controllers".to_owned(), controllers.clone()]);
                ("broker", args)
            };
            let log = root.join(format!("{}.log", cluster.name(i)));
            cluster.nodes.push(Node {
                role,
                args,
                state: State::Down,
                log,
                unexpected_exits: Vec::new(),
            });
        }
        // Controllers first (brokers register with them), all in parallel per role.
        for range in [0..CONTROLLERS, CONTROLLERS..CONTROLLERS + BROKERS] {
            let waits: Vec<(usize, mpsc::Receiver<String>)> = range
                .map(|i| cluster.spawn(i).map(|rx| (i, rx)))
                .collect::<Result<_>>()?;
            for (i, rx) in waits {
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match rx.recv_timeout(left) {
                        Ok(line) if line.contains(" ready on ") => break,
                        Ok(_) => {}
                        Err(_) => bail!(
                            "{} did not become ready; log tail:\n{}",
                            cluster.name(i),
                            cluster.log_tail(i)
                        ),
                    }
                }
            }
        }
        Ok(cluster)
    }

    /// `controller-N` or `broker-N`.
    pub fn name(&self, i: usize) -> String {
        if i < CONTROLLERS {
            format!("controller-{}", i + 1)
        } else {
            format!("broker-{}", i - CONTROLLERS + 1)
        }
    }

    /// Node `i`'s client address.
    pub fn client_address(&self, i: usize) -> String {
        format!("{}:{CLIENT_PORT}", self.net.nodes[i].ip)
    }

    /// Node `i`'s internal address.
    pub fn internal_address(&self, i: usize) -> String {
        format!("{}:{INTERNAL_PORT}", self.net.nodes[i].ip)
    }

    /// The brokers' client addresses: what clients bootstrap from.
    pub fn bootstrap(&self) -> Vec<String> {
        (CONTROLLERS..CONTROLLERS + BROKERS)
            .map(|i| self.client_address(i))
            .collect()
    }

    /// The controllers' client addresses.
    pub fn controller_addresses(&self) -> Vec<String> {
        (0..CONTROLLERS).map(|i| self.client_address(i)).collect()
    }

    /// Broker `id`'s (1-based) data directory: the mount point of its disk.
    pub fn broker_data_dir(&self, id: usize) -> PathBuf {
        self.root.join(format!("broker-{id}"))
    }

    /// The file that fills broker `id`'s disk.
    fn filler(&self, id: usize) -> PathBuf {
        self.broker_data_dir(id).join("nemesis-filler")
    }

    /// Starts node `i` (it must be down); returns its stdout lines.
    fn spawn(&mut self, i: usize) -> Result<mpsc::Receiver<String>> {
        assert!(matches!(self.nodes[i].state, State::Down), "node is down");
        let fd = self.net.namespace_fd(i)?;
        let node = &self.nodes[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)
            .context("node log")?;
        let mut cmd = Command::new(super::binary());
        cmd.arg(node.role)
            .args(&node.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .env("RUST_LOG", "info,openraft=warn");
        for (k, v) in ENV {
            cmd.env(k, v);
        }
        // SAFETY: the closure only calls setns(2) and prctl(2), which are
        // async-signal-safe. PR_SET_PDEATHSIG: should the test process die without
        // unwinding (kill -9, SIGBUS), the kernel kills its nodes too.
        unsafe {
            cmd.pre_exec(move || {
                netns::enter(&fd)?;
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawn {}", self.name(i)))?;
        let stdout = child.stdout.take().context("stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    // Nobody listens any more; keep draining so the node never blocks.
                    continue;
                }
            }
        });
        self.nodes[i].state = State::Running(child);
        Ok(rx)
    }

    /// Notes a node that exited by itself (a crash) and marks it down.
    pub fn reap_crashed(&mut self) {
        for i in 0..self.nodes.len() {
            let exited = match &mut self.nodes[i].state {
                State::Running(child) | State::Paused(child) => child.try_wait().ok().flatten(),
                State::Down => None,
            };
            if let Some(status) = exited {
                let line = format!("{} exited by itself: {status}", self.name(i));
                eprintln!("nemesis: {line}; log tail:\n{}", self.log_tail(i));
                self.nodes[i].unexpected_exits.push(line);
                self.nodes[i].state = State::Down;
            }
        }
    }

    /// Every crash noticed so far.
    pub fn unexpected_exits(&self) -> Vec<String> {
        self.nodes
            .iter()
            .flat_map(|n| n.unexpected_exits.iter().cloned())
            .collect()
    }

    /// kill -9 node `i` (resumed or not) and reap it.
    pub fn kill9(&mut self, i: usize) {
        if let State::Running(mut child) | State::Paused(mut child) =
            std::mem::replace(&mut self.nodes[i].state, State::Down)
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts node `i` again if it is down; does not wait for it to serve.
    pub fn restart(&mut self, i: usize) -> Result<()> {
        self.reap_crashed();
        if matches!(self.nodes[i].state, State::Down) {
            self.spawn(i)?;
        }
        Ok(())
    }

    /// SIGSTOP node `i`.
    pub fn pause(&mut self, i: usize) {
        if let State::Running(child) = std::mem::replace(&mut self.nodes[i].state, State::Down) {
            signal(&child, libc::SIGSTOP);
            self.nodes[i].state = State::Paused(child);
        }
    }

    /// SIGCONT node `i` if paused.
    pub fn resume(&mut self, i: usize) {
        match std::mem::replace(&mut self.nodes[i].state, State::Down) {
            State::Paused(child) => {
                signal(&child, libc::SIGCONT);
                self.nodes[i].state = State::Running(child);
            }
            other => self.nodes[i].state = other,
        }
    }

    /// Resumes every paused node and starts every node that is down.
    pub fn resume_and_restart_all(&mut self) -> Result<()> {
        for i in 0..self.nodes.len() {
            self.resume(i);
            self.restart(i)?;
        }
        Ok(())
    }

    /// SIGTERM node `i` and wait (bounded) for it to exit; kill -9 after 30 s.
    pub fn terminate(&mut self, i: usize) -> Result<()> {
        self.resume(i);
        let State::Running(mut child) = std::mem::replace(&mut self.nodes[i].state, State::Down)
        else {
            return Ok(());
        };
        signal(&child, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().context("wait")? {
                if !status.success() {
                    bail!("{} exited with {status} on SIGTERM", self.name(i));
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{} ignored SIGTERM for 30 s", self.name(i));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Fills broker `id`'s disk: a file takes every free byte. Returns the bytes left.
    pub fn fill_disk(&self, id: usize) -> Result<u64> {
        let dir = self.broker_data_dir(id);
        let free = free_bytes(&dir)?;
        let path = self.filler(id);
        let file = std::fs::File::create(&path).context("filler")?;
        // Allocate the free space in steps; the last one fails with ENOSPC, which is the
        // point.
        let step: u64 = 4 << 20;
        let mut allocated: u64 = 0;
        while allocated < free + step {
            let len = step as libc::off_t;
            // SAFETY: fallocate(2) on a file we opened for writing.
            let rc = unsafe {
                libc::fallocate(
                    std::os::fd::AsRawFd::as_raw_fd(&file),
                    0,
                    allocated as libc::off_t,
                    len,
                )
            };
            if rc != 0 {
                break;
            }
            allocated += step;
        }
        // Whatever is left (less than a step) goes too, one page at a time.
        loop {
            // SAFETY: as above.
            let rc = unsafe {
                libc::fallocate(
                    std::os::fd::AsRawFd::as_raw_fd(&file),
                    0,
                    allocated as libc::off_t,
                    4096,
                )
            };
            if rc != 0 || allocated > free + step {
                break;
            }
            allocated += 4096;
        }
        free_bytes(&dir)
    }

    /// Frees broker `id`'s disk.
    pub fn free_disk(&self, id: usize) {
        let _ = std::fs::remove_file(self.filler(id));
    }

    /// The last lines of node `i`'s log.
    pub fn log_tail(&self, i: usize) -> String {
        let text = std::fs::read_to_string(&self.nodes[i].log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Keeps the data and logs after the run (for a failing seed); returns where.
    pub fn keep_files(&mut self) -> PathBuf {
        if let Some(dir) = self.dir.take() {
            let _ = std::fs::write(
                dir.path().join(KEPT_MARKER),
                "kept: the run found anomalies\n",
            );
            let _ = dir.keep();
        }
        self.root.clone()
    }

    /// Kills every process (no reaping wait beyond SIGKILL's).
    fn kill_all(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill9(i);
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_all();
        for mount in self.mounts.drain(..).rev() {
            let path = mount.display().to_string();
            // The loop device goes with the last unmount (mount -o loop sets autoclear).
            if netns::run("umount", &[&path]).is_err() {
                if let Err(e) = netns::run("umount", &["-l", &path]) {
                    eprintln!("nemesis: {e}");
                }
            }
        }
    }
}

/// Cleans up after runs whose process died without unwinding (kill -9): unmounts the
/// broker disks of run directories whose pid is gone (their nodes died with
/// them, see PR_SET_PDEATHSIG), removes those directories, and deletes their network
/// namespaces.
pub fn remove_stale_runs() {
    let alive = |pid: &str| Path::new("/proc").join(pid).exists();
    let tmp = std::env::temp_dir();
    if let Ok(entries) = std::fs::read_dir(&tmp) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(DIR_PREFIX) else {
                continue;
            };
            let Some((pid, _)) = rest.split_once('-') else {
                continue;
            };
            if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) || alive(pid) {
                continue;
            }
            for id in 1..=BROKERS {
                let mount = e.path().join(format!("broker-{id}"));
                let _ = netns::run("umount", &["-l", &mount.display().to_string()]);
            }
            // A run that found an anomaly kept its files on purpose.
            if !e.path().join(KEPT_MARKER).exists() {
                eprintln!("nemesis: removing the stale run {}", e.path().display());
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    netns::remove_stale_namespaces(alive);
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
    unsafe {
        libc::kill(child.id() as i32, signal);
    }
}

fn free_bytes(dir: &Path) -> Result<u64> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).context("path")?;
    // SAFETY: statvfs(3) with a valid C string and an out struct.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        bail!(
            "statvfs {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(s.f_bfree as u64 * s.f_frsize as u64)
}
