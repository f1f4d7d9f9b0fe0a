//! Latency samples and the figures the benchmark scripts print.

use std::time::Duration;

/// Latencies of one run, in microseconds, plus what went wrong.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    pub micros: Vec<u64>,
    /// Answers with an unexpected status, and transport failures.
    pub errors: u64,
    /// The first few error descriptions, for the log.
    pub first_errors: Vec<String>,
}

impl Samples {
    pub fn record(&mut self, took: Duration) {
        self.micros.push(took.as_micros() as u64);
    }

    pub fn error(&mut self, what: String) {
        self.errors += 1;
        if self.first_errors.len() < 5 {
            self.first_errors.push(what);
        }
    }

    pub fn merge(&mut self, other: Samples) {
        self.micros.extend(other.micros);
        self.errors += other.errors;
        for e in other.first_errors {
            if self.first_errors.len() < 5 {
                self.first_errors.push(e);
            }
        }
    }

    /// Requests answered, successful or not.
    pub fn count(&self) -> u64 {
        self.micros.len() as u64
    }

    pub fn summary(&self) -> Summary {
        let mut v = self.micros.clone();
        v.sort_unstable();
        Summary {
            count: v.len() as u64,
            p50_ms: percentile(&v, 50.0),
            p99_ms: percentile(&v, 99.0),
            max_ms: v.last().map_or(0.0, |m| *m as f64 / 1000.0),
        }
    }
}

/// p50, p99 and max of one run, milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub count: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms over {} requests",
            self.p50_ms, self.p99_ms, self.max_ms, self.count
        )
    }
}

/// Nearest-rank percentile of sorted microseconds, in milliseconds.
pub fn percentile(sorted_micros: &[u64], p: f64) -> f64 {
    if sorted_micros.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted_micros.len() as f64).ceil() as usize;
    sorted_micros[rank.clamp(1, sorted_micros.len()) - 1] as f64 / 1000.0
}

/// The median of a few figures (e.g. one per round).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
