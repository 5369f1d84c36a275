//! `fleetgate demo`: two simulated backends and the gateway in one process, a handful of
//! streamed chats sent directly and through the gateway (interleaved), a small table of what
//! the hop cost, then the gateway keeps serving with everything needed to try it by hand.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use fleetgate_protocol::outln;
use http::{HeaderMap, HeaderValue, Uri};
use tokio::net::TcpListener;

use fleetgate_gateway::auth::Authenticator;
use fleetgate_gateway::config::{Config, PoolConfig, PoolKind, ServerConfig};
use fleetgate_gateway::key::{Environment, KeyRecord};
use fleetgate_gateway::server::Server;
use fleetgate_gateway::store::CreateKey;
use fleetgate_gateway::telemetry::Recorder;
use fleetgate_protocol::client::{self, HttpClient, Measured};
use fleetgate_sim::{SimArgs, SimServer};

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Gateway port (a free one is taken if it is busy).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Streamed chats per path (direct and via the gateway).
    #[arg(long, default_value_t = 8)]
    pub requests: usize,
    /// Tokens per answer.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// Print the table and exit instead of serving until Ctrl-C.
    #[arg(long)]
    pub no_wait: bool,
}

const MODEL: &str = "qwen32b";
/// The embedding model of the demo's second pool, behind the same key.
const EMBED_MODEL: &str = "embed";

pub async fn run(
    args: DemoArgs,
    until: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let sims = [
        fleetgate_sim::start(demo_sim_args(1)).await?,
        fleetgate_sim::start(demo_sim_args(2)).await?,
    ];
    let embed = fleetgate_sim::start(embed_sim_args()).await?;
    let listener = bind(args.port).await?;
    let data_dir = std::env::temp_dir().join(format!("fleetgate-demo-{}", std::process::id()));
    let mut config = demo_config(&listener, &sims, &embed, &data_dir)?;
    // The console on the admin listener (8081 beside a gateway on 8080, else a free port), with
    // a secret made for this run: the demo prints a sign-in link.
    let admin_port = match args.port {
        0 => 0,
        _ if std::net::TcpListener::bind(("127.0.0.1", 8081)).is_ok() => 8081,
        _ => 0,
    };
    config.admin.listen = Some(SocketAddr::from(([127, 0, 0, 1], admin_port)));
    let secret: [u8; 24] = rand::random();
    let secret: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    config.admin.jwt_key = Some(fleetgate_gateway::config::JwtKey::Secret(
        fleetgate_gateway::secret::Secret::new(secret.clone()),
    ));
    let server = Server::start_on(listener, &config, Recorder::new(false))
        .await
        .map_err(std::io::Error::other)?;
    // The demo's settings, its admin secret among them, beside its store: `console-login` and
    // `keys` read them from there, so a used or expired console link can be had anew.
    let config_file = data_dir.join("fleetgate.toml");
    write_demo_config(&config_file, &server, &sims, &embed, &secret)?;
    let gateway = server.base_url();
    let (demo_key, record) = issue_demo_key(&server.auth).await?;

    outln!(
        "fleetgate demo: 2 simulated vLLM backends, 1 simulated embedding server + the gateway, one process\n"
    );
    let c = client::http_client();
    let headers = bearer(&demo_key)?;
    let body = chat_body(args.max_tokens);
    let via: Uri = format!("{gateway}/v1/chat/completions")
        .parse()
        .map_err(std::io::Error::other)?;
    warm_up(&c, &sims, &via, &headers, &body).await?;
    let diffs = compare(&c, &sims, &via, &headers, &body, args.requests).await?;
    print_median(diffs);
    let console = match server.admin_addr {
        Some(admin) => {
            let token = fleetgate_gateway::admin::console::session::mint_login(
                &config.admin,
                fleetgate_gateway::admin::jwt::Role::Admin,
                "demo",
                Duration::from_secs(8 * 3600),
            )
            .map_err(std::io::Error::other)?;
            Some(format!("http://{admin}/console/login?token={token}"))
        }
        None => None,
    };
    print_try_it(
        &gateway,
        &sims,
        &embed,
        &config.database.sqlite_path,
        &demo_key,
        &record.public_id,
        console.as_deref().map(|link| (link, config_file.as_path())),
    );

    if !args.no_wait {
        outln!("\nServing until Ctrl-C.");
        until.await;
    }
    server.shutdown().await;
    for s in sims {
        s.shutdown().await;
    }
    embed.shutdown().await;
    let codex_home = demo_codex_home(&data_dir.join("fleetgate.db"));
    if !codex_home.starts_with(&data_dir)
        && let Some(per_demo) = codex_home.parent()
    {
        let _ = std::fs::remove_dir_all(per_demo);
    }
    let _ = std::fs::remove_dir_all(&data_dir);
    Ok(())
}

/// The gateway's listener: on `port`, or on a free port when it is busy.
async fn bind(port: u16) -> std::io::Result<TcpListener> {
    match TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await {
        Ok(l) => Ok(l),
        Err(e) => {
            outln!("port {port} is busy ({e}); using a free port instead");
            TcpListener::bind("127.0.0.1:0").await
        }
    }
}

/// A chat pool over the simulated backends and an embeddings pool over the embedding server,
/// the embedded SQLite store in `data_dir`, and health checks quick enough for a short demo
/// (the caller adds the admin listener).
fn demo_config(
    listener: &TcpListener,
    sims: &[SimServer],
    embed: &SimServer,
    data_dir: &Path,
) -> std::io::Result<Config> {
    let url = |s: &SimServer| s.url().parse::<Uri>().map_err(std::io::Error::other);
    let backends: Vec<Uri> = sims.iter().map(url).collect::<Result<_, _>>()?;
    let mut embeddings = PoolConfig::new(EMBED_MODEL, vec![url(embed)?]);
    embeddings.kind = PoolKind::Embed;
    let mut config = Config::with_pools(vec![PoolConfig::new(MODEL, backends), embeddings]);
    config.server = ServerConfig {
        listen: listener.local_addr()?,
        health_interval: Duration::from_millis(500),
        request_log_events: false,
        shutdown_grace: Duration::from_secs(5),
        ..ServerConfig::default()
    };
    config.database.sqlite_path = data_dir.join("fleetgate.db");
    config.request_log.spill_path = data_dir.join("request-log.spill");
    config.admin.listen = None;
    Ok(config)
}

/// The demo's settings as a config file (owner-only: it holds the admin secret): the gateway's
/// and the console's addresses, the store (relative to the file), the pools.
fn write_demo_config(
    path: &Path,
    server: &Server,
    sims: &[SimServer],
    embed: &SimServer,
    secret: &str,
) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let backends = sims
        .iter()
        .map(|s| format!("\"{}\"", s.url()))
        .collect::<Vec<_>>()
        .join(", ");
    let admin = server
        .admin_addr
        .map(|a| format!("listen = \"{a}\"\n"))
        .unwrap_or_default();
    let text = format!(
        "# `fleetgate demo`'s settings for this run (its admin secret included: keep this file private).\n\
         [server]\nlisten = \"{listen}\"\n\n\
         [database]\nsqlite_path = \"fleetgate.db\"\n\n\
         [admin]\n{admin}jwt_secret = \"{secret}\"\n\n\
         [[pools]]\nmodel = \"{MODEL}\"\nbackends = [{backends}]\n\n\
         [[pools]]\nmodel = \"{EMBED_MODEL}\"\nkind = \"embed\"\nbackends = [\"{embed}\"]\n",
        listen = server.local_addr,
        embed = embed.url(),
    );
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?
        .write_all(text.as_bytes())
}

/// The demo's own stress key, in the embedded SQLite store, known to the gateway at once.
async fn issue_demo_key(auth: &Authenticator) -> std::io::Result<(String, KeyRecord)> {
    let (demo_key, record) = auth
        .store()
        .create(
            &CreateKey {
                name: "demo".into(),
                environment: Some(Environment::Stress),
                ..CreateKey::default()
            },
            "fleetgate-demo",
        )
        .await
        .map_err(std::io::Error::other)?;
    auth.apply(&record.public_id, Some(record.clone()));
    Ok((demo_key, record))
}

fn bearer(key: &str) -> std::io::Result<HeaderMap> {
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::AUTHORIZATION,
        HeaderValue::try_from(format!("Bearer {key}")).map_err(std::io::Error::other)?,
    );
    Ok(headers)
}

fn chat_body(max_tokens: u32) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "Explain continuous batching in one paragraph."}],
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string(),
    )
}

fn chat_uri(sim: &SimServer) -> std::io::Result<Uri> {
    format!("{}/v1/chat/completions", sim.url())
        .parse()
        .map_err(std::io::Error::other)
}

/// One request down each path, so that connection set-up is not measured.
async fn warm_up(
    c: &HttpClient,
    sims: &[SimServer],
    via: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
) -> std::io::Result<()> {
    for s in sims {
        let direct = chat_uri(s)?;
        let _ = client::send(c, &direct, headers, body.clone(), false).await;
    }
    let _ = client::send(c, via, headers, body.clone(), false).await;
    Ok(())
}

/// `requests` pairs of the same chat, direct and through the gateway, one table row each;
/// returns the TTFT differences of the pairs where both answered.
async fn compare(
    c: &HttpClient,
    sims: &[SimServer],
    via: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
    requests: usize,
) -> std::io::Result<Vec<f64>> {
    outln!(
        "{:>3}  {:>12}  {:>14}  {:>11}  {:>9}",
        "#",
        "direct TTFT",
        "gateway TTFT",
        "difference",
        "tokens"
    );
    let mut diffs = Vec::new();
    for i in 0..requests {
        // Interleave, and alternate which goes first, so noise falls on both.
        let direct = chat_uri(&sims[i % 2])?;
        let (d, g) = if i % 2 == 0 {
            let d = client::send(c, &direct, headers, body.clone(), false).await;
            let g = client::send(c, via, headers, body.clone(), false).await;
            (d, g)
        } else {
            let g = client::send(c, via, headers, body.clone(), false).await;
            let d = client::send(c, &direct, headers, body.clone(), false).await;
            (d, g)
        };
        match (d, g) {
            (Ok(d), Ok(g)) if d.status == 200 && g.status == 200 => {
                let (dt, gt) = (ttft_ms(&d), ttft_ms(&g));
                diffs.push(gt - dt);
                outln!(
                    "{:>3}  {:>9.2} ms  {:>11.2} ms  {:>+8.2} ms  {:>9}",
                    i + 1,
                    dt,
                    gt,
                    gt - dt,
                    g.metrics.usage.map_or(0, |u| u.completion_tokens)
                );
            }
            (d, g) => outln!(
                "{:>3}  failed: direct {:?} / gateway {:?}",
                i + 1,
                status(&d),
                status(&g)
            ),
        }
    }
    Ok(diffs)
}

fn print_median(mut diffs: Vec<f64>) {
    if diffs.is_empty() {
        return;
    }
    diffs.sort_by(|a, b| a.total_cmp(b));
    let median = diffs[diffs.len() / 2];
    outln!(
        "\nmedian TTFT difference through the gateway: {median:+.3} ms over {} pairs",
        diffs.len()
    );
    outln!(
        "(the simulated backends batch like vLLM, so single pairs vary by a step; docs/benchmarks.md has the careful measurement)"
    );
}

/// Everything needed to try the running gateway by hand: the newcomer's path, each command
/// runnable as printed (the binary by its full path: `cargo run` puts none on the PATH).
/// tests/it/docs_commands.rs runs these lines exactly as printed.
fn print_try_it(
    gateway: &str,
    sims: &[SimServer],
    embed: &SimServer,
    db: &Path,
    demo_key: &str,
    id: &str,
    console: Option<(&str, &Path)>,
) {
    let codex_home = demo_codex_home(db);
    if let Err(e) = write_codex_config(&codex_home, gateway) {
        tracing::warn!(error = %e, "could not write Codex's config for the demo");
    }
    let codex_home = codex_home.display();
    let db = db.display();
    let exe = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "fleetgate".to_owned());
    outln!("\nGateway:   {gateway}/v1   (OpenAI base URL; model `{MODEL}`)");
    for (i, s) in sims.iter().enumerate() {
        outln!(
            "Backend {}: {}/v1   (direct, for comparison)",
            i + 1,
            s.url()
        );
    }
    outln!(
        "Embedder:  {}/v1   (direct; model `{EMBED_MODEL}`, an embedding server: vllm serve --runner pooling)",
        embed.url()
    );
    outln!("Key:       {demo_key}   (environment stress, id {id}; shown once)");
    outln!("Store:     {db}   (embedded SQLite: keys and the request log)");
    if let Some((link, config)) = console {
        outln!(
            "Console:   {link}   (the web console: a one-time sign-in link, valid 10 minutes; docs/console.md)"
        );
        outln!(
            "Config:    {}   (the demo's settings and admin secret: `{exe} console-login --config {}` prints a new link)",
            config.display(),
            config.display()
        );
    }
    outln!("\nNext, in another terminal (each command runs as printed):");
    outln!("  export OPENAI_BASE_URL={gateway}/v1");
    outln!(
        "  export OPENAI_API_KEY=$({exe} keys create --sqlite {db} --env prod --name 'my service' -q)   # issue a key; -q prints it alone"
    );
    let curl = format!(
        "curl -sN $OPENAI_BASE_URL/chat/completions -H \"Authorization: Bearer $OPENAI_API_KEY\" \\\n    -H 'Content-Type: application/json' \\\n    -d '{{\"model\":\"{MODEL}\",\"stream\":true,\"max_tokens\":16,\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'"
    );
    outln!("  {curl}   # streams, ends with data: [DONE]");
    outln!(
        "  python3 -c 'from openai import OpenAI; s = OpenAI().chat.completions.create(model=\"{MODEL}\", stream=True, max_tokens=16, messages=[{{\"role\": \"user\", \"content\": \"hello\"}}]); print(\"\".join(c.choices[0].delta.content or \"\" for c in s if c.choices))'   # needs pip install openai"
    );
    outln!(
        "  curl -s $OPENAI_BASE_URL/embeddings -H \"Authorization: Bearer $OPENAI_API_KEY\" -H 'Content-Type: application/json' -d '{{\"model\":\"{EMBED_MODEL}\",\"input\":\"hello\"}}'   # the same key, the embedding model's pool: lists \"embedding\""
    );
    outln!(
        "  {exe} usage --sqlite {db} --since 1h --by env   # lists prod: the requests above, from the request log"
    );
    // The coding agents, each with a key of its own (docs/agents.md).
    outln!(
        "  export CODEX_KEY=$({exe} keys create --sqlite {db} --env prod --name codex -q)   # a key of its own for Codex"
    );
    outln!(
        "  CODEX_HOME={codex_home} FLEETGATE_KEY=$CODEX_KEY codex exec --skip-git-repo-check 'say hi' </dev/null   # Codex CLI (npm @openai/codex): its provider is in {codex_home}/config.toml; </dev/null: nothing more to read"
    );
    outln!(
        "  export CLAUDE_KEY=$({exe} keys create --sqlite {db} --env prod --name claude-code -q)   # and one for Claude Code"
    );
    outln!(
        "  ANTHROPIC_BASE_URL={gateway} ANTHROPIC_AUTH_TOKEN=$CLAUDE_KEY ANTHROPIC_MODEL={MODEL} CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 claude -p 'say hi'   # Claude Code (npm @anthropic-ai/claude-code)"
    );
    if let Some((_, config)) = console {
        outln!(
            "  {exe} console-login --config {}   # lists /console/login?token=: a new one-time sign-in link to the console",
            config.display()
        );
    }
    outln!("  {exe} keys revoke \"$OPENAI_API_KEY\" --sqlite {db} --reason 'demo over'");
    outln!("  {curl}   # answers 401 key_revoked (the revoke returned once the gateway had it)");
}

/// Where the demo's Codex home goes: Codex will not set up its helper binaries under a
/// temporary directory such as /tmp, where the demo's store lives, so it goes under the user's
/// cache directory (`$XDG_CACHE_HOME`, else `$HOME/.cache`), one per demo store; the store's
/// directory only when neither is set.
fn demo_codex_home(db: &Path) -> std::path::PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| std::path::PathBuf::from(h).join(".cache"))
        });
    let demo = db.parent().and_then(Path::file_name).map_or_else(
        || "fleetgate-demo".into(),
        |n| n.to_string_lossy().into_owned(),
    );
    match cache {
        Some(c) => c.join("fleetgate").join(demo).join("codex"),
        None => db.parent().unwrap_or_else(|| Path::new(".")).join("codex"),
    }
}

/// Codex CLI's provider for this gateway (`$CODEX_HOME/config.toml`), as docs/agents.md gives
/// it: the Responses API at the gateway's `/v1`, the key from `FLEETGATE_KEY`; no retries
/// (the gateway is local: a failure is shown at once).
fn write_codex_config(dir: &Path, gateway: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("config.toml"),
        format!(
            "model = \"{MODEL}\"\nmodel_provider = \"fleetgate\"\ncheck_for_update_on_startup = false\n\n\
             [model_providers.fleetgate]\nname = \"fleetgate\"\nbase_url = \"{gateway}/v1\"\n\
             wire_api = \"responses\"\nenv_key = \"FLEETGATE_KEY\"\n\
             request_max_retries = 0\nstream_max_retries = 0\n\n[analytics]\nenabled = false\n"
        ),
    )
}

fn demo_sim_args(seed: u64) -> SimArgs {
    SimArgs {
        port: 0,
        seed,
        decode_step_ms: 8.0,
        decode_ms_per_seq: 0.2,
        prefill_us_per_token: 5.0,
        // What the agents need of a backend: their tools taken (vLLM with a tool parser), and
        // answers that end on their own (Claude Code asks 32000 tokens).
        enable_auto_tool_choice: true,
        tool_call_parser: Some("hermes".to_owned()),
        output_tokens: Some(24),
        responses_store: true,
        ..SimArgs::default()
    }
}

/// The demo's embedding server: `vllm serve --runner pooling --convert embed` in the sim.
fn embed_sim_args() -> SimArgs {
    SimArgs {
        port: 0,
        served_model_name: vec![EMBED_MODEL.to_owned()],
        runner: fleetgate_sim::Runner::Pooling,
        convert: fleetgate_sim::Convert::Embed,
        ..SimArgs::default()
    }
}

fn ttft_ms(m: &Measured) -> f64 {
    m.metrics.ttft().map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

fn status(r: &Result<Measured, hyper_util::client::legacy::Error>) -> String {
    match r {
        Ok(m) => m.status.to_string(),
        Err(e) => e.to_string(),
    }
}
