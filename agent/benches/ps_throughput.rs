//! PS pull/push throughput on loopback with 4 MB dense updates.
//!
//! One agent-side PS node serving one 4 MB shard; `CLIENTS` workers, each its own process-like
//! peer with its own TCP connection (opened, with its hello, in every round), run BSP clocks: a
//! 4 MB push of its partition, then a 4 MB pull once every client pushed that clock. Only pushes
//! the shard applied and pulls of complete clocks count (anything else fails the run). Reports
//! the median aggregate payload rate over several rounds against the 1 GB/s target.
//!
//! The cost of the authenticated hello, in the same run: every round is run twice, against a
//! node whose connections prove the job's secret and against one whose connections skip the
//! hello (a benchmark-only mode), and `CONNECTS` fresh connections each carrying one small
//! request are timed both ways.

mod common;

use proteus_agent::apps::App;
use proteus_agent::ps::{PsNode, ShardState};
use proteus_agent::transport::{DataPlane, MAX_FRAME, Peers, PushOutcome, Request, Response};
use proteus_wire::InstanceId;
use std::sync::Arc;
use std::time::{Duration, Instant};

const FLOATS: usize = 1 << 20; // 4 MiB of f32
const CLIENTS: u32 = 4;
const OPS_PER_CLIENT: u64 = 40;
const ROUNDS: usize = 5;
const TARGET_GBPS: f64 = 1.0;

const CONNECTS: usize = 300;

/// One worker's rounds, as a BSP worker runs them: push its partition's update for a clock, then
/// pull the shard once that clock is complete (every client pushed it). The pull waits on the
/// others, so no client runs ahead and every push is one the shard applies; only applied pushes
/// and complete pulls are counted, and any other answer fails the run.
async fn client(addr: String, partition: u32, round: u64, plane: DataPlane) -> u64 {
    let peers = Peers::new(format!("client-{partition}"), plane);
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
            Ok(Response::Pushed(PushOutcome::Applied)) => bytes += (FLOATS * 4) as u64,
            other => panic!("client {partition}: push of clock {clock} not applied: {other:?}"),
        }
        let pull = Request::Pull {
            shard: 0,
            need: Some(clock),
            wait_ms: 30_000,
        };
        match peers.call(&addr, &pull, Duration::from_secs(40)).await {
            Ok(Response::Params { values, done, .. }) if done.is_some_and(|d| d >= clock) => {
                assert_eq!(values.len(), FLOATS, "a pull returns the whole shard");
                bytes += (values.len() * 4) as u64
            }
            other => panic!("client {partition}: pull of complete clock {clock} failed: {other:?}"),
        }
    }
    bytes
}

fn main() -> std::process::ExitCode {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let met = rt.block_on(async {
        let planes = [
            ("authenticated hello", test_plane()),
            ("no hello", test_plane().without_hello_for_benchmarks()),
        ];
        let mut addrs = Vec::new();
        for (_, plane) in &planes {
            addrs.push(serve(plane.clone()).await);
        }

        let mut rates = [Vec::new(), Vec::new()];
        let mut per_cpu = Vec::new();
        for round in 0..ROUNDS as u64 {
            for (i, (name, plane)) in planes.iter().enumerate() {
                let t = Instant::now();
                let cpu0 = common::cpu_seconds();
                let handles: Vec<_> = (0..CLIENTS)
                    .map(|p| tokio::spawn(client(addrs[i].clone(), p, round, plane.clone())))
                    .collect();
                let mut bytes = 0;
                for h in handles {
                    bytes += h.await.expect("client");
                }
                let gbps = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
                let cpu = common::cpu_seconds() - cpu0;
                let gb_per_cpu_s = if cpu > 0.0 { bytes as f64 / 1e9 / cpu } else { f64::NAN };
                println!(
                    "round {round} ({name}): {:.2} GB/s ({} MB moved, {cpu:.2} CPU-s: {gb_per_cpu_s:.2} GB per CPU-second)",
                    gbps,
                    bytes / 1_000_000
                );
                rates[i].push(gbps);
                if i == 0 {
                    per_cpu.push(gb_per_cpu_s);
                }
            }
        }
        let med = common::median(&mut rates[0]);
        let med_open = common::median(&mut rates[1]);
        let med_cpu = common::median(&mut per_cpu);
        println!(
            "PS pull/push throughput, 4 MB dense updates, {CLIENTS} clients on loopback: median {med:.2} GB/s aggregate \
             (target >= {TARGET_GBPS:.1} GB/s: ratio {:.2}x)",
            med / TARGET_GBPS
        );
        println!(
            "  authenticated hello vs none, same run: {med:.2} vs {med_open:.2} GB/s (ratio {:.3})",
            med / med_open
        );
        println!(
            "  work per CPU: median {med_cpu:.2} GB per CPU-second (server and clients together); \
             with both cores free that is {:.2} GB/s (load average now {})",
            med_cpu * 2.0,
            common::load_average()
        );

        // Connection set-up: a fresh connection and one small request, CONNECTS times each way,
        // interleaved so that both see the same machine.
        let mut micros = [Vec::new(), Vec::new()];
        for _ in 0..CONNECTS {
            for (i, (_, plane)) in planes.iter().enumerate() {
                let peers = Peers::new("connect".into(), plane.clone());
                let t = Instant::now();
                match peers.call(&addrs[i], &Request::Progress, Duration::from_secs(10)).await {
                    Ok(_) => micros[i].push(t.elapsed().as_secs_f64() * 1e6),
                    Err(e) => panic!("connect failed: {e}"),
                }
            }
        }
        let with = common::median(&mut micros[0]);
        let without = common::median(&mut micros[1]);
        println!(
            "  new connection + first request: median {with:.0} µs with the hello, {without:.0} µs without \
             (ratio {:.2}; {CONNECTS} each)",
            with / without
        );
        med >= TARGET_GBPS
    });
    // 0: the target is met; 1: it is missed.
    if met {
        std::process::ExitCode::SUCCESS
    } else {
        eprintln!("bench/agent-ps-throughput: target missed");
        std::process::ExitCode::from(1)
    }
}

/// A PS node serving one 4 MB shard on a fresh loopback port; its address.
async fn serve(plane: DataPlane) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let peers = Peers::new(addr.clone(), plane);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::mem::forget(rx);
    let app = Arc::new(App::Synthetic { model_len: FLOATS });
    let node = PsNode::new(
        InstanceId("ps".into()),
        app.clone(),
        CLIENTS,
        peers.clone(),
        tx,
    );
    node.install_active(0, ShardState::fresh(0, app.init(0..FLOATS), CLIENTS));
    peers.set_handler(node.clone());
    tokio::spawn(peers.serve(listener));
    addr
}

/// One job's data plane: every peer of this bench shares its secret.
fn test_plane() -> DataPlane {
    DataPlane::new(
        proteus_wire::agent_api::DataSecret::from_bytes([7; 32]),
        MAX_FRAME,
    )
}
