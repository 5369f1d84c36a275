//! Verdicts on a run: `--sla` objectives and what violates them, and the comparison of two
//! targets (the mean and every measured percentile, judged one-sided against a relative
//! tolerance with an absolute floor), beside the hop cost the gateway recorded.

use std::fmt::Write as _;

use super::interval::{CONFIDENCE_PCT, Interval, Pairs, Stat, metric_values};
use super::measure::Outcome;
use super::summary::{METRICS, Stats, Summary, p_word};

/// One `--sla` objective: `ttft_p99_ms=1500` (at most) or `error_rate=0.01`.
#[derive(Debug, Clone, PartialEq)]
pub struct Objective {
    pub name: String,
    pub limit: f64,
}

/// Parse `ttft_p99_ms=1500,e2el_p95_ms=60000`. A percentile an objective names is measured:
/// it is added to `percentiles` (the `--metric-percentiles`) when missing.
pub fn parse_sla(text: &str, percentiles: &mut Vec<f64>) -> Result<Vec<Objective>, String> {
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
pub fn violations(s: &Summary, sla: &[Objective]) -> Vec<(Objective, f64)> {
    sla.iter()
        .filter_map(|o| {
            let v = s.value(&o.name)?;
            (v > o.limit).then(|| (o.clone(), v))
        })
        .collect()
}

/// The `--sla` table: every objective, its limit, what was measured and whether it was met
/// (the header says whether any was violated).
pub fn render_sla(s: &Summary, sla: &[Objective]) -> String {
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
pub fn significant(v: f64) -> String {
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

/// Tolerances of the compare verdict. One-sided: a line fails only when the measured target is
/// slower than its baseline by more than `pct` % of the baseline's value or `floor_ms`,
/// whichever is larger; being faster is always a pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// For means (`--max-mean-delta-pct`).
    pub mean_pct: f64,
    /// For every percentile (`--max-percentile-delta-pct`, alias `--max-p95-delta-pct`).
    pub percentile_pct: f64,
    /// The absolute floor (`--delta-floor-ms`).
    pub floor_ms: f64,
}

impl Thresholds {
    /// The tolerance in percent for `stat` (`mean` or `pNN`).
    pub fn pct_for(&self, stat: &str) -> f64 {
        if stat == "mean" {
            self.mean_pct
        } else {
            self.percentile_pct
        }
    }

    /// The largest slowdown (ms) allowed a line whose baseline is `baseline_ms`.
    pub fn allowed_ms(&self, pct: f64, baseline_ms: f64) -> f64 {
        (pct / 100.0 * baseline_ms.max(0.0)).max(self.floor_ms)
    }

    /// The rule in words, as the verdict's header prints it, for `names` [baseline, measured].
    pub fn rule(&self, names: [&str; 2]) -> String {
        let [base, measured] = names;
        format!(
            "a line fails only when {measured} is slower than {base} by more than max(+{m} % of {base}'s value, +{f} ms) for a mean, max(+{p} %, +{f} ms) for a percentile; faster always passes",
            m = self.mean_pct,
            p = self.percentile_pct,
            f = self.floor_ms
        )
    }
}

/// How a line of the comparison was judged, from the confidence interval of its delta.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Judgement {
    /// The whole interval is within the allowed slowdown (or faster).
    Within,
    /// The whole interval lies beyond the allowed slowdown: shown slower.
    Over,
    /// The interval spans the allowed slowdown: this many samples cannot tell.
    NotDistinguishable,
    /// Too few samples to estimate the statistic at all (P99 from 60 requests): not judged.
    NotEnoughSamples,
    /// The statistic has no value on one side or both: the line cannot be judged, and the
    /// verdict cannot pass without it.
    NotMeasured,
}

/// One line of the comparison.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Delta {
    pub metric: String,
    pub stat: String,
    pub baseline_ms: Option<f64>,
    pub measured_ms: Option<f64>,
    /// measured − baseline: positive when the second target is slower.
    pub delta_ms: Option<f64>,
    pub delta_pct: Option<f64>,
    /// The 95 % confidence interval of the delta (paired bootstrap over prompts).
    pub ci_ms: Option<Interval>,
    /// Prompts answered by both targets, whose samples were paired.
    pub paired_prompts: usize,
    /// Samples on the thinner side (prompts; ITL: gaps), against `min_samples`.
    pub samples: usize,
    pub min_samples: usize,
    /// Prompts per target that would decide a line that is not distinguishable, were the
    /// true delta the measured one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompts_to_decide: Option<usize>,
    /// The fewest that could (the true delta at the interval's far end); nearer the limit,
    /// more without bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompts_to_decide_at_least: Option<usize>,
    /// The tolerance in percent this line is judged against.
    pub limit_pct: f64,
    /// The largest slowdown allowed, max(limit_pct × baseline, floor).
    pub allowed_ms: Option<f64>,
    pub judgement: Judgement,
    /// Why a line was not measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    pub pass: bool,
}

/// The value of `stat` in `s`, or why there is none.
fn measured(s: &Stats, stat: &str) -> Result<f64, String> {
    if s.count == 0 {
        return Err("no samples".to_owned());
    }
    s.get(stat).ok_or_else(|| {
        format!(
            "{} was not among the measured percentiles",
            stat.to_uppercase()
        )
    })
}

/// Judge the measured target against the baseline at the mean and every one of `percentiles`,
/// for every selected metric: one line each, none skipped. The values are the targets'
/// summaries; the judgement is the interval's, from the requests paired by prompt.
pub fn compare(
    outcomes: &[Outcome],
    baseline: &Summary,
    measured_target: &Summary,
    selected: &[String],
    percentiles: &[f64],
    t: Thresholds,
) -> Vec<Delta> {
    let names: Vec<String> = std::iter::once("mean".to_owned())
        .chain(percentiles.iter().map(|p| format!("p{}", p_word(*p))))
        .collect();
    let stats: Vec<Stat> = std::iter::once(Stat::Mean)
        .chain(percentiles.iter().map(|p| Stat::Percentile(*p)))
        .collect();
    let mut out = Vec::new();
    for (key, _, _) in METRICS {
        if !selected.iter().any(|m| m == key) {
            continue;
        }
        let none = Stats::default();
        let a = baseline.metrics.get(key).unwrap_or(&none);
        let b = measured_target.metrics.get(key).unwrap_or(&none);
        let pairs = Pairs::of(outcomes, key);
        let intervals = pairs.intervals(&stats);
        for ((name, stat), ci) in names.iter().zip(&stats).zip(intervals) {
            let limit_pct = t.pct_for(name);
            let mut line = Delta {
                metric: (*key).to_owned(),
                stat: name.clone(),
                baseline_ms: None,
                measured_ms: None,
                delta_ms: None,
                delta_pct: None,
                ci_ms: None,
                paired_prompts: pairs.prompts(),
                samples: pairs.samples(),
                min_samples: stat.min_samples(),
                prompts_to_decide: None,
                prompts_to_decide_at_least: None,
                limit_pct,
                allowed_ms: None,
                judgement: Judgement::NotMeasured,
                note: None,
                pass: false,
            };
            match (measured(a, name), measured(b, name)) {
                (Ok(x), Ok(y)) => {
                    // Over the prompts both answered, so that the delta and its interval are
                    // of the same samples (the same as the targets' own figures when nothing
                    // failed).
                    let (x, y) = pairs.values(*stat).unwrap_or((x, y));
                    let allowed = t.allowed_ms(limit_pct, x);
                    line.baseline_ms = Some(x);
                    line.measured_ms = Some(y);
                    line.delta_ms = Some(y - x);
                    line.delta_pct = (x.abs() > 1e-12).then(|| (y - x) / x * 100.0);
                    line.allowed_ms = Some(allowed);
                    line.ci_ms = ci;
                    line.judgement = match ci {
                        _ if line.samples < line.min_samples => Judgement::NotEnoughSamples,
                        None => Judgement::NotEnoughSamples,
                        Some(i) if i.lo > allowed => Judgement::Over,
                        Some(i) if i.hi <= allowed => Judgement::Within,
                        Some(i) => {
                            line.prompts_to_decide = i
                                .prompts_to_decide(pairs.prompts(), y - x, allowed)
                                .map(|n| n.max(line.min_samples));
                            line.prompts_to_decide_at_least = i
                                .prompts_to_decide_at_least(pairs.prompts(), allowed)
                                .map(|n| n.max(line.min_samples));
                            Judgement::NotDistinguishable
                        }
                    };
                    line.pass = line.judgement != Judgement::Over;
                }
                (x, y) => {
                    let why = |side: &str, r: &Result<f64, String>| {
                        r.as_ref().err().map(|e| format!("{side}: {e}"))
                    };
                    line.note = Some(
                        [why("first", &x), why("second", &y)]
                            .into_iter()
                            .flatten()
                            .collect::<Vec<_>>()
                            .join("; "),
                    );
                    line.baseline_ms = x.ok();
                    line.measured_ms = y.ok();
                }
            }
            out.push(line);
        }
    }
    out
}

/// What the gateway recorded as its hop cost beside what the client saw it add: to TTFT for a
/// stream, to the whole request (E2EL) for an answer that is not streamed (an embedding).
#[derive(Debug, Clone, PartialEq)]
pub struct HopCheck {
    /// The client-side metric the hop is set beside: `ttft`, or `e2el`.
    pub metric: &'static str,
    /// Median `Server-Timing` hop of the second target's successful requests (none: it sent
    /// no hop figure).
    pub recorded_median_ms: Option<f64>,
    /// Its P99, when there are enough of them (`Stat::min_samples`).
    pub recorded_p99_ms: Option<f64>,
    /// How many of its requests carried one.
    pub recorded_count: usize,
    /// Second target's median of `metric` − first's (none: not measured on a side); in the
    /// result as `client_<metric>_median_delta_ms`.
    pub client_median_delta_ms: Option<f64>,
    /// The 95 % interval of that delta (paired bootstrap over prompts).
    pub client_median_delta_ci_ms: Option<Interval>,
    /// recorded / client-seen (none: either is missing, or the client saw no added time).
    pub ratio: Option<f64>,
}

/// The result's keys name the client-side metric (`client_ttft_median_delta_ms`).
impl serde::Serialize for HopCheck {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = ser.serialize_map(Some(6))?;
        m.serialize_entry("recorded_median_ms", &self.recorded_median_ms)?;
        m.serialize_entry("recorded_p99_ms", &self.recorded_p99_ms)?;
        m.serialize_entry("recorded_count", &self.recorded_count)?;
        m.serialize_entry(
            &format!("client_{}_median_delta_ms", self.metric),
            &self.client_median_delta_ms,
        )?;
        m.serialize_entry(
            &format!("client_{}_median_delta_ci_ms", self.metric),
            &self.client_median_delta_ci_ms,
        )?;
        m.serialize_entry("ratio", &self.ratio)?;
        m.end()
    }
}

impl HopCheck {
    /// Beside the client's TTFT (streams).
    pub fn of(outcomes: &[Outcome], baseline: &Summary, measured_target: &Summary) -> HopCheck {
        Self::beside(outcomes, baseline, measured_target, "ttft")
    }

    /// Beside the client's `metric`: `ttft` for streams, `e2el` for whole answers, whose
    /// first byte is their last.
    pub fn beside(
        outcomes: &[Outcome],
        baseline: &Summary,
        measured_target: &Summary,
        metric: &'static str,
    ) -> HopCheck {
        let median_of = |s: &Summary| {
            s.metrics
                .get(metric)
                .filter(|t| t.count > 0)
                .map(|t| t.median)
        };
        let pairs = Pairs::of(outcomes, metric);
        let median = Stat::Percentile(50.0);
        // Over the prompts both answered, as its interval; the targets' medians without pairs.
        let client = pairs.delta(median).or_else(|| {
            median_of(baseline)
                .zip(median_of(measured_target))
                .map(|(a, b)| b - a)
        });
        let hop = measured_target.hop_ms.as_ref();
        let recorded = hop.map(|h| h.median);
        let p99 = Stat::Percentile(99.0);
        HopCheck {
            metric,
            recorded_median_ms: recorded,
            recorded_p99_ms: hop
                .filter(|h| h.count >= p99.min_samples())
                .and_then(|h| h.get("p99")),
            recorded_count: hop.map_or(0, |h| h.count),
            client_median_delta_ms: client,
            client_median_delta_ci_ms: pairs.intervals(&[median]).remove(0),
            ratio: recorded
                .zip(client.filter(|c| *c > 0.0))
                .map(|(r, c)| r / c),
        }
    }

    /// The summary line: the figure to believe (the hop the gateway stamped per request)
    /// beside what the client saw, with its interval.
    fn render(&self, names: [&str; 2]) -> String {
        let m = self.metric.to_uppercase();
        let client = match (self.client_median_delta_ms, self.client_median_delta_ci_ms) {
            (Some(c), Some(i)) => format!(
                "the client-side {m} median delta ({} − {}) is {c:+.3} ms, {CONFIDENCE_PCT} % interval [{:+.3}, {:+.3}] ms",
                names[1], names[0], i.lo, i.hi
            ),
            (Some(c), None) => format!(
                "the client-side {m} median delta ({} − {}) is {c:+.3} ms (too few paired prompts for an interval)",
                names[1], names[0]
            ),
            _ => format!("the client-side {m} median delta: not measured (no {m} on a side)"),
        };
        match self.recorded_median_ms {
            None => format!(
                "hop cost: {} sent no hop figure (no `hop` in its Server-Timing header or trailer); {client}\n",
                names[1]
            ),
            Some(r) => format!(
                "the figure to believe: the hop {} recorded, stamped per request from the kernel's receive time: median {r:.3} ms{} over {} requests; {client}; recorded / client-seen: {}\n",
                names[1],
                self.recorded_p99_ms
                    .map(|p| format!(", p99 {p:.3} ms"))
                    .unwrap_or_default(),
                self.recorded_count,
                match self.ratio {
                    Some(x) => format!("{x:.2}"),
                    None => format!("n/a (the client saw no added {m})"),
                }
            ),
        }
    }
}

/// The least difference between the two sides' backends that `LikeForLike` calls unequal.
pub const LIKE_FLOOR_MS: f64 = 1.0;

/// Whether the two sides reached comparable backends: the backend's TTFT as the gateway saw
/// it (its `Server-Timing` `upstream`, per request) against the direct TTFT of the same prompt.
/// A gateway adds its hop on top of the backend's time, never inside it, so a difference here
/// is the backends' own: a direct URL that is not the gateway's pool, one server against a
/// pool of several, another model.
/// For an answer that is not streamed (an embedding), the gateway's `upstream` is the backend's
/// time to answer, set beside the direct E2EL.
#[derive(Debug, Clone, PartialEq)]
pub struct LikeForLike {
    /// The direct side's metric: `ttft`, or `e2el` for whole answers.
    pub metric: &'static str,
    /// Prompts with both figures.
    pub paired_prompts: usize,
    /// Median backend time (to first token; to the answer) behind the gateway, as it
    /// recorded it.
    pub gateway_upstream_median_ms: Option<f64>,
    /// In the result as `direct_<metric>_median_ms`.
    pub direct_median_ms: Option<f64>,
    /// Median of the first − median of the second, with its 95 % interval.
    pub delta_ms: Option<f64>,
    pub ci_ms: Option<Interval>,
    /// The difference that counts as significant: the verdict's percentile tolerance of the
    /// direct median, at least `LIKE_FLOOR_MS`.
    pub allowed_ms: Option<f64>,
    /// None: not enough figures to tell (no `upstream` from the gateway, or too few prompts).
    pub comparable: Option<bool>,
}

/// The result's keys name the direct side's metric (`direct_ttft_median_ms`).
impl serde::Serialize for LikeForLike {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = ser.serialize_map(Some(7))?;
        m.serialize_entry("paired_prompts", &self.paired_prompts)?;
        m.serialize_entry(
            "gateway_upstream_median_ms",
            &self.gateway_upstream_median_ms,
        )?;
        m.serialize_entry(
            &format!("direct_{}_median_ms", self.metric),
            &self.direct_median_ms,
        )?;
        m.serialize_entry("delta_ms", &self.delta_ms)?;
        m.serialize_entry("ci_ms", &self.ci_ms)?;
        m.serialize_entry("allowed_ms", &self.allowed_ms)?;
        m.serialize_entry("comparable", &self.comparable)?;
        m.end()
    }
}

impl LikeForLike {
    /// Against the direct TTFT (streams).
    pub fn of(outcomes: &[Outcome], t: Thresholds) -> LikeForLike {
        Self::against(outcomes, t, "ttft")
    }

    /// Against the direct `metric`: `ttft` for streams, `e2el` for whole answers.
    pub fn against(outcomes: &[Outcome], t: Thresholds, metric: &'static str) -> LikeForLike {
        let direct_values = |o: &Outcome| metric_values(o, metric);
        let upstream = |o: &Outcome| -> Vec<f64> { o.upstream_ms.into_iter().collect() };
        let pairs = Pairs::by(outcomes, direct_values, upstream);
        let median = Stat::Percentile(50.0);
        // Both medians over the same prompts: those both sides answered (a side's own
        // requests alone would set unequal samples side by side).
        let medians = pairs.values(median);
        let direct = medians.map(|(d, _)| d);
        // Two measuring points (the client, the gateway) differ by their own HTTP stacks'
        // microseconds: a difference counts from the percentile tolerance or 1 ms up.
        let allowed = direct.map(|d| (t.percentile_pct / 100.0 * d).max(LIKE_FLOOR_MS));
        let ci = if pairs.prompts() >= median.min_samples() {
            pairs.intervals(&[median]).remove(0)
        } else {
            None
        };
        LikeForLike {
            metric,
            paired_prompts: pairs.prompts(),
            gateway_upstream_median_ms: medians.map(|(_, u)| u),
            direct_median_ms: direct,
            delta_ms: pairs.delta(median),
            ci_ms: ci,
            allowed_ms: allowed,
            comparable: ci.zip(allowed).map(|(i, a)| !(i.lo > a || i.hi < -a)),
        }
    }

    fn render(&self, names: [&str; 2]) -> String {
        let [base, gw] = names;
        let to = if self.metric == "ttft" {
            "to first token"
        } else {
            "to answer"
        };
        match (
            self.comparable,
            self.gateway_upstream_median_ms,
            self.direct_median_ms,
            self.ci_ms,
        ) {
            (Some(ok), Some(up), Some(direct), Some(i)) => {
                let figures = format!(
                    "the backends behind {gw} took {up:.3} ms {to} (median of its Server-Timing upstream, {} prompts), {base}'s {direct:.3} ms; paired delta {:+.3} ms, {CONFIDENCE_PCT} % interval [{:+.3}, {:+.3}] ms",
                    self.paired_prompts,
                    self.delta_ms.unwrap_or(up - direct),
                    i.lo,
                    i.hi
                );
                if ok {
                    format!(
                        "like for like, by timing: the backends behind {gw} answered as {base}'s did — {figures}. A timing check cannot see which servers each side reached: {base}= must list every server of {gw}'s pool\n"
                    )
                } else {
                    format!(
                        "WARNING: not like for like — {figures}, beyond ±{:.3} ms: the two sides reached unequal backends, so the deltas above measure the backends, not the hop. Point {base}= at the servers of {gw}'s pool, comma-separated ({base}=http://host1:8000,http://host2:8000), so that both sides spread the same prompts over the same servers\n",
                        self.allowed_ms.unwrap_or_default()
                    )
                }
            }
            (_, None, _, _) => {
                format!("like for like: not checked — {gw} sent no Server-Timing upstream figure\n")
            }
            _ => format!(
                "like for like: not checked — {} paired prompts; the check needs {}\n",
                self.paired_prompts,
                Stat::Percentile(50.0).min_samples()
            ),
        }
    }
}

/// The requests one side of a comparison failed (refused, cut, timed out): how many of how
/// many, and their errors, the most frequent first.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Failures {
    pub target: String,
    pub failed: usize,
    pub sent: usize,
    /// The kinds of error (`HTTP 429 requests_per_minute_exceeded`), the most frequent first,
    /// at most three: (kind, count, one of its messages cut to 200 characters).
    pub errors: Vec<(String, usize, String)>,
}

impl Failures {
    /// One per side that failed any request.
    pub fn of(names: [&str; 2], summaries: &[Summary]) -> Vec<Failures> {
        names
            .iter()
            .zip(summaries)
            .filter(|(_, s)| s.failed > 0)
            .map(|(name, s)| {
                // Messages differ by key and retry time: counted by their kind, the part
                // before the first `: ` (status and code).
                let mut kinds: Vec<(String, usize, String)> = Vec::new();
                for (e, n) in &s.errors {
                    let kind = e.split_once(": ").map_or(e.as_str(), |(k, _)| k);
                    match kinds.iter_mut().find(|k| k.0 == kind) {
                        Some(k) => k.1 += n,
                        None => kinds.push((kind.to_owned(), *n, e.chars().take(200).collect())),
                    }
                }
                let mut errors = kinds;
                errors.sort_by_key(|e| std::cmp::Reverse(e.1));
                errors.truncate(3);
                Failures {
                    target: (*name).to_owned(),
                    failed: s.failed,
                    sent: s.failed + s.completed,
                    errors,
                }
            })
            .collect()
    }

    fn render(&self) -> String {
        let errors: Vec<String> = self
            .errors
            .iter()
            .map(|(kind, n, example)| {
                if example == kind {
                    format!("{n} × {kind}")
                } else {
                    format!("{n} × {kind} (\"{example}\")")
                }
            })
            .collect();
        format!(
            "WARNING: {} failed {} of its {} requests: {}\n",
            self.target,
            self.failed,
            self.sent,
            errors.join("; ")
        )
    }
}

/// The comparison as text: the rule, one line per judged statistic with its interval, the
/// gateway's own figures beside the client's, and the verdict.
#[allow(
    clippy::too_many_arguments,
    reason = "the comparison's parts, each rendered in its place"
)]
pub fn render_compare(
    names: [&str; 2],
    deltas: &[Delta],
    t: Thresholds,
    added_percentiles: &[f64],
    hop: &HopCheck,
    like: &LikeForLike,
    measured_target: &Summary,
    failures: &[Failures],
) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{:=^110}", format!(" {} vs {} ", names[1], names[0]));
    for f in failures {
        o.push_str(&f.render());
    }
    if !failures.is_empty() {
        let _ = writeln!(
            o,
            "WARNING: the lines below judge only the prompts both sides answered; a failed request is never judged, and the two sides did not carry the same load"
        );
    }
    let _ = writeln!(o, "rule: {}", t.rule(names));
    if let Some(d) = deltas.iter().find(|d| d.ci_ms.is_some()) {
        let _ = writeln!(
            o,
            "each line over the {} prompts both answered; interval: {CONFIDENCE_PCT} %, paired bootstrap over prompts",
            d.paired_prompts
        );
    }
    if !added_percentiles.is_empty() {
        let _ = writeln!(
            o,
            "note: {} measured for the verdict (the seed's criterion), though not in --metric-percentiles",
            added_percentiles
                .iter()
                .map(|p| format!("P{}", p_word(*p)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = writeln!(
        o,
        "{:<12} {:>12} {:>12} {:>11} {:>9} {:>21} {:>9}  verdict",
        "metric",
        names[0],
        names[1],
        "delta (ms)",
        "delta",
        format!("{CONFIDENCE_PCT} % interval (ms)"),
        "allowed"
    );
    let num = |v: Option<f64>, w: usize, sign: bool| match v {
        Some(x) if sign => format!("{x:>+w$.3}"),
        Some(x) => format!("{x:>w$.3}"),
        None => format!("{:>w$}", "-"),
    };
    for d in deltas {
        let verdict = match d.judgement {
            Judgement::Within if d.ci_ms.is_some_and(|i| i.hi < 0.0) => "ok (faster)".to_owned(),
            Judgement::Within => "ok".to_owned(),
            Judgement::Over => "SLOWER than allowed".to_owned(),
            Judgement::NotDistinguishable => format!(
                "not distinguishable at this sample size{}",
                match (d.prompts_to_decide_at_least, d.prompts_to_decide) {
                    (Some(least), Some(n)) if n > least => format!(
                        " (≥{least} prompts to decide; ~{n} if the delta is as measured, more the nearer it is to the limit)"
                    ),
                    (Some(least), _) => format!(
                        " (≥{least} prompts to decide; more the nearer the delta is to the limit)"
                    ),
                    (None, _) => " (the delta sits on the limit)".to_owned(),
                }
            ),
            Judgement::NotEnoughSamples => format!(
                "not enough samples (n={} for {}; needs {})",
                d.samples, d.stat, d.min_samples
            ),
            Judgement::NotMeasured => {
                format!("not measured ({})", d.note.as_deref().unwrap_or("no value"))
            }
        };
        let pct = d
            .delta_pct
            .map_or_else(|| format!("{:>9}", "-"), |p| format!("{p:>+8.2}%"));
        let ci = d.ci_ms.map_or_else(
            || format!("{:>21}", "-"),
            |i| format!("{:>21}", format!("[{:+.3}, {:+.3}]", i.lo, i.hi)),
        );
        let _ = writeln!(
            o,
            "{:<12} {} {} {} {} {} {}  {}",
            format!("{} {}", d.metric.to_uppercase(), d.stat),
            num(d.baseline_ms, 12, false),
            num(d.measured_ms, 12, false),
            num(d.delta_ms, 11, true),
            pct,
            ci,
            num(d.allowed_ms, 9, false),
            verdict
        );
    }
    o.push_str(&hop.render(names));
    o.push_str(&like.render(names));
    if let Some(g) = &measured_target.gateway_ms {
        let _ = writeln!(
            o,
            "{}'s own time (its Server-Timing gw): mean {:.3} ms, median {:.3} ms, max {:.3} ms",
            names[1], g.mean, g.median, g.max,
        );
    }
    let _ = writeln!(o, "verdict: {}", verdict_words(names, deltas, failures));
    o
}

/// The verdict line: FAIL when a line is shown slower (its whole interval beyond the allowed
/// delta) or cannot be measured; else PASS, saying what could not be told apart at this sample
/// size and what was not judged.
fn verdict_words(names: [&str; 2], deltas: &[Delta], failures: &[Failures]) -> String {
    // A comparison holds only where both sides answer: a side that failed requests the other
    // answered (a rate limit, a refusal, a cut stream) fails it, whatever its latencies.
    if !failures.is_empty() {
        let said: Vec<String> = failures
            .iter()
            .map(|f| {
                format!(
                    "{} failed {} of {} requests ({})",
                    f.target,
                    f.failed,
                    f.sent,
                    f.errors
                        .iter()
                        .map(|(kind, n, _)| format!("{n} × {kind}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
            .collect();
        return format!(
            "FAIL — {}: a comparison needs every request answered on both sides (lower --num-prompts or --request-rate, or use a key whose limits admit this load)",
            said.join("; ")
        );
    }
    let list = |j: Judgement| {
        deltas
            .iter()
            .filter(|d| d.judgement == j)
            .map(|d| format!("{} {}", d.metric.to_uppercase(), d.stat))
            .collect::<Vec<_>>()
    };
    let over = list(Judgement::Over);
    let unmeasured = list(Judgement::NotMeasured);
    let unclear = list(Judgement::NotDistinguishable);
    let thin = list(Judgement::NotEnoughSamples);
    let within = list(Judgement::Within);
    let mut why = Vec::new();
    if !over.is_empty() {
        why.push(format!(
            "slower than allowed (the whole interval): {}",
            over.join(", ")
        ));
    }
    if !unmeasured.is_empty() {
        why.push(format!(
            "not measured, so not shown within tolerance: {}",
            unmeasured.join(", ")
        ));
    }
    if !why.is_empty() {
        return format!("FAIL — {}", why.join("; "));
    }
    let mut said = if within.is_empty() && unclear.is_empty() {
        format!(
            "PASS — nothing could be judged at this sample size; {} is not shown slower",
            names[1]
        )
    } else if unclear.is_empty() {
        format!(
            "PASS — {} is within the tolerance on every judged line, interval and all",
            names[1]
        )
    } else {
        let unclear_lines = || {
            deltas
                .iter()
                .filter(|d| d.judgement == Judgement::NotDistinguishable)
        };
        let least = unclear_lines()
            .filter_map(|d| d.prompts_to_decide_at_least)
            .max();
        let decide = unclear_lines().filter_map(|d| d.prompts_to_decide).max();
        format!(
            "PASS — {} is not shown slower than allowed; not distinguishable at this sample size: {}{}",
            names[1],
            unclear.join(", "),
            match (least, decide) {
                (Some(l), Some(n)) if n > l => format!(
                    " (at least {l} prompts per target would decide, ~{n} if the deltas are as measured: --num-prompts {n}; an estimate as uncertain as the deltas, and without bound for a delta at its limit)"
                ),
                (Some(l), _) => format!(
                    " (at least {l} prompts per target would decide: --num-prompts {l}; more for a delta nearer its limit)"
                ),
                _ => String::new(),
            }
        )
    };
    if !thin.is_empty() {
        said.push_str(&format!(
            "; not judged (not enough samples): {}",
            thin.join(", ")
        ));
    }
    said
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sla_names_are_checked() {
        let mut measured = vec![99.0];
        let ok = parse_sla(
            "ttft_p99_ms=1500, e2el_p95_ms=60000,itl_p99.9_ms=80,error_rate=0.01",
            &mut measured,
        )
        .unwrap();
        assert_eq!(ok.len(), 4);
        assert_eq!(
            measured,
            [95.0, 99.0, 99.9],
            "what an objective names is measured"
        );
        for (bad, says) in [
            ("ttft_p99=1", "_ms"),
            ("foo_p99_ms=1", "not one of"),
            ("ttft_p900_ms=1", "not a statistic"),
            ("ttft_pfast_ms=1", "not a statistic"),
            ("ttft_p99_ms=fast", "not a number"),
            ("ttft", "name=value"),
        ] {
            let e = parse_sla(bad, &mut vec![95.0, 99.0]).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    /// A compare run: prompt i answered in `base[i]` ms by the first target and `measured[i]` ms
    /// by the second, as TTFT, TPOT and ITL (E2EL twice that); with the two summaries measured
    /// at `percentiles`.
    fn run(
        base: &[f64],
        measured: &[f64],
        percentiles: &[f64],
    ) -> (Vec<Outcome>, Summary, Summary) {
        let one = |target: u8, prompt: usize, v: f64| Outcome {
            target,
            prompt,
            sent_at: std::time::Duration::from_millis(prompt as u64 * 2 + u64::from(target)),
            ttft: Some(std::time::Duration::from_secs_f64(v / 1e3)),
            e2el: Some(std::time::Duration::from_secs_f64(2.0 * v / 1e3)),
            itls_ms: vec![v as f32],
            output_tokens: 2,
            ..Outcome::default()
        };
        let outcomes: Vec<Outcome> = base
            .iter()
            .enumerate()
            .map(|(i, v)| one(0, i, *v))
            .chain(measured.iter().enumerate().map(|(i, v)| one(1, i, *v)))
            .collect();
        let side = |t: u8| {
            let of: Vec<&Outcome> = outcomes.iter().filter(|o| o.target == t).collect();
            Summary::of(&of, 1.0, percentiles, &Vec::new())
        };
        let (a, b) = (side(0), side(1));
        (outcomes, a, b)
    }

    /// `n` latencies (ms) of a noisy server: a 50 ms floor plus an exponential tail of mean
    /// 50 ms, from `seed`.
    fn noisy(n: usize, seed: u64) -> Vec<f64> {
        use rand::{Rng, SeedableRng};
        let mut r = rand::rngs::SmallRng::seed_from_u64(seed);
        (0..n)
            .map(|_| 50.0 - 50.0 * (1.0 - r.random::<f64>()).ln())
            .collect()
    }

    const T: Thresholds = Thresholds {
        mean_pct: 3.0,
        percentile_pct: 5.0,
        floor_ms: 1.0,
    };

    fn line<'a>(d: &'a [Delta], metric: &str, stat: &str) -> &'a Delta {
        d.iter()
            .find(|x| x.metric == metric && x.stat == stat)
            .unwrap_or_else(|| panic!("no {metric} {stat} line in {d:?}"))
    }

    fn judge(
        base: &[f64],
        measured: &[f64],
        p: &[f64],
        sel: &[&str],
        t: Thresholds,
    ) -> (Vec<Delta>, String) {
        let (o, a, b) = run(base, measured, p);
        let sel: Vec<String> = sel.iter().map(|s| (*s).to_owned()).collect();
        let d = compare(&o, &a, &b, &sel, p, t);
        let text = render_compare(
            ["direct", "gateway"],
            &d,
            t,
            &[],
            &HopCheck::of(&o, &a, &b),
            &LikeForLike::of(&o, t),
            &b,
            &[],
        );
        (d, text)
    }

    #[test]
    fn equal_distributions_are_not_distinguishable() {
        // Two independent draws from one noisy server: the old verdict failed such runs on
        // whichever statistic the noise pushed over 3 %.
        let (d, text) = judge(
            &noisy(200, 1),
            &noisy(200, 2),
            &[50.0, 95.0],
            &["ttft", "e2el"],
            T,
        );
        for x in &d {
            assert_eq!(x.judgement, Judgement::NotDistinguishable, "{x:?}");
            assert!(x.pass);
            let i = x.ci_ms.unwrap();
            assert!(
                i.lo < x.allowed_ms.unwrap() && x.allowed_ms.unwrap() < i.hi,
                "{x:?}"
            );
            assert!(x.prompts_to_decide.unwrap() > 200, "{x:?}");
            // The range's low end is below the estimate at the measured delta.
            assert!(
                x.prompts_to_decide_at_least.unwrap() <= x.prompts_to_decide.unwrap(),
                "{x:?}"
            );
        }
        assert!(
            text.contains("not distinguishable at this sample size (≥"),
            "{text}"
        );
        assert!(
            text.contains("verdict: PASS — gateway is not shown slower than allowed; not distinguishable at this sample size: TTFT mean, TTFT p50, TTFT p95, E2EL mean"),
            "{text}"
        );
        assert!(text.contains("prompts per target would decide"), "{text}");
    }

    #[test]
    fn a_real_shift_fails() {
        // The same requests, each 30 ms slower through the second target.
        let base = noisy(200, 3);
        let slow: Vec<f64> = base.iter().map(|v| v + 30.0).collect();
        let (d, text) = judge(&base, &slow, &[50.0, 95.0], &["ttft"], T);
        for x in &d {
            assert_eq!(x.judgement, Judgement::Over, "{x:?}");
            assert!(!x.pass);
            let i = x.ci_ms.unwrap();
            assert!(
                i.lo > x.allowed_ms.unwrap() && i.lo > 25.0 && i.hi < 35.0,
                "{x:?}"
            );
        }
        assert!(
            text.contains("verdict: FAIL — slower than allowed (the whole interval): TTFT mean, TTFT p50, TTFT p95"),
            "{text}"
        );
    }

    #[test]
    fn a_small_sample_does_not_judge_the_tail() {
        // The run: 60 prompts and --metric-percentiles 95,99.
        let base = noisy(60, 4);
        let slow: Vec<f64> = base.iter().map(|v| v + 30.0).collect();
        let (d, text) = judge(&base, &slow, &[95.0, 99.0], &["ttft"], T);
        let p99 = line(&d, "ttft", "p99");
        assert_eq!(p99.judgement, Judgement::NotEnoughSamples);
        assert!(p99.pass, "not judged is not failed");
        assert!(
            text.contains("not enough samples (n=60 for p99; needs 500)"),
            "{text}"
        );
        assert!(
            text.contains("not enough samples (n=60 for p95; needs 100)"),
            "{text}"
        );
        // The mean has enough and is judged: the shift still fails it.
        assert_eq!(line(&d, "ttft", "mean").judgement, Judgement::Over);
        assert!(
            text.contains("verdict: FAIL — slower than allowed (the whole interval): TTFT mean"),
            "{text}"
        );
        // Equal samples: nothing shown slower; the unjudged lines are named.
        let (_, text) = judge(&base, &base, &[95.0, 99.0], &["ttft"], T);
        assert!(
            text.contains("verdict: PASS — gateway is within the tolerance on every judged line, interval and all; not judged (not enough samples): TTFT p95, TTFT p99"),
            "{text}"
        );
        // Five prompts: nothing at all can be judged, and the verdict says so.
        let (_, text) = judge(&base[..5], &slow[..5], &[95.0], &["ttft"], T);
        assert!(
            text.contains("PASS — nothing could be judged at this sample size"),
            "{text}"
        );
    }

    #[test]
    fn a_faster_gateway_passes() {
        let base = noisy(200, 5);
        let fast: Vec<f64> = base.iter().map(|v| v * 0.8).collect();
        let (d, text) = judge(&base, &fast, &[50.0, 95.0], &["ttft", "e2el"], T);
        assert_eq!(d.len(), 2 * 3, "mean, P50 and P95 of both metrics");
        for x in &d {
            assert_eq!(x.judgement, Judgement::Within, "{x:?}");
            assert!(x.ci_ms.unwrap().hi < 0.0);
        }
        assert!(text.contains("ok (faster)"), "{text}");
        assert!(
            text.contains("verdict: PASS — gateway is within the tolerance on every judged line"),
            "{text}"
        );
    }

    #[test]
    fn slower_fails_past_the_larger_of_percent_and_floor() {
        let p = [95.0];
        let sel = ["ttft"];
        // 1000 ms baseline: 3 % = 30 ms is the larger; +29 passes, +31 fails (mean).
        let base = vec![1000.0; 120];
        let shifted = |by: f64| base.iter().map(|v| v + by).collect::<Vec<_>>();
        let (d, _) = judge(&base, &shifted(29.0), &p, &sel, T);
        assert_eq!(line(&d, "ttft", "mean").judgement, Judgement::Within);
        assert_eq!(line(&d, "ttft", "mean").allowed_ms, Some(30.0));
        let (d, _) = judge(&base, &shifted(31.0), &p, &sel, T);
        assert_eq!(line(&d, "ttft", "mean").judgement, Judgement::Over);
        // P95 has its own tolerance: 5 % of 1000 ms.
        assert!(line(&d, "ttft", "p95").pass, "+31 ms is within 50 ms");
        // 2 ms baseline: the 1 ms floor is the larger; +0.9 ms (45 %) passes, +1.1 ms fails.
        let base = vec![2.0; 120];
        let (d, _) = judge(&base, &vec![2.9; 120], &p, &sel, T);
        assert!(d.iter().all(|x| x.judgement == Judgement::Within), "{d:?}");
        let (d, _) = judge(&base, &vec![3.1; 120], &p, &sel, T);
        assert!(d.iter().all(|x| !x.pass), "{d:?}");
        // Without a floor the percentages alone decide.
        let no_floor = Thresholds { floor_ms: 0.0, ..T };
        let (d, text) = judge(&base, &vec![2.5; 120], &p, &sel, no_floor);
        assert_eq!(line(&d, "ttft", "mean").judgement, Judgement::Over);
        assert!(
            text.contains(
                "verdict: FAIL — slower than allowed (the whole interval): TTFT mean, TTFT p95"
            ),
            "{text}"
        );
    }

    #[test]
    fn every_percentile_is_judged_and_an_unmeasured_one_is_named() {
        let p = [50.0, 95.0];
        let base = noisy(150, 6);
        // P50 and P95 are both lines; a statistic the summaries lack is "not measured".
        let (o, a, b) = run(&base, &base, &p);
        let d = compare(&o, &a, &b, &["e2el".into()], &[90.0], T);
        let l = line(&d, "e2el", "p90");
        assert_eq!(l.judgement, Judgement::NotMeasured);
        assert!(!l.pass);
        assert!(
            l.note.as_deref().unwrap().contains("P90 was not among"),
            "{l:?}"
        );
        let d = compare(&o, &a, &b, &["e2el".into()], &p, T);
        assert_eq!(
            d.iter().map(|x| x.stat.as_str()).collect::<Vec<_>>(),
            ["mean", "p50", "p95"]
        );
        // A metric without samples on one side (TPOT of one-token answers): named, not passed.
        let mut one_token = o.clone();
        for x in one_token.iter_mut().filter(|x| x.target == 1) {
            x.output_tokens = 1;
        }
        let of = |t: u8| {
            let v: Vec<&Outcome> = one_token.iter().filter(|o| o.target == t).collect();
            Summary::of(&v, 1.0, &p, &Vec::new())
        };
        let (a, b) = (of(0), of(1));
        let d = compare(&one_token, &a, &b, &["ttft".into(), "tpot".into()], &p, T);
        assert!(line(&d, "ttft", "mean").pass);
        let l = line(&d, "tpot", "p95");
        assert_eq!(l.judgement, Judgement::NotMeasured);
        assert_eq!(l.note.as_deref(), Some("second: no samples"));
        let text = render_compare(
            ["direct", "gateway"],
            &d,
            T,
            &[],
            &HopCheck::of(&one_token, &a, &b),
            &LikeForLike::of(&one_token, T),
            &b,
            &[],
        );
        assert!(text.contains("not measured (second: no samples)"), "{text}");
        assert!(
            text.contains(
                "FAIL — not measured, so not shown within tolerance: TPOT mean, TPOT p50, TPOT p95"
            ),
            "{text}"
        );
    }

    #[test]
    fn unequal_backends_are_named() {
        let base = noisy(120, 8);
        let (mut o, _, _) = run(&base, &base, &[50.0]);
        let t = LikeForLike::of(&o, T);
        assert_eq!(t.comparable, None);
        assert!(
            t.render(["direct", "gateway"])
                .contains("gateway sent no Server-Timing upstream figure")
        );
        // The gateway's backends answer as direct's did (to a few µs): like for like.
        let ttft = |o: &Outcome| o.ttft.unwrap().as_secs_f64() * 1e3;
        for x in o.iter_mut().filter(|x| x.target == 1) {
            x.upstream_ms = Some(ttft(x) - 0.005);
        }
        let t = LikeForLike::of(&o, T);
        assert_eq!(t.comparable, Some(true), "{t:?}");
        assert!(t.render(["direct", "gateway"]).starts_with(
            "like for like, by timing: the backends behind gateway answered as direct's did"
        ));
        // Behind the gateway, a pool twice as fast as the one direct server: warned.
        for x in o.iter_mut().filter(|x| x.target == 1) {
            x.upstream_ms = Some(ttft(x) / 2.0);
        }
        let t = LikeForLike::of(&o, T);
        assert_eq!(t.comparable, Some(false), "{t:?}");
        let text = t.render(["direct", "gateway"]);
        assert!(text.starts_with("WARNING: not like for like"), "{text}");
        assert!(
            text.contains("direct=http://host1:8000,http://host2:8000"),
            "{text}"
        );
        // Too few prompts to tell.
        let (o, _, _) = run(&base[..5], &base[..5], &[50.0]);
        let mut o = o;
        for x in o.iter_mut() {
            x.upstream_ms = Some(1.0);
        }
        assert!(
            LikeForLike::of(&o, T)
                .render(["direct", "gateway"])
                .contains("5 paired prompts; the check needs 10")
        );
    }

    #[test]
    fn the_summary_line_names_the_recorded_hop_beside_the_client_delta() {
        let base: Vec<f64> = noisy(120, 7);
        let gw_v: Vec<f64> = base.iter().map(|v| v + 0.25).collect();
        let (o, a, mut b) = run(&base, &gw_v, &[99.0]);
        let hop = HopCheck::of(&o, &a, &b);
        let d = compare(&o, &a, &b, &["ttft".into()], &[99.0], T);
        // No hop figure: said so, not left out.
        let text = render_compare(
            ["direct", "gateway"],
            &d,
            T,
            &[95.0],
            &hop,
            &LikeForLike::of(&o, T),
            &b,
            &[],
        );
        assert!(text.contains("gateway sent no hop figure"), "{text}");
        assert!(
            text.contains("the client-side TTFT median delta (gateway − direct) is +0.250 ms, 95 % interval [+0.250, +0.250] ms"),
            "{text}"
        );
        assert!(
            text.contains("note: P95 measured for the verdict"),
            "{text}"
        );
        assert!(text.contains("rule: a line fails only when gateway is slower than direct by more than max(+3 % of direct's value, +1 ms) for a mean, max(+5 %, +1 ms) for a percentile; faster always passes"), "{text}");
        b.hop_ms = Some(Stats::of(vec![0.2, 0.21, 0.3], &[99.0]));
        let h = HopCheck::of(&o, &a, &b);
        assert_eq!(h.recorded_median_ms, Some(0.21));
        assert_eq!(h.recorded_p99_ms, None, "three hops do not make a P99");
        assert_eq!(h.recorded_count, 3);
        assert!((h.ratio.unwrap() - 0.84).abs() < 1e-6, "{h:?}");
        let text = render_compare(
            ["direct", "gateway"],
            &d,
            T,
            &[],
            &h,
            &LikeForLike::of(&o, T),
            &b,
            &[],
        );
        assert!(
            text.contains("the figure to believe: the hop gateway recorded, stamped per request from the kernel's receive time: median 0.210 ms over 3 requests; the client-side TTFT median delta (gateway − direct) is +0.250 ms, 95 % interval [+0.250, +0.250] ms; recorded / client-seen: 0.84"),
            "{text}"
        );
        // A faster gateway has no added TTFT to set the hop against.
        let (o, a, mut fast) = run(&gw_v, &base, &[99.0]);
        fast.hop_ms = b.hop_ms.clone();
        let h = HopCheck::of(&o, &a, &fast);
        assert_eq!((h.recorded_median_ms, h.ratio), (Some(0.21), None));
        assert!(
            h.render(["direct", "gateway"])
                .contains("n/a (the client saw no added TTFT)")
        );
    }
}
