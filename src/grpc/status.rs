//! The one place a controlplane error becomes a gRPC status.

use nm_controlplane::Error;
use nm_types::throttle::Throttle;
use tonic::Status;
use tonic::metadata::MetadataValue;

/// Metadata naming the contract code of a refusal the gRPC code alone does not tell
/// (`session_mismatch`), read back by the link's client.
pub const ERROR_CODE_METADATA: &str = "nm-error";

pub fn to_status(e: Error) -> Status {
    match e {
        Error::InvalidArgument(m) => Status::invalid_argument(m),
        Error::SessionMismatch(m) => {
            let mut s = Status::failed_precondition(m);
            s.metadata_mut().insert(
                ERROR_CODE_METADATA,
                MetadataValue::from_static("session_mismatch"),
            );
            s
        }
        Error::NotFound(m) => Status::not_found(m),
        Error::FailedPrecondition(m) => Status::failed_precondition(m),
        Error::Database(db) => unavailable(&db),
        Error::Sqlite(db) => unavailable(&db),
        Error::Unavailable(m) => Status::unavailable(m),
        Error::Config(m) => Status::failed_precondition(m),
        Error::Export(m) => {
            tracing::error!(error = %m, "export failed");
            Status::internal("the export could not be written")
        }
    }
}

/// The database's own text stays in the log: it can name tables, values and hosts. At most a
/// line a second (with the count left out): an outage fails every call.
fn unavailable(e: &dyn std::fmt::Display) -> Status {
    static LOGGED: Throttle = Throttle::new(std::time::Duration::from_secs(1));
    if let Some(suppressed) = LOGGED.allow() {
        tracing::error!(error = %e, suppressed, "database error");
    }
    Status::unavailable("the controlplane's database is unavailable; nothing was stored")
}
