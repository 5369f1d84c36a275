//! Agent-shaped load: conversations that each send their turns one after another, every turn
//! carrying the whole history (a system prompt all conversations share, the earlier user
//! messages and the answers actually received) plus a new user message, as a coding agent
//! does. It reports TTFT by turn and, where vLLM's `/metrics` can be read, the prefix cache's
//! hit rate over the run: the figures that show whether a fleet keeps a conversation's
//! history cached.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::engine::{RunResult, thread_cpu};
use super::measure::{self, Outcome};
use super::plan::Plan;
use super::report::{Report, build_report};
use super::spec::{EndpointType, MultiTurn};
use super::summary::Stats;

/// Who said a message of the history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    User,
    Assistant,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// The body of one turn: the system prompt and the whole history (ending with the new user
/// message), in the endpoint's shape: chat `messages` with a system message; Responses
/// `instructions` and the history as `input` items; Messages a `system` and `messages`.
pub(crate) fn turn_body(
    kind: EndpointType,
    model: &str,
    system: &str,
    history: &[(Role, String)],
    output_tokens: u64,
    ignore_eos: bool,
    extra: &serde_json::Map<String, Value>,
) -> Bytes {
    let items: Vec<Value> = history
        .iter()
        .map(|(r, t)| json!({"role": r.name(), "content": t}))
        .collect();
    let mut v = match kind {
        EndpointType::OpenaiResponses => {
            let mut v = json!({"model": model, "input": items});
            if !system.is_empty() {
                v["instructions"] = system.into();
            }
            v["max_output_tokens"] = output_tokens.into();
            v
        }
        EndpointType::AnthropicMessages => {
            let mut v = json!({"model": model, "messages": items});
            if !system.is_empty() {
                v["system"] = system.into();
            }
            v["max_tokens"] = output_tokens.into();
            v
        }
        // `plan` admits chat, Responses and Messages only; chat for the others.
        EndpointType::OpenaiChat | EndpointType::Openai | EndpointType::OpenaiEmbeddings => {
            let mut messages = Vec::with_capacity(items.len() + 1);
            if !system.is_empty() {
                messages.push(json!({"role": "system", "content": system}));
            }
            messages.extend(items);
            let mut v = json!({"model": model, "messages": messages});
            v["max_tokens"] = output_tokens.into();
            v["stream_options"] = json!({"include_usage": true});
            v
        }
    };
    v["temperature"] = 0.0.into();
    v["stream"] = true.into();
    if ignore_eos {
        v["ignore_eos"] = true.into();
    }
    super::dataset::with_extra(v, extra)
}

/// The run and what it measured: the engine's result and the prefix-cache counters before
/// and after (each `None` when not readable).
pub async fn run(plan: Arc<Plan>, stop: CancellationToken) -> Result<Report, String> {
    let mt = plan
        .multi_turn
        .clone()
        .ok_or("not a multi-turn plan (--multi-turn-conversations)")?;
    let before = cache_counters(&mt.cache_metrics).await;
    let result = execute(plan.clone(), stop).await?;
    let after = cache_counters(&mt.cache_metrics).await;
    let mut report = build_report(&plan, &result);
    let cache = match (before, after) {
        (Some(b), Some(a)) => Some(CacheDelta {
            hits: a.0 - b.0,
            queries: a.1 - b.1,
        }),
        _ => None,
    };
    let (text, json) = section(&mt, &result.outcomes, cache);
    report.text.push_str(&text);
    if let Value::Object(m) = &mut report.json {
        m.insert("multi_turn".into(), json);
    }
    Ok(report)
}

/// Run the conversations on a thread of their own (one core, its own event loop), as the
/// engine runs a plain plan.
pub async fn execute(plan: Arc<Plan>, stop: CancellationToken) -> Result<RunResult, String> {
    super::engine::on_bench_thread(move || conversations(plan, stop)).await
}

async fn conversations(plan: Arc<Plan>, stop: CancellationToken) -> Result<RunResult, String> {
    let mt = plan
        .multi_turn
        .clone()
        .ok_or("not a multi-turn plan (--multi-turn-conversations)")?;
    let client = fleetgate_protocol::client::http_client();
    let cpu_before = thread_cpu();
    let started = Instant::now();
    // Each turn's outcome lands here as it ends, so an interrupted run keeps what finished.
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let mut set = JoinSet::new();
    for c in 0..mt.conversations {
        let (plan, client, outcomes) = (plan.clone(), client.clone(), outcomes.clone());
        set.spawn(conversation(plan, client, c, started, outcomes));
    }
    let interrupted = tokio::select! {
        _ = stop.cancelled() => {
            set.abort_all();
            while set.join_next().await.is_some() {}
            true
        }
        _ = async { while set.join_next().await.is_some() {} } => false,
    };
    let duration = started.elapsed();
    let client_cpu = match (cpu_before, thread_cpu()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    let mut outcomes = std::mem::take(&mut *outcomes.lock().map_err(|e| e.to_string())?);
    outcomes.sort_by_key(|o| o.sent_at);
    Ok(RunResult {
        outcomes,
        duration,
        interrupted,
        client_cpu,
    })
}

/// One conversation's turns, in order; a failed turn ends it (its history would be wrong). The
/// hot conversation sends each turn by all its lanes at once, over the same history, and moves
/// on when all have answered, with lane 0's message and answer (a failed lane 0 ends it).
async fn conversation(
    plan: Arc<Plan>,
    client: fleetgate_protocol::client::HttpClient,
    c: usize,
    started: Instant,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
) {
    let Some(mt) = plan.multi_turn.as_ref() else {
        return;
    };
    // Several servers given directly (`--base-url URL1,URL2`): a conversation stays on one, as
    // a session does with its server, so its history can be found in that server's cache.
    let mut target = plan.targets[0].clone();
    if target.replicas.len() > 1 {
        target.replicas = vec![target.replicas[c % target.replicas.len()].clone()];
    }
    let target = &target;
    // A timed run (`--duration-seconds`): the conversation starts over, as a new one, until the
    // time is up; a turn begun in time runs to its end.
    let deadline = plan.duration.map(|d| started + d);
    for session in 0.. {
        if !session_of_turns(
            &plan, mt, target, &client, c, session, started, deadline, &outcomes,
        )
        .await
            || deadline.is_none()
        {
            return;
        }
    }
}

/// One session of conversation `c`'s turns (the first, or the `session`-th start over of a
/// timed run, its messages' words rotated by `session`: a conversation of its own, of the same
/// sizes). True when all its turns were answered in time.
#[allow(clippy::too_many_arguments)]
async fn session_of_turns(
    plan: &Plan,
    mt: &MultiTurn,
    target: &super::spec::Target,
    client: &fleetgate_protocol::client::HttpClient,
    c: usize,
    session: usize,
    started: Instant,
    deadline: Option<Instant>,
    outcomes: &Arc<Mutex<Vec<Outcome>>>,
) -> bool {
    let text_of = |i: usize| -> String {
        let own = &plan.prompts[i].text;
        if session == 0 {
            return own.clone();
        }
        super::dataset::rotate_words(own, session)
    };
    let mut history: Vec<(Role, String)> = Vec::with_capacity(2 * mt.turns);
    let mut expected = mt.system_len;
    for t in 0..mt.turns {
        if t > 0 && !mt.think.is_zero() {
            tokio::time::sleep(mt.think).await;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        let mut sends = Vec::with_capacity(mt.lanes(c));
        for lane in 0..mt.lanes(c) {
            let i = mt.lane_index(c, lane, t);
            let prompt = &plan.prompts[i];
            history.push((Role::User, text_of(i)));
            let body = turn_body(
                plan.endpoint_type,
                &plan.model,
                &mt.system,
                &history,
                prompt.output_tokens,
                plan.ignore_eos,
                &plan.body_extra,
            );
            history.pop();
            let (outcomes, timeout) = (outcomes, plan.timeout);
            let expected = expected + prompt.input_tokens;
            sends.push(async move {
                let mut o =
                    measure::send_keeping_text(client, target, i, body, expected, started, timeout)
                        .await;
                o.prompt = i;
                let answer = o.answer.take().filter(|_| o.ok());
                let output_tokens = o.output_tokens;
                // Each lane's outcome lands as it ends, so an interrupted turn keeps them.
                if let Ok(mut all) = outcomes.lock() {
                    all.push(o);
                }
                (answer, output_tokens)
            });
        }
        let mut lanes = futures_util::future::join_all(sends).await.into_iter();
        let i = mt.index(c, t);
        match lanes.next() {
            Some((Some(answer), output_tokens)) => {
                expected += plan.prompts[i].input_tokens + output_tokens;
                history.push((Role::User, text_of(i)));
                history.push((Role::Assistant, answer));
            }
            _ => return false,
        }
    }
    true
}

/// What the prefix cache counted over the run: hit and queried tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CacheDelta {
    pub(crate) hits: f64,
    pub(crate) queries: f64,
}

/// (hits, queries) of vLLM's `vllm:prefix_cache_hits_total` and
/// `vllm:prefix_cache_queries_total` in a `/metrics` text, summed over their series; `None`
/// when either is missing (not a vLLM, or a gateway).
pub(crate) fn prefix_cache_counters(metrics: &str) -> Option<(f64, f64)> {
    let sum = |name: &str| -> Option<f64> {
        let mut found = None;
        for line in metrics.lines().filter(|l| !l.starts_with('#')) {
            let Some(rest) = line.strip_prefix(name) else {
                continue;
            };
            // The name alone, or with labels: not a longer name that starts the same.
            if !(rest.starts_with(' ') || rest.starts_with('{')) {
                continue;
            }
            let value = rest.rsplit(' ').find(|s| !s.is_empty())?;
            if let Ok(v) = value.parse::<f64>() {
                *found.get_or_insert(0.0) += v;
            }
        }
        found
    };
    Some((
        sum("vllm:prefix_cache_hits_total")?,
        sum("vllm:prefix_cache_queries_total")?,
    ))
}

/// The counters summed over every server of `bases`; `None` unless every one answered with
/// them (a partial sum would misstate the fleet's rate).
async fn cache_counters(bases: &[String]) -> Option<(f64, f64)> {
    use http_body_util::BodyExt;
    if bases.is_empty() {
        return None;
    }
    let client = fleetgate_protocol::client::http_client();
    let mut total = (0.0, 0.0);
    for base in bases {
        let uri: http::Uri = format!("{base}/metrics").parse().ok()?;
        let req = http::Request::get(uri)
            .body(http_body_util::Full::new(Bytes::new()))
            .ok()?;
        let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
            .await
            .ok()?
            .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
            .await
            .ok()?
            .ok()?
            .to_bytes();
        let (h, q) = prefix_cache_counters(&String::from_utf8_lossy(&body))?;
        total.0 += h;
        total.1 += q;
    }
    Some(total)
}

/// The per-turn table and the cache line (text), and the `multi_turn` result key.
fn section(mt: &MultiTurn, outcomes: &[Outcome], cache: Option<CacheDelta>) -> (String, Value) {
    use std::fmt::Write;
    let mut text = format!(
        "\nMulti-turn: {} conversations × {} turns (system prompt {} tokens shared by all, {} new user tokens a turn, think {} ms)\n",
        mt.conversations,
        mt.turns,
        mt.system_len,
        mt.user_len,
        mt.think.as_millis()
    );
    let _ = writeln!(
        text,
        "{:>5} {:>5} {:>6} {:>10} {:>14} {:>16} {:>14} {:>7}",
        "turn",
        "ok",
        "failed",
        "mean in",
        "mean TTFT ms",
        "median TTFT ms",
        "P99 TTFT ms",
        "cached"
    );
    let mut rows = Vec::with_capacity(mt.turns);
    for t in 0..mt.turns {
        let mine: Vec<&Outcome> = outcomes
            .iter()
            .filter(|o| mt.turn_of(o.prompt) == t)
            .collect();
        let ok: Vec<&Outcome> = mine.iter().copied().filter(|o| o.ok()).collect();
        let ttft = Stats::of(
            ok.iter()
                .filter_map(|o| o.ttft)
                .map(|d| d.as_secs_f64() * 1e3)
                .collect(),
            &[99.0],
        );
        let input: u64 = ok.iter().map(|o| o.input_tokens).sum();
        let mean_input = if ok.is_empty() {
            0.0
        } else {
            input as f64 / ok.len() as f64
        };
        // The share of this turn's prompt tokens the server said it found cached.
        let reported: Vec<&&Outcome> = ok.iter().filter(|o| o.cached_tokens.is_some()).collect();
        let cached_share = (!reported.is_empty()).then(|| {
            let cached: u64 = reported.iter().filter_map(|o| o.cached_tokens).sum();
            let of: u64 = reported.iter().map(|o| o.input_tokens).sum();
            if of == 0 {
                0.0
            } else {
                cached as f64 / of as f64
            }
        });
        let p99 = ttft.get("p99").unwrap_or(0.0);
        let _ = writeln!(
            text,
            "{:>5} {:>5} {:>6} {:>10.1} {:>14.2} {:>16.2} {:>14.2} {:>7}",
            t + 1,
            ok.len(),
            mine.len() - ok.len(),
            mean_input,
            ttft.mean,
            ttft.median,
            p99,
            cached_share.map_or("-".to_owned(), |s| format!("{:.0}%", s * 100.0))
        );
        rows.push(json!({
            "turn": t + 1,
            "completed": ok.len(),
            "failed": mine.len() - ok.len(),
            "mean_input_tokens": mean_input,
            "mean_ttft_ms": ttft.mean,
            "median_ttft_ms": ttft.median,
            "p99_ttft_ms": p99,
            "cached_tokens_share": cached_share,
        }));
    }
    // Turns after the first: what a cache-aware router can serve from the conversation's
    // history (the first turn's prompt is new everywhere but its system prompt).
    let later = Stats::of(
        outcomes
            .iter()
            .filter(|o| o.ok() && mt.turn_of(o.prompt) > 0)
            .filter_map(|o| o.ttft)
            .map(|d| d.as_secs_f64() * 1e3)
            .collect(),
        &[99.0],
    );
    let later_p99 = later.get("p99").unwrap_or(0.0);
    if mt.turns > 1 {
        let _ = writeln!(
            text,
            "Later turns (2 to {}): TTFT median {:.2} ms, P99 {:.2} ms",
            mt.turns, later.median, later_p99
        );
    }
    let hot_json = mt.hot.map(|h| {
        let (hot, others): (Vec<&Outcome>, Vec<&Outcome>) =
            outcomes.iter().partition(|o| mt.is_hot(o.prompt));
        let ttft = |of: &[&Outcome]| {
            let s = Stats::of(
                of.iter()
                    .filter(|o| o.ok())
                    .filter_map(|o| o.ttft)
                    .map(|d| d.as_secs_f64() * 1e3)
                    .collect(),
                &[99.0],
            );
            (s.median, s.get("p99").unwrap_or(0.0))
        };
        let ((median, p99), (others_median, others_p99)) = (ttft(&hot), ttft(&others));
        let share = if outcomes.is_empty() {
            0.0
        } else {
            hot.len() as f64 / outcomes.len() as f64
        };
        let _ = writeln!(
            text,
            "Hot conversation: {} lanes a turn, {} of {} requests ({:.1}%, asked {:.1}%); TTFT median {:.2} ms, P99 {:.2} ms vs the other conversations' {:.2} ms, {:.2} ms",
            h.lanes,
            hot.len(),
            outcomes.len(),
            share * 100.0,
            h.share * 100.0,
            median,
            p99,
            others_median,
            others_p99
        );
        json!({
            "share_asked": h.share,
            "lanes": h.lanes,
            "requests": hot.len(),
            "all_requests": outcomes.len(),
            "share": share,
            "median_ttft_ms": median,
            "p99_ttft_ms": p99,
            "others_median_ttft_ms": others_median,
            "others_p99_ttft_ms": others_p99,
        })
    });
    let sources: Vec<String> = mt
        .cache_metrics
        .iter()
        .map(|b| format!("{b}/metrics"))
        .collect();
    let cache_json = match cache {
        Some(d) => {
            let rate = (d.queries > 0.0).then(|| d.hits / d.queries);
            let _ = writeln!(
                text,
                "Prefix cache hit rate (vLLM /metrics, this run): {} ({} of {} queried tokens)",
                rate.map_or("-".to_owned(), |r| format!("{:.1}%", r * 100.0)),
                d.hits,
                d.queries
            );
            json!({"measured": true, "sources": sources, "hits": d.hits, "queries": d.queries, "hit_rate": rate})
        }
        None => {
            text.push_str(
                "Prefix cache hit rate: not measured (no vLLM prefix-cache counters at the target's /metrics; behind a gateway, name the backends with --cache-metrics-url)\n",
            );
            json!({"measured": false, "sources": sources, "hits": null, "queries": null, "hit_rate": null})
        }
    };
    let json = json!({
        "conversations": mt.conversations,
        "turns": mt.turns,
        "user_len": mt.user_len,
        "system_len": mt.system_len,
        "think_ms": mt.think.as_secs_f64() * 1e3,
        "per_turn": rows,
        "later_turns": {"median_ttft_ms": later.median, "p99_ttft_ms": later_p99},
        "hot": hot_json,
        "prefix_cache": cache_json,
    });
    (text, json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::HotConversation;

    #[test]
    fn reads_the_prefix_cache_counters_of_vllm_metrics() {
        let m = "# HELP vllm:prefix_cache_hits_total x\n\
                 vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 96.0\n\
                 vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 4\n\
                 vllm:prefix_cache_hits_total_created 1.7e9\n\
                 vllm:prefix_cache_queries_total 310\n";
        assert_eq!(prefix_cache_counters(m), Some((100.0, 310.0)));
        assert_eq!(prefix_cache_counters("fleetgate_requests_total 3\n"), None);
    }

    #[test]
    fn the_hot_conversation_has_enough_lanes_for_its_share() {
        // The brief's example: a third of 16 conversations' requests.
        assert_eq!(HotConversation::lanes_for(1.0 / 3.0, 16), 8);
        let h = HotConversation {
            share: 1.0 / 3.0,
            lanes: 8,
        };
        assert!((h.planned_share(16) - 8.0 / 23.0).abs() < 1e-12);
        assert_eq!(HotConversation::lanes_for(0.5, 4), 3);
        assert_eq!(HotConversation::lanes_for(0.9, 2), 9);
        // Never fewer than two lanes: one would be no hotter than the others.
        assert_eq!(HotConversation::lanes_for(0.01, 16), 2);
        assert_eq!(HotConversation::lanes_for(0.5, 2), 2);
        // The lanes' prompts follow all conversations' and keep their turn.
        let mt = MultiTurn {
            conversations: 4,
            turns: 3,
            user_len: 1,
            system_len: 0,
            think: Duration::ZERO,
            system: String::new(),
            cache_metrics: Vec::new(),
            hot: Some(HotConversation {
                share: 0.5,
                lanes: 3,
            }),
        };
        assert_eq!(mt.lane_index(0, 0, 2), 2);
        assert_eq!(mt.lane_index(2, 0, 1), 7);
        assert_eq!(mt.lane_index(0, 1, 0), 12);
        assert_eq!(mt.lane_index(0, 2, 2), 17);
        assert_eq!((mt.lanes(0), mt.lanes(1)), (3, 1));
        let o = |prompt| Outcome {
            prompt,
            ..Outcome::default()
        };
        let hot: Vec<usize> = (0..18).filter(|p| mt.is_hot(o(*p).prompt)).collect();
        assert_eq!(hot, [0, 1, 2, 12, 13, 14, 15, 16, 17]);
        assert_eq!(mt.turn_of(o(16).prompt), 1);
    }

    #[test]
    fn a_turn_carries_the_system_prompt_and_the_whole_history() {
        let h = vec![
            (Role::User, "u1".to_owned()),
            (Role::Assistant, "a1".to_owned()),
            (Role::User, "u2".to_owned()),
        ];
        let chat: Value = serde_json::from_slice(&turn_body(
            EndpointType::OpenaiChat,
            "m",
            "sys",
            &h,
            5,
            false,
            &serde_json::Map::new(),
        ))
        .unwrap_or_default();
        assert_eq!(
            chat["messages"][0],
            json!({"role": "system", "content": "sys"})
        );
        assert_eq!(
            chat["messages"][2],
            json!({"role": "assistant", "content": "a1"})
        );
        assert_eq!(chat["messages"].as_array().map(Vec::len), Some(4));
        let r: Value = serde_json::from_slice(&turn_body(
            EndpointType::OpenaiResponses,
            "m",
            "sys",
            &h,
            5,
            false,
            &serde_json::Map::new(),
        ))
        .unwrap_or_default();
        assert_eq!(r["instructions"], "sys");
        assert_eq!(r["input"].as_array().map(Vec::len), Some(3));
        assert_eq!(r["max_output_tokens"], 5);
        let a: Value = serde_json::from_slice(&turn_body(
            EndpointType::AnthropicMessages,
            "m",
            "",
            &h,
            5,
            true,
            &serde_json::Map::new(),
        ))
        .unwrap_or_default();
        assert!(a.get("system").is_none());
        assert_eq!(a["messages"][2]["content"], "u2");
        assert_eq!(
            (a["max_tokens"].as_u64(), a["ignore_eos"].as_bool()),
            (Some(5), Some(true))
        );
    }
}
