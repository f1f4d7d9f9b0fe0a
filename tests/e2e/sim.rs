//! The simulated cloud with real agents, driven through the CLI as a user would.

use proteus_e2e::{BrokerProcess, TOKEN, fresh_pg_database, proteus};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_on_the_simulated_cloud_trains_and_reports_its_cost() {
    let dir = tempfile::tempdir().unwrap();
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(dir.path(), &db, "300", &[]).await;
    let id = broker.submit_file(
        dir.path(),
        "name = \"e2e-digits\"\napp = \"mlr\"\ndataset = \"digits\"\npolicy = \"bidbrain\"\n\
         [stop]\nepochs = 30\n[limits]\nmax_instances = 3\nmax_reliable_instances = 1\n\
         [work]\ntotal_work = 3.0\n[training]\nseed = 3\n",
    );
    let env = broker.user_env();

    let api = broker.client();
    let job = api
        .wait_for(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(240),
            "the job to finish",
            |j| j["state"] != "pending" && j["state"] != "running",
        )
        .await;
    assert_eq!(job["state"], "succeeded", "{job}\n{}", broker.log_text());
    let accuracy = job["metric"]["value"].as_f64().unwrap();
    assert!(accuracy > 0.85, "digits is easy: {job}");

    let events = api.get(&format!("/v1/jobs/{id}/events")).await;
    let kinds: Vec<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    for kind in [
        "job_submitted",
        "launched",
        "agent_registered",
        "agent_ready",
        "training_complete",
        "job_succeeded",
    ] {
        assert!(kinds.contains(&kind), "no `{kind}` event: {kinds:?}");
    }

    let (code, out, err) = proteus(None, &["report", &id.to_string(), "--output", "json"], &env);
    assert_eq!(code, 0, "{err}");
    let cost: serde_json::Value = serde_json::from_str(&out).unwrap();
    let total = cost["total_usd"].as_f64().unwrap();
    let tiers: f64 = cost["by_tier"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .sum();
    assert!(total > 0.0 && (total - tiers).abs() < 1e-9, "{cost}");
    assert!(
        cost["by_tier"]["reliable"].as_f64().unwrap() > 0.0,
        "BidBrain keeps a reliable tier: {cost}"
    );
    let (code, table, _) = proteus(None, &["report", &id.to_string()], &env);
    assert_eq!(code, 0);
    assert!(
        table.contains("on-demand") && table.contains("standard-bidding"),
        "{table}"
    );
    let (code, status, _) = proteus(None, &["status"], &env);
    assert_eq!(code, 0);
    assert!(
        status.contains("e2e-digits") && status.contains("succeeded"),
        "{status}"
    );

    // Tokens never reach a log: neither the user token nor any agent token.
    let logs = format!("{}{}", broker.log_text(), broker.agent_logs());
    assert!(!logs.contains(TOKEN), "the user token was logged");
    assert!(
        !proteus_e2e::contains_agent_token(&logs),
        "an agent token was logged"
    );
    assert!(logs.contains("started agent"), "the logs are the real ones");
}
