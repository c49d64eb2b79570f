//! The one place a controlplane error becomes a gRPC status.

use nm_controlplane::Error;
use tonic::Status;

pub fn to_status(e: Error) -> Status {
    match e {
        Error::InvalidArgument(m) => Status::invalid_argument(m),
        Error::NotFound(m) => Status::not_found(m),
        Error::Database(db) => unavailable(&db),
        Error::Sqlite(db) => unavailable(&db),
        Error::Unavailable(m) => Status::unavailable(m),
        Error::Config(m) => Status::failed_precondition(m),
    }
}

/// The database's own text stays in the log: it can name tables, values and hosts.
fn unavailable(e: &dyn std::fmt::Display) -> Status {
    tracing::error!(error = %e, "database error");
    Status::unavailable("the controlplane's database is unavailable; nothing was stored")
}
