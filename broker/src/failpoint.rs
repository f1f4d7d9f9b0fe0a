//! Crash points for the crash-safety tests (of the broker and of `prices ingest`). With
//! `PROTEUS_FAILPOINTS=NAME[,NAME…]` in its environment, the process dies on the spot — no
//! destructors, no flushing, like `kill -9` — the first time it reaches a named point. The
//! tests then restart it and check that nothing was launched twice and nothing leaked.
//! Unset, a point costs one branch on a cached value.

use std::sync::OnceLock;

/// The points the broker defines, in the order a job's life reaches them.
pub const POINTS: [&str; 6] = [
    "ingest-mid-write",
    "launch-after-intent",
    "launch-after-cloud",
    "terminate-after-intent",
    "evicted-before-record",
    "cancel-after-record",
];

fn armed() -> &'static [String] {
    static ARMED: OnceLock<Vec<String>> = OnceLock::new();
    ARMED.get_or_init(|| {
        std::env::var("PROTEUS_FAILPOINTS")
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Dies here if `name` is armed.
pub fn hit(name: &str) {
    if armed().iter().any(|a| a == name) {
        eprintln!("failpoint `{name}` reached: exiting at once");
        // SAFETY: _exit ends the process immediately; that is the point.
        unsafe { libc::_exit(137) };
    }
}
