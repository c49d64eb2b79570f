//! Whether the database takes writes: the controlplane's readiness is "reachable *and*
//! writable", because a database that answers reads while refusing every write (a full disk, a
//! file or volume that became read-only, a PostgreSQL standby) loses every signal and record
//! sent to it while a read-only check says all is well.
//!
//! Two sources feed one state ([`Writability`]):
//! - every write transaction: a commit that succeeds marks the database writable; a storage
//!   fault in `BEGIN`, a statement or the commit marks it not writable, with a short reason;
//! - the write probe ([`super::Store::probe_write`]), a one-row upsert in a transaction of its
//!   own, run once at start (the start-up check: readiness stays false until a write went
//!   through) and then periodically ([`spawn_prober`]): every [`PROBE_EVERY`] while writable,
//!   every [`PROBE_RETRY`] while not, so recovery is seen within about a second even when no
//!   other write happens.
//!
//! Conflicts between transactions (a unique key already stored, a deadlock or serialization
//! failure) are not storage faults and change nothing. The reasons are our own words, never the
//! database's text, because they travel to the dataplanes' `/health` (HTTP, no key).

use std::sync::Arc;
use std::time::Duration;

use sea_orm::sqlx;
use sea_orm::{DbErr, RuntimeErr};
use tokio::sync::watch;
use tracing::{error, info};

/// How often the write probe runs while the database takes writes.
pub const PROBE_EVERY: Duration = Duration::from_secs(5);
/// How often it runs while the database does not.
pub const PROBE_RETRY: Duration = Duration::from_secs(1);

/// Why the database does not take writes; `None` while it does.
pub type WriteProblem = Option<&'static str>;

/// The shared writability state. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Writability {
    tx: Arc<watch::Sender<WriteProblem>>,
}

impl Writability {
    /// Not known to be writable until a first write (the start-up probe) went through.
    pub(super) fn new() -> Self {
        Self {
            tx: Arc::new(watch::Sender::new(Some("no write has been tried yet"))),
        }
    }

    /// The current state, and changes to it.
    pub fn subscribe(&self) -> watch::Receiver<WriteProblem> {
        self.tx.subscribe()
    }

    /// The current state.
    pub fn problem(&self) -> WriteProblem {
        *self.tx.borrow()
    }

    pub(crate) fn succeeded(&self) {
        self.set(None);
    }

    /// Notes a failed write when it is a storage fault (not a conflict between transactions).
    pub(crate) fn failed(&self, e: &DbErr) {
        if let Some(reason) = fault_of(e) {
            self.set(Some(reason));
        }
    }

    /// Notes a statement's failure, if it failed ([`Writability::failed`]), and passes its
    /// result on.
    pub(crate) fn seen<T>(&self, r: Result<T, DbErr>) -> Result<T, DbErr> {
        if let Err(e) = &r {
            self.failed(e);
        }
        r
    }

    /// A COMMIT's outcome: committed, the database takes writes again (and `committed` says
    /// the transaction's connection may be used again); failed, the failure is noted.
    pub(crate) fn commit_done<T>(
        &self,
        done: Result<T, DbErr>,
        committed: &std::sync::atomic::AtomicBool,
    ) -> Result<(), DbErr> {
        self.seen(done)?;
        committed.store(true, std::sync::atomic::Ordering::Relaxed);
        self.succeeded();
        Ok(())
    }

    pub(crate) fn failed_sqlite(&self, e: &rusqlite::Error) {
        if let Some(reason) = fault_of_rusqlite(e) {
            self.set(Some(reason));
        }
    }

    fn set(&self, problem: WriteProblem) {
        self.tx.send_if_modified(|current| {
            if *current == problem {
                return false;
            }
            match problem {
                None => info!("the database takes writes again"),
                Some(reason) => error!(
                    reason,
                    "the database does not take writes; readiness is false until it does"
                ),
            }
            *current = problem;
            true
        });
    }
}

/// The storage fault behind a failed write, in our words; `None` for a conflict between
/// transactions (which says nothing about the database's health).
pub fn fault_of(e: &DbErr) -> WriteProblem {
    let sqlx_error = match e {
        DbErr::Exec(RuntimeErr::SqlxError(e))
        | DbErr::Query(RuntimeErr::SqlxError(e))
        | DbErr::Conn(RuntimeErr::SqlxError(e)) => e.as_ref(),
        DbErr::ConnectionAcquire(_) | DbErr::Conn(_) => return Some(UNREACHABLE),
        _ => return Some(REFUSED),
    };
    match sqlx_error {
        sqlx::Error::Database(d) => {
            if d.is_unique_violation() || d.is_foreign_key_violation() || d.is_check_violation() {
                return None;
            }
            fault_of_code(&d.code().unwrap_or_default())
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => Some(UNREACHABLE),
        _ => Some(REFUSED),
    }
}

fn fault_of_rusqlite(e: &rusqlite::Error) -> WriteProblem {
    match e {
        rusqlite::Error::SqliteFailure(f, _) => {
            if f.code == rusqlite::ErrorCode::ConstraintViolation {
                return None;
            }
            fault_of_code(&f.extended_code.to_string())
        }
        _ => Some(REFUSED),
    }
}

const UNREACHABLE: &str = "the database does not answer";
const REFUSED: &str = "the database refused a write";

/// A database error code: SQLite's (extended) result code as a number, or PostgreSQL's
/// SQLSTATE.
fn fault_of_code(code: &str) -> WriteProblem {
    // A SQLSTATE has five characters (often all digits); SQLite's codes are at most four digits.
    if code.len() < 5
        && let Ok(n) = code.parse::<i32>()
    {
        // SQLite: the primary result code is the low byte of the extended one.
        return match n & 0xff {
            19 => None, // SQLITE_CONSTRAINT
            13 => Some("the database's disk is full"),
            8 => Some("the database is read-only"),
            10 => Some("the database's disk failed (I/O error)"),
            5 | 6 => Some("the database is locked by another writer"),
            11 | 26 => Some("the database file is corrupt"),
            14 => Some("the database file cannot be opened"),
            _ => Some(REFUSED),
        };
    }
    match code {
        // deadlock_detected, serialization_failure, unique/foreign key/check violations
        "40P01" | "40001" => None,
        c if c.starts_with("23") => None,
        "53100" => Some("the database's disk is full"),
        "25006" => Some("the database is read-only"),
        c if c.starts_with("53") => Some("the database is out of resources"),
        c if c.starts_with("57P") || c.starts_with("08") => Some(UNREACHABLE),
        c if c.starts_with("58") => Some("the database's disk failed (I/O error)"),
        _ => Some(REFUSED),
    }
}

/// Runs the write probe for as long as `stop` stays false: every [`PROBE_EVERY`] while the
/// database takes writes, every [`PROBE_RETRY`] while it does not.
pub fn spawn_prober(
    store: super::Store,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let wait = if store.writability().problem().is_none() {
                PROBE_EVERY
            } else {
                PROBE_RETRY
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            // The outcome lands in the writability state; the error itself is not needed.
            let _ = store.probe_write().await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_are_not_faults_and_faults_are_named() {
        assert_eq!(fault_of_code("40P01"), None);
        assert_eq!(fault_of_code("40001"), None);
        assert_eq!(fault_of_code("23505"), None);
        assert_eq!(fault_of_code("2067"), None); // SQLITE_CONSTRAINT_UNIQUE
        assert_eq!(fault_of_code("13"), Some("the database's disk is full"));
        assert_eq!(fault_of_code("8"), Some("the database is read-only"));
        assert_eq!(fault_of_code("1032"), Some("the database is read-only")); // READONLY_DBMOVED
        assert_eq!(fault_of_code("53100"), Some("the database's disk is full"));
        assert_eq!(fault_of_code("57P01"), Some(UNREACHABLE));
        assert_eq!(fault_of_code("XX000"), Some(REFUSED));
    }
}
