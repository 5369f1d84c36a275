//! The report of a run: the terminal text in `vllm bench serve`'s layout, the result JSON
//! (vLLM's keys plus the seed's `result.json` shape), the comparison and SLA sections, the exit
//! code, and `bench diff` of two result files.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::capacity;
use super::engine::RunResult;
use super::interval::CONFIDENCE_PCT;
use super::measure::Outcome;
use super::plan::Plan;
use super::spec::EndpointType;
use super::summary::{METRICS, Stats, Summary, p_word};
use super::verdict::{
    Failures, HopCheck, Judgement, LikeForLike, compare, render_compare, render_sla, violations,
};

/// The terminal summary in `vllm bench serve`'s layout: its generation lines, or for an
/// endpoint type whose answers are not streamed (embeddings) its pooling lines, which have no
/// output tokens and no per-second peaks.
pub fn render(
    s: &Summary,
    selected: &[String],
    max_concurrency: Option<usize>,
    rate: f64,
    kind: EndpointType,
) -> String {
    let mut o = String::new();
    let line = |o: &mut String, k: &str, v: String| {
        let _ = writeln!(o, "{:<40} {:<10}", k, v);
    };
    let _ = writeln!(o, "{:=^50}", " Serving Benchmark Result ");
    line(&mut o, "Successful requests:", s.completed.to_string());
    line(&mut o, "Failed requests:", s.failed.to_string());
    if let Some(c) = max_concurrency {
        line(&mut o, "Maximum request concurrency:", c.to_string());
    }
    if rate.is_finite() {
        line(
            &mut o,
            "Request rate configured (RPS):",
            format!("{rate:.2}"),
        );
    }
    line(
        &mut o,
        "Benchmark duration (s):",
        format!("{:.2}", s.duration_s),
    );
    line(&mut o, "Total input tokens:", s.total_input.to_string());
    if kind.streams() {
        line(
            &mut o,
            "Total generated tokens:",
            s.total_output.to_string(),
        );
    }
    line(
        &mut o,
        "Request throughput (req/s):",
        format!("{:.2}", s.request_throughput),
    );
    if !kind.streams() {
        // vLLM's inputs per second; one input (the prompt) per request.
        line(
            &mut o,
            "Input throughput (inputs/s):",
            format!("{:.2}", s.request_throughput),
        );
    }
    if let Some(g) = s.goodput {
        line(&mut o, "Request goodput (req/s):", format!("{g:.2}"));
    }
    if kind.streams() {
        line(
            &mut o,
            "Output token throughput (tok/s):",
            format!("{:.2}", s.output_throughput),
        );
        line(
            &mut o,
            "Peak output token throughput (tok/s):",
            format!("{:.2}", s.peak_output_throughput),
        );
        line(
            &mut o,
            "Peak concurrent requests:",
            format!("{:.2}", s.max_concurrent_requests as f64),
        );
    }
    // Without output tokens (an embedding), the input tokens per second.
    line(
        &mut o,
        "Total token throughput (tok/s):",
        format!("{:.2}", s.total_token_throughput),
    );
    // Not a vLLM line: vLLM's "peak" above counts requests active within the same second.
    line(
        &mut o,
        "Instantaneous peak concurrency:",
        s.peak_concurrent_instant.to_string(),
    );
    for (key, title, label) in METRICS {
        if !selected.iter().any(|m| m == key) {
            continue;
        }
        let st = &s.metrics[key];
        let _ = writeln!(o, "{:-^50}", title);
        line(
            &mut o,
            &format!("Mean {label} (ms):"),
            format!("{:.2}", st.mean),
        );
        line(
            &mut o,
            &format!("Median {label} (ms):"),
            format!("{:.2}", st.median),
        );
        for (p, v) in &st.percentiles {
            line(
                &mut o,
                &format!("P{} {label} (ms):", p_word(*p)),
                format!("{v:.2}"),
            );
        }
    }
    if let Some(g) = &s.gateway_ms {
        stats_section(
            &mut o,
            "Gateway's own time (Server-Timing gw)",
            "gateway time",
            g,
        );
    }
    if let Some(h) = &s.hop_ms {
        stats_section(
            &mut o,
            "Gateway's recorded hop cost (Server-Timing hop)",
            "hop cost",
            h,
        );
    }
    let _ = writeln!(o, "{}", "=".repeat(50));
    if !s.errors.is_empty() {
        let _ = writeln!(o, "Failures by cause:");
        for (e, n) in &s.errors {
            let _ = writeln!(o, "  {n:>6} × {e}");
        }
    }
    if s.outputs_without_usage > 0 {
        let _ = writeln!(
            o,
            "note: {} request(s) reported no usage; {}",
            s.outputs_without_usage,
            if kind.streams() {
                "their output tokens are their content events"
            } else {
                "their input tokens are the prompt's own count"
            }
        );
    }
    o
}

/// A section of figures a gateway reported about itself (milliseconds, three decimals).
fn stats_section(o: &mut String, title: &str, what: &str, st: &Stats) {
    let _ = writeln!(o, "{title:-^50}");
    let mut line = |k: String, v: f64| {
        let _ = writeln!(o, "{k:<40} {v:<10.3}");
    };
    line(format!("Mean {what} (ms):"), st.mean);
    line(format!("Median {what} (ms):"), st.median);
    for (p, v) in &st.percentiles {
        line(format!("P{} {what} (ms):", p_word(*p)), *v);
    }
}

/// vLLM's result keys for one target (per-request arrays included, texts not kept): those of a
/// generation, or those of a pooling run for an endpoint type whose answers are not streamed.
pub fn vllm_json(
    s: &Summary,
    outcomes: &[&Outcome],
    selected: &[String],
    kind: EndpointType,
) -> serde_json::Map<String, Value> {
    if !kind.streams() {
        return vllm_pooling_json(s, outcomes, selected);
    }
    let mut m = serde_json::Map::new();
    m.insert("duration".into(), json!(s.duration_s));
    m.insert("completed".into(), json!(s.completed));
    m.insert("failed".into(), json!(s.failed));
    m.insert("total_input_tokens".into(), json!(s.total_input));
    m.insert("total_output_tokens".into(), json!(s.total_output));
    m.insert("request_throughput".into(), json!(s.request_throughput));
    // vLLM writes null without --goodput.
    m.insert("request_goodput".into(), json!(s.goodput));
    m.insert("output_throughput".into(), json!(s.output_throughput));
    m.insert(
        "total_token_throughput".into(),
        json!(s.total_token_throughput),
    );
    m.insert(
        "max_output_tokens_per_s".into(),
        json!(s.peak_output_throughput),
    );
    m.insert(
        "max_concurrent_requests".into(),
        json!(s.max_concurrent_requests),
    );
    m.insert(
        "peak_concurrent_requests_instant".into(),
        json!(s.peak_concurrent_instant),
    );
    m.insert(
        "input_lens".into(),
        json!(outcomes.iter().map(|o| o.input_tokens).collect::<Vec<_>>()),
    );
    m.insert(
        "output_lens".into(),
        json!(
            outcomes
                .iter()
                .map(|o| if o.ok() { o.output_tokens } else { 0 })
                .collect::<Vec<_>>()
        ),
    );
    m.insert(
        "ttfts".into(),
        json!(
            outcomes
                .iter()
                .map(|o| o.ttft.map_or(0.0, |d| d.as_secs_f64()))
                .collect::<Vec<_>>()
        ),
    );
    m.insert(
        "itls".into(),
        json!(
            outcomes
                .iter()
                .map(|o| o
                    .itls_ms
                    .iter()
                    .map(|v| f64::from(*v) / 1e3)
                    .collect::<Vec<_>>())
                .collect::<Vec<_>>()
        ),
    );
    // E2EL per request in seconds (0 for a failed one, as vLLM leaves it).
    m.insert(
        "latencies".into(),
        json!(
            outcomes
                .iter()
                .map(|o| match (o.ok(), o.e2el) {
                    (true, Some(d)) => d.as_secs_f64(),
                    _ => 0.0,
                })
                .collect::<Vec<_>>()
        ),
    );
    m.insert(
        "errors".into(),
        json!(
            outcomes
                .iter()
                .map(|o| o.error.clone().unwrap_or_default())
                .collect::<Vec<_>>()
        ),
    );
    metric_keys(&mut m, s, selected);
    m
}

/// vLLM's result keys of a pooling run (`calculate_metrics_for_embeddings`): no output tokens,
/// no TTFT or ITL, one latency per request; plus `failed`, which vLLM prints but leaves out
/// of this dict, and fleetgate's instantaneous peak.
fn vllm_pooling_json(
    s: &Summary,
    outcomes: &[&Outcome],
    selected: &[String],
) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("duration".into(), json!(s.duration_s));
    m.insert("completed".into(), json!(s.completed));
    m.insert("failed".into(), json!(s.failed));
    m.insert("total_input_tokens".into(), json!(s.total_input));
    // One input (the prompt) per request.
    m.insert("total_input_sequences".into(), json!(s.completed));
    m.insert("request_throughput".into(), json!(s.request_throughput));
    m.insert(
        "input_sequence_throughput".into(),
        json!(s.request_throughput),
    );
    m.insert(
        "total_token_throughput".into(),
        json!(s.total_token_throughput),
    );
    if let Some(g) = s.goodput {
        m.insert("request_goodput".into(), json!(g));
    }
    m.insert(
        "peak_concurrent_requests_instant".into(),
        json!(s.peak_concurrent_instant),
    );
    m.insert(
        "input_lens".into(),
        json!(outcomes.iter().map(|o| o.input_tokens).collect::<Vec<_>>()),
    );
    m.insert(
        "latencies".into(),
        json!(
            outcomes
                .iter()
                .map(|o| o.e2el.map_or(0.0, |d| d.as_secs_f64()))
                .collect::<Vec<_>>()
        ),
    );
    m.insert(
        "errors".into(),
        json!(
            outcomes
                .iter()
                .map(|o| o.error.clone().unwrap_or_default())
                .collect::<Vec<_>>()
        ),
    );
    metric_keys(&mut m, s, selected);
    m
}

/// `mean_/median_/std_/p<N>_<metric>_ms` of each selected metric.
fn metric_keys(m: &mut serde_json::Map<String, Value>, s: &Summary, selected: &[String]) {
    for (key, _, _) in METRICS {
        if !selected.iter().any(|m| m == key) {
            continue;
        }
        let st = &s.metrics[key];
        m.insert(format!("mean_{key}_ms"), json!(st.mean));
        m.insert(format!("median_{key}_ms"), json!(st.median));
        m.insert(format!("std_{key}_ms"), json!(st.std));
        for (p, v) in &st.percentiles {
            m.insert(format!("p{}_{key}_ms", p_word(*p)), json!(v));
        }
    }
}

/// The seed's `result.json` shape (of an embedding run, only `error_rate`: it has no TTFT,
/// TPOT or output tokens).
pub fn seed_json(s: &Summary, kind: EndpointType) -> serde_json::Map<String, Value> {
    if !kind.streams() {
        let mut m = serde_json::Map::new();
        m.insert("error_rate".into(), json!(s.error_rate()));
        return m;
    }
    let pct = |st: &Stats| {
        let mut o = serde_json::Map::new();
        for p in [50.0, 95.0, 99.0] {
            let v = if p == 50.0 {
                Some(st.median)
            } else {
                st.get(&format!("p{}", p_word(p)))
            };
            if let Some(v) = v {
                o.insert(format!("p{}", p_word(p)), json!(v));
            }
        }
        Value::Object(o)
    };
    let mut m = serde_json::Map::new();
    m.insert("ttft_ms".into(), pct(&s.metrics["ttft"]));
    m.insert("tpot_ms".into(), pct(&s.metrics["tpot"]));
    m.insert(
        "throughput_tokens_per_sec".into(),
        json!(s.output_throughput),
    );
    m.insert("error_rate".into(), json!(s.error_rate()));
    m
}

/// `fleetgate bench diff A.json B.json`: every `mean_/median_/pNN_*_ms` and throughput key of
/// two result files side by side.
pub fn diff(a: &Value, b: &Value) -> Result<String, String> {
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
        Ok((obj.clone(), "a single-target run".to_owned()))
    };
    let ((a, what_a), (b, what_b)) = (pick(a)?, pick(b)?);
    let mut o = String::new();
    let _ = writeln!(o, "A: {what_a}");
    let _ = writeln!(o, "B: {what_b}");
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
pub const EXIT_INTERRUPTED: u8 = 130;

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
        // Interleaved targets share the arrivals: each gets its part of the rate.
        let rate = if plan.targets.len() > 1 {
            plan.request_rate / plan.targets.len() as f64
        } else {
            plan.request_rate
        };
        let kind = plan.endpoint_type;
        text.push_str(&render(
            &s,
            &plan.selected,
            plan.max_concurrency,
            rate,
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

/// The breakdown by request class (settings.json's `request_distribution`): per class, its
/// requests and TTFT / TPOT / E2EL (mean, median and each measured percentile), as a table and
/// as the result's `classes` key. None when the prompts carry no class.
fn per_class(plan: &Plan, mine: &[&Outcome], dur: f64) -> Option<(String, Value)> {
    let mut names: Vec<&str> = Vec::new();
    for p in &plan.prompts {
        if let Some(c) = p.class.as_deref()
            && !names.contains(&c)
        {
            names.push(c);
        }
    }
    if names.is_empty() {
        return None;
    }
    let class_of = |o: &Outcome| plan.prompts[o.prompt].class.as_deref().unwrap_or("-");
    let pcts = &plan.percentiles;
    let mut text = format!("{:-^50}\n", "Per request class");
    let mut header = format!("{:<12} {:>6} {:>6}", "class", "ok", "failed");
    let keys: Vec<&str> = ["ttft", "tpot", "e2el"]
        .into_iter()
        .filter(|k| plan.endpoint_type.metrics().contains(k))
        .collect();
    for m in keys.iter().map(|k| k.to_uppercase()) {
        header.push_str(&format!(" {:>10}", format!("{m} mean")));
        for p in pcts {
            header.push_str(&format!(" {:>10}", format!("{m} P{}", p_word(*p))));
        }
    }
    text.push_str(&header);
    text.push_str("  (ms)\n");
    let mut json = serde_json::Map::new();
    for name in names {
        let of: Vec<&Outcome> = mine
            .iter()
            .copied()
            .filter(|o| class_of(o) == name)
            .collect();
        let s = Summary::of(&of, dur, pcts, &Vec::new());
        let mut line = format!("{:<12} {:>6} {:>6}", name, s.completed, s.failed);
        let mut j = serde_json::Map::new();
        j.insert("completed".into(), json!(s.completed));
        j.insert("failed".into(), json!(s.failed));
        let ok = s.completed.max(1) as f64;
        j.insert("mean_input_tokens".into(), json!(s.total_input as f64 / ok));
        j.insert(
            "mean_output_tokens".into(),
            json!(s.total_output as f64 / ok),
        );
        for &key in &keys {
            let st = s.metrics.get(key).cloned().unwrap_or_default();
            let val = |v: f64| if st.count > 0 { json!(v) } else { Value::Null };
            let cell = |v: f64| {
                if st.count > 0 {
                    format!(" {v:>10.2}")
                } else {
                    format!(" {:>10}", "-")
                }
            };
            line.push_str(&cell(st.mean));
            j.insert(format!("mean_{key}_ms"), val(st.mean));
            j.insert(format!("median_{key}_ms"), val(st.median));
            for (p, v) in &st.percentiles {
                line.push_str(&cell(*v));
                j.insert(format!("p{}_{key}_ms", p_word(*p)), val(*v));
            }
        }
        text.push_str(&line);
        text.push('\n');
        json.insert(name.to_owned(), Value::Object(j));
    }
    text.push_str(&format!("{:=^50}\n", ""));
    Some((text, Value::Object(json)))
}

/// Figures a gateway reported about itself (from `Server-Timing`) as a result key.
fn stats_json(g: &Stats) -> Value {
    json!({"count": g.count, "mean": g.mean, "median": g.median, "max": g.max,
           "percentiles": g.percentiles.iter().map(|(p, v)| (format!("p{}", p_word(*p)), json!(v))).collect::<serde_json::Map<_, _>>()})
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
