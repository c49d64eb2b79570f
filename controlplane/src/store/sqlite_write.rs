//! Write transactions on SQLite that can lend their connection to rusqlite, and that never
//! leave a broken connection in the pool.
//!
//! Storing request records is most of what the controlplane writes, and `nm-gateway serve` does it
//! on the same CPUs that proxy the requests. Through sea-orm, a batch's rows went in as multi-row
//! `INSERT`s whose every value was built as a `sea_query::Value`, cloned by sea-orm, converted to
//! sqlx's arguments on the async runtime, and then bound and cleared one by one on sqlx's SQLite
//! thread: thousands of parameters per statement, each costing more than SQLite spent storing
//! it. A [`SqliteWrite`] runs the batch's transaction on one pooled sqlx connection instead. Its
//! other statements (sessions, rollups, spend) go through sea-orm's [`ConnectionTrait`] as before,
//! and [`SqliteWrite::with_rusqlite`] hands the same connection, inside the same transaction, to
//! rusqlite, which binds a prepared single-row statement straight from the records.
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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sea_orm::sqlx::pool::PoolConnection;
use sea_orm::sqlx::{self, Sqlite, SqlitePool};
use sea_orm::{
    ConnectionTrait, DatabaseBackend, DbErr, ExecResult, QueryResult, RuntimeErr, Statement, Values,
};
use sea_query_sqlx::SqlxValues;
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::Mutex;

use super::ffi;
use super::writable::Writability;
use crate::error::{Error, Result};

/// A `BEGIN IMMEDIATE` transaction on one SQLite connection of the pool. Dropped without a
/// successful [`SqliteWrite::commit`], its connection is closed, which rolls it back.
pub struct SqliteWrite {
    conn: Mutex<PoolConnection<Sqlite>>,
    /// Set once `COMMIT` succeeded: only then does the connection go back to the pool.
    committed: AtomicBool,
    writability: Writability,
}

impl std::fmt::Debug for SqliteWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteWrite").finish_non_exhaustive()
    }
}

impl Drop for SqliteWrite {
    fn drop(&mut self) {
        if !self.committed.load(Ordering::Relaxed) {
            // Not committed (an error, or the caller went away): closing the connection rolls
            // back whatever SQLite still holds, and keeps a connection in an unknown state out
            // of the pool.
            self.conn.get_mut().close_on_drop();
        }
    }
}

impl SqliteWrite {
    /// Takes the write lock up front, like [`super::Store::begin_write`].
    pub(super) async fn begin(pool: &SqlitePool, writability: Writability) -> Result<Self, DbErr> {
        let conn = pool.acquire().await.map_err(exec_err)?;
        // Until `BEGIN` has succeeded, the connection is closed if this future is dropped (the
        // caller's deadline passed while `BEGIN IMMEDIATE` waited for the write lock): sqlx's
        // worker would still run it, and a connection holding the write lock must not go back
        // to the pool.
        let mut pending = CloseUnlessKept(Some(conn));
        let Some(conn) = pending.0.as_mut() else {
            return Err(DbErr::Custom("no connection".to_owned()));
        };
        if let Err(e) = sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut **conn).await {
            let e = exec_err(e);
            writability.failed(&e);
            return Err(e);
        }
        let Some(conn) = pending.keep() else {
            return Err(DbErr::Custom("no connection".to_owned()));
        };
        Ok(Self {
            conn: Mutex::new(conn),
            committed: AtomicBool::new(false),
            writability,
        })
    }

    pub async fn commit(self) -> Result<(), DbErr> {
        let mut conn = self.conn.lock().await;
        match sqlx::raw_sql("COMMIT").execute(&mut **conn).await {
            Ok(_) => {
                self.committed.store(true, Ordering::Relaxed);
                self.writability.succeeded();
                Ok(())
            }
            Err(e) => {
                // SQLite may have rolled back by itself, or may still hold the transaction open;
                // either way the connection is closed when `self` drops (not committed).
                let e = exec_err(e);
                self.writability.failed(&e);
                Err(e)
            }
        }
    }

    /// Runs `f` with rusqlite on this transaction's connection, so what it writes commits or
    /// rolls back with the rest. sqlx's worker thread makes no call on the connection until `f`
    /// returns. SQLite calls block: on a multi-threaded runtime `f` runs in
    /// [`tokio::task::block_in_place`], so the runtime's other tasks move to another thread.
    pub async fn with_rusqlite<R>(
        &self,
        f: impl FnOnce(&rusqlite::Connection) -> rusqlite::Result<R>,
    ) -> Result<R> {
        let mut conn = self.conn.lock().await;
        let mut locked = conn.lock_handle().await.map_err(exec_err)?;
        let raw = locked.as_raw_handle();
        // `locked` keeps sqlx's worker off the connection until it is dropped, after `run`.
        let run = || f(&ffi::borrow_sqlite(raw)?);
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

    /// Reports a failed statement to the writability state and passes it on.
    fn seen<T>(&self, r: Result<T, DbErr>) -> Result<T, DbErr> {
        if let Err(e) = &r {
            self.writability.failed(e);
        }
        r
    }
}

/// A pooled connection that is closed, not given back, unless [`CloseUnlessKept::keep`] takes it.
struct CloseUnlessKept(Option<PoolConnection<Sqlite>>);

impl CloseUnlessKept {
    fn keep(&mut self) -> Option<PoolConnection<Sqlite>> {
        self.0.take()
    }
}

impl Drop for CloseUnlessKept {
    fn drop(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            conn.close_on_drop();
        }
    }
}

fn exec_err(e: sqlx::Error) -> DbErr {
    DbErr::Exec(RuntimeErr::SqlxError(Arc::new(e)))
}

fn query_err(e: sqlx::Error) -> DbErr {
    DbErr::Query(RuntimeErr::SqlxError(Arc::new(e)))
}

/// The statement as an sqlx query, its values moved (sea-orm clones them).
fn query(stmt: Statement) -> sqlx::query::Query<'static, Sqlite, SqlxValues> {
    let values = SqlxValues(stmt.values.unwrap_or(Values(Vec::new())));
    sqlx::query_with(sqlx::AssertSqlSafe(stmt.sql), values)
}

#[async_trait::async_trait]
impl ConnectionTrait for SqliteWrite {
    fn get_database_backend(&self) -> DatabaseBackend {
        DatabaseBackend::Sqlite
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        let mut conn = self.conn.lock().await;
        let done = query(stmt).execute(&mut **conn).await.map_err(exec_err);
        self.seen(done).map(Into::into)
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        let mut conn = self.conn.lock().await;
        let done = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut **conn)
            .await
            .map_err(exec_err);
        self.seen(done).map(Into::into)
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        let mut conn = self.conn.lock().await;
        let row = query(stmt)
            .fetch_optional(&mut **conn)
            .await
            .map_err(query_err);
        self.seen(row).map(|r| r.map(QueryResult::from))
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        let mut conn = self.conn.lock().await;
        let rows = query(stmt).fetch_all(&mut **conn).await.map_err(query_err);
        self.seen(rows)
            .map(|rows| rows.into_iter().map(QueryResult::from).collect())
    }
}
