//! `[tracing]`: OpenTelemetry trace export over OTLP, and the standard `OTEL_*` environment
//! variables that shape it as every OpenTelemetry SDK reads them.
//!
//! Export is on when a traces endpoint is named, in the file or the environment. Each setting
//! is read from the environment first, then the file, then its default: the environment is
//! the operator's override of a shipped file, as the OpenTelemetry specification intends it.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, FileErrors};
use crate::secret::Secret;

/// Where and how spans are exported; `export: None` is tracing off.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TracingConfig {
    pub export: Option<OtlpExport>,
}

impl TracingConfig {
    /// The settings of a `[tracing]` section's text (`endpoint = "..."`, without the header)
    /// with `env` as the environment: for tests and tools that set tracing up alone.
    pub fn parse(
        section: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<TracingConfig, ConfigError> {
        let err = FileErrors {
            file: "[tracing]",
            dir: None,
        };
        let raw: RawTracing =
            toml::from_str(section).map_err(|e| err.at("tracing", e.to_string()))?;
        validate(raw, &env, err)
    }
}

/// OTLP over HTTP/protobuf to one collector.
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpExport {
    /// The full traces URL (`…/v1/traces`).
    pub endpoint: String,
    /// Headers on every export (a vendor's API key, say) from the file;
    /// `OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_EXPORTER_OTLP_TRACES_HEADERS` are added over them
    /// by the exporter, per header.
    pub(crate) headers: Vec<(String, Secret)>,
    /// One export request's limit.
    pub(crate) timeout: Duration,
    pub(crate) gzip: bool,
    /// `service.name` of the resource: the file's (or `fleetgate`).
    pub service_name: String,
    /// `OTEL_SERVICE_NAME`, which wins over every other source of `service.name`.
    pub service_name_env: Option<String>,
    /// The file's resource attributes (`OTEL_RESOURCE_ATTRIBUTES` is read over them).
    pub(crate) resource: Vec<(String, String)>,
    pub sampler: SamplerChoice,
    /// Requests waiting for export; beyond, their spans are dropped and counted.
    pub(crate) max_queue_size: usize,
    pub(crate) max_export_batch_size: usize,
    pub(crate) schedule_delay: Duration,
    /// One batch's limit, retries included.
    pub(crate) export_timeout: Duration,
}

/// The samplers of `OTEL_TRACES_SAMPLER` that need nothing outside the process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SamplerChoice {
    AlwaysOn,
    AlwaysOff,
    TraceIdRatio(f64),
    ParentBasedAlwaysOn,
    ParentBasedAlwaysOff,
    ParentBasedTraceIdRatio(f64),
}

const SAMPLERS: &str = "always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTracing {
    /// The collector's base URL (`/v1/traces` is added), as `OTEL_EXPORTER_OTLP_ENDPOINT`.
    endpoint: Option<String>,
    /// The full traces URL, as `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`.
    traces_endpoint: Option<String>,
    protocol: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    timeout_ms: Option<u64>,
    compression: Option<String>,
    service_name: Option<String>,
    #[serde(default)]
    resource_attributes: BTreeMap<String, String>,
    sampler: Option<String>,
    sampler_arg: Option<f64>,
    max_queue_size: Option<usize>,
    max_export_batch_size: Option<usize>,
    schedule_delay_ms: Option<u64>,
    export_timeout_ms: Option<u64>,
}

/// One setting: the environment's value (with the variable's name, for errors) or the file's.
struct Source<'a> {
    env: &'a dyn Fn(&str) -> Option<String>,
    err: FileErrors<'a>,
}

impl Source<'_> {
    /// The first of `vars` that is set and not empty.
    fn var(&self, vars: &[&'static str]) -> Option<(&'static str, String)> {
        vars.iter().find_map(|v| {
            (self.env)(v)
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .map(|s| (*v, s))
        })
    }

    fn env_error(&self, var: &str, message: impl Into<String>) -> ConfigError {
        self.err.at(format!("{var} (environment)"), message)
    }

    /// Milliseconds from the environment, else the file's, else `default`.
    fn millis(
        &self,
        vars: &[&'static str],
        file: Option<u64>,
        field: &str,
        default: u64,
    ) -> Result<Duration, ConfigError> {
        let ms = match self.var(vars) {
            Some((var, v)) => v.parse::<u64>().map_err(|_| {
                self.env_error(var, format!("`{v}` is not a number of milliseconds"))
            })?,
            None => file.unwrap_or(default),
        };
        if ms == 0 {
            return Err(self.err.at(field, "must be at least 1 ms"));
        }
        Ok(Duration::from_millis(ms))
    }

    fn count(
        &self,
        var: &'static str,
        file: Option<usize>,
        field: &str,
        default: usize,
    ) -> Result<usize, ConfigError> {
        let n = match self.var(&[var]) {
            Some((var, v)) => v
                .parse::<usize>()
                .map_err(|_| self.env_error(var, format!("`{v}` is not a count")))?,
            None => file.unwrap_or(default),
        };
        if n == 0 {
            return Err(self.err.at(field, "must be at least 1"));
        }
        Ok(n)
    }
}

pub(super) fn validate(
    raw: RawTracing,
    env: &dyn Fn(&str) -> Option<String>,
    err: FileErrors<'_>,
) -> Result<TracingConfig, ConfigError> {
    let src = Source { env, err };
    if let Some((_, v)) = src.var(&["OTEL_SDK_DISABLED"])
        && v.eq_ignore_ascii_case("true")
    {
        return Ok(TracingConfig::default());
    }
    match src.var(&["OTEL_TRACES_EXPORTER"]) {
        Some((_, v)) if v == "none" => return Ok(TracingConfig::default()),
        Some((_, v)) if v == "otlp" => {}
        Some((var, v)) => {
            return Err(src.env_error(
                var,
                format!("`{v}` is not an exporter fleetgate has: `otlp` exports spans over OTLP, `none` exports nothing"),
            ));
        }
        None => {}
    }
    let endpoint = match src.var(&["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]) {
        Some((var, v)) => check_url(&src, &v, Some(var), "tracing.traces_endpoint")?,
        None => match src.var(&["OTEL_EXPORTER_OTLP_ENDPOINT"]) {
            Some((var, v)) => traces_path(&check_url(&src, &v, Some(var), "tracing.endpoint")?),
            None => match (&raw.traces_endpoint, &raw.endpoint) {
                (Some(t), _) => check_url(&src, t, None, "tracing.traces_endpoint")?,
                (None, Some(e)) => traces_path(&check_url(&src, e, None, "tracing.endpoint")?),
                // No collector named: tracing is off.
                (None, None) => return Ok(TracingConfig::default()),
            },
        },
    };
    let protocol = match src.var(&[
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ]) {
        Some((var, v)) => Some((format!("{var} (environment)"), v)),
        None => raw
            .protocol
            .clone()
            .map(|p| ("tracing.protocol".to_owned(), p)),
    };
    if let Some((field, p)) = protocol
        && p != "http/protobuf"
    {
        let why = match p.as_str() {
            "grpc" => {
                "fleetgate exports OTLP over HTTP only: set `http/protobuf`, and the collector's OTLP/HTTP port (4318 on the OpenTelemetry Collector) in the endpoint"
            }
            "http/json" => {
                "fleetgate exports OTLP/HTTP in protobuf, which every collector reads: set `http/protobuf`"
            }
            _ => {
                "the OTLP protocols are `http/protobuf`, `http/json` and `grpc`; fleetgate exports `http/protobuf`"
            }
        };
        return Err(err.at(field, format!("`{p}`: {why}")));
    }
    let compression = match src.var(&[
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
        "OTEL_EXPORTER_OTLP_COMPRESSION",
    ]) {
        Some((var, v)) => Some((format!("{var} (environment)"), v)),
        None => raw
            .compression
            .clone()
            .map(|c| ("tracing.compression".to_owned(), c)),
    };
    let gzip = match compression {
        None => false,
        Some((_, c)) if c == "none" => false,
        Some((_, c)) if c == "gzip" => true,
        Some((field, c)) => {
            return Err(err.at(field, format!("`{c}`: use `gzip` or `none`")));
        }
    };
    let sampler = sampler(&src, &raw)?;
    let mut headers = Vec::with_capacity(raw.headers.len());
    for (name, value) in raw.headers {
        if http::HeaderName::from_bytes(name.as_bytes()).is_err()
            || http::HeaderValue::from_str(&value).is_err()
        {
            return Err(err.at(
                format!("tracing.headers.{name}"),
                "not a valid HTTP header name and value",
            ));
        }
        headers.push((name, Secret::new(value)));
    }
    let max_queue_size = src.count(
        "OTEL_BSP_MAX_QUEUE_SIZE",
        raw.max_queue_size,
        "tracing.max_queue_size",
        2048,
    )?;
    let max_export_batch_size = src.count(
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
        raw.max_export_batch_size,
        "tracing.max_export_batch_size",
        512,
    )?;
    if max_export_batch_size > max_queue_size {
        return Err(err.at(
            "tracing.max_export_batch_size",
            format!("{max_export_batch_size} is more than the queue holds ({max_queue_size}): a batch is taken from the queue"),
        ));
    }
    Ok(TracingConfig {
        export: Some(OtlpExport {
            endpoint,
            headers,
            timeout: src.millis(
                &[
                    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
                    "OTEL_EXPORTER_OTLP_TIMEOUT",
                ],
                raw.timeout_ms,
                "tracing.timeout_ms",
                10_000,
            )?,
            gzip,
            service_name: raw.service_name.unwrap_or_else(|| "fleetgate".to_owned()),
            service_name_env: src.var(&["OTEL_SERVICE_NAME"]).map(|(_, v)| v),
            resource: raw.resource_attributes.into_iter().collect(),
            sampler,
            max_queue_size,
            max_export_batch_size,
            schedule_delay: src.millis(
                &["OTEL_BSP_SCHEDULE_DELAY"],
                raw.schedule_delay_ms,
                "tracing.schedule_delay_ms",
                5_000,
            )?,
            export_timeout: src.millis(
                &["OTEL_BSP_EXPORT_TIMEOUT"],
                raw.export_timeout_ms,
                "tracing.export_timeout_ms",
                30_000,
            )?,
        }),
    })
}

/// An `http://` or `https://` URL with a host.
fn check_url(
    src: &Source<'_>,
    url: &str,
    var: Option<&str>,
    field: &str,
) -> Result<String, ConfigError> {
    let ok = url
        .parse::<http::Uri>()
        .ok()
        .filter(|u| matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some());
    if ok.is_some() {
        return Ok(url.to_owned());
    }
    let message = format!(
        "`{url}` is not an http:// or https:// URL of a collector, e.g. http://otel-collector:4318"
    );
    Err(match var {
        Some(var) => src.env_error(var, message),
        None => src.err.at(field, message),
    })
}

/// `OTEL_EXPORTER_OTLP_ENDPOINT`'s rule: the signal's path is added to the base URL.
fn traces_path(base: &str) -> String {
    format!("{}/v1/traces", base.trim_end_matches('/'))
}

fn sampler(src: &Source<'_>, raw: &RawTracing) -> Result<SamplerChoice, ConfigError> {
    let (name, field) = match src.var(&["OTEL_TRACES_SAMPLER"]) {
        Some((var, v)) => (v, format!("{var} (environment)")),
        None => match &raw.sampler {
            Some(s) => (s.clone(), "tracing.sampler".to_owned()),
            None => return Ok(SamplerChoice::ParentBasedAlwaysOn),
        },
    };
    let ratio = || -> Result<f64, ConfigError> {
        let (arg, arg_field) = match src.var(&["OTEL_TRACES_SAMPLER_ARG"]) {
            Some((var, v)) => {
                let r = v.parse::<f64>().map_err(|_| {
                    src.env_error(var, format!("`{v}` is not a ratio between 0 and 1"))
                })?;
                (Some(r), format!("{var} (environment)"))
            }
            None => (raw.sampler_arg, "tracing.sampler_arg".to_owned()),
        };
        match arg {
            None => Ok(1.0),
            Some(r) if (0.0..=1.0).contains(&r) => Ok(r),
            Some(r) => Err(src.err.at(
                arg_field,
                format!("{r} is not a ratio between 0 and 1 (0.1 samples one trace in ten)"),
            )),
        }
    };
    Ok(match name.as_str() {
        "always_on" => SamplerChoice::AlwaysOn,
        "always_off" => SamplerChoice::AlwaysOff,
        "traceidratio" => SamplerChoice::TraceIdRatio(ratio()?),
        "parentbased_always_on" => SamplerChoice::ParentBasedAlwaysOn,
        "parentbased_always_off" => SamplerChoice::ParentBasedAlwaysOff,
        "parentbased_traceidratio" => SamplerChoice::ParentBasedTraceIdRatio(ratio()?),
        other => {
            return Err(src.err.at(
                field,
                format!("`{other}` is not a sampler fleetgate has: {SAMPLERS}"),
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(file: &str, env: &[(&str, &str)]) -> Result<TracingConfig, ConfigError> {
        let raw: RawTracing = toml::from_str(file).map_err(|e| ConfigError {
            file: "t".into(),
            field: "-".into(),
            message: e.to_string(),
        })?;
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let lookup = move |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        validate(
            raw,
            &lookup,
            FileErrors {
                file: "t",
                dir: None,
            },
        )
    }

    fn export(file: &str, env: &[(&str, &str)]) -> OtlpExport {
        match resolve(file, env) {
            Ok(TracingConfig { export: Some(e) }) => e,
            other => panic!("expected export on, got {other:?}"),
        }
    }

    #[test]
    fn off_until_a_collector_is_named() {
        assert_eq!(resolve("", &[]).ok(), Some(TracingConfig::default()));
        let e = export(r#"endpoint = "http://c:4318/""#, &[]);
        assert_eq!(e.endpoint, "http://c:4318/v1/traces");
        assert_eq!(e.sampler, SamplerChoice::ParentBasedAlwaysOn);
        assert_eq!(e.max_queue_size, 2048);
        assert_eq!(e.schedule_delay, Duration::from_millis(5000));
        let e = export("", &[("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c")]);
        assert_eq!(e.endpoint, "https://c/v1/traces");
    }

    #[test]
    fn the_environment_wins_over_the_file() {
        let file = r#"
            traces_endpoint = "http://file:4318/v1/traces"
            sampler = "always_off"
            service_name = "gw"
            schedule_delay_ms = 100
        "#;
        let e = export(
            file,
            &[
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "http://env:4318/custom",
                ),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://ignored:4318"),
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
                ("OTEL_SERVICE_NAME", "edge"),
            ],
        );
        assert_eq!(e.endpoint, "http://env:4318/custom");
        assert_eq!(e.sampler, SamplerChoice::ParentBasedTraceIdRatio(0.25));
        assert_eq!(e.service_name, "gw");
        assert_eq!(e.service_name_env.as_deref(), Some("edge"));
        assert_eq!(e.schedule_delay, Duration::from_millis(100));
        // The SDK switches turn a configured file off.
        for off in [
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ] {
            assert_eq!(resolve(file, &[off]).ok(), Some(TracingConfig::default()));
        }
    }

    #[test]
    fn every_mistake_names_its_setting() {
        // (file, environment, the field named, what the message says)
        type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str, &'a str);
        let cases: &[Case<'_>] = &[
            (r#"endpoint = "c:4318""#, &[], "tracing.endpoint", "http://"),
            (
                "",
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector")],
                "OTEL_EXPORTER_OTLP_ENDPOINT (environment)",
                "not an http://",
            ),
            (
                r#"endpoint = "http://c""#,
                &[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")],
                "OTEL_EXPORTER_OTLP_PROTOCOL (environment)",
                "4318",
            ),
            (
                "endpoint = \"http://c\"\nsampler = \"ratio\"",
                &[],
                "tracing.sampler",
                "parentbased_traceidratio",
            ),
            (
                "endpoint = \"http://c\"\nsampler = \"traceidratio\"\nsampler_arg = 2.0",
                &[],
                "tracing.sampler_arg",
                "between 0 and 1",
            ),
            (
                r#"endpoint = "http://c""#,
                &[("OTEL_TRACES_EXPORTER", "zipkin")],
                "OTEL_TRACES_EXPORTER (environment)",
                "`otlp`",
            ),
            (
                r#"endpoint = "http://c""#,
                &[("OTEL_BSP_SCHEDULE_DELAY", "5s")],
                "OTEL_BSP_SCHEDULE_DELAY (environment)",
                "milliseconds",
            ),
            (
                "endpoint = \"http://c\"\nmax_queue_size = 10\nmax_export_batch_size = 20",
                &[],
                "tracing.max_export_batch_size",
                "queue",
            ),
            (
                "endpoint = \"http://c\"\ncompression = \"zstd\"",
                &[],
                "tracing.compression",
                "gzip",
            ),
        ];
        for (file, env, field, says) in cases {
            match resolve(file, env) {
                Err(e) => {
                    assert_eq!(e.field, *field, "{file} {env:?}");
                    assert!(e.message.contains(says), "{}", e.message);
                }
                Ok(c) => panic!("{file} {env:?} accepted: {c:?}"),
            }
        }
    }
}
