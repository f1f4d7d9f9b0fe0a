//! What a whole fleet has seen of each spot pool, and what it learns from it.
//!
//! One job sees a pool only through its own instances: while it waits or runs on-demand it
//! knows only what its last try said. A broker runs many jobs, and every spot launch any of
//! them makes, every refusal, every interruption and every instance still running says
//! something about the pool it was in. The [`PoolBook`] folds those observations, in time
//! order, into one [`Belief`] per pool that every job's plan reads, and learns each pool's own
//! availability model online from them: the prior model (fitted on the 2022 traces) scaled per
//! pool, up and down runs apart, by how many run ends the fleet saw against how many the prior
//! expected over the same watched time (a proportional-hazards estimate; the prior counts as
//! [`PoolBook::PRIOR_ENDS`] ends of evidence).
//!
//! The book is pure: observations carry their time, the caller passes `now`. Its input is a
//! log ([`PoolObservation`]), so a broker keeps the log in the store and any broker folds the
//! same book from it, after a restart too.
//!
//! What counts as watched time: a pool is watched up while the fleet holds a spot instance in
//! it (it is up for as long as the instance runs), and watched down between two refusals less
//! than one step of the model apart. An up run's end is seen as an interruption (or a refusal
//! within a step of the pool being seen up); a down run's end as a grant within a step of a
//! refusal. Several jobs interrupted at one instant saw one end.

use super::availability::{AvailabilityModel, Belief};
use crate::market::{Market, Timestamp};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What was seen of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "seen")]
pub enum Seen {
    /// A spot launch was granted: the pool is up, and the fleet holds one more instance there.
    Granted,
    /// A spot launch was refused for capacity: the pool is down.
    Refused,
    /// A spot instance got its interruption notice: the pool's up run ended now.
    Interrupted,
    /// A spot instance was ended by its job (or the job ended): the pool was up until now, and
    /// the fleet holds one instance fewer there.
    Released,
}

/// One observation of one pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolObservation {
    pub market: Market,
    pub at: Timestamp,
    #[serde(flatten)]
    pub seen: Seen,
}

/// Run ends seen against those the prior expected, over the time a pool was watched in a state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Exposure {
    /// Run ends seen.
    pub ends: f64,
    /// Run ends the prior model expected over the watched time.
    pub expected: f64,
    /// Watched time, hours.
    pub hours: f64,
}

impl Exposure {
    /// How much likelier a run is to end per step than the prior says, with the prior weighing
    /// as [`PoolBook::PRIOR_ENDS`] ends.
    pub fn multiplier(&self) -> f64 {
        (self.ends + PoolBook::PRIOR_ENDS) / (self.expected + PoolBook::PRIOR_ENDS)
    }
}

/// What the book holds for one pool.
#[derive(Debug, Clone)]
struct Pool {
    /// The prior scaled by what was learned.
    model: AvailabilityModel,
    transition: Vec<f64>,
    /// Learned multipliers as applied (quantised), down and up.
    applied: [f64; 2],
    belief: Belief,
    /// When the belief was last brought up to date.
    at: Timestamp,
    /// Spot instances the fleet holds there.
    held: u32,
    /// The last state seen, and when.
    last: Option<(Timestamp, bool)>,
    /// [down, up]
    exposure: [Exposure; 2],
    observations: u64,
}

/// What the fleet has seen of one pool, for reports and the store.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolSummary {
    pub market: String,
    pub observations: u64,
    pub held: u32,
    /// The chance the pool is up at the asked time.
    pub p_up: f64,
    pub up: Exposure,
    pub down: Exposure,
    /// The learned end-rate multipliers applied to the prior (up, down).
    pub up_multiplier: f64,
    pub down_multiplier: f64,
    /// The long-run share of time up under the learned model.
    pub up_share: f64,
}

/// Every pool's belief and learned model, folded from the fleet's observations.
#[derive(Debug, Clone)]
pub struct PoolBook {
    prior: AvailabilityModel,
    prior_transition: Vec<f64>,
    learn: bool,
    pools: BTreeMap<Market, Pool>,
}

impl PoolBook {
    /// How many run ends of evidence the prior counts as, per state.
    pub const PRIOR_ENDS: f64 = 3.0;
    /// Multipliers are applied in steps of a quarter power of two, within [1/8, 8], so that
    /// plans and transitions are shared between pools that learned alike.
    const QUANTUM: f64 = 0.25;
    const MAX_LOG2: f64 = 3.0;

    /// A book over `prior`; `learn: false` keeps the prior for every pool (beliefs are still
    /// shared).
    pub fn new(prior: AvailabilityModel, learn: bool) -> Self {
        let prior_transition = prior.transition();
        PoolBook {
            prior,
            prior_transition,
            learn,
            pools: BTreeMap::new(),
        }
    }

    pub fn prior(&self) -> &AvailabilityModel {
        &self.prior
    }

    /// Folds one observation in. Observations should come in time order; one older than what
    /// the pool has already seen is taken as seen at that latest time.
    pub fn observe(&mut self, o: &PoolObservation) {
        let prior = &self.prior;
        let prior_t = &self.prior_transition;
        let pool = self.pools.entry(o.market.clone()).or_insert_with(|| Pool {
            model: prior.clone(),
            transition: prior_t.clone(),
            applied: [1.0, 1.0],
            belief: Belief::unknown(prior),
            at: o.at,
            held: 0,
            last: None,
            exposure: [Exposure::default(); 2],
            observations: 0,
        });
        let at = o.at.max(pool.at);
        let step = prior.step_secs();
        // Watched since the last look: up while an instance is held; down between refusals
        // within a step.
        let watched = if pool.held > 0 {
            Some(true)
        } else {
            match pool.last {
                Some((t, false)) if at.secs_since(t) <= step => Some(false),
                _ => None,
            }
        };
        advance(pool, prior, at, watched);
        let recent = |pool: &Pool, up: bool| matches!(pool.last, Some((t, s)) if s == up && at.secs_since(t) <= step);
        match o.seen {
            Seen::Granted => {
                let came_up = recent(pool, false);
                if came_up {
                    pool.exposure[0].ends += 1.0;
                }
                pool.belief.see(&pool.model, true, came_up);
                pool.held += 1;
                pool.last = Some((at, true));
            }
            Seen::Refused => {
                // Watched up until now (an instance is held, or a look within a step said up):
                // the up run ended.
                let went =
                    pool.last.is_some_and(|(_, up)| up) && (pool.held > 0 || recent(pool, true));
                if went {
                    pool.exposure[1].ends += 1.0;
                }
                pool.belief.see(&pool.model, false, went);
                pool.last = Some((at, false));
            }
            Seen::Interrupted => {
                // One end however many instances were warned at this instant.
                if pool.last != Some((at, false)) {
                    pool.exposure[1].ends += 1.0;
                    pool.belief.see(&pool.model, false, true);
                }
                pool.held = pool.held.saturating_sub(1);
                pool.last = Some((at, false));
            }
            Seen::Released => {
                if pool.last != Some((at, false)) {
                    pool.belief.see(&pool.model, true, false);
                    pool.last = Some((at, true));
                }
                pool.held = pool.held.saturating_sub(1);
            }
        }
        pool.observations += 1;
        if self.learn {
            relearn(pool, prior);
        }
    }

    /// The fleet's belief of `market` at `now` (drifted by the pool's model since the last
    /// observation, up while the fleet holds an instance there), or `None` if nothing was seen
    /// of it.
    pub fn belief(&self, market: &Market, now: Timestamp) -> Option<Belief> {
        let pool = self.pools.get(market)?;
        let mut b = pool.belief.clone();
        if now > pool.at {
            b.drift(
                &pool.model,
                &pool.transition,
                now.secs_since(pool.at) / pool.model.step_secs(),
            );
        }
        if pool.held > 0 {
            b.see(&pool.model, true, false);
        }
        Some(b)
    }

    /// The pool's learned model (the prior if nothing was learned).
    pub fn model(&self, market: &Market) -> &AvailabilityModel {
        self.pools.get(market).map_or(&self.prior, |p| &p.model)
    }

    /// The one-step transition of [`PoolBook::model`] (kept with it, not recomputed).
    pub fn transition(&self, market: &Market) -> &[f64] {
        self.pools
            .get(market)
            .map_or(&self.prior_transition, |p| &p.transition)
    }

    /// Every pool the fleet has seen, at `now`.
    pub fn summary(&self, now: Timestamp) -> Vec<PoolSummary> {
        self.pools
            .iter()
            .map(|(m, p)| PoolSummary {
                market: m.to_string(),
                observations: p.observations,
                held: p.held,
                p_up: self.belief(m, now).map_or(f64::NAN, |b| b.up(&p.model)),
                up: p.exposure[1],
                down: p.exposure[0],
                up_multiplier: p.applied[1],
                down_multiplier: p.applied[0],
                up_share: p.model.up_share(),
            })
            .collect()
    }
}

/// Brings a pool's belief to `at`, counting the watched time's expected run ends (under the
/// prior, from the belief's ages) when the pool was watched in one state throughout.
fn advance(pool: &mut Pool, prior: &AvailabilityModel, at: Timestamp, watched: Option<bool>) {
    let steps = at.secs_since(pool.at) / pool.model.step_secs();
    if steps <= 0.0 {
        return;
    }
    match watched {
        None => pool.belief.drift(&pool.model, &pool.transition, steps),
        Some(up) => {
            // Step by step, conditioned on the state it was watched in.
            let mut left = steps;
            let nb = prior.buckets();
            while left > 1e-9 {
                let dt = left.min(1.0);
                pool.belief.see(&pool.model, up, false);
                let probs = pool.belief.probs();
                let ends = if up { &prior.up_end } else { &prior.down_end };
                let offset = usize::from(up) * nb;
                let hazard: f64 = (0..nb).map(|b| probs[offset + b] * ends[b]).sum();
                let e = &mut pool.exposure[usize::from(up)];
                e.expected += hazard * dt;
                e.hours += dt * prior.step_secs() / 3600.0;
                pool.belief.drift(&pool.model, &pool.transition, dt);
                left -= dt;
            }
            pool.belief.see(&pool.model, up, false);
        }
    }
    pool.at = at;
}

/// The pool's model from its exposure: the prior's end probabilities scaled as hazards
/// (`1 − (1 − p)^m`), `m` quantised.
fn relearn(pool: &mut Pool, prior: &AvailabilityModel) {
    let q = |e: &Exposure| {
        let l = e
            .multiplier()
            .log2()
            .clamp(-PoolBook::MAX_LOG2, PoolBook::MAX_LOG2);
        2f64.powf((l / PoolBook::QUANTUM).round() * PoolBook::QUANTUM)
    };
    let next = [q(&pool.exposure[0]), q(&pool.exposure[1])];
    if next == pool.applied {
        return;
    }
    let scale = |ps: &[f64], m: f64| -> Vec<f64> {
        ps.iter()
            .map(|&p| (1.0 - (1.0 - p).powf(m)).clamp(1e-4, 0.9999))
            .collect()
    };
    pool.model = AvailabilityModel {
        down_end: scale(&prior.down_end, next[0]),
        up_end: scale(&prior.up_end, next[1]),
        ..prior.clone()
    };
    pool.transition = pool.model.transition();
    pool.applied = next;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> AvailabilityModel {
        AvailabilityModel {
            step_minutes: 10.0,
            bucket_steps: vec![1, 2, 4],
            up_end: vec![0.3, 0.2, 0.1, 0.05],
            down_end: vec![0.5, 0.3, 0.2, 0.1],
        }
    }

    fn pool() -> Market {
        "us-west-2a/p3.2xlarge".parse().unwrap()
    }

    fn t(min: f64) -> Timestamp {
        Timestamp::from_millis((min * 60_000.0) as i64)
    }

    fn see(book: &mut PoolBook, min: f64, seen: Seen) {
        book.observe(&PoolObservation {
            market: pool(),
            at: t(min),
            seen,
        });
    }

    #[test]
    fn another_jobs_instance_tells_a_waiting_job_the_pool_is_up_until_it_is_interrupted() {
        let m = model();
        let mut book = PoolBook::new(m.clone(), false);
        assert!(book.belief(&pool(), t(0.0)).is_none());
        // Job A's launch is granted at 0; job B, on on-demand, reads the book at 95 min.
        see(&mut book, 0.0, Seen::Granted);
        let b = book.belief(&pool(), t(95.0)).unwrap();
        assert_eq!(b.up(&m), 1.0, "held: up for sure");
        // A's instance is interrupted at 100: B learns of a fresh down run.
        see(&mut book, 100.0, Seen::Interrupted);
        let b = book.belief(&pool(), t(100.0)).unwrap();
        assert_eq!(b.probs()[m.state(false, 1)], 1.0);
        // Ten minutes on, unobserved: it drifts by the chain (a fresh outage ends with 0.5).
        let b = book.belief(&pool(), t(110.0)).unwrap();
        assert!((b.up(&m) - 0.5).abs() < 1e-9, "{}", b.up(&m));
    }

    #[test]
    fn several_instances_interrupted_at_once_are_one_end_and_released_ones_leave_the_pool_up() {
        let mut book = PoolBook::new(model(), true);
        see(&mut book, 0.0, Seen::Granted);
        see(&mut book, 0.0, Seen::Granted);
        see(&mut book, 60.0, Seen::Interrupted);
        see(&mut book, 60.0, Seen::Interrupted);
        let s = &book.summary(t(60.0))[0];
        assert_eq!(s.up.ends, 1.0);
        assert_eq!(s.held, 0);
        // Watched up for the hour, once (two instances, one pool).
        assert!((s.up.hours - 1.0).abs() < 1e-9, "{}", s.up.hours);
        see(&mut book, 70.0, Seen::Granted);
        see(&mut book, 80.0, Seen::Released);
        let m = model();
        assert_eq!(book.belief(&pool(), t(80.0)).unwrap().up(&m), 1.0);
        assert_eq!(book.summary(t(80.0))[0].held, 0);
    }

    #[test]
    fn a_pool_that_stays_up_longer_than_the_prior_says_learns_rarer_ends() {
        let m = model();
        let mut book = PoolBook::new(m.clone(), true);
        // Up runs of 10 hours, each seen from a launch at its start to its interruption, with
        // a short outage watched by refusals between.
        let mut at = 0.0;
        for _ in 0..6 {
            see(&mut book, at, Seen::Granted);
            at += 600.0;
            see(&mut book, at, Seen::Interrupted);
            see(&mut book, at + 5.0, Seen::Refused);
            at += 10.0;
        }
        let s = &book.summary(t(at))[0];
        assert_eq!(s.up.ends, 6.0);
        assert!(s.up.expected > 20.0, "{s:?}");
        assert!(s.up_multiplier < 0.5, "{s:?}");
        let learned = book.model(&pool());
        assert!(learned.up_end[3] < m.up_end[3] / 2.0, "{learned:?}");
        assert!(learned.up_share() > m.up_share());
        // A book that does not learn keeps the prior.
        let mut fixed = PoolBook::new(m.clone(), false);
        see(&mut fixed, 0.0, Seen::Granted);
        see(&mut fixed, 600.0, Seen::Interrupted);
        assert_eq!(fixed.model(&pool()), &m);
    }

    #[test]
    fn outages_watched_by_refusals_count_and_a_grant_right_after_ends_one() {
        let mut book = PoolBook::new(model(), true);
        see(&mut book, 0.0, Seen::Refused);
        see(&mut book, 5.0, Seen::Refused);
        see(&mut book, 10.0, Seen::Granted);
        let s = &book.summary(t(10.0))[0];
        assert_eq!(s.down.ends, 1.0);
        assert!((s.down.hours - 10.0 / 60.0).abs() < 1e-9, "{s:?}");
        // A refusal long after the last look watched nothing in between.
        see(&mut book, 20.0, Seen::Released);
        see(&mut book, 300.0, Seen::Refused);
        let s = &book.summary(t(300.0))[0];
        assert_eq!(s.up.ends, 0.0, "{s:?}");
    }
}
