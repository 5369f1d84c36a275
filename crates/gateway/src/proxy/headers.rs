//! The request's head as a backend gets it: the client's headers without hop-by-hop ones and
//! credentials, the forwarding headers the gateway sets (`X-Forwarded-*`, believed from a
//! trusted proxy only), and the head limits a backend would enforce, checked before the body is
//! read.

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use super::error::HeadExcess;

pub(crate) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// Read by the OpenAI and Anthropic SDKs (and so by Codex and Claude Code) before their own
/// retry rules: `false` stops them retrying an answer that will not change, such as a revoked
/// key's 401, which Claude Code otherwise retries for minutes.
pub(crate) static X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
pub(crate) static APPLICATION_JSON: HeaderValue = HeaderValue::from_static("application/json");
pub(crate) static TEXT_EVENT_STREAM: HeaderValue = HeaderValue::from_static("text/event-stream");
pub(crate) static NO_CACHE: HeaderValue = HeaderValue::from_static("no-cache");

/// The client's `x-request-id` if usable, else a new one: `fg-`, a per-process random prefix
/// (which replica made it), and 96 random bits: unguessable (a stored response's id is made
/// from it) and unique across replicas.
pub(crate) fn request_id(headers: &HeaderMap) -> HeaderValue {
    if let Some(v) = headers.get(&X_REQUEST_ID)
        && !v.is_empty()
        && v.len() <= 128
    {
        return v.clone();
    }
    static PREFIX: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let prefix = *PREFIX.get_or_init(rand::random::<u32>);
    let bits: u128 = rand::random();
    let mut buf = [0u8; 3 + 8 + 1 + 24];
    buf[..3].copy_from_slice(b"fg-");
    hex_into(&mut buf[3..11], u64::from(prefix), 8);
    buf[11] = b'-';
    hex_into(&mut buf[12..20], (bits >> 64) as u64, 8);
    hex_into(&mut buf[20..], bits as u64, 16);
    HeaderValue::from_bytes(&buf).unwrap_or_else(|_| HeaderValue::from_static("fg-invalid"))
}

fn hex_into(out: &mut [u8], mut v: u64, digits: usize) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for i in (0..digits).rev() {
        out[i] = HEX[(v & 0xf) as usize];
        v >>= 4;
    }
}

/// Headers of the client's never passed upstream besides the hop-by-hop ones and `host` (taken
/// out first by `outgoing`, for `X-Forwarded-Host`; the backend's own is sent): its credentials
/// (the pool's own upstream key is sent instead), `content-length` and `x-request-id` (the
/// gateway sets both), `accept-encoding` (the relay must see plain SSE), `expect` and `cookie`;
/// and the headers vLLM reads as instructions from whoever deploys it, not from its clients:
/// `x-data-parallel-rank` picks the engine rank a request runs on (the fleet's router's
/// choice, not a client's), `endpoint-load-metrics-format` asks for the engine's load report
/// in the answer's head, and `x-vllm-priority` sets the request's place in the engine's queue
/// ahead of the body's `priority` (vLLM 0.32): a client would otherwise claim a better place
/// than `[pools.priority]` gives its environment.
static STRIP_UPSTREAM: [HeaderName; 8] = [
    header::AUTHORIZATION,
    header::CONTENT_LENGTH,
    header::ACCEPT_ENCODING,
    header::EXPECT,
    header::COOKIE,
    HeaderName::from_static("x-data-parallel-rank"),
    HeaderName::from_static("endpoint-load-metrics-format"),
    HeaderName::from_static("x-vllm-priority"),
];

/// Hop-by-hop headers by definition (RFC 9110 §7.6.1, and the older `Keep-Alive` and
/// `Proxy-Connection` it names), removed in both directions with the ones `Connection` names.
/// `Trailer` too: the gateway frames every body anew.
static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

/// Remove `Connection`, every header it names, and the hop-by-hop ones (RFC 9110 §7.6.1).
/// Without a `Connection` header (every HTTP/2 request, most HTTP/1.1 ones) this is a few
/// lookups; one `Connection` line is taken out and read in place; only several lines are
/// copied out first (their names cannot be removed while the map is borrowed).
pub(super) fn strip_hop_by_hop(h: &mut HeaderMap) {
    let (one, more) = {
        let mut lines = h.get_all(header::CONNECTION).iter();
        (lines.next().is_some(), lines.next().is_some())
    };
    if more {
        let lines: Vec<HeaderValue> = h.get_all(header::CONNECTION).iter().cloned().collect();
        for line in &lines {
            remove_named(h, line);
        }
    } else if one && let Some(line) = h.remove(header::CONNECTION) {
        remove_named(h, &line);
    }
    for name in &HOP_BY_HOP {
        h.remove(name);
    }
}

/// Remove the headers a `Connection` value names (a comma-separated list of field names).
fn remove_named(h: &mut HeaderMap, connection: &HeaderValue) {
    for token in connection.as_bytes().split(|b| *b == b',') {
        if let Ok(name) = std::str::from_utf8(token.trim_ascii())
            && !name.is_empty()
        {
            h.remove(name);
        }
    }
}

/// How forwarded requests say whom they came from (`server.forwarded_headers`,
/// `server.trusted_proxies`), made once from config.
#[derive(Debug, Clone)]
pub(crate) struct Forwarding {
    /// Set `X-Forwarded-For`, `-Proto` and `-Host` (false: the client's go, none are set).
    pub(crate) enabled: bool,
    /// Peers whose own forwarding headers are kept (and extended).
    pub(crate) trusted: Vec<ipnet::IpNet>,
    /// `http` or `https`: how the client reached this listener.
    pub(crate) proto: HeaderValue,
}

impl Forwarding {
    pub(crate) fn new(server: &crate::config::ServerConfig) -> Self {
        Self {
            enabled: server.forwarded_headers,
            trusted: server.trusted_proxies.clone(),
            proto: HeaderValue::from_static(if server.tls.is_some() {
                "https"
            } else {
                "http"
            }),
        }
    }
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Headers by which a sender states another client address, host, scheme or prefix: believed
/// only from a trusted proxy, else removed (and the gateway's own set).
static CLIENT_CLAIMS: [HeaderName; 8] = [
    header::FORWARDED,
    X_FORWARDED_FOR,
    X_FORWARDED_HOST,
    X_FORWARDED_PROTO,
    HeaderName::from_static("x-forwarded-port"),
    HeaderName::from_static("x-forwarded-prefix"),
    HeaderName::from_static("x-real-ip"),
    HeaderName::from_static("x-client-ip"),
];

/// Path overrides some frameworks obey instead of the request line: never forwarded, from
/// anyone — the gateway forwards only the routes it knows, and a backend must see those.
static PATH_OVERRIDES: [HeaderName; 2] = [
    HeaderName::from_static("x-original-url"),
    HeaderName::from_static("x-rewrite-url"),
];

/// Who sent the request, as the listener saw it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sender<'a> {
    pub(crate) peer: Option<std::net::IpAddr>,
    /// The request's authority (HTTP/2's `:authority`; HTTP/1.1 has it in `Host`).
    pub(crate) authority: Option<&'a http::uri::Authority>,
}

/// Replace (or, from a trusted proxy, extend) the forwarding headers: `X-Forwarded-For` ends
/// with the peer's address, `X-Forwarded-Proto` and `-Host` say how the client reached the
/// gateway. `host` is the client's `Host` (read before it was removed).
fn forwarding(
    headers: &mut HeaderMap,
    fwd: &Forwarding,
    sender: Sender<'_>,
    host: Option<HeaderValue>,
) {
    for name in &PATH_OVERRIDES {
        headers.remove(name);
    }
    let peer = sender.peer.map(|ip| ip.to_canonical());
    let trusted = fwd.enabled && peer.is_some_and(|ip| fwd.trusted.iter().any(|n| n.contains(&ip)));
    let prior = if trusted {
        join_lines(headers, &X_FORWARDED_FOR)
    } else {
        for name in &CLIENT_CLAIMS {
            headers.remove(name);
        }
        None
    };
    let (true, Some(ip)) = (fwd.enabled, peer) else {
        return;
    };
    // One allocation: the peer's address (at most 39 bytes) after the trusted chain, if any.
    let mut value = prior.unwrap_or_else(|| Vec::with_capacity(40));
    if !value.is_empty() {
        value.extend_from_slice(b", ");
    }
    {
        use std::io::Write as _;
        let _ = write!(value, "{ip}");
    }
    if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(value)) {
        headers.insert(X_FORWARDED_FOR, v);
    }
    if !headers.contains_key(&X_FORWARDED_PROTO) {
        headers.insert(X_FORWARDED_PROTO, fwd.proto.clone());
    }
    if !headers.contains_key(&X_FORWARDED_HOST) {
        let host = host.or_else(|| {
            sender
                .authority
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        if let Some(h) = host {
            headers.insert(X_FORWARDED_HOST, h);
        }
    }
}

/// Every line of `name` joined with ", " (a list header may come in several lines); taken out.
fn join_lines(headers: &mut HeaderMap, name: &HeaderName) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    for v in headers.get_all(name) {
        let o = out.get_or_insert_with(|| Vec::with_capacity(v.len() + 48));
        if !o.is_empty() {
            o.extend_from_slice(b", ");
        }
        o.extend_from_slice(v.as_bytes());
    }
    headers.remove(name);
    out
}

/// The client's headers as they will go upstream, with what the gateway read of the ones
/// that do not.
#[derive(Clone)]
pub(crate) struct Outgoing {
    pub(crate) headers: HeaderMap,
    /// The client accepts trailers (`TE: trailers`): a stream's `Server-Timing`, with the hop
    /// cost known only after its first token, comes as a trailer.
    pub(crate) trailers: bool,
}

/// Clean the client's headers for the backend: done first, so that the head limit measures
/// what would really be forwarded. `TE` is read before it goes (it is hop-by-hop, and often
/// named in `Connection` as RFC 9110 asks).
pub(crate) fn outgoing(mut headers: HeaderMap, fwd: &Forwarding, sender: Sender<'_>) -> Outgoing {
    let trailers = accepts_trailers(&headers);
    strip_hop_by_hop(&mut headers);
    let host = headers.remove(header::HOST);
    for name in &STRIP_UPSTREAM {
        headers.remove(name);
    }
    forwarding(&mut headers, fwd, sender, host);
    headers.remove("x-api-key");
    headers.remove(&X_REQUEST_ID);
    Outgoing { headers, trailers }
}

/// The head limits (`server.max_upstream_*`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadLimits {
    pub(crate) max_head: usize,
    pub(crate) max_value: usize,
}

/// Header fields forwarded at most: the listener's own HTTP/1.1 limit (hyper's default of 100),
/// so an HTTP/2 client, bounded by size only, is held to the same; vLLM's server takes 256.
pub(crate) const MAX_FORWARDED_FIELDS: usize = 100;

/// Whether the request's head, as a backend would get it, is within what backends accept:
/// its headers (already `outgoing`), the gateway's own (`x-request-id`, `content-length` at
/// its widest, the blank line) and the largest part a backend decides (`backend_part`:
/// request line, `Host`, `Authorization`). Counts only; no allocation unless it refuses.
pub(crate) fn check_head(
    headers: &HeaderMap,
    request_id: &HeaderValue,
    backend_part: usize,
    limits: HeadLimits,
) -> Result<(), HeadExcess> {
    let line = |name: usize, value: usize| name + 2 + value + 2;
    let mut bytes = backend_part
        + line(X_REQUEST_ID.as_str().len(), request_id.len())
        + line("content-length".len(), 20)
        + 2;
    let mut fields = 2;
    let mut largest: Option<(&HeaderName, usize)> = None;
    for (name, value) in headers {
        bytes += line(name.as_str().len(), value.len());
        fields += 1;
        if value.len() > limits.max_value && largest.is_none_or(|(_, n)| value.len() > n) {
            largest = Some((name, value.len()));
        }
    }
    if let Some((name, n)) = largest {
        return Err(HeadExcess::Value {
            name: name.as_str().chars().take(64).collect(),
            bytes: n,
            limit: limits.max_value,
        });
    }
    if fields > MAX_FORWARDED_FIELDS {
        return Err(HeadExcess::Fields {
            count: fields,
            limit: MAX_FORWARDED_FIELDS,
        });
    }
    if bytes > limits.max_head {
        return Err(HeadExcess::Total {
            bytes,
            limit: limits.max_head,
        });
    }
    Ok(())
}

/// `TE: trailers` (among other codings).
fn accepts_trailers(h: &HeaderMap) -> bool {
    h.get_all(header::TE).iter().any(|v| {
        v.as_bytes()
            .split(|b| *b == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids() {
        let mut h = HeaderMap::new();
        let a = request_id(&h);
        let b = request_id(&h);
        assert_ne!(a, b);
        assert!(a.to_str().unwrap().starts_with("fg-"));
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("mine"));
        assert_eq!(request_id(&h), "mine");
    }
}
