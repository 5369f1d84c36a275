//! What the result records about the run: its labels (with the model, fleetgate's version and
//! the date) and the settings it ran with.

use serde_json::{Value, json};

use crate::args::{BenchArgs, kv};
use crate::spec::EndpointType;

/// The `--label KEY=VALUE`s, plus the model, fleetgate's version and the date; and vLLM's
/// label, a bare `--label NAME` (at most one).
pub(super) fn labels(
    args: &BenchArgs,
    model: &str,
) -> Result<(serde_json::Map<String, Value>, Option<String>), String> {
    let mut labels = serde_json::Map::new();
    let mut bare = None;
    for l in &args.labels {
        if !l.contains('=') {
            let name = l.trim();
            if name.is_empty() || bare.replace(name.to_owned()).is_some() {
                return Err(format!(
                    "--label `{l}`: one bare label names the run (vLLM's --label); write the others KEY=VALUE"
                ));
            }
            continue;
        }
        let (k, v) = kv(l, "--label")?;
        labels.insert(k, Value::String(v));
    }
    labels
        .entry("model")
        .or_insert(Value::String(model.to_owned()));
    labels.insert(
        "fleetgate_version".into(),
        Value::String(env!("CARGO_PKG_VERSION").to_owned()),
    );
    labels.insert("date".into(), Value::String(now_rfc3339()));
    Ok((labels, bare))
}

/// The flags the run used, stored with the result (without settings.json, which is stored as is).
pub(super) fn settings_echo(
    args: &BenchArgs,
    endpoint: &str,
    kind: EndpointType,
    selected: &[String],
    percentiles: &[f64],
) -> Value {
    // An embedding has no output: no output length was sent.
    let output_len = kind.streams().then_some(args.random_output_len);
    json!({
        "base_url": args.base_url,
        "endpoint": endpoint,
        "endpoint_type": kind.name(),
        "dataset_name": format!("{:?}", args.dataset_name).to_lowercase(),
        "dataset_path": args.dataset_path,
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": output_len,
        "random_range_ratio": args.random_range_ratio,
        "sharegpt_output_len": args.sharegpt_output_len,
        "tokenizer": args.tokenizer,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration_seconds": args.duration_seconds,
        "percentile_metrics": selected,
        "metric_percentiles": percentiles,
        "goodput": args.goodput,
        "num_warmups": args.num_warmups,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "compare": args.compare,
        "max_mean_delta_pct": args.max_mean_delta_pct,
        "max_percentile_delta_pct": args.max_percentile_delta_pct,
        "delta_floor_ms": args.delta_floor_ms,
        "sla": args.sla,
    })
}

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}
