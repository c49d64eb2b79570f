//! The dataplane's tower layers, one per file. `stack.rs` puts them in order.

pub mod auth;
pub mod request_id;
pub mod rescue;
pub mod trace;

pub use auth::AuthLayer;
pub use request_id::{RequestId, RequestIdLayer};
pub use rescue::RescueLayer;
pub use trace::TraceLayer;
