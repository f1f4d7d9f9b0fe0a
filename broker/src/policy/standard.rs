//! Standard bidding: what people did before BidBrain, given its best honest shot.
//!
//! Spot capacity for the whole job (`max_instances`) in the single cheapest market per unit of
//! work, bidding the on-demand price (so it is evicted only when spot is dearer than on-demand);
//! the job checkpoints every `interval_minutes`, stalling `checkpoint_minutes` each time; after
//! an eviction it relaunches in the same market if the price is back under the bid, otherwise in
//! the next-cheapest market, and restarts from the last checkpoint (`restart_minutes` plus the
//! instances' start-up). The checkpointing is not simulator magic: it is the job's eviction-cost
//! model ([`EvictionCost::Checkpoint`]) that this policy reports through
//! [`Policy::eviction_cost`], and the driver accounts work under it.
//!
//! "Cheapest" is judged, by default, on the time-weighted mean price over the last week rather
//! than on the price of the moment: a careful user looks at the price history before choosing,
//! and a market that is cheap only right now is usually about to spike.

use super::{
    Acquisition, Decision, DecisionContext, Policy, PolicyError, PolicyKind, Purchase, rate_of,
};
use crate::job::{EvictionCost, JobModel};
use crate::market::{InstanceType, Market, Timestamp, UsdPerHour};
use serde::{Deserialize, Serialize};

/// The keys of a `kind = "standard-bidding"` policy file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StandardBiddingConfig {
    #[serde(default)]
    pub name: Option<String>,
    /// Restrict to these markets (`zone/type`). Default: every market of the job's types.
    #[serde(default)]
    pub markets: Vec<String>,
    /// Restrict to these instance types (each must be one of the job's). Default: the job's.
    #[serde(default)]
    pub instance_types: Vec<String>,
    /// The bid as a multiple of the on-demand price. Default 1.0 (bid the on-demand price).
    #[serde(default = "one")]
    pub bid_vs_on_demand: f64,
    /// How markets are ranked: `lookback-mean` (default; time-weighted mean over
    /// `lookback_hours`) or `current-price`.
    #[serde(default)]
    pub rank_by: RankBy,
    /// Look-back for `rank_by = "lookback-mean"`, hours. Default 168 (a week).
    #[serde(default = "default_lookback")]
    pub lookback_hours: f64,
    /// How often to look for capacity while the job lacks instances, minutes. Default 5.
    #[serde(default = "default_tick")]
    pub tick_minutes: f64,
    /// The checkpoint/restart cycle.
    pub checkpoint: CheckpointConfig,
}

/// Checkpointing of the standard-bidding job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Minutes of running between checkpoints.
    pub interval_minutes: f64,
    /// Minutes every instance stalls while a checkpoint is written.
    pub checkpoint_minutes: f64,
    /// Minutes to reload the checkpoint after replacements have started.
    pub restart_minutes: f64,
}

/// How standard bidding ranks markets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RankBy {
    #[default]
    LookbackMean,
    CurrentPrice,
}

fn one() -> f64 {
    1.0
}
fn default_lookback() -> f64 {
    168.0
}
fn default_tick() -> f64 {
    5.0
}

/// The standard-bidding policy; see the module documentation.
pub struct StandardBidding {
    name: String,
    config: StandardBiddingConfig,
    markets: Vec<Market>,
    types: Vec<InstanceType>,
    cost: EvictionCost,
}

impl StandardBidding {
    pub fn new(
        name: String,
        config: StandardBiddingConfig,
    ) -> Result<Self, (String, String, String)> {
        let bad = |k: &str, p: String, a: &str| Err((k.to_string(), p, a.to_string()));
        for (k, v) in [
            ("bid_vs_on_demand", config.bid_vs_on_demand),
            ("lookback_hours", config.lookback_hours),
            ("tick_minutes", config.tick_minutes),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(k, format!("{v} is not positive"), "a number > 0");
            }
        }
        let c = &config.checkpoint;
        let cost = EvictionCost::from_spec(&crate::job::EvictionCostSpec::Checkpoint {
            interval_minutes: c.interval_minutes,
            checkpoint_minutes: c.checkpoint_minutes,
            restart_minutes: c.restart_minutes,
        })
        .map_err(|(k, p)| {
            (
                format!("checkpoint.{k}"),
                p,
                "minutes: interval > 0, the others ≥ 0".to_string(),
            )
        })?;
        let markets = config
            .markets
            .iter()
            .map(|m| {
                Market::parse(m).map_err(|e| {
                    (
                        "markets".to_string(),
                        format!("`{m}`: {e}"),
                        "zone/type, e.g. us-east-1a/c3.xlarge".into(),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let types = config
            .instance_types
            .iter()
            .map(|t| {
                InstanceType::parse(t).map_err(|e| {
                    (
                        "instance_types".to_string(),
                        format!("`{t}`: {e}"),
                        "instance types of the job".into(),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(StandardBidding {
            name,
            config,
            markets,
            types,
            cost,
        })
    }

    fn allowed(&self, market: &Market, job: &JobModel) -> bool {
        job.rate(&market.instance_type).is_some()
            && (self.markets.is_empty() || self.markets.contains(market))
            && (self.types.is_empty() || self.types.contains(&market.instance_type))
    }

    /// The cheapest market per unit of work whose price is at most the bid now, with the bid.
    fn choose(
        &self,
        ctx: &DecisionContext<'_>,
    ) -> Result<Option<(Market, UsdPerHour)>, PolicyError> {
        let view = ctx.market;
        let now = ctx.now();
        let since = Timestamp::from_millis(
            now.millis() - (self.config.lookback_hours * 3_600_000.0) as i64,
        );
        let mut best: Option<(f64, f64, &Market, f64)> = None;
        for m in view.markets() {
            if !self.allowed(m, ctx.job) {
                continue;
            }
            let (Some(rate), Some(od), Some(price)) = (
                rate_of(ctx.job, m),
                view.on_demand_price(m),
                view.spot_price(m),
            ) else {
                continue;
            };
            let bid = od.get() * self.config.bid_vs_on_demand;
            if price.get() > bid {
                continue;
            }
            let metric = match self.config.rank_by {
                RankBy::CurrentPrice => price.get(),
                RankBy::LookbackMean => view
                    .mean_spot_price(m, since)?
                    .map_or(price.get(), UsdPerHour::get),
            } / rate;
            let better = match best {
                None => true,
                Some((b, r, _, _)) => {
                    metric < b - 1e-12 || ((metric - b).abs() <= 1e-12 && rate > r)
                }
            };
            if better {
                best = Some((metric, rate, m, bid));
            }
        }
        Ok(best.and_then(|(_, _, m, bid)| UsdPerHour::new(bid).ok().map(|b| (m.clone(), b))))
    }
}

impl Policy for StandardBidding {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> PolicyKind {
        PolicyKind::StandardBidding
    }

    fn eviction_cost(&self, _job: &JobModel) -> EvictionCost {
        self.cost
    }

    fn named_markets(&self) -> Vec<Market> {
        self.markets.clone()
    }

    fn named_instance_types(&self) -> Vec<InstanceType> {
        self.types.clone()
    }

    fn decide(&mut self, ctx: &DecisionContext<'_>) -> Result<Decision, PolicyError> {
        let now = ctx.now();
        let tick =
            Timestamp::from_millis(now.millis() + (self.config.tick_minutes * 60_000.0) as i64);
        let mut decision = Decision {
            wake_at: Some(tick),
            ..Decision::default()
        };
        if ctx.progress.remaining() <= 0.0 {
            return Ok(decision);
        }
        let active: Vec<_> = ctx.footprint.iter().filter(|i| i.is_active()).collect();
        let want = (ctx.job.max_instances as usize).saturating_sub(active.len());
        if want == 0 {
            return Ok(decision);
        }
        // Keep the cluster in one market: top up where the survivors are if it is still
        // under the bid; otherwise the cheapest market that is.
        let survivors_market = active.first().map(|i| &i.market).filter(|m| {
            ctx.market
                .spot_price(m)
                .zip(ctx.market.on_demand_price(m))
                .is_some_and(|(p, od)| p.get() <= od.get() * self.config.bid_vs_on_demand)
        });
        let target = match survivors_market {
            Some(m) => ctx
                .market
                .on_demand_price(m)
                .and_then(|od| UsdPerHour::new(od.get() * self.config.bid_vs_on_demand).ok())
                .map(|b| (m.clone(), b)),
            None => self.choose(ctx)?,
        };
        if let Some((market, bid)) = target {
            decision.acquire.push(Acquisition {
                market,
                purchase: Purchase::Spot { bid },
                count: want as u32,
            });
        }
        Ok(decision)
    }
}
