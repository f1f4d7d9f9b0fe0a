//! Pipeline parallelism (PipeDream: 1F1B, weight stashing, a partitioner that minimises its own
//! prediction) against tuned data parallelism (bucketed ring all-reduce overlapped with the
//! backward pass) on the same 4 workers and the same emulated links, swept over bandwidths:
//! time to the target MNIST test accuracy for each mode, the plan chosen, and the predicted
//! against the measured time per minibatch.
//!
//! - **Workers:** every worker is its own `proteus-agent pipeline-worker` process with its own
//!   TCP endpoint on loopback (`pipeline::processes`). Each connection is limited by a token
//!   bucket (both directions together) to the sweep's rate and delays every message by the
//!   latency.
//! - **Model:** an MLP of 8 uneven layers (`--layers`), so that the plan is not one layer per
//!   stage and where the cuts fall matters.
//! - **Learning rates:** each mode gets its own, chosen from the same grid by test accuracy
//!   after one epoch on the fastest link (reported; the one sweep for both, so neither is
//!   tuned on the other's behalf); the grid is widened while a mode's best is at its edge.
//! - **The cost model, calibrated as the workers run:** the layers are profiled first (all
//!   emulated workers computing at once); then, at every bandwidth, the plan the profile gives
//!   runs a warm-up of half an epoch (`--warmup-minibatches`), and the model is fitted to what
//!   the workers measured (`pipeline::calibration`: each layer's compute scale, and processor
//!   time per byte of messages); a plan the calibrated model then picks that no warm-up ran is
//!   warmed up too and the model refitted to every warm-up (at most 3 rounds). The sweep's
//!   plans are chosen on, and predicted by, the calibrated model; the static profile's
//!   prediction of the same plan is printed beside.
//! - **Runs:** the pipeline trains up to `--epochs` epochs; data parallelism as many, but at
//!   most `--dp-budget-secs` of predicted time (a run that does not reach the target in it
//!   gives a lower bound on the speed-up, said so). Test accuracy is evaluated afterwards from
//!   checkpoints, 8 per epoch (no evaluation on the clock).
//!
//! Targets: prediction within 20% of measured at every bandwidth; at the slowest bandwidth the
//! pipeline reaches the target accuracy at least 2× sooner than data parallelism. Exit 1 when
//! one is missed.
//!
//! Usage: `cargo bench -p proteus-agent --bench pipeline -- [--json FILE]
//! [--mbit 50,100,200,400,1000] [--latency-ms 2] [--layers 784,512,...,10] [--batch 64]
//! [--epochs 3] [--dp-budget-secs 240] [--lrs 0.01,0.02,0.05,0.1] [--warmup-minibatches N]`

mod common;

use proteus_agent::apps::mlp::{self, LrSchedule, MlpShape};
use proteus_agent::data;
use proteus_agent::pipeline::Plan;
use proteus_agent::pipeline::calibration::{self, Warmup};
use proteus_agent::pipeline::partition::{self, Link, Partitioner};
use proteus_agent::pipeline::processes::{self, DataSet, ProcessSpec};
use proteus_agent::pipeline::profile::{self, Profile};
use proteus_agent::pipeline::schedule::ScheduleKind;
use proteus_agent::pipeline::stage::{Batches, DEFAULT_BUCKET_BYTES};
use serde_json::json;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

const WORKERS: u32 = 4;
const TARGET_ACCURACY: f64 = 0.97;
const TARGET_SPEEDUP: f64 = 2.0;
const TARGET_PREDICTION_ERROR: f64 = 0.20;
const CHECKPOINTS_PER_EPOCH: u64 = 8;

struct Args {
    json: Option<String>,
    mbits: Vec<f64>,
    latency_ms: f64,
    layers: Vec<usize>,
    batch: usize,
    epochs: u64,
    dp_budget_secs: f64,
    lrs: Vec<f64>,
    momentum: f32,
    /// Minibatches of each warm-up run (0: half an epoch).
    warmup_minibatches: u64,
}

fn list<T: std::str::FromStr>(name: &str, v: &str) -> Result<Vec<T>, String>
where
    T::Err: std::fmt::Display,
{
    v.split(',')
        .map(|s| {
            s.trim()
                .parse::<T>()
                .map_err(|e| format!("{name} `{s}`: {e}"))
        })
        .collect()
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        json: None,
        mbits: vec![50.0, 100.0, 200.0, 400.0, 1000.0],
        latency_ms: 2.0,
        layers: vec![784, 512, 512, 256, 256, 512, 128, 128, 10],
        batch: 64,
        epochs: 3,
        dp_budget_secs: 240.0,
        lrs: vec![0.01, 0.02, 0.05, 0.1],
        momentum: 0.9,
        warmup_minibatches: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--json" => a.json = Some(val("--json")?),
            "--mbit" => a.mbits = list("--mbit", &val("--mbit")?)?,
            "--latency-ms" => {
                a.latency_ms = val("--latency-ms")?
                    .parse()
                    .map_err(|e| format!("--latency-ms: {e}"))?
            }
            "--layers" => a.layers = list("--layers", &val("--layers")?)?,
            "--batch" => {
                a.batch = val("--batch")?
                    .parse()
                    .map_err(|e| format!("--batch: {e}"))?
            }
            "--epochs" => {
                a.epochs = val("--epochs")?
                    .parse()
                    .map_err(|e| format!("--epochs: {e}"))?
            }
            "--dp-budget-secs" => {
                a.dp_budget_secs = val("--dp-budget-secs")?
                    .parse()
                    .map_err(|e| format!("--dp-budget-secs: {e}"))?
            }
            "--lrs" => a.lrs = list("--lrs", &val("--lrs")?)?,
            "--warmup-minibatches" => {
                a.warmup_minibatches = val("--warmup-minibatches")?
                    .parse()
                    .map_err(|e| format!("--warmup-minibatches: {e}"))?
            }
            "--bench" => {} // cargo bench passes this
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if a.mbits.is_empty()
        || a.lrs.is_empty()
        || a.mbits.iter().any(|m| *m <= 0.0)
        || a.lrs.iter().any(|l| !(*l > 0.0 && l.is_finite()))
    {
        return Err("--mbit and --lrs need at least one value, every one positive".into());
    }
    Ok(a)
}

/// What one run measured.
struct Measured {
    secs_to_target: Option<f64>,
    final_accuracy: f64,
    /// Test accuracy at the first checkpoint of the second epoch or later (tuning's criterion:
    /// after one epoch).
    accuracy_after_one_epoch: f64,
    /// Steady state: wall time between the first and last checkpoint per minibatch.
    ms_per_minibatch: f64,
    wall_secs: f64,
    /// Per stage of the plan: its replicas' computing seconds per minibatch, summed.
    stage_compute_secs: Vec<f64>,
}

struct Data {
    train: Arc<data::ImageSet>,
    test: data::ImageSet,
}

#[allow(clippy::too_many_arguments)]
fn run_mode(
    name: &str,
    plan: Plan,
    shape: &MlpShape,
    args: &Args,
    lr: f64,
    minibatches: u64,
    data: &Data,
    link: Link,
) -> Result<Measured, String> {
    let per_epoch = Batches::new(data.train.len(), args.batch, 1).per_epoch();
    let every = (per_epoch / CHECKPOINTS_PER_EPOCH).max(1);
    let spec = ProcessSpec {
        data: DataSet::Mnist,
        data_dir: Path::new(common::DATA_DIR).to_path_buf(),
        widths: shape.widths().to_vec(),
        stages: plan.stages().to_vec(),
        predicted_secs: plan.predicted_secs,
        schedule: ScheduleKind::OneFOneB,
        batch: args.batch,
        batch_seed: 1,
        minibatches,
        lr: LrSchedule::constant(lr as f32),
        momentum: args.momentum,
        seed: 7,
        checkpoint_every: every,
        snapshot_every: 0,
        allreduce_bucket_bytes: DEFAULT_BUCKET_BYTES,
        vertical_sync: false,
        link: Some((link.bytes_per_sec, link.latency_secs)),
    };
    println!(
        "  {name}: {plan} at lr {lr}, {minibatches} minibatches ({:.2} epochs) of {}",
        minibatches as f64 / per_epoch as f64,
        args.batch
    );
    let agent = Path::new(env!("CARGO_BIN_EXE_proteus-agent"));
    let run = processes::run(agent, &spec).map_err(|e| format!("{name}: {e}"))?;
    let cps = run.checkpoints.complete();
    let mut secs_to_target = None;
    let mut after_one = None;
    for cp in &cps {
        let acc = mlp::accuracy(&cp.layers, &data.test);
        let t = cp.at.duration_since(run.started).as_secs_f64();
        if cp.minibatch + 1 >= per_epoch && after_one.is_none() {
            after_one = Some(acc);
        }
        if acc >= TARGET_ACCURACY && secs_to_target.is_none() {
            secs_to_target = Some(t);
            println!(
                "    {name}: {:.0}% after minibatch {} (epoch {:.2}) at {t:.1} s",
                TARGET_ACCURACY * 100.0,
                cp.minibatch + 1,
                (cp.minibatch + 1) as f64 / per_epoch as f64
            );
        }
    }
    let final_accuracy = mlp::accuracy(&run.model(), &data.test);
    let ms_per_minibatch = match (cps.first(), cps.last()) {
        (Some(a), Some(b)) if b.minibatch > a.minibatch => {
            b.at.duration_since(a.at).as_secs_f64() * 1e3 / (b.minibatch - a.minibatch) as f64
        }
        _ => run.wall_secs * 1e3 / minibatches as f64,
    };
    // Where the time goes: each worker's computing time per minibatch of the run.
    let busy: Vec<String> = run
        .outcomes
        .iter()
        .map(|o| format!("{:.2}", o.compute_secs * 1e3 / minibatches as f64))
        .collect();
    println!(
        "    {name}: {:.2} ms/minibatch, final accuracy {final_accuracy:.4}, wall {:.1} s; \
         computing per minibatch by worker (ms): {}",
        ms_per_minibatch,
        run.wall_secs,
        busy.join(", ")
    );
    let mut stage_compute_secs = vec![0.0; plan.stages().len()];
    for o in &run.outcomes {
        if let Some(s) = stage_compute_secs.get_mut(o.stage) {
            *s += o.compute_secs / minibatches as f64;
        }
    }
    Ok(Measured {
        secs_to_target,
        final_accuracy,
        accuracy_after_one_epoch: after_one.unwrap_or(final_accuracy),
        ms_per_minibatch,
        wall_secs: run.wall_secs,
        stage_compute_secs,
    })
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bench/pipeline failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn link(args: &Args, mbit: f64) -> Link {
    Link::new(mbit * 1e6 / 8.0, args.latency_ms / 1e3)
}

/// Most rates added beyond the grid's edges while tuning one mode.
const MAX_WIDENINGS: usize = 4;

/// Most rounds of warm-ups while calibrating the cost model.
const WARMUP_ROUNDS: usize = 3;

/// The learning rate whose one-epoch run is most accurate, every result, and whether that rate
/// lies inside the rates tried. The grid is widened (halving below its lowest rate, doubling
/// above its highest) while the best is at an edge, at most [`MAX_WIDENINGS`] times.
#[allow(clippy::too_many_arguments)]
fn tune(
    name: &str,
    plan: &Plan,
    shape: &MlpShape,
    args: &Args,
    data: &Data,
    link: Link,
    per_epoch: u64,
) -> Result<(f64, bool, Vec<serde_json::Value>), String> {
    let mut tried: Vec<(f64, f64)> = Vec::new();
    let mut rows = Vec::new();
    let mut try_rate = |lr: f64, tried: &mut Vec<(f64, f64)>| -> Result<(), String> {
        let m = run_mode(name, plan.clone(), shape, args, lr, per_epoch, data, link)?;
        println!(
            "  tuning {name}: lr {lr}: test accuracy {:.4} after one epoch",
            m.accuracy_after_one_epoch
        );
        rows.push(
            json!({"mode": name, "lr": lr, "accuracy_after_one_epoch": m.accuracy_after_one_epoch}),
        );
        tried.push((lr, m.accuracy_after_one_epoch));
        tried.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(())
    };
    for &lr in &args.lrs {
        try_rate(lr, &mut tried)?;
    }
    let best = |tried: &[(f64, f64)]| {
        tried
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.1.total_cmp(&b.1.1))
            .map(|(i, &(lr, _))| (i, lr))
            .unwrap_or((0, args.lrs[0]))
    };
    let inside = |i: usize, tried: &[(f64, f64)]| i > 0 && i + 1 < tried.len();
    for _ in 0..MAX_WIDENINGS {
        let (i, lr) = best(&tried);
        if inside(i, &tried) {
            break;
        }
        let next = if i == 0 { lr / 2.0 } else { lr * 2.0 };
        println!("  tuning {name}: the best rate {lr} is at the grid's edge: trying {next}");
        try_rate(next, &mut tried)?;
    }
    let (i, lr) = best(&tried);
    Ok((lr, inside(i, &tried), rows))
}

fn run() -> Result<ExitCode, String> {
    let args = parse_args()?;
    let shape = MlpShape::new(args.layers.clone()).map_err(|e| e.to_string())?;
    let (train, test) =
        data::load_mnist(Path::new(common::DATA_DIR)).map_err(|e| format!("MNIST: {e}"))?;
    let data = Data {
        train: Arc::new(train),
        test,
    };
    let per_epoch = Batches::new(data.train.len(), args.batch, 1).per_epoch();
    println!(
        "MLP {:?}: {} layers, {} parameters ({:.2} MB), minibatch {} per worker, momentum {}, \
         {WORKERS} workers; links {:?} Mbit/s with {} ms latency; load average {}",
        shape.widths(),
        shape.layers(),
        shape.params(),
        shape.params() as f64 * 4.0 / 1e6,
        args.batch,
        args.momentum,
        args.mbits,
        args.latency_ms,
        common::load_average()
    );

    // Profile with all emulated workers computing at once: they share this machine's cores.
    let prof = profile::profile(&shape, args.batch, 10, WORKERS as usize);
    for (l, p) in prof.layers.iter().enumerate() {
        println!(
            "  profile layer {l}: forward {:.2} ms, backward {:.2} ms, update {:.2} ms, activation {} KB, params {} KB",
            p.forward_secs * 1e3,
            p.backward_secs * 1e3,
            p.update_secs * 1e3,
            p.activation_bytes / 1000,
            p.param_bytes / 1000
        );
    }
    let plan_for = |prof: &Profile, l: Link| -> Result<Plan, String> {
        Partitioner::solve(prof, l, WORKERS as usize)
            .exact(WORKERS as usize)
            .cloned()
            .ok_or_else(|| "the partitioner found no plan".to_string())
    };
    let dp_plan = |l: Link| {
        Plan::data_parallel(
            shape.layers(),
            WORKERS,
            partition::data_parallel_secs(&prof, l, WORKERS as usize),
        )
    };

    // Learning rates: one grid, one criterion, both modes, on the fastest link.
    let fastest = args.mbits.iter().copied().fold(f64::MIN, f64::max);
    let fast = link(&args, fastest);
    println!("tuning the learning rates at {fastest} Mbit/s: test accuracy after one epoch");
    let (pipe_lr, pipe_inside, mut tuning) = tune(
        "pipeline",
        &plan_for(&prof, fast)?,
        &shape,
        &args,
        &data,
        fast,
        per_epoch,
    )?;
    let (dp_lr, dp_inside, dp_rows) = tune(
        "data-parallel",
        &dp_plan(fast),
        &shape,
        &args,
        &data,
        fast,
        per_epoch,
    )?;
    tuning.extend(dp_rows);
    let edge = |inside: bool| {
        if inside {
            "inside the rates tried"
        } else {
            "at an edge"
        }
    };
    println!(
        "learning rates: pipeline {pipe_lr} ({}), data parallelism {dp_lr} ({})",
        edge(pipe_inside),
        edge(dp_inside)
    );

    // The cost model calibrated from warm-ups: the profile's plan at every bandwidth first;
    // then, while the calibrated model picks a plan no warm-up ran, that plan too (at most
    // WARMUP_ROUNDS rounds), each round refitting the model to every warm-up so far.
    let warmup_minibatches = if args.warmup_minibatches == 0 {
        (per_epoch / 2).max(1)
    } else {
        args.warmup_minibatches
    };
    println!(
        "warm-up: {warmup_minibatches} minibatches of a plan at a time, to calibrate the cost \
         model (the profile's plan at every bandwidth, then any plan the calibrated model picks \
         that no warm-up ran; at most {WARMUP_ROUNDS} rounds)"
    );
    let mut warmups: Vec<Warmup> = Vec::new();
    let mut warmup_mbits: Vec<f64> = Vec::new();
    for round in 0..WARMUP_ROUNDS {
        let model = if warmups.is_empty() {
            prof.clone()
        } else {
            calibration::calibrate(&prof, &warmups)
                .map_err(|e| e.to_string())?
                .profile
        };
        let mut ran = false;
        for &mbit in &args.mbits {
            let l = link(&args, mbit);
            let plan = plan_for(&model, l)?;
            if warmups
                .iter()
                .any(|w| w.link == l && w.stages.as_slice() == plan.stages())
            {
                continue;
            }
            ran = true;
            let m = run_mode(
                "warm-up",
                plan.clone(),
                &shape,
                &args,
                pipe_lr,
                warmup_minibatches,
                &data,
                l,
            )?;
            println!(
                "  warm-up round {round} at {mbit} Mbit/s: {plan}: measured {:.2} ms/minibatch, \
                 the profile predicted {:.2}; computing per stage (ms): {}",
                m.ms_per_minibatch,
                partition::predicted_1f1b_secs(&prof, l, plan.stages()) * 1e3,
                m.stage_compute_secs
                    .iter()
                    .map(|s| format!("{:.2}", s * 1e3))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            warmups.push(Warmup {
                link: l,
                stages: plan.stages().to_vec(),
                stage_compute_secs: m.stage_compute_secs,
                secs_per_minibatch: m.ms_per_minibatch / 1e3,
            });
            warmup_mbits.push(mbit);
        }
        if !ran {
            break;
        }
    }
    let cal = calibration::calibrate(&prof, &warmups).map_err(|e| e.to_string())?;
    println!(
        "calibrated: {:.2} ns of processor time per byte of messages; compute scale per layer {}; \
         warm-ups fitted within {}",
        cal.profile.message_secs_per_byte * 1e9,
        cal.compute_scale
            .iter()
            .map(|k| format!("{k:.2}"))
            .collect::<Vec<_>>()
            .join(", "),
        cal.fitted
            .iter()
            .map(|(p, m)| format!("{:+.0}%", (p / m - 1.0) * 100.0))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let warmup_json: Vec<serde_json::Value> = warmups
        .iter()
        .zip(&warmup_mbits)
        .zip(&cal.fitted)
        .map(|((w, mbit), (fit, _))| {
            json!({
                "link_mbit_per_sec": mbit,
                "stages": w.stages.len(),
                "measured_ms_per_minibatch": w.secs_per_minibatch * 1e3,
                "profile_predicted_ms_per_minibatch":
                    partition::predicted_1f1b_secs(&prof, w.link, &w.stages) * 1e3,
                "calibrated_ms_per_minibatch": fit * 1e3,
                "stage_compute_ms": w.stage_compute_secs.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
            })
        })
        .collect();

    let mut sweep = Vec::new();
    let mut errors = Vec::new();
    let mut slow_end = None;
    let slowest = args.mbits.iter().copied().fold(f64::MAX, f64::min);
    for &mbit in &args.mbits {
        let l = link(&args, mbit);
        let plan = plan_for(&cal.profile, l)?;
        let predicted_ms = plan.predicted_secs * 1e3;
        let static_ms = partition::predicted_1f1b_secs(&prof, l, plan.stages()) * 1e3;
        let warmed = warmups
            .iter()
            .any(|w| w.link == l && w.stages.as_slice() == plan.stages());
        // Data parallelism's budget in the profile's predicted time, as before calibration.
        let dp_pred = partition::data_parallel_secs(&prof, l, WORKERS as usize);
        println!(
            "{mbit} Mbit/s, {} ms: plan {plan} ({}) predicted {predicted_ms:.2} ms/minibatch by \
             the calibrated model ({static_ms:.2} by the profile alone); data parallelism \
             predicted {:.2} ms/minibatch",
            args.latency_ms,
            if warmed {
                "a warm-up ran it"
            } else {
                "no warm-up ran it"
            },
            dp_pred * 1e3
        );
        let epochs = per_epoch * args.epochs;
        let pipe = run_mode(
            "pipeline",
            plan.clone(),
            &shape,
            &args,
            pipe_lr,
            epochs,
            &data,
            l,
        )?;
        // Data parallelism: as many epochs, within the budget of predicted time.
        let budget =
            ((args.dp_budget_secs / dp_pred.max(1e-6)) as u64).clamp(per_epoch / 4, epochs);
        let dp = run_mode(
            "data-parallel",
            dp_plan(l),
            &shape,
            &args,
            dp_lr,
            budget,
            &data,
            l,
        )?;
        let error = (predicted_ms - pipe.ms_per_minibatch).abs() / pipe.ms_per_minibatch;
        errors.push((mbit, error));
        let (speedup, bound) = match (pipe.secs_to_target, dp.secs_to_target) {
            (Some(p), Some(d)) => (Some(d / p), false),
            // Data parallelism did not get there in its run: its run's length bounds it.
            (Some(p), None) => (Some(dp.wall_secs / p), true),
            (None, _) => (None, false),
        };
        let fmt = |s: Option<f64>| s.map_or("not reached".to_string(), |s| format!("{s:.1} s"));
        println!(
            "  {mbit} Mbit/s: to {:.0}%: pipeline {}, data parallelism {}{}; speed-up {}; \
             per minibatch predicted {predicted_ms:.2} ms, measured {:.2} ms (error {:.0}%); \
             final accuracy {:.4} / {:.4}",
            TARGET_ACCURACY * 100.0,
            fmt(pipe.secs_to_target),
            fmt(dp.secs_to_target),
            if dp.secs_to_target.is_none() {
                format!(" (ran {:.1} s)", dp.wall_secs)
            } else {
                String::new()
            },
            speedup.map_or("-".to_string(), |s| format!(
                "{}{s:.2}x",
                if bound { ">= " } else { "" }
            )),
            pipe.ms_per_minibatch,
            error * 100.0,
            pipe.final_accuracy,
            dp.final_accuracy
        );
        if mbit == slowest {
            slow_end = Some((speedup, bound));
        }
        sweep.push(json!({
            "link_mbit_per_sec": mbit,
            "latency_ms": args.latency_ms,
            "pipeline_s_to_target": pipe.secs_to_target,
            "dp_s_to_target": dp.secs_to_target,
            "dp_reached_target": dp.secs_to_target.is_some(),
            "speedup": speedup,
            "predicted_ms_per_minibatch": predicted_ms,
            "profile_predicted_ms_per_minibatch": static_ms,
            "plan_warmed_up": warmed,
            "measured_ms_per_minibatch": pipe.ms_per_minibatch,
            "dp_predicted_ms_per_minibatch": dp_pred * 1e3,
            "dp_measured_ms_per_minibatch": dp.ms_per_minibatch,
            "layers": shape.layers(),
            "stages": plan.stages().len(),
            "replicated_stages": plan.stages().iter().filter(|s| s.replicas > 1).count(),
        }));
    }

    let worst = errors
        .iter()
        .copied()
        .fold((0.0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
    let prediction_ok = worst.1 <= TARGET_PREDICTION_ERROR;
    println!(
        "prediction: worst error {:.0}% (at {} Mbit/s; target <= {:.0}%: ratio {:.2} of the allowed)",
        worst.1 * 100.0,
        worst.0,
        TARGET_PREDICTION_ERROR * 100.0,
        worst.1 / TARGET_PREDICTION_ERROR
    );
    let speedup_ok = match slow_end {
        Some((Some(s), bound)) => {
            println!(
                "speed-up to {:.0}% at {slowest} Mbit/s: {}{s:.2}x (target >= {TARGET_SPEEDUP}: ratio {:.2})",
                TARGET_ACCURACY * 100.0,
                if bound { ">= " } else { "" },
                s / TARGET_SPEEDUP
            );
            s >= TARGET_SPEEDUP
        }
        _ => {
            println!("speed-up at {slowest} Mbit/s: the pipeline did not reach the target");
            false
        }
    };
    let met = |ok: bool| if ok { "met" } else { "NOT met" };
    println!(
        "targets: prediction within 20% at every bandwidth {}; >= 2x at the slow end {}",
        met(prediction_ok),
        met(speedup_ok)
    );
    if let Some(path) = &args.json {
        let out = json!({
            "sweep": sweep,
            "dp_learning_rate": dp_lr,
            "pipeline_learning_rate": pipe_lr,
            "pipeline_learning_rate_inside_grid": pipe_inside,
            "dp_learning_rate_inside_grid": dp_inside,
            "learning_rate_sweep": tuning,
            "workers": "processes",
            "warmup_minibatches": warmup_minibatches,
            "warmup": warmup_json,
            "message_ns_per_byte": cal.profile.message_secs_per_byte * 1e9,
            "compute_scale": cal.compute_scale,
        });
        let text = serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("{path}: {e}"))?;
    }
    if prediction_ok && speedup_ok {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("bench/pipeline: a target was missed (see `NOT met` above)");
        Ok(ExitCode::from(1))
    }
}
