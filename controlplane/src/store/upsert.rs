//! A multi-row upsert of rows of borrowed values, on either database, inside a write
//! transaction.

use sea_orm::{ConnectionTrait, Statement};

use super::WriteTxn;
use crate::error::Result;
use crate::sql::{Cell, SqliteStatements, chunks_of, insert_values};

/// A multi-row upsert of rows of borrowed values ([`Cell`]) into one table, on either database:
/// the day totals' and the budget spend's, whose rows come one or more per record. On SQLite
/// through rusqlite ([`SqliteStatements`]); on PostgreSQL through sea-orm, in statements of the
/// fixed row counts of [`chunks_of`], each value an owned [`Value`].
#[derive(Debug)]
pub struct Upsert {
    table: &'static str,
    cols: &'static [&'static str],
    /// The `ON CONFLICT` clause.
    tail: String,
    sqlite: SqliteStatements,
}

impl Upsert {
    pub fn new(table: &'static str, cols: &'static [&'static str], tail: String) -> Self {
        Self {
            sqlite: SqliteStatements::insert(table, cols, &tail),
            table,
            cols,
            tail,
        }
    }

    /// Writes `values`, whole rows of the table's columns in order, in `txn`. The rows go in the
    /// order given (sorted by the callers: concurrent batches lock rows in one order).
    pub async fn run(&self, txn: &WriteTxn, values: &[Cell<'_>]) -> Result<()> {
        if let WriteTxn::Sqlite(t) = txn {
            t.with_rusqlite(|conn| self.sqlite.run(conn, values))
                .await?;
            return Ok(());
        }
        let backend = txn.get_database_backend();
        let rows: Vec<&[Cell<'_>]> = values.chunks_exact(self.cols.len()).collect();
        for chunk in chunks_of(&rows) {
            let mut sql = insert_values(backend, self.table, self.cols, chunk.len());
            sql.push_str(&self.tail);
            let values = chunk
                .iter()
                .flat_map(|row| row.iter())
                .map(|c| c.to_value());
            txn.execute_raw(Statement::from_sql_and_values(backend, sql, values))
                .await?;
        }
        Ok(())
    }
}
