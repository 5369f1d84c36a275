//! `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (with VLLM_ALLOW_RUNTIME_LORA_UPDATING),
//! on the adapters of `sim::lora`. vLLM answers a success as plain text with no content type
//! (FastAPI's `Response(content=...)`), an error in its JSON error shape.

use http::{Request, Response};
use hyper::body::Incoming;

use crate::api::{self, error::ApiError};
use crate::body::SimBody;
use crate::lora::{LoadRequest, UnloadRequest};

use super::{SimContext, read_body};

pub(super) async fn load(
    req: Request<Incoming>,
    ctx: &SimContext,
) -> Result<Response<SimBody>, ApiError> {
    let body = read_body(req).await?;
    let r: LoadRequest = api::validate(&body)?;
    let done = ctx
        .adapters
        .load(r, &ctx.cfg, ctx.cfg.lora_load_delay)
        .await?;
    Ok(Response::new(SimBody::full(done, None)))
}

pub(super) async fn unload(
    req: Request<Incoming>,
    ctx: &SimContext,
) -> Result<Response<SimBody>, ApiError> {
    let body = read_body(req).await?;
    let r: UnloadRequest = api::validate(&body)?;
    let done = ctx.adapters.unload(r).await?;
    Ok(Response::new(SimBody::full(done, None)))
}
