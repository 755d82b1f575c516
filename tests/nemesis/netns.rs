//! A private network for one nemesis run: one network namespace per node, all joined by
//! a bridge in a hub namespace, and a veth from the test's own namespace into the bridge
//! so the checker's clients reach every node. Partitions are nftables drop rules inside
//! node namespaces (both directions, on both ends), healed by deleting the table.
//!
//! Invariants: every name includes the test's pid and a run number, so concurrent or
//! crashed runs never collide; [`Network`]'s `Drop` deletes every namespace and the
//! root-side veth it made (deleting a namespace deletes the veths inside it), so a
//! panicking run leaks nothing. Every command's failure is an error naming the command.

use std::collections::BTreeSet;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// Runs `program args...`; an error carries the command and its stderr.
pub fn run(program: &str, args: &[&str]) -> Result<()> {
    run_with_input(program, args, None)
}

fn run_with_input(program: &str, args: &[&str], input: Option<&str>) -> Result<()> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn {program}"))?;
    if let Some(text) = input {
        child
            .stdin
            .take()
            .context("stdin")?
            .write_all(text.as_bytes())
            .with_context(|| format!("write to {program}"))?;
    }
    let out = child.wait_with_output().context("wait")?;
    if !out.status.success() {
        bail!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Why the nemesis cannot run here, or `None` when it can: root, and `ip`, `nft`,
/// `mkfs.ext4` and `mount` (for the brokers' loop-mounted disks).
pub fn unsupported() -> Option<String> {
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not running as root (network namespaces need CAP_NET_ADMIN)".into());
    }
    for (tool, flag) in [
        ("ip", "-V"),
        ("nft", "-v"),
        ("mkfs.ext4", "-V"),
        ("mount", "-V"),
    ] {
        let found = Command::new(tool)
            .arg(flag)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Some(format!(
                "`{tool}` not found (install iproute2, nftables, e2fsprogs and mount)"
            ));
        }
    }
    None
}

/// One node's namespace and address.
pub struct NodeNet {
    /// The namespace's name (`ip netns` name).
    pub namespace: String,
    /// Its address on the bridge.
    pub ip: String,
}

/// The namespaces, the bridge and the root-side veth of one run.
pub struct Network {
    hub: String,
    root_veth: String,
    /// Nodes, index 0 = node 1.
    pub nodes: Vec<NodeNet>,
    /// The test's own address on the bridge.
    pub client_ip: String,
    /// Node pairs (indices, low first) whose link is cut now.
    cut: BTreeSet<(usize, usize)>,
    made: Vec<String>,
    root_made: bool,
}

impl Network {
    /// Creates `n` node namespaces joined by a bridge; `run` distinguishes runs of one
    /// process.
    pub fn create(n: usize, run: u32) -> Result<Network> {
        assert!((1..=200).contains(&n), "node count");
        let pid = std::process::id();
        let tag = format!("tlnm{pid}r{run}");
        // A /24 per pid, so runs of concurrent processes do not route into each other.
        let subnet = format!("10.213.{}", pid % 250);
        let mut net = Network {
            hub: format!("{tag}-hub"),
            root_veth: format!("tl{}r{}", pid % 10_000_000, run % 100),
            nodes: (1..=n)
                .map(|i| NodeNet {
                    namespace: format!("{tag}-n{i}"),
                    ip: format!("{subnet}.{i}"),
                })
                .collect(),
            client_ip: format!("{subnet}.254"),
            cut: BTreeSet::new(),
            made: Vec::new(),
            root_made: false,
        };
        net.build().context("building the nemesis network")?;
        Ok(net)
    }

    fn add_namespace(&mut self, name: &str) -> Result<()> {
        run("ip", &["netns", "add", name])?;
        self.made.push(name.to_owned());
        run("ip", &["-n", name, "link", "set", "lo", "up"])
    }

    fn build(&mut self) -> Result<()> {
        let hub = self.hub.clone();
        self.add_namespace(&hub)?;
        run("ip", &["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        run("ip", &["-n", &hub, "link", "set", "br0", "up"])?;
        for i in 0..self.nodes.len() {
            let ns = self.nodes[i].namespace.clone();
            let ip = self.nodes[i].ip.clone();
            self.add_namespace(&ns)?;
            let port = format!("v{}", i + 1);
            run(
                "ip",
                &[
                    "link", "add", &port, "netns", &hub, "type", "veth", "peer", "name", "eth0",
                    "netns", &ns,
                ],
            )?;
            run("ip", &["-n", &hub, "link", "set", &port, "master", "br0"])?;
            run("ip", &["-n", &hub, "link", "set", &port, "up"])?;
            run(
                "ip",
                &["-n", &ns, "addr", "add", &format!("{ip}/24"), "dev", "eth0"],
            )?;
            run("ip", &["-n", &ns, "link", "set", "eth0", "up"])?;
        }
        let veth = self.root_veth.clone();
        run(
            "ip",
            &[
                "link", "add", &veth, "type", "veth", "peer", "name", "vroot", "netns", &hub,
            ],
        )?;
        self.root_made = true;
        run("ip", &["-n", &hub, "link", "set", "vroot", "master", "br0"])?;
        run("ip", &["-n", &hub, "link", "set", "vroot", "up"])?;
        run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/24", self.client_ip),
                "dev",
                &veth,
            ],
        )?;
        run("ip", &["link", "set", &veth, "up"])?;
        Ok(())
    }

    /// An open handle on node `i`'s namespace, for `setns(2)` in a child before exec.
    pub fn namespace_fd(&self, i: usize) -> Result<OwnedFd> {
        let path = format!("/run/netns/{}", self.nodes[i].namespace);
        let file = std::fs::File::open(&path).with_context(|| format!("open {path}"))?;
        Ok(OwnedFd::from(file))
    }

    /// The links cut between every node of `a` and every node of `b` (indices), as
    /// pairs for [`Network::set_cuts`].
    pub fn pairs(a: &[usize], b: &[usize]) -> BTreeSet<(usize, usize)> {
        let mut out = BTreeSet::new();
        for &x in a {
            for &y in b {
                if x != y {
                    out.insert((x.min(y), x.max(y)));
                }
            }
        }
        out
    }

    /// Cuts exactly the links in `pairs` (node indices) and restores every other.
    pub fn set_cuts(&mut self, pairs: BTreeSet<(usize, usize)>) -> Result<()> {
        if pairs == self.cut {
            return Ok(());
        }
        self.cut = pairs;
        self.apply()
    }

    /// Restores every link.
    pub fn heal(&mut self) -> Result<()> {
        self.cut.clear();
        self.apply()
    }

    /// Rewrites every node's rule set from `self.cut`: one table, replaced atomically.
    fn apply(&self) -> Result<()> {
        for (i, node) in self.nodes.iter().enumerate() {
            let peers: Vec<&str> = self
                .cut
                .iter()
                .filter_map(|&(x, y)| {
                    if x == i {
                        Some(self.nodes[y].ip.as_str())
                    } else if y == i {
                        Some(self.nodes[x].ip.as_str())
                    } else {
                        None
                    }
                })
                .collect();
            let mut script = String::from(
                "table inet nemesis\ndelete table inet nemesis\ntable inet nemesis {\n",
            );
            if !peers.is_empty() {
                let set = peers.join(", ");
                script.push_str(&format!(
                    "  chain input {{ type filter hook input priority 0; policy accept; ip saddr {{ {set} }} drop; }}\n  chain output {{ type filter hook output priority 0; policy accept; ip daddr {{ {set} }} drop; }}\n"
                ));
            }
            script.push_str("}\n");
            run_with_input(
                "ip",
                &["netns", "exec", &node.namespace, "nft", "-f", "-"],
                Some(&script),
            )?;
        }
        Ok(())
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        if self.root_made {
            let _ = run("ip", &["link", "del", &self.root_veth]);
        }
        for name in self.made.iter().rev() {
            if let Err(e) = run("ip", &["netns", "del", name]) {
                eprintln!("nemesis: could not delete namespace {name}: {e}");
            }
        }
    }
}

/// Deletes the namespaces of runs whose process is gone (`alive(pid)` is false).
pub fn remove_stale_namespaces(alive: impl Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("tlnm") else {
            continue;
        };
        let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if !pid.is_empty() && !alive(&pid) {
            eprintln!("nemesis: deleting the stale namespace {name}");
            let _ = run("ip", &["netns", "del", &name]);
        }
    }
}

/// Makes the calling (child) process join the namespace `fd` refers to; for
/// `CommandExt::pre_exec`.
pub fn enter(fd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: setns(2) on an fd we own; async-signal-safe, as pre_exec requires.
    if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
