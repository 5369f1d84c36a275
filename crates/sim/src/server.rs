//! HTTP side of the sim: the accept loop and one handler that reads top to bottom as vLLM's
//! request path (auth → route → parse → validate → fault → generate → respond).

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
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::agents;
use super::api::{self, ApiError, FinalAnswer};
use super::args::SimConfig;
use super::audio::{self, AudioFrames, SpeechTask};
use super::body::{Capture, Frames, SimBody, TokenStream};
use super::engine::{Engine, Output};
use super::frames::{Endpoint, FrameWriter};
use super::pooling::{self, PoolingCall, PoolingRoute};
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
    /// Numbers requests for `--fail-rate`, so the faulty fraction is reproducible per seed.
    fault_draws: AtomicU64,
}

impl SimContext {
    pub fn new(cfg: SimConfig, stats: Arc<SimStats>, engine: Engine) -> Self {
        Self {
            responses: cfg.responses_store.then(Default::default),
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
            match socket.listen(1024) {
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
    // Each frame is written as produced; Nagle would hold small frames back and distort ITL.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "sim could not set TCP_NODELAY");
    }
    let svc = service_fn(move |req| {
        let ctx = ctx.clone();
        async move { Ok::<_, Infallible>(handle(req, &ctx).await) }
    });
    // No header-read timer: hyper only arms it when a timer is configured, and the sim's
    // zero-delay mode is meant to measure a proxy hop without timer overhead.
    let conn = http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), svc);
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
                        pooled(route, task, req, ctx, capture_key).await
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
                    true => speech(task, req, ctx, capture_key).await,
                    false => Err(ApiError::MethodNotAllowed),
                };
            }
            if p == "/v1/chat/completions/batch" {
                return match post {
                    true => batch_chat(req, ctx, capture_key).await,
                    false => Err(ApiError::MethodNotAllowed),
                };
            }
            if !p.starts_with("/v1") {
                return Err(ApiError::RouteNotFound);
            }
            let capture = || capture_key.and_then(|k| Capture::new(&ctx.stats, k.to_owned()));
            match (p, req.method()) {
                ("/v1/models", &Method::GET) => Ok(json_response(
                    api::model_list(&ctx.cfg, unix_now()),
                    capture(),
                )),
                ("/v1/chat/completions", &Method::POST) => {
                    generate(Endpoint::Chat, req, ctx, capture_key).await
                }
                ("/v1/completions", &Method::POST) => {
                    generate(Endpoint::Completions, req, ctx, capture_key).await
                }
                ("/v1/responses", &Method::POST) => {
                    generate(Endpoint::Responses, req, ctx, capture_key).await
                }
                ("/v1/messages", &Method::POST) => {
                    generate(Endpoint::Messages, req, ctx, capture_key)
                        .await
                        .map_err(ApiError::anthropic)
                }
                ("/v1/messages/count_tokens", &Method::POST) => {
                    let body = read_body(req).await?;
                    Ok(json_response(
                        api::count_tokens(&body, &ctx.cfg)?,
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
                        (Some(id), &Method::POST) => cancel_response(id, ctx),
                        (None, &Method::GET) => {
                            stored_response(rest, req.uri().query(), ctx, capture())
                        }
                        _ => Err(ApiError::MethodNotAllowed),
                    }
                }
                _ => Err(ApiError::RouteNotFound),
            }
        }
    }
}

/// A pooling request (`sim::pooling`): answered after one prefill through the engine, so
/// pooling requests queue and cost time alongside generations as they do in vLLM.
async fn pooled(
    route: PoolingRoute,
    task: crate::args::PoolingTask,
    req: Request<Incoming>,
    ctx: &SimContext,
    capture_key: Option<&str>,
) -> Result<Response<SimBody>, ApiError> {
    let arrived = Instant::now();
    ctx.stats.requests.fetch_add(1, Relaxed);
    let body = read_body(req).await?;
    let call = PoolingCall {
        route,
        task,
        request_id: capture_key,
        created: unix_now(),
    };
    let answer = pooling::answer(&call, &body, &ctx.cfg)?;
    if ctx.draw_failure() {
        ctx.stats.failed_injected.fetch_add(1, Relaxed);
        return Err(ApiError::InjectedFailure);
    }
    ctx.stats
        .engine
        .prompt_tokens
        .fetch_add(u64::from(answer.prompt_tokens), Relaxed);
    let mut pass = ctx.engine.start(
        ctx.stats.clone(),
        answer.prompt_tokens,
        &[],
        Output {
            max_tokens: 1,
            ..Output::default()
        },
        arrived,
    );
    pass.collect_text().await;
    pass.finish();
    let capture = capture_key.and_then(|k| Capture::new(&ctx.stats, k.to_owned()));
    Ok(json_response(answer.body, capture))
}

/// `/v1/audio/transcriptions` and `/translations` (`sim::audio`): the words come from the
/// engine like a generation's, streamed as vLLM's chunks or collected into one answer.
async fn speech(
    task: SpeechTask,
    req: Request<Incoming>,
    ctx: &SimContext,
    capture_key: Option<&str>,
) -> Result<Response<SimBody>, ApiError> {
    let arrived = Instant::now();
    ctx.stats.requests.fetch_add(1, Relaxed);
    let content_type = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = read_body(req).await?;
    let parsed = audio::parse(content_type.as_deref(), body, &ctx.cfg).await?;
    if ctx.draw_failure() {
        ctx.stats.failed_injected.fetch_add(1, Relaxed);
        return Err(ApiError::InjectedFailure);
    }
    let request_id = match capture_key {
        Some(id) => id.to_owned(),
        None => format!("{:016x}", rand::random::<u64>()),
    };
    let id = format!("{}{request_id}", task.id_prefix());
    ctx.stats
        .engine
        .prompt_tokens
        .fetch_add(u64::from(parsed.prompt_tokens), Relaxed);
    let mut generation = ctx.engine.start(
        ctx.stats.clone(),
        parsed.prompt_tokens,
        &[],
        Output {
            max_tokens: parsed.max_tokens,
            token_seed: parsed.token_seed,
            priority: 0,
        },
        arrived,
    );
    let capture = Capture::new(&ctx.stats, request_id);
    if parsed.stream {
        let frames = Frames::Audio(AudioFrames::new(
            task,
            &id,
            unix_now(),
            ctx.cfg.model_name(),
            parsed.prompt_tokens,
            parsed.continuous_usage,
        ));
        let stream = TokenStream::new(
            generation,
            frames,
            false,
            parsed.include_usage,
            ctx.cfg.fault,
            capture,
        )
        .ending(parsed.natural_end);
        return Ok(event_stream(SimBody::Stream(Box::new(stream))));
    }
    let text = generation.collect_text().await;
    generation.finish();
    Ok(json_response(
        audio::answer_json(task, &text, parsed.duration_s),
        capture,
    ))
}

/// `/v1/chat/completions/batch`: the conversations run side by side in the engine and are
/// answered together. With `stream: true` vLLM 0.32 still answers one JSON body, but its
/// per-token outputs leave each choice holding only its last token (and usage counting one
/// completion token a conversation): the sim answers the same.
async fn batch_chat(
    req: Request<Incoming>,
    ctx: &SimContext,
    capture_key: Option<&str>,
) -> Result<Response<SimBody>, ApiError> {
    let arrived = Instant::now();
    let body = read_body(req).await?;
    let batch = api::parse_batch(&body, &ctx.cfg)?;
    if ctx.draw_failure() {
        ctx.stats.failed_injected.fetch_add(1, Relaxed);
        return Err(ApiError::InjectedFailure);
    }
    let runs = batch.conversations.iter().map(|c| {
        ctx.stats.requests.fetch_add(1, Relaxed);
        ctx.stats
            .engine
            .prompt_tokens
            .fetch_add(u64::from(c.prompt_tokens), Relaxed);
        let mut generation = ctx.engine.start(
            ctx.stats.clone(),
            c.prompt_tokens,
            &[],
            Output {
                max_tokens: c.max_tokens,
                token_seed: c.token_seed,
                priority: c.priority,
            },
            arrived,
        );
        let (natural_end, only_last) = (c.natural_end, batch.stream);
        async move {
            let mut text = String::new();
            while let Some(t) = std::future::poll_fn(|cx| generation.poll_token(cx)).await {
                if only_last {
                    text.clear();
                }
                text.push_str(t);
            }
            generation.finish();
            api::BatchAnswer {
                text,
                finish_reason: if natural_end { "stop" } else { "length" },
                prompt_tokens: generation.prompt_tokens,
                completion_tokens: if only_last { 1 } else { generation.emitted() },
            }
        }
    });
    let answers = futures_util::future::join_all(runs).await;
    let request_id = match capture_key {
        Some(id) => id.to_owned(),
        None => format!("{:016x}", rand::random::<u64>()),
    };
    let id = format!("chatcmpl-{request_id}");
    let body = api::batch_chat_json(&id, unix_now(), ctx.cfg.model_name(), &answers);
    Ok(json_response(body, Capture::new(&ctx.stats, request_id)))
}

/// `GET /v1/responses/{id}`: the stored response (404 without `--responses-store`, as vLLM).
/// With `?stream=true`, a streamed background response's events after `starting_after`; any
/// other response's stream is empty (vLLM answers 200 and closes it).
fn stored_response(
    id: &str,
    query: Option<&str>,
    ctx: &SimContext,
    capture: Option<Capture>,
) -> Result<Response<SimBody>, ApiError> {
    let store = ctx.responses.as_ref();
    let found = store.and_then(|s| s.get(id));
    let r = found.ok_or_else(|| agents::response_not_found(id))?;
    let param = |name: &str| {
        query?
            .split('&')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
    };
    if param("stream") == Some("true") {
        let after = param("starting_after").and_then(|v| v.parse().ok());
        let events = store.and_then(|s| s.replay(id, after)).unwrap_or_default();
        return Ok(event_stream(SimBody::full(events, capture)));
    }
    Ok(json_response(
        serde_json::to_vec(&r).unwrap_or_default(),
        capture,
    ))
}

/// `POST /v1/responses/{id}/cancel`: a background response that still runs stops and reads
/// `cancelled`; any other is refused with vLLM's message (it says "synchronous" for a finished
/// background response too).
fn cancel_response(id: &str, ctx: &SimContext) -> Result<Response<SimBody>, ApiError> {
    let store = ctx
        .responses
        .as_ref()
        .ok_or_else(|| agents::response_not_found(id))?;
    match store.cancel(id) {
        Ok(object) => Ok(json_response(
            serde_json::to_vec(&object).unwrap_or_default(),
            None,
        )),
        Err(agents::CancelRefused::NotFound) => Err(agents::response_not_found(id)),
        Err(agents::CancelRefused::NotRunning) => Err(ApiError::Flat {
            status: http::StatusCode::BAD_REQUEST,
            message: "Cannot cancel a synchronous response.".into(),
            kind: "invalid_request_error",
            param: Some("response_id"),
        }),
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
        api::tokenize(&body, &ctx.cfg)?
    } else {
        api::detokenize(&body, &ctx.cfg)?
    };
    let capture = capture_key.and_then(|k| Capture::new(&ctx.stats, k.to_owned()));
    Ok(json_response(answer, capture))
}

async fn generate(
    endpoint: Endpoint,
    req: Request<Incoming>,
    ctx: &SimContext,
    capture_key: Option<&str>,
) -> Result<Response<SimBody>, ApiError> {
    let arrived = Instant::now();
    ctx.stats.requests.fetch_add(1, Relaxed);
    // vLLM 0.32 takes a request's priority from `X-Vllm-Priority` when present, before the
    // body's `priority`.
    let header_priority = req
        .headers()
        .get("x-vllm-priority")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<i64>().ok());
    let body = read_body(req).await?;
    let mut parsed = api::parse_generation(endpoint, &body, &ctx.cfg)?;
    if let Some(p) = header_priority {
        parsed.priority = p;
    }
    if ctx.draw_failure() {
        ctx.stats.failed_injected.fetch_add(1, Relaxed);
        return Err(ApiError::InjectedFailure);
    }

    let extras = &parsed.responses;
    if endpoint == Endpoint::Responses {
        if extras.background && !extras.store {
            return Err(ApiError::BadParam {
                message: "background can only be used when `store` is true (parameter=background)"
                    .into(),
                param: "background",
            });
        }
        if extras.background && ctx.responses.is_none() {
            return Err(ApiError::Flat {
                status: http::StatusCode::BAD_REQUEST,
                message: "This vLLM engine does not support `store=True` and therefore does not support the background mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.".into(),
                kind: "invalid_request_error",
                param: Some("background"),
            });
        }
        if let Some(prev) = &extras.previous_response_id
            && ctx.responses.as_ref().and_then(|s| s.get(prev)).is_none()
        {
            return Err(agents::response_not_found(prev));
        }
    }

    let request_id = match capture_key {
        Some(id) => id.to_owned(),
        // vLLM's ids: 16 hex characters.
        None => format!("{:016x}", rand::random::<u64>()),
    };
    let id = format!("{}{request_id}", endpoint.id_prefix());
    let created = unix_now();
    let model = ctx.cfg.model_name();
    ctx.stats
        .engine
        .prompt_tokens
        .fetch_add(u64::from(parsed.prompt_tokens), Relaxed);
    let mut generation = ctx.engine.start(
        ctx.stats.clone(),
        parsed.prompt_tokens,
        &parsed.prompt_blocks,
        Output {
            max_tokens: parsed.max_tokens,
            token_seed: parsed.token_seed,
            priority: parsed.priority,
        },
        arrived,
    );
    let capture = Capture::new(&ctx.stats, request_id);
    let store = ctx
        .responses
        .clone()
        .filter(|_| endpoint == Endpoint::Responses && parsed.responses.store);
    let mut object = (endpoint == Endpoint::Responses).then(|| {
        let mut o = agents::ResponseObject::new(
            id.clone(),
            created,
            model,
            parsed.responses.instructions.clone(),
            parsed
                .responses
                .max_output_tokens
                .unwrap_or(parsed.max_tokens),
            parsed.responses.previous_response_id.clone(),
        );
        o.tools.clone_from(&parsed.responses.tools);
        o.tool_choice = parsed.responses.tool_choice;
        o.cached_tokens = generation.cached_tokens;
        o
    });
    let msg_id = || format!("msg_{:016x}", rand::random::<u64>());
    // Background mode (store required, checked above): stored at once, generated on.
    let background = store.clone().filter(|_| parsed.responses.background);
    if let (Some(store), Some(object)) = (&background, &mut object) {
        object.background = true;
        if !parsed.stream {
            object.status = "queued";
        }
        store.put(object);
    }
    if let (Some(store), Some(mut object), false) = (background, object.clone(), parsed.stream) {
        let answer = serde_json::to_vec(&object).unwrap_or_default();
        let natural_end = parsed.natural_end;
        let msg = msg_id();
        let running = store.clone();
        // Dropping the task (a cancel aborts it) drops the generation: the engine's cancel.
        let task = tokio::spawn(async move {
            let text = generation.collect_text().await;
            generation.finish();
            let (prompt, completion) = (generation.prompt_tokens, generation.emitted());
            object.complete(&msg, &text, prompt, completion, !natural_end);
            running.put(&object);
        });
        store.running_task(&id, task.abort_handle());
        return Ok(json_response(answer, capture));
    }

    // A streamed background response runs on when its client leaves (vLLM runs it in a task of
    // its own and the stream reads its events).
    let detached = store.clone().filter(|_| parsed.responses.background);
    if parsed.stream {
        let frames = match endpoint {
            Endpoint::Chat | Endpoint::Completions => {
                let mut frames = FrameWriter::new(endpoint, &id, created, model);
                if parsed.continuous_usage {
                    frames.continuous_usage(parsed.prompt_tokens);
                }
                if ctx.cfg.prompt_tokens_details {
                    frames.prompt_tokens_details(generation.cached_tokens);
                }
                Frames::Chat(frames)
            }
            Endpoint::Responses => Frames::Responses(
                Box::new(agents::ResponsesFrames::new(
                    object.unwrap_or_else(|| {
                        agents::ResponseObject::new(id.clone(), created, model, None, 0, None)
                    }),
                    msg_id(),
                )),
                store,
            ),
            Endpoint::Messages => Frames::Messages(agents::MessagesFrames::new(
                id.clone(),
                model,
                parsed.prompt_tokens,
            )),
        };
        let stream = TokenStream::new(
            generation,
            frames,
            endpoint == Endpoint::Chat,
            parsed.include_usage,
            ctx.cfg.fault,
            capture,
        )
        .ending(parsed.natural_end);
        let body = SimBody::Stream(Box::new(stream));
        if let Some(store) = detached {
            return Ok(event_stream(SimBody::detached(body, |task| {
                store.running_task(&id, task);
            })));
        }
        return Ok(event_stream(body));
    }

    // If the client leaves while we wait here, hyper drops this future and with it the
    // generation, which is the cancellation signal.
    let text = generation.collect_text().await;
    generation.finish();
    let (prompt, completion) = (generation.prompt_tokens, generation.emitted());
    match (endpoint, object) {
        (Endpoint::Responses, Some(mut object)) => {
            object.complete(&msg_id(), &text, prompt, completion, !parsed.natural_end);
            if let Some(store) = store {
                store.put(&object);
            }
            return Ok(json_response(
                serde_json::to_vec(&object).unwrap_or_default(),
                capture,
            ));
        }
        (Endpoint::Messages, _) => {
            return Ok(json_response(
                agents::message_json(
                    &id,
                    model,
                    &text,
                    prompt,
                    completion,
                    ctx.cfg
                        .prompt_tokens_details
                        .then_some(generation.cached_tokens),
                    !parsed.natural_end,
                ),
                capture,
            ));
        }
        _ => {}
    }
    let answer = FinalAnswer {
        endpoint,
        id: &id,
        created,
        model,
        text: &text,
        finish_reason: if parsed.natural_end { "stop" } else { "length" },
        prompt_tokens: generation.prompt_tokens,
        completion_tokens: generation.emitted(),
        cached_tokens: ctx
            .cfg
            .prompt_tokens_details
            .then_some(generation.cached_tokens),
    };
    Ok(json_response(answer.to_json(), capture))
}
