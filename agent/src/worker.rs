//! The worker: pulls the model, computes its partitions' update for the clock, pushes it.
//!
//! Correctness rests on two facts: a shard applies each (clock, partition) at most once, and an
//! update is a pure function of (parameters of the clock, partition, clock). So a worker may
//! always recompute and resend — after a conflict, after a crashed shard lost pushes, or for a
//! partition it inherited from a worker that left — without double counting.

use crate::apps::App;
use crate::sync::SyncPolicy;
use crate::transport::{Peers, PushOutcome, Request, Response};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::{ClusterView, Metric, Progress, ShardPlacement};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

const PULL_WAIT_MS: u32 = 300;
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// What the worker tells the agent's control loop.
#[derive(Debug, Clone)]
pub enum WorkerEvent {
    /// The last clock is complete; this is the final model's evaluation.
    Finished(Option<Metric>),
}

/// Shared, live progress of this agent's worker (read by the heartbeat).
pub type SharedProgress = Arc<Mutex<Progress>>;

/// Everything a worker needs; cheap to clone.
#[derive(Clone)]
pub struct WorkerCtx {
    pub me: InstanceId,
    pub app: Arc<App>,
    pub peers: Arc<Peers>,
    pub views: watch::Receiver<Option<Arc<ClusterView>>>,
    pub progress: SharedProgress,
    pub events: mpsc::UnboundedSender<WorkerEvent>,
    pub total_clocks: u64,
    pub clocks_per_epoch: u64,
    pub eval_every_clocks: u64,
    pub sync: SyncPolicy,
}

/// Why a worker loop ended.
#[derive(Debug, PartialEq, Eq)]
pub enum WorkerExit {
    /// The view no longer lists this agent as a worker.
    Unassigned,
    Finished,
}

struct Worker {
    ctx: WorkerCtx,
    view: Arc<ClusterView>,
    /// Parameters of the clock being worked on (kept to recompute lost or contested pushes).
    params: Vec<f32>,
    clock: u64,
    samples: u64,
    rate: RateMeter,
}

impl WorkerCtx {
    fn current_view(&self) -> Option<Arc<ClusterView>> {
        self.views.borrow().clone()
    }
}

/// Run the worker until it is unassigned or training is finished.
pub async fn run(ctx: WorkerCtx) -> WorkerExit {
    let Some(view) = ctx.current_view() else {
        return WorkerExit::Unassigned;
    };
    let samples = ctx
        .progress
        .lock()
        .map(|p| p.samples_processed)
        .unwrap_or(0);
    let mut w = Worker {
        view,
        params: Vec::new(),
        clock: 0,
        samples,
        rate: RateMeter::default(),
        ctx,
    };
    let Some(start) = w.start_clock().await else {
        return WorkerExit::Unassigned;
    };
    w.clock = start;
    tracing::info!(clock = start, "worker starting");
    loop {
        if w.my_partitions().is_none() {
            return WorkerExit::Unassigned;
        }
        if w.clock >= w.ctx.total_clocks {
            return w.finish().await;
        }
        let need = w.ctx.sync.needed_clock(w.clock);
        if !w.pull_all(need).await {
            return WorkerExit::Unassigned;
        }
        w.maybe_evaluate().await;
        let Some(parts) = w.my_partitions() else {
            return WorkerExit::Unassigned;
        };
        let t = Instant::now();
        let update = w.compute(parts.clone()).await;
        let samples = update.samples;
        let loss = (samples > 0).then(|| update.loss_sum / samples as f64);
        if !w.push_all(&parts, update.delta).await {
            return WorkerExit::Unassigned;
        }
        w.samples += samples as u64;
        w.rate.add(samples as u64, t.elapsed());
        w.clock += 1;
        w.report(loss);
    }
}

impl Worker {
    fn refresh_view(&mut self) {
        if let Some(v) = self.ctx.current_view() {
            self.view = v;
        }
    }

    fn my_partitions(&mut self) -> Option<Vec<u32>> {
        self.refresh_view();
        self.view
            .worker(&self.ctx.me)
            .map(|w| w.partitions.iter().collect())
    }

    /// Wait briefly for a newer view (after a peer said it is not the owner, or vanished).
    async fn await_newer_view(&mut self) {
        let mut rx = self.ctx.views.clone();
        let epoch = self.view.epoch;
        let _ = tokio::time::timeout(Duration::from_millis(100), async {
            while rx.borrow().as_ref().is_none_or(|v| v.epoch <= epoch) {
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
        self.refresh_view();
    }

    fn placement(&self, shard: u32) -> Option<(ShardPlacement, String)> {
        let p = self.view.shard(shard)?.clone();
        let addr = self.view.data_addr(&p.active)?.to_string();
        Some((p, addr))
    }

    /// First clock to work on: the one the job is in, i.e. just after the most advanced shard's
    /// last complete clock (a shard restored from an older backup lags behind; it catches up by
    /// skipping the clocks it lost).
    async fn start_clock(&mut self) -> Option<u64> {
        let mut start: Option<u64> = None;
        for s in 0..self.view.shards.len() as u32 {
            loop {
                self.my_partitions()?;
                let Some((_, addr)) = self.placement(s) else {
                    self.await_newer_view().await;
                    continue;
                };
                let req = Request::Pull {
                    shard: s,
                    need: None,
                    wait_ms: 0,
                };
                match self.ctx.peers.call(&addr, &req, CALL_TIMEOUT).await {
                    Ok(Response::Params { done, .. }) => {
                        let next = done.map_or(0, |d| d + 1);
                        start = Some(start.map_or(next, |x: u64| x.max(next)));
                        break;
                    }
                    Ok(Response::Busy) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    _ => {}
                }
                self.await_newer_view().await;
            }
        }
        Some(start.unwrap_or(0))
    }

    /// Pull every shard once `need` is complete there; returns false if unassigned meanwhile.
    async fn pull_all(&mut self, need: Option<u64>) -> bool {
        let mut fresh = vec![0.0f32; self.ctx.app.model_len()];
        let shards = self.view.shards.len() as u32;
        // Fast path: ask every shard at once; only shards that did not answer with parameters
        // go through the patient per-shard loop below.
        let req = |s| Request::Pull {
            shard: s,
            need,
            wait_ms: PULL_WAIT_MS,
        };
        let done = self
            .fan_out(req, |p, resp| match resp {
                Response::Params { values, .. } if values.len() as u64 == p.keys.len() => {
                    fresh[p.keys.start as usize..p.keys.end as usize].copy_from_slice(&values);
                    true
                }
                _ => false,
            })
            .await;
        for s in (0..shards).filter(|s| !done.contains(s)) {
            loop {
                if self.my_partitions().is_none() {
                    return false;
                }
                let Some((p, addr)) = self.placement(s) else {
                    self.await_newer_view().await;
                    continue;
                };
                let req = Request::Pull {
                    shard: s,
                    need,
                    wait_ms: PULL_WAIT_MS,
                };
                match self.ctx.peers.call(&addr, &req, CALL_TIMEOUT).await {
                    Ok(Response::Params { values, .. }) if values.len() as u64 == p.keys.len() => {
                        fresh[p.keys.start as usize..p.keys.end as usize].copy_from_slice(&values);
                        break;
                    }
                    Ok(Response::NotReady { missing }) => {
                        // Lost or never-sent updates of partitions that are ours now: resend.
                        let mine = self.my_partitions().unwrap_or_default();
                        let redo: Vec<u32> =
                            missing.into_iter().filter(|m| mine.contains(m)).collect();
                        if let (Some(c), false) = (need, redo.is_empty()) {
                            // Normally we hold the clock's parameters. A worker that just joined
                            // does not; it uses the current ones, which differ from them only by
                            // updates a crash already lost.
                            let params = if !self.params.is_empty() && c + 1 == self.clock {
                                Some(self.params.clone())
                            } else {
                                self.pull_current().await
                            };
                            if let Some(params) = params {
                                tracing::info!(shard = s, clock = c, partitions = ?redo, "resending updates the shard lacks");
                                let update = self.compute_with(params, redo.clone(), c).await;
                                self.push_one(s, c, &redo, &update.delta).await;
                            }
                        }
                    }
                    Ok(Response::Busy) => tokio::time::sleep(Duration::from_millis(20)).await,
                    _ => self.await_newer_view().await,
                }
            }
        }
        self.params = fresh;
        true
    }

    async fn compute(&self, parts: Vec<u32>) -> crate::apps::Update {
        self.compute_at(parts, self.clock).await
    }

    /// The update of `parts` at `clock` against `self.params`, off the async threads.
    async fn compute_at(&self, parts: Vec<u32>, clock: u64) -> crate::apps::Update {
        self.compute_with(self.params.clone(), parts, clock).await
    }

    async fn compute_with(
        &self,
        params: Vec<f32>,
        parts: Vec<u32>,
        clock: u64,
    ) -> crate::apps::Update {
        // On a multi-threaded runtime, compute in place: no hand-off to the blocking pool and
        // back (two thread wake-ups per clock, which under CPU contention cost more than the
        // copy they avoid); the runtime's other thread keeps serving shards meanwhile.
        let app = self.ctx.app.clone();
        let run = move || app.compute(&params, &parts, clock);
        match tokio::runtime::Handle::current().runtime_flavor() {
            tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(run),
            _ => tokio::task::spawn_blocking(run).await.unwrap_or_default(),
        }
    }

    /// The model as it is now on every shard, without waiting for any clock (one attempt each).
    async fn pull_current(&self) -> Option<Vec<f32>> {
        let mut out = vec![0.0f32; self.ctx.app.model_len()];
        for s in 0..self.view.shards.len() as u32 {
            let (p, addr) = self.placement(s)?;
            let req = Request::Pull {
                shard: s,
                need: None,
                wait_ms: 0,
            };
            match self.ctx.peers.call(&addr, &req, CALL_TIMEOUT).await {
                Ok(Response::Params { values, .. }) if values.len() as u64 == p.keys.len() => {
                    out[p.keys.start as usize..p.keys.end as usize].copy_from_slice(&values);
                }
                _ => return None,
            }
        }
        Some(out)
    }

    /// Push the clock's update to every shard; false if unassigned meanwhile.
    async fn push_all(&mut self, parts: &[u32], delta: Vec<f32>) -> bool {
        let clock = self.clock;
        let req = |p: &ShardPlacement| Request::Push {
            shard: p.shard,
            clock,
            partitions: parts.to_vec(),
            delta: delta[p.keys.start as usize..p.keys.end as usize].to_vec(),
        };
        let done = self
            .fan_out_with(req, |_, resp| {
                matches!(
                    resp,
                    Response::Pushed(PushOutcome::Applied | PushOutcome::Duplicate)
                )
            })
            .await;
        for s in (0..self.view.shards.len() as u32).filter(|s| !done.contains(s)) {
            if !self.push_one(s, self.clock, parts, &delta).await {
                return false;
            }
        }
        true
    }

    /// Send one request per shard concurrently; returns the shards for which `accept` took the
    /// answer. Anything else (errors, moved shards) is left to the caller's retry loops.
    async fn fan_out(
        &self,
        req: impl Fn(u32) -> Request,
        accept: impl FnMut(&ShardPlacement, Response) -> bool,
    ) -> Vec<u32> {
        self.fan_out_with(|p| req(p.shard), accept).await
    }

    async fn fan_out_with(
        &self,
        req: impl Fn(&ShardPlacement) -> Request,
        mut accept: impl FnMut(&ShardPlacement, Response) -> bool,
    ) -> Vec<u32> {
        let mut calls = Vec::new();
        for s in 0..self.view.shards.len() as u32 {
            let Some((p, addr)) = self.placement(s) else {
                continue;
            };
            let (peers, r) = (self.ctx.peers.clone(), req(&p));
            calls.push((
                p,
                tokio::spawn(async move { peers.call(&addr, &r, CALL_TIMEOUT).await }),
            ));
        }
        let mut done = Vec::new();
        for (p, call) in calls {
            if let Ok(Ok(resp)) = call.await
                && accept(&p, resp)
            {
                done.push(p.shard);
            }
        }
        done
    }

    /// Push `delta`'s slice for shard `s` until it is applied or known to be in already.
    async fn push_one(&mut self, s: u32, clock: u64, parts: &[u32], delta: &[f32]) -> bool {
        let mut parts = parts.to_vec();
        let mut delta = delta.to_vec();
        loop {
            if self.my_partitions().is_none() {
                return false;
            }
            let Some((p, addr)) = self.placement(s) else {
                self.await_newer_view().await;
                continue;
            };
            if delta.is_empty() || parts.is_empty() {
                return true;
            }
            let slice = delta[p.keys.start as usize..p.keys.end as usize].to_vec();
            let req = Request::Push {
                shard: s,
                clock,
                partitions: parts.clone(),
                delta: slice,
            };
            match self.ctx.peers.call(&addr, &req, CALL_TIMEOUT).await {
                Ok(Response::Pushed(PushOutcome::Applied | PushOutcome::Duplicate)) => return true,
                Ok(Response::Pushed(PushOutcome::Conflict { already })) => {
                    parts.retain(|x| !already.contains(x));
                    if parts.is_empty() {
                        return true;
                    }
                    delta = self.compute_at(parts.clone(), clock).await.delta;
                }
                Ok(Response::Busy) => tokio::time::sleep(Duration::from_millis(20)).await,
                Ok(Response::Error(e)) => {
                    tracing::error!(shard = s, error = %e, "push refused");
                    self.await_newer_view().await;
                }
                _ => self.await_newer_view().await,
            }
        }
    }

    async fn maybe_evaluate(&mut self) {
        let every = self.ctx.eval_every_clocks;
        let rank0 = self.view.worker(&self.ctx.me).is_some_and(|w| w.rank == 0);
        if every == 0 || !rank0 || self.clock == 0 || !self.clock.is_multiple_of(every) {
            return;
        }
        let metric = self.evaluate().await;
        if let Some(m) = metric {
            tracing::info!(clock = self.clock, kind = %m.kind, value = m.value, "evaluated");
        }
        if let Ok(mut p) = self.ctx.progress.lock() {
            p.metric = metric;
        }
    }

    async fn evaluate(&self) -> Option<Metric> {
        let app = self.ctx.app.clone();
        let params = self.params.clone();
        let clock = self.clock;
        tokio::task::spawn_blocking(move || app.evaluate(&params, clock))
            .await
            .ok()
            .flatten()
    }

    async fn finish(&mut self) -> WorkerExit {
        let need = self.ctx.total_clocks.checked_sub(1);
        if !self.pull_all(need).await {
            return WorkerExit::Unassigned;
        }
        let metric = self.evaluate().await;
        tracing::info!(?metric, "training finished");
        if let Ok(mut p) = self.ctx.progress.lock() {
            p.metric = metric;
        }
        let _ = self.ctx.events.send(WorkerEvent::Finished(metric));
        WorkerExit::Finished
    }

    fn report(&self, loss: Option<f64>) {
        if let Ok(mut p) = self.ctx.progress.lock() {
            p.clock = self.clock;
            p.epoch = self.clock as f64 / self.ctx.clocks_per_epoch.max(1) as f64;
            p.samples_processed = self.samples;
            p.loss = loss;
            p.samples_per_sec = self.rate.per_sec();
        }
    }
}

/// Samples per second over the last few clocks, counting wall time of whole clocks (waits
/// included), which is what the job experiences.
#[derive(Default)]
struct RateMeter {
    window: std::collections::VecDeque<(Instant, u64)>,
}

impl RateMeter {
    fn add(&mut self, samples: u64, _compute: Duration) {
        self.window.push_back((Instant::now(), samples));
        while self.window.len() > 20 {
            self.window.pop_front();
        }
    }

    fn per_sec(&self) -> f64 {
        let (Some(first), Some(last)) = (self.window.front(), self.window.back()) else {
            return 0.0;
        };
        let secs = last.0.duration_since(first.0).as_secs_f64();
        if secs <= 0.0 {
            return 0.0;
        }
        let n: u64 = self.window.iter().skip(1).map(|(_, s)| s).sum();
        n as f64 / secs
    }
}
