//! BidBrain (Proteus, EuroSys'17): buy capacity to minimise the expected cost per unit of work.
//!
//! Every allocation (a count of instances in one market at one bid) is judged by its expected
//! cost and expected useful work per horizon of its life (one billing hour by default), from the
//! market model's eviction estimate `(P, E)` (probability of eviction within the horizon,
//! expected running time within it):
//!
//! - a new spot instance bid at `price + delta` costs, under `hourly-2015`, `price × (1 − P)`
//!   (an eviction makes the started hour free), and under `per-second`, `price × E`;
//! - it works at its type's rate for `E`, minus its start-up spread over its expected life
//!   (`1/P` horizons, capped by the job's remaining time: a survivor keeps working without
//!   starting again), minus `P ×` the work an eviction loses (AgileML: half a sync interval),
//!   minus its share of the pauses every membership change costs the whole footprint;
//! - an on-demand instance costs the list price and is never evicted.
//!
//! Only work the job can still use counts, and only an eviction before the job ends makes an
//! hour free: near the end, both figures are taken over the time the footprint needs to finish
//! (a free-ride bid 20 minutes before the end is usually cut by the job's end, and paid).
//!
//! A footprint's cost per work (CPW) is the sum of expected costs over the sum of expected work.
//! At each decision BidBrain
//!
//! 1. keeps a small reliable tier of on-demand instances for the backup parameter-server shards
//!    (AgileML needs state that outlives a bulk eviction);
//! 2. releases an instance — under `hourly-2015` only in the last minutes before its billing
//!    hour ends, because the hour is paid anyway — when keeping it for another horizon would
//!    cost more per unit of work than the on-demand ceiling; or clearly more (`switch_margin`)
//!    than a new allocation that is at least as fast per slot, while the footprint is full or
//!    at its target speed; or clearly more than the rest of the footprint while the rest stays
//!    at its target speed without it (the paper's rule: keeping it raises the CPW). Under
//!    `hourly-2015` the end game is explicit: the work the footprint will do in the hours it has
//!    already paid for is subtracted from what remains, and only that shortfall is handed out
//!    to the renewals due now, cheapest first; a renewal that gets none of it is released (its
//!    hour would be paid for work the others finish anyway);
//! 3. acquires the cheapest allocations per unit of work — over every market of the job's types
//!    and every bid delta of its grid — up to its capacity target (the job's full speed on the
//!    worker slots) with allocations within `fill_slack` of the best one, and beyond the target
//!    while an allocation lowers the footprint's CPW (the paper's rule), up to `max_instances`.
//!    Under `hourly-2015` it buys no more instances than the shortfall left after the renewals
//!    needs if none is evicted (a whole hour each), and none once it is covered: an instance
//!    bought in the job's last hour is paid in full unless evicted, however little it works.
//!
//! **Deadlines (today's market).** With a deadline, BidBrain paces the job against the straight
//! line from its start to its deadline, as Can't Be Late's Uniform Progress does ([`Plan`]):
//! behind the line it may buy on-demand (spot still wins on cost when a pool has capacity);
//! a restart or more ahead it buys spot only and lets on-demand go; in between it keeps what
//! runs. When the slack is down to two restarts and a tick it commits to on-demand to the end.
//! Its own cost model still chooses among every pool of the job's types, with the interruption
//! risk its market model learns per pool; pools that refused a launch are left out until the
//! next tick. Under `per-second` an instance the provider interrupts within its first hour is
//! free, and the expected cost counts that.
//!
//! The free partial hour of `hourly-2015` is exploited through the cost term: a small delta in a
//! market that is about to move gives a high eviction probability, hence a low expected cost, and
//! the grid search picks it when the expected work stays worth it. How well that works depends
//! on the estimates; see [`crate::market_model::PriceDrivenModel`] (state-matched replay).

use super::{
    Acquisition, Decision, DecisionContext, Expectation, InstanceState, InstanceView, Policy,
    PolicyError, PolicyKind, Purchase, Reason, Subject, cheapest_on_demand, rate_of,
};
use crate::billing::{BillingModel, FREE_INTERRUPTION_MS};
use crate::job::{EvictionCost, JobModel};
use crate::market::{InstanceType, Market, Timestamp, Usd, UsdPerHour};
use crate::market_model::availability::AvailabilityModel;
use crate::market_model::{EvictionEstimate, ModelError, ModelKind};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

mod today;

/// The keys of a `kind = "bidbrain"` policy file. Every key has a default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BidBrainConfig {
    /// Name in reports. Default: the file's stem.
    #[serde(default)]
    pub name: Option<String>,
    /// Restrict to these markets (`zone/type`). Default: every market of the job's types.
    #[serde(default)]
    pub markets: Vec<String>,
    /// Bid deltas searched, as fractions of the type's on-demand price (bid = current price +
    /// delta × on-demand). Non-negative. Only used when evictions follow the price.
    #[serde(default = "default_deltas")]
    pub bid_deltas: Vec<f64>,
    /// Horizon over which allocations are judged, minutes. Default 60 (one billing hour).
    #[serde(default = "default_horizon")]
    pub horizon_minutes: f64,
    /// How often the policy wants to be asked even if nothing happens, minutes. Default 5.
    #[serde(default = "default_tick")]
    pub tick_minutes: f64,
    /// Under `hourly-2015`, an allocation is reconsidered this many minutes before its billing
    /// hour ends (the hour is paid; releasing just before the next one starts saves it).
    #[serde(default = "default_release_window")]
    pub release_before_boundary_minutes: f64,
    /// Largest allocation (instances in one market at one bid) made at once. Spreads the
    /// footprint over markets and bids so one price spike does not take everything.
    #[serde(default = "default_max_per_allocation")]
    pub max_per_allocation: u32,
    /// Capacity target as a multiple of the job's full speed (`max_instances` reference
    /// instances). BidBrain fills up to it with anything below the ceiling.
    #[serde(default = "one")]
    pub capacity_target: f64,
    /// Ceiling on an allocation's expected cost per unit of work, as a multiple of on-demand's
    /// (the cheapest on-demand type per unit of work).
    #[serde(default = "one")]
    pub max_cost_vs_on_demand: f64,
    /// While filling up to the capacity target, take only allocations within this fraction of
    /// the best one available now (0.5 = up to 50% dearer per unit of work); beyond it, the
    /// allocation waits for a better moment. Large values fill at any price under the ceiling.
    #[serde(default = "default_fill_slack")]
    pub fill_slack: f64,
    /// Allocations per market per decision (each at a different bid delta).
    #[serde(default = "one_u32")]
    pub allocations_per_market: u32,
    /// Replace a kept allocation only when a new one is at least this much cheaper per unit of
    /// work (0.15 = 15%); damps flapping between near-equal markets.
    #[serde(default = "default_switch_margin")]
    pub switch_margin: f64,
    /// With a deadline: how far behind Uniform Progress's line the job may fall, waiting for
    /// spot, before it buys on-demand, as a share of its slack at the start (the time the
    /// deadline leaves beyond the work at full speed). 0 is Uniform Progress's rule; 1 waits
    /// until the slack is gone (the safety net then commits to on-demand).
    #[serde(default)]
    pub deadline_allowance: f64,
    /// With a deadline: on-demand bought to keep pace is let go only once the job is this many
    /// restart overheads of its on-demand time ahead of the line, so that each stint on
    /// on-demand pays its start-up back (an elastic job on many on-demand instances gains on the
    /// line fast and would otherwise buy and release them every few minutes). The lead is never
    /// less than one restart at full speed, Uniform Progress's own.
    #[serde(default = "default_ahead_stint_restarts")]
    pub ahead_stint_restarts: f64,
    /// The runtime the user accepts, as a multiple of standard bidding's on the same job (a
    /// number ≥ 1; `inf`: cost alone). A job without a deadline is paced, as one with a
    /// deadline is, against the line to `start + runtime_vs_standard × standard bidding's
    /// runtime` ([`standard_runtime_secs`]); a deadline of the job's own comes first.
    #[serde(default = "default_runtime_vs_standard")]
    pub runtime_vs_standard: f64,
    /// The reliable (on-demand) tier for backup parameter-server shards.
    #[serde(default)]
    pub reliable: ReliableTier,
    /// Today's market: how a one-instance job with a deadline is planned.
    #[serde(default)]
    pub today: TodayConfig,
}

/// Today's market (per-second billing, interruptions that follow capacity): a one-instance job
/// with a deadline is planned against its pools' availability ([`crate::policy::deadline_plan`])
/// instead of Uniform Progress's straight line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TodayConfig {
    /// Plan one-instance jobs with a deadline. `false`: pace them on Uniform Progress's line,
    /// as elastic jobs are.
    #[serde(default = "yes")]
    pub plan: bool,
    /// Slack the plan keeps in hand, in looks (`tick_minutes`), for what it does not model:
    /// the policy acts at its looks, an interruption loses the work since the last sync, and a
    /// change of instance pauses the job. Tuned on the 2022 traces: without it some deadlines
    /// were missed by seconds; 1 and 2 cost the same. Default 1.
    #[serde(default = "one")]
    pub margin_ticks: f64,
    /// Switches between on-demand and spot are made before they are broken: the new instance
    /// starts beside the old, which works on until it is ready ([`super::Decision::replace`]).
    /// This also makes a try at spot from on-demand free (a refusal leaves on-demand running),
    /// and lets a job on several pools move to capacity that has just come back without losing
    /// progress. `false`: the old instance goes first and every switch pays the restart
    /// overhead, as Uniform Progress's switches do.
    #[serde(default = "yes")]
    pub make_before_break: bool,
    /// How a pool's spot capacity comes and goes. The default is fitted on the 2022
    /// availability traces (the tuning set): `proteus simulate --fit-availability
    /// --availability data/spot/skypilot-spot-traces/availability/1-node/aws-10-26-2022/us-west-2a_v100_1.json
    /// --availability …/us-west-2b_v100_1.json`.
    #[serde(default = "default_availability")]
    pub availability: AvailabilityModel,
}

impl Default for TodayConfig {
    fn default() -> Self {
        TodayConfig {
            plan: true,
            margin_ticks: 1.0,
            make_before_break: true,
            availability: default_availability(),
        }
    }
}

fn yes() -> bool {
    true
}

/// Fitted on the 2022 V100 ×1 availability traces (us-west-2a, us-west-2b; 10-minute steps, the
/// default buckets, a prior of 1 step): see [`TodayConfig::availability`].
pub fn default_availability() -> AvailabilityModel {
    AvailabilityModel {
        step_minutes: 10.0,
        bucket_steps: AvailabilityModel::DEFAULT_BUCKETS.to_vec(),
        up_end: DEFAULT_UP_END.to_vec(),
        down_end: DEFAULT_DOWN_END.to_vec(),
    }
}

/// Rounded to four places, as `--fit-availability` prints them.
const DEFAULT_UP_END: [f64; 10] = [
    0.2502, 0.1513, 0.0997, 0.0759, 0.0559, 0.0847, 0.052, 0.0269, 0.0249, 0.017,
];
const DEFAULT_DOWN_END: [f64; 10] = [
    0.4186, 0.2538, 0.2089, 0.0889, 0.123, 0.0828, 0.0626, 0.056, 0.0826, 0.0751,
];

/// The reliable tier BidBrain keeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReliableTier {
    /// On-demand instances kept for backup shards (capped by the job's
    /// `max_reliable_instances`). Default 1.
    #[serde(default = "one_u32")]
    pub count: u32,
    /// `cheapest-per-hour` (default: in stage 3 the tier holds backups and does no work, so
    /// the cheapest instance per hour is the right one), `cheapest-per-work`, or an instance
    /// type of the job.
    #[serde(default)]
    pub instance_type: ReliableTypeChoice,
}

impl Default for ReliableTier {
    fn default() -> Self {
        ReliableTier {
            count: 1,
            instance_type: ReliableTypeChoice::CheapestPerHour,
        }
    }
}

/// Which on-demand type holds the backup shards.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ReliableTypeChoice {
    /// The job's type with the lowest on-demand price per unit of work (it may also do work).
    CheapestPerWork,
    /// The job's type with the lowest on-demand price per hour (backups need memory, not speed).
    #[default]
    CheapestPerHour,
    /// This type.
    Type(InstanceType),
}

impl TryFrom<String> for ReliableTypeChoice {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        match s.trim() {
            "cheapest-per-work" => Ok(ReliableTypeChoice::CheapestPerWork),
            "cheapest-per-hour" => Ok(ReliableTypeChoice::CheapestPerHour),
            other => InstanceType::parse(other).map(ReliableTypeChoice::Type).map_err(|e| {
                format!("{e} (allowed: cheapest-per-work, cheapest-per-hour, or an instance type such as c3.xlarge)")
            }),
        }
    }
}

impl From<ReliableTypeChoice> for String {
    fn from(c: ReliableTypeChoice) -> String {
        match c {
            ReliableTypeChoice::CheapestPerWork => "cheapest-per-work".into(),
            ReliableTypeChoice::CheapestPerHour => "cheapest-per-hour".into(),
            ReliableTypeChoice::Type(t) => t.to_string(),
        }
    }
}

fn default_deltas() -> Vec<f64> {
    vec![0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
}

impl BidBrainConfig {
    /// The bid deltas BidBrain searches unless its policy file says otherwise.
    pub fn default_bid_deltas() -> Vec<f64> {
        default_deltas()
    }
}
fn default_horizon() -> f64 {
    60.0
}
fn default_tick() -> f64 {
    5.0
}
fn default_release_window() -> f64 {
    3.0
}
fn default_max_per_allocation() -> u32 {
    32
}
fn one() -> f64 {
    1.0
}
fn one_u32() -> u32 {
    1
}
fn default_fill_slack() -> f64 {
    0.3
}
fn default_switch_margin() -> f64 {
    0.15
}

fn default_ahead_stint_restarts() -> f64 {
    10.0
}

/// Held to a runtime (`runtime_vs_standard`) and behind its line on the 2015 market, BidBrain
/// buys spot only at bids whose estimated chance of an eviction within the horizon is at most
/// this. Fixed before any run, not tuned.
pub const BEHIND_MAX_EVICTION: f64 = 0.1;

/// Chosen in sample (March–April 2015, 100 starts × seeds 1–2) by a rule fixed before the runs:
/// the cheapest of 1.0, 1.02, 1.05, 1.1, 1.15, 1.25 and `inf` whose median per-start runtime is
/// at most 1.10 × standard bidding's (the runtime at the default): 1.1 (runtime 1.097 /
/// 1.096, cost 0.988 / 1.001 × standard's; 1.15 ran 1.135 / 1.121). See `docs/bidbrain-gap.md`,
/// *BidBrain on the frontier*.
fn default_runtime_vs_standard() -> f64 {
    1.1
}

/// Standard bidding's runtime on a job over its runtime at full speed on instances never
/// evicted (start-up plus the work at full speed): 15.94 h against 15.71 h for the reference job
/// on every one of 300 March–April 2015 starts (in sample; seeds 1–3), so 1.015.
pub const STANDARD_OVER_FULL_SPEED: f64 = 1.015;

/// Standard bidding's expected runtime on `job`, seconds: the job at full speed from one
/// start-up, stretched by what standard bidding's evictions cost it
/// ([`STANDARD_OVER_FULL_SPEED`]).
pub fn standard_runtime_secs(job: &JobModel) -> f64 {
    (job.startup_secs + job.total_work / job.full_speed().max(1e-9) * 3600.0)
        * STANDARD_OVER_FULL_SPEED
}

impl BidBrainConfig {
    /// Checks values serde cannot: returns (key, problem, allowed).
    pub(crate) fn validate(&self) -> Result<Vec<Market>, (String, String, String)> {
        let bad = |k: &str, p: String, a: &str| Err((k.to_string(), p, a.to_string()));
        if self.bid_deltas.is_empty() {
            return bad(
                "bid_deltas",
                "is empty".into(),
                "a list of fractions ≥ 0, e.g. [0.0, 0.01, 0.1]",
            );
        }
        if self
            .bid_deltas
            .iter()
            .any(|d| !(d.is_finite() && *d >= 0.0))
        {
            return bad(
                "bid_deltas",
                format!("{:?} has a negative or non-finite value", self.bid_deltas),
                "fractions ≥ 0",
            );
        }
        if !(self.deadline_allowance.is_finite() && (0.0..=1.0).contains(&self.deadline_allowance))
        {
            return bad(
                "deadline_allowance",
                format!("{} is not a share between 0 and 1", self.deadline_allowance),
                "a number from 0 to 1",
            );
        }
        if self.runtime_vs_standard.is_nan() || self.runtime_vs_standard < 1.0 {
            return bad(
                "runtime_vs_standard",
                format!(
                    "{} is below 1: no runtime shorter than standard bidding's can be asked for",
                    self.runtime_vs_standard
                ),
                "a number ≥ 1, or inf for cost alone",
            );
        }
        if !(self.ahead_stint_restarts.is_finite() && self.ahead_stint_restarts >= 0.0) {
            return bad(
                "ahead_stint_restarts",
                format!("{} is not a count of restarts", self.ahead_stint_restarts),
                "a number ≥ 0",
            );
        }
        for (k, v) in [
            ("horizon_minutes", self.horizon_minutes),
            ("tick_minutes", self.tick_minutes),
            ("capacity_target", self.capacity_target),
            ("max_cost_vs_on_demand", self.max_cost_vs_on_demand),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(k, format!("{v} is not positive"), "a number > 0");
            }
        }
        if !(self.release_before_boundary_minutes.is_finite()
            && self.release_before_boundary_minutes >= 0.0
            && self.release_before_boundary_minutes < 60.0)
        {
            return bad(
                "release_before_boundary_minutes",
                format!("{} is out of range", self.release_before_boundary_minutes),
                "0 ≤ minutes < 60",
            );
        }
        if self.fill_slack.is_nan() || self.fill_slack < 0.0 {
            return bad(
                "fill_slack",
                format!("{} is negative", self.fill_slack),
                "a fraction ≥ 0",
            );
        }
        if self.allocations_per_market == 0 {
            return bad(
                "allocations_per_market",
                "is 0".into(),
                "a whole number ≥ 1",
            );
        }
        if !(self.switch_margin.is_finite() && self.switch_margin >= 0.0) {
            return bad(
                "switch_margin",
                format!("{} is negative", self.switch_margin),
                "a fraction ≥ 0",
            );
        }
        if self.max_per_allocation == 0 {
            return bad("max_per_allocation", "is 0".into(), "a whole number ≥ 1");
        }
        if let Err(p) = self.today.availability.check() {
            return bad(
                &format!("today.availability.{}", p.key),
                p.problem,
                "see `proteus simulate --fit-availability`",
            );
        }
        if !(self.today.margin_ticks.is_finite() && self.today.margin_ticks >= 0.0) {
            return bad(
                "today.margin_ticks",
                format!("{} is not a number of looks", self.today.margin_ticks),
                "a number ≥ 0",
            );
        }
        if self.today.availability.step_minutes > 30.0 {
            return bad(
                "today.availability.step_minutes",
                format!(
                    "{} is too coarse for the first hour's billing",
                    self.today.availability.step_minutes
                ),
                "at most 30 minutes",
            );
        }
        self.markets
            .iter()
            .map(|m| {
                Market::parse(m).map_err(|e| {
                    (
                        "markets".to_string(),
                        format!("`{m}`: {e}"),
                        "zone/type, e.g. us-east-1a/c3.xlarge".to_string(),
                    )
                })
            })
            .collect()
    }
}

/// Expected cost and useful work of one instance per horizon of its life.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Economics {
    cost: Usd,
    work: f64,
    /// Probability of an eviction within the horizon (and before the job ends).
    p_evict: f64,
}

impl Economics {
    /// What a decision records of it, per instance.
    fn expectation(self, horizon_secs: f64) -> Expectation {
        Expectation {
            cost_usd: self.cost.get(),
            work_units: self.work,
            eviction_probability: self.p_evict,
            horizon_hours: horizon_secs / 3600.0,
        }
    }

    /// Dollars per unit of work: a figure to rank by (infinite without work), not an amount.
    fn cpw(self) -> f64 {
        if self.work > 0.0 {
            self.cost.get() / self.work
        } else {
            f64::INFINITY
        }
    }
}

/// What a decision assumes about the job when it judges allocations.
#[derive(Debug, Clone, Copy)]
struct JobCosts {
    /// Seconds from launch to work.
    startup: f64,
    /// Work-seconds an evicted instance loses (its own work since the last sync).
    loss: f64,
    /// Units the whole footprint loses per membership change (AgileML re-splits partitions).
    rebalance_units: f64,
    /// Instances assumed to join and leave together (one membership change for all).
    batch: f64,
    /// Horizons the job still needs at its target speed (at least one): an instance cannot
    /// amortise its start-up over a longer life than that.
    periods_left: f64,
    /// Seconds until the job finishes at the footprint's current speed (tail releases).
    finish_secs: f64,
}

impl JobCosts {
    /// A new spot instance bought now at `price` with eviction risk `est`. Its start-up is
    /// spread over its expected life (1/P horizons, capped by the job's), because an instance
    /// that survives the horizon keeps working without starting again.
    fn new_spot(
        &self,
        billing: BillingModel,
        price: UsdPerHour,
        est: &EvictionEstimate,
        rate: f64,
    ) -> Economics {
        // Only an eviction before the job ends makes the hour free: the rest of the job, not
        // the horizon, is the window that counts.
        let est = &est.within(self.finish_secs);
        let p = est.probability;
        let periods = if p > 0.0 {
            (1.0 / p).min(self.periods_left)
        } else {
            self.periods_left
        }
        .max(1.0);
        let secs = est.expected_secs - self.startup / periods - p * self.loss;
        let overhead = self.rebalance_units * (1.0 / periods + p) / self.batch;
        Economics {
            cost: spot_cost(billing, price, est, 0.0),
            work: (rate * secs / 3600.0 - overhead).max(0.0),
            p_evict: p,
        }
    }

    /// A new on-demand instance: never evicted, list price for the whole horizon.
    fn new_on_demand(
        &self,
        billing: BillingModel,
        od: UsdPerHour,
        rate: f64,
        horizon_secs: f64,
    ) -> Economics {
        let periods = self.periods_left.max(1.0);
        // Work after the job is done is worth nothing (as for spot, see `new_spot`).
        let secs = horizon_secs.min(self.finish_secs) - self.startup / periods;
        Economics {
            cost: od.for_hours(billing.billed_hours(horizon_secs)),
            work: (rate * secs / 3600.0 - self.rebalance_units / (periods * self.batch)).max(0.0),
            p_evict: 0.0,
        }
    }
}

/// One allocation BidBrain could make.
#[derive(Debug, Clone)]
struct Candidate<'v> {
    market: &'v Market,
    purchase: Purchase,
    rate: f64,
    per_instance: Economics,
}

/// The BidBrain policy; see the module documentation.
pub struct BidBrain {
    name: String,
    config: BidBrainConfig,
    markets: Vec<Market>,
    /// Pools that refused a spot launch, and when: left out until the next tick.
    refused: BTreeMap<Market, Timestamp>,
    /// The deadline's slack ran out: on-demand to the end.
    committed: bool,
    /// The deadline plan's memory (one-instance jobs on today's market).
    today: today::Today,
    // Scratch space reused across decisions (a decision allocates little).
    deltas: Vec<f64>,
    estimates: Vec<EvictionEstimate>,
}

impl BidBrain {
    pub fn new(name: String, config: BidBrainConfig) -> Result<Self, (String, String, String)> {
        let markets = config.validate()?;
        Ok(BidBrain {
            name,
            config,
            markets,
            refused: BTreeMap::new(),
            committed: false,
            today: today::Today::default(),
            deltas: Vec::new(),
            estimates: Vec::new(),
        })
    }

    pub fn config(&self) -> &BidBrainConfig {
        &self.config
    }

    fn horizon_secs(&self) -> f64 {
        self.config.horizon_minutes * 60.0
    }

    fn allowed(&self, market: &Market, job: &JobModel) -> bool {
        job.rate(&market.instance_type).is_some()
            && (self.markets.is_empty() || self.markets.contains(market))
    }

    /// Units per hour BidBrain fills up to: the job's full speed on the slots the backup tier
    /// leaves, times `capacity_target`.
    /// The backup tier's size: the configured count, within the job's reliable limit, and
    /// leaving at least one slot for a worker (a one-instance job has no tier to keep).
    fn tier(&self, job: &JobModel) -> u32 {
        self.config
            .reliable
            .count
            .min(job.max_reliable_instances)
            .min(job.max_instances.saturating_sub(1))
    }

    fn target_speed(&self, job: &JobModel) -> f64 {
        let tier = self.tier(job);
        let worker_slots = f64::from(job.max_instances.saturating_sub(tier).max(1));
        self.config.capacity_target * job.full_speed() * worker_slots
            / f64::from(job.max_instances.max(1))
    }

    fn job_costs(&self, ctx: &DecisionContext<'_>, working_rate: f64) -> JobCosts {
        let job = ctx.job;
        let remaining = ctx.progress.remaining();
        let target = self.target_speed(job).max(1e-9);
        let rebalance_secs = match self.eviction_cost(job) {
            EvictionCost::AgileMl { rebalance_secs, .. } => rebalance_secs,
            EvictionCost::Checkpoint { .. } => 0.0,
        };
        JobCosts {
            startup: job.startup_secs,
            loss: self.eviction_cost(job).expected_loss_secs(),
            rebalance_units: target * rebalance_secs / 3600.0,
            batch: f64::from(self.config.max_per_allocation).max(1.0),
            periods_left: (remaining / target * 3600.0 / self.horizon_secs()).max(1.0),
            finish_secs: if working_rate > 0.0 {
                remaining / working_rate * 3600.0
            } else {
                f64::INFINITY
            },
        }
    }

    /// The deadline the job is paced against: its own, or else the runtime the policy accepts
    /// (`runtime_vs_standard` × standard bidding's) from its start.
    fn deadline(&self, ctx: &DecisionContext<'_>) -> Option<Timestamp> {
        let f = self.config.runtime_vs_standard;
        ctx.progress.deadline.or_else(|| {
            f.is_finite().then(|| {
                let secs = f * standard_runtime_secs(ctx.job);
                Timestamp::from_millis(ctx.progress.started_at.millis() + (secs * 1000.0) as i64)
            })
        })
    }

    /// Where the job stands against its deadline (see [`Plan`]). The line runs straight from
    /// (start, nothing done) to (deadline, all done), as Uniform Progress draws it.
    fn plan(&mut self, ctx: &DecisionContext<'_>, tick_secs: f64) -> Plan {
        let Some(deadline) = self.deadline(ctx) else {
            return Plan::Free;
        };
        let now = ctx.now();
        let job = ctx.job;
        let remaining = ctx.progress.remaining();
        let speed = job.full_speed().max(1e-9);
        let overhead = job.startup_secs;
        let slack = deadline.secs_since(now) - remaining / speed * 3600.0;
        // The safety net is on-demand to the end: only where on-demand can carry the job
        // (a job held to a runtime may have a reliable limit far below its instances; there,
        // being behind is as far as it goes).
        let can_commit = ctx.progress.deadline.is_some();
        if can_commit && (self.committed || slack <= 2.0 * overhead + tick_secs) {
            self.committed = true;
            return Plan::Commit;
        }
        let span = deadline.secs_since(ctx.progress.started_at).max(1.0);
        let elapsed = now.secs_since(ctx.progress.started_at).max(0.0);
        let target = ctx.progress.total_work * (elapsed / span).min(1.0);
        let done = ctx.progress.done_work;
        // A restart ahead at full speed, or enough that the on-demand stint that got the job
        // there (gaining `speed − slope` on the line) lasted `ahead_stint_restarts` restarts.
        let slope = ctx.progress.total_work / (span / 3600.0);
        let lead = overhead / 3600.0
            * speed.max(self.config.ahead_stint_restarts * (speed - slope).max(0.0));
        // The allowance: a share of the slack the job started with, in units of work.
        let initial_slack_h = span / 3600.0 - ctx.progress.total_work / speed;
        let allowance = self.config.deadline_allowance * initial_slack_h.max(0.0) * speed;
        if done < target - allowance {
            Plan::Behind
        } else if done >= target + lead {
            Plan::Ahead
        } else {
            Plan::Keep
        }
    }

    /// The reliable type and zone for backup shards.
    fn reliable_market<'v>(&self, ctx: &DecisionContext<'v>) -> Option<&'v Market> {
        let view = ctx.market;
        match &self.config.reliable.instance_type {
            ReliableTypeChoice::CheapestPerWork => {
                cheapest_on_demand(view, ctx.job, None).map(|(m, _, _)| m)
            }
            ReliableTypeChoice::Type(t) => {
                cheapest_on_demand(view, ctx.job, Some(t)).map(|(m, _, _)| m)
            }
            ReliableTypeChoice::CheapestPerHour => view
                .markets()
                .into_iter()
                .filter(|m| rate_of(ctx.job, m).is_some())
                .filter_map(|m| view.on_demand_price(m).map(|p| (m, p.get())))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(m, _)| m),
        }
    }

    /// Every allocation BidBrain could make now, cheapest per unit of work first: per market,
    /// an on-demand worker and the best `allocations_per_market` spot bids. `lasting`: only
    /// bids expected to last the horizon are spot candidates (an eviction chance of at most
    /// [`BEHIND_MAX_EVICTION`]; in a market with none, its bid least likely to be evicted).
    fn gather_candidates<'v>(
        &mut self,
        ctx: &DecisionContext<'v>,
        costs: &JobCosts,
        lasting: bool,
    ) -> Result<Vec<Candidate<'v>>, PolicyError> {
        let view = ctx.market;
        let job = ctx.job;
        let h = self.horizon_secs();
        let keep = self.config.allocations_per_market as usize;
        let mut candidates = Vec::with_capacity(32);
        let mut spot: Vec<Candidate<'v>> = Vec::with_capacity(self.config.bid_deltas.len());
        let price_driven = view.model_kind() == ModelKind::PriceDriven;
        for market in view.markets() {
            if !self.allowed(market, job) {
                continue;
            }
            let (Some(rate), Some(od)) = (rate_of(job, market), view.on_demand_price(market))
            else {
                continue;
            };
            candidates.push(Candidate {
                market,
                purchase: Purchase::OnDemand,
                rate,
                per_instance: costs.new_on_demand(ctx.billing, od, rate, h),
            });
            // No spot offer now (a driver's cool-down), or it refused us at this look.
            let Some(price) = view.spot_price(market) else {
                continue;
            };
            if self.refused.contains_key(market) {
                continue;
            }
            self.deltas.clear();
            if price_driven {
                self.deltas
                    .extend(self.config.bid_deltas.iter().map(|f| f * od.get()));
            } else if price <= od {
                // Evictions do not follow the bid: bid the on-demand price (today's default cap).
                self.deltas.push(od.get() - price.get());
            }
            self.estimates.clear();
            match view.eviction_many(market, &self.deltas, h, &mut self.estimates) {
                Ok(()) => {}
                // A market without enough history is not a candidate; others still are.
                Err(ModelError::NotEnoughHistory { .. }) | Err(ModelError::NoOnDemandPrice(_)) => {
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
            spot.clear();
            for (&delta, est) in self.deltas.iter().zip(&self.estimates) {
                let Ok(bid) = UsdPerHour::new(price.get() + delta) else {
                    continue;
                };
                spot.push(Candidate {
                    market,
                    purchase: Purchase::Spot { bid },
                    rate,
                    per_instance: costs.new_spot(ctx.billing, price, est, rate),
                });
            }
            if lasting {
                let least = spot
                    .iter()
                    .map(|c| c.per_instance.p_evict)
                    .fold(f64::INFINITY, f64::min);
                let limit = least.max(BEHIND_MAX_EVICTION);
                spot.retain(|c| c.per_instance.p_evict <= limit);
            }
            spot.sort_by(|a, b| a.per_instance.cpw().total_cmp(&b.per_instance.cpw()));
            candidates.extend(spot.drain(..).take(keep));
        }
        candidates.sort_by(|a, b| {
            a.per_instance
                .cpw()
                .total_cmp(&b.per_instance.cpw())
                .then(b.rate.total_cmp(&a.rate))
                .then_with(|| a.market.cmp(b.market))
        });
        Ok(candidates)
    }

    /// Work `inst` is expected to do before its current billing period ends (paid already):
    /// a spot instance works until the end of the period or its expected eviction, whichever
    /// is first (`memo` holds its estimate, from [`Self::keep_economics`]).
    fn paid_work_ahead(
        &self,
        ctx: &DecisionContext<'_>,
        inst: &InstanceView,
        memo: &[(&Market, f64, UsdPerHour, EvictionEstimate)],
    ) -> f64 {
        let now = ctx.now();
        let rate = rate_of(ctx.job, &inst.market).unwrap_or(0.0);
        let from = match inst.state {
            InstanceState::Starting { ready_at } => ready_at.max(now),
            _ => now,
        };
        let mut secs = ctx
            .billing
            .period_end(inst.launched_at, now)
            .secs_since(from)
            .max(0.0);
        if let Purchase::Spot { bid } = inst.purchase
            && let Some((_, _, _, est)) = memo
                .iter()
                .find(|(m, b, _, _)| *m == &inst.market && *b == bid.get())
        {
            secs = secs.min((est.expected_secs - from.secs_since(now)).max(0.0));
        }
        rate * secs / 3600.0
    }

    /// Expected cost and work of keeping `inst` for one more horizon from now, counting only
    /// work the job can still use after `usable_after` seconds (its paid period's end).
    fn keep_economics<'f>(
        &self,
        ctx: &DecisionContext<'_>,
        inst: &'f InstanceView,
        costs: &JobCosts,
        backup: bool,
        memo: &mut Vec<(&'f Market, f64, UsdPerHour, EvictionEstimate)>,
    ) -> Economics {
        let view = ctx.market;
        let now = ctx.now();
        let h = self.horizon_secs();
        let rate = if backup {
            0.0
        } else {
            rate_of(ctx.job, &inst.market).unwrap_or(0.0)
        };
        let startup_left = match inst.state {
            InstanceState::Starting { ready_at } => ready_at.secs_since(now).max(0.0),
            _ => 0.0,
        };
        // Work after the job is done is worth nothing: near the end, the next period is only
        // partly useful (what makes releasing before the last boundaries pay).
        let period_left = ctx
            .billing
            .period_end(inst.launched_at, now)
            .secs_since(now)
            .max(0.0);
        // Per-second billing has no sunk period, so nothing is gained by leaving early.
        let useful_cap = match ctx.billing {
            BillingModel::Hourly2015 => (costs.finish_secs - period_left).max(0.0),
            BillingModel::PerSecond => f64::INFINITY,
        };
        match inst.purchase {
            Purchase::OnDemand => {
                let od = view
                    .on_demand_price(&inst.market)
                    .unwrap_or(UsdPerHour::ZERO);
                Economics {
                    cost: od.for_hours(ctx.billing.billed_hours(h)),
                    work: rate * (h.min(useful_cap) - startup_left).max(0.0) / 3600.0,
                    p_evict: 0.0,
                }
            }
            Purchase::Spot { bid } => {
                // Instances of one allocation share market and bid: estimate each pair once.
                let cached = memo
                    .iter()
                    .find(|(m, b, _, _)| *m == &inst.market && *b == bid.get());
                let (price, est) = match cached {
                    Some(&(_, _, price, est)) => (price, est),
                    None => {
                        // A market without a spot offer now (a driver's cool-down after a
                        // refusal) still prices what already runs there.
                        let held_price = view
                            .spot_price(&inst.market)
                            .or_else(|| view.spot_price_at(&inst.market, now).ok().flatten());
                        let Some(price) = held_price else {
                            return Economics {
                                cost: Usd::ZERO,
                                work: 0.0,
                                p_evict: 0.0,
                            };
                        };
                        let est = view
                            .eviction(&inst.market, (bid.get() - price.get()).max(0.0), h)
                            .unwrap_or(EvictionEstimate::never(h));
                        memo.push((&inst.market, bid.get(), price, est));
                        (price, est)
                    }
                };
                // As for a new instance: an eviction after the job ends saves nothing.
                let est = est.within(costs.finish_secs);
                let p = est.probability;
                let secs = est.expected_secs.min(useful_cap) - startup_left - p * costs.loss;
                Economics {
                    cost: spot_cost(
                        ctx.billing,
                        price,
                        &est,
                        now.secs_since(inst.launched_at).max(0.0),
                    ),
                    work: (rate * secs / 3600.0 - costs.rebalance_units * p / costs.batch).max(0.0),
                    p_evict: p,
                }
            }
        }
    }
}

/// Expected charge of a spot instance `age_secs` old (0 for a new one) over the estimate's
/// horizon.
fn spot_cost(
    billing: BillingModel,
    price: UsdPerHour,
    est: &EvictionEstimate,
    age_secs: f64,
) -> Usd {
    match billing {
        // The period is charged at its start price unless the provider ends it inside.
        BillingModel::Hourly2015 => {
            price.for_hours(1.0 - est.probability) * billing.billed_hours(est.horizon_secs)
        }
        // The seconds it runs, unless the provider ends it within its first hour: then its
        // whole life is free. The share of the horizon's eviction risk that falls inside the
        // first hour is taken as proportional to the time (a constant hazard over the horizon).
        BillingModel::PerSecond => {
            let free_window = (FREE_INTERRUPTION_MS as f64 / 1000.0 - age_secs).max(0.0);
            let p_free = if est.horizon_secs > 0.0 {
                est.probability * (free_window / est.horizon_secs).min(1.0)
            } else {
                0.0
            };
            price.for_hours(billing.billed_hours(est.expected_secs) * (1.0 - p_free))
        }
    }
}

/// How a deadline shapes a decision: the job's progress against Uniform Progress's line, with
/// its hysteresis and safety net (see `policy/uniform_progress.rs`). BidBrain's own cost model
/// still picks the pools, the bids and the counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// No deadline: cost per unit of work alone.
    Free,
    /// Behind the line: on-demand may be bought (spot is still cheaper when it can be had),
    /// and on-demand held is kept.
    Behind,
    /// Between the line and a restart ahead of it: no new on-demand, what runs keeps running.
    Keep,
    /// A restart or more ahead: spot only; on-demand held is released (waiting is allowed).
    Ahead,
    /// The slack is down to two restarts and a tick: on-demand to the end.
    Commit,
}

impl Policy for BidBrain {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> PolicyKind {
        PolicyKind::BidBrain
    }

    fn eviction_cost(&self, job: &JobModel) -> EvictionCost {
        job.eviction_cost
    }

    fn named_markets(&self) -> Vec<Market> {
        self.markets.clone()
    }

    fn named_instance_types(&self) -> Vec<InstanceType> {
        match &self.config.reliable.instance_type {
            ReliableTypeChoice::Type(t) => vec![t.clone()],
            _ => Vec::new(),
        }
    }

    fn on_event(
        &mut self,
        ctx: &DecisionContext<'_>,
        event: &super::PolicyEvent,
    ) -> Result<Decision, PolicyError> {
        if let super::PolicyEvent::LaunchFailed { market, .. } = event {
            self.refused.insert(market.clone(), ctx.now());
            self.today
                .launch_failed(&self.config.today, market, ctx.now());
        }
        self.decide(ctx)
    }

    fn decide(&mut self, ctx: &DecisionContext<'_>) -> Result<Decision, PolicyError> {
        let now = ctx.now();
        let job = ctx.job;
        let remaining = ctx.progress.remaining();
        let tick =
            Timestamp::from_millis(now.millis() + (self.config.tick_minutes * 60_000.0) as i64);
        let mut decision = Decision {
            wake_at: Some(tick),
            ..Decision::default()
        };
        if remaining <= 0.0 {
            return Ok(decision);
        }
        let tick_secs = self.config.tick_minutes * 60.0;
        if self.config.today.plan
            && ctx.billing == BillingModel::PerSecond
            && ctx.progress.deadline.is_some()
            && job.max_instances == 1
            && ctx.market.model_kind() == ModelKind::Hazard
        {
            self.refused.retain(|_, at| now.secs_since(*at) < tick_secs);
            let pools: Vec<&Market> = ctx
                .market
                .markets()
                .into_iter()
                .filter(|m| self.allowed(m, job) && ctx.market.spot_price(m).is_some())
                .collect();
            if let Some(planned) = self.today.decide(
                &self.config.today,
                ctx,
                &pools,
                &self.refused,
                &mut self.committed,
                tick_secs,
            )? {
                return Ok(planned);
            }
        }
        let Some((_, od_cpw, _)) = cheapest_on_demand(ctx.market, job, None) else {
            return Err(PolicyError::NoMarket {
                types: job
                    .rates()
                    .map(|(t, _)| t.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                now,
            });
        };
        let mut ceiling = self.config.max_cost_vs_on_demand * od_cpw;

        // The footprint: the backup tier is the oldest active on-demand instances, up to the
        // tier's size; they hold state, not work (stage 3), and are never released.
        let tier_size = self.tier(job) as usize;
        let mut active: Vec<&InstanceView> =
            ctx.footprint.iter().filter(|i| i.is_active()).collect();
        active.sort_by_key(|i| (i.launched_at, i.id.clone()));
        let mut backups = 0usize;
        let mut members: Vec<(&InstanceView, bool)> = Vec::with_capacity(active.len());
        for inst in active {
            let backup = inst.purchase == Purchase::OnDemand && backups < tier_size;
            backups += usize::from(backup);
            members.push((inst, backup));
        }
        let working_rate: f64 = members
            .iter()
            .filter(|(_, backup)| !backup)
            .map(|(i, _)| rate_of(job, &i.market).unwrap_or(0.0))
            .sum();
        let mut costs = self.job_costs(ctx, working_rate);
        self.refused.retain(|_, at| now.secs_since(*at) < tick_secs);
        let plan = self.plan(ctx, tick_secs);
        // Held to a runtime on a market whose evictions follow the bid: behind the line, spot
        // at bids expected to last the horizon (standard bidding's way to keep pace), and
        // every free slot filled under the ceiling, however it compares with the best.
        let held_behind = plan == Plan::Behind
            && ctx.progress.deadline.is_none()
            && ctx.market.model_kind() == ModelKind::PriceDriven;
        let mut candidates = self.gather_candidates(ctx, &costs, held_behind)?;
        match plan {
            Plan::Free | Plan::Behind => {}
            Plan::Ahead | Plan::Keep => candidates.retain(|c| c.purchase != Purchase::OnDemand),
            // On-demand first; spot only for slots the job's reliable limit leaves.
            Plan::Commit => candidates.sort_by_key(|c| c.purchase != Purchase::OnDemand),
        }
        // On-demand candidates carry start-up like any other: measure the ceiling the same way,
        // so that with no usable spot market BidBrain still runs the job on-demand.
        if let Some(od_new) = candidates
            .iter()
            .filter(|c| c.purchase == Purchase::OnDemand)
            .map(|c| c.per_instance.cpw())
            .filter(|c| c.is_finite())
            .min_by(f64::total_cmp)
        {
            ceiling = ceiling.max(self.config.max_cost_vs_on_demand * od_new);
        }
        let best_new = candidates
            .iter()
            .map(|c| c.per_instance.cpw())
            .find(|c| c.is_finite())
            .unwrap_or(f64::INFINITY);
        let target = self.target_speed(job);
        let full = members.len() >= job.max_instances as usize;
        let fast_enough = working_rate >= target;

        // Releases. First every member's economics for one more horizon and whether it may go
        // now; then, dearest first, each judged against the footprint shrunk by the ones before.
        let window_ms = (self.config.release_before_boundary_minutes * 60_000.0) as i64;
        let stop_ms = (job.stop_secs * 1000.0) as i64;
        let mut next_wake = tick;
        let mut memo = Vec::with_capacity(8);
        let finish_all = costs.finish_secs;
        let mut judged: Vec<(&InstanceView, bool, Economics)> = Vec::with_capacity(members.len());
        // Work the footprint does in billing periods it has already paid for (hourly-2015).
        let mut paid_ahead = 0.0;
        for (inst, backup) in members {
            let releasable_now = !backup
                && match ctx.billing {
                    BillingModel::Hourly2015 => {
                        // A release asked after `close` would end after the boundary (a
                        // graceful stop takes up to the job's `stop_secs`): the window closes
                        // that much earlier.
                        let end = ctx.billing.period_end(inst.launched_at, now);
                        let close = end.millis() - stop_ms;
                        let open = Timestamp::from_millis(close - window_ms);
                        let inside = open <= now && now.millis() < close;
                        let mut wake = open;
                        if wake <= now {
                            wake = Timestamp::from_millis(wake.millis() + crate::billing::HOUR_MS);
                        }
                        next_wake = next_wake.min(wake);
                        inside
                    }
                    BillingModel::PerSecond => {
                        !matches!(inst.state, InstanceState::Starting { .. })
                    }
                };
            costs.finish_secs = finish_all;
            let econ = self.keep_economics(ctx, inst, &costs, backup, &mut memo);
            if !backup && matches!(ctx.billing, BillingModel::Hourly2015) {
                paid_ahead += self.paid_work_ahead(ctx, inst, &memo);
            }
            judged.push((inst, releasable_now, econ));
        }
        // The end game (hourly-2015): an instance renewed at its boundary pays a whole hour,
        // but its work only matters for what the footprint cannot do in the hours it has
        // already paid for. Hand that shortfall out, cheapest renewal first; a renewal that
        // gets none of it is worth nothing and is released.
        let mut useful_caps: Vec<f64> = vec![f64::INFINITY; judged.len()];
        if matches!(ctx.billing, BillingModel::Hourly2015) {
            let mut order: Vec<usize> = (0..judged.len()).filter(|&k| judged[k].1).collect();
            order.sort_by(|&a, &b| judged[a].2.cpw().total_cmp(&judged[b].2.cpw()));
            let mut left = remaining - paid_ahead;
            for k in order {
                useful_caps[k] = left.max(0.0);
                judged[k].2.work = judged[k].2.work.min(useful_caps[k]);
                left -= judged[k].2.work;
            }
        }
        let mut judged: Vec<(&InstanceView, bool, Economics, f64)> = judged
            .into_iter()
            .zip(useful_caps)
            .map(|((i, r, e), cap)| (i, r, e, cap))
            .collect();
        judged.sort_by(|a, b| b.2.cpw().total_cmp(&a.2.cpw()));
        let (mut fp_cost, mut fp_work) = judged
            .iter()
            .fold((Usd::ZERO, 0.0), |(c, w), (_, _, e, _)| {
                (c + e.cost, w + e.work)
            });
        let mut rate_left = working_rate;
        // What the footprint will not do in paid hours nor in the hours renewed now (hourly-2015).
        let mut shortfall = match ctx.billing {
            BillingModel::Hourly2015 => remaining - paid_ahead,
            BillingModel::PerSecond => f64::INFINITY,
        };
        let mut kept: Vec<(&InstanceView, Economics)> = Vec::with_capacity(judged.len());
        // Committed to on-demand: spot goes only where on-demand can take its place.
        let mut commit_room = (job.max_reliable_instances as usize).saturating_sub(
            judged
                .iter()
                .filter(|(i, ..)| i.purchase == Purchase::OnDemand)
                .count(),
        );
        for (inst, releasable_now, econ, useful_cap) in judged {
            let inst_rate = rate_of(job, &inst.market).unwrap_or(0.0);
            let mut econ = econ;
            if releasable_now && matches!(ctx.billing, BillingModel::Hourly2015) {
                // Near the end, judge with the finish time of the footprint as it is now.
                costs.finish_secs = if rate_left > 0.0 {
                    remaining / rate_left * 3600.0
                } else {
                    f64::INFINITY
                };
                econ = self.keep_economics(ctx, inst, &costs, false, &mut memo);
                econ.work = econ.work.min(useful_cap);
            }
            let cpw = econ.cpw();
            // A replacement must be at least as fast per slot, or releasing would only make
            // room that the footprint cannot fill as well (and the next decision would flap back).
            let best_replacement = candidates
                .iter()
                .filter(|c| c.rate >= inst_rate - 1e-9)
                .map(|c| c.per_instance.cpw())
                .find(|c| c.is_finite())
                .unwrap_or(f64::INFINITY);
            let margin = 1.0 + self.config.switch_margin;
            let others_cpw = if fp_work - econ.work > 0.0 {
                (fp_cost - econ.cost).get() / (fp_work - econ.work)
            } else {
                f64::INFINITY
            };
            let on_demand = inst.purchase == Purchase::OnDemand;
            let rule: Option<String> = match plan {
                // Well ahead: on-demand goes (waiting for spot is allowed); on-demand to the
                // end: spot goes. Both at the usual moment (never a backup, never a paid hour).
                Plan::Ahead if on_demand => releasable_now.then(|| {
                    "the job is ahead of its deadline's line: on-demand goes at the end of its \
                     paid hour"
                        .to_string()
                }),
                Plan::Commit if !on_demand => {
                    let go = releasable_now && commit_room > 0;
                    commit_room -= usize::from(go);
                    go.then(|| {
                        "committed to on-demand for the deadline: spot goes where on-demand \
                         takes its place"
                            .to_string()
                    })
                }
                // Hysteresis: on-demand bought to keep pace stays until well ahead.
                Plan::Behind | Plan::Keep | Plan::Commit if on_demand => None,
                _ if !releasable_now => None,
                _ if cpw > ceiling => Some(format!(
                    "above the ceiling of ${ceiling:.4} per unit (a multiple of on-demand's)"
                )),
                _ if cpw > best_replacement * margin && (full || fast_enough) => Some(format!(
                    "a replacement does the work for ${best_replacement:.4} per unit"
                )),
                // The paper's rule: keeping it raises the footprint's cost per work, and the
                // footprint stays at its target speed without it.
                _ if cpw > others_cpw * margin && rate_left - inst_rate >= target => Some(format!(
                    "the rest of the footprint costs ${others_cpw:.4} per unit and keeps the \
                         target speed without it"
                )),
                _ => None,
            };
            if let Some(rule) = rule {
                decision.release.push(inst.id.clone());
                decision.reasons.push(Reason {
                    subject: Subject::Release {
                        instance: inst.id.clone(),
                        market: inst.market.clone(),
                    },
                    expected: econ.expectation(self.horizon_secs()),
                    rule,
                });
                rate_left -= inst_rate;
                fp_cost -= econ.cost;
                fp_work -= econ.work;
            } else {
                if releasable_now {
                    shortfall -= econ.work;
                }
                kept.push((inst, econ));
            }
        }
        decision.wake_at = Some(next_wake.max(now + std::time::Duration::from_secs(1)));

        // Acquisitions.
        let mut slots = (job.max_instances as usize).saturating_sub(kept.len());
        let reliable_active = kept
            .iter()
            .filter(|(i, _)| i.purchase == Purchase::OnDemand)
            .count();
        let backups_kept = backups.min(reliable_active);
        let mut reliable_room =
            (job.max_reliable_instances as usize).saturating_sub(reliable_active);
        if backups_kept < tier_size && slots > 0 {
            let need = (tier_size - backups_kept).min(slots).min(reliable_room);
            if let Some(m) = self.reliable_market(ctx).filter(|_| need > 0) {
                let acquisition = Acquisition {
                    market: m.clone(),
                    purchase: Purchase::OnDemand,
                    count: need as u32,
                };
                let h = self.horizon_secs();
                let od = ctx.market.on_demand_price(m).unwrap_or(UsdPerHour::ZERO);
                decision.reasons.push(Reason {
                    subject: Subject::Acquire(acquisition.clone()),
                    expected: Economics {
                        cost: od.for_hours(ctx.billing.billed_hours(h)),
                        work: 0.0,
                        p_evict: 0.0,
                    }
                    .expectation(h),
                    rule: format!(
                        "the reliable tier (backup state, no work of its own) holds \
                         {backups_kept} of its {tier_size}"
                    ),
                });
                decision.acquire.push(acquisition);
                slots -= need;
                reliable_room -= need;
            }
        }
        let mut rate = rate_left;
        // Committed: the safety net counted on full speed to the deadline, so every free slot
        // is filled (on-demand first), whatever one more horizon of the footprint would do.
        let commit = plan == Plan::Commit;
        // Near the end, the footprint finishes within the horizon: nothing new is worth starting.
        if !commit && (fp_work >= remaining || shortfall <= 0.0) {
            return Ok(decision);
        }
        let mut used_markets: Vec<&Market> = Vec::new();
        let fill_ceiling = if held_behind {
            ceiling
        } else {
            ceiling.min(best_new * (1.0 + self.config.fill_slack))
        };
        for pass in 0..2 {
            for cand in &candidates {
                if slots == 0 || (!commit && fp_work >= remaining) {
                    break;
                }
                let cpw = cand.per_instance.cpw();
                // Sorted cheapest first: the rest do no useful work (or cost too much).
                if !cpw.is_finite() || cpw > ceiling {
                    break;
                }
                let uses = used_markets.iter().filter(|m| **m == cand.market).count();
                if uses >= self.config.allocations_per_market as usize {
                    continue;
                }
                let below_target = rate < target && cpw <= fill_ceiling;
                // First pass: skip types too small to reach the target with the slots left.
                if pass == 0 && below_target && cand.rate * (slots as f64) < target - rate {
                    continue;
                }
                let fp_cpw = if fp_work > 0.0 {
                    fp_cost.get() / fp_work
                } else {
                    f64::INFINITY
                };
                let (mut count, rule) = if commit {
                    (
                        slots,
                        "committed to the deadline: every free slot is filled".to_string(),
                    )
                } else if below_target {
                    (
                        ((target - rate) / cand.rate).ceil() as usize,
                        format!(
                            "the footprint works {rate:.2} units an hour, below the target of \
                             {target:.2}"
                        ),
                    )
                } else if cpw < fp_cpw {
                    (
                        self.config.max_per_allocation as usize,
                        format!("cheaper per unit than the footprint's ${fp_cpw:.4}"),
                    )
                } else {
                    (0, String::new())
                };
                count = count
                    .min(slots)
                    .min(self.config.max_per_allocation as usize);
                if cand.purchase == Purchase::OnDemand {
                    count = count.min(reliable_room);
                }
                // Do not buy more work than is left, nor (hourly-2015) more paid hours than the
                // shortfall needs if the allocation is not evicted.
                let per = cand.per_instance.work.max(1e-9);
                let full_hour =
                    cand.rate * (self.horizon_secs() - job.startup_secs).max(60.0) / 3600.0;
                if !commit {
                    count = count.min(((remaining - fp_work) / per).ceil().max(1.0) as usize);
                    count = count.min((shortfall / full_hour).ceil().max(0.0) as usize);
                }
                if count == 0 {
                    continue;
                }
                let rule = if held_behind && cand.purchase != Purchase::OnDemand {
                    format!(
                        "{rule}; behind the line to the runtime asked (runtime_vs_standard),                          at a bid expected to last the hour"
                    )
                } else {
                    rule
                };
                let acquisition = Acquisition {
                    market: cand.market.clone(),
                    purchase: cand.purchase,
                    count: count as u32,
                };
                decision.reasons.push(Reason {
                    subject: Subject::Acquire(acquisition.clone()),
                    expected: cand.per_instance.expectation(self.horizon_secs()),
                    rule,
                });
                decision.acquire.push(acquisition);
                used_markets.push(cand.market);
                slots -= count;
                if cand.purchase == Purchase::OnDemand {
                    reliable_room -= count;
                }
                rate += cand.rate * count as f64;
                shortfall -= full_hour * count as f64;
                fp_cost += cand.per_instance.cost * count as f64;
                fp_work += cand.per_instance.work * count as f64;
            }
        }
        Ok(decision)
    }
}
