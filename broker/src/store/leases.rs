//! Brokers and the leases through which they own jobs (migration 0006).
//!
//! Several brokers may share one Postgres database. Each has a row in `brokers`, refreshed by
//! its heartbeat; each unfinished job has at most one owner, through a lease on its row: the
//! owner's id, a fencing token and an expiry in wall time. The owner renews its leases with its
//! heartbeat. A job whose lease expired (its owner died or stalled) is claimed by another
//! broker, which adds one to the token. Every write the owner makes for a job carries the
//! token it holds ([`Lease`]); the store refuses it ([`StoreError::Fenced`]) once a newer token
//! exists, so a broker that wakes from a pause after losing a job cannot write for it.
//!
//! Times here are epoch milliseconds **on the database's clock**: every statement that sets or
//! judges an expiry reads the time inside the database ([`Store::db_now_sql`]), so brokers
//! whose own clocks disagree (one runs a minute fast) still agree on when a lease ends. A
//! broker's wall clock never enters a lease decision; what it keeps locally is a monotonic
//! deadline shorter than the lease (see `service::membership`).

use super::{Context, Store, StoreError, with_db};
use proteus_wire::JobId;

/// The right to write for one job: proof that the holder owned the job's lease with this
/// token. Obtained only from the store, when a lease is granted, claimed or renewed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease {
    job: JobId,
    token: i64,
}

impl Lease {
    /// A lease as the store would give it, for unit tests of its holders.
    #[cfg(test)]
    pub(crate) fn for_test(job: JobId, token: i64) -> Lease {
        Lease { job, token }
    }
    pub fn job(&self) -> JobId {
        self.job
    }
    pub fn token(&self) -> i64 {
        self.token
    }
}

/// A broker as its row says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerRow {
    pub id: String,
    pub url: String,
    pub pid: u32,
    pub started_ms: i64,
    pub heartbeat_ms: i64,
    /// Unfinished jobs it owns.
    pub jobs: i64,
}

/// The SQL condition "the job's lease token is `$n`" for a statement on `jobs` (the bound token
/// `None` means a write that is not the owner's — a user's cancel — and is not fenced).
pub(crate) fn jobs_fence(param: usize) -> String {
    format!("(${param} IS NULL OR lease_token = ${param})")
}

/// The same for a statement on a job's instances.
pub(crate) fn instances_fence(param: usize) -> String {
    format!(
        "(${param} IS NULL OR EXISTS (SELECT 1 FROM jobs j WHERE j.id = instances.job_id \
         AND j.lease_token = ${param}))"
    )
}

pub(crate) fn token_of(lease: Option<&Lease>) -> Option<i64> {
    lease.map(|l| l.token)
}

impl Store {
    /// The SQL expression for "now" on the database's clock, in epoch milliseconds.
    pub(crate) fn db_now_sql(&self) -> &'static str {
        match self.backend() {
            super::Backend::Postgres => {
                "(EXTRACT(EPOCH FROM statement_timestamp()) * 1000)::BIGINT"
            }
            super::Backend::Sqlite => {
                "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"
            }
        }
    }

    /// The database's clock now, in epoch milliseconds: what lease expiries are judged by.
    pub async fn db_now_ms(&self) -> Result<i64, StoreError> {
        let sql = format!("SELECT {}", self.db_now_sql());
        let now: i64 = with_db!(self, |pool| {
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .fetch_one(pool)
                .await
                .context("reading the database's clock")?
        });
        Ok(now)
    }

    /// Records (or refreshes) a broker's row.
    pub async fn register_broker(&self, id: &str, url: &str, pid: u32) -> Result<(), StoreError> {
        let now = self.db_now_sql();
        let sql = format!(
            "INSERT INTO brokers (id, url, pid, started_ms, heartbeat_ms) VALUES ($1, $2, $3, {now}, {now}) \
             ON CONFLICT (id) DO UPDATE SET url = $2, pid = $3, started_ms = {now}, heartbeat_ms = {now}"
        );
        with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(url)
                .bind(i64::from(pid))
                .execute(pool)
                .await
                .context("registering this broker")?;
        });
        Ok(())
    }

    /// The heartbeat: refreshes the broker's row and renews every lease it still holds until
    /// `lease_ms` from now (the database's now). A lease another broker claimed (after it
    /// expired) is not renewed: the answer is the leases still held, with their tokens.
    pub async fn heartbeat(&self, id: &str, lease_ms: i64) -> Result<Vec<Lease>, StoreError> {
        let now = self.db_now_sql();
        let beat = format!("UPDATE brokers SET heartbeat_ms = {now} WHERE id = $1");
        let renew = format!(
            "UPDATE jobs SET lease_expires_ms = {now} + $2 WHERE lease_owner = $1 \
             RETURNING id, lease_token"
        );
        let rows: Vec<(i64, i64)> = with_db!(self, |pool| {
            sqlx::query(sqlx::AssertSqlSafe(beat))
                .bind(id)
                .execute(pool)
                .await
                .context("recording this broker's heartbeat")?;
            sqlx::query_as(sqlx::AssertSqlSafe(renew))
                .bind(id)
                .bind(lease_ms)
                .fetch_all(pool)
                .await
                .context("renewing this broker's leases")?
        });
        Ok(rows
            .into_iter()
            .map(|(job, token)| Lease {
                job: JobId(job),
                token,
            })
            .collect())
    }

    /// Claims up to `max` jobs whose lease expired (or that have no owner while unfinished, or
    /// that an owner left while winding them down), adding one to each token. With `force`, live
    /// leases of other brokers are taken too: only for a broker that knows it is alone (it holds
    /// the embedded database's exclusive lock). Without `unowned`, jobs that never had an owner
    /// are left alone: a broker at its fair share leaves a new job to the broker its submitter
    /// gives it to (else it could take it between the insert and that grant).
    pub async fn claim_expired(
        &self,
        id: &str,
        lease_ms: i64,
        max: i64,
        force: bool,
        unowned: bool,
    ) -> Result<Vec<Lease>, StoreError> {
        if max <= 0 {
            return Ok(Vec::new());
        }
        // The condition is repeated outside the sub-select: Postgres re-checks it on the row as
        // another broker's concurrent claim left it, so two claims never both win.
        // Its own leases a broker renews (its heartbeat), it does not claim them.
        // A job without an owner waits out its submitter's grant (`NewJob::grant_window_ms`,
        // kept in `lease_expires_ms`; a released lease has 0 there), unless the claimant is
        // alone. Expiry is judged on the database's clock, never the claimant's.
        let now = self.db_now_sql();
        let claimable = format!(
            "((lease_owner IS NULL AND $5 = 1 AND (lease_expires_ms <= {now} OR $4 = 1)) \
                 OR (lease_owner <> $1 \
                 AND (lease_expires_ms <= {now} OR $4 = 1))) \
             AND (state IN ('pending', 'running') OR lease_owner IS NOT NULL)"
        );
        // On Postgres a job whose row another transaction holds is skipped, not waited for: a
        // broker paused inside a transaction (until the server ends it, see
        // `IDLE_IN_TRANSACTION_TIMEOUT`) must not stop the takeover of every other job. SQLite
        // has one writer at a time and no row locks.
        let skip_locked = match self.backend() {
            super::Backend::Postgres => "FOR UPDATE SKIP LOCKED",
            super::Backend::Sqlite => "",
        };
        let sql = format!(
            "UPDATE jobs SET lease_owner = $1, lease_token = lease_token + 1, \
                 lease_expires_ms = {now} + $2 \
             WHERE id IN (SELECT id FROM jobs WHERE {claimable} ORDER BY id LIMIT $3 {skip_locked}) \
               AND {claimable} \
             RETURNING id, lease_token"
        );
        let rows: Vec<(i64, i64)> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .bind(lease_ms)
                .bind(max)
                .bind(i64::from(force))
                .bind(i64::from(unowned))
                .fetch_all(pool)
                .await
                .context("claiming jobs whose lease expired")?
        });
        Ok(rows
            .into_iter()
            .map(|(job, token)| Lease {
                job: JobId(job),
                token,
            })
            .collect())
    }

    /// Gives up a lease (the job is wound down, or the broker is stopping): the job is then
    /// claimable at once. Refused when the lease is no longer this one.
    pub async fn release_lease(&self, lease: &Lease) -> Result<bool, StoreError> {
        let done = with_db!(self, |pool| {
            sqlx::query(
                "UPDATE jobs SET lease_owner = NULL, lease_expires_ms = 0 \
                 WHERE id = $1 AND lease_token = $2",
            )
            .bind(lease.job.0)
            .bind(lease.token)
            .execute(pool)
            .await
            .context("releasing a job's lease")?
            .rows_affected()
        });
        Ok(done > 0)
    }

    /// A stopping broker's last words: its leases released and its row removed.
    pub async fn leave(&self, id: &str) -> Result<(), StoreError> {
        with_db!(self, |pool| {
            sqlx::query(
                "UPDATE jobs SET lease_owner = NULL, lease_expires_ms = 0 WHERE lease_owner = $1",
            )
            .bind(id)
            .execute(pool)
            .await
            .context("releasing this broker's leases")?;
            sqlx::query("DELETE FROM brokers WHERE id = $1")
                .bind(id)
                .execute(pool)
                .await
                .context("removing this broker's row")?;
        });
        Ok(())
    }

    /// Brokers whose heartbeat is at most `within_ms` old (on the database's clock), with how
    /// many unfinished jobs each owns, fewest first (ties by id).
    pub async fn live_brokers(&self, within_ms: i64) -> Result<Vec<BrokerRow>, StoreError> {
        type Row = (String, String, i64, i64, i64, i64);
        let sql = format!(
            "SELECT b.id, b.url, b.pid, b.started_ms, b.heartbeat_ms, \
                 (SELECT COUNT(*) FROM jobs j WHERE j.lease_owner = b.id \
                  AND j.state IN ('pending', 'running')) AS jobs \
             FROM brokers b WHERE b.heartbeat_ms >= {} - $1 ORDER BY jobs, b.id",
            self.db_now_sql()
        );
        let rows: Vec<Row> = with_db!(self, |pool| {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(within_ms)
                .fetch_all(pool)
                .await
                .context("listing live brokers")?
        });
        Ok(rows
            .into_iter()
            .map(|(id, url, pid, started_ms, heartbeat_ms, jobs)| BrokerRow {
                id,
                url,
                pid: u32::try_from(pid).unwrap_or(0),
                started_ms,
                heartbeat_ms,
                jobs,
            })
            .collect())
    }

    /// Gives a new job to `owner` (the submitting broker picks the one with the fewest jobs):
    /// its first lease. `None` when a broker claimed the job in between.
    pub async fn grant_lease(
        &self,
        job: JobId,
        owner: &str,
        lease_ms: i64,
    ) -> Result<Option<Lease>, StoreError> {
        let sql = format!(
            "UPDATE jobs SET lease_owner = $2, lease_token = lease_token + 1, \
                 lease_expires_ms = {} + $3 \
             WHERE id = $1 AND lease_owner IS NULL RETURNING lease_token",
            self.db_now_sql()
        );
        let token: Option<i64> = with_db!(self, |pool| {
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(job.0)
                .bind(owner)
                .bind(lease_ms)
                .fetch_optional(pool)
                .await
                .context("granting a new job's lease")?
        });
        Ok(token.map(|token| Lease { job, token }))
    }

    /// Counts unfinished jobs (for each broker's fair share).
    pub async fn active_job_count(&self) -> Result<i64, StoreError> {
        let n: i64 = with_db!(self, |pool| {
            sqlx::query_scalar("SELECT COUNT(*) FROM jobs WHERE state IN ('pending', 'running')")
                .fetch_one(pool)
                .await
                .context("counting unfinished jobs")?
        });
        Ok(n)
    }

    /// What a fenced write that changed `changed` rows returns: when it changed nothing, the
    /// lease is checked, to tell "nothing to change" from "fenced out".
    pub(crate) async fn fenced(
        &self,
        lease: Option<&Lease>,
        changed: u64,
    ) -> Result<u64, StoreError> {
        if changed == 0 {
            self.check_lease(lease).await?;
        }
        Ok(changed)
    }

    /// Whether `lease` is still the job's current lease.
    async fn check_lease(&self, lease: Option<&Lease>) -> Result<(), StoreError> {
        let Some(lease) = lease else {
            return Ok(());
        };
        let token: Option<i64> = with_db!(self, |pool| {
            sqlx::query_scalar("SELECT lease_token FROM jobs WHERE id = $1")
                .bind(lease.job.0)
                .fetch_optional(pool)
                .await
                .context("checking a job's lease")?
        });
        match token {
            Some(t) if t == lease.token => Ok(()),
            _ => Err(StoreError::Fenced { job: lease.job }),
        }
    }
}
