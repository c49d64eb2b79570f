//! Proxied-request records: validated, stored once per request id, folded into the `sessions`
//! table (so the controlplane knows which agent, env and end user each session belongs to) and
//! into the `user_spend` rollup that budgets read — all in the batch's one transaction.
//!
//! - `ingest.rs`: the flow of a batch ([`Records::ingest`]): checks, the rows, sessions,
//!   rollups, re-attributed signals, spend, one commit.
//! - `row.rs`: the one mapping of a record to a `requests` row ([`row::COLUMNS`],
//!   [`row::row_cells`]), shared by both databases.
//! - `sqlite.rs` and `postgres.rs`: the row writer of each database, behind [`RowWriter`]:
//!   statements prepared once per connection, values bound from the records without copies.

mod ingest;
mod postgres;
mod row;
mod sqlite;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::future::Future;

use sea_orm::{ConnectionTrait, DatabaseBackend};

use crate::error::Result;
use crate::store::WriteTxn;

pub use ingest::{IngestOutcome, Records};
pub use nm_types::record::RequestRecord;
pub use nm_types::{Usage, UsageStatus};

#[cfg(test)]
use crate::budgets::Budgets;
#[cfg(test)]
use crate::store::Store;
#[cfg(test)]
use crate::store::entity::session;
#[cfg(test)]
use sea_orm::{ColumnTrait, EntityTrait, QueryFilter};

/// Writes a batch's `requests` rows inside the batch's write transaction, skipping the rows
/// stored already, and says which were new. One per database: its transaction type, its
/// statements.
trait RowWriter {
    /// The write transaction this database's rows go through.
    type Txn;

    fn insert_new<'a>(
        &'a self,
        txn: &'a Self::Txn,
        records: &'a [&'a RequestRecord],
    ) -> impl Future<Output = Result<Fresh>> + Send + 'a;
}

/// The statements of both row writers for one database backend, made once per [`Records`]; the
/// write transaction picks the writer.
#[derive(Debug)]
struct InsertSql {
    sqlite: sqlite::SqliteRows,
    postgres: postgres::PostgresRows,
}

impl InsertSql {
    fn new(backend: DatabaseBackend) -> Self {
        Self {
            sqlite: sqlite::SqliteRows::new(backend),
            postgres: postgres::PostgresRows::new(),
        }
    }
}

/// Which records of a batch were stored for the first time.
#[derive(Debug)]
enum Fresh {
    All,
    Only(HashSet<String>),
}

impl Fresh {
    fn contains(&self, request_id: &str) -> bool {
        match self {
            Fresh::All => true,
            Fresh::Only(ids) => ids.contains(request_id),
        }
    }
}

/// Writes request rows inside `txn` with the statements the ingest uses, skipping stored ones
/// (the synthetic data's direct path: rows without their sessions and spend).
pub(crate) async fn write_rows(txn: &WriteTxn, records: &[&RequestRecord]) -> Result<()> {
    let sql = InsertSql::new(txn.get_database_backend());
    insert_new(txn, &sql, records).await.map(drop)
}

/// Inserts the records not stored yet and says which they were.
async fn insert_new(txn: &WriteTxn, sql: &InsertSql, records: &[&RequestRecord]) -> Result<Fresh> {
    match txn {
        WriteTxn::Sqlite(txn) => sql.sqlite.insert_new(txn, records).await,
        WriteTxn::Postgres(txn) => sql.postgres.insert_new(txn, records).await,
    }
}
