//! The pooling routes' path through the server: the answer computed by `sim::pooling`, held
//! back for one prefill through the engine.

use std::sync::atomic::Ordering::Relaxed;

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::api::error::ApiError;
use crate::args::PoolingTask;
use crate::body::{Capture, SimBody};
use crate::engine::Output;
use crate::pooling::{self, PoolingCall, PoolingRoute};

use super::{SimContext, json_response, read_body, unix_now};

/// A pooling request (`sim::pooling`): answered after one prefill through the engine, so
/// pooling requests queue and cost time alongside generations as they do in vLLM.
pub(super) async fn pooled(
    route: PoolingRoute,
    task: PoolingTask,
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
    let answer = pooling::answer(&call, &body, &ctx.cfg, &ctx.adapters)?;
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
        &crate::prefix_cache::PromptBlocks::default(),
        Output {
            max_tokens: 1,
            adapter: answer.adapter.clone(),
            ..Output::default()
        },
        arrived,
    );
    pass.collect_text().await;
    pass.finish();
    let capture = capture_key.and_then(|k| Capture::new(&ctx.stats, k.to_owned()));
    Ok(json_response(answer.body, capture))
}
