//! Starting clusters of real agent processes, and killing them whatever happens.

use proteus_agent::testing::{ImdsMock, TestCoordinator};
use proteus_wire::Tier;
use proteus_wire::agent_api::TrainingConfig;
use proteus_wire::coordinator::{JobState, JobStatus};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A `key=value` field of a log line (tracing's plain format), as text.
pub fn log_text_field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// A `key=value` field of a log line, parsed.
pub fn log_field<T: std::str::FromStr>(line: &str, key: &str) -> Option<T> {
    log_text_field(line, key)?.parse().ok()
}

pub const DATA_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/ml");

/// One agent process; killed (SIGKILL) and reaped on drop so no test leaves processes behind.
pub struct AgentProc {
    pub id: String,
    pub imds: ImdsMock,
    pub log: PathBuf,
    child: Option<Child>,
}

impl AgentProc {
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// `kill -9`: no warning, no hand-over.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Wait for the process to exit by itself; its exit code.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                self.child = None;
                return Some(status.code().unwrap_or(-1));
            }
            if self.child.is_none() || std::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

pub struct Cluster {
    pub coord: TestCoordinator,
    pub agents: Vec<AgentProc>,
    pub _dir: tempfile::TempDir,
}

impl Cluster {
    /// Start a coordinator for `training` and one agent per `(name, tier)`.
    pub async fn start(training: TrainingConfig, specs: &[(&str, Tier)]) -> Cluster {
        Self::start_logging(training, specs, DEFAULT_LOG).await
    }

    /// The same, with the agents' log filter `log`.
    pub async fn start_logging(
        training: TrainingConfig,
        specs: &[(&str, Tier)],
        log: &str,
    ) -> Cluster {
        let tokens: Vec<(String, String, Tier)> = specs
            .iter()
            .map(|(n, t)| (format!("tok-{n}"), n.to_string(), *t))
            .collect();
        let refs: Vec<(&str, &str, Tier)> = tokens
            .iter()
            .map(|(a, b, t)| (a.as_str(), b.as_str(), *t))
            .collect();
        let coord = TestCoordinator::start(training, &refs)
            .await
            .expect("coordinator starts");
        let dir = tempfile::tempdir().expect("tempdir");
        let mut agents = Vec::new();
        for (name, _) in specs {
            agents.push(spawn_agent_logging(&coord.url(), name, dir.path(), log).await);
        }
        Cluster {
            coord,
            agents,
            _dir: dir,
        }
    }

    pub fn agent(&mut self, name: &str) -> &mut AgentProc {
        self.agents
            .iter_mut()
            .find(|a| a.id == name)
            .expect("agent exists")
    }

    /// Wait for the job to end; panics with the agents' logs if it does not in time.
    pub async fn wait_done(&self, timeout: Duration) -> JobStatus {
        match self
            .coord
            .wait_for(timeout, |s| s.state == JobState::Completed)
            .await
        {
            Some(s) => s,
            None => {
                self.dump_logs();
                panic!(
                    "job did not complete in {timeout:?}: {:#?}",
                    self.coord.status()
                );
            }
        }
    }

    pub fn dump_logs(&self) {
        for a in &self.agents {
            let text = a.log_text();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("==== {} ====", a.id);
            for l in tail.into_iter().rev() {
                eprintln!("{l}");
            }
        }
    }

    /// Every agent still running exits by itself (code 0) within `timeout`.
    pub async fn assert_all_exit_cleanly(&mut self, timeout: Duration) {
        for a in &mut self.agents {
            if a.pid().is_none() {
                continue;
            }
            let code = a.wait_exit(timeout).await;
            assert_eq!(
                code,
                Some(0),
                "agent {} did not exit cleanly; log:\n{}",
                a.id,
                a.log_text()
            );
        }
    }
}

const DEFAULT_LOG: &str = "info,proteus_agent=info";

pub async fn spawn_agent(broker: &str, name: &str, dir: &std::path::Path) -> AgentProc {
    spawn_agent_logging(broker, name, dir, DEFAULT_LOG).await
}

pub async fn spawn_agent_logging(
    broker: &str,
    name: &str,
    dir: &std::path::Path,
    filter: &str,
) -> AgentProc {
    let imds = ImdsMock::start(name).await.expect("imds mock starts");
    let log = dir.join(format!("{name}.log"));
    let file = std::fs::File::create(&log).expect("log file");
    let child = Command::new(env!("CARGO_BIN_EXE_proteus-agent"))
        .args(["--broker", broker, "--token", &format!("tok-{name}")])
        .args(["--imds-endpoint", &imds.url(), "--imds-poll-ms", "200"])
        .args([
            "--data-dir",
            DATA_DIR,
            "--listen",
            "127.0.0.1:0",
            "--exit-margin-secs",
            "1",
        ])
        .args(["--log", filter])
        .env_remove("PROTEUS_AGENT_INSTANCE_ID")
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .expect("agent binary starts");
    AgentProc {
        id: name.into(),
        imds,
        log,
        child: Some(child),
    }
}
