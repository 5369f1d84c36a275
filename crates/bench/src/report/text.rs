//! One target's terminal summary in `vllm bench serve`'s layout, with the figures a gateway
//! reported about itself.

use std::fmt::Write as _;

use crate::spec::EndpointType;
use crate::summary::{METRICS, Stats, Summary, p_word};

/// The terminal summary in `vllm bench serve`'s layout: its generation lines, or for an
/// endpoint type whose answers are not streamed (embeddings) its pooling lines, which have no
/// output tokens and no per-second peaks.
pub(crate) fn render(
    s: &Summary,
    selected: &[String],
    max_concurrency: Option<usize>,
    rate: f64,
    kind: EndpointType,
) -> String {
    let mut o = String::new();
    let line = |o: &mut String, k: &str, v: String| {
        let _ = writeln!(o, "{:<40} {:<10}", k, v);
    };
    let _ = writeln!(o, "{:=^50}", " Serving Benchmark Result ");
    line(&mut o, "Successful requests:", s.completed.to_string());
    line(&mut o, "Failed requests:", s.failed.to_string());
    if let Some(c) = max_concurrency {
        line(&mut o, "Maximum request concurrency:", c.to_string());
    }
    if rate.is_finite() {
        line(
            &mut o,
            "Request rate configured (RPS):",
            format!("{rate:.2}"),
        );
    }
    line(
        &mut o,
        "Benchmark duration (s):",
        format!("{:.2}", s.duration_s),
    );
    line(&mut o, "Total input tokens:", s.total_input.to_string());
    if kind.streams() {
        line(
            &mut o,
            "Total generated tokens:",
            s.total_output.to_string(),
        );
    }
    line(
        &mut o,
        "Request throughput (req/s):",
        format!("{:.2}", s.request_throughput),
    );
    if !kind.streams() {
        // vLLM's inputs per second; one input (the prompt) per request.
        line(
            &mut o,
            "Input throughput (inputs/s):",
            format!("{:.2}", s.request_throughput),
        );
    }
    if let Some(g) = s.goodput {
        line(&mut o, "Request goodput (req/s):", format!("{g:.2}"));
    }
    if kind.streams() {
        line(
            &mut o,
            "Output token throughput (tok/s):",
            format!("{:.2}", s.output_throughput),
        );
        line(
            &mut o,
            "Peak output token throughput (tok/s):",
            format!("{:.2}", s.peak_output_throughput),
        );
        line(
            &mut o,
            "Peak concurrent requests:",
            format!("{:.2}", s.max_concurrent_requests as f64),
        );
    }
    // Without output tokens (an embedding), the input tokens per second.
    line(
        &mut o,
        "Total token throughput (tok/s):",
        format!("{:.2}", s.total_token_throughput),
    );
    // Not a vLLM line: vLLM's "peak" above counts requests active within the same second.
    line(
        &mut o,
        "Instantaneous peak concurrency:",
        s.peak_concurrent_instant.to_string(),
    );
    for (key, title, label) in METRICS {
        if !selected.iter().any(|m| m == key) {
            continue;
        }
        let st = &s.metrics[key];
        let _ = writeln!(o, "{:-^50}", title);
        line(
            &mut o,
            &format!("Mean {label} (ms):"),
            format!("{:.2}", st.mean),
        );
        line(
            &mut o,
            &format!("Median {label} (ms):"),
            format!("{:.2}", st.median),
        );
        for (p, v) in &st.percentiles {
            line(
                &mut o,
                &format!("P{} {label} (ms):", p_word(*p)),
                format!("{v:.2}"),
            );
        }
    }
    if let Some(g) = &s.gateway_ms {
        stats_section(
            &mut o,
            "Gateway's own time (Server-Timing gw)",
            "gateway time",
            g,
        );
    }
    if let Some(h) = &s.hop_ms {
        stats_section(
            &mut o,
            "Gateway's recorded hop cost (Server-Timing hop)",
            "hop cost",
            h,
        );
    }
    let _ = writeln!(o, "{}", "=".repeat(50));
    if !s.errors.is_empty() {
        let _ = writeln!(o, "Failures by cause:");
        for (e, n) in &s.errors {
            let _ = writeln!(o, "  {n:>6} × {e}");
        }
    }
    if s.outputs_without_usage > 0 {
        let _ = writeln!(
            o,
            "note: {} request(s) reported no usage; {}",
            s.outputs_without_usage,
            if kind.streams() {
                "their output tokens are their content events"
            } else {
                "their input tokens are the prompt's own count"
            }
        );
    }
    o
}

/// A section of figures a gateway reported about itself (milliseconds, three decimals).
fn stats_section(o: &mut String, title: &str, what: &str, st: &Stats) {
    let _ = writeln!(o, "{title:-^50}");
    let mut line = |k: String, v: f64| {
        let _ = writeln!(o, "{k:<40} {v:<10.3}");
    };
    line(format!("Mean {what} (ms):"), st.mean);
    line(format!("Median {what} (ms):"), st.median);
    for (p, v) in &st.percentiles {
        line(format!("P{} {what} (ms):", p_word(*p)), *v);
    }
}
