//! Promotion of a BackupPS: it holds exactly the updates up to its sequence number.

use proteus_agent::apps::App;
use proteus_agent::ps::{PsNode, ShardState};
use proteus_agent::transport::{DataPlane, MAX_FRAME, Peers};
use proteus_wire::InstanceId;
use proteus_wire::Tier;
use proteus_wire::agent_api::{
    ClusterView, KeyRange, MemberInfo, ShardPlacement, ShardSource, Stage,
};
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;

async fn node(name: &str, app: Arc<App>) -> (Arc<PsNode>, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let peers = Peers::new(addr.clone(), test_plane());
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    std::mem::forget(_rx);
    let node = PsNode::new(InstanceId(name.into()), app, 4, peers.clone(), tx);
    peers.set_handler(node.clone());
    tokio::spawn(peers.serve(listener));
    (node, addr)
}

fn view(
    epoch: u64,
    active: &str,
    backup: &str,
    source: ShardSource,
    addrs: &[(&str, &str)],
    len: u64,
) -> ClusterView {
    ClusterView {
        epoch,
        stage: Stage::Stage2,
        founders: Vec::new(),
        pipeline: None,
        profiler: None,
        members: addrs
            .iter()
            .map(|(n, a)| MemberInfo {
                instance_id: InstanceId(n.to_string()),
                tier: Tier::Transient,
                data_addr: a.to_string(),
                draining: false,
            })
            .collect(),
        shards: vec![ShardPlacement {
            shard: 0,
            keys: KeyRange { start: 0, end: len },
            active: InstanceId(active.into()),
            backup: Some(InstanceId(backup.into())),
            source,
        }],
        workers: vec![],
        num_partitions: 4,
        model_len: len,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promoted_backup_holds_every_update_up_to_its_seq() {
    const LEN: usize = 10_000;
    let app = Arc::new(App::Synthetic { model_len: LEN });
    let (active, a_addr) = node("a", app.clone()).await;
    let (backup, b_addr) = node("b", app.clone()).await;
    let (spare, c_addr) = node("c", app.clone()).await;
    let addrs = [
        ("a", a_addr.as_str()),
        ("b", b_addr.as_str()),
        ("c", c_addr.as_str()),
    ];
    let init = app.init(0..LEN);
    active.install_active(0, ShardState::fresh(0, init.clone(), 4));
    active.apply_view(&view(1, "a", "b", ShardSource::Fresh, &addrs, LEN as u64));

    // A log of every update the active applies, in order.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut log: Vec<Vec<f32>> = Vec::new();
    let mut synced_at = 0;
    for clock in 0..30u64 {
        for p in 0..4u32 {
            let delta: Vec<f32> = (0..LEN).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            // Through the real request path, over TCP.
            let peers = Peers::new("client".into(), test_plane());
            let resp = peers
                .call(
                    &a_addr,
                    &proteus_agent::transport::Request::Push {
                        shard: 0,
                        clock,
                        partitions: vec![p],
                        delta: delta.clone(),
                    },
                    Duration::from_secs(5),
                )
                .await
                .expect("push over tcp");
            assert!(matches!(
                resp,
                proteus_agent::transport::Response::Pushed(
                    proteus_agent::transport::PushOutcome::Applied
                )
            ));
            log.push(delta);
        }
        if clock == 19 {
            active.sync_backups().await;
            synced_at = log.len() as u64;
        }
    }
    // The active dies here (updates 81..=120 never reach the backup). Promote the backup by view.
    drop(active);
    let copy = backup.backup_copy(0).expect("backup holds a copy");
    assert_eq!(
        copy.seq, synced_at,
        "backup's seq is the number of updates it holds"
    );
    let mut expected = init.clone();
    for d in &log[..synced_at as usize] {
        for (e, x) in expected.iter_mut().zip(d) {
            *e += x;
        }
    }
    assert!(
        copy.values
            .iter()
            .zip(&expected)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "value-for-value equality"
    );
    assert_eq!(copy.clocks.done(), Some(19));

    // A third machine becomes active and restores from b over the network.
    spare.apply_view(&view(
        2,
        "c",
        "b",
        ShardSource::Restore {
            from: InstanceId("b".into()),
        },
        &addrs[1..],
        LEN as u64,
    ));
    let mut promoted = None;
    for _ in 0..100 {
        if let Some(s) = spare.active_copy(0) {
            promoted = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let promoted = promoted.expect("spare serves the shard");
    assert_eq!(promoted.seq, synced_at);
    assert!(
        promoted
            .values
            .iter()
            .zip(&expected)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    // Clock 20's partitions are missing on the promoted shard: workers will resend them.
    assert_eq!(promoted.clocks.missing(20), vec![0, 1, 2, 3]);
}

/// One job's data plane: every peer of this test shares its secret.
fn test_plane() -> DataPlane {
    DataPlane::new(
        proteus_wire::agent_api::DataSecret::from_bytes([7; 32]),
        MAX_FRAME,
    )
}
