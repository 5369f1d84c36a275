//! The console's time windows follow the data.

use super::*;

/// The console's charts: the overview's window follows the data (a few requests
/// just now are drawn over 5 minutes, not squashed into the edge of an hour) and says itself;
/// a key whose traffic was yesterday opens on yesterday — its window ending at its last
/// request, said on the page — with a hop chart beside TTFT and processing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_windows_follow_the_data() {
    for (db, _guard) in stores("console_windows").await {
        let kind = db.kind().as_str();
        let (_sim, gw, admin) = console_gateway(Some(db.clone())).await;
        let (cookie, _) = sign_in(admin, Role::Viewer).await;

        // The overview: three requests just now.
        let (key, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
        let auth = format!("Bearer {key}");
        let chat = gw.url("/v1/chat/completions");
        for _ in 0..3 {
            let m = post(&chat, &[("authorization", &auth)], chat_body()).await;
            assert_eq!(m.status, 200);
        }
        let mut charts = String::new();
        for _ in 0..500 {
            charts = page_ok(admin, &cookie, "/console/charts").await;
            if charts.contains("data-env=\"prod\"><td><span class=\"env prod\">prod</span></td><td class=\"num\">3<") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            charts.contains(">3<"),
            "{kind}: the log has the 3 requests: {charts}"
        );
        // Drawn over 5 minutes in 10-second buckets, and the page says so on each chart.
        assert_eq!(
            charts.matches("per 10 s, ").count(),
            5,
            "{kind}: every chart says its window: {charts}"
        );
        assert!(charts.contains(" UTC (5 min)"), "{charts}");
        assert!(
            charts.contains("From the request log, ") && !charts.contains("-1h"),
            "{charts}"
        );
        // Hop and processing in µs, TTFT in ms, in the table as in the charts.
        for unit in ["TTFT p50 (ms)", "hop p50 (µs)", "processing p99 (µs)"] {
            assert!(charts.contains(unit), "{unit}: {charts}");
        }

        // A gray key whose 40 requests, one a minute, ended 26 hours ago.
        let (_, quiet) = issue_key(&gw, Environment::Gray, |c| c.name = "yesterday".into()).await;
        let id = quiet.public_id.to_string();
        let last = fleetgate_gateway::clock::wall_ms() - 26 * 3_600_000;
        for i in 0..40i64 {
            sqlx::query(
                "INSERT INTO request_log (row_id, at, request_id, key_id, environment, status, \
                 stream, usage_source, content_events, client_ttft_us, overhead_pre_us, \
                 overhead_relay_us, hop_us) \
                 VALUES ($1, $2, $3, $4, 'gray', 200, 1, 'backend', 3, $5, 90, 30, $6)",
            )
            .bind(format!("yesterday-{i}"))
            .bind(last - (39 - i) * 60_000)
            .bind(format!("request-{i}"))
            .bind(id.clone())
            .bind(150_000 + i * 1000)
            .bind(40 + i)
            .execute(gw.server.auth.store().pool())
            .await
            .unwrap_or_else(|e| panic!("{kind}: insert: {e}"));
        }
        let page = page_ok(admin, &cookie, format!("/console/keys/{id}")).await;
        let note = page
            .split("id=\"usage-note\">")
            .nth(1)
            .and_then(|s| s.split("</p>").next())
            .unwrap_or_else(|| panic!("{kind}: no usage note: {page}"));
        let last_text = fleetgate_gateway::clock::format_wall_ms(last);
        assert!(
            note.contains(&format!(
                "the window ends at its last request, {last_text} (1 d 2 h ago)"
            )),
            "{kind}: {note}"
        );
        // 39 minutes and a bit: 40 one-minute buckets, on yesterday's date.
        assert!(note.contains(" (40 min)."), "{kind}: {note}");
        // The window starts on the day of its first request (the 40 minutes may cross
        // midnight, when the page names both days).
        let first_text = fleetgate_gateway::clock::format_wall_ms(last - 39 * 60_000);
        let first_day = &first_text[..10];
        assert!(
            page.contains(&format!("per minute, {first_day} ")),
            "{kind}: the charts say the day: {page}"
        );
        assert!(page.contains("id=\"usage-requests\">40<"), "{kind}: {page}");
        // The hop chart, p50 solid and p99 dashed, in µs like the percentiles table.
        let hop = page
            .split("id=\"key-chart-hop\"")
            .nth(1)
            .and_then(|s| s.split("</figure>").next())
            .unwrap_or_else(|| panic!("{kind}: no hop chart: {page}"));
        assert!(hop.contains("(µs)"), "{hop}");
        assert_eq!(
            hop.matches("<path class=\"series gray\"").count(),
            2,
            "{hop}"
        );
        assert!(hop.contains("stroke-dasharray=\"5 3\""), "{hop}");
        assert!(
            page.contains("<tr data-figure=\"hop\"><td>hop (added TTFT)</td><td class=\"unit\">µs</td><td class=\"num\">59.0<"),
            "{kind}: hop p50 of 40..=79 µs: {page}"
        );
        // Asked for the last hour: nothing, and the page says when its last request was.
        let hour = page_ok(admin, &cookie, format!("/console/keys/{id}?since=1h")).await;
        assert!(
            hour.contains(&format!(
                "No request in the last hour; its last request was at {last_text}"
            )) && hour.contains(&format!("href=\"/console/keys/{id}?since=latest\"")),
            "{kind}: {hour}"
        );
        // A key without any request says that, too.
        let (_, fresh) = issue_key(&gw, Environment::Stress, |_| {}).await;
        let none = page_ok(admin, &cookie, format!("/console/keys/{}", fresh.public_id)).await;
        assert!(
            none.contains("No request with this key is in the request log."),
            "{kind}: {none}"
        );
    }
}
