//! The Proteus broker as a library; `src/main.rs` is a thin CLI over it.
//!
//! Modules, roughly in the order data flows through them:
//! - [`market`]: the vocabulary (markets, prices, time), validated at the edge;
//! - [`prices`]: reading traces and EC2 price history, in-memory series, statistics;
//! - [`store`]: Postgres or SQLite behind one API;
//! - [`billing`], [`market_model`], [`job`], [`policy`]: what instances cost, how likely they are
//!   to be taken away, what a job needs, and what to buy (shared by the simulator and the live
//!   scheduler);
//! - [`sim`]: the trace-driven simulator and policy comparison;
//! - [`clock`], [`cloud`], [`launcher`]: market time, cloud drivers (EC2, simulated) and the
//!   local launcher that runs real agents where instances do not really boot;
//! - [`cli`]: the `proteus` commands.

pub mod api;
pub mod billing;
pub mod broker_lock;
pub mod chart;
pub mod checkpoint;
pub mod cli;
pub mod clock;
pub mod cloud;
pub mod data;
pub mod engine;
pub mod failpoint;
pub mod job;
pub mod launcher;
pub mod market;
pub mod market_model;
pub mod output;
pub mod policy;
pub mod prices;
pub mod service;
pub mod sim;
pub mod startup;
pub mod store;
