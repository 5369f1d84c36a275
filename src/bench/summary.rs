//! Statistics of a run in `vllm bench serve`'s terms: the summary of one target (counts,
//! throughputs, peaks, goodput, errors) and, per latency metric, mean / median / std / max and
//! percentiles (numpy's linear interpolation).

use std::collections::BTreeMap;

use super::measure::Outcome;

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
}
