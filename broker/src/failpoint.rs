//! Crash points for the crash-safety tests (of the broker and of `prices ingest`). With
//! `PROTEUS_FAILPOINTS=NAME[,NAME…]` in its environment, the process dies on the spot — no
//! destructors, no flushing, like `kill -9` — the first time it reaches a named point. The
//! tests then restart it and check that nothing was launched twice and nothing leaked.
//! `NAME=stop` instead stops the process there (SIGSTOP to itself, as a frozen VM or a long
//! pause would), for a test to wake with SIGCONT once other brokers have moved on.
//! Unset, a point costs one branch on a cached value.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// A stop point stops the process once (the first point reached).
static STOPPED: AtomicBool = AtomicBool::new(false);

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

/// Dies (or stops) here if `name` is armed.
pub fn hit(name: &str) {
    for a in armed() {
        if a == name {
            eprintln!("failpoint `{name}` reached: exiting at once");
            // SAFETY: _exit ends the process immediately; that is the point.
            unsafe { libc::_exit(137) };
        }
        if a.strip_suffix("=stop") == Some(name) && !STOPPED.swap(true, Ordering::SeqCst) {
            eprintln!("failpoint `{name}` reached: stopping until SIGCONT");
            // SAFETY: raising a signal on this process; SIGSTOP cannot be caught.
            unsafe { libc::raise(libc::SIGSTOP) };
            eprintln!("failpoint `{name}`: continued");
        }
    }
}
