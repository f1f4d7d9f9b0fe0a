//! Pipeline mode end to end: every worker its own runtime and TCP endpoint on loopback (threads
//! of one process, or agent processes), the real stage runtime, against single-process SGD on
//! the same minibatches.

use crate::support::log_field;
use proteus_agent::apps::mlp::{self, Dense, LrSchedule, MlpShape};
use proteus_agent::data;
use proteus_agent::pipeline::schedule::ScheduleKind;
use proteus_agent::pipeline::stage::{Batches, RunConfig, train_sgd};
use proteus_agent::pipeline::{Plan, StagePlan, local, processes};
use std::path::Path;
use std::sync::Arc;

fn plan(stages: &[(usize, usize, u32)], layers: usize) -> Plan {
    let stages = stages
        .iter()
        .map(|&(a, b, r)| StagePlan {
            layers: a..b,
            replicas: r,
        })
        .collect();
    Plan::new(stages, layers, 0.0).expect("valid plan")
}

/// Every minibatch a last stage computed the loss of, over all workers, sorted: each exactly
/// once when nothing was lost or run twice.
fn through_last_stages(run: &local::LocalRun) -> Vec<u64> {
    let mut seen: Vec<u64> = run
        .outcomes
        .iter()
        .flat_map(|o| o.minibatches.iter().copied())
        .collect();
    seen.sort_unstable();
    seen
}

fn max_rel_diff(a: &[Dense], b: &[Dense]) -> f32 {
    let (fa, fb) = (mlp::flatten(a), mlp::flatten(b));
    assert_eq!(fa.len(), fb.len());
    fa.iter()
        .zip(&fb)
        .map(|(x, y)| (x - y).abs() / (1.0 + x.abs().max(y.abs())))
        .fold(0.0, f32::max)
}

#[test]
fn flushing_pipeline_matches_single_process_sgd_step_for_step() {
    let (train, _) = data::load_digits(Path::new(super::support::DATA_DIR)).expect("digits");
    let shape = MlpShape::new(vec![64, 48, 32, 24, 10]).unwrap();
    let group = 4;
    let cfg = RunConfig {
        shape: shape.clone(),
        // Stage 0 replicated: its replicas all-reduce their gradient sums at every flush.
        plan: plan(&[(0, 2, 2), (2, 3, 1), (3, 4, 1)], 4),
        schedule: ScheduleKind::Flushing { group },
        batches: Batches::new(train.len(), 16, 3),
        minibatches: 48,
        lr: LrSchedule::constant(0.1),
        momentum: 0.9,
        seed: 11,
        checkpoint_every: group,
        replans: Default::default(),
        warn_at: None,
        drain_at: None,
        join_at: None,
        snapshot_every: 0,
        kill_at: None,
        allreduce_bucket_bytes: proteus_agent::pipeline::stage::DEFAULT_BUCKET_BYTES,
        vertical_sync: false,
    };
    let (reference, final_ref) = train_sgd(&cfg, &train, group);
    let run = local::run(cfg, Arc::new(train), None).expect("pipeline runs");
    let got = run.checkpoints.complete();
    assert_eq!(got.len(), reference.len(), "one checkpoint per step");
    let init = shape.init(11);
    for (cp, (m, want)) in got.iter().zip(&reference) {
        assert_eq!(cp.minibatch, *m);
        let d = max_rel_diff(&cp.layers, want);
        assert!(d < 1e-4, "after minibatch {m}: differs by {d}");
        assert!(max_rel_diff(&cp.layers, &init) > 1e-3, "the model trained");
    }
    assert!(max_rel_diff(&run.model(), &final_ref) < 1e-4);
    // Both replicas of stage 0 hold the same weights.
    let s0: Vec<&Vec<Dense>> = run
        .outcomes
        .iter()
        .filter(|o| o.stage == 0)
        .map(|o| &o.layers)
        .collect();
    assert_eq!(s0.len(), 2);
    assert_eq!(s0[0], s0[1]);
}

#[test]
fn one_f_one_b_with_stashing_reaches_sgd_accuracy() {
    let (train, test) = data::load_mnist(Path::new(super::support::DATA_DIR)).expect("mnist");
    let shape = MlpShape::new(vec![784, 128, 64, 10]).unwrap();
    let batches = Batches::new(train.len(), 64, 5);
    let epochs = 1;
    let minibatches = batches.per_epoch() * epochs;
    let base = RunConfig {
        shape: shape.clone(),
        plan: plan(&[(0, 3, 1)], 3),
        schedule: ScheduleKind::OneFOneB,
        batches,
        minibatches,
        // Staleness compounds with momentum: PipeDream's stages see weights up to warm-up steps
        // old, so the step size is moderate (0.05 with momentum 0.9 left 1F1B 1.3 points behind).
        lr: LrSchedule::constant(0.02),
        momentum: 0.9,
        seed: 2,
        checkpoint_every: 0,
        replans: Default::default(),
        warn_at: None,
        drain_at: None,
        join_at: None,
        snapshot_every: 0,
        kill_at: None,
        allreduce_bucket_bytes: proteus_agent::pipeline::stage::DEFAULT_BUCKET_BYTES,
        vertical_sync: false,
    };
    let (_, sgd) = train_sgd(&base, &train, 1);
    let sgd_acc = mlp::accuracy(&sgd, &test);
    let train = Arc::new(train);
    // Three single stages (warm-ups 2, 1, 0), and a replicated first stage (its replicas step
    // together with the sum of their minibatches' mean gradients): both within 0.5 points of SGD.
    for (stages, tolerance) in [
        (vec![(0, 1, 1), (1, 2, 1), (2, 3, 1)], 0.005),
        (vec![(0, 1, 2), (1, 2, 1), (2, 3, 1)], 0.005),
    ] {
        let cfg = RunConfig {
            plan: plan(&stages, 3),
            ..base.clone()
        };
        let run = local::run(cfg, train.clone(), None).expect("pipeline runs");
        let acc = mlp::accuracy(&run.model(), &test);
        eprintln!("plan {stages:?}: 1F1B {acc:.4} vs SGD {sgd_acc:.4}");
        assert!(
            (acc - sgd_acc).abs() <= tolerance,
            "plan {stages:?}: 1F1B reached {acc:.4}, SGD {sgd_acc:.4}"
        );
        // Weight stashing really kept several versions in flight at the first stage.
        let first = run.outcomes.iter().find(|o| o.stage == 0).unwrap();
        assert!(first.max_versions >= 2, "{}", first.max_versions);
        let last = run.outcomes.iter().find(|o| o.stage == 2).unwrap();
        assert_eq!(last.samples as u64, {
            let b = &base.batches;
            (0..minibatches)
                .map(|m| b.rows(m).len() as u64)
                .sum::<u64>()
        });
    }
}

#[test]
fn a_warned_stage_moves_to_the_survivors_and_no_minibatch_is_lost() {
    let (train, test) = data::load_mnist(Path::new(super::support::DATA_DIR)).expect("mnist");
    let shape = MlpShape::new(vec![784, 128, 64, 32, 10]).unwrap();
    let batches = Batches::new(train.len(), 64, 5);
    let minibatches = batches.per_epoch();
    // Four single stages; the partitioner's table would give plans like these for fewer workers.
    let replans = [
        (3, plan(&[(0, 1, 1), (1, 2, 1), (2, 4, 1)], 4)),
        (2, plan(&[(0, 2, 1), (2, 4, 1)], 4)),
        (1, plan(&[(0, 4, 1)], 4)),
    ]
    .into_iter()
    .collect();
    let base = RunConfig {
        shape: shape.clone(),
        plan: plan(&[(0, 1, 1), (1, 2, 1), (2, 3, 1), (3, 4, 1)], 4),
        schedule: ScheduleKind::OneFOneB,
        batches: batches.clone(),
        minibatches,
        lr: LrSchedule::constant(0.02),
        momentum: 0.9,
        seed: 2,
        checkpoint_every: 0,
        replans,
        warn_at: None,
        drain_at: None,
        join_at: None,
        snapshot_every: 0,
        kill_at: None,
        allreduce_bucket_bytes: proteus_agent::pipeline::stage::DEFAULT_BUCKET_BYTES,
        vertical_sync: false,
    };
    let train = Arc::new(train);
    let plain = local::run(base.clone(), train.clone(), None).expect("uninterrupted run");
    let plain_acc = mlp::accuracy(&plain.model(), &test);
    // Worker 1 (stage 1, the only holder of layer 1) is warned a third of the way in: its layer
    // moves to worker 2, whose layer moves to worker 3.
    let cfg = RunConfig {
        warn_at: Some((minibatches / 3, 1)),
        drain_at: None,
        join_at: None,
        snapshot_every: 0,
        kill_at: None,
        ..base
    };
    let run = local::run(cfg, train, None).expect("run with an eviction");
    let evicted: Vec<u32> = run
        .outcomes
        .iter()
        .filter(|o| o.evicted)
        .map(|o| o.worker)
        .collect();
    assert_eq!(evicted, [1]);
    // The survivors finished on the plan for three workers.
    let layout: Vec<(u32, usize, usize)> = run
        .outcomes
        .iter()
        .filter(|o| !o.evicted)
        .map(|o| (o.worker, o.first_layer, o.layers.len()))
        .collect();
    assert_eq!(layout, [(0, 0, 1), (2, 1, 1), (3, 2, 2)]);
    // Every minibatch went through the last stage exactly once.
    assert_eq!(
        through_last_stages(&run),
        (0..minibatches).collect::<Vec<_>>()
    );
    for o in &run.outcomes {
        eprintln!(
            "worker {} stage {} replica {} first layer {} shapes {:?} evicted {}",
            o.worker,
            o.stage,
            o.replica,
            o.first_layer,
            o.layers.iter().map(|l| l.w.dim()).collect::<Vec<_>>(),
            o.evicted
        );
    }
    let acc = mlp::accuracy(&run.model(), &test);
    let events = run.checkpoints.events();
    let notice = events
        .iter()
        .find(|e| matches!(e.0, proteus_agent::pipeline::stage::Event::Notice { .. }));
    let resumed = events
        .iter()
        .find(|e| matches!(e.0, proteus_agent::pipeline::stage::Event::Resumed { .. }));
    let (Some(n), Some(r)) = (notice, resumed) else {
        panic!("no re-plan recorded: {events:?}");
    };
    eprintln!(
        "eviction: {:?}; training again on the new plan {:.3} s after the notice; accuracy {acc:.4} vs uninterrupted {plain_acc:.4}",
        n.0,
        r.1.duration_since(n.1).as_secs_f64()
    );
    assert!((acc - plain_acc).abs() <= 0.005, "{acc} vs {plain_acc}");
}

/// Seconds of the day of the first log line containing `what` (`…THH:MM:SS.ffffffZ …`).
fn log_secs(log: &str, what: &str) -> Option<f64> {
    let line = log.lines().find(|l| l.contains(what))?;
    let time = line.split_whitespace().next()?.split_once('T')?.1;
    let mut parts = time.trim_end_matches('Z').split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

/// `(start, end, replicas)` of every "layers A..B xR" in a logged plan.
fn parse_plan(line: &str) -> Vec<(usize, usize, u32)> {
    line.split("layers ")
        .skip(1)
        .filter_map(|part| {
            let (range, rest) = part.split_once(" x")?;
            let (a, b) = range.split_once("..")?;
            let r: String = rest.chars().take_while(char::is_ascii_digit).collect();
            Some((a.parse().ok()?, b.parse().ok()?, r.parse().ok()?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mlp_job_replans_when_a_stage_agent_is_warned() {
    use super::support::Cluster;
    use proteus_wire::Tier;
    use proteus_wire::agent_api::{
        AppConfig, ImageDataset, Parallelism, StopCondition, TrainingConfig,
    };
    use std::time::{Duration, Instant};

    // Wide layers behind slow links: the partitioner splits them into four single stages (the
    // activations, not the layers, are the bottleneck), as in bench/pipeline.
    let widths = vec![512u32, 512, 512, 10];
    let mut cfg = TrainingConfig::new(AppConfig::Mlp {
        dataset: ImageDataset::Mnist,
        layers: widths.clone(),
        batch: 64,
        learning_rate: 0.02,
        momentum: 0.9,
        parallelism: Parallelism::Pipeline,
        // Slow links make the partitioner split the layers into stages.
        link_mbit_per_sec: Some(200.0),
        link_latency_ms: None,
        pipeline: Default::default(),
    });
    // Two epochs: the comparison is made once training has mostly converged, where a re-plan's
    // change of replication (and so of staleness) no longer shows at the first decimal.
    cfg.stop = StopCondition::Epochs { epochs: 2 };
    cfg.clocks_per_epoch = 937;
    cfg.min_workers = 4;
    cfg.seed = 3;
    cfg.eval_every_epochs = 0;
    let specs = [
        ("p0", Tier::Reliable),
        ("p1", Tier::Transient),
        ("p2", Tier::Transient),
        ("p3", Tier::Transient),
    ];
    let mut c = Cluster::start(cfg.clone(), &specs).await;
    let started = c
        .coord
        .wait_for(Duration::from_secs(120), |s| s.progress.clock >= 150)
        .await;
    if started.is_none() {
        c.dump_logs();
        panic!("the pipeline did not get going");
    }
    let view = c.coord.with(|co| co.view().cloned()).expect("view");
    let ranks: Vec<String> = view
        .workers
        .iter()
        .map(|w| w.instance_id.0.clone())
        .collect();
    assert_eq!(ranks.len(), 4);
    let warned = ranks[1].clone();
    let noticed = Instant::now();
    c.agent(&warned).imds.announce_interruption(120);
    let st = c.wait_done(Duration::from_secs(300)).await;
    let metric = st.final_metric.expect("final metric");
    // The warned agent handed over and left on its own.
    let code = c.agent(&warned).wait_exit(Duration::from_secs(60)).await;
    assert_eq!(code, Some(0), "{}", c.agent(&warned).log_text());
    // The leader logged the plan, the drain and the re-plan.
    let leader_log = c.agent(&ranks[0]).log_text();
    let plan_line = leader_log
        .lines()
        .find(|l| l.contains("pipeline plan"))
        .expect("plan logged")
        .to_string();
    let stages = parse_plan(&plan_line);
    assert!(!stages.is_empty(), "{plan_line}");
    let all_logs: String = c.agents.iter().map(|a| a.log_text()).collect();
    assert!(
        all_logs.contains("draining the pipeline for a re-plan"),
        "no drain"
    );
    assert!(all_logs.contains("re-planned"), "no re-plan");
    let warned_log = c.agent(&warned).log_text();
    assert!(warned_log.contains("state handed over"), "{warned_log}");
    // Every survivor trained again on the new plan; the leader says after how long.
    let pauses: Vec<String> = c
        .agents
        .iter()
        .filter(|a| a.id != warned)
        .filter_map(|a| {
            a.log_text()
                .lines()
                .find(|l| l.contains("training again on the new plan"))
                .map(|l| l.split("pause_ms=").nth(1).unwrap_or("?").to_string())
        })
        .collect();
    assert_eq!(
        pauses.len(),
        3,
        "every survivor resumes training: {pauses:?}"
    );
    // Wall time from the agent seeing the notice to the last survivor training again, from the
    // log timestamps (all agents share this machine's clock).
    let notice_at = log_secs(&warned_log, "interruption warning");
    let resumed_at = c
        .agents
        .iter()
        .filter(|a| a.id != warned)
        .filter_map(|a| log_secs(&a.log_text(), "training again on the new plan"))
        .fold(None, |m: Option<f64>, t| Some(m.map_or(t, |m| m.max(t))));
    let (Some(n), Some(r)) = (notice_at, resumed_at) else {
        panic!("no notice or resumption in the logs");
    };
    eprintln!(
        "notice to training again on the new plan: {:.3} s",
        (r - n).rem_euclid(86_400.0)
    );
    eprintln!(
        "plan {stages:?}; pause after the drain (ms) per survivor: {pauses:?}; notice to job end {:.1} s; final accuracy {:.4}",
        noticed.elapsed().as_secs_f64(),
        metric.value
    );
    // The reference: the same plans, drain point, minibatches and seed, locally over TCP. The
    // drain point is the leader's (it depends on when the warning reached it, which is this
    // machine's timing); replayed, the local run trains what the agents should have trained.
    let drain_line = leader_log
        .lines()
        .find(|l| l.contains("draining the pipeline for a re-plan"))
        .expect("the leader logged the drain point");
    let drain_at: u64 = log_field(drain_line, "drain_at").expect("drain_at");
    let evicted: u32 = log_field(drain_line, "evicted").expect("evicted");
    assert_eq!(evicted, 1, "the warned agent is worker 1: {drain_line}");
    let replanned = parse_plan(
        leader_log
            .lines()
            .find(|l| l.contains("re-planned"))
            .expect("the leader logged the plan for three"),
    );
    let (train, test) = data::load_mnist(Path::new(super::support::DATA_DIR)).expect("mnist");
    let mut w = vec![784usize];
    w.extend(widths.iter().map(|&x| x as usize));
    let shape = MlpShape::new(w).unwrap();
    let batches = Batches::new(train.len(), 64, 3);
    let reference = RunConfig {
        shape: shape.clone(),
        plan: plan(&stages, shape.layers()),
        schedule: ScheduleKind::OneFOneB,
        minibatches: batches.per_epoch() * 2,
        batches,
        lr: LrSchedule::constant(0.02),
        momentum: 0.9,
        seed: 3,
        checkpoint_every: 0,
        replans: [(3, plan(&replanned, shape.layers()))].into(),
        warn_at: None,
        drain_at: Some((drain_at, 1)),
        join_at: None,
        snapshot_every: 0,
        kill_at: None,
        allreduce_bucket_bytes: proteus_agent::pipeline::stage::DEFAULT_BUCKET_BYTES,
        vertical_sync: false,
    };
    let run = tokio::task::spawn_blocking(move || local::run(reference, Arc::new(train), None))
        .await
        .unwrap()
        .expect("reference run");
    let want = mlp::accuracy(&run.model(), &test);
    eprintln!("the same re-plan, drained at minibatch {drain_at}, locally: {want:.4}");
    // The same plans, drain point and data order train the same model (to float rounding: a
    // few test images at most), however fast this machine ran the agents.
    assert!(
        (metric.value - want).abs() <= 0.002,
        "the agents trained {} against the replayed run's {want}",
        metric.value
    );
}

#[test]
fn bucketed_overlapped_all_reduce_steps_as_one_all_reduce_after_the_backward_pass() {
    let (train, _) = data::load_digits(Path::new(super::support::DATA_DIR)).expect("digits");
    let shape = MlpShape::new(vec![64, 48, 32, 24, 10]).unwrap();
    let train = Arc::new(train);
    // Data parallelism on three workers, and a replicated middle stage (its overlapped pass
    // also sends the previous stage its gradient).
    for stages in [vec![(0, 4, 3)], vec![(0, 1, 1), (1, 3, 2), (3, 4, 1)]] {
        let base = RunConfig {
            shape: shape.clone(),
            plan: plan(&stages, 4),
            schedule: ScheduleKind::OneFOneB,
            batches: Batches::new(train.len(), 16, 3),
            // Not a multiple of the replicas: the last step of some replicas has no backward
            // pass, and theirs must pair with the others' overlapped buckets.
            minibatches: 61,
            lr: LrSchedule::constant(0.05),
            momentum: 0.9,
            seed: 5,
            checkpoint_every: 6,
            replans: Default::default(),
            warn_at: None,
            drain_at: None,
            join_at: None,
            snapshot_every: 0,
            kill_at: None,
            allreduce_bucket_bytes: 0,
            vertical_sync: false,
        };
        let whole = local::run(base.clone(), train.clone(), None).expect("one all-reduce");
        // 4 KB buckets: every layer of this model is a bucket of its own or shares one.
        let bucketed = RunConfig {
            allreduce_bucket_bytes: 4096,
            ..base
        };
        let buckets = proteus_agent::pipeline::stage::buckets(&shape.init(5), 4096);
        assert!(buckets.len() >= 3, "{buckets:?}");
        let run = local::run(bucketed, train.clone(), None).expect("bucketed all-reduce");
        let (a, b) = (whole.checkpoints.complete(), run.checkpoints.complete());
        assert_eq!(a.len(), 10, "{stages:?}");
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.minibatch, y.minibatch);
            let d = max_rel_diff(&x.layers, &y.layers);
            assert!(
                d < 1e-5,
                "{stages:?} after minibatch {}: differs by {d}",
                x.minibatch
            );
        }
        assert!(
            max_rel_diff(&whole.model(), &shape.init(5)) > 1e-3,
            "the model trained"
        );
    }
}

/// Single-process training that writes out what a pipeline schedule promises: each segment
/// (a run of minibatches on one plan; a re-plan starts the next) begins from the model as the
/// previous one left it, with versions counted from its start; minibatch `m`'s gradient is
/// computed (forward and backward) with each stage `s`'s layers as the model was after
/// `version(plan, s, m − start)` of the segment's optimizer steps, and the model steps once per
/// `group(plan)` minibatches of the segment with their accumulated gradients, as that many
/// sequential steps (1F1B's scaling).
fn train_versioned(
    cfg: &RunConfig,
    train: &data::ImageSet,
    segments: &[(std::ops::Range<u64>, &Plan)],
    group: impl Fn(&Plan) -> u64,
    version: impl Fn(&Plan, usize, u64) -> u64,
) -> Vec<Dense> {
    let mut model = cfg.shape.init(cfg.seed);
    let mut opt = mlp::Sgd::new(&model, cfg.lr, cfg.momentum);
    for (range, plan) in segments {
        let mut history = vec![model.clone()];
        let mut acc: Vec<Dense> = model.iter().map(Dense::zeros_like).collect();
        let (mut samples, mut count) = (0usize, 0u32);
        for m in range.clone() {
            let layers: Vec<Dense> = plan
                .stages()
                .iter()
                .enumerate()
                .flat_map(|(s, st)| {
                    let v = version(plan, s, m - range.start) as usize;
                    assert!(
                        v < history.len(),
                        "stage {s} minibatch {m}: version {v} lies ahead"
                    );
                    history[v][st.layers.clone()].to_vec()
                })
                .collect();
            let rows = cfg.batches.rows(m);
            let t = mlp::forward(&layers, mlp::features(train, &rows), true);
            let (_, _, g) = mlp::softmax_xent(&t.output, &mlp::labels(train, &rows));
            let (grads, _) = mlp::backward(&layers, &t, g, true, false);
            mlp::add_into(&mut acc, &grads);
            samples += rows.len();
            count += 1;
            if u64::from(count) == group(plan) || m + 1 == range.end {
                let mut w = history.last().expect("a version").clone();
                opt.step_as(&mut w, &acc, samples as f32 / count as f32, 0, count);
                history.push(w);
                acc.iter_mut().for_each(|a| {
                    a.w.fill(0.0);
                    a.b.fill(0.0)
                });
                (samples, count) = (0, 0);
            }
        }
        model = history.pop().expect("a version");
    }
    model
}

/// PipeDream's warm-up of stage `s` of `plan`.
fn warm(plan: &Plan, s: usize) -> u64 {
    proteus_agent::pipeline::schedule::warmup(plan.workers_from(s), plan.stages()[s].replicas)
        as u64
}

/// A schedule's promise, as [`train_versioned`] takes it: the minibatches one step covers on a
/// plan, and the version stage `s` of a plan runs minibatch `m` (of its segment) on.
type Promise = (
    Box<dyn Fn(&Plan) -> u64>,
    Box<dyn Fn(&Plan, usize, u64) -> u64>,
);

/// 1F1B: stage `s` runs `m` after `m − warm-up(s)` of its steps.
fn one_f_one_b_promise() -> Promise {
    (
        Box::new(|_| 1),
        Box::new(|p, s, m| m.saturating_sub(warm(p, s))),
    )
}

/// Vertical sync: every stage runs `m` on the input stage's version when `m` entered.
fn vertical_sync_promise() -> Promise {
    (
        Box::new(|_| 1),
        Box::new(|p, _, m| m.saturating_sub(warm(p, 0))),
    )
}

/// 2BW: a step per group of minibatches (the run's `group`, or the plan's own minimum when that
/// is larger), so a stage's version advances once per group.
fn two_bw_promise(group: u64) -> Promise {
    let on = move |p: &Plan| group.max(proteus_agent::pipeline::schedule::two_bw_group(p));
    (
        Box::new(on),
        Box::new(move |p, s, m| m.saturating_sub(warm(p, s)) / on(p)),
    )
}

/// The schedule tests' setting: digits, an MLP of four layers on four single stages,
/// minibatches of 16, 1F1B without vertical sync.
fn four_stage_digits(minibatches: u64) -> (Arc<data::ImageSet>, RunConfig) {
    let (train, _) = data::load_digits(Path::new(super::support::DATA_DIR)).expect("digits");
    let cfg = RunConfig {
        shape: MlpShape::new(vec![64, 48, 32, 24, 10]).unwrap(),
        plan: plan(&[(0, 1, 1), (1, 2, 1), (2, 3, 1), (3, 4, 1)], 4),
        schedule: ScheduleKind::OneFOneB,
        batches: Batches::new(train.len(), 16, 3),
        minibatches,
        lr: LrSchedule::constant(0.05),
        momentum: 0.9,
        seed: 11,
        checkpoint_every: 0,
        replans: Default::default(),
        warn_at: None,
        drain_at: None,
        join_at: None,
        snapshot_every: 0,
        kill_at: None,
        allreduce_bucket_bytes: proteus_agent::pipeline::stage::DEFAULT_BUCKET_BYTES,
        vertical_sync: false,
    };
    (Arc::new(train), cfg)
}

#[test]
fn one_f_one_b_vertical_sync_and_2bw_train_on_the_weight_versions_they_promise() {
    let (train, base) = four_stage_digits(50);
    let shape = base.shape.clone();
    // Warm-ups 3, 2, 1, 0: stage s runs minibatch m forward after m − warm(s) of its steps.
    let group = proteus_agent::pipeline::schedule::two_bw_group(&base.plan);
    assert_eq!(group, 4);
    let cases: [(&str, RunConfig, Promise, [usize; 4]); 3] = [
        ("1F1B", base.clone(), one_f_one_b_promise(), [4, 3, 2, 1]),
        (
            // Every stage runs m on the input stage's version when m entered: one model.
            "1F1B with vertical sync",
            RunConfig {
                vertical_sync: true,
                ..base.clone()
            },
            vertical_sync_promise(),
            [4, 4, 4, 4],
        ),
        (
            // One step per 4 minibatches; a stage's versions advance once per group.
            "2BW",
            RunConfig {
                schedule: ScheduleKind::TwoBW { group },
                ..base.clone()
            },
            two_bw_promise(group),
            [2, 2, 2, 1],
        ),
    ];
    let mut finals = Vec::new();
    for (name, cfg, (step_every, version), copies) in cases {
        let want = train_versioned(
            &cfg,
            &train,
            &[(0..cfg.minibatches, &cfg.plan)],
            step_every,
            version,
        );
        let run = local::run(cfg, train.clone(), None).expect("pipeline runs");
        let d = max_rel_diff(&run.model(), &want);
        assert!(d < 1e-4, "{name}: differs from its promise by {d}");
        assert!(
            max_rel_diff(&run.model(), &shape.init(11)) > 1e-3,
            "{name} trained"
        );
        let mut held = [0; 4];
        for o in &run.outcomes {
            held[o.stage] = o.max_weight_copies;
        }
        assert_eq!(held, copies, "{name}: weight copies held per stage");
        finals.push(run.model());
    }
    // The three really train differently.
    assert!(max_rel_diff(&finals[0], &finals[1]) > 1e-4);
    assert!(max_rel_diff(&finals[0], &finals[2]) > 1e-4);

    // Replicated stages: vertical sync maps the input stage's version to each stage's own
    // (replicas 2, 1, 1 step every 2, 1, 1 minibatches), and 2BW's group covers both replicas.
    let replicated = plan(&[(0, 2, 2), (2, 3, 1), (3, 4, 1)], 4);
    let group = proteus_agent::pipeline::schedule::two_bw_group(&replicated);
    for cfg in [
        RunConfig {
            plan: replicated.clone(),
            vertical_sync: true,
            ..base.clone()
        },
        RunConfig {
            plan: replicated.clone(),
            schedule: ScheduleKind::TwoBW { group },
            ..base.clone()
        },
    ] {
        let two_bw = cfg.schedule != ScheduleKind::OneFOneB;
        let run = local::run(cfg, train.clone(), None).expect("replicated pipeline runs");
        assert!(max_rel_diff(&run.model(), &shape.init(11)) > 1e-3);
        if two_bw {
            assert!(run.outcomes.iter().all(|o| o.max_weight_copies <= 2));
        }
    }

    // What the runtime cannot do is refused before anything runs.
    let e = local::run(
        RunConfig {
            schedule: ScheduleKind::TwoBW { group: 2 },
            ..base.clone()
        },
        train.clone(),
        None,
    )
    .expect_err("a 2BW group too small for two versions");
    assert!(
        e.to_string().contains("smaller than this plan needs"),
        "{e}"
    );
    let e = local::run(
        RunConfig {
            schedule: ScheduleKind::Flushing { group: 4 },
            vertical_sync: true,
            ..base
        },
        train,
        None,
    )
    .expect_err("vertical sync with flushing");
    assert!(e.to_string().contains("1F1B schedule only"), "{e}");
}

#[test]
fn vertical_sync_and_2bw_survive_a_warned_stage_and_keep_their_promise_across_the_replan() {
    let (train, base) = four_stage_digits(70);
    let four = base.plan.clone();
    let three = plan(&[(0, 1, 1), (1, 2, 1), (2, 4, 1)], 4);
    let base = RunConfig {
        replans: [(3, three.clone())].into_iter().collect(),
        // Worker 1 (stage 1) is warned when the leader reaches minibatch 20.
        warn_at: Some((20, 1)),
        drain_at: None,
        ..base
    };
    let group = proteus_agent::pipeline::schedule::two_bw_group(&four);
    let cases: [(&str, RunConfig, Promise); 2] = [
        (
            "vertical sync",
            RunConfig {
                vertical_sync: true,
                ..base.clone()
            },
            vertical_sync_promise(),
        ),
        (
            "2BW",
            RunConfig {
                schedule: ScheduleKind::TwoBW { group },
                ..base
            },
            two_bw_promise(group),
        ),
    ];
    for (name, cfg, (step_every, version)) in cases {
        let run = local::run(cfg.clone(), train.clone(), None).expect("run with an eviction");
        let evicted: Vec<u32> = run
            .outcomes
            .iter()
            .filter(|o| o.evicted)
            .map(|o| o.worker)
            .collect();
        assert_eq!(evicted, [1], "{name}");
        let drain_at = run
            .checkpoints
            .events()
            .iter()
            .find_map(|e| match e.0 {
                proteus_agent::pipeline::stage::Event::Notice { drain_at, .. } => Some(drain_at),
                _ => None,
            })
            .expect("a drain");
        assert!(
            drain_at > 20 && drain_at < 70,
            "{name}: drained at {drain_at}"
        );
        let group = step_every(&four);
        if group > 1 {
            assert_eq!(drain_at % group, 0, "{name}: drained inside a group");
        }
        // Every minibatch went through the last stage exactly once.
        assert_eq!(
            through_last_stages(&run),
            (0..70).collect::<Vec<_>>(),
            "{name}"
        );
        let want = train_versioned(
            &cfg,
            &train,
            &[(0..drain_at, &four), (drain_at..70, &three)],
            step_every,
            version,
        );
        let d = max_rel_diff(&run.model(), &want);
        assert!(
            d < 1e-4,
            "{name}: differs from its promise across the re-plan by {d}"
        );
        if name == "2BW" {
            assert!(run.outcomes.iter().all(|o| o.max_weight_copies <= 2));
        }
    }
}

#[test]
fn a_worker_that_joins_is_folded_in_by_a_replan_and_the_run_keeps_its_promise() {
    let (train, base) = four_stage_digits(70);
    let four = base.plan.clone();
    let three = plan(&[(0, 1, 1), (1, 2, 1), (2, 4, 1)], 4);
    // Three workers start; worker 3 stands by and is folded in when the leader reaches
    // minibatch 20, on the plan for four.
    let base = RunConfig {
        plan: three.clone(),
        replans: [(4, four.clone())].into_iter().collect(),
        join_at: Some((20, 3)),
        ..base
    };
    // 2BW starts with the group three workers need (3) and takes four's (4) after the join.
    let group = proteus_agent::pipeline::schedule::two_bw_group(&three);
    assert_eq!(group, 3);
    let cases: [(&str, RunConfig, Promise); 3] = [
        ("1F1B", base.clone(), one_f_one_b_promise()),
        (
            "1F1B with vertical sync",
            RunConfig {
                vertical_sync: true,
                ..base.clone()
            },
            vertical_sync_promise(),
        ),
        (
            "2BW",
            RunConfig {
                schedule: ScheduleKind::TwoBW { group },
                ..base.clone()
            },
            two_bw_promise(group),
        ),
    ];
    for (name, cfg, (step_every, version)) in cases {
        let run = local::run(cfg.clone(), train.clone(), None).expect("run with a join");
        let drain_at = run
            .checkpoints
            .events()
            .iter()
            .find_map(|e| match e.0 {
                proteus_agent::pipeline::stage::Event::Join { joined, drain_at } => {
                    assert_eq!(joined, 3);
                    Some(drain_at)
                }
                _ => None,
            })
            .expect("a join");
        assert!(
            drain_at > 20 && drain_at < 70,
            "{name}: drained at {drain_at}"
        );
        // The newcomer took the last stage of the plan for four; nobody left.
        assert!(run.outcomes.iter().all(|o| !o.evicted));
        let layout: Vec<(u32, usize, usize)> = run
            .outcomes
            .iter()
            .map(|o| (o.worker, o.first_layer, o.layers.len()))
            .collect();
        assert_eq!(
            layout,
            [(0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 3, 1)],
            "{name}"
        );
        assert!(run.outcomes.iter().all(|o| o.final_members == [0, 1, 2, 3]));
        // Every minibatch went through a last stage exactly once: the old one's before the
        // drain point, the newcomer's after.
        assert_eq!(
            through_last_stages(&run),
            (0..70).collect::<Vec<_>>(),
            "{name}"
        );
        let newcomer = run.outcomes.iter().find(|o| o.worker == 3).unwrap();
        assert_eq!(
            newcomer.minibatches,
            (drain_at..70).collect::<Vec<_>>(),
            "{name}"
        );
        let want = train_versioned(
            &cfg,
            &train,
            &[(0..drain_at, &three), (drain_at..70, &four)],
            step_every,
            version,
        );
        let d = max_rel_diff(&run.model(), &want);
        assert!(
            d < 1e-4,
            "{name}: differs from its promise across the join by {d}"
        );
        if name == "2BW" {
            assert_eq!(drain_at % group, 0, "{name}: drained inside a group");
            assert!(run.outcomes.iter().all(|o| o.max_weight_copies <= 2));
        }
    }
    // Only the worker after the first plan's can stand by in a local run.
    let e = local::run(
        RunConfig {
            join_at: Some((20, 5)),
            ..base.clone()
        },
        train.clone(),
        None,
    )
    .expect_err("worker 5 is not the next one");
    assert!(e.to_string().contains("folds in worker 3"), "{e}");
    let e = local::run(
        RunConfig {
            join_at: Some((20, 1)),
            ..base
        },
        train,
        None,
    )
    .expect_err("worker 1 is in the plan");
    assert!(e.to_string().contains("in the first plan already"), "{e}");
}

/// A replacement agent's path, in a local run: the newcomer knows only the founders' addresses
/// and says it is ready when the run starts. With no plan for five it waits; worker 1 is warned,
/// the pipeline re-plans for three, and then the leader numbers the newcomer 4, gives it the
/// plan table and the address book, and re-plans for four. The run equals the segmented
/// reference of the plans it went through.
/// The leader's decisions to re-plan, in order.
fn replans(run: &local::LocalRun) -> Vec<proteus_agent::pipeline::stage::Event> {
    use proteus_agent::pipeline::stage::Event;
    run.checkpoints
        .events()
        .into_iter()
        .map(|e| e.0)
        .filter(|e| !matches!(e, Event::Resumed { .. }))
        .collect()
}

#[test]
fn a_replacement_that_says_it_is_ready_is_folded_in_once_a_plan_has_room() {
    use proteus_agent::pipeline::stage::Event;
    let (train, base) = four_stage_digits(70);
    let four = base.plan.clone();
    let three = plan(&[(0, 1, 1), (1, 2, 1), (2, 4, 1)], 4);
    let base = RunConfig {
        replans: [(3, three.clone())].into_iter().collect(),
        warn_at: Some((15, 1)),
        drain_at: None,
        ..base
    };
    let group = proteus_agent::pipeline::schedule::two_bw_group(&four);
    let cases: [(&str, RunConfig, Promise); 2] = [
        ("1F1B", base.clone(), one_f_one_b_promise()),
        (
            "2BW",
            RunConfig {
                schedule: ScheduleKind::TwoBW { group },
                ..base.clone()
            },
            two_bw_promise(group),
        ),
    ];
    for (name, cfg, (step_every, version)) in cases {
        let run = local::run_with_newcomer(cfg.clone(), train.clone(), None, Vec::new())
            .expect("run with a newcomer");
        let events = replans(&run);
        let (left_at, joined_at) = match events[..] {
            [
                Event::Notice {
                    evicted: 1,
                    drain_at: l,
                },
                Event::Join {
                    joined: 4,
                    drain_at: j,
                },
            ] => (l, j),
            _ => panic!("{name}: a leave, then a join of worker 4: {events:?}"),
        };
        assert!(
            15 < left_at && left_at < joined_at && joined_at < 70,
            "{name}: left at {left_at}, joined at {joined_at}"
        );
        let layout: Vec<(u32, bool)> = run.outcomes.iter().map(|o| (o.worker, o.evicted)).collect();
        assert_eq!(
            layout,
            [(0, false), (1, true), (2, false), (3, false), (4, false)],
            "{name}: the newcomer got the next free number"
        );
        let finished = run.outcomes.iter().filter(|o| !o.evicted);
        assert!(
            finished.clone().all(|o| o.final_members == [0, 2, 3, 4]),
            "{name}"
        );
        let newcomer = run.outcomes.iter().find(|o| o.worker == 4).unwrap();
        assert_eq!(
            newcomer.minibatches,
            (joined_at..70).collect::<Vec<_>>(),
            "{name}: the newcomer took the last stage from the join on"
        );
        // The join was decided before the plan for three took its first step; every survivor
        // still reports training again on it (what the agent sends as `pipeline_resumed`),
        // then on the plan for four, which is all the newcomer trained.
        for o in finished.clone() {
            let want: &[(u32, u32)] = if o.worker == 4 {
                &[(2, 4)]
            } else {
                &[(1, 3), (2, 4)]
            };
            assert_eq!(o.resumed, want, "{name}: worker {}", o.worker);
        }
        assert_eq!(
            through_last_stages(&run),
            (0..70).collect::<Vec<_>>(),
            "{name}"
        );
        let want = train_versioned(
            &cfg,
            &train,
            &[
                (0..left_at, &four),
                (left_at..joined_at, &three),
                (joined_at..70, &four),
            ],
            step_every,
            version,
        );
        let d = max_rel_diff(&run.model(), &want);
        assert!(
            d < 1e-4,
            "{name}: differs from its promise across the leave and the join by {d}"
        );
    }

    // With a plan for one more worker from the start, the newcomer is folded in at once.
    let cfg = RunConfig {
        plan: three.clone(),
        replans: [(4, four.clone())].into_iter().collect(),
        warn_at: None,
        drain_at: None,
        ..base.clone()
    };
    let run = local::run_with_newcomer(cfg, train.clone(), None, Vec::new())
        .expect("run with a newcomer");
    let events = replans(&run);
    assert!(
        matches!(events[..], [Event::Join { joined: 3, .. }]),
        "{events:?}"
    );
    assert!(run.outcomes.iter().all(|o| o.final_members == [0, 1, 2, 3]));
    assert_eq!(through_last_stages(&run), (0..70).collect::<Vec<_>>());

    // A newcomer is for a run that folds it in when it is ready, not at a set minibatch.
    let e = local::run_with_newcomer(
        RunConfig {
            join_at: Some((20, 4)),
            ..base
        },
        train,
        None,
        Vec::new(),
    )
    .expect_err("both");
    assert!(e.to_string().contains("when it is ready"), "{e}");
}

/// A worker lost without warning (`kill -9`): a middle stage, the leader (the member that plans
/// re-plans), and a 2BW last stage. Whoever cannot reach it tells the others; the first survivor
/// restarts them from its newest snapshot of every layer (taken every 8 minibatches, held by
/// the leader and the next member), so the minibatches after the snapshot are computed again.
/// The run equals the reference that re-plans at the snapshot, and the result counts every
/// minibatch once. Without snapshots, the loss ends the run at once with an error that names it.
#[test]
fn a_worker_lost_without_warning_is_restarted_from_the_newest_snapshot() {
    use proteus_agent::pipeline::stage::Event;
    let (train, base) = four_stage_digits(70);
    let four = base.plan.clone();
    let three = plan(&[(0, 1, 1), (1, 2, 1), (2, 4, 1)], 4);
    let base = RunConfig {
        replans: [(3, three.clone())].into_iter().collect(),
        snapshot_every: 8,
        ..base
    };
    let group = proteus_agent::pipeline::schedule::two_bw_group(&four);
    let cases: [(&str, RunConfig, Promise); 3] = [
        (
            "1F1B, a middle stage",
            RunConfig {
                kill_at: Some((30, 2)),
                ..base.clone()
            },
            one_f_one_b_promise(),
        ),
        (
            "1F1B, the leader",
            RunConfig {
                kill_at: Some((30, 0)),
                ..base.clone()
            },
            one_f_one_b_promise(),
        ),
        (
            "2BW, the last stage",
            RunConfig {
                kill_at: Some((30, 3)),
                schedule: ScheduleKind::TwoBW { group },
                ..base.clone()
            },
            two_bw_promise(group),
        ),
    ];
    for (name, cfg, (step_every, version)) in cases {
        let killed = cfg.kill_at.unwrap().1;
        let run = local::run(cfg.clone(), train.clone(), None).expect(name);
        let events = replans(&run);
        let restart_at = match events[..] {
            [Event::Lost { worker, restart_at }] if worker == killed => restart_at,
            _ => panic!("{name}: one loss, of worker {killed}: {events:?}"),
        };
        let every = 8u64.div_ceil(step_every(&four)) * step_every(&four);
        assert!(
            (8..=30).contains(&restart_at) && restart_at.is_multiple_of(every),
            "{name}: restarted at {restart_at}"
        );
        let survivors: Vec<u32> = (0..4).filter(|&w| w != killed).collect();
        for o in &run.outcomes {
            assert_eq!(o.lost, o.worker == killed, "{name}");
            if !o.lost {
                assert_eq!(o.final_members, survivors, "{name}");
            }
        }
        // Every minibatch's loss counted once: the lost worker's only before the restart.
        let mut seen: Vec<u64> = run
            .outcomes
            .iter()
            .flat_map(|o| {
                o.minibatches
                    .iter()
                    .copied()
                    .filter(move |&m| !o.lost || m < restart_at)
            })
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..70).collect::<Vec<_>>(), "{name}");
        let want = train_versioned(
            &cfg,
            &train,
            &[(0..restart_at, &four), (restart_at..70, &three)],
            step_every,
            version,
        );
        let d = max_rel_diff(&run.model(), &want);
        assert!(
            d < 1e-4,
            "{name}: differs from a re-plan at the snapshot by {d}"
        );
    }
    // The leader killed while a replacement waits: the new leader restarts the survivors, then
    // folds the replacement in (as a replacement agent the broker buys after a loss is).
    let cfg = RunConfig {
        kill_at: Some((30, 0)),
        ..base.clone()
    };
    let run = local::run_with_newcomer(cfg.clone(), train.clone(), None, Vec::new())
        .expect("a loss, then a join");
    let events = replans(&run);
    let (restart_at, joined_at) = match events[..] {
        [
            Event::Lost {
                worker: 0,
                restart_at,
            },
            Event::Join {
                joined: 4,
                drain_at,
            },
        ] => (restart_at, drain_at),
        _ => panic!("a loss of worker 0, then worker 4 joins: {events:?}"),
    };
    assert!(restart_at <= 30 && restart_at < joined_at && joined_at < 70);
    for o in run.outcomes.iter().filter(|o| !o.lost) {
        assert_eq!(o.final_members, [1, 2, 3, 4]);
    }
    let (step_every, version) = one_f_one_b_promise();
    let want = train_versioned(
        &cfg,
        &train,
        &[
            (0..restart_at, &four),
            (restart_at..joined_at, &three),
            (joined_at..70, &four),
        ],
        step_every,
        version,
    );
    let d = max_rel_diff(&run.model(), &want);
    assert!(d < 1e-4, "a loss then a join: differs by {d}");

    let e = local::run(
        RunConfig {
            kill_at: Some((30, 2)),
            snapshot_every: 0,
            ..base
        },
        train,
        None,
    )
    .expect_err("no snapshots");
    assert!(e.to_string().contains("worker 2 was lost"), "{e}");
}

#[test]
fn a_run_whose_last_snapshot_is_taken_a_step_before_its_end_finishes() {
    // Two stages on a slow link; the run's last snapshot (at minibatch 40 of 41) is taken by the
    // first stage a step before the end, and its keeper, the second stage, finishes its last
    // minibatch before the snapshot has crossed the link. Nobody will restart from it: the
    // run finishes, every minibatch once. (A failed snapshot send used to count its keeper as
    // lost and fail the first stage at the very end: in an agent, a job whose clocks were all
    // done and that never completed.)
    let (train, _) = data::load_digits(Path::new(super::support::DATA_DIR)).expect("digits");
    let shape = MlpShape::new(vec![64, 48, 32, 24, 10]).unwrap();
    let cfg = RunConfig {
        shape: shape.clone(),
        plan: plan(&[(0, 2, 1), (2, 4, 1)], shape.layers()),
        schedule: ScheduleKind::OneFOneB,
        batches: Batches::new(train.len(), 16, 3),
        minibatches: 41,
        lr: LrSchedule::constant(0.05),
        momentum: 0.9,
        seed: 5,
        checkpoint_every: 0,
        replans: Default::default(),
        warn_at: None,
        drain_at: None,
        join_at: None,
        snapshot_every: 40,
        kill_at: None,
        allreduce_bucket_bytes: 0,
        vertical_sync: false,
    };
    // 1 Mbit/s: the first stage's snapshot (about 38 KB of weights and momentum) takes about
    // 0.3 s to cross; the second stage's last minibatch, its activation a few hundred bytes.
    let link = proteus_agent::pipeline::partition::Link::new(125_000.0, 0.0);
    let run = local::run(cfg, Arc::new(train), Some(link))
        .expect("the run finishes though the last snapshot's keeper is done");
    assert_eq!(through_last_stages(&run), (0..41).collect::<Vec<u64>>());
}

/// The schedule tests' setting with a replicated last stage and checkpoints, as a spec for
/// worker processes.
fn digits_process_spec() -> processes::ProcessSpec {
    processes::ProcessSpec {
        data: processes::DataSet::Digits,
        data_dir: Path::new(super::support::DATA_DIR).to_path_buf(),
        widths: vec![64, 48, 32, 24, 10],
        stages: plan(&[(0, 2, 1), (2, 3, 1), (3, 4, 2)], 4)
            .stages()
            .to_vec(),
        predicted_secs: 0.0,
        schedule: ScheduleKind::OneFOneB,
        batch: 16,
        batch_seed: 3,
        minibatches: 60,
        lr: LrSchedule::constant(0.05),
        momentum: 0.9,
        seed: 11,
        checkpoint_every: 10,
        snapshot_every: 0,
        allreduce_bucket_bytes: proteus_agent::pipeline::stage::DEFAULT_BUCKET_BYTES,
        vertical_sync: false,
        link: Some((2e6, 0.001)),
    }
}

#[test]
fn worker_processes_train_the_same_model_as_worker_threads() {
    let spec = digits_process_spec();
    let agent = Path::new(env!("CARGO_BIN_EXE_proteus-agent"));
    let launched = std::time::Instant::now();
    let run = processes::run(agent, &spec).expect("the worker processes run");
    // The run's wall time spans every worker's stage (first operation to last), and not the
    // processes' start nor the results' reading.
    assert!(
        run.wall_secs > 0.0 && run.wall_secs < launched.elapsed().as_secs_f64(),
        "{}",
        run.wall_secs
    );
    for o in &run.outcomes {
        assert!(
            o.wall_secs <= run.wall_secs + 0.01,
            "worker {}: {} s of {} s",
            o.worker,
            o.wall_secs,
            run.wall_secs
        );
    }
    let (train, _) = data::load_digits(Path::new(super::support::DATA_DIR)).expect("digits");
    let cfg = spec.config(train.len()).expect("a valid spec");
    let link = proteus_agent::pipeline::partition::Link::new(2e6, 0.001);
    let threads = local::run(cfg, Arc::new(train), Some(link)).expect("the worker threads run");

    // One outcome per worker process, every minibatch through the last stage exactly once.
    assert_eq!(run.outcomes.len(), 4);
    assert_eq!(through_last_stages(&run), (0..60).collect::<Vec<_>>());
    assert!(run.outcomes.iter().all(|o| o.compute_secs > 0.0));
    // Every checkpoint crossed the process boundary whole, on the launcher's clock, in order.
    let (got, want) = (run.checkpoints.complete(), threads.checkpoints.complete());
    assert_eq!(
        got.iter().map(|c| c.minibatch).collect::<Vec<_>>(),
        vec![9, 19, 29, 39, 49, 59]
    );
    assert!(got.windows(2).all(|w| w[0].at <= w[1].at));
    assert!(got.iter().all(|c| c.at >= run.started));
    for (a, b) in got.iter().zip(&want) {
        let d = max_rel_diff(&a.layers, &b.layers);
        assert!(d < 1e-5, "after minibatch {}: differs by {d}", a.minibatch);
    }
    let d = max_rel_diff(&run.model(), &threads.model());
    assert!(d < 1e-5, "the final models differ by {d}");
    assert!(
        max_rel_diff(&run.model(), &spec_init()) > 1e-3,
        "the model trained"
    );
}

fn spec_init() -> Vec<Dense> {
    MlpShape::new(vec![64, 48, 32, 24, 10]).unwrap().init(11)
}

#[test]
fn a_worker_process_that_cannot_start_is_named_with_why() {
    let agent = Path::new(env!("CARGO_BIN_EXE_proteus-agent"));
    // A plan with a gap is refused before any process starts.
    let mut bad = digits_process_spec();
    bad.stages[1].layers = 3..3;
    let e = processes::run(agent, &bad).expect_err("a plan with a gap");
    assert!(e.to_string().contains("plan"), "{e}");
    // Data that is not there: each worker says so, and the launcher names the first.
    let mut missing = digits_process_spec();
    missing.data_dir = std::env::temp_dir().join("proteus-no-such-data-dir");
    let e = processes::run(agent, &missing).expect_err("no data");
    let text = e.to_string();
    assert!(
        text.starts_with("worker 0:") && text.contains("proteus-no-such-data-dir"),
        "{text}"
    );
}

/// The worker processes this test process started and has not reaped: (pid, state).
fn worker_children() -> Vec<(i32, char)> {
    let me = std::process::id().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid …: comm may hold spaces, so split after its closing paren.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if fields.get(1) == Some(&me.as_str())
            && String::from_utf8_lossy(&cmdline).contains("pipeline-worker")
        {
            found.push((pid, fields[0].chars().next().unwrap_or('?')));
        }
    }
    found.sort();
    found
}

/// How many sockets process `pid` holds open.
fn sockets_of(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.flatten()
                .filter(|fd| {
                    std::fs::read_link(fd.path())
                        .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// A worker process killed in the middle of a run (SIGKILL, after the workers have connected to
/// each other): the launcher ends the run with an error that names a worker, within a bound,
/// and leaves no worker process behind — not the killed one's peers waiting on it, nor a zombie.
#[test]
fn a_worker_process_killed_mid_run_ends_the_run_and_leaves_no_process() {
    let agent = Path::new(env!("CARGO_BIN_EXE_proteus-agent"));
    let mut spec = digits_process_spec();
    // Long enough that the run is still going when the kill comes (minutes at this link).
    spec.minibatches = 200_000;
    spec.checkpoint_every = 0;
    let (tx, rx) = std::sync::mpsc::channel();
    let launcher = std::thread::spawn(move || {
        let _ = tx.send(processes::run(agent, &spec));
    });
    // Once the run has begun, a worker past the first stage holds its listener and at least
    // two peer connections (the stage before, and the one after or its replica); before the
    // launcher's go, only the listener. Bounded wait, polled.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let victim = loop {
        let children = worker_children();
        if let Some((pid, _)) = children.iter().find(|(pid, _)| sockets_of(*pid) >= 3) {
            break *pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the workers never connected: {children:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // SAFETY: signalling a process this test started.
    assert_eq!(unsafe { libc::kill(victim, libc::SIGKILL) }, 0);
    let result = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the launcher returns within a minute of the kill");
    launcher.join().unwrap();
    match result {
        Err(processes::ProcessError::Worker { worker, what }) => {
            assert!(worker < 4, "{worker}: {what}");
            assert!(!what.is_empty());
            eprintln!("the run ended: worker {worker}: {what}");
        }
        other => panic!("expected a worker's failure, got {:?}", other.map(|_| ())),
    }
    assert_eq!(
        worker_children(),
        Vec::new(),
        "worker processes left behind"
    );
}
