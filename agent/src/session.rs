//! An agent's session with the broker, whatever its job runs (a built-in app or a command job):
//! how the agent is started and how it ends, and the two loops that keep the session alive
//! beside the job — heartbeats, and the command poll — both of which turn the broker's "job
//! over" and "unknown instance" answers into `Control` messages for the loop running the job.

use crate::control::Broker;
use crate::error::AgentError;
use crate::worker::SharedProgress;
use proteus_wire::InstanceId;
use proteus_wire::agent_api::{Command, Heartbeat};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// How the agent is started.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub broker: String,
    /// The agent token, or the instance's one-time bootstrap token (`pb_…`, from its user data
    /// or its launcher), which the agent trades for its agent token at its first contact.
    pub token: String,
    /// Where the token was read from: a traded bootstrap token is replaced there by the agent
    /// token, so that the agent, restarted, uses the token that still works.
    pub token_file: Option<PathBuf>,
    /// PEM CA certificates to verify the broker's HTTPS against (`None`: the system roots).
    pub ca_file: Option<PathBuf>,
    /// From the command line; otherwise IMDS `instance-id`.
    pub instance_id: Option<String>,
    /// IMDS base URL; `None` disables interruption polling.
    pub imds_endpoint: Option<String>,
    pub imds_poll: Duration,
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    /// `host:port` peers should dial, when it differs from the bound address (NAT, 0.0.0.0).
    pub advertise: Option<String>,
    pub vcpus: u32,
    /// Exit at the latest this long before an interruption's action time.
    pub exit_margin: Duration,
    /// This agent's worker is a persistent straggler this many times slower (1: normal).
    pub slowdown: f64,
    /// Command jobs: where each instance's working, checkpoint, notice and progress files go.
    pub scratch_dir: PathBuf,
    /// Command jobs: the (unprivileged) user the program runs as, when the agent is root.
    pub run_as: Option<String>,
}

/// How the agent ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Told to stop (training done, job cancelled or over).
    Stopped(String),
    /// Handed over and left after an interruption warning.
    Interrupted,
}

/// What the session's loops tell the loop running the job.
pub(crate) enum Control {
    /// The broker's newest layout (boxed: a layout is large, the other messages small).
    Configure(Box<proteus_wire::agent_api::ClusterView>),
    /// The broker asks the agent to leave, saying why.
    Stop(String),
    /// The broker answered that the job is over (409).
    JobOver,
    /// The broker no longer knows this instance (404; declared dead?).
    Forgotten,
}

/// Sends a heartbeat every `interval`: the worker's `progress`, the shards this agent serves
/// (`shards`: `None` while it has no parameter server, and always for a command job) and the
/// newest view it applied; stops when the job is over or the instance is forgotten.
pub(crate) async fn heartbeats(
    broker: Broker,
    me: InstanceId,
    interval: Duration,
    progress: SharedProgress,
    shards: impl Fn() -> Option<(Vec<u32>, Vec<u32>)> + Send + 'static,
    applied_epoch: Arc<AtomicU64>,
    tx: mpsc::UnboundedSender<Control>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut p = progress.lock().map(|p| p.clone()).unwrap_or_default();
        if let Some(roles) = shards() {
            (p.active_shards, p.backup_shards) = roles;
        }
        let hb = Heartbeat {
            applied_epoch: applied_epoch.load(Ordering::Relaxed),
            progress: p,
        };
        match broker.heartbeat(&me, &hb).await {
            Ok(()) => {}
            Err(AgentError::BrokerStatus { status: 409, .. }) => {
                let _ = tx.send(Control::JobOver);
                return;
            }
            Err(AgentError::BrokerStatus { status: 404, .. }) => {
                let _ = tx.send(Control::Forgotten);
                return;
            }
            Err(e) => tracing::debug!(error = %e, "heartbeat failed"),
        }
    }
}

/// Long-polls the broker for this agent's commands and forwards them, until the job is over,
/// the instance is forgotten or nobody listens any more.
pub(crate) async fn poll_commands(
    broker: Broker,
    me: InstanceId,
    wait_ms: u64,
    tx: mpsc::UnboundedSender<Control>,
) {
    let mut after = 0;
    let mut failing = false;
    let mut delay = Duration::from_millis(200);
    loop {
        match broker.commands(&me, after, wait_ms).await {
            Ok(cmds) => {
                failing = false;
                delay = Duration::from_millis(200);
                for c in cmds {
                    after = after.max(c.seq);
                    let control = match c.command {
                        Command::Configure(view) => Control::Configure(Box::new(view)),
                        Command::Stop { reason } => Control::Stop(reason),
                    };
                    if tx.send(control).is_err() {
                        return;
                    }
                }
            }
            Err(AgentError::BrokerStatus { status: 409, .. }) => {
                let _ = tx.send(Control::JobOver);
                return;
            }
            Err(AgentError::BrokerStatus { status: 404, .. }) => {
                let _ = tx.send(Control::Forgotten);
                return;
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "cannot poll broker for commands; retrying with backoff");
                    failing = true;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Seconds since the Unix epoch (0 on a clock set before it).
pub(crate) fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}
