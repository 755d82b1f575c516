//! Harness for tests that run the real `tidelog` binary: free loopback ports, temporary
//! data directories, processes that are always killed and reaped (even on panic), and
//! polling with deadlines instead of sleeps.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use tidelog::api::proto::{BrokerHeartbeatRequest, RegisterBrokerRequest};
use tidelog::client::controller::ControllerClient;
use tidelog::net::node_auth::ClusterSecret;

/// The binary under test.
pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_tidelog")
}

/// `n` distinct free ports on 127.0.0.1 whose default internal ports (+ 100) are free
/// too (bound together, then released). They come from below the kernel's ephemeral range
/// (32768 up), so an outgoing connection of a client cannot take one between this call
/// and the server binding it, and no port is handed out twice in one test process.
pub fn free_ports(n: usize) -> Vec<u16> {
    use std::hash::{BuildHasher, Hasher};
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let mut held = Vec::new();
    let mut ports = Vec::new();
    let state = std::collections::hash_map::RandomState::new();
    let mut attempt = 0u64;
    while ports.len() < n {
        attempt += 1;
        assert!(attempt < 100_000, "no free ports below 32668");
        let mut h = state.build_hasher();
        h.write_u64(attempt);
        let port = 10_000 + (h.finish() % 22_000) as u16;
        if given.contains(&port) || given.contains(&(port + 100)) {
            continue;
        }
        let (Ok(a), Ok(b)) = (
            std::net::TcpListener::bind(("127.0.0.1", port)),
            std::net::TcpListener::bind(("127.0.0.1", port + 100)),
        ) else {
            continue;
        };
        held.push(a);
        held.push(b);
        given.push(port);
        given.push(port + 100);
        ports.push(port);
    }
    ports
}

/// The default internal address of a node whose client address is `address`.
pub fn internal_of(address: &str) -> String {
    let (host, port) = address.rsplit_once(':').expect("host:port");
    format!("{host}:{}", port.parse::<u16>().expect("port") + 100)
}

/// The cluster secret every test cluster shares.
pub const TEST_SECRET: &str = "tidelog test cluster secret 0123456789";

/// Writes [`TEST_SECRET`] into `dir` and returns the file's path.
pub fn secret_file(dir: &Path) -> PathBuf {
    let path = dir.join("cluster.secret");
    std::fs::write(&path, TEST_SECRET).expect("secret file");
    path
}

/// [`TEST_SECRET`], for clients that act as a node.
pub fn node_secret() -> Arc<ClusterSecret> {
    Arc::new(ClusterSecret::from_bytes(TEST_SECRET.as_bytes()).expect("secret"))
}

/// A node's client of the controllers whose client addresses are `controllers`.
pub fn controller_client(controllers: &[String], timeout: Duration) -> ControllerClient {
    ControllerClient::new(
        controllers.iter().map(|a| internal_of(a)).collect(),
        timeout,
        node_secret(),
    )
}

/// Raft timings that keep tests quick without spurious elections on a busy machine.
pub const FAST_RAFT: &[(&str, &str)] = &[
    ("TIDELOG_RAFT_HEARTBEAT_INTERVAL_MS", "100"),
    ("TIDELOG_RAFT_ELECTION_TIMEOUT_MIN_MS", "600"),
    ("TIDELOG_RAFT_ELECTION_TIMEOUT_MAX_MS", "1200"),
];

/// A running `tidelog` process; killed and reaped on drop.
pub struct Proc {
    child: Option<Child>,
    stderr_path: PathBuf,
    /// What it printed after "ready on".
    pub ready_address: String,
}

impl Proc {
    /// Starts `tidelog args...` and waits for `tidelog <role> ready on <ADDR>`. Unless
    /// the test sets `--kafka-listen` or `TIDELOG_KAFKA_LISTEN`, the Kafka listener is
    /// turned off (`none`): standalone's default port 9092 would collide between tests
    /// running in parallel.
    pub fn start(role: &str, args: &[String], envs: &[(&str, &str)], log_dir: &Path) -> Proc {
        let stderr_path = log_dir.join(
            format!(
                "{role}-{}.stderr",
                args.join("_").replace(['/', ':', ','], "")
            )
            .chars()
            .take(120)
            .collect::<String>(),
        );
        let stderr = std::fs::File::create(&stderr_path).expect("stderr file");
        let mut cmd = Command::new(binary());
        cmd.arg(role)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .env("RUST_LOG", "info,openraft=warn")
            // Many servers run at once: no default HTTP port unless a test asks for one.
            .env("TIDELOG_HTTP_LISTEN", "none");
        let kafka_set = args.iter().any(|a| a.starts_with("--kafka-listen"))
            || envs.iter().any(|(k, _)| *k == "TIDELOG_KAFKA_LISTEN");
        if !kafka_set {
            cmd.env("TIDELOG_KAFKA_LISTEN", "none");
        }
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn tidelog");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut proc = Proc {
            child: Some(child),
            stderr_path,
            ready_address: String::new(),
        };
        let prefix = format!("tidelog {role} ready on ");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(addr) = line.strip_prefix(&prefix) {
                        proc.ready_address = addr.trim().to_owned();
                        return proc;
                    }
                }
                Err(_) => {
                    let tail = proc.stderr_tail();
                    panic!("{role} did not become ready; stderr:\n{tail}");
                }
            }
        }
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    /// Everything it wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// The last lines of its stderr.
    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal` (e.g. SIGSTOP, SIGCONT) without waiting.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on the pid of a child this harness spawned and has not reaped.
        unsafe {
            libc::kill(self.pid(), signal);
        }
    }

    /// SIGTERM, then waits (bounded) for a clean exit; returns the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        // SAFETY: as in `signal`.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("process ignored SIGTERM for 20 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// `GET path` over HTTP/1.1 at `address`; returns (status, body).
pub fn http_get(address: &str, path: &str) -> std::io::Result<(u16, String)> {
    http_request(address, "GET", path, &[], "").map(|r| (r.status, r.body))
}

/// An HTTP response: status, headers (names lower-cased) and body.
#[allow(dead_code)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

#[allow(dead_code)]
impl HttpResponse {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request at `address` with extra `headers` (`Host` defaults to `address`)
/// and `body`.
pub fn http_request(
    address: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<HttpResponse> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut request = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        request.push_str(&format!("Host: {address}\r\n"));
    }
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        request.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Ok(HttpResponse {
        status,
        headers,
        body: body.to_owned(),
    })
}

/// Runs a client subcommand to completion; returns (success, stdout, stderr).
pub fn cli(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(binary())
        .args(args)
        .env_remove("TIDELOG_BOOTSTRAP")
        .stdin(Stdio::null())
        .output()
        .expect("run tidelog");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs a client subcommand that must succeed and print one JSON document; returns it.
pub fn cli_json(args: &[&str]) -> serde_json::Value {
    let (ok, out, err) = cli(args);
    assert!(ok, "tidelog {args:?} failed: {err}");
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("tidelog {args:?}: {e}: {out}"))
}

/// Runs a client subcommand with `input` on stdin; returns (success, stdout, stderr).
pub fn cli_stdin(args: &[&str], input: &str) -> (bool, String, String) {
    use std::io::Write;
    let mut child = Command::new(binary())
        .args(args)
        .env_remove("TIDELOG_BOOTSTRAP")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tidelog");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().expect("wait for tidelog");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Polls `check` every 50 ms until it returns `Some`, or panics after `within`.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() > deadline {
            panic!("timed out after {within:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A quorum of `tidelog controller` processes with ids 1..=n.
pub struct Controllers {
    pub dir: tempfile::TempDir,
    pub ports: Vec<u16>,
    pub procs: Vec<Option<Proc>>,
    pub envs: Vec<(String, String)>,
}

impl Controllers {
    /// Starts `n` controllers with `envs` added to [`FAST_RAFT`].
    pub fn start(n: usize, envs: &[(&str, &str)]) -> Controllers {
        Self::start_with(n, envs, true)
    }

    /// Starts `n` controllers with `envs`, on [`FAST_RAFT`] timings or the defaults.
    pub fn start_with(n: usize, envs: &[(&str, &str)], fast_raft: bool) -> Controllers {
        let timings: &[(&str, &str)] = if fast_raft { FAST_RAFT } else { &[] };
        let mut all: Vec<(String, String)> = timings
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        all.extend(envs.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let mut c = Controllers {
            dir: tempfile::tempdir().expect("tempdir"),
            ports: free_ports(n),
            procs: (0..n).map(|_| None).collect(),
            envs: all,
        };
        for id in 1..=n as u64 {
            c.start_node(id);
        }
        c
    }

    /// `1=addr,2=addr,...` of the internal addresses.
    pub fn peers(&self) -> String {
        (1..=self.ports.len() as u64)
            .map(|id| format!("{id}={}", internal_of(&self.address(id))))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The address of controller `id`.
    pub fn address(&self, id: u64) -> String {
        format!("127.0.0.1:{}", self.ports[id as usize - 1])
    }

    /// Addresses of the running controllers.
    pub fn live_addresses(&self) -> Vec<String> {
        (1..=self.ports.len() as u64)
            .filter(|id| self.procs[*id as usize - 1].is_some())
            .map(|id| self.address(id))
            .collect()
    }

    /// The data directory of controller `id`.
    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("controller-{id}"))
    }

    /// The flags controller `id` runs with.
    pub fn args(&self, id: u64) -> Vec<String> {
        vec![
            "--node-id".into(),
            id.to_string(),
            "--listen".into(),
            self.address(id),
            "--peers".into(),
            self.peers(),
            "--data-dir".into(),
            self.data_dir(id).display().to_string(),
            "--cluster-secret-file".into(),
            secret_file(self.dir.path()).display().to_string(),
        ]
    }

    /// (Re)starts controller `id`.
    pub fn start_node(&mut self, id: u64) {
        let envs: Vec<(&str, &str)> = self
            .envs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let proc = Proc::start("controller", &self.args(id), &envs, self.dir.path());
        self.procs[id as usize - 1] = Some(proc);
    }

    /// kill -9 controller `id`.
    pub fn kill9(&mut self, id: u64) {
        if let Some(mut p) = self.procs[id as usize - 1].take() {
            p.kill9();
        }
    }

    /// SIGTERM controller `id`; asserts it exits cleanly.
    pub fn stop(&mut self, id: u64) {
        if let Some(mut p) = self.procs[id as usize - 1].take() {
            let status = p.terminate();
            assert!(
                status.success(),
                "controller {id} exited with {status}: {}",
                p.stderr_tail()
            );
        }
    }
}

/// A broker played by the test: registers, then heartbeats until stopped.
pub struct FakeBroker {
    /// Its broker id.
    pub id: i32,
    /// Its registration epoch.
    pub epoch: u64,
    /// Clear to stop heartbeating (the process "hangs").
    pub beating: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeBroker {
    /// Registers broker `id` through `controllers` (client addresses) and starts
    /// heartbeating every 250 ms.
    pub async fn start(controllers: Vec<String>, id: i32) -> FakeBroker {
        let client = Arc::new(controller_client(&controllers, Duration::from_secs(20)));
        let epoch = client
            .register_broker(RegisterBrokerRequest {
                broker_id: id,
                address: format!("127.0.0.1:{}", 40000 + id),
                internal_address: format!("127.0.0.1:{}", 40100 + id),
                rack: None,
                incarnation_id: uuid::Uuid::new_v4().to_string(),
                kafka_address: None,
            })
            .await
            .expect("register")
            .broker_epoch;
        let beating = Arc::new(AtomicBool::new(true));
        let flag = beating.clone();
        let task = tokio::spawn(async move {
            loop {
                if flag.load(Ordering::SeqCst) {
                    let _ = client
                        .heartbeat(BrokerHeartbeatRequest {
                            broker_id: id,
                            broker_epoch: epoch,
                            metadata_version: 0,
                            want_fence: false,
                            want_shut_down: false,
                            offline_replicas: Vec::new(),
                        })
                        .await;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
        FakeBroker {
            id,
            epoch,
            beating,
            task,
        }
    }
}

impl Drop for FakeBroker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A controller quorum and `n` brokers on loopback. A broker may reach the controllers
/// through its own [`LinkProxy`], so a test can cut it off from them alone.
pub struct BrokerCluster {
    /// Extra environment for every process (e.g. replication timings).
    pub extra_env: Vec<(String, String)>,
    pub dir: tempfile::TempDir,
    pub controllers: Controllers,
    pub broker_ports: Vec<u16>,
    /// Per broker: its HTTP port (metrics, health).
    pub http_ports: Vec<u16>,
    /// Per broker: its Kafka listener's port.
    pub kafka_ports: Vec<u16>,
    pub brokers: Vec<Option<Proc>>,
    /// Per broker: the proxy its controller links go through, when it has one.
    pub links: Vec<Option<LinkProxy>>,
    /// Per broker: its `--rack` (empty: none given).
    pub racks: Vec<String>,
}

/// Broker session timings for tests: fencing within seconds.
pub const SESSION: &[(&str, &str)] = &[
    ("TIDELOG_BROKER_SESSION_TIMEOUT_MS", "3000"),
    ("TIDELOG_BROKER_HEARTBEAT_INTERVAL_MS", "300"),
];

impl BrokerCluster {
    /// Starts a controller and brokers 1..=n.
    pub fn start(n: usize) -> Self {
        Self::start_with(n, &[])
    }

    /// Like [`BrokerCluster::start`], with extra environment for every process.
    pub fn start_with(n: usize, env: &[(&str, &str)]) -> Self {
        Self::build(1, n, env, false)
    }

    /// `controllers` controllers and brokers 1..=n; with `proxied`, every broker reaches
    /// the controllers through its own [`LinkProxy`] (needs a Tokio runtime).
    pub fn build(controllers: usize, n: usize, env: &[(&str, &str)], proxied: bool) -> Self {
        Self::build_in_racks(controllers, n, env, proxied, &[])
    }

    /// [`BrokerCluster::build`] with broker `i + 1` in rack `racks[i]`.
    pub fn build_in_racks(
        controllers: usize,
        n: usize,
        env: &[(&str, &str)],
        proxied: bool,
        racks: &[&str],
    ) -> Self {
        let envs: Vec<(&str, &str)> = SESSION.iter().chain(env.iter()).copied().collect();
        let controllers = Controllers::start(controllers, &envs);
        let links = (0..n)
            .map(|_| {
                proxied.then(|| {
                    LinkProxy::start(
                        (1..=controllers.ports.len() as u64)
                            .map(|id| internal_of(&controllers.address(id)))
                            .collect(),
                    )
                })
            })
            .collect();
        let ports = free_ports(3 * n);
        let mut c = BrokerCluster {
            dir: tempfile::tempdir().unwrap(),
            controllers,
            // One call: its ports (and their internal ports, + 100) are all distinct.
            broker_ports: ports[..n].to_vec(),
            http_ports: ports[n..2 * n].to_vec(),
            kafka_ports: ports[2 * n..].to_vec(),
            brokers: (0..n).map(|_| None).collect(),
            links,
            racks: racks.iter().map(|r| r.to_string()).collect(),
            extra_env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        for id in 1..=n as i32 {
            c.start_broker(id);
        }
        c
    }

    fn envs(&self) -> Vec<(&str, &str)> {
        FAST_RAFT
            .iter()
            .chain(SESSION.iter())
            .copied()
            .chain(self.extra_env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .collect()
    }

    /// The first controller's address.
    pub fn controller_address(&self) -> String {
        self.controllers.address(1)
    }

    /// Every controller's address.
    pub fn controller_addresses(&self) -> Vec<String> {
        (1..=self.controllers.ports.len() as u64)
            .map(|id| self.controllers.address(id))
            .collect()
    }

    /// Every controller's internal address (what brokers' `--controllers` names).
    pub fn controller_internal_addresses(&self) -> Vec<String> {
        self.controller_addresses()
            .iter()
            .map(|a| internal_of(a))
            .collect()
    }

    /// The cluster secret file's flag, for nodes a test starts itself.
    pub fn secret_args(&self) -> Vec<String> {
        vec![
            "--cluster-secret-file".into(),
            secret_file(self.dir.path()).display().to_string(),
        ]
    }

    /// Broker `id`'s HTTP port (metrics, health).
    pub fn broker_http_address(&self, id: i32) -> String {
        format!("127.0.0.1:{}", self.http_ports[id as usize - 1])
    }

    /// Broker `id`'s Kafka listener.
    pub fn broker_kafka_address(&self, id: i32) -> String {
        format!("127.0.0.1:{}", self.kafka_ports[id as usize - 1])
    }

    /// See the name.
    pub fn broker_address(&self, id: i32) -> String {
        format!("127.0.0.1:{}", self.broker_ports[id as usize - 1])
    }

    /// See the name.
    pub fn start_broker(&mut self, id: i32) {
        let controllers = match &self.links[id as usize - 1] {
            Some(proxy) => proxy.addresses.join(","),
            None => self.controller_internal_addresses().join(","),
        };
        let mut args = vec![
            "--broker-id".into(),
            id.to_string(),
            "--listen".into(),
            self.broker_address(id),
            "--controllers".into(),
            controllers,
            "--data-dir".into(),
            self.dir
                .path()
                .join(format!("broker-{id}"))
                .display()
                .to_string(),
        ];
        args.extend(self.secret_args());
        args.extend(["--http-listen".into(), self.broker_http_address(id)]);
        args.extend(["--kafka-listen".into(), self.broker_kafka_address(id)]);
        if let Some(rack) = self.racks.get(id as usize - 1) {
            args.extend(["--rack".into(), rack.clone()]);
        }
        self.brokers[id as usize - 1] =
            Some(Proc::start("broker", &args, &self.envs(), self.dir.path()));
    }

    /// See the name.
    pub fn bootstrap(&self) -> Vec<String> {
        (1..=self.brokers.len() as i32)
            .map(|id| self.broker_address(id))
            .collect()
    }
}

/// A TCP proxy on loopback in front of some addresses (one listening port each) that a
/// test can cut, like a network partition: while cut, open connections stop carrying
/// bytes and new ones are accepted but never answered (so calls time out, as across a
/// real partition); on healing, the held connections are closed and new ones pass.
pub struct LinkProxy {
    /// The proxy's addresses, one per target, in order.
    pub addresses: Vec<String>,
    cut: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl LinkProxy {
    /// Proxies `targets`; must be called within a Tokio runtime.
    pub fn start(targets: Vec<String>) -> LinkProxy {
        let (cut, _) = tokio::sync::watch::channel(false);
        let mut addresses = Vec::new();
        let mut tasks = Vec::new();
        for target in targets {
            let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            std_listener.set_nonblocking(true).expect("nonblocking");
            addresses.push(std_listener.local_addr().unwrap().to_string());
            let listener = tokio::net::TcpListener::from_std(std_listener).expect("listener");
            let cut_rx = cut.subscribe();
            tasks.push(tokio::spawn(async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    let _ = inbound.set_nodelay(true);
                    tokio::spawn(Self::serve(inbound, target.clone(), cut_rx.clone()));
                }
            }));
        }
        LinkProxy {
            addresses,
            cut,
            tasks,
        }
    }

    /// Stops carrying traffic.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Carries traffic again.
    pub fn heal(&self) {
        self.cut.send_replace(false);
    }

    async fn serve(
        inbound: tokio::net::TcpStream,
        target: String,
        mut cut: tokio::sync::watch::Receiver<bool>,
    ) {
        if *cut.borrow() {
            // Accepted during a partition: never answered; closed on healing.
            let _ = cut.wait_for(|c| !*c).await;
            return;
        }
        let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
            return;
        };
        let _ = outbound.set_nodelay(true);
        let (mut in_read, mut in_write) = inbound.into_split();
        let (mut out_read, mut out_write) = outbound.into_split();
        tokio::select! {
            _ = tokio::io::copy(&mut in_read, &mut out_write) => return,
            _ = tokio::io::copy(&mut out_read, &mut in_write) => return,
            _ = cut.wait_for(|c| *c) => {}
        }
        // Cut: hold both connections without carrying a byte until healed.
        let _ = cut.wait_for(|c| !*c).await;
    }
}

impl Drop for LinkProxy {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        // Wakes held connections so they close.
        self.cut.send_replace(false);
    }
}

/// A standalone server on `port` with its data under `dir`, fast Raft timings and `extra`
/// environment.
pub fn standalone_with(dir: &Path, port: u16, extra: &[(&str, &str)]) -> Proc {
    let args = vec![
        "--data-dir".to_owned(),
        dir.join("data").display().to_string(),
        "--listen".to_owned(),
        format!("127.0.0.1:{port}"),
    ];
    let env: Vec<(&str, &str)> = FAST_RAFT.iter().chain(extra.iter()).copied().collect();
    Proc::start("standalone", &args, &env, dir)
}

/// A standalone server on `port` with its data under `dir`.
pub fn standalone(dir: &Path, port: u16) -> Proc {
    standalone_with(dir, port, &[])
}

/// Every record of `topic` (partitions `0..partitions`) from the earliest offset, as
/// (partition, offset, value), reading until four polls in a row bring nothing.
pub async fn read_all(
    bootstrap: &[String],
    topic: &str,
    partitions: u32,
) -> Vec<(u32, i64, String)> {
    let mut consumer =
        tidelog::client::consumer::Consumer::new(bootstrap.to_vec(), Duration::from_secs(20));
    for p in 0..partitions {
        consumer
            .assign(topic, p, tidelog::client::consumer::StartAt::Earliest)
            .await
            .expect("assign");
    }
    let mut out = Vec::new();
    let mut idle = 0;
    while idle < 4 {
        let batch = consumer
            .poll(Duration::from_millis(300))
            .await
            .expect("poll");
        idle = if batch.is_empty() { idle + 1 } else { 0 };
        for r in batch {
            out.push((
                r.partition,
                r.offset,
                String::from_utf8_lossy(&r.value.unwrap()).into_owned(),
            ));
        }
    }
    out
}

/// Runs `tidelog args` with `envs` until it exits or `within` passes (then kills it);
/// returns (exited successfully, exited at all, stderr, elapsed).
pub fn run_to_exit(
    args: &[&str],
    envs: &[(&str, &str)],
    within: Duration,
) -> (bool, bool, String, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let err_path = dir.path().join("stderr");
    let started = Instant::now();
    let mut child = Command::new(binary())
        .args(args)
        .envs(envs.iter().copied())
        .env_remove("TIDELOG_BOOTSTRAP")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .expect("spawn tidelog");
    let (ok, exited) = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break (status.success(), true);
        }
        if started.elapsed() > within {
            let _ = child.kill();
            let _ = child.wait();
            break (false, false);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    (ok, exited, stderr, started.elapsed())
}

/// One fetch of `topic`-0 at `offset` from the broker at `address`; asserts it succeeded
/// and returns the records as (offset, value) with how long the broker held the request.
pub async fn fetch_partition0(
    address: &str,
    topic: &str,
    offset: i64,
    max_wait_ms: u32,
    min_bytes: u32,
) -> (Vec<(i64, String)>, Duration) {
    use tidelog::api::proto::broker_client::BrokerClient;
    use tidelog::api::proto::{FetchPartition, FetchRequest, FetchTopic};
    let mut client = BrokerClient::connect(format!("http://{address}"))
        .await
        .expect("connect");
    let started = Instant::now();
    let r = client
        .fetch(FetchRequest {
            max_wait_ms,
            min_bytes,
            topics: vec![FetchTopic {
                topic: topic.to_owned(),
                partitions: vec![FetchPartition {
                    partition: 0,
                    fetch_offset: offset,
                    partition_max_bytes: 0,
                }],
            }],
            ..Default::default()
        })
        .await
        .expect("fetch")
        .into_inner();
    let p = &r.topics[0].partitions[0];
    assert_eq!(p.error_code, 0, "fetch of {topic}-0: {}", p.error_message);
    let records = p
        .records
        .iter()
        .map(|r| {
            let value = String::from_utf8_lossy(r.value.as_deref().unwrap_or_default());
            (r.offset, value.into_owned())
        })
        .collect();
    (records, started.elapsed())
}

/// A test venv's directory: `$<env_var>`, else `${XDG_CACHE_HOME:-~/.cache}/tidelog/<name>`
/// (where the `.ci/` install scripts make it).
#[allow(dead_code)]
pub fn venv_dir(env_var: &str, name: &str) -> PathBuf {
    std::env::var(env_var)
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            let cache = std::env::var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|_| {
                    PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache")
                });
            cache.join("tidelog").join(name)
        })
}

/// Whether a test's outside tools are there (`why` says what is missing): when not, the
/// test says so and skips, unless `require_var` is set (CI), which fails it instead.
#[allow(dead_code)]
pub fn available(why: Option<String>, require_var: &str, install: &str) -> bool {
    let Some(why) = why else {
        return true;
    };
    assert!(
        std::env::var(require_var).is_err(),
        "{require_var} is set but {why} (run {install})"
    );
    eprintln!("skipping: {why} (run {install} to install it)");
    false
}

/// Bytes `tidelog_bytes_out_total` counts for `topic` at the broker whose HTTP port is
/// `http` (what it served to consumers).
pub fn bytes_out(http: &str, topic: &str) -> f64 {
    let (status, body) = http_get(http, "/metrics").expect("GET /metrics");
    assert_eq!(status, 200);
    let label = format!("topic=\"{topic}\"");
    body.lines()
        .filter(|l| l.starts_with("tidelog_bytes_out_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A standalone server holding `topic` (`partitions` partitions, one replica): its data
/// directory (removed on drop), the process and its address.
pub async fn server_with_topic(topic: &str, partitions: u32) -> (tempfile::TempDir, Proc, String) {
    let dir = tempfile::tempdir().unwrap();
    let port = free_ports(1)[0];
    let server = standalone(dir.path(), port);
    let bootstrap = format!("127.0.0.1:{port}");
    tidelog::client::AdminClient::new(vec![bootstrap.clone()], Duration::from_secs(10))
        .create_topic(topic, Some(partitions), Some(1), Default::default())
        .await
        .unwrap();
    (dir, server, bootstrap)
}

/// [`bytes_out`] of `topic` at each broker of `c`, in broker id order.
pub fn bytes_out_per_broker(c: &BrokerCluster, topic: &str) -> Vec<f64> {
    (1..=c.brokers.len() as i32)
        .map(|id| bytes_out(&c.broker_http_address(id), topic))
        .collect()
}
