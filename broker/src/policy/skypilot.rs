//! `skypilot-default`: what SkyPilot managed jobs do by default with `use_spot: true`.
//!
//! Source: SkyPilot's documentation, "Managed Jobs" (spot recovery) and its
//! `sky/jobs/recovery_strategy.py` (`EAGER_NEXT_REGION`, the default strategy since 0.6):
//!
//! - every instance is spot, in the cheapest pool the job can use (ties by name), at a maximum
//!   price equal to on-demand (SkyPilot pays the spot price);
//! - a launch refused for capacity fails over to the next pool, then the next (the optimizer's
//!   order); when every pool refused, it retries them all after a gap;
//! - on a preemption it relaunches at once, trying *other* zones and regions first and the
//!   preempted one last (EAGER_NEXT_REGION), and the job restarts from its last checkpoint;
//! - it never falls back to on-demand and knows nothing of deadlines.
//!
//! Choices where the source is silent, in the baseline's favour: the retry gap is 60 s (the
//! controller's first backoff), and with several instances only the lost ones are relaunched
//! (SkyPilot relaunches the whole cluster).

use super::{
    Acquisition, Decision, DecisionContext, Policy, PolicyError, PolicyEvent, PolicyKind, Purchase,
    rate_of,
};
use crate::job::{EvictionCost, JobModel};
use crate::market::{Market, Timestamp};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// The keys of a `kind = "skypilot-default"` policy file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SkypilotConfig {
    #[serde(default)]
    pub name: Option<String>,
    /// Seconds before pools that all refused are tried again.
    #[serde(default = "default_retry_secs")]
    pub retry_secs: f64,
}

fn default_retry_secs() -> f64 {
    60.0
}

/// The policy.
pub struct SkypilotDefault {
    name: String,
    retry: Duration,
    /// Pools that refused a launch, and when: skipped until every pool has refused.
    refused: BTreeMap<Market, Timestamp>,
    /// The pool of the last preemption: tried last.
    preempted_in: Option<Market>,
}

impl SkypilotDefault {
    pub fn new(name: String, config: SkypilotConfig) -> Result<Self, (String, String, String)> {
        if !(config.retry_secs.is_finite() && config.retry_secs >= 1.0) {
            return Err((
                "retry_secs".into(),
                format!("{} is not a number of seconds ≥ 1", config.retry_secs),
                "1 or more".into(),
            ));
        }
        Ok(SkypilotDefault {
            name,
            retry: Duration::from_secs_f64(config.retry_secs),
            refused: BTreeMap::new(),
            preempted_in: None,
        })
    }
}

impl Policy for SkypilotDefault {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> PolicyKind {
        PolicyKind::SkypilotDefault
    }

    fn eviction_cost(&self, job: &JobModel) -> EvictionCost {
        job.eviction_cost
    }

    fn decide(&mut self, ctx: &DecisionContext<'_>) -> Result<Decision, PolicyError> {
        let now = ctx.now();
        let mut decision = Decision {
            wake_at: Some(now + Duration::from_secs(3600)),
            ..Decision::default()
        };
        if ctx.progress.remaining() <= 0.0 {
            return Ok(decision);
        }
        let active = ctx.footprint.iter().filter(|i| i.is_active()).count();
        let want = (ctx.job.max_instances as usize).saturating_sub(active);
        if want == 0 {
            return Ok(decision);
        }
        // The optimizer's order: cheapest spot price, then name; the preempted pool last.
        let mut pools: Vec<(&Market, f64)> = ctx
            .market
            .markets()
            .into_iter()
            .filter(|m| rate_of(ctx.job, m).is_some())
            .filter_map(|m| Some((m, ctx.market.spot_price(m)?.get())))
            .collect();
        if pools.is_empty() && ctx.market.markets().is_empty() {
            return Err(PolicyError::NoMarket {
                types: ctx
                    .job
                    .rates()
                    .map(|(t, _)| t.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                now,
            });
        }
        pools.sort_by(|a, b| {
            let last = |m: &Market| self.preempted_in.as_ref() == Some(m);
            (last(a.0), a.1, a.0)
                .partial_cmp(&(last(b.0), b.1, b.0))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        if pools.is_empty() {
            // No spot offer anywhere now (a driver's cool-down): look again after the gap.
            decision.wake_at = Some(now + self.retry);
            return Ok(decision);
        }
        // A full round of refusals: wait the gap, then start over.
        let all_refused = pools.iter().all(|(m, _)| self.refused.contains_key(*m));
        if all_refused {
            let since = self.refused.values().max().copied().unwrap_or(now);
            if now < since + self.retry {
                decision.wake_at = Some(since + self.retry);
                return Ok(decision);
            }
            self.refused.clear();
        }
        let Some(&(market, _)) = pools.iter().find(|(m, _)| !self.refused.contains_key(*m)) else {
            return Ok(decision);
        };
        let bid = ctx
            .market
            .on_demand_price(market)
            .or_else(|| ctx.market.spot_price(market))
            .ok_or_else(|| PolicyError::NoMarket {
                types: market.instance_type.to_string(),
                now,
            })?;
        decision.acquire.push(Acquisition {
            market: market.clone(),
            purchase: Purchase::Spot { bid },
            count: want as u32,
        });
        Ok(decision)
    }

    fn on_event(
        &mut self,
        ctx: &DecisionContext<'_>,
        event: &PolicyEvent,
    ) -> Result<Decision, PolicyError> {
        match event {
            PolicyEvent::LaunchFailed { market, .. } => {
                self.refused.insert(market.clone(), ctx.now());
            }
            PolicyEvent::Warned(ids) | PolicyEvent::Evicted(ids) => {
                if let Some(i) = ctx.footprint.iter().find(|i| ids.contains(&i.id)) {
                    self.preempted_in = Some(i.market.clone());
                }
            }
            // Not a preemption: no reason to leave its market.
            PolicyEvent::Lost(_) => {}
            PolicyEvent::Ready(_) => {
                // A launch went through: the round of failovers is over.
                self.refused.clear();
            }
        }
        self.decide(ctx)
    }
}
