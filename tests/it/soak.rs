//! The fault soak (the reliability suite): three `fleetgate sim` processes, two `fleetgate
//! serve` gateways sharing one PostgreSQL database (keys, request log) and one Redis (limits),
//! both reached through TCP forwarders the test can cut. Steady mixed load (streaming and not,
//! chat and completions, prod and stress keys) runs through both gateways while faults arrive
//! on a schedule: a backend SIGKILLed and restarted, a backend stalled (SIGSTOP/SIGCONT), a
//! backend restarted cold (refusing connections while it warms up), PostgreSQL cut, Redis cut,
//! a SIGHUP reload with a changed weight, and a SIGTERM of one gateway near the end.
//!
//! Then the accounting: every request either completed or got a clear error (an OpenAI error
//! body, or an in-stream error event followed by `[DONE]`); every request a gateway answered has
//! exactly one request-log row; gateway A holds no more descriptors or memory after the load
//! than during it.
//!
//! Duration: `FLEETGATE_SOAK_SECONDS` (default 20, so `cargo test` stays short). The long run
//! and its results: docs/reliability-soak.md.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use bytes::{Bytes, BytesMut};
use fleetgate_gateway::admin::jwt::Role;
use fleetgate_protocol::client::{self, BodyEnd, HttpClient};
use fleetgate_protocol::event::DataKind;
use fleetgate_protocol::sse::SseScanner;
use fleetgate_protocol::stream::StreamMetrics;
use http::{HeaderMap, HeaderValue};

const BIN: &str = env!("CARGO_BIN_EXE_fleetgate");
/// Requests started per second, spread over the gateways that are up.
const RATE: u32 = 20;
/// Longest a request may take, head and body, before it counts as a hang. The longest legitimate
/// answer is a prod request that waits its whole queue deadline (30 s) and then streams.
const REQUEST_BOUND: Duration = Duration::from_secs(60);
/// Descriptors gateway A may hold idle beyond what it held under load after warm-up: a few
/// more idle upstream keep-alive connections than at the warm-up moment (their number follows
/// the peak concurrency per backend, which the faults raise) and a PostgreSQL pool connection
/// or two; far below a leak of one per request, per fault or per reload.
const FD_SLACK: usize = 16;
/// Resident memory gateway A may gain from warm-up to idle after the load. Seen: about +2 MiB
/// (debug, 20 s) and +2.3 MiB (release, 600 s, 12 000 requests), flat over the last third:
/// allocator arenas and per-backend, per-key state settling, not a function of the request
/// count. 16 MiB is seven times that; a leak of 1.4 KiB per request shows up in the second
/// half of the long run alone (half the slack over its 6 000 requests).
const RSS_SLACK_KIB: u64 = 16 * 1024;
/// A fault cycle (every fault once) per this many seconds of soak, at least one.
const CYCLE_SECONDS: f64 = 60.0;

// ----------------------------------------------------------------------------------------------
// Processes

/// A child process, killed if the test ends before it was waited for.
struct Proc {
    name: String,
    child: Option<Child>,
}

impl Proc {
    fn spawn(name: &str, cmd: &mut Command, log: &Path) -> Self {
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

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Send `sig` (`KILL`, `STOP`, `CONT`, `HUP`, `TERM`) with kill(1), as an operator would.
    fn signal(&self, sig: &str) {
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
    async fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
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

fn spawn_sim(i: usize, port: u16, warmup_secs: u32, log: &Path) -> Proc {
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
struct Usage {
    fds: usize,
    rss_kib: u64,
}

fn usage_of(pid: u32) -> Usage {
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
fn fd_breakdown(pid: u32, ports: &[(u16, &str)]) -> BTreeMap<String, usize> {
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
fn log_summary(path: &Path) -> BTreeMap<String, usize> {
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

/// `scheme://user@` , `host:port`, `/rest` of a service URL.
fn split_url(url: &str) -> (String, String, String) {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (user, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    (
        format!("{scheme}://{user}"),
        hostport.to_owned(),
        path.to_owned(),
    )
}

/// The same URL with its host and port replaced by a local forwarder's.
fn via_forwarder(url: &str, port: u16) -> String {
    let (head, _, path) = split_url(url);
    format!("{head}127.0.0.1:{port}{path}")
}

async fn resolve(url: &str) -> std::net::SocketAddr {
    let (_, hostport, _) = split_url(url);
    tokio::net::lookup_host(hostport.as_str())
        .await
        .unwrap()
        .next()
        .unwrap()
}

struct GatewayPlan {
    port: u16,
    admin_port: u16,
    spill: PathBuf,
}

struct Shared {
    db_url: String,
    redis_url: String,
    redis_prefix: String,
    sim_ports: Vec<u16>,
}

fn gateway_config(g: &GatewayPlan, s: &Shared, weight0: u32) -> String {
    let backend = |i: usize| format!("http://127.0.0.1:{}", s.sim_ports[i]);
    format!(
        r#"[server]
listen = "127.0.0.1:{port}"
shutdown_grace_seconds = 5
health_interval_ms = 500
log_format = "json"
request_log_events = false

[database]
url = "{db}"
migrate_on_start = true

[admin]
listen = "127.0.0.1:{admin}"
jwt_secret = "{JWT_SECRET}"

[request_log]
flush_interval_ms = 100
spill_path = "{spill}"

[limits]
shared = "redis"

[limits.redis]
url = "{redis}"
replicas = 2
key_prefix = "{prefix}"

[[pools]]
model = "qwen32b"
backends = [
  {{ url = "{b0}", weight = {weight0} }},
  "{b1}",
  "{b2}",
]
max_in_flight_per_backend = 32

# Shorter than the stall fault, so a stalled backend's streams end with a timeout event.
[pools.timeouts]
idle_ms = 1000

[pools.warmup]
requests = 2
slow_start_seconds = 3
"#,
        port = g.port,
        admin = g.admin_port,
        spill = g.spill.display(),
        db = s.db_url,
        redis = s.redis_url,
        prefix = s.redis_prefix,
        b0 = backend(0),
        b1 = backend(1),
        b2 = backend(2),
    )
}

async fn admin_call(
    admin_port: u16,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, String) {
    use http_body_util::BodyExt;
    let c = client::http_client();
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://127.0.0.1:{admin_port}{path}"))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {}", token(Role::Admin)))
        .body(http_body_util::Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// An unlabelled series from a gateway's admin `/metrics`.
async fn metric(admin_port: u16, name: &str) -> f64 {
    let (s, text) = admin_call(admin_port, "GET", "/metrics", None).await;
    assert_eq!(s, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

async fn config_generation(admin_port: u16) -> f64 {
    metric(admin_port, "fleetgate_config_generation").await
}

/// What a gateway shows once every fault is over: Redis and the key store up, nothing left in
/// the spill file, every backend healthy. `Err` names what is not (yet) so.
async fn recovered(admin_port: u16) -> Result<(), String> {
    let mut wrong = Vec::new();
    for (name, want) in [
        ("fleetgate_limits_redis_up", 1.0),
        ("fleetgate_key_store_up", 1.0),
        ("fleetgate_request_log_spilled_rows", 0.0),
    ] {
        let v = metric(admin_port, name).await;
        if v != want {
            wrong.push(format!("{name} {v}"));
        }
    }
    let (s, body) = admin_call(admin_port, "GET", "/admin/backends", None).await;
    assert_eq!(s, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    for b in v["data"].as_array().unwrap() {
        if b["state"] != "healthy" {
            wrong.push(format!("backend {} {}", b["backend"], b["state"]));
        }
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(wrong.join(", "))
    }
}

// ----------------------------------------------------------------------------------------------
// Requests and their classification

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    /// 200 with a JSON body, or a stream that ended with `[DONE]` and no error event.
    Completed,
    /// A non-2xx status with an OpenAI error body, or a stream with an error event then `[DONE]`.
    ClearError,
    /// The connection was refused: no gateway received it.
    NotReceived,
    /// Anything else: a cut stream, a 500, a body that is not JSON, a hang.
    Failure,
}

#[derive(Debug)]
struct Outcome {
    id: String,
    gateway: usize,
    stream: bool,
    class: Class,
    /// The response head's status, when one arrived.
    status: Option<u16>,
    /// The error code (of the body or the stream's error event), or what went wrong.
    detail: String,
}

struct Load {
    client: HttpClient,
    tag: String,
    ports: [u16; 2],
    keys: [String; 2],
    /// Gateway B takes requests until it is about to get its SIGTERM.
    b_open: AtomicBool,
}

/// The `n`th request of the soak: which gateway, key, endpoint and shape. Mixed so every
/// combination comes up: gateway alternates, streaming by pairs, one in five a completion.
fn request_for(load: &Load, n: u64) -> (usize, http::Uri, HeaderMap, Bytes, bool, String) {
    let gateway = if load.b_open.load(Ordering::SeqCst) {
        (n % 2) as usize
    } else {
        0
    };
    let stream = (n / 2) % 2 == 0;
    let max_tokens = 8 + (n * 37) % 120;
    let prompt = "soak ".repeat(1 + (n % 40) as usize);
    let (path, body) = if n % 5 == 4 {
        (
            "/v1/completions",
            serde_json::json!({"model": "qwen32b", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}),
        )
    } else {
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "qwen32b", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": stream}),
        )
    };
    let id = format!("{}-{n}", load.tag);
    let key = &load.keys[((n / 3) % 2) as usize];
    let mut h = HeaderMap::new();
    h.insert(
        http::header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {key}")).unwrap(),
    );
    h.insert("x-request-id", HeaderValue::from_str(&id).unwrap());
    let uri = format!("http://127.0.0.1:{}{path}", load.ports[gateway])
        .parse()
        .unwrap();
    (gateway, uri, h, Bytes::from(body.to_string()), stream, id)
}

/// The start of a body, for a failure's description.
fn snippet(body: &[u8]) -> String {
    String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned()
}

/// The `code` of an OpenAI error body, or `None` when the body is not one.
fn openai_error_code(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let e = v.get("error")?;
    if !(e["message"].is_string()
        && e["type"].is_string()
        && e.get("code").is_some()
        && e.get("param").is_some())
    {
        return None;
    }
    Some(e["code"].as_str().unwrap_or("null").to_owned())
}

async fn one_request(
    client: HttpClient,
    gateway: usize,
    uri: http::Uri,
    headers: HeaderMap,
    body: Bytes,
    stream: bool,
    id: String,
) -> Outcome {
    let outcome = |class, status, detail: String| Outcome {
        id: id.clone(),
        gateway,
        stream,
        class,
        status,
        detail,
    };
    let deadline = tokio::time::Instant::now() + REQUEST_BOUND;
    let req = client::post(&uri, &headers, body);
    let mut answer =
        match tokio::time::timeout_at(deadline, client::open(&client, req, Instant::now())).await {
            Err(_) => return outcome(Class::Failure, None, "no response head (hang)".into()),
            Ok(Err(e)) if e.is_connect() => {
                return outcome(Class::NotReceived, None, format!("connect: {e}"));
            }
            Ok(Err(e)) => {
                return outcome(
                    Class::Failure,
                    None,
                    format!("transport error before the head: {e:?}"),
                );
            }
            Ok(Ok(a)) => a,
        };
    let status = answer.status.as_u16();
    let mut scanner = SseScanner::new();
    let mut metrics = StreamMetrics::default();
    let mut error_code: Option<String> = None;
    let mut kept = BytesMut::new();
    let end = answer
        .read(Some(deadline), |data, at| {
            scanner.feed(data, |l| {
                if l.kind == DataKind::Error && error_code.is_none() {
                    error_code = Some(
                        openai_error_code(l.payload).unwrap_or_else(|| "malformed".to_owned()),
                    );
                }
                metrics.on_data(l.kind, l.usage, at);
            });
            kept.extend_from_slice(data);
        })
        .await;
    scanner.finish(|l| metrics.on_data(l.kind, l.usage, Duration::ZERO));
    let s = Some(status);
    if answer
        .headers
        .get("x-request-id")
        .map(HeaderValue::as_bytes)
        != Some(id.as_bytes())
    {
        return outcome(Class::Failure, s, "x-request-id not echoed".into());
    }
    match end {
        BodyEnd::Complete => {}
        BodyEnd::Deadline => return outcome(Class::Failure, s, "body hang".into()),
        BodyEnd::Cut(e) => return outcome(Class::Failure, s, format!("body cut: {e}")),
    }
    if status == 500 {
        return outcome(Class::Failure, s, format!("500: {}", snippet(&kept)));
    }
    if !(200..300).contains(&status) {
        return match openai_error_code(&kept) {
            Some(code) => outcome(Class::ClearError, s, code),
            None => outcome(
                Class::Failure,
                s,
                format!("error body not OpenAI JSON: {}", snippet(&kept)),
            ),
        };
    }
    if stream {
        if !metrics.done {
            return outcome(Class::Failure, s, "stream ended without [DONE]".into());
        }
        if let Some(code) = error_code {
            return outcome(Class::ClearError, s, format!("stream: {code}"));
        }
        if metrics.content_events == 0 {
            return outcome(Class::Failure, s, "stream without content".into());
        }
        return outcome(Class::Completed, s, String::new());
    }
    match serde_json::from_slice::<serde_json::Value>(&kept) {
        Ok(v) if v["choices"].is_array() => outcome(Class::Completed, s, String::new()),
        _ => outcome(
            Class::Failure,
            s,
            format!("200 body not a completion: {}", snippet(&kept)),
        ),
    }
}

// ----------------------------------------------------------------------------------------------
// Faults

/// What the fault tasks act on.
struct Rig {
    start: Instant,
    dir: PathBuf,
    sims: Mutex<Vec<Proc>>,
    sim_ports: Vec<u16>,
    pg: Mutex<Option<Cuttable>>,
    pg_port: u16,
    pg_upstream: std::net::SocketAddr,
    redis: Mutex<Option<Cuttable>>,
    redis_port: u16,
    redis_upstream: std::net::SocketAddr,
    a_pid: u32,
    a_admin_port: u16,
    a_config: PathBuf,
    a_plan: GatewayPlan,
    shared: Shared,
    events: Mutex<Vec<String>>,
    reloads_unapplied: Mutex<Vec<String>>,
}

impl Rig {
    fn note(&self, what: String) {
        let line = format!("{:7.1} s  {what}", self.start.elapsed().as_secs_f64());
        println!("soak: {line}");
        self.events.lock().unwrap().push(line);
    }

    fn sim_signal(&self, i: usize, sig: &str) {
        self.sims.lock().unwrap()[i].signal(sig);
    }

    /// SIGKILL sim `i`, then start it again on the same port (`warmup` seconds refusing
    /// connections, like a cold vLLM instance).
    async fn kill_and_restart(&self, i: usize, down: Duration, warmup: u32) {
        self.note(format!("SIGKILL sim{i}"));
        {
            let mut sims = self.sims.lock().unwrap();
            sims[i].signal("KILL");
            let c = sims[i].child.as_mut().unwrap();
            let _ = c.wait();
            sims[i].child = None;
        }
        tokio::time::sleep(down).await;
        let p = spawn_sim(
            i,
            self.sim_ports[i],
            warmup,
            &self.dir.join(format!("sim{i}.log")),
        );
        self.sims.lock().unwrap()[i] = p;
        self.note(if warmup > 0 {
            format!("sim{i} restarted cold: refuses connections for {warmup} s")
        } else {
            format!("sim{i} restarted")
        });
    }

    async fn stall(&self, i: usize, for_: Duration) {
        self.note(format!(
            "SIGSTOP sim{i} (stall {:.1} s)",
            for_.as_secs_f64()
        ));
        self.sim_signal(i, "STOP");
        tokio::time::sleep(for_).await;
        self.sim_signal(i, "CONT");
        self.note(format!("SIGCONT sim{i}"));
    }

    async fn cut_pg(&self, for_: Duration) {
        let fwd = self.pg.lock().unwrap().take().unwrap();
        fwd.cut();
        self.note(format!("PostgreSQL cut ({:.0} s)", for_.as_secs_f64()));
        tokio::time::sleep(for_).await;
        let fwd = Cuttable::start(self.pg_port, self.pg_upstream).await;
        *self.pg.lock().unwrap() = Some(fwd);
        self.note("PostgreSQL back".into());
    }

    async fn cut_redis(&self, for_: Duration) {
        let fwd = self.redis.lock().unwrap().take().unwrap();
        fwd.cut();
        self.note(format!("Redis cut ({:.0} s)", for_.as_secs_f64()));
        tokio::time::sleep(for_).await;
        let fwd = Cuttable::start(self.redis_port, self.redis_upstream).await;
        *self.redis.lock().unwrap() = Some(fwd);
        self.note("Redis back".into());
    }

    /// Rewrite gateway A's config with sim0's weight changed, SIGHUP it, and check that the
    /// reload was applied (its config generation moves on).
    async fn reload_a(&self, weight0: u32) {
        let before = config_generation(self.a_admin_port).await;
        std::fs::write(
            &self.a_config,
            gateway_config(&self.a_plan, &self.shared, weight0),
        )
        .unwrap();
        let status = Command::new("kill")
            .args(["-s", "HUP", &self.a_pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        self.note(format!("SIGHUP gateway A (sim0 weight {weight0})"));
        let t = Instant::now();
        while config_generation(self.a_admin_port).await <= before {
            if t.elapsed() > Duration::from_secs(10) {
                self.reloads_unapplied
                    .lock()
                    .unwrap()
                    .push(format!("weight {weight0}"));
                self.note("reload NOT applied within 10 s".into());
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Fault `which` of cycle `cycle`; a cycle runs them in this order, evenly spaced.
async fn run_fault(rig: Arc<Rig>, which: usize, cycle: usize) {
    match which {
        0 => rig.kill_and_restart(0, Duration::from_secs(1), 0).await,
        1 => rig.stall(1, Duration::from_secs(2)).await,
        2 => rig.kill_and_restart(2, Duration::from_millis(500), 3).await,
        3 => rig.cut_pg(Duration::from_secs(5)).await,
        4 => rig.cut_redis(Duration::from_secs(5)).await,
        5 => rig.reload_a(if cycle % 2 == 0 { 3 } else { 1 }).await,
        _ => unreachable!(),
    }
}
const FAULTS: usize = 6;

// ----------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_soak() {
    let seconds: f64 = std::env::var("FLEETGATE_SOAK_SECONDS")
        .ok()
        .map(|v| {
            v.parse()
                .expect("FLEETGATE_SOAK_SECONDS is a number of seconds")
        })
        .unwrap_or(20.0);
    assert!(seconds >= 10.0, "FLEETGATE_SOAK_SECONDS: at least 10");
    let Some(db) = pg_database("soak").await else {
        return;
    };
    let Some(redis) = redis_url("soak").await else {
        return;
    };
    let dir = temp_dir("soak");
    let suffix = {
        use std::hash::{BuildHasher, RandomState};
        RandomState::new().hash_one(Instant::now()) & 0xffff_ffff
    };
    let tag = format!("soak{}x{suffix:x}", std::process::id());
    println!("soak: {seconds} s, logs and configs in {}", dir.display());

    // The shared services, each behind a forwarder the faults can cut.
    let pg_upstream = resolve(&db.url).await;
    let redis_upstream = resolve(&redis).await;
    let pg_fwd = Cuttable::start(0, pg_upstream).await;
    let redis_fwd = Cuttable::start(0, redis_upstream).await;

    // Three sims.
    let mut sim_ports = Vec::new();
    let mut sims = Vec::new();
    for i in 0..3 {
        let port = closed_port().await.port();
        sims.push(spawn_sim(i, port, 0, &dir.join(format!("sim{i}.log"))));
        sim_ports.push(port);
    }
    for p in &sim_ports {
        wait_for_200(&format!("http://127.0.0.1:{p}/health")).await;
    }
    let shared = Shared {
        db_url: via_forwarder(&db.url, pg_fwd.port),
        redis_url: via_forwarder(&redis, redis_fwd.port),
        redis_prefix: format!("fg-{tag}"),
        sim_ports: sim_ports.clone(),
    };

    // Two gateways; A applies the migrations before B starts.
    let mut plans = Vec::new();
    let mut gateways = Vec::new();
    for name in ["a", "b"] {
        let plan = GatewayPlan {
            port: closed_port().await.port(),
            admin_port: closed_port().await.port(),
            spill: dir.join(format!("spill-{name}")),
        };
        let cfg = dir.join(format!("gateway-{name}.toml"));
        std::fs::write(&cfg, gateway_config(&plan, &shared, 1)).unwrap();
        let gw = Proc::spawn(
            &format!("gateway {name}"),
            Command::new(BIN).args(["serve", "--config"]).arg(&cfg),
            &dir.join(format!("gateway-{name}.log")),
        );
        wait_for_200(&format!("http://127.0.0.1:{}/readyz", plan.port)).await;
        plans.push(plan);
        gateways.push(gw);
    }

    // Two keys (prod and stress), limits far above the load so nothing is refused for them.
    let mut keys = Vec::new();
    for env in ["prod", "stress"] {
        let (s, body) = admin_call(
            plans[0].admin_port,
            "POST",
            "/admin/keys",
            Some(serde_json::json!({
                "name": format!("soak {env}"),
                "environment": env,
                "requests_per_minute": 100_000,
                "tokens_per_minute": 100_000_000,
                "max_concurrent_streams": 1_000,
            })),
        )
        .await;
        assert_eq!(s, 201, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        keys.push(v["key"].as_str().unwrap().to_owned());
    }
    // Both gateways know both keys before the load starts.
    for plan in &plans {
        for key in &keys {
            let uri: http::Uri = format!("http://127.0.0.1:{}/v1/chat/completions", plan.port)
                .parse()
                .unwrap();
            let m = post(
                &uri,
                &[
                    ("authorization", &format!("Bearer {key}")),
                    ("x-request-id", &format!("{tag}-setup")),
                ],
                client::chat_body("qwen32b", "hi", 2, false),
            )
            .await;
            assert_eq!(m.status, 200, "setup request on port {}", plan.port);
        }
    }

    let a_pid = gateways[0].pid();
    let a_plan = GatewayPlan {
        port: plans[0].port,
        admin_port: plans[0].admin_port,
        spill: plans[0].spill.clone(),
    };
    let rig = Arc::new(Rig {
        start: Instant::now(),
        dir: dir.clone(),
        sims: Mutex::new(sims),
        sim_ports,
        pg_port: pg_fwd.port,
        pg: Mutex::new(Some(pg_fwd)),
        pg_upstream,
        redis_port: redis_fwd.port,
        redis: Mutex::new(Some(redis_fwd)),
        redis_upstream,
        a_pid,
        a_admin_port: plans[0].admin_port,
        a_config: dir.join("gateway-a.toml"),
        a_plan,
        shared,
        events: Mutex::new(Vec::new()),
        reloads_unapplied: Mutex::new(Vec::new()),
    });

    // The load: RATE requests a second until the end, each on its own task.
    let load = Arc::new(Load {
        client: soak_client(),
        tag: tag.clone(),
        ports: [plans[0].port, plans[1].port],
        keys: [keys[0].clone(), keys[1].clone()],
        b_open: AtomicBool::new(true),
    });
    let total = Duration::from_secs_f64(seconds);
    let load_task = {
        let load = load.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let mut tick = tokio::time::interval(Duration::from_secs(1) / RATE);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut running = Vec::new();
            let mut n = 0u64;
            while start.elapsed() < total {
                tick.tick().await;
                let (gateway, uri, h, body, stream, id) = request_for(&load, n);
                running.push(tokio::spawn(one_request(
                    load.client.clone(),
                    gateway,
                    uri,
                    h,
                    body,
                    stream,
                    id,
                )));
                n += 1;
            }
            let mut outcomes = Vec::with_capacity(running.len());
            for r in running {
                outcomes.push(r.await.unwrap());
            }
            outcomes
        })
    };

    // Gateway A's descriptors and memory after warm-up, then every so often.
    let warmup = Duration::from_secs_f64((seconds * 0.05).max(1.5));
    tokio::time::sleep(warmup).await;
    let port_names = [
        (rig.sim_ports[0], "sim0"),
        (rig.sim_ports[1], "sim1"),
        (rig.sim_ports[2], "sim2"),
        (rig.pg_port, "PostgreSQL"),
        (rig.redis_port, "Redis"),
        (plans[0].port, "gateway A"),
        (plans[0].admin_port, "gateway A admin"),
        (plans[1].port, "gateway B"),
    ];
    let baseline = usage_of(a_pid);
    let baseline_fds = fd_breakdown(a_pid, &port_names);
    rig.note(format!(
        "gateway A after warm-up: {} fds, {} KiB RSS",
        baseline.fds, baseline.rss_kib
    ));
    let sampler = {
        let rig = rig.clone();
        let every = Duration::from_secs_f64((seconds / 20.0).max(1.0));
        tokio::spawn(async move {
            let mut samples = Vec::new();
            while rig.start.elapsed() < total {
                tokio::time::sleep(every).await;
                let u = usage_of(a_pid);
                samples.push((rig.start.elapsed().as_secs_f64(), u));
            }
            samples
        })
    };

    // The faults: every fault once per cycle, spread over 10 %..85 % of the run.
    let window_start = (seconds * 0.10).max(2.0);
    let window = seconds * 0.85 - window_start;
    let cycles = ((seconds / CYCLE_SECONDS).round() as usize).max(1);
    let cycle_len = window / cycles as f64;
    let mut faults = Vec::new();
    for c in 0..cycles {
        for f in 0..FAULTS {
            let at = window_start + cycle_len * (c as f64 + f as f64 / FAULTS as f64);
            let rig = rig.clone();
            faults.push(tokio::spawn(async move {
                let at = Duration::from_secs_f64(at);
                tokio::time::sleep(at.saturating_sub(rig.start.elapsed())).await;
                run_fault(rig, f, c).await;
            }));
        }
    }

    // Near the end, clients stop using B and B gets its SIGTERM; its streams drain.
    tokio::time::sleep(Duration::from_secs_f64(seconds * 0.9).saturating_sub(rig.start.elapsed()))
        .await;
    load.b_open.store(false, Ordering::SeqCst);
    // Requests already handed to B's connections arrive before the signal does.
    tokio::time::sleep(Duration::from_millis(200)).await;
    rig.note("SIGTERM gateway B (clients use A only)".into());
    gateways[1].signal("TERM");

    for f in faults {
        f.await.unwrap();
    }
    let outcomes = load_task.await.unwrap();
    rig.note(format!("load over: {} requests", outcomes.len()));
    let b_exit = gateways[1].wait_exit(Duration::from_secs(30)).await;
    rig.note(format!("gateway B exited: {b_exit}"));
    let samples = sampler.await.unwrap();

    // Idle: the client's connections close at once (the client is dropped). A's idle upstream
    // connections close when the upstream client's idle sweep finds them older than 90 s; the
    // sweep itself runs every 90 s per worker, so the last ones go 90 to 180 s after their
    // last use, and until then A holds up to its peak concurrency of them. The check waits
    // (polling, at most 190 s) for the descriptors to come back within the slack, and at least
    // 5 s; the long run waits the whole 190 s so its figures are those of a fully idle gateway.
    drop(load);
    let idle_start = Instant::now();
    let full_idle = Duration::from_secs(190);
    let min_idle = if seconds >= 300.0 {
        full_idle
    } else {
        Duration::from_secs(5)
    };
    tokio::time::sleep(min_idle).await;
    while usage_of(a_pid).fds > baseline.fds + FD_SLACK && idle_start.elapsed() < full_idle {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    rig.note(format!(
        "gateway A idle for {:.0} s",
        idle_start.elapsed().as_secs_f64()
    ));
    let after = usage_of(a_pid);
    let after_fds = fd_breakdown(a_pid, &port_names);
    rig.note(format!(
        "gateway A idle after the load: {} fds, {} KiB RSS",
        after.fds, after.rss_kib
    ));

    // Every fault is over: A is whole again (bounded: a probe or a retry loop per second).
    let t = Instant::now();
    let mut state = recovered(plans[0].admin_port).await;
    while state.is_err() && t.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        state = recovered(plans[0].admin_port).await;
    }
    let dropped_rows = metric(plans[0].admin_port, "fleetgate_request_log_dropped_total").await;
    rig.note(format!(
        "gateway A recovered: {state:?}; request-log rows dropped: {dropped_rows}"
    ));

    rig.note("SIGTERM gateway A".into());
    gateways[0].signal("TERM");
    let a_exit = gateways[0].wait_exit(Duration::from_secs(30)).await;
    rig.note(format!("gateway A exited: {a_exit}"));

    // ---- The accounting.
    let mut by_class: BTreeMap<(Class, String, String), u64> = BTreeMap::new();
    for o in &outcomes {
        let status = o.status.map_or_else(|| "-".to_owned(), |s| s.to_string());
        let detail = if o.class == Class::Failure {
            o.detail.chars().take(120).collect()
        } else {
            o.detail.clone()
        };
        *by_class.entry((o.class, status, detail)).or_default() += 1;
    }
    println!(
        "\nsoak: outcomes by class, status and error code ({} requests):",
        outcomes.len()
    );
    for ((class, status, detail), n) in &by_class {
        println!("  {class:?} {status} {detail}: {n}");
    }
    let per_gateway = |g: usize| outcomes.iter().filter(|o| o.gateway == g).count();
    println!(
        "soak: gateway A {} requests, gateway B {}; streams {}",
        per_gateway(0),
        per_gateway(1),
        outcomes.iter().filter(|o| o.stream).count()
    );

    // Request-log rows, read directly (not through the forwarder).
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let rows: Vec<(String, i64, i32)> = sqlx::query_as(
        "SELECT request_id, COUNT(*), MIN(status) FROM request_log WHERE request_id LIKE $1 GROUP BY request_id",
    )
    .bind(format!("{tag}-%"))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    drop(conn);
    let rows: HashMap<String, (i64, i32)> =
        rows.into_iter().map(|(id, n, s)| (id, (n, s))).collect();
    let answered: Vec<&Outcome> = outcomes.iter().filter(|o| o.status.is_some()).collect();
    let mut missing = Vec::new();
    let mut doubled = Vec::new();
    let mut status_mismatch = Vec::new();
    for o in &answered {
        match rows.get(&o.id) {
            None => missing.push(o.id.clone()),
            Some((n, _)) if *n != 1 => doubled.push(format!("{} ({n} rows)", o.id)),
            Some((_, s)) => {
                // A head that is an error is recorded with that status.
                let st = i32::from(o.status.unwrap());
                if st != 200 && *s != st {
                    status_mismatch.push(format!("{}: answered {st}, logged {s}", o.id));
                }
            }
        }
    }
    let sent: std::collections::HashSet<&str> = outcomes.iter().map(|o| o.id.as_str()).collect();
    let unexpected: Vec<&String> = rows
        .keys()
        .filter(|id| !sent.contains(id.as_str()) && !id.ends_with("-setup"))
        .collect();
    let unanswered_with_row: Vec<&str> = outcomes
        .iter()
        .filter(|o| o.status.is_none() && rows.contains_key(&o.id))
        .map(|o| o.id.as_str())
        .collect();
    println!(
        "soak: request-log rows for answered requests: {} found / {} expected ({} missing, {} with more than one row, {} rows for unsent ids, {} for requests without an answer)",
        answered.len() - missing.len() - doubled.len(),
        answered.len(),
        missing.len(),
        doubled.len(),
        unexpected.len(),
        unanswered_with_row.len(),
    );
    for p in [&plans[0].spill, &plans[1].spill] {
        println!(
            "soak: spill file {}: {}",
            p.display(),
            if p.exists() {
                "STILL THERE"
            } else {
                "gone (replayed)"
            }
        );
    }

    println!("\nsoak: fault schedule as it ran:");
    for e in rig.events.lock().unwrap().iter() {
        println!("  {e}");
    }
    println!("soak: gateway A's descriptors after warm-up | idle after the load:");
    let kinds: std::collections::BTreeSet<&String> =
        baseline_fds.keys().chain(after_fds.keys()).collect();
    for k in kinds {
        println!(
            "  {k}: {} | {}",
            baseline_fds.get(k).copied().unwrap_or(0),
            after_fds.get(k).copied().unwrap_or(0)
        );
    }
    for name in ["a", "b"] {
        println!("soak: gateway {name}'s warnings and errors:");
        for (line, n) in log_summary(&dir.join(format!("gateway-{name}.log"))) {
            println!("  {n} x {line}");
        }
    }
    println!("soak: gateway A over time (s: fds, RSS KiB):");
    for (t, u) in &samples {
        println!("  {t:7.1}: {}, {}", u.fds, u.rss_kib);
    }

    // ---- The verdicts.
    let failures: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.class == Class::Failure)
        .collect();
    let not_received: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.class == Class::NotReceived)
        .collect();
    assert!(
        failures.is_empty(),
        "{} requests neither completed nor got a clear error, e.g. {:?}\n(logs: {})",
        failures.len(),
        &failures[..failures.len().min(5)],
        dir.display()
    );
    assert!(
        not_received.is_empty(),
        "connections refused by a gateway that should be up: {:?}",
        &not_received[..not_received.len().min(5)]
    );
    assert!(
        a_exit.success() && b_exit.success(),
        "exit: A {a_exit}, B {b_exit}"
    );
    assert!(
        missing.is_empty() && doubled.is_empty() && unanswered_with_row.is_empty(),
        "request log: missing {:?}, doubled {:?}, rows without an answer {:?}",
        &missing[..missing.len().min(10)],
        &doubled[..doubled.len().min(10)],
        unanswered_with_row
    );
    assert!(
        status_mismatch.is_empty(),
        "request log status differs from the answer: {status_mismatch:?}"
    );
    assert!(
        unexpected.is_empty(),
        "rows for ids never sent: {unexpected:?}"
    );
    assert!(
        !plans[0].spill.exists() && !plans[1].spill.exists(),
        "a spill file was left behind: rows never reached PostgreSQL"
    );
    assert_eq!(state, Ok(()), "gateway A did not recover from the faults");
    assert_eq!(dropped_rows, 0.0, "gateway A dropped request-log rows");
    let unapplied = rig.reloads_unapplied.lock().unwrap().clone();
    assert!(
        unapplied.is_empty(),
        "SIGHUP reloads not applied: {unapplied:?}"
    );
    assert!(
        outcomes
            .iter()
            .filter(|o| o.class == Class::Completed)
            .count()
            * 2
            > outcomes.len(),
        "most requests complete under these faults"
    );
    assert!(
        after.fds <= baseline.fds + FD_SLACK,
        "gateway A descriptors grew: {} after warm-up, {} idle after the load",
        baseline.fds,
        after.fds
    );
    // Memory: see RSS_SLACK_KIB; and none of it in the second half of the run, when the
    // allocator has long settled and a leak would be all that still grows.
    assert!(
        after.rss_kib <= baseline.rss_kib + RSS_SLACK_KIB,
        "gateway A memory grew: {} KiB after warm-up, {} KiB idle after the load",
        baseline.rss_kib,
        after.rss_kib
    );
    let (mid_t, mid) = samples
        .iter()
        .find(|(t, _)| *t >= seconds / 2.0)
        .copied()
        .unwrap_or((0.0, baseline));
    assert!(
        after.rss_kib <= mid.rss_kib + RSS_SLACK_KIB / 2,
        "gateway A memory grew in the second half: {} KiB at {mid_t:.0} s, {} KiB idle after the load",
        mid.rss_kib,
        after.rss_kib
    );
    drop(rig);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The load's client: keep-alive, and idle connections closed well before the gateway's own
/// keep-alive timeout (60 s), so a request never goes out on a connection the gateway is
/// closing at that moment (a race every HTTP/1.1 client has, not a gateway fault).
fn soak_client() -> HttpClient {
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.set_nodelay(true);
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(5))
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .pool_max_idle_per_host(1024)
        .build(http)
}
