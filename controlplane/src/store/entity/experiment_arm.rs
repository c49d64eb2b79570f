//! `experiment_arms`: an experiment's arms in the order they were given (the first is the one
//! clients are expected to call: arms on another provider need an operator credential).

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "experiment_arms")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub experiment_id: String,
    /// 0, 1, ...: the order given at creation.
    #[sea_orm(primary_key, auto_increment = false)]
    pub position: i32,
    pub name: String,
    /// A provider's canonical name.
    pub provider: String,
    pub model: String,
    /// 1 to 10^6.
    pub weight: i64,
    /// Taken out by a rollback: no session goes to it any more.
    pub rolled_back: bool,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
