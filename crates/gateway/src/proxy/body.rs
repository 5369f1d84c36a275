//! The body step. The head as a backend would get it is cleaned (`headers`) and refused here
//! when a backend would refuse it: before the body is read, and without a backend charged for
//! the client's headers. Then the body: JSON within the size limit, read whole (requests are
//! small); an audio route's `multipart/form-data` within its own, larger limit; and the bound
//! on the bytes of bodies still arriving that the gateway holds (`PendingBodies`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use dashmap::DashMap;
use futures_util::FutureExt;
use http::header::{self, HeaderValue};
use http::{HeaderMap, Request, Uri};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::error::{ApiError, PendingScope};
use super::headers::{self, Outgoing};
use super::state::ProxyState;
use crate::telemetry::RequestRecord;
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::endpoint::BodyKind;

/// A request's head once its body has been read: as a backend gets it, with its target.
pub(super) struct Head {
    pub(super) outgoing: Outgoing,
    pub(super) uri: Uri,
    pub(super) body_read: Instant,
}

/// The head cleaned and checked, then the body within its endpoint's limit.
pub(super) async fn receive(
    state: &ProxyState,
    endpoint: Endpoint,
    req: Request<Incoming>,
    record: &mut RequestRecord,
) -> Result<(Head, Bytes), ApiError> {
    let (parts, body) = req.into_parts();
    let declared = declared_length(&parts.headers);
    let sender = headers::Sender {
        peer: record.client_addr.map(|a| a.ip()),
        authority: parts.uri.authority(),
    };
    let outgoing = headers::outgoing(parts.headers, &state.forwarding, sender);
    let backend_part = state.generation.load().max_backend_head;
    headers::check_head(
        &outgoing.headers,
        &record.request_id,
        backend_part,
        state.head_limits,
    )
    .map_err(ApiError::HeadersTooLarge)?;
    let kind = endpoint.needs().body;
    let accepted = match kind {
        BodyKind::Multipart => Accepted {
            kind,
            limit: state.max_audio_body_bytes,
            setting: "server.max_audio_body_bytes",
        },
        BodyKind::Json | BodyKind::None => Accepted {
            kind,
            limit: state.max_body_bytes,
            setting: "server.max_body_bytes",
        },
    };
    let body = read(
        &outgoing.headers,
        declared,
        body,
        accepted,
        state.body_timeouts,
        (&state.pending_bodies, record.key.as_ref().map(|k| k.id)),
    )
    .await?;
    let body_read = Instant::now();
    record.timeline.stamp_body_read(body_read);
    let head = Head {
        outgoing,
        uri: parts.uri,
        body_read,
    };
    Ok((head, body))
}

/// The length a request's `Content-Length` declares (read before the header is cleaned away
/// for the backend, which gets the length of what is really sent).
pub(crate) fn declared_length(headers: &HeaderMap) -> Option<u64> {
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
pub(crate) struct Accepted {
    pub(crate) kind: BodyKind,
    pub(crate) limit: usize,
    pub(crate) setting: &'static str,
}

/// How long a body may take: all of it within `total` after its head, and never a pause of
/// more than `idle` between two of its reads (a body that stopped arriving).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyTimeouts {
    pub(crate) total: Duration,
    pub(crate) idle: Duration,
}

/// The request body, or why it is refused: not of the route's media type (JSON; multipart for
/// the audio routes), too large (by `declared` length before reading, or while reading),
/// unreadable, too slow, or past what the gateway holds of bodies still arriving
/// (`PendingBodies`). A body that came with its head is taken as it is: no timer, no
/// reservation. One that must be waited for first reserves its declared length (the route's
/// limit when it declares none), across the gateway and for its key, and gives it back once
/// it is read (or refused).
pub(crate) async fn read(
    headers: &HeaderMap,
    declared: Option<u64>,
    body: Incoming,
    accepted: Accepted,
    timeouts: BodyTimeouts,
    pending: (&PendingBodies, Option<i64>),
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
    let mut body = Limited::new(body, limit);
    let mut parts = Parts::default();
    // What already arrived with the head: most JSON bodies are all there.
    loop {
        match body.frame().now_or_never() {
            Some(Some(frame)) => parts.take(frame, &too_large)?,
            Some(None) => return Ok(parts.into_bytes()),
            None => break,
        }
    }
    let (pending, key) = pending;
    let reserve = declared.map_or(limit, |d| usize::try_from(d).unwrap_or(usize::MAX));
    let _hold = pending.hold(key, reserve)?;
    let deadline = tokio::time::Instant::now() + timeouts.total;
    loop {
        let quiet = tokio::time::Instant::now() + timeouts.idle;
        match tokio::time::timeout_at(quiet.min(deadline), body.frame()).await {
            Ok(Some(frame)) => parts.take(frame, &too_large)?,
            Ok(None) => return Ok(parts.into_bytes()),
            Err(_) if quiet < deadline => {
                return Err(ApiError::BodyStalled {
                    after_ms: timeouts.idle.as_millis(),
                });
            }
            Err(_) => {
                return Err(ApiError::BodyTimeout {
                    after_ms: timeouts.total.as_millis(),
                });
            }
        }
    }
}

/// The chunks of a body as they came: only a body of several chunks allocates a list (most
/// JSON bodies come in one); `into_bytes` makes either one buffer of the body's own.
#[derive(Default)]
struct Parts {
    first: Option<Bytes>,
    more: Vec<Bytes>,
    len: usize,
}

impl Parts {
    fn take(
        &mut self,
        frame: Result<http_body::Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>,
        too_large: &ApiError,
    ) -> Result<(), ApiError> {
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data()
                    && !data.is_empty()
                {
                    self.len += data.len();
                    match self.first {
                        None => self.first = Some(data),
                        Some(_) => self.more.push(data),
                    }
                }
                Ok(())
            }
            Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large.clone()),
            Err(e) => Err(ApiError::BodyRead(e.to_string())),
        }
    }

    fn into_bytes(self) -> Bytes {
        let first = self.first.unwrap_or_default();
        if self.more.is_empty() {
            // A copy: the chunk is a slice of the connection's read buffer (8 KiB, or more
            // once hyper has grown it), and the body can live as long as the answer (a stream
            // that may be resumed keeps it for its whole length), the buffer with it, while
            // the connection reads into another beside it.
            return Bytes::copy_from_slice(&first);
        }
        let mut all = BytesMut::with_capacity(self.len);
        all.extend_from_slice(&first);
        for c in &self.more {
            all.extend_from_slice(c);
        }
        all.freeze()
    }
}

/// The bytes of request bodies still arriving, for the whole gateway (every worker) and per
/// key: each such body holds its declared length until it is read whole. Without it, any
/// valid key could open connections that each send a large body one byte short and hold the
/// gateway's memory until their timeouts fire; with it, past either bound a new one is
/// refused at once (503 for the gateway's, 429 for the key's), before its bytes are read.
/// Bodies already read are bounded by the key's concurrency and the queue, not here.
#[derive(Debug)]
pub(crate) struct PendingBodies {
    held: AtomicUsize,
    limit: usize,
    per_key: usize,
    by_key: DashMap<i64, usize>,
}

impl PendingBodies {
    pub(crate) fn new(limit: usize, per_key: usize) -> Self {
        Self {
            held: AtomicUsize::new(0),
            limit,
            per_key,
            by_key: DashMap::new(),
        }
    }

    /// Hold `bytes` for a body of `key` until the hold drops, or say which bound it passes.
    pub(crate) fn hold(&self, key: Option<i64>, bytes: usize) -> Result<PendingHold<'_>, ApiError> {
        let refused = |scope| ApiError::PendingBodies {
            scope,
            limit: match scope {
                PendingScope::Gateway => self.limit,
                PendingScope::Key => self.per_key,
            },
        };
        if self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .is_err()
        {
            return Err(refused(PendingScope::Gateway));
        }
        if let Some(id) = key {
            let mut mine = self.by_key.entry(id).or_insert(0);
            if mine.saturating_add(bytes) > self.per_key {
                drop(mine);
                self.by_key.remove_if(&id, |_, held| *held == 0);
                self.held.fetch_sub(bytes, Ordering::AcqRel);
                return Err(refused(PendingScope::Key));
            }
            *mine += bytes;
        }
        Ok(PendingHold {
            of: self,
            key,
            bytes,
        })
    }
}

/// A body's place in `PendingBodies`, given back when dropped.
#[derive(Debug)]
pub(crate) struct PendingHold<'a> {
    of: &'a PendingBodies,
    key: Option<i64>,
    bytes: usize,
}

impl Drop for PendingHold<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.key
            && let Some(mut mine) = self.of.by_key.get_mut(&id)
        {
            *mine = mine.saturating_sub(self.bytes);
            drop(mine);
            self.of.by_key.remove_if(&id, |_, held| *held == 0);
        }
        self.of.held.fetch_sub(self.bytes, Ordering::AcqRel);
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
