//! A whole pipeline on this machine: one OS thread, tokio runtime, TCP listener and transport
//! endpoint per worker, talking over loopback TCP exactly as agents on different machines do
//! (optionally through the emulated slow links of [`crate::transport::TokenBucket`]).

use super::PipeMsg;
use super::partition::Link;
use super::stage::{
    self, AddressBook, Checkpoints, Inbox, Notices, RunConfig, StageCtx, StageError, StageOutcome,
};
use crate::data::ImageSet;
use crate::transport::{DataPlane, Peers, frame_bound};
use proteus_wire::agent_api::DataSecret;
use std::sync::{Arc, Barrier};
use std::time::Instant;

/// Why a local run failed.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("setting up worker {worker}: {source}")]
    Setup { worker: u32, source: std::io::Error },
    #[error("worker {worker}: {source}")]
    Stage { worker: u32, source: StageError },
    #[error("worker {0} panicked")]
    Panicked(u32),
}

/// What a finished run reports.
#[derive(Debug)]
pub struct LocalRun {
    /// One per worker, in worker order.
    pub outcomes: Vec<StageOutcome>,
    pub started: Instant,
    pub wall_secs: f64,
    pub checkpoints: Arc<Checkpoints>,
}

/// Interruption warnings to deliver during a run: worker, and how long after the start.
pub type Warnings = Vec<(u32, std::time::Duration)>;

impl LocalRun {
    /// The whole model at the end (replica 0 of every stage of the final plan, in layer order).
    pub fn model(&self) -> Vec<crate::apps::mlp::Dense> {
        let mut stages: Vec<&StageOutcome> = self
            .outcomes
            .iter()
            .filter(|o| o.replica == 0 && !o.evicted && !o.lost)
            .collect();
        stages.sort_by_key(|o| o.first_layer);
        stages
            .iter()
            .flat_map(|o| o.layers.iter().cloned())
            .collect()
    }
}

/// Run `cfg` on `cfg.plan.workers()` local workers, each connection emulating `link` when
/// given: its rate (both directions together) and its latency.
pub fn run(
    cfg: RunConfig,
    train: Arc<ImageSet>,
    link: Option<Link>,
) -> Result<LocalRun, LocalError> {
    run_with_warnings(cfg, train, link, Vec::new())
}

/// [`run`], with interruption warnings delivered at wall-clock times (the leader drains the
/// pipeline and every survivor continues on the plan for one worker fewer). With
/// `cfg.join_at`, one more worker (numbered after the first plan's) stands by until the
/// leader folds it in.
pub fn run_with_warnings(
    cfg: RunConfig,
    train: Arc<ImageSet>,
    link: Option<Link>,
    warnings: Warnings,
) -> Result<LocalRun, LocalError> {
    run_local(cfg, train, link, warnings, false)
}

/// [`run_with_warnings`], with one more worker that joins as a replacement agent does: it
/// knows the first plan's workers' addresses only, tells them it is ready when the run starts,
/// and whoever leads folds it in, under the next free number, as soon as a plan has room for
/// it (at once when the run has a plan for one more worker; else after a warned worker left).
pub fn run_with_newcomer(
    cfg: RunConfig,
    train: Arc<ImageSet>,
    link: Option<Link>,
    warnings: Warnings,
) -> Result<LocalRun, LocalError> {
    run_local(cfg, train, link, warnings, true)
}

fn run_local(
    cfg: RunConfig,
    train: Arc<ImageSet>,
    link: Option<Link>,
    warnings: Warnings,
    newcomer: bool,
) -> Result<LocalRun, LocalError> {
    cfg.check()
        .map_err(|source| LocalError::Stage { worker: 0, source })?;
    let first = cfg.plan.workers();
    let n = match cfg.join_at {
        Some(_) if newcomer => {
            return Err(LocalError::Stage {
                worker: first,
                source: StageError::Config(
                    "a newcomer joins when it is ready, not at a given minibatch".into(),
                ),
            });
        }
        None if newcomer => first + 1,
        Some((_, w)) if w == first => first + 1,
        Some((_, w)) => {
            return Err(LocalError::Stage {
                worker: w,
                source: StageError::Config(format!(
                    "a local run folds in worker {first}, the one after its first plan's, not {w}"
                )),
            });
        }
        None => first,
    };
    let cfg = Arc::new(cfg);
    let checkpoints = Checkpoints::new(cfg.shape.layers());
    let notices = Arc::new(Notices::default());
    let mut setups = Vec::new();
    for w in 0..n {
        let setup = |source| LocalError::Setup { worker: w, source };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(format!("pipe-w{w}"))
            .enable_all()
            .build()
            .map_err(setup)?;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(setup)?;
        listener.set_nonblocking(true).map_err(setup)?;
        let addr = listener.local_addr().map_err(setup)?.to_string();
        setups.push((rt, listener, addr));
    }
    let addrs: Vec<String> = setups.iter().map(|s| s.2.clone()).collect();
    // Every runtime stays up until every worker is done, so late acknowledgements still flow.
    let all_done = Arc::new(Barrier::new(n as usize));
    let started = Instant::now();
    if !warnings.is_empty() {
        let notices = notices.clone();
        std::thread::spawn(move || {
            let mut warnings = warnings;
            warnings.sort_by_key(|w| w.1);
            for (w, after) in warnings {
                std::thread::sleep(after.saturating_sub(started.elapsed()));
                notices.warn(w);
            }
        });
    }
    // The local workers are one job: one fresh secret, the bound of this model and batch.
    let batch = train.len() / cfg.batches.per_epoch().max(1) as usize + 1;
    let plane = DataPlane::new(
        DataSecret::from_bytes(rand::random()),
        frame_bound(cfg.shape.max_message_floats(batch), 1, 0),
    )
    .with_link_limit(link.map(|l| l.bytes_per_sec))
    .with_link_latency(link.map(|l| std::time::Duration::from_secs_f64(l.latency_secs)));
    let mut threads = Vec::new();
    for (w, (rt, listener, addr)) in setups.into_iter().enumerate() {
        let w = w as u32;
        // Each worker its own address book. A newcomer is in none but its own until it is
        // folded in; a standby the leader folds in at `join_at` is in every one.
        let book = if newcomer && w < first {
            AddressBook::new(addrs[..first as usize].to_vec())
        } else {
            AddressBook::new(addrs.clone())
        };
        let founders = addrs[..first as usize].to_vec();
        let announce = newcomer && w == first;
        let (cfg, train, plane) = (cfg.clone(), train.clone(), plane.clone());
        let (cps, all_done, notices) = (checkpoints.clone(), all_done.clone(), notices.clone());
        let handle = std::thread::Builder::new()
            .name(format!("pipe-worker-{w}"))
            .spawn(move || {
                let result = rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener)
                        .map_err(|source| LocalError::Setup { worker: w, source })?;
                    let peers = Peers::new(addr, plane.clone());
                    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                    peers.set_handler(Arc::new(Inbox(tx)));
                    tokio::spawn(peers.clone().serve(listener));
                    if announce {
                        let ready = PipeMsg::Ready {
                            addr: book.get(w).unwrap_or_default(),
                        }
                        .to_request();
                        // Twice, as a replacement that heard nothing says it again: the second
                        // must change nothing. A worker that does not answer cannot lead.
                        for to in founders.iter().chain(&founders) {
                            let _ = peers.call(to, &ready, stage::MESSAGE_TIMEOUT).await;
                        }
                    }
                    let ctx = StageCtx {
                        worker: w,
                        addrs: book,
                        peers,
                        inbox: rx,
                        train,
                        cfg,
                        checkpoints: Some(cps),
                        notices: Some(notices),
                        steps: None,
                        resumed: None,
                    };
                    stage::run(ctx)
                        .await
                        .map_err(|source| LocalError::Stage { worker: w, source })
                });
                if let Err(e) = &result {
                    tracing::error!(worker = w, error = %e, "pipeline worker failed");
                }
                // A worker stopped dead goes at once, its endpoint with it, as a killed
                // process's does: the others' connections to it fail.
                if result.as_ref().is_ok_and(|o| o.lost) {
                    drop(rt);
                    all_done.wait();
                } else {
                    all_done.wait();
                    drop(rt);
                }
                result
            })
            .map_err(|source| LocalError::Setup { worker: w, source })?;
        threads.push(handle);
    }
    let mut outcomes = Vec::new();
    let mut first_err = None;
    for (w, t) in threads.into_iter().enumerate() {
        match t.join() {
            Ok(Ok(o)) => outcomes.push(o),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert(LocalError::Panicked(w as u32));
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(LocalRun {
        outcomes,
        started,
        wall_secs: started.elapsed().as_secs_f64(),
        checkpoints,
    })
}
