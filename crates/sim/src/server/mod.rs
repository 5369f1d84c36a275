//! HTTP side of the sim: the accept loop and one handler that reads top to bottom as vLLM's
//! request path (auth → route → parse → validate → fault → generate → respond).
//!
//! This module holds the accept loop, the routing, auth, body reading and the response
//! builders the routes share; each kind of route is answered in a submodule:
//! - `generate`: chat, completions, Responses and Anthropic messages, and the chat batch.
//! - `stored`: `GET /v1/responses/{id}` and its cancel, on the responses store.
//! - `pooled`: the pooling routes of `--runner pooling`.
//! - `speech`: `/v1/audio/transcriptions` and `/translations`.
//! - `lora`: `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

mod generate;
mod lora;
mod pooled;
mod speech;
mod stored;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::agents;
use super::api::{self, error::ApiError};
use super::args::SimConfig;
use super::audio::SpeechTask;
use super::body::{Capture, SimBody};
use super::engine::Engine;
use super::frames::Endpoint;
use super::lora::Adapters;
use super::pooling::PoolingRoute;
use super::stats::{SimStats, render_metrics};
use super::tokens::mix64;

/// Bodies above this are refused; far more than any max-model-len worth of text.
const MAX_REQUEST_BODY: usize = 64 << 20;
const X_REQUEST_ID: &str = "x-request-id";
/// vLLM's API-key middleware guards these path prefixes, as plain string prefixes (so `/v1x`
/// too), before any routing; everything else (/health, /metrics, /tokenize, /pooling,
/// /score, /rerank, /classify, ...) is open even with `--api-key`.
const GUARDED_PREFIXES: [&str; 4] = ["/v1", "/v2", "/inference", "/cohere"];

/// Routes vLLM registers only for a generative model (`--runner generate`).
fn generative_only(path: &str) -> bool {
    matches!(
        path,
        "/v1/chat/completions"
            | "/v1/chat/completions/batch"
            | "/v1/completions"
            | "/v1/responses"
            | "/v1/messages"
            | "/v1/messages/count_tokens"
    ) || path.starts_with("/v1/responses/")
        || SpeechTask::at(path).is_some()
}

/// What every connection of one sim shares.
pub(crate) struct SimContext {
    /// Stored responses (`--responses-store`).
    pub responses: Option<Arc<agents::Store>>,
    pub cfg: SimConfig,
    pub stats: Arc<SimStats>,
    pub engine: Engine,
    /// The LoRA adapters loaded now (none without `--enable-lora`).
    pub adapters: Adapters,
    /// Numbers requests for `--fail-rate`, so the faulty fraction is reproducible per seed.
    fault_draws: AtomicU64,
}

impl SimContext {
    pub(crate) fn new(cfg: SimConfig, stats: Arc<SimStats>, engine: Engine) -> Self {
        Self {
            responses: cfg.responses_store.then(Default::default),
            adapters: Adapters::new(&cfg),
            cfg,
            stats,
            engine,
            fault_draws: AtomicU64::new(0),
        }
    }

    fn draw_failure(&self) -> bool {
        if self.cfg.fail_rate <= 0.0 {
            return false;
        }
        let n = self.fault_draws.fetch_add(1, Relaxed);
        let u = (mix64(self.cfg.seed ^ mix64(n)) >> 11) as f64 / (1u64 << 53) as f64;
        u < self.cfg.fail_rate
    }
}

/// The accept queue of vLLM's HTTP server: uvicorn's default `backlog` (2048). A burst of
/// connections from a gateway waits in it as it would at vLLM, rather than at tokio's 1 024.
pub(crate) const LISTEN_BACKLOG: u32 = 2048;

/// The socket before and after `listen()`.
pub(crate) enum Listener {
    Listening(TcpListener),
    /// Bound but not listening: connects get ECONNREFUSED until the warm-up ends.
    WarmingUp(TcpSocket, Duration),
}

/// Accepts until cancelled, then aborts every connection task and waits for them.
pub(crate) async fn serve(listener: Listener, ctx: Arc<SimContext>, cancel: CancellationToken) {
    let listener = match listener {
        Listener::Listening(l) => l,
        Listener::WarmingUp(socket, warmup) => {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(warmup) => {}
            }
            match socket.listen(LISTEN_BACKLOG) {
                Ok(l) => {
                    tracing::info!("sim warm-up over, accepting connections");
                    l
                }
                Err(e) => {
                    tracing::error!(error = %e, "sim could not listen after warm-up");
                    return;
                }
            }
        }
    };
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    conns.spawn(serve_connection(stream, ctx.clone()));
                }
                Err(e) => {
                    // Usually EMFILE; back off a little instead of spinning on the error.
                    tracing::warn!(error = %e, "sim accept failed");
                    tokio::select! {
                        () = cancel.cancelled() => break,
                        () = tokio::time::sleep(Duration::from_millis(10)) => {}
                    }
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    conns.shutdown().await;
}

async fn serve_connection(stream: TcpStream, ctx: Arc<SimContext>) {
    let keep_alive = ctx.cfg.keep_alive_timeout;
    // Each frame is written as produced; Nagle would hold small frames back and distort ITL.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "sim could not set TCP_NODELAY");
    }
    let svc = service_fn(move |req| {
        let ctx = ctx.clone();
        async move { Ok::<_, Infallible>(handle(req, &ctx).await) }
    });
    // No header-read timer unless `--timeout-keep-alive` asks for one: hyper only arms it when
    // a timer is configured, and the sim's zero-delay mode is meant to measure a proxy hop
    // without timer overhead. With one, hyper's header timer runs from the end of each answer:
    // an idle kept-alive connection is closed after it, as uvicorn closes vLLM's.
    let mut builder = http1::Builder::new();
    builder.keep_alive(true);
    if let Some(idle) = keep_alive {
        builder
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(idle);
    }
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    if let Err(e) = conn.await {
        // Client hang-ups land here too; they are routine for a test server.
        tracing::debug!(error = %e, "sim connection ended");
    }
}

async fn handle(req: Request<Incoming>, ctx: &SimContext) -> Response<SimBody> {
    // vLLM 0.32 builds the answer's id from the caller's `X-Request-Id` (`chatcmpl-<it>`) and
    // does not echo the header.
    let capture_key = req
        .headers()
        .get(X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    match route(req, ctx, capture_key.as_deref()).await {
        Ok(r) => r,
        Err(e) => error_response(&e, ctx, capture_key.as_deref()),
    }
}

fn error_response(e: &ApiError, ctx: &SimContext, capture_key: Option<&str>) -> Response<SimBody> {
    let capture = capture_key.and_then(|k| Capture::new(&ctx.stats, k.to_owned()));
    let mut r = Response::new(SimBody::full(e.body(), capture));
    *r.status_mut() = e.status();
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An SSE answer, with vLLM's content type.
fn event_stream(body: SimBody) -> Response<SimBody> {
    let mut r = Response::new(body);
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r
}

fn json_response(body: Vec<u8>, capture: Option<Capture>) -> Response<SimBody> {
    let mut r = Response::new(SimBody::full(body, capture));
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn route(
    req: Request<Incoming>,
    ctx: &SimContext,
    capture_key: Option<&str>,
) -> Result<Response<SimBody>, ApiError> {
    let path = req.uri().path();
    let get = req.method() == Method::GET;
    match path {
        // vLLM leaves /health and /metrics open even with --api-key.
        "/health" if get => Ok(Response::new(SimBody::empty())),
        "/metrics" if get => {
            let text = render_metrics(&ctx.stats, ctx.cfg.model_name());
            let mut r = Response::new(SimBody::full(text, None));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            Ok(r)
        }
        // The vLLM release whose behaviour the sim follows (tests/fixtures/vllm-<version>/).
        "/version" if get => {
            let mut r = Response::new(SimBody::full(
                bytes::Bytes::from_static(br#"{"version":"0.32.0"}"#),
                None,
            ));
            r.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            Ok(r)
        }
        "/health" | "/metrics" | "/version" => Err(ApiError::MethodNotAllowed),
        // vLLM's tokenizer sits at the root, and its `--api-key` guards only /v1 paths.
        "/tokenize" | "/detokenize" if req.method() == Method::POST => {
            let tokenize = path == "/tokenize";
            tokenizer(tokenize, req, ctx, capture_key).await
        }
        "/tokenize" | "/detokenize" => Err(ApiError::MethodNotAllowed),
        p => {
            if GUARDED_PREFIXES.iter().any(|g| p.starts_with(g)) {
                authorize(&req, ctx)?;
            }
            let post = req.method() == Method::POST;
            if let Some(route) = PoolingRoute::named(p) {
                return match ctx.cfg.pooling {
                    Some(task) if route.served_by(task) && post => {
                        pooled::pooled(route, task, req, ctx, capture_key).await
                    }
                    Some(task) if route.served_by(task) => Err(ApiError::MethodNotAllowed),
                    // Not registered for this kind of model.
                    _ => Err(ApiError::RouteNotFound),
                };
            }
            if ctx.cfg.pooling.is_some() && generative_only(p) {
                return Err(ApiError::RouteNotFound);
            }
            if let Some(task) = SpeechTask::at(p) {
                return match post {
                    true => speech::speech(task, req, ctx, capture_key).await,
                    false => Err(ApiError::MethodNotAllowed),
                };
            }
            if p == "/v1/chat/completions/batch" {
                return match post {
                    true => generate::batch_chat(req, ctx, capture_key).await,
                    false => Err(ApiError::MethodNotAllowed),
                };
            }
            if !p.starts_with("/v1") {
                return Err(ApiError::RouteNotFound);
            }
            let capture = || capture_key.and_then(|k| Capture::new(&ctx.stats, k.to_owned()));
            match (p, req.method()) {
                ("/v1/models", &Method::GET) => Ok(json_response(
                    api::models::model_list(&ctx.cfg, &ctx.adapters.list(), unix_now()),
                    capture(),
                )),
                // vLLM registers these only with VLLM_ALLOW_RUNTIME_LORA_UPDATING.
                ("/v1/load_lora_adapter", &Method::POST) if ctx.cfg.runtime_lora_updating => {
                    lora::load(req, ctx).await
                }
                ("/v1/unload_lora_adapter", &Method::POST) if ctx.cfg.runtime_lora_updating => {
                    lora::unload(req, ctx).await
                }
                ("/v1/load_lora_adapter" | "/v1/unload_lora_adapter", _)
                    if ctx.cfg.runtime_lora_updating =>
                {
                    Err(ApiError::MethodNotAllowed)
                }
                ("/v1/chat/completions", &Method::POST) => {
                    generate::generate(Endpoint::Chat, req, ctx, capture_key).await
                }
                ("/v1/completions", &Method::POST) => {
                    generate::generate(Endpoint::Completions, req, ctx, capture_key).await
                }
                ("/v1/responses", &Method::POST) => {
                    generate::generate(Endpoint::Responses, req, ctx, capture_key).await
                }
                ("/v1/messages", &Method::POST) => {
                    generate::generate(Endpoint::Messages, req, ctx, capture_key)
                        .await
                        .map_err(ApiError::anthropic)
                }
                ("/v1/messages/count_tokens", &Method::POST) => {
                    let body = read_body(req).await?;
                    Ok(json_response(
                        api::anthropic::count_tokens(&body, &ctx.cfg, &ctx.adapters)?,
                        capture(),
                    ))
                }
                (
                    "/v1/models"
                    | "/v1/chat/completions"
                    | "/v1/completions"
                    | "/v1/responses"
                    | "/v1/messages"
                    | "/v1/messages/count_tokens",
                    _,
                ) => Err(ApiError::MethodNotAllowed),
                (p, m) if p.starts_with("/v1/responses/") => {
                    let rest = &p["/v1/responses/".len()..];
                    match (rest.strip_suffix("/cancel"), m) {
                        (Some(id), &Method::POST) => stored::cancel_response(id, ctx),
                        (None, &Method::GET) => {
                            stored::stored_response(rest, req.uri().query(), ctx, capture())
                        }
                        _ => Err(ApiError::MethodNotAllowed),
                    }
                }
                _ => Err(ApiError::RouteNotFound),
            }
        }
    }
}

/// vLLM's check, byte for byte: the header must equal `Bearer <key>`; CORS preflights pass.
fn authorize(req: &Request<Incoming>, ctx: &SimContext) -> Result<(), ApiError> {
    let Some(key) = ctx.cfg.api_key.as_deref() else {
        return Ok(());
    };
    if req.method() == Method::OPTIONS {
        return Ok(());
    }
    let ok = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .is_some_and(|presented| presented == key.as_bytes());
    if ok {
        Ok(())
    } else {
        Err(ApiError::Unauthorized)
    }
}

async fn read_body(req: Request<Incoming>) -> Result<bytes::Bytes, ApiError> {
    Ok(Limited::new(req.into_body(), MAX_REQUEST_BODY)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                ApiError::PayloadTooLarge
            } else {
                ApiError::BadRequest(format!("could not read the request body: {e}"))
            }
        })?
        .to_bytes())
}

/// `/tokenize` or `/detokenize`: answered at once, off the engine (as vLLM does).
async fn tokenizer(
    tokenize: bool,
    req: Request<Incoming>,
    ctx: &SimContext,
    capture_key: Option<&str>,
) -> Result<Response<SimBody>, ApiError> {
    ctx.stats.tokenizations.fetch_add(1, Relaxed);
    let body = read_body(req).await?;
    let answer = if tokenize {
        api::tokenizer::tokenize(&body, &ctx.cfg, &ctx.adapters)?
    } else {
        api::tokenizer::detokenize(&body, &ctx.cfg, &ctx.adapters)?
    };
    let capture = capture_key.and_then(|k| Capture::new(&ctx.stats, k.to_owned()));
    Ok(json_response(answer, capture))
}
