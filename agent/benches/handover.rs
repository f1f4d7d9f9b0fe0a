//! Time from an interruption warning to a 100 MB shard serving on another machine.
//!
//! Two real agent processes: a transient one serving the only shard (100 MB, synthetic app, no
//! workers) and a reliable one holding its backup. The transient one's IMDS mock announces an
//! interruption; we time until the reliable one answers a pull for the shard.

mod common;

use proteus_agent::testing::TestCoordinator;
use proteus_agent::transport::{DataPlane, MAX_FRAME, Peers, Request, Response};
use proteus_wire::Tier;
use proteus_wire::agent_api::{AppConfig, TrainingConfig};
use proteus_wire::coordinator::MemberState;
use std::time::{Duration, Instant};

const MODEL_LEN: u64 = 25_000_000; // 100 MB of f32
const RUNS: usize = 5;
const TARGET_SECS: f64 = 2.0;
const IMDS_POLL_MS: u64 = 200;

async fn one_run() -> (f64, f64) {
    let mut cfg = TrainingConfig::new(AppConfig::Synthetic {
        model_len: MODEL_LEN,
    });
    cfg.num_shards = 1;
    cfg.min_workers = 1000; // shards only: no training traffic
    cfg.backup_sync_interval_ms = 1000;
    let coord = TestCoordinator::start(
        cfg,
        &[
            ("tok-r", "r", Tier::Reliable),
            ("tok-t", "t", Tier::Transient),
        ],
    )
    .await
    .expect("coordinator");
    let _r = common::spawn_agent(&coord.url(), "r", IMDS_POLL_MS).await;
    let t = common::spawn_agent(&coord.url(), "t", IMDS_POLL_MS).await;
    let ready = coord
        .wait_for(Duration::from_secs(60), |s| {
            let role = |id: &str| {
                s.members
                    .iter()
                    .find(|m| m.instance_id.0 == id)
                    .map(|m| m.progress.clone())
            };
            role("t").is_some_and(|p| p.active_shards == [0])
                && role("r").is_some_and(|p| p.backup_shards == [0])
        })
        .await;
    assert!(
        ready.is_some(),
        "layout never settled: {:#?}",
        coord.status()
    );
    let r_addr = coord
        .status()
        .members
        .iter()
        .find(|m| m.instance_id.0 == "r")
        .map(|m| m.data_addr.clone())
        .expect("r");

    let start = Instant::now();
    t.1.announce_interruption(120);
    // The bench reads the agents' shards as one of the job's peers, with the job's secret.
    let secret = coord
        .with(|c| c.data_secret().cloned())
        .expect("the job has a data-plane secret");
    let client = Peers::new("bench".into(), DataPlane::new(secret, MAX_FRAME));
    let mut warned_at = None;
    loop {
        if warned_at.is_none() {
            let st = coord.status();
            let leaving = st
                .members
                .iter()
                .any(|m| m.instance_id.0 == "t" && m.state == MemberState::Leaving);
            if leaving || !st.departed.is_empty() {
                warned_at = Some(start.elapsed().as_secs_f64());
            }
        }
        let req = Request::Pull {
            shard: 0,
            need: None,
            wait_ms: 0,
        };
        if let Ok(Response::Params { values, .. }) =
            client.call(&r_addr, &req, Duration::from_secs(30)).await
        {
            assert_eq!(values.len() as u64, MODEL_LEN);
            let total = start.elapsed().as_secs_f64();
            let w = warned_at.unwrap_or(total);
            return (total, total - w);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "shard never served elsewhere"
        );
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (mut totals, mut after) = (Vec::new(), Vec::new());
        for i in 0..RUNS {
            let (total, from_broker) = one_run().await;
            println!("run {i}: warning posted -> serving elsewhere {total:.3} s (broker told -> serving {from_broker:.3} s)");
            totals.push(total);
            after.push(from_broker);
        }
        let med = common::median(&mut totals);
        let med_after = common::median(&mut after);
        println!(
            "Hand-over of a 100 MB shard: median {med:.3} s from the IMDS notice to serving on the backup machine \
             (IMDS polled every {IMDS_POLL_MS} ms; {med_after:.3} s from the broker learning of it) \
             (target < {TARGET_SECS:.1} s: ratio {:.2} of target; load average {})",
            med / TARGET_SECS,
            common::load_average()
        );
    });
}
