//! A record as a `requests` row: the columns, and each record's values in their order,
//! borrowed from the record. Both databases' writers bind these; nothing else maps a record to
//! a row.

use nm_types::{Env, SessionId};
use rusqlite::ToSql;
use rusqlite::types::{ToSqlOutput, ValueRef};
use sea_orm::{DatabaseBackend, Value};

use super::RequestRecord;
use crate::sql::insert_values;

/// `requests` columns, in the order of [`row_cells`].
pub(super) const COLUMNS: [&str; 28] = [
    "request_id",
    "started_at_ms",
    "key_id",
    "provider",
    "method",
    "path",
    "model",
    "agent",
    "session_id",
    "env",
    "user_id",
    "status",
    "latency_ms",
    "ttfb_ms",
    "streamed",
    "error_code",
    "response_bytes",
    "answered_model",
    "input_tokens",
    "output_tokens",
    "cached_input_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
    "finish_reason",
    "cost_micros",
    "usage_status",
    "trace_id",
    "span_id",
];

/// One value of a `requests` row, borrowed from its record: bound by rusqlite on SQLite, turned
/// into sea-orm values on PostgreSQL.
#[derive(Debug, Clone, Copy)]
pub(super) enum Cell<'a> {
    Text(Option<&'a str>),
    Int(Option<i64>),
    Int32(i32),
    Bool(bool),
    /// A span's trace id, then its span id, stored as their hex spellings.
    TraceId(Option<&'a nm_types::record::TraceRef>),
    SpanId(Option<&'a nm_types::record::TraceRef>),
}

/// One record's values in [`COLUMNS`] order.
pub(super) fn row_cells(r: &RequestRecord) -> [Cell<'_>; COLUMNS.len()] {
    fn text(v: &Option<String>) -> Cell<'_> {
        Cell::Text(v.as_deref())
    }
    let count = |v: Option<u64>| Cell::Int(v.map(saturating_i64));
    let u = &r.usage;
    [
        Cell::Text(Some(&r.request_id)),
        Cell::Int(Some(r.started_at_ms)),
        Cell::Text(Some(&r.key_id)),
        Cell::Text(Some(&r.provider)),
        Cell::Text(Some(&r.method)),
        Cell::Text(Some(&r.path)),
        text(&r.model),
        text(&r.agent),
        Cell::Text(r.session_id.as_ref().map(SessionId::as_str)),
        Cell::Text(r.env.map(Env::as_str)),
        text(&r.user_id),
        Cell::Int32(i32::from(r.status)),
        count(Some(r.latency_ms)),
        count(r.ttfb_ms),
        Cell::Bool(r.streamed),
        Cell::Text(r.error_code.as_deref()),
        count(Some(r.response_bytes)),
        text(&u.model),
        count(u.input_tokens),
        count(u.output_tokens),
        count(u.cached_input_tokens),
        count(u.cache_write_tokens),
        count(u.reasoning_tokens),
        text(&u.finish_reason),
        count(r.cost_micros),
        Cell::Text(Some(r.usage_status.as_str())),
        Cell::TraceId(r.trace.as_ref()),
        Cell::SpanId(r.trace.as_ref()),
    ]
}

impl From<Cell<'_>> for Value {
    fn from(cell: Cell<'_>) -> Value {
        match cell {
            Cell::Text(s) => Value::String(s.map(str::to_owned)),
            Cell::Int(n) => Value::BigInt(n),
            Cell::Int32(n) => Value::Int(Some(n)),
            Cell::Bool(b) => Value::Bool(Some(b)),
            Cell::TraceId(t) => Value::String(t.map(|t| t.trace_hex())),
            Cell::SpanId(t) => Value::String(t.map(|t| t.span_hex())),
        }
    }
}

impl ToSql for Cell<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        match *self {
            Cell::TraceId(Some(t)) => return Ok(ToSqlOutput::from(t.trace_hex())),
            Cell::SpanId(Some(t)) => return Ok(ToSqlOutput::from(t.span_hex())),
            _ => {}
        }
        Ok(ToSqlOutput::Borrowed(match *self {
            Cell::Text(Some(s)) => ValueRef::Text(s.as_bytes()),
            Cell::Text(None) | Cell::Int(None) => ValueRef::Null,
            Cell::Int(Some(n)) => ValueRef::Integer(n),
            Cell::Int32(n) => ValueRef::Integer(n.into()),
            Cell::Bool(b) => ValueRef::Integer(b.into()),
            Cell::TraceId(_) | Cell::SpanId(_) => ValueRef::Null,
        }))
    }
}

/// The INSERT of `rows` records as one multi-row `VALUES` list of bound parameters. Resent
/// records are skipped (`ON CONFLICT DO NOTHING`); with `returning`, the statement names the new
/// ones.
///
/// On PostgreSQL a batch goes in as such statements, cut into a few fixed row counts
/// ([`crate::sql::INSERT_CHUNK_SIZES`]) so each connection caches a handful of prepared statements (an
/// earlier version sent the batch as one JSON parameter unpacked by `json_each`, and SQLite's JSON
/// path lookups were then 16% of the whole gateway's instructions under load). On SQLite only the
/// one-row statement is used, through rusqlite (`sqlite.rs`).
pub(super) fn insert_sql(backend: DatabaseBackend, rows: usize, returning: bool) -> String {
    let mut sql = insert_values(backend, "requests", &COLUMNS, rows);
    sql.push_str(" ON CONFLICT (request_id) DO NOTHING");
    if returning {
        sql.push_str(" RETURNING request_id");
    }
    sql
}

fn saturating_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
