//! A whole pipeline on this machine with every worker its own agent process
//! (`proteus-agent pipeline-worker`), talking over loopback TCP exactly as agents on different
//! machines do (optionally through the emulated slow links of [`crate::transport::TokenBucket`]).
//!
//! [`super::local`] runs the same workers as threads of one process; this module is what a
//! benchmark uses when the processes' own costs (scheduling, memory, message handling) must be
//! in the measurement.
//!
//! **The exchange**, one JSON line at a time over each worker's stdin and stdout:
//!
//! 1. the launcher writes [`Setup`] (the run's [`ProcessSpec`], the worker's number, the job's
//!    data secret — on stdin, so that it is in no process's arguments or environment — and a
//!    directory for the results);
//! 2. the worker loads its data, binds a loopback port and answers `{"addr": …}`;
//! 3. once every worker has answered, the launcher writes [`Go`] with every address, and the
//!    run starts;
//! 4. a worker that finished writes its outcome, its final layers and its checkpoints to the
//!    directory and answers `{"done": true}` (or `{"error": …}`); it keeps its endpoint up,
//!    so that late acknowledgements still flow, until the launcher closes its stdin, which the
//!    launcher does once every worker is done.
//!
//! Checkpoint times cross the process boundary as Unix time and are mapped back onto the
//! launcher's clock (one machine, one clock).

use super::stage::{self, AddressBook, Checkpoints, Inbox, RunConfig, StageCtx, StageOutcome};
use super::{Plan, StagePlan, schedule::ScheduleKind};
use crate::apps::mlp::{Dense, LrSchedule, MlpShape};
use crate::data::{self, ImageSet};
use crate::transport::{DataPlane, Peers, frame_bound};
use ndarray::{Array1, Array2};
use proteus_wire::agent_api::DataSecret;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The first argument that makes `proteus-agent` a pipeline worker of this module.
pub const WORKER_COMMAND: &str = "pipeline-worker";

/// Which data set the workers train on (each loads it from `data_dir`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataSet {
    Mnist,
    Digits,
}

impl DataSet {
    fn load(self, dir: &Path) -> crate::error::Result<ImageSet> {
        Ok(match self {
            DataSet::Mnist => data::load_mnist(dir)?.0,
            DataSet::Digits => data::load_digits(dir)?.0,
        })
    }
}

/// What every worker process of one run agrees on: a [`RunConfig`] without the tests' fault
/// injections (warnings, kills and joins are [`super::local`]'s), and where the data is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessSpec {
    pub data: DataSet,
    pub data_dir: PathBuf,
    /// Layer widths, input first.
    pub widths: Vec<usize>,
    pub stages: Vec<StagePlan>,
    pub predicted_secs: f64,
    pub schedule: ScheduleKind,
    /// Samples per minibatch and the seed of their shuffle.
    pub batch: usize,
    pub batch_seed: u64,
    pub minibatches: u64,
    pub lr: LrSchedule,
    pub momentum: f32,
    pub seed: u64,
    pub checkpoint_every: u64,
    pub snapshot_every: u64,
    pub allreduce_bucket_bytes: usize,
    pub vertical_sync: bool,
    /// Every connection's emulated link: bytes per second (both directions) and one-way
    /// latency in seconds.
    pub link: Option<(f64, f64)>,
}

impl ProcessSpec {
    /// The run's configuration over a training set of `train_len` samples.
    pub fn config(&self, train_len: usize) -> Result<RunConfig, ProcessError> {
        let (shape, plan) = self.shape_and_plan()?;
        let cfg = RunConfig {
            shape,
            plan,
            schedule: self.schedule,
            batches: stage::Batches::new(train_len, self.batch, self.batch_seed),
            minibatches: self.minibatches,
            lr: self.lr,
            momentum: self.momentum,
            seed: self.seed,
            checkpoint_every: self.checkpoint_every,
            replans: Default::default(),
            warn_at: None,
            drain_at: None,
            join_at: None,
            snapshot_every: self.snapshot_every,
            kill_at: None,
            allreduce_bucket_bytes: self.allreduce_bucket_bytes,
            vertical_sync: self.vertical_sync,
        };
        cfg.check()
            .map_err(|e| ProcessError::Spec(format!("run configuration: {e}")))?;
        Ok(cfg)
    }
}

impl ProcessSpec {
    fn shape_and_plan(&self) -> Result<(MlpShape, Plan), ProcessError> {
        let shape = MlpShape::new(self.widths.clone())
            .map_err(|e| ProcessError::Spec(format!("widths {:?}: {e}", self.widths)))?;
        let plan = Plan::new(self.stages.clone(), shape.layers(), self.predicted_secs)
            .map_err(|e| ProcessError::Spec(format!("plan: {e}")))?;
        Ok((shape, plan))
    }
}

/// Why a run of worker processes failed.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("the run's specification: {0}")]
    Spec(String),
    #[error("starting worker {worker} ({program}): {source}")]
    Spawn {
        worker: u32,
        program: String,
        source: std::io::Error,
    },
    #[error("worker {worker}: {what}")]
    Worker { worker: u32, what: String },
    #[error("the results directory {dir}: {source}")]
    Results { dir: String, source: std::io::Error },
}

/// The launcher's first line to a worker.
#[derive(Debug, Serialize, Deserialize)]
struct Setup {
    worker: u32,
    spec: ProcessSpec,
    secret: DataSecret,
    out_dir: PathBuf,
}

/// The launcher's second line: every worker's address, by number.
#[derive(Debug, Serialize, Deserialize)]
struct Go {
    addrs: Vec<String>,
}

/// A worker's lines to the launcher.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Said {
    Addr(String),
    /// Its stage ended at this Unix time (seconds); its results are written.
    Done(f64),
    Error(String),
}

/// A worker's results file (`worker-N.json`): its outcome without the layers, which are in
/// `worker-N.f32`, little-endian, in the order listed: the final layers, then every
/// checkpoint's. Written from a borrowed outcome, read into an owned one.
#[derive(Debug, Serialize, Deserialize)]
struct Results<O> {
    outcome: O,
    /// Rows and columns of each final layer's weights (its bias has `cols` values).
    final_layers: Vec<(usize, usize)>,
    checkpoints: Vec<CheckpointPart>,
}

#[derive(Debug, Serialize, Deserialize)]
struct CheckpointPart {
    minibatch: u64,
    layer: usize,
    at_unix_secs: f64,
    rows: usize,
    cols: usize,
}

/// How long a worker may take to load its data and answer with its address.
const SETUP_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `spec` with one `agent pipeline-worker` process per worker of its plan and returns
/// what [`super::local::run`] returns for the same run. Every worker process is stopped before
/// this returns, whatever happened.
pub fn run(agent: &Path, spec: &ProcessSpec) -> Result<super::local::LocalRun, ProcessError> {
    // Check the spec here, where the error is clearest (the workers check it again).
    let (shape, plan) = spec.shape_and_plan()?;
    let n = plan.workers();
    let out = tempfile_dir()?;
    let secret = DataSecret::from_bytes(rand::random());
    let mut workers = Workers(Vec::new());
    for w in 0..n {
        let mut child = Command::new(agent)
            .arg(WORKER_COMMAND)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| ProcessError::Spawn {
                worker: w,
                program: agent.display().to_string(),
                source,
            })?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().map(BufReader::new);
        workers.0.push(WorkerProc {
            child,
            stdin,
            stdout,
        });
        let setup = Setup {
            worker: w,
            spec: spec.clone(),
            secret: secret.clone(),
            out_dir: out.path.clone(),
        };
        workers.send(w, &setup)?;
    }
    let mut addrs = Vec::new();
    for w in 0..n {
        match workers.hear(w, SETUP_TIMEOUT)? {
            Said::Addr(a) => addrs.push(a),
            other => return Err(unexpected(w, &other)),
        }
    }
    let started = Instant::now();
    let started_unix = unix_secs(SystemTime::now());
    for w in 0..n {
        workers.send(
            w,
            &Go {
                addrs: addrs.clone(),
            },
        )?;
    }
    // A run has no deadline of its own; a worker that dies closes its stdout. Every worker is
    // heard at once, so that the first to fail ends the run (its peers may be waiting on it).
    let (tx, rx) = std::sync::mpsc::channel();
    for w in 0..n {
        let mut stdout = workers.take_stdout(w)?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut line = String::new();
            let said = match stdout.read_line(&mut line) {
                Ok(0) => Err("ended without answering (its stderr says why)".to_string()),
                Ok(_) => serde_json::from_str::<Said>(&line)
                    .map_err(|e| format!("unreadable answer {:?}: {e}", line.trim())),
                Err(e) => Err(format!("reading from it: {e}")),
            };
            let _ = tx.send((w, said));
        });
    }
    drop(tx);
    // The run's wall time ends when the last stage does, not when the last worker has
    // written its results (for data parallelism, hundreds of MB of checkpoints).
    let mut last_end = started_unix;
    for _ in 0..n {
        let failed = match rx.recv() {
            Ok((_, Ok(Said::Done(ended)))) => {
                last_end = last_end.max(ended);
                continue;
            }
            Ok((w, Ok(other))) => unexpected(w, &other),
            Ok((worker, Err(what))) => ProcessError::Worker { worker, what },
            Err(_) => ProcessError::Worker {
                worker: 0,
                what: "every worker's output closed".into(),
            },
        };
        // `workers` kills every process still running as it goes.
        return Err(failed);
    }
    let wall_secs = last_end - started_unix;
    workers.stop();
    let checkpoints = Checkpoints::new(shape.layers());
    let mut outcomes = Vec::new();
    for w in 0..n {
        let at = |unix: f64| started + Duration::from_secs_f64((unix - started_unix).max(0.0));
        outcomes.push(read_results(&out.path, w, &checkpoints, at)?);
    }
    Ok(super::local::LocalRun {
        outcomes,
        started,
        wall_secs,
        checkpoints,
    })
}

fn unexpected(worker: u32, said: &Said) -> ProcessError {
    let what = match said {
        Said::Error(e) => e.clone(),
        other => format!("said {other:?} out of turn"),
    };
    ProcessError::Worker { worker, what }
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A directory removed when dropped.
struct TempDir {
    path: PathBuf,
}

fn tempfile_dir() -> Result<TempDir, ProcessError> {
    let path = std::env::temp_dir().join(format!(
        "proteus-pipeline-{}-{:016x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir(&path).map_err(|source| ProcessError::Results {
        dir: path.display().to_string(),
        source,
    })?;
    Ok(TempDir { path })
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

struct WorkerProc {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Option<BufReader<ChildStdout>>,
}

/// The launcher's worker processes: killed when dropped, so that none outlives an error.
struct Workers(Vec<WorkerProc>);

impl Workers {
    fn send<T: Serialize>(&mut self, w: u32, msg: &T) -> Result<(), ProcessError> {
        let err = |what: String| ProcessError::Worker { worker: w, what };
        let p = self
            .0
            .get_mut(w as usize)
            .ok_or_else(|| err("no such worker".into()))?;
        let stdin = p.stdin.as_mut().ok_or_else(|| err("stdin closed".into()))?;
        let mut line = serde_json::to_vec(msg).map_err(|e| err(e.to_string()))?;
        line.push(b'\n');
        stdin
            .write_all(&line)
            .and_then(|()| stdin.flush())
            .map_err(|e| err(format!("writing to it: {e}")))
    }

    /// The worker's next line. The wait is bounded by `timeout` on a helper thread that kills
    /// the worker when it passes (a worker that hangs would otherwise hang the launcher).
    fn hear(&mut self, w: u32, timeout: Duration) -> Result<Said, ProcessError> {
        let err = |what: String| ProcessError::Worker { worker: w, what };
        let p = self
            .0
            .get_mut(w as usize)
            .ok_or_else(|| err("no such worker".into()))?;
        let stdout = p
            .stdout
            .as_mut()
            .ok_or_else(|| err("stdout closed".into()))?;
        let pid = p.child.id();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let watchdog = std::thread::spawn(move || {
            if rx.recv_timeout(timeout).is_err() {
                // SAFETY: kill(2) on our own child, not yet waited for (so its pid is still
                // ours); no memory is touched.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGKILL);
                }
            }
        });
        let mut line = String::new();
        let read = stdout.read_line(&mut line);
        let _ = tx.send(());
        let _ = watchdog.join();
        match read {
            Ok(0) => {
                let status = p.child.wait().map(|s| s.to_string()).unwrap_or_default();
                Err(err(format!(
                    "ended without answering ({status}; its stderr says why)"
                )))
            }
            Ok(_) => serde_json::from_str(&line)
                .map_err(|e| err(format!("unreadable answer {:?}: {e}", line.trim()))),
            Err(e) => Err(err(format!("reading from it: {e}"))),
        }
    }

    /// Worker `w`'s stdout, for reading on another thread.
    fn take_stdout(&mut self, w: u32) -> Result<BufReader<ChildStdout>, ProcessError> {
        self.0
            .get_mut(w as usize)
            .and_then(|p| p.stdout.take())
            .ok_or_else(|| ProcessError::Worker {
                worker: w,
                what: "stdout closed".into(),
            })
    }

    /// Closes every worker's stdin (its signal to exit) and waits for it.
    fn stop(&mut self) {
        for p in &mut self.0 {
            p.stdin.take();
        }
        for p in &mut self.0 {
            let _ = p.child.wait();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for p in &mut self.0 {
            p.stdin.take();
            if matches!(p.child.try_wait(), Ok(None)) {
                let _ = p.child.kill();
            }
            let _ = p.child.wait();
        }
    }
}

fn read_results(
    dir: &Path,
    w: u32,
    checkpoints: &Checkpoints,
    at: impl Fn(f64) -> Instant,
) -> Result<StageOutcome, ProcessError> {
    let err = |what: String| ProcessError::Worker { worker: w, what };
    let meta = dir.join(format!("worker-{w}.json"));
    let text = std::fs::read(&meta).map_err(|e| err(format!("{}: {e}", meta.display())))?;
    let r: Results<StageOutcome> =
        serde_json::from_slice(&text).map_err(|e| err(format!("{}: {e}", meta.display())))?;
    let bin = dir.join(format!("worker-{w}.f32"));
    let mut floats = std::io::BufReader::new(
        std::fs::File::open(&bin).map_err(|e| err(format!("{}: {e}", bin.display())))?,
    );
    let mut dense = |rows: usize, cols: usize| -> Result<Dense, ProcessError> {
        let mut take = |count: usize| -> Result<Vec<f32>, ProcessError> {
            let mut bytes = vec![0u8; count * 4];
            floats
                .read_exact(&mut bytes)
                .map_err(|e| err(format!("{}: {e}", bin.display())))?;
            Ok(bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let w = Array2::from_shape_vec((rows, cols), take(rows * cols)?)
            .map_err(|e| err(format!("{}: {e}", bin.display())))?;
        Ok(Dense {
            w,
            b: Array1::from_vec(take(cols)?),
        })
    };
    let mut layers = Vec::new();
    for &(rows, cols) in &r.final_layers {
        layers.push(dense(rows, cols)?);
    }
    for cp in &r.checkpoints {
        let d = dense(cp.rows, cp.cols)?;
        checkpoints.insert(cp.minibatch, cp.layer, at(cp.at_unix_secs), d);
    }
    let mut outcome = r.outcome;
    outcome.layers = layers;
    Ok(outcome)
}

/// `proteus-agent pipeline-worker`: one worker of a [`run`], driven over stdin and stdout.
pub fn worker_main() -> ExitCode {
    let mut stdin = std::io::stdin().lock();
    let mut say = |s: &Said| {
        let mut out = std::io::stdout().lock();
        let ok = serde_json::to_writer(&mut out, s).is_ok()
            && out.write_all(b"\n").is_ok()
            && out.flush().is_ok();
        if !ok {
            eprintln!("pipeline-worker: the launcher stopped listening");
        }
    };
    match worker(&mut stdin, &mut say) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pipeline-worker: {e}");
            say(&Said::Error(e));
            ExitCode::FAILURE
        }
    }
}

fn read_line<T: serde::de::DeserializeOwned>(
    input: &mut impl BufRead,
    what: &str,
) -> Result<T, String> {
    let mut line = String::new();
    match input.read_line(&mut line) {
        Ok(0) => Err(format!("the launcher closed stdin before the {what}")),
        Ok(_) => serde_json::from_str(&line).map_err(|e| format!("the {what}: {e}")),
        Err(e) => Err(format!("reading the {what}: {e}")),
    }
}

fn worker(input: &mut impl BufRead, say: &mut impl FnMut(&Said)) -> Result<(), String> {
    let setup: Setup = read_line(input, "setup")?;
    let w = setup.worker;
    let train = Arc::new(setup.spec.data.load(&setup.spec.data_dir).map_err(|e| {
        format!(
            "loading {:?} from {}: {e}",
            setup.spec.data,
            setup.spec.data_dir.display()
        )
    })?);
    let cfg = Arc::new(setup.spec.config(train.len()).map_err(|e| e.to_string())?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("a runtime: {e}"))?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .map_err(|e| format!("binding a loopback port: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("the bound address: {e}"))?
        .to_string();
    say(&Said::Addr(addr.clone()));
    let go: Go = read_line(input, "addresses")?;
    if go.addrs.get(w as usize) != Some(&addr) {
        return Err(format!(
            "the addresses do not list this worker ({addr}) as {w}"
        ));
    }
    let batch = train.len() / cfg.batches.per_epoch().max(1) as usize + 1;
    let link = setup.spec.link;
    let plane = DataPlane::new(
        setup.secret,
        frame_bound(cfg.shape.max_message_floats(batch), 1, 0),
    )
    .with_link_limit(link.map(|l| l.0))
    .with_link_latency(link.map(|l| Duration::from_secs_f64(l.1.max(0.0))));
    let checkpoints = Checkpoints::new(cfg.shape.layers());
    let result = rt.block_on({
        let checkpoints = checkpoints.clone();
        async move {
            let peers = Peers::new(addr, plane);
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            peers.set_handler(Arc::new(Inbox(tx)));
            tokio::spawn(peers.clone().serve(listener));
            let ctx = StageCtx {
                worker: w,
                addrs: AddressBook::new(go.addrs),
                peers,
                inbox: rx,
                train,
                cfg,
                checkpoints: Some(checkpoints),
                notices: None,
                steps: None,
                resumed: None,
            };
            stage::run(ctx).await
        }
    });
    let ended = unix_secs(SystemTime::now());
    let outcome = result.map_err(|e| format!("worker {w}: {e}"))?;
    write_results(&setup.out_dir, w, &outcome, &checkpoints)?;
    say(&Said::Done(ended));
    // Stay up, answering late messages, until the launcher says every worker is done.
    let mut rest = String::new();
    while matches!(input.read_line(&mut rest), Ok(n) if n > 0) {
        rest.clear();
    }
    drop(rt);
    Ok(())
}

fn write_results(
    dir: &Path,
    w: u32,
    o: &StageOutcome,
    checkpoints: &Checkpoints,
) -> Result<(), String> {
    let bin = dir.join(format!("worker-{w}.f32"));
    let file = std::fs::File::create(&bin).map_err(|e| format!("{}: {e}", bin.display()))?;
    let mut floats = std::io::BufWriter::new(file);
    let mut put = |d: &Dense| -> std::io::Result<()> {
        for v in d.w.iter().chain(d.b.iter()) {
            floats.write_all(&v.to_le_bytes())?;
        }
        Ok(())
    };
    let write_err = |e: std::io::Error| format!("{}: {e}", bin.display());
    for d in &o.layers {
        put(d).map_err(write_err)?;
    }
    let (now, now_unix) = (Instant::now(), unix_secs(SystemTime::now()));
    let mut parts = Vec::new();
    for (minibatch, layer, at, d) in checkpoints.records() {
        put(&d).map_err(write_err)?;
        parts.push(CheckpointPart {
            minibatch,
            layer,
            at_unix_secs: now_unix - now.duration_since(at).as_secs_f64(),
            rows: d.w.nrows(),
            cols: d.w.ncols(),
        });
    }
    floats.flush().map_err(write_err)?;
    let results = Results {
        outcome: o,
        final_layers: o
            .layers
            .iter()
            .map(|d| (d.w.nrows(), d.w.ncols()))
            .collect(),
        checkpoints: parts,
    };
    let meta = dir.join(format!("worker-{w}.json"));
    let text = serde_json::to_vec(&results).map_err(|e| e.to_string())?;
    std::fs::write(&meta, text).map_err(|e| format!("{}: {e}", meta.display()))
}
