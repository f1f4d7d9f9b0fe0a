//! The agents' control plane: one [`Coordinator`] per running job, shared by the agent API
//! (registrations, heartbeats, events, command long-polls) and the scheduler (cloud removals,
//! dead-member ticks, completion).
//!
//! Coordinators keep time in wall milliseconds: heartbeats and timeouts are about real
//! processes, whatever speed the market clock runs at.

use proteus_wire::JobId;
use proteus_wire::agent_api::DataSecret;
use proteus_wire::agent_api::{CommandEnvelope, TrainingConfig};
use proteus_wire::coordinator::{Coordinator, CoordinatorError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// Wall-clock milliseconds since the Unix epoch.
pub fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One job's coordinator and the bell its long-polls wait on.
#[derive(Debug)]
pub struct JobControl {
    coordinator: Mutex<Coordinator>,
    changed: Notify,
    finished: Mutex<Option<std::time::Instant>>,
    /// How much longer than the sweep's grace it is kept once finished (its agents may still be
    /// stopping their programs and uploading checkpoints, which the plane authorises).
    linger: Mutex<Duration>,
    /// Changed since last saved to the store.
    dirty: std::sync::atomic::AtomicBool,
}

impl JobControl {
    /// Runs `f` on the coordinator and wakes every long-poll of the job, since any change may
    /// have queued commands. An MLP job is planned here as soon as it can be (its founders are
    /// known and, for a pipeline, its profile is pinned or in): the broker owns the plans.
    pub fn update<R>(&self, f: impl FnOnce(&mut Coordinator) -> R) -> R {
        let r = {
            let mut c = self.coordinator.lock().unwrap_or_else(|e| e.into_inner());
            let r = f(&mut c);
            match proteus_agent::pipeline::planning::plan_if_due(&mut c) {
                Some(Ok(())) => tracing::info!(
                    job = %c.job_id(),
                    plan = ?c.pipeline_plan(),
                    "pipeline planned for the job's founders"
                ),
                Some(Err(e)) => tracing::error!(job = %c.job_id(), "planning the pipeline: {e}"),
                None => {}
            }
            r
        };
        self.dirty.store(true, std::sync::atomic::Ordering::Release);
        self.changed.notify_waiters();
        r
    }

    /// For changes that queue no command and are not worth saving on their own (heartbeats:
    /// they move only liveness and progress, which the next save picks up). Neither marks the
    /// coordinator changed nor wakes the long-polls: with hundreds of agents, waking every
    /// poll on every heartbeat made each heartbeat cost a scan per waiting agent. A caller
    /// whose change may have queued commands follows up with [`JobControl::update`].
    pub fn update_quietly<R>(&self, f: impl FnOnce(&mut Coordinator) -> R) -> R {
        let mut c = self.coordinator.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut c)
    }

    /// The coordinator as JSON if it changed since the last call.
    pub fn snapshot_if_dirty(&self) -> Option<String> {
        if !self.dirty.swap(false, std::sync::atomic::Ordering::AcqRel) {
            return None;
        }
        self.read(|c| serde_json::to_string(c).ok())
    }

    pub fn read<R>(&self, f: impl FnOnce(&Coordinator) -> R) -> R {
        let c = self.coordinator.lock().unwrap_or_else(|e| e.into_inner());
        f(&c)
    }

    /// Keeps the plane `extra` longer once the job is finished (at least; the longest asked
    /// stands).
    pub fn linger(&self, extra: Duration) {
        let mut l = self.linger.lock().unwrap_or_else(|e| e.into_inner());
        *l = (*l).max(extra);
    }

    /// Commands for `instance` after `after`, waiting up to `wait` for one to appear.
    pub async fn wait_commands(
        &self,
        instance: &proteus_wire::InstanceId,
        after: u64,
        wait: Duration,
    ) -> Result<Vec<CommandEnvelope>, CoordinatorError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Register interest before looking, so a change between the look and the wait is
            // not missed.
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let commands = self.read(|c| c.commands_after(instance, after))?;
            if !commands.is_empty() || self.read(|c| c.is_over()) {
                return Ok(commands);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Ok(Vec::new());
            }
        }
    }
}

/// Every running job's control state.
#[derive(Debug, Default)]
pub struct ControlPlane {
    jobs: Mutex<HashMap<JobId, Arc<JobControl>>>,
}

impl ControlPlane {
    /// The job's control state, creating its coordinator on first use — from `saved` (a
    /// snapshot in the store, after a restart) when there is one.
    pub fn ensure(
        &self,
        job: JobId,
        training: &TrainingConfig,
        saved: Option<&str>,
    ) -> Result<Arc<JobControl>, CoordinatorError> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = jobs.get(&job) {
            return Ok(c.clone());
        }
        let restored = saved.and_then(|text| match serde_json::from_str::<Coordinator>(text) {
            Ok(mut c) => {
                c.resume(wall_ms());
                tracing::info!(%job, "resumed the job's control plane from its saved state");
                Some(c)
            }
            Err(e) => {
                tracing::warn!(%job, error = %e, "saved control state unreadable; starting afresh");
                None
            }
        });
        // A fresh secret per job, from the OS-seeded CSPRNG; a state saved before secrets
        // existed gets one too (its agents re-register and learn it).
        let secret = || DataSecret::from_bytes(rand::random());
        let coordinator = match restored {
            Some(c) if c.has_data_secret() => c,
            Some(c) => c.with_data_secret(secret()),
            None => Coordinator::new(job, training.clone())?.with_data_secret(secret()),
        };
        let control = Arc::new(JobControl {
            coordinator: Mutex::new(coordinator),
            changed: Notify::new(),
            finished: Mutex::new(None),
            linger: Mutex::new(Duration::ZERO),
            dirty: std::sync::atomic::AtomicBool::new(true),
        });
        jobs.insert(job, control.clone());
        Ok(control)
    }

    pub fn get(&self, job: JobId) -> Option<Arc<JobControl>> {
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&job)
            .cloned()
    }

    /// Forgets a finished job (its agents have been told to stop).
    pub fn remove(&self, job: JobId) {
        if let Some(c) = self
            .jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&job)
        {
            c.changed.notify_waiters();
        }
    }

    /// Notes that a job ended; [`ControlPlane::sweep`] forgets it after a grace period.
    pub fn mark_finished(&self, job: JobId) {
        if let Some(c) = self.get(job) {
            c.finished
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert_with(std::time::Instant::now);
        }
    }

    /// Forgets jobs that ended more than `grace` ago.
    pub fn sweep(&self, grace: Duration) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.retain(|_, c| {
            let linger = *c.linger.lock().unwrap_or_else(|e| e.into_inner());
            let done = c
                .finished
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some_and(|t| t.elapsed() > grace + linger);
            if done {
                c.changed.notify_waiters();
            }
            !done
        });
    }

    pub fn jobs(&self) -> Vec<(JobId, Arc<JobControl>)> {
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect()
    }
}
