//! SeaORM entities, one module per table (see `migration.rs` for the schema).

pub mod api_key;
pub mod request;
pub mod session;
pub mod signal;
