//! `budgets`: the default end-user budget (subject `default`) and per-user overrides (subject
//! `user:<id>`).

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "budgets")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub subject: String,
    pub limit_micros: Option<i64>,
    /// `day` or `month`.
    pub period: String,
    pub requests_per_minute: Option<i32>,
    pub updated_at_ms: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
