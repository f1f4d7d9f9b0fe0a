//! Counters and the decision-latency histogram behind `GET /metrics`, kept with
//! `prometheus-client` and exposed in the OpenMetrics text format. Gauges that the store already
//! knows (jobs by state, instances by tier and market, spend) are read from it at scrape time
//! into a registry of their own instead of being kept twice ([`super::metrics_text`]).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// Upper bounds of the decision-latency buckets, seconds.
const BUCKETS: [f64; 10] = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2.0];

/// What the broker counts as it runs. Each metric is registered once, in [`Metrics::default`];
/// the counters' exported names get the `_total` suffix (`proteus_launches_total`, …).
#[derive(Debug)]
pub struct Metrics {
    pub launches: Counter,
    pub launch_failures: Counter,
    pub evictions: Counter,
    pub warnings: Counter,
    pub terminations: Counter,
    pub ticks: Counter,
    pub lease_lapses: Counter,
    pub bootstrap_refused: Counter,
    decisions: Histogram,
    registry: Registry,
}

impl Default for Metrics {
    fn default() -> Self {
        let m = Metrics {
            launches: Counter::default(),
            launch_failures: Counter::default(),
            evictions: Counter::default(),
            warnings: Counter::default(),
            terminations: Counter::default(),
            ticks: Counter::default(),
            lease_lapses: Counter::default(),
            bootstrap_refused: Counter::default(),
            decisions: Histogram::new(BUCKETS),
            registry: Registry::default(),
        };
        let mut registry = Registry::default();
        for (name, help, counter) in [
            ("proteus_launches", "Instances launched", &m.launches),
            (
                "proteus_launch_failures",
                "Launches the cloud refused",
                &m.launch_failures,
            ),
            (
                "proteus_evictions",
                "Instances the provider took away",
                &m.evictions,
            ),
            (
                "proteus_interruption_warnings",
                "Interruption warnings received",
                &m.warnings,
            ),
            (
                "proteus_terminations",
                "Instances the broker terminated",
                &m.terminations,
            ),
            (
                "proteus_scheduler_ticks",
                "Passes of the control loop",
                &m.ticks,
            ),
            (
                "proteus_lease_lapses",
                "Job ticks skipped: the broker's lease on the job went unrenewed past its local \
                 deadline (the database is slow or the broker was paused)",
                &m.lease_lapses,
            ),
            (
                "proteus_bootstrap_refused",
                "Bootstrap tokens presented a second time or for another instance, and refused \
                 (someone read an instance's user data)",
                &m.bootstrap_refused,
            ),
        ] {
            // Metrics share their state with their clones: the registry's copy is the field.
            registry.register(name, help, counter.clone());
        }
        registry.register(
            "proteus_decision_seconds",
            "Time to make one scheduling decision for one job",
            m.decisions.clone(),
        );
        Metrics { registry, ..m }
    }
}

impl Metrics {
    pub fn inc(counter: &Counter) {
        counter.inc();
    }

    pub fn record_decision(&self, took: Duration) {
        self.decisions.observe(took.as_secs_f64());
    }

    /// Appends the counters and the histogram (OpenMetrics text, without the closing `# EOF`).
    pub fn render(&self, out: &mut String) {
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode_registry(out, &self.registry);
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InstanceLabels {
    tier: String,
    market: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabel {
    job: String,
}

/// What the store knows at scrape time, as gauges.
pub(super) struct StoreGauges {
    /// Jobs per state, every state present (zeros too).
    pub jobs: Vec<(&'static str, i64)>,
    /// Live instances per (tier, market).
    pub instances: Vec<((String, String), i64)>,
    /// Ledger total per job id.
    pub spend: Vec<(i64, crate::market::Usd)>,
}

/// The whole exposition: the store's gauges, then the broker's own metrics, then `# EOF`.
pub(super) fn exposition(gauges: &StoreGauges, metrics: &Metrics) -> String {
    let mut registry = Registry::default();
    let jobs = Family::<StateLabel, Gauge>::default();
    for (state, n) in &gauges.jobs {
        jobs.get_or_create(&StateLabel { state }).set(*n);
    }
    registry.register("proteus_jobs", "Jobs by state", jobs);
    let instances = Family::<InstanceLabels, Gauge>::default();
    for ((tier, market), n) in &gauges.instances {
        instances
            .get_or_create(&InstanceLabels {
                tier: tier.clone(),
                market: market.clone(),
            })
            .set(*n);
    }
    registry.register(
        "proteus_instances",
        "Live instances by tier and market",
        instances,
    );
    let spend = Family::<JobLabel, Gauge<f64, AtomicU64>>::default();
    for (job, usd) in &gauges.spend {
        spend
            .get_or_create(&JobLabel {
                job: job.to_string(),
            })
            .set(usd.get());
    }
    registry.register("proteus_spend_usd", "Ledger total per job", spend);

    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode_registry(&mut out, &registry);
    metrics.render(&mut out);
    let _ = prometheus_client::encoding::text::encode_eof(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_keeps_every_metric_name_and_escapes_labels() {
        let m = Metrics::default();
        Metrics::inc(&m.launches);
        Metrics::inc(&m.launches);
        m.record_decision(Duration::from_millis(3));
        let text = exposition(
            &StoreGauges {
                jobs: vec![("running", 1), ("failed", 0)],
                instances: vec![(("transient".into(), "us-east-1a/\"odd\"".into()), 2)],
                spend: vec![(7, crate::market::Usd::new(0.25).unwrap())],
            },
            &m,
        );
        for line in [
            "proteus_jobs{state=\"running\"} 1",
            "proteus_jobs{state=\"failed\"} 0",
            "proteus_instances{tier=\"transient\",market=\"us-east-1a/\\\"odd\\\"\"} 2",
            "proteus_spend_usd{job=\"7\"} 0.25",
            "proteus_launches_total 2",
            "proteus_launch_failures_total 0",
            "proteus_evictions_total 0",
            "proteus_interruption_warnings_total 0",
            "proteus_terminations_total 0",
            "proteus_decision_seconds_bucket{le=\"0.002\"} 0",
            "proteus_decision_seconds_bucket{le=\"0.005\"} 1",
            "proteus_decision_seconds_bucket{le=\"+Inf\"} 1",
            "proteus_decision_seconds_count 1",
            "# TYPE proteus_decision_seconds histogram",
            "# HELP proteus_jobs Jobs by state.",
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
        assert_eq!(text.matches("# EOF").count(), 1);
    }
}
