//! Summaries of a set of measured values (µs): count, nearest-rank percentiles, mean and
//! maximum, and their JSON form.

use serde_json::{Value, json};

#[derive(Clone, Copy, Debug, Default)]
pub struct Summary {
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub max: f64,
}

/// Nearest-rank percentile of sorted values.
fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub fn summarize(values: &[f64]) -> Summary {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Summary {
        n,
        p50: pct(&v, 50.0),
        p90: pct(&v, 90.0),
        p99: pct(&v, 99.0),
        mean: if n == 0 {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / n as f64
        },
        max: v.last().copied().unwrap_or(f64::NAN),
    }
}

pub fn summary_json(s: &Summary) -> Value {
    json!({"n": s.n, "p50": s.p50, "p90": s.p90, "p99": s.p99, "mean": s.mean, "max": s.max})
}
