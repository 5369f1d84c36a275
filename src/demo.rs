//! `fleetgate demo`: two simulated backends and the gateway in one process, a handful of
//! streamed chats sent directly and through the gateway (interleaved), a small table of what
//! the hop cost, then the gateway keeps serving with everything needed to try it by hand.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Uri};
use tokio::net::TcpListener;

use crate::client::{self, Measured};
use crate::config::{Config, PoolConfig, ServerConfig};
use crate::key::Environment;
use crate::server::Server;
use crate::sim::{self, SimArgs};
use crate::store::CreateKey;
use crate::telemetry::Recorder;

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

pub async fn run(
    args: DemoArgs,
    until: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let sims = [
        sim::start(demo_sim_args(1)).await?,
        sim::start(demo_sim_args(2)).await?,
    ];
    let listener = match TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], args.port))).await {
        Ok(l) => l,
        Err(e) => {
            println!(
                "port {} is busy ({e}); using a free port instead",
                args.port
            );
            TcpListener::bind("127.0.0.1:0").await?
        }
    };
    let backends: Vec<Uri> = sims
        .iter()
        .map(|s| s.url().parse::<Uri>().map_err(std::io::Error::other))
        .collect::<Result<_, _>>()?;
    let data_dir = std::env::temp_dir().join(format!("fleetgate-demo-{}", std::process::id()));
    let mut config = Config::with_pools(vec![PoolConfig::new(MODEL, backends)]);
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
    let server = Server::start_on(listener, &config, Recorder::new(false))
        .await
        .map_err(std::io::Error::other)?;
    let gateway = server.base_url();
    // The demo's own stress key, in the embedded SQLite store.
    let (demo_key, record) = server
        .auth
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
    server.auth.apply(&record.public_id, Some(record.clone()));

    println!("fleetgate demo: 2 simulated vLLM backends + the gateway, one process\n");
    let c = client::http_client();
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::AUTHORIZATION,
        HeaderValue::try_from(format!("Bearer {demo_key}")).map_err(std::io::Error::other)?,
    );
    let body = Bytes::from(
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "Explain continuous batching in one paragraph."}],
            "max_tokens": args.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string(),
    );
    // Warm both paths so connection set-up is not measured.
    let via: Uri = format!("{gateway}/v1/chat/completions")
        .parse()
        .map_err(std::io::Error::other)?;
    for s in &sims {
        let direct: Uri = format!("{}/v1/chat/completions", s.url())
            .parse()
            .map_err(std::io::Error::other)?;
        let _ = client::send(&c, &direct, &headers, body.clone(), false).await;
    }
    let _ = client::send(&c, &via, &headers, body.clone(), false).await;

    println!(
        "{:>3}  {:>12}  {:>14}  {:>11}  {:>9}",
        "#", "direct TTFT", "gateway TTFT", "difference", "tokens"
    );
    let mut diffs = Vec::new();
    for i in 0..args.requests {
        // Interleave, and alternate which goes first, so noise falls on both.
        let backend = &sims[i % 2];
        let direct: Uri = format!("{}/v1/chat/completions", backend.url())
            .parse()
            .map_err(std::io::Error::other)?;
        let (d, g) = if i % 2 == 0 {
            let d = client::send(&c, &direct, &headers, body.clone(), false).await;
            let g = client::send(&c, &via, &headers, body.clone(), false).await;
            (d, g)
        } else {
            let g = client::send(&c, &via, &headers, body.clone(), false).await;
            let d = client::send(&c, &direct, &headers, body.clone(), false).await;
            (d, g)
        };
        match (d, g) {
            (Ok(d), Ok(g)) if d.status == 200 && g.status == 200 => {
                let (dt, gt) = (ttft_ms(&d), ttft_ms(&g));
                diffs.push(gt - dt);
                println!(
                    "{:>3}  {:>9.2} ms  {:>11.2} ms  {:>+8.2} ms  {:>9}",
                    i + 1,
                    dt,
                    gt,
                    gt - dt,
                    g.metrics.usage.map_or(0, |u| u.completion_tokens)
                );
            }
            (d, g) => println!(
                "{:>3}  failed: direct {:?} / gateway {:?}",
                i + 1,
                status(&d),
                status(&g)
            ),
        }
    }
    if !diffs.is_empty() {
        diffs.sort_by(|a, b| a.total_cmp(b));
        let median = diffs[diffs.len() / 2];
        println!(
            "\nmedian TTFT difference through the gateway: {median:+.3} ms over {} pairs",
            diffs.len()
        );
        println!(
            "(the simulated backends batch like vLLM, so single pairs vary by a step; docs/benchmarks.md has the careful measurement)"
        );
    }

    println!("\nGateway:   {gateway}/v1   (OpenAI base URL; model `{MODEL}`)");
    for (i, s) in sims.iter().enumerate() {
        println!(
            "Backend {}: {}/v1   (direct, for comparison)",
            i + 1,
            s.url()
        );
    }
    let db = config.database.sqlite_path.display();
    let id = &record.public_id;
    println!("Key:       {demo_key}   (environment stress, id {id}; shown once)");
    println!("           export OPENAI_API_KEY={demo_key} OPENAI_BASE_URL={gateway}/v1");
    println!(
        "Try:\n  curl -N {gateway}/v1/chat/completions \\\n    -H 'Authorization: Bearer {demo_key}' -H 'Content-Type: application/json' \\\n    -d '{{\"model\":\"{MODEL}\",\"stream\":true,\"max_tokens\":16,\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'"
    );
    println!("Keys (embedded store {db}):");
    println!("  fleetgate keys create --sqlite {db} --env prod --name 'my service'");
    println!(
        "  fleetgate keys revoke {id} --sqlite {db} --reason 'demo over'   # refused within ~1 s"
    );

    if !args.no_wait {
        println!("\nServing until Ctrl-C.");
        until.await;
    }
    server.shutdown().await;
    for s in sims {
        s.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(&data_dir);
    Ok(())
}

fn demo_sim_args(seed: u64) -> SimArgs {
    SimArgs {
        port: 0,
        seed,
        decode_step_ms: 8.0,
        decode_ms_per_seq: 0.2,
        prefill_us_per_token: 5.0,
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
