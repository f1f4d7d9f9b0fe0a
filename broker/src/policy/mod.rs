//! Policies: what to buy, where, at what bid, and when to let go.
//!
//! # How a scheduler drives a policy
//!
//! The simulator and the live scheduler run the same policy code through one trait, [`Policy`].
//! A policy never touches a cloud, a database or a trace. On every control tick, and whenever
//! something happens to the job's instances, the driver:
//!
//! 1. builds a [`MarketView`] at the current time `now` (prices in force, on-demand prices, the
//!    market model's eviction estimates; nothing after `now` can be read through it);
//! 2. describes the job's footprint as [`InstanceView`]s (market, tier, bid, launch time,
//!    state: starting, running, or warned of termination) and its progress as [`JobProgress`];
//! 3. calls [`Policy::decide`] (a tick) or [`Policy::on_event`] (an instance became ready, was
//!    warned, was evicted, a launch failed) with a [`DecisionContext`];
//! 4. applies the returned [`Decision`]: launches each [`Acquisition`] (count instances in a
//!    market, on-demand or spot at the given bid), terminates each released instance, and asks
//!    again no later than [`Decision::wake_at`] (BidBrain asks to be woken just before its
//!    instances' billing hours end, which is when releasing is cheapest).
//!
//! The driver also asks [`Policy::eviction_cost`] once per job: how the job runs under this
//! policy (AgileML, or checkpoint/restart for standard bidding), so progress and lost work are
//! accounted the same way in simulation and in production.
//!
//! Decisions must be idempotent with respect to the footprint: a policy asks for what it wants
//! *given* the instances it is shown, so a driver that crashed after launching can rebuild the
//! footprint, ask again and not launch twice. The policies here keep no state between decisions
//! beyond scratch buffers (standard bidding finds "its" market from the survivors' market) and
//! soft memories a restart may lose at the cost of one more try: pools that refused a launch
//! recently (BidBrain, skypilot-default, uniform-progress), the last preempted pool
//! (skypilot-default), and a deadline's commitment to on-demand, which the next decision
//! derives again from the slack. A restarted driver can build fresh instances with
//! [`load_policy_file`].
//!
//! # The market view in production
//!
//! [`crate::engine::view::TraceView`] is the reference [`MarketView`]: a
//! [`crate::prices::PriceHistory`] (from the store), a [`crate::market_model::MarketModel`] and
//! the clock. Build the model once per broker: [`crate::market_model::PriceDrivenModel`] for the
//! 2015-style market (rebuild it when new prices arrive: its per-market indexes are computed on
//! first use from the history it was given), [`crate::market_model::HazardModel`] for today's,
//! fed every observed interruption and every instance's running hours through
//! [`crate::market_model::MarketModel::observe`]. A driver that wants to hide markets (a
//! cool-down after a capacity error) wraps the view and filters [`MarketView::markets`].
//!
//! # Policies are data
//!
//! `policies/*.toml`, loaded by [`load_policy_file`] (or [`resolve_policy_path`] for a bare
//! name); `kind` selects the implementation, see [`BidBrainConfig`], [`OnDemandConfig`],
//! [`StandardBiddingConfig`], [`SkypilotConfig`] and [`UniformProgressConfig`] for the
//! documented keys. Errors name the file, the key and the
//! allowed values ([`PolicyLoadError`]).

mod bidbrain;
mod config;
pub mod deadline_plan;
mod on_demand;
mod skypilot;
mod standard;
mod uniform_progress;

pub use bidbrain::{
    BidBrain, BidBrainConfig, ReliableTier, ReliableTypeChoice, TodayConfig, standard_runtime_secs,
};
pub use config::{
    PolicyLoadError, PolicySpec, load_policy_file, parse_policy, policies_dir, resolve_policy_path,
};
pub use on_demand::{OnDemandConfig, OnDemandPolicy};
pub use skypilot::{SkypilotConfig, SkypilotDefault};
pub use standard::{RankBy, StandardBidding, StandardBiddingConfig};
pub use uniform_progress::{UniformProgress, UniformProgressConfig, Zones};

use crate::billing::BillingModel;
use crate::job::{EvictionCost, JobModel};
use crate::market::{InstanceType, Market, Timestamp, UsdPerHour};
use crate::market_model::{EvictionEstimate, ModelError, ModelKind};
pub use proteus_wire::{InstanceId, Tier};
use serde::Serialize;
use std::fmt;
use thiserror::Error;

/// How an instance is bought. The tier follows from it: on-demand is reliable, spot transient.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
#[serde(tag = "purchase", rename_all = "kebab-case")]
pub enum Purchase {
    /// On-demand at the list price; never taken away.
    OnDemand,
    /// Spot with a maximum price. Under the 2015 market the instance is evicted when the price
    /// rises above `bid`; today the bid only caps what is paid.
    Spot { bid: UsdPerHour },
}

impl Purchase {
    pub fn tier(self) -> Tier {
        match self {
            Purchase::OnDemand => Tier::Reliable,
            Purchase::Spot { .. } => Tier::Transient,
        }
    }

    pub fn bid(self) -> Option<UsdPerHour> {
        match self {
            Purchase::OnDemand => None,
            Purchase::Spot { bid } => Some(bid),
        }
    }
}

/// Where an instance is in its life, as far as the policy cares.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum InstanceState {
    /// Launched, not yet doing work; expected to be ready at `ready_at`.
    Starting { ready_at: Timestamp },
    /// Doing work.
    Running,
    /// The provider announced its termination at `terminate_at`; it is handing its work over.
    /// A policy may replace it; releasing it is pointless.
    Warned { terminate_at: Timestamp },
}

/// One instance of the job's footprint.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InstanceView {
    pub id: InstanceId,
    pub market: Market,
    pub purchase: Purchase,
    pub launched_at: Timestamp,
    pub state: InstanceState,
}

impl InstanceView {
    pub fn tier(&self) -> Tier {
        self.purchase.tier()
    }

    /// Not warned: it will still be there unless the policy releases it or the market takes it.
    pub fn is_active(&self) -> bool {
        !matches!(self.state, InstanceState::Warned { .. })
    }
}

/// How far the job has come.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct JobProgress {
    /// Work done and not lost, units.
    pub done_work: f64,
    pub total_work: f64,
    /// When the job was submitted.
    pub started_at: Timestamp,
    /// When the job must be done by, if it has a deadline: a policy plans against it (the
    /// engine ends the job when it passes).
    pub deadline: Option<Timestamp>,
}

impl JobProgress {
    pub fn remaining(&self) -> f64 {
        (self.total_work - self.done_work).max(0.0)
    }

    /// Seconds until the deadline (negative once past), or `None` without one.
    pub fn secs_to_deadline(&self, now: Timestamp) -> Option<f64> {
        self.deadline.map(|d| d.secs_since(now))
    }
}

/// A read of the past that the view refuses.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ViewError {
    #[error("read of {market} at {requested} is after the decision time {now}")]
    Future {
        market: String,
        requested: Timestamp,
        now: Timestamp,
    },
}

/// The market as of `now()`. Implementations must not reveal anything after `now()`: reads at a
/// later time fail with [`ViewError::Future`], and eviction estimates use only the past.
pub trait MarketView {
    /// The decision time.
    fn now(&self) -> Timestamp;
    /// Every spot market with a known price at `now()`.
    fn markets(&self) -> Vec<&Market>;
    /// The spot price in force at `now()`, if the market has one.
    fn spot_price(&self, market: &Market) -> Option<UsdPerHour>;
    /// The spot price in force at `at ≤ now()`.
    fn spot_price_at(
        &self,
        market: &Market,
        at: Timestamp,
    ) -> Result<Option<UsdPerHour>, ViewError>;
    /// The time-weighted mean spot price over `[since, now()]`, if any price is known in it.
    fn mean_spot_price(
        &self,
        market: &Market,
        since: Timestamp,
    ) -> Result<Option<UsdPerHour>, ViewError>;
    /// The on-demand price of the market's instance type in its region.
    fn on_demand_price(&self, market: &Market) -> Option<UsdPerHour>;
    /// What the whole fleet has seen of today's spot pools, when the driver keeps a book
    /// ([`crate::market_model::pool_book`]): every job's launches, refusals and interruptions.
    fn pool_book(&self) -> Option<&crate::market_model::pool_book::PoolBook> {
        None
    }
    /// Which market model answers [`MarketView::eviction`].
    fn model_kind(&self) -> ModelKind;
    /// Eviction risk over `horizon_secs` from `now()` of an instance whose bid is
    /// `bid_delta_usd` above the current price.
    fn eviction(
        &self,
        market: &Market,
        bid_delta_usd: f64,
        horizon_secs: f64,
    ) -> Result<EvictionEstimate, ModelError>;
    /// [`MarketView::eviction`] for several deltas of one market at once (appends to `out`);
    /// implementations override it when a batch is cheaper.
    fn eviction_many(
        &self,
        market: &Market,
        bid_deltas_usd: &[f64],
        horizon_secs: f64,
        out: &mut Vec<EvictionEstimate>,
    ) -> Result<(), ModelError> {
        for &d in bid_deltas_usd {
            out.push(self.eviction(market, d, horizon_secs)?);
        }
        Ok(())
    }
}

/// Everything a policy may look at for one decision.
pub struct DecisionContext<'a> {
    pub market: &'a dyn MarketView,
    pub job: &'a JobModel,
    pub progress: JobProgress,
    /// The job's current instances, warned ones included; terminated ones are gone.
    pub footprint: &'a [InstanceView],
    pub billing: BillingModel,
}

impl DecisionContext<'_> {
    /// The decision time (the market view's clock; there is no other).
    pub fn now(&self) -> Timestamp {
        self.market.now()
    }
}

/// Why the policy is being asked outside a tick.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyEvent {
    /// These instances finished starting and are doing work.
    Ready(Vec<InstanceId>),
    /// The provider announced these instances' termination (2015: the price crossed the bid;
    /// today: an interruption notice). They stop working and leave at their deadline.
    Warned(Vec<InstanceId>),
    /// These instances are gone (after their warning, or without one).
    Evicted(Vec<InstanceId>),
    /// These instances ended though neither the policy released them nor the provider
    /// reclaimed them: terminated by someone else, failed, or gone from the cloud's list.
    Lost(Vec<InstanceId>),
    /// A launch the policy asked for did not happen (e.g. the bid is below the current price,
    /// or the cloud has no capacity).
    LaunchFailed { market: Market, reason: String },
}

/// Instances to launch in one market.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Acquisition {
    pub market: Market,
    #[serde(flatten)]
    pub purchase: Purchase,
    pub count: u32,
}

impl Acquisition {
    pub fn tier(&self) -> Tier {
        self.purchase.tier()
    }
}

/// What a policy expected of one instance it buys or lets go, over its horizon (one billing
/// hour for BidBrain): the figures that justified the choice.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Expectation {
    /// Expected charge, in dollars.
    pub cost_usd: f64,
    /// Expected useful work, in units of the job's work (what the job can still use).
    pub work_units: f64,
    /// Probability that the provider ends it within the horizon (0 for on-demand).
    pub eviction_probability: f64,
    pub horizon_hours: f64,
}

impl Expectation {
    /// Dollars per unit of work (`None` without work).
    pub fn cost_per_unit(&self) -> Option<f64> {
        (self.work_units > 0.0).then(|| self.cost_usd / self.work_units)
    }
}

impl fmt::Display for Expectation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "${:.4} for {:.3} units of work in the next {} h, eviction probability {:.2}",
            self.cost_usd, self.work_units, self.horizon_hours, self.eviction_probability
        )?;
        match self.cost_per_unit() {
            Some(cpw) => write!(f, " (${cpw:.4} per unit)"),
            None => f.write_str(" (no useful work)"),
        }
    }
}

/// What one reason is about.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Subject {
    /// One of the decision's acquisitions; the expectation is per instance.
    Acquire(Acquisition),
    /// One of the decision's releases; the expectation is of keeping it.
    Release {
        instance: InstanceId,
        market: Market,
    },
}

/// Why one part of a decision was taken: what was expected of it and the rule that chose it.
/// Policies that weigh expectations (BidBrain) give one per acquisition and release; rule-based
/// baselines give none.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reason {
    #[serde(flatten)]
    pub subject: Subject,
    pub expected: Expectation,
    /// The rule, in words, with the figure it was held against.
    pub rule: String,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.subject {
            Subject::Acquire(a) => {
                write!(f, "buy {} × {} ", a.count, a.market)?;
                match a.purchase {
                    Purchase::OnDemand => f.write_str("on-demand")?,
                    Purchase::Spot { bid } => write!(f, "spot at bid {bid}")?,
                }
                write!(f, ": each expected {}; {}", self.expected, self.rule)
            }
            Subject::Release { instance, market } => write!(
                f,
                "release {instance} ({market}): keeping it was expected {}; {}",
                self.expected, self.rule
            ),
        }
    }
}

/// What a policy wants done now.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Decision {
    pub acquire: Vec<Acquisition>,
    /// Instances to terminate now (by the user, for billing purposes).
    pub release: Vec<InstanceId>,
    /// Make before break: instances the acquisitions replace, the first launched instance
    /// replacing the first of these, and so on. Each keeps working until its replacement is
    /// ready and is then released by the driver; while they overlap it does not count against
    /// the job's limits (as a warned instance does not). If its replacement is refused, warned
    /// or ends before it is ready, it stays.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replace: Vec<InstanceId>,
    /// When a replaced instance goes: when its replacement is ready (make before break, the
    /// default), or as soon as the replacement's launch is granted (a switch that pays the
    /// restart, and that a refusal still leaves undone).
    #[serde(skip_serializing_if = "ReplaceAt::is_ready")]
    pub replace_at: ReplaceAt,
    /// Ask again no later than this (in addition to the driver's own ticks and events).
    pub wake_at: Option<Timestamp>,
    /// Why: one reason per acquisition and release, for policies that weigh expectations.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<Reason>,
}

/// When an instance named in [`Decision::replace`] goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplaceAt {
    /// When its replacement is ready: it works on meanwhile.
    #[default]
    Ready,
    /// When its replacement's launch is granted.
    Launch,
}

impl ReplaceAt {
    fn is_ready(&self) -> bool {
        *self == ReplaceAt::Ready
    }
}

impl Decision {
    pub fn is_empty(&self) -> bool {
        self.acquire.is_empty() && self.release.is_empty()
    }
}

/// The kinds of policy this broker implements; the comparison reports ratios against the
/// on-demand and standard-bidding kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    #[serde(rename = "bidbrain")]
    BidBrain,
    OnDemand,
    StandardBidding,
    /// SkyPilot managed jobs' default recovery (today's market baseline).
    SkypilotDefault,
    /// Can't Be Late's Uniform Progress (today's market baseline).
    UniformProgress,
}

impl PolicyKind {
    pub const ALLOWED: &'static str =
        "bidbrain, on-demand, standard-bidding, skypilot-default, uniform-progress";

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::BidBrain => "bidbrain",
            PolicyKind::OnDemand => "on-demand",
            PolicyKind::StandardBidding => "standard-bidding",
            PolicyKind::SkypilotDefault => "skypilot-default",
            PolicyKind::UniformProgress => "uniform-progress",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a policy could not decide.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PolicyError {
    #[error("no market of the job's instance types ({types}) has a price at {now}")]
    NoMarket { types: String, now: Timestamp },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    View(#[from] ViewError),
}

/// A policy: see the module documentation for how it is driven.
pub trait Policy: Send {
    /// The name it is reported under (the file's `name`, or its stem).
    fn name(&self) -> &str;

    fn kind(&self) -> PolicyKind;

    /// How the job runs under this policy: what an eviction costs it.
    fn eviction_cost(&self, job: &JobModel) -> EvictionCost;

    /// Markets the policy's file names explicitly; the driver checks they have prices.
    fn named_markets(&self) -> Vec<Market> {
        Vec::new()
    }

    /// Instance types the policy's file names explicitly; the driver checks the job has them.
    fn named_instance_types(&self) -> Vec<InstanceType> {
        Vec::new()
    }

    /// A control tick: what to acquire and release now.
    fn decide(&mut self, ctx: &DecisionContext<'_>) -> Result<Decision, PolicyError>;

    /// Something happened to the footprint. The default reacts like a tick (every policy here
    /// replaces lost capacity through `decide`); override to react differently, e.g. to
    /// replace a warned instance before it is gone.
    fn on_event(
        &mut self,
        ctx: &DecisionContext<'_>,
        event: &PolicyEvent,
    ) -> Result<Decision, PolicyError> {
        let _ = event;
        self.decide(ctx)
    }
}

/// A borrowed policy is a policy (the simulator runs a caller's policy without owning it).
impl<P: Policy + ?Sized> Policy for &mut P {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn kind(&self) -> PolicyKind {
        (**self).kind()
    }
    fn eviction_cost(&self, job: &JobModel) -> EvictionCost {
        (**self).eviction_cost(job)
    }
    fn named_markets(&self) -> Vec<Market> {
        (**self).named_markets()
    }
    fn named_instance_types(&self) -> Vec<InstanceType> {
        (**self).named_instance_types()
    }
    fn decide(&mut self, ctx: &DecisionContext<'_>) -> Result<Decision, PolicyError> {
        (**self).decide(ctx)
    }
    fn on_event(
        &mut self,
        ctx: &DecisionContext<'_>,
        event: &PolicyEvent,
    ) -> Result<Decision, PolicyError> {
        (**self).on_event(ctx, event)
    }
}

/// Units of work per hour of an instance of `market` for this job, or `None` if the job does
/// not run on its type.
pub(crate) fn rate_of(job: &JobModel, market: &Market) -> Option<f64> {
    job.rate(&market.instance_type)
}

/// The lowest on-demand price per unit of work over the job's types present in the view, with
/// the market (zone) to buy it in. Ties go to the faster type (fewer instances for the speed).
pub(crate) fn cheapest_on_demand<'a>(
    view: &'a dyn MarketView,
    job: &JobModel,
    only: Option<&InstanceType>,
) -> Option<(&'a Market, f64, f64)> {
    let mut best: Option<(&Market, f64, f64)> = None;
    for m in view.markets() {
        if only.is_some_and(|t| *t != m.instance_type) {
            continue;
        }
        let (Some(rate), Some(od)) = (rate_of(job, m), view.on_demand_price(m)) else {
            continue;
        };
        let per_unit = od.get() / rate;
        let better = match best {
            None => true,
            Some((_, b, r)) => per_unit < b - 1e-12 || ((per_unit - b).abs() <= 1e-12 && rate > r),
        };
        if better {
            best = Some((m, per_unit, rate));
        }
    }
    best
}
