//! `analytics_results`: the latest analytics computed for each agent (see
//! [`crate::analytics`]), stored whole as JSON so a read is one primary-key lookup.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "analytics_results")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub agent: String,
    pub computed_at_ms: i64,
    /// `collecting` or `ready`.
    pub status: String,
    /// The [`crate::analytics::AgentAnalytics`] as JSON.
    pub report: String,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
