//! Rate limits, token budgets, concurrency caps and the admission queue, end to end: a real
//! gateway in front of real sims, each limit exceeded and its 429/503 read as a client reads
//! it; two gateways sharing one limit through the real Redis.

mod per_key;
mod queue;
mod shared;

use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use fleetgate_gateway::config::{EnvLimits, SharedLimits};
use fleetgate_gateway::key::Environment;
use http_body_util::BodyExt;

fn chat(max_tokens: u32, stream: bool) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": "qwen32b",
            "messages": [{"role": "user", "content": "Say something"}],
            "max_tokens": max_tokens,
            "stream": stream,
        })
        .to_string(),
    )
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

fn header<'a>(m: &'a fleetgate_protocol::client::Measured, name: &str) -> &'a str {
    m.headers
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header: {:?}", m.headers))
        .to_str()
        .unwrap()
}
