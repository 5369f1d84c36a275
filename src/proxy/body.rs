//! The body phase: a JSON body within the size limit, read whole (requests are small).

use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::HeaderMap;
use http::header::{self, HeaderValue};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::error::ApiError;

/// The length a request's `Content-Length` declares (read before the header is cleaned away
/// for the backend, which gets the length of what is really sent).
pub fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// The request body, or why it is refused: not JSON, too large (by `declared` length before
/// reading, or while reading), or unreadable. The whole body must arrive within `timeout` (a
/// client trickling it cannot hold its connection); no timer is armed when it is already there.
pub async fn read(
    headers: &HeaderMap,
    declared: Option<u64>,
    body: Incoming,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE)
        && !is_json_content_type(ct)
    {
        return Err(ApiError::UnsupportedMediaType {
            got: String::from_utf8_lossy(ct.as_bytes()).into_owned(),
        });
    }
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let mut collect = std::pin::pin!(Limited::new(body, limit).collect());
    let collected = match collect.as_mut().now_or_never() {
        Some(done) => done,
        None => {
            tokio::time::timeout(timeout, collect)
                .await
                .map_err(|_| ApiError::BodyTimeout {
                    after_ms: timeout.as_millis(),
                })?
        }
    };
    match collected {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::BodyTooLarge { limit })
        }
        Err(e) => Err(ApiError::BodyRead(e.to_string())),
    }
}

fn is_json_content_type(v: &HeaderValue) -> bool {
    let Ok(s) = v.to_str() else { return false };
    let mime = s.split(';').next().unwrap_or("").trim();
    mime.eq_ignore_ascii_case("application/json")
        || mime.len() > 5 && mime[mime.len() - 5..].eq_ignore_ascii_case("+json")
}
