//! Everything decided about a job, in one place: [`JobEngine`] (a pure, deterministic state
//! machine, one per job) and what it is built from — the rules of the world (how long a notice
//! lasts), when the policy is consulted, the market [`view`] it reads, the footprint's
//! [`limits`], the [`work`] and [`progress`] accounting, and the [`digest`] of its decisions.
//!
//! The simulator ([`crate::sim`]) and the live scheduler ([`crate::service`]) are its two
//! drivers: what the simulator measures is what the broker does.

use crate::market::Timestamp;

pub mod digest;
pub mod job_engine;

pub use job_engine::JobEngine;
pub mod limits;
pub mod progress;
pub mod view;
pub mod work;

/// Seconds between a provider's interruption notice and the termination (EC2's two minutes).
pub const NOTICE_SECS: f64 = 120.0;

/// How long a driver waits before consulting the policy again when nothing happens and the
/// policy asked for no earlier wake-up (market seconds).
pub const DECISION_INTERVAL_SECS: f64 = 600.0;

/// The soonest a policy's own wake-up request is honoured after a decision (market seconds), so
/// that a policy cannot make a driver spin.
pub const MIN_WAKE_SECS: f64 = 1.0;

/// When a driver next consults the policy on its own, after a decision at `now` that asked to
/// be woken at `wake_at`. Events (instances ready, warned, evicted; launches refused) consult
/// it sooner, in both drivers.
pub fn next_decision(now: Timestamp, wake_at: Option<Timestamp>) -> Timestamp {
    wake_at
        .unwrap_or(now.plus_secs(DECISION_INTERVAL_SECS))
        .max(now.plus_secs(MIN_WAKE_SECS))
}

/// After the policy's answer to a refused launch is refused too, the driver consults it again
/// this soon (market seconds) rather than at its own wake-up time, so that a job whose markets
/// keep refusing is not left without capacity until then.
pub const RETRY_AFTER_REFUSAL_SECS: f64 = 60.0;

/// [`next_decision`] after a decision whose launches were refused again.
pub fn after_refusal(now: Timestamp, next: Timestamp) -> Timestamp {
    next.min(now.plus_secs(RETRY_AFTER_REFUSAL_SECS))
}
