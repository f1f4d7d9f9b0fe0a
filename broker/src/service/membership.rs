//! This broker among the brokers that share its database: its identity, its heartbeat and the
//! leases through which it owns jobs (see [`crate::store::Lease`]).
//!
//! - The lease keeper ([`Broker::run_lease_keeper`]) renews every lease this broker holds, a
//!   quarter of the lease period apart, and drops the jobs whose lease another broker took.
//! - Each scheduler tick claims jobs whose lease expired, up to this broker's fair share
//!   (unfinished jobs over live brokers, rounded up), and recovers them (their instances
//!   reconciled with the cloud by tag) before stepping them.
//! - A new job goes to the live broker with the fewest jobs ([`Broker::grant_new_job`]).
//! - A stopping broker releases its leases ([`Broker::leave`]), so its jobs move at once.
//!
//! On the embedded database a broker is alone (it holds the file's lock), so it claims every
//! job at start without waiting for leases of an earlier process to expire.

use super::{Broker, ServiceError};
use crate::store::Lease;
use proteus_wire::JobId;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Default lease period: a dead broker's jobs move within about this long (plus a tick).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// Who this broker is, and the leases it holds.
#[derive(Debug)]
pub struct Membership {
    id: String,
    url: String,
    lease: Duration,
    /// Alone on its database (the embedded default): claims without waiting for expiry.
    exclusive: bool,
    held: Mutex<HashMap<JobId, Lease>>,
}

impl Membership {
    pub fn new(id: String, url: String, lease: Duration, exclusive: bool) -> Membership {
        Membership {
            id,
            url,
            lease,
            exclusive,
            held: Mutex::new(HashMap::new()),
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }
    pub fn url(&self) -> &str {
        &self.url
    }
    pub fn lease_period(&self) -> Duration {
        self.lease
    }

    /// The lease held on `job`, if this broker owns it.
    pub fn lease(&self, job: JobId) -> Option<Lease> {
        self.lock().get(&job).copied()
    }

    /// The jobs this broker owns.
    pub fn jobs(&self) -> HashSet<JobId> {
        self.lock().keys().copied().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, Lease>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn lease_ms(&self) -> i64 {
        i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX / 4)
    }
}

/// Wall time in epoch milliseconds, as the store's lease columns hold it: leases are between
/// processes, not in market time.
pub(super) fn wall_now_ms() -> i64 {
    i64::try_from(super::control::wall_ms()).unwrap_or(i64::MAX)
}

/// A fresh broker id.
pub fn new_broker_id() -> String {
    format!("brk-{}", &crate::api::auth::new_token("")[..12])
}

/// The id of the broker that runs on `state_dir`, kept in `broker-id` there, so that a
/// restarted broker is the same broker and owns its jobs again at once.
pub fn broker_id_of(state_dir: &Path) -> std::io::Result<String> {
    let path = state_dir.join("broker-id");
    match std::fs::read_to_string(&path) {
        Ok(text) if !text.trim().is_empty() => Ok(text.trim().to_string()),
        _ => {
            std::fs::create_dir_all(state_dir)?;
            let id = new_broker_id();
            std::fs::write(&path, &id)?;
            Ok(id)
        }
    }
}

impl Broker {
    /// The lease this broker holds on `job`: what its writes for the job carry. Refused when the
    /// job is another broker's.
    pub fn fence(&self, job: JobId) -> Result<Lease, ServiceError> {
        self.membership
            .lease(job)
            .ok_or(ServiceError::NotOwner { job })
    }

    /// Records this broker's row (at start).
    pub async fn join(&self) -> Result<(), ServiceError> {
        self.store
            .register_broker(
                self.membership.id(),
                self.membership.url(),
                std::process::id(),
                wall_now_ms(),
            )
            .await?;
        Ok(())
    }

    /// The heartbeat: renews this broker's leases; jobs whose lease another broker took are
    /// dropped here (their coordinator, agents and runtime), leases granted to this broker by
    /// another's submit are picked up.
    pub async fn renew_leases(&self) -> Result<(), ServiceError> {
        // Leases gained while the heartbeat is in flight (a claim, a grant) are not in its
        // answer, and are not lost: only those held before it can be.
        let before = self.membership.lock().clone();
        let renewed = self
            .store
            .heartbeat(
                self.membership.id(),
                wall_now_ms(),
                self.membership.lease_ms(),
            )
            .await?;
        let now: HashMap<JobId, Lease> = renewed.iter().map(|l| (l.job(), *l)).collect();
        let lost: Vec<JobId> = {
            let mut held = self.membership.lock();
            let lost: Vec<JobId> = held
                .iter()
                .filter(|(j, l)| !now.contains_key(j) && before.get(j) == Some(l))
                .map(|(j, _)| *j)
                .collect();
            for job in &lost {
                held.remove(job);
            }
            held.extend(now);
            lost
        };
        for job in lost {
            tracing::warn!(%job, "lost the lease on a job to another broker; dropping it");
            self.drop_job(job);
        }
        Ok(())
    }

    /// Forgets a job this broker no longer owns: nothing of it is acted on here any more. The
    /// lease goes first, so that nothing rebuilds the job once its state is forgotten.
    fn drop_job(&self, job: JobId) {
        self.membership.lock().remove(&job);
        self.forget_job_state(job);
    }

    /// Forgets the lease on a job wound down here (released in the store).
    pub(crate) fn membership_forget(&self, job: JobId) {
        self.membership.lock().remove(&job);
    }

    /// A write was refused because another broker owns the job now.
    pub(crate) fn lost_lease(&self, job: JobId) {
        tracing::warn!(%job, "another broker took the job over; this broker stops acting on it");
        self.drop_job(job);
    }

    /// Renews the leases until `shutdown` resolves, a quarter of the lease period apart.
    pub async fn run_lease_keeper(
        self: Arc<Self>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let every = self.membership.lease_period() / 4;
        loop {
            if let Err(e) = self.renew_leases().await {
                tracing::warn!(error = %e, "cannot renew leases; retrying");
            }
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }

    /// Claims jobs whose lease expired, up to this broker's fair share, and returns the
    /// leases gained.
    pub(crate) async fn claim_share(&self) -> Result<Vec<Lease>, ServiceError> {
        let now = wall_now_ms();
        let lease_ms = self.membership.lease_ms();
        let (max, unowned) = if self.membership.exclusive {
            (i64::MAX / 4, true)
        } else {
            let live = self.store.live_brokers(now - lease_ms).await?;
            let brokers = i64::try_from(live.len().max(1)).unwrap_or(1);
            let active = self.store.active_job_count().await?;
            let share = (active + brokers - 1) / brokers;
            let held = i64::try_from(self.membership.lock().len()).unwrap_or(0);
            // Jobs winding down (over, still leased by a dead owner) are claimed beyond the
            // share: they hold instances that must be released. A new job (never owned) is not:
            // its submitter is giving it to the broker with the fewest.
            ((share - held).max(1), share > held)
        };
        let claimed = self
            .store
            .claim_expired(
                self.membership.id(),
                now,
                lease_ms,
                max,
                self.membership.exclusive,
                unowned,
            )
            .await?;
        // A claimed lease had lapsed: whatever this broker still holds of the job in memory
        // (it owned it before a pause, say) may be older than what another owner saved since,
        // so the job is rebuilt from the store.
        for l in &claimed {
            self.membership.lock().remove(&l.job());
            self.forget_job_state(l.job());
        }
        if !claimed.is_empty() {
            let mut held = self.membership.lock();
            for l in &claimed {
                held.insert(l.job(), *l);
            }
        }
        for l in &claimed {
            tracing::info!(job = %l.job(), token = l.token(), "took over a job's lease");
            self.store
                .add_event(
                    Some(l.job()),
                    None,
                    self.clock.now(),
                    "broker_takeover",
                    &format!(
                        "broker {} ({}) runs the job now (lease {})",
                        self.membership.id(),
                        self.membership.url(),
                        l.token()
                    ),
                )
                .await?;
        }
        Ok(claimed)
    }

    /// Gives a new job its first owner: the live broker with the fewest jobs (this one on a
    /// tie, or when it is alone).
    pub(crate) async fn grant_new_job(&self, job: JobId) -> Result<Option<Lease>, ServiceError> {
        let now = wall_now_ms();
        let lease_ms = self.membership.lease_ms();
        let live = self.store.live_brokers(now - lease_ms).await?;
        let mine = live
            .iter()
            .find(|b| b.id == self.membership.id())
            .map(|b| b.jobs);
        let owner = match (live.first(), mine) {
            (Some(first), Some(mine)) if first.jobs < mine => first.id.clone(),
            _ => self.membership.id().to_string(),
        };
        match self.store.grant_lease(job, &owner, now, lease_ms).await? {
            Some(lease) if owner == self.membership.id() => {
                self.membership.lock().insert(job, lease);
                Ok(Some(lease))
            }
            Some(_) => {
                tracing::info!(%job, %owner, "new job given to the broker with the fewest jobs");
                Ok(None)
            }
            // A broker's claim took it first: it is that broker's.
            None => Ok(None),
        }
    }

    /// The broker URLs agents are given: this one first, then the other live brokers', so that
    /// an agent whose broker died finds the one that takes its job over.
    pub async fn agent_broker_urls(&self) -> Vec<String> {
        let mut urls = vec![self.membership.url().to_string()];
        let since = wall_now_ms() - self.membership.lease_ms();
        if let Ok(live) = self.store.live_brokers(since).await {
            for b in live {
                if !urls.contains(&b.url) {
                    urls.push(b.url);
                }
            }
        }
        urls
    }

    /// Graceful stop: every lease released (the other brokers claim the jobs at their next
    /// tick) and this broker's row removed.
    pub async fn leave(&self) -> Result<(), ServiceError> {
        self.store.leave(self.membership.id()).await?;
        self.membership.lock().clear();
        Ok(())
    }

    pub fn membership(&self) -> &Membership {
        &self.membership
    }
}
