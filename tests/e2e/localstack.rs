//! `proteus serve --cloud ec2` against LocalStack, with agents started by the local launcher:
//! launch with tags, training, an interruption announced through the instance's metadata
//! endpoint and carried out in LocalStack, the hand-over, completion, and a cancel.

use proteus_e2e::{BrokerProcess, Seen, localstack_ec2, localstack_instances, proteus, unique};
pub use proteus_e2e::{aws_env, ec2_database, start_ec2_broker_on};
use serde_json::{Value, json};
use std::time::Duration;

/// A broker on LocalStack with a small price history, under its own deployment tag.
pub async fn start_ec2_broker(dir: &std::path::Path, deployment: &str) -> (BrokerProcess, String) {
    let db = ec2_database(dir).await;
    let broker = start_ec2_broker_on(dir, &db, deployment, &[]).await;
    (broker, db)
}

pub fn job(name: &str, epochs: u32, max_instances: u32) -> Value {
    json!({
        "name": name,
        "app": "mlr",
        "dataset": "mnist",
        "policy": "bidbrain",
        "stop": {"epochs": epochs},
        "limits": {"max_instances": max_instances, "max_reliable_instances": 1},
        "work": {"total_work": 2.0, "startup_minutes": 0.0},
        "training": {"seed": 5, "backup_sync_interval_ms": 300}
    })
}

pub fn live(view: &Value) -> Vec<Value> {
    view["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| ["requested", "running", "warned"].contains(&i["state"].as_str().unwrap()))
        .cloned()
        .collect()
}

/// The instance with the broker's id `id` in a job's view.
pub fn instance(view: &Value, id: &str) -> Value {
    view["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == id)
        .unwrap_or_else(|| panic!("no instance {id} in {view}"))
        .clone()
}

/// No instance launched twice for one intent, and no running instance without a live record.
pub fn assert_no_duplicates_or_leaks(seen: &[Seen], views: &[Value]) {
    let alive: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.state == "running" || s.state == "pending")
        .collect();
    for s in &alive {
        let twins = alive
            .iter()
            .filter(|o| o.proteus_id == s.proteus_id)
            .count();
        assert_eq!(
            twins, 1,
            "instance {} launched {twins} times: {seen:?}",
            s.proteus_id
        );
    }
    let records: Vec<Value> = views.iter().flat_map(live).collect();
    for s in &alive {
        assert!(
            records.iter().any(|r| r["cloud_id"] == s.cloud_id.as_str()),
            "{} runs in the cloud without a live record (leak): {records:?}",
            s.cloud_id
        );
    }
    for r in &records {
        if let Some(cloud_id) = r["cloud_id"].as_str() {
            assert!(
                alive.iter().any(|s| s.cloud_id == cloud_id),
                "record {r} has no running instance"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn localstack_job_survives_an_interruption_and_cancel_releases_everything() {
    let dir = tempfile::tempdir().unwrap();
    let deployment = unique("ls");
    let (broker, _db) = start_ec2_broker(dir.path(), &deployment).await;
    let api = broker.client();
    let ec2 = localstack_ec2().await;

    let a = api.post("/v1/jobs", job("e2e-a", 8, 3)).await;
    let a_id = a["id"].as_i64().unwrap();
    let path = format!("/v1/jobs/{a_id}");
    // Instances appear in LocalStack with Proteus tags; agents register and start training.
    let view = api
        .wait_for(
            &path,
            Duration::from_secs(120),
            "instances and training",
            |v| {
                let l = live(v);
                l.len() == 3
                    && l.iter().any(|i| i["tier"] == "transient")
                    && v["progress"].as_f64().unwrap_or(0.0) > 0.0
            },
        )
        .await;
    let seen = localstack_instances(&ec2, &deployment).await;
    for inst in live(&view) {
        let cloud_id = inst["cloud_id"].as_str().unwrap();
        let s = seen
            .iter()
            .find(|s| s.cloud_id == cloud_id)
            .unwrap_or_else(|| panic!("{cloud_id} not in LocalStack: {seen:?}"));
        assert_eq!(s.proteus_id, inst["id"].as_str().unwrap());
        assert_eq!(s.job, a_id.to_string());
        if inst["tier"] == "transient" {
            assert_eq!(s.lifecycle.as_deref(), Some("spot"), "{s:?}");
        }
    }
    assert_no_duplicates_or_leaks(&seen, std::slice::from_ref(&view));

    // The interruption: the notice through the instance's metadata endpoint, as EC2 gives it,
    // then the termination in LocalStack once the agent has handed over.
    let victim = live(&view)
        .into_iter()
        .find(|i| i["tier"] == "transient")
        .unwrap();
    let victim_id = victim["id"].as_str().unwrap().to_string();
    let metadata = victim["metadata_url"]
        .as_str()
        .expect("local agents have a metadata endpoint")
        .to_string();
    let resp = reqwest::Client::new()
        .post(format!("{metadata}/_proteus/interrupt"))
        .json(&json!({"action": "terminate"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
    api.wait_for(
        &format!("/v1/jobs/{a_id}/events"),
        Duration::from_secs(60),
        "the agent's hand-over and exit",
        |ev| {
            ev.as_array()
                .unwrap()
                .iter()
                .any(|e| e["instance_id"] == victim_id.as_str() && e["kind"] == "agent_exit")
        },
    )
    .await;
    ec2.terminate_instances()
        .instance_ids(victim["cloud_id"].as_str().unwrap())
        .send()
        .await
        .expect("TerminateInstances on LocalStack");

    broker
        .wait_succeeded(&path, Duration::from_secs(300), "job a to finish")
        .await;
    // The job may end during the victim's notice; its end is recorded when the cloud reports
    // it, a tick or two later.
    let done = api
        .wait_for(
            &path,
            Duration::from_secs(60),
            "the victim's end recorded",
            |j| instance(j, &victim_id)["ended"].is_string(),
        )
        .await;
    let victim_after = instance(&done, &victim_id);
    assert_eq!(victim_after["end_reason"], "evicted", "{victim_after}");
    let events = api.get(&format!("/v1/jobs/{a_id}/events")).await;
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "handover_complete"),
        "the victim's shards moved: {events}"
    );
    let cost = api.get(&format!("/v1/jobs/{a_id}/cost")).await;
    assert!(
        cost["evictions"].as_u64().unwrap() >= 1,
        "the ledger shows the eviction: {cost}"
    );
    // Finishing released everything.
    api.wait_for(
        &path,
        Duration::from_secs(30),
        "job a's instances to end",
        |v| live(v).is_empty(),
    )
    .await;

    // A second job, cancelled: every one of its instances is terminated in LocalStack.
    let b = api.post("/v1/jobs", job("e2e-b", 50, 3)).await;
    let b_id = b["id"].as_i64().unwrap();
    api.wait_for(
        &format!("/v1/jobs/{b_id}"),
        Duration::from_secs(120),
        "job b's instances",
        |v| live(v).len() >= 2,
    )
    .await;
    let cancelled = api.cancel(b_id).await;
    assert_eq!(cancelled["state"], "cancelled");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let seen = localstack_instances(&ec2, &deployment).await;
        let still: Vec<&Seen> = seen
            .iter()
            .filter(|s| {
                s.job == b_id.to_string() && s.state != "terminated" && s.state != "shutting-down"
            })
            .collect();
        if still.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "job b's instances not terminated: {still:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let b_view = api.get(&format!("/v1/jobs/{b_id}")).await;
    assert!(live(&b_view).is_empty(), "{b_view}");
}

#[test]
fn dry_run_checks_every_ec2_action_against_the_account() {
    let env = aws_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (code, out, err) = proteus(None, &["serve", "--cloud", "ec2", "--dry-run"], &env);
    assert_eq!(code, 0, "{out}{err}");
    for action in [
        "ec2:RunInstances",
        "ec2:TerminateInstances",
        "ec2:DescribeInstances",
        "ec2:CreateTags",
    ] {
        assert!(out.contains(&format!("ok       {action}")), "{out}");
    }
    let (code, _, err) = proteus(None, &["serve", "--cloud", "sim", "--dry-run"], &env);
    assert_eq!(code, 1);
    assert!(err.contains("--cloud ec2"), "{err}");
}

/// A broker on a database other brokers can share (Postgres), on a cloud they share (EC2),
/// with no checkpoint store named: its default, a directory on its own disk, would leave a job
/// taken over by another broker without its checkpoints, so it refuses to start and says what to
/// set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_would_keep_checkpoints_on_its_own_disk_beside_other_brokers_refuses_to_start()
 {
    let dir = tempfile::tempdir().unwrap();
    let db = ec2_database(dir.path()).await;
    let mut cmd = std::process::Command::new(proteus_e2e::bin("proteus"));
    cmd.args([
        "serve",
        "--cloud",
        "ec2",
        "--region",
        "us-east-1",
        "--deployment",
    ])
    .arg(unique("no-store"))
    .args([
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        &db,
        "--state-dir",
    ])
    .arg(dir.path().join("state"))
    .env("PROTEUS_TOKEN", proteus_e2e::TOKEN)
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped());
    for (k, v) in aws_env() {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("proteus serve");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("proteus serve started (or hung) without a shared checkpoint store");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("--checkpoint-store s3://BUCKET/PREFIX") && err.contains("own disk"),
        "the refusal does not say what to set: {err}"
    );
}
