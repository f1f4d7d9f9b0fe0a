//! One broker per embedded database and per state directory.
//!
//! `proteus serve` holds an exclusive lock on `<database>.lock` (the embedded SQLite default:
//! one process may write it) and on `<state dir>/broker.lock` (agents' files, checkpoints and
//! outputs are one broker's) before it writes anything. A second broker on either is refused,
//! told the PID and address of the one that holds it. The locks are `flock`s: the kernel drops
//! them when the process dies, `kill -9` included, so a restart needs no clean-up; the files
//! are opened close-on-exec, so agents the broker starts (which outlive it) do not inherit them.
//!
//! On Postgres, brokers share the jobs through leases (`service::membership`), except with the
//! simulated cloud, which lives inside one broker: then one broker holds the database through
//! an advisory lock ([`lock_postgres`]).

use crate::store::{PgExclusive, Refused};
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "another broker is running on {what} {}: {holder}; stop it first, or give this \
         broker its own --database-url and --state-dir (lock file {})",
        .path.display(), .lock.display()
    )]
    Held {
        what: &'static str,
        path: PathBuf,
        lock: PathBuf,
        holder: Holder,
    },
    #[error(
        "another broker is running on the Postgres database {url}: {}; several brokers on \
         one Postgres database share it only on a cloud they share (--cloud ec2), not the \
         simulated cloud, which lives inside one broker: stop it first, or give this broker a \
         database of its own",
        .holder.as_deref().unwrap_or("a session whose name Postgres does not show")
    )]
    PgHeld { url: String, holder: Option<String> },
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("cannot lock {} (for the {what} {}): {source}", .lock.display(), .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        lock: PathBuf,
        source: std::io::Error,
    },
}

/// Who holds a lock, as its lock file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub pid: Option<u32>,
    pub addr: Option<String>,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.pid {
            Some(pid) => write!(f, "PID {pid}")?,
            None => write!(f, "PID unknown")?,
        }
        match &self.addr {
            Some(addr) => write!(f, ", listening on {addr}"),
            None => write!(f, ", address not yet known"),
        }
    }
}

impl Holder {
    /// Reads `pid=…` and `addr=…` lines; anything else is ignored.
    fn parse(text: &str) -> Holder {
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
                .map(str::trim)
                .filter(|v| !v.is_empty())
        };
        Holder {
            pid: field("pid").and_then(|p| p.parse().ok()),
            addr: field("addr").map(str::to_string),
        }
    }
}

/// The locks this broker holds; they are released when it is dropped or the process ends.
#[derive(Debug)]
pub struct BrokerLock {
    files: Vec<File>,
}

impl BrokerLock {
    /// Locks the state directory and, for the embedded database, its file. `database` is the
    /// SQLite file (None for Postgres or an in-memory database).
    pub fn acquire(state_dir: &Path, database: Option<&Path>) -> Result<BrokerLock, LockError> {
        let mut targets = vec![("state directory", state_dir.to_path_buf(), {
            state_dir.join("broker.lock")
        })];
        if let Some(db) = database {
            let mut lock = db.as_os_str().to_owned();
            lock.push(".lock");
            targets.push(("database", db.to_path_buf(), PathBuf::from(lock)));
        }
        let mut files = Vec::new();
        for (what, path, lock) in targets {
            files.push(lock_one(what, &path, &lock)?);
        }
        let mut held = BrokerLock { files };
        held.write(None).map_err(|source| LockError::Io {
            what: "state directory",
            path: state_dir.to_path_buf(),
            lock: state_dir.join("broker.lock"),
            source,
        })?;
        Ok(held)
    }

    /// Records the address this broker listens on, for whoever is refused next.
    pub fn announce(&mut self, addr: &str) -> std::io::Result<()> {
        self.write(Some(addr))
    }

    fn write(&mut self, addr: Option<&str>) -> std::io::Result<()> {
        let text = format!(
            "pid={}\naddr={}\n",
            std::process::id(),
            addr.unwrap_or_default()
        );
        for f in &mut self.files {
            f.set_len(0)?;
            f.rewind()?;
            f.write_all(text.as_bytes())?;
            f.sync_data()?;
        }
        Ok(())
    }
}

/// Takes the Postgres database of `url` for this broker (see [`PgExclusive`]), naming it by
/// its PID and `addr` to a broker that is refused.
///
/// A broker that has just died may hold the lock for a moment (until its server session sees
/// the closed socket): a held lock is asked for again for up to [`PG_LOCK_WAIT`].
pub async fn lock_postgres(url: &str, addr: &str) -> Result<PgExclusive, LockError> {
    let label = format!("proteus serve pid={} {addr}", std::process::id());
    let deadline = std::time::Instant::now() + PG_LOCK_WAIT;
    loop {
        match PgExclusive::take(url, &label).await {
            Ok(held) => return Ok(held),
            Err(Refused::Held(_)) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
            Err(Refused::Held(holder)) => {
                return Err(LockError::PgHeld {
                    url: crate::store::redact(url),
                    holder,
                });
            }
            Err(Refused::Store(e)) => return Err(LockError::Store(e)),
        }
    }
}

/// How long [`lock_postgres`] waits for a lock that another session holds.
pub const PG_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

fn lock_one(what: &'static str, path: &Path, lock: &Path) -> Result<File, LockError> {
    let io = |source| LockError::Io {
        what,
        path: path.to_path_buf(),
        lock: lock.to_path_buf(),
        source,
    };
    if let Some(dir) = lock.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(lock)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => {
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            Err(LockError::Held {
                what,
                path: path.to_path_buf(),
                lock: lock.to_path_buf(),
                holder: Holder::parse(&text),
            })
        }
        Err(TryLockError::Error(e)) => Err(io(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_files_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let db = dir.path().join("proteus.db");
        let mut first = BrokerLock::acquire(&state, Some(&db)).unwrap();
        first.announce("http://127.0.0.1:8080").unwrap();
        // The state directory is locked first: that is what a second broker is told about.
        match BrokerLock::acquire(&state, Some(&db)).unwrap_err() {
            LockError::Held { what, holder, .. } => {
                assert_eq!(what, "state directory");
                assert_eq!(holder.pid, Some(std::process::id()));
                assert_eq!(holder.addr.as_deref(), Some("http://127.0.0.1:8080"));
            }
            e => panic!("{e}"),
        }
        // Another state directory on the same database: the database's lock refuses it.
        let err = BrokerLock::acquire(&dir.path().join("other"), Some(&db)).unwrap_err();
        assert!(
            err.to_string()
                .contains("another broker is running on database"),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("listening on http://127.0.0.1:8080")
        );
        // Released with the holder: the next broker gets it.
        drop(first);
        BrokerLock::acquire(&state, Some(&db)).unwrap();
    }

    #[test]
    fn a_lock_file_without_a_holder_says_so() {
        assert_eq!(
            Holder::parse("pid=42\naddr=\n").to_string(),
            "PID 42, address not yet known"
        );
        assert_eq!(
            Holder::parse("").to_string(),
            "PID unknown, address not yet known"
        );
    }
}
