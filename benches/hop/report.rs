//! The report: the markdown summary printed on stdout, section by section as the phases end,
//! the recorded hop set beside the client-seen added TTFT (as a markdown line and a JSON row),
//! the targets table, the environment, and the µs formatting they share.

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::args::Args;
use crate::latency::LatencyResult;
use crate::memory::mib;
use crate::openloop::OpenLoopResult;
use crate::procfs::nproc;
use crate::summary::{Summary, summarize, summary_json};
use crate::target::NAMES;

/// The hop cost fleetgate recorded (median over its requests) against what the client saw it
/// add (TTFT p50 through fleetgate − TTFT p50 direct, and the median of the paired differences
/// when the phase pairs requests): their ratio and whether it is within 25 %.
/// Means are compared too: a backend that starts requests only at step boundaries (the sim,
/// vLLM) quantises TTFT, which makes the difference of two medians jumpy while the difference of
/// means stays the expected delay.
fn hop_agreement(recorded: &Summary, added_p50: f64, added_mean: f64, paired_p50: f64) -> String {
    if recorded.n == 0 {
        return "Recorded hop: fleetgate sent no `hop` figure (no kernel stamps?).".to_owned();
    }
    let ratio = recorded.p50 / added_p50;
    let mut line = format!(
        "Recorded hop (fleetgate's `Server-Timing` trailer, {} requests): median {} µs against the client-seen added TTFT p50 {} µs: ratio {:.2} ({} the 25 % goal)",
        recorded.n,
        us(recorded.p50),
        signed_us(added_p50),
        ratio,
        if (ratio - 1.0).abs() <= 0.25 {
            "within"
        } else {
            "outside"
        }
    );
    let _ = write!(
        line,
        "; mean {} µs against the added TTFT mean {} µs: ratio {:.2}",
        us(recorded.mean),
        signed_us(added_mean),
        recorded.mean / added_mean
    );
    if paired_p50.is_finite() {
        let _ = write!(
            line,
            "; paired-difference median {} µs, ratio {:.2}",
            signed_us(paired_p50),
            recorded.p50 / paired_p50
        );
    }
    line.push('.');
    line
}

pub fn hop_json(
    phase: &str,
    recorded: &Summary,
    added_p50: f64,
    added_mean: f64,
    paired_p50: f64,
) -> Value {
    json!({
        "phase": phase,
        "recorded_hop_us": summary_json(recorded),
        "client_added_ttft_p50_us": added_p50,
        "client_added_ttft_mean_us": added_mean,
        "ratio_recorded_to_added_mean": recorded.mean / added_mean,
        "client_paired_difference_p50_us": paired_p50,
        "ratio_recorded_to_added_p50": recorded.p50 / added_p50,
    })
}

fn us(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.0}")
    } else {
        "–".into()
    }
}

fn signed_us(v: f64) -> String {
    if v.is_finite() {
        format!("{v:+.0}")
    } else {
        "–".into()
    }
}

fn met(ok: Option<bool>) -> &'static str {
    match ok {
        Some(true) => "met",
        Some(false) => "**not met**",
        None => "not measured",
    }
}

pub fn environment() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    json!({"nproc": nproc(), "cpu_model": cpu, "kernel": kernel})
}

/// The heading: the machine, the request, and how to read the figures.
pub fn heading(md: &mut String, args: &Args, env: &Value) {
    let _ = writeln!(
        md,
        "## fleetgate hop cost{}{}\n\n{} × {}, kernel {}; streamed chat, max_tokens {}, {}. \
         Times in µs; \"added\" = via − direct in the same run.\n",
        if args.label.is_empty() { "" } else { ": " },
        args.label,
        env["nproc"],
        env["cpu_model"].as_str().unwrap_or(""),
        env["kernel"].as_str().unwrap_or(""),
        args.max_tokens,
        if args.no_include_usage {
            "no include_usage (fleetgate asks for usage upstream and removes the usage chunk)"
        } else {
            "include_usage"
        }
    );
}

/// Phase 1's section: TTFT and E2EL per target, the TTFT each proxy adds, the other CPU, the CPU
/// per request, and the recorded hop against the added TTFT.
pub fn latency_section(md: &mut String, args: &Args, lat: &LatencyResult) {
    let _ = writeln!(
        md,
        "### 1. Latency at concurrency 1 ({} rounds, rotating order)\n",
        args.rounds
    );
    let _ = writeln!(
        md,
        "| target | ok | failed | TTFT p50 | p90 | p99 | mean | E2EL p50 | p90 | p99 | mean |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (i, t) in lat.json["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let s = &lat.ttft[i];
        let e = &t["e2el_us"];
        let f = |v: &Value| us(v.as_f64().unwrap_or(f64::NAN));
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            NAMES[i],
            t["ok"],
            t["failed"],
            us(s.p50),
            us(s.p90),
            us(s.p99),
            us(s.mean),
            f(&e["p50"]),
            f(&e["p90"]),
            f(&e["p99"]),
            f(&e["mean"])
        );
    }
    let _ = writeln!(
        md,
        "\n| added TTFT | Δp50 | Δp90 | Δp99 | paired p50 | paired p90 | paired p99 |\n|---|---|---|---|---|---|---|"
    );
    for ((name, d), p) in NAMES[1..]
        .iter()
        .zip(&lat.added_diff)
        .zip(&lat.added_paired)
    {
        let _ = writeln!(
            md,
            "| {} − direct | {} | {} | {} | {} | {} | {} |",
            name,
            signed_us(d[0]),
            signed_us(d[1]),
            signed_us(d[2]),
            signed_us(p.p50),
            signed_us(p.p90),
            signed_us(p.p99)
        );
    }
    let _ = writeln!(
        md,
        "\nOther CPU during this phase: {:.1}% of the machine.",
        lat.json["other_cpu_share"].as_f64().unwrap_or(f64::NAN) * 100.0
    );
    let _ = writeln!(md, "\nCPU per request at concurrency 1 (µs): {}\n", {
        lat.json["cpu"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                format!(
                    "{} {}",
                    c["process"].as_str().unwrap_or(""),
                    us(c["cpu_us_per_request"].as_f64().unwrap_or(f64::NAN))
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    });
    let _ = writeln!(
        md,
        "{}\n",
        hop_agreement(
            &lat.hop[1],
            lat.added_diff[0][0],
            lat.ttft[1].mean - lat.ttft[0].mean,
            lat.added_paired[0].p50,
        )
    );
}

/// Phase 2's section: one row per target, the note on how CPU is counted, and the recorded hop
/// against the added TTFT. `sums` are the targets' TTFT summaries, `fg_hop` the hop fleetgate
/// recorded.
pub fn openloop_section(
    md: &mut String,
    args: &Args,
    ol: &OpenLoopResult,
    sums: &[Summary],
    fg_hop: &Summary,
) {
    let _ = writeln!(
        md,
        "### 2. Open loop at {} streamed requests/s (constant rate, {} s slices × {} rotations)\n",
        args.rate, args.slice_secs, args.repeats
    );
    let _ = writeln!(
        md,
        "| target | completed | failed | send rate/s | send lag p99 | TTFT p50 | TTFT p99 | added p50 | added p99 | gateway CPU/req | nginx CPU/req | sim CPU/req | driver CPU/req | other CPU (max) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (i, a) in ol.per_target.iter().enumerate() {
        let s = &sums[i];
        let added = |v: f64, b: f64| {
            if i == 0 {
                "–".to_owned()
            } else {
                signed_us(v - b)
            }
        };
        let lag = summarize(&a.send_lag_us);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1}% |",
            NAMES[i],
            a.completed,
            a.failed,
            a.sent.saturating_sub(args.repeats) as f64 / a.send_secs,
            us(lag.p99),
            us(s.p50),
            us(s.p99),
            added(s.p50, sums[0].p50),
            added(s.p99, sums[0].p99),
            us(a.cpu_us_per_request("gateway")),
            us(a.cpu_us_per_request("nginx")),
            us(a.cpu_us_per_request("sim")),
            us(a.cpu_us_per_request("driver")),
            a.other_share.iter().copied().fold(0.0, f64::max) * 100.0
        );
    }
    let _ = writeln!(
        md,
        "\nCPU per request = utime+stime of the process over its target's slices ÷ requests completed in them (the proxy columns of the other rows show its idle cost). Other CPU = machine busy time outside these processes (other programs, unattributed kernel work) as a share of both cores: a noise flag.\n"
    );
    let _ = writeln!(
        md,
        "{}\n",
        hop_agreement(
            fg_hop,
            sums[1].p50 - sums[0].p50,
            sums[1].mean - sums[0].mean,
            f64::NAN,
        )
    );
}

/// Phase 3's section: the memory of each proxy with its streams open.
pub fn memory_section(md: &mut String, args: &Args, mem: &[Value]) {
    let _ = writeln!(
        md,
        "### 3. Memory with {} open streams (MiB)\n\n| via | open | RSS before | RSS with streams open | VmHWM | RSS after close | KiB per stream |\n|---|---|---|---|---|---|---|",
        args.mem_streams
    );
    for m in mem {
        let k = |f: &str| mib(m[f].as_u64().unwrap_or(0));
        let _ = writeln!(
            md,
            "| {} | {}/{} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            m["via"].as_str().unwrap_or(""),
            m["open_at_reading"],
            m["streams_requested"],
            k("rss_before_kib"),
            k("rss_open_kib"),
            k("hwm_open_kib"),
            k("rss_after_close_kib"),
            m["rss_per_stream_kib"].as_f64().unwrap_or(f64::NAN)
        );
    }
    let _ = writeln!(md);
}

/// Phase 0: each proxy's bursts side by side, the first one cold.
pub fn burst_section(md: &mut String, args: &Args, bursts: &[Value]) {
    let _ = writeln!(
        md,
        "### 0. Bursts of {} streams opened at once, each on a new connection ({} rounds; the first is the process's first traffic)\n\n| via | burst | ok | TTFT p50 | TTFT p99 | CPU per stream (driver's) | TTFT ≥ 1 s | listen drops | SYN retransmits | RSS peak | RSS all open | RSS {} s after |\n|---|---|---|---|---|---|---|---|---|---|---|---|",
        args.burst_streams, args.burst_rounds, args.burst_settle_secs
    );
    for b in bursts {
        let via = b["via"].as_str().unwrap_or("");
        let idle = mib(b["rss_idle_kib"].as_u64().unwrap_or(0));
        let anon = mib(b["rss_idle_anon_kib"].as_u64().unwrap_or(0));
        let _ = writeln!(
            md,
            "| {via} | idle | | | | | | | | {idle:.1} MiB (anonymous {anon:.1}) | | |"
        );
        for (i, r) in b["bursts"].as_array().into_iter().flatten().enumerate() {
            let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
            let _ = writeln!(
                md,
                "| {via} | {}{} | {}/{} | {:.1} ms | {:.1} ms | {:.0} µs ({:.0}) | {} | {} | {} | {:.1} MiB | {:.1} MiB | {:.1} MiB |",
                i + 1,
                if i == 0 { " (cold)" } else { "" },
                r["ok"],
                r["streams"],
                f("ttft_p50_ms"),
                f("ttft_p99_ms"),
                f("cpu_per_stream_us"),
                f("driver_cpu_per_stream_us"),
                r["ttft_over_1s"],
                r["listen_drops"],
                r["syn_retrans"],
                mib(r["rss_peak_kib"].as_u64().unwrap_or(0)),
                mib(r["rss_open_kib"].as_u64().unwrap_or(0)),
                mib(r["rss_after_kib"].as_u64().unwrap_or(0)),
            );
        }
        if let Some(kib) = b["rss_drained_kib"].as_u64() {
            let _ = writeln!(
                md,
                "| {via} | {:.0} s after the last | | | | | | | | | | {:.1} MiB (anonymous {:.1}) |",
                args.burst_drain_secs,
                mib(kib),
                mib(b["rss_drained_anon_kib"].as_u64().unwrap_or(0))
            );
        }
    }
    let _ = writeln!(md);
}

/// The hop cost's targets, each marked met or not from this run's figures.
pub fn targets_table(
    md: &mut String,
    args: &Args,
    [added_p50, added_p99]: [Option<f64>; 2],
    ol_p99_ok: Option<bool>,
    ol_figures: (f64, f64, f64, f64),
    cpu_ratio: Option<f64>,
    peak_rss_mib: Option<f64>,
) {
    let _ = writeln!(
        md,
        "### Targets\n\n| target | goal | measured | |\n|---|---|---|---|"
    );
    let _ = writeln!(
        md,
        "| added TTFT p50, concurrency 1 | ≤ 60 µs | {} µs | {} |",
        added_p50.map_or("–".into(), signed_us),
        met(added_p50.map(|v| v <= 60.0))
    );
    let _ = writeln!(
        md,
        "| added TTFT p99, concurrency 1 | ≤ 250 µs | {} µs | {} |",
        added_p99.map_or("–".into(), signed_us),
        met(added_p99.map(|v| v <= 250.0))
    );
    let _ = writeln!(
        md,
        "| added TTFT p99 at {}/s | ≤ nginx's | fleetgate {} µs, nginx {} µs | {} |",
        args.rate,
        signed_us(ol_figures.0),
        signed_us(ol_figures.1),
        met(ol_p99_ok)
    );
    let _ = writeln!(
        md,
        "| gateway CPU per streamed request | ≤ 1.5 × nginx | {} µs vs {} µs ({}) | {} |",
        us(ol_figures.2),
        us(ol_figures.3),
        cpu_ratio.map_or("–".into(), |r| format!("{r:.2}×")),
        met(cpu_ratio.map(|r| r <= 1.5))
    );
    let _ = writeln!(
        md,
        "| peak RSS, {} open streams | ≤ 64 MiB | {} | {} |",
        args.mem_streams,
        peak_rss_mib.map_or("–".into(), |v| format!("{v:.1} MiB")),
        met(peak_rss_mib.map(|v| v <= 64.0))
    );
}
