//! Command jobs end to end: a stdlib-only Python program (`examples/command/train.py`) under
//! the contract of docs/command-jobs.md, run by real agents on the sim cloud, evicted by a
//! price spike (the same hand-made trace as `eviction.rs`), resumed by a replacement from its
//! durable checkpoint — in LocalStack's S3 through presigned URLs (LocalStack checks their
//! signatures), or in the broker's directory store — plus exit codes mapped to job states.

use proteus_e2e::{BrokerProcess, fresh_pg_database, localstack_url};
use proteus_e2e::{sim_minutes, write_c3_trace};
use std::path::Path;
use std::time::Duration;

fn program() -> String {
    proteus_e2e::example_program("train.py")
}

/// A command job spec: one spot instance under standard bidding (so the spike evicts the
/// program), with `env` for the program.
fn spec(name: &str, policy: &str, env: &[(&str, &str)], extra: &str) -> String {
    let env: String = env
        .iter()
        .map(|(k, v)| format!("{k} = \"{v}\"\n"))
        .collect();
    format!(
        "name = \"{name}\"\napp = \"command\"\npolicy = \"{policy}\"\n\
         [limits]\nmax_instances = 1\nmax_reliable_instances = 1\n\
         [work]\ntotal_work = 1.0\ninstance_types = [\"c3.xlarge\"]\nstartup_minutes = 1.0\n\
         [command]\nrun = [\"python3\", \"{}\"]\ncheckpoint_interval_secs = 1\n{extra}\
         [command.env]\n{env}",
        program()
    )
}

fn submit(broker: &BrokerProcess, dir: &Path, name: &str, spec: &str) -> i64 {
    let sub = dir.join(name);
    std::fs::create_dir_all(&sub).unwrap();
    broker.submit_file(&sub, spec)
}

/// Every instance's output tail of job `id`, through `broker`, by instance id.
pub(crate) async fn logs(broker: &BrokerProcess, id: i64) -> Vec<(String, String)> {
    let v = broker.client().get(&format!("/v1/jobs/{id}/logs")).await;
    let mut out: Vec<(String, String)> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["instance_id"].as_str().unwrap().to_string(),
                t["output"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    out.sort();
    out
}

/// The numbers after `prefix` on the lines that start with it.
fn numbers(text: &str, prefix: &str) -> Vec<u64> {
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter_map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|n| n.parse().ok())
        })
        .collect()
}

async fn events(broker: &BrokerProcess, id: i64) -> Vec<(String, String, String)> {
    let v = broker.client().get(&format!("/v1/jobs/{id}/events")).await;
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["instance_id"].as_str().unwrap_or("").to_string(),
                e["kind"].as_str().unwrap().to_string(),
                e["detail"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The evicted run and the one that replaced it: (last step the evicted run printed, step the
/// replacement resumed from, the replacement's output).
fn evicted_then_resumed(tails: &[(String, String)]) -> (u64, u64, String) {
    let story = || {
        tails
            .iter()
            .map(|(i, t)| format!("==> {i}\n{t}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let evicted = tails
        .iter()
        .find(|(_, t)| t.contains("notice delivered (SIGTERM)"))
        .unwrap_or_else(|| panic!("no instance got a notice:\n{}", story()));
    let last_step = *numbers(&evicted.1, "step ")
        .last()
        .unwrap_or_else(|| panic!("the evicted run did no step:\n{}", story()));
    let replacement = tails
        .iter()
        .find(|(i, t)| i != &evicted.0 && t.contains("restored the checkpoint of rank 0"))
        .unwrap_or_else(|| panic!("no replacement ran the program:\n{}", story()));
    let resumed = numbers(&replacement.1, "start rank=0 world=1 resumed_from=");
    (last_step, resumed[0], replacement.1.clone())
}

/// A plain (unsigned) `GET` on LocalStack's S3: LocalStack lets anonymous requests read, so
/// the test sees the bucket without signing code of its own.
async fn s3_get(path: &str) -> (reqwest::StatusCode, Vec<u8>) {
    let resp = reqwest::get(format!("{}{path}", localstack_url()))
        .await
        .expect("LocalStack S3 answers");
    let status = resp.status();
    (status, resp.bytes().await.expect("S3 body").to_vec())
}

/// The `step` in `state.json` of a checkpoint archive (gzipped tar), read by Python's
/// `tarfile` — an implementation independent of the agent's packing.
fn step_in_archive(archive: &[u8]) -> u64 {
    use std::io::Write;
    let mut child = std::process::Command::new("python3")
        .args([
            "-c",
            "import io, json, sys, tarfile\n\
             t = tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read()))\n\
             print(json.load(t.extractfile('state.json'))['step'])",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    child.stdin.take().unwrap().write_all(archive).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the archive is not a tar.gz with state.json"
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// Waits, with the market held a minute before the spike (`--hold-at`), until the program of
/// job `id` (150 steps, a checkpoint every 5) is past its first checkpoint, then lifts the
/// hold: the spike finds it running with something saved, however slowly it started.
async fn past_its_first_checkpoint(broker: &BrokerProcess, id: i64) {
    let api = broker.client();
    api.wait_for(
        &format!("/v1/jobs/{id}"),
        Duration::from_secs(180),
        "the program past its first checkpoint before the spike",
        |j| j["progress"].as_f64().unwrap_or(0.0) >= 6.0 / 150.0,
    )
    .await;
    api.lift_hold().await;
}

/// Evicted mid-run by a price spike; the checkpoint goes through LocalStack's S3 (the broker
/// presigns, the agent `PUT`s and `GET`s, LocalStack verifies the signatures); the replacement
/// resumes exactly where the warned program saved; the job succeeds on the program's own
/// progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_program_resumes_from_its_checkpoint_on_the_replacement() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, od) = write_c3_trace(
        dir.path(),
        Some((super::eviction::SPIKE_AT_MIN, super::eviction::SPIKE_MIN)),
    );
    let db = fresh_pg_database().await;
    let bucket = proteus_e2e::unique("ck")
        .replace('_', "-")
        .to_ascii_lowercase();
    let store = format!("s3://{bucket}/e2e");
    let endpoint = localstack_url();
    let broker = BrokerProcess::start_sim_with_env(
        dir.path(),
        &db,
        "60",
        &[
            "--trace",
            &trace,
            "--on-demand",
            &od,
            "--min-notice-secs",
            "8",
            "--checkpoint-store",
            &store,
            "--hold-at",
            &sim_minutes(super::eviction::SPIKE_AT_MIN - 1),
        ],
        &[
            ("AWS_ENDPOINT_URL_S3", endpoint.as_str()),
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("AWS_REGION", "us-east-1"),
        ],
    )
    .await;
    // The program itself comes from S3 too: `workdir = "s3://…"` is a gzipped tar of its
    // directory, which every instance fetches (presigned by the broker) before it starts, so
    // `run` names it relative to that directory.
    let workdir_key = "programs/train.tar.gz";
    let program_dir = dir.path().join("program");
    std::fs::create_dir_all(&program_dir).unwrap();
    std::fs::copy(program(), program_dir.join("train.py")).unwrap();
    let archive = dir.path().join("train.tar.gz");
    let tar = std::process::Command::new("tar")
        .arg("-C")
        .arg(&program_dir)
        .arg("-czf")
        .arg(&archive)
        .arg(".")
        .status()
        .expect("tar");
    assert!(tar.success());
    let put = reqwest::Client::new()
        .put(format!("{endpoint}/{bucket}/{workdir_key}"))
        .body(std::fs::read(&archive).unwrap())
        .send()
        .await
        .expect("LocalStack S3 answers");
    assert!(put.status().is_success(), "{:?}", put.status());
    let id = submit(
        &broker,
        dir.path(),
        "evict",
        &spec(
            "evicted-resumes",
            "standard-bidding",
            &[
                ("STEPS", "150"),
                ("STEP_SECS", "0.2"),
                ("CHECKPOINT_EVERY", "5"),
            ],
            &format!("kill_margin_secs = 2\nworkdir = \"s3://{bucket}/{workdir_key}\"\n"),
        )
        .replace(&program(), "train.py"),
    );
    past_its_first_checkpoint(&broker, id).await;
    let job = broker
        .wait_succeeded(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(300),
            "the job",
        )
        .await;
    assert!(
        job["state_reason"]
            .as_str()
            .unwrap_or("")
            .contains("program completed"),
        "{job}"
    );
    let tails = logs(&broker, id).await;
    let (last, resumed, replacement) = evicted_then_resumed(&tails);
    // Both the evicted instance and its replacement ran `train.py` from the fetched directory.
    let fetched = broker
        .agent_logs()
        .matches("fetched the working directory")
        .count();
    assert!(
        fetched >= 2,
        "{fetched} instances fetched the working directory"
    );
    // The warned program saved on SIGTERM: nothing lost at all (the contract allows up to the
    // program's own checkpoint interval).
    assert!(
        resumed > 0,
        "the replacement started from scratch:\n{replacement}"
    );
    assert_eq!(resumed, last, "steps lost between the runs:\n{tails:?}");
    assert!(
        replacement.contains("restored the checkpoint of rank 0"),
        "{replacement}"
    );
    assert!(
        replacement.lines().any(|l| l == "step 150"),
        "{replacement}"
    );
    // The checkpoint is in the bucket (and not in the broker's directory): the last upload,
    // taken when the program exited, holds its final step.
    let key = format!("e2e/job-{id}/rank-0.tar.gz");
    let (status, listing) = s3_get(&format!("/{bucket}?list-type=2")).await;
    assert!(status.is_success(), "{status}");
    let listing = String::from_utf8_lossy(&listing);
    assert!(listing.contains(&format!("<Key>{key}</Key>")), "{listing}");
    let (status, archive) = s3_get(&format!("/{bucket}/{key}")).await;
    assert!(status.is_success(), "{status}");
    assert_eq!(step_in_archive(&archive), 150);
    assert!(
        !broker
            .state_dir
            .join("checkpoints")
            .join(format!("job-{id}"))
            .exists(),
        "the directory store was not used"
    );
    // LocalStack does check presigned signatures, so the agent's transfers above were signed
    // right: the same object with a wrong signature is refused.
    let now = chrono::Utc::now();
    let forged = format!(
        "/{bucket}/{key}?X-Amz-Algorithm=AWS4-HMAC-SHA256\
         &X-Amz-Credential=test%2F{}%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date={}\
         &X-Amz-Expires=600&X-Amz-SignedHeaders=host&X-Amz-Signature={}",
        now.format("%Y%m%d"),
        now.format("%Y%m%dT%H%M%SZ"),
        "0".repeat(64)
    );
    let (status, body) = s3_get(&forged).await;
    assert_eq!(
        status,
        reqwest::StatusCode::FORBIDDEN,
        "{}",
        String::from_utf8_lossy(&body)
    );
    let kinds: Vec<(String, String, String)> = events(&broker, id).await;
    assert!(
        kinds
            .iter()
            .any(|(_, k, d)| k == "program_exited" && d.contains("after a notice")),
        "{kinds:?}"
    );
    assert!(kinds.iter().any(|(_, k, _)| k == "evicted"), "{kinds:?}");
    // The progress the broker recorded is the program's own.
    assert_eq!(job["progress"].as_f64(), Some(1.0), "{job}");
}

/// The directory store (the default), a program that ignores SIGTERM and is SIGKILLed at the
/// margin yet completes from its last upload, and exit codes: a failure within
/// `max_restarts` is retried and the job succeeds; failures beyond it fail the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_is_enforced_at_the_margin_and_exit_codes_decide_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, od) = write_c3_trace(
        dir.path(),
        Some((super::eviction::SPIKE_AT_MIN, super::eviction::SPIKE_MIN)),
    );
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(
        dir.path(),
        &db,
        "60",
        &[
            "--trace",
            &trace,
            "--on-demand",
            &od,
            "--min-notice-secs",
            "8",
            "--hold-at",
            &sim_minutes(super::eviction::SPIKE_AT_MIN - 1),
        ],
    )
    .await;
    // This broker keeps checkpoints in a directory: it has no credentials to presign an
    // `s3://` working directory, so such a job is refused at submission, saying why.
    let job = dir.path().join("s3-workdir.toml");
    std::fs::write(
        &job,
        spec(
            "s3-workdir",
            "on-demand",
            &[],
            "workdir = \"s3://some-bucket/prog.tar.gz\"\n",
        ),
    )
    .unwrap();
    let (code, _, err) =
        proteus_e2e::proteus(None, &["submit", job.to_str().unwrap()], &broker.user_env());
    assert_ne!(code, 0, "an unsignable s3:// workdir was accepted");
    assert!(
        err.contains("command.workdir") && err.contains("--checkpoint-store"),
        "{err}"
    );
    let stubborn = submit(
        &broker,
        dir.path(),
        "stubborn",
        &spec(
            "ignores-sigterm",
            "standard-bidding",
            &[
                ("STEPS", "150"),
                ("STEP_SECS", "0.2"),
                ("CHECKPOINT_EVERY", "5"),
                ("IGNORE_SIGTERM", "1"),
            ],
            "kill_margin_secs = 3\n",
        ),
    );
    // On demand: nothing evicts these two; they end (or fail) well before the spike.
    let retried = submit(
        &broker,
        dir.path(),
        "retried",
        &spec(
            "fails-once",
            "on-demand",
            &[
                ("STEPS", "6"),
                ("STEP_SECS", "0.05"),
                ("CHECKPOINT_EVERY", "2"),
                ("FAIL_ONCE_AT_STEP", "3"),
            ],
            "max_restarts = 1\n",
        ),
    );
    let failing = submit(
        &broker,
        dir.path(),
        "failing",
        &spec(
            "always-fails",
            "on-demand",
            &[("STEPS", "6"), ("STEP_SECS", "0.05"), ("FAIL_AT_STEP", "2")],
            "max_restarts = 1\n",
        ),
    );

    let api = broker.client();
    let over = |v: &serde_json::Value| v["state"] != "running" && v["state"] != "pending";
    let failed = api
        .wait_for(
            &format!("/v1/jobs/{failing}"),
            Duration::from_secs(120),
            "the failing job",
            over,
        )
        .await;
    assert_eq!(failed["state"], "failed", "{failed}");
    let reason = failed["state_reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("program failed 2 times") && reason.contains("exit code 3"),
        "{failed}"
    );
    let exits: Vec<_> = events(&broker, failing)
        .await
        .into_iter()
        .filter(|(_, k, _)| k == "program_exited")
        .collect();
    assert_eq!(
        exits.len(),
        2,
        "one run, one restart, then failed: {exits:?}"
    );

    let retried_job = broker
        .wait_succeeded(
            &format!("/v1/jobs/{retried}"),
            Duration::from_secs(120),
            "the retried job",
        )
        .await;
    let exits: Vec<String> = events(&broker, retried)
        .await
        .into_iter()
        .filter(|(_, k, _)| k == "program_exited")
        .map(|(_, _, d)| d)
        .collect();
    assert_eq!(
        exits,
        ["exit code 3", "exit code 0, completing the job"],
        "{retried_job}"
    );
    let out = logs(&broker, retried).await;
    assert_eq!(out.len(), 1, "restarted on the same instance: {out:?}");
    assert!(
        out[0].1.contains("resumed_from=2"),
        "the restart resumed from the local checkpoint:\n{}",
        out[0].1
    );

    past_its_first_checkpoint(&broker, stubborn).await;
    broker
        .wait_succeeded(
            &format!("/v1/jobs/{stubborn}"),
            Duration::from_secs(300),
            "the stubborn job",
        )
        .await;
    let tails = logs(&broker, stubborn).await;
    let evicted = tails
        .iter()
        .find(|(_, t)| t.contains("notice delivered (SIGTERM)"))
        .unwrap_or_else(|| panic!("no notice: {tails:?}"));
    assert!(
        evicted
            .1
            .contains("still running at the kill margin: SIGKILL"),
        "{}",
        evicted.1
    );
    assert!(evicted.1.contains("signal: Some(9)"), "{}", evicted.1);
    let (last, resumed, replacement) = evicted_then_resumed(&tails);
    // It never saved on the notice: the replacement starts from its last periodic
    // checkpoint, at most one checkpoint interval (5 steps) behind.
    assert!(resumed > 0 && resumed % 5 == 0, "{replacement}");
    assert!(
        last >= resumed && last - resumed < 5,
        "lost {} steps:\n{tails:?}",
        last - resumed
    );
    assert!(
        replacement.lines().any(|l| l == "step 150"),
        "{replacement}"
    );
    assert!(
        broker
            .state_dir
            .join("checkpoints")
            .join(format!("job-{stubborn}"))
            .join("rank-0.tar.gz")
            .is_file(),
        "the directory store holds the checkpoint"
    );
}

/// What a program can read of the machine it runs on, under a root agent's defaults: its
/// environment, its agent's `/proc/<pid>/environ` and `cmdline`, every other process's
/// `environ`, and every file it can open under the broker's state directory. Written to
/// `$PROBE_OUT/<instance>.txt`; then it runs `train.py` in its place.
const PROBE: &str = r#"
import os, sys
out = []
def note(name, read):
    try:
        out.append(f"== {name}\n{read()}")
    except Exception as e:
        out.append(f"== {name}: unreadable ({type(e).__name__})")
def text(path):
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")
out.append(f"uid={os.getuid()}")
out.append("== env\n" + "\n".join(f"{k}={v}" for k, v in sorted(os.environ.items())))
ppid = os.getppid()
note(f"/proc/{ppid}/environ (the agent)", lambda: text(f"/proc/{ppid}/environ"))
note(f"/proc/{ppid}/cmdline (the agent)", lambda: text(f"/proc/{ppid}/cmdline"))
for pid in filter(str.isdigit, os.listdir("/proc")):
    if int(pid) not in (os.getpid(), ppid):
        try:
            out.append(f"== /proc/{pid}/environ\n" + text(f"/proc/{pid}/environ"))
        except Exception:
            pass
for root, dirs, files in os.walk(os.environ["PROBE_STATE"]):
    for f in files:
        p = os.path.join(root, f)
        try:
            out.append(f"== {p}\n" + text(p))
        except Exception:
            pass
with open(os.path.join(os.environ["PROBE_OUT"], os.environ["PROTEUS_INSTANCE_ID"] + ".txt"), "w") as f:
    f.write("\n".join(out))
# Ranks run at different speeds, so that the job completes (rank 0 first) while the others
# still run: they are stopped at the job's end.
os.environ["STEP_SECS"] = str(0.1 * (1 + int(os.environ["PROTEUS_RANK"])))
os.execvp("python3", ["python3", os.environ["PROBE_TRAIN"]])
"#;

/// The lines `start rank=R world=W resumed_from=S` of a tail, as (R, W, S).
fn starts(tail: &str) -> Vec<(u64, u64, u64)> {
    tail.lines()
        .filter_map(|l| l.strip_prefix("start rank="))
        .filter_map(|rest| {
            let n: Vec<u64> = rest
                .split(|c: char| !c.is_ascii_digit())
                .filter(|s| !s.is_empty())
                .filter_map(|s| s.parse().ok())
                .collect();
            (n.len() == 3).then(|| (n[0], n[1], n[2]))
        })
        .collect()
}

/// Three instances (one reliable, two spot) run the program as ranks 0–2 under root agents
/// with their defaults (as CI starts them): the program runs as the unprivileged
/// `proteus-job`. A spot one is interrupted mid-run with the 20 s notice the sim cloud gives by default:
/// its program gets the notice file before SIGTERM, saves and exits well before SIGKILL; its
/// replacement waits for the rank, takes *that* rank (never a fourth), restores its newest
/// checkpoint and goes on from the very step the warned program saved. When the job completes
/// the other programs get the notice file before their SIGTERM too, and the warned instance is
/// an eviction in the report. Meanwhile every program looked for the broker's and the agents'
/// secrets and found none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_takes_the_departed_rank_and_programs_reach_no_secret() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // The program's user reads the probe and writes its findings here.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let probe_out = dir.path().join("probe");
    std::fs::create_dir_all(&probe_out).unwrap();
    std::fs::set_permissions(&probe_out, std::fs::Permissions::from_mode(0o777)).unwrap();
    let probe = dir.path().join("probe.py");
    std::fs::write(&probe, PROBE).unwrap();
    std::fs::set_permissions(&probe, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (trace, od) = write_c3_trace(dir.path(), None);
    let db = fresh_pg_database().await;
    const AWS_SECRET: &str = "aws-canary-0b1f7e5d9c3a";
    let broker = BrokerProcess::start_sim_with_env(
        dir.path(),
        &db,
        "60",
        &["--trace", &trace, "--on-demand", &od],
        &[
            ("AWS_SECRET_ACCESS_KEY", AWS_SECRET),
            ("AWS_ACCESS_KEY_ID", "AKIACANARY"),
        ],
    )
    .await;
    let state = broker.state_dir.display().to_string();
    let spec = format!(
        "name = \"ranks\"\napp = \"command\"\npolicy = \"standard-bidding\"\n\
         [limits]\nmax_instances = 3\nmax_reliable_instances = 1\n\
         [work]\ntotal_work = 1.0\ninstance_types = [\"c3.xlarge\"]\nstartup_minutes = 1.0\n\
         [command]\nrun = [\"python3\", \"{}\"]\ncheckpoint_interval_secs = 1\n\
         [command.env]\nSTEPS = \"400\"\nSTEP_SECS = \"0.1\"\nCHECKPOINT_EVERY = \"5\"\n\
         PROBE_OUT = \"{}\"\nPROBE_STATE = \"{state}\"\nPROBE_TRAIN = \"{}\"\n",
        probe.display(),
        probe_out.display(),
        program()
    );
    let id = submit(&broker, dir.path(), "ranks", &spec);
    let api = broker.client();

    // The three train as ranks 0, 1, 2 (in a world of at most 3).
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    let tails = loop {
        let t = logs(&broker, id).await;
        let training = t
            .iter()
            .filter(|(_, o)| numbers(o, "step ").last().is_some_and(|&s| s >= 20))
            .count();
        if training == 3 {
            break t;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "three programs never trained: {t:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let mut ranks: Vec<u64> = tails
        .iter()
        .map(|(_, o)| starts(o).first().expect("a start line").0)
        .collect();
    ranks.sort();
    assert_eq!(ranks, [0, 1, 2], "{tails:?}");
    // The agents' tokens, read as root from their token files, for the probe check.
    let agent_tokens = broker.agent_tokens();
    assert!(!agent_tokens.is_empty(), "no agent token found to look for");

    // A spot instance is warned (interruption is a spot instance's fate).
    let job = api.get(&format!("/v1/jobs/{id}")).await;
    let victim = job["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["tier"] == "transient" && i["worker_rank"].is_u64())
        .unwrap_or_else(|| panic!("no spot worker: {job}"))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let victim_tail = &tails.iter().find(|(i, _)| *i == victim).unwrap().1;
    let victim_rank = starts(victim_tail)[0].0;
    let (code, _, err) = proteus_e2e::proteus(None, &["interrupt", &victim], &broker.user_env());
    assert_eq!(code, 0, "proteus interrupt failed: {err}");
    broker
        .wait_succeeded(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(300),
            "the job",
        )
        .await;
    // The job's outcome is decided when rank 0 is done; the others are then stopped
    // gracefully, and their last words are read once every instance has ended.
    let job = api
        .wait_for(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(120),
            "every instance of the finished job ended",
            |j| {
                j["instances"]
                    .as_array()
                    .is_some_and(|i| i.iter().all(|i| i["state"] == "terminated"))
            },
        )
        .await;
    let tails = logs(&broker, id).await;
    let story = || {
        tails
            .iter()
            .map(|(i, t)| format!("==> {i}\n{t}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let of = |iid: &str| &tails.iter().find(|(i, _)| i == iid).unwrap().1;

    // The warned program found the notice file with its SIGTERM, saved and exited in time.
    let warned = of(&victim);
    assert!(warned.contains("sigterm notice_file=yes"), "{warned}");
    assert!(!warned.contains("SIGKILL"), "{warned}");
    let saved = numbers(warned, "notice: saved step ");
    assert_eq!(saved.len(), 1, "{warned}");

    // Its successor took its rank once it was free, restored that rank's checkpoint and went
    // on from the very step it saved; no program ever started beyond rank 2 or world 3. The
    // successor is a new instance, or (when the world shrank before one came) a survivor the
    // smaller world re-ranked: either way, a start of another instance as that rank, resumed.
    let successor = |t: &str| {
        starts(t)
            .into_iter()
            .find(|s| s.0 == victim_rank && s.2 > 0)
    };
    let replacement = tails
        .iter()
        .find(|(i, t)| i != &victim && successor(t).is_some())
        .unwrap_or_else(|| panic!("no replacement took rank {victim_rank}:\n{}", story()));
    assert!(
        replacement
            .1
            .contains(&format!("restored the checkpoint of rank {victim_rank}")),
        "{}",
        replacement.1
    );
    assert_eq!(
        successor(&replacement.1).map(|s| s.2),
        Some(saved[0]),
        "steps lost between the warned program and its replacement:\n{}",
        story()
    );
    for (i, t) in &tails {
        for (rank, world, _) in starts(t) {
            assert!(
                rank < 3 && world <= 3,
                "{i} started as rank {rank} of {world}:\n{}",
                story()
            );
        }
    }
    // Every SIGTERM came with the notice file: the warned one and those at the job's end.
    for (i, t) in &tails {
        assert!(!t.contains("sigterm notice_file=no"), "{i}:\n{t}");
    }
    // At the job's end the programs still running are stopped the same way (notice file,
    // SIGTERM, their grace), save, and their last words reach the broker before their
    // instances end. (The handler prints its line at once; the step under way may finish
    // after it.)
    let stopped_at_end = |tail: &str| {
        let lines: Vec<&str> = tail.lines().collect();
        let last_run = &lines[lines.len().saturating_sub(8)..];
        last_run
            .iter()
            .any(|l| l.starts_with("notice: saved step "))
            && last_run.contains(&"sigterm notice_file=yes")
    };
    assert!(
        tails
            .iter()
            .filter(|(i, _)| *i != victim)
            .any(|(_, t)| stopped_at_end(t)),
        "no program was stopped at the job's end:\n{}",
        story()
    );
    // The warned instance is an eviction in the report.
    let cost = api.get(&format!("/v1/jobs/{id}/cost")).await;
    assert!(
        cost["evictions"].as_u64().is_some_and(|n| n >= 1),
        "{cost}\n{job}"
    );

    // No program reached a secret: not the user's token, not the database URL, not the
    // broker's AWS credentials, not any agent's token; and the agent's environment was
    // closed to it.
    let job_uid = proteus_e2e::program_uid();
    assert_ne!(job_uid, 0);
    let mut dumps = 0;
    for e in std::fs::read_dir(&probe_out).unwrap().flatten() {
        let dump = std::fs::read_to_string(e.path()).unwrap();
        dumps += 1;
        assert!(
            dump.contains(&format!("uid={job_uid}")),
            "the program did not run as {}:\n{dump}",
            proteus_e2e::PROGRAM_USER
        );
        assert!(
            dump.contains("(the agent): unreadable"),
            "the agent's environ was readable:\n{dump}"
        );
        for secret in [proteus_e2e::TOKEN, AWS_SECRET, db.as_str()]
            .into_iter()
            .chain(agent_tokens.iter().map(String::as_str))
        {
            assert!(
                !dump.contains(secret),
                "a program reached {secret:?}:\n{dump}"
            );
        }
        assert!(
            !proteus_e2e::contains_agent_token(&dump),
            "an agent token:\n{dump}"
        );
        let env = dump
            .split("== env\n")
            .nth(1)
            .unwrap()
            .split("\n== ")
            .next()
            .unwrap();
        let names: Vec<&str> = env.lines().filter_map(|l| l.split('=').next()).collect();
        for name in &names {
            assert!(
                name.starts_with("PROTEUS_")
                    || name.starts_with("PROBE_")
                    || [
                        "PATH",
                        "HOME",
                        "LANG",
                        "TZ",
                        "STEPS",
                        "STEP_SECS",
                        "CHECKPOINT_EVERY"
                    ]
                    .contains(name)
                    || name.starts_with("LC_"),
                "{name} crossed into the program's environment:\n{env}"
            );
        }
    }
    assert!(dumps >= 4, "{dumps} probes ran (3 + the replacement)");
}

/// Today's market live (`serve --cloud sim --availability`): a command job with a deadline on
/// BidBrain. Its zone loses all spot capacity 40 market minutes in and the other zone never has
/// any: the instance gets its notice, saves and leaves; relaunches are refused for capacity
/// until the zone is back; the replacement resumes from the checkpoint and the job completes
/// before its deadline. Interrupted inside its first hour, the first instance costs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_todays_market_a_capacity_drop_is_ridden_out_before_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    // A folder named as SkyPilot's are: the traces start at its date, the brokers' SIM_START.
    let traces = dir.path().join("aws-05-01-2015");
    std::fs::create_dir_all(&traces).unwrap();
    let write = |zone: &str, ticks: String| {
        let data: Vec<String> = ticks.chars().map(|c| c.to_string()).collect();
        let path = traces.join(format!("{zone}_v100_1.json"));
        std::fs::write(
            &path,
            format!(
                "{{\"metadata\": {{\"gap_seconds\": 600}}, \"data\": [{}]}}",
                data.join(",")
            ),
        )
        .unwrap();
        path.display().to_string()
    };
    let a = write(
        "us-west-2a",
        format!("{}{}{}", "1".repeat(4), "0".repeat(3), "1".repeat(200)),
    );
    let b = write("us-west-2b", "0".repeat(207));
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(
        dir.path(),
        &db,
        "120",
        &[
            "--availability",
            &a,
            &b,
            "--region",
            "us-west-2",
            "--billing",
            "per-second",
            "--market-model",
            "hazard",
            "--min-notice-secs",
            "5",
        ],
    )
    .await;
    let spec = format!(
        "name = \"today\"\napp = \"command\"\npolicy = \"bidbrain\"\n\
         [limits]\nmax_instances = 1\nmax_reliable_instances = 1\ndeadline_hours = 4.0\n\
         [work]\ntotal_work = 1.0\ninstance_types = [\"p3.2xlarge\"]\nstartup_minutes = 1.0\n\
         [command]\nrun = [\"python3\", \"{}\"]\ncheckpoint_interval_secs = 1\nkill_margin_secs = 2\n\
         [command.env]\nSTEPS = \"300\"\nSTEP_SECS = \"0.1\"\nCHECKPOINT_EVERY = \"5\"\n",
        program()
    );
    let id = submit(&broker, dir.path(), "today", &spec);
    let job = broker
        .wait_succeeded(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(240),
            "the job on today's market",
        )
        .await;
    assert_eq!(job["evictions"], 1, "{job}");
    let instances = job["instances"].as_array().unwrap();
    assert!(
        instances
            .iter()
            .filter(|i| i["ready"].is_string())
            .all(|i| i["market"] == "us-west-2a/p3.2xlarge"),
        "only the zone with capacity ran anything: {job}"
    );
    let ev = events(&broker, id).await;
    assert!(
        ev.iter().any(|(_, kind, detail)| kind == "launch_failed"
            && detail.contains("InsufficientInstanceCapacity")),
        "relaunches were refused for capacity: {ev:?}"
    );
    let tails = logs(&broker, id).await;
    let (last, resumed, _) = evicted_then_resumed(&tails);
    assert!(
        resumed > 0 && resumed + 5 >= last && resumed <= last + 1,
        "resumed from {resumed}, the interrupted run reached {last}"
    );
    // Per-second billing: the interrupted instance ran under an hour, so it is free; the job
    // paid only for the replacement.
    let report = broker.client().get(&format!("/v1/jobs/{id}/cost")).await;
    let lines = report["lines"].as_array().cloned().unwrap_or_default();
    let evicted = instances
        .iter()
        .find(|i| i["end_reason"] == "evicted")
        .unwrap_or_else(|| panic!("no evicted instance: {job}"))["id"]
        .clone();
    let of_evicted: Vec<_> = lines
        .iter()
        .filter(|l| l["instance_id"] == evicted)
        .collect();
    assert!(
        !of_evicted.is_empty()
            && of_evicted
                .iter()
                .all(|l| l["amount_usd"] == 0.0 && l["free"] == true),
        "{report}"
    );
    assert!(job["spend_usd"].as_f64().unwrap() > 0.0, "{job}");
}

/// The rank (`start rank=R`) and the step the program saved on its notice (`notice: saved
/// step N`) in one instance's output tail.
fn rank_and_final_save(tail: &str) -> (Option<u64>, Option<u64>) {
    (
        numbers(tail, "start rank=").last().copied(),
        numbers(tail, "notice: saved step ").last().copied(),
    )
}

/// A cancel is a stop Proteus chooses, as a policy's release and the job's end are: every
/// program gets the notice file and the job's `grace_seconds` (here its save takes 4 s, longer
/// than the 2 s the machine's shutdown used to leave it), its final checkpoint is uploaded, and
/// only then is its instance ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_lets_every_program_save_and_upload_before_its_instance_ends() {
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
    let spec = spec(
        "graceful",
        "on-demand",
        &[
            ("STEPS", "100000"),
            ("STEP_SECS", "0.05"),
            // Never a periodic save: what is in the store at the end is the final one.
            ("CHECKPOINT_EVERY", "1000000"),
            ("SAVE_SECS", "4"),
        ],
        "grace_seconds = 20\n",
    )
    .replace(
        "max_instances = 1\nmax_reliable_instances = 1",
        "max_instances = 2\nmax_reliable_instances = 2",
    );
    let id = submit(&broker, dir.path(), "graceful", &spec);
    let api = broker.client();
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    loop {
        let tails = logs(&broker, id).await;
        if tails.len() == 2 && tails.iter().all(|(_, t)| t.contains("\nstep 20\n")) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "two ranks not training within 180 s: {tails:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    api.cancel(id).await;
    api.wait_for(
        &format!("/v1/jobs/{id}"),
        Duration::from_secs(120),
        "every instance of the cancelled job ended",
        |j| {
            j["state"] == "cancelled"
                && j["instances"]
                    .as_array()
                    .is_some_and(|i| i.iter().all(|i| i["state"] == "terminated"))
        },
    )
    .await;

    let tails = logs(&broker, id).await;
    let mut ranks = Vec::new();
    for (instance, tail) in &tails {
        let (rank, saved) = rank_and_final_save(tail);
        let (Some(rank), Some(saved)) = (rank, saved) else {
            panic!("{instance} did not save on its notice:\n{tail}");
        };
        assert!(
            tail.contains("sigterm notice_file=yes"),
            "{instance}: SIGTERM without the notice file:\n{tail}"
        );
        assert!(
            !tail.contains("SIGKILL"),
            "{instance} was killed within its grace:\n{tail}"
        );
        let archive = std::fs::read(
            broker
                .state_dir
                .join("checkpoints")
                .join(format!("job-{id}"))
                .join(format!("rank-{rank}.tar.gz")),
        )
        .unwrap_or_else(|e| panic!("{instance}: no checkpoint of rank {rank}: {e}\n{tail}"));
        assert_eq!(
            step_in_archive(&archive),
            saved,
            "{instance}: the store holds another step than its final save:\n{tail}"
        );
        ranks.push(rank);
    }
    ranks.sort();
    assert_eq!(ranks, [0, 1]);
    // Each instance ended only after its agent had left.
    let history = events(&broker, id).await;
    for (instance, _) in &tails {
        let at = |kind: &str| {
            history
                .iter()
                .position(|(i, k, _)| i == instance && k == kind)
                .unwrap_or_else(|| panic!("no {kind} event for {instance}: {history:?}"))
        };
        assert!(
            at("agent_exit") < at("terminated"),
            "{instance} ended before its agent left: {history:?}"
        );
    }
}

/// A policy's release is graceful too, and its replacement resumes where the released program
/// saved. Uniform Progress starts the job on on-demand while a price spike keeps spot away, and
/// once the job is well ahead of its line it tries spot at every look: the spike refuses it and
/// on-demand stays; when a spot launch is granted, the on-demand instance is released at once
/// (Uniform Progress as published: the switch pays the restart). The released program gets the notice file and
/// its grace, saves (in 2 s) and its checkpoint is uploaded before the instance ends; the spot
/// instance, once it runs, takes rank 0's lineage and resumes at exactly the saved step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_program_saves_and_its_replacement_resumes_at_the_same_step() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, od) = write_c3_trace(dir.path(), Some((0, 10)));
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(
        dir.path(),
        &db,
        "60",
        &["--trace", &trace, "--on-demand", &od],
    )
    .await;
    let spec = spec(
        "released",
        "uniform-progress",
        &[
            ("STEPS", "600"),
            ("STEP_SECS", "0.05"),
            ("CHECKPOINT_EVERY", "1000000"),
            ("SAVE_SECS", "2"),
        ],
        "grace_seconds = 20\n",
    )
    .replace(
        "max_reliable_instances = 1\n",
        "max_reliable_instances = 1\ndeadline_hours = 10.0\n",
    );
    let id = submit(&broker, dir.path(), "released", &spec);
    let job = broker
        .wait_succeeded(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(300),
            "the job that moved from on-demand to spot",
        )
        .await;
    let instances = job["instances"].as_array().unwrap();
    let of = |tier: &str| -> Vec<String> {
        instances
            .iter()
            .filter(|i| i["tier"] == tier && i["cloud_id"].is_string())
            .map(|i| i["id"].as_str().unwrap().to_string())
            .collect()
    };
    // (Spot launches refused during the spike never ran.)
    let (on_demand, spot) = (of("reliable"), of("transient"));
    assert_eq!((on_demand.len(), spot.len()), (1, 1), "{job}");
    let history = events(&broker, id).await;
    let at = |instance: &str, kind: &str| {
        history
            .iter()
            .position(|(i, k, _)| i == instance && k == kind)
            .unwrap_or_else(|| panic!("no {kind} event for {instance}: {history:?}"))
    };
    assert!(
        at(&on_demand[0], "instance_stopping") < at(&on_demand[0], "agent_exit")
            && at(&on_demand[0], "agent_exit") < at(&on_demand[0], "terminated"),
        "the released instance ended before its agent left: {history:?}"
    );
    let tails = logs(&broker, id).await;
    let tail = |instance: &str| {
        tails
            .iter()
            .find(|(i, _)| i == instance)
            .map(|(_, t)| t.clone())
            .unwrap_or_else(|| panic!("no output of {instance}: {tails:?}"))
    };
    let released = tail(&on_demand[0]);
    let (_, saved) = rank_and_final_save(&released);
    let saved = saved.unwrap_or_else(|| panic!("the released program did not save:\n{released}"));
    assert!(
        released.contains("sigterm notice_file=yes") && !released.contains("SIGKILL"),
        "{released}"
    );
    let replacement = tail(&spot[0]);
    assert!(
        replacement.contains("restored the checkpoint of rank 0"),
        "{replacement}"
    );
    assert_eq!(
        numbers(&replacement, "start rank=0 world=1 resumed_from="),
        [saved],
        "the replacement repeated or skipped steps:\n{replacement}"
    );
}
