//! The hop cost the gateway recorded (its `Server-Timing` `hop`) beside the delta the client
//! saw it add.

use crate::interval::{CONFIDENCE_PCT, Interval, Pairs, Stat};
use crate::measure::Outcome;
use crate::summary::Summary;

/// What the gateway recorded as its hop cost beside what the client saw it add: to TTFT for a
/// stream, to the whole request (E2EL) for an answer that is not streamed (an embedding).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HopCheck {
    /// The client-side metric the hop is set beside: `ttft`, or `e2el`.
    pub(crate) metric: &'static str,
    /// Median `Server-Timing` hop of the second target's successful requests (none: it sent
    /// no hop figure).
    pub(crate) recorded_median_ms: Option<f64>,
    /// Its P99, when there are enough of them (`Stat::min_samples`).
    pub(crate) recorded_p99_ms: Option<f64>,
    /// How many of its requests carried one.
    pub(crate) recorded_count: usize,
    /// Second target's median of `metric` − first's (none: not measured on a side); in the
    /// result as `client_<metric>_median_delta_ms`.
    pub(crate) client_median_delta_ms: Option<f64>,
    /// The 95 % interval of that delta (paired bootstrap over prompts).
    pub(crate) client_median_delta_ci_ms: Option<Interval>,
    /// recorded / client-seen (none: either is missing, or the client saw no added time).
    pub(crate) ratio: Option<f64>,
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
    #[cfg(test)]
    pub(crate) fn of(
        outcomes: &[Outcome],
        baseline: &Summary,
        measured_target: &Summary,
    ) -> HopCheck {
        Self::beside(outcomes, baseline, measured_target, "ttft")
    }

    /// Beside the client's `metric`: `ttft` for streams, `e2el` for whole answers, whose
    /// first byte is their last.
    pub(crate) fn beside(
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
    pub(super) fn render(&self, names: [&str; 2]) -> String {
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
