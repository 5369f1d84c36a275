//! Statistics of a run in `vllm bench serve`'s terms: the summary of one target (counts,
//! throughputs, peaks, goodput, errors) and, per latency metric, mean / median / std / max and
//! percentiles (numpy's linear interpolation).

use std::collections::BTreeMap;

use super::measure::Outcome;

/// The latency metrics, in vLLM's order, with their section titles and labels.
pub(crate) const METRICS: &[(&str, &str, &str)] = &[
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
    pub(crate) std: f64,
    pub(crate) max: f64,
    /// (percentile, value).
    pub(crate) percentiles: Vec<(f64, f64)>,
}

/// numpy's default percentile: linear interpolation between the closest ranks.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

impl Stats {
    pub(crate) fn of(mut values: Vec<f64>, percentiles: &[f64]) -> Stats {
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
    pub(crate) fn get(&self, stat: &str) -> Option<f64> {
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
pub(crate) fn p_word(p: f64) -> String {
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
    pub(crate) duration_s: f64,
    pub total_input: u64,
    pub total_output: u64,
    pub(crate) request_throughput: f64,
    pub(crate) output_throughput: f64,
    pub(crate) total_token_throughput: f64,
    /// vLLM's `max_output_tokens_per_s`: the most token events in one second (`busiest_seconds`).
    pub(crate) peak_output_throughput: f64,
    /// vLLM's `max_concurrent_requests`: the most requests active within one second
    /// (`busiest_seconds`) — at least the instantaneous peak, usually more.
    pub max_concurrent_requests: usize,
    /// The most requests in flight at one instant (sent, not yet answered to the end; failed
    /// ones included).
    pub peak_concurrent_instant: usize,
    /// Requests meeting every `--goodput` objective, per second.
    pub(crate) goodput: Option<f64>,
    pub metrics: BTreeMap<&'static str, Stats>,
    /// The gateway's own time per request from `Server-Timing` (when it sent one).
    pub gateway_ms: Option<Stats>,
    /// The hop cost the gateway recorded per successful request (`Server-Timing` hop, when it
    /// sent one).
    pub hop_ms: Option<Stats>,
    /// Error message → count.
    pub errors: BTreeMap<String, usize>,
    /// Requests whose output count came from content events (no usage reported).
    pub outputs_without_usage: usize,
}

/// `--goodput` objectives: metric → maximum milliseconds.
pub(crate) type Goodput = Vec<(String, f64)>;

impl Summary {
    pub(crate) fn of(
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
        let (peak_tokens, busiest) = busiest_seconds(&ok);
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
        // Beside the successful requests' TTFT, which the compare's client-side delta is of.
        let hop: Vec<f64> = ok.iter().filter_map(|o| o.hop_ms).collect();
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
            peak_output_throughput: peak_tokens as f64,
            max_concurrent_requests: busiest,
            peak_concurrent_instant: peak_in_flight(outcomes),
            goodput: good.map(|g| g as f64 / d),
            metrics,
            gateway_ms: (!gw.is_empty()).then(|| Stats::of(gw, percentiles)),
            hop_ms: (!hop.is_empty()).then(|| Stats::of(hop, percentiles)),
            errors,
            outputs_without_usage: ok.iter().filter(|o| !o.usage_reported).count(),
        }
    }

    pub(crate) fn error_rate(&self) -> f64 {
        let n = self.completed + self.failed;
        if n == 0 {
            0.0
        } else {
            self.failed as f64 / n as f64
        }
    }

    /// The value named `<metric>_<stat>_ms` (e.g. `ttft_p99_ms`), or `error_rate`.
    pub(crate) fn value(&self, name: &str) -> Option<f64> {
        if name == "error_rate" {
            return Some(self.error_rate());
        }
        let rest = name.strip_suffix("_ms")?;
        let (metric, stat) = rest.split_once('_')?;
        self.metrics.get(metric)?.get(stat)
    }
}

/// vLLM 0.33's two per-second peaks (`calculate_metrics` in vllm/benchmarks/serve.py), over the
/// successful requests in 1-second buckets counted from the earliest one's start: the most token
/// events in one bucket (`max_output_tokens_per_s`), and the most requests active at any time
/// within one bucket (`max_concurrent_requests`; a request counts in every bucket from the one
/// its start falls in to the one its end falls in, both included, its end being its E2EL). A
/// request that ends in the second another starts counts in both, so this is at least the
/// instantaneous peak, and more the shorter the requests.
fn busiest_seconds(ok: &[&&Outcome]) -> (u64, usize) {
    let Some(first) = ok.iter().map(|o| o.sent_at).min() else {
        return (0, 0);
    };
    let second = |d: std::time::Duration| d.saturating_sub(first).as_secs() as usize;
    fn add<T: Default + Clone + std::ops::AddAssign>(v: &mut Vec<T>, i: usize, by: T) {
        if v.len() <= i {
            v.resize(i + 1, T::default());
        }
        v[i] += by;
    }
    let mut tokens: Vec<u64> = Vec::new();
    // Per bucket: requests whose activity starts there (+1) or ended in the bucket before (−1).
    let mut entering: Vec<i64> = Vec::new();
    for o in ok {
        let base = o.sent_at.saturating_sub(first).as_secs_f64();
        for t in &o.token_at_ms {
            add(&mut tokens, (base + f64::from(*t) / 1e3) as usize, 1);
        }
        let from = second(o.sent_at);
        let to = second(o.sent_at + o.e2el.unwrap_or(o.took));
        add(&mut entering, from, 1);
        add(&mut entering, to + 1, -1);
    }
    let busiest = entering
        .iter()
        .scan(0i64, |active, d| {
            *active += d;
            Some(*active)
        })
        .max()
        .unwrap_or(0);
    (
        tokens.into_iter().max().unwrap_or(0),
        usize::try_from(busiest).unwrap_or(0),
    )
}

/// The most requests in flight at one instant: each from its send to the end of its answer (or
/// its failure), an end before a start at the same instant.
fn peak_in_flight(outcomes: &[&Outcome]) -> usize {
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
    usize::try_from(peak).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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

    /// A successful request sent at `at_ms` whose tokens came at `tokens_ms` after it, ending
    /// (E2EL) at the last and its body `tail_ms` later.
    fn request(at_ms: u64, tokens_ms: &[u64], tail_ms: u64) -> Outcome {
        let last = tokens_ms.last().copied().unwrap_or(0);
        Outcome {
            sent_at: Duration::from_millis(at_ms),
            ttft: Some(Duration::from_millis(tokens_ms[0])),
            e2el: Some(Duration::from_millis(last)),
            took: Duration::from_millis(last + tail_ms),
            token_at_ms: tokens_ms.iter().map(|t| *t as f32).collect(),
            output_tokens: tokens_ms.len() as u64,
            usage_reported: true,
            ..Outcome::default()
        }
    }

    #[test]
    fn max_concurrent_requests_counts_requests_active_within_each_second_as_vllm() {
        // One at a time, 300 ms each, back to back: never two in flight at once, but four
        // within the first second (0–300, 300–600, 600–900, 900–1200) and four in the next.
        let seq: Vec<Outcome> = (0..10)
            .map(|i| request(i * 300, &[100, 200, 300], 0))
            .collect();
        let refs: Vec<&Outcome> = seq.iter().collect();
        let s = Summary::of(&refs, 3.0, &[99.0], &Vec::new());
        assert_eq!(s.peak_concurrent_instant, 1);
        assert_eq!(s.max_concurrent_requests, 4);
        // A failed request is in flight but not in vLLM's count.
        let mut with_failure = seq.clone();
        with_failure.push(Outcome {
            sent_at: Duration::from_millis(100),
            took: Duration::from_millis(50),
            error: Some("HTTP 500: boom".into()),
            ..Outcome::default()
        });
        let refs: Vec<&Outcome> = with_failure.iter().collect();
        let s = Summary::of(&refs, 3.0, &[99.0], &Vec::new());
        assert_eq!(
            (s.peak_concurrent_instant, s.max_concurrent_requests),
            (2, 4)
        );
        // The end is the last token (E2EL), not the end of the body: a long tail after the
        // last token does not stretch a request into the next second.
        let tail = [request(0, &[100, 900], 500), request(1000, &[100], 0)];
        let refs: Vec<&Outcome> = tail.iter().collect();
        let s = Summary::of(&refs, 2.0, &[99.0], &Vec::new());
        assert_eq!(
            (s.peak_concurrent_instant, s.max_concurrent_requests),
            (2, 1)
        );
    }

    #[test]
    fn peak_token_seconds_are_counted_from_the_first_request_as_vllm() {
        // Sent 700 ms into the run, ten tokens within 900 ms of it: one second from the first
        // start holds all ten (counted from the run's start they would straddle two).
        let o = request(700, &[50, 150, 250, 350, 450, 550, 650, 750, 850, 900], 0);
        let s = Summary::of(&[&o], 2.0, &[99.0], &Vec::new());
        assert_eq!(s.peak_output_throughput, 10.0);
        assert_eq!(s.max_concurrent_requests, 1);
    }
}
