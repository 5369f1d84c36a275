//! Bounds on client connections, so that sockets cannot take the gateway offline:
//!
//! - a cap on open connections per listener (`server.max_connections`, by default derived from
//!   the descriptor limit so that every client connection can still get an upstream connection
//!   and the store, Redis and the probes keep their descriptors);
//! - a cap per client address (`server.max_connections_per_address`, IPv6 by /64; by default
//!   half the listener's cap), so one address cannot hold every place: a connection past it is
//!   closed at once;
//! - a deadline for a new connection to deliver its first request head (TLS handshake
//!   included): a silent or trickling socket is closed;
//! - a back-off when `accept` fails for want of descriptors or memory, instead of a spin.
//!
//! At the cap the listener stops accepting: new connections wait in the kernel's listen backlog
//! until one closes (the way nginx behaves at `worker_connections`), and one warning says so.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Descriptors kept out of the client-connection budget: listeners, the key store and request
/// log pools, Redis, probes, discovery, log files.
const RESERVED_DESCRIPTORS: u64 = 128;
/// Never derive a cap below this, even under a tiny descriptor limit.
const MIN_DERIVED: usize = 16;

/// Raise the soft descriptor limit to the hard one (what nginx's `worker_rlimit_nofile` and
/// most servers do) and return the soft limit now in force, if it can be read.
pub(super) fn raise_descriptor_limit() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
        if soft < hard {
            match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                Ok(()) => return Some(hard),
                Err(e) => {
                    tracing::debug!(error = %e, soft, hard, "cannot raise the descriptor limit")
                }
            }
        }
        Some(soft)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// The cap used when `server.max_connections` is 0: half of what the descriptor limit leaves
/// after the reserve, since a proxied request holds a client and an upstream connection.
pub(super) fn derived_max_connections(descriptor_limit: Option<u64>) -> usize {
    match descriptor_limit {
        Some(n) => {
            let per_pair = n.saturating_sub(RESERVED_DESCRIPTORS) / 2;
            usize::try_from(per_pair)
                .unwrap_or(usize::MAX)
                .clamp(MIN_DERIVED, 1 << 20)
        }
        None => 4096,
    }
}

/// Metrics of the client listeners, labelled by listener (`api`, `admin`).
#[derive(Clone, Debug)]
pub(super) struct ConnMetrics {
    open: IntGaugeVec,
    events: IntCounterVec,
}

impl ConnMetrics {
    pub(super) fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let open = IntGaugeVec::new(
            Opts::new(
                "fleetgate_client_connections",
                "Client connections open now, per listener.",
            ),
            &["listener"],
        )?;
        let events = IntCounterVec::new(
            Opts::new(
                "fleetgate_client_connection_events_total",
                "Client connections closed or held back by the gateway's own bounds: \
                 header_timeout (no complete request head in time), limit_reached (the \
                 listener stopped accepting at server.max_connections), address_limit \
                 (closed at once: its address, IPv6 by /64, already had \
                 server.max_connections_per_address open), accept_error (accept failed, e.g. \
                 out of descriptors).",
            ),
            &["listener", "event"],
        )?;
        registry.register(Box::new(open.clone()))?;
        registry.register(Box::new(events.clone()))?;
        Ok(Self { open, events })
    }
}

/// One listener's bounds, shared by the workers accepting on it.
#[derive(Debug)]
pub(super) struct ConnLimit {
    listener: &'static str,
    max: usize,
    permits: Arc<Semaphore>,
    /// Connections one address may hold open.
    per_address: u32,
    /// Open connections by address (IPv6 by /64); entries leave at zero.
    by_address: Arc<Mutex<HashMap<IpKey, u32>>>,
    last_address_warned_ms: AtomicU64,
    /// A new connection must deliver its first request head within this.
    pub(crate) header_timeout: Duration,
    /// An HTTP/1.1 connection idle between requests closes after this.
    pub(crate) keepalive_timeout: Duration,
    /// The largest request head read (`server.max_request_head_bytes`), both protocols.
    pub(crate) max_head: usize,
    /// When the last "limit reached" warning was logged (ms since `epoch`), to log once per
    /// episode rather than once per refused accept.
    last_warned_ms: AtomicU64,
    epoch: Instant,
    metrics: Option<ConnMetrics>,
    /// This listener's open-connections gauge, resolved once (not per connection).
    open: Option<prometheus::IntGauge>,
}

/// A connection's place under the cap; dropping it frees the place.
#[derive(Debug)]
pub(super) struct ConnPermit {
    _permit: OwnedSemaphorePermit,
    gauge: Option<prometheus::IntGauge>,
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        if let Some(g) = &self.gauge {
            g.dec();
        }
    }
}

/// What a client address is counted by: an IPv4 address, or an IPv6 /64 (one host usually
/// has a whole /64 to pick addresses from). IPv4-mapped IPv6 addresses count as IPv4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum IpKey {
    V4([u8; 4]),
    V6Prefix([u8; 8]),
}

impl IpKey {
    pub(super) fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => IpKey::V4(v4.octets()),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => IpKey::V4(v4.octets()),
                None => {
                    let o = v6.octets();
                    let mut prefix = [0u8; 8];
                    prefix.copy_from_slice(&o[..8]);
                    IpKey::V6Prefix(prefix)
                }
            },
        }
    }
}

/// A connection's place in its address's share; dropping it frees the place.
#[derive(Debug)]
pub(super) struct AddressPlace {
    key: IpKey,
    by_address: Arc<Mutex<HashMap<IpKey, u32>>>,
}

impl Drop for AddressPlace {
    fn drop(&mut self) {
        let mut map = self.by_address.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.key);
            }
        }
    }
}

/// The share of one address when `server.max_connections_per_address` is 0: half the
/// listener's cap, so one address never holds every place.
pub(super) fn derived_per_address(max: usize) -> u32 {
    u32::try_from((max / 2).max(1)).unwrap_or(u32::MAX)
}

impl ConnLimit {
    /// The listener it guards (`api`, `admin`): a log field.
    pub(super) fn name(&self) -> &'static str {
        self.listener
    }

    pub(super) fn new(
        listener: &'static str,
        max: usize,
        server: &crate::config::ServerConfig,
        metrics: Option<ConnMetrics>,
    ) -> Arc<Self> {
        let per_address = match server.max_connections_per_address {
            0 => derived_per_address(max),
            n => n,
        };
        Arc::new(Self {
            listener,
            max,
            permits: Arc::new(Semaphore::new(max.max(1))),
            per_address,
            by_address: Arc::new(Mutex::new(HashMap::new())),
            last_address_warned_ms: AtomicU64::new(0),
            header_timeout: server.header_timeout,
            keepalive_timeout: server.keepalive_timeout,
            max_head: server.max_request_head_bytes,
            last_warned_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            open: metrics
                .as_ref()
                .map(|m| m.open.with_label_values(&[listener])),
            metrics,
        })
    }

    pub(super) fn listener(&self) -> &'static str {
        self.listener
    }

    /// A place for one more connection from `ip`, or `None` when its address already holds
    /// its share (the connection is to be closed; counted, and said once per episode).
    pub(super) fn admit(&self, ip: IpAddr) -> Option<AddressPlace> {
        let key = IpKey::of(ip);
        {
            let mut map = self.by_address.lock().unwrap_or_else(|e| e.into_inner());
            let n = map.entry(key).or_insert(0);
            if *n < self.per_address {
                *n += 1;
                return Some(AddressPlace {
                    key,
                    by_address: self.by_address.clone(),
                });
            }
        }
        self.count("address_limit");
        if self.once_per_episode(&self.last_address_warned_ms) {
            tracing::warn!(
                listener = self.listener,
                client = %ip,
                max_connections_per_address = self.per_address,
                "a client address holds {} connections (server.max_connections_per_address): \
                 its next connections are closed at once",
                self.per_address
            );
        }
        None
    }

    /// True at most once per 10 s for `last` (a warning's episode).
    fn once_per_episode(&self, last: &AtomicU64) -> bool {
        let now_ms = self.epoch.elapsed().as_millis() as u64 + 10_000;
        let prev = last.load(Ordering::Relaxed);
        now_ms.saturating_sub(prev) >= 10_000
            && last
                .compare_exchange(prev, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    fn permit(&self, p: OwnedSemaphorePermit) -> ConnPermit {
        let gauge = self.open.clone();
        if let Some(g) = &gauge {
            g.inc();
        }
        ConnPermit { _permit: p, gauge }
    }

    /// A place for the next connection, at once if there is one.
    pub(super) fn try_acquire(&self) -> Option<ConnPermit> {
        let p = self.permits.clone().try_acquire_owned().ok()?;
        Some(self.permit(p))
    }

    /// Wait for a place; says once per episode (at most every 10 s) that the cap is reached.
    pub(super) async fn acquire(&self) -> Option<ConnPermit> {
        self.count("limit_reached");
        if self.once_per_episode(&self.last_warned_ms) {
            tracing::warn!(
                listener = self.listener,
                max_connections = self.max,
                "connection limit reached: {} client connections are open (server.max_connections); \
                 new connections wait in the listen backlog until one closes",
                self.max
            );
        }
        // `None` only if the semaphore were closed, which nothing does.
        let p = self.permits.clone().acquire_owned().await.ok()?;
        Some(self.permit(p))
    }

    pub(super) fn count(&self, event: &str) {
        if let Some(m) = &self.metrics {
            m.events.with_label_values(&[self.listener, event]).inc();
        }
    }
}

/// Back-off for failed accepts: out of descriptors or memory, retrying at once only spins.
#[derive(Debug, Default)]
pub(super) struct AcceptBackoff {
    delay: Duration,
    failures: u64,
    last_log: Option<Instant>,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_secs(1);

    /// An accept succeeded: the next failure starts from the shortest delay again.
    pub(super) fn reset(&mut self) {
        self.delay = Duration::ZERO;
    }

    /// How long to wait after `e` before accepting again (zero for errors that concern only
    /// the one connection, such as a peer that reset before it was accepted). Logs at most
    /// every 5 s, with the number of failures since the last line.
    pub(super) fn on_error(&mut self, e: &io::Error, listener: &str) -> Duration {
        let resource = matches!(
            e.raw_os_error(),
            Some(code) if code == libc_codes::EMFILE
                || code == libc_codes::ENFILE
                || code == libc_codes::ENOBUFS
                || code == libc_codes::ENOMEM
        );
        self.failures += 1;
        let now = Instant::now();
        if self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(5))
        {
            tracing::warn!(
                listener,
                error = %e,
                failures = self.failures,
                "accept failed{}",
                if resource {
                    "; backing off (raise the descriptor limit or lower server.max_connections)"
                } else {
                    ""
                }
            );
            self.last_log = Some(now);
            self.failures = 0;
        }
        if !resource {
            return Duration::ZERO;
        }
        self.delay = if self.delay.is_zero() {
            Self::FIRST
        } else {
            (self.delay * 2).min(Self::MAX)
        };
        self.delay
    }
}

/// The errno values the back-off looks at.
#[cfg(target_os = "linux")]
mod libc_codes {
    pub(super) use nix::libc::{EMFILE, ENFILE, ENOBUFS, ENOMEM};
}
#[cfg(not(target_os = "linux"))]
mod libc_codes {
    pub(crate) const ENOMEM: i32 = 12;
    pub(crate) const ENFILE: i32 = 23;
    pub(crate) const EMFILE: i32 = 24;
    pub(crate) const ENOBUFS: i32 = 55;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_derived_cap_leaves_a_reserve_and_a_descriptor_per_upstream() {
        assert_eq!(derived_max_connections(Some(1024)), 448);
        assert_eq!(derived_max_connections(Some(65_536)), 32_704);
        assert_eq!(derived_max_connections(Some(100)), MIN_DERIVED);
    }

    /// An address holds at most its share; IPv6 addresses of one /64 share one, and an
    /// IPv4-mapped address counts as its IPv4 one; a closed connection frees its place.
    #[test]
    fn each_address_holds_at_most_its_share() {
        let server = crate::config::ServerConfig {
            max_connections_per_address: 2,
            ..Default::default()
        };
        let limit = ConnLimit::new("api", 10, &server, None);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let p1 = limit.admit(a).unwrap();
        let _p2 = limit.admit(mapped).unwrap();
        assert!(limit.admit(a).is_none());
        assert!(limit.admit("10.0.0.2".parse().unwrap()).is_some());
        drop(p1);
        assert!(limit.admit(a).is_some());
        let v6 = |s: &str| -> IpAddr { s.parse().unwrap() };
        let _q1 = limit.admit(v6("2001:db8:1:2::1")).unwrap();
        let _q2 = limit.admit(v6("2001:db8:1:2:ffff::9")).unwrap();
        assert!(limit.admit(v6("2001:db8:1:2::77")).is_none(), "same /64");
        assert!(limit.admit(v6("2001:db8:1:3::1")).is_some(), "another /64");
        // The default share is half the cap.
        let derived = ConnLimit::new("api", 448, &crate::config::ServerConfig::default(), None);
        assert_eq!(derived.per_address, 224);
        assert_eq!(derived_per_address(1), 1);
    }

    #[test]
    fn descriptor_exhaustion_backs_off_exponentially_up_to_a_second() {
        let mut b = AcceptBackoff::default();
        let emfile = io::Error::from_raw_os_error(libc_codes::EMFILE);
        let waits: Vec<_> = (0..10).map(|_| b.on_error(&emfile, "api")).collect();
        assert_eq!(waits[0], Duration::from_millis(10));
        assert_eq!(waits[1], Duration::from_millis(20));
        assert_eq!(waits[9], Duration::from_secs(1));
        b.reset();
        assert_eq!(b.on_error(&emfile, "api"), Duration::from_millis(10));
        let aborted = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(b.on_error(&aborted, "api"), Duration::ZERO);
    }
}
