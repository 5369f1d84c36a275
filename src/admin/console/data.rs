//! What the console's figures are made of: the request log over a window (percentiles and
//! series per environment or per key), and the live rates from the in-process metrics.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::Row;

use crate::store::{KeyStore, StoreError};

/// Environments in display order; index 3 is "no key" (refused before a key was known).
pub const ENVS: [&str; 4] = ["stress", "gray", "prod", "none"];

/// The most rows read for one window: a busier window is summarised from its latest rows
/// (and says so).
pub const ROW_LIMIT: i64 = 200_000;

fn env_index(e: Option<&str>) -> usize {
    match e {
        Some("stress") => 0,
        Some("gray") => 1,
        Some("prod") => 2,
        _ => 3,
    }
}

/// One request-log row, as the console reads it (times in milliseconds).
pub struct LogRow {
    pub at: i64,
    pub env: usize,
    pub status: i32,
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub processing_ms: Option<f64>,
    pub hop_ms: Option<f64>,
    pub prompt: i64,
    pub completion: i64,
}

/// Read the window `[from, to)`, newest first, at most `ROW_LIMIT` rows; true when cut there.
pub async fn read_rows(
    store: &KeyStore,
    from: i64,
    to: i64,
    key: Option<&str>,
) -> Result<(Vec<LogRow>, bool), StoreError> {
    let sql = format!(
        "SELECT at, environment, status, error, client_ttft_us, overhead_pre_us, overhead_relay_us, \
         hop_us, prompt_tokens, completion_tokens FROM request_log WHERE at >= $1 AND at < $2 {} \
         ORDER BY at DESC LIMIT {ROW_LIMIT}",
        if key.is_some() { "AND key_id = $3" } else { "" }
    );
    let mut q = sqlx::query(&sql).bind(from).bind(to);
    if let Some(k) = key {
        q = q.bind(k.to_owned());
    }
    let rows = q.fetch_all(store.pool()).await?;
    let ms = |us: Option<i64>| us.map(|u| u as f64 / 1000.0);
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let env: Option<String> = r.try_get("environment")?;
        let pre: Option<i64> = r.try_get("overhead_pre_us")?;
        let relay: Option<i64> = r.try_get("overhead_relay_us")?;
        let processing = match (pre, relay) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        };
        out.push(LogRow {
            at: r.try_get("at")?,
            env: env_index(env.as_deref()),
            status: r.try_get("status")?,
            error: r.try_get("error")?,
            ttft_ms: ms(r.try_get("client_ttft_us")?),
            processing_ms: ms(processing),
            hop_ms: ms(r.try_get("hop_us")?),
            prompt: r.try_get::<Option<i64>, _>("prompt_tokens")?.unwrap_or(0),
            completion: r
                .try_get::<Option<i64>, _>("completion_tokens")?
                .unwrap_or(0),
        });
    }
    let cut = out.len() as i64 >= ROW_LIMIT;
    Ok((out, cut))
}

/// What a group of rows adds up to.
#[derive(Default, Clone)]
pub struct Acc {
    pub requests: u64,
    pub errors: u64,
    pub prompt: i64,
    pub completion: i64,
    pub ttft: Vec<f64>,
    pub processing: Vec<f64>,
    pub hop: Vec<f64>,
    /// Failed requests by cause (the log's `error`, else the status).
    pub causes: BTreeMap<String, u64>,
}

impl Acc {
    fn add(&mut self, r: &LogRow) {
        self.requests += 1;
        if r.status >= 400 || r.error.is_some() {
            self.errors += 1;
            let cause = r
                .error
                .clone()
                .unwrap_or_else(|| format!("status {}", r.status));
            *self.causes.entry(cause).or_default() += 1;
        }
        self.prompt += r.prompt;
        self.completion += r.completion;
        if let Some(v) = r.ttft_ms {
            self.ttft.push(v);
        }
        if let Some(v) = r.processing_ms {
            self.processing.push(v);
        }
        if let Some(v) = r.hop_ms {
            self.hop.push(v);
        }
    }

    /// Sort the samples (once, before reading percentiles).
    fn seal(&mut self) {
        for v in [&mut self.ttft, &mut self.processing, &mut self.hop] {
            v.sort_by(f64::total_cmp);
        }
    }

    pub fn error_rate(&self) -> Option<f64> {
        (self.requests > 0).then(|| self.errors as f64 / self.requests as f64 * 100.0)
    }
}

/// Nearest-rank percentile of sorted samples (the one `fleetgate usage` reads with).
pub use crate::telemetry::usage::nearest_rank as pct;

/// A window cut into equal buckets, per group.
pub struct Series {
    pub from: i64,
    pub to: i64,
    pub buckets: usize,
    /// `[group][bucket]`
    pub by_bucket: Vec<Vec<Acc>>,
    /// `[group]`: the whole window.
    pub totals: Vec<Acc>,
    pub cut: bool,
}

impl Series {
    pub fn new(
        rows: &[LogRow],
        cut: bool,
        from: i64,
        to: i64,
        buckets: usize,
        groups: usize,
        group_of: impl Fn(&LogRow) -> usize,
    ) -> Self {
        let buckets = buckets.max(1);
        let width = ((to - from) / buckets as i64).max(1);
        let mut by_bucket = vec![vec![Acc::default(); buckets]; groups];
        let mut totals = vec![Acc::default(); groups];
        for r in rows {
            let g = group_of(r).min(groups - 1);
            let b = usize::try_from((r.at - from) / width)
                .unwrap_or(0)
                .min(buckets - 1);
            by_bucket[g][b].add(r);
            totals[g].add(r);
        }
        for a in by_bucket.iter_mut().flatten().chain(totals.iter_mut()) {
            a.seal();
        }
        Self {
            from,
            to,
            buckets,
            by_bucket,
            totals,
            cut,
        }
    }

    /// One value per bucket of group `g`.
    pub fn values(&self, g: usize, f: impl Fn(&Acc) -> Option<f64>) -> Vec<Option<f64>> {
        self.by_bucket[g].iter().map(f).collect()
    }

    pub fn bucket_seconds(&self) -> f64 {
        (self.to - self.from) as f64 / self.buckets as f64 / 1000.0
    }
}

/// Requests and errors per environment, read from the in-process counters.
#[derive(Clone, Copy, Default)]
struct Counts {
    requests: [u64; 4],
    errors: [u64; 4],
}

/// The live figures per environment.
pub struct LiveFigures {
    /// Requests per second and error rate (%) since the oldest sample kept (`None` until a
    /// second sample exists).
    pub rate: [Option<f64>; 4],
    pub error_rate: [Option<f64>; 4],
    /// Over how many seconds the rates were taken.
    pub over_seconds: f64,
    pub requests_total: [u64; 4],
    /// Queued requests per model.
    pub queue: Vec<(String, i64)>,
}

/// Samples of the counters, so each refresh can show a rate.
#[derive(Default)]
pub struct Live {
    samples: Mutex<VecDeque<(Instant, Counts)>>,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").finish_non_exhaustive()
    }
}

/// Rates are taken over about this long (or since the first sample).
const RATE_WINDOW: Duration = Duration::from_secs(30);

impl Live {
    pub fn read(&self, registry: &prometheus::Registry) -> LiveFigures {
        let mut now = Counts::default();
        let mut queue = Vec::new();
        for fam in registry.gather() {
            match fam.name() {
                "fleetgate_requests_total" => {
                    for m in fam.get_metric() {
                        let mut env = 3;
                        let mut failed = false;
                        for l in m.get_label() {
                            match l.name() {
                                "environment" => env = env_index(Some(l.value())),
                                "status_class" => failed = matches!(l.value(), "4xx" | "5xx"),
                                _ => {}
                            }
                        }
                        let v = m.get_counter().get_value() as u64;
                        now.requests[env] += v;
                        if failed {
                            now.errors[env] += v;
                        }
                    }
                }
                "fleetgate_queue_depth" => {
                    for m in fam.get_metric() {
                        let model = m
                            .get_label()
                            .iter()
                            .find(|l| l.name() == "model")
                            .map(|l| l.value().to_owned())
                            .unwrap_or_default();
                        queue.push((model, m.get_gauge().get_value() as i64));
                    }
                }
                _ => {}
            }
        }
        let t = Instant::now();
        let mut samples = self
            .samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Keep one sample older than the window as the base.
        while samples.len() >= 2 && t.duration_since(samples[1].0) >= RATE_WINDOW {
            samples.pop_front();
        }
        let base = samples.front().copied();
        if samples
            .back()
            .is_none_or(|(at, _)| t.duration_since(*at) >= Duration::from_secs(1))
        {
            samples.push_back((t, now));
        }
        drop(samples);
        let mut rate = [None; 4];
        let mut error_rate = [None; 4];
        let mut over = 0.0;
        if let Some((at, old)) = base {
            let secs = t.duration_since(at).as_secs_f64();
            if secs >= 0.5 {
                over = secs;
                for e in 0..4 {
                    let n = now.requests[e].saturating_sub(old.requests[e]);
                    let f = now.errors[e].saturating_sub(old.errors[e]);
                    rate[e] = Some(n as f64 / secs);
                    error_rate[e] = (n > 0).then(|| f as f64 / n as f64 * 100.0);
                }
            }
        }
        LiveFigures {
            rate,
            error_rate,
            over_seconds: over,
            requests_total: now.requests,
            queue,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(at: i64, env: usize, status: i32, ttft: f64) -> LogRow {
        LogRow {
            at,
            env,
            status,
            error: (status >= 400).then(|| "backend_timeout".to_owned()),
            ttft_ms: Some(ttft),
            processing_ms: Some(0.1),
            hop_ms: None,
            prompt: 3,
            completion: 5,
        }
    }

    #[test]
    fn buckets_and_percentiles() {
        let rows: Vec<_> = (0..100)
            .map(|i| row(i * 10, 2, if i % 10 == 0 { 504 } else { 200 }, i as f64))
            .collect();
        let s = Series::new(&rows, false, 0, 1000, 10, 4, |r| r.env);
        assert_eq!(s.totals[2].requests, 100);
        assert_eq!(s.totals[2].errors, 10);
        assert_eq!(s.totals[2].causes["backend_timeout"], 10);
        assert_eq!(s.totals[2].completion, 500);
        assert_eq!(pct(&s.totals[2].ttft, 50.0), Some(49.0));
        assert_eq!(pct(&s.totals[2].ttft, 99.0), Some(98.0));
        assert_eq!(s.by_bucket[2][0].requests, 10);
        assert_eq!(s.by_bucket[2][9].requests, 10);
        assert_eq!(s.values(0, |a| a.error_rate()), vec![None; 10]);
        assert_eq!(s.by_bucket[2][3].error_rate(), Some(10.0));
        assert_eq!(pct(&[], 50.0), None);
    }
}
