//! `--sla` objectives: their names parsed and checked, the ones a run violates, and their
//! table.

use std::fmt::Write as _;

use crate::summary::{METRICS, Summary, p_word};

/// One `--sla` objective: `ttft_p99_ms=1500` (at most) or `error_rate=0.01`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Objective {
    pub(crate) name: String,
    pub(crate) limit: f64,
}

/// Parse `ttft_p99_ms=1500,e2el_p95_ms=60000`. A percentile an objective names is measured:
/// it is added to `percentiles` (the `--metric-percentiles`) when missing.
pub(crate) fn parse_sla(text: &str, percentiles: &mut Vec<f64>) -> Result<Vec<Objective>, String> {
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
            if !matches!(stat, "mean" | "median" | "max") {
                let p = stat
                    .strip_prefix('p')
                    .and_then(|p| p.parse::<f64>().ok())
                    .filter(|p| (0.0..=100.0).contains(p) && p_word(*p) == stat[1..])
                    .ok_or_else(|| {
                        format!(
                            "--sla `{name}`: `{stat}` is not a statistic; use mean, median, max or a percentile such as p95 or p99.9"
                        )
                    })?;
                if !percentiles.iter().any(|q| (q - p).abs() < 1e-9) {
                    percentiles.push(p);
                    percentiles.sort_by(f64::total_cmp);
                }
            }
        }
        out.push(Objective { name, limit });
    }
    Ok(out)
}

/// The objectives `s` violates: (objective, measured).
pub(crate) fn violations(s: &Summary, sla: &[Objective]) -> Vec<(Objective, f64)> {
    sla.iter()
        .filter_map(|o| {
            let v = s.value(&o.name)?;
            (v > o.limit).then(|| (o.clone(), v))
        })
        .collect()
}

/// The `--sla` table: every objective, its limit, what was measured and whether it was met
/// (the header says whether any was violated).
pub(crate) fn render_sla(s: &Summary, sla: &[Objective]) -> String {
    let mut o = String::new();
    let violated = !violations(s, sla).is_empty();
    let title = if violated {
        " SLA violated "
    } else {
        " SLA: every objective met "
    };
    let _ = writeln!(o, "{title:=^62}");
    let _ = writeln!(
        o,
        "{:<24} {:>12} {:>12}  result",
        "objective", "limit", "measured"
    );
    for obj in sla {
        let got = s.value(&obj.name);
        let result = match got {
            Some(v) if v > obj.limit => "VIOLATED",
            Some(_) => "met",
            None => "not measured",
        };
        let _ = writeln!(
            o,
            "{:<24} {:>12} {:>12}  {result}",
            obj.name,
            significant(obj.limit),
            got.map_or_else(|| "-".to_owned(), significant)
        );
    }
    o
}

/// A number with four significant digits and no trailing zeros (`0.001`, `1500`, `12.35`):
/// a limit is printed as it was written, however small.
pub(crate) fn significant(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let magnitude = v.abs().log10().floor() as i32;
    let decimals = usize::try_from((3 - magnitude).clamp(0, 12)).unwrap_or(0);
    let text = format!("{v:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        text
    }
}
