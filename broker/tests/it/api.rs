//! The REST API over real HTTP against a broker on Postgres with the simulated cloud (no agent
//! processes here; `tests/e2e` runs those). The market clock is stepped by the test.

use crate::support::TestDb;
use proteus_broker::clock::{Clock, ManualClock};
use proteus_broker::market::Timestamp;
use proteus_broker::service::{Broker, Pacing};
use proteus_broker::startup::{ServeArgs, StartOptions, start_with};
use serde_json::{Value, json};
use std::sync::Arc;

/// At least 32 characters, as `proteus serve` requires of a user token.
pub(crate) const TOKEN: &str = "pt_test-user-token-of-32-characters";

pub(crate) struct TestServer {
    pub(crate) url: String,
    pub(crate) broker: Arc<Broker>,
    pub(crate) clock: ManualClock,
    pub(crate) http: reqwest::Client,
    task: tokio::task::JoinHandle<()>,
    _db: TestDb,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestServer {
    pub(crate) async fn start(tweak: impl FnOnce(&mut ServeArgs)) -> TestServer {
        let db = TestDb::postgres().await;
        let clock = ManualClock::new(Timestamp::parse("2015-05-01T00:00:00Z").unwrap());
        let mut args = ServeArgs::sim_defaults();
        args.token = Some(TOKEN.into());
        args.local_agents = Some(false);
        args.start = Some("2015-05-01T00:00:00Z".into());
        tweak(&mut args);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = start_with(
            db.store.clone(),
            args,
            listener,
            StartOptions {
                clock: Some(Arc::new(clock.clone())),
                pacing: Some(Pacing::Modelled),
                ..Default::default()
            },
        )
        .await
        .expect("broker starts");
        let url = format!("http://{}", server.addr);
        let (broker, task) = server.serve_api();
        TestServer {
            url,
            broker,
            clock,
            http: reqwest::Client::new(),
            task,
            _db: db,
        }
    }

    pub(crate) async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut req = self.http.request(method, format!("{}{path}", self.url));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub(crate) async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call(reqwest::Method::POST, path, Some(TOKEN), Some(body))
            .await
    }
    pub(crate) async fn get(&self, path: &str) -> (u16, Value) {
        self.call(reqwest::Method::GET, path, Some(TOKEN), None)
            .await
    }
    /// `POST /v1/jobs/{id}/cancel`.
    pub(crate) async fn cancel(&self, id: i64) -> (u16, Value) {
        self.call(
            reqwest::Method::POST,
            &format!("/v1/jobs/{id}/cancel"),
            Some(TOKEN),
            None,
        )
        .await
    }

    /// Advances market time and runs one scheduler pass.
    pub(crate) async fn step(&self, secs: f64) {
        self.clock.advance_secs(secs);
        self.broker.tick().await.expect("tick");
    }
}

pub(crate) fn job(policy: &str) -> Value {
    json!({
        "name": "api-test",
        "app": "mlr",
        "policy": policy,
        "limits": {"max_instances": 4, "max_reliable_instances": 1},
        "work": {"total_work": 8.0}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_4xx_naming_the_field() {
    let s = TestServer::start(|_| {}).await;
    let cases: Vec<(Value, u16, Option<&str>)> = vec![
        (
            json!({"app": "mlr", "policy": "bidbrain", "limits": {"max_instances": -1}}),
            422,
            Some("limits.max_instances"),
        ),
        (
            json!({"app": "mlr", "policy": "bidbrain", "limits": {"max_instances": 0}}),
            422,
            Some("limits.max_instances"),
        ),
        (
            json!({"app": "svm", "policy": "bidbrain", "limits": {"max_instances": 2}}),
            422,
            Some("app"),
        ),
        (
            json!({"app": "mlr", "policy": "bidbrain", "limits": {"max_instances": "many"}}),
            422,
            Some("limits.max_instances"),
        ),
        (
            json!({"app": "mlr", "policy": "bidbrain", "limits": {"max_instances": 2}, "colour": 1}),
            422,
            Some("colour"),
        ),
        (
            json!({"app": "mlr", "policy": "no-such-policy", "limits": {"max_instances": 2}}),
            422,
            Some("policy"),
        ),
        (json!({"app": "mlr", "policy": "bidbrain"}), 422, None),
        (
            json!({"app": "mlr", "policy": "bidbrain", "limits": {"max_instances": 2, "budget_usd": -5}}),
            422,
            Some("limits.budget_usd"),
        ),
        (
            json!({"app": "mlr", "policy": "bidbrain", "limits": {"max_instances": 2}, "work": {"instance_types": ["p9.huge"]}}),
            409,
            Some("work.instance_types[0]"),
        ),
    ];
    for (body, status, field) in cases {
        let (got, answer) = s.post("/v1/jobs", body.clone()).await;
        assert_eq!(got, status, "{body} -> {answer}");
        assert!(
            answer["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{answer}"
        );
        if let Some(f) = field {
            assert_eq!(answer["field"], f, "{body} -> {answer}");
        }
    }
    // Malformed JSON and a wrong content type.
    let resp = s
        .http
        .post(format!("{}/v1/jobs", s.url))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body("{\"app\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let resp = s
        .http
        .post(format!("{}/v1/jobs", s.url))
        .bearer_auth(TOKEN)
        .body("app=mlr")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 415);
    for path in [
        "/v1/jobs/abc",
        "/v1/jobs/0",
        "/v1/jobs/999999",
        "/v1/jobs/-3/cost",
        "/v1/nothing",
    ] {
        let (status, _) = s.get(path).await;
        assert_eq!(status, 404, "{path}");
    }
    let (status, answer) = s.get("/v1/prices?market=nowhere").await;
    assert_eq!((status, answer["field"].as_str()), (422, Some("market")));
    assert_eq!(
        s.broker.store().jobs(false).await.unwrap().len(),
        0,
        "nothing was stored"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_checked_and_scoped_to_their_instance() {
    let s = TestServer::start(|_| {}).await;
    let (status, _) = s.call(reqwest::Method::GET, "/v1/jobs", None, None).await;
    assert_eq!(status, 401);
    let (status, _) = s
        .call(reqwest::Method::GET, "/v1/jobs", Some("pt_wrong"), None)
        .await;
    assert_eq!(status, 401);
    let (status, _) = s.get("/healthz").await;
    assert_eq!(status, 200, "health needs no token");

    // Two jobs, each with one launched instance whose agent token we know.
    let mut tokens = Vec::new();
    for _ in 0..2 {
        let (status, view) = s.post("/v1/jobs", job("on-demand")).await;
        assert_eq!(status, 201, "{view}");
        let id = proteus_wire::JobId(view["id"].as_i64().unwrap());
        let market = proteus_broker::market::Market::parse("us-east-1a/c3.xlarge").unwrap();
        let token = proteus_broker::api::auth::new_token("pa_");
        let row = proteus_broker::store::InstanceRow {
            id: format!("pi-test-{}", id.0),
            job_id: id,
            cloud_id: None,
            market,
            tier: proteus_wire::Tier::Reliable,
            bid: None,
            state: proteus_broker::store::InstanceState::Requested,
            token_hash: proteus_broker::api::auth::hash_token(&token),
            requested: s.clock.now(),
            launched: None,
            ready: None,
            warned: None,
            ended: None,
            end_reason: None,
            ended_by_provider: false,
            launch_error: None,
            metadata_addr: None,
            agent_pid: None,
            stop_by: None,
            launch_token: None,
            bootstrap_hash: None,
            bootstrap_used: None,
        };
        s.broker.store().insert_instance(None, &row).await.unwrap();
        let cloud_id = format!("i-test{}", id.0);
        s.broker
            .store()
            .mark_launched(None, &row.id, &cloud_id, s.clock.now())
            .await
            .unwrap();
        tokens.push((cloud_id, token));
    }
    let (a_id, a_token) = &tokens[0];
    let (b_id, b_token) = &tokens[1];
    async fn register(s: &TestServer, id: &str, t: Option<&str>) -> u16 {
        let body = json!({"instance_id": id, "data_addr": "127.0.0.1:9", "vcpus": 2, "protocol_version": proteus_wire::agent_api::PROTOCOL_VERSION});
        s.call(reqwest::Method::POST, "/v1/agents/register", t, Some(body))
            .await
            .0
    }
    assert_eq!(register(&s, a_id, Some(a_token)).await, 200, "own token");
    // An agent of another protocol version (or one from before versions, which sends none) is
    // refused at the hello, both versions named, and does not join.
    for other in [None, Some(proteus_wire::agent_api::PROTOCOL_VERSION + 1)] {
        let mut body = json!({"instance_id": b_id, "data_addr": "127.0.0.1:9", "vcpus": 2});
        if let Some(v) = other {
            body["protocol_version"] = json!(v);
        }
        let (status, answer) = s
            .call(
                reqwest::Method::POST,
                "/v1/agents/register",
                Some(b_token),
                Some(body),
            )
            .await;
        assert_eq!(status, 409, "{answer}");
        assert_eq!(answer["code"], "protocol_mismatch", "{answer}");
        let message = answer["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("agent protocol {}", other.unwrap_or(0)))
                && message.contains(&format!(
                    "this broker {}",
                    proteus_wire::agent_api::PROTOCOL_VERSION
                )),
            "{message}"
        );
    }
    assert_eq!(
        register(&s, b_id, Some(a_token)).await,
        403,
        "another instance's token"
    );
    assert_eq!(register(&s, b_id, Some("pa_bogus")).await, 401);
    assert_eq!(register(&s, b_id, None).await, 401);
    let (status, _) = s
        .call(
            reqwest::Method::POST,
            &format!("/v1/agents/{b_id}/heartbeat"),
            Some(a_token),
            Some(json!({})),
        )
        .await;
    assert_eq!(
        status, 403,
        "an agent cannot act for another job's instance"
    );
    let (status, _) = s
        .call(reqwest::Method::GET, "/v1/jobs/2", Some(b_token), None)
        .await;
    assert_eq!(status, 403, "agent tokens cannot read the job API");
    let (status, _) = s
        .call(
            reqwest::Method::POST,
            "/v1/jobs/1/cancel",
            Some(a_token),
            None,
        )
        .await;
    assert_eq!(status, 403);
    assert_eq!(
        s.get("/v1/jobs/1").await.1["state"],
        "pending",
        "not cancelled by the agent"
    );

    // What a booting VM fetches: data sets (and the agent binary), with its instance token only.
    let fetch = |path: &str, token: Option<&str>| {
        let mut req = s.http.get(format!("{}{path}", s.url));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    let resp = fetch("/v1/downloads/data/digits-8x8.csv.gz", Some(a_token))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.bytes().await.unwrap();
    assert_eq!(
        &body[..],
        &std::fs::read(crate::support::data("ml/digits-8x8.csv.gz")).unwrap()[..]
    );
    assert_eq!(
        fetch("/v1/downloads/data/digits-8x8.csv.gz", None)
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(
        fetch("/v1/downloads/data/digits-8x8.csv.gz", Some(TOKEN))
            .await
            .unwrap()
            .status(),
        401
    );
    for bad in ["..%2FSOURCES.md", ".hidden", "nope.csv"] {
        let status = fetch(&format!("/v1/downloads/data/{bad}"), Some(a_token))
            .await
            .unwrap()
            .status();
        assert_eq!(status, 404, "{bad}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_launch_cancel_releases_every_instance_and_closes_the_ledger() {
    let s = TestServer::start(|_| {}).await;
    let (status, view) = s.post("/v1/jobs", job("bidbrain")).await;
    assert_eq!(status, 201, "{view}");
    let id = view["id"].as_i64().unwrap();
    // Before any work, the baselines have nothing to do either: no simulation, no cost.
    let (status, cost) = s.get(&format!("/v1/jobs/{id}/cost")).await;
    assert_eq!(status, 200, "{cost}");
    for c in cost["counterfactuals"].as_array().unwrap() {
        assert_eq!(
            (c["cost_usd"].as_f64(), c["note"].as_str()),
            (Some(0.0), Some("no work done yet")),
            "{cost}"
        );
    }
    // Eight minutes: past the instances' five minutes of start-up, so they do some work.
    for _ in 0..8 {
        s.step(60.0).await;
    }
    let (_, view) = s.get(&format!("/v1/jobs/{id}")).await;
    assert_eq!(view["state"], "running", "{view}");
    let live = view["instances_by_tier"]["reliable"].as_u64().unwrap()
        + view["instances_by_tier"]["transient"].as_u64().unwrap();
    assert!((2..=4).contains(&live), "{view}");
    assert!(view["instances_by_tier"]["reliable"].as_u64().unwrap() <= 1);
    let described = s.broker.cloud().describe().await.unwrap();
    assert_eq!(
        described.iter().filter(|c| !c.state.is_gone()).count() as u64,
        live,
        "the cloud agrees with the store"
    );

    let (status, view) = s.cancel(id).await;
    assert_eq!(
        (status, view["state"].as_str()),
        (200, Some("cancelled")),
        "{view}"
    );
    let (status, _) = s.cancel(id).await;
    assert_eq!(status, 409, "cancelling twice is a conflict");
    s.step(1.0).await;
    let described = s.broker.cloud().describe().await.unwrap();
    assert!(
        described.iter().all(|c| c.state.is_gone()),
        "every instance terminated: {described:?}"
    );
    let rows = s
        .broker
        .store()
        .instances_of_job(proteus_wire::JobId(id))
        .await
        .unwrap();
    assert!(rows.iter().all(|r| r.state.is_final()), "{rows:?}");

    let (status, cost) = s.get(&format!("/v1/jobs/{id}/cost")).await;
    assert_eq!(status, 200, "{cost}");
    let total = cost["total_usd"].as_f64().unwrap();
    let lines: f64 = cost["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["amount_usd"].as_f64().unwrap())
        .sum();
    // Times in RFC 3339, as everywhere else in the API.
    for l in cost["lines"].as_array().unwrap() {
        for k in ["start", "end"] {
            let t = l[k].as_str().unwrap_or_else(|| panic!("{k} of {l}"));
            assert!(
                chrono::DateTime::parse_from_rfc3339(t).is_ok(),
                "{k} of {l}"
            );
        }
    }
    let tiers: f64 = cost["by_tier"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .sum();
    assert!(
        total > 0.0 && (total - lines).abs() < 1e-9 && (total - tiers).abs() < 1e-9,
        "{cost}"
    );
    s.step(3600.0).await;
    let (_, later) = s.get(&format!("/v1/jobs/{id}/cost")).await;
    assert_eq!(
        later["total_usd"], cost["total_usd"],
        "the ledger is closed"
    );
    // What the scheduler counts as spent (against a budget) is the ledger's total, also once
    // the ended instances' final bills are kept instead of recomputed.
    for _ in 0..2 {
        let spent = s
            .broker
            .refresh_ledger(proteus_wire::JobId(id), s.clock.now())
            .await
            .unwrap();
        assert!((spent.get() - total).abs() < 1e-9, "{spent} vs {total}");
    }
    // The job worked, so each baseline is simulated doing that work: a cost, and no note.
    assert!(cost["work_units"].as_f64().unwrap() > 0.0, "{cost}");
    let counterfactuals = cost["counterfactuals"].as_array().unwrap();
    assert_eq!(counterfactuals.len(), 2, "{cost}");
    for c in counterfactuals {
        assert!(c["cost_usd"].as_f64().unwrap() > 0.0, "{cost}");
        assert!(c.get("note").is_none(), "{cost}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_errors_cool_the_market_down_and_the_policy_buys_elsewhere() {
    let s = TestServer::start(|a| {
        a.inject_launch_faults = Some("*/c3.xlarge=insufficient-capacity".into())
    })
    .await;
    let body = json!({
        "app": "mlr", "policy": "on-demand",
        "limits": {"max_instances": 2, "max_reliable_instances": 2},
        "work": {"total_work": 4.0, "instance_types": ["c3.xlarge", "r3.large"]}
    });
    let (status, view) = s.post("/v1/jobs", body).await;
    assert_eq!(status, 201, "{view}");
    let id = view["id"].as_i64().unwrap();
    for _ in 0..5 {
        s.step(60.0).await;
    }
    let (_, view) = s.get(&format!("/v1/jobs/{id}")).await;
    let reasons = view["unavailable_markets"].as_array().unwrap();
    assert!(
        reasons.iter().any(|r| r
            .as_str()
            .unwrap()
            .contains("c3.xlarge: insufficient-capacity")),
        "the reason is visible: {view}"
    );
    let instances = view["instances"].as_array().unwrap();
    assert!(instances.iter().any(|i| i["state"] == "failed" && i["market"].as_str().unwrap().ends_with("c3.xlarge")));
    assert!(
        instances.iter().any(|i| i["state"] == "running" && i["market"].as_str().unwrap().ends_with("r3.large")),
        "bought elsewhere: {view}"
    );
    let (_, events) = s.get(&format!("/v1/jobs/{id}/events")).await;
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "launch_failed")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_ends_a_job() {
    let s = TestServer::start(|_| {}).await;
    let mut body = job("on-demand");
    body["limits"]["budget_usd"] = json!(0.5);
    body["work"]["total_work"] = json!(50.0);
    let (_, view) = s.post("/v1/jobs", body).await;
    let budget_job = view["id"].as_i64().unwrap();
    for _ in 0..20 {
        s.step(30.0).await;
    }
    let (_, view) = s.get(&format!("/v1/jobs/{budget_job}")).await;
    assert!(
        view["work"]["deadline_slack_hours"].is_null(),
        "no deadline: {view}"
    );
    for _ in 20..360 {
        s.step(30.0).await;
    }
    let (_, view) = s.get(&format!("/v1/jobs/{budget_job}")).await;
    assert_eq!(view["state"], "failed", "{view}");
    assert!(
        view["state_reason"].as_str().unwrap().contains("budget"),
        "{view}"
    );
    // $0.50 buys two first hours at $0.21; the job ends before their second hours start.
    assert_eq!(
        view["instances"].as_array().unwrap().len(),
        2,
        "two launches fit the budget: {view}"
    );
    let spend = view["spend_usd"].as_f64().unwrap();
    assert!(
        (spend - 0.42).abs() < 1e-9,
        "spend stays within the budget (two instance-hours): {view}"
    );
    assert!(
        s.broker
            .cloud()
            .describe()
            .await
            .unwrap()
            .iter()
            .all(|c| c.state.is_gone())
    );
}

/// A deadline that not even on-demand at full speed can meet is refused at submission, with
/// the arithmetic and nothing stored; one that could be met but is not (its only type has no
/// capacity) is shown at risk, then ends the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_out_of_reach_is_refused_and_a_missed_one_ends_the_job() {
    let s = TestServer::start(|a| {
        a.inject_launch_faults = Some("*/c3.xlarge=insufficient-capacity".into())
    })
    .await;
    let body = |hours: f64| {
        json!({
            "name": "deadline", "app": "mlr", "policy": "on-demand",
            "limits": {"max_instances": 4, "max_reliable_instances": 4, "deadline_hours": hours},
            "work": {"total_work": 8.0, "instance_types": ["c3.xlarge"],
                     "reference_type": "c3.xlarge", "startup_minutes": 6.0}
        })
    };
    // 8 units on 4 instances of 1 unit/h each: 2 h, plus 6 min of start-up.
    for (hours, at) in [(1.0, "1.00 h away"), (2.09, "2.09 h away")] {
        let (status, err) = s.post("/v1/jobs", body(hours)).await;
        assert_eq!(status, 409, "{err}");
        assert_eq!(err["code"], "unmet", "{err}");
        let text = err.to_string();
        for part in [
            "limits.deadline_hours",
            "cannot be met even on on-demand",
            "8 units of work",
            "4 instances at 1 units/h",
            "2.00 h",
            "6 min of start-up",
            "2.10 h in all",
            "Allow at least 2.10 h",
            at,
        ] {
            assert!(text.contains(part), "{part:?} missing: {text}");
        }
    }
    let (_, jobs) = s.get("/v1/jobs").await;
    assert_eq!(jobs.as_array().unwrap().len(), 0, "nothing stored: {jobs}");
    // The dry run says the same.
    let (status, err) = s.post("/v1/jobs/dry-run", body(1.0)).await;
    assert_eq!(status, 409, "{err}");

    // Exactly what the error asked for is accepted.
    let (status, view) = s.post("/v1/jobs/dry-run", body(2.1)).await;
    assert_eq!(status, 200, "{view}");
    // Reachable on paper; the cloud has no c3.xlarge to give.
    let (status, view) = s.post("/v1/jobs", body(2.2)).await;
    assert_eq!(status, 201, "{view}");
    let id = view["id"].as_i64().unwrap();
    for _ in 0..30 {
        s.step(30.0).await;
    }
    // A quarter of an hour in, nothing done: 2.2 h − 0.25 h − 2 h of work at full speed.
    let (_, view) = s.get(&format!("/v1/jobs/{id}")).await;
    let slack = view["work"]["deadline_slack_hours"].as_f64().unwrap();
    assert!((-0.2..0.0).contains(&slack), "{view}");
    assert_eq!(view["work"]["deadline_at_risk"], true, "{view}");
    for _ in 30..300 {
        s.step(30.0).await;
    }
    let (_, view) = s.get(&format!("/v1/jobs/{id}")).await;
    assert_eq!(view["state"], "failed", "{view}");
    assert!(
        view["state_reason"].as_str().unwrap().contains("deadline"),
        "{view}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_body_causes_a_server_error() {
    use rand::{Rng, SeedableRng};
    let s = TestServer::start(|_| {}).await;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let leaves = [
        json!(null),
        json!(-1),
        json!(0),
        json!(1e308),
        json!(4_294_967_296u64),
        json!("x"),
        json!(""),
        json!([]),
        json!({}),
        json!(true),
        json!("2015-05-02T00:00:00Z"),
        json!(f64::MIN_POSITIVE),
    ];
    let keys = [
        "app", "policy", "limits", "work", "training", "stop", "billing", "dataset", "name",
    ];
    for case in 0..300 {
        let mut body = job(["bidbrain", "on-demand", "standard-bidding"][case % 3]);
        for _ in 0..rng.random_range(1..4) {
            let key = keys[rng.random_range(0..keys.len())];
            let leaf = leaves[rng.random_range(0..leaves.len())].clone();
            match body.get_mut(key) {
                Some(Value::Object(inner)) if !inner.is_empty() && rng.random_bool(0.6) => {
                    let k = inner
                        .keys()
                        .nth(rng.random_range(0..inner.len()))
                        .unwrap()
                        .clone();
                    inner.insert(k, leaf);
                }
                _ => {
                    body[key] = leaf;
                }
            }
        }
        let (status, answer) = s.post("/v1/jobs", body.clone()).await;
        assert!(status < 500, "{body} -> {status} {answer}");
        if status >= 400 {
            assert!(answer["message"].is_string(), "{answer}");
        }
    }
    for path in [
        "/v1/agents/i-x/commands?after=-1",
        "/v1/agents/i-x/commands?wait_ms=abc",
        "/v1/prices",
        "/v1/prices?market=us-east-1a/c3.xlarge&from=x",
    ] {
        let (status, _) = s.get(path).await;
        assert!((400..500).contains(&status), "{path} -> {status}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_describes_every_route() {
    let s = TestServer::start(|_| {}).await;
    let (status, doc) = s
        .call(reqwest::Method::GET, "/v1/openapi.json", None, None)
        .await;
    assert_eq!(status, 200);
    let paths = doc["paths"].as_object().unwrap();
    for p in [
        "/v1/jobs",
        "/v1/jobs/dry-run",
        "/v1/jobs/{id}",
        "/v1/jobs/{id}/cancel",
        "/v1/jobs/{id}/cost",
        "/v1/markets",
        "/v1/prices",
        "/v1/agents/register",
        "/v1/agents/{instance_id}/heartbeat",
        "/v1/agents/{instance_id}/commands",
        "/v1/agents/{instance_id}/events",
        "/healthz",
        "/metrics",
    ] {
        assert!(
            paths.contains_key(p),
            "{p} missing from the OpenAPI document"
        );
    }
    assert!(doc["components"]["schemas"]["JobSpec"].is_object());
    // The agents' bodies are described too (a fuzzer generates them from this document).
    for (path, method, schema) in [
        ("/v1/agents/register", "post", "RegisterRequest"),
        ("/v1/agents/{instance_id}/heartbeat", "post", "Heartbeat"),
        ("/v1/agents/{instance_id}/events", "post", "AgentEvent"),
    ] {
        let body = &doc["paths"][path][method]["requestBody"]["content"]["application/json"];
        assert_eq!(
            body["schema"]["$ref"],
            format!("#/components/schemas/{schema}"),
            "{method} {path}"
        );
    }
    for schema in [
        "RegisterResponse",
        "CommandEnvelope",
        "ClusterView",
        "Progress",
    ] {
        assert!(
            doc["components"]["schemas"][schema].is_object(),
            "{schema} missing from the OpenAPI components"
        );
    }
    let (status, markets) = s.get("/v1/markets").await;
    assert_eq!(status, 200);
    assert_eq!(markets.as_array().unwrap().len(), 15);
    let (status, prices) = s
        .get("/v1/prices?market=us-east-1a/c3.xlarge&from=2015-04-01&to=2015-04-02")
        .await;
    assert_eq!(status, 200);
    assert!(!prices.as_array().unwrap().is_empty());
    let (_, metrics) = s.get("/metrics").await;
    assert!(
        metrics
            .as_str()
            .unwrap()
            .contains("proteus_jobs{state=\"running\"}")
    );
}

/// Every agent endpoint, called for instance `cloud_id` with `token`: (endpoint, status).
async fn agent_endpoints(s: &TestServer, cloud_id: &str, token: &str) -> Vec<(&'static str, u16)> {
    let t = Some(token);
    let register = json!({"instance_id": cloud_id, "data_addr": "127.0.0.1:9", "vcpus": 2, "protocol_version": proteus_wire::agent_api::PROTOCOL_VERSION});
    let mut out = vec![(
        "register",
        s.call(
            reqwest::Method::POST,
            "/v1/agents/register",
            t,
            Some(register),
        )
        .await
        .0,
    )];
    let heartbeat = format!("/v1/agents/{cloud_id}/heartbeat");
    out.push((
        "heartbeat",
        s.call(reqwest::Method::POST, &heartbeat, t, Some(json!({})))
            .await
            .0,
    ));
    let events = format!("/v1/agents/{cloud_id}/events");
    let event = json!({"type": "rebalance_recommendation"});
    out.push((
        "events",
        s.call(reqwest::Method::POST, &events, t, Some(event))
            .await
            .0,
    ));
    let commands = format!("/v1/agents/{cloud_id}/commands?after=0&wait_ms=0");
    out.push((
        "commands",
        s.call(reqwest::Method::GET, &commands, t, None).await.0,
    ));
    let download = s
        .http
        .get(format!("{}/v1/downloads/data/digits-8x8.csv.gz", s.url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16();
    out.push(("download", download));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_tokens_are_scoped_to_one_live_instance_even_within_a_job() {
    let s = TestServer::start(|_| {}).await;
    let (status, view) = s.post("/v1/jobs", job("on-demand")).await;
    assert_eq!(status, 201, "{view}");
    let job_id = proteus_wire::JobId(view["id"].as_i64().unwrap());
    // Two instances of the same job, whose agent tokens we know.
    let mut agents = Vec::new();
    for k in 0..2 {
        let token = proteus_broker::api::auth::new_token("pa_");
        let row = proteus_broker::store::InstanceRow::intent(
            format!("pi-same-{k}"),
            job_id,
            proteus_broker::market::Market::parse("us-east-1a/c3.xlarge").unwrap(),
            proteus_broker::policy::Purchase::OnDemand,
            proteus_broker::api::auth::hash_token(&token),
            s.clock.now(),
        );
        s.broker.store().insert_instance(None, &row).await.unwrap();
        let cloud_id = format!("i-same{k}");
        s.broker
            .store()
            .mark_launched(None, &row.id, &cloud_id, s.clock.now())
            .await
            .unwrap();
        agents.push((row.id, cloud_id, token));
    }
    let (a_row, a_cloud, a_token) = &agents[0];
    let (b_row, b_cloud, b_token) = &agents[1];

    for (endpoint, status) in agent_endpoints(&s, a_cloud, a_token).await {
        assert!(
            (200..300).contains(&status),
            "{endpoint}: own token: {status}"
        );
    }
    for (endpoint, status) in agent_endpoints(&s, a_cloud, b_token).await {
        if endpoint != "download" {
            assert_eq!(
                status, 403,
                "{endpoint}: a token of another instance of the same job"
            );
        }
    }

    // The instance ends (as the scheduler records it): its token dies with it, everywhere.
    let row = s.broker.store().instance(a_row).await.unwrap().unwrap();
    let now = s.clock.now();
    s.broker.on_ended(&row, now, false, now).await.unwrap();
    for (endpoint, status) in agent_endpoints(&s, a_cloud, a_token).await {
        assert_eq!(status, 403, "{endpoint}: the token of an ended instance");
    }
    // The other instance is not affected.
    for (endpoint, status) in agent_endpoints(&s, b_cloud, b_token).await {
        assert!(
            (200..300).contains(&status),
            "{endpoint}: the live instance: {status}"
        );
    }
    // Its events were logged; a rebalance recommendation is not a warning.
    let row = s.broker.store().instance(b_row).await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.warned),
        (proteus_broker::store::InstanceState::Running, None),
        "{row:?}"
    );

    // An id no cloud gives (a NUL in it, which Postgres cannot even look up): no such
    // instance, so a valid token is somebody else's. Refused, not a server error.
    let (status, body) = s
        .call(
            reqwest::Method::POST,
            "/v1/agents/i-%00x/heartbeat",
            Some(b_token),
            Some(json!({})),
        )
        .await;
    assert_eq!(status, 403, "{body}");

    // A registration must say where the agent's peers reach it: a `host:port`, nothing else.
    let register = |addr: String| {
        json!({"instance_id": b_cloud, "data_addr": addr, "vcpus": 2,
               "protocol_version": proteus_wire::agent_api::PROTOCOL_VERSION})
    };
    for bad in [
        String::new(),
        "127.0.0.1 :9".to_string(),
        "127.0.0.1:9\n".to_string(),
        format!("{}:9", "h".repeat(255)),
    ] {
        let (status, body) = s
            .call(
                reqwest::Method::POST,
                "/v1/agents/register",
                Some(b_token),
                Some(register(bad.clone())),
            )
            .await;
        assert_eq!(
            (status, body["field"].as_str()),
            (422, Some("data_addr")),
            "{bad:?}: {body}"
        );
    }
    let longest = format!("{}:9", "h".repeat(254));
    let (status, body) = s
        .call(
            reqwest::Method::POST,
            "/v1/agents/register",
            Some(b_token),
            Some(register(longest)),
        )
        .await;
    assert_eq!(status, 200, "a 256-character address is fine: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interruption_sent_on_request_warns_a_spot_instance_and_is_refused_for_others() {
    let s = TestServer::start(|_| {}).await;
    let (status, view) = s.post("/v1/jobs", job("bidbrain")).await;
    assert_eq!(status, 201, "{view}");
    let id = view["id"].as_i64().unwrap();
    for _ in 0..5 {
        s.step(60.0).await;
    }
    let (_, view) = s.get(&format!("/v1/jobs/{id}")).await;
    let instances = view["instances"].as_array().unwrap();
    let of_tier = |tier: &str| {
        instances
            .iter()
            .find(|i| i["tier"] == tier && i["state"] == "running")
            .map(|i| i["id"].as_str().unwrap().to_string())
    };
    let (Some(spot), Some(reliable)) = (of_tier("transient"), of_tier("reliable")) else {
        panic!("BidBrain bought both tiers: {view}");
    };
    let path = |iid: &str| format!("/v1/instances/{iid}/interruption");

    let (status, body) = s.post(&path("pi-nope"), json!({})).await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = s.post(&path(&reliable), json!({})).await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("reliable"),
        "{body}"
    );
    let (status, _) = s
        .call(reqwest::Method::POST, &path(&spot), None, Some(json!({})))
        .await;
    assert_eq!(status, 401, "the user token is needed");

    let (status, sent) = s.post(&path(&spot), json!({})).await;
    assert_eq!(status, 202, "{sent}");
    assert_eq!(sent["instance_id"], spot.as_str());
    assert_eq!(sent["job_id"], id);
    s.step(1.0).await;
    let (_, view) = s.get(&format!("/v1/jobs/{id}")).await;
    let warned = view["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == spot.as_str())
        .unwrap();
    assert!(
        warned["warned"].is_string(),
        "the scheduler saw the warning: {warned}"
    );
    let (_, events) = s.get(&format!("/v1/jobs/{id}/events")).await;
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["instance_id"] == spot.as_str() && e["kind"] == "interruption_warning"),
        "{events}"
    );
    // Two market minutes later the cloud reclaims it; an ended instance cannot be interrupted.
    s.step(150.0).await;
    s.step(1.0).await;
    let (status, body) = s.post(&path(&spot), json!({})).await;
    assert_eq!(status, 409, "{body}");
}

/// The document says what the API does before a handler decides anything (bench/fuzz-api checks
/// the same with schemathesis): every operation needing a token documents 401, every JSON body
/// 400/415/422, every query string 400; query parameters are declared in the query, required
/// when they are; the job spec carries its bounds. And a request without credentials is told
/// so first, whatever its query string.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_is_truthful_about_refusals() {
    let s = TestServer::start(|_| {}).await;
    let (_, doc) = s
        .call(reqwest::Method::GET, "/v1/openapi.json", None, None)
        .await;
    let mut secured = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let responses = op["responses"].as_object().unwrap();
            let has = |code: &str| responses.contains_key(code);
            if op["security"].as_array().is_some_and(|s| !s.is_empty()) {
                secured += 1;
                assert!(has("401"), "{method} {path} does not document 401");
            }
            if op["requestBody"]["content"]["application/json"].is_object() {
                for code in ["400", "415", "422"] {
                    assert!(has(code), "{method} {path} does not document {code}");
                }
            }
            for p in op["parameters"].as_array().into_iter().flatten() {
                if p["in"] == "query" {
                    assert!(has("400"), "{method} {path} does not document 400");
                }
                if p["in"] == "path" {
                    let name = p["name"].as_str().unwrap();
                    assert!(
                        path.contains(&format!("{{{name}}}")),
                        "{method} {path}: `{name}` is declared a path parameter"
                    );
                }
            }
        }
    }
    assert!(secured >= 15, "only {secured} operations need a token");
    let param = |path: &str, name: &str| {
        doc["paths"][path]["get"]["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{path} has no parameter {name}"))
    };
    let market = param("/v1/prices", "market");
    assert_eq!(
        (&market["in"], &market["required"]),
        (&json!("query"), &json!(true))
    );
    let from = param("/v1/prices", "from");
    assert_eq!(from["in"], "query");
    assert_ne!(from["required"], json!(true), "`from` is optional");
    assert_eq!(param("/v1/markets/chart", "market")["required"], true);
    let limits = &doc["components"]["schemas"]["Limits"]["properties"]["max_instances"];
    assert_eq!(
        (&limits["minimum"], &limits["maximum"]),
        (&json!(1), &json!(1000)),
        "{limits}"
    );

    for path in [
        "/v1/prices",
        "/v1/prices?market=",
        "/v1/prices?market=us-east-1a/c3.xlarge&from=yesterday",
        "/v1/markets/chart?hours=lots",
        "/v1/jobs/1/chart?format=gif",
    ] {
        let (status, body) = s.call(reqwest::Method::GET, path, None, None).await;
        assert_eq!(status, 401, "{path} without credentials: {body}");
    }
    // With credentials, the query string is what is wrong.
    let (status, body) = s.get("/v1/prices").await;
    assert_eq!(status, 400, "{body}");
}

/// A spot instance the provider warned is an eviction whatever ends it during its notice:
/// here the user cancels the job before the reclaim. The report counts it, its end is the
/// provider's (an `evicted` event), and its partial hour is billed under the provider-ended
/// rule (free under `hourly-2015`) — live as in the simulator.
/// A BidBrain job five market minutes in: its id and view.
async fn bidbrain_job_running(s: &TestServer) -> (i64, Value) {
    let (status, view) = s.post("/v1/jobs", job("bidbrain")).await;
    assert_eq!(status, 201, "{view}");
    let id = view["id"].as_i64().unwrap();
    for _ in 0..5 {
        s.step(60.0).await;
    }
    let (_, view) = s.get(&format!("/v1/jobs/{id}")).await;
    (id, view)
}

/// Every launch of a BidBrain job follows a `decision` event that says what the policy
/// expected of it (cost, work, eviction probability over its hour) and by which rule; a
/// rule-based baseline records none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bidbrain_records_what_it_expected_of_every_launch() {
    let s = TestServer::start(|_| {}).await;
    let (id, _) = bidbrain_job_running(&s).await;
    let (_, od_view) = s.post("/v1/jobs", job("on-demand")).await;
    let od = od_view["id"].as_i64().unwrap();
    s.step(60.0).await;
    let events_of = |v: &Value| -> Vec<(String, String)> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["kind"].as_str().unwrap().to_string(),
                    e["detail"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let (_, events) = s.get(&format!("/v1/jobs/{id}/events")).await;
    let events = events_of(&events);
    let mut bought: Vec<String> = Vec::new();
    let mut launched = 0;
    for (kind, detail) in &events {
        if kind == "decision" {
            assert!(
                detail.starts_with("bidbrain: buy ") || detail.starts_with("bidbrain: release "),
                "{detail}"
            );
            for figure in [
                "expected $",
                " units of work in the next 1 h",
                "eviction probability ",
            ] {
                assert!(detail.contains(figure), "{figure:?} missing: {detail}");
            }
            // "buy N × region/zone/type ...": N launches in that market may follow.
            if let Some(rest) = detail.strip_prefix("bidbrain: buy ") {
                let mut words = rest.split(' ');
                let n: usize = words.next().unwrap().parse().unwrap();
                assert_eq!(words.next(), Some("×"), "{detail}");
                let market = words.next().unwrap().to_string();
                bought.extend(std::iter::repeat_n(market, n));
            }
        }
        if kind == "launched" {
            launched += 1;
            let market = detail.split(' ').next().unwrap();
            let k = bought.iter().position(|m| m == market).unwrap_or_else(|| {
                panic!("{detail}: launched without a decision that bought it:\n{events:?}")
            });
            bought.remove(k);
        }
    }
    assert!(launched >= 2, "{events:?}");
    let (_, od_events) = s.get(&format!("/v1/jobs/{od}/events")).await;
    let od_events = events_of(&od_events);
    assert!(
        od_events.iter().any(|(k, _)| k == "launched"),
        "{od_events:?}"
    );
    assert!(
        !od_events.iter().any(|(k, _)| k == "decision"),
        "the on-demand baseline weighs no expectations: {od_events:?}"
    );
}

/// The id of a running spot instance of the job `view` shows.
fn running_spot(view: &Value) -> String {
    view["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["tier"] == "transient" && i["state"] == "running")
        .map(|i| i["id"].as_str().unwrap().to_string())
        .unwrap_or_else(|| panic!("no spot instance: {view}"))
}

/// The provider warns `spot`, and job `id` is cancelled inside the notice: the user's
/// termination reaches the warned instance before the provider's reclaim does.
async fn warn_then_cancel(s: &TestServer, id: i64, spot: &str) {
    let (status, body) = s
        .post(&format!("/v1/instances/{spot}/interruption"), json!({}))
        .await;
    assert_eq!(status, 202, "{body}");
    s.step(1.0).await;
    let (status, body) = s.post(&format!("/v1/jobs/{id}/cancel"), json!({})).await;
    assert_eq!(status, 200, "{body}");
    for _ in 0..3 {
        s.step(1.0).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warned_instance_ended_during_its_notice_is_an_eviction() {
    let s = TestServer::start(|_| {}).await;
    let (id, view) = bidbrain_job_running(&s).await;
    let spot = running_spot(&view);
    warn_then_cancel(&s, id, &spot).await;
    let (_, cost) = s.get(&format!("/v1/jobs/{id}/cost")).await;
    assert_eq!(cost["evictions"], 1, "{cost}");
    assert!(
        cost["free_hours"].as_f64().unwrap_or(0.0) > 0.0,
        "the evicted partial hour is free under hourly-2015: {cost}"
    );
    let (_, events) = s.get(&format!("/v1/jobs/{id}/events")).await;
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["instance_id"] == spot.as_str() && e["kind"] == "evicted"),
        "{events}"
    );
}

/// The spend a running job shows bills every live instance as if the user released it now; the
/// view says how much of it an interruption would make free, and that part is what an eviction
/// takes off: the evicted instance's bill becomes zero (hourly-2015, first partial hour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spend_shown_says_what_an_interruption_would_make_free() {
    let s = TestServer::start(|_| {}).await;
    let (id, view) = bidbrain_job_running(&s).await;
    let (_, cost) = s.get(&format!("/v1/jobs/{id}/cost")).await;
    let billed = |cost: &Value, instance: &str| -> f64 {
        cost["lines"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["instance_id"] == instance)
            .map(|l| l["amount_usd"].as_f64().unwrap())
            .sum()
    };
    let instances = view["instances"].as_array().unwrap();
    // Live: running, or warned and still running until it leaves.
    let live_spot: Vec<&str> = instances
        .iter()
        .filter(|i| i["tier"] == "transient" && (i["state"] == "running" || i["state"] == "warned"))
        .map(|i| i["id"].as_str().unwrap())
        .collect();
    assert!(!live_spot.is_empty(), "no spot instance: {view}");
    assert!(
        instances.iter().any(|i| i["tier"] == "reliable"),
        "a reliable instance too: {view}"
    );
    let spend = view["spend_usd"].as_f64().unwrap();
    let provisional = view["spend_provisional_usd"].as_f64().unwrap();
    // Every live spot instance is in its first hour: its whole bill is provisional; the
    // reliable instance's is not.
    let spot_bills: f64 = live_spot.iter().map(|i| billed(&cost, i)).sum();
    assert!(provisional > 0.0 && provisional < spend, "{view}");
    assert!(
        (provisional - spot_bills).abs() < 1e-9,
        "provisional {provisional} = the live spot instances' bills {spot_bills}: {cost}"
    );

    // The provider warns one, and the job ends inside its notice (an eviction all the same):
    // the warned instance's bill is zero, as the view said; the others are billed as released.
    let victim = running_spot(&view);
    let victim = victim.as_str();
    let before = billed(&cost, victim);
    warn_then_cancel(&s, id, victim).await;
    let (_, view) = s.get(&format!("/v1/jobs/{id}")).await;
    let (_, cost) = s.get(&format!("/v1/jobs/{id}/cost")).await;
    let gone = view["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == victim)
        .unwrap();
    assert_eq!(gone["end_reason"], "evicted", "{view}");
    assert!(before > 0.0 && billed(&cost, victim) == 0.0, "{cost}");
    // Over, with every instance ended: nothing is provisional; the spend is the final cost.
    assert!(
        view["instances"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| !i["ended"].is_null()),
        "{view}"
    );
    assert_eq!(view["spend_provisional_usd"].as_f64(), Some(0.0), "{view}");
    assert_eq!(view["spend_usd"], cost["total_usd"], "{view}\n{cost}");
}

/// A dry run answers with the engine's first decision and stores and launches nothing; the job
/// submitted next buys exactly that at its first tick. Bad specs get the submission's errors,
/// and the route needs a token before it reads the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_shows_the_first_decision_and_launches_nothing() {
    let s = TestServer::start(|_| {}).await;
    let mut body = job("bidbrain");
    body["limits"]["max_instances"] = json!(3);
    let (status, _) = s
        .call(
            reqwest::Method::POST,
            "/v1/jobs/dry-run",
            None,
            Some(body.clone()),
        )
        .await;
    assert_eq!(status, 401);
    let (status, plan) = s.post("/v1/jobs/dry-run", body.clone()).await;
    assert_eq!(status, 200, "{plan}");
    let purchases = plan["purchases"].as_array().unwrap();
    let count: u64 = purchases.iter().map(|p| p["count"].as_u64().unwrap()).sum();
    assert!((1..=3).contains(&count), "{plan}");
    let per_hour: f64 = purchases
        .iter()
        .map(|p| p["usd_per_hour"].as_f64().unwrap() * p["count"].as_f64().unwrap())
        .sum();
    assert!((per_hour - plan["usd_per_hour"].as_f64().unwrap()).abs() < 1e-9);
    assert!(plan["expected_finish"].as_str().unwrap() > "2015-05-01T00:00:00Z");
    // Nothing stored, nothing launched.
    let (_, jobs) = s.get("/v1/jobs").await;
    assert_eq!(jobs.as_array().unwrap().len(), 0, "{jobs}");
    assert!(s.broker.cloud().describe().await.unwrap().is_empty());
    // Submitted at the same market time, the job buys what the dry run said.
    let (_, view) = s.post("/v1/jobs", body.clone()).await;
    let id = proteus_wire::JobId(view["id"].as_i64().unwrap());
    s.step(0.0).await;
    let mut bought: Vec<(String, String, u64)> = Vec::new();
    for row in s.broker.store().instances_of_job(id).await.unwrap() {
        let bid = row
            .bid
            .map_or("-".to_string(), |b| format!("{:.6}", b.get()));
        match bought
            .iter_mut()
            .find(|(m, b, _)| *m == row.market.to_string() && *b == bid)
        {
            Some((_, _, n)) => *n += 1,
            None => bought.push((row.market.to_string(), bid, 1)),
        }
    }
    let planned: Vec<(String, String, u64)> = purchases
        .iter()
        .map(|p| {
            (
                p["market"].as_str().unwrap().to_string(),
                p["bid_usd_per_hour"]
                    .as_f64()
                    .map_or("-".to_string(), |b| format!("{b:.6}")),
                p["count"].as_u64().unwrap(),
            )
        })
        .collect();
    // The store lists instances by id (random), the dry run in the order the policy asked.
    bought.sort();
    let mut planned = planned;
    planned.sort();
    assert_eq!(
        bought, planned,
        "the dry run and the first tick decided otherwise"
    );
    // A budget below one first hour: nothing bought, and why.
    let mut poor = job("on-demand");
    poor["limits"]["budget_usd"] = json!(0.01);
    let (status, plan) = s.post("/v1/jobs/dry-run", poor).await;
    assert_eq!(status, 200, "{plan}");
    assert!(plan["purchases"].as_array().unwrap().is_empty(), "{plan}");
    assert!(plan["held"].as_str().unwrap().contains("budget"), "{plan}");
    // A spec a submission would refuse, refused the same way.
    let mut bad = job("no-such-policy");
    bad["name"] = json!("bad");
    let (status, err) = s.post("/v1/jobs/dry-run", bad).await;
    assert_eq!(status, 422, "{err}");
    assert!(err.to_string().contains("policy"), "{err}");
}

/// `resources` as SkyPilot users write it: the job runs on the types that have it, stored with
/// the job and shown at submission; what no type here has is refused, naming what there is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resources_choose_the_instance_types_and_are_shown_at_submission() {
    let s = TestServer::start(|_| {}).await;
    let mut body = job("bidbrain");
    body["resources"] = json!({"accelerators": "K520:1"});
    let (status, view) = s.post("/v1/jobs", body.clone()).await;
    assert_eq!(status, 201, "{view}");
    assert_eq!(view["instance_types"], json!(["g2.2xlarge"]), "{view}");
    let id = view["id"].as_i64().unwrap();
    let (_, events) = s.get(&format!("/v1/jobs/{id}/events")).await;
    let submitted = events["events"]
        .as_array()
        .or(events.as_array())
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "job_submitted")
        .cloned()
        .unwrap_or_else(|| panic!("{events}"));
    assert!(
        submitted["detail"]
            .as_str()
            .unwrap()
            .contains("on g2.2xlarge (resources K520:1)"),
        "{submitted}"
    );
    s.step(0.0).await;
    let rows = s
        .broker
        .store()
        .instances_of_job(proteus_wire::JobId(id))
        .await
        .unwrap();
    assert!(!rows.is_empty());
    assert!(
        rows.iter()
            .all(|r| r.market.instance_type.as_str() == "g2.2xlarge"),
        "{rows:?}"
    );
    // The dry run shows the same types.
    let (_, plan) = s.post("/v1/jobs/dry-run", body).await;
    assert_eq!(plan["instance_types"], json!(["g2.2xlarge"]), "{plan}");
    // No V100 in the 2015 market: refused as valid but not on this market, saying what there
    // is.
    let mut body = job("bidbrain");
    body["resources"] = json!({"accelerators": "V100:1"});
    let (status, err) = s.post("/v1/jobs", body).await;
    assert_eq!(status, 409, "{err}");
    assert_eq!(err["code"], "unmet", "{err}");
    let text = err.to_string();
    assert!(
        text.contains("resources") && text.contains("g2.2xlarge has K520:1"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulated_market_is_held_where_asked_and_runs_on_when_released() {
    // A broker on the simulated market's own clock (not the tests' manual one) at 3600x, held
    // a market minute in: about 17 ms of wall time.
    let db = TestDb::postgres().await;
    let mut args = ServeArgs::sim_defaults();
    args.token = Some(TOKEN.into());
    args.local_agents = Some(false);
    args.start = Some("2015-05-01T00:00:00Z".into());
    args.speed = 3600.0;
    args.hold_at = Some("2015-05-01T00:01:00Z".into());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = start_with(db.store.clone(), args, listener, StartOptions::default())
        .await
        .expect("broker starts");
    let url = format!("http://{}", server.addr);
    let (_broker, task) = server.serve_api();
    let http = reqwest::Client::new();
    let call = |method: reqwest::Method, token: &str, body: Option<Value>| {
        let mut req = http
            .request(method, format!("{url}/v1/sim/clock"))
            .bearer_auth(token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        async move {
            let resp = req.send().await.expect("request");
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let at = |v: &Value, key: &str| Timestamp::parse(v[key].as_str().unwrap_or("")).ok();
    let hold = Timestamp::parse("2015-05-01T00:01:00Z").unwrap();
    // It runs up to the hold and stays there.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let held = loop {
        let (status, v) = call(reqwest::Method::GET, TOKEN, None).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(at(&v, "held_at"), Some(hold), "{v}");
        assert_eq!(v["speed"], 3600.0);
        let now = at(&v, "now").expect("now");
        assert!(now <= hold, "ran past the hold: {v}");
        if now == hold {
            break v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never reached the hold: {v}"
        );
        tokio::task::yield_now().await;
    };
    let (_, again) = call(reqwest::Method::GET, TOKEN, None).await;
    assert_eq!(again["now"], held["now"], "it stays at the hold");
    // Refused, and nothing changed: no token, a time that is none, a field that is none.
    let (status, _) = call(
        reqwest::Method::POST,
        "pt_not-the-token-of-32-characters!",
        Some(json!({"hold_at": null})),
    )
    .await;
    assert_eq!(status, 401);
    let (status, e) = call(
        reqwest::Method::POST,
        TOKEN,
        Some(json!({"hold_at": "yesterday"})),
    )
    .await;
    assert_eq!((status, &e["field"]), (422, &json!("hold_at")), "{e}");
    let (status, e) = call(
        reqwest::Method::POST,
        TOKEN,
        Some(json!({"hold_at": null, "speed": 1})),
    )
    .await;
    assert!((400..500).contains(&status), "{status} {e}");
    let (_, still) = call(reqwest::Method::GET, TOKEN, None).await;
    assert_eq!(
        (at(&still, "now"), at(&still, "held_at")),
        (Some(hold), Some(hold))
    );
    // Released, it runs on from the hold; a hold in the past stops it where it stands.
    let (status, v) = call(reqwest::Method::POST, TOKEN, Some(json!({"hold_at": null}))).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["held_at"].is_null(), "{v}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (_, v) = call(reqwest::Method::GET, TOKEN, None).await;
        if at(&v, "now").expect("now") > hold {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never ran on: {v}");
        tokio::task::yield_now().await;
    }
    let (status, v) = call(
        reqwest::Method::POST,
        TOKEN,
        Some(json!({"hold_at": "2015-05-01T00:00:00Z"})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let stopped = at(&v, "held_at").expect("held");
    assert!(stopped > hold, "held where it stood, not in the past: {v}");
    let (_, v) = call(reqwest::Method::GET, TOKEN, None).await;
    assert_eq!(at(&v, "now"), Some(stopped), "{v}");
    task.abort();
    // A broker on another clock (here the tests' manual one, as the demo's) says it has none.
    let s = TestServer::start(|_| {}).await;
    let (status, e) = s.get("/v1/sim/clock").await;
    assert_eq!(status, 409, "{e}");
}
