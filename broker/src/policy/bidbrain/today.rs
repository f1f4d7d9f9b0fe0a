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
use crate::market_model::availability::{AvailabilityModel, Belief};
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
    /// The pools spot was last tried in, and when.
    tried: BTreeSet<Market>,
    tried_at: Option<Timestamp>,
}

/// What a stint of spot in a pool is expected to cost, if the pool is up now.
#[derive(Debug, Clone, Copy)]
struct Stint {
    p_up: f64,
    /// The chance that the pool goes within the instance's first hour, which is then free.
    p_free: f64,
    price: f64,
    usd_per_hour_of_work: f64,
    usd_per_hour_beside: f64,
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
        if self.tried_at == Some(now) && self.tried.contains(market) {
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
        // What the whole fleet has seen of each pool (every job's launches, refusals and
        // interruptions, this one's among them), when the broker keeps a book on this model.
        let book = ctx
            .market
            .pool_book()
            .filter(|b| b.prior() == &config.availability);
        if let Some(book) = book {
            for m in pools {
                if let Some(belief) = book.belief(m, now) {
                    let w = self.watch(config, m, now);
                    w.belief = belief;
                }
            }
        }
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
        // What a stint in each pool is expected to cost per hour of work, if the pool is up now:
        // its instance is free when the pool goes within the first hour; one that lasts is
        // paid for the hour (and, when chasing, left then for capacity that has just come
        // back). A pool seen down a little while ago that is up now has only just come back,
        // and its first hour is likely free; one long up is likely to last, and paid.
        let spot_price = |m: &Market| ctx.market.spot_price(m).map(|p| p.get());
        let transition = model.transition();
        let hour_steps = ((3600.0 / model.step_secs()).round() as usize).max(1);
        let o_h = overhead / 3600.0;
        // Each pool's own model, when the fleet has learned one.
        let learned: BTreeMap<&Market, (&AvailabilityModel, &[f64])> = book
            .map(|b| {
                pools
                    .iter()
                    .filter(|m| b.model(m) != model)
                    .map(|m| (*m, (b.model(m), b.transition(m))))
                    .collect()
            })
            .unwrap_or_default();
        let stint = |m: &Market| -> Option<Stint> {
            let w = self.pools.get(m)?;
            let price = spot_price(m)?;
            let (model, transition) = learned
                .get(m)
                .map_or((model, transition.as_slice()), |(pm, t)| (*pm, *t));
            let p_up = w.belief.up(model);
            let (p_end, up_steps) = w.belief.up_run_within(model, transition, hour_steps)?;
            // Hours up within the hour, and the first hour's bill if it lasts.
            let up_h = up_steps * model.step_secs() / 3600.0;
            let paid = (1.0 - p_end) * price;
            let per_hour = |cost: f64, work: f64| {
                if work > 1e-6 {
                    cost / work
                } else {
                    f64::INFINITY
                }
            };
            Some(Stint {
                p_up,
                p_free: p_end,
                price,
                // Started from nothing: the start-up is the stint's own.
                usd_per_hour_of_work: per_hour(paid, up_h - o_h),
                // Started beside an instance that works on (make before break): its start-up
                // is the old instance's work, paid.
                usd_per_hour_beside: per_hour(paid + price * o_h, up_h),
            })
        };
        // Pools to try spot in, cheapest stint first (a refusal costs nothing); not those that
        // refused at this instant, nor those surely down.
        let mut candidates: Vec<(&Market, Stint)> = pools
            .iter()
            .filter(|m| !refused.contains_key(**m))
            .filter_map(|m| Some((*m, stint(m)?)))
            .filter(|(_, s)| s.p_up > 0.02)
            .collect();
        candidates.sort_by(|a, b| {
            a.1.usd_per_hour_of_work
                .total_cmp(&b.1.usd_per_hour_of_work)
                .then(a.1.price.total_cmp(&b.1.price))
                .then(a.0.cmp(b.0))
        });
        let home = match (spot, candidates.first()) {
            (Some(i), _) => i.market.clone(),
            (None, Some((m, _))) => (*m).clone(),
            // Every pool refused at this instant, or is surely down: believe the first one.
            (None, None) => (*pools[0]).clone(),
        };
        let price = spot_price(&home).unwrap_or(od_price.get());
        let spec = PlanSpec {
            work_secs: remaining_secs,
            time_secs: time_left,
            overhead_secs: overhead,
            spot_usd_per_hour: price,
            on_demand_usd_per_hour: od_price.get(),
            make_before_break: config.make_before_break,
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
        self.tried.clear();
        self.tried_at = Some(now);
        let spot_in = |m: &Market| Acquisition {
            market: m.clone(),
            purchase: Purchase::Spot {
                bid: ctx.market.on_demand_price(m).unwrap_or(od_price),
            },
            count: 1,
        };
        match choice.action {
            Action::Spot => {
                if let (Some(_), Some(od)) = (spot, on_demand) {
                    release(&mut decision, &od.id, &od.market, because("keep spot"));
                }
                // Chasing capacity that has just come back: with several pools and a start-up
                // short enough, the instance past its (paid) first hour is replaced by one in a
                // pool whose first hour is likely free, made before it is broken.
                if let Some(i) = spot
                    && config.make_before_break
                    && pools.len() > 1
                    && matches!(i.state, InstanceState::Running)
                    && now.secs_since(i.launched_at) >= 3600.0
                {
                    let here = spot_price(&i.market).unwrap_or(price);
                    let better: Vec<&(&Market, Stint)> = candidates
                        .iter()
                        .filter(|(m, s)| {
                            // Cheaper per hour of work than staying (the 2022 traces: any
                            // margin asked of it cost more, in sample).
                            **m != i.market && s.usd_per_hour_beside < here
                        })
                        .collect();
                    for (m, st) in &better {
                        let acquisition = spot_in(m);
                        decision.reasons.push(Reason {
                            subject: Subject::Acquire(acquisition.clone()),
                            expected: Expectation {
                                cost_usd: st.usd_per_hour_beside,
                                work_units: 1.0,
                                eviction_probability: st.p_free,
                                horizon_hours: 1.0,
                            },
                            rule: format!(
                                "deadline plan: chase capacity that has just come back: a stint \
                                 in {m} is expected at ${:.3} per hour of work (its first hour \
                                 free with probability {:.2}, the pool up with {:.2}) against \
                                 ${here:.3} on {}, past its first hour",
                                st.usd_per_hour_beside, st.p_free, st.p_up, i.id
                            ),
                        });
                        decision.acquire.push(acquisition);
                        self.tried.insert((*m).clone());
                    }
                    if !better.is_empty() {
                        decision.replace.push(i.id.clone());
                    }
                }
                if spot.is_none() {
                    // The cheapest stint first; if it is refused, the next at once.
                    let acquisition = spot_in(&home);
                    decision.reasons.push(Reason {
                        subject: Subject::Acquire(acquisition.clone()),
                        expected: expected(choice.spot_usd, 1.0 - choice.p_up),
                        rule: because("try spot"),
                    });
                    decision.acquire.push(acquisition);
                    self.tried.insert(home.clone());
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
