//! What the bench measures: the sim's configured timing, ITL against TPOT, the hop's cost from
//! a stream's trailer, and in-stream and HTTP errors counted as failures.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measures_what_the_sim_was_configured_to_produce() {
    // One token every 10 ms, no prefill cost, one request at a time: TTFT ≈ one step,
    // ITL ≈ TPOT ≈ 10 ms, E2EL ≈ TTFT + 19 × 10 ms for 20 tokens.
    let s = sim(|a| {
        a.decode_step_ms = 10.0;
        a.decode_ms_per_seq = 0.0;
        a.prefill_us_per_token = 0.0;
    })
    .await;
    let (_, report) = run(&[
        "--base-url",
        &s.url(),
        "--num-prompts",
        "12",
        "--random-input-len",
        "50",
        "--random-output-len",
        "20",
        "--max-concurrency",
        "1",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,95,99",
    ])
    .await;
    let r = &report.summaries[0];
    assert_eq!((r.completed, r.failed), (12, 0), "{}", report.text);
    assert_eq!(r.total_output, 12 * 20, "output tokens from usage");
    assert_eq!(r.outputs_without_usage, 0);
    let m = |k: &str| r.metrics[k].mean;
    // The sim lays each decode step of 10 ms end to end from the previous step's deadline and never
    // sends a token before its deadline; a loaded machine only delays tokens, and a late step
    // makes the next one short (the deadlines keep their spacing). So physics gives lower
    // bounds: the first token is one step after the request, the last 19 steps after the first.
    // What a loaded machine adds has no bound worth a test, so the upper bounds are generous:
    // they catch a wrong unit or a sum over the wrong events, not a slow run.
    const STEP_MS: f64 = 10.0;
    assert!(
        (STEP_MS..20.0 * STEP_MS).contains(&m("ttft")),
        "TTFT {} for one step of {STEP_MS} ms",
        m("ttft")
    );
    assert!(
        (19.0 * STEP_MS..80.0 * STEP_MS).contains(&m("e2el")),
        "E2EL {} for 20 steps of {STEP_MS} ms",
        m("e2el")
    );
    // Like vLLM, the sim opens each stream with a role chunk; by vLLM 0.33's definition it is
    // not a token event: the 20 tokens give 19 ITLs.
    assert_eq!(
        r.metrics["itl"].count,
        12 * 19,
        "one ITL per event after the first"
    );
    // The figures are one measurement read three ways, whatever the machine's load: each
    // request's TPOT is (E2EL − TTFT) / 19, and its 19 ITLs span the same time but for the end of
    // the stream after the last token (the usage chunk and `[DONE]`, sent at once).
    let span = (m("e2el") - m("ttft")) / 19.0;
    assert!(
        (m("tpot") - span).abs() < 0.001 * span,
        "mean TPOT {} against (E2EL − TTFT) / 19 = {span}",
        m("tpot")
    );
    assert!(
        (m("itl") - span).abs() < 0.05 * span,
        "mean ITL {} against (E2EL − TTFT) / 19 = {span}",
        m("itl")
    );
    // One at a time: never two in flight at once, but vLLM's per-second count sees each second's
    // several requests (~210 ms each).
    assert_eq!(r.peak_concurrent_instant, 1);
    assert!(
        (2..=12).contains(&r.max_concurrent_requests),
        "{}",
        r.max_concurrent_requests
    );
    // vLLM's keys and the seed's shape.
    let j = &report.json;
    for k in [
        "completed",
        "failed",
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "peak_concurrent_requests_instant",
        "request_goodput",
        "latencies",
        "backend",
        "label",
        "tokenizer_id",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p50_ttft_ms",
        "p95_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "errors",
        "throughput_tokens_per_sec",
        "error_rate",
        "labels",
        "settings",
        "client",
    ] {
        assert!(j.get(k).is_some(), "result JSON lacks `{k}`");
    }
    assert_eq!(j["completed"], 12);
    assert!(j["ttft_ms"]["p95"].as_f64().unwrap() > 0.0);
    assert_eq!(j["labels"]["model"], "qwen32b", "the model from /v1/models");
    assert_eq!(j["itls"].as_array().unwrap().len(), 12);
    assert_eq!(j["max_concurrent_requests"], r.max_concurrent_requests);
    assert_eq!(j["peak_concurrent_requests_instant"], 1);
    assert!(j["request_goodput"].is_null(), "null without --goodput");
    assert_eq!(j["backend"], "openai-chat");
    assert!(j["label"].is_null() && j["tokenizer_id"].is_null());
    // E2EL per request, in seconds like `ttfts`.
    let latencies = j["latencies"].as_array().unwrap();
    assert_eq!(latencies.len(), 12);
    let mean_s = latencies.iter().map(|v| v.as_f64().unwrap()).sum::<f64>() / 12.0;
    assert!((mean_s * 1e3 - m("e2el")).abs() < 1e-6, "{mean_s}");
    // vLLM's labels, to the letter; the instantaneous peak under a label of its own.
    for l in [
        "Successful requests:",
        "Peak concurrent requests:",
        "Total token throughput (tok/s):",
        "P95 ITL (ms):",
        "Instantaneous peak concurrency:",
    ] {
        assert!(report.text.contains(l), "{l}\n{}", report.text);
    }
    assert!(!report.text.contains("Total Token"));
    assert_eq!(report.exit, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_stream_errors_and_http_errors_count_as_failures() {
    let s = sim(|a| {
        a.zero_delay = true;
        a.error_after_chunks = Some(2);
    })
    .await;
    let (_, report) = run(&[
        "--base-url",
        &s.url(),
        "--num-prompts",
        "6",
        "--random-input-len",
        "10",
        "--random-output-len",
        "8",
    ])
    .await;
    let r = &report.summaries[0];
    assert_eq!((r.completed, r.failed), (0, 6), "{}", report.text);
    assert!(
        r.errors
            .keys()
            .all(|e| e.starts_with("error event in the stream")),
        "{:?}",
        r.errors
    );
    assert!(report.text.contains("Failures by cause"));
    assert_eq!(report.exit, 1, "nothing succeeded");
    // A wrong model name: HTTP 404 with the server's message, per request.
    let s = sim(|a| a.zero_delay = true).await;
    let (_, report) = run(&[
        "--base-url",
        &s.url(),
        "--model",
        "no-such-model",
        "--num-prompts",
        "2",
        "--random-input-len",
        "10",
        "--random-output-len",
        "3",
    ])
    .await;
    let r = &report.summaries[0];
    assert_eq!(r.failed, 2);
    assert!(
        r.errors.keys().all(|e| e.starts_with("HTTP 404")),
        "{:?}",
        r.errors
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mean_itl_equals_mean_tpot_at_eight_output_tokens() {
    // vLLM 0.33's definitions: one token per fixed decode step, eight tokens. Counting the
    // opening role chunk as a token would make mean ITL 12.5 % lower than mean TPOT here; by the definitions the two are the same gaps averaged two ways (E2EL − TTFT
    // over 7), whatever the machine's load, so the ratio is asserted, not a time.
    let s = sim(|a| {
        a.decode_step_ms = 5.0;
        a.decode_ms_per_seq = 0.0;
        a.prefill_us_per_token = 0.0;
    })
    .await;
    let (_, report) = run(&[
        "--base-url",
        &s.url(),
        "--num-prompts",
        "10",
        "--random-input-len",
        "20",
        "--random-output-len",
        "8",
        "--max-concurrency",
        "1",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
    ])
    .await;
    let r = &report.summaries[0];
    assert_eq!((r.completed, r.total_output), (10, 80), "{}", report.text);
    assert_eq!(
        r.metrics["itl"].count,
        10 * 7,
        "seven gaps between eight tokens"
    );
    let (itl, tpot) = (r.metrics["itl"].mean, r.metrics["tpot"].mean);
    assert!(
        (itl - tpot).abs() / tpot < 0.02,
        "mean ITL {itl} ms vs mean TPOT {tpot} ms\n{}",
        report.text
    );
}

/// A body of the frames given, in order (data, then a trailer).
struct Frames(std::collections::VecDeque<hyper::body::Frame<bytes::Bytes>>);

impl hyper::body::Body for Frames {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.pop_front().map(Ok))
    }
}

/// A server on 127.0.0.1:0 that answers every request as a gateway will a stream: three tokens,
/// `Server-Timing: gw` in the head and the full `Server-Timing` (with `hop`) as an HTTP/1
/// trailer — which hyper sends only to a request with `TE: trailers` (counted in `te_seen`).
async fn timing_server(
    te_seen: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> std::net::SocketAddr {
    use http_body_util::BodyExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = te_seen.clone();
            let svc = hyper::service::service_fn(
                move |req: http::Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        if req
                            .headers()
                            .get(http::header::TE)
                            .is_some_and(|v| v == "trailers")
                        {
                            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        let _ = req.into_body().collect().await;
                        let mut frames: std::collections::VecDeque<_> = [
                        r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
                        r#"{"choices":[{"index":0,"delta":{"content":"a"}}]}"#,
                        r#"{"choices":[{"index":0,"delta":{"content":"b"}}]}"#,
                        r#"{"choices":[{"index":0,"delta":{"content":"c"}}]}"#,
                        r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}"#,
                        "[DONE]",
                    ]
                    .into_iter()
                    .map(|d| hyper::body::Frame::data(bytes::Bytes::from(format!("data: {d}\n\n"))))
                    .collect();
                        let mut trailer = http::HeaderMap::new();
                        trailer.insert(
                            "server-timing",
                            http::HeaderValue::from_static("gw;dur=0.050, hop;dur=0.250"),
                        );
                        frames.push_back(hyper::body::Frame::trailers(trailer));
                        let resp = http::Response::builder()
                            .header(http::header::CONTENT_TYPE, "text/event-stream")
                            .header("server-timing", "gw;dur=0.040")
                            .header(http::header::TRAILER, "server-timing")
                            .body(Frames(frames))
                            .unwrap();
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                },
            );
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hop_cost_is_read_from_the_trailer_of_a_stream() {
    use std::sync::atomic::AtomicUsize;
    let te_seen = std::sync::Arc::new(AtomicUsize::new(0));
    let addr = timing_server(te_seen.clone()).await;
    let client = fleetgate_protocol::client::http_client();
    let uri: http::Uri = format!("http://{addr}/v1/chat/completions")
        .parse()
        .unwrap();
    let body = fleetgate_protocol::client::chat_body("m", "hi", 3, true);
    let target = fleetgate_bench::spec::Target {
        name: "t".into(),
        base: format!("http://{addr}"),
        uri: uri.clone(),
        replicas: vec![uri.clone()],
        headers: http::HeaderMap::new(),
        key_source: "no key".into(),
        dialect: fleetgate_protocol::Dialect::Chat,
        streamed: true,
    };
    let o = fleetgate_bench::measure::send(
        &client,
        &target,
        0,
        body.clone(),
        5,
        std::time::Instant::now(),
        std::time::Duration::from_secs(10),
    )
    .await;
    assert!(o.ok(), "{:?}", o.error);
    assert_eq!(o.output_tokens, 3);
    assert_eq!(o.gateway_ms, Some(0.04), "gw from the head");
    assert_eq!(o.hop_ms, Some(0.25), "hop from the trailer");
    assert_eq!(
        te_seen.load(Ordering::SeqCst),
        1,
        "the bench asked for trailers"
    );
    // Without `TE: trailers` the server keeps the trailer back: the bench's header is what
    // lets the hop figure through.
    let req = fleetgate_protocol::client::post(&uri, &http::HeaderMap::new(), body);
    let mut a = fleetgate_protocol::client::open(&client, req, std::time::Instant::now())
        .await
        .unwrap();
    let end = a.read(None, |_, _| {}).await;
    assert_eq!(end, fleetgate_protocol::client::BodyEnd::Complete);
    assert!(a.trailers.is_none(), "{:?}", a.trailers);
    // Through a whole compare run: the report's hop section and the line beside the client's
    // delta.
    let s = sim(|a| a.zero_delay = true).await;
    let direct = format!("direct={}", s.url());
    let via = format!("gateway=http://{addr}");
    let (_, report) = run(&[
        "--compare",
        &direct,
        &via,
        "--model",
        "qwen32b",
        "--num-prompts",
        "10",
        "--random-input-len",
        "10",
        "--random-output-len",
        "3",
        "--max-concurrency",
        "1",
    ])
    .await;
    let g = &report.summaries[1];
    assert_eq!(g.completed, 10, "{}", report.text);
    assert_eq!(
        te_seen.load(Ordering::SeqCst),
        1 + 10,
        "TE: trailers on every request"
    );
    let hop = g.hop_ms.as_ref().unwrap();
    assert_eq!((hop.count, hop.median), (10, 0.25));
    for l in [
        "Gateway's recorded hop cost (Server-Timing hop)",
        "Median hop cost (ms):                    0.250",
        "the figure to believe: the hop gateway recorded, stamped per request from the kernel's receive time: median 0.250 ms over 10 requests; the client-side TTFT median delta (gateway − direct) is",
    ] {
        assert!(report.text.contains(l), "{l}\n{}", report.text);
    }
    let j = &report.json;
    assert_eq!(j["targets"]["gateway"]["gateway_hop_ms"]["median"], 0.25);
    assert_eq!(j["targets"]["gateway"]["gateway_hop_ms"]["count"], 10);
    assert!(j["targets"]["direct"].get("gateway_hop_ms").is_none());
    assert_eq!(j["comparison"]["hop"]["recorded_median_ms"], 0.25);
}
