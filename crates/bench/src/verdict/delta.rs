//! The lines of the compare verdict: for every selected metric, the mean and each measured
//! percentile of the two targets, their delta with its confidence interval, and how it was
//! judged against the tolerance.

use super::Thresholds;
use crate::interval::{Interval, Pairs, Stat};
use crate::measure::Outcome;
use crate::summary::{METRICS, Stats, Summary, p_word};

/// How a line of the comparison was judged, from the confidence interval of its delta.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Judgement {
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
pub(crate) struct Delta {
    pub(crate) metric: String,
    pub(crate) stat: String,
    pub(crate) baseline_ms: Option<f64>,
    pub(crate) measured_ms: Option<f64>,
    /// measured − baseline: positive when the second target is slower.
    pub(crate) delta_ms: Option<f64>,
    pub(crate) delta_pct: Option<f64>,
    /// The 95 % confidence interval of the delta (paired bootstrap over prompts).
    pub(crate) ci_ms: Option<Interval>,
    /// Prompts answered by both targets, whose samples were paired.
    pub(crate) paired_prompts: usize,
    /// Samples on the thinner side (prompts; ITL: gaps), against `min_samples`.
    pub(crate) samples: usize,
    pub(crate) min_samples: usize,
    /// Prompts per target that would decide a line that is not distinguishable, were the
    /// true delta the measured one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) prompts_to_decide: Option<usize>,
    /// The fewest that could (the true delta at the interval's far end); nearer the limit,
    /// more without bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) prompts_to_decide_at_least: Option<usize>,
    /// The tolerance in percent this line is judged against.
    pub(crate) limit_pct: f64,
    /// The largest slowdown allowed, max(limit_pct × baseline, floor).
    pub(crate) allowed_ms: Option<f64>,
    pub(crate) judgement: Judgement,
    /// Why a line was not measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) note: Option<String>,
    pub(crate) pass: bool,
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
pub(crate) fn compare(
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
                            // Undecided at this many prompts: deciding takes more than were
                            // run, whatever the statistic's own minimum.
                            let more = |n: usize| n.max(line.min_samples).max(pairs.prompts() + 1);
                            line.prompts_to_decide = i
                                .prompts_to_decide(pairs.prompts(), y - x, allowed)
                                .map(more);
                            line.prompts_to_decide_at_least = i
                                .prompts_to_decide_at_least(pairs.prompts(), allowed)
                                .map(more);
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
