//! The controlplane's error type. The root maps it to gRPC status codes in one `From` impl.

use sea_orm::DbErr;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The database refused or failed a statement, or could not be reached.
    #[error("database error: {0}")]
    Database(#[from] DbErr),
    /// A statement run through rusqlite on a SQLite write transaction failed.
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The caller sent a value that breaks a rule; the message names the field and the rule.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A signal named a session and a request the database knows under another session (the
    /// message names both rules, never the values).
    #[error("session mismatch: {0}")]
    SessionMismatch(String),
    /// The call is valid but the state of what it names does not allow it now (an experiment
    /// resumed that is not paused, a second running experiment on one agent); the message says
    /// which rule.
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// The named thing does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// Storage is not available right now (the write was not done); retrying later may work.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The database URL or a startup setting is unusable.
    #[error("configuration: {0}")]
    Config(String),
    /// Writing an export file failed (a file system or encoding error; the message says which).
    #[error("export: {0}")]
    Export(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
