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
//! Expiry is the database's to judge (see [`crate::store::Lease`]). Locally, each lease held
//! carries a monotonic deadline: [`LOCAL_SHARE`] of the lease period after the grant, claim or
//! renewal that gave it was *asked for*. The database set the expiry no earlier than that, so
//! until the local deadline no other broker can have claimed the job. Past it, without a
//! renewal (the database is slow, the process was paused), this broker does not act on the job
//! at all — no launch, no release, no write, no answer to its agents
//! ([`ServiceError::LeaseLapsed`]) — until a renewal says the job is still its own.
//!
//! On the embedded database a broker is alone (it holds the file's lock), so it claims every
//! job at start without waiting for leases of an earlier process to expire.

use super::{Broker, ServiceError};
use crate::store::Lease;
use proteus_wire::JobId;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default lease period: a dead broker's jobs move within about this long (plus a tick).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// The part of a lease period a broker acts on a lease for after asking for it (3/4): the rest
/// is its margin for the time the database took to answer and for the two clocks' rates. The
/// keeper renews every quarter period, so a healthy broker's deadline stays half a period
/// ahead.
pub const LOCAL_SHARE: (u32, u32) = (3, 4);

/// A lease this broker holds, and until when (on its monotonic clock) it may act on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    lease: Lease,
    until: Instant,
}

/// Who this broker is, and the leases it holds.
#[derive(Debug)]
pub struct Membership {
    id: String,
    url: String,
    lease: Duration,
    /// Alone on its database (the embedded default): claims without waiting for expiry.
    exclusive: bool,
    held: Mutex<HashMap<JobId, Held>>,
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

    /// The lease held on `job`, if this broker owns it and its local deadline has not passed.
    pub fn lease(&self, job: JobId) -> Option<Lease> {
        self.lease_at(job, Instant::now()).ok()
    }

    /// The lease held on `job` at `now` on the monotonic clock: refused when this broker does
    /// not hold it, or holds it past its local deadline.
    pub fn lease_at(&self, job: JobId, now: Instant) -> Result<Lease, ServiceError> {
        match self.lock().get(&job) {
            None => Err(ServiceError::NotOwner { job }),
            Some(h) if now >= h.until => Err(ServiceError::LeaseLapsed {
                job,
                by: now.duration_since(h.until),
            }),
            Some(h) => Ok(h.lease),
        }
    }

    /// The lease held on `job`, past its local deadline or not.
    fn held(&self, job: JobId) -> Option<Lease> {
        self.lock().get(&job).map(|h| h.lease)
    }

    /// The jobs this broker holds leases on (lapsed or not).
    pub fn jobs(&self) -> HashSet<JobId> {
        self.lock().keys().copied().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The local deadline of a lease the store granted, claimed or renewed for a request made
    /// at `asked`.
    fn deadline(&self, asked: Instant) -> Instant {
        let (num, den) = LOCAL_SHARE;
        asked + self.lease * num / den
    }

    /// Records leases the store gave for a request made at `asked`.
    fn hold(&self, leases: &[Lease], asked: Instant) {
        let until = self.deadline(asked);
        let mut held = self.lock();
        for l in leases {
            held.insert(l.job(), Held { lease: *l, until });
        }
    }

    pub(super) fn lease_ms(&self) -> i64 {
        i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX / 4)
    }
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
    /// The lease this broker holds on `job`: what its writes for the job carry, and what is
    /// asked for right before every cloud call made for the job. Refused when the job is
    /// another broker's ([`ServiceError::NotOwner`]) or its lease went unrenewed past the local
    /// deadline ([`ServiceError::LeaseLapsed`]).
    pub fn fence(&self, job: JobId) -> Result<Lease, ServiceError> {
        self.membership.lease_at(job, Instant::now())
    }

    /// The lease to record the outcome of a cloud call already made for `job` (a launch, its
    /// refusal, the local agent it started) with: the one held, even past the local deadline.
    /// The deadline keeps a stalled broker from acting; what it already did is recorded all the
    /// same (an instance left unrecorded would run with nobody tracking it), and the store
    /// refuses the write if another broker has the job by then.
    pub(crate) fn record_fence(&self, job: JobId) -> Result<Lease, ServiceError> {
        self.membership
            .held(job)
            .ok_or(ServiceError::NotOwner { job })
    }

    /// Records this broker's row (at start).
    pub async fn join(&self) -> Result<(), ServiceError> {
        self.store
            .register_broker(
                self.membership.id(),
                self.membership.url(),
                std::process::id(),
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
        let before: HashMap<JobId, Lease> = self
            .membership
            .lock()
            .iter()
            .map(|(j, h)| (*j, h.lease))
            .collect();
        let asked = Instant::now();
        let renewed = self
            .store
            .heartbeat(self.membership.id(), self.membership.lease_ms())
            .await?;
        let now: HashMap<JobId, Lease> = renewed.iter().map(|l| (l.job(), *l)).collect();
        let lost: Vec<JobId> = {
            let mut held = self.membership.lock();
            let lost: Vec<JobId> = held
                .iter()
                .filter(|(j, h)| !now.contains_key(j) && before.get(j) == Some(&h.lease))
                .map(|(j, _)| *j)
                .collect();
            for job in &lost {
                held.remove(job);
            }
            lost
        };
        self.membership.hold(&renewed, asked);
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
        let mut failing = false;
        loop {
            match self.renew_leases().await {
                Err(e) => {
                    tracing::warn!(error = %e, "cannot renew leases; retrying");
                    failing = true;
                }
                // The database is back: the connections that idled through its outage are dead,
                // and each would cost whoever takes it next a failed ping and a new connection
                // (seconds, at a job's end, on a loaded machine). Replace them now.
                Ok(()) if failing => {
                    failing = false;
                    let store = self.store.clone();
                    tokio::spawn(async move {
                        let replaced = store.recycle_idle_connections().await;
                        tracing::info!(replaced, "the database is back; idle connections recycled");
                    });
                }
                Ok(()) => {}
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
        let lease_ms = self.membership.lease_ms();
        let (max, unowned) = if self.membership.exclusive {
            (i64::MAX / 4, true)
        } else {
            let live = self.store.live_brokers(lease_ms).await?;
            let brokers = i64::try_from(live.len().max(1)).unwrap_or(1);
            let active = self.store.active_job_count().await?;
            let share = (active + brokers - 1) / brokers;
            let held = i64::try_from(self.membership.lock().len()).unwrap_or(0);
            // Jobs winding down (over, still leased by a dead owner) are claimed beyond the
            // share: they hold instances that must be released. A new job (never owned) is not:
            // its submitter is giving it to the broker with the fewest.
            ((share - held).max(1), share > held)
        };
        let asked = Instant::now();
        let claimed = self
            .store
            .claim_expired(
                self.membership.id(),
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
        self.membership.hold(&claimed, asked);
        for l in &claimed {
            tracing::info!(job = %l.job(), token = l.token(), "took over a job's lease");
            self.store
                .add_event(
                    Some(l),
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
        let lease_ms = self.membership.lease_ms();
        let live = self.store.live_brokers(lease_ms).await?;
        let mine = live
            .iter()
            .find(|b| b.id == self.membership.id())
            .map(|b| b.jobs);
        let owner = match (live.first(), mine) {
            (Some(first), Some(mine)) if first.jobs < mine => first.id.clone(),
            _ => self.membership.id().to_string(),
        };
        let asked = Instant::now();
        match self.store.grant_lease(job, &owner, lease_ms).await? {
            Some(lease) if owner == self.membership.id() => {
                self.membership.hold(&[lease], asked);
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
        if let Ok(live) = self.store.live_brokers(self.membership.lease_ms()).await {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn member(lease: Duration) -> Membership {
        Membership::new("brk-test".into(), "http://b".into(), lease, false)
    }

    /// A lease is acted on for three quarters of its period after it was asked for; past that,
    /// without a renewal, the holder refuses to act (and keeps the lease, for a renewal to
    /// revive); a renewal moves the deadline; a job never held is another broker's.
    #[test]
    fn a_lease_is_acted_on_until_its_local_deadline_and_again_after_a_renewal() {
        let period = Duration::from_secs(8);
        let m = member(period);
        let job = JobId(7);
        let lease = Lease::for_test(job, 3);
        let asked = Instant::now();
        m.hold(&[lease], asked);
        let deadline = asked + Duration::from_secs(6);
        assert_eq!(m.lease_at(job, asked).unwrap(), lease);
        assert_eq!(
            m.lease_at(job, deadline - Duration::from_millis(1))
                .unwrap(),
            lease
        );
        match m.lease_at(job, deadline + Duration::from_secs(2)) {
            Err(ServiceError::LeaseLapsed { job: j, by }) => {
                assert_eq!((j, by), (job, Duration::from_secs(2)))
            }
            other => panic!("a lease past its local deadline was acted on: {other:?}"),
        }
        assert!(
            m.jobs().contains(&job),
            "a lapsed lease is kept for its renewal"
        );
        // Renewed (asked 5 s after the first): good until 6 s after that.
        m.hold(&[lease], asked + Duration::from_secs(5));
        assert_eq!(
            m.lease_at(job, deadline + Duration::from_secs(2)).unwrap(),
            lease
        );
        assert!(matches!(
            m.lease_at(JobId(8), asked),
            Err(ServiceError::NotOwner { job: JobId(8) })
        ));
    }

    /// Past the local deadline nothing new is done for the job, but the outcome of a cloud
    /// call already made is still recorded under the held lease (`Broker::record_fence`).
    #[test]
    fn a_lapsed_lease_still_records_the_outcome_of_what_was_done() {
        let m = member(Duration::from_secs(4));
        let lease = Lease::for_test(JobId(7), 2);
        let asked = Instant::now();
        m.hold(&[lease], asked);
        let later = asked + Duration::from_secs(10);
        assert!(matches!(
            m.lease_at(JobId(7), later),
            Err(ServiceError::LeaseLapsed { .. })
        ));
        assert_eq!(m.held(JobId(7)), Some(lease));
        assert_eq!(m.held(JobId(8)), None);
    }
}
