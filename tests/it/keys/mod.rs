//! API keys end to end, on the embedded SQLite store and on real PostgreSQL: the store's
//! lifecycle, every 401/403 message as an OpenAI client decodes it, instant revocation across
//! gateways, rotation grace, expiry, the admin API's JWT checks, brute-force slowdown, and a
//! database outage served from the snapshot.

mod admin_api;
mod refusals;
mod store;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::common::*;
use bytes::Bytes;
use fleetgate_gateway::admin::jwt::{self, Role};
use fleetgate_gateway::key::Environment;
use fleetgate_gateway::secret::Secret;
use fleetgate_gateway::store::{CreateKey, KeyStore, StoreError};
use fleetgate_protocol::client::{self, chat_body};
use http_body_util::BodyExt;

fn create(env: Environment, name: &str) -> CreateKey {
    CreateKey {
        name: name.into(),
        environment: Some(env),
        ..CreateKey::default()
    }
}

async fn chat(gw: &Gateway, key: &str) -> client::Measured {
    post(
        &gw.url("/v1/chat/completions"),
        &[("authorization", &format!("Bearer {key}"))],
        chat_body("qwen32b", "hi", 3, true),
    )
    .await
}
