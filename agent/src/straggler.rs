//! Straggler injection and pacing, for tests and benchmarks.
//!
//! A *paced* worker computes at a fixed rate of training samples per second: after computing
//! some items it sleeps until its budget allows them, so it uses a small, steady share of a
//! core; when the computation itself took longer than its budget (the CPU is contended or
//! capped), it does not sleep, so a real CPU shortage slows it as it would on a real machine.
//! A slowed worker's rate is divided by its slowdown. Pacing is per agent and shared by
//! everything its worker computes (its own range, chunks it takes over, ranges handed to it), so
//! helping others costs a helper its own time, as it would on a real machine. Without pacing a
//! slowdown `f` sleeps `f - 1` times the compute time after each computation.

use proteus_wire::agent_api::{StragglerInjection, StragglerPattern};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// Lateness of a paced computation that is counted as timer overshoot, not as a pause.
const TIMER_SLACK: Duration = Duration::from_millis(3);

/// One agent's injected slowness.
#[derive(Debug)]
pub struct Pace {
    injection: StragglerInjection,
    /// This agent's own persistent slowdown (`proteus-agent --slowdown`), on top of the job's.
    agent_slowdown: f64,
    seed: u64,
    /// When the paced worker's budget is free again.
    next_free: Mutex<Option<Instant>>,
}

impl Pace {
    pub fn new(injection: StragglerInjection, agent_slowdown: f64, seed: u64) -> Pace {
        Pace {
            injection,
            agent_slowdown: if agent_slowdown.is_finite() && agent_slowdown >= 1.0 {
                agent_slowdown
            } else {
                1.0
            },
            seed,
            next_free: Mutex::new(None),
        }
    }

    /// No injection at all.
    pub fn none() -> Pace {
        Pace::new(StragglerInjection::default(), 1.0, 0)
    }

    /// How many times slower the worker of `rank` is at `clock`.
    pub fn slowdown(&self, rank: u32, clock: u64) -> f64 {
        let job = match self.injection.pattern {
            StragglerPattern::None => 1.0,
            StragglerPattern::Persistent { rank: r, slowdown } if r == rank => slowdown,
            StragglerPattern::Persistent { .. } => 1.0,
            StragglerPattern::Transient {
                probability,
                slowdown,
            } => {
                let mix = self.seed
                    ^ u64::from(rank).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ clock.wrapping_mul(0xD1B5_4A32_D192_ED03);
                if ChaCha8Rng::seed_from_u64(mix).random::<f64>() < probability {
                    slowdown
                } else {
                    1.0
                }
            }
        };
        job * self.agent_slowdown
    }

    /// Whether any slowness or pacing is configured.
    pub fn is_active(&self) -> bool {
        self.injection.pace_samples_per_sec.is_some()
            || self.agent_slowdown > 1.0
            || !matches!(self.injection.pattern, StragglerPattern::None)
    }

    /// After computing `samples` samples in `compute` as the worker of `rank` at `clock`: wait
    /// as long as the injection says.
    pub async fn spend(&self, samples: usize, compute: Duration, rank: u32, clock: u64) {
        let f = self.slowdown(rank, clock);
        match self.injection.pace_samples_per_sec {
            Some(rate) => {
                let cost = Duration::from_secs_f64(samples as f64 * f / rate);
                let until = {
                    let mut next = self.next_free.lock().unwrap_or_else(|e| e.into_inner());
                    let until = budget_end(*next, Instant::now(), compute, cost);
                    *next = Some(until);
                    until
                };
                tokio::time::sleep_until(until).await;
            }
            None if f > 1.0 => tokio::time::sleep(compute.mul_f64(f - 1.0)).await,
            None => {}
        }
    }
}

/// When the budget of a computation that took `compute` and is worth `cost` of paced time ends,
/// the last one having ended at `last`. It runs from where the last one ended if the computation
/// began by then (back to back, or late by a timer's overshoot), else from when it began: idle
/// time (waiting for others) is not banked. The worker waits until then, so it computes at the
/// paced rate, or at the CPU's when that is slower (the result is then already past: a CPU taken
/// by another process slows a paced worker as it would an unpaced one).
fn budget_end(last: Option<Instant>, now: Instant, compute: Duration, cost: Duration) -> Instant {
    let began = now.checked_sub(compute).unwrap_or(now);
    let start = match last {
        Some(n) if began <= n + TIMER_SLACK => n,
        _ => began,
    };
    start + cost
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_slowdowns_follow_their_probability_and_seed() {
        let p = Pace::new(
            StragglerInjection {
                pattern: StragglerPattern::Transient {
                    probability: 0.1,
                    slowdown: 4.0,
                },
                pace_samples_per_sec: None,
            },
            1.0,
            7,
        );
        let slowed = (0..4)
            .flat_map(|r| (0..1000).map(move |c| (r, c)))
            .filter(|&(r, c)| p.slowdown(r, c) > 1.0)
            .count();
        assert!((300..500).contains(&slowed), "{slowed} of 4000");
        assert_eq!(p.slowdown(1, 17), p.slowdown(1, 17));
        let persistent = Pace::new(
            StragglerInjection {
                pattern: StragglerPattern::Persistent {
                    rank: 3,
                    slowdown: 2.0,
                },
                pace_samples_per_sec: Some(100.0),
            },
            1.5,
            0,
        );
        assert_eq!(persistent.slowdown(3, 0), 3.0);
        assert_eq!(persistent.slowdown(0, 0), 1.5);
    }

    #[test]
    fn a_budget_counts_the_computation_and_banks_no_idle_time() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let now = t0 + ms(1_000);
        // First computation, 4 ms of a 20 ms budget: the budget began with the computation.
        assert_eq!(budget_end(None, now, ms(4), ms(20)), now - ms(4) + ms(20));
        // Back to back: the next budget starts where the last ended, even if the computation
        // began a timer's overshoot after it.
        let last = now - ms(6);
        assert_eq!(budget_end(Some(last), now, ms(4), ms(20)), last + ms(20));
        // After a pause (waiting for others) the budget starts afresh from the computation.
        let long_ago = now - ms(500);
        assert_eq!(
            budget_end(Some(long_ago), now, ms(4), ms(20)),
            now - ms(4) + ms(20)
        );
        // A computation slower than its budget (a capped CPU) is not paced further: its budget
        // is already over.
        assert!(budget_end(None, now, ms(50), ms(20)) < now);
        assert!(budget_end(Some(now - ms(50)), now, ms(50), ms(20)) < now);
    }

    #[tokio::test]
    async fn pacing_is_shared_by_everything_the_agent_computes() {
        let p = std::sync::Arc::new(Pace::new(
            StragglerInjection {
                pattern: StragglerPattern::None,
                pace_samples_per_sec: Some(1000.0),
            },
            1.0,
            0,
        ));
        let t = Instant::now();
        let (a, b) = (p.clone(), p.clone());
        let x = tokio::spawn(async move { a.spend(50, Duration::ZERO, 0, 0).await });
        let y = tokio::spawn(async move { b.spend(50, Duration::ZERO, 0, 0).await });
        let _ = (x.await, y.await);
        // Two concurrent 50 ms budgets take 100 ms, not 50.
        assert!(t.elapsed() >= Duration::from_millis(100));
    }
}
