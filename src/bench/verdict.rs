//! Verdicts on a run: `--sla` objectives and what violates them, and the comparison of two
//! targets (mean, P95, P99 deltas against the thresholds).

use std::fmt::Write as _;

use super::summary::{METRICS, Summary, p_word};

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

#[cfg(test)]
mod tests {
    use super::*;

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
