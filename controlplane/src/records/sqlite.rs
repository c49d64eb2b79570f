//! SQLite's row writer: one prepared one-row statement through rusqlite, on the write
//! transaction's own connection ([`crate::store::SqliteWrite`]).

use sea_orm::DatabaseBackend;

use super::row::{insert_sql, row_cells};
use super::{Fresh, RequestRecord, RowWriter};
use crate::error::Result;
use crate::store::SqliteWrite;

/// The one-row INSERT without `RETURNING`.
#[derive(Debug)]
pub(super) struct SqliteRows {
    one_row: String,
}

impl SqliteRows {
    pub(super) fn new(backend: DatabaseBackend) -> Self {
        Self {
            one_row: insert_sql(backend, 1, false),
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
        txn.with_rusqlite(|conn| insert_rows(conn, &self.one_row, records))
            .await
    }
}

/// SQLite: the records one by one through a prepared one-row statement, bound from the records
/// themselves (see [`crate::store::SqliteWrite`]). A row that changed nothing was stored already.
fn insert_rows(
    conn: &rusqlite::Connection,
    sql: &str,
    records: &[&RequestRecord],
) -> rusqlite::Result<Fresh> {
    let mut stmt = conn.prepare(sql)?;
    let mut stored = Vec::with_capacity(records.len());
    for r in records {
        for (i, cell) in row_cells(r).iter().enumerate() {
            stmt.raw_bind_parameter(i + 1, cell)?;
        }
        stored.push(stmt.raw_execute()? == 1);
    }
    if stored.iter().all(|s| *s) {
        return Ok(Fresh::All);
    }
    let ids = records
        .iter()
        .zip(stored)
        .filter(|(_, s)| *s)
        .map(|(r, _)| r.request_id.clone())
        .collect();
    Ok(Fresh::Only(ids))
}
