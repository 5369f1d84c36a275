//! The comparison as text: its rule, one line per judged statistic, the gateway's own figures
//! and the verdict line.

use std::fmt::Write as _;

use super::Thresholds;
use super::delta::{Delta, Judgement};
use super::failures::Failures;
use super::hop::HopCheck;
use super::like_for_like::LikeForLike;
use crate::interval::CONFIDENCE_PCT;
use crate::summary::{Summary, p_word};

/// The comparison as text: the rule, one line per judged statistic with its interval, the
/// gateway's own figures beside the client's, and the verdict.
#[allow(
    clippy::too_many_arguments,
    reason = "the comparison's parts, each rendered in its place"
)]
pub(crate) fn render_compare(
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
                        " ({} prompts run; ≥{least} to decide, ~{n} if the delta is as measured, more the nearer it is to the limit)",
                        d.paired_prompts
                    ),
                    (Some(least), _) => format!(
                        " ({} prompts run; ≥{least} to decide, more the nearer the delta is to the limit)",
                        d.paired_prompts
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
