//! The control loop. Every tick it (1) applies what the cloud did (warnings, reclaims), then,
//! for each running job, (2) reads training progress from the job's coordinator, (3) finishes
//! the job on completion, budget or deadline, (4) asks the job's policy what to buy and
//! release, with the same [`Policy`](crate::policy::Policy) code the simulator runs, and
//! (5) applies the answer through the cloud driver, writing every intent to the store first.

use super::control::wall_ms;
use super::{Broker, JobRuntime, MarketData, Pacing, PendingEvents, ServiceError, ledger};
use crate::billing::BillingModel;
use crate::cloud::{CloudEvent, LaunchSpec};
use crate::engine::NOTICE_SECS;
use crate::engine::limits::{Budget, Held, Limits};
use crate::engine::view::{FutureReads, TraceView};
use crate::engine::work::{self, WorkingSpan};
use crate::launcher::metadata::InstanceFacts;
use crate::market::{Market, Timestamp, Usd, UsdPerHour};
use crate::market_model::{EvictionEstimate, ModelError, ModelKind, Observation};
use crate::policy::{
    Decision, DecisionContext, InstanceState as PolicyInstanceState, InstanceView, JobProgress,
    MarketView, PolicyEvent, Purchase, ViewError,
};
use crate::store::{
    Cooldown, EventRecord, InstanceRow, InstanceState, JobRow, JobState, WorkRecord,
};
use proteus_wire::coordinator::JobState as TrainingState;
use proteus_wire::{InstanceId, JobId, Tier};
use std::collections::HashSet;
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
        // Job statuses show what the tick wrote from now on.
        self.status_cache
            .refresh(&self.store, self.clock.now())
            .await;
        outcome
    }

    async fn tick_jobs(&self) -> Result<(), ServiceError> {
        let now = self.clock.now();
        self.control.sweep(Duration::from_secs(30));
        self.apply_cloud_events(now).await?;
        for job in self.store.jobs(true).await? {
            if let Err(e) = self.tick_job(&job, now).await {
                tracing::warn!(job = %job.id, error = %e, "job tick failed");
            }
        }
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
                Some(row) => self.on_ended(&row, *at, *by_provider, now).await,
                None => Ok(()),
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
        let detail = format!("{} reclaims it at {action_time}", row.market);
        let event = EventRecord {
            job: Some(row.job_id),
            kind: "interruption_warning",
            detail: &detail,
        };
        if !self.store.mark_warned(&row.id, at, Some(event)).await? {
            return Ok(());
        }
        if let Some(runtime) = self.runtime(row.job_id) {
            let mut rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
            rt.pending.warned.push(InstanceId(row.id.clone()));
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
        if !self
            .store
            .mark_ended(&row.id, at, reason, by_provider, Some(event))
            .await?
        {
            return Ok(());
        }
        let data = self.market_data();
        if let Some(launched) = row.launched {
            data.observe(Observation::Ran {
                market: &row.market,
                hours: at.secs_since(launched).max(0.0) / 3600.0,
            });
        }
        if by_provider {
            super::metrics::Metrics::inc(&self.metrics.evictions);
            if let Some(runtime) = self.runtime(row.job_id) {
                let mut rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
                rt.pending.evicted.push(InstanceId(row.id.clone()));
            }
            data.observe(Observation::Interrupted {
                market: &row.market,
                at,
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
            let id = row.id.clone();
            tokio::spawn(async move { launcher.stop(&id, Duration::from_secs(3)).await });
        }
        // Only this instance's bill changed (for good); the job's live instances are billed by
        // its next tick. Re-billing them all here made ending N instances O(N²) writes.
        self.bill_ended(&row.id, now).await?;
        Ok(())
    }

    /// Records when each instance started working for the job: when its agent joined the
    /// training (measured pacing), or start-up after its launch (modelled pacing, so that
    /// nothing depends on wall time). Updates `instances` to match.
    async fn record_readiness(
        &self,
        instances: &mut [InstanceRow],
        status: &proteus_wire::coordinator::JobStatus,
        startup_secs: f64,
        now: Timestamp,
    ) -> Result<Vec<InstanceId>, ServiceError> {
        let joined: HashSet<&str> = status
            .members
            .iter()
            .filter(|m| m.state != proteus_wire::coordinator::MemberState::Joining)
            .map(|m| m.instance_id.0.as_str())
            .collect();
        let mut ready = Vec::new();
        for row in instances.iter_mut() {
            // A warned instance still starts up (as in the simulator, which tells the policy
            // it is ready); it works for nothing, its working span having ended at the warning.
            if row.ready.is_some()
                || !matches!(row.state, InstanceState::Running | InstanceState::Warned)
            {
                continue;
            }
            let Some(launched) = row.launched else {
                continue;
            };
            let ready_at = match self.settings.pacing {
                Pacing::Measured => row
                    .cloud_id
                    .as_deref()
                    .is_some_and(|c| joined.contains(c))
                    .then_some(now),
                Pacing::Modelled => Some(launched.plus_secs(startup_secs)).filter(|&t| t <= now),
            };
            if let Some(at) = ready_at
                && self.store.mark_ready(&row.id, at).await?
            {
                row.ready = Some(at);
                ready.push(InstanceId(row.id.clone()));
            }
        }
        Ok(ready)
    }

    /// Records a re-estimate of the job's total work as an event when it moved by more than
    /// 10% since the last one recorded (or is the first).
    async fn announce_reestimate(
        &self,
        job: JobId,
        runtime: &Arc<std::sync::Mutex<JobRuntime>>,
        now: Timestamp,
    ) -> Result<(), ServiceError> {
        let detail = {
            let mut rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
            let total = rt.model.total_work;
            if total == rt.submitted_work && rt.announced_work.is_none() {
                return Ok(());
            }
            let moved = rt
                .announced_work
                .is_none_or(|last| (total - last).abs() > 0.1 * last);
            if !moved {
                return Ok(());
            }
            rt.announced_work = Some(total);
            format!(
                "remaining work re-estimated from the measured rate: {total:.3} units in all \
                 (submitted estimate {:.3})",
                rt.submitted_work
            )
        };
        self.store
            .add_event(Some(job), None, now, "work_reestimated", &detail)
            .await?;
        Ok(())
    }

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
        let mut instances = self.store.instances_of_job(job.id).await?;
        let startup = runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .model
            .startup_secs;
        let ready = self
            .record_readiness(&mut instances, &status, startup, now)
            .await?;
        let (fraction, work) = {
            let mut rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
            let done = work::received(&instances, &rt.model, now);
            match self.settings.pacing {
                Pacing::Measured => {
                    // Heartbeats carry clocks; the end of training may arrive before the
                    // last of them.
                    // A command job's program reports its own progress (any units); the
                    // built-in apps report clocks.
                    let fraction = if status.state == TrainingState::Completed {
                        1.0
                    } else {
                        status.progress.fraction()
                    };
                    let expected = work::reestimate_total(done, fraction);
                    if let Some(total) = expected {
                        rt.model.total_work = total;
                    }
                    (
                        fraction,
                        WorkRecord {
                            done_units: done,
                            expected_units: expected,
                        },
                    )
                }
                Pacing::Modelled => {
                    advance_modelled_work(&mut rt, &instances, &ready, now);
                    let total = rt.model.total_work;
                    (
                        if rt.modelled.is_complete(total) {
                            1.0
                        } else {
                            (rt.modelled.done() / total).min(1.0)
                        },
                        WorkRecord {
                            done_units: done,
                            expected_units: None,
                        },
                    )
                }
            }
        };
        self.announce_reestimate(job.id, &runtime, now).await?;
        let training_done = status.state == TrainingState::Completed;
        if status.state == TrainingState::Failed {
            self.save_control(job.id).await?;
            let reason = status
                .end_reason
                .clone()
                .unwrap_or_else(|| "the program failed".into());
            self.finish_job(job.id, JobState::Failed, &reason, now)
                .await?;
            return Ok(());
        }
        self.save_control(job.id).await?;
        let metric = status
            .final_metric
            .or(status.latest_metric)
            .and_then(|m| serde_json::to_string(&m).ok());
        self.store
            .set_job_progress(job.id, fraction, metric.as_deref(), work)
            .await?;

        if training_done && (self.settings.pacing == Pacing::Measured || fraction >= 1.0) {
            self.store
                .set_job_progress(job.id, 1.0, metric.as_deref(), work)
                .await?;
            let reason = match status.final_metric {
                Some(m) => format!("training complete: {} {:.4}", m.kind, m.value),
                // A command job: the coordinator says how its program completed.
                None => status
                    .end_reason
                    .clone()
                    .unwrap_or_else(|| "training complete".to_string()),
            };
            self.finish_job(job.id, JobState::Succeeded, &reason, now)
                .await?;
            return Ok(());
        }
        let spend = self.refresh_ledger(job.id, now).await?;
        let (budget, deadline) = {
            let r = runtime.lock().unwrap_or_else(|e| e.into_inner());
            (r.valid.budget_usd, r.valid.deadline)
        };
        if let Some(budget) = budget {
            // Stop before the next billing period that would take spend past the budget, not
            // after it: the scheduler may not run again until a little market time has passed.
            let billing = runtime
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .valid
                .billing;
            let ahead = BUDGET_LOOKAHEAD_SECS
                .max(2.0 * self.settings.tick.as_secs_f64() * self.clock.speed());
            let data = self.market_data();
            let running_on: Usd = instances
                .iter()
                .filter(|i| !i.state.is_final() && i.state != InstanceState::Terminating)
                .filter_map(|i| {
                    let launched = i.launched?;
                    let price = price_now(&data, &i.market, i.tier, now);
                    Some(billing.cost_of_running_on(price, launched, now, ahead))
                })
                .sum();
            if let Some(reason) = Budget(budget).ends_job(spend, running_on) {
                self.finish_job(job.id, JobState::Failed, &reason, now)
                    .await?;
                return Ok(());
            }
        }
        if let Some(deadline) = deadline
            && now >= deadline
        {
            self.finish_job(
                job.id,
                JobState::Failed,
                &format!("deadline {deadline} passed before training completed"),
                now,
            )
            .await?;
            return Ok(());
        }
        if job.state == JobState::Pending && instances.iter().any(|i| i.launched.is_some()) {
            self.store
                .set_job_state(job.id, JobState::Running, None, now)
                .await?;
        }
        if self.settings.pacing == Pacing::Modelled && fraction >= 1.0 {
            // The modelled work is done (the simulator's job ends here): nothing more is bought
            // or released while the agents finish their training.
            return Ok(());
        }
        let progress = JobProgress {
            done_work: 0.0,
            total_work: 0.0,
            started_at: job.started.unwrap_or(job.created),
        };
        // As the simulator does: the policy hears of each kind of event (warned, evicted,
        // ready), and is consulted on its own when its wake-up time has come.
        // The pending events are dropped only once every consultation went through: a tick
        // that fails (the store is down) hears of them again next time.
        let events = {
            let rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
            let pending = rt.pending.clone();
            let events: Vec<PolicyEvent> = [
                PolicyEvent::Warned(pending.warned),
                PolicyEvent::Evicted(pending.evicted),
                PolicyEvent::Ready(ready),
            ]
            .into_iter()
            .filter(|e| match e {
                PolicyEvent::Warned(ids) | PolicyEvent::Evicted(ids) | PolicyEvent::Ready(ids) => {
                    !ids.is_empty()
                }
                PolicyEvent::LaunchFailed { .. } => true,
            })
            .collect();
            events
        };
        let consult = Consult {
            job,
            runtime: &runtime,
            progress,
            fraction,
            spend,
            now,
        };
        for event in events {
            self.consult(&consult, Some(event)).await?;
        }
        // As in the simulator, an answer to an event already set the next wake-up.
        let due = runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .next_decision
            .is_none_or(|t| now >= t);
        if due {
            self.consult(&consult, None).await?;
        }
        runtime.lock().unwrap_or_else(|e| e.into_inner()).pending = PendingEvents::default();
        Ok(())
    }

    /// Consults the policy (a tick when `event` is `None`) and applies its decision. Like the
    /// simulator, it tells the policy once about each market that refused a launch; what the
    /// policy asks then is applied, and its own refusals bring the next consultation forward
    /// ([`crate::engine::after_refusal`]).
    async fn consult(
        &self,
        c: &Consult<'_>,
        event: Option<PolicyEvent>,
    ) -> Result<(), ServiceError> {
        let refused = self.consult_once(c, event.as_ref()).await?;
        for (market, reason) in refused {
            let again = self
                .consult_once(c, Some(&PolicyEvent::LaunchFailed { market, reason }))
                .await?;
            if !again.is_empty() {
                let mut rt = c.runtime.lock().unwrap_or_else(|e| e.into_inner());
                rt.next_decision = rt
                    .next_decision
                    .map(|next| crate::engine::after_refusal(c.now, next));
            }
        }
        Ok(())
    }

    async fn consult_once(
        &self,
        c: &Consult<'_>,
        event: Option<&PolicyEvent>,
    ) -> Result<Vec<(Market, String)>, ServiceError> {
        // The footprint as stored now: an earlier consult of this tick may have launched.
        let instances = self.store.instances_of_job(c.job.id).await?;
        let decision = self
            .decide(c.runtime, &instances, c.progress, c.fraction, c.now, event)
            .await?;
        self.apply(c.job, c.runtime, decision, &instances, c.spend, c.now)
            .await
    }

    /// Asks the policy. The market view hides markets in a cool-down, so the policy picks
    /// elsewhere without knowing why.
    async fn decide(
        &self,
        runtime: &Arc<std::sync::Mutex<JobRuntime>>,
        instances: &[InstanceRow],
        mut progress: JobProgress,
        fraction: f64,
        now: Timestamp,
        event: Option<&PolicyEvent>,
    ) -> Result<Decision, ServiceError> {
        let cooled: HashSet<(String, String)> = self
            .store
            .cooldowns(now)
            .await?
            .into_iter()
            .map(|c| (c.zone.to_string(), c.instance_type.to_string()))
            .collect();
        let data = self.market_data();
        let mut rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
        progress.total_work = rt.model.total_work;
        progress.done_work = fraction * rt.model.total_work;
        let startup = rt.model.startup_secs;
        let footprint: Vec<InstanceView> = instances
            .iter()
            .filter_map(|i| instance_view(i, startup, now))
            .collect();
        let model = data.model.lock().unwrap_or_else(|e| e.into_inner());
        let inner = TraceView::new(now, &data.markets, model.as_ref(), FutureReads::Refuse);
        let view = LiveView {
            inner,
            cooled: &cooled,
        };
        let JobRuntime {
            model: job_model,
            policy,
            valid,
            next_decision,
            ..
        } = &mut *rt;
        let ctx = DecisionContext {
            market: &view,
            job: job_model,
            progress,
            footprint: &footprint,
            billing: valid.billing,
        };
        let started = Instant::now();
        let decision = match event {
            None => policy.decide(&ctx),
            Some(e) => policy.on_event(&ctx, e),
        };
        self.metrics.record_decision(started.elapsed());
        drop(model);
        let decision = decision
            .map_err(|e| ServiceError::Internal(format!("policy {}: {e}", policy.name())))?;
        *next_decision = Some(crate::engine::next_decision(now, decision.wake_at));
        Ok(decision)
    }

    async fn apply(
        &self,
        job: &JobRow,
        runtime: &Arc<std::sync::Mutex<JobRuntime>>,
        decision: Decision,
        instances: &[InstanceRow],
        spend: Usd,
        now: Timestamp,
    ) -> Result<Vec<(Market, String)>, ServiceError> {
        let mut released_any = false;
        for id in &decision.release {
            if let Some(row) = instances.iter().find(|i| i.id == id.0) {
                released_any |= row.state == InstanceState::Running;
                self.terminate_instance(row, "released by the policy")
                    .await?;
            }
        }
        if released_any {
            runtime
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .modelled
                .released(now);
        }
        let (limits, budget, billing, model) = {
            let r = runtime.lock().unwrap_or_else(|e| e.into_inner());
            (
                Limits::of(&r.model, r.policy.kind()),
                r.valid.budget_usd,
                r.valid.billing,
                r.model.clone(),
            )
        };
        let rate = |m: &Market| model.rate(&m.instance_type).unwrap_or(0.0);
        // Held against the limits as the simulator counts it: launched or requested, not
        // warned, not being released.
        let mut footprint = Held::default();
        for i in instances.iter().filter(|i| {
            matches!(i.state, InstanceState::Requested | InstanceState::Running)
                && !decision.release.iter().any(|r| r.0 == i.id)
        }) {
            footprint.add(i.tier, rate(&i.market));
        }
        let mut committed = spend;
        let data = self.market_data();
        let mut held = None;
        let mut refused: Vec<(Market, String)> = Vec::new();
        // The broker-wide cap: what every job holds, counted before this decision launches.
        let cap = u64::from(self.settings.instance_cap);
        let mut held_by_all = if decision.acquire.is_empty() {
            0
        } else {
            self.store.count_live_instances().await?
        };
        for acq in &decision.acquire {
            for _ in 0..acq.count {
                if refused.iter().any(|(m, _)| *m == acq.market) {
                    break;
                }
                let tier = acq.purchase.tier();
                if limits.room(&footprint, tier, rate(&acq.market), 1) == 0 {
                    break;
                }
                if held_by_all >= cap {
                    held = Some(format!(
                        "the broker holds {held_by_all} instances across all jobs, its cap \
                         (`proteus serve --instance-cap {cap}`)"
                    ));
                    break;
                }
                let period = first_period_cost(&data, &acq.market, acq.purchase, billing, now);
                if let Some(reason) = budget.and_then(|b| Budget(b).holds_launch(committed, period))
                {
                    held = Some(reason);
                    break;
                }
                match self
                    .launch_instance(job.id, &acq.market, acq.purchase, now)
                    .await?
                {
                    Launch::Launched => {
                        footprint.add(tier, rate(&acq.market));
                        committed += period;
                        held_by_all += 1;
                    }
                    // The cloud refused this market: do not ask it again in this decision.
                    Launch::Refused(reason) => refused.push((acq.market.clone(), reason)),
                }
            }
        }
        runtime.lock().unwrap_or_else(|e| e.into_inner()).held = held;
        Ok(refused)
    }

    /// The next market time after `now` at which something happens that the control loop acts
    /// on: the cloud warns or reclaims, an instance becomes ready (modelled pacing), a policy
    /// wants to be woken, a stall or milestone of a job's work ends, a job's work completes.
    /// A driver that steps market time itself (the demo) ticks at each, so that the live
    /// broker decides at the instants the simulator does.
    pub async fn next_event_after(
        &self,
        now: Timestamp,
    ) -> Result<Option<Timestamp>, ServiceError> {
        let mut times: Vec<Timestamp> = self.cloud.next_event_after(now).into_iter().collect();
        for job in self.store.jobs(true).await? {
            let Some(runtime) = self.runtime(job.id) else {
                continue;
            };
            let instances = self.store.instances_of_job(job.id).await?;
            let rt = runtime.lock().unwrap_or_else(|e| e.into_inner());
            times.extend(rt.next_decision);
            times.extend(rt.modelled.next_change(now));
            if self.settings.pacing == Pacing::Modelled {
                let startup = rt.model.startup_secs;
                times.extend(
                    instances
                        .iter()
                        .filter(|i| {
                            matches!(i.state, InstanceState::Running | InstanceState::Warned)
                                && i.ready.is_none()
                        })
                        .filter_map(|i| i.launched.map(|l| l.plus_secs(startup))),
                );
                let spans: Vec<WorkingSpan> = instances
                    .iter()
                    .filter_map(|i| WorkingSpan::of_instance(i, &rt.model))
                    .collect();
                let working = rt.modelled.working_rate(&spans, &rt.model.stages, now);
                times.extend(rt.modelled.completion(now, working, rt.model.total_work));
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
        let token = crate::api::auth::new_token("pa_");
        let row = InstanceRow::intent(
            id,
            job,
            market.clone(),
            purchase,
            crate::api::auth::hash_token(&token),
            now,
        );
        self.store.insert_instance(&row).await?;
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
            agent_token: token.to_string(),
        };
        match self.cloud.launch(&spec).await {
            Ok(ci) => {
                crate::failpoint::hit("launch-after-cloud");
                self.store
                    .mark_launched(&row.id, &ci.cloud_id, ci.launched.unwrap_or(now))
                    .await?;
                super::metrics::Metrics::inc(&self.metrics.launches);
                self.remember_agent(&ci.cloud_id, row);
                let what = match row.bid {
                    Some(b) => format!("{} spot, bid {b} ({})", row.market, ci.cloud_id),
                    None => format!("{} on-demand ({})", row.market, ci.cloud_id),
                };
                self.store
                    .add_event(Some(row.job_id), Some(&row.id), now, "launched", &what)
                    .await?;
                self.start_local_agent(row, &ci.cloud_id, token, None)
                    .await?;
                Ok(Launch::Launched)
            }
            Err(e) => {
                self.store
                    .mark_launch_failed(&row.id, &e.to_string(), now)
                    .await?;
                super::metrics::Metrics::inc(&self.metrics.launch_failures);
                let mut detail = format!("{}: {}: {e}", row.market, e.reason());
                if e.cools_down_market() {
                    let until = now.plus_secs(self.settings.cooldown_secs);
                    self.store
                        .set_cooldown(&Cooldown {
                            zone: row.market.zone.clone(),
                            instance_type: row.market.instance_type.clone(),
                            until,
                            reason: e.reason().to_string(),
                        })
                        .await?;
                    detail.push_str(&format!("; market skipped until {until}"));
                }
                tracing::warn!(instance = %row.id, %detail, "launch failed");
                self.store
                    .add_event(
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
        recorded: Option<std::net::SocketAddr>,
    ) -> Result<(), ServiceError> {
        let Some(launcher) = &self.launcher else {
            return Ok(());
        };
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
        match launcher.start(&row.id, facts, token, recorded).await {
            Ok(addr) => {
                self.store
                    .set_metadata_addr(&row.id, &addr.to_string())
                    .await?
            }
            Err(e) => {
                tracing::warn!(instance = %row.id, error = %e, "cannot start the local agent");
                self.store
                    .add_event(
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
            None => {
                // Never launched: nothing to terminate in the cloud.
                self.store
                    .mark_ended(&row.id, self.clock.now(), reason, false, None)
                    .await?;
            }
            Some(cloud_id) => {
                self.store.mark_terminating(&row.id, reason).await?;
                crate::failpoint::hit("terminate-after-intent");
                super::metrics::Metrics::inc(&self.metrics.terminations);
                if let Err(e) = self.cloud.terminate(std::slice::from_ref(cloud_id)).await {
                    tracing::warn!(instance = %row.id, error = %e, "terminate failed; reconciliation will retry");
                }
            }
        }
        Ok(())
    }

    /// Asks the cloud to end many instances (a job's end), recording the requests first: one
    /// store update for them all and one cloud call per [`TERMINATE_BATCH`], not one of each
    /// per instance.
    async fn terminate_all(&self, rows: &[InstanceRow], reason: &str) -> Result<(), ServiceError> {
        let live: Vec<&InstanceRow> = rows.iter().filter(|r| !r.state.is_final()).collect();
        for row in live.iter().filter(|r| r.cloud_id.is_none()) {
            // Never launched: nothing to terminate in the cloud.
            self.store
                .mark_ended(&row.id, self.clock.now(), reason, false, None)
                .await?;
        }
        let launched: Vec<(&str, &String)> = live
            .iter()
            .filter_map(|r| r.cloud_id.as_ref().map(|c| (r.id.as_str(), c)))
            .collect();
        if launched.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = launched.iter().map(|(id, _)| *id).collect();
        self.store.mark_terminating_many(&ids, reason).await?;
        crate::failpoint::hit("terminate-after-intent");
        let cloud_ids: Vec<String> = launched.iter().map(|(_, c)| (*c).clone()).collect();
        for batch in cloud_ids.chunks(TERMINATE_BATCH) {
            self.metrics.terminations.inc_by(batch.len() as u64);
            if let Err(e) = self.cloud.terminate(batch).await {
                tracing::warn!(instances = batch.len(), error = %e, "terminate failed; reconciliation will retry");
            }
        }
        Ok(())
    }

    /// Ends a job: records its final state, stops training, releases every instance.
    pub async fn finish_job(
        &self,
        job: JobId,
        state: JobState,
        reason: &str,
        now: Timestamp,
    ) -> Result<(), ServiceError> {
        if !self
            .store
            .set_job_state(job, state, Some(reason), now)
            .await?
        {
            return Ok(());
        }
        if state == JobState::Cancelled {
            crate::failpoint::hit("cancel-after-record");
        }
        tracing::info!(%job, state = %state, reason, "job finished");
        self.store
            .add_event(Some(job), None, now, &format!("job_{state}"), reason)
            .await?;
        if let Some(control) = self.control.get(job) {
            control.update(|c| c.cancel(reason));
        }
        let rows = self.store.instances_of_job(job).await?;
        self.terminate_all(&rows, &format!("job {state}")).await?;
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
        self.store.replace_ledger_lines_many(job, &lines).await?;
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
                    .replace_ledger_lines(row.job_id, &row.id, &lines)
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
    Launched,
    /// The cloud refused it; why, as recorded in the job's events.
    Refused(String),
}

/// One tick's consultations of a job's policy share these.
struct Consult<'a> {
    job: &'a JobRow,
    runtime: &'a Arc<std::sync::Mutex<JobRuntime>>,
    progress: JobProgress,
    fraction: f64,
    spend: Usd,
    now: Timestamp,
}

/// How the policy sees one stored instance; final ones are not part of the footprint. It is
/// running once it is recorded ready (see [`Broker::record_readiness`]).
fn instance_view(i: &InstanceRow, startup_secs: f64, now: Timestamp) -> Option<InstanceView> {
    let purchase = match i.bid {
        Some(bid) => Purchase::Spot { bid },
        None => Purchase::OnDemand,
    };
    let launched_at = i.launched.unwrap_or(i.requested);
    let state = match i.state {
        InstanceState::Terminated | InstanceState::Failed | InstanceState::Terminating => {
            return None;
        }
        InstanceState::Warned => PolicyInstanceState::Warned {
            terminate_at: i.warned.unwrap_or(launched_at).plus_secs(NOTICE_SECS),
        },
        InstanceState::Requested | InstanceState::Running => {
            if i.ready.is_some_and(|r| r <= now) {
                PolicyInstanceState::Running
            } else {
                PolicyInstanceState::Starting {
                    ready_at: launched_at.plus_secs(startup_secs),
                }
            }
        }
    };
    Some(InstanceView {
        id: InstanceId(i.id.clone()),
        market: i.market.clone(),
        purchase,
        launched_at,
        state,
    })
}

/// What launching one instance commits the job to before it can be released: one billing
/// period at the current price.
fn first_period_cost(
    data: &MarketData,
    market: &Market,
    purchase: Purchase,
    billing: BillingModel,
    now: Timestamp,
) -> Usd {
    price_now(data, market, purchase.tier(), now).for_hours(billing.billed_hours(0.0))
}

/// What an hour of `market` on `tier` costs at `now`: its on-demand price, or the spot price.
fn price_now(data: &MarketData, market: &Market, tier: Tier, now: Timestamp) -> UsdPerHour {
    match tier {
        Tier::Reliable => data.markets.on_demand(market),
        Tier::Transient => data.history.get(market).and_then(|s| s.price_at(now)),
    }
    .unwrap_or(UsdPerHour::ZERO)
}

/// Most cloud events one tick applies; the rest wait for the next tick (which then comes at
/// once), so that a job ending many instances together never holds up the other jobs' ticks.
const CLOUD_EVENTS_PER_TICK: usize = 256;

/// Most instances one terminate call names (EC2 takes up to 1000 per TerminateInstances).
const TERMINATE_BATCH: usize = 500;

/// How far ahead (market seconds, at least two ticks) a job's budget is checked against the
/// billing periods its instances are about to start.
const BUDGET_LOOKAHEAD_SECS: f64 = 60.0;

/// The trace view minus markets the cloud refused recently.
struct LiveView<'a> {
    inner: TraceView<'a>,
    cooled: &'a HashSet<(String, String)>,
}

impl LiveView<'_> {
    fn cooled(&self, m: &Market) -> bool {
        self.cooled
            .contains(&(m.zone.to_string(), m.instance_type.to_string()))
    }
}

impl MarketView for LiveView<'_> {
    fn now(&self) -> Timestamp {
        self.inner.now()
    }
    fn markets(&self) -> Vec<&Market> {
        self.inner
            .markets()
            .into_iter()
            .filter(|m| !self.cooled(m))
            .collect()
    }
    fn spot_price(&self, market: &Market) -> Option<UsdPerHour> {
        if self.cooled(market) {
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

/// [`Pacing::Modelled`]: counts the work since the last count and applies this instant's
/// warnings and readiness to the job's [`JobWork`](crate::engine::progress::JobWork), in the
/// simulator's order. Between two counts the footprint is as the last count left it (the demo
/// steps market time onto every change, see [`Broker::next_event_after`]), so the rate at the
/// last count holds all the way.
fn advance_modelled_work(
    rt: &mut JobRuntime,
    instances: &[InstanceRow],
    ready: &[InstanceId],
    now: Timestamp,
) {
    let since = rt.modelled_at.unwrap_or(now);
    rt.modelled_at = Some(now);
    let spans: Vec<WorkingSpan> = instances
        .iter()
        .filter_map(|i| WorkingSpan::of_instance(i, &rt.model))
        .collect();
    let working = rt.modelled.working_rate(&spans, &rt.model.stages, since);
    let total = rt.model.total_work;
    // Done when the completion foreseen at the last count has come, as in the simulator.
    let completion = rt.modelled.completion(since, working, total);
    rt.modelled.accrue(since, now, working, working);
    if completion.is_some_and(|c| now >= c) || rt.modelled.is_complete(total) {
        rt.modelled.complete(total);
        return;
    }
    let mut membership_changed = !ready.is_empty();
    for id in &rt.pending.warned {
        if let Some(row) = instances.iter().find(|i| i.id == id.0) {
            let rate = rt.model.rate(&row.market.instance_type).unwrap_or(0.0);
            membership_changed |= rt.modelled.warned(now, row.ready, rate);
        }
    }
    if !rt.pending.warned.is_empty() {
        rt.modelled.after_warnings();
    }
    if membership_changed {
        rt.modelled.rebalance(now);
    }
    let live =
        |i: &&InstanceRow| matches!(i.state, InstanceState::Requested | InstanceState::Running);
    let any_ready = instances.iter().filter(live).any(|i| i.ready.is_some());
    let any_starting = instances.iter().filter(live).any(|i| i.ready.is_none());
    rt.modelled.milestones(now, any_ready, any_starting);
}
