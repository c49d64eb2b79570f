//! `sessions`: what the proxy records say about each session (agent, env, end user, activity).

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "sessions")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub session_id: String,
    pub agent: Option<String>,
    pub env: Option<String>,
    pub user_id: Option<String>,
    pub first_seen_ms: i64,
    pub last_seen_ms: i64,
    pub request_count: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
