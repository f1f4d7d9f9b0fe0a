//! The Proteus agent as a library; `src/main.rs` is a thin CLI over it.
//!
//! - [`agent`]: the control loop (registration, views, interruption handling);
//! - [`session`]: what every job's loop shares: options, outcome, heartbeats, command poll;
//! - [`control`]: client of the broker's agent API; [`imds`]: instance metadata (IMDSv2);
//! - [`transport`]: the peer-to-peer data plane; [`ps`]: ActivePS/BackupPS shards;
//! - [`worker`] and [`sync`]: the worker loop under a synchronisation model; [`reassign`]:
//!   FlexRR's RapidReassignment; [`straggler`]: injected slowness and pacing;
//! - [`audit`]: the hook tests use to see every clock, item and push as it happens;
//! - [`apps`] and [`data`]: MLR, MF and the MLP on ndarray, data loaders;
//! - [`pipeline`]: PipeDream's pipeline-parallel mode (profiler, partitioner, 1F1B, stages);
//! - [`command`]: command jobs — the user's own program under the contract of
//!   `docs/command-jobs.md` (notice file and signals, progress file, durable checkpoints);
//! - `testing` (feature `testing`): a coordinator HTTP server and an IMDS mock.

pub mod agent;
pub mod apps;
pub mod audit;
pub mod cli;
pub mod command;
pub mod control;
pub mod data;
pub mod error;
pub mod imds;
pub mod pipeline;
pub mod ps;
pub mod reassign;
pub mod session;
pub mod straggler;
pub mod sync;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;
pub mod worker;

pub use error::{AgentError, Result};
