//! Phase 0, burst: a reconnect storm. Thousands of streams opened at the same moment, each on
//! a new connection, through one proxy; then again, several times, in the same processes. The
//! first burst after the proxies start is the cold one (a rolling update's new replica); the
//! later ones are warm. Per burst: TTFT p50/p99 (each stream from its own send), the resident
//! set at its peak and once its streams have ended. Run first, so the first burst is cold.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use std::net::{SocketAddr, ToSocketAddrs};

use bytes::Bytes;
use http::{HeaderMap, Uri};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use crate::args::Args;
use crate::error::Res;
use crate::memory::mib;
use crate::procfs::{TcpStorm, cpu_secs, rss_anon_kib, rss_kib, self_cpu_secs};
use crate::target::{chat_uri, request_body};

/// One stream of a burst: its time to first token, or why it has none. The client is as
/// plain as the streams allow, so that the burst measures the proxy and not the driver: a
/// socket of its own, the request written ready-made (`Connection: close`), the first token
/// found by a byte search, the rest read to the end (the connection stays busy as a real
/// client's would) and only its last bytes kept, to check that the answer ended with `[DONE]`.
async fn one_stream(
    addr: SocketAddr,
    request: Bytes,
    firsts: Arc<AtomicUsize>,
) -> Result<Duration, &'static str> {
    let sent = Instant::now();
    let mut sock = TcpStream::connect(addr).await.map_err(|_| "connect")?;
    let _ = sock.set_nodelay(true);
    sock.write_all(&request).await.map_err(|_| "send")?;
    let mut buf = [0u8; 4096];
    // Everything read until the first token (a head and two or three events: small), then
    // only the last bytes.
    let mut seen: Vec<u8> = Vec::with_capacity(1024);
    let mut first = None;
    loop {
        let n = sock.read(&mut buf).await.map_err(|_| "cut")?;
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        if first.is_none() {
            if !seen.starts_with(b"HTTP/1.1 200") && seen.len() >= 12 {
                return Err("status");
            }
            // The role chunk's content is empty (`"content":""`); a token's is not.
            let token = seen
                .windows(12)
                .any(|w| w.starts_with(b"\"content\":\"") && w[11] != b'"');
            if token {
                first = Some(sent.elapsed());
                firsts.fetch_add(1, Ordering::Relaxed);
            }
        }
        if first.is_some() && seen.len() > 64 {
            seen.drain(..seen.len() - 64);
        }
    }
    let first = first.ok_or("no token")?;
    if !seen.windows(6).any(|w| w == b"[DONE]") {
        return Err("cut");
    }
    Ok(first)
}

/// The request of every stream of a burst, as it goes on the wire.
fn wire_request(uri: &Uri, headers: &HeaderMap, body: &[u8]) -> Res<(SocketAddr, Bytes)> {
    let authority = uri.authority().ok_or("the burst URL has no host")?;
    let addr = (authority.host(), authority.port_u16().unwrap_or(80))
        .to_socket_addrs()?
        .next()
        .ok_or("the burst URL's host resolves to nothing")?;
    let mut head = format!(
        "POST {} HTTP/1.1\r\nhost: {authority}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        uri.path(),
        body.len()
    );
    // Not `te: trailers`: this client reads no trailer (fleetgate would end the stream with
    // its `Server-Timing` after `[DONE]`).
    for (name, value) in headers
        .iter()
        .filter(|(n, _)| *n != http::header::TE && *n != http::header::CONTENT_TYPE)
    {
        let value = value.to_str().map_err(|_| "a burst header is not text")?;
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let mut wire = head.into_bytes();
    wire.extend_from_slice(body);
    Ok((addr, Bytes::from(wire)))
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
    let (addr, request) = wire_request(&uri, headers, &body)?;
    let n = args.burst_streams;
    let mut set = JoinSet::new();
    let sampling = Arc::new(AtomicBool::new(true));
    let firsts = Arc::new(AtomicUsize::new(0));
    let cpu_at_start = (cpu_secs(pids)?, self_cpu_secs()?);
    // The peak resident set, read every 20 ms while the burst runs, and the CPU the proxy and
    // the driver had spent when the last stream's first token arrived (then the streams only
    // wait for their slow tokens).
    let sampler = {
        let pids = pids.to_vec();
        let sampling = sampling.clone();
        let firsts = firsts.clone();
        tokio::spawn(async move {
            let mut peak = 0;
            let mut cpu = None;
            let mut all_open = None;
            let mut open = 0;
            while sampling.load(Ordering::Relaxed) {
                let rss = rss_kib(&pids).map_or(0, |(rss, _)| rss);
                peak = peak.max(rss);
                if cpu.is_none() && firsts.load(Ordering::Relaxed) >= n {
                    cpu = cpu_secs(&pids).ok().zip(self_cpu_secs().ok());
                    all_open = Some(Instant::now());
                }
                // Once every stream is open and relaying, what they hold (the burst's own
                // transient allocations gone): read 1 s after the last first token.
                if open == 0 && all_open.is_some_and(|t| t.elapsed() >= Duration::from_secs(1)) {
                    open = rss;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (peak, cpu, open)
        })
    };
    let storm = TcpStorm::read()?;
    let started = Instant::now();
    for _ in 0..n {
        set.spawn(one_stream(addr, request.clone(), firsts.clone()));
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
    sampling.store(false, Ordering::Relaxed);
    let (peak, cpu, open) = sampler.await.unwrap_or((0, None, 0));
    // CPU per stream, in µs, to the last first token.
    let per_stream = |secs: f64| secs * 1e6 / n.max(1) as f64;
    let (proxy_cpu_us, driver_cpu_us) = cpu.map_or((f64::NAN, f64::NAN), |(p, d)| {
        (
            per_stream(p - cpu_at_start.0),
            per_stream(d - cpu_at_start.1),
        )
    });
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
        "cpu_per_stream_us": proxy_cpu_us,
        "driver_cpu_per_stream_us": driver_cpu_us,
        "rss_peak_kib": peak.max(after),
        "rss_open_kib": open,
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
                "hop: burst {} via {name}: {}/{} ok, TTFT p50 {:.1} ms, p99 {:.1} ms, CPU per stream {:.0} µs (driver {:.0} µs), {} at 1 s or more, {} listen drops, {} SYN retransmits, RSS peak {:.1} MiB, all open {:.1} MiB, after {:.1} MiB",
                round + 1,
                b["ok"],
                b["streams"],
                b["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN),
                b["ttft_p99_ms"].as_f64().unwrap_or(f64::NAN),
                b["cpu_per_stream_us"].as_f64().unwrap_or(f64::NAN),
                b["driver_cpu_per_stream_us"].as_f64().unwrap_or(f64::NAN),
                b["ttft_over_1s"],
                b["listen_drops"],
                b["syn_retrans"],
                mib(b["rss_peak_kib"].as_u64().unwrap_or(0)),
                mib(b["rss_open_kib"].as_u64().unwrap_or(0)),
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
