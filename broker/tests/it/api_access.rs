//! Who gets in, and what they learn (issue 23): dead agent tokens stay dead, credentials are
//! checked before anything else of a request is read, metrics need the user token, user tokens
//! are long and logins back off, `s3://` working directories come only from allowed buckets,
//! agents cannot flood a job's events, errors name only what the client sent, and the OpenAPI
//! document says what the handlers require.

use crate::api::{TOKEN, TestServer, job};
use proteus_broker::api::auth::{hash_token, new_token};
use proteus_broker::clock::Clock;
use proteus_broker::cloud::LaunchSpec;
use proteus_broker::market::Market;
use proteus_wire::{JobId, Tier};
use reqwest::Method;
use serde_json::{Value, json};

/// An instance of `job` launched in the simulated cloud, whose agent token the test knows:
/// (broker id, cloud id, token).
async fn agent_of(s: &TestServer, job: i64, k: usize) -> (String, String, String) {
    let token = new_token("pa_");
    let row = proteus_broker::store::InstanceRow::intent(
        format!("pi-t{job}-{k}"),
        JobId(job),
        Market::parse("us-east-1a/c3.xlarge").unwrap(),
        proteus_broker::policy::Purchase::OnDemand,
        hash_token(&token),
        s.clock.now(),
    );
    s.broker.store().insert_instance(None, &row).await.unwrap();
    let launched = s
        .broker
        .cloud()
        .launch(&LaunchSpec {
            instance_id: row.id.clone(),
            job_id: JobId(job),
            market: row.market.clone(),
            tier: Tier::Reliable,
            bid: None,
            bootstrap_token: token.clone(),
        })
        .await
        .expect("the simulated cloud launches");
    s.broker
        .store()
        .mark_launched(None, &row.id, &launched.cloud_id, s.clock.now())
        .await
        .unwrap();
    (row.id, launched.cloud_id, token)
}

/// A request with a raw body: (status, body text, headers).
async fn raw(
    s: &TestServer,
    method: Method,
    path: &str,
    token: Option<&str>,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> (u16, String, reqwest::header::HeaderMap) {
    let mut req = s.http.request(method, format!("{}{path}", s.url));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(c) = content_type {
        req = req.header("content-type", c);
    }
    let resp = req.body(body).send().await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, resp.text().await.unwrap_or_default(), headers)
}

async fn register(s: &TestServer, cloud: &str, token: &str) {
    let body = json!({"instance_id": cloud, "data_addr": "127.0.0.1:9", "vcpus": 2, "protocol_version": proteus_wire::agent_api::PROTOCOL_VERSION});
    let (status, answer) = s
        .call(Method::POST, "/v1/agents/register", Some(token), Some(body))
        .await;
    assert_eq!(status, 200, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_instances_token_stays_dead_after_a_wrong_token_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(|a| a.state_dir = Some(dir.path().to_path_buf())).await;
    let (status, view) = s.post("/v1/jobs", job("on-demand")).await;
    assert_eq!(status, 201, "{view}");
    let id = view["id"].as_i64().unwrap();
    let (row_id, cloud, token) = agent_of(&s, id, 0).await;
    let output = format!("/v1/agents/{cloud}/output");
    let checkpoint = format!("/v1/agents/{cloud}/checkpoint-data/0");
    let heartbeat = format!("/v1/agents/{cloud}/heartbeat");
    let text = |t: &str| t.as_bytes().to_vec();
    let (status, body, _) = raw(&s, Method::POST, &output, Some(&token), None, text("hi")).await;
    assert_eq!(status, 204, "the live instance's token works: {body}");

    // The job is cancelled; the cloud ends its instance and the scheduler records the end.
    let (status, view) = s.post(&format!("/v1/jobs/{id}/cancel"), json!({})).await;
    assert_eq!(status, 200, "{view}");
    s.step(1.0).await;
    s.step(1.0).await;
    let row = s.broker.store().instance(&row_id).await.unwrap().unwrap();
    assert!(row.state.is_final(), "{row:?}");
    let (status, body, _) = raw(&s, Method::POST, &output, Some(&token), None, text("x")).await;
    assert_eq!(status, 403, "the ended instance's token: {body}");

    // One request with a wrong token for the ended instance...
    let wrong = new_token("pa_");
    let (status, body, _) = raw(
        &s,
        Method::POST,
        &heartbeat,
        Some(&wrong),
        Some("application/json"),
        text("{}"),
    )
    .await;
    assert_eq!(status, 401, "{body}");
    // ...does not bring the old token back to life, anywhere.
    let requests = [
        (Method::POST, &output, None, text("after the end")),
        (Method::PUT, &checkpoint, None, text("not even a tar")),
        (Method::GET, &checkpoint, None, Vec::new()),
        (
            Method::POST,
            &heartbeat,
            Some("application/json"),
            text("{}"),
        ),
    ];
    for (method, path, content_type, body) in requests {
        let (status, answer, _) =
            raw(&s, method.clone(), path, Some(&token), content_type, body).await;
        assert_eq!(status, 403, "{method} {path}: {answer}");
    }
}

/// A session cookie and the CSRF token of its page.
async fn session(s: &TestServer) -> (String, String) {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let resp = http
        .post(format!("{}/login", s.url))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 303);
    let cookie = resp.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let page = http
        .get(format!("{}/", s.url))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let csrf = page
        .split(r#"name="csrf-token" content=""#)
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("the page carries its CSRF token")
        .to_string();
    (cookie, csrf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupting_an_instance_through_a_session_needs_the_csrf_header() {
    let s = TestServer::start(|_| {}).await;
    let (cookie, csrf) = session(&s).await;
    let interrupt = |csrf: Option<&str>| {
        let mut req = s
            .http
            .post(format!("{}/v1/instances/pi-nope/interruption", s.url))
            .header("cookie", &cookie);
        if let Some(c) = csrf {
            req = req.header("x-csrf-token", c);
        }
        req.send()
    };
    let resp = interrupt(None).await.unwrap();
    assert_eq!(
        resp.status(),
        403,
        "a change through a session without its CSRF header"
    );
    let resp = interrupt(Some(&csrf)).await.unwrap();
    assert_eq!(resp.status(), 404, "with it, the request gets through");
    // Reading needs no CSRF header.
    let resp = s
        .http
        .get(format!("{}/v1/jobs", s.url))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_are_checked_before_bodies_and_queries_are_read() {
    let s = TestServer::start(|_| {}).await;
    let (status, view) = s.post("/v1/jobs", job("on-demand")).await;
    assert_eq!(status, 201, "{view}");
    let json_type = Some("application/json");
    let b = |t: &str| t.as_bytes().to_vec();
    let cases: Vec<(Method, &str, Option<&str>, Vec<u8>)> = vec![
        (Method::POST, "/v1/jobs", json_type, b("{}")),
        (Method::POST, "/v1/jobs", json_type, b("{\"app\": ")),
        (Method::POST, "/v1/jobs", None, b("app=mlr")),
        (Method::GET, "/v1/jobs/1/events?limit=lots", None, vec![]),
        (Method::GET, "/v1/jobs/%FF", None, vec![]),
        (Method::GET, "/v1/prices?market=", None, vec![]),
        (Method::GET, "/v1/markets/chart?hours=lots", None, vec![]),
        (Method::POST, "/v1/jobs/1/cancel", None, vec![]),
        (Method::POST, "/v1/instances/%FF/interruption", None, vec![]),
        (Method::POST, "/v1/agents/register", json_type, b("{}")),
        (Method::POST, "/v1/agents/register", None, b("\u{0}")),
        (
            Method::POST,
            "/v1/agents/i-x/heartbeat",
            json_type,
            b("not json"),
        ),
        (
            Method::POST,
            "/v1/agents/i-x/events",
            json_type,
            b("{\"type\": \"nope\"}"),
        ),
        (
            Method::GET,
            "/v1/agents/i-x/commands?after=-1&wait_ms=abc",
            None,
            vec![],
        ),
        (
            Method::GET,
            "/v1/agents/i-x/checkpoint?rank=x&op=sideways",
            None,
            vec![],
        ),
        (
            Method::PUT,
            "/v1/agents/i-x/checkpoint-data/not-a-rank",
            None,
            vec![],
        ),
        (
            Method::GET,
            "/v1/agents/i-x/checkpoint-data/x",
            None,
            vec![],
        ),
        (
            Method::POST,
            "/v1/agents/i-x/output",
            None,
            vec![0xff, 0xfe],
        ),
        (Method::GET, "/v1/downloads/data/%FF", None, vec![]),
    ];
    let wrong_user = new_token("pt_");
    let wrong_agent = new_token("pa_");
    for token in [None, Some(wrong_user.as_str()), Some(wrong_agent.as_str())] {
        for (method, path, content_type, body) in &cases {
            let (status, answer, _) =
                raw(&s, method.clone(), path, token, *content_type, body.clone()).await;
            assert_eq!(
                status,
                401,
                "{method} {path} with {}: {answer}",
                token.map_or("no token", |t| &t[..3])
            );
            assert!(
                !answer.contains("field") && !answer.contains("expected"),
                "nothing about the request's shape: {answer}"
            );
        }
    }
    // The user token is not an agent's: agent routes refuse it before reading the request.
    for (method, path, content_type, body) in cases.iter().filter(|c| c.1.contains("/agents/")) {
        let (status, answer, _) = raw(
            &s,
            method.clone(),
            path,
            Some(TOKEN),
            *content_type,
            body.clone(),
        )
        .await;
        assert_eq!(status, 401, "{method} {path} with the user token: {answer}");
    }
    // With credentials, the shape of the request is what is wrong.
    let (status, _) = s.post("/v1/jobs", json!({})).await;
    assert_eq!(status, 422);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_need_the_user_token_and_show_every_jobs_spend_from_one_query() {
    let s = TestServer::start(|_| {}).await;
    for path in ["/metrics", "/v1/metrics"] {
        let (status, body) = s.call(Method::GET, path, None, None).await;
        assert_eq!(status, 401, "{path}: {body}");
        let (status, _) = s
            .call(Method::GET, path, Some(&new_token("pt_")), None)
            .await;
        assert_eq!(status, 401, "{path} with a wrong token");
    }
    // Many jobs, one of which has spent something: every one has its gauge.
    let jobs = 40;
    for _ in 0..jobs {
        let (status, view) = s.post("/v1/jobs", job("on-demand")).await;
        assert_eq!(status, 201, "{view}");
    }
    for _ in 0..8 {
        s.step(60.0).await;
    }
    let (status, text) = s.get("/metrics").await;
    assert_eq!(status, 200, "{text}");
    let text = text.as_str().unwrap().to_string();
    let spend: Vec<(i64, f64)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("proteus_spend_usd{job=\""))
        .map(|rest| {
            let (job, value) = rest.split_once("\"} ").unwrap();
            (job.parse().unwrap(), value.parse().unwrap())
        })
        .collect();
    assert_eq!(spend.len(), jobs, "{text}");
    for (job, usd) in &spend {
        let stored = s
            .broker
            .store()
            .spend_of_job(JobId(*job))
            .await
            .unwrap()
            .get();
        assert!((usd - stored).abs() < 1e-9, "job {job}: {usd} vs {stored}");
    }
    assert!(spend.iter().any(|(_, usd)| *usd > 0.0), "{text}");
    assert!(text.contains("proteus_jobs{state=\"running\"} "), "{text}");
    let counted: i64 = text
        .lines()
        .filter_map(|l| l.strip_prefix("proteus_jobs{state=\""))
        .map(|rest| rest.split_once("\"} ").unwrap().1.parse::<i64>().unwrap())
        .sum();
    assert_eq!(counted, jobs as i64, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_user_token_stops_the_start_naming_the_flag() {
    let db = crate::support::TestDb::postgres().await;
    let mut args = proteus_broker::startup::ServeArgs::sim_defaults();
    args.local_agents = Some(false);
    args.token = Some("pt_only-twenty-chars".into());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let Err(e) = proteus_broker::startup::start(db.store.clone(), args, listener).await else {
        panic!("a 20-character token was accepted");
    };
    let e = format!("{e:#}");
    assert!(
        e.contains("--token") && e.contains("PROTEUS_TOKEN") && e.contains("32"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_logins_back_off_after_repeated_failures() {
    let s = TestServer::start(|_| {}).await;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let login = |token: String| {
        http.post(format!("{}/login", s.url))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("token={token}"))
            .send()
    };
    for _ in 0..proteus_broker::api::auth::FREE_LOGIN_FAILURES {
        let resp = login(new_token("pt_")).await.unwrap();
        assert_eq!(resp.status(), 401);
    }
    let resp = login(TOKEN.to_string()).await.unwrap();
    assert_eq!(
        resp.status(),
        429,
        "even the right token waits after too many failures"
    );
    let retry: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=900).contains(&retry), "{retry}");
    let page = resp.text().await.unwrap();
    assert!(page.contains("Too many failed logins"), "{page}");
    // The API's bearer token is not held back by the form's failures.
    let (status, _) = s.get("/v1/jobs").await;
    assert_eq!(status, 200);
}

fn command_job(workdir: &str) -> Value {
    json!({
        "name": "workdir", "app": "command", "policy": "on-demand",
        "limits": {"max_instances": 1},
        "command": {"run": ["python3", "train.py"], "workdir": workdir}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_workdir_outside_the_allowed_buckets_is_refused_at_submission() {
    let s = TestServer::start(|a| a.workdir_buckets = vec!["team-code".into()]).await;
    let (status, answer) = s
        .post("/v1/jobs", command_job("s3://someone-elses/secrets.tar.gz"))
        .await;
    assert_eq!(
        (status, answer["field"].as_str()),
        (422, Some("command.workdir")),
        "{answer}"
    );
    let message = answer["message"].as_str().unwrap();
    assert!(
        message.contains("bucket `someone-elses`") && message.contains("--workdir-buckets"),
        "{message}"
    );
    // An allowed bucket gets past the allow-list (this lean broker still cannot sign for it).
    let (status, answer) = s
        .post("/v1/jobs", command_job("s3://team-code/train.tar.gz"))
        .await;
    assert_eq!(
        (status, answer["field"].as_str()),
        (422, Some("command.workdir")),
        "{answer}"
    );
    assert!(
        answer["message"]
            .as_str()
            .unwrap()
            .contains("--checkpoint-store"),
        "{answer}"
    );
    // The flag's values are bucket names.
    let db = crate::support::TestDb::postgres().await;
    let mut args = proteus_broker::startup::ServeArgs::sim_defaults();
    args.token = Some(TOKEN.into());
    args.local_agents = Some(false);
    args.workdir_buckets = vec!["Not_A_Bucket".into()];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let Err(e) = proteus_broker::startup::start(db.store.clone(), args, listener).await else {
        panic!("a bad bucket name was accepted");
    };
    assert!(format!("{e:#}").contains("`Not_A_Bucket`"), "{e:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_events_are_checked_for_membership_first_and_capped_per_job() {
    let s = TestServer::start(|a| a.max_job_events = 12).await;
    let (_, view) = s.post("/v1/jobs", job("on-demand")).await;
    let id = view["id"].as_i64().unwrap();
    let (_, cloud, token) = agent_of(&s, id, 0).await;
    let events = format!("/v1/agents/{cloud}/events");
    let count = || s.broker.store().event_count_of_job(JobId(id));
    let post = |event: Value| s.call(Method::POST, &events, Some(&token), Some(event));

    // An exit's failure message is checked like every other text.
    let (status, answer) =
        post(json!({"type": "exit", "reason": {"type": "failed", "message": "bad\u{0}"}})).await;
    assert_eq!(
        (status, answer["field"].as_str()),
        (422, Some("reason.message")),
        "{answer}"
    );
    // Not a member of the job's layout yet (not registered): refused, and nothing logged.
    let before = count().await.unwrap();
    let (status, answer) = post(json!({"type": "rebalance_recommendation"})).await;
    assert_eq!(status, 404, "{answer}");
    assert_eq!(
        count().await.unwrap(),
        before,
        "the refused event was logged"
    );

    register(&s, &cloud, &token).await;
    let mut accepted = 0;
    let refusal = loop {
        let (status, answer) = post(json!({"type": "rebalance_recommendation"})).await;
        match status {
            204 => accepted += 1,
            429 => break answer,
            other => panic!("{other}: {answer}"),
        }
        assert!(accepted <= 12, "the cap does not hold");
    };
    assert!(accepted > 0);
    assert_eq!(count().await.unwrap(), 12, "exactly the cap is kept");
    assert!(
        refusal["message"]
            .as_str()
            .unwrap()
            .contains("--max-job-events"),
        "{refusal}"
    );
    // A registration is not refused for the count (and not logged past it).
    register(&s, &cloud, &token).await;
    assert_eq!(count().await.unwrap(), 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_events_come_a_page_at_a_time() {
    let s = TestServer::start(|_| {}).await;
    let (_, view) = s.post("/v1/jobs", job("bidbrain")).await;
    let id = view["id"].as_i64().unwrap();
    for _ in 0..6 {
        s.step(60.0).await;
    }
    let (status, all) = s.get(&format!("/v1/jobs/{id}/events")).await;
    assert_eq!(status, 200, "{all}");
    let all: Vec<i64> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_i64().unwrap())
        .collect();
    assert!(all.len() >= 3, "{all:?}");
    assert!(all.windows(2).all(|w| w[0] < w[1]), "oldest first: {all:?}");
    // Following the `Link` of each full page visits every event once, in order.
    let mut seen = Vec::new();
    let mut next = Some(format!("/v1/jobs/{id}/events?limit=2"));
    let mut pages = 0;
    while let Some(path) = next.take() {
        let (status, body, headers) = raw(&s, Method::GET, &path, Some(TOKEN), None, vec![]).await;
        assert_eq!(status, 200, "{path}: {body}");
        let page: Vec<Value> = serde_json::from_str(&body).unwrap();
        assert!(page.len() <= 2);
        seen.extend(page.iter().map(|e| e["id"].as_i64().unwrap()));
        next = headers.get("link").map(|l| {
            let l = l.to_str().unwrap();
            assert!(l.ends_with("rel=\"next\""), "{l}");
            l.trim_start_matches('<')
                .split('>')
                .next()
                .unwrap()
                .to_string()
        });
        if page.len() < 2 {
            assert!(next.is_none(), "a short page is the last");
        }
        pages += 1;
        assert!(pages <= all.len() + 1);
    }
    assert_eq!(seen, all);
    let (_, after) = s
        .get(&format!("/v1/jobs/{id}/events?after={}", all[1]))
        .await;
    assert_eq!(after.as_array().unwrap().len(), all.len() - 2);
    for (query, status, field) in [
        ("limit=0", 422, Some("limit")),
        ("limit=5001", 422, Some("limit")),
        ("after=-1", 422, Some("after")),
        ("limit=lots", 400, None),
    ] {
        let (got, answer) = s.get(&format!("/v1/jobs/{id}/events?{query}")).await;
        assert_eq!(
            (got, answer["field"].as_str()),
            (status, field),
            "{query}: {answer}"
        );
    }
    let (_, doc) = s.call(Method::GET, "/v1/openapi.json", None, None).await;
    let params = doc["paths"]["/v1/jobs/{id}/events"]["get"]["parameters"]
        .as_array()
        .unwrap()
        .clone();
    let limit = params.iter().find(|p| p["name"] == "limit").unwrap();
    assert_eq!(
        (&limit["schema"]["minimum"], &limit["schema"]["maximum"]),
        (&json!(1), &json!(5000)),
        "{limit}"
    );
    assert!(
        params
            .iter()
            .any(|p| p["name"] == "after" && p["in"] == "query")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_what_the_client_sent_not_where_the_broker_keeps_files() {
    let s = TestServer::start(|_| {}).await;
    let (_, view) = s.post("/v1/jobs", job("on-demand")).await;
    let (_, _, token) = agent_of(&s, view["id"].as_i64().unwrap(), 0).await;
    let (status, body, _) = raw(
        &s,
        Method::GET,
        "/v1/downloads/data/nope.csv",
        Some(&token),
        None,
        vec![],
    )
    .await;
    assert_eq!(status, 404, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    let message = answer["message"].as_str().unwrap();
    assert_eq!(message, "data set `nope.csv` is not available here");
    let data_dir = crate::support::data("ml");
    for leak in [
        data_dir.display().to_string(),
        "/data/ml".to_string(),
        "os error".to_string(),
    ] {
        assert!(!body.contains(&leak), "{body} names {leak}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_says_what_handlers_require_and_cancel_keeps_the_job() {
    let s = TestServer::start(|_| {}).await;
    let (_, doc) = s.call(Method::GET, "/v1/openapi.json", None, None).await;
    let param = |path: &str, name: &str| {
        doc["paths"][path]["get"]["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{path} has no parameter {name}"))
    };
    for path in ["/v1/jobs/{id}/chart", "/v1/markets/chart"] {
        let format = param(path, "format");
        let schema = &format["schema"];
        let values = schema["enum"]
            .as_array()
            .or_else(|| {
                schema["oneOf"]
                    .as_array()
                    .and_then(|o| o.iter().find_map(|v| v["enum"].as_array()))
            })
            .unwrap_or_else(|| panic!("{path}: `format` has no enum: {format}"));
        assert!(
            values.contains(&json!("svg")) && values.contains(&json!("png")),
            "{format}"
        );
        assert!(!values.contains(&json!("")), "{format}");
        let market = if path == "/v1/markets/chart" {
            Some(param(path, "market"))
        } else {
            None
        };
        if let Some(m) = market {
            assert_eq!(m["schema"]["minLength"], 1, "{m}");
        }
    }
    let market = param("/v1/prices", "market");
    assert_eq!(market["schema"]["minLength"], 1, "{market}");
    let policy = &doc["components"]["schemas"]["JobSpec"]["properties"]["policy"];
    assert_eq!(policy["minLength"], 1, "{policy}");
    for name in ["bidbrain", "on-demand", "standard-bidding"] {
        assert!(
            policy["enum"].as_array().unwrap().contains(&json!(name)),
            "{policy}"
        );
    }
    // What the handlers do agrees: empty values are refused.
    for path in [
        "/v1/jobs/1/chart?format=",
        "/v1/markets/chart?market=us-east-1a/c3.xlarge&format=",
        "/v1/prices?market=",
    ] {
        let (status, answer) = s.get(path).await;
        assert_eq!(status, 422, "{path}: {answer}");
    }
    let mut spec = job("on-demand");
    spec["policy"] = json!("");
    assert_eq!(s.post("/v1/jobs", spec).await.0, 422);

    // Cancelling is `POST …/cancel`; the job stays readable. The `DELETE` that did the same
    // (deprecated since issue 23: a `DELETE` promises the resource is gone) is retired.
    let cancel = &doc["paths"]["/v1/jobs/{id}/cancel"]["post"];
    assert!(
        cancel["security"].as_array().is_some_and(|s| !s.is_empty()),
        "{cancel}"
    );
    assert!(
        doc["paths"]["/v1/jobs/{id}"].get("delete").is_none(),
        "{}",
        doc["paths"]["/v1/jobs/{id}"]
    );
    let (_, view) = s.post("/v1/jobs", job("on-demand")).await;
    let id = view["id"].as_i64().unwrap();
    let (status, view) = s.post(&format!("/v1/jobs/{id}/cancel"), json!({})).await;
    assert_eq!(
        (status, view["state"].as_str()),
        (200, Some("cancelled")),
        "{view}"
    );
    for path in ["", "/cost", "/events", "/logs"] {
        let (status, answer) = s.get(&format!("/v1/jobs/{id}{path}")).await;
        assert_eq!(status, 200, "{path}: {answer}");
    }
    let (status, _) = s.post(&format!("/v1/jobs/{id}/cancel"), json!({})).await;
    assert_eq!(status, 409, "cancelling twice");
    let (_, view) = s.post("/v1/jobs", job("on-demand")).await;
    let other = view["id"].as_i64().unwrap();
    let (status, body, headers) = raw(
        &s,
        Method::DELETE,
        &format!("/v1/jobs/{other}"),
        Some(TOKEN),
        None,
        vec![],
    )
    .await;
    assert_eq!(status, 405, "{body}");
    let allow = headers["allow"].to_str().unwrap_or_default();
    assert!(
        allow.contains("GET") && !allow.contains("DELETE"),
        "{allow}"
    );
    assert_ne!(
        s.get(&format!("/v1/jobs/{other}")).await.1["state"],
        "cancelled",
        "a refused DELETE cancels nothing"
    );
}
