//! The user side: submit, list, inspect, cancel jobs and read their cost.

use super::spec::ValidJob;
use super::status_cache::JobRecord;
use super::{Broker, ServiceError, ledger};
use crate::engine::work::{self, WorkingSpan};
use crate::market::{Timestamp, Usd, UsdPerHour};
use crate::store::{Cooldown, CooldownScope, InstanceRow, InstanceState, JobRow, JobState, NewJob};
use proteus_wire::{JobId, Tier};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// What `POST /v1/instances/{id}/interruption` answers: the cloud took the request; the
/// warning follows in the job's events.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct InterruptionSent {
    pub instance_id: String,
    pub cloud_id: String,
    pub job_id: i64,
    /// Market time (RFC 3339).
    pub sent: String,
}

/// A job as `GET /v1/jobs/{id}` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct JobView {
    pub id: i64,
    pub name: String,
    /// What the job runs: `mlr`, `mf`, `mlp` (the built-in apps) or `command` (your program).
    #[schema(value_type = String)]
    pub app: super::spec::App,
    /// `pending`, `running`, `succeeded`, `failed`, `cancelled`.
    pub state: String,
    pub state_reason: Option<String>,
    pub policy: String,
    pub billing: String,
    /// The instance types the job may run on (chosen by its `resources` or listed in its
    /// `work.instance_types`); empty: every type the broker has prices for.
    #[serde(default)]
    pub instance_types: Vec<String>,
    /// The clock every time and duration of this view is read on: `wall` (UTC, on EC2) or
    /// `simulated` (the simulated cloud's market time, which runs faster than the wall's from
    /// a point of its trace).
    #[serde(default)]
    pub clock: ViewClock,
    /// When the job was submitted (RFC 3339, on `clock`).
    pub created: String,
    pub started: Option<String>,
    pub finished: Option<String>,
    /// Seconds the job has run on `clock`: from its start to its end, or to now while it runs;
    /// none before it starts.
    pub duration_s: Option<f64>,
    /// Fraction of training done, 0–1.
    pub progress: f64,
    /// Latest evaluation, e.g. `{"kind": "accuracy", "value": 0.91}`.
    #[schema(value_type = Option<Object>)]
    pub metric: Option<serde_json::Value>,
    /// AgileML stage (1–3) of the current layout; none for command jobs.
    pub stage: Option<u8>,
    /// How the workers synchronise, e.g. `bsp` or `flexrr (slack 1, helper groups of 3)`;
    /// `program` for command jobs (your program synchronises its ranks itself).
    pub sync: String,
    /// What the job has committed: every ended instance as billed, every running one as if it
    /// were released now. Once the job is over and its instances ended, its final cost.
    #[schema(value_type = f64)]
    pub spend_usd: Usd,
    /// Of `spend_usd`, what would be free if the provider interrupted the spot instances now
    /// running (their partial hour under `hourly-2015`; their first hour under today's
    /// `per-second` rule). Why the final cost can come out below the spend shown while the job
    /// ran. Zero once nothing runs.
    #[serde(default)]
    #[schema(value_type = f64)]
    pub spend_provisional_usd: Usd,
    #[schema(value_type = Option<f64>)]
    pub budget_usd: Option<Usd>,
    pub deadline: Option<String>,
    pub evictions: u32,
    /// Live instances per tier that stay: `reliable` (on-demand), `transient` (spot). Warned
    /// instances are not among them: see `leaving_by_tier`.
    pub instances_by_tier: BTreeMap<String, u32>,
    /// Instances per tier that were warned of their end (a spot interruption notice) and still
    /// run until they leave: over the limits for a while, as their replacements start.
    pub leaving_by_tier: BTreeMap<String, u32>,
    pub instances: Vec<InstanceSummary>,
    /// Why launches are being held back, if they are (e.g. the budget).
    pub held: Option<String>,
    /// Markets skipped after the cloud refused them, with the reason.
    pub unavailable_markets: Vec<String>,
    pub work: WorkView,
    /// The id of the broker that runs the job (several brokers may share one database; any of
    /// them answers for every job); none once the job is over and its instances released.
    #[serde(default)]
    pub broker: Option<String>,
}

/// What only a job's owner computes for its view, saved by the owner (JSON in the job's row)
/// for the other brokers on the database.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct OwnerFigures {
    /// AgileML stage of the current layout.
    stage: Option<u8>,
    /// Worker ranks by cloud id.
    ranks: BTreeMap<String, u32>,
    /// Why launches are held back.
    held: Option<String>,
    /// When the job should finish at the capacity it holds (market epoch ms).
    eta_ms: Option<i64>,
    deadline_slack_hours: Option<f64>,
}

/// The clock a view's times are read on.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ViewClock {
    /// Wall time, UTC.
    #[default]
    Wall,
    /// The simulated cloud's market time.
    Simulated,
}

impl ViewClock {
    /// How the CLI and the dashboard name it.
    pub fn describe(self) -> &'static str {
        match self {
            ViewClock::Wall => "wall time (UTC)",
            ViewClock::Simulated => "simulated market time (UTC of the trace)",
        }
    }
}

/// The job's work, measured (see [`crate::engine::work`]).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WorkView {
    /// Units received so far from the instances' working time.
    pub done_units: f64,
    /// The total the job is now expected to need: re-estimated from the measured rate
    /// (done ÷ progress) once it has made progress; `None` while the submitted estimate stands.
    pub expected_units: Option<f64>,
    /// When the job should finish at the capacity it holds now (market time, RFC 3339).
    pub eta: Option<String>,
    /// With a deadline, while the job runs: hours to spare if it ran at full speed (every
    /// instance it may hold) from now on; negative: not even that finishes in time.
    #[serde(default)]
    pub deadline_slack_hours: Option<f64>,
    /// With a deadline, while the job runs: the ETA at the capacity held now is after it.
    #[serde(default)]
    pub deadline_at_risk: Option<bool>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct InstanceSummary {
    pub id: String,
    pub cloud_id: Option<String>,
    pub market: String,
    pub tier: String,
    #[schema(value_type = Option<f64>)]
    pub bid_usd: Option<UsdPerHour>,
    pub state: String,
    pub launched: Option<String>,
    /// When it started working for the job (its agent joined, or start-up passed).
    pub ready: Option<String>,
    pub warned: Option<String>,
    pub ended: Option<String>,
    pub end_reason: Option<String>,
    /// The instance-metadata endpoint of a locally launched agent (simulated cloud, LocalStack).
    pub metadata_url: Option<String>,
    /// Its worker's rank in the job's current layout (none while it holds no worker).
    #[serde(default)]
    pub worker_rank: Option<u32>,
    /// Being stopped gracefully (a release, the job's end): its program is saving, and the
    /// instance ends once its agent has left, or at this time at the latest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_by: Option<String>,
}

/// `GET /v1/jobs/{id}/cost`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CostReport {
    pub job_id: i64,
    pub billing: String,
    #[schema(value_type = f64)]
    pub total_usd: Usd,
    #[schema(value_type = BTreeMap<String, f64>)]
    pub by_tier: BTreeMap<String, Usd>,
    pub by_market: Vec<MarketCost>,
    /// Instance-hours not charged because the provider ended the instance (a partial hour under
    /// `hourly-2015`, a first hour under `per-second`).
    pub free_hours: f64,
    pub evictions: u32,
    /// The work the job received, in units (instance-hours of its reference type): every
    /// instance's working time (after start-up, before a warning or release) × its type's
    /// rate, under AgileML's stage rule. The counterfactuals do this much work.
    pub work_units: f64,
    /// What the submitted estimate says the progress made needs (progress × `total_work`).
    pub estimated_work_units: f64,
    /// Where progress comes from: `measured` (the agents' training clocks) or `modelled` (the
    /// work model on market time, as in the demo, where estimate and measurement agree by
    /// construction up to the work evictions lose).
    pub pacing: String,
    /// Set when the measured work and the estimate differ by more than 20%.
    pub work_note: Option<String>,
    /// The same work under the baselines, on the same prices (on an availability market, the
    /// same capacity, against the job's deadline).
    pub counterfactuals: Vec<ledger::Counterfactual>,
    /// `1 - total / counterfactual` for each baseline with a cost.
    pub savings: BTreeMap<String, f64>,
    pub lines: Vec<LedgerLineView>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct MarketCost {
    pub market: String,
    pub tier: String,
    #[schema(value_type = f64)]
    pub usd: Usd,
    pub instance_hours: f64,
    pub instances: u32,
}

/// What a stored job runs, as its view shows it: the app, and the sync model (`program` for a
/// command job, whose program synchronises its ranks itself).
#[derive(Debug, Clone, PartialEq)]
pub struct JobKind {
    pub app: super::spec::App,
    pub sync: String,
    /// The spec's `work.instance_types` (what `resources` chose is stored there); empty: every
    /// type the broker has prices for.
    pub instance_types: Vec<String>,
}

/// A stored job's [`JobKind`] (its spec was validated at submission). It parses the spec:
/// callers on the status path read it once per [`JobRecord`], not per request.
///
/// [`JobRecord`]: super::status_cache::JobRecord
pub(super) fn kind_of(job: &JobRow) -> JobKind {
    use super::spec::{App, JobSpec};
    let spec = serde_json::from_str::<JobSpec>(&job.spec).ok();
    let app = spec.as_ref().map_or(App::Mlr, |s| s.app);
    let instance_types = spec
        .as_ref()
        .and_then(|s| s.work.as_ref())
        .and_then(|w| w.instance_types.clone())
        .unwrap_or_default();
    let sync = match app {
        App::Command => "program".to_string(),
        _ => spec
            .and_then(|s| s.training)
            .and_then(|t| t.sync_model().ok().flatten())
            .unwrap_or_default()
            .to_string(),
    };
    JobKind {
        app,
        sync,
        instance_types,
    }
}

/// One billed segment of an instance, as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LedgerLineView {
    pub instance_id: String,
    /// RFC 3339, market time.
    pub start: String,
    /// RFC 3339, market time.
    pub end: String,
    #[schema(value_type = f64)]
    pub usd_per_hour: UsdPerHour,
    #[schema(value_type = f64)]
    pub amount_usd: Usd,
    /// Waived: a provider-ended partial hour under `hourly-2015`, or a spot instance the
    /// provider interrupted within its first hour under `per-second`.
    pub free: bool,
}

impl From<&crate::store::LedgerLine> for LedgerLineView {
    fn from(l: &crate::store::LedgerLine) -> Self {
        LedgerLineView {
            instance_id: l.instance_id.clone(),
            start: l.start.to_string(),
            end: l.end.to_string(),
            usd_per_hour: l.usd_per_hour,
            amount_usd: l.amount_usd,
            free: l.free,
        }
    }
}

/// A deadline that no schedule can meet is refused at submission, with the arithmetic: the
/// work the spec states, at the job's fastest (every instance it may hold, of its fastest type,
/// on-demand from now, after one start-up; no faster than `max_capacity`), ends after it. A
/// job that states no work (`work.total_work`) cannot be checked and is not.
pub(crate) fn deadline_is_reachable(
    spec: &super::spec::JobSpec,
    valid: &ValidJob,
    job: &crate::job::JobModel,
    now: Timestamp,
) -> Result<(), ServiceError> {
    let (Some(deadline), Some(work)) = (valid.deadline, valid.work.total_work) else {
        return Ok(());
    };
    let each = job.max_rate();
    let all = f64::from(job.max_instances) * each;
    let fastest = job.max_capacity.map_or(all, |cap| all.min(cap));
    let left_h = deadline.secs_since(now) / 3600.0;
    let startup_min = job.startup_secs / 60.0;
    let need_h = work / fastest.max(1e-9) + startup_min / 60.0;
    // What to ask for, rounded up so that asking for it is accepted.
    let allow_h = (need_h * 100.0 - 1e-6).ceil() / 100.0;
    if need_h <= left_h {
        return Ok(());
    }
    let speed = if fastest < all {
        format!("{fastest} units/h (`limits.max_capacity`)")
    } else {
        format!(
            "{fastest} units/h ({} instances at {each} units/h, the job's fastest type)",
            job.max_instances
        )
    };
    let field = if spec.limits.deadline_hours.is_some() {
        "limits.deadline_hours"
    } else {
        "limits.deadline"
    };
    Err(ServiceError::Unmet {
        field: field.into(),
        message: format!(
            "cannot be met even on on-demand: {work} units of work at {speed} take {:.2} h, \
             plus {startup_min:.0} min of start-up, {need_h:.2} h in all, but the deadline \
             ({deadline}) is {left_h:.2} h away. Allow at least {allow_h:.2} h, raise \
             `limits.max_instances`, or lower `work.total_work`",
            work / fastest.max(1e-9)
        ),
    })
}

fn ts(t: Option<Timestamp>) -> Option<String> {
    t.map(|t| t.to_string())
}

/// A live instance that was warned of its end and will leave.
fn is_leaving(i: &InstanceRow) -> bool {
    i.state == InstanceState::Warned || i.warned.is_some()
}

fn is_live(i: &InstanceRow) -> bool {
    matches!(
        i.state,
        InstanceState::Requested | InstanceState::Running | InstanceState::Warned
    )
}

impl Broker {
    /// Validates and stores a job; the scheduler starts it on its next tick.
    pub async fn submit(&self, mut spec: super::spec::JobSpec) -> Result<JobView, ServiceError> {
        let now = self.clock.now();
        let (valid, default_budget) = self.validate_submission(&mut spec, now)?;
        // Resolve now, so that an unknown policy or instance type is the submitter's error.
        let runtime = self.build_runtime(valid.clone(), self.clock.now(), None)?;
        deadline_is_reachable(&spec, &valid, runtime.engine.job(), now)?;
        // The types `resources` chose are stored with the job: a restarted broker runs it on
        // the same ones, and they are shown with it.
        let chosen: Option<Vec<String>> = spec.resources.as_ref().map(|_| {
            runtime
                .engine
                .job()
                .rates()
                .map(|(t, _)| t.to_string())
                .collect()
        });
        if let Some(types) = &chosen {
            spec.work
                .get_or_insert_with(Default::default)
                .instance_types = Some(types.clone());
        }
        let spec_json =
            serde_json::to_string(&spec).map_err(|e| ServiceError::Internal(e.to_string()))?;
        let id = self
            .store
            .create_job(&NewJob {
                name: valid.name.clone(),
                spec: spec_json,
                policy: valid.policy.clone(),
                billing: valid.billing.to_string(),
                budget_usd: valid.budget_usd,
                deadline: valid.deadline,
                created: now,
                // Another broker's claim leaves it to this one's grant below, unless this
                // one dies first.
                grant_window_ms: self.membership.lease_ms(),
            })
            .await?;
        let mut detail = match (valid.budget_usd, default_budget) {
            (Some(b), true) => format!(
                "policy {}, up to {} instances, budget {b} (the broker's default: \
                 `proteus serve --default-budget-usd`)",
                valid.policy, valid.max_instances
            ),
            _ => format!(
                "policy {}, up to {} instances",
                valid.policy, valid.max_instances
            ),
        };
        if let (Some(types), Some(r)) = (&chosen, &valid.resources) {
            detail.push_str(&format!(
                ", on {} (resources {})",
                types.join(", "),
                r.describe()
            ));
        }
        self.store
            .add_event(None, Some(id), None, now, "job_submitted", &detail)
            .await?;
        drop(runtime);
        // The job goes to the broker with the fewest; this one builds its runtime only if
        // that is itself (another broker picks it up with its next heartbeat).
        if self.grant_new_job(id).await?.is_some() {
            let job = self.job_row(id).await?;
            self.ensure_runtime(&job)?;
        }
        self.nudge.notify_one();
        self.job_view(id).await
    }

    /// What [`Broker::submit`] checks before it stores anything: the spec (with the broker's
    /// default budget applied, which the returned flag says), the broker-wide cap, the work
    /// directory. `spec` gains the default budget.
    pub(crate) fn validate_submission(
        &self,
        spec: &mut super::spec::JobSpec,
        now: Timestamp,
    ) -> Result<(ValidJob, bool), ServiceError> {
        // The broker's default budget goes into the stored spec, so that a restarted broker
        // (which validates the stored spec again) keeps it.
        let default_budget =
            spec.limits.budget_usd.is_none() && self.settings.default_budget.is_some();
        if default_budget {
            spec.limits.budget_usd = self.settings.default_budget.map(|b| b.get());
        }
        let valid = spec
            .validate(self.settings.default_billing, now)
            .map_err(ServiceError::from)?;
        let cap = self.settings.instance_cap;
        if valid.max_instances > cap {
            return Err(ServiceError::unmet(
                "limits.max_instances",
                format!(
                    "{} is above this broker's cap of {cap} instances across all jobs \
                     (`proteus serve --instance-cap`, PROTEUS_INSTANCE_CAP)",
                    valid.max_instances
                ),
            ));
        }
        self.check_workdir_signable(&valid.training.app)?;
        Ok((valid, default_budget))
    }

    async fn job_row(&self, id: JobId) -> Result<JobRow, ServiceError> {
        self.store.job(id).await?.ok_or(ServiceError::NoSuchJob(id))
    }

    pub async fn job_view(&self, id: JobId) -> Result<JobView, ServiceError> {
        let cache = &self.status_cache;
        let record = match cache.get(id) {
            Some(r) => r,
            None => {
                let lock = cache.read_lock(id);
                let _reading = lock.lock().await;
                match cache.get(id) {
                    Some(r) => r,
                    None => {
                        let started = std::time::Instant::now();
                        let cooldowns = cache.cooldowns(&self.store, self.clock.now()).await?;
                        let record = JobRecord::read(&self.store, id, cooldowns)
                            .await?
                            .ok_or(ServiceError::NoSuchJob(id))?;
                        let record = std::sync::Arc::new(record);
                        cache.put(id, started, record.clone());
                        record
                    }
                }
            }
        };
        let provisional = *record.provisional_usd.get_or_init(|| {
            self.provisional_spend(
                &record.job,
                &record.instances,
                record.spend_usd,
                self.clock.now(),
            )
        });
        Ok(self.view_of(
            &record.job,
            &record.instances,
            (record.spend_usd, provisional),
            &record.cooldowns,
            &record.kind,
        ))
    }

    fn view_of(
        &self,
        job: &JobRow,
        instances: &[InstanceRow],
        (spend, provisional): (Usd, Usd),
        cooldowns: &[Cooldown],
        kind: &JobKind,
    ) -> JobView {
        let mut by_tier =
            BTreeMap::from([("reliable".to_string(), 0), ("transient".to_string(), 0)]);
        let mut leaving = by_tier.clone();
        for i in instances.iter().filter(|i| is_live(i)) {
            let count = match is_leaving(i) {
                true => &mut leaving,
                false => &mut by_tier,
            };
            *count.entry(i.tier.to_string()).or_insert(0) += 1;
        }
        let now = self.clock.now();
        let OwnerFigures {
            stage,
            ranks,
            held,
            eta_ms,
            deadline_slack_hours,
        } = self.figures_of(job, instances, now);
        let running = !job.state.is_over();
        let eta = eta_ms.map(Timestamp::from_millis).filter(|_| running);
        let work = WorkView {
            done_units: job.work.done_units,
            expected_units: job.work.expected_units,
            eta: eta.map(|e| e.to_string()),
            deadline_slack_hours: deadline_slack_hours.filter(|_| running),
            deadline_at_risk: match (job.deadline, running) {
                (Some(d), true) => Some(eta.is_none_or(|e| e > d)),
                _ => None,
            },
        };
        let unavailable = cooldowns
            .iter()
            .filter(|c| c.until > now)
            .map(|c| {
                let scope = match c.scope {
                    CooldownScope::SpotOffer => " (spot)",
                    CooldownScope::WholeMarket => "",
                };
                format!(
                    "{}/{}: {}{scope} until {}",
                    c.zone, c.instance_type, c.reason, c.until
                )
            })
            .collect();
        let command = kind.app == super::spec::App::Command;
        JobView {
            id: job.id.0,
            name: job.name.clone(),
            app: kind.app,
            state: job.state.to_string(),
            state_reason: job.state_reason.clone(),
            policy: job.policy.clone(),
            billing: job.billing.clone(),
            instance_types: kind.instance_types.clone(),
            clock: self.view_clock(),
            created: job.created.to_string(),
            started: ts(job.started),
            finished: ts(job.finished),
            duration_s: job
                .started
                .map(|s| job.finished.unwrap_or(now).secs_since(s).max(0.0)),
            progress: job.progress,
            metric: job
                .metric
                .as_deref()
                .and_then(|m| serde_json::from_str(m).ok()),
            stage: stage.filter(|_| !command),
            sync: kind.sync.clone(),
            spend_usd: spend,
            spend_provisional_usd: provisional,
            budget_usd: job.budget_usd,
            deadline: ts(job.deadline),
            evictions: instances.iter().filter(|i| i.ended_by_provider).count() as u32,
            instances_by_tier: by_tier,
            leaving_by_tier: leaving,
            instances: instances
                .iter()
                .map(|i| {
                    let rank = i.cloud_id.as_ref().and_then(|c| ranks.get(c).copied());
                    summary(i, rank)
                })
                .collect(),
            held,
            unavailable_markets: unavailable,
            work,
            broker: job.lease_owner.clone(),
        }
    }

    /// What the live spot instances' bills lose if the provider ends them now rather than the
    /// user (the ledger bills a live instance as released by the user now); never more than
    /// `spend` (the ledger was billed at the owner's last tick, this at `now`).
    fn provisional_spend(
        &self,
        job: &JobRow,
        instances: &[InstanceRow],
        spend: Usd,
        now: Timestamp,
    ) -> Usd {
        let mut live = instances
            .iter()
            .filter(|i| i.tier == Tier::Transient && is_live(i) && i.launched.is_some())
            .peekable();
        if live.peek().is_none() {
            return Usd::ZERO;
        }
        let billing = job.billing.parse().unwrap_or(self.settings.default_billing);
        let data = self.market_data();
        let amount = |row: &InstanceRow| -> Usd {
            ledger::bill_instance(row, now, billing, &data)
                .map(|lines| lines.iter().map(|l| l.amount_usd).sum())
                .unwrap_or(Usd::ZERO)
        };
        let saved: f64 = live
            .map(|i| {
                let evicted = InstanceRow {
                    ended: Some(now),
                    ended_by_provider: true,
                    ..i.clone()
                };
                (amount(i).get() - amount(&evicted).get()).max(0.0)
            })
            .sum();
        Usd::new(saved.min(spend.get())).unwrap_or(Usd::ZERO)
    }

    /// The clock this broker's views are read on.
    pub fn view_clock(&self) -> ViewClock {
        match self.cloud.kind() {
            "sim" => ViewClock::Simulated,
            _ => ViewClock::Wall,
        }
    }

    /// The figures only a job's owner computes (its engine and its agents' coordinator live in
    /// the owner's memory): computed here when this broker runs the job, else as the owner last
    /// saved them while the job runs ([`Broker::publish_figures`]), else none.
    fn figures_of(&self, job: &JobRow, instances: &[InstanceRow], now: Timestamp) -> OwnerFigures {
        self.local_figures(job, instances, now)
            .or_else(|| {
                // The owner stops saving them once the job is over.
                job.owner_figures
                    .as_deref()
                    .filter(|_| !job.state.is_over())
                    .and_then(|t| serde_json::from_str(t).ok())
            })
            .unwrap_or_default()
    }

    /// The owner's figures, if this broker runs the job.
    fn local_figures(
        &self,
        job: &JobRow,
        instances: &[InstanceRow],
        now: Timestamp,
    ) -> Option<OwnerFigures> {
        let control = self.control.get(job.id);
        let runtime = self.runtime(job.id);
        if control.is_none() && runtime.is_none() {
            return None;
        }
        let (stage, ranks) = control
            .and_then(|c| {
                c.read(|c| {
                    c.view().map(|v| {
                        let ranks: BTreeMap<String, u32> = v
                            .workers
                            .iter()
                            .map(|w| (w.instance_id.0.clone(), w.rank))
                            .collect();
                        (Some(v.stage.number()), ranks)
                    })
                })
            })
            .unwrap_or_default();
        let running = !job.state.is_over();
        let (held, eta, slack) = runtime
            .map(|r| {
                let rt = r.lock().unwrap_or_else(|e| e.into_inner());
                let spans: Vec<WorkingSpan> = instances
                    .iter()
                    .filter_map(|i| WorkingSpan::of_instance(i, rt.engine.job()))
                    .collect();
                let rate = work::rate_at(&spans, Some(&rt.engine.job().stages), now);
                let total = job.work.expected_units.unwrap_or(rt.engine.total_work());
                let remaining = (total - job.work.done_units).max(0.0);
                let eta = (rate > 0.0 && running).then(|| now.plus_secs(remaining / rate * 3600.0));
                let full = rt.engine.job().full_speed();
                let slack = match (job.deadline, full > 0.0 && running) {
                    (Some(d), true) => Some(d.secs_since(now) / 3600.0 - remaining / full),
                    _ => None,
                };
                (rt.engine.held().map(str::to_string), eta, slack)
            })
            .unwrap_or_default();
        // To the minute and the hundredth of an hour, as every broker shows them.
        Some(OwnerFigures {
            stage,
            ranks,
            held,
            eta_ms: eta.map(|e| (e.millis() + 30_000).div_euclid(60_000) * 60_000),
            deadline_slack_hours: slack.map(|h| (h * 100.0).round() / 100.0),
        })
    }

    /// Saves the owner's figures of a job it runs, when they changed since the row it read (a
    /// tick that moves the ETA by less than a minute writes nothing), so that every broker on
    /// the database shows them.
    pub(super) async fn publish_figures(
        &self,
        job: &JobRow,
        instances: &[InstanceRow],
        now: Timestamp,
    ) -> Result<(), ServiceError> {
        let Some(figures) = self.local_figures(job, instances, now) else {
            return Ok(());
        };
        let text = serde_json::to_string(&figures).unwrap_or_default();
        if job.owner_figures.as_deref() == Some(text.as_str()) {
            return Ok(());
        }
        self.store
            .save_owner_figures(Some(&self.fence(job.id)?), job.id, &text)
            .await?;
        Ok(())
    }

    pub async fn job_views(&self) -> Result<Vec<JobView>, ServiceError> {
        let mut out = Vec::new();
        let cooldowns = self.store.cooldowns(self.clock.now()).await?;
        for job in self.store.jobs(false).await? {
            let instances = self.store.instances_of_job(job.id).await?;
            let spend = self.store.spend_of_job(job.id).await?;
            let kind = kind_of(&job);
            let provisional = self.provisional_spend(&job, &instances, spend, self.clock.now());
            out.push(self.view_of(&job, &instances, (spend, provisional), &cooldowns, &kind));
        }
        Ok(out)
    }

    /// Cancels a job: every instance is released and the ledger closed.
    pub async fn cancel(&self, id: JobId) -> Result<JobView, ServiceError> {
        let job = self.job_row(id).await?;
        if job.state.is_over() {
            return Err(ServiceError::JobOver(id));
        }
        let now = self.clock.now();
        let reason = "cancelled by the user";
        let finished = match self.membership().lease(id) {
            Some(_) => self.finish_job(id, JobState::Cancelled, reason, now).await,
            // Another broker's job: the cancel is recorded, and its owner releases the
            // instances at its next tick.
            None => self
                .record_end(None, id, JobState::Cancelled, reason, now)
                .await
                .map(|_| ()),
        };
        self.status_cache.invalidate();
        // Once the end is recorded, the lease can go while this call still stops the job: the
        // scheduler, seeing the job over, winds it down at its tick and gives the lease up once
        // every instance has ended (or another broker took the job over). Whoever owns the job
        // stops what is left; the cancel took, and the user is told so, not "ask another broker".
        let finished = match finished {
            Err(ServiceError::NotOwner { .. })
            | Err(ServiceError::Store(crate::store::StoreError::Fenced { .. }))
                if self.job_row(id).await?.state == JobState::Cancelled =>
            {
                tracing::debug!(job = %id, "cancel recorded; the job was wound down meanwhile");
                Ok(())
            }
            other => other,
        };
        finished?;
        self.nudge.notify_one();
        self.job_view(id).await
    }

    /// Has the cloud interrupt one of a job's spot instances now, as a price spike would: the
    /// warning reaches the scheduler and, through the instance's metadata, its agent, which
    /// hands over before the reclaim. For trying a job's eviction handling on purpose (on the
    /// simulated cloud; on AWS, Fault Injection Service does this).
    pub async fn interrupt_instance(&self, id: &str) -> Result<InterruptionSent, ServiceError> {
        let inst = self
            .store
            .instance(id)
            .await?
            .ok_or_else(|| ServiceError::NoSuchInstance(id.to_string()))?;
        if inst.tier != Tier::Transient {
            return Err(ServiceError::Refused(format!(
                "instance {id} is on the reliable (on-demand) tier; only spot instances are interrupted"
            )));
        }
        let cloud_id = match (&inst.cloud_id, inst.state) {
            (Some(c), InstanceState::Running) => c.clone(),
            (_, state) => {
                return Err(ServiceError::Refused(format!(
                    "instance {id} is {state}; only a running instance can be interrupted"
                )));
            }
        };
        self.cloud
            .send_interruption(&cloud_id)
            .await
            .map_err(|e| ServiceError::Refused(e.to_string()))?;
        tracing::info!(instance = id, cloud_id, "interruption sent on request");
        // The scheduler picks the warning up from the cloud's events at once, not at its tick.
        self.nudge.notify_one();
        Ok(InterruptionSent {
            instance_id: inst.id,
            cloud_id,
            job_id: inst.job_id.0,
            sent: self.clock.now().to_string(),
        })
    }

    pub async fn cost_report(&self, id: JobId) -> Result<CostReport, ServiceError> {
        let job = self.job_row(id).await?;
        let instances = self.store.instances_of_job(id).await?;
        let lines = self.store.ledger_of_job(id).await?;
        let mut by_tier = BTreeMap::from([
            ("reliable".to_string(), Usd::ZERO),
            ("transient".to_string(), Usd::ZERO),
        ]);
        let mut by_market: BTreeMap<(String, String), MarketCost> = BTreeMap::new();
        let mut free_hours = 0.0;
        for line in &lines {
            let Some(inst) = instances.iter().find(|i| i.id == line.instance_id) else {
                continue;
            };
            *by_tier.entry(inst.tier.to_string()).or_insert(Usd::ZERO) += line.amount_usd;
            let hours = line.end.secs_since(line.start) / 3600.0;
            if line.free {
                free_hours += hours;
            }
            let key = (inst.market.to_string(), inst.tier.to_string());
            let entry = by_market.entry(key.clone()).or_insert_with(|| MarketCost {
                market: key.0.clone(),
                tier: key.1.clone(),
                usd: Usd::ZERO,
                instance_hours: 0.0,
                instances: 0,
            });
            entry.usd += line.amount_usd;
            entry.instance_hours += hours;
        }
        for inst in instances.iter().filter(|i| i.launched.is_some()) {
            if let Some(e) = by_market.get_mut(&(inst.market.to_string(), inst.tier.to_string())) {
                e.instances += 1;
            }
        }
        let total: Usd = lines.iter().map(|l| l.amount_usd).sum();
        let billing = job.billing.parse().unwrap_or(self.settings.default_billing);
        let until = job.finished.unwrap_or_else(|| self.clock.now());
        let pacing = match self.settings.pacing {
            crate::service::Pacing::Measured => "measured",
            crate::service::Pacing::Modelled => "modelled",
        };
        let (counterfactuals, work_units, estimated_work_units) = match self.work_model_of(&job) {
            Some(model) => {
                let units = work::received(&instances, &model, until);
                let estimated = job.progress * model.total_work;
                let start = job.started.unwrap_or(job.created);
                let data = self.market_data();
                let replay = ledger::Replay {
                    deadline: job.deadline,
                    availability: self.settings.availability.clone(),
                };
                // The counterfactuals run the simulator: keep it off the async workers.
                let cf = tokio::task::spawn_blocking(move || {
                    ledger::counterfactuals(&data, &model, units, billing, start, &replay)
                })
                .await
                .unwrap_or_default();
                (cf, units, estimated)
            }
            None => (Vec::new(), 0.0, 0.0),
        };
        let work_note = work_disagreement(work_units, estimated_work_units);
        let savings = counterfactuals
            .iter()
            .filter_map(|c| {
                c.cost_usd
                    .filter(|c| *c > Usd::ZERO)
                    .map(|cost| (c.policy.clone(), 1.0 - total / cost))
            })
            .collect();
        Ok(CostReport {
            job_id: id.0,
            billing: job.billing.clone(),
            total_usd: total,
            by_tier,
            by_market: by_market.into_values().collect(),
            free_hours,
            evictions: instances.iter().filter(|i| i.ended_by_provider).count() as u32,
            work_units,
            estimated_work_units,
            pacing: pacing.to_string(),
            work_note,
            counterfactuals,
            savings,
            lines: lines.iter().map(LedgerLineView::from).collect(),
        })
    }

    /// The job's work model as submitted (its `total_work` is the submitted estimate, not a
    /// re-estimate).
    fn work_model_of(&self, job: &JobRow) -> Option<crate::job::JobModel> {
        if let Some(r) = self.runtime(job.id) {
            let rt = r.lock().unwrap_or_else(|e| e.into_inner());
            let mut model = rt.engine.job().clone();
            model.total_work = rt.engine.submitted_work();
            return Some(model);
        }
        let spec: super::spec::JobSpec = serde_json::from_str(&job.spec).ok()?;
        let valid = spec
            .validate(self.settings.default_billing, job.created)
            .ok()?;
        self.build_runtime(valid, job.created, None)
            .ok()
            .map(|r| r.engine.job().clone())
    }
}

/// Says so when the measured work and what the estimate expected for the progress made differ
/// by more than 20% (of the estimate).
fn work_disagreement(measured: f64, estimated: f64) -> Option<String> {
    if estimated <= 0.0 || (measured - estimated).abs() <= 0.2 * estimated {
        return None;
    }
    Some(format!(
        "the job received {measured:.3} units of work where its estimate expected {estimated:.3} \
         ({:+.0}%): the counterfactuals are priced on the measured work",
        (measured / estimated - 1.0) * 100.0
    ))
}

fn summary(i: &InstanceRow, worker_rank: Option<u32>) -> InstanceSummary {
    InstanceSummary {
        id: i.id.clone(),
        cloud_id: i.cloud_id.clone(),
        market: i.market.to_string(),
        tier: match i.tier {
            Tier::Reliable => "reliable",
            Tier::Transient => "transient",
        }
        .to_string(),
        bid_usd: i.bid,
        state: i.state.to_string(),
        launched: ts(i.launched),
        ready: ts(i.ready),
        warned: ts(i.warned),
        ended: ts(i.ended),
        end_reason: i.end_reason.clone(),
        metadata_url: i.metadata_addr.as_ref().map(|a| format!("http://{a}")),
        worker_rank,
        stop_by: ts(i.stop_by),
    }
}
