//! Write transactions on PostgreSQL on one pooled sqlx connection of our own, so an ingest can
//! bind its request rows with sqlx straight from the records (sea-orm's transaction does not
//! lend its connection), and so a transaction that did not commit never goes back to the pool.
//!
//! Every other statement of the transaction goes through sea-orm's [`ConnectionTrait`], as on
//! sea-orm's own transaction. `BEGIN` and `COMMIT` are plain statements on the connection;
//! dropped without a successful [`PgWrite::commit`], the connection is closed, and the server
//! rolls back what it held.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sea_orm::sqlx::pool::PoolConnection;
use sea_orm::sqlx::{self, PgPool, Postgres};
use sea_orm::{
    ConnectionTrait, DatabaseBackend, DbErr, ExecResult, QueryResult, RuntimeErr, Statement,
};
use tokio::sync::{Mutex, MutexGuard};

use super::sqlx_bridge::{exec_err, query, query_err};
use super::writable::Writability;

/// A transaction on one PostgreSQL connection of the pool. Dropped without a successful
/// [`PgWrite::commit`], its connection is closed, which rolls it back.
pub struct PgWrite {
    conn: Mutex<PoolConnection<Postgres>>,
    /// Set once `COMMIT` succeeded: only then does the connection go back to the pool.
    committed: AtomicBool,
    writability: Writability,
}

impl std::fmt::Debug for PgWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgWrite").finish_non_exhaustive()
    }
}

impl Drop for PgWrite {
    fn drop(&mut self) {
        if !self.committed.load(Ordering::Relaxed) {
            self.conn.get_mut().close_on_drop();
        }
    }
}

impl PgWrite {
    pub(super) async fn begin(pool: &PgPool, writability: Writability) -> Result<Self, DbErr> {
        let mut conn = match pool.acquire().await {
            Ok(conn) => conn,
            Err(e) => {
                // No connection: the database does not answer (as sea-orm's `begin` reports it).
                let e = DbErr::Conn(RuntimeErr::SqlxError(Arc::new(e)));
                writability.failed(&e);
                return Err(e);
            }
        };
        if let Err(e) = sqlx::raw_sql("BEGIN").execute(&mut *conn).await {
            // Not known to be usable: closed, not given back.
            conn.close_on_drop();
            let e = exec_err(e);
            writability.failed(&e);
            return Err(e);
        }
        Ok(Self {
            conn: Mutex::new(conn),
            committed: AtomicBool::new(false),
            writability,
        })
    }

    pub async fn commit(self) -> Result<(), DbErr> {
        let mut conn = self.conn.lock().await;
        let done = sqlx::raw_sql("COMMIT").execute(&mut **conn).await;
        self.writability
            .commit_done(done.map_err(exec_err), &self.committed)
    }

    /// The transaction's connection, for statements sqlx binds itself. Their failures are
    /// reported with [`PgWrite::seen`].
    pub(crate) async fn connection(&self) -> MutexGuard<'_, PoolConnection<Postgres>> {
        self.conn.lock().await
    }

    /// Reports a failed statement to the writability state and passes it on.
    pub(crate) fn seen<T>(&self, r: Result<T, DbErr>) -> Result<T, DbErr> {
        self.writability.seen(r)
    }
}

#[async_trait::async_trait]
impl ConnectionTrait for PgWrite {
    fn get_database_backend(&self) -> DatabaseBackend {
        DatabaseBackend::Postgres
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
