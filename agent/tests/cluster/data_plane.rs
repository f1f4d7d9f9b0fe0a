//! The data plane admits only the job's agents, and only frames the job can need: a real agent
//! process, raw TCP clients playing the rogue, and the model read before and after.

use crate::support::Cluster;
use proteus_agent::apps::App;
use proteus_agent::transport::{
    DataPlane, MAX_FRAME, Peers, Request, Response, hello_as_initiator,
};
use proteus_wire::Tier;
use proteus_wire::agent_api::{AppConfig, DataSecret, TrainingConfig};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MODEL_LEN: usize = 5_000;

/// One reliable agent holding the whole model as shard 0, with no worker: nothing changes the
/// parameters but a push that the agent accepts.
async fn shard_holder() -> (Cluster, String, DataSecret, TrainingConfig) {
    let mut cfg = TrainingConfig::new(AppConfig::Synthetic {
        model_len: MODEL_LEN as u64,
    });
    cfg.num_shards = 1;
    cfg.min_workers = 1000; // shards only: no training traffic
    let cluster = Cluster::start(cfg.clone(), &[("r", Tier::Reliable)]).await;
    let ready = cluster
        .coord
        .wait_for(Duration::from_secs(60), |s| {
            s.members
                .iter()
                .any(|m| m.instance_id.0 == "r" && m.progress.active_shards == [0])
        })
        .await;
    if ready.is_none() {
        cluster.dump_logs();
        panic!(
            "the agent never took shard 0: {:#?}",
            cluster.coord.status()
        );
    }
    let addr = cluster.coord.status().members[0].data_addr.clone();
    let secret = cluster
        .coord
        .with(|c| c.data_secret().cloned())
        .expect("the job has a secret");
    (cluster, addr, secret, cfg)
}

async fn pull(peers: &std::sync::Arc<Peers>, addr: &str) -> proteus_agent::Result<Response> {
    let req = Request::Pull {
        shard: 0,
        need: None,
        wait_ms: 0,
    };
    peers.call(addr, &req, Duration::from_secs(5)).await
}

async fn model(addr: &str, secret: &DataSecret) -> Vec<f32> {
    let peers = Peers::new("test".into(), DataPlane::new(secret.clone(), MAX_FRAME));
    match pull(&peers, addr).await {
        Ok(Response::Params { values, .. }) => values.to_vec(),
        other => panic!("the job's own peer cannot pull: {other:?}"),
    }
}

/// A frame as the agent's peers encode it (`u32` length, kind 1 = request, id, body).
fn request_frame(id: u64, req: &Request) -> Vec<u8> {
    let mut e = proteus_agent::transport::Enc::default();
    req.encode(&mut e);
    let mut out = Vec::new();
    out.extend_from_slice(&((1 + 8 + e.0.len()) as u32).to_le_bytes());
    out.push(1);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&e.0);
    out
}

/// Everything the agent sends until it closes the connection (or 5 s pass: then `None`).
async fn read_until_closed(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut got)).await;
    match read {
        Ok(Ok(_)) => Some(got),
        // A reset is a close too.
        Ok(Err(_)) => Some(got),
        Err(_) => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rogue_peer_without_the_secret_reads_no_parameter_and_changes_none() {
    let (mut cluster, addr, secret, _) = shard_holder().await;
    let before = model(&addr, &secret).await;
    assert_eq!(before.len(), MODEL_LEN);
    let push = Request::Push {
        shard: 0,
        clock: 0,
        partitions: vec![0, 1, 2, 3],
        delta: vec![1000.0; MODEL_LEN],
    };
    let pull_req = Request::Pull {
        shard: 0,
        need: None,
        wait_ms: 0,
    };

    // 1. The old protocol: frames straight away, no hello.
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    let mut bytes = request_frame(1, &push);
    bytes.extend(request_frame(2, &pull_req));
    let _ = s.write_all(&bytes).await;
    let answer = read_until_closed(&mut s).await;
    assert_eq!(
        answer,
        Some(Vec::new()),
        "the agent answered a peer with no hello"
    );

    // 2. The hello's form with a made-up proof, then frames anyway: the agent's challenge is
    //    all it ever sends (32-byte nonce + 32-byte proof of its own), then it hangs up.
    let mut s = TcpStream::connect(&addr).await.expect("connect");
    let mut hello = b"PRTSDP01".to_vec();
    hello.extend_from_slice(&[9u8; 32]);
    s.write_all(&hello).await.expect("hello");
    let mut challenge = [0u8; 64];
    s.read_exact(&mut challenge).await.expect("challenge");
    let mut bytes = vec![0u8; 32]; // not the HMAC of anything
    bytes.extend(request_frame(1, &push));
    bytes.extend(request_frame(2, &pull_req));
    let _ = s.write_all(&bytes).await;
    let answer = read_until_closed(&mut s).await;
    assert_eq!(
        answer,
        Some(Vec::new()),
        "the agent answered a forged proof"
    );

    // 3. The real client code with another job's secret: refused at the hello.
    let rogue = Peers::new(
        "rogue".into(),
        DataPlane::new(DataSecret::from_bytes([0x5a; 32]), MAX_FRAME),
    );
    let err = pull(&rogue, &addr)
        .await
        .expect_err("a wrong secret is refused");
    assert!(err.to_string().contains("secret"), "{err}");
    assert!(
        rogue
            .call(&addr, &push, Duration::from_secs(5))
            .await
            .is_err()
    );

    // The model is exactly as it was, and the agent says why it hung up.
    let after = model(&addr, &secret).await;
    assert_eq!(before, after, "a rogue changed the parameters");
    let log = cluster.agent("r").log_text();
    assert!(
        log.matches("refused a data-plane connection").count() >= 3,
        "{log}"
    );
    // The job's own peers still work over the same port: the push applies, and is visible.
    let own = Peers::new("own".into(), DataPlane::new(secret.clone(), MAX_FRAME));
    let pushed = own.call(&addr, &push, Duration::from_secs(5)).await;
    assert!(matches!(pushed, Ok(Response::Pushed(_))), "{pushed:?}");
    let changed = model(&addr, &secret).await;
    assert_ne!(
        before, changed,
        "a push with the secret must change the model"
    );
    cluster.agent("r").kill9();
}

/// `VmPeak` of a process: the most address space it ever had (a `Vec::with_capacity` of the
/// declared length would raise it by that much even if the pages are never touched).
fn vm_peak_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmPeak:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmPeak")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_over_the_jobs_bound_is_refused_without_allocating_it() {
    let (mut cluster, addr, secret, cfg) = shard_holder().await;
    let bound = App::Synthetic {
        model_len: MODEL_LEN,
    }
    .max_frame(&cfg);
    assert!(
        bound < 1 << 20,
        "a 5000-parameter job needs no more: {bound}"
    );
    let pid = cluster.agent("r").pid().expect("running");
    let peak_before = vm_peak_kib(pid);

    for declared in [bound + 1, 768 << 20] {
        // An authenticated peer, so that only the bound can stop it.
        let mut s = TcpStream::connect(&addr).await.expect("connect");
        hello_as_initiator(&mut s, &secret).await.expect("hello");
        let mut header = (declared as u32).to_le_bytes().to_vec();
        header.extend_from_slice(&[1u8; 1024]); // the start of a body
        let _ = s.write_all(&header).await;
        let answer = read_until_closed(&mut s).await;
        assert_eq!(
            answer,
            Some(Vec::new()),
            "a declared {declared}-byte frame was not refused"
        );
    }
    let peak_after = vm_peak_kib(pid);
    assert!(
        peak_after < peak_before + (256 << 10),
        "the agent reserved memory for the frame: VmPeak {peak_before} kB -> {peak_after} kB"
    );
    let log = cluster.agent("r").log_text();
    assert!(log.contains("exceeds this job's bound"), "{log}");
    // A frame within the bound still works on a fresh connection.
    assert_eq!(model(&addr, &secret).await.len(), MODEL_LEN);
    cluster.agent("r").kill9();
}
