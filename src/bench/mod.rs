//! `fleetgate bench`: a load generator compatible with `vllm bench serve` (its flags, its
//! metric definitions, its result keys) and with the seed's `bench_client.py --config
//! settings.json --output result.json`, that can also run the comparison the product exists
//! for: the same prompts and arrival schedule sent interleaved to the backend directly and
//! through the gateway (`--compare direct=URL gateway=URL`), with a verdict.
//!
//! The client runs on one thread with its own event loop (one core), so its CPU time per
//! request is reported and it cannot borrow the machine's other core from what it measures.

pub mod dataset;
pub mod measure;
pub mod report;
pub mod sweep;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Uri};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand_distr::Distribution;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use dataset::{Prompt, RequestClass};
use measure::Outcome;
use report::{Goodput, Summary, Thresholds};

/// Exit codes beyond 0 (success) and 1 (could not run).
pub const EXIT_SLA: u8 = 2;
pub const EXIT_COMPARE: u8 = 3;
pub const EXIT_INTERRUPTED: u8 = 130;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointType {
    /// `/v1/chat/completions` with `messages`.
    OpenaiChat,
    /// `/v1/completions` with `prompt`.
    Openai,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatasetName {
    Random,
    Sharegpt,
}

#[derive(clap::Subcommand, Debug, Clone)]
pub enum BenchCommand {
    /// Compare two result files (fleetgate bench or vllm bench serve): every latency and
    /// throughput key side by side with the change.
    Diff { a: PathBuf, b: PathBuf },
}

/// `fleetgate bench` flags: `vllm bench serve`'s names, plus the comparison, SLA and labels.
#[derive(clap::Args, Debug, Clone)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: Option<BenchCommand>,
    /// The seed's settings.json (endpoint, api_key_env, model, concurrency, duration_seconds,
    /// request_distribution, metrics, warmup_requests). Its keys win over the flags.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Write the result JSON to this file (the seed's `--output result.json`).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Server base URL, e.g. http://127.0.0.1:8080 (the gateway) or http://vllm:8000.
    #[arg(long, alias = "base_url")]
    pub base_url: Option<String>,
    /// API path (default by --endpoint-type: /v1/chat/completions or /v1/completions).
    #[arg(long)]
    pub endpoint: Option<String>,
    #[arg(long, value_enum, default_value = "openai-chat")]
    pub endpoint_type: EndpointType,
    /// Model name to send (default: the first id of GET /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Extra request header, `Name=value` or `Name: value` (repeatable).
    #[arg(long = "header", value_name = "NAME=VALUE")]
    pub headers: Vec<String>,
    /// Environment variable holding the API key, sent as `Authorization: Bearer` (keys are
    /// never read from files or flags).
    #[arg(long, default_value = "OPENAI_API_KEY")]
    pub api_key_env: String,
    /// With --compare: another variable for one target, `NAME=VAR` (e.g. direct=VLLM_API_KEY).
    #[arg(long = "target-key-env", value_name = "NAME=VAR")]
    pub target_key_env: Vec<String>,
    #[arg(long, value_enum, default_value = "random")]
    pub dataset_name: DatasetName,
    /// ShareGPT JSON file (with --dataset-name sharegpt).
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: u64,
    #[arg(long, default_value_t = 128)]
    pub random_output_len: u64,
    /// Lengths drawn from [len × (1 − r), len × (1 + r)].
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// The model's tokenizer.json (Hugging Face format): exact token counts for ShareGPT
    /// filtering and random prompts (without it: characters / 4).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Output length of every ShareGPT request (default: the conversation's own reply length).
    #[arg(long)]
    pub sharegpt_output_len: Option<u64>,
    /// Requests per second, Poisson arrivals (with --burstiness 1); `inf` sends all at once.
    #[arg(long, default_value = "inf")]
    pub request_rate: String,
    /// Gamma shape of the arrival gaps (1: Poisson; < 1 burstier; > 1 more even), as vLLM.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Run for this long instead of --num-prompts requests (prompts are reused in turn).
    #[arg(long)]
    pub duration_seconds: Option<f64>,
    /// Comma-separated: ttft, tpot, itl, e2el.
    #[arg(long, default_value = "ttft,tpot,itl")]
    pub percentile_metrics: String,
    /// Comma-separated percentiles, e.g. 50,95,99.
    #[arg(long, default_value = "99")]
    pub metric_percentiles: String,
    /// Service-level objectives for goodput, e.g. `--goodput ttft:500 tpot:50` (ms).
    #[arg(long, num_args = 1.., value_name = "METRIC:MS")]
    pub goodput: Vec<String>,
    #[arg(long, default_value_t = 0)]
    pub num_warmups: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Ask the server to ignore end-of-sequence (vLLM's `ignore_eos`): exact output lengths.
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long)]
    pub save_result: bool,
    #[arg(long)]
    pub result_filename: Option<String>,
    #[arg(long)]
    pub result_dir: Option<PathBuf>,
    /// Label stored with the result, `key=value` (repeatable): hardware, quantisation, ...
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// Two targets, `NAME=BASE_URL NAME=BASE_URL` (the first is the baseline): the same prompts
    /// and arrivals, interleaved between them.
    #[arg(long, num_args = 2, value_name = "NAME=URL")]
    pub compare: Vec<String>,
    /// Compare verdict: largest change of a mean, in percent.
    #[arg(long, default_value_t = 3.0)]
    pub max_mean_delta_pct: f64,
    /// Compare verdict: largest change of a P95, in percent.
    #[arg(long, default_value_t = 5.0)]
    pub max_p95_delta_pct: f64,
    /// Objectives to meet, e.g. `ttft_p99_ms=1500,e2el_p95_ms=60000,error_rate=0.01`; exit 2
    /// with a table when one is violated.
    #[arg(long)]
    pub sla: Option<String>,
    /// A series of runs, e.g. `rate=2,4,8,16,32` or `concurrency=1,4,16`: a table, an SVG chart
    /// of TTFT P99 and throughput with the knee marked (`--sweep-chart`).
    #[arg(long)]
    pub sweep: Option<String>,
    /// Where the sweep's SVG chart goes.
    #[arg(long, default_value = "fleetgate-sweep.svg")]
    pub sweep_chart: PathBuf,
    /// Capacity planning: the QPS the fleet must serve.
    #[arg(long)]
    pub target_qps: Option<f64>,
    /// Capacity planning: headroom factor (the seed uses 1.2–1.3).
    #[arg(long, default_value_t = 1.25)]
    pub redundancy: f64,
    /// Capacity planning: how many instances served the measured endpoint.
    #[arg(long, default_value_t = 1)]
    pub instances: u32,
    /// Give up on a request after this long.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout_seconds: f64,
    /// No live progress line.
    #[arg(long, alias = "disable-tqdm")]
    pub no_progress: bool,
}

/// The seed's settings.json.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub endpoint: String,
    #[serde(default)]
    pub api_key_env: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub concurrency: Option<usize>,
    #[serde(default)]
    pub duration_seconds: Option<f64>,
    #[serde(default)]
    pub request_distribution: Vec<RequestClass>,
    #[serde(default)]
    pub metrics: Option<SettingsMetrics>,
    #[serde(default)]
    pub warmup_requests: Option<usize>,
    #[serde(default)]
    pub request_rate: Option<f64>,
    #[serde(default)]
    pub num_prompts: Option<usize>,
}

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct SettingsMetrics {
    #[serde(default = "yes")]
    pub record_ttft: bool,
    #[serde(default = "yes")]
    pub record_tpot: bool,
    #[serde(default)]
    pub percentiles: Vec<f64>,
}

fn yes() -> bool {
    true
}

/// A server the run sends to.
#[derive(Debug, Clone)]
pub struct Target {
    pub name: String,
    pub base: String,
    pub uri: Uri,
    pub headers: HeaderMap,
}

/// Everything a run needs, resolved from the flags and settings.
#[derive(Debug, Clone)]
pub struct Plan {
    pub targets: Vec<Target>,
    pub model: String,
    pub chat: bool,
    pub prompts: Vec<Prompt>,
    /// Bodies by prompt (the same bytes for every target).
    pub bodies: Vec<Bytes>,
    pub request_rate: f64,
    pub burstiness: f64,
    pub max_concurrency: Option<usize>,
    pub duration: Option<Duration>,
    pub num_prompts: usize,
    pub warmups: usize,
    pub seed: u64,
    pub timeout: Duration,
    pub selected: Vec<String>,
    pub percentiles: Vec<f64>,
    pub goodput: Goodput,
    pub sla: Vec<report::Objective>,
    pub thresholds: Thresholds,
    pub labels: serde_json::Map<String, Value>,
    pub dataset_note: String,
    pub settings: Value,
    pub progress: bool,
    pub sweep: Option<(sweep::Axis, Vec<f64>)>,
    pub sweep_chart: PathBuf,
    /// (target QPS, redundancy, instances measured).
    pub capacity: Option<(f64, f64, u32)>,
}

/// What the engine gives back.
#[derive(Debug, Default)]
pub struct RunResult {
    pub outcomes: Vec<Outcome>,
    pub duration: Duration,
    pub interrupted: bool,
    /// CPU time of the client's thread (user + system).
    pub client_cpu: Option<Duration>,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim() {
        "inf" | "infinity" | "Infinity" => Ok(f64::INFINITY),
        t => match t.parse::<f64>() {
            Ok(r) if r > 0.0 => Ok(r),
            _ => Err(format!(
                "--request-rate `{s}`: a positive number of requests per second, or inf"
            )),
        },
    }
}

fn header_pair(s: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (k, v) = s
        .split_once(':')
        .filter(|(k, _)| !k.contains('='))
        .or_else(|| s.split_once('='))
        .ok_or_else(|| format!("--header `{s}`: write Name=value or \"Name: value\""))?;
    let name = HeaderName::try_from(k.trim()).map_err(|e| format!("--header `{k}`: {e}"))?;
    let value = HeaderValue::try_from(v.trim()).map_err(|e| format!("--header `{k}`: {e}"))?;
    Ok((name, value))
}

fn kv(s: &str, what: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("{what} `{s}`: write NAME=VALUE"))
}

/// Split a full endpoint URL (settings.json's `endpoint`) into base and path.
fn split_endpoint(url: &str) -> (String, Option<String>) {
    for p in ["/v1/chat/completions", "/v1/completions"] {
        if let Some(base) = url.trim_end_matches('/').strip_suffix(p) {
            return (base.to_owned(), Some(p.to_owned()));
        }
    }
    (url.trim_end_matches('/').to_owned(), None)
}

fn base_of(url: &str) -> Result<String, String> {
    let u = url.trim().trim_end_matches('/');
    let u = u.strip_suffix("/v1").unwrap_or(u);
    let parsed: Uri = u
        .parse()
        .map_err(|e| format!("`{url}` is not a URL: {e}"))?;
    match parsed.scheme_str() {
        Some("http") => Ok(u.to_owned()),
        Some("https") => Err(format!(
            "`{url}`: the bench client speaks plain http (put it next to the server, or measure the TLS listener with another client)"
        )),
        _ => Err(format!("`{url}` needs http://host:port")),
    }
}

/// Apply settings.json over the flags (its keys win).
fn apply_settings(args: &mut BenchArgs, s: &Settings) -> Result<(), String> {
    let (base, endpoint) = split_endpoint(&s.endpoint);
    args.base_url = Some(base);
    if let Some(e) = endpoint {
        if e == "/v1/completions" {
            args.endpoint_type = EndpointType::Openai;
        }
        args.endpoint = Some(e);
    }
    if let Some(k) = &s.api_key_env {
        args.api_key_env = k.clone();
    }
    if let Some(m) = &s.model {
        args.model = Some(m.clone());
    }
    if let Some(c) = s.concurrency {
        if c == 0 {
            return Err("settings: concurrency must be ≥ 1".into());
        }
        args.max_concurrency = Some(c);
    }
    if let Some(d) = s.duration_seconds {
        args.duration_seconds = Some(d);
    }
    if let Some(w) = s.warmup_requests {
        args.num_warmups = w;
    }
    if let Some(r) = s.request_rate {
        args.request_rate = r.to_string();
    }
    if let Some(n) = s.num_prompts {
        args.num_prompts = n;
    }
    if let Some(m) = &s.metrics {
        let mut sel = Vec::new();
        if m.record_ttft {
            sel.push("ttft");
        }
        if m.record_tpot {
            sel.push("tpot");
        }
        sel.extend(["itl", "e2el"]);
        args.percentile_metrics = sel.join(",");
        if !m.percentiles.is_empty() {
            args.metric_percentiles = m
                .percentiles
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(",");
        }
    }
    Ok(())
}

/// The model: the flag, else the first id of `GET /v1/models`.
async fn discover_model(target: &Target) -> Result<String, String> {
    use http_body_util::BodyExt;
    let client = crate::client::http_client();
    let uri: Uri = format!("{}/v1/models", target.base)
        .parse()
        .map_err(|e| format!("{e}"))?;
    let mut req = http::Request::get(uri.clone())
        .body(http_body_util::Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    *req.headers_mut() = target.headers.clone();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .map_err(|_| format!("GET {uri}: no answer within 10 s"))?
        .map_err(|e| format!("GET {uri}: {e} (is the server running, and is --base-url right?)"))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if !status.is_success() {
        return Err(format!(
            "GET {uri} answered {status}: {} (pass --model, or check the key in the variable named by --api-key-env)",
            String::from_utf8_lossy(&body)
                .chars()
                .take(300)
                .collect::<String>()
        ));
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| format!("GET {uri}: {e}"))?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("GET {uri}: no model listed; pass --model"))
}

/// Resolve flags (and settings.json) into a plan; the model may need a request.
pub async fn plan(mut args: BenchArgs) -> Result<Plan, String> {
    let Some(path) = args.config.clone() else {
        return plan_with(args, None, Value::Null).await;
    };
    let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let s: Settings =
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    apply_settings(&mut args, &s)?;
    if !s.request_distribution.is_empty() {
        args.dataset_name = DatasetName::Random;
    }
    let settings = serde_json::to_value(&s).unwrap_or(Value::Null);
    plan_with(args, Some(s.request_distribution), settings).await
}

async fn plan_with(
    args: BenchArgs,
    classes: Option<Vec<RequestClass>>,
    settings_json: Value,
) -> Result<Plan, String> {
    let rate = parse_rate(&args.request_rate)?;
    if !(args.burstiness.is_finite() && args.burstiness > 0.0) {
        return Err("--burstiness must be > 0 (1 = Poisson)".into());
    }
    if args.max_concurrency == Some(0) {
        return Err("--max-concurrency must be ≥ 1".into());
    }
    let duration = match args.duration_seconds {
        Some(d) if d > 0.0 && d.is_finite() => Some(Duration::from_secs_f64(d)),
        Some(_) => return Err("--duration-seconds must be > 0".into()),
        None => None,
    };
    if duration.is_some() && rate.is_infinite() && args.max_concurrency.is_none() {
        return Err("a timed run needs --max-concurrency (settings: concurrency) or a finite --request-rate".into());
    }
    if args.num_prompts == 0 {
        return Err("--num-prompts must be ≥ 1".into());
    }
    let chat = args.endpoint_type == EndpointType::OpenaiChat;
    let endpoint = args.endpoint.clone().unwrap_or_else(|| {
        if chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
        .to_owned()
    });
    if !endpoint.starts_with('/') {
        return Err(format!("--endpoint `{endpoint}` must start with /"));
    }
    if chat != endpoint.ends_with("/chat/completions") {
        return Err(format!(
            "--endpoint {endpoint} and --endpoint-type {} disagree: chat requests go to /v1/chat/completions, completions to /v1/completions (the \"KeyError: 'choices'\" case)",
            if chat { "openai-chat" } else { "openai" }
        ));
    }
    let mut common = HeaderMap::new();
    for h in &args.headers {
        let (k, v) = header_pair(h)?;
        if k == http::header::AUTHORIZATION {
            eprintln!(
                "fleetgate bench: warning: a key given with --header is visible to every user of this machine (ps); prefer --api-key-env"
            );
        }
        common.insert(k, v);
    }
    let key_from = |var: &str| -> Result<Option<HeaderValue>, String> {
        match std::env::var(var) {
            Ok(k) if !k.trim().is_empty() => {
                let mut v = HeaderValue::try_from(format!("Bearer {}", k.trim()))
                    .map_err(|_| format!("${var} holds characters not allowed in a header"))?;
                v.set_sensitive(true);
                Ok(Some(v))
            }
            _ => Ok(None),
        }
    };
    let default_key = key_from(&args.api_key_env)?;
    let mut per_target_key = std::collections::HashMap::new();
    for t in &args.target_key_env {
        let (name, var) = kv(t, "--target-key-env")?;
        let v =
            key_from(&var)?.ok_or_else(|| format!("--target-key-env {name}: ${var} is not set"))?;
        per_target_key.insert(name, v);
    }
    let mut targets = Vec::new();
    let raw: Vec<(String, String)> = if args.compare.is_empty() {
        let base = args
            .base_url
            .clone()
            .ok_or("--base-url is required (or --config settings.json, or --compare)")?;
        vec![("target".to_owned(), base)]
    } else {
        if args.base_url.is_some() && args.config.is_none() {
            return Err(
                "--base-url and --compare exclude each other: --compare names both targets".into(),
            );
        }
        let pairs = args
            .compare
            .iter()
            .map(|c| kv(c, "--compare"))
            .collect::<Result<Vec<_>, _>>()?;
        if pairs[0].0 == pairs[1].0 {
            return Err("--compare: the two targets need different names".into());
        }
        pairs
    };
    for (name, url) in raw {
        let base = base_of(&url)?;
        let uri: Uri = format!("{base}{endpoint}")
            .parse()
            .map_err(|e| format!("`{base}{endpoint}`: {e}"))?;
        let mut headers = common.clone();
        if !headers.contains_key(http::header::AUTHORIZATION)
            && let Some(k) = per_target_key.get(&name).or(default_key.as_ref())
        {
            headers.insert(http::header::AUTHORIZATION, k.clone());
        }
        targets.push(Target {
            name,
            base,
            uri,
            headers,
        });
    }
    if let Some(unknown) = per_target_key
        .keys()
        .find(|k| !targets.iter().any(|t| &t.name == *k))
    {
        return Err(format!(
            "--target-key-env {unknown}: no such --compare target"
        ));
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        None => discover_model(&targets[targets.len() - 1]).await?,
    };
    let selected: Vec<String> = args
        .percentile_metrics
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect();
    if let Some(bad) = selected
        .iter()
        .find(|m| !report::METRICS.iter().any(|(k, _, _)| k == m))
    {
        return Err(format!(
            "--percentile-metrics: `{bad}` is not one of ttft, tpot, itl, e2el"
        ));
    }
    let mut percentiles = Vec::new();
    for p in args
        .metric_percentiles
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let v: f64 = p
            .parse()
            .ok()
            .filter(|v: &f64| (0.0..=100.0).contains(v))
            .ok_or_else(|| format!("--metric-percentiles: `{p}` is not a percentile in 0..100"))?;
        percentiles.push(v);
    }
    let mut goodput = Vec::new();
    for g in &args.goodput {
        let (m, v) = g
            .split_once(':')
            .ok_or_else(|| format!("--goodput `{g}`: write metric:ms, e.g. ttft:500"))?;
        if !matches!(m, "ttft" | "tpot" | "e2el") {
            return Err(format!(
                "--goodput `{g}`: the metric is one of ttft, tpot, e2el"
            ));
        }
        let v: f64 = v
            .parse()
            .map_err(|_| format!("--goodput `{g}`: `{v}` is not milliseconds"))?;
        goodput.push((m.to_owned(), v));
    }
    let sweep = match &args.sweep {
        Some(s) => {
            if args.compare.len() == 2 {
                return Err(
                    "--sweep measures one target; run the comparison at the rate you care about"
                        .into(),
                );
            }
            // The table and the chart read P99.
            if !percentiles.iter().any(|p| (*p - 99.0).abs() < 1e-9) {
                percentiles.push(99.0);
            }
            Some(sweep::parse(s)?)
        }
        None => None,
    };
    let capacity = match args.target_qps {
        Some(q) if q > 0.0 && q.is_finite() => {
            if !(args.redundancy.is_finite() && args.redundancy >= 1.0) {
                return Err("--redundancy must be ≥ 1 (the seed uses 1.2–1.3)".into());
            }
            Some((q, args.redundancy, args.instances.max(1)))
        }
        Some(_) => return Err("--target-qps must be > 0".into()),
        None => None,
    };
    // For SLA names, every percentile counts as measured.
    let sla = match &args.sla {
        Some(s) => report::parse_sla(s, &percentiles)?,
        None => Vec::new(),
    };
    let (counter, counting) = match &args.tokenizer {
        Some(p) => (
            dataset::Counter::load(p)?,
            format!("token counts by the tokenizer {}", p.display()),
        ),
        None => (
            dataset::Counter::Approximate,
            dataset::APPROXIMATION.to_owned(),
        ),
    };
    let (prompts, dataset_note) = match (classes, args.dataset_name) {
        (Some(c), _) if !c.is_empty() => (
            dataset::classes(args.num_prompts, &c, args.seed, &counter)?,
            format!(
                "settings.json request_distribution ({} classes); {counting}",
                c.len()
            ),
        ),
        (_, DatasetName::Random) => (
            dataset::random(
                args.num_prompts,
                args.random_input_len,
                args.random_output_len,
                args.random_range_ratio,
                args.seed,
                &counter,
            ),
            format!(
                "random: {} in / {} out tokens (range ratio {}); {counting}",
                args.random_input_len, args.random_output_len, args.random_range_ratio
            ),
        ),
        (_, DatasetName::Sharegpt) => {
            let path = args
                .dataset_path
                .as_ref()
                .ok_or("--dataset-name sharegpt needs --dataset-path (e.g. ShareGPT_V3_unfiltered_cleaned_split.json)")?;
            let (p, stats) = dataset::sharegpt(
                path,
                args.num_prompts,
                args.sharegpt_output_len,
                args.seed,
                &counter,
            )?;
            let short = if p.len() < args.num_prompts {
                format!(" (only {} of the {} asked for)", p.len(), args.num_prompts)
            } else {
                String::new()
            };
            (
                p,
                format!("sharegpt {}: {stats}{short}; {counting}", path.display()),
            )
        }
    };
    let bodies = prompts
        .iter()
        .map(|p| dataset::body(p, &model, chat, args.ignore_eos))
        .collect();
    let mut labels = serde_json::Map::new();
    for l in &args.labels {
        let (k, v) = kv(l, "--label")?;
        labels.insert(k, Value::String(v));
    }
    labels
        .entry("model")
        .or_insert(Value::String(model.clone()));
    labels.insert(
        "fleetgate_version".into(),
        Value::String(env!("CARGO_PKG_VERSION").to_owned()),
    );
    labels.insert("date".into(), Value::String(now_rfc3339()));
    let settings = if settings_json.is_null() {
        json!({
            "base_url": args.base_url,
            "endpoint": endpoint,
            "endpoint_type": if chat { "openai-chat" } else { "openai" },
            "dataset_name": format!("{:?}", args.dataset_name).to_lowercase(),
            "dataset_path": args.dataset_path,
            "num_prompts": args.num_prompts,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
            "sharegpt_output_len": args.sharegpt_output_len,
            "tokenizer": args.tokenizer,
            "request_rate": args.request_rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "duration_seconds": args.duration_seconds,
            "percentile_metrics": selected,
            "metric_percentiles": percentiles,
            "goodput": args.goodput,
            "num_warmups": args.num_warmups,
            "seed": args.seed,
            "ignore_eos": args.ignore_eos,
            "compare": args.compare,
            "sla": args.sla,
        })
    } else {
        settings_json
    };
    Ok(Plan {
        targets,
        model,
        chat,
        prompts,
        bodies,
        request_rate: rate,
        burstiness: args.burstiness,
        max_concurrency: args.max_concurrency,
        duration,
        num_prompts: args.num_prompts,
        warmups: args.num_warmups,
        seed: args.seed,
        timeout: Duration::from_secs_f64(args.request_timeout_seconds.max(0.001)),
        selected,
        percentiles,
        goodput,
        sla,
        thresholds: Thresholds {
            mean_pct: args.max_mean_delta_pct,
            p95_pct: args.max_p95_delta_pct,
        },
        labels,
        dataset_note,
        settings,
        progress: !args.no_progress,
        sweep,
        sweep_chart: args.sweep_chart.clone(),
        capacity,
    })
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// CPU time (user + system) of the calling thread, from /proc (Linux; clock ticks of 10 ms).
fn thread_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    // After the command: state is field 3, utime 14, stime 15 (1-based) → 11 and 12 here.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

/// Which target and prompt the j-th arrival carries. One target: prompt j. Two: each prompt
/// goes to both, in consecutive arrivals, the order alternating (AB, BA, AB, ...) so neither
/// target always goes second.
pub fn assignment(j: usize, targets: usize, prompts: usize) -> (u8, usize) {
    if targets < 2 {
        return (0, j % prompts);
    }
    let pair = j / 2;
    let first = (pair % 2) as u8;
    let t = if j % 2 == 0 { first } else { 1 - first };
    (t, pair % prompts)
}

/// Run the plan on a thread of its own (one core, its own event loop) until done or `stop`.
pub async fn execute(plan: Arc<Plan>, stop: CancellationToken) -> Result<RunResult, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("fleetgate-bench".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                    return;
                }
            };
            let result = rt.block_on(engine(plan, stop));
            let _ = tx.send(Ok(result));
        })
        .map_err(|e| e.to_string())?;
    rx.await
        .map_err(|_| "the bench thread ended without a result".to_owned())?
}

async fn engine(plan: Arc<Plan>, stop: CancellationToken) -> RunResult {
    let client = crate::client::http_client();
    // Warm-up requests, not measured (connections opened, caches warm).
    if plan.warmups > 0 {
        let sem = Arc::new(tokio::sync::Semaphore::new(
            plan.max_concurrency.unwrap_or(plan.warmups),
        ));
        let mut set = tokio::task::JoinSet::new();
        let start = Instant::now();
        for j in 0..plan.warmups * plan.targets.len() {
            let (t, p) = assignment(j, plan.targets.len(), plan.bodies.len());
            let (plan, client, sem) = (plan.clone(), client.clone(), sem.clone());
            set.spawn(async move {
                let _permit = sem.acquire_owned().await;
                let target = &plan.targets[usize::from(t)];
                measure::send(
                    &client,
                    &target.uri,
                    &target.headers,
                    plan.bodies[p].clone(),
                    0,
                    start,
                    plan.timeout,
                )
                .await
            });
        }
        tokio::select! {
            _ = stop.cancelled() => return RunResult { interrupted: true, ..RunResult::default() },
            _ = async { while set.join_next().await.is_some() {} } => {}
        }
    }
    let cpu_before = thread_cpu();
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let progress = plan.progress && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let total = match plan.duration {
        Some(_) => None,
        None => Some(plan.bodies.len() * plan.targets.len()),
    };
    let ticker = progress.then(|| {
        let (done, failed) = (done.clone(), failed.clone());
        tokio::spawn(async move {
            let mut last = (Instant::now(), 0u64);
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let d = done.load(Ordering::Relaxed);
                let f = failed.load(Ordering::Relaxed);
                let now = Instant::now();
                let rate = (d - last.1) as f64 / now.duration_since(last.0).as_secs_f64();
                last = (now, d);
                let of = total.map_or(String::new(), |t| format!("/{t}"));
                eprint!(
                    "\r\x1b[2K{d}{of} done, {f} failed, {rate:.1} req/s, {:.0} s",
                    started.elapsed().as_secs_f64()
                );
            }
        })
    });
    let sem = plan
        .max_concurrency
        .map(|n| Arc::new(tokio::sync::Semaphore::new(n)));
    let gate_in_loop = plan.request_rate.is_infinite();
    let mut rng = SmallRng::seed_from_u64(plan.seed);
    let gamma =
        rand_distr::Gamma::new(plan.burstiness, 1.0 / (plan.request_rate * plan.burstiness)).ok();
    let mut set = tokio::task::JoinSet::new();
    let mut outcomes = Vec::with_capacity(total.unwrap_or(1024));
    let mut next = Duration::ZERO;
    let mut interrupted = false;
    let mut j = 0usize;
    loop {
        if total.is_some_and(|t| j >= t) {
            break;
        }
        if let Some(d) = plan.duration
            && started.elapsed() >= d
        {
            break;
        }
        // Collect what finished, so a long run does not hold every task.
        while let Some(r) = set.try_join_next() {
            if let Ok(o) = r {
                outcomes.push(o);
            }
        }
        if !plan.request_rate.is_infinite() {
            let at = tokio::time::Instant::from_std(started + next);
            tokio::select! {
                _ = stop.cancelled() => { interrupted = true; break; }
                _ = tokio::time::sleep_until(at) => {}
            }
        }
        let permit = match (&sem, gate_in_loop) {
            (Some(s), true) => tokio::select! {
                _ = stop.cancelled() => { interrupted = true; break; }
                p = s.clone().acquire_owned() => p.ok(),
            },
            _ => None,
        };
        if stop.is_cancelled() {
            interrupted = true;
            break;
        }
        let (t, p) = assignment(j, plan.targets.len(), plan.bodies.len());
        let (plan2, client2, sem2, done2, failed2) = (
            plan.clone(),
            client.clone(),
            sem.clone(),
            done.clone(),
            failed.clone(),
        );
        set.spawn(async move {
            let _permit = match (permit, sem2) {
                (Some(p), _) => Some(p),
                (None, Some(s)) => s.acquire_owned().await.ok(),
                (None, None) => None,
            };
            let target = &plan2.targets[usize::from(t)];
            let mut o = measure::send(
                &client2,
                &target.uri,
                &target.headers,
                plan2.bodies[p].clone(),
                plan2.prompts[p].input_tokens,
                started,
                plan2.timeout,
            )
            .await;
            o.target = t;
            o.prompt = p;
            if o.ok() {
                done2.fetch_add(1, Ordering::Relaxed);
            } else {
                failed2.fetch_add(1, Ordering::Relaxed);
            }
            o
        });
        j += 1;
        if let Some(g) = &gamma {
            next += Duration::from_secs_f64(g.sample(&mut rng));
        }
    }
    if interrupted {
        set.abort_all();
    }
    tokio::select! {
        _ = stop.cancelled(), if !interrupted => {
            interrupted = true;
            set.abort_all();
            while let Some(r) = set.join_next().await {
                if let Ok(o) = r {
                    outcomes.push(o);
                }
            }
        }
        _ = async {
            while let Some(r) = set.join_next().await {
                if let Ok(o) = r {
                    outcomes.push(o);
                }
            }
        } => {}
    }
    let duration = started.elapsed();
    if let Some(t) = ticker {
        t.abort();
        eprint!("\r\x1b[2K");
    }
    let client_cpu = match (cpu_before, thread_cpu()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    // In arrival order (by send time), as vLLM lists its per-request arrays.
    outcomes.sort_by_key(|o| o.sent_at);
    RunResult {
        outcomes,
        duration,
        interrupted,
        client_cpu,
    }
}

/// The whole report: terminal text, result JSON and the exit code.
pub struct Report {
    pub text: String,
    pub json: Value,
    pub exit: u8,
    pub summaries: Vec<Summary>,
}

pub fn build_report(plan: &Plan, run: &RunResult) -> Report {
    let dur = run.duration.as_secs_f64();
    let mut text = String::new();
    let mut summaries = Vec::new();
    let mut per_target = serde_json::Map::new();
    for (i, t) in plan.targets.iter().enumerate() {
        let mine: Vec<&Outcome> = run
            .outcomes
            .iter()
            .filter(|o| usize::from(o.target) == i)
            .collect();
        let s = Summary::of(&mine, dur, &plan.percentiles, &plan.goodput);
        if plan.targets.len() > 1 {
            text.push_str(&format!("\n[{}] {}\n", t.name, t.base));
        }
        let rate = if plan.targets.len() > 1 {
            plan.request_rate / plan.targets.len() as f64
        } else {
            plan.request_rate
        };
        text.push_str(&report::render(
            &s,
            &plan.selected,
            plan.max_concurrency,
            rate,
        ));
        let mut m = report::vllm_json(&s, &mine, &plan.selected);
        m.extend(report::seed_json(&s));
        if let Some(g) = &s.gateway_ms {
            m.insert(
                "gateway_time_ms".into(),
                json!({"mean": g.mean, "median": g.median, "max": g.max,
                       "percentiles": g.percentiles.iter().map(|(p, v)| (format!("p{}", report::p_word(*p)), json!(v))).collect::<serde_json::Map<_, _>>()}),
            );
        }
        per_target.insert(t.name.clone(), Value::Object(m));
        summaries.push(s);
    }
    let mut exit = 0u8;
    let mut json = serde_json::Map::new();
    json.insert(
        "date".into(),
        json!(time::OffsetDateTime::now_utc().unix_timestamp()),
    );
    json.insert(
        "endpoint_type".into(),
        json!(if plan.chat { "openai-chat" } else { "openai" }),
    );
    json.insert("model_id".into(), json!(plan.model));
    json.insert("num_prompts".into(), json!(plan.num_prompts));
    json.insert(
        "request_rate".into(),
        if plan.request_rate.is_finite() {
            json!(plan.request_rate)
        } else {
            json!("inf")
        },
    );
    json.insert("burstiness".into(), json!(plan.burstiness));
    json.insert("max_concurrency".into(), json!(plan.max_concurrency));
    json.insert("dataset".into(), json!(plan.dataset_note));
    json.insert("settings".into(), plan.settings.clone());
    json.insert("labels".into(), Value::Object(plan.labels.clone()));
    json.insert("interrupted".into(), json!(run.interrupted));
    let requests = run.outcomes.len().max(1) as f64;
    json.insert(
        "client".into(),
        json!({
            "threads": 1,
            "cpu_seconds": run.client_cpu.map(|c| c.as_secs_f64()),
            "cpu_us_per_request": run.client_cpu.map(|c| c.as_secs_f64() * 1e6 / requests),
            "cpu_share_of_one_core": run.client_cpu.map(|c| c.as_secs_f64() / dur.max(1e-9)),
        }),
    );
    if let Some(cpu) = run.client_cpu {
        text.push_str(&format!(
            "client: one thread, {:.2} s CPU = {:.1} µs per request ({:.0} % of one core)\n",
            cpu.as_secs_f64(),
            cpu.as_secs_f64() * 1e6 / requests,
            cpu.as_secs_f64() / dur.max(1e-9) * 100.0
        ));
    }
    if plan.targets.len() == 1 {
        if let Some(Value::Object(m)) = per_target.remove(&plan.targets[0].name) {
            json.extend(m);
        }
    } else {
        let deltas = report::compare(
            &summaries[0],
            &summaries[1],
            &plan.selected,
            plan.thresholds,
        );
        text.push('\n');
        text.push_str(&report::render_compare(
            [&plan.targets[0].name, &plan.targets[1].name],
            &deltas,
            &summaries[1],
        ));
        let pass = deltas.iter().all(|d| d.pass);
        if !pass {
            exit = EXIT_COMPARE;
        }
        json.insert("targets".into(), Value::Object(per_target));
        json.insert(
            "comparison".into(),
            json!({
                "baseline": plan.targets[0].name,
                "measured": plan.targets[1].name,
                "interleaving": "each prompt to both targets in consecutive arrivals, order alternating",
                "thresholds_pct": {"mean": plan.thresholds.mean_pct, "p95": plan.thresholds.p95_pct},
                "deltas": deltas,
                "pass": pass,
            }),
        );
    }
    if !plan.sla.is_empty() {
        let measured = &summaries[summaries.len() - 1];
        let v = report::violations(measured, &plan.sla);
        json.insert(
            "sla".into(),
            json!({
                "objectives": plan.sla.iter().map(|o| json!({"name": o.name, "limit": o.limit})).collect::<Vec<_>>(),
                "violated": v.iter().map(|(o, got)| json!({"name": o.name, "limit": o.limit, "measured": got})).collect::<Vec<_>>(),
            }),
        );
        if v.is_empty() {
            text.push_str("SLA: every objective met\n");
        } else {
            text.push_str(&report::render_violations(&v));
            exit = EXIT_SLA;
        }
    }
    if let Some((q, red, inst)) = plan.capacity {
        let measured = &summaries[summaries.len() - 1];
        let at_sla = report::violations(measured, &plan.sla).is_empty() && measured.completed > 0;
        let thr = at_sla.then_some(measured.request_throughput);
        text.push_str(&capacity_text(q, red, inst, thr, "this run"));
        json.insert("capacity".into(), sweep::capacity_json(q, red, thr, inst));
    }
    if summaries.iter().all(|s| s.completed == 0) {
        exit = 1;
    }
    if run.interrupted {
        text.push_str("interrupted: the figures cover the requests that finished before Ctrl-C\n");
        exit = EXIT_INTERRUPTED;
    }
    Report {
        text,
        json: Value::Object(json),
        exit,
        summaries,
    }
}

fn capacity_text(q: f64, red: f64, inst: u32, thr: Option<f64>, source: &str) -> String {
    match thr.and_then(|t| sweep::capacity(q, red, t, inst).map(|n| (t, n))) {
        Some((t, n)) => format!(
            "capacity: {t:.2} req/s measured on {inst} instance(s) at the SLA ({source}) → {:.2} per instance; {q} QPS × {red} redundancy needs {n} instance(s)\n",
            t / f64::from(inst)
        ),
        None => format!(
            "capacity: unknown — {source} does not meet the SLA (or completed nothing); lower the load or sweep (--sweep rate=...)\n"
        ),
    }
}

/// Run every point of the sweep; the report holds the table, the chart's path and capacity.
async fn run_sweep(plan: Arc<Plan>, stop: CancellationToken) -> Result<(Report, String), String> {
    let Some((axis, values)) = plan.sweep.clone() else {
        return Err("no sweep".into());
    };
    let mut points = Vec::new();
    let mut runs = Vec::new();
    let mut interrupted = false;
    for (i, x) in values.iter().enumerate() {
        let mut p = (*plan).clone();
        match axis {
            sweep::Axis::Rate => p.request_rate = *x,
            sweep::Axis::Concurrency => p.max_concurrency = Some(*x as usize),
        }
        if i > 0 {
            p.warmups = 0;
        }
        eprintln!(
            "fleetgate bench: sweep point {} of {}: {} = {x}",
            i + 1,
            values.len(),
            axis.name()
        );
        let result = execute(Arc::new(p.clone()), stop.clone()).await?;
        let r = build_report(&p, &result);
        interrupted |= result.interrupted;
        points.push(sweep::Point {
            x: *x,
            summary: r.summaries[0].clone(),
            meets_sla: false,
        });
        let mut j = r.json;
        if let Value::Object(m) = &mut j {
            m.insert("sweep_value".into(), json!(x));
        }
        runs.push(j);
        if result.interrupted {
            break;
        }
    }
    sweep::mark_sla(&mut points, &plan.sla);
    let knee = sweep::knee(axis, &points);
    let mut text = sweep::table(axis, &points, knee, !plan.sla.is_empty());
    let chart = sweep::svg(axis, &points, knee);
    let mut exit = 0;
    let best = points
        .iter()
        .filter(|p| p.meets_sla)
        .map(|p| p.summary.request_throughput)
        .fold(None, |m: Option<f64>, t| Some(m.map_or(t, |m| m.max(t))));
    if !plan.sla.is_empty() && best.is_none() {
        text.push_str("SLA: no point of the sweep meets it\n");
        exit = EXIT_SLA;
    }
    let mut json = serde_json::Map::new();
    json.insert("model_id".into(), json!(plan.model));
    json.insert("labels".into(), Value::Object(plan.labels.clone()));
    json.insert("settings".into(), plan.settings.clone());
    json.insert(
        "sweep".into(),
        json!({
            "axis": match axis { sweep::Axis::Rate => "rate", sweep::Axis::Concurrency => "concurrency" },
            "values": values,
            "knee": knee.map(|k| points[k].x),
            "meets_sla": points.iter().map(|p| p.meets_sla).collect::<Vec<_>>(),
            "runs": runs,
        }),
    );
    if let Some((q, red, inst)) = plan.capacity {
        let source = if plan.sla.is_empty() {
            "the sweep's best throughput; give --sla to plan at an objective"
        } else {
            "the best sweep point meeting the SLA"
        };
        let thr = if plan.sla.is_empty() {
            points
                .iter()
                .map(|p| p.summary.request_throughput)
                .fold(None, |m: Option<f64>, t| Some(m.map_or(t, |m| m.max(t))))
        } else {
            best
        };
        text.push_str(&capacity_text(q, red, inst, thr, source));
        json.insert("capacity".into(), sweep::capacity_json(q, red, thr, inst));
    }
    if interrupted {
        text.push_str("interrupted: the sweep stopped at Ctrl-C\n");
        exit = EXIT_INTERRUPTED;
    }
    json.insert("interrupted".into(), json!(interrupted));
    Ok((
        Report {
            text,
            json: Value::Object(json),
            exit,
            summaries: points.into_iter().map(|p| p.summary).collect(),
        },
        chart,
    ))
}

/// Where `--save-result` / `--output` writes.
fn result_path(args: &BenchArgs, plan: &Plan) -> Option<PathBuf> {
    if let Some(o) = &args.output {
        return Some(o.clone());
    }
    if !args.save_result && args.result_filename.is_none() {
        return None;
    }
    let name = args.result_filename.clone().unwrap_or_else(|| {
        let stamp = time::OffsetDateTime::now_utc();
        let rate = if plan.request_rate.is_finite() {
            format!("{}", plan.request_rate)
        } else {
            "inf".into()
        };
        format!(
            "fleetgate-bench-{}qps-{}-{:04}{:02}{:02}-{:02}{:02}{:02}.json",
            rate,
            plan.model.replace('/', "_"),
            stamp.year(),
            u8::from(stamp.month()),
            stamp.day(),
            stamp.hour(),
            stamp.minute(),
            stamp.second()
        )
    });
    Some(match &args.result_dir {
        Some(d) => d.join(name),
        None => PathBuf::from(name),
    })
}

/// `fleetgate bench ...`: returns the process exit code.
pub async fn run(args: BenchArgs, stop: CancellationToken) -> u8 {
    if let Some(BenchCommand::Diff { a, b }) = &args.command {
        let read = |p: &PathBuf| -> Result<Value, String> {
            let t = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
            serde_json::from_slice(&t).map_err(|e| format!("{}: {e}", p.display()))
        };
        return match read(a).and_then(|x| read(b).and_then(|y| report::diff(&x, &y))) {
            Ok(text) => {
                print!("{text}");
                0
            }
            Err(e) => {
                eprintln!("fleetgate bench diff: {e}");
                1
            }
        };
    }
    let plan = match plan(args.clone()).await {
        Ok(p) => Arc::new(p),
        Err(e) => {
            eprintln!("fleetgate bench: {e}");
            return 1;
        }
    };
    eprintln!(
        "fleetgate bench: model {}, {} → {}; {}",
        plan.model,
        plan.targets
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join(" & "),
        plan.targets
            .iter()
            .map(|t| t.uri.to_string())
            .collect::<Vec<_>>()
            .join(" & "),
        plan.dataset_note
    );
    let report = if plan.sweep.is_some() {
        match run_sweep(plan.clone(), stop).await {
            Ok((report, chart)) => {
                match std::fs::write(&plan.sweep_chart, chart) {
                    Ok(()) => eprintln!(
                        "fleetgate bench: chart written to {}",
                        plan.sweep_chart.display()
                    ),
                    Err(e) => eprintln!(
                        "fleetgate bench: cannot write {}: {e}",
                        plan.sweep_chart.display()
                    ),
                }
                report
            }
            Err(e) => {
                eprintln!("fleetgate bench: {e}");
                return 1;
            }
        }
    } else {
        match execute(plan.clone(), stop).await {
            Ok(r) => build_report(&plan, &r),
            Err(e) => {
                eprintln!("fleetgate bench: {e}");
                return 1;
            }
        }
    };
    print!("{}", report.text);
    if let Some(path) = result_path(&args, &plan) {
        let text = serde_json::to_vec_pretty(&report.json).unwrap_or_default();
        match std::fs::write(&path, text) {
            Ok(()) => eprintln!("fleetgate bench: result written to {}", path.display()),
            Err(e) => {
                eprintln!("fleetgate bench: cannot write {}: {e}", path.display());
                return 1;
            }
        }
    }
    report.exit
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaving_sends_each_prompt_to_both_targets_alternating_order() {
        let seq: Vec<(u8, usize)> = (0..8).map(|j| assignment(j, 2, 100)).collect();
        assert_eq!(
            seq,
            [
                (0, 0),
                (1, 0),
                (1, 1),
                (0, 1),
                (0, 2),
                (1, 2),
                (1, 3),
                (0, 3)
            ]
        );
        assert_eq!(assignment(5, 1, 3), (0, 2));
    }

    #[test]
    fn settings_endpoint_splits_into_base_and_path() {
        assert_eq!(
            split_endpoint("http://gw:8080/v1/chat/completions"),
            ("http://gw:8080".into(), Some("/v1/chat/completions".into()))
        );
        assert_eq!(
            split_endpoint("http://gw:8080/"),
            ("http://gw:8080".into(), None)
        );
        assert_eq!(base_of("http://gw:8080/v1/").unwrap(), "http://gw:8080");
        assert!(base_of("gw:8080").is_err());
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("inf").unwrap().is_infinite());
        assert_eq!(
            header_pair("Authorization: Bearer x").unwrap().0,
            "authorization"
        );
        assert_eq!(header_pair("x-a=b=c").unwrap().1, "b=c");
    }
}
