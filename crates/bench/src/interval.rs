//! The compare verdict's evidence. The two targets get the same prompts in consecutive
//! arrivals, so their samples come in pairs: one prompt, both targets, the same moment of the
//! run. A paired bootstrap (resample prompts with replacement, take the statistic on each side
//! of the resample, keep the delta) gives each judged statistic a confidence interval for the
//! measured-minus-baseline delta that carries the run's own noise. Before any of that, a
//! percentile needs enough samples to be estimated at all: at least five expected beyond it on
//! its thinner side, so P99 needs 500 and P95 100.

use std::collections::BTreeMap;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::measure::Outcome;

/// The intervals' confidence: the central 95 % of the resampled deltas.
pub(crate) const CONFIDENCE_PCT: f64 = 95.0;

/// Samples expected beyond a percentile (on its thinner side) before it counts as estimated.
const TAIL_SAMPLES: f64 = 5.0;

/// The resampled values the bootstrap may touch in all (resamples × samples): the number of
/// resamples shrinks for a metric with very many samples (ITL), never under `MIN_RESAMPLES`.
const WORK: usize = 40_000_000;
const MAX_RESAMPLES: usize = 2_000;
const MIN_RESAMPLES: usize = 200;

/// A judged statistic.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Stat {
    Mean,
    /// 0..=100, numpy's linear interpolation (as the summaries).
    Percentile(f64),
}

impl Stat {
    /// `mean`, `median` or `pNN`.
    #[cfg(test)]
    pub(crate) fn parse(s: &str) -> Option<Stat> {
        match s {
            "mean" => Some(Stat::Mean),
            "median" => Some(Stat::Percentile(50.0)),
            _ => s
                .strip_prefix('p')?
                .parse()
                .ok()
                .filter(|p| (0.0..=100.0).contains(p))
                .map(Stat::Percentile),
        }
    }

    /// The samples the statistic needs before it is estimated: n × min(q, 1 − q) ≥ 5 for a
    /// percentile q (P99: 500, P95: 100, P50: 10); a mean as a median. P0 and P100 (the
    /// extremes) are never estimated.
    pub(crate) fn min_samples(self) -> usize {
        let q = match self {
            Stat::Mean => 0.5,
            Stat::Percentile(p) => p / 100.0,
        };
        let thin = q.min(1.0 - q);
        if thin <= 0.0 {
            return usize::MAX;
        }
        // Rounded before the ceiling so that 5 / 0.01 is 500, not 501.
        ((TAIL_SAMPLES / thin * 1e6).round() / 1e6).ceil() as usize
    }

    /// The statistic of `values` (reordered in place), in O(n).
    fn of(self, values: &mut [f64]) -> f64 {
        match self {
            Stat::Mean => values.iter().sum::<f64>() / values.len() as f64,
            Stat::Percentile(p) => {
                let rank = (p / 100.0).clamp(0.0, 1.0) * (values.len() - 1) as f64;
                let lo = rank.floor() as usize;
                let (_, at, above) = values.select_nth_unstable_by(lo, f64::total_cmp);
                let a = *at;
                if rank > lo as f64 {
                    let b = above.iter().copied().fold(f64::INFINITY, f64::min);
                    a + (b - a) * (rank - lo as f64)
                } else {
                    a
                }
            }
        }
    }
}

/// One metric's samples, paired by prompt: per prompt sent to both targets and answered by
/// both, the baseline's values and the measured target's (one each for TTFT, TPOT and E2EL;
/// one per inter-token gap for ITL).
#[derive(Debug, Clone, Default)]
pub(crate) struct Pairs {
    units: Vec<(Vec<f64>, Vec<f64>)>,
}

impl Pairs {
    /// The pairs of `metric` (`ttft`, `tpot`, `itl`, `e2el`) among the successful requests.
    pub(crate) fn of(outcomes: &[Outcome], metric: &str) -> Pairs {
        let values = |o: &Outcome| metric_values(o, metric);
        Pairs::by(outcomes, values, values)
    }

    /// Pairs of any two per-request figures: `baseline` of the first target's request, `measured`
    /// of the second's. A prompt sent several times (a `--duration` run) pairs its i-th sending
    /// to each target in the order they were sent.
    pub(crate) fn by(
        outcomes: &[Outcome],
        baseline: impl Fn(&Outcome) -> Vec<f64>,
        measured: impl Fn(&Outcome) -> Vec<f64>,
    ) -> Pairs {
        let mut sides: BTreeMap<usize, [Vec<&Outcome>; 2]> = BTreeMap::new();
        for o in outcomes.iter().filter(|o| o.ok() && o.target < 2) {
            sides.entry(o.prompt).or_default()[usize::from(o.target)].push(o);
        }
        let mut units = Vec::new();
        for [mut a, mut b] in sides.into_values() {
            a.sort_by_key(|o| o.sent_at);
            b.sort_by_key(|o| o.sent_at);
            for (x, y) in a.into_iter().zip(b) {
                let (x, y) = (baseline(x), measured(y));
                if !x.is_empty() && !y.is_empty() {
                    units.push((x, y));
                }
            }
        }
        Pairs { units }
    }

    /// Prompts paired.
    pub(crate) fn prompts(&self) -> usize {
        self.units.len()
    }

    /// Samples on the thinner side: prompts, or for ITL the gaps.
    pub(crate) fn samples(&self) -> usize {
        let side = |f: fn(&(Vec<f64>, Vec<f64>)) -> usize| self.units.iter().map(f).sum::<usize>();
        side(|u| u.0.len()).min(side(|u| u.1.len()))
    }

    /// The statistic on each side (baseline, measured) over every pair.
    pub(crate) fn values(&self, stat: Stat) -> Option<(f64, f64)> {
        if self.units.is_empty() {
            return None;
        }
        let mut a: Vec<f64> = self
            .units
            .iter()
            .flat_map(|u| u.0.iter().copied())
            .collect();
        let mut b: Vec<f64> = self
            .units
            .iter()
            .flat_map(|u| u.1.iter().copied())
            .collect();
        Some((stat.of(&mut a), stat.of(&mut b)))
    }

    /// The statistic's delta (measured − baseline) over every pair.
    pub(crate) fn delta(&self, stat: Stat) -> Option<f64> {
        self.values(stat).map(|(a, b)| b - a)
    }

    /// The central 95 % of the paired bootstrap's deltas, for each of `stats`; none with fewer
    /// than two pairs. Seeded from the data's size: the same samples give the same interval.
    pub(crate) fn intervals(&self, stats: &[Stat]) -> Vec<Option<Interval>> {
        let n = self.units.len();
        if n < 2 || stats.is_empty() {
            return vec![None; stats.len()];
        }
        let total: usize = self.units.iter().map(|u| u.0.len() + u.1.len()).sum();
        let resamples = (WORK / total.max(1)).clamp(MIN_RESAMPLES, MAX_RESAMPLES);
        let mut rng = SmallRng::seed_from_u64(0x5eed_0000 ^ total as u64);
        let mut deltas = vec![Vec::with_capacity(resamples); stats.len()];
        let (mut a, mut b) = (Vec::with_capacity(total), Vec::with_capacity(total));
        for _ in 0..resamples {
            a.clear();
            b.clear();
            for _ in 0..n {
                let u = &self.units[rng.random_range(0..n)];
                a.extend_from_slice(&u.0);
                b.extend_from_slice(&u.1);
            }
            for (stat, out) in stats.iter().zip(&mut deltas) {
                out.push(stat.of(&mut b) - stat.of(&mut a));
            }
        }
        let tail = (100.0 - CONFIDENCE_PCT) / 2.0;
        deltas
            .into_iter()
            .map(|mut d| {
                d.sort_by(f64::total_cmp);
                Some(Interval {
                    lo: super::summary::percentile(&d, tail),
                    hi: super::summary::percentile(&d, 100.0 - tail),
                })
            })
            .collect()
    }
}

/// A confidence interval of a delta, in ms.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub(crate) struct Interval {
    pub(crate) lo: f64,
    pub(crate) hi: f64,
}

impl Interval {
    /// The prompts that would narrow this interval (measured over `n` prompts, around `delta`)
    /// until it no longer spans `allowed`: the width shrinks as 1/√n. None when the delta sits
    /// on the limit itself (no sample size decides it).
    pub(crate) fn prompts_to_decide(&self, n: usize, delta: f64, allowed: f64) -> Option<usize> {
        let half = (self.hi - self.lo) / 2.0;
        Self::needed(n, half, (delta - allowed).abs())
    }

    /// The fewest prompts that could decide it: were the true delta at the end of this
    /// interval farthest from `allowed`. The estimate above is as uncertain as the delta
    /// itself: the nearer the true delta lies to the limit, the more prompts it takes, without
    /// bound, so this lower bound is what a range can honestly give.
    pub(crate) fn prompts_to_decide_at_least(&self, n: usize, allowed: f64) -> Option<usize> {
        let half = (self.hi - self.lo) / 2.0;
        let farthest = (self.lo - allowed).abs().max((self.hi - allowed).abs());
        Self::needed(n, half, farthest)
    }

    fn needed(n: usize, half: f64, margin: f64) -> Option<usize> {
        if margin <= half * 1e-3 {
            return None;
        }
        let need = n as f64 * (half / margin).powi(2);
        (need.is_finite() && need < 1e9).then(|| need.ceil() as usize)
    }
}

/// A request's samples of `metric`, in ms (none when it failed or has no such figure).
pub(crate) fn metric_values(o: &Outcome, metric: &str) -> Vec<f64> {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    match metric {
        "ttft" => o.ttft.map(ms).into_iter().collect(),
        "tpot" => o.tpot().map(ms).into_iter().collect(),
        "itl" => o.itls_ms.iter().map(|v| f64::from(*v)).collect(),
        "e2el" => o.e2el.map(ms).into_iter().collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn outcome(target: u8, prompt: usize, ttft_ms: f64) -> Outcome {
        Outcome {
            target,
            prompt,
            sent_at: Duration::from_millis(prompt as u64 * 10 + u64::from(target)),
            ttft: Some(Duration::from_secs_f64(ttft_ms / 1e3)),
            e2el: Some(Duration::from_secs_f64(ttft_ms * 2.0 / 1e3)),
            ..Outcome::default()
        }
    }

    #[test]
    fn samples_a_percentile_needs() {
        assert_eq!(Stat::Percentile(99.0).min_samples(), 500);
        assert_eq!(Stat::Percentile(95.0).min_samples(), 100);
        assert_eq!(Stat::Percentile(90.0).min_samples(), 50);
        assert_eq!(Stat::Percentile(50.0).min_samples(), 10);
        assert_eq!(Stat::Mean.min_samples(), 10);
        assert_eq!(Stat::Percentile(99.9).min_samples(), 5_000);
        assert_eq!(Stat::Percentile(1.0).min_samples(), 500);
        assert_eq!(Stat::Percentile(100.0).min_samples(), usize::MAX);
        assert_eq!(Stat::parse("p99.9"), Some(Stat::Percentile(99.9)));
        assert_eq!(Stat::parse("median"), Some(Stat::Percentile(50.0)));
        assert_eq!(Stat::parse("p101"), None);
    }

    #[test]
    fn the_linear_time_percentile_is_numpys() {
        let v: Vec<f64> = [7.0, 1.0, 3.0, 10.0, 2.0, 8.5].to_vec();
        let mut sorted = v.clone();
        sorted.sort_by(f64::total_cmp);
        for p in [0.0, 10.0, 33.3, 50.0, 95.0, 99.0, 100.0] {
            let mut w = v.clone();
            let got = Stat::Percentile(p).of(&mut w);
            let want = super::super::summary::percentile(&sorted, p);
            assert!((got - want).abs() < 1e-12, "p{p}: {got} vs {want}");
        }
    }

    #[test]
    fn pairs_are_by_prompt_and_skip_what_one_side_lacks() {
        let mut o = vec![
            outcome(0, 0, 10.0),
            outcome(1, 0, 11.0),
            outcome(1, 1, 12.0),
            outcome(0, 2, 10.0),
        ];
        o.push(Outcome {
            error: Some("boom".into()),
            ..outcome(1, 2, 99.0)
        });
        let p = Pairs::of(&o, "ttft");
        assert_eq!(p.prompts(), 1, "prompt 1 has no baseline, prompt 2 failed");
        assert!((p.delta(Stat::Mean).unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(
            p.intervals(&[Stat::Mean]),
            vec![None],
            "one pair: no interval"
        );
    }

    #[test]
    fn a_constant_shift_has_a_tight_interval_around_it() {
        let o: Vec<Outcome> = (0..200)
            .flat_map(|i| {
                let base = 50.0 + (i * 37 % 101) as f64;
                [outcome(0, i, base), outcome(1, i, base + 4.0)]
            })
            .collect();
        let p = Pairs::of(&o, "ttft");
        let stats = [Stat::Mean, Stat::Percentile(50.0), Stat::Percentile(90.0)];
        for (s, i) in stats.iter().zip(p.intervals(&stats)) {
            let i = i.unwrap();
            assert!(i.lo > 2.0 && i.hi < 6.0, "{s:?}: {i:?}");
        }
        // Deterministic: the same samples, the same interval.
        assert_eq!(p.intervals(&stats), p.intervals(&stats));
        let i = Interval { lo: -2.0, hi: 4.0 };
        // Half-width 3 around +1 against a 2 ms limit: nine times the prompts.
        assert_eq!(i.prompts_to_decide(100, 1.0, 2.0), Some(900));
        assert_eq!(i.prompts_to_decide(100, 2.0, 2.0), None);
    }
}
