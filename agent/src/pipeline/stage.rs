//! A stage replica at run time.
//!
//! [`StageCore`] is the synchronous part: the stage's layers, its current weights, the stash of
//! (weights, activations) per minibatch in flight, the older versions vertical sync keeps, the
//! gradient accumulator and the optimizer.
//! [`run`] drives it through the replica's schedule, receiving activations and gradients from its
//! neighbours, sending its own, and synchronising weights with its peer replicas (ring
//! all-reduce of the summed gradients, the same for the data-parallel baseline, which is one
//! stage of all layers replicated on every worker).

use super::schedule::{self, Op, ScheduleKind};
use super::{PipeMsg, Plan, Tensor};
use crate::apps::Partitioner;
use crate::apps::mlp::{self, Dense, LrSchedule, MlpShape, Sgd, Trace};
use crate::data::ImageSet;
use crate::transport::{Handler, Peers, Request, Response};
use ndarray::Array2;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// How long a stage waits for a message before it declares the pipeline broken.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(120);
/// A worker that has waited this long for a neighbour's activation or gradient asks whether the
/// neighbour is still there (a neighbour killed after its last send is noticed by nobody's
/// send).
const PROBE_AFTER: Duration = Duration::from_secs(1);
/// How long a probed neighbour has to answer; a slower one is not taken for lost.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// Why a stage failed.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("minibatch {0}: no forward pass stashed for this backward pass")]
    NotStashed(u64),
    #[error("minibatch {minibatch}: the stash already holds {capacity} versions (1F1B bound)")]
    StashFull { minibatch: u64, capacity: usize },
    #[error("minibatch {0}: a tensor of the wrong shape arrived")]
    Shape(u64),
    #[error("worker {0} is not in the plan")]
    NotInPlan(u32),
    #[error("waited {0:?} for {1}; the pipeline is broken")]
    Timeout(Duration, String),
    #[error("inbox closed")]
    InboxClosed,
    #[error("no plan for {0} workers to re-plan to")]
    NoPlan(u32),
    #[error("sending to worker {worker}: {message}")]
    Send { worker: u32, message: String },
    #[error("a backward pass failed: {0}")]
    Compute(String),
    #[error("minibatch {minibatch}: weight version {version} is not held (vertical sync)")]
    VersionGone { minibatch: u64, version: u64 },
    #[error("{0}")]
    Config(String),
    /// Worker `0` stopped answering (lost without warning).
    #[error("worker {0} was lost without warning")]
    PeerLost(u32),
    #[error(
        "worker {0} was lost without warning and no snapshot of every layer is held to restart from"
    )]
    NoSnapshot(u32),
    /// Tests: this worker stopped dead ([`RunConfig::kill_at`]).
    #[error("stopped dead")]
    Killed,
}

/// Which samples minibatch `m` holds: a seeded shuffle per epoch, the same on every worker.
#[derive(Debug, Clone)]
pub struct Batches {
    order: Partitioner,
    per_epoch: u64,
}

impl Batches {
    /// Minibatches of about `batch` samples over `n_items`.
    pub fn new(n_items: usize, batch: usize, seed: u64) -> Self {
        let per_epoch = (n_items / batch.max(1)).max(1) as u32;
        Batches {
            order: Partitioner::new(n_items, 1, per_epoch, seed),
            per_epoch: u64::from(per_epoch),
        }
    }
    pub fn per_epoch(&self) -> u64 {
        self.per_epoch
    }
    pub fn rows(&self, m: u64) -> Vec<u32> {
        self.order.batch(0, m)
    }
    pub fn epoch(&self, m: u64) -> u64 {
        m / self.per_epoch
    }
}

/// What every worker of one pipeline run agrees on.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub shape: MlpShape,
    pub plan: Plan,
    pub schedule: ScheduleKind,
    pub batches: Batches,
    pub minibatches: u64,
    pub lr: LrSchedule,
    pub momentum: f32,
    /// Seed of the initial weights.
    pub seed: u64,
    /// Record every stage's weights after minibatch `m` when `(m + 1) % checkpoint_every == 0`
    /// (0: never).
    pub checkpoint_every: u64,
    /// The plan for each smaller worker count (from [`super::partition::Partitioner`]), for
    /// re-planning when a worker is warned; a run without it cannot re-plan.
    pub replans: BTreeMap<u32, Plan>,
    /// Tests: warn original worker `w` when the leader reaches minibatch `m`.
    pub warn_at: Option<(u64, u32)>,
    /// Tests: the leader drains for original worker `w`'s warning at the first step whose drain
    /// point reaches minibatch `m`. A replay of a run whose leader logged that drain point
    /// (`drain_at`): the run then goes the same way whichever step its leader took the warning
    /// at, and so trains the same model.
    pub drain_at: Option<(u64, u32)>,
    /// Tests: fold in worker `w`, a standby outside the first plan (its address is in the
    /// address table, it waits for a [`PipeMsg::Grow`]), when the leader reaches minibatch `m`.
    pub join_at: Option<(u64, u32)>,
    /// Every stage's first replica sends its layers to the leader and the next member at the
    /// start of every segment and then every this many minibatches (rounded up to a multiple
    /// of the plan's step), so that the pipeline can restart without a worker lost without
    /// warning, from the newest snapshot of every layer. 0: no snapshots, and a lost worker
    /// ends the run.
    pub snapshot_every: u64,
    /// Tests: worker `w` stops dead, with no hand-over, when it reaches minibatch `m` (as a
    /// `kill -9` would stop it).
    pub kill_at: Option<(u64, u32)>,
    /// A replicated stage all-reduces its gradients in buckets of about this many bytes, each
    /// as soon as the backward pass has produced it, overlapping the rest of the backward pass
    /// (as PyTorch DDP does); 0: one all-reduce of everything after the backward pass.
    pub allreduce_bucket_bytes: usize,
    /// PipeDream's vertical sync (1F1B only): every stage runs minibatch `m` forward and
    /// backward on the weight version the input stage had when `m` entered the pipeline (for a
    /// replicated stage, its newest version with no more minibatches applied than that), so
    /// each minibatch sees one consistent model; stages keep the older versions it needs.
    pub vertical_sync: bool,
}

impl RunConfig {
    /// Combinations the runtime cannot run, with the reason.
    pub fn check(&self) -> Result<(), StageError> {
        if self.vertical_sync && self.schedule != ScheduleKind::OneFOneB {
            return Err(StageError::Config(
                "vertical sync applies to the 1F1B schedule only (flushing runs every stage on \
                 one version already; 2BW keeps two)"
                    .into(),
            ));
        }
        if let Some((_, w)) = self.join_at
            && w < self.plan.workers()
        {
            return Err(StageError::Config(format!(
                "worker {w} cannot join: it is in the first plan already"
            )));
        }
        if let ScheduleKind::TwoBW { group } = self.schedule {
            let need = schedule::two_bw_group(&self.plan);
            if group < need {
                return Err(StageError::Config(format!(
                    "a 2BW group of {group} minibatches is smaller than this plan needs for two \
                     weight versions per stage ({need})"
                )));
            }
        }
        Ok(())
    }
}

/// Gradient buckets of 1 MiB: PyTorch DDP's first bucket (its later ones are 25 MiB, for
/// models a hundred times larger than these).
pub const DEFAULT_BUCKET_BYTES: usize = 1 << 20;

/// At most this many buckets per step (they share a round number's low bits).
const MAX_BUCKETS: usize = 63;

/// Consecutive layer ranges of about `bytes` of parameters each, from the last layer back (the
/// order a backward pass produces them in); at most [`MAX_BUCKETS`].
pub fn buckets(layers: &[Dense], bytes: usize) -> Vec<std::ops::Range<usize>> {
    let n = layers.len();
    let total: usize = layers.iter().map(|l| l.len() * 4).sum();
    let bytes = bytes.max(total.div_ceil(MAX_BUCKETS)).max(1);
    let mut out = Vec::new();
    let (mut end, mut size) = (n, 0usize);
    for i in (0..n).rev() {
        size += layers[i].len() * 4;
        if size >= bytes || i == 0 {
            out.push(i..end);
            end = i;
            size = 0;
        }
    }
    out
}

/// How an optimizer step scales the summed gradients it applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepScale {
    /// The mean over every sample in the step: single-process SGD on their union (flushing).
    Mean,
    /// As many sequential steps' worth as the step has minibatches (1F1B): a stage replicated
    /// `r` times, whose replicas step together over `r` minibatches, moves as far per minibatch
    /// as a stage of one replica does (the sum of the minibatches' mean gradients, momentum
    /// `μ^r`; see [`Sgd::step_as`]), so a re-plan that changes replication does not change the
    /// optimisation; for data parallelism this is the linear scaling rule.
    SumOfMinibatchMeans,
}

/// One minibatch between its forward and its backward pass.
#[derive(Debug)]
struct Stashed {
    version: u64,
    weights: Arc<Vec<Dense>>,
    trace: Trace,
    /// Last stage: the loss gradient, computed with the forward pass.
    loss_grad: Option<Array2<f32>>,
}

/// A stage's layers, weights, stash and optimizer; no I/O.
#[derive(Debug)]
pub struct StageCore {
    ends_model: bool,
    starts_model: bool,
    weights: Arc<Vec<Dense>>,
    version: u64,
    stash: BTreeMap<u64, Stashed>,
    capacity: usize,
    opt: Sgd,
    acc: Vec<Dense>,
    acc_samples: usize,
    acc_minibatches: usize,
    /// Training loss and correct predictions summed over forward passes (last stage only).
    pub loss_sum: f64,
    pub correct: usize,
    pub samples: usize,
    /// Most weight versions the stash held at once.
    pub max_versions: usize,
    /// Older versions kept for vertical sync, oldest first (empty without it).
    history: std::collections::VecDeque<(u64, Arc<Vec<Dense>>)>,
    keep_history: bool,
    /// Most copies of the stage's weights alive at once: the current version, the versions
    /// stashed for backward passes and those kept for vertical sync (the weight memory a
    /// schedule costs, in units of the stage's parameters).
    pub max_weight_copies: usize,
}

impl StageCore {
    /// `layers` of the model, `capacity` minibatches in flight at most (warm-up + 1).
    pub fn new(
        layers: Vec<Dense>,
        starts_model: bool,
        ends_model: bool,
        capacity: usize,
        lr: LrSchedule,
        momentum: f32,
    ) -> Self {
        let opt = Sgd::new(&layers, lr, momentum);
        let acc = layers.iter().map(Dense::zeros_like).collect();
        StageCore {
            ends_model,
            starts_model,
            weights: Arc::new(layers),
            version: 0,
            stash: BTreeMap::new(),
            capacity: capacity.max(1),
            opt,
            acc,
            acc_samples: 0,
            acc_minibatches: 0,
            loss_sum: 0.0,
            correct: 0,
            samples: 0,
            max_versions: 0,
            history: std::collections::VecDeque::new(),
            keep_history: false,
            max_weight_copies: 1,
        }
    }

    /// Keep every version a later [`Self::forward_at`] may ask for (vertical sync).
    pub fn keep_versions(&mut self) {
        self.keep_history = true;
        self.history.push_back((self.version, self.weights.clone()));
    }

    fn count_copies(&mut self) {
        let mut v: Vec<u64> = self.stash.values().map(|s| s.version).collect();
        v.extend(self.history.iter().map(|h| h.0));
        v.push(self.version);
        v.sort_unstable();
        v.dedup();
        self.max_weight_copies = self.max_weight_copies.max(v.len());
    }

    pub fn weights(&self) -> &[Dense] {
        &self.weights
    }

    /// Number of optimizer steps taken.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The version minibatch `m`'s forward pass used, while it is stashed.
    pub fn stashed_version(&self, m: u64) -> Option<u64> {
        self.stash.get(&m).map(|s| s.version)
    }

    /// Forward pass of minibatch `m` with the current weights, stashing them. The last stage
    /// also computes the loss against `labels`. Returns the stage's output.
    pub fn forward(
        &mut self,
        m: u64,
        x: Array2<f32>,
        labels: Option<&[u8]>,
    ) -> Result<Array2<f32>, StageError> {
        let (version, weights) = (self.version, self.weights.clone());
        self.forward_with(m, x, labels, version, weights)
    }

    /// [`Self::forward`] with weight version `version`, kept since [`Self::keep_versions`];
    /// versions older than it are dropped (minibatches ask for versions in order).
    pub fn forward_at(
        &mut self,
        m: u64,
        x: Array2<f32>,
        labels: Option<&[u8]>,
        version: u64,
    ) -> Result<Array2<f32>, StageError> {
        self.release_before(version);
        let weights = match self.history.front() {
            Some((v, w)) if *v == version => w.clone(),
            _ => {
                return Err(StageError::VersionGone {
                    minibatch: m,
                    version,
                });
            }
        };
        self.forward_with(m, x, labels, version, weights)
    }

    /// Drop the versions kept for vertical sync that are older than `version` (no later
    /// forward pass asks for them).
    pub fn release_before(&mut self, version: u64) {
        while self.history.front().is_some_and(|h| h.0 < version) {
            self.history.pop_front();
        }
    }

    fn forward_with(
        &mut self,
        m: u64,
        x: Array2<f32>,
        labels: Option<&[u8]>,
        version: u64,
        weights: Arc<Vec<Dense>>,
    ) -> Result<Array2<f32>, StageError> {
        if self.stash.len() >= self.capacity {
            return Err(StageError::StashFull {
                minibatch: m,
                capacity: self.capacity,
            });
        }
        let w0 = self.weights.first().map_or(0, |l| l.w.nrows());
        if x.ncols() != w0 {
            return Err(StageError::Shape(m));
        }
        let trace = mlp::forward(&weights, x, self.ends_model);
        let out = trace.output.clone();
        let loss_grad = match (self.ends_model, labels) {
            (true, Some(y)) if y.len() == out.nrows() => {
                let (loss, correct, g) = mlp::softmax_xent(&out, y);
                self.loss_sum += loss;
                self.correct += correct;
                self.samples += y.len();
                Some(g)
            }
            (true, _) => return Err(StageError::Shape(m)),
            _ => None,
        };
        self.stash.insert(
            m,
            Stashed {
                version,
                weights,
                trace,
                loss_grad,
            },
        );
        let mut versions: Vec<u64> = self.stash.values().map(|s| s.version).collect();
        versions.sort_unstable();
        versions.dedup();
        self.max_versions = self.max_versions.max(versions.len());
        self.count_copies();
        Ok(out)
    }

    /// Backward pass of minibatch `m` with the weights its forward pass used; accumulates the
    /// parameter gradients and returns the gradient for the previous stage (none at the first).
    pub fn backward(
        &mut self,
        m: u64,
        grad_out: Option<Array2<f32>>,
    ) -> Result<Option<Array2<f32>>, StageError> {
        let st = self.stash.remove(&m).ok_or(StageError::NotStashed(m))?;
        let g = match (st.loss_grad, grad_out) {
            (Some(g), _) => g,
            (None, Some(g)) if g.raw_dim() == st.trace.output.raw_dim() => g,
            _ => return Err(StageError::Shape(m)),
        };
        let rows = g.nrows();
        let (grads, gin) = mlp::backward(
            &st.weights,
            &st.trace,
            g,
            self.ends_model,
            !self.starts_model,
        );
        mlp::add_into(&mut self.acc, &grads);
        self.acc_samples += rows;
        self.acc_minibatches += 1;
        Ok(gin)
    }

    /// Takes minibatch `m`'s backward pass out of the core, to run off the stage's task
    /// ([`DetachedBackward::run`]) while the gradients it has produced are being all-reduced.
    /// Counts its samples and minibatch like [`Self::backward`]; the parameter gradients are
    /// the caller's. Only when nothing is accumulated ([`Self::accumulating`] is false).
    pub fn detach_backward(
        &mut self,
        m: u64,
        grad_out: Option<Array2<f32>>,
    ) -> Result<DetachedBackward, StageError> {
        let st = self.stash.remove(&m).ok_or(StageError::NotStashed(m))?;
        let g = match (st.loss_grad, grad_out) {
            (Some(g), _) => g,
            (None, Some(g)) if g.raw_dim() == st.trace.output.raw_dim() => g,
            _ => return Err(StageError::Shape(m)),
        };
        self.acc_samples += g.nrows();
        self.acc_minibatches += 1;
        Ok(DetachedBackward {
            weights: st.weights,
            trace: st.trace,
            grad_out: g,
            ends_model: self.ends_model,
            input_grad: !self.starts_model,
        })
    }

    /// Whether gradients of earlier backward passes wait for a step.
    pub fn accumulating(&self) -> bool {
        self.acc_minibatches > 0
    }

    /// The sample and minibatch counts of the gradients taken out with
    /// [`Self::detach_backward`] (the last two entries of a flat vector); resets them.
    pub fn take_counts(&mut self) -> [f32; 2] {
        let counts = [self.acc_samples as f32, self.acc_minibatches as f32];
        self.acc_samples = 0;
        self.acc_minibatches = 0;
        counts
    }

    /// The accumulated gradient sums, then their sample count and minibatch count, as one flat
    /// vector (what replicas all-reduce); resets the accumulator.
    pub fn take_gradients(&mut self) -> Vec<f32> {
        let mut flat = mlp::flatten(&self.acc);
        flat.push(self.acc_samples as f32);
        flat.push(self.acc_minibatches as f32);
        for a in &mut self.acc {
            a.w.fill(0.0);
            a.b.fill(0.0);
        }
        self.acc_samples = 0;
        self.acc_minibatches = 0;
        flat
    }

    /// One optimizer step with a (possibly all-reduced) vector from [`Self::take_gradients`].
    pub fn apply(&mut self, flat: &[f32], epoch: u64, scale: StepScale) -> Result<(), StageError> {
        let [.., samples, minibatches] = flat else {
            return Err(StageError::Shape(0));
        };
        let grads = &flat[..flat.len() - 2];
        let grads = mlp::unflatten(&self.weights, grads).ok_or(StageError::Shape(0))?;
        // Copy-on-write: stashed minibatches keep the version they ran with.
        let w = Arc::make_mut(&mut self.weights);
        match scale {
            StepScale::Mean => self.opt.step(w, &grads, *samples, epoch),
            StepScale::SumOfMinibatchMeans => {
                // One step for `minibatches` minibatches: as many sequential steps' worth.
                let mb = minibatches.max(1.0);
                self.opt
                    .step_as(w, &grads, *samples / mb, epoch, mb.round() as u32)
            }
        }
        self.version += 1;
        if self.keep_history {
            self.history.push_back((self.version, self.weights.clone()));
        }
        self.count_copies();
        Ok(())
    }

    /// Weights, optimizer state and stash as they are (for hand-over).
    pub fn optimizer(&self) -> &Sgd {
        &self.opt
    }
}

/// A backward pass taken out of its [`StageCore`] (which keeps going with other minibatches'
/// messages meanwhile): the weights its forward pass used, its trace and output gradient.
#[derive(Debug)]
pub struct DetachedBackward {
    weights: Arc<Vec<Dense>>,
    trace: Trace,
    grad_out: Array2<f32>,
    ends_model: bool,
    input_grad: bool,
}

impl DetachedBackward {
    /// Computes it, handing each layer's gradient to `on_layer` as it is ready (last layer
    /// first); returns the gradient for the previous stage (none at the first).
    pub fn run(self, on_layer: impl FnMut(usize, Dense)) -> Option<Array2<f32>> {
        mlp::backward_each(
            &self.weights,
            &self.trace,
            self.grad_out,
            self.ends_model,
            self.input_grad,
            on_layer,
        )
    }
}

/// Per layer of one checkpoint: when its stage recorded it, and its weights.
type LayerSlots = Vec<Option<(Instant, Dense)>>;

/// Every layer's weights at checkpoints, with the time its stage recorded them, and the run's
/// re-planning events.
#[derive(Debug)]
pub struct Checkpoints {
    layers: usize,
    taken: Mutex<BTreeMap<u64, LayerSlots>>,
    events: Mutex<Vec<(Event, Instant)>>,
}

/// Moments of a re-plan, for measuring the pause it causes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The leader decided to drain because worker `evicted` was warned.
    Notice { evicted: u32, drain_at: u64 },
    /// The leader decided to drain to fold in worker `joined`.
    Join { joined: u32, drain_at: u64 },
    /// The first optimizer step of segment `segment` (training again on the new plan).
    Resumed { segment: u32 },
    /// Worker `worker` was lost without warning; the survivors restart from the snapshot at
    /// `restart_at`.
    Lost { worker: u32, restart_at: u64 },
}

/// A checkpoint every stage has recorded: the whole model after minibatch `minibatch`.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub minibatch: u64,
    /// When the last stage recorded it.
    pub at: Instant,
    pub layers: Vec<Dense>,
}

impl Checkpoints {
    pub fn new(layers: usize) -> Arc<Self> {
        Arc::new(Checkpoints {
            layers,
            taken: Mutex::new(BTreeMap::new()),
            events: Mutex::new(Vec::new()),
        })
    }

    fn record(&self, m: u64, first_layer: usize, layers: &[Dense]) {
        let now = Instant::now();
        if let Ok(mut t) = self.taken.lock() {
            let e = t.entry(m).or_insert_with(|| vec![None; self.layers]);
            for (i, l) in layers.iter().enumerate() {
                if let Some(slot) = e.get_mut(first_layer + i) {
                    *slot = Some((now, l.clone()));
                }
            }
        }
    }

    /// Every layer recorded, by checkpoint: minibatch, layer, when, weights (for moving a
    /// worker process's records to its launcher).
    pub fn records(&self) -> Vec<(u64, usize, Instant, Dense)> {
        let Ok(t) = self.taken.lock() else {
            return Vec::new();
        };
        t.iter()
            .flat_map(|(&m, slots)| {
                slots
                    .iter()
                    .enumerate()
                    .filter_map(move |(l, s)| s.as_ref().map(|(at, d)| (m, l, *at, d.clone())))
            })
            .collect()
    }

    /// Layer `layer`'s weights after minibatch `m`, recorded at `at` by another process; of
    /// two records of one layer (its stage's replicas), the later stays, as in [`Self::record`].
    pub fn insert(&self, m: u64, layer: usize, at: Instant, weights: Dense) {
        if let Ok(mut t) = self.taken.lock() {
            let e = t.entry(m).or_insert_with(|| vec![None; self.layers]);
            if let Some(slot) = e.get_mut(layer)
                && slot.as_ref().is_none_or(|(was, _)| *was <= at)
            {
                *slot = Some((at, weights));
            }
        }
    }

    fn event(&self, e: Event) {
        if let Ok(mut ev) = self.events.lock() {
            if matches!(e, Event::Resumed { .. }) && ev.iter().any(|x| x.0 == e) {
                return;
            }
            ev.push((e, Instant::now()));
        }
    }

    pub fn events(&self) -> Vec<(Event, Instant)> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// Complete checkpoints in minibatch order.
    pub fn complete(&self) -> Vec<Checkpoint> {
        let Ok(t) = self.taken.lock() else {
            return Vec::new();
        };
        t.iter()
            .filter(|(_, v)| v.iter().all(Option::is_some))
            .map(|(&m, v)| {
                let parts: Vec<&(Instant, Dense)> = v.iter().flatten().collect();
                Checkpoint {
                    minibatch: m,
                    at: parts.iter().map(|p| p.0).max().unwrap_or_else(Instant::now),
                    layers: parts.iter().map(|p| p.1.clone()).collect(),
                }
            })
            .collect()
    }
}

/// Interruption notices: the current leader (worker 0 of the current plan) takes them and
/// drains the pipeline for a re-plan. A local run shares one among its workers; an agent has its
/// own, for the one worker it runs.
#[derive(Debug, Default)]
pub struct Notices(Mutex<Vec<u32>>);

/// In [`Notices`]: the worker that reads them, whatever its number (an agent's worker learns
/// its number only when it is folded in).
const THIS_WORKER: u32 = u32::MAX;

impl Notices {
    /// Worker `worker` (by its number in the original plan) will be gone soon.
    pub fn warn(&self, worker: u32) {
        if let Ok(mut n) = self.0.lock() {
            n.push(worker);
        }
    }
    /// The worker reading these notices will be gone soon.
    pub fn warn_this_worker(&self) {
        self.warn(THIS_WORKER);
    }
    /// Whether a notice is waiting for worker `me` (or for this worker).
    pub fn is_warned(&self, me: u32) -> bool {
        self.0
            .lock()
            .is_ok_and(|n| n.iter().any(|&w| w == me || w == THIS_WORKER))
    }
    /// A notice for one of `members`, read by worker `me`.
    fn take(&self, me: u32, members: &[u32]) -> Option<u32> {
        let mut n = self.0.lock().ok()?;
        let of = |w: u32| if w == THIS_WORKER { me } else { w };
        let i = n.iter().position(|&w| members.contains(&of(w)))?;
        Some(of(n.remove(i)))
    }
}

/// Every worker's data address, by worker number. It grows when a worker joins: the leader
/// adds the newcomer, and every [`PipeMsg::Grow`] carries the leader's book to the others.
#[derive(Debug, Default)]
pub struct AddressBook(Mutex<Vec<String>>);

impl AddressBook {
    pub fn new(addrs: Vec<String>) -> Arc<AddressBook> {
        Arc::new(AddressBook(Mutex::new(addrs)))
    }
    pub fn get(&self, worker: u32) -> Option<String> {
        let book = self.0.lock().ok()?;
        book.get(worker as usize).filter(|a| !a.is_empty()).cloned()
    }
    pub fn len(&self) -> u32 {
        self.0.lock().map_or(0, |b| b.len() as u32)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn snapshot(&self) -> Vec<String> {
        self.0.lock().map(|b| b.clone()).unwrap_or_default()
    }
    /// A newcomer's number.
    fn add(&self, addr: String) -> u32 {
        match self.0.lock() {
            Ok(mut b) => {
                b.push(addr);
                b.len() as u32 - 1
            }
            Err(_) => u32::MAX,
        }
    }
    /// A leader's book: it only ever grows, so an older one changes nothing.
    fn adopt(&self, addrs: Vec<String>) {
        if let Ok(mut b) = self.0.lock()
            && addrs.len() >= b.len()
        {
            *b = addrs;
        }
    }
}

/// Routes pipeline messages arriving over the transport into a stage's inbox.
pub struct Inbox(pub mpsc::UnboundedSender<PipeMsg>);

impl Handler for Inbox {
    fn handle(self: Arc<Self>, req: Request) -> Pin<Box<dyn Future<Output = Response> + Send>> {
        Box::pin(async move {
            match req {
                Request::Opaque(payload) => receive(&self.0, &payload),
                _ => Response::Error("this worker runs a pipeline stage only".into()),
            }
        })
    }
}

/// Files the pipeline message an opaque request carries in `inbox`: [`Response::Ack`] once it
/// is there, [`Response::Busy`] when the stage is gone, [`Response::Error`] for bytes that are
/// no pipeline message.
pub(super) fn receive(inbox: &mpsc::UnboundedSender<PipeMsg>, payload: &[u8]) -> Response {
    match PipeMsg::from_payload(payload) {
        Ok(msg) => match inbox.send(msg) {
            Ok(()) => Response::Ack,
            Err(_) => Response::Busy,
        },
        Err(e) => Response::Error(e.to_string()),
    }
}

/// A layer's weights and momentum, flat.
type LayerState = (Vec<f32>, Vec<f32>);

/// A layer's snapshot while its pieces arrive (see [`PipeMsg::Snapshot`]).
#[derive(Debug)]
struct Pieces {
    total: u32,
    weights_len: u32,
    buf: Vec<f32>,
    /// Offsets of the pieces in, so that a piece sent again is not counted twice.
    offsets: std::collections::HashSet<u32>,
    filled: u64,
}

/// Floats per snapshot piece (16 KiB): an urgent frame waits at most this long behind one
/// on its link.
const SNAPSHOT_PIECE: usize = 4096;

/// Messages received ahead of when the schedule needs them.
struct Mailbox {
    rx: mpsc::UnboundedReceiver<PipeMsg>,
    /// The segment this worker runs (activations and gradients of others are stale).
    segment: u32,
    acts: HashMap<(u32, u64), Tensor>,
    grads: HashMap<(u32, u64), Tensor>,
    reduces: HashMap<(u64, u32), Vec<f32>>,
    states: HashMap<(u32, u32), (Vec<f32>, Vec<f32>)>,
    /// Drain orders by segment: where, and how the members change.
    drains: HashMap<u32, (u64, Change)>,
    /// Warnings forwarded to this worker as the leader.
    warns: Vec<u32>,
    /// Workers outside the pipeline ready to join, by address, oldest first (for whoever
    /// leads).
    readies: Vec<String>,
    /// Updated from every [`PipeMsg::Grow`].
    book: Arc<AddressBook>,
    /// To probe a neighbour that keeps this worker waiting.
    peers: Arc<Peers>,
    /// Layers' snapshots by the minibatch they were taken before (the newest complete one, and
    /// newer ones still arriving).
    snapshots: BTreeMap<u64, HashMap<u32, LayerState>>,
    /// Layers' snapshots whose pieces are still arriving, by (minibatch, layer).
    pieces: HashMap<(u64, u32), Pieces>,
    /// The model's layer count (a snapshot with every layer is complete).
    layers: usize,
    /// Workers lost without warning, by the segment they were lost in.
    lost: HashMap<u32, u32>,
    /// Restart orders by segment: (restart point, lost worker).
    restores: HashMap<u32, (u64, u32)>,
    /// Messages that are not the stage's (plan tables), kept for the caller.
    other: Vec<PipeMsg>,
}

/// How a re-plan changes the pipeline's members.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Change {
    /// This worker leaves (it was warned).
    Leave(u32),
    /// The members of the next plan, in plan order (a worker joins).
    Grow(Vec<u32>),
}

enum Want {
    Act(u64),
    Grad(u64),
    Reduce(u64, u32),
    State(u32, u32),
    /// A re-plan that folds in the standby at this address (a worker outside the pipeline).
    Join(String),
    /// The restart order after a worker of this segment was lost.
    Restore(u32),
}

enum Got {
    Tensor(Tensor),
    Chunk(Vec<f32>),
    State(Vec<f32>, Vec<f32>),
    /// A drain order arrived while waiting (interruptible waits only).
    Drain,
    /// (segment, drain point, members of the next plan).
    Join(u32, u64, Vec<u32>),
    /// (restart point, lost worker).
    Restore(u64, u32),
}

impl Mailbox {
    fn file(&mut self, msg: PipeMsg) -> bool {
        match msg {
            PipeMsg::Activation {
                segment,
                minibatch,
                tensor,
                ..
            } => {
                // One abandoned after a lost worker arrives late, and is dropped.
                if segment >= self.segment {
                    self.acts.insert((segment, minibatch), tensor);
                }
            }
            PipeMsg::Gradient {
                segment,
                minibatch,
                tensor,
                ..
            } => {
                if segment >= self.segment {
                    self.grads.insert((segment, minibatch), tensor);
                }
            }
            PipeMsg::Snapshot {
                at,
                layer,
                offset,
                total,
                weights_len,
                data,
            } => self.snapshot_piece(at, layer, offset, total, weights_len, data),
            PipeMsg::Lost { segment, worker } => {
                self.lost.entry(segment).or_insert(worker);
            }
            PipeMsg::Restore { segment, at, lost } => {
                self.restores.insert(segment, (at, lost));
            }
            PipeMsg::Ping => {}
            PipeMsg::Reduce {
                round, step, data, ..
            } => {
                self.reduces.insert((round, step), data);
            }
            PipeMsg::State {
                segment,
                layer,
                weights,
                velocity,
            } => {
                self.states.insert((segment, layer), (weights, velocity));
            }
            PipeMsg::Drain {
                segment,
                at,
                evicted,
            } => {
                self.drains.insert(segment, (at, Change::Leave(evicted)));
                return true;
            }
            PipeMsg::Grow {
                segment,
                at,
                members,
                addrs,
            } => {
                self.book.adopt(addrs);
                // Whoever leads next must not fold the newcomer in twice.
                if let Some(joined) = members.last().and_then(|&w| self.book.get(w)) {
                    self.readies.retain(|a| *a != joined);
                }
                self.drains.insert(segment, (at, Change::Grow(members)));
                return true;
            }
            PipeMsg::Warn { worker } => self.warns.push(worker),
            PipeMsg::Ready { addr } => {
                if !self.readies.contains(&addr) {
                    self.readies.push(addr);
                }
            }
            m @ PipeMsg::Plans { .. } => self.other.push(m),
        }
        false
    }

    /// File whatever has arrived, without waiting.
    fn poll(&mut self) {
        while let Ok(msg) = self.rx.try_recv() {
            self.file(msg);
        }
    }

    fn take(&mut self, w: &Want) -> Option<Got> {
        match *w {
            Want::Act(m) => self.acts.remove(&(self.segment, m)).map(Got::Tensor),
            Want::Grad(m) => self.grads.remove(&(self.segment, m)).map(Got::Tensor),
            Want::Restore(segment) => self
                .restores
                .get(&segment)
                .map(|&(at, lost)| Got::Restore(at, lost)),
            Want::Reduce(r, s) => self.reduces.remove(&(r, s)).map(Got::Chunk),
            Want::State(g, l) => self.states.remove(&(g, l)).map(|(w, v)| Got::State(w, v)),
            Want::Join(ref addr) => {
                self.drains
                    .iter()
                    .find_map(|(&segment, (at, change))| match change {
                        Change::Grow(members)
                            if members
                                .last()
                                .is_some_and(|&w| self.book.get(w).as_ref() == Some(addr)) =>
                        {
                            Some(Got::Join(segment, *at, members.clone()))
                        }
                        _ => None,
                    })
            }
        }
    }

    /// A worker lost in this worker's segment.
    fn lost_here(&self) -> Option<u32> {
        self.lost.get(&self.segment).copied()
    }

    /// File a piece of a layer's snapshot; the layer is filed once every piece is in. A piece
    /// that contradicts the others' sizes, or of a snapshot older than the newest complete
    /// one, is dropped.
    fn snapshot_piece(
        &mut self,
        at: u64,
        layer: u32,
        offset: u32,
        total: u32,
        weights_len: u32,
        data: Vec<f32>,
    ) {
        // Older than the newest complete snapshot, or a piece sent again after its layer was
        // filed (its acknowledgement was lost): nothing to keep.
        if self.newest_snapshot().is_some_and(|n| at < n)
            || self
                .snapshots
                .get(&at)
                .is_some_and(|l| l.contains_key(&layer))
        {
            return;
        }
        let p = self.pieces.entry((at, layer)).or_insert_with(|| Pieces {
            total,
            weights_len,
            buf: vec![0.0; total as usize],
            offsets: Default::default(),
            filled: 0,
        });
        let end = offset as usize + data.len();
        if p.total != total || p.weights_len != weights_len || end > p.buf.len() {
            tracing::warn!(
                at,
                layer,
                offset,
                total,
                "a snapshot piece that does not fit"
            );
            return;
        }
        if !p.offsets.insert(offset) {
            return;
        }
        p.buf[offset as usize..end].copy_from_slice(&data);
        p.filled += data.len() as u64;
        if p.filled < u64::from(p.total) {
            return;
        }
        let Some(mut p) = self.pieces.remove(&(at, layer)) else {
            return;
        };
        let velocity = p.buf.split_off(p.weights_len as usize);
        self.snapshot(at, layer, p.buf, velocity);
    }

    /// File a layer's snapshot; once one has every layer, older ones (and their pieces) go.
    fn snapshot(&mut self, at: u64, layer: u32, weights: Vec<f32>, velocity: Vec<f32>) {
        self.snapshots
            .entry(at)
            .or_default()
            .insert(layer, (weights, velocity));
        if let Some(newest) = self.newest_snapshot() {
            self.snapshots.retain(|&a, _| a >= newest);
            self.pieces.retain(|&(a, _), _| a >= newest);
        }
    }

    /// The newest snapshot that holds every layer.
    fn newest_snapshot(&self) -> Option<u64> {
        self.snapshots
            .iter()
            .rev()
            .find(|(_, l)| l.len() == self.layers)
            .map(|(&at, _)| at)
    }

    async fn wait(&mut self, w: Want, interruptible: bool) -> Result<Got, StageError> {
        self.wait_on(w, interruptible, None).await
    }

    /// [`Mailbox::wait`] for what worker `from` sends: once the wait has lasted
    /// [`PROBE_AFTER`], and again every as long, `from` is asked whether it is there; a worker
    /// that cannot be reached, or whose stage is gone, is lost (one that is slow to answer is
    /// not).
    async fn wait_on(
        &mut self,
        w: Want,
        interruptible: bool,
        from: Option<u32>,
    ) -> Result<Got, StageError> {
        let deadline = tokio::time::Instant::now() + MESSAGE_TIMEOUT;
        let mut probe_at = tokio::time::Instant::now() + PROBE_AFTER;
        loop {
            if let Some(x) = self.take(&w) {
                return Ok(x);
            }
            // Nothing of this segment's may come any more; the restart order still may.
            if let Some(lost) = self.lost_here()
                && !matches!(w, Want::Restore(_) | Want::State(..))
            {
                return Err(StageError::PeerLost(lost));
            }
            let until = match from {
                Some(_) => deadline.min(probe_at),
                None => deadline,
            };
            match tokio::time::timeout_at(until, self.rx.recv()).await {
                Ok(Some(msg)) => {
                    if self.file(msg) && interruptible {
                        return Ok(Got::Drain);
                    }
                }
                Ok(None) => return Err(StageError::InboxClosed),
                Err(_) if tokio::time::Instant::now() < deadline => {
                    let Some(peer) = from else { continue };
                    probe_at = tokio::time::Instant::now() + PROBE_AFTER;
                    let gone = match self.book.get(peer) {
                        None => true,
                        Some(addr) => match self
                            .peers
                            .call(&addr, &PipeMsg::Ping.to_request(), PROBE_TIMEOUT)
                            .await
                        {
                            Ok(Response::Ack) => false,
                            Ok(_) => true,
                            Err(e) => !e.to_string().contains("timed out"),
                        },
                    };
                    if gone {
                        self.lost.entry(self.segment).or_insert(peer);
                        return Err(StageError::PeerLost(peer));
                    }
                }
                Err(_) => {
                    let what = match w {
                        Want::Act(m) => format!("the activation of minibatch {m}"),
                        Want::Grad(m) => format!("the gradient of minibatch {m}"),
                        Want::Reduce(r, s) => format!("all-reduce round {r} step {s}"),
                        Want::State(g, l) => format!("layer {l}'s state for segment {g}"),
                        Want::Join(_) => "an invitation to join the pipeline".into(),
                        Want::Restore(g) => {
                            format!("the order to restart segment {g} after a lost worker")
                        }
                    };
                    return Err(StageError::Timeout(MESSAGE_TIMEOUT, what));
                }
            }
        }
    }

    async fn chunk(&mut self, round: u64, step: u32) -> Result<Vec<f32>, StageError> {
        match self.wait(Want::Reduce(round, step), false).await? {
            Got::Chunk(v) => Ok(v),
            _ => Err(StageError::InboxClosed),
        }
    }
}

/// A worker's place in a run.
pub struct StageCtx {
    /// This worker's number in the run's first plan (its identity across re-plans).
    pub worker: u32,
    /// Data address of every worker, by worker number. A standby (a worker outside the first
    /// plan, `worker ≥ plan.workers()`) is listed at its number until it is folded in; the
    /// [`PipeMsg::Grow`] that folds it in gives it its real number.
    pub addrs: Arc<AddressBook>,
    pub peers: Arc<Peers>,
    pub inbox: mpsc::UnboundedReceiver<PipeMsg>,
    pub train: Arc<ImageSet>,
    pub cfg: Arc<RunConfig>,
    pub checkpoints: Option<Arc<Checkpoints>>,
    pub notices: Option<Arc<Notices>>,
    /// Counts the optimizer steps this worker took, for progress reports.
    pub steps: Option<Arc<std::sync::atomic::AtomicU64>>,
    /// Where to say that training resumed after a re-plan (the agent reports it to the broker).
    pub resumed: Option<mpsc::UnboundedSender<crate::worker::WorkerEvent>>,
}

/// What a stage replica reports at the end (serialised without its layers, which a worker
/// process writes apart: [`super::processes`]).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct StageOutcome {
    pub worker: u32,
    /// Stage, replica and layers in the last segment this worker took part in.
    pub stage: usize,
    pub replica: u32,
    pub first_layer: usize,
    #[serde(skip)]
    pub layers: Vec<Dense>,
    /// The worker left after a warning (its state moved to the survivors).
    pub evicted: bool,
    /// Tests: the worker stopped dead ([`RunConfig::kill_at`]).
    pub lost: bool,
    /// Original worker numbers of the last plan's workers, in plan order (the first leads).
    pub final_members: Vec<u32>,
    pub loss_sum: f64,
    pub correct: usize,
    pub samples: usize,
    /// Minibatches whose loss this worker computed (as the last stage), in order.
    pub minibatches: Vec<u64>,
    pub max_versions: usize,
    /// Most copies of its stage's weights this worker held at once (current, stashed and kept
    /// for vertical sync): the weight memory its schedule costs.
    pub max_weight_copies: usize,
    /// Seconds spent computing (forward, backward, optimizer).
    pub compute_secs: f64,
    /// From the first operation to the last.
    pub wall_secs: f64,
    /// Every re-plan this worker trained again after, in order: the segment and its worker
    /// count (what the agent reports as `pipeline_resumed`).
    pub resumed: Vec<(u32, u32)>,
}

fn to_tensor(a: Array2<f32>) -> Tensor {
    let (rows, cols) = a.dim();
    let data = if a.is_standard_layout() {
        a.into_raw_vec_and_offset().0
    } else {
        a.iter().copied().collect()
    };
    Tensor {
        rows: rows as u32,
        cols: cols as u32,
        data,
    }
}

fn from_tensor(t: Tensor, m: u64) -> Result<Array2<f32>, StageError> {
    Array2::from_shape_vec((t.rows as usize, t.cols as usize), t.data)
        .map_err(|_| StageError::Shape(m))
}

/// Run `f` off the async threads (the runtime's other threads keep the transport going).
fn compute<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

struct Sender {
    me: u32,
    peers: Arc<Peers>,
    addrs: Arc<AddressBook>,
    tasks: JoinSet<Result<(), StageError>>,
    /// The segment sends belong to, and this worker's own inbox: a background send that fails
    /// files [`PipeMsg::Lost`] there, so that a worker waiting on the lost one learns of it.
    segment: u32,
    loopback: mpsc::UnboundedSender<PipeMsg>,
}

async fn deliver(
    peers: Arc<Peers>,
    addr: String,
    me: u32,
    to: u32,
    msg: PipeMsg,
) -> Result<(), StageError> {
    deliver_in(peers, addr, me, to, msg, false).await
}

/// [`deliver`], in the transport's background lane when `background`.
async fn deliver_in(
    peers: Arc<Peers>,
    addr: String,
    me: u32,
    to: u32,
    msg: PipeMsg,
    background: bool,
) -> Result<(), StageError> {
    let req = msg.to_request();
    let mut delay = Duration::from_millis(20);
    let mut last = String::new();
    for _ in 0..6 {
        let answer = if background {
            peers.call_background(&addr, &req, CALL_TIMEOUT).await
        } else {
            peers.call(&addr, &req, CALL_TIMEOUT).await
        };
        match answer {
            Ok(Response::Ack) => return Ok(()),
            Ok(other) => last = format!("answered {other:?}"),
            Err(e) => last = e.to_string(),
        }
        tracing::debug!(from = me, to, error = %last, "pipeline send failed; retrying");
        tokio::time::sleep(delay).await;
        delay *= 2;
    }
    Err(StageError::Send {
        worker: to,
        message: last,
    })
}

impl Sender {
    fn addr(&self, to: u32) -> Result<String, StageError> {
        self.addrs.get(to).ok_or(StageError::NotInPlan(to))
    }

    /// Send in the background (to worker `to`, by original number).
    fn send(&mut self, to: u32, msg: PipeMsg) -> Result<(), StageError> {
        let addr = self.addr(to)?;
        let (peers, me, segment) = (self.peers.clone(), self.me, self.segment);
        let loopback = self.loopback.clone();
        self.tasks.spawn(async move {
            let sent = deliver(peers, addr, me, to, msg).await;
            if sent.is_err() {
                let _ = loopback.send(PipeMsg::Lost {
                    segment,
                    worker: to,
                });
            }
            sent
        });
        // Surface failures of earlier sends without waiting for the others.
        while let Some(done) = self.tasks.try_join_next() {
            if let Ok(Err(e)) = done {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Send a snapshot piece in the background lane, best effort: one that does not arrive only leaves
    /// the restart point at an older snapshot. A keeper that has finished the run (it runs a
    /// later stage, and the last snapshot can be taken a step or two before the end) no
    /// longer takes it; that is no loss, and a keeper that is really lost is found by the
    /// data path. (Counted as a lost worker, such a send failed the run at its very end: a
    /// job whose clocks were all done stayed running.)
    fn send_snapshot(&mut self, to: u32, msg: PipeMsg) -> Result<(), StageError> {
        let addr = self.addr(to)?;
        let (peers, me) = (self.peers.clone(), self.me);
        self.tasks.spawn(async move {
            if let Err(e) = deliver_in(peers, addr, me, to, msg, true).await {
                tracing::warn!(to, error = %e, "a snapshot did not reach its keeper");
            }
            Ok(())
        });
        Ok(())
    }

    /// One attempt, best effort (news for a worker that may have stopped).
    async fn try_once(&self, to: u32, msg: &PipeMsg) {
        if let Some(addr) = self.addrs.get(to) {
            let _ = self
                .peers
                .call(&addr, &msg.to_request(), Duration::from_secs(5))
                .await;
        }
    }

    /// Send and wait for the receiver's acknowledgement.
    async fn send_now(&mut self, to: u32, msg: PipeMsg) -> Result<(), StageError> {
        let addr = self.addr(to)?;
        deliver(self.peers.clone(), addr, self.me, to, msg).await
    }

    async fn drain(&mut self) -> Result<(), StageError> {
        while let Some(done) = self.tasks.join_next().await {
            if let Ok(Err(e)) = done {
                return Err(e);
            }
        }
        Ok(())
    }
}

/// One plan's stretch of a run: minibatches `start..` on `members` (plan worker `i` is original
/// worker `members[i]`).
#[derive(Debug, Clone)]
struct Segment {
    index: u32,
    start: u64,
    plan: Plan,
    members: Vec<u32>,
}

impl Segment {
    fn physical(&self, plan_worker: u32) -> u32 {
        self.members[plan_worker as usize]
    }
}

enum SegmentEnd {
    Finished,
    Drained { at: u64, change: Change },
}

/// Totals across segments.
#[derive(Default)]
struct Totals {
    loss_sum: f64,
    correct: usize,
    samples: usize,
    minibatches: Vec<u64>,
    max_versions: usize,
    max_weight_copies: usize,
    busy: Duration,
    /// Drains not yet followed by a step (to report the pause when training resumes): the
    /// segment that trains next, and when this worker learnt of the drain before it. More
    /// than one when a segment is drained again before its first step (a newcomer ready just
    /// as a warned worker left): each segment still reports its own resumption.
    drained_at: Vec<(u32, Instant)>,
    /// Segments trained again after a re-plan, with their worker counts.
    resumed: Vec<(u32, u32)>,
}

/// Run worker `ctx.worker` through the whole run: its stage replica's schedule under the first
/// plan and, after every re-plan, under the next (see [`PipeMsg::Drain`]).
pub async fn run(ctx: StageCtx) -> Result<StageOutcome, StageError> {
    Ok(run_inner(ctx).await?.0)
}

/// What arrived for a worker besides its stage's traffic, with the inbox, after [`run`].
pub type Leftovers = (mpsc::UnboundedReceiver<PipeMsg>, Vec<PipeMsg>);

/// [`run`], giving back the inbox and whatever arrived that was not the stage's (final layers
/// for the leader, sent as `State` of segment `member::FINAL_SEGMENT`, and plan tables).
pub async fn run_keeping_inbox(ctx: StageCtx) -> Result<(StageOutcome, Leftovers), StageError> {
    let (o, mut mail) = run_inner(ctx).await?;
    let mut left = std::mem::take(&mut mail.other);
    for ((segment, layer), (weights, velocity)) in mail.states.drain() {
        left.push(PipeMsg::State {
            segment,
            layer,
            weights,
            velocity,
        });
    }
    Ok((o, (mail.rx, left)))
}

async fn run_inner(mut ctx: StageCtx) -> Result<(StageOutcome, Mailbox), StageError> {
    let cfg = ctx.cfg.clone();
    cfg.check()?;
    let n = cfg.plan.workers();
    let all = cfg.shape.init(cfg.seed);
    // The inbox, with this worker's own notes of failed sends merged in.
    let (loopback, merged) = mpsc::unbounded_channel();
    let mut inbox = std::mem::replace(&mut ctx.inbox, mpsc::unbounded_channel().1);
    let forward = loopback.clone();
    tokio::spawn(async move {
        while let Some(m) = inbox.recv().await {
            if forward.send(m).is_err() {
                return;
            }
        }
    });
    let mut mail = Mailbox {
        rx: merged,
        segment: 0,
        acts: HashMap::new(),
        grads: HashMap::new(),
        reduces: HashMap::new(),
        states: HashMap::new(),
        drains: HashMap::new(),
        warns: Vec::new(),
        readies: Vec::new(),
        book: ctx.addrs.clone(),
        peers: ctx.peers.clone(),
        snapshots: BTreeMap::new(),
        pieces: HashMap::new(),
        layers: cfg.shape.layers(),
        lost: HashMap::new(),
        restores: HashMap::new(),
        other: Vec::new(),
    };
    let mut out = Sender {
        me: ctx.worker,
        peers: ctx.peers.clone(),
        addrs: ctx.addrs.clone(),
        tasks: JoinSet::new(),
        segment: 0,
        loopback,
    };
    let started = Instant::now();
    let mut totals = Totals::default();
    let (mut seg, mut layers, mut velocity) = if ctx.worker < n {
        let seg = Segment {
            index: 0,
            start: 0,
            plan: cfg.plan.clone(),
            members: (0..n).collect(),
        };
        let (s0, _) = seg
            .plan
            .role(ctx.worker)
            .ok_or(StageError::NotInPlan(ctx.worker))?;
        let layers = all[seg.plan.stages()[s0].layers.clone()].to_vec();
        let velocity = layers.iter().map(Dense::zeros_like).collect();
        (seg, layers, velocity)
    } else {
        // A worker outside the first plan waits to be folded in, then takes over its layers
        // under the number the leader gave it (the last of the new members).
        let addr = ctx
            .addrs
            .get(ctx.worker)
            .ok_or(StageError::NotInPlan(ctx.worker))?;
        let Got::Join(segment, at, members) = mail.wait(Want::Join(addr), false).await? else {
            return Err(StageError::InboxClosed);
        };
        ctx.worker = members.last().copied().unwrap_or(ctx.worker);
        out.me = ctx.worker;
        totals.drained_at.push((segment + 1, Instant::now()));
        let next = Segment {
            index: segment + 1,
            start: at,
            plan: plan_for(&cfg, members.len() as u32)?,
            members,
        };
        let (layers, velocity) = take_over(&mut mail, &next, ctx.worker, &all).await?;
        tracing::info!(worker = ctx.worker, segment = next.index, from = at, plan = %next.plan, "joined the pipeline");
        (next, layers, velocity)
    };
    loop {
        let me = seg
            .members
            .iter()
            .position(|&w| w == ctx.worker)
            .ok_or(StageError::NotInPlan(ctx.worker))? as u32;
        let (s, k) = seg.plan.role(me).ok_or(StageError::NotInPlan(ctx.worker))?;
        let first_layer = seg.plan.stages()[s].layers.start;
        let ran = run_segment(
            &ctx,
            &seg,
            me,
            layers,
            velocity,
            &mut mail,
            &mut out,
            &mut totals,
        )
        .await;
        let (end, core) = match ran {
            Ok(ran) => ran,
            Err(StageError::Killed) => {
                tracing::warn!(worker = ctx.worker, "stopped dead (test)");
                let mut o = outcome(
                    &ctx,
                    s,
                    k,
                    first_layer,
                    Vec::new(),
                    false,
                    seg.members.clone(),
                    totals,
                    started,
                );
                o.lost = true;
                return Ok((o, mail));
            }
            Err(e) => {
                // A worker of this segment lost without warning: restart without it from the
                // newest snapshot, when snapshots are taken.
                let lost = match e {
                    StageError::PeerLost(w) => w,
                    StageError::Send { worker, .. }
                        if worker != ctx.worker && seg.members.contains(&worker) =>
                    {
                        worker
                    }
                    e => return Err(e),
                };
                // Sends of the abandoned segment are dropped, and the others hear of the loss
                // (a worker that waits on the lost one would not notice by itself).
                out.tasks = JoinSet::new();
                mail.lost.entry(seg.index).or_insert(lost);
                let heard = PipeMsg::Lost {
                    segment: seg.index,
                    worker: lost,
                };
                for &w in seg
                    .members
                    .iter()
                    .filter(|&&w| w != lost && w != ctx.worker)
                {
                    out.try_once(w, &heard).await;
                }
                if cfg.snapshot_every == 0 || seg.members.len() < 2 {
                    return Err(StageError::PeerLost(lost));
                }
                let (next, l, v) =
                    restart_without(&ctx, &seg, lost, &mut mail, &mut out, &mut totals, &all)
                        .await?;
                (layers, velocity) = (l, v);
                seg = next;
                continue;
            }
        };
        layers = core.weights().to_vec();
        velocity = core.optimizer().velocity.clone();
        totals.max_versions = totals.max_versions.max(core.max_versions);
        totals.max_weight_copies = totals.max_weight_copies.max(core.max_weight_copies);
        let (at, change) = match end {
            SegmentEnd::Finished => {
                out.drain().await?;
                let members = seg.members.clone();
                let o = outcome(
                    &ctx,
                    s,
                    k,
                    first_layer,
                    layers,
                    false,
                    members,
                    totals,
                    started,
                );
                return Ok((o, mail));
            }
            SegmentEnd::Drained { at, change } => (at, change),
        };
        // Re-plan for the new members: a lookup in the partitioner's table.
        let members: Vec<u32> = match &change {
            Change::Leave(evicted) => seg
                .members
                .iter()
                .copied()
                .filter(|w| w != evicted)
                .collect(),
            Change::Grow(members) => members.clone(),
        };
        let next = Segment {
            index: seg.index + 1,
            start: at,
            plan: plan_for(&cfg, members.len() as u32)?,
            members,
        };
        // Replica 0 of every stage hands its layers (weights and momentum) to every replica of
        // the stage that owns them under the new plan.
        if k == 0 {
            for (i, l) in layers.iter().enumerate() {
                let layer = first_layer + i;
                let Some(ns) = next
                    .plan
                    .stages()
                    .iter()
                    .position(|st| st.layers.contains(&layer))
                else {
                    continue;
                };
                for rep in 0..next.plan.stages()[ns].replicas {
                    let to = next.physical(next.plan.first_worker(ns) + rep);
                    let msg = PipeMsg::State {
                        segment: next.index,
                        layer: layer as u32,
                        weights: mlp::flatten(std::slice::from_ref(l)),
                        velocity: mlp::flatten(std::slice::from_ref(&velocity[i])),
                    };
                    out.send(to, msg)?;
                }
            }
        }
        out.drain().await?;
        if change == Change::Leave(ctx.worker) {
            tracing::info!(
                worker = ctx.worker,
                "state handed over; leaving the pipeline"
            );
            let members = next.members.clone();
            let o = outcome(
                &ctx,
                s,
                k,
                first_layer,
                layers,
                true,
                members,
                totals,
                started,
            );
            return Ok((o, mail));
        }
        (layers, velocity) = take_over(&mut mail, &next, ctx.worker, &all).await?;
        tracing::info!(worker = ctx.worker, segment = next.index, from = at, plan = %next.plan, "re-planned");
        seg = next;
    }
}

/// After worker `lost` stopped answering in `seg` (and the others were told): agree on the restart point
/// (the first surviving member decides: its newest snapshot of every layer), and take over this
/// worker's layers of the plan for the survivors from that snapshot. Minibatches from the
/// restart point on are computed again.
async fn restart_without(
    ctx: &StageCtx,
    seg: &Segment,
    lost: u32,
    mail: &mut Mailbox,
    out: &mut Sender,
    totals: &mut Totals,
    all: &[Dense],
) -> Result<(Segment, Vec<Dense>, Vec<Dense>), StageError> {
    let cfg = &ctx.cfg;
    tracing::warn!(
        worker = ctx.worker,
        lost,
        segment = seg.index,
        "a worker was lost without warning: restarting from the newest snapshot"
    );
    let survivors: Vec<u32> = seg.members.iter().copied().filter(|&w| w != lost).collect();
    let first = survivors
        .first()
        .copied()
        .ok_or(StageError::NoSnapshot(lost))?;
    let at = if first == ctx.worker {
        let at = mail.newest_snapshot().ok_or(StageError::NoSnapshot(lost))?;
        for &w in survivors.iter().filter(|&&w| w != ctx.worker) {
            out.send_now(
                w,
                PipeMsg::Restore {
                    segment: seg.index,
                    at,
                    lost,
                },
            )
            .await?;
        }
        if let Some(cp) = &ctx.checkpoints {
            cp.event(Event::Lost {
                worker: lost,
                restart_at: at,
            });
        }
        at
    } else {
        match mail.wait(Want::Restore(seg.index), false).await? {
            Got::Restore(at, theirs) if theirs == lost => at,
            // Two losses at once (or two workers that name different ones): not recoverable.
            Got::Restore(_, theirs) => return Err(StageError::PeerLost(theirs)),
            _ => return Err(StageError::InboxClosed),
        }
    };
    totals.drained_at.push((seg.index + 1, Instant::now()));
    totals.minibatches.retain(|&m| m < at);
    let next = Segment {
        index: seg.index + 1,
        start: at,
        plan: plan_for(cfg, survivors.len() as u32)?,
        members: survivors,
    };
    if first == ctx.worker {
        // Every layer of the snapshot to every replica of the stage that owns it now.
        let snapshot = mail.snapshots.get(&at).cloned().unwrap_or_default();
        for (layer, (weights, velocity)) in snapshot {
            let Some(ns) = next
                .plan
                .stages()
                .iter()
                .position(|st| st.layers.contains(&(layer as usize)))
            else {
                continue;
            };
            for rep in 0..next.plan.stages()[ns].replicas {
                let to = next.physical(next.plan.first_worker(ns) + rep);
                let msg = PipeMsg::State {
                    segment: next.index,
                    layer,
                    weights: weights.clone(),
                    velocity: velocity.clone(),
                };
                if to == ctx.worker {
                    mail.file(msg);
                } else {
                    out.send(to, msg)?;
                }
            }
        }
        out.drain().await?;
    }
    let (layers, velocity) = take_over(mail, &next, ctx.worker, all).await?;
    tracing::info!(worker = ctx.worker, segment = next.index, from = at, plan = %next.plan, "restarted without the lost worker");
    Ok((next, layers, velocity))
}

/// The plan for `workers` workers: the run's first, or one of its re-plans.
fn plan_for(cfg: &RunConfig, workers: u32) -> Result<Plan, StageError> {
    if workers == cfg.plan.workers() {
        return Ok(cfg.plan.clone());
    }
    cfg.replans
        .get(&workers)
        .cloned()
        .ok_or(StageError::NoPlan(workers))
}

/// The layers (weights and momentum) worker `worker` owns in segment `next`, as their previous
/// owners hand them over.
async fn take_over(
    mail: &mut Mailbox,
    next: &Segment,
    worker: u32,
    all: &[Dense],
) -> Result<(Vec<Dense>, Vec<Dense>), StageError> {
    let me = next
        .members
        .iter()
        .position(|&w| w == worker)
        .ok_or(StageError::NotInPlan(worker))? as u32;
    let (ns, _) = next.plan.role(me).ok_or(StageError::NotInPlan(worker))?;
    let (mut layers, mut velocity) = (Vec::new(), Vec::new());
    for layer in next.plan.stages()[ns].layers.clone() {
        let like = std::slice::from_ref(&all[layer]);
        match mail
            .wait(Want::State(next.index, layer as u32), false)
            .await?
        {
            Got::State(w, v) => {
                let w = mlp::unflatten(like, &w).ok_or(StageError::Shape(next.start))?;
                let v = mlp::unflatten(like, &v).ok_or(StageError::Shape(next.start))?;
                layers.extend(w);
                velocity.extend(v);
            }
            _ => return Err(StageError::InboxClosed),
        }
    }
    Ok((layers, velocity))
}

#[allow(clippy::too_many_arguments)]
fn outcome(
    ctx: &StageCtx,
    stage: usize,
    replica: u32,
    first_layer: usize,
    layers: Vec<Dense>,
    evicted: bool,
    final_members: Vec<u32>,
    t: Totals,
    started: Instant,
) -> StageOutcome {
    StageOutcome {
        worker: ctx.worker,
        stage,
        replica,
        first_layer,
        layers,
        evicted,
        lost: false,
        final_members,
        loss_sum: t.loss_sum,
        correct: t.correct,
        samples: t.samples,
        minibatches: t.minibatches,
        max_versions: t.max_versions,
        max_weight_copies: t.max_weight_copies,
        compute_secs: t.busy.as_secs_f64(),
        wall_secs: started.elapsed().as_secs_f64(),
        resumed: t.resumed,
    }
}

/// Run one segment's schedule from its start; stops early when drained for a re-plan.
#[allow(clippy::too_many_arguments)]
async fn run_segment(
    ctx: &StageCtx,
    seg: &Segment,
    me: u32,
    layers: Vec<Dense>,
    velocity: Vec<Dense>,
    mail: &mut Mailbox,
    out: &mut Sender,
    totals: &mut Totals,
) -> Result<(SegmentEnd, StageCore), StageError> {
    let cfg = &ctx.cfg;
    let plan = &seg.plan;
    let (s, k) = plan.role(me).ok_or(StageError::NotInPlan(ctx.worker))?;
    let sp = plan.stages()[s].clone();
    let (first, last) = (s == 0, s + 1 == plan.stages().len());
    let r = sp.replicas;
    let warm = schedule::warmup(plan.workers_from(s), r);
    // 2BW's group is the run's, or larger when this segment's plan needs it for two versions per
    // stage (and a replica in every group): a plan grown by a join may.
    let kind = match cfg.schedule {
        ScheduleKind::TwoBW { group } => ScheduleKind::TwoBW {
            group: group.max(schedule::two_bw_group(plan)),
        },
        other => other,
    };
    let capacity = match kind {
        ScheduleKind::OneFOneB | ScheduleKind::TwoBW { .. } => warm + 1,
        ScheduleKind::Flushing { group } => group as usize,
    };
    let mut core = StageCore::new(layers, first, last, capacity, cfg.lr, cfg.momentum);
    core.opt.velocity = velocity;
    mail.segment = seg.index;
    out.segment = seg.index;
    mail.acts.retain(|&(g, _), _| g >= seg.index);
    mail.grads.retain(|&(g, _), _| g >= seg.index);
    // Snapshots for restarting without a worker lost without warning: at the segment's start
    // and every `every` minibatches, a multiple of every stage's step.
    let every = match kind {
        ScheduleKind::OneFOneB => plan
            .stages()
            .iter()
            .fold(1u64, |l, st| lcm(l, u64::from(st.replicas))),
        ScheduleKind::Flushing { group } | ScheduleKind::TwoBW { group } => group.max(1),
    };
    let every = cfg.snapshot_every.div_ceil(every) * every;
    let keepers: Vec<u32> = seg.members.iter().copied().take(2).collect();
    let snapshot = |core: &StageCore, at: u64, mail: &mut Mailbox, out: &mut Sender| {
        for (i, (w, v)) in core
            .weights()
            .iter()
            .zip(&core.optimizer().velocity)
            .enumerate()
        {
            let layer = (sp.layers.start + i) as u32;
            let mut data = mlp::flatten(std::slice::from_ref(w));
            let weights_len = data.len() as u32;
            data.extend(mlp::flatten(std::slice::from_ref(v)));
            let total = data.len() as u32;
            let piece = |offset: usize, data: &[f32]| PipeMsg::Snapshot {
                at,
                layer,
                offset: offset as u32,
                total,
                weights_len,
                data: data.to_vec(),
            };
            for &to in &keepers {
                if to == ctx.worker {
                    mail.file(piece(0, &data));
                } else {
                    for (n, chunk) in data.chunks(SNAPSHOT_PIECE).enumerate() {
                        out.send_snapshot(to, piece(n * SNAPSHOT_PIECE, chunk))?;
                    }
                }
            }
        }
        Ok::<(), StageError>(())
    };
    if every > 0 && k == 0 {
        snapshot(&core, seg.start, mail, out)?;
    }
    // Vertical sync: the input stage's version when minibatch `rel` (of this segment) entered,
    // as the minibatches it had applied: its replica ran `rel / r0` forward passes before and
    // stepped after each backward pass past its warm-up.
    let r0 = u64::from(plan.stages()[0].replicas);
    let warm0 = schedule::warmup(plan.workers(), plan.stages()[0].replicas) as u64;
    let entered_with = |rel: u64| (rel / r0).saturating_sub(warm0) * r0;
    if cfg.vertical_sync && !first {
        core.keep_versions();
    }
    let left = cfg.minibatches.saturating_sub(seg.start);
    let later = plan.workers_from(s);
    let mut ops = schedule::ops(kind, left, r, k, later);
    let ring_next = seg.physical(plan.first_worker(s) + (k + 1) % r);
    let leader = me == 0;
    let mut drain: Option<(u64, Change)> = None;
    let mut round = 0u64;
    let round_base = u64::from(seg.index) << 40;
    let last_epoch = cfg.batches.epoch(cfg.minibatches.saturating_sub(1));
    // Replicas of a stage all-reduce in buckets, overlapped with the backward pass where
    // there is one.
    let bucketed =
        r > 1 && cfg.allreduce_bucket_bytes > 0 && matches!(kind, ScheduleKind::OneFOneB);
    let layer_buckets = buckets(core.weights(), cfg.allreduce_bucket_bytes);
    // The step's gradients when the backward pass all-reduced them already.
    let mut reduced: Option<Vec<f32>> = None;
    let mut pc = 0usize;
    while pc < ops.len() {
        mail.poll();
        if let Some(lost) = mail.lost_here() {
            return Err(StageError::PeerLost(lost));
        }
        if let (Some((m, w)), Op::Forward(rel) | Op::Backward(rel)) = (cfg.kill_at, ops[pc])
            && w == ctx.worker
            && seg.start + rel >= m
        {
            return Err(StageError::Killed);
        }
        if drain.is_none()
            && let Some((at, change)) = mail.drains.get(&seg.index).cloned()
        {
            drain = Some((at, change));
            totals.drained_at.push((seg.index + 1, Instant::now()));
            ops = schedule::ops(kind, at - seg.start, r, k, later);
            continue;
        }
        let op = ops[pc];
        // A warned worker that does not lead tells the leader.
        if !leader
            && drain.is_none()
            && let Some(w) = ctx
                .notices
                .as_ref()
                .and_then(|n| n.take(ctx.worker, &[ctx.worker]))
        {
            out.send(seg.physical(0), PipeMsg::Warn { worker: w })?;
        }
        // The leader turns a warning, or a worker ready to join, into a drain point no replica
        // has admitted yet.
        if leader && drain.is_none() {
            // A worker joins when a test says so, or when a newcomer said it is ready (then it
            // is numbered after every worker in the address book) and a plan has room for it.
            let grown = |w: u32| {
                let mut members = seg.members.clone();
                members.push(w);
                Change::Grow(members)
            };
            let joining = match (cfg.join_at, op) {
                (Some((m, w)), Op::Forward(rel))
                    if seg.start + rel >= m && !seg.members.contains(&w) =>
                {
                    Some((grown(w), None))
                }
                (_, Op::Forward(_)) => {
                    let member_at = |a: &String| {
                        seg.members
                            .iter()
                            .any(|&w| ctx.addrs.get(w).as_ref() == Some(a))
                    };
                    mail.readies.retain(|a| !member_at(a));
                    let room = plan_for(cfg, seg.members.len() as u32 + 1).is_ok();
                    match mail.readies.first() {
                        Some(a) if room => Some((grown(ctx.addrs.len()), Some(a.clone()))),
                        _ => None,
                    }
                }
                _ => None,
            };
            // A warning is taken only when no join is being handled at this step: taking it
            // would consume it unhandled.
            // The first minibatch no replica has admitted yet, were the pipeline drained now.
            let ahead = match kind {
                ScheduleKind::OneFOneB => (round + warm as u64 + 3) * u64::from(r),
                ScheduleKind::Flushing { group } => (round + 2) * group,
                // Replicas are at most one group apart and admit at most a group ahead.
                ScheduleKind::TwoBW { group } => (round + 3) * group,
            };
            let drainable = |w: u32| seg.members.contains(&w) && seg.members.len() > 1;
            let mut warned = || match (cfg.warn_at, cfg.drain_at, op) {
                (Some((m, w)), _, Op::Forward(rel)) if seg.start + rel >= m && drainable(w) => {
                    Some(w)
                }
                (_, Some((m, w)), _) if seg.start + ahead >= m && drainable(w) => Some(w),
                _ => ctx
                    .notices
                    .as_ref()
                    .and_then(|n| n.take(ctx.worker, &seg.members))
                    .or_else(|| {
                        let i = mail.warns.iter().position(|w| seg.members.contains(w))?;
                        Some(mail.warns.remove(i))
                    }),
            };
            let (change, newcomer) = match joining {
                Some((change, newcomer)) => (Some(change), newcomer),
                None => (warned().map(Change::Leave), None),
            };
            if let Some(change) = change {
                let at = seg.start + ahead;
                if at < cfg.minibatches {
                    let (order, event, also) = match &change {
                        Change::Leave(evicted) => {
                            tracing::warn!(
                                evicted,
                                drain_at = at,
                                "warning: draining the pipeline for a re-plan"
                            );
                            let order = PipeMsg::Drain {
                                segment: seg.index,
                                at,
                                evicted: *evicted,
                            };
                            let event = Event::Notice {
                                evicted: *evicted,
                                drain_at: at,
                            };
                            (order, event, None)
                        }
                        Change::Grow(members) => {
                            let joined = members.last().copied().unwrap_or_default();
                            if let Some(addr) = newcomer {
                                // Numbered, and given the plan table, before anyone hears of it.
                                mail.readies.retain(|a| *a != addr);
                                tracing::info!(joined, %addr, "a newcomer is ready to join");
                                if ctx.addrs.add(addr) != joined {
                                    return Err(StageError::NotInPlan(joined));
                                }
                                let table = super::encode_plans(
                                    std::iter::once(&cfg.plan).chain(cfg.replans.values()),
                                );
                                out.send_now(joined, PipeMsg::Plans { table }).await?;
                            }
                            tracing::info!(
                                joined,
                                drain_at = at,
                                "a worker joins: draining the pipeline for a re-plan"
                            );
                            let order = PipeMsg::Grow {
                                segment: seg.index,
                                at,
                                members: members.clone(),
                                addrs: ctx.addrs.snapshot(),
                            };
                            let event = Event::Join {
                                joined,
                                drain_at: at,
                            };
                            (order, event, Some(joined))
                        }
                    };
                    if let Some(cp) = &ctx.checkpoints {
                        cp.event(event);
                    }
                    let others = seg.members.iter().copied().filter(|&w| w != ctx.worker);
                    for w in others.chain(also) {
                        out.send_now(w, order.clone()).await?;
                    }
                    mail.drains.insert(seg.index, (at, change));
                    continue;
                }
            }
        }
        let step_epoch = match op {
            Op::Forward(rel) => {
                let m = seg.start + rel;
                let rows = cfg.batches.rows(m);
                let x = if first {
                    mlp::features(&ctx.train, &rows)
                } else {
                    let from = seg.physical(plan.worker_for(s - 1, rel));
                    match mail
                        .wait_on(Want::Act(m), drain.is_none(), Some(from))
                        .await?
                    {
                        Got::Tensor(t) => from_tensor(t, m)?,
                        Got::Drain => continue,
                        _ => return Err(StageError::InboxClosed),
                    }
                };
                let labels = last.then(|| mlp::labels(&ctx.train, &rows));
                let t = Instant::now();
                let y = if cfg.vertical_sync && !first {
                    let v = entered_with(rel) / u64::from(r);
                    compute(|| core.forward_at(m, x, labels.as_deref(), v))?
                } else {
                    if cfg.vertical_sync && core.version() * r0 != entered_with(rel) {
                        return Err(StageError::Config(format!(
                            "vertical sync: the input stage runs minibatch {m} on version {}, \
                             not the one its later stages expect",
                            core.version()
                        )));
                    }
                    compute(|| core.forward(m, x, labels.as_deref()))?
                };
                totals.busy += t.elapsed();
                if last {
                    totals.minibatches.push(m);
                }
                if !last {
                    let msg = PipeMsg::Activation {
                        segment: seg.index,
                        to_stage: (s + 1) as u32,
                        minibatch: m,
                        tensor: to_tensor(y),
                    };
                    out.send(seg.physical(plan.worker_for(s + 1, rel)), msg)?;
                }
                None
            }
            Op::Backward(rel) => {
                let m = seg.start + rel;
                let g = if last {
                    None
                } else {
                    let from = seg.physical(plan.worker_for(s + 1, rel));
                    match mail.wait_on(Want::Grad(m), false, Some(from)).await? {
                        Got::Tensor(t) => Some(from_tensor(t, m)?),
                        _ => return Err(StageError::InboxClosed),
                    }
                };
                let prev = (!first).then(|| Prev {
                    segment: seg.index,
                    worker: seg.physical(plan.worker_for(s - 1, rel)),
                    stage: (s - 1) as u32,
                    minibatch: m,
                });
                let overlap = bucketed && !core.accumulating();
                if overlap {
                    let job = core.detach_backward(m, g)?;
                    let counts = core.take_counts();
                    let ring = Ring {
                        stage: s as u32,
                        k,
                        r,
                        next: ring_next,
                        step_round: round_base + round,
                    };
                    let (flat, busy) =
                        backward_overlapped(job, &layer_buckets, counts, mail, out, ring, prev)
                            .await?;
                    totals.busy += busy;
                    reduced = Some(flat);
                } else {
                    let t = Instant::now();
                    let gin = compute(|| core.backward(m, g))?;
                    totals.busy += t.elapsed();
                    if let (Some(gin), Some(prev)) = (gin, prev) {
                        out.send(prev.worker, prev.message(gin))?;
                    }
                }
                matches!(kind, ScheduleKind::OneFOneB).then(|| cfg.batches.epoch(m))
            }
            Op::Sync => Some(last_epoch),
            Op::Flush { group } => match kind {
                ScheduleKind::Flushing { group: g } | ScheduleKind::TwoBW { group: g } => {
                    Some(cfg.batches.epoch(seg.start + group * g))
                }
                ScheduleKind::OneFOneB => None,
            },
        };
        pc += 1;
        let Some(epoch) = step_epoch else {
            continue;
        };
        // An optimizer step: all-reduce among replicas (unless the backward pass did, bucket
        // by bucket), then apply.
        let flat = match reduced.take() {
            Some(flat) => flat,
            None => {
                let flat = compute(|| core.take_gradients());
                let ring = Ring {
                    stage: s as u32,
                    k,
                    r,
                    next: ring_next,
                    step_round: round_base + round,
                };
                if r == 1 {
                    flat
                } else if bucketed {
                    // A step without a backward pass here (the other replicas may have had
                    // one): the same buckets in the same order as theirs.
                    let sizes: Vec<usize> = core.weights().iter().map(Dense::len).collect();
                    allreduce_in_buckets(mail, out, ring, &layer_buckets, &sizes, flat).await?
                } else {
                    ring_allreduce(mail, out, ring, 0, flat).await?
                }
            }
        };
        // Vertical sync: before the step makes a new version, drop those the stage's next
        // forward passes no longer need.
        if cfg.vertical_sync && !first {
            let next = ops[pc..].iter().find_map(|op| match op {
                Op::Forward(rel) => Some(entered_with(*rel) / u64::from(r)),
                _ => None,
            });
            core.release_before(next.unwrap_or(u64::MAX));
        }
        let t = Instant::now();
        let scale = match kind {
            ScheduleKind::OneFOneB | ScheduleKind::TwoBW { .. } => StepScale::SumOfMinibatchMeans,
            ScheduleKind::Flushing { .. } => StepScale::Mean,
        };
        compute(|| core.apply(&flat, epoch, scale))?;
        totals.busy += t.elapsed();
        // The first step of a segment after a re-plan (steps that finish the minibatches
        // below a drain point still belong to the segment being drained).
        if let Some(i) = totals.drained_at.iter().position(|(n, _)| *n == seg.index) {
            let (_, t) = totals.drained_at.remove(i);
            // Older segments that never stepped have nothing to report.
            totals.drained_at.retain(|(n, _)| *n > seg.index);
            let pause = t.elapsed();
            totals.resumed.push((seg.index, seg.members.len() as u32));
            tracing::info!(
                segment = seg.index,
                pause_ms = pause.as_millis() as u64,
                "training again on the new plan"
            );
            if let Some(tx) = &ctx.resumed {
                let _ = tx.send(crate::worker::WorkerEvent::PipelineResumed {
                    segment: seg.index,
                    from: seg.start,
                    workers: seg.members.len() as u32,
                    pause,
                });
            }
        }
        if let Some(c) = &ctx.steps {
            c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // Minibatches whose updates this step completes.
        let covered = match kind {
            ScheduleKind::OneFOneB => round * u64::from(r)..(round + 1) * u64::from(r),
            ScheduleKind::Flushing { group } | ScheduleKind::TwoBW { group } => {
                round * group..(round + 1) * group
            }
        };
        if every > 0 && k == 0 && covered.end.is_multiple_of(every) {
            let limit = drain.as_ref().map_or(cfg.minibatches, |d| d.0);
            if seg.start + covered.end < limit {
                snapshot(&core, seg.start + covered.end, mail, out)?;
            }
        }
        if let Some(cp) = &ctx.checkpoints {
            if seg.index > 0 {
                cp.event(Event::Resumed { segment: seg.index });
            }
            if k == 0 && cfg.checkpoint_every > 0 {
                let limit = drain.as_ref().map_or(cfg.minibatches, |d| d.0);
                for m in covered.map(|rel| seg.start + rel).filter(|m| *m < limit) {
                    if (m + 1).is_multiple_of(cfg.checkpoint_every) {
                        cp.record(m, sp.layers.start, core.weights());
                    }
                }
            }
        }
        round += 1;
    }
    totals.loss_sum += core.loss_sum;
    totals.correct += core.correct;
    totals.samples += core.samples;
    let end = match drain {
        Some((at, change)) => SegmentEnd::Drained { at, change },
        None => SegmentEnd::Finished,
    };
    Ok((end, core))
}

/// Where a gradient for the previous stage goes.
struct Prev {
    segment: u32,
    worker: u32,
    stage: u32,
    minibatch: u64,
}

impl Prev {
    fn message(&self, gin: Array2<f32>) -> PipeMsg {
        PipeMsg::Gradient {
            segment: self.segment,
            to_stage: self.stage,
            minibatch: self.minibatch,
            tensor: to_tensor(gin),
        }
    }
}

/// A replica's place in its stage's all-reduce ring for one optimizer step.
#[derive(Clone, Copy)]
struct Ring {
    stage: u32,
    /// This replica's index and the replica count.
    k: u32,
    r: u32,
    /// The next replica's worker.
    next: u32,
    /// The step's number (unique within the run).
    step_round: u64,
}

/// A replicated stage's backward pass with its all-reduce overlapped: the pass runs on a
/// blocking thread and hands over each layer's gradient as it is ready; each bucket (of
/// `buckets`, from the last layer back) is all-reduced as soon as it is complete, while the
/// pass computes the layers before it. The gradient for the previous stage goes out as soon as
/// the pass ends, before the last bucket's all-reduce. Returns the step's summed flat vector
/// (as [`StageCore::take_gradients`] lays it out, `counts` last) and the compute time.
async fn backward_overlapped(
    job: DetachedBackward,
    buckets: &[std::ops::Range<usize>],
    counts: [f32; 2],
    mail: &mut Mailbox,
    out: &mut Sender,
    ring: Ring,
    prev: Option<Prev>,
) -> Result<(Vec<f32>, Duration), StageError> {
    let layers = buckets.first().map_or(0, |b| b.end);
    let last = buckets.len().saturating_sub(1);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let computing = tokio::task::spawn_blocking(move || {
        let t = Instant::now();
        let gin = job.run(|i, d| {
            let _ = tx.send((i, d));
        });
        (gin, t.elapsed())
    });
    let mut grads: Vec<Option<Dense>> = vec![None; layers];
    let flat_of = |grads: &mut [Option<Dense>], b: &std::ops::Range<usize>| {
        let mut flat = Vec::new();
        for g in &mut grads[b.clone()] {
            let d = g.take().ok_or(StageError::Shape(ring.step_round))?;
            flat.extend(d.w.iter());
            flat.extend(d.b.iter());
        }
        Ok::<_, StageError>(flat)
    };
    let mut reduced: Vec<Vec<f32>> = Vec::with_capacity(buckets.len());
    while let Some((i, d)) = rx.recv().await {
        let slot = grads.get_mut(i).ok_or(StageError::Shape(ring.step_round))?;
        *slot = Some(d);
        let b = reduced.len();
        if b < last && buckets[b].start == i {
            let flat = flat_of(&mut grads, &buckets[b])?;
            reduced.push(ring_allreduce(mail, out, ring, b + 1, flat).await?);
        }
    }
    let (gin, busy) = computing
        .await
        .map_err(|e| StageError::Compute(e.to_string()))?;
    if let (Some(gin), Some(prev)) = (gin, prev) {
        out.send(prev.worker, prev.message(gin))?;
    }
    let mut flat = flat_of(&mut grads, &buckets[last])?;
    flat.extend(counts);
    let mut tail = ring_allreduce(mail, out, ring, last + 1, flat).await?;
    let counts = tail.split_off(tail.len().saturating_sub(2));
    reduced.push(tail);
    // Buckets run from the last layer back; the flat vector from the first layer on.
    let mut all: Vec<f32> = reduced.into_iter().rev().flatten().collect();
    all.extend(counts);
    Ok((all, busy))
}

/// [`backward_overlapped`]'s all-reduces for a flat vector that is all there already (as
/// [`StageCore::take_gradients`] lays it out; `sizes`: each layer's length in it): the same
/// buckets in the same order, so that it pairs with replicas that overlapped theirs.
async fn allreduce_in_buckets(
    mail: &mut Mailbox,
    out: &mut Sender,
    ring: Ring,
    buckets: &[std::ops::Range<usize>],
    sizes: &[usize],
    mut flat: Vec<f32>,
) -> Result<Vec<f32>, StageError> {
    let at = |layer: usize| sizes[..layer].iter().sum::<usize>();
    let last = buckets.len().saturating_sub(1);
    for (b, bucket) in buckets.iter().enumerate().take(last) {
        let range = at(bucket.start)..at(bucket.end);
        let sum = ring_allreduce(mail, out, ring, b + 1, flat[range.clone()].to_vec()).await?;
        flat[range].copy_from_slice(&sum);
    }
    let end = buckets.get(last).map_or(0, |b| at(b.end));
    let mut tail = flat[..end].to_vec();
    tail.extend_from_slice(&flat[flat.len().saturating_sub(2)..]);
    let sum = ring_allreduce(mail, out, ring, last + 1, tail).await?;
    flat[..end].copy_from_slice(&sum[..end]);
    let n = flat.len();
    flat[n.saturating_sub(2)..].copy_from_slice(&sum[end..]);
    Ok(flat)
}

/// Ring all-reduce (sum) of `data` among the `r` replicas of a stage: reduce-scatter, then
/// all-gather, each `r − 1` steps of one chunk to the next replica. `bucket` tells apart the
/// all-reduces of one step (0: the whole gradient at once).
async fn ring_allreduce(
    mail: &mut Mailbox,
    out: &mut Sender,
    ring: Ring,
    bucket: usize,
    mut data: Vec<f32>,
) -> Result<Vec<f32>, StageError> {
    let Ring {
        stage, k, r, next, ..
    } = ring;
    let round = (ring.step_round << 6) | bucket as u64;
    let n = data.len();
    let ru = r as usize;
    let chunk = |i: u32| (i as usize * n / ru)..((i as usize + 1) * n / ru);
    for t in 0..r - 1 {
        let send = (k + r - t) % r;
        let msg = PipeMsg::Reduce {
            stage,
            round,
            step: t,
            data: data[chunk(send)].to_vec(),
        };
        out.send(next, msg)?;
        let recv = (k + 2 * r - t - 1) % r;
        let got = mail.chunk(round, t).await?;
        let range = chunk(recv);
        if got.len() != range.len() {
            return Err(StageError::Shape(round));
        }
        for (d, g) in data[range].iter_mut().zip(got) {
            *d += g;
        }
    }
    for t in 0..r - 1 {
        let send = (k + 1 + r - t) % r;
        let msg = PipeMsg::Reduce {
            stage,
            round,
            step: r - 1 + t,
            data: data[chunk(send)].to_vec(),
        };
        out.send(next, msg)?;
        let recv = (k + r - t) % r;
        let got = mail.chunk(round, r - 1 + t).await?;
        let range = chunk(recv);
        if got.len() != range.len() {
            return Err(StageError::Shape(round));
        }
        data[range].copy_from_slice(&got);
    }
    Ok(data)
}

/// Single-process minibatch SGD over the same minibatches, `group` minibatches per step: the
/// reference the pipeline is compared against. Returns the weights after every
/// `checkpoint_every`-th minibatch's step (when it completes a step) and at the end.
pub fn train_sgd(
    cfg: &RunConfig,
    train: &ImageSet,
    group: u64,
) -> (Vec<(u64, Vec<Dense>)>, Vec<Dense>) {
    let mut layers = cfg.shape.init(cfg.seed);
    let mut opt = Sgd::new(&layers, cfg.lr, cfg.momentum);
    let mut checkpoints = Vec::new();
    let group = group.max(1);
    let mut m = 0;
    while m < cfg.minibatches {
        let end = (m + group).min(cfg.minibatches);
        let mut acc: Vec<Dense> = layers.iter().map(Dense::zeros_like).collect();
        let mut samples = 0;
        for mb in m..end {
            let rows = cfg.batches.rows(mb);
            let t = mlp::forward(&layers, mlp::features(train, &rows), true);
            let (_, _, g) = mlp::softmax_xent(&t.output, &mlp::labels(train, &rows));
            let (grads, _) = mlp::backward(&layers, &t, g, true, false);
            mlp::add_into(&mut acc, &grads);
            samples += rows.len();
        }
        opt.step(&mut layers, &acc, samples as f32, cfg.batches.epoch(m));
        for mb in m..end {
            if cfg.checkpoint_every > 0 && (mb + 1).is_multiple_of(cfg.checkpoint_every) {
                checkpoints.push((mb, layers.clone()));
            }
        }
        m = end;
    }
    (checkpoints, layers)
}

fn lcm(a: u64, b: u64) -> u64 {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    if a == 0 || b == 0 {
        a.max(b)
    } else {
        a / gcd(a, b) * b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_stashing_uses_the_forward_pass_version() {
        let shape = MlpShape::new(vec![6, 5, 4]).unwrap();
        let layers = shape.init(1);
        let v0 = layers[..1].to_vec();
        let mut core = StageCore::new(v0.clone(), true, false, 2, LrSchedule::constant(0.5), 0.9);
        let x = Array2::from_shape_fn((3, 6), |(i, j)| (i * 6 + j) as f32 / 18.0);
        core.forward(0, x.clone(), None).unwrap();
        // A step in between gives version 1 with deliberately different weights.
        let mut push: Vec<f32> = (0..mlp::flatten(&v0).len())
            .map(|i| (i % 7) as f32 - 3.0)
            .collect();
        push.extend([1.0, 1.0]);
        core.apply(&push, 0, StepScale::Mean).unwrap();
        assert_eq!(core.version(), 1);
        assert_ne!(core.weights(), &v0[..]);
        assert_eq!(core.stashed_version(0), Some(0));
        core.forward(1, x.clone(), None).unwrap();
        assert_eq!(core.stashed_version(1), Some(1));
        assert_eq!(core.max_versions, 2);
        // The capacity (warm-up + 1) bounds the minibatches in flight.
        assert!(matches!(
            core.forward(2, x.clone(), None),
            Err(StageError::StashFull { .. })
        ));

        let g = Array2::from_shape_fn((3, 5), |(i, j)| ((i + j) % 3) as f32 - 1.0);
        core.backward(0, Some(g.clone())).unwrap();
        let got = core.take_gradients();
        // What version 0 gives, and what the current version would have given.
        let expect = |w: &[Dense]| {
            let t = mlp::forward(w, x.clone(), false);
            let (grads, _) = mlp::backward(w, &t, g.clone(), false, false);
            let mut f = mlp::flatten(&grads);
            f.extend([3.0, 1.0]);
            f
        };
        assert_eq!(got, expect(&v0));
        assert_ne!(got, expect(core.weights()));
        assert!(matches!(
            core.backward(0, Some(g)),
            Err(StageError::NotStashed(0))
        ));
    }

    #[test]
    fn the_stage_input_gradient_uses_the_stashed_weights() {
        let shape = MlpShape::new(vec![4, 3, 2]).unwrap();
        let layers = shape.init(5);
        let last = layers[1..].to_vec();
        let mut core = StageCore::new(last.clone(), false, true, 1, LrSchedule::constant(1.0), 0.0);
        let x = Array2::from_shape_fn((2, 3), |(i, j)| (i + j) as f32 / 3.0);
        core.forward(4, x.clone(), Some(&[0, 1])).unwrap();
        let mut push = vec![0.25f32; mlp::flatten(&last).len()];
        push.extend([1.0, 1.0]);
        core.apply(&push, 0, StepScale::SumOfMinibatchMeans)
            .unwrap();
        let gin = core.backward(4, None).unwrap().unwrap();
        let t = mlp::forward(&last, x, true);
        let (_, _, g) = mlp::softmax_xent(&t.output, &[0, 1]);
        let (_, want) = mlp::backward(&last, &t, g, true, true);
        assert_eq!(Some(gin), want);
    }
}
