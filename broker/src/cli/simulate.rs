//! `proteus simulate`: run policies against a spot price trace and compare what they cost.

use crate::billing::BillingModel;
use crate::data;
use crate::engine::view::FutureReads;
use crate::job::{JobModel, WorkModelSpec};
use crate::market::{Region, Timestamp};
use crate::market_model::{
    HazardModel, HazardPrior, MarketModel, PriceDrivenModel, PriceModelConfig,
    learned::{self, EvictionModelFile, LearnedModel},
};
use crate::output::{Cell, OutputFormat, Table, emit, json_table};
use crate::policy::{PolicyKind, resolve_policy_path};
use crate::service::spec::JobSpec;
use crate::sim::foresight::{Foresight, ForesightSchedule};
use crate::sim::inputs::{check_policy, load_history};
use crate::sim::sweep::{
    PolicyEntry, PolicySummary, SweepOptions, run_sweep, start_times, summarize,
};
use crate::sim::world::HazardTruth;
use crate::sim::{Deadline, RunResult, Scenario, World, gap};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    # the paper's comparison on the 2015 trace, 50 start times\n  \
    proteus simulate --job examples/jobs/reference-2015.toml --compare bidbrain standard-bidding on-demand \\\n      \
      --starts 50 --seed 1\n  \
    # one run from a given time, as JSON\n  \
    proteus simulate --job examples/jobs/reference-2015.toml --policy bidbrain --start 2015-05-01T00:00:00Z --output json\n  \
    # today's market from real availability traces, with a deadline\n  \
    proteus simulate --availability data/spot/skypilot-spot-traces/availability/1-node/aws-10-26-2022/us-west-2a_v100_1.json \\\n      \
      --work-hours 48 --deadline-hours 52 --restart-overhead-hours 0.2 --policy uniform-progress --starts 20 --output json\n  \
    # today's market: per-second billing, interruption-hazard model\n  \
    proteus simulate --trace data/spot/aws-us-east-1-2021-03-to-05.csv.gz \\\n      \
      --on-demand data/spot/on-demand-us-east-1-2021.csv --job examples/jobs/reference-2021.toml \\\n      \
      --billing per-second --compare bidbrain standard-bidding on-demand --starts 50\n\n\
    Policies are files (policies/*.toml) or bare names looked up in the repository's policies/\n\
    directory. Ratios are medians over start times of per-start ratios (the second table also\n\
    gives the ratio of the medians); when the compared set has no on-demand or standard-bidding\n\
    policy, the shipped one is run too, as the baseline. `units/h held` is the capacity each\n\
    policy held (median): set `max_capacity` in the job's work model to compare at equal speed.")]
pub struct SimulateArgs {
    /// Spot price trace (CSV or DescribeSpotPriceHistory JSON, plain or .gz).
    /// Default: the repository's 2015 us-east-1 trace.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// On-demand price table. Default: the repository's 2015 table.
    #[arg(long = "on-demand", value_name = "FILE")]
    pub on_demand: Option<PathBuf>,
    /// Region for on-demand rows without a region column.
    #[arg(long, default_value = "us-east-1")]
    pub region: String,
    /// The policy to simulate (file or name). With --availability and neither this nor
    /// --compare: bidbrain, uniform-progress and skypilot-default.
    #[arg(
        long,
        value_name = "POLICY",
        conflicts_with = "compare",
        required_unless_present_any = ["compare", "availability", "optimal", "fit_eviction"]
    )]
    pub policy: Option<String>,
    /// Several policies, run on the same start times.
    #[arg(long, value_name = "POLICY", num_args = 1..)]
    pub compare: Vec<String>,
    /// The job's work model (TOML or JSON), e.g. examples/jobs/reference-2015.toml.
    /// Not with --availability (the flags below describe that job).
    #[arg(long, value_name = "FILE", required_unless_present = "availability")]
    pub job: Option<PathBuf>,
    /// Today's market from availability traces instead of a price trace: one file per zone,
    /// the zone named by the file name (`us-west-2a_v100_1.json`), all covering the same
    /// period (SkyPilot's `{"metadata": {"gap_seconds": G}, "data": [...]}`). Repeat the flag
    /// or give several files. Per-second billing, free if EC2 interrupts in the first hour.
    #[arg(long, value_name = "FILE", num_args = 1.., conflicts_with_all = ["trace", "job", "start"])]
    pub availability: Vec<PathBuf>,
    /// How a 0/1 availability value is read: `available` (1: spot can be had; the upstream
    /// README's reading) or `preempted` (1: no spot).
    #[arg(long, value_enum, default_value_t = crate::sim::availability::Reading::Available)]
    pub availability_reading: crate::sim::availability::Reading,
    /// The hindsight optimum: the cheapest schedule that does the work by the deadline knowing
    /// the whole trace (a lower bound, not a policy). With --availability (one instance, every
    /// zone given — a file per zone —, no --policy or --compare): its figures are printed as the
    /// asked policy's; the restart overhead is exact and the last tick billed to the second
    /// (see sim/optimal.rs). With
    /// --job on a 2015-style price trace (hourly-2015 billing): a `hindsight-optimal` row beside
    /// the compared policies, each start's deadline being --deadline (or the job's), else the
    /// time standard bidding took from that start (see sim/foresight.rs for its rules).
    #[arg(long)]
    pub optimal: bool,
    /// With --job and --optimal (and no --deadline): hold the optimum on each start to the
    /// time this compared policy took there, instead of standard bidding's.
    #[arg(long, value_name = "POLICY", requires = "optimal")]
    pub optimal_held_to: Option<String>,
    /// With --job and --optimal (and no --deadline): hold the optimum to this multiple of the
    /// held-to policy's runtime on each start (1.0 to 10; default 1.0): a point of the
    /// cost–runtime frontier (bench/bidbrain-gap traces 1.00, 1.02, 1.05, 1.10 and 1.25).
    #[arg(long, value_name = "F", default_value_t = 1.0, requires = "optimal")]
    pub optimal_runtime_factor: f64,
    /// With --job and --optimal: write where each policy's money goes against the optimum
    /// (per start and in total, in dollars) to this JSON file.
    #[arg(long, value_name = "FILE", requires = "optimal")]
    pub gap: Option<PathBuf>,
    /// With --job and --optimal: draw that decomposition (SVG, or PNG by the file's extension).
    #[arg(long, value_name = "FILE", requires = "optimal")]
    pub gap_chart: Option<PathBuf>,
    /// With --job: how well the market model's eviction estimates matched what happened, per
    /// policy, as JSON to this file: each spot instance's probability of an eviction within its
    /// first hour (at launch) against whether one came; Brier score, the constant forecast's,
    /// and a reliability table (see sim/calibration.rs).
    #[arg(long, value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// With --job: fit the learned eviction model (logistic regression on what a broker knows at
    /// launch: see market_model/learned.rs) to launches replayed in every market every 10
    /// minutes at BidBrain's bid deltas over the start window (--starts-from/--starts-until,
    /// each launch's hour inside it), write it to this file, and run nothing. Fit on
    /// March–April 2015 (--starts-until 2015-05-01); load it with --eviction-model on another
    /// period.
    #[arg(long, value_name = "FILE", conflicts_with = "eviction_model")]
    pub fit_eviction: Option<PathBuf>,
    /// With --job on the 2015 market: the eviction estimates come from this learned model file
    /// (written by --fit-eviction) instead of the price replay alone.
    #[arg(long, value_name = "FILE")]
    pub eviction_model: Option<PathBuf>,
    /// With --availability: fit the availability model BidBrain plans with (the pools' spot
    /// capacity coming and going, on 10-minute steps) to these traces, and print it as the
    /// `[today.availability]` table of a policy file (JSON with --output json). Runs nothing.
    #[arg(long, requires = "availability", conflicts_with_all = ["policy", "compare", "optimal"])]
    pub fit_availability: bool,
    /// With --availability: the instance type the traces are of.
    #[arg(long, default_value = "p3.2xlarge")]
    pub instance_type: String,
    /// With --availability: instances the job runs on (all at once at full speed).
    #[arg(long, default_value_t = 1)]
    pub instances: u32,
    /// With --availability: the job's compute at full width, hours.
    #[arg(long, value_name = "HOURS", requires = "availability")]
    pub work_hours: Option<f64>,
    /// With --availability: the deadline, hours after each start.
    #[arg(long, value_name = "HOURS", requires = "availability")]
    pub deadline_hours: Option<f64>,
    /// With --availability: time from each launch to useful work, hours.
    #[arg(long, value_name = "HOURS", default_value_t = 0.02)]
    pub restart_overhead_hours: f64,
    /// With --availability: every start begins a fleet of K jobs of the job's shape, started
    /// a deadline ÷ K apart, that share one pool book: what any job's spot launches,
    /// refusals and interruptions show of a pool, every job's plan reads, and each pool's
    /// availability model is learned from it (docs/today.md). The report covers every job of
    /// every fleet. Without it each start is run alone.
    #[arg(long, value_name = "K", requires = "availability")]
    pub fleet: Option<usize>,
    /// With --fleet: share beliefs only; every pool keeps the policy's prior model.
    #[arg(long, requires = "fleet")]
    pub no_pool_learning: bool,
    /// With --availability: the spot price of every pool, USD/h (the traces carry none).
    #[arg(long, value_name = "USD", default_value_t = crate::sim::availability::TRACE_SPOT_USD_PER_HOUR)]
    pub spot_price: f64,
    /// With --availability: the on-demand price, USD/h (p3.2xlarge's list price).
    #[arg(long, value_name = "USD", default_value_t = crate::sim::availability::P3_2XLARGE_ON_DEMAND_USD_PER_HOUR)]
    pub on_demand_price: f64,
    /// One start time (RFC 3339 or YYYY-MM-DD) instead of a sweep.
    #[arg(long, conflicts_with_all = ["starts"])]
    pub start: Option<String>,
    /// Number of start times, spread over the trace (one at random in each of N equal slices).
    #[arg(long, default_value_t = 50)]
    pub starts: usize,
    /// Start times no earlier than this (RFC 3339 or YYYY-MM-DD), e.g. to report on May–June
    /// 2015 when defaults were tuned on March–April.
    #[arg(long, conflicts_with = "start")]
    pub starts_from: Option<String>,
    /// Start times before this (RFC 3339 or YYYY-MM-DD).
    #[arg(long, conflicts_with = "start")]
    pub starts_until: Option<String>,
    /// Seed of the start times and of the interruption world.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Billing model.
    #[arg(long, value_enum, default_value_t = BillingModel::Hourly2015)]
    pub billing: BillingModel,
    /// Market model and eviction world: `price` (2015: evicted when the price crosses the bid;
    /// estimates replay history), `hazard` (today: per-pool interruptions; estimates learn from
    /// them), or `auto` (price with hourly-2015, hazard with per-second).
    #[arg(long, value_enum, default_value_t = ModelChoice::Auto)]
    pub market_model: ModelChoice,
    /// Look-back window of the price-driven model, days.
    #[arg(long, default_value_t = 7.0)]
    pub lookback_days: f64,
    /// Hazard model prior: interruptions per instance-hour.
    #[arg(long, default_value_t = HazardPrior::default().interruptions_per_instance_hour)]
    pub hazard_prior: f64,
    /// Hazard model prior weight, instance-hours.
    #[arg(long, default_value_t = HazardPrior::default().weight_instance_hours)]
    pub hazard_prior_weight: f64,
    /// Multiplies the simulated world's true interruption rates (hazard world only).
    #[arg(long, default_value_t = 1.0)]
    pub hazard_scale: f64,
    /// Trace time kept after each sweep start so the job can finish, hours.
    /// Default: three times the job's on-demand runtime, at least 48.
    #[arg(long)]
    pub reserve_hours: Option<f64>,
    /// The job's budget, USD: a run ends (failed) before the billing period that would pass it,
    /// as the live broker ends the job. Default: the job spec's `limits.budget_usd`, if any.
    #[arg(long, value_name = "USD")]
    pub budget: Option<f64>,
    /// The job's deadline: a duration after each start (`36h`, `90m`, `2d`) or a market time.
    /// A run still going then ends (failed), as the live broker ends the job. Default: the job
    /// spec's `limits.deadline_hours` or `limits.deadline`, if any.
    #[arg(long, value_name = "DURATION|TIME")]
    pub deadline: Option<String>,
    /// Worker threads for sweeps. Default: the available cores.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Also write every run as JSON lines to this file.
    #[arg(long, value_name = "FILE")]
    pub runs_out: Option<PathBuf>,
    /// Include every policy decision in the runs written by --runs-out (large).
    #[arg(long, requires = "runs_out")]
    pub record_decisions: bool,
    #[arg(long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModelChoice {
    Auto,
    Price,
    Hazard,
}

impl SimulateArgs {
    /// Worker threads for a sweep: `--threads`, or the available cores.
    pub(super) fn threads(&self) -> usize {
        self.threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

pub fn run(args: SimulateArgs) -> Result<ExitCode> {
    if !args.availability.is_empty() {
        return super::simulate_today::run(args);
    }
    let Some(job_path) = args.job.clone() else {
        bail!("--job FILE is needed (or --availability FILE… for today's market)");
    };
    let began = Instant::now();
    let region = Region::parse(&args.region).context("--region")?;
    let trace = args
        .trace
        .clone()
        .unwrap_or_else(|| data::data_dir().join("spot").join(data::TRACE_2015_NAME));
    let on_demand = args.on_demand.clone().unwrap_or_else(|| {
        data::data_dir()
            .join("spot")
            .join(data::ON_DEMAND_2015_NAME)
    });
    let history = Arc::new(load_history(&trace, &on_demand, &region)?);
    if history.is_empty() {
        bail!("{}: no price rows", trace.display());
    }
    let job_file = job_path.display().to_string();
    let (job, billing, limits) = load_job(&job_path, &history, &region, args.billing)?;
    let budget = match args.budget {
        Some(b) => Some(
            crate::market::Usd::new(b)
                .ok()
                .filter(|b| b.get() > 0.0)
                .with_context(|| format!("--budget {b}: a positive amount of USD"))?,
        ),
        None => limits.budget,
    };
    let deadline = match &args.deadline {
        Some(d) => Some(
            Deadline::parse(d)
                .map_err(anyhow::Error::msg)
                .context("--deadline")?,
        ),
        None => limits.deadline,
    };
    for (t, _) in job.rates() {
        if !history.markets().any(|m| &m.instance_type == t) {
            eprintln!(
                "warning: {job_file}: instance type {t} has no spot market in {}",
                trace.display()
            );
        }
    }

    // Policies: the ones asked for, plus the shipped baselines when ratios need them.
    let asked: Vec<String> = match &args.policy {
        Some(p) => vec![p.clone()],
        None => args.compare.clone(),
    };
    let mut entries = Vec::new();
    for name in &asked {
        let path = resolve_policy_path(name)?;
        entries.push(PolicyEntry::load(&path)?);
    }
    for (kind, name) in [
        (PolicyKind::OnDemand, "on-demand"),
        (PolicyKind::StandardBidding, "standard-bidding"),
    ] {
        if !entries.iter().any(|e| e.kind == kind) {
            match resolve_policy_path(name)
                .map_err(anyhow::Error::from)
                .and_then(|p| Ok(PolicyEntry::load(&p)?))
            {
                Ok(e) => entries.push(e),
                Err(e) => eprintln!("warning: no {kind} baseline for the ratios: {e:#}"),
            }
        }
    }
    let trace_name = trace.display().to_string();
    for e in &entries {
        check_policy(e, &history, &job, &trace_name)?;
    }
    // Said before the runs, not after them.
    let factor = args.optimal_runtime_factor;
    if !(factor.is_finite() && (1.0..=10.0).contains(&factor)) {
        bail!(
            "--optimal-runtime-factor {factor}: must be a number from 1.0 to 10 (the optimum's \
             runtime as a multiple of the held-to policy's)"
        );
    }
    if factor != 1.0 && deadline.is_some() {
        bail!(
            "--optimal-runtime-factor holds the optimum to a policy's runtime: it does not go with a \
             deadline (--deadline or the job's)"
        );
    }
    if let Some(held_to) = &args.optimal_held_to
        && !entries.iter().any(|e| &e.name == held_to)
    {
        bail!(
            "--optimal-held-to {held_to}: no compared policy has that name (compared: {})",
            entries
                .iter()
                .map(|e| e.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }

    let kind = match (args.market_model, billing) {
        (ModelChoice::Price, _) | (ModelChoice::Auto, BillingModel::Hourly2015) => {
            ModelChoice::Price
        }
        _ => ModelChoice::Hazard,
    };
    let lookback_secs = args.lookback_days * 86_400.0;
    if !(lookback_secs.is_finite() && lookback_secs > 0.0) {
        bail!("--lookback-days must be positive");
    }
    if kind != ModelChoice::Price && (args.eviction_model.is_some() || args.fit_eviction.is_some())
    {
        bail!(
            "--fit-eviction and --eviction-model are for the 2015 market, where evictions follow \
             the price (--billing hourly-2015, --market-model price or auto)"
        );
    }
    let (model, world): (Box<dyn MarketModel>, World) = match kind {
        ModelChoice::Price => {
            let m = PriceDrivenModel::new(
                history.clone(),
                PriceModelConfig {
                    lookback_secs,
                    ..PriceModelConfig::default()
                },
            );
            match &args.eviction_model {
                Some(path) => {
                    let file = EvictionModelFile::read(path)?;
                    let learned = LearnedModel::new(history.clone(), Box::new(m), file, path)?;
                    let unknown = learned.unknown_markets();
                    if !unknown.is_empty() {
                        eprintln!(
                            "note: {} has no launches of {} to learn from: answered as the \
                             average market",
                            path.display(),
                            unknown.join(", ")
                        );
                    }
                    (Box::new(learned), World::Price)
                }
                None => (Box::new(m), World::Price),
            }
        }
        _ => {
            let prior = HazardPrior {
                interruptions_per_instance_hour: args.hazard_prior,
                weight_instance_hours: args.hazard_prior_weight,
            };
            if !(prior.interruptions_per_instance_hour >= 0.0 && prior.weight_instance_hours >= 0.0)
            {
                bail!("--hazard-prior and --hazard-prior-weight must be zero or positive");
            }
            let truth = HazardTruth {
                scale: args.hazard_scale,
                ..HazardTruth::default()
            };
            (Box::new(HazardModel::new(prior)), World::Hazard(truth))
        }
    };
    if args.optimal && (billing != BillingModel::Hourly2015 || kind != ModelChoice::Price) {
        bail!(
            "--optimal with --job is the foresight optimum of the 2015 market: it needs \
             --billing hourly-2015 and evictions that follow the price (--market-model price or \
             auto); under the interruption-hazard model nobody can foresee an eviction"
        );
    }
    let od_hours = job.total_work / job.full_speed() + job.startup_secs / 3600.0;
    let scenario = Scenario::new(history.clone(), job, billing, world, model)?;
    let (first, last) = scenario.span();

    let starts: Vec<Timestamp> = match &args.start {
        Some(s) => vec![Timestamp::parse(s).context("--start")?],
        None => {
            if args.starts == 0 {
                bail!("--starts must be at least 1");
            }
            let reserve = args.reserve_hours.unwrap_or((3.0 * od_hours).max(48.0));
            let mut lo = Timestamp::from_millis(first.millis() + lookback_secs as i64 * 1000);
            let mut hi = Timestamp::from_millis(last.millis() - (reserve * 3_600_000.0) as i64);
            if let Some(from) = &args.starts_from {
                lo = lo.max(Timestamp::parse(from).context("--starts-from")?);
            }
            if let Some(until) = &args.starts_until {
                hi = hi.min(Timestamp::parse(until).context("--starts-until")?);
            }
            if (args.starts_from.is_some() || args.starts_until.is_some()) && hi <= lo {
                bail!(
                    "no start time fits: the window {lo} to {hi} is empty once the look-back \
                     ({:.1} days) and the time to finish ({reserve:.1} h) are left out of the trace",
                    args.lookback_days
                );
            }
            if hi <= lo {
                bail!(
                    "the trace {} covers {:.1} days ({first} to {last}); the job needs {:.1} days of \
                     look-back plus {:.1} hours to finish after each start (--reserve-hours): use a longer trace",
                    trace.display(),
                    last.secs_since(first) / 86_400.0,
                    args.lookback_days,
                    reserve
                );
            }
            start_times(lo, hi, args.starts, args.seed)
        }
    };

    if let Some(path) = &args.fit_eviction {
        // The start window: from the first time with a look-back behind it (or --starts-from)
        // to the trace's end (or --starts-until).
        let mut from = Timestamp::from_millis(first.millis() + lookback_secs as i64 * 1000);
        if let Some(f) = &args.starts_from {
            from = from.max(Timestamp::parse(f).context("--starts-from")?);
        }
        let to = match &args.starts_until {
            Some(u) => last.min(Timestamp::parse(u).context("--starts-until")?),
            None => last,
        };
        return fit_eviction(path, &history, scenario.model(), from, to)
            .map(|()| ExitCode::SUCCESS);
    }
    let total_runs = (starts.len() * entries.len()) as u64;
    let bar = indicatif::ProgressBar::new(total_runs);
    if total_runs < 30 {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} simulating {pos}/{len} runs [{bar:30}] {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let threads = args.threads();
    let options = SweepOptions {
        seed: args.seed,
        threads,
        future_reads: FutureReads::Refuse,
        // The instances' estimates at launch come with the decisions.
        record_decisions: args.record_decisions || args.calibration.is_some(),
        budget,
        deadline,
    };
    let mut results = run_sweep(&scenario, &entries, &starts, &options, &|| bar.inc(1))?;
    bar.finish_and_clear();
    if let Some(path) = &args.calibration {
        write_calibration(path, &results)?;
        if !args.record_decisions {
            for r in results.iter_mut().flatten() {
                r.decisions.clear();
                r.instances.clear();
            }
        }
    }
    let summaries = summarize(&results);

    let optimum = if args.optimal {
        let held_to = args
            .optimal_held_to
            .as_deref()
            .unwrap_or("standard-bidding");
        Some(foresight_runs(
            &scenario,
            &results,
            &starts,
            deadline,
            (held_to, args.optimal_runtime_factor),
            threads,
        )?)
    } else {
        None
    };
    if let Some(path) = &args.runs_out {
        write_runs(path, &results, optimum.as_deref())?;
    }
    if let Some(optimum) = &optimum {
        write_gap(&args, &scenario, &results, optimum)?;
    }
    eprintln!(
        "{} runs ({} policies × {} starts, {} to {}) on {} with {} billing and the {} model in {:.2} s",
        total_runs,
        entries.len(),
        starts.len(),
        starts
            .iter()
            .min()
            .map(Timestamp::to_string)
            .unwrap_or_default(),
        starts
            .iter()
            .max()
            .map(Timestamp::to_string)
            .unwrap_or_default(),
        trace.display(),
        billing,
        if kind == ModelChoice::Price {
            "price-driven"
        } else {
            "interruption-hazard"
        },
        began.elapsed().as_secs_f64()
    );
    let optimal_row = optimum.as_ref().map(|o| optimal_summary(o, &results));
    let mut rows: Vec<serde_json::Value> = summaries
        .iter()
        .map(serde_json::to_value)
        .collect::<Result<_, _>>()?;
    if let Some(row) = &optimal_row {
        rows.push(serde_json::to_value(row)?);
    }
    match args.output {
        // One column per field of the JSON, named as there (the table's ranges and rounded
        // figures are for people).
        OutputFormat::Csv => print!("{}", json_table(SUMMARY_FIELDS, &rows).to_csv()),
        _ => emit(args.output, &rows, || summary_table(&summaries))?,
    }
    if args.output == OutputFormat::Table {
        println!();
        print!("{}", breakdown_table(&summaries).render());
        if let Some(row) = &optimal_row {
            println!();
            println!("{}", row.sentence());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The job to simulate, and its billing: a work model file (`examples/jobs/reference-2015.toml`),
/// or a job spec as `proteus submit` and `proteus demo --job` take it
/// (`examples/jobs/demo.toml`), whose work model is the one the broker would run it with
/// ([`ValidJob::work_model_spec`](crate::service::spec::ValidJob::work_model_spec)) and whose
/// `billing`, if set, overrides `--billing`.
fn load_job(
    path: &std::path::Path,
    history: &Arc<crate::prices::PriceHistory>,
    region: &Region,
    billing: BillingModel,
) -> Result<(JobModel, BillingModel, SpecLimits)> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {file}"))?;
    if !is_job_spec(&text) {
        let model =
            WorkModelSpec::parse(&file, &text)?.resolve(&file, history.on_demand(), region)?;
        return Ok((model, billing, SpecLimits::default()));
    }
    let spec = JobSpec::parse_file(&file, &text).map_err(anyhow::Error::msg)?;
    let valid = spec
        .validate(billing, Timestamp::from_millis(0))
        .map_err(|e| anyhow::anyhow!("{file}: {}: {}", e.field, e.message))?;
    let usable = crate::engine::view::TraceMarkets::new(history.clone()).usable_types();
    let model = valid
        .work_model_spec(&usable, crate::job::DEFAULT_STARTUP_MINUTES)
        .map_err(|e| anyhow::anyhow!("{file}: {}: {}", e.field, e.message))?
        .resolve(&file, history.on_demand(), region)?;
    // Validated against the epoch, a relative deadline is its own length.
    let deadline = match (&spec.limits.deadline, valid.deadline) {
        (None, Some(d)) => Some(Deadline::After(d.millis() as f64 / 1000.0)),
        (Some(_), Some(d)) => Some(Deadline::At(d)),
        (_, None) => None,
    };
    let limits = SpecLimits {
        budget: valid.budget_usd,
        deadline,
    };
    Ok((model, valid.billing, limits))
}

/// The limits a job spec sets that the simulator applies as the broker would.
#[derive(Debug, Default)]
struct SpecLimits {
    budget: Option<crate::market::Usd>,
    deadline: Option<Deadline>,
}

/// A job spec names its application (`app`); a work model file has none.
fn is_job_spec(text: &str) -> bool {
    if text.trim_start().starts_with('{') {
        serde_json::from_str::<serde_json::Value>(text).is_ok_and(|v| v.get("app").is_some())
    } else {
        toml::from_str::<toml::Table>(text).is_ok_and(|t| t.contains_key("app"))
    }
}

fn write_runs(
    path: &std::path::Path,
    results: &[Vec<RunResult>],
    optimum: Option<&[OptimalRun]>,
) -> Result<()> {
    use std::io::Write;
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    for r in results.iter().flatten() {
        serde_json::to_writer(&mut w, r)?;
        writeln!(w)?;
    }
    for o in optimum.into_iter().flatten() {
        serde_json::to_writer(&mut w, o)?;
        writeln!(w)?;
    }
    w.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The foresight optimum on one start of a sweep.
#[derive(Debug, Clone, serde::Serialize)]
struct OptimalRun {
    policy: &'static str,
    start: Timestamp,
    /// The deadline it was held to, hours after the start.
    deadline_hours: f64,
    /// `None`: no schedule does the work by then.
    schedule: Option<ForesightSchedule>,
}

const OPTIMAL: &str = "hindsight-optimal";

/// The optimum on every start: held to `deadline` if one is set, else to the time the policy
/// named `held_to` took from that start.
fn foresight_runs(
    scenario: &Scenario,
    results: &[Vec<RunResult>],
    starts: &[Timestamp],
    deadline: Option<Deadline>,
    (held_to, factor): (&str, f64),
    threads: usize,
) -> Result<Vec<OptimalRun>> {
    let standard = results
        .iter()
        .find(|r| r.first().is_some_and(|x| x.policy == held_to));
    if deadline.is_none() && standard.is_none() {
        bail!("--optimal-held-to {held_to}: no compared policy has that name");
    }
    let by = |i: usize, start: Timestamp| -> Result<Timestamp> {
        if let Some(d) = deadline {
            return Ok(d.for_start(start));
        }
        standard
            .and_then(|runs| runs.get(i))
            .map(|r| start.plus_secs(r.end.secs_since(start) * factor))
            .context("--optimal needs a deadline: --deadline, the job's, or a standard-bidding run")
    };
    let deadlines: Vec<Timestamp> = starts
        .iter()
        .enumerate()
        .map(|(i, s)| by(i, *s))
        .collect::<Result<_>>()?;
    let chunk = starts.len().div_ceil(threads.max(1)).max(1);
    let mut out: Vec<OptimalRun> = Vec::with_capacity(starts.len());
    std::thread::scope(|scope| {
        let handles: Vec<_> = starts
            .chunks(chunk)
            .zip(deadlines.chunks(chunk))
            .map(|(s, d)| {
                scope.spawn(move || {
                    s.iter()
                        .zip(d)
                        .map(|(&start, &by)| OptimalRun {
                            policy: OPTIMAL,
                            start,
                            deadline_hours: by.secs_since(start) / 3600.0,
                            schedule: match scenario.foresight(start, by) {
                                Foresight::Schedule(s) => Some(s),
                                Foresight::Infeasible => None,
                            },
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            out.extend(h.join().unwrap_or_default());
        }
    });
    Ok(out)
}

/// The optimum's row beside the policies' summaries.
#[derive(Debug, Clone, serde::Serialize)]
struct OptimalSummary {
    policy: &'static str,
    kind: &'static str,
    runs: usize,
    completed_runs: usize,
    median_cost_usd: f64,
    p10_cost_usd: f64,
    p90_cost_usd: f64,
    /// The deadlines it was held to (it finishes by them, not necessarily earlier).
    median_runtime_hours: f64,
    median_free_instance_hours: Option<f64>,
    cost_ratio_vs_on_demand: Option<f64>,
    cost_ratio_vs_standard: Option<f64>,
    median_usd_per_paid_unit_hour: f64,
    median_paid_share: f64,
    median_useful_fraction: f64,
    median_lost_work: f64,
    /// Median over starts of the Lagrangian bound (no schedule under the rules costs less).
    median_lower_bound_usd: f64,
}

impl OptimalSummary {
    fn sentence(&self) -> String {
        format!(
            "hindsight optimum (knows the whole trace; a lower bound, not a policy), held to \
             the deadline or a compared policy's runtime (median {:.1} h): median ${:.2} (p10 ${:.2}, p90 ${:.2}) \
             on {} of {} starts; {} of on-demand, {} of standard bidding (medians of per-start \
             ratios)",
            self.median_runtime_hours,
            self.median_cost_usd,
            self.p10_cost_usd,
            self.p90_cost_usd,
            self.completed_runs,
            self.runs,
            self.cost_ratio_vs_on_demand
                .map_or("-".into(), |r| format!("{:.1}%", 100.0 * r)),
            self.cost_ratio_vs_standard
                .map_or("-".into(), |r| format!("{:.1}%", 100.0 * r)),
        )
    }
}

/// `--fit-eviction FILE`: the learned eviction model fitted to launches replayed from `from` to
/// `to` (every market every 10 minutes, at BidBrain's default bid deltas).
fn fit_eviction(
    path: &Path,
    history: &crate::prices::PriceHistory,
    replay: &dyn MarketModel,
    from: Timestamp,
    to: Timestamp,
) -> Result<()> {
    const STEP_SECS: f64 = 600.0;
    let deltas = crate::policy::BidBrainConfig::default_bid_deltas();
    let launches = learned::replayed_launches(history, from, to, STEP_SECS, &deltas);
    let file = learned::fit(history, replay, &launches)?;
    eprintln!(
        "fitted the eviction model on {} launches replayed in {} markets ({} to {}, every 10 \
         minutes at {} bid deltas), {:.3} evicted within the hour",
        file.samples,
        file.markets.len(),
        file.trained_from.to_datetime().format("%Y-%m-%d %H:%M"),
        file.trained_to.to_datetime().format("%Y-%m-%d %H:%M"),
        deltas.len(),
        file.evicted_rate
    );
    let text = serde_json::to_string_pretty(&file).context("encoding the eviction model")?;
    std::fs::write(path, text + "\n")
        .with_context(|| format!("writing the eviction model to {}", path.display()))
}

/// `--calibration FILE`: the eviction estimates' calibration per policy (every start pooled).
fn write_calibration(path: &Path, results: &[Vec<RunResult>]) -> Result<()> {
    use crate::sim::calibration::{self, Calibration};
    #[derive(serde::Serialize)]
    struct PolicyCalibration<'a> {
        policy: &'a str,
        #[serde(flatten)]
        calibration: Calibration,
    }
    #[derive(serde::Serialize)]
    struct File<'a> {
        horizon_hours: f64,
        held_without_eviction_hours: f64,
        policies: Vec<PolicyCalibration<'a>>,
    }
    let policies: Vec<PolicyCalibration> = results
        .iter()
        .filter_map(|runs| {
            let policy = runs.first()?.policy.as_str();
            let c = calibration::calibrate(runs.iter().flat_map(|r| &r.instances), 10);
            (c.outcomes + c.censored > 0).then_some(PolicyCalibration {
                policy,
                calibration: c,
            })
        })
        .collect();
    for p in &policies {
        let c = &p.calibration;
        eprintln!(
            "{}'s eviction estimates: {} spot instances ({} censored), mean estimate {:.3}, \
             evicted within the hour {:.3}; Brier {:.4} (constant forecast {:.4}: skill {:.1}%)",
            p.policy,
            c.outcomes,
            c.censored,
            c.mean_estimate,
            c.observed_rate,
            c.brier,
            c.climatology_brier,
            if c.climatology_brier > 0.0 {
                (1.0 - c.brier / c.climatology_brier) * 100.0
            } else {
                0.0
            }
        );
    }
    let file = File {
        horizon_hours: calibration::HORIZON_SECS / 3600.0,
        held_without_eviction_hours: calibration::OBSERVED_SECS / 3600.0,
        policies,
    };
    let text = serde_json::to_string_pretty(&file).context("encoding the calibration")?;
    std::fs::write(path, text + "\n")
        .with_context(|| format!("writing the calibration to {}", path.display()))
}

fn optimal_summary(optimum: &[OptimalRun], results: &[Vec<RunResult>]) -> OptimalSummary {
    use crate::sim::sweep::percentile;
    let solved: Vec<(usize, &ForesightSchedule)> = optimum
        .iter()
        .enumerate()
        .filter_map(|(i, o)| o.schedule.as_ref().map(|s| (i, s)))
        .collect();
    let col = |f: &dyn Fn(&ForesightSchedule) -> f64| -> Vec<f64> {
        solved.iter().map(|(_, s)| f(s)).collect()
    };
    let costs = col(&|s| s.cost_usd);
    // NaN when no start had a schedule (JSON null).
    let pct = |v: &[f64], p: f64| {
        if v.is_empty() {
            f64::NAN
        } else {
            percentile(v, p)
        }
    };
    let median = |v: &[f64]| pct(v, 50.0);
    let ratio = |kind: PolicyKind| {
        results
            .iter()
            .find(|r| r.first().is_some_and(|x| x.kind == kind))
            .map(|runs| {
                let v: Vec<f64> = solved
                    .iter()
                    .filter_map(|(i, s)| runs.get(*i).map(|r| s.cost_usd / r.cost_usd.get()))
                    .collect();
                median(&v)
            })
    };
    let hours: Vec<f64> = optimum.iter().map(|o| o.deadline_hours).collect();
    OptimalSummary {
        policy: OPTIMAL,
        kind: OPTIMAL,
        runs: optimum.len(),
        completed_runs: solved.len(),
        median_cost_usd: median(&costs),
        p10_cost_usd: pct(&costs, 10.0),
        p90_cost_usd: pct(&costs, 90.0),
        median_runtime_hours: median(&hours),
        median_free_instance_hours: None,
        cost_ratio_vs_on_demand: ratio(PolicyKind::OnDemand),
        cost_ratio_vs_standard: ratio(PolicyKind::StandardBidding),
        median_usd_per_paid_unit_hour: median(&col(&|s| {
            if s.paid_unit_hours > 0.0 {
                s.cost_usd / s.paid_unit_hours
            } else {
                0.0
            }
        })),
        median_paid_share: median(&col(&|s| {
            let used = s.paid_unit_hours - s.unused_billed_unit_hours + s.free_unit_hours;
            if used > 0.0 {
                (s.paid_unit_hours - s.unused_billed_unit_hours) / used
            } else {
                0.0
            }
        })),
        median_useful_fraction: median(&col(&|s| {
            let useful = s.held_unit_hours - s.startup_unit_hours - s.handover_unit_hours;
            if s.held_unit_hours > 0.0 {
                useful / s.held_unit_hours
            } else {
                0.0
            }
        })),
        median_lost_work: 0.0,
        median_lower_bound_usd: median(&col(&|s| s.lower_bound_usd)),
    }
}

/// `--gap` and `--gap-chart`: every non-on-demand policy's cost against the optimum's.
fn write_gap(
    args: &SimulateArgs,
    scenario: &Scenario,
    results: &[Vec<RunResult>],
    optimum: &[OptimalRun],
) -> Result<()> {
    if args.gap.is_none() && args.gap_chart.is_none() {
        return Ok(());
    }
    let job = &scenario.job;
    let capacity = job.max_capacity.unwrap_or_else(|| job.full_speed());
    let reports: Vec<gap::GapReport> = results
        .iter()
        .filter(|runs| runs.first().is_some_and(|r| r.kind != PolicyKind::OnDemand))
        .map(|runs| {
            let pairs: Vec<_> = runs
                .iter()
                .zip(optimum)
                .filter_map(|(r, o)| {
                    let s = o.schedule.as_ref()?;
                    Some((
                        r.start,
                        gap::Account::of_run(r, capacity),
                        gap::Account::of_optimum(s, job.total_work, capacity, o.deadline_hours),
                    ))
                })
                .collect();
            gap::report(&runs[0].policy, &pairs)
        })
        .collect();
    if let Some(path) = &args.gap {
        let text = serde_json::to_string_pretty(&serde_json::json!({
            "parts": gap::GapParts::NAMES,
            "policies": reports,
        }))?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.gap_chart {
        let format = crate::chart::Format::from_path(path);
        let categories: Vec<String> = gap::GapParts::NAMES
            .iter()
            .map(|n| n.replace('_', " "))
            .collect();
        let series: Vec<crate::chart::BarSeries> = reports
            .iter()
            .map(|r| crate::chart::BarSeries {
                name: format!("{} (gap ${:.0})", r.policy, r.total.gap_usd),
                values: r.total.parts.values().to_vec(),
            })
            .collect();
        let title = format!(
            "Cost above the foresight optimum ({}), summed over {} starts",
            args.deadline.as_deref().map_or_else(
                || format!(
                    "held to {:.2} × {}'s runtime",
                    args.optimal_runtime_factor,
                    args.optimal_held_to
                        .as_deref()
                        .unwrap_or("standard-bidding")
                ),
                |d| format!("deadline {d}")
            ),
            optimum.len()
        );
        let bytes = crate::chart::bar_chart(format, &title, "USD", &categories, &series)?;
        std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn ratio(v: Option<f64>) -> Cell {
    Cell::or_unknown(v, Cell::pct)
}

/// The runs, and how many of them ended at their budget or deadline rather than done.
fn runs_cell(s: &PolicySummary) -> Cell {
    let mut shown = s.runs.to_string();
    let mut ended = Vec::new();
    if s.ended_by_budget > 0 {
        ended.push(format!("{} at budget", s.ended_by_budget));
    }
    if s.ended_by_deadline > 0 {
        ended.push(format!("{} at deadline", s.ended_by_deadline));
    }
    if !ended.is_empty() {
        shown = format!("{shown} ({})", ended.join(", "));
    }
    Cell {
        shown,
        plain: s.runs.to_string(),
    }
}

/// The CSV columns of `simulate`: the fields of its JSON rows.
const SUMMARY_FIELDS: &[&str] = &[
    "policy",
    "kind",
    "runs",
    "completed_runs",
    "ended_by_budget",
    "ended_by_deadline",
    "median_cost_usd",
    "p10_cost_usd",
    "p90_cost_usd",
    "median_runtime_hours",
    "p10_runtime_hours",
    "p90_runtime_hours",
    "median_evictions",
    "median_instance_hours_reliable",
    "median_instance_hours_transient",
    "median_free_instance_hours",
    "cost_ratio_vs_on_demand",
    "cost_ratio_vs_standard",
    "runtime_ratio_vs_standard",
    "median_cost_ratio_vs_on_demand",
    "median_cost_ratio_vs_standard",
    "median_capacity_units_per_hour",
    "median_usd_per_paid_unit_hour",
    "median_paid_share",
    "median_useful_fraction",
    "median_lost_work",
];

fn summary_table(rows: &[PolicySummary]) -> Table {
    let mut t = Table::new(&[
        "policy",
        "runs",
        "cost median",
        "cost p10–p90",
        "hours median",
        "hours p10–p90",
        "evictions",
        "reliable inst-h",
        "transient inst-h",
        "free inst-h",
        "vs on-demand",
        "vs standard",
        "runtime vs std",
        "units/h held",
    ]);
    for s in rows {
        let text = |v: String| Cell::from(v);
        t.push([
            text(s.policy.clone()),
            runs_cell(s),
            Cell::usd(s.median_cost_usd),
            Cell {
                shown: format!("{}–{}", s.p10_cost_usd, s.p90_cost_usd),
                plain: format!("{}–{}", s.p10_cost_usd.get(), s.p90_cost_usd.get()),
            },
            text(format!("{:.2}", s.median_runtime_hours)),
            text(format!(
                "{:.2}–{:.2}",
                s.p10_runtime_hours, s.p90_runtime_hours
            )),
            text(format!("{:.0}", s.median_evictions)),
            text(format!("{:.1}", s.median_instance_hours_reliable)),
            text(format!("{:.1}", s.median_instance_hours_transient)),
            text(format!("{:.1}", s.median_free_instance_hours)),
            ratio(s.cost_ratio_vs_on_demand),
            ratio(s.cost_ratio_vs_standard),
            ratio(s.runtime_ratio_vs_standard),
            text(format!("{:.1}", s.median_capacity_units_per_hour)),
        ]);
    }
    t
}

/// Where the money goes: price per unit of capacity, the share free hours waived, and how much
/// of the paid capacity became useful work.
fn breakdown_table(rows: &[PolicySummary]) -> Table {
    let mut t = Table::new(&[
        "policy",
        "$ per paid unit-hour",
        "paid share of capacity",
        "useful fraction",
        "lost work (units)",
        "median cost vs on-demand",
        "median cost vs standard",
    ]);
    for s in rows {
        t.push([
            Cell::from(s.policy.clone()),
            Cell::dollars(s.median_usd_per_paid_unit_hour),
            Cell::pct(s.median_paid_share),
            Cell::pct(s.median_useful_fraction),
            Cell::from(format!("{:.1}", s.median_lost_work)),
            ratio(s.median_cost_ratio_vs_on_demand),
            ratio(s.median_cost_ratio_vs_standard),
        ]);
    }
    t
}
