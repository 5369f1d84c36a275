//! The `fleetgate` command line: serve, sim, demo, check-config.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fleetgate::config::{Config, LogFormat};
use fleetgate::server::Server;

#[derive(Parser)]
#[command(
    name = "fleetgate",
    version,
    about = "Authenticating gateway for fleets of OpenAI-compatible inference servers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        #[arg(long, short, default_value = "config/fleetgate.toml")]
        config: PathBuf,
    },
    /// Run a simulated vLLM server (OpenAI-compatible, continuous-batching timing model).
    Sim(fleetgate::sim::SimArgs),
    /// Two simulated backends and the gateway in one process; compares TTFT direct vs via.
    Demo(fleetgate::demo::DemoArgs),
    /// Manage API keys in the key store.
    Keys(fleetgate::keys_cli::KeysArgs),
    /// Requests, errors, tokens and TTFT/overhead percentiles from the request log.
    Usage(fleetgate::keys_cli::UsageArgs),
    /// Apply pending database migrations.
    Migrate(fleetgate::keys_cli::StoreArgs),
    /// Mint an admin API token from the configured HS256 secret.
    AdminToken(fleetgate::keys_cli::AdminTokenArgs),
    /// Load generator compatible with `vllm bench serve`; `--compare direct=URL gateway=URL`
    /// measures the gateway's cost against direct calls in one interleaved run.
    Bench(Box<fleetgate::bench::BenchArgs>),
    /// GET a URL and exit 0 on a 2xx answer, 1 otherwise: a container health check without
    /// curl (e.g. `fleetgate probe http://127.0.0.1:8080/readyz`).
    Probe {
        url: String,
        #[arg(long, default_value_t = 2.0)]
        timeout_seconds: f64,
    },
    /// Check a config file and print what it configures.
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
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => builder.init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
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
        Command::Sim(args) => {
            init_logging(LogFormat::Text);
            match fleetgate::sim::run(args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("fleetgate sim: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Demo(args) => {
            // The demo prints its own table; logs only for warnings unless RUST_LOG says more.
            init_logging_default(LogFormat::Text, "warn");
            match fleetgate::demo::run(args, wait_for_signal()).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("fleetgate demo: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Bench(args) => {
            init_logging_default(LogFormat::Text, "warn");
            // Ctrl-C stops sending and prints what was measured so far.
            let stop = tokio_util::sync::CancellationToken::new();
            let on_signal = stop.clone();
            tokio::spawn(async move {
                wait_for_signal().await;
                on_signal.cancel();
            });
            ExitCode::from(fleetgate::bench::run(*args, stop).await)
        }
        Command::Probe {
            url,
            timeout_seconds,
        } => report(probe(&url, timeout_seconds).await),
        Command::Keys(args) => report(fleetgate::keys_cli::run_keys(args).await),
        Command::Usage(args) => report(fleetgate::keys_cli::run_usage(args).await),
        Command::Migrate(args) => report(fleetgate::keys_cli::run_migrate(args).await),
        Command::AdminToken(args) => report(fleetgate::keys_cli::run_admin_token(args)),
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
                for p in &c.pools {
                    let backends: Vec<String> = p
                        .backends
                        .iter()
                        .map(|b| match b.discover {
                            fleetgate::config::Discover::Static => b.url.to_string(),
                            fleetgate::config::Discover::Dns { interval } => format!(
                                "{} (every address, re-resolved every {:.1} s)",
                                b.url,
                                interval.as_secs_f64()
                            ),
                        })
                        .collect();
                    let _ = writeln!(
                        out,
                        "model {} -> {}{}",
                        p.model,
                        backends.join(", "),
                        p.served_model_name
                            .as_ref()
                            .map(|n| format!(" (served as {n})"))
                            .unwrap_or_default()
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
    let client = fleetgate::client::http_client();
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
    let reloads = fleetgate::server::reload::run(&server, path, config, stop_reloads.clone());
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
