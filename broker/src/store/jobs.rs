//! Jobs, instances, agents, events, ledger lines and market cool-downs: the live broker's state.
//!
//! The store is the broker's memory across crashes: an instance row is written before the cloud
//! is asked for it, and every state change is written before it is acted on, so a restarted
//! broker can rebuild its view from here and the cloud's tags.

use super::leases::{instances_fence, jobs_fence, token_of};
use super::{Context, Lease, Store, StoreError, with_db};
use crate::market::{InstanceType, Market, Product, Timestamp, Usd, UsdPerHour, Zone};
use proteus_wire::{JobId, Tier};
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

macro_rules! string_enum {
    ($(#[$doc:meta])* $name:ident { $($variant:ident => $text:literal),* $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($variant),* }

        impl $name {
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),* }
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(self.as_str()) }
        }
        impl FromStr for $name {
            type Err = StoreError;
            fn from_str(s: &str) -> Result<Self, StoreError> {
                match s {
                    $($text => Ok($name::$variant),)*
                    other => Err(StoreError::Invalid(format!(concat!("unknown ", stringify!($name), " `{}`"), other))),
                }
            }
        }
    };
}

string_enum!(
    /// Where a job is in its life.
    JobState {
        Pending => "pending",
        Running => "running",
        Succeeded => "succeeded",
        Failed => "failed",
        Cancelled => "cancelled",
    }
);

impl JobState {
    pub fn is_over(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled
        )
    }
}

string_enum!(
    /// Where an instance is in its life. `Requested` is the durable intent written before the
    /// cloud call; only `Terminated` and `Failed` are final.
    InstanceState {
        Requested => "requested",
        Running => "running",
        Warned => "warned",
        Terminating => "terminating",
        Terminated => "terminated",
        Failed => "failed",
    }
);

impl InstanceState {
    pub fn is_final(self) -> bool {
        matches!(self, InstanceState::Terminated | InstanceState::Failed)
    }
}

/// A job as stored.
#[derive(Debug, Clone, Serialize)]
pub struct JobRow {
    pub id: JobId,
    pub name: String,
    pub spec: String,
    pub policy: String,
    pub billing: String,
    pub state: JobState,
    pub state_reason: Option<String>,
    pub budget_usd: Option<Usd>,
    pub deadline: Option<Timestamp>,
    pub progress: f64,
    pub metric: Option<String>,
    pub control_state: Option<String>,
    /// The job's engine state (JSON), as the scheduler last saved it.
    pub engine_state: Option<String>,
    pub created: Timestamp,
    pub started: Option<Timestamp>,
    pub finished: Option<Timestamp>,
    /// The work the job has received, as the scheduler last counted it.
    pub work: WorkRecord,
    /// The broker whose lease the job is under (see [`Lease`]), if any.
    pub lease_owner: Option<String>,
    /// What only the owner computes, as it last saved it (JSON), for the other brokers' views.
    pub owner_figures: Option<String>,
}

/// A job's work as the scheduler last counted it (see [`crate::engine::work`]).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct WorkRecord {
    /// Units received from the instances' working time.
    pub done_units: f64,
    /// The total the job needs, re-estimated from its measured rate once it made progress;
    /// `None` while the submitted estimate stands.
    pub expected_units: Option<f64>,
}

/// A new job to store.
#[derive(Debug, Clone)]
pub struct NewJob {
    pub name: String,
    pub spec: String,
    pub policy: String,
    pub billing: String,
    pub budget_usd: Option<Usd>,
    pub deadline: Option<Timestamp>,
    pub created: Timestamp,
    /// For this long from its insert (on the database's clock) the job is its submitter's to
    /// give its first owner: no other broker's claim takes it before (0: claimable at once). A
    /// submitter that dies between storing the job and granting it leaves it to the others
    /// after that.
    pub grant_window_ms: i64,
}

/// An instance as stored.
#[derive(Debug, Clone, Serialize)]
pub struct InstanceRow {
    /// The broker's own id: the cloud tag and idempotency token that ties a cloud instance back
    /// to the decision that bought it.
    pub id: String,
    pub job_id: JobId,
    pub cloud_id: Option<String>,
    pub market: Market,
    pub tier: Tier,
    pub bid: Option<UsdPerHour>,
    pub state: InstanceState,
    #[serde(skip)]
    pub token_hash: String,
    pub requested: Timestamp,
    pub launched: Option<Timestamp>,
    /// When it started working for the job: its agent joined (measured pacing), or start-up
    /// after launch passed (modelled pacing).
    pub ready: Option<Timestamp>,
    pub warned: Option<Timestamp>,
    pub ended: Option<Timestamp>,
    pub end_reason: Option<String>,
    pub ended_by_provider: bool,
    pub launch_error: Option<String>,
    /// The instance-metadata endpoint of a locally launched agent.
    pub metadata_addr: Option<String>,
    /// The process id of a locally launched agent.
    pub agent_pid: Option<u32>,
    /// A graceful stop: its agent was told to stop, and the instance is ended once the agent
    /// has left, or at this time at the latest.
    pub stop_by: Option<Timestamp>,
    /// The bootstrap token the launch's user data carries, kept while the launch is unanswered
    /// (cleared once it is recorded): every retry, and a relaunch by the broker that took the
    /// job over, sends the same ClientToken with the same parameters.
    #[serde(skip)]
    pub launch_token: Option<String>,
    /// The hash of that bootstrap token: good for the instance's downloads and for one
    /// exchange for its agent token (`Broker::agent_bootstrap`). None for an instance launched
    /// before bootstrap tokens (its user data carried the agent token itself).
    #[serde(skip)]
    pub bootstrap_hash: Option<String>,
    /// When the bootstrap token was exchanged; from then on it is dead (the job's events say
    /// so too: `agent_bootstrapped`).
    #[serde(skip)]
    pub bootstrap_used: Option<Timestamp>,
}

impl InstanceRow {
    /// A launch intent: what is stored before the cloud is asked for the instance, so that a
    /// crash between the two leaves a record to reconcile against the cloud's tags.
    pub fn intent(
        id: String,
        job_id: JobId,
        market: Market,
        purchase: crate::policy::Purchase,
        token_hash: String,
        now: Timestamp,
    ) -> InstanceRow {
        InstanceRow {
            id,
            job_id,
            cloud_id: None,
            market,
            tier: purchase.tier(),
            bid: purchase.bid(),
            state: InstanceState::Requested,
            token_hash,
            requested: now,
            launched: None,
            ready: None,
            warned: None,
            ended: None,
            end_reason: None,
            ended_by_provider: false,
            launch_error: None,
            metadata_addr: None,
            agent_pid: None,
            stop_by: None,
            launch_token: None,
            bootstrap_hash: None,
            bootstrap_used: None,
        }
    }

    /// The intent, carrying the bootstrap token its launch's user data will carry (see
    /// [`InstanceRow::launch_token`]) and that token's hash.
    pub fn carrying(mut self, bootstrap_token: String, bootstrap_hash: String) -> InstanceRow {
        self.launch_token = Some(bootstrap_token);
        self.bootstrap_hash = Some(bootstrap_hash);
        self
    }
}

/// One event in a job's history.
#[derive(Debug, Clone, Serialize)]
pub struct EventRow {
    pub id: i64,
    pub job_id: Option<JobId>,
    pub instance_id: Option<String>,
    pub time: Timestamp,
    pub kind: String,
    pub detail: String,
}

/// An event recorded together with a change of an instance's state (its instance and time
/// are the change's).
#[derive(Debug, Clone, Copy)]
pub struct EventRecord<'a> {
    pub job: Option<JobId>,
    pub kind: &'a str,
    pub detail: &'a str,
}

/// Inserts one event through `$exec` (a pool, or `&mut *tx` for an open transaction).
macro_rules! insert_event {
    ($exec:expr, $job:expr, $instance:expr, $at:expr, $kind:expr, $detail:expr) => {
        sqlx::query(
            "INSERT INTO events (job_id, instance_id, ts_ms, kind, detail) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind($job.map(|j: JobId| j.0))
        .bind($instance)
        .bind($at.millis())
        .bind($kind)
        .bind($detail)
        .execute($exec)
        .await
        .context("recording an event")
    };
}

/// One billed segment of an instance.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct LedgerLine {
    pub instance_id: String,
    pub start: Timestamp,
    pub end: Timestamp,
    pub usd_per_hour: UsdPerHour,
    pub amount_usd: Usd,
    pub free: bool,
}

/// A market the cloud refused recently.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cooldown {
    pub zone: Zone,
    pub instance_type: InstanceType,
    pub until: Timestamp,
    pub reason: String,
    pub scope: CooldownScope,
}

/// What a cool-down covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CooldownScope {
    /// A spot launch was refused: the market's spot offer is skipped; on-demand capacity is
    /// separate and stays offered.
    SpotOffer,
    /// An on-demand launch was refused: the market is skipped altogether.
    WholeMarket,
}

#[derive(sqlx::FromRow)]
struct JobRecord {
    id: i64,
    name: String,
    spec: String,
    policy: String,
    billing: String,
    state: String,
    state_reason: Option<String>,
    budget_usd: Option<f64>,
    deadline_ms: Option<i64>,
    progress: f64,
    metric: Option<String>,
    control_state: Option<String>,
    engine_state: Option<String>,
    created_ms: i64,
    started_ms: Option<i64>,
    finished_ms: Option<i64>,
    work_done_units: f64,
    expected_work_units: Option<f64>,
    lease_owner: Option<String>,
    owner_figures: Option<String>,
}

/// The saved states a job's row holds.
#[derive(Clone, Copy)]
enum SavedState {
    Control,
    Engine,
    OwnerFigures,
}

/// A job's row joined with one of its instances (none: every instance column is null) and its
/// spend: what [`Store::job_status`] reads, one row per instance.
#[derive(sqlx::FromRow)]
struct JobStatusRecord {
    #[sqlx(flatten)]
    job: JobRecord,
    spend_usd: Option<f64>,
    i_id: Option<String>,
    i_job_id: Option<i64>,
    i_cloud_id: Option<String>,
    i_availability_zone: Option<String>,
    i_instance_type: Option<String>,
    i_product: Option<String>,
    i_tier: Option<String>,
    i_bid_usd: Option<f64>,
    i_state: Option<String>,
    i_token_hash: Option<String>,
    i_requested_ms: Option<i64>,
    i_launched_ms: Option<i64>,
    i_ready_ms: Option<i64>,
    i_warned_ms: Option<i64>,
    i_ended_ms: Option<i64>,
    i_end_reason: Option<String>,
    i_ended_by_provider: Option<i64>,
    i_launch_error: Option<String>,
    i_metadata_addr: Option<String>,
    i_agent_pid: Option<i64>,
    i_stop_by_ms: Option<i64>,
}

impl JobStatusRecord {
    /// The joined instance, if the row has one.
    fn instance(&mut self) -> Option<InstanceRecord> {
        let missing = |what: &str| format!("instance column {what} is null");
        let id = self.i_id.take()?;
        let out = (|| -> Result<InstanceRecord, String> {
            Ok(InstanceRecord {
                job_id: self.i_job_id.ok_or_else(|| missing("job_id"))?,
                cloud_id: self.i_cloud_id.take(),
                availability_zone: self
                    .i_availability_zone
                    .take()
                    .ok_or_else(|| missing("zone"))?,
                instance_type: self.i_instance_type.take().ok_or_else(|| missing("type"))?,
                product: self.i_product.take().ok_or_else(|| missing("product"))?,
                tier: self.i_tier.take().ok_or_else(|| missing("tier"))?,
                bid_usd: self.i_bid_usd,
                state: self.i_state.take().ok_or_else(|| missing("state"))?,
                token_hash: self
                    .i_token_hash
                    .take()
                    .ok_or_else(|| missing("token_hash"))?,
                requested_ms: self.i_requested_ms.ok_or_else(|| missing("requested_ms"))?,
                launched_ms: self.i_launched_ms,
                ready_ms: self.i_ready_ms,
                warned_ms: self.i_warned_ms,
                ended_ms: self.i_ended_ms,
                end_reason: self.i_end_reason.take(),
                ended_by_provider: self.i_ended_by_provider.unwrap_or(0),
                launch_error: self.i_launch_error.take(),
                metadata_addr: self.i_metadata_addr.take(),
                agent_pid: self.i_agent_pid,
                stop_by_ms: self.i_stop_by_ms,
                // What a status shows never needs them.
                launch_token: None,
                bootstrap_hash: None,
                bootstrap_used_ms: None,
                id: id.clone(),
            })
        })();
        // Columns of a NOT NULL schema are never null for a joined row; if one were, the
        // instance is left out rather than the whole status failing.
        out.map_err(|e| tracing::warn!(instance = %id, "{e}")).ok()
    }
}

/// id, job, instance, time, kind, detail.
type EventTuple = (i64, Option<i64>, Option<String>, i64, String, String);

const JOB_COLUMNS: &str = "id, name, spec, policy, billing, state, state_reason, budget_usd, deadline_ms, \
     progress, metric, control_state, engine_state, created_ms, started_ms, finished_ms, work_done_units, expected_work_units, lease_owner, owner_figures";

fn job_from(t: JobRecord) -> Result<JobRow, StoreError> {
    Ok(JobRow {
        id: JobId(t.id),
        name: t.name,
        spec: t.spec,
        policy: t.policy,
        billing: t.billing,
        state: t.state.parse()?,
        state_reason: t.state_reason,
        budget_usd: t
            .budget_usd
            .map(Usd::new)
            .transpose()
            .map_err(|e| StoreError::Invalid(format!("stored job {}: budget: {e}", t.id)))?,
        deadline: t.deadline_ms.map(Timestamp::from_millis),
        progress: t.progress,
        metric: t.metric,
        control_state: t.control_state,
        engine_state: t.engine_state,
        created: Timestamp::from_millis(t.created_ms),
        started: t.started_ms.map(Timestamp::from_millis),
        finished: t.finished_ms.map(Timestamp::from_millis),
        work: WorkRecord {
            done_units: t.work_done_units,
            expected_units: t.expected_work_units,
        },
        lease_owner: t.lease_owner,
        owner_figures: t.owner_figures,
    })
}

#[derive(sqlx::FromRow)]
struct InstanceRecord {
    id: String,
    job_id: i64,
    cloud_id: Option<String>,
    availability_zone: String,
    instance_type: String,
    product: String,
    tier: String,
    bid_usd: Option<f64>,
    state: String,
    token_hash: String,
    requested_ms: i64,
    launched_ms: Option<i64>,
    ready_ms: Option<i64>,
    warned_ms: Option<i64>,
    ended_ms: Option<i64>,
    end_reason: Option<String>,
    ended_by_provider: i64,
    launch_error: Option<String>,
    metadata_addr: Option<String>,
    agent_pid: Option<i64>,
    stop_by_ms: Option<i64>,
    launch_token: Option<String>,
    bootstrap_hash: Option<String>,
    bootstrap_used_ms: Option<i64>,
}

const INSTANCE_COLUMNS: &str = "id, job_id, cloud_id, availability_zone, instance_type, product, tier, bid_usd, \
     state, token_hash, requested_ms, launched_ms, ready_ms, warned_ms, ended_ms, end_reason, ended_by_provider, launch_error, \
     metadata_addr, agent_pid, stop_by_ms, launch_token, bootstrap_hash, bootstrap_used_ms";

fn instance_from(r: InstanceRecord) -> Result<InstanceRow, StoreError> {
    let bad = |e: crate::market::InvalidValue| {
        StoreError::Invalid(format!("stored instance {}: {e}", r.id))
    };
    Ok(InstanceRow {
        market: Market::new(
            Zone::parse(&r.availability_zone).map_err(bad)?,
            InstanceType::parse(&r.instance_type).map_err(bad)?,
            Product::parse(&r.product).map_err(bad)?,
        ),
        tier: r.tier.parse().map_err(StoreError::Invalid)?,
        bid: r.bid_usd.map(UsdPerHour::new).transpose().map_err(bad)?,
        state: r.state.parse()?,
        id: r.id,
        job_id: JobId(r.job_id),
        cloud_id: r.cloud_id,
        token_hash: r.token_hash,
        requested: Timestamp::from_millis(r.requested_ms),
        launched: r.launched_ms.map(Timestamp::from_millis),
        ready: r.ready_ms.map(Timestamp::from_millis),
        warned: r.warned_ms.map(Timestamp::from_millis),
        ended: r.ended_ms.map(Timestamp::from_millis),
        end_reason: r.end_reason,
        ended_by_provider: r.ended_by_provider != 0,
        launch_error: r.launch_error,
        metadata_addr: r.metadata_addr,
        agent_pid: r.agent_pid.and_then(|p| u32::try_from(p).ok()),
        stop_by: r.stop_by_ms.map(Timestamp::from_millis),
        launch_token: r.launch_token,
        bootstrap_hash: r.bootstrap_hash,
        bootstrap_used: r.bootstrap_used_ms.map(Timestamp::from_millis),
    })
}

impl Store {
    pub async fn create_job(&self, job: &NewJob) -> Result<JobId, StoreError> {
        let sql = format!(
            "INSERT INTO jobs (name, spec, policy, billing, state, budget_usd, deadline_ms, \
                 created_ms, lease_expires_ms) \
             VALUES ($1, $2, $3, $4, 'pending', $5, $6, $7, {} + $8) RETURNING id",
            self.db_now_sql()
        );
        let id: i64 = with_db!(self, |pool| {
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(&job.name)
                .bind(&job.spec)
                .bind(&job.policy)
                .bind(&job.billing)
                .bind(job.budget_usd.map(Usd::get))
                .bind(job.deadline.map(|t| t.millis()))
                .bind(job.created.millis())
                .bind(job.grant_window_ms)
                .fetch_one(pool)
                .await
                .context("creating a job")?
        });
        Ok(JobId(id))
    }

    pub async fn job(&self, id: JobId) -> Result<Option<JobRow>, StoreError> {
        let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1");
        let row: Option<JobRecord> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(id.0)
                .fetch_optional(pool)
                .await
                .context("reading a job")?
        });
        row.map(job_from).transpose()
    }

    /// Jobs, newest first; only unfinished ones when `active_only`.
    pub async fn jobs(&self, active_only: bool) -> Result<Vec<JobRow>, StoreError> {
        let filter = if active_only {
            "WHERE state IN ('pending', 'running')"
        } else {
            ""
        };
        let sql = format!("SELECT {JOB_COLUMNS} FROM jobs {filter} ORDER BY id DESC");
        let rows: Vec<JobRecord> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(pool)
                .await
                .context("listing jobs")?
        });
        rows.into_iter().map(job_from).collect()
    }

    /// The jobs whose lease `owner` holds, in any state (an over job stays leased while its
    /// instances are released), oldest first.
    pub async fn jobs_leased_by(&self, owner: &str) -> Result<Vec<JobRow>, StoreError> {
        let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE lease_owner = $1 ORDER BY id");
        let rows: Vec<JobRecord> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(owner)
                .fetch_all(pool)
                .await
                .context("listing this broker's jobs")?
        });
        rows.into_iter().map(job_from).collect()
    }

    /// Moves a job to `state`. Final states are final: a finished job is never reopened, which
    /// makes a racing cancel and completion harmless. Returns whether the row changed.
    ///
    /// `lease`: the owner's decisions carry it (fenced, see [`Lease`]); a user's cancel, made
    /// through any broker, does not.
    pub async fn set_job_state(
        &self,
        lease: Option<&Lease>,
        id: JobId,
        state: JobState,
        reason: Option<&str>,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE jobs SET state = $2, state_reason = COALESCE($3, state_reason), \
                 started_ms = CASE WHEN $2 = 'running' AND started_ms IS NULL THEN $4 ELSE started_ms END, \
                 finished_ms = CASE WHEN $2 IN ('succeeded', 'failed', 'cancelled') THEN $4 ELSE finished_ms END \
             WHERE id = $1 AND state NOT IN ('succeeded', 'failed', 'cancelled') AND {}",
            jobs_fence(5)
        );
        let done = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id.0)
                .bind(state.as_str())
                .bind(reason)
                .bind(now.millis())
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context("changing a job's state")?
                .rows_affected()
        });
        self.fenced(lease, done).await?;
        Ok(done > 0)
    }

    pub async fn set_job_progress(
        &self,
        lease: Option<&Lease>,
        id: JobId,
        progress: f64,
        metric: Option<&str>,
        work: WorkRecord,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE jobs SET progress = $2, metric = COALESCE($3, metric), \
                 work_done_units = $4, expected_work_units = $5 WHERE id = $1 AND {}",
            jobs_fence(6)
        );
        let done = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id.0)
                .bind(progress)
                .bind(metric)
                .bind(work.done_units)
                .bind(work.expected_units)
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context("recording job progress")?
                .rows_affected()
        });
        self.fenced(lease, done).await?;
        Ok(())
    }

    /// Saves a job's coordinator state (JSON), so that a restarted broker resumes its layout.
    pub async fn save_control_state(
        &self,
        lease: Option<&Lease>,
        id: JobId,
        state: &str,
    ) -> Result<(), StoreError> {
        self.save_job_state_text(lease, id, SavedState::Control, state)
            .await
    }

    /// Saves a job's engine state (JSON), so that a restarted broker continues deciding.
    pub async fn save_engine_state(
        &self,
        lease: Option<&Lease>,
        id: JobId,
        state: &str,
    ) -> Result<(), StoreError> {
        self.save_job_state_text(lease, id, SavedState::Engine, state)
            .await
    }

    /// Saves what only the owner computes for the job's view (JSON), for the other brokers.
    pub async fn save_owner_figures(
        &self,
        lease: Option<&Lease>,
        id: JobId,
        figures: &str,
    ) -> Result<(), StoreError> {
        self.save_job_state_text(lease, id, SavedState::OwnerFigures, figures)
            .await
    }

    async fn save_job_state_text(
        &self,
        lease: Option<&Lease>,
        id: JobId,
        which: SavedState,
        state: &str,
    ) -> Result<(), StoreError> {
        let (column, context) = match which {
            SavedState::Control => ("control_state", "saving a job's control state"),
            SavedState::Engine => ("engine_state", "saving a job's engine state"),
            SavedState::OwnerFigures => ("owner_figures", "saving a job's owner figures"),
        };
        let sql = format!(
            "UPDATE jobs SET {column} = $2 WHERE id = $1 AND {}",
            jobs_fence(3)
        );
        let done = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id.0)
                .bind(state)
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context(context)?
                .rows_affected()
        });
        self.fenced(lease, done).await?;
        Ok(())
    }

    /// Records the intent to buy an instance, before the cloud is asked: refused
    /// ([`StoreError::Fenced`]) when `lease` is no longer the job's, so a broker that lost the
    /// job never launches for it.
    pub async fn insert_instance(
        &self,
        lease: Option<&Lease>,
        i: &InstanceRow,
    ) -> Result<(), StoreError> {
        let done = with_db!(self, |pool| {
            sqlx::query(
                "INSERT INTO instances (id, job_id, cloud_id, availability_zone, instance_type, product, tier, \
                     bid_usd, state, token_hash, requested_ms, launched_ms, launch_token, bootstrap_hash) \
                 SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $14, $15 \
                 WHERE ($13 IS NULL OR EXISTS (SELECT 1 FROM jobs WHERE id = $2 AND lease_token = $13))",
            )
            .bind(&i.id)
            .bind(i.job_id.0)
            .bind(&i.cloud_id)
            .bind(i.market.zone.as_str())
            .bind(i.market.instance_type.as_str())
            .bind(i.market.product.as_str())
            .bind(i.tier.as_str())
            .bind(i.bid.map(UsdPerHour::get))
            .bind(i.state.as_str())
            .bind(&i.token_hash)
            .bind(i.requested.millis())
            .bind(i.launched.map(|t| t.millis()))
            .bind(token_of(lease))
            .bind(&i.launch_token)
            .bind(&i.bootstrap_hash)
            .execute(pool)
            .await
            .context("recording an instance")?
            .rows_affected()
        });
        self.fenced(lease, done).await?;
        Ok(())
    }

    pub async fn instance(&self, id: &str) -> Result<Option<InstanceRow>, StoreError> {
        let sql = format!("SELECT {INSTANCE_COLUMNS} FROM instances WHERE id = $1");
        let row: Option<InstanceRecord> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .fetch_optional(pool)
                .await
                .context("reading an instance")?
        });
        row.map(instance_from).transpose()
    }

    /// A job's status in one query: its row, its instances (in launch order) and its spend.
    /// `None` if there is no such job.
    pub async fn job_status(
        &self,
        id: JobId,
    ) -> Result<Option<(JobRow, Vec<InstanceRow>, Usd)>, StoreError> {
        let job_columns = JOB_COLUMNS
            .split(',')
            .map(|c| format!("j.{}", c.trim()))
            .collect::<Vec<_>>()
            .join(", ");
        let instance_columns = INSTANCE_COLUMNS
            .split(',')
            .map(|c| format!("i.{0} AS i_{0}", c.trim()))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = format!(
            "SELECT {job_columns}, \
                 (SELECT SUM(l.amount_usd) FROM ledger_lines l WHERE l.job_id = j.id) AS spend_usd, \
                 {instance_columns} \
             FROM jobs j LEFT JOIN instances i ON i.job_id = j.id \
             WHERE j.id = $1 ORDER BY i.requested_ms, i.id"
        );
        let rows: Vec<JobStatusRecord> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(id.0)
                .fetch_all(pool)
                .await
                .context("reading a job's status")?
        });
        let mut rows = rows.into_iter();
        let Some(mut first) = rows.next() else {
            return Ok(None);
        };
        let spend = Usd::new(first.spend_usd.unwrap_or(0.0))
            .map_err(|e| StoreError::Invalid(format!("spend of job {id}: {e}")))?;
        let mut instances = Vec::new();
        if let Some(i) = first.instance() {
            instances.push(instance_from(i)?);
        }
        for mut row in rows {
            if let Some(i) = row.instance() {
                instances.push(instance_from(i)?);
            }
        }
        Ok(Some((job_from(first.job)?, instances, spend)))
    }

    pub async fn instances_of_job(&self, job: JobId) -> Result<Vec<InstanceRow>, StoreError> {
        let sql = format!(
            "SELECT {INSTANCE_COLUMNS} FROM instances WHERE job_id = $1 ORDER BY requested_ms, id"
        );
        let rows: Vec<InstanceRecord> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(job.0)
                .fetch_all(pool)
                .await
                .context("listing a job's instances")?
        });
        rows.into_iter().map(instance_from).collect()
    }

    /// Every instance not yet in a final state, across jobs: what reconciliation checks.
    pub async fn live_instances(&self) -> Result<Vec<InstanceRow>, StoreError> {
        let sql = format!(
            "SELECT {INSTANCE_COLUMNS} FROM instances WHERE state NOT IN ('terminated', 'failed') ORDER BY requested_ms, id"
        );
        let rows: Vec<InstanceRecord> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(pool)
                .await
                .context("listing live instances")?
        });
        rows.into_iter().map(instance_from).collect()
    }

    pub async fn mark_launched(
        &self,
        lease: Option<&Lease>,
        id: &str,
        cloud_id: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE instances SET cloud_id = $2, launched_ms = COALESCE(launched_ms, $3), \
                 launch_token = NULL, \
                 state = CASE WHEN state = 'requested' THEN 'running' ELSE state END \
             WHERE id = $1 AND {}",
            instances_fence(4)
        );
        let done = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(cloud_id)
                .bind(at.millis())
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context("recording a launch")?
                .rows_affected()
        });
        self.fenced(lease, done).await?;
        Ok(())
    }

    /// Records when an instance started working for its job: the first time only, while it is
    /// running or warned (an instance warned while starting still becomes ready, as in the
    /// simulator), never after it ended.
    pub async fn mark_ready(
        &self,
        lease: Option<&Lease>,
        id: &str,
        at: Timestamp,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE instances SET ready_ms = $2 \
             WHERE id = $1 AND ready_ms IS NULL AND state IN ('running', 'warned') AND {}",
            instances_fence(3)
        );
        let n = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(at.millis())
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context("recording that an instance is ready")?
                .rows_affected()
        });
        Ok(self.fenced(lease, n).await? > 0)
    }

    pub async fn set_token_hash(
        &self,
        lease: Option<&Lease>,
        id: &str,
        hash: &str,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE instances SET token_hash = $2 WHERE id = $1 AND {}",
            instances_fence(3)
        );
        let done = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(hash)
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context("rotating an agent token")?
                .rows_affected()
        });
        self.fenced(lease, done).await?;
        Ok(())
    }

    /// A new bootstrap token for an intent relaunched from before bootstrap tokens were kept
    /// (its user data and launch token with it).
    pub async fn set_bootstrap(
        &self,
        lease: Option<&Lease>,
        id: &str,
        token: &str,
        hash: &str,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE instances SET launch_token = $2, bootstrap_hash = $3 WHERE id = $1 AND {}",
            instances_fence(4)
        );
        let done = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(token)
                .bind(hash)
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context("recording a bootstrap token")?
                .rows_affected()
        });
        self.fenced(lease, done).await?;
        Ok(())
    }

    /// The one exchange of an instance's bootstrap token: sets its agent token's hash and marks
    /// the bootstrap token used, only if it was not used before and the instance is the one
    /// the cloud calls `cloud_id` and has not ended. False when any of that does not hold (or
    /// the lease is stale: then the error).
    pub async fn exchange_bootstrap(
        &self,
        lease: Option<&Lease>,
        id: &str,
        cloud_id: &str,
        token_hash: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE instances SET token_hash = $3, bootstrap_used_ms = $4 \
             WHERE id = $1 AND cloud_id = $2 AND bootstrap_hash IS NOT NULL \
             AND bootstrap_used_ms IS NULL AND ended_ms IS NULL AND {}",
            instances_fence(5)
        );
        let done = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(cloud_id)
                .bind(token_hash)
                .bind(now.millis())
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context("exchanging a bootstrap token")?
                .rows_affected()
        });
        Ok(self.fenced(lease, done).await? == 1)
    }

    /// The instance whose bootstrap token hashes to `hash`, used or not.
    pub async fn instance_by_bootstrap_hash(
        &self,
        hash: &str,
    ) -> Result<Option<InstanceRow>, StoreError> {
        let sql = format!("SELECT {INSTANCE_COLUMNS} FROM instances WHERE bootstrap_hash = $1");
        let row: Option<InstanceRecord> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(hash)
                .fetch_optional(pool)
                .await
                .context("looking up a bootstrap token")?
        });
        row.map(instance_from).transpose()
    }

    /// Where a locally started agent's metadata endpoint listens, and its process id: what any
    /// broker that later owns the job needs to serve the one and stop the other.
    pub async fn set_local_agent(
        &self,
        lease: Option<&Lease>,
        id: &str,
        addr: &str,
        pid: Option<u32>,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE instances SET metadata_addr = $2, agent_pid = COALESCE($3, agent_pid) \
             WHERE id = $1 AND {}",
            instances_fence(4)
        );
        let n = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(addr)
                .bind(pid.map(i64::from))
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context("recording a metadata endpoint")?
                .rows_affected()
        });
        self.fenced(lease, n).await?;
        Ok(())
    }

    pub async fn mark_launch_failed(
        &self,
        lease: Option<&Lease>,
        id: &str,
        error: &str,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE instances SET state = 'failed', launch_error = $2, ended_ms = $3, \
                 end_reason = 'launch failed', launch_token = NULL \
             WHERE id = $1 AND state = 'requested' AND {}",
            instances_fence(4)
        );
        let n = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(error)
                .bind(at.millis())
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context("recording a failed launch")?
                .rows_affected()
        });
        self.fenced(lease, n).await?;
        Ok(())
    }

    /// Records a warning, and `event` with it in the same transaction: a change of state and
    /// the event that tells of it are stored together or not at all, so a failure between them
    /// cannot leave a warned instance whose warning nobody hears of (a retry would find it
    /// already warned and say nothing). False when it was already warned or over.
    pub async fn mark_warned(
        &self,
        lease: Option<&Lease>,
        id: &str,
        at: Timestamp,
        event: Option<EventRecord<'_>>,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE instances SET state = 'warned', warned_ms = COALESCE(warned_ms, $2) \
             WHERE id = $1 AND state IN ('requested', 'running') AND {}",
            instances_fence(3)
        );
        let changed = with_db!(self, |pool| {
            let mut tx = pool.begin().await.context("recording a warning")?;
            let n = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(at.millis())
                .bind(token_of(lease))
                .execute(&mut *tx)
                .await
                .context("recording a warning")?
                .rows_affected();
            if n > 0
                && let Some(e) = &event
            {
                insert_event!(&mut *tx, e.job, Some(id), at, e.kind, e.detail)?;
            }
            tx.commit().await.context("recording a warning")?;
            n
        });
        Ok(self.fenced(lease, changed).await? > 0)
    }

    /// Records a graceful stop: the instance's agent was told to stop, and the instance is to
    /// be ended once the agent has left, or at `stop_by` at the latest. False when it was over,
    /// being ended, or already stopping (the first stop's time stands).
    pub async fn mark_stopping(
        &self,
        lease: Option<&Lease>,
        id: &str,
        stop_by: Timestamp,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE instances SET stop_by_ms = $2, end_reason = COALESCE(end_reason, $3) \
             WHERE id = $1 AND stop_by_ms IS NULL AND state IN ('requested', 'running', 'warned') \
             AND {}",
            instances_fence(4)
        );
        let n = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(stop_by.millis())
                .bind(reason)
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context("recording a graceful stop")?
                .rows_affected()
        });
        self.fenced(lease, n).await?;
        Ok(n > 0)
    }

    /// Instances being stopped gracefully and not yet being ended, of jobs `owner` leases.
    pub async fn stopping_instances(&self, owner: &str) -> Result<Vec<InstanceRow>, StoreError> {
        self.instances_of_jobs_held_by(
            owner,
            "i.stop_by_ms IS NOT NULL AND i.state IN ('requested', 'running', 'warned')",
            "i.stop_by_ms, i.id",
            "listing instances being stopped",
        )
        .await
    }

    /// Instances of jobs `owner` holds whose end was asked of the cloud and not yet seen.
    pub async fn terminating_instances(&self, owner: &str) -> Result<Vec<InstanceRow>, StoreError> {
        self.instances_of_jobs_held_by(
            owner,
            "i.state = 'terminating'",
            "i.id",
            "listing instances being terminated",
        )
        .await
    }

    /// The instances matching `condition` (SQL over `i`, the instance) of the jobs `owner`
    /// holds the lease of, in `order`; `what` names the query in errors.
    async fn instances_of_jobs_held_by(
        &self,
        owner: &str,
        condition: &'static str,
        order: &'static str,
        what: &'static str,
    ) -> Result<Vec<InstanceRow>, StoreError> {
        let columns = INSTANCE_COLUMNS
            .split(',')
            .map(|c| format!("i.{}", c.trim()))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = format!(
            "SELECT {columns} FROM instances i JOIN jobs j ON j.id = i.job_id \
             WHERE {condition} AND j.lease_owner = $1 ORDER BY {order}"
        );
        let rows: Vec<InstanceRecord> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(owner)
                .fetch_all(pool)
                .await
                .context(what)?
        });
        rows.into_iter().map(instance_from).collect()
    }

    /// Records that the broker asked the cloud to end an instance (the call may not have
    /// completed; reconciliation finishes the job).
    pub async fn mark_terminating(
        &self,
        lease: Option<&Lease>,
        id: &str,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE instances SET state = 'terminating', end_reason = COALESCE(end_reason, $2) \
             WHERE id = $1 AND state IN ('requested', 'running', 'warned') AND {}",
            instances_fence(3)
        );
        let n = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(reason)
                .bind(token_of(lease))
                .execute(pool)
                .await
                .context("recording a termination request")?
                .rows_affected()
        });
        self.fenced(lease, n).await?;
        Ok(n > 0)
    }

    /// [`Store::mark_terminating`] for many instances at once (a job's end): a few statements,
    /// not one per instance. Returns how many changed.
    pub async fn mark_terminating_many(
        &self,
        lease: Option<&Lease>,
        ids: &[&str],
        reason: &str,
    ) -> Result<u64, StoreError> {
        let mut changed = 0;
        for chunk in ids.chunks(500) {
            let list = (0..chunk.len())
                .map(|i| format!("${}", i + 3))
                .collect::<Vec<_>>()
                .join(", ");
            let sql = format!(
                "UPDATE instances SET state = 'terminating', end_reason = COALESCE(end_reason, $1) \
                 WHERE state IN ('requested', 'running', 'warned') AND {} AND id IN ({list})",
                instances_fence(2)
            );
            changed += with_db!(self, |pool| {
                let mut query = sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
                    .bind(reason)
                    .bind(token_of(lease));
                for id in chunk {
                    query = query.bind(*id);
                }
                query
                    .execute(pool)
                    .await
                    .context("recording termination requests")?
                    .rows_affected()
            });
        }
        self.fenced(lease, changed).await?;
        Ok(changed)
    }

    /// How many instances are held now across all jobs: every one not in a final state
    /// (requested, running, warned or terminating).
    pub async fn count_live_instances(&self) -> Result<u64, StoreError> {
        let n: i64 = with_db!(self, |pool| {
            sqlx::query_scalar(
                "SELECT COUNT(*) FROM instances WHERE state NOT IN ('terminated', 'failed')",
            )
            .fetch_one(pool)
            .await
            .context("counting live instances")?
        });
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Records the end of an instance, and `event` with it in the same transaction (see
    /// [`Store::mark_warned`]). The first end recorded wins (times and who ended it). Its reason
    /// is a terminate request's, if one came first, unless the provider ended it: then `reason`
    /// (an eviction is reported as one, whatever else was asked of the instance).
    pub async fn mark_ended(
        &self,
        lease: Option<&Lease>,
        id: &str,
        at: Timestamp,
        reason: &str,
        by_provider: bool,
        event: Option<EventRecord<'_>>,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE instances SET state = 'terminated', ended_ms = $2, launch_token = NULL, \
                 end_reason = CASE WHEN $4 = 1 THEN $3 ELSE COALESCE(end_reason, $3) END, \
                 ended_by_provider = $4 WHERE id = $1 AND state NOT IN ('terminated', 'failed') AND {}",
            instances_fence(5)
        );
        let changed = with_db!(self, |pool| {
            let mut tx = pool
                .begin()
                .await
                .context("recording the end of an instance")?;
            let n = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(at.millis())
                .bind(reason)
                .bind(i64::from(by_provider))
                .bind(token_of(lease))
                .execute(&mut *tx)
                .await
                .context("recording the end of an instance")?
                .rows_affected();
            if n > 0
                && let Some(e) = &event
            {
                insert_event!(&mut *tx, e.job, Some(id), at, e.kind, e.detail)?;
            }
            tx.commit()
                .await
                .context("recording the end of an instance")?;
            n > 0
        });
        self.fenced(lease, u64::from(changed)).await?;
        Ok(changed)
    }

    pub async fn upsert_agent(
        &self,
        instance_id: &str,
        job: JobId,
        data_addr: &str,
        vcpus: u32,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        with_db!(self, |pool| {
            sqlx::query(
                "INSERT INTO agents (instance_id, job_id, data_addr, vcpus, registered_ms, last_heartbeat_ms) \
                 VALUES ($1, $2, $3, $4, $5, $5) ON CONFLICT (instance_id) DO UPDATE SET \
                 data_addr = excluded.data_addr, vcpus = excluded.vcpus, registered_ms = excluded.registered_ms",
            )
            .bind(instance_id)
            .bind(job.0)
            .bind(data_addr)
            .bind(i64::from(vcpus))
            .bind(at.millis())
            .execute(pool)
            .await
            .context("registering an agent")?;
        });
        Ok(())
    }

    pub async fn touch_agent(
        &self,
        instance_id: &str,
        at: Timestamp,
        samples_per_sec: f64,
    ) -> Result<(), StoreError> {
        with_db!(self, |pool| {
            sqlx::query("UPDATE agents SET last_heartbeat_ms = $2, samples_per_sec = $3 WHERE instance_id = $1")
                .bind(instance_id)
                .bind(at.millis())
                .bind(samples_per_sec)
                .execute(pool)
                .await
                .context("recording a heartbeat")?;
        });
        Ok(())
    }

    /// Records an event. `lease`: an event the job's owner records carries its lease and is
    /// refused once the lease is another's ([`StoreError::Fenced`]), as its other writes are;
    /// `None` for what is not the owner's to say (a user's submit or cancel, a broker's own
    /// events).
    pub async fn add_event(
        &self,
        lease: Option<&Lease>,
        job: Option<JobId>,
        instance_id: Option<&str>,
        at: Timestamp,
        kind: &str,
        detail: &str,
    ) -> Result<(), StoreError> {
        let Some(l) = lease else {
            with_db!(self, |pool| {
                insert_event!(pool, job, instance_id, at, kind, detail)?;
            });
            return Ok(());
        };
        debug_assert_eq!(
            job,
            Some(l.job()),
            "an event under a lease is of the lease's job"
        );
        let n = with_db!(self, |pool| {
            sqlx::query(
                "INSERT INTO events (job_id, instance_id, ts_ms, kind, detail) \
                 SELECT $1, $2, $3, $4, $5 WHERE EXISTS \
                     (SELECT 1 FROM jobs WHERE id = $1 AND lease_token = $6)",
            )
            .bind(l.job().0)
            .bind(instance_id)
            .bind(at.millis())
            .bind(kind)
            .bind(detail)
            .bind(l.token())
            .execute(pool)
            .await
            .context("recording an event")?
            .rows_affected()
        });
        self.fenced(lease, n).await?;
        Ok(())
    }

    /// Every event of a job, oldest first.
    pub async fn events_of_job(&self, job: JobId) -> Result<Vec<EventRow>, StoreError> {
        self.events_of_job_page(job, 0, u32::MAX).await
    }

    /// One page of a job's events: those with an id above `after`, oldest first, at most
    /// `limit`.
    pub async fn events_of_job_page(
        &self,
        job: JobId,
        after: i64,
        limit: u32,
    ) -> Result<Vec<EventRow>, StoreError> {
        let rows: Vec<EventTuple> = with_db!(self, |pool| {
            sqlx::query_as(
                "SELECT id, job_id, instance_id, ts_ms, kind, detail FROM events \
                 WHERE job_id = $1 AND id > $2 ORDER BY id LIMIT $3",
            )
            .bind(job.0)
            .bind(after)
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await
            .context("listing a page of a job's events")?
        });
        Ok(rows
            .into_iter()
            .map(|(id, job_id, instance_id, ts, kind, detail)| EventRow {
                id,
                job_id: job_id.map(JobId),
                instance_id,
                time: Timestamp::from_millis(ts),
                kind,
                detail,
            })
            .collect())
    }

    /// The latest market time this database recorded (a job's submission or any event), if
    /// any: where a simulated market resumes after a restart, so that its history never runs
    /// backwards.
    pub async fn latest_recorded_time(&self) -> Result<Option<Timestamp>, StoreError> {
        let ts: Option<i64> = with_db!(self, |pool| {
            sqlx::query_scalar(
                "SELECT MAX(t) FROM (SELECT MAX(created_ms) AS t FROM jobs \
                 UNION ALL SELECT MAX(ts_ms) AS t FROM events) AS latest",
            )
            .fetch_one(pool)
            .await
            .context("reading the latest recorded time")?
        });
        Ok(ts.map(Timestamp::from_millis))
    }

    /// How many events a job has.
    pub async fn event_count_of_job(&self, job: JobId) -> Result<i64, StoreError> {
        let n: i64 = with_db!(self, |pool| {
            sqlx::query_scalar("SELECT COUNT(*) FROM events WHERE job_id = $1")
                .bind(job.0)
                .fetch_one(pool)
                .await
                .context("counting a job's events")?
        });
        Ok(n)
    }

    /// Replaces an instance's ledger lines in one transaction: billing is recomputed from the
    /// instance's whole life each time, so the ledger is always consistent with it.
    pub async fn replace_ledger_lines(
        &self,
        lease: Option<&Lease>,
        job: JobId,
        instance_id: &str,
        lines: &[LedgerLine],
    ) -> Result<(), StoreError> {
        self.replace_ledger_lines_many(lease, job, &[(instance_id, lines)])
            .await
    }

    /// [`Store::replace_ledger_lines`] for several instances of a job, in one transaction (one
    /// commit for a whole job's bills, not one per instance).
    pub async fn replace_ledger_lines_many(
        &self,
        lease: Option<&Lease>,
        job: JobId,
        bills: &[(&str, &[LedgerLine])],
    ) -> Result<(), StoreError> {
        if bills.is_empty() {
            return Ok(());
        }
        let sql = format!(
            "UPDATE jobs SET lease_token = lease_token WHERE id = $1 AND {}",
            jobs_fence(2)
        );
        let fenced = with_db!(self, |pool| {
            let mut tx = pool.begin().await.context("starting a ledger update")?;
            // Takes the job's row first (and its lock, on Postgres): a takeover waits for this
            // transaction, or this one sees the new token and writes nothing.
            let held = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(job.0)
                .bind(token_of(lease))
                .execute(&mut *tx)
                .await
                .context("checking the job's lease for a ledger update")?
                .rows_affected();
            if held == 0 {
                true
            } else {
                for (instance_id, lines) in bills {
                    sqlx::query("DELETE FROM ledger_lines WHERE instance_id = $1")
                        .bind(instance_id)
                        .execute(&mut *tx)
                        .await
                        .context("clearing ledger lines")?;
                    for l in lines.iter() {
                        sqlx::query(
                        "INSERT INTO ledger_lines (job_id, instance_id, start_ms, end_ms, usd_per_hour, amount_usd, free) \
                         VALUES ($1, $2, $3, $4, $5, $6, $7)",
                    )
                    .bind(job.0)
                    .bind(instance_id)
                    .bind(l.start.millis())
                    .bind(l.end.millis())
                    .bind(l.usd_per_hour.get())
                    .bind(l.amount_usd.get())
                    .bind(i64::from(l.free))
                    .execute(&mut *tx)
                    .await
                    .context("writing ledger lines")?;
                    }
                }
                tx.commit().await.context("committing ledger lines")?;
                false
            }
        });
        if fenced {
            return Err(StoreError::Fenced { job });
        }
        Ok(())
    }

    pub async fn ledger_of_job(&self, job: JobId) -> Result<Vec<LedgerLine>, StoreError> {
        let rows: Vec<(String, i64, i64, f64, f64, i64)> = with_db!(self, |pool| {
            sqlx::query_as(
                "SELECT instance_id, start_ms, end_ms, usd_per_hour, amount_usd, free FROM ledger_lines \
                 WHERE job_id = $1 ORDER BY start_ms, instance_id",
            )
            .bind(job.0)
            .fetch_all(pool)
            .await
            .context("reading a job's ledger")?
        });
        rows.into_iter()
            .map(|(instance_id, s, e, rate, amount, free)| {
                let bad = |e: crate::market::InvalidValue| {
                    StoreError::Invalid(format!("ledger line of instance {instance_id}: {e}"))
                };
                Ok(LedgerLine {
                    usd_per_hour: UsdPerHour::new(rate).map_err(bad)?,
                    amount_usd: Usd::new(amount).map_err(bad)?,
                    instance_id,
                    start: Timestamp::from_millis(s),
                    end: Timestamp::from_millis(e),
                    free: free != 0,
                })
            })
            .collect()
    }

    /// Total spend per job, from the ledger.
    pub async fn spend_of_job(&self, job: JobId) -> Result<Usd, StoreError> {
        let total: Option<f64> = with_db!(self, |pool| {
            sqlx::query_scalar("SELECT SUM(amount_usd) FROM ledger_lines WHERE job_id = $1")
                .bind(job.0)
                .fetch_one(pool)
                .await
                .context("summing a job's spend")?
        });
        Usd::new(total.unwrap_or(0.0))
            .map_err(|e| StoreError::Invalid(format!("spend of job {job}: {e}")))
    }

    /// Every job's ledger total (zero for a job with no lines), in one grouped query.
    pub async fn spend_by_job(&self) -> Result<Vec<(JobId, Usd)>, StoreError> {
        let rows: Vec<(i64, Option<f64>)> = with_db!(self, |pool| {
            sqlx::query_as(
                "SELECT j.id, SUM(l.amount_usd) FROM jobs j \
                 LEFT JOIN ledger_lines l ON l.job_id = j.id GROUP BY j.id ORDER BY j.id",
            )
            .fetch_all(pool)
            .await
            .context("summing every job's spend")?
        });
        rows.into_iter()
            .map(|(id, total)| {
                Usd::new(total.unwrap_or(0.0))
                    .map(|usd| (JobId(id), usd))
                    .map_err(|e| StoreError::Invalid(format!("spend of job {id}: {e}")))
            })
            .collect()
    }

    /// How many jobs are in each state (states without jobs are absent).
    pub async fn job_counts_by_state(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let rows: Vec<(String, i64)> = with_db!(self, |pool| {
            sqlx::query_as("SELECT state, COUNT(*) FROM jobs GROUP BY state")
                .fetch_all(pool)
                .await
                .context("counting jobs by state")?
        });
        Ok(rows)
    }

    /// Records a cool-down at `now`; a newer one for the same market replaces it, except that
    /// a spot refusal does not narrow a whole-market cool-down still running at `now`.
    pub async fn set_cooldown(&self, c: &Cooldown, now: Timestamp) -> Result<(), StoreError> {
        with_db!(self, |pool| {
            sqlx::query(
                "INSERT INTO market_cooldowns (availability_zone, instance_type, until_ms, reason, spot_only) \
                 VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (availability_zone, instance_type) DO UPDATE SET until_ms = excluded.until_ms, \
                 reason = excluded.reason, \
                 spot_only = CASE WHEN market_cooldowns.spot_only = 0 AND market_cooldowns.until_ms > $6 \
                 THEN 0 ELSE excluded.spot_only END",
            )
            .bind(c.zone.as_str())
            .bind(c.instance_type.as_str())
            .bind(c.until.millis())
            .bind(&c.reason)
            .bind(i64::from(c.scope == CooldownScope::SpotOffer))
            .bind(now.millis())
            .execute(pool)
            .await
            .context("recording a market cool-down")?;
        });
        Ok(())
    }

    pub async fn cooldowns(&self, now: Timestamp) -> Result<Vec<Cooldown>, StoreError> {
        let rows: Vec<(String, String, i64, String, i64)> = with_db!(self, |pool| {
            sqlx::query_as(
                "SELECT availability_zone, instance_type, until_ms, reason, spot_only FROM market_cooldowns WHERE until_ms > $1",
            )
            .bind(now.millis())
            .fetch_all(pool)
            .await
            .context("reading market cool-downs")?
        });
        rows.into_iter()
            .map(|(z, t, until, reason, spot_only)| {
                let bad = |e: crate::market::InvalidValue| {
                    StoreError::Invalid(format!("stored cool-down: {e}"))
                };
                Ok(Cooldown {
                    zone: Zone::parse(&z).map_err(bad)?,
                    instance_type: InstanceType::parse(&t).map_err(bad)?,
                    until: Timestamp::from_millis(until),
                    reason,
                    scope: if spot_only == 0 {
                        CooldownScope::WholeMarket
                    } else {
                        CooldownScope::SpotOffer
                    },
                })
            })
            .collect()
    }

    /// The stored hash of a named API token, if one was generated.
    pub async fn api_token_hash(&self, name: &str) -> Result<Option<String>, StoreError> {
        with_db!(self, |pool| {
            sqlx::query_scalar("SELECT token_hash FROM api_tokens WHERE name = $1")
                .bind(name)
                .fetch_optional(pool)
                .await
                .context("reading the API token")
        })
    }

    /// Stores a token hash unless one exists; returns the hash in force (a concurrent first
    /// start keeps whichever was written first).
    pub async fn init_api_token_hash(
        &self,
        name: &str,
        hash: &str,
        now: Timestamp,
    ) -> Result<String, StoreError> {
        with_db!(self, |pool| {
            sqlx::query(
                "INSERT INTO api_tokens (name, token_hash, created_ms) VALUES ($1, $2, $3) ON CONFLICT (name) DO NOTHING",
            )
            .bind(name)
            .bind(hash)
            .bind(now.millis())
            .execute(pool)
            .await
            .context("storing the API token")?;
        });
        Ok(self
            .api_token_hash(name)
            .await?
            .unwrap_or_else(|| hash.to_string()))
    }

    /// The instance whose agent token has this hash.
    pub async fn instance_by_token_hash(
        &self,
        hash: &str,
    ) -> Result<Option<InstanceRow>, StoreError> {
        let sql = format!("SELECT {INSTANCE_COLUMNS} FROM instances WHERE token_hash = $1");
        let row: Option<InstanceRecord> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(hash)
                .fetch_optional(pool)
                .await
                .context("looking up an agent token")?
        });
        row.map(instance_from).transpose()
    }

    pub async fn instance_by_cloud_id(
        &self,
        cloud_id: &str,
    ) -> Result<Option<InstanceRow>, StoreError> {
        let sql = format!("SELECT {INSTANCE_COLUMNS} FROM instances WHERE cloud_id = $1");
        let row: Option<InstanceRecord> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(cloud_id)
                .fetch_optional(pool)
                .await
                .context("reading an instance by cloud id")?
        });
        row.map(instance_from).transpose()
    }
}
