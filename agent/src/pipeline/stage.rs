//! A stage replica at run time.
//!
//! [`StageCore`] is the synchronous part: the stage's layers, its current weights, the stash of
//! (weights, activations) per minibatch in flight, the gradient accumulator and the optimizer.
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
    #[error("sending to worker {worker}: {message}")]
    Send { worker: u32, message: String },
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
    /// Training loss and correct predictions summed over forward passes (last stage only).
    pub loss_sum: f64,
    pub correct: usize,
    pub samples: usize,
    /// Most weight versions the stash held at once.
    pub max_versions: usize,
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
            loss_sum: 0.0,
            correct: 0,
            samples: 0,
            max_versions: 0,
        }
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
        let trace = mlp::forward(&self.weights, x, self.ends_model);
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
                version: self.version,
                weights: self.weights.clone(),
                trace,
                loss_grad,
            },
        );
        let mut versions: Vec<u64> = self.stash.values().map(|s| s.version).collect();
        versions.dedup();
        self.max_versions = self.max_versions.max(versions.len());
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
        Ok(gin)
    }

    /// The accumulated gradient sums and their sample count, as one flat vector with the count
    /// last (what replicas all-reduce); resets the accumulator.
    pub fn take_gradients(&mut self) -> Vec<f32> {
        let mut flat = mlp::flatten(&self.acc);
        flat.push(self.acc_samples as f32);
        for a in &mut self.acc {
            a.w.fill(0.0);
            a.b.fill(0.0);
        }
        self.acc_samples = 0;
        flat
    }

    /// One optimizer step with a (possibly all-reduced) vector from [`Self::take_gradients`].
    pub fn apply(&mut self, flat: &[f32], epoch: u64) -> Result<(), StageError> {
        let Some((&count, grads)) = flat.split_last() else {
            return Err(StageError::Shape(0));
        };
        let grads = mlp::unflatten(&self.weights, grads).ok_or(StageError::Shape(0))?;
        // Copy-on-write: stashed minibatches keep the version they ran with.
        let w = Arc::make_mut(&mut self.weights);
        self.opt.step(w, &grads, count.round() as usize, epoch);
        self.version += 1;
        Ok(())
    }

    /// Weights, optimizer state and stash as they are (for hand-over).
    pub fn optimizer(&self) -> &Sgd {
        &self.opt
    }
}

/// Every stage's weights at checkpoints, with the time each stage recorded them.
#[derive(Debug)]
pub struct Checkpoints {
    stages: usize,
    taken: Mutex<BTreeMap<u64, Vec<Option<(Instant, Vec<Dense>)>>>>,
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
    pub fn new(stages: usize) -> Arc<Self> {
        Arc::new(Checkpoints {
            stages,
            taken: Mutex::new(BTreeMap::new()),
        })
    }

    fn record(&self, m: u64, stage: usize, layers: Vec<Dense>) {
        let now = Instant::now();
        if let Ok(mut t) = self.taken.lock() {
            let e = t.entry(m).or_insert_with(|| vec![None; self.stages]);
            if let Some(slot) = e.get_mut(stage) {
                *slot = Some((now, layers));
            }
        }
    }

    /// Complete checkpoints in minibatch order.
    pub fn complete(&self) -> Vec<Checkpoint> {
        let Ok(t) = self.taken.lock() else {
            return Vec::new();
        };
        t.iter()
            .filter(|(_, v)| v.iter().all(Option::is_some))
            .map(|(&m, v)| {
                let parts: Vec<&(Instant, Vec<Dense>)> = v.iter().flatten().collect();
                Checkpoint {
                    minibatch: m,
                    at: parts.iter().map(|p| p.0).max().unwrap_or_else(Instant::now),
                    layers: parts.iter().flat_map(|p| p.1.iter().cloned()).collect(),
                }
            })
            .collect()
    }
}

/// Routes pipeline messages arriving over the transport into a stage's inbox.
pub struct Inbox(pub mpsc::UnboundedSender<PipeMsg>);

impl Handler for Inbox {
    fn handle(self: Arc<Self>, req: Request) -> Pin<Box<dyn Future<Output = Response> + Send>> {
        Box::pin(async move {
            match req {
                Request::Pipe(m) => {
                    if self.0.send(m).is_ok() {
                        Response::Ack
                    } else {
                        Response::Busy
                    }
                }
                _ => Response::Error("this worker runs a pipeline stage only".into()),
            }
        })
    }
}

/// Messages received ahead of when the schedule needs them.
struct Mailbox {
    rx: mpsc::UnboundedReceiver<PipeMsg>,
    acts: HashMap<u64, Tensor>,
    grads: HashMap<u64, Tensor>,
    reduces: HashMap<(u64, u32), Vec<f32>>,
}

enum Want {
    Act(u64),
    Grad(u64),
    Reduce(u64, u32),
}

impl Mailbox {
    fn file(&mut self, msg: PipeMsg) {
        match msg {
            PipeMsg::Activation {
                minibatch, tensor, ..
            } => {
                self.acts.insert(minibatch, tensor);
            }
            PipeMsg::Gradient {
                minibatch, tensor, ..
            } => {
                self.grads.insert(minibatch, tensor);
            }
            PipeMsg::Reduce {
                round, step, data, ..
            } => {
                self.reduces.insert((round, step), data);
            }
        }
    }

    fn take(&mut self, w: &Want) -> Option<Result<Tensor, Vec<f32>>> {
        match *w {
            Want::Act(m) => self.acts.remove(&m).map(Ok),
            Want::Grad(m) => self.grads.remove(&m).map(Ok),
            Want::Reduce(r, s) => self.reduces.remove(&(r, s)).map(Err),
        }
    }

    async fn wait(&mut self, w: Want) -> Result<Result<Tensor, Vec<f32>>, StageError> {
        let deadline = tokio::time::Instant::now() + MESSAGE_TIMEOUT;
        loop {
            if let Some(x) = self.take(&w) {
                return Ok(x);
            }
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(msg)) => self.file(msg),
                Ok(None) => return Err(StageError::InboxClosed),
                Err(_) => {
                    let what = match w {
                        Want::Act(m) => format!("the activation of minibatch {m}"),
                        Want::Grad(m) => format!("the gradient of minibatch {m}"),
                        Want::Reduce(r, s) => format!("all-reduce round {r} step {s}"),
                    };
                    return Err(StageError::Timeout(MESSAGE_TIMEOUT, what));
                }
            }
        }
    }

    async fn tensor(&mut self, w: Want) -> Result<Tensor, StageError> {
        match self.wait(w).await? {
            Ok(t) => Ok(t),
            Err(_) => Err(StageError::InboxClosed),
        }
    }

    async fn chunk(&mut self, round: u64, step: u32) -> Result<Vec<f32>, StageError> {
        match self.wait(Want::Reduce(round, step)).await? {
            Err(v) => Ok(v),
            Ok(_) => Err(StageError::InboxClosed),
        }
    }
}

/// A worker's place in a run.
pub struct StageCtx {
    pub worker: u32,
    /// Data address of every worker, by worker number.
    pub addrs: Arc<Vec<String>>,
    pub peers: Arc<Peers>,
    pub inbox: mpsc::UnboundedReceiver<PipeMsg>,
    pub train: Arc<ImageSet>,
    pub cfg: Arc<RunConfig>,
    pub checkpoints: Option<Arc<Checkpoints>>,
}

/// What a stage replica reports at the end.
#[derive(Debug)]
pub struct StageOutcome {
    pub worker: u32,
    pub stage: usize,
    pub replica: u32,
    pub layers: Vec<Dense>,
    pub loss_sum: f64,
    pub correct: usize,
    pub samples: usize,
    pub max_versions: usize,
    /// Seconds spent computing (forward, backward, optimizer).
    pub compute_secs: f64,
    /// From the first operation to the last.
    pub wall_secs: f64,
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
    addrs: Arc<Vec<String>>,
    tasks: JoinSet<Result<(), StageError>>,
}

impl Sender {
    fn send(&mut self, to: u32, msg: PipeMsg) -> Result<(), StageError> {
        let addr = self
            .addrs
            .get(to as usize)
            .cloned()
            .ok_or(StageError::NotInPlan(to))?;
        let peers = self.peers.clone();
        let me = self.me;
        self.tasks.spawn(async move {
            let req = Request::Pipe(msg);
            let mut delay = Duration::from_millis(20);
            let mut last = String::new();
            for _ in 0..6 {
                match peers.call(&addr, &req, CALL_TIMEOUT).await {
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
        });
        // Surface failures of earlier sends without waiting for the others.
        while let Some(done) = self.tasks.try_join_next() {
            if let Ok(Err(e)) = done {
                return Err(e);
            }
        }
        Ok(())
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

/// Run worker `ctx.worker`'s stage replica through its whole schedule.
pub async fn run(ctx: StageCtx) -> Result<StageOutcome, StageError> {
    let cfg = ctx.cfg.clone();
    let plan = &cfg.plan;
    let (s, k) = plan
        .role(ctx.worker)
        .ok_or(StageError::NotInPlan(ctx.worker))?;
    let sp = plan.stages()[s].clone();
    let n_stages = plan.stages().len();
    let (first, last) = (s == 0, s + 1 == n_stages);
    let r = sp.replicas;
    let warm = schedule::warmup(plan.workers_from(s), r);
    let capacity = match cfg.schedule {
        ScheduleKind::OneFOneB => warm + 1,
        ScheduleKind::Flushing { group } => group as usize,
    };
    let all = cfg.shape.init(cfg.seed);
    let mine: Vec<Dense> = all[sp.layers.clone()].to_vec();
    let mut core = StageCore::new(mine, first, last, capacity, cfg.lr, cfg.momentum);
    let ops = schedule::ops(cfg.schedule, cfg.minibatches, r, k, plan.workers_from(s));
    let mut mail = Mailbox {
        rx: ctx.inbox,
        acts: HashMap::new(),
        grads: HashMap::new(),
        reduces: HashMap::new(),
    };
    let mut out = Sender {
        me: ctx.worker,
        peers: ctx.peers.clone(),
        addrs: ctx.addrs.clone(),
        tasks: JoinSet::new(),
    };
    let ring_next = plan.first_worker(s) + (k + 1) % r;
    let start = Instant::now();
    let mut busy = Duration::ZERO;
    let mut round = 0u64;
    let last_epoch = cfg.batches.epoch(cfg.minibatches.saturating_sub(1));
    for op in ops {
        let step_epoch = match op {
            Op::Forward(m) => {
                let rows = cfg.batches.rows(m);
                let x = if first {
                    mlp::features(&ctx.train, &rows)
                } else {
                    from_tensor(mail.tensor(Want::Act(m)).await?, m)?
                };
                let labels = last.then(|| mlp::labels(&ctx.train, &rows));
                let t = Instant::now();
                let y = compute(|| core.forward(m, x, labels.as_deref()))?;
                busy += t.elapsed();
                if !last {
                    let msg = PipeMsg::Activation {
                        to_stage: (s + 1) as u32,
                        minibatch: m,
                        tensor: to_tensor(y),
                    };
                    out.send(plan.worker_for(s + 1, m), msg)?;
                }
                None
            }
            Op::Backward(m) => {
                let g = if last {
                    None
                } else {
                    Some(from_tensor(mail.tensor(Want::Grad(m)).await?, m)?)
                };
                let t = Instant::now();
                let gin = compute(|| core.backward(m, g))?;
                busy += t.elapsed();
                if let Some(gin) = gin {
                    let msg = PipeMsg::Gradient {
                        to_stage: (s - 1) as u32,
                        minibatch: m,
                        tensor: to_tensor(gin),
                    };
                    out.send(plan.worker_for(s - 1, m), msg)?;
                }
                matches!(cfg.schedule, ScheduleKind::OneFOneB).then(|| cfg.batches.epoch(m))
            }
            Op::Sync => Some(last_epoch),
            Op::Flush { group } => match cfg.schedule {
                ScheduleKind::Flushing { group: g } => Some(cfg.batches.epoch(group * g)),
                ScheduleKind::OneFOneB => None,
            },
        };
        let Some(epoch) = step_epoch else {
            continue;
        };
        // An optimizer step: all-reduce among replicas, then apply.
        let mut flat = compute(|| core.take_gradients());
        if r > 1 {
            flat =
                ring_allreduce(&mut mail, &mut out, s as u32, k, r, ring_next, round, flat).await?;
        }
        let t = Instant::now();
        compute(|| core.apply(&flat, epoch))?;
        busy += t.elapsed();
        // Minibatches whose updates this step completes.
        let covered = match cfg.schedule {
            ScheduleKind::OneFOneB => round * u64::from(r)..(round + 1) * u64::from(r),
            ScheduleKind::Flushing { group } => round * group..(round + 1) * group,
        };
        if let Some(cp) = &ctx.checkpoints
            && k == 0
            && cfg.checkpoint_every > 0
        {
            for m in covered.filter(|m| *m < cfg.minibatches) {
                if (m + 1).is_multiple_of(cfg.checkpoint_every) {
                    cp.record(m, s, core.weights().to_vec());
                }
            }
        }
        round += 1;
    }
    out.drain().await?;
    Ok(StageOutcome {
        worker: ctx.worker,
        stage: s,
        replica: k,
        layers: core.weights().to_vec(),
        loss_sum: core.loss_sum,
        correct: core.correct,
        samples: core.samples,
        max_versions: core.max_versions,
        compute_secs: busy.as_secs_f64(),
        wall_secs: start.elapsed().as_secs_f64(),
    })
}

/// Ring all-reduce (sum) of `data` among the `r` replicas of `stage`: reduce-scatter, then
/// all-gather, each `r − 1` steps of one chunk to the next replica.
#[allow(clippy::too_many_arguments)]
async fn ring_allreduce(
    mail: &mut Mailbox,
    out: &mut Sender,
    stage: u32,
    k: u32,
    r: u32,
    next: u32,
    round: u64,
    mut data: Vec<f32>,
) -> Result<Vec<f32>, StageError> {
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
        opt.step(&mut layers, &acc, samples, cfg.batches.epoch(m));
        for mb in m..end {
            if cfg.checkpoint_every > 0 && (mb + 1).is_multiple_of(cfg.checkpoint_every) {
                checkpoints.push((mb, layers.clone()));
            }
        }
        m = end;
    }
    (checkpoints, layers)
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
        push.push(1.0);
        core.apply(&push, 0).unwrap();
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
            f.push(3.0);
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
        push.push(1.0);
        core.apply(&push, 0).unwrap();
        let gin = core.backward(4, None).unwrap().unwrap();
        let t = mlp::forward(&last, x, true);
        let (_, _, g) = mlp::softmax_xent(&t.output, &[0, 1]);
        let (_, want) = mlp::backward(&last, &t, g, true, true);
        assert_eq!(Some(gin), want);
    }
}
