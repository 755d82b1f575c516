//! The web console with real processes: in headless Chromium driven by selenium (create a
//! topic, produce through the form, browse records, a markup value shown as text, a
//! group's lag, delete after confirmation; screenshots of each page), and its forms'
//! CSRF protection over raw HTTP.
//!
//! The browser comes from `.ci/browser` (Debian's chromium and chromium-driver; a venv with
//! selenium at `$BROWSER_VENV`, default `~/.cache/tidelog/browser-venv`). Without them the
//! browser test prints why and passes, unless `CONSOLE_BROWSER_REQUIRE=1` (CI sets it):
//! then it fails.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{binary, cli, free_ports, http_request, Proc, FAST_RAFT};

/// The venv's Python with selenium, or why there is none.
fn browser_python() -> Option<PathBuf> {
    let venv = common::venv_dir("BROWSER_VENV", "browser-venv");
    let python = venv.join("bin/python");
    let why = if !Path::new("/usr/bin/chromium").exists()
        || !Path::new("/usr/bin/chromedriver").exists()
    {
        Some("chromium or chromium-driver is not installed".to_owned())
    } else if !Command::new(&python)
        .args(["-c", "import selenium"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        Some(format!("no venv with selenium at {}", venv.display()))
    } else {
        None
    };
    common::available(why, "CONSOLE_BROWSER_REQUIRE", ".ci/browser").then_some(python)
}

/// A standalone with its client and HTTP addresses.
struct Server {
    _proc: Proc,
    grpc: String,
    http: String,
    dir: tempfile::TempDir,
}

fn start() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let ports = free_ports(2);
    let (grpc, http) = (
        format!("127.0.0.1:{}", ports[0]),
        format!("127.0.0.1:{}", ports[1]),
    );
    let args = vec![
        "--data-dir".to_owned(),
        dir.path().join("data").display().to_string(),
        "--listen".to_owned(),
        grpc.clone(),
        "--http-listen".to_owned(),
        http.clone(),
        "--kafka-listen".to_owned(),
        "none".to_owned(),
    ];
    let mut env = FAST_RAFT.to_vec();
    // Browsing a missing topic must not create it even where producers may.
    env.push(("TIDELOG_AUTO_CREATE_TOPICS_ENABLE", "true"));
    let proc = Proc::start("standalone", &args, &env, dir.path());
    Server {
        _proc: proc,
        grpc,
        http,
        dir,
    }
}

/// Produces `lines` (one record each) to `topic` through the CLI.
fn produce(bootstrap: &str, topic: &str, lines: &[&str]) {
    let mut child = Command::new(binary())
        .args(["produce", "--bootstrap", bootstrap, "--topic", topic])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    for l in lines {
        writeln!(stdin, "{l}").unwrap();
    }
    drop(stdin);
    assert!(child.wait().unwrap().success(), "produce failed");
}

#[test]
fn the_console_works_in_a_real_browser_and_shows_records_as_text() {
    let Some(python) = browser_python() else {
        return;
    };
    let server = start();
    let (ok, _, err) = cli(&[
        "topics",
        "create",
        "--bootstrap",
        &server.grpc,
        "--topic",
        "lagged",
        "--partitions",
        "1",
    ]);
    assert!(ok, "{err}");
    let values: Vec<String> = (0..10).map(|i| format!("v{i}")).collect();
    produce(
        &server.grpc,
        "lagged",
        &values.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    // A group that read 4 of 10 records: lag 6.
    let (ok, out, err) = cli(&[
        "consume",
        "--bootstrap",
        &server.grpc,
        "--topic",
        "lagged",
        "--group",
        "readers",
        "--from-beginning",
        "--max-messages",
        "4",
        "--timeout-ms",
        "10000",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 4, "{out}");

    let shots = server.dir.path().join("screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/console_browser.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(format!("http://{}", server.http))
        .arg(&shots)
        .args(["readers", "6"])
        .output()
        .expect("run the browser script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "browser script failed:\n{stdout}\n{stderr}"
    );
    for page in [
        "overview",
        "topics",
        "topic",
        "messages",
        "messages-hex",
        "group",
        "deleted",
    ] {
        let png = shots.join(format!("{page}.png"));
        let size = std::fs::metadata(&png).map(|m| m.len()).unwrap_or(0);
        assert!(size > 1000, "no screenshot of {page} at {}", png.display());
    }
    eprintln!("{stdout}screenshots in {}", shots.display());
    if let Ok(keep) = std::env::var("CONSOLE_SCREENSHOTS") {
        for entry in std::fs::read_dir(&shots).unwrap().flatten() {
            let _ = std::fs::copy(entry.path(), Path::new(&keep).join(entry.file_name()));
        }
    }
}

/// The browser id and CSRF token a console page hands out.
fn session(http: &str) -> (String, String) {
    let page = http_request(http, "GET", "/topics", &[], "").unwrap();
    assert_eq!(page.status, 200, "{}", page.body);
    let cookie = page
        .header("set-cookie")
        .and_then(|c| c.split(';').next())
        .expect("a console cookie")
        .to_owned();
    let marker = "name=\"csrf\" value=\"";
    let at = page.body.find(marker).expect("a CSRF field") + marker.len();
    let token = page.body[at..at + 64].to_owned();
    (cookie, token)
}

/// Posts the create-topic form `body` with the browser `cookie` and `extra` headers.
fn post_create(
    http: &str,
    cookie: Option<&str>,
    extra: &[(&str, &str)],
    body: &str,
) -> common::HttpResponse {
    let mut headers = vec![("Content-Type", "application/x-www-form-urlencoded")];
    if let Some(c) = cookie {
        headers.push(("Cookie", c));
    }
    headers.extend_from_slice(extra);
    http_request(http, "POST", "/topics", &headers, body).unwrap()
}

fn create(http: &str, cookie: Option<&str>, token: &str, name: &str) -> u16 {
    let body = format!("csrf={token}&name={name}&partitions=1");
    post_create(http, cookie, &[], &body).status
}

#[test]
fn console_forms_refuse_missing_or_forged_csrf_tokens_and_change_nothing() {
    let server = start();
    let (cookie, token) = session(&server.http);
    let (other_cookie, _) = session(&server.http);
    assert_ne!(cookie, other_cookie, "each browser gets its own id");

    assert_eq!(create(&server.http, None, &token, "no-cookie"), 403);
    assert_eq!(create(&server.http, Some(&cookie), "", "no-token"), 403);
    assert_eq!(
        create(&server.http, Some(&other_cookie), &token, "other-browser"),
        403
    );
    assert_eq!(
        create(&server.http, Some(&cookie), &"0".repeat(64), "forged"),
        403
    );
    assert_eq!(create(&server.http, Some(&cookie), &token, "accepted"), 303);

    let (ok, out, err) = cli(&["topics", "list", "--bootstrap", &server.grpc]);
    assert!(ok, "{err}");
    let topics: Vec<&str> = out.lines().collect();
    assert_eq!(
        topics,
        ["accepted"],
        "only the form with a valid token changed anything"
    );

    // A bad field is refused with its name, and nothing is created.
    let body = format!("csrf={token}&name=bad-partitions&partitions=many");
    let r = post_create(&server.http, Some(&cookie), &[], &body);
    assert_eq!(r.status, 400);
    assert!(
        r.body.contains("INVALID_REQUEST") && r.body.contains("partitions must be"),
        "{}",
        r.body
    );

    // Pages carry a policy that allows only the console's own script.
    let page = http_request(&server.http, "GET", "/", &[], "").unwrap();
    let csp = page.header("content-security-policy").unwrap_or_default();
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"),
        "{csp}"
    );
    assert_eq!(page.header("x-frame-options"), Some("DENY"));
    // An unknown topic is a coded 404, not a crash, and browsing it does not create it
    // (the server auto-creates topics for producers).
    for path in [
        "/topics/no-such-topic",
        "/topics/no-such-topic/messages?partition=0",
    ] {
        let missing = http_request(&server.http, "GET", path, &[], "").unwrap();
        assert_eq!(missing.status, 404, "{path}: {}", missing.body);
        assert!(
            missing.body.contains("UNKNOWN_TOPIC_OR_PARTITION"),
            "{}",
            missing.body
        );
    }
    let (ok, out, err) = cli(&["topics", "list", "--bootstrap", &server.grpc]);
    assert!(ok, "{err}");
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        ["accepted"],
        "a GET created a topic"
    );
    // A name no topic can have is refused before the cluster is asked; a group whose
    // name is a path step is still addressed (by query).
    let long = format!("/topics/{}", "a".repeat(20_000));
    let r = http_request(&server.http, "GET", &long, &[], "").unwrap();
    assert_eq!(r.status, 400, "{}", &r.body[..r.body.len().min(300)]);
    assert!(r.body.contains("INVALID_TOPIC"));
    let r = http_request(&server.http, "GET", "/group?name=..", &[], "").unwrap();
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.body.contains("GROUP_ID_NOT_FOUND"), "{}", r.body);

    // DNS rebinding: a page under a foreign host name is refused; a form posted from
    // another origin is refused even with a valid token.
    let rebound = http_request(
        &server.http,
        "GET",
        "/topics",
        &[("Host", "evil.example:80")],
        "",
    )
    .unwrap();
    assert_eq!(rebound.status, 421, "{}", rebound.body);
    assert!(
        !rebound.body.contains("csrf"),
        "no token under a foreign name"
    );
    let body = format!("csrf={token}&name=cross-origin&partitions=1");
    let r = post_create(
        &server.http,
        Some(&cookie),
        &[("Origin", "http://evil.example")],
        &body,
    );
    assert_eq!(r.status, 403, "{}", r.body);
    // Metrics and health stay reachable under any name (scrapers, probes).
    let health = http_request(
        &server.http,
        "GET",
        "/health/live",
        &[("Host", "tidelog-0.tidelog")],
        "",
    )
    .unwrap();
    assert_eq!(health.status, 200);
}
