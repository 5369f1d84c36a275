//! State the replicas share beside the limits, through the limits' Redis: a stored response's
//! backend (`PinStore`, written in the background, read with the limits' timeout), and the link
//! other sharing (the longest-prefix channel) starts from (`RedisLink`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use redis::aio::ConnectionManager;

/// Write a stored response's pin unless another key owns the id: the value is
/// `model\tbackend\tkey`, ARGV[2] the writer's key.
pub(super) const PUT_PIN: &str = r"
local old = redis.call('GET', KEYS[1])
if old then
  local owner = string.match(old, '^[^\t]*\t[^\t]*\t(.*)$')
  if owner ~= nil and owner ~= ARGV[2] then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
return 1
";

/// The deployment's Redis as the limits reach it, for the other state replicas share.
#[derive(Clone)]
pub(crate) struct RedisLink {
    pub(super) client: redis::Client,
    pub(super) prefix: Arc<str>,
}

impl std::fmt::Debug for RedisLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLink")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisLink {
    pub(crate) fn client(&self) -> &redis::Client {
        &self.client
    }

    /// Every key and channel name starts with it (`{limits.redis.key_prefix}`).
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }
}

/// Short strings kept in Redis for a time, by id (a stored response's backend): written in the
/// background, read with the limits' timeout. While Redis is down nothing is shared.
#[derive(Clone)]
pub(crate) struct PinStore {
    pub(super) conn: Arc<ArcSwapOption<ConnectionManager>>,
    pub(super) up: Arc<AtomicBool>,
    pub(super) prefix: Arc<str>,
    pub(super) timeout: Duration,
    /// `PUT_PIN`, hashed once.
    pub(super) put: Arc<redis::Script>,
}

impl std::fmt::Debug for PinStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinStore").finish_non_exhaustive()
    }
}

impl PinStore {
    fn key(&self, id: &str) -> String {
        format!("{}:resp:{id}", self.prefix)
    }

    fn conn(&self) -> Option<ConnectionManager> {
        self.conn
            .load_full()
            .filter(|_| self.up.load(Ordering::Acquire))
            .map(|c| (*c).clone())
    }

    /// `SET <prefix>:resp:<id> <value> EX <ttl>` unless the id is held by a key other than
    /// `owner` (the value's last tab-separated field), in the background (dropped while
    /// Redis is down: the pin stays in this replica only).
    pub(crate) fn put(&self, id: &str, value: String, owner: &str, ttl: Duration) {
        let Some(mut c) = self.conn() else {
            return;
        };
        let (key, timeout) = (self.key(id), self.timeout);
        let owner = owner.to_owned();
        let secs = ttl.as_secs().max(1);
        let script = self.put.clone();
        tokio::spawn(async move {
            let mut call = script.key(&key);
            call.arg(value).arg(owner).arg(secs);
            let set = call.invoke_async::<i64>(&mut c);
            match tokio::time::timeout(timeout, set).await {
                Ok(Err(e)) => tracing::debug!(error = %e, "stored response's pin not shared"),
                Ok(Ok(0)) => tracing::warn!(
                    "a stored response id another key holds in Redis was not re-pinned to this key"
                ),
                _ => {}
            }
        });
    }

    /// The value under `id`, if Redis has one and answers in time.
    pub(crate) async fn get(&self, id: &str) -> Option<String> {
        let mut c = self.conn()?;
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.key(id));
        let get = cmd.query_async::<Option<String>>(&mut c);
        tokio::time::timeout(self.timeout, get).await.ok()?.ok()?
    }
}
