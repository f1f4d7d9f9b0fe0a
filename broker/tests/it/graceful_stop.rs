//! Graceful stops through the broker's API and scheduler: an instance Proteus ends (a policy's
//! release, the job's end) is first stopped through its agent, and ended only once the agent
//! has left, or when the job's grace and the upload allowance have passed.

use crate::api::TestServer;
use proteus_broker::clock::Clock;
use proteus_broker::store::InstanceState;
use proteus_wire::JobId;
use serde_json::{Value, json};

/// A launched reliable instance of job `id` whose agent token the test knows, registered and
/// ready, as its agent would be.
async fn agent(s: &TestServer, id: JobId, n: u32) -> (String, String, String) {
    agent_of(s, id, n, proteus_wire::Tier::Reliable, 1).await
}

/// A launched instance of job `id` in `tier` whose agent token the test knows, registered and
/// ready with a model of `model_len` parameters, as its agent would be.
pub(crate) async fn agent_of(
    s: &TestServer,
    id: JobId,
    n: u32,
    tier: proteus_wire::Tier,
    model_len: u64,
) -> (String, String, String) {
    let market = proteus_broker::market::Market::parse("us-east-1a/c3.xlarge").unwrap();
    let token = proteus_broker::api::auth::new_token("pa_");
    let row = proteus_broker::store::InstanceRow {
        id: format!("pi-graceful-{n}"),
        job_id: id,
        cloud_id: None,
        market,
        tier,
        bid: None,
        state: InstanceState::Requested,
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
    let cloud_id = format!("i-graceful{n}");
    s.broker
        .store()
        .mark_launched(None, &row.id, &cloud_id, s.clock.now())
        .await
        .unwrap();
    let (status, _) = s
        .call(
            reqwest::Method::POST,
            "/v1/agents/register",
            Some(&token),
            Some(json!({"instance_id": cloud_id, "data_addr": "127.0.0.1:9", "vcpus": 2, "protocol_version": proteus_wire::agent_api::PROTOCOL_VERSION})),
        )
        .await;
    assert_eq!(status, 200);
    event(
        s,
        &cloud_id,
        &token,
        json!({"type": "ready", "model_len": model_len}),
    )
    .await;
    (row.id, cloud_id, token)
}

async fn event(s: &TestServer, cloud_id: &str, token: &str, body: Value) {
    let (status, answer) = try_event(s, cloud_id, token, body).await;
    assert!(status < 300, "{status} {answer}");
}

/// An event as an agent posts it: the status and the answer.
pub(crate) async fn try_event(
    s: &TestServer,
    cloud_id: &str,
    token: &str,
    body: Value,
) -> (u16, Value) {
    s.call(
        reqwest::Method::POST,
        &format!("/v1/agents/{cloud_id}/events"),
        Some(token),
        Some(body),
    )
    .await
}

pub(crate) async fn commands(s: &TestServer, cloud_id: &str, token: &str) -> Value {
    s.call(
        reqwest::Method::GET,
        &format!("/v1/agents/{cloud_id}/commands?after=0&wait_ms=0"),
        Some(token),
        None,
    )
    .await
    .1
}

async fn state(s: &TestServer, id: &str) -> (InstanceState, bool) {
    let row = s.broker.store().instance(id).await.unwrap().unwrap();
    (row.state, row.stop_by.is_some())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_instance_ends_once_its_agent_has_left_or_when_its_grace_runs_out() {
    let s = TestServer::start(|_| {}).await;
    let (status, view) = s
        .post(
            "/v1/jobs",
            json!({
                "name": "graceful",
                "app": "command",
                "policy": "on-demand",
                "limits": {"max_instances": 2, "max_reliable_instances": 2},
                "work": {"total_work": 8.0},
                "command": {"run": ["true"], "grace_seconds": 5}
            }),
        )
        .await;
    assert_eq!(status, 201, "{view}");
    let job = JobId(view["id"].as_i64().unwrap());
    let (leaves, leaves_cloud, leaves_token) = agent(&s, job, 1).await;
    let (hangs, hangs_cloud, hangs_token) = agent(&s, job, 2).await;

    // The policy releases both (what `Command::Release` does).
    for id in [&leaves, &hangs] {
        let row = s.broker.store().instance(id).await.unwrap().unwrap();
        s.broker
            .stop_instance(&row, "released by the policy", s.clock.now())
            .await
            .unwrap();
    }
    // Each agent is told to stop, with the reason; neither instance is ended yet.
    for (cloud, token) in [(&leaves_cloud, &leaves_token), (&hangs_cloud, &hangs_token)] {
        let told = commands(&s, cloud, token).await;
        assert!(
            told.as_array()
                .unwrap()
                .iter()
                .any(|c| c["command"]["type"] == "stop"
                    && c["command"]["reason"] == "released by the policy"),
            "{cloud}: {told}"
        );
    }
    s.step(1.0).await;
    assert_eq!(state(&s, &leaves).await, (InstanceState::Running, true));
    assert_eq!(state(&s, &hangs).await, (InstanceState::Running, true));
    // A second release of an instance being stopped changes nothing.
    let row = s.broker.store().instance(&leaves).await.unwrap().unwrap();
    s.broker
        .stop_instance(&row, "released again", s.clock.now())
        .await
        .unwrap();

    // One agent saves, uploads and says it exits: its instance is ended at the next tick.
    event(
        &s,
        &leaves_cloud,
        &leaves_token,
        json!({"type": "exit", "reason": {"type": "stopped"}}),
    )
    .await;
    s.step(1.0).await;
    assert!(
        matches!(
            state(&s, &leaves).await.0,
            InstanceState::Terminating | InstanceState::Terminated
        ),
        "the instance whose agent left was not ended"
    );
    assert_eq!(state(&s, &hangs).await.0, InstanceState::Running);
    // The other never does: it is ended once its grace (5 s) and the upload allowance (60 s)
    // have passed, and not before.
    s.step(60.0).await;
    assert_eq!(state(&s, &hangs).await.0, InstanceState::Running);
    s.step(5.0).await;
    assert!(matches!(
        state(&s, &hangs).await.0,
        InstanceState::Terminating | InstanceState::Terminated
    ));
    let (_, events) = s.get(&format!("/v1/jobs/{}/events", job.0)).await;
    let stopping = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "instance_stopping")
        .count();
    assert_eq!(stopping, 2, "{events}");
}
