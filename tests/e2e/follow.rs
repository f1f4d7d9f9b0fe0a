//! Following a job from the CLI (`submit --follow`, `status --watch`, `logs -f`), as a user
//! would: real broker on the sim cloud, real agents, the real `proteus` binary.

use proteus_e2e::{BrokerProcess, bin, fresh_pg_database, proteus, wait_bounded, write_c3_trace};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn program() -> String {
    proteus_e2e::example_program("train.py")
}

/// A one-instance command job running `train.py` for `steps` steps.
fn job_file(dir: &Path, name: &str, steps: u32) -> String {
    let file = dir.join(format!("{name}.toml"));
    std::fs::write(
        &file,
        format!(
            "name = \"{name}\"\napp = \"command\"\npolicy = \"on-demand\"\n\
             [limits]\nmax_instances = 1\nmax_reliable_instances = 1\n\
             [work]\ntotal_work = 1.0\ninstance_types = [\"c3.xlarge\"]\nstartup_minutes = 1.0\n\
             [command]\nrun = [\"python3\", \"{}\"]\n\
             [command.env]\nSTEPS = \"{steps}\"\nSTEP_SECS = \"0.05\"\nCHECKPOINT_EVERY = \"10\"\n",
            program()
        ),
    )
    .unwrap();
    file.display().to_string()
}

/// `proteus args` with the broker's URL and token; its stdout lines arrive on the receiver.
fn start(broker: &BrokerProcess, args: &[&str]) -> (Child, mpsc::Receiver<String>) {
    let mut cmd = Command::new(bin("proteus"));
    cmd.args(args)
        .env("PROTEUS_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in broker.user_env() {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("run proteus");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn json_lines(rx: &mpsc::Receiver<String>) -> Vec<Value> {
    rx.try_iter()
        .map(|l| serde_json::from_str(&l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// The `step N` lines of the output lines, in order.
fn steps(lines: &[Value]) -> Vec<u64> {
    lines
        .iter()
        .filter(|l| l["type"] == "output")
        .flat_map(|l| {
            l["text"]
                .as_str()
                .unwrap_or_default()
                .lines()
                .filter_map(|t| t.strip_prefix("step ")?.parse().ok())
                .collect::<Vec<u64>>()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followed_job_streams_until_it_ends_and_ctrl_c_leaves_it_running() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, od) = write_c3_trace(dir.path(), None);
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(
        dir.path(),
        &db,
        "60",
        &["--trace", &trace, "--on-demand", &od],
    )
    .await;
    let api = broker.client();

    // `submit --follow`: events, status and output as they happen, then the end; exit 0.
    let file = job_file(dir.path(), "followed", 40);
    let (child, rx) = start(
        &broker,
        &[
            "submit",
            &file,
            "--follow",
            "--output",
            "json",
            "--interval-ms",
            "200",
        ],
    );
    let (code, err) = wait_bounded(child, Duration::from_secs(240), "submit --follow");
    let lines = json_lines(&rx);
    assert_eq!(code, 0, "{err}\n{lines:#?}");
    let last = lines.last().expect("lines");
    assert_eq!(last["type"], "end", "{lines:#?}");
    assert_eq!(last["state"], "succeeded", "{lines:#?}");
    let kinds: Vec<&str> = lines
        .iter()
        .filter(|l| l["type"] == "event")
        .filter_map(|l| l["kind"].as_str())
        .collect();
    assert!(kinds.contains(&"job_submitted"), "{kinds:?}");
    assert!(kinds.contains(&"launched"), "{kinds:?}");
    // Every step the program printed, each exactly once, in order.
    assert_eq!(steps(&lines), (1..=40).collect::<Vec<_>>(), "{lines:#?}");
    // Status lines: progress never goes back; the first shows the job before its end.
    let progress: Vec<f64> = lines
        .iter()
        .filter(|l| l["type"] == "status")
        .filter_map(|l| l["progress"].as_f64())
        .collect();
    assert!(progress.len() >= 2, "{lines:#?}");
    assert!(progress.windows(2).all(|w| w[0] <= w[1]), "{progress:?}");
    let id = api.get("/v1/jobs").await[0]["id"].as_i64().unwrap();
    // A command job shows none of the built-in apps' facts: no stage, no sync model, no model.
    let job = api.get(&format!("/v1/jobs/{id}")).await;
    assert_eq!(job["app"], "command", "{job}");
    assert!(job["stage"].is_null(), "{job}");
    assert_eq!(job["sync"], "program", "{job}");
    let ready: Vec<&Value> = lines
        .iter()
        .filter(|l| l["type"] == "event" && l["kind"] == "agent_ready")
        .collect();
    assert!(!ready.is_empty(), "{lines:#?}");
    for r in ready {
        assert_eq!(r["detail"], "ready to run the program", "{r}");
    }

    // `logs -f` of the job that has ended: its output once, then the end line; exit 0.
    let (child, rx) = start(&broker, &["logs", &id.to_string(), "-f"]);
    let (code, err) = wait_bounded(child, Duration::from_secs(60), "logs -f");
    let text: Vec<String> = rx.try_iter().collect();
    assert_eq!(code, 0, "{err}\n{text:#?}");
    assert_eq!(
        text.iter().filter(|l| l.ends_with("] step 40")).count(),
        1,
        "{text:#?}"
    );
    assert!(
        text.last()
            .is_some_and(|l| l.starts_with("[end] the job succeeded")),
        "{text:#?}"
    );

    // `status --watch` of a long job, stopped by Ctrl-C: exit 130, and the job keeps running.
    let file = job_file(dir.path(), "long", 100_000);
    let long = broker.submit_file(dir.path(), &std::fs::read_to_string(&file).unwrap());
    let (child, rx) = start(
        &broker,
        &[
            "status",
            &long.to_string(),
            "--watch",
            "--interval-ms",
            "200",
        ],
    );
    let first = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a first line from status --watch");
    assert!(
        first.starts_with("[event]") || first.starts_with("[status]"),
        "{first}"
    );
    // SAFETY: interrupting the process this test started, as Ctrl-C would.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let (code, err) = wait_bounded(
        child,
        Duration::from_secs(30),
        "status --watch after Ctrl-C",
    );
    assert_eq!(code, 130, "{err}");
    assert!(err.contains("keeps running"), "{err}");
    let job = api.get(&format!("/v1/jobs/{long}")).await;
    assert!(
        job["state"] == "running" || job["state"] == "pending",
        "{job}"
    );
    // A follower without a job to follow says so.
    let (child, _) = start(&broker, &["status", "999999", "--watch"]);
    let (code, err) = wait_bounded(child, Duration::from_secs(30), "status --watch of no job");
    assert_ne!(code, 0);
    assert!(err.contains("999999"), "{err}");
    api.post(&format!("/v1/jobs/{long}/cancel"), serde_json::json!({}))
        .await;
}

/// `proteus submit --dry-run`, as a user runs it: the plan as a table and as JSON, and nothing
/// submitted; a bad spec gets the submission's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_prints_the_plan_and_submits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, od) = write_c3_trace(dir.path(), None);
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(
        dir.path(),
        &db,
        "60",
        &["--trace", &trace, "--on-demand", &od],
    )
    .await;
    let file = job_file(dir.path(), "planned", 40);
    // A dry run ends on its own: its whole output is read after it exits.
    let env = broker.user_env();
    let run = |args: &[&str]| proteus(None, args, &env);
    let (code, table, err) = run(&["submit", &file, "--dry-run"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        table.contains("nothing submitted, nothing launched") && table.contains("c3.xlarge"),
        "{table}"
    );
    assert!(table.contains("per unit of work"), "{table}");
    let (code, json, err) = run(&["submit", &file, "--dry-run", "--output", "json"]);
    assert_eq!(code, 0, "{err}");
    let plan: Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
    let purchases = plan["purchases"].as_array().unwrap();
    assert_eq!(purchases.len(), 1, "{plan}");
    assert_eq!(purchases[0]["count"], 1, "max_instances = 1: {plan}");
    assert_eq!(purchases[0]["tier"], "reliable", "on-demand: {plan}");
    assert!(plan["expected_finish"].is_string(), "{plan}");
    // Nothing was stored: no job, no instance.
    let (status, jobs) = broker
        .client()
        .call(reqwest::Method::GET, "/v1/jobs", None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(jobs.as_array().map(Vec::len), Some(0), "{jobs}");
    // A spec the broker refuses: the same error a submission gets, exit 1.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&file)
            .unwrap()
            .replace("policy = \"on-demand\"", "policy = \"no-such-policy\""),
    )
    .unwrap();
    let (code, _, err) = run(&["submit", bad.to_str().unwrap(), "--dry-run"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("policy") && err.contains("no-such-policy"),
        "{err}"
    );
}
