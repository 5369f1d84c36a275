//! The shared fixture (tests/fixtures/timed-streams.json: raw SSE streams as a client receives
//! them, with read times, and the figures `vllm bench serve` gives for them) is reproduced by
//! both of fleetgate's clocks: the gateway's Timeline, fed event by event as the relay feeds it,
//! and the bench's stream timer. One test, one reading of the fixture, two measurers.

use std::time::{Duration, Instant};

use base64::Engine;
use fleetgate_bench::measure::StreamTimer;
use fleetgate_gateway::telemetry::Timeline;
use fleetgate_protocol::sse::SseScanner;
use fleetgate_protocol::stream::UsageSource;

struct Stream {
    name: String,
    /// (read time from the request's start, bytes read)
    reads: Vec<(Duration, Vec<u8>)>,
    expect: serde_json::Value,
}

fn streams() -> Vec<Stream> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/timed-streams.json"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["streams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| Stream {
            name: s["name"].as_str().unwrap().to_owned(),
            reads: s["reads"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    let at = Duration::from_millis(r["t_ms"].as_u64().unwrap());
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(r["b64"].as_str().unwrap())
                        .unwrap();
                    (at, bytes)
                })
                .collect(),
            expect: s["expect"].clone(),
        })
        .collect()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn expected_itls(s: &Stream) -> Vec<f64> {
    s.expect["itl_ms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

/// The gateway side: each read goes through the SSE scanner into
/// `Timeline::on_upstream_event`, the same calls the relay makes; the gaps it returns are the
/// ITL samples the relay observes.
fn check_timeline(s: &Stream) {
    let name = &s.name;
    let t0 = Instant::now();
    let mut tl = Timeline::start(t0);
    let mut scanner = SseScanner::new();
    let mut itls = Vec::new();
    for (at, bytes) in &s.reads {
        let now = t0 + *at;
        let offset = tl.offset(now);
        scanner.feed(bytes, |line| {
            if let Some(gap) = tl.on_upstream_event(line.kind, line.usage, now, offset) {
                itls.push(ms(gap));
            }
        });
    }
    let m = tl.stream();
    let e = &s.expect;
    assert_eq!(m.error, e["failed"].as_bool().unwrap(), "{name}: failed");
    assert_eq!(
        ms(tl.upstream_first_token().unwrap() - t0),
        e["ttft_ms"].as_f64().unwrap(),
        "{name}: first token stamp"
    );
    assert_eq!(
        ms(m.ttft().unwrap()),
        e["ttft_ms"].as_f64().unwrap(),
        "{name}: ttft"
    );
    let want = expected_itls(s);
    assert_eq!(itls, want, "{name}: itl");
    assert_eq!(m.content_events as usize, want.len() + 1, "{name}");
    if let Some(max) = want.iter().cloned().reduce(f64::max) {
        assert_eq!(ms(m.itl_max().unwrap()), max, "{name}: itl max");
        let mean = want.iter().sum::<f64>() / want.len() as f64;
        assert!((ms(m.itl_mean().unwrap()) - mean).abs() < 1e-9, "{name}");
    }
    if m.error {
        return;
    }
    assert_eq!(
        ms(m.e2el().unwrap()),
        e["e2el_ms"].as_f64().unwrap(),
        "{name}: e2el"
    );
    let (tokens, source) = m.output_tokens();
    assert_eq!(source, UsageSource::Backend);
    assert_eq!(tokens, e["output_tokens"].as_u64(), "{name}: tokens");
    assert_eq!(m.tpot().map(ms), e["tpot_ms"].as_f64(), "{name}: tpot");
    assert!(m.done, "{name}: [DONE] seen");
}

/// The bench side: the load generator's timer fed the same reads.
fn check_bench(s: &Stream) {
    let name = &s.name;
    let mut timer = StreamTimer::new();
    let mut end = Duration::ZERO;
    for (at, bytes) in &s.reads {
        end = *at;
        timer.feed(bytes, end);
    }
    let o = timer.finish(end, None, 0);
    let e = &s.expect;
    assert_eq!(!o.ok(), e["failed"].as_bool().unwrap(), "{name}: {o:?}");
    if o.ok() {
        assert_eq!(
            ms(o.ttft.unwrap()),
            e["ttft_ms"].as_f64().unwrap(),
            "{name}"
        );
    }
    let want: Vec<f32> = expected_itls(s).iter().map(|v| *v as f32).collect();
    assert_eq!(o.itls_ms, want, "{name}: itl");
    if !o.ok() {
        assert!(
            o.error.as_deref().unwrap().contains("error event"),
            "{name}"
        );
        return;
    }
    assert_eq!(
        ms(o.e2el.unwrap()),
        e["e2el_ms"].as_f64().unwrap(),
        "{name}"
    );
    assert_eq!(
        o.output_tokens,
        e["output_tokens"].as_u64().unwrap(),
        "{name}"
    );
    assert!(o.usage_reported);
    assert_eq!(o.tpot().map(ms), e["tpot_ms"].as_f64(), "{name}: tpot");
}

#[test]
fn the_timeline_and_the_bench_reproduce_the_shared_fixture() {
    let streams = streams();
    assert!(streams.len() >= 6, "the fixture lost streams");
    for s in &streams {
        check_timeline(s);
        check_bench(s);
    }
}
