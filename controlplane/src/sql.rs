//! A small builder for hand-written aggregate SQL that runs on SQLite and PostgreSQL alike:
//! it numbers placeholders the way each backend wants (`?` or `$n`). Used where an aggregate reads
//! more clearly as SQL than through the query builder. And what the row writers share: a row's
//! borrowed values ([`Cell`]), multi-row `VALUES` lists in a few fixed shapes ([`chunks_of`]),
//! and SQLite's statements through rusqlite ([`SqliteStatements`]).

use rusqlite::ToSql;
use rusqlite::types::{ToSqlOutput, ValueRef};
use sea_orm::{DatabaseBackend, QueryResult, Statement, Value};

use crate::error::Result;

#[derive(Debug)]
pub struct Sql {
    backend: DatabaseBackend,
    text: String,
    values: Vec<Value>,
}

impl Sql {
    pub fn new(backend: DatabaseBackend, text: &str) -> Self {
        Self {
            backend,
            text: text.to_owned(),
            values: Vec::new(),
        }
    }

    pub fn backend(&self) -> DatabaseBackend {
        self.backend
    }

    /// Appends SQL text (never user input).
    pub fn push(&mut self, text: &str) -> &mut Self {
        self.text.push_str(text);
        self
    }

    /// Appends a placeholder bound to `value`.
    pub fn bind(&mut self, value: impl Into<Value>) -> &mut Self {
        self.values.push(value.into());
        push_placeholder(self.backend, &mut self.text, self.values.len());
        self
    }

    pub fn build(self) -> Statement {
        Statement::from_sql_and_values(self.backend, self.text, self.values)
    }
}

/// Appends the `n`-th placeholder (from 1) of a statement: `$n` on PostgreSQL, `?` elsewhere.
pub fn push_placeholder(backend: DatabaseBackend, text: &mut String, n: usize) {
    match backend {
        DatabaseBackend::Postgres => {
            text.push('$');
            text.push_str(&n.to_string());
        }
        _ => text.push('?'),
    }
}

/// Appends `rows` parenthesised rows of `cols` placeholders each, comma-separated: the list of a
/// multi-row `VALUES`, numbered from 1.
pub fn push_value_rows(backend: DatabaseBackend, text: &mut String, rows: usize, cols: usize) {
    let mut n = 0;
    for row in 0..rows {
        text.push_str(if row > 0 { ", (" } else { "(" });
        for col in 0..cols {
            if col > 0 {
                text.push_str(", ");
            }
            n += 1;
            push_placeholder(backend, text, n);
        }
        text.push(')');
    }
}

/// `INSERT INTO table (cols...) VALUES` followed by `rows` rows of placeholders, one per column:
/// the head of a multi-row insert or upsert, whatever follows it (`ON CONFLICT ...`).
pub fn insert_values(backend: DatabaseBackend, table: &str, cols: &[&str], rows: usize) -> String {
    let mut text = format!("INSERT INTO {table} ({}) VALUES ", cols.join(", "));
    push_value_rows(backend, &mut text, rows, cols.len());
    text
}

/// SQLite's plan of `stmt` (`EXPLAIN QUERY PLAN`), one detail line per step: the tests' check
/// that a statement reads the index it was written for.
#[cfg(test)]
pub async fn query_plan<C: sea_orm::ConnectionTrait>(db: &C, stmt: &Statement) -> Vec<String> {
    let explain = Statement::from_sql_and_values(
        db.get_database_backend(),
        format!("EXPLAIN QUERY PLAN {}", stmt.sql),
        stmt.values.clone().map(|v| v.0).unwrap_or_default(),
    );
    db.query_all_raw(explain)
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get::<String>("", "detail").unwrap())
        .collect()
}

/// A count column (`COUNT`, a `SUM` of integers) of a result row; a negative value reads as 0.
pub fn count(row: &QueryResult, col: &str) -> Result<u64> {
    let v: i64 = row.try_get("", col)?;
    Ok(u64::try_from(v).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_placeholders_per_backend() {
        let mut pg = Sql::new(DatabaseBackend::Postgres, "SELECT 1 WHERE a = ");
        pg.bind(1).push(" AND b = ").bind("x");
        assert_eq!(pg.build().sql, "SELECT 1 WHERE a = $1 AND b = $2");
        let mut lite = Sql::new(DatabaseBackend::Sqlite, "SELECT 1 WHERE a = ");
        lite.bind(1).push(" AND b = ").bind("x");
        assert_eq!(lite.build().sql, "SELECT 1 WHERE a = ? AND b = ?");
        assert_eq!(
            insert_values(DatabaseBackend::Postgres, "t", &["a", "b"], 2),
            "INSERT INTO t (a, b) VALUES ($1, $2), ($3, $4)"
        );
    }
}

/// One value of a row, borrowed from what it describes: bound by rusqlite on SQLite
/// ([`SqliteStatements`]); for sqlx on PostgreSQL gathered into one array per column (the request
/// rows) or copied into a sea-orm [`Value`] (`store::upsert`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Cell<'a> {
    Text(Option<&'a str>),
    Int(Option<i64>),
    Int32(i32),
    Bool(bool),
    /// A span's trace id or span id, spelled in hex here (no allocation per row).
    Hex(Option<Hex>),
}

/// An id of up to 16 bytes spelled in lower-case hex (the W3C and OTLP/JSON spelling, as
/// [`nm_types::record::TraceRef::trace_hex`]), held inline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hex {
    digits: [u8; 32],
    len: usize,
}

impl Hex {
    /// `bytes` in hex; only the first 16 bytes are spelled (trace ids are 16, span ids 8).
    pub(crate) fn of(bytes: &[u8]) -> Self {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut digits = [0; 32];
        for (pair, b) in digits.chunks_exact_mut(2).zip(bytes) {
            pair[0] = DIGITS[usize::from(b >> 4)];
            pair[1] = DIGITS[usize::from(b & 0xf)];
        }
        Self {
            digits,
            len: 2 * bytes.len().min(16),
        }
    }

    /// The digits: ASCII, hence UTF-8.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.digits[..self.len]
    }

    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }
}

impl ToSql for Cell<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(match self {
            Cell::Text(Some(s)) => ValueRef::Text(s.as_bytes()),
            Cell::Text(None) | Cell::Int(None) | Cell::Hex(None) => ValueRef::Null,
            Cell::Int(Some(n)) => ValueRef::Integer(*n),
            Cell::Int32(n) => ValueRef::Integer((*n).into()),
            Cell::Bool(b) => ValueRef::Integer((*b).into()),
            Cell::Hex(Some(h)) => ValueRef::Text(h.as_bytes()),
        }))
    }
}

impl Cell<'_> {
    /// The value as sea-orm binds it (an owned copy).
    pub(crate) fn to_value(self) -> Value {
        match self {
            Cell::Text(t) => Value::String(t.map(str::to_owned)),
            Cell::Int(n) => Value::BigInt(n),
            Cell::Int32(n) => Value::Int(Some(n)),
            Cell::Bool(b) => Value::Bool(Some(b)),
            Cell::Hex(h) => Value::String(h.map(|h| h.as_str().to_owned())),
        }
    }
}

/// The row counts of SQLite's multi-row statements through rusqlite ([`SqliteStatements`]),
/// largest first. Each row of a statement costs SQLite one pass of the insert loop, but each
/// statement adds its own start and end (cursors opened on the table and its indexes, the
/// statement's halt) and, through rusqlite, a step and a reset: about a tenth of a one-row
/// INSERT. Statements of 8 rows, not 32: SQLite copies each bound text, and binding a 32-row
/// statement's texts cost more than its fewer statements saved (callgrind, `serve`: 120–122k
/// instructions per request with 8 and 1, 124–126k with 32, 8 and 1, alternating runs).
pub const SQLITE_ROW_COUNTS: [usize; 2] = [8, 1];

/// A multi-row statement on SQLite run through rusqlite on the write transaction's own
/// connection (`store::SqliteWrite::with_rusqlite`): its SQL for each row count of
/// [`SQLITE_ROW_COUNTS`], made once, each prepared once per connection (rusqlite's cache, which
/// outlives the transaction), every value bound from the caller's memory. What sqlx would do
/// with the same statement costs more per row: each value an owned copy, a statement text (and
/// so a prepared statement) per number of rows. rusqlite's cache keeps 16 statements per
/// connection; a batch's transaction uses 11 (the request rows' 2 and their savepoint's 3, 2 for
/// each of the usage and latency day totals and the budget spend).
#[derive(Debug)]
pub struct SqliteStatements {
    by_rows: [(usize, String); SQLITE_ROW_COUNTS.len()],
    /// Values per row.
    width: usize,
}

impl SqliteStatements {
    /// The statements `sql(rows)` writes, of `width` values a row.
    pub fn new(width: usize, sql: impl Fn(usize) -> String) -> Self {
        Self {
            by_rows: SQLITE_ROW_COUNTS.map(|rows| (rows, sql(rows))),
            width,
        }
    }

    /// `INSERT INTO table (cols…) VALUES` and its rows, then `tail` (an `ON CONFLICT` clause).
    pub fn insert(table: &str, cols: &[&str], tail: &str) -> Self {
        Self::new(cols.len(), |rows| {
            let mut sql = insert_values(DatabaseBackend::Sqlite, table, cols, rows);
            sql.push_str(tail);
            sql
        })
    }

    /// The statement of `rows` rows (one of [`SQLITE_ROW_COUNTS`]).
    fn sql(&self, rows: usize) -> &str {
        self.by_rows
            .iter()
            .find(|(n, _)| *n == rows)
            .map_or("", |(_, sql)| sql)
    }

    /// Runs the statements over `values`, rows of `width` values one after the other: as many
    /// statements of the most rows as fit, then the rest. Returns the rows they changed.
    pub fn run<V: rusqlite::ToSql>(
        &self,
        conn: &rusqlite::Connection,
        values: &[V],
    ) -> rusqlite::Result<usize> {
        debug_assert_eq!(values.len() % self.width, 0, "whole rows only");
        let rows: Vec<&[V]> = values.chunks_exact(self.width.max(1)).collect();
        let mut changed = 0;
        // The chunks come largest first: each statement is taken from the cache once and
        // rebound chunk after chunk. (Back in the cache its bindings are cleared, which frees
        // the copies SQLite made of the bound text; rebinding reuses them.)
        let mut current: Option<(usize, rusqlite::CachedStatement<'_>)> = None;
        for chunk in chunks_by(&rows, &SQLITE_ROW_COUNTS) {
            if current
                .as_ref()
                .is_none_or(|(rows, _)| *rows != chunk.len())
            {
                current = Some((chunk.len(), conn.prepare_cached(self.sql(chunk.len()))?));
            }
            let Some((_, stmt)) = current.as_mut() else {
                continue;
            };
            for (i, value) in chunk.iter().flat_map(|row| row.iter()).enumerate() {
                stmt.raw_bind_parameter(i + 1, value)?;
            }
            changed += stmt.raw_execute()?;
        }
        Ok(changed)
    }
}

/// The row counts [`insert_chunks`] draws from, largest first.
pub const INSERT_CHUNK_SIZES: [usize; 5] = [256, 64, 16, 4, 1];

/// Row counts for multi-row INSERTs of `n` rows, drawn from a few fixed sizes.
///
/// Every distinct row count is a distinct SQL text, and each connection caches a prepared
/// statement per text; a large multi-row statement is big (hundreds of KiB in SQLite). Fixed sizes
/// keep at most five shapes per table in the cache instead of one per batch size.
pub fn insert_chunks(n: usize) -> impl Iterator<Item = usize> {
    chunk_sizes(n, &INSERT_CHUNK_SIZES)
}

/// `n` cut greedily into sizes drawn from `sizes` (largest first, ending with 1).
fn chunk_sizes(mut n: usize, sizes: &'static [usize]) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let size = sizes.iter().copied().find(|s| *s <= n)?;
        n -= size;
        Some(size)
    })
}

/// `items` cut into consecutive slices of the sizes [`insert_chunks`] draws, for one multi-row
/// statement each.
pub fn chunks_of<T>(items: &[T]) -> impl Iterator<Item = &[T]> {
    chunks_by(items, &INSERT_CHUNK_SIZES)
}

/// `items` cut into consecutive slices of sizes drawn greedily from `sizes` (largest first,
/// ending with 1), for one multi-row statement each.
pub fn chunks_by<'a, T>(items: &'a [T], sizes: &'static [usize]) -> impl Iterator<Item = &'a [T]> {
    let mut rest = items;
    chunk_sizes(items.len(), sizes).map(move |size| {
        let (chunk, tail) = rest.split_at(size);
        rest = tail;
        chunk
    })
}

#[cfg(test)]
mod chunk_tests {
    use super::{chunks_by, chunks_of, insert_chunks};

    #[test]
    fn chunks_cover_every_row_with_few_shapes() {
        for n in [0, 1, 5, 63, 64, 300, 1000, 1023] {
            let sizes: Vec<usize> = insert_chunks(n).collect();
            assert_eq!(sizes.iter().sum::<usize>(), n);
            assert!(sizes.iter().all(|s| [256, 64, 16, 4, 1].contains(s)));
        }
        assert_eq!(
            insert_chunks(300).collect::<Vec<_>>(),
            [256, 16, 16, 4, 4, 4]
        );
        let items: Vec<usize> = (0..300).collect();
        let chunks: Vec<&[usize]> = chunks_of(&items).collect();
        assert_eq!(
            chunks.iter().map(|c| c.len()).collect::<Vec<_>>(),
            [256, 16, 16, 4, 4, 4]
        );
        assert_eq!(chunks.concat(), items);
        let sizes: Vec<usize> = chunks_by(&items[..53], &[32, 8, 1])
            .map(<[usize]>::len)
            .collect();
        assert_eq!(sizes, [32, 8, 8, 1, 1, 1, 1, 1]);
    }
}

#[cfg(test)]
mod sqlite_statement_tests {
    use sea_orm::DatabaseBackend;

    use super::{Cell, SqliteStatements, insert_values};

    /// Every row goes in, in order, whatever the count: statements of 8 rows, then of 1; an
    /// upsert adds to the rows already there.
    #[test]
    fn rows_go_in_through_both_statement_sizes() {
        let conn = rusqlite::Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (k TEXT PRIMARY KEY, n INTEGER NOT NULL)")
            .unwrap();
        let upsert = SqliteStatements::new(2, |rows| {
            let mut sql = insert_values(DatabaseBackend::Sqlite, "t", &["k", "n"], rows);
            sql.push_str(" ON CONFLICT (k) DO UPDATE SET n = t.n + excluded.n");
            sql
        });
        let keys: Vec<String> = (0..19).map(|i| format!("k{i:02}")).collect();
        let values = |n: i64| -> Vec<Cell<'_>> {
            keys.iter()
                .flat_map(|k| [Cell::Text(Some(k)), Cell::Int(Some(n))])
                .collect()
        };
        assert_eq!(upsert.run(&conn, &values(1)).unwrap(), 19);
        assert_eq!(upsert.run(&conn, &values(2)).unwrap(), 19);
        assert_eq!(upsert.run(&conn, &values(5)[..6]).unwrap(), 3);
        let mut stmt = conn.prepare("SELECT k, n FROM t ORDER BY k").unwrap();
        let rows: Vec<(String, i64)> = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let expected: Vec<(String, i64)> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k.clone(), if i < 3 { 8 } else { 3 }))
            .collect();
        assert_eq!(rows, expected);
    }
}
