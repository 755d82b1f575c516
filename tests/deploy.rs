//! The deployment files under `deploy/`, for real: builds the container image from the
//! binary under test with `deploy/build-image`, starts `deploy/docker-compose.yml` (3
//! controllers, 3 brokers) under a project name of its own with every published port moved
//! to a free port on 127.0.0.1, waits until every node is ready (HTTP `/health/ready` on
//! the published ports and the containers' own health checks), then creates a topic with
//! replication factor 3 and produces and consumes through the published broker ports with
//! the tidelog CLI on the host, restarts a broker and reads everything again. The project
//! is taken down with its volumes (`down -v`) whatever happens, by a guard's `Drop`.
//!
//! Needs a Docker daemon and Compose (`docker compose` or `docker-compose`). Without them
//! the test prints why and passes, unless `DEPLOY_REQUIRE=1`: then it fails.

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{binary, cli, free_ports, http_get};

/// The image the compose file runs; `deploy/build-image` tags it.
const IMAGE: &str = "tidelog:local";

/// How long the cluster may take to become ready (six debug-build containers on 2 cores).
const READY_WITHIN: Duration = Duration::from_secs(240);

fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

/// Runs `program args` to completion; `None` when it cannot be started at all.
fn run(program: &str, args: &[&str]) -> Option<Output> {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .ok()
}

/// The Compose command line (`docker compose` or `docker-compose`), or why there is none.
fn compose_command() -> Result<Vec<String>, String> {
    match run("docker", &["info", "--format", "{{.ServerVersion}}"]) {
        Some(out) if out.status.success() => {}
        Some(out) => {
            return Err(format!(
                "the Docker daemon does not answer: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
        None => return Err("docker is not installed".to_owned()),
    }
    if run("docker", &["compose", "version"]).is_some_and(|o| o.status.success()) {
        return Ok(vec!["docker".into(), "compose".into()]);
    }
    if run("docker-compose", &["version"]).is_some_and(|o| o.status.success()) {
        return Ok(vec!["docker-compose".into()]);
    }
    Err("neither `docker compose` nor `docker-compose` works".to_owned())
}

/// The Compose command line, or `None` (after saying why) when the test cannot run here.
fn compose_or_skip() -> Option<Vec<String>> {
    match compose_command() {
        Ok(compose) => Some(compose),
        Err(why) => {
            assert!(
                std::env::var("DEPLOY_REQUIRE").as_deref() != Ok("1"),
                "DEPLOY_REQUIRE=1 but {why}"
            );
            eprintln!("skipping: {why} (set DEPLOY_REQUIRE=1 to make this a failure)");
            None
        }
    }
}

/// One Compose project from `deploy/docker-compose.yml`; taken down with its volumes and
/// network on drop, even when the test panics.
struct Project {
    compose: Vec<String>,
    name: String,
    /// The `TLDEPLOY_*` variables the compose file reads (ports, secret file).
    env: Vec<(String, String)>,
    /// Holds the cluster secret file.
    _dir: tempfile::TempDir,
}

impl Project {
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.compose[0]);
        cmd.args(&self.compose[1..])
            .args(["-p", self.name.as_str()])
            .args(args)
            .current_dir(deploy_dir())
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null());
        cmd
    }

    /// Runs a Compose subcommand; panics (with its output and the logs) if it fails.
    fn run(&self, args: &[&str]) -> String {
        let out = self.command(args).output().expect("run compose");
        assert!(
            out.status.success(),
            "compose {args:?} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The last lines every container logged.
    fn logs(&self) -> String {
        self.command(&["logs", "--no-color", "--tail", "30"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// Health of every container of the project, from its health check.
    fn health(&self) -> Vec<String> {
        let ids = self.run(&["ps", "-q"]);
        ids.split_whitespace()
            .map(|id| {
                run(
                    "docker",
                    &["inspect", "--format", "{{.State.Health.Status}}", id],
                )
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
                .unwrap_or_default()
            })
            .collect()
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- container logs ---\n{}", self.logs());
        }
        match self
            .command(&["down", "-v", "--remove-orphans", "--timeout", "10"])
            .output()
        {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "compose down failed for project {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("compose down for project {}: {e}", self.name),
        }
    }
}

/// Waits (bounded) until `check` holds; panics with `what` if not (the project's guard
/// then prints the containers' logs).
fn wait_until(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for: {what}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `GET /health/ready` at `address` answers 200.
fn ready(address: &str) -> bool {
    matches!(http_get(address, "/health/ready"), Ok((200, _)))
}

/// Produces `values` (one record each) to `partition` with acks=all through `bootstrap`.
fn produce(bootstrap: &str, topic: &str, partition: u32, values: &[String]) {
    let partition = partition.to_string();
    let mut child = Command::new(binary())
        .args(["produce", "--topic", topic, "--acks", "all"])
        .args(["--partition", partition.as_str()])
        .args(["--bootstrap", bootstrap, "--timeout-ms", "60000"])
        .env_remove("TIDELOG_BOOTSTRAP")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tidelog produce");
    {
        let mut stdin = child.stdin.take().expect("stdin");
        for v in values {
            writeln!(stdin, "{v}").expect("write record");
        }
    }
    let out = child.wait_with_output().expect("wait for produce");
    assert!(
        out.status.success(),
        "produce failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every value of `topic` read from the beginning through `bootstrap`.
fn consume_all(bootstrap: &str, topic: &str, n: usize) -> BTreeSet<String> {
    let max = n.to_string();
    let (ok, out, err) = cli(&[
        "consume",
        "--topic",
        topic,
        "--from-beginning",
        "--max-messages",
        &max,
        "--timeout-ms",
        "30000",
        "--bootstrap",
        bootstrap,
    ]);
    assert!(ok, "consume failed: {err}");
    out.lines().map(str::to_owned).collect()
}

#[test]
fn compose_cluster_from_the_image_replicates_and_serves_host_clients() {
    let Some(compose) = compose_or_skip() else {
        return;
    };

    // The image, from the binary this test run built.
    let out = Command::new("bash")
        .arg(deploy_dir().join("build-image"))
        .args([binary(), IMAGE])
        .stdin(Stdio::null())
        .output()
        .expect("run deploy/build-image");
    assert!(
        out.status.success(),
        "deploy/build-image failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Published ports: 3 per broker (gRPC, Kafka, HTTP) and HTTP per controller, all free
    // on 127.0.0.1, so this never collides with another cluster on the machine.
    let ports = free_ports(12);
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = common::secret_file(dir.path());
    // The containers run as uid 65532 and read the secret through a bind mount.
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644))
        .expect("chmod secret");
    let mut env: Vec<(String, String)> = vec![
        ("TLDEPLOY_IMAGE".into(), IMAGE.into()),
        ("TLDEPLOY_HOST".into(), "127.0.0.1".into()),
        ("TLDEPLOY_SECRET_FILE".into(), secret.display().to_string()),
    ];
    let names = [
        "B1_GRPC", "B2_GRPC", "B3_GRPC", "B1_KAFKA", "B2_KAFKA", "B3_KAFKA", "B1_HTTP", "B2_HTTP",
        "B3_HTTP", "C1_HTTP", "C2_HTTP", "C3_HTTP",
    ];
    for (name, port) in names.iter().zip(&ports) {
        env.push((format!("TLDEPLOY_{name}_PORT"), port.to_string()));
    }
    let grpc: Vec<String> = ports[..3]
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    // Brokers 1..=3, then controllers 1..=3.
    let http: Vec<String> = ports[6..]
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let project = Project {
        compose,
        name: format!("tidelog-deploy-test-{}-{millis}", std::process::id()),
        env,
        _dir: dir,
    };

    // Brokers start once the controllers' health checks pass (depends_on).
    project.run(&["up", "-d"]);

    wait_until(
        "/health/ready on every published HTTP port",
        READY_WITHIN,
        || http.iter().all(|a| ready(a)),
    );
    wait_until(
        "three unfenced brokers in cluster describe",
        READY_WITHIN,
        || {
            let (ok, out, _) = cli(&[
                "cluster",
                "describe",
                "--output",
                "json",
                "--request-timeout-ms",
                "5000",
                "--bootstrap",
                &grpc[0],
            ]);
            let Ok(v) = serde_json::from_str::<serde_json::Value>(out.trim()) else {
                return false;
            };
            ok && !v["leader"].is_null()
                && v["brokers"]
                    .as_array()
                    .is_some_and(|b| b.len() == 3 && b.iter().all(|b| b["state"] == "unfenced"))
        },
    );
    // The compose health checks (`tidelog cluster describe` inside each container) pass.
    wait_until("every container healthy", READY_WITHIN, || {
        let health = project.health();
        health.len() == 6 && health.iter().all(|h| h == "healthy")
    });

    let topic = "deploy-orders";
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--topic",
        topic,
        "--partitions",
        "3",
        "--replication-factor",
        "3",
        "--config",
        "min.insync.replicas=2",
        "--bootstrap",
        &grpc[0],
    ]);
    assert!(ok, "topics create failed: {err}");

    // Records go to every partition, so to leaders on all three brokers: bootstrapped from
    // broker 1 alone, the client reaches the others through the addresses they advertise
    // (the published ports).
    let values: Vec<String> = (0..30).map(|i| format!("record-{i}")).collect();
    for (partition, chunk) in values.chunks(10).enumerate() {
        produce(&grpc[0], topic, partition as u32, chunk);
    }
    let expected: BTreeSet<String> = values.iter().cloned().collect();
    assert_eq!(consume_all(&grpc[1], topic, values.len()), expected);

    let (ok, out, err) = cli(&[
        "topics",
        "describe",
        "--topic",
        topic,
        "--output",
        "json",
        "--bootstrap",
        &grpc[2],
    ]);
    assert!(ok, "topics describe failed: {err}");
    let described: serde_json::Value =
        serde_json::from_str(out.trim()).expect("topics describe JSON");
    let partitions = described["topics"][0]["partitions"]
        .as_array()
        .expect("partitions");
    assert_eq!(partitions.len(), 3, "{out}");
    for p in partitions {
        assert_eq!(p["isr"].as_array().map(Vec::len), Some(3), "{out}");
        assert_eq!(p["high_watermark"], 10, "{out}");
    }

    // A broker restarted in place keeps its data (its named volume) and rejoins.
    project.run(&["restart", "broker1"]);
    wait_until("broker1 ready again", READY_WITHIN, || ready(&http[0]));
    assert_eq!(consume_all(&grpc[0], topic, values.len()), expected);
}
