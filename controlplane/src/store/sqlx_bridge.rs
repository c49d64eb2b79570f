//! What both write transactions (`sqlite_write.rs`, `pg_write.rs`) need to run sea-orm's
//! statements through sqlx themselves: the statement as an sqlx query, and sqlx's errors as
//! sea-orm's.

use std::sync::Arc;

use sea_orm::sqlx;
use sea_orm::{DbErr, RuntimeErr, Statement, Values};
use sea_query_sqlx::SqlxValues;

/// An error of a statement that changes rows.
pub(crate) fn exec_err(e: sqlx::Error) -> DbErr {
    DbErr::Exec(RuntimeErr::SqlxError(Arc::new(e)))
}

/// An error of a statement that reads rows.
pub(crate) fn query_err(e: sqlx::Error) -> DbErr {
    DbErr::Query(RuntimeErr::SqlxError(Arc::new(e)))
}

/// The statement as an sqlx query on either database, its values moved (sea-orm clones them).
pub(crate) fn query<DB>(stmt: Statement) -> sqlx::query::Query<'static, DB, SqlxValues>
where
    DB: sqlx::Database,
    SqlxValues: sqlx::IntoArguments<DB>,
{
    let values = SqlxValues(stmt.values.unwrap_or(Values(Vec::new())));
    sqlx::query_with(sqlx::AssertSqlSafe(stmt.sql), values)
}
