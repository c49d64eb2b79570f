//! Write transactions on SQLite that can lend their connection to rusqlite, and that never
//! leave a broken connection in the pool.
//!
//! Storing request records is most of what the controlplane writes, and `nm-gateway serve` does it
//! on the same CPUs that proxy the requests. Through sea-orm, a batch's rows went in as multi-row
//! `INSERT`s whose every value was built as a `sea_query::Value`, cloned by sea-orm, converted to
//! sqlx's arguments on the async runtime, and then bound and cleared one by one on sqlx's SQLite
//! thread: thousands of parameters per statement, each costing more than SQLite spent storing
//! it. A [`SqliteWrite`] runs the batch's transaction on one pooled sqlx connection instead. Its
//! other statements (sessions, analytics rollups) go through sea-orm's [`ConnectionTrait`] as
//! before, and [`SqliteWrite::with_rusqlite`] hands the same connection, inside the same
//! transaction, to rusqlite, which binds prepared multi-row statements straight from the records:
//! the request rows, and the upserts of the day totals and the budget spend, whose rows come one
//! or more per record too (`crate::sql::Upsert`, `crate::sql::SqliteStatements`).
//!
//! **Statements kept.** Preparing that 28-column `INSERT` costs SQLite far more than storing a
//! row, so it is prepared once per connection, not once per batch: a committed transaction's
//! connection is kept ([`KeptWriter`], one per store) together with the rusqlite connection
//! over its handle and rusqlite's statement cache, and the next write transaction begins on it.
//! A transaction that begins while the kept connection is in use takes one from the pool as
//! before. rusqlite's statements must be finalized before sqlx closes the handle, and never
//! while sqlx's worker thread runs a command on it (`WriteConn`).
//!
//! **Failure.** The transaction is ours, not sqlx's: `BEGIN IMMEDIATE`, `COMMIT` and `ROLLBACK`
//! are plain statements on the connection, and sqlx's transaction depth stays 0. When a
//! statement or the commit fails (a full disk, a file that became read-only, an I/O error),
//! SQLite may already have rolled the transaction back by itself, and sqlx's own transactions
//! then lost count: their `ROLLBACK` failed ("no transaction is active"), the depth stayed at 1,
//! and every later `BEGIN` on that connection failed with "attempted to call begin_with at
//! non-zero transaction depth" until a restart. Here, a transaction that did not commit is never
//! given back to the pool: its connection is closed (which rolls back whatever SQLite still
//! held), and the pool opens a fresh one for the next writer. So once the cause is gone (space
//! back, the file writable again), the next transaction succeeds by itself. A connection closed
//! this way costs one `open` of the database file (well under a millisecond); it happens only
//! after a failure or a cancelled write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};

use sea_orm::sqlx::pool::PoolConnection;
use sea_orm::sqlx::{self, Sqlite, SqlitePool};
use sea_orm::{ConnectionTrait, DatabaseBackend, DbErr, ExecResult, QueryResult, Statement};
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};

use super::ffi;
use super::sqlx_bridge::{exec_err, query, query_err};
use super::writable::Writability;
use crate::error::{Error, Result};

/// A `BEGIN IMMEDIATE` transaction on one SQLite connection of the pool. Dropped without a
/// successful [`SqliteWrite::commit`], its connection is closed, which rolls it back; committed,
/// the connection waits in [`KeptWriter`] for the next transaction.
pub struct SqliteWrite {
    /// `None` only once the transaction has ended (its connection handed on in `drop`).
    conn: Mutex<Option<WriteConn>>,
    /// Set once `COMMIT` succeeded: only then is the connection used again.
    committed: AtomicBool,
    writability: Writability,
    kept: Arc<KeptWriter>,
}

impl std::fmt::Debug for SqliteWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteWrite").finish_non_exhaustive()
    }
}

impl Drop for SqliteWrite {
    fn drop(&mut self) {
        let Some(conn) = self.conn.get_mut().take() else {
            return;
        };
        if self.committed.load(Ordering::Relaxed) {
            self.kept.put(conn);
        } else {
            // Not committed (an error, or the caller went away): closing the connection rolls
            // back whatever SQLite still holds, and keeps a connection in an unknown state out
            // of the pool.
            conn.discard();
        }
    }
}

impl SqliteWrite {
    /// Takes the write lock up front, like [`super::Store::begin_write`], on the kept write
    /// connection when it is free, else on one from the pool.
    pub(super) async fn begin(
        pool: &SqlitePool,
        kept: &Arc<KeptWriter>,
        writability: Writability,
    ) -> Result<Self, DbErr> {
        let conn = match kept.take() {
            Some(conn) => conn,
            None => WriteConn {
                lite: None,
                sqlx: pool.acquire().await.map_err(exec_err)?,
                busy: false,
            },
        };
        // Until `BEGIN` has succeeded, the connection is closed if this future is dropped (the
        // caller's deadline passed while `BEGIN IMMEDIATE` waited for the write lock): sqlx's
        // worker would still run it, and a connection holding the write lock must not go back
        // to the pool.
        let mut pending = DiscardUnlessKept(Some(conn));
        let Some(conn) = pending.0.as_mut() else {
            return Err(gone());
        };
        conn.busy = true;
        if let Err(e) = sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut *conn.sqlx)
            .await
        {
            conn.busy = false;
            let e = exec_err(e);
            writability.failed(&e);
            return Err(e);
        }
        conn.busy = false;
        let Some(conn) = pending.keep() else {
            return Err(gone());
        };
        Ok(Self {
            conn: Mutex::new(Some(conn)),
            committed: AtomicBool::new(false),
            writability,
            kept: Arc::clone(kept),
        })
    }

    pub async fn commit(self) -> Result<(), DbErr> {
        let mut conn = self.held().await?;
        conn.busy = true;
        let done = sqlx::raw_sql("COMMIT").execute(&mut *conn.sqlx).await;
        conn.busy = false;
        drop(conn);
        // Committed, `self` drops and its connection goes back to the kept writer. Failed,
        // SQLite may have rolled back by itself or may still hold the transaction open: either
        // way the connection is closed when `self` drops (not committed).
        self.writability
            .commit_done(done.map_err(exec_err), &self.committed)
    }

    /// Runs `f` with rusqlite on this transaction's connection, so what it writes commits or
    /// rolls back with the rest. sqlx's worker thread makes no call on the connection until `f`
    /// returns. SQLite calls block: on a multi-threaded runtime `f` runs in
    /// [`tokio::task::block_in_place`], so the runtime's other tasks move to another thread.
    ///
    /// The rusqlite connection stays with the sqlx one for as long as it lives, so statements
    /// `f` prepares with [`rusqlite::Connection::prepare_cached`] are prepared once per
    /// connection, not once per transaction.
    pub async fn with_rusqlite<R>(
        &self,
        f: impl FnOnce(&rusqlite::Connection) -> rusqlite::Result<R>,
    ) -> Result<R> {
        let mut guard = self.held().await?;
        let conn = &mut *guard;
        let mut locked = conn.sqlx.lock_handle().await.map_err(exec_err)?;
        // `locked` keeps sqlx's worker off the connection until it is dropped, after `run`.
        let lite = match &mut conn.lite {
            Some(lite) => lite,
            empty => empty.insert(ffi::borrow_sqlite(locked.as_raw_handle())?),
        };
        let run = || f(lite);
        let out = match Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(run),
            _ => run(),
        };
        drop(locked);
        out.map_err(|e| {
            self.writability.failed_sqlite(&e);
            Error::Sqlite(e)
        })
    }

    /// The transaction's connection, while it has one.
    async fn held(&self) -> Result<MappedMutexGuard<'_, WriteConn>, DbErr> {
        MutexGuard::try_map(self.conn.lock().await, Option::as_mut).map_err(|_| gone())
    }

    /// Reports a failed statement to the writability state and passes it on.
    fn seen<T>(&self, r: Result<T, DbErr>) -> Result<T, DbErr> {
        self.writability.seen(r)
    }
}

/// The pooled connection a write transaction runs on, and rusqlite's view of it.
///
/// rusqlite's connection borrows sqlx's handle and holds the statements it prepared; sqlx
/// closes the handle with `sqlite3_close`, which fails (and sqlx panics) while any statement is
/// left. So `lite` is declared first and dropped first, and it is only ever touched while sqlx's
/// worker makes no call on the handle: under sqlx's handle lock, or while no command sent to the
/// worker may still be running (`busy` false).
struct WriteConn {
    /// rusqlite on this connection's handle, made by the first [`SqliteWrite::with_rusqlite`].
    lite: Option<rusqlite::Connection>,
    sqlx: PoolConnection<Sqlite>,
    /// A command was sent to sqlx's worker and its answer not yet received: the worker may
    /// still be running it (a future awaiting it was dropped).
    busy: bool,
}

impl Drop for WriteConn {
    fn drop(&mut self) {
        let Some(lite) = self.lite.take() else { return };
        if self.busy {
            // Finalizing now could race the worker on the handle. Only reached when the
            // runtime could not run `finalize_then_close` (it is shutting down); the handle
            // then stays open until the process exits.
            std::mem::forget(lite);
        }
        // Otherwise `lite` drops here, finalizing its statements before sqlx may close the handle.
    }
}

impl WriteConn {
    /// Closes the connection instead of giving it back (it may hold a transaction in an unknown
    /// state), once rusqlite's statements are finalized.
    fn discard(mut self) {
        self.sqlx.close_on_drop();
        if self.busy
            && self.lite.is_some()
            && let Ok(rt) = Handle::try_current()
        {
            rt.spawn(self.finalize_then_close());
        }
        // Otherwise `self` drops here: its statements first (the worker is idle), then the
        // connection, closed.
    }

    /// Waits for sqlx's worker to finish the command it may be running, finalizes rusqlite's
    /// statements under the handle lock, and closes the connection.
    async fn finalize_then_close(mut self) {
        if let Ok(locked) = self.sqlx.lock_handle().await {
            self.lite = None;
            drop(locked);
            self.busy = false;
        }
    }
}

/// The write connection kept between transactions, with the statements rusqlite prepared on it.
/// SQLite has one writer at a time, so one kept connection serves almost every transaction; a
/// transaction that begins while it is taken uses another connection from the pool (and its
/// rusqlite statements last only as long as that transaction).
#[derive(Default)]
pub(super) struct KeptWriter {
    conn: std::sync::Mutex<Option<WriteConn>>,
    /// Set by [`KeptWriter::close`]: nothing is kept any more, so the pool can close.
    closed: AtomicBool,
}

impl std::fmt::Debug for KeptWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeptWriter").finish_non_exhaustive()
    }
}

impl KeptWriter {
    fn take(&self) -> Option<WriteConn> {
        self.conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Keeps a connection whose transaction committed. When one is kept already, the one with
    /// rusqlite statements stays (a write probe that ran beside an ingest must not push out the
    /// ingest's prepared statements) and the other goes back to the pool; when the store is
    /// closing, `conn` goes back too.
    fn put(&self, conn: WriteConn) {
        if conn.busy || self.closed.load(Ordering::Relaxed) {
            return conn.discard();
        }
        let mut slot = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        let keep_new = slot
            .as_ref()
            .is_none_or(|kept| kept.lite.is_none() && conn.lite.is_some());
        let spare = if keep_new {
            slot.replace(conn)
        } else {
            Some(conn)
        };
        drop(slot);
        // The spare drops here: its statements first (its worker is idle), then back to the pool.
        drop(spare);
    }

    /// Gives the kept connection back to the pool and keeps none from now on: the pool's
    /// `close` waits for every connection taken from it.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        drop(self.take());
    }
}

/// A connection that is discarded (closed, not given back), unless [`DiscardUnlessKept::keep`]
/// takes it.
struct DiscardUnlessKept(Option<WriteConn>);

impl DiscardUnlessKept {
    fn keep(&mut self) -> Option<WriteConn> {
        self.0.take()
    }
}

impl Drop for DiscardUnlessKept {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            conn.discard();
        }
    }
}

fn gone() -> DbErr {
    DbErr::Custom("the write transaction has ended".to_owned())
}

// Each statement marks the connection busy while sqlx's worker may be running it (see
// `WriteConn`): a future dropped at its `await` leaves the mark.
#[async_trait::async_trait]
impl ConnectionTrait for SqliteWrite {
    fn get_database_backend(&self) -> DatabaseBackend {
        DatabaseBackend::Sqlite
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        let mut conn = self.held().await?;
        conn.busy = true;
        let done = query(stmt).execute(&mut *conn.sqlx).await.map_err(exec_err);
        conn.busy = false;
        self.seen(done).map(Into::into)
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        let mut conn = self.held().await?;
        conn.busy = true;
        let done = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut *conn.sqlx)
            .await
            .map_err(exec_err);
        conn.busy = false;
        self.seen(done).map(Into::into)
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        let mut conn = self.held().await?;
        conn.busy = true;
        let row = query(stmt)
            .fetch_optional(&mut *conn.sqlx)
            .await
            .map_err(query_err);
        conn.busy = false;
        self.seen(row).map(|r| r.map(QueryResult::from))
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        let mut conn = self.held().await?;
        conn.busy = true;
        let rows = query(stmt)
            .fetch_all(&mut *conn.sqlx)
            .await
            .map_err(query_err);
        conn.busy = false;
        self.seen(rows)
            .map(|rows| rows.into_iter().map(QueryResult::from).collect())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sea_orm::{ConnectionTrait, Statement};

    use crate::store::{Store, WriteTxn};

    async fn store(dir: &tempfile::TempDir) -> Store {
        let url = format!("sqlite://{}/t.db?mode=rwc", dir.path().display());
        Store::connect(&url).await.unwrap()
    }

    fn sqlite(txn: &WriteTxn) -> &super::SqliteWrite {
        match txn {
            WriteTxn::Sqlite(t) => t,
            WriteTxn::Postgres(_) => panic!("not SQLite"),
        }
    }

    /// Whether the transaction runs on the connection that created the temporary table `mark`
    /// (temporary tables belong to their connection).
    async fn has_mark(txn: &WriteTxn) -> bool {
        let sql = "SELECT COUNT(*) AS n FROM sqlite_temp_master WHERE name = 'mark'";
        let row = txn
            .query_one_raw(Statement::from_string(txn.get_database_backend(), sql))
            .await
            .unwrap()
            .unwrap();
        row.try_get::<i64>("", "n").unwrap() == 1
    }

    /// A committed transaction's connection, with the statements rusqlite prepared on it, serves
    /// the next write transaction; one that did not commit is closed and never seen again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn committed_connections_are_kept_with_their_statements() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let insert = "INSERT INTO write_probe (id, written_at_ms) VALUES (?1, 0) \
            ON CONFLICT (id) DO NOTHING";

        let txn = store.begin_write().await.unwrap();
        txn.execute_unprepared("CREATE TEMP TABLE mark (x)")
            .await
            .unwrap();
        let rows = sqlite(&txn)
            .with_rusqlite(|c| c.prepare_cached(insert)?.execute([1]))
            .await
            .unwrap();
        assert_eq!(rows, 1);
        txn.commit().await.unwrap();

        let txn = store.begin_write().await.unwrap();
        assert!(has_mark(&txn).await, "the committed connection is kept");
        // A second writer meanwhile takes another connection from the pool.
        let other = tokio::spawn({
            let store = store.clone();
            async move {
                let txn = store.begin_write().await.unwrap();
                let kept = has_mark(&txn).await;
                txn.commit().await.unwrap();
                kept
            }
        });
        let rows = sqlite(&txn)
            .with_rusqlite(|c| c.prepare_cached(insert)?.execute([2]))
            .await
            .unwrap();
        assert_eq!(rows, 1);
        // Not committed: the connection is closed, its statements finalized first.
        drop(txn);
        assert!(!other.await.unwrap(), "the kept connection is not shared");

        let txn = store.begin_write().await.unwrap();
        assert!(
            !has_mark(&txn).await,
            "a connection that did not commit is gone"
        );
        let rows = sqlite(&txn)
            .with_rusqlite(|c| c.prepare_cached(insert)?.execute([2]))
            .await
            .unwrap();
        assert_eq!(rows, 1, "the rolled-back row was not stored");
        txn.commit().await.unwrap();
        // `close` returns only once the kept connection is back in the pool.
        store.close().await.unwrap();
    }

    /// A transaction dropped while sqlx's worker still runs one of its statements, on a
    /// connection with rusqlite statements: they are finalized once the worker is done, the
    /// connection closed, and the next transaction works.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transaction_dropped_mid_statement_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let insert = "INSERT INTO write_probe (id, written_at_ms) VALUES (?1, 0)";
        let txn = store.begin_write().await.unwrap();
        sqlite(&txn)
            .with_rusqlite(|c| c.prepare_cached(insert)?.execute([1]))
            .await
            .unwrap();
        let slow = Statement::from_string(
            txn.get_database_backend(),
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000000) \
             SELECT COUNT(*) AS c FROM n",
        );
        // Polled once (the statement is sent to sqlx's worker), then dropped.
        let _ = tokio::time::timeout(Duration::ZERO, txn.query_one_raw(slow)).await;
        drop(txn);

        let txn = store.begin_write().await.unwrap();
        let rows = sqlite(&txn)
            .with_rusqlite(|c| c.prepare_cached(insert)?.execute([1]))
            .await
            .unwrap();
        assert_eq!(rows, 1, "the dropped transaction's row was rolled back");
        txn.commit().await.unwrap();
        store.close().await.unwrap();
    }
}
