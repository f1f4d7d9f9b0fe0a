//! What `GET /v1/jobs/{id}` reads from the store, kept for a moment.
//!
//! A job's status is polled far more often than it changes: the store rows behind it (the job,
//! its instances, its ledger, the market cool-downs) are written by the scheduler once a tick and
//! by a few API calls, while a dashboard or a fleet of scripts may read it thousands of times a
//! second. A read from the store costs one query (the market cool-downs it also shows are
//! shared by every job, read at most once per [`TTL`]); a read served from here costs none.
//!
//! Reads stay consistent with writes: every place that writes what a status shows says so once
//! its writes are done — the end of each scheduler tick reads the statuses being asked for again
//! ([`StatusCache::refresh`]), a cancel or an agent's event drops them
//! ([`StatusCache::invalidate`]) — and a read that *started* before that is neither served nor
//! kept, so a status fetched while a write was under way cannot outlive it. A write this does
//! not hear of (another broker on the same database) shows after [`TTL`] (1 s) at most. When a status
//! must be read, one request per job reads it; the others wait for it.

use super::ServiceError;
use crate::market::{Timestamp, Usd};
use crate::store::{Cooldown, InstanceRow, JobRow, Store};
use proteus_wire::JobId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longest time a status is served without being read again: a write by another broker on the
/// same database (which this one does not hear of) shows within it. The scheduler's tick (1 s
/// by default) reads again what is being asked for (see [`StatusCache::refresh`]).
pub const TTL: Duration = Duration::from_secs(1);

/// Entries kept at most (statuses of jobs nobody asks about expire and are dropped).
const CAPACITY: usize = 4096;

/// The store rows a job's status is made of.
#[derive(Debug, Clone)]
pub struct JobRecord {
    pub job: JobRow,
    pub instances: Vec<InstanceRow>,
    pub spend_usd: Usd,
    /// Market cool-downs in force when read (shared by every job's status, read at most once
    /// per [`TTL`]); filter by `until` again when shown.
    pub cooldowns: Arc<Vec<Cooldown>>,
    /// The job's app and sync model as shown, from its spec (which never changes).
    pub kind: super::jobs::JobKind,
    /// Of the spend, what an interruption of the live spot instances would make free: billed
    /// once per record (so at most [`TTL`] old), not at every read.
    pub provisional_usd: std::sync::OnceLock<Usd>,
}

impl JobRecord {
    /// Reads a job's rows (one query); `None` if there is no such job.
    pub async fn read(
        store: &Store,
        id: JobId,
        cooldowns: Arc<Vec<Cooldown>>,
    ) -> Result<Option<JobRecord>, ServiceError> {
        let Some((job, instances, spend_usd)) = store.job_status(id).await? else {
            return Ok(None);
        };
        Ok(Some(JobRecord {
            kind: super::jobs::kind_of(&job),
            job,
            instances,
            spend_usd,
            cooldowns,
            provisional_usd: Default::default(),
        }))
    }
}

#[derive(Debug, Default)]
pub struct StatusCache {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Reads that started before this may have missed a write: not served, not kept.
    valid_from: Option<Instant>,
    /// Per job: when the read started, and what it found.
    jobs: HashMap<JobId, (Instant, Arc<JobRecord>)>,
    /// Per job: held while reading it from the store, so that the requests that find the entry
    /// gone after a tick wait for one read instead of each making their own.
    reading: HashMap<JobId, Arc<tokio::sync::Mutex<()>>>,
    /// The market cool-downs every status shows, and when their read started.
    cooldowns: Option<(Instant, Arc<Vec<Cooldown>>)>,
}

impl StatusCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A record read at or after the last invalidation, less than [`TTL`] ago.
    pub fn get(&self, id: JobId) -> Option<Arc<JobRecord>> {
        let inner = self.lock();
        let (started, record) = inner.jobs.get(&id)?;
        let fresh = started.elapsed() < TTL && inner.valid_from.is_none_or(|v| *started >= v);
        fresh.then(|| record.clone())
    }

    /// The market cool-downs in force, as read less than [`TTL`] ago (and after the last
    /// invalidation), or read now.
    pub async fn cooldowns(
        &self,
        store: &Store,
        now: Timestamp,
    ) -> Result<Arc<Vec<Cooldown>>, ServiceError> {
        {
            let inner = self.lock();
            if let Some((started, c)) = &inner.cooldowns
                && started.elapsed() < TTL
                && inner.valid_from.is_none_or(|v| *started >= v)
            {
                return Ok(c.clone());
            }
        }
        let started = Instant::now();
        let fresh = Arc::new(store.cooldowns(now).await?);
        let mut inner = self.lock();
        if inner.cooldowns.as_ref().is_none_or(|(s, _)| *s < started) {
            inner.cooldowns = Some((started, fresh.clone()));
        }
        Ok(fresh)
    }

    /// Keeps a record whose read started at `started`, unless a write may have happened since
    /// or a newer read is already kept.
    pub fn put(&self, id: JobId, started: Instant, record: Arc<JobRecord>) {
        let mut inner = self.lock();
        if inner.valid_from.is_some_and(|v| started < v)
            || inner.jobs.get(&id).is_some_and(|(s, _)| *s >= started)
        {
            return;
        }
        if inner.jobs.len() >= CAPACITY {
            inner.jobs.retain(|_, (s, _)| s.elapsed() < TTL);
        }
        if inner.jobs.len() < CAPACITY {
            inner.jobs.insert(id, (started, record));
        }
    }

    /// The lock to hold while reading job `id` from the store (then [`StatusCache::get`] again
    /// before reading: whoever held it may have just done so).
    pub fn read_lock(&self, id: JobId) -> Arc<tokio::sync::Mutex<()>> {
        let mut inner = self.lock();
        if inner.reading.len() >= CAPACITY {
            inner.reading.retain(|_, l| Arc::strong_count(l) > 1);
        }
        inner.reading.entry(id).or_default().clone()
    }

    /// Reads again every job whose status was read in the last [`TTL`], and forgets the rest:
    /// call after writing anything a job's status shows, as [`StatusCache::invalidate`] but
    /// without leaving the next requests to find nothing. Until this returns, requests are
    /// answered from before the writes, as if they had not happened yet.
    pub async fn refresh(&self, store: &Store, now: Timestamp) {
        let started = Instant::now();
        let ids: Vec<JobId> = {
            let inner = self.lock();
            inner
                .jobs
                .iter()
                .filter(|(_, (s, _))| s.elapsed() < TTL)
                .map(|(id, _)| *id)
                .collect()
        };
        let mut fresh = Vec::with_capacity(ids.len());
        if ids.is_empty() {
            return self.invalidate_before(started);
        }
        let cooldowns = match store.cooldowns(now).await {
            Ok(c) => Arc::new(c),
            Err(e) => {
                tracing::debug!(error = %e, "cannot refresh the market cool-downs");
                self.invalidate();
                return;
            }
        };
        for id in ids {
            match JobRecord::read(store, id, cooldowns.clone()).await {
                Ok(Some(record)) => fresh.push((id, Arc::new(record))),
                Ok(None) => {}
                Err(e) => tracing::debug!(job = %id, error = %e, "cannot refresh a job's status"),
            }
        }
        let mut inner = self.lock();
        inner.valid_from = Some(started);
        inner.jobs.retain(|_, (s, _)| *s >= started);
        for (id, record) in fresh {
            if inner.jobs.get(&id).is_none_or(|(s, _)| *s < started) {
                inner.jobs.insert(id, (started, record));
            }
        }
        if inner.cooldowns.as_ref().is_none_or(|(s, _)| *s < started) {
            inner.cooldowns = Some((started, cooldowns));
        }
    }

    /// Nothing was being asked for: what was kept from before `started` is dropped.
    fn invalidate_before(&self, started: Instant) {
        let mut inner = self.lock();
        inner.valid_from = Some(started);
        inner.jobs.retain(|_, (s, _)| *s >= started);
        inner.cooldowns = inner.cooldowns.take().filter(|(s, _)| *s >= started);
    }

    /// Forgets everything: call after writing anything a job's status shows.
    pub fn invalidate(&self) {
        let mut inner = self.lock();
        inner.valid_from = Some(Instant::now());
        inner.jobs.clear();
        inner.cooldowns = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::JobState;

    fn record(name: &str) -> Arc<JobRecord> {
        Arc::new(JobRecord {
            job: JobRow {
                id: JobId(1),
                name: name.into(),
                spec: "{}".into(),
                policy: "bidbrain".into(),
                billing: "per-second".into(),
                state: JobState::Running,
                state_reason: None,
                budget_usd: None,
                deadline: None,
                progress: 0.0,
                metric: None,
                control_state: None,
                engine_state: None,
                created: Timestamp::from_millis(0),
                started: None,
                finished: None,
                work: Default::default(),
                lease_owner: None,
                owner_figures: None,
            },
            instances: vec![],
            spend_usd: Usd::ZERO,
            cooldowns: Arc::default(),
            kind: crate::service::jobs::JobKind {
                app: crate::service::spec::App::Mlr,
                sync: "bsp".into(),
                instance_types: vec![],
            },
            provisional_usd: Default::default(),
        })
    }

    #[test]
    fn serves_what_was_read_until_invalidated() {
        let cache = StatusCache::default();
        assert!(cache.get(JobId(1)).is_none());
        cache.put(JobId(1), Instant::now(), record("a"));
        assert_eq!(cache.get(JobId(1)).unwrap().job.name, "a");
        assert!(cache.get(JobId(2)).is_none());
        cache.invalidate();
        assert!(cache.get(JobId(1)).is_none());
    }

    #[test]
    fn a_read_that_started_before_a_write_is_not_kept() {
        let cache = StatusCache::default();
        let started = Instant::now();
        // A write lands (and invalidates) while the read is under way.
        std::thread::sleep(Duration::from_millis(2));
        cache.invalidate();
        cache.put(JobId(1), started, record("stale"));
        assert!(cache.get(JobId(1)).is_none());
        // A read that started after the write is kept.
        cache.put(JobId(1), Instant::now(), record("fresh"));
        assert_eq!(cache.get(JobId(1)).unwrap().job.name, "fresh");
    }

    #[test]
    fn an_older_read_never_replaces_a_newer_one() {
        let cache = StatusCache::default();
        let older = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        cache.put(JobId(1), Instant::now(), record("newer"));
        cache.put(JobId(1), older, record("older"));
        assert_eq!(cache.get(JobId(1)).unwrap().job.name, "newer");
    }

    #[tokio::test]
    async fn a_refresh_reads_again_what_is_being_asked_for() {
        let store = Store::open("sqlite::memory:").await.unwrap();
        let new_job = |name: &str| crate::store::NewJob {
            name: name.into(),
            spec: "{}".into(),
            policy: "bidbrain".into(),
            billing: "per-second".into(),
            budget_usd: None,
            deadline: None,
            created: Timestamp::from_millis(0),
            grant_window_ms: 0,
        };
        let asked = store.create_job(&new_job("asked")).await.unwrap();
        let unasked = store.create_job(&new_job("unasked")).await.unwrap();
        let cache = StatusCache::default();
        let read = |id| JobRecord::read(&store, id, Arc::default());
        cache.put(
            asked,
            Instant::now(),
            Arc::new(read(asked).await.unwrap().unwrap()),
        );
        let long_ago = Instant::now().checked_sub(TTL).expect("uptime over TTL");
        cache.put(
            unasked,
            long_ago,
            Arc::new(read(unasked).await.unwrap().unwrap()),
        );
        // The scheduler writes, then refreshes.
        store
            .set_job_state(
                None,
                asked,
                JobState::Running,
                None,
                Timestamp::from_millis(1),
            )
            .await
            .unwrap();
        cache.refresh(&store, Timestamp::from_millis(1)).await;
        assert_eq!(cache.get(asked).unwrap().job.state, JobState::Running);
        assert!(cache.get(unasked).is_none());
    }

    #[test]
    fn entries_expire() {
        let cache = StatusCache::default();
        let long_ago = Instant::now().checked_sub(TTL).expect("uptime over TTL");
        cache.put(JobId(1), long_ago, record("old"));
        assert!(cache.get(JobId(1)).is_none());
    }
}
