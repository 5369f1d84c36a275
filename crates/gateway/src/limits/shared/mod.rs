//! Limits shared by several replicas, in Redis: one script round trip per request checks and
//! updates the key's request rate (GCRA, the algorithm the local limits run, `limiter::Gcra`), the
//! environment's aggregate rate and the key's token bucket, atomically, on Redis's clock.
//! Token settlements go back in batches from a background task, never from the request path.
//!
//! When Redis does not answer within `limits.redis.timeout_ms`, the gateway falls back to
//! local limits of limit/replicas (so N replicas together still enforce about the limit), logs
//! the switch once, counts it (`fleetgate_limits_fallback_total`) and shows it
//! (`fleetgate_limits_redis_up` 0), and probes Redis every second until it answers again.
//!
//! A failover hands no key a fresh burst, either way. While Redis answers, each check
//! carries Redis's view of the key (how long each limit needs to be whole again) into the
//! local limits, so a fallback starts from what the key has used. While it does not, what the
//! local limits admit is remembered per key, and the key's first check when Redis is back
//! sends that local view along as floors the script applies before it decides, so Redis does
//! not admit again what was admitted here. (Time to be whole again is the same measure for the
//! whole limit and for a replica's share of limit/replicas at its share of the rate.)

mod pins;
mod settle;

pub(crate) use pins::{PinStore, RedisLink};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use prometheus::{IntCounter, IntGauge, Opts, Registry};
use redis::aio::ConnectionManager;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use pins::PUT_PIN;
use settle::{SETTLE, Settle, Settler, settle_loop};

use super::{Floors, KeyQuota};
use crate::config::RedisConfig;
use crate::key::KeyRecord;

/// KEYS: key request TAT, key token bucket, environment request TAT.
/// ARGV: key emission interval µs, key tolerance µs (0 0: no limit), token capacity, tokens to
/// reserve (0 0: no budget), environment emission interval µs, environment tolerance µs, then
/// the floors (µs; 0: none): how long the key's request rate, its token bucket and the
/// environment's rate need to be whole again by what a replica admitted on its own while Redis
/// was away — the stored state is taken as at least that used.
/// Returns {0, req_remaining, req_reset_us, tok_remaining, tok_reset_us, env_reset_us} (-1: no
/// such limit; a reset is the time until the limit is whole again) or {which, retry_us} with
/// which = 1 key requests, 2 key tokens, 3 environment requests, 4 more tokens than the whole
/// budget. Times are Redis's own (`TIME`), so replicas' clocks do not matter. A missing key
/// means a full bucket: every key expires when it would be full.
const CHECK: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local kt, ktau = tonumber(ARGV[1]), tonumber(ARGV[2])
local cap, need = tonumber(ARGV[3]), tonumber(ARGV[4])
local et, etau = tonumber(ARGV[5]), tonumber(ARGV[6])
local kfloor, tfloor, efloor = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local ktat = now
if kt > 0 then
  ktat = math.max(tonumber(redis.call('GET', KEYS[1])) or now, now + kfloor)
  if now < ktat - ktau then return {1, ktat - ktau - now} end
end
local etat = now
if et > 0 then
  etat = math.max(tonumber(redis.call('GET', KEYS[3])) or now, now + efloor)
  if now < etat - etau then return {3, etat - etau - now} end
end
local level = 0
if cap > 0 then
  if need > cap then return {4, 0} end
  local b = redis.call('HMGET', KEYS[2], 'l', 'a')
  level = tonumber(b[1]) or cap
  local at = tonumber(b[2]) or now
  if now > at then level = math.min(cap, level + (now - at) * cap / 60000000) end
  level = math.min(level, cap - tfloor * cap / 60000000)
  if level < need then return {2, math.ceil((need - level) * 60000000 / cap)} end
end
local out = {0, -1, 0, -1, 0, -1}
if kt > 0 then
  local nxt = math.max(ktat, now) + kt
  redis.call('SET', KEYS[1], string.format('%.0f', nxt), 'PX', math.ceil((nxt - now) / 1000) + 1000)
  out[2] = math.floor(math.min(now + ktau + kt - nxt, ktau + kt) / kt)
  out[3] = nxt - now
end
if et > 0 then
  local nxt = math.max(etat, now) + et
  redis.call('SET', KEYS[3], string.format('%.0f', nxt), 'PX', math.ceil((nxt - now) / 1000) + 1000)
  out[6] = nxt - now
end
if cap > 0 then
  level = level - need
  local refill = (cap - level) * 60000000 / cap
  redis.call('HSET', KEYS[2], 'l', string.format('%.3f', level), 'a', string.format('%.0f', now))
  redis.call('PEXPIRE', KEYS[2], math.ceil(refill / 1000) + 1000)
  out[4] = math.floor(math.max(level, 0))
  out[5] = math.ceil(refill)
end
return out
";

/// One request's check.
#[derive(Debug, Clone)]
pub(crate) struct Check {
    key_id: i64,
    environment: &'static str,
    key_t_us: u64,
    key_tau_us: u64,
    token_capacity: u64,
    reserve: u64,
    env_t_us: u64,
    env_tau_us: u64,
    key_floor: Floors,
    env_floor: Duration,
}

impl Check {
    pub(crate) fn new(
        key: &KeyRecord,
        quota: &KeyQuota,
        env_per_second: Option<(u32, u32)>,
        reserve: u64,
    ) -> Self {
        let (key_t_us, key_tau_us) = match quota.requests_per_minute {
            Some(r) => {
                let t = 60_000_000 / u64::from(r.max(1));
                (t.max(1), t.max(1) * u64::from(quota.burst.max(1) - 1))
            }
            None => (0, 0),
        };
        let (env_t_us, env_tau_us) = match env_per_second {
            Some((r, b)) => {
                let t = (1_000_000 / u64::from(r.max(1))).max(1);
                (t, t * u64::from(b.max(1) - 1))
            }
            None => (0, 0),
        };
        let (token_capacity, reserve) = match quota.tokens_per_minute {
            Some(c) => (c, reserve),
            None => (0, 0),
        };
        Self {
            key_id: key.id,
            environment: key.environment.as_str(),
            key_t_us,
            key_tau_us,
            token_capacity,
            reserve,
            env_t_us,
            env_tau_us,
            key_floor: Floors::default(),
            env_floor: Duration::ZERO,
        }
    }

    /// What this replica admitted on its own while Redis was away, for Redis to count
    /// (`KeyLimiter::floors`, `EnvLimiter::floor`).
    pub(crate) fn with_floors(mut self, key: Floors, env: Duration) -> Self {
        self.key_floor = key;
        self.env_floor = env;
        self
    }
}

/// Which shared limit refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Which {
    KeyRequests,
    KeyTokens,
    KeyTokensTooLarge,
    EnvRequests,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// (remaining, reset) of the request and token windows that apply, and the time the
    /// environment's rate needs to be whole again. A reset is the time until the limit is
    /// whole again: the key's state that a later fallback starts from.
    Passed {
        requests: Option<(u64, Duration)>,
        tokens: Option<(u64, Duration)>,
        env: Option<Duration>,
    },
    Refused {
        which: Which,
        retry_after: Duration,
    },
}

#[derive(Debug)]
struct SharedMetrics {
    up: IntGauge,
    fallback: IntCounter,
    dropped_settlements: IntCounter,
}

/// The Redis side of the limits.
pub struct Shared {
    /// Tells this instance's per-worker connections apart from another's (a test process
    /// runs many gateways).
    id: u64,
    client: redis::Client,
    conn: Arc<ArcSwapOption<ConnectionManager>>,
    up: Arc<AtomicBool>,
    check: redis::Script,
    timeout: Duration,
    prefix: Arc<str>,
    settle_tx: mpsc::Sender<Settle>,
    metrics: Arc<SharedMetrics>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("up", &self.is_up()).finish()
    }
}

fn redacted(url: &str) -> String {
    // redis://user:password@host → redis://***@host
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}***{}", &url[..s + 3], &url[at..]),
        _ => url.to_owned(),
    }
}

impl Shared {
    /// Connect to Redis. An unreachable Redis is not fatal: the gateway starts on local
    /// limits (limit/replicas) and keeps trying. The background tasks run on `tasks`: probing
    /// ends with `stop`; settling ends with `settle_stop`, which must come once no request
    /// can settle any more (the workers are done), after sending what is still queued.
    pub async fn start(
        cfg: &RedisConfig,
        registry: Option<&Registry>,
        tasks: &TaskTracker,
        stop: CancellationToken,
        settle_stop: CancellationToken,
    ) -> std::io::Result<Self> {
        let client = redis::Client::open(cfg.url.expose()).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("limits.redis.url: {e}"),
            )
        })?;
        let metrics = Arc::new(SharedMetrics {
            up: IntGauge::with_opts(Opts::new(
                "fleetgate_limits_redis_up",
                "1 while the shared limit store (Redis) answers; 0 while limits fall back to local limit/replicas",
            ))
            .map_err(std::io::Error::other)?,
            fallback: IntCounter::with_opts(Opts::new(
                "fleetgate_limits_fallback_total",
                "Switches from shared (Redis) limits to local limit/replicas",
            ))
            .map_err(std::io::Error::other)?,
            dropped_settlements: IntCounter::with_opts(Opts::new(
                "fleetgate_limits_settlements_dropped_total",
                "Token settlements not sent to Redis (queue full or Redis unreachable)",
            ))
            .map_err(std::io::Error::other)?,
        });
        if let Some(r) = registry {
            r.register(Box::new(metrics.up.clone()))
                .map_err(std::io::Error::other)?;
            r.register(Box::new(metrics.fallback.clone()))
                .map_err(std::io::Error::other)?;
            r.register(Box::new(metrics.dropped_settlements.clone()))
                .map_err(std::io::Error::other)?;
        }
        let conn = Arc::new(ArcSwapOption::empty());
        let up = Arc::new(AtomicBool::new(false));
        let where_ = redacted(cfg.url.expose());
        match connect(&client, cfg.timeout.max(Duration::from_secs(1))).await {
            Ok(c) => {
                conn.store(Some(Arc::new(c)));
                up.store(true, Ordering::Release);
                metrics.up.set(1);
                tracing::info!(redis = %where_, "rate limits shared through Redis");
            }
            Err(e) => {
                metrics.fallback.inc();
                tracing::warn!(redis = %where_, error = %e, replicas = cfg.replicas,
                    "Redis unreachable at start: enforcing local limits of limit/replicas until it answers");
            }
        }
        let (settle_tx, settle_rx) = mpsc::channel(65_536);
        let prefix: Arc<str> = Arc::from(format!("{{{}}}", cfg.key_prefix));
        tasks.spawn(health_loop(
            client.clone(),
            conn.clone(),
            up.clone(),
            metrics.clone(),
            where_,
            stop,
        ));
        let settler = Settler {
            conn: conn.clone(),
            up: up.clone(),
            prefix: prefix.clone(),
            metrics: metrics.clone(),
            timeout: cfg.timeout.max(Duration::from_millis(500)),
            script: redis::Script::new(SETTLE),
        };
        tasks.spawn(settle_loop(settle_rx, settler, settle_stop));
        Ok(Self {
            id: rand::random(),
            client,
            conn,
            up,
            check: redis::Script::new(CHECK),
            timeout: cfg.timeout,
            prefix,
            settle_tx,
            metrics,
        })
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    fn mark_down(&self, why: &str) {
        if self.up.swap(false, Ordering::AcqRel) {
            self.metrics.up.set(0);
            self.metrics.fallback.inc();
            tracing::warn!(error = %why, "Redis did not answer: enforcing local limits of limit/replicas until it does");
        }
    }

    /// One round trip: check and update every shared counter that applies. `Err(())` when
    /// Redis failed or was too slow (already logged and counted; use local limits).
    pub(crate) async fn check(&self, c: &Check) -> Result<Outcome, ()> {
        let p = &self.prefix;
        let mut inv = self.check.prepare_invoke();
        inv.key(format!("{p}:k:{}:r", c.key_id))
            .key(format!("{p}:k:{}:t", c.key_id))
            .key(format!("{p}:e:{}:r", c.environment))
            .arg(c.key_t_us)
            .arg(c.key_tau_us)
            .arg(c.token_capacity)
            .arg(c.reserve)
            .arg(c.env_t_us)
            .arg(c.env_tau_us)
            .arg(micros(c.key_floor.requests))
            .arg(micros(c.key_floor.tokens))
            .arg(micros(c.env_floor));
        let answer = match self.worker_conn() {
            Some(mut own) => match self.invoke(&inv, &mut own).await {
                // This worker's connection broke (Redis went away and came back, say): it is
                // opened anew in the background, and the shared one, which the health loop
                // checks, answers for this request. A timeout is Redis being slow for all.
                Err(Failed::Error(_)) => {
                    self.drop_worker_conn();
                    self.invoke_shared(&inv).await
                }
                other => other,
            },
            None => self.invoke_shared(&inv).await,
        };
        let reply = match answer {
            Ok(r) => r,
            Err(f) => {
                self.mark_down(&f.to_string());
                return Err(());
            }
        };
        let us = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
        let get = |i: usize| reply.get(i).copied().unwrap_or(-1);
        Ok(match get(0) {
            0 => Outcome::Passed {
                requests: (get(1) >= 0).then(|| (get(1) as u64, us(get(2)))),
                tokens: (get(3) >= 0).then(|| (get(3) as u64, us(get(4)))),
                env: (get(5) >= 0).then(|| us(get(5))),
            },
            which => Outcome::Refused {
                which: match which {
                    1 => Which::KeyRequests,
                    2 => Which::KeyTokens,
                    3 => Which::EnvRequests,
                    _ => Which::KeyTokensTooLarge,
                },
                retry_after: us(get(1)),
            },
        })
    }

    /// The check script on `conn`, within the timeout.
    async fn invoke(
        &self,
        inv: &redis::ScriptInvocation<'_>,
        conn: &mut ConnectionManager,
    ) -> Result<Vec<i64>, Failed> {
        match tokio::time::timeout(self.timeout, inv.invoke_async(conn)).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(Failed::Error(e.to_string())),
            Err(_) => Err(Failed::Timeout(self.timeout)),
        }
    }

    /// The check script on the shared connection.
    async fn invoke_shared(&self, inv: &redis::ScriptInvocation<'_>) -> Result<Vec<i64>, Failed> {
        let Some(conn) = self.conn.load_full() else {
            return Err(Failed::Error("not connected".to_owned()));
        };
        self.invoke(inv, &mut (*conn).clone()).await
    }

    /// Forget this worker's connection: a new one is opened on its next check.
    fn drop_worker_conn(&self) {
        WORKER_CONNS.with(|conns| {
            if let Some(own) = conns.borrow_mut().iter_mut().find(|c| c.owner == self.id) {
                own.conn.store(None);
                own.next_try = std::time::Instant::now();
            }
        });
    }

    /// This worker thread's own connection, once it has one. A multiplexed connection's
    /// driver is a task on the runtime that opened it: the shared one's runs on the
    /// control-plane runtime, so a check through it wakes that thread to write and again
    /// to read, and the answer wakes the worker back (measured: +214 µs at p50 and ~130 µs of
    /// CPU per check on this 2-core machine, against a 42 µs Redis round trip). A
    /// worker's own connection has its driver on the worker's event loop: the command, the
    /// socket and the answer stay on one thread. Opened in the background on first use (this
    /// check goes through the shared one); a failed open is tried again a second later.
    /// Only for single-threaded runtimes (the workers): on a multi-threaded one the driver
    /// would run on any of its threads, which gains nothing.
    fn worker_conn(&self) -> Option<ConnectionManager> {
        let handle = tokio::runtime::Handle::try_current().ok()?;
        if handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
            return None;
        }
        WORKER_CONNS.with(|conns| {
            let mut conns = conns.borrow_mut();
            let at = match conns.iter().position(|c| c.owner == self.id) {
                Some(at) => at,
                None => {
                    conns.push(WorkerConn {
                        owner: self.id,
                        conn: Arc::new(ArcSwapOption::empty()),
                        next_try: std::time::Instant::now(),
                    });
                    conns.len() - 1
                }
            };
            let own = &mut conns[at];
            if let Some(c) = own.conn.load_full() {
                return Some((*c).clone());
            }
            // The clock is read only while there is no connection yet.
            let now = std::time::Instant::now();
            if now >= own.next_try {
                own.next_try = now + Duration::from_secs(1);
                let (client, slot) = (self.client.clone(), own.conn.clone());
                let timeout = self.timeout.max(Duration::from_secs(1));
                // Ends within `timeout`; dropped with the worker's runtime at shutdown. The
                // connection's own driver is the redis crate's task, on this runtime too.
                handle.spawn(async move {
                    if let Ok(c) = connect(&client, timeout).await {
                        slot.store(Some(Arc::new(c)));
                    }
                });
            }
            None
        })
    }

    /// Where stored responses' backends are shared between replicas (`proxy::pins`): the
    /// same connection and key prefix as the counters.
    pub(crate) fn pin_store(&self) -> PinStore {
        PinStore {
            conn: self.conn.clone(),
            up: self.up.clone(),
            prefix: self.prefix.clone(),
            timeout: self.timeout.max(Duration::from_millis(200)),
            put: Arc::new(redis::Script::new(PUT_PIN)),
        }
    }

    /// The same Redis for other shared state (the prefix records): its client (for
    /// connections of their own) and its key prefix.
    pub(crate) fn link(&self) -> RedisLink {
        RedisLink {
            client: self.client.clone(),
            prefix: self.prefix.clone(),
        }
    }

    /// Give back (or take) tokens after a request ended; sent in the background.
    pub fn settle(&self, key_id: i64, capacity: u64, delta: i64) {
        if delta == 0 {
            return;
        }
        if self
            .settle_tx
            .try_send(Settle {
                key_id,
                capacity,
                delta,
            })
            .is_err()
        {
            self.metrics.dropped_settlements.inc();
        }
    }
}

/// Why a check got no answer from Redis.
enum Failed {
    Error(String),
    Timeout(Duration),
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failed::Error(e) => f.write_str(e),
            Failed::Timeout(t) => write!(f, "no answer within {} ms", t.as_millis()),
        }
    }
}

/// A worker thread's own connection to one `Shared`'s Redis (`Shared::worker_conn`).
struct WorkerConn {
    owner: u64,
    conn: Arc<ArcSwapOption<ConnectionManager>>,
    next_try: std::time::Instant,
}

thread_local! {
    /// This thread's own connections, by `Shared` instance.
    static WORKER_CONNS: std::cell::RefCell<Vec<WorkerConn>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

async fn connect(
    client: &redis::Client,
    timeout: Duration,
) -> Result<ConnectionManager, redis::RedisError> {
    let cfg = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout)
        .set_number_of_retries(1);
    let mut conn = ConnectionManager::new_with_config(client.clone(), cfg).await?;
    let _: String = redis::cmd("PING").query_async(&mut conn).await?;
    Ok(conn)
}

/// While Redis is marked down, try it every second; mark it up when it answers.
async fn health_loop(
    client: redis::Client,
    conn: Arc<ArcSwapOption<ConnectionManager>>,
    up: Arc<AtomicBool>,
    metrics: Arc<SharedMetrics>,
    where_: String,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        if up.load(Ordering::Acquire) {
            continue;
        }
        let ok = match conn.load_full() {
            Some(c) => {
                let mut c = (*c).clone();
                matches!(
                    tokio::time::timeout(
                        Duration::from_secs(1),
                        redis::cmd("PING").query_async::<String>(&mut c)
                    )
                    .await,
                    Ok(Ok(_))
                )
            }
            None => match connect(&client, Duration::from_secs(1)).await {
                Ok(c) => {
                    conn.store(Some(Arc::new(c)));
                    true
                }
                Err(_) => false,
            },
        };
        if ok {
            up.store(true, Ordering::Release);
            metrics.up.set(1);
            tracing::info!(redis = %where_, "Redis answers again: rate limits are shared again");
        }
    }
}
