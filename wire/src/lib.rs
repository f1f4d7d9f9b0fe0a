//! Types that both `proteus` (the broker) and `proteus-agent` put on the wire.
//!
//! Keeping them in one crate means the two binaries cannot drift apart: a field renamed here is a
//! compile error on both sides, not a silent `null` at run time.

pub mod ids;

pub use ids::{InstanceId, JobId, Tier};
