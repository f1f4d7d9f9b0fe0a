//! The control loop: the live driver of every job's [`JobEngine`](crate::engine::JobEngine).
//! Every tick it (1) records what the cloud did (warnings, reclaims) and queues it for the
//! job's engine, then, for each running job, (2) reads the training's state from the job's
//! coordinator, (3) feeds all of it to the engine, which decides — the same engine the
//! simulator drives — and (4) carries out the engine's commands: launches through the cloud
//! driver (every intent written to the store first, each launch answered before the engine
//! goes on), releases, events, the job's end. It decides nothing itself.

use super::control::wall_ms;
use super::{Broker, JobRuntime, Pacing, ServiceError, ledger};
use crate::billing::BillingModel;
use crate::cloud::{CloudError, CloudEvent, LaunchSpec};
use crate::engine::NOTICE_SECS;
use crate::engine::job_engine::{Command, Ctx, Input, JobEnd, Member};
use crate::engine::view::{FutureReads, TraceView};
use crate::launcher::metadata::InstanceFacts;
use crate::market::{Market, Timestamp, Usd, UsdPerHour};
use crate::market_model::pool_book::Seen;
use crate::market_model::{EvictionEstimate, ModelError, ModelKind};
use crate::policy::{MarketView, Purchase, ViewError};
use crate::store::{
    Cooldown, CooldownScope, EventRecord, InstanceRow, InstanceState, JobRow, JobState, WorkRecord,
};
use proteus_wire::coordinator::JobState as TrainingState;
use proteus_wire::{InstanceId, JobId, Tier};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Broker {
    /// Runs the control loop until `shutdown` resolves.
    pub async fn run_scheduler(self: Arc<Self>, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            if let Err(e) = self.tick().await {
                tracing::warn!(error = %e, "scheduler tick failed; retrying next tick");
            }
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(self.settings.tick) => {}
                _ = self.nudge.notified() => {}
            }
        }
    }

    /// One pass of the control loop.
    pub async fn tick(&self) -> Result<(), ServiceError> {
        let outcome = self.tick_jobs().await;
        super::metrics::Metrics::inc(&self.metrics.ticks);
        // Job statuses show what the tick wrote from now on.
        self.status_cache
            .refresh(&self.store, self.clock.now())
            .await;
        outcome
    }

    async fn tick_jobs(&self) -> Result<(), ServiceError> {
        let now = self.clock.now();
        self.control.sweep(Duration::from_secs(30));
        // First what the cloud did (held, in order, while the database is away).
        self.apply_cloud_events(now).await?;
        // Jobs whose owner died (or left) become this broker's, reconciled with the cloud
        // before anything is decided for them.
        let claimed = self.claim_share().await?;
        let leased = self.store.jobs_leased_by(self.membership().id()).await?;
        // So is a job this broker runs without having it in memory: given to it by another
        // broker's submit, or claimed at a tick whose recovery failed.
        let unrecovered: HashSet<JobId> = claimed
            .iter()
            .map(|l| l.job())
            .chain(
                leased
                    .iter()
                    .filter(|j| !j.state.is_over() && self.runtime(j.id).is_none())
                    .map(|j| j.id),
            )
            .collect();
        if !unrecovered.is_empty() {
            self.recover_jobs(&unrecovered).await?;
        }
        // Instances stopped gracefully whose agents have left are ended now.
        if let Err(e) = self.finish_stops(now).await {
            tracing::warn!(error = %e, "cannot finish graceful stops; retrying next tick");
        }
        // Terminations the cloud refused (throttled, failing) are asked again.
        if let Err(e) = self.retry_terminations().await {
            tracing::warn!(error = %e, "cannot retry terminations; retrying next tick");
        }
        // What every job (of every broker) saw of the spot pools, for this tick's decisions.
        // After the reads above: while the database is away the tick has stopped before this,
        // and a tick holding cloud events does not wait on the pool a second time.
        self.refresh_pools().await;
        for job in leased {
            let lease = match self.fence(job.id) {
                Ok(lease) => lease,
                Err(e @ ServiceError::LeaseLapsed { .. }) => {
                    super::metrics::Metrics::inc(&self.metrics.lease_lapses);
                    tracing::warn!(job = %job.id, error = %e, "not acting on the job");
                    continue;
                }
                Err(_) => continue,
            };
            let outcome = if job.state.is_over() {
                self.wind_down(&job, &lease, now).await
            } else {
                self.tick_job(&job, now).await
            };
            match outcome {
                Err(ServiceError::NotOwner { job })
                | Err(ServiceError::Store(crate::store::StoreError::Fenced { job })) => {
                    self.lost_lease(job)
                }
                // Acted on again once renewed (the keeper), with nothing forgotten.
                Err(e @ ServiceError::LeaseLapsed { .. }) => {
                    super::metrics::Metrics::inc(&self.metrics.lease_lapses);
                    tracing::warn!(job = %job.id, error = %e, "job tick stopped")
                }
                Err(e) => tracing::warn!(job = %job.id, error = %e, "job tick failed"),
                Ok(()) => {}
            }
        }
        Ok(())
    }

    /// A job this broker owns that is over (it ended here, or a user cancelled it through
    /// another broker): its instances are released, and once all of them have ended and are
    /// billed, its lease is given up.
    async fn wind_down(
        &self,
        job: &JobRow,
        lease: &crate::store::Lease,
        now: Timestamp,
    ) -> Result<(), ServiceError> {
        let rows = self.store.instances_of_job(job.id).await?;
        if rows.iter().any(|r| {
            !r.state.is_final() && r.state != InstanceState::Terminating && r.stop_by.is_none()
        }) {
            self.stop_job(
                job.id,
                job.state,
                job.state_reason.as_deref().unwrap_or("over"),
                now,
            )
            .await?;
            return Ok(());
        }
        if rows.iter().any(|r| !r.state.is_final()) {
            return Ok(());
        }
        self.refresh_ledger(job.id, now).await?;
        self.forget_runtime(job.id);
        if self.store.release_lease(lease).await? {
            tracing::debug!(job = %job.id, "job wound down; lease released");
        }
        self.membership_forget(job.id);
        Ok(())
    }

    /// Applies what the provider did. The cloud reports each event once, so an event is taken
    /// off the queue only once it is recorded: when the database is down, the rest wait, in
    /// order, for the next tick.
    async fn apply_cloud_events(&self, now: Timestamp) -> Result<(), ServiceError> {
        match self.cloud.events().await {
            Ok(events) => self
                .unrecorded_cloud_events
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(events),
            Err(e) => tracing::warn!(error = %e, "cannot read cloud events"),
        }
        // One tick at a time applies them (the scheduler loop is the only caller), at most
        // CLOUD_EVENTS_PER_TICK: the rest wait for the next tick, which comes at once.
        for applied in 0.. {
            if applied == CLOUD_EVENTS_PER_TICK {
                self.nudge.notify_one();
                return Ok(());
            }
            let next = self
                .unrecorded_cloud_events
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .front()
                .cloned();
            let Some(event) = next else {
                return Ok(());
            };
            if let Err(e) = self.apply_cloud_event(&event, now).await {
                let waiting = self
                    .unrecorded_cloud_events
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .len();
                tracing::warn!(error = %e, waiting, "cloud events held until they can be recorded");
                return Err(e);
            }
            self.unrecorded_cloud_events
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
        }
        Ok(())
    }

    /// Whether a cloud event about `job`'s instance is this broker's to record: not when the job
    /// is another broker's (its owner sees the same event); held back (an error, so the event
    /// waits in the queue) while this broker's lease on it is lapsed.
    fn owns(&self, job: JobId) -> Result<bool, ServiceError> {
        match self.fence(job) {
            Ok(_) => Ok(true),
            Err(ServiceError::NotOwner { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn apply_cloud_event(
        &self,
        event: &CloudEvent,
        now: Timestamp,
    ) -> Result<(), ServiceError> {
        match event {
            CloudEvent::Warning {
                cloud_id,
                at,
                action_time,
            } => self.on_warning(cloud_id, *at, *action_time, now).await,
            CloudEvent::Ended {
                cloud_id,
                at,
                by_provider,
            } => match self.store.instance_by_cloud_id(cloud_id).await? {
                Some(row) if self.owns(row.job_id)? => {
                    self.on_ended(&row, *at, *by_provider, now).await
                }
                _ => Ok(()),
            },
        }
    }

    /// The provider announced a reclaim: record it, and tell the agent through its metadata
    /// endpoint (locally launched agents) exactly as EC2 would.
    pub async fn on_warning(
        &self,
        cloud_id: &str,
        at: Timestamp,
        action_time: Timestamp,
        now: Timestamp,
    ) -> Result<(), ServiceError> {
        let Some(row) = self.store.instance_by_cloud_id(cloud_id).await? else {
            return Ok(());
        };
        if !self.owns(row.job_id)? {
            return Ok(());
        }
        let lease = self.fence(row.job_id)?;
        let detail = format!("{} reclaims it at {action_time}", row.market);
        let event = EventRecord {
            job: Some(row.job_id),
            kind: "interruption_warning",
            detail: &detail,
        };
        if !self
            .store
            .mark_warned(Some(&lease), &row.id, at, Some(event))
            .await?
        {
            return Ok(());
        }
        if row.tier == Tier::Transient {
            self.saw_pool(&row.market, at, Seen::Interrupted).await;
        }
        if let Some(runtime) = self.runtime(row.job_id) {
            let mut rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
            rt.arrivals.push(Input::Warned {
                id: InstanceId(row.id.clone()),
                at,
                terminate_at: action_time,
            });
        }
        // A command job's warned member leaves the working set now (its rank stays reserved
        // until it departs), not when its agent reads the notice.
        if let (Some(control), Some(cloud_id)) = (self.control.get(row.job_id), &row.cloud_id) {
            let id = InstanceId(cloud_id.clone());
            if control.read(|c| c.is_member(&id)) {
                control.update(|c| c.provider_warned(&id));
            }
        }
        super::metrics::Metrics::inc(&self.metrics.warnings);
        if let Some(launcher) = &self.launcher {
            // The agent compares the notice with its own (wall) clock.
            let wall = self
                .clock
                .wall_for(action_time.secs_since(now))
                .max(self.settings.min_notice);
            let when = chrono::Utc::now() + chrono::Duration::from_std(wall).unwrap_or_default();
            launcher.announce_interruption(
                &row.id,
                &when.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            );
        }
        Ok(())
    }

    /// An instance is gone: record who ended it and when, bill it, drop it from the training
    /// layout and stop its local agent.
    pub async fn on_ended(
        &self,
        row: &InstanceRow,
        at: Timestamp,
        by_provider: bool,
        now: Timestamp,
    ) -> Result<(), ServiceError> {
        // A warned instance that ends was reclaimed by the provider, whoever reports the end
        // (EC2 shows a plain termination once the notice period is over) and whatever ended it
        // during its notice (a release, the job's end): an eviction in every report, billed
        // under the provider-ended rule.
        let by_provider = by_provider || row.warned.is_some();
        if by_provider {
            crate::failpoint::hit("evicted-before-record");
        }
        let reason = if by_provider { "evicted" } else { "terminated" };
        let detail = if by_provider {
            format!("{} reclaimed by the provider", row.market)
        } else {
            row.end_reason
                .clone()
                .unwrap_or_else(|| "terminated".to_string())
        };
        let event = EventRecord {
            job: Some(row.job_id),
            kind: reason,
            detail: &detail,
        };
        let lease = self.fence(row.job_id)?;
        if !self
            .store
            .mark_ended(Some(&lease), &row.id, at, reason, by_provider, Some(event))
            .await?
        {
            return Ok(());
        }
        if by_provider {
            super::metrics::Metrics::inc(&self.metrics.evictions);
        }
        // A warned instance's pool was seen going at the notice. Otherwise: taken without a
        // notice, the pool went now; let go by its job, it was up until now.
        if row.tier == Tier::Transient && row.cloud_id.is_some() && row.warned.is_none() {
            let seen = if by_provider {
                Seen::Interrupted
            } else {
                Seen::Released
            };
            self.saw_pool(&row.market, at, seen).await;
        }
        if let Some(runtime) = self.runtime(row.job_id) {
            let mut rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
            rt.arrivals.push(Input::Ended {
                id: InstanceId(row.id.clone()),
                at,
                by_provider,
            });
        }
        if let (Some(control), Some(cloud_id)) = (self.control.get(row.job_id), &row.cloud_id) {
            control.update(|c| c.remove(&InstanceId(cloud_id.clone()), reason, wall_ms()));
        }
        if let Some(cloud_id) = &row.cloud_id {
            self.agent_cache
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(cloud_id);
        }
        if let Some(launcher) = self.launcher.clone() {
            // The "VM" shuts down: like a real one, it gives the agent (and its program, whose
            // grace it honours on SIGTERM) time to finish before it is killed.
            let grace = self
                .control
                .get(row.job_id)
                .and_then(|c| c.read(|c| c.stop_grace()))
                .map_or(Duration::from_secs(3), |g| g + STOP_UPLOAD_ALLOWANCE);
            let (id, pid) = (row.id.clone(), row.agent_pid);
            tokio::spawn(async move { launcher.stop(&id, grace, pid).await });
        }
        // Only this instance's bill changed (for good); the job's live instances are billed by
        // its next tick. Re-billing them all here made ending N instances O(N²) writes.
        self.bill_ended(&row.id, now).await?;
        Ok(())
    }

    /// One job's turn: what its agents report goes to its [`JobEngine`] with what the cloud
    /// reported since the last tick, and the engine's commands are carried out.
    async fn tick_job(&self, job: &JobRow, now: Timestamp) -> Result<(), ServiceError> {
        let runtime = match self.ensure_runtime(job) {
            Ok(r) => r,
            Err(e) => {
                self.finish_job(job.id, JobState::Failed, &format!("cannot run: {e}"), now)
                    .await?;
                return Ok(());
            }
        };
        let Some(control) = self.control.get(job.id) else {
            return Ok(());
        };
        // A tick that finds nobody dead changes nothing worth saving (liveness is not saved, as
        // for heartbeats): marking the coordinator changed would re-save its whole snapshot
        // every tick, under the lock every heartbeat needs.
        let dead = control.update_quietly(|c| c.tick(wall_ms()));
        if !dead.is_empty() {
            control.update(|_| ());
        }
        for dead in dead {
            if let Some(row) = self.store.instance_by_cloud_id(&dead.0).await? {
                self.store
                    .add_event(
                        Some(&self.fence(job.id)?),
                        Some(job.id),
                        Some(&row.id),
                        now,
                        "agent_lost",
                        "no heartbeat within the timeout; replacing the instance",
                    )
                    .await?;
                self.terminate_instance(&row, "agent unresponsive").await?;
            }
        }
        let status = control.read(|c| c.status());
        let instances = self.store.instances_of_job(job.id).await?;
        self.reconcile(&runtime, &instances);
        let mut inputs =
            std::mem::take(&mut runtime.lock().unwrap_or_else(|e| e.into_inner()).arrivals);
        if self.settings.pacing == Pacing::Measured {
            inputs.extend(self.joined(&instances, &status, now).await?);
            // Heartbeats carry clocks; a command job's program reports its own progress. The
            // end of training may arrive before the last of them: then it is all done.
            inputs.push(Input::Progress {
                fraction: if status.state == TrainingState::Completed {
                    1.0
                } else {
                    status.progress.fraction()
                },
            });
        }
        match status.state {
            TrainingState::Completed => inputs.push(Input::TrainingComplete {
                reason: match status.final_metric {
                    Some(m) => format!("training complete: {} {:.4}", m.kind, m.value),
                    // A command job: the coordinator says how its program completed.
                    None => status
                        .end_reason
                        .clone()
                        .unwrap_or_else(|| "training complete".to_string()),
                },
            }),
            TrainingState::Failed => inputs.push(Input::TrainingFailed {
                reason: status
                    .end_reason
                    .clone()
                    .unwrap_or_else(|| "the program failed".into()),
            }),
            _ => {}
        }
        inputs.push(Input::Tick);
        self.save_control(job.id).await?;
        let metric = status
            .final_metric
            .or(status.latest_metric)
            .and_then(|m| serde_json::to_string(&m).ok());
        let end = self
            .drive(job.id, &runtime, inputs, metric.as_deref(), now)
            .await?;
        if let Some(end) = end {
            let state = if end.outcome.succeeded() {
                JobState::Succeeded
            } else {
                JobState::Failed
            };
            self.finish_job(job.id, state, &end.reason, now).await?;
            return Ok(());
        }
        self.record_progress(job.id, &runtime, metric.as_deref(), now)
            .await?;
        self.refresh_ledger(job.id, now).await?;
        self.publish_figures(job, &instances, now).await?;
        if job.state == JobState::Pending {
            let instances = self.store.instances_of_job(job.id).await?;
            if instances.iter().any(|i| i.launched.is_some()) {
                self.store
                    .set_job_state(
                        Some(&self.fence(job.id)?),
                        job.id,
                        JobState::Running,
                        None,
                        now,
                    )
                    .await?;
            }
        }
        self.save_engine(job.id, &runtime).await
    }

    /// A restored engine learns of the instances the store holds that it does not know: ones
    /// launched after its state was last saved (or by recovery), and the ended ones it bills.
    fn reconcile(&self, runtime: &Arc<std::sync::Mutex<JobRuntime>>, instances: &[InstanceRow]) {
        let mut rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
        if rt.reconciled {
            return;
        }
        rt.reconciled = true;
        let data = self.market_data();
        for row in instances {
            let Some(launched) = row.launched else {
                continue;
            };
            let purchase = match row.bid {
                Some(bid) => Purchase::Spot { bid },
                None => Purchase::OnDemand,
            };
            let member = Member {
                id: InstanceId(row.id.clone()),
                rate: rt
                    .engine
                    .job()
                    .rate(&row.market.instance_type)
                    .unwrap_or(0.0),
                market: row.market.clone(),
                purchase,
                launched_at: launched,
                ready: row.ready,
                warned: row.warned,
                terminate_at: row.warned.map(|w| w.plus_secs(NOTICE_SECS)),
                releasing: row.state == InstanceState::Terminating || row.stop_by.is_some(),
                // A replacement in flight when the engine was last saved is not known from
                // the store: the replaced instance counts again, and the policy decides anew.
                replaced_by: None,
            };
            let ended = row
                .state
                .is_final()
                .then(|| (row.ended.unwrap_or(launched), row.ended_by_provider));
            rt.engine.adopt(member, ended, &data.markets);
        }
    }

    /// [`Pacing::Measured`]: records the instances whose agents joined the training (they
    /// work for the job from now) and returns them for the engine.
    async fn joined(
        &self,
        instances: &[InstanceRow],
        status: &proteus_wire::coordinator::JobStatus,
        now: Timestamp,
    ) -> Result<Vec<Input>, ServiceError> {
        // Each joined member, with when its agent said it was ready (on the wall clock).
        let joined: HashMap<&str, Option<u64>> = status
            .members
            .iter()
            .filter(|m| m.state != proteus_wire::coordinator::MemberState::Joining)
            .map(|m| (m.instance_id.0.as_str(), m.ready_at_ms))
            .collect();
        let wall_now = wall_ms();
        let mut ready = Vec::new();
        for row in instances {
            // A warned instance still starts up; it works for nothing, its working span having
            // ended at the warning.
            if row.ready.is_some()
                || !matches!(row.state, InstanceState::Running | InstanceState::Warned)
            {
                continue;
            }
            let Some(ready_at) = row.cloud_id.as_deref().and_then(|c| joined.get(c)) else {
                continue;
            };
            // Ready when its agent said so, in market time (a tick can come a market minute
            // later on the simulated cloud, and a short job may train within it), never before
            // its launch nor after now.
            let at = match ready_at {
                Some(ms) => now
                    .plus_secs(-(wall_now.saturating_sub(*ms) as f64 / 1000.0) * self.clock.speed())
                    .max(row.launched.unwrap_or(now))
                    .min(now),
                None => now,
            };
            if self
                .store
                .mark_ready(Some(&self.fence(row.job_id)?), &row.id, at)
                .await?
            {
                ready.push(Input::Ready {
                    id: InstanceId(row.id.clone()),
                    at,
                });
            }
        }
        Ok(ready)
    }

    /// Feeds `inputs` to the job's engine and carries out its commands, answering each launch
    /// before the engine goes on. Returns the job's end when the engine decided it.
    async fn drive(
        &self,
        job: JobId,
        runtime: &Arc<std::sync::Mutex<JobRuntime>>,
        inputs: Vec<Input>,
        metric: Option<&str>,
        now: Timestamp,
    ) -> Result<Option<JobEnd>, ServiceError> {
        let mut queue: VecDeque<Input> = inputs.into();
        let mut cooled = self.cooled(now).await?;
        let cap = u64::from(self.settings.instance_cap);
        let mut held_by_all: Option<u64> = None;
        let mut end = None;
        while let Some(input) = queue.pop_front() {
            let commands = {
                let mut rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
                let asked = rt.engine.counts().decisions;
                let started = Instant::now();
                let commands = self.step_engine(&mut rt.engine, now, input, &cooled);
                if rt.engine.counts().decisions > asked {
                    self.metrics.record_decision(started.elapsed());
                }
                commands?
            };
            for command in commands {
                match command {
                    Command::Launch { market, purchase } => {
                        let all = match held_by_all {
                            Some(n) => n,
                            None => self.store.count_live_instances().await?,
                        };
                        if all >= cap {
                            held_by_all = Some(all);
                            queue.push_front(Input::LaunchHeld {
                                reason: format!(
                                    "the broker holds {all} instances across all jobs, its cap \
                                     (`proteus serve --instance-cap {cap}`)"
                                ),
                            });
                            continue;
                        }
                        let answer = match self.launch_instance(job, &market, purchase, now).await?
                        {
                            Launch::Launched { id, at } => {
                                held_by_all = Some(all + 1);
                                Input::Launched {
                                    id: InstanceId(id),
                                    at,
                                }
                            }
                            Launch::Refused(reason) => {
                                // The market may be cooling down now: the policy's next look
                                // leaves it out.
                                cooled = self.cooled(now).await?;
                                Input::LaunchRefused { reason }
                            }
                        };
                        queue.push_front(answer);
                    }
                    Command::Release { id } => {
                        if let Some(row) = self.store.instance(&id.0).await? {
                            self.stop_instance(&row, "released by the policy", now)
                                .await?;
                        }
                    }
                    Command::MarkReady { id, at } => {
                        self.store
                            .mark_ready(Some(&self.fence(job)?), &id.0, at)
                            .await?;
                    }
                    Command::Observe(o) => self.market_data().observe(o.as_observation()),
                    Command::Record { kind, detail } => {
                        self.store
                            .add_event(Some(&self.fence(job)?), Some(job), None, now, kind, &detail)
                            .await?;
                    }
                    Command::End(e) => {
                        if e.outcome.succeeded() {
                            let work = self.work_record(runtime, now);
                            self.store
                                .set_job_progress(Some(&self.fence(job)?), job, 1.0, metric, work)
                                .await?;
                        }
                        end = Some(e);
                    }
                }
            }
        }
        Ok(end)
    }

    /// One step of a job's engine against the broker's market: the trace view at `now`,
    /// without the markets in a cool-down (the policy picks elsewhere without knowing why).
    pub(super) fn step_engine(
        &self,
        engine: &mut crate::engine::JobEngine<'static>,
        now: Timestamp,
        input: Input,
        cooled: &CooledMarkets,
    ) -> Result<Vec<Command>, ServiceError> {
        let data = self.market_data();
        let model = data.model.lock().unwrap_or_else(|e| e.into_inner());
        let pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        let view = LiveView {
            inner: TraceView::new(now, &data.markets, model.as_ref(), FutureReads::Refuse)
                .with_book(Some(pools.book())),
            cooled,
        };
        let ctx = Ctx {
            view: &view,
            markets: &data.markets,
        };
        engine
            .step(now, input, &ctx)
            .map_err(|e| ServiceError::Internal(e.to_string()))
    }

    /// Markets in a cool-down after the cloud refused them: the policy does not see them
    /// (after a spot refusal, it does not see their spot offer).
    pub(super) async fn cooled(&self, now: Timestamp) -> Result<CooledMarkets, ServiceError> {
        Ok(self
            .store
            .cooldowns(now)
            .await?
            .into_iter()
            .map(|c| ((c.zone.to_string(), c.instance_type.to_string()), c.scope))
            .collect())
    }

    fn work_record(
        &self,
        runtime: &Arc<std::sync::Mutex<JobRuntime>>,
        now: Timestamp,
    ) -> WorkRecord {
        let rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
        let reestimated = rt.engine.total_work() != rt.engine.submitted_work();
        WorkRecord {
            done_units: rt.engine.received_work(now),
            expected_units: (self.settings.pacing == Pacing::Measured && reestimated)
                .then(|| rt.engine.total_work()),
        }
    }

    async fn record_progress(
        &self,
        job: JobId,
        runtime: &Arc<std::sync::Mutex<JobRuntime>>,
        metric: Option<&str>,
        now: Timestamp,
    ) -> Result<(), ServiceError> {
        let fraction = runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .engine
            .fraction();
        let work = self.work_record(runtime, now);
        self.store
            .set_job_progress(Some(&self.fence(job)?), job, fraction, metric, work)
            .await?;
        Ok(())
    }

    /// Saves the engine's state when it changed, so that a restarted broker continues the job.
    async fn save_engine(
        &self,
        job: JobId,
        runtime: &Arc<std::sync::Mutex<JobRuntime>>,
    ) -> Result<(), ServiceError> {
        let snapshot = {
            let mut rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
            let json = serde_json::to_string(rt.engine.state())
                .map_err(|e| ServiceError::Internal(format!("engine state of job {job}: {e}")))?;
            if rt.saved_engine.as_deref() == Some(json.as_str()) {
                return Ok(());
            }
            rt.saved_engine = Some(json.clone());
            json
        };
        self.store
            .save_engine_state(Some(&self.fence(job)?), job, &snapshot)
            .await?;
        Ok(())
    }

    /// The next market time after `now` at which something happens that the control loop acts
    /// on: the cloud warns or reclaims, or a job's engine wakes up (see
    /// [`JobEngine::next_wake`]). A driver that steps market time itself (the demo) ticks at
    /// each, so that the live broker decides at the instants the simulator does.
    pub async fn next_event_after(
        &self,
        now: Timestamp,
    ) -> Result<Option<Timestamp>, ServiceError> {
        let mut times: Vec<Timestamp> = self.cloud.next_event_after(now).into_iter().collect();
        for job in self.store.jobs(true).await? {
            if let Some(runtime) = self.runtime(job.id) {
                let rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
                times.extend(rt.engine.next_wake(now));
            }
        }
        Ok(times.into_iter().filter(|&t| t > now).min())
    }

    /// Launches one instance: the intent is stored before the cloud is called, and the cloud
    /// call carries the intent's id as tag and idempotency token.
    pub async fn launch_instance(
        &self,
        job: JobId,
        market: &Market,
        purchase: Purchase,
        now: Timestamp,
    ) -> Result<Launch, ServiceError> {
        let id = format!("pi-{}-{:08x}", job.0, rand::random::<u32>());
        // The launch carries a one-time bootstrap token; the agent token is made when the agent
        // trades it (`agent_bootstrap`). Until then the instance's agent token is one nobody
        // holds.
        let token = crate::api::auth::new_token(proteus_wire::agent_api::BOOTSTRAP_TOKEN_PREFIX);
        let unheld = crate::api::auth::hash_token(&crate::api::auth::new_token("pa_"));
        let row = InstanceRow::intent(id, job, market.clone(), purchase, unheld, now)
            .carrying(token.clone(), crate::api::auth::hash_token(&token));
        self.store
            .insert_instance(Some(&self.fence(job)?), &row)
            .await?;
        crate::failpoint::hit("launch-after-intent");
        self.launch_recorded(&row, &token, now).await
    }

    /// The cloud half of a launch, for a stored intent (also used by recovery).
    pub(crate) async fn launch_recorded(
        &self,
        row: &InstanceRow,
        token: &str,
        now: Timestamp,
    ) -> Result<Launch, ServiceError> {
        let spec = LaunchSpec {
            instance_id: row.id.clone(),
            job_id: row.job_id,
            market: row.market.clone(),
            tier: row.tier,
            bid: row.bid,
            bootstrap_token: token.to_string(),
        };
        // Until the launch is recorded (or refused), a job's end leaves this instance to it.
        let _in_flight = InFlight::enter(&self.launches_in_flight, &row.id);
        // The lease is asked for at the cloud call, not only at the intent's write before it:
        // a broker that stalled in between (past its local deadline) does not launch.
        self.fence(row.job_id)?;
        match self.cloud.launch(&spec).await {
            Ok(ci) => {
                crate::failpoint::hit("launch-after-cloud");
                let lease = self.record_fence(row.job_id)?;
                self.store
                    .mark_launched(
                        Some(&lease),
                        &row.id,
                        &ci.cloud_id,
                        ci.launched.unwrap_or(now),
                    )
                    .await?;
                super::metrics::Metrics::inc(&self.metrics.launches);
                if row.tier == Tier::Transient {
                    self.saw_pool(&row.market, ci.launched.unwrap_or(now), Seen::Granted)
                        .await;
                }
                self.remember_agent(&ci.cloud_id, row);
                let what = match row.bid {
                    Some(b) => format!("{} spot, bid {b} ({})", row.market, ci.cloud_id),
                    None => format!("{} on-demand ({})", row.market, ci.cloud_id),
                };
                self.store
                    .add_event(
                        Some(&lease),
                        Some(row.job_id),
                        Some(&row.id),
                        now,
                        "launched",
                        &what,
                    )
                    .await?;
                let job_over = self
                    .store
                    .job(row.job_id)
                    .await?
                    .is_none_or(|j| j.state.is_over());
                if job_over {
                    // The job ended (a cancel) while the cloud was launching this instance: it
                    // goes at once, and its agent is never started.
                    if let Some(launched) = self.store.instance(&row.id).await? {
                        self.terminate_instance(&launched, "its job ended during the launch")
                            .await?;
                    }
                } else {
                    self.start_local_agent(row, &ci.cloud_id, token).await?;
                }
                Ok(Launch::Launched {
                    id: row.id.clone(),
                    at: ci.launched.unwrap_or(now),
                })
            }
            Err(e) => {
                let lease = self.record_fence(row.job_id)?;
                self.store
                    .mark_launch_failed(Some(&lease), &row.id, &e.to_string(), now)
                    .await?;
                super::metrics::Metrics::inc(&self.metrics.launch_failures);
                if row.tier == Tier::Transient
                    && matches!(e, CloudError::InsufficientCapacity { .. })
                {
                    self.saw_pool(&row.market, now, Seen::Refused).await;
                }
                let mut detail = format!("{}: {}: {e}", row.market, e.reason());
                if e.cools_down_market() {
                    let until = now.plus_secs(self.settings.cooldown_secs);
                    // A spot refusal says nothing of on-demand in the same market: only its spot
                    // offer cools down then (the store keeps a whole-market one that runs).
                    let scope = match row.tier {
                        Tier::Transient => CooldownScope::SpotOffer,
                        Tier::Reliable => CooldownScope::WholeMarket,
                    };
                    self.store
                        .set_cooldown(
                            &Cooldown {
                                zone: row.market.zone.clone(),
                                instance_type: row.market.instance_type.clone(),
                                until,
                                reason: e.reason().to_string(),
                                scope,
                            },
                            now,
                        )
                        .await?;
                    detail.push_str(&format!("; market skipped until {until}"));
                }
                // The market saying no (no capacity, a bid below the price) is a normal outcome
                // on a spot market, recorded as the job's event; only a failed call is a warning.
                match e {
                    CloudError::InsufficientCapacity { .. } | CloudError::PriceTooLow { .. } => {
                        tracing::info!(instance = %row.id, %detail, "launch refused by the market")
                    }
                    _ => tracing::warn!(instance = %row.id, %detail, "launch failed"),
                }
                self.store
                    .add_event(
                        Some(&lease),
                        Some(row.job_id),
                        Some(&row.id),
                        now,
                        "launch_failed",
                        &detail,
                    )
                    .await?;
                Ok(Launch::Refused(detail))
            }
        }
    }

    /// Starts (or re-adopts) the agent of a locally launched instance.
    pub(crate) async fn start_local_agent(
        &self,
        row: &InstanceRow,
        cloud_id: &str,
        token: &str,
    ) -> Result<(), ServiceError> {
        let Some(launcher) = &self.launcher else {
            return Ok(());
        };
        let recorded = crate::launcher::Recorded {
            metadata_addr: row.metadata_addr.as_deref().and_then(|a| a.parse().ok()),
            pid: row.agent_pid,
        };
        let urls = self.agent_broker_urls().await.join(",");
        let facts = InstanceFacts {
            instance_id: cloud_id.to_string(),
            instance_type: row.market.instance_type.to_string(),
            availability_zone: row.market.zone.to_string(),
            lifecycle: if row.tier == Tier::Transient {
                "spot"
            } else {
                "on-demand"
            }
            .to_string(),
        };
        match launcher.start(&row.id, facts, token, recorded, &urls).await {
            Ok((addr, pid)) => {
                self.store
                    .set_local_agent(
                        Some(&self.record_fence(row.job_id)?),
                        &row.id,
                        &addr.to_string(),
                        Some(pid),
                    )
                    .await?
            }
            Err(e) => {
                tracing::warn!(instance = %row.id, error = %e, "cannot start the local agent");
                self.store
                    .add_event(
                        Some(&self.record_fence(row.job_id)?),
                        Some(row.job_id),
                        Some(&row.id),
                        self.clock.now(),
                        "agent_start_failed",
                        &e.to_string(),
                    )
                    .await?;
            }
        }
        Ok(())
    }

    /// Ends an instance Proteus chose to end. Where its agent runs a command job's program,
    /// gracefully: the agent is told to stop (the program gets the notice file and the job's
    /// `grace_seconds`, and its checkpoint is uploaded), and the instance is ended once the
    /// agent has left ([`Broker::finish_stops`]), or when the grace and
    /// [`STOP_UPLOAD_ALLOWANCE`] have passed. Anything else is ended at once.
    pub async fn stop_instance(
        &self,
        row: &InstanceRow,
        reason: &str,
        now: Timestamp,
    ) -> Result<(), ServiceError> {
        if row.state.is_final() || row.state == InstanceState::Terminating || row.stop_by.is_some()
        {
            return Ok(());
        }
        let told = match (self.control.get(row.job_id), &row.cloud_id) {
            (Some(control), Some(cloud_id)) => control.update(|c| {
                let grace = c.stop_grace()?;
                c.stop_member(&InstanceId(cloud_id.clone()), reason)
                    .then_some(grace)
            }),
            _ => None,
        };
        let Some(grace) = told else {
            return self.terminate_instance(row, reason).await;
        };
        let lease = self.fence(row.job_id)?;
        self.store
            .mark_stopping(Some(&lease), &row.id, self.stop_by(now, grace), reason)
            .await?;
        self.store
            .add_event(
                Some(&lease),
                Some(row.job_id),
                Some(&row.id),
                now,
                "instance_stopping",
                &format!(
                    "{reason}: its program has {} s to save, then the instance ends",
                    grace.as_secs()
                ),
            )
            .await?;
        self.save_control(row.job_id).await?;
        Ok(())
    }

    /// The latest time (market) a graceful stop asked at `now` ends its instance.
    fn stop_by(&self, now: Timestamp, grace: Duration) -> Timestamp {
        now.plus_secs((grace + STOP_UPLOAD_ALLOWANCE).as_secs_f64() * self.clock.speed())
    }

    /// Ends the instances being stopped gracefully whose agents have left (or that ran out of
    /// time), of jobs this broker owns.
    pub(super) async fn finish_stops(&self, now: Timestamp) -> Result<(), ServiceError> {
        for row in self
            .store
            .stopping_instances(self.membership().id())
            .await?
        {
            let agent_left = match (self.control.get(row.job_id), &row.cloud_id) {
                (Some(control), Some(cloud_id)) => {
                    !control.read(|c| c.is_member(&InstanceId(cloud_id.clone())))
                }
                _ => true,
            };
            let late = row.stop_by.is_some_and(|t| now >= t);
            if agent_left || late {
                let reason = row
                    .end_reason
                    .clone()
                    .unwrap_or_else(|| "stopped".to_string());
                if late && !agent_left {
                    tracing::warn!(instance = %row.id, "graceful stop ran out of time; ending the instance");
                }
                self.terminate_instance(&row, &reason).await?;
            }
        }
        Ok(())
    }

    /// Asks the cloud to end an instance (recording the request first).
    pub async fn terminate_instance(
        &self,
        row: &InstanceRow,
        reason: &str,
    ) -> Result<(), ServiceError> {
        if row.state.is_final() {
            return Ok(());
        }
        match &row.cloud_id {
            None => self.end_unlaunched(row, reason).await?,
            Some(cloud_id) => {
                self.store
                    .mark_terminating(Some(&self.fence(row.job_id)?), &row.id, reason)
                    .await?;
                crate::failpoint::hit("terminate-after-intent");
                // Asked again at the cloud call (see `launch_recorded`).
                self.fence(row.job_id)?;
                super::metrics::Metrics::inc(&self.metrics.terminations);
                match self.cloud.terminate(std::slice::from_ref(cloud_id)).await {
                    Ok(()) => self.terminated(std::iter::once(row), reason).await?,
                    Err(e) => {
                        tracing::warn!(instance = %row.id, error = %e, "terminate failed; asked again in {TERMINATE_RETRY:?}")
                    }
                }
            }
        }
        Ok(())
    }

    /// Asks the cloud again to end the instances of this broker's jobs that are still
    /// `terminating` (the call failed — throttled, 5xx, a timeout — or its answer was lost),
    /// each at most every [`TERMINATE_RETRY`], until the cloud accepts or lists it gone. Without
    /// it such an instance would run (and bill) until a restart or a takeover reconciled it.
    async fn retry_terminations(&self) -> Result<(), ServiceError> {
        let rows = self
            .store
            .terminating_instances(self.membership().id())
            .await?;
        let due: Vec<InstanceRow> = {
            let mut asked = self
                .terminations_asked
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            asked.retain(|id, _| rows.iter().any(|r| &r.id == id));
            let now = std::time::Instant::now();
            rows.into_iter()
                .filter(|r| r.cloud_id.is_some())
                .filter(|r| {
                    let last = asked.entry(r.id.clone()).or_insert(now);
                    let due = now.duration_since(*last) >= TERMINATE_RETRY;
                    if due {
                        *last = now;
                    }
                    due
                })
                .collect()
        };
        for row in due {
            let Some(cloud_id) = row.cloud_id.clone() else {
                continue;
            };
            if self.fence(row.job_id).is_err() {
                continue;
            }
            let reason = row
                .end_reason
                .clone()
                .unwrap_or_else(|| "terminated".to_string());
            match self.cloud.terminate(std::slice::from_ref(&cloud_id)).await {
                Ok(()) => {
                    tracing::info!(instance = %row.id, "terminate asked again; the cloud accepted it");
                    self.terminated(std::iter::once(&row), &reason).await?
                }
                Err(e) => {
                    tracing::warn!(instance = %row.id, error = %e, "terminate failed again; retrying")
                }
            }
        }
        Ok(())
    }

    /// Instances whose termination the cloud accepted end now: EC2 stops billing an instance
    /// once it is shutting down, which is what the accepted call means, while the listing that
    /// would report the end comes up to `describe_every` (2 s) later.
    async fn terminated<'r>(
        &self,
        rows: impl Iterator<Item = &'r InstanceRow>,
        reason: &str,
    ) -> Result<(), ServiceError> {
        let now = self.clock.now();
        for row in rows {
            let mut row = row.clone();
            row.end_reason = Some(reason.to_string());
            self.on_ended(&row, now, false, now).await?;
        }
        Ok(())
    }

    /// Ends an instance that was never launched: nothing to terminate in the cloud. One whose
    /// launch the cloud is answering now is left to that launch (it may yet exist): it
    /// terminates the instance when it finds the job over.
    async fn end_unlaunched(&self, row: &InstanceRow, reason: &str) -> Result<(), ServiceError> {
        if InFlight::contains(&self.launches_in_flight, &row.id) {
            tracing::debug!(instance = %row.id, "launch in flight; its end waits for the cloud's answer");
            return Ok(());
        }
        let lease = self.fence(row.job_id)?;
        self.store
            .mark_ended(Some(&lease), &row.id, self.clock.now(), reason, false, None)
            .await?;
        Ok(())
    }

    /// Asks the cloud to end many instances (a job's end), recording the requests first: one
    /// store update for them all and one cloud call per [`TERMINATE_BATCH`], not one of each
    /// per instance.
    async fn terminate_all(&self, rows: &[InstanceRow], reason: &str) -> Result<(), ServiceError> {
        let live: Vec<&InstanceRow> = rows.iter().filter(|r| !r.state.is_final()).collect();
        for row in live.iter().filter(|r| r.cloud_id.is_none()) {
            self.end_unlaunched(row, reason).await?;
        }
        let launched: Vec<&InstanceRow> = live
            .iter()
            .copied()
            .filter(|r| r.cloud_id.is_some())
            .collect();
        if launched.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = launched.iter().map(|r| r.id.as_str()).collect();
        // One job's instances (a job's end).
        let lease = match live.first() {
            Some(r) => Some(self.fence(r.job_id)?),
            None => None,
        };
        self.store
            .mark_terminating_many(lease.as_ref(), &ids, reason)
            .await?;
        crate::failpoint::hit("terminate-after-intent");
        if let Some(r) = live.first() {
            self.fence(r.job_id)?;
        }
        for batch in launched.chunks(TERMINATE_BATCH) {
            let cloud_ids: Vec<String> = batch.iter().filter_map(|r| r.cloud_id.clone()).collect();
            self.metrics.terminations.inc_by(batch.len() as u64);
            match self.cloud.terminate(&cloud_ids).await {
                Ok(()) => self.terminated(batch.iter().copied(), reason).await?,
                Err(e) => {
                    tracing::warn!(instances = batch.len(), error = %e, "terminate failed; asked again in {TERMINATE_RETRY:?}")
                }
            }
        }
        Ok(())
    }

    /// Ends a job this broker owns: records its final state, stops training, releases every
    /// instance.
    pub async fn finish_job(
        &self,
        job: JobId,
        state: JobState,
        reason: &str,
        now: Timestamp,
    ) -> Result<(), ServiceError> {
        let lease = self.fence(job)?;
        if !self
            .record_end(Some(&lease), job, state, reason, now)
            .await?
        {
            return Ok(());
        }
        self.stop_job(job, state, reason, now).await
    }

    /// Records a job's final state and the event that tells of it; false when it was over
    /// already. `lease`: the owner's; `None` for a user's cancel through another broker (the
    /// owner stops the job at its next tick).
    pub(crate) async fn record_end(
        &self,
        lease: Option<&crate::store::Lease>,
        job: JobId,
        state: JobState,
        reason: &str,
        now: Timestamp,
    ) -> Result<bool, ServiceError> {
        if !self
            .store
            .set_job_state(lease, job, state, Some(reason), now)
            .await?
        {
            return Ok(false);
        }
        if state == JobState::Cancelled {
            crate::failpoint::hit("cancel-after-record");
        }
        tracing::info!(%job, state = %state, reason, "job finished");
        self.store
            .add_event(lease, Some(job), None, now, &format!("job_{state}"), reason)
            .await?;
        Ok(true)
    }

    /// Stops an ended job's training and releases its instances.
    async fn stop_job(
        &self,
        job: JobId,
        state: JobState,
        reason: &str,
        now: Timestamp,
    ) -> Result<(), ServiceError> {
        // Every member is told to stop (the coordinator's end); a command job's programs get
        // their grace and upload their checkpoints, and their instances end once their agents
        // have left (`finish_stops`). The rest end now.
        let reason_of_end = format!("job {state}");
        let rows = self.store.instances_of_job(job).await?;
        let mut now_ending = Vec::new();
        let control = self.control.get(job);
        let grace = control.as_ref().and_then(|c| {
            c.update(|c| {
                c.cancel(reason);
                c.stop_grace()
            })
        });
        for row in rows {
            if row.state.is_final() || row.stop_by.is_some() {
                continue;
            }
            let told = grace.is_some()
                && row.state != InstanceState::Terminating
                && control
                    .as_ref()
                    .zip(row.cloud_id.as_ref())
                    .is_some_and(|(c, id)| c.read(|c| c.is_member(&InstanceId(id.clone()))));
            match grace {
                Some(grace) if told => {
                    let lease = self.fence(job)?;
                    self.store
                        .mark_stopping(
                            Some(&lease),
                            &row.id,
                            self.stop_by(now, grace),
                            &reason_of_end,
                        )
                        .await?;
                }
                _ => now_ending.push(row),
            }
        }
        self.terminate_all(&now_ending, &reason_of_end).await?;
        if let Some(c) = &control {
            c.linger(grace.map_or(Duration::ZERO, |g| g + STOP_UPLOAD_ALLOWANCE));
        }
        self.refresh_ledger(job, now).await?;
        self.forget_runtime(job);
        // The control plane stays a little longer, so that agents' long polls deliver the stop.
        self.control.mark_finished(job);
        Ok(())
    }

    /// The billing model of a job: its runtime's, or its stored one's once it is over.
    async fn billing_of(&self, job: JobId) -> Result<Option<BillingModel>, ServiceError> {
        Ok(match self.runtime(job) {
            Some(r) => Some(r.lock().unwrap_or_else(|e| e.into_inner()).valid.billing),
            None => self
                .store
                .job(job)
                .await?
                .map(|j| j.billing.parse().unwrap_or(self.settings.default_billing)),
        })
    }

    /// Recomputes the ledger lines of every instance of a job (one transaction for the job);
    /// returns the job's spend.
    pub async fn refresh_ledger(&self, job: JobId, now: Timestamp) -> Result<Usd, ServiceError> {
        let Some(billing) = self.billing_of(job).await? else {
            return Ok(Usd::ZERO);
        };
        let data = self.market_data();
        let mut total = Usd::ZERO;
        // (instance, its lines, its amount when that is final)
        let mut bills: Vec<(String, Vec<crate::store::LedgerLine>, Option<Usd>)> = Vec::new();
        for row in self.store.instances_of_job(job).await? {
            if row.launched.is_none() {
                continue;
            }
            let ended = row.state.is_final() && row.ended.is_some();
            if ended {
                let billed = self.final_bills.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(amount) = billed.get(&row.id) {
                    total += *amount;
                    continue;
                }
            }
            match ledger::bill_instance(&row, now, billing, &data) {
                Ok(lines) => {
                    let amount = lines.iter().map(|l| l.amount_usd).sum::<Usd>();
                    total += amount;
                    bills.push((row.id, lines, ended.then_some(amount)));
                }
                Err(e) => tracing::warn!(instance = %row.id, error = %e, "cannot bill instance"),
            }
        }
        // Live instances are billed again every tick; ended ones once for good.
        let lines: Vec<(&str, &[crate::store::LedgerLine])> = bills
            .iter()
            .map(|(id, lines, _)| (id.as_str(), lines.as_slice()))
            .collect();
        // Written by the job's owner only. A job nobody owns is over and was billed in full
        // before its lease was given up: its total is read, not written.
        let Some(lease) = self.membership().lease(job) else {
            return Ok(total);
        };
        self.store
            .replace_ledger_lines_many(Some(&lease), job, &lines)
            .await?;
        let mut billed = self.final_bills.lock().unwrap_or_else(|e| e.into_inner());
        for (id, _, amount) in bills {
            if let Some(amount) = amount {
                billed.insert(id, amount);
            }
        }
        Ok(total)
    }

    /// Writes the final bill of one instance that has just ended (its job's other instances
    /// are not touched).
    async fn bill_ended(&self, id: &str, now: Timestamp) -> Result<(), ServiceError> {
        let Some(row) = self.store.instance(id).await? else {
            return Ok(());
        };
        if row.launched.is_none() {
            return Ok(());
        }
        let Some(billing) = self.billing_of(row.job_id).await? else {
            return Ok(());
        };
        match ledger::bill_instance(&row, now, billing, &self.market_data()) {
            Ok(lines) => {
                let amount = lines.iter().map(|l| l.amount_usd).sum::<Usd>();
                self.store
                    .replace_ledger_lines(
                        Some(&self.fence(row.job_id)?),
                        row.job_id,
                        &row.id,
                        &lines,
                    )
                    .await?;
                if row.state.is_final() && row.ended.is_some() {
                    self.final_bills
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(row.id.clone(), amount);
                }
            }
            Err(e) => tracing::warn!(instance = %row.id, error = %e, "cannot bill instance"),
        }
        Ok(())
    }

    pub(crate) fn remember_agent_row(&self, cloud_id: &str, row: &InstanceRow) {
        self.remember_agent(cloud_id, row);
    }

    fn remember_agent(&self, cloud_id: &str, row: &InstanceRow) {
        self.agent_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                cloud_id.to_string(),
                super::agents::AgentIdentity {
                    instance_id: row.id.clone(),
                    job_id: row.job_id,
                    tier: row.tier,
                    token_hash: row.token_hash.clone(),
                },
            );
    }
}

/// What became of a launch the policy asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum Launch {
    /// Running under this (the broker's) id since `at`.
    Launched { id: String, at: Timestamp },
    /// The cloud refused it; why, as recorded in the job's events.
    Refused(String),
}

/// Most cloud events one tick applies; the rest wait for the next tick (which then comes at
/// once), so that a job ending many instances together never holds up the other jobs' ticks.
const CLOUD_EVENTS_PER_TICK: usize = 256;

/// [`crate::job::STOP_UPLOAD_ALLOWANCE_SECS`].
const STOP_UPLOAD_ALLOWANCE: Duration = Duration::from_secs(crate::job::STOP_UPLOAD_ALLOWANCE_SECS);

/// Most instances one terminate call names (EC2 takes up to 1000 per TerminateInstances).
const TERMINATE_BATCH: usize = 500;

/// How long a termination the cloud has not confirmed waits before it is asked again.
const TERMINATE_RETRY: Duration = Duration::from_secs(5);

/// How far ahead (market seconds) a job's budget is checked against the billing periods its
/// instances are about to start: the engine's look interval, or two ticks if they are longer.
pub(crate) fn budget_lookahead_secs(tick: std::time::Duration, speed: f64) -> f64 {
    crate::engine::job_engine::BUDGET_LOOK_SECS.max(2.0 * tick.as_secs_f64() * speed)
}

/// Cooled-down markets by (zone, type), with what each cool-down covers.
pub(super) type CooledMarkets = HashMap<(String, String), CooldownScope>;

/// The trace view minus markets the cloud refused recently.
struct LiveView<'a> {
    inner: TraceView<'a>,
    cooled: &'a CooledMarkets,
}

impl LiveView<'_> {
    fn cooled(&self, m: &Market) -> Option<CooldownScope> {
        self.cooled
            .get(&(m.zone.to_string(), m.instance_type.to_string()))
            .copied()
    }
}

impl MarketView for LiveView<'_> {
    fn now(&self) -> Timestamp {
        self.inner.now()
    }
    fn pool_book(&self) -> Option<&crate::market_model::pool_book::PoolBook> {
        self.inner.pool_book()
    }
    fn markets(&self) -> Vec<&Market> {
        self.inner
            .markets()
            .into_iter()
            .filter(|m| self.cooled(m) != Some(CooldownScope::WholeMarket))
            .collect()
    }
    fn spot_price(&self, market: &Market) -> Option<UsdPerHour> {
        if self.cooled(market).is_some() {
            return None;
        }
        self.inner.spot_price(market)
    }
    fn spot_price_at(
        &self,
        market: &Market,
        at: Timestamp,
    ) -> Result<Option<UsdPerHour>, ViewError> {
        self.inner.spot_price_at(market, at)
    }
    fn mean_spot_price(
        &self,
        market: &Market,
        since: Timestamp,
    ) -> Result<Option<UsdPerHour>, ViewError> {
        self.inner.mean_spot_price(market, since)
    }
    fn on_demand_price(&self, market: &Market) -> Option<UsdPerHour> {
        self.inner.on_demand_price(market)
    }
    fn model_kind(&self) -> ModelKind {
        self.inner.model_kind()
    }
    fn eviction(
        &self,
        market: &Market,
        bid_delta_usd: f64,
        horizon_secs: f64,
    ) -> Result<EvictionEstimate, ModelError> {
        self.inner.eviction(market, bid_delta_usd, horizon_secs)
    }
    fn eviction_many(
        &self,
        market: &Market,
        bid_deltas_usd: &[f64],
        horizon_secs: f64,
        out: &mut Vec<EvictionEstimate>,
    ) -> Result<(), ModelError> {
        self.inner
            .eviction_many(market, bid_deltas_usd, horizon_secs, out)
    }
}

/// An instance id in [`Broker`]'s set of launches in flight, for as long as the guard lives
/// (every exit of a launch, errors included, takes it out).
struct InFlight<'a> {
    set: &'a std::sync::Mutex<HashSet<String>>,
    id: String,
}

impl<'a> InFlight<'a> {
    fn enter(set: &'a std::sync::Mutex<HashSet<String>>, id: &str) -> Self {
        set.lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string());
        InFlight {
            set,
            id: id.to_string(),
        }
    }

    fn contains(set: &std::sync::Mutex<HashSet<String>>, id: &str) -> bool {
        set.lock().unwrap_or_else(|e| e.into_inner()).contains(id)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}
