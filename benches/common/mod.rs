//! Pieces the benchmark binaries share: flags, a key fixture, a throwaway PostgreSQL database.
#![allow(
    dead_code,
    clippy::unwrap_used,
    reason = "benchmark helpers: each binary uses some, and fails loudly"
)]

use fleetgate_gateway::config::DatabaseConfig;
use fleetgate_gateway::key::Environment;
use fleetgate_gateway::key::KeyRecord;
use fleetgate_gateway::secret::Secret;
use sqlx::Connection;

/// `--name N` from the command line, or `default`.
pub fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// An active prod key record with the given public id and secret hash.
pub fn key_record(public_id: &str, hash: [u8; 32]) -> KeyRecord {
    KeyRecord {
        id: 0,
        public_id: public_id.into(),
        name: "bench".into(),
        environment: Environment::Prod,
        secret_hash: hash,
        previous: None,
        created_at: 0,
        created_by: "bench".into(),
        expires_at: Some(i64::MAX),
        revoked_at: None,
        revoked_by: None,
        revoke_reason: None,
        allowed_models: None,
        allowed_endpoints: None,
        requests_per_minute: None,
        tokens_per_minute: None,
        max_concurrent_streams: None,
        metadata: serde_json::Value::Null,
        updated_at: 0,
    }
}

/// A fresh database on the PostgreSQL server of FLEETGATE_TEST_PG (default: the local one).
pub struct ThrowawayPg {
    pub config: DatabaseConfig,
    admin: sqlx::PgConnection,
    name: String,
}

impl ThrowawayPg {
    pub async fn create(tag: &str) -> Result<Self, String> {
        let admin_url = std::env::var("FLEETGATE_TEST_PG")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let mut admin = sqlx::PgConnection::connect(&admin_url)
            .await
            .map_err(|e| e.to_string())?;
        let name = format!("fg_bench_{tag}_{}", std::process::id());
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .map_err(|e| e.to_string())?;
        let url = format!("{}/{name}", admin_url.rsplit_once('/').unwrap().0);
        Ok(Self {
            config: DatabaseConfig {
                url: Some(Secret::new(url)),
                ..DatabaseConfig::default()
            },
            admin,
            name,
        })
    }

    pub async fn drop_database(mut self) {
        let _ = sqlx::query(&format!("DROP DATABASE {} WITH (FORCE)", self.name))
            .execute(&mut self.admin)
            .await;
    }
}

/// The Timeline of a typical finished stream (64 tokens, 20 ms TTFT, 0.7 s), starting at `t0`.
pub fn streamed_timeline(t0: std::time::Instant) -> fleetgate_gateway::telemetry::Timeline {
    use std::time::Duration;
    let ms = Duration::from_millis;
    let mut tl = fleetgate_gateway::telemetry::Timeline::start(t0);
    tl.stamp_body_read(t0 + Duration::from_micros(5));
    tl.stamp_admitted(t0 + Duration::from_micros(5));
    tl.stamp_upstream_sent(t0 + Duration::from_micros(10));
    tl.stamp_upstream_first_byte(t0 + ms(1));
    tl.stamp_whole_answer(t0 + ms(20), t0 + ms(20));
    tl.stamp_done(t0 + ms(700));
    let stream = tl.stream_mut();
    stream.first_content = Some(ms(20));
    stream.last_content = Some(ms(690));
    stream.last_data = Some(ms(691));
    stream.content_events = 65;
    stream.usage = Some(fleetgate_protocol::usage::Usage {
        prompt_tokens: 100,
        completion_tokens: 64,
        cached_tokens: None,
    });
    tl
}
