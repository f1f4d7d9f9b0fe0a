//! `uniform-progress`: Can't Be Late's Uniform Progress with its safety net (Wu et al., "Can't
//! Be Late: Optimizing Spot Instance Savings under Deadlines", NSDI 2024, §4).
//!
//! The job should progress along the straight line from (start, 0) to (deadline, all work):
//!
//! - spot whenever it can be had (tried at every tick: a refused launch costs nothing);
//! - no spot and *behind* the line: on-demand; no spot and ahead of it: wait, holding nothing;
//! - once on on-demand, it stays there until spot is back and running (hysteresis: it leaves
//!   on-demand only for a ready spot instance, and only while at least one restart overhead
//!   ahead of the line), so that it does not flap and pay the restart overhead twice;
//! - the safety net: when the slack left (time to the deadline minus the compute still needed
//!   on the instances the job may hold) falls to two restart overheads and one look (it acts at
//!   its looks, every `tick_minutes`), it commits to on-demand to the end.
//!
//! As published the policy uses one zone (`zones = "one"`, the cheapest pool, ties by name);
//! `zones = "all"` lets it take spot in any pool, trying them in that order. Without a deadline
//! it behaves as a spot-first policy that falls back to on-demand only when behind a line it
//! cannot draw: on-demand whenever spot is refused.

use super::{
    Acquisition, Decision, DecisionContext, Policy, PolicyError, PolicyEvent, PolicyKind, Purchase,
    rate_of,
};
use crate::job::{EvictionCost, JobModel};
use crate::market::{Market, Timestamp};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// Which pools the policy may take spot in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Zones {
    /// The cheapest pool only (as published).
    #[default]
    One,
    /// Every pool, cheapest first.
    All,
}

/// The keys of a `kind = "uniform-progress"` policy file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UniformProgressConfig {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub zones: Zones,
    /// How often it looks, minutes (spot is tried again at each look).
    #[serde(default = "default_tick_minutes")]
    pub tick_minutes: f64,
}

fn default_tick_minutes() -> f64 {
    5.0
}

pub struct UniformProgress {
    name: String,
    zones: Zones,
    tick: Duration,
    /// Pools whose spot launch was refused at this instant.
    refused: BTreeMap<Market, Timestamp>,
    /// The safety net fired: on-demand to the end.
    committed: bool,
}

impl UniformProgress {
    pub fn new(
        name: String,
        config: UniformProgressConfig,
    ) -> Result<Self, (String, String, String)> {
        if !(config.tick_minutes.is_finite() && config.tick_minutes > 0.0) {
            return Err((
                "tick_minutes".into(),
                format!(
                    "{} is not a positive number of minutes",
                    config.tick_minutes
                ),
                "a number of minutes > 0".into(),
            ));
        }
        Ok(UniformProgress {
            name,
            zones: config.zones,
            tick: Duration::from_secs_f64(config.tick_minutes * 60.0),
            refused: BTreeMap::new(),
            committed: false,
        })
    }
}

impl Policy for UniformProgress {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> PolicyKind {
        PolicyKind::UniformProgress
    }

    fn eviction_cost(&self, job: &JobModel) -> EvictionCost {
        job.eviction_cost
    }

    fn decide(&mut self, ctx: &DecisionContext<'_>) -> Result<Decision, PolicyError> {
        let now = ctx.now();
        let mut decision = Decision {
            wake_at: Some(now + self.tick),
            ..Decision::default()
        };
        let remaining = ctx.progress.remaining();
        if remaining <= 0.0 {
            return Ok(decision);
        }
        self.refused.retain(|_, t| *t >= now);
        let job = ctx.job;
        let n = job.max_instances.max(1) as f64;
        let mut pools: Vec<(&Market, f64)> = ctx
            .market
            .markets()
            .into_iter()
            .filter(|m| rate_of(job, m).is_some())
            .filter_map(|m| Some((m, ctx.market.spot_price(m)?.get())))
            .collect();
        pools.sort_by(|a, b| {
            (a.1, a.0)
                .partial_cmp(&(b.1, b.0))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        if self.zones == Zones::One {
            pools.truncate(1);
        }
        // No spot offer anywhere now (a driver's cool-down): on-demand as the fallback market.
        let fallback = super::cheapest_on_demand(ctx.market, job, None).map(|(m, _, _)| m);
        let Some(home) = pools.first().map(|&(m, _)| m).or(fallback) else {
            return Err(PolicyError::NoMarket {
                types: job
                    .rates()
                    .map(|(t, _)| t.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                now,
            });
        };
        let rate = rate_of(job, home).unwrap_or(1.0);
        let overhead = job.startup_secs;
        // Where the line says the job should be, and the slack left.
        let (behind, ahead_by_overhead, slack) = match ctx.progress.deadline {
            Some(deadline) => {
                let span = deadline.secs_since(ctx.progress.started_at).max(1.0);
                let elapsed = now.secs_since(ctx.progress.started_at).max(0.0);
                let target = ctx.progress.total_work * (elapsed / span).min(1.0);
                let done = ctx.progress.done_work;
                let per_sec = rate * n / 3600.0;
                (
                    done < target,
                    done >= target + overhead * per_sec,
                    deadline.secs_since(now) - remaining / per_sec,
                )
            }
            None => (true, false, f64::INFINITY),
        };
        // Two restarts and one look of margin: it acts at its looks, so the net must hold until
        // the next one (the same margin BidBrain's deadline plan uses).
        if slack <= 2.0 * overhead + self.tick.as_secs_f64() {
            self.committed = true;
        }
        let active = |spot: bool| {
            ctx.footprint.iter().filter(move |i| {
                i.is_active() && matches!(i.purchase, Purchase::Spot { .. }) == spot
            })
        };
        let want = job.max_instances as usize;
        let on_demand: Vec<_> = active(false).collect();
        let spot: Vec<_> = active(true).collect();
        let od_market = super::cheapest_on_demand(ctx.market, job, Some(&home.instance_type))
            .map(|(m, _, _)| m.clone())
            .unwrap_or_else(|| home.clone());
        if self.committed {
            // On-demand to the end: replace spot by on-demand, keep what is on-demand.
            let missing = want.saturating_sub(on_demand.len());
            if missing > 0 {
                decision.acquire.push(Acquisition {
                    market: od_market,
                    purchase: Purchase::OnDemand,
                    count: missing as u32,
                });
            }
            decision.release.extend(spot.iter().map(|i| i.id.clone()));
            return Ok(decision);
        }
        // Spot first, tried in the pools not refused at this instant. On on-demand it looks for
        // spot only once well ahead of the line (the hysteresis), and then leaves on-demand for
        // it: the job may not hold more than its instances, and a refusal leaves it waiting,
        // which is what the line allows.
        let probe = on_demand.is_empty() || ahead_by_overhead;
        let missing_spot = want.saturating_sub(spot.len());
        if probe
            && missing_spot > 0
            && let Some(&(m, _)) = pools.iter().find(|(m, _)| !self.refused.contains_key(*m))
        {
            let bid = ctx
                .market
                .on_demand_price(m)
                .or_else(|| ctx.market.spot_price(m))
                .ok_or_else(|| PolicyError::NoMarket {
                    types: m.instance_type.to_string(),
                    now,
                })?;
            decision.acquire.push(Acquisition {
                market: m.clone(),
                purchase: Purchase::Spot { bid },
                count: missing_spot as u32,
            });
            decision
                .release
                .extend(on_demand.iter().map(|i| i.id.clone()));
            return Ok(decision);
        }
        // No spot now. On-demand covers what spot does not while behind; between the line and
        // a restart overhead ahead of it, what runs keeps running; further ahead, it waits.
        let uncovered = want.saturating_sub(spot.len());
        let od_target = if behind {
            uncovered
        } else if ahead_by_overhead {
            0
        } else {
            on_demand.len().min(uncovered)
        };
        if od_target > on_demand.len() {
            decision.acquire.push(Acquisition {
                market: od_market,
                purchase: Purchase::OnDemand,
                count: (od_target - on_demand.len()) as u32,
            });
        }
        decision.release.extend(
            on_demand
                .iter()
                .rev()
                .take(on_demand.len().saturating_sub(od_target))
                .map(|i| i.id.clone()),
        );
        Ok(decision)
    }

    fn on_event(
        &mut self,
        ctx: &DecisionContext<'_>,
        event: &PolicyEvent,
    ) -> Result<Decision, PolicyError> {
        if let PolicyEvent::LaunchFailed { market, .. } = event {
            self.refused.insert(market.clone(), ctx.now());
        }
        self.decide(ctx)
    }
}
