//! PostgreSQL's row writer: multi-row statements of bound parameters in a few fixed sizes.

use std::collections::HashSet;

use sea_orm::{
    ConnectionTrait, DatabaseBackend, DatabaseTransaction, Statement, TransactionTrait, Value,
};

use super::row::{insert_sql, row_cells};
use super::{Fresh, RequestRecord, RowWriter};
use crate::error::Result;
use crate::sql::{INSERT_CHUNK_SIZES, chunks_of};

/// The INSERT texts for each row count of [`INSERT_CHUNK_SIZES`], with and without `RETURNING`,
/// made once per [`super::Records`].
#[derive(Debug)]
pub(super) struct PostgresRows {
    backend: DatabaseBackend,
    by_size: Vec<(usize, bool, String)>,
}

impl PostgresRows {
    pub(super) fn new(backend: DatabaseBackend) -> Self {
        let by_size = INSERT_CHUNK_SIZES
            .iter()
            .flat_map(|&n| [false, true].map(|r| (n, r, insert_sql(backend, n, r))))
            .collect();
        Self { backend, by_size }
    }

    /// The statement inserting `chunk`.
    fn statement(&self, chunk: &[&RequestRecord], returning: bool) -> Statement {
        let rows = chunk.len();
        let sql = self
            .by_size
            .iter()
            .find(|(n, r, _)| *n == rows && *r == returning)
            .map_or_else(
                || insert_sql(self.backend, rows, returning),
                |(_, _, sql)| sql.clone(),
            );
        let values = chunk.iter().flat_map(|r| row_cells(r).map(Value::from));
        Statement::from_sql_and_values(self.backend, sql, values)
    }
}

impl RowWriter for PostgresRows {
    type Txn = DatabaseTransaction;

    async fn insert_new<'a>(
        &'a self,
        txn: &'a DatabaseTransaction,
        records: &'a [&'a RequestRecord],
    ) -> Result<Fresh> {
        insert_new_pooled(txn, self, records).await
    }
}

/// PostgreSQL: multi-row statements of [`INSERT_CHUNK_SIZES`].
///
/// A batch is almost always new, so it is first inserted without `RETURNING` inside a savepoint:
/// when every row went in, that is the answer. When some were stored already (a resent batch),
/// the savepoint is rolled back and the batch inserted again with `RETURNING`, which names the
/// new ones. Skipping `RETURNING` in the common case saves the database and the driver a result
/// row per record.
async fn insert_new_pooled(
    txn: &DatabaseTransaction,
    sql: &PostgresRows,
    records: &[&RequestRecord],
) -> Result<Fresh> {
    let attempt = txn.begin().await?;
    let mut inserted = 0u64;
    for chunk in chunks_of(records) {
        inserted += attempt
            .execute_raw(sql.statement(chunk, false))
            .await?
            .rows_affected();
    }
    if inserted == records.len() as u64 {
        attempt.commit().await?;
        return Ok(Fresh::All);
    }
    attempt.rollback().await?;
    let mut ids = HashSet::with_capacity(records.len());
    for chunk in chunks_of(records) {
        for row in txn.query_all_raw(sql.statement(chunk, true)).await? {
            ids.insert(row.try_get::<String>("", "request_id")?);
        }
    }
    Ok(Fresh::Only(ids))
}
