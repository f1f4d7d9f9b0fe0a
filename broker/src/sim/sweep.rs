//! Many runs: several policies over the same start times, and what they add up to.

use super::{RunOptions, RunResult, Scenario, SimError, run};
use crate::engine::view::FutureReads;
use crate::market::{Timestamp, Usd};
use crate::policy::{Policy, PolicyKind, PolicyLoadError, PolicySpec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A policy file, loaded once and instantiated afresh for every run (policies keep state).
#[derive(Debug, Clone)]
pub struct PolicyEntry {
    pub name: String,
    pub kind: PolicyKind,
    pub file: String,
    spec: PolicySpec,
}

impl PolicyEntry {
    pub fn load(path: &Path) -> Result<Self, PolicyLoadError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|cause| PolicyLoadError::Io {
            file: file.clone(),
            cause,
        })?;
        Self::parse(&file, &text)
    }

    pub fn parse(file: &str, text: &str) -> Result<Self, PolicyLoadError> {
        let spec: PolicySpec = toml::from_str(text).map_err(|e| PolicyLoadError::Syntax {
            file: file.to_string(),
            problem: e.to_string().trim_end().to_string(),
        })?;
        // Build once now so that every error surfaces before any run.
        let built = crate::policy::parse_policy(file, text)?;
        Ok(PolicyEntry {
            name: built.name().to_string(),
            kind: spec.kind(),
            file: file.to_string(),
            spec,
        })
    }

    /// The availability model the policy plans today's market with (BidBrain's), if any.
    pub fn availability_model(
        &self,
    ) -> Option<&crate::market_model::availability::AvailabilityModel> {
        match &self.spec {
            PolicySpec::BidBrain(c) => Some(&c.today.availability),
            _ => None,
        }
    }

    /// A fresh instance of the policy.
    pub fn build(&self) -> Result<Box<dyn Policy>, PolicyLoadError> {
        let stem = Path::new(&self.file)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.name.clone());
        self.spec.clone().build(&self.file, &stem)
    }
}

/// `n` start times spread over `[first, last]`: one uniformly random time in each of `n` equal
/// strata, so that every part of the trace is represented and the seed makes it repeatable.
pub fn start_times(first: Timestamp, last: Timestamp, n: usize, seed: u64) -> Vec<Timestamp> {
    if n == 0 || last <= first {
        return Vec::new();
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let width = (last.millis() - first.millis()) as f64 / n as f64;
    (0..n)
        .map(|k| {
            Timestamp::from_millis(
                first.millis() + (width * (k as f64 + rng.random::<f64>())) as i64,
            )
        })
        .collect()
}

/// The seed of the run at start index `k` (the same for every policy at that start, so they
/// meet the same world).
pub fn run_seed(seed: u64, k: usize) -> u64 {
    let mut z = seed ^ (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// How a sweep runs.
#[derive(Debug, Clone, Default)]
pub struct SweepOptions {
    /// Base seed; run `k` gets [`run_seed`]`(seed, k)`.
    pub seed: u64,
    /// Worker threads (at least 1).
    pub threads: usize,
    pub future_reads: FutureReads,
    pub record_decisions: bool,
    /// Every run's budget ([`RunOptions::budget`]).
    pub budget: Option<crate::market::Usd>,
    /// Every run's deadline ([`RunOptions::deadline`]).
    pub deadline: Option<super::Deadline>,
}

impl SweepOptions {
    /// The options of run `k` of the sweep (its seed is [`run_seed`]`(seed, k)`).
    pub fn run_options(&self, k: usize) -> RunOptions {
        RunOptions {
            seed: run_seed(self.seed, k),
            future_reads: self.future_reads,
            record_decisions: self.record_decisions,
            budget: self.budget,
            deadline: self.deadline,
        }
    }
}

/// Calls `work` on every item on `threads` threads (at least 1), taking the next item as each
/// finishes; the answers come back in the items' order, whatever the threads did.
pub fn in_parallel<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    work: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let slots: Mutex<Vec<Option<R>>> = Mutex::new((0..items.len()).map(|_| None).collect());
    let worker = || {
        loop {
            let j = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(j) else { break };
            let answer = work(item);
            if let Ok(mut s) = slots.lock() {
                s[j] = Some(answer);
            }
        }
    };
    let threads = threads.clamp(1, items.len().max(1));
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(worker);
        }
        worker();
    });
    slots
        .into_inner()
        .unwrap_or_else(|poison| poison.into_inner())
        .into_iter()
        .flatten()
        .collect()
}

/// Runs every policy from every start time. `results[p][k]` is policy `p` from start `k`;
/// results do not depend on the number of threads. `on_done` is called after each run.
pub fn run_sweep(
    scenario: &Scenario,
    policies: &[PolicyEntry],
    starts: &[Timestamp],
    sweep: &SweepOptions,
    on_done: &(dyn Fn() + Sync),
) -> Result<Vec<Vec<RunResult>>, SimError> {
    let jobs: Vec<(usize, usize)> = (0..starts.len())
        .flat_map(|k| (0..policies.len()).map(move |p| (p, k)))
        .collect();
    let outcomes = in_parallel(&jobs, sweep.threads, |&(p, k)| {
        let outcome = match policies[p].build() {
            Ok(mut policy) => run(scenario, policy.as_mut(), starts[k], &sweep.run_options(k)),
            Err(e) => Err(SimError::PolicyFile(e.to_string())),
        };
        on_done();
        outcome
    });
    if outcomes.len() != jobs.len() {
        return Err(SimError::Runaway(0));
    }
    let mut results: Vec<Vec<RunResult>> = policies
        .iter()
        .map(|_| Vec::with_capacity(starts.len()))
        .collect();
    for (outcome, &(p, _)) in outcomes.into_iter().zip(&jobs) {
        results[p].push(outcome?);
    }
    Ok(results)
}

/// Percentile (0–100) with linear interpolation between order statistics.
pub fn percentile(values: &[f64], pct: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v: Vec<f64> = values.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = (pct / 100.0).clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// One policy over all start times.
#[derive(Debug, Clone, Serialize)]
pub struct PolicySummary {
    pub policy: String,
    pub kind: PolicyKind,
    pub runs: usize,
    /// Runs whose work was done; the others ended at their budget or deadline (only with
    /// `--budget` or `--deadline`, or a job spec that sets them).
    pub completed_runs: usize,
    pub ended_by_budget: usize,
    pub ended_by_deadline: usize,
    pub median_cost_usd: Usd,
    pub p10_cost_usd: Usd,
    pub p90_cost_usd: Usd,
    pub median_runtime_hours: f64,
    pub p10_runtime_hours: f64,
    pub p90_runtime_hours: f64,
    pub median_evictions: f64,
    pub median_instance_hours_reliable: f64,
    pub median_instance_hours_transient: f64,
    pub median_free_instance_hours: f64,
    /// Median over starts of this policy's cost / the on-demand policy's cost at that start.
    pub cost_ratio_vs_on_demand: Option<f64>,
    /// Median over starts of this policy's cost / standard bidding's cost at that start.
    pub cost_ratio_vs_standard: Option<f64>,
    /// Median over starts of this policy's runtime / standard bidding's runtime.
    pub runtime_ratio_vs_standard: Option<f64>,
    /// This policy's median cost / the on-demand policy's median cost (the ratio of medians,
    /// beside the median of per-start ratios above).
    pub median_cost_ratio_vs_on_demand: Option<f64>,
    /// This policy's median cost / standard bidding's median cost.
    pub median_cost_ratio_vs_standard: Option<f64>,
    /// Capacity held: units of work per hour of capacity (Σ rate × instance-hours ÷ runtime),
    /// median over starts. Policies compared at equal speed hold equal capacity; see
    /// `max_capacity` in the job's work model.
    pub median_capacity_units_per_hour: f64,
    /// With one start: that run's [`crate::engine::digest`], which `proteus demo` prints for
    /// the same job, start and policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decisions_digest: Option<String>,
    /// Where the money goes (medians). Cost per unit of work = price per paid unit-hour ×
    /// paid share of the capacity used ÷ useful fraction. The price paid per unit-hour of
    /// capacity (cheaper markets, cheaper hours)…
    pub median_usd_per_paid_unit_hour: f64,
    /// …the share of the capacity used that was paid for (the rest came in free hours)…
    pub median_paid_share: f64,
    /// …and the share of the capacity (paid and free) that became useful work (start-up,
    /// stalls, lost work and warned time are the rest).
    pub median_useful_fraction: f64,
    pub median_lost_work: f64,
}

/// Summarises `results[p][k]`; ratios are against the first policy of each baseline kind.
pub fn summarize(results: &[Vec<RunResult>]) -> Vec<PolicySummary> {
    let baseline = |kind: PolicyKind| {
        results
            .iter()
            .find(|r| r.first().is_some_and(|x| x.kind == kind))
    };
    let od = baseline(PolicyKind::OnDemand);
    let sb = baseline(PolicyKind::StandardBidding);
    results
        .iter()
        .filter(|runs| !runs.is_empty())
        .map(|runs| {
            let col = |f: &dyn Fn(&RunResult) -> f64| runs.iter().map(f).collect::<Vec<f64>>();
            let costs = col(&|r| r.cost_usd.get());
            let times = col(&|r| r.runtime_hours);
            let ratio_of_medians = |base: Option<&Vec<RunResult>>| {
                base.map(|b| {
                    let base: Vec<f64> = b.iter().map(|r| r.cost_usd.get()).collect();
                    percentile(&costs, 50.0) / percentile(&base, 50.0)
                })
            };
            let ratio = |base: Option<&Vec<RunResult>>, f: &dyn Fn(&RunResult) -> f64| {
                base.map(|b| {
                    let v: Vec<f64> = runs.iter().zip(b).map(|(r, b)| f(r) / f(b)).collect();
                    percentile(&v, 50.0)
                })
            };
            PolicySummary {
                policy: runs[0].policy.clone(),
                decisions_digest: (runs.len() == 1).then(|| runs[0].decisions_digest.clone()),
                kind: runs[0].kind,
                runs: runs.len(),
                completed_runs: runs.iter().filter(|r| r.outcome.succeeded()).count(),
                ended_by_budget: runs
                    .iter()
                    .filter(|r| r.outcome == crate::engine::job_engine::Outcome::Budget)
                    .count(),
                ended_by_deadline: runs
                    .iter()
                    .filter(|r| r.outcome == crate::engine::job_engine::Outcome::Deadline)
                    .count(),
                // A percentile of amounts is one of them or between two: an amount.
                median_cost_usd: Usd::computed(percentile(&costs, 50.0)),
                p10_cost_usd: Usd::computed(percentile(&costs, 10.0)),
                p90_cost_usd: Usd::computed(percentile(&costs, 90.0)),
                median_runtime_hours: percentile(&times, 50.0),
                p10_runtime_hours: percentile(&times, 10.0),
                p90_runtime_hours: percentile(&times, 90.0),
                median_evictions: percentile(&col(&|r| f64::from(r.evictions)), 50.0),
                median_instance_hours_reliable: percentile(
                    &col(&|r| r.instance_hours_reliable),
                    50.0,
                ),
                median_instance_hours_transient: percentile(
                    &col(&|r| r.instance_hours_transient),
                    50.0,
                ),
                median_free_instance_hours: percentile(&col(&|r| r.free_instance_hours), 50.0),
                cost_ratio_vs_on_demand: ratio(od, &|r| r.cost_usd.get()),
                cost_ratio_vs_standard: ratio(sb, &|r| r.cost_usd.get()),
                runtime_ratio_vs_standard: ratio(sb, &|r| r.runtime_hours),
                median_cost_ratio_vs_on_demand: ratio_of_medians(od),
                median_cost_ratio_vs_standard: ratio_of_medians(sb),
                median_capacity_units_per_hour: percentile(
                    &col(&|r| r.capacity_units / r.runtime_hours.max(1e-9)),
                    50.0,
                ),
                median_usd_per_paid_unit_hour: percentile(
                    &col(&|r| (r.cost_usd / r.paid_capacity_units.max(1e-9)).get()),
                    50.0,
                ),
                median_paid_share: percentile(
                    &col(&|r| {
                        r.paid_capacity_units
                            / (r.paid_capacity_units + r.free_capacity_units).max(1e-9)
                    }),
                    50.0,
                ),
                median_useful_fraction: percentile(
                    &col(&|r| {
                        r.done_work / (r.paid_capacity_units + r.free_capacity_units).max(1e-9)
                    }),
                    50.0,
                ),
                median_lost_work: percentile(&col(&|r| r.lost_work), 50.0),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 10.0), 1.4);
        assert_eq!(percentile(&v, 100.0), 5.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn start_times_are_stratified_and_repeatable() {
        let s = start_times(
            Timestamp::from_millis(0),
            Timestamp::from_millis(1000),
            10,
            7,
        );
        assert_eq!(
            s,
            start_times(
                Timestamp::from_millis(0),
                Timestamp::from_millis(1000),
                10,
                7
            )
        );
        assert_ne!(
            s,
            start_times(
                Timestamp::from_millis(0),
                Timestamp::from_millis(1000),
                10,
                8
            )
        );
        for (k, t) in s.iter().enumerate() {
            assert!(
                t.millis() >= k as i64 * 100 && t.millis() < (k as i64 + 1) * 100,
                "{k}: {t:?}"
            );
        }
    }
}
