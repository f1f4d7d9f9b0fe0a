//! Hand-over fencing between in-process PS nodes over real TCP: a hand-over is served only by
//! the agent awaiting it from its sender in that ownership; a late, duplicated or reordered one
//! never replaces a shard already served, and no applied update is lost across a hand-over.

use proteus_agent::apps::App;
use proteus_agent::audit::AuditEvent;
use proteus_agent::ps::{HandoverTiming, PsNode, ShardState};
use proteus_agent::transport::{
    ClockState, DataPlane, Lineage, MAX_FRAME, Peers, PushOutcome, Request, Response, Snapshot,
};
use proteus_wire::agent_api::{
    ClusterView, DataSecret, KeyRange, MemberInfo, ShardPlacement, ShardSource, Stage,
};
use proteus_wire::{InstanceId, Tier};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const LEN: usize = 64;
const PARTITIONS: u32 = 4;
/// An address nobody listens on (a departing owner the test only impersonates).
const NOWHERE: &str = "127.0.0.1:1";

fn test_plane() -> DataPlane {
    DataPlane::new(DataSecret::from_bytes([9; 32]), MAX_FRAME)
}

fn id(name: &str) -> InstanceId {
    InstanceId(name.into())
}

/// A PS node serving on loopback, and a count of the pushes it applied.
struct Node {
    ps: Arc<PsNode>,
    addr: String,
    applied: Arc<AtomicU64>,
}

async fn node(name: &str, timing: HandoverTiming) -> Node {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let peers = Peers::new(addr.clone(), test_plane());
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::mem::forget(rx);
    let app = Arc::new(App::Synthetic { model_len: LEN });
    let ps = PsNode::new(id(name), app, PARTITIONS, peers.clone(), tx);
    ps.set_handover_timing(timing);
    let applied = Arc::new(AtomicU64::new(0));
    let count = applied.clone();
    ps.set_audit(Arc::new(move |ev| {
        if matches!(ev, AuditEvent::Applied { .. }) {
            count.fetch_add(1, Ordering::SeqCst);
        }
    }));
    peers.set_handler(ps.clone());
    tokio::spawn(peers.serve(listener));
    Node { ps, addr, applied }
}

/// One shard over the whole model, owned by `active`.
fn view(
    epoch: u64,
    active: &str,
    backup: Option<&str>,
    source: ShardSource,
    members: &[(&str, &str)],
) -> ClusterView {
    ClusterView {
        epoch,
        stage: Stage::Stage2,
        founders: Vec::new(),
        pipeline: None,
        profiler: None,
        members: members
            .iter()
            .map(|(n, a)| MemberInfo {
                instance_id: id(n),
                tier: Tier::Transient,
                data_addr: a.to_string(),
                draining: false,
            })
            .collect(),
        shards: vec![ShardPlacement {
            shard: 0,
            keys: KeyRange {
                start: 0,
                end: LEN as u64,
            },
            active: id(active),
            backup: backup.map(id),
            source,
        }],
        workers: vec![],
        num_partitions: PARTITIONS,
        model_len: LEN as u64,
    }
}

fn handover_from(from: &str, fallback: Option<&str>) -> ShardSource {
    ShardSource::Handover {
        from: id(from),
        fallback: fallback.map(id),
    }
}

/// A shard whose every value is `seq` (each update adds 1.0 everywhere) and whose clocks up to
/// `seq / PARTITIONS - 1` are complete.
fn snapshot(seq: u64) -> Snapshot {
    Snapshot {
        start: 0,
        seq,
        lineage: Lineage::Continuous,
        clocks: ClockState {
            done: (seq / u64::from(PARTITIONS)).checked_sub(1),
            partial: vec![],
        },
        values: vec![seq as f32; LEN],
    }
}

fn handover(epoch: u64, from: &str, snapshot: Snapshot) -> Request {
    Request::Handover {
        shard: 0,
        epoch,
        from: id(from),
        snapshot,
    }
}

async fn call(client: &Arc<Peers>, addr: &str, req: &Request) -> Response {
    client
        .call(addr, req, Duration::from_secs(5))
        .await
        .expect("call over tcp")
}

/// Push 1.0 everywhere for `partition` at `clock` until the shard applies it (or already has it).
async fn push(client: &Arc<Peers>, addr: &str, clock: u64, partition: u32) -> PushOutcome {
    let req = Request::Push {
        shard: 0,
        clock,
        partitions: vec![partition],
        delta: vec![1.0; LEN],
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match client.call(addr, &req, Duration::from_secs(5)).await {
            Ok(Response::Pushed(o @ (PushOutcome::Applied | PushOutcome::Duplicate))) => return o,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "push of clock {clock} partition {partition} never applied: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
}

async fn push_clock(client: &Arc<Peers>, addr: &str, clock: u64) {
    for p in 0..PARTITIONS {
        assert_eq!(push(client, addr, clock, p).await, PushOutcome::Applied);
    }
}

/// The state `node` serves once it serves one.
async fn serving(node: &PsNode) -> ShardState {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = node.active_copy(0) {
            return s;
        }
        assert!(Instant::now() < deadline, "the shard is never served");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What a test compares of a served shard: seq, values, clocks.
fn served(s: &ShardState) -> (u64, Vec<f32>, Option<u64>) {
    (s.seq, s.values.to_vec(), s.clocks.done())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_handover_never_replaces_the_shard_restored_meanwhile() {
    // The sender's budget is short: the receiver gives up soon and restores from c.
    let timing =
        HandoverTiming::from_send_budget(Duration::from_millis(200), Duration::from_millis(100));
    let b = node("b", timing).await;
    let c = node("c", timing).await;
    let client = Peers::new("client".into(), test_plane());
    // c holds a backup at seq 4 (clock 0 complete).
    let sync = Request::BackupSync {
        shard: 0,
        snapshot: snapshot(4),
    };
    assert_eq!(call(&client, &c.addr, &sync).await, Response::Ack);
    let members = [
        ("a", NOWHERE),
        ("b", b.addr.as_str()),
        ("c", c.addr.as_str()),
    ];
    let v = view(2, "b", Some("c"), handover_from("a", Some("c")), &members);
    c.ps.apply_view(&v);
    b.ps.apply_view(&v);
    // No hand-over comes in time: b restores c's copy and serves it; workers go on.
    assert_eq!(serving(&b.ps).await.seq, 4);
    push_clock(&client, &b.addr, 1).await;
    let before = served(&serving(&b.ps).await);
    assert_eq!(before, (8, vec![8.0; LEN], Some(1)));

    // Now a's hand-over of this very move arrives, late (and with more updates than b had).
    let late = call(&client, &b.addr, &handover(2, "a", snapshot(12))).await;
    assert_eq!(
        served(&serving(&b.ps).await),
        before,
        "serving state untouched"
    );
    assert_eq!(late, Response::Superseded);
    // Kept as the backup copy (b held none), never served.
    assert_eq!(b.ps.backup_copy(0).map(|s| s.seq), Some(12));
    // An older one is not even kept.
    let older = call(&client, &b.addr, &handover(2, "a", snapshot(10))).await;
    assert_eq!(served(&serving(&b.ps).await), before);
    assert_eq!(older, Response::Superseded);
    assert_eq!(b.ps.backup_copy(0).map(|s| s.seq), Some(12));
    // The data plane serves what it served before, and every push applied is in it.
    let pull = Request::Pull {
        shard: 0,
        need: None,
        wait_ms: 0,
    };
    match call(&client, &b.addr, &pull).await {
        Response::Params { seq, values, .. } => {
            assert_eq!(seq, 8);
            assert_eq!(*values, vec![8.0; LEN]);
        }
        other => panic!("pull: {other:?}"),
    }
    assert_eq!(b.applied.load(Ordering::SeqCst), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicated_handover_leaves_the_serving_shard_untouched() {
    let a = node("a", HandoverTiming::default()).await;
    let b = node("b", HandoverTiming::default()).await;
    let client = Peers::new("client".into(), test_plane());
    let members = [("a", a.addr.as_str()), ("b", b.addr.as_str())];
    a.ps.install_active(0, ShardState::fresh(0, vec![0.0; LEN], PARTITIONS));
    let v1 = view(1, "a", None, ShardSource::Fresh, &members);
    a.ps.apply_view(&v1);
    b.ps.apply_view(&v1);
    push_clock(&client, &a.addr, 0).await;
    let sent = a.ps.active_copy(0).expect("a serves").snapshot();

    // The shard moves to b; a hands it over for real.
    let v2 = view(2, "b", None, handover_from("a", None), &members);
    b.ps.apply_view(&v2);
    a.ps.apply_view(&v2);
    assert_eq!(serving(&b.ps).await.seq, 4);
    let deadline = Instant::now() + Duration::from_secs(20);
    while a.ps.handovers_in_flight() > 0 {
        assert!(Instant::now() < deadline, "a's hand-over never finished");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    push_clock(&client, &b.addr, 1).await;
    let before = served(&serving(&b.ps).await);
    assert_eq!(before, (8, vec![8.0; LEN], Some(1)));

    // The same hand-over again (say its first answer was lost and a retried): acknowledged,
    // and nothing changes.
    let again = call(&client, &b.addr, &handover(2, "a", sent.clone())).await;
    assert_eq!(again, Response::Ack);
    assert_eq!(
        served(&serving(&b.ps).await),
        before,
        "serving state untouched"
    );
    let again = call(&client, &b.addr, &handover(2, "a", sent)).await;
    assert_eq!(again, Response::Ack);
    assert_eq!(
        served(&serving(&b.ps).await),
        before,
        "serving state untouched"
    );
    assert_eq!(
        a.applied.load(Ordering::SeqCst) + b.applied.load(Ordering::SeqCst),
        8
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reordered_handover_from_an_older_epoch_is_refused() {
    let b = node("b", HandoverTiming::default()).await;
    let client = Peers::new("client".into(), test_plane());
    let members = [("a", NOWHERE), ("b", b.addr.as_str())];
    // b saw a own the shard at epoch 3 (a had it back after an earlier move to b at epoch 2),
    // then is told at epoch 4 that a hands it over again.
    b.ps.apply_view(&view(3, "a", None, ShardSource::Fresh, &members));
    b.ps.apply_view(&view(4, "b", None, handover_from("a", None), &members));

    // The epoch-2 hand-over, delayed, arrives first: it belongs to the earlier ownership.
    let old = call(&client, &b.addr, &handover(2, "a", snapshot(8))).await;
    assert!(
        b.ps.active_copy(0).is_none(),
        "an old hand-over is not served"
    );
    assert_eq!(old, Response::Superseded);
    // Then the epoch-4 one: served.
    let new = call(&client, &b.addr, &handover(4, "a", snapshot(20))).await;
    assert_eq!(new, Response::Ack);
    assert_eq!(serving(&b.ps).await.seq, 20);
    push_clock(&client, &b.addr, 5).await;
    let before = served(&serving(&b.ps).await);
    assert_eq!(before, (24, vec![24.0; LEN], Some(5)));

    // The epoch-2 one again, after the newer one: refused, serving state untouched.
    let old = call(&client, &b.addr, &handover(2, "a", snapshot(8))).await;
    assert_eq!(
        served(&serving(&b.ps).await),
        before,
        "serving state untouched"
    );
    assert_eq!(old, Response::Superseded);
    assert_eq!(b.applied.load(Ordering::SeqCst), 4);
}

/// A TCP proxy to `target` that holds every new connection for `delay` first: a slow link.
async fn slow_link(target: String, delay: Duration) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                // Simulated latency, not synchronisation: the hand-over is slow on the wire.
                tokio::time::sleep(delay).await;
                if let Ok(mut out) = tokio::net::TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_applied_update_is_lost_across_a_slow_handover() {
    // The link from a to b takes 1 s, well within the sender's 3 s budget.
    let timing = HandoverTiming::from_send_budget(Duration::from_secs(3), Duration::from_secs(1));
    let a = node("a", timing).await;
    let b = node("b", timing).await;
    let c = node("c", timing).await;
    let client = Peers::new("client".into(), test_plane());
    let to_b = slow_link(b.addr.clone(), Duration::from_secs(1)).await;
    let members = [
        ("a", a.addr.as_str()),
        ("b", b.addr.as_str()),
        ("c", c.addr.as_str()),
    ];
    a.ps.install_active(0, ShardState::fresh(0, vec![0.0; LEN], PARTITIONS));
    let v1 = view(1, "a", Some("c"), ShardSource::Fresh, &members);
    for n in [&a, &b, &c] {
        n.ps.apply_view(&v1);
    }
    // Clocks 0..3 on a; c's backup has only clock 0.
    push_clock(&client, &a.addr, 0).await;
    a.ps.sync_backups().await;
    assert_eq!(c.ps.backup_copy(0).map(|s| s.seq), Some(4));
    for clock in 1..3 {
        push_clock(&client, &a.addr, clock).await;
    }

    // The shard moves to b (fallback: c's backup). a reaches b over the slow link.
    let v2 = view(2, "b", Some("c"), handover_from("a", Some("c")), &members);
    let slow = [
        ("a", a.addr.as_str()),
        ("b", to_b.as_str()),
        ("c", c.addr.as_str()),
    ];
    c.ps.apply_view(&v2);
    b.ps.apply_view(&v2);
    a.ps.apply_view(&view(
        2,
        "b",
        Some("c"),
        handover_from("a", Some("c")),
        &slow,
    ));
    // The workers go on with the new owner (Busy until it serves).
    for clock in 3..6 {
        for p in 0..PARTITIONS {
            push(&client, &b.addr, clock, p).await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while a.ps.handovers_in_flight() > 0 {
        assert!(Instant::now() < deadline, "a's hand-over never finished");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Every update either node applied is in the state b serves, and nothing else is.
    let applied = a.applied.load(Ordering::SeqCst) + b.applied.load(Ordering::SeqCst);
    let (seq, values, done) = served(&serving(&b.ps).await);
    assert_eq!(applied, 24, "each push applied exactly once");
    assert_eq!(seq, applied, "b's state counts every applied update");
    assert_eq!(
        values,
        vec![applied as f32; LEN],
        "and holds every one of them"
    );
    assert_eq!(done, Some(5));
    assert_eq!(serving(&b.ps).await.clocks.lineage(), Lineage::Continuous);
}
