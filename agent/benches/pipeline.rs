//! Pipeline parallelism (PipeDream 1F1B, weight stashing, profiled partitioner) against data
//! parallelism (ring all-reduce of the whole model every step) on the same 4 workers and the same
//! bandwidth-limited links: time to the target MNIST test accuracy, samples per second, the plan,
//! and the partitioner's predicted time per minibatch against the measured one.
//!
//! Every worker is its own tokio runtime and TCP endpoint on loopback; each connection is limited
//! by a token bucket (both directions together) to `--mbit` Mbit/s. Same model, per-worker
//! minibatch, learning rate and momentum for both; the test accuracy is evaluated afterwards
//! from checkpoints the stages record in memory (no evaluation on the clock).
//!
//! Usage: `cargo bench -p proteus-agent --bench pipeline -- [--json FILE] [--mbit B]
//! [--layers 784,512,512,512,10] [--batch 64] [--pipeline-epochs E] [--dp-epochs E]`

mod common;

use proteus_agent::apps::mlp::{self, LrSchedule, MlpShape};
use proteus_agent::data;
use proteus_agent::pipeline::partition::{self, Link, Partitioner};
use proteus_agent::pipeline::profile;
use proteus_agent::pipeline::schedule::ScheduleKind;
use proteus_agent::pipeline::stage::{Batches, RunConfig};
use proteus_agent::pipeline::{Plan, local};
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

const WORKERS: u32 = 4;
const TARGET_ACCURACY: f64 = 0.97;
const TARGET_SPEEDUP: f64 = 2.0;
const TARGET_PREDICTION_ERROR: f64 = 0.20;
const TARGET_DP_EXCHANGE_RATIO: f64 = 2.0;

struct Args {
    json: Option<String>,
    mbit: f64,
    layers: Vec<usize>,
    batch: usize,
    pipeline_epochs: u64,
    dp_epochs: u64,
    lr: f32,
    momentum: f32,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        json: None,
        mbit: 200.0,
        layers: vec![784, 512, 512, 512, 10],
        batch: 64,
        pipeline_epochs: 3,
        dp_epochs: 4,
        lr: 0.02,
        momentum: 0.9,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--json" => a.json = Some(val("--json")?),
            "--mbit" => a.mbit = val("--mbit")?.parse().map_err(|e| format!("--mbit: {e}"))?,
            "--layers" => {
                a.layers = val("--layers")?
                    .split(',')
                    .map(|s| s.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .map_err(|e| format!("--layers: {e}"))?
            }
            "--batch" => {
                a.batch = val("--batch")?
                    .parse()
                    .map_err(|e| format!("--batch: {e}"))?
            }
            "--pipeline-epochs" => {
                a.pipeline_epochs = val("--pipeline-epochs")?
                    .parse()
                    .map_err(|e| format!("--pipeline-epochs: {e}"))?
            }
            "--dp-epochs" => {
                a.dp_epochs = val("--dp-epochs")?
                    .parse()
                    .map_err(|e| format!("--dp-epochs: {e}"))?
            }
            "--lr" => a.lr = val("--lr")?.parse().map_err(|e| format!("--lr: {e}"))?,
            "--bench" => {} // cargo bench passes this
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(a)
}

/// What one mode's run measured.
struct Measured {
    secs_to_target: Option<f64>,
    final_accuracy: f64,
    samples_per_sec: f64,
    /// Steady state: wall time between the first and last checkpoint per minibatch.
    ms_per_minibatch: f64,
    wall_secs: f64,
    compute_secs_per_worker: f64,
}

#[allow(clippy::too_many_arguments)]
fn run_mode(
    name: &str,
    plan: Plan,
    shape: &MlpShape,
    args: &Args,
    epochs: u64,
    train: &Arc<data::ImageSet>,
    test: &data::ImageSet,
    link: f64,
) -> Result<Measured, String> {
    let batches = Batches::new(train.len(), args.batch, 1);
    let per_epoch = batches.per_epoch();
    let minibatches = per_epoch * epochs;
    let every = (per_epoch / 8).max(1);
    let cfg = RunConfig {
        shape: shape.clone(),
        plan,
        schedule: ScheduleKind::OneFOneB,
        batches: batches.clone(),
        minibatches,
        lr: LrSchedule::constant(args.lr),
        momentum: args.momentum,
        seed: 7,
        checkpoint_every: every,
        replans: Default::default(),
        warn_at: None,
        allreduce_bucket_bytes: proteus_agent::pipeline::stage::DEFAULT_BUCKET_BYTES,
    };
    println!(
        "{name}: {} for {epochs} epochs ({minibatches} minibatches of {})",
        cfg.plan, args.batch
    );
    let run = local::run(cfg, train.clone(), Some(Link::new(link, 0.0))).map_err(|e| format!("{name}: {e}"))?;
    let cps = run.checkpoints.complete();
    let mut secs_to_target = None;
    for cp in &cps {
        let acc = mlp::accuracy(&cp.layers, test);
        let t = cp.at.duration_since(run.started).as_secs_f64();
        println!(
            "  {name}: after minibatch {:>6} (epoch {:.2}) at {t:7.1} s: test accuracy {acc:.4}",
            cp.minibatch + 1,
            (cp.minibatch + 1) as f64 / per_epoch as f64
        );
        if acc >= TARGET_ACCURACY {
            secs_to_target = Some(t);
            break;
        }
    }
    let final_accuracy = mlp::accuracy(&run.model(), test);
    let samples: u64 = (0..minibatches).map(|m| batches.rows(m).len() as u64).sum();
    let ms_per_minibatch = match (cps.first(), cps.last()) {
        (Some(a), Some(b)) if b.minibatch > a.minibatch => {
            b.at.duration_since(a.at).as_secs_f64() * 1e3 / (b.minibatch - a.minibatch) as f64
        }
        _ => run.wall_secs * 1e3 / minibatches as f64,
    };
    let compute: f64 = run.outcomes.iter().map(|o| o.compute_secs).sum();
    Ok(Measured {
        secs_to_target,
        final_accuracy,
        samples_per_sec: samples as f64 / run.wall_secs,
        ms_per_minibatch,
        wall_secs: run.wall_secs,
        compute_secs_per_worker: compute / run.outcomes.len().max(1) as f64,
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

fn run() -> Result<ExitCode, String> {
    let args = parse_args()?;
    let shape = MlpShape::new(args.layers.clone()).map_err(|e| e.to_string())?;
    let (train, test) =
        data::load_mnist(Path::new(common::DATA_DIR)).map_err(|e| format!("MNIST: {e}"))?;
    let train = Arc::new(train);
    let link = args.mbit * 1e6 / 8.0;
    println!(
        "MLP {:?} ({} parameters, {:.2} MB), minibatch {} per worker, lr {} momentum {}, {WORKERS} workers, \
         links {} Mbit/s ({:.2} MB/s per connection, both directions together); load average {}",
        shape.widths(),
        shape.params(),
        shape.params() as f64 * 4.0 / 1e6,
        args.batch,
        args.lr,
        args.momentum,
        args.mbit,
        link / 1e6,
        common::load_average()
    );

    // Profile with all emulated workers computing at once: they share this machine's cores.
    let prof = profile::profile(&shape, args.batch, 10, WORKERS as usize);
    for (l, p) in prof.layers.iter().enumerate() {
        println!(
            "  profile layer {l}: forward {:.2} ms, backward {:.2} ms, activation {} KB, params {} KB",
            p.forward_secs * 1e3,
            p.backward_secs * 1e3,
            p.activation_bytes / 1000,
            p.param_bytes / 1000
        );
    }
    let link_model = Link {
        latency_secs: 0.0,
        bytes_per_sec: link,
    };
    let part = Partitioner::solve(&prof, link_model, WORKERS as usize);
    for m in 1..=WORKERS as usize {
        if let Some(p) = part.exact(m) {
            println!("  plan for {m} worker(s): {p}");
        }
    }
    let plan = part
        .exact(WORKERS as usize)
        .cloned()
        .ok_or("partitioner found no plan")?;
    let dp_pred = partition::data_parallel_secs(&prof, link_model, WORKERS as usize);
    let bound = partition::round_trip_bound_secs(&prof, link_model, plan.stages());
    let predicted = partition::predicted_1f1b_secs(&prof, link_model, plan.stages());
    println!("pipeline plan: {plan}");
    println!(
        "  predicted per minibatch: slowest stage or link (PipeDream's objective) {:.2} ms, 1F1B round-trip bound {:.2} ms: predicted {:.2} ms",
        plan.predicted_secs * 1e3,
        bound * 1e3,
        predicted * 1e3
    );
    println!(
        "data parallelism modelled at {:.2} ms/minibatch ({:.2} ms per step of {WORKERS} minibatches)",
        dp_pred * 1e3,
        dp_pred * 1e3 * f64::from(WORKERS)
    );
    let predicted_ms = predicted * 1e3;

    let pipe = run_mode(
        "pipeline",
        plan,
        &shape,
        &args,
        args.pipeline_epochs,
        &train,
        &test,
        link,
    )?;
    let dp = run_mode(
        "data-parallel",
        Plan::data_parallel(shape.layers(), WORKERS, dp_pred),
        &shape,
        &args,
        args.dp_epochs,
        &train,
        &test,
        link,
    )?;

    // Data parallelism's step: compute per worker vs the rest (the exchange).
    let dp_steps = (dp.wall_secs * 1e3 / dp.ms_per_minibatch / f64::from(WORKERS)).max(1.0);
    let dp_compute_step = dp.compute_secs_per_worker / dp_steps;
    let dp_step = dp.ms_per_minibatch * f64::from(WORKERS) / 1e3;
    let exchange_ratio = (dp_step - dp_compute_step) / dp_compute_step.max(1e-9);
    for (name, m) in [("pipeline", &pipe), ("data-parallel", &dp)] {
        println!(
            "{name}: {} to {:.0}% test accuracy, {:.0} samples/s, {:.2} ms/minibatch measured, final accuracy {:.4}, wall {:.1} s",
            m.secs_to_target
                .map_or("not reached".to_string(), |s| format!("{s:.1} s")),
            TARGET_ACCURACY * 100.0,
            m.samples_per_sec,
            m.ms_per_minibatch,
            m.final_accuracy,
            m.wall_secs
        );
    }
    println!(
        "data parallelism: {:.1} ms per step exchanging vs {:.1} ms computing: ratio {:.2} (target >= {TARGET_DP_EXCHANGE_RATIO})",
        (dp_step - dp_compute_step) * 1e3,
        dp_compute_step * 1e3,
        exchange_ratio
    );
    let error = (predicted_ms - pipe.ms_per_minibatch).abs() / pipe.ms_per_minibatch;
    println!(
        "pipeline time per minibatch: predicted {predicted_ms:.2} ms, measured {:.2} ms: error {:.0}% (target <= {:.0}%: ratio {:.2} of the allowed error)",
        pipe.ms_per_minibatch,
        error * 100.0,
        TARGET_PREDICTION_ERROR * 100.0,
        error / TARGET_PREDICTION_ERROR
    );
    let Some(p_secs) = pipe.secs_to_target else {
        return Err("the pipeline did not reach the target accuracy".into());
    };
    // Not reaching the target is a lower bound on data parallelism's time.
    let (d_secs, bound) = match dp.secs_to_target {
        Some(s) => (s, ""),
        None => (
            dp.wall_secs,
            " (lower bound: data parallelism did not reach the target)",
        ),
    };
    let speedup = d_secs / p_secs;
    println!(
        "time-to-accuracy speedup: {speedup:.2}x{bound} (target >= {TARGET_SPEEDUP}: ratio {:.2}); throughput ratio {:.2}x; link {} Mbit/s",
        speedup / TARGET_SPEEDUP,
        pipe.samples_per_sec / dp.samples_per_sec,
        args.mbit
    );
    let met = |ok: bool| if ok { "met" } else { "NOT met" };
    let targets = [
        speedup >= TARGET_SPEEDUP,
        error <= TARGET_PREDICTION_ERROR,
        exchange_ratio >= TARGET_DP_EXCHANGE_RATIO,
    ];
    println!(
        "targets: speedup {}; prediction {}; data-parallel exchange >= 2x compute {}",
        met(targets[0]),
        met(targets[1]),
        met(targets[2])
    );
    if let Some(path) = &args.json {
        let dp_secs = dp.secs_to_target.unwrap_or(dp.wall_secs);
        let json = serde_json::json!({
            "pipeline": {"secs_to_target": p_secs, "samples_per_sec": pipe.samples_per_sec},
            "data_parallel": {"secs_to_target": dp_secs, "samples_per_sec": dp.samples_per_sec},
            "speedup": speedup,
            "link_mbit_per_sec": args.mbit,
            "predicted_ms_per_minibatch": predicted_ms,
            "measured_ms_per_minibatch": pipe.ms_per_minibatch,
        });
        std::fs::write(path, json.to_string()).map_err(|e| format!("{path}: {e}"))?;
    }
    // The exit says whether the targets were met: 0 all met, 1 one missed or the run failed.
    if targets.iter().all(|&ok| ok) {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("bench/pipeline: a target was missed (see `NOT met` above)");
        Ok(ExitCode::from(1))
    }
}
