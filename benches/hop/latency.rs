//! Phase 1, latency at concurrency 1: rounds of one request per target in a rotating order,
//! the TTFT each proxy adds (difference of percentiles and paired per round), and the CPU per
//! request of every watched process over the measured rounds.

use std::time::Instant;

use bytes::Bytes;
use http::HeaderMap;
use serde_json::{Value, json};

use crate::args::Args;
use crate::error::Res;
use crate::procfs::Watched;
use crate::summary::{Summary, summarize, summary_json};
use crate::target::{Target, measure};

pub struct LatencyResult {
    pub json: Value,
    pub ttft: Vec<Summary>,
    pub added_diff: Vec<[f64; 3]>,
    pub added_paired: Vec<Summary>,
    /// The hop cost each target recorded (fleetgate's only).
    pub hop: Vec<Summary>,
}

pub async fn phase_latency(
    args: &Args,
    targets: &[Target],
    headers: &HeaderMap,
    body: &Bytes,
    watched: &Watched,
) -> Res<LatencyResult> {
    let n = targets.len();
    let mut ttft: Vec<Vec<f64>> = vec![Vec::with_capacity(args.rounds); n];
    let mut e2el: Vec<Vec<f64>> = vec![Vec::with_capacity(args.rounds); n];
    // Per round and target; NaN where the request failed, so rounds stay aligned for pairing.
    let mut round_ttft: Vec<Vec<f64>> = vec![Vec::with_capacity(args.rounds); n];
    let mut hop: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut failed = vec![0usize; n];
    let mut first_errors: Vec<Option<String>> = vec![None; n];
    let mut cpu_before = None;
    let started = Instant::now();
    for round in 0..args.warmup_rounds + args.rounds {
        let measured = round >= args.warmup_rounds;
        if round == args.warmup_rounds {
            cpu_before = Some(watched.read()?);
        }
        let mut this_round = vec![f64::NAN; n];
        for k in 0..n {
            let i = (round + k) % n;
            let t = &targets[i];
            let r = measure(&t.client, &t.uri, headers, body.clone(), args.max_tokens).await;
            if !measured {
                if let Err(e) = r {
                    return Err(format!("warm-up request to {} failed: {e}", t.name).into());
                }
                continue;
            }
            match r {
                Ok(s) => {
                    ttft[i].push(s.ttft_us);
                    e2el[i].push(s.e2el_us);
                    this_round[i] = s.ttft_us;
                    if s.hop_us.is_finite() {
                        hop[i].push(s.hop_us);
                    }
                }
                Err(e) => {
                    failed[i] += 1;
                    first_errors[i].get_or_insert(e);
                }
            }
        }
        if measured {
            for (i, v) in this_round.into_iter().enumerate() {
                round_ttft[i].push(v);
            }
        }
    }
    let cpu_after = watched.read()?;
    let cpu = cpu_before.as_ref().map(|b| watched.delta(b, &cpu_after));
    let elapsed = started.elapsed().as_secs_f64();

    let ttft_s: Vec<Summary> = ttft.iter().map(|v| summarize(v)).collect();
    let e2el_s: Vec<Summary> = e2el.iter().map(|v| summarize(v)).collect();
    let hop_s: Vec<Summary> = hop.iter().map(|v| summarize(v)).collect();
    let mut added_diff = Vec::new();
    let mut added_paired = Vec::new();
    for i in 1..n {
        let d = &ttft_s[i];
        let b = &ttft_s[0];
        added_diff.push([d.p50 - b.p50, d.p90 - b.p90, d.p99 - b.p99]);
        let paired: Vec<f64> = round_ttft[i]
            .iter()
            .zip(&round_ttft[0])
            .map(|(x, y)| x - y)
            .filter(|d| d.is_finite())
            .collect();
        added_paired.push(summarize(&paired));
    }
    // CPU per request of each process over the measured rounds: a proxy only serves its own
    // target's requests, so its CPU is divided by those; the sim and the driver serve all.
    let ok: Vec<usize> = ttft.iter().map(Vec::len).collect();
    let all_ok: usize = ok.iter().sum();
    let cpu_json: Vec<Value> = cpu
        .iter()
        .flat_map(|c| c.per.iter())
        .map(|(name, secs)| {
            let per = match *name {
                "gateway" => ok[1],
                "nginx" => ok[2],
                _ => all_ok,
            };
            json!({"process": name, "cpu_s": secs, "requests": per,
                   "cpu_us_per_request": secs * 1e6 / per.max(1) as f64})
        })
        .collect();

    let per_target: Vec<Value> = (0..n)
        .map(|i| {
            json!({
                "target": targets[i].name,
                "ok": ok[i],
                "failed": failed[i],
                "first_error": first_errors[i],
                "ttft_us": summary_json(&ttft_s[i]),
                "e2el_us": summary_json(&e2el_s[i]),
                "recorded_hop_us": summary_json(&hop_s[i]),
            })
        })
        .collect();
    let added: Vec<Value> = (1..n)
        .map(|i| {
            let d = added_diff[i - 1];
            json!({
                "via": targets[i].name,
                "difference_of_percentiles_us": {"p50": d[0], "p90": d[1], "p99": d[2]},
                "paired_difference_us": summary_json(&added_paired[i - 1]),
            })
        })
        .collect();
    Ok(LatencyResult {
        json: json!({
            "rounds": args.rounds,
            "warmup_rounds": args.warmup_rounds,
            "elapsed_s": elapsed,
            "targets": per_target,
            "added_ttft": added,
            "cpu": cpu_json,
            "other_cpu_share": cpu.as_ref().map(|c| c.other_share),
        }),
        ttft: ttft_s,
        added_diff,
        added_paired,
        hop: hop_s,
    })
}
