//! `fleetgate bench`'s options: the flags (named as `vllm bench serve` names them), the seed's
//! settings.json laid over them, and the small parsers for their values.

use std::path::PathBuf;

use http::{HeaderName, HeaderValue, Uri};
use serde::Deserialize;

use super::spec::{EndpointType, RequestClass};

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DatasetName {
    Random,
    Sharegpt,
    /// vLLM's `prefix_repetition`: random prefixes, each shared by several prompts, and a
    /// random suffix per prompt.
    #[value(name = "prefix_repetition", alias = "prefix-repetition")]
    PrefixRepetition,
}

#[derive(clap::Subcommand, Debug, Clone)]
pub(crate) enum BenchCommand {
    /// Compare two result files (fleetgate bench or vllm bench serve): every latency and
    /// throughput key side by side with the change.
    Diff { a: PathBuf, b: PathBuf },
}

/// `fleetgate bench` flags: `vllm bench serve`'s names, plus the comparison, SLA and labels.
/// Every other flag of `vllm bench serve` is taken before clap reads these
/// (`vllm_flags::normalize`). A flag given twice keeps its last value, and a unique prefix names
/// its flag (`--num-prompt`), as in vLLM's parser.
#[derive(clap::Args, Debug, Clone)]
#[command(
    args_conflicts_with_subcommands = true,
    args_override_self = true,
    infer_long_args = true
)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub(crate) command: Option<BenchCommand>,
    /// The seed's settings.json (endpoint, api_key_env, model, concurrency, duration_seconds,
    /// request_distribution, metrics, warmup_requests). Its keys win over the flags.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Write the result JSON to this file (the seed's `--output result.json`).
    #[arg(long)]
    pub(crate) output: Option<PathBuf>,
    /// Server base URL, e.g. http://127.0.0.1:8080 (the gateway) or http://vllm:8000.
    #[arg(long)]
    pub(crate) base_url: Option<String>,
    /// Without --base-url: the server's host (vLLM's default 127.0.0.1).
    #[arg(long)]
    pub(crate) host: Option<String>,
    /// Without --base-url: the server's port (vLLM's default 8000).
    #[arg(long)]
    pub(crate) port: Option<u16>,
    /// API path (default by --endpoint-type: /v1/chat/completions, /v1/completions,
    /// /v1/responses, /v1/messages or /v1/embeddings).
    #[arg(long)]
    pub(crate) endpoint: Option<String>,
    /// The request format (default openai-chat). vLLM's backend names are taken too: vllm
    /// and openai (completions), openai-embeddings-chat, -clip, -vlm2vec, infinity-embeddings.
    #[arg(long, value_enum)]
    pub(crate) endpoint_type: Option<EndpointType>,
    /// vLLM's name for the request format (`--backend vllm` is completions); --endpoint-type
    /// wins when both are given.
    #[arg(long, value_parser = parse_backend)]
    pub(crate) backend: Option<Backend>,
    /// Model name to send (default: the first id of GET /v1/models).
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// With --model: the name put in the requests instead (vLLM's --served-model-name).
    #[arg(long)]
    pub(crate) served_model_name: Option<String>,
    /// Extra request headers, `Name=value` or `Name: value` (several after one --header, as
    /// vLLM, or --header repeated).
    #[arg(long = "header", value_name = "NAME=VALUE", num_args = 0.., action = clap::ArgAction::Append)]
    pub(crate) headers: Vec<String>,
    /// Sampling: sent in every request (default: temperature 0, the server's defaults for the
    /// rest).
    #[arg(long)]
    pub(crate) temperature: Option<f64>,
    #[arg(long)]
    pub(crate) top_p: Option<f64>,
    #[arg(long)]
    pub(crate) top_k: Option<i64>,
    #[arg(long)]
    pub(crate) min_p: Option<f64>,
    #[arg(long)]
    pub(crate) frequency_penalty: Option<f64>,
    #[arg(long)]
    pub(crate) presence_penalty: Option<f64>,
    #[arg(long)]
    pub(crate) repetition_penalty: Option<f64>,
    /// A JSON object merged into every request body (after the sampling flags), e.g.
    /// '{"chat_template_kwargs":{"enable_thinking":false}}'.
    #[arg(long, value_name = "JSON")]
    pub(crate) extra_body: Option<String>,
    /// What `vllm bench serve` flags asked for that fleetgate bench does not implement
    /// (`vllm_flags::normalize`): the run stops, naming them.
    #[arg(long = "vllm-not-implemented", hide = true)]
    pub(crate) vllm_not_implemented: Vec<String>,
    /// Environment variable holding the API key, sent as `Authorization: Bearer` (keys are
    /// never read from files or flags).
    #[arg(long, default_value = "OPENAI_API_KEY")]
    pub(crate) api_key_env: String,
    /// With --compare: another variable for one target, `NAME=VAR` (e.g. direct=VLLM_API_KEY).
    #[arg(long = "target-key-env", value_name = "NAME=VAR")]
    pub(crate) target_key_env: Vec<String>,
    #[arg(long, value_enum, default_value = "random")]
    pub(crate) dataset_name: DatasetName,
    /// ShareGPT JSON file (with --dataset-name sharegpt).
    #[arg(long)]
    pub(crate) dataset_path: Option<PathBuf>,
    #[arg(long, default_value_t = 1000)]
    pub(crate) num_prompts: usize,
    #[arg(long, default_value_t = 1024)]
    pub(crate) random_input_len: u64,
    #[arg(long, default_value_t = 128)]
    pub(crate) random_output_len: u64,
    /// Lengths drawn from [len × (1 − r), len × (1 + r)].
    #[arg(long, default_value_t = 0.0)]
    pub(crate) random_range_ratio: f64,
    /// random: tokens of one random prefix every prompt starts with (vLLM's), before its own
    /// --random-input-len tokens.
    #[arg(long, default_value_t = 0)]
    pub(crate) random_prefix_len: u64,
    /// The model's tokenizer.json (Hugging Face format): exact token counts for ShareGPT
    /// filtering and random prompts (without it: characters / 4).
    #[arg(long)]
    pub(crate) tokenizer: Option<PathBuf>,
    /// Output length of every ShareGPT request (default: the conversation's own reply length).
    #[arg(long)]
    pub(crate) sharegpt_output_len: Option<u64>,
    /// prefix_repetition: tokens of each shared prefix.
    #[arg(long, default_value_t = 256)]
    pub(crate) prefix_repetition_prefix_len: u64,
    /// prefix_repetition: tokens of each prompt's own suffix.
    #[arg(long, default_value_t = 256)]
    pub(crate) prefix_repetition_suffix_len: u64,
    /// prefix_repetition: how many prefixes (--num-prompts / this prompts share each one).
    #[arg(long, default_value_t = 10)]
    pub(crate) prefix_repetition_num_prefixes: usize,
    /// prefix_repetition: output tokens of every request.
    #[arg(long, default_value_t = 128)]
    pub(crate) prefix_repetition_output_len: u64,
    /// Agent-shaped load: this many conversations at once, each sending its turns one after
    /// another, every turn carrying the whole history (replaces the dataset and the arrivals).
    #[arg(long)]
    pub(crate) multi_turn_conversations: Option<usize>,
    /// Multi-turn: turns per conversation.
    #[arg(long, default_value_t = 4)]
    pub(crate) multi_turn_turns: usize,
    /// Multi-turn: tokens of the new user message of every turn.
    #[arg(long, default_value_t = 128)]
    pub(crate) multi_turn_user_len: u64,
    /// Multi-turn: tokens of the system prompt every conversation shares (0: none).
    #[arg(long, default_value_t = 1024)]
    pub(crate) multi_turn_system_len: u64,
    /// Multi-turn: think time between a conversation's answer and its next turn, ms.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) multi_turn_think_ms: f64,
    /// Multi-turn, uneven load: conversation 0 is hot and carries about this fraction F of all
    /// requests (0 < F < 1; needs ≥ 2 conversations). Each of its turns is sent by
    /// L = max(2, round(F / (1 − F) × (C − 1))) parallel lanes at once (share L / (L + C − 1)),
    /// as an agent fanning out over one shared context: every lane sends the same history with
    /// a new user message of its own (lane 0 the turn's prompt, lane k the same words rotated
    /// by k). The turn ends when all lanes have answered, and the history goes on with lane 0's.
    #[arg(long, value_name = "F")]
    pub(crate) multi_turn_hot_share: Option<f64>,
    /// Where to read the prefix-cache counters (vLLM's /metrics), comma-separated base URLs
    /// (default: the target itself; a gateway's backends must be named here).
    #[arg(long, value_name = "URL[,URL...]")]
    pub(crate) cache_metrics_url: Option<String>,
    /// Requests per second, Poisson arrivals (with --burstiness 1); `inf` sends all at once.
    #[arg(long, default_value = "inf")]
    pub(crate) request_rate: String,
    /// Gamma shape of the arrival gaps (1: Poisson; < 1 burstier; > 1 more even), as vLLM.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) burstiness: f64,
    #[arg(long)]
    pub(crate) max_concurrency: Option<usize>,
    /// Run for this long instead of --num-prompts requests (prompts are reused in turn). With
    /// --multi-turn-conversations: each conversation starts over as a new one (its messages'
    /// words rotated) until the time is up; a turn begun in time runs to its end.
    #[arg(long)]
    pub(crate) duration_seconds: Option<f64>,
    /// Comma-separated: ttft, tpot, itl, e2el (default: ttft,tpot,itl; e2el for
    /// openai-embeddings, as vLLM).
    #[arg(long)]
    pub(crate) percentile_metrics: Option<String>,
    /// Comma-separated percentiles, e.g. 50,95,99.
    #[arg(long, default_value = "99")]
    pub(crate) metric_percentiles: String,
    /// Service-level objectives for goodput, e.g. `--goodput ttft:500 tpot:50` (ms).
    #[arg(long, num_args = 1.., value_name = "METRIC:MS")]
    pub(crate) goodput: Vec<String>,
    #[arg(long, default_value_t = 0)]
    pub(crate) num_warmups: usize,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Ask the server to ignore end-of-sequence (vLLM's `ignore_eos`): exact output lengths.
    #[arg(long)]
    pub(crate) ignore_eos: bool,
    #[arg(long)]
    pub(crate) save_result: bool,
    #[arg(long)]
    pub(crate) result_filename: Option<String>,
    #[arg(long)]
    pub(crate) result_dir: Option<PathBuf>,
    /// Label stored with the result, `key=value` (repeatable): hardware, quantisation, ... A
    /// bare `--label NAME` is vLLM's: the result's `label` and the saved file's name prefix.
    #[arg(long = "label", value_name = "KEY=VALUE|NAME")]
    pub(crate) labels: Vec<String>,
    /// Two targets, `NAME=BASE_URL NAME=BASE_URL` (the first is the baseline): the same prompts
    /// and arrivals, interleaved between them.
    #[arg(long, num_args = 2, value_name = "NAME=URL")]
    pub(crate) compare: Vec<String>,
    /// Compare verdict: how much slower a mean may be, in percent of the baseline's (or
    /// --delta-floor-ms, whichever is larger).
    #[arg(long, default_value_t = 3.0)]
    pub(crate) max_mean_delta_pct: f64,
    /// Compare verdict: how much slower each percentile (P95 and every --metric-percentiles)
    /// may be, in percent of the baseline's (or --delta-floor-ms, whichever is larger).
    #[arg(long, visible_alias = "max-p95-delta-pct", default_value_t = 5.0)]
    pub(crate) max_percentile_delta_pct: f64,
    /// Compare verdict: the absolute tolerance in milliseconds under which no slowdown fails,
    /// however large in percent (microseconds on a fast baseline).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) delta_floor_ms: f64,
    /// Objectives to meet, e.g. `ttft_p99_ms=1500,e2el_p95_ms=60000,error_rate=0.01`; exit 2
    /// with a table when one is violated.
    #[arg(long)]
    pub(crate) sla: Option<String>,
    /// A series of runs, e.g. `rate=2,4,8,16,32` or `concurrency=1,4,16`: a table, an SVG chart
    /// of TTFT P99 and throughput with the knee marked (`--sweep-chart`).
    #[arg(long)]
    pub(crate) sweep: Option<String>,
    /// Where the sweep's SVG chart goes.
    #[arg(long, default_value = "fleetgate-sweep.svg")]
    pub(crate) sweep_chart: PathBuf,
    /// Capacity planning: the QPS the fleet must serve.
    #[arg(long)]
    pub(crate) target_qps: Option<f64>,
    /// Capacity planning: headroom factor (the seed uses 1.2–1.3).
    #[arg(long, default_value_t = 1.25)]
    pub(crate) redundancy: f64,
    /// Capacity planning: how many instances served the measured endpoint.
    #[arg(long, default_value_t = 1)]
    pub(crate) instances: u32,
    /// Give up on a request after this long.
    #[arg(long, default_value_t = 600.0)]
    pub(crate) request_timeout_seconds: f64,
    /// No live progress line.
    #[arg(long, alias = "disable-tqdm")]
    pub(crate) no_progress: bool,
}

impl BenchArgs {
    /// The request format: --endpoint-type, else vLLM's --backend, else openai-chat.
    pub(crate) fn kind(&self) -> EndpointType {
        self.endpoint_type
            .or(self.backend.as_ref().map(|b| b.kind))
            .unwrap_or(EndpointType::OpenaiChat)
    }
}

/// vLLM's `--backend`: the name as given, and the request format it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Backend {
    pub(crate) name: String,
    pub(crate) kind: EndpointType,
}

fn parse_backend(s: &str) -> Result<Backend, String> {
    use clap::ValueEnum;
    EndpointType::from_str(s, false).map(|kind| Backend {
        name: s.to_owned(),
        kind,
    })
}

/// The seed's settings.json.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub endpoint: String,
    #[serde(default)]
    pub(crate) api_key_env: Option<String>,
    #[serde(default)]
    pub(crate) model: Option<String>,
    #[serde(default)]
    pub(crate) concurrency: Option<usize>,
    #[serde(default)]
    pub(crate) duration_seconds: Option<f64>,
    #[serde(default)]
    pub request_distribution: Vec<RequestClass>,
    #[serde(default)]
    pub(crate) metrics: Option<SettingsMetrics>,
    #[serde(default)]
    pub(crate) warmup_requests: Option<usize>,
    #[serde(default)]
    pub(crate) request_rate: Option<f64>,
    #[serde(default)]
    pub(crate) num_prompts: Option<usize>,
}

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SettingsMetrics {
    #[serde(default = "yes")]
    pub(crate) record_ttft: bool,
    #[serde(default = "yes")]
    pub(crate) record_tpot: bool,
    #[serde(default)]
    pub(crate) percentiles: Vec<f64>,
}

fn yes() -> bool {
    true
}

pub(super) fn parse_rate(s: &str) -> Result<f64, String> {
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

pub(super) fn header_pair(s: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (k, v) = s
        .split_once(':')
        .filter(|(k, _)| !k.contains('='))
        .or_else(|| s.split_once('='))
        .ok_or_else(|| format!("--header `{s}`: write Name=value or \"Name: value\""))?;
    let name = HeaderName::try_from(k.trim()).map_err(|e| format!("--header `{k}`: {e}"))?;
    let value = HeaderValue::try_from(v.trim()).map_err(|e| format!("--header `{k}`: {e}"))?;
    Ok((name, value))
}

pub(super) fn kv(s: &str, what: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("{what} `{s}`: write NAME=VALUE"))
}

/// Split a full endpoint URL (settings.json's `endpoint`) into base and path.
pub(super) fn split_endpoint(url: &str) -> (String, Option<String>) {
    for p in ["/v1/chat/completions", "/v1/completions"] {
        if let Some(base) = url.trim_end_matches('/').strip_suffix(p) {
            return (base.to_owned(), Some(p.to_owned()));
        }
    }
    (url.trim_end_matches('/').to_owned(), None)
}

pub(super) fn base_of(url: &str) -> Result<String, String> {
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

/// Apply settings.json over the flags (its keys win). `s` was checked by
/// `plan::read_settings`.
pub(super) fn apply_settings(args: &mut BenchArgs, s: &Settings) {
    let (base, endpoint) = split_endpoint(&s.endpoint);
    args.base_url = Some(base);
    if let Some(e) = endpoint {
        if e == "/v1/completions" {
            args.endpoint_type = Some(EndpointType::Openai);
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
        args.percentile_metrics = Some(sel.join(","));
        if !m.percentiles.is_empty() {
            args.metric_percentiles = m
                .percentiles
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(",");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
