//! OpenTelemetry traces: a client's trace continues through the gateway to the backend, the
//! gateway's spans reach a real OTLP receiver (decoded with the official schema) on every
//! protocol, refusals are exported with an error status, a retry is its own span, the sampler
//! decides, and a collector that is down or slow costs the requests nothing.

use std::collections::HashSet;
use std::time::Duration;

use crate::common::*;
use fleetgate_gateway::config::{PoolConfig, PoolKind};
use fleetgate_protocol::client::chat_body;
use serde_json::json;

/// The W3C recommendation's own example: trace 4bf9…4736, the client's span 00f0…02b7.
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SERVER: i32 = 2;
const CLIENT: i32 = 3;
const ERROR: i32 = 2;

/// The `traceparent` a backend got: (trace, parent span, flags).
fn sent_traceparent(head: &http::HeaderMap) -> (String, String, String) {
    let all: Vec<_> = head.get_all("traceparent").iter().collect();
    assert_eq!(all.len(), 1, "one traceparent upstream: {head:?}");
    let v = all[0].to_str().unwrap();
    let parts: Vec<&str> = v.split('-').collect();
    assert_eq!(parts.len(), 4, "{v}");
    assert_eq!(parts[0], "00");
    (parts[1].into(), parts[2].into(), parts[3].into())
}

fn one(spans: &[Received], kind: i32) -> &Received {
    let of: Vec<_> = spans.iter().filter(|s| s.kind() == kind).collect();
    assert_eq!(of.len(), 1, "one span of kind {kind}: {spans:#?}");
    of[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_trace_continues_through_the_gateway_to_the_backend() {
    let collector = OtlpReceiver::start().await;
    let backend = HeadRecorder::start(&[]).await;
    let gw = gateway_with(vec![pool("qwen", &[backend.url()])], |c| {
        c.tracing = tracing_with(
            &collector.endpoint(),
            "service_name = \"edge-gw\"\ncompression = \"gzip\"\n[headers]\nx-collector-key = \"k-1\"\n[resource_attributes]\n\"deployment.environment\" = \"prod\"\n",
        );
    })
    .await;
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[
            ("x-request-id", "trace-1"),
            ("traceparent", TRACEPARENT),
            ("tracestate", "rojo=00f067aa0ba902b7"),
        ],
        chat_body("qwen", "hi", 7, false),
    )
    .await;
    assert_eq!(m.status, 200, "{:?}", m.body);

    // The backend is in the client's trace, its parent the gateway's span for the call.
    let head = backend.heads().pop().unwrap();
    let (trace, parent, flags) = sent_traceparent(&head);
    assert_eq!(trace, TRACE);
    assert_ne!(
        parent, "00f067aa0ba902b7",
        "the gateway's span, not the client's"
    );
    assert_eq!(flags, "01");
    assert_eq!(head.get("tracestate").unwrap(), "rojo=00f067aa0ba902b7");

    let spans = collector.trace(TRACE, 2).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let server = one(&spans, SERVER);
    let client = one(&spans, CLIENT);
    assert_eq!(server.parent_hex(), "00f067aa0ba902b7", "the client's span");
    assert_eq!(client.parent_hex(), server.id_hex());
    assert_eq!(
        client.id_hex(),
        parent,
        "the backend's parent is the CLIENT span"
    );
    assert_eq!(server.span.name, "chat qwen");
    assert_eq!(client.span.name, "chat qwen");
    assert_eq!(server.str("gen_ai.operation.name"), Some("chat"));
    assert_eq!(server.str("gen_ai.request.model"), Some("qwen"));
    assert_eq!(server.str("gen_ai.response.model"), Some("qwen"));
    assert_eq!(server.int("gen_ai.request.max_tokens"), Some(7));
    assert_eq!(server.int("http.response.status_code"), Some(200));
    assert_eq!(server.str("http.route"), Some("/v1/chat/completions"));
    assert_eq!(server.str("fleetgate.request_id"), Some("trace-1"));
    assert_eq!(server.str("fleetgate.environment"), Some("stress"));
    assert_eq!(server.str("fleetgate.key_id"), Some(public_id(&gw.key)));
    assert_eq!(server.str("fleetgate.pool"), Some("qwen"));
    assert_eq!(server.int("fleetgate.retries"), Some(0));
    assert!(server.attr("fleetgate.ttft_ms").is_some());
    assert_eq!(server.attr("error.type"), None);
    assert_ne!(server.status_code(), ERROR);
    assert_eq!(client.str("server.address"), Some("127.0.0.1"));
    assert_eq!(
        client.int("server.port"),
        Some(i64::from(backend.addr.port()))
    );
    assert_eq!(client.int("http.response.status_code"), Some(200));
    // The call lies within the request.
    assert!(client.span.start_time_unix_nano >= server.span.start_time_unix_nano);
    assert!(client.span.end_time_unix_nano <= server.span.end_time_unix_nano);
    assert!(server.span.end_time_unix_nano > server.span.start_time_unix_nano);
    // The prompt is in no span.
    for s in &spans {
        assert!(!format!("{:?}", s.span).contains("\"hi\""), "{s:?}");
    }
    // The resource: the file's service name and attributes; the key never.
    assert_eq!(server.resource_str("service.name"), Some("edge-gw"));
    assert_eq!(server.resource_str("deployment.environment"), Some("prod"));
    assert!(!format!("{spans:?}").contains(&gw.key));
    // The collector got the configured header, gzip-compressed protobuf.
    let heads = collector.heads.lock().unwrap().clone();
    assert!(
        heads
            .iter()
            .all(|h| h.get("x-collector-key").unwrap() == "k-1")
    );
    assert!(
        heads
            .iter()
            .all(|h| h.get("content-encoding").unwrap() == "gzip")
    );
    // Counted once the collector has answered.
    assert!(
        eventually(Duration::from_secs(5), || metrics_text(&gw)
            .contains("fleetgate_trace_spans_exported_total 2"))
        .await,
        "{}",
        metrics_text(&gw)
    );
}

/// A pool whose model is served under `model` by `sim`, of `kind`.
fn of_kind(model: &str, sim: &fleetgate_sim::SimServer, kind: PoolKind) -> PoolConfig {
    let mut p = pool(model, &[sim.url()]);
    p.kind = kind;
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_protocol_gets_a_server_span_and_a_client_span() {
    let collector = OtlpReceiver::start().await;
    let gen_sim = sim(|a| a.served_model_name = vec!["qwen".into()]).await;
    let embed_sim = sim(|a| {
        a.runner = fleetgate_sim::Runner::Pooling;
        a.convert = fleetgate_sim::Convert::Embed;
        a.served_model_name = vec!["emb".into()];
    })
    .await;
    let asr_sim = sim(|a| a.served_model_name = vec!["asr".into()]).await;
    let gw = gateway_with(
        vec![
            of_kind("qwen", &gen_sim, PoolKind::Generate),
            of_kind("emb", &embed_sim, PoolKind::Embed),
            of_kind("asr", &asr_sim, PoolKind::Transcription),
        ],
        |c| c.tracing = tracing_to(&collector.endpoint()),
    )
    .await;
    let j = |v: serde_json::Value| bytes::Bytes::from(v.to_string());
    let (ct, ctv) = crate::audio::multipart();
    let audio = crate::audio::form(&[("model", "asr")], Some(&crate::audio::wav(300)));
    // (request id, path, extra headers, body, gen_ai.operation.name)
    type Case<'a> = (
        &'a str,
        &'a str,
        Vec<(&'a str, &'a str)>,
        bytes::Bytes,
        &'a str,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            "p-chat",
            "/v1/chat/completions",
            vec![],
            chat_body("qwen", "hello", 6, true),
            "chat",
        ),
        (
            "p-completions",
            "/v1/completions",
            vec![],
            j(json!({"model":"qwen","prompt":"hello","max_tokens":4,"stream":true})),
            "text_completion",
        ),
        (
            "p-responses",
            "/v1/responses",
            vec![],
            j(json!({"model":"qwen","input":"hello","max_output_tokens":5,"stream":true})),
            "chat",
        ),
        (
            "p-messages",
            "/v1/messages",
            vec![],
            j(
                json!({"model":"qwen","max_tokens":3,"messages":[{"role":"user","content":"hello"}]}),
            ),
            "chat",
        ),
        (
            "p-tokenize",
            "/tokenize",
            vec![],
            j(json!({"model":"qwen","prompt":"hello"})),
            "tokenize",
        ),
        (
            "p-embeddings",
            "/v1/embeddings",
            vec![],
            j(json!({"model":"emb","input":["a","b"]})),
            "embeddings",
        ),
        (
            "p-audio",
            "/v1/audio/transcriptions",
            vec![(ct, ctv.as_str())],
            bytes::Bytes::from(audio),
            "transcriptions",
        ),
    ];
    for (id, path, extra, body, op) in cases {
        let mut hdrs = vec![("x-request-id", id)];
        hdrs.extend(extra);
        let m = post(&gw.url(path), &hdrs, body).await;
        assert_eq!(m.status, 200, "{path}: {:?}", m.body);
        let spans = collector.request(id, 2).await;
        assert_eq!(spans.len(), 2, "{path}: {spans:#?}");
        let server = one(&spans, SERVER);
        let client = one(&spans, CLIENT);
        assert_eq!(client.parent_hex(), server.id_hex(), "{path}");
        assert_eq!(server.parent_hex(), "", "{path}: a new trace has no parent");
        assert_eq!(server.str("gen_ai.operation.name"), Some(op), "{path}");
        assert_eq!(server.str("http.route"), Some(path), "{path}");
        assert_eq!(server.int("http.response.status_code"), Some(200), "{path}");
        assert_eq!(client.int("http.response.status_code"), Some(200), "{path}");
        let model = server.str("gen_ai.request.model").unwrap();
        assert_eq!(server.span.name, format!("{op} {model}"), "{path}");
        // Why the answer ended, in the protocol's own words, as the client read it.
        let body = String::from_utf8_lossy(m.body.as_deref().unwrap_or_default()).into_owned();
        let said = server.strs("gen_ai.response.finish_reasons");
        match path {
            "/v1/chat/completions" | "/v1/completions" | "/v1/messages" | "/v1/responses" => {
                assert_eq!(said.len(), 1, "{path}: {server:#?}");
                let key = match path {
                    "/v1/messages" => "\"stop_reason\":\"",
                    // (An answer cut at its limit says why, else its status.)
                    "/v1/responses" if said[0] == "max_output_tokens" => "\"reason\":\"",
                    "/v1/responses" => "\"status\":\"",
                    _ => "\"finish_reason\":\"",
                };
                assert!(
                    body.contains(&format!("{key}{}\"", said[0])),
                    "{path}: {said:?} not in {body}"
                );
            }
            _ => assert!(said.is_empty(), "{path}: {said:?}"),
        }
        if op != "tokenize" {
            assert!(
                server.int("gen_ai.usage.input_tokens").unwrap_or(0) > 0
                    || path == "/v1/audio/transcriptions",
                "{path}: {server:#?}"
            );
        }
    }
    // A stream's usage and its first token: on the SERVER span (to the client) and the
    // CLIENT span (from the backend).
    let spans = collector.request("p-chat", 2).await;
    let server = one(&spans, SERVER);
    let client = one(&spans, CLIENT);
    assert_eq!(server.int("gen_ai.usage.output_tokens"), Some(6));
    assert!(server.attr("fleetgate.hop_us").is_some(), "{server:#?}");
    assert!(server.attr("fleetgate.stream").is_some());
    for s in [server, client] {
        let first: Vec<_> = s
            .span
            .events
            .iter()
            .filter(|e| e.name == "first_token")
            .collect();
        assert_eq!(first.len(), 1, "{s:#?}");
        assert!(first[0].time_unix_nano >= s.span.start_time_unix_nano);
    }
    assert!(
        one(&spans, CLIENT).span.events[0].time_unix_nano
            <= one(&spans, SERVER).span.events[0].time_unix_nano,
        "the backend's first token comes before the client's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_are_exported_with_an_error_status() {
    let collector = OtlpReceiver::start().await;
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.tracing = tracing_to(&collector.endpoint());
    })
    .await;
    let chat = gw.url("/v1/chat/completions");
    let bad_key = post(
        &chat,
        &[
            ("x-request-id", "r-401"),
            ("authorization", "Bearer fg-stress-nope-nope"),
            ("traceparent", TRACEPARENT),
        ],
        chat_body("qwen32b", "hi", 4, false),
    )
    .await;
    assert_eq!(bad_key.status, 401);
    let no_model = post(
        &chat,
        &[("x-request-id", "r-404")],
        chat_body("nope", "hi", 4, false),
    )
    .await;
    assert_eq!(no_model.status, 404);
    // A key over its requests per minute: 429.
    let (limited, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.requests_per_minute = Some(1)
    })
    .await;
    let auth = format!("Bearer {limited}");
    for (id, status) in [("r-ok", 200), ("r-429", 429)] {
        let m = post(
            &chat,
            &[("x-request-id", id), ("authorization", &auth)],
            chat_body("qwen32b", "hi", 4, false),
        )
        .await;
        assert_eq!(m.status, status, "{id}");
    }
    for (id, status) in [("r-401", 401), ("r-404", 404), ("r-429", 429)] {
        let spans = collector.request(id, 1).await;
        assert_eq!(spans.len(), 1, "{id}: no backend was called: {spans:#?}");
        let server = one(&spans, SERVER);
        let seen = gw.record_of(id).await;
        assert_eq!(server.status_code(), ERROR, "{id}");
        assert_eq!(server.str("error.type"), seen.error, "{id}");
        assert_eq!(
            server.span.status.as_ref().unwrap().message,
            seen.error.unwrap(),
            "{id}"
        );
        assert_eq!(
            server.int("http.response.status_code"),
            Some(status),
            "{id}"
        );
    }
    // The refused request stayed in the client's trace.
    assert_eq!(collector.trace(TRACE, 1).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_on_another_backend_is_its_own_client_span() {
    let collector = OtlpReceiver::start().await;
    let live = sim(|_| {}).await;
    let doomed = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[doomed.url(), live.url()])], |c| {
        c.tracing = tracing_to(&collector.endpoint());
        c.server.health_interval = Duration::from_secs(3600);
    })
    .await;
    assert!(all_backends_healthy(&gw, "qwen32b").await);
    let doomed_port = doomed.addr().port();
    doomed.shutdown().await;
    // Requests until one was sent to the dead backend first and retried.
    let mut retried = None;
    for i in 0..20 {
        let id = format!("retry-{i}");
        let m = post(
            &gw.url("/v1/chat/completions"),
            &[("x-request-id", &id)],
            chat_body("qwen32b", "hi", 2, true),
        )
        .await;
        assert_eq!(m.status, 200, "{:?}", m.body);
        if gw.record_of(&id).await.retries == 1 {
            retried = Some(id);
            break;
        }
    }
    let id = retried.expect("one request was retried");
    let spans = collector.request(&id, 3).await;
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let server = one(&spans, SERVER);
    assert_eq!(server.int("fleetgate.retries"), Some(1));
    assert_ne!(server.status_code(), ERROR, "the request succeeded");
    let mut calls: Vec<_> = spans.iter().filter(|s| s.kind() == CLIENT).collect();
    calls.sort_by_key(|s| s.int("fleetgate.attempt"));
    assert_eq!(calls[0].int("server.port"), Some(i64::from(doomed_port)));
    assert_eq!(calls[0].str("error.type"), Some("backend_unreachable"));
    assert_eq!(calls[0].status_code(), ERROR);
    assert_eq!(
        calls[1].int("server.port"),
        Some(i64::from(live.addr().port()))
    );
    assert_eq!(calls[1].attr("error.type"), None);
    assert!(calls[0].span.end_time_unix_nano <= calls[1].span.start_time_unix_nano);
    for c in &calls {
        assert_eq!(c.parent_hex(), server.id_hex());
    }
    assert_ne!(calls[0].id_hex(), calls[1].id_hex());
}

/// A stream resumed on another backend (`[pools.resume]`) has both upstream attempts in its
/// trace: the part cut mid-answer, ended with its error, then the continuation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_stream_has_both_attempts_in_its_trace() {
    let collector = OtlpReceiver::start().await;
    let cutting = || async {
        sim(|a| {
            a.zero_delay = true;
            a.drop_after_chunks = Some(4);
        })
        .await
    };
    let (a, b) = (cutting().await, cutting().await);
    let gw = gateway_with(vec![pool("qwen32b", &[a.url(), b.url()])], |c| {
        c.tracing = tracing_to(&collector.endpoint());
    })
    .await;
    // 6 tokens, cut after 4: the continuation's 2 are its last, which the sim never cuts.
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", "resumed-trace")],
        chat_body("qwen32b", "hi", 6, true),
    )
    .await;
    assert!(m.metrics.done && !m.metrics.error, "{:?}", m.body);
    assert_eq!(m.metrics.content_events, 6);
    let spans = collector.request("resumed-trace", 3).await;
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let server = one(&spans, SERVER);
    assert_ne!(server.status_code(), ERROR, "the answer was whole");
    let mut calls: Vec<_> = spans.iter().filter(|s| s.kind() == CLIENT).collect();
    calls.sort_by_key(|s| s.int("fleetgate.attempt"));
    assert_eq!(calls[0].str("error.type"), Some("upstream_stream_error"));
    assert_eq!(calls[1].attr("error.type"), None);
    assert_ne!(
        calls[0].int("server.port"),
        calls[1].int("server.port"),
        "the continuation went to the other backend"
    );
    for c in &calls {
        assert_eq!(c.parent_hex(), server.id_hex());
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sampler_decides_and_a_malformed_traceparent_starts_a_new_trace() {
    let collector = OtlpReceiver::start().await;
    let backend = HeadRecorder::start(&[]).await;
    // The default sampler: the parent's decision, else sampled.
    let gw = gateway_with(vec![pool("qwen", &[backend.url()])], |c| {
        c.tracing = tracing_to(&collector.endpoint());
    })
    .await;
    let chat = gw.url("/v1/chat/completions");
    let send = |hdrs: Vec<(&'static str, &'static str)>| {
        let chat = chat.clone();
        async move {
            let m = post(&chat, &hdrs, chat_body("qwen", "hi", 2, false)).await;
            assert_eq!(m.status, 200, "{hdrs:?}");
        }
    };
    // The client decided not to record: the backend is told so, in the same trace.
    send(vec![(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
    )])
    .await;
    let (trace, _, flags) = sent_traceparent(&backend.heads().pop().unwrap());
    assert_eq!((trace.as_str(), flags.as_str()), (TRACE, "00"));
    // A malformed traceparent (uppercase hex) is ignored: a new trace, sampled.
    send(vec![(
        "traceparent",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
    )])
    .await;
    let (fresh, _, flags) = sent_traceparent(&backend.heads().pop().unwrap());
    assert_ne!(fresh, TRACE);
    assert_eq!(flags, "01");
    let spans = collector.trace(&fresh, 2).await;
    assert_eq!(spans.len(), 2);
    assert_eq!(one(&spans, SERVER).parent_hex(), "");
    // Exported in order: the unsampled request, sent first, has left no span.
    assert!(collector.of_trace(TRACE).is_empty());

    // A ratio sampler: what the backend is told and what is exported agree, request by
    // request.
    let ratio = gateway_with(vec![pool("qwen", &[backend.url()])], |c| {
        c.tracing = tracing_with(
            &collector.endpoint(),
            "sampler = \"traceidratio\"\nsampler_arg = 0.5\n",
        );
    })
    .await;
    let before = backend.heads().len();
    for _ in 0..30 {
        let m = post(
            &ratio.url("/v1/chat/completions"),
            &[],
            chat_body("qwen", "hi", 2, false),
        )
        .await;
        assert_eq!(m.status, 200);
    }
    let told: Vec<_> = backend.heads()[before..]
        .iter()
        .map(sent_traceparent)
        .collect();
    let sampled: HashSet<String> = told
        .iter()
        .filter(|(_, _, f)| f == "01")
        .map(|(t, _, _)| t.clone())
        .collect();
    assert!(!sampled.is_empty() && sampled.len() < 30, "{told:?}");
    // Every sampled request's spans arrive; no unsampled request's ever do (they are never
    // queued: checked after the last sampled one has arrived, with the exporter in order).
    for t in &sampled {
        assert_eq!(collector.trace(t, 2).await.len(), 2, "{t}");
    }
    for (t, _, _) in told.iter().filter(|(_, _, f)| f == "00") {
        assert!(collector.of_trace(t).is_empty(), "{t} was not sampled");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_or_slow_costs_the_requests_nothing() {
    let sim = sim(|_| {}).await;
    // Nothing listens: every export fails.
    let down = closed_port().await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.tracing = tracing_to(&format!("http://{down}"));
    })
    .await;
    for i in 0..10 {
        let m = post(
            &gw.url("/v1/chat/completions"),
            &[("x-request-id", &format!("down-{i}"))],
            chat_body("qwen32b", "hi", 2, true),
        )
        .await;
        assert_eq!(m.status, 200);
    }
    assert!(
        eventually(Duration::from_secs(10), || metrics_text(&gw)
            .lines()
            .any(|l| l.starts_with(
                "fleetgate_trace_spans_dropped_total{reason=\"export_failed\"}"
            ) && !l.ends_with(" 0")))
        .await,
        "{}",
        metrics_text(&gw)
    );

    // A collector that takes 5 s to answer, and a queue of 2: spans beyond it are dropped,
    // counted, and the requests never wait.
    let slow = OtlpReceiver::answering(200, Duration::from_secs(5)).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.tracing = tracing_with(
            &slow.endpoint(),
            "max_queue_size = 2\nmax_export_batch_size = 1\n",
        );
    })
    .await;
    for i in 0..20 {
        let m = post(
            &gw.url("/v1/chat/completions"),
            &[("x-request-id", &format!("slow-{i}"))],
            chat_body("qwen32b", "hi", 2, true),
        )
        .await;
        assert_eq!(m.status, 200);
    }
    let text = metrics_text(&gw);
    let full = text
        .lines()
        .find(|l| l.starts_with("fleetgate_trace_spans_dropped_total{reason=\"queue_full\"}"))
        .unwrap_or_else(|| panic!("{text}"));
    let dropped: u64 = full.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(
        dropped >= 20,
        "{full}: 20 requests, 2 spans each, a queue of 2"
    );
    assert_eq!(
        gw.records.lock().unwrap().len(),
        20,
        "every request recorded"
    );
}
