//! Crash safety against LocalStack (which, unlike EC2, ignores idempotency tokens): the broker
//! dies at chosen points — failpoints that exit on the spot, and a plain `kill -9` — and is
//! restarted. Nothing may be launched twice for one decision, nothing may leak, and the job
//! goes on.

use crate::localstack::{assert_no_duplicates_or_leaks, instance, job, live, start_ec2_broker};
use proteus_e2e::{localstack_ec2, localstack_instances, unique};
use std::time::Duration;

/// The broker exited at `failpoint` (the failpoint's own exit status and message), not for
/// some other reason.
fn assert_died_at(status: Option<std::process::ExitStatus>, failpoint: &str, log: &str) {
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(137),
        "the broker should have exited at {failpoint} with 137 ({status:?}):\n{log}"
    );
    assert!(
        log.contains(&format!("failpoint `{failpoint}` reached")),
        "the broker died, but not at {failpoint}:\n{log}"
    );
}

/// Kills the broker at `failpoint` during a launch, restarts it, and checks the job's instances.
async fn crash_during_launch(failpoint: &str) {
    let dir = tempfile::tempdir().unwrap();
    let deployment = unique("crash");
    let (mut broker, _db) = start_ec2_broker(dir.path(), &deployment).await;
    broker.kill9();
    broker.spawn(&[("PROTEUS_FAILPOINTS", failpoint)]).await;
    let api = broker.client();
    // The scheduler may reach the failpoint, and end the process, before the submission's
    // answer has left (status 0): the job is stored either way and is found after the restart.
    let (submitted, answer) = api
        .call(
            reqwest::Method::POST,
            "/v1/jobs",
            Some(job("crash", 100, 3)),
        )
        .await;
    assert!(
        submitted == 201 || submitted == 0,
        "POST /v1/jobs: {submitted} {answer}"
    );
    let status = broker.wait_exit(Duration::from_secs(30)).await;
    assert_died_at(status, failpoint, &broker.log_text());

    broker.spawn(&[]).await;
    let api = broker.client();
    let id = match answer["id"].as_i64() {
        Some(id) => id,
        None => {
            let jobs = api.get("/v1/jobs").await;
            assert_eq!(jobs.as_array().map(Vec::len), Some(1), "{jobs}");
            jobs[0]["id"].as_i64().unwrap()
        }
    };
    let path = format!("/v1/jobs/{id}");
    let view = api
        .wait_for(
            &path,
            Duration::from_secs(120),
            "the job to run on 3 instances after the restart",
            |v| live(v).len() == 3 && live(v).iter().all(|i| i["state"] == "running"),
        )
        .await;
    let ec2 = localstack_ec2().await;
    // Let a few ticks pass: a duplicate would show up as an extra instance.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let seen = localstack_instances(&ec2, &deployment).await;
    assert_no_duplicates_or_leaks(&seen, &[api.get(&path).await]);
    let per_intent = seen.iter().filter(|s| s.state != "terminated").count();
    assert_eq!(
        per_intent, 3,
        "one cloud instance per intent: {seen:?} {view}"
    );
    api.wait_for(
        &path,
        Duration::from_secs(120),
        "training progress after the restart",
        |v| v["progress"].as_f64().unwrap_or(0.0) > 0.0,
    )
    .await;
    api.cancel(id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_recording_a_launch_intent() {
    crash_during_launch("launch-after-intent").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_the_cloud_launched_but_before_recording_it() {
    crash_during_launch("launch-after-cloud").await;
}

/// Kills the broker at `failpoint` during a cancel, restarts it: every instance is terminated.
async fn crash_during_cancel(failpoint: &str) {
    let dir = tempfile::tempdir().unwrap();
    let deployment = unique("crash");
    let (mut broker, _db) = start_ec2_broker(dir.path(), &deployment).await;
    let api = broker.client();
    let id = api.post("/v1/jobs", job("crash-cancel", 100, 3)).await["id"]
        .as_i64()
        .unwrap();
    let path = format!("/v1/jobs/{id}");
    api.wait_for(
        &path,
        Duration::from_secs(120),
        "3 running instances",
        |v| live(v).len() == 3 && live(v).iter().all(|i| i["state"] == "running"),
    )
    .await;
    broker.kill9();
    broker.spawn(&[("PROTEUS_FAILPOINTS", failpoint)]).await;
    let api = broker.client();
    let (status, body) = api
        .call(reqwest::Method::POST, &format!("{path}/cancel"), None)
        .await;
    // Both points are on the cancel's own path (recording it, then releasing the instances):
    // the broker dies before it answers, so the connection closes without a status.
    assert_eq!(status, 0, "the broker died while answering: {body}");
    let died = broker.wait_exit(Duration::from_secs(30)).await;
    assert_died_at(died, failpoint, &broker.log_text());

    broker.spawn(&[]).await;
    let api = broker.client();
    let view = api
        .wait_for(
            &path,
            Duration::from_secs(60),
            "the cancel to finish after the restart",
            |v| v["state"] == "cancelled" && live(v).is_empty(),
        )
        .await;
    let ec2 = localstack_ec2().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let seen = localstack_instances(&ec2, &deployment).await;
        if seen
            .iter()
            .all(|s| s.state == "terminated" || s.state == "shutting-down")
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "instances leaked after the cancel: {seen:?} {view}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_recording_a_cancel() {
    crash_during_cancel("cancel-after-record").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_recording_a_termination() {
    crash_during_cancel("terminate-after-intent").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_job_then_restart_leaves_no_leak_and_no_duplicate_and_the_job_completes() {
    let dir = tempfile::tempdir().unwrap();
    let deployment = unique("kill9");
    let (mut broker, _db) = start_ec2_broker(dir.path(), &deployment).await;
    let api = broker.client();
    let id = api.post("/v1/jobs", job("kill9", 6, 3)).await["id"]
        .as_i64()
        .unwrap();
    let path = format!("/v1/jobs/{id}");
    api.wait_for(&path, Duration::from_secs(120), "training to start", |v| {
        live(v).len() == 3 && v["progress"].as_f64().unwrap_or(0.0) > 0.0
    })
    .await;
    let before = localstack_instances(&localstack_ec2().await, &deployment).await;
    broker.kill9();
    tokio::time::sleep(Duration::from_secs(2)).await;
    broker.spawn(&[]).await;
    let api = broker.client();
    broker
        .wait_succeeded(
            &path,
            Duration::from_secs(300),
            "the job to finish after the restart",
        )
        .await;
    // The agents that outlived the crash finished the job: the resumed control plane kept them.
    let events = api.get(&format!("{path}/events")).await;
    let lost: Vec<&serde_json::Value> = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| {
            e["kind"] == "agent_lost" || (e["kind"] == "agent_exit" && e["detail"] != "Stopped")
        })
        .collect();
    assert!(
        lost.is_empty(),
        "agents were lost across the restart: {lost:?}"
    );
    let after = localstack_instances(&localstack_ec2().await, &deployment).await;
    for s in &before {
        let twins = after
            .iter()
            .filter(|a| a.proteus_id == s.proteus_id)
            .count();
        assert_eq!(
            twins, 1,
            "{} was launched again after the restart: {after:?}",
            s.proteus_id
        );
    }
    api.wait_for(
        &path,
        Duration::from_secs(30),
        "every instance to end",
        |v| live(v).is_empty(),
    )
    .await;
    let after = localstack_instances(&localstack_ec2().await, &deployment).await;
    assert!(
        after
            .iter()
            .all(|s| s.state == "terminated" || s.state == "shutting-down"),
        "leak: {after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_while_recording_an_eviction() {
    let dir = tempfile::tempdir().unwrap();
    let deployment = unique("crash-evict");
    let (mut broker, _db) = start_ec2_broker(dir.path(), &deployment).await;
    let api = broker.client();
    let id = api.post("/v1/jobs", job("crash-evict", 20, 3)).await["id"]
        .as_i64()
        .unwrap();
    let path = format!("/v1/jobs/{id}");
    let view = api
        .wait_for(
            &path,
            Duration::from_secs(120),
            "training on 3 instances",
            |v| live(v).len() == 3 && v["progress"].as_f64().unwrap_or(0.0) > 0.0,
        )
        .await;
    let victim = live(&view)
        .into_iter()
        .find(|i| i["tier"] == "transient")
        .unwrap();
    let victim_id = victim["id"].as_str().unwrap().to_string();
    // Restart with the eviction failpoint armed, then evict: notice, hand-over, termination.
    broker.kill9();
    broker
        .spawn(&[("PROTEUS_FAILPOINTS", "evicted-before-record")])
        .await;
    let api = broker.client();
    let metadata = victim["metadata_url"].as_str().unwrap().to_string();
    let resp = reqwest::Client::new()
        .post(format!("{metadata}/_proteus/interrupt"))
        .json(&serde_json::json!({"action": "terminate"}))
        .send()
        .await;
    assert!(
        resp.is_ok(),
        "the metadata endpoint is served again after the restart: {resp:?}"
    );
    api.wait_for(
        &format!("{path}/events"),
        Duration::from_secs(60),
        "the victim's exit",
        |ev| {
            ev.as_array()
                .unwrap()
                .iter()
                .any(|e| e["instance_id"] == victim_id.as_str() && e["kind"] == "agent_exit")
        },
    )
    .await;
    let ec2 = localstack_ec2().await;
    ec2.terminate_instances()
        .instance_ids(victim["cloud_id"].as_str().unwrap())
        .send()
        .await
        .unwrap();
    let died = broker.wait_exit(Duration::from_secs(30)).await;
    if died.is_none() {
        let events = api.get(&format!("{path}/events")).await;
        let view = api.get(&path).await;
        panic!(
            "the broker should have died recording the eviction:\n{events}\n{view}\n{}",
            broker.log_text()
        );
    }
    assert_died_at(died, "evicted-before-record", &broker.log_text());

    broker.spawn(&[]).await;
    let api = broker.client();
    let done = broker
        .wait_succeeded(&path, Duration::from_secs(300), "the job to finish")
        .await;
    let victim_after = instance(&done, &victim_id);
    assert_eq!(
        victim_after["end_reason"], "evicted",
        "the eviction was recorded after the restart: {victim_after}"
    );
    assert!(
        api.get(&format!("{path}/cost")).await["evictions"]
            .as_u64()
            .unwrap()
            >= 1
    );
    api.wait_for(
        &path,
        Duration::from_secs(30),
        "every instance to end",
        |v| live(v).is_empty(),
    )
    .await;
    let seen = localstack_instances(&ec2, &deployment).await;
    assert!(
        seen.iter()
            .all(|s| s.state == "terminated" || s.state == "shutting-down"),
        "leak: {seen:?}"
    );
}
