//! One broker per Postgres database, until jobs are shared through leases: a session-level
//! advisory lock held on a connection of its own, outside the pool.
//!
//! The lock lives as long as that connection: the server drops it when the broker dies
//! (`kill -9` included, as the socket closes) or when Postgres restarts. [`PgExclusive::keep`]
//! watches the connection and takes the lock again after an outage; if another broker took it
//! meanwhile, it says so and this broker must stop.

use super::{Context, StoreError};
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Connection};
use std::str::FromStr;
use std::time::Duration;

/// The advisory lock's key ("PROT"): advisory locks are per database, so this names "the
/// broker of this database".
const KEY: i64 = 0x5052_4f54;

/// How often the lock's connection is checked.
const CHECK_EVERY: Duration = Duration::from_secs(2);

/// An advisory lock this broker holds on its Postgres database.
pub struct PgExclusive {
    conn: PgConnection,
    options: PgConnectOptions,
}

/// Why [`PgExclusive::take`] did not get the lock.
#[derive(Debug)]
pub enum Refused {
    /// Another session holds it: its `application_name` (the other broker's PID and address),
    /// when Postgres shows it.
    Held(Option<String>),
    Store(StoreError),
}

impl From<StoreError> for Refused {
    fn from(e: StoreError) -> Self {
        Refused::Store(e)
    }
}

impl PgExclusive {
    /// Takes the lock on the database of `url` under the name `label` (shown to a broker that
    /// is refused; Postgres keeps at most 63 bytes of it).
    pub async fn take(url: &str, label: &str) -> Result<PgExclusive, Refused> {
        let options = PgConnectOptions::from_str(url)
            .map_err(|source| StoreError::Connect {
                url: super::redact(url),
                source,
            })?
            .application_name(label);
        let conn = connect(&options, url).await?;
        let mut held = PgExclusive { conn, options };
        held.lock().await?;
        Ok(held)
    }

    async fn lock(&mut self) -> Result<(), Refused> {
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(KEY)
            .fetch_one(&mut self.conn)
            .await
            .context("taking the broker's lock")?;
        if got {
            return Ok(());
        }
        let holder: Option<String> = sqlx::query_scalar(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.granted AND l.classid::bigint = 0 AND l.objid::bigint = $1 \
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .bind(KEY)
        .fetch_optional(&mut self.conn)
        .await
        .context("asking who holds the broker's lock")?;
        Err(Refused::Held(holder.filter(|h| !h.is_empty())))
    }

    /// Keeps the lock until `stop` resolves: checks its connection every [`CHECK_EVERY`] and,
    /// after an outage, connects and takes the lock again. Returns an error only when another
    /// session took the lock while this one had lost it.
    pub async fn keep(
        mut self,
        url: String,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<(), Refused> {
        tokio::pin!(stop);
        let mut lost = false;
        loop {
            tokio::select! {
                _ = &mut stop => {
                    let _ = self.conn.close().await;
                    return Ok(());
                }
                _ = tokio::time::sleep(CHECK_EVERY) => {}
            }
            if !lost {
                if self.conn.ping().await.is_ok() {
                    continue;
                }
                tracing::warn!(
                    "the connection holding the broker's database lock is gone; taking it again"
                );
                lost = true;
            }
            let Ok(conn) = connect(&self.options, &url).await else {
                continue; // Postgres is still away: so is anybody else's lock.
            };
            self.conn = conn;
            match self.lock().await {
                Ok(()) => {
                    tracing::info!("the broker's database lock is held again");
                    lost = false;
                }
                Err(Refused::Store(e)) => {
                    tracing::warn!(error = %e, "cannot take the broker's database lock yet");
                }
                Err(held) => return Err(held),
            }
        }
    }
}

async fn connect(options: &PgConnectOptions, url: &str) -> Result<PgConnection, StoreError> {
    options
        .connect()
        .await
        .map_err(|source| StoreError::Connect {
            url: super::redact(url),
            source,
        })
}
