//! An agent's part in an MLP job: the pipeline (or data-parallel) worker the control loop runs
//! instead of the parameter-server worker.
//!
//! The job's workers, in rank order, are the plan's workers. The broker plans (see
//! [`super::planning`]): from the job's pinned profile, or from the profile of the member its
//! view names (a reliable one when there is one), which measures the model on its machine and
//! sends it. The plans, one per worker count up to the founders', arrive in the view, so every
//! worker runs the same plan and re-planning after a warning is a lookup in the broker's table.
//! A warned agent tells the current leader (see [`super::stage::run`]); its stage's state moves to
//! the survivors before it leaves. At the end, every stage sends its layers to the last leader,
//! which evaluates the whole model and reports the job's final metric.

use super::schedule::ScheduleKind;
use super::stage::{self, AddressBook, Batches, Notices, RunConfig, StageCtx, StageError};
use super::{PipeMsg, Plan, profile};
use crate::apps::mlp::{self, MlpJob};
use crate::transport::{Handler, Peers, Request, Response};
use crate::worker::{SharedProgress, WorkerEvent};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::{
    ClusterView, Metric, MetricKind, PipelineSchedule, StopCondition, TrainingConfig,
};
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::{mpsc, watch};

/// The segment number of the final hand-in of layers to the leader.
pub const FINAL_SEGMENT: u32 = u32::MAX;

/// Sends pipeline messages to the pipeline's inbox and everything else to the parameter server.
pub struct Router {
    ps: Arc<dyn Handler>,
    pipe: mpsc::UnboundedSender<PipeMsg>,
}

impl Router {
    /// The router and the receiving end of the pipeline inbox (messages wait there until the
    /// pipeline starts).
    pub fn new(ps: Arc<dyn Handler>) -> (Arc<Router>, mpsc::UnboundedReceiver<PipeMsg>) {
        let (pipe, rx) = mpsc::unbounded_channel();
        (Arc::new(Router { ps, pipe }), rx)
    }
}

impl Handler for Router {
    fn handle(self: Arc<Self>, req: Request) -> Pin<Box<dyn Future<Output = Response> + Send>> {
        match req {
            Request::Opaque(payload) => {
                Box::pin(async move { stage::receive(&self.pipe, &payload) })
            }
            other => self.ps.clone().handle(other),
        }
    }
}

/// Everything an agent's pipeline member needs.
pub struct MemberCtx {
    pub me: InstanceId,
    pub view: Arc<ClusterView>,
    /// Every view the agent applies (the broker's plans arrive in one).
    pub views: watch::Receiver<Option<Arc<ClusterView>>>,
    pub peers: Arc<Peers>,
    pub inbox: mpsc::UnboundedReceiver<PipeMsg>,
    pub job: Arc<MlpJob>,
    pub training: TrainingConfig,
    pub notices: Arc<Notices>,
    pub progress: SharedProgress,
    pub events: mpsc::UnboundedSender<WorkerEvent>,
}

/// Why the member ended.
#[derive(Debug, PartialEq, Eq)]
pub enum MemberExit {
    Finished,
    /// Warned: state handed to the survivors.
    Evicted,
}

/// How often the profiler sends its profile again while no plans arrive (an event is sent
/// once, best effort; the broker ignores a repeat).
const PROFILE_RESEND: std::time::Duration = std::time::Duration::from_secs(10);

/// The broker's plans, from the views: waits for a view that carries them, up to
/// [`stage::MESSAGE_TIMEOUT`] after the last sign of progress. When a view names this member
/// the profiler, it measures the model on its machine and sends the profile.
async fn broker_plans(ctx: &MemberCtx) -> Result<BTreeMap<u32, Plan>, StageError> {
    let layers = ctx.job.shape.layers();
    let mut views = ctx.views.clone();
    let mut profile: Option<Vec<proteus_wire::agent_api::LayerTiming>> = None;
    let mut sent: Option<tokio::time::Instant> = None;
    let mut deadline = tokio::time::Instant::now() + stage::MESSAGE_TIMEOUT;
    loop {
        let view = views.borrow_and_update().clone();
        if let Some(view) = view {
            if let Some(plans) = &view.pipeline {
                return super::planning::from_wire(plans, layers)
                    .map_err(|e| StageError::Config(format!("the broker's plans: {e}")));
            }
            if view.profiler.as_ref() == Some(&ctx.me) && profile.is_none() {
                let job = ctx.job.clone();
                let p = tokio::task::spawn_blocking(move || {
                    profile::profile(&job.shape, job.batch, 5, 1)
                })
                .await
                .map_err(|_| StageError::InboxClosed)?;
                let timings = p.timings();
                tracing::info!(
                    profile = %serde_json::to_string(&timings).unwrap_or_default(),
                    "pipeline profile measured, sent to the broker to plan from \
                     (training.pipeline.profile pins it)"
                );
                profile = Some(timings);
                deadline = tokio::time::Instant::now() + stage::MESSAGE_TIMEOUT;
            }
        }
        let now = tokio::time::Instant::now();
        if let Some(p) = &profile
            && sent.is_none_or(|at| now >= at + PROFILE_RESEND)
        {
            let _ = ctx.events.send(WorkerEvent::PipelineProfile(p.clone()));
            sent = Some(now);
        }
        let wait = match sent {
            Some(at) => deadline.min(at + PROFILE_RESEND),
            None => deadline,
        };
        match tokio::time::timeout_at(wait, views.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(StageError::InboxClosed),
            Err(_) if tokio::time::Instant::now() < deadline => {}
            Err(_) => {
                return Err(StageError::Timeout(
                    stage::MESSAGE_TIMEOUT,
                    "the broker's plans".into(),
                ));
            }
        }
    }
}

/// How often a newcomer says again that it is ready while it waits to be folded in (a leader
/// that was busy handing over, or gone, may have missed it).
const ANNOUNCE_EVERY: std::time::Duration = std::time::Duration::from_secs(15);

/// What waiting for the plan table came to.
enum Waited {
    /// The table, and the stage's inbox (what arrived meanwhile first, in order).
    Plans(Vec<f32>, mpsc::UnboundedReceiver<PipeMsg>),
    /// A newcomer warned before anyone folded it in.
    Warned,
}

/// A newcomer's announcement: to whom, and where it is reachable.
struct Announce<'a> {
    peers: &'a Arc<Peers>,
    to: Vec<String>,
    me: String,
    notices: &'a Notices,
}

/// A newcomer's wait for the plan table, which the pipeline's leader sends when it folds it
/// in: it tells every worker it knows of that it is ready, again every [`ANNOUNCE_EVERY`], and
/// waits as long as it takes (its agent stops it when the job ends).
async fn await_plans(
    mut inbox: mpsc::UnboundedReceiver<PipeMsg>,
    a: Announce<'_>,
) -> Result<Waited, StageError> {
    let mut early = Vec::new();
    let table = loop {
        if a.notices.is_warned(u32::MAX) {
            return Ok(Waited::Warned);
        }
        let ready = PipeMsg::Ready { addr: a.me.clone() }.to_request();
        for to in &a.to {
            // Best effort: a worker that does not answer is leaving or not leading.
            let _ = a.peers.call(to, &ready, ANNOUNCE_EVERY).await;
        }
        let deadline = tokio::time::Instant::now() + ANNOUNCE_EVERY;
        let got = loop {
            match tokio::time::timeout_at(deadline, inbox.recv()).await {
                Ok(Some(PipeMsg::Plans { table })) => break Some(table),
                Ok(Some(other)) => early.push(other),
                Ok(None) => return Err(StageError::InboxClosed),
                Err(_) => break None,
            }
        };
        if let Some(table) = got {
            break table;
        }
    };
    let (tx, rx) = mpsc::unbounded_channel();
    for m in early {
        let _ = tx.send(m);
    }
    // Keep forwarding from the real inbox.
    tokio::spawn(async move {
        while let Some(m) = inbox.recv().await {
            if tx.send(m).is_err() {
                return;
            }
        }
    });
    Ok(Waited::Plans(table, rx))
}

/// Run this agent's pipeline worker until the job's last minibatch or its eviction.
///
/// The pipeline's workers are the job's founders (its first layout, see
/// [`ClusterView::founders`]), numbered by their position there. An agent that is not one (a
/// replacement) is a newcomer: it says it is ready, and the pipeline's leader folds it in by a
/// re-plan as soon as a plan has room for it (after a warned worker left).
/// Minibatches stepped, as the job's clocks: `clocks_per_epoch` a pass over the training set
/// when the job stops after epochs; one a minibatch when it stops after a number of clocks
/// (which a pipeline counts in minibatches).
fn job_clock(
    training: &TrainingConfig,
    per_epoch: u64,
) -> impl Fn(u64) -> u64 + Send + Copy + 'static {
    let scale = match training.stop {
        StopCondition::Epochs { .. } => Some(u64::from(training.clocks_per_epoch)),
        StopCondition::Clocks { .. } => None,
    };
    move |minibatches| match scale {
        Some(clocks) => minibatches.saturating_mul(clocks) / per_epoch.max(1),
        None => minibatches,
    }
}

pub async fn run(ctx: MemberCtx) -> Result<MemberExit, StageError> {
    let founders: Vec<InstanceId> = if ctx.view.founders.is_empty() {
        // A broker that predates founders: the first view's workers.
        ctx.view
            .workers
            .iter()
            .map(|w| w.instance_id.clone())
            .collect()
    } else {
        ctx.view.founders.clone()
    };
    let n = founders.len() as u32;
    let addr_of = |id: &InstanceId| ctx.view.data_addr(id).unwrap_or_default().to_string();
    let mut book: Vec<String> = founders.iter().map(addr_of).collect();
    let founder = founders.iter().position(|f| *f == ctx.me).map(|p| p as u32);
    let layers = ctx.job.shape.layers();
    let (rank, inbox, plans) = match founder {
        Some(rank) => {
            let plans = broker_plans(&ctx).await?;
            (rank, ctx.inbox, plans)
        }
        None => {
            let me = addr_of(&ctx.me);
            let to = ctx
                .view
                .members
                .iter()
                .filter(|m| m.instance_id != ctx.me)
                .map(|m| m.data_addr.clone())
                .collect();
            tracing::info!(
                founders = n,
                "joining a running pipeline: telling its workers"
            );
            let announce = Announce {
                peers: &ctx.peers,
                to,
                me: me.clone(),
                notices: &ctx.notices,
            };
            let (table, inbox) = match await_plans(ctx.inbox, announce).await? {
                Waited::Plans(table, inbox) => (table, inbox),
                Waited::Warned => {
                    tracing::warn!("warned before joining the pipeline: leaving");
                    return Ok(MemberExit::Evicted);
                }
            };
            let plans = super::decode_plans(&table, layers).ok_or(StageError::Shape(0))?;
            // Listed after the founders until the leader's book (in the re-plan that folds
            // this worker in) gives it its number.
            book.push(me);
            (n, inbox, plans)
        }
    };
    let addrs = AddressBook::new(book);
    let plan = plans.get(&n).cloned().ok_or(StageError::NoPlan(n))?;
    if rank == 0 {
        tracing::info!(%plan, "pipeline plan");
    }
    let batches = Batches::new(ctx.job.train.len(), ctx.job.batch, ctx.training.seed);
    let minibatches = match ctx.training.stop {
        StopCondition::Epochs { epochs } => batches.per_epoch() * u64::from(epochs),
        StopCondition::Clocks { clocks } => clocks,
    };
    let mut replans = plans;
    replans.remove(&n);
    let schedule = match ctx.job.pipeline.schedule {
        PipelineSchedule::OneFOneB => ScheduleKind::OneFOneB,
        PipelineSchedule::TwoBW => ScheduleKind::TwoBW {
            group: super::schedule::two_bw_group(&plan),
        },
    };
    let cfg = RunConfig {
        shape: ctx.job.shape.clone(),
        plan,
        schedule,
        batches,
        minibatches,
        lr: ctx.job.lr,
        momentum: ctx.job.momentum,
        seed: ctx.training.seed,
        checkpoint_every: 0,
        replans,
        warn_at: None,
        drain_at: None,
        join_at: None,
        snapshot_every: u64::from(ctx.job.pipeline.snapshot_every),
        kill_at: None,
        allreduce_bucket_bytes: super::stage::DEFAULT_BUCKET_BYTES,
        vertical_sync: ctx.job.pipeline.vertical_sync,
    };
    // Heartbeats report the minibatches this worker has stepped through, in the job's clocks:
    // the broker counts progress as clocks over the stop condition's (`clocks_per_epoch` a
    // pass), not minibatches. Reported as minibatches, a two-epoch job looked done after 40 of
    // its 1,875, and its policy bought no replacement for a warned stage (the work being
    // "complete").
    let steps = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let per_epoch = cfg.batches.per_epoch().max(1);
    let clock_of = job_clock(&ctx.training, per_epoch);
    let reporter = {
        let (steps, progress) = (steps.clone(), ctx.progress.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(200));
            loop {
                tick.tick().await;
                let n = steps.load(std::sync::atomic::Ordering::Relaxed);
                if let Ok(mut p) = progress.lock() {
                    p.clock = clock_of(n);
                    p.epoch = n as f64 / per_epoch as f64;
                }
            }
        })
    };
    let sctx = StageCtx {
        worker: rank,
        addrs: addrs.clone(),
        peers: ctx.peers.clone(),
        inbox,
        train: ctx.job.train.clone(),
        cfg: Arc::new(cfg),
        checkpoints: None,
        notices: Some(ctx.notices.clone()),
        steps: Some(steps),
        resumed: Some(ctx.events.clone()),
    };
    let result = stage::run_keeping_inbox(sctx).await;
    reporter.abort();
    let (outcome, (mut inbox, left)) = result?;
    // Final layers that arrived while this worker was still training come first.
    let (early_tx, mut pending) = mpsc::unbounded_channel();
    for m in left {
        let _ = early_tx.send(m);
    }
    drop(early_tx);
    if let Ok(mut p) = ctx.progress.lock() {
        p.samples_processed = outcome.samples as u64;
        // Only a worker that saw the run through reports it whole. A warned one keeps the
        // minibatches it stepped through: its last heartbeats must not tell the broker the job
        // is done (it then bought no replacement for it, its work being "complete").
        if !outcome.evicted {
            p.clock = clock_of(minibatches);
        }
    }
    if outcome.evicted {
        return Ok(MemberExit::Evicted);
    }
    // Hand the final layers to the last leader, which evaluates the whole model.
    let leader = outcome.final_members.first().copied().unwrap_or(0);
    if outcome.replica == 0 {
        for (i, l) in outcome.layers.iter().enumerate() {
            let msg = PipeMsg::State {
                segment: FINAL_SEGMENT,
                layer: (outcome.first_layer + i) as u32,
                weights: mlp::flatten(std::slice::from_ref(l)),
                velocity: Vec::new(),
            };
            let addr = addrs.get(leader).unwrap_or_default();
            match ctx
                .peers
                .call(&addr, &msg.to_request(), stage::MESSAGE_TIMEOUT)
                .await
            {
                Ok(Response::Ack) => {}
                other => {
                    return Err(StageError::Send {
                        worker: leader,
                        message: format!("final layers: {other:?}"),
                    });
                }
            }
        }
    }
    if outcome.worker == leader {
        let init = ctx.job.shape.init(0);
        let mut got: BTreeMap<u32, mlp::Dense> = BTreeMap::new();
        while got.len() < layers {
            let next = match pending.try_recv() {
                Ok(m) => Ok(Some(m)),
                Err(_) => tokio::time::timeout(stage::MESSAGE_TIMEOUT, inbox.recv()).await,
            };
            match next {
                Ok(Some(PipeMsg::State {
                    segment,
                    layer,
                    weights,
                    ..
                })) if segment == FINAL_SEGMENT && (layer as usize) < layers => {
                    let like = std::slice::from_ref(&init[layer as usize]);
                    let l = mlp::unflatten(like, &weights).ok_or(StageError::Shape(0))?;
                    got.extend(l.into_iter().map(|l| (layer, l)));
                }
                Ok(Some(_)) => {}
                Ok(None) => return Err(StageError::InboxClosed),
                Err(_) => {
                    return Err(StageError::Timeout(
                        stage::MESSAGE_TIMEOUT,
                        "the final layers".into(),
                    ));
                }
            }
        }
        let model: Vec<mlp::Dense> = got.into_values().collect();
        let job = ctx.job.clone();
        let acc = tokio::task::spawn_blocking(move || mlp::accuracy(&model, &job.test))
            .await
            .unwrap_or(0.0);
        let metric = Metric {
            kind: MetricKind::Accuracy,
            value: acc,
            baseline: None,
            clock: minibatches,
        };
        tracing::info!(accuracy = acc, "pipeline training finished");
        if let Ok(mut p) = ctx.progress.lock() {
            p.metric = Some(metric);
        }
        let _ = ctx.events.send(WorkerEvent::Finished(Some(metric)));
    }
    Ok(MemberExit::Finished)
}

#[cfg(test)]
mod tests {
    use super::super::StagePlan;
    use super::*;

    #[test]
    fn plan_tables_roundtrip() {
        let mut plans = BTreeMap::new();
        plans.insert(1, Plan::data_parallel(3, 1, 0.5));
        let p = Plan::new(
            vec![
                StagePlan {
                    layers: 0..1,
                    replicas: 2,
                },
                StagePlan {
                    layers: 1..3,
                    replicas: 1,
                },
            ],
            3,
            0.25,
        )
        .unwrap();
        plans.insert(3, p);
        assert_eq!(
            super::super::decode_plans(&super::super::encode_plans(plans.values()), 3),
            Some(plans)
        );
        assert_eq!(super::super::decode_plans(&[1.0, 0.0, 2.0], 3), None);
    }
}

#[cfg(test)]
mod clock_tests {
    use super::*;

    #[test]
    fn minibatches_are_reported_in_the_jobs_clocks() {
        let mut t = TrainingConfig::new(proteus_wire::agent_api::AppConfig::Mlr {
            dataset: Default::default(),
            learning_rate: 0.1,
            l2: 0.0,
        });
        t.stop = StopCondition::Epochs { epochs: 2 };
        t.clocks_per_epoch = 20;
        // 938 minibatches a pass: the run's 1,876 are the job's 40 clocks, and a quarter of
        // them a quarter.
        let c = job_clock(&t, 938);
        assert_eq!(c(1876), t.total_clocks());
        assert_eq!(c(469), 10);
        assert_eq!(c(0), 0);
        t.stop = StopCondition::Clocks { clocks: 500 };
        let c = job_clock(&t, 938);
        assert_eq!(c(500), t.total_clocks());
    }
}
