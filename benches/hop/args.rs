//! The benchmark's command-line flags: the three targets, the request, each phase's settings,
//! the pids whose CPU and memory are read, and where the report goes.

use std::path::PathBuf;

use clap::Parser;

use crate::target::Protocol;

#[derive(Parser, Debug)]
#[command(
    name = "hop",
    about = "Hop cost of fleetgate vs direct calls, beside nginx"
)]
pub struct Args {
    /// Base URL of the backend itself, e.g. http://127.0.0.1:8001.
    #[arg(long)]
    pub direct: String,
    /// Base URL of fleetgate in front of that backend.
    #[arg(long)]
    pub fleetgate: String,
    /// Base URL of nginx in front of that backend.
    #[arg(long)]
    pub nginx: String,
    /// Model name sent in every request of phases 1 and 2.
    #[arg(long, default_value = "qwen32b")]
    pub model: String,
    /// Completion tokens per request (the sim answers exactly this many content chunks).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Streams without `stream_options.include_usage`: fleetgate then asks for usage upstream
    /// and removes the usage chunk (the relay's other path).
    #[arg(long)]
    pub no_include_usage: bool,
    /// The protocol of phases 1 and 2: chat (/v1/chat/completions), responses (OpenAI's
    /// Responses API, /v1/responses) or messages (Anthropic's, /v1/messages). Phase 3 streams
    /// chat.
    #[arg(long, value_enum, default_value = "chat")]
    pub protocol: Protocol,
    /// Sent as `Authorization: Bearer <key>` when given.
    #[arg(long, env = "FLEETGATE_BENCH_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Phases to run, comma-separated: latency, openloop, memory.
    #[arg(long, value_delimiter = ',', default_value = "latency,openloop,memory")]
    pub phases: Vec<String>,

    /// Phase 1: measured rounds (one request per target each).
    #[arg(long, default_value_t = 2000)]
    pub rounds: usize,
    /// Phase 1: warm-up rounds, not measured.
    #[arg(long, default_value_t = 200)]
    pub warmup_rounds: usize,

    /// Phase 2: arrivals per second (constant rate).
    #[arg(long, default_value_t = 400.0)]
    pub rate: f64,
    /// Phase 2: seconds per slice.
    #[arg(long, default_value_t = 5.0)]
    pub slice_secs: f64,
    /// Phase 2: how many times the direct → fleetgate → nginx rotation runs.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Phase 2: longest wait for a slice's requests to finish after the last was sent.
    #[arg(long, default_value_t = 30.0)]
    pub drain_secs: f64,

    /// Pid of the fleetgate process (CPU and memory).
    #[arg(long)]
    pub gateway_pid: Option<u32>,
    /// Pids of the nginx worker processes (CPU and memory), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub nginx_pids: Vec<u32>,
    /// Pid of the backend sim serving phases 1 and 2 (CPU).
    #[arg(long)]
    pub sim_pid: Option<u32>,

    /// Phase 3: base URL of fleetgate routing `--mem-model` to a slow backend.
    #[arg(long)]
    pub mem_fleetgate: Option<String>,
    /// Phase 3: base URL of nginx in front of that slow backend.
    #[arg(long)]
    pub mem_nginx: Option<String>,
    /// Phase 3: model name of the slow backend.
    #[arg(long, default_value = "slow")]
    pub mem_model: String,
    /// Phase 3: streams held open at once.
    #[arg(long, default_value_t = 5000)]
    pub mem_streams: usize,
    /// Phase 3: completion tokens per stream (long enough to outlast the phase).
    #[arg(long, default_value_t = 30000)]
    pub mem_max_tokens: u32,
    /// Phase 3: requests waiting for their response head at any one time while opening.
    #[arg(long, default_value_t = 256)]
    pub mem_open_concurrency: usize,
    /// Phase 3: longest wait for all streams to open (and again for their first token).
    #[arg(long, default_value_t = 90.0)]
    pub mem_wait_secs: f64,

    /// Phase 0 (burst): streams opened at once, each on a new connection, per burst.
    #[arg(long, default_value_t = 5000)]
    pub burst_streams: usize,
    /// Phase 0: bursts through each proxy (the first cold, the others warm).
    #[arg(long, default_value_t = 5)]
    pub burst_rounds: usize,
    /// Phase 0: how long after a burst's streams have ended its "RSS after" is read (an
    /// allocator that returns memory with a decay needs seconds).
    #[arg(long, default_value_t = 2.0)]
    pub burst_settle_secs: f64,
    /// Phase 0: after the last burst, how long to wait before reading each process's RSS once
    /// more (0: not read). Past the gateway's upstream idle timeout (4 s) and jemalloc's
    /// decay (10 s), its idle backend connections have closed and freed pages gone back: what
    /// is left is what the process keeps.
    #[arg(long, default_value_t = 0.0)]
    pub burst_drain_secs: f64,
    /// Phase 0: completion tokens per stream (the burst sim: one per decode step).
    #[arg(long, default_value_t = 20)]
    pub burst_max_tokens: u32,
    /// Phase 0: the model the bursts ask for (the burst sim's; default `--mem-model`).
    #[arg(long)]
    pub burst_model: Option<String>,
    /// Phase 0: base URL of nginx in front of the burst sim (default `--mem-nginx`).
    #[arg(long)]
    pub burst_nginx: Option<String>,
    /// Phase 0: base URL of the burst sim itself, burst directly too: the backend's own floor.
    #[arg(long)]
    pub burst_direct: Option<String>,
    /// Phase 0: pid of the burst sim (its RSS is reported with the direct bursts).
    #[arg(long)]
    pub burst_sim_pid: Option<u32>,

    /// Driver runtime threads: 1 runs a current-thread runtime (lowest latency at concurrency 1).
    #[arg(long, default_value_t = 1)]
    pub driver_threads: usize,
    /// Names the run in the markdown heading (e.g. which sim answers).
    #[arg(long, default_value = "")]
    pub label: String,
    /// Leave the targets table out (for passes the targets are not defined on).
    #[arg(long)]
    pub no_targets: bool,
    /// Where to write the JSON with every figure.
    #[arg(long, default_value = "bench-out/hop.json")]
    pub out: PathBuf,

    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    pub bench: bool,
}
