//! `bench/chaos` (issue 44, item 5): a checker that nothing is lost when several brokers share
//! one database and everything around them misbehaves. Run through `bench/chaos`, which starts
//! LocalStack and exports its URL as the end-to-end tests expect.
//!
//! RUNS seeded runs (default 20, seeds SEED.., default 1..). Each: a PostgreSQL of its own (so it
//! can be restarted), three `proteus serve --cloud ec2` brokers on it and on LocalStack EC2/S3
//! (checkpoints in S3, agents local), one of them with its clock off by ±60 s (libfaketime); a
//! command job (`examples/command/train.py`, checkpointing every step, uploaded every second) and
//! two built-in MLR jobs. The brokers reach EC2 through `tests/chaos/cloud_proxy.py`, which
//! throttles (`RequestLimitExceeded`) or fails (500) every EC2 call while told to. For
//! FAULT_SECS, faults drawn from the seed, one after another: `kill -9` of the broker owning the
//! most jobs (started again once its jobs have moved), SIGSTOP of it (SIGCONT once its jobs have
//! moved, 15 s at least), a Postgres restart (down 3 s), the EC2 API throttled or failing for
//! 8 s. Then every job runs to its end.
//!
//! Checked after each run, from the cloud's own instance list (LocalStack, by deployment tag),
//! the ledger and instances in Postgres, the brokers' answers and the programs' own output:
//! - every instance in the cloud is in the ledger (a record with its cloud id, and billed) and
//!   every recorded cloud id is in the cloud;
//! - no instance billed twice (overlapping ledger lines of one instance);
//! - no twin launch (two cloud instances of one launch intent);
//! - each job's spend never decreases in any broker's view (`GET /v1/jobs/{id}/cost`, polled
//!   every 500 ms through every broker that answers);
//! - every instance ended within two ticks (600 ms) of its job's end, and none runs in the cloud
//!   after every job ended;
//! - no program step lost beyond one checkpoint upload interval (1 s: 10 steps) per stop;
//! - every job succeeded.
//!
//! Takeover: from a kill or a stop of the broker owning jobs until every one of its unfinished
//! jobs names another broker (polled every 100 ms).
//!
//! Prints the counts, the violations and the takeover median and maximum, the targets (zero
//! violations, takeover max ≤ 30 s); `--json FILE` writes `runs`, `faults`, `violations` (each
//! with its run, seed and what was seen), `takeover_p50_s`, `takeover_max_s`. Exits 1 when a
//! target is missed, 2 when the run itself fails.
//!
//!     proteus-bench-chaos [--runs N] [--seed S] [--json FILE]

use proteus_e2e::{
    BrokerProcess, PrivatePostgres, busiest_broker, example_program, ingest_small_prices, job_over,
    job_views, localstack_ec2, localstack_instances, localstack_url, median, mlr_job, skewed_clock,
    start_ec2_broker_with, unique, wait_moved,
};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BROKERS: usize = 3;
const FAULT_SECS: u64 = 60;
const TICK_MS: i64 = 300;
const TARGET_TAKEOVER_S: f64 = 30.0;
/// The command job: 900 steps of 0.1 s, a checkpoint every step, uploaded every second.
const STEPS: u64 = 900;
const STEPS_PER_UPLOAD: u64 = 10;

/// xorshift64*: the fault schedule from the seed, the same on every machine.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Kill9,
    Stop,
    PostgresRestart,
    Throttle,
    Fail5xx,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Kill9 => "kill9",
            Fault::Stop => "sigstop",
            Fault::PostgresRestart => "postgres_restart",
            Fault::Throttle => "ec2_throttled",
            Fault::Fail5xx => "ec2_5xx",
        }
    }
}

struct Violation {
    run: usize,
    seed: u64,
    what: String,
}

/// What one run found.
#[derive(Default)]
struct RunOutcome {
    faults: Vec<Fault>,
    takeovers: Vec<f64>,
    violations: Vec<String>,
}

/// Processes a run started besides its brokers, killed when it ends.
struct Helpers(Vec<Child>);

impl Drop for Helpers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// An instance as stored: (id, job id, cloud id, state, ended_ms).
type InstanceRecord = (String, i64, Option<String>, String, Option<i64>);

fn command_job() -> Value {
    json!({
        "name": "chaos-command",
        "app": "command",
        "policy": "on-demand",
        "limits": {"max_instances": 1, "max_reliable_instances": 1},
        "work": {"total_work": 1.0, "instance_types": ["m5.large"], "startup_minutes": 0.0},
        "command": {
            "run": ["python3", example_program("train.py")],
            "checkpoint_interval_secs": 1,
            "env": {"STEPS": STEPS.to_string(), "STEP_SECS": "0.1", "CHECKPOINT_EVERY": "1"}
        }
    })
}

/// Sends `signal` to a broker's process.
fn signal(broker: &BrokerProcess, signal: i32) {
    // SAFETY: kill(2) on a child process id this program started.
    unsafe {
        libc::kill(broker.pid(), signal);
    }
}

/// Polls every job's cost through every broker that answers; records each decrease seen in
/// one broker's view.
fn watch_spend(
    urls: Vec<String>,
    token: String,
    jobs: Vec<i64>,
    stop: Arc<Mutex<bool>>,
) -> tokio::task::JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .expect("client");
        let mut last: HashMap<(usize, i64), f64> = HashMap::new();
        let mut found = Vec::new();
        while !*stop.lock().unwrap_or_else(|e| e.into_inner()) {
            for (b, url) in urls.iter().enumerate() {
                for job in &jobs {
                    let Ok(resp) = http
                        .get(format!("{url}/v1/jobs/{job}/cost"))
                        .bearer_auth(&token)
                        .send()
                        .await
                    else {
                        continue;
                    };
                    let Ok(v) = resp.json::<Value>().await else {
                        continue;
                    };
                    let Some(total) = v["total_usd"].as_f64() else {
                        continue;
                    };
                    if let Some(before) = last.insert((b, *job), total)
                        && total < before - 1e-9
                    {
                        found.push(format!(
                            "job {job}'s spend went down in broker {b}'s view: ${before} then ${total}"
                        ));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        found
    })
}

async fn run_once(root: &Path, run: usize, seed: u64) -> Result<RunOutcome, String> {
    let mut rng = Rng::new(seed);
    let mut out = RunOutcome::default();
    let dir = root.join(format!("run-{run}"));
    std::fs::create_dir_all(dir.join("pg")).map_err(|e| e.to_string())?;
    let mut pg = PrivatePostgres::init(&dir.join("pg"));
    let db = pg.url();
    ingest_small_prices(&db, &dir)?;

    // The EC2 API, through the proxy that misbehaves when told.
    let control = dir.join("cloud-mode");
    std::fs::write(&control, "ok").map_err(|e| e.to_string())?;
    let proxy_port = proteus_e2e::free_port();
    let proxy_url = format!("http://127.0.0.1:{proxy_port}");
    let mut helpers = Helpers(Vec::new());
    helpers.0.push(
        Command::new("python3")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("chaos/cloud_proxy.py"))
            .arg(proxy_port.to_string())
            .arg(localstack_url())
            .arg(&control)
            .arg(dir.join("cloud-proxy.log"))
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting the cloud proxy: {e}"))?,
    );
    let ready = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", proxy_port)).is_err() {
        if ready.elapsed() > Duration::from_secs(10) {
            return Err("the cloud proxy did not listen within 10 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let deployment = unique("chaos");
    let skewed = rng.below(BROKERS as u64) as usize;
    let skew = if rng.below(2) == 0 { "+60s" } else { "-60s" };
    let mut brokers = Vec::new();
    for i in 0..BROKERS {
        let bdir = dir.join(format!("broker-{i}"));
        std::fs::create_dir_all(&bdir).map_err(|e| e.to_string())?;
        let mut env: Vec<(String, String)> =
            vec![("AWS_ENDPOINT_URL_EC2".into(), proxy_url.clone())];
        if i == skewed {
            env.extend(
                skewed_clock(skew)
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v)),
            );
        }
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        brokers.push(start_ec2_broker_with(&bdir, &db, &deployment, &[], &env).await);
    }
    let mut alive = vec![true; BROKERS];
    let api = brokers[0].client();
    let mut jobs = vec![
        api.post("/v1/jobs", command_job()).await["id"]
            .as_i64()
            .ok_or("the command job was not accepted")?,
    ];
    for n in 0..2 {
        let v = api
            .post("/v1/jobs", mlr_job(&format!("chaos-mlr-{n}"), 150))
            .await;
        jobs.push(v["id"].as_i64().ok_or("an MLR job was not accepted")?);
    }
    let started = Instant::now();
    loop {
        let v = job_views(&brokers, &alive).await;
        if jobs.iter().all(|id| {
            v.get(id)
                .is_some_and(|j| j["broker"].is_string() && j["progress"].as_f64() > Some(0.0))
        }) {
            break;
        }
        if started.elapsed() > Duration::from_secs(180) {
            return Err("the jobs did not start within 180 s".into());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let stop_watch = Arc::new(Mutex::new(false));
    let spend = watch_spend(
        brokers.iter().map(|b| b.url.clone()).collect(),
        proteus_e2e::TOKEN.to_string(),
        jobs.clone(),
        stop_watch.clone(),
    );

    // The faults, one after another, drawn from the seed.
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(FAULT_SECS) {
        let fault = [
            Fault::Kill9,
            Fault::Stop,
            Fault::PostgresRestart,
            Fault::Throttle,
            Fault::Fail5xx,
        ][rng.below(5) as usize];
        eprintln!(
            "  run {run} t={:.0}s: {}",
            window.elapsed().as_secs_f64(),
            fault.name()
        );
        match fault {
            Fault::Kill9 | Fault::Stop => {
                let Some((i, id, owned)) = busiest_broker(&brokers, &alive).await else {
                    continue;
                };
                if fault == Fault::Kill9 {
                    brokers[i].kill9();
                } else {
                    signal(&brokers[i], libc::SIGSTOP);
                }
                alive[i] = false;
                let stopped = Instant::now();
                let moved =
                    wait_moved(&brokers, &alive, &owned, &id, Duration::from_secs(90)).await;
                match moved {
                    Some(t) => out.takeovers.push(t),
                    None => {
                        out.takeovers.push(90.0);
                        out.violations.push(format!(
                            "the jobs {owned:?} of broker {id} ({}) were not taken over within 90 s",
                            fault.name()
                        ));
                    }
                }
                if fault == Fault::Kill9 {
                    brokers[i].spawn(&[]).await;
                } else {
                    let least = Duration::from_secs(15);
                    if let Some(rest) = least.checked_sub(stopped.elapsed()) {
                        tokio::time::sleep(rest).await;
                    }
                    signal(&brokers[i], libc::SIGCONT);
                }
                alive[i] = true;
            }
            Fault::PostgresRestart => {
                pg.stop();
                tokio::time::sleep(Duration::from_secs(3)).await;
                pg.start();
            }
            Fault::Throttle | Fault::Fail5xx => {
                let mode = if fault == Fault::Throttle {
                    "throttle"
                } else {
                    "fail"
                };
                std::fs::write(&control, mode).map_err(|e| e.to_string())?;
                tokio::time::sleep(Duration::from_secs(8)).await;
                std::fs::write(&control, "ok").map_err(|e| e.to_string())?;
            }
        }
        out.faults.push(fault);
        tokio::time::sleep(Duration::from_millis(2000 + rng.below(3000))).await;
    }

    // Every job to its end.
    let deadline = Instant::now() + Duration::from_secs(600);
    let views = loop {
        let v = job_views(&brokers, &alive).await;
        if jobs.iter().all(|id| {
            v.get(id)
                .is_some_and(|j| job_over(j) && j["broker"].is_null())
        }) {
            break v;
        }
        if Instant::now() > deadline {
            out.violations
                .push("the jobs did not all end within 10 min of the faults".into());
            break v;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    for id in &jobs {
        if let Some(j) = views.get(id)
            && j["state"] != "succeeded"
        {
            out.violations
                .push(format!("job {id} ended {} ({})", j["state"], j["error"]));
        }
    }
    // The cloud settles: terminations the brokers sent are carried out.
    tokio::time::sleep(Duration::from_secs(3)).await;
    *stop_watch.lock().unwrap_or_else(|e| e.into_inner()) = true;
    out.violations
        .extend(spend.await.map_err(|e| e.to_string())?);

    // The cloud's own list against the records and the ledger.
    let seen = localstack_instances(&localstack_ec2().await, &deployment).await;
    let pool = sqlx::PgPool::connect(&db)
        .await
        .map_err(|e| format!("connecting to Postgres: {e}"))?;
    let rows: Vec<InstanceRecord> =
        sqlx::query_as("SELECT id, job_id, cloud_id, state, ended_ms FROM instances")
            .fetch_all(&pool)
            .await
            .map_err(|e| e.to_string())?;
    let lines: Vec<(String, i64, i64)> =
        sqlx::query_as("SELECT instance_id, start_ms, end_ms FROM ledger_lines ORDER BY start_ms")
            .fetch_all(&pool)
            .await
            .map_err(|e| e.to_string())?;
    let finished: Vec<(i64, Option<i64>)> = sqlx::query_as("SELECT id, finished_ms FROM jobs")
        .fetch_all(&pool)
        .await
        .map_err(|e| e.to_string())?;
    let mut per_intent: HashMap<&str, usize> = HashMap::new();
    for s in &seen {
        *per_intent.entry(s.proteus_id.as_str()).or_default() += 1;
        if !rows.iter().any(|(id, _, cloud, _, _)| {
            *id == s.proteus_id && cloud.as_deref() == Some(&s.cloud_id)
        }) {
            out.violations.push(format!(
                "cloud instance {} ({}) has no record",
                s.cloud_id, s.proteus_id
            ));
        }
        if !lines.iter().any(|(i, _, _)| *i == s.proteus_id) {
            out.violations.push(format!(
                "cloud instance {} ({}) is not in the ledger",
                s.cloud_id, s.proteus_id
            ));
        }
        if s.state == "running" || s.state == "pending" {
            out.violations.push(format!(
                "cloud instance {} ({}) still {} after every job ended",
                s.cloud_id, s.proteus_id, s.state
            ));
        }
    }
    for (intent, n) in &per_intent {
        if *n > 1 {
            out.violations.push(format!(
                "twin launch: {n} cloud instances for intent {intent}"
            ));
        }
    }
    for (id, _, cloud, _, _) in &rows {
        if let Some(c) = cloud
            && !seen.iter().any(|s| &s.cloud_id == c)
        {
            out.violations.push(format!(
                "record {id} names cloud instance {c}, which the cloud does not list"
            ));
        }
    }
    let mut by_instance: BTreeMap<&str, Vec<(i64, i64)>> = BTreeMap::new();
    for (i, start, end) in &lines {
        by_instance
            .entry(i.as_str())
            .or_default()
            .push((*start, *end));
    }
    for (i, spans) in &by_instance {
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                out.violations.push(format!(
                    "instance {i} billed twice: ledger lines [{}, {}) and [{}, {}) overlap",
                    w[0].0, w[0].1, w[1].0, w[1].1
                ));
            }
        }
    }
    for (id, job, _, _, ended) in &rows {
        let end_of_job = finished
            .iter()
            .find(|(j, _)| j == job)
            .and_then(|(_, f)| *f);
        match (end_of_job, ended) {
            (Some(f), Some(e)) if *e > f + 2 * TICK_MS => out.violations.push(format!(
                "instance {id} ended {} ms after its job {job} (two ticks: {} ms)",
                e - f,
                2 * TICK_MS
            )),
            (Some(_), None) => out
                .violations
                .push(format!("instance {id} never ended (its job {job} has)")),
            _ => {}
        }
    }

    // The command job's program: no step lost beyond one upload interval per stop.
    let command = jobs[0];
    let logs = brokers[0]
        .client()
        .get(&format!("/v1/jobs/{command}/logs"))
        .await;
    let order: Vec<String> = views
        .get(&command)
        .and_then(|j| j["instances"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|i| i["id"].as_str().map(str::to_string))
        .collect();
    let tail_of = |id: &str| -> String {
        logs.as_array()
            .into_iter()
            .flatten()
            .find(|l| l["instance_id"] == id)
            .and_then(|l| l["output"].as_str())
            .unwrap_or("")
            .to_string()
    };
    let mut previous_last: Option<(String, u64)> = None;
    for id in &order {
        let tail = tail_of(id);
        let resumed = tail
            .lines()
            .find_map(|l| l.strip_prefix("start rank=0 world=1 resumed_from="))
            .and_then(|n| n.trim().parse::<u64>().ok());
        let last = tail
            .lines()
            .filter_map(|l| l.strip_prefix("step "))
            .filter_map(|n| n.trim().parse::<u64>().ok())
            .max();
        let Some(resumed) = resumed else {
            continue;
        };
        if let Some((prev, before)) = &previous_last
            && before.saturating_sub(resumed) > STEPS_PER_UPLOAD
        {
            out.violations.push(format!(
                "the command job lost {} steps between {prev} (last step {before}) and {id} (resumed from {resumed}); at most {STEPS_PER_UPLOAD} per stop",
                before - resumed
            ));
        }
        if let Some(last) = last {
            previous_last = Some((id.clone(), last));
        }
    }
    if !tail_of(order.last().map_or("", String::as_str)).contains("done") {
        out.violations
            .push("the command job's program did not print its end".into());
    }

    // The EC2 faults took: calls were refused while they lasted (else the brokers never went
    // through the proxy, and the run proved nothing about them).
    let calls = std::fs::read_to_string(dir.join("cloud-proxy.log")).unwrap_or_default();
    let refused = calls
        .lines()
        .filter(|l| l.ends_with(" throttle") || l.ends_with(" fail"))
        .count();
    eprintln!(
        "  run {run}: {} EC2 calls through the proxy, {refused} refused",
        calls.lines().count()
    );
    if refused == 0
        && out
            .faults
            .iter()
            .any(|f| matches!(f, Fault::Throttle | Fault::Fail5xx))
    {
        return Err(
            "an EC2 fault was injected but no call was refused: the brokers do not go \
                    through the cloud proxy"
                .into(),
        );
    }

    for b in &mut brokers {
        b.kill_agents();
    }
    drop(brokers);
    drop(helpers);
    drop(pg);
    Ok(out)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let runs: usize = flag("--runs").and_then(|v| v.parse().ok()).unwrap_or(20);
    let first_seed: u64 = flag("--seed").and_then(|v| v.parse().ok()).unwrap_or(1);
    let json_path = flag("--json");
    let root = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut violations: Vec<Violation> = Vec::new();
    let mut faults: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut takeovers = Vec::new();
    for run in 0..runs {
        let seed = first_seed + run as u64;
        eprintln!("chaos run {} of {runs} (seed {seed})", run + 1);
        match run_once(root.path(), run, seed).await {
            Ok(o) => {
                for f in &o.faults {
                    *faults.entry(f.name()).or_default() += 1;
                }
                takeovers.extend(o.takeovers);
                for what in o.violations {
                    eprintln!("  VIOLATION (run {run}, seed {seed}): {what}");
                    violations.push(Violation { run, seed, what });
                }
            }
            Err(e) => {
                eprintln!("error: run {run} (seed {seed}) failed: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let p50 = median(&takeovers);
    let max = takeovers.iter().copied().fold(0.0, f64::max);
    println!("chaos: {runs} runs (seeds {first_seed}..), {BROKERS} brokers on one Postgres each");
    println!("  faults: {faults:?}");
    println!(
        "  takeover: median {p50:.2} s, max {max:.2} s over {} takeovers (target: max <= {TARGET_TAKEOVER_S} s)",
        takeovers.len()
    );
    println!("  violations: {} (target 0)", violations.len());
    for v in &violations {
        println!("    run {} seed {}: {}", v.run, v.seed, v.what);
    }
    if let Some(path) = json_path {
        let out = json!({
            "runs": runs,
            "faults": faults,
            "violations": violations.iter().map(|v| json!({"run": v.run, "seed": v.seed, "what": v.what})).collect::<Vec<_>>(),
            "takeover_p50_s": p50,
            "takeover_max_s": max,
        });
        if let Err(e) = std::fs::write(&path, format!("{out:#}\n")) {
            eprintln!("error: --json {path}: {e}");
            return ExitCode::from(2);
        }
    }
    if violations.is_empty() && max <= TARGET_TAKEOVER_S {
        println!("targets met");
        ExitCode::SUCCESS
    } else {
        println!("TARGET MISSED");
        ExitCode::from(1)
    }
}
