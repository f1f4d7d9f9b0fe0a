//! What is measured is what runs: `proteus demo` (a real broker on the simulated cloud, real
//! agents training, the trace's spikes evicting them through their metadata endpoints) and
//! `proteus simulate` on the same job file, start and policy make the same decisions at the
//! same market instants (the same `decisions_digest`) and cost the same to the cent.

use proteus_e2e::{fresh_pg_database, proteus};
use serde_json::Value;

fn demo_job() -> String {
    format!("{}/../examples/jobs/demo.toml", env!("CARGO_MANIFEST_DIR"))
}

/// `proteus simulate --start`: (digest, cost, evictions) of the asked policy's one run.
fn simulate(policy: &str, start: &str) -> (String, f64, u64) {
    let job = demo_job();
    let (code, stdout, stderr) = proteus(
        None,
        &[
            "simulate", "--job", &job, "--start", start, "--policy", policy, "--output", "json",
        ],
        &[],
    );
    assert_eq!(code, 0, "simulate failed: {stderr}");
    let rows: Vec<Value> = serde_json::from_str(&stdout).unwrap();
    let row = rows
        .iter()
        .find(|r| r["policy"] == policy)
        .unwrap_or_else(|| panic!("no {policy} row: {stdout}"));
    assert_eq!(row["runs"], 1, "{row}");
    (
        row["decisions_digest"].as_str().unwrap().to_string(),
        row["median_cost_usd"].as_f64().unwrap(),
        row["median_evictions"].as_f64().unwrap() as u64,
    )
}

/// `proteus demo --start` against a fresh Postgres database: its JSON result.
async fn demo(policy: String, start: String) -> Value {
    let db = fresh_pg_database().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    let job = demo_job();
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || {
        proteus(
            Some(&db),
            &[
                "demo", "--job", &job, "--start", &start, "--policy", &policy, "--output", "json",
                "--out", &out,
            ],
            &[],
        )
    })
    .await
    .unwrap();
    assert_eq!(code, 0, "the demo failed: {stderr}\n{stdout}");
    serde_json::from_str(&stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_and_simulate_make_the_same_decisions_and_cost_the_same() {
    // BidBrain on two starts with evictions (50 and 20 in simulation), standard bidding and
    // on-demand on starts without; two demos at a time, so that the agents' wall-clock timing
    // varies with the load too.
    let cases = [
        ("bidbrain", "2015-05-01T00:00:00Z"),
        ("standard-bidding", "2015-05-08T00:00:00Z"),
        ("bidbrain", "2015-05-15T12:00:00Z"),
        ("on-demand", "2015-06-02T00:00:00Z"),
    ];
    let mut evictions = 0;
    for pair in cases.chunks(2) {
        let runs: Vec<_> = pair
            .iter()
            .map(|(p, s)| tokio::spawn(demo(p.to_string(), s.to_string())))
            .collect();
        for ((policy, start), run) in pair.iter().zip(runs) {
            let live = run.await.unwrap();
            let (digest, cost, sim_evictions) = simulate(policy, start);
            let what = format!("{policy} from {start}");
            assert_eq!(live["job"]["state"], "succeeded", "{what}: {live}");
            assert_eq!(live["cost"]["pacing"], "modelled", "{what}");
            assert_eq!(
                live["decisions_digest"].as_str().unwrap(),
                digest,
                "{what}: the demo decided otherwise than the simulator"
            );
            let live_cost = live["cost"]["total_usd"].as_f64().unwrap();
            assert_eq!(
                (live_cost * 100.0).round(),
                (cost * 100.0).round(),
                "{what}: demo ${live_cost} vs simulate ${cost}"
            );
            assert_eq!(
                live["cost"]["evictions"].as_u64().unwrap(),
                sim_evictions,
                "{what}"
            );
            evictions += sim_evictions;
        }
    }
    assert!(evictions > 0, "no case had an eviction");
}
