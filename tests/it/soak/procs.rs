//! The soak's processes: a sim or a gateway as a child process with its log, signals, and its
//! descriptors, memory and log lines read from /proc and the log.

use super::*;

/// A child process, killed if the test ends before it was waited for.
pub(super) struct Proc {
    pub(super) name: String,
    pub(super) child: Option<Child>,
}

impl Proc {
    pub(super) fn spawn(name: &str, cmd: &mut Command, log: &Path) -> Self {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let err = out.try_clone().unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: cannot start {BIN}: {e}"));
        Self {
            name: name.to_owned(),
            child: Some(child),
        }
    }

    pub(super) fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Send `sig` (`KILL`, `STOP`, `CONT`, `HUP`, `TERM`) with kill(1), as an operator would.
    pub(super) fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args(["-s", sig, &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(
            status.success(),
            "kill -s {sig} {} ({})",
            self.pid(),
            self.name
        );
    }

    /// Wait (polling, bounded) for the process to exit; its exit status.
    pub(super) async fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        let child = self.child.as_mut().expect("not yet waited for");
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return status;
            }
            assert!(
                start.elapsed() < limit,
                "{} did not exit within {limit:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            // A stopped process must be continued to die of anything but SIGKILL; SIGKILL is fine.
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(super) fn spawn_sim(i: usize, port: u16, warmup_secs: u32, log: &Path) -> Proc {
    Proc::spawn(
        &format!("sim{i}"),
        Command::new(BIN).args([
            "sim",
            "--port",
            &port.to_string(),
            "--decode-step-ms",
            "5",
            "--seed",
            &i.to_string(),
            "--warmup-secs",
            &warmup_secs.to_string(),
        ]),
        log,
    )
}

/// Descriptors and resident memory of a process, from /proc.
#[derive(Debug, Clone, Copy)]
pub(super) struct Usage {
    pub(super) fds: usize,
    pub(super) rss_kib: u64,
}

pub(super) fn usage_of(pid: u32) -> Usage {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/<pid>/status");
    Usage { fds, rss_kib }
}

/// What a process's descriptors are: TCP sockets by peer (named by `ports`: a port the peer
/// listens on, or one of the process's own listening ports for accepted clients), other
/// descriptors by kind. Shows where a growth comes from when the slack is exceeded.
pub(super) fn fd_breakdown(pid: u32, ports: &[(u16, &str)]) -> BTreeMap<String, usize> {
    // inode -> (local port, remote port, state) from the kernel's TCP tables.
    let mut sockets = HashMap::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 {
                continue;
            }
            let port = |a: &str| {
                a.rsplit_once(':')
                    .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
                    .unwrap_or(0)
            };
            sockets.insert(f[9].to_owned(), (port(f[1]), port(f[2]), f[3] == "0A"));
        }
    }
    let name = |p: u16| ports.iter().find(|(q, _)| *q == p).map(|(_, n)| *n);
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return out;
    };
    for e in dir.flatten() {
        let target = std::fs::read_link(e.path())
            .map(|t| t.display().to_string())
            .unwrap_or_default();
        let kind = match target
            .strip_prefix("socket:[")
            .and_then(|i| i.strip_suffix(']'))
        {
            Some(inode) => match sockets.get(inode) {
                Some((local, _, true)) => format!("listening :{}", name(*local).unwrap_or("?")),
                Some((local, remote, false)) => match (name(*remote), name(*local)) {
                    (Some(n), _) => format!("tcp to {n}"),
                    (None, Some(n)) => format!("tcp from a client of {n}"),
                    (None, None) => format!("tcp {local}->{remote}"),
                },
                None => "socket (not TCP)".to_owned(),
            },
            None if target.starts_with('/') => {
                let t = target.trim_end_matches(" (deleted)");
                t.rsplit('/').next().unwrap_or(t).to_owned()
            }
            None => target.split(':').take(2).collect::<Vec<_>>().join(":"),
        };
        *out.entry(kind).or_default() += 1;
    }
    out
}

/// WARN and ERROR lines of a gateway's JSON log, counted by level and message.
pub(super) fn log_summary(path: &Path) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    let text = std::fs::read_to_string(path).unwrap_or_default();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            if !line.trim().is_empty() {
                *out.entry(format!(
                    "(not JSON) {}",
                    line.chars().take(100).collect::<String>()
                ))
                .or_default() += 1;
            }
            continue;
        };
        let level = v["level"].as_str().unwrap_or("?");
        if level == "WARN" || level == "ERROR" {
            let msg = v["message"].as_str().unwrap_or("?");
            *out.entry(format!("{level} {msg}")).or_default() += 1;
        }
    }
    out
}

// ----------------------------------------------------------------------------------------------
// Configuration
