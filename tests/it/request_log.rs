//! The request log: one row per request in the store, written in the background; spilled to
//! disk while PostgreSQL is away and replayed when it is back, every row exactly once.

use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use fleetgate_gateway::secret::Secret;
use fleetgate_protocol::client::chat_body;
use sqlx::Row;

/// The W3C recommendation's own example.
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

async fn rows(store: &fleetgate_gateway::store::KeyStore) -> Vec<sqlx::any::AnyRow> {
    sqlx::query("SELECT * FROM request_log ORDER BY at, row_id")
        .fetch_all(store.pool())
        .await
        .unwrap()
}

async fn wait_rows(store: &fleetgate_gateway::store::KeyStore, n: usize) -> Vec<sqlx::any::AnyRow> {
    for _ in 0..500 {
        let r = rows(store).await;
        if r.len() >= n {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    rows(store).await
}

/// One streamed chat through the gateway at `chat`, tagged `id`; it must succeed.
async fn stream_one(chat: &http::Uri, id: &str) {
    let r = post(
        chat,
        &[("x-request-id", id)],
        chat_body("qwen32b", "hi", 2, true),
    )
    .await;
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_gets_one_consistent_row_on_both_stores() {
    for (db, _guard) in stores("request_log_rows").await {
        let kind = db.kind().as_str();
        let sim = sim(|_| {}).await;
        let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
            c.database = db.clone()
        })
        .await;
        let chat = gw.url("/v1/chat/completions");
        let streamed = Bytes::from(
            serde_json::json!({"model":"qwen32b","stream":true,"max_tokens":6,"messages":[{"role":"user","content":"hello"}]})
                .to_string(),
        );
        assert_eq!(
            post(
                &chat,
                &[
                    ("x-request-id", "log-stream"),
                    ("traceparent", TRACEPARENT),
                    ("tracestate", "rojo=00f067aa0ba902b7")
                ],
                streamed
            )
            .await
            .status,
            200
        );
        assert_eq!(
            post(
                &chat,
                // A malformed traceparent is ignored, never refused.
                &[
                    ("x-request-id", "log-plain"),
                    (
                        "traceparent",
                        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"
                    )
                ],
                chat_body("qwen32b", "hi", 4, false)
            )
            .await
            .status,
            200
        );
        assert_eq!(
            post(
                &chat,
                &[("x-request-id", "log-404"), ("traceparent", TRACEPARENT)],
                chat_body("nope", "hi", 4, true)
            )
            .await
            .status,
            404
        );
        // The agents' protocols share the log, named by their endpoint.
        let responses = Bytes::from(
            serde_json::json!({"model":"qwen32b","stream":true,"max_output_tokens":5,"input":"hello"})
                .to_string(),
        );
        let m = post(
            &gw.url("/v1/responses"),
            &[("x-request-id", "log-responses")],
            responses,
        )
        .await;
        assert_eq!(m.status, 200);
        let messages = Bytes::from(
            serde_json::json!({"model":"qwen32b","max_tokens":3,"messages":[{"role":"user","content":"hello"}]})
                .to_string(),
        );
        let m = post(
            &gw.url("/v1/messages"),
            &[("x-request-id", "log-messages")],
            messages,
        )
        .await;
        assert_eq!(m.status, 200);
        let store = gw.server.auth.store().clone();
        let all = wait_rows(&store, 5).await;
        assert_eq!(all.len(), 5, "{kind}: one row per request");
        let by_id = |id: &str| {
            all.iter()
                .find(|r| r.get::<String, _>("request_id") == id)
                .unwrap()
        };

        for (id, endpoint, tokens) in [
            ("log-stream", "chat", 6),
            ("log-plain", "chat", 4),
            ("log-responses", "responses", 5),
            ("log-messages", "messages", 3),
        ] {
            let r = by_id(id);
            assert_eq!(
                r.get::<Option<String>, _>("endpoint").as_deref(),
                Some(endpoint),
                "{kind} {id}"
            );
            assert_eq!(
                r.get::<Option<i64>, _>("completion_tokens"),
                Some(tokens),
                "{kind} {id}"
            );
            assert_eq!(r.get::<String, _>("usage_source"), "backend", "{kind} {id}");
            assert!(
                r.get::<Option<i64>, _>("prompt_tokens").unwrap() > 0,
                "{kind} {id}"
            );
        }
        assert!(
            by_id("log-responses")
                .get::<Option<i64>, _>("upstream_ttft_us")
                .is_some()
        );
        // The client's W3C trace, on its rows: a refused request's too; none for a malformed
        // traceparent or none at all.
        for (id, trace) in [
            ("log-stream", Some("4bf92f3577b34da6a3ce929d0e0e4736")),
            ("log-404", Some("4bf92f3577b34da6a3ce929d0e0e4736")),
            ("log-plain", None),
            ("log-messages", None),
        ] {
            assert_eq!(
                by_id(id).get::<Option<String>, _>("trace_id").as_deref(),
                trace,
                "{kind} {id}"
            );
        }

        let s = by_id("log-stream");
        assert_eq!(s.get::<i32, _>("status"), 200, "{kind}");
        assert_eq!(s.get::<i32, _>("stream"), 1);
        assert_eq!(
            s.get::<Option<i64>, _>("completion_tokens"),
            Some(6),
            "{kind}: usage learned"
        );
        assert_eq!(s.get::<String, _>("usage_source"), "backend");
        assert!(s.get::<Option<i64>, _>("prompt_tokens").unwrap() > 0);
        assert_eq!(
            s.get::<Option<String>, _>("environment").as_deref(),
            Some("stress")
        );
        assert_eq!(
            s.get::<Option<String>, _>("model").as_deref(),
            Some("qwen32b")
        );
        assert_eq!(s.get::<Option<String>, _>("backend"), Some(sim.url()));
        assert_eq!(
            s.get::<Option<String>, _>("client_addr").as_deref(),
            Some("127.0.0.1")
        );
        let key_id = fleetgate_gateway::key::parse(&gw.key)
            .unwrap()
            .public_id
            .to_owned();
        assert_eq!(s.get::<Option<String>, _>("key_id"), Some(key_id));
        let up = s.get::<Option<i64>, _>("upstream_ttft_us").unwrap();
        let client = s.get::<Option<i64>, _>("client_ttft_us").unwrap();
        let pre = s.get::<Option<i64>, _>("overhead_pre_us").unwrap();
        let e2el = s.get::<Option<i64>, _>("e2el_us").unwrap();
        assert!(
            up <= client && client <= e2el && pre >= 0,
            "{kind}: {up} {client} {e2el} {pre}"
        );
        assert_eq!(s.get::<i32, _>("content_events"), 6);
        // The hop cost, from the kernel's stamps (Linux): at most what the client saw less what
        // the backend took, plus the time the request waited in the kernel.
        if fleetgate_gateway::rx_time::SUPPORTED {
            let hop = s.get::<Option<i64>, _>("hop_us");
            assert!(
                hop.is_some_and(|h| h >= 0 && h < client - up + 50_000),
                "{kind}: hop_us {hop:?} (client {client}, upstream {up})"
            );
        }
        assert!(
            s.get::<Option<i64>, _>("itl_p99_us").unwrap()
                <= s.get::<Option<i64>, _>("itl_max_us").unwrap()
        );

        let p = by_id("log-plain");
        assert_eq!(p.get::<i32, _>("stream"), 0);
        if fleetgate_gateway::rx_time::SUPPORTED {
            assert!(p.get::<Option<i64>, _>("hop_us").is_some(), "{kind}");
        }
        assert_eq!(
            by_id("log-404").get::<Option<i64>, _>("hop_us"),
            None,
            "{kind}: no backend, no hop"
        );
        let e = by_id("log-404");
        assert_eq!(e.get::<i32, _>("status"), 404);
        assert_eq!(
            e.get::<Option<String>, _>("error").as_deref(),
            Some("model_not_found")
        );
        assert_eq!(e.get::<Option<String>, _>("model"), None);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_during_an_outage_are_spilled_and_replayed_exactly_once() {
    let Some(db) = pg_database("request_log_outage").await else {
        return;
    };
    let admin_url: http::Uri = pg_admin_url().parse().unwrap();
    let upstream =
        std::net::SocketAddr::from(([127, 0, 0, 1], admin_url.port_u16().unwrap_or(5432)));
    let proxy = Cuttable::start(0, upstream).await;
    let via_proxy = db.url.replacen(
        &format!(":{}/", upstream.port()),
        &format!(":{}/", proxy.port),
        1,
    );
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.database.url = Some(Secret::new(via_proxy.clone()));
        // Short, so the outage is noticed soon, but room for the first connect and the
        // migrations through the proxy on a loaded machine (500 ms timed out in a full run).
        c.database.connect_timeout = Duration::from_secs(2);
    })
    .await;
    let spill = gw.db_dir.0.join("request-log.spill");
    // A direct view of the same database, not through the proxy.
    let direct =
        fleetgate_gateway::store::KeyStore::connect(&fleetgate_gateway::config::DatabaseConfig {
            url: Some(Secret::new(db.url.clone())),
            ..Default::default()
        })
        .await
        .unwrap();
    let chat = gw.url("/v1/chat/completions");
    for i in 0..5 {
        stream_one(&chat, &format!("before-{i}")).await;
    }
    assert_eq!(wait_rows(&direct, 5).await.len(), 5);

    let port = proxy.cut();
    for i in 0..10 {
        let id = format!("during-{i}");
        assert_eq!(
            post(
                &chat,
                &[("x-request-id", &id)],
                chat_body("qwen32b", "hi", 2, true)
            )
            .await
            .status,
            200,
            "requests go on while the log's database is away"
        );
    }
    let spill_check = spill.clone();
    assert!(
        eventually(Duration::from_secs(15), || std::fs::read_to_string(
            &spill_check
        )
        .map_or(0, |t| t.lines().count())
            == 10)
        .await,
        "the rows were not spilled"
    );
    let _proxy = Cuttable::start(port, upstream).await;
    let all = wait_rows(&direct, 15).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let all_again = rows(&direct).await;
    assert_eq!(all.len(), 15);
    assert_eq!(all_again.len(), 15, "no row twice");
    let mut ids: Vec<String> = all_again
        .iter()
        .map(|r| r.get::<String, _>("request_id"))
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 15);
    assert!(
        eventually(Duration::from_secs(5), || !spill.exists()).await,
        "the spill file is removed once replayed"
    );
    drop(gw);
    drop(db);
}

/// `GET /admin/usage?<query>` with `token`: the JSON of a 200.
async fn admin_usage(gw: &Gateway, token: &str, query: &str) -> serde_json::Value {
    use http_body_util::BodyExt;
    let req = http::Request::get(format!(
        "http://{}/admin/usage?{query}",
        gw.server.admin_addr.unwrap()
    ))
    .header("authorization", format!("Bearer {token}"))
    .body(http_body_util::Full::new(Bytes::new()))
    .unwrap();
    let resp = fleetgate_protocol::client::http_client()
        .request(req)
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap()
}

/// Reading the log back, through the CLI and the admin API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_reads_the_log_back() {
    let sim = sim(|_| {}).await;
    let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
        c.admin.jwt_key = Some(fleetgate_gateway::config::JwtKey::Secret(Secret::new(
            "usage-test-secret-0123456789abcdef",
        )));
    })
    .await;
    let chat = gw.url("/v1/chat/completions");
    for _ in 0..3 {
        assert_eq!(
            post(&chat, &[], chat_body("qwen32b", "hi", 5, true))
                .await
                .status,
            200
        );
    }
    assert_eq!(
        post(&chat, &[], chat_body("nope", "hi", 5, true))
            .await
            .status,
        404
    );
    let store = gw.server.auth.store().clone();
    assert_eq!(wait_rows(&store, 4).await.len(), 4);

    let db = gw.db_dir.0.join("keys.db");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fleetgate"))
        .args(["usage", "--sqlite"])
        .arg(&db)
        .args(["--by", "model", "--since", "1h", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let groups = v["groups"].as_array().unwrap();
    let model = groups.iter().find(|g| g["group"] == "qwen32b").unwrap();
    assert_eq!(model["requests"], 3);
    assert_eq!(model["errors"], 0);
    assert_eq!(model["completion_tokens"], 15);
    assert!(
        model["client_ttft_ms"]["p99"].as_f64().unwrap()
            >= model["client_ttft_ms"]["p50"].as_f64().unwrap()
    );
    assert!(model["overhead_ms"]["p50"].as_f64().is_some());
    // The requests refused before routing: named as such (the console's word for the keyless
    // group is "no key").
    let none = groups.iter().find(|g| g["group"] == "no model").unwrap();
    assert_eq!(
        (none["requests"].as_u64(), none["errors"].as_u64()),
        (Some(1), Some(1))
    );

    let token = fleetgate_gateway::admin::jwt::mint(
        &fleetgate_gateway::config::AdminConfig {
            jwt_key: Some(fleetgate_gateway::config::JwtKey::Secret(Secret::new(
                "usage-test-secret-0123456789abcdef",
            ))),
            ..Default::default()
        },
        fleetgate_gateway::admin::jwt::Role::Viewer,
        "t",
        Duration::from_secs(60),
    )
    .unwrap();
    let v = admin_usage(&gw, &token, "by=env&since=1h").await;
    let stress = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["group"] == "stress")
        .unwrap();
    assert_eq!(stress["requests"], 4);
    assert_eq!(stress["errors"], 1);
    assert!(stress.get("key_name").is_none(), "only grouped by key");

    // By key: each key's name and environment beside its id.
    let v = admin_usage(&gw, &token, "by=key&since=1h").await;
    let id = fleetgate_gateway::key::parse(&gw.key)
        .unwrap()
        .public_id
        .to_owned();
    let mine = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["group"] == id.as_str())
        .unwrap_or_else(|| panic!("{v}"));
    assert_eq!(mine["key_environment"], "stress", "{mine}");
    assert!(mine["key_name"].is_string(), "{mine}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fleetgate"))
        .args(["usage", "--by", "key", "--since", "1h", "--sqlite"])
        .arg(gw.db_dir.0.join("keys.db"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    // A header over every column, the key's environment and name included.
    let header = text.lines().nth(1).unwrap_or_default();
    for column in ["KEY", "REQUESTS", "ERRORS", "TTFT ms", "ENV", "NAME"] {
        assert!(header.contains(column), "{column} in {text}");
    }
    assert!(
        header.ends_with(&format!("{:<6}  NAME", "ENV")),
        "{header:?}"
    );
    let line = text
        .lines()
        .find(|l| l.starts_with(&id))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains(&format!("  stress  {}", mine["key_name"].as_str().unwrap())),
        "{text}"
    );
}

/// The writer does not wake for every row: a partial batch waits for the flush interval, a
/// full one is written at once, and what is still queued at shutdown is written then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_batch_is_written_at_once_a_partial_one_at_the_interval_or_at_shutdown() {
    for (db, _guard) in stores("request_log_batches").await {
        let kind = db.kind().as_str();
        let sim = sim(|a| a.decode_step_ms = 0.0).await;
        let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
            c.database = db.clone();
            c.request_log.batch_rows = 4;
            c.request_log.flush_interval = Duration::from_secs(3600);
        })
        .await;
        let store = gw.server.auth.store().clone();
        let chat = gw.url("/v1/chat/completions");
        for i in 0..4 {
            stream_one(&chat, &format!("full-{i}")).await;
        }
        assert_eq!(
            wait_rows(&store, 4).await.len(),
            4,
            "{kind}: a full batch is written without waiting an hour"
        );
        stream_one(&chat, "partial").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            rows(&store).await.len(),
            4,
            "{kind}: one row waits for its batch to fill or the interval to pass"
        );
        gw.server.shutdown().await;
        let all = rows(&store).await;
        assert_eq!(
            all.len(),
            5,
            "{kind}: the queued row is written at shutdown"
        );
        assert!(
            all.iter()
                .any(|r| r.get::<String, _>("request_id") == "partial")
        );
    }
}

/// Connections the request log's writer holds open.
fn writer_connections(store: &fleetgate_gateway::store::KeyStore) -> u32 {
    match store.bulk() {
        fleetgate_gateway::store::BulkPool::Postgres(p) => p.size(),
        fleetgate_gateway::store::BulkPool::Sqlite(p) => p.size(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_closes_its_connection_when_idle_and_opens_one_for_the_next_batch() {
    use fleetgate_gateway::store::BULK_IDLE;
    for (db, _guard) in stores("request_log_idle").await {
        let kind = db.kind().as_str();
        let sim = sim(|a| a.decode_step_ms = 0.0).await;
        let gw = gateway_with(vec![pool("qwen32b", &[sim.url()])], |c| {
            c.database = db.clone();
            c.request_log.flush_interval = Duration::from_millis(20);
        })
        .await;
        let store = gw.server.auth.store().clone();
        let chat = gw.url("/v1/chat/completions");
        assert_eq!(writer_connections(&store), 0, "{kind}: connected lazily");
        stream_one(&chat, "before-idle").await;
        assert_eq!(wait_rows(&store, 1).await.len(), 1, "{kind}");
        assert_eq!(
            writer_connections(&store),
            1,
            "{kind}: the batch opened the writer's connection"
        );
        // sqlx looks for idle connections every BULK_IDLE: closed within two of them.
        let deadline = tokio::time::Instant::now() + BULK_IDLE * 3;
        while writer_connections(&store) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            writer_connections(&store),
            0,
            "{kind}: an idle writer gives its connection (and SQLite's page cache) back"
        );
        stream_one(&chat, "after-idle").await;
        let all = wait_rows(&store, 2).await;
        assert_eq!(
            all.iter()
                .map(|r| r.get::<String, _>("request_id"))
                .collect::<Vec<_>>(),
            ["before-idle", "after-idle"],
            "{kind}: the next batch opens a connection and is stored"
        );
    }
}

/// One spilled row, as an older process would have written it to its spill file (a minute
/// ago: well inside the log's retention, which the writer applies as it starts).
fn spilled_row(i: i64) -> fleetgate_gateway::telemetry::request_log::row::SpillRow {
    let minute_ago = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
        - 60_000;
    fleetgate_gateway::telemetry::request_log::row::SpillRow {
        row_id: format!("0a1b2c3d0042-{i:x}"),
        at: minute_ago + i,
        request_id: format!("spilled-{i}"),
        key_id: Some("AbCdEfGhIjKl".into()),
        environment: Some("prod".into()),
        model: Some("qwen32b".into()),
        backend: Some("http://10.0.0.5:8000".into()),
        status: 200,
        error: None,
        stream: true,
        prompt_tokens: Some(5),
        completion_tokens: Some(16),
        usage_source: "backend".into(),
        queue_wait_us: Some(0),
        upstream_ttft_us: Some(1000),
        client_ttft_us: Some(1100),
        overhead_pre_us: Some(40),
        overhead_relay_us: Some(20),
        hop_us: Some(90),
        e2el_us: Some(9000),
        tpot_us: Some(500),
        itl_mean_us: Some(500),
        itl_p99_us: Some(700),
        itl_max_us: Some(800),
        content_events: 16,
        client_addr: Some("10.1.2.3".into()),
        endpoint: Some("responses".into()),
        trace_id: Some(format!("{i:032x}")),
        predicted_cached_tokens: Some(4),
        cached_tokens: Some(3),
        resumes: Some(1),
        resume_detail: Some(
            r#"{"parts":[{"backend":"http://10.0.0.4:8000","cause":"closed","tokens":7}]}"#.into(),
        ),
        fleet_tokens: Some(33),
        fallback_from: Some("big".into()),
        fallback_detail: Some(r#"[{"model":"big","cause":"no_backend"}]"#.into()),
    }
}

/// Start a writer on `db` with `rows` in its spill file; return when the file is replayed.
async fn replay_spill(
    store: &fleetgate_gateway::store::KeyStore,
    dir: &std::path::Path,
    rows: &[fleetgate_gateway::telemetry::request_log::row::SpillRow],
) {
    let spill = dir.join("request-log.spill");
    let mut text = String::new();
    for r in rows {
        text.push_str(&serde_json::to_string(r).unwrap());
        text.push('\n');
    }
    // What a full disk leaves behind: a row cut short. Counted as dropped, not skipped.
    text.push_str("{\"row_id\":\"0a1b2c3d0042-ff\",\"at\":17");
    std::fs::write(&spill, text).unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let tasks = tokio_util::task::TaskTracker::new();
    let config = fleetgate_gateway::config::RequestLogConfig {
        spill_path: spill.clone(),
        ..Default::default()
    };
    let log = fleetgate_gateway::telemetry::request_log::start(
        store.clone(),
        config,
        &prometheus::Registry::new(),
        stop.clone(),
        &tasks,
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || !spill.exists()).await,
        "the spill file was not replayed"
    );
    assert_eq!(
        log.dropped(),
        1,
        "the unreadable line is counted as dropped"
    );
    stop.cancel();
    tasks.close();
    tasks.wait().await;
}

/// A spill file replayed twice (the process stopped between the replay's commit and the file's
/// removal) stores each row once, on both stores; SQLite finds stored rows without a unique
/// index on the row id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spill_file_replayed_twice_stores_each_row_once() {
    for (db, _guard) in stores("request_log_replay_twice").await {
        let store = fleetgate_gateway::store::KeyStore::connect(&db)
            .await
            .unwrap();
        store.migrate().await.unwrap();
        let dir = TempDir(temp_dir("replay-twice"));
        let first: Vec<_> = (0..3).map(spilled_row).collect();
        replay_spill(&store, &dir.0, &first).await;
        assert_eq!(rows(&store).await.len(), 3, "{}", db.kind().as_str());
        // The same three again, and two new ones (one at the same millisecond as a stored one).
        let mut again = first.clone();
        let mut same_ms = spilled_row(7);
        same_ms.at = first[1].at;
        again.push(same_ms);
        again.push(spilled_row(8));
        replay_spill(&store, &dir.0, &again).await;
        let stored = rows(&store).await;
        let mut ids: Vec<String> = stored.iter().map(|r| r.get("request_id")).collect();
        ids.sort();
        assert_eq!(
            ids,
            [
                "spilled-0",
                "spilled-1",
                "spilled-2",
                "spilled-7",
                "spilled-8"
            ],
            "{}",
            db.kind().as_str()
        );
        let r = &stored[0];
        assert_eq!(r.get::<i64, _>("hop_us"), 90);
        assert_eq!(
            r.get::<Option<String>, _>("client_addr").as_deref(),
            Some("10.1.2.3")
        );
        let request = r.get::<String, _>("request_id");
        let i: i64 = request.trim_start_matches("spilled-").parse().unwrap();
        assert_eq!(
            r.get::<Option<String>, _>("trace_id"),
            Some(format!("{i:032x}")),
            "a replayed row keeps its trace"
        );
        assert_eq!(
            (
                r.get::<Option<i64>, _>("predicted_cached_tokens"),
                r.get::<Option<i64>, _>("cached_tokens")
            ),
            (Some(4), Some(3)),
            "a replayed row keeps the cache's belief and truth"
        );
        assert_eq!(
            (
                r.get::<Option<i32>, _>("resumes"),
                r.get::<Option<String>, _>("resume_detail"),
                r.get::<Option<i64>, _>("fleet_tokens")
            ),
            (
                Some(1),
                Some(
                    r#"{"parts":[{"backend":"http://10.0.0.4:8000","cause":"closed","tokens":7}]}"#
                        .into()
                ),
                Some(33)
            ),
            "a replayed row keeps how its stream was resumed"
        );
    }
}

/// Two processes opening one new SQLite file at once (a `serve` starting while `keys create`
/// runs, as the README's steps do) both migrate it: SQLite has no migration lock, and the
/// slower one used to fail on a step the other had applied ("table request_log_new has 26
/// columns but 27 values were supplied").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_of_one_sqlite_file_both_succeed() {
    for round in 0..8 {
        let dir = TempDir(temp_dir(&format!("migrate-race-{round}")));
        let db = fleetgate_gateway::config::DatabaseConfig {
            sqlite_path: dir.0.join("fresh.db"),
            ..Default::default()
        };
        let stores: Vec<_> = futures_util::future::join_all(
            (0..3).map(|_| fleetgate_gateway::store::KeyStore::connect(&db)),
        )
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
        let results = futures_util::future::join_all(stores.iter().map(|s| s.migrate())).await;
        for r in &results {
            assert!(r.is_ok(), "round {round}: {results:?}");
        }
        assert_eq!(rows(&stores[0]).await.len(), 0);
    }
}

/// Upgrading an SQLite store whose request log still has the row-id primary key keeps every
/// row, and leaves the table with only its two time indexes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrading_the_sqlite_request_log_keeps_its_rows() {
    let dir = TempDir(temp_dir("log-upgrade"));
    let db = fleetgate_gateway::config::DatabaseConfig {
        sqlite_path: dir.0.join("old.db"),
        ..Default::default()
    };
    let store = fleetgate_gateway::store::KeyStore::connect(&db)
        .await
        .unwrap();
    // The store as the release before this migration left it.
    let mut before = sqlx::migrate!("./migrations/sqlite");
    let upto = before
        .migrations
        .iter()
        .position(|m| m.description == "request log rowid")
        .expect("the migration that drops the row-id index");
    before.migrations = std::borrow::Cow::Owned(before.migrations[..upto].to_vec());
    before.run(store.pool()).await.unwrap();
    for i in 0..2i64 {
        sqlx::query(
            "INSERT INTO request_log (row_id, at, request_id, status, stream, usage_source, \
             content_events, hop_us) VALUES (?, ?, ?, 200, 1, 'backend', 3, 77)",
        )
        .bind(format!("old-{i}"))
        .bind(1_700_000_000_000 + i)
        .bind(format!("old-request-{i}"))
        .execute(store.pool())
        .await
        .unwrap();
    }
    store.migrate().await.unwrap();
    // Read back as the upgraded gateway would, on new connections: a pooled SQLite connection
    // that last saw the old schema re-prepares `SELECT *` with more columns than sqlx sized
    // the row for (the test's `SELECT *`; the gateway names its columns).
    drop(store);
    let store = fleetgate_gateway::store::KeyStore::connect(&db)
        .await
        .unwrap();
    let stored = rows(&store).await;
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[1].get::<String, _>("request_id"), "old-request-1");
    assert_eq!(stored[1].get::<i64, _>("hop_us"), 77);
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'request_log' \
         ORDER BY name",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(indexes, ["request_log_at", "request_log_key_at"]);
}
