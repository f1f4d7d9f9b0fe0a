//! The dashboard in a real browser: Debian's headless `chromium` driven through `chromedriver`
//! (WebDriver, with `fantoccini`) against a real `proteus serve` with real agents.
//!
//! Every page visited is kept as a screenshot under `$PROTEUS_TEST_ARTIFACTS/dashboard/` (default
//! `<target dir>/test-artifacts/dashboard/`). `scripts/test` installs chromium and chromedriver
//! with apt-get when they are missing; `PROTEUS_TEST_CHROMIUM` and `PROTEUS_TEST_CHROMEDRIVER`
//! point elsewhere.

use fantoccini::{Client, ClientBuilder, Locator};
use proteus_e2e::{BrokerProcess, TOKEN, free_port, fresh_pg_database};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A job that trains far longer than any test waits, so that it is running when the browser
/// looks at it.
const LONG_JOB: &str = "name = \"e2e-dashboard\"\napp = \"mlr\"\ndataset = \"digits\"\n\
    policy = \"bidbrain\"\n[stop]\nepochs = 10000\n[limits]\nmax_instances = 2\n\
    max_reliable_instances = 1\n[work]\ntotal_work = 500.0\n[training]\nseed = 5\n";

/// How long any one thing may take to show up in the page.
const DEADLINE: Duration = Duration::from_secs(60);

fn artifacts() -> PathBuf {
    let dir = match std::env::var_os("PROTEUS_TEST_ARTIFACTS") {
        Some(d) => PathBuf::from(d),
        None => {
            // target/<profile>/deps/e2e-… → target/test-artifacts
            let exe = std::env::current_exe().expect("test executable path");
            exe.ancestors()
                .nth(3)
                .expect("target dir")
                .join("test-artifacts")
        }
    }
    .join("dashboard");
    std::fs::create_dir_all(&dir).expect("create the artifacts directory");
    dir
}

/// chromedriver (in its own process group, with the chromium it starts) and a session on it.
/// Dropping it kills the whole group.
struct Browser {
    driver: Child,
    client: Client,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn start() -> Browser {
        let chromium =
            std::env::var("PROTEUS_TEST_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        let chromedriver = std::env::var("PROTEUS_TEST_CHROMEDRIVER")
            .unwrap_or_else(|_| "/usr/bin/chromedriver".into());
        for bin in [&chromium, &chromedriver] {
            assert!(
                std::path::Path::new(bin).is_file(),
                "{bin} is missing: run the suite with scripts/test, which installs chromium and \
                 chromium-driver"
            );
        }
        let port = free_port();
        let driver = {
            use std::os::unix::process::CommandExt;
            Command::new(&chromedriver)
                .arg(format!("--port={port}"))
                .arg("--allowed-ips=127.0.0.1")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
                .expect("start chromedriver")
        };
        let url = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = http.get(format!("{url}/status")).send().await
                && let Ok(v) = r.json::<Value>().await
                && v["value"]["ready"] == true
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "chromedriver did not get ready on {url}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir().expect("profile dir");
        let caps = json!({
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", "--no-first-run", "--window-size=1280,1100",
                    format!("--user-data-dir={}", profile.path().display()),
                ],
            },
        });
        let Value::Object(caps) = caps else {
            unreachable!("a JSON object")
        };
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&url)
            .await
            .expect("a WebDriver session on chromium");
        Browser {
            driver,
            client,
            _profile: profile,
        }
    }

    /// Saves the page as `<artifacts>/<name>.png`.
    async fn screenshot(&self, name: &str) {
        let png = self.client.screenshot().await.expect("screenshot");
        assert_eq!(&png[..4], b"\x89PNG", "a PNG screenshot");
        let path = artifacts().join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write the screenshot");
        eprintln!("screenshot: {}", path.display());
    }

    /// Polls the page with `script` (a function body returning a value) until `ok` holds.
    async fn wait_js(&self, what: &str, script: &str, ok: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let v = self
                .client
                .execute(script, vec![])
                .await
                .unwrap_or(Value::Null);
            if ok(&v) {
                return v;
            }
            if Instant::now() > deadline {
                let source = self.client.source().await.unwrap_or_default();
                panic!("timed out waiting for {what} (last {v}); page:\n{source}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The text of the element `css` once it contains `needle`.
    async fn wait_text(&self, css: &str, needle: &str) -> String {
        let script = format!(
            "const e = document.querySelector({}); return e ? e.textContent : null;",
            json!(css)
        );
        let v = self
            .wait_js(&format!("`{css}` to say `{needle}`"), &script, |v| {
                v.as_str().is_some_and(|t| t.contains(needle))
            })
            .await;
        v.as_str().unwrap_or_default().to_string()
    }

    /// Waits until the `<img>` `css` has loaded a picture at least `min_width` pixels wide.
    async fn wait_image(&self, css: &str, min_width: u64) {
        let script = format!(
            "const e = document.querySelector({}); return e && e.complete ? e.naturalWidth : 0;",
            json!(css)
        );
        self.wait_js(&format!("the chart `{css}`"), &script, |v| {
            v.as_u64().is_some_and(|w| w >= min_width)
        })
        .await;
    }

    async fn login(&self, base: &str, token: &str) {
        self.client.goto(base).await.expect("open the dashboard");
        let field = self
            .client
            .wait()
            .at_most(DEADLINE)
            .for_element(Locator::Id("token"))
            .await
            .expect("the login form");
        field.send_keys(token).await.expect("type the token");
        self.client
            .find(Locator::Id("login-submit"))
            .await
            .expect("the sign-in button")
            .click()
            .await
            .expect("sign in");
    }

    /// Ends the WebDriver session (chromium exits), then chromedriver's group goes on drop.
    async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

fn kill_group(driver: &mut Child) {
    // SAFETY: signalling the process group this test started chromedriver in.
    unsafe { libc::kill(-(driver.id() as i32), libc::SIGKILL) };
    let _ = driver.wait();
}

impl Drop for Browser {
    fn drop(&mut self) {
        kill_group(&mut self.driver);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_running_job_its_chart_and_cancels_it() {
    let dir = tempfile::tempdir().unwrap();
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(dir.path(), &db, "60", &[]).await;
    let id = broker.submit_file(dir.path(), LONG_JOB);
    let api = broker.client();
    api.wait_for(&format!("/v1/jobs/{id}"), DEADLINE, "the job to run", |j| {
        j["state"] == "running"
    })
    .await;

    let browser = Browser::start().await;
    browser.login(&broker.url, TOKEN).await;
    // The jobs page lists the running job with its spend and both counterfactuals.
    let row = format!("#jobs-table tr[data-job-id=\"{id}\"][data-state=\"running\"]");
    browser.wait_text(&row, "e2e-dashboard").await;
    browser.wait_text(&row, "cheaper").await;
    // Policy, submitted, duration and ETA columns, on the broker's clock (simulated here).
    browser
        .wait_text(&format!("{row} td[data-col=\"policy\"]"), "bidbrain")
        .await;
    let submitted = api.get(&format!("/v1/jobs/{id}")).await["created"]
        .as_str()
        .unwrap()
        .replace('T', " ")
        .replace('Z', "");
    browser
        .wait_text(&format!("{row} td[data-col=\"submitted\"]"), &submitted)
        .await;
    browser
        .wait_text(&format!("{row} td[data-col=\"duration\"]"), " min ")
        .await;
    browser
        .wait_text(&format!("{row} td[data-col=\"eta\"]"), "-")
        .await;
    browser.screenshot("jobs").await;
    // The session cookie is HttpOnly: the page's scripts cannot read it.
    let cookies = browser
        .client
        .execute("return document.cookie;", vec![])
        .await
        .unwrap();
    assert!(
        !cookies.as_str().unwrap_or("").contains("proteus_session"),
        "{cookies}"
    );

    // Open it: state, chart (the broker's plotters SVG), cost by market and tier, events.
    browser
        .client
        .find(Locator::Css(&format!("{row} a.job-link")))
        .await
        .expect("the job's link")
        .click()
        .await
        .expect("open the job");
    browser.wait_text("#job-state", "running").await;
    browser.wait_image("#job-chart", 900).await;
    browser.wait_text("#ledger-table", "transient").await;
    browser
        .wait_text("#counterfactuals-table", "standard-bidding")
        .await;
    browser.wait_text("#events-table", "launched").await;
    browser
        .wait_text("dd[data-fact=\"clock\"]", "simulated market time")
        .await;
    browser.screenshot("job").await;

    // The event log filtered by kind: only that kind's rows, then all of them again.
    let kinds = "return [...document.querySelectorAll('#events-table tbody tr')]\
                 .map(r => r.dataset.kind);";
    browser
        .client
        .find(Locator::Id("event-filter"))
        .await
        .unwrap()
        .select_by_value("launched")
        .await
        .unwrap();
    let shown = browser
        .wait_js("only launches in the event log", kinds, |v| {
            v.as_array()
                .is_some_and(|a| !a.is_empty() && a.iter().all(|k| k == "launched"))
        })
        .await;
    browser.screenshot("job-events-filtered").await;
    browser
        .client
        .find(Locator::Id("event-filter"))
        .await
        .unwrap()
        .select_by_value("")
        .await
        .unwrap();
    browser
        .wait_js("every event again", kinds, |v| {
            v.as_array().is_some_and(|a| {
                a.len() > shown.as_array().map_or(0, Vec::len) && a.iter().any(|k| k != "launched")
            })
        })
        .await;

    // On a 420 px phone the page does not scroll sideways (wide tables scroll in their boxes)
    // and the facts are one per row.
    browser.client.set_window_size(420, 900).await.unwrap();
    browser
        .wait_js(
            "the page to fit 420 px",
            "const d = document.documentElement; \
             const cols = getComputedStyle(document.getElementById('job-facts')) \
               .gridTemplateColumns.split(' ').length; \
             return d.clientWidth <= 420 && d.scrollWidth <= d.clientWidth ? cols : 0;",
            |v| v.as_u64() == Some(2),
        )
        .await;
    browser.screenshot("job-420px").await;
    browser.client.set_window_size(1280, 1100).await.unwrap();

    // A spot instance warned of its end runs on until it leaves: the page shows it as leaving,
    // beside the instances that stay, as the API does.
    let job = api
        .wait_for(
            &format!("/v1/jobs/{id}"),
            DEADLINE,
            "a running spot instance",
            |j| {
                j["instances"].as_array().is_some_and(|a| {
                    a.iter()
                        .any(|i| i["tier"] == "transient" && i["state"] == "running")
                })
            },
        )
        .await;
    let spot = job["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["tier"] == "transient" && i["state"] == "running")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (code, _, err) = proteus_e2e::proteus(None, &["interrupt", &spot], &broker.user_env());
    assert_eq!(code, 0, "proteus interrupt: {err}");
    api.wait_for(
        &format!("/v1/jobs/{id}"),
        DEADLINE,
        "the warned instance counted as leaving",
        |j| j["leaving_by_tier"]["transient"] == 1,
    )
    .await;
    browser
        .wait_text("dd[data-fact=\"instances\"]", "(+1 leaving)")
        .await;
    browser.screenshot("job-leaving").await;

    // Cancel: two clicks (the first arms the button), then the API says it is cancelled.
    let cancel = browser.client.find(Locator::Id("cancel")).await.unwrap();
    cancel.click().await.unwrap();
    browser.wait_text("#cancel", "again").await;
    cancel.click().await.unwrap();
    browser.wait_text("#job-state", "cancelled").await;
    let job = api.get(&format!("/v1/jobs/{id}")).await;
    assert_eq!(job["state"], "cancelled", "{job}");
    assert_eq!(job["state_reason"], "cancelled by the user", "{job}");
    browser.wait_text("#events-table", "job_cancelled").await;
    browser.screenshot("job-cancelled").await;

    // Markets: the price history of the first market over the default week.
    browser
        .client
        .goto(&format!("{}/#/markets", broker.url))
        .await
        .unwrap();
    browser.wait_text("#markets-table", "us-east-1").await;
    browser.wait_image("#market-chart", 900).await;
    browser
        .client
        .find(Locator::Id("window"))
        .await
        .unwrap()
        .select_by_value("720")
        .await
        .unwrap();
    browser
        .wait_js(
            "the 30-day chart",
            "const e = document.getElementById('market-chart'); \
             return e.complete && e.src.includes('hours=720') ? e.naturalWidth : 0;",
            |v| v.as_u64().is_some_and(|w| w >= 900),
        )
        .await;
    browser.screenshot("markets").await;

    // Signing out ends the session: the page is the login form again and data is refused.
    browser
        .client
        .find(Locator::Id("logout"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    browser.wait_text("body", "User token").await;
    let status = browser
        .client
        .execute("return fetch('/v1/jobs').then(r => r.status);", vec![])
        .await
        .unwrap();
    assert_eq!(status, json!(401));
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_refuses_a_wrong_token() {
    let dir = tempfile::tempdir().unwrap();
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(dir.path(), &db, "60", &[]).await;
    let browser = Browser::start().await;
    browser.login(&broker.url, "pt_not-the-token").await;
    let message = browser.wait_text("#login-error", "not valid").await;
    assert!(message.contains("token"), "{message}");
    browser.screenshot("login-refused").await;
    // Still the login form, no dashboard, and no data through the browser.
    let shell = browser
        .client
        .execute("return document.getElementById('view') === null;", vec![])
        .await
        .unwrap();
    assert_eq!(shell, json!(true));
    for path in ["/v1/jobs", "/v1/markets", "/v1/jobs/1/chart"] {
        let status = browser
            .client
            .execute(
                &format!("return fetch({}).then(r => r.status);", json!(path)),
                vec![],
            )
            .await
            .unwrap();
        assert_eq!(status, json!(401), "{path}");
    }
    // The right token then gets in.
    browser.login(&broker.url, TOKEN).await;
    browser.wait_text("#jobs-summary", "0 jobs").await;
    browser.screenshot("login-accepted").await;
    browser.close().await;
}

/// The session's rules over plain HTTP: cookie attributes, what a cookie may read, that a
/// change through a cookie needs the CSRF header, and the chart endpoints' formats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_sessions_are_http_only_strict_and_guard_changes() {
    let dir = tempfile::tempdir().unwrap();
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(dir.path(), &db, "60", &[]).await;
    let id = broker.submit_file(dir.path(), LONG_JOB);
    broker
        .client()
        .wait_for(&format!("/v1/jobs/{id}"), DEADLINE, "the job to run", |j| {
            j["state"] == "running"
        })
        .await;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let url = |p: &str| format!("{}{p}", broker.url);

    // Without a session: the login form, and no data or chart.
    let page = http.get(url("/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let csp = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(csp.contains("script-src 'self'"), "{csp}");
    let text = page.text().await.unwrap();
    assert!(
        text.contains("id=\"login-form\"") && !text.contains("csrf-token"),
        "{text}"
    );
    for path in [
        "/v1/jobs".to_string(),
        format!("/v1/jobs/{id}/chart"),
        "/v1/markets/chart?market=us-east-1a/c3.xlarge".into(),
    ] {
        let r = http.get(url(&path)).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path}");
    }

    let form = |token: &str| {
        http.post(url("/login"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("token={token}"))
    };
    let refused = form("pt_wrong").send().await.unwrap();
    assert_eq!(refused.status(), 401);
    assert!(refused.headers().get("set-cookie").is_none());
    assert!(refused.text().await.unwrap().contains("not valid"));

    let ok = form(TOKEN).send().await.unwrap();
    assert_eq!(ok.status(), 303);
    assert_eq!(ok.headers()["location"], "/");
    let set = ok.headers()["set-cookie"].to_str().unwrap().to_string();
    for part in [
        "proteus_session=ps_",
        "HttpOnly",
        "SameSite=Strict",
        "Path=/",
    ] {
        assert!(set.contains(part), "{set}");
    }
    assert!(!set.contains("Secure"), "plain HTTP: {set}");
    let cookie = set.split(';').next().unwrap().to_string();

    // With the cookie: the page carries the CSRF token, and the data endpoints answer.
    let page = http
        .get(url("/"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let csrf = page
        .split("name=\"csrf-token\" content=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .expect("the page's CSRF token")
        .to_string();
    assert!(csrf.starts_with("pc_"), "{csrf}");
    let jobs = http
        .get(url("/v1/jobs"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(jobs.status(), 200);
    let svg = http
        .get(url(&format!("/v1/jobs/{id}/chart")))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(svg.headers()["content-type"], "image/svg+xml");
    assert!(svg.text().await.unwrap().starts_with("<svg"));
    let png = http
        .get(url(&format!("/v1/jobs/{id}/chart?format=png")))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(png.headers()["content-type"], "image/png");
    assert_eq!(&png.bytes().await.unwrap()[..4], b"\x89PNG");
    let bad = http
        .get(url(
            "/v1/markets/chart?market=us-east-1a/c3.xlarge&from=2015-05-02&to=2015-05-01",
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 422);
    assert!(bad.text().await.unwrap().contains("not before"));

    // A change through the cookie needs the CSRF header; a wrong one is refused too.
    for header in [None, Some("pc_guess")] {
        let mut req = http
            .post(url(&format!("/v1/jobs/{id}/cancel")))
            .header("cookie", &cookie);
        if let Some(h) = header {
            req = req.header("x-csrf-token", h);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 403, "CSRF header {header:?}");
    }
    let job = broker.client().get(&format!("/v1/jobs/{id}")).await;
    assert_ne!(job["state"], "cancelled", "refused changes change nothing");
    let r = http
        .post(url(&format!("/v1/jobs/{id}/cancel")))
        .header("cookie", &cookie)
        .header("x-csrf-token", &csrf)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", broker.log_text());
    assert_eq!(r.json::<Value>().await.unwrap()["state"], "cancelled");

    // Signing out ends the session on the server, not only in the browser.
    let out = http
        .post(url("/logout"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert!(
        out.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
    let after = http
        .get(url("/v1/jobs"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(after.status(), 401);
}

/// `proteus demo --keep-serving`: after its report the broker stays up with the dashboard,
/// printing where and with which token, until Ctrl-C (SIGINT) ends it cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_keeps_serving_its_dashboard_until_interrupted() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    let mut child = Command::new(proteus_e2e::bin("proteus"))
        .args([
            "demo",
            "--keep-serving",
            "--output",
            "json",
            "--work",
            "2",
            "--epochs",
            "1",
        ])
        .args(["--out", &out])
        .env_remove("PROTEUS_DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start proteus demo");
    // The report (stdout) and the lines that say where the dashboard is (stderr), read on
    // threads so that a silent demo fails at the deadline instead of hanging.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let stdout = child.stdout.take().unwrap();
    let report = std::thread::spawn(move || std::io::read_to_string(stdout).unwrap_or_default());
    let deadline = Instant::now() + Duration::from_secs(300);
    let (mut url, mut token, mut seen) = (None, None, String::new());
    while url.is_none() || token.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = rx.recv_timeout(left) else {
            let _ = child.kill();
            panic!("the demo never said where its dashboard is; its stderr:\n{seen}");
        };
        seen.push_str(&line);
        seen.push('\n');
        if let Some(u) = line.trim().strip_prefix("dashboard: ") {
            url = Some(u.trim().trim_end_matches('/').to_string());
        }
        if let Some(t) = line.trim().strip_prefix("token: ") {
            token = Some(t.trim().to_string());
        }
    }
    let (url, token) = (url.unwrap(), token.unwrap());
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let login = http
        .post(format!("{url}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={token}"))
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 303, "the printed token opens a session");
    let jobs: Value = http
        .get(format!("{url}/v1/jobs"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(jobs[0]["state"], "succeeded", "{jobs}");
    let chart = http
        .get(format!("{url}/v1/jobs/{}/chart", jobs[0]["id"]))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(chart.status(), 200);
    assert!(dir.path().join("proteus-demo.svg").is_file());
    assert!(dir.path().join("proteus-demo.png").is_file());

    // SAFETY: interrupting the demo process this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the demo did not stop on SIGINT");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(status.success(), "{status}");
    let report: Value = serde_json::from_str(&report.join().unwrap()).expect("the JSON report");
    assert_eq!(report["job"]["state"], "succeeded");
    assert!(
        http.get(format!("{url}/healthz")).send().await.is_err(),
        "the broker is gone after Ctrl-C"
    );
}
