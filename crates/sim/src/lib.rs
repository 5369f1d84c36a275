//! `fleetgate sim`: a simulated vLLM server, OpenAI-compatible, for testing and demonstrating
//! the gateway without a GPU.
//!
//! Layout:
//! - `args`: the flags and their validation into `SimConfig`.
//! - `server`: accept loop and the request path (auth → route → parse → fault → generate),
//!   one submodule per kind of route.
//! - `api`: request parsing, error bodies and the non-streaming JSON shapes (and the chat
//!   batch), one submodule per concern.
//! - `pooling`: the pooling routes of `--runner pooling` (embeddings, score, rerank,
//!   classify, pooling) and the sim's pooling model.
//! - `audio`: speech-to-text (`/v1/audio/transcriptions`, `/translations`), multipart in.
//! - `engine`: the continuous-batching model and its scheduler task; the `SeqHandle`
//!   whose drop is the cancellation signal.
//! - `body` / `frames`: the SSE stream, formatted by hand for a cheap per-token path.
//! - `prefix_cache`: vLLM's automatic prefix caching (chained block hashes, LRU).
//! - `kv_events`: vLLM's KV cache events of that cache (`--kv-events-config`), over ZeroMQ.
//! - `lora`: LoRA adapters (`--enable-lora`, `--lora-modules`, loaded at run time) and
//!   `vllm:lora_requests_info`.
//! - `stats`: counters for tests and the `/metrics` text.
//! - `tokens`: deterministic token texts and JSON escaping.
//!
//! Timing: with any non-zero timing flag one scheduler task runs vLLM-style steps (at most
//! `max_num_seqs` running, FIFO waiting, chunked prefill within `max_num_batched_tokens`, one
//! token per running sequence per step). With all timing zero there is no scheduler and no timer:
//! each body makes its frames when polled, and `max_num_seqs` does not apply.

// What only this crate reaches is `pub(crate)`, not `pub` (clippy -D warnings holds it).
#![warn(unreachable_pub)]

mod agents;
mod api;
mod args;
mod audio;
mod body;
mod engine;
mod frames;
pub mod kv_events;
mod lora;
mod model_tokens;
mod pooling;
mod prefix_cache;
mod server;
mod stats;
mod tokens;

#[cfg(test)]
mod tests;

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use tokio::net::TcpSocket;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use args::{Convert, Runner, SchedulingPolicy, SimArgs};
pub use stats::SimStats;

use args::SimConfig;
use engine::Engine;
use server::{Listener, SimContext};

/// A running sim. Dropping it stops it too (without waiting); `shutdown` also waits.
pub struct SimServer {
    addr: SocketAddr,
    stats: Arc<SimStats>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl SimServer {
    /// The bound address (known at once, even during warm-up).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL for clients, e.g. `http://127.0.0.1:8001`; a wildcard bind is reached via
    /// loopback.
    pub fn url(&self) -> String {
        let ip = match self.addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        format!("http://{}", SocketAddr::new(ip, self.addr.port()))
    }

    pub fn stats(&self) -> &Arc<SimStats> {
        &self.stats
    }

    /// Stops accepting, aborts open connections (their streams count as cancelled) and the
    /// scheduler, and waits until all of them are gone.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        for task in std::mem::take(&mut self.tasks) {
            let _ = task.await;
        }
    }
}

impl Drop for SimServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Binds `args.host:args.port` and starts serving; returns once the port is bound. During a
/// warm-up the socket is bound but not listening, so connects are refused with ECONNREFUSED.
pub async fn start(args: SimArgs) -> io::Result<SimServer> {
    let cfg = SimConfig::try_from(&args)?;
    let addr = tokio::net::lookup_host((args.host.as_str(), args.port))
        .await?
        .next()
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("--host {} resolves to no address", args.host),
            )
        })?;
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    let bound = socket.local_addr()?;
    let listener = if cfg.warmup.is_zero() {
        Listener::Listening(socket.listen(server::LISTEN_BACKLOG)?)
    } else {
        Listener::WarmingUp(socket, cfg.warmup)
    };

    // A plausible KV-cache size for the usage gauge: room for a full batch of quarter-length
    // sequences, which like a real deployment is less than max_num_seqs × max_model_len.
    let kv_capacity = u64::from(cfg.max_model_len) * u64::from(cfg.max_num_seqs.div_ceil(4)).max(1);
    // The KV blocks it reports (`vllm:cache_config_info`): the prefix cache's, when it has one.
    let block_size = cfg.block_size.max(1);
    let kv_blocks = if cfg.prefix_caching() {
        cfg.prefix_cache_tokens
    } else {
        kv_capacity
    } / u64::from(block_size);
    let stats = Arc::new(SimStats::new(
        cfg.capture,
        kv_capacity,
        u64::from(cfg.max_model_len),
        (block_size, kv_blocks),
        cfg.lora.as_ref().map(|l| l.max_loras),
    ));
    let cancel = CancellationToken::new();
    let mut kv_task = None;
    let kv_events = match cfg.kv_events.clone() {
        Some(settings) => {
            let (publisher, task) =
                kv_events::start(settings, cfg.block_size, cancel.clone()).await?;
            kv_task = Some(task);
            Some(publisher)
        }
        None => None,
    };
    let (engine, scheduler) = Engine::spawn(&cfg, stats.clone(), cancel.clone(), kv_events);
    let ctx = Arc::new(SimContext::new(cfg, stats.clone(), engine));
    let mut tasks = vec![tokio::spawn(server::serve(listener, ctx, cancel.clone()))];
    tasks.extend(scheduler);
    tasks.extend(kv_task);
    Ok(SimServer {
        addr: bound,
        stats,
        cancel,
        tasks,
    })
}

/// CLI entry: start, log the URL, serve until Ctrl-C or SIGTERM.
pub async fn run(args: SimArgs) -> io::Result<()> {
    let warmup = args.warmup_secs;
    let server = start(args).await?;
    if warmup > 0.0 {
        tracing::info!(
            url = %server.url(),
            warmup_secs = warmup,
            "simulated vLLM server bound; refusing connections until warm-up ends"
        );
    } else {
        tracing::info!(url = %server.url(), "simulated vLLM server listening");
    }
    shutdown_signal().await?;
    tracing::info!("simulated vLLM server shutting down");
    server.shutdown().await;
    Ok(())
}

async fn shutdown_signal() -> io::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await
    }
}
