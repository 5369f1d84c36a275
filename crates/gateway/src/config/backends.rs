//! `[[pools]].backends`: one entry per backend (a base URL, or a table with its weight,
//! capacity, labels, key and discovery mode), checked and normalised to a base URL.

use std::fmt;
use std::time::Duration;

use http::Uri;
use http::uri::InvalidUri;
use serde::Deserialize;

use super::{ConfigError, FileErrors};
use crate::secret::Secret;

/// One backend of a pool.
#[derive(Debug, Clone)]
pub struct BackendConfig {
    pub url: Uri,
    /// Share of new requests relative to the pool's other backends (≥ 1).
    pub weight: u32,
    /// Requests this backend serves at once (`None`: the pool's `max_in_flight_per_backend`).
    pub capacity: Option<u32>,
    /// Free-form labels (e.g. `canary`), shown by the admin API.
    pub labels: Vec<String>,
    /// Sent to this backend instead of the pool's `upstream_api_key`.
    pub upstream_api_key: Option<Secret>,
    pub discover: Discover,
    /// Its engine's KV event publisher port, where it is not the pool's `kv_events.port` (say,
    /// several vLLM servers on one host).
    pub kv_events_port: Option<u16>,
    /// Whether its engine publishes KV events (`kv_events = false`: in a pool with
    /// `[pools.kv_events]`, what its cache holds is estimated from what the gateway sent it,
    /// within the capacity its `/metrics` reports).
    pub kv_events: bool,
}

/// How a backend entry becomes backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discover {
    /// The URL is one backend.
    Static,
    /// The URL's host is re-resolved every `interval`; each address is one backend (a
    /// Kubernetes headless Service).
    Dns { interval: Duration },
}

pub(crate) const DEFAULT_DNS_INTERVAL: Duration = Duration::from_secs(5);

impl BackendConfig {
    pub fn new(url: Uri) -> Self {
        Self {
            url,
            weight: 1,
            capacity: None,
            labels: Vec::new(),
            upstream_api_key: None,
            discover: Discover::Static,
            kv_events_port: None,
            kv_events: true,
        }
    }
}

/// Why a backend URL was refused. The text names the URL as written, for the operator.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BackendUrlError {
    #[error("`{text}` is not a URL: {source}")]
    NotAUrl { text: String, source: InvalidUri },
    #[error("`{0}` needs a scheme: http://host:port or https://host:port")]
    NoScheme(String),
    #[error("`{0}` has no host")]
    NoHost(String),
    #[error(
        "`{0}` carries credentials (user:password@): fleetgate never sends a URL's userinfo; put the backend's key in `upstream_api_key` (sent as `Authorization: Bearer`)"
    )]
    Userinfo(String),
    #[error("`{0}` must not carry a query string")]
    Query(String),
    #[error("`{text}`: {source}")]
    Rebuilt { text: String, source: InvalidUri },
    #[error(
        "`{0}`: discover = \"dns\" dials each address directly, so it needs http:// (a TLS certificate names the Service, not the pods' addresses)"
    )]
    DnsNeedsHttp(Uri),
    #[error(
        "`{0}`: discover = \"dns\" needs a host name to resolve (e.g. a headless Service, vllm.default.svc.cluster.local), not an address"
    )]
    DnsNeedsHostName(Uri),
}

/// A backend is a base URL: scheme http or https, a host, an optional path prefix (a trailing
/// `/v1` is accepted and dropped, since clients' base URLs often carry it).
pub(crate) fn parse_backend_url(text: &str) -> Result<Uri, BackendUrlError> {
    let uri: Uri = text.parse().map_err(|source| BackendUrlError::NotAUrl {
        text: text.to_owned(),
        source,
    })?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => return Err(BackendUrlError::NoScheme(text.to_owned())),
    }
    if uri.host().is_none() {
        return Err(BackendUrlError::NoHost(text.to_owned()));
    }
    if let Some(a) = uri.authority()
        && let Some((_, host)) = a.as_str().rsplit_once('@')
    {
        // Named without the secret: the message reaches logs and check-config's output.
        let shown = text.replacen(a.as_str(), &format!("***@{host}"), 1);
        return Err(BackendUrlError::Userinfo(shown));
    }
    if uri.query().is_some() {
        return Err(BackendUrlError::Query(text.to_owned()));
    }
    let mut path = uri.path().trim_end_matches('/');
    if let Some(p) = path.strip_suffix("/v1") {
        path = p;
    }
    let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
    let scheme = uri.scheme_str().unwrap_or("http");
    format!("{scheme}://{authority}{path}")
        .parse()
        .map_err(|source| BackendUrlError::Rebuilt {
            text: text.to_owned(),
            source,
        })
}

/// A `discover = "dns"` entry names a host to resolve, reached over plain HTTP.
fn check_dns_entry(url: &Uri) -> Result<(), BackendUrlError> {
    if url.scheme_str() != Some("http") {
        return Err(BackendUrlError::DnsNeedsHttp(url.clone()));
    }
    let host = url.host().unwrap_or_default();
    if host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .is_ok()
    {
        return Err(BackendUrlError::DnsNeedsHostName(url.clone()));
    }
    Ok(())
}

/// The backend entries of one pool; `at` is their field path (`pools[0].backends`).
pub(super) fn validate(
    at: &str,
    raw: Vec<RawBackend>,
    err: FileErrors<'_>,
) -> Result<Vec<BackendConfig>, ConfigError> {
    let mut backends = Vec::with_capacity(raw.len());
    for (j, b) in raw.into_iter().enumerate() {
        let bat = |f: &str| format!("{at}[{j}]{f}");
        let backend = match b {
            RawBackend::Url(u) => BackendConfig::new(
                parse_backend_url(&u).map_err(|e| err.at(bat(""), e.to_string()))?,
            ),
            RawBackend::Table(t) => table(t, &bat, err)?,
        };
        if backends
            .iter()
            .any(|o: &BackendConfig| o.url == backend.url)
        {
            return Err(err.at(bat(""), format!("backend {} is listed twice", backend.url)));
        }
        backends.push(backend);
    }
    Ok(backends)
}

fn table(
    t: RawBackendTable,
    bat: &dyn Fn(&str) -> String,
    err: FileErrors<'_>,
) -> Result<BackendConfig, ConfigError> {
    if t.weight == 0 {
        return Err(err.at(
            bat(".weight"),
            "must be ≥ 1 (remove the backend, or drain it through the admin API, to stop its traffic)",
        ));
    }
    let url = parse_backend_url(&t.url).map_err(|e| err.at(bat(".url"), e.to_string()))?;
    let discover = match t.discover.as_deref() {
        None | Some("static") => {
            if t.refresh_interval_ms.is_some() {
                return Err(err.at(
                    bat(".refresh_interval_ms"),
                    "applies only with discover = \"dns\"",
                ));
            }
            Discover::Static
        }
        Some("dns") => {
            check_dns_entry(&url).map_err(|e| err.at(bat(".url"), e.to_string()))?;
            let ms = t
                .refresh_interval_ms
                .unwrap_or(DEFAULT_DNS_INTERVAL.as_millis() as u64);
            if ms < 100 {
                return Err(err.at(
                    bat(".refresh_interval_ms"),
                    "must be at least 100 (milliseconds)",
                ));
            }
            Discover::Dns {
                interval: Duration::from_millis(ms),
            }
        }
        Some(other) => {
            return Err(err.at(
                bat(".discover"),
                format!(
                    "`{other}` is not a discovery mode: use \"dns\" (re-resolve the host, one backend per address) or leave it out"
                ),
            ));
        }
    };
    if !t.kv_events && t.kv_events_port.is_some() {
        return Err(err.at(
            bat(".kv_events_port"),
            "names the event publisher of a backend with `kv_events = false`: leave one of them out",
        ));
    }
    Ok(BackendConfig {
        url,
        weight: t.weight,
        capacity: t.capacity,
        labels: t.labels,
        upstream_api_key: t.upstream_api_key.map(Secret::new),
        discover,
        kv_events_port: match t.kv_events_port {
            Some(0) => return Err(err.at(bat(".kv_events_port"), "must be a port (1-65535)")),
            p => p,
        },
        kv_events: t.kv_events,
    })
}

/// A backend: its base URL, or a table with the URL and its weight, capacity, labels, key.
pub(super) enum RawBackend {
    Url(String),
    Table(RawBackendTable),
}

impl<'de> Deserialize<'de> for RawBackend {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawBackend;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a backend base URL, or a table { url = \"...\", weight, capacity, labels, upstream_api_key, kv_events_port, kv_events }")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawBackend, E> {
                Ok(RawBackend::Url(v.to_owned()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> Result<RawBackend, A::Error> {
                // Through the table's own Deserialize: unknown keys are named.
                RawBackendTable::deserialize(serde::de::value::MapAccessDeserializer::new(m))
                    .map(RawBackend::Table)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBackendTable {
    pub(super) url: String,
    #[serde(default = "default_weight")]
    pub(super) weight: u32,
    pub(super) capacity: Option<u32>,
    #[serde(default)]
    pub(super) labels: Vec<String>,
    pub(super) upstream_api_key: Option<String>,
    pub(super) discover: Option<String>,
    pub(super) refresh_interval_ms: Option<u64>,
    pub(super) kv_events_port: Option<u16>,
    #[serde(default = "yes")]
    pub(super) kv_events: bool,
}

fn yes() -> bool {
    true
}

fn default_weight() -> u32 {
    1
}
