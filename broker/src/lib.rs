//! The Proteus broker as a library; `src/main.rs` is a thin CLI over it.
