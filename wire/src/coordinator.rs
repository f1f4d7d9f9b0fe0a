//! The control plane of one job: a pure, deterministic state machine.
//!
//! The broker wraps it in its HTTP routes (and calls [`Coordinator::remove`] when the cloud says
//! an instance is gone); the agent's tests wrap the very same type in a small test server. It
//! does no I/O and reads no clock: every call that depends on time takes `now_ms`, so the same
//! sequence of calls always yields the same views, byte for byte.
//!
//! A long-poll server notifies its waiters after every mutating call and re-reads
//! [`Coordinator::commands_after`]; [`Coordinator::latest_seq`] tells whether anything is new.

use crate::agent_api::{
    AgentEvent, AppConfig, ClusterView, Command, CommandEnvelope, Heartbeat, KeyRange, LayerTiming,
    MemberInfo, Metric, Parallelism, PartitionRange, PipelinePlan, PipelinePlans, PlanSource,
    Progress, RegisterRequest, RegisterResponse, ShardPlacement, ShardSource, Stage,
    StageThresholds, TrainingConfig, WorkerAssignment,
};
use crate::agent_api::{ApiError, DataSecret, ExitReason};
use crate::ids::{InstanceId, JobId, Tier};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Why a call was refused. [`CoordinatorError::http_status`] maps it onto the agent API.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CoordinatorError {
    #[error("instance {0} is not a member of this job")]
    UnknownInstance(InstanceId),
    #[error("job {0} is over")]
    JobOver(JobId),
    #[error("agent reports a model of {got} parameters, the job's model has {expected}")]
    ModelMismatch { expected: u64, got: u64 },
    #[error("invalid training configuration: {0}")]
    InvalidConfig(String),
    #[error(
        "this agent speaks agent protocol {agent} and this broker {broker} (0: from before the \
         protocol had a version): run the agent of the broker's release \
         (GET /v1/downloads/proteus-agent)"
    )]
    ProtocolMismatch { agent: u32, broker: u32 },
    #[error("instance {0} is not the member asked to profile this job's pipeline")]
    NotProfiler(InstanceId),
    #[error("invalid pipeline profile: {0}")]
    InvalidProfile(String),
    #[error("plans refused: {0}")]
    InvalidPlans(String),
}

impl CoordinatorError {
    /// The status code of the agent API for this error.
    pub fn http_status(&self) -> u16 {
        match self {
            CoordinatorError::UnknownInstance(_) => 404,
            CoordinatorError::JobOver(_)
            | CoordinatorError::ProtocolMismatch { .. }
            | CoordinatorError::NotProfiler(_) => 409,
            CoordinatorError::ModelMismatch { .. }
            | CoordinatorError::InvalidConfig(_)
            | CoordinatorError::InvalidProfile(_)
            | CoordinatorError::InvalidPlans(_) => 400,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            CoordinatorError::UnknownInstance(_) => "not_found",
            CoordinatorError::JobOver(_) => "job_over",
            CoordinatorError::ProtocolMismatch { .. } => "protocol_mismatch",
            CoordinatorError::NotProfiler(_) => "not_profiler",
            CoordinatorError::ModelMismatch { .. }
            | CoordinatorError::InvalidConfig(_)
            | CoordinatorError::InvalidProfile(_)
            | CoordinatorError::InvalidPlans(_) => "bad_request",
        }
    }

    pub fn to_api_error(&self) -> ApiError {
        ApiError {
            code: self.code().into(),
            message: self.to_string(),
        }
    }
}

/// Where a member is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberState {
    /// Registered, still loading its data: no role yet.
    Joining,
    /// Eligible for every role.
    Active,
    /// Rebalance recommendation: keeps working, holds no shard.
    Draining,
    /// Interruption warning: out of the view, handing over, about to exit.
    Leaving,
}

/// Why a member is no longer part of the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum DepartureReason {
    /// It said it exits.
    Exited { reason: ExitReason },
    /// Silent for longer than the dead-member timeout.
    TimedOut,
    /// The cloud reported the instance gone ([`Coordinator::remove`]).
    Removed { reason: String },
    /// It registered again (its process restarted and lost its state).
    Restarted,
}

/// Overall state of the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Fewer than `min_workers` have joined so far.
    Waiting,
    Running,
    /// A worker finished the last clock (or a command job's program completed).
    Completed,
    Cancelled,
    /// A command job's program failed more often than its `max_restarts` allow.
    Failed,
}

impl JobState {
    pub fn is_over(self) -> bool {
        matches!(
            self,
            JobState::Completed | JobState::Cancelled | JobState::Failed
        )
    }
}

/// Roles of one member in the current view.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Roles {
    pub worker: Option<PartitionRange>,
    pub active_shards: Vec<u32>,
    pub backup_shards: Vec<u32>,
}

/// A member as the job's status page shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberStatus {
    pub instance_id: InstanceId,
    pub tier: Tier,
    pub state: MemberState,
    pub data_addr: String,
    pub roles: Roles,
    pub joined_at_ms: u64,
    /// When its agent said it was ready (data loaded, model built): from then on it works.
    #[serde(default)]
    pub ready_at_ms: Option<u64>,
    pub last_seen_ms: u64,
    pub applied_epoch: u64,
    pub progress: Progress,
}

/// A member that left.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DepartedMember {
    pub instance_id: InstanceId,
    pub tier: Tier,
    pub at_ms: u64,
    pub reason: DepartureReason,
}

/// Job-wide progress.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct AggregateProgress {
    /// Furthest clock any worker reached.
    pub clock: u64,
    pub total_clocks: u64,
    /// `clock / clocks_per_epoch`.
    pub epoch: f64,
    /// Samples processed by all members ever, departed ones included.
    pub samples_processed: u64,
    /// Sum over current members.
    pub samples_per_sec: f64,
    /// Mean of the members' latest training loss.
    pub loss: Option<f64>,
    /// Command jobs: the furthest progress any member's program reported (kept when that
    /// member leaves, so a job between instances does not fall back to zero).
    #[serde(default)]
    pub program: Option<crate::agent_api::ProgramProgress>,
}

impl AggregateProgress {
    /// The fraction of the job done: the program's own progress when it reports one, else
    /// clocks over the stop condition's clocks.
    pub fn fraction(&self) -> f64 {
        match self.program.and_then(|p| p.fraction()) {
            Some(f) => f,
            None if self.total_clocks > 0 => {
                (self.clock as f64 / self.total_clocks as f64).min(1.0)
            }
            None => 0.0,
        }
    }
}

/// What the broker's `GET /jobs/{id}` shows about training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobStatus {
    pub job_id: JobId,
    pub state: JobState,
    pub epoch: u64,
    pub stage: Option<Stage>,
    pub progress: AggregateProgress,
    /// Most recent evaluation (highest clock) reported by any member.
    pub latest_metric: Option<Metric>,
    /// Evaluation of the final model, once training completed.
    pub final_metric: Option<Metric>,
    pub members: Vec<MemberStatus>,
    pub departed: Vec<DepartedMember>,
    /// Why the job ended, when it did.
    pub end_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Member {
    tier: Tier,
    data_addr: String,
    state: MemberState,
    joined_at_ms: u64,
    #[serde(default)]
    ready_at_ms: Option<u64>,
    last_seen_ms: u64,
    applied_epoch: u64,
    progress: Progress,
    /// Saved without its layout: every member's log would hold the whole view, making a
    /// snapshot quadratic in the members (tens of MB at 500 agents), and [`Coordinator::resume`]
    /// re-sends the current layout to everyone anyway, superseding any saved one.
    #[serde(serialize_with = "without_layouts")]
    commands: Vec<CommandEnvelope>,
    next_seq: u64,
    /// Command jobs: it was published as a worker and has not reported its program's end
    /// since, so its program may be running (and saving its rank's checkpoint). Its rank does
    /// not change while this holds.
    #[serde(default)]
    program_up: bool,
    /// Command jobs: the newest layout epoch that gave it a rank slot.
    #[serde(default)]
    worker_epoch: u64,
}

fn without_layouts<S: serde::Serializer>(
    commands: &[CommandEnvelope],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(
        commands
            .iter()
            .filter(|c| !matches!(c.command, Command::Configure(_))),
    )
}

impl Member {
    fn push(&mut self, command: Command) {
        // A newer layout supersedes older ones, so the log keeps only the latest Configure: a
        // slow agent jumps straight to the current view and memory stays bounded.
        if matches!(command, Command::Configure(_)) {
            self.commands
                .retain(|c| !matches!(c.command, Command::Configure(_)));
        }
        self.commands.push(CommandEnvelope {
            seq: self.next_seq,
            command,
        });
        self.next_seq += 1;
    }
}

/// The control-plane state of one job. See the module documentation. Serialisable, so that a
/// broker can store it and resume a job's control plane after a restart (see
/// [`Coordinator::resume`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Coordinator {
    job_id: JobId,
    training: TrainingConfig,
    heartbeat_interval_ms: u64,
    command_wait_ms: u64,
    model_len: Option<u64>,
    members: BTreeMap<InstanceId, Member>,
    departed: Vec<DepartedMember>,
    /// Current shard placement; empty until the first view.
    shards: Vec<ShardPlacement>,
    view: Option<ClusterView>,
    started: bool,
    state: JobState,
    end_reason: Option<String>,
    final_metric: Option<Metric>,
    latest_metric: Option<Metric>,
    /// Samples processed by members that departed, so the job total never goes down.
    departed_samples: u64,
    /// The job's data-plane secret, handed to each agent at registration; dropped when the job
    /// ends (a new job gets a new one). Saved with the rest so that agents joining after a broker
    /// restart can talk to those already running.
    #[serde(default)]
    data_secret: Option<DataSecret>,
    /// Command jobs: the newest program progress reported by any member.
    #[serde(default)]
    program_progress: Option<crate::agent_api::ProgramProgress>,
    /// Command jobs: program runs that failed (not after a notice).
    #[serde(default)]
    program_failures: u32,
    /// Command jobs: the worker rank each member holds. A rank has at most one holder; a
    /// member keeps its rank while it works and while it leaves (its program is still saving
    /// the rank's checkpoint), and frees it only when it departs, so the next holder restores
    /// the newest checkpoint of that rank. See [`Coordinator::rank_holder`].
    #[serde(default)]
    ranks: BTreeMap<InstanceId, u32>,
    /// Command jobs: ranks `0..ranks_opened` have been held (each may have a checkpoint); a
    /// rank at or above it has never been held. Ranks are always taken lowest first, so the
    /// ranks ever held are this prefix.
    #[serde(default)]
    ranks_opened: u32,
    /// MLP jobs: the workers of the first layout, in rank order (see [`ClusterView::founders`]).
    #[serde(default)]
    founders: Vec<InstanceId>,
    /// MLP jobs: the plans the broker computed for the founders (see
    /// [`Coordinator::planning_due`]), published in every view from then on.
    #[serde(default)]
    pipeline: Option<PipelinePlans>,
    /// MLP pipeline jobs: the profile the profiler sent, until the plans are computed from it.
    #[serde(default)]
    measured_profile: Option<(InstanceId, Vec<LayerTiming>)>,
    /// MLP jobs: the workers of the plan the pipeline trains now (its newest re-plan's).
    #[serde(default)]
    pipeline_workers: Option<u32>,
}

/// What the broker must plan an MLP job from: [`Coordinator::planning_due`].
#[derive(Debug, Clone, PartialEq)]
pub struct PlanningInput {
    /// Plans for `1..=workers` workers are wanted.
    pub workers: u32,
    pub source: PlanSource,
}

impl Coordinator {
    /// A coordinator for a job that trains with `training`.
    pub fn new(job_id: JobId, training: TrainingConfig) -> Result<Self, CoordinatorError> {
        training
            .validate()
            .map_err(CoordinatorError::InvalidConfig)?;
        Ok(Coordinator {
            job_id,
            training,
            heartbeat_interval_ms: crate::agent_api::default_heartbeat_interval_ms(),
            command_wait_ms: crate::agent_api::default_command_wait_ms(),
            model_len: None,
            members: BTreeMap::new(),
            departed: Vec::new(),
            shards: Vec::new(),
            view: None,
            started: false,
            state: JobState::Waiting,
            end_reason: None,
            final_metric: None,
            latest_metric: None,
            departed_samples: 0,
            data_secret: None,
            program_progress: None,
            program_failures: 0,
            ranks: BTreeMap::new(),
            ranks_opened: 0,
            founders: Vec::new(),
            pipeline: None,
            measured_profile: None,
            pipeline_workers: None,
        })
    }

    /// The secret agents of this job prove to each other on the data plane. The broker draws it
    /// from a cryptographic random source (this type does no I/O and stays deterministic).
    pub fn with_data_secret(mut self, secret: DataSecret) -> Self {
        if !self.state.is_over() {
            self.data_secret = Some(secret);
        }
        self
    }

    /// Whether the job has a data-plane secret (none once it is over, or in a state saved by a
    /// broker that predates them).
    pub fn has_data_secret(&self) -> bool {
        self.data_secret.is_some()
    }

    /// The job's data-plane secret while it runs (tests and benchmarks act as a peer with it).
    pub fn data_secret(&self) -> Option<&DataSecret> {
        self.data_secret.as_ref()
    }

    /// After a broker restart: the members' last heartbeats are as old as the outage, which says
    /// nothing about the agents, so every member gets a fresh dead-member timeout from `now_ms`.
    ///
    /// The snapshot may predate commands the crashed broker issued after saving it, which agents
    /// may already have seen; so sequence numbers jump well past anything it could have issued,
    /// and every member is sent the current layout again under the new numbers.
    pub fn resume(&mut self, now_ms: u64) {
        const SEQ_GAP: u64 = 1 << 20;
        let view = self.view.clone();
        for m in self.members.values_mut() {
            m.last_seen_ms = m.last_seen_ms.max(now_ms);
            m.next_seq += SEQ_GAP;
            if let Some(view) = &view {
                m.push(Command::Configure(view.clone()));
            }
        }
    }

    /// Override the heartbeat interval and the longest long-poll wait told to agents.
    pub fn with_intervals(mut self, heartbeat_interval_ms: u64, command_wait_ms: u64) -> Self {
        self.heartbeat_interval_ms = heartbeat_interval_ms.max(1);
        self.command_wait_ms = command_wait_ms;
        self
    }

    pub fn job_id(&self) -> JobId {
        self.job_id
    }

    pub fn training(&self) -> &TrainingConfig {
        &self.training
    }

    /// The current layout, if one was published.
    pub fn view(&self) -> Option<&ClusterView> {
        self.view.as_ref()
    }

    pub fn is_member(&self, id: &InstanceId) -> bool {
        self.members.contains_key(id)
    }

    pub fn is_over(&self) -> bool {
        self.state.is_over()
    }

    /// Command jobs: whether `id` holds `rank` now (working or leaving). Only the holder may
    /// replace the rank's checkpoint, so a checkpoint is only ever replaced by a newer one of
    /// the same rank's lineage.
    pub fn holds_rank(&self, id: &InstanceId, rank: u32) -> bool {
        self.ranks.get(id) == Some(&rank)
    }

    /// Command jobs: the member holding `rank`, if any.
    pub fn rank_holder(&self, rank: u32) -> Option<&InstanceId> {
        self.ranks
            .iter()
            .find(|(_, r)| **r == rank)
            .map(|(id, _)| id)
    }

    /// The provider warned `id` that it will be reclaimed. A command job's member leaves the
    /// layout at once (the world size counts working instances, never warned ones) but keeps
    /// its rank until it departs; the agent's own notice may come later. AgileML members are
    /// left to their agent, which hands its state over when it reads the notice. Returns
    /// whether anything changed.
    pub fn provider_warned(&mut self, id: &InstanceId) -> bool {
        if !self.is_command_job() || self.state.is_over() {
            return false;
        }
        match self.members.get_mut(id) {
            Some(m) if m.state != MemberState::Leaving => {
                m.state = MemberState::Leaving;
                self.relayout();
                true
            }
            _ => false,
        }
    }

    /// Command jobs: Proteus ends this member's instance (a policy release, a scale-down). It
    /// is told to stop — its program gets the notice file and the job's `grace_seconds`, and
    /// its checkpoint is uploaded — and leaves the working set at once, keeping its rank until
    /// it departs. The broker ends the instance once it has. Returns whether it was told
    /// (false for other jobs, which are not stopped this way, an unknown member, or a job that
    /// is over: every member was told then).
    pub fn stop_member(&mut self, id: &InstanceId, reason: &str) -> bool {
        if !self.is_command_job() || self.state.is_over() {
            return false;
        }
        let Some(m) = self.members.get_mut(id) else {
            return false;
        };
        m.push(Command::Stop {
            reason: reason.to_string(),
        });
        if m.state != MemberState::Leaving {
            m.state = MemberState::Leaving;
            self.relayout();
        }
        true
    }

    /// Command jobs: how long a program Proteus stops has to save (`grace_seconds`).
    pub fn stop_grace(&self) -> Option<std::time::Duration> {
        match &self.training.app {
            crate::agent_api::AppConfig::Command(c) => {
                Some(std::time::Duration::from_secs(c.grace_seconds))
            }
            _ => None,
        }
    }

    fn is_command_job(&self) -> bool {
        matches!(self.training.app, crate::agent_api::AppConfig::Command(_))
    }

    /// Command jobs: the most ranks (working instances) at once, the job's `max_instances`.
    fn max_ranks(&self) -> u32 {
        match &self.training.app {
            crate::agent_api::AppConfig::Command(c) => c.max_nodes.max(1),
            _ => u32::MAX,
        }
    }

    /// Admit an agent. `tier` comes from the broker's own records, not from the agent. A second
    /// registration of a known instance means its process restarted: the old incarnation's state
    /// is gone and is treated as a crash.
    pub fn register(
        &mut self,
        req: RegisterRequest,
        tier: Tier,
        now_ms: u64,
    ) -> Result<RegisterResponse, CoordinatorError> {
        self.ensure_not_over()?;
        if req.protocol_version != crate::agent_api::PROTOCOL_VERSION {
            return Err(CoordinatorError::ProtocolMismatch {
                agent: req.protocol_version,
                broker: crate::agent_api::PROTOCOL_VERSION,
            });
        }
        if self.members.contains_key(&req.instance_id) {
            self.depart(&req.instance_id, DepartureReason::Restarted, now_ms);
        }
        self.members.insert(
            req.instance_id.clone(),
            Member {
                tier,
                data_addr: req.data_addr,
                state: MemberState::Joining,
                joined_at_ms: now_ms,
                ready_at_ms: None,
                last_seen_ms: now_ms,
                applied_epoch: 0,
                progress: Progress::default(),
                commands: Vec::new(),
                next_seq: 1,
                program_up: false,
                worker_epoch: 0,
            },
        );
        self.relayout();
        Ok(RegisterResponse {
            job_id: self.job_id,
            instance_id: req.instance_id,
            tier,
            training: self.training.clone(),
            heartbeat_interval_ms: self.heartbeat_interval_ms,
            command_wait_ms: self.command_wait_ms,
            data_secret: self.data_secret.clone(),
            protocol_version: crate::agent_api::PROTOCOL_VERSION,
        })
    }

    /// Record a heartbeat: liveness and progress.
    pub fn heartbeat(
        &mut self,
        id: &InstanceId,
        hb: Heartbeat,
        now_ms: u64,
    ) -> Result<(), CoordinatorError> {
        self.ensure_not_over()?;
        let member = self.member_mut(id)?;
        member.last_seen_ms = now_ms;
        member.applied_epoch = member.applied_epoch.max(hb.applied_epoch);
        if let Some(metric) = hb.progress.metric {
            self.note_metric(metric);
        }
        if let Some(p) = hb.progress.program
            && p.fraction().is_some()
        {
            self.program_progress = Some(p);
        }
        let member = self.member_mut(id)?;
        member.progress = hb.progress;
        Ok(())
    }

    /// Apply an agent's event. Events are accepted after the job is over (an agent saying it
    /// exits is news the broker wants either way).
    pub fn event(
        &mut self,
        id: &InstanceId,
        event: AgentEvent,
        now_ms: u64,
    ) -> Result<(), CoordinatorError> {
        if let AgentEvent::Ready { model_len } = event {
            return self.ready(id, model_len, now_ms);
        }
        let member = self.member_mut(id)?;
        member.last_seen_ms = now_ms;
        match event {
            AgentEvent::Ready { .. } => {}
            AgentEvent::InterruptionWarning { .. } => {
                member.state = MemberState::Leaving;
                self.relayout();
            }
            AgentEvent::RebalanceRecommendation { .. } => {
                if member.state == MemberState::Active {
                    member.state = MemberState::Draining;
                    self.relayout();
                }
            }
            AgentEvent::HandoverComplete { .. } => {}
            AgentEvent::PipelineResumed { workers, .. } => {
                if self.pipeline.is_some() {
                    self.pipeline_workers = Some(workers);
                }
            }
            AgentEvent::PipelineProfile { layers } => return self.take_profile(id, layers),
            AgentEvent::ProgramIdle { epoch } => {
                // Only news about a layout newer than any that gave it a slot: an older one
                // may predate a program it has started since.
                if member.program_up && epoch > member.worker_epoch {
                    member.program_up = false;
                    self.relayout();
                }
            }
            AgentEvent::TrainingComplete { metric } => {
                self.note_metric(metric);
                if !self.state.is_over() {
                    self.final_metric = Some(metric);
                    self.finish(
                        JobState::Completed,
                        format!("training complete: {metric:?}"),
                    );
                }
            }
            AgentEvent::Exit { reason } => {
                self.depart(id, DepartureReason::Exited { reason }, now_ms);
                self.relayout();
            }
            AgentEvent::ProgramExited {
                code,
                signal,
                after_notice,
                completes,
            } => {
                // A worker's agent starts the program again (after a failure, or a notice that
                // left it in the layout); one out of the working set has stopped it for good.
                let working = self.view.as_ref().is_some_and(|v| v.worker(id).is_some());
                if let Some(m) = self.members.get_mut(id) {
                    m.program_up = working;
                }
                self.program_exited(code, signal, after_notice, completes);
                // A member waiting for its program to end before it changes rank moves now.
                self.relayout();
            }
        }
        Ok(())
    }

    /// A command job's program ended: completion ends the job; a failure (not after a
    /// notice) counts against `max_restarts` and one too many fails the job.
    fn program_exited(
        &mut self,
        code: Option<i32>,
        signal: Option<i32>,
        after_notice: bool,
        completes: bool,
    ) {
        if self.state.is_over() {
            return;
        }
        let how = match (code, signal) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(s)) => format!("signal {s}"),
            (None, None) => "an unknown status".to_string(),
        };
        if completes {
            self.finish(JobState::Completed, format!("program completed ({how})"));
            return;
        }
        if after_notice {
            return;
        }
        self.program_failures += 1;
        let allowed = match &self.training.app {
            crate::agent_api::AppConfig::Command(c) => c.max_restarts,
            _ => 0,
        };
        if self.program_failures > allowed {
            self.finish(
                JobState::Failed,
                format!(
                    "program failed {} times (last with {how}); max_restarts is {allowed}",
                    self.program_failures
                ),
            );
        }
    }

    fn ready(
        &mut self,
        id: &InstanceId,
        model_len: u64,
        now_ms: u64,
    ) -> Result<(), CoordinatorError> {
        self.ensure_not_over()?;
        match self.model_len {
            Some(expected) if expected != model_len => {
                return Err(CoordinatorError::ModelMismatch {
                    expected,
                    got: model_len,
                });
            }
            _ if model_len == 0 => {
                return Err(CoordinatorError::InvalidConfig(
                    "model_len must be at least 1".into(),
                ));
            }
            _ => {}
        }
        let member = self.member_mut(id)?;
        member.last_seen_ms = now_ms;
        if member.state != MemberState::Joining {
            return Ok(());
        }
        member.state = MemberState::Active;
        member.ready_at_ms = Some(now_ms);
        self.model_len = Some(model_len);
        self.relayout();
        // A member joining an existing layout still needs the current view even if the layout
        // did not change because of it (e.g. a reliable machine in stage 3 with enough backups).
        if let Some(view) = &self.view
            && let Some(m) = self.members.get_mut(id)
            && m.commands.is_empty()
        {
            m.push(Command::Configure(view.clone()));
        }
        Ok(())
    }

    /// The cloud reports the instance gone (terminated, evicted): it is dead now, whatever it
    /// was doing. Unknown instances are ignored, so the broker may call this unconditionally.
    pub fn remove(&mut self, id: &InstanceId, reason: &str, now_ms: u64) -> bool {
        if !self.members.contains_key(id) {
            return false;
        }
        self.depart(
            id,
            DepartureReason::Removed {
                reason: reason.into(),
            },
            now_ms,
        );
        self.relayout();
        true
    }

    /// Declare members silent for longer than the dead-member timeout dead. Returns them.
    pub fn tick(&mut self, now_ms: u64) -> Vec<InstanceId> {
        let timeout = self.training.dead_member_timeout_ms;
        let dead: Vec<InstanceId> = self
            .members
            .iter()
            .filter(|(_, m)| now_ms.saturating_sub(m.last_seen_ms) > timeout)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &dead {
            self.depart(id, DepartureReason::TimedOut, now_ms);
        }
        if !dead.is_empty() {
            self.relayout();
        }
        dead
    }

    /// End the job: every member is told to stop.
    pub fn cancel(&mut self, reason: &str) {
        if !self.state.is_over() {
            self.finish(JobState::Cancelled, reason.to_string());
        }
    }

    /// Commands for `id` with `seq > after`.
    pub fn commands_after(
        &self,
        id: &InstanceId,
        after: u64,
    ) -> Result<Vec<CommandEnvelope>, CoordinatorError> {
        let member = self
            .members
            .get(id)
            .ok_or_else(|| CoordinatorError::UnknownInstance(id.clone()))?;
        Ok(member
            .commands
            .iter()
            .filter(|c| c.seq > after)
            .cloned()
            .collect())
    }

    /// Sequence number of the newest command for `id` (0: none yet).
    pub fn latest_seq(&self, id: &InstanceId) -> Option<u64> {
        self.members.get(id).map(|m| m.next_seq - 1)
    }

    /// Everything the broker's status API shows.
    pub fn status(&self) -> JobStatus {
        let members = self
            .members
            .iter()
            .map(|(id, m)| MemberStatus {
                instance_id: id.clone(),
                tier: m.tier,
                state: m.state,
                data_addr: m.data_addr.clone(),
                roles: self.roles_of(id),
                joined_at_ms: m.joined_at_ms,
                ready_at_ms: m.ready_at_ms,
                last_seen_ms: m.last_seen_ms,
                applied_epoch: m.applied_epoch,
                progress: m.progress.clone(),
            })
            .collect();
        JobStatus {
            job_id: self.job_id,
            state: self.state,
            epoch: self.view.as_ref().map_or(0, |v| v.epoch),
            stage: self.view.as_ref().map(|v| v.stage),
            progress: self.aggregate_progress(),
            latest_metric: self.latest_metric,
            final_metric: self.final_metric,
            members,
            departed: self.departed.clone(),
            end_reason: self.end_reason.clone(),
        }
    }

    /// MLP jobs: when the founders are known and their plans are not, what to compute them from
    /// — no profile for data parallelism, the pinned one, or the one the profiler sent. `None`
    /// while a profile is awaited (or the job needs no plans). The broker computes the plans
    /// (the partitioner, outside this pure type) and hands them to
    /// [`Coordinator::set_pipeline_plans`].
    pub fn planning_due(&self) -> Option<PlanningInput> {
        let AppConfig::Mlp {
            parallelism,
            pipeline,
            ..
        } = &self.training.app
        else {
            return None;
        };
        if self.pipeline.is_some() || self.founders.is_empty() || self.state.is_over() {
            return None;
        }
        let source = match (parallelism, &pipeline.profile, &self.measured_profile) {
            (Parallelism::Data, _, _) => PlanSource::DataParallel,
            (Parallelism::Pipeline, Some(_), _) => PlanSource::Pinned,
            (Parallelism::Pipeline, None, Some((by, profile))) => PlanSource::Measured {
                by: by.clone(),
                profile: profile.clone(),
            },
            (Parallelism::Pipeline, None, None) => return None,
        };
        Some(PlanningInput {
            workers: self.founders.len() as u32,
            source,
        })
    }

    /// Publishes an MLP job's plans (one per worker count up to the founders', in order, each
    /// covering every layer) in a new view. Refused when they do not fit the job.
    pub fn set_pipeline_plans(&mut self, plans: PipelinePlans) -> Result<(), CoordinatorError> {
        let AppConfig::Mlp { layers, .. } = &self.training.app else {
            return Err(CoordinatorError::InvalidPlans("not an MLP job".into()));
        };
        let layers = layers.len() as u32;
        if plans.plans.len() != self.founders.len() {
            return Err(CoordinatorError::InvalidPlans(format!(
                "{} plans for {} founders",
                plans.plans.len(),
                self.founders.len()
            )));
        }
        for (i, plan) in plans.plans.iter().enumerate() {
            let mut next = 0;
            for s in &plan.stages {
                if s.first_layer != next || s.end_layer <= s.first_layer || s.replicas == 0 {
                    return Err(CoordinatorError::InvalidPlans(format!(
                        "plan {} has stage {s:?} after layer {next}",
                        i + 1
                    )));
                }
                next = s.end_layer;
            }
            if next != layers || plan.workers() != i as u32 + 1 {
                return Err(CoordinatorError::InvalidPlans(format!(
                    "plan {} covers {next} of {layers} layers on {} workers",
                    i + 1,
                    plan.workers()
                )));
            }
        }
        self.pipeline = Some(plans);
        self.measured_profile = None;
        self.relayout();
        Ok(())
    }

    /// The plan an MLP job's pipeline trains now (the founders' until a re-plan resumed), when
    /// the broker has planned it.
    pub fn pipeline_plan(&self) -> Option<&PipelinePlan> {
        let plans = &self.pipeline.as_ref()?.plans;
        let workers = self.pipeline_workers.unwrap_or(plans.len() as u32);
        plans.get(workers.checked_sub(1)? as usize)
    }

    /// The founder asked to profile an MLP pipeline job (see [`ClusterView::profiler`]): the
    /// first active reliable founder, else the first active founder; none once a profile is
    /// in or none is needed.
    fn profiler(&self) -> Option<InstanceId> {
        let AppConfig::Mlp {
            parallelism: Parallelism::Pipeline,
            pipeline,
            ..
        } = &self.training.app
        else {
            return None;
        };
        if pipeline.profile.is_some() || self.pipeline.is_some() || self.measured_profile.is_some()
        {
            return None;
        }
        let active = |id: &&InstanceId| {
            self.members
                .get(*id)
                .is_some_and(|m| m.state == MemberState::Active)
        };
        let reliable =
            |id: &&InstanceId| self.members.get(*id).map(|m| m.tier) == Some(Tier::Reliable);
        self.founders
            .iter()
            .filter(active)
            .find(reliable)
            .or_else(|| self.founders.iter().find(active))
            .cloned()
    }

    /// The profiler's profile: taken once, checked against the model. A repeat from the member
    /// whose profile was taken is a duplicate and ignored.
    fn take_profile(
        &mut self,
        id: &InstanceId,
        profile: Vec<LayerTiming>,
    ) -> Result<(), CoordinatorError> {
        let sent_before = match (&self.measured_profile, &self.pipeline) {
            (Some((by, _)), _) => by == id,
            (
                None,
                Some(PipelinePlans {
                    source: PlanSource::Measured { by, .. },
                    ..
                }),
            ) => by == id,
            _ => false,
        };
        if sent_before {
            return Ok(());
        }
        if self.profiler().as_ref() != Some(id) {
            return Err(CoordinatorError::NotProfiler(id.clone()));
        }
        let AppConfig::Mlp { layers, .. } = &self.training.app else {
            return Err(CoordinatorError::NotProfiler(id.clone()));
        };
        LayerTiming::check_profile(&profile, layers.len())
            .map_err(CoordinatorError::InvalidProfile)?;
        self.measured_profile = Some((id.clone(), profile));
        Ok(())
    }

    /// Roles of `id` in the current view.
    pub fn roles_of(&self, id: &InstanceId) -> Roles {
        let Some(view) = &self.view else {
            return Roles::default();
        };
        Roles {
            worker: view.worker(id).map(|w| w.partitions),
            active_shards: view
                .shards
                .iter()
                .filter(|s| &s.active == id)
                .map(|s| s.shard)
                .collect(),
            backup_shards: view
                .shards
                .iter()
                .filter(|s| s.backup.as_ref() == Some(id))
                .map(|s| s.shard)
                .collect(),
        }
    }

    // -----------------------------------------------------------------------------------------

    fn ensure_not_over(&self) -> Result<(), CoordinatorError> {
        if self.state.is_over() {
            Err(CoordinatorError::JobOver(self.job_id))
        } else {
            Ok(())
        }
    }

    fn member_mut(&mut self, id: &InstanceId) -> Result<&mut Member, CoordinatorError> {
        self.members
            .get_mut(id)
            .ok_or_else(|| CoordinatorError::UnknownInstance(id.clone()))
    }

    fn note_metric(&mut self, metric: Metric) {
        if self.latest_metric.is_none_or(|m| metric.clock >= m.clock) {
            self.latest_metric = Some(metric);
        }
    }

    fn finish(&mut self, state: JobState, reason: String) {
        self.state = state;
        // The secret dies with the job: nothing that learnt it can use it again.
        self.data_secret = None;
        for m in self.members.values_mut() {
            m.push(Command::Stop {
                reason: reason.clone(),
            });
        }
        self.end_reason = Some(reason);
    }

    fn depart(&mut self, id: &InstanceId, reason: DepartureReason, now_ms: u64) {
        self.ranks.remove(id);
        if let Some(m) = self.members.remove(id) {
            self.departed_samples += m.progress.samples_processed;
            self.departed.push(DepartedMember {
                instance_id: id.clone(),
                tier: m.tier,
                at_ms: now_ms,
                reason,
            });
        }
    }

    fn aggregate_progress(&self) -> AggregateProgress {
        let total_clocks = self.training.total_clocks();
        let clock = self
            .members
            .values()
            .map(|m| m.progress.clock)
            .max()
            .unwrap_or(0);
        let losses: Vec<f64> = self
            .members
            .values()
            .filter_map(|m| m.progress.loss)
            .collect();
        AggregateProgress {
            clock,
            total_clocks,
            epoch: clock as f64 / f64::from(self.training.clocks_per_epoch),
            samples_processed: self.departed_samples
                + self
                    .members
                    .values()
                    .map(|m| m.progress.samples_processed)
                    .sum::<u64>(),
            samples_per_sec: self
                .members
                .values()
                .map(|m| m.progress.samples_per_sec)
                .sum(),
            loss: (!losses.is_empty()).then(|| losses.iter().sum::<f64>() / losses.len() as f64),
            program: self.program_progress,
        }
    }

    /// Recompute the layout; publish it as a new epoch if it differs from the current one.
    fn relayout(&mut self) {
        if self.state.is_over() {
            return;
        }
        let Some(model_len) = self.model_len else {
            return;
        };
        let eligible: Vec<(&InstanceId, Tier)> = self
            .members
            .iter()
            .filter(|(_, m)| m.state == MemberState::Active)
            .map(|(id, m)| (id, m.tier))
            .collect();
        if eligible.is_empty() {
            // Nobody can hold shards: keep the old placement so that the sources computed when
            // someone joins still refer to who held what.
            return;
        }
        let stage = choose_stage(&eligible, &self.training.stages);
        let shards = self.place_shards(stage, &eligible, model_len);
        let mut workers = self.place_workers(stage);
        if !self.started {
            if workers.len() >= self.training.min_workers as usize {
                self.started = true;
                self.state = JobState::Running;
                if matches!(self.training.app, crate::agent_api::AppConfig::Mlp { .. }) {
                    self.founders = workers.iter().map(|w| w.instance_id.clone()).collect();
                }
            } else {
                workers.clear();
            }
        }
        let members: Vec<MemberInfo> = self
            .members
            .iter()
            .filter(|(_, m)| matches!(m.state, MemberState::Active | MemberState::Draining))
            .map(|(id, m)| MemberInfo {
                instance_id: id.clone(),
                tier: m.tier,
                data_addr: m.data_addr.clone(),
                draining: m.state == MemberState::Draining,
            })
            .collect();
        let epoch = self.view.as_ref().map_or(0, |v| v.epoch) + 1;
        let view = ClusterView {
            epoch,
            stage,
            members,
            shards: shards.clone(),
            workers,
            num_partitions: self.training.num_partitions,
            model_len,
            founders: self.founders.clone(),
            pipeline: self.pipeline.clone(),
            profiler: self.profiler(),
        };
        let unchanged = self.view.as_ref().is_some_and(|old| {
            old.stage == view.stage
                && old.members == view.members
                && old.shards == view.shards
                && old.workers == view.workers
                && old.pipeline == view.pipeline
                && old.profiler == view.profiler
        });
        self.shards = shards;
        if !unchanged {
            for m in self.members.values_mut() {
                m.push(Command::Configure(view.clone()));
            }
            self.view = Some(view);
        }
        if let Some(view) = &self.view {
            for w in &view.workers {
                if let Some(m) = self.members.get_mut(&w.instance_id) {
                    m.program_up = true;
                    m.worker_epoch = view.epoch;
                }
            }
        }
    }

    /// Sticky placement: a shard stays where it is while its holder remains a valid choice, so a
    /// membership change moves as little state as possible.
    fn place_shards(
        &self,
        stage: Stage,
        eligible: &[(&InstanceId, Tier)],
        model_len: u64,
    ) -> Vec<ShardPlacement> {
        let n = self.training.num_shards;
        let of_tier = |t: Tier| -> Vec<InstanceId> {
            eligible
                .iter()
                .filter(|(_, tier)| *tier == t)
                .map(|(id, _)| (*id).clone())
                .collect()
        };
        let (reliable, transient) = (of_tier(Tier::Reliable), of_tier(Tier::Transient));
        let active_pool = match stage {
            Stage::Stage1 if !reliable.is_empty() => reliable.clone(),
            Stage::Stage1 => transient.clone(),
            _ if !transient.is_empty() => transient.clone(),
            _ => reliable.clone(),
        };
        // Stage 1 keeps state on machines that are never revoked, so no backups; stages 2 and 3
        // back transient actives up on reliable machines (or, lacking any, on other transients).
        let backup_pool = match stage {
            Stage::Stage1 => Vec::new(),
            _ if !reliable.is_empty() => reliable.clone(),
            _ => transient.clone(),
        };
        let previous = |s: u32| self.shards.iter().find(|p| p.shard == s);

        let mut actives: Vec<Option<InstanceId>> = (0..n)
            .map(|s| {
                previous(s)
                    .map(|p| p.active.clone())
                    .filter(|a| active_pool.contains(a))
            })
            .collect();
        release_overloaded(&mut actives, &active_pool);
        fill_least_loaded(&mut actives, &active_pool, |_, _| true);

        let mut backups: Vec<Option<InstanceId>> = (0..n)
            .map(|s| {
                let active = actives[s as usize].as_ref();
                previous(s)
                    .and_then(|p| p.backup.clone())
                    .filter(|b| backup_pool.contains(b) && Some(b) != active)
            })
            .collect();
        if !backup_pool.is_empty() {
            let act = actives.clone();
            fill_least_loaded(&mut backups, &backup_pool, |s, cand| {
                act[s].as_ref() != Some(cand)
            });
        }

        (0..n)
            .map(|s| {
                let i = s as usize;
                let active = actives[i].clone().unwrap_or_else(|| active_pool[0].clone());
                let source = match previous(s) {
                    None => ShardSource::Fresh,
                    Some(p) if p.active == active => p.source.clone(),
                    Some(p) => self.transfer_source(p, &active),
                };
                ShardPlacement {
                    shard: s,
                    keys: split_range(model_len, n, s),
                    active,
                    backup: backups[i].clone(),
                    source,
                }
            })
            .collect()
    }

    /// How a shard's new active owner gets the state that `prev` describes.
    fn transfer_source(&self, prev: &ShardPlacement, new_active: &InstanceId) -> ShardSource {
        let alive = |id: &InstanceId| self.members.contains_key(id);
        let backup = prev.backup.clone().filter(|b| alive(b));
        if alive(&prev.active) {
            ShardSource::Handover {
                from: prev.active.clone(),
                fallback: backup,
            }
        } else if let Some(b) = backup {
            ShardSource::Restore { from: b }
        } else if prev.backup.as_ref() == Some(new_active) {
            ShardSource::Restore {
                from: new_active.clone(),
            }
        } else {
            ShardSource::Lost
        }
    }

    fn place_workers(&mut self, stage: Stage) -> Vec<WorkerAssignment> {
        let ids: Vec<InstanceId> = self
            .members
            .iter()
            .filter(|(_, m)| matches!(m.state, MemberState::Active | MemberState::Draining))
            .filter(|(_, m)| stage.reliable_machines_train() || m.tier == Tier::Transient)
            .map(|(id, _)| id.clone())
            .collect();
        let ranked: Vec<(InstanceId, u32)> = if self.is_command_job() {
            self.assign_ranks(&ids)
        } else {
            // AgileML: ranks are positions; the partitions follow the rank.
            ids.into_iter().zip(0..).collect()
        };
        let n = ranked.len() as u64;
        let p = u64::from(self.training.num_partitions);
        ranked
            .into_iter()
            .enumerate()
            .map(|(pos, (id, rank))| {
                let r = pos as u64;
                WorkerAssignment {
                    instance_id: id,
                    rank,
                    partitions: PartitionRange {
                        start: (r * p / n) as u32,
                        end: ((r + 1) * p / n) as u32,
                    },
                }
            })
            .collect()
    }

    /// Command jobs: ranks. Returns the working holders by rank; their ranks are always
    /// exactly `0..n` (so a program always starts with `rank < world size`, the world size
    /// being `n`, never above `max_ranks`). The rules, in order:
    ///
    /// - a rank has at most one holder; a member keeps its rank while it works and while it
    ///   leaves (its program is still saving the rank's checkpoint), and frees it when it
    ///   departs;
    /// - a member without a rank takes the lowest free rank that was held before (a lineage
    ///   that may have a checkpoint); failing one, it waits for a leaving member's rank rather
    ///   than open a fresh one; only a member with neither opens the lowest fresh rank;
    /// - a free rank below a working holder's is filled by moving the highest holder down, once
    ///   its program has ended (its own rank's checkpoint saved; that lineage is then free for
    ///   the next newcomer);
    /// - only holders of the ranks below the first rank without a working holder work (behind
    ///   a leaving holder's rank, the higher ranks wait until it departs and is replaced).
    ///
    /// The last two rules are for `plain` programs, which index by rank. Under
    /// `launcher = "torchrun"` the program's rank is torchrun's own (`RANK`, dense in every
    /// rendezvous round) and `PROTEUS_RANK` only names a checkpoint lineage: every holder works,
    /// gaps stay, and the survivors of a departure train on without a restart (torchrun's
    /// elastic re-form), which stopping them would defeat.
    fn assign_ranks(&mut self, eligible: &[InstanceId]) -> Vec<(InstanceId, u32)> {
        let is_leaving = |m: &Member| m.state == MemberState::Leaving;
        let members = &self.members;
        self.ranks
            .retain(|id, _| eligible.contains(id) || members.get(id).is_some_and(is_leaving));
        let max = self.max_ranks();
        let held = |ranks: &BTreeMap<InstanceId, u32>, r: u32| ranks.values().any(|x| *x == r);

        // Newcomers, first come first served.
        let mut waiting: Vec<&InstanceId> = eligible
            .iter()
            .filter(|id| !self.ranks.contains_key(*id))
            .collect();
        waiting.sort_by_key(|id| (self.members.get(*id).map_or(0, |m| m.joined_at_ms), *id));
        let mut soon_free = self
            .ranks
            .keys()
            .filter(|id| self.members.get(*id).is_some_and(is_leaving))
            .count();
        for id in waiting {
            let lineage = (0..self.ranks_opened.min(max)).find(|r| !held(&self.ranks, *r));
            let rank = match lineage {
                Some(r) => r,
                None if soon_free > 0 => {
                    soon_free -= 1;
                    continue;
                }
                None => match (self.ranks_opened..max).find(|r| !held(&self.ranks, *r)) {
                    Some(r) => r,
                    None => break,
                },
            };
            self.ranks.insert(id.clone(), rank);
            self.ranks_opened = self.ranks_opened.max(rank + 1);
        }

        let dense = !matches!(
            &self.training.app,
            crate::agent_api::AppConfig::Command(c)
                if c.launcher == crate::agent_api::CommandLauncher::Torchrun
        );
        // Gaps: a free rank below a working holder's is filled from the top, by a holder whose
        // program is down.
        while let Some((top_rank, top_id)) = dense
            .then(|| {
                eligible
                    .iter()
                    .filter_map(|id| self.ranks.get(id).map(|r| (*r, id)))
                    .max()
            })
            .flatten()
        {
            let Some(gap) = (0..top_rank).find(|r| !held(&self.ranks, *r)) else {
                break;
            };
            if self.members.get(top_id).is_some_and(|m| m.program_up) {
                // It is taken out of the working set below (it is above the gap): its agent
                // stops the program, which saves this rank's checkpoint, and reports the end.
                break;
            }
            self.ranks.insert(top_id.clone(), gap);
        }

        let first_unworked = (0..max)
            .filter(|_| dense)
            .find(|r| !eligible.iter().any(|id| self.ranks.get(id) == Some(r)))
            .unwrap_or(max);
        let mut working: Vec<(InstanceId, u32)> = eligible
            .iter()
            .filter_map(|id| self.ranks.get(id).map(|r| (id.clone(), *r)))
            .filter(|(_, r)| *r < first_unworked)
            .collect();
        working.sort_by_key(|(_, r)| *r);
        working
    }
}

/// AgileML's stage from the transient:reliable ratio among eligible members.
pub fn choose_stage(eligible: &[(&InstanceId, Tier)], thresholds: &StageThresholds) -> Stage {
    let transient = eligible
        .iter()
        .filter(|(_, t)| *t == Tier::Transient)
        .count();
    Stage::for_counts(transient, eligible.len() - transient, thresholds)
}

/// Shard `s` of `n` over `[0, len)`: contiguous, covering, sizes differing by at most one.
pub fn split_range(len: u64, n: u32, s: u32) -> KeyRange {
    let (n, s) = (u128::from(n), u128::from(s));
    let len = u128::from(len);
    KeyRange {
        start: (s * len / n) as u64,
        end: ((s + 1) * len / n) as u64,
    }
}

/// Free slots of the most loaded pool members until loads differ by at most one once refilled,
/// so that a machine joining takes its share of shards (and only its share moves).
fn release_overloaded(slots: &mut [Option<InstanceId>], pool: &[InstanceId]) {
    if pool.is_empty() {
        return;
    }
    let fair_max = slots.len().div_ceil(pool.len());
    for member in pool {
        let mut held: Vec<usize> = (0..slots.len())
            .filter(|&i| slots[i].as_ref() == Some(member))
            .collect();
        while held.len() > fair_max {
            if let Some(i) = held.pop() {
                slots[i] = None;
            }
        }
    }
}

/// Give every empty slot the pool member with the fewest slots so far (first in pool order on
/// ties) among those `allowed` for that slot.
fn fill_least_loaded(
    slots: &mut [Option<InstanceId>],
    pool: &[InstanceId],
    allowed: impl Fn(usize, &InstanceId) -> bool,
) {
    for i in 0..slots.len() {
        if slots[i].is_some() {
            continue;
        }
        let load = |c: &InstanceId| slots.iter().filter(|s| s.as_ref() == Some(c)).count();
        let choice = pool
            .iter()
            .filter(|c| allowed(i, c))
            .min_by_key(|c| load(c))
            .cloned();
        slots[i] = choice;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent_api::{AppConfig, MetricKind, StopCondition};
    use proptest::prelude::*;

    fn id(s: &str) -> InstanceId {
        InstanceId(s.into())
    }

    fn config() -> TrainingConfig {
        let mut c = TrainingConfig::new(AppConfig::Synthetic { model_len: 1000 });
        c.num_shards = 4;
        c.num_partitions = 30;
        c.stages = StageThresholds {
            stage2_ratio: 1.0,
            stage3_ratio: 3.0,
        };
        c.dead_member_timeout_ms = 5_000;
        c
    }

    fn join(c: &mut Coordinator, name: &str, tier: Tier, now: u64) {
        let req = RegisterRequest {
            instance_id: id(name),
            data_addr: format!("{name}:1"),
            vcpus: 1,
            agent_version: String::new(),
            protocol_version: crate::agent_api::PROTOCOL_VERSION,
        };
        c.register(req, tier, now).unwrap();
        c.event(&id(name), AgentEvent::Ready { model_len: 1000 }, now)
            .unwrap();
    }

    fn view(c: &Coordinator) -> ClusterView {
        c.view().cloned().unwrap()
    }

    #[test]
    fn an_agent_of_another_protocol_version_is_refused_at_the_hello_naming_both() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        for other in [0, crate::agent_api::PROTOCOL_VERSION + 1] {
            let req = RegisterRequest {
                instance_id: id("a"),
                data_addr: "a:1".into(),
                vcpus: 1,
                agent_version: String::new(),
                protocol_version: other,
            };
            let e = c.register(req, Tier::Reliable, 100).unwrap_err();
            assert_eq!(
                e,
                CoordinatorError::ProtocolMismatch {
                    agent: other,
                    broker: crate::agent_api::PROTOCOL_VERSION
                }
            );
            assert_eq!((e.http_status(), e.code()), (409, "protocol_mismatch"));
            let text = e.to_string();
            assert!(
                text.contains(&format!("agent protocol {other}"))
                    && text.contains(&format!(
                        "this broker {}",
                        crate::agent_api::PROTOCOL_VERSION
                    )),
                "{text}"
            );
            assert!(c.status().members.is_empty(), "nothing joined");
        }
        // The same agent of this version joins, and is told the broker's version.
        let req = RegisterRequest {
            instance_id: id("a"),
            data_addr: "a:1".into(),
            vcpus: 1,
            agent_version: String::new(),
            protocol_version: crate::agent_api::PROTOCOL_VERSION,
        };
        let r = c.register(req, Tier::Reliable, 100).unwrap();
        assert_eq!(r.protocol_version, crate::agent_api::PROTOCOL_VERSION);
    }

    #[test]
    fn a_member_is_ready_from_its_ready_event_not_its_registration() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        let req = RegisterRequest {
            instance_id: id("a"),
            data_addr: "a:1".into(),
            vcpus: 1,
            agent_version: String::new(),
            protocol_version: crate::agent_api::PROTOCOL_VERSION,
        };
        c.register(req, Tier::Reliable, 100).unwrap();
        let member = |c: &Coordinator| c.status().members[0].clone();
        assert_eq!(
            (member(&c).joined_at_ms, member(&c).ready_at_ms),
            (100, None)
        );
        c.event(&id("a"), AgentEvent::Ready { model_len: 1000 }, 250)
            .unwrap();
        assert_eq!(member(&c).ready_at_ms, Some(250));
        // A repeated readiness (a retried event) keeps the first.
        c.event(&id("a"), AgentEvent::Ready { model_len: 1000 }, 900)
            .unwrap();
        assert_eq!(member(&c).ready_at_ms, Some(250));
    }

    /// An MLP job's founders are the first layout's workers, for good: a warned founder stays
    /// listed (the pipeline keeps its number), and a replacement is a worker but no founder,
    /// whatever its rank among the workers.
    #[test]
    fn an_mlp_job_keeps_its_founders_and_a_replacement_is_not_one() {
        let app: AppConfig = serde_json::from_value(serde_json::json!({"type": "mlp"})).unwrap();
        let mut cfg = config();
        cfg.app = app;
        cfg.min_workers = 2;
        let mut c = Coordinator::new(JobId(1), cfg).unwrap();
        join(&mut c, "b", Tier::Transient, 1);
        assert!(view(&c).founders.is_empty(), "no layout yet");
        join(&mut c, "c", Tier::Transient, 2);
        assert_eq!(view(&c).founders, [id("b"), id("c")]);
        c.event(
            &id("b"),
            AgentEvent::InterruptionWarning {
                action: "terminate".into(),
                action_time: "t".into(),
            },
            3,
        )
        .unwrap();
        // The replacement sorts first, so it takes rank 0 among the workers.
        join(&mut c, "a", Tier::Transient, 4);
        let v = view(&c);
        assert_eq!(v.worker(&id("a")).map(|w| w.rank), Some(0));
        assert_eq!(v.founders, [id("b"), id("c")]);
        // Saved and restored (a broker restart), the founders stay.
        let saved = serde_json::to_string(&c).unwrap();
        let back: Coordinator = serde_json::from_str(&saved).unwrap();
        assert_eq!(view(&back).founders, [id("b"), id("c")]);

        // Other jobs have none.
        let mut c = Coordinator::new(JobId(2), config()).unwrap();
        join(&mut c, "a", Tier::Transient, 1);
        assert!(view(&c).workers.len() == 1 && view(&c).founders.is_empty());
    }

    fn tier_of(v: &ClusterView, i: &InstanceId) -> Tier {
        v.member(i).unwrap().tier
    }

    /// Every partition is worked on by exactly one worker, every key by exactly one shard.
    fn assert_covering(v: &ClusterView) {
        for p in 0..v.num_partitions {
            let owners = v
                .workers
                .iter()
                .filter(|w| w.partitions.contains(p))
                .count();
            assert_eq!(
                owners,
                if v.workers.is_empty() { 0 } else { 1 },
                "partition {p}"
            );
        }
        let mut next = 0;
        for s in &v.shards {
            assert_eq!(s.keys.start, next);
            next = s.keys.end;
            assert_ne!(
                Some(&s.active),
                s.backup.as_ref(),
                "active and backup on one machine"
            );
            assert!(
                v.member(&s.active).is_some(),
                "active owner must be a member"
            );
        }
        assert_eq!(next, v.model_len);
    }

    fn command_config(max_nodes: u32) -> TrainingConfig {
        let cmd: crate::agent_api::CommandConfig = serde_json::from_value(serde_json::json!({
            "run": ["train"],
            "max_nodes": max_nodes,
        }))
        .unwrap();
        let mut c = TrainingConfig::new(AppConfig::Command(cmd));
        c.dead_member_timeout_ms = 5_000;
        c
    }

    fn join_command(c: &mut Coordinator, name: &str, now: u64) {
        let req = RegisterRequest {
            instance_id: id(name),
            data_addr: format!("{name}:1"),
            vcpus: 1,
            agent_version: String::new(),
            protocol_version: crate::agent_api::PROTOCOL_VERSION,
        };
        c.register(req, Tier::Transient, now).unwrap();
        c.event(&id(name), AgentEvent::Ready { model_len: 1 }, now)
            .unwrap();
    }

    /// (instance, rank) of the working instances in the current view.
    fn ranks(c: &Coordinator) -> Vec<(String, u32)> {
        view(c)
            .workers
            .iter()
            .map(|w| (w.instance_id.0.clone(), w.rank))
            .collect()
    }

    fn exit(c: &mut Coordinator, name: &str, now: u64) {
        c.event(
            &id(name),
            AgentEvent::Exit {
                reason: ExitReason::Interrupted,
            },
            now,
        )
        .unwrap();
    }

    #[test]
    fn a_command_rank_stays_with_its_holder_and_passes_to_a_replacement_only_once_freed() {
        let mut c = Coordinator::new(JobId(1), command_config(3)).unwrap();
        // Ids sort the other way round from the join order: ranks follow the join, and a
        // newcomer sorting first does not shift anyone's rank.
        join_command(&mut c, "z", 1);
        join_command(&mut c, "y", 2);
        join_command(&mut c, "x", 3);
        assert_eq!(
            ranks(&c),
            [("z".into(), 0), ("y".into(), 1), ("x".into(), 2)]
        );

        // y is warned: it keeps rank 1 while it saves. x, above it, waits: "rank 2 of 2" would
        // break any program that indexes by rank.
        c.event(
            &id("y"),
            AgentEvent::InterruptionWarning {
                action: "terminate".into(),
                action_time: "t".into(),
            },
            4,
        )
        .unwrap();
        assert_eq!(ranks(&c), [("z".into(), 0)]);
        assert!(c.holds_rank(&id("y"), 1));
        assert!(c.holds_rank(&id("x"), 2));

        // Its replacement joins during the notice: every rank below max_instances is held,
        // so it waits rather than becoming rank 3 (world 4 > max) or sharing rank 1.
        join_command(&mut c, "a", 5);
        assert_eq!(ranks(&c), [("z".into(), 0)]);
        assert_eq!(c.rank_holder(1), Some(&id("y")));

        // y exits (its checkpoint is up): the replacement takes rank 1.
        exit(&mut c, "y", 6);
        assert_eq!(
            ranks(&c),
            [("z".into(), 0), ("a".into(), 1), ("x".into(), 2)]
        );
        assert!(c.holds_rank(&id("a"), 1));
        assert!(!c.holds_rank(&id("y"), 1));
    }

    #[test]
    fn a_command_job_never_works_more_instances_than_max_instances() {
        let mut c = Coordinator::new(JobId(1), command_config(2)).unwrap();
        for (i, name) in ["a", "b", "c", "d"].iter().enumerate() {
            join_command(&mut c, name, i as u64);
        }
        assert_eq!(ranks(&c), [("a".into(), 0), ("b".into(), 1)]);
        // The cloud takes b away without a word from its agent: the first waiting member
        // (by join time) takes its rank.
        c.remove(&id("b"), "terminated", 10);
        assert_eq!(ranks(&c), [("a".into(), 0), ("c".into(), 1)]);
    }

    #[test]
    fn a_provider_warning_takes_a_command_member_out_of_the_working_set_at_once() {
        let mut c = Coordinator::new(JobId(1), command_config(2)).unwrap();
        join_command(&mut c, "a", 1);
        join_command(&mut c, "b", 2);
        assert!(c.provider_warned(&id("b")));
        assert_eq!(ranks(&c), [("a".into(), 0)]);
        assert!(c.holds_rank(&id("b"), 1), "kept until it departs");
        assert!(
            !c.provider_warned(&id("b")),
            "a second warning changes nothing"
        );
        // AgileML jobs leave the warning to the agent.
        let mut agile = Coordinator::new(JobId(2), config()).unwrap();
        join(&mut agile, "t1", Tier::Transient, 1);
        assert!(!agile.provider_warned(&id("t1")));
    }

    fn warn_command(c: &mut Coordinator, name: &str, now: u64) {
        let _ = c.event(
            &id(name),
            AgentEvent::InterruptionWarning {
                action: "terminate".into(),
                action_time: "t".into(),
            },
            now,
        );
    }

    fn program_ended(c: &mut Coordinator, name: &str, after_notice: bool, now: u64) {
        let _ = c.event(
            &id(name),
            AgentEvent::ProgramExited {
                code: Some(if after_notice { 143 } else { 1 }),
                signal: None,
                after_notice,
                completes: false,
            },
            now,
        );
    }

    #[test]
    fn a_member_proteus_stops_is_told_to_stop_and_keeps_its_rank_until_it_leaves() {
        let mut c = Coordinator::new(JobId(1), command_config(2)).unwrap();
        join_command(&mut c, "a", 1);
        join_command(&mut c, "b", 2);
        let before = c.latest_seq(&id("b")).unwrap();
        assert!(c.stop_member(&id("b"), "released by the policy"));
        let told = c.commands_after(&id("b"), before).unwrap();
        assert!(
            told.iter().any(|e| matches!(&e.command, Command::Stop { reason } if reason == "released by the policy")),
            "{told:?}"
        );
        assert_eq!(ranks(&c), [("a".into(), 0)]);
        assert!(
            c.holds_rank(&id("b"), 1),
            "its program is still saving rank 1"
        );
        assert!(!c.stop_member(&id("nobody"), "x"));
        exit(&mut c, "b", 3);
        assert_eq!(c.rank_holder(1), None);
        // Not a command job: nothing to tell.
        let mut agile = Coordinator::new(JobId(2), config()).unwrap();
        join(&mut agile, "t1", Tier::Transient, 1);
        assert!(!agile.stop_member(&id("t1"), "x"));
    }

    #[test]
    fn a_replacement_below_the_limit_waits_for_the_leaving_rank_and_resumes_it() {
        let mut c = Coordinator::new(JobId(1), command_config(3)).unwrap();
        join_command(&mut c, "z", 1);
        join_command(&mut c, "y", 2);
        warn_command(&mut c, "y", 3);
        // The job holds fewer than max_instances, yet the newcomer does not open rank 2 from
        // step 0 ("rank 2 of 2"): rank 1's checkpoint is being saved, and it is the newcomer's.
        join_command(&mut c, "x", 4);
        assert_eq!(ranks(&c), [("z".into(), 0)]);
        assert_eq!(c.rank_holder(2), None);
        exit(&mut c, "y", 5);
        assert_eq!(ranks(&c), [("z".into(), 0), ("x".into(), 1)]);
    }

    #[test]
    fn a_rank_nobody_replaces_is_taken_by_the_highest_holder_once_its_program_stopped() {
        let mut c = Coordinator::new(JobId(1), command_config(3)).unwrap();
        for (i, n) in ["z", "y", "w"].iter().enumerate() {
            join_command(&mut c, n, i as u64);
        }
        warn_command(&mut c, "y", 3);
        assert_eq!(ranks(&c), [("z".into(), 0)], "w waits behind y's rank");
        exit(&mut c, "y", 4);
        // Rank 1 is free, but w's program may still be saving rank 2: w keeps it meanwhile,
        // out of the working set.
        assert_eq!(ranks(&c), [("z".into(), 0)]);
        assert!(c.holds_rank(&id("w"), 2));
        program_ended(&mut c, "w", true, 5);
        assert_eq!(ranks(&c), [("z".into(), 0), ("w".into(), 1)]);
        // Rank 2's lineage is free now; the next newcomer takes it before any fresh rank.
        join_command(&mut c, "v", 6);
        assert_eq!(
            ranks(&c),
            [("z".into(), 0), ("w".into(), 1), ("v".into(), 2)]
        );
    }

    /// One agent of the property test below: the program it runs, as (rank, world size).
    #[derive(Debug, Default, Clone)]
    struct ModelAgent {
        running: Option<(u32, u32)>,
    }

    /// Random churn against the command-job rank rules, with a model of each agent (it starts
    /// its program when the view gives it a slot, stops it when the view takes the slot away or
    /// changes its rank, and reports the end): joins, restarts, warnings from agent and
    /// provider, exits, removals, program failures and broker restarts (state saved, loaded,
    /// resumed), for max_instances 1–8.
    fn check_rank_invariants(
        max: u32,
        torchrun: bool,
        ops: &[(u8, u8)],
    ) -> Result<(), TestCaseError> {
        let mut cfg = command_config(max);
        if let AppConfig::Command(cmd) = &mut cfg.app {
            cmd.max_restarts = u32::MAX;
            if torchrun {
                cmd.launcher = crate::agent_api::CommandLauncher::Torchrun;
            }
        }
        let mut c = Coordinator::new(JobId(1), cfg).unwrap();
        let names: Vec<String> = (0..10).map(|i| format!("i{i}")).collect();
        let mut agents: BTreeMap<String, ModelAgent> = BTreeMap::new();
        let mut opened: std::collections::BTreeSet<u32> = Default::default();
        // What an agent does with the current view.
        fn act(
            c: &mut Coordinator,
            agents: &mut BTreeMap<String, ModelAgent>,
            name: &str,
            now: u64,
            dense: bool,
        ) -> Result<(), TestCaseError> {
            let Some(view) = c.view().cloned() else {
                return Ok(());
            };
            let Some(agent) = agents.get_mut(name) else {
                return Ok(());
            };
            let slot = view
                .worker(&id(name))
                .map(|w| (w.rank, view.workers.len() as u32));
            match (agent.running, slot) {
                (None, Some((rank, world))) => {
                    // (Under torchrun PROTEUS_RANK names a lineage; torchrun's own rank is
                    // dense.)
                    prop_assert!(
                        !dense || rank < world,
                        "{name} starts as rank {rank} of {world}"
                    );
                    prop_assert!(c.holds_rank(&id(name), rank));
                    agent.running = Some((rank, world));
                }
                (Some((r, _)), s) if s.is_none_or(|(rank, _)| rank != r) => {
                    agent.running = None;
                    program_ended(c, name, true, now);
                }
                (None, None) => {
                    let _ = c.event(
                        &id(name),
                        AgentEvent::ProgramIdle { epoch: view.epoch },
                        now,
                    );
                }
                _ => {}
            }
            Ok(())
        }
        let mut now = 0;
        for &(op, who) in ops {
            now += 1;
            let name = names[who as usize % names.len()].clone();
            let member = c.is_member(&id(&name));
            match op % 9 {
                0 => {
                    join_command(&mut c, &name, now);
                    agents.insert(name.clone(), ModelAgent::default());
                }
                1 if member => warn_command(&mut c, &name, now),
                2 => {
                    c.provider_warned(&id(&name));
                }
                3 if member => {
                    // An agent exits once its program ended.
                    if agents.get(&name).is_some_and(|a| a.running.is_some()) {
                        program_ended(&mut c, &name, true, now);
                    }
                    agents.remove(&name);
                    exit(&mut c, &name, now);
                }
                4 => {
                    agents.remove(&name);
                    c.remove(&id(&name), "gone", now);
                }
                5 if agents.get(&name).is_some_and(|a| a.running.is_some()) => {
                    // The program fails; a worker's agent starts it again at its next act.
                    agents.get_mut(&name).unwrap().running = None;
                    program_ended(&mut c, &name, false, now);
                }
                6 => {
                    let text = serde_json::to_string(&c).unwrap();
                    c = serde_json::from_str(&text).unwrap();
                    c.resume(now);
                }
                _ => act(&mut c, &mut agents, &name, now, !torchrun)?,
            }
            let mut seen = std::collections::BTreeSet::new();
            for (holder, rank) in &c.ranks {
                prop_assert!(*rank < max, "rank {rank} at max_instances {max}");
                prop_assert!(seen.insert(*rank), "rank {rank} has two holders");
                prop_assert!(c.is_member(holder), "a departed member holds rank {rank}");
            }
            // A fresh rank is opened only when every rank held before has a holder.
            for r in &seen {
                if !opened.contains(r) {
                    let orphans: Vec<_> = opened.iter().filter(|o| !seen.contains(o)).collect();
                    prop_assert!(
                        orphans.is_empty(),
                        "fresh rank {r} while ranks {orphans:?} have checkpoints and no holder"
                    );
                }
            }
            opened.extend(seen.iter().copied());
            // A running program's rank stays its instance's (only the holder uploads).
            for (name, a) in &agents {
                if let Some((rank, _)) = a.running {
                    prop_assert!(
                        c.holds_rank(&id(name), rank),
                        "{name} runs as rank {rank} it no longer holds"
                    );
                }
            }
            if let Some(v) = c.view()
                && !torchrun
            {
                let ranks: Vec<u32> = v.workers.iter().map(|w| w.rank).collect();
                prop_assert_eq!(ranks, (0..v.workers.len() as u32).collect::<Vec<_>>());
            }
        }
        // Churn over: the warned leave, and once every agent has acted (a stop, a move, a
        // start), every member that may work does, up to max_instances.
        let leaving: Vec<String> = c
            .members
            .iter()
            .filter(|(_, m)| m.state == MemberState::Leaving)
            .map(|(i, _)| i.0.clone())
            .collect();
        for name in leaving {
            now += 1;
            if agents.remove(&name).is_some_and(|a| a.running.is_some()) {
                program_ended(&mut c, &name, true, now);
            }
            exit(&mut c, &name, now);
        }
        for _ in 0..3 {
            let names: Vec<String> = agents.keys().cloned().collect();
            for name in names {
                now += 1;
                act(&mut c, &mut agents, &name, now, !torchrun)?;
            }
        }
        let active = c
            .members
            .values()
            .filter(|m| m.state == MemberState::Active)
            .count() as u32;
        // (With nobody active the layout is not recomputed: nothing to check.)
        if let Some(v) = c.view()
            && c.started
            && active > 0
        {
            prop_assert_eq!(
                v.workers.len() as u32,
                active.min(max),
                "idle members left waiting"
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn command_ranks_hold_their_invariants_under_any_churn(
            max in 1u32..=8,
            torchrun in any::<bool>(),
            ops in proptest::collection::vec((0u8..9, 0u8..10), 1..400),
        ) {
            check_rank_invariants(max, torchrun, &ops)?;
        }
    }

    #[test]
    fn stage_follows_ratio() {
        let t = StageThresholds {
            stage2_ratio: 1.0,
            stage3_ratio: 3.0,
        };
        let (r, tr) = (id("r"), id("t"));
        assert_eq!(choose_stage(&[(&r, Tier::Reliable)], &t), Stage::Stage1);
        assert_eq!(
            choose_stage(&[(&r, Tier::Reliable), (&tr, Tier::Transient)], &t),
            Stage::Stage2
        );
        assert_eq!(
            choose_stage(
                &[
                    (&r, Tier::Reliable),
                    (&tr, Tier::Transient),
                    (&tr, Tier::Transient),
                    (&tr, Tier::Transient)
                ],
                &t
            ),
            Stage::Stage3
        );
        assert_eq!(choose_stage(&[(&tr, Tier::Transient)], &t), Stage::Stage3);
    }

    #[test]
    fn stage1_places_all_shards_on_reliable_without_backups() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        join(&mut c, "r2", Tier::Reliable, 0);
        join(&mut c, "t1", Tier::Transient, 0);
        let v = view(&c);
        assert_eq!(v.stage, Stage::Stage1);
        for s in &v.shards {
            assert_eq!(tier_of(&v, &s.active), Tier::Reliable);
            assert_eq!(s.backup, None);
            // Shards first placed on r1 move to r2 when it joins, by hand-over from r1.
            assert!(matches!(
                &s.source,
                ShardSource::Fresh | ShardSource::Handover { .. }
            ));
        }
        assert_eq!(v.workers.len(), 3);
        assert_covering(&v);
        // Load is balanced across the reliable machines.
        let on_r1 = v.shards.iter().filter(|s| s.active == id("r1")).count();
        assert_eq!(on_r1, 2);
    }

    #[test]
    fn stage2_puts_actives_on_transient_and_backups_on_reliable() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        join(&mut c, "t1", Tier::Transient, 0);
        join(&mut c, "t2", Tier::Transient, 0);
        let v = view(&c);
        assert_eq!(v.stage, Stage::Stage2);
        for s in &v.shards {
            assert_eq!(tier_of(&v, &s.active), Tier::Transient);
            assert_eq!(
                s.backup.as_ref().map(|b| tier_of(&v, b)),
                Some(Tier::Reliable)
            );
        }
        assert_eq!(v.workers.len(), 3, "stage 2: workers everywhere");
        assert_covering(&v);
    }

    #[test]
    fn stage3_reliable_hold_only_backups() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        for t in ["t1", "t2", "t3"] {
            join(&mut c, t, Tier::Transient, 0);
        }
        let v = view(&c);
        assert_eq!(v.stage, Stage::Stage3);
        assert!(v.worker(&id("r1")).is_none());
        assert_eq!(v.workers.len(), 3);
        assert!(v.shards.iter().all(|s| s.active != id("r1")));
        assert!(v.shards.iter().all(|s| s.backup == Some(id("r1"))));
        assert_covering(&v);
    }

    #[test]
    fn stage_switches_live_and_shards_hand_over() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        let v1 = view(&c);
        assert_eq!(v1.stage, Stage::Stage1);
        join(&mut c, "t1", Tier::Transient, 10);
        let v2 = view(&c);
        assert_eq!(v2.stage, Stage::Stage2);
        assert!(v2.epoch > v1.epoch);
        for s in &v2.shards {
            assert_eq!(s.active, id("t1"));
            assert_eq!(s.backup, Some(id("r1")));
            assert_eq!(
                s.source,
                ShardSource::Handover {
                    from: id("r1"),
                    fallback: None
                },
                "the reliable holder is alive and hands over"
            );
        }
        // t1 leaves by warning: back to stage 1, shards hand over from t1 to r1 (r1 holds backup).
        c.event(
            &id("t1"),
            AgentEvent::InterruptionWarning {
                action: "terminate".into(),
                action_time: "x".into(),
            },
            20,
        )
        .unwrap();
        let v3 = view(&c);
        assert_eq!(v3.stage, Stage::Stage1);
        assert!(
            v3.member(&id("t1")).is_none(),
            "a warned member leaves the next view"
        );
        assert!(v3.worker(&id("t1")).is_none());
        for s in &v3.shards {
            assert_eq!(s.active, id("r1"));
            assert_eq!(
                s.source,
                ShardSource::Handover {
                    from: id("t1"),
                    fallback: Some(id("r1"))
                }
            );
        }
        // The leaving member still gets the view that tells it to hand over.
        let cmds = c.commands_after(&id("t1"), 0).unwrap();
        assert!(
            matches!(&cmds.last().unwrap().command, Command::Configure(v) if v.epoch == v3.epoch)
        );
        assert_covering(&v3);
    }

    #[test]
    fn dead_member_restores_from_backup() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        join(&mut c, "t1", Tier::Transient, 0);
        join(&mut c, "t2", Tier::Transient, 0);
        let before = view(&c);
        let on_t1: Vec<u32> = before
            .shards
            .iter()
            .filter(|s| s.active == id("t1"))
            .map(|s| s.shard)
            .collect();
        assert!(!on_t1.is_empty());
        // Everyone but t1 keeps heartbeating.
        for who in ["r1", "t2"] {
            c.heartbeat(&id(who), Heartbeat::default(), 4_000).unwrap();
        }
        assert!(c.tick(4_000).is_empty());
        let dead = c.tick(5_001);
        assert_eq!(dead, vec![id("t1")]);
        let after = view(&c);
        for s in on_t1 {
            let p = after.shard(s).unwrap();
            assert_eq!(p.active, id("t2"));
            assert_eq!(p.source, ShardSource::Restore { from: id("r1") });
        }
        // Shards that did not move keep their source.
        for p in after
            .shards
            .iter()
            .filter(|p| before.shard(p.shard).unwrap().active == p.active)
        {
            assert_eq!(p.source, before.shard(p.shard).unwrap().source);
        }
        assert_covering(&after);
        assert!(matches!(
            c.status().departed[0].reason,
            DepartureReason::TimedOut
        ));
    }

    #[test]
    fn shard_without_backup_is_lost_when_owner_dies() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        join(&mut c, "r2", Tier::Reliable, 0);
        c.remove(&id("r1"), "terminated", 10);
        let v = view(&c);
        for s in &v.shards {
            assert_eq!(s.active, id("r2"));
        }
        assert!(v.shards.iter().any(|s| s.source == ShardSource::Lost));
    }

    #[test]
    fn partitions_resplit_on_join_and_leave() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        for n in 1..=5 {
            join(&mut c, &format!("r{}", n + 1), Tier::Reliable, 0);
            let v = view(&c);
            assert_eq!(v.workers.len(), n + 1);
            assert_covering(&v);
            let sizes: Vec<u32> = v.workers.iter().map(|w| w.partitions.len()).collect();
            assert!(
                sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
                "{sizes:?}"
            );
        }
        c.event(
            &id("r3"),
            AgentEvent::Exit {
                reason: ExitReason::Stopped,
            },
            5,
        )
        .unwrap();
        let v = view(&c);
        assert_eq!(v.workers.len(), 5);
        assert_covering(&v);
    }

    #[test]
    fn min_workers_holds_back_workers_but_places_shards() {
        let mut cfg = config();
        cfg.min_workers = 3;
        let mut c = Coordinator::new(JobId(1), cfg).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        join(&mut c, "r2", Tier::Reliable, 0);
        assert!(view(&c).workers.is_empty());
        assert_eq!(c.status().state, JobState::Waiting);
        join(&mut c, "r3", Tier::Reliable, 0);
        assert_eq!(view(&c).workers.len(), 3);
        assert_eq!(c.status().state, JobState::Running);
        // Once started, fewer workers keep going.
        c.remove(&id("r3"), "gone", 1);
        assert_eq!(view(&c).workers.len(), 2);
    }

    #[test]
    fn rebalance_drains_shards_but_keeps_worker() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        join(&mut c, "t1", Tier::Transient, 0);
        join(&mut c, "t2", Tier::Transient, 0);
        c.event(
            &id("t1"),
            AgentEvent::RebalanceRecommendation { notice_time: None },
            1,
        )
        .unwrap();
        let v = view(&c);
        assert!(v.member(&id("t1")).unwrap().draining);
        assert!(v.worker(&id("t1")).is_some());
        assert!(
            v.shards
                .iter()
                .all(|s| s.active != id("t1") && s.backup != Some(id("t1")))
        );
    }

    #[test]
    fn commands_are_sequenced_and_compacted() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        join(&mut c, "r2", Tier::Reliable, 0);
        join(&mut c, "r3", Tier::Reliable, 0);
        let cmds = c.commands_after(&id("r1"), 0).unwrap();
        assert_eq!(cmds.len(), 1, "older layouts are superseded");
        assert_eq!(cmds[0].seq, 3);
        assert!(c.commands_after(&id("r1"), 3).unwrap().is_empty());
        assert_eq!(c.latest_seq(&id("r1")), Some(3));
        // r3 joined last and gets exactly the current view.
        let r3 = c.commands_after(&id("r3"), 0).unwrap();
        assert!(matches!(&r3[0].command, Command::Configure(v) if v.epoch == view(&c).epoch));
        assert!(matches!(
            c.commands_after(&id("nobody"), 0),
            Err(CoordinatorError::UnknownInstance(_))
        ));
    }

    #[test]
    fn a_saved_coordinator_resumes_past_anything_agents_saw() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        join(&mut c, "t1", Tier::Transient, 0);
        let saved = serde_json::to_string(&c).unwrap();
        // After the save, the crashed broker issued more commands the agent saw.
        join(&mut c, "t2", Tier::Transient, 0);
        let seen = c.latest_seq(&id("r1")).unwrap();

        let mut restored: Coordinator = serde_json::from_str(&saved).unwrap();
        assert_eq!(
            restored.view(),
            serde_json::from_str::<Coordinator>(&saved).unwrap().view()
        );
        restored.resume(60_000);
        let cmds = restored.commands_after(&id("r1"), seen).unwrap();
        assert_eq!(cmds.len(), 1, "the current layout again, under new numbers");
        assert!(
            matches!(&cmds[0].command, Command::Configure(v) if v.epoch == view(&restored).epoch)
        );
        assert!(
            restored.tick(60_000 + 5_000).is_empty(),
            "a fresh timeout after the outage"
        );
    }

    #[test]
    fn a_snapshot_grows_linearly_with_members() {
        let size = |n: usize| {
            let mut c = Coordinator::new(JobId(1), config()).unwrap();
            join(&mut c, "r1", Tier::Reliable, 0);
            for i in 0..n {
                join(&mut c, &format!("t{i}"), Tier::Transient, 0);
            }
            serde_json::to_string(&c).unwrap().len()
        };
        let (small, large) = (size(100), size(400));
        // Four times the members: about four times the bytes, not sixteen.
        assert!(
            large < 5 * small,
            "100 members: {small} bytes, 400 members: {large} bytes"
        );
    }

    #[test]
    fn training_complete_stops_everyone_and_ends_job() {
        let mut c = Coordinator::new(JobId(7), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        join(&mut c, "r2", Tier::Reliable, 0);
        let metric = Metric {
            kind: MetricKind::Accuracy,
            value: 0.92,
            baseline: Some(0.11),
            clock: 100,
        };
        c.event(&id("r2"), AgentEvent::TrainingComplete { metric }, 5)
            .unwrap();
        let st = c.status();
        assert_eq!(st.state, JobState::Completed);
        assert_eq!(st.final_metric, Some(metric));
        for who in ["r1", "r2"] {
            let cmds = c.commands_after(&id(who), 0).unwrap();
            assert!(matches!(cmds.last().unwrap().command, Command::Stop { .. }));
        }
        let err = c.heartbeat(&id("r1"), Heartbeat::default(), 6).unwrap_err();
        assert_eq!(err.http_status(), 409);
        let req = RegisterRequest {
            instance_id: id("late"),
            data_addr: "x".into(),
            vcpus: 1,
            agent_version: String::new(),
            protocol_version: crate::agent_api::PROTOCOL_VERSION,
        };
        assert_eq!(
            c.register(req, Tier::Reliable, 7)
                .unwrap_err()
                .http_status(),
            409
        );
    }

    #[test]
    fn model_len_must_agree() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        let req = RegisterRequest {
            instance_id: id("r2"),
            data_addr: "x".into(),
            vcpus: 1,
            agent_version: String::new(),
            protocol_version: crate::agent_api::PROTOCOL_VERSION,
        };
        c.register(req, Tier::Reliable, 0).unwrap();
        assert!(
            c.view().unwrap().member(&id("r2")).is_none(),
            "joining members get no role"
        );
        let err = c
            .event(&id("r2"), AgentEvent::Ready { model_len: 999 }, 0)
            .unwrap_err();
        assert_eq!(err.http_status(), 400);
    }

    #[test]
    fn aggregate_progress_keeps_departed_samples() {
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        join(&mut c, "r1", Tier::Reliable, 0);
        join(&mut c, "r2", Tier::Reliable, 0);
        for (who, samples, clock) in [("r1", 100, 4), ("r2", 50, 5)] {
            let hb = Heartbeat {
                applied_epoch: 1,
                progress: Progress {
                    clock,
                    samples_processed: samples,
                    loss: Some(1.0),
                    ..Default::default()
                },
            };
            c.heartbeat(&id(who), hb, 1).unwrap();
        }
        c.remove(&id("r2"), "gone", 2);
        let p = c.status().progress;
        assert_eq!(p.samples_processed, 150);
        assert_eq!(p.clock, 4);
    }

    #[test]
    fn same_calls_same_views() {
        let run = || {
            let mut c = Coordinator::new(JobId(1), config()).unwrap();
            for (i, n) in ["t3", "r1", "t1", "r2", "t2", "t4", "t5"]
                .iter()
                .enumerate()
            {
                let tier = if n.starts_with('r') {
                    Tier::Reliable
                } else {
                    Tier::Transient
                };
                join(&mut c, n, tier, i as u64);
            }
            c.event(
                &id("t1"),
                AgentEvent::InterruptionWarning {
                    action: "terminate".into(),
                    action_time: "x".into(),
                },
                9,
            )
            .unwrap();
            c.remove(&id("t4"), "evicted", 10);
            serde_json::to_string(&c.commands_after(&id("r1"), 0).unwrap()).unwrap()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn placement_invariants_hold_under_random_churn() {
        // A small deterministic pseudo-random walk over joins, warnings, exits and deaths.
        let mut c = Coordinator::new(JobId(1), config()).unwrap();
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut names = 0;
        let mut prev_epoch = 0;
        for step in 0..400u64 {
            let members: Vec<InstanceId> = c
                .status()
                .members
                .iter()
                .map(|m| m.instance_id.clone())
                .collect();
            match next() % 5 {
                0 | 1 => {
                    names += 1;
                    let tier = if next() % 3 == 0 {
                        Tier::Reliable
                    } else {
                        Tier::Transient
                    };
                    join(&mut c, &format!("m{names}"), tier, step);
                }
                2 if !members.is_empty() => {
                    let m = &members[(next() as usize) % members.len()];
                    let _ = c.event(
                        m,
                        AgentEvent::InterruptionWarning {
                            action: "terminate".into(),
                            action_time: "x".into(),
                        },
                        step,
                    );
                }
                3 if !members.is_empty() => {
                    let m = &members[(next() as usize) % members.len()];
                    c.remove(m, "evicted", step);
                }
                _ if !members.is_empty() => {
                    let m = &members[(next() as usize) % members.len()];
                    let _ = c.event(
                        m,
                        AgentEvent::RebalanceRecommendation { notice_time: None },
                        step,
                    );
                }
                _ => {}
            }
            if let Some(v) = c.view() {
                assert!(v.epoch >= prev_epoch);
                prev_epoch = v.epoch;
                if v.members.iter().any(|m| !m.draining) {
                    assert_covering(v);
                }
            }
        }
    }

    #[test]
    fn stop_condition_clocks() {
        let mut cfg = config();
        cfg.stop = StopCondition::Clocks { clocks: 7 };
        assert_eq!(cfg.total_clocks(), 7);
    }

    #[test]
    fn the_data_secret_reaches_members_only_while_the_job_runs_and_never_prints() {
        let secret = DataSecret::from_bytes([0xab; DataSecret::LEN]);
        let mut c = Coordinator::new(JobId(1), config())
            .unwrap()
            .with_data_secret(secret.clone());
        let reg = c
            .register(
                RegisterRequest {
                    instance_id: InstanceId("i-1".into()),
                    data_addr: "127.0.0.1:1".into(),
                    vcpus: 1,
                    agent_version: String::new(),
                    protocol_version: crate::agent_api::PROTOCOL_VERSION,
                },
                Tier::Reliable,
                0,
            )
            .unwrap();
        assert_eq!(reg.data_secret.as_ref(), Some(&secret));
        // Saved and restored with the coordinator (a broker restart keeps the job's secret)...
        let saved = serde_json::to_string(&c).unwrap();
        let restored: Coordinator = serde_json::from_str(&saved).unwrap();
        assert_eq!(restored.data_secret(), Some(&secret));
        // ...but never in a log line, whatever is logged.
        let hex = "ab".repeat(DataSecret::LEN);
        assert!(saved.contains(&hex));
        assert!(!format!("{reg:?} {c:?} {secret}").contains(&hex));
        // It dies with the job, and a finished job takes no new one.
        c.cancel("done");
        assert!(!c.has_data_secret());
        let c = c.with_data_secret(DataSecret::from_bytes([1; DataSecret::LEN]));
        assert!(c.data_secret().is_none());
        // Malformed secrets are refused without echoing them.
        let err = serde_json::from_str::<DataSecret>("\"zz\"").unwrap_err();
        assert!(!err.to_string().contains("zz"), "{err}");
    }
}
