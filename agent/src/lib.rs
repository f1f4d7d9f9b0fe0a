//! The Proteus agent as a library; `src/main.rs` is a thin CLI over it.

pub mod apps;
pub mod data;
pub mod error;

pub use error::{AgentError, Result};
