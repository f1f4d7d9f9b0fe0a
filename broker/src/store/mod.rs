//! The broker's database: Postgres in production, SQLite as the embedded default.
//!
//! Both backends share one schema (see `migrations/`) and, wherever the dialects agree, one
//! query text: [`with_db!`] expands a block once per backend, so a query is written once yet
//! runs on each driver's native types. Backend-specific code is confined to where it pays, such
//! as `COPY` for bulk price loads on Postgres.

mod exclusive;
mod jobs;
mod leases;
mod outputs;
mod pools;
mod prices;

pub use exclusive::{PgExclusive, Refused};

pub use jobs::{
    Cooldown, CooldownScope, EventRecord, EventRow, InstanceRow, InstanceState, JobRow, JobState,
    LedgerLine, NewJob, WorkRecord,
};
pub use leases::{BrokerRow, Lease};
pub use prices::{IngestCounts, MarketFilter, MarketRow};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;
use thiserror::Error;

/// Errors from the store. Each carries what the store was doing, so a log line is actionable.
#[derive(Debug, Error)]
pub enum StoreError {
    #[error("database URL `{url}` is not supported: use postgres://… or sqlite://…")]
    UnsupportedUrl { url: String },
    #[error("cannot connect to {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("cannot create the database directory {dir}: {source}")]
    CreateDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("applying migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("{context}: {source}")]
    Query {
        context: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("{0}")]
    Invalid(String),
    /// A write for a job carried a lease another broker has since taken over.
    #[error("job {job} is now owned by another broker: this broker's lease on it has ended")]
    Fenced { job: proteus_wire::JobId },
}

/// Adds what the store was doing to a driver error.
pub(crate) trait Context<T> {
    fn context(self, context: &'static str) -> Result<T, StoreError>;
}

impl<T> Context<T> for Result<T, sqlx::Error> {
    fn context(self, context: &'static str) -> Result<T, StoreError> {
        self.map_err(|source| StoreError::Query { context, source })
    }
}

/// Which database the store runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

#[derive(Debug, Clone)]
pub(crate) enum Db {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

/// Runs `$body` with `$pool` bound to the backend's native pool. The body is compiled once per
/// backend, so it must use only SQL and Rust types both drivers understand.
macro_rules! with_db {
    ($store:expr, |$pool:ident| $body:expr) => {
        match &$store.db {
            $crate::store::Db::Postgres($pool) => $body,
            $crate::store::Db::Sqlite($pool) => $body,
        }
    };
}
pub(crate) use with_db;

/// How long Postgres lets one of the store's sessions sit inside an open transaction before it
/// ends the session (and the transaction, and its row locks). A broker's transactions are a few
/// statements in a row; one that idles this long belongs to a process that is paused or
/// starved, and the job rows it holds would otherwise stop other brokers' takeovers (and every
/// fenced write) until it wakes. Below the default lease (10 s): a broker paused mid-transaction
/// delays the takeover of the rows it holds to this long after the pause at most, when that is
/// later than its lease's expiry. The woken broker's statement fails and its
/// next round retries it.
pub const IDLE_IN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(5);

/// The store: a connection pool on one of the two backends.
#[derive(Debug, Clone)]
pub struct Store {
    pub(crate) db: Db,
    url: String,
}

impl Store {
    /// Connects to `url` (`postgres://…` or `sqlite://…`; a SQLite file is created if missing).
    pub async fn connect(url: &str) -> Result<Store, StoreError> {
        let redacted = redact(url);
        let connect_err = |source| StoreError::Connect {
            url: redacted.clone(),
            source,
        };
        let db = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let options = PgConnectOptions::from_str(url)
                .map_err(connect_err)?
                .options([(
                    "idle_in_transaction_session_timeout",
                    IDLE_IN_TRANSACTION_TIMEOUT.as_millis().to_string(),
                )]);
            let pool = PgPoolOptions::new()
                .max_connections(16)
                .acquire_timeout(Duration::from_secs(10))
                .connect_with(options)
                .await
                .map_err(connect_err)?;
            Db::Postgres(pool)
        } else if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)
                .map_err(connect_err)?
                .create_if_missing(true)
                .foreign_keys(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(10));
            if let Some(dir) = options
                .get_filename()
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
            {
                std::fs::create_dir_all(dir).map_err(|source| StoreError::CreateDir {
                    dir: dir.to_path_buf(),
                    source,
                })?;
            }
            // Each in-memory connection would be its own empty database.
            let max = if url.contains(":memory:") { 1 } else { 8 };
            let pool = SqlitePoolOptions::new()
                .max_connections(max)
                .connect_with(options)
                .await
                .map_err(connect_err)?;
            Db::Sqlite(pool)
        } else {
            return Err(StoreError::UnsupportedUrl { url: redacted });
        };
        Ok(Store { db, url: redacted })
    }

    /// Connects and applies any pending migrations: what `serve` and `demo` do at start.
    pub async fn open(url: &str) -> Result<Store, StoreError> {
        let store = Store::connect(url).await?;
        store.migrate().await?;
        Ok(store)
    }

    pub async fn migrate(&self) -> Result<(), StoreError> {
        match &self.db {
            Db::Postgres(pool) => sqlx::migrate!("../migrations/postgres").run(pool).await?,
            Db::Sqlite(pool) => sqlx::migrate!("../migrations/sqlite").run(pool).await?,
        }
        Ok(())
    }

    /// Takes every idle connection at once, so that the pool checks each (a ping) and replaces
    /// the dead ones, then gives them back: what to do once the database is back after an
    /// outage, rather than leave each dead connection to whoever takes it next. Returns how many
    /// were taken. Nothing to do on SQLite (a file, no server to lose).
    pub async fn recycle_idle_connections(&self) -> usize {
        match &self.db {
            Db::Postgres(pool) => {
                let idle = pool.num_idle();
                let taken = futures::future::join_all((0..idle).map(|_| pool.acquire())).await;
                taken.iter().filter(|c| c.is_ok()).count()
            }
            Db::Sqlite(_) => 0,
        }
    }

    pub fn backend(&self) -> Backend {
        match self.db {
            Db::Postgres(_) => Backend::Postgres,
            Db::Sqlite(_) => Backend::Sqlite,
        }
    }

    /// The URL with any password masked: safe to print.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Runs one statement outside any transaction, e.g. `CREATE DATABASE` from test tooling.
    pub async fn execute_admin(&self, sql: &str) -> Result<(), StoreError> {
        with_db!(self, |pool| {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
                .execute(pool)
                .await
                .context("running an administrative statement")?;
        });
        Ok(())
    }

    /// Every (table, column) of the application schema, sorted: how a test proves that the two
    /// backends' migrations build the same schema.
    /// The schema as both backends can describe it, normalised so that the two migration sets
    /// can be compared: every column with its storage class and nullability, the primary keys,
    /// and every other index with its columns and uniqueness.
    pub async fn schema(&self) -> Result<Schema, StoreError> {
        let mut schema = Schema::default();
        match &self.db {
            Db::Postgres(pool) => {
                let cols: Vec<(String, String, String, String)> = sqlx::query_as(
                    "SELECT table_name::TEXT, column_name::TEXT, data_type::TEXT, is_nullable::TEXT \
                     FROM information_schema.columns WHERE table_schema = 'public'",
                )
                .fetch_all(pool)
                .await
                .context("reading the schema")?;
                let indexes: Vec<(String, bool, bool, String)> = sqlx::query_as(
                    "SELECT t.relname::TEXT, ix.indisprimary, ix.indisunique, \
                         array_to_string(ARRAY(SELECT a.attname FROM unnest(ix.indkey) \
                         WITH ORDINALITY AS k(attnum, ord) JOIN pg_attribute a \
                         ON a.attrelid = t.oid AND a.attnum = k.attnum ORDER BY k.ord), ',') \
                     FROM pg_index ix JOIN pg_class t ON t.oid = ix.indrelid \
                     JOIN pg_namespace n ON n.oid = t.relnamespace WHERE n.nspname = 'public'",
                )
                .fetch_all(pool)
                .await
                .context("reading the indexes")?;
                for (table, column, kind, nullable) in cols {
                    schema.columns.push(SchemaColumn {
                        table,
                        column,
                        kind: storage_class(&kind),
                        nullable: nullable == "YES",
                    });
                }
                for (table, primary, unique, columns) in indexes {
                    let columns: Vec<String> = columns.split(',').map(str::to_string).collect();
                    if primary {
                        schema.primary_keys.push((table, columns));
                    } else {
                        schema.indexes.push(SchemaIndex {
                            table,
                            columns,
                            unique,
                        });
                    }
                }
            }
            Db::Sqlite(pool) => {
                let cols: Vec<(String, String, String, i64, i64)> = sqlx::query_as(
                    "SELECT m.name, p.name, p.type, p.\"notnull\", p.pk FROM sqlite_master m \
                     JOIN pragma_table_info(m.name) p WHERE m.type = 'table' ORDER BY m.name, p.pk",
                )
                .fetch_all(pool)
                .await
                .context("reading the schema")?;
                let indexes: Vec<(String, String, i64, String, i64, String)> = sqlx::query_as(
                    "SELECT m.name, il.name, il.\"unique\", il.origin, ii.seqno, ii.name \
                     FROM sqlite_master m JOIN pragma_index_list(m.name) il \
                     JOIN pragma_index_info(il.name) ii WHERE m.type = 'table' \
                     ORDER BY m.name, il.name, ii.seqno",
                )
                .fetch_all(pool)
                .await
                .context("reading the indexes")?;
                let mut keys: std::collections::BTreeMap<String, Vec<String>> = Default::default();
                for (table, column, kind, not_null, pk) in cols {
                    if pk > 0 {
                        keys.entry(table.clone()).or_default().push(column.clone());
                    }
                    schema.columns.push(SchemaColumn {
                        table,
                        column,
                        kind: storage_class(&kind),
                        // SQLite lets an INTEGER PRIMARY KEY be declared nullable; it never is.
                        nullable: not_null == 0 && pk == 0,
                    });
                }
                schema.primary_keys.extend(keys);
                let mut by_index: std::collections::BTreeMap<
                    (String, String),
                    (bool, bool, Vec<String>),
                > = Default::default();
                for (table, index, unique, origin, _, column) in indexes {
                    let entry = by_index.entry((table, index)).or_insert((
                        unique != 0,
                        origin == "pk",
                        Vec::new(),
                    ));
                    entry.2.push(column);
                }
                for ((table, _), (unique, primary, columns)) in by_index {
                    if primary {
                        // A TEXT primary key's automatic index: the key itself, listed above.
                        continue;
                    }
                    schema.indexes.push(SchemaIndex {
                        table,
                        columns,
                        unique,
                    });
                }
            }
        }
        let internal = |t: &str| t.starts_with("_sqlx") || t.starts_with("sqlite_");
        schema.columns.retain(|c| !internal(&c.table));
        schema.indexes.retain(|i| !internal(&i.table));
        schema.primary_keys.retain(|(t, _)| !internal(t));
        schema
            .columns
            .sort_by(|a, b| (&a.table, &a.column).cmp(&(&b.table, &b.column)));
        schema.indexes.sort_by(|a, b| {
            (&a.table, &a.columns, a.unique).cmp(&(&b.table, &b.columns, b.unique))
        });
        schema.primary_keys.sort();
        Ok(schema)
    }

    pub async fn close(&self) {
        with_db!(self, |pool| pool.close().await)
    }
}

/// A database schema as [`Store::schema`] describes it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Schema {
    pub columns: Vec<SchemaColumn>,
    /// Table and key columns, in key order.
    pub primary_keys: Vec<(String, Vec<String>)>,
    /// Unique constraints and indexes other than primary keys.
    pub indexes: Vec<SchemaIndex>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SchemaColumn {
    pub table: String,
    pub column: String,
    /// `integer`, `real`, `text` or `bytes`: what both backends store, whatever the name.
    pub kind: &'static str,
    pub nullable: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SchemaIndex {
    pub table: String,
    pub columns: Vec<String>,
    pub unique: bool,
}

/// The storage class of a declared column type on either backend.
fn storage_class(declared: &str) -> &'static str {
    let t = declared.to_ascii_lowercase();
    if t.contains("int") {
        "integer"
    } else if t.contains("double")
        || t.contains("real")
        || t.contains("float")
        || t.contains("numeric")
    {
        "real"
    } else if t.contains("char") || t.contains("text") || t.contains("clob") {
        "text"
    } else if t.contains("bytea") || t.contains("blob") {
        "bytes"
    } else {
        "other"
    }
}

/// The file of a `sqlite:` URL; None for Postgres and in-memory databases.
pub fn sqlite_file(url: &str) -> Option<std::path::PathBuf> {
    if !url.starts_with("sqlite:") || url.contains(":memory:") || url.contains("mode=memory") {
        return None;
    }
    let options = SqliteConnectOptions::from_str(url).ok()?;
    Some(options.get_filename().to_path_buf())
}

/// The embedded default: a SQLite file under the user's data directory.
pub fn default_database_url() -> String {
    let path = crate::data::user_dir().join("proteus.db");
    format!("sqlite://{}", path.display())
}

/// Masks the password of a URL such as `postgres://user:secret@host/db`.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.split_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{host}")
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked() {
        assert_eq!(redact("postgres://u:pw@h:5/db"), "postgres://u:***@h:5/db");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("sqlite:///tmp/x.db"), "sqlite:///tmp/x.db");
    }
}
