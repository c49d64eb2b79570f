//! SeaORM entities, one module per table (see `migration.rs` for the schema).

pub mod analytics_result;
pub mod api_key;
pub mod audit_event;
pub mod budget;
pub mod budget_spend;
pub mod experiment;
pub mod experiment_arm;
pub mod experiment_event;
pub mod request;
pub mod session;
pub mod signal;
pub mod user_spend;
