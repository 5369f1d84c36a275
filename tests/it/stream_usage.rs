//! Usage on streams: learned from every stream whatever the client asked, reaching the client
//! only as it asked, a null `stream_options`, and the `system_fingerprint` of a removed usage
//! chunk kept.

use std::time::Duration;

use crate::common::*;
use crate::relay::stream_body;
use bytes::Bytes;
use http_body_util::BodyExt;

/// `"stream_options": null` on a stream: the backend gets one `stream_options` (with the usage
/// the gateway needs), the client a stream without the usage event it did not ask for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_null_stream_options_gets_usage_without_a_duplicate_key() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let body = serde_json::json!({"model":"qwen32b","stream":true,"stream_options":null,
        "max_tokens":5,"messages":[{"role":"user","content":"hi"}]});
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", "null-opts")],
        body.to_string(),
    )
    .await;
    let text = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
    assert_eq!(m.status, 200, "{text}");
    assert!(m.metrics.done, "{text}");
    assert!(
        !text.contains("\"usage\""),
        "usage the client did not ask for: {text}"
    );
    let rec = gw.record_of("null-opts").await;
    assert_eq!(
        rec.timeline.stream().usage.map(|u| u.completion_tokens),
        Some(5)
    );
}

/// Usage reaches a client exactly as it asked, as vLLM 0.32 answers it: the
/// gateway asks the backend for `include_usage` to count tokens and removes that usage chunk,
/// but `continuous_usage_stats` alone (which gets no usage from vLLM) must not turn into usage
/// on every chunk; with both, every chunk keeps its usage and the final chunk stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_usage_reaches_the_client_as_asked() {
    let sim = sim(|a| a.zero_delay = true).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let url = gw.url("/v1/chat/completions");
    let stream = |options: serde_json::Value| {
        let mut body = serde_json::json!({"model":"qwen32b","stream":true,"max_tokens":4,
            "messages":[{"role":"user","content":"hi"}]});
        if !options.is_null() {
            body["stream_options"] = options;
        }
        Bytes::from(body.to_string())
    };
    let with_usage = |m: &fleetgate_protocol::client::Measured| {
        String::from_utf8_lossy(m.body.as_ref().unwrap())
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|p| p.contains("\"usage\""))
            .count()
    };
    for (options, chunks_with_usage) in [
        (serde_json::Value::Null, 0),
        (serde_json::json!({"continuous_usage_stats": true}), 0),
        (serde_json::json!({"include_usage": true}), 1),
        // The role chunk, four tokens, and the final usage chunk.
        (
            serde_json::json!({"include_usage": true, "continuous_usage_stats": true}),
            6,
        ),
    ] {
        let m = post(&url, &[], stream(options.clone())).await;
        assert_eq!(m.status, 200);
        assert_eq!(with_usage(&m), chunks_with_usage, "{options}");
        // Directly, the backend answers the same.
        let direct = post(
            &format!("{}/v1/chat/completions", sim.url())
                .parse()
                .unwrap(),
            &[("x-no-auth", "1")],
            stream(options.clone()),
        )
        .await;
        assert_eq!(with_usage(&direct), chunks_with_usage, "direct, {options}");
    }
}

/// A vLLM-like backend whose streams are written as `writes`, `gap` apart: the finish chunk and
/// the usage chunk in one write or in two.
async fn scripted_stream_backend(
    writes: &'static [&'static str],
    gap: Duration,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    http_backend(move |req| async move {
        let (content_type, body) = if req.uri().path() == "/v1/chat/completions" {
            let frames = futures_util::stream::unfold(0, move |i| async move {
                let text = writes.get(i)?;
                if i > 0 {
                    tokio::time::sleep(gap).await;
                }
                let frame = hyper::body::Frame::data(Bytes::from_static(text.as_bytes()));
                Some((Ok::<_, std::convert::Infallible>(frame), i + 1))
            });
            (
                "text/event-stream",
                http_body_util::StreamBody::new(frames).boxed(),
            )
        } else {
            let models = r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#;
            (
                "application/json",
                http_body_util::Full::new(Bytes::from_static(models.as_bytes())).boxed(),
            )
        };
        http::Response::builder()
            .header("content-type", content_type)
            .body(body)
            .unwrap()
    })
    .await
}

const ROLE: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n";
const TOKEN: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" a\"},\"finish_reason\":null}]}\n\n";
const FINISH: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" b\"},\"finish_reason\":\"length\",\"stop_reason\":null}]}\n\n";
const USAGE_FP: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"total_tokens\":5,\"completion_tokens\":2},\"system_fingerprint\":\"vllm-0.32.0-2048\"}\n\n";
const DONE: &str = "data: [DONE]\n\n";

/// vLLM stamps `system_fingerprint` on the usage chunk when it sends one, else on the finish
/// chunk. The gateway asks for usage and removes the chunk: the client that
/// asked for no usage still finds the fingerprint on the finish chunk, whether the two chunks
/// came in one read or apart (then from the value the backend sent last); a client that asked
/// for usage gets the backend's bytes untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_fingerprint_survives_the_removed_usage_chunk() {
    let fp = "\"system_fingerprint\":\"vllm-0.32.0-2048\"";
    let finish_chunk = |body: &str| -> String {
        body.lines()
            .find(|l| l.contains("\"finish_reason\":\"length\""))
            .unwrap_or_else(|| panic!("no finish chunk in {body}"))
            .to_owned()
    };
    let request = |usage: bool| {
        let mut body = serde_json::json!({"model":"m","stream":true,"max_tokens":2,
            "messages":[{"role":"user","content":"hi"}]});
        if usage {
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        Bytes::from(body.to_string())
    };
    // One write: the fingerprint comes from the usage chunk of the same read.
    static ONE_READ: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| {
        let tail: &'static str = Box::leak(format!("{FINISH}{USAGE_FP}{DONE}").into_boxed_str());
        vec![ROLE, TOKEN, tail]
    });
    // Apart: the finish chunk leaves before the usage chunk is read.
    const APART: &[&str] = &[ROLE, TOKEN, FINISH, USAGE_FP, DONE];
    for (writes, gap) in [
        (ONE_READ.as_slice(), Duration::ZERO),
        (APART, Duration::from_millis(150)),
    ] {
        let (addr, task) = scripted_stream_backend(writes, gap).await;
        let gw = gateway(vec![pool("m", &[format!("http://{addr}")])]).await;
        let url = gw.url("/v1/chat/completions");
        if gap > Duration::ZERO {
            // The first stream teaches the gateway this backend's fingerprint.
            let first = post(&url, &[], request(false)).await;
            assert_eq!(first.status, 200);
        }
        let m = post(&url, &[], request(false)).await;
        assert_eq!(m.status, 200);
        let body = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
        assert!(!body.contains("\"usage\""), "usage leaked: {body}");
        let finish = finish_chunk(&body);
        assert!(
            finish.ends_with(&format!(",{fp}}}")),
            "gap {gap:?}: {finish}"
        );
        // The rest of the chunk is the backend's.
        assert_eq!(
            finish.replace(&format!(",{fp}"), ""),
            FINISH.trim_end(),
            "gap {gap:?}"
        );
        assert!(body.ends_with(DONE), "{body}");
        // Asked for usage: the backend's bytes, untouched.
        let m = post(&url, &[], request(true)).await;
        let body = String::from_utf8_lossy(m.body.as_ref().unwrap()).into_owned();
        assert_eq!(
            body,
            format!("{ROLE}{TOKEN}{FINISH}{USAGE_FP}{DONE}"),
            "gap {gap:?}"
        );
        task.abort();
    }
}

/// A stream that did not ask for usage: the gateway asks upstream, learns the real counts, and
/// the client receives exactly the backend's stream minus that one usage event, its
/// `system_fingerprint` moved to the finish chunk (where vLLM puts it without a usage chunk).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_learned_on_every_stream_and_hidden_from_the_client() {
    let sim = sim(|_| {}).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    // One stream first: it teaches the gateway the backend's fingerprint, which the next ones
    // get even when the finish and usage chunks are read apart.
    let first = post(&gw.url("/v1/chat/completions"), &[], stream_body(2)).await;
    assert_eq!(first.status, 200);
    for (id, body) in [
        (
            "u-absent",
            serde_json::json!({"model":"qwen32b","stream":true,"max_tokens":7,"messages":[{"role":"user","content":"hi there"}]}),
        ),
        (
            "u-false",
            serde_json::json!({"model":"qwen32b","stream":true,"max_tokens":7,"stream_options":{"include_usage":false},"messages":[{"role":"user","content":"hi there"}]}),
        ),
    ] {
        let m = post(
            &gw.url("/v1/chat/completions"),
            &[("x-request-id", id)],
            body.to_string(),
        )
        .await;
        assert_eq!(m.status, 200);
        let got = m.body.clone().unwrap();
        let sent = sim.stats().captured(id).unwrap();
        let sent_text = String::from_utf8(sent.to_vec()).unwrap();
        let usage_event = sent_text
            .split_inclusive("\n\n")
            .find(|e| e.contains("\"usage\""))
            .expect("the backend sent usage: the gateway asked for it");
        let fingerprint = usage_event
            .find(",\"system_fingerprint\":")
            .map(|at| usage_event[at..].trim_end().trim_end_matches('}'))
            .expect("the sim's usage chunk has a fingerprint");
        let finish = sent_text
            .split_inclusive("\n\n")
            .find(|e| e.contains("\"finish_reason\":\"length\""))
            .unwrap();
        let stamped = format!(
            "{}{fingerprint}}}\n\n",
            &finish.trim_end()[..finish.trim_end().len() - 1]
        );
        let expected = sent_text
            .replacen(usage_event, "", 1)
            .replacen(finish, &stamped, 1);
        assert_eq!(
            String::from_utf8(got.to_vec()).unwrap(),
            expected,
            "{id}: client bytes"
        );
        assert!(
            m.metrics.usage.is_none(),
            "{id}: the client sees no usage it did not ask for"
        );
        let rec = gw.record_of(id).await;
        let usage = rec
            .timeline
            .stream()
            .usage
            .expect("the gateway knows the real counts");
        assert_eq!(usage.completion_tokens, 7);
        assert!(usage.prompt_tokens > 0);
    }
    // A client that asked for usage gets it, unchanged.
    let m = post(
        &gw.url("/v1/chat/completions"),
        &[("x-request-id", "u-true")],
        stream_body(5),
    )
    .await;
    assert_eq!(m.body.unwrap(), sim.stats().captured("u-true").unwrap());
    assert_eq!(m.metrics.usage.unwrap().completion_tokens, 5);
}
