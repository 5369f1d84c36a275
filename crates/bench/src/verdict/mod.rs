//! Verdicts on a run: `--sla` objectives and what violates them, and the comparison of two
//! targets (the mean and every measured percentile, judged one-sided against a relative
//! tolerance with an absolute floor), beside the hop cost the gateway recorded.
//!
//! This module holds the compare verdict's `Thresholds`, which its parts share; `sla` holds
//! the objectives, `delta` the judged lines, `hop` and `like_for_like` the gateway's own
//! figures set beside the client's, `failures` the requests a side failed, and `render` the
//! comparison as text with its verdict line.

pub(crate) mod delta;
pub(crate) mod failures;
pub(crate) mod hop;
pub(crate) mod like_for_like;
pub(crate) mod render;
pub(crate) mod sla;

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
    pub(crate) fn pct_for(&self, stat: &str) -> f64 {
        if stat == "mean" {
            self.mean_pct
        } else {
            self.percentile_pct
        }
    }

    /// The largest slowdown (ms) allowed a line whose baseline is `baseline_ms`.
    pub(crate) fn allowed_ms(&self, pct: f64, baseline_ms: f64) -> f64 {
        (pct / 100.0 * baseline_ms.max(0.0)).max(self.floor_ms)
    }

    /// The rule in words, as the verdict's header prints it, for `names` [baseline, measured].
    pub(crate) fn rule(&self, names: [&str; 2]) -> String {
        let [base, measured] = names;
        format!(
            "a line fails only when {measured} is slower than {base} by more than max(+{m} % of {base}'s value, +{f} ms) for a mean, max(+{p} %, +{f} ms) for a percentile; faster always passes",
            m = self.mean_pct,
            p = self.percentile_pct,
            f = self.floor_ms
        )
    }
}

#[cfg(test)]
mod tests;
