//! Whether the two sides of a comparison reached comparable backends, by timing: the backend's
//! time as the gateway recorded it against the direct side's.

use super::Thresholds;
use crate::interval::{CONFIDENCE_PCT, Interval, Pairs, Stat, metric_values};
use crate::measure::Outcome;

/// The least difference between the two sides' backends that `LikeForLike` calls unequal.
pub(crate) const LIKE_FLOOR_MS: f64 = 1.0;

/// Whether the two sides reached comparable backends: the backend's TTFT as the gateway saw
/// it (its `Server-Timing` `upstream`, per request) against the direct TTFT of the same prompt.
/// A gateway adds its hop on top of the backend's time, never inside it, so a difference here
/// is the backends' own: a direct URL that is not the gateway's pool, one server against a
/// pool of several, another model.
/// For an answer that is not streamed (an embedding), the gateway's `upstream` is the backend's
/// time to answer, set beside the direct E2EL.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LikeForLike {
    /// The direct side's metric: `ttft`, or `e2el` for whole answers.
    pub(crate) metric: &'static str,
    /// Prompts with both figures.
    pub(crate) paired_prompts: usize,
    /// Median backend time (to first token; to the answer) behind the gateway, as it
    /// recorded it.
    pub(crate) gateway_upstream_median_ms: Option<f64>,
    /// In the result as `direct_<metric>_median_ms`.
    pub(crate) direct_median_ms: Option<f64>,
    /// Median of the first − median of the second, with its 95 % interval.
    pub(crate) delta_ms: Option<f64>,
    pub(crate) ci_ms: Option<Interval>,
    /// The difference that counts as significant: the verdict's percentile tolerance of the
    /// direct median, at least `LIKE_FLOOR_MS`.
    pub(crate) allowed_ms: Option<f64>,
    /// None: not enough figures to tell (no `upstream` from the gateway, or too few prompts).
    pub(crate) comparable: Option<bool>,
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
    #[cfg(test)]
    pub(crate) fn of(outcomes: &[Outcome], t: Thresholds) -> LikeForLike {
        Self::against(outcomes, t, "ttft")
    }

    /// Against the direct `metric`: `ttft` for streams, `e2el` for whole answers.
    pub(crate) fn against(
        outcomes: &[Outcome],
        t: Thresholds,
        metric: &'static str,
    ) -> LikeForLike {
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

    pub(super) fn render(&self, names: [&str; 2]) -> String {
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
