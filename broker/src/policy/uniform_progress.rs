//! `uniform-progress`: Can't Be Late's Uniform Progress (Wu et al., "Can't Be Late: Optimizing
//! Spot Instance Savings under Deadlines", NSDI 2024), rule by rule as published (§3.3, §5.2.2):
//!
//! - **Thrifty** (§3.3): idle once the work is done.
//! - **Exploitation** (§3.3): once on spot, stay on it until it is preempted — a running spot
//!   instance is never released, not even by the safety net.
//! - **Safety net** (§3.3): when the job is *not on spot* and the time left `R(t)` is below the
//!   compute left `C(t)` plus two restart overheads `2d`, on-demand to the end. The policy acts
//!   at its looks, so the net holds one look of margin more (`2d` + `tick_minutes`).
//! - **Uniform progress** (§5.2.2, rule 1): idle (no spot to be had) and behind the line
//!   `cp(t) < ep(t)` from (start, 0) to (deadline, all work): on-demand.
//! - **Taking risks** (rule 2): spot whenever it can be had, behind the line or not. A spot
//!   launch is how a broker learns whether a pool has capacity: it is tried at every look
//!   (a refused launch costs nothing, and a refusal is not retried in the same instant).
//! - **Hysteresis** (rule 3): on on-demand, stay there until `cp(t) ≥ ep(t + 2d)`; then it
//!   moves to spot *when spot can be had*. A refused try leaves on-demand running (Figure 10:
//!   the only way off on-demand is to spot). The on-demand instance goes when the spot launch
//!   is granted (at the next look), so the switch pays the restart overhead, as published.
//!
//! `make_before_break = true` is the `uniform-progress-mbb` variant: the same rules, but the
//! on-demand instance works on until its spot replacement is ready (BidBrain's switch), so a
//! comparison with BidBrain isolates the plan.
//!
//! It looks every `tick_minutes` (default 0.5: at least once in every tick of the availability
//! traces here, whose ticks are 10 min or 32 s). `zones = "one"` (as published) takes spot in the
//! cheapest pool only (ties by name); `zones = "all"` in any pool, in that order. Several
//! instances follow the paper's §5.5 mapping with counts: spot for every slot it can get,
//! on-demand for the rest while behind. Without a deadline it is spot-first with on-demand
//! whenever spot is refused.

use super::{
    Acquisition, Decision, DecisionContext, Policy, PolicyError, PolicyEvent, PolicyKind, Purchase,
    ReplaceAt, rate_of,
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
    /// Switches from on-demand to spot are made before they are broken (the
    /// `uniform-progress-mbb` variant); `false` as published.
    #[serde(default)]
    pub make_before_break: bool,
}

fn default_tick_minutes() -> f64 {
    0.5
}

pub struct UniformProgress {
    name: String,
    zones: Zones,
    tick: Duration,
    make_before_break: bool,
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
            make_before_break: config.make_before_break,
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
            // Thrifty.
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
        let d = job.startup_secs;
        let look = self.tick.as_secs_f64();
        // The line: cp(t) against ep(t) and ep(t + 2d); the safety net's R(t) < C(t) + 2d.
        let (behind, hysteresis_done, net) = match ctx.progress.deadline {
            Some(deadline) => {
                let span = deadline.secs_since(ctx.progress.started_at).max(1.0);
                let ep = |t: Timestamp, plus: f64| {
                    let elapsed = t.secs_since(ctx.progress.started_at).max(0.0) + plus;
                    ctx.progress.total_work * (elapsed / span).min(1.0)
                };
                let cp = ctx.progress.done_work;
                let per_sec = rate * n / 3600.0;
                let r = deadline.secs_since(now);
                let c = remaining / per_sec;
                (
                    cp < ep(now, 0.0),
                    cp >= ep(now, 2.0 * d),
                    r < c + 2.0 * d + look,
                )
            }
            None => (true, false, false),
        };
        let active = |spot: bool| {
            ctx.footprint.iter().filter(move |i| {
                i.is_active() && matches!(i.purchase, Purchase::Spot { .. }) == spot
            })
        };
        let want = job.max_instances as usize;
        let on_demand: Vec<_> = active(false).collect();
        let spot: Vec<_> = active(true).collect();
        // Safety net: only off spot (Exploitation keeps a spot instance to its end).
        if net && spot.is_empty() {
            self.committed = true;
        }
        let od_market = super::cheapest_on_demand(ctx.market, job, Some(&home.instance_type))
            .map(|(m, _, _)| m.clone())
            .unwrap_or_else(|| home.clone());
        let acquire_od = |decision: &mut Decision, count: usize| {
            if count > 0 {
                decision.acquire.push(Acquisition {
                    market: od_market.clone(),
                    purchase: Purchase::OnDemand,
                    count: count as u32,
                });
            }
        };
        if self.committed {
            // On-demand to the end for every slot spot does not hold.
            acquire_od(
                &mut decision,
                want.saturating_sub(spot.len() + on_demand.len()),
            );
            return Ok(decision);
        }
        // Taking risks: spot for the slots spot does not hold, from idle at once, from
        // on-demand once the hysteresis is done.
        let missing_spot = want.saturating_sub(spot.len());
        let idle_slots = want.saturating_sub(spot.len() + on_demand.len());
        let tryable = pools.iter().find(|(m, _)| !self.refused.contains_key(*m));
        if missing_spot > 0
            && let Some(&(m, _)) = tryable
        {
            let from_od = if hysteresis_done || ctx.progress.deadline.is_none() {
                missing_spot - idle_slots
            } else {
                0
            };
            let count = idle_slots + from_od;
            if count > 0 {
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
                    count: count as u32,
                });
                // The on-demand instances it leaves go when the spot launch is granted (as
                // published: the switch pays the restart) or, make before break, when the spot
                // instance is ready; a refusal keeps them either way.
                decision
                    .replace
                    .extend(on_demand.iter().rev().take(from_od).map(|i| i.id.clone()));
                if !self.make_before_break {
                    decision.replace_at = ReplaceAt::Launch;
                }
                return Ok(decision);
            }
        }
        // No spot to be had now. Uniform progress: behind the line, on-demand for the idle
        // slots; on on-demand, it stays (hysteresis, and no spot to leave it for).
        if behind {
            acquire_od(&mut decision, idle_slots);
        }
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
