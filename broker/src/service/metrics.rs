//! Counters and the decision-latency histogram behind `GET /metrics` (Prometheus text format).
//! Gauges that the store already knows (jobs by state, instances by tier and market, spend) are
//! read from it at scrape time instead of being kept twice.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the decision-latency buckets, seconds.
const BUCKETS: [f64; 10] = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0];

#[derive(Debug, Default)]
pub struct Metrics {
    pub launches: AtomicU64,
    pub launch_failures: AtomicU64,
    pub evictions: AtomicU64,
    pub warnings: AtomicU64,
    pub terminations: AtomicU64,
    decisions: Mutex<Histogram>,
}

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Metrics {
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_decision(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let mut h = self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        for (i, bound) in BUCKETS.iter().enumerate() {
            if secs <= *bound {
                h.counts[i] += 1;
            }
        }
        h.count += 1;
        h.sum += secs;
    }

    /// The counters and the histogram in Prometheus text format.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let counters = [
            (
                "proteus_launches_total",
                "Instances launched.",
                &self.launches,
            ),
            (
                "proteus_launch_failures_total",
                "Launches the cloud refused.",
                &self.launch_failures,
            ),
            (
                "proteus_evictions_total",
                "Instances the provider took away.",
                &self.evictions,
            ),
            (
                "proteus_interruption_warnings_total",
                "Interruption warnings received.",
                &self.warnings,
            ),
            (
                "proteus_terminations_total",
                "Instances the broker terminated.",
                &self.terminations,
            ),
        ];
        for (name, help, c) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let h = self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        let name = "proteus_decision_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Time to make one scheduling decision for one job.\n# TYPE {name} histogram"
        );
        for (i, bound) in BUCKETS.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {}", h.counts[i]);
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            h.count, h.sum, h.count
        );
    }
}

/// Escapes a Prometheus label value.
pub fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
