//! A throwaway PostgreSQL database for the benchmarks: created under a random name on a server,
//! dropped (with its connections) at the end.

use anyhow::Context;
use clap::Args;
use sea_orm::{ConnectionTrait, Database};

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

/// A database of our own on a PostgreSQL server, dropped by [`ScratchPg::drop_it`].
#[derive(Debug)]
pub struct ScratchPg {
    server: String,
    pub name: String,
    /// The URL of the new database.
    pub url: String,
}

impl ScratchPg {
    /// Creates `<prefix>_<random>` on the server of `server` (a URL naming any database there).
    pub async fn create(server: &str, prefix: &str) -> anyhow::Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() ^ (d.as_secs() as u32));
        let name = format!(
            "{prefix}_{:08x}{:06x}",
            nanos,
            std::process::id() & 0xff_ffff
        );
        let (base, _) = server
            .rsplit_once('/')
            .context("the PostgreSQL URL needs a /DATABASE part")?;
        let admin = Database::connect(server)
            .await
            .with_context(|| format!("connecting to {server} (--no-postgres to skip)"))?;
        admin
            .execute_unprepared(&format!("CREATE DATABASE {name}"))
            .await?;
        admin.close().await?;
        Ok(Self {
            server: server.to_owned(),
            url: format!("{base}/{name}"),
            name,
        })
    }

    pub async fn drop_it(self) -> anyhow::Result<()> {
        let admin = Database::connect(&self.server).await?;
        admin
            .execute_unprepared(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .await?;
        admin.close().await?;
        Ok(())
    }
}
