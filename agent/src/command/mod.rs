//! Command jobs: the agent runs the user's own program under a small contract
//! (`docs/command-jobs.md`), instead of a built-in app.
//!
//! - the environment: `PROTEUS_JOB_ID`, `PROTEUS_INSTANCE_ID`, `PROTEUS_RANK`,
//!   `PROTEUS_WORLD_SIZE` (from the view the program starts in), `PROTEUS_CHECKPOINT_DIR`,
//!   `PROTEUS_NOTICE_FILE`, `PROTEUS_PROGRESS_FILE`;
//! - the checkpoint directory is restored from durable storage before the first start on an
//!   instance, uploaded every `checkpoint_interval_secs` while the program runs and whenever it
//!   ends ([`checkpoint`]);
//! - an interruption notice is written to the notice file and the process group gets SIGTERM
//!   at once; SIGKILL follows `kill_margin_secs` before the deadline;
//! - the progress file is read on every heartbeat and sent to the broker as the job's
//!   progress; the program's end is reported as [`AgentEvent::ProgramExited`], which the
//!   coordinator maps to the job's state (completion, a failure against `max_restarts`, or
//!   nothing after a notice).
//!
//! The agent joins the job's control plane like any other (so the broker's layout decides
//! who works and with which rank) but holds no parameter-server state.

pub mod checkpoint;
pub mod program;
pub mod torchrun;

use crate::control::Broker;
use crate::error::{AgentError, Result};
use crate::imds::{self, Imds, Notice};
use crate::session::{AgentOptions, Control, Outcome, heartbeats, now_unix, poll_commands};
use program::{Ended, Launch, OutputTail, RunAs, Running, SharedTail};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::{
    AgentEvent, ClusterView, CommandConfig, CommandLauncher, ExitReason, ProgramProgress,
    RegisterResponse,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// The files of the contract, per instance.
#[derive(Debug, Clone)]
pub struct Paths {
    pub checkpoint_dir: PathBuf,
    pub notice_file: PathBuf,
    pub progress_file: PathBuf,
    pub output_log: PathBuf,
    pub workdir: PathBuf,
    /// The program's `HOME` when it runs as its own user.
    pub home: PathBuf,
    /// `launcher = "torchrun"`: the launcher script ([`torchrun::SHIM`]).
    pub torchrun_shim: PathBuf,
}

impl Paths {
    fn new(root: &Path, workdir: Option<&str>) -> Paths {
        Paths {
            checkpoint_dir: root.join("checkpoint"),
            notice_file: root.join("notice.json"),
            progress_file: root.join("progress.json"),
            output_log: root.join("output.log"),
            torchrun_shim: root.join("proteus_torchrun.py"),
            home: root.join("home"),
            // An `s3://` working directory is fetched into the instance's own `work`.
            workdir: workdir
                .filter(|w| !w.starts_with("s3://"))
                .map_or_else(|| root.join("work"), PathBuf::from),
        }
    }
}

/// Fetches the job's `s3://` working directory (a gzipped tar) into `dir`, before `setup`:
/// through a URL the broker presigns, so the agent needs neither credentials nor an AWS SDK.
async fn fetch_workdir(broker: &Broker, me: &InstanceId, dir: &Path) -> Result<()> {
    let source = broker.workdir_transfer(me).await?;
    let archive = broker.get_archive(&source).await?.ok_or_else(|| {
        AgentError::Config(
            "the job's s3:// working directory does not exist (S3 answered 404)".into(),
        )
    })?;
    let (bytes, d) = (archive.len(), dir.to_path_buf());
    tokio::task::spawn_blocking(move || checkpoint::unpack(&archive, &d))
        .await
        .map_err(|e| {
            AgentError::Config(format!("unpacking the working directory crashed: {e}"))
        })??;
    tracing::info!(bytes, dir = %dir.display(), "fetched the working directory");
    Ok(())
}

/// Reads `{"done": x, "total": y}`; `None` while the file is absent or half-written.
pub fn read_progress(path: &Path) -> Option<ProgramProgress> {
    let text = std::fs::read_to_string(path).ok()?;
    let p: ProgramProgress = serde_json::from_str(&text).ok()?;
    p.fraction().map(|_| p)
}

/// Writes `text` to `path` atomically and durably: a reader sees the old file or the whole new
/// one, and once this returns the new one is on disk (file and directory entry synced).
fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// The kill margin of a notice that leaves `left` before its deadline: the job's
/// `kill_margin_secs`, but never more than a quarter of the notice, so a short notice (a sped-up
/// simulated cloud, a job ending) still leaves the program three quarters of it to exit.
pub fn kill_margin(configured_secs: u64, left: Duration) -> Duration {
    Duration::from_secs(configured_secs).min(left / 4)
}

/// RFC 3339 (UTC, seconds) of a Unix time.
fn rfc3339(unix: i64) -> String {
    proteus_wire::time::format_millis(unix.saturating_mul(1000))
}

/// Why the program is being stopped.
struct Leaving {
    /// SIGKILL then, if it still runs.
    kill_at: Instant,
    /// The agent exits once the program ended and its checkpoint is up (an interruption);
    /// otherwise (taken out of the layout) it stays and may be given work again.
    exit_after: bool,
}

/// One run: (setup, then) the program, in a task; `pgid` is the group currently running.
struct Run {
    task: JoinHandle<RunEnd>,
    pgid: Arc<AtomicI32>,
    rank: u32,
    /// `launcher = "torchrun"`: the rendezvous this run joined.
    rendezvous: Option<torchrun::Rendezvous>,
}

struct RunEnd {
    ended: Ended,
    /// The setup step succeeded (it is not repeated on this instance).
    setup_done: bool,
}

struct Runner {
    me: InstanceId,
    broker: Broker,
    cfg: CommandConfig,
    reg: RegisterResponse,
    paths: Paths,
    progress: crate::worker::SharedProgress,
    applied_epoch: Arc<AtomicU64>,
    tail: SharedTail,
    /// (rank, world size) in the newest view; `None` when this instance does not work.
    slot: Option<(u32, u32)>,
    /// `launcher = "torchrun"`: the rendezvous in the newest view.
    rendezvous: Option<torchrun::Rendezvous>,
    /// `launcher = "torchrun"`: the rendezvous moved (its host changed) and the running
    /// torchrun was told to stop, to start again against the new one; SIGKILL then.
    moving: Option<Instant>,
    run: Option<Run>,
    setup_done: bool,
    /// The rank whose checkpoint the local checkpoint directory holds (restored once per rank
    /// held on this instance).
    restored: Option<u32>,
    leaving: Option<Leaving>,
    /// The program completed the job here; wait for the broker's stop.
    finished: bool,
    restart_at: Option<Instant>,
    uploader: Arc<tokio::sync::Mutex<()>>,
    next_upload: Instant,
    sent_version: u64,
    /// The user the program runs as (the agent is root and was given `--run-as`).
    run_as: Option<RunAs>,
}

/// Runs a command job on this instance to its end.
pub async fn run(
    opts: &AgentOptions,
    cfg: CommandConfig,
    reg: RegisterResponse,
    broker: Broker,
    me: InstanceId,
    imds: Option<Imds>,
) -> Result<Outcome> {
    let root_dir = opts.scratch_dir.join(me.0.replace(['/', '\\'], "_"));
    let paths = Paths::new(&root_dir, cfg.workdir.as_deref());
    let own_workdir = cfg
        .workdir
        .as_deref()
        .is_none_or(|w| w.starts_with("s3://"));
    for dir in [
        &root_dir,
        &paths.workdir,
        &paths.checkpoint_dir,
        &paths.home,
    ] {
        std::fs::create_dir_all(dir).map_err(|source| AgentError::Io {
            file: dir.clone(),
            source,
        })?;
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let run_as = match (opts.run_as.as_deref(), root) {
        (Some(name), false) => {
            return Err(AgentError::Config(format!(
                "--run-as {name} needs the agent to run as root"
            )));
        }
        (Some(name), true) => Some(RunAs::lookup(name)?),
        // A program never runs as root: it could read every secret on the machine.
        (None, true) => Some(RunAs::dedicated().await?),
        (None, false) => None,
    };
    if let Some(user) = &run_as {
        // The program's own files are its user's; the agent's (output log, notice) stay the
        // agent's, readable.
        for dir in [&root_dir, &paths.checkpoint_dir, &paths.home] {
            user.own(dir, false)?;
        }
        if own_workdir {
            user.own(&paths.workdir, false)?;
        }
    }
    if cfg
        .workdir
        .as_deref()
        .is_some_and(|w| w.starts_with("s3://"))
    {
        fetch_workdir(&broker, &me, &paths.workdir).await?;
    }
    if cfg.launcher == CommandLauncher::Torchrun {
        std::fs::write(&paths.torchrun_shim, torchrun::SHIM).map_err(|source| AgentError::Io {
            file: paths.torchrun_shim.clone(),
            source,
        })?;
    }
    for stale in [&paths.notice_file, &paths.progress_file] {
        let _ = std::fs::remove_file(stale);
    }
    let (control_tx, control_rx) = mpsc::unbounded_channel();
    let progress: crate::worker::SharedProgress = Arc::new(Mutex::new(Default::default()));
    let applied_epoch = Arc::new(AtomicU64::new(0));
    tokio::spawn(heartbeats(
        broker.clone(),
        me.clone(),
        Duration::from_millis(reg.heartbeat_interval_ms),
        progress.clone(),
        || None,
        applied_epoch.clone(),
        control_tx.clone(),
    ));
    // No model: one key, so the control plane's layout stays well-formed.
    broker
        .event(&me, &AgentEvent::Ready { model_len: 1 })
        .await?;
    tokio::spawn(poll_commands(
        broker.clone(),
        me.clone(),
        reg.command_wait_ms,
        control_tx,
    ));
    let (notices_tx, notices_rx) = mpsc::unbounded_channel();
    if let Some(imds) = imds {
        tokio::spawn(imds::watch(imds, opts.imds_poll, notices_tx));
    }
    let mut runner = Runner {
        me,
        broker,
        next_upload: Instant::now() + Duration::from_secs(cfg.checkpoint_interval_secs),
        cfg,
        reg,
        paths,
        progress,
        applied_epoch,
        tail: Arc::new(Mutex::new(OutputTail::default())),
        slot: None,
        rendezvous: None,
        moving: None,
        run: None,
        setup_done: false,
        restored: None,
        leaving: None,
        finished: false,
        restart_at: None,
        uploader: Arc::new(tokio::sync::Mutex::new(())),
        sent_version: 0,
        run_as,
    };
    runner.main_loop(control_rx, notices_rx).await
}

impl Runner {
    fn note(&self, line: impl Into<String>) {
        let line = line.into();
        tracing::info!("{line}");
        self.tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .note(line);
    }

    async fn event(&self, ev: AgentEvent) {
        if let Err(e) = self.broker.event(&self.me, &ev).await {
            tracing::warn!(error = %e, ?ev, "could not report event");
        }
    }

    async fn main_loop(
        &mut self,
        mut control_rx: mpsc::UnboundedReceiver<Control>,
        mut notices_rx: mpsc::UnboundedReceiver<Notice>,
    ) -> Result<Outcome> {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        let mut sigterm =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut last_output = Instant::now();
        loop {
            tokio::select! {
                Some(c) = control_rx.recv() => match c {
                    Control::Configure(view) => self.configure(*view).await,
                    Control::Stop(reason) => {
                        return self.stop(&reason).await;
                    }
                    Control::JobOver => return self.stop("job over").await,
                    Control::Forgotten => {
                        // Its checkpoint upload is refused if the rank has moved on; tried anyway.
                        self.stop_program("the broker no longer knows this instance").await;
                        return Err(AgentError::Broker(
                            "the broker no longer knows this instance (declared dead?)".into(),
                        ));
                    }
                },
                Some(n) = notices_rx.recv() => {
                    if let Some(out) = self.on_notice(n).await {
                        return out;
                    }
                }
                end = async { (&mut self.run.as_mut().expect("guarded").task).await }, if self.run.is_some() => {
                    let rank = self.run.take().map_or(0, |r| r.rank);
                    let end = end.unwrap_or(RunEnd { ended: Ended { code: None, signal: None }, setup_done: false });
                    if let Some(out) = self.on_end(end, rank).await {
                        return out;
                    }
                }
                _ = sigterm.recv() => {
                    // The machine is going away under us (the instance was ended: the launcher
                    // stops the "VM", or the OS shuts down). Proteus's own stops come as a
                    // `Stop` first; this is the backstop, with the same grace.
                    self.stop_program("this instance is shutting down").await;
                    return Ok(Outcome::Stopped("terminated by signal".into()));
                }
                _ = tick.tick() => {
                    self.on_tick().await;
                    if last_output.elapsed() >= Duration::from_secs(1) {
                        last_output = Instant::now();
                        self.send_output().await;
                    }
                }
            }
        }
    }

    async fn configure(&mut self, view: ClusterView) {
        if view.epoch <= self.applied_epoch.load(Ordering::Relaxed) {
            return;
        }
        self.applied_epoch.store(view.epoch, Ordering::Relaxed);
        self.slot = view
            .worker(&self.me)
            .map(|w| (w.rank, view.workers.len() as u32));
        self.rendezvous = torchrun::rendezvous(&view, &self.me);
        let moved = self
            .run
            .as_ref()
            .zip(self.slot)
            .is_some_and(|(run, (rank, _))| run.rank != rank);
        match (self.slot, self.run.is_some()) {
            (Some(_), false) if !self.finished && self.leaving.is_none() => {
                self.restart_at = None;
                self.start().await;
            }
            (None, false) => {
                // Say so: the broker may give this instance's rank to another (or this one
                // another rank) only once no program of it runs.
                self.event(AgentEvent::ProgramIdle { epoch: view.epoch })
                    .await;
            }
            (_, true) if (self.slot.is_none() || moved) && self.leaving.is_none() => {
                // Taken out of the layout (or given another rank) without a notice: stop the
                // program as if warned, keep its checkpoint, stay available; a new rank's
                // program starts once this one ended.
                let grace = self.grace();
                let deadline = now_unix() + grace.as_secs() as i64;
                self.deliver_notice(deadline, "this instance was taken out of the job's layout")
                    .await;
                self.leaving = Some(Leaving {
                    kill_at: Instant::now() + grace,
                    exit_after: false,
                });
            }
            (Some(_), true) if self.leaving.is_none() && self.moving.is_none() => {
                let joined = self.run.as_ref().and_then(|r| r.rendezvous.clone());
                if self.cfg.launcher == CommandLauncher::Torchrun && joined != self.rendezvous {
                    // Another member hosts the rendezvous now (say the reliable instance
                    // joined after spot nodes had started one of their own): move to it. This
                    // is not a failure and not a notice; torchrun closes the old rendezvous,
                    // whose other nodes move too.
                    self.note(format!(
                        "the rendezvous moved to {:?}: restarting torchrun",
                        self.rendezvous.as_ref().map(|r| &r.endpoint)
                    ));
                    // The notice file first, as for every stop: the program saves.
                    let grace = self.grace();
                    self.deliver_notice(
                        now_unix() + grace.as_secs() as i64,
                        "the torchrun rendezvous moved: restarting against the new one",
                    )
                    .await;
                    self.moving = Some(Instant::now() + grace);
                }
            }
            _ => {}
        }
    }

    /// The program's whole environment: `PATH`, `HOME`, `LANG` and `TZ` (`HOME` is the
    /// instance's own when the program runs as its own user), the job's `env`, then the
    /// contract's variables. Nothing else of the agent's environment.
    fn env(&self, rank: u32, world: u32) -> BTreeMap<String, String> {
        let p = |p: &Path| p.display().to_string();
        let mut env: BTreeMap<String, String> = program::INHERITED_VARS
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
            .collect();
        if self.run_as.is_some() || !env.contains_key("HOME") {
            env.insert("HOME".into(), p(&self.paths.home));
        }
        env.extend(self.cfg.env.clone());
        for (k, v) in [
            ("PROTEUS_JOB_ID", self.reg.job_id.to_string()),
            ("PROTEUS_INSTANCE_ID", self.me.0.clone()),
            ("PROTEUS_RANK", rank.to_string()),
            ("PROTEUS_WORLD_SIZE", world.to_string()),
            ("PROTEUS_CHECKPOINT_DIR", p(&self.paths.checkpoint_dir)),
            ("PROTEUS_NOTICE_FILE", p(&self.paths.notice_file)),
            ("PROTEUS_PROGRESS_FILE", p(&self.paths.progress_file)),
        ] {
            env.insert(k.to_string(), v);
        }
        env
    }

    /// Restores the checkpoint (first start on this instance), then starts setup and the
    /// program in a task.
    async fn start(&mut self) {
        let Some((rank, world)) = self.slot else {
            return;
        };
        // A rank has one holder at a time, and a holder leaves it only once its program has
        // ended and its checkpoint is up: so this is the rank's newest checkpoint.
        let ck_rank = rank;
        if self.restored != Some(ck_rank) {
            if self.restored.is_some() {
                // This instance held another rank before: never carry that rank's state into
                // this rank's lineage.
                let dir = &self.paths.checkpoint_dir;
                if let Err(e) =
                    std::fs::remove_dir_all(dir).and_then(|()| std::fs::create_dir_all(dir))
                {
                    self.note(format!("cannot clear the checkpoint directory: {e}"));
                }
                if let Some(user) = &self.run_as
                    && let Err(e) = user.own(dir, false)
                {
                    self.note(format!(
                        "cannot give the checkpoint directory to {}: {e}",
                        user.name
                    ));
                }
            }
            match checkpoint::restore(&self.broker, &self.me, ck_rank, &self.paths.checkpoint_dir)
                .await
            {
                Ok(Some(t)) => {
                    self.note(format!(
                        "restored the checkpoint of rank {ck_rank}: {} bytes in {:.2} s",
                        t.bytes, t.secs
                    ));
                    if let Some(user) = &self.run_as
                        && let Err(e) = user.own(&self.paths.checkpoint_dir, true)
                    {
                        self.note(format!("cannot give the checkpoint to {}: {e}", user.name));
                    }
                }
                Ok(None) => self.note(format!(
                    "no checkpoint of rank {ck_rank} yet: starting fresh"
                )),
                Err(e) => {
                    self.note(format!(
                        "cannot restore the checkpoint ({e}); retrying in 2 s"
                    ));
                    self.restart_at = Some(Instant::now() + Duration::from_secs(2));
                    return;
                }
            }
            self.restored = Some(ck_rank);
        }
        let mut env = self.env(rank, world);
        if self.cfg.launcher == CommandLauncher::Torchrun {
            env.entry(torchrun::UNSHARED_STORE.0.into())
                .or_insert_with(|| torchrun::UNSHARED_STORE.1.into());
        }
        let setup =
            (!self.setup_done && !self.cfg.setup.is_empty()).then(|| self.cfg.setup.clone());
        let argv = match (self.cfg.launcher, &self.rendezvous) {
            (CommandLauncher::Plain, _) => self.cfg.run.clone(),
            (CommandLauncher::Torchrun, Some(rdzv)) => torchrun::argv(
                &self.cfg,
                &self.paths.torchrun_shim.display().to_string(),
                rdzv,
                self.reg.job_id.0,
                self.reg.training.min_workers,
            ),
            (CommandLauncher::Torchrun, None) => return,
        };
        let (cwd, log, tail, run_as) = (
            self.paths.workdir.clone(),
            self.paths.output_log.clone(),
            self.tail.clone(),
            self.run_as.clone(),
        );
        let _ = std::fs::remove_file(&self.paths.notice_file);
        let pgid = Arc::new(AtomicI32::new(0));
        let group = pgid.clone();
        self.note(format!("starting {:?} as rank {rank} of {world}", argv));
        self.next_upload = Instant::now() + Duration::from_secs(self.cfg.checkpoint_interval_secs);
        let task = tokio::spawn(async move {
            let launch = |argv: &[String], env: &BTreeMap<String, String>| {
                Running::start(Launch {
                    argv,
                    env,
                    run_as: run_as.as_ref(),
                    cwd: &cwd,
                    log: &log,
                    tail: tail.clone(),
                })
            };
            let failed = |e: AgentError, tail: &SharedTail| {
                tail.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .note(format!("cannot start: {e}"));
                Ended {
                    code: Some(127),
                    signal: None,
                }
            };
            let mut setup_done = setup.is_none();
            if let Some(setup) = setup {
                match launch(&setup, &env) {
                    Ok(mut r) => {
                        group.store(r.pgid(), Ordering::SeqCst);
                        let ended = r.wait().await;
                        group.store(0, Ordering::SeqCst);
                        if !ended.success() {
                            tail.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .note(format!("setup failed: {ended:?}"));
                            return RunEnd { ended, setup_done };
                        }
                        setup_done = true;
                    }
                    Err(e) => {
                        return RunEnd {
                            ended: failed(e, &tail),
                            setup_done,
                        };
                    }
                }
            }
            match launch(&argv, &env) {
                Ok(mut r) => {
                    group.store(r.pgid(), Ordering::SeqCst);
                    let ended = r.wait().await;
                    group.store(0, Ordering::SeqCst);
                    RunEnd { ended, setup_done }
                }
                Err(e) => RunEnd {
                    ended: failed(e, &tail),
                    setup_done,
                },
            }
        });
        self.run = Some(Run {
            task,
            pgid,
            rank: ck_rank,
            rendezvous: self.rendezvous.clone(),
        });
    }

    fn pgid(&self) -> i32 {
        self.run
            .as_ref()
            .map_or(0, |r| r.pgid.load(Ordering::SeqCst))
    }

    fn kill_now(&self) {
        program::signal_group(self.pgid(), libc::SIGKILL);
    }

    /// Writes the notice file (atomically, synced), then SIGTERMs the program's group: every
    /// path that stops a program comes through here, so no SIGTERM comes without its notice.
    async fn deliver_notice(&self, deadline_unix: i64, reason: &str) {
        let notice = serde_json::json!({
            "action": "terminate",
            "deadline": rfc3339(deadline_unix),
            "reason": reason,
        });
        let (path, text) = (self.paths.notice_file.clone(), notice.to_string());
        match tokio::task::spawn_blocking(move || write_atomic(&path, &text)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "cannot write the notice file"),
            Err(e) => tracing::error!(error = %e, "writing the notice file crashed"),
        }
        program::signal_group(self.pgid(), libc::SIGTERM);
        self.note(format!("notice delivered (SIGTERM): {notice}"));
    }

    /// The job's `grace_seconds`: how long a program Proteus stops has to save.
    fn grace(&self) -> Duration {
        Duration::from_secs(self.cfg.grace_seconds.max(1))
    }

    /// Stops the running program, if any: notice file, SIGTERM, SIGKILL after the job's
    /// `grace_seconds`; then uploads its checkpoint. Returns whether a program ran.
    async fn stop_program(&mut self, reason: &str) -> bool {
        if self.run.is_none() {
            return false;
        }
        let grace = self.grace();
        self.note(format!("stopping the program: {reason}"));
        let deadline = now_unix() + grace.as_secs().max(1) as i64;
        self.deliver_notice(deadline, reason).await;
        let Some(mut run) = self.run.take() else {
            return false;
        };
        if tokio::time::timeout(grace, &mut run.task).await.is_err() {
            self.note("still running at the end of its notice: SIGKILL");
            program::signal_group(run.pgid.load(Ordering::SeqCst), libc::SIGKILL);
            let _ = tokio::time::timeout(Duration::from_secs(5), &mut run.task).await;
        }
        self.final_upload(run.rank).await;
        true
    }

    async fn on_notice(&mut self, n: Notice) -> Option<Result<Outcome>> {
        let Notice::Interruption { action, time } = n else {
            if let Notice::Rebalance { notice_time } = n {
                self.event(AgentEvent::RebalanceRecommendation { notice_time })
                    .await;
            }
            return None;
        };
        let deadline = proteus_wire::time::parse_millis(&time)
            .ok()
            .map(|ms| ms.div_euclid(1000))
            .unwrap_or_else(|| now_unix() + 120);
        let left = Duration::from_secs((deadline - now_unix()).max(0) as u64);
        let margin = kill_margin(self.cfg.kill_margin_secs, left);
        self.deliver_notice(
            deadline,
            &format!("spot instance {action} notice for {time}"),
        )
        .await;
        self.leaving = Some(Leaving {
            kill_at: Instant::now() + left.saturating_sub(margin),
            exit_after: true,
        });
        self.restart_at = None;
        self.event(AgentEvent::InterruptionWarning {
            action,
            action_time: time,
        })
        .await;
        if self.run.is_none() {
            return Some(
                self.leave(ExitReason::Interrupted, Outcome::Interrupted)
                    .await,
            );
        }
        None
    }

    async fn on_tick(&mut self) {
        let p = read_progress(&self.paths.progress_file);
        if let Ok(mut shared) = self.progress.lock()
            && p.is_some()
        {
            shared.program = p;
        }
        let kill_at = self.leaving.as_ref().map(|l| l.kill_at).or(self.moving);
        if let Some(kill_at) = kill_at
            && self.run.is_some()
            && Instant::now() >= kill_at
            && self.pgid() > 0
        {
            self.note("still running at the kill margin: SIGKILL");
            self.kill_now();
        }
        if self.run.is_some() && Instant::now() >= self.next_upload {
            self.next_upload =
                Instant::now() + Duration::from_secs(self.cfg.checkpoint_interval_secs);
            if let (Ok(guard), Some(rank)) = (
                self.uploader.clone().try_lock_owned(),
                self.run.as_ref().map(|r| r.rank),
            ) {
                let (broker, me, dir, tail) = (
                    self.broker.clone(),
                    self.me.clone(),
                    self.paths.checkpoint_dir.clone(),
                    self.tail.clone(),
                );
                tokio::spawn(async move {
                    let _guard = guard;
                    match checkpoint::upload(&broker, &me, rank, &dir).await {
                        Ok(t) => tracing::info!(
                            bytes = t.bytes,
                            secs = t.secs,
                            "periodic checkpoint uploaded"
                        ),
                        Err(e) => tail
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .note(format!("periodic checkpoint upload failed: {e}")),
                    }
                });
            }
        }
        if self.run.is_none()
            && self.restart_at.is_some_and(|t| Instant::now() >= t)
            && self.leaving.is_none()
        {
            self.restart_at = None;
            self.start().await;
        }
    }

    /// The final upload of a run: waits for any periodic one, then sends the newest state.
    async fn final_upload(&self, rank: u32) {
        let _guard = self.uploader.lock().await;
        match checkpoint::upload(&self.broker, &self.me, rank, &self.paths.checkpoint_dir).await {
            Ok(t) => self.note(format!(
                "checkpoint uploaded: {} bytes in {:.2} s",
                t.bytes, t.secs
            )),
            Err(e) => self.note(format!("final checkpoint upload failed: {e}")),
        }
    }

    async fn on_end(&mut self, end: RunEnd, rank: u32) -> Option<Result<Outcome>> {
        self.setup_done |= end.setup_done;
        let ended = end.ended;
        self.note(format!("program ended: {ended:?}"));
        self.final_upload(rank).await;
        if self.moving.take().is_some() && self.leaving.is_none() {
            self.send_output().await;
            self.restart_at = self.slot.map(|_| Instant::now());
            return None;
        }
        let after_notice = self.leaving.is_some();
        let progress = read_progress(&self.paths.progress_file);
        let completes = ended.success()
            && !after_notice
            && match progress {
                Some(p) => p.done >= p.total,
                None => self.slot.is_some_and(|(r, _)| r == 0),
            };
        let idle_success = ended.success() && !completes && !after_notice && progress.is_none();
        // The program's last lines first: its exit may end the job, and the instance's token
        // with it.
        self.send_output().await;
        if !idle_success {
            self.event(AgentEvent::ProgramExited {
                code: ended.code,
                signal: ended.signal,
                after_notice,
                completes,
            })
            .await;
        }
        match self.leaving.take() {
            Some(l) if l.exit_after => {
                return Some(
                    self.leave(ExitReason::Interrupted, Outcome::Interrupted)
                        .await,
                );
            }
            Some(_) => {
                let _ = std::fs::remove_file(&self.paths.notice_file);
                if self.slot.is_some() {
                    self.restart_at = Some(Instant::now());
                }
            }
            None if completes || idle_success => self.finished = true,
            None => {
                self.note("the run failed; restarting in 1 s unless the job is over");
                self.restart_at = Some(Instant::now() + Duration::from_secs(1));
            }
        }
        None
    }

    async fn send_output(&mut self) {
        let (version, text) = {
            let t = self.tail.lock().unwrap_or_else(|e| e.into_inner());
            (t.version(), t.text())
        };
        if version == self.sent_version {
            return;
        }
        match self.broker.output(&self.me, text).await {
            Ok(()) => self.sent_version = version,
            Err(e) => tracing::debug!(error = %e, "cannot send the output tail"),
        }
    }

    /// Told to stop (a release, a scale-down, the job's end, a cancel): notice file, SIGTERM,
    /// SIGKILL after `grace_seconds`, upload, leave. The broker ends the instance once this
    /// agent has said it exits.
    async fn stop(&mut self, reason: &str) -> Result<Outcome> {
        self.stop_program(reason).await;
        self.leave(ExitReason::Stopped, Outcome::Stopped(reason.to_string()))
            .await
    }

    async fn leave(&mut self, reason: ExitReason, outcome: Outcome) -> Result<Outcome> {
        self.send_output().await;
        self.event(AgentEvent::Exit { reason }).await;
        tracing::info!(?outcome, "agent exiting");
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kill_margin_is_at_most_a_quarter_of_the_notice_given() {
        let m = |configured, left_secs| kill_margin(configured, Duration::from_secs(left_secs));
        // EC2's two minutes: the job's margin stands.
        assert_eq!(m(10, 120), Duration::from_secs(10));
        // A sped-up simulated cloud's 6 s: 1.5 s, not 10 (which left the program no time).
        assert_eq!(m(10, 6), Duration::from_millis(1500));
        // The sim cloud's default 20 s: 5 s, leaving a program 15 s to exit.
        assert_eq!(m(10, 20), Duration::from_secs(5));
        assert_eq!(m(0, 20), Duration::ZERO);
        assert_eq!(m(10, 0), Duration::ZERO);
    }

    #[test]
    fn the_notice_file_is_written_whole_and_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("notice.json");
        write_atomic(&f, r#"{"action":"terminate"}"#).unwrap();
        assert_eq!(
            std::fs::read_to_string(&f).unwrap(),
            r#"{"action":"terminate"}"#
        );
        write_atomic(&f, "{}").unwrap();
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "{}");
        assert!(!f.with_extension("tmp").exists(), "no temporary file left");
    }

    #[test]
    fn progress_files_that_are_not_progress_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("p.json");
        assert_eq!(read_progress(&f), None);
        std::fs::write(&f, r#"{"done": 3, "total": 12}"#).unwrap();
        assert_eq!(
            read_progress(&f),
            Some(ProgramProgress {
                done: 3.0,
                total: 12.0
            })
        );
        std::fs::write(&f, r#"{"done": 3, "to"#).unwrap();
        assert_eq!(read_progress(&f), None);
        std::fs::write(&f, r#"{"done": 3, "total": 0}"#).unwrap();
        assert_eq!(read_progress(&f), None);
    }
}
