//! The plan of a run: the flags and settings resolved into targets (URL, headers, key), the
//! model, the prompts and their request bodies, the arrival schedule and what to report.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Uri};
use serde_json::{Value, json};

use super::args::{
    BenchArgs, DatasetName, Settings, apply_settings, base_of, header_pair, kv, parse_rate,
};
use super::dataset::{self, Prompt};
use super::spec::{self, EndpointType, HotConversation, MultiTurn, RequestClass, Target};
use super::summary::{Goodput, METRICS};
use super::verdict::{Objective, Thresholds, parse_sla};

/// Everything a run needs, resolved from the flags and settings.
#[derive(Debug, Clone)]
pub struct Plan {
    pub targets: Vec<Target>,
    pub model: String,
    pub endpoint_type: EndpointType,
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
    pub sla: Vec<Objective>,
    pub thresholds: Thresholds,
    /// Percentiles measured because the compare verdict needs them, not because they were asked.
    pub added_percentiles: Vec<f64>,
    pub labels: serde_json::Map<String, Value>,
    /// vLLM's `label` (a bare `--label NAME`).
    pub label: Option<String>,
    /// vLLM's `tokenizer_id`: the tokenizer that counted the prompts (none: characters / 4).
    pub tokenizer_id: Option<String>,
    pub dataset_note: String,
    pub settings: Value,
    pub progress: bool,
    pub sweep: Option<(spec::Axis, Vec<f64>)>,
    pub sweep_chart: PathBuf,
    /// (target QPS, redundancy, instances measured).
    pub capacity: Option<(f64, f64, u32)>,
    /// What the run leaves out of what was asked, and why (printed as `note:` lines).
    pub notes: Vec<String>,
    /// vLLM's `ignore_eos`, asked of every request.
    pub ignore_eos: bool,
    /// Merged into every request body last (sampling flags, `--extra-body`,
    /// `--served-model-name`).
    pub body_extra: serde_json::Map<String, Value>,
    /// Agent-shaped load instead of independent prompts (`--multi-turn-conversations`): then
    /// `prompts` holds each conversation's user messages, turn by turn.
    pub multi_turn: Option<MultiTurn>,
}

/// The model: the flag, else the first id of `GET /v1/models`.
async fn discover_model(target: &Target) -> Result<String, String> {
    use http_body_util::BodyExt;
    let client = fleetgate_protocol::client::http_client();
    let first = target.base.split(", ").next().unwrap_or_default();
    let uri: Uri = format!("{first}/v1/models")
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

/// Read and check settings.json: its JSON, its keys (unknown ones refused) and every value,
/// before anything is sent. An error names the file and the key (`fleetgate bench` exits 64).
pub fn read_settings(path: &std::path::Path) -> Result<Settings, String> {
    let at = |e: String| format!("settings file {}: {e}", path.display());
    let text = std::fs::read(path).map_err(|e| at(format!("cannot read it: {e}")))?;
    let s: Settings = serde_json::from_slice(&text).map_err(|e| at(e.to_string()))?;
    check_settings(&s).map_err(at)?;
    Ok(s)
}

fn check_settings(s: &Settings) -> Result<(), String> {
    let (base, _) = super::args::split_endpoint(&s.endpoint);
    base_of(&base).map_err(|e| format!("endpoint: {e}"))?;
    if s.concurrency == Some(0) {
        return Err("concurrency: must be ≥ 1".into());
    }
    if let Some(d) = s.duration_seconds
        && !(d.is_finite() && d > 0.0)
    {
        return Err(format!("duration_seconds: {d} is not a duration > 0"));
    }
    if let Some(r) = s.request_rate
        && (r.is_nan() || r <= 0.0)
    {
        return Err(format!("request_rate: {r} is not a rate > 0"));
    }
    if s.num_prompts == Some(0) {
        return Err("num_prompts: must be ≥ 1".into());
    }
    if let Some(m) = &s.metrics
        && let Some(p) = m.percentiles.iter().find(|p| !(0.0..=100.0).contains(*p))
    {
        return Err(format!(
            "metrics.percentiles: {p} is not a percentile in 0..100"
        ));
    }
    let classes = &s.request_distribution;
    for (i, c) in classes.iter().enumerate() {
        let name = c.name.clone().unwrap_or_else(|| format!("#{i}"));
        if !(c.weight.is_finite() && c.weight >= 0.0) {
            return Err(format!(
                "request_distribution[{i}] ({name}): weight {} must be ≥ 0",
                c.weight
            ));
        }
        if c.input_tokens == 0 || c.output_tokens == 0 {
            return Err(format!(
                "request_distribution[{i}] ({name}): input_tokens and output_tokens must be ≥ 1"
            ));
        }
        if let Some(n) = &c.name
            && classes[..i].iter().any(|d| d.name.as_ref() == Some(n))
        {
            return Err(format!(
                "request_distribution[{i}]: the name {n:?} is used twice (the report breaks results down by class)"
            ));
        }
    }
    if !classes.is_empty() && classes.iter().map(|c| c.weight).sum::<f64>() <= 0.0 {
        return Err(
            "request_distribution: every weight is 0; give at least one class a weight > 0".into(),
        );
    }
    Ok(())
}

/// Resolve flags (and settings.json) into a plan; the model may need a request.
pub async fn plan(mut args: BenchArgs) -> Result<Plan, String> {
    let Some(path) = args.config.clone() else {
        return plan_with(args, None, Value::Null).await;
    };
    let s = read_settings(&path)?;
    apply_settings(&mut args, &s);
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
    // What a `vllm bench serve` line asked for that would change the measurement and is not
    // implemented here: nothing is sent.
    if !args.vllm_not_implemented.is_empty() {
        return Err(format!(
            "this vllm bench serve command line asks for what fleetgate bench does not implement, so nothing was sent: {}",
            args.vllm_not_implemented.join("; ")
        ));
    }
    if let (Some(t), Some(b)) = (args.endpoint_type, &args.backend)
        && t != b.kind
    {
        eprintln!(
            "fleetgate bench: warning: --backend {} is ignored: --endpoint-type {} gives the request format",
            b.name,
            t.name()
        );
    }
    // The order of the steps is the order the errors are reported in.
    let (rate, duration) = schedule(&args)?;
    let (kind, endpoint) = endpoint(&args)?;
    let targets = targets(&args, &endpoint, kind)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => discover_model(&targets[targets.len() - 1]).await?,
    };
    let (selected, mut notes) = selected_metrics(&args, kind)?;
    let mut percentiles = percentiles(&args)?;
    let goodput = goodput(&args, kind)?;
    let (thresholds, added_percentiles) = verdict_thresholds(&args, &mut percentiles)?;
    let sweep = sweep_series(&args, &mut percentiles)?;
    let capacity = capacity(&args)?;
    // A percentile an SLA objective names is measured (added to the percentiles).
    let sla = match &args.sla {
        Some(s) => parse_sla(s, &mut percentiles)?,
        None => Vec::new(),
    };
    if let Some(o) = sla.iter().find(|o| !objective_exists(&o.name, kind)) {
        return Err(format!(
            "--sla {}: {} answers have no such figure (not streamed: no TTFT, TPOT or ITL); objectives on e2el or error_rate",
            o.name,
            kind.name()
        ));
    }
    if args.multi_turn_hot_share.is_some() && args.multi_turn_conversations.is_none() {
        return Err(
            "--multi-turn-hot-share makes one of the conversations hot: give --multi-turn-conversations too".into(),
        );
    }
    let (prompts, dataset_note, multi_turn) = match args.multi_turn_conversations {
        Some(c) => {
            let (mt, prompts, note) = multi_turn(&args, c, kind, &targets)?;
            if args.max_concurrency.is_some() {
                notes.push(
                    "--max-concurrency is not used: the conversations are the concurrency".into(),
                );
            }
            if args.num_warmups > 0 {
                notes.push(
                    "--num-warmups is not sent: a warm-up would fill the prefix cache the run measures".into(),
                );
            }
            (prompts, note, Some(mt))
        }
        None => {
            let (p, n) = prompts(&args, classes)?;
            (p, n, None)
        }
    };
    if !kind.streams() && matches!(args.dataset_name, DatasetName::Random) {
        notes.push(format!(
            "{} requests have no output: --random-output-len is not sent (vLLM ignores it too)",
            kind.name()
        ));
    }
    let body_extra = body_extra(&args)?;
    let bodies = prompts
        .iter()
        .map(|p| dataset::body(p, &model, kind, args.ignore_eos, &body_extra))
        .collect();
    let (labels, label) = labels(&args, &model)?;
    // A multi-turn run sends one request per turn of each conversation, and per lane of the
    // hot conversation's turns.
    let num_prompts = if multi_turn.is_some() {
        prompts.len()
    } else {
        args.num_prompts
    };
    let settings = if settings_json.is_null() {
        settings_echo(&args, &endpoint, kind, &selected, &percentiles)
    } else {
        settings_json
    };
    Ok(Plan {
        targets,
        model,
        endpoint_type: kind,
        prompts,
        bodies,
        request_rate: rate,
        burstiness: args.burstiness,
        max_concurrency: args.max_concurrency,
        duration,
        num_prompts,
        warmups: if multi_turn.is_some() {
            0
        } else {
            args.num_warmups
        },
        seed: args.seed,
        timeout: Duration::from_secs_f64(args.request_timeout_seconds.max(0.001)),
        selected,
        percentiles,
        goodput,
        sla,
        thresholds,
        added_percentiles,
        labels,
        label,
        tokenizer_id: args
            .tokenizer
            .as_ref()
            .filter(|p| p.exists())
            .map(|p| p.display().to_string()),
        dataset_note,
        settings,
        progress: !args.no_progress,
        sweep,
        sweep_chart: args.sweep_chart.clone(),
        capacity,
        notes,
        ignore_eos: args.ignore_eos,
        body_extra,
        multi_turn,
    })
}

/// What every request body gets on top of the prompt's: the sampling flags, then
/// `--extra-body`, then `--served-model-name` as the model (vLLM's order).
fn body_extra(args: &BenchArgs) -> Result<serde_json::Map<String, Value>, String> {
    let mut extra = serde_json::Map::new();
    let floats = [
        ("temperature", args.temperature),
        ("top_p", args.top_p),
        ("min_p", args.min_p),
        ("frequency_penalty", args.frequency_penalty),
        ("presence_penalty", args.presence_penalty),
        ("repetition_penalty", args.repetition_penalty),
    ];
    for (k, v) in floats {
        if let Some(v) = v {
            if !v.is_finite() {
                return Err(format!("--{}: {v} is not a number", k.replace('_', "-")));
            }
            extra.insert(k.into(), json!(v));
        }
    }
    if let Some(k) = args.top_k {
        extra.insert("top_k".into(), json!(k));
    }
    if let Some(text) = &args.extra_body {
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(m)) => extra.extend(m),
            Ok(_) => {
                return Err(format!(
                    "--extra-body `{text}`: a JSON object, e.g. '{{\"top_k\": 20}}'"
                ));
            }
            Err(e) => return Err(format!("--extra-body is not JSON: {e}")),
        }
    }
    if let Some(name) = &args.served_model_name {
        extra.insert("model".into(), json!(name));
    }
    Ok(extra)
}

/// The multi-turn shape, and each conversation's user messages as prompts (conversation c's
/// turn t at `MultiTurn::index(c, t)`), every one asking for `--random-output-len` tokens.
fn multi_turn(
    args: &BenchArgs,
    conversations: usize,
    kind: EndpointType,
    targets: &[Target],
) -> Result<(MultiTurn, Vec<Prompt>, String), String> {
    if conversations == 0 || args.multi_turn_turns == 0 {
        return Err("--multi-turn-conversations and --multi-turn-turns must be ≥ 1".into());
    }
    if !matches!(
        kind,
        EndpointType::OpenaiChat | EndpointType::OpenaiResponses | EndpointType::AnthropicMessages
    ) {
        return Err(format!(
            "--multi-turn-conversations: {} has no conversation; use --endpoint-type openai-chat, openai-responses or anthropic-messages",
            kind.name()
        ));
    }
    if targets.len() != 1 || args.sweep.is_some() || args.duration_seconds.is_some() {
        return Err(
            "--multi-turn-conversations runs against one --base-url, without --compare, --sweep or --duration-seconds".into(),
        );
    }
    if !(args.multi_turn_think_ms.is_finite() && args.multi_turn_think_ms >= 0.0) {
        return Err("--multi-turn-think-ms must be ≥ 0".into());
    }
    let hot = match args.multi_turn_hot_share {
        None => None,
        Some(f) if !(f > 0.0 && f < 1.0) => {
            return Err(format!(
                "--multi-turn-hot-share {f}: the hot conversation's share of all requests must be between 0 and 1, both excluded (e.g. 0.33)"
            ));
        }
        Some(_) if conversations < 2 => {
            return Err(
                "--multi-turn-hot-share needs --multi-turn-conversations ≥ 2: the hot conversation's share is of all conversations' requests".into(),
            );
        }
        Some(share) => Some(HotConversation {
            share,
            lanes: HotConversation::lanes_for(share, conversations),
        }),
    };
    let (counter, _) = counter(args)?;
    let n = conversations * args.multi_turn_turns;
    // The system prompt from a seed of its own, so it does not change with the conversations.
    let system = match args.multi_turn_system_len {
        0 => String::new(),
        len => {
            use rand::SeedableRng;
            let mut rng = rand::rngs::SmallRng::seed_from_u64(args.seed ^ 0x5157_454d);
            dataset::random_prompt(&mut rng, len, &counter).0
        }
    };
    let user_len = args.multi_turn_user_len.max(1);
    let mut prompts = dataset::random(
        n,
        user_len,
        args.random_output_len,
        0.0,
        args.seed,
        &counter,
    );
    // The hot conversation's other lanes: after all conversations' prompts, `turns` per lane
    // (`MultiTurn::lane_index`), each the turn's own message with its words rotated by the
    // lane: a message of its own, of the same words and so the same size.
    if let Some(h) = hot {
        for lane in 1..h.lanes {
            for t in 0..args.multi_turn_turns {
                let own = &prompts[t];
                let mut words: Vec<&str> = own.text.split(' ').collect();
                let by = lane % words.len().max(1);
                words.rotate_left(by);
                let text = words.join(" ");
                let input_tokens = match counter {
                    dataset::Counter::Approximate => own.input_tokens,
                    _ => counter.count(&text),
                };
                let lane_prompt = Prompt {
                    text,
                    input_tokens,
                    output_tokens: own.output_tokens,
                    class: own.class.clone(),
                };
                prompts.push(lane_prompt);
            }
        }
    }
    let cache_metrics = match &args.cache_metrics_url {
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(base_of)
            .collect::<Result<Vec<_>, _>>()?,
        None => targets[0].base.split(", ").map(str::to_owned).collect(),
    };
    let mt = MultiTurn {
        conversations,
        turns: args.multi_turn_turns,
        user_len,
        system_len: args.multi_turn_system_len,
        think: Duration::from_secs_f64(args.multi_turn_think_ms / 1e3),
        system,
        cache_metrics,
        hot,
    };
    let mut note = format!(
        "multi-turn: {conversations} conversations × {} turns, a shared system prompt of {} tokens, {user_len} user tokens and {} out a turn",
        mt.turns, mt.system_len, args.random_output_len
    );
    if let Some(h) = hot {
        note.push_str(&format!(
            "; conversation 0 hot: {} lanes a turn, {:.1}% of the requests",
            h.lanes,
            h.planned_share(conversations) * 100.0
        ));
    }
    Ok((mt, prompts, note))
}

/// Whether the `--sla` objective `name` is a figure answers of `kind` have.
fn objective_exists(name: &str, kind: EndpointType) -> bool {
    name == "error_rate"
        || name
            .split('_')
            .next()
            .is_some_and(|m| kind.metrics().contains(&m))
}

/// The arrival schedule: request rate, and how long a timed run lasts.
fn schedule(args: &BenchArgs) -> Result<(f64, Option<Duration>), String> {
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
    Ok((rate, duration))
}

/// The endpoint type, and the API path, which must agree.
fn endpoint(args: &BenchArgs) -> Result<(EndpointType, String), String> {
    let kind = args.kind();
    let endpoint = args
        .endpoint
        .clone()
        .unwrap_or_else(|| kind.path().to_owned());
    if !endpoint.starts_with('/') {
        return Err(format!("--endpoint `{endpoint}` must start with /"));
    }
    let fits = match kind {
        EndpointType::OpenaiChat => endpoint.ends_with("/chat/completions"),
        EndpointType::Openai => {
            endpoint.ends_with("/completions") && !endpoint.ends_with("/chat/completions")
        }
        EndpointType::OpenaiResponses => endpoint.ends_with("/responses"),
        EndpointType::AnthropicMessages => endpoint.ends_with("/messages"),
        EndpointType::OpenaiEmbeddings => endpoint.ends_with("/embeddings"),
    };
    if !fits {
        return Err(format!(
            "--endpoint {endpoint} and --endpoint-type {} disagree: chat requests go to /v1/chat/completions, completions to /v1/completions, openai-responses to /v1/responses, anthropic-messages to /v1/messages, openai-embeddings to /v1/embeddings (the \"KeyError: 'choices'\" case)",
            kind.name()
        ));
    }
    Ok((kind, endpoint))
}

/// The servers to send to, each with its URL and headers (the `--header`s, then its key).
fn targets(args: &BenchArgs, endpoint: &str, kind: EndpointType) -> Result<Vec<Target>, String> {
    let common = common_headers(args)?;
    let default_key = bearer_from(&args.api_key_env)?;
    let mut per_target_key = std::collections::HashMap::new();
    for t in &args.target_key_env {
        let (name, var) = kv(t, "--target-key-env")?;
        let v = bearer_from(&var)?
            .ok_or_else(|| format!("--target-key-env {name}: ${var} is not set"))?;
        per_target_key.insert(name, v);
    }
    let mut targets = Vec::new();
    for (name, urls) in target_urls(args)? {
        let mut bases = Vec::new();
        let mut replicas = Vec::new();
        for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            let base = base_of(url)?;
            let uri: Uri = format!("{base}{endpoint}")
                .parse()
                .map_err(|e| format!("`{base}{endpoint}`: {e}"))?;
            bases.push(base);
            replicas.push(uri);
        }
        if replicas.is_empty() {
            return Err(format!("{name}=: no URL given"));
        }
        if let Some(dup) = bases
            .iter()
            .enumerate()
            .find(|(i, b)| bases[..*i].contains(b))
        {
            return Err(format!(
                "{name}: `{}` is listed twice; list each server once",
                dup.1
            ));
        }
        let base = bases.join(", ");
        let uri = replicas[0].clone();
        let mut headers = common.clone();
        if !headers.contains_key(http::header::AUTHORIZATION)
            && let Some(k) = per_target_key.get(&name).or(default_key.as_ref())
        {
            headers.insert(http::header::AUTHORIZATION, k.clone());
        }
        // Anthropic's API asks every request to name its version.
        if kind == EndpointType::AnthropicMessages && !headers.contains_key("anthropic-version") {
            headers.insert(
                http::HeaderName::from_static("anthropic-version"),
                http::HeaderValue::from_static("2023-06-01"),
            );
        }
        targets.push(Target {
            name,
            base,
            uri,
            replicas,
            headers,
            dialect: kind.dialect(),
            streamed: kind.streams(),
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
    Ok(targets)
}

/// The `--header`s every target gets.
fn common_headers(args: &BenchArgs) -> Result<HeaderMap, String> {
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
    Ok(common)
}

/// `Bearer <key>` from the variable `var`, when it is set (marked sensitive: never logged).
fn bearer_from(var: &str) -> Result<Option<HeaderValue>, String> {
    match std::env::var(var) {
        Ok(k) if !k.trim().is_empty() => {
            let mut v = HeaderValue::try_from(format!("Bearer {}", k.trim()))
                .map_err(|_| format!("${var} holds characters not allowed in a header"))?;
            v.set_sensitive(true);
            Ok(Some(v))
        }
        _ => Ok(None),
    }
}

/// (name, URL) of each target: `--base-url` alone, or the two of `--compare`.
fn target_urls(args: &BenchArgs) -> Result<Vec<(String, String)>, String> {
    if args.compare.is_empty() {
        // Without --base-url, vLLM's --host and --port (127.0.0.1:8000 by default).
        let base = args.base_url.clone().unwrap_or_else(|| {
            let host = args.host.as_deref().unwrap_or("127.0.0.1");
            let host = if host.contains(':') && !host.starts_with('[') {
                format!("[{host}]")
            } else {
                host.to_owned()
            };
            let url = format!("http://{host}:{}", args.port.unwrap_or(8000));
            if args.host.is_none() && args.port.is_none() {
                eprintln!(
                    "fleetgate bench: no --base-url: sending to {url} (vLLM's default --host and --port)"
                );
            }
            url
        });
        return Ok(vec![("target".to_owned(), base)]);
    }
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
    Ok(pairs)
}

/// `--percentile-metrics`: which latency metrics get percentiles (by default vLLM's for the
/// endpoint type). A metric the endpoint type's answers do not have (TTFT of an embedding) is
/// left out with a note, as vLLM leaves it out, rather than reported as a measured zero.
fn selected_metrics(
    args: &BenchArgs,
    kind: EndpointType,
) -> Result<(Vec<String>, Vec<String>), String> {
    let selected: Vec<String> = args
        .percentile_metrics
        .as_deref()
        .unwrap_or(kind.default_percentile_metrics())
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect();
    // vLLM's client-side queue metrics: the time a request waited for the client's own
    // --max-concurrency slot, which says nothing about the server.
    let client_queue = ["client_queue_time", "e2el_including_client_queue"];
    let mut notes = Vec::new();
    let (queue, selected): (Vec<String>, Vec<String>) = selected
        .into_iter()
        .partition(|m| client_queue.contains(&m.as_str()));
    if !queue.is_empty() {
        notes.push(format!(
            "{} not measured: fleetgate bench times a request from when it is sent, not while it waits for its own --max-concurrency slot",
            queue.join(", ")
        ));
    }
    if let Some(bad) = selected
        .iter()
        .find(|m| !METRICS.iter().any(|(k, _, _)| k == m))
    {
        return Err(format!(
            "--percentile-metrics: `{bad}` is not one of ttft, tpot, itl, e2el"
        ));
    }
    let (selected, absent): (Vec<String>, Vec<String>) = selected
        .into_iter()
        .partition(|m| kind.metrics().contains(&m.as_str()));
    if !absent.is_empty() {
        notes.push(format!(
            "{} answers are not streamed: {} not measured (the only latency is the whole request, E2EL)",
            kind.name(),
            absent.join(", ")
        ));
    }
    if selected.is_empty() && absent.is_empty() {
        return Err(
            "--percentile-metrics names nothing fleetgate bench measures: give ttft, tpot, itl or e2el".into(),
        );
    }
    if selected.is_empty() {
        return Err(format!(
            "--percentile-metrics: {} answers have none of {}; use e2el",
            kind.name(),
            absent.join(", ")
        ));
    }
    Ok((selected, notes))
}

/// `--metric-percentiles`, each in 0..100.
fn percentiles(args: &BenchArgs) -> Result<Vec<f64>, String> {
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
    Ok(percentiles)
}

/// `--goodput metric:ms ...`: the objectives a request must meet to count as good.
fn goodput(args: &BenchArgs, kind: EndpointType) -> Result<Goodput, String> {
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
        if !kind.metrics().contains(&m) {
            return Err(format!(
                "--goodput `{g}`: {} answers are not streamed and have no {m}; use e2el",
                kind.name()
            ));
        }
        let v: f64 = v
            .parse()
            .map_err(|_| format!("--goodput `{g}`: `{v}` is not milliseconds"))?;
        goodput.push((m.to_owned(), v));
    }
    Ok(goodput)
}

/// The compare verdict's tolerances; with `--compare`, P95 (the seed's criterion) joins the
/// measured percentiles when it is not among them, and is returned as added.
fn verdict_thresholds(
    args: &BenchArgs,
    percentiles: &mut Vec<f64>,
) -> Result<(Thresholds, Vec<f64>), String> {
    for (flag, v) in [
        ("--max-mean-delta-pct", args.max_mean_delta_pct),
        ("--max-percentile-delta-pct", args.max_percentile_delta_pct),
        ("--delta-floor-ms", args.delta_floor_ms),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!("{flag} must be a number ≥ 0"));
        }
    }
    let thresholds = Thresholds {
        mean_pct: args.max_mean_delta_pct,
        percentile_pct: args.max_percentile_delta_pct,
        floor_ms: args.delta_floor_ms,
    };
    let mut added = Vec::new();
    if args.compare.len() == 2 && !percentiles.iter().any(|p| (*p - 95.0).abs() < 1e-9) {
        percentiles.push(95.0);
        percentiles.sort_by(f64::total_cmp);
        added.push(95.0);
    }
    Ok((thresholds, added))
}

/// `--sweep`: its axis and values; adds P99 to the percentiles, which the table and chart read.
fn sweep_series(
    args: &BenchArgs,
    percentiles: &mut Vec<f64>,
) -> Result<Option<(spec::Axis, Vec<f64>)>, String> {
    let Some(s) = &args.sweep else {
        return Ok(None);
    };
    if args.compare.len() == 2 {
        return Err(
            "--sweep measures one target; run the comparison at the rate you care about".into(),
        );
    }
    if !args.kind().streams() {
        return Err(format!(
            "--sweep charts TTFT P99, which {} answers do not have; run one rate at a time (E2EL and throughput)",
            args.kind().name()
        ));
    }
    // The table and the chart read P99.
    if !percentiles.iter().any(|p| (*p - 99.0).abs() < 1e-9) {
        percentiles.push(99.0);
    }
    Ok(Some(spec::parse_sweep(s)?))
}

/// Capacity planning: (target QPS, redundancy, instances measured), with `--target-qps`.
fn capacity(args: &BenchArgs) -> Result<Option<(f64, f64, u32)>, String> {
    match args.target_qps {
        Some(q) if q > 0.0 && q.is_finite() => {
            if !(args.redundancy.is_finite() && args.redundancy >= 1.0) {
                return Err("--redundancy must be ≥ 1 (the seed uses 1.2–1.3)".into());
            }
            Ok(Some((q, args.redundancy, args.instances.max(1))))
        }
        Some(_) => Err("--target-qps must be > 0".into()),
        None => Ok(None),
    }
}

/// vLLM's `--random-prefix-len`: one random prefix of `len` tokens (from a seed of its own),
/// the same at the start of every prompt.
fn with_prefix(
    mut prompts: Vec<Prompt>,
    len: u64,
    seed: u64,
    counter: &dataset::Counter,
) -> Vec<Prompt> {
    if len == 0 {
        return prompts;
    }
    use rand::SeedableRng;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ 0x7072_6566);
    let (prefix, tokens) = dataset::random_prompt(&mut rng, len, counter);
    for p in &mut prompts {
        p.text = format!("{prefix} {}", p.text);
        p.input_tokens += tokens;
    }
    prompts
}

/// How prompts are counted: `--tokenizer` (a tokenizer.json, or a model directory holding
/// one), and the note saying so. A path that does not exist is, for vLLM, a model id on
/// Hugging Face's hub; nothing is downloaded here: prompts are counted as characters / 4, and
/// a warning says so.
fn counter(args: &BenchArgs) -> Result<(dataset::Counter, String), String> {
    match &args.tokenizer {
        Some(p) if p.exists() => Ok((
            dataset::Counter::load(p)?,
            format!("token counts by the tokenizer {}", p.display()),
        )),
        Some(p) => {
            eprintln!(
                "fleetgate bench: warning: --tokenizer {}: no such file or directory (fleetgate bench reads a tokenizer.json, or a model directory holding one, and downloads nothing); prompts are counted as characters / 4",
                p.display()
            );
            Ok((
                dataset::Counter::Approximate,
                format!(
                    "{} (--tokenizer {} not found)",
                    dataset::APPROXIMATION,
                    p.display()
                ),
            ))
        }
        None => Ok((
            dataset::Counter::Approximate,
            dataset::APPROXIMATION.to_owned(),
        )),
    }
}

/// The prompts (settings.json's classes, random, or ShareGPT) and a note saying which.
fn prompts(
    args: &BenchArgs,
    classes: Option<Vec<RequestClass>>,
) -> Result<(Vec<Prompt>, String), String> {
    let (counter, counting) = counter(args)?;
    Ok(match (classes, args.dataset_name) {
        (Some(c), _) if !c.is_empty() => (
            dataset::classes(args.num_prompts, &c, args.seed, &counter)?,
            format!(
                "settings.json request_distribution ({} classes); {counting}",
                c.len()
            ),
        ),
        (_, DatasetName::Random) => (
            with_prefix(
                dataset::random(
                    args.num_prompts,
                    args.random_input_len,
                    args.random_output_len,
                    args.random_range_ratio,
                    args.seed,
                    &counter,
                ),
                args.random_prefix_len,
                args.seed,
                &counter,
            ),
            if args.kind().streams() {
                format!(
                    "random: {}{} in / {} out tokens (range ratio {}); {counting}",
                    if args.random_prefix_len > 0 {
                        format!("a shared prefix of {} + ", args.random_prefix_len)
                    } else {
                        String::new()
                    },
                    args.random_input_len,
                    args.random_output_len,
                    args.random_range_ratio
                )
            } else {
                format!(
                    "random: {} in tokens (range ratio {}); {counting}",
                    args.random_input_len, args.random_range_ratio
                )
            },
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
        (_, DatasetName::PrefixRepetition) => {
            let shape = dataset::PrefixRepetition {
                prefix_len: args.prefix_repetition_prefix_len,
                suffix_len: args.prefix_repetition_suffix_len,
                num_prefixes: args.prefix_repetition_num_prefixes,
                output_len: args.prefix_repetition_output_len,
            };
            let p = dataset::prefix_repetition(args.num_prompts, &shape, args.seed, &counter)?;
            let note = format!(
                "prefix_repetition: {} prompts, {} prefixes of {} tokens each shared by {}, suffixes of {}, {} out; {counting}",
                p.len(),
                shape.num_prefixes,
                shape.prefix_len,
                p.len() / shape.num_prefixes.max(1),
                shape.suffix_len,
                shape.output_len
            );
            (p, note)
        }
    })
}

/// The `--label KEY=VALUE`s, plus the model, fleetgate's version and the date; and vLLM's
/// label, a bare `--label NAME` (at most one).
fn labels(
    args: &BenchArgs,
    model: &str,
) -> Result<(serde_json::Map<String, Value>, Option<String>), String> {
    let mut labels = serde_json::Map::new();
    let mut bare = None;
    for l in &args.labels {
        if !l.contains('=') {
            let name = l.trim();
            if name.is_empty() || bare.replace(name.to_owned()).is_some() {
                return Err(format!(
                    "--label `{l}`: one bare label names the run (vLLM's --label); write the others KEY=VALUE"
                ));
            }
            continue;
        }
        let (k, v) = kv(l, "--label")?;
        labels.insert(k, Value::String(v));
    }
    labels
        .entry("model")
        .or_insert(Value::String(model.to_owned()));
    labels.insert(
        "fleetgate_version".into(),
        Value::String(env!("CARGO_PKG_VERSION").to_owned()),
    );
    labels.insert("date".into(), Value::String(now_rfc3339()));
    Ok((labels, bare))
}

/// The flags the run used, stored with the result (without settings.json, which is stored as is).
fn settings_echo(
    args: &BenchArgs,
    endpoint: &str,
    kind: EndpointType,
    selected: &[String],
    percentiles: &[f64],
) -> Value {
    // An embedding has no output: no output length was sent.
    let output_len = kind.streams().then_some(args.random_output_len);
    json!({
        "base_url": args.base_url,
        "endpoint": endpoint,
        "endpoint_type": kind.name(),
        "dataset_name": format!("{:?}", args.dataset_name).to_lowercase(),
        "dataset_path": args.dataset_path,
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": output_len,
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
        "max_mean_delta_pct": args.max_mean_delta_pct,
        "max_percentile_delta_pct": args.max_percentile_delta_pct,
        "delta_floor_ms": args.delta_floor_ms,
        "sla": args.sla,
    })
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}
