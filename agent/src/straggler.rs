//! Straggler injection and pacing, for tests and benchmarks.
//!
//! A *paced* worker computes at a fixed rate of training samples per second: after computing
//! some items it sleeps until its budget allows them, so it uses a small, steady share of a
//! core. A slowed worker's rate is divided by its slowdown. Pacing is per agent and shared by
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
                    let now = Instant::now();
                    // Continue from where the budget ended if we are just late by a timer's
                    // overshoot (else a worker paced item by item would lose ~1 ms per item);
                    // after a real pause (waiting for others) start afresh: idle time is not
                    // banked.
                    let start = match *next {
                        Some(n) if now <= n + TIMER_SLACK => n,
                        _ => now,
                    };
                    let until = start + cost;
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
