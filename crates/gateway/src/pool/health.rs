//! Health and load: the reachability probe (with warm-up before a backend takes traffic), and
//! the scrape of vLLM's own `/metrics` for load-aware pools.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use tokio_util::sync::CancellationToken;

use super::backend::{Backend, Reachability};
use super::{Generation, Pool};
use crate::config::PoolKind;
use fleetgate_protocol::Endpoint;

impl Generation {
    /// Scrape every load-aware pool's backends' `/metrics` on the pool's interval until
    /// `stop`.
    pub(crate) async fn load_loop(&self, stop: CancellationToken) {
        let mut loops = Vec::new();
        for pool in &self.pools {
            let Some(la) = pool.config.load_aware.clone() else {
                continue;
            };
            let stop = stop.clone();
            loops.push(async move {
                loop {
                    futures_util::future::join_all(pool.backends.iter().map(|b| scrape(pool, b)))
                        .await;
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(la.interval) => {}
                    }
                }
            });
        }
        futures_util::future::join_all(loops).await;
    }

    pub(crate) async fn probe_once(&self) {
        let probes = self
            .pools
            .iter()
            .flat_map(|pool| pool.backends.iter().map(move |b| probe(pool, b)));
        futures_util::future::join_all(probes).await;
    }
}

/// One health probe: `GET <base><health.path>`. `unhealthy_threshold` failures in a row take
/// the backend down; `healthy_threshold` successes in a row bring it back — through warm-up
/// when the pool has one.
async fn probe(pool: &Pool, backend: &Backend) {
    // vLLM's `/health` needs no key: whether the backend takes the gateway's key is asked of
    // `/v1/models`, when the backend is new (start, reload) or back from down, and again at
    // every probe while it refuses.
    // It is read again every `models_interval` too: the LoRA adapters a backend serves
    // change at run time (`/v1/load_lora_adapter`).
    let interval =
        u64::try_from(pool.config.health.models_interval.as_millis()).unwrap_or(u64::MAX);
    let due = crate::clock::mono_ms()
        .saturating_sub(backend.models_read_ms.load(Ordering::Relaxed))
        >= interval;
    if !backend.card_checked.load(Ordering::Relaxed)
        || backend.misconfigured.load(Ordering::Relaxed)
        || due
    {
        check_models(pool, backend).await;
    }
    let mut req = Request::get(backend.health_uri.clone());
    if let Some(auth) = &backend.upstream_auth {
        req = req.header(http::header::AUTHORIZATION, auth.clone());
    }
    let Ok(req) = req.body(Full::new(Bytes::new())) else {
        return;
    };
    let health = &pool.config.health;
    let result = tokio::time::timeout(health.timeout, async {
        let resp = pool.client.request(req).await?;
        let ok = resp.status().is_success();
        // Drain so the connection goes back to the pool.
        let _ = resp.into_body().collect().await;
        Ok::<bool, hyper_util::client::legacy::Error>(ok)
    })
    .await;
    let ok = matches!(result, Ok(Ok(true)));
    let state = backend.reachability();
    if !ok {
        backend.probes_ok.store(0, Ordering::Relaxed);
        let bad = backend.probes_bad.fetch_add(1, Ordering::Relaxed) + 1;
        let why = match &result {
            Ok(Ok(_)) => format!("{} answered an error", health.path),
            Ok(Err(e)) => {
                let (cause, detail) = super::cause::classify(e, e.is_connect());
                format!("{} failed: {} ({detail})", health.path, cause.describe())
            }
            Err(_) => format!(
                "{} did not answer within {} ms",
                health.path,
                health.timeout.as_millis()
            ),
        };
        backend.set_last_error(&why);
        if bad >= health.unhealthy_threshold && state != Reachability::Down {
            tracing::warn!(backend = %backend.base, error = %why, "backend failed its health probe");
            backend.mark(Reachability::Down);
        }
        return;
    }
    backend.probes_bad.store(0, Ordering::Relaxed);
    if backend.misconfigured.load(Ordering::Relaxed) {
        // Reachable, but every request would fail with the backend's 401.
        return;
    }
    let good = backend.probes_ok.fetch_add(1, Ordering::Relaxed) + 1;
    let warming = backend.warming.load(Ordering::Relaxed);
    if state == Reachability::Up && !warming {
        return;
    }
    if good < health.healthy_threshold && state == Reachability::Down {
        return;
    }
    if warming {
        if let Err(why) = warm_up(pool, backend).await {
            backend.set_last_error(&why);
            tracing::warn!(backend = %backend.base, error = %why, "backend warm-up failed; trying again at the next probe");
            return;
        }
        backend.warming.store(false, Ordering::Relaxed);
        tracing::info!(backend = %backend.base, requests = pool.config.warmup.requests, "backend warmed up");
    }
    if state != Reachability::Up {
        tracing::info!(backend = %backend.base, "backend reachable");
        // Healthy again: what took it down is history (the log keeps it).
        backend.clear_last_error();
    }
    backend.mark(Reachability::Up);
    // Waiting requests may be served by a backend that came back.
    pool.balancer.dispatch();
}

/// `GET /v1/models` with the gateway's upstream key: a 401/403/407 marks the backend
/// misconfigured (down, with the reason); a list keeps the card of the pool's model for the
/// gateway's own `/v1/models`. Anything else (no answer, a server without the route) changes
/// nothing: reachability is the health probe's business.
async fn check_models(pool: &Pool, backend: &Backend) {
    backend
        .models_read_ms
        .store(crate::clock::mono_ms(), Ordering::Relaxed);
    let mut req = Request::get(backend.models_uri.clone());
    if let Some(auth) = &backend.upstream_auth {
        req = req.header(http::header::AUTHORIZATION, auth.clone());
    }
    let Ok(req) = req.body(Full::new(Bytes::new())) else {
        return;
    };
    let answer = tokio::time::timeout(pool.config.health.timeout, async {
        let resp = pool.client.request(req).await.ok()?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), 1 << 20)
            .collect()
            .await
            .ok()?
            .to_bytes();
        Some((status, body))
    })
    .await
    .ok()
    .flatten();
    let Some((status, body)) = answer else {
        return;
    };
    let code = status.as_u16();
    if matches!(code, 401 | 403 | 407) {
        let why = format!(
            "misconfigured: GET /v1/models answered {status} to the gateway's {}: the backend refuses it (check upstream_api_key for this pool or backend); it takes no requests until this check passes",
            if backend.upstream_auth.is_some() {
                "upstream_api_key"
            } else {
                "request without a key (no upstream_api_key is configured)"
            }
        );
        if !backend.misconfigured.swap(true, Ordering::Relaxed) {
            tracing::warn!(backend = %backend.base, status = code, "backend refuses the gateway's upstream key");
        }
        backend.set_last_error(&why);
        backend.mark(Reachability::Down);
        return;
    }
    backend.card_checked.store(true, Ordering::Relaxed);
    if backend.misconfigured.swap(false, Ordering::Relaxed) {
        tracing::info!(backend = %backend.base, "backend accepts the gateway's upstream key again");
        backend.clear_last_error();
    }
    if status.is_success() {
        backend.set_model_card(fleetgate_protocol::models::find_card(
            &body,
            &pool.served_name,
        ));
        pool.learn_adapters(backend, super::adapters::Served::from_list(&body));
    }
}

/// Read a backend's own load from its Prometheus text: vLLM's running + waiting requests and
/// KV-cache usage. An unreadable answer counts as no information (load 0: local counts only).
async fn scrape(pool: &Pool, backend: &Backend) {
    // This gateway's own part of what the engine will count: its requests when the scrape
    // leaves (the engine renders its figures a moment later).
    let own = backend.in_flight.load(Ordering::Relaxed);
    let text = metrics_text(&pool.client, backend, pool.config.health.timeout).await;
    let (load, kv) = text.as_deref().map_or((0.0, 0.0), vllm_load);
    backend.set_remote_load(load.clamp(0.0, f64::from(u32::MAX)) as u32, own);
    backend
        .kv_usage_permille
        .store((kv.clamp(0.0, 1.0) * 1000.0) as u32, Ordering::Relaxed);
}

/// A backend's `/metrics` text (with its upstream key), up to 4 MiB, within `timeout`; `None`
/// when it cannot be read or answers an error.
pub(crate) async fn metrics_text(
    client: &super::UpstreamClient,
    backend: &Backend,
    timeout: Duration,
) -> Option<Bytes> {
    let mut req = Request::get(backend.metrics_uri.clone());
    if let Some(auth) = &backend.upstream_auth {
        req = req.header(http::header::AUTHORIZATION, auth.clone());
    }
    let req = req.body(Full::new(Bytes::new())).ok()?;
    tokio::time::timeout(timeout, async {
        let resp = client.request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        http_body_util::Limited::new(resp.into_body(), 4 << 20)
            .collect()
            .await
            .ok()
            .map(|c| c.to_bytes())
    })
    .await
    .ok()
    .flatten()
}

/// (running + waiting, KV-cache usage) summed over a vLLM `/metrics` text's series.
pub(crate) fn vllm_load(text: &[u8]) -> (f64, f64) {
    let text = String::from_utf8_lossy(text);
    let mut load = 0.0;
    let mut kv: f64 = 0.0;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or("");
        let Some(value) = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
        else {
            continue;
        };
        match name {
            "vllm:num_requests_running" | "vllm:num_requests_waiting" => load += value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => kv = kv.max(value),
            _ => {}
        }
    }
    (load, kv)
}

/// The warm-up request of a pool's kind of model: a one-token chat completion for a
/// generative model, the prompt embedded or classified for a pooling one (which has no chat
/// route).
/// (the route, its content type, its body).
fn warm_up_request(kind: PoolKind, model: &str, prompt: &str) -> (Endpoint, &'static str, Bytes) {
    const JSON: &str = "application/json";
    let json = |v: serde_json::Value| Bytes::from(v.to_string());
    match kind {
        PoolKind::Generate => (
            Endpoint::Chat,
            JSON,
            json(serde_json::json!({
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 1,
                "stream": false,
            })),
        ),
        PoolKind::Embed => (
            Endpoint::Embeddings,
            JSON,
            json(serde_json::json!({"model": model, "input": prompt})),
        ),
        PoolKind::Classify => (
            Endpoint::Classify,
            JSON,
            json(serde_json::json!({"model": model, "input": prompt})),
        ),
        PoolKind::Transcription => (
            Endpoint::Transcriptions,
            WARM_UP_FORM_TYPE,
            warm_up_form(model),
        ),
    }
}

const WARM_UP_BOUNDARY: &str = "fleetgate-warm-up";
const WARM_UP_FORM_TYPE: &str = "multipart/form-data; boundary=fleetgate-warm-up";

/// A speech model's warm-up: half a second of silence (16 kHz mono 16-bit PCM WAV) to
/// transcribe, as a multipart form.
fn warm_up_form(model: &str) -> Bytes {
    const RATE: u32 = 16_000;
    const DATA: u32 = RATE; // 0.5 s of 2-byte samples
    let mut wav = Vec::with_capacity(44 + DATA as usize);
    wav.extend_from_slice(b"RIFF");
    wav.extend_from_slice(&(36 + DATA).to_le_bytes());
    wav.extend_from_slice(b"WAVEfmt ");
    wav.extend_from_slice(&16u32.to_le_bytes()); // the fmt chunk's size
    wav.extend_from_slice(&1u16.to_le_bytes()); // PCM
    wav.extend_from_slice(&1u16.to_le_bytes()); // mono
    wav.extend_from_slice(&RATE.to_le_bytes());
    wav.extend_from_slice(&(RATE * 2).to_le_bytes());
    wav.extend_from_slice(&2u16.to_le_bytes());
    wav.extend_from_slice(&16u16.to_le_bytes());
    wav.extend_from_slice(b"data");
    wav.extend_from_slice(&DATA.to_le_bytes());
    wav.resize(44 + DATA as usize, 0);
    let b = WARM_UP_BOUNDARY;
    let mut form = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"warm-up.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
    )
    .into_bytes();
    form.extend_from_slice(&wav);
    form.extend_from_slice(format!("\r\n--{b}--\r\n").as_bytes());
    Bytes::from(form)
}

/// Send the pool's warm-up requests (small non-streaming requests of its kind) to `backend`;
/// all must succeed.
async fn warm_up(pool: &Pool, backend: &Backend) -> Result<(), String> {
    let w = &pool.config.warmup;
    let (endpoint, content_type, body) =
        warm_up_request(pool.config.kind, &pool.served_name, &w.prompt);
    let limit = pool.timeouts.first_token.min(Duration::from_secs(60));
    for i in 0..w.requests {
        let mut req = Request::post(backend.uri(endpoint).clone())
            .header(http::header::CONTENT_TYPE, content_type);
        if let Some(auth) = &backend.upstream_auth {
            req = req.header(http::header::AUTHORIZATION, auth.clone());
        }
        let req = req
            .body(Full::new(body.clone()))
            .map_err(|e| e.to_string())?;
        let status = tokio::time::timeout(limit, async {
            let resp = pool.client.request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            let _ = resp.into_body().collect().await;
            Ok::<_, String>(status)
        })
        .await
        .map_err(|_| {
            format!(
                "warm-up request {} timed out after {} ms",
                i + 1,
                limit.as_millis()
            )
        })??;
        if status == http::StatusCode::NOT_FOUND {
            // vLLM registers its routes by the kind of model it serves.
            return Err(format!(
                "warm-up request {} answered {status} to POST {}: the backend has no such route for its model, so it serves another kind than pools[].kind = {} (a pooling model has no chat route, a generative one no embeddings route): set the pool's kind to what `vllm serve` runs",
                i + 1,
                endpoint.path(),
                pool.config.kind.as_str()
            ));
        }
        if !status.is_success() {
            return Err(format!("warm-up request {} answered {status}", i + 1));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_load() {
        let text = b"# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\",model_name=\"a\"} 7.0\nvllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 3\nvllm:num_requests_waiting_by_reason{r=\"x\"} 99\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.42\n";
        let (load, kv) = vllm_load(text);
        assert_eq!(load, 10.0);
        assert!((kv - 0.42).abs() < 1e-9);
        assert_eq!(vllm_load(b"<html>not metrics</html>"), (0.0, 0.0));
    }
}
