//! Reads through any broker of a deployment: what one broker writes shows through every other
//! within the status cache's TTL (1 s), the longest a broker serves a job's status without
//! reading it again. A broker hears of its own writes at once; another broker's it does not
//! hear of, so this is the promise for a user behind a load balancer.
//!
//! Stated in the promise's own terms, not the machine's speed: a read may show the old state
//! only when it *started* less than a TTL after the write was answered; every read that starts
//! later must show the new one. A slow machine makes fewer reads, never a wrong one.

use crate::api::TOKEN;
use crate::support::TestDb;
use proteus_broker::clock::ManualClock;
use proteus_broker::cloud::Cloud;
use proteus_broker::market::Timestamp;
use proteus_broker::service::{Broker, Pacing};
use proteus_broker::startup::{ServeArgs, StartOptions, start_with};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

const START: &str = "2015-05-01T00:00:00Z";
/// `status_cache::TTL`, the promise under test.
const TTL: Duration = Duration::from_secs(1);
/// Reads of the stale side for at least this long past the TTL, so that a cache that held a
/// status for longer (or for ever) is caught.
const WATCH: Duration = Duration::from_secs(3);

struct Api {
    url: String,
    http: reqwest::Client,
}

impl Api {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(TOKEN);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status();
        let v: Value = resp.json().await.expect("JSON");
        assert!(status.is_success(), "{path}: {status} {v}");
        v
    }
}

async fn broker(
    db: &TestDb,
    dir: &std::path::Path,
    clock: &ManualClock,
    cloud: &Arc<dyn Cloud>,
) -> (Arc<Broker>, Api, tokio::task::JoinHandle<()>) {
    let mut args = ServeArgs::sim_defaults();
    args.token = Some(TOKEN.into());
    args.local_agents = Some(false);
    args.start = Some(START.into());
    args.state_dir = Some(dir.to_path_buf());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app = start_with(
        db.store.clone(),
        args,
        listener,
        StartOptions {
            clock: Some(Arc::new(clock.clone())),
            pacing: Some(Pacing::Modelled),
            cloud: Some(cloud.clone()),
        },
    )
    .await
    .expect("broker starts");
    let url = format!("http://{}", app.addr);
    let (b, task) = app.serve_api();
    let api = Api {
        url,
        http: reqwest::Client::new(),
    };
    (b, api, task)
}

/// Reads job `id` through `api` from the moment `written` on, for a TTL and [`WATCH`] more:
/// each read that started at least a TTL after it shows `state`.
async fn watch(api: &Api, id: i64, written: Instant, state: &str) {
    loop {
        let started = Instant::now();
        let v = api
            .call(reqwest::Method::GET, &format!("/v1/jobs/{id}"), None)
            .await;
        let since = started.duration_since(written);
        if v["state"] != state {
            assert!(
                since < TTL,
                "a read started {since:?} after the write still shows {}: {v}",
                v["state"]
            );
        }
        if since >= TTL + WATCH {
            return;
        }
        // Paced reads, not a synchronisation: the loop ends on the read times above.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_through_one_broker_shows_through_the_other_within_the_cache_ttl() {
    let db = TestDb::postgres().await;
    let clock = ManualClock::new(Timestamp::parse(START).unwrap());
    let cloud: Arc<dyn Cloud> = Arc::new(crate::cancel_during_launch::sim_cloud(&clock));
    let dirs = tempfile::tempdir().unwrap();
    let (a, api_a, task_a) = broker(&db, &dirs.path().join("a"), &clock, &cloud).await;
    let (_b, api_b, task_b) = broker(&db, &dirs.path().join("b"), &clock, &cloud).await;
    let spec = json!({
        "name": "fresh",
        "app": "mlr",
        "policy": "bidbrain",
        "limits": {"max_instances": 2, "max_reliable_instances": 1},
        "work": {"total_work": 8.0}
    });

    // A job submitted through a (its owner) is read through both, so both keep its status.
    let one = api_a
        .call(reqwest::Method::POST, "/v1/jobs", Some(spec.clone()))
        .await["id"]
        .as_i64()
        .unwrap();
    assert!(
        a.membership().lease(proteus_wire::JobId(one)).is_some(),
        "a owns what it was given"
    );
    for api in [&api_a, &api_b] {
        let v = api
            .call(reqwest::Method::GET, &format!("/v1/jobs/{one}"), None)
            .await;
        assert_eq!(v["state"], "pending", "{v}");
    }
    // Cancelled through its owner: the other broker shows it within the TTL.
    api_a
        .call(
            reqwest::Method::POST,
            &format!("/v1/jobs/{one}/cancel"),
            None,
        )
        .await;
    let written = Instant::now();
    watch(&api_b, one, written, "cancelled").await;

    // The other way round: a second job of a's, cancelled through b, which does not own it
    // (the cancel is recorded for the owner), and read through a, which had it cached.
    let two = api_a
        .call(reqwest::Method::POST, "/v1/jobs", Some(spec))
        .await["id"]
        .as_i64()
        .unwrap();
    for api in [&api_a, &api_b] {
        let v = api
            .call(reqwest::Method::GET, &format!("/v1/jobs/{two}"), None)
            .await;
        assert_eq!(v["state"], "pending", "{v}");
    }
    let v = api_b
        .call(
            reqwest::Method::POST,
            &format!("/v1/jobs/{two}/cancel"),
            None,
        )
        .await;
    assert_eq!(
        v["state"], "cancelled",
        "the broker that took the cancel shows it: {v}"
    );
    let written = Instant::now();
    watch(&api_a, two, written, "cancelled").await;
    task_a.abort();
    task_b.abort();
}
