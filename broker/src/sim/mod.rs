//! The trace-driven simulator: a job's work model and a policy against a spot price trace.
//!
//! One run ([`run`]) starts the job at a time inside the trace, asks the policy (through the same
//! [`Policy`] trait the live scheduler uses, with a [`crate::engine::view::TraceView`] that refuses reads after
//! the decision time), and replays the market: instances start (billed, not working, for the
//! job's start-up time), work at their type's rate, are warned and evicted when the world says
//! so ([`world`]), and lose work according to the eviction-cost model the policy runs the job
//! under. When the work is done every instance is terminated and the whole life of every
//! instance is billed with [`crate::billing`]. [`sweep`] runs several policies over the same
//! start times and summarises.
//!
//! Simplifications, all stated: the market has unlimited capacity at the trace's price (our
//! purchases do not move it); the job's throughput is the sum of its instances' rates (linear
//! scaling up to `max_instances`); an AgileML eviction loses the evicted instance's work since
//! its last background sync, and every membership change pauses all workers for the job's
//! rebalance time; a checkpoint/restart job stops entirely on any eviction until replacements
//! have started and the checkpoint is reloaded.

pub mod inputs;
pub mod sweep;
pub mod world;

use crate::billing::{BillingError, BillingModel, EndedBy, PriceSource};
use crate::engine::limits::{Held, Limits};
use crate::engine::progress::JobWork;
use crate::engine::view::{FutureReads, TraceMarkets, TraceView};
use crate::engine::work::WorkingSpan;
use crate::job::JobModel;
use crate::market::{Market, Timestamp, Usd, UsdPerHour};
use crate::market_model::{MarketModel, Observation};
use crate::policy::{
    Decision, DecisionContext, InstanceId, InstanceState, InstanceView, JobProgress, Policy,
    PolicyError, PolicyEvent, PolicyKind, Purchase, Tier,
};
use crate::prices::PriceHistory;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use thiserror::Error;
use world::{HazardTruth, HazardWorld, MaxTree};

/// Who decides when an instance is taken away.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "world", rename_all = "kebab-case")]
pub enum World {
    /// 2015: at the first price change above the bid.
    Price,
    /// Today: per-pool interruption events (see [`HazardTruth`]), or a price above the bid.
    Hazard(HazardTruth),
}

/// Everything that stays the same across the runs of a sweep.
pub struct Scenario {
    markets: TraceMarkets,
    trees: HashMap<Market, MaxTree>,
    pub job: JobModel,
    pub billing: BillingModel,
    pub world: World,
    /// The market model the policies consult; every run gets its own copy.
    model: Box<dyn MarketModel>,
    /// Seconds between the termination notice and the termination.
    pub warning_secs: f64,
    /// The last price change in the trace: nothing is known after it.
    end: Timestamp,
    start_of_trace: Timestamp,
}

impl Scenario {
    pub fn new(
        history: Arc<PriceHistory>,
        job: JobModel,
        billing: BillingModel,
        world: World,
        model: Box<dyn MarketModel>,
    ) -> Result<Self, SimError> {
        let (start_of_trace, end) = history.span().ok_or(SimError::EmptyTrace)?;
        let trees = history
            .series()
            .map(|s| (s.market().clone(), MaxTree::new(s.prices())))
            .collect();
        Ok(Scenario {
            markets: TraceMarkets::new(history),
            trees,
            job,
            billing,
            world,
            model,
            warning_secs: crate::engine::NOTICE_SECS,
            end,
            start_of_trace,
        })
    }

    pub fn history(&self) -> &Arc<PriceHistory> {
        self.markets.history()
    }

    /// The span of the trace: first and last price change.
    pub fn span(&self) -> (Timestamp, Timestamp) {
        (self.start_of_trace, self.end)
    }

    pub fn model(&self) -> &dyn MarketModel {
        self.model.as_ref()
    }
}

/// Per-run switches.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Seeds the interruption world (hazard) and anything random in a run.
    pub seed: u64,
    /// Panic instead of refusing when a policy reads the future (tests).
    pub future_reads: FutureReads,
    /// Keep every decision in the result (tests, debugging).
    pub record_decisions: bool,
}

/// Why a run could not complete.
#[derive(Debug, Error)]
pub enum SimError {
    #[error("the trace has no prices")]
    EmptyTrace,
    #[error(
        "the trace ends at {trace_end}, before the job started at {start} finished \
         ({done:.0} of {total:.0} units done): use an earlier start or a longer trace"
    )]
    TraceTooShort {
        start: Timestamp,
        trace_end: Timestamp,
        done: f64,
        total: f64,
    },
    #[error("start time {start} is outside the trace ({first} to {last})")]
    StartOutsideTrace {
        start: Timestamp,
        first: Timestamp,
        last: Timestamp,
    },
    #[error("policy `{policy}` at {at}: {source}")]
    Policy {
        policy: String,
        at: Timestamp,
        #[source]
        source: PolicyError,
    },
    #[error("{0}")]
    PolicyFile(String),
    #[error("billing: {0}")]
    Billing(#[from] BillingError),
    #[error("no spot price series for {0}")]
    NoSpotPrice(String),
    #[error("no on-demand price for {0}, which the policy bought on-demand")]
    NoOnDemandPrice(String),
    #[error(
        "the simulation did not finish after {0} steps (a policy that never acquires anything?)"
    )]
    Runaway(u64),
}

/// The outcome of one run.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub policy: String,
    pub kind: PolicyKind,
    pub start: Timestamp,
    pub end: Timestamp,
    pub runtime_hours: f64,
    pub cost_usd: Usd,
    /// Instances the provider took away.
    pub evictions: u32,
    /// Distinct times at which the provider took instances away.
    pub eviction_events: u32,
    pub launches: u32,
    /// Launches refused (bid below the price, no such market).
    pub failed_launches: u32,
    /// Times the policy was asked (ticks and events).
    pub decisions_made: u32,
    pub instance_hours_reliable: f64,
    pub instance_hours_transient: f64,
    /// Instance-hours inside free partial hours (`hourly-2015`, provider-ended).
    pub free_instance_hours: f64,
    /// What those free hours would have been charged had the user ended them.
    pub free_value_usd: Usd,
    /// Units of work lost to evictions (and redone).
    pub lost_work: f64,
    /// Units the instances could have done had they worked every second they ran
    /// (Σ rate × instance-hours); `total_work / capacity` is the useful fraction.
    pub capacity_units: f64,
    /// Capacity (rate × hours) inside charged billing periods, as billed (a charged partial
    /// hour counts in full): `cost / paid_capacity_units` is the price paid per unit-hour.
    pub paid_capacity_units: f64,
    /// Capacity used inside free periods.
    pub free_capacity_units: f64,
    /// Where capacity (rate × instance-hours) did no useful work, in units.
    pub overheads: Overheads,
    /// Cost per type, USD.
    pub cost_by_type: BTreeMap<String, Usd>,
    /// Instance-hours per type.
    pub hours_by_type: BTreeMap<String, f64>,
    /// [`crate::engine::digest`] of the run's launches and how they ended: the live broker
    /// prints the same for the same decisions.
    pub decisions_digest: String,
    /// Every decision with its time (only with [`RunOptions::record_decisions`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<(Timestamp, Decision)>,
    /// Every instance's life (only with [`RunOptions::record_decisions`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<InstanceRecord>,
}

/// Capacity that did no useful work, in units (rate × hours).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Overheads {
    /// Starting instances (billed, not yet working).
    pub startup: f64,
    /// Warned instances handing over their work before termination.
    pub warned: f64,
    /// Ready instances paused: rebalancing, writing checkpoints, waiting for a restart.
    pub stalled: f64,
    /// Reliable instances holding only backup shards (AgileML stage 3).
    pub idle: f64,
    /// Billed but unused: the rest of each charged hour after a user ended the instance.
    pub unused_billed: f64,
}

/// One instance's life, for calibration and debugging: what the market model expected at
/// launch (spot only) and what happened.
#[derive(Debug, Clone, Serialize)]
pub struct InstanceRecord {
    pub market: String,
    pub tier: Tier,
    pub bid: Option<UsdPerHour>,
    pub launch: Timestamp,
    pub end: Timestamp,
    pub ended_by: EndedBy,
    pub price_at_launch: Option<UsdPerHour>,
    /// The model's eviction probability within its horizon at launch.
    pub predicted_probability: Option<f64>,
    /// The model's expected running time within its horizon at launch, seconds.
    pub predicted_secs: Option<f64>,
    pub cost_usd: Usd,
}

/// Simulates `policy` running the scenario's job from `start`.
pub fn run(
    scenario: &Scenario,
    policy: &mut dyn Policy,
    start: Timestamp,
    options: &RunOptions,
) -> Result<RunResult, SimError> {
    let (first, last) = scenario.span();
    if start < first || start >= last {
        return Err(SimError::StartOutsideTrace { start, first, last });
    }
    Engine::new(scenario, policy, start, options).run()
}

/// The simulator's record of an instance beside the policy's [`InstanceView`].
#[derive(Debug, Clone)]
struct SimInstance {
    predicted: Option<(f64, f64)>,
    rate: f64,
    ready_at: Timestamp,
    ready: bool,
    /// When the world will warn it (evict it), if ever within the trace.
    warn_at: Option<Timestamp>,
    terminate_at: Option<Timestamp>,
}

/// An instance that has ended, to be billed.
struct Ended {
    /// The model's estimate at launch (probability, seconds), when recording.
    predicted: Option<(f64, f64)>,
    market: Market,
    purchase: Purchase,
    launch: Timestamp,
    end: Timestamp,
    by: EndedBy,
    rate: f64,
}

const MAX_STEPS: u64 = 5_000_000;

struct Engine<'a> {
    sc: &'a Scenario,
    policy: &'a mut dyn Policy,
    options: &'a RunOptions,
    model: Box<dyn MarketModel>,
    hazard: Option<HazardWorld>,
    rng: ChaCha8Rng,
    start: Timestamp,
    now: Timestamp,
    views: Vec<InstanceView>,
    sims: Vec<SimInstance>,
    next_id: u64,
    /// Work done, lost, stalls: the engine's one model of it.
    work: JobWork,
    next_decision: Timestamp,
    ended: Vec<Ended>,
    evictions: u32,
    eviction_events: u32,
    launches: u32,
    failed_launches: u32,
    decisions_made: u32,
    overheads: Overheads,
    decisions: Vec<(Timestamp, Decision)>,
}

impl<'a> Engine<'a> {
    fn new(
        sc: &'a Scenario,
        policy: &'a mut dyn Policy,
        start: Timestamp,
        options: &'a RunOptions,
    ) -> Self {
        let cost_model = policy.eviction_cost(&sc.job);
        let hazard = match &sc.world {
            World::Price => None,
            World::Hazard(truth) => Some(HazardWorld::new(truth.clone(), options.seed, start)),
        };
        Engine {
            sc,
            policy,
            options,
            model: sc.model.boxed_clone(),
            hazard,
            rng: ChaCha8Rng::seed_from_u64(options.seed ^ 0x5eed),
            start,
            now: start,
            views: Vec::new(),
            sims: Vec::new(),
            next_id: 0,
            work: JobWork::new(cost_model, start),
            next_decision: start,
            ended: Vec::new(),
            evictions: 0,
            eviction_events: 0,
            launches: 0,
            failed_launches: 0,
            decisions_made: 0,
            overheads: Overheads::default(),
            decisions: Vec::new(),
        }
    }

    fn run(mut self) -> Result<RunResult, SimError> {
        self.consult(None)?;
        let total = self.sc.job.total_work;
        let mut steps = 0u64;
        let done_at = loop {
            steps += 1;
            if steps > MAX_STEPS {
                return Err(SimError::Runaway(MAX_STEPS));
            }
            let (t, completion) = self.next_event_time();
            if t > self.sc.end {
                return Err(SimError::TraceTooShort {
                    start: self.start,
                    trace_end: self.sc.end,
                    done: self.work.done(),
                    total,
                });
            }
            self.advance(t);
            self.now = t;
            if completion.is_some_and(|c| t >= c) || self.work.is_complete(total) {
                self.work.complete(total);
                break t;
            }
            let (evicted, warned, ready) = self.process_events();
            if !warned.is_empty() {
                self.consult(Some(PolicyEvent::Warned(warned)))?;
            }
            if !evicted.is_empty() {
                self.consult(Some(PolicyEvent::Evicted(evicted)))?;
            }
            if !ready.is_empty() {
                self.consult(Some(PolicyEvent::Ready(ready)))?;
            }
            if self.now >= self.next_decision {
                self.consult(None)?;
            }
        };
        self.finish(done_at)
    }

    /// Units per hour the footprint is doing right now (0 while down; stalls are applied by
    /// the caller).
    fn working_rate(&self) -> f64 {
        self.rates().0
    }

    /// (working rate, rate of every ready instance that is not warned). The working rate is
    /// the engine's ([`JobWork::working_rate`]).
    fn rates(&self) -> (f64, f64) {
        let spans: Vec<WorkingSpan> = self
            .views
            .iter()
            .zip(&self.sims)
            .filter(|(_, s)| s.ready && s.terminate_at.is_none())
            .map(|(v, s)| WorkingSpan {
                tier: v.tier(),
                units_per_hour: s.rate,
                from: self.now,
                until: None,
            })
            .collect();
        let ready = spans.iter().map(|s| s.units_per_hour).sum();
        (
            self.work
                .working_rate(&spans, &self.sc.job.stages, self.now),
            ready,
        )
    }

    /// The next time anything happens, and when the job would complete at the current rate.
    fn next_event_time(&self) -> (Timestamp, Option<Timestamp>) {
        let mut t = self.next_decision;
        for s in &self.sims {
            if !s.ready {
                t = t.min(s.ready_at);
            }
            match s.terminate_at {
                Some(end) => t = t.min(end),
                None => {
                    if let Some(w) = s.warn_at {
                        t = t.min(w);
                    }
                }
            }
        }
        if let Some(x) = self.work.next_change(self.now) {
            t = t.min(x);
        }
        let completion =
            self.work
                .completion(self.now, self.working_rate(), self.sc.job.total_work);
        if let Some(c) = completion {
            t = t.min(c);
        }
        (t.max(self.now), completion)
    }

    /// Accrues work from `now` to `t` (the rate is constant in between by construction).
    fn advance(&mut self, t: Timestamp) {
        let (working, ready) = self.rates();
        let idle = self.work.accrue(self.now, t, working, ready);
        self.overheads.stalled += idle.stalled;
        self.overheads.idle += idle.backups_only;
    }

    fn index_of(&self, id: &InstanceId) -> Option<usize> {
        self.views.iter().position(|v| &v.id == id)
    }

    /// Applies what happens at `now`: terminations, warnings, instances becoming ready,
    /// checkpoint and restart milestones. Returns the ids evicted, warned and made ready.
    fn process_events(&mut self) -> (Vec<InstanceId>, Vec<InstanceId>, Vec<InstanceId>) {
        let now = self.now;
        let (mut evicted, mut warned, mut ready) = (Vec::new(), Vec::new(), Vec::new());
        // Terminations of warned instances.
        let mut i = 0;
        while i < self.views.len() {
            if self.sims[i].terminate_at.is_some_and(|e| e <= now) {
                evicted.push(self.views[i].id.clone());
                self.end_instance(i, EndedBy::Provider);
            } else {
                i += 1;
            }
        }
        // Warnings.
        let mut membership_changed = false;
        for i in 0..self.views.len() {
            let s = &self.sims[i];
            if s.terminate_at.is_some() || s.warn_at.is_none_or(|w| w > now) {
                continue;
            }
            let terminate_at =
                Timestamp::from_millis(now.millis() + (self.sc.warning_secs * 1000.0) as i64);
            self.sims[i].terminate_at = Some(terminate_at);
            self.views[i].state = InstanceState::Warned { terminate_at };
            warned.push(self.views[i].id.clone());
            self.evictions += 1;
            let market = self.views[i].market.clone();
            self.model.observe(Observation::Interrupted {
                market: &market,
                at: now,
            });
            let s = &self.sims[i];
            membership_changed |= self.work.warned(now, s.ready.then_some(s.ready_at), s.rate);
        }
        if !warned.is_empty() {
            self.eviction_events += 1;
            self.work.after_warnings();
        }
        // Instances becoming ready.
        for i in 0..self.views.len() {
            let s = &mut self.sims[i];
            if !s.ready && s.ready_at <= now {
                s.ready = true;
                if s.terminate_at.is_none() {
                    self.views[i].state = InstanceState::Running;
                }
                ready.push(self.views[i].id.clone());
                membership_changed = true;
            }
        }
        if membership_changed {
            self.work.rebalance(now);
        }
        let any_ready = self
            .sims
            .iter()
            .any(|s| s.ready && s.terminate_at.is_none());
        let any_starting = self
            .sims
            .iter()
            .any(|s| !s.ready && s.terminate_at.is_none());
        self.work.milestones(now, any_ready, any_starting);
        (evicted, warned, ready)
    }

    fn end_instance(&mut self, i: usize, by: EndedBy) {
        let v = self.views.remove(i);
        let s = self.sims.remove(i);
        let hours = self.now.secs_since(v.launched_at) / 3600.0;
        self.overheads.startup += s.rate * (hours.min(self.sc.job.startup_secs / 3600.0));
        if let Some(end) = s.terminate_at {
            let warned_at =
                Timestamp::from_millis(end.millis() - (self.sc.warning_secs * 1000.0) as i64)
                    .max(s.ready_at);
            self.overheads.warned += s.rate * (self.now.secs_since(warned_at) / 3600.0).max(0.0);
        }
        self.model.observe(Observation::Ran {
            market: &v.market,
            hours,
        });
        self.ended.push(Ended {
            predicted: s.predicted,
            market: v.market,
            purchase: v.purchase,
            launch: v.launched_at,
            end: self.now,
            by,
            rate: s.rate,
        });
    }

    /// Asks the policy (a tick when `event` is `None`) and applies its decision.
    fn consult(&mut self, event: Option<PolicyEvent>) -> Result<(), SimError> {
        let decision = self.ask(event.as_ref())?;
        let failures = self.apply(decision);
        // Tell the policy once about launches that failed; what it asks then is applied, and
        // its own failures are only counted (a policy must not loop on an impossible launch),
        // but bring the next consultation forward (the live scheduler does the same).
        for (market, reason) in failures {
            let d = self.ask(Some(&PolicyEvent::LaunchFailed { market, reason }))?;
            if !self.apply(d).is_empty() {
                self.next_decision = crate::engine::after_refusal(self.now, self.next_decision);
            }
        }
        Ok(())
    }

    fn ask(&mut self, event: Option<&PolicyEvent>) -> Result<Decision, SimError> {
        let view = TraceView::new(
            self.now,
            &self.sc.markets,
            self.model.as_ref(),
            self.options.future_reads,
        );
        let ctx = DecisionContext {
            market: &view,
            job: &self.sc.job,
            progress: JobProgress {
                done_work: self.work.done(),
                total_work: self.sc.job.total_work,
                started_at: self.start,
            },
            footprint: &self.views,
            billing: self.sc.billing,
        };
        self.decisions_made += 1;
        let result = match event {
            None => self.policy.decide(&ctx),
            Some(e) => self.policy.on_event(&ctx, e),
        };
        let decision = result.map_err(|source| SimError::Policy {
            policy: self.policy.name().to_string(),
            at: self.now,
            source,
        })?;
        if self.options.record_decisions {
            self.decisions.push((self.now, decision.clone()));
        }
        Ok(decision)
    }

    /// What the footprint holds against its limits: every instance not warned.
    fn held(&self) -> Held {
        let mut held = Held::default();
        for (v, s) in self.views.iter().zip(&self.sims) {
            if s.terminate_at.is_none() {
                held.add(v.tier(), s.rate);
            }
        }
        held
    }

    /// Releases and launches what the decision says; returns the launches that failed.
    fn apply(&mut self, decision: Decision) -> Vec<(Market, String)> {
        let now = self.now;
        let mut released_any = false;
        for id in &decision.release {
            if let Some(i) = self
                .index_of(id)
                .filter(|&i| self.sims[i].terminate_at.is_none())
            {
                self.end_instance(i, EndedBy::User);
                released_any = true;
            }
        }
        if released_any {
            self.work.released(now);
        }
        let mut failures = Vec::new();
        let limits = Limits::of(&self.sc.job, self.policy.kind());
        for acq in &decision.acquire {
            let held = self.held();
            let rate = self.sc.job.rate(&acq.market.instance_type);
            let count = limits.room(&held, acq.tier(), rate.unwrap_or(0.0), acq.count) as usize;
            if count == 0 {
                continue;
            }
            let Some(rate) = rate else {
                self.failed_launches += 1;
                failures.push((
                    acq.market.clone(),
                    format!("the job does not run on {}", acq.market.instance_type),
                ));
                continue;
            };
            let series = self.sc.markets.series(&acq.market);
            let price = series.and_then(|s| s.price_at(now));
            let warn_at = match acq.purchase {
                Purchase::OnDemand => {
                    if self.sc.markets.on_demand(&acq.market).is_none() {
                        self.failed_launches += 1;
                        failures.push((acq.market.clone(), "no on-demand price".into()));
                        continue;
                    }
                    None
                }
                Purchase::Spot { bid } => {
                    let (Some(series), Some(price)) = (series, price) else {
                        self.failed_launches += 1;
                        failures.push((acq.market.clone(), "no spot price in this market".into()));
                        continue;
                    };
                    if price > bid {
                        self.failed_launches += 1;
                        failures.push((
                            acq.market.clone(),
                            format!("bid {bid} is below the price {price}"),
                        ));
                        continue;
                    }
                    let Some(tree) = self.sc.trees.get(&acq.market) else {
                        self.failed_launches += 1;
                        failures.push((acq.market.clone(), "no spot price in this market".into()));
                        continue;
                    };
                    world::first_above(series, tree, now, bid.get())
                }
            };
            for _ in 0..count {
                let hazard_at = match (&mut self.hazard, acq.purchase) {
                    (Some(h), Purchase::Spot { .. }) => {
                        h.interruption(&acq.market, now, self.sc.end, &mut self.rng)
                    }
                    _ => None,
                };
                let warn = match (warn_at, hazard_at) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                self.next_id += 1;
                let ready_at = Timestamp::from_millis(
                    now.millis() + (self.sc.job.startup_secs * 1000.0) as i64,
                );
                self.views.push(InstanceView {
                    id: InstanceId(format!("sim-{}", self.next_id)),
                    market: acq.market.clone(),
                    purchase: acq.purchase,
                    launched_at: now,
                    state: InstanceState::Starting { ready_at },
                });
                let predicted = match (self.options.record_decisions, acq.purchase, price) {
                    (true, Purchase::Spot { bid }, Some(p)) => self
                        .model
                        .eviction(&acq.market, bid.get() - p.get(), 3600.0, now)
                        .ok()
                        .map(|e| (e.probability, e.expected_secs)),
                    _ => None,
                };
                self.sims.push(SimInstance {
                    predicted,
                    rate,
                    ready_at,
                    ready: false,
                    warn_at: warn,
                    terminate_at: None,
                });
                self.launches += 1;
            }
        }
        self.next_decision = crate::engine::next_decision(now, decision.wake_at);
        failures
    }

    fn finish(mut self, done_at: Timestamp) -> Result<RunResult, SimError> {
        self.now = done_at;
        while !self.views.is_empty() {
            // The job is done and releases what it holds. A warned instance among them was
            // reclaimed by the provider all the same (it is an eviction in every report), and
            // is billed under the provider-ended rule, as the live broker does.
            let by = if self.sims[0].terminate_at.is_some() {
                EndedBy::Provider
            } else {
                EndedBy::User
            };
            self.end_instance(0, by);
        }
        let mut r = RunResult {
            policy: self.policy.name().to_string(),
            kind: self.policy.kind(),
            start: self.start,
            end: done_at,
            runtime_hours: done_at.secs_since(self.start) / 3600.0,
            cost_usd: Usd::ZERO,
            evictions: self.evictions,
            eviction_events: self.eviction_events,
            launches: self.launches,
            failed_launches: self.failed_launches,
            decisions_made: self.decisions_made,
            instance_hours_reliable: 0.0,
            instance_hours_transient: 0.0,
            free_instance_hours: 0.0,
            free_value_usd: Usd::ZERO,
            lost_work: self.work.lost(),
            capacity_units: 0.0,
            paid_capacity_units: 0.0,
            free_capacity_units: 0.0,
            overheads: self.overheads,
            cost_by_type: BTreeMap::new(),
            hours_by_type: BTreeMap::new(),
            decisions_digest: crate::engine::digest::decisions_digest(self.ended.iter().map(|e| {
                crate::engine::digest::Launched {
                    at: e.launch,
                    market: &e.market,
                    tier: e.purchase.tier(),
                    bid: e.purchase.bid().map(|b| b.get()),
                    ended: Some(e.end),
                    ended_by_provider: e.by == EndedBy::Provider,
                }
            })),
            decisions: std::mem::take(&mut self.decisions),
            instances: Vec::new(),
        };
        for e in &self.ended {
            let source = match e.purchase {
                Purchase::OnDemand => PriceSource::Fixed(
                    self.sc
                        .markets
                        .on_demand(&e.market)
                        .ok_or_else(|| SimError::NoOnDemandPrice(e.market.to_string()))?,
                ),
                // Spot launches are refused in markets without a series, so this always exists.
                Purchase::Spot { .. } => PriceSource::Spot(
                    self.sc
                        .markets
                        .series(&e.market)
                        .ok_or_else(|| SimError::NoSpotPrice(e.market.to_string()))?,
                ),
            };
            let items = self.sc.billing.bill(e.launch, e.end, e.by, source)?;
            let hours = e.end.secs_since(e.launch) / 3600.0;
            let cost: Usd = items.iter().map(|i| i.amount_usd).sum();
            for item in &items {
                if item.free {
                    r.free_instance_hours += item.used_hours();
                    // The free period is an hour (only `hourly-2015` has them).
                    r.free_value_usd += item.price_usd_per_hour.for_hours(1.0);
                    r.free_capacity_units += e.rate * item.used_hours();
                } else {
                    r.paid_capacity_units += e.rate * item.billed_seconds / 3600.0;
                }
            }
            r.cost_usd += cost;
            match e.purchase.tier() {
                Tier::Reliable => r.instance_hours_reliable += hours,
                Tier::Transient => r.instance_hours_transient += hours,
            }
            r.capacity_units += e.rate * hours;
            *r.cost_by_type
                .entry(e.market.instance_type.to_string())
                .or_default() += cost;
            if self.options.record_decisions {
                r.instances.push(InstanceRecord {
                    market: e.market.to_string(),
                    tier: e.purchase.tier(),
                    bid: e.purchase.bid(),
                    launch: e.launch,
                    end: e.end,
                    ended_by: e.by,
                    price_at_launch: self
                        .sc
                        .markets
                        .series(&e.market)
                        .and_then(|s| s.price_at(e.launch)),
                    predicted_probability: e.predicted.map(|p| p.0),
                    predicted_secs: e.predicted.map(|p| p.1),
                    cost_usd: cost,
                });
            }
            *r.hours_by_type
                .entry(e.market.instance_type.to_string())
                .or_default() += hours;
        }
        r.overheads.unused_billed =
            (r.paid_capacity_units + r.free_capacity_units - r.capacity_units).max(0.0);
        Ok(r)
    }
}
