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

/// Wall time as the brokers' shared database tells it: this machine's clock plus its offset to
/// the database's clock, which the broker measures at start and keeps measuring
/// (`startup::database_clock`). Brokers on one database then stamp launches, ends,
/// jobs' ends and bills on one clock, whatever their machines' clocks say — a broker whose clock
/// runs a minute slow would otherwise bill a job it takes over a minute less than its previous
/// owner had. Never runs backwards (a new offset that would move it back holds it instead).
#[derive(Debug, Default)]
pub struct DatabaseClock {
    offset_ms: std::sync::atomic::AtomicI64,
    last_ms: std::sync::atomic::AtomicI64,
}

impl DatabaseClock {
    /// The database's clock minus this machine's, in milliseconds.
    pub fn offset_ms(&self) -> i64 {
        self.offset_ms.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn set_offset_ms(&self, offset_ms: i64) {
        self.offset_ms
            .store(offset_ms, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Clock for DatabaseClock {
    fn now(&self) -> Timestamp {
        let t = Timestamp::now().millis() + self.offset_ms();
        let before = self
            .last_ms
            .fetch_max(t, std::sync::atomic::Ordering::Relaxed);
        Timestamp::from_millis(t.max(before))
    }
    fn speed(&self) -> f64 {
        1.0
    }
}

/// The simulated cloud's market time: from `origin` when the clock is created, `speed` times
/// faster than wall time, unless held. A hold (`proteus serve --hold-at`, `POST /v1/sim/clock`)
/// lets the market run up to an instant and stop there until it is lifted; then it runs on
/// from there. So whoever watches a moment of the trace (a test that needs its agents training
/// when a price spike comes, a user looking at a decision) says when the market passes it,
/// not the machine's speed. Market time never runs backwards: a hold before now stops it now.
#[derive(Debug)]
pub struct SimClock {
    speed: f64,
    run: std::sync::Mutex<Run>,
}

/// Where the market stood when it last started running, and where it will stop.
#[derive(Debug, Clone, Copy)]
struct Run {
    origin: Timestamp,
    started: Instant,
    hold: Option<Timestamp>,
}

impl Run {
    fn now(&self, speed: f64) -> Timestamp {
        let t = self
            .origin
            .plus_secs(self.started.elapsed().as_secs_f64() * speed);
        match self.hold {
            Some(h) if t > h => h.max(self.origin),
            _ => t,
        }
    }
}

impl SimClock {
    pub fn new(origin: Timestamp, speed: f64) -> Self {
        SimClock {
            speed: if speed.is_finite() && speed > 0.0 {
                speed
            } else {
                1.0
            },
            run: std::sync::Mutex::new(Run {
                origin,
                started: Instant::now(),
                hold: None,
            }),
        }
    }

    fn run(&self) -> std::sync::MutexGuard<'_, Run> {
        self.run.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hold the market at `hold` (it runs there and stops), or lift the hold (`None`: it runs
    /// on from where it stands). Returns the market time now.
    pub fn hold_at(&self, hold: Option<Timestamp>) -> Timestamp {
        let mut run = self.run();
        let now = run.now(self.speed);
        *run = Run {
            origin: now,
            started: Instant::now(),
            hold: hold.map(|h| h.max(now)),
        };
        now
    }

    /// The instant the market is held at, if it is.
    pub fn held_at(&self) -> Option<Timestamp> {
        self.run().hold
    }
}

impl Clock for SimClock {
    fn now(&self) -> Timestamp {
        self.run().now(self.speed)
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

    #[test]
    fn the_database_clock_keeps_its_offset_and_never_runs_backwards() {
        let c = DatabaseClock::default();
        c.set_offset_ms(60_000);
        let ahead = c.now();
        assert!(ahead.millis() - Timestamp::now().millis() >= 59_000);
        c.set_offset_ms(-60_000);
        assert!(
            c.now() >= ahead,
            "a smaller offset holds the clock; it does not move it back"
        );
        assert_eq!(c.speed(), 1.0);
    }
    use super::*;

    #[test]
    fn sim_clock_runs_faster() {
        let c = SimClock::new(Timestamp::from_millis(0), 3600.0);
        std::thread::sleep(Duration::from_millis(20));
        let t = c.now();
        assert!(
            t.millis() >= 72_000,
            "20 ms wall at 3600x is at least 72 s market, got {t:?}"
        );
        assert_eq!(c.wall_for(3600.0), Duration::from_secs(1));
    }

    #[test]
    fn a_held_sim_clock_stops_at_the_hold_and_runs_on_from_it() {
        let c = SimClock::new(Timestamp::from_millis(0), 3600.0);
        // Held a minute in: at 3600x that is 17 ms of wall time, long passed after 30 ms.
        c.hold_at(Some(Timestamp::from_millis(60_000)));
        assert_eq!(c.held_at(), Some(Timestamp::from_millis(60_000)));
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(c.now(), Timestamp::from_millis(60_000));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(c.now(), Timestamp::from_millis(60_000), "it stays there");
        // Lifted, it runs on from the hold, not from where it would have been.
        let lifted = std::time::Instant::now();
        assert_eq!(c.hold_at(None), Timestamp::from_millis(60_000));
        assert_eq!(c.held_at(), None);
        std::thread::sleep(Duration::from_millis(10));
        let t = c.now();
        let most = (lifted.elapsed().as_secs_f64() * 3600.0 * 1000.0).ceil() as i64;
        let ran = t.millis() - 60_000;
        assert!(
            (36_000..=most).contains(&ran),
            "ran {ran} ms of market in the {most} ms since the lift (at 3600x)"
        );
        // A hold in the past stops the market where it stands: time never runs backwards.
        let now = c.hold_at(Some(Timestamp::from_millis(0)));
        assert!(now >= t);
        assert_eq!(c.held_at(), Some(now));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(c.now(), now);
    }
}
