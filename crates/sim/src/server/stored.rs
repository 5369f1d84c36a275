//! The responses store's routes: `GET /v1/responses/{id}` (the stored object, or a background
//! response's events) and `POST /v1/responses/{id}/cancel`.

use http::Response;

use crate::agents;
use crate::api::error::ApiError;
use crate::body::{Capture, SimBody};

use super::{SimContext, event_stream, json_response};

/// `GET /v1/responses/{id}`: the stored response (404 without `--responses-store`, as vLLM).
/// With `?stream=true`, a streamed background response's events after `starting_after`; any
/// other response's stream is empty (vLLM answers 200 and closes it).
pub(super) fn stored_response(
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
pub(super) fn cancel_response(id: &str, ctx: &SimContext) -> Result<Response<SimBody>, ApiError> {
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
