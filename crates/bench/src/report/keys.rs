//! One target's result keys: vLLM's (of a generation, or of a pooling run), the seed's
//! `result.json` shape, and the figures a gateway reported about itself.

use serde_json::{Value, json};

use crate::measure::Outcome;
use crate::spec::EndpointType;
use crate::summary::{METRICS, Stats, Summary, p_word};

/// vLLM's result keys for one target (per-request arrays included, texts not kept): those of a
/// generation, or those of a pooling run for an endpoint type whose answers are not streamed.
pub(crate) fn vllm_json(
    s: &Summary,
    outcomes: &[&Outcome],
    selected: &[String],
    kind: EndpointType,
) -> serde_json::Map<String, Value> {
    if !kind.streams() {
        return vllm_pooling_json(s, outcomes, selected);
    }
    let mut m = serde_json::Map::new();
    m.insert("duration".into(), json!(s.duration_s));
    m.insert("completed".into(), json!(s.completed));
    m.insert("failed".into(), json!(s.failed));
    m.insert("total_input_tokens".into(), json!(s.total_input));
    m.insert("total_output_tokens".into(), json!(s.total_output));
    m.insert("request_throughput".into(), json!(s.request_throughput));
    // vLLM writes null without --goodput.
    m.insert("request_goodput".into(), json!(s.goodput));
    m.insert("output_throughput".into(), json!(s.output_throughput));
    m.insert(
        "total_token_throughput".into(),
        json!(s.total_token_throughput),
    );
    m.insert(
        "max_output_tokens_per_s".into(),
        json!(s.peak_output_throughput),
    );
    m.insert(
        "max_concurrent_requests".into(),
        json!(s.max_concurrent_requests),
    );
    m.insert(
        "peak_concurrent_requests_instant".into(),
        json!(s.peak_concurrent_instant),
    );
    m.insert(
        "input_lens".into(),
        json!(outcomes.iter().map(|o| o.input_tokens).collect::<Vec<_>>()),
    );
    m.insert(
        "output_lens".into(),
        json!(
            outcomes
                .iter()
                .map(|o| if o.ok() { o.output_tokens } else { 0 })
                .collect::<Vec<_>>()
        ),
    );
    m.insert(
        "ttfts".into(),
        json!(
            outcomes
                .iter()
                .map(|o| o.ttft.map_or(0.0, |d| d.as_secs_f64()))
                .collect::<Vec<_>>()
        ),
    );
    m.insert(
        "itls".into(),
        json!(
            outcomes
                .iter()
                .map(|o| o
                    .itls_ms
                    .iter()
                    .map(|v| f64::from(*v) / 1e3)
                    .collect::<Vec<_>>())
                .collect::<Vec<_>>()
        ),
    );
    // E2EL per request in seconds (0 for a failed one, as vLLM leaves it).
    m.insert(
        "latencies".into(),
        json!(
            outcomes
                .iter()
                .map(|o| match (o.ok(), o.e2el) {
                    (true, Some(d)) => d.as_secs_f64(),
                    _ => 0.0,
                })
                .collect::<Vec<_>>()
        ),
    );
    m.insert(
        "errors".into(),
        json!(
            outcomes
                .iter()
                .map(|o| o.error.clone().unwrap_or_default())
                .collect::<Vec<_>>()
        ),
    );
    metric_keys(&mut m, s, selected);
    m
}

/// vLLM's result keys of a pooling run (`calculate_metrics_for_embeddings`): no output tokens,
/// no TTFT or ITL, one latency per request; plus `failed`, which vLLM prints but leaves out
/// of this dict, and fleetgate's instantaneous peak.
fn vllm_pooling_json(
    s: &Summary,
    outcomes: &[&Outcome],
    selected: &[String],
) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("duration".into(), json!(s.duration_s));
    m.insert("completed".into(), json!(s.completed));
    m.insert("failed".into(), json!(s.failed));
    m.insert("total_input_tokens".into(), json!(s.total_input));
    // One input (the prompt) per request.
    m.insert("total_input_sequences".into(), json!(s.completed));
    m.insert("request_throughput".into(), json!(s.request_throughput));
    m.insert(
        "input_sequence_throughput".into(),
        json!(s.request_throughput),
    );
    m.insert(
        "total_token_throughput".into(),
        json!(s.total_token_throughput),
    );
    if let Some(g) = s.goodput {
        m.insert("request_goodput".into(), json!(g));
    }
    m.insert(
        "peak_concurrent_requests_instant".into(),
        json!(s.peak_concurrent_instant),
    );
    m.insert(
        "input_lens".into(),
        json!(outcomes.iter().map(|o| o.input_tokens).collect::<Vec<_>>()),
    );
    m.insert(
        "latencies".into(),
        json!(
            outcomes
                .iter()
                .map(|o| o.e2el.map_or(0.0, |d| d.as_secs_f64()))
                .collect::<Vec<_>>()
        ),
    );
    m.insert(
        "errors".into(),
        json!(
            outcomes
                .iter()
                .map(|o| o.error.clone().unwrap_or_default())
                .collect::<Vec<_>>()
        ),
    );
    metric_keys(&mut m, s, selected);
    m
}

/// `mean_/median_/std_/p<N>_<metric>_ms` of each selected metric.
fn metric_keys(m: &mut serde_json::Map<String, Value>, s: &Summary, selected: &[String]) {
    for (key, _, _) in METRICS {
        if !selected.iter().any(|m| m == key) {
            continue;
        }
        let st = &s.metrics[key];
        m.insert(format!("mean_{key}_ms"), json!(st.mean));
        m.insert(format!("median_{key}_ms"), json!(st.median));
        m.insert(format!("std_{key}_ms"), json!(st.std));
        for (p, v) in &st.percentiles {
            m.insert(format!("p{}_{key}_ms", p_word(*p)), json!(v));
        }
    }
}

/// The seed's `result.json` shape (of an embedding run, only `error_rate`: it has no TTFT,
/// TPOT or output tokens).
pub(crate) fn seed_json(s: &Summary, kind: EndpointType) -> serde_json::Map<String, Value> {
    if !kind.streams() {
        let mut m = serde_json::Map::new();
        m.insert("error_rate".into(), json!(s.error_rate()));
        return m;
    }
    let pct = |st: &Stats| {
        let mut o = serde_json::Map::new();
        for p in [50.0, 95.0, 99.0] {
            let v = if p == 50.0 {
                Some(st.median)
            } else {
                st.get(&format!("p{}", p_word(p)))
            };
            if let Some(v) = v {
                o.insert(format!("p{}", p_word(p)), json!(v));
            }
        }
        Value::Object(o)
    };
    let mut m = serde_json::Map::new();
    m.insert("ttft_ms".into(), pct(&s.metrics["ttft"]));
    m.insert("tpot_ms".into(), pct(&s.metrics["tpot"]));
    m.insert(
        "throughput_tokens_per_sec".into(),
        json!(s.output_throughput),
    );
    m.insert("error_rate".into(), json!(s.error_rate()));
    m
}

/// Figures a gateway reported about itself (from `Server-Timing`) as a result key.
pub(super) fn stats_json(g: &Stats) -> Value {
    json!({"count": g.count, "mean": g.mean, "median": g.median, "max": g.max,
           "percentiles": g.percentiles.iter().map(|(p, v)| (format!("p{}", p_word(*p)), json!(v))).collect::<serde_json::Map<_, _>>()})
}
