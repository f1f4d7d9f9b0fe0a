//! `proteus demo` as a user runs it: the job completes through the trace's evictions, each
//! evicted instance warned before it went and its last hour billed free. (Whether an evicted
//! agent was still training when its warning came depends on how fast this machine trains;
//! `eviction.rs` drives that path on a trace made for it.)

use proteus_e2e::{fresh_pg_database, proteus};
use sqlx::Row;

/// `proteus demo --output json` with `extra` flags against a fresh Postgres database: the
/// demo's output directory (kept while the value lives), the database's URL and the demo's
/// JSON result (the demo must succeed).
async fn run_demo(extra: &[&str]) -> (tempfile::TempDir, String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let db = fresh_pg_database().await;
    let out = dir.path().display().to_string();
    let mut args: Vec<String> = ["demo", "--output", "json", "--out", &out]
        .iter()
        .map(|a| a.to_string())
        .collect();
    args.extend(extra.iter().map(|a| a.to_string()));
    let run = {
        let db = db.clone();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            proteus(Some(&db), &args, &[])
        })
    };
    let (code, stdout, stderr) = run.await.unwrap();
    assert_eq!(code, 0, "the demo failed: {stderr}\n{stdout}");
    (dir, db, serde_json::from_str(&stdout).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_completes_through_evictions_billed_as_provider_ended() {
    let (_out, db, result) = run_demo(&[]).await;
    assert_eq!(result["job"]["state"], "succeeded", "{result}");
    assert!(
        result["job"]["metric"]["value"].as_f64().unwrap() > 0.85,
        "MNIST logistic regression reaches ~0.9: {result}"
    );
    let cost = &result["cost"];
    assert!(cost["evictions"].as_u64().unwrap() >= 1, "{cost}");
    assert!(cost["free_hours"].as_f64().unwrap() > 0.0, "{cost}");
    assert_eq!(cost["pacing"], "modelled", "{cost}");
    assert!(
        std::path::Path::new(result["chart"].as_str().unwrap()).is_file(),
        "{result}"
    );

    // One instance's whole story, from the store the demo wrote.
    let pool = sqlx::PgPool::connect(&db).await.unwrap();
    let evicted: Vec<String> = sqlx::query(
        "SELECT id FROM instances WHERE ended_by_provider = 1 AND tier = 'transient' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .map(|r| r.get::<String, _>(0))
    .collect();
    assert!(!evicted.is_empty(), "no instance was evicted");
    for id in &evicted {
        let kinds: Vec<String> =
            sqlx::query("SELECT kind FROM events WHERE instance_id = $1 ORDER BY id")
                .bind(id)
                .fetch_all(&pool)
                .await
                .unwrap()
                .into_iter()
                .map(|r| r.get::<String, _>(0))
                .collect();
        let pos = |k: &str| kinds.iter().position(|x| x == k);
        let (Some(warned), Some(gone)) = (pos("interruption_warning"), pos("evicted")) else {
            panic!("{id}: evicted without the warning and eviction on record: {kinds:?}");
        };
        assert!(warned < gone, "{id}: {kinds:?}");
        // The last ledger line of an evicted instance is its free partial hour.
        let last_free: i64 = sqlx::query(
            "SELECT free FROM ledger_lines WHERE instance_id = $1 ORDER BY start_ms DESC LIMIT 1",
        )
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap()
        .get(0);
        assert_eq!(
            last_free, 1,
            "{id}: the provider ended it, so its last hour is free"
        );
    }
    pool.close().await;
}

/// `proteus demo --market today`: real 2023 availability traces, where the cloud refuses spot
/// launches without capacity and interrupts instances when a pool shrinks. The job meets its
/// deadline on a mix of spot and on-demand, a spot instance interrupted in its first hour costs
/// nothing, and the whole costs less than on-demand alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_today_demo_meets_its_deadline_through_refusals_and_interruptions() {
    let (_out, db, result) = run_demo(&["--market", "today"]).await;
    let job = &result["job"];
    assert_eq!(job["state"], "succeeded", "{result}");
    assert_eq!(job["billing"], "per-second", "{job}");
    assert_eq!(
        job["instance_types"],
        serde_json::json!(["p3.2xlarge"]),
        "{job}"
    );
    let finished = job["finished"].as_str().unwrap();
    let deadline = job["deadline"]
        .as_str()
        .expect("the demo job has a deadline");
    // RFC 3339 in UTC with the same layout: the strings order as the times do.
    assert!(finished <= deadline, "finished {finished} after {deadline}");
    let instances = job["instances"].as_array().unwrap();
    let launched = |tier: &str| {
        instances
            .iter()
            .filter(|i| i["tier"] == tier && !i["launched"].is_null())
            .count()
    };
    assert!(
        launched("transient") >= 1 && launched("reliable") >= 1,
        "{job}"
    );
    let cost = &result["cost"];
    assert!(cost["evictions"].as_u64().unwrap() >= 1, "{cost}");
    assert!(
        cost["free_hours"].as_f64().unwrap() > 0.0,
        "an interrupted first hour is free: {cost}"
    );
    let on_demand = cost["counterfactuals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["policy"] == "on-demand")
        .and_then(|c| c["cost_usd"].as_f64())
        .unwrap();
    let spent = cost["total_usd"].as_f64().unwrap();
    assert!(
        spent < on_demand,
        "spent ${spent} ≥ on-demand's ${on_demand}"
    );
    // The counterfactuals replay the same capacity against the same deadline, with the
    // baselines users run today (not standard bidding priced as if every launch were granted).
    let baselines: Vec<&str> = cost["counterfactuals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["policy"].as_str().unwrap())
        .collect();
    assert_eq!(
        baselines,
        ["on-demand", "uniform-progress", "skypilot-default"],
        "{cost}"
    );
    for c in cost["counterfactuals"].as_array().unwrap() {
        assert!(c["deadline_met"].is_boolean(), "{c}");
        assert!(c["cost_usd"].as_f64().is_some(), "{c}");
    }

    // The cloud refused spot for lack of capacity, as EC2 does, and the broker said so.
    let pool = sqlx::PgPool::connect(&db).await.unwrap();
    let refusals: i64 = sqlx::query(
        "SELECT count(*) FROM events WHERE kind = 'launch_failed' \
         AND detail LIKE '%InsufficientInstanceCapacity%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap()
    .get(0);
    assert!(refusals >= 1, "no launch was refused for capacity");
    pool.close().await;
}
