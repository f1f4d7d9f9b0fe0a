//! Training to a target on real data, with and without revocations.

use crate::support::Cluster;
use proteus_agent::apps::App;
use proteus_wire::Tier;
use proteus_wire::agent_api::Stage;
use proteus_wire::agent_api::{
    AppConfig, ImageDataset, MetricKind, StageThresholds, StopCondition, TrainingConfig,
};
use proteus_wire::coordinator::JobState;
use std::time::Duration;

/// 2 reliable + 4 transient at stage3_ratio 2: stage 3, so the 4 transient machines are the
/// workers and serve the 2 active shards, with backups on the reliable pair.
pub fn mnist_config() -> TrainingConfig {
    let mut cfg = TrainingConfig::new(AppConfig::Mlr {
        dataset: ImageDataset::Mnist,
        learning_rate: 1.0,
        l2: 0.0,
    });
    cfg.num_shards = 2;
    cfg.num_partitions = 16;
    cfg.clocks_per_epoch = 120;
    cfg.stop = StopCondition::Epochs { epochs: 3 };
    cfg.stages = StageThresholds {
        stage2_ratio: 1.0,
        stage3_ratio: 2.0,
    };
    cfg.backup_sync_interval_ms = 300;
    cfg.dead_member_timeout_ms = 3_000;
    cfg.min_workers = 4;
    cfg.eval_every_epochs = 1;
    cfg
}

pub const SIX: [(&str, Tier); 6] = [
    ("r1", Tier::Reliable),
    ("r2", Tier::Reliable),
    ("t1", Tier::Transient),
    ("t2", Tier::Transient),
    ("t3", Tier::Transient),
    ("t4", Tier::Transient),
];

async fn run_mnist(revoke_at_clock: Option<u64>) -> f64 {
    let mut c = Cluster::start(mnist_config(), &SIX).await;
    let started = c
        .coord
        .wait_for(Duration::from_secs(60), |s| s.state == JobState::Running)
        .await;
    assert!(
        started.is_some(),
        "job never started: {:#?}",
        c.coord.status()
    );
    // Training may start before the last agents finish loading (4 workers suffice); wait for
    // the full layout.
    let full = c
        .coord
        .wait_for(Duration::from_secs(60), |s| {
            s.stage == Some(Stage::Stage3) && s.members.len() == 6
        })
        .await;
    assert!(
        full.is_some(),
        "never reached stage 3 with all six: {:#?}",
        c.coord.status()
    );
    let view = c.coord.with(|co| co.view().cloned()).expect("a view");
    assert_eq!(view.stage, Stage::Stage3);
    assert_eq!(view.workers.len(), 4);
    assert_eq!(view.shards.len(), 2);
    if let Some(at) = revoke_at_clock {
        c.coord
            .wait_for(Duration::from_secs(120), |s| s.progress.clock >= at)
            .await
            .expect("training progresses");
        // Bulk revocation: half the transient machines, both shard owners among them if possible.
        let owners: Vec<String> = view.shards.iter().map(|s| s.active.0.clone()).collect();
        let mut victims: Vec<String> = owners.clone();
        victims.dedup();
        for t in ["t1", "t2", "t3", "t4"] {
            if victims.len() < 2 && !victims.iter().any(|v| v == t) {
                victims.push(t.to_string());
            }
        }
        eprintln!(
            "revoking {victims:?} at clock {}",
            c.coord.status().progress.clock
        );
        for v in &victims {
            c.agent(v).imds.announce_interruption(120);
        }
        for v in &victims {
            let code = c.agent(v).wait_exit(Duration::from_secs(60)).await;
            assert_eq!(
                code,
                Some(0),
                "warned agent {v} must hand over and exit 0:\n{}",
                c.agent(v).log_text()
            );
        }
        let after = c.coord.with(|co| co.view().cloned()).expect("a view");
        assert_eq!(
            after.stage,
            Stage::Stage2,
            "2 reliable + 2 transient is stage 2"
        );
        assert!(after.shards.iter().all(|s| !victims.contains(&s.active.0)));
        for v in &victims {
            assert!(c.agent(v).log_text().contains("handed shard over") || !owners.contains(v));
        }
    }
    let st = c.wait_done(Duration::from_secs(240)).await;
    c.assert_all_exit_cleanly(Duration::from_secs(20)).await;
    let m = st.final_metric.expect("final metric");
    assert_eq!(m.kind, MetricKind::Accuracy);
    eprintln!(
        "MNIST accuracy {:.4} (baseline {:?}), revocation: {revoke_at_clock:?}",
        m.value, m.baseline
    );
    m.value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mlr_mnist_reaches_91_percent_and_survives_bulk_revocation() {
    let clean = run_mnist(None).await;
    assert!(clean >= 0.91, "accuracy {clean} below 91%");
    let revoked = run_mnist(Some(120)).await;
    assert!(
        revoked >= 0.91,
        "accuracy {revoked} below 91% after revocation"
    );
    assert!(
        (clean - revoked).abs() <= 0.005,
        "clean {clean} vs revoked {revoked}: more than 0.5 points apart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mf_four_workers_match_single_process_rmse() {
    let mut cfg = TrainingConfig::new(AppConfig::Mf {
        ratings_file: "movietweetings-100k.csv.gz".into(),
        rank: 10,
        learning_rate: 0.01,
        l2: 0.05,
        holdout_fraction: 0.1,
    });
    cfg.num_shards = 2;
    cfg.num_partitions = 16;
    cfg.clocks_per_epoch = 10;
    cfg.stop = StopCondition::Epochs { epochs: 10 };
    cfg.min_workers = 4;
    cfg.eval_every_epochs = 5;
    let app =
        App::load(&cfg, std::path::Path::new(crate::support::DATA_DIR)).expect("ratings load");
    let single = tokio::task::spawn_blocking({
        let total = cfg.total_clocks();
        let parts = cfg.num_partitions;
        move || app.train_local(total, parts)
    })
    .await
    .expect("local run")
    .expect("metric");

    let specs = [
        ("r1", Tier::Reliable),
        ("t1", Tier::Transient),
        ("t2", Tier::Transient),
        ("t3", Tier::Transient),
    ];
    let mut c = Cluster::start(cfg, &specs).await;
    let st = c.wait_done(Duration::from_secs(200)).await;
    c.assert_all_exit_cleanly(Duration::from_secs(20)).await;
    let dist = st.final_metric.expect("final metric");
    eprintln!(
        "MF held-out RMSE: 4 workers {:.4}, single process {:.4}, global-mean baseline {:?}",
        dist.value, single.value, single.baseline
    );
    assert_eq!(dist.kind, MetricKind::Rmse);
    assert!(
        dist.value < single.baseline.unwrap_or(f64::MAX),
        "MF must beat the global mean"
    );
    assert!(
        (dist.value - single.value).abs() / single.value <= 0.02,
        "{} vs {}",
        dist.value,
        single.value
    );
}
