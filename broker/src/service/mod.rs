//! The live broker: the state a running `proteus serve` holds and the operations the API and
//! the scheduler perform on it.
//!
//! - [`spec`]: the job spec users submit, and its validation;
//! - [`control`]: the agents' control plane (one coordinator per job);
//! - [`scheduler`]: the control loop that asks each job's policy and applies its decisions;
//! - [`ledger`]: billing instances into ledger lines, and the counterfactual costs;
//! - [`agents`], [`jobs`]: what the API's handlers call.
//!
//! The store is the source of truth: the broker writes an intent before it acts on the cloud,
//! so that [`Broker::recover`] can rebuild the in-memory parts after a crash.

pub mod agents;
pub mod control;
pub mod dry_run;
pub mod jobs;
pub mod ledger;
pub mod membership;
pub mod metrics;
pub mod pools;
pub mod programs;
pub mod recovery;
pub mod scheduler;
pub mod spec;
pub mod status_cache;

use crate::billing::BillingModel;
use crate::clock::SharedClock;
use crate::cloud::Cloud;
use crate::engine::JobEngine;
use crate::engine::job_engine::{EngineConfig, EngineState, JobTerms};
use crate::engine::view::TraceMarkets;
use crate::job::JobModel;
use crate::launcher::LocalLauncher;
use crate::market::{Market, Region};
use crate::market_model::{HazardModel, HazardPrior, PriceDrivenModel, PriceModelConfig};
use crate::market_model::{MarketModel, Observation};
use crate::prices::PriceHistory;
use crate::store::{JobRow, Store};
use control::ControlPlane;
use proteus_wire::{JobId, Tier};
use spec::{JobSpec, ValidJob};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::sync::Notify;

/// Which market model answers the policies' eviction questions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelChoice {
    /// Evictions follow the price (the 2015 market): replay of the stored history.
    Price,
    /// Evictions follow capacity (today): per-pool hazard learned from observed interruptions.
    Hazard,
}

pub use crate::engine::job_engine::Pacing;

/// Settings of a running broker.
#[derive(Debug, Clone)]
pub struct Settings {
    pub region: Region,
    /// Billing for jobs that do not choose.
    pub default_billing: BillingModel,
    pub model: ModelChoice,
    /// How often the control loop runs (wall time).
    pub tick: Duration,
    /// Minutes from launch to useful work assumed for jobs that do not say.
    pub default_startup_minutes: f64,
    /// How long a market that refused a launch is skipped (market seconds).
    pub cooldown_secs: f64,
    /// How long before an announced interruption the agent is killed at the latest (wall).
    pub min_notice: Duration,
    pub pacing: Pacing,
    /// Which `s3://` working directories command jobs may name (`--workdir-buckets`).
    pub workdir: programs::WorkdirPolicy,
    /// Agent events kept per job at most (`--max-job-events`); more are refused with 429.
    pub max_job_events: u32,
    /// Most instances held at once across all jobs (`serve --instance-cap`); a job asking
    /// for more is refused at submission.
    pub instance_cap: u32,
    /// The budget of a job whose spec sets none (`serve --default-budget-usd`).
    pub default_budget: Option<crate::market::Usd>,
    /// The capacity the simulated cloud plays (`serve --cloud sim --availability`): the cost
    /// report's counterfactuals replay it.
    pub availability: Option<Arc<crate::sim::availability::Availability>>,
}

/// Agent events kept per job unless `--max-job-events` says otherwise: far more than a job's
/// agents report in a normal life (a few per instance), far less than fills a disk.
pub const DEFAULT_MAX_JOB_EVENTS: u32 = 10_000;

/// Prices and the model the policies read, swapped whole when refreshed.
pub struct MarketData {
    pub history: Arc<PriceHistory>,
    pub markets: TraceMarkets,
    pub model: Mutex<Box<dyn MarketModel>>,
}

impl MarketData {
    pub fn new(
        history: Arc<PriceHistory>,
        choice: ModelChoice,
        learned: Option<Box<dyn MarketModel>>,
    ) -> Self {
        let model: Box<dyn MarketModel> = match (choice, learned) {
            (ModelChoice::Hazard, Some(m)) => m,
            (ModelChoice::Hazard, None) => Box::new(HazardModel::new(HazardPrior::default())),
            (ModelChoice::Price, _) => Box::new(PriceDrivenModel::new(
                history.clone(),
                PriceModelConfig::default(),
            )),
        };
        MarketData {
            markets: TraceMarkets::new(history.clone()),
            history,
            model: Mutex::new(model),
        }
    }

    pub fn observe(&self, observation: Observation<'_>) {
        self.model
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(observation);
    }
}

/// What the scheduler keeps per running job besides the store: its policy (which may hold
/// state) and its resolved models.
pub struct JobRuntime {
    pub valid: ValidJob,
    /// Everything decided about the job ([`crate::engine::JobEngine`]).
    pub engine: crate::engine::JobEngine<'static>,
    /// What the cloud reported since the last tick, for the engine.
    pub arrivals: Vec<crate::engine::job_engine::Input>,
    /// Whether the engine has been told of the store's instances (once, after it is built).
    pub reconciled: bool,
    /// The engine state last saved (saved again only when it changes).
    pub saved_engine: Option<String>,
}

/// A running broker.
pub struct Broker {
    store: Store,
    clock: SharedClock,
    cloud: Arc<dyn Cloud>,
    launcher: Option<Arc<LocalLauncher>>,
    control: ControlPlane,
    settings: Settings,
    metrics: metrics::Metrics,
    market_data: RwLock<Arc<MarketData>>,
    runtimes: Mutex<HashMap<JobId, Arc<Mutex<JobRuntime>>>>,
    /// Rings when something should be looked at before the next tick (a submit, a cancel).
    nudge: Notify,
    /// Agent tokens by cloud id, so heartbeats need no database read.
    pub(crate) agent_cache: Mutex<HashMap<String, agents::AgentIdentity>>,
    /// Job statuses as last read from the store; see [`status_cache`].
    status_cache: status_cache::StatusCache,
    /// What each ended instance was billed, by instance id: an ended instance's bill cannot
    /// change, so its ledger lines are written once, not on every tick.
    pub(crate) final_bills: Mutex<HashMap<String, crate::market::Usd>>,
    /// What the cloud reported and the store has not recorded yet (see
    /// `Broker::apply_cloud_events`).
    unrecorded_cloud_events: Mutex<std::collections::VecDeque<crate::cloud::CloudEvent>>,
    /// Command jobs' checkpoints and output tails ([`programs`]); unset: command jobs cannot
    /// checkpoint.
    pub(crate) programs: std::sync::OnceLock<crate::checkpoint::ProgramStorage>,
    /// Who this broker is among those sharing the database, and the jobs it owns.
    membership: membership::Membership,
    /// Instances whose launch the cloud is answering now (by instance id): a job's end leaves
    /// them to the launch, which terminates what it launched for a job that ended meanwhile.
    launches_in_flight: Mutex<std::collections::HashSet<String>>,
    /// Instances in `terminating` this broker has seen, and when their termination was last
    /// asked of the cloud (`Broker::retry_terminations`).
    terminations_asked: Mutex<HashMap<String, std::time::Instant>>,
    /// What every job saw of each spot pool ([`pools`]).
    pools: Mutex<pools::Pools>,
}

impl Broker {
    /// The broker's database.
    pub fn store(&self) -> &Store {
        &self.store
    }
    /// Market time.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }
    pub fn cloud(&self) -> &Arc<dyn Cloud> {
        &self.cloud
    }
    /// Starts agents on this machine for locally launched instances (the simulated cloud).
    pub fn launcher(&self) -> Option<&Arc<LocalLauncher>> {
        self.launcher.as_ref()
    }
    /// The jobs' coordinators.
    pub fn control(&self) -> &ControlPlane {
        &self.control
    }
    pub fn settings(&self) -> &Settings {
        &self.settings
    }
    pub fn metrics(&self) -> &metrics::Metrics {
        &self.metrics
    }
    /// Rings when something should be looked at before the next tick (a submit, a cancel).
    pub fn nudge(&self) -> &Notify {
        &self.nudge
    }
    pub fn status_cache(&self) -> &status_cache::StatusCache {
        &self.status_cache
    }
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("cloud", &self.cloud.kind())
            .finish_non_exhaustive()
    }
}

/// Why a job could not be accepted or run.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    /// A valid request this broker cannot take as things stand (its markets, its clock, its
    /// settings), naming the field (409).
    #[error("{field}: {message}")]
    Unmet { field: String, message: String },
    #[error("job {0} does not exist")]
    NoSuchJob(JobId),
    #[error("job {0} is already over")]
    JobOver(JobId),
    #[error("instance {0} does not exist")]
    NoSuchInstance(String),
    /// The request is well formed but the thing it names cannot do it now.
    #[error("{0}")]
    Refused(String),
    /// A malformed request the caller can fix.
    #[error("{0}")]
    BadRequest(String),
    /// No credentials, or ones nobody issued.
    #[error("{0}")]
    Unauthenticated(String),
    /// Credentials of someone else, or of something that has ended.
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    /// More than the broker accepts (a checkpoint over its size limit).
    #[error("{0}")]
    TooLarge(String),
    /// Over a count limit (a job's events): 429.
    #[error("{0}")]
    TooMany(String),
    /// Over a disk quota (a job's checkpoints in the broker's directory store).
    #[error("{0}")]
    InsufficientStorage(String),
    /// The broker is not set up for this (no checkpoint store).
    #[error("{0}")]
    Unavailable(String),
    /// The job's coordinator refused an agent's call.
    #[error(transparent)]
    Coordinator(#[from] proteus_wire::coordinator::CoordinatorError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("{0}")]
    Internal(String),
    /// The job is another broker's (or nobody's, for a moment, while its lease moves).
    #[error("job {job} is run by another broker")]
    NotOwner { job: JobId },
    /// This broker holds the job's lease but has not renewed it in time (its local deadline
    /// passed `by` ago): it does not act on the job until a renewal says it still owns it.
    #[error(
        "this broker's lease on job {job} went unrenewed {by:?} past its local deadline; it acts \
         on the job again once the lease is renewed"
    )]
    LeaseLapsed { job: JobId, by: std::time::Duration },
}

impl ServiceError {
    pub(crate) fn invalid(field: &str, message: impl Into<String>) -> Self {
        ServiceError::Invalid {
            field: field.to_string(),
            message: message.into(),
        }
    }

    pub(crate) fn unmet(field: &str, message: impl Into<String>) -> Self {
        ServiceError::Unmet {
            field: field.to_string(),
            message: message.into(),
        }
    }
}

impl From<spec::FieldError> for ServiceError {
    fn from(e: spec::FieldError) -> Self {
        match e.unmet {
            true => ServiceError::Unmet {
                field: e.field,
                message: e.message,
            },
            false => ServiceError::Invalid {
                field: e.field,
                message: e.message,
            },
        }
    }
}

impl Broker {
    pub fn new(
        store: Store,
        clock: SharedClock,
        cloud: Arc<dyn Cloud>,
        launcher: Option<Arc<LocalLauncher>>,
        history: Arc<PriceHistory>,
        settings: Settings,
        membership: membership::Membership,
    ) -> Arc<Broker> {
        let data = MarketData::new(history, settings.model, None);
        Arc::new(Broker {
            store,
            clock,
            cloud,
            launcher,
            control: ControlPlane::default(),
            settings,
            metrics: metrics::Metrics::default(),
            programs: std::sync::OnceLock::new(),
            market_data: RwLock::new(Arc::new(data)),
            runtimes: Mutex::new(HashMap::new()),
            nudge: Notify::new(),
            agent_cache: Mutex::new(HashMap::new()),
            final_bills: Mutex::new(HashMap::new()),
            status_cache: Default::default(),
            unrecorded_cloud_events: Mutex::new(Default::default()),
            membership,
            launches_in_flight: Mutex::new(Default::default()),
            terminations_asked: Mutex::new(HashMap::new()),
            pools: Mutex::new(pools::Pools::new()),
        })
    }

    pub fn market_data(&self) -> Arc<MarketData> {
        self.market_data
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces the price history (e.g. after a refresh from EC2), keeping what the hazard
    /// model learned.
    pub fn replace_history(&self, history: Arc<PriceHistory>) {
        let old = self.market_data();
        let learned = old
            .model
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .boxed_clone();
        let data = MarketData::new(history, self.settings.model, Some(learned));
        *self.market_data.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(data);
    }

    pub fn runtime(&self, job: JobId) -> Option<Arc<Mutex<JobRuntime>>> {
        self.runtimes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&job)
            .cloned()
    }

    fn forget_runtime(&self, job: JobId) {
        self.runtimes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&job);
    }

    /// Forgets everything this broker holds in memory of a job — its runtime, its coordinator,
    /// its agents' identities — under the lock [`Broker::ensure_runtime`] creates them under, so
    /// that no request already past its lease check brings a copy back afterwards.
    pub(super) fn forget_job_state(&self, job: JobId) {
        {
            let mut runtimes = self.runtimes.lock().unwrap_or_else(|e| e.into_inner());
            runtimes.remove(&job);
            self.control.remove(job);
        }
        self.agent_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, a| a.job_id != job);
    }

    /// Builds (or returns) the runtime of a stored job: its policy, its work model and its
    /// coordinator. Used at submit and when a restarted broker resumes a job.
    ///
    /// Only while this broker holds the job's lease ([`ServiceError::NotOwner`] otherwise), and
    /// checked under the lock that forgetting a job takes: an agent's request that passed its
    /// lease check just before the lease was lost must not rebuild the job here from what the
    /// store held at that instant. Such a copy outlived the drop, and when this broker took the
    /// job back later it ran that copy instead of the new owner's saved state: a coordinator
    /// behind its agents' command cursors, which never gave them another command (the job
    /// stopped at 19% in a three-broker CI run).
    pub fn ensure_runtime(&self, job: &JobRow) -> Result<Arc<Mutex<JobRuntime>>, ServiceError> {
        if let Some(r) = self.runtime(job.id) {
            return Ok(r);
        }
        self.fence(job.id)?;
        let spec: JobSpec = serde_json::from_str(&job.spec)
            .map_err(|e| ServiceError::Internal(format!("stored spec of job {}: {e}", job.id)))?;
        let valid = spec
            .validate(self.settings.default_billing, job.created)
            .map_err(|e| {
                ServiceError::Internal(format!(
                    "stored spec of job {}: {}: {}",
                    job.id, e.field, e.message
                ))
            })?;
        let runtime = self.build_runtime(
            valid,
            job.started.unwrap_or(job.created),
            job.engine_state.as_deref(),
        )?;
        let mut runtimes = self.runtimes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = runtimes.get(&job.id) {
            return Ok(r.clone());
        }
        self.fence(job.id)?;
        self.control
            .ensure(
                job.id,
                &runtime.valid.training,
                job.control_state.as_deref(),
            )
            .map_err(|e| ServiceError::Internal(e.to_string()))?;
        let runtime = Arc::new(Mutex::new(runtime));
        runtimes.insert(job.id, runtime.clone());
        Ok(runtime)
    }

    /// Resolves the policy and the work model of a validated spec against the broker's markets.
    pub fn build_runtime(
        &self,
        valid: ValidJob,
        started_at: crate::market::Timestamp,
        saved: Option<&str>,
    ) -> Result<JobRuntime, ServiceError> {
        let dir = crate::policy::policies_dir();
        let path = dir.join(format!("{}.toml", valid.policy));
        if !path.is_file() {
            let mut names: Vec<String> = std::fs::read_dir(&dir)
                .map(|rd| {
                    rd.filter_map(|e| e.ok())
                        .filter_map(|e| {
                            e.file_name()
                                .to_str()?
                                .strip_suffix(".toml")
                                .map(str::to_string)
                        })
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            return Err(ServiceError::invalid(
                "policy",
                format!(
                    "unknown policy `{}` (available: {})",
                    valid.policy,
                    names.join(", ")
                ),
            ));
        }
        let policy = crate::policy::load_policy_file(&path)
            .map_err(|e| ServiceError::invalid("policy", e.to_string()))?;
        let data = self.market_data();
        let model = self.work_model(&valid, &data)?;
        let config = EngineConfig {
            // The demo's agents train for real: the job ends when they are done too.
            await_training: self.settings.pacing == Pacing::Modelled && self.launcher.is_some(),
            budget_lookahead_secs: scheduler::budget_lookahead_secs(
                self.settings.tick,
                self.clock.speed(),
            ),
            ..EngineConfig::new(self.settings.pacing)
        };
        let terms = JobTerms {
            estimated: valid.work.total_work.is_some(),
            billing: valid.billing,
            budget: valid.budget_usd,
            deadline: valid.deadline,
            started_at,
        };
        let engine = match saved.map(serde_json::from_str::<EngineState>) {
            Some(Ok(state)) => JobEngine::restore(model, policy, config, terms, state),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "a saved engine state cannot be read; the job's engine starts afresh");
                JobEngine::new(model, policy, config, terms)
            }
            None => JobEngine::new(model, policy, config, terms),
        };
        Ok(JobRuntime {
            valid,
            engine,
            arrivals: Vec::new(),
            reconciled: false,
            saved_engine: saved.map(str::to_string),
        })
    }

    fn work_model(&self, valid: &ValidJob, data: &MarketData) -> Result<JobModel, ServiceError> {
        let spec = valid
            .work_model_spec(
                &data.markets.usable_types(),
                self.settings.default_startup_minutes,
            )
            .map_err(ServiceError::from)?;
        spec.resolve(
            "job spec `work`",
            data.history.on_demand(),
            &self.settings.region,
        )
        .map_err(|e| match e {
            crate::job::JobError::Field { key, problem, .. } => {
                ServiceError::invalid(&format!("work.{key}"), problem)
            }
            other => ServiceError::invalid("work", other.to_string()),
        })
    }

    /// The tier an instance of this market was bought in, by purchase.
    pub fn tier_label(tier: Tier) -> &'static str {
        match tier {
            Tier::Reliable => "on-demand",
            Tier::Transient => "spot",
        }
    }

    /// Saves a job's coordinator if it changed, so that a restart resumes the same layout.
    pub async fn save_control(&self, job: JobId) -> Result<(), ServiceError> {
        if let Some(snapshot) = self.control.get(job).and_then(|c| c.snapshot_if_dirty()) {
            let lease = self.fence(job)?;
            self.store
                .save_control_state(Some(&lease), job, &snapshot)
                .await?;
        }
        Ok(())
    }

    /// Looks up the spot series of a market in the current data.
    pub fn has_market(&self, market: &Market) -> bool {
        self.market_data().history.get(market).is_some()
    }
}

/// `GET /metrics`: counters kept in memory plus gauges read from the store — three grouped
/// queries whatever the number of jobs (jobs by state, live instances, spend by job).
pub async fn metrics_text(broker: &Broker) -> Result<String, ServiceError> {
    let counts = broker.store.job_counts_by_state().await?;
    let states = ["pending", "running", "succeeded", "failed", "cancelled"]
        .into_iter()
        .map(|state| {
            let n = counts
                .iter()
                .filter(|(s, _)| s == state)
                .map(|(_, n)| *n)
                .sum();
            (state, n)
        })
        .collect();
    let mut by: std::collections::BTreeMap<(String, String), i64> = Default::default();
    for i in broker.store.live_instances().await? {
        *by.entry((i.tier.to_string(), i.market.to_string()))
            .or_default() += 1;
    }
    let spend = broker
        .store
        .spend_by_job()
        .await?
        .into_iter()
        .map(|(job, usd)| (job.0, usd))
        .collect();
    let gauges = metrics::StoreGauges {
        jobs: states,
        instances: by.into_iter().collect(),
        spend,
    };
    Ok(metrics::exposition(&gauges, &broker.metrics))
}
