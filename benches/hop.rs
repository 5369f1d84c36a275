//! Hop-cost benchmark: what one hop through fleetgate adds to a streamed chat completion,
//! measured against direct calls to the same backend and against nginx as the floor.
//!
//! Three targets share one backend: `direct` (the sim itself), `fleetgate` (the gateway in
//! front of it) and `nginx` (nginx in front of it). Every phase interleaves the three, so slow
//! drift of the machine falls on all of them alike:
//!
//! 1. latency at concurrency 1: rounds of one request per target in a rotating order;
//! 2. open loop: constant-rate arrivals in slices rotating direct → fleetgate → nginx, with the
//!    CPU time of every given process per completed request;
//! 3. memory: thousands of slow streams held open through fleetgate, then through nginx, with
//!    the resident set of the proxy read from /proc.
//!
//! `scripts/bench-hop.sh` starts the processes and passes their URLs and pids; run by hand with
//! `cargo bench --bench hop -- --help`. Output: a JSON file with every figure, and a markdown
//! summary on stdout.

use std::error::Error;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use fleetgate_protocol::client::{self, HttpClient, Measured};
use fleetgate_protocol::event::DataKind;
use fleetgate_protocol::sse::SseScanner;
use http::{HeaderMap, HeaderValue, Method, Request, Uri, header};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

type BoxError = Box<dyn Error + Send + Sync>;
type Res<T> = Result<T, BoxError>;

/// Linux reports utime/stime in USER_HZ ticks, which is 100 on every architecture we run on.
const TICKS_PER_SEC: f64 = 100.0;

#[derive(Parser, Debug)]
#[command(
    name = "hop",
    about = "Hop cost of fleetgate vs direct calls, beside nginx"
)]
struct Args {
    /// Base URL of the backend itself, e.g. http://127.0.0.1:8001.
    #[arg(long)]
    direct: String,
    /// Base URL of fleetgate in front of that backend.
    #[arg(long)]
    fleetgate: String,
    /// Base URL of nginx in front of that backend.
    #[arg(long)]
    nginx: String,
    /// Model name sent in every request of phases 1 and 2.
    #[arg(long, default_value = "qwen32b")]
    model: String,
    /// Completion tokens per request (the sim answers exactly this many content chunks).
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Streams without `stream_options.include_usage`: fleetgate then asks for usage upstream
    /// and removes the usage chunk (the relay's other path).
    #[arg(long)]
    no_include_usage: bool,
    /// The protocol of phases 1 and 2: chat (/v1/chat/completions), responses (OpenAI's
    /// Responses API, /v1/responses) or messages (Anthropic's, /v1/messages). Phase 3 streams
    /// chat.
    #[arg(long, value_enum, default_value = "chat")]
    protocol: Protocol,
    /// Sent as `Authorization: Bearer <key>` when given.
    #[arg(long, env = "FLEETGATE_BENCH_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Phases to run, comma-separated: latency, openloop, memory.
    #[arg(long, value_delimiter = ',', default_value = "latency,openloop,memory")]
    phases: Vec<String>,

    /// Phase 1: measured rounds (one request per target each).
    #[arg(long, default_value_t = 2000)]
    rounds: usize,
    /// Phase 1: warm-up rounds, not measured.
    #[arg(long, default_value_t = 200)]
    warmup_rounds: usize,

    /// Phase 2: arrivals per second (constant rate).
    #[arg(long, default_value_t = 400.0)]
    rate: f64,
    /// Phase 2: seconds per slice.
    #[arg(long, default_value_t = 5.0)]
    slice_secs: f64,
    /// Phase 2: how many times the direct → fleetgate → nginx rotation runs.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Phase 2: longest wait for a slice's requests to finish after the last was sent.
    #[arg(long, default_value_t = 30.0)]
    drain_secs: f64,

    /// Pid of the fleetgate process (CPU and memory).
    #[arg(long)]
    gateway_pid: Option<u32>,
    /// Pids of the nginx worker processes (CPU and memory), comma-separated.
    #[arg(long, value_delimiter = ',')]
    nginx_pids: Vec<u32>,
    /// Pid of the backend sim serving phases 1 and 2 (CPU).
    #[arg(long)]
    sim_pid: Option<u32>,

    /// Phase 3: base URL of fleetgate routing `--mem-model` to a slow backend.
    #[arg(long)]
    mem_fleetgate: Option<String>,
    /// Phase 3: base URL of nginx in front of that slow backend.
    #[arg(long)]
    mem_nginx: Option<String>,
    /// Phase 3: model name of the slow backend.
    #[arg(long, default_value = "slow")]
    mem_model: String,
    /// Phase 3: streams held open at once.
    #[arg(long, default_value_t = 5000)]
    mem_streams: usize,
    /// Phase 3: completion tokens per stream (long enough to outlast the phase).
    #[arg(long, default_value_t = 30000)]
    mem_max_tokens: u32,
    /// Phase 3: requests waiting for their response head at any one time while opening.
    #[arg(long, default_value_t = 256)]
    mem_open_concurrency: usize,
    /// Phase 3: longest wait for all streams to open (and again for their first token).
    #[arg(long, default_value_t = 90.0)]
    mem_wait_secs: f64,

    /// Driver runtime threads: 1 runs a current-thread runtime (lowest latency at concurrency 1).
    #[arg(long, default_value_t = 1)]
    driver_threads: usize,
    /// Names the run in the markdown heading (e.g. which sim answers).
    #[arg(long, default_value = "")]
    label: String,
    /// Leave the targets table out (for passes the targets are not defined on).
    #[arg(long)]
    no_targets: bool,
    /// Where to write the JSON with every figure.
    #[arg(long, default_value = "bench-out/hop.json")]
    out: PathBuf,

    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> Res<()> {
    let args = Args::parse();
    let _ = PROTOCOL.set(args.protocol);
    let runtime = if args.driver_threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.driver_threads)
            .enable_all()
            .build()?
    };
    runtime.block_on(run(args))
}

// ---------------------------------------------------------------------------------------------
// Targets and requests

const NAMES: [&str; 3] = ["direct", "fleetgate", "nginx"];

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Chat,
    Responses,
    Messages,
}

impl Protocol {
    fn path(self) -> &'static str {
        match self {
            Protocol::Chat => "/v1/chat/completions",
            Protocol::Responses => "/v1/responses",
            Protocol::Messages => "/v1/messages",
        }
    }

    fn dialect(self) -> fleetgate_protocol::Dialect {
        use fleetgate_protocol::Dialect;
        match self {
            Protocol::Chat => Dialect::Chat,
            Protocol::Responses => Dialect::Responses,
            Protocol::Messages => Dialect::Anthropic,
        }
    }
}

/// The protocol of phases 1 and 2 (set once, from the flags).
static PROTOCOL: std::sync::OnceLock<Protocol> = std::sync::OnceLock::new();

fn protocol() -> Protocol {
    PROTOCOL.get().copied().unwrap_or(Protocol::Chat)
}

/// The URL of the measured protocol's endpoint.
fn api_uri(base: &str) -> Res<Uri> {
    let base = base.trim_end_matches('/');
    Ok(format!("{base}{}", protocol().path()).parse()?)
}

/// A streamed request of the measured protocol; chat's as `request_body`.
fn api_body(model: &str, max_tokens: u32, include_usage: bool) -> Bytes {
    let prompt = "Write a short poem about the sea.";
    match protocol() {
        Protocol::Chat => request_body(model, max_tokens, include_usage),
        Protocol::Responses => Bytes::from(
            json!({"model": model, "input": prompt, "max_output_tokens": max_tokens, "stream": true})
                .to_string(),
        ),
        Protocol::Messages => Bytes::from(
            json!({"model": model, "messages": [{"role": "user", "content": prompt}],
                   "max_tokens": max_tokens, "stream": true})
            .to_string(),
        ),
    }
}

/// One way to reach the backend: its own keep-alive client and the chat URL.
struct Target {
    name: &'static str,
    client: HttpClient,
    uri: Uri,
}

fn chat_uri(base: &str) -> Res<Uri> {
    let base = base.trim_end_matches('/');
    Ok(format!("{base}/v1/chat/completions").parse()?)
}

fn request_body(model: &str, max_tokens: u32, include_usage: bool) -> Bytes {
    let mut body = json!({
        "model": model,
        "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
        "max_tokens": max_tokens,
        "stream": true,
    });
    if include_usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    Bytes::from(body.to_string())
}

fn request_headers(api_key: Option<&str>) -> Res<HeaderMap> {
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    // fleetgate sends a stream's `Server-Timing` (with the hop cost it recorded) as a trailer,
    // to clients that take trailers; the backend and nginx ignore the header.
    h.insert(header::TE, HeaderValue::from_static("trailers"));
    if let Some(k) = api_key {
        let mut v = HeaderValue::try_from(format!("Bearer {k}"))?;
        v.set_sensitive(true);
        h.insert(header::AUTHORIZATION, v);
    }
    Ok(h)
}

/// A measured streamed request, reduced to what the report needs (µs).
#[derive(Clone, Copy, Debug)]
struct Sample {
    ttft_us: f64,
    e2el_us: f64,
    /// The hop cost the gateway recorded for this request (its `Server-Timing` trailer);
    /// NaN from a target that sends none.
    hop_us: f64,
}

/// Whether a measured answer is a complete, correct stream; `Err` says what was wrong.
fn check(m: &Measured, max_tokens: u32) -> Result<Sample, String> {
    if m.status != 200 {
        return Err(format!("status {}", m.status));
    }
    if let Some(e) = &m.body_error {
        return Err(format!("body error: {e}"));
    }
    let s = &m.metrics;
    if s.error {
        return Err("error event in stream".into());
    }
    if !s.done {
        return Err("no clean end ([DONE], response.completed, message_stop)".into());
    }
    match s.output_tokens().0 {
        Some(n) if n == u64::from(max_tokens) => {}
        other => return Err(format!("output tokens {other:?}, expected {max_tokens}")),
    }
    let (Some(ttft), Some(e2el)) = (s.ttft(), s.e2el()) else {
        return Err("no content event".into());
    };
    Ok(Sample {
        ttft_us: ttft.as_secs_f64() * 1e6,
        e2el_us: e2el.as_secs_f64() * 1e6,
        hop_us: fleetgate_bench::measure::hop_ms(&m.headers, m.trailers.as_ref())
            .map_or(f64::NAN, |ms| ms * 1e3),
    })
}

async fn measure(
    t_client: &HttpClient,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
    max_tokens: u32,
) -> Result<Sample, String> {
    match client::send_in(t_client, uri, headers, body, false, protocol().dialect()).await {
        Ok(m) => check(&m, max_tokens),
        Err(e) => Err(format!("request failed: {e}")),
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics

#[derive(Clone, Copy, Debug, Default)]
struct Summary {
    n: usize,
    p50: f64,
    p90: f64,
    p99: f64,
    mean: f64,
    max: f64,
}

/// Nearest-rank percentile of sorted values.
fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn summarize(values: &[f64]) -> Summary {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Summary {
        n,
        p50: pct(&v, 50.0),
        p90: pct(&v, 90.0),
        p99: pct(&v, 99.0),
        mean: if n == 0 {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / n as f64
        },
        max: v.last().copied().unwrap_or(f64::NAN),
    }
}

fn summary_json(s: &Summary) -> Value {
    json!({"n": s.n, "p50": s.p50, "p90": s.p90, "p99": s.p99, "mean": s.mean, "max": s.max})
}

// ---------------------------------------------------------------------------------------------
// /proc readings

/// utime + stime of a process (all its threads, living and exited), in ticks.
fn cpu_ticks(pid: &str) -> Res<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name may contain spaces; the fields after it are plain numbers.
    let close = stat.rfind(')').ok_or("malformed /proc stat")?;
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    // Fields 14 and 15 of stat(5); fields[0] is field 3 (state).
    let utime: u64 = fields.get(11).ok_or("short /proc stat")?.parse()?;
    let stime: u64 = fields.get(12).ok_or("short /proc stat")?.parse()?;
    Ok(utime + stime)
}

/// Total CPU seconds of a set of processes (0 for an empty set).
fn cpu_secs(pids: &[u32]) -> Res<f64> {
    let mut ticks = 0;
    for pid in pids {
        ticks += cpu_ticks(&pid.to_string())?;
    }
    Ok(ticks as f64 / TICKS_PER_SEC)
}

fn self_cpu_secs() -> Res<f64> {
    Ok(cpu_ticks("self")? as f64 / TICKS_PER_SEC)
}

/// VmRSS and VmHWM of a set of processes, summed, in KiB.
fn rss_kib(pids: &[u32]) -> Res<(u64, u64)> {
    let (mut rss, mut hwm) = (0, 0);
    for pid in pids {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        for line in status.lines() {
            let field = |prefix: &str| -> Option<u64> {
                line.strip_prefix(prefix)?
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .ok()
            };
            if let Some(v) = field("VmRSS:") {
                rss += v;
            } else if let Some(v) = field("VmHWM:") {
                hwm += v;
            }
        }
    }
    Ok((rss, hwm))
}

/// Busy time of the whole machine (all CPUs, everything but idle and iowait), in seconds.
fn machine_busy_secs() -> Res<f64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().ok_or("empty /proc/stat")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    // user nice system idle iowait irq softirq steal (guest time is inside user)
    let busy = v
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, x)| x);
    Ok(busy.sum::<u64>() as f64 / TICKS_PER_SEC)
}

fn nproc() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The processes whose CPU is reported, read together before and after a measured stretch.
struct Watched {
    groups: Vec<(&'static str, Vec<u32>)>,
}

#[derive(Clone)]
struct CpuReading {
    /// Per group, then the driver itself.
    secs: Vec<f64>,
    machine: f64,
    at: Instant,
}

/// CPU spent between two readings.
struct CpuDelta {
    /// Per process group, the driver last.
    per: Vec<(&'static str, f64)>,
    /// Busy time of the machine outside the watched processes and the driver (other programs,
    /// and kernel softirq work not charged to any of them), as a share of all CPUs' time.
    other_share: f64,
}

impl Watched {
    fn read(&self) -> Res<CpuReading> {
        let mut secs = Vec::with_capacity(self.groups.len() + 1);
        for (_, pids) in &self.groups {
            secs.push(cpu_secs(pids)?);
        }
        secs.push(self_cpu_secs()?);
        Ok(CpuReading {
            secs,
            machine: machine_busy_secs()?,
            at: Instant::now(),
        })
    }

    fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.groups
            .iter()
            .map(|(n, _)| *n)
            .chain(std::iter::once("driver"))
    }

    fn delta(&self, a: &CpuReading, b: &CpuReading) -> CpuDelta {
        let per: Vec<(&'static str, f64)> = self
            .names()
            .zip(a.secs.iter().zip(&b.secs))
            .map(|(n, (x, y))| (n, y - x))
            .collect();
        let watched: f64 = per.iter().map(|(_, s)| s).sum();
        let wall = b.at.duration_since(a.at).as_secs_f64() * nproc() as f64;
        let other = (b.machine - a.machine - watched).max(0.0);
        CpuDelta {
            per,
            other_share: if wall > 0.0 { other / wall } else { f64::NAN },
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Phase 1: latency at concurrency 1

struct LatencyResult {
    json: Value,
    ttft: Vec<Summary>,
    added_diff: Vec<[f64; 3]>,
    added_paired: Vec<Summary>,
    /// The hop cost each target recorded (fleetgate's only).
    hop: Vec<Summary>,
}

async fn phase_latency(
    args: &Args,
    targets: &[Target],
    headers: &HeaderMap,
    body: &Bytes,
    watched: &Watched,
) -> Res<LatencyResult> {
    let n = targets.len();
    let mut ttft: Vec<Vec<f64>> = vec![Vec::with_capacity(args.rounds); n];
    let mut e2el: Vec<Vec<f64>> = vec![Vec::with_capacity(args.rounds); n];
    // Per round and target; NaN where the request failed, so rounds stay aligned for pairing.
    let mut round_ttft: Vec<Vec<f64>> = vec![Vec::with_capacity(args.rounds); n];
    let mut hop: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut failed = vec![0usize; n];
    let mut first_errors: Vec<Option<String>> = vec![None; n];
    let mut cpu_before = None;
    let started = Instant::now();
    for round in 0..args.warmup_rounds + args.rounds {
        let measured = round >= args.warmup_rounds;
        if round == args.warmup_rounds {
            cpu_before = Some(watched.read()?);
        }
        let mut this_round = vec![f64::NAN; n];
        for k in 0..n {
            let i = (round + k) % n;
            let t = &targets[i];
            let r = measure(&t.client, &t.uri, headers, body.clone(), args.max_tokens).await;
            if !measured {
                if let Err(e) = r {
                    return Err(format!("warm-up request to {} failed: {e}", t.name).into());
                }
                continue;
            }
            match r {
                Ok(s) => {
                    ttft[i].push(s.ttft_us);
                    e2el[i].push(s.e2el_us);
                    this_round[i] = s.ttft_us;
                    if s.hop_us.is_finite() {
                        hop[i].push(s.hop_us);
                    }
                }
                Err(e) => {
                    failed[i] += 1;
                    first_errors[i].get_or_insert(e);
                }
            }
        }
        if measured {
            for (i, v) in this_round.into_iter().enumerate() {
                round_ttft[i].push(v);
            }
        }
    }
    let cpu_after = watched.read()?;
    let cpu = cpu_before.as_ref().map(|b| watched.delta(b, &cpu_after));
    let elapsed = started.elapsed().as_secs_f64();

    let ttft_s: Vec<Summary> = ttft.iter().map(|v| summarize(v)).collect();
    let e2el_s: Vec<Summary> = e2el.iter().map(|v| summarize(v)).collect();
    let hop_s: Vec<Summary> = hop.iter().map(|v| summarize(v)).collect();
    let mut added_diff = Vec::new();
    let mut added_paired = Vec::new();
    for i in 1..n {
        let d = &ttft_s[i];
        let b = &ttft_s[0];
        added_diff.push([d.p50 - b.p50, d.p90 - b.p90, d.p99 - b.p99]);
        let paired: Vec<f64> = round_ttft[i]
            .iter()
            .zip(&round_ttft[0])
            .map(|(x, y)| x - y)
            .filter(|d| d.is_finite())
            .collect();
        added_paired.push(summarize(&paired));
    }
    // CPU per request of each process over the measured rounds: a proxy only serves its own
    // target's requests, so its CPU is divided by those; the sim and the driver serve all.
    let ok: Vec<usize> = ttft.iter().map(Vec::len).collect();
    let all_ok: usize = ok.iter().sum();
    let cpu_json: Vec<Value> = cpu
        .iter()
        .flat_map(|c| c.per.iter())
        .map(|(name, secs)| {
            let per = match *name {
                "gateway" => ok[1],
                "nginx" => ok[2],
                _ => all_ok,
            };
            json!({"process": name, "cpu_s": secs, "requests": per,
                   "cpu_us_per_request": secs * 1e6 / per.max(1) as f64})
        })
        .collect();

    let per_target: Vec<Value> = (0..n)
        .map(|i| {
            json!({
                "target": targets[i].name,
                "ok": ok[i],
                "failed": failed[i],
                "first_error": first_errors[i],
                "ttft_us": summary_json(&ttft_s[i]),
                "e2el_us": summary_json(&e2el_s[i]),
                "recorded_hop_us": summary_json(&hop_s[i]),
            })
        })
        .collect();
    let added: Vec<Value> = (1..n)
        .map(|i| {
            let d = added_diff[i - 1];
            json!({
                "via": targets[i].name,
                "difference_of_percentiles_us": {"p50": d[0], "p90": d[1], "p99": d[2]},
                "paired_difference_us": summary_json(&added_paired[i - 1]),
            })
        })
        .collect();
    Ok(LatencyResult {
        json: json!({
            "rounds": args.rounds,
            "warmup_rounds": args.warmup_rounds,
            "elapsed_s": elapsed,
            "targets": per_target,
            "added_ttft": added,
            "cpu": cpu_json,
            "other_cpu_share": cpu.as_ref().map(|c| c.other_share),
        }),
        ttft: ttft_s,
        added_diff,
        added_paired,
        hop: hop_s,
    })
}

// ---------------------------------------------------------------------------------------------
// Phase 2: open loop

struct OpenLoopTarget {
    ttft: Vec<f64>,
    hop: Vec<f64>,
    e2el: Vec<f64>,
    sent: usize,
    completed: usize,
    failed: usize,
    first_error: Option<String>,
    send_lag_us: Vec<f64>,
    send_secs: f64,
    cpu: Vec<(&'static str, f64)>,
    other_share: Vec<f64>,
}

impl OpenLoopTarget {
    fn new() -> Self {
        Self {
            ttft: Vec::new(),
            hop: Vec::new(),
            e2el: Vec::new(),
            sent: 0,
            completed: 0,
            failed: 0,
            first_error: None,
            send_lag_us: Vec::new(),
            send_secs: 0.0,
            cpu: Vec::new(),
            other_share: Vec::new(),
        }
    }

    fn cpu_of(&self, name: &str) -> f64 {
        self.cpu
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(f64::NAN, |(_, s)| *s)
    }

    fn cpu_us_per_request(&self, name: &str) -> f64 {
        self.cpu_of(name) * 1e6 / self.completed.max(1) as f64
    }
}

struct OpenLoopResult {
    json: Value,
    per_target: Vec<OpenLoopTarget>,
}

async fn one_slice(
    args: &Args,
    t: &Target,
    headers: &Arc<HeaderMap>,
    body: &Bytes,
    watched: &Watched,
    acc: &mut OpenLoopTarget,
) -> Res<Value> {
    let n = (args.rate * args.slice_secs).round().max(1.0) as usize;
    let interval = Duration::from_secs_f64(1.0 / args.rate);
    let before = watched.read()?;
    let mut set = JoinSet::new();
    let start = Instant::now();
    let mut last_send = start;
    let mut lags = Vec::with_capacity(n);
    for k in 0..n {
        let due = start + interval.mul_f64(k as f64);
        tokio::time::sleep_until(due.into()).await;
        let now = Instant::now();
        lags.push(now.saturating_duration_since(due).as_secs_f64() * 1e6);
        last_send = now;
        let (c, uri, h, b) = (
            t.client.clone(),
            t.uri.clone(),
            headers.clone(),
            body.clone(),
        );
        let max_tokens = args.max_tokens;
        set.spawn(async move { measure(&c, &uri, &h, b, max_tokens).await });
    }
    let send_secs = last_send.duration_since(start).as_secs_f64();
    let drain_deadline = Instant::now() + Duration::from_secs_f64(args.drain_secs);
    let (mut completed, mut failed) = (0usize, 0usize);
    let mut ttft = Vec::with_capacity(n);
    loop {
        let next = tokio::time::timeout_at(drain_deadline.into(), set.join_next()).await;
        let result = match next {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(_) => {
                // Bounded: whatever has not finished by now counts as failed.
                failed += set.len();
                acc.first_error
                    .get_or_insert_with(|| "not finished within --drain-secs".into());
                set.abort_all();
                while set.join_next().await.is_some() {}
                break;
            }
        };
        match result {
            Ok(Ok(s)) => {
                completed += 1;
                ttft.push(s.ttft_us);
                acc.ttft.push(s.ttft_us);
                acc.e2el.push(s.e2el_us);
                if s.hop_us.is_finite() {
                    acc.hop.push(s.hop_us);
                }
            }
            Ok(Err(e)) => {
                failed += 1;
                acc.first_error.get_or_insert(e);
            }
            Err(e) => {
                failed += 1;
                acc.first_error.get_or_insert(format!("task: {e}"));
            }
        }
    }
    let after = watched.read()?;
    let cpu = watched.delta(&before, &after);
    acc.sent += n;
    acc.completed += completed;
    acc.failed += failed;
    acc.send_lag_us.extend_from_slice(&lags);
    acc.send_secs += send_secs;
    acc.other_share.push(cpu.other_share);
    for (name, secs) in &cpu.per {
        match acc.cpu.iter_mut().find(|(n, _)| n == name) {
            Some((_, s)) => *s += secs,
            None => acc.cpu.push((name, *secs)),
        }
    }
    let ttft_s = summarize(&ttft);
    let cpu_json: Value = cpu
        .per
        .iter()
        .map(|(name, secs)| {
            (
                (*name).to_owned(),
                json!({"cpu_s": secs, "cpu_us_per_request": secs * 1e6 / completed.max(1) as f64}),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into();
    Ok(json!({
        "target": t.name,
        "sent": n,
        "completed": completed,
        "failed": failed,
        "achieved_send_rate": if send_secs > 0.0 { (n - 1) as f64 / send_secs } else { f64::NAN },
        "send_lag_us": summary_json(&summarize(&lags)),
        "ttft_us": summary_json(&ttft_s),
        "cpu": cpu_json,
        "other_cpu_share": cpu.other_share,
    }))
}

async fn phase_openloop(
    args: &Args,
    targets: &[Target],
    headers: &Arc<HeaderMap>,
    body: &Bytes,
    watched: &Watched,
    warmed: bool,
) -> Res<OpenLoopResult> {
    if !(args.rate.is_finite() && args.rate > 0.0) {
        return Err("--rate must be > 0".into());
    }
    // Warm every target's connection pool and code paths, unless phase 1 just did.
    let warm_up = if warmed { 0 } else { 50 };
    for t in targets {
        for _ in 0..warm_up {
            measure(&t.client, &t.uri, headers, body.clone(), args.max_tokens)
                .await
                .map_err(|e| format!("warm-up request to {} failed: {e}", t.name))?;
        }
    }
    let mut per_target: Vec<OpenLoopTarget> =
        targets.iter().map(|_| OpenLoopTarget::new()).collect();
    let mut slices = Vec::new();
    for rep in 0..args.repeats {
        for (i, t) in targets.iter().enumerate() {
            let mut s = one_slice(args, t, headers, body, watched, &mut per_target[i]).await?;
            s["repeat"] = json!(rep);
            eprintln!(
                "hop: open loop {} repeat {}: {} completed, {} failed, TTFT p99 {:.0} us, other CPU {:.1}%",
                t.name,
                rep,
                s["completed"],
                s["failed"],
                s["ttft_us"]["p99"].as_f64().unwrap_or(f64::NAN),
                s["other_cpu_share"].as_f64().unwrap_or(f64::NAN) * 100.0
            );
            slices.push(s);
        }
    }
    let summary: Vec<Value> = targets
        .iter()
        .zip(&per_target)
        .map(|(t, a)| {
            let cpu: Value = a
                .cpu
                .iter()
                .map(|(name, secs)| {
                    (
                        (*name).to_owned(),
                        json!({"cpu_s": secs, "cpu_us_per_request": a.cpu_us_per_request(name)}),
                    )
                })
                .collect::<serde_json::Map<_, _>>()
                .into();
            json!({
                "target": t.name,
                "sent": a.sent,
                "completed": a.completed,
                "failed": a.failed,
                "first_error": a.first_error,
                "achieved_send_rate": a.sent.saturating_sub(args.repeats) as f64 / a.send_secs,
                "send_lag_us": summary_json(&summarize(&a.send_lag_us)),
                "ttft_us": summary_json(&summarize(&a.ttft)),
                "e2el_us": summary_json(&summarize(&a.e2el)),
                "cpu": cpu,
                "other_cpu_share_max": a.other_share.iter().copied().fold(0.0, f64::max),
            })
        })
        .collect();
    Ok(OpenLoopResult {
        json: json!({
            "arrivals": "constant rate (fixed interval 1/rate; tokio timer, 1 ms granularity)",
            "rate": args.rate,
            "slice_secs": args.slice_secs,
            "repeats": args.repeats,
            "targets": summary,
            "slices": slices,
        }),
        per_target,
    })
}

// ---------------------------------------------------------------------------------------------
// Phase 3: memory with many open streams

#[derive(Default)]
struct MemCounters {
    heads: AtomicUsize,
    first_tokens: AtomicUsize,
    failed: AtomicUsize,
    ended_early: AtomicUsize,
}

/// One long stream: wait for a slot to open it, hold it open reading every frame, and close it
/// (drop the body, which closes the connection) when told to stop.
async fn hold_stream(
    c: HttpClient,
    req: Request<Full<Bytes>>,
    open_slots: Arc<Semaphore>,
    counters: Arc<MemCounters>,
    mut stop: watch::Receiver<bool>,
) {
    let Ok(permit) = open_slots.acquire_owned().await else {
        return;
    };
    let resp = tokio::select! {
        r = c.request(req) => r,
        _ = stop.changed() => return,
    };
    drop(permit);
    let resp = match resp {
        Ok(r) if r.status() == http::StatusCode::OK => r,
        _ => {
            counters.failed.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    counters.heads.fetch_add(1, Ordering::Relaxed);
    let mut body = resp.into_body();
    let mut scanner = SseScanner::new();
    let mut first = false;
    loop {
        tokio::select! {
            f = body.frame() => match f {
                Some(Ok(frame)) => {
                    if !first && let Some(data) = frame.data_ref() {
                        scanner.feed(data, |l| first |= l.kind == DataKind::Content);
                        if first {
                            counters.first_tokens.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                _ => {
                    counters.ended_early.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            },
            _ = stop.changed() => return,
        }
    }
}

/// Waits (bounded) until `done()` holds, polling every 50 ms.
async fn wait_until(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    true
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

async fn mem_one(
    args: &Args,
    name: &'static str,
    base: &str,
    pids: &[u32],
    headers: &HeaderMap,
) -> Res<Value> {
    let uri = chat_uri(base)?;
    let body = request_body(&args.mem_model, args.mem_max_tokens, !args.no_include_usage);
    let c = client::http_client();
    let n = args.mem_streams;
    let (rss_before, hwm_before) = rss_kib(pids)?;
    let counters = Arc::new(MemCounters::default());
    let open_slots = Arc::new(Semaphore::new(args.mem_open_concurrency.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut set = JoinSet::new();
    let opening = Instant::now();
    for _ in 0..n {
        let mut req = Request::new(Full::new(body.clone()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri.clone();
        *req.headers_mut() = headers.clone();
        set.spawn(hold_stream(
            c.clone(),
            req,
            open_slots.clone(),
            counters.clone(),
            stop_rx.clone(),
        ));
    }
    let wait = Duration::from_secs_f64(args.mem_wait_secs);
    let all_answered = wait_until(opening + wait, || {
        counters.heads.load(Ordering::Relaxed) + counters.failed.load(Ordering::Relaxed) >= n
    })
    .await;
    let open_secs = opening.elapsed().as_secs_f64();
    let heads = counters.heads.load(Ordering::Relaxed);
    // Then every open stream relaying tokens: the steady state whose memory counts.
    let all_first = wait_until(Instant::now() + wait, || {
        counters.first_tokens.load(Ordering::Relaxed)
            >= heads.saturating_sub(counters.ended_early.load(Ordering::Relaxed))
    })
    .await;
    let mut rss_open = 0;
    for _ in 0..10 {
        rss_open = rss_open.max(rss_kib(pids)?.0);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, hwm_open) = rss_kib(pids)?;
    let open_now = heads.saturating_sub(counters.ended_early.load(Ordering::Relaxed));
    let _ = stop_tx.send(true);
    let closing = Instant::now();
    let all_closed = tokio::time::timeout(Duration::from_secs(30), async {
        while set.join_next().await.is_some() {}
    })
    .await
    .is_ok();
    if !all_closed {
        set.abort_all();
        while set.join_next().await.is_some() {}
    }
    let close_secs = closing.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (rss_after, hwm_after) = rss_kib(pids)?;
    let per_stream_kib = rss_open.saturating_sub(rss_before) as f64 / open_now.max(1) as f64;
    eprintln!(
        "hop: memory via {name}: {open_now}/{n} streams open, RSS {:.1} -> {:.1} MiB, HWM {:.1} MiB",
        mib(rss_before),
        mib(rss_open),
        mib(hwm_open)
    );
    Ok(json!({
        "via": name,
        "pids": pids,
        "streams_requested": n,
        "heads": heads,
        "failed": counters.failed.load(Ordering::Relaxed),
        "ended_early": counters.ended_early.load(Ordering::Relaxed),
        "first_tokens": counters.first_tokens.load(Ordering::Relaxed),
        "open_at_reading": open_now,
        "all_answered_in_time": all_answered,
        "all_first_tokens_in_time": all_first,
        "open_secs": open_secs,
        "close_secs": close_secs,
        "rss_before_kib": rss_before,
        "hwm_before_kib": hwm_before,
        "rss_open_kib": rss_open,
        "hwm_open_kib": hwm_open,
        "rss_after_close_kib": rss_after,
        "hwm_after_close_kib": hwm_after,
        "rss_per_stream_kib": per_stream_kib,
    }))
}

// ---------------------------------------------------------------------------------------------
// Report

/// The hop cost fleetgate recorded (median over its requests) against what the client saw it
/// add (TTFT p50 through fleetgate − TTFT p50 direct, and the median of the paired differences
/// when the phase pairs requests): their ratio and whether it is within 25 %.
/// Means are compared too: a backend that starts requests only at step boundaries (the sim,
/// vLLM) quantises TTFT, which makes the difference of two medians jumpy while the difference of
/// means stays the expected delay.
fn hop_agreement(recorded: &Summary, added_p50: f64, added_mean: f64, paired_p50: f64) -> String {
    if recorded.n == 0 {
        return "Recorded hop: fleetgate sent no `hop` figure (no kernel stamps?).".to_owned();
    }
    let ratio = recorded.p50 / added_p50;
    let mut line = format!(
        "Recorded hop (fleetgate's `Server-Timing` trailer, {} requests): median {} µs against the client-seen added TTFT p50 {} µs: ratio {:.2} ({} the 25 % goal)",
        recorded.n,
        us(recorded.p50),
        signed_us(added_p50),
        ratio,
        if (ratio - 1.0).abs() <= 0.25 {
            "within"
        } else {
            "outside"
        }
    );
    let _ = write!(
        line,
        "; mean {} µs against the added TTFT mean {} µs: ratio {:.2}",
        us(recorded.mean),
        signed_us(added_mean),
        recorded.mean / added_mean
    );
    if paired_p50.is_finite() {
        let _ = write!(
            line,
            "; paired-difference median {} µs, ratio {:.2}",
            signed_us(paired_p50),
            recorded.p50 / paired_p50
        );
    }
    line.push('.');
    line
}

fn hop_json(
    phase: &str,
    recorded: &Summary,
    added_p50: f64,
    added_mean: f64,
    paired_p50: f64,
) -> Value {
    json!({
        "phase": phase,
        "recorded_hop_us": summary_json(recorded),
        "client_added_ttft_p50_us": added_p50,
        "client_added_ttft_mean_us": added_mean,
        "ratio_recorded_to_added_mean": recorded.mean / added_mean,
        "client_paired_difference_p50_us": paired_p50,
        "ratio_recorded_to_added_p50": recorded.p50 / added_p50,
    })
}

fn us(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.0}")
    } else {
        "–".into()
    }
}

fn signed_us(v: f64) -> String {
    if v.is_finite() {
        format!("{v:+.0}")
    } else {
        "–".into()
    }
}

fn met(ok: Option<bool>) -> &'static str {
    match ok {
        Some(true) => "met",
        Some(false) => "**not met**",
        None => "not measured",
    }
}

fn environment() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    json!({"nproc": nproc(), "cpu_model": cpu, "kernel": kernel})
}

async fn run(args: Args) -> Res<()> {
    let phases: Vec<&str> = args.phases.iter().map(|s| s.trim()).collect();
    for p in &phases {
        if !["latency", "openloop", "memory"].contains(p) {
            return Err(format!("unknown phase `{p}` (latency, openloop, memory)").into());
        }
    }
    let bases = [&args.direct, &args.fleetgate, &args.nginx];
    let mut targets = Vec::new();
    for (name, base) in NAMES.iter().zip(bases) {
        targets.push(Target {
            name,
            client: client::http_client(),
            uri: api_uri(base)?,
        });
    }
    let headers = Arc::new(request_headers(args.api_key.as_deref())?);
    let body = api_body(&args.model, args.max_tokens, !args.no_include_usage);
    let watched = Watched {
        groups: vec![
            ("gateway", args.gateway_pid.into_iter().collect()),
            ("nginx", args.nginx_pids.clone()),
            ("sim", args.sim_pid.into_iter().collect()),
        ],
    };
    // Fail fast with the reason when a target does not answer correctly.
    for t in &targets {
        measure(&t.client, &t.uri, &headers, body.clone(), args.max_tokens)
            .await
            .map_err(|e| format!("{} ({}) does not answer correctly: {e}", t.name, t.uri))?;
    }

    let env = environment();
    let mut md = String::new();
    let mut out = json!({
        "environment": env,
        "request": {
            "model": args.model,
            "max_tokens": args.max_tokens,
            "stream": true,
            "include_usage": !args.no_include_usage,
            "body_bytes": body.len(),
        },
        "targets": {"direct": args.direct, "fleetgate": args.fleetgate, "nginx": args.nginx},
        "pids": {"gateway": args.gateway_pid, "nginx": args.nginx_pids, "sim": args.sim_pid},
        "driver_threads": args.driver_threads,
        "label": args.label,
    });
    let _ = writeln!(
        md,
        "## fleetgate hop cost{}{}\n\n{} × {}, kernel {}; streamed chat, max_tokens {}, {}. \
         Times in µs; \"added\" = via − direct in the same run.\n",
        if args.label.is_empty() { "" } else { ": " },
        args.label,
        env["nproc"],
        env["cpu_model"].as_str().unwrap_or(""),
        env["kernel"].as_str().unwrap_or(""),
        args.max_tokens,
        if args.no_include_usage {
            "no include_usage (fleetgate asks for usage upstream and removes the usage chunk)"
        } else {
            "include_usage"
        }
    );

    let mut added_p50 = None;
    let mut hop_rows: Vec<Value> = Vec::new();
    let mut added_p99 = None;
    if phases.contains(&"latency") {
        eprintln!(
            "hop: latency at concurrency 1, {} rounds after {} warm-up rounds",
            args.rounds, args.warmup_rounds
        );
        let lat = phase_latency(&args, &targets, &headers, &body, &watched).await?;
        let _ = writeln!(
            md,
            "### 1. Latency at concurrency 1 ({} rounds, rotating order)\n",
            args.rounds
        );
        let _ = writeln!(
            md,
            "| target | ok | failed | TTFT p50 | p90 | p99 | mean | E2EL p50 | p90 | p99 | mean |\n|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for (i, t) in lat.json["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let s = &lat.ttft[i];
            let e = &t["e2el_us"];
            let f = |v: &Value| us(v.as_f64().unwrap_or(f64::NAN));
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                NAMES[i],
                t["ok"],
                t["failed"],
                us(s.p50),
                us(s.p90),
                us(s.p99),
                us(s.mean),
                f(&e["p50"]),
                f(&e["p90"]),
                f(&e["p99"]),
                f(&e["mean"])
            );
        }
        let _ = writeln!(
            md,
            "\n| added TTFT | Δp50 | Δp90 | Δp99 | paired p50 | paired p90 | paired p99 |\n|---|---|---|---|---|---|---|"
        );
        for ((name, d), p) in NAMES[1..]
            .iter()
            .zip(&lat.added_diff)
            .zip(&lat.added_paired)
        {
            let _ = writeln!(
                md,
                "| {} − direct | {} | {} | {} | {} | {} | {} |",
                name,
                signed_us(d[0]),
                signed_us(d[1]),
                signed_us(d[2]),
                signed_us(p.p50),
                signed_us(p.p90),
                signed_us(p.p99)
            );
        }
        let _ = writeln!(
            md,
            "\nOther CPU during this phase: {:.1}% of the machine.",
            lat.json["other_cpu_share"].as_f64().unwrap_or(f64::NAN) * 100.0
        );
        let _ = writeln!(md, "\nCPU per request at concurrency 1 (µs): {}\n", {
            lat.json["cpu"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| {
                    format!(
                        "{} {}",
                        c["process"].as_str().unwrap_or(""),
                        us(c["cpu_us_per_request"].as_f64().unwrap_or(f64::NAN))
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        });
        let _ = writeln!(
            md,
            "{}\n",
            hop_agreement(
                &lat.hop[1],
                lat.added_diff[0][0],
                lat.ttft[1].mean - lat.ttft[0].mean,
                lat.added_paired[0].p50,
            )
        );
        hop_rows.push(hop_json(
            "latency_c1",
            &lat.hop[1],
            lat.added_diff[0][0],
            lat.ttft[1].mean - lat.ttft[0].mean,
            lat.added_paired[0].p50,
        ));
        added_p50 = Some(lat.added_diff[0][0]);
        added_p99 = Some(lat.added_diff[0][2]);
        out["latency_c1"] = lat.json;
    }

    let mut ol_p99_ok = None;
    let mut cpu_ratio = None;
    let mut ol_figures = (f64::NAN, f64::NAN, f64::NAN, f64::NAN);
    if phases.contains(&"openloop") {
        eprintln!(
            "hop: open loop at {}/s, {} s slices × {} rotations",
            args.rate, args.slice_secs, args.repeats
        );
        let warmed = phases.contains(&"latency");
        let ol = phase_openloop(&args, &targets, &headers, &body, &watched, warmed).await?;
        let _ = writeln!(
            md,
            "### 2. Open loop at {} streamed requests/s (constant rate, {} s slices × {} rotations)\n",
            args.rate, args.slice_secs, args.repeats
        );
        let _ = writeln!(
            md,
            "| target | completed | failed | send rate/s | send lag p99 | TTFT p50 | TTFT p99 | added p50 | added p99 | gateway CPU/req | nginx CPU/req | sim CPU/req | driver CPU/req | other CPU (max) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        let sums: Vec<Summary> = ol.per_target.iter().map(|a| summarize(&a.ttft)).collect();
        for (i, a) in ol.per_target.iter().enumerate() {
            let s = &sums[i];
            let added = |v: f64, b: f64| {
                if i == 0 {
                    "–".to_owned()
                } else {
                    signed_us(v - b)
                }
            };
            let lag = summarize(&a.send_lag_us);
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1}% |",
                NAMES[i],
                a.completed,
                a.failed,
                a.sent.saturating_sub(args.repeats) as f64 / a.send_secs,
                us(lag.p99),
                us(s.p50),
                us(s.p99),
                added(s.p50, sums[0].p50),
                added(s.p99, sums[0].p99),
                us(a.cpu_us_per_request("gateway")),
                us(a.cpu_us_per_request("nginx")),
                us(a.cpu_us_per_request("sim")),
                us(a.cpu_us_per_request("driver")),
                a.other_share.iter().copied().fold(0.0, f64::max) * 100.0
            );
        }
        let _ = writeln!(
            md,
            "\nCPU per request = utime+stime of the process over its target's slices ÷ requests completed in them (the proxy columns of the other rows show its idle cost). Other CPU = machine busy time outside these processes (other programs, unattributed kernel work) as a share of both cores: a noise flag.\n"
        );
        let fg_hop = summarize(&ol.per_target[1].hop);
        let _ = writeln!(
            md,
            "{}\n",
            hop_agreement(
                &fg_hop,
                sums[1].p50 - sums[0].p50,
                sums[1].mean - sums[0].mean,
                f64::NAN,
            )
        );
        hop_rows.push(hop_json(
            "open_loop",
            &fg_hop,
            sums[1].p50 - sums[0].p50,
            sums[1].mean - sums[0].mean,
            f64::NAN,
        ));
        let fg_added = sums[1].p99 - sums[0].p99;
        let ng_added = sums[2].p99 - sums[0].p99;
        if fg_added.is_finite() && ng_added.is_finite() {
            ol_p99_ok = Some(fg_added <= ng_added);
        }
        let fg_cpu = ol.per_target[1].cpu_us_per_request("gateway");
        let ng_cpu = ol.per_target[2].cpu_us_per_request("nginx");
        if args.gateway_pid.is_some() && !args.nginx_pids.is_empty() && ng_cpu > 0.0 {
            cpu_ratio = Some(fg_cpu / ng_cpu);
        }
        ol_figures = (fg_added, ng_added, fg_cpu, ng_cpu);
        out["open_loop"] = ol.json;
    }

    let mut peak_rss_mib = None;
    if phases.contains(&"memory") {
        let mut mem = Vec::new();
        let plan = [
            (
                "fleetgate",
                args.mem_fleetgate.as_deref(),
                args.gateway_pid.into_iter().collect::<Vec<_>>(),
            ),
            ("nginx", args.mem_nginx.as_deref(), args.nginx_pids.clone()),
        ];
        for (name, base, pids) in plan {
            let Some(base) = base else {
                eprintln!("hop: memory via {name} skipped (no --mem-{name})");
                continue;
            };
            if pids.is_empty() {
                eprintln!("hop: memory via {name} skipped (no pid given)");
                continue;
            }
            eprintln!("hop: memory: {} open streams via {name}", args.mem_streams);
            mem.push(mem_one(&args, name, base, &pids, &headers).await?);
        }
        let _ = writeln!(
            md,
            "### 3. Memory with {} open streams (MiB)\n\n| via | open | RSS before | RSS with streams open | VmHWM | RSS after close | KiB per stream |\n|---|---|---|---|---|---|---|",
            args.mem_streams
        );
        for m in &mem {
            let k = |f: &str| mib(m[f].as_u64().unwrap_or(0));
            let _ = writeln!(
                md,
                "| {} | {}/{} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
                m["via"].as_str().unwrap_or(""),
                m["open_at_reading"],
                m["streams_requested"],
                k("rss_before_kib"),
                k("rss_open_kib"),
                k("hwm_open_kib"),
                k("rss_after_close_kib"),
                m["rss_per_stream_kib"].as_f64().unwrap_or(f64::NAN)
            );
            if m["via"] == "fleetgate"
                && m["open_at_reading"].as_u64() == Some(args.mem_streams as u64)
            {
                peak_rss_mib = Some(k("hwm_open_kib"));
            }
        }
        let _ = writeln!(md);
        out["memory"] = Value::Array(mem);
    }

    if !args.no_targets {
        targets_table(
            &mut md,
            &args,
            [added_p50, added_p99],
            ol_p99_ok,
            ol_figures,
            cpu_ratio,
            peak_rss_mib,
        );
        out["targets_met"] = json!({
            "added_ttft_p50_c1_le_60us": added_p50.map(|v| v <= 60.0),
            "added_ttft_p99_c1_le_250us": added_p99.map(|v| v <= 250.0),
            "open_loop_added_p99_le_nginx": ol_p99_ok,
            "gateway_cpu_le_1_5x_nginx": cpu_ratio.map(|r| r <= 1.5),
            "peak_rss_le_64mib": peak_rss_mib.map(|v| v <= 64.0),
        });
    }

    out["recorded_hop"] = Value::Array(hop_rows);

    if let Some(dir) = args.out.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_vec_pretty(&out)?)?;
    print!("{md}");
    eprintln!("hop: wrote {}", args.out.display());
    Ok(())
}

/// The targets, each marked met or not from this run's figures.
fn targets_table(
    md: &mut String,
    args: &Args,
    [added_p50, added_p99]: [Option<f64>; 2],
    ol_p99_ok: Option<bool>,
    ol_figures: (f64, f64, f64, f64),
    cpu_ratio: Option<f64>,
    peak_rss_mib: Option<f64>,
) {
    let _ = writeln!(
        md,
        "### Targets\n\n| target | goal | measured | |\n|---|---|---|---|"
    );
    let _ = writeln!(
        md,
        "| added TTFT p50, concurrency 1 | ≤ 60 µs | {} µs | {} |",
        added_p50.map_or("–".into(), signed_us),
        met(added_p50.map(|v| v <= 60.0))
    );
    let _ = writeln!(
        md,
        "| added TTFT p99, concurrency 1 | ≤ 250 µs | {} µs | {} |",
        added_p99.map_or("–".into(), signed_us),
        met(added_p99.map(|v| v <= 250.0))
    );
    let _ = writeln!(
        md,
        "| added TTFT p99 at {}/s | ≤ nginx's | fleetgate {} µs, nginx {} µs | {} |",
        args.rate,
        signed_us(ol_figures.0),
        signed_us(ol_figures.1),
        met(ol_p99_ok)
    );
    let _ = writeln!(
        md,
        "| gateway CPU per streamed request | ≤ 1.5 × nginx | {} µs vs {} µs ({}) | {} |",
        us(ol_figures.2),
        us(ol_figures.3),
        cpu_ratio.map_or("–".into(), |r| format!("{r:.2}×")),
        met(cpu_ratio.map(|r| r <= 1.5))
    );
    let _ = writeln!(
        md,
        "| peak RSS, {} open streams | ≤ 64 MiB | {} | {} |",
        args.mem_streams,
        peak_rss_mib.map_or("–".into(), |v| format!("{v:.1} MiB")),
        met(peak_rss_mib.map(|v| v <= 64.0))
    );
}
