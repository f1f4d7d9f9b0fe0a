//! Market time. On a real cloud it is wall time; on the simulated cloud it runs `speed` times
//! faster from a chosen instant of the trace, so a day of spot history plays out in minutes.
//! Everything in the live broker that reads the time reads it from a [`Clock`].

use crate::market::Timestamp;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A source of market time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current market time.
    fn now(&self) -> Timestamp;
    /// Market seconds per wall second (1 for a real cloud).
    fn speed(&self) -> f64;

    /// How long to wait in wall time for `market_secs` of market time to pass.
    fn wall_for(&self, market_secs: f64) -> Duration {
        Duration::from_secs_f64((market_secs / self.speed()).max(0.0))
    }
}

pub type SharedClock = Arc<dyn Clock>;

/// Wall time.
#[derive(Debug, Default, Clone, Copy)]
pub struct WallClock;

impl Clock for WallClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
    fn speed(&self) -> f64 {
        1.0
    }
}

/// Market time that starts at `origin` when the clock is created and runs `speed` times faster
/// than wall time.
#[derive(Debug, Clone)]
pub struct ScaledClock {
    origin: Timestamp,
    started: Instant,
    speed: f64,
}

impl ScaledClock {
    pub fn new(origin: Timestamp, speed: f64) -> Self {
        ScaledClock {
            origin,
            started: Instant::now(),
            speed: if speed.is_finite() && speed > 0.0 {
                speed
            } else {
                1.0
            },
        }
    }
}

impl Clock for ScaledClock {
    fn now(&self) -> Timestamp {
        self.origin
            .plus_secs(self.started.elapsed().as_secs_f64() * self.speed)
    }
    fn speed(&self) -> f64 {
        self.speed
    }
}

/// A clock that moves only when told to: for tests that must not depend on scheduling.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<std::sync::Mutex<Timestamp>>,
}

impl ManualClock {
    pub fn new(start: Timestamp) -> Self {
        ManualClock {
            now: Arc::new(std::sync::Mutex::new(start)),
        }
    }
    pub fn advance_secs(&self, secs: f64) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        *now = now.plus_secs(secs);
    }
    pub fn set(&self, t: Timestamp) {
        *self.now.lock().unwrap_or_else(|e| e.into_inner()) = t;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        *self.now.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn speed(&self) -> f64 {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_clock_runs_faster() {
        let c = ScaledClock::new(Timestamp::from_millis(0), 3600.0);
        std::thread::sleep(Duration::from_millis(20));
        let t = c.now();
        assert!(
            t.millis() >= 72_000,
            "20 ms wall at 3600x is at least 72 s market, got {t:?}"
        );
        assert_eq!(c.wall_for(3600.0), Duration::from_secs(1));
    }
}
