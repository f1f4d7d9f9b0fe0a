//! Crashes without warning, rebalance recommendations, an unreachable broker.

use crate::support::{Cluster, spawn_agent};
use crate::training::{SIX, mnist_config};
use proteus_wire::Tier;
use proteus_wire::agent_api::{
    AppConfig, ImageDataset, ShardSource, StopCondition, TrainingConfig,
};
use proteus_wire::coordinator::JobState;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_of_a_shard_owner_loses_little_and_job_completes() {
    let mut cfg = mnist_config();
    cfg.stop = StopCondition::Epochs { epochs: 3 };
    let mut c = Cluster::start(cfg, &SIX).await;
    c.coord
        .wait_for(Duration::from_secs(60), |s| s.state == JobState::Running)
        .await
        .expect("starts");
    let c0 = c
        .coord
        .wait_for(Duration::from_secs(120), |s| s.progress.clock >= 20)
        .await
        .expect("progress")
        .progress
        .clock;
    // Timed from when clock c0 was seen, not from before waiting for it: time spent reaching
    // c0 would understate the rate, and with it the bound on lost clocks below.
    let t0 = std::time::Instant::now();
    let c1 = c
        .coord
        .wait_for(Duration::from_secs(120), |s| s.progress.clock >= 100)
        .await
        .expect("progress")
        .progress
        .clock;
    let clocks_per_sec = (c1 - c0) as f64 / t0.elapsed().as_secs_f64();
    let view = c.coord.with(|co| co.view().cloned()).expect("view");
    let victim = view.shards[0].active.0.clone();
    let kill_clock = c.coord.status().progress.clock;
    eprintln!("kill -9 {victim} at clock {kill_clock} ({clocks_per_sec:.1} clocks/s)");
    c.agent(&victim).kill9();
    // Detected by heartbeat timeout; its shard is restored from the backup.
    let after = c
        .coord
        .wait_for(Duration::from_secs(30), |s| {
            s.members.iter().all(|m| m.instance_id.0 != victim)
        })
        .await;
    assert!(after.is_some(), "dead member never removed");
    let v = c.coord.with(|co| co.view().cloned()).expect("view");
    let s0 = &v.shards[0];
    assert!(
        matches!(&s0.source, ShardSource::Restore { .. }),
        "{:?}",
        s0.source
    );
    let st = c.wait_done(Duration::from_secs(240)).await;
    c.assert_all_exit_cleanly(Duration::from_secs(20)).await;
    let m = st.final_metric.expect("metric");
    eprintln!("after kill -9: accuracy {:.4}", m.value);
    assert!(m.value >= 0.90, "accuracy {} after a crash", m.value);
    // The new owner restored the backup and says how much it had.
    let restored: Vec<String> = c
        .agents
        .iter()
        .flat_map(|a| {
            a.log_text()
                .lines()
                .filter(|l| l.contains("serving shard") && l.contains("Restore"))
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .collect();
    eprintln!("restore: {restored:?}");
    assert_eq!(restored.len(), 1);
    // Work lost = clocks between the restored copy and the kill: bounded by the sync interval
    // (0.3 s here) plus one heartbeat of reporting lag, in clocks.
    let done: i64 = restored[0]
        .split("done=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|d| d.parse().ok())
        .expect("restore line says which clock the backup completed");
    let lost = kill_clock as i64 - done;
    let bound = (clocks_per_sec * (0.3 + 0.3)).ceil() as i64 + 2;
    eprintln!("clocks lost with the crashed shard: {lost} (bound {bound})");
    assert!(
        lost <= bound,
        "lost {lost} clocks, more than the sync interval's worth ({bound})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalance_moves_shards_early_without_exiting() {
    let mut cfg = TrainingConfig::new(AppConfig::Mlr {
        dataset: ImageDataset::Digits,
        learning_rate: 0.5,
        l2: 0.0,
    });
    cfg.clocks_per_epoch = 10;
    cfg.stop = StopCondition::Epochs { epochs: 40 };
    cfg.min_workers = 3;
    let specs = [
        ("r1", Tier::Reliable),
        ("t1", Tier::Transient),
        ("t2", Tier::Transient),
    ];
    let mut c = Cluster::start(cfg, &specs).await;
    c.coord
        .wait_for(Duration::from_secs(60), |s| s.progress.clock >= 20)
        .await
        .expect("progress");
    let view = c.coord.with(|co| co.view().cloned()).expect("view");
    let owner = view.shards[0].active.0.clone();
    c.agent(&owner).imds.announce_rebalance();
    let moved = c
        .coord
        .wait_for(Duration::from_secs(20), |s| {
            s.members.iter().any(|m| {
                m.instance_id.0 == owner
                    && m.roles.active_shards.is_empty()
                    && m.roles.worker.is_some()
            })
        })
        .await;
    assert!(moved.is_some(), "shards did not move off {owner}");
    let st = c.wait_done(Duration::from_secs(120)).await;
    assert_eq!(st.state, JobState::Completed);
    // A recommendation is not a notice: the owner worked to the end and left only when the
    // finished job stopped everyone, not as an interrupted instance.
    assert!(
        st.departed
            .iter()
            .filter(|d| d.instance_id.0 == owner)
            .all(|d| matches!(
                &d.reason,
                proteus_wire::coordinator::DepartureReason::Exited {
                    reason: proteus_wire::agent_api::ExitReason::Stopped
                }
            )),
        "{owner} left early: {:?}",
        st.departed
    );
    c.assert_all_exit_cleanly(Duration::from_secs(20)).await;
    assert!(
        c.agent(&owner)
            .log_text()
            .contains("rebalance recommendation")
    );
    assert!(
        // This configuration (digits, 40 short epochs) ends near 0.89; a lost shard costs more.
        st.final_metric.is_some_and(|m| m.value >= 0.87),
        "{:?}",
        st.final_metric
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_retries_until_broker_is_reachable() {
    // Reserve a port, start the agent against it with nothing listening.
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = probe.local_addr().expect("addr");
    drop(probe);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut a = spawn_agent(&format!("http://{addr}"), "r1", dir.path()).await;
    // It retries (and says so) rather than giving up...
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !a
        .log_text()
        .contains("broker unreachable; retrying registration")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no retry logged: {}",
            a.log_text()
        );
        assert!(
            a.wait_exit(Duration::from_millis(100)).await.is_none(),
            "agent must not give up: {}",
            a.log_text()
        );
    }
    // ...and registers once a broker listens there.
    let coord = proteus_agent::testing::TestCoordinator::start_at(
        crate::training::mnist_config(),
        &[("tok-r1", "r1", Tier::Reliable)],
        addr,
    )
    .await
    .expect("a coordinator on the reserved port");
    let joined = coord
        .wait_for(Duration::from_secs(60), |s| {
            s.members.iter().any(|m| m.instance_id.0 == "r1")
        })
        .await;
    assert!(
        joined.is_some(),
        "the agent registered once the broker was up: {}",
        a.log_text()
    );
    assert!(a.wait_exit(Duration::from_millis(10)).await.is_none());
}
