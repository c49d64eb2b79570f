//! PostgreSQL's row writer: the whole batch in one `INSERT ... SELECT FROM UNNEST(...)`, one
//! array parameter per column, bound by sqlx straight from the records on the write
//! transaction's own connection ([`crate::store::PgWrite`]).
//!
//! Earlier versions sent multi-row `VALUES` lists in a few fixed sizes through sea-orm: 28
//! parameters a row, each text value copied into a `sea_query::Value`, cloned again by sea-orm,
//! and the server parsing and binding up to 7,168 parameters per statement. Here a batch of any
//! size is one statement of 31 parameters (one prepared statement per connection), the arrays
//! are encoded from borrowed strings, and nothing is copied per value but into sqlx's buffer.

use std::collections::HashSet;
use std::sync::Arc;

use sea_orm::sqlx::{self, Row};

use super::row::{COLUMNS, row_cells};
use super::{Fresh, RequestRecord, RowWriter};
use crate::error::{Error, Result};
use crate::sql::{Cell, Hex};
use crate::store::PgWrite;
use crate::store::sqlx_bridge::exec_err;

/// The batch INSERT, without and with `RETURNING`, made once per [`super::Records`].
#[derive(Debug)]
pub(super) struct PostgresRows {
    insert: Arc<str>,
    returning: Arc<str>,
}

impl PostgresRows {
    pub(super) fn new() -> Self {
        let insert = unnest_insert();
        let returning = format!("{insert} RETURNING request_id");
        Self {
            insert: insert.into(),
            returning: returning.into(),
        }
    }
}

/// `INSERT INTO requests (...) SELECT * FROM UNNEST($1::text[], ...) ON CONFLICT DO NOTHING`:
/// each column's array type follows its cells' kind. The key is (request_id, started_at_ms), the
/// table being partitioned by time (migration m0017): a resent record has the same time.
fn unnest_insert() -> String {
    let mut sql = format!(
        "INSERT INTO requests ({}) SELECT * FROM UNNEST(",
        COLUMNS.join(", ")
    );
    for (i, cell) in row_cells(&RequestRecord::default()).iter().enumerate() {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push('$');
        sql.push_str(&(i + 1).to_string());
        sql.push_str(match cell {
            Cell::Text(_) | Cell::Hex(_) => "::text[]",
            Cell::Int(_) => "::int8[]",
            Cell::Int32(_) => "::int4[]",
            Cell::Bool(_) => "::bool[]",
        });
    }
    sql.push_str(") ON CONFLICT (request_id, started_at_ms) DO NOTHING");
    sql
}

type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// One column of a batch: its cells in record order.
enum Column<'a> {
    Text(Vec<Option<&'a str>>),
    Int(Vec<Option<i64>>),
    Int32(Vec<i32>),
    Bool(Vec<bool>),
    Hex(Vec<Option<Hex>>),
}

impl<'a> Column<'a> {
    /// An empty column for cells of `kind`'s kind, with room for `rows`.
    fn like(kind: &Cell<'_>, rows: usize) -> Self {
        match kind {
            Cell::Text(_) => Column::Text(Vec::with_capacity(rows)),
            Cell::Int(_) => Column::Int(Vec::with_capacity(rows)),
            Cell::Int32(_) => Column::Int32(Vec::with_capacity(rows)),
            Cell::Bool(_) => Column::Bool(Vec::with_capacity(rows)),
            Cell::Hex(_) => Column::Hex(Vec::with_capacity(rows)),
        }
    }

    /// Appends `cell`; false when it is not of this column's kind (`row_cells` changed a
    /// column's kind with the record's value: a bug).
    fn push(&mut self, cell: Cell<'a>) -> bool {
        match (self, cell) {
            (Column::Text(v), Cell::Text(s)) => v.push(s),
            (Column::Int(v), Cell::Int(n)) => v.push(n),
            (Column::Int32(v), Cell::Int32(n)) => v.push(n),
            (Column::Bool(v), Cell::Bool(b)) => v.push(b),
            (Column::Hex(v), Cell::Hex(h)) => v.push(h),
            _ => return false,
        }
        true
    }

    /// Binds the column as one array parameter (sqlx encodes it at once, copying nothing else).
    fn bind<'q>(&self, q: PgQuery<'q>) -> PgQuery<'q> {
        match self {
            Column::Text(v) => q.bind(v.as_slice()),
            Column::Int(v) => q.bind(v.as_slice()),
            Column::Int32(v) => q.bind(v.as_slice()),
            Column::Bool(v) => q.bind(v.as_slice()),
            Column::Hex(v) => q.bind(
                v.iter()
                    .map(|h| h.as_ref().map(Hex::as_str))
                    .collect::<Vec<_>>(),
            ),
        }
    }
}

/// The batch's columns.
fn columns<'a>(records: &[&'a RequestRecord]) -> Result<Vec<Column<'a>>> {
    let mut columns: Vec<Column<'a>> = row_cells(&RequestRecord::default())
        .iter()
        .map(|kind| Column::like(kind, records.len()))
        .collect();
    for r in records {
        for (column, cell) in columns.iter_mut().zip(row_cells(r)) {
            if !column.push(cell) {
                return Err(Error::Database(sea_orm::DbErr::Custom(
                    "a request row's cell is not of its column's kind".to_owned(),
                )));
            }
        }
    }
    Ok(columns)
}

impl RowWriter for PostgresRows {
    type Txn = PgWrite;

    async fn insert_new<'a>(
        &'a self,
        txn: &'a PgWrite,
        records: &'a [&'a RequestRecord],
    ) -> Result<Fresh> {
        insert_new_pooled(txn, self, records).await
    }
}

/// PostgreSQL: the batch in one statement.
///
/// A batch is almost always new, so it is first inserted without `RETURNING` inside a savepoint:
/// when every row went in, that is the answer. When some were stored already (a resent batch),
/// the savepoint is rolled back and the batch inserted again with `RETURNING`, which names the
/// new ones. Skipping `RETURNING` in the common case saves the database and the driver a result
/// row per record.
async fn insert_new_pooled(
    txn: &PgWrite,
    sql: &PostgresRows,
    records: &[&RequestRecord],
) -> Result<Fresh> {
    if records.is_empty() {
        return Ok(Fresh::All);
    }
    let columns = columns(records)?;
    let mut conn = txn.connection().await;
    let fresh = insert_batch(&mut conn, sql, &columns, records.len()).await;
    Ok(txn.seen(fresh)?)
}

/// The statement `text` with the batch's columns bound.
fn statement(text: &Arc<str>, columns: &[Column<'_>]) -> PgQuery<'static> {
    columns.iter().fold(
        sqlx::query(sqlx::AssertSqlSafe(Arc::clone(text))),
        |q, column| column.bind(q),
    )
}

async fn insert_batch(
    conn: &mut sqlx::PgConnection,
    sql: &PostgresRows,
    columns: &[Column<'_>],
    rows: usize,
) -> Result<Fresh, sea_orm::DbErr> {
    sqlx::raw_sql("SAVEPOINT request_rows")
        .execute(&mut *conn)
        .await
        .map_err(exec_err)?;
    let inserted = statement(&sql.insert, columns)
        .execute(&mut *conn)
        .await
        .map_err(exec_err)?
        .rows_affected();
    if inserted == rows as u64 {
        sqlx::raw_sql("RELEASE SAVEPOINT request_rows")
            .execute(&mut *conn)
            .await
            .map_err(exec_err)?;
        return Ok(Fresh::All);
    }
    sqlx::raw_sql("ROLLBACK TO SAVEPOINT request_rows")
        .execute(&mut *conn)
        .await
        .map_err(exec_err)?;
    let mut ids = HashSet::with_capacity(rows);
    for row in statement(&sql.returning, columns)
        .fetch_all(&mut *conn)
        .await
        .map_err(exec_err)?
    {
        ids.insert(row.try_get::<String, _>("request_id").map_err(exec_err)?);
    }
    Ok(Fresh::Only(ids))
}
