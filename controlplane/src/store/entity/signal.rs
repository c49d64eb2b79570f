//! `signals`: what end users did with outputs. A signal names its session, or one answer
//! (`request_id`), or both. `agent`, `env` and `user_id` are copied from the session when it is
//! known, or for a signal naming an answer from that request's record (`attributed_by_session`:
//! attributed, by its session or its request), else `agent` holds the `NM-Agent` hint; the
//! records ingest re-attributes once the session's (or the request's) record arrives.
//! `session_id` is empty while a signal that named only an answer waits for that answer's
//! record (which gives it its session, if it had one).
//!
//! An implicit signal (`source = implicit`, with its `rule`) is written by the records ingest
//! from the record that revealed it: its id is `<that request id>:<rule>`, its time, key,
//! session, agent, env and user are that record's, its `request_id` the answer judged.

use sea_orm::entity::prelude::*;

/// `source` of a signal an application sent.
pub const EXPLICIT: &str = "explicit";
/// `source` of a signal a rule inferred.
pub const IMPLICIT: &str = "implicit";

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "signals")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub received_at_ms: i64,
    pub session_id: String,
    pub request_id: Option<String>,
    pub action: String,
    pub edit_distance: Option<i64>,
    pub custom_label: Option<String>,
    pub key_id: String,
    pub idempotency_key: Option<String>,
    pub agent_hint: Option<String>,
    pub agent: Option<String>,
    pub env: Option<String>,
    pub user_id: Option<String>,
    pub attributed_by_session: bool,
    /// `explicit` (sent to `/v1/signal`) or `implicit` (inferred by a dataplane rule).
    pub source: String,
    /// The rule of an implicit signal (`nm_types::signal::Rule::name`); NULL for explicit ones.
    pub rule: Option<String>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
