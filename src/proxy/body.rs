//! The body phase: a JSON body within the size limit, read whole (requests are small); an
//! audio route's `multipart/form-data` within its own, larger limit.

use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::HeaderMap;
use http::header::{self, HeaderValue};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::error::ApiError;
use crate::protocol::endpoint::BodyKind;

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

/// What a route's body may be: its kind, and the most bytes read (`setting` names the
/// config key that sets it).
#[derive(Debug, Clone, Copy)]
pub struct Accepted {
    pub kind: BodyKind,
    pub limit: usize,
    pub setting: &'static str,
}

/// The request body, or why it is refused: not of the route's media type (JSON; multipart for
/// the audio routes), too large (by `declared` length before reading, or while reading), or
/// unreadable. The whole body must arrive within `timeout` (a client trickling it cannot hold
/// its connection); no timer is armed when it is already there.
pub async fn read(
    headers: &HeaderMap,
    declared: Option<u64>,
    body: Incoming,
    accepted: Accepted,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    let Accepted {
        kind,
        limit,
        setting,
    } = accepted;
    let ct = headers.get(header::CONTENT_TYPE);
    let multipart = kind == BodyKind::Multipart;
    let fits = match ct {
        Some(ct) if multipart => is_multipart(ct),
        Some(ct) => is_json_content_type(ct),
        None => !multipart,
    };
    if !fits {
        return Err(ApiError::UnsupportedMediaType {
            got: ct.map_or_else(
                || "none".to_owned(),
                |ct| String::from_utf8_lossy(ct.as_bytes()).into_owned(),
            ),
            multipart,
        });
    }
    let too_large = ApiError::BodyTooLarge { limit, setting };
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large);
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
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large),
        Err(e) => Err(ApiError::BodyRead(e.to_string())),
    }
}

fn is_multipart(v: &HeaderValue) -> bool {
    let Ok(s) = v.to_str() else { return false };
    let mime = s.split(';').next().unwrap_or("").trim();
    mime.eq_ignore_ascii_case("multipart/form-data")
}

fn is_json_content_type(v: &HeaderValue) -> bool {
    let Ok(s) = v.to_str() else { return false };
    let mime = s.split(';').next().unwrap_or("").trim();
    mime.eq_ignore_ascii_case("application/json")
        || mime.len() > 5 && mime[mime.len() - 5..].eq_ignore_ascii_case("+json")
}
