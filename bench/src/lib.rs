//! What the benchmark programs share: the database flags of `nm-usage-bench` and
//! `nm-analytics-bench`, and their throwaway PostgreSQL database ([`ScratchPg`], the tests' own).

use anyhow::Context;
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

impl DatabaseArgs {
    /// A fresh `<prefix>_<random>` database on `--postgres`, or `None` with `--no-postgres`.
    pub async fn scratch_pg(&self, prefix: &str) -> anyhow::Result<Option<ScratchPg>> {
        if self.no_postgres {
            return Ok(None);
        }
        let pg = ScratchPg::create(&self.postgres, prefix)
            .await
            .with_context(|| format!("{} (--no-postgres to skip)", self.postgres))?;
        Ok(Some(pg))
    }
}
