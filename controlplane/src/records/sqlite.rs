//! SQLite's row writer: multi-row statements through rusqlite, on the write transaction's own
//! connection ([`crate::store::SqliteWrite`]), each prepared once per connection.

use sea_orm::DatabaseBackend;

use super::row::{COLUMNS, insert_sql, row_cells};
use super::{Fresh, RequestRecord, RowWriter};
use crate::error::Result;
use crate::sql::{Cell, SqliteStatements};
use crate::store::SqliteWrite;

/// The INSERTs without `RETURNING`, one per row count of [`crate::sql::SQLITE_ROW_COUNTS`].
#[derive(Debug)]
pub(super) struct SqliteRows {
    statements: SqliteStatements,
}

impl SqliteRows {
    pub(super) fn new(backend: DatabaseBackend) -> Self {
        Self {
            statements: SqliteStatements::new(COLUMNS.len(), |rows| {
                insert_sql(backend, rows, false)
            }),
        }
    }
}

impl RowWriter for SqliteRows {
    type Txn = SqliteWrite;

    async fn insert_new<'a>(
        &'a self,
        txn: &'a SqliteWrite,
        records: &'a [&'a RequestRecord],
    ) -> Result<Fresh> {
        txn.with_rusqlite(|conn| insert_rows(conn, self, records))
            .await
    }
}

/// SQLite: the records bound straight from themselves (see [`crate::store::SqliteWrite`]),
/// through statements from rusqlite's cache on the connection, which outlives the transaction:
/// each is prepared by the connection's first batch only.
///
/// A batch is almost always new, so it is first inserted in multi-row statements inside a
/// savepoint: when every row went in, that is the answer. When some were stored already (a
/// resent batch), the savepoint is rolled back and the records go in one by one, where a row
/// that changed nothing was stored already.
fn insert_rows(
    conn: &rusqlite::Connection,
    sql: &SqliteRows,
    records: &[&RequestRecord],
) -> rusqlite::Result<Fresh> {
    conn.prepare_cached("SAVEPOINT request_rows")?.execute([])?;
    let cells: Vec<Cell<'_>> = records.iter().flat_map(|r| row_cells(r)).collect();
    if sql.statements.run(conn, &cells)? == records.len() {
        conn.prepare_cached("RELEASE request_rows")?.execute([])?;
        return Ok(Fresh::All);
    }
    conn.prepare_cached("ROLLBACK TO request_rows")?
        .execute([])?;
    conn.prepare_cached("RELEASE request_rows")?.execute([])?;
    let mut ids = std::collections::HashSet::with_capacity(records.len());
    for (r, row) in records.iter().zip(cells.chunks_exact(COLUMNS.len())) {
        if sql.statements.run(conn, row)? == 1 {
            ids.insert(r.request_id.clone());
        }
    }
    Ok(Fresh::Only(ids))
}
