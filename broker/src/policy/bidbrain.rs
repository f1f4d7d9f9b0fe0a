//! BidBrain (Proteus, EuroSys'17): buy capacity to minimise the expected cost per unit of work.
//!
//! Every allocation (a count of instances in one market at one bid) is judged by its expected
//! cost and expected useful work over a horizon (one billing hour by default):
//!
//! - a new spot instance bid at `price + delta` costs, under `hourly-2015`, the current price
//!   times the probability that it is *not* evicted within the hour (an eviction makes the
//!   started hour free), and under `per-second`, the price times its expected running time;
//! - it works at its type's rate for its expected running time, minus the start-up time and
//!   minus the expected work lost to an eviction (AgileML: half a sync interval);
//! - an on-demand instance costs the list price and is never evicted.
//!
//! The footprint's cost per work (CPW) is the sum of expected costs over the sum of expected
//! work of what it keeps. At each decision BidBrain
//!
//! 1. keeps a small reliable tier of on-demand instances for the backup parameter-server shards
//!    (AgileML needs state that outlives a bulk eviction);
//! 2. releases an allocation when keeping it for another billing period would cost more per
//!    unit of work than the on-demand ceiling, or clearly more than the best allocation it
//!    could buy instead while the footprint is full (or fast enough) — under `hourly-2015` only
//!    in the last minutes before the allocation's hour ends, because the hour is paid anyway;
//! 3. acquires the cheapest allocations per unit of work — over every market of the job's types
//!    and every bid delta of its grid — while the footprint is below its capacity target (by
//!    default the job's full speed: `max_instances` reference instances) and the allocation is
//!    below the ceiling, and beyond the target while an allocation lowers the footprint's CPW
//!    (the paper's rule), up to `max_instances`.
//!
//! The free partial hour of `hourly-2015` is exploited through the first term: a small delta in a
//! market that moves often gives a high eviction probability, hence a low expected cost, and
//! the grid search picks it when the expected work stays worth it.

use super::{
    Acquisition, Decision, DecisionContext, InstanceState, InstanceView, Policy, PolicyError,
    PolicyKind, Purchase, cheapest_on_demand, rate_of,
};
use crate::billing::BillingModel;
use crate::job::{EvictionCost, JobModel};
use crate::market::{InstanceType, Market, Timestamp, UsdPerHour};
use crate::market_model::{EvictionEstimate, ModelError, ModelKind};
use serde::{Deserialize, Serialize};

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
    /// How often the policy wants to be asked even if nothing happens, minutes. Default 10.
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
    /// Replace a kept allocation only when a new one is at least this much cheaper per unit of
    /// work (0.15 = 15%); damps flapping between near-equal markets.
    #[serde(default = "default_switch_margin")]
    pub switch_margin: f64,
    /// The reliable (on-demand) tier for backup parameter-server shards.
    #[serde(default)]
    pub reliable: ReliableTier,
}

/// The reliable tier BidBrain keeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReliableTier {
    /// On-demand instances kept for backup shards (capped by the job's
    /// `max_reliable_instances`). Default 1.
    #[serde(default = "one_u32")]
    pub count: u32,
    /// `cheapest-per-work` (default), `cheapest-per-hour`, or an instance type of the job.
    #[serde(default)]
    pub instance_type: ReliableTypeChoice,
}

impl Default for ReliableTier {
    fn default() -> Self {
        ReliableTier {
            count: 1,
            instance_type: ReliableTypeChoice::CheapestPerWork,
        }
    }
}

/// Which on-demand type holds the backup shards.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ReliableTypeChoice {
    /// The job's type with the lowest on-demand price per unit of work (it may also do work).
    #[default]
    CheapestPerWork,
    /// The job's type with the lowest on-demand price per hour (backups need memory, not speed).
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
fn default_horizon() -> f64 {
    60.0
}
fn default_tick() -> f64 {
    10.0
}
fn default_release_window() -> f64 {
    3.0
}
fn default_max_per_allocation() -> u32 {
    16
}
fn one() -> f64 {
    1.0
}
fn one_u32() -> u32 {
    1
}
fn default_switch_margin() -> f64 {
    0.15
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

/// Expected cost and useful work of one instance over the horizon.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Economics {
    cost: f64,
    work: f64,
}

impl Economics {
    fn cpw(self) -> f64 {
        if self.work > 0.0 {
            self.cost / self.work
        } else {
            f64::INFINITY
        }
    }
}

/// One allocation BidBrain could make.
#[derive(Debug, Clone)]
struct Candidate {
    market: Market,
    purchase: Purchase,
    rate: f64,
    per_instance: Economics,
}

/// The BidBrain policy; see the module documentation.
pub struct BidBrain {
    name: String,
    config: BidBrainConfig,
    markets: Vec<Market>,
    // Scratch space reused across decisions (a decision allocates little).
    deltas: Vec<f64>,
    estimates: Vec<EvictionEstimate>,
    candidates: Vec<Candidate>,
}

impl BidBrain {
    pub fn new(name: String, config: BidBrainConfig) -> Result<Self, (String, String, String)> {
        let markets = config.validate()?;
        Ok(BidBrain {
            name,
            config,
            markets,
            deltas: Vec::new(),
            estimates: Vec::new(),
            candidates: Vec::new(),
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

    /// A new spot instance bought now at `price` whose eviction risk is `est`.
    fn new_spot(
        &self,
        billing: BillingModel,
        price: f64,
        est: &EvictionEstimate,
        rate: f64,
        startup: f64,
        loss: f64,
    ) -> Economics {
        let cost = spot_cost(billing, price, est);
        let useful = (est.expected_secs - startup - est.probability * loss).max(0.0);
        Economics {
            cost,
            work: rate * useful / 3600.0,
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

    /// Fills `self.candidates` with every allocation BidBrain could make now, cheapest first.
    fn gather_candidates(
        &mut self,
        ctx: &DecisionContext<'_>,
        loss: f64,
    ) -> Result<(), PolicyError> {
        let view = ctx.market;
        let job = ctx.job;
        let h = self.horizon_secs();
        let startup = job.startup_secs;
        let mut candidates = std::mem::take(&mut self.candidates);
        candidates.clear();
        let price_driven = view.model_kind() == ModelKind::PriceDriven;
        for market in view.markets() {
            if !self.allowed(market, job) {
                continue;
            }
            let (Some(rate), Some(od), Some(price)) = (
                rate_of(job, market),
                view.on_demand_price(market),
                view.spot_price(market),
            ) else {
                continue;
            };
            let (od, price) = (od.get(), price.get());
            // On-demand workers: never evicted, list price for the whole horizon.
            candidates.push(Candidate {
                market: market.clone(),
                purchase: Purchase::OnDemand,
                rate,
                per_instance: Economics {
                    cost: od * billed_hours(ctx.billing, h),
                    work: rate * (h - startup).max(0.0) / 3600.0,
                },
            });
            self.deltas.clear();
            if price_driven {
                self.deltas
                    .extend(self.config.bid_deltas.iter().map(|f| f * od));
            } else if price <= od {
                // Evictions do not follow the bid: bid the on-demand price (today's default cap).
                self.deltas.push(od - price);
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
            for (&delta, est) in self.deltas.iter().zip(&self.estimates) {
                let Ok(bid) = UsdPerHour::new(price + delta) else {
                    continue;
                };
                candidates.push(Candidate {
                    market: market.clone(),
                    purchase: Purchase::Spot { bid },
                    rate,
                    per_instance: self.new_spot(ctx.billing, price, est, rate, startup, loss),
                });
            }
        }
        candidates.sort_by(|a, b| {
            a.per_instance
                .cpw()
                .total_cmp(&b.per_instance.cpw())
                .then(b.rate.total_cmp(&a.rate))
                .then_with(|| a.market.cmp(&b.market))
        });
        self.candidates = candidates;
        Ok(())
    }

    /// Expected cost and work of keeping `inst` for one more horizon from now.
    fn keep_economics(
        &self,
        ctx: &DecisionContext<'_>,
        inst: &InstanceView,
        loss: f64,
        backup: bool,
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
        match inst.purchase {
            Purchase::OnDemand => {
                let od = view
                    .on_demand_price(&inst.market)
                    .map_or(0.0, UsdPerHour::get);
                Economics {
                    cost: od * billed_hours(ctx.billing, h),
                    work: rate * (h - startup_left).max(0.0) / 3600.0,
                }
            }
            Purchase::Spot { bid } => {
                let Some(price) = view.spot_price(&inst.market).map(UsdPerHour::get) else {
                    return Economics {
                        cost: 0.0,
                        work: 0.0,
                    };
                };
                let est = view
                    .eviction(&inst.market, (bid.get() - price).max(0.0), h)
                    .unwrap_or(EvictionEstimate::never(h));
                Economics {
                    cost: spot_cost(ctx.billing, price, &est),
                    work: rate
                        * (est.expected_secs - startup_left - est.probability * loss).max(0.0)
                        / 3600.0,
                }
            }
        }
    }
}

/// Expected charge of a spot instance over the estimate's horizon.
fn spot_cost(billing: BillingModel, price: f64, est: &EvictionEstimate) -> f64 {
    match billing {
        // The period is charged at its start price unless the provider ends it inside.
        BillingModel::Hourly2015 => {
            price * (1.0 - est.probability) * (est.horizon_secs / 3600.0).ceil().max(1.0)
        }
        BillingModel::PerSecond => price * est.expected_secs.max(60.0) / 3600.0,
    }
}

/// Hours charged for running a reliable instance over `horizon_secs`.
fn billed_hours(billing: BillingModel, horizon_secs: f64) -> f64 {
    match billing {
        BillingModel::Hourly2015 => (horizon_secs / 3600.0).ceil().max(1.0),
        BillingModel::PerSecond => horizon_secs.max(60.0) / 3600.0,
    }
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

    fn decide(&mut self, ctx: &DecisionContext<'_>) -> Result<Decision, PolicyError> {
        let now = ctx.now();
        let job = ctx.job;
        let remaining = ctx.progress.remaining();
        let tick = Timestamp(now.0 + (self.config.tick_minutes * 60_000.0) as i64);
        let mut decision = Decision {
            wake_at: Some(tick),
            ..Decision::default()
        };
        if remaining <= 0.0 {
            return Ok(decision);
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
        let ceiling = self.config.max_cost_vs_on_demand * od_cpw;
        let loss = self.eviction_cost(job).expected_loss_secs();
        self.gather_candidates(ctx, loss)?;

        // The backup tier: the oldest active on-demand instances, up to the tier's size.
        let tier_size = self.config.reliable.count.min(job.max_reliable_instances) as usize;
        let mut active: Vec<&InstanceView> =
            ctx.footprint.iter().filter(|i| i.is_active()).collect();
        active.sort_by_key(|i| (i.launched_at, i.id.clone()));
        let mut backups = 0usize;
        let mut kept: Vec<(&InstanceView, bool, Economics)> = Vec::with_capacity(active.len());
        // Instances of one allocation share market and bid; judge each pair once.
        let mut memo: Vec<(&Market, Option<f64>, bool, Economics)> = Vec::new();
        for inst in active {
            let backup = inst.purchase == Purchase::OnDemand && backups < tier_size;
            backups += usize::from(backup);
            let key_bid = inst.purchase.bid().map(UsdPerHour::get);
            let startup_free = !matches!(inst.state, InstanceState::Starting { .. });
            let econ = match memo
                .iter()
                .find(|(m, b, s, _)| *m == &inst.market && *b == key_bid && *s == startup_free)
            {
                Some(&(_, _, _, e)) if startup_free => e,
                _ => {
                    let e = self.keep_economics(ctx, inst, loss, backup);
                    if startup_free && !backup {
                        memo.push((&inst.market, key_bid, startup_free, e));
                    }
                    e
                }
            };
            kept.push((inst, backup, econ));
        }

        // Releases.
        let window_ms = (self.config.release_before_boundary_minutes * 60_000.0) as i64;
        let best_new = self
            .candidates
            .iter()
            .map(|c| c.per_instance.cpw())
            .find(|c| c.is_finite())
            .unwrap_or(f64::INFINITY);
        let target = self.config.capacity_target * job.full_speed();
        let working_rate: f64 = kept
            .iter()
            .filter(|(_, backup, _)| !backup)
            .map(|(i, _, _)| rate_of(job, &i.market).unwrap_or(0.0))
            .sum();
        let full = kept.len() >= job.max_instances as usize;
        let fast_enough = working_rate >= target;
        let mut next_wake = tick;
        let mut released_rate = 0.0;
        kept.retain(|(inst, backup, econ)| {
            if *backup {
                return true;
            }
            let releasable_now = match ctx.billing {
                BillingModel::Hourly2015 => {
                    let end = ctx.billing.period_end(inst.launched_at, now);
                    let mut wake = Timestamp(end.0 - window_ms);
                    let inside = wake <= now;
                    if inside {
                        wake = Timestamp(wake.0 + crate::billing::HOUR_MS);
                    }
                    next_wake = next_wake.min(wake);
                    inside
                }
                BillingModel::PerSecond => !matches!(inst.state, InstanceState::Starting { .. }),
            };
            if !releasable_now {
                return true;
            }
            let cpw = econ.cpw();
            let release = cpw > ceiling
                || (cpw > best_new * (1.0 + self.config.switch_margin) && (full || fast_enough));
            if release {
                decision.release.push(inst.id.clone());
                released_rate += rate_of(job, &inst.market).unwrap_or(0.0);
            }
            !release
        });
        decision.wake_at = Some(next_wake.max(Timestamp(now.0 + 1_000)));

        // Acquisitions.
        let mut slots = (job.max_instances as usize).saturating_sub(kept.len());
        let reliable_active = kept
            .iter()
            .filter(|(i, _, _)| i.purchase == Purchase::OnDemand)
            .count();
        let backups_kept = kept.iter().filter(|(_, b, _)| *b).count();
        let mut reliable_room =
            (job.max_reliable_instances as usize).saturating_sub(reliable_active);
        if backups_kept < tier_size && slots > 0 {
            let need = (tier_size - backups_kept).min(slots).min(reliable_room);
            if need > 0 {
                if let Some(m) = self.reliable_market(ctx) {
                    decision.acquire.push(Acquisition {
                        market: m.clone(),
                        purchase: Purchase::OnDemand,
                        count: need as u32,
                    });
                    slots -= need;
                    reliable_room -= need;
                }
            }
        }
        let mut rate = working_rate - released_rate;
        let (mut fp_cost, mut fp_work) = kept
            .iter()
            .fold((0.0, 0.0), |(c, w), (_, _, e)| (c + e.cost, w + e.work));
        // Near the end, the footprint finishes within the horizon: nothing new is worth starting.
        if fp_work >= remaining {
            return Ok(decision);
        }
        let mut used_markets: Vec<&Market> = Vec::new();
        for pass in 0..2 {
            for cand in &self.candidates {
                if slots == 0 || fp_work >= remaining {
                    break;
                }
                let cpw = cand.per_instance.cpw();
                if !(cpw <= ceiling) {
                    break;
                }
                if used_markets.contains(&&cand.market) {
                    continue;
                }
                let below_target = rate < target;
                // First pass: skip types too small to reach the target with the slots left.
                if pass == 0 && below_target && cand.rate * (slots as f64) < target - rate {
                    continue;
                }
                let fp_cpw = if fp_work > 0.0 {
                    fp_cost / fp_work
                } else {
                    f64::INFINITY
                };
                let mut count = if below_target {
                    ((target - rate) / cand.rate).ceil() as usize
                } else if cpw < fp_cpw {
                    self.config.max_per_allocation as usize
                } else {
                    0
                };
                count = count
                    .min(slots)
                    .min(self.config.max_per_allocation as usize);
                if cand.purchase == Purchase::OnDemand {
                    count = count.min(reliable_room);
                }
                // Do not buy more work than is left.
                let per = cand.per_instance.work.max(1e-9);
                count = count.min(((remaining - fp_work) / per).ceil().max(1.0) as usize);
                if count == 0 {
                    continue;
                }
                decision.acquire.push(Acquisition {
                    market: cand.market.clone(),
                    purchase: cand.purchase,
                    count: count as u32,
                });
                used_markets.push(&cand.market);
                slots -= count;
                if cand.purchase == Purchase::OnDemand {
                    reliable_room -= count;
                }
                rate += cand.rate * count as f64;
                fp_cost += cand.per_instance.cost * count as f64;
                fp_work += cand.per_instance.work * count as f64;
            }
        }
        Ok(decision)
    }
}
