//! The report of a run: the terminal text in `vllm bench serve`'s layout, the result JSON
//! (vLLM's keys plus the seed's `result.json` shape), the comparison and SLA sections, the exit
//! code, and `bench diff` of two result files.
//!
//! This module assembles the report from each target's sections, the comparison, the SLA and
//! capacity; `text` holds a target's terminal summary, `keys` its result keys, and `classes`
//! its breakdown by request class.

mod classes;
pub(crate) mod keys;
pub(crate) mod text;

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::capacity;
use crate::engine::RunResult;
use crate::interval::CONFIDENCE_PCT;
use crate::measure::Outcome;
use crate::plan::Plan;
use crate::summary::Summary;
use crate::verdict::delta::{Judgement, compare};
use crate::verdict::failures::Failures;
use crate::verdict::hop::HopCheck;
use crate::verdict::like_for_like::LikeForLike;
use crate::verdict::render::render_compare;
use crate::verdict::sla::{render_sla, violations};
use classes::per_class;
use keys::{seed_json, stats_json, vllm_json};
use text::render;

/// `fleetgate bench diff A.json B.json`: every `mean_/median_/pNN_*_ms` and throughput key of
/// two result files side by side, each file named (`names`) and said what run it holds.
pub fn diff(a: &Value, b: &Value, names: [&str; 2]) -> Result<String, String> {
    // The figures of a file, and which they are: a compare run's measured target, or the run.
    let pick = |v: &Value| -> Result<(serde_json::Map<String, Value>, String), String> {
        let obj = v.as_object().ok_or("not a JSON object")?;
        if let Some(t) = obj.get("targets").and_then(Value::as_object) {
            let measured = obj["comparison"]["measured"].as_str().unwrap_or_default();
            let baseline = obj["comparison"]["baseline"].as_str().unwrap_or("?");
            let figures = t
                .get(measured)
                .and_then(Value::as_object)
                .cloned()
                .ok_or_else(|| "a compare result without its measured target".to_owned())?;
            return Ok((
                figures,
                format!(
                    "target `{measured}` of a --compare run (the measured side; `{baseline}` was its baseline)"
                ),
            ));
        }
        Ok((obj.clone(), format!("a single-target run{}", run_of(obj))))
    };
    let ((a, what_a), (b, what_b)) = (pick(a)?, pick(b)?);
    let mut o = String::new();
    let _ = writeln!(o, "A: {}: {what_a}", names[0]);
    let _ = writeln!(o, "B: {}: {what_b}", names[1]);
    let _ = writeln!(o, "{:<28} {:>14} {:>14} {:>10}", "key", "A", "B", "change");
    let wanted = |k: &str| {
        (k.ends_with("_ms")
            && (k.starts_with("mean_") || k.starts_with("median_") || k.starts_with('p')))
            || matches!(
                k,
                "request_throughput"
                    | "output_throughput"
                    | "total_token_throughput"
                    | "completed"
                    | "failed"
                    | "max_output_tokens_per_s"
                    | "input_sequence_throughput"
            )
    };
    let mut n = 0;
    for (k, va) in &a {
        if !wanted(k) {
            continue;
        }
        let (Some(x), Some(y)) = (va.as_f64(), b.get(k).and_then(Value::as_f64)) else {
            continue;
        };
        let pct = if x.abs() > 1e-12 {
            format!("{:+.2}%", (y - x) / x * 100.0)
        } else {
            "-".into()
        };
        let _ = writeln!(o, "{:<28} {:>14.3} {:>14.3} {:>10}", k, x, y, pct);
        n += 1;
    }
    if n == 0 {
        return Err(
            "no comparable keys: are both files fleetgate bench or vllm bench serve results?"
                .into(),
        );
    }
    Ok(o)
}

/// Exit codes beyond 0 (success) and 1 (could not run).
pub const EXIT_SLA: u8 = 2;
pub const EXIT_COMPARE: u8 = 3;
/// A bad command line or settings file (EX_USAGE, as every `fleetgate` command).
pub const EXIT_USAGE: u8 = 64;
pub(crate) const EXIT_INTERRUPTED: u8 = 130;

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
    for n in &plan.notes {
        let _ = writeln!(text, "note: {n}");
    }
    let (summaries, mut per_target) = target_sections(plan, run, dur, &mut text);
    let mut exit = 0u8;
    let mut json = run_json(plan, run, dur);
    if let Some(cpu) = run.client_cpu {
        text.push_str(&client_cpu_text(cpu, run.outcomes.len(), dur));
    }
    if plan.targets.len() == 1 {
        if let Some(Value::Object(m)) = per_target.remove(&plan.targets[0].name) {
            json.extend(m);
        }
    } else if !comparison(plan, run, &summaries, per_target, &mut json, &mut text) {
        exit = EXIT_COMPARE;
    }
    if !plan.sla.is_empty() {
        let measured = &summaries[summaries.len() - 1];
        // A failed comparison's exit code (3) wins over the SLA's (2).
        if !sla_section(plan, measured, &mut json, &mut text) && exit == 0 {
            exit = EXIT_SLA;
        }
    }
    if let Some((q, red, inst)) = plan.capacity {
        let measured = &summaries[summaries.len() - 1];
        let at_sla = violations(measured, &plan.sla).is_empty() && measured.completed > 0;
        let thr = at_sla.then_some(measured.request_throughput);
        text.push_str(&capacity_text(q, red, inst, thr, "this run"));
        json.insert(
            "capacity".into(),
            capacity::capacity_json(q, red, thr, inst),
        );
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

/// Each target's summary, its terminal section (appended to `text`) and its result keys.
fn target_sections(
    plan: &Plan,
    run: &RunResult,
    dur: f64,
    text: &mut String,
) -> (Vec<Summary>, serde_json::Map<String, Value>) {
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
        // The rate is each target's (interleaved targets share one schedule at their sum).
        let kind = plan.endpoint_type;
        text.push_str(&render(
            &s,
            &plan.selected,
            plan.max_concurrency,
            plan.request_rate,
            kind,
        ));
        let mut m = vllm_json(&s, &mine, &plan.selected, kind);
        m.extend(seed_json(&s, kind));
        if let Some(g) = &s.gateway_ms {
            m.insert("gateway_time_ms".into(), stats_json(g));
        }
        if let Some(h) = &s.hop_ms {
            m.insert("gateway_hop_ms".into(), stats_json(h));
        }
        if let Some((section, classes)) = per_class(plan, &mine, dur) {
            text.push_str(&section);
            m.insert("classes".into(), classes);
        }
        per_target.insert(t.name.clone(), Value::Object(m));
        summaries.push(s);
    }
    (summaries, per_target)
}

/// What a result file says of its run (label, model, prompts and rate, date), so two files of
/// the same kind read apart: ` (label `x`, model `m`, 500 prompts at 20 req/s, 2026-12-06T05:00:00Z)`.
fn run_of(obj: &serde_json::Map<String, Value>) -> String {
    let mut parts = Vec::new();
    if let Some(l) = obj.get("label").and_then(Value::as_str) {
        parts.push(format!("label `{l}`"));
    }
    if let Some(m) = obj.get("model_id").and_then(Value::as_str) {
        parts.push(format!("model `{m}`"));
    }
    match (
        obj.get("num_prompts").and_then(Value::as_u64),
        obj.get("request_rate"),
    ) {
        (Some(n), Some(Value::Number(r))) => parts.push(format!("{n} prompts at {r} req/s")),
        (Some(n), _) => parts.push(format!("{n} prompts at once")),
        _ => {}
    }
    if let Some(at) = obj
        .get("date")
        .and_then(Value::as_i64)
        .and_then(|d| time::OffsetDateTime::from_unix_timestamp(d).ok())
        .and_then(|d| {
            d.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
    {
        parts.push(at);
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

/// The keys describing the run itself: when, what was sent and how, and the client's cost.
fn run_json(plan: &Plan, run: &RunResult, dur: f64) -> serde_json::Map<String, Value> {
    let mut json = serde_json::Map::new();
    json.insert(
        "date".into(),
        json!(time::OffsetDateTime::now_utc().unix_timestamp()),
    );
    let backend = plan.endpoint_type.name();
    json.insert("endpoint_type".into(), json!(backend));
    json.insert("backend".into(), json!(backend));
    json.insert("label".into(), json!(plan.label));
    json.insert("model_id".into(), json!(plan.model));
    json.insert("tokenizer_id".into(), json!(plan.tokenizer_id));
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
    json.insert("notes".into(), json!(plan.notes));
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
    json
}

/// The client's CPU line: what one request cost the load generator.
fn client_cpu_text(cpu: std::time::Duration, outcomes: usize, dur: f64) -> String {
    let requests = outcomes.max(1) as f64;
    format!(
        "client: one thread, {:.2} s CPU = {:.1} µs per request ({:.0} % of one core)\n",
        cpu.as_secs_f64(),
        cpu.as_secs_f64() * 1e6 / requests,
        cpu.as_secs_f64() / dur.max(1e-9) * 100.0
    )
}

/// The comparison of the two targets: its table (to `text`), its keys (to `json`, with each
/// target's own keys under `targets`); true when every delta is within its threshold.
fn comparison(
    plan: &Plan,
    run: &RunResult,
    summaries: &[Summary],
    per_target: serde_json::Map<String, Value>,
    json: &mut serde_json::Map<String, Value>,
    text: &mut String,
) -> bool {
    let deltas = compare(
        &run.outcomes,
        &summaries[0],
        &summaries[1],
        &plan.selected,
        &plan.percentiles,
        plan.thresholds,
    );
    let names = [plan.targets[0].name.as_str(), plan.targets[1].name.as_str()];
    // A whole answer's first byte is its last: the hop is set beside the whole request.
    let metric = if plan.endpoint_type.streams() {
        "ttft"
    } else {
        "e2el"
    };
    let hop = HopCheck::beside(&run.outcomes, &summaries[0], &summaries[1], metric);
    let like = LikeForLike::against(&run.outcomes, plan.thresholds, metric);
    let failures = Failures::of(names, summaries);
    text.push('\n');
    text.push_str(&render_compare(
        names,
        &deltas,
        plan.thresholds,
        &plan.added_percentiles,
        &hop,
        &like,
        &summaries[1],
        &failures,
    ));
    let pass = failures.is_empty() && deltas.iter().all(|d| d.pass);
    let t = plan.thresholds;
    json.insert("targets".into(), Value::Object(per_target));
    json.insert(
        "comparison".into(),
        json!({
            "baseline": names[0],
            "measured": names[1],
            "interleaving": "each prompt to both targets in consecutive arrivals, order alternating",
            "rule": t.rule(names),
            "thresholds": {"mean_pct": t.mean_pct, "percentile_pct": t.percentile_pct, "floor_ms": t.floor_ms},
            "percentiles_judged": plan.percentiles,
            "percentiles_added": plan.added_percentiles,
            "deltas": deltas,
            "not_measured": deltas.iter().filter(|d| d.judgement == Judgement::NotMeasured).map(|d| format!("{}_{}", d.metric, d.stat)).collect::<Vec<_>>(),
            "confidence_pct": CONFIDENCE_PCT,
            "interval_method": "paired bootstrap over prompts (each prompt sent to both targets)",
            "not_distinguishable": deltas.iter().filter(|d| d.judgement == Judgement::NotDistinguishable).map(|d| format!("{}_{}", d.metric, d.stat)).collect::<Vec<_>>(),
            "not_enough_samples": deltas.iter().filter(|d| d.judgement == Judgement::NotEnoughSamples).map(|d| format!("{}_{}", d.metric, d.stat)).collect::<Vec<_>>(),
            "hop": hop,
            "like_for_like": like,
            "failures": failures,
            "pass": pass,
        }),
    );
    pass
}

/// The `--sla` section for the measured target; true when every objective is met.
fn sla_section(
    plan: &Plan,
    measured: &Summary,
    json: &mut serde_json::Map<String, Value>,
    text: &mut String,
) -> bool {
    let v = violations(measured, &plan.sla);
    json.insert(
        "sla".into(),
        json!({
            "objectives": plan.sla.iter().map(|o| json!({"name": o.name, "limit": o.limit})).collect::<Vec<_>>(),
            "violated": v.iter().map(|(o, got)| json!({"name": o.name, "limit": o.limit, "measured": got})).collect::<Vec<_>>(),
        }),
    );
    text.push_str(&render_sla(measured, &plan.sla));
    v.is_empty()
}

pub(super) fn capacity_text(q: f64, red: f64, inst: u32, thr: Option<f64>, source: &str) -> String {
    match thr.and_then(|t| capacity::capacity(q, red, t, inst).map(|n| (t, n))) {
        Some((t, n)) => format!(
            "capacity: {t:.2} req/s measured on {inst} instance(s) at the SLA ({source}) → {:.2} per instance; {q} QPS × {red} redundancy needs {n} instance(s)\n",
            t / f64::from(inst)
        ),
        None => format!(
            "capacity: unknown — {source} does not meet the SLA (or completed nothing); lower the load or sweep (--sweep rate=...)\n"
        ),
    }
}
