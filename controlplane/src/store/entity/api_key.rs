//! `api_keys`: API keys, stored as SHA-256 hashes only (the current secret's, and while a
//! rotation's grace period runs, the previous one's), with their role, scope, labels and expiry.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "api_keys")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub name: String,
    #[sea_orm(unique)]
    pub hash_hex: String,
    pub display_prefix: String,
    /// `role == "admin"`, kept for the binaries that predate roles.
    pub admin: bool,
    pub created_at_ms: i64,
    pub revoked_at_ms: Option<i64>,
    /// `admin`, `viewer` or `service`.
    pub role: String,
    /// `nm_types::access::Scope` as JSON; NULL: unrestricted.
    pub scope_json: Option<String>,
    /// Labels (`team=search`) as a JSON object of strings; NULL: none.
    pub labels_json: Option<String>,
    pub expires_at_ms: Option<i64>,
    /// The secret a rotation replaced, accepted until `previous_valid_until_ms`.
    pub previous_hash_hex: Option<String>,
    pub previous_valid_until_ms: Option<i64>,
    pub rotated_at_ms: Option<i64>,
    /// Start of the key's latest recorded request, as of the last flush (see `Keys::note_used`).
    pub last_used_at_ms: Option<i64>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
