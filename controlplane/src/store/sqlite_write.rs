//! Write transactions on SQLite that can lend their connection to rusqlite.
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

use std::sync::Arc;

use sea_orm::sqlx::{self, Sqlite, SqlitePool, Transaction};
use sea_orm::{
    ConnectionTrait, DatabaseBackend, DbErr, ExecResult, QueryResult, RuntimeErr, Statement, Values,
};
use sea_query_sqlx::SqlxValues;
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::Mutex;

use crate::error::{Error, Result};

/// A `BEGIN IMMEDIATE` transaction on one SQLite connection of the pool. Dropped without
/// [`SqliteWrite::commit`], it rolls back (sqlx's [`Transaction`] does that).
pub struct SqliteWrite {
    txn: Mutex<Transaction<'static, Sqlite>>,
}

impl std::fmt::Debug for SqliteWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteWrite").finish_non_exhaustive()
    }
}

impl SqliteWrite {
    /// Takes the write lock up front, like [`super::Store::begin_write`].
    pub(super) async fn begin(pool: &SqlitePool) -> Result<Self, DbErr> {
        let txn = pool.begin_with("BEGIN IMMEDIATE").await.map_err(exec_err)?;
        Ok(Self {
            txn: Mutex::new(txn),
        })
    }

    pub async fn commit(self) -> Result<(), DbErr> {
        self.txn.into_inner().commit().await.map_err(exec_err)
    }

    /// Runs `f` with rusqlite on this transaction's connection, so what it writes commits or
    /// rolls back with the rest. sqlx's worker thread makes no call on the connection until `f`
    /// returns. SQLite calls block: on a multi-threaded runtime `f` runs in
    /// [`tokio::task::block_in_place`], so the runtime's other tasks move to another thread.
    pub async fn with_rusqlite<R>(
        &self,
        f: impl FnOnce(&rusqlite::Connection) -> rusqlite::Result<R>,
    ) -> Result<R> {
        let mut txn = self.txn.lock().await;
        let mut locked = txn.lock_handle().await.map_err(exec_err)?;
        let raw = locked.as_raw_handle().as_ptr();
        // `locked` keeps sqlx's worker off the connection until it is dropped, after `run`.
        let run = || f(&borrow(raw)?);
        let out = match Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(run),
            _ => run(),
        };
        drop(locked);
        out.map_err(Error::Sqlite)
    }
}

/// A rusqlite connection on a handle it does not own: dropping it finalizes the statements
/// prepared on it, never the connection.
#[allow(unsafe_code, reason = "rusqlite takes a foreign connection handle")]
fn borrow(raw: *mut rusqlite::ffi::sqlite3) -> rusqlite::Result<rusqlite::Connection> {
    // SAFETY: `raw` is an open connection (sqlx's, from `LockedSqliteHandle`) on which no other
    // thread makes calls while the caller holds the lock; the caller drops the result first.
    unsafe { rusqlite::Connection::from_handle(raw) }
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
        let mut txn = self.txn.lock().await;
        let done = query(stmt).execute(&mut **txn).await.map_err(exec_err)?;
        Ok(done.into())
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        let mut txn = self.txn.lock().await;
        let done = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut **txn)
            .await
            .map_err(exec_err)?;
        Ok(done.into())
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        let mut txn = self.txn.lock().await;
        let row = query(stmt)
            .fetch_optional(&mut **txn)
            .await
            .map_err(query_err)?;
        Ok(row.map(QueryResult::from))
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        let mut txn = self.txn.lock().await;
        let rows = query(stmt).fetch_all(&mut **txn).await.map_err(query_err)?;
        Ok(rows.into_iter().map(QueryResult::from).collect())
    }
}
