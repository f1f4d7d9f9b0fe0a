//! Pipeline schedules against each other: PipeDream's 1F1B with weight stashing, 1F1B with
//! vertical sync, and PipeDream-2BW (double-buffered weights: 1F1B's order, one optimizer step
//! per group of minibatches, two weight versions per stage), on the same 4 workers, links,
//! model, data and learning rate.
//!
//! For each schedule and plan it measures:
//! - **weight memory:** the most copies of its stage's weights each worker held at once
//!   (current, stashed for backward passes, kept for vertical sync), and their bytes summed over
//!   the workers (activations stashed are the same for the three: one per minibatch in flight);
//! - **throughput:** the median, over the intervals between checkpoints, of the wall time per
//!   minibatch;
//! - **training:** time to the target MNIST test accuracy and the final accuracy.
//!
//! Two plans: the partitioner's at the link (`--mbit`, `--latency-ms`), and the deepest, four
//! single stages, where 1F1B stashes the most versions.
//!
//! Targets, fixed before the first run: 2BW holds at most two weight copies at every stage; its
//! weight memory is below 1F1B's on the four-stage plan; its throughput is at least 0.95× 1F1B's
//! on both plans. Exit 1 when one is missed.
//!
//! Usage: `cargo bench -p proteus-agent --bench pipeline_schedules -- [--json FILE]
//! [--svg FILE] [--mbit 200] [--latency-ms 2] [--epochs 3] [--lr 0.01]`

mod common;

use common::plot::{Line, Panel};
use proteus_agent::apps::mlp::{self, LrSchedule, MlpShape};
use proteus_agent::data;
use proteus_agent::pipeline::partition::{Link, Partitioner};
use proteus_agent::pipeline::schedule::{ScheduleKind, two_bw_group};
use proteus_agent::pipeline::stage::{Batches, DEFAULT_BUCKET_BYTES, RunConfig};
use proteus_agent::pipeline::{Plan, StagePlan, local, profile};
use serde_json::json;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

const WORKERS: u32 = 4;
const TARGET_ACCURACY: f64 = 0.97;
const TARGET_2BW_COPIES: usize = 2;
const TARGET_THROUGHPUT_RATIO: f64 = 0.95;
const CHECKPOINTS_PER_EPOCH: u64 = 8;
const LAYERS: [usize; 9] = [784, 512, 512, 256, 256, 512, 128, 128, 10];
const BATCH: usize = 64;
const MOMENTUM: f32 = 0.9;

struct Args {
    json: Option<String>,
    svg: Option<String>,
    mbit: f64,
    latency_ms: f64,
    epochs: u64,
    lr: f64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        json: None,
        svg: None,
        mbit: 200.0,
        latency_ms: 2.0,
        epochs: 3,
        // bench/pipeline's tuned rate for the pipeline (docs/pipeline.md), for all three.
        lr: 0.01,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        let num = |name: &str, v: String| -> Result<f64, String> {
            v.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or(format!("{name} `{v}`: a positive number"))
        };
        match arg.as_str() {
            "--json" => a.json = Some(val("--json")?),
            "--svg" => a.svg = Some(val("--svg")?),
            "--mbit" => a.mbit = num("--mbit", val("--mbit")?)?,
            "--latency-ms" => a.latency_ms = num("--latency-ms", val("--latency-ms")?)?,
            "--epochs" => a.epochs = num("--epochs", val("--epochs")?)?.round().max(1.0) as u64,
            "--lr" => a.lr = num("--lr", val("--lr")?)?,
            "--bench" => {} // cargo bench passes this
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(a)
}

/// One schedule on one plan.
struct Measured {
    plan: String,
    schedule: &'static str,
    vertical_sync: bool,
    ms_per_minibatch: f64,
    copies: Vec<usize>,
    weight_bytes: usize,
    secs_to_target: Option<f64>,
    final_accuracy: f64,
    curve: Vec<(f64, f64)>,
}

struct Setup {
    shape: MlpShape,
    train: Arc<data::ImageSet>,
    test: data::ImageSet,
    link: Link,
    minibatches: u64,
    per_epoch: u64,
    lr: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn run_one(
    s: &Setup,
    plan_name: &str,
    plan: &Plan,
    schedule: ScheduleKind,
    vertical_sync: bool,
) -> Result<Measured, String> {
    let batches = Batches::new(s.train.len(), BATCH, 1);
    let every = (s.per_epoch / CHECKPOINTS_PER_EPOCH).max(1);
    let name = match (schedule, vertical_sync) {
        (ScheduleKind::TwoBW { .. }, _) => "2bw",
        (_, true) => "1f1b+vertical_sync",
        _ => "1f1b",
    };
    let cfg = RunConfig {
        shape: s.shape.clone(),
        plan: plan.clone(),
        schedule,
        batches,
        minibatches: s.minibatches,
        lr: LrSchedule::constant(s.lr as f32),
        momentum: MOMENTUM,
        seed: 7,
        checkpoint_every: every,
        replans: Default::default(),
        warn_at: None,
        drain_at: None,
        join_at: None,
        snapshot_every: 0,
        kill_at: None,
        allreduce_bucket_bytes: DEFAULT_BUCKET_BYTES,
        vertical_sync,
    };
    println!("  {plan_name} / {name}: {plan}");
    let run = local::run(cfg, s.train.clone(), Some(s.link))
        .map_err(|e| format!("{plan_name} / {name}: {e}"))?;
    let cps = run.checkpoints.complete();
    let mut curve = Vec::new();
    let mut secs_to_target = None;
    for cp in &cps {
        let acc = mlp::accuracy(&cp.layers, &s.test);
        let t = cp.at.duration_since(run.started).as_secs_f64();
        curve.push((t, acc));
        if acc >= TARGET_ACCURACY && secs_to_target.is_none() {
            secs_to_target = Some(t);
        }
    }
    let intervals: Vec<f64> = cps
        .windows(2)
        .filter(|w| w[1].minibatch > w[0].minibatch)
        .map(|w| {
            w[1].at.duration_since(w[0].at).as_secs_f64() * 1e3
                / (w[1].minibatch - w[0].minibatch) as f64
        })
        .collect();
    let ms_per_minibatch = if intervals.is_empty() {
        run.wall_secs * 1e3 / s.minibatches as f64
    } else {
        median(intervals)
    };
    // Copies per stage (the most any of its replicas held) and bytes over every worker.
    let mut copies = vec![0; plan.stages().len()];
    let mut weight_bytes = 0;
    for o in &run.outcomes {
        copies[o.stage] = copies[o.stage].max(o.max_weight_copies);
        let params: usize = o.layers.iter().map(mlp::Dense::len).sum();
        weight_bytes += o.max_weight_copies * params * 4;
    }
    let final_accuracy = mlp::accuracy(&run.model(), &s.test);
    println!(
        "    {name}: {ms_per_minibatch:.2} ms/minibatch (median), weight copies per stage \
         {copies:?} ({:.2} MB over the workers), {:.0}% at {}, final accuracy {final_accuracy:.4}",
        weight_bytes as f64 / 1e6,
        TARGET_ACCURACY * 100.0,
        secs_to_target.map_or("not reached".into(), |t| format!("{t:.1} s")),
    );
    Ok(Measured {
        plan: plan_name.to_string(),
        schedule: name,
        vertical_sync,
        ms_per_minibatch,
        copies,
        weight_bytes,
        secs_to_target,
        final_accuracy,
        curve,
    })
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bench/pipeline-schedules failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<ExitCode, String> {
    let args = parse_args()?;
    let shape = MlpShape::new(LAYERS.to_vec()).map_err(|e| e.to_string())?;
    let (train, test) =
        data::load_mnist(Path::new(common::DATA_DIR)).map_err(|e| format!("MNIST: {e}"))?;
    let per_epoch = Batches::new(train.len(), BATCH, 1).per_epoch();
    let link = Link::new(args.mbit * 1e6 / 8.0, args.latency_ms / 1e3);
    let setup = Setup {
        shape: shape.clone(),
        train: Arc::new(train),
        test,
        link,
        minibatches: per_epoch * args.epochs,
        per_epoch,
        lr: args.lr,
    };
    println!(
        "MLP {:?}, minibatch {BATCH} per worker, momentum {MOMENTUM}, lr {}, {} epochs, \
         {WORKERS} workers on links of {} Mbit/s with {} ms latency; load average {}",
        shape.widths(),
        args.lr,
        args.epochs,
        args.mbit,
        args.latency_ms,
        common::load_average()
    );
    let prof = profile::profile(&shape, BATCH, 10, WORKERS as usize);
    let partitioned = Partitioner::solve(&prof, link, WORKERS as usize)
        .exact(WORKERS as usize)
        .cloned()
        .ok_or("the partitioner found no plan")?;
    // Four stages of about equal parameters: 0..2, 2..4, 4..6, 6..8.
    let four = Plan::new(
        (0..4)
            .map(|i| StagePlan {
                layers: 2 * i..2 * i + 2,
                replicas: 1,
            })
            .collect(),
        shape.layers(),
        0.0,
    )
    .map_err(|e| e.to_string())?;
    let mut all = Vec::new();
    for (name, plan) in [("partitioned", &partitioned), ("four stages", &four)] {
        let group = two_bw_group(plan);
        println!("{name}: 2BW group {group} minibatches");
        all.push(run_one(&setup, name, plan, ScheduleKind::OneFOneB, false)?);
        all.push(run_one(&setup, name, plan, ScheduleKind::OneFOneB, true)?);
        all.push(run_one(
            &setup,
            name,
            plan,
            ScheduleKind::TwoBW { group },
            false,
        )?);
    }

    let mut missed = Vec::new();
    let mut comparisons = Vec::new();
    for plan in ["partitioned", "four stages"] {
        let get = |schedule: &str| {
            all.iter()
                .find(|m| m.plan == plan && m.schedule == schedule)
                .ok_or(format!("{plan}: no {schedule} run"))
        };
        let (base, vs, bw) = (get("1f1b")?, get("1f1b+vertical_sync")?, get("2bw")?);
        let throughput = base.ms_per_minibatch / bw.ms_per_minibatch;
        let memory = bw.weight_bytes as f64 / base.weight_bytes as f64;
        let vs_memory = vs.weight_bytes as f64 / base.weight_bytes as f64;
        let vs_throughput = base.ms_per_minibatch / vs.ms_per_minibatch;
        println!(
            "{plan}: 2BW throughput {throughput:.3}x 1F1B's (target >= {TARGET_THROUGHPUT_RATIO}), \
             weight memory {memory:.3}x, copies {:?} vs {:?} (target <= {TARGET_2BW_COPIES}); \
             vertical sync: throughput {vs_throughput:.3}x, weight memory {vs_memory:.3}x",
            bw.copies, base.copies
        );
        if throughput < TARGET_THROUGHPUT_RATIO {
            missed.push(format!("{plan}: 2BW throughput {throughput:.3}x 1F1B's"));
        }
        if bw.copies.iter().any(|&c| c > TARGET_2BW_COPIES) {
            missed.push(format!("{plan}: 2BW held {:?} weight copies", bw.copies));
        }
        if plan == "four stages" && memory >= 1.0 {
            missed.push(format!("{plan}: 2BW weight memory {memory:.3}x 1F1B's"));
        }
        comparisons.push(json!({
            "plan": plan,
            "two_bw_throughput_vs_1f1b": throughput,
            "two_bw_weight_memory_vs_1f1b": memory,
            "vertical_sync_throughput_vs_1f1b": vs_throughput,
            "vertical_sync_weight_memory_vs_1f1b": vs_memory,
        }));
    }

    if let Some(path) = &args.svg {
        let panels: Vec<Panel> = ["partitioned", "four stages"]
            .iter()
            .map(|plan| Panel {
                title: format!("{plan} plan"),
                lines: all
                    .iter()
                    .filter(|m| m.plan == *plan)
                    .map(|m| Line {
                        label: m.schedule.to_string(),
                        points: m.curve.clone(),
                    })
                    .collect(),
            })
            .collect();
        common::plot::panels(
            Path::new(path),
            &format!(
                "Pipeline schedules: MNIST test accuracy, {} Mbit/s, {} ms",
                args.mbit, args.latency_ms
            ),
            "wall time (s)",
            "test accuracy",
            2,
            false,
            &panels,
        )?;
        println!("wrote {path}");
    }
    if let Some(path) = &args.json {
        let runs: Vec<serde_json::Value> = all
            .iter()
            .map(|m| {
                json!({
                    "plan": m.plan,
                    "schedule": m.schedule,
                    "vertical_sync": m.vertical_sync,
                    "ms_per_minibatch": m.ms_per_minibatch,
                    "weight_copies_per_stage": m.copies,
                    "weight_bytes": m.weight_bytes,
                    "secs_to_target": m.secs_to_target,
                    "final_accuracy": m.final_accuracy,
                })
            })
            .collect();
        let doc = json!({
            "link_mbit_per_sec": args.mbit,
            "latency_ms": args.latency_ms,
            "learning_rate": args.lr,
            "epochs": args.epochs,
            "target_accuracy": TARGET_ACCURACY,
            "runs": runs,
            "comparisons": comparisons,
            "targets_missed": missed,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("{path}: {e}"))?;
        println!("wrote {path}");
    }
    if missed.is_empty() {
        println!("every target met");
        Ok(ExitCode::SUCCESS)
    } else {
        for m in &missed {
            println!("MISSED: {m}");
        }
        Ok(ExitCode::from(1))
    }
}
