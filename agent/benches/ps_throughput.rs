//! PS pull/push throughput on loopback with 4 MB dense updates.
//!
//! One agent-side PS node serving one 4 MB shard; `CLIENTS` workers, each its own process-like
//! peer with its own TCP connection, alternate a 4 MB push and a 4 MB pull. Reports the median
//! aggregate payload rate over several rounds against the 1 GB/s target.

mod common;

use proteus_agent::apps::App;
use proteus_agent::ps::{PsNode, ShardState};
use proteus_agent::transport::{DataPlane, MAX_FRAME, Peers, Request, Response};
use proteus_wire::InstanceId;
use std::sync::Arc;
use std::time::{Duration, Instant};

const FLOATS: usize = 1 << 20; // 4 MiB of f32
const CLIENTS: u32 = 4;
const OPS_PER_CLIENT: u64 = 40;
const ROUNDS: usize = 5;
const TARGET_GBPS: f64 = 1.0;

async fn client(addr: String, partition: u32, round: u64) -> u64 {
    let peers = Peers::new(format!("client-{partition}"), test_plane());
    let delta = vec![0.001f32; FLOATS];
    let mut bytes = 0u64;
    for i in 0..OPS_PER_CLIENT {
        let clock = round * OPS_PER_CLIENT + i;
        let push = Request::Push {
            shard: 0,
            clock,
            partitions: vec![partition],
            delta: delta.clone(),
        };
        match peers.call(&addr, &push, Duration::from_secs(30)).await {
            Ok(Response::Pushed(_)) => bytes += (FLOATS * 4) as u64,
            other => panic!("push failed: {other:?}"),
        }
        let pull = Request::Pull {
            shard: 0,
            need: None,
            wait_ms: 0,
        };
        match peers.call(&addr, &pull, Duration::from_secs(30)).await {
            Ok(Response::Params { values, .. }) => bytes += (values.len() * 4) as u64,
            other => panic!("pull failed: {other:?}"),
        }
    }
    bytes
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let peers = Peers::new(addr.clone(), test_plane());
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let app = Arc::new(App::Synthetic { model_len: FLOATS });
        let node = PsNode::new(InstanceId("ps".into()), app.clone(), CLIENTS, peers.clone(), tx);
        node.install_active(0, ShardState::fresh(0, app.init(0..FLOATS), CLIENTS));
        peers.set_handler(node.clone());
        tokio::spawn(peers.serve(listener));

        let mut rates = Vec::new();
        let mut per_cpu = Vec::new();
        for round in 0..ROUNDS as u64 {
            let t = Instant::now();
            let cpu0 = common::cpu_seconds();
            let handles: Vec<_> =
                (0..CLIENTS).map(|p| tokio::spawn(client(addr.clone(), p, round))).collect();
            let mut bytes = 0;
            for h in handles {
                bytes += h.await.expect("client");
            }
            let gbps = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
            let cpu = common::cpu_seconds() - cpu0;
            let gb_per_cpu_s = if cpu > 0.0 { bytes as f64 / 1e9 / cpu } else { f64::NAN };
            println!(
                "round {round}: {:.2} GB/s ({} MB moved, {cpu:.2} CPU-s: {gb_per_cpu_s:.2} GB per CPU-second)",
                gbps,
                bytes / 1_000_000
            );
            rates.push(gbps);
            per_cpu.push(gb_per_cpu_s);
        }
        let med = common::median(&mut rates);
        let med_cpu = common::median(&mut per_cpu);
        println!(
            "PS pull/push throughput, 4 MB dense updates, {CLIENTS} clients on loopback: median {med:.2} GB/s aggregate \
             (target >= {TARGET_GBPS:.1} GB/s: ratio {:.2}x)",
            med / TARGET_GBPS
        );
        println!(
            "  work per CPU: median {med_cpu:.2} GB per CPU-second (server and clients together); \
             with both cores free that is {:.2} GB/s (load average now {})",
            med_cpu * 2.0,
            common::load_average()
        );
    });
}

/// One job's data plane: every peer of this test shares its secret.
fn test_plane() -> DataPlane {
    DataPlane::new(
        proteus_wire::agent_api::DataSecret::from_bytes([7; 32]),
        MAX_FRAME,
    )
}
