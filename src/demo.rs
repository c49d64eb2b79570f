//! `nm-gateway demo`: fills a fresh database with realistic synthetic traffic and signals for a
//! few agents (seeded, deterministic; see [`nm_controlplane::analytics::synthetic`]), computes
//! their analytics, and says how to look at them, so a new user sees counts and recommendations
//! at once.

use std::io::Write;

use anyhow::{Context, bail};
use nm_controlplane::analytics::synthetic::{self, demo_specs};
use nm_controlplane::analytics::{Analytics, Status};
use nm_controlplane::{Keys, Store, now_ms};
use sea_orm::ConnectionTrait;

use crate::config::Settings;

/// `nm-gateway demo` options.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Database URL to fill (env NM_DATABASE_URL; default the embedded SQLite file). It must
    /// hold no requests and no signals yet.
    #[arg(long)]
    pub database_url: Option<String>,
    /// Seed of the synthetic traffic: the same seed gives the same data.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

/// Fills `settings.database_url` and prints what to run next.
pub async fn run(settings: &Settings, seed: u64, out: &mut impl Write) -> anyhow::Result<()> {
    let url = &settings.database_url;
    let store = Store::connect(url)
        .await
        .with_context(|| format!("database {}", nm_controlplane::store::redact_url(url)))?;
    let db = store.conn();
    let used = db
        .query_one_raw(sea_orm::Statement::from_string(
            db.get_database_backend(),
            "SELECT (SELECT COUNT(*) FROM requests) + (SELECT COUNT(*) FROM signals) AS n",
        ))
        .await?
        .map(|r| r.try_get::<i64>("", "n"))
        .transpose()?
        .unwrap_or(0);
    if used > 0 {
        bail!(crate::cli::UsageError(format!(
            "the database {} already holds requests or signals; point NM_DATABASE_URL (or --database-url) at a fresh one",
            nm_controlplane::store::redact_url(url)
        )));
    }
    let keys = Keys::load(store.clone()).await?;
    let admin = keys.ensure_admin(settings.bootstrap_key.as_deref()).await?;

    let specs = demo_specs();
    writeln!(
        out,
        "generating synthetic traffic for {} agents (seed {seed})...",
        specs.len()
    )?;
    let written = synthetic::generate(&store, &specs, seed, now_ms(), 2_000).await?;
    writeln!(
        out,
        "stored {} sessions, {} requests, {} signals",
        written.sessions, written.requests, written.signals
    )?;
    let results = Analytics::new(store.clone()).recompute_all().await?;
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|a| {
            vec![
                a.agent.clone(),
                a.progress.signals.to_string(),
                match a.status {
                    Status::Ready => "ready".to_owned(),
                    Status::Collecting => format!("collecting ({} to go)", a.progress.remaining),
                },
                a.recommendations.len().to_string(),
            ]
        })
        .collect();
    crate::cli::write_table(
        out,
        &["AGENT", "SIGNALS", "STATUS", "RECOMMENDATIONS"],
        &rows,
    )?;
    store.close().await?;

    writeln!(out)?;
    if let Some(key) = admin {
        writeln!(
            out,
            "An admin key was created for this database (shown only now):\n\n    {}\n",
            key.secret
        )?;
        writeln!(
            out,
            "Next:\n  nm-gateway serve      # same NM_DATABASE_URL\n  NM_ADMIN_KEY={} nm-gateway agents recommend support-assistant",
            key.secret
        )?;
    } else {
        writeln!(
            out,
            "Next:\n  nm-gateway serve      # same NM_DATABASE_URL\n  NM_ADMIN_KEY=<your admin key> nm-gateway agents recommend support-assistant"
        )?;
    }
    writeln!(
        out,
        "  (also: doc-search, code-review, and email-drafter, which is still collecting)"
    )?;
    Ok(())
}
