//! Phase 0, burst: a reconnect storm. Thousands of streams opened at the same moment, each on
//! a new connection, through one proxy; then again, several times, in the same processes. The
//! first burst after the proxies start is the cold one (a rolling update's new replica); the
//! later ones are warm. Per burst: TTFT p50/p99 (each stream from its own send), the resident
//! set at its peak and once its streams have ended. Run first, so the first burst is cold.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fleetgate_protocol::client;
use fleetgate_protocol::event::DataKind;
use fleetgate_protocol::sse::SseScanner;
use http::{HeaderMap, Method, Request};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use tokio::task::JoinSet;

use crate::args::Args;
use crate::error::Res;
use crate::memory::mib;
use crate::procfs::{TcpStorm, rss_anon_kib, rss_kib};
use crate::target::{chat_uri, request_body};

/// One stream of a burst: its time to first token, or why it has none.
async fn one_stream(
    c: client::HttpClient,
    req: Request<Full<Bytes>>,
) -> Result<Duration, &'static str> {
    let sent = Instant::now();
    let resp = c.request(req).await.map_err(|_| "connect or send")?;
    if resp.status() != http::StatusCode::OK {
        return Err("status");
    }
    let mut body = resp.into_body();
    let mut scanner = SseScanner::new();
    let mut first = None;
    // Read to the end: the stream's connection stays busy as a real client's would.
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return Err("cut");
        };
        if first.is_none()
            && let Some(data) = frame.data_ref()
        {
            let mut seen = false;
            scanner.feed(data, |l| seen |= l.kind == DataKind::Content);
            if seen {
                first = Some(sent.elapsed());
            }
        }
    }
    first.ok_or("no token")
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// One burst of `args.burst_streams` through `base`: every stream on a connection of its own,
/// all sent at once.
async fn burst(args: &Args, base: &str, pids: &[u32], headers: &HeaderMap) -> Res<Value> {
    let uri = chat_uri(base)?;
    let model = args.burst_model.as_deref().unwrap_or(&args.mem_model);
    let body = request_body(model, args.burst_max_tokens, false);
    // A new client per burst: no connection is reused from the last one.
    let c = client::http_client();
    let n = args.burst_streams;
    let mut set = JoinSet::new();
    let sampling = Arc::new(AtomicBool::new(true));
    // The peak resident set, read every 20 ms while the burst runs.
    let sampler = {
        let pids = pids.to_vec();
        let sampling = sampling.clone();
        tokio::spawn(async move {
            let mut peak = 0;
            while sampling.load(Ordering::Relaxed) {
                if let Ok((rss, _)) = rss_kib(&pids) {
                    peak = peak.max(rss);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            peak
        })
    };
    let storm = TcpStorm::read()?;
    let started = Instant::now();
    for _ in 0..n {
        let mut req = Request::new(Full::new(body.clone()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri.clone();
        *req.headers_mut() = headers.clone();
        set.spawn(one_stream(c.clone(), req));
    }
    let mut ttft = Vec::with_capacity(n);
    let mut failed: Vec<&str> = Vec::new();
    let limit = Duration::from_secs_f64(args.mem_wait_secs);
    let all = tokio::time::timeout(limit, async {
        while let Some(r) = set.join_next().await {
            match r {
                Ok(Ok(d)) => ttft.push(d.as_secs_f64() * 1e3),
                Ok(Err(why)) => failed.push(why),
                Err(_) => failed.push("panic"),
            }
        }
    })
    .await
    .is_ok();
    if !all {
        set.abort_all();
    }
    let secs = started.elapsed().as_secs_f64();
    // Counted for the whole machine: the proxy's listener and the backend's (its upstream
    // connects) both; the bursts run one at a time, so each burst's losses are its own.
    let storm = TcpStorm::read()?.since(storm);
    drop(c);
    sampling.store(false, Ordering::Relaxed);
    let peak = sampler.await.unwrap_or(0);
    // The streams have ended and their connections closed: what the process keeps.
    tokio::time::sleep(Duration::from_secs_f64(args.burst_settle_secs)).await;
    let (after, hwm) = rss_kib(pids)?;
    ttft.sort_by(f64::total_cmp);
    // A stream that waited a SYN retransmission (1 s) or more.
    let over_1s = ttft.iter().filter(|&&t| t >= 1000.0).count();
    let mut why = failed.clone();
    why.sort_unstable();
    why.dedup();
    Ok(json!({
        "streams": n,
        "ok": ttft.len(),
        "failed": failed.len(),
        "failed_why": why,
        "secs": secs,
        "ttft_p50_ms": quantile(&ttft, 0.5),
        "ttft_p99_ms": quantile(&ttft, 0.99),
        "ttft_max_ms": ttft.last().copied().unwrap_or(f64::NAN),
        "ttft_over_1s": over_1s,
        "listen_drops": storm.listen_drops,
        "syn_retrans": storm.syn_retrans,
        "rss_peak_kib": peak.max(after),
        "rss_after_kib": after,
        "hwm_kib": hwm,
    }))
}

/// `args.burst_rounds` bursts through each proxy, alternating (fleetgate, nginx, direct,
/// fleetgate, ...): the first of each is cold. Direct bursts go to the backend itself: its own
/// TTFT is the floor under both proxies'. Returns one record per proxy with its idle RSS and its bursts.
pub async fn bursts(
    args: &Args,
    plan: &[(&'static str, String, Vec<u32>)],
    headers: &HeaderMap,
) -> Res<Vec<Value>> {
    let mut out: Vec<Value> = plan
        .iter()
        .map(|(name, _, pids)| {
            let (idle, anon) = rss_anon_kib(pids).unwrap_or((0, 0));
            json!({"via": name, "rss_idle_kib": idle, "rss_idle_anon_kib": anon, "bursts": []})
        })
        .collect();
    for round in 0..args.burst_rounds {
        for (i, (name, base, pids)) in plan.iter().enumerate() {
            let b = burst(args, base, pids, headers).await?;
            eprintln!(
                "hop: burst {} via {name}: {}/{} ok, TTFT p50 {:.1} ms, p99 {:.1} ms, {} at 1 s or more, {} listen drops, {} SYN retransmits, RSS peak {:.1} MiB, after {:.1} MiB",
                round + 1,
                b["ok"],
                b["streams"],
                b["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN),
                b["ttft_p99_ms"].as_f64().unwrap_or(f64::NAN),
                b["ttft_over_1s"],
                b["listen_drops"],
                b["syn_retrans"],
                mib(b["rss_peak_kib"].as_u64().unwrap_or(0)),
                mib(b["rss_after_kib"].as_u64().unwrap_or(0)),
            );
            if let Some(list) = out[i]["bursts"].as_array_mut() {
                list.push(b);
            }
        }
    }
    if args.burst_drain_secs > 0.0 {
        eprintln!(
            "hop: burst: waiting {:.0} s for the idle connections to close",
            args.burst_drain_secs
        );
        tokio::time::sleep(Duration::from_secs_f64(args.burst_drain_secs)).await;
        for (i, (name, _, pids)) in plan.iter().enumerate() {
            let (rss, anon) = rss_anon_kib(pids)?;
            eprintln!(
                "hop: burst: {name} RSS {:.1} MiB {:.0} s after the last burst",
                mib(rss),
                args.burst_drain_secs
            );
            out[i]["rss_drained_kib"] = json!(rss);
            out[i]["rss_drained_anon_kib"] = json!(anon);
        }
    }
    Ok(out)
}
