//! A whole pipeline on this machine: one OS thread, tokio runtime, TCP listener and transport
//! endpoint per worker, talking over loopback TCP exactly as agents on different machines do
//! (optionally through the emulated slow links of [`crate::transport::TokenBucket`]).

use super::stage::{self, Checkpoints, Inbox, RunConfig, StageCtx, StageError, StageOutcome};
use crate::data::ImageSet;
use crate::transport::Peers;
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

impl LocalRun {
    /// The whole model at the end (replica 0 of every stage, in stage order).
    pub fn model(&self) -> Vec<crate::apps::mlp::Dense> {
        let mut stages: Vec<&StageOutcome> =
            self.outcomes.iter().filter(|o| o.replica == 0).collect();
        stages.sort_by_key(|o| o.stage);
        stages
            .iter()
            .flat_map(|o| o.layers.iter().cloned())
            .collect()
    }
}

/// Run `cfg` on `cfg.plan.workers()` local workers, each connection limited to
/// `link_bytes_per_sec` (both directions together) when given.
pub fn run(
    cfg: RunConfig,
    train: Arc<ImageSet>,
    link_bytes_per_sec: Option<f64>,
) -> Result<LocalRun, LocalError> {
    let n = cfg.plan.workers();
    let cfg = Arc::new(cfg);
    let checkpoints = Checkpoints::new(cfg.plan.stages().len());
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
    let addrs: Arc<Vec<String>> = Arc::new(setups.iter().map(|s| s.2.clone()).collect());
    // Every runtime stays up until every worker is done, so late acknowledgements still flow.
    let all_done = Arc::new(Barrier::new(n as usize));
    let started = Instant::now();
    let mut threads = Vec::new();
    for (w, (rt, listener, addr)) in setups.into_iter().enumerate() {
        let w = w as u32;
        let (addrs, cfg, train) = (addrs.clone(), cfg.clone(), train.clone());
        let (cps, all_done) = (checkpoints.clone(), all_done.clone());
        let handle = std::thread::Builder::new()
            .name(format!("pipe-worker-{w}"))
            .spawn(move || {
                let result = rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener)
                        .map_err(|source| LocalError::Setup { worker: w, source })?;
                    let peers = Peers::with_link_limit(addr, link_bytes_per_sec);
                    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                    peers.set_handler(Arc::new(Inbox(tx)));
                    tokio::spawn(peers.clone().serve(listener));
                    let ctx = StageCtx {
                        worker: w,
                        addrs,
                        peers,
                        inbox: rx,
                        train,
                        cfg,
                        checkpoints: Some(cps),
                    };
                    stage::run(ctx)
                        .await
                        .map_err(|source| LocalError::Stage { worker: w, source })
                });
                if let Err(e) = &result {
                    tracing::error!(worker = w, error = %e, "pipeline worker failed");
                }
                all_done.wait();
                drop(rt);
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
