//! Longest-prefix routing across replicas: every replica tells the others, through Redis
//! pub/sub, which backend it sent each prompt to, and records what the others tell it in its
//! own index (`pool::prefix`). A conversation's next turn then finds the backend holding its
//! history whichever replica it reaches, as if one replica had seen every turn.
//!
//! Why pub/sub and not a shared index read per request: a turn's next turn comes after the
//! model has answered (seconds), while a record crosses Redis in about a millisecond, so every
//! replica can hold the whole fleet's index locally and the request path never waits on Redis.
//! Its only cost there is a `try_send` of three reference-counted pointers into a bounded
//! channel; publishing runs in a background task, gathered for 20 ms into one
//! message (after the first token of most requests, and one PUBLISH for a busy moment).
//!
//! When Redis is slow or away, nothing waits: records that cannot be sent are dropped and
//! counted, each replica routes on what it has itself seen (and what it learnt before), the
//! switch is logged once and shown by `fleetgate_prefix_share_up` and `/admin/ready`. The
//! subscription pings every second and reconnects, so a paused Redis is noticed as well as a
//! killed one. A replica that starts late knows only what is published from then on: the
//! index is a cache with an age bound, not a record.
//!
//! The channel is named by `limits.redis.key_prefix` and the Redis database number: pub/sub
//! channels ignore the database, so two deployments on one Redis, in databases of their own,
//! would otherwise exchange records. A received record longer than the longest prompt this
//! replica takes (`server.max_body_bytes` over the pool's `block_bytes`) is dropped and
//! counted: no sender can displace the index with one record.
//!
//! Beside the records, each replica tells the others how many prompt tokens it has sent each
//! backend that are not prefilled yet (no first token): longest-prefix routing weighs them as
//! it weighs its own (`Balancer::try_acquire_prefix`), so new conversations arriving at several
//! replicas together are not stacked on one backend. A replica publishes its counts with its
//! records, again within 20 ms of a change, and at least every second while any is not zero; a
//! replica's counts not renewed for 3 s are forgotten (it stopped, or Redis lost it), and all
//! of them when this replica's subscription is lost, so nothing stays counted after a replica
//! dies or while Redis is away.
//!
//! A message: the sending replica's id (8 bytes), the number of records (4 bytes), then per
//! record the pool's model and the backend's base URL (each a 2-byte length and its bytes), the
//! number of block names (4 bytes) and the names (8 bytes each); then, to the end, per backend
//! of the replica's longest-prefix pools its model, base URL and tokens not prefilled (8
//! bytes); all little endian. Backends are named by their base URL, as configured, since
//! metrics indexes are a replica's own numbering.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use prometheus::{IntCounter, IntGauge, Opts, Registry};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::limits::shared::RedisLink;
use crate::pool::fleet::Fleet;

/// Records waiting to be published; past it they are dropped (counted).
const QUEUE: usize = 4096;
/// Records sent in one message at most.
const BATCH: usize = 256;
/// How long the first record of a batch waits for others.
const LINGER: Duration = Duration::from_millis(20);
/// How long a publish or a ping may take before Redis counts as away.
const TIMEOUT: Duration = Duration::from_secs(1);
/// A replica's counts not prefilled are published again at least this often while not zero.
const RENEW: Duration = Duration::from_secs(1);
/// Another replica's counts not renewed for this long are forgotten.
const FORGET: Duration = Duration::from_secs(3);

/// One prompt sent to one backend.
struct Record {
    model: Arc<str>,
    backend: Arc<str>,
    names: Arc<[u64]>,
}

#[derive(Debug)]
struct Metrics {
    up: IntGauge,
    published: IntCounter,
    received: IntCounter,
    dropped: IntCounter,
}

impl Metrics {
    fn new(registry: Option<&Registry>) -> std::io::Result<Self> {
        let gauge = |n: &str, h: &str| IntGauge::with_opts(Opts::new(n, h));
        let counter = |n: &str, h: &str| IntCounter::with_opts(Opts::new(n, h));
        let m = Self {
            up: gauge(
                "fleetgate_prefix_share_up",
                "1 while this replica receives the other replicas' prefix records through Redis; 0 while it routes on its own index",
            )
            .map_err(std::io::Error::other)?,
            published: counter(
                "fleetgate_prefix_share_published_total",
                "Prefix records (one prompt sent to one backend) published to the other replicas",
            )
            .map_err(std::io::Error::other)?,
            received: counter(
                "fleetgate_prefix_share_received_total",
                "Prefix records received from other replicas and recorded in this replica's index",
            )
            .map_err(std::io::Error::other)?,
            dropped: counter(
                "fleetgate_prefix_share_dropped_total",
                "Prefix records not published (queue full, Redis slow or away) or received for a pool or backend this replica does not have",
            )
            .map_err(std::io::Error::other)?,
        };
        if let Some(r) = registry {
            r.register(Box::new(m.up.clone()))
                .map_err(std::io::Error::other)?;
            for c in [&m.published, &m.received, &m.dropped] {
                r.register(Box::new(c.clone()))
                    .map_err(std::io::Error::other)?;
            }
        }
        Ok(m)
    }
}

/// The request path's side: hands records to the publisher.
#[derive(Debug)]
pub(crate) struct PrefixShare {
    tx: mpsc::Sender<Record>,
    up: Arc<Up>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Record")
            .field("model", &self.model)
            .field("backend", &self.backend)
            .field("blocks", &self.names.len())
            .finish()
    }
}

impl PrefixShare {
    /// Start publishing and subscribing on `tasks` until `stop`.
    /// `max_prompt_bytes` bounds a received record (`server.max_body_bytes`).
    pub(crate) fn start(
        link: RedisLink,
        fleet: Arc<Fleet>,
        max_prompt_bytes: usize,
        registry: Option<&Registry>,
        tasks: &TaskTracker,
        stop: CancellationToken,
    ) -> std::io::Result<Arc<Self>> {
        let metrics = Arc::new(Metrics::new(registry)?);
        let (tx, rx) = mpsc::channel(QUEUE);
        let replica: u64 = rand::random();
        let channel = channel_of(&link);
        let up = Arc::new(Up::default());
        tasks.spawn(publish_loop(
            rx,
            link.clone(),
            Publisher {
                replica,
                fleet: fleet.clone(),
            },
            channel.clone(),
            metrics.clone(),
            up.clone(),
            stop.clone(),
        ));
        tasks.spawn(subscribe_loop(
            link.clone(),
            Learner {
                fleet,
                replica,
                max_prompt_bytes,
                pending: std::sync::Mutex::new(std::collections::HashMap::new()),
            },
            channel,
            metrics.clone(),
            up.clone(),
            stop,
        ));
        Ok(Arc::new(Self { tx, up, metrics }))
    }

    /// `backend` of `model`'s pool was sent the prompt of `names`: tell the other replicas.
    pub(crate) fn publish(&self, model: &Arc<str>, backend: &Arc<str>, names: &Arc<[u64]>) {
        let r = Record {
            model: model.clone(),
            backend: backend.clone(),
            names: names.clone(),
        };
        if self.tx.try_send(r).is_err() {
            self.metrics.dropped.inc();
        }
    }

    /// Records go both ways: the other replicas' arrive (the subscription answers) and this
    /// one's can be published (the shared connection answers).
    pub(crate) fn is_up(&self) -> bool {
        self.up.both()
    }
}

/// Each way's state: this replica's records can be published, the others' arrive.
#[derive(Debug, Default)]
struct Up {
    publish: AtomicBool,
    subscribe: AtomicBool,
}

impl Up {
    fn both(&self) -> bool {
        self.publish.load(Ordering::Acquire) && self.subscribe.load(Ordering::Acquire)
    }

    /// Set one way's state (`fleetgate_prefix_share_up` is 1 while both are up); `true` when
    /// it changed.
    fn set(&self, way: &AtomicBool, on: bool, metrics: &Metrics) -> bool {
        let changed = way.swap(on, Ordering::AcqRel) != on;
        metrics.up.set(i64::from(self.both()));
        changed
    }
}

/// The records' channel: the deployment's key prefix and its Redis database.
fn channel_of(link: &RedisLink) -> Arc<str> {
    let db = link.client().get_connection_info().redis.db;
    Arc::from(format!("{}:db{db}:prefix-index", link.prefix()))
}

/// Another replica's count of prompt tokens not prefilled on one backend: (replica, model,
/// backend's base URL) → (tokens, when it was said).
type OthersPending = std::collections::HashMap<(u64, String, String), (u64, Instant)>;

/// What the subscriber records received messages into, and how it bounds them.
struct Learner {
    fleet: Arc<Fleet>,
    replica: u64,
    max_prompt_bytes: usize,
    /// The other replicas' last published counts not prefilled (only the subscriber's task
    /// takes the lock).
    pending: std::sync::Mutex<OthersPending>,
}

/// What the publisher says besides the records: this replica's id and its counts not
/// prefilled, read from the fleet's longest-prefix pools.
struct Publisher {
    replica: u64,
    fleet: Arc<Fleet>,
}

/// One backend's count of prompt tokens sent and not prefilled: (model, base URL, tokens).
type Pending = (Arc<str>, Arc<str>, u64);

impl Publisher {
    /// This replica's counts, one per backend of each longest-prefix pool.
    fn pending(&self) -> Vec<Pending> {
        let generation = self.fleet.current();
        generation
            .iter()
            .filter(|pool| pool.prefix.is_some())
            .flat_map(|pool| {
                pool.backends.iter().map(|b| {
                    (
                        pool.model.clone(),
                        b.base.clone(),
                        b.prefill_pending.load(Ordering::Relaxed),
                    )
                })
            })
            .collect()
    }
}

/// Appends `s` with its 2-byte length (cut at 65 535 bytes).
fn put_text(out: &mut Vec<u8>, s: &str) {
    let len = u16::try_from(s.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..usize::from(len)]);
}

/// One message: the sending replica, each record, then each backend's count not prefilled.
fn encode(replica: u64, batch: &[Record], pending: &[Pending]) -> Vec<u8> {
    let size: usize = batch
        .iter()
        .map(|r| 8 + r.model.len() + r.backend.len() + r.names.len() * 8)
        .chain(pending.iter().map(|(m, b, _)| 12 + m.len() + b.len()))
        .sum();
    let mut out = Vec::with_capacity(12 + size);
    out.extend_from_slice(&replica.to_le_bytes());
    let records = u32::try_from(batch.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&records.to_le_bytes());
    for r in batch.iter().take(records as usize) {
        put_text(&mut out, &r.model);
        put_text(&mut out, &r.backend);
        let count = u32::try_from(r.names.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&count.to_le_bytes());
        for n in r.names.iter().take(count as usize) {
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
    for (model, backend, tokens) in pending {
        put_text(&mut out, model);
        put_text(&mut out, backend);
        out.extend_from_slice(&tokens.to_le_bytes());
    }
    out
}

/// One decoded record: `(model, backend, names)`.
type Decoded<'a> = (&'a str, &'a str, Vec<u64>);

/// A decoded message: the replica, its records and its counts not prefilled.
struct Message<'a> {
    replica: u64,
    records: Vec<Decoded<'a>>,
    pending: Vec<(&'a str, &'a str, u64)>,
}

/// A message's parts, `None` if it is not one.
fn decode(msg: &[u8]) -> Option<Message<'_>> {
    let replica = u64::from_le_bytes(msg.get(..8)?.try_into().ok()?);
    let count = u32::from_le_bytes(msg.get(8..12)?.try_into().ok()?) as usize;
    let mut rest = &msg[12..];
    fn text<'a>(rest: &mut &'a [u8]) -> Option<&'a str> {
        let len = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
        let s = std::str::from_utf8(rest.get(2..2 + len)?).ok()?;
        *rest = &rest[2 + len..];
        Some(s)
    }
    // At most what the message can hold (a record takes at least 8 bytes).
    let mut records = Vec::with_capacity(count.min(rest.len() / 8));
    for _ in 0..count {
        let model = text(&mut rest)?;
        let backend = text(&mut rest)?;
        let n = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let bytes = rest.get(4..4 + n.checked_mul(8)?)?;
        let names = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        rest = &rest[4 + bytes.len()..];
        records.push((model, backend, names));
    }
    let mut pending = Vec::new();
    while !rest.is_empty() {
        let model = text(&mut rest)?;
        let backend = text(&mut rest)?;
        let tokens = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
        rest = &rest[8..];
        pending.push((model, backend, tokens));
    }
    Some(Message {
        replica,
        records,
        pending,
    })
}

/// Publishes batches on a connection of its own (the limits' connection manager, reconnecting
/// with its own backoff, could keep records waiting well after Redis is back). A batch that
/// fails drops the connection; a new one is tried every second, with or without records.
async fn publish_loop(
    mut rx: mpsc::Receiver<Record>,
    link: RedisLink,
    me: Publisher,
    channel: Arc<str>,
    metrics: Arc<Metrics>,
    up: Arc<Up>,
    stop: CancellationToken,
) {
    let mut batch = Vec::with_capacity(BATCH);
    let mut conn: Option<redis::aio::MultiplexedConnection> = None;
    let mut next_try = tokio::time::Instant::now();
    // Said once per switch, both ways (the first connection is not news).
    let mut said_down = false;
    // The counts not prefilled last published, when, and when to look at them again (while
    // any is not zero).
    let mut said: Vec<u64> = Vec::new();
    let mut said_at = tokio::time::Instant::now();
    let mut look_again: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            n = rx.recv_many(&mut batch, BATCH) => if n == 0 { return },
            _ = tokio::time::sleep_until(next_try), if conn.is_none() => {}
            _ = tokio::time::sleep_until(look_again.unwrap_or(next_try)), if look_again.is_some() => {}
        }
        // Linger, so that the send happens after the request's first token rather than beside
        // it, and the records of a busy moment share one message.
        if !batch.is_empty() && batch.len() < BATCH {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(LINGER) => {}
            }
            while batch.len() < BATCH {
                match rx.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(_) => break,
                }
            }
        }
        let now = tokio::time::Instant::now();
        if conn.is_none() && now >= next_try {
            next_try = now + Duration::from_secs(1);
            let connect = link.client().get_multiplexed_async_connection();
            if let Ok(Ok(c)) = tokio::time::timeout(TIMEOUT, connect).await {
                conn = Some(c);
                up.set(&up.publish, true, &metrics);
                if said_down {
                    tracing::info!(
                        "prefix records are published to the other replicas again (Redis answers)"
                    );
                    said_down = false;
                }
            }
        }
        let pending = me.pending();
        let counts: Vec<u64> = pending.iter().map(|p| p.2).collect();
        let busy = counts.iter().any(|t| *t > 0);
        let now = tokio::time::Instant::now();
        look_again = busy.then_some(now + LINGER);
        let renew = counts != said || (busy && now >= said_at + RENEW);
        if batch.is_empty() && !renew {
            continue;
        }
        let sent = match conn.as_mut() {
            Some(c) => {
                let publish = redis::cmd("PUBLISH")
                    .arg(&*channel)
                    .arg(encode(me.replica, &batch, &pending))
                    .to_owned();
                match tokio::time::timeout(TIMEOUT, publish.query_async::<()>(c)).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!("no answer within {} ms", TIMEOUT.as_millis())),
                }
            }
            None => Err(String::new()),
        };
        if sent.is_ok() {
            said = counts;
            said_at = now;
        }
        let counter = match sent {
            Ok(()) => &metrics.published,
            Err(why) => {
                if conn.take().is_some() {
                    next_try = tokio::time::Instant::now() + Duration::from_secs(1);
                }
                up.set(&up.publish, false, &metrics);
                if !said_down {
                    let why = if why.is_empty() {
                        "no connection to Redis"
                    } else {
                        &why
                    };
                    tracing::warn!(error = %why, "prefix records cannot be published to the other replicas: they route on what they have seen until Redis answers");
                    said_down = true;
                }
                &metrics.dropped
            }
        };
        counter.inc_by(batch.len() as u64);
        batch.clear();
    }
}

async fn subscribe_loop(
    link: RedisLink,
    learner: Learner,
    channel: Arc<str>,
    metrics: Arc<Metrics>,
    up: Arc<Up>,
    stop: CancellationToken,
) {
    // Said once per switch, both ways.
    let mut said_down = false;
    loop {
        let subscribed = async {
            let mut ps = link.client().get_async_pubsub().await?;
            ps.subscribe(&*channel).await?;
            Ok::<_, redis::RedisError>(ps)
        };
        let ps = tokio::select! {
            _ = stop.cancelled() => return,
            r = tokio::time::timeout(TIMEOUT, subscribed) => r,
        };
        match ps {
            Ok(Ok(ps)) => {
                up.set(&up.subscribe, true, &metrics);
                if said_down {
                    tracing::info!(
                        "prefix records are shared between replicas again (Redis answers)"
                    );
                }
                let (mut sink, mut messages) = ps.split();
                let mut ping = tokio::time::interval(Duration::from_secs(1));
                ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let why = loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        m = messages.next() => match m {
                            Some(m) => learner.learn(m.get_payload_bytes(), &metrics),
                            None => break "the subscription ended".to_owned(),
                        },
                        _ = ping.tick() => {
                            learner.forget_stale();
                            match tokio::time::timeout(TIMEOUT, sink.ping::<redis::Value>()).await {
                                Ok(Ok(_)) => {}
                                Ok(Err(e)) => break e.to_string(),
                                Err(_) => break format!("no answer to a ping within {} ms", TIMEOUT.as_millis()),
                            }
                        }
                    }
                };
                up.set(&up.subscribe, false, &metrics);
                learner.forget_all();
                tracing::warn!(error = %why, "prefix records are no longer shared between replicas: routing on this replica's own index until Redis answers");
                said_down = true;
            }
            Ok(Err(e)) if !said_down => {
                tracing::warn!(error = %e, "prefix records cannot be shared between replicas: routing on this replica's own index until Redis answers");
                said_down = true;
            }
            Err(_) if !said_down => {
                tracing::warn!(
                    "prefix records cannot be shared between replicas (Redis did not answer within 1 s): routing on this replica's own index until it does"
                );
                said_down = true;
            }
            _ => {}
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

impl Learner {
    /// Record another replica's message in this replica's index.
    fn learn(&self, msg: &[u8], metrics: &Metrics) {
        // Its own messages come back too: told apart by the first eight bytes, before decoding.
        if msg.get(..8) == Some(&self.replica.to_le_bytes()[..]) {
            return;
        }
        let Some(Message {
            replica,
            records,
            pending,
        }) = decode(msg)
        else {
            metrics.dropped.inc();
            return;
        };
        self.learn_pending(replica, &pending);
        let generation = self.fleet.current();
        for (model, backend, names) in records {
            let found = generation.get(model).and_then(|pool| {
                let index = pool.prefix.as_ref()?;
                let b = pool.backends.iter().find(|b| &*b.base == backend)?;
                Some((index, b, pool.config().load_aware.is_some()))
            });
            match found {
                Some((index, ..)) if names.len() > self.max_prompt_bytes / index.block_bytes() => {
                    metrics.dropped.inc();
                }
                Some((index, b, load_aware)) => {
                    index.record(&names, u32::try_from(b.metrics_index).unwrap_or(u32::MAX));
                    // A record is a request the other replica has just sent there: its load
                    // counts now, not at the next scrape of the backend's metrics.
                    if load_aware {
                        b.count_others_request();
                    }
                    metrics.received.inc();
                }
                None => metrics.dropped.inc(),
            }
        }
    }

    /// Replica `replica`'s counts not prefilled replace what it said before.
    fn learn_pending(&self, replica: u64, counts: &[(&str, &str, u64)]) {
        let now = Instant::now();
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.retain(|(r, ..), _| *r != replica);
        for (model, backend, tokens) in counts.iter().filter(|c| c.2 > 0) {
            pending.insert(
                (replica, (*model).to_owned(), (*backend).to_owned()),
                (*tokens, now),
            );
        }
        self.apply_pending(&pending);
    }

    /// Forget the counts of replicas that have not renewed them for `FORGET`.
    fn forget_stale(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let before = pending.len();
        pending.retain(|_, (_, at)| at.elapsed() < FORGET);
        if pending.len() != before {
            self.apply_pending(&pending);
        }
    }

    /// Forget every other replica's counts: the subscription is lost, so they would never
    /// be renewed nor taken back.
    fn forget_all(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.clear();
        self.apply_pending(&pending);
    }

    /// Each longest-prefix backend's `others_prefill`: the sum of the other replicas' counts
    /// (summed once per backend named, then looked up: linear in both).
    fn apply_pending(&self, pending: &OthersPending) {
        let mut sums: std::collections::HashMap<(&str, &str), u64> =
            std::collections::HashMap::with_capacity(pending.len());
        for ((_, model, base), (tokens, _)) in pending {
            *sums.entry((model.as_str(), base.as_str())).or_default() += tokens;
        }
        let generation = self.fleet.current();
        for pool in generation.iter().filter(|p| p.prefix.is_some()) {
            for b in pool.backends.iter() {
                let sum = sums.get(&(&*pool.model, &*b.base)).copied().unwrap_or(0);
                b.others_prefill.store(sum, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_survives_the_wire() {
        let r = |backend: &str, names: Vec<u64>| Record {
            model: Arc::from("qwen32b"),
            backend: Arc::from(backend),
            names: Arc::from(names),
        };
        let batch = [
            r("http://10.0.0.7:8000", vec![1, u64::MAX, 42]),
            r("http://10.0.0.8:8000", vec![]),
        ];
        let pending = [
            (
                Arc::from("qwen32b"),
                Arc::from("http://10.0.0.7:8000"),
                5_500,
            ),
            (Arc::from("qwen32b"), Arc::from("http://10.0.0.8:8000"), 0),
        ];
        let msg = encode(7, &batch, &pending);
        let m = decode(&msg).unwrap();
        assert_eq!(m.replica, 7);
        assert_eq!(
            m.records,
            [
                ("qwen32b", "http://10.0.0.7:8000", vec![1, u64::MAX, 42]),
                ("qwen32b", "http://10.0.0.8:8000", vec![]),
            ]
        );
        assert_eq!(
            m.pending,
            [
                ("qwen32b", "http://10.0.0.7:8000", 5_500),
                ("qwen32b", "http://10.0.0.8:8000", 0),
            ]
        );
        // Counts alone, without records (a first token arrived).
        let alone = encode(7, &[], &pending[..1]);
        let m = decode(&alone).unwrap();
        assert!(m.records.is_empty());
        assert_eq!(m.pending, [("qwen32b", "http://10.0.0.7:8000", 5_500)]);
        assert!(decode(&msg[..msg.len() - 1]).is_none(), "a cut message");
        assert!(decode(b"short").is_none());
        // A record count the message cannot hold.
        let mut lying = encode(7, &batch, &[]);
        lying[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&lying).is_none());
    }
}
