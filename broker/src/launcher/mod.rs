//! The local launcher: where instances do not really boot (the simulated cloud, LocalStack), it
//! starts one real `proteus-agent` process per instance and gives it an instance-metadata
//! endpoint of its own, through which an interruption is announced exactly as EC2 would.
//!
//! Agents are the "VMs": they outlive a crash of the broker. Each agent's PID and metadata
//! address are recorded (the PID in a file under the state directory, the address in the store),
//! so a restarted broker re-adopts the agents that are still alive and serves their metadata on
//! the same address again.

pub mod metadata;

use metadata::{InstanceFacts, MetadataServer};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum LaunchError {
    #[error("cannot start the metadata endpoint for {instance}: {source}")]
    Metadata {
        instance: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start {bin} for {instance}: {source}")]
    Spawn {
        bin: PathBuf,
        instance: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    State {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How agents are started.
#[derive(Debug, Clone)]
pub struct LauncherConfig {
    /// The agent program: `proteus-agent`, or this `proteus` binary run as `proteus agent`.
    pub agent_bin: PathBuf,
    /// Arguments before the agent's own (`["agent"]` when `agent_bin` is `proteus`).
    pub agent_prefix: Vec<String>,
    /// Where the agents find their data sets.
    pub data_dir: PathBuf,
    /// PID files and agent logs.
    pub state_dir: PathBuf,
    /// How often agents poll their metadata endpoint.
    pub imds_poll_ms: u64,
    /// How long before the announced action time agents leave.
    pub exit_margin_secs: u64,
    /// Log filter passed to agents.
    pub agent_log: String,
    /// The CA agents trust for the broker's HTTPS (their `--ca-file`); `None`: system roots.
    pub ca_file: Option<PathBuf>,
    /// The unprivileged user agents run command jobs' programs as (their `--run-as`).
    pub run_as: Option<String>,
}

/// The variables of the broker's environment a local agent gets: nothing else crosses, so the
/// broker's secrets (its user token, database URL, AWS credentials) never reach an agent, and
/// so never a user's program.
pub const AGENT_ENV: [&str; 5] = ["PATH", "HOME", "LANG", "TZ", "RUST_BACKTRACE"];

impl LauncherConfig {
    /// Where local agents keep command jobs' files per instance (working and checkpoint
    /// directories, output logs). Beside the agents' logs under the state directory, except
    /// for a root broker: its agents run programs as an unprivileged user, who must reach its
    /// instance's directory, and a state directory under root's home is closed to it. Then a
    /// directory of the broker's own under the system's temporary directory (named after the
    /// state directory, mode 0711: reachable, not listable).
    pub fn scratch_dir(&self) -> PathBuf {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return self.state_dir.join("scratch");
        }
        let path =
            std::fs::canonicalize(&self.state_dir).unwrap_or_else(|_| self.state_dir.clone());
        // FNV-1a: a stable name, not a secret.
        let hash = path
            .as_os_str()
            .as_encoded_bytes()
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
            });
        std::env::temp_dir().join(format!("proteus-scratch-{hash:016x}"))
    }

    /// `proteus-agent` next to the running binary if it is there (as cargo and installs lay
    /// them out), else the running `proteus` itself as `proteus agent`.
    pub fn default_agent_command() -> (PathBuf, Vec<String>) {
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("proteus"));
        let sibling = exe
            .parent()
            .map(|d| d.join("proteus-agent"))
            .filter(|p| p.is_file());
        match sibling {
            Some(bin) => (bin, Vec::new()),
            None => (exe, vec!["agent".to_string()]),
        }
    }
}

/// What the store recorded of an instance's local agent.
#[derive(Debug, Clone, Copy, Default)]
pub struct Recorded {
    pub metadata_addr: Option<SocketAddr>,
    pub pid: Option<u32>,
}

#[derive(Debug)]
struct LocalAgent {
    pid: u32,
    metadata: MetadataServer,
}

/// Starts, tracks and stops local agent processes.
#[derive(Debug)]
pub struct LocalLauncher {
    config: LauncherConfig,
    agents: Mutex<HashMap<String, LocalAgent>>,
}

impl LocalLauncher {
    pub fn new(config: LauncherConfig) -> Result<Self, LaunchError> {
        let dir = config.state_dir.join("agents");
        std::fs::create_dir_all(&dir)
            .and_then(|()| {
                // The agents' logs and PID files are the broker's own: no program of a job
                // (which may run as another user) reads them.
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            })
            .map_err(|source| LaunchError::State { path: dir, source })?;
        Ok(LocalLauncher {
            config,
            agents: Mutex::new(HashMap::new()),
        })
    }

    pub fn config(&self) -> &LauncherConfig {
        &self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, LocalAgent>> {
        self.agents.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn token_file(&self, instance_id: &str) -> PathBuf {
        self.config
            .state_dir
            .join("agents")
            .join(format!("{instance_id}.token"))
    }

    fn pid_file(&self, instance_id: &str) -> PathBuf {
        self.config
            .state_dir
            .join("agents")
            .join(format!("{instance_id}.pid"))
    }

    pub fn log_file(&self, instance_id: &str) -> PathBuf {
        self.config
            .state_dir
            .join("agents")
            .join(format!("{instance_id}.log"))
    }

    /// Starts the agent of an instance (or re-adopts it if its recorded process is still alive)
    /// and returns its metadata address and process id. `recorded` reuses a recorded metadata
    /// address and process (another broker's, when this one took the job over); `broker_urls`
    /// is what the agent is told (comma-separated, tried in turn). `token` goes into the agent's
    /// token file: a new instance's bootstrap token (the agent trades it for its agent token at
    /// its first contact and writes that over the file), or an adopted instance's agent token.
    pub async fn start(
        &self,
        instance_id: &str,
        facts: InstanceFacts,
        token: &str,
        recorded: Recorded,
        broker_urls: &str,
    ) -> Result<(SocketAddr, u32), LaunchError> {
        if let Some(a) = self.lock().get(instance_id) {
            return Ok((a.metadata.addr(), a.pid));
        }
        let metadata_addr = recorded.metadata_addr;
        let bind = metadata_addr.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
        let metadata = match MetadataServer::start(bind, facts.clone()).await {
            Ok(m) => m,
            // The recorded port may be taken by now; a fresh one only costs an adopted agent its
            // notices, and a new agent nothing.
            Err(_) if metadata_addr.is_some() => {
                MetadataServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), facts)
                    .await
                    .map_err(|source| LaunchError::Metadata {
                        instance: instance_id.to_string(),
                        source,
                    })?
            }
            Err(source) => {
                return Err(LaunchError::Metadata {
                    instance: instance_id.to_string(),
                    source,
                });
            }
        };
        let addr = metadata.addr();
        let pid = match self.recorded_live_pid(instance_id, recorded.pid) {
            Some(pid) => {
                tracing::info!(instance = instance_id, pid, "re-adopted a running agent");
                pid
            }
            None => self.spawn(instance_id, token, &metadata.url(), broker_urls)?,
        };
        self.lock()
            .insert(instance_id.to_string(), LocalAgent { pid, metadata });
        Ok((addr, pid))
    }

    fn spawn(
        &self,
        instance_id: &str,
        token: &str,
        imds: &str,
        broker_urls: &str,
    ) -> Result<u32, LaunchError> {
        let log_path = self.log_file(instance_id);
        let state_err = |path: &Path, source| LaunchError::State {
            path: path.to_path_buf(),
            source,
        };
        let log = std::fs::File::create(&log_path).map_err(|e| state_err(&log_path, e))?;
        let scratch = self.config.scratch_dir();
        create_reachable(&scratch).map_err(|e| state_err(&scratch, e))?;
        // The token goes in a file only this user can read, not in the agent's environment or
        // arguments (which `/proc` shows, and `ps`).
        let token_path = self.token_file(instance_id);
        write_private(&token_path, token).map_err(|e| state_err(&token_path, e))?;
        let log2 = log.try_clone().map_err(|e| state_err(&log_path, e))?;
        let mut cmd = std::process::Command::new(&self.config.agent_bin);
        cmd.env_clear();
        for var in AGENT_ENV {
            if let Some(value) = std::env::var_os(var) {
                cmd.env(var, value);
            }
        }
        cmd.args(&self.config.agent_prefix)
            .args(
                self.config
                    .run_as
                    .iter()
                    .flat_map(|user| ["--run-as", user.as_str()]),
            )
            .arg("--broker")
            .arg(broker_urls)
            .arg("--imds-endpoint")
            .arg(imds)
            .arg("--imds-poll-ms")
            .arg(self.config.imds_poll_ms.to_string())
            .arg("--exit-margin-secs")
            .arg(self.config.exit_margin_secs.to_string())
            .arg("--data-dir")
            .arg(&self.config.data_dir)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--log")
            .arg(&self.config.agent_log)
            .args(
                self.config
                    .ca_file
                    .iter()
                    .flat_map(|f| [std::ffi::OsStr::new("--ca-file"), f.as_os_str()]),
            )
            // Command jobs' files per instance.
            .env("PROTEUS_AGENT_SCRATCH_DIR", self.config.scratch_dir())
            .arg("--token-file")
            .arg(&token_path)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log2);
        let child = cmd.spawn().map_err(|source| LaunchError::Spawn {
            bin: self.config.agent_bin.clone(),
            instance: instance_id.to_string(),
            source,
        })?;
        let pid = child.id();
        let pid_path = self.pid_file(instance_id);
        std::fs::write(&pid_path, pid.to_string()).map_err(|e| state_err(&pid_path, e))?;
        // Reap the child when it exits so it does not linger as a zombie.
        std::thread::spawn(move || {
            let mut child = child;
            let _ = child.wait();
        });
        tracing::info!(instance = instance_id, pid, imds, "started agent");
        Ok(pid)
    }

    /// The agent's process, from this launcher's PID file or as the store recorded it (started
    /// by another broker), if it is alive.
    fn recorded_live_pid(&self, instance_id: &str, recorded: Option<u32>) -> Option<u32> {
        let from_file = std::fs::read_to_string(self.pid_file(instance_id))
            .ok()
            .and_then(|text| text.trim().parse().ok());
        from_file.or(recorded).filter(|pid| process_alive(*pid))
    }

    /// Whether the instance's agent process (tracked, or recorded in its PID file or the
    /// store) is alive.
    pub fn has_live_process(&self, instance_id: &str, recorded: Option<u32>) -> bool {
        self.is_running(instance_id) || self.recorded_live_pid(instance_id, recorded).is_some()
    }

    /// Sets the instance's `spot/instance-action` notice. Returns false for unknown instances.
    pub fn announce_interruption(&self, instance_id: &str, time_rfc3339: &str) -> bool {
        match self.lock().get(instance_id) {
            Some(a) => {
                a.metadata.announce_interruption(time_rfc3339);
                true
            }
            None => false,
        }
    }

    pub fn announce_rebalance(&self, instance_id: &str, time_rfc3339: &str) -> bool {
        match self.lock().get(instance_id) {
            Some(a) => {
                a.metadata.announce_rebalance(time_rfc3339);
                true
            }
            None => false,
        }
    }

    pub fn metadata_url(&self, instance_id: &str) -> Option<String> {
        self.lock().get(instance_id).map(|a| a.metadata.url())
    }

    pub fn is_running(&self, instance_id: &str) -> bool {
        self.lock()
            .get(instance_id)
            .is_some_and(|a| process_alive(a.pid))
    }

    /// Stops an instance's agent: the VM is gone. SIGTERM, then SIGKILL after `grace`.
    /// `recorded`: its process id as the store has it.
    pub async fn stop(&self, instance_id: &str, grace: Duration, recorded: Option<u32>) {
        let agent = self.lock().remove(instance_id);
        let pid = agent
            .as_ref()
            .map(|a| a.pid)
            .or_else(|| self.recorded_live_pid(instance_id, recorded));
        if let Some(pid) = pid {
            terminate_process(pid, grace).await;
        }
        let _ = std::fs::remove_file(self.pid_file(instance_id));
        let _ = std::fs::remove_file(self.token_file(instance_id));
    }

    /// Stops every agent this launcher knows about.
    pub async fn stop_all(&self, grace: Duration) {
        let ids: Vec<String> = self.lock().keys().cloned().collect();
        for id in ids {
            self.stop(&id, grace, None).await;
        }
    }
}

fn process_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks that the process exists.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    // A zombie (exited, not yet reaped) still "exists"; its /proc state says otherwise.
    alive
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                !s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(true)
}

/// Creates `dir` (and its parents) and makes it reachable, not listable, by others (0711).
fn create_reachable(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
}

/// Writes `text` to a new file readable and writable by this user only (0600 from its
/// creation: no moment at which others could open it).
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(text.as_bytes())
}

async fn terminate_process(pid: u32, grace: Duration) {
    let Ok(raw) = i32::try_from(pid) else { return };
    // SAFETY: sending a signal to a process id we started.
    unsafe { libc::kill(raw, libc::SIGTERM) };
    let deadline = tokio::time::Instant::now() + grace;
    while tokio::time::Instant::now() < deadline {
        if !process_alive(pid) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // SAFETY: as above.
    unsafe { libc::kill(raw, libc::SIGKILL) };
}
