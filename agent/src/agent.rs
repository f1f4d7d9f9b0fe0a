//! The agent's control loop: register, load data, follow views, report, and leave in time.

use crate::apps::App;
use crate::control::Broker;
use crate::error::{AgentError, Result};
use crate::imds::{self, Imds, Notice};
use crate::pipeline::{PipeMsg, member, stage::Notices};
use crate::ps::{self, PsEvent, PsNode};
use crate::reassign::{Board, Node};
use crate::session::{AgentOptions, Control, Outcome, heartbeats, now_unix, poll_commands};
use crate::straggler::Pace;
use crate::sync::SyncPolicy;
use crate::transport::{DataPlane, Peers};
use crate::worker::{self, SharedProgress, WorkerCtx, WorkerEvent, WorkerExit};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::{
    AgentEvent, BOOTSTRAP_TOKEN_PREFIX, BootstrapRequest, ClusterView, ExitReason, Metric,
    MetricKind, RegisterRequest, RegisterResponse,
};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Run the agent to its end.
pub async fn run(opts: AgentOptions) -> Result<Outcome> {
    let mut imds = match &opts.imds_endpoint {
        Some(url) => Some(Imds::new(url)?),
        None => None,
    };
    let instance_id = resolve_instance_id(&opts, imds.as_mut()).await?;
    let listener = TcpListener::bind(opts.listen).await?;
    let data_addr = advertised_addr(&opts, listener.local_addr()?, imds.as_mut()).await;
    let token = agent_token(&opts, &instance_id).await?;
    let broker = Broker::new(&opts.broker, &token, opts.ca_file.as_deref())?;
    tracing::info!(instance = %instance_id, broker = %broker.url(), data_addr = %data_addr, "registering");
    let reg = broker
        .register(&RegisterRequest {
            instance_id: instance_id.clone(),
            data_addr: data_addr.clone(),
            vcpus: opts.vcpus,
            agent_version: env!("CARGO_PKG_VERSION").into(),
            protocol_version: proteus_wire::agent_api::PROTOCOL_VERSION,
        })
        .await?;
    tracing::info!(job = %reg.job_id, tier = %reg.tier, app = reg.training.app.name(), "registered");
    if let proteus_wire::agent_api::AppConfig::Command(cfg) = &reg.training.app {
        drop(listener);
        let cfg = cfg.clone();
        return crate::command::run(&opts, cfg, reg, broker, instance_id, imds).await;
    }
    let mut agent = match Agent::start(
        &opts,
        reg,
        broker.clone(),
        instance_id.clone(),
        data_addr,
        listener,
    )
    .await
    {
        Ok(a) => a,
        Err(e) => {
            let reason = ExitReason::failed(&e.to_string());
            let _ = broker
                .event(&instance_id, &AgentEvent::Exit { reason })
                .await;
            return Err(e);
        }
    };
    if let Some(imds) = imds {
        tokio::spawn(imds::watch(imds, opts.imds_poll, agent.notices_tx.clone()));
    }
    agent.main_loop(opts.exit_margin).await
}

/// The agent token: the one given, or, when that is the instance's bootstrap token, the one the
/// broker trades it for (written over the token file, atomically, before it is used).
async fn agent_token(opts: &AgentOptions, instance_id: &InstanceId) -> Result<String> {
    if !opts.token.starts_with(BOOTSTRAP_TOKEN_PREFIX) {
        return Ok(opts.token.clone());
    }
    let broker = Broker::new(&opts.broker, &opts.token, opts.ca_file.as_deref())?;
    tracing::info!(instance = %instance_id, broker = %broker.url(), "trading the bootstrap token");
    let token = broker
        .bootstrap(&BootstrapRequest {
            instance_id: instance_id.clone(),
        })
        .await?;
    if let Some(file) = &opts.token_file {
        replace_private(file, &token)?;
    }
    Ok(token)
}

/// Writes `text` over `file` (readable by this user only) by renaming a new file over it:
/// a crash leaves the old or the new content, never a half.
fn replace_private(file: &std::path::Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |e: std::io::Error| {
        AgentError::Config(format!(
            "writing the agent token to {}: {e}",
            file.display()
        ))
    };
    let tmp = file.with_extension("new");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    f.write_all(format!("{text}\n").as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, file).map_err(io)?;
    Ok(())
}

/// What peers dial: `--advertise`, else the bound address; a wildcard bind is replaced by the
/// instance's private IPv4 from metadata (or loopback when there is none, for local runs).
async fn advertised_addr(
    opts: &AgentOptions,
    bound: SocketAddr,
    imds: Option<&mut Imds>,
) -> String {
    if let Some(a) = &opts.advertise {
        return a.clone();
    }
    if !bound.ip().is_unspecified() {
        return bound.to_string();
    }
    let ip = match imds {
        Some(imds) => imds
            .get("meta-data/local-ipv4")
            .await
            .ok()
            .flatten()
            .map(|s| s.trim().to_string()),
        None => None,
    };
    let ip = ip.filter(|s| s.parse::<std::net::IpAddr>().is_ok()).unwrap_or_else(|| {
        tracing::warn!("listening on a wildcard address and no local-ipv4 in metadata: advertising 127.0.0.1");
        "127.0.0.1".into()
    });
    format!("{ip}:{}", bound.port())
}

async fn resolve_instance_id(opts: &AgentOptions, imds: Option<&mut Imds>) -> Result<InstanceId> {
    if let Some(id) = &opts.instance_id {
        return Ok(InstanceId(id.clone()));
    }
    let imds = imds.ok_or_else(|| {
        AgentError::Config(
            "no --instance-id and no instance metadata endpoint to read it from".into(),
        )
    })?;
    let mut delay = Duration::from_millis(200);
    for _ in 0..6 {
        match imds.instance_id().await {
            Ok(id) => return Ok(InstanceId(id)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read instance-id from metadata; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
        }
    }
    Err(AgentError::Imds("instance-id unavailable".into()))
}

struct Agent {
    me: InstanceId,
    broker: Broker,
    app: Arc<App>,
    reg: RegisterResponse,
    ps: Arc<PsNode>,
    node: Arc<Node>,
    board: Arc<Board>,
    pace: Arc<Pace>,
    samples: Arc<AtomicU64>,
    peers: Arc<Peers>,
    views_tx: watch::Sender<Option<Arc<ClusterView>>>,
    progress: SharedProgress,
    applied_epoch: Arc<AtomicU64>,
    control_rx: mpsc::UnboundedReceiver<Control>,
    notices_tx: mpsc::UnboundedSender<Notice>,
    notices_rx: mpsc::UnboundedReceiver<Notice>,
    worker_tx: mpsc::UnboundedSender<WorkerEvent>,
    worker_rx: mpsc::UnboundedReceiver<WorkerEvent>,
    ps_rx: mpsc::UnboundedReceiver<PsEvent>,
    worker: Option<JoinHandle<WorkerExit>>,
    /// MLP jobs: the pipeline worker (instead of the parameter-server worker), its inbox until it
    /// starts, and where interruption notices reach it.
    pipeline: Option<JoinHandle<Result<member::MemberExit, crate::pipeline::stage::StageError>>>,
    pipe_inbox: Option<mpsc::UnboundedReceiver<PipeMsg>>,
    pipe_notices: Arc<Notices>,
    finished: bool,
    /// Set by an interruption warning: leave by then.
    leave_by: Option<Instant>,
}

impl Agent {
    async fn start(
        opts: &AgentOptions,
        reg: RegisterResponse,
        broker: Broker,
        me: InstanceId,
        data_addr: String,
        listener: TcpListener,
    ) -> Result<Agent> {
        // Heartbeats start before the (slow) data load so the member is not declared dead.
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let progress: SharedProgress = Arc::new(Mutex::new(Default::default()));
        let applied_epoch = Arc::new(AtomicU64::new(0));
        let ps_cell: Arc<OnceLock<Arc<PsNode>>> = Arc::new(OnceLock::new());
        let shards = {
            let ps_cell = ps_cell.clone();
            move || ps_cell.get().map(|ps| ps.roles())
        };
        tokio::spawn(heartbeats(
            broker.clone(),
            me.clone(),
            Duration::from_millis(reg.heartbeat_interval_ms),
            progress.clone(),
            shards,
            applied_epoch.clone(),
            control_tx.clone(),
        ));
        let t = Instant::now();
        let cfg = reg.training.clone();
        let dir = opts.data_dir.clone();
        let app = tokio::task::spawn_blocking(move || App::load(&cfg, &dir))
            .await
            .map_err(|e| AgentError::Data(format!("loader crashed: {e}")))??;
        let app = Arc::new(app);
        tracing::info!(
            model_len = app.model_len(),
            ms = t.elapsed().as_millis() as u64,
            "data loaded"
        );

        // MLP jobs may emulate slow links between agents (all of this agent's connections).
        let (link, latency) = match &*app {
            App::Mlp(job) => (job.link_bytes_per_sec, job.link_latency),
            _ => (None, None),
        };
        let secret = reg.data_secret.clone().ok_or_else(|| {
            AgentError::Config(
                "the broker sent no data-plane secret (a broker older than this agent?)".into(),
            )
        })?;
        let plane = DataPlane::new(secret, app.max_frame(&reg.training))
            .with_link_limit(link)
            .with_link_latency(latency);
        tracing::info!(max_frame = plane.max_frame(), "data plane bound");
        let peers = Peers::new(data_addr, plane);
        let (ps_tx, ps_rx) = mpsc::unbounded_channel();
        let ps = PsNode::with_slack(
            me.clone(),
            app.clone(),
            reg.training.num_partitions,
            reg.training.sync.slack(),
            peers.clone(),
            ps_tx,
        );
        let board = Board::new();
        let node = Node::new(me.clone(), ps.clone(), board.clone(), None);
        // Pipeline messages go to the pipeline member; the rest to RapidReassignment's node,
        // which serves the parameter-server shards too.
        let (router, pipe_inbox) = member::Router::new(node.clone());
        peers.set_handler(router);
        let pace = Arc::new(Pace::new(
            reg.training.stragglers,
            opts.slowdown,
            reg.training.seed,
        ));
        let _ = ps_cell.set(ps.clone());
        tokio::spawn(peers.clone().serve(listener));
        tokio::spawn(ps::run_backup_sync(
            ps.clone(),
            Duration::from_millis(reg.training.backup_sync_interval_ms),
        ));

        broker
            .event(
                &me,
                &AgentEvent::Ready {
                    model_len: app.model_len() as u64,
                },
            )
            .await?;

        tokio::spawn(poll_commands(
            broker.clone(),
            me.clone(),
            reg.command_wait_ms,
            control_tx,
        ));
        let (notices_tx, notices_rx) = mpsc::unbounded_channel();
        let (worker_tx, worker_rx) = mpsc::unbounded_channel();
        let (views_tx, _) = watch::channel(None);
        Ok(Agent {
            me,
            broker,
            app,
            reg,
            ps,
            node,
            board,
            pace,
            samples: Arc::new(AtomicU64::new(0)),
            peers,
            views_tx,
            progress,
            applied_epoch,
            control_rx,
            notices_tx,
            notices_rx,
            worker_tx,
            worker_rx,
            ps_rx,
            worker: None,
            pipeline: None,
            pipe_inbox: Some(pipe_inbox),
            pipe_notices: Arc::new(Notices::default()),
            finished: false,
            leave_by: None,
        })
    }

    async fn event(&self, ev: AgentEvent) {
        if let Err(e) = self.broker.event(&self.me, &ev).await {
            tracing::warn!(error = %e, ?ev, "could not report event");
        }
    }

    async fn exit(&mut self, reason: ExitReason, outcome: Outcome) -> Result<Outcome> {
        if let Some(p) = self.pipeline.take() {
            p.abort();
        }
        if let Some(w) = self.worker.take() {
            w.abort();
        }
        self.event(AgentEvent::Exit { reason }).await;
        // This agent is done with the job: its secret opens nothing here any more.
        self.peers.revoke();
        tracing::info!(?outcome, "agent exiting");
        Ok(outcome)
    }

    async fn main_loop(&mut self, exit_margin: Duration) -> Result<Outcome> {
        let mut check = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                Some(c) = self.control_rx.recv() => match c {
                    Control::Configure(view) => self.configure(*view),
                    Control::Stop(reason) => {
                        tracing::info!(%reason, "stop command");
                        return self.exit(ExitReason::Stopped, Outcome::Stopped(reason)).await;
                    }
                    Control::JobOver => {
                        return self.exit(ExitReason::Stopped, Outcome::Stopped("job over".into())).await;
                    }
                    Control::Forgotten => {
                        return Err(AgentError::Broker("the broker no longer knows this instance (declared dead?)".into()));
                    }
                },
                Some(n) = self.notices_rx.recv() => self.on_notice(n, exit_margin).await,
                Some(ev) = self.worker_rx.recv() => match ev {
                    WorkerEvent::Finished(metric) => {
                        self.finished = true;
                        let metric = metric.unwrap_or(Metric { kind: MetricKind::Accuracy, value: 0.0, baseline: None, clock: 0 });
                        self.event(AgentEvent::TrainingComplete { metric }).await;
                    }
                    WorkerEvent::PipelineResumed { segment, from, workers, pause } => {
                        let pause_ms = pause.as_millis() as u64;
                        self.event(AgentEvent::PipelineResumed { segment, from, workers, pause_ms }).await;
                    }
                    WorkerEvent::PipelineProfile(layers) => {
                        self.event(AgentEvent::PipelineProfile { layers }).await;
                    }
                },
                Some(PsEvent::HandedOver { shard, to, seq }) = self.ps_rx.recv() => {
                    self.event(AgentEvent::HandoverComplete { shard, to, seq }).await;
                }
                _ = check.tick() => {
                    if let Some(out) = self.check_leaving().await {
                        return out;
                    }
                    if let Some(failed) = self.reap_pipeline().await {
                        return failed;
                    }
                    self.reap_worker();
                }
            }
        }
    }

    fn configure(&mut self, view: ClusterView) {
        if view.epoch <= self.applied_epoch.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) = check_view(&view, self.app.model_len() as u64) {
            tracing::error!(epoch = view.epoch, error = %e, "ignoring an inconsistent view");
            return;
        }
        let me = &self.me;
        tracing::info!(
            epoch = view.epoch,
            stage = view.stage.number(),
            members = view.members.len(),
            workers = view.workers.len(),
            worker = ?view.worker(me).map(|w| (w.partitions.start, w.partitions.end)),
            active = ?view.shards.iter().filter(|s| &s.active == me).map(|s| s.shard).collect::<Vec<_>>(),
            backup = ?view.shards.iter().filter(|s| s.backup.as_ref() == Some(me)).map(|s| s.shard).collect::<Vec<_>>(),
            "new view"
        );
        self.applied_epoch.store(view.epoch, Ordering::Relaxed);
        let view = Arc::new(view);
        self.views_tx.send_replace(Some(view.clone()));
        self.ps.apply_view(&view);
        self.reap_worker();
        if view.worker(&self.me).is_some()
            && self.worker.is_none()
            && !self.finished
            && self.leave_by.is_none()
        {
            self.spawn_worker();
        }
    }

    fn spawn_worker(&mut self) {
        if let App::Mlp(job) = &*self.app {
            // Once per job: the pipeline's founders are the job's first layout; it re-plans
            // itself when one of them is warned, and folds in a newcomer (this agent, when it
            // is not a founder) when it is ready.
            let (Some(inbox), Some(view)) =
                (self.pipe_inbox.take(), self.views_tx.borrow().clone())
            else {
                return;
            };
            let ctx = member::MemberCtx {
                me: self.me.clone(),
                view,
                views: self.views_tx.subscribe(),
                peers: self.peers.clone(),
                inbox,
                job: job.clone(),
                training: self.reg.training.clone(),
                notices: self.pipe_notices.clone(),
                progress: self.progress.clone(),
                events: self.worker_tx.clone(),
            };
            self.pipeline = Some(tokio::spawn(member::run(ctx)));
            return;
        }
        let t = &self.reg.training;
        let ctx = WorkerCtx {
            me: self.me.clone(),
            app: self.app.clone(),
            peers: self.peers.clone(),
            views: self.views_tx.subscribe(),
            progress: self.progress.clone(),
            events: self.worker_tx.clone(),
            total_clocks: t.total_clocks(),
            clocks_per_epoch: u64::from(t.clocks_per_epoch),
            eval_every_clocks: t.eval_interval_clocks(),
            sync: SyncPolicy::from(t.sync),
            board: self.board.clone(),
            pace: self.pace.clone(),
            samples: self.samples.clone(),
            audit: None,
        };
        self.node.set_worker(ctx.clone());
        self.worker = Some(tokio::spawn(worker::run(ctx)));
    }

    /// A pipeline member that ended in an error (a peer that never sent, a hand-in nobody
    /// took) leaves the agent with nothing to do for the job: say so, and leave as failed, so
    /// that the broker hears of it at once. (Its error used to end with the task, unread, and
    /// the job waited for a final metric that would never come.) A member that finished or
    /// handed over stays until the broker stops this agent or the warning's deadline.
    async fn reap_pipeline(&mut self) -> Option<Result<Outcome>> {
        if self.leave_by.is_some() || !self.pipeline.as_ref()?.is_finished() {
            return None;
        }
        let message = match self.pipeline.take()?.await {
            Ok(Ok(exit)) => {
                tracing::info!(?exit, "pipeline worker ended");
                return None;
            }
            Ok(Err(e)) => format!("the pipeline worker failed: {e}"),
            Err(e) => format!("the pipeline worker panicked: {e}"),
        };
        tracing::error!("{message}: leaving the job");
        let out = self
            .exit(
                ExitReason::failed(&message),
                Outcome::Stopped(message.clone()),
            )
            .await;
        Some(out.and(Err(AgentError::Training(message))))
    }

    fn reap_worker(&mut self) {
        if self.worker.as_ref().is_some_and(|w| w.is_finished()) {
            self.worker = None;
            let assigned = self
                .views_tx
                .borrow()
                .as_ref()
                .is_some_and(|v| v.worker(&self.me).is_some());
            if assigned && !self.finished && self.leave_by.is_none() {
                self.spawn_worker();
            }
        }
    }

    async fn on_notice(&mut self, n: Notice, exit_margin: Duration) {
        match n {
            Notice::Interruption { action, time } => {
                let left = proteus_wire::time::parse_millis(&time)
                    .map_or(120, |t| t.div_euclid(1000) - now_unix());
                let budget = Duration::from_secs(left.max(0) as u64).saturating_sub(exit_margin);
                tracing::warn!(%action, %time, seconds_left = left, "interruption warning: handing over and leaving");
                self.leave_by = Some(Instant::now() + budget);
                let ps = self.ps.clone();
                tokio::spawn(async move { ps.sync_backups().await });
                if self.pipeline.is_some() {
                    self.pipe_notices.warn_this_worker();
                }
                let event = AgentEvent::InterruptionWarning {
                    action,
                    action_time: time,
                };
                let working = self.worker.as_ref().is_some_and(|w| !w.is_finished());
                if self.reg.training.sync.helper_group().is_some() && working {
                    // A warning is a permanent straggler: the worker hands the rest of its
                    // clock to its helpers at once. The broker hears of the warning (and
                    // re-splits the input) once that is done, so that nobody recomputes a
                    // range a helper is working on.
                    self.board.leave();
                    let (board, broker, me) =
                        (self.board.clone(), self.broker.clone(), self.me.clone());
                    tokio::spawn(async move {
                        let t = Instant::now();
                        if !board.wait_released(budget / 2).await {
                            tracing::warn!("the worker did not hand its range over in time");
                        }
                        tracing::info!(
                            ms = t.elapsed().as_millis() as u64,
                            "worker released; telling the broker"
                        );
                        if let Err(e) = broker.event(&me, &event).await {
                            tracing::warn!(error = %e, "could not report the warning");
                        }
                    });
                } else {
                    self.event(event).await;
                }
            }
            Notice::Rebalance { notice_time } => {
                tracing::warn!(
                    ?notice_time,
                    "rebalance recommendation: moving shards off this machine early"
                );
                let ps = self.ps.clone();
                tokio::spawn(async move { ps.sync_backups().await });
                self.event(AgentEvent::RebalanceRecommendation { notice_time })
                    .await;
            }
        }
    }

    /// After a warning: leave once the view no longer has us and every hand-over is done, or at
    /// the deadline whatever happened.
    async fn check_leaving(&mut self) -> Option<Result<Outcome>> {
        let leave_by = self.leave_by?;
        let out_of_view = self
            .views_tx
            .borrow()
            .as_ref()
            .is_none_or(|v| v.member(&self.me).is_none());
        let (active, _) = self.ps.roles();
        let handed_over = self.ps.handovers_in_flight() == 0
            && active.is_empty()
            && self.pipeline.as_ref().is_none_or(|p| p.is_finished());
        if out_of_view && handed_over {
            return Some(
                self.exit(ExitReason::Interrupted, Outcome::Interrupted)
                    .await,
            );
        }
        if Instant::now() >= leave_by {
            tracing::error!(
                "interruption deadline reached before hand-over finished; leaving anyway"
            );
            return Some(
                self.exit(ExitReason::Interrupted, Outcome::Interrupted)
                    .await,
            );
        }
        None
    }
}

/// A view must tile this agent's model exactly; anything else would index out of bounds.
fn check_view(view: &ClusterView, model_len: u64) -> std::result::Result<(), String> {
    if view.model_len != model_len {
        return Err(format!(
            "view is for a model of {} parameters, ours has {model_len}",
            view.model_len
        ));
    }
    let mut next = 0;
    for (i, s) in view.shards.iter().enumerate() {
        if s.shard as usize != i || s.keys.start != next || s.keys.end < s.keys.start {
            return Err(format!(
                "shard {} has key range {:?}, expected to start at {next}",
                s.shard, s.keys
            ));
        }
        next = s.keys.end;
    }
    if next != model_len {
        return Err(format!("shards cover {next} of {model_len} parameters"));
    }
    Ok(())
}
