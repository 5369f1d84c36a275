//! The plan of a run: the flags and settings resolved into targets (URL, headers, key), the
//! model, the prompts and their request bodies, the arrival schedule and what to report.
//!
//! This module holds the `Plan`, the settings file's checks and the order the steps run in;
//! `targets` resolves where requests go, `prompts` what they carry, `metrics` what the run
//! measures and judges, and `labels` what the result records about the run.

mod labels;
mod metrics;
mod prompts;
mod targets;

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;

use crate::args::{BenchArgs, DatasetName, Settings, apply_settings, base_of, parse_rate};
use crate::dataset::{self, Prompt};
use crate::spec::{self, EndpointType, MultiTurn, RequestClass, Target};
use crate::summary::Goodput;
use crate::verdict::Thresholds;
use crate::verdict::sla::{Objective, parse_sla};
use labels::{labels, settings_echo};
use metrics::{
    capacity, goodput, objective_exists, percentiles, selected_metrics, sweep_series,
    verdict_thresholds,
};
use prompts::{body_extra, multi_turn, prompts};
use targets::{discover_model, endpoint, targets};

/// Everything a run needs, resolved from the flags and settings.
#[derive(Debug, Clone)]
pub struct Plan {
    pub targets: Vec<Target>,
    pub model: String,
    pub(crate) endpoint_type: EndpointType,
    pub prompts: Vec<Prompt>,
    /// Bodies by prompt (the same bytes for every target).
    pub bodies: Vec<Bytes>,
    pub request_rate: f64,
    pub(crate) burstiness: f64,
    pub(crate) max_concurrency: Option<usize>,
    pub(crate) duration: Option<Duration>,
    pub num_prompts: usize,
    pub(crate) warmups: usize,
    pub(crate) seed: u64,
    pub(crate) timeout: Duration,
    pub selected: Vec<String>,
    pub percentiles: Vec<f64>,
    pub(crate) goodput: Goodput,
    pub(crate) sla: Vec<Objective>,
    pub thresholds: Thresholds,
    /// Percentiles measured because the compare verdict needs them, not because they were asked.
    pub added_percentiles: Vec<f64>,
    pub labels: serde_json::Map<String, Value>,
    /// vLLM's `label` (a bare `--label NAME`).
    pub label: Option<String>,
    /// vLLM's `tokenizer_id`: the tokenizer that counted the prompts (none: characters / 4).
    pub(crate) tokenizer_id: Option<String>,
    pub dataset_note: String,
    pub(crate) settings: Value,
    pub(crate) progress: bool,
    pub(crate) sweep: Option<(spec::Axis, Vec<f64>)>,
    pub(crate) sweep_chart: PathBuf,
    /// (target QPS, redundancy, instances measured).
    pub(crate) capacity: Option<(f64, f64, u32)>,
    /// What the run leaves out of what was asked, and why (printed as `note:` lines).
    pub(crate) notes: Vec<String>,
    /// vLLM's `ignore_eos`, asked of every request.
    pub(crate) ignore_eos: bool,
    /// Merged into every request body last (sampling flags, `--extra-body`,
    /// `--served-model-name`).
    pub(crate) body_extra: serde_json::Map<String, Value>,
    /// Agent-shaped load instead of independent prompts (`--multi-turn-conversations`): then
    /// `prompts` holds each conversation's user messages, turn by turn.
    pub multi_turn: Option<MultiTurn>,
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
    let (base, _) = crate::args::split_endpoint(&s.endpoint);
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
    // A timed multi-turn run's concurrency is its conversations.
    if duration.is_some()
        && rate.is_infinite()
        && args.max_concurrency.is_none()
        && args.multi_turn_conversations.is_none()
    {
        return Err("a timed run needs --max-concurrency (settings: concurrency) or a finite --request-rate".into());
    }
    if args.num_prompts == 0 {
        return Err("--num-prompts must be ≥ 1".into());
    }
    Ok((rate, duration))
}
