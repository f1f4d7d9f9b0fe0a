//! `proteus simulate --availability FILE…`: a job with a deadline on today's market, from
//! real availability traces (see [`crate::sim::availability`]), under per-second billing.
//!
//! The job is given by flags, as in Can't Be Late's evaluation: `--instances N` of
//! `--instance-type`, `--work-hours W` of compute at full width (the job's total is W × N
//! instance-hours), `--deadline-hours D` after each start, and `--restart-overhead-hours O`
//! between a launch and useful work (every (re)start pays it; nothing else is lost on an
//! interruption beyond a few seconds since the last sync, as the 2-minute notice lets the job
//! save). Every run of every policy meets the same trace from the same start times; on-demand
//! is always run too, as the baseline of `cost_vs_on_demand`.

use super::simulate::SimulateArgs;
use crate::billing::BillingModel;
use crate::engine::job_engine::Outcome;
use crate::engine::view::FutureReads;
use crate::job::WorkModelSpec;
use crate::market::{InstanceType, Timestamp, UsdPerHour};
use crate::market_model::{HazardModel, HazardPrior};
use crate::output::{Cell, Table, emit};
use crate::policy::{PolicyKind, resolve_policy_path};
use crate::sim::availability::{Availability, AvailabilityTrace, origin_of};
use crate::sim::optimal::{OptimalCase, Optimum, Solution, elastic_bound, solve};
use crate::sim::sweep::{PolicyEntry, SweepOptions, run_sweep, start_times};
use crate::sim::{Deadline, RunResult, Scenario, World};
use anyhow::{Context, Result, bail};
use serde::Serialize;
use std::process::ExitCode;
use std::sync::Arc;

/// One policy's figures over the start times.
#[derive(Debug, Clone, Serialize)]
pub struct TodaySummary {
    pub policy: String,
    /// The policy's kind, or `hindsight-optimal` for `--optimal`.
    pub kind: String,
    pub runs: usize,
    /// Runs that finished their work by the deadline.
    pub deadline_met_rate: f64,
    /// Mean over start times of cost ÷ on-demand's cost from the same start.
    pub cost_vs_on_demand: f64,
    pub median_cost_usd: f64,
    pub mean_cost_usd: f64,
    /// Mean spot interruptions per run.
    pub mean_interruptions: f64,
    /// Mean refused launches per run.
    pub mean_refused_launches: f64,
    /// Mean share of the instance-hours on spot.
    pub spot_share: f64,
    /// Every run, in the order of the report's `starts`.
    pub runs_by_start: Vec<TodayRun>,
}

/// One run's figures.
#[derive(Debug, Clone, Serialize)]
pub struct TodayRun {
    pub cost_usd: f64,
    /// Instance-hours of work done (the job's total when it met its deadline).
    pub done_work: f64,
    pub deadline_met: bool,
}

/// With `--fleet K`: how the fleets were run, and what the first fleet's book learned of each
/// pool, per BidBrain policy.
#[derive(Debug, Clone, Serialize)]
pub struct FleetReport {
    pub jobs: usize,
    /// Between one job's start and the next's.
    pub gap_hours: f64,
    pub pool_learning: bool,
    pub first_fleet_pools:
        std::collections::BTreeMap<String, Vec<crate::market_model::pool_book::PoolSummary>>,
}

/// What `--output json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct TodayReport {
    pub availability: Vec<String>,
    pub reading: crate::sim::availability::Reading,
    pub instance_type: String,
    pub instances: u32,
    pub work_hours: f64,
    pub deadline_hours: f64,
    pub restart_overhead_hours: f64,
    pub spot_usd_per_hour: f64,
    pub on_demand_usd_per_hour: f64,
    pub starts: Vec<Timestamp>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetReport>,
    pub policies: Vec<TodaySummary>,
    /// The asked policy's figures (`--policy`), also at the top level for scripts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_met_rate: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_vs_on_demand: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub median_cost_usd: Option<f64>,
}

/// Runs the sweep the flags describe and returns it (the bench calls this too).
pub fn sweep(args: &SimulateArgs) -> Result<TodayReport> {
    let work_hours = args
        .work_hours
        .context("--availability needs --work-hours (the job's compute at full width, hours)")?;
    let deadline_hours = args
        .deadline_hours
        .context("--availability needs --deadline-hours (after each start)")?;
    let overhead_hours = args.restart_overhead_hours;
    let n = args.instances;
    for (flag, v, ok) in [
        ("--work-hours", work_hours, work_hours > 0.0),
        ("--deadline-hours", deadline_hours, deadline_hours > 0.0),
        (
            "--restart-overhead-hours",
            overhead_hours,
            overhead_hours >= 0.0,
        ),
    ] {
        if !(v.is_finite() && ok) {
            bail!("{flag} {v}: must be a positive number of hours (overhead: zero or more)");
        }
    }
    if n == 0 {
        bail!("--instances must be at least 1");
    }
    let instance_type = InstanceType::parse(&args.instance_type)
        .map_err(|e| anyhow::anyhow!("--instance-type {}: {e}", args.instance_type))?;
    let mut traces = Vec::new();
    for path in &args.availability {
        traces.push(AvailabilityTrace::load(path, args.availability_reading)?);
    }
    let origin = args
        .availability
        .first()
        .map(|p| origin_of(p))
        .context("no --availability file")?;
    // The zones of one run are one period: files from different collections (their folders
    // name the start date) would line up ticks of different days.
    if let Some(other) = args.availability.iter().find(|p| origin_of(p) != origin) {
        bail!(
            "--availability {}: its traces start {} but {}'s start {}: the files of one run must              cover the same period",
            other.display(),
            origin_of(other),
            args.availability[0].display(),
            origin
        );
    }
    let files: Vec<String> = args
        .availability
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let availability = Arc::new(Availability::new(traces, instance_type.clone(), origin)?);
    let spot = UsdPerHour::new(args.spot_price).context("--spot-price")?;
    let on_demand = UsdPerHour::new(args.on_demand_price).context("--on-demand-price")?;
    let history = Arc::new(availability.price_history(spot, on_demand));
    let region = availability
        .markets()
        .next()
        .map(|m| m.region())
        .context("no pool in the availability files")?;

    let spec = format!(
        "name = \"today\"\ntotal_work = {total}\nreference_type = \"{t}\"\n\
         instance_types = [\"{t}\"]\nmax_instances = {n}\nmax_reliable_instances = {n}\n\
         startup_minutes = {startup}\n\
         [eviction_cost]\nmodel = \"agileml\"\nsync_interval_minutes = 0.5\nrebalance_seconds = 1.0\n",
        total = work_hours * n as f64,
        t = instance_type,
        startup = (overhead_hours * 60.0).max(1e-6),
    );
    let job = WorkModelSpec::parse("--work-hours", &spec)?.resolve(
        "--work-hours",
        history.on_demand(),
        &region,
    )?;

    if args.optimal && (args.policy.is_some() || !args.compare.is_empty()) {
        bail!(
            "--optimal with --availability is printed as the asked policy's figures: give no \
             --policy or --compare with it"
        );
    }
    if args.gap.is_some() || args.gap_chart.is_some() {
        bail!("--gap and --gap-chart are for a price trace (--job), not --availability");
    }
    if args.fit_eviction.is_some() || args.eviction_model.is_some() {
        bail!(
            "--fit-eviction and --eviction-model are for the 2015 price trace (--job): evictions \
             there follow the price; the availability world's follow capacity"
        );
    }
    if args.calibration.is_some() {
        bail!(
            "--calibration is for a price trace (--job): the availability world has no eviction \
             estimates at launch to check"
        );
    }
    let asked: Vec<String> = match &args.policy {
        Some(p) => vec![p.clone()],
        None if args.optimal => Vec::new(),
        None if args.compare.is_empty() => vec![
            "bidbrain".into(),
            "uniform-progress".into(),
            "skypilot-default".into(),
        ],
        None => args.compare.clone(),
    };
    let mut entries = Vec::new();
    for name in &asked {
        entries.push(PolicyEntry::load(&resolve_policy_path(name)?)?);
    }
    if !entries.iter().any(|e| e.kind == PolicyKind::OnDemand) {
        entries.push(PolicyEntry::load(&resolve_policy_path("on-demand")?)?);
    }
    let od_index = entries
        .iter()
        .position(|e| e.kind == PolicyKind::OnDemand)
        .context("no on-demand baseline")?;

    let scenario = Scenario::new(
        history.clone(),
        job,
        BillingModel::PerSecond,
        World::Availability(availability.clone()),
        Box::new(HazardModel::new(HazardPrior::default())),
    )?;
    let (first, last) = availability.span();
    let fleet = match args.fleet {
        Some(0) => bail!("--fleet must be at least 1 job"),
        Some(k) if k > 64 => bail!("--fleet {k}: at most 64 jobs per fleet"),
        other => other,
    };
    // A fleet's jobs start a deadline ÷ K apart.
    let gap_hours = fleet.map_or(0.0, |k| deadline_hours / k as f64);
    let spread_hours = fleet.map_or(0.0, |k| gap_hours * (k - 1) as f64);
    // Every start leaves the deadline (and a day to spare for runs that miss it) in the traces.
    let hi = Timestamp::from_millis(
        last.millis() - ((deadline_hours + 24.0 + spread_hours) * 3_600_000.0) as i64,
    );
    if hi <= first {
        bail!(
            "the availability traces cover {:.1} days; a job with a {deadline_hours} h deadline \
             needs more than that plus a day after each start",
            last.secs_since(first) / 86_400.0
        );
    }
    if args.starts == 0 {
        bail!("--starts must be at least 1");
    }
    let fleet_starts = start_times(first, hi, args.starts, args.seed);
    let fleets: Vec<Vec<Timestamp>> = match fleet {
        Some(k) => fleet_starts
            .iter()
            .map(|&s| crate::sim::fleet::staggered(s, k, gap_hours * 3600.0))
            .collect(),
        None => fleet_starts.iter().map(|&s| vec![s]).collect(),
    };
    let starts: Vec<Timestamp> = fleets.iter().flatten().copied().collect();
    let threads = args.threads();
    let options = SweepOptions {
        seed: args.seed,
        threads,
        future_reads: FutureReads::Refuse,
        record_decisions: false,
        budget: None,
        deadline: Some(Deadline::After(deadline_hours * 3600.0)),
    };
    let (results, fleet_report) = match fleet {
        None => (
            run_sweep(&scenario, &entries, &starts, &options, &|| {})?,
            None,
        ),
        Some(k) => {
            // The book's prior: the first BidBrain's model (a policy on another model ignores
            // the book), else the default.
            let prior = entries
                .iter()
                .find_map(|e| e.availability_model().cloned())
                .unwrap_or_else(|| crate::policy::TodayConfig::default().availability);
            let learn = !args.no_pool_learning;
            let crate::sim::fleet::FleetSweep { runs, pools } = crate::sim::fleet::run_fleet_sweep(
                &scenario, &entries, &fleets, &options, &prior, learn,
            )?;
            let pools = entries
                .iter()
                .zip(pools)
                .filter(|(e, _)| e.kind == PolicyKind::BidBrain)
                .map(|(e, p)| (e.name.clone(), p))
                .collect();
            (
                runs,
                Some(FleetReport {
                    jobs: k,
                    gap_hours,
                    pool_learning: learn,
                    first_fleet_pools: pools,
                }),
            )
        }
    };
    let od_costs: Vec<f64> = results[od_index].iter().map(|r| r.cost_usd.get()).collect();
    let mut policies: Vec<TodaySummary> = entries
        .iter()
        .zip(&results)
        .map(|(e, runs)| summarize(e, runs, &od_costs))
        .collect();
    if args.optimal {
        let markets: Vec<_> = availability.markets().cloned().collect();
        let solve_at = |start: Timestamp| {
            let case = OptimalCase {
                capacity: markets
                    .iter()
                    .map(|m| availability.capacity_from(m, start))
                    .collect(),
                offset_secs: availability.offset_in_tick(start),
                gap_secs: availability.gap_secs(),
                work_secs: work_hours * 3600.0,
                deadline_secs: deadline_hours * 3600.0,
                overhead_secs: overhead_hours * 3600.0,
                spot_usd_per_hour: spot.get(),
                on_demand_usd_per_hour: on_demand.get(),
            };
            if n == 1 {
                solve(&case)
            } else {
                // Several instances: a relaxation (sim/optimal.rs), exact in nothing but a bound.
                Solution {
                    optimum: elastic_bound(&case, n),
                    quanta_per_tick: 1,
                    overhead_rounded: false,
                }
            }
        };
        // One start per thread at a time: a start is a few million states.
        let solutions: Vec<Solution> = std::thread::scope(|scope| {
            let chunk = starts.len().div_ceil(threads.max(1));
            let handles: Vec<_> = starts
                .chunks(chunk.max(1))
                .map(|part| scope.spawn(|| part.iter().map(|&s| solve_at(s)).collect::<Vec<_>>()))
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        if solutions.len() != starts.len() {
            bail!("the hindsight optimum failed on some starts");
        }
        if let Some(s) = solutions.first()
            && s.overhead_rounded
        {
            tracing::warn!(
                quanta_per_tick = s.quanta_per_tick,
                "--optimal: no quantum up to a thousandth of a tick divides the restart overhead; \
                 it is rounded down (the figure is still a lower bound, less tight)"
            );
        }
        let runs: Vec<TodayRun> = solutions
            .iter()
            .map(|s| match s.optimum {
                Optimum::Cost(c) => TodayRun {
                    cost_usd: c,
                    done_work: work_hours * n as f64,
                    deadline_met: true,
                },
                Optimum::Infeasible => TodayRun {
                    cost_usd: 0.0,
                    done_work: 0.0,
                    deadline_met: false,
                },
            })
            .collect();
        policies.insert(
            0,
            summarize_runs("hindsight-optimal", "hindsight-optimal", runs, &od_costs),
        );
    }
    let asked_summary = (args.policy.is_some() || args.optimal)
        .then(|| policies.first().cloned())
        .flatten();
    Ok(TodayReport {
        availability: files,
        reading: args.availability_reading,
        instance_type: instance_type.to_string(),
        instances: n,
        work_hours,
        deadline_hours,
        restart_overhead_hours: overhead_hours,
        spot_usd_per_hour: spot.get(),
        on_demand_usd_per_hour: on_demand.get(),
        starts,
        fleet: fleet_report,
        deadline_met_rate: asked_summary.as_ref().map(|s| s.deadline_met_rate),
        cost_vs_on_demand: asked_summary.as_ref().map(|s| s.cost_vs_on_demand),
        median_cost_usd: asked_summary.as_ref().map(|s| s.median_cost_usd),
        policies,
    })
}

/// The mean over starts of each cost divided by on-demand's from the same start (starts where
/// on-demand cost nothing are left out).
fn mean_ratio(costs: &[f64], od_costs: &[f64]) -> f64 {
    let ratios: Vec<f64> = costs
        .iter()
        .zip(od_costs)
        .filter(|(_, od)| **od > 0.0)
        .map(|(c, od)| c / od)
        .collect();
    ratios.iter().sum::<f64>() / ratios.len().max(1) as f64
}

/// Summary of runs that are not simulations (the hindsight optimum): no instance figures.
fn summarize_runs(policy: &str, kind: &str, runs: Vec<TodayRun>, od_costs: &[f64]) -> TodaySummary {
    let k = runs.len().max(1) as f64;
    let costs: Vec<f64> = runs.iter().map(|r| r.cost_usd).collect();
    TodaySummary {
        policy: policy.to_string(),
        kind: kind.to_string(),
        runs: runs.len(),
        deadline_met_rate: runs.iter().filter(|r| r.deadline_met).count() as f64 / k,
        cost_vs_on_demand: mean_ratio(&costs, od_costs),
        median_cost_usd: median(&costs),
        mean_cost_usd: costs.iter().sum::<f64>() / k,
        mean_interruptions: 0.0,
        mean_refused_launches: 0.0,
        spot_share: 0.0,
        runs_by_start: runs,
    }
}

fn summarize(entry: &PolicyEntry, runs: &[RunResult], od_costs: &[f64]) -> TodaySummary {
    let k = runs.len().max(1) as f64;
    let costs: Vec<f64> = runs.iter().map(|r| r.cost_usd.get()).collect();
    let met = runs
        .iter()
        .filter(|r| r.outcome == Outcome::Completed)
        .count() as f64;
    let hours: f64 = runs
        .iter()
        .map(|r| r.instance_hours_reliable + r.instance_hours_transient)
        .sum();
    let spot_hours: f64 = runs.iter().map(|r| r.instance_hours_transient).sum();
    TodaySummary {
        policy: entry.name.clone(),
        kind: entry.kind.as_str().to_string(),
        runs: runs.len(),
        deadline_met_rate: met / k,
        cost_vs_on_demand: mean_ratio(&costs, od_costs),
        median_cost_usd: median(&costs),
        mean_cost_usd: costs.iter().sum::<f64>() / k,
        mean_interruptions: runs.iter().map(|r| r.evictions as f64).sum::<f64>() / k,
        mean_refused_launches: runs.iter().map(|r| r.failed_launches as f64).sum::<f64>() / k,
        spot_share: if hours > 0.0 { spot_hours / hours } else { 0.0 },
        runs_by_start: runs
            .iter()
            .map(|r| TodayRun {
                cost_usd: r.cost_usd.get(),
                done_work: r.done_work,
                deadline_met: r.outcome == Outcome::Completed,
            })
            .collect(),
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// `--fit-availability`: the model fitted to the files, as a policy file's table.
fn fit(args: &SimulateArgs) -> Result<ExitCode> {
    use crate::market_model::availability::{AvailabilityModel, resample};
    let step_minutes = 10.0;
    let mut series = Vec::new();
    for path in &args.availability {
        let t = AvailabilityTrace::load(path, args.availability_reading)?;
        let up: Vec<bool> = t.counts.iter().map(|&c| c > 0).collect();
        series.push(resample(&up, t.gap_secs as f64, step_minutes * 60.0));
    }
    let mut model = AvailabilityModel::fit(
        &series,
        step_minutes,
        &AvailabilityModel::DEFAULT_BUCKETS,
        1.0,
    );
    // Four places are plenty for a probability, and keep a policy file readable.
    for p in model.up_end.iter_mut().chain(model.down_end.iter_mut()) {
        *p = (*p * 1e4).round() / 1e4;
    }
    if args.output == crate::output::OutputFormat::Json {
        println!("{}", serde_json::to_string_pretty(&model)?);
    } else {
        let files: Vec<String> = args
            .availability
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        println!(
            "# Fitted by `proteus simulate --fit-availability` to {} (reading: {}); up {:.1}% \
             of the time in the long run.\n[today.availability]\n{}",
            files.join(", "),
            match args.availability_reading {
                crate::sim::availability::Reading::Available => "available",
                crate::sim::availability::Reading::Preempted => "preempted",
            },
            100.0 * model.up_share(),
            toml::to_string(&model).context("writing the model as TOML")?
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn run(args: SimulateArgs) -> Result<ExitCode> {
    if args.fit_availability {
        return fit(&args);
    }
    let began = std::time::Instant::now();
    let report = sweep(&args)?;
    eprintln!(
        "{} starts × {} policies on {} pool(s) of {} in {:.2} s",
        report.starts.len(),
        report.policies.len(),
        report.availability.len(),
        report.instance_type,
        began.elapsed().as_secs_f64()
    );
    emit(args.output, &report, || {
        let mut table = Table::new(&[
            "policy",
            "deadline met",
            "cost vs on-demand",
            "median cost",
            "interruptions",
            "refused launches",
            "spot share",
        ])
        .fields(&[
            "policy",
            "deadline_met_rate",
            "cost_vs_on_demand",
            "median_cost_usd",
            "mean_interruptions",
            "mean_refused_launches",
            "spot_share",
        ]);
        let plain = |shown: String, v: f64| Cell {
            shown,
            plain: v.to_string(),
        };
        for s in &report.policies {
            table.push([
                Cell::from(s.policy.clone()),
                plain(format!("{:.2}", s.deadline_met_rate), s.deadline_met_rate),
                plain(format!("{:.3}", s.cost_vs_on_demand), s.cost_vs_on_demand),
                Cell::dollars(s.median_cost_usd),
                plain(format!("{:.1}", s.mean_interruptions), s.mean_interruptions),
                plain(
                    format!("{:.1}", s.mean_refused_launches),
                    s.mean_refused_launches,
                ),
                plain(format!("{:.2}", s.spot_share), s.spot_share),
            ]);
        }
        table
    })?;
    Ok(ExitCode::SUCCESS)
}
