//! `audit_events`: every admin change, written in the transaction of the change itself: who
//! (the acting key's id), when, what (`action`, `target`) and the state before and after as
//! JSON. Never a secret or a key hash.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "audit_events")]
pub struct Model {
    /// `aud_<uuid v7>`.
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub at_ms: i64,
    /// The acting key's id, or `system` for what the controlplane did by itself (the
    /// bootstrap key).
    pub actor_key_id: String,
    /// `key.create`, `key.revoke`, `key.rotate`, `key.update`, `budget.set`, `budget.delete`, ...
    pub action: String,
    /// What was changed: a key id, `budget:default`, `budget:user:<id>`, ...
    pub target: String,
    pub before_json: Option<String>,
    pub after_json: Option<String>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
