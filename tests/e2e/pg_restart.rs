//! Postgres restarted under a running broker: requests fail while it is down (503 from
//! /healthz, no panic), and the broker recovers by itself when it is back.

use proteus_e2e::{BrokerProcess, PrivatePostgres, SIM_START, write_c3_trace};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_rides_out_a_postgres_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut pg = PrivatePostgres::init(dir.path());
    let work = dir.path().join("broker");
    std::fs::create_dir_all(&work).unwrap();
    let broker = BrokerProcess::start_sim(&work, &pg.url(), "300", &[]).await;
    let api = broker.client();
    let job = serde_json::json!({
        "app": "mlr", "dataset": "mnist", "policy": "on-demand",
        "stop": {"epochs": 8}, "limits": {"max_instances": 2, "max_reliable_instances": 2},
        "work": {"total_work": 2.0}
    });
    let id = api.post("/v1/jobs", job).await["id"].as_i64().unwrap();
    let path = format!("/v1/jobs/{id}");
    api.wait_for(&path, Duration::from_secs(120), "training to start", |v| {
        v["progress"].as_f64().unwrap_or(0.0) > 0.0
    })
    .await;

    pg.stop();
    let (status, _) = api.call(reqwest::Method::GET, "/healthz", None).await;
    assert_eq!(status, 503, "health reports the database down");
    let (status, body) = api.call(reqwest::Method::GET, &path, None).await;
    assert_eq!(status, 500, "a clean error, not a hang or a crash: {body}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    pg.start();

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, _) = api.call(reqwest::Method::GET, "/healthz", None).await;
        if status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the broker did not reconnect:\n{}",
            broker.log_text()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    broker
        .wait_succeeded(&path, Duration::from_secs(240), "the job to finish")
        .await;
}

/// Market minutes after the broker's start when the c3.xlarge spot markets spike above any bid
/// (a market minute is a wall second here). Training starts about 2 s after submission on an idle
/// machine and took 18 s on a CI run loaded with the torch tests; the database must go down
/// before the spike, so the spike leaves room for more than twice that.
const SPIKE_AT_MIN: i64 = 45;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_events_during_a_postgres_outage_are_recorded_when_it_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut pg = PrivatePostgres::init(dir.path());
    let work = dir.path().join("broker");
    std::fs::create_dir_all(&work).unwrap();
    let (trace, od) = write_c3_trace(&work, Some((SPIKE_AT_MIN, 10)));
    let broker = BrokerProcess::start_sim(
        &work,
        &pg.url(),
        "60",
        &[
            "--trace",
            &trace,
            "--on-demand",
            &od,
            "--billing",
            "hourly-2015",
        ],
    )
    .await;
    let api = broker.client();
    // One reliable instance keeps the backups; the spot ones hold the active shards.
    let job = serde_json::json!({
        "app": "mlr", "dataset": "mnist", "policy": "bidbrain",
        "stop": {"epochs": 60}, "limits": {"max_instances": 3, "max_reliable_instances": 1},
        "work": {"total_work": 2.0, "instance_types": ["c3.xlarge"], "startup_minutes": 1.0},
        "training": {"num_shards": 2, "stage2_ratio": 1.0, "stage3_ratio": 10.0, "seed": 11}
    });
    let submitted = Instant::now();
    let view = api.post("/v1/jobs", job).await;
    let id = view["id"].as_i64().unwrap();
    let created = chrono::DateTime::parse_from_rfc3339(view["created"].as_str().unwrap()).unwrap();
    let spike = chrono::DateTime::parse_from_rfc3339(SIM_START).unwrap()
        + chrono::Duration::minutes(SPIKE_AT_MIN);
    let spike_wall =
        submitted + Duration::from_secs_f64((spike - created).num_milliseconds() as f64 / 60_000.0);
    let path = format!("/v1/jobs/{id}");
    let training = api
        .wait_for(&path, Duration::from_secs(120), "training to start", |v| {
            v["progress"].as_f64().unwrap_or(0.0) > 0.0
        })
        .await;
    let spot: Vec<String> = training["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["tier"] == "transient" && i["state"] == "running")
        .map(|i| i["id"].as_str().unwrap().to_string())
        .collect();
    assert!(!spot.is_empty(), "BidBrain bought spot: {training}");
    assert!(
        Instant::now() + Duration::from_secs(3) < spike_wall,
        "training started too late to take the database down before the spike"
    );

    // The database goes down before the spike; the cloud warns and reclaims the spot instances
    // while it is down, and the broker must hold what it cannot record. Training usually ends
    // during the outage too (about 20 s of training before the spike at 45 s): the agents'
    // completion must outlast it, or the job never finishes.
    pg.stop();
    let held = format!("waiting={}", 2 * spot.len());
    let deadline = Instant::now() + Duration::from_secs(90);
    while !broker.log_text().contains(&held) {
        assert!(
            Instant::now() < deadline,
            "the broker never held the {} warnings and reclaims:\n{}",
            2 * spot.len(),
            broker.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    pg.start();

    let done = broker
        .wait_succeeded(&path, Duration::from_secs(300), "the job to finish")
        .await;
    let events = api.get(&format!("{path}/events")).await;
    let events = events.as_array().unwrap();
    for iid in &spot {
        let kinds: Vec<&str> = events
            .iter()
            .filter(|e| e["instance_id"] == iid.as_str())
            .map(|e| e["kind"].as_str().unwrap())
            .collect();
        for kind in ["interruption_warning", "evicted"] {
            assert_eq!(
                kinds.iter().filter(|k| **k == kind).count(),
                1,
                "{iid}: one {kind} recorded after the outage: {kinds:?}"
            );
        }
        let row = done["instances"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["id"] == iid.as_str())
            .unwrap();
        assert_eq!(row["end_reason"], "evicted", "{row}");
    }
    // Nothing leaked: every instance ends (the last release completes on the next tick).
    api.wait_for(
        &path,
        Duration::from_secs(60),
        "every instance to end",
        |v| {
            v["instances"].as_array().is_some_and(|a| {
                a.iter()
                    .all(|i| i["state"] == "terminated" || i["state"] == "failed")
            })
        },
    )
    .await;
    let cost = api.get(&format!("{path}/cost")).await;
    assert!(
        cost["evictions"].as_u64().unwrap() >= spot.len() as u64,
        "{cost}"
    );
}
