//! A record as a `requests` row: the columns, and each record's values in their order,
//! borrowed from the record. Both databases' writers bind these; nothing else maps a record to
//! a row.

use nm_types::{Env, SessionId};
use sea_orm::DatabaseBackend;

use super::RequestRecord;
use crate::sql::{Cell, Hex, insert_values};

/// `requests` columns, in the order of [`row_cells`].
pub(super) const COLUMNS: [&str; 31] = [
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
    "experiment_id",
    "arm",
    "requested_model",
];

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
        Cell::Hex(r.trace.as_ref().map(|t| Hex::of(&t.trace_id))),
        Cell::Hex(r.trace.as_ref().map(|t| Hex::of(&t.span_id))),
        Cell::Text(r.variant.as_ref().map(|v| &*v.experiment)),
        Cell::Text(r.variant.as_ref().map(|v| &*v.arm)),
        Cell::Text(
            r.variant
                .as_ref()
                .and_then(|v| v.requested_model.as_deref()),
        ),
    ]
}

/// The INSERT of `rows` records as one multi-row `VALUES` list of bound parameters. Resent
/// records are skipped (`ON CONFLICT DO NOTHING`); with `returning`, the statement names the new
/// ones. SQLite's writer (`sqlite.rs`) uses a few row counts of it; PostgreSQL's
/// (`postgres.rs`) sends a batch as one array per column instead.
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

#[cfg(test)]
mod tests {
    use nm_types::record::TraceRef;

    use super::Hex;

    #[test]
    fn hex_is_spelled_as_the_record_spells_it() {
        let t = TraceRef {
            trace_id: [
                0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e,
                0x47, 0x36,
            ],
            span_id: [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7],
        };
        assert_eq!(Hex::of(&t.trace_id).as_str(), t.trace_hex());
        assert_eq!(Hex::of(&t.span_id).as_str(), t.span_hex());
        assert_eq!(Hex::of(&[0xff; 20]).as_str(), "ff".repeat(16));
    }
}
