//! What the snapshots that let a pipeline restart without a worker lost without warning cost:
//! the same 1F1B pipeline (4 local workers, the partitioner's plan for the MLP and links of
//! bench/pipeline-schedules) with no snapshots and with a snapshot every `--every` minibatches
//! (the default of `training.pipeline.snapshot_every`), several runs of each, alternating.
//!
//! Throughput: wall time per minibatch of a whole run (snapshots are taken all along it).
//! Target, fixed before the first run: with snapshots the pipeline keeps at least 0.90× its
//! throughput without. Exit 1 when it is missed.
//!
//! Usage: `cargo bench -p proteus-agent --bench pipeline_snapshots -- [--json FILE]
//! [--every 100] [--runs 3] [--minibatches 600] [--mbit 200] [--latency-ms 2]`

mod common;

use proteus_agent::apps::mlp::{LrSchedule, MlpShape};
use proteus_agent::data;
use proteus_agent::pipeline::partition::{Link, Partitioner};
use proteus_agent::pipeline::schedule::ScheduleKind;
use proteus_agent::pipeline::stage::{Batches, DEFAULT_BUCKET_BYTES, RunConfig};
use proteus_agent::pipeline::{local, profile};
use serde_json::json;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

const WORKERS: u32 = 4;
const TARGET_THROUGHPUT_RATIO: f64 = 0.90;
const LAYERS: [usize; 9] = [784, 512, 512, 256, 256, 512, 128, 128, 10];
const BATCH: usize = 64;

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bench/pipeline-snapshots failed: {e}");
            ExitCode::from(2)
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn run() -> Result<ExitCode, String> {
    let (mut json_out, mut every, mut runs, mut minibatches, mut mbit, mut latency_ms) =
        (None, 100u64, 3usize, 600u64, 200.0f64, 2.0f64);
    let mut it = std::env::args().skip(1).filter(|a| a != "--bench");
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        let num = |v: String, name: &str| v.parse::<f64>().map_err(|_| format!("{name}: {v}?"));
        match a.as_str() {
            "--json" => json_out = Some(value("--json")?),
            "--every" => every = num(value("--every")?, "--every")? as u64,
            "--runs" => runs = num(value("--runs")?, "--runs")? as usize,
            "--minibatches" => minibatches = num(value("--minibatches")?, "--minibatches")? as u64,
            "--mbit" => mbit = num(value("--mbit")?, "--mbit")?,
            "--latency-ms" => latency_ms = num(value("--latency-ms")?, "--latency-ms")?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if every == 0 || runs == 0 || minibatches == 0 {
        return Err("--every, --runs and --minibatches must be positive".into());
    }
    let shape = MlpShape::new(LAYERS.to_vec()).map_err(|e| e.to_string())?;
    let (train, _) =
        data::load_mnist(Path::new(common::DATA_DIR)).map_err(|e| format!("MNIST: {e}"))?;
    let train = Arc::new(train);
    let link = Link::new(mbit * 1e6 / 8.0, latency_ms / 1e3);
    let prof = profile::profile(&shape, BATCH, 10, WORKERS as usize);
    let plan = Partitioner::solve(&prof, link, WORKERS as usize)
        .exact(WORKERS as usize)
        .cloned()
        .ok_or("the partitioner found no plan")?;
    println!(
        "MLP {:?}, {WORKERS} workers, links {mbit} Mbit/s with {latency_ms} ms, {minibatches} \
         minibatches per run, {runs} runs each; plan {plan}; load average {}",
        shape.widths(),
        common::load_average()
    );
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for r in 0..runs {
        for snapshot_every in [0, every] {
            let cfg = RunConfig {
                shape: shape.clone(),
                plan: plan.clone(),
                schedule: ScheduleKind::OneFOneB,
                batches: Batches::new(train.len(), BATCH, 1),
                minibatches,
                lr: LrSchedule::constant(0.01),
                momentum: 0.9,
                seed: 7,
                checkpoint_every: 0,
                replans: Default::default(),
                warn_at: None,
                drain_at: None,
                join_at: None,
                snapshot_every,
                kill_at: None,
                allreduce_bucket_bytes: DEFAULT_BUCKET_BYTES,
                vertical_sync: false,
            };
            let out = local::run(cfg, train.clone(), Some(link)).map_err(|e| e.to_string())?;
            let ms = out.wall_secs * 1e3 / minibatches as f64;
            println!(
                "  run {}: snapshots every {snapshot_every}: {ms:.2} ms/minibatch",
                r + 1
            );
            if snapshot_every == 0 {
                &mut without
            } else {
                &mut with
            }
            .push(ms);
        }
    }
    let (ms_without, ms_with) = (median(without), median(with));
    let ratio = ms_without / ms_with;
    let met = ratio >= TARGET_THROUGHPUT_RATIO;
    println!(
        "median {ms_without:.2} ms/minibatch without snapshots, {ms_with:.2} with one every \
         {every}: throughput {ratio:.3}x (target >= {TARGET_THROUGHPUT_RATIO}) {}",
        if met { "met" } else { "MISSED" }
    );
    if let Some(path) = json_out {
        let doc = json!({
            "snapshot_every": every,
            "runs": runs,
            "minibatches": minibatches,
            "link_mbit_per_sec": mbit,
            "latency_ms": latency_ms,
            "ms_per_minibatch_without": ms_without,
            "ms_per_minibatch_with": ms_with,
            "throughput_ratio": ratio,
            "target_throughput_ratio": TARGET_THROUGHPUT_RATIO,
            "met": met,
        });
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&doc).unwrap_or_default(),
        )
        .map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(if met {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
