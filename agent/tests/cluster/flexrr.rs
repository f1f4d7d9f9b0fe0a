//! SSP and FlexRR's RapidReassignment: real workers, shards and transport on loopback.
//!
//! The in-process tests run one "agent" per worker as tokio tasks (its own `Peers` on its own
//! TCP port, its own `PsNode`, `Board` and worker loop, exactly as `agent.rs` wires them) with a
//! hand-made view, so that many seeds fit in seconds; an audit hook records every clock started,
//! every item processed and every push a shard applied, in one global order. The last test runs
//! real agent processes and warns one of them.

use crate::support::{Cluster, DATA_DIR, log_field, log_text_field};
use proteus_agent::apps::App;
use proteus_agent::audit::{Audit, AuditEvent, How};
use proteus_agent::ps::PsNode;
use proteus_agent::reassign::{Board, Node};
use proteus_agent::straggler::Pace;
use proteus_agent::sync::SyncPolicy;
use proteus_agent::transport::{DataPlane, MAX_FRAME, Peers, Request, Response};
use proteus_agent::worker::{self, WorkerCtx, WorkerExit};
use proteus_wire::agent_api::{
    AppConfig, ClusterView, ImageDataset, MemberInfo, PartitionRange, ShardPlacement, ShardSource,
    Stage, StopCondition, StragglerInjection, StragglerPattern, SyncModel, TrainingConfig,
    WorkerAssignment,
};
use proteus_wire::coordinator::JobState;
use proteus_wire::{InstanceId, Tier};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

type Log = Arc<Mutex<Vec<AuditEvent>>>;

struct InProcess {
    log: Log,
    peers: Arc<Peers>,
    addrs: Vec<String>,
    workers: Vec<tokio::task::JoinHandle<WorkerExit>>,
    cfg: TrainingConfig,
    _views: watch::Sender<Option<Arc<ClusterView>>>,
}

fn id(i: usize) -> InstanceId {
    InstanceId(format!("w{i}"))
}

fn digits_config(clocks: u64, num_partitions: u32, sync: SyncModel) -> TrainingConfig {
    let mut cfg = TrainingConfig::new(AppConfig::Mlr {
        dataset: ImageDataset::Digits,
        learning_rate: 0.5,
        l2: 0.0,
    });
    cfg.num_shards = 2;
    cfg.num_partitions = num_partitions;
    cfg.clocks_per_epoch = 2;
    cfg.stop = StopCondition::Clocks { clocks };
    cfg.eval_every_epochs = 0;
    cfg.sync = sync;
    cfg
}

/// Start `n` workers (shards on the first two) for `cfg`; `slowdowns[i]` is worker i's own
/// persistent slowdown on top of the job's injection.
async fn start(app: Arc<App>, cfg: TrainingConfig, slowdowns: &[f64]) -> InProcess {
    let n = slowdowns.len();
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    let audit: Audit = {
        let log = log.clone();
        Arc::new(move |e| log.lock().unwrap_or_else(|e| e.into_inner()).push(e))
    };
    let mut listeners = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..n {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        addrs.push(l.local_addr().expect("addr").to_string());
        listeners.push(l);
    }
    let model_len = app.model_len() as u64;
    let p = u64::from(cfg.num_partitions);
    let view = ClusterView {
        epoch: 1,
        stage: Stage::Stage1,
        founders: Vec::new(),
        pipeline: None,
        profiler: None,
        members: (0..n)
            .map(|i| MemberInfo {
                instance_id: id(i),
                tier: Tier::Transient,
                data_addr: addrs[i].clone(),
                draining: false,
            })
            .collect(),
        shards: (0..cfg.num_shards)
            .map(|s| ShardPlacement {
                shard: s,
                keys: proteus_wire::coordinator::split_range(model_len, cfg.num_shards, s),
                active: id(s as usize % n),
                backup: None,
                source: ShardSource::Fresh,
            })
            .collect(),
        workers: (0..n)
            .map(|i| WorkerAssignment {
                instance_id: id(i),
                rank: i as u32,
                partitions: PartitionRange {
                    start: (i as u64 * p / n as u64) as u32,
                    end: ((i as u64 + 1) * p / n as u64) as u32,
                },
            })
            .collect(),
        num_partitions: cfg.num_partitions,
        model_len,
    };
    let view = Arc::new(view);
    let (views_tx, _) = watch::channel(Some(view.clone()));
    let mut ctxs = Vec::new();
    for (i, listener) in listeners.into_iter().enumerate() {
        let peers = Peers::new(addrs[i].clone(), test_plane());
        let (ps_tx, ps_rx) = mpsc::unbounded_channel();
        std::mem::forget(ps_rx);
        let ps = PsNode::with_slack(
            id(i),
            app.clone(),
            cfg.num_partitions,
            cfg.sync.slack(),
            peers.clone(),
            ps_tx,
        );
        ps.set_audit(audit.clone());
        let board = Board::new();
        let node = Node::new(id(i), ps.clone(), board.clone(), Some(audit.clone()));
        peers.set_handler(node.clone());
        tokio::spawn(peers.clone().serve(listener));
        ps.apply_view(&view);
        let (ev_tx, ev_rx) = mpsc::unbounded_channel();
        std::mem::forget(ev_rx);
        let ctx = WorkerCtx {
            me: id(i),
            app: app.clone(),
            peers,
            views: views_tx.subscribe(),
            progress: Arc::new(Mutex::new(Default::default())),
            events: ev_tx,
            total_clocks: cfg.total_clocks(),
            clocks_per_epoch: u64::from(cfg.clocks_per_epoch),
            eval_every_clocks: 0,
            sync: SyncPolicy::from(cfg.sync),
            board,
            pace: Arc::new(Pace::new(cfg.stragglers, slowdowns[i], cfg.seed)),
            samples: Arc::new(AtomicU64::new(0)),
            audit: Some(audit.clone()),
        };
        node.set_worker(ctx.clone());
        ctxs.push(ctx);
    }
    let workers = ctxs
        .into_iter()
        .map(|c| tokio::spawn(worker::run(c)))
        .collect();
    InProcess {
        log,
        peers: Peers::new("127.0.0.1:1".into(), test_plane()),
        addrs,
        workers,
        cfg,
        _views: views_tx,
    }
}

impl InProcess {
    async fn finish(self) -> (Vec<AuditEvent>, TrainingConfig) {
        for w in self.workers {
            let exit = tokio::time::timeout(Duration::from_secs(120), w)
                .await
                .expect("workers finish in time")
                .expect("worker task");
            assert_eq!(exit, WorkerExit::Finished);
        }
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (log, self.cfg)
    }
}

/// Every partition of every clock processed exactly once; returns (helped chunks, cancelled offers).
fn assert_exactly_once(log: &[AuditEvent], cfg: &TrainingConfig, what: &str) -> (usize, usize) {
    let mut count: BTreeMap<(u64, u32), Vec<(InstanceId, How)>> = BTreeMap::new();
    let (mut helped, mut cancelled) = (0, 0);
    for e in log {
        match e {
            AuditEvent::Processed {
                worker,
                clock,
                partitions,
                how,
            } => {
                if matches!(how, How::Helped { .. }) {
                    helped += 1;
                }
                for p in partitions {
                    count
                        .entry((*clock, *p))
                        .or_default()
                        .push((worker.clone(), how.clone()));
                }
            }
            AuditEvent::Offer {
                accepted: false, ..
            } => cancelled += 1,
            _ => {}
        }
    }
    for c in 0..cfg.total_clocks() {
        for p in 0..cfg.num_partitions {
            let by = count.get(&(c, p)).cloned().unwrap_or_default();
            assert_eq!(
                by.len(),
                1,
                "{what}: clock {c} partition {p} processed {} times: {by:?}",
                by.len()
            );
        }
    }
    assert_eq!(
        count.len() as u64,
        cfg.total_clocks() * u64::from(cfg.num_partitions),
        "{what}: items outside the job processed"
    );
    (helped, cancelled)
}

fn digits() -> Arc<App> {
    let cfg = digits_config(1, 16, SyncModel::Bsp);
    Arc::new(App::load(&cfg, std::path::Path::new(DATA_DIR)).expect("digits load"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flexrr_processes_every_item_exactly_once_under_randomised_timing() {
    let app = digits();
    let (mut helped, mut cancelled) = (0, 0);
    for seed in 0..16u64 {
        let slack = (seed % 3) as u32;
        let helpers = 1 + (seed % 3) as u32;
        let mut cfg = digits_config(
            10,
            24 + (seed % 4) as u32 * 4,
            SyncModel::Flexrr { slack, helpers },
        );
        cfg.seed = seed;
        // ~1437 samples per epoch, 2 clocks per epoch: ~180 per worker and clock, so a clock
        // takes ~30 ms at this pace and each of 4 workers is 4x slower at random.
        cfg.stragglers = StragglerInjection {
            pattern: StragglerPattern::Transient {
                probability: 0.3,
                slowdown: 4.0,
            },
            pace_samples_per_sec: Some(6_000.0),
        };
        // And one worker persistently slower by a seed-dependent factor.
        let mut slow = vec![1.0; 4];
        slow[(seed % 4) as usize] = 1.0 + (seed % 5) as f64 * 0.5;
        let run = start(app.clone(), cfg, &slow).await;
        let (log, cfg) = run.finish().await;
        let (h, c) = assert_exactly_once(&log, &cfg, &format!("seed {seed}"));
        helped += h;
        cancelled += c;
    }
    eprintln!("16 seeds: {helped} chunks taken over, {cancelled} offers cancelled");
    assert!(helped > 50, "RapidReassignment barely ran: {helped} chunks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssp_never_starts_a_clock_more_than_slack_ahead_of_the_slowest() {
    let app = digits();
    for (slack, model) in [
        (2, SyncModel::Ssp { slack: 2 }),
        (0, SyncModel::Bsp),
        (1, SyncModel::Ssp { slack: 1 }),
    ] {
        let mut cfg = digits_config(14, 16, model);
        cfg.stragglers = StragglerInjection {
            pattern: StragglerPattern::Persistent {
                rank: 3,
                slowdown: 4.0,
            },
            pace_samples_per_sec: Some(8_000.0),
        };
        let run = start(app.clone(), cfg, &[1.0; 4]).await;
        let (log, cfg) = run.finish().await;
        assert_exactly_once(&log, &cfg, &format!("ssp slack {slack}"));
        // Replay the log: at each start of clock c, every shard must have applied every
        // partition of clock c - slack - 1, i.e. the slowest worker has finished that clock.
        // The lead is how far c is past the first clock not yet finished everywhere.
        let mut applied: HashMap<(u32, u64), usize> = HashMap::new();
        let finished_everywhere = |applied: &HashMap<(u32, u64), usize>| -> Option<u64> {
            let full = |c: u64| {
                (0..cfg.num_shards).all(|s| {
                    applied.get(&(s, c)).copied().unwrap_or(0) == cfg.num_partitions as usize
                })
            };
            (0..cfg.total_clocks()).take_while(|&c| full(c)).last()
        };
        let mut max_lead = 0;
        for e in &log {
            match e {
                AuditEvent::Applied {
                    shard,
                    clock,
                    partitions,
                } => *applied.entry((*shard, *clock)).or_default() += partitions.len(),
                AuditEvent::Started { worker, clock } => {
                    let first_unfinished = finished_everywhere(&applied).map_or(0, |d| d + 1);
                    let lead = clock.saturating_sub(first_unfinished);
                    assert!(
                        lead <= slack,
                        "slack {slack}: {worker} started clock {clock} while clock {first_unfinished} was not finished everywhere"
                    );
                    max_lead = max_lead.max(lead);
                }
                _ => {}
            }
        }
        eprintln!("slack {slack}: largest lead over the slowest worker {max_lead}");
        // With a 4x straggler the fast workers use all the slack they have.
        assert_eq!(max_lead, slack, "slack {slack} never used fully");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_that_loses_the_race_is_cancelled_and_items_are_processed_once() {
    let app = digits();
    // Two workers, the second very slow; helpers groups of one: w0 helps w1.
    let mut cfg = digits_config(
        6,
        16,
        SyncModel::Flexrr {
            slack: 0,
            helpers: 1,
        },
    );
    cfg.stragglers.pace_samples_per_sec = Some(2_000.0);
    let run = start(app, cfg, &[1.0, 8.0]).await;
    // Race w1 ourselves: read its position, wait until it has started the item we will name
    // as the split point, and offer to take the tail from there.
    let slow = run.addrs[1].clone();
    let mut raced = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while raced < 3 && tokio::time::Instant::now() < deadline {
        let Ok(Response::Progress(Some(p))) = run
            .peers
            .call(&slow, &Request::Progress, Duration::from_secs(5))
            .await
        else {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        };
        if p.next + 2 > p.end {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        let split = p.next;
        // Wait (by watching its progress, not the clock) until w1 starts item `split`.
        let passed = loop {
            match run
                .peers
                .call(&slow, &Request::Progress, Duration::from_secs(5))
                .await
            {
                Ok(Response::Progress(Some(q))) if q.clock == p.clock && q.next > split => {
                    break Some(q);
                }
                Ok(Response::Progress(Some(q))) if q.clock != p.clock => break None,
                Ok(_) => tokio::time::sleep(Duration::from_millis(2)).await,
                Err(e) => panic!("progress: {e}"),
            }
        };
        let Some(q) = passed else { continue };
        let offer = Request::Offer {
            clock: p.clock,
            split,
            end: q.end,
            by: "racer".into(),
        };
        let answer = run
            .peers
            .call(&slow, &offer, Duration::from_secs(5))
            .await
            .expect("offer answered");
        assert_eq!(
            answer,
            Response::Offer(false),
            "an offer behind the owner's position must be cancelled"
        );
        raced += 1;
    }
    assert_eq!(raced, 3, "could not race the slow worker");
    let (log, cfg) = run.finish().await;
    let (helped, cancelled) = assert_exactly_once(&log, &cfg, "raced");
    assert!(cancelled >= 3, "{cancelled} cancellations recorded");
    assert!(helped > 0, "w0 never helped the slow w1");
}

/// Real agent processes: a warned worker hands the rest of its clock to its helpers, which
/// finish it within the notice; every item of every clock is processed exactly once (from the
/// agents' audit logs), and the job completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warned_worker_hands_its_range_to_its_helpers_within_the_notice() {
    let mut cfg = digits_config(
        16,
        32,
        SyncModel::Flexrr {
            slack: 1,
            helpers: 2,
        },
    );
    cfg.eval_every_epochs = 0;
    cfg.min_workers = 4;
    cfg.dead_member_timeout_ms = 5_000;
    // ~180 samples per worker and clock at 200/s: about a second per clock, so the warning
    // lands in the middle of one.
    cfg.stragglers.pace_samples_per_sec = Some(200.0);
    let specs = [
        ("t1", Tier::Transient),
        ("t2", Tier::Transient),
        ("t3", Tier::Transient),
        ("t4", Tier::Transient),
    ];
    let total = cfg.total_clocks();
    let parts = cfg.num_partitions;
    let mut c = Cluster::start_logging(cfg, &specs, "info,proteus_agent::audit=debug").await;
    c.coord
        .wait_for(Duration::from_secs(60), |s| s.progress.clock >= 3)
        .await
        .expect("training progresses");
    let notice_secs = 30;
    c.agent("t2").imds.announce_interruption(notice_secs);
    let code = c
        .agent("t2")
        .wait_exit(Duration::from_secs(notice_secs))
        .await;
    assert_eq!(
        code,
        Some(0),
        "warned agent must exit within the notice:\n{}",
        c.agent("t2").log_text()
    );
    let st = c.wait_done(Duration::from_secs(120)).await;
    assert_eq!(st.state, JobState::Completed);
    let warned = c.agent("t2").log_text();
    let handed = warned
        .lines()
        .find(|l| l.contains("handed the rest of the clock to the helpers"))
        .unwrap_or_else(|| panic!("no hand-off in the warned agent's log:\n{warned}"));
    eprintln!("{handed}");
    let clock: u64 = log_field(handed, "clock").expect("clock in the hand-off line");
    assert!(
        !handed.contains("helpers=[]"),
        "no helper took anything: {handed}"
    );
    let released = warned
        .lines()
        .find(|l| l.contains("worker released; telling the broker"))
        .expect("released line");
    let ms: u64 = log_field(released, "ms").expect("ms");
    assert!(ms < notice_secs * 1000, "hand-off took {ms} ms");
    let finished: Vec<String> = c
        .agents
        .iter()
        .filter(|a| a.id != "t2")
        .flat_map(|a| {
            a.log_text()
                .lines()
                .filter(|l| l.contains("finished a range handed over by a warned worker"))
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        finished
            .iter()
            .any(|l| log_field::<u64>(l, "clock") == Some(clock) && l.contains("ok=true")),
        "helpers did not finish clock {clock}: {finished:?}"
    );
    // Exactly once, from every agent's audit lines.
    let mut count: BTreeMap<(u64, u32), usize> = BTreeMap::new();
    for a in &c.agents {
        for l in a.log_text().lines().filter(|l| l.contains(" processed ")) {
            let (Some(ck), Some(ps)) = (
                log_field::<u64>(l, "clock"),
                log_text_field(l, "partitions"),
            ) else {
                continue;
            };
            for r in ps.split(',') {
                let Some((a, b)) = r.split_once("..") else {
                    continue;
                };
                let (a, b): (u32, u32) = (a.parse().unwrap_or(0), b.parse().unwrap_or(0));
                for p in a..b {
                    *count.entry((ck, p)).or_default() += 1;
                }
            }
        }
    }
    for ck in 0..total {
        for p in 0..parts {
            assert_eq!(
                count.get(&(ck, p)).copied().unwrap_or(0),
                1,
                "clock {ck} partition {p} (warned at clock {clock})"
            );
        }
    }
    c.assert_all_exit_cleanly(Duration::from_secs(20)).await;
}

/// One job's data plane: every peer of this test shares its secret.
fn test_plane() -> DataPlane {
    DataPlane::new(
        proteus_wire::agent_api::DataSecret::from_bytes([7; 32]),
        MAX_FRAME,
    )
}
