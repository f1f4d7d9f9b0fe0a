//! Several jobs run together on one world, sharing what they see of the pools.
//!
//! A broker runs a fleet, not one job: every spot launch, refusal and interruption of any of
//! its jobs goes into one [`PoolBook`], and every job's decisions read it. [`run_fleet`] plays
//! K jobs of one shape, each from its own start, in one time order (at one instant, in the
//! order they were given), with one book between them.
//!
//! Each job plays the trace as if alone: a trace records whether one more instance could be
//! had, and a fleet of a few one-instance jobs is small beside a pool, so one job's instance
//! does not take another's capacity. What the jobs share is what they learn.

use super::{Run, RunOptions, RunResult, Scenario, SimError};
use crate::market::Timestamp;
use crate::market_model::availability::AvailabilityModel;
use crate::market_model::pool_book::{PoolBook, PoolSummary};
use crate::policy::Policy;
use std::cell::RefCell;

/// The fleet's runs, in the order of their starts, and what its book learned of each pool.
#[derive(Debug)]
pub struct FleetResult {
    pub runs: Vec<RunResult>,
    pub pools: Vec<PoolSummary>,
}

/// The start of every job of a fleet whose first job starts at `start`: `jobs` starts, `gap`
/// seconds apart.
pub fn staggered(start: Timestamp, jobs: usize, gap_secs: f64) -> Vec<Timestamp> {
    (0..jobs)
        .map(|i| start.plus_secs(i as f64 * gap_secs))
        .collect()
}

/// Runs one job per `(policy, start)` together, sharing a [`PoolBook`] over `prior` (`learn`:
/// each pool's model is learned from what the fleet sees).
pub fn run_fleet<'a>(
    scenario: &'a Scenario,
    jobs: Vec<(Box<dyn Policy + 'a>, Timestamp)>,
    options: &'a [RunOptions],
    prior: AvailabilityModel,
    learn: bool,
) -> Result<FleetResult, SimError> {
    let (first, last) = scenario.span();
    for (_, start) in &jobs {
        if *start < first || *start >= last {
            return Err(SimError::StartOutsideTrace {
                start: *start,
                first,
                last,
            });
        }
    }
    if options.len() != jobs.len() {
        return Err(SimError::Engine(format!(
            "{} jobs but {} run options",
            jobs.len(),
            options.len()
        )));
    }
    let book = RefCell::new(PoolBook::new(prior, learn));
    let mut runs: Vec<Run<'_>> = jobs
        .into_iter()
        .zip(options)
        .map(|((policy, start), o)| Run::new(scenario, policy, start, o, Some(&book)))
        .collect();
    // Per job: not begun (its start), going (its next instant), or ended.
    let mut next: Vec<Option<Timestamp>> = runs.iter().map(|r| Some(r.start)).collect();
    let mut begun = vec![false; runs.len()];
    while let Some((i, t)) = next
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.map(|t| (i, t)))
        .min_by_key(|&(i, t)| (t, i))
    {
        let run = &mut runs[i];
        if begun[i] {
            run.advance(t)?;
        } else {
            begun[i] = true;
            run.begin()?;
        }
        next[i] = run.next_at()?;
    }
    let end = runs
        .iter()
        .filter_map(|r| r.engine.end().map(|e| e.at))
        .max();
    let runs = runs
        .into_iter()
        .map(Run::finish)
        .collect::<Result<Vec<_>, _>>()?;
    let pools = book
        .borrow()
        .summary(end.unwrap_or_else(|| scenario.span().1));
    Ok(FleetResult { runs, pools })
}

/// What [`run_fleet_sweep`] returns, per policy.
#[derive(Debug)]
pub struct FleetSweep {
    /// Every job's run, in the order of the fleets and their starts.
    pub runs: Vec<Vec<RunResult>>,
    /// What the first fleet's book saw of each pool.
    pub pools: Vec<Vec<PoolSummary>>,
}

/// Every policy over the same fleets: each fleet (a list of job starts) is run once per
/// policy, all its jobs that policy's.
pub fn run_fleet_sweep(
    scenario: &Scenario,
    policies: &[super::sweep::PolicyEntry],
    fleets: &[Vec<Timestamp>],
    sweep: &super::sweep::SweepOptions,
    prior: &AvailabilityModel,
    learn: bool,
) -> Result<FleetSweep, SimError> {
    let work: Vec<(usize, usize)> = (0..fleets.len())
        .flat_map(|f| (0..policies.len()).map(move |p| (p, f)))
        .collect();
    let outcomes = super::sweep::in_parallel(&work, sweep.threads, |&(p, f)| {
        let fleet = &fleets[f];
        let before: usize = fleets[..f].iter().map(Vec::len).sum();
        let options: Vec<RunOptions> = (0..fleet.len())
            .map(|i| sweep.run_options(before + i))
            .collect();
        fleet
            .iter()
            .map(|&start| {
                policies[p]
                    .build()
                    .map(|policy| (policy, start))
                    .map_err(|e| SimError::PolicyFile(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()
            .and_then(|jobs| run_fleet(scenario, jobs, &options, prior.clone(), learn))
    });
    if outcomes.len() != work.len() {
        return Err(SimError::Runaway(0));
    }
    let mut runs: Vec<Vec<RunResult>> = policies.iter().map(|_| Vec::new()).collect();
    let mut pools: Vec<Vec<PoolSummary>> = policies.iter().map(|_| Vec::new()).collect();
    for (outcome, &(p, f)) in outcomes.into_iter().zip(&work) {
        let r = outcome?;
        runs[p].extend(r.runs);
        if f == 0 {
            pools[p] = r.pools;
        }
    }
    Ok(FleetSweep { runs, pools })
}
