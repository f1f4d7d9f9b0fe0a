//! The broker owns an MLP job's plans: it names a reliable founder to profile, takes that
//! member's profile once (not another member's, not a profile of the wrong shape), computes the
//! plans for every worker count, and publishes them in the view every agent trains from.

use crate::api::TestServer;
use crate::graceful_stop::{agent_of, commands, try_event};
use proteus_wire::{JobId, Tier};
use serde_json::{Value, json};

/// The newest layout an agent was sent.
async fn layout(s: &TestServer, cloud_id: &str, token: &str) -> Value {
    let told = commands(s, cloud_id, token).await;
    told.as_array()
        .expect("commands")
        .iter()
        .rev()
        .find(|c| c["command"]["type"] == "configure")
        .map(|c| c["command"].clone())
        .unwrap_or_else(|| panic!("no layout for {cloud_id}: {told}"))
}

fn profile(layers: usize) -> Value {
    (0..layers)
        .map(|l| json!({"forward_ms": 1.0 + l as f64, "backward_ms": 2.0, "update_ms": 0.5}))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_plans_a_pipeline_from_its_reliable_founders_profile_and_publishes_the_plans() {
    let s = TestServer::start(|_| {}).await;
    let (status, view) = s
        .post(
            "/v1/jobs",
            json!({
                "name": "plans",
                "app": "mlp",
                "policy": "on-demand",
                "limits": {"max_instances": 3, "max_reliable_instances": 3},
                "work": {"total_work": 8.0},
                "training": {
                    "layers": [32, 16, 10],
                    "parallelism": "pipeline",
                    "link_mbit_per_sec": 200.0,
                    "min_workers": 3
                }
            }),
        )
        .await;
    assert_eq!(status, 201, "{view}");
    let job = JobId(view["id"].as_i64().unwrap());
    // 784·32+32 + 32·16+16 + 16·10+10 parameters.
    let params = 25_120 + 528 + 170;
    // Instance ids sort as they are numbered: the first founder is a spot instance.
    let (_, spot1, spot1_token) = agent_of(&s, job, 21, Tier::Transient, params).await;
    let (_, reliable, reliable_token) = agent_of(&s, job, 22, Tier::Reliable, params).await;
    let (_, spot2, spot2_token) = agent_of(&s, job, 23, Tier::Transient, params).await;

    let before = layout(&s, &spot1, &spot1_token).await;
    assert_eq!(
        before["founders"].as_array().map(Vec::len),
        Some(3),
        "{before}"
    );
    assert_eq!(before["founders"][0], json!(spot1), "{before}");
    assert!(
        before["pipeline"].is_null(),
        "no plans before a profile: {before}"
    );
    assert_eq!(
        before["profiler"],
        json!(reliable),
        "the reliable founder profiles, not rank 0 on spot: {before}"
    );

    let post = |who: &str, token: &str, body: Value| {
        let (who, token) = (who.to_string(), token.to_string());
        let s = &s;
        async move { try_event(s, &who, &token, body).await }
    };
    // A spot member's profile is not taken.
    let (status, answer) = post(
        &spot2,
        &spot2_token,
        json!({"type": "pipeline_profile", "layers": profile(3)}),
    )
    .await;
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["code"], "not_profiler", "{answer}");
    // The profiler's token does not post as another instance.
    let (status, _) = post(
        &spot2,
        &reliable_token,
        json!({"type": "pipeline_profile", "layers": profile(3)}),
    )
    .await;
    assert!(status == 401 || status == 403, "{status}");
    // A profile of the wrong shape is refused and says what.
    let (status, answer) = post(
        &reliable,
        &reliable_token,
        json!({"type": "pipeline_profile", "layers": profile(2)}),
    )
    .await;
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["message"]
            .as_str()
            .unwrap_or("")
            .contains("2 entries"),
        "{answer}"
    );
    assert!(layout(&s, &spot1, &spot1_token).await["pipeline"].is_null());

    // The profiler's profile: the plans for one, two and three workers are published.
    let (status, answer) = post(
        &reliable,
        &reliable_token,
        json!({"type": "pipeline_profile", "layers": profile(3)}),
    )
    .await;
    assert!(status < 300, "{status} {answer}");
    let after = layout(&s, &spot1, &spot1_token).await;
    assert!(
        after["epoch"].as_u64() > before["epoch"].as_u64(),
        "{after}"
    );
    assert!(after["profiler"].is_null(), "{after}");
    let plans = after["pipeline"]["plans"]
        .as_array()
        .expect("plans")
        .clone();
    assert_eq!(plans.len(), 3, "{after}");
    for (i, plan) in plans.iter().enumerate() {
        let stages = plan["stages"].as_array().unwrap();
        let workers: u64 = stages.iter().map(|s| s["replicas"].as_u64().unwrap()).sum();
        assert_eq!(workers, i as u64 + 1, "{plan}");
        assert_eq!(stages.last().unwrap()["end_layer"], 3, "{plan}");
    }
    assert_eq!(after["pipeline"]["source"]["kind"], "measured");
    assert_eq!(after["pipeline"]["source"]["by"], json!(reliable));
    // Every member is sent the same plans.
    for (who, token) in [(&reliable, &reliable_token), (&spot2, &spot2_token)] {
        assert_eq!(layout(&s, who, token).await["pipeline"], after["pipeline"]);
    }
    // A duplicate of the profile (a resend) changes nothing.
    let (status, _) = post(
        &reliable,
        &reliable_token,
        json!({"type": "pipeline_profile", "layers": profile(3)}),
    )
    .await;
    assert!(status < 300);
    assert_eq!(
        layout(&s, &spot1, &spot1_token).await["pipeline"],
        after["pipeline"]
    );
    // The job's history says who measured what.
    let (_, events) = s.get(&format!("/v1/jobs/{}/events", job.0)).await;
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "pipeline_profile"
                && e["detail"].as_str().unwrap_or("").contains("3 layers")),
        "{events}"
    );
}
