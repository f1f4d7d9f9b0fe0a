//! BidBrain on today's market, for a one-instance job with a deadline: the deadline plan
//! ([`crate::policy::deadline_plan`]) decides, from what BidBrain believes of each pool.
//!
//! BidBrain sees a pool only through its own instances: a spot instance of its running there
//! says the pool is up, a refused launch or an interruption says it is down. In between (while
//! the job waits or runs on-demand) each pool's [`Belief`] drifts by the availability model,
//! and the plan weighs trying spot (which looks), on-demand and waiting under it. With several
//! pools, spot is tried in the one most likely up (then the cheapest, then by name), and a
//! refusal sends the next look elsewhere; the plan itself is the one pool's.
//!
//! Every purchase and release records the plan's expected bill to the end of the job for each
//! choice, as a `decision` event.

use super::TodayConfig;
use crate::market::{Market, Timestamp};
use crate::market_model::availability::Belief;
use crate::policy::deadline_plan::{Action, Choice, DeadlinePlan, Mode, PlanSpec};
use crate::policy::{
    Acquisition, Decision, DecisionContext, Expectation, InstanceId, InstanceState, PolicyError,
    Purchase, Reason, Subject, cheapest_on_demand,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// What BidBrain keeps between decisions for the plan: soft memory, rebuilt from nothing after
/// a restart (the beliefs start from the model's long-run mix).
#[derive(Default)]
pub(super) struct Today {
    pools: BTreeMap<Market, Watch>,
    plan: Option<Arc<DeadlinePlan>>,
    /// Interruptions already taken into the beliefs.
    warned: BTreeSet<InstanceId>,
    /// The pool spot was last tried in, and when.
    tried: Option<(Market, Timestamp)>,
}

struct Watch {
    belief: Belief,
    /// When the belief was last brought up to date.
    at: Timestamp,
}

impl Today {
    fn watch(&mut self, config: &TodayConfig, market: &Market, now: Timestamp) -> &mut Watch {
        let model = &config.availability;
        let transition = self.plan.as_ref().map(|p| p.transition().to_vec());
        let w = self.pools.entry(market.clone()).or_insert_with(|| Watch {
            belief: Belief::unknown(model),
            at: now,
        });
        if now > w.at {
            let t = transition.unwrap_or_else(|| model.transition());
            w.belief
                .drift(model, &t, now.secs_since(w.at) / model.step_secs());
            w.at = now;
        }
        w
    }

    /// A launch into `market` failed now: if it was the spot launch the plan tried, the pool
    /// is down (an on-demand refusal says nothing of spot).
    pub(super) fn launch_failed(&mut self, config: &TodayConfig, market: &Market, now: Timestamp) {
        if self.tried.as_ref() == Some(&(market.clone(), now)) {
            let w = self.watch(config, market, now);
            w.belief.see(&config.availability, false, false);
        }
    }

    /// Decides for the job, or `None` when the plan does not apply (no spot pool, no
    /// on-demand price).
    pub(super) fn decide(
        &mut self,
        config: &TodayConfig,
        ctx: &DecisionContext<'_>,
        pools: &[&Market],
        refused: &BTreeMap<Market, Timestamp>,
        committed: &mut bool,
        tick_secs: f64,
    ) -> Result<Option<Decision>, PolicyError> {
        let now = ctx.now();
        let wake_at = now + std::time::Duration::from_secs_f64(tick_secs);
        let job = ctx.job;
        let Some(deadline) = ctx.progress.deadline else {
            return Ok(None);
        };
        let Some((od_market, _, _)) = cheapest_on_demand(ctx.market, job, None) else {
            return Ok(None);
        };
        let Some(od_price) = ctx.market.on_demand_price(od_market) else {
            return Ok(None);
        };
        if pools.is_empty() {
            return Ok(None);
        }
        let model = &config.availability;
        // What each pool was seen doing: a spot instance running there, or taken away.
        let active: Vec<_> = ctx.footprint.iter().filter(|i| i.is_active()).collect();
        for i in ctx.footprint {
            if i.purchase == Purchase::OnDemand {
                continue;
            }
            match i.state {
                InstanceState::Warned { .. } => {
                    if self.warned.insert(i.id.clone()) {
                        let w = self.watch(config, &i.market, now);
                        w.belief.see(model, false, true);
                    }
                }
                _ => {
                    let w = self.watch(config, &i.market, now);
                    w.belief.see(model, true, false);
                }
            }
        }
        for m in pools {
            self.watch(config, m, now);
        }
        let speed = job.full_speed().max(1e-9);
        let remaining_secs = ctx.progress.remaining() / speed * 3600.0;
        let time_left = deadline.secs_since(now);
        let spot = active
            .iter()
            .filter(|i| i.purchase != Purchase::OnDemand)
            .max_by_key(|i| i.launched_at);
        let on_demand = active
            .iter()
            .filter(|i| i.purchase == Purchase::OnDemand)
            .max_by_key(|i| i.launched_at);
        // What is left of a start-up, unless another instance works meanwhile (a switch made
        // before break).
        let working = active
            .iter()
            .any(|i| matches!(i.state, InstanceState::Running));
        let starting = if working {
            0.0
        } else {
            spot.or(on_demand)
                .map(|i| match i.state {
                    InstanceState::Starting { ready_at } => ready_at.secs_since(now).max(0.0),
                    _ => 0.0,
                })
                .unwrap_or(0.0)
        };
        let slack = time_left - remaining_secs - starting;
        let overhead = job.startup_secs;
        // The safety net, for what the plan does not model: with one restart and one look of
        // slack left, on-demand to the end.
        if *committed || slack <= overhead + tick_secs {
            *committed = true;
        }
        // The spot pool the job is in, or the one to try: most likely up, then cheapest.
        let spot_price = |m: &Market| ctx.market.spot_price(m).map(|p| p.get());
        let home = match spot {
            Some(i) => i.market.clone(),
            None => {
                let mut order: Vec<(&Market, f64, f64)> = pools
                    .iter()
                    .filter(|m| !refused.contains_key(**m))
                    .filter_map(|m| {
                        let up = self.pools.get(*m).map_or(0.0, |w| w.belief.up(model));
                        Some((*m, up, spot_price(m)?))
                    })
                    .collect();
                order.sort_by(|a, b| {
                    b.1.total_cmp(&a.1)
                        .then(a.2.total_cmp(&b.2))
                        .then(a.0.cmp(b.0))
                });
                match order.first() {
                    Some((m, ..)) => (*m).clone(),
                    // Every pool refused at this instant: believe the first one, down.
                    None => (*pools[0]).clone(),
                }
            }
        };
        let price = spot_price(&home).unwrap_or(od_price.get());
        let spec = PlanSpec {
            work_secs: remaining_secs,
            time_secs: time_left,
            overhead_secs: overhead,
            spot_usd_per_hour: price,
            on_demand_usd_per_hour: od_price.get(),
            make_before_break: true,
        };
        let plan = match &self.plan {
            Some(p) if p.covers(time_left, slack) && p.spec().overhead_secs == overhead => {
                p.clone()
            }
            _ => {
                let p = DeadlinePlan::cached(spec, model);
                self.plan = Some(p.clone());
                p
            }
        };
        let mode = match (spot, on_demand) {
            (Some(i), _) => Mode::Spot {
                age_secs: now.secs_since(i.launched_at),
            },
            (None, Some(_)) => Mode::OnDemand,
            (None, None) => Mode::Idle,
        };
        let all_refused = spot.is_none() && pools.iter().all(|m| refused.contains_key(*m));
        let belief = &self.pools[&home].belief;
        let mut choice = if *committed {
            Choice {
                action: Action::OnDemand,
                expected_usd: f64::NAN,
                wait_usd: None,
                on_demand_usd: None,
                spot_usd: None,
                p_up: belief.up(model),
                replace: false,
            }
        } else {
            // The plan acts on its steps; the policy looks every tick, loses the work since the
            // last sync to an interruption and pauses at every change: it keeps a margin.
            plan.choose(
                time_left,
                slack - config.margin_ticks * tick_secs,
                mode,
                belief,
            )
        };
        if choice.action == Action::Spot && all_refused {
            // Nowhere to try at this instant: the best of the rest.
            choice.action = match (choice.on_demand_usd, choice.wait_usd) {
                (Some(od), Some(wait)) if wait < od => Action::Wait,
                _ => Action::OnDemand,
            };
        }
        tracing::trace!(
            %now,
            hours_left = time_left / 3600.0,
            slack_hours = slack / 3600.0,
            ?mode,
            pool = %home,
            p_up = choice.p_up,
            action = ?choice.action,
            wait_usd = ?choice.wait_usd,
            on_demand_usd = ?choice.on_demand_usd,
            spot_usd = ?choice.spot_usd,
            "deadline plan"
        );
        let mut decision = Decision {
            wake_at: Some(wake_at),
            ..Decision::default()
        };
        let horizon_hours = time_left / 3600.0;
        let because = |what: &str| -> String {
            let usd = |x: Option<f64>| x.map_or("—".to_string(), |v| format!("${v:.2}"));
            if *committed {
                format!(
                    "deadline plan: {what}; the slack is down to a restart and a look: \
                     on-demand to the end"
                )
            } else {
                format!(
                    "deadline plan: {what}; expected bill to the end: spot ${}, on-demand {}, \
                     waiting {} ({} pool up with probability {:.2}, slack {:.2} h)",
                    choice
                        .spot_usd
                        .map_or("—".to_string(), |v| format!("{v:.2}")),
                    usd(choice.on_demand_usd),
                    usd(choice.wait_usd),
                    home,
                    choice.p_up,
                    slack / 3600.0
                )
            }
        };
        let expected = |cost: Option<f64>, p_evict: f64| Expectation {
            cost_usd: cost.filter(|c| c.is_finite()).unwrap_or(0.0),
            work_units: ctx.progress.remaining(),
            eviction_probability: p_evict,
            horizon_hours,
        };
        let release = |decision: &mut Decision, id: &InstanceId, market: &Market, rule: String| {
            decision.release.push(id.clone());
            decision.reasons.push(Reason {
                subject: Subject::Release {
                    instance: id.clone(),
                    market: market.clone(),
                },
                expected: expected(Some(choice.expected_usd), 0.0),
                rule,
            });
        };
        match choice.action {
            Action::Spot => {
                if let (Some(_), Some(od)) = (spot, on_demand) {
                    release(&mut decision, &od.id, &od.market, because("keep spot"));
                }
                if spot.is_none() {
                    let bid = ctx.market.on_demand_price(&home).unwrap_or(od_price);
                    let acquisition = Acquisition {
                        market: home.clone(),
                        purchase: Purchase::Spot { bid },
                        count: 1,
                    };
                    decision.reasons.push(Reason {
                        subject: Subject::Acquire(acquisition.clone()),
                        expected: expected(choice.spot_usd, 1.0 - choice.p_up),
                        rule: because("try spot"),
                    });
                    decision.acquire.push(acquisition);
                    self.tried = Some((home.clone(), now));
                    if let Some(od) = on_demand {
                        if choice.replace {
                            // It works on until the spot instance is ready, and goes then.
                            decision.replace.push(od.id.clone());
                        } else {
                            release(
                                &mut decision,
                                &od.id,
                                &od.market,
                                because("leave on-demand"),
                            );
                        }
                    }
                }
            }
            Action::OnDemand => {
                if on_demand.is_none() {
                    let acquisition = Acquisition {
                        market: od_market.clone(),
                        purchase: Purchase::OnDemand,
                        count: 1,
                    };
                    decision.reasons.push(Reason {
                        subject: Subject::Acquire(acquisition.clone()),
                        expected: expected(choice.on_demand_usd, 0.0),
                        rule: because("run on-demand"),
                    });
                    decision.acquire.push(acquisition);
                }
                if let Some(s) = spot {
                    if choice.replace && on_demand.is_none() {
                        decision.replace.push(s.id.clone());
                    } else {
                        release(&mut decision, &s.id, &s.market, because("leave spot"));
                    }
                }
            }
            Action::Wait => {
                for i in &active {
                    release(&mut decision, &i.id, &i.market, because("wait for spot"));
                }
            }
        }
        Ok(Some(decision))
    }
}
