//! nm-gateway controlplane: the source of truth behind the dataplanes.
//!
//! It owns the database (SQLite embedded by default, PostgreSQL in production, both through
//! SeaORM with the same migrations) and the logic on top of it: service API keys
//! ([`keys`]), proxied-request records ([`records`]) and end-user signals ([`signals`]). It knows nothing of gRPC or HTTP: the
//! root crate adapts these calls to tonic, mapping [`Error`] to a gRPC status in one place.

pub mod analytics;
mod app;
pub mod budgets;
pub mod error;
pub mod feeds;
pub mod keys;
#[cfg(test)]
mod lock_order_tests;
pub mod records;
pub mod scratch;
pub mod signals;
mod sql;
pub mod store;
pub mod usage;

pub use app::Controlplane;
pub use budgets::Budgets;
pub use error::Error;
pub use keys::{CreatedKey, KeyCache, KeyInfo, KeySnapshot, Keys};
pub use records::{IngestOutcome, Records, RequestRecord, Usage, UsageStatus};
pub use signals::{NewSignal, Signals, Stored};
pub use store::Store;

/// Wall-clock time as Unix milliseconds, the unit every stored time uses.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
