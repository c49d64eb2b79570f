//! The benchmarks' database flags, and their throwaway PostgreSQL database
//! ([`ScratchPg`], shared with the tests).

use clap::Args;

/// Which databases a benchmark runs on.
#[derive(Debug, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL server URL; a fresh database is created on it and dropped at the end.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    pub postgres: String,
    /// Skip PostgreSQL.
    #[arg(long)]
    pub no_postgres: bool,
    /// Skip SQLite.
    #[arg(long)]
    pub no_sqlite: bool,
}

pub use nm_controlplane::scratch::ScratchPg;
