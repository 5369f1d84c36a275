//! What the console's figures are made of: the request log over a window (percentiles and
//! series per environment or per key), and the live rates from the in-process metrics.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::Row;

use crate::store::{KeyStore, StoreError};

/// Environments in display order; index 3 is "no key" (refused before a key was known).
pub(crate) const ENVS: [&str; 4] = ["stress", "gray", "prod", "none"];

/// The most rows read for one window: a busier window is summarised from its latest rows
/// (and says so).
pub(crate) const ROW_LIMIT: i64 = 200_000;

fn env_index(e: Option<&str>) -> usize {
    match e {
        Some("stress") => 0,
        Some("gray") => 1,
        Some("prod") => 2,
        _ => 3,
    }
}

/// One request as the Requests page shows it, from its request-log row.
pub(crate) struct RequestRow {
    pub(crate) at: i64,
    pub(crate) request_id: String,
    pub(crate) endpoint: Option<String>,
    pub(crate) key_id: Option<String>,
    pub(crate) model: Option<String>,
    pub(crate) backend: Option<String>,
    pub(crate) status: i32,
    pub(crate) error: Option<String>,
    pub(crate) ttft_ms: Option<f64>,
    pub(crate) hop_us: Option<i64>,
    pub(crate) trace_id: Option<String>,
}

/// How far back the Requests page looks (the `at` index bounds the search).
pub(crate) const REQUESTS_WINDOW_MS: i64 = 24 * 3600 * 1000;

/// Most rows the Requests page lists.
pub(crate) const REQUESTS_SHOWN: i64 = 50;

/// The requests of the last `REQUESTS_WINDOW_MS` before `now`, newest first: all of them, or
/// those whose request id or W3C trace id is `find`.
pub(crate) async fn find_requests(
    store: &KeyStore,
    now: i64,
    find: Option<&str>,
) -> Result<Vec<RequestRow>, StoreError> {
    let sql = format!(
        "SELECT at, request_id, endpoint, key_id, model, backend, status, error, client_ttft_us, \
         hop_us, trace_id FROM request_log WHERE at >= $1 {} ORDER BY at DESC LIMIT {REQUESTS_SHOWN}",
        if find.is_some() {
            "AND (request_id = $2 OR trace_id = $2)"
        } else {
            ""
        }
    );
    let mut q = sqlx::query(&sql).bind(now - REQUESTS_WINDOW_MS);
    if let Some(f) = find {
        q = q.bind(f.to_owned());
    }
    let rows = q.fetch_all(store.pool()).await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        out.push(RequestRow {
            at: r.try_get("at")?,
            request_id: r.try_get("request_id")?,
            endpoint: r.try_get("endpoint")?,
            key_id: r.try_get("key_id")?,
            model: r.try_get("model")?,
            backend: r.try_get("backend")?,
            status: r.try_get("status")?,
            error: r.try_get("error")?,
            ttft_ms: r
                .try_get::<Option<i64>, _>("client_ttft_us")?
                .map(|us| us as f64 / 1000.0),
            hop_us: r.try_get("hop_us")?,
            trace_id: r.try_get("trace_id")?,
        });
    }
    Ok(out)
}

/// One request-log row, as the console reads it (times in milliseconds).
pub(crate) struct LogRow {
    pub(crate) at: i64,
    pub(crate) env: usize,
    pub(crate) status: i32,
    pub(crate) error: Option<String>,
    pub(crate) ttft_ms: Option<f64>,
    pub(crate) processing_ms: Option<f64>,
    pub(crate) hop_ms: Option<f64>,
    pub(crate) prompt: i64,
    pub(crate) completion: i64,
}

/// Read the window `[from, to)`, newest first, at most `ROW_LIMIT` rows; true when cut there.
pub(crate) async fn read_rows(
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
pub(crate) struct Acc {
    pub(crate) requests: u64,
    pub(crate) errors: u64,
    pub(crate) prompt: i64,
    pub(crate) completion: i64,
    pub(crate) ttft: Vec<f64>,
    pub(crate) processing: Vec<f64>,
    pub(crate) hop: Vec<f64>,
    /// Failed requests by cause (the log's `error`, else the status).
    pub(crate) causes: BTreeMap<String, u64>,
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

    pub(crate) fn error_rate(&self) -> Option<f64> {
        (self.requests > 0).then(|| self.errors as f64 / self.requests as f64 * 100.0)
    }
}

/// Nearest-rank percentile of sorted samples (the one `fleetgate usage` reads with).
pub(crate) use crate::telemetry::usage::nearest_rank as pct;

/// The charts' interval sizes, smallest first. Each divides a day, so the buckets of a window
/// read as round intervals ("per 30 s", "per 5 min", "per 3 h").
const BUCKET_SIZES_MS: [i64; 15] = [
    10_000, 15_000, 30_000, 60_000, 120_000, 300_000, 600_000, 900_000, 1_800_000, 3_600_000,
    7_200_000, 10_800_000, 21_600_000, 43_200_000, 86_400_000,
];

/// The shortest window drawn: a few seconds of traffic still show as a line, not as a dot.
pub(crate) const MIN_SPAN_MS: i64 = 5 * 60_000;

/// The most buckets in a window: the bucket size is the smallest that keeps under it, so a
/// window has between 24 and 60 points (consecutive sizes differ by at most 2.5×).
pub(crate) const MAX_BUCKETS: i64 = 60;

/// A span of the wall clock, `[from, to)` in epoch milliseconds, cut into equal buckets that
/// end at `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub(crate) from: i64,
    pub(crate) to: i64,
    pub(crate) bucket_ms: i64,
}

impl Window {
    /// The window that follows the data: from the bucket holding `earliest` (the oldest
    /// request read) to `to`, at least `MIN_SPAN_MS` long, in the smallest bucket size that
    /// gives at most `MAX_BUCKETS` buckets. A window that reaches back a whole hour or day
    /// only when the traffic does.
    pub(crate) fn fitted(earliest: Option<i64>, to: i64) -> Self {
        let span = earliest
            .map_or(0, |e| to.saturating_sub(e))
            .max(MIN_SPAN_MS);
        let count = |b: i64| (span + b - 1) / b;
        let bucket_ms = BUCKET_SIZES_MS
            .into_iter()
            .find(|&b| count(b) <= MAX_BUCKETS)
            .unwrap_or(86_400_000);
        Self {
            from: to - count(bucket_ms) * bucket_ms,
            to,
            bucket_ms,
        }
    }

    pub(crate) fn buckets(&self) -> usize {
        usize::try_from((self.to - self.from) / self.bucket_ms.max(1))
            .unwrap_or(0)
            .max(1)
    }

    /// The bucket holding `at`, if the window does.
    pub(crate) fn bucket_of(&self, at: i64) -> Option<usize> {
        if at < self.from || at >= self.to {
            return None;
        }
        usize::try_from((at - self.from) / self.bucket_ms.max(1)).ok()
    }

    /// The middle of bucket `i`, where its point is drawn.
    pub(crate) fn bucket_middle(&self, i: usize) -> f64 {
        self.from as f64 + (i as f64 + 0.5) * self.bucket_ms as f64
    }
}

/// A window's buckets, per group.
pub(crate) struct Series {
    pub(crate) window: Window,
    /// `[group][bucket]`
    pub(crate) by_bucket: Vec<Vec<Acc>>,
    /// `[group]`: the whole window.
    pub(crate) totals: Vec<Acc>,
    pub(crate) cut: bool,
}

impl Series {
    pub(crate) fn new(
        rows: &[LogRow],
        cut: bool,
        window: Window,
        groups: usize,
        group_of: impl Fn(&LogRow) -> usize,
    ) -> Self {
        let buckets = window.buckets();
        let mut by_bucket = vec![vec![Acc::default(); buckets]; groups];
        let mut totals = vec![Acc::default(); groups];
        for r in rows {
            let Some(b) = window.bucket_of(r.at) else {
                continue;
            };
            let g = group_of(r).min(groups - 1);
            by_bucket[g][b.min(buckets - 1)].add(r);
            totals[g].add(r);
        }
        for a in by_bucket.iter_mut().flatten().chain(totals.iter_mut()) {
            a.seal();
        }
        Self {
            window,
            by_bucket,
            totals,
            cut,
        }
    }

    /// One value per bucket of group `g`.
    pub(crate) fn values(&self, g: usize, f: impl Fn(&Acc) -> Option<f64>) -> Vec<Option<f64>> {
        self.by_bucket[g].iter().map(f).collect()
    }

    /// `n` requests in one bucket, as requests per minute.
    pub(crate) fn per_minute(&self, n: u64) -> f64 {
        n as f64 * 60_000.0 / self.window.bucket_ms as f64
    }
}

/// When the key's last request in the log was (`None`: it has none).
pub(crate) async fn last_request_at(
    store: &KeyStore,
    key: &str,
) -> Result<Option<i64>, StoreError> {
    let row = sqlx::query("SELECT MAX(at) AS last FROM request_log WHERE key_id = $1")
        .bind(key.to_owned())
        .fetch_one(store.pool())
        .await?;
    Ok(row.try_get::<Option<i64>, _>("last")?)
}

/// Requests and errors per environment, read from the in-process counters.
#[derive(Clone, Copy, Default)]
struct Counts {
    requests: [u64; 4],
    errors: [u64; 4],
}

/// The live figures per environment.
pub struct LiveFigures {
    /// Requests per second and error rate (%) since the base reading (`rate_base`; `None`
    /// until there is one).
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
pub(crate) struct Live {
    samples: Mutex<VecDeque<(Instant, Counts)>>,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").finish_non_exhaustive()
    }
}

/// "Now" is this long: rates are taken against the newest reading of the counters at least
/// this old (readings are taken when the overview asks, every 5 seconds while it is open, so
/// the span is 30 to 35 seconds; shorter only in the first 30 seconds of looking).
pub const RATE_WINDOW: Duration = Duration::from_secs(30);

/// A reading older than this is no base: nobody looked in between, and a rate averaged over
/// an hour of nobody looking is no "now".
const STALE_AFTER: Duration = Duration::from_secs(60);

/// Drop the readings no rate at `t` needs, and return the base to take rates against: the
/// newest reading at least `RATE_WINDOW` old, else the oldest one (younger), never one older
/// than `STALE_AFTER`.
fn rate_base(samples: &mut VecDeque<(Instant, Counts)>, t: Instant) -> Option<(Instant, Counts)> {
    while samples.len() >= 2 && t.duration_since(samples[1].0) >= RATE_WINDOW {
        samples.pop_front();
    }
    if samples
        .front()
        .is_some_and(|(at, _)| t.duration_since(*at) > STALE_AFTER)
    {
        samples.pop_front();
    }
    samples.front().copied()
}

impl Live {
    pub(crate) fn read(&self, registry: &prometheus::Registry) -> LiveFigures {
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
        let base = rate_base(&mut samples, t);
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
        let w = Window {
            from: 0,
            to: 1000,
            bucket_ms: 100,
        };
        let s = Series::new(&rows, false, w, 4, |r| r.env);
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

    const MIN: i64 = 60_000;

    #[test]
    fn the_window_follows_the_data() {
        let now = 1_800_000_000_000;
        // Six minutes of traffic in the last hour: six minutes drawn (not an hour with the
        // traffic squashed against its right edge), in 10-second buckets.
        let w = Window::fitted(Some(now - 6 * MIN), now);
        assert_eq!((w.to - w.from, w.bucket_ms), (6 * MIN, 10_000));
        assert_eq!(w.buckets(), 36);
        assert_eq!(w.bucket_of(now - 6 * MIN), Some(0));
        assert_eq!(w.bucket_of(now - 1), Some(35));
        assert_eq!(w.bucket_of(now), None);
        // A few seconds, or nothing: the 5-minute minimum.
        assert_eq!(
            Window::fitted(Some(now - 3_000), now).to - Window::fitted(Some(now - 3_000), now).from,
            5 * MIN
        );
        assert_eq!(Window::fitted(None, now).bucket_ms, 10_000);
        // 35 minutes: per minute. A whole hour: per minute, 60 points.
        let w = Window::fitted(Some(now - 35 * MIN + 20_000), now);
        assert_eq!((w.to - w.from, w.bucket_ms), (35 * MIN, MIN));
        let w = Window::fitted(Some(now - 60 * MIN), now);
        assert_eq!((w.buckets(), w.bucket_ms), (60, MIN));
        // A day, a week: between 24 and 60 points in round intervals.
        for span in [
            61 * MIN,
            24 * 60 * MIN,
            7 * 24 * 60 * MIN,
            13 * MIN,
            2 * 60 * MIN,
        ] {
            let w = Window::fitted(Some(now - span), now);
            assert!((24..=60).contains(&w.buckets()), "{span}: {w:?}");
            assert!(
                w.from <= now - span && w.from > now - span - w.bucket_ms,
                "{w:?}"
            );
            assert_eq!(86_400_000 % w.bucket_ms, 0);
        }
    }

    #[test]
    fn rows_outside_the_window_are_not_counted() {
        let w = Window::fitted(Some(10 * MIN), 20 * MIN);
        let rows = [row(9 * MIN, 2, 200, 1.0), row(15 * MIN, 2, 200, 1.0)];
        let s = Series::new(&rows, false, w, 4, |r| r.env);
        assert_eq!(s.totals[2].requests, 1);
        assert_eq!(s.per_minute(3), 18.0, "3 requests in 10 s");
    }

    fn counts(n: u64) -> Counts {
        Counts {
            requests: [n; 4],
            errors: [0; 4],
        }
    }

    #[test]
    fn live_rates_are_over_the_last_30_seconds_never_a_stale_reading() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // Readings every 5 seconds: the base is the newest at least 30 seconds old.
        let mut samples: VecDeque<_> = (0..10).map(|i| (at(i * 5), counts(i))).collect();
        let (base, _) = rate_base(&mut samples, at(47)).unwrap_or_else(|| panic!("a base"));
        assert_eq!(at(47).duration_since(base), Duration::from_secs(32));
        // Nobody looked for an hour: that reading is no base for "now"; the latest one is.
        let mut samples: VecDeque<_> = [(at(0), counts(0)), (at(3600), counts(7))].into();
        let (base, _) = rate_base(&mut samples, at(3603)).unwrap_or_else(|| panic!("a base"));
        assert_eq!(base, at(3600));
        let mut samples: VecDeque<_> = [(at(0), counts(0))].into();
        assert!(rate_base(&mut samples, at(3600)).is_none());
        assert!(samples.is_empty());
    }
}

/// One pool's prefix cache over a window of the request log: answers whose engine reported
/// its cached prompt tokens, their prompt tokens, what the engines served from cache, what the
/// routing predicted, and the sum of each answer's |predicted - served|.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CacheFigures {
    pub(crate) model: String,
    pub(crate) answers: i64,
    pub(crate) prompt: i64,
    pub(crate) served: i64,
    pub(crate) predicted: i64,
    pub(crate) error: i64,
}

impl CacheFigures {
    fn share(&self, n: i64) -> Option<f64> {
        (self.prompt > 0).then(|| 100.0 * n as f64 / self.prompt as f64)
    }
    /// The fleet's hit rate: prompt tokens the engines served from cache, in percent.
    pub(crate) fn served_share(&self) -> Option<f64> {
        self.share(self.served)
    }
    /// The routing's belief, in percent of the same prompt tokens.
    pub(crate) fn predicted_share(&self) -> Option<f64> {
        self.share(self.predicted)
    }
    /// The prediction's error, answer by answer: the mean of |predicted - served| in percent
    /// of the prompt tokens (0 only when every answer was predicted exactly).
    pub(crate) fn error_share(&self) -> Option<f64> {
        self.share(self.error)
    }
}

/// The prefix-cache figures of each pool since `from` (rows whose engine reported its cached
/// prompt tokens only: a backend without `--enable-prompt-tokens-details` has none).
pub(crate) async fn cache_by_pool(
    store: &KeyStore,
    from: i64,
) -> Result<Vec<CacheFigures>, StoreError> {
    let rows = sqlx::query(
        "SELECT model, COUNT(*) AS answers, \
         CAST(SUM(prompt_tokens) AS BIGINT) AS prompt, \
         CAST(SUM(CASE WHEN cached_tokens < prompt_tokens THEN cached_tokens ELSE prompt_tokens END) AS BIGINT) AS served, \
         CAST(SUM(CASE WHEN COALESCE(predicted_cached_tokens, 0) < prompt_tokens \
             THEN COALESCE(predicted_cached_tokens, 0) ELSE prompt_tokens END) AS BIGINT) AS predicted, \
         CAST(SUM(ABS(COALESCE(predicted_cached_tokens, 0) - cached_tokens)) AS BIGINT) AS error \
         FROM request_log WHERE at >= $1 AND cached_tokens IS NOT NULL AND prompt_tokens IS NOT NULL \
         AND model IS NOT NULL GROUP BY model ORDER BY model",
    )
    .bind(from)
    .fetch_all(store.pool())
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        out.push(CacheFigures {
            model: r.try_get("model")?,
            answers: r.try_get("answers")?,
            prompt: r.try_get::<Option<i64>, _>("prompt")?.unwrap_or(0),
            served: r.try_get::<Option<i64>, _>("served")?.unwrap_or(0),
            predicted: r.try_get::<Option<i64>, _>("predicted")?.unwrap_or(0),
            error: r.try_get::<Option<i64>, _>("error")?.unwrap_or(0),
        });
    }
    Ok(out)
}
