//! Phase 2, open loop: constant-rate arrivals in slices rotating direct → fleetgate → nginx,
//! each slice drained (bounded) and charged the CPU every watched process spent in it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::HeaderMap;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use crate::args::Args;
use crate::error::Res;
use crate::procfs::Watched;
use crate::summary::{summarize, summary_json};
use crate::target::{Target, measure};

pub struct OpenLoopTarget {
    pub ttft: Vec<f64>,
    pub hop: Vec<f64>,
    e2el: Vec<f64>,
    pub sent: usize,
    pub completed: usize,
    pub failed: usize,
    first_error: Option<String>,
    pub send_lag_us: Vec<f64>,
    pub send_secs: f64,
    cpu: Vec<(&'static str, f64)>,
    pub other_share: Vec<f64>,
}

impl OpenLoopTarget {
    fn new() -> Self {
        Self {
            ttft: Vec::new(),
            hop: Vec::new(),
            e2el: Vec::new(),
            sent: 0,
            completed: 0,
            failed: 0,
            first_error: None,
            send_lag_us: Vec::new(),
            send_secs: 0.0,
            cpu: Vec::new(),
            other_share: Vec::new(),
        }
    }

    fn cpu_of(&self, name: &str) -> f64 {
        self.cpu
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(f64::NAN, |(_, s)| *s)
    }

    pub fn cpu_us_per_request(&self, name: &str) -> f64 {
        self.cpu_of(name) * 1e6 / self.completed.max(1) as f64
    }
}

pub struct OpenLoopResult {
    pub json: Value,
    pub per_target: Vec<OpenLoopTarget>,
}

async fn one_slice(
    args: &Args,
    t: &Target,
    headers: &Arc<HeaderMap>,
    body: &Bytes,
    watched: &Watched,
    acc: &mut OpenLoopTarget,
) -> Res<Value> {
    let n = (args.rate * args.slice_secs).round().max(1.0) as usize;
    let interval = Duration::from_secs_f64(1.0 / args.rate);
    let before = watched.read()?;
    let mut set = JoinSet::new();
    let start = Instant::now();
    let mut last_send = start;
    let mut lags = Vec::with_capacity(n);
    for k in 0..n {
        let due = start + interval.mul_f64(k as f64);
        tokio::time::sleep_until(due.into()).await;
        let now = Instant::now();
        lags.push(now.saturating_duration_since(due).as_secs_f64() * 1e6);
        last_send = now;
        let (c, uri, h, b) = (
            t.client.clone(),
            t.uri.clone(),
            headers.clone(),
            body.clone(),
        );
        let max_tokens = args.max_tokens;
        set.spawn(async move { measure(&c, &uri, &h, b, max_tokens).await });
    }
    let send_secs = last_send.duration_since(start).as_secs_f64();
    let drain_deadline = Instant::now() + Duration::from_secs_f64(args.drain_secs);
    let (mut completed, mut failed) = (0usize, 0usize);
    let mut ttft = Vec::with_capacity(n);
    loop {
        let next = tokio::time::timeout_at(drain_deadline.into(), set.join_next()).await;
        let result = match next {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(_) => {
                // Bounded: whatever has not finished by now counts as failed.
                failed += set.len();
                acc.first_error
                    .get_or_insert_with(|| "not finished within --drain-secs".into());
                set.abort_all();
                while set.join_next().await.is_some() {}
                break;
            }
        };
        match result {
            Ok(Ok(s)) => {
                completed += 1;
                ttft.push(s.ttft_us);
                acc.ttft.push(s.ttft_us);
                acc.e2el.push(s.e2el_us);
                if s.hop_us.is_finite() {
                    acc.hop.push(s.hop_us);
                }
            }
            Ok(Err(e)) => {
                failed += 1;
                acc.first_error.get_or_insert(e);
            }
            Err(e) => {
                failed += 1;
                acc.first_error.get_or_insert(format!("task: {e}"));
            }
        }
    }
    let after = watched.read()?;
    let cpu = watched.delta(&before, &after);
    acc.sent += n;
    acc.completed += completed;
    acc.failed += failed;
    acc.send_lag_us.extend_from_slice(&lags);
    acc.send_secs += send_secs;
    acc.other_share.push(cpu.other_share);
    for (name, secs) in &cpu.per {
        match acc.cpu.iter_mut().find(|(n, _)| n == name) {
            Some((_, s)) => *s += secs,
            None => acc.cpu.push((name, *secs)),
        }
    }
    let ttft_s = summarize(&ttft);
    let cpu_json: Value = cpu
        .per
        .iter()
        .map(|(name, secs)| {
            (
                (*name).to_owned(),
                json!({"cpu_s": secs, "cpu_us_per_request": secs * 1e6 / completed.max(1) as f64}),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into();
    Ok(json!({
        "target": t.name,
        "sent": n,
        "completed": completed,
        "failed": failed,
        "achieved_send_rate": if send_secs > 0.0 { (n - 1) as f64 / send_secs } else { f64::NAN },
        "send_lag_us": summary_json(&summarize(&lags)),
        "ttft_us": summary_json(&ttft_s),
        "cpu": cpu_json,
        "other_cpu_share": cpu.other_share,
    }))
}

pub async fn phase_openloop(
    args: &Args,
    targets: &[Target],
    headers: &Arc<HeaderMap>,
    body: &Bytes,
    watched: &Watched,
    warmed: bool,
) -> Res<OpenLoopResult> {
    if !(args.rate.is_finite() && args.rate > 0.0) {
        return Err("--rate must be > 0".into());
    }
    // Warm every target's connection pool and code paths, unless phase 1 just did.
    let warm_up = if warmed { 0 } else { 50 };
    for t in targets {
        for _ in 0..warm_up {
            measure(&t.client, &t.uri, headers, body.clone(), args.max_tokens)
                .await
                .map_err(|e| format!("warm-up request to {} failed: {e}", t.name))?;
        }
    }
    let mut per_target: Vec<OpenLoopTarget> =
        targets.iter().map(|_| OpenLoopTarget::new()).collect();
    let mut slices = Vec::new();
    for rep in 0..args.repeats {
        for (i, t) in targets.iter().enumerate() {
            let mut s = one_slice(args, t, headers, body, watched, &mut per_target[i]).await?;
            s["repeat"] = json!(rep);
            eprintln!(
                "hop: open loop {} repeat {}: {} completed, {} failed, TTFT p99 {:.0} us, other CPU {:.1}%",
                t.name,
                rep,
                s["completed"],
                s["failed"],
                s["ttft_us"]["p99"].as_f64().unwrap_or(f64::NAN),
                s["other_cpu_share"].as_f64().unwrap_or(f64::NAN) * 100.0
            );
            slices.push(s);
        }
    }
    let summary: Vec<Value> = targets
        .iter()
        .zip(&per_target)
        .map(|(t, a)| {
            let cpu: Value = a
                .cpu
                .iter()
                .map(|(name, secs)| {
                    (
                        (*name).to_owned(),
                        json!({"cpu_s": secs, "cpu_us_per_request": a.cpu_us_per_request(name)}),
                    )
                })
                .collect::<serde_json::Map<_, _>>()
                .into();
            json!({
                "target": t.name,
                "sent": a.sent,
                "completed": a.completed,
                "failed": a.failed,
                "first_error": a.first_error,
                "achieved_send_rate": a.sent.saturating_sub(args.repeats) as f64 / a.send_secs,
                "send_lag_us": summary_json(&summarize(&a.send_lag_us)),
                "ttft_us": summary_json(&summarize(&a.ttft)),
                "e2el_us": summary_json(&summarize(&a.e2el)),
                "cpu": cpu,
                "other_cpu_share_max": a.other_share.iter().copied().fold(0.0, f64::max),
            })
        })
        .collect();
    Ok(OpenLoopResult {
        json: json!({
            "arrivals": "constant rate (fixed interval 1/rate; tokio timer, 1 ms granularity)",
            "rate": args.rate,
            "slice_secs": args.slice_secs,
            "repeats": args.repeats,
            "targets": summary,
            "slices": slices,
        }),
        per_target,
    })
}
