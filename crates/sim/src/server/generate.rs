//! The generation routes: chat, completions, Responses and Anthropic messages (streamed, or
//! collected into one answer, or run in the background for the responses store), and the chat
//! batch, whose conversations run side by side in the engine.

use std::sync::atomic::Ordering::Relaxed;

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::agents;
use crate::api::answer::FinalAnswer;
use crate::api::batch::{self, BatchAnswer};
use crate::api::error::ApiError;
use crate::api::generation::parse_generation;
use crate::body::{Capture, Frames, SimBody, TokenStream};
use crate::engine::Output;
use crate::frames::{Endpoint, FrameWriter};
use crate::lora::answer_model;

use super::{SimContext, event_stream, json_response, read_body, unix_now};

/// `/v1/chat/completions/batch`: the conversations run side by side in the engine and are
/// answered together. With `stream: true` vLLM 0.32 still answers one JSON body, but its
/// per-token outputs leave each choice holding only its last token (and usage counting one
/// completion token a conversation): the sim answers the same.
pub(super) async fn batch_chat(
    req: Request<Incoming>,
    ctx: &SimContext,
    capture_key: Option<&str>,
) -> Result<Response<SimBody>, ApiError> {
    let arrived = Instant::now();
    let body = read_body(req).await?;
    let batch = batch::parse_batch(&body, &ctx.cfg, &ctx.adapters)?;
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
            &crate::prefix_cache::PromptBlocks::default(),
            Output {
                max_tokens: c.max_tokens,
                token_seed: c.token_seed,
                skip: c.token_skip,
                priority: c.priority,
                adapter: c.adapter.clone(),
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
            BatchAnswer {
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
    // Every conversation names the batch's one `model`.
    let adapter = batch
        .conversations
        .first()
        .and_then(|c| c.adapter.as_deref());
    let model = answer_model(&ctx.cfg, adapter);
    let body = batch::batch_chat_json(&id, unix_now(), model, &answers);
    Ok(json_response(body, Capture::new(&ctx.stats, request_id)))
}

pub(super) async fn generate(
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
    let mut parsed = parse_generation(endpoint, &body, &ctx.cfg, &ctx.adapters)?;
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
    let model = answer_model(&ctx.cfg, parsed.adapter.as_deref());
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
            skip: parsed.token_skip,
            priority: parsed.priority,
            adapter: parsed.adapter.clone(),
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
