//! The latency figures the console shows (TTFT, the gateway's processing, the hop), each in its
//! own unit, in tables and in charts.

use maud::Markup;

use super::number;
use crate::admin::console::chart::{Line, line_chart};
use crate::admin::console::data::{Acc, Series, pct};

/// The unit a latency figure is shown in, the same in its table and its chart.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Unit {
    Ms,
    Us,
}

impl Unit {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Unit::Ms => "ms",
            Unit::Us => "µs",
        }
    }

    /// A value in milliseconds (as the console reads the log), in this unit.
    pub(crate) fn of_ms(self, v: f64) -> f64 {
        match self {
            Unit::Ms => v,
            Unit::Us => v * 1000.0,
        }
    }
}

/// A latency figure: its name, its unit and its samples. TTFT is a backend's time (tens to
/// thousands of milliseconds); processing and hop are the gateway's own (tens to hundreds of
/// microseconds): each is read in the unit its values are written in, in tables and charts.
#[derive(Clone, Copy)]
pub(crate) struct Latency {
    pub(crate) name: &'static str,
    pub(crate) unit: Unit,
    pub(crate) pick: fn(&Acc) -> &[f64],
}

fn ttft(a: &Acc) -> &[f64] {
    &a.ttft
}

fn processing(a: &Acc) -> &[f64] {
    &a.processing
}

fn hop(a: &Acc) -> &[f64] {
    &a.hop
}

pub(crate) const TTFT: Latency = Latency {
    name: "TTFT",
    unit: Unit::Ms,
    pick: ttft,
};
pub(crate) const PROCESSING: Latency = Latency {
    name: "processing",
    unit: Unit::Us,
    pick: processing,
};
pub(crate) const HOP: Latency = Latency {
    name: "hop",
    unit: Unit::Us,
    pick: hop,
};

impl Latency {
    /// Percentile `p` of `a`'s samples, in this figure's unit.
    fn pct(&self, a: &Acc, p: f64) -> Option<f64> {
        pct((self.pick)(a), p).map(|v| self.unit.of_ms(v))
    }

    /// Percentile `p` for a table cell: a number, the unit being in the column's header.
    pub(crate) fn cell(&self, a: &Acc, p: f64) -> String {
        number(self.pct(a, p))
    }

    /// `TTFT p50 (ms)`
    pub(crate) fn header(&self, p: &str) -> String {
        format!("{} {p} ({})", self.name, self.unit.label())
    }
}

/// p50 (solid) and p99 (dashed) lines of `figure` per group that has samples, in its unit.
fn pair_lines(s: &Series, groups: &[(usize, String, &'static str)], figure: Latency) -> Vec<Line> {
    let mut out = Vec::new();
    for (g, name, class) in groups {
        if (figure.pick)(&s.totals[*g]).is_empty() {
            continue;
        }
        out.push(Line {
            label: format!("{name} p50"),
            class,
            dashed: false,
            values: s.values(*g, |a| figure.pct(a, 50.0)),
        });
        out.push(Line {
            label: format!("{name} p99"),
            class,
            dashed: true,
            values: s.values(*g, |a| figure.pct(a, 99.0)),
        });
    }
    out
}

/// A chart of `figure`'s p50 and p99 over the window.
pub(crate) fn latency_chart(
    id: &str,
    title: &str,
    s: &Series,
    now: i64,
    groups: &[(usize, String, &'static str)],
    figure: Latency,
) -> Markup {
    line_chart(
        id,
        &format!("{title}, p50 and p99 (dashed)"),
        figure.unit.label(),
        &s.window,
        now,
        &pair_lines(s, groups, figure),
    )
}
