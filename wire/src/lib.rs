//! Types that both `proteus` (the broker) and `proteus-agent` put on the wire.
//!
//! Keeping them in one crate means the two binaries cannot drift apart: a field renamed here is a
//! compile error on both sides, not a silent `null` at run time.
//!
//! - [`agent_api`]: the agent control protocol (registration, heartbeats, commands, events).
//! - [`coordinator`]: the per-job control-plane state machine both the broker and the agent's
//!   tests run.
//! - [`time`]: the one parser (and writer) of times as text.

pub mod agent_api;
pub mod coordinator;
pub mod ids;
pub mod time;

pub use ids::{InstanceId, JobId, Tier};
