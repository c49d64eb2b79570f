//! `experiments`: one row per experiment (see `crate::experiments`): its agent and env, state,
//! the secret salt of its assignment, primary unit, guardrails, limits, what it may act on by
//! itself, its winner and whether that was promoted. Its arms are `experiment_arms`, its
//! history `experiment_events`. Its guardrails' thresholds (`latency_threshold_ms`,
//! `cost_threshold_micros`, NULL until fixed) are read and written by the evaluation's own
//! statements (`crate::experiments::evaluate`), not through this entity.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "experiments")]
pub struct Model {
    /// `exp_` and 12 lower-case hex digits.
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub agent: String,
    /// `production`, `staging`, `development`; NULL: every env.
    pub env: Option<String>,
    /// `running`, `paused`, `decided`, `harm`, `inconclusive` or `stopped`.
    pub state: String,
    /// 32 lower-case hex digits (a secret: never logged, never in an answer).
    pub salt: String,
    /// `session` or `request`.
    pub unit: String,
    /// Comma-separated guardrail names; empty: none.
    pub guardrails: String,
    /// NULL: no limit.
    pub max_sessions: Option<i64>,
    /// NULL: no limit.
    pub max_days: Option<i64>,
    pub auto_promote: bool,
    pub auto_rollback: bool,
    pub description: String,
    pub winner: Option<String>,
    pub promoted: bool,
    pub reason: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
