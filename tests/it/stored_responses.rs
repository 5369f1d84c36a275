//! Stored responses (`/v1/responses` with `store`): every `GET`, cancel and continuation reaches
//! the backend that holds the response, another key's response does not exist for a key,
//! background responses hold their slots until done and are settled once, and replicas
//! sharing Redis find each other's responses.

use std::time::Duration;

use crate::agent_protocols::{events, responses_body};
use crate::common::*;
use bytes::Bytes;
use fleetgate_protocol::client;
use http_body_util::BodyExt;
use serde_json::{Value, json};

/// A stored response lives on one backend: its GET, its cancel and a response that continues
/// it all reach that backend (two backends, many tries), and an id the gateway never saw, or
/// whose backend is drained, gets a clear answer, never another backend's "not found".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_are_reached_where_they_live() {
    let one = sim(|a| a.responses_store = true).await;
    let two = sim(|a| a.responses_store = true).await;
    let gw = gateway_with(vec![pool("qwen32b", &[one.url(), two.url()])], |c| {
        c.admin = admin_cfg();
    })
    .await;
    let c = client::http_client();
    let get = |path: String| {
        let req = authed(&gw, "GET", &path)
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        c.request(req)
    };
    let mut ids = Vec::new();
    for i in 0..6 {
        let stream = i % 2 == 0;
        let m = post(
            &gw.url("/v1/responses"),
            &[],
            responses_body("qwen32b", 3, stream),
        )
        .await;
        assert_eq!(m.status, 200);
        let id = if stream {
            events(m.body.as_ref().unwrap())[0].1["response"]["id"]
                .as_str()
                .unwrap()
                .to_owned()
        } else {
            json_body(&m)["id"].as_str().unwrap().to_owned()
        };
        ids.push(id);
    }
    for id in &ids {
        for _ in 0..3 {
            let resp = get(format!("/v1/responses/{id}")).await.unwrap();
            let status = resp.status();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["id"], id.as_str());
        }
        // A continuation goes to the same backend (elsewhere it would be a 404).
        let body = json!({"model": "qwen32b", "input": "and then?", "max_output_tokens": 2, "previous_response_id": id});
        let m = post(&gw.url("/v1/responses"), &[], Bytes::from(body.to_string())).await;
        assert_eq!(m.status, 200, "{:?}", m.body);
        // The sim's responses are synchronous: its cancel says so, from the right backend.
        let req = authed(&gw, "POST", &format!("/v1/responses/{id}/cancel"))
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        let resp = c.request(req).await.unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
        assert!(String::from_utf8_lossy(&body).contains("synchronous"));
    }
    let rec = gw.records.lock().unwrap().clone();
    assert!(rec.iter().any(|r| r.endpoint == Some("responses_get")));
    // An id the gateway never pinned.
    let resp = get("/v1/responses/resp_0000000000000000".into())
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "response_not_found", "{v}");
    // A path that is not an id is not a route.
    let resp = get("/v1/responses/resp%2e1".into()).await.unwrap();
    assert_eq!(resp.status(), 404);
    // Drain the backend of the first response: reading it still works, continuing it does not.
    let holder = gw
        .records
        .lock()
        .unwrap()
        .iter()
        .find(|r| r.endpoint == Some("responses_get"))
        .and_then(|r| r.backend.clone())
        .unwrap();
    let first_on_holder = {
        let mut found = None;
        for id in &ids {
            let resp = get(format!("/v1/responses/{id}")).await.unwrap();
            let rid = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
            let _ = resp.into_body().collect().await;
            if gw.record_of(&rid).await.backend.as_deref() == Some(holder.as_str()) {
                found = Some(id.clone());
                break;
            }
        }
        found.unwrap()
    };
    let (s, v) = admin(
        &gw,
        "POST",
        "/admin/backends/drain",
        Some(&token(fleetgate_gateway::admin::jwt::Role::Admin)),
        Some(json!({"model": "qwen32b", "backend": holder})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let resp = get(format!("/v1/responses/{first_on_holder}"))
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        200,
        "a draining backend still answers for what it holds"
    );
    let body = json!({"model": "qwen32b", "input": "more", "max_output_tokens": 2, "previous_response_id": first_on_holder});
    let m = post(&gw.url("/v1/responses"), &[], Bytes::from(body.to_string())).await;
    assert_eq!(m.status, 503);
    let e = openai_error(&m);
    assert_eq!(e["code"], "response_unavailable");
    assert!(e["message"].as_str().unwrap().contains("draining"), "{e}");
    let _ = Duration::ZERO;
}

/// `background: true`: the POST ends at once while its backend generates on. The work keeps
/// its backend slot and the key's stream until the backend is done (the gateway watches it),
/// its tokens are settled once (with the finished response's usage; reading it back later
/// charges nothing), and reading or cancelling it reaches the backend that runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_responses_hold_their_slots_until_done_and_are_settled_once() {
    let one = sim(|a| {
        a.responses_store = true;
        a.decode_step_ms = 10.0;
    })
    .await;
    let two = sim(|a| {
        a.responses_store = true;
        a.decode_step_ms = 10.0;
    })
    .await;
    let mut p = pool("qwen32b", &[one.url(), two.url()]);
    p.max_in_flight_per_backend = 1;
    let gw = gateway(vec![p]).await;
    let (key, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |k| {
        k.tokens_per_minute = Some(1000);
        k.max_concurrent_streams = Some(1);
    })
    .await;
    let auth = format!("Bearer {key}");
    let h = [("authorization", auth.as_str())];
    let background = |tokens: u32| {
        Bytes::from(
            json!({"model": "qwen32b", "input": "Say something about the license.",
                   "max_output_tokens": tokens, "background": true})
            .to_string(),
        )
    };
    let c = client::http_client();
    let call = |method: &str, path: String, key: Option<&str>| {
        let mut req = http::Request::builder().method(method).uri(gw.url(&path));
        if let Some(k) = key {
            req = req.header("authorization", format!("Bearer {k}"));
        } else {
            req = authed(&gw, method, &path);
        }
        c.request(req.body(http_body_util::Full::new(Bytes::new())).unwrap())
    };
    let read = |resp: http::Response<hyper::body::Incoming>| async move {
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice::<Value>(&body).unwrap())
    };

    // 300 tokens at 10 ms each: answered queued, long before the backend is done.
    let bg = post(&gw.url("/v1/responses"), &h, background(300)).await;
    assert_eq!(bg.status, 200, "{:?}", bg.body);
    let v = json_body(&bg);
    assert_eq!(v["status"], "queued", "{v}");
    assert_eq!(v["background"], true);
    let id = v["id"].as_str().unwrap().to_owned();
    // The key's one stream is the background work's while it runs: the next request of the
    // same key is refused at once.
    let next = post(
        &gw.url("/v1/responses"),
        &h,
        responses_body("qwen32b", 3, false),
    )
    .await;
    assert_eq!(next.status, 429, "{:?}", next.body);
    assert_eq!(openai_error(&next)["code"], "concurrency_limit_exceeded");
    // Reading it back (pinned: the other backend would answer 404) until it is done.
    let mut done = Value::Null;
    for _ in 0..200 {
        let (status, v) = read(
            call("GET", format!("/v1/responses/{id}"), Some(&key))
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        if !matches!(v["status"].as_str(), Some("queued" | "in_progress")) {
            done = v;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(done["status"], "incomplete", "{done}");
    assert_eq!(done["usage"]["output_tokens"], 300, "{done}");
    // Once the backend is done the watcher releases the key's stream: the small request is
    // answered (within a poll or two).
    let mut next_status = 0;
    for _ in 0..100 {
        let next = post(
            &gw.url("/v1/responses"),
            &h,
            responses_body("qwen32b", 3, false),
        )
        .await;
        next_status = next.status;
        if next_status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(next_status, 200, "the key's stream came back");
    // Charged once: 300 + its prompt for the background response (its final usage), the
    // small one's real use, and this request's reservation, less what a few seconds
    // refilled. Charged twice (the reads too) it would be about 300 lower; never settled,
    // about 300 higher.
    let last = post(
        &gw.url("/v1/responses"),
        &h,
        responses_body("qwen32b", 3, false),
    )
    .await;
    assert_eq!(last.status, 200, "{:?}", last.body);
    let remaining: u64 = last.headers["x-ratelimit-remaining-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (600..=850).contains(&remaining),
        "remaining tokens {remaining}: the background response was not charged exactly once"
    );

    // A long one, cancelled while it runs, on the backend that runs it.
    let long = post(&gw.url("/v1/responses"), &[], background(2000)).await;
    assert_eq!(long.status, 200, "{:?}", long.body);
    let long_id = json_body(&long)["id"].as_str().unwrap().to_owned();
    let (status, v) = read(
        call("POST", format!("/v1/responses/{long_id}/cancel"), None)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "cancelled");
    let (status, v) = read(
        call("GET", format!("/v1/responses/{long_id}"), None)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, &v["status"]), (200, &json!("cancelled")), "{v}");
    let (status, v) = read(
        call("POST", format!("/v1/responses/{long_id}/cancel"), None)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 400, "cancelled once: {v}");
    // A streamed background response, replayed from its fourth event by a read that keeps
    // its query (`?stream=true&starting_after=3`), from the backend that holds it.
    let body = json!({"model": "qwen32b", "input": "Say something about the license.",
                      "max_output_tokens": 5, "background": true, "stream": true});
    let streamed = post(&gw.url("/v1/responses"), &[], Bytes::from(body.to_string())).await;
    assert_eq!(streamed.status, 200);
    let sent = events(streamed.body.as_ref().unwrap());
    let sid = sent[0].1["response"]["id"].as_str().unwrap().to_owned();
    let resp = call(
        "GET",
        format!("/v1/responses/{sid}?stream=true&starting_after=3"),
        None,
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let replayed = resp.into_body().collect().await.unwrap().to_bytes();
    let replayed = events(&replayed);
    assert_eq!(replayed.len(), sent.len() - 4, "{replayed:?}");
    assert_eq!(replayed[0].1["sequence_number"], 4);
    assert_eq!(replayed.last().unwrap().0, "response.completed");
    // The backends generate nothing for it any more.
    let (a, b) = (one.stats().clone(), two.stats().clone());
    assert!(
        eventually(Duration::from_secs(5), || a
            .cancelled
            .load(std::sync::atomic::Ordering::SeqCst)
            + b.cancelled.load(std::sync::atomic::Ordering::SeqCst)
            >= 1)
        .await
    );
}

/// A stored response is its key's: another key (even one with rights on the model) is told it
/// does not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_keys_response_does_not_exist_for_it() {
    let sim = sim(|a| a.responses_store = true).await;
    let gw = gateway(vec![pool("qwen32b", &[sim.url()])]).await;
    let m = post(
        &gw.url("/v1/responses"),
        &[],
        responses_body("qwen32b", 2, false),
    )
    .await;
    let id = json_body(&m)["id"].as_str().unwrap().to_owned();
    let (other, _) = issue_key(&gw, fleetgate_gateway::key::Environment::Prod, |_| {}).await;
    let bearer = format!("Bearer {other}");
    let c = client::http_client();
    let req = http::Request::get(gw.url(&format!("/v1/responses/{id}")))
        .header("authorization", &bearer)
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.status(), 404);
    let body = json!({"model": "qwen32b", "input": "more", "max_output_tokens": 2, "previous_response_id": id});
    let m = post(
        &gw.url("/v1/responses"),
        &[("authorization", &bearer)],
        Bytes::from(body.to_string()),
    )
    .await;
    assert_eq!(m.status, 404);
    assert_eq!(openai_error(&m)["code"], "response_not_found");
    // Its own key still reads it.
    let req = authed(&gw, "GET", &format!("/v1/responses/{id}"))
        .body(http_body_util::Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(c.request(req).await.unwrap().status(), 200);
}

/// With `limits.shared = "redis"` a stored response made through one replica is reached
/// through another; without it, that other replica says it does not know it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_redis_share_stored_responses() {
    let Some(redis) = redis_url("replicas_sharing_redis_share_stored_responses").await else {
        return;
    };
    let one = sim(|a| a.responses_store = true).await;
    let two = sim(|a| a.responses_store = true).await;
    let db = temp_dir("pins-db").join("keys.db");
    let prefix = format!("fgtest-pins-{}-{}", std::process::id(), rand_suffix());
    let shared = |c: &mut fleetgate_gateway::config::Config| {
        c.database.sqlite_path = db.clone();
        c.limits.shared = fleetgate_gateway::config::SharedLimits::Redis;
        c.limits.redis = Some(fleetgate_gateway::config::RedisConfig {
            url: fleetgate_gateway::secret::Secret::new(&redis),
            timeout: Duration::from_millis(500),
            replicas: 2,
            key_prefix: prefix.clone(),
        });
    };
    let backends = [one.url(), two.url()];
    let a = gateway_with(vec![pool("qwen32b", &backends)], shared).await;
    let b = gateway_with(vec![pool("qwen32b", &backends)], shared).await;
    let alone = gateway_with(vec![pool("qwen32b", &backends)], |c| {
        c.database.sqlite_path = db.clone();
    })
    .await;
    // One key, known to every replica (one store).
    let key = a.key.clone();
    let bearer = format!("Bearer {key}");
    let c = client::http_client();
    for _ in 0..4 {
        let m = post(
            &a.url("/v1/responses"),
            &[],
            responses_body("qwen32b", 2, false),
        )
        .await;
        assert_eq!(m.status, 200);
        let id = json_body(&m)["id"].as_str().unwrap().to_owned();
        let mut got = 0;
        for _ in 0..50 {
            let req = http::Request::get(b.url(&format!("/v1/responses/{id}")))
                .header("authorization", &bearer)
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap();
            let resp = c.request(req).await.unwrap();
            got = resp.status().as_u16();
            if got == 200 {
                break;
            }

            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(got, 200, "replica b finds {id} through Redis");
        let req = http::Request::get(alone.url(&format!("/v1/responses/{id}")))
            .header("authorization", &bearer)
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        assert_eq!(
            c.request(req).await.unwrap().status(),
            404,
            "a replica without Redis"
        );
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}
