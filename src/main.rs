//! The `fleetgate` command line: serve, sim, demo, check-config.

use std::path::PathBuf;
use std::process::ExitCode;

#[cfg(feature = "tools")]
mod demo;
mod keys_cli;

use clap::{Parser, Subcommand};
use fleetgate_gateway::config::{Config, LogFormat};
use fleetgate_gateway::server::Server;

/// Exit codes, shown by `fleetgate --help` (the README has the same table).
const EXIT_CODES: &str = "Exit codes:
  0    done (also when the reader of the output stopped reading, e.g. `| head -1`)
  1    the command failed: the message on stderr says why (store unreachable, unknown key,
       a revoked key rotated, a server that could not start, no bench request succeeded, ...)
  2    bench: an --sla objective was violated
  3    bench: the --compare verdict failed (a line shown slower, or a side failed requests;
       3 wins over 2 when both)
  64   bad command line or invalid config (the field and what to write instead)
  74   stdout could not be written (a full disk, ...)
  130  bench: interrupted by Ctrl-C (what finished is printed and saved)

Try: fleetgate demo";

#[derive(Parser)]
#[command(
    name = "fleetgate",
    version,
    about = "Authenticating gateway for fleets of OpenAI-compatible inference servers",
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    #[command(after_help = "Examples:\n  fleetgate serve --config config/fleetgate.toml")]
    Serve {
        #[arg(long, short, default_value = "config/fleetgate.toml")]
        config: PathBuf,
    },
    #[cfg(feature = "tools")]
    /// Run a simulated vLLM server (OpenAI-compatible, continuous-batching timing model).
    #[command(
        after_help = "Examples:\n  fleetgate sim --port 8001\n  fleetgate sim --port 8002 --zero-delay          # pure hop-cost measurements\n  fleetgate sim --port 8003 --fail-rate 0.1       # fault injection"
    )]
    Sim(fleetgate_sim::SimArgs),
    #[cfg(feature = "tools")]
    /// Two simulated backends behind the gateway, in one process: TTFT direct vs through it.
    #[command(
        after_help = "Examples:\n  fleetgate demo                  # serves on 127.0.0.1:8080 until Ctrl-C, prints the next steps\n  fleetgate demo --no-wait        # print the TTFT table and exit"
    )]
    Demo(demo::DemoArgs),
    /// Manage API keys in the key store.
    #[command(
        after_help = "Examples:\n  fleetgate keys create --env prod --name 'chat frontend' --models qwen32b --expires 90d\n  fleetgate keys list --env prod --sqlite fleetgate.db\n  fleetgate keys revoke ID --reason 'leaked in CI log'"
    )]
    Keys(keys_cli::KeysArgs),
    /// Requests, errors, tokens and TTFT/overhead percentiles from the request log.
    #[command(
        after_help = "Examples:\n  fleetgate usage --env prod --since 24h --by key\n  fleetgate usage --month 2026-11 --by model --json"
    )]
    Usage(keys_cli::UsageArgs),
    /// Apply pending database migrations.
    #[command(
        after_help = "Examples:\n  fleetgate migrate --config config/fleetgate.toml\n  fleetgate migrate --database-url postgres://fleetgate@db/fleetgate"
    )]
    Migrate(keys_cli::StoreArgs),
    /// Mint an admin API token from the configured HS256 secret.
    #[command(
        after_help = "Examples:\n  fleetgate admin-token --role viewer --ttl 8h\n  curl -H \"Authorization: Bearer $(fleetgate admin-token)\" http://127.0.0.1:8081/admin/backends"
    )]
    AdminToken(keys_cli::AdminTokenArgs),
    /// Print a one-time sign-in link to the console (the admin listener's web pages).
    #[command(
        after_help = "Examples:\n  fleetgate console-login --ttl 8h\n  fleetgate console-login --role viewer --ttl 1h --sub alice\n  fleetgate console-login --url https://gateway-admin.example.com   # behind a TLS proxy\n(docs/console.md)"
    )]
    ConsoleLogin(keys_cli::ConsoleLoginArgs),
    #[cfg(feature = "tools")]
    /// Load generator compatible with `vllm bench serve`; `--compare direct=URL gateway=URL`
    /// measures the gateway's cost against direct calls in one interleaved run.
    #[command(
        after_help = "Examples:\n  fleetgate bench --base-url http://127.0.0.1:8080 --api-key-env FLEETGATE_API_KEY --num-prompts 100 --request-rate 10 --random-input-len 256 --random-output-len 32\n  fleetgate bench --compare direct=http://127.0.0.1:8001,http://127.0.0.1:8002 gateway=http://127.0.0.1:8080 --api-key-env FLEETGATE_API_KEY --num-prompts 120 --request-rate 20 --random-input-len 64 --random-output-len 16 --sla ttft_p99_ms=1500\n  vllm bench serve's own flags run as written: --backend vllm --base_url http://127.0.0.1:8080 --endpoint-type openai-chat --endpoint /v1/chat/completions ...\n  fleetgate bench diff yesterday.json today.json\n(the examples run on the README's two sims and gateway; docs/bench.md has every flag; a comparison is judged only over the prompts both sides answered, and fails when a side failed any)"
    )]
    Bench(Box<fleetgate_bench::BenchArgs>),
    /// GET a URL and exit 0 on a 2xx answer, 1 otherwise: a container health check without
    /// curl (e.g. `fleetgate probe http://127.0.0.1:8080/readyz`).
    #[command(
        after_help = "Examples:\n  fleetgate probe http://127.0.0.1:8080/readyz --timeout-seconds 1"
    )]
    Probe {
        url: String,
        #[arg(long, default_value_t = 2.0)]
        timeout_seconds: f64,
    },
    /// Check a config file and print what it configures.
    #[command(
        after_help = "Examples:\n  fleetgate check-config --config config/fleetgate.toml   # exit 64 naming the field on error"
    )]
    CheckConfig {
        #[arg(long, short, default_value = "config/fleetgate.toml")]
        config: PathBuf,
    },
}

/// EX_USAGE: a bad config or command line.
const EXIT_CONFIG: u8 = 64;

fn init_logging(format: LogFormat) {
    init_logging_default(format, "info");
}

fn init_logging_default(format: LogFormat, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colour only on a terminal: a log file, a pipe or `kubectl logs` gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()));
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => builder.init(),
    }
}

/// The store flags (`--config FILE`, `--sqlite FILE`, `--database-url URL`, also as
/// `--flag=value`) written before the subcommand move to just after it, where every command
/// that reads the store takes them: `fleetgate --config F keys list` is `fleetgate keys --config
/// F list`. Everything else stays where it is.
fn store_flags_after_subcommand(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    const WITH_VALUE: [&str; 4] = ["--config", "-c", "--sqlite", "--database-url"];
    let mut moved = Vec::new();
    let mut rest = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    rest.extend(it.next()); // the program's name
    while let Some(a) = it.next() {
        let text = a.to_str().unwrap_or_default();
        let name = text.split_once('=').map_or(text, |(n, _)| n);
        if WITH_VALUE.contains(&name) {
            let joined = name.len() < text.len();
            moved.push(a);
            if !joined {
                moved.extend(it.next());
            }
            continue;
        }
        let is_subcommand = !text.starts_with('-');
        rest.push(a);
        if is_subcommand {
            rest.append(&mut moved);
            rest.extend(it);
            return rest;
        }
    }
    // No subcommand: leave the flags where they were, for clap to name the problem.
    rest.extend(moved);
    rest
}

/// `fleetgate bench` takes every `vllm bench serve` flag (`fleetgate_bench::vllm_flags`).
#[cfg(feature = "tools")]
fn tool_flags(mut args: Vec<std::ffi::OsString>) -> Result<Vec<std::ffi::OsString>, ExitCode> {
    if args.get(1).is_some_and(|a| a == "bench") {
        let (rest, warnings) = fleetgate_bench::vllm_flags::normalize(args.split_off(2));
        args.extend(rest);
        for w in warnings {
            eprintln!("fleetgate bench: warning: {w}");
        }
    }
    Ok(args)
}

/// A build without the tools (the container image's) says so for their commands, rather than
/// clap's "unrecognized subcommand".
#[cfg(not(feature = "tools"))]
fn tool_flags(args: Vec<std::ffi::OsString>) -> Result<Vec<std::ffi::OsString>, ExitCode> {
    match args.get(1).and_then(|a| a.to_str()) {
        Some(tool @ ("sim" | "bench" | "demo")) => {
            eprintln!(
                "fleetgate: `{tool}` is not in this build: it was built without the `tools` feature, as the container image is (the gateway alone); run `fleetgate {tool}` from a default build (`cargo build --release`)"
            );
            Err(ExitCode::from(EXIT_CONFIG))
        }
        _ => Ok(args),
    }
}

/// jemalloc, with background threads that return freed pages to the system a few seconds
/// after a burst (glibc's malloc kept a burst's peak resident for good: docs/benchmarks.md,
/// "Bursts").
#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Hands the calling thread's jemalloc cache back to the arenas, from where its pages return
/// to the system with the decay (run by a parking runtime thread: `server::allocator`). Disabling
/// the thread's cache flushes it (jemalloc's `thread.tcache.enabled`, which unlike
/// `thread.tcache.flush` takes a value and so has a safe call); enabling it again starts an
/// empty one.
#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
fn release_thread_cache() {
    use tikv_jemalloc_ctl::{Access, AsName, Mib};
    static TCACHE_ENABLED: std::sync::OnceLock<Option<Mib<[usize; 3]>>> =
        std::sync::OnceLock::new();
    let Some(mib) = TCACHE_ENABLED.get_or_init(|| b"thread.tcache.enabled\0".name().mib().ok())
    else {
        return;
    };
    if mib.write(false).is_ok() {
        let _ = mib.write(true);
    }
}

fn main() -> ExitCode {
    // A bad command line exits 64 (EX_USAGE), not clap's 2: 2 is bench's "SLA violated".
    let args = store_flags_after_subcommand(std::env::args_os().collect());
    let args = match tool_flags(args) {
        Ok(args) => args,
        Err(code) => return code,
    };
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_CONFIG } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    #[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
    fleetgate_gateway::server::allocator::set_release(release_thread_cache);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_park(fleetgate_gateway::server::allocator::parked)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fleetgate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(cli))
}

async fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Serve { config: path } => {
            let config = match Config::load(&path) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("fleetgate: invalid config: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            init_logging(config.server.log_format);
            serve(config, path).await
        }
        #[cfg(feature = "tools")]
        Command::Sim(args) => {
            init_logging(LogFormat::Text);
            match fleetgate_sim::run(args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("fleetgate sim: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        #[cfg(feature = "tools")]
        Command::Demo(args) => {
            // The demo prints its own table; logs only for warnings unless RUST_LOG says more.
            init_logging_default(LogFormat::Text, "warn");
            match demo::run(args, wait_for_signal()).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("fleetgate demo: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        #[cfg(feature = "tools")]
        Command::Bench(args) => {
            init_logging_default(LogFormat::Text, "warn");
            // Ctrl-C stops sending and prints what was measured so far.
            let stop = tokio_util::sync::CancellationToken::new();
            let on_signal = stop.clone();
            tokio::spawn(async move {
                wait_for_signal().await;
                on_signal.cancel();
            });
            ExitCode::from(fleetgate_bench::run(*args, stop).await)
        }
        Command::Probe {
            url,
            timeout_seconds,
        } => report(probe(&url, timeout_seconds).await),
        Command::Keys(args) => report(keys_cli::run_keys(args).await),
        Command::Usage(args) => report(keys_cli::run_usage(args).await),
        Command::Migrate(args) => report(keys_cli::run_migrate(args).await),
        Command::AdminToken(args) => report(keys_cli::run_admin_token(args)),
        Command::ConsoleLogin(args) => report(keys_cli::run_console_login(args)),
        Command::CheckConfig { config } => match Config::load(&config) {
            Ok(c) => {
                // Written with errors ignored: `check-config | head -1` must not panic.
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{}: ok", config.display());
                let _ = writeln!(
                    out,
                    "listen {} (tls: {})",
                    c.server.listen,
                    c.server.tls.is_some()
                );
                let _ = writeln!(out, "store {}", c.database.describe());
                // Where the environment's OTEL_* variables lead too: they win over the file.
                let _ = match &c.tracing.export {
                    Some(e) => writeln!(
                        out,
                        "tracing: OTLP/HTTP to {} (sampler {:?}, service {})",
                        e.endpoint,
                        e.sampler,
                        e.service_name_env.as_deref().unwrap_or(&e.service_name)
                    ),
                    None => writeln!(out, "tracing: off"),
                };
                for p in &c.pools {
                    let backends: Vec<String> = p
                        .backends
                        .iter()
                        .map(|b| match b.discover {
                            fleetgate_gateway::config::Discover::Static => b.url.to_string(),
                            fleetgate_gateway::config::Discover::Dns { interval } => format!(
                                "{} (every address, re-resolved every {:.1} s)",
                                b.url,
                                interval.as_secs_f64()
                            ),
                        })
                        .collect();
                    let _ = writeln!(
                        out,
                        "model {} -> {}{}{}",
                        p.model,
                        backends.join(", "),
                        p.served_model_name
                            .as_ref()
                            .map(|n| format!(" (served as {n})"))
                            .unwrap_or_default(),
                        match p.kind {
                            fleetgate_gateway::config::PoolKind::Generate => String::new(),
                            kind => format!(" [{} model]", kind.as_str()),
                        }
                    );
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("fleetgate: invalid config: {e}");
                ExitCode::from(EXIT_CONFIG)
            }
        },
    }
}

async fn probe(url: &str, timeout_seconds: f64) -> Result<(), String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("probe: `{url}`: {e}"))?;
    let req = http::Request::get(uri)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .map_err(|e| format!("probe: {e}"))?;
    let client = fleetgate_protocol::client::http_client();
    let limit = std::time::Duration::from_secs_f64(timeout_seconds.max(0.001));
    match tokio::time::timeout(limit, client.request(req)).await {
        Ok(Ok(r)) if r.status().is_success() => Ok(()),
        Ok(Ok(r)) => Err(format!("probe: {url} answered {}", r.status())),
        Ok(Err(e)) => Err(format!("probe: {url}: {e}")),
        Err(_) => Err(format!(
            "probe: {url}: no answer within {timeout_seconds} s"
        )),
    }
}

fn report(r: Result<(), String>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fleetgate: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config, path: std::path::PathBuf) -> ExitCode {
    let server = match Server::start(&config).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            return ExitCode::FAILURE;
        }
    };
    tracing::info!(url = %server.base_url(), pools = config.pools.len(), "fleetgate listening");
    // SIGHUP (and, with server.watch_config, a changed file) reloads [[pools]].
    let stop_reloads = tokio_util::sync::CancellationToken::new();
    let reloads =
        fleetgate_gateway::server::reload::run(&server, path, config, stop_reloads.clone());
    tokio::select! {
        () = wait_for_signal() => {}
        () = reloads => {}
    }
    stop_reloads.cancel();
    tracing::info!("shutdown requested");
    server.shutdown().await;
    ExitCode::SUCCESS
}

/// SIGINT (Ctrl-C) or SIGTERM.
pub async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
