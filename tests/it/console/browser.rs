//! The operator's whole path in a real headless Chromium driven through chromedriver (skipped
//! loudly without Debian's `chromium` and `chromium-driver`, a failure under `CI=true`).

use super::*;

/// chromedriver on a free port, stopped when dropped.
struct Driver {
    child: std::process::Child,
    port: u16,
    _profile: TempDir,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Debian's chromium and chromedriver, or `None` with a loud skip (a failure under CI=true).
fn browser_installed() -> bool {
    let missing: Vec<&str> = ["/usr/bin/chromium", "/usr/bin/chromedriver"]
        .into_iter()
        .filter(|p| !std::path::Path::new(p).exists())
        .collect();
    if missing.is_empty() {
        return true;
    }
    let why = format!(
        "{} not installed (apt-get install chromium chromium-driver; .ci/run does)",
        missing.join(" and ")
    );
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("the console's browser test needs Chromium under CI=true: {why}");
    }
    eprintln!("\n*** SKIPPED console_in_a_real_browser: {why} ***\n");
    false
}

async fn start_driver() -> Driver {
    let port = closed_port().await.port();
    let profile = TempDir(temp_dir("chromium"));
    let child = std::process::Command::new("/usr/bin/chromedriver")
        .arg(format!("--port={port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("chromedriver: {e}"));
    let driver = Driver {
        child,
        port,
        _profile: profile,
    };
    wait_for_200(&format!("http://127.0.0.1:{port}/status")).await;
    driver
}

/// The browser's console since the last read, as (level, message).
#[derive(Debug)]
struct BrowserLog;

impl fantoccini::wd::WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(
        &self,
        base_url: &url::Url,
        session_id: Option<&str>,
    ) -> Result<url::Url, url::ParseError> {
        base_url.join(&format!(
            "session/{}/se/log",
            session_id.unwrap_or_default()
        ))
    }

    fn method_and_body(&self, _: &url::Url) -> (http::Method, Option<String>) {
        (http::Method::POST, Some(r#"{"type":"browser"}"#.to_owned()))
    }
}

struct Browser {
    client: fantoccini::Client,
    base: String,
    shots: Option<std::path::PathBuf>,
}

impl Browser {
    async fn goto(&self, path: &str) {
        self.client
            .goto(&format!("{}{path}", self.base))
            .await
            .unwrap_or_else(|e| panic!("goto {path}: {e}"));
    }

    async fn css(&self, selector: &str) -> fantoccini::elements::Element {
        match self
            .client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(fantoccini::Locator::Css(selector))
            .await
        {
            Ok(e) => e,
            Err(e) => {
                let url = self.client.current_url().await.map(|u| u.to_string());
                let text = match self.client.find(fantoccini::Locator::Css("body")).await {
                    Ok(body) => body.text().await.unwrap_or_default(),
                    Err(_) => String::new(),
                };
                panic!("{selector}: {e}; the page {url:?} reads:\n{text}")
            }
        }
    }

    async fn absent(&self, selector: &str) -> bool {
        self.client
            .find_all(fantoccini::Locator::Css(selector))
            .await
            .unwrap_or_else(|e| panic!("{selector}: {e}"))
            .is_empty()
    }

    async fn text(&self, selector: &str) -> String {
        self.css(selector)
            .await
            .text()
            .await
            .unwrap_or_else(|e| panic!("text of {selector}: {e}"))
    }

    async fn fill(&self, selector: &str, value: &str) {
        let e = self.css(selector).await;
        e.clear()
            .await
            .unwrap_or_else(|e| panic!("clear {selector}: {e}"));
        e.send_keys(value)
            .await
            .unwrap_or_else(|e| panic!("type into {selector}: {e}"));
    }

    async fn click(&self, selector: &str) {
        self.css(selector)
            .await
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {selector}: {e}"));
    }

    /// The browser's console since the last call.
    async fn log(&self) -> Vec<(String, String)> {
        let v = self
            .client
            .issue_cmd(BrowserLog)
            .await
            .unwrap_or_else(|e| panic!("browser log: {e}"));
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|e| {
                        (
                            e["level"].as_str().unwrap_or_default().to_owned(),
                            e["message"].as_str().unwrap_or_default().to_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// No error, warning or CSP report in the browser's console since the last check.
    async fn no_console_errors(&self, page: &str) {
        let bad: Vec<_> = self
            .log()
            .await
            .into_iter()
            .filter(|(level, message)| {
                level != "INFO" && level != "DEBUG" || message.contains("Content Security Policy")
            })
            .collect();
        assert!(bad.is_empty(), "{page}: the browser's console: {bad:?}");
    }

    async fn shot(&self, name: &str) {
        let Some(dir) = &self.shots else { return };
        let png = self
            .client
            .screenshot()
            .await
            .unwrap_or_else(|e| panic!("screenshot: {e}"));
        std::fs::write(dir.join(format!("{name}.png")), png)
            .unwrap_or_else(|e| panic!("write screenshot: {e}"));
    }
}

async fn open_browser(driver: &Driver, base: String) -> Browser {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--disable-quic", "--window-size=1360,1500",
                format!("--user-data-dir={}", driver._profile.0.display()),
            ],
        }),
    );
    caps.insert(
        "goog:loggingPrefs".into(),
        serde_json::json!({"browser": "ALL"}),
    );
    let client =
        fantoccini::ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", driver.port))
            .await
            .unwrap_or_else(|e| panic!("chromium via chromedriver: {e}"));
    let shots = std::env::var_os("FLEETGATE_CONSOLE_SCREENSHOTS").map(std::path::PathBuf::from);
    if let Some(d) = &shots {
        std::fs::create_dir_all(d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    }
    Browser {
        client,
        base,
        shots,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_a_real_browser() {
    if !browser_installed() {
        return;
    }
    let (_sim, gw, admin) = console_gateway(None).await;
    let chat = gw.url("/v1/chat/completions");
    // Some traffic in each environment, so the overview has something to draw.
    let mut keys = HashMap::new();
    for env in Environment::ALL {
        let (k, _) = issue_key(&gw, env, |c| c.name = format!("{env} load test")).await;
        keys.insert(env, format!("Bearer {k}"));
    }
    for i in 0..24 {
        let env = Environment::ALL[i % 3];
        assert_eq!(
            post(&chat, &[("authorization", &keys[&env])], chat_body())
                .await
                .status,
            200
        );
    }
    let _ = post(
        &chat,
        &[("authorization", "Bearer fg-prod-nope")],
        chat_body(),
    )
    .await;

    let driver = start_driver().await;
    let b = open_browser(&driver, format!("http://{admin}")).await;

    // Sign in with a one-time link: the page moves on to the overview by itself.
    b.goto(&format!("/console/login?token={}", link(Role::Admin)))
        .await;
    b.css("#live-table").await;
    assert_eq!(b.text("#role").await, "admin");
    assert_eq!(
        b.text("#hour-table tr[data-env=prod] td:nth-child(2)")
            .await,
        "8"
    );
    b.css("#chart-ttft path.series.prod").await;
    // The live section refreshes without a reload: the script stamps it.
    b.client
        .wait()
        .at_most(Duration::from_secs(15))
        .for_element(fantoccini::Locator::Css("#live[data-updated]"))
        .await
        .unwrap_or_else(|e| panic!("the live section never refreshed: {e}"));
    b.no_console_errors("overview").await;
    b.shot("overview").await;

    // Issue a prod key whose name would run script if it were not escaped.
    b.goto("/console/keys").await;
    b.shot("keys").await;
    let evil = "<img src=x onerror=alert(1)>";
    b.fill("#issue-name", evil).await;
    b.fill("#issue-models", "qwen32b").await;
    b.fill("#issue-endpoints", "chat, embeddings").await;
    // An empty limit means the environment's default (docs/console.md), and the form says so.
    for field in ["#issue-rpm", "#issue-tpm", "#issue-streams"] {
        let placeholder = b
            .css(field)
            .await
            .attr("placeholder")
            .await
            .unwrap()
            .unwrap_or_default();
        assert_eq!(placeholder, "the environment's default", "{field}");
    }
    b.fill("#issue-rpm", "600").await;
    b.fill("#issue-metadata", r#"{"owner": "the \"quoted\" team"}"#)
        .await;
    b.click("#issue-submit").await;
    let key = b.text("#new-key").await;
    assert!(key.starts_with("fg-prod-"), "{key}");
    let export = b.text("#export-line").await;
    assert_eq!(
        export,
        format!(
            "export OPENAI_API_KEY={key} OPENAI_BASE_URL=http://127.0.0.1:{}/v1",
            gw.server.local_addr.port()
        )
    );
    b.click("button[data-copy=new-key]").await;
    b.no_console_errors("key issued").await;
    b.shot("key-issued").await;
    let auth = format!("Bearer {key}");
    assert_eq!(
        post(&chat, &[("authorization", &auth)], chat_body())
            .await
            .status,
        200
    );

    // Its page: the name shows as text, no image element was made, no alert is open.
    b.click("#key-page").await;
    assert_eq!(b.text("#key-name").await, evil);
    assert!(b.absent("main img").await);
    assert!(b.client.get_alert_text().await.is_err(), "an alert opened");
    assert!(
        b.text("#key-metadata")
            .await
            .contains(r#""the \"quoted\" team""#)
    );
    assert_eq!(b.text("#usage-requests").await, "1");
    assert_eq!(b.text("#key-endpoints").await, "chat, embeddings");
    b.no_console_errors("key page").await;
    b.shot("key").await;

    // Revoke it in the page.
    b.fill("#revoke-reason", "leaked in a log").await;
    b.click("#revoke-confirm").await;
    b.click("#revoke").await;
    b.css("#notice").await;
    assert_eq!(b.text("#key-status").await, "revoked");
    let m = post(&chat, &[("authorization", &auth)], chat_body()).await;
    assert_eq!(m.status, 401);
    assert_eq!(openai_error(&m)["code"], "key_revoked");
    b.no_console_errors("revoked").await;

    // The audit page shows both actions on that key.
    let id = key.split('-').nth(2).unwrap_or_default().to_owned();
    b.goto("/console/audit").await;
    let audit = b.text("#audit").await;
    assert!(
        audit.contains("create") && audit.contains("revoke") && audit.contains(&id),
        "{audit}"
    );
    b.css(&format!(
        "#audit tr[data-action=revoke] a[href='/console/keys/{id}']"
    ))
    .await;
    b.no_console_errors("audit").await;
    b.shot("audit").await;

    b.goto("/console/backends").await;
    b.css("tr[data-backend] .state").await;
    // The name clients see in errors (`model#N`) and the labels a gray canary selects by.
    assert_eq!(b.text("tr[data-backend] td.name").await, "qwen32b#0");
    assert_eq!(b.text("tr[data-backend] td.labels").await, "canary");
    assert!(
        !b.absent("tr[data-backend] form button").await,
        "an admin can drain"
    );
    b.no_console_errors("backends").await;
    b.shot("backends").await;

    // Sign out: the console asks to sign in again.
    b.click("#sign-out").await;
    b.css("#signed-out").await;
    b.goto("/console/").await;
    b.css("#error").await;
    let _ = b.log().await; // the 401 of that last page is expected

    // A viewer sees everything and changes nothing: no button, and a forged POST is refused.
    let (other, other_record) =
        issue_key(&gw, Environment::Prod, |c| c.name = "still active".into()).await;
    b.goto(&format!("/console/login?token={}", link(Role::Viewer)))
        .await;
    b.css("#live-table").await;
    assert_eq!(b.text("#role").await, "viewer");
    b.goto("/console/keys").await;
    assert!(b.absent("#issue-form").await);
    b.goto(&format!("/console/keys/{}", other_record.public_id))
        .await;
    assert!(b.absent("#revoke").await && b.absent("#rotate").await);
    b.shot("viewer-key").await;
    b.goto("/console/backends").await;
    assert!(b.absent("tr[data-backend] form").await);
    b.no_console_errors("viewer pages").await;
    let status = b
        .client
        .execute(
            "const csrf = document.querySelector('input[name=csrf]').value; \
             return fetch(arguments[0], {method: 'POST', headers: {'content-type': 'application/x-www-form-urlencoded'}, \
               body: 'csrf=' + csrf + '&reason=forged&confirm=yes'}).then(r => r.status);",
            vec![serde_json::json!(format!("/console/keys/{}/revoke", other_record.public_id))],
        )
        .await
        .unwrap_or_else(|e| panic!("forged POST: {e}"));
    assert_eq!(status, serde_json::json!(403));
    let _ = b.log().await; // the 403 is expected
    let ok = post(
        &chat,
        &[("authorization", &format!("Bearer {other}"))],
        chat_body(),
    )
    .await;
    assert_eq!(ok.status, 200, "the viewer's forged revoke changed nothing");
    let _ = b.client.clone().close().await;
}
