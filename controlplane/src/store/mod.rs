//! Database connection and schema. [`Store::connect`] opens SQLite or PostgreSQL from a URL and
//! runs the migrations before anything else touches the database.

#[forbid(unsafe_code)]
pub mod entity;
mod ffi;
#[forbid(unsafe_code)]
mod migrate;
#[forbid(unsafe_code)]
mod migration;
#[forbid(unsafe_code)]
mod nodelay;
#[forbid(unsafe_code)]
pub(crate) mod pg_write;
#[forbid(unsafe_code)]
mod sqlite_write;
#[forbid(unsafe_code)]
pub(crate) mod sqlx_bridge;
pub(crate) mod upsert;
#[forbid(unsafe_code)]
pub mod writable;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sea_orm::sqlx::sqlite::{SqliteAutoVacuum, SqliteJournalMode, SqliteSynchronous};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseBackend, DatabaseConnection, DbErr,
    ExecResult, QueryResult, Statement,
};
use tracing::info;

use crate::error::{Error, Result};

pub use migrate::MigratorTrait;
pub use migration::Migrator;
pub use pg_write::PgWrite;
use sqlite_write::KeptWriter;
pub use sqlite_write::SqliteWrite;
pub use writable::{Writability, WriteProblem};

/// A handle on the controlplane database. Cheap to clone (a connection pool).
#[derive(Clone, Debug)]
pub struct Store {
    db: DatabaseConnection,
    writability: Writability,
    /// SQLite: the write connection kept between write transactions, with its prepared
    /// statements (see [`SqliteWrite`]).
    kept_writer: Arc<KeptWriter>,
}

/// Whether a SQLite URL names a file that does not exist yet, or is empty (or memory).
fn sqlite_file_is_new(url: &str) -> bool {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    let path = rest.split('?').next().unwrap_or_default();
    if path.is_empty() || path == ":memory:" {
        return true;
    }
    std::fs::metadata(path).map_or(true, |m| m.len() == 0)
}

impl Store {
    /// Connects to `url` (`sqlite://PATH?mode=rwc` or `postgres://...`) and brings the schema up
    /// to date. For SQLite the parent directory is created, and the database runs in WAL mode
    /// with `synchronous=FULL`: a committed transaction survives a crash of the process or of
    /// the machine.
    #[tracing::instrument(skip_all, fields(db.system = tracing::field::Empty))]
    pub fn connect<'a>(url: &'a str) -> crate::BoxFuture<'a, Result<Self>> {
        Box::pin(async move {
            let backend = if url.starts_with("sqlite:") {
                prepare_sqlite_dir(url)?;
                "sqlite"
            } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
                "postgresql"
            } else {
                return Err(Error::Config(format!(
                    "database URL must start with sqlite:// or postgres://, got {:?}",
                    redact_url(url)
                )));
            };
            tracing::Span::current().record("db.system", backend);

            let mut opts = ConnectOptions::new(url.to_owned());
            opts.sqlx_logging(false)
                .connect_timeout(Duration::from_secs(10))
                .acquire_timeout(Duration::from_secs(10));
            if backend == "sqlite" {
                // SQLite serialises writers; a few connections serve concurrent readers.
                opts.max_connections(8).min_connections(1);
                // Incremental: pages freed by retention go back to the file system
                // (`crate::retention`). Only for a new file: on an existing one the pragma is a write
                // (a read-only database could not even be opened), and takes effect only after a
                // VACUUM, which retention runs.
                let fresh = sqlite_file_is_new(url);
                opts.map_sqlx_sqlite_opts(move |o| {
                    let o = if fresh {
                        o.auto_vacuum(SqliteAutoVacuum::Incremental)
                    } else {
                        o
                    };
                    o.journal_mode(SqliteJournalMode::Wal)
                        .synchronous(SqliteSynchronous::Full)
                        .busy_timeout(Duration::from_secs(10))
                        .foreign_keys(true)
                });
                opts.map_sqlx_sqlite_pool_opts(|pool| pool.after_release(release_if_idle));
            } else {
                opts.max_connections(16).min_connections(1);
                // One function: sea-orm keeps only the last one given (a second call once replaced
                // the `TCP_NODELAY` hook, and every statement waited for a delayed acknowledgement).
                let port = postgres_tcp_port(url);
                opts.map_sqlx_postgres_pool_opts(move |pool| {
                    let pool = pool.after_release(release_if_idle);
                    match port {
                        // See `nodelay`: sqlx 0.9.0 leaves Nagle's algorithm on.
                        Some(port) => pool.after_connect(move |_conn, _meta| {
                            Box::pin(async move {
                                nodelay::set_on_sockets_to(port);
                                Ok(())
                            })
                        }),
                        None => pool,
                    }
                });
            }
            let db = Database::connect(opts).await?;
            Migrator::up(&db, None).await?;
            info!(db.system = backend, url = %redact_url(url), "database ready");
            Ok(Self {
                db,
                writability: Writability::new(),
                kept_writer: Arc::default(),
            })
        })
    }

    /// Whether the database takes writes (see [`writable`]).
    pub fn writability(&self) -> &Writability {
        &self.writability
    }

    /// The write probe: a one-row upsert in a write transaction of its own. Its outcome (like
    /// every write transaction's) updates [`Store::writability`].
    pub fn probe_write(&self) -> crate::BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let txn = self.begin_write().await?;
            let mut sql = crate::sql::Sql::new(
                self.backend(),
                "INSERT INTO write_probe (id, written_at_ms) VALUES (1, ",
            );
            sql.bind(crate::now_ms())
                .push(") ON CONFLICT (id) DO UPDATE SET written_at_ms = excluded.written_at_ms");
            txn.execute_raw(sql.build()).await?;
            txn.commit().await
        })
    }

    pub fn conn(&self) -> &DatabaseConnection {
        &self.db
    }

    pub fn backend(&self) -> DatabaseBackend {
        self.db.get_database_backend()
    }

    /// `sqlite` or `postgresql`.
    pub fn system(&self) -> &'static str {
        match self.backend() {
            DatabaseBackend::Postgres => "postgresql",
            DatabaseBackend::Sqlite => "sqlite",
            _ => "other",
        }
    }

    /// Starts a transaction that will write. On SQLite it is a [`SqliteWrite`] (whose bulk
    /// inserts can bypass sea-orm) begun with `BEGIN IMMEDIATE`: it takes the write lock up front
    /// (waiting up to the busy timeout), so a transaction that reads before it writes cannot fail
    /// with "database is locked" when another writer committed in between (SQLite refuses to
    /// upgrade a stale read snapshot and does not wait in that case). On PostgreSQL it is a
    /// [`PgWrite`], whose request rows sqlx binds straight from the records.
    pub async fn begin_write(&self) -> Result<WriteTxn> {
        if self.backend() == DatabaseBackend::Sqlite {
            let pool = self.db.get_sqlite_connection_pool();
            let txn = SqliteWrite::begin(pool, &self.kept_writer, self.writability.clone()).await?;
            return Ok(WriteTxn::Sqlite(txn));
        }
        let pool = self.db.get_postgres_connection_pool();
        let txn = PgWrite::begin(pool, self.writability.clone()).await?;
        Ok(WriteTxn::Postgres(txn))
    }

    /// SQLite: switches the file to incremental vacuum with one `VACUUM`, both on one connection
    /// (the pragma is a connection's until the `VACUUM` writes it into the file).
    pub fn vacuum_to_incremental(&self) -> crate::BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let pool = self.db.get_sqlite_connection_pool();
            let mut conn = pool.acquire().await.map_err(sqlx_bridge::exec_err)?;
            for sql in ["PRAGMA auto_vacuum = INCREMENTAL", "VACUUM"] {
                sea_orm::sqlx::query(sql)
                    .execute(&mut *conn)
                    .await
                    .map_err(sqlx_bridge::exec_err)?;
            }
            Ok(())
        })
    }

    /// True when the database answers a trivial query.
    pub fn ping(&self) -> crate::BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            self.db.ping().await?;
            Ok(())
        })
    }

    /// True when every migration this binary knows has been applied.
    pub fn migrations_current(&self) -> crate::BoxFuture<'_, Result<bool>> {
        Box::pin(async move {
            let pending = Migrator::get_pending_migrations(&self.db).await?;
            Ok(pending.is_empty())
        })
    }

    pub fn close(self) -> crate::BoxFuture<'static, Result<()>> {
        Box::pin(async move {
            // The pool's `close` waits for every connection taken from it.
            self.kept_writer.close();
            self.db.close().await?;
            Ok(())
        })
    }
}

/// How many times in all a transaction that lost a deadlock or a serialization conflict is run.
pub const CONFLICT_ATTEMPTS: u32 = 4;

/// Whether `e` is a conflict between transactions that running the transaction again resolves:
/// PostgreSQL's `deadlock_detected` (40P01) or `serialization_failure` (40001).
pub fn is_conflict(e: &Error) -> bool {
    let Error::Database(db) = e else {
        return false;
    };
    let (DbErr::Exec(sea_orm::RuntimeErr::SqlxError(sqlx))
    | DbErr::Query(sea_orm::RuntimeErr::SqlxError(sqlx))) = db
    else {
        return false;
    };
    sqlx.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code == "40P01" || code == "40001")
}

/// The pause before the `attempt`-th rerun of a conflicted transaction: 5, 10, 20 ms, with up
/// to as much again at random, so the transactions that collided do not collide again.
pub fn conflict_backoff(attempt: u32) -> Duration {
    let base = 5u64 << attempt.saturating_sub(1).min(4);
    Duration::from_millis(base + rand::random_range(0..=base))
}

/// Runs `op` (one transaction) again when it lost a deadlock or a serialization conflict, up to
/// [`CONFLICT_ATTEMPTS`] times in all.
pub async fn retry_conflicts<T, F, Fut>(mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut attempt = 1;
    loop {
        match op().await {
            Err(e) if is_conflict(&e) && attempt < CONFLICT_ATTEMPTS => {
                tracing::debug!(error = %e, attempt, "transaction conflicted; running it again");
                tokio::time::sleep(conflict_backoff(attempt)).await;
                attempt += 1;
            }
            other => return other,
        }
    }
}

/// Gives a pooled connection back only when no transaction is open on it. A transaction whose
/// commit failed can leave sqlx counting one open (its `ROLLBACK` then finds none, or the
/// connection broke): such a connection is closed instead, and the pool opens a fresh one. One
/// atomic read per release.
fn release_if_idle<C: sea_orm::sqlx::Connection>(
    conn: &mut C,
    _meta: sea_orm::sqlx::pool::PoolConnectionMetadata,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<bool, sea_orm::sqlx::Error>> + Send + '_>,
> {
    let idle = !conn.is_in_transaction();
    Box::pin(async move { Ok(idle) })
}

/// A write transaction from [`Store::begin_write`]. Dropped without [`WriteTxn::commit`], it
/// rolls back, and its connection is closed rather than given back to the pool.
#[derive(Debug)]
pub enum WriteTxn {
    /// SQLite: our transaction on one sqlx connection, which rusqlite can also use.
    Sqlite(SqliteWrite),
    /// PostgreSQL: our transaction on one sqlx connection, on which sqlx can bind rows itself.
    Postgres(PgWrite),
}

impl WriteTxn {
    pub async fn commit(self) -> Result<()> {
        match self {
            WriteTxn::Sqlite(t) => t.commit().await?,
            WriteTxn::Postgres(t) => t.commit().await?,
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl ConnectionTrait for WriteTxn {
    fn get_database_backend(&self) -> DatabaseBackend {
        match self {
            WriteTxn::Sqlite(t) => t.get_database_backend(),
            WriteTxn::Postgres(t) => t.get_database_backend(),
        }
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        match self {
            WriteTxn::Sqlite(t) => t.execute_raw(stmt).await,
            WriteTxn::Postgres(t) => t.execute_raw(stmt).await,
        }
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        match self {
            WriteTxn::Sqlite(t) => t.execute_unprepared(sql).await,
            WriteTxn::Postgres(t) => t.execute_unprepared(sql).await,
        }
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        match self {
            WriteTxn::Sqlite(t) => t.query_one_raw(stmt).await,
            WriteTxn::Postgres(t) => t.query_one_raw(stmt).await,
        }
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        match self {
            WriteTxn::Sqlite(t) => t.query_all_raw(stmt).await,
            WriteTxn::Postgres(t) => t.query_all_raw(stmt).await,
        }
    }
}

/// The TCP port a PostgreSQL URL connects to; `None` for a Unix socket or a URL sqlx cannot
/// read (connecting then reports the error).
fn postgres_tcp_port(url: &str) -> Option<u16> {
    let opts: sea_orm::sqlx::postgres::PgConnectOptions = url.parse().ok()?;
    (!opts.get_host().starts_with('/')).then(|| opts.get_port())
}

/// Creates the directory that will hold a SQLite file named by `url`.
fn prepare_sqlite_dir(url: &str) -> Result<()> {
    let path = url
        .trim_start_matches("sqlite://")
        .trim_start_matches("sqlite:")
        .split('?')
        .next()
        .unwrap_or_default();
    if path.is_empty() || path == ":memory:" {
        return Ok(());
    }
    if let Some(dir) = Path::new(path)
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
    {
        std::fs::create_dir_all(dir).map_err(|e| {
            Error::Config(format!(
                "cannot create database directory {}: {e}",
                dir.display()
            ))
        })?;
    }
    Ok(())
}

/// The URL without its password, for logs.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{user}:***{}", &url[..scheme_end + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(
            redact_url("sqlite://./nm-data/x.db?mode=rwc"),
            "sqlite://./nm-data/x.db?mode=rwc"
        );
    }
}
