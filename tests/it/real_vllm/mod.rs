//! The gateway in front of a real vLLM server. Run with the URL and key that
//! `scripts/real-vllm.sh start` prints:
//!
//!     FLEETGATE_TEST_VLLM=http://127.0.0.1:PORT FLEETGATE_TEST_VLLM_KEY=KEY \
//!         cargo test --test it real_vllm:: -- --nocapture
//!
//! Without `FLEETGATE_TEST_VLLM` every test here says loudly that it was skipped and passes,
//! under `CI=true` too: vLLM's install is about 6 GB, so CI runs the captured answers instead
//! (tests/it/vllm_conformance.rs). `vllm bench serve` comes from the venv of
//! `$FLEETGATE_VLLM_HOME` (default `${XDG_CACHE_HOME:-~/.cache}/fleetgate/vllm`), as
//! scripts/real-vllm.sh installs it.
//!
//! The tests take turns (one server, whose running-request gauge some of them read). They pass
//! against the plain server (`start`) and against the agents' (`start --agents`), but for the
//! coding agents' tests (Codex CLI and Claude Code, as `.ci/run` installs them), which
//! need the agents' server and say loudly that they skipped against the other.
//! `priority_orders_the_waiting_queue_as_the_sim_does` needs a one-slot server in priority mode
//! (`start --scheduling-policy priority --max-num-seqs 1 --enable-per-request-metrics`) and says
//! loudly that it skipped against any other; the other tests are not meant for that one.
//! `traces::vllms_span_sits_under_the_gateways_call_in_the_clients_trace` needs a server
//! started with `--otlp-traces-endpoint URL` (`FLEETGATE_TEST_VLLM_OTLP`, printed by `start`,
//! is where it runs its OTLP receiver) and says loudly that it skipped without one.

mod agents;
mod benches;
mod continuation;
mod kv_events;
mod priority;
mod relay;
mod tokens;
mod traces;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use http_body_util::BodyExt;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Real {
    url: String,
    key: String,
    model: String,
    /// From the model's card in `/v1/models`: 32768 in agents mode, 1024 otherwise.
    max_model_len: u64,
    /// The model's directory (`root` in its card).
    root: String,
}

/// The server under test, or `None` (skipped, said on stderr).
async fn real(test: &str) -> Option<Real> {
    real_at(test, "FLEETGATE_TEST_VLLM", "scripts/real-vllm.sh start").await
}

/// The pooling server under test (`scripts/real-vllm.sh start --pooling embed`), given apart
/// from the generative one, whose routes it does not serve: `FLEETGATE_TEST_VLLM_POOLING` and
/// `FLEETGATE_TEST_VLLM_POOLING_KEY`. `None` (skipped, said on stderr) without it.
async fn real_pooling(test: &str) -> Option<Real> {
    real_at(
        test,
        "FLEETGATE_TEST_VLLM_POOLING",
        "scripts/real-vllm.sh start --pooling embed",
    )
    .await
}

/// The server whose URL is in `$var` and key in `${var}_KEY`.
async fn real_at(test: &str, var: &str, start: &str) -> Option<Real> {
    let Ok(url) = std::env::var(var) else {
        eprintln!(
            "\n*** SKIPPED {test} against real vLLM: {var} is not set \
             ({start} prints the server's URL and key; docs/testing.md). ***\n"
        );
        return None;
    };
    let url = url.trim_end_matches('/').to_owned();
    let key = std::env::var(format!("{var}_KEY")).unwrap_or_default();
    let (status, body) = get(&format!("{url}/v1/models"), Some(&key)).await;
    assert_eq!(status, 200, "GET {url}/v1/models with {var}_KEY: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let card = &v["data"][0];
    Some(Real {
        url,
        key,
        model: card["id"].as_str().unwrap().to_owned(),
        max_model_len: card["max_model_len"].as_u64().unwrap_or(0),
        root: card["root"].as_str().unwrap_or_default().to_owned(),
    })
}

async fn get(url: &str, key: Option<&str>) -> (u16, String) {
    let c = fleetgate_protocol::client::http_client();
    let mut req = http::Request::get(url);
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let resp = c
        .request(req.body(http_body_util::Full::new(Bytes::new())).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// A gateway with one pool `client_name` → the real server, with its key upstream.
async fn gateway_to(r: &Real, client_name: &str, key: &str, load_aware: bool) -> Gateway {
    let mut p = pool(client_name, std::slice::from_ref(&r.url));
    if client_name != r.model {
        p.served_model_name = Some(r.model.clone());
    }
    p.upstream_api_key = Some(fleetgate_gateway::secret::Secret::new(key));
    if load_aware {
        p.load_aware = Some(fleetgate_gateway::config::LoadAwareConfig {
            metrics_path: "/metrics".into(),
            interval: Duration::from_millis(100),
        });
    }
    let gw = gateway_with(vec![p], |c| c.admin = admin_cfg()).await;
    if key == r.key {
        wait_for_200(&gw.url("/readyz").to_string()).await;
    }
    gw
}

/// POST to the real server directly (its key) or through the gateway (the harness key).
async fn direct(
    r: &Real,
    path: &str,
    body: &serde_json::Value,
) -> fleetgate_protocol::client::Measured {
    let auth = format!("Bearer {}", r.key);
    post(
        &format!("{}{path}", r.url).parse().unwrap(),
        &[("authorization", &auth)],
        Bytes::from(body.to_string()),
    )
    .await
}

async fn through(
    gw: &Gateway,
    path: &str,
    body: &serde_json::Value,
) -> fleetgate_protocol::client::Measured {
    post(&gw.url(path), &[], Bytes::from(body.to_string())).await
}

fn text(m: &fleetgate_protocol::client::Measured) -> String {
    String::from_utf8_lossy(m.body.as_ref().expect("body kept")).into_owned()
}

/// The body with its request id and `created` stamps made neutral: they differ between any two
/// requests. Everything else must be byte for byte the same.
fn neutral(body: &str) -> String {
    let mut out = body.to_owned();
    if let Some(at) = out.find("\"id\":\"") {
        let start = at + 6;
        let end = start + out[start..].find('"').unwrap();
        let id = out[start..end].to_owned();
        out = out.replace(&id, "ID");
    }
    let mut neutral = String::with_capacity(out.len());
    let mut rest = out.as_str();
    while let Some(at) = rest.find("\"created\":") {
        let start = at + 10;
        neutral.push_str(&rest[..start]);
        neutral.push('0');
        let digits = rest[start..]
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len() - start);
        rest = &rest[start + digits..];
    }
    neutral.push_str(rest);
    neutral
}

fn chat(model: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": model, "stream": stream, "max_tokens": max_tokens,
        "temperature": 0, "seed": 7,
        "messages": [{"role": "user", "content": "Tell me about the sea"}]})
}

fn completion(model: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": model, "stream": stream, "max_tokens": max_tokens,
        "temperature": 0, "seed": 7, "prompt": "Once upon a time"})
}

/// Runs a command to its end off the runtime's threads (the gateway under test runs on them).
async fn output(mut cmd: std::process::Command) -> std::process::Output {
    tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap()
}

/// Where scripts/real-vllm.sh installs vLLM: `$FLEETGATE_VLLM_HOME`, else the user's cache.
fn vllm_home() -> PathBuf {
    if let Some(home) = std::env::var_os("FLEETGATE_VLLM_HOME") {
        return PathBuf::from(home);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache.join("fleetgate").join("vllm")
}
