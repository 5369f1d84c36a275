//! The Requests page: a request found by its request id or by its W3C trace id, on both
//! stores.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_found_by_its_request_id_or_its_trace_id() {
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    for (db, _guard) in stores("console_requests").await {
        let kind = db.kind().as_str();
        let (_sim, gw, admin) = console_gateway(Some(db.clone())).await;
        let (cookie, _) = sign_in(admin, Role::Viewer).await;
        let (key, _) = issue_key(&gw, Environment::Prod, |_| {}).await;
        let auth = format!("Bearer {key}");
        let chat = gw.url("/v1/chat/completions");
        let traceparent = format!("00-{TRACE}-00f067aa0ba902b7-01");
        let m = post(
            &chat,
            &[
                ("authorization", &auth),
                ("x-request-id", "console-traced"),
                ("traceparent", &traceparent),
            ],
            chat_body(),
        )
        .await;
        assert_eq!(m.status, 200);
        let m = post(
            &chat,
            &[("authorization", &auth), ("x-request-id", "console-plain")],
            chat_body(),
        )
        .await;
        assert_eq!(m.status, 200);
        // The rows reach the store in the background.
        let mut latest = String::new();
        for _ in 0..250 {
            latest = page_ok(admin, &cookie, "/console/requests").await;
            if latest.contains("console-traced") && latest.contains("console-plain") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(latest.contains("console-plain"), "{kind}: {latest}");
        assert!(latest.contains("console-traced"), "{kind}: {latest}");

        // By trace id: the traced request only, with its trace linked.
        let by_trace = page_ok(admin, &cookie, format!("/console/requests?q={TRACE}")).await;
        assert!(by_trace.contains("console-traced"), "{kind}: {by_trace}");
        assert!(!by_trace.contains("console-plain"), "{kind}: {by_trace}");
        assert!(
            by_trace.contains(&format!("href=\"/console/requests?q={TRACE}\"")),
            "{kind}: {by_trace}"
        );
        // By request id: its trace id shown.
        let by_id = page_ok(admin, &cookie, "/console/requests?q=console-traced").await;
        assert!(by_id.contains(TRACE), "{kind}: {by_id}");
        // Nothing found says so, and what was typed is escaped.
        let none = page_ok(admin, &cookie, "/console/requests?q=%3Cscript%3Ex").await;
        assert!(none.contains("id=\"no-requests\""), "{kind}: {none}");
        assert!(!none.contains("<script>x"), "{kind}: {none}");
        assert!(none.contains("&lt;script&gt;x"), "{kind}: {none}");
    }
}
