//! The user's program as a child process group: started with the contract's environment, its
//! output captured (a file plus an in-memory tail for the broker), signalled as a group.

use crate::error::{AgentError, Result};
use std::collections::{BTreeMap, VecDeque};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// The newest output of the program (stdout and stderr interleaved by line), bounded.
#[derive(Debug, Default)]
pub struct OutputTail {
    lines: VecDeque<String>,
    bytes: usize,
    /// Bumped on every line, so the agent sends the tail only when it changed.
    version: u64,
}

/// Most bytes of output kept for the broker.
pub const TAIL_BYTES: usize = 64 * 1024;

impl OutputTail {
    fn push(&mut self, line: String) {
        self.bytes += line.len() + 1;
        self.lines.push_back(line);
        while self.bytes > TAIL_BYTES {
            match self.lines.pop_front() {
                Some(l) => self.bytes -= l.len() + 1,
                None => break,
            }
        }
        self.version += 1;
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn text(&self) -> String {
        let mut s = String::with_capacity(self.bytes);
        for l in &self.lines {
            s.push_str(l);
            s.push('\n');
        }
        s
    }

    /// Agent-side lines (what the agent did to the program) go into the same tail.
    pub fn note(&mut self, line: impl Into<String>) {
        self.push(format!("[proteus-agent] {}", line.into()));
    }
}

pub type SharedTail = Arc<Mutex<OutputTail>>;

/// How a run of the program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ended {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl Ended {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// A running program (its own process group, led by the child).
pub struct Running {
    child: Child,
    pgid: i32,
    readers: Vec<tokio::task::JoinHandle<()>>,
}

/// What to start.
pub struct Launch<'a> {
    pub argv: &'a [String],
    pub env: &'a BTreeMap<String, String>,
    pub cwd: &'a Path,
    pub log: &'a Path,
    pub tail: SharedTail,
}

impl Running {
    /// Starts `argv` in a new process group. The agent's own token is not passed on.
    pub fn start(l: Launch<'_>) -> Result<Running> {
        let (program, args) = l
            .argv
            .split_first()
            .ok_or_else(|| AgentError::Config("empty command".into()))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .current_dir(l.cwd)
            .env_remove("PROTEUS_AGENT_TOKEN")
            .envs(l.env)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to SIGKILL the child
        // when the agent dies, so a crashed agent does not leave the program running.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|source| AgentError::Io {
            file: PathBuf::from(program),
            source,
        })?;
        let pid = child
            .id()
            .ok_or_else(|| AgentError::Config(format!("{program} exited at once")))?;
        let mut readers = Vec::new();
        let log = Arc::new(tokio::sync::Mutex::new(None::<tokio::fs::File>));
        let log_path = l.log.to_path_buf();
        let stdout = child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>);
        let stderr = child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>);
        for stream in [stdout, stderr].into_iter().flatten() {
            let (tail, log, log_path) = (l.tail.clone(), log.clone(), log_path.clone());
            readers.push(tokio::spawn(async move {
                let mut lines = BufReader::new(stream).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    {
                        let mut f = log.lock().await;
                        if f.is_none() {
                            *f = tokio::fs::OpenOptions::new()
                                .create(true)
                                .append(true)
                                .open(&log_path)
                                .await
                                .ok();
                        }
                        if let Some(f) = f.as_mut() {
                            let _ = f.write_all(format!("{line}\n").as_bytes()).await;
                        }
                    }
                    tail.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                }
            }));
        }
        Ok(Running {
            child,
            pgid: pid as i32,
            readers,
        })
    }

    /// The process group's id (the child's pid).
    pub fn pgid(&self) -> i32 {
        self.pgid
    }

    /// Sends `signal` to the whole process group.
    pub fn signal_group(&self, signal: i32) {
        signal_group(self.pgid, signal);
    }

    /// Waits for the program to end, then for its output to be drained. Whatever it left
    /// running in its group is killed: a run ends with its group.
    pub async fn wait(&mut self) -> Ended {
        let status = self.child.wait().await;
        self.signal_group(libc::SIGKILL);
        for r in self.readers.drain(..) {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), r).await;
        }
        match status {
            Ok(s) => Ended {
                code: s.code(),
                signal: s.signal(),
            },
            Err(e) => {
                tracing::error!(error = %e, "cannot wait for the program");
                Ended {
                    code: None,
                    signal: None,
                }
            }
        }
    }
}

/// Sends `signal` to process group `pgid` (no-op for 0, "no program").
pub fn signal_group(pgid: i32, signal: i32) {
    if pgid > 0 {
        // SAFETY: signalling a process group this agent created (negative pid = group).
        unsafe { libc::kill(-pgid, signal) };
    }
}
