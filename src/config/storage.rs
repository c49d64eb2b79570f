//! Storage and records: the controlplane's database and analytics schedule, and how a
//! dataplane holds request records until the controlplane has them.

use std::path::PathBuf;
use std::time::Duration;

use nm_dataplane::journal::Durability;

use super::decl::{Chart, Default, Flag, Group, Kind, Lit, Raw, declare};
use super::{ConfigError, invalid, parse};

declare! { Group::Storage;
    /// `sqlite://PATH?mode=rwc` or `postgres://...`
    DATABASE_URL: String => database_url, {
        env: "NM_DATABASE_URL",
        flag: Some(Flag { long: "database-url", get: |f| f.database_url.as_deref() }),
        file: Some(("database_url", Kind::Str)),
        default: Default::Is(Lit::Str("sqlite://./nm-data/nm-gateway.db?mode=rwc")),
        chart: Chart::Template,
    };
    /// how often the controlplane recomputes every agent's analytics, in seconds; `0`: only on demand
    ANALYTICS_INTERVAL: Option<Duration> => analytics_interval, {
        env: "NM_ANALYTICS_INTERVAL_SECS",
        file: Some(("analytics_interval_secs", Kind::Int)),
        default: Default::Is(Lit::Int(600)),
        chart: Chart::Value("analyticsIntervalSecs"),
    };
    /// seconds before an alert delivery that failed is tried again (doubling after each failure, at most 15 minutes apart; a delivery is tried for 65 minutes)
    ALERT_RETRY: Duration => alert_retry, {
        env: "NM_ALERT_RETRY_SECS",
        file: Some(("alert_retry_secs", Kind::Int)),
        default: Default::Is(Lit::Int(5)),
    };
    /// request records held in memory on their way to the controlplane (beyond it, dropped and counted)
    RECORD_QUEUE: usize => record_queue, {
        env: "NM_RECORD_QUEUE",
        file: Some(("record_queue", Kind::Int)),
        default: Default::Is(Lit::Int(65_536)),
        chart: Chart::Value("recordQueue"),
    };
    /// where a dataplane spools records while its controlplane is unreachable
    SPOOL_DIR: PathBuf => parse::path, {
        env: "NM_SPOOL_DIR",
        file: Some(("spool_dir", Kind::Str)),
        default: Default::Is(Lit::Str("./nm-data/spool")),
        chart: Chart::Template,
    };
    /// spool cap, at least 1 MiB; beyond it the oldest records are dropped, logged and counted
    SPOOL_MAX_BYTES: u64 => spool_max_bytes, {
        env: "NM_SPOOL_MAX_BYTES",
        file: Some(("spool_max_bytes", Kind::Int)),
        default: Default::Is(Lit::Int(256 * 1024 * 1024)),
        chart: Chart::Value("spoolMaxBytes"),
    };
    /// `memory`: a record waits in memory until the controlplane has it or it is spooled (a crash loses the last moments' records, counted at the next start); `spool`: each record is journaled on disk (fsynced, group commit) before its answer's end reaches the client, so a crash loses none (costs an fsync's latency at each answer's end)
    RECORD_DURABILITY: Durability => record_durability, {
        env: "NM_RECORD_DURABILITY",
        file: Some(("record_durability", Kind::Str)),
        default: Default::Is(Lit::Str("memory")),
    };
    /// how long request records are kept, as `30s`, `12h`, `90d`; older ones are deleted in the background, their usage kept by day for the reports (docs/data-lifecycle.md); unset: kept forever
    RETENTION_RECORDS: Duration => retention, {
        env: "NM_RETENTION_RECORDS",
        file: Some(("retention_records", Kind::Str)),
    };
    /// how long signals are kept, as `30s`, `12h`, `90d`; older ones are deleted in the background, the analytics keep each session's rollup (docs/data-lifecycle.md); unset: kept forever
    RETENTION_SIGNALS: Duration => retention, {
        env: "NM_RETENTION_SIGNALS",
        file: Some(("retention_signals", Kind::Str)),
    };
}

/// A duration as `30s`, `12h`, `90d`, `1h30m`, of at least one second.
fn retention(key: &'static str, raw: Raw<'_>) -> Result<Duration, ConfigError> {
    let text = parse::text(key, raw)?;
    let d = nm_types::duration::parse(text.trim()).map_err(|e| invalid(key, e.to_string()))?;
    if d < Duration::from_secs(1) {
        return Err(invalid(key, "must be at least 1s"));
    }
    Ok(d)
}

fn database_url(key: &'static str, raw: Raw<'_>) -> Result<String, ConfigError> {
    let url = parse::text(key, raw)?;
    if !["sqlite:", "postgres://", "postgresql://"]
        .iter()
        .any(|p| url.starts_with(p))
    {
        return Err(invalid(key, "must start with sqlite:// or postgres://"));
    }
    Ok(url)
}

fn alert_retry(key: &'static str, raw: Raw<'_>) -> Result<Duration, ConfigError> {
    match parse::whole(key, raw)? {
        secs @ 1..=3600 => Ok(Duration::from_secs(secs)),
        _ => Err(invalid(key, "must be from 1 to 3600 seconds")),
    }
}

fn analytics_interval(key: &'static str, raw: Raw<'_>) -> Result<Option<Duration>, ConfigError> {
    let secs = parse::whole(key, raw)?;
    Ok((secs > 0).then(|| Duration::from_secs(secs)))
}

/// At least one (0 is taken as 1).
fn record_queue(key: &'static str, raw: Raw<'_>) -> Result<usize, ConfigError> {
    let n = parse::whole(key, raw)?;
    Ok(usize::try_from(n).unwrap_or(usize::MAX).max(1))
}

fn spool_max_bytes(key: &'static str, raw: Raw<'_>) -> Result<u64, ConfigError> {
    let n = parse::whole(key, raw)?;
    if n < 1024 * 1024 {
        return Err(invalid(key, "must be at least 1048576 (1 MiB)"));
    }
    Ok(n)
}

fn record_durability(key: &'static str, raw: Raw<'_>) -> Result<Durability, ConfigError> {
    let v = parse::text(key, raw)?;
    Durability::parse(v.trim()).ok_or_else(|| {
        invalid(
            key,
            format!("is {v:?}; use `memory` (the default) or `spool`"),
        )
    })
}
