//! The SQL of analytics: one statement per question, computed by the database (SQLite or
//! PostgreSQL), never by loading signals into memory.
//!
//! The answers are defined over a per-session table: the agent's signals in the window
//! `[since, until)` and its requests from a day before it (for answers that came shortly before
//! their signals), grouped by session:
//!
//! - the outcome model of [`super::outcome`] runs in SQL: each signal gets its class (1 success,
//!   2 abandoned, 0 other failure) from the same rules as [`super::outcome::is_success`], and the
//!   session's class is the class of its **last** signal, found without a window function as
//!   `MAX(received_at_ms · 4 + class) % 4` (the latest signal wins; among signals of the same
//!   millisecond the higher class). Regenerations and heavy edits are summed;
//! - from the requests: the model and provider (kept only when every request of the session used
//!   the same one), env, end user, known cost, slowest time to first byte, number of requests.
//!   A session with exactly one request is that request's outcome: the signals tie to it.
//!   A "session" here is an outcome *unit* ([`super::rollup`]): a session, or an answer that
//!   signals name (`request_id`), which has exactly that request's model.
//!
//! Grouping every signal and request of a large agent by session is too slow (one agent with a
//! million of each: ~10 s), so the statements read that table mostly from `session_rollups`
//! ([`super::rollup`]), which holds each session's aggregates already, kept by the ingest:
//!
//! - a session whose rows all lie inside the window (signals in `[since, until)`, requests in
//!   `[since − REQUEST_LOOKBACK_MS, until)`) is its rollup row as it is ([`push_inside`]);
//! - the few sessions that straddle an edge of the window are grouped from their rows in the
//!   window, found by session id, exactly as before the rollup ([`push_edge_sessions`], the CTE
//!   `s`); the tests compare both against the statement that grouped every row.
//!
//! The groups asked for are `GROUP BY`s over both parts, whose measures are sums and add up.
//! Over the rollup, SQLite (which has no hash aggregate: a `GROUP BY` is a sort) reads sessions
//! through covering indexes already in the order of the groups and of the sessions' measures, so
//! alike sessions fold into one group as they are read, and groups them again by key
//! ([`VECTOR`]); PostgreSQL hashes the same statement.

use std::collections::BTreeMap;

use sea_orm::{ConnectionTrait, DatabaseBackend, QueryResult, Statement};

use super::evidence::{Evidence, IMPLICIT_INDEX, IMPLICIT_ROWS};
use super::report::{OutcomeRow, Window};
use super::rollup::{self, ttfb_band};
use crate::error::Result;
use crate::sql::{Sql, count};
use crate::store::Store;

/// Requests are read from this long before the window, so a session whose answer came shortly
/// before its first signal in the window still has its model and cost.
pub const REQUEST_LOOKBACK_MS: i64 = 86_400_000;

/// What outcome rates are grouped by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dimension {
    /// The model as answered, else as requested; none when a session used several.
    Model,
    Provider,
    Env,
    /// UTC week (Monday to Sunday) of the session's last signal, as the Monday's date.
    Week,
    User,
}

impl Dimension {
    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::Model => "model",
            Dimension::Provider => "provider",
            Dimension::Env => "env",
            Dimension::Week => "week",
            Dimension::User => "user",
        }
    }

    /// The dimension as a text expression over `s`: constants of ours, never user input.
    fn expr(self) -> &'static str {
        match self {
            Dimension::Model => "model",
            Dimension::Provider => "provider",
            Dimension::Env => "env",
            // Unix day 0 is a Thursday: shifting by 3 days makes weeks start on Monday.
            Dimension::Week => "CAST((last_ms + 259200000) / 604800000 AS TEXT)",
            Dimension::User => "user_id",
        }
    }

    /// The same expression over a `session_rollups` row (or a group of them, [`VECTOR`]).
    fn rollup_expr(self) -> &'static str {
        match self {
            Dimension::Model => "CASE WHEN model_min = model_max THEN model_min END",
            Dimension::Provider => "CASE WHEN provider_min = provider_max THEN provider_min END",
            Dimension::Env => "env",
            Dimension::Week => "CAST(week AS TEXT)",
            Dimension::User => "user_id",
        }
    }

    /// The stored key as shown: the Monday's date for a week.
    fn show(self, raw: Option<String>) -> Option<String> {
        match self {
            Dimension::Week => raw.and_then(|w| w.parse::<i64>().ok()).map(|week| {
                let (y, m, d) = nm_types::budget::civil_from_day(week * 7 - 3);
                format!("{y:04}-{m:02}-{d:02}")
            }),
            _ => raw,
        }
    }
}

/// Measures over the sessions of `s` that have signals (`s` also holds the agent's sessions
/// without any, for their cost); `cls` is the session's outcome class.
fn measures(cls: &str) -> String {
    format!(
        "CAST(COALESCE(SUM(CASE WHEN signals > 0 THEN 1 ELSE 0 END), 0) AS BIGINT) AS sessions, \
         CAST(COALESCE(SUM(signals), 0) AS BIGINT) AS signals, \
         CAST(COALESCE(SUM(CASE WHEN {cls} = 1 THEN 1 ELSE 0 END), 0) AS BIGINT) AS successes, \
         CAST(COALESCE(SUM(CASE WHEN {cls} = 2 THEN 1 ELSE 0 END), 0) AS BIGINT) AS abandoned, \
         CAST(COALESCE(SUM(CASE WHEN regens > 0 THEN 1 ELSE 0 END), 0) AS BIGINT) AS regenerated, \
         CAST(COALESCE(SUM(CASE WHEN heavy > 0 THEN 1 ELSE 0 END), 0) AS BIGINT) AS heavily_edited, \
         CAST(COALESCE(SUM(regens), 0) AS BIGINT) AS regenerations, \
         CAST(COALESCE(SUM(CASE WHEN signals > 0 THEN cost ELSE 0 END), 0) AS BIGINT) AS cost_micros, \
         CAST(COALESCE(SUM(CASE WHEN signals > 0 THEN requests ELSE 0 END), 0) AS BIGINT) AS requests, \
         CAST(COALESCE(SUM(cost), 0) AS BIGINT) AS all_cost"
    )
}

/// [`measures`] over `session_rollups` rows, in fewer operations per row (SQLite reads every
/// row in its VM: a comparison summed directly costs less than a `CASE`); with `signals_only`
/// the rows are known to have signals (`WHERE signals > 0`).
fn rollup_measures(backend: DatabaseBackend, signals_only: bool) -> String {
    let flag = |cond: &str| match backend {
        DatabaseBackend::Sqlite => format!("({cond})"),
        _ => format!("CASE WHEN {cond} THEN 1 ELSE 0 END"),
    };
    let (sessions, cost, requests) = if signals_only {
        (
            "COUNT(*)".to_owned(),
            "SUM(cost)".to_owned(),
            "SUM(requests)".to_owned(),
        )
    } else {
        (
            format!("SUM({})", flag("signals > 0")),
            "SUM(CASE WHEN signals > 0 THEN cost ELSE 0 END)".to_owned(),
            "SUM(CASE WHEN signals > 0 THEN requests ELSE 0 END)".to_owned(),
        )
    };
    let cols = [
        sessions,
        "SUM(signals)".to_owned(),
        format!("SUM({})", flag("cls = 1")),
        format!("SUM({})", flag("cls = 2")),
        format!("SUM({})", flag("regens > 0")),
        format!("SUM({})", flag("heavy > 0")),
        "SUM(regens)".to_owned(),
        cost,
        requests,
        "SUM(cost)".to_owned(),
    ];
    cols.iter()
        .zip(MEASURE_NAMES)
        .map(|(c, name)| format!("CAST(COALESCE({c}, 0) AS BIGINT) AS {name}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// How [`push_grouped`] groups the rollup rows inside the window.
struct Grouping<'a> {
    /// The raw columns `select` and `by` read.
    columns: &'a str,
    /// SQLite's first grouping: an index's order, then the measures of [`VECTOR`].
    order: &'a str,
    /// The index SQLite reads in that order (named: without statistics its planner may
    /// otherwise take the primary key and sort).
    index: &'a str,
    /// The groups (raw columns; none: one group).
    by: &'a str,
    /// Which rows count, besides lying inside the window.
    filter: &'a str,
    /// Whether `filter` keeps only sessions with signals.
    signals_only: bool,
}

/// Appends `SELECT {select}` and the measures of the rollup rows of `agent` inside the window
/// that pass `g.filter`, grouped by `g.by`. SQLite groups twice: first in the order of an index
/// and by the sessions' measures ([`VECTOR`], sessions read in order fold into a few thousand
/// groups without a sort), then by `g.by`. PostgreSQL hashes the rows once.
fn push_grouped(
    sql: &mut Sql,
    select: &str,
    g: Grouping<'_>,
    ev: Evidence,
    (agent, since, until): (&str, i64, i64),
) {
    let by = if g.by.is_empty() {
        String::new()
    } else {
        format!(" GROUP BY {}", g.by)
    };
    if sql.backend() == DatabaseBackend::Sqlite {
        sql.push(&format!(
            "SELECT {select}{} FROM (SELECT {}, {VECTOR} FROM {} WHERE ",
            vector_measures(),
            g.columns,
            ev.rollup(&format!(" INDEXED BY {}", g.index))
        ));
        push_inside(sql, Scan::Grouped, agent, since, until);
        sql.push(&format!(" AND {} GROUP BY {}) AS v{by}", g.filter, g.order));
    } else {
        sql.push(&format!(
            "SELECT {select}{} FROM {} WHERE ",
            rollup_measures(sql.backend(), g.signals_only),
            ev.rollup("")
        ));
        push_inside(sql, Scan::Grouped, agent, since, until);
        sql.push(&format!(" AND {}{by}", g.filter));
    }
}

/// What groups of alike sessions carry: the measures that tell sessions apart (grouped by)
/// and their number and known cost.
const VECTOR: &str = "signals, cls, regens, heavy, requests, COUNT(*) AS n, SUM(cost) AS cost";

/// The `GROUP BY` of the cube's first grouping: the order of `idx_session_rollups_cube`, then
/// the measures of [`VECTOR`].
const CUBE_ORDER: &str = "model_min, model_max, provider_min, provider_max, env, week, ttfb_band, \
     signals, cls, regens, heavy, requests";

/// SQLite's indexes of the rollup (m0006): by cube key, by end user, by last activity.
const CUBE_INDEX: &str = "idx_session_rollups_cube";
const USER_INDEX: &str = "idx_session_rollups_user";
const ACTIVE_INDEX: &str = "idx_session_rollups_agent_active";

/// The `GROUP BY` of the end users' first grouping: the order of `idx_session_rollups_user`.
const USER_ORDER: &str = "user_id, signals, cls, regens, heavy, requests";

/// [`measures`] over groups of alike sessions ([`VECTOR`]).
fn vector_measures() -> String {
    let cols = [
        "SUM(CASE WHEN signals > 0 THEN n ELSE 0 END)",
        "SUM(signals * n)",
        "SUM(CASE WHEN cls = 1 THEN n ELSE 0 END)",
        "SUM(CASE WHEN cls = 2 THEN n ELSE 0 END)",
        "SUM(CASE WHEN regens > 0 THEN n ELSE 0 END)",
        "SUM(CASE WHEN heavy > 0 THEN n ELSE 0 END)",
        "SUM(regens * n)",
        "SUM(CASE WHEN signals > 0 THEN cost ELSE 0 END)",
        "SUM(CASE WHEN signals > 0 THEN requests * n ELSE 0 END)",
        "SUM(cost)",
    ];
    cols.iter()
        .zip(MEASURE_NAMES)
        .map(|(c, name)| format!("CAST(COALESCE({c}, 0) AS BIGINT) AS {name}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The sums of the measure columns of grouped rows.
fn sum_measures() -> String {
    MEASURE_NAMES
        .iter()
        .map(|m| format!("CAST(COALESCE(SUM({m}), 0) AS BIGINT) AS {m}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The measure columns [`measures`] names, in order.
const MEASURE_NAMES: [&str; 10] = [
    "sessions",
    "signals",
    "successes",
    "abandoned",
    "regenerated",
    "heavily_edited",
    "regenerations",
    "cost_micros",
    "requests",
    "all_cost",
];

/// Where the per-session table comes from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Source {
    /// `session_rollups` for the sessions whole inside the window, and the rows of the few
    /// that straddle an edge of it ([`push_edge_sessions`]), counting the signals of the
    /// evidence.
    Rollup(Evidence),
    /// Every session from its rows, in the CTE `s` the function appends (the tests' reference:
    /// the statement before the rollup).
    #[cfg(test)]
    Rows(PushSessions),
}

/// Appends the CTEs ending in `s`, a per-session table of `agent` over `[since, until)`.
#[cfg(test)]
pub(crate) type PushSessions = fn(&mut Sql, &str, i64, i64);

/// Appends the condition that a `session_rollups` row of `agent` lies whole inside the
/// window: its signals in `[since, until)` and its requests in `[since - REQUEST_LOOKBACK_MS,
/// until)`. Such a row is exactly what grouping the session's rows in the window gives.
///
/// `Scan::Range` lets the planner read the rows by their last activity (the index on
/// `(agent, last_active_ms)`); `Scan::Grouped` keeps SQLite off that index (`+last_active_ms`),
/// so it reads them through the index whose order is the `GROUP BY`'s instead of sorting them.
fn push_inside(sql: &mut Sql, scan: Scan, agent: &str, since: i64, until: i64) {
    let request_since = since - REQUEST_LOOKBACK_MS;
    let active = match (scan, sql.backend()) {
        (Scan::Grouped, DatabaseBackend::Sqlite) => "+last_active_ms",
        // PostgreSQL hashes whatever the order; an expression would hide the column's
        // statistics from its planner, which would then expect a handful of rows and sort.
        _ => "last_active_ms",
    };
    sql.push("agent = ")
        .bind(agent.to_owned())
        .push(&format!(" AND {active} >= "))
        .bind(request_since)
        .push(&format!(" AND {active} < "))
        .bind(until)
        .push(" AND (first_signal_ms IS NULL OR first_signal_ms >= ")
        .bind(since)
        .push(") AND (first_request_ms IS NULL OR first_request_ms >= ")
        .bind(request_since)
        .push(")");
}

/// How [`push_inside`] lets the rollup be read.
#[derive(Debug, Clone, Copy)]
enum Scan {
    Range,
    Grouped,
}

/// Appends the CTEs ending in `s`: the sessions of `agent` that straddle an edge of the window
/// (some of their rows lie outside it: exactly the rollup rows with activity in the window that
/// [`push_inside`] rejects), grouped from their rows in the window as the analytics did before
/// the rollup: the agent's signals in `[since, until)` and its requests from
/// [`REQUEST_LOOKBACK_MS`] before, grouped by session. Few sessions, found by session id.
///
/// `s` keeps the sessions without a signal in the window too (`signals = 0`), for the cost per
/// end user; outcome measures count only the sessions with signals.
fn push_edge_sessions(sql: &mut Sql, ev: Evidence, agent: &str, since: i64, until: i64) {
    push_edge_sessions_of(sql, ev, &ev.rollup(""), agent, since, until);
}

/// [`push_edge_sessions`] of the units among the rollup rows of `units` (the evidence's view
/// of `session_rollups`, or of some of its rows).
fn push_edge_sessions_of(
    sql: &mut Sql,
    ev: Evidence,
    units: &str,
    agent: &str,
    since: i64,
    until: i64,
) {
    let request_since = since - REQUEST_LOOKBACK_MS;
    // `agent || ''` and `+ 0` keep SQLite off the agent and time indexes, so it looks the few
    // sessions up by id instead of scanning every row of the agent.
    sql.push(&format!(
        "WITH e AS MATERIALIZED (SELECT session_id FROM {units} WHERE agent = "
    ))
    .bind(agent.to_owned())
    .push(" AND last_active_ms >= ")
    .bind(request_since)
    .push(" AND (last_active_ms >= ")
    .bind(until)
    .push(" OR first_signal_ms < ")
    .bind(since)
    .push(" OR first_request_ms < ")
    .bind(request_since)
    .push(")), u AS (");
    // A unit's rows (`rollup::Unit`): a session's signals that name no answer and its requests
    // no signal names; or an answer's signals and its request. Four lookups by id, each an
    // index's equality, rather than one `OR` the planners may not split.
    let keys = "e.session_id AS session_id";
    let signal_parts = [
        "t.request_id IS NULL AND t.session_id = e.session_id",
        "t.request_id = e.session_id",
    ];
    let explicit = rollup::signal_rows(keys, "e CROSS JOIN signals AS t");
    let implicit = rollup::implicit_rows(keys, "e CROSS JOIN signals AS t");
    // An implicit signal's unit (`rollup::implicit_unit`): its answer's when an explicit
    // signal names it, else its session.
    let implicit_parts = [
        format!(
            "t.{} AND t.request_id = e.session_id AND {}",
            rollup::IMPLICIT,
            rollup::named("t.")
        ),
        format!(
            "t.{} AND t.session_id = e.session_id AND NOT {}",
            rollup::IMPLICIT,
            rollup::named("t.")
        ),
    ];
    let parts = signal_parts
        .iter()
        .map(|unit| (&explicit, format!("t.{} AND {unit}", rollup::EXPLICIT)))
        .chain(
            implicit_parts
                .into_iter()
                .filter(|_| ev.implicit)
                .map(|unit| (&implicit, unit)),
        );
    for (i, (rows, unit)) in parts.enumerate() {
        if i > 0 {
            sql.push(" UNION ALL ");
        }
        sql.push(&format!("{rows} WHERE {unit} AND t.agent || '' = "))
            .bind(agent.to_owned())
            .push(" AND t.received_at_ms + 0 >= ")
            .bind(since)
            .push(" AND t.received_at_ms + 0 < ")
            .bind(until);
    }
    let request_parts = [
        format!(
            "t.session_id = e.session_id AND NOT {}",
            rollup::named("t.")
        ),
        format!("t.request_id = e.session_id AND {}", rollup::named("t.")),
    ];
    for unit in request_parts {
        sql.push(&format!(
            " UNION ALL {} WHERE {unit} AND t.agent || '' = ",
            rollup::request_rows(keys, "e CROSS JOIN requests AS t")
        ))
        .bind(agent.to_owned())
        .push(" AND t.started_at_ms + 0 >= ")
        .bind(request_since)
        .push(" AND t.started_at_ms + 0 < ")
        .bind(until);
    }
    sql.push(&format!(
        "), s AS MATERIALIZED (SELECT {} FROM u GROUP BY session_id) ",
        ev.session_from_rows()
    ));
}

/// Runs one analytics statement. On PostgreSQL it runs in a read transaction with JIT off (the
/// planner cannot estimate the per-session groups, overestimates the cost and would spend more
/// time compiling than executing) and enough `work_mem` to aggregate the sessions in memory.
pub(crate) async fn run(store: &Store, stmt: sea_orm::Statement) -> Result<Vec<QueryResult>> {
    let db = store.conn();
    if db.get_database_backend() != DatabaseBackend::Postgres {
        return Ok(db.query_all_raw(stmt).await?);
    }
    let txn = sea_orm::TransactionTrait::begin(db).await?;
    txn.execute_unprepared("SET LOCAL jit = off; SET LOCAL work_mem = '256MB'")
        .await?;
    let rows = txn.query_all_raw(stmt).await?;
    txn.commit().await?;
    Ok(rows)
}

/// The groups one recommendation pass needs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Aggregates {
    pub total: OutcomeRow,
    pub by_model: Vec<OutcomeRow>,
    pub by_provider: Vec<OutcomeRow>,
    pub by_env: Vec<OutcomeRow>,
    /// Sessions whose last signal is in the recent trend window, and in the one before.
    pub recent: OutcomeRow,
    pub previous: OutcomeRow,
    /// Sessions by time-to-first-byte band, fastest first (index into the bands of `rollup::TTFB_BANDS_MS`, the
    /// band past the last bound last); sessions without a TTFB are left out.
    pub by_ttfb: Vec<(usize, OutcomeRow)>,
    /// Sessions by end user (with signals).
    pub by_user: Vec<OutcomeRow>,
    /// Known cost of the agent's sessions in the window by end user, with or without signals
    /// (requests without a session or an end user are left out).
    pub user_costs: Vec<(String, u64)>,
}

/// The time ranges of a recommendation: the analysis window `[since, until)` and, inside it,
/// the trend periods `[recent_since, until)` and `[previous_since, recent_since)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Periods {
    pub window: Window,
    pub recent_since: i64,
    pub previous_since: i64,
}

/// Runs the one recommendation statement for `agent` over `periods`.
#[tracing::instrument(skip_all, fields(nm.agent = %agent))]
pub fn aggregates<'a>(
    store: &'a Store,
    agent: &'a str,
    periods: Periods,
    ev: Evidence,
) -> crate::BoxFuture<'a, Result<Aggregates>> {
    Box::pin(async move { aggregates_from(store, Source::Rollup(ev), agent, periods).await })
}

/// [`aggregates`] over the per-session table of `source`.
pub(crate) async fn aggregates_from(
    store: &Store,
    source: Source,
    agent: &str,
    periods: Periods,
) -> Result<Aggregates> {
    let stmt = aggregates_statement(store.backend(), source, agent, periods);
    let mut out = Aggregates::default();
    let mut by_model: BTreeMap<Option<String>, OutcomeRow> = BTreeMap::new();
    let mut by_provider: BTreeMap<Option<String>, OutcomeRow> = BTreeMap::new();
    let mut by_env: BTreeMap<Option<String>, OutcomeRow> = BTreeMap::new();
    let mut by_ttfb: BTreeMap<usize, OutcomeRow> = BTreeMap::new();
    let mut by_user: BTreeMap<String, (OutcomeRow, u64)> = BTreeMap::new();
    for row in run(store, stmt).await? {
        let group: String = row.try_get("", "g")?;
        let k = |i: usize| row.try_get::<Option<String>>("", &format!("k{i}"));
        let (k1, k2, k3, k4, k5) = (k(1)?, k(2)?, k(3)?, k(4)?, k(5)?);
        let m = measures_of(&row, Vec::new())?;
        match group.as_str() {
            "user" => {
                if let Some(user) = k1 {
                    let e = by_user.entry(user).or_default();
                    add(&mut e.0, &m);
                    e.1 += count(&row, "all_cost")?;
                }
                continue;
            }
            "recent" => {
                add(&mut out.recent, &m);
                continue;
            }
            "previous" => {
                add(&mut out.previous, &m);
                continue;
            }
            _ => {}
        }
        add(&mut out.total, &m);
        add(by_model.entry(k1).or_default(), &m);
        add(by_provider.entry(k2).or_default(), &m);
        add(by_env.entry(k3).or_default(), &m);
        if let Some(band) = k4.and_then(|b| b.parse::<usize>().ok()) {
            add(by_ttfb.entry(band).or_default(), &m);
        }
        match k5.as_deref() {
            Some("recent") => add(&mut out.recent, &m),
            Some("previous") => add(&mut out.previous, &m),
            _ => {}
        }
    }
    let keyed = |map: BTreeMap<Option<String>, OutcomeRow>| -> Vec<OutcomeRow> {
        map.into_iter()
            .map(|(k, r)| OutcomeRow { key: vec![k], ..r })
            .collect()
    };
    out.by_model = keyed(by_model);
    out.by_provider = keyed(by_provider);
    out.by_env = keyed(by_env);
    out.by_ttfb = by_ttfb.into_iter().collect();
    for (user, (m, all_cost)) in by_user {
        out.user_costs.push((user.clone(), all_cost));
        if m.sessions > 0 {
            out.by_user.push(OutcomeRow {
                key: vec![Some(user)],
                ..m
            });
        }
    }
    for rows in [
        &mut out.by_model,
        &mut out.by_provider,
        &mut out.by_env,
        &mut out.by_user,
    ] {
        rows.sort_by(|a, b| b.sessions.cmp(&a.sessions).then_with(|| a.key.cmp(&b.key)));
    }
    out.user_costs
        .sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(out)
}

/// The statement of [`aggregates_from`].
#[cfg_attr(
    not(test),
    expect(
        irrefutable_let_patterns,
        reason = "the raw-row source exists in tests only"
    )
)]
pub(crate) fn aggregates_statement(
    backend: DatabaseBackend,
    source: Source,
    agent: &str,
    periods: Periods,
) -> Statement {
    let Periods {
        window: Window {
            since_ms: since,
            until_ms: until,
        },
        recent_since,
        previous_since,
    } = periods;
    let mut sql = Sql::new(backend, "");
    match source {
        Source::Rollup(ev) => push_edge_sessions(&mut sql, ev, agent, since, until),
        #[cfg(test)]
        Source::Rows(push) => push(&mut sql, agent, since, until),
    }
    let band = ttfb_band("ttfb", true);
    // Over `s`, two groupings: a small cube of model x provider x env x TTFB band x trend
    // period (a few hundred rows at most, rolled up below: every measure is a sum), and one row
    // per end user.
    sql.push(&format!(
        "SELECT 'cube' AS g, model AS k1, provider AS k2, env AS k3, {band} AS k4, \
         CASE WHEN last_ms >= "
    ))
    .bind(recent_since)
    .push(" THEN 'recent' WHEN last_ms >= ")
    .bind(previous_since)
    .push(&format!(
        " THEN 'previous' END AS k5, {} FROM s WHERE signals > 0 GROUP BY 2, 3, 4, 5, 6 \
         UNION ALL SELECT 'user', user_id, NULL, NULL, NULL, NULL, {} FROM s \
         WHERE user_id IS NOT NULL GROUP BY user_id",
        measures("cls"),
        measures("cls")
    ));
    if let Source::Rollup(ev) = source {
        // The sessions inside the window, from their rollup rows, in four passes that read
        // sessions in the order of an index and never sort them (see m0006): the cube without
        // the trend period, the two trend periods (ranges of the last activity; a session's
        // last signal, `sig_key / 4`, is never after it), and the end users. The cube and the
        // users are grouped twice: by the index's order and the sessions' measures
        // ([`VECTOR`]: a few thousand groups), then by their keys.
        sql.push(" UNION ALL ");
        push_grouped(
            &mut sql,
            &format!(
                "'cube', {}, {}, env, CAST(ttfb_band AS TEXT), CAST(NULL AS TEXT), ",
                Dimension::Model.rollup_expr(),
                Dimension::Provider.rollup_expr()
            ),
            Grouping {
                columns: "model_min, model_max, provider_min, provider_max, env, ttfb_band",
                order: CUBE_ORDER,
                index: CUBE_INDEX,
                by: "model_min, model_max, provider_min, provider_max, env, ttfb_band",
                filter: "signals > 0",
                signals_only: true,
            },
            ev,
            (agent, since, until),
        );
        let with_signals = rollup_measures(backend, true);
        for (name, from, to) in [
            ("recent", recent_since, until),
            ("previous", previous_since, recent_since),
        ] {
            let indexed = match backend {
                DatabaseBackend::Sqlite => format!(" INDEXED BY {ACTIVE_INDEX}"),
                _ => String::new(),
            };
            sql.push(&format!(
                " UNION ALL SELECT '{name}', NULL, NULL, NULL, NULL, NULL, {with_signals} \
                 FROM {} WHERE ",
                ev.rollup(&indexed)
            ));
            push_inside(&mut sql, Scan::Range, agent, since, until);
            sql.push(" AND signals > 0 AND last_active_ms >= ")
                .bind(from)
                .push(" AND sig_key >= ")
                .bind(from.saturating_mul(4))
                .push(" AND sig_key < ")
                .bind(to.saturating_mul(4));
        }
        sql.push(" UNION ALL ");
        push_grouped(
            &mut sql,
            "'user', user_id, NULL, NULL, NULL, NULL, ",
            Grouping {
                columns: "user_id",
                order: USER_ORDER,
                index: USER_INDEX,
                by: "user_id",
                filter: "user_id IS NOT NULL",
                signals_only: false,
            },
            ev,
            (agent, since, until),
        );
    }

    sql.build()
}

/// Adds `m`'s measures to `into` (every measure is a sum).
fn add(into: &mut OutcomeRow, m: &OutcomeRow) {
    into.sessions += m.sessions;
    into.signals += m.signals;
    into.successes += m.successes;
    into.abandoned += m.abandoned;
    into.regenerated += m.regenerated;
    into.heavily_edited += m.heavily_edited;
    into.regenerations += m.regenerations;
    into.cost_micros += m.cost_micros;
    into.requests += m.requests;
}

/// The total of `agent` over `window` counting implicit evidence (explicit and implicit
/// signals, `continued` no outcome), shown beside explicit evidence, from `explicit`: the
/// window's total with explicit evidence only ([`Aggregates::total`]).
///
/// An explicit signal always wins, so a unit with an explicit signal in the window has the
/// same measures under both evidences; the implicit total is the explicit one plus the units
/// with no explicit signal in the window and an implicit one. Only those are read: the rollup
/// rows whole inside the window without any explicit signal, and the few units straddling an
/// edge, both through the partial index of the rows with implicit signals, so an agent without
/// implicit signals costs nothing here.
pub fn implicit_beside<'a>(
    store: &'a Store,
    agent: &'a str,
    window: Window,
    explicit: &'a OutcomeRow,
) -> crate::BoxFuture<'a, Result<OutcomeRow>> {
    Box::pin(async move {
        let stmt = implicit_beside_statement(store.backend(), agent, window);
        let mut total = OutcomeRow {
            key: Vec::new(),
            ..explicit.clone()
        };
        for row in run(store, stmt).await? {
            add(&mut total, &measures_of(&row, Vec::new())?);
        }
        Ok(total)
    })
}

/// The statement of [`implicit_beside`]: two rows, the straddling units' and the inside rows'.
pub(crate) fn implicit_beside_statement(
    backend: DatabaseBackend,
    agent: &str,
    window: Window,
) -> Statement {
    let Window {
        since_ms: since,
        until_ms: until,
    } = window;
    let ev = Evidence {
        implicit: true,
        continued: false,
    };
    let indexed = match backend {
        DatabaseBackend::Sqlite => format!(" INDEXED BY {IMPLICIT_INDEX}"),
        _ => String::new(),
    };
    let mut sql = Sql::new(backend, "");
    // A unit with no implicit signal (`continued` aside) has none of these measures.
    push_edge_sessions_of(
        &mut sql,
        ev,
        &ev.rollup_where(&indexed, &format!("{IMPLICIT_ROWS} AND isignals > 0")),
        agent,
        since,
        until,
    );
    sql.push(&format!(
        "SELECT {} FROM s WHERE signals > 0 AND esignals = 0 UNION ALL SELECT {} FROM {} WHERE ",
        measures("cls"),
        rollup_measures(backend, true),
        Evidence::implicit_only(&indexed)
    ));
    push_inside(&mut sql, Scan::Range, agent, since, until);
    sql.push(" AND signals > 0");
    sql.build()
}

/// Most rows [`outcome_rates`] returns.
pub const MAX_RATE_ROWS: u32 = 10_000;

/// Session outcomes of `agent` over `[since, until)`, grouped by `dims` (none: one total row),
/// most sessions first, at most `limit` rows (0: [`MAX_RATE_ROWS`]).
#[tracing::instrument(skip_all, fields(nm.agent = %agent, dims = ?dims))]
pub fn outcome_rates<'a>(
    store: &'a Store,
    agent: &'a str,
    dims: &'a [Dimension],
    since: i64,
    until: i64,
    limit: u32,
    ev: Evidence,
) -> crate::BoxFuture<'a, Result<Vec<OutcomeRow>>> {
    Box::pin(async move {
        outcome_rates_from(store, Source::Rollup(ev), agent, dims, since, until, limit).await
    })
}

/// [`outcome_rates`] over the per-session table of `source`.
pub(crate) async fn outcome_rates_from(
    store: &Store,
    source: Source,
    agent: &str,
    dims: &[Dimension],
    since: i64,
    until: i64,
    limit: u32,
) -> Result<Vec<OutcomeRow>> {
    let stmt = outcome_rates_statement(store.backend(), source, agent, dims, since, until, limit);
    let mut rows = Vec::new();
    for row in run(store, stmt).await? {
        let key = dims
            .iter()
            .enumerate()
            .map(|(i, d)| Ok(d.show(row.try_get::<Option<String>>("", &format!("k{i}"))?)))
            .collect::<Result<Vec<_>>>()?;
        let m = measures_of(&row, key)?;
        if m.sessions > 0 {
            rows.push(m);
        }
    }
    Ok(rows)
}

/// The statement of [`outcome_rates_from`].
#[cfg_attr(
    not(test),
    expect(
        irrefutable_let_patterns,
        reason = "the raw-row source exists in tests only"
    )
)]
pub(crate) fn outcome_rates_statement(
    backend: DatabaseBackend,
    source: Source,
    agent: &str,
    dims: &[Dimension],
    since: i64,
    until: i64,
    limit: u32,
) -> Statement {
    let limit = match limit {
        0 => MAX_RATE_ROWS,
        n => n.min(MAX_RATE_ROWS),
    };
    let mut sql = Sql::new(backend, "");
    match source {
        Source::Rollup(ev) => push_edge_sessions(&mut sql, ev, agent, since, until),
        #[cfg(test)]
        Source::Rows(push) => push(&mut sql, agent, since, until),
    }
    let keys = |expr: fn(Dimension) -> &'static str| -> String {
        dims.iter()
            .enumerate()
            .map(|(i, d)| format!("{} AS k{i}, ", expr(*d)))
            .collect()
    };
    let numbers: Vec<String> = (1..=dims.len()).map(|i| i.to_string()).collect();
    let group = if dims.is_empty() {
        String::new()
    } else {
        format!(" GROUP BY {}", numbers.join(", "))
    };
    // The groups of `s` and, for the sessions inside the window, of their rollup rows, summed.
    sql.push(&format!(
        ", r AS (SELECT {}{} FROM s WHERE signals > 0{group}",
        keys(Dimension::expr),
        measures("cls")
    ));
    if let Source::Rollup(ev) = source {
        // On SQLite by the order of the end users' index when the groups are by end user, else
        // of the cube's.
        let (columns, order, index) = if dims.contains(&Dimension::User) {
            (
                "user_id, model_min, model_max, provider_min, provider_max, env, week",
                format!(
                    "{USER_ORDER}, model_min, model_max, provider_min, provider_max, env, week"
                ),
                USER_INDEX,
            )
        } else {
            (
                "model_min, model_max, provider_min, provider_max, env, week",
                CUBE_ORDER.to_owned(),
                CUBE_INDEX,
            )
        };
        let by: Vec<&str> = dims
            .iter()
            .map(|d| match d {
                Dimension::Model => "model_min, model_max",
                Dimension::Provider => "provider_min, provider_max",
                Dimension::Env => "env",
                Dimension::Week => "week",
                Dimension::User => "user_id",
            })
            .collect();
        let by = by.join(", ");
        sql.push(" UNION ALL ");
        push_grouped(
            &mut sql,
            &keys(Dimension::rollup_expr),
            Grouping {
                columns,
                order: &order,
                index,
                by: &by,
                filter: "signals > 0",
                signals_only: true,
            },
            ev,
            (agent, since, until),
        );
    }

    let outer_keys: Vec<String> = (0..dims.len()).map(|i| format!("k{i}")).collect();
    let mut select = outer_keys.join(", ");
    if !select.is_empty() {
        select.push_str(", ");
    }
    sql.push(&format!(") SELECT {select}{} FROM r", sum_measures()));
    if !dims.is_empty() {
        sql.push(&format!(
            " GROUP BY {} ORDER BY sessions DESC, {}",
            numbers.join(", "),
            numbers.join(", ")
        ));
    }
    sql.push(" LIMIT ").bind(i64::from(limit));
    sql.build()
}

fn measures_of(row: &QueryResult, key: Vec<Option<String>>) -> Result<OutcomeRow> {
    Ok(OutcomeRow {
        key,
        sessions: count(row, "sessions")?,
        signals: count(row, "signals")?,
        successes: count(row, "successes")?,
        abandoned: count(row, "abandoned")?,
        regenerated: count(row, "regenerated")?,
        heavily_edited: count(row, "heavily_edited")?,
        regenerations: count(row, "regenerations")?,
        cost_micros: count(row, "cost_micros")?,
        requests: count(row, "requests")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weeks_start_on_monday() {
        // 2026-11-23 is a Monday; its week number shows as itself.
        let monday_ms = nm_types::budget::day_from_civil(2026, 11, 23) * 86_400_000;
        let week = (monday_ms + 259_200_000) / 604_800_000;
        assert_eq!(
            Dimension::Week.show(Some(week.to_string())).as_deref(),
            Some("2026-11-23")
        );
        let sunday_ms = monday_ms + 6 * 86_400_000 + 86_399_999;
        assert_eq!((sunday_ms + 259_200_000) / 604_800_000, week);
        assert_eq!(((monday_ms - 1) + 259_200_000) / 604_800_000, week - 1);
    }
}
