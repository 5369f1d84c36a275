//! `[server]`: the client-facing listener, TLS, logging, shutdown and worker settings.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, FileErrors};

pub(crate) const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// 25 MiB: OpenAI's own limit on an audio file.
pub(super) const DEFAULT_MAX_AUDIO_BODY_BYTES: usize = 25 * 1024 * 1024;
/// 512 MiB of bodies still arriving, every key together; 128 MiB for one key (five audio
/// uploads at OpenAI's limit).
pub(super) const DEFAULT_MAX_PENDING_BODY_BYTES: usize = 512 * 1024 * 1024;
pub(super) const DEFAULT_MAX_PENDING_BODY_BYTES_PER_KEY: usize = 128 * 1024 * 1024;

/// The largest request head the listener reads (HTTP/1.1: request line and headers; HTTP/2:
/// the header list as HTTP/2 counts it, each field's name and value plus 32 bytes). Well above
/// what is forwarded (`DEFAULT_MAX_UPSTREAM_HEAD_BYTES`), so that a head the backends would
/// refuse still reaches the gateway's own 431 with its explanation; beyond it the listener
/// answers a bare 431 itself.
pub(super) const DEFAULT_MAX_REQUEST_HEAD_BYTES: usize = 64 * 1024;

/// The largest request head forwarded to a backend (request line, `Host`, the client's headers
/// that go on, the gateway's own). A little below 16 KiB: h11, the HTTP/1.1 parser of uvicorn
/// (vLLM's server), refuses a head over its `max_incomplete_event_size`, 16 KiB by default
/// (`h11/_connection.py`, `DEFAULT_MAX_INCOMPLETE_EVENT_SIZE = 16 * 1024`); Node's
/// `--max-http-header-size` is 16 KiB too. (Recent vLLM launchers raise h11's limit to 4 MiB,
/// `vllm/entrypoints/constants.py`; other servers and proxies in front of a backend do not.)
pub(super) const DEFAULT_MAX_UPSTREAM_HEAD_BYTES: usize = 15 * 1024;

/// The largest single header value forwarded to a backend: a little below nginx's default
/// `large_client_header_buffers 4 8k` (a header line must fit in 8 KiB) and Apache's
/// `LimitRequestFieldSize 8190`, the common proxies in front of a backend.
pub(super) const DEFAULT_MAX_UPSTREAM_HEADER_VALUE_BYTES: usize = 7 * 1024 + 512;

/// hyper's smallest HTTP/1.1 buffer: a smaller `max_request_head_bytes` could not be applied.
const MIN_REQUEST_HEAD_BYTES: usize = 8192;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// The API listener's accept queue: connections the kernel completes and holds until a
    /// worker accepts them (the kernel caps it at `net.core.somaxconn`).
    pub listen_backlog: u32,
    pub max_body_bytes: usize,
    /// The largest `multipart/form-data` body of the audio routes (an audio file is larger
    /// than any JSON body).
    pub max_audio_body_bytes: usize,
    /// The largest request head the listener accepts (see `DEFAULT_MAX_REQUEST_HEAD_BYTES`).
    pub max_request_head_bytes: usize,
    /// The largest request head, and single header value, forwarded to a backend: a larger
    /// one is refused with 431 before any backend is contacted.
    pub max_upstream_head_bytes: usize,
    pub max_upstream_header_value_bytes: usize,
    pub shutdown_grace: Duration,
    pub tls: Option<TlsConfig>,
    pub log_format: LogFormat,
    /// Emit one structured log event per request (target `fleetgate::request`).
    pub request_log_events: bool,
    /// How often backends are probed for `/readyz`.
    pub health_interval: Duration,
    /// Request-path worker threads, each with its own event loop (0: one per CPU core).
    pub workers: usize,
    /// Re-read the config file when its content changes (checked every 2 s) and apply its
    /// `[[pools]]`, as SIGHUP does.
    pub watch_config: bool,
    /// Client connections open at once on the API listener (0: derived from the descriptor
    /// limit at start, see `server::conn_limit`).
    pub max_connections: usize,
    /// Client connections one address (IPv6: one /64) may hold open on a listener (0: half of
    /// the listener's cap); a connection past it is closed at once.
    pub max_connections_per_address: u32,
    /// The longest SSE line relayed from a backend, carried across reads: past it the stream
    /// ends with an `upstream_protocol_error` event (a backend that never ends a line cannot
    /// grow the gateway's memory).
    pub max_stream_line_bytes: usize,
    /// Stored responses whose backend is remembered (the oldest forgotten first), and for how
    /// long (`proxy::pins`).
    pub response_pin_capacity: usize,
    pub response_pin_ttl: Duration,
    /// A new connection must deliver its first request head (TLS handshake included) within
    /// this, or it is closed.
    pub header_timeout: Duration,
    /// An HTTP/1.1 connection idle between requests (or sending the next head) is closed after
    /// this.
    pub keepalive_timeout: Duration,
    /// A request's whole body must arrive within this (408 `body_timeout`).
    pub body_timeout: Duration,
    /// A body that stops arriving for this long is refused (408 `body_timeout`).
    pub body_idle_timeout: Duration,
    /// The bytes of request bodies still arriving the gateway holds at once, all keys
    /// together and per key (a body counts its declared length until it has arrived).
    pub max_pending_body_bytes: usize,
    pub max_pending_body_bytes_per_key: usize,
    /// Set `X-Forwarded-For`, `-Proto` and `-Host` on forwarded requests, as a reverse proxy
    /// does (false: the client's are removed and none are set).
    pub forwarded_headers: bool,
    /// Peers whose own forwarding headers are believed (load balancers, ingresses in front of
    /// the gateway); anyone else's are replaced.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Name backends by their address in the error messages clients get (false: by the pool's
    /// model and the backend's number, e.g. `qwen32b#1`; operators see addresses in
    /// `GET /admin/backends`, the logs and the metrics).
    pub expose_backend_addresses: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            listen_backlog: DEFAULT_LISTEN_BACKLOG,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_audio_body_bytes: DEFAULT_MAX_AUDIO_BODY_BYTES,
            max_request_head_bytes: DEFAULT_MAX_REQUEST_HEAD_BYTES,
            max_upstream_head_bytes: DEFAULT_MAX_UPSTREAM_HEAD_BYTES,
            max_upstream_header_value_bytes: DEFAULT_MAX_UPSTREAM_HEADER_VALUE_BYTES,
            shutdown_grace: Duration::from_secs(30),
            tls: None,
            log_format: LogFormat::Text,
            request_log_events: true,
            health_interval: Duration::from_secs(5),
            workers: 0,
            watch_config: false,
            max_connections: 0,
            max_connections_per_address: 0,
            max_stream_line_bytes: fleetgate_protocol::sse::DEFAULT_MAX_LINE,
            response_pin_capacity: 100_000,
            response_pin_ttl: Duration::from_secs(24 * 3600),
            header_timeout: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            body_idle_timeout: Duration::from_secs(10),
            max_pending_body_bytes: DEFAULT_MAX_PENDING_BODY_BYTES,
            max_pending_body_bytes_per_key: DEFAULT_MAX_PENDING_BODY_BYTES_PER_KEY,
            forwarded_headers: true,
            trusted_proxies: Vec::new(),
            expose_backend_addresses: false,
        }
    }
}

pub(super) fn validate(s: RawServer, err: FileErrors<'_>) -> Result<ServerConfig, ConfigError> {
    let listen: SocketAddr = s.listen.parse().map_err(|_| {
        err.at(
            "server.listen",
            format!(
                "`{}` is not an address:port (for example \"127.0.0.1:8080\" or \"0.0.0.0:8080\")",
                s.listen
            ),
        )
    })?;
    if s.max_body_bytes < 1024 {
        return Err(err.at("server.max_body_bytes", "must be at least 1024"));
    }
    if s.max_audio_body_bytes < 1024 {
        return Err(err.at("server.max_audio_body_bytes", "must be at least 1024"));
    }
    let head = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    let (listener_head, upstream_head, upstream_value) = (
        head(s.max_request_head_bytes),
        head(s.max_upstream_head_bytes),
        head(s.max_upstream_header_value_bytes),
    );
    if !(MIN_REQUEST_HEAD_BYTES..=u32::MAX as usize).contains(&listener_head) {
        return Err(err.at(
            "server.max_request_head_bytes",
            format!("must be between {MIN_REQUEST_HEAD_BYTES} and {}", u32::MAX),
        ));
    }
    if upstream_head < 1024 || upstream_head > listener_head {
        return Err(err.at(
            "server.max_upstream_head_bytes",
            format!(
                "must be at least 1024 and at most server.max_request_head_bytes ({listener_head}): the listener must accept every head the gateway would forward, so that a larger one gets the gateway's own 431"
            ),
        ));
    }
    if upstream_value < 64 || upstream_value > upstream_head {
        return Err(err.at(
            "server.max_upstream_header_value_bytes",
            format!(
                "must be at least 64 and at most server.max_upstream_head_bytes ({upstream_head})"
            ),
        ));
    }
    if !(s.shutdown_grace_seconds.is_finite() && s.shutdown_grace_seconds >= 0.0) {
        return Err(err.at(
            "server.shutdown_grace_seconds",
            "must be a number of seconds ≥ 0",
        ));
    }
    for (field, v) in [
        ("server.header_timeout_seconds", s.header_timeout_seconds),
        (
            "server.keepalive_timeout_seconds",
            s.keepalive_timeout_seconds,
        ),
        ("server.body_timeout_seconds", s.body_timeout_seconds),
        (
            "server.body_idle_timeout_seconds",
            s.body_idle_timeout_seconds,
        ),
    ] {
        if !(v.is_finite() && v > 0.0 && v <= 3600.0) {
            return Err(err.at(
                field,
                "must be a number of seconds > 0 and ≤ 3600 (a connection that sends nothing is closed after it)",
            ));
        }
    }
    if s.max_stream_line_bytes < 4096 {
        return Err(err.at(
            "server.max_stream_line_bytes",
            "must be at least 4096 (vLLM's events with logprobs or tool calls run to hundreds of kilobytes; the default is 1048576)",
        ));
    }
    if s.response_pin_capacity == 0 || s.response_pin_ttl_s == 0 {
        return Err(err.at(
            "server.response_pin_capacity",
            "server.response_pin_capacity and server.response_pin_ttl_s must be > 0: without a pin, a stored response (GET /v1/responses/{id}, previous_response_id) cannot be found on the backend that holds it",
        ));
    }
    let (pending, per_key) = (
        usize::try_from(s.max_pending_body_bytes).unwrap_or(usize::MAX),
        usize::try_from(s.max_pending_body_bytes_per_key).unwrap_or(usize::MAX),
    );
    let largest_body = s.max_body_bytes.max(s.max_audio_body_bytes);
    if s.max_pending_body_bytes_per_key < largest_body {
        return Err(err.at(
            "server.max_pending_body_bytes_per_key",
            format!(
                "must be at least the largest body a route takes ({largest_body}: server.max_body_bytes and server.max_audio_body_bytes), or one such body could never be received"
            ),
        ));
    }
    if pending < per_key {
        return Err(err.at(
            "server.max_pending_body_bytes",
            format!(
                "must be at least server.max_pending_body_bytes_per_key ({per_key}): it bounds every key together"
            ),
        ));
    }
    if s.health_interval_ms == 0 {
        return Err(err.at("server.health_interval_ms", "must be > 0"));
    }
    if s.listen_backlog == 0 || s.listen_backlog > i32::MAX as u32 {
        return Err(err.at(
            "server.listen_backlog",
            format!(
                "must be between 1 and {} (the default, {DEFAULT_LISTEN_BACKLOG}, holds a reconnect storm; the kernel caps it at net.core.somaxconn)",
                i32::MAX
            ),
        ));
    }
    let mut trusted_proxies = Vec::with_capacity(s.trusted_proxies.len());
    for (i, text) in s.trusted_proxies.iter().enumerate() {
        let net = text
            .trim()
            .parse::<ipnet::IpNet>()
            .or_else(|_| text.trim().parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| {
                err.at(
                    format!("server.trusted_proxies[{i}]"),
                    format!(
                        "`{text}` is not an address or a CIDR range (for example \"10.0.0.0/8\", \"127.0.0.1\" or \"fd00::/8\")"
                    ),
                )
            })?;
        trusted_proxies.push(net.trunc());
    }
    let tls = s.tls.map(|t| TlsConfig {
        cert: err.path(t.cert),
        key: err.path(t.key),
    });
    Ok(ServerConfig {
        listen,
        listen_backlog: s.listen_backlog,
        max_body_bytes: usize::try_from(s.max_body_bytes).unwrap_or(usize::MAX),
        max_audio_body_bytes: usize::try_from(s.max_audio_body_bytes).unwrap_or(usize::MAX),
        max_request_head_bytes: listener_head,
        max_upstream_head_bytes: upstream_head,
        max_upstream_header_value_bytes: upstream_value,
        shutdown_grace: Duration::from_secs_f64(s.shutdown_grace_seconds),
        tls,
        log_format: s.log_format,
        request_log_events: s.request_log_events,
        health_interval: Duration::from_millis(s.health_interval_ms),
        workers: s.workers,
        watch_config: s.watch_config,
        max_connections: s.max_connections,
        max_connections_per_address: s.max_connections_per_address,
        max_stream_line_bytes: usize::try_from(s.max_stream_line_bytes).unwrap_or(usize::MAX),
        response_pin_capacity: s.response_pin_capacity,
        response_pin_ttl: Duration::from_secs(s.response_pin_ttl_s),
        header_timeout: Duration::from_secs_f64(s.header_timeout_seconds),
        keepalive_timeout: Duration::from_secs_f64(s.keepalive_timeout_seconds),
        body_timeout: Duration::from_secs_f64(s.body_timeout_seconds),
        body_idle_timeout: Duration::from_secs_f64(s.body_idle_timeout_seconds),
        max_pending_body_bytes: pending,
        max_pending_body_bytes_per_key: per_key,
        forwarded_headers: s.forwarded_headers,
        trusted_proxies,
        expose_backend_addresses: s.expose_backend_addresses,
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    #[serde(default = "default_listen")]
    pub(super) listen: String,
    #[serde(default = "default_max_body")]
    pub(super) max_body_bytes: u64,
    #[serde(default = "default_max_audio_body")]
    pub(super) max_audio_body_bytes: u64,
    #[serde(default = "default_max_request_head")]
    pub(super) max_request_head_bytes: u64,
    #[serde(default = "default_max_upstream_head")]
    pub(super) max_upstream_head_bytes: u64,
    #[serde(default = "default_max_upstream_header_value")]
    pub(super) max_upstream_header_value_bytes: u64,
    #[serde(default = "default_grace")]
    pub(super) shutdown_grace_seconds: f64,
    pub(super) tls: Option<RawTls>,
    #[serde(default)]
    pub(super) log_format: LogFormat,
    #[serde(default = "super::default_true")]
    pub(super) request_log_events: bool,
    #[serde(default = "default_health_interval")]
    pub(super) health_interval_ms: u64,
    #[serde(default)]
    pub(super) workers: usize,
    #[serde(default)]
    pub(super) watch_config: bool,
    #[serde(default)]
    pub(super) max_connections: usize,
    #[serde(default)]
    pub(super) max_connections_per_address: u32,
    #[serde(default = "default_listen_backlog")]
    pub(super) listen_backlog: u32,
    #[serde(default = "default_max_stream_line")]
    pub(super) max_stream_line_bytes: u64,
    #[serde(default = "default_response_pin_capacity")]
    pub(super) response_pin_capacity: usize,
    #[serde(default = "default_response_pin_ttl")]
    pub(super) response_pin_ttl_s: u64,
    #[serde(default = "default_header_timeout")]
    pub(super) header_timeout_seconds: f64,
    #[serde(default = "default_keepalive_timeout")]
    pub(super) keepalive_timeout_seconds: f64,
    #[serde(default = "default_body_timeout")]
    pub(super) body_timeout_seconds: f64,
    #[serde(default = "default_body_idle_timeout")]
    pub(super) body_idle_timeout_seconds: f64,
    #[serde(default = "default_max_pending_body")]
    pub(super) max_pending_body_bytes: u64,
    #[serde(default = "default_max_pending_body_per_key")]
    pub(super) max_pending_body_bytes_per_key: u64,
    #[serde(default = "super::default_true")]
    pub(super) forwarded_headers: bool,
    #[serde(default)]
    pub(super) trusted_proxies: Vec<String>,
    #[serde(default)]
    pub(super) expose_backend_addresses: bool,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            max_body_bytes: default_max_body(),
            max_audio_body_bytes: default_max_audio_body(),
            max_request_head_bytes: default_max_request_head(),
            max_upstream_head_bytes: default_max_upstream_head(),
            max_upstream_header_value_bytes: default_max_upstream_header_value(),
            shutdown_grace_seconds: default_grace(),
            tls: None,
            log_format: LogFormat::Text,
            request_log_events: true,
            health_interval_ms: default_health_interval(),
            workers: 0,
            watch_config: false,
            max_connections: 0,
            max_connections_per_address: 0,
            listen_backlog: default_listen_backlog(),
            max_stream_line_bytes: default_max_stream_line(),
            response_pin_capacity: default_response_pin_capacity(),
            response_pin_ttl_s: default_response_pin_ttl(),
            header_timeout_seconds: default_header_timeout(),
            keepalive_timeout_seconds: default_keepalive_timeout(),
            body_timeout_seconds: default_body_timeout(),
            body_idle_timeout_seconds: default_body_idle_timeout(),
            max_pending_body_bytes: default_max_pending_body(),
            max_pending_body_bytes_per_key: default_max_pending_body_per_key(),
            forwarded_headers: true,
            trusted_proxies: Vec::new(),
            expose_backend_addresses: false,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    pub(super) cert: PathBuf,
    pub(super) key: PathBuf,
}

fn default_body_timeout() -> f64 {
    30.0
}

fn default_body_idle_timeout() -> f64 {
    10.0
}

fn default_max_pending_body() -> u64 {
    super::server::DEFAULT_MAX_PENDING_BODY_BYTES as u64
}

fn default_max_pending_body_per_key() -> u64 {
    super::server::DEFAULT_MAX_PENDING_BODY_BYTES_PER_KEY as u64
}

fn default_header_timeout() -> f64 {
    10.0
}

fn default_keepalive_timeout() -> f64 {
    60.0
}

fn default_listen() -> String {
    "127.0.0.1:8080".to_owned()
}

fn default_max_body() -> u64 {
    DEFAULT_MAX_BODY_BYTES as u64
}

fn default_max_audio_body() -> u64 {
    DEFAULT_MAX_AUDIO_BODY_BYTES as u64
}

fn default_max_request_head() -> u64 {
    DEFAULT_MAX_REQUEST_HEAD_BYTES as u64
}

fn default_max_upstream_head() -> u64 {
    DEFAULT_MAX_UPSTREAM_HEAD_BYTES as u64
}

fn default_max_upstream_header_value() -> u64 {
    DEFAULT_MAX_UPSTREAM_HEADER_VALUE_BYTES as u64
}

fn default_response_pin_capacity() -> usize {
    100_000
}

fn default_response_pin_ttl() -> u64 {
    24 * 3600
}

/// Room for a reconnect storm: thousands of clients connecting in the same millisecond (a
/// rolling update, a client pool after a network blip) wait in the accept queue instead of
/// having their SYNs dropped, which costs each of them a 1 s retransmission. Linux's default
/// `net.core.somaxconn` since 5.4; tokio's `TcpListener::bind` asks for 1 024, nginx for 511.
pub(crate) const DEFAULT_LISTEN_BACKLOG: u32 = 4096;

fn default_listen_backlog() -> u32 {
    DEFAULT_LISTEN_BACKLOG
}

fn default_max_stream_line() -> u64 {
    fleetgate_protocol::sse::DEFAULT_MAX_LINE as u64
}

fn default_grace() -> f64 {
    30.0
}

fn default_health_interval() -> u64 {
    5000
}
