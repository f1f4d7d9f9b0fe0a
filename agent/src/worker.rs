//! The worker: pulls the model, computes its partitions' update for the clock, pushes it.
//!
//! Correctness rests on two facts: a shard applies each (clock, partition) at most once, and an
//! update is a pure function of (parameters of the clock, partition, clock). So a worker may
//! always recompute and resend — after a conflict, after a crashed shard lost pushes, or for a
//! partition it inherited from a worker that left — without double counting.

use crate::apps::{App, Update};
use crate::audit::{Audit, AuditEvent, How};
use crate::reassign::{self, Board, Delegate};
use crate::straggler::Pace;
use crate::sync::SyncPolicy;
use crate::transport::{Peers, PushOutcome, RangeProgress, Request, Response};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::{ClusterView, Metric, PartitionRange, Progress, ShardPlacement};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

const PULL_WAIT_MS: u32 = 300;
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a pull that keeps waiting for missing updates reports what is missing.
const STALL_REPORT_EVERY: Duration = Duration::from_secs(10);

/// What the worker tells the agent's control loop.
#[derive(Debug, Clone)]
pub enum WorkerEvent {
    /// The last clock is complete; this is the final model's evaluation.
    Finished(Option<Metric>),
    /// Pipeline jobs: training again after a re-plan (see [`proteus_wire::agent_api::AgentEvent::PipelineResumed`]).
    PipelineResumed {
        segment: u32,
        from: u64,
        workers: u32,
        pause: Duration,
    },
    /// Pipeline jobs: the profile this member measured, for the broker to plan from (see
    /// [`proteus_wire::agent_api::AgentEvent::PipelineProfile`]).
    PipelineProfile(Vec<proteus_wire::agent_api::LayerTiming>),
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
    /// This worker's range in the current clock, shared with the handler its helpers call.
    pub board: Arc<Board>,
    /// Injected slowness (tests, benchmarks); shared by everything this agent computes.
    pub pace: Arc<Pace>,
    /// Samples this agent has processed, over every worker run and delegated range.
    pub samples: Arc<AtomicU64>,
    /// Tests: told of every clock started and every item processed.
    pub audit: Option<Audit>,
}

/// Why a worker loop ended.
#[derive(Debug, PartialEq, Eq)]
pub enum WorkerExit {
    /// The view no longer lists this agent as a worker.
    Unassigned,
    Finished,
    /// Warned: the rest of its range was handed to its helpers.
    Left,
}

struct Worker {
    ctx: WorkerCtx,
    view: Arc<ClusterView>,
    /// Parameters of the clock being worked on (kept to recompute lost or contested pushes).
    params: Vec<f32>,
    clock: u64,
    rate: RateMeter,
    /// Recent seconds per own item and per push: a helper takes over a chunk only if
    /// computing it takes longer than the extra push it costs.
    item_secs: Ewma,
    push_secs: Ewma,
}

/// Exponentially weighted mean of recent samples (None until the first).
#[derive(Debug, Default, Clone, Copy)]
struct Ewma(Option<f64>);

impl Ewma {
    fn add(&mut self, x: f64) {
        self.0 = Some(self.0.map_or(x, |m| 0.8 * m + 0.2 * x));
    }
}

impl WorkerCtx {
    fn current_view(&self) -> Option<Arc<ClusterView>> {
        self.views.borrow().clone()
    }
}

/// Run the worker until it is unassigned or training is finished.
pub async fn run(ctx: WorkerCtx) -> WorkerExit {
    ctx.board.rearm();
    let Some(view) = ctx.current_view() else {
        ctx.board.release();
        return WorkerExit::Unassigned;
    };
    let mut w = Worker {
        view,
        params: Vec::new(),
        clock: 0,
        rate: RateMeter::default(),
        item_secs: Ewma::default(),
        push_secs: Ewma::default(),
        ctx,
    };
    let exit = w.run().await;
    // Whatever happened, a warned agent must not wait for this worker any longer.
    w.ctx.board.release();
    exit
}

/// Compute a range of `clock` handed over by a warned worker and push it; true once applied.
async fn run_delegated(ctx: WorkerCtx, clock: u64, partitions: Vec<u32>) -> bool {
    let Some(view) = ctx.current_view() else {
        return false;
    };
    let mut w = Worker {
        view,
        params: Vec::new(),
        clock,
        rate: RateMeter::default(),
        item_secs: Ewma::default(),
        push_secs: Ewma::default(),
        ctx,
    };
    if w.my_partitions().is_none() {
        return false;
    }
    // Parameters fresh enough for `clock` (usually there already: we are at or past it).
    if !w.pull_all(w.ctx.sync.needed_clock(clock), false).await {
        return false;
    }
    let t = Instant::now();
    let u = w
        .compute_paced(partitions.clone(), clock, How::Delegated)
        .await;
    let ok = w.push_all(clock, &partitions, u.delta).await;
    tracing::info!(
        clock,
        partitions = %ranges(&partitions),
        ms = t.elapsed().as_millis() as u64,
        ok,
        "finished a range handed over by a warned worker"
    );
    ok
}

/// RapidReassignment's node hands a warned peer's range to this agent's worker.
impl Delegate for WorkerCtx {
    fn run_delegated(
        &self,
        clock: u64,
        partitions: Vec<u32>,
    ) -> Pin<Box<dyn Future<Output = bool> + Send>> {
        Box::pin(run_delegated(self.clone(), clock, partitions))
    }
}

/// `3..7` style text for a sorted partition list.
fn ranges(parts: &[u32]) -> String {
    let mut out = Vec::new();
    let mut it = parts.iter().copied().peekable();
    while let Some(a) = it.next() {
        let mut b = a;
        while it.peek() == Some(&(b + 1)) {
            b += 1;
            it.next();
        }
        out.push(format!("{a}..{}", b + 1));
    }
    out.join(",")
}

fn add_update(acc: &mut Update, u: Update) {
    if acc.delta.is_empty() {
        *acc = u;
        return;
    }
    for (a, d) in acc.delta.iter_mut().zip(&u.delta) {
        *a += d;
    }
    acc.samples += u.samples;
    acc.loss_sum += u.loss_sum;
}

impl Worker {
    async fn run(&mut self) -> WorkerExit {
        let Some(start) = self.start_clock().await else {
            return WorkerExit::Unassigned;
        };
        self.clock = start;
        tracing::info!(clock = start, sync = %self.ctx.sync.0, "worker starting");
        loop {
            if self.ctx.board.is_leaving() {
                return WorkerExit::Left;
            }
            if self.my_partitions().is_none() {
                return WorkerExit::Unassigned;
            }
            if self.clock >= self.ctx.total_clocks {
                return self.finish().await;
            }
            let need = self.ctx.sync.needed_clock(self.clock);
            if !self.pull_all(need, true).await {
                return WorkerExit::Unassigned;
            }
            self.maybe_evaluate();
            let Some(range) = self.my_range() else {
                return WorkerExit::Unassigned;
            };
            self.audit(AuditEvent::Started {
                worker: self.ctx.me.clone(),
                clock: self.clock,
            });
            let t = Instant::now();
            let (parts, update) = self.compute_own(range).await;
            let mut samples = update.samples as u64;
            let loss = (update.samples > 0).then(|| update.loss_sum / update.samples as f64);
            if !parts.is_empty() {
                self.item_secs
                    .add(t.elapsed().as_secs_f64() / parts.len() as f64);
            }
            let tp = Instant::now();
            if !parts.is_empty() && !self.push_all(self.clock, &parts, update.delta).await {
                return WorkerExit::Unassigned;
            }
            self.push_secs.add(tp.elapsed().as_secs_f64());
            if self.ctx.board.is_leaving() {
                self.hand_over_rest().await;
                return WorkerExit::Left;
            }
            if let Some(g) = self.ctx.sync.helper_group() {
                samples += self.help(g).await;
            }
            self.rate.add(samples, t.elapsed());
            self.clock += 1;
            self.report(loss);
        }
    }

    fn audit(&self, ev: AuditEvent) {
        if let Some(a) = &self.ctx.audit {
            a(ev);
        }
    }

    fn rank(&self) -> u32 {
        self.view.worker(&self.ctx.me).map_or(0, |w| w.rank)
    }

    fn my_range(&mut self) -> Option<PartitionRange> {
        self.refresh_view();
        self.view.worker(&self.ctx.me).map(|w| w.partitions)
    }

    /// Compute `parts` at `clock` against `self.params`, then wait as the injection says.
    async fn compute_paced(&self, parts: Vec<u32>, clock: u64, how: How) -> Update {
        let t = Instant::now();
        let u = self
            .compute_with(self.params.clone(), parts.clone(), clock)
            .await;
        tracing::debug!(target: "proteus_agent::audit", clock, partitions = %ranges(&parts), how = ?how, "processed");
        self.audit(AuditEvent::Processed {
            worker: self.ctx.me.clone(),
            clock,
            partitions: parts,
            how,
        });
        self.ctx
            .samples
            .fetch_add(u.samples as u64, Ordering::Relaxed);
        self.ctx
            .pace
            .spend(u.samples, t.elapsed(), self.rank(), self.clock)
            .await;
        u
    }

    /// This worker's own range of the clock, item by item through the board so that helpers
    /// can take the unstarted tail (all at once when nobody helps). Returns the partitions it
    /// processed and their summed update.
    async fn compute_own(&mut self, range: PartitionRange) -> (Vec<u32>, Update) {
        let step = if self.ctx.sync.helper_group().is_some() {
            1
        } else {
            u32::MAX
        };
        let mut acc = Update::default();
        if !self.ctx.board.begin(self.clock, range.start, range.end) {
            return (Vec::new(), acc);
        }
        while let Some(r) = self.ctx.board.take(step) {
            let u = self.compute_paced(r.collect(), self.clock, How::Own).await;
            add_update(&mut acc, u);
        }
        let done: Vec<u32> = self.ctx.board.finish().collect();
        (done, acc)
    }

    /// RapidReassignment, helper side: while a worker this one helps has unstarted items in a
    /// clock this worker's parameters are fresh enough for, offer to take a chunk of its tail.
    /// Returns the samples processed.
    async fn help(&mut self, group: u32) -> u64 {
        let mut samples = 0u64;
        loop {
            if self.ctx.board.is_leaving() {
                break;
            }
            self.refresh_view();
            let mut calls = Vec::new();
            for id in reassign::helpees(&self.view, &self.ctx.me, group) {
                let Some(addr) = self.view.data_addr(&id).map(str::to_string) else {
                    continue;
                };
                let peers = self.ctx.peers.clone();
                calls.push((
                    id,
                    addr.clone(),
                    tokio::spawn(async move {
                        peers
                            .call(&addr, &Request::Progress, Duration::from_secs(5))
                            .await
                    }),
                ));
            }
            let mut best: Option<(InstanceId, String, RangeProgress)> = None;
            for (id, addr, call) in calls {
                if let Ok(Ok(Response::Progress(Some(p)))) = call.await
                    && p.clock <= self.clock
                    && p.end > p.next
                    && best
                        .as_ref()
                        .is_none_or(|(_, _, b)| p.end - p.next > b.end - b.next)
                {
                    best = Some((id, addr, p));
                }
            }
            let Some((owner, addr, p)) = best else {
                break;
            };
            let k = reassign::chunk(p.end - p.next, group);
            // Not worth it when the chunk computes faster than the extra push it costs (tiny
            // items, e.g. an unpaced small model): the owner will be done as soon.
            if let (Some(item), Some(push)) = (self.item_secs.0, self.push_secs.0)
                && f64::from(k) * item < push
            {
                break;
            }
            let split = p.end - k;
            let offer = Request::Offer {
                clock: p.clock,
                split,
                end: p.end,
                by: self.ctx.me.0.clone(),
            };
            match self.ctx.peers.call(&addr, &offer, CALL_TIMEOUT).await {
                Ok(Response::Offer(true)) => {
                    let parts: Vec<u32> = (split..p.end).collect();
                    tracing::debug!(owner = %owner, clock = p.clock, split, end = p.end, "took over a chunk");
                    let u = self
                        .compute_paced(parts.clone(), p.clock, How::Helped { owner })
                        .await;
                    samples += u.samples as u64;
                    if !self.push_all(p.clock, &parts, u.delta).await {
                        break;
                    }
                    let done = Request::ChunkPushed {
                        clock: p.clock,
                        start: split,
                        end: p.end,
                    };
                    let peers = self.ctx.peers.clone();
                    tokio::spawn(async move {
                        let _ = peers.call(&addr, &done, CALL_TIMEOUT).await;
                    });
                }
                Ok(Response::Offer(false)) => {}
                _ => break,
            }
        }
        samples
    }

    /// Warned: hand what is left of the current clock to the helper group at once (each helper
    /// a contiguous chunk); compute here whatever no helper took.
    async fn hand_over_rest(&mut self) {
        let Some((clock, rest)) = self.ctx.board.take_left_over() else {
            return;
        };
        if rest.is_empty() {
            return;
        }
        let t = Instant::now();
        self.refresh_view();
        let group = self.ctx.sync.helper_group().unwrap_or(1);
        let helpers: Vec<(InstanceId, String)> =
            reassign::helper_group(&self.view, &self.ctx.me, group)
                .into_iter()
                .filter_map(|h| {
                    let addr = self.view.data_addr(&h)?.to_string();
                    Some((h, addr))
                })
                .collect();
        let n = helpers.len().max(1) as u32;
        let len = rest.len() as u32;
        let mut calls = Vec::new();
        for (i, (h, addr)) in helpers.into_iter().enumerate() {
            let i = i as u32;
            let parts: Vec<u32> =
                (rest.start + i * len / n..rest.start + (i + 1) * len / n).collect();
            if parts.is_empty() {
                continue;
            }
            let peers = self.ctx.peers.clone();
            let req = Request::Delegate {
                clock,
                partitions: parts.clone(),
            };
            calls.push((
                h,
                parts,
                tokio::spawn(async move { peers.call(&addr, &req, CALL_TIMEOUT).await }),
            ));
        }
        let mut leftover: Vec<u32> = if calls.is_empty() {
            rest.clone().collect()
        } else {
            Vec::new()
        };
        let mut to = Vec::new();
        for (h, parts, call) in calls {
            match call.await {
                Ok(Ok(Response::Ack)) => to.push(format!("{h}:{}", ranges(&parts))),
                other => {
                    tracing::warn!(helper = %h, ?other, "helper did not take its chunk; computing it here");
                    leftover.extend(parts);
                }
            }
        }
        if !leftover.is_empty() {
            let u = self.compute_paced(leftover.clone(), clock, How::Own).await;
            self.push_all(clock, &leftover, u.delta).await;
        }
        tracing::info!(
            clock,
            partitions = %ranges(&rest.collect::<Vec<_>>()),
            helpers = ?to,
            computed_here = %ranges(&leftover),
            ms = t.elapsed().as_millis() as u64,
            "handed the rest of the clock to the helpers"
        );
    }

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
    /// With `resend`, partitions of `need` that a shard lacks and that are ours now are
    /// recomputed (lost pushes, inherited partitions), except those a live helper took over.
    async fn pull_all(&mut self, need: Option<u64>, resend: bool) -> bool {
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
            // A pull that waits long says what the shard lacks and why this worker sends none
            // of it (not its partition, or a live helper's): what to read when a job stalls.
            let waiting_since = Instant::now();
            let mut told = Duration::ZERO;
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
                    Ok(Response::NotReady { missing })
                        if waiting_since.elapsed() >= told + STALL_REPORT_EVERY =>
                    {
                        told = waiting_since.elapsed();
                        let mine = self.my_partitions().unwrap_or_default();
                        let helped: Vec<u32> = missing
                            .iter()
                            .copied()
                            .filter(|m| {
                                need.is_some_and(|c| self.ctx.board.given_away(c, *m, &self.view))
                            })
                            .collect();
                        tracing::warn!(shard = s, clock = ?need, waited_s = told.as_secs(),
                            missing = ?missing, mine = ?mine, given_to_live_helpers = ?helped,
                            epoch = self.view.epoch, resend,
                            "a pull has waited long: the shard lacks these partitions' updates");
                    }
                    Ok(Response::NotReady { .. }) if !resend => {}
                    Ok(Response::NotReady { missing }) => {
                        // Lost or never-sent updates of partitions that are ours now: resend.
                        let mine = self.my_partitions().unwrap_or_default();
                        let redo: Vec<u32> = missing
                            .into_iter()
                            .filter(|m| mine.contains(m))
                            .filter(|m| {
                                need.is_none_or(|c| !self.ctx.board.given_away(c, *m, &self.view))
                            })
                            .collect();
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
                                tracing::debug!(target: "proteus_agent::audit", clock = c, partitions = %ranges(&redo), how = ?How::Resent, "processed");
                                self.audit(AuditEvent::Processed {
                                    worker: self.ctx.me.clone(),
                                    clock: c,
                                    partitions: redo.clone(),
                                    how: How::Resent,
                                });
                                self.ctx
                                    .samples
                                    .fetch_add(update.samples as u64, Ordering::Relaxed);
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

    /// Push the update of `parts` at `clock` to every shard; false if unassigned meanwhile.
    async fn push_all(&mut self, clock: u64, parts: &[u32], delta: Vec<f32>) -> bool {
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
            if !self.push_one(s, clock, parts, &delta).await {
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
                Ok(Response::Pushed(PushOutcome::BeyondBound { done })) => {
                    // The shard has not seen the clocks this push depends on complete: not
                    // applied. Retry once they are in (or the layout changes).
                    tracing::warn!(
                        shard = s,
                        clock,
                        ?done,
                        "push beyond the shard's staleness bound refused; retrying"
                    );
                    self.await_newer_view().await;
                }
                Ok(Response::Error(e)) => {
                    tracing::error!(shard = s, error = %e, "push refused");
                    self.await_newer_view().await;
                }
                _ => self.await_newer_view().await,
            }
        }
    }

    /// Rank 0 evaluates the parameters it starts a clock with, every `eval_every_clocks`, off
    /// the training path: the evaluation runs on a blocking thread while the worker goes on, so
    /// a frequent metric does not make rank 0 a straggler. A late result never replaces a newer
    /// one (the final metric included).
    fn maybe_evaluate(&self) {
        let every = self.ctx.eval_every_clocks;
        let rank0 = self.view.worker(&self.ctx.me).is_some_and(|w| w.rank == 0);
        if every == 0 || !rank0 || self.clock == 0 || !self.clock.is_multiple_of(every) {
            return;
        }
        let app = self.ctx.app.clone();
        let params = self.params.clone();
        let clock = self.clock;
        let progress = self.ctx.progress.clone();
        tokio::task::spawn_blocking(move || {
            let Some(m) = app.evaluate(&params, clock) else {
                return;
            };
            tracing::info!(clock, kind = %m.kind, value = m.value, "evaluated");
            if let Ok(mut p) = progress.lock()
                && p.metric.is_none_or(|old| old.clock < m.clock)
            {
                p.metric = Some(m);
            }
        });
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
        if !self.pull_all(need, true).await {
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
            p.samples_processed = self.ctx.samples.load(Ordering::Relaxed);
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
    fn add(&mut self, samples: u64, _elapsed: Duration) {
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
