//! Crashes without warning, rebalance recommendations, an unreachable broker.

use crate::support::{Cluster, log_field, spawn_agent};
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
    // The owners log every copy their backups acknowledge (`backup synced`, at debug).
    let mut c = Cluster::start_logging(cfg, &SIX, "info,proteus_agent::ps=debug").await;
    c.coord
        .wait_for(Duration::from_secs(60), |s| s.state == JobState::Running)
        .await
        .expect("starts");
    c.coord
        .wait_for(Duration::from_secs(120), |s| s.progress.clock >= 100)
        .await
        .expect("progress");
    let view = c.coord.with(|co| co.view().cloned()).expect("view");
    let victim = view.shards[0].active.0.clone();
    // The sync rule: an owner copies a shard that changed to its backup every sync interval.
    // So the backup of shard 0 comes to hold the clock the job has reached now; once it has
    // said so, the owner is killed, and that much must survive it.
    let reached = c.coord.status().progress.clock as i64;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let synced = loop {
        match last_synced(&c.agent(&victim).log_text(), 0) {
            Some(done) if done >= reached => break done,
            other if std::time::Instant::now() >= deadline => panic!(
                "the owner of shard 0 never synced its backup past clock {reached} \
                 (newest copy acknowledged: {other:?}): the sync rule is broken"
            ),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let kill_clock = c.coord.status().progress.clock as i64;
    c.agent(&victim).kill9();
    // The newest copy the backup acknowledged before the kill (it may be newer than `synced`).
    let synced_at_kill = last_synced(&c.agent(&victim).log_text(), 0).unwrap_or(synced);
    eprintln!("kill -9 {victim} at clock {kill_clock}; its backup held clock {synced_at_kill}");
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
    let done = log_field::<i64>(&restored[0], "done")
        .expect("restore line says which clock the backup completed");
    // Work lost is what the backup had not been sent: nothing it acknowledged is lost, so the
    // restore starts at or after the newest acknowledged copy (and so after `reached`, the clock
    // the job had made when the kill was decided). Counted in clocks, whatever this machine's
    // speed.
    eprintln!(
        "clocks lost with the crashed shard: {} (the job at {kill_clock} by the coordinator)",
        kill_clock - done
    );
    assert!(
        done >= synced_at_kill && done >= reached,
        "the restore started at clock {done}, older than the backup's acknowledged copy \
         ({synced_at_kill}; the job had reached {reached}): acknowledged work was lost"
    );
}

/// The clock of the newest copy of `shard` whose backup acknowledged it, from an owner's log.
fn last_synced(log: &str, shard: u32) -> Option<i64> {
    log.lines()
        .filter(|l| l.contains("backup synced"))
        .filter(|l| log_field::<i64>(l, "shard") == Some(i64::from(shard)))
        .filter_map(|l| log_field::<i64>(l, "done"))
        .next_back()
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
