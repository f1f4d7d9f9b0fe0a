//! A one-instance job with a deadline on today's market, planned as a Markov decision process.
//!
//! Uniform Progress (Can't Be Late, NSDI'24) keeps the job on a straight line from its start to
//! its deadline. The line knows nothing of the pool: it buys on-demand at the first outage that
//! finds the job behind, though half the outages end within half an hour, and it leaves
//! on-demand for spot that has just come back, though a pool that has just come back is likely
//! to go again soon. This plan weighs both with the pool's [`AvailabilityModel`]: it minimises
//! the expected bill to the end of the job, subject to finishing by the deadline, by dynamic
//! programming over
//!
//! - the steps left to the deadline (the model's grid, 10 minutes by default),
//! - the slack: time left minus the work left at full speed, in quarter steps (running keeps
//!   it, waiting spends it, every start spends one restart overhead of it),
//! - what the job runs on: nothing, on-demand, or spot, with the spot instance's age in steps
//!   up to its first hour (today's billing: an instance EC2 interrupts within its first hour is
//!   not charged at all, one that lives longer, or that the user ends, is charged from its
//!   launch, per second),
//! - where the pool is: up or down, and for how long (the model's age buckets).
//!
//! Each step the job may wait, run on-demand, or run spot (only while the pool is up); a spot
//! instance is interrupted when the pool goes down. Running out of slack is priced at a penalty
//! far above any bill, and on-demand always finishes from a slack of one restart, so the plan
//! meets every deadline that on-demand could still meet.
//!
//! A policy does not see the pool while it runs on-demand or waits. It keeps a
//! [`Belief`](crate::market_model::availability::Belief) over the pool's states and chooses
//! the action with the least expected cost under it ([`DeadlinePlan::choose`]); "try spot"
//! learns the truth (a launch is granted or refused), and a refusal after on-demand was let go
//! leaves the job idle, which the choice counts.
//!
//! The plan is a pure function of its [`PlanSpec`] and model; [`DeadlinePlan::cached`] shares
//! solved plans between the runs of a sweep.

use crate::market_model::availability::{AvailabilityModel, Belief};
use std::sync::{Arc, Mutex};

/// Slack quanta per step.
const QUANTA: usize = 4;
/// The value of running out of slack, USD: no bill comes near it.
const PENALTY: f32 = 1.0e6;

/// What a plan is solved for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanSpec {
    /// Work left, in seconds of one instance at full speed.
    pub work_secs: f64,
    /// Time left to the deadline, seconds.
    pub time_secs: f64,
    /// Seconds from a launch to useful work (the restart overhead).
    pub overhead_secs: f64,
    pub spot_usd_per_hour: f64,
    pub on_demand_usd_per_hour: f64,
    /// Whether a switch between on-demand and spot may overlap (make before break: the new
    /// instance starts while the old one works, which is then let go), trading the restart
    /// overhead's lost time for the old instance's money over it.
    pub make_before_break: bool,
}

/// What the job runs on now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    Idle,
    OnDemand,
    /// A spot instance launched `age_secs` ago.
    Spot {
        age_secs: f64,
    },
}

/// What to do for the next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Wait,
    OnDemand,
    /// Run spot: keep the one running, or try to launch one (refused when the pool is down).
    Spot,
}

/// A choice and the expected bills that made it, USD to the end of the job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    pub action: Action,
    /// Expected bill to the end under the chosen action.
    pub expected_usd: f64,
    /// Expected bill of waiting, on-demand and spot (`None`: not weighed from this mode).
    pub wait_usd: Option<f64>,
    pub on_demand_usd: Option<f64>,
    pub spot_usd: Option<f64>,
    /// The chance the pool is up, as believed.
    pub p_up: f64,
    /// A switch to make before break: the new instance replaces the one running, which works
    /// until it is ready.
    pub replace: bool,
}

/// A solved plan.
#[derive(Debug)]
pub struct DeadlinePlan {
    spec: PlanSpec,
    model: AvailabilityModel,
    transition: Vec<f64>,
    /// The transition's non-zero entries per row (a run stays, ages, or ends).
    rows: Vec<Vec<(usize, f64)>>,
    step_secs: f64,
    /// Steps the plan covers.
    steps: usize,
    /// Slack quanta it covers.
    slack: usize,
    /// Steps in a spot instance's first hour.
    young: usize,
    states: usize,
    buckets: usize,
    /// Per step, slack and state: the value of holding nothing, on-demand, and a spot instance
    /// one step old (up states only).
    values: Vec<f32>,
    /// Per step, slack, spot age (steps 0..young, then older) and up bucket: the best action
    /// (0 wait, 1 on-demand, 2 spot).
    spot_actions: Vec<u8>,
}

fn sparse_rows(p: &[f64], n: usize) -> Vec<Vec<(usize, f64)>> {
    (0..n)
        .map(|i| {
            (0..n)
                .filter(|&j| p[i * n + j] > 0.0)
                .map(|j| (j, p[i * n + j]))
                .collect()
        })
        .collect()
}

// Modes inside the solver: idle, on-demand, spot with `j` steps done (j < young), spot past its
// first hour.
const IDLE: usize = 0;
const OD: usize = 1;

impl DeadlinePlan {
    /// Solves the plan. Cost: steps × slack × modes × states², about a second for a 70-hour
    /// deadline on 10-minute steps in a release build.
    pub fn solve(spec: PlanSpec, model: &AvailabilityModel) -> DeadlinePlan {
        let step = model.step_secs();
        let q = step / QUANTA as f64;
        let steps = ((spec.time_secs / step).ceil().max(1.0) as usize).min(5_000);
        let slack_secs = (spec.time_secs - spec.work_secs).max(0.0);
        let slack = ((slack_secs / q).ceil() as usize + QUANTA + 2).min(20_000);
        let young = ((3600.0 / step).round() as usize).max(2);
        let modes = 2 + young + 1;
        let paid = 2 + young;
        let nb = model.buckets();
        let na = model.states();
        let p = model.transition();
        let rows = sparse_rows(&p, na);
        let up: Vec<bool> = (0..na).map(|s| model.is_up(s)).collect();
        let od_step = (spec.on_demand_usd_per_hour * step / 3600.0) as f32;
        let spot_step = (spec.spot_usd_per_hour * step / 3600.0) as f32;
        let spot_hour = (spec.spot_usd_per_hour * young as f64 * step / 3600.0) as f32;
        // Make before break: the old instance's money over the overlap, and the chance that the
        // pool goes down before the new spot instance is ready (the on-demand one then stays).
        let mbb = spec.make_before_break;
        let overlap = spec.overhead_secs.max(0.0).min(step);
        let od_overlap = (spec.on_demand_usd_per_hour * overlap / 3600.0) as f32;
        let spot_overlap = (spec.spot_usd_per_hour * overlap / 3600.0) as f32;
        let kept = (overlap / step) as f32;
        // A start spends the overhead: whole quanta, the fraction by chance (so that a short
        // overhead is not rounded away).
        let oq = spec.overhead_secs.max(0.0) / q;
        let (ofl, ofr) = (oq.floor() as usize, (oq - oq.floor()) as f32);
        // What ending the job in a mode charges: a young spot instance is paid for its life.
        let end_charge = |m: usize| -> f32 {
            if (2..paid).contains(&m) {
                spot_step * (m - 2) as f32
            } else {
                0.0
            }
        };
        let width = modes * na;
        let idx = |s: usize, m: usize, i: usize| s * width + m * na + i;
        // Layer 0: the deadline; done where there is no work left (any slack ≥ 0).
        let mut prev = vec![0f32; (slack + 1) * width];
        for s in 0..=slack {
            for m in 0..modes {
                for i in 0..na {
                    prev[idx(s, m, i)] = end_charge(m);
                }
            }
        }
        let stored = 2 * na + nb;
        let mut values = vec![0f32; (steps + 1) * (slack + 1) * stored];
        let mut spot_actions = vec![0u8; (steps + 1) * (slack + 1) * (young + 1) * nb];
        let store = |values: &mut Vec<f32>, tau: usize, layer: &[f32]| {
            for s in 0..=slack {
                let base = (tau * (slack + 1) + s) * stored;
                for i in 0..na {
                    values[base + i] = layer[idx(s, IDLE, i)];
                    values[base + na + i] = layer[idx(s, OD, i)];
                }
                for b in 0..nb {
                    values[base + 2 * na + b] = layer[idx(s, 3, nb + b)];
                }
            }
        };
        store(&mut values, 0, &prev);
        // Expectations over the next state: per next mode, slack and current state.
        let mut ev_idle = vec![0f32; (slack + 1) * na];
        let mut ev_od = vec![0f32; (slack + 1) * na];
        // Spot going on into mode k (k = 3..paid), or back to idle when the pool goes down.
        let mut ev_spot = vec![0f32; (young) * (slack + 1) * na];
        // A spot launch beside on-demand (make before break).
        let mut ev_mbb = vec![0f32; (slack + 1) * na];
        let mut cur = vec![0f32; (slack + 1) * width];
        for tau in 1..=steps {
            for s in 0..=slack {
                for i in 0..na {
                    let row = &rows[i];
                    let (mut ei, mut eo) = (0f64, 0f64);
                    for &(j, w) in row {
                        ei += w * f64::from(prev[idx(s, IDLE, j)]);
                        eo += w * f64::from(prev[idx(s, OD, j)]);
                    }
                    ev_idle[s * na + i] = ei as f32;
                    ev_od[s * na + i] = eo as f32;
                    if !up[i] {
                        continue;
                    }
                    for k in 3..=paid {
                        let mut e = 0f64;
                        for &(j, w) in row {
                            let m = if up[j] { k } else { IDLE };
                            e += w * f64::from(prev[idx(s, m, j)]);
                        }
                        ev_spot[((k - 3) * (slack + 1) + s) * na + i] = e as f32;
                    }
                    if mbb {
                        let mut e = 0f64;
                        for &(j, w) in row {
                            let v = if up[j] {
                                f64::from(prev[idx(s, 3, j)])
                            } else {
                                f64::from(kept) * f64::from(prev[idx(s, OD, j)])
                                    + f64::from(1.0 - kept) * f64::from(prev[idx(s, IDLE, j)])
                            };
                            e += w * v;
                        }
                        ev_mbb[s * na + i] = e as f32;
                    }
                }
            }
            let at = |ev: &[f32], s: isize, i: usize| -> f32 {
                if s < 0 {
                    PENALTY
                } else {
                    ev[(s as usize).min(slack) * na + i]
                }
            };
            // After a start: the overhead spent.
            let started = |ev: &[f32], s: usize, i: usize| -> f32 {
                let s = s as isize - ofl as isize;
                (1.0 - ofr) * at(ev, s, i) + ofr * at(ev, s - 1, i)
            };
            let spot_ev =
                |k: usize| &ev_spot[(k - 3) * (slack + 1) * na..(k - 2) * (slack + 1) * na];
            for s in 0..=slack {
                let done = s >= tau * QUANTA;
                for m in 0..modes {
                    let leave = end_charge(m);
                    for i in 0..na {
                        if done {
                            cur[idx(s, m, i)] = leave;
                            continue;
                        }
                        let wait = leave + at(&ev_idle, s as isize - QUANTA as isize, i);
                        let mut od_code = 1u8;
                        let od = if m == OD {
                            od_step + at(&ev_od, s as isize, i)
                        } else {
                            let restart = leave + od_step + started(&ev_od, s, i);
                            // From spot, on-demand may start while spot works.
                            let beside = if mbb && m >= 2 {
                                leave + spot_overlap + od_step + at(&ev_od, s as isize, i)
                            } else {
                                f32::INFINITY
                            };
                            if beside < restart {
                                od_code = 3;
                                beside
                            } else {
                                restart
                            }
                        };
                        let spot = if !up[i] {
                            f32::INFINITY
                        } else if m == paid {
                            spot_step + at(spot_ev(paid), s as isize, i)
                        } else if (2..paid).contains(&m) {
                            let j = m - 2;
                            if j + 1 == young {
                                spot_hour + at(spot_ev(paid), s as isize, i)
                            } else {
                                at(spot_ev(m + 1), s as isize, i)
                            }
                        } else if m == OD && mbb {
                            started(spot_ev(3), s, i).min(od_overlap + at(&ev_mbb, s as isize, i))
                        } else {
                            started(spot_ev(3), s, i)
                        };
                        let (best, action) = if spot <= od && spot <= wait {
                            (spot, 2u8)
                        } else if od <= wait {
                            (od, od_code)
                        } else {
                            (wait, 0)
                        };
                        cur[idx(s, m, i)] = best.min(PENALTY);
                        if m >= 2 && up[i] {
                            let age = m - 2;
                            let a = ((tau * (slack + 1) + s) * (young + 1) + age) * nb + (i - nb);
                            spot_actions[a] = action;
                        }
                    }
                }
            }
            store(&mut values, tau, &cur);
            std::mem::swap(&mut prev, &mut cur);
        }
        DeadlinePlan {
            spec,
            model: model.clone(),
            transition: p,
            rows,
            step_secs: step,
            steps,
            slack,
            young,
            states: na,
            buckets: nb,
            values,
            spot_actions,
        }
    }

    /// The plan for `spec`, solved once per process for the same spec and model: the runs of a
    /// sweep (and jobs of one shape) share it. Plans are pure, so sharing changes nothing.
    pub fn cached(spec: PlanSpec, model: &AvailabilityModel) -> Arc<DeadlinePlan> {
        type Cache = Mutex<Vec<Arc<DeadlinePlan>>>;
        static CACHE: std::sync::OnceLock<Cache> = std::sync::OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
        let key = |p: &DeadlinePlan| p.spec == spec && p.model == *model;
        if let Some(p) = cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|p| key(p))
        {
            return p.clone();
        }
        let plan = Arc::new(DeadlinePlan::solve(spec, model));
        let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
        if !c.iter().any(|p| key(p)) {
            // A few shapes at a time: a plan is tens of megabytes.
            if c.len() >= 4 {
                c.remove(0);
            }
            c.push(plan.clone());
        }
        plan
    }

    pub fn spec(&self) -> &PlanSpec {
        &self.spec
    }

    pub fn model(&self) -> &AvailabilityModel {
        &self.model
    }

    /// The model's one-step transition matrix (for a belief's drift).
    pub fn transition(&self) -> &[f64] {
        &self.transition
    }

    /// Whether a job `time_left_secs` from its deadline with `slack_secs` is inside what the plan
    /// was solved for (a later, smaller job is; a longer one needs its own plan).
    pub fn covers(&self, time_left_secs: f64, slack_secs: f64) -> bool {
        time_left_secs <= self.steps as f64 * self.step_secs + 1.0
            && slack_secs <= self.slack as f64 * self.step_secs / QUANTA as f64
    }

    fn value(&self, tau: usize, s: usize, which: usize, i: usize) -> f64 {
        let stored = 2 * self.states + self.buckets;
        let base = (tau * (self.slack + 1) + s.min(self.slack)) * stored;
        f64::from(self.values[base + which * self.states + i])
    }

    /// The best action now, from the job's time to its deadline, its slack (time left minus
    /// the work left at full speed minus what is left of a start-up in progress), what it runs
    /// on, and what the policy believes of the pool.
    pub fn choose(
        &self,
        time_left_secs: f64,
        slack_secs: f64,
        mode: Mode,
        belief: &Belief,
    ) -> Choice {
        let q = self.step_secs / QUANTA as f64;
        // Whole steps, rounded up: never fewer steps of work left than there are.
        let tau = ((time_left_secs / self.step_secs).ceil() as usize).clamp(1, self.steps);
        let s = if slack_secs <= 0.0 {
            0
        } else {
            ((slack_secs / q).floor() as usize).min(self.slack)
        };
        let nb = self.buckets;
        let probs = belief.probs();
        let p_up = belief.up(&self.model);
        let spec = &self.spec;
        let od_step = spec.on_demand_usd_per_hour * self.step_secs / 3600.0;
        let oq = spec.overhead_secs.max(0.0) / q;
        let (ofl, ofr) = (oq.floor() as isize, oq - oq.floor());
        // Expected next value of `which` (0 idle, 1 on-demand, 2 spot one step old) from state
        // i at slack index `s` of the next layer; below zero slack, the penalty.
        let next = |s: isize, which: usize, i: usize| -> f64 {
            if s < 0 {
                return f64::from(PENALTY);
            }
            let s = s as usize;
            self.rows[i]
                .iter()
                .map(|&(j, w)| {
                    let v = match which {
                        2 if self.model.is_up(j) => self.value(tau - 1, s, 2, j - nb),
                        2 => self.value(tau - 1, s, 0, j),
                        w => self.value(tau - 1, s, w, j),
                    };
                    w * v
                })
                .sum()
        };
        let started = |s: isize, which: usize, i: usize| -> f64 {
            (1.0 - ofr) * next(s - ofl, which, i) + ofr * next(s - ofl - 1, which, i)
        };
        // Make before break (as the solver counts it).
        let mbb = spec.make_before_break;
        let overlap = spec.overhead_secs.max(0.0).min(self.step_secs);
        let od_overlap = spec.on_demand_usd_per_hour * overlap / 3600.0;
        let spot_overlap = spec.spot_usd_per_hour * overlap / 3600.0;
        let kept = overlap / self.step_secs;
        let beside = |s: isize, i: usize| -> f64 {
            if s < 0 {
                return f64::from(PENALTY);
            }
            let s = s as usize;
            self.rows[i]
                .iter()
                .map(|&(j, w)| {
                    w * if self.model.is_up(j) {
                        self.value(tau - 1, s, 2, j - nb)
                    } else {
                        kept * self.value(tau - 1, s, 1, j)
                            + (1.0 - kept) * self.value(tau - 1, s, 0, j)
                    }
                })
                .sum()
        };
        let s = s as isize;
        match mode {
            Mode::Idle | Mode::OnDemand => {
                let on_od = mode == Mode::OnDemand;
                let (mut wait, mut od, mut attempt, mut attempt_beside) = (0.0, 0.0, 0.0, 0.0);
                for (i, &w) in probs.iter().enumerate() {
                    if w == 0.0 {
                        continue;
                    }
                    let qi = next(s - QUANTA as isize, 0, i);
                    let qo = if on_od {
                        od_step + next(s, 1, i)
                    } else {
                        od_step + started(s, 1, i)
                    };
                    wait += w * qi;
                    od += w * qo;
                    let up = self.model.is_up(i);
                    attempt += w * if up {
                        started(s, 2, i)
                    } else {
                        // Refused: on-demand was let go for the try, so it starts again.
                        qi.min(od_step + started(s, 1, i))
                    };
                    // Beside on-demand: a refusal leaves it running.
                    attempt_beside += w * if up { od_overlap + beside(s, i) } else { qo };
                }
                let replace = on_od && mbb && attempt_beside < attempt;
                if replace {
                    attempt = attempt_beside;
                }
                // A try is worth it only when it can gain: with the pool surely down it is a
                // refusal (and, from on-demand, a restart) for nothing.
                let gain = 1e-6 * od.abs().max(1.0);
                let (action, expected_usd) = if attempt < od.min(wait) - gain {
                    (Action::Spot, attempt)
                } else if od <= wait {
                    (Action::OnDemand, od)
                } else {
                    (Action::Wait, wait)
                };
                Choice {
                    action,
                    expected_usd,
                    wait_usd: Some(wait),
                    on_demand_usd: Some(od),
                    spot_usd: Some(attempt),
                    p_up,
                    replace: replace && action == Action::Spot,
                }
            }
            Mode::Spot { age_secs } => {
                let age = ((age_secs.max(0.0) / self.step_secs).floor() as usize).min(self.young);
                // The belief is up (the instance runs): vote by the up states' best actions.
                let mut votes = [0f64; 4];
                let mut od = 0.0;
                let leave = if age < self.young {
                    spec.spot_usd_per_hour * age as f64 * self.step_secs / 3600.0
                } else {
                    0.0
                };
                let up_mass: f64 = probs[nb..].iter().sum();
                for b in 0..nb {
                    let w = if up_mass > 0.0 {
                        probs[nb + b] / up_mass
                    } else {
                        1.0 / nb as f64
                    };
                    if w == 0.0 {
                        continue;
                    }
                    let a =
                        ((tau * (self.slack + 1) + s as usize) * (self.young + 1) + age) * nb + b;
                    votes[usize::from(self.spot_actions[a])] += w;
                    let restart = leave + od_step + started(s, 1, nb + b);
                    od += w * if mbb {
                        restart.min(leave + spot_overlap + od_step + next(s, 1, nb + b))
                    } else {
                        restart
                    };
                }
                let to_od = votes[1] + votes[3];
                let action = if votes[2] >= to_od && votes[2] >= votes[0] {
                    Action::Spot
                } else if to_od >= votes[0] {
                    Action::OnDemand
                } else {
                    Action::Wait
                };
                Choice {
                    action,
                    expected_usd: if action == Action::OnDemand {
                        od
                    } else {
                        f64::NAN
                    },
                    wait_usd: None,
                    on_demand_usd: Some(od),
                    spot_usd: None,
                    p_up,
                    replace: action == Action::OnDemand && votes[3] > votes[1],
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(up_end: f64, down_end: f64) -> AvailabilityModel {
        AvailabilityModel {
            step_minutes: 10.0,
            bucket_steps: vec![1, 3],
            up_end: vec![up_end; 3],
            down_end: vec![down_end; 3],
        }
    }

    fn spec(work_h: f64, time_h: f64, overhead_h: f64) -> PlanSpec {
        PlanSpec {
            work_secs: work_h * 3600.0,
            time_secs: time_h * 3600.0,
            overhead_secs: overhead_h * 3600.0,
            spot_usd_per_hour: 1.0,
            on_demand_usd_per_hour: 3.0,
            make_before_break: false,
        }
    }

    fn seen(m: &AvailabilityModel, up: bool) -> Belief {
        let mut b = Belief::unknown(m);
        b.see(m, up, false);
        b
    }

    #[test]
    fn a_pool_that_stays_up_is_ridden_on_spot_and_paid_from_its_launch() {
        let m = model(1e-4, 0.9);
        let plan = DeadlinePlan::solve(spec(2.0, 3.0, 0.1), &m);
        let c = plan.choose(3.0 * 3600.0, 3600.0, Mode::Idle, &seen(&m, true));
        assert_eq!(c.action, Action::Spot, "{c:?}");
        // Two hours of work and the start-up, on spot, charged from the launch (it outlives
        // its first hour): about $2.1. A step of on-demand first costs more.
        assert!((c.expected_usd - 2.1).abs() < 0.25, "{c:?}");
        assert!(c.on_demand_usd.unwrap() > c.expected_usd + 0.3, "{c:?}");
        // Once on spot it stays.
        let c = plan.choose(
            2.5 * 3600.0,
            3600.0,
            Mode::Spot { age_secs: 1800.0 },
            &seen(&m, true),
        );
        assert_eq!(c.action, Action::Spot);
    }

    #[test]
    fn a_pool_that_stays_down_is_waited_for_only_while_the_slack_lasts() {
        let m = model(0.9, 1e-4);
        let plan = DeadlinePlan::solve(spec(2.0, 3.0, 0.1), &m);
        let down = seen(&m, false);
        // Whatever it does, on-demand has to do the work in the end: about $6.3.
        let c = plan.choose(3.0 * 3600.0, 3600.0, Mode::Idle, &down);
        assert!((c.expected_usd - 6.3).abs() < 0.35, "{c:?}");
        // With a restart and a step of slack left, it buys on-demand now, and keeps it.
        let c = plan.choose(2.25 * 3600.0, 0.25 * 3600.0, Mode::Idle, &down);
        assert_eq!(c.action, Action::OnDemand, "{c:?}");
        let c = plan.choose(2.25 * 3600.0, 0.25 * 3600.0, Mode::OnDemand, &down);
        assert_eq!(c.action, Action::OnDemand, "{c:?}");
        assert!(
            c.expected_usd < f64::from(PENALTY),
            "the deadline is met: {c:?}"
        );
    }

    #[test]
    fn a_short_outage_is_waited_out_and_a_fresh_spot_run_is_not_left_on_demand_for() {
        // Outages end fast (half within a step); an up run, once it has lasted, lasts.
        let m = AvailabilityModel {
            step_minutes: 10.0,
            bucket_steps: vec![1, 3],
            up_end: vec![0.6, 0.3, 0.005],
            down_end: vec![0.5, 0.5, 0.5],
        };
        let plan = DeadlinePlan::solve(spec(10.0, 14.0, 0.2), &m);
        let c = plan.choose(13.0 * 3600.0, 3.0 * 3600.0, Mode::Idle, &seen(&m, false));
        assert_eq!(
            c.action,
            Action::Wait,
            "a short outage, hours of slack: {c:?}"
        );
        // On on-demand with little slack, a spot run that has just begun is likely to end
        // within the hour; one that has lasted is not.
        let mut fresh = Belief::unknown(&m);
        fresh.see(&m, true, true);
        let mut old = Belief::unknown(&m);
        old.see(&m, true, true);
        old.drift(&m, &m.transition(), 6.0);
        old.see(&m, true, false);
        let t = 6.0 * 3600.0;
        let slack = 1.0 * 3600.0;
        let young = plan.choose(t, slack, Mode::OnDemand, &fresh);
        let aged = plan.choose(t, slack, Mode::OnDemand, &old);
        assert!(
            aged.spot_usd.unwrap() < young.spot_usd.unwrap(),
            "{young:?} {aged:?}"
        );
        assert_eq!(aged.action, Action::Spot, "{aged:?}");
        assert_eq!(young.action, Action::OnDemand, "{young:?}");
    }

    #[test]
    fn a_refused_try_from_on_demand_is_counted_as_starting_over() {
        let m = model(0.2, 0.2);
        let plan = DeadlinePlan::solve(spec(4.0, 5.0, 0.2), &m);
        let c = plan.choose(4.5 * 3600.0, 0.5 * 3600.0, Mode::OnDemand, &seen(&m, false));
        assert_ne!(c.action, Action::Spot, "the pool is down: {c:?}");
        assert!(
            c.spot_usd.unwrap() > c.on_demand_usd.unwrap(),
            "a refusal costs the on-demand instance's restart: {c:?}"
        );
    }

    /// The solver's values against a plain recursion over the same rules, on a case small
    /// enough to enumerate.
    #[test]
    fn the_solved_values_are_the_expectation_of_the_best_play() {
        let m = AvailabilityModel {
            step_minutes: 10.0,
            bucket_steps: vec![1],
            up_end: vec![0.4, 0.2],
            down_end: vec![0.5, 0.3],
        };
        let sp = PlanSpec {
            work_secs: 1200.0,
            time_secs: 2400.0,
            overhead_secs: 150.0,
            spot_usd_per_hour: 1.0,
            on_demand_usd_per_hour: 3.0,
            make_before_break: false,
        };
        let plan = DeadlinePlan::solve(sp, &m);
        let p = m.transition();
        let na = m.states();
        let young = plan.young;
        let q = 150.0;
        let step = 600.0;
        // value(tau, s, mode, i): modes 0 idle, 1 od, 2 + j spot with j steps, 2 + young paid.
        fn rec(
            tau: usize,
            s: i64,
            mode: usize,
            i: usize,
            ctx: &(Vec<f64>, usize, usize, f64, f64, &AvailabilityModel),
        ) -> f64 {
            let (p, na, young, step, q, m) = ctx;
            let (na, young) = (*na, *young);
            let spot_step = step / 3600.0;
            let od_step = 3.0 * step / 3600.0;
            let leave = if (2..2 + young).contains(&mode) {
                spot_step * (mode - 2) as f64
            } else {
                0.0
            };
            if s < 0 {
                return f64::from(PENALTY);
            }
            if s >= (tau * QUANTA) as i64 {
                return leave;
            }
            if tau == 0 {
                return leave;
            }
            let oh = (150.0 / q) as i64;
            let ev = |s2: i64, next_up: usize, next_down: usize| -> f64 {
                (0..na)
                    .map(|j| {
                        let w = p[i * na + j];
                        if w == 0.0 {
                            return 0.0;
                        }
                        let nm = if m.is_up(j) { next_up } else { next_down };
                        w * rec(tau - 1, s2, nm, j, ctx).min(f64::from(PENALTY))
                    })
                    .sum()
            };
            let wait = leave + ev(s - QUANTA as i64, 0, 0);
            let od = if mode == 1 {
                od_step + ev(s, 1, 1)
            } else {
                leave + od_step + ev(s - oh, 1, 1)
            };
            let mut best = wait.min(od);
            if m.is_up(i) {
                let paid = 2 + young;
                let spot = if mode == paid {
                    spot_step + ev(s, paid, 0)
                } else if (2..paid).contains(&mode) {
                    let j = mode - 2;
                    if j + 1 == young {
                        spot_step * young as f64 + ev(s, paid, 0)
                    } else {
                        ev(s, mode + 1, 0)
                    }
                } else {
                    ev(s - oh, 3, 0)
                };
                best = best.min(spot);
            }
            best.min(f64::from(PENALTY))
        }
        let ctx = (p, na, young, step, q, &m);
        for tau in 1..=plan.steps {
            for s in 0..=plan.slack.min(tau * QUANTA) {
                for i in 0..na {
                    for (which, mode) in [(0usize, 0usize), (1, 1)] {
                        let want = rec(tau, s as i64, mode, i, &ctx);
                        let got = plan.value(tau, s, which, i);
                        assert!(
                            (want - got).abs() < 1e-3 * want.max(1.0),
                            "tau {tau} s {s} mode {mode} state {i}: {got} vs {want}"
                        );
                    }
                }
            }
        }
        // More slack never costs more.
        for tau in 1..=plan.steps {
            for s in 1..=plan.slack {
                for i in 0..na {
                    assert!(plan.value(tau, s, 0, i) <= plan.value(tau, s - 1, 0, i) + 1e-4);
                }
            }
        }
    }
}
