//! Helpers for the end-to-end tests: the binaries, fresh databases, a broker process that is
//! killed with everything it started, and a LocalStack EC2 client.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A binary of the workspace, from the target directory this test was built into.
/// `cargo test --workspace` builds every package's binaries (each has integration tests).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // Tests run from target/<profile>/deps, the benchmarks' binaries from target/<profile>.
    let dir = exe
        .parent()
        .map(|d| {
            if d.ends_with("deps") {
                d.parent().unwrap_or(d)
            } else {
                d
            }
        })
        .expect("target/<profile>");
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run the suite with `scripts/test` (or `cargo build --workspace --bins` first)",
        path.display()
    );
    path
}

pub fn pg_admin_url() -> String {
    std::env::var("PROTEUS_TEST_PG_URL")
        .expect("PROTEUS_TEST_PG_URL is not set: run the suite through scripts/test")
}

pub fn localstack_url() -> String {
    std::env::var("PROTEUS_TEST_LOCALSTACK_URL")
        .expect("PROTEUS_TEST_LOCALSTACK_URL is not set: run the suite through scripts/test")
}

/// A name no other test of this run uses.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A fresh Postgres database on the test cluster; returns its URL.
pub async fn fresh_pg_database() -> String {
    use sqlx::Executor;
    let admin = pg_admin_url();
    let name = unique("proteus_e2e");
    let pool = sqlx::PgPool::connect(&admin)
        .await
        .expect("connect to the test Postgres");
    pool.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await
        .expect("create database");
    pool.close().await;
    let (base, _) = admin
        .rsplit_once('/')
        .expect("admin URL ends with a database");
    format!("{base}/{name}")
}

/// At least 32 characters, as `proteus serve` requires of a user token.
pub const TOKEN: &str = "pt_e2e-user-token-of-32-characters";

/// A `proteus serve` process. Dropping it kills the broker (SIGKILL) and every agent it started.
pub struct BrokerProcess {
    pub child: Option<Child>,
    pub url: String,
    pub port: u16,
    pub state_dir: PathBuf,
    pub log: PathBuf,
    /// The CA this broker's HTTPS certificate chains to (from `--tls-ca`), when it serves TLS.
    pub ca_file: Option<PathBuf>,
    args: Vec<String>,
    envs: Vec<(String, String)>,
}

/// Where [`BrokerProcess::start_sim`] starts market time.
pub const SIM_START: &str = "2015-05-01T00:00:00Z";

/// The user a root agent runs programs as by default (the agent's `DEFAULT_USER`).
pub const PROGRAM_USER: &str = "proteus-job";

/// That user's uid (it exists once an agent has run a program).
pub fn program_uid() -> u32 {
    let out = std::process::Command::new("id")
        .args(["-u", PROGRAM_USER])
        .output()
        .expect("id runs");
    assert!(out.status.success(), "no user {PROGRAM_USER}");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a uid")
}

/// The market instant `minutes` after [`SIM_START`] (RFC 3339), as `--hold-at` takes it.
pub fn sim_minutes(minutes: i64) -> String {
    let start = chrono::DateTime::parse_from_rfc3339(SIM_START)
        .expect("SIM_START is RFC 3339")
        .to_utc();
    (start + chrono::Duration::minutes(minutes)).to_rfc3339()
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl BrokerProcess {
    /// Starts `proteus serve` with `args` (plus listen address, token, state dir and log) and
    /// waits until it answers `/healthz`. With `--tls-cert` in `args` the broker is reached
    /// over HTTPS, trusting the `--tls-ca` given with it.
    pub async fn start(
        dir: &Path,
        database_url: &str,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> BrokerProcess {
        let port = free_port();
        let tls = args.contains(&"--tls-cert");
        let ca_file = args
            .iter()
            .position(|a| *a == "--tls-ca")
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from);
        let scheme = if tls { "https" } else { "http" };
        let mut b = BrokerProcess {
            child: None,
            url: format!("{scheme}://127.0.0.1:{port}"),
            port,
            state_dir: dir.join("state"),
            log: dir.join("broker.log"),
            ca_file,
            args: args.iter().map(|s| s.to_string()).collect(),
            envs: envs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        b.envs
            .push(("PROTEUS_DATABASE_URL".into(), database_url.into()));
        b.spawn(&[]).await;
        b
    }

    /// A broker on the simulated cloud, market time from [`SIM_START`] at `speed`× with 250 ms
    /// ticks, plus `extra` arguments (e.g. a trace of the test's own).
    pub async fn start_sim(
        dir: &Path,
        database_url: &str,
        speed: &str,
        extra: &[&str],
    ) -> BrokerProcess {
        Self::start_sim_with_env(dir, database_url, speed, extra, &[]).await
    }

    /// [`BrokerProcess::start_sim`] with extra environment for the broker (e.g. the S3
    /// endpoint and credentials of a checkpoint store).
    pub async fn start_sim_with_env(
        dir: &Path,
        database_url: &str,
        speed: &str,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> BrokerProcess {
        let mut args = vec![
            "--cloud",
            "sim",
            "--speed",
            speed,
            "--start",
            SIM_START,
            "--tick-ms",
            "250",
        ];
        args.extend_from_slice(extra);
        Self::start(dir, database_url, &args, envs).await
    }

    /// What the CLI needs to reach this broker as its user.
    pub fn user_env(&self) -> Vec<(&'static str, &str)> {
        let mut env = vec![("PROTEUS_URL", self.url.as_str()), ("PROTEUS_TOKEN", TOKEN)];
        if let Some(ca) = self.ca_file.as_deref().and_then(|p| p.to_str()) {
            env.push(("PROTEUS_CA_FILE", ca));
        }
        env
    }

    /// An HTTP client that trusts this broker (its test CA when it serves TLS).
    pub fn http(&self) -> reqwest::Client {
        let mut b = reqwest::Client::builder().timeout(Duration::from_secs(60));
        if let Some(ca) = &self.ca_file {
            let pem = std::fs::read(ca).expect("read the test CA");
            let certs = reqwest::Certificate::from_pem_bundle(&pem).expect("the test CA is PEM");
            b = b.tls_certs_only(certs);
        }
        b.build().expect("client")
    }

    /// Writes `spec` (TOML) to `dir/job.toml` and submits it with `proteus submit`, as a user
    /// would; returns the job's id.
    pub fn submit_file(&self, dir: &Path, spec: &str) -> i64 {
        let file = dir.join("job.toml");
        std::fs::write(&file, spec).expect("write the job file");
        let file = file.display().to_string();
        let (code, out, err) = proteus(
            None,
            &["submit", &file, "--output", "json"],
            &self.user_env(),
        );
        assert_eq!(code, 0, "submit failed: {err}");
        let submitted: serde_json::Value = serde_json::from_str(&out).expect("submit's JSON");
        submitted["id"].as_i64().expect("a job id")
    }

    /// (Re)starts the process with the same settings plus `extra_env`.
    pub async fn spawn(&mut self, extra_env: &[(&str, &str)]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("broker log");
        let mut cmd = Command::new(bin("proteus"));
        cmd.arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(&self.args)
            .env("PROTEUS_TOKEN", TOKEN)
            .env("PROTEUS_LOG", "info,tower_http=warn")
            .env_remove("PROTEUS_FAILPOINTS")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        for (k, v) in &self.envs {
            cmd.env(k, v);
        }
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn().expect("start proteus serve"));
        let deadline = Instant::now() + Duration::from_secs(60);
        let http = self.http();
        loop {
            if let Ok(r) = http.get(format!("{}/healthz", self.url)).send().await
                && r.status().is_success()
            {
                return;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "proteus serve exited with {status} during start; its log:\n{}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "proteus serve did not answer within 60 s:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `kill -9` the broker only (its agents, like VMs, keep running).
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the broker to exit by itself (a failpoint), up to `timeout`.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The value of one counter or gauge of the broker's `GET /metrics` (0 when absent).
    pub async fn metric(&self, name: &str) -> f64 {
        let (status, body) = self
            .client()
            .call(reqwest::Method::GET, "/metrics", None)
            .await;
        assert_eq!(status, 200, "GET /metrics: {body}");
        let text = body.as_str().unwrap_or_default().to_string();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// The process id of the running broker.
    pub fn pid(&self) -> i32 {
        let child = self.child.as_ref().expect("the broker runs");
        i32::try_from(child.id()).expect("a pid")
    }

    /// Whether the process is stopped (SIGSTOP; `T` in /proc/PID/stat).
    pub fn is_stopped(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))
            .ok()
            .and_then(|s| {
                let after = s.rsplit_once(')')?.1.trim_start().chars().next()?;
                Some(after == 'T')
            })
            .unwrap_or(false)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The tokens of the agents this broker's launcher started, from their token files (the
    /// broker itself keeps only their hashes). Also checks that no agent process carries its
    /// token in its environment, which `/proc/<pid>/environ` would show.
    pub fn agent_tokens(&self) -> Vec<String> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(self.state_dir.join("agents"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = e.path();
            if path.extension().is_some_and(|x| x == "token")
                && let Ok(t) = std::fs::read_to_string(&path)
            {
                out.push(t.trim().to_string());
            }
            if path.extension().is_some_and(|x| x == "pid")
                && let Ok(pid) = std::fs::read_to_string(&path)
                && let Ok(env) = std::fs::read(format!("/proc/{}/environ", pid.trim()))
            {
                assert!(
                    !env.split(|b| *b == 0)
                        .any(|v| v.starts_with(b"PROTEUS_AGENT_TOKEN=")),
                    "agent {} carries its token in its environment",
                    path.display()
                );
            }
        }
        out
    }

    /// Every agent log the launcher wrote.
    pub fn agent_logs(&self) -> String {
        let mut out = String::new();
        if let Ok(rd) = std::fs::read_dir(self.state_dir.join("agents")) {
            for e in rd.flatten() {
                if e.path().extension().is_some_and(|x| x == "log") {
                    out.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
                }
            }
        }
        out
    }

    /// `kill -9` the agent of `instance` only (a process dying without a word; its VM, to the
    /// cloud, still runs).
    pub fn kill_agent(&self, instance: &str) {
        let pid_file = self
            .state_dir
            .join("agents")
            .join(format!("{instance}.pid"));
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()))
            .trim()
            .parse()
            .expect("a pid");
        // SAFETY: signalling a process this test's broker started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0, "kill {pid}");
    }

    pub fn kill_agents(&self) {
        if let Ok(rd) = std::fs::read_dir(self.state_dir.join("agents")) {
            for e in rd.flatten() {
                if e.path().extension().is_some_and(|x| x == "pid")
                    && let Ok(pid) = std::fs::read_to_string(e.path())
                        .unwrap_or_default()
                        .trim()
                        .parse::<i32>()
                {
                    // SAFETY: signalling a process this test's broker started.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
    }

    /// Waits until the job at `path` is over and asserts that it succeeded, with the broker's
    /// log in the failure message; returns the job's final view.
    pub async fn wait_succeeded(
        &self,
        path: &str,
        timeout: Duration,
        what: &str,
    ) -> serde_json::Value {
        let done = self
            .client()
            .wait_for(path, timeout, what, |v| {
                v["state"] != "running" && v["state"] != "pending"
            })
            .await;
        assert_eq!(done["state"], "succeeded", "{done}\n{}", self.log_text());
        done
    }

    pub fn client(&self) -> Api {
        Api {
            base: self.url.clone(),
            http: self.http(),
        }
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        self.kill9();
        self.kill_agents();
    }
}

/// The user API over HTTP.
pub struct Api {
    base: String,
    http: reqwest::Client,
}

impl Api {
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> (u16, serde_json::Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(TOKEN);
        if let Some(b) = body {
            req = req.json(&b);
        }
        // A broker that dies mid-request (the crash tests) answers with status 0.
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => return (0, serde_json::Value::String(e.to_string())),
        };
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        )
    }
    pub async fn get(&self, path: &str) -> serde_json::Value {
        let (status, v) = self.call(reqwest::Method::GET, path, None).await;
        assert_eq!(status, 200, "GET {path}: {v}");
        v
    }
    pub async fn post(&self, path: &str, body: serde_json::Value) -> serde_json::Value {
        let (status, v) = self.call(reqwest::Method::POST, path, Some(body)).await;
        assert!((200..300).contains(&status), "POST {path}: {status} {v}");
        v
    }
    /// Lifts the hold on the simulated market's clock (`--hold-at`): it runs on from there.
    pub async fn lift_hold(&self) -> serde_json::Value {
        let v = self
            .post("/v1/sim/clock", serde_json::json!({ "hold_at": null }))
            .await;
        assert!(v["held_at"].is_null(), "the hold is lifted: {v}");
        v
    }
    /// `POST /v1/jobs/{id}/cancel`; the cancelled job.
    pub async fn cancel(&self, id: impl std::fmt::Display) -> serde_json::Value {
        let path = format!("/v1/jobs/{id}/cancel");
        let (status, v) = self.call(reqwest::Method::POST, &path, None).await;
        assert_eq!(status, 200, "POST {path}: {v}");
        v
    }

    /// Polls `GET path` until `pred` holds, up to `timeout`; returns the last answer.
    pub async fn wait_for(
        &self,
        path: &str,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = Instant::now() + timeout;
        loop {
            let (status, v) = self.call(reqwest::Method::GET, path, None).await;
            if status == 200 && pred(&v) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; last {path}: {v}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// An EC2 client on LocalStack.
pub async fn localstack_ec2() -> aws_sdk_ec2::Client {
    let creds = aws_sdk_ec2::config::Credentials::new("test", "test", None, None, "e2e");
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(localstack_url())
        .credentials_provider(creds)
        .load()
        .await;
    aws_sdk_ec2::Client::new(&config)
}

/// An instance as LocalStack sees it: (cloud id, proteus:instance-id tag, job tag, state).
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub cloud_id: String,
    pub proteus_id: String,
    pub job: String,
    pub state: String,
    pub lifecycle: Option<String>,
}

/// Every instance LocalStack holds for one deployment.
pub async fn localstack_instances(ec2: &aws_sdk_ec2::Client, deployment: &str) -> Vec<Seen> {
    let out = ec2
        .describe_instances()
        .filters(
            aws_sdk_ec2::types::Filter::builder()
                .name("tag:proteus:managed")
                .values(deployment)
                .build(),
        )
        .send()
        .await
        .expect("DescribeInstances on LocalStack");
    let mut seen = Vec::new();
    for r in out.reservations() {
        for i in r.instances() {
            let tag = |k: &str| {
                i.tags()
                    .iter()
                    .find(|t| t.key() == Some(k))
                    .and_then(|t| t.value())
                    .unwrap_or_default()
                    .to_string()
            };
            seen.push(Seen {
                cloud_id: i.instance_id().unwrap_or_default().to_string(),
                proteus_id: tag("proteus:instance-id"),
                job: tag("proteus:job-id"),
                state: i
                    .state()
                    .and_then(|s| s.name())
                    .map(|n| n.as_str().to_string())
                    .unwrap_or_default(),
                lifecycle: i.instance_lifecycle().map(|l| l.as_str().to_string()),
            });
        }
    }
    seen
}

/// A tiny price history for LocalStack runs (LocalStack's own prices are placeholders): two
/// types in two zones, recent enough to be "now", with on-demand prices.
pub fn write_small_prices(dir: &Path) -> (PathBuf, PathBuf) {
    let trace = dir.join("prices.csv");
    let now = chrono::Utc::now();
    let mut text =
        String::from("timestamp,availability_zone,instance_type,product_description,spot_price\n");
    for day in (1..=10).rev() {
        let stamp =
            (now - chrono::Duration::days(day)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        for (zone, ty, price) in [
            ("us-east-1a", "c5.large", 0.031),
            ("us-east-1b", "c5.large", 0.033),
            ("us-east-1a", "m5.large", 0.037),
            ("us-east-1b", "m5.large", 0.036),
        ] {
            text.push_str(&format!("{stamp},{zone},{ty},Linux/UNIX,{price}\n"));
        }
    }
    std::fs::write(&trace, text).expect("write prices");
    let od = dir.join("on-demand.csv");
    std::fs::write(
        &od,
        "instance_type,vcpus,memory_gib,on_demand_usd_per_hour,region\nc5.large,2,4,0.085,us-east-1\nm5.large,2,8,0.096,us-east-1\n",
    )
    .expect("write on-demand");
    (trace, od)
}

/// The absolute path of an example program under `examples/command/` (e.g. `train.py`).
pub fn example_program(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/command")
        .join(name)
        .canonicalize()
        .unwrap_or_else(|e| panic!("examples/command/{name}: {e}"))
        .display()
        .to_string()
}

/// Waits for `child` to exit within `timeout`, killing it (and failing the test, naming
/// `what`) otherwise; returns its exit code (-1 when a signal ended it) and its stderr.
pub fn wait_bounded(mut child: Child, timeout: Duration, what: &str) -> (i32, String) {
    use std::io::Read;
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for a child process") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not end within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    (status.code().unwrap_or(-1), err)
}

/// Runs `proteus` (not serve) with a database URL and returns (status, stdout, stderr).
pub fn proteus(
    database_url: Option<&str>,
    args: &[&str],
    envs: &[(&str, &str)],
) -> (i32, String, String) {
    let mut cmd = Command::new(bin("proteus"));
    cmd.args(args).env("PROTEUS_LOG", "warn");
    if let Some(url) = database_url {
        cmd.env("PROTEUS_DATABASE_URL", url);
    }
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run proteus");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Whether `text` holds something shaped like an agent token (`pa_` and 48 hex digits).
pub fn contains_agent_token(text: &str) -> bool {
    text.match_indices("pa_").any(|(i, _)| {
        let rest = &text[i + 3..];
        rest.len() >= 48 && rest.as_bytes()[..48].iter().all(|b| b.is_ascii_hexdigit())
    })
}

/// A hand-made c3.xlarge trace for the simulated cloud, written to `dir`: eight days of calm
/// prices in us-east-1a and us-east-1b before [`SIM_START`] (BidBrain's market model reads a
/// week of history), calm for a day after it, and optionally a spike above any bid
/// `(minutes after the start, minutes long)`. Returns the trace's and the on-demand catalogue's
/// paths, as `--trace` and `--on-demand` take them.
pub fn write_c3_trace(dir: &Path, spike: Option<(i64, i64)>) -> (String, String) {
    let start = chrono::DateTime::parse_from_rfc3339(SIM_START)
        .expect("SIM_START is RFC 3339")
        .to_utc();
    let mut text =
        String::from("timestamp,availability_zone,instance_type,product_description,spot_price\n");
    let mut row = |t: chrono::DateTime<chrono::Utc>, zone: &str, price: f64| {
        text.push_str(&format!(
            "{},{zone},c3.xlarge,Linux/UNIX,{price:.4}\n",
            t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        ));
    };
    for h in -8 * 24..0 {
        let t = start + chrono::Duration::hours(h);
        row(t, "us-east-1a", 0.0320 + 0.0002 * f64::from((h % 3) as i32));
        row(t, "us-east-1b", 0.0330 + 0.0002 * f64::from((h % 2) as i32));
    }
    for zone in ["us-east-1a", "us-east-1b"] {
        // (A spike from the start replaces the start's calm price: one price per instant.)
        if spike.is_none_or(|(at, _)| at > 0) {
            row(start, zone, 0.0321);
        }
        if let Some((at, len)) = spike {
            row(start + chrono::Duration::minutes(at), zone, 2.5);
            row(start + chrono::Duration::minutes(at + len), zone, 0.0322);
        }
        row(start + chrono::Duration::hours(24), zone, 0.0323);
    }
    let trace = dir.join("c3-trace.csv");
    std::fs::write(&trace, text).expect("write the trace");
    let od = dir.join("on-demand.csv");
    std::fs::write(
        &od,
        "instance_type,vcpus,memory_gib,on_demand_usd_per_hour,region\nc3.xlarge,4,7.5,0.21,us-east-1\n",
    )
    .expect("write the on-demand catalogue");
    (trace.display().to_string(), od.display().to_string())
}

/// The AWS environment of a broker on LocalStack.
pub fn aws_env() -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL", localstack_url()),
        ("AWS_ACCESS_KEY_ID", "test".into()),
        ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ("AWS_REGION", "us-east-1".into()),
    ]
}

/// A fresh database holding a small price history of LocalStack's region.
pub async fn ec2_database(dir: &std::path::Path) -> String {
    let db = fresh_pg_database().await;
    if let Err(e) = ingest_small_prices(&db, dir) {
        panic!("{e}");
    }
    db
}

/// Writes [`write_small_prices`]'s history into `dir` and ingests it into the database `db`.
pub fn ingest_small_prices(db: &str, dir: &std::path::Path) -> Result<(), String> {
    let (trace, od) = write_small_prices(dir);
    let (code, _, err) = proteus(
        Some(db),
        &[
            "prices",
            "ingest",
            "--file",
            &trace.display().to_string(),
            "--on-demand",
            &od.display().to_string(),
        ],
        &[],
    );
    if code == 0 {
        Ok(())
    } else {
        Err(format!("ingesting prices: {err}"))
    }
}

/// The median of `xs` (NaN when empty).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The live broker (`alive`) owning the most unfinished jobs: (its index, its id, those jobs).
pub async fn busiest_broker(
    brokers: &[BrokerProcess],
    alive: &[bool],
) -> Option<(usize, String, Vec<i64>)> {
    let v = job_views(brokers, alive).await;
    (0..brokers.len())
        .filter(|i| alive[*i])
        .map(|i| {
            let id = broker_id(&brokers[i]);
            let jobs: Vec<i64> = v
                .values()
                .filter(|j| !job_over(j) && j["broker"] == id.as_str())
                .filter_map(|j| j["id"].as_i64())
                .collect();
            (i, id, jobs)
        })
        .filter(|(_, _, jobs)| !jobs.is_empty())
        .max_by_key(|(_, _, jobs)| jobs.len())
}

/// Seconds until none of `jobs` that is unfinished names `owner` (polled every 100 ms through
/// the `alive` brokers), or None when `limit` passes first.
pub async fn wait_moved(
    brokers: &[BrokerProcess],
    alive: &[bool],
    jobs: &[i64],
    owner: &str,
    limit: Duration,
) -> Option<f64> {
    let start = Instant::now();
    while start.elapsed() < limit {
        let v = job_views(brokers, alive).await;
        if !v.is_empty()
            && jobs.iter().all(|id| {
                v.get(id).is_none_or(|j| {
                    job_over(j) || (j["broker"].is_string() && j["broker"] != owner)
                })
            })
        {
            return Some(start.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// A broker on LocalStack on the database `db` (several may share it), plus `extra` flags.
pub async fn start_ec2_broker_on(
    dir: &std::path::Path,
    db: &str,
    deployment: &str,
    extra: &[&str],
) -> BrokerProcess {
    start_ec2_broker_with(dir, db, deployment, extra, &[]).await
}

/// [`start_ec2_broker_on`] with more environment (kept on every restart).
pub async fn start_ec2_broker_with(
    dir: &std::path::Path,
    db: &str,
    deployment: &str,
    extra: &[&str],
    envs: &[(&str, &str)],
) -> BrokerProcess {
    let env = aws_env();
    let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    env.extend_from_slice(envs);
    let mut args = vec![
        "--cloud",
        "ec2",
        "--region",
        "us-east-1",
        "--deployment",
        deployment,
        "--tick-ms",
        "300",
    ];
    // Agents started on this machine, unless `extra` says otherwise (then only the user data
    // starts them, as on EC2).
    if !extra.contains(&"--local-agents") {
        args.extend_from_slice(&["--local-agents", "true"]);
    }
    // Brokers on a shared database keep checkpoints where all of them reach them: one
    // LocalStack S3 bucket per deployment.
    let store = format!("s3://{}/checkpoints", bucket_of(deployment));
    if !extra.contains(&"--checkpoint-store") {
        args.extend_from_slice(&["--checkpoint-store", &store]);
    }
    args.extend_from_slice(extra);
    BrokerProcess::start(dir, db, &args, &env).await
}

/// An MLR job of `epochs` on at most 2 instances (1 reliable): the failover test's and
/// benchmark's job.
pub fn mlr_job(name: &str, epochs: u32) -> serde_json::Value {
    serde_json::json!({
        "name": name,
        "app": "mlr",
        "dataset": "mnist",
        "policy": "bidbrain",
        "stop": {"epochs": epochs},
        "limits": {"max_instances": 2, "max_reliable_instances": 1},
        "work": {"total_work": 2.0, "startup_minutes": 0.0},
        "training": {"seed": 5, "backup_sync_interval_ms": 300}
    })
}

/// The S3 bucket (LocalStack's) of a test deployment's checkpoints.
pub fn bucket_of(deployment: &str) -> String {
    let name: String = format!("ck-{deployment}")
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(63)
        .collect();
    name.trim_end_matches('-').to_string()
}

/// The environment that runs a process with its wall clock `offset` off (`+60s`, `-60s`)
/// through Debian's libfaketime (`faketime` package; scripts/test installs it), its monotonic
/// clock left alone: a machine whose clock is set wrong.
pub fn skewed_clock(offset: &str) -> Vec<(&'static str, String)> {
    let lib = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";
    assert!(
        std::path::Path::new(lib).exists(),
        "{lib} is missing: install Debian's faketime (scripts/test does)"
    );
    vec![
        ("LD_PRELOAD", lib.to_string()),
        ("FAKETIME", offset.to_string()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_string()),
    ]
}

/// Whether a job's view says it is over.
pub fn job_over(v: &serde_json::Value) -> bool {
    !matches!(v["state"].as_str(), Some("pending" | "running"))
}

/// Every job's view by id, from the first of `brokers` that is `alive` and answers; empty when
/// none does.
pub async fn job_views(
    brokers: &[BrokerProcess],
    alive: &[bool],
) -> std::collections::BTreeMap<i64, serde_json::Value> {
    for (b, up) in brokers.iter().zip(alive) {
        if !up {
            continue;
        }
        let (status, list) = b
            .client()
            .call(reqwest::Method::GET, "/v1/jobs", None)
            .await;
        if status == 200 {
            return list
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|j| Some((j["id"].as_i64()?, j.clone())))
                .collect();
        }
    }
    Default::default()
}

/// The id a broker process runs under (kept in its state directory).
pub fn broker_id(b: &BrokerProcess) -> String {
    std::fs::read_to_string(b.state_dir.join("broker-id"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// A PostgreSQL server of a test's own (initdb in `dir`, on a free loopback port), which the
/// test can stop and start under a running broker; stopped when dropped.
pub struct PrivatePostgres {
    bin: String,
    data: std::path::PathBuf,
    port: u16,
    running: bool,
    as_postgres: bool,
}

impl PrivatePostgres {
    pub fn init(dir: &std::path::Path) -> PrivatePostgres {
        let bin = std::env::var("PROTEUS_TEST_PG_BIN")
            .expect("PROTEUS_TEST_PG_BIN is not set: run the suite through scripts/test");
        let as_postgres = unsafe { libc::geteuid() } == 0;
        let data = dir.join("pgdata");
        if as_postgres {
            let status = Command::new("chown")
                .arg("-R")
                .arg("postgres")
                .arg(dir)
                .status()
                .unwrap();
            assert!(status.success());
        }
        let mut pg = PrivatePostgres {
            bin,
            data,
            port: free_port(),
            running: false,
            as_postgres,
        };
        let out = pg
            .command("initdb")
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "-D",
            ])
            .arg(&pg.data)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        pg.start();
        pg
    }

    fn command(&self, tool: &str) -> Command {
        let path = format!("{}/{tool}", self.bin);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", &path]);
            c
        } else {
            Command::new(path)
        }
    }

    pub fn start(&mut self) {
        let options = format!(
            "-h 127.0.0.1 -p {} -k {} -c fsync=off",
            self.port,
            self.data.parent().unwrap().display()
        );
        let out = self
            .command("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-o", &options, "-l"])
            .arg(self.data.parent().unwrap().join("postgres.log"))
            .args(["-w", "start"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.running = true;
    }

    pub fn stop(&mut self) {
        let out = self
            .command("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "fast", "-w", "stop"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl stop: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.running = false;
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        if self.running {
            let _ = self
                .command("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["-m", "immediate", "-w", "stop"])
                .output();
        }
    }
}
