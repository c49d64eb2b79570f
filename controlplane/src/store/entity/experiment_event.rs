//! `experiment_events`: an experiment's history, written in the transaction of each change:
//! when, what (`created`, `paused`, `resumed`, `stopped`, `decided`, `harm`, `inconclusive`,
//! `promoted`, `rolled_back`), the arm concerned, who (a key id or `system`) and why.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "experiment_events")]
pub struct Model {
    /// `xev_<uuid v7>`: ordered by time within a millisecond too.
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub experiment_id: String,
    pub at_ms: i64,
    pub kind: String,
    pub arm: Option<String>,
    /// The acting key's id, or `system`.
    pub actor: String,
    pub detail: String,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
