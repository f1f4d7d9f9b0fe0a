//! The Proteus broker as a library; `src/main.rs` is a thin CLI over it.
//!
//! Modules, roughly in the order data flows through them:
//! - [`market`]: the vocabulary (markets, prices, time), validated at the edge;
//! - [`prices`]: reading traces and EC2 price history, in-memory series, statistics;
//! - [`store`]: Postgres or SQLite behind one API;
//! - [`cli`]: the `proteus` commands.

pub mod cli;
pub mod clock;
pub mod cloud;
pub mod data;
pub mod launcher;
pub mod market;
pub mod output;
pub mod prices;
pub mod store;
