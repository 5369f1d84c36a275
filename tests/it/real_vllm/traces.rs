//! One trace from the client through the gateway into real vLLM: vLLM started with
//! `--otlp-traces-endpoint` (`scripts/real-vllm.sh start --otlp-traces-endpoint URL`, which
//! prints `FLEETGATE_TEST_VLLM_OTLP=URL`) exports its `llm_request` span to a receiver this
//! test runs at that URL, beside the gateway's own spans.

use std::net::SocketAddr;
use std::time::Duration;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_span_sits_under_the_gateways_call_in_the_clients_trace() {
    let _serial = SERIAL.lock().await;
    let Some(r) = real("vllms_span_sits_under_the_gateways_call_in_the_clients_trace").await else {
        return;
    };
    let Ok(otlp) = std::env::var("FLEETGATE_TEST_VLLM_OTLP") else {
        eprintln!(
            "\n*** SKIPPED vllms_span_sits_under_the_gateways_call_in_the_clients_trace: vLLM was \
             not started with --otlp-traces-endpoint (scripts/real-vllm.sh start \
             --otlp-traces-endpoint http://127.0.0.1:14318/v1/traces prints \
             FLEETGATE_TEST_VLLM_OTLP). ***\n"
        );
        return;
    };
    let uri: http::Uri = otlp.parse().unwrap();
    let addr: SocketAddr = format!("{}:{}", uri.host().unwrap(), uri.port_u16().unwrap())
        .parse()
        .unwrap();
    // vLLM and the gateway export to the same receiver, as to one collector.
    let collector = OtlpReceiver::at(addr).await;
    let mut p = pool(&r.model, std::slice::from_ref(&r.url));
    p.upstream_api_key = Some(fleetgate_gateway::secret::Secret::new(&r.key));
    let gw = gateway_with(vec![p], |c| {
        c.admin = admin_cfg();
        c.tracing = tracing_to(&collector.endpoint());
    })
    .await;
    wait_for_200(&gw.url("/readyz").to_string()).await;

    // A trace of this run's own (earlier runs' spans may still arrive from vLLM's retries).
    let trace: String = (0..16)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    let client_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace}-{client_span}-01");
    for stream in [false, true] {
        let m = post(
            &gw.url("/v1/chat/completions"),
            &[("traceparent", &traceparent)],
            Bytes::from(chat(&r.model, 8, stream).to_string()),
        )
        .await;
        assert_eq!(m.status, 200, "{:?}", m.body);
    }

    // Two requests: each a gateway SERVER and CLIENT span and vLLM's `llm_request`. vLLM's
    // exporter sends within ~0.1 s (OTEL_BSP_SCHEDULE_DELAY=100), retrying a failed batch
    // for ~10 s.
    let mut spans = Vec::new();
    for _ in 0..150 {
        spans = collector.of_trace(&trace);
        if spans.len() >= 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let vllm: Vec<_> = spans
        .iter()
        .filter(|s| s.span.name == "llm_request")
        .collect();
    assert_eq!(
        vllm.len(),
        2,
        "vLLM's spans in the client's trace: {spans:#?}"
    );
    let servers: Vec<_> = spans
        .iter()
        .filter(|s| s.kind() == 2 && s.span.name != "llm_request")
        .collect();
    let calls: Vec<_> = spans.iter().filter(|s| s.kind() == 3).collect();
    assert_eq!((servers.len(), calls.len()), (2, 2), "{spans:#?}");
    for s in &servers {
        assert_eq!(
            s.parent_hex(),
            client_span,
            "the gateway joins the client's trace"
        );
        // max_tokens 8 at temperature 0: the answer is cut at its limit.
        assert_eq!(
            s.strs("gen_ai.response.finish_reasons"),
            ["length"],
            "{s:#?}"
        );
        assert_eq!(s.resource_str("service.name"), Some("fleetgate"));
    }
    for v in &vllm {
        assert_eq!(v.resource_str("service.name"), Some("vllm"));
        // vLLM's span is the child of the gateway's span for the upstream call.
        let call = calls
            .iter()
            .find(|c| c.id_hex() == v.parent_hex())
            .unwrap_or_else(|| {
                panic!("llm_request's parent is no gateway CLIENT span: {spans:#?}")
            });
        let server = servers
            .iter()
            .find(|s| s.id_hex() == call.parent_hex())
            .expect("the call is under a gateway SERVER span");
        // On one clock: vLLM's request lies within the gateway's call, which lies within the
        // gateway's request.
        assert!(
            v.span.start_time_unix_nano >= call.span.start_time_unix_nano,
            "{v:#?} {call:#?}"
        );
        assert!(call.span.start_time_unix_nano >= server.span.start_time_unix_nano);
        assert!(
            v.attr("gen_ai.latency.time_to_first_token").is_some(),
            "{v:#?}"
        );
        eprintln!(
            "trace {trace}: gateway {} µs before vLLM's span; vLLM queue {:?} s, ttft {:?} s",
            (v.span.start_time_unix_nano - server.span.start_time_unix_nano) / 1000,
            v.attr("gen_ai.latency.time_in_queue"),
            v.attr("gen_ai.latency.time_to_first_token"),
        );
    }
}
