//! The refusal side of the limits: which limit refused a request, its message and code, the
//! `x-ratelimit-*` headers, and the refusal counters.

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};
use prometheus::{IntCounter, IntCounterVec};

use crate::key::Environment;
use fleetgate_protocol::error::ErrorKind;

/// Which limit refused a request (a metric label and the error's code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitKind {
    KeyRequests,
    KeyTokens,
    KeyTokensTooLarge,
    KeyConcurrency,
    EnvRequests,
    EnvConcurrency,
}

impl LimitKind {
    pub(crate) const ALL: [LimitKind; 6] = [
        LimitKind::KeyRequests,
        LimitKind::KeyTokens,
        LimitKind::KeyTokensTooLarge,
        LimitKind::KeyConcurrency,
        LimitKind::EnvRequests,
        LimitKind::EnvConcurrency,
    ];

    /// The error kind (and so the status) of a refusal by this limit.
    pub(crate) fn error_kind(self) -> ErrorKind {
        match self {
            LimitKind::KeyRequests
            | LimitKind::KeyTokens
            | LimitKind::KeyTokensTooLarge
            | LimitKind::KeyConcurrency
            | LimitKind::EnvRequests
            | LimitKind::EnvConcurrency => ErrorKind::RateLimited,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            LimitKind::KeyRequests => "key_requests",
            LimitKind::KeyTokens => "key_tokens",
            LimitKind::KeyTokensTooLarge => "key_tokens_too_large",
            LimitKind::KeyConcurrency => "key_concurrency",
            LimitKind::EnvRequests => "env_requests",
            LimitKind::EnvConcurrency => "env_concurrency",
        }
    }
}

/// One rate window as OpenAI's `x-ratelimit-*` headers state it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    /// Until the window is full again.
    pub(crate) reset: Duration,
}

/// The `x-ratelimit-*` values of one response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RateHeaders {
    pub(crate) requests: Option<Window>,
    pub(crate) tokens: Option<Window>,
}

static LIMIT_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
static REMAINING_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-requests");
static RESET_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");
static LIMIT_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
static REMAINING_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
static RESET_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");

impl RateHeaders {
    pub(crate) fn is_empty(&self) -> bool {
        self.requests.is_none() && self.tokens.is_none()
    }

    pub(crate) fn write(&self, h: &mut HeaderMap) {
        for (w, names) in [
            (
                self.requests,
                [&LIMIT_REQUESTS, &REMAINING_REQUESTS, &RESET_REQUESTS],
            ),
            (
                self.tokens,
                [&LIMIT_TOKENS, &REMAINING_TOKENS, &RESET_TOKENS],
            ),
        ] {
            if let Some(w) = w {
                h.insert(names[0].clone(), HeaderValue::from(w.limit));
                h.insert(names[1].clone(), HeaderValue::from(w.remaining));
                h.insert(names[2].clone(), reset_value(w.reset));
            }
        }
    }
}

/// A duration as OpenAI writes it in `x-ratelimit-reset-*`: `120ms`, `1.5s`, `6m0s`.
pub(crate) fn reset_value(d: Duration) -> HeaderValue {
    let mut buf = [0u8; 32];
    let n = format_reset(&mut buf, d);
    HeaderValue::from_bytes(&buf[..n]).unwrap_or_else(|_| HeaderValue::from_static("0s"))
}

fn format_reset(buf: &mut [u8; 32], d: Duration) -> usize {
    let mut ib = itoa::Buffer::new();
    let mut n = 0;
    let mut put = |s: &[u8], n: &mut usize| {
        buf[*n..*n + s.len()].copy_from_slice(s);
        *n += s.len();
    };
    let ms = d.as_millis().min(u128::from(u64::MAX)) as u64;
    if ms < 1000 {
        put(ib.format(ms).as_bytes(), &mut n);
        put(b"ms", &mut n);
    } else if ms < 60_000 {
        put(ib.format(ms / 1000).as_bytes(), &mut n);
        let tenths = ms % 1000 / 100;
        if tenths > 0 {
            put(&[b'.', b'0' + tenths as u8], &mut n);
        }
        put(b"s", &mut n);
    } else {
        put(ib.format(ms / 60_000).as_bytes(), &mut n);
        put(b"m", &mut n);
        put(ib.format(ms % 60_000 / 1000).as_bytes(), &mut n);
        put(b"s", &mut n);
    }
    n
}

/// A refused request: which limit, its numbers, and when to come back.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub(crate) kind: LimitKind,
    pub(crate) key_id: Box<str>,
    pub(crate) environment: Environment,
    /// The limit's value (per minute, per second, or concurrent requests).
    pub(crate) limit: u64,
    /// Tokens this request would reserve (token limits only).
    pub(crate) requested: u64,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) headers: RateHeaders,
}

impl Refusal {
    pub(crate) fn code(&self) -> &'static str {
        match self.kind {
            LimitKind::KeyRequests => "requests_per_minute_exceeded",
            LimitKind::KeyTokens => "tokens_per_minute_exceeded",
            LimitKind::KeyTokensTooLarge => "request_exceeds_token_budget",
            LimitKind::KeyConcurrency => "concurrency_limit_exceeded",
            LimitKind::EnvRequests => "environment_rate_limit_exceeded",
            LimitKind::EnvConcurrency => "environment_concurrency_exceeded",
        }
    }

    pub(crate) fn message(&self) -> String {
        let key = &self.key_id;
        let env = self.environment;
        let retry = match self.retry_after {
            Some(d) => format!(" Retry after {:.1} s.", d.as_secs_f64().max(0.1)),
            None => String::new(),
        };
        match self.kind {
            LimitKind::KeyRequests => format!(
                "Rate limit reached for key {key} on requests per minute (RPM): limit {}.{retry}",
                self.limit
            ),
            LimitKind::KeyTokens => format!(
                "Rate limit reached for key {key} on tokens per minute (TPM): limit {}, this request reserves {} (prompt estimate + max_tokens).{retry} A smaller max_tokens reserves less.",
                self.limit, self.requested
            ),
            LimitKind::KeyTokensTooLarge => format!(
                "Request too large for key {key} on tokens per minute (TPM): limit {}, this request needs {} (prompt estimate + max_tokens). Lower max_tokens or shorten the prompt; it can never pass as it is.",
                self.limit, self.requested
            ),
            LimitKind::KeyConcurrency => format!(
                "Too many concurrent requests for key {key}: limit {} in flight. Wait for one to finish.",
                self.limit
            ),
            LimitKind::EnvRequests => format!(
                "Rate limit reached for the {env} environment (all {env} keys together): {} requests per second.{retry}",
                self.limit
            ),
            LimitKind::EnvConcurrency => format!(
                "Too many concurrent requests in the {env} environment (all {env} keys together): limit {} in flight.",
                self.limit
            ),
        }
    }
}

/// Counters per refusal kind, resolved once.
#[derive(Debug, Clone)]
pub struct LimitMetrics {
    rejections: Vec<IntCounter>,
}

impl LimitMetrics {
    pub(crate) fn new(rejections: &IntCounterVec) -> Self {
        Self {
            rejections: LimitKind::ALL
                .iter()
                .map(|k| rejections.with_label_values(&[k.as_str()]))
                .collect(),
        }
    }

    pub(crate) fn rejected(&self, kind: LimitKind) {
        if let Some(c) = self.rejections.get(kind as usize) {
            c.inc();
        }
    }
}
