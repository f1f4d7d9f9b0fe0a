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

/// The user a root agent runs programs as by default ([`RunAs::dedicated`]).
pub const DEFAULT_USER: &str = "proteus-job";

/// An unprivileged user the program runs as (the agent is root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

impl RunAs {
    /// Looks `name` up in the user database.
    pub fn lookup(name: &str) -> Result<RunAs> {
        let unknown = || AgentError::Config(format!("--run-as {name}: no such user"));
        let c_name = std::ffi::CString::new(name).map_err(|_| unknown())?;
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut buf = vec![0u8; 16 * 1024];
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; the strings `pwd` points into live in
        // `buf`, which outlives the fields read below (uid and gid are plain integers).
        let rc = unsafe {
            libc::getpwnam_r(
                c_name.as_ptr(),
                &mut pwd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut found,
            )
        };
        if rc != 0 || found.is_null() {
            return Err(unknown());
        }
        if pwd.pw_uid == 0 {
            return Err(AgentError::Config(format!(
                "--run-as {name}: that is root; name an unprivileged user"
            )));
        }
        Ok(RunAs {
            name: name.to_string(),
            uid: pwd.pw_uid,
            gid: pwd.pw_gid,
        })
    }

    /// The user a root agent runs programs as when not told otherwise ([`DEFAULT_USER`]),
    /// created if missing: a system user with its own group, no home and no login shell, as
    /// the EC2 bootstrap creates it. Agents starting side by side may race to create it; the
    /// loser finds it made.
    pub async fn dedicated() -> Result<RunAs> {
        for attempt in 0..5u32 {
            if let Ok(user) = RunAs::lookup(DEFAULT_USER) {
                return Ok(user);
            }
            let out = tokio::process::Command::new("useradd")
                .args([
                    "--system",
                    "--user-group",
                    "--no-create-home",
                    "--home-dir",
                    "/nonexistent",
                    "--shell",
                    "/usr/sbin/nologin",
                    DEFAULT_USER,
                ])
                .stdin(std::process::Stdio::null())
                .output()
                .await
                .map_err(|e| {
                    AgentError::Config(format!(
                        "cannot run useradd to create the user programs run as ({DEFAULT_USER}):                          {e}; create it, or start the agent with --run-as USER"
                    ))
                })?;
            if out.status.success() {
                continue;
            }
            tracing::debug!(
                attempt,
                stderr = %String::from_utf8_lossy(&out.stderr),
                "useradd failed; another agent may be creating the user"
            );
            tokio::time::sleep(std::time::Duration::from_millis(
                200 * u64::from(attempt + 1),
            ))
            .await;
        }
        RunAs::lookup(DEFAULT_USER).map_err(|_| {
            AgentError::Config(format!(
                "cannot create the user programs run as ({DEFAULT_USER}); create it, or start                  the agent with --run-as USER"
            ))
        })
    }

    /// Gives `path` to this user (not following symlinks), and everything under it when
    /// `recursive`.
    pub fn own(&self, path: &Path, recursive: bool) -> Result<()> {
        let io = |source| AgentError::Io {
            file: path.to_path_buf(),
            source,
        };
        std::os::unix::fs::lchown(path, Some(self.uid), Some(self.gid)).map_err(io)?;
        if recursive && std::fs::symlink_metadata(path).map_err(io)?.is_dir() {
            for entry in std::fs::read_dir(path).map_err(io)? {
                self.own(&entry.map_err(io)?.path(), true)?;
            }
        }
        Ok(())
    }
}

/// The variables of the agent's own environment a program gets (besides the contract's and the
/// job's): nothing else crosses, so no secret of the agent's or the broker's reaches it.
pub const INHERITED_VARS: [&str; 4] = ["PATH", "HOME", "LANG", "TZ"];

/// What to start.
pub struct Launch<'a> {
    pub argv: &'a [String],
    /// The program's whole environment (nothing of the agent's is inherited).
    pub env: &'a BTreeMap<String, String>,
    /// Run as this user instead of the agent's.
    pub run_as: Option<&'a RunAs>,
    pub cwd: &'a Path,
    pub log: &'a Path,
    pub tail: SharedTail,
}

impl Running {
    /// Starts `argv` in a new process group, with exactly `env` as its environment.
    pub fn start(l: Launch<'_>) -> Result<Running> {
        let (program, args) = l
            .argv
            .split_first()
            .ok_or_else(|| AgentError::Config("empty command".into()))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .current_dir(l.cwd)
            .env_clear()
            .envs(l.env)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        if let Some(user) = l.run_as {
            // std drops the supplementary groups too when a root parent sets the uid.
            cmd.uid(user.uid).gid(user.gid);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    async fn run(argv: &[&str], env: &[(&str, &str)], run_as: Option<&RunAs>) -> String {
        let dir = tempfile::tempdir().unwrap();
        let argv: Vec<String> = argv.iter().map(|s| s.to_string()).collect();
        let env: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let tail: SharedTail = Arc::new(Mutex::new(OutputTail::default()));
        let mut r = Running::start(Launch {
            argv: &argv,
            env: &env,
            run_as,
            cwd: Path::new("/"),
            log: &dir.path().join("out.log"),
            tail: tail.clone(),
        })
        .unwrap();
        assert!(r.wait().await.success());
        tail.lock().unwrap().text()
    }

    #[tokio::test]
    async fn a_program_gets_exactly_the_environment_it_is_given() {
        // The test process's own environment (CARGO_*, PATH, HOME, ...) must not show.
        let out = run(
            &["/usr/bin/env"],
            &[("PATH", "/usr/bin:/bin"), ("A", "1")],
            None,
        )
        .await;
        let mut lines: Vec<&str> = out.lines().collect();
        lines.sort();
        assert_eq!(lines, ["A=1", "PATH=/usr/bin:/bin"], "{out}");
    }

    #[tokio::test]
    async fn a_root_agent_runs_the_program_as_the_user_it_is_told() {
        let nobody = RunAs::lookup("nobody").expect("the nobody user");
        assert_ne!(nobody.uid, 0);
        assert!(
            RunAs::lookup("root").is_err(),
            "root is refused as --run-as"
        );
        assert!(RunAs::lookup("no-such-user-here").is_err());
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let out = run(&["/usr/bin/id", "-u"], &[], Some(&nobody)).await;
            assert_eq!(out.trim(), nobody.uid.to_string());
        } else {
            // Not root: changing the user is refused by the kernel, never silently skipped.
            let dir = tempfile::tempdir().unwrap();
            let argv = vec!["/usr/bin/id".to_string()];
            let started = Running::start(Launch {
                argv: &argv,
                env: &BTreeMap::new(),
                run_as: Some(&nobody),
                cwd: Path::new("/"),
                log: &dir.path().join("out.log"),
                tail: Arc::new(Mutex::new(OutputTail::default())),
            });
            assert!(started.is_err());
        }
    }
}
