//! SQLite's row writer: multi-row statements through rusqlite, on the write transaction's own
//! connection ([`crate::store::SqliteWrite`]), each prepared once per connection.

use sea_orm::DatabaseBackend;

use super::row::{COLUMNS, insert_sql, row_cells};
use super::{Fresh, RequestRecord, RowWriter};
use crate::error::Result;
use crate::sql::{SQLITE_ROW_COUNTS, SqliteStatements, chunks_by};
use crate::store::SqliteWrite;

/// The INSERTs without `RETURNING`, one per row count of [`SQLITE_ROW_COUNTS`].
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

    /// The statement inserting `rows` rows (one of [`SQLITE_ROW_COUNTS`]).
    fn sql(&self, rows: usize) -> &str {
        self.statements.sql(rows)
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
    let mut inserted = 0;
    // The chunks come largest first: each statement is taken from the cache once per batch and
    // rebound chunk after chunk. (Back in the cache its bindings are cleared, which frees the
    // copies SQLite made of the bound text; rebinding reuses them.)
    let mut current: Option<(usize, rusqlite::CachedStatement<'_>)> = None;
    for chunk in chunks_by(records, &SQLITE_ROW_COUNTS) {
        if current
            .as_ref()
            .is_none_or(|(rows, _)| *rows != chunk.len())
        {
            current = Some((chunk.len(), conn.prepare_cached(sql.sql(chunk.len()))?));
        }
        let Some((_, stmt)) = current.as_mut() else {
            continue;
        };
        for (r, record) in chunk.iter().enumerate() {
            for (i, cell) in row_cells(record).iter().enumerate() {
                stmt.raw_bind_parameter(r * COLUMNS.len() + i + 1, cell)?;
            }
        }
        inserted += stmt.raw_execute()?;
    }
    drop(current);
    if inserted == records.len() {
        conn.prepare_cached("RELEASE request_rows")?.execute([])?;
        return Ok(Fresh::All);
    }
    conn.prepare_cached("ROLLBACK TO request_rows")?
        .execute([])?;
    conn.prepare_cached("RELEASE request_rows")?.execute([])?;
    let mut stmt = conn.prepare_cached(sql.sql(1))?;
    let mut ids = std::collections::HashSet::with_capacity(records.len());
    for r in records {
        for (i, cell) in row_cells(r).iter().enumerate() {
            stmt.raw_bind_parameter(i + 1, cell)?;
        }
        if stmt.raw_execute()? == 1 {
            ids.insert(r.request_id.clone());
        }
    }
    Ok(Fresh::Only(ids))
}
