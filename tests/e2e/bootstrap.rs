//! What a VM carries. An EC2 instance's user data, as the broker writes it and LocalStack hands
//! it back to anyone with `ec2:DescribeInstanceAttribute`, carries a one-time bootstrap token,
//! never an agent token. Run as EC2 would run it — the real script, as root, on this machine, in
//! namespaces of its own (`tests/bootstrap/sandbox`) with a metadata endpoint on its loopback —
//! it makes the programs' unprivileged user, closes instance metadata to that user with a
//! firewall rule, fetches the agent, and starts it; the agent trades the bootstrap token at its
//! first contact, keeps the agent token in a root-only file, and trains the job to its end. The
//! bootstrap token is dead from then on: a second exchange, or one for another instance, is
//! refused and recorded in the job's events.

use proteus_e2e::{BrokerProcess, ec2_database, localstack_ec2, start_ec2_broker_on, unique};
use serde_json::json;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Processes this test started, killed when it ends however it ends (the sandbox's `unshare`
/// takes every process inside with it).
struct Started(Vec<Child>);

impl Drop for Started {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn here(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// Waits (bounded) until `path` exists.
async fn wait_file(path: &Path, timeout: Duration, what: &str, log: &Path) {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {timeout:?}\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| format!("<{}: {e}>", path.display()))
}

/// The bootstrap tokens in `text`: `pb_` and 48 hex digits.
fn bootstrap_tokens(text: &str) -> Vec<String> {
    let mut out: Vec<String> = text
        .match_indices("pb_")
        .filter_map(|(i, _)| {
            let hex = &text.as_bytes()[i + 3..];
            (hex.len() >= 48 && hex[..48].iter().all(u8::is_ascii_hexdigit))
                .then(|| text[i..i + 51].to_string())
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

async fn exchange(broker: &BrokerProcess, token: &str, instance: &str) -> (u16, serde_json::Value) {
    let resp = broker
        .http()
        .post(format!("{}/v1/agents/bootstrap", broker.url))
        .bearer_auth(token)
        .json(&json!({ "instance_id": instance }))
        .send()
        .await
        .expect("the broker answers");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_data_carries_a_one_time_token_and_its_script_boots_an_agent_that_trains_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let deployment = unique("boot");
    let db = ec2_database(dir.path()).await;
    // No agent is started on this machine by the broker: only the user data starts one.
    let broker =
        start_ec2_broker_on(dir.path(), &db, &deployment, &["--local-agents", "false"]).await;
    let api = broker.client();
    let id = api
        .post(
            "/v1/jobs",
            json!({
                "name": "bootstrap", "app": "mlr", "dataset": "digits", "policy": "on-demand",
                "stop": {"epochs": 20},
                "limits": {"max_instances": 1, "max_reliable_instances": 1},
                "work": {"total_work": 1.0, "startup_minutes": 0.0},
                // Paced (1,797 samples an epoch at 1,000 a second: half a minute in all), so
                // that the job still runs while the test tries the spent token again.
                "training": {"seed": 5, "pace_samples_per_sec": 1000}
            }),
        )
        .await["id"]
        .as_i64()
        .unwrap();
    let path = format!("/v1/jobs/{id}");
    let view = api
        .wait_for(
            &path,
            Duration::from_secs(120),
            "a launched instance",
            |v| {
                v["instances"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|i| i["cloud_id"].is_string()))
            },
        )
        .await;
    let instance = view["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["cloud_id"].is_string())
        .unwrap()
        .clone();
    let (broker_id, cloud_id) = (
        instance["id"].as_str().unwrap().to_string(),
        instance["cloud_id"].as_str().unwrap().to_string(),
    );
    let (itype, zone) = instance["market"]
        .as_str()
        .and_then(|m| m.split_once('/'))
        .map(|(z, t)| (t.to_string(), z.to_string()))
        .unwrap_or_else(|| panic!("a market `zone/type`: {instance}"));

    // The user data, as anyone allowed to describe the instance reads it.
    let attr = localstack_ec2()
        .await
        .describe_instance_attribute()
        .instance_id(&cloud_id)
        .attribute(aws_sdk_ec2::types::InstanceAttributeName::UserData)
        .send()
        .await
        .expect("DescribeInstanceAttribute");
    let encoded = attr
        .user_data()
        .and_then(|u| u.value())
        .expect("the instance has user data");
    let mut decode = Command::new("base64")
        .arg("-d")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    decode
        .stdin
        .take()
        .unwrap()
        .write_all(encoded.as_bytes())
        .unwrap();
    let script = String::from_utf8(decode.wait_with_output().unwrap().stdout).unwrap();
    assert!(script.starts_with("#!/bin/bash"), "{script}");
    assert!(
        !proteus_e2e::contains_agent_token(&script),
        "the user data carries an agent token"
    );
    let tokens = bootstrap_tokens(&script);
    assert_eq!(tokens.len(), 1, "one bootstrap token: {tokens:?}");
    let bootstrap = tokens[0].clone();
    // Not yet traded, it is no agent token: the agent API refuses it.
    let resp = broker
        .http()
        .post(format!("{}/v1/agents/{cloud_id}/heartbeat", broker.url))
        .bearer_auth(&bootstrap)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401, "the bootstrap token is no agent token");

    // The script, run as EC2 runs it, in a sandbox of its own.
    let work = dir.path().join("sandbox");
    std::fs::create_dir_all(&work).unwrap();
    let user_data = dir.path().join("user-data.sh");
    std::fs::write(&user_data, &script).unwrap();
    let socket = dir.path().join("broker.sock");
    let mut started = Started(Vec::new());
    started.0.push(
        Command::new("python3")
            .arg(here("bootstrap/relay.py"))
            .args(["listen-unix", socket.to_str().unwrap(), "127.0.0.1"])
            .arg(broker.port.to_string())
            .stdin(Stdio::null())
            .spawn()
            .expect("start the relay"),
    );
    wait_file(
        &socket,
        Duration::from_secs(10),
        "the relay's socket",
        &work,
    )
    .await;
    let sandbox_log = work.join("sandbox.log");
    started.0.push(
        Command::new(here("bootstrap/sandbox"))
            .arg(&user_data)
            .arg(&work)
            .args([&cloud_id, &itype, &zone])
            .arg(broker.port.to_string())
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&sandbox_log).unwrap())
            .stderr(std::fs::File::create(work.join("sandbox.err")).unwrap())
            .spawn()
            .expect("start the sandbox"),
    );
    wait_file(
        &work.join("ready"),
        Duration::from_secs(300),
        "the user data's script",
        &work.join("user-data.log"),
    )
    .await;
    assert_eq!(
        read(&work.join("user-data.status")).trim(),
        "0",
        "the script failed:\n{}\n{}",
        read(&work.join("user-data.log")),
        read(&work.join("sandbox.err"))
    );

    // The programs' user, made by the script (the sandbox removed any this machine had).
    let passwd = read(&work.join("upper/etc/passwd"));
    let user = passwd
        .lines()
        .find(|l| l.starts_with("proteus-job:"))
        .unwrap_or_else(|| panic!("no proteus-job user in {passwd}"));
    let fields: Vec<&str> = user.split(':').collect();
    assert_eq!(fields[6], "/usr/sbin/nologin", "{user}");
    // Instance metadata: refused to that user by the firewall rule, served to root.
    let probe_job = read(&work.join("probe-job.status"));
    assert_ne!(
        probe_job.trim(),
        "0",
        "the programs' user reached instance metadata: {}\n{}",
        read(&work.join("probe-job.out")),
        read(&work.join("nft.txt"))
    );
    assert_eq!(
        read(&work.join("probe-root.status")).trim(),
        "0",
        "root (the agent) must reach it: {}",
        read(&work.join("probe-root.out"))
    );
    let rules = read(&work.join("nft.txt"));
    assert!(
        rules.contains("169.254.169.254") && rules.contains(&format!("skuid {}", fields[2])),
        "{rules}"
    );

    // The agent, started from the unit file, traded its bootstrap token and registered.
    let events_path = format!("{path}/events");
    api.wait_for(
        &events_path,
        Duration::from_secs(120),
        "the agent's exchange and registration",
        |ev| {
            let of = |kind: &str| {
                ev.as_array().is_some_and(|a| {
                    a.iter()
                        .any(|e| e["instance_id"] == broker_id.as_str() && e["kind"] == kind)
                })
            };
            of("agent_bootstrapped") && of("agent_registered")
        },
    )
    .await;
    let token_file = work.join("upper/etc/proteus/agent.token");
    let agent_token = read(&token_file).trim().to_string();
    assert!(
        proteus_e2e::contains_agent_token(&agent_token) && agent_token != bootstrap,
        "the token file holds the agent token now, not {agent_token:?}"
    );
    assert_eq!(
        std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // The bootstrap token is dead: a second exchange is refused and recorded; so is one for
    // another instance; and it fetches nothing any more.
    let (status, body) = exchange(&broker, &bootstrap, &cloud_id).await;
    assert_eq!(status, 403, "a second exchange: {body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or("")
            .contains("second exchange"),
        "{body}"
    );
    let (status, body) = exchange(&broker, &bootstrap, "i-0123456789abcdef0").await;
    assert_eq!(status, 403, "another instance's: {body}");
    let download = broker
        .http()
        .get(format!(
            "{}/v1/downloads/data/digits-8x8.csv.gz",
            broker.url
        ))
        .bearer_auth(&bootstrap)
        .send()
        .await
        .unwrap();
    assert_eq!(download.status(), 403);
    let refused = api.get(&events_path).await;
    let refused: Vec<&serde_json::Value> = refused
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "bootstrap_refused")
        .collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(broker.metric("proteus_bootstrap_refused_total").await >= 2.0);

    // And the agent the script started trains the job to its end.
    broker
        .wait_succeeded(
            &path,
            Duration::from_secs(300),
            "the job, trained by that agent",
        )
        .await;
    let agent_log = read(&work.join("agent.log"));
    assert!(
        agent_log.contains("trading the bootstrap token"),
        "{agent_log}"
    );
    drop(started);
}
