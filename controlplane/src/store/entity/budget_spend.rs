//! `budget_spend`: each budget scope's known spend, tokens and requests per UTC day (days since
//! the Unix epoch), kept in the same transaction as the records it sums. Budgets read it; weeks
//! and months are ranges of days. Scopes: `user`, `key`, `label` (`name=value`), `agent`,
//! `model`, `env`.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "budget_spend")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub scope_kind: String,
    #[sea_orm(primary_key, auto_increment = false)]
    pub scope_value: String,
    #[sea_orm(primary_key, auto_increment = false)]
    pub day: i64,
    pub cost_micros: i64,
    pub tokens: i64,
    pub requests: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
