//! Throwaway PostgreSQL databases for tests and benchmarks: created under a random name on a
//! server, dropped (with their connections) at the end. `.ci/run` clears any that a failed test
//! or an interrupted benchmark left behind (`nm_test_*`, `nm_*_bench_*`).

use sea_orm::{ConnectionTrait, Database};

use crate::error::{Error, Result};

/// The PostgreSQL server the tests use (a URL naming any database on it); unset, the
/// PostgreSQL variants are skipped.
pub const TEST_POSTGRES_ENV: &str = "NM_TEST_POSTGRES_URL";

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
    pub async fn create(server: &str, prefix: &str) -> Result<Self> {
        let name = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
        let (base, _) = server
            .rsplit_once('/')
            .ok_or_else(|| Error::Config("the PostgreSQL URL needs a /DATABASE part".into()))?;
        let admin = Database::connect(server).await?;
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

    /// A fresh `nm_test_*` database on the server of [`TEST_POSTGRES_ENV`], or `None` (with a
    /// notice) when it is unset. Panics when the server cannot make one: a test should fail then.
    pub async fn for_tests() -> Option<Self> {
        let Ok(server) = std::env::var(TEST_POSTGRES_ENV) else {
            eprintln!(
                "SKIPPED PostgreSQL variant: set {TEST_POSTGRES_ENV}=postgres://USER@HOST:PORT/DB to run it"
            );
            return None;
        };
        Some(
            Self::create(&server, "nm_test")
                .await
                .unwrap_or_else(|e| panic!("{TEST_POSTGRES_ENV}={server}: {e}")),
        )
    }

    pub async fn drop_it(self) -> Result<()> {
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

/// Drops a database made by [`ScratchPg::for_tests`], given its URL (best effort: a failed test
/// leaves its database behind for inspection, and `.ci/run` clears leftovers).
pub async fn drop_test_db(url: &str) {
    let (Ok(server), Some((_, name))) = (std::env::var(TEST_POSTGRES_ENV), url.rsplit_once('/'))
    else {
        return;
    };
    if !name.starts_with("nm_test_") {
        return;
    }
    let _ = ScratchPg {
        server,
        name: name.to_owned(),
        url: url.to_owned(),
    }
    .drop_it()
    .await;
}
