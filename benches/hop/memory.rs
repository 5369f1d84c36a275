//! Phase 3, memory: thousands of slow streams held open through one proxy, and the resident
//! set of its processes before, while they relay tokens, and after they close.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fleetgate_protocol::client::{self, HttpClient};
use fleetgate_protocol::event::DataKind;
use fleetgate_protocol::sse::SseScanner;
use http::{HeaderMap, Method, Request};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

use crate::args::Args;
use crate::error::Res;
use crate::procfs::rss_kib;
use crate::target::{chat_uri, request_body};

#[derive(Default)]
struct MemCounters {
    heads: AtomicUsize,
    first_tokens: AtomicUsize,
    failed: AtomicUsize,
    ended_early: AtomicUsize,
}

/// One long stream: wait for a slot to open it, hold it open reading every frame, and close it
/// (drop the body, which closes the connection) when told to stop.
async fn hold_stream(
    c: HttpClient,
    req: Request<Full<Bytes>>,
    open_slots: Arc<Semaphore>,
    counters: Arc<MemCounters>,
    mut stop: watch::Receiver<bool>,
) {
    let Ok(permit) = open_slots.acquire_owned().await else {
        return;
    };
    let resp = tokio::select! {
        r = c.request(req) => r,
        _ = stop.changed() => return,
    };
    drop(permit);
    let resp = match resp {
        Ok(r) if r.status() == http::StatusCode::OK => r,
        _ => {
            counters.failed.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    counters.heads.fetch_add(1, Ordering::Relaxed);
    let mut body = resp.into_body();
    let mut scanner = SseScanner::new();
    let mut first = false;
    loop {
        tokio::select! {
            f = body.frame() => match f {
                Some(Ok(frame)) => {
                    if !first && let Some(data) = frame.data_ref() {
                        scanner.feed(data, |l| first |= l.kind == DataKind::Content);
                        if first {
                            counters.first_tokens.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                _ => {
                    counters.ended_early.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            },
            _ = stop.changed() => return,
        }
    }
}

/// Waits (bounded) until `done()` holds, polling every 50 ms.
async fn wait_until(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    true
}

pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

pub async fn mem_one(
    args: &Args,
    name: &'static str,
    base: &str,
    pids: &[u32],
    headers: &HeaderMap,
) -> Res<Value> {
    let uri = chat_uri(base)?;
    let body = request_body(&args.mem_model, args.mem_max_tokens, !args.no_include_usage);
    let c = client::http_client();
    let n = args.mem_streams;
    let (rss_before, hwm_before) = rss_kib(pids)?;
    let counters = Arc::new(MemCounters::default());
    let open_slots = Arc::new(Semaphore::new(args.mem_open_concurrency.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut set = JoinSet::new();
    let opening = Instant::now();
    for _ in 0..n {
        let mut req = Request::new(Full::new(body.clone()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri.clone();
        *req.headers_mut() = headers.clone();
        set.spawn(hold_stream(
            c.clone(),
            req,
            open_slots.clone(),
            counters.clone(),
            stop_rx.clone(),
        ));
    }
    let wait = Duration::from_secs_f64(args.mem_wait_secs);
    let all_answered = wait_until(opening + wait, || {
        counters.heads.load(Ordering::Relaxed) + counters.failed.load(Ordering::Relaxed) >= n
    })
    .await;
    let open_secs = opening.elapsed().as_secs_f64();
    let heads = counters.heads.load(Ordering::Relaxed);
    // Then every open stream relaying tokens: the steady state whose memory counts.
    let all_first = wait_until(Instant::now() + wait, || {
        counters.first_tokens.load(Ordering::Relaxed)
            >= heads.saturating_sub(counters.ended_early.load(Ordering::Relaxed))
    })
    .await;
    let mut rss_open = 0;
    for _ in 0..10 {
        rss_open = rss_open.max(rss_kib(pids)?.0);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, hwm_open) = rss_kib(pids)?;
    let open_now = heads.saturating_sub(counters.ended_early.load(Ordering::Relaxed));
    let _ = stop_tx.send(true);
    let closing = Instant::now();
    let all_closed = tokio::time::timeout(Duration::from_secs(30), async {
        while set.join_next().await.is_some() {}
    })
    .await
    .is_ok();
    if !all_closed {
        set.abort_all();
        while set.join_next().await.is_some() {}
    }
    let close_secs = closing.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (rss_after, hwm_after) = rss_kib(pids)?;
    let per_stream_kib = rss_open.saturating_sub(rss_before) as f64 / open_now.max(1) as f64;
    eprintln!(
        "hop: memory via {name}: {open_now}/{n} streams open, RSS {:.1} -> {:.1} MiB, HWM {:.1} MiB",
        mib(rss_before),
        mib(rss_open),
        mib(hwm_open)
    );
    Ok(json!({
        "via": name,
        "pids": pids,
        "streams_requested": n,
        "heads": heads,
        "failed": counters.failed.load(Ordering::Relaxed),
        "ended_early": counters.ended_early.load(Ordering::Relaxed),
        "first_tokens": counters.first_tokens.load(Ordering::Relaxed),
        "open_at_reading": open_now,
        "all_answered_in_time": all_answered,
        "all_first_tokens_in_time": all_first,
        "open_secs": open_secs,
        "close_secs": close_secs,
        "rss_before_kib": rss_before,
        "hwm_before_kib": hwm_before,
        "rss_open_kib": rss_open,
        "hwm_open_kib": hwm_open,
        "rss_after_close_kib": rss_after,
        "hwm_after_close_kib": hwm_after,
        "rss_per_stream_kib": per_stream_kib,
    }))
}
