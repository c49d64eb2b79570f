//! nm-gateway controlplane: the source of truth behind the dataplanes.
//!
//! It owns the database (SQLite embedded by default, PostgreSQL in production, both through
//! SeaORM with the same migrations) and the logic on top of it: API keys
//! and their roles and scopes ([`keys`]), the audit trail of admin changes ([`audit`]), experiments and the live set dataplanes apply ([`experiments`]), proxied-request records ([`records`]) and end-user signals ([`signals`]). It
//! owns the rules every record and signal from a dataplane passes ([`link`]), whatever adapter
//! brought it. It knows nothing of gRPC or HTTP: the root crate adapts these calls to tonic,
//! mapping [`Error`] to a gRPC status in one place.

#[forbid(unsafe_code)]
pub mod agents;
#[forbid(unsafe_code)]
pub mod alerts;
#[forbid(unsafe_code)]
pub mod analytics;
#[forbid(unsafe_code)]
mod app;
#[forbid(unsafe_code)]
pub mod audit;
#[forbid(unsafe_code)]
pub mod budgets;
#[forbid(unsafe_code)]
pub mod error;
#[forbid(unsafe_code)]
pub mod experiments;
#[forbid(unsafe_code)]
pub mod export;
#[forbid(unsafe_code)]
pub mod feeds;
#[forbid(unsafe_code)]
pub mod forget;
#[forbid(unsafe_code)]
pub mod keys;
#[forbid(unsafe_code)]
pub mod link;
#[cfg(test)]
mod lock_order_tests;
#[forbid(unsafe_code)]
pub mod otel;
#[forbid(unsafe_code)]
pub mod partitions;
#[forbid(unsafe_code)]
pub mod records;
#[forbid(unsafe_code)]
pub mod retention;
#[forbid(unsafe_code)]
#[cfg(any(test, feature = "test-support"))]
pub mod scratch;
#[forbid(unsafe_code)]
pub mod signals;
#[forbid(unsafe_code)]
mod sql;
/// The one module allowed `unsafe` (in its `ffi` submodule only).
pub mod store;
#[forbid(unsafe_code)]
pub mod usage;

pub use agents::Agents;
pub use alerts::Alerts;
pub use app::Controlplane;
pub use audit::Audit;
pub use budgets::Budgets;
pub use error::Error;
pub use experiments::Experiments;
pub use keys::{CreatedKey, KeyCache, KeyChange, KeyInfo, KeySnapshot, Keys, NewKey};
pub use link::{MAX_INGEST_BATCH, SignalOutcome};
pub use nm_types::signal::Signal;
pub use records::{IngestOutcome, Records, RequestRecord, Usage, UsageStatus};
pub use signals::{Signals, Stored};
pub use store::Store;

/// What the public operations the root crate awaits return (admin calls, reports, start-up; never
/// a request's path): a boxed future. An `async fn`'s state machine is compiled in every crate
/// that polls it, so the root crate compiled these bodies, and the sea-orm and sqlx code under
/// them, a second time; behind a `dyn Future` they are compiled once, here (bench/HISTORY.md,
/// "Session 26").
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Wall-clock time as Unix milliseconds, the unit every stored time uses.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
