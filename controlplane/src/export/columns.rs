//! The exported columns, schema version 1 (docs/export.md lists them with their meaning). The
//! order here is the order in the files. Times are UTC milliseconds (Parquet
//! `TIMESTAMP(MILLIS, UTC)`; JSON: RFC 3339 with `Z`); money is integer micro-dollars.

use crate::store::entity::{request, signal};

/// A column's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ty {
    /// UTF-8 text, never null.
    Str,
    /// UTF-8 text or null.
    OptStr,
    /// 64-bit integer, never null.
    I64,
    /// 64-bit integer or null.
    OptI64,
    /// UTC time in milliseconds, never null.
    Time,
    /// true or false, never null.
    Bool,
}

impl Ty {
    pub fn nullable(self) -> bool {
        matches!(self, Ty::OptStr | Ty::OptI64)
    }
}

/// One column: its name and type.
#[derive(Clone, Copy, Debug)]
pub struct Col {
    pub name: &'static str,
    pub ty: Ty,
}

/// One value of a row, in column order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Val {
    Null,
    I64(i64),
    Str(String),
    Bool(bool),
}

const fn c(name: &'static str, ty: Ty) -> Col {
    Col { name, ty }
}

/// `records/1`.
pub const RECORDS: &[Col] = &[
    c("request_id", Ty::Str),
    c("started_at", Ty::Time),
    c("key_id", Ty::Str),
    c("provider", Ty::Str),
    c("method", Ty::Str),
    c("path", Ty::Str),
    c("model", Ty::OptStr),
    c("requested_model", Ty::OptStr),
    c("answered_model", Ty::OptStr),
    c("agent", Ty::OptStr),
    c("session_id", Ty::OptStr),
    c("env", Ty::OptStr),
    c("user_id", Ty::OptStr),
    c("status", Ty::I64),
    c("latency_ms", Ty::I64),
    c("ttfb_ms", Ty::OptI64),
    c("streamed", Ty::Bool),
    c("error_code", Ty::OptStr),
    c("response_bytes", Ty::I64),
    c("input_tokens", Ty::OptI64),
    c("output_tokens", Ty::OptI64),
    c("cached_input_tokens", Ty::OptI64),
    c("cache_write_tokens", Ty::OptI64),
    c("reasoning_tokens", Ty::OptI64),
    c("finish_reason", Ty::OptStr),
    c("cost_micros", Ty::OptI64),
    c("usage_status", Ty::Str),
    c("trace_id", Ty::OptStr),
    c("span_id", Ty::OptStr),
    c("experiment_id", Ty::OptStr),
    c("arm", Ty::OptStr),
];

/// `signals/1`.
pub const SIGNALS: &[Col] = &[
    c("id", Ty::Str),
    c("received_at", Ty::Time),
    c("session_id", Ty::OptStr),
    c("request_id", Ty::OptStr),
    c("action", Ty::Str),
    c("edit_distance", Ty::OptI64),
    c("custom_label", Ty::OptStr),
    c("key_id", Ty::Str),
    c("agent", Ty::OptStr),
    c("agent_hint", Ty::OptStr),
    c("env", Ty::OptStr),
    c("user_id", Ty::OptStr),
    c("attributed_by_session", Ty::Bool),
    c("source", Ty::Str),
    c("rule", Ty::OptStr),
];

fn s(v: String) -> Val {
    Val::Str(v)
}

fn os(v: Option<String>) -> Val {
    v.map_or(Val::Null, Val::Str)
}

fn oi(v: Option<i64>) -> Val {
    v.map_or(Val::Null, Val::I64)
}

/// A stored record as a row of [`RECORDS`].
pub fn record_row(m: request::Model) -> Vec<Val> {
    vec![
        s(m.request_id),
        Val::I64(m.started_at_ms),
        s(m.key_id),
        s(m.provider),
        s(m.method),
        s(m.path),
        os(m.model),
        os(m.requested_model),
        os(m.answered_model),
        os(m.agent),
        os(m.session_id),
        os(m.env),
        os(m.user_id),
        Val::I64(i64::from(m.status)),
        Val::I64(m.latency_ms),
        oi(m.ttfb_ms),
        Val::Bool(m.streamed),
        os(m.error_code),
        Val::I64(m.response_bytes),
        oi(m.input_tokens),
        oi(m.output_tokens),
        oi(m.cached_input_tokens),
        oi(m.cache_write_tokens),
        oi(m.reasoning_tokens),
        os(m.finish_reason),
        oi(m.cost_micros),
        s(m.usage_status),
        os(m.trace_id),
        os(m.span_id),
        os(m.experiment_id),
        os(m.arm),
    ]
}

/// A stored signal as a row of [`SIGNALS`]. A signal still waiting for its answer's record has
/// no session yet: stored as `""`, exported as null.
pub fn signal_row(m: signal::Model) -> Vec<Val> {
    vec![
        s(m.id),
        Val::I64(m.received_at_ms),
        os(Some(m.session_id).filter(|v| !v.is_empty())),
        os(m.request_id),
        s(m.action),
        oi(m.edit_distance),
        os(m.custom_label),
        s(m.key_id),
        os(m.agent),
        os(m.agent_hint),
        os(m.env),
        os(m.user_id),
        Val::Bool(m.attributed_by_session),
        s(m.source),
        os(m.rule),
    ]
}
