//! `budgets`: the default end-user budget (subject `default`), the default key budget
//! (`default-key`) and budgets of scopes (`<kind>:<value>`, e.g. `user:<id>`, `agent:<name>`).

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "budgets")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub subject: String,
    pub limit_micros: Option<i64>,
    /// `day`, `week` or `month`.
    pub period: String,
    pub requests_per_minute: Option<i32>,
    pub updated_at_ms: i64,
    pub limit_tokens: Option<i64>,
    pub tokens_per_minute: Option<i64>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
