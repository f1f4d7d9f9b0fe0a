//! The trace-driven simulator: a job's work model and a policy against a spot price trace.
//!
//! One run ([`run`]) is a thin driver of the job's [`JobEngine`] — the one the live scheduler
//! runs — with a [`crate::engine::view::TraceView`] that refuses reads after the decision time.
//! It plays the world in time order: it answers the engine's launches as the 2015 market would
//! (refused below the price), draws each instance's fate ([`world`]: warned at the first price
//! above its bid, or by the hazard world), and feeds warnings, reclaims and the engine's own
//! wake-ups as they come. The engine decides everything else: when instances are ready, the
//! work they do and lose, the limits, budget and deadline, the bill, the job's end. [`sweep`]
//! runs several policies over the same start times and summarises.
//!
//! Simplifications, all stated: the market has unlimited capacity at the trace's price (our
//! purchases do not move it); the job's throughput is the sum of its instances' rates (linear
//! scaling up to `max_instances`); an AgileML eviction loses the evicted instance's work since
//! its last background sync, and every membership change pauses all workers for the job's
//! rebalance time; a checkpoint/restart job stops entirely on any eviction until replacements
//! have started and the checkpoint is reloaded.

pub mod availability;
pub mod calibration;
pub mod fleet;
pub mod foresight;
pub mod gap;
pub mod inputs;
pub mod optimal;
pub mod sweep;
pub mod world;

use crate::billing::{BillingError, EndedBy, PriceSource};
use crate::engine::job_engine::{
    Command, Ctx, EngineConfig, EngineError, Input, JobEngine, JobTerms, Outcome, Pacing,
};
use crate::engine::view::{FutureReads, TraceMarkets, TraceView};
use crate::job::JobModel;
use crate::market::{Market, Timestamp, Usd, UsdPerHour};
use crate::market_model::MarketModel;
use crate::market_model::pool_book::{PoolBook, PoolObservation, Seen};
use crate::policy::{Decision, InstanceId, Policy, PolicyError, PolicyKind, Purchase, Tier};
use crate::prices::PriceHistory;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use thiserror::Error;
use world::{HazardTruth, HazardWorld, MaxTree};

/// Who decides when an instance is taken away.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "world", rename_all = "kebab-case")]
pub enum World {
    /// 2015: at the first price change above the bid.
    Price,
    /// Today: per-pool interruption events (see [`HazardTruth`]), or a price above the bid.
    Hazard(HazardTruth),
    /// Today, from real availability traces ([`availability`]): a spot launch into a pool
    /// without spare capacity is refused (`InsufficientInstanceCapacity`), and when a pool's
    /// capacity falls below what the job holds there, that many instances (the newest first)
    /// get the 2-minute notice.
    #[serde(skip)]
    Availability(Arc<availability::Availability>),
}

/// Everything that stays the same across the runs of a sweep.
pub struct Scenario {
    markets: TraceMarkets,
    trees: HashMap<Market, MaxTree>,
    pub job: JobModel,
    pub billing: crate::billing::BillingModel,
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
        billing: crate::billing::BillingModel,
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
    /// The job's budget: it ends before the billing period that would pass it.
    pub budget: Option<Usd>,
    /// The job's deadline: it ends (failed) then if not done.
    pub deadline: Option<Deadline>,
}

/// When a simulated job must be done by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Deadline {
    /// Seconds after the run's start (a sweep's runs each get their own).
    After(f64),
    /// A market time.
    At(Timestamp),
}

impl Deadline {
    pub fn for_start(self, start: Timestamp) -> Timestamp {
        match self {
            Deadline::After(secs) => start.plus_secs(secs),
            Deadline::At(t) => t,
        }
    }

    /// `36h`, `90m`, `2d`, `600s` (after the start) or a market time (RFC 3339 or YYYY-MM-DD).
    pub fn parse(text: &str) -> Result<Deadline, String> {
        let t = text.trim();
        let unit = t
            .chars()
            .last()
            .filter(|c| matches!(c, 's' | 'm' | 'h' | 'd'));
        if let Some(unit) = unit
            && let Ok(n) = t[..t.len() - 1].trim().parse::<f64>()
        {
            if !(n.is_finite() && n > 0.0) {
                return Err(format!("deadline `{text}`: the duration must be positive"));
            }
            let secs = n * match unit {
                's' => 1.0,
                'm' => 60.0,
                'h' => 3600.0,
                _ => 86_400.0,
            };
            return Ok(Deadline::After(secs));
        }
        Timestamp::parse(t).map(Deadline::At).map_err(|e| {
            format!("deadline `{text}`: neither a duration (36h, 90m, 2d) nor a time ({e})")
        })
    }
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
    #[error("engine: {0}")]
    Engine(String),
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
    /// How the run ended: its work done, or its budget or deadline first.
    pub outcome: Outcome,
    /// Why, as the live broker records it.
    pub end_reason: String,
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
    /// Units of work done: the job's total when it completed, less when it ended at its budget
    /// or deadline.
    pub done_work: f64,
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

pub use crate::engine::job_engine::Overheads;

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
    Run::new(scenario, Box::new(policy), start, options, None).run()
}

/// What the simulated world holds for one instance: when the provider will warn it and, once
/// warned, when it takes it.
#[derive(Debug, Clone)]
struct Fate {
    id: InstanceId,
    market: Market,
    spot: bool,
    warn_at: Option<Timestamp>,
    terminate_at: Option<Timestamp>,
}

const MAX_STEPS: u64 = 5_000_000;

/// One run: the simulated world around a [`JobEngine`], fed in time order.
struct Run<'a> {
    sc: &'a Scenario,
    options: &'a RunOptions,
    engine: JobEngine<'a>,
    model: Box<dyn MarketModel>,
    hazard: Option<HazardWorld>,
    rng: ChaCha8Rng,
    start: Timestamp,
    /// By launch order, so that what happens at one instant happens in that order.
    fates: BTreeMap<u64, Fate>,
    /// The model's estimate at launch (probability, seconds), when recording.
    predicted: HashMap<InstanceId, (f64, f64)>,
    next_id: u64,
    /// The current instant, and the events played so far.
    now: Timestamp,
    steps: u64,
    /// The fleet's pool book, when several jobs run together ([`fleet`]): what this job's
    /// spot launches, refusals, interruptions and releases show of the pools goes into it, and
    /// every decision's view reads it.
    book: Option<&'a RefCell<PoolBook>>,
}

impl<'a> Run<'a> {
    fn new(
        sc: &'a Scenario,
        policy: Box<dyn Policy + 'a>,
        start: Timestamp,
        options: &'a RunOptions,
        book: Option<&'a RefCell<PoolBook>>,
    ) -> Self {
        let hazard = match &sc.world {
            World::Price | World::Availability(_) => None,
            World::Hazard(truth) => Some(HazardWorld::new(truth.clone(), options.seed, start)),
        };
        let config = EngineConfig {
            record_decisions: options.record_decisions,
            ..EngineConfig::new(Pacing::Modelled)
        };
        let terms = JobTerms {
            // The simulator's work model is the truth: nothing to measure.
            estimated: true,
            billing: sc.billing,
            budget: options.budget,
            deadline: options.deadline.map(|d| d.for_start(start)),
            started_at: start,
        };
        Run {
            sc,
            options,
            engine: JobEngine::new(sc.job.clone(), policy, config, terms),
            model: sc.model.boxed_clone(),
            hazard,
            rng: ChaCha8Rng::seed_from_u64(options.seed ^ 0x5eed),
            start,
            fates: BTreeMap::new(),
            predicted: HashMap::new(),
            next_id: 0,
            now: start,
            steps: 0,
            book,
        }
    }

    fn run(mut self) -> Result<RunResult, SimError> {
        self.begin()?;
        while let Some(t) = self.next_at()? {
            self.advance(t)?;
        }
        self.finish()
    }

    /// The job is submitted at its start.
    fn begin(&mut self) -> Result<(), SimError> {
        self.step(self.start, Input::Tick)
    }

    /// When the next thing happens to the job (`None`: it has ended).
    fn next_at(&mut self) -> Result<Option<Timestamp>, SimError> {
        if self.engine.end().is_some() {
            return Ok(None);
        }
        let now = self.now;
        self.steps += 1;
        if self.steps > MAX_STEPS {
            return Err(SimError::Runaway(MAX_STEPS));
        }
        let world = self
            .fates
            .values()
            .filter_map(|f| f.terminate_at.or(f.warn_at))
            .chain(self.capacity_changes(now))
            .min();
        let Some(t) = [self.engine.next_wake(now), world]
            .into_iter()
            .flatten()
            .min()
        else {
            return Err(SimError::Runaway(self.steps));
        };
        let t = t.max(now);
        if t > self.sc.end {
            return Err(SimError::TraceTooShort {
                start: self.start,
                trace_end: self.sc.end,
                done: self.engine.done_work(),
                total: self.sc.job.total_work,
            });
        }
        Ok(Some(t))
    }

    /// Plays the world and the job at `t` (from [`Run::next_at`]).
    fn advance(&mut self, t: Timestamp) -> Result<(), SimError> {
        self.now = t;
        self.world_at(t)?;
        self.step(t, Input::Tick)
    }

    /// Tells the fleet's book what was seen of a pool (spot only, on today's market).
    fn seen(&self, market: &Market, at: Timestamp, seen: Seen) {
        if let (Some(book), World::Availability(_)) = (self.book, &self.sc.world) {
            book.borrow_mut().observe(&PoolObservation {
                market: market.clone(),
                at,
                seen,
            });
        }
    }

    /// The next change of capacity in a pool where the job holds spot instances.
    fn capacity_changes(&self, now: Timestamp) -> Option<Timestamp> {
        let World::Availability(a) = &self.sc.world else {
            return None;
        };
        self.fates
            .values()
            .filter(|f| f.spot && f.terminate_at.is_none())
            .filter_map(|f| a.next_change(&f.market, now))
            .min()
    }

    /// Spot instances the job holds in `market` that the world has not warned.
    fn held(&self, market: &Market) -> impl Iterator<Item = (&u64, &Fate)> {
        self.fates
            .iter()
            .filter(move |(_, f)| f.spot && &f.market == market && f.warn_at.is_none())
    }

    /// Availability world: where a pool now has less capacity than the job holds there, the
    /// newest instances get their notice now.
    fn reclaim_capacity(&mut self, now: Timestamp) {
        let World::Availability(a) = &self.sc.world else {
            return;
        };
        let pools: std::collections::BTreeSet<Market> = self
            .fates
            .values()
            .filter(|f| f.spot && f.warn_at.is_none())
            .map(|f| f.market.clone())
            .collect();
        for market in pools {
            let held: Vec<u64> = self.held(&market).map(|(&seq, _)| seq).collect();
            let capacity = a.capacity(&market, now) as usize;
            for seq in held.iter().rev().take(held.len().saturating_sub(capacity)) {
                if let Some(f) = self.fates.get_mut(seq) {
                    f.warn_at = Some(now);
                }
            }
        }
    }

    /// What the world does at `now`: warned instances are taken, others warned.
    fn world_at(&mut self, now: Timestamp) -> Result<(), SimError> {
        self.reclaim_capacity(now);
        let mut ended = Vec::new();
        let mut warned = Vec::new();
        for (&seq, fate) in &self.fates {
            match fate.terminate_at {
                Some(end) if end <= now => ended.push(seq),
                Some(_) => {}
                None if fate.warn_at.is_some_and(|w| w <= now) => warned.push(seq),
                None => {}
            }
        }
        for seq in ended {
            let Some(fate) = self.fates.remove(&seq) else {
                continue;
            };
            self.step(
                now,
                Input::Ended {
                    id: fate.id,
                    at: now,
                    by_provider: true,
                },
            )?;
        }
        for seq in warned {
            let terminate_at = now.plus_secs(self.sc.warning_secs);
            let Some(f) = self.fates.get_mut(&seq) else {
                continue;
            };
            f.terminate_at = Some(terminate_at);
            let id = f.id.clone();
            if f.spot {
                let market = f.market.clone();
                self.seen(&market, now, Seen::Interrupted);
            }
            self.step(
                now,
                Input::Warned {
                    id,
                    at: now,
                    terminate_at,
                },
            )?;
        }
        Ok(())
    }

    /// Feeds `input` to the engine and carries out what it asks, answering launches at once.
    /// The ends of released instances come back after the engine's answer is complete.
    fn step(&mut self, now: Timestamp, input: Input) -> Result<(), SimError> {
        let mut next = Some(input);
        let mut ends = Vec::new();
        while let Some(input) = next.take() {
            let commands = {
                let book = self.book.map(|b| b.borrow());
                let view = TraceView::new(
                    now,
                    &self.sc.markets,
                    self.model.as_ref(),
                    self.options.future_reads,
                )
                .with_book(book.as_deref());
                let ctx = Ctx {
                    view: &view,
                    markets: &self.sc.markets,
                };
                self.engine.step(now, input, &ctx).map_err(SimError::from)?
            };
            for command in commands {
                match command {
                    Command::Launch { market, purchase } => {
                        next = Some(self.launch(now, &market, purchase));
                    }
                    Command::Release { id } => ends.push(id),
                    Command::Observe(o) => self.model.observe(o.as_observation()),
                    Command::MarkReady { .. } | Command::Record { .. } => {}
                    // The job is over: it releases everything it holds.
                    Command::End(_) => {
                        ends.extend(self.engine.members().iter().map(|m| m.id.clone()))
                    }
                }
            }
        }
        for id in ends {
            let released: Vec<Market> = self
                .fates
                .values()
                .filter(|f| f.id == id && f.spot && f.warn_at.is_none())
                .map(|f| f.market.clone())
                .collect();
            for market in released {
                self.seen(&market, now, Seen::Released);
            }
            self.fates.retain(|_, f| f.id != id);
            let book = self.book.map(|b| b.borrow());
            self.engine
                .step(
                    now,
                    Input::Ended {
                        id,
                        at: now,
                        by_provider: false,
                    },
                    &Ctx {
                        view: &TraceView::new(
                            now,
                            &self.sc.markets,
                            self.model.as_ref(),
                            self.options.future_reads,
                        )
                        .with_book(book.as_deref()),
                        markets: &self.sc.markets,
                    },
                )
                .map_err(SimError::from)?;
        }
        Ok(())
    }

    /// The simulated cloud's answer to a launch: refused when the market has no price for the
    /// purchase or the bid is below the price; otherwise running, with its fate drawn.
    fn launch(&mut self, now: Timestamp, market: &Market, purchase: Purchase) -> Input {
        let refused = |reason: String| Input::LaunchRefused { reason };
        let series = self.sc.markets.series(market);
        let price = series.and_then(|s| s.price_at(now));
        let warn_at = match purchase {
            Purchase::OnDemand => {
                if self.sc.markets.on_demand(market).is_none() {
                    return refused("no on-demand price".into());
                }
                None
            }
            Purchase::Spot { bid } => {
                let (Some(series), Some(price)) = (series, price) else {
                    return refused("no spot price in this market".into());
                };
                if price > bid {
                    return refused(format!("bid {bid} is below the price {price}"));
                }
                let Some(tree) = self.sc.trees.get(market) else {
                    return refused("no spot price in this market".into());
                };
                world::first_above(series, tree, now, bid.get())
            }
        };
        if let (World::Availability(a), Purchase::Spot { .. }) = (&self.sc.world, purchase) {
            let capacity = a.capacity(market, now) as usize;
            if self.held(market).count() >= capacity {
                self.seen(market, now, Seen::Refused);
                return refused(format!(
                    "InsufficientInstanceCapacity: {} has no spare spot capacity \
                     ({capacity} available, the job holds {})",
                    market.zone,
                    self.held(market).count()
                ));
            }
        }
        let hazard_at = match (&mut self.hazard, purchase) {
            (Some(h), Purchase::Spot { .. }) => {
                h.interruption(market, now, self.sc.end, &mut self.rng)
            }
            _ => None,
        };
        let warn_at = match (warn_at, hazard_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if matches!(purchase, Purchase::Spot { .. }) {
            self.seen(market, now, Seen::Granted);
        }
        self.next_id += 1;
        let id = InstanceId(format!("sim-{}", self.next_id));
        if let (true, Purchase::Spot { bid }, Some(p)) =
            (self.options.record_decisions, purchase, price)
            && let Ok(e) = self
                .model
                .eviction(market, bid.get() - p.get(), 3600.0, now)
        {
            self.predicted
                .insert(id.clone(), (e.probability, e.expected_secs));
        }
        self.fates.insert(
            self.next_id,
            Fate {
                id: id.clone(),
                market: market.clone(),
                spot: matches!(purchase, Purchase::Spot { .. }),
                warn_at,
                terminate_at: None,
            },
        );
        Input::Launched { id, at: now }
    }

    fn finish(mut self) -> Result<RunResult, SimError> {
        let Some(end) = self.engine.end().cloned() else {
            return Err(SimError::Runaway(0));
        };
        let counts = self.engine.counts();
        let mut r = RunResult {
            policy: self.engine.policy().name().to_string(),
            kind: self.engine.policy().kind(),
            start: self.start,
            end: end.at,
            runtime_hours: end.at.secs_since(self.start) / 3600.0,
            outcome: end.outcome,
            end_reason: end.reason.clone(),
            cost_usd: Usd::ZERO,
            evictions: counts.evictions,
            eviction_events: counts.eviction_events,
            launches: counts.launches,
            failed_launches: counts.failed_launches,
            decisions_made: counts.decisions,
            instance_hours_reliable: 0.0,
            instance_hours_transient: 0.0,
            free_instance_hours: 0.0,
            free_value_usd: Usd::ZERO,
            lost_work: self.engine.lost_work(),
            done_work: if end.outcome.succeeded() {
                self.sc.job.total_work
            } else {
                self.engine.done_work()
            },
            capacity_units: 0.0,
            paid_capacity_units: 0.0,
            free_capacity_units: 0.0,
            overheads: self.engine.overheads(),
            cost_by_type: BTreeMap::new(),
            hours_by_type: BTreeMap::new(),
            decisions_digest: crate::engine::digest::decisions_digest(
                self.engine
                    .ended()
                    .iter()
                    .map(|e| crate::engine::digest::Launched {
                        at: e.member.launched_at,
                        market: &e.member.market,
                        tier: e.member.purchase.tier(),
                        bid: e.member.purchase.bid().map(|b| b.get()),
                        ended: Some(e.end),
                        ended_by_provider: e.by == EndedBy::Provider,
                    }),
            ),
            decisions: self.engine.take_decisions(),
            instances: Vec::new(),
        };
        for e in self.engine.ended() {
            let m = &e.member;
            let source = match m.purchase {
                Purchase::OnDemand => PriceSource::Fixed(
                    self.sc
                        .markets
                        .on_demand(&m.market)
                        .ok_or_else(|| SimError::NoOnDemandPrice(m.market.to_string()))?,
                ),
                // Spot launches are refused in markets without a series, so this always exists.
                Purchase::Spot { .. } => PriceSource::Spot(
                    self.sc
                        .markets
                        .series(&m.market)
                        .ok_or_else(|| SimError::NoSpotPrice(m.market.to_string()))?,
                ),
            };
            let items = self.sc.billing.bill(m.launched_at, e.end, e.by, source)?;
            let hours = e.end.secs_since(m.launched_at) / 3600.0;
            let cost: Usd = items.iter().map(|i| i.amount_usd).sum();
            for item in &items {
                if item.free {
                    r.free_instance_hours += item.used_hours();
                    // The free period is an hour (only `hourly-2015` has them).
                    r.free_value_usd += item.price_usd_per_hour.for_hours(1.0);
                    r.free_capacity_units += m.rate * item.used_hours();
                } else {
                    r.paid_capacity_units += m.rate * item.billed_seconds / 3600.0;
                }
            }
            r.cost_usd += cost;
            match m.purchase.tier() {
                Tier::Reliable => r.instance_hours_reliable += hours,
                Tier::Transient => r.instance_hours_transient += hours,
            }
            r.capacity_units += m.rate * hours;
            *r.cost_by_type
                .entry(m.market.instance_type.to_string())
                .or_default() += cost;
            if self.options.record_decisions {
                let predicted = self.predicted.get(&m.id);
                r.instances.push(InstanceRecord {
                    market: m.market.to_string(),
                    tier: m.purchase.tier(),
                    bid: m.purchase.bid(),
                    launch: m.launched_at,
                    end: e.end,
                    ended_by: e.by,
                    price_at_launch: self
                        .sc
                        .markets
                        .series(&m.market)
                        .and_then(|s| s.price_at(m.launched_at)),
                    predicted_probability: predicted.map(|p| p.0),
                    predicted_secs: predicted.map(|p| p.1),
                    cost_usd: cost,
                });
            }
            *r.hours_by_type
                .entry(m.market.instance_type.to_string())
                .or_default() += hours;
        }
        r.overheads.unused_billed =
            (r.paid_capacity_units + r.free_capacity_units - r.capacity_units).max(0.0);
        Ok(r)
    }
}

impl From<EngineError> for SimError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Policy { policy, at, source } => SimError::Policy { policy, at, source },
            other => SimError::Engine(other.to_string()),
        }
    }
}
