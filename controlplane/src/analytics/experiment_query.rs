//! What an experiment's evaluation reads from the database: each arm's counts
//! ([`arm_counts`]) and the guardrails' thresholds ([`history_thresholds`],
//! [`pooled_thresholds`]). Raw rows, by the experiment's index on `requests (experiment_id,
//! arm)`: an experiment's rows are a small part of an agent's, and they are read once an
//! analytics interval.
//!
//! A unit's outcome is the agent's analytics' own: the class of its last signal
//! ([`super::outcome::class_case`]); under the agent's `explicit+implicit` evidence a unit with
//! no explicit signal takes its implicit one (`continued` only when the agent counts it).

use sea_orm::{QueryResult, Statement};

use super::evidence::Evidence;
use super::experiment::{ArmCounts, Unit};
use super::outcome::class_case;
use super::query::run;
use crate::error::Result;
use crate::sql::{Sql, count};
use crate::store::Store;

/// What a guardrail's bad event is measured against (see [`super::experiment`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Thresholds {
    /// A request slower than this is slow (`p95_latency`).
    pub latency_ms: Option<u64>,
    /// A session that cost more than this is costly (`cost_per_session`).
    pub cost_micros: Option<u64>,
}

/// Requests (latency) and sessions (cost) a threshold needs to be read from history or from the
/// experiment's first units.
pub const MIN_THRESHOLD_REQUESTS: u64 = 100;
pub const MIN_THRESHOLD_SESSIONS: u64 = 30;

/// A day, for the week of history the thresholds read.
const WEEK_MS: i64 = 7 * 86_400_000;

/// A request that failed: an error status (the upstream's or the gateway's) or a body cut by
/// the upstream. A client that left is not the arm's failure (the abandonment guardrail counts
/// that).
const FAILED: &str = "(status >= 500 OR status = 429 OR error_code = 'upstream_body_error')";

/// A signal's sort key for "the last signal decides": `received_at_ms · 4 + class`, NULL for a
/// signal that does not count under `ev`, per source.
fn keys(ev: Evidence) -> String {
    let class = class_case();
    let implicit = if !ev.implicit {
        "CAST(NULL AS BIGINT)".to_owned()
    } else if ev.continued {
        format!("MAX(CASE WHEN source = 'implicit' THEN received_at_ms * 4 + ({class}) END)")
    } else {
        format!(
            "MAX(CASE WHEN source = 'implicit' AND (rule IS NULL OR rule <> 'continued') \
             THEN received_at_ms * 4 + ({class}) END)"
        )
    };
    format!(
        "COUNT(*) AS n, \
         MAX(CASE WHEN source = 'explicit' THEN received_at_ms * 4 + ({class}) END) AS ekey, \
         {implicit} AS ikey"
    )
}

/// Each arm's counts, in the order of `arms` (arms with no data get zeros).
pub fn arm_counts<'a>(
    store: &'a Store,
    experiment: &'a str,
    arms: &'a [String],
    unit: Unit,
    ev: Evidence,
    th: Thresholds,
) -> crate::BoxFuture<'a, Result<Vec<ArmCounts>>> {
    Box::pin(async move {
        let backend = store.backend();
        let mut out: Vec<ArmCounts> = arms
            .iter()
            .map(|name| ArmCounts {
                name: name.clone(),
                ..ArmCounts::default()
            })
            .collect();
        let slot = |out: &mut Vec<ArmCounts>, row: &QueryResult| -> Result<Option<usize>> {
            let arm: Option<String> = row.try_get("", "arm")?;
            Ok(arm.and_then(|a| out.iter().position(|c| c.name == a)))
        };

        // Sessions: their requests, cost and signals (the session unit's outcome).
        let latency = i64::try_from(th.latency_ms.unwrap_or(u64::MAX)).unwrap_or(i64::MAX);
        let cost = i64::try_from(th.cost_micros.unwrap_or(u64::MAX)).unwrap_or(i64::MAX);
        let mut sql = Sql::new(
            backend,
            &format!(
                "WITH sess AS (SELECT session_id, MIN(arm) AS arm, COUNT(*) AS requests, \
             SUM(CASE WHEN {FAILED} THEN 1 ELSE 0 END) AS errors, \
             SUM(CASE WHEN latency_ms > "
            ),
        );
        sql.bind(latency).push(
            " THEN 1 ELSE 0 END) AS slow, CAST(SUM(cost_micros) AS BIGINT) AS cost \
         FROM requests WHERE experiment_id = ",
        );
        sql.bind(experiment).push(&format!(
            " AND session_id IS NOT NULL GROUP BY session_id), \
         sig AS (SELECT session_id, {} FROM signals \
         WHERE session_id IN (SELECT session_id FROM sess) GROUP BY session_id) \
         SELECT sess.arm AS arm, COUNT(*) AS sessions, {} AS requests, {} AS errors, \
         {} AS slow, {} AS cost, SUM(CASE WHEN sess.cost > ",
            keys(ev),
            total("sess.requests"),
            total("sess.errors"),
            total("sess.slow"),
            total("sess.cost"),
        ));
        sql.bind(cost).push(&format!(
            " THEN 1 ELSE 0 END) AS costly, {} AS signals, \
         SUM(CASE WHEN COALESCE(sig.ekey, sig.ikey) IS NOT NULL THEN 1 ELSE 0 END) AS judged, \
         SUM(CASE WHEN COALESCE(sig.ekey, sig.ikey) % 4 = 1 THEN 1 ELSE 0 END) AS successes, \
         SUM(CASE WHEN COALESCE(sig.ekey, sig.ikey) % 4 = 2 THEN 1 ELSE 0 END) AS abandoned \
         FROM sess LEFT JOIN sig ON sig.session_id = sess.session_id GROUP BY sess.arm",
            total("sig.n")
        ));
        for row in run(store, sql.build()).await? {
            let Some(i) = slot(&mut out, &row)? else {
                continue;
            };
            let a = &mut out[i];
            a.sessions = count(&row, "sessions")?;
            a.requests = count(&row, "requests")?;
            a.errors = count(&row, "errors")?;
            a.slow = count(&row, "slow")?;
            a.cost_micros = count(&row, "cost")?;
            a.costly = count(&row, "costly")?;
            a.signals = count(&row, "signals")?;
            a.abandoned = count(&row, "abandoned")?;
            if unit == Unit::Session {
                a.judged = count(&row, "judged")?;
                a.successes = count(&row, "successes")?;
            }
        }

        // Answers named by signals: the request unit's outcome.
        if unit == Unit::Request {
            let mut sql = Sql::new(
                backend,
                &format!(
                    "WITH sig AS (SELECT request_id, {} FROM signals WHERE request_id IN \
                 (SELECT request_id FROM requests WHERE experiment_id = ",
                    keys(ev)
                ),
            );
            sql.bind(experiment).push(
                ") GROUP BY request_id) \
             SELECT r.arm AS arm, \
             SUM(CASE WHEN COALESCE(sig.ekey, sig.ikey) IS NOT NULL THEN 1 ELSE 0 END) AS judged, \
             SUM(CASE WHEN COALESCE(sig.ekey, sig.ikey) % 4 = 1 THEN 1 ELSE 0 END) AS successes \
             FROM sig JOIN requests r ON r.request_id = sig.request_id GROUP BY r.arm",
            );
            for row in run(store, sql.build()).await? {
                if let Some(i) = slot(&mut out, &row)? {
                    out[i].judged = count(&row, "judged")?;
                    out[i].successes = count(&row, "successes")?;
                }
            }
        }

        // Each arm's p95 latency: the value at rank ⌈0.95·n⌉.
        for a in &mut out {
            if a.requests == 0 {
                continue;
            }
            let mut sql = Sql::new(
                backend,
                "SELECT latency_ms FROM requests WHERE experiment_id = ",
            );
            sql.bind(experiment)
                .push(" AND arm = ")
                .bind(a.name.as_str());
            sql.push(" ORDER BY latency_ms LIMIT 1 OFFSET ")
                .bind(rank_95(a.requests));
            if let Some(row) = run(store, sql.build()).await?.first() {
                a.p95_latency_ms = Some(count(row, "latency_ms")?);
            }
        }
        Ok(out)
    })
}

/// `SUM(col)` as a 64-bit integer, 0 over no rows (PostgreSQL sums `BIGINT`s as `NUMERIC`).
fn total(col: &str) -> String {
    format!("CAST(COALESCE(SUM({col}), 0) AS BIGINT)")
}

/// The 0-based offset of the 95th percentile among `n` sorted values.
fn rank_95(n: u64) -> i64 {
    i64::try_from((n * 95).div_ceil(100).saturating_sub(1)).unwrap_or(i64::MAX)
}

/// The thresholds from the agent's week before `before_ms` (its env's, when `env` is set): its
/// requests' p95 latency and its sessions' median cost, each `None` without enough history.
pub fn history_thresholds<'a>(
    store: &'a Store,
    agent: &'a str,
    env: Option<&'a str>,
    before_ms: i64,
) -> crate::BoxFuture<'a, Result<Thresholds>> {
    Box::pin(async move {
        let filter = |sql: &mut Sql| {
            sql.push(" FROM requests WHERE agent = ").bind(agent);
            if let Some(env) = env {
                sql.push(" AND env = ").bind(env);
            }
            sql.push(" AND started_at_ms >= ")
                .bind(before_ms - WEEK_MS)
                .push(" AND started_at_ms < ")
                .bind(before_ms);
        };
        let backend = store.backend();
        let mut latency = Sql::new(backend, "SELECT latency_ms AS v");
        filter(&mut latency);
        let mut cost = Sql::new(backend, "SELECT CAST(SUM(cost_micros) AS BIGINT) AS v");
        filter(&mut cost);
        cost.push(" AND session_id IS NOT NULL GROUP BY session_id");
        thresholds(store, latency, cost).await
    })
}

/// The thresholds from the experiment's own units, all arms pooled, once it has enough of them
/// (each `None` before).
pub fn pooled_thresholds<'a>(
    store: &'a Store,
    experiment: &'a str,
) -> crate::BoxFuture<'a, Result<Thresholds>> {
    Box::pin(async move {
        let backend = store.backend();
        let mut latency = Sql::new(
            backend,
            "SELECT latency_ms AS v FROM requests WHERE experiment_id = ",
        );
        latency.bind(experiment);
        let mut cost = Sql::new(
            backend,
            "SELECT CAST(SUM(cost_micros) AS BIGINT) AS v FROM requests WHERE experiment_id = ",
        );
        cost.bind(experiment)
            .push(" AND session_id IS NOT NULL GROUP BY session_id");
        thresholds(store, latency, cost).await
    })
}

/// The p95 of the values `latency` selects and the median of those `cost` selects (as `v`),
/// each when there are enough of them.
async fn thresholds(store: &Store, latency: Sql, cost: Sql) -> Result<Thresholds> {
    Ok(Thresholds {
        latency_ms: quantile(store, latency, MIN_THRESHOLD_REQUESTS, rank_95).await?,
        cost_micros: quantile(store, cost, MIN_THRESHOLD_SESSIONS, |n| {
            i64::try_from(n.saturating_sub(1) / 2).unwrap_or(i64::MAX)
        })
        .await?,
    })
}

/// The value at `rank(n)` among the non-NULL `v`s `inner` selects, when there are at least
/// `min` of them.
async fn quantile(
    store: &Store,
    inner: Sql,
    min: u64,
    rank: impl Fn(u64) -> i64,
) -> Result<Option<u64>> {
    let backend = store.backend();
    let inner = inner.build();
    let values = inner.values.map(|v| v.0).unwrap_or_default();
    // The wrapped statement adds no placeholder: the inner one's numbering holds.
    let wrap = |text: String| Statement::from_sql_and_values(backend, text, values.clone());
    let n = run(
        store,
        wrap(format!("SELECT COUNT(v) AS n FROM ({}) t", inner.sql)),
    )
    .await?;
    let n = match n.first() {
        Some(row) => count(row, "n")?,
        None => 0,
    };
    if n < min {
        return Ok(None);
    }
    let at = wrap(format!(
        "SELECT v FROM ({}) t WHERE v IS NOT NULL ORDER BY v LIMIT 1 OFFSET {}",
        inner.sql,
        rank(n)
    ));
    match run(store, at).await?.first() {
        Some(row) => Ok(Some(count(row, "v")?)),
        None => Ok(None),
    }
}
