//! Fuzz targets for what parses untrusted bytes: the request-body view (and the body the
//! gateway sends upstream from it), the SSE scanner, the key parser and the config parser.
//! Each target checks properties, not only "no panic".
//!
//! `cargo test --test it parser_fuzz::` runs a short pass of each (256 cases). The long run documented in
//! docs/reliability.md sets the number of cases per target:
//!
//! ```sh
//! FLEETGATE_FUZZ_CASES=10000000 cargo test --release --test it parser_fuzz:: -- --nocapture
//! ```

use std::fmt;

use bytes::Bytes;
use fleetgate_gateway::config::Config;
use fleetgate_gateway::key::{self, Environment};
use fleetgate_protocol::Endpoint;
use fleetgate_protocol::event::DataKind;
use fleetgate_protocol::sse::SseScanner;
use fleetgate_protocol::view;
use proptest::prelude::*;
use proptest::test_runner::{Config as RunConfig, TestRunner};
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

fn cases() -> u32 {
    std::env::var("FLEETGATE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

/// A runner with `cases()` cases, no failure persistence files, a fixed seed in CI so a
/// failure reproduces (the long run draws a fresh seed).
fn runner() -> TestRunner {
    let cfg = RunConfig {
        cases: cases(),
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..RunConfig::default()
    };
    if std::env::var_os("FLEETGATE_FUZZ_CASES").is_some() {
        TestRunner::new(cfg)
    } else {
        TestRunner::new_with_rng(
            cfg,
            proptest::test_runner::TestRng::deterministic_rng(cfg_algo()),
        )
    }
}

fn cfg_algo() -> proptest::test_runner::RngAlgorithm {
    proptest::test_runner::RngAlgorithm::ChaCha
}

/// Print what a target ran: `cases()` cases for each of its `strategies`.
fn report(target: &str, strategies: u32, started: std::time::Instant) {
    let n = u64::from(cases()) * u64::from(strategies);
    let s = started.elapsed().as_secs_f64();
    eprintln!(
        "fuzz {target}: {n} executions ({strategies} strategies x {} cases) in {s:.1} s ({:.0}/s)",
        cases(),
        n as f64 / s.max(1e-9)
    );
}

// ---------------------------------------------------------------------------------------
// Request bodies

/// A JSON value of a type a client may put where a field is expected (right or wrong).
fn any_json_scalar() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("true".to_owned()),
        Just("false".to_owned()),
        Just("null".to_owned()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| f.to_string()),
        "\\PC{0,12}".prop_map(|s| serde_json::to_string(&s).unwrap()),
        Just("[]".to_owned()),
        Just("{}".to_owned()),
        Just("\"true\"".to_owned()),
        Just("1e400".to_owned()),
        Just("-0".to_owned()),
    ]
}

fn stream_options() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        Just(None),
        Just(Some("null".to_owned())),
        Just(Some("{}".to_owned())),
        Just(Some(r#"{"include_usage":false}"#.to_owned())),
        Just(Some(r#"{"include_usage":true}"#.to_owned())),
        Just(Some(r#"{"continuous_usage_stats":true}"#.to_owned())),
        Just(Some(
            r#"{ "include_usage" : null , "x" : [1,{"include_usage":1}] }"#.to_owned()
        )),
        any_json_scalar().prop_map(Some),
    ]
}

fn whitespace() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just(""), Just(" "), Just("\n"), Just("\t "), Just("\r\n  ")]
}

/// A request body built field by field, in any order, with any spacing: mostly well-formed,
/// often with wrong types, unknown fields and odd strings.
fn request_body() -> impl Strategy<Value = String> {
    let model = prop_oneof![
        "[a-z0-9./-]{1,24}".prop_map(|s| serde_json::to_string(&s).unwrap()),
        "\\PC{0,16}".prop_map(|s| serde_json::to_string(&s).unwrap()),
        Just(r#""qw\u0065n""#.to_owned()),
        any_json_scalar(),
    ];
    let stream = prop_oneof![
        Just(Some("true".to_owned())),
        Just(Some("false".to_owned())),
        Just(None),
        any_json_scalar().prop_map(Some),
    ];
    let max_tokens = prop_oneof![Just(None), any_json_scalar().prop_map(Some)];
    let messages = prop_oneof![
        "\\PC{0,40}".prop_map(|s| format!(
            r#"[{{"role":"user","content":{}}}]"#,
            serde_json::to_string(&s).unwrap()
        )),
        Just(r#"[{"role":"user","content":[{"type":"text","text":"hi"}]}]"#.to_owned()),
        any_json_scalar(),
    ];
    let extra = prop::collection::vec(("[a-z_]{1,10}", any_json_scalar()), 0..3);
    (
        model,
        stream,
        max_tokens,
        stream_options(),
        messages,
        extra,
        whitespace(),
        any::<u64>(),
    )
        .prop_map(
            |(model, stream, max_tokens, so, messages, extra, ws, order)| {
                let mut fields = vec![
                    format!("\"model\"{ws}:{ws}{model}"),
                    format!("\"messages\":{messages}"),
                ];
                if let Some(s) = stream {
                    fields.push(format!("\"stream\":{ws}{s}"));
                }
                if let Some(m) = max_tokens {
                    fields.push(format!("\"max_tokens\":{m}"));
                }
                if let Some(o) = so {
                    fields.push(format!("\"stream_options\"{ws}:{o}"));
                }
                for (k, v) in extra {
                    if !matches!(
                        k.as_str(),
                        "model" | "stream" | "max_tokens" | "stream_options" | "messages"
                    ) {
                        fields.push(format!("\"{k}\":{v}"));
                    }
                }
                // A deterministic shuffle from `order`.
                let n = fields.len();
                for i in (1..n).rev() {
                    let j = (order.rotate_left(i as u32) as usize) % (i + 1);
                    fields.swap(i, j);
                }
                format!("{ws}{{{ws}{}{ws}}}{ws}", fields.join(&format!(",{ws}")))
            },
        )
}

/// The keys of a JSON object in order, duplicates kept (serde_json's `Value` keeps only the
/// last of duplicate keys, which is exactly what must be caught).
struct Keys(Vec<String>);

impl<'de> serde::Deserialize<'de> for Keys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Keys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Keys, A::Error> {
                let mut keys = Vec::new();
                while let Some((k, IgnoredAny)) = m.next_entry::<String, IgnoredAny>()? {
                    keys.push(k);
                }
                Ok(Keys(keys))
            }
        }
        d.deserialize_map(V)
    }
}

/// Whatever the view accepts, the body built for upstream from it is one JSON object with
/// each key once, the pool's model name in `model`, and (when usage is injected)
/// `stream_options.include_usage: true`; everything else the client sent is unchanged.
fn check_body(text: &[u8]) -> Result<(), TestCaseError> {
    for endpoint in [Endpoint::Chat, Endpoint::Completions] {
        let Ok(v) = view::parse(text, endpoint) else {
            continue;
        };
        prop_assert!(v.model_span.end <= text.len());
        let literal: String = serde_json::from_slice(&text[v.model_span.clone()])
            .map_err(|e| TestCaseError::fail(format!("model span is not a string: {e}")))?;
        prop_assert_eq!(literal.as_str(), v.model.as_ref());
        if let Some(span) = &v.stream_options_span {
            prop_assert!(span.end <= text.len());
        }
        // (`serde_json::Value` refuses numbers past f64, such as 1e400, which the view passes
        // through untouched: then only the shape is checked.)
        let client: Option<serde_json::Value> = serde_json::from_slice(text).ok();
        if let Some(client) = &client {
            prop_assert_eq!(v.stream, client["stream"] == serde_json::Value::Bool(true));
        }
        let client_keys: Vec<String> = serde_json::from_slice::<Keys>(text)
            .map(|k| k.0)
            .map_err(|e| TestCaseError::fail(format!("the view accepted a non-object: {e}")))?;
        let body = Bytes::copy_from_slice(text);
        for (rename, inject) in [
            (None, false),
            (Some(&b"\"served/name\""[..]), false),
            (None, v.stream),
            (Some(&b"\"served/name\""[..]), v.stream),
        ] {
            let up = view::splice::upstream_body(&body, &v, rename, inject);
            let keys: Keys = serde_json::from_slice(&up).map_err(|e| {
                TestCaseError::fail(format!(
                    "upstream body is not a JSON object ({e}): {}",
                    String::from_utf8_lossy(&up)
                ))
            })?;
            // The same keys as the client's, in the same number (a client's own duplicate
            // stays its own), plus `stream_options` when injected where there was none.
            let mut want: Vec<String> = client_keys.clone();
            if inject && !want.iter().any(|k| k == "stream_options") {
                want.push("stream_options".to_owned());
            }
            let mut got = keys.0.clone();
            want.sort();
            got.sort();
            prop_assert_eq!(
                got,
                want,
                "keys changed upstream: {}",
                String::from_utf8_lossy(&up)
            );
            let Some(client) = &client else {
                continue;
            };
            let sent: serde_json::Value = serde_json::from_slice(&up).unwrap();
            let want_model = match rename {
                Some(_) => serde_json::Value::from("served/name"),
                None => client["model"].clone(),
            };
            prop_assert_eq!(&sent["model"], &want_model);
            if inject {
                prop_assert_eq!(
                    &sent["stream_options"]["include_usage"],
                    &serde_json::Value::Bool(true)
                );
            }
            for (k, val) in client.as_object().unwrap() {
                if k != "model" && !(inject && k == "stream_options") {
                    prop_assert_eq!(&sent[k], val, "field {} changed", k);
                }
            }
        }
    }
    Ok(())
}

#[test]
fn fuzz_request_body_view_and_upstream_body() {
    let started = std::time::Instant::now();
    runner()
        .run(&request_body(), |body| check_body(body.as_bytes()))
        .unwrap();
    // Raw bytes and mutations of well-formed bodies: never a panic, the same properties.
    let mutated = (request_body(), any::<usize>(), any::<u8>(), any::<bool>()).prop_map(
        |(body, at, byte, cut)| {
            let mut b = body.into_bytes();
            if b.is_empty() {
                return b;
            }
            let at = at % b.len();
            if cut {
                b.truncate(at);
            } else {
                b[at] = byte;
            }
            b
        },
    );
    runner().run(&mutated, |b| check_body(&b)).unwrap();
    runner()
        .run(&prop::collection::vec(any::<u8>(), 0..256), |b| {
            check_body(&b)
        })
        .unwrap();
    report("request body", 3, started);
}

// ---------------------------------------------------------------------------------------
// SSE

fn sse_line() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(r#"data: {"choices":[{"delta":{"role":"assistant","content":""}}]}"#.to_owned()),
        "\\PC{0,12}".prop_map(|s| format!(
            r#"data: {{"choices":[{{"delta":{{"content":{}}}}}]}}"#,
            serde_json::to_string(&s).unwrap()
        )),
        Just(
            r#"data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#.to_owned()
        ),
        Just(r#"data: {"error":{"message":"x"}}"#.to_owned()),
        Just("data: [DONE]".to_owned()),
        Just("data:[DONE]".to_owned()),
        Just(": keep-alive".to_owned()),
        Just("event: message".to_owned()),
        Just(String::new()),
        "\\PC{0,30}",
        "data: \\PC{0,30}",
    ]
}

fn sse_stream() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec((sse_line(), prop_oneof![Just("\n"), Just("\r\n")]), 0..24),
        any::<bool>(),
    )
        .prop_map(|(lines, blank)| {
            let mut out = String::new();
            for (l, nl) in lines {
                out.push_str(&l);
                out.push_str(nl);
                if blank {
                    out.push_str(nl);
                }
            }
            out.into_bytes()
        })
}

type Seen = Vec<(DataKind, Vec<u8>)>;

fn scan(chunks: &[&[u8]]) -> Result<Seen, TestCaseError> {
    let mut s = SseScanner::new();
    let mut seen = Vec::new();
    let mut bad = None;
    for c in chunks {
        s.feed(c, |line| {
            if let Some(span) = &line.event_span
                && span.end > c.len()
            {
                bad = Some(format!("event span {span:?} past a chunk of {}", c.len()));
            }
            seen.push((line.kind, line.payload.to_vec()));
        });
    }
    s.finish(|line| seen.push((line.kind, line.payload.to_vec())));
    match bad {
        Some(m) => Err(TestCaseError::fail(m)),
        None => Ok(seen),
    }
}

#[test]
fn fuzz_sse_scanner_sees_the_same_events_however_the_reads_split() {
    let started = std::time::Instant::now();
    let strategy = prop_oneof![
        3 => sse_stream(),
        1 => prop::collection::vec(any::<u8>(), 0..512),
    ]
    .prop_flat_map(|bytes| {
        let n = bytes.len();
        (Just(bytes), prop::collection::vec(0..=n, 0..8))
    });
    runner()
        .run(&strategy, |(bytes, mut cuts)| {
            let whole = scan(&[&bytes])?;
            cuts.sort_unstable();
            let mut chunks = Vec::new();
            let mut from = 0;
            for c in cuts {
                chunks.push(&bytes[from..c]);
                from = c;
            }
            chunks.push(&bytes[from..]);
            let split = scan(&chunks)?;
            prop_assert_eq!(&whole, &split);
            // Every `[DONE]` line is seen as the end.
            let dones = bytes
                .split(|b| *b == b'\n')
                .filter(|l| {
                    let l = l.strip_suffix(b"\r").unwrap_or(l);
                    l == b"data: [DONE]" || l == b"data:[DONE]"
                })
                .count();
            prop_assert_eq!(
                whole.iter().filter(|(k, _)| *k == DataKind::Done).count(),
                dones
            );
            Ok(())
        })
        .unwrap();
    report("sse scanner", 1, started);
}

// ---------------------------------------------------------------------------------------
// Keys

#[test]
fn fuzz_key_parser() {
    let started = std::time::Instant::now();
    // Anything: never a panic; what parses is well-formed.
    runner()
        .run(&"\\PC{0,80}", |s| {
            if let Ok(p) = key::parse(&s) {
                prop_assert!(s.contains(p.public_id));
            }
            Ok(())
        })
        .unwrap();
    // A real key parses; any single changed character makes it unparseable (the checksum).
    let env = prop_oneof![
        Just(Environment::Stress),
        Just(Environment::Gray),
        Just(Environment::Prod)
    ];
    runner()
        .run(&(env, any::<usize>(), any::<char>()), |(env, at, ch)| {
            let k = key::generate(env, None);
            let parsed = key::parse(&k.full).unwrap();
            prop_assert_eq!(parsed.public_id, k.public_id.as_str());
            prop_assert_eq!(key::hash_secret(parsed.secret), k.secret_hash);
            let mut chars: Vec<char> = k.full.chars().collect();
            let at = at % chars.len();
            if chars[at] != ch {
                chars[at] = ch;
                let changed: String = chars.into_iter().collect();
                prop_assert!(key::parse(&changed).is_err(), "{} parsed", changed);
            }
            Ok(())
        })
        .unwrap();
    report("key parser", 2, started);
}

// ---------------------------------------------------------------------------------------
// Config

fn config_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        Just("-1".to_owned()),
        Just("0".to_owned()),
        Just("1e309".to_owned()),
        Just("nan".to_owned()),
        Just("inf".to_owned()),
        Just("0.0001".to_owned()),
        Just("true".to_owned()),
        "\\PC{0,12}".prop_map(|s| format!("{s:?}")),
        Just("\"${UNSET_VARIABLE}\"".to_owned()),
        Just("\"${FLEETGATE_FUZZ_X:-7}\"".to_owned()),
        Just("[]".to_owned()),
        Just("{}".to_owned()),
        Just("[\"http://127.0.0.1:1\"]".to_owned()),
    ]
}

const SECTIONS_AND_KEYS: &[(&str, &[&str])] = &[
    (
        "server",
        &[
            "listen",
            "max_body_bytes",
            "shutdown_grace_seconds",
            "health_interval_ms",
            "workers",
            "max_connections",
            "header_timeout_seconds",
            "keepalive_timeout_seconds",
            "log_format",
        ],
    ),
    (
        "database",
        &["url", "sqlite_path", "max_connections", "migrate_on_start"],
    ),
    ("auth", &["negative_cache_seconds", "lookups_per_second"]),
    ("admin", &["listen", "jwt_secret", "jwt_algorithm"]),
    (
        "request_log",
        &["enabled", "flush_interval_ms", "batch_size"],
    ),
    ("limits", &["shared"]),
    (
        "queue",
        &["max_size", "max_per_key", "keepalive_interval_ms"],
    ),
];

fn config_text() -> impl Strategy<Value = String> {
    let entry = (0..SECTIONS_AND_KEYS.len(), any::<usize>(), config_value());
    (
        prop::collection::vec(entry, 0..10),
        prop::collection::vec(("[a-z_]{1,12}", config_value()), 0..2),
        prop_oneof![
            Just(String::new()),
            Just("[[pools]]\nmodel = \"m\"\nbackends = [\"http://127.0.0.1:1\"]\n".to_owned()),
            config_value().prop_map(|v| format!(
                "[[pools]]\nmodel = \"m\"\nbackends = {v}\nmax_in_flight_per_backend = {v}\n"
            )),
        ],
    )
        .prop_map(|(entries, unknown, pools)| {
            let mut out = String::new();
            let mut by_section: Vec<Vec<String>> = vec![Vec::new(); SECTIONS_AND_KEYS.len()];
            for (s, k, v) in entries {
                let keys = SECTIONS_AND_KEYS[s].1;
                by_section[s].push(format!("{} = {v}", keys[k % keys.len()]));
            }
            for (i, lines) in by_section.iter().enumerate() {
                if lines.is_empty() {
                    continue;
                }
                out.push_str(&format!("[{}]\n", SECTIONS_AND_KEYS[i].0));
                // A key given twice is a TOML error, reported like any other.
                for l in lines {
                    out.push_str(l);
                    out.push('\n');
                }
            }
            for (k, v) in unknown {
                out.push_str(&format!("[server]\n{k} = {v}\n"));
            }
            out.push_str(&pools);
            out
        })
}

fn check_config(text: &str) -> Result<(), TestCaseError> {
    let env = |name: &str| (name == "FLEETGATE_FUZZ_SET").then(|| "1".to_owned());
    if let Err(e) = Config::parse("fuzz.toml", text, env) {
        let shown = e.to_string();
        prop_assert!(
            shown.contains("fuzz.toml"),
            "error names the file: {}",
            shown
        );
        prop_assert!(!e.message.is_empty());
        prop_assert!(!e.field.is_empty());
    }
    Ok(())
}

#[test]
fn fuzz_config_parser() {
    let started = std::time::Instant::now();
    runner().run(&config_text(), |t| check_config(&t)).unwrap();
    runner().run(&"\\PC{0,200}", |t| check_config(&t)).unwrap();
    report("config parser", 2, started);
}

// ---------------------------------------------------------------------------------------
// W3C trace context

/// A `traceparent` the gateway writes reads back as what it wrote, and one byte changed in a
/// valid header either reads as another valid one or not at all: never a panic, and never a
/// header of another length or with uppercase hex taken as valid.
#[test]
fn fuzz_traceparent_round_trips_and_refuses_what_is_not_exactly_right() {
    use fleetgate_protocol::trace_context::{SpanId, TraceId, TraceParent};
    let started = std::time::Instant::now();
    let ids = (
        any::<[u8; 16]>(),
        any::<[u8; 8]>(),
        any::<[u8; 8]>(),
        any::<u8>(),
    )
        .prop_filter("W3C forbids all-zero ids", |(t, p, c, _)| {
            *t != [0; 16] && *p != [0; 8] && *c != [0; 8]
        });
    runner()
        .run(&ids, |(trace, parent, child, flags)| {
            let p = TraceParent {
                trace_id: TraceId(trace),
                parent_id: SpanId(parent),
                flags,
            };
            let header = p.child_header(SpanId(child));
            let back = TraceParent::parse(header.as_bytes()).unwrap();
            prop_assert_eq!(back.trace_id, p.trace_id);
            prop_assert_eq!(back.parent_id, SpanId(child));
            prop_assert_eq!(back.flags, flags);
            prop_assert_eq!(header.len(), 55);
            Ok(())
        })
        .unwrap();
    let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mutated = (0..valid.len(), any::<u8>(), any::<bool>()).prop_map(|(at, byte, cut)| {
        let mut b = valid.as_bytes().to_vec();
        if cut {
            b.truncate(at);
        } else {
            b[at] = byte;
        }
        b
    });
    runner()
        .run(&mutated, |b| {
            if let Some(p) = TraceParent::parse(&b) {
                prop_assert_eq!(b.len(), 55);
                prop_assert!(
                    b.iter()
                        .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c) || *c == b'-'),
                    "{:?}",
                    String::from_utf8_lossy(&b)
                );
                prop_assert!(p.trace_id != TraceId([0; 16]));
            }
            Ok(())
        })
        .unwrap();
    runner()
        .run(&prop::collection::vec(any::<u8>(), 0..128), |b| {
            let _ = TraceParent::parse(&b);
            Ok(())
        })
        .unwrap();
    report("traceparent", 3, started);
}
