//! What a run measures and judges: the latency metrics and their percentiles, goodput, the
//! `--sla` objectives an endpoint type can have, the compare verdict's tolerances, the sweep and
//! capacity planning.

use crate::args::BenchArgs;
use crate::spec::{self, EndpointType};
use crate::summary::{Goodput, METRICS};
use crate::verdict::Thresholds;

/// Whether the `--sla` objective `name` is a figure answers of `kind` have.
pub(super) fn objective_exists(name: &str, kind: EndpointType) -> bool {
    name == "error_rate"
        || name
            .split('_')
            .next()
            .is_some_and(|m| kind.metrics().contains(&m))
}

/// `--percentile-metrics`: which latency metrics get percentiles (by default vLLM's for the
/// endpoint type). A metric the endpoint type's answers do not have (TTFT of an embedding) is
/// left out with a note, as vLLM leaves it out, rather than reported as a measured zero.
pub(super) fn selected_metrics(
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
pub(super) fn percentiles(args: &BenchArgs) -> Result<Vec<f64>, String> {
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
pub(super) fn goodput(args: &BenchArgs, kind: EndpointType) -> Result<Goodput, String> {
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
pub(super) fn verdict_thresholds(
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
pub(super) fn sweep_series(
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
pub(super) fn capacity(args: &BenchArgs) -> Result<Option<(f64, f64, u32)>, String> {
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
