//! Stragglers under BSP, BSP+RR, SSP and SSP+RR (FlexRR): MLR on MNIST and MF on
//! MovieTweetings, 8 paced worker processes (helper groups of 2) and 2 parameter-server shards,
//! real agent processes on loopback, four straggler patterns.
//!
//! Every worker is *paced*: it computes at a fixed rate of samples per second (its share of a
//! clock takes 0.5 s), well below a core, and sleeps for the rest; a slowed worker's rate is
//! divided by its slowdown, and everything an agent computes (its own range, chunks it takes
//! over) shares its budget, so helping costs the helper. A paced worker whose computation takes
//! longer than its budget does not sleep: a CPU shortage slows it as it would a real machine.
//!
//! Patterns:
//! - `none`;
//! - `persistent`: the worker of the last rank is 3× slower throughout;
//! - `transient`: each clock, each worker is 4× slower with probability 0.1 (drawn from the
//!   seed, the rank and the clock);
//! - `disrupted`: real CPU contention, no injected sleep. Every agent process is a *machine*
//!   of 0.2 cores (a cgroup CPU quota of its own, 20 ms per 100 ms) and computes as fast as that
//!   allows (unpaced; a clock is a whole epoch so that it takes a while); from a quarter to three
//!   quarters of the clocks one machine (one that serves no shard) has a third of that. Helping
//!   costs a helper its own CPU, and everything on the disrupted machine slows, its answers to
//!   helpers included. Its reference is the same machines undisturbed (printed as `machines`).
//!   MLR only: an MF epoch of the 100k-rating set takes a few milliseconds of CPU, so an
//!   unpaced MF clock is all synchronisation and a CPU shortage has nothing to slow.
//!
//! Figures per run: seconds per clock (from the first clock done to the job's completion), the
//! ratio to the same model without stragglers (`ratio_to_none`), to BSP under the same pattern
//! (`ratio_to_bsp`) and to the balanced bound (`ratio_to_balanced`), the final accuracy (MLR)
//! or held-out RMSE (MF), and the metric against wall time, evaluated every 2 clocks off the
//! training path (20 points in 40 clocks, plus the final one).
//!
//! The balanced bound is the fastest no-straggler run of the app (over every model; for
//! `disrupted`, the fastest `machines` run) times the mean over clocks of `n / Σ speeds`, the
//! speeds being the pattern's: what a perfect balancer of the remaining capacity would take.
//! The disrupted machine's speed over its window is the one BSP measured (BSP waits for it
//! every clock), since the kernel enforces a quota only to within a scheduler tick. Slack does not enter it: slack changes when a worker
//! may start a clock, not how much work there is or how fast the machines are, so no model
//! with any slack can beat the bound; slack (like RR) only helps reach it.
//!
//! Usage: `cargo bench -p proteus-agent --bench straggler -- [--json FILE] [--plots DIR]
//! [--clocks N] [--apps mlr,mf] [--patterns none,persistent,transient,disrupted]
//! [--repeats N]` (runs per cell, default 3; the figures are medians).
//! `disrupted` needs root (a cgroup per agent) and runs its own reference (`machines`);
//! `persistent` and `transient` need `none` in the same run.

mod common;

use common::cpu_limit::CpuLimit;
use common::plot::{Line, Panel};
use proteus_agent::straggler::Pace;
use proteus_agent::testing::TestCoordinator;
use proteus_wire::Tier;
use proteus_wire::agent_api::{
    AppConfig, ImageDataset, StopCondition, StragglerInjection, StragglerPattern, SyncModel,
    TrainingConfig,
};
use proteus_wire::coordinator::{JobState, JobStatus};
use std::process::ExitCode;
use std::time::{Duration, Instant};

const WORKERS: usize = 8;
const HELPERS: u32 = 2;
/// Seconds a worker's share of a clock takes at its pace, undisturbed.
const SHARE_SECS: f64 = 0.5;
const EVAL_EVERY_CLOCKS: u32 = 2;
const SEED: u64 = 11;
const PERSISTENT_SLOWDOWN: f64 = 3.0;
const TRANSIENT_PROBABILITY: f64 = 0.1;
const TRANSIENT_SLOWDOWN: f64 = 4.0;
/// CPU of each machine (agent process) in the disrupted pattern and its reference.
const MACHINE_CORES: f64 = 0.2;
/// The disrupted machine has this many times less CPU over its window.
const DISRUPTION: f64 = 3.0;
const BOUND_TARGET: f64 = 1.10;
const SPEEDUP_TARGET: f64 = 1.5;

#[derive(Clone, Copy, PartialEq, Debug)]
enum App {
    Mlr,
    Mf,
}

impl App {
    fn name(self) -> &'static str {
        match self {
            App::Mlr => "mlr",
            App::Mf => "mf",
        }
    }
    fn config(self) -> AppConfig {
        match self {
            App::Mlr => AppConfig::Mlr {
                dataset: ImageDataset::Mnist,
                learning_rate: 1.0,
                l2: 0.0,
            },
            App::Mf => AppConfig::Mf {
                ratings_file: "movietweetings-100k.csv.gz".into(),
                rank: 10,
                learning_rate: 0.01,
                l2: 0.05,
                holdout_fraction: 0.1,
            },
        }
    }
    /// MLR: 3,000 of MNIST's 60,000 images per clock; MF: 9,000 of the ~90,000 training
    /// ratings per clock (as the cluster test trains it; an MF sample is far cheaper than an
    /// image, so its pace is higher).
    /// On CPU-capped machines (unpaced) a clock is a whole epoch.
    fn clocks_per_epoch(self, machines: bool) -> u32 {
        match (self, machines) {
            (_, true) => 1,
            (App::Mlr, false) => 20,
            (App::Mf, false) => 10,
        }
    }
    fn training_samples(self) -> f64 {
        match self {
            App::Mlr => 60_000.0,
            App::Mf => 90_000.0,
        }
    }
    /// Samples per second per worker: a worker's share of a clock in [`SHARE_SECS`].
    fn pace(self) -> f64 {
        self.training_samples()
            / f64::from(self.clocks_per_epoch(false))
            / WORKERS as f64
            / SHARE_SECS
    }
    fn metric(self) -> &'static str {
        match self {
            App::Mlr => "test accuracy",
            App::Mf => "held-out RMSE",
        }
    }
    fn higher_is_better(self) -> bool {
        self == App::Mlr
    }
    /// Whether the app is measured on CPU-capped machines (the disrupted pattern). MF is not:
    /// an epoch of the 100k-rating set takes a few milliseconds of CPU, so an unpaced MF clock
    /// is all synchronisation and a CPU shortage has nothing to slow.
    fn runs_on_machines(self) -> bool {
        self == App::Mlr
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Pattern {
    None,
    Persistent,
    Transient,
    Disrupted,
    /// The disrupted pattern's reference: the same CPU-capped machines, undisturbed. Run
    /// before `disrupted`; not a row of its own in the JSON.
    Machines,
}

impl Pattern {
    const ALL: [Pattern; 4] = [
        Pattern::None,
        Pattern::Persistent,
        Pattern::Transient,
        Pattern::Disrupted,
    ];
    fn name(self) -> &'static str {
        match self {
            Pattern::None => "none",
            Pattern::Persistent => "persistent",
            Pattern::Transient => "transient",
            Pattern::Disrupted => "disrupted",
            Pattern::Machines => "machines",
        }
    }
    fn on_machines(self) -> bool {
        matches!(self, Pattern::Disrupted | Pattern::Machines)
    }
    /// The pattern whose runs this one's `ratio_to_none` is taken against.
    fn reference(self) -> Pattern {
        if self.on_machines() {
            Pattern::Machines
        } else {
            Pattern::None
        }
    }
    fn injection(self) -> StragglerPattern {
        match self {
            Pattern::None | Pattern::Disrupted | Pattern::Machines => StragglerPattern::None,
            Pattern::Persistent => StragglerPattern::Persistent {
                rank: WORKERS as u32 - 1,
                slowdown: PERSISTENT_SLOWDOWN,
            },
            Pattern::Transient => StragglerPattern::Transient {
                probability: TRANSIENT_PROBABILITY,
                slowdown: TRANSIENT_SLOWDOWN,
            },
        }
    }
}

/// The clocks during which the disrupted worker is capped: `[clocks/4, 3·clocks/4)`.
fn disruption_window(clocks: u64) -> (u64, u64) {
    (clocks / 4, clocks * 3 / 4)
}

#[derive(Clone, Copy)]
struct Model {
    /// `bsp`, `bsp+rr`, `ssp` or `ssp+rr`.
    name: &'static str,
    slack: u32,
    sync: SyncModel,
}

impl Model {
    fn label(&self) -> String {
        if self.slack == 0 {
            self.name.to_string()
        } else {
            format!("{} s{}", self.name, self.slack)
        }
    }
    fn is_flexrr(&self) -> bool {
        self.name == "ssp+rr"
    }
}

fn models() -> Vec<Model> {
    let rr = |slack| SyncModel::Flexrr {
        slack,
        helpers: HELPERS,
    };
    vec![
        Model {
            name: "bsp",
            slack: 0,
            sync: SyncModel::Bsp,
        },
        Model {
            name: "bsp+rr",
            slack: 0,
            sync: rr(0),
        },
        Model {
            name: "ssp",
            slack: 1,
            sync: SyncModel::Ssp { slack: 1 },
        },
        Model {
            name: "ssp",
            slack: 2,
            sync: SyncModel::Ssp { slack: 2 },
        },
        Model {
            name: "ssp+rr",
            slack: 1,
            sync: rr(1),
        },
        Model {
            name: "ssp+rr",
            slack: 2,
            sync: rr(2),
        },
    ]
}

fn config(app: App, pattern: Pattern, sync: SyncModel, clocks: u64) -> TrainingConfig {
    let mut cfg = TrainingConfig::new(app.config());
    cfg.num_shards = 2;
    // 16 items per worker and clock: the unit a helper takes over.
    cfg.num_partitions = 128;
    cfg.clocks_per_epoch = app.clocks_per_epoch(pattern.on_machines());
    cfg.stop = StopCondition::Clocks { clocks };
    cfg.eval_every_clocks = EVAL_EVERY_CLOCKS;
    cfg.min_workers = WORKERS as u32;
    cfg.seed = SEED;
    cfg.sync = sync;
    cfg.stragglers = StragglerInjection {
        pattern: pattern.injection(),
        pace_samples_per_sec: (!pattern.on_machines()).then(|| app.pace()),
    };
    cfg
}

/// `n / Σ speeds`, averaged over the clocks: how much longer than without stragglers a perfect
/// balancer of this pattern's capacity takes.
/// `disruption`: how many times slower the disrupted worker is over its window.
fn balanced_factor(cfg: &TrainingConfig, pattern: Pattern, disruption: f64) -> f64 {
    let pace = Pace::new(cfg.stragglers, 1.0, cfg.seed);
    let clocks = cfg.total_clocks();
    let (from, to) = disruption_window(clocks);
    let n = WORKERS as f64;
    let mut sum = 0.0;
    for c in 0..clocks {
        let speeds: f64 = if pattern == Pattern::Disrupted {
            if (from..to).contains(&c) {
                n - 1.0 + 1.0 / disruption
            } else {
                n
            }
        } else {
            (0..WORKERS as u32).map(|r| 1.0 / pace.slowdown(r, c)).sum()
        };
        sum += n / speeds;
    }
    sum / clocks as f64
}

struct Run {
    app: App,
    pattern: Pattern,
    model: Model,
    secs: f64,
    secs_per_clock: f64,
    final_metric: f64,
    /// The metric of a trivial predictor (majority class, global mean rating).
    baseline: Option<f64>,
    /// (seconds since the first clock, metric) at each evaluation seen.
    curve: Vec<(f64, f64)>,
    /// Mean CPU (cores) used by the workers that serve no shard, over the run.
    worker_cpu: f64,
    /// The disrupted machine, for the disrupted pattern.
    disrupted: Option<String>,
}

/// Workers that serve no shard, by instance id: the candidates for a disruption, whose CPU
/// is the worker's alone.
fn shardless_workers(st: &JobStatus) -> Vec<String> {
    let mut v: Vec<String> = st
        .members
        .iter()
        .filter(|m| {
            m.roles.worker.is_some()
                && m.roles.active_shards.is_empty()
                && m.roles.backup_shards.is_empty()
        })
        .map(|m| m.instance_id.0.clone())
        .collect();
    v.sort();
    v
}

async fn one_run(app: App, pattern: Pattern, model: Model, clocks: u64) -> Result<Run, String> {
    let what = format!("{} / {} / {}", app.name(), pattern.name(), model.label());
    let cfg = config(app, pattern, model.sync, clocks);
    let names: Vec<String> = (1..=WORKERS).map(|i| format!("s{i}")).collect();
    let tokens: Vec<(String, String)> = names
        .iter()
        .map(|n| (format!("tok-{n}"), n.clone()))
        .collect();
    let specs: Vec<(&str, &str, Tier)> = tokens
        .iter()
        .map(|(t, n)| (t.as_str(), n.as_str(), Tier::Transient))
        .collect();
    let coord = TestCoordinator::start(cfg, &specs)
        .await
        .map_err(|e| format!("{what}: coordinator: {e}"))?;
    let mut procs = Vec::new();
    for n in &names {
        procs.push((n.clone(), common::spawn_agent(&coord.url(), n, 2000).await));
    }
    let first = coord
        .wait_for(Duration::from_secs(180), |s| {
            s.state == JobState::Running && s.progress.clock >= 1
        })
        .await
        .ok_or_else(|| format!("{what}: training never started"))?;
    // Machines get their CPU once training runs (loading the data set is not measured).
    let mut machines = Vec::new();
    if pattern.on_machines() {
        for (n, p) in &procs {
            let l = CpuLimit::new(&format!("proteus-bench-{n}"), p.0.id())?;
            l.set(MACHINE_CORES)?;
            machines.push((n.clone(), l));
        }
    }
    let t0 = Instant::now();
    // Roles as training runs (a completed job's members hold none).
    let workers = shardless_workers(&first);
    let cpu0: Vec<f64> = procs
        .iter()
        .map(|(_, p)| common::proc_cpu_seconds(&p.0.id().to_string()))
        .collect();
    let (from, to) = disruption_window(clocks);
    let victim = (pattern == Pattern::Disrupted)
        .then(|| workers.last().cloned())
        .flatten();
    if pattern == Pattern::Disrupted && victim.is_none() {
        return Err(format!("{what}: every worker serves a shard"));
    }
    let limit_of = |name: &str| machines.iter().find(|(n, _)| n == name).map(|(_, l)| l);
    let (mut capped, mut restored) = (false, false);
    let mut curve = Vec::new();
    let mut last_clock = None;
    let deadline = t0 + Duration::from_secs(60 + clocks * 15);
    let done = loop {
        let st = coord.status();
        if let Some(m) = st.latest_metric
            && last_clock != Some(m.clock)
        {
            last_clock = Some(m.clock);
            curve.push((t0.elapsed().as_secs_f64(), m.value));
        }
        if let Some(l) = victim.as_deref().and_then(limit_of) {
            if !capped && st.progress.clock >= from {
                l.set(MACHINE_CORES / DISRUPTION)?;
                capped = true;
            } else if capped && !restored && st.progress.clock >= to {
                l.set(MACHINE_CORES)?;
                restored = true;
            }
        }
        if st.state == JobState::Completed {
            break st;
        }
        if st.state == JobState::Cancelled || Instant::now() > deadline {
            return Err(format!("{what}: job did not complete: {st:#?}"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let secs = t0.elapsed().as_secs_f64();
    let used: Vec<f64> = procs
        .iter()
        .zip(&cpu0)
        .filter(|((n, _), _)| workers.contains(n))
        .map(|((_, p), c0)| common::proc_cpu_seconds(&p.0.id().to_string()) - c0)
        .collect();
    let worker_cpu = used.iter().sum::<f64>() / used.len().max(1) as f64 / secs;
    let (final_metric, baseline) = done
        .final_metric
        .map(|m| (m.value, m.baseline))
        .ok_or_else(|| format!("{what}: no final metric"))?;
    curve.push((secs, final_metric));
    // The processes first (killed and reaped), then their emptied groups.
    drop(procs);
    drop(machines);
    Ok(Run {
        app,
        pattern,
        model,
        secs,
        secs_per_clock: secs / (clocks - 1) as f64,
        final_metric,
        baseline,
        curve,
        worker_cpu,
        disrupted: victim,
    })
}

/// The median of repeated runs of one cell: the run of median time (its curve and machine),
/// with the median time and the median final metric.
fn median_run(mut reps: Vec<Run>) -> Run {
    let mut secs: Vec<f64> = reps.iter().map(|r| r.secs).collect();
    let mut finals: Vec<f64> = reps.iter().map(|r| r.final_metric).collect();
    let (secs, final_metric) = (common::median(&mut secs), common::median(&mut finals));
    reps.sort_by(|a, b| a.secs.total_cmp(&b.secs));
    let mid = reps.len() / 2;
    let mut run = reps.swap_remove(mid);
    run.secs_per_clock *= secs / run.secs;
    run.secs = secs;
    run.final_metric = final_metric;
    run
}

/// The metric of `curve` at time `t` (the last evaluation at or before it; None before the
/// first).
fn at(curve: &[(f64, f64)], t: f64) -> Option<f64> {
    curve
        .iter()
        .take_while(|(s, _)| *s <= t + 1e-9)
        .last()
        .map(|(_, a)| *a)
}

fn list<T: Copy>(
    arg: Option<String>,
    all: &[T],
    name: impl Fn(T) -> &'static str,
) -> Result<Vec<T>, String> {
    let Some(arg) = arg else {
        return Ok(all.to_vec());
    };
    arg.split(',')
        .map(|w| {
            all.iter()
                .copied()
                .find(|x| name(*x) == w.trim())
                .ok_or_else(|| {
                    let names: Vec<&str> = all.iter().map(|x| name(*x)).collect();
                    format!("unknown {w:?}; one of {}", names.join(", "))
                })
        })
        .collect()
}

struct Args {
    json: Option<String>,
    plots: Option<String>,
    clocks: u64,
    apps: Vec<App>,
    patterns: Vec<Pattern>,
    /// Runs per cell; the figures are their medians.
    repeats: usize,
}

fn parse_args() -> Result<Args, String> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let clocks = match arg("--clocks").map(|c| c.parse::<u64>()) {
        None => 40,
        Some(Ok(c)) if c >= 8 => c,
        Some(_) => return Err("--clocks must be a number >= 8".into()),
    };
    let apps =
        list(arg("--apps"), &[App::Mlr, App::Mf], App::name).map_err(|e| format!("--apps: {e}"))?;
    let patterns = list(arg("--patterns"), &Pattern::ALL, Pattern::name)
        .map_err(|e| format!("--patterns: {e}"))?;
    let paced = |p: &Pattern| matches!(p, Pattern::Persistent | Pattern::Transient);
    if patterns.iter().any(paced) && !patterns.contains(&Pattern::None) {
        return Err(
            "--patterns: persistent and transient need none (their ratios are to it)".into(),
        );
    }
    let repeats = match arg("--repeats").map(|c| c.parse::<usize>()) {
        None => 3,
        Some(Ok(n)) if (1..=9).contains(&n) => n,
        Some(_) => return Err("--repeats must be a number from 1 to 9".into()),
    };
    Ok(Args {
        repeats,
        json: arg("--json"),
        plots: arg("--plots"),
        clocks,
        apps,
        patterns,
    })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench/straggler: {e}");
            return ExitCode::from(2);
        }
    };
    if args.patterns.contains(&Pattern::Disrupted)
        && let Err(e) = CpuLimit::new("proteus-bench-preflight", std::process::id())
    {
        eprintln!("bench/straggler: the disrupted pattern cannot cap a process's CPU here: {e}");
        return ExitCode::from(2);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench/straggler: no runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let clocks = args.clocks;
    let mut runs: Vec<Run> = Vec::new();
    // The disrupted pattern's reference runs just before it.
    let patterns: Vec<Pattern> = args
        .patterns
        .iter()
        .flat_map(|&p| {
            if p == Pattern::Disrupted {
                vec![Pattern::Machines, p]
            } else {
                vec![p]
            }
        })
        .collect();
    for &app in &args.apps {
        for &pattern in &patterns {
            if !app.runs_on_machines() && pattern.on_machines() {
                continue;
            }
            for model in models() {
                let mut reps = Vec::new();
                for _ in 0..args.repeats {
                    let r = match rt.block_on(one_run(app, pattern, model, clocks)) {
                        Ok(r) => r,
                        Err(e) => {
                            eprintln!("bench/straggler: a run failed: {e}");
                            return ExitCode::from(2);
                        }
                    };
                    eprintln!(
                        "  {:<4} {:<10} {:<10} {:.3} s/clock, {} {:.4}, worker CPU {:.3} cores{} (load average {})",
                        app.name(),
                        pattern.name(),
                        model.label(),
                        r.secs_per_clock,
                        app.metric(),
                        r.final_metric,
                        r.worker_cpu,
                        r.disrupted
                            .as_ref()
                            .map(|w| format!(", {w} disrupted"))
                            .unwrap_or_default(),
                        common::load_average()
                    );
                    reps.push(r);
                }
                runs.push(median_run(reps));
            }
        }
    }
    report(&args, &runs)
}

fn report(args: &Args, runs: &[Run]) -> ExitCode {
    let clocks = args.clocks;
    // As run: the machines reference where disrupted was asked for.
    let mut patterns: Vec<Pattern> = Vec::new();
    for r in runs {
        if !patterns.contains(&r.pattern) {
            patterns.push(r.pattern);
        }
    }
    let find = |app: App, pattern: Pattern, name: &str, slack: u32| {
        runs.iter().find(|r| {
            r.app == app && r.pattern == pattern && r.model.name == name && r.model.slack == slack
        })
    };
    println!(
        "straggler benchmark: {WORKERS} worker processes (paced: a worker's share of a clock takes {SHARE_SECS} s), helper groups of {HELPERS}, 2 shards, {clocks} clocks, evaluated every {EVAL_EVERY_CLOCKS} clocks; medians of {} run(s) per cell",
        args.repeats
    );
    println!(
        "patterns: persistent = last rank {PERSISTENT_SLOWDOWN}x slower; transient = {TRANSIENT_SLOWDOWN}x with p = {TRANSIENT_PROBABILITY} per worker and clock; disrupted = unpaced machines of {MACHINE_CORES} cores each (cgroup quotas; a clock is an epoch), one shard-less machine at 1/{DISRUPTION} of that over clocks {:?}; machines = the same undisturbed",
        disruption_window(clocks)
    );
    // The disrupted machine's real slowdown over its window, by BSP's time (BSP waits for it
    // every clock): the kernel enforces a quota only to within a tick, so the bound uses this,
    // not the nominal figure.
    let disruption = |app: App| {
        let (b, n) = (
            find(app, Pattern::Disrupted, "bsp", 0)?,
            find(app, Pattern::Machines, "bsp", 0)?,
        );
        let (from, to) = disruption_window(clocks);
        let window = (to - from) as f64 * n.secs_per_clock;
        Some(1.0 + (b.secs - n.secs).max(0.0) / window)
    };
    // The balanced bound, seconds per clock.
    let bound = |app: App, pattern: Pattern| {
        let best_none = runs
            .iter()
            .filter(|r| r.app == app && r.pattern == pattern.reference())
            .map(|r| r.secs_per_clock)
            .fold(f64::INFINITY, f64::min);
        let f = if pattern == Pattern::Disrupted {
            disruption(app).unwrap_or(f64::NAN)
        } else {
            1.0
        };
        best_none * balanced_factor(&config(app, pattern, SyncModel::Bsp, clocks), pattern, f)
    };
    let mut rows = Vec::new();
    let mut all_met = true;
    let mut panels_by_app = Vec::new();
    for &app in &args.apps {
        let best_none = bound(app, Pattern::None);
        let trivial = runs
            .iter()
            .find(|r| r.app == app)
            .and_then(|r| r.baseline)
            .map_or("?".into(), |b| format!("{b:.4}"));
        println!(
            "\n{} ({}, a trivial predictor's {trivial}; pace {:.0} samples/s per worker; fastest no-straggler run {best_none:.3} s/clock)",
            app.name(),
            app.metric(),
            app.pace()
        );
        println!(
            "{:<11} {:<10} {:>8} {:>9} {:>9} {:>9} {:>9} {:>14}",
            "pattern", "model", "s/clock", "to_none", "to_bal", "to_bsp", "final", "at equal time"
        );
        let mut panels = Vec::new();
        for &pattern in &patterns {
            let these: Vec<&Run> = runs
                .iter()
                .filter(|r| r.app == app && r.pattern == pattern)
                .collect();
            if these.is_empty() {
                continue;
            }
            // Equal wall time: when the fastest model of this pattern finished.
            let t_eq = these.iter().map(|r| r.secs).fold(f64::INFINITY, f64::min);
            let bsp = find(app, pattern, "bsp", 0).map_or(f64::NAN, |r| r.secs_per_clock);
            for r in &these {
                let none = find(app, pattern.reference(), r.model.name, r.model.slack)
                    .map_or(f64::NAN, |n| n.secs_per_clock);
                let to_none = r.secs_per_clock / none;
                let to_bal = r.secs_per_clock / bound(app, pattern);
                let to_bsp = r.secs_per_clock / bsp;
                let eq = at(&r.curve, t_eq);
                println!(
                    "{:<11} {:<10} {:>8.3} {:>9.3} {:>9.3} {:>9.3} {:>9.4} {:>14}",
                    pattern.name(),
                    r.model.label(),
                    r.secs_per_clock,
                    to_none,
                    to_bal,
                    to_bsp,
                    r.final_metric,
                    eq.map_or("-".into(), |m| format!("{m:.4}"))
                );
                if pattern == Pattern::Machines {
                    continue;
                }
                let (acc, loss) = match app {
                    App::Mlr => (Some(r.final_metric), None),
                    App::Mf => (None, Some(r.final_metric)),
                };
                rows.push(serde_json::json!({
                    "pattern": pattern.name(),
                    "model": r.model.name,
                    "slack": r.model.slack,
                    "workers": WORKERS,
                    "app": app.name(),
                    "ratio_to_balanced": to_bal,
                    "ratio_to_none": to_none,
                    "ratio_to_bsp": to_bsp,
                    "final_accuracy": acc,
                    "final_loss": loss,
                }));
            }
            if pattern == Pattern::Disrupted {
                println!(
                    "  disrupted: the quota made the machine {:.2}x slower over its window by BSP's time (nominal {DISRUPTION}x); the bound uses the measured figure",
                    disruption(app).unwrap_or(f64::NAN)
                );
            }
            panels.push(Panel {
                title: pattern.name().to_string(),
                lines: these
                    .iter()
                    .map(|r| Line {
                        label: r.model.label(),
                        points: r.curve.clone(),
                    })
                    .collect(),
            });
        }
        if !app.runs_on_machines() && args.patterns.contains(&Pattern::Disrupted) {
            println!(
                "  disrupted: not measured for {}: an epoch takes a few milliseconds of CPU, so an unpaced clock is all synchronisation and a CPU shortage has nothing to slow",
                app.name()
            );
        }
        panels_by_app.push((app, panels));
    }
    println!("\ntargets (every ssp+rr row):");
    for &app in &args.apps {
        for &pattern in &args.patterns {
            for r in runs
                .iter()
                .filter(|r| r.app == app && r.pattern == pattern && r.model.is_flexrr())
            {
                let to_bal = r.secs_per_clock / bound(app, pattern);
                let mut checks = vec![(
                    format!("ratio_to_balanced {to_bal:.3} <= {BOUND_TARGET}"),
                    to_bal <= BOUND_TARGET,
                )];
                if pattern == Pattern::Persistent {
                    let speedup = find(app, pattern, "bsp", 0)
                        .map_or(f64::NAN, |b| b.secs_per_clock / r.secs_per_clock);
                    checks.push((
                        format!("{speedup:.2}x faster than bsp, >= {SPEEDUP_TARGET}x"),
                        speedup >= SPEEDUP_TARGET,
                    ));
                }
                for (what, ok) in checks {
                    all_met &= ok;
                    println!(
                        "  {:<4} {:<11} {:<10} {what}: {}",
                        app.name(),
                        pattern.name(),
                        r.model.label(),
                        if ok { "met" } else { "NOT MET" }
                    );
                }
            }
        }
    }
    println!(
        "all targets {}; load average {}",
        if all_met { "met" } else { "NOT met" },
        common::load_average()
    );
    if let Some(dir) = &args.plots {
        for (app, panels) in &panels_by_app {
            let path = std::path::Path::new(dir).join(format!("straggler-{}.svg", app.name()));
            let title = format!(
                "{}: {} against wall time ({WORKERS} workers, {clocks} clocks)",
                app.name(),
                app.metric()
            );
            if let Err(e) = std::fs::create_dir_all(dir)
                .map_err(|e| e.to_string())
                .and_then(|()| {
                    common::plot::panels(
                        &path,
                        &title,
                        "seconds since the first clock",
                        app.metric(),
                        2,
                        !app.higher_is_better(),
                        panels,
                    )
                })
            {
                eprintln!("bench/straggler: {e}");
                return ExitCode::FAILURE;
            }
            println!("wrote {}", path.display());
        }
    }
    if let Some(file) = &args.json {
        let doc = serde_json::json!({ "runs": rows });
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        if let Err(e) = std::fs::write(file, text + "\n") {
            eprintln!("bench/straggler: cannot write {file}: {e}");
            return ExitCode::FAILURE;
        }
        println!("wrote {file}");
    }
    // The exit says whether the targets were met: 0 all met, 1 one missed (2: bad arguments or
    // a failed run).
    if all_met {
        ExitCode::SUCCESS
    } else {
        eprintln!("bench/straggler: a target was missed (see `NOT MET` above)");
        ExitCode::from(1)
    }
}
