//! What the simulator and the live scheduler share around the policy: the rules of the world
//! (how long a notice lasts) and the work accounting (what a footprint's instances deliver).
//!
//! Both drivers credit work through [`work`], so the figure the simulator measures and the one
//! the broker reports for a live job come from one definition.

pub mod work;

/// Seconds between a provider's interruption notice and the termination (EC2's two minutes).
pub const NOTICE_SECS: f64 = 120.0;
