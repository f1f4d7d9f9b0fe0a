//! The Proteus agent as a library; `src/main.rs` is a thin CLI over it.
