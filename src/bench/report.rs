//! Statistics of a run in `vllm bench serve`'s terms: the summary (throughputs, peaks), and per
//! metric mean / median / std / percentiles (numpy's linear interpolation), the terminal layout,
//! the result JSON (vLLM's keys plus the seed's `result.json` shape), SLA checks and the
//! comparison of two targets.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{Value, json};

use super::engine::RunResult;
use super::measure::Outcome;
use super::plan::Plan;
use super::sweep;

/// The latency metrics, in vLLM's order, with their section titles and labels.
pub const METRICS: &[(&str, &str, &str)] = &[
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
];

/// Mean, median, standard deviation and percentiles of one metric (milliseconds).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    pub count: usize,
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    pub max: f64,
    /// (percentile, value).
    pub percentiles: Vec<(f64, f64)>,
}

/// numpy's default percentile: linear interpolation between the closest ranks.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

impl Stats {
    pub fn of(mut values: Vec<f64>, percentiles: &[f64]) -> Stats {
        if values.is_empty() {
            return Stats {
                percentiles: percentiles.iter().map(|p| (*p, 0.0)).collect(),
                ..Stats::default()
            };
        }
        values.sort_by(f64::total_cmp);
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        Stats {
            count: values.len(),
            mean,
            median: percentile(&values, 50.0),
            std: var.sqrt(),
            max: values[values.len() - 1],
            percentiles: percentiles
                .iter()
                .map(|p| (*p, percentile(&values, *p)))
                .collect(),
        }
    }

    /// The value of `stat`: `mean`, `median`, `std`, `max` or `pNN`.
    pub fn get(&self, stat: &str) -> Option<f64> {
        match stat {
            "mean" => Some(self.mean),
            "median" | "p50" => Some(self.median),
            "std" => Some(self.std),
            "max" => Some(self.max),
            _ => {
                let p: f64 = stat.strip_prefix('p')?.parse().ok()?;
                self.percentiles
                    .iter()
                    .find(|(q, _)| (*q - p).abs() < 1e-9)
                    .map(|(_, v)| *v)
            }
        }
    }
}

/// How vLLM names a percentile in its keys: `99`, `99.9`.
pub fn p_word(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("{}", p as i64)
    } else {
        format!("{p}")
    }
}

/// One target's figures.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub total_input: u64,
    pub total_output: u64,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub peak_output_throughput: f64,
    pub peak_concurrency: usize,
    /// Requests meeting every `--goodput` objective, per second.
    pub goodput: Option<f64>,
    pub metrics: BTreeMap<&'static str, Stats>,
    /// The gateway's own time per request from `Server-Timing` (when it sent one).
    pub gateway_ms: Option<Stats>,
    /// Error message → count.
    pub errors: BTreeMap<String, usize>,
    /// Requests whose output count came from content events (no usage reported).
    pub outputs_without_usage: usize,
}

/// `--goodput` objectives: metric → maximum milliseconds.
pub type Goodput = Vec<(String, f64)>;

impl Summary {
    pub fn of(
        outcomes: &[&Outcome],
        duration_s: f64,
        percentiles: &[f64],
        goodput: &Goodput,
    ) -> Summary {
        let ok: Vec<&&Outcome> = outcomes.iter().filter(|o| o.ok()).collect();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let mut metrics = BTreeMap::new();
        metrics.insert(
            "ttft",
            Stats::of(
                ok.iter().filter_map(|o| o.ttft.map(ms)).collect(),
                percentiles,
            ),
        );
        metrics.insert(
            "tpot",
            Stats::of(
                ok.iter().filter_map(|o| o.tpot().map(ms)).collect(),
                percentiles,
            ),
        );
        metrics.insert(
            "itl",
            Stats::of(
                ok.iter()
                    .flat_map(|o| o.itls_ms.iter().map(|v| f64::from(*v)))
                    .collect(),
                percentiles,
            ),
        );
        metrics.insert(
            "e2el",
            Stats::of(
                ok.iter().filter_map(|o| o.e2el.map(ms)).collect(),
                percentiles,
            ),
        );
        let total_input: u64 = ok.iter().map(|o| o.input_tokens).sum();
        let total_output: u64 = ok.iter().map(|o| o.output_tokens).sum();
        // Peak output tokens per second: content events in 1 s buckets of wall time.
        let mut buckets: BTreeMap<u64, u64> = BTreeMap::new();
        for o in &ok {
            let base = o.sent_at.as_secs_f64();
            for t in &o.token_at_ms {
                let at = base + f64::from(*t) / 1e3;
                *buckets.entry(at as u64).or_default() += 1;
            }
        }
        // Peak concurrency: the most requests open at once.
        let mut edges: Vec<(f64, i32)> = Vec::with_capacity(outcomes.len() * 2);
        for o in outcomes {
            let start = o.sent_at.as_secs_f64();
            edges.push((start, 1));
            edges.push((start + o.took.as_secs_f64(), -1));
        }
        edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let (mut open, mut peak) = (0i32, 0i32);
        for (_, d) in edges {
            open += d;
            peak = peak.max(open);
        }
        let good = (!goodput.is_empty()).then(|| {
            ok.iter()
                .filter(|o| {
                    goodput.iter().all(|(m, limit)| {
                        let v = match m.as_str() {
                            "ttft" => o.ttft.map(ms),
                            "tpot" => o.tpot().map(ms),
                            "e2el" => o.e2el.map(ms),
                            _ => None,
                        };
                        v.is_none_or(|v| v <= *limit)
                    })
                })
                .count()
        });
        let gw: Vec<f64> = outcomes.iter().filter_map(|o| o.gateway_ms).collect();
        let mut errors = BTreeMap::new();
        for o in outcomes {
            if let Some(e) = &o.error {
                *errors.entry(e.clone()).or_default() += 1;
            }
        }
        let d = duration_s.max(1e-9);
        Summary {
            completed: ok.len(),
            failed: outcomes.len() - ok.len(),
            duration_s,
            total_input,
            total_output,
            request_throughput: ok.len() as f64 / d,
            output_throughput: total_output as f64 / d,
            total_token_throughput: (total_input + total_output) as f64 / d,
            peak_output_throughput: buckets.values().copied().max().unwrap_or(0) as f64,
            peak_concurrency: usize::try_from(peak).unwrap_or(0),
            goodput: good.map(|g| g as f64 / d),
            metrics,
            gateway_ms: (!gw.is_empty()).then(|| Stats::of(gw, percentiles)),
            errors,
            outputs_without_usage: ok.iter().filter(|o| !o.usage_reported).count(),
        }
    }

    pub fn error_rate(&self) -> f64 {
        let n = self.completed + self.failed;
        if n == 0 {
            0.0
        } else {
            self.failed as f64 / n as f64
        }
    }

    /// The value named `<metric>_<stat>_ms` (e.g. `ttft_p99_ms`), or `error_rate`.
    pub fn value(&self, name: &str) -> Option<f64> {
        if name == "error_rate" {
            return Some(self.error_rate());
        }
        let rest = name.strip_suffix("_ms")?;
        let (metric, stat) = rest.split_once('_')?;
        self.metrics.get(metric)?.get(stat)
    }
}

/// The terminal summary in `vllm bench serve`'s layout.
pub fn render(
    s: &Summary,
    selected: &[String],
    max_concurrency: Option<usize>,
    rate: f64,
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
    line(
        &mut o,
        "Total generated tokens:",
        s.total_output.to_string(),
    );
    line(
        &mut o,
        "Request throughput (req/s):",
        format!("{:.2}", s.request_throughput),
    );
    if let Some(g) = s.goodput {
        line(&mut o, "Request goodput (req/s):", format!("{g:.2}"));
    }
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
        format!("{:.2}", s.peak_concurrency as f64),
    );
    line(
        &mut o,
        "Total Token throughput (tok/s):",
        format!("{:.2}", s.total_token_throughput),
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
        let _ = writeln!(o, "{:-^50}", "Gateway's own time (Server-Timing gw)");
        line(&mut o, "Mean gateway time (ms):", format!("{:.3}", g.mean));
        line(
            &mut o,
            "Median gateway time (ms):",
            format!("{:.3}", g.median),
        );
        for (p, v) in &g.percentiles {
            line(
                &mut o,
                &format!("P{} gateway time (ms):", p_word(*p)),
                format!("{v:.3}"),
            );
        }
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
            "note: {} request(s) reported no usage; their output tokens are their content events",
            s.outputs_without_usage
        );
    }
    o
}

/// vLLM's result keys for one target (per-request arrays included, texts not kept).
pub fn vllm_json(
    s: &Summary,
    outcomes: &[&Outcome],
    selected: &[String],
) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("duration".into(), json!(s.duration_s));
    m.insert("completed".into(), json!(s.completed));
    m.insert("failed".into(), json!(s.failed));
    m.insert("total_input_tokens".into(), json!(s.total_input));
    m.insert("total_output_tokens".into(), json!(s.total_output));
    m.insert("request_throughput".into(), json!(s.request_throughput));
    if let Some(g) = s.goodput {
        m.insert("request_goodput".into(), json!(g));
    }
    m.insert("output_throughput".into(), json!(s.output_throughput));
    m.insert(
        "total_token_throughput".into(),
        json!(s.total_token_throughput),
    );
    m.insert(
        "max_output_tokens_per_s".into(),
        json!(s.peak_output_throughput),
    );
    m.insert("max_concurrent_requests".into(), json!(s.peak_concurrency));
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
    m.insert(
        "errors".into(),
        json!(
            outcomes
                .iter()
                .map(|o| o.error.clone().unwrap_or_default())
                .collect::<Vec<_>>()
        ),
    );
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
    m
}

/// The seed's `result.json` shape.
pub fn seed_json(s: &Summary) -> serde_json::Map<String, Value> {
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

/// One `--sla` objective: `ttft_p99_ms=1500` (at most) or `error_rate=0.01`.
#[derive(Debug, Clone, PartialEq)]
pub struct Objective {
    pub name: String,
    pub limit: f64,
}

/// Parse `ttft_p99_ms=1500,e2el_p95_ms=60000`. `percentiles` are the ones measured.
pub fn parse_sla(text: &str, percentiles: &[f64]) -> Result<Vec<Objective>, String> {
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, value) = part
            .split_once('=')
            .ok_or_else(|| format!("--sla `{part}`: write name=value, e.g. ttft_p99_ms=1500"))?;
        let limit: f64 = value
            .trim()
            .parse()
            .map_err(|_| format!("--sla `{part}`: `{value}` is not a number"))?;
        let name = name.trim().to_owned();
        if name != "error_rate" {
            let rest = name.strip_suffix("_ms").ok_or_else(|| {
                format!("--sla `{name}`: names are <metric>_<stat>_ms (ttft, tpot, itl, e2el × mean, median, pNN) or error_rate")
            })?;
            let (metric, stat) = rest
                .split_once('_')
                .ok_or_else(|| format!("--sla `{name}`: expected e.g. ttft_p99_ms"))?;
            if !METRICS.iter().any(|(k, _, _)| *k == metric) {
                return Err(format!(
                    "--sla `{name}`: `{metric}` is not one of ttft, tpot, itl, e2el"
                ));
            }
            let known = matches!(stat, "mean" | "median" | "max")
                || stat
                    .strip_prefix('p')
                    .and_then(|p| p.parse::<f64>().ok())
                    .is_some_and(|p| p == 50.0 || percentiles.iter().any(|q| (q - p).abs() < 1e-9));
            if !known {
                return Err(format!(
                    "--sla `{name}`: `{stat}` is not measured; use mean, median, max or one of the --metric-percentiles ({})",
                    percentiles
                        .iter()
                        .map(|p| format!("p{}", p_word(*p)))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        out.push(Objective { name, limit });
    }
    Ok(out)
}

/// The objectives `s` violates: (objective, measured).
pub fn violations(s: &Summary, sla: &[Objective]) -> Vec<(Objective, f64)> {
    sla.iter()
        .filter_map(|o| {
            let v = s.value(&o.name)?;
            (v > o.limit).then(|| (o.clone(), v))
        })
        .collect()
}

pub fn render_violations(v: &[(Objective, f64)]) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{:=^50}", " SLA violated ");
    let _ = writeln!(o, "{:<24} {:>12} {:>12}", "objective", "limit", "measured");
    for (obj, got) in v {
        let _ = writeln!(o, "{:<24} {:>12.2} {:>12.2}", obj.name, obj.limit, got);
    }
    o
}

/// Thresholds of the compare verdict, in percent.
#[derive(Debug, Clone, Copy)]
pub struct Thresholds {
    pub mean_pct: f64,
    pub p95_pct: f64,
}

/// One line of the comparison.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Delta {
    pub metric: String,
    pub stat: String,
    pub baseline_ms: f64,
    pub measured_ms: f64,
    pub delta_ms: f64,
    pub delta_pct: f64,
    /// The threshold this line is judged against (none: reported only).
    pub limit_pct: Option<f64>,
    pub pass: bool,
}

/// Compare `measured` with `baseline` at mean, P95 and P99 of every selected metric.
pub fn compare(
    baseline: &Summary,
    measured: &Summary,
    selected: &[String],
    t: Thresholds,
) -> Vec<Delta> {
    let mut out = Vec::new();
    for (key, _, _) in METRICS {
        if !selected.iter().any(|m| m == key) {
            continue;
        }
        let (a, b) = (&baseline.metrics[key], &measured.metrics[key]);
        for (stat, limit) in [
            ("mean", Some(t.mean_pct)),
            ("p95", Some(t.p95_pct)),
            ("p99", None),
        ] {
            let (Some(x), Some(y)) = (a.get(stat), b.get(stat)) else {
                continue;
            };
            let pct = if x.abs() > 1e-12 {
                (y - x) / x * 100.0
            } else {
                0.0
            };
            out.push(Delta {
                metric: (*key).to_owned(),
                stat: stat.to_owned(),
                baseline_ms: x,
                measured_ms: y,
                delta_ms: y - x,
                delta_pct: pct,
                limit_pct: limit,
                pass: limit.is_none_or(|l| pct.abs() <= l),
            });
        }
    }
    out
}

pub fn render_compare(names: [&str; 2], deltas: &[Delta], measured: &Summary) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{:=^78}", format!(" {} vs {} ", names[1], names[0]));
    let _ = writeln!(
        o,
        "{:<12} {:>14} {:>14} {:>12} {:>9}  verdict",
        "metric", names[0], names[1], "delta (ms)", "delta"
    );
    for d in deltas {
        let verdict = match (d.limit_pct, d.pass) {
            (None, _) => "(reported)".to_owned(),
            (Some(l), true) => format!("ok (≤ {l}%)"),
            (Some(l), false) => format!("OVER {l}%"),
        };
        let _ = writeln!(
            o,
            "{:<12} {:>14.3} {:>14.3} {:>+12.3} {:>+8.2}%  {}",
            format!("{} {}", d.metric.to_uppercase(), d.stat),
            d.baseline_ms,
            d.measured_ms,
            d.delta_ms,
            d.delta_pct,
            verdict
        );
    }
    if let Some(g) = &measured.gateway_ms {
        let ttft_delta = deltas
            .iter()
            .find(|d| d.metric == "ttft" && d.stat == "mean")
            .map(|d| d.delta_ms);
        let _ = writeln!(
            o,
            "gateway's own time (its Server-Timing): mean {:.3} ms, median {:.3} ms, max {:.3} ms{}",
            g.mean,
            g.median,
            g.max,
            ttft_delta.map_or(String::new(), |t| format!(
                "; client-side TTFT delta at the mean {t:+.3} ms"
            ))
        );
    }
    let pass = deltas.iter().all(|d| d.pass);
    let _ = writeln!(
        o,
        "verdict: {}",
        if pass {
            "PASS — the extra hop did not distort the measurement"
        } else {
            "FAIL — a delta is over its threshold"
        }
    );
    o
}

/// `fleetgate bench diff A.json B.json`: every `mean_/median_/pNN_*_ms` and throughput key of
/// two result files side by side.
pub fn diff(a: &Value, b: &Value) -> Result<String, String> {
    let pick = |v: &Value| -> Result<serde_json::Map<String, Value>, String> {
        let obj = v.as_object().ok_or("not a JSON object")?;
        // A compare run: its measured target.
        if let Some(t) = obj.get("targets").and_then(Value::as_object) {
            let measured = obj["comparison"]["measured"].as_str().unwrap_or_default();
            return t
                .get(measured)
                .and_then(Value::as_object)
                .cloned()
                .ok_or_else(|| "a compare result without its measured target".to_owned());
        }
        Ok(obj.clone())
    };
    let (a, b) = (pick(a)?, pick(b)?);
    let mut o = String::new();
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
        text.push_str(&render(&s, &plan.selected, plan.max_concurrency, rate));
        let mut m = vllm_json(&s, &mine, &plan.selected);
        m.extend(seed_json(&s));
        if let Some(g) = &s.gateway_ms {
            m.insert(
                "gateway_time_ms".into(),
                json!({"mean": g.mean, "median": g.median, "max": g.max,
                       "percentiles": g.percentiles.iter().map(|(p, v)| (format!("p{}", p_word(*p)), json!(v))).collect::<serde_json::Map<_, _>>()}),
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
        let deltas = compare(
            &summaries[0],
            &summaries[1],
            &plan.selected,
            plan.thresholds,
        );
        text.push('\n');
        text.push_str(&render_compare(
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
        let v = violations(measured, &plan.sla);
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
            text.push_str(&render_violations(&v));
            exit = EXIT_SLA;
        }
    }
    if let Some((q, red, inst)) = plan.capacity {
        let measured = &summaries[summaries.len() - 1];
        let at_sla = violations(measured, &plan.sla).is_empty() && measured.completed > 0;
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

pub(super) fn capacity_text(q: f64, red: f64, inst: u32, thr: Option<f64>, source: &str) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&v, 0.0), 1.0);
        let s = Stats::of(vec![4.0, 1.0, 3.0, 2.0], &[95.0, 99.0]);
        assert_eq!(s.mean, 2.5);
        assert!(
            (s.std - 1.118_033_988_749_895).abs() < 1e-12,
            "population std, as np.std"
        );
        assert_eq!(s.get("p95"), Some(percentile(&v, 95.0)));
        assert_eq!(p_word(99.0), "99");
        assert_eq!(p_word(99.9), "99.9");
    }

    #[test]
    fn sla_names_are_checked() {
        let ok = parse_sla(
            "ttft_p99_ms=1500, e2el_p95_ms=60000,error_rate=0.01",
            &[95.0, 99.0],
        )
        .unwrap();
        assert_eq!(ok.len(), 3);
        for (bad, says) in [
            ("ttft_p99=1", "_ms"),
            ("foo_p99_ms=1", "not one of"),
            ("ttft_p90_ms=1", "not measured"),
            ("ttft_p99_ms=fast", "not a number"),
            ("ttft", "name=value"),
        ] {
            let e = parse_sla(bad, &[95.0, 99.0]).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
