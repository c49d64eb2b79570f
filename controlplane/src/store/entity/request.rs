//! `requests`: one row per proxied request, keyed by the request id the client saw.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "requests")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub request_id: String,
    pub started_at_ms: i64,
    pub key_id: String,
    pub provider: String,
    pub method: String,
    pub path: String,
    pub model: Option<String>,
    pub agent: Option<String>,
    pub session_id: Option<String>,
    pub env: Option<String>,
    pub user_id: Option<String>,
    pub status: i32,
    pub latency_ms: i64,
    pub ttfb_ms: Option<i64>,
    pub streamed: bool,
    pub error_code: Option<String>,
    pub response_bytes: i64,
    pub answered_model: Option<String>,
    pub input_tokens: Option<i64>,
    pub output_tokens: Option<i64>,
    pub cached_input_tokens: Option<i64>,
    pub cache_write_tokens: Option<i64>,
    pub reasoning_tokens: Option<i64>,
    pub finish_reason: Option<String>,
    pub cost_micros: Option<i64>,
    /// `reported`, `partial`, `missing` or `not_applicable`.
    pub usage_status: String,
    pub trace_id: Option<String>,
    pub span_id: Option<String>,
    /// The experiment whose arm served the request (NULL: in none).
    pub experiment_id: Option<String>,
    pub arm: Option<String>,
    /// The model the client named, when the arm sent another one (`model` is the one served).
    pub requested_model: Option<String>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
