//! `session_rollups`: one row per (agent, session) holding what the analytics need of the
//! session's signals and requests, kept in the same transaction as the rows it summarises, so an
//! agent's analytics read about one row per session instead of grouping every signal and request.
//!
//! Every column is *mergeable* (a count, a sum, a minimum or a maximum), so a row is the same
//! whatever order the signals and requests arrive in, late records from a dataplane's spool
//! included: the row of a set of rows merged with the row of another set is the row of their
//! union. A row holds, for the signals of the session attributed to the agent: their number, the
//! largest `received_at_ms · 4 + class` (the session's outcome and its last signal, see
//! [`super::query`]), regenerations, heavy edits and the first signal's time; for the agent's
//! requests of the session: their number, the smallest and largest model (as answered, else as
//! requested) and provider, the largest env and end user, the known cost (NULL while no request
//! has a known cost, exactly like `SUM`), the slowest time to first byte and the first and last
//! request's time; and the session's last activity (`last_active_ms`).
//!
//! **Outcome units.** A row's `session_id` names its *unit*: a session, or one answer. A signal
//! that names an answer (`signals.request_id`) counts for that request alone: its unit is the
//! request id (a UUIDv7, never of the `sess_` form), and the request's own record moves from its
//! session's unit to that unit, so the unit has exactly that request's model, provider, env and
//! cost (each request in one unit: costs are never counted twice). A session's unit keeps its
//! signals that name no answer and its requests no signal names. [`SIGNAL_UNIT`] and
//! [`request_unit`] say it in SQL; the raw-row statements (the window's edges, the rebuilds, the
//! tests' reference) group by them. When a signal naming a known request arrives, or the record
//! of a request some signal named, the rows of both units are rebuilt ([`rebuild_unit`]).
//!
//! Only rows stored for the first time are added: duplicates of records (a resent batch) and of
//! signals (a retried `Idempotency-Key`) are skipped by their inserts and never reach here. Rows
//! without an agent (or a request without a session) are not in it; when signals that arrived
//! before their session are re-attributed to its agent, the rows of the session's agents are
//! rebuilt from the raw rows ([`rebuild_session`]).
//!
//! A batch of records is grouped by (agent, session) **in the database**
//! (`INSERT .. SELECT .. FROM (VALUES ..) GROUP BY .. ON CONFLICT DO UPDATE`), so text minimums
//! and maximums follow the database's collation, exactly as a `MIN`/`MAX` over the raw rows
//! does. Signals carry only integers: a group of them is folded per session in Rust (the class
//! from the same [`super::outcome::is_success`]) and upserted as a plain `VALUES` list, which
//! costs the signal writer less. The outcome class of a signal is baked into `sig_key`: a change of
//! [`super::outcome::is_success`] or of the heavy-edit threshold needs a migration that rebuilds
//! the table.
//!
//! **Implicit signals** (`signals.source = 'implicit'`, inferred by the dataplane's rules) never
//! enter the explicit columns above and never decide a unit: units are those the *explicit*
//! signals make ([`named`] looks at explicit signals only). They are folded into columns of
//! their own beside them (`isignals`, `isig_key`, `iregens`, `iheavy`, `ifirst_ms`, and
//! `icont`, `icont_key` for the rule `continued`), in the unit that holds the answer they judge:
//! that answer's own unit when an explicit signal names it, else its session's. So the explicit
//! analytics read exactly what they read before implicit signals existed, and the analytics
//! that count implicit evidence ([`super::query`]'s `Evidence`) take a unit's explicit outcome
//! when it has one and its implicit outcome only otherwise: explicit always wins. Implicit
//! signals come with the record that revealed them (their agent is known then) and are added
//! once, with that record ([`add_implicit`]); `last_active_ms` covers their times too.

use sea_orm::{ConnectionTrait, DatabaseBackend, Statement, Value};

use std::collections::{BTreeMap, HashSet};

use super::outcome::{HEAVY_EDIT_CHARS, class_case, is_heavy_edit, is_success};
use crate::error::Result;
use crate::records::RequestRecord;
use crate::sql::{Sql, chunks_of, insert_values, push_value_rows};
use nm_types::Action;
use nm_types::signal::Rule;

/// A signal's unit over `signals`: the answer it names, else its session.
pub(crate) const SIGNAL_UNIT: &str = "COALESCE(request_id, session_id)";

/// Which rows of `signals` are explicit (sent by an application).
pub(crate) const EXPLICIT: &str = "source = 'explicit'";

/// Which rows of `signals` are implicit (inferred by a rule).
pub(crate) const IMPLICIT: &str = "source = 'implicit'";

/// Whether some explicit signal names the request of `requests` (or `signals`) alias `t`
/// (`t.`): implicit signals never make a unit.
pub(crate) fn named(t: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM signals AS n WHERE n.request_id = {t}request_id \
         AND n.source = 'explicit')"
    )
}

/// A request's unit over `requests` alias `t` (`t.`): itself when a signal names it, else its
/// session.
pub(crate) fn request_unit(t: &str) -> String {
    format!(
        "CASE WHEN {} THEN {t}request_id ELSE {t}session_id END",
        named(t)
    )
}

/// An outcome unit of the rollup: a session, or one answer named by signals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unit<'a> {
    Session(&'a str),
    Request(&'a str),
}

impl Unit<'_> {
    fn id(&self) -> &str {
        match self {
            Unit::Session(id) | Unit::Request(id) => id,
        }
    }

    /// Appends the condition that an explicit row of `signals` belongs to the unit.
    fn push_signals(&self, sql: &mut Sql) {
        sql.push(EXPLICIT).push(" AND ");
        match self {
            Unit::Session(id) => sql
                .push("request_id IS NULL AND session_id = ")
                .bind((*id).to_owned()),
            Unit::Request(id) => sql.push("request_id = ").bind((*id).to_owned()),
        };
    }

    /// Appends the condition that an implicit row of `signals` belongs to the unit: the unit
    /// of the answer it judges ([`implicit_unit`]).
    fn push_implicit(&self, sql: &mut Sql) {
        sql.push(IMPLICIT).push(" AND ");
        self.push_judged(sql, "signals.");
    }

    /// Appends the condition that a row of `requests` belongs to the unit.
    fn push_requests(&self, sql: &mut Sql) {
        self.push_judged(sql, "requests.");
    }

    /// A row of `table` (prefix `table.`) whose `request_id` is an answer: in a session's unit
    /// unless explicit signals name that answer, then in the answer's own.
    fn push_judged(&self, sql: &mut Sql, table: &str) {
        match self {
            Unit::Session(id) => sql
                .push("session_id = ")
                .bind((*id).to_owned())
                .push(&format!(" AND NOT {}", named(table))),
            Unit::Request(id) => sql
                .push("request_id = ")
                .bind((*id).to_owned())
                .push(&format!(" AND {}", named(table))),
        };
    }
}

/// Time-to-first-byte bands (upper bounds, ms) for the latency analysis; the last band is open.
/// Defined here because each row stores its band (the `ttfb_band` column, [`DERIVED`]): a change
/// of the bands needs a migration that rebuilds the table.
pub const TTFB_BANDS_MS: [i64; 5] = [500, 1_000, 2_000, 4_000, 8_000];

/// The time-to-first-byte band of the expression `ttfb` (`0`.., as text with `text`; NULL
/// without a TTFB).
pub(crate) fn ttfb_band(ttfb: &str, text: bool) -> String {
    let quote = if text { "'" } else { "" };
    let mut band = format!("CASE WHEN {ttfb} IS NULL THEN NULL");
    for (i, bound) in TTFB_BANDS_MS.iter().enumerate() {
        band.push_str(&format!(" WHEN {ttfb} < {bound} THEN {quote}{i}{quote}"));
    }
    band.push_str(&format!(" ELSE {quote}{}{quote} END", TTFB_BANDS_MS.len()));
    band
}

/// An implicit signal's unit over `signals` alias `t` (`t.`): its answer's own when an
/// explicit signal names that answer, else its session (the answer's: the rules judge answers
/// of the session that revealed them).
pub(crate) fn implicit_unit(t: &str) -> String {
    format!(
        "CASE WHEN {} THEN {t}request_id ELSE {t}session_id END",
        named(t)
    )
}

/// The rollup's columns after (agent, session_id), in the order [`AGGREGATES`] computes them.
pub(crate) const COLUMNS: [&str; 24] = [
    "signals",
    "sig_key",
    "regens",
    "heavy",
    "first_signal_ms",
    "requests",
    "model_min",
    "model_max",
    "provider_min",
    "provider_max",
    "env",
    "user_id",
    "cost",
    "ttfb",
    "first_request_ms",
    "last_request_ms",
    "last_active_ms",
    "isignals",
    "isig_key",
    "iregens",
    "iheavy",
    "ifirst_ms",
    "icont",
    "icont_key",
];

/// The rollup columns as aggregates over rows of the shape [`signal_rows`] and [`request_rows`]
/// give, in [`COLUMNS`] order.
const AGGREGATES: &str = "CAST(SUM(is_sig) AS BIGINT), MAX(sig_key), \
     CAST(SUM(regen) AS BIGINT), CAST(SUM(heavy) AS BIGINT), MIN(sig_ms), \
     CAST(SUM(1 - is_sig - is_isig - icont) AS BIGINT), MIN(model), MAX(model), MIN(provider), \
     MAX(provider), MAX(env), MAX(user_id), CAST(SUM(cost) AS BIGINT), MAX(ttfb), MIN(req_ms), \
     MAX(req_ms), MAX(COALESCE(sig_ms, req_ms, isig_ms)), CAST(SUM(is_isig) AS BIGINT), MAX(isig_key), \
     CAST(SUM(iregen) AS BIGINT), CAST(SUM(iheavy) AS BIGINT), MIN(isig_ms), \
     CAST(SUM(icont) AS BIGINT), MAX(icont_key)";

/// Columns derived from others, stored so that indexes can order and cover them (SQLite
/// reads a generated column from the table, never from an index): the outcome class, the TTFB
/// band and the UTC week (from Monday) of the last signal.
pub(crate) const DERIVED: [&str; 3] = ["cls", "ttfb_band", "week"];

/// The [`DERIVED`] columns from the session's `sig_key` and `ttfb` expressions.
fn derived(sig_key: &str, ttfb: &str) -> String {
    format!(
        "({sig_key}) % 4, {}, (({sig_key}) / 4 + 259200000) / 604800000",
        ttfb_band(ttfb, false)
    )
}

/// Every stored column after (agent, session_id): [`COLUMNS`] then [`DERIVED`].
fn all_columns() -> String {
    format!("{}, {}", COLUMNS.join(", "), DERIVED.join(", "))
}

/// [`AGGREGATES`] and the [`DERIVED`] columns, in [`all_columns`] order.
fn aggregates() -> String {
    format!("{AGGREGATES}, {}", derived("MAX(sig_key)", "MAX(ttfb)"))
}

/// How a stored row and a new one merge, in [`COLUMNS`] order: sums add (a NULL cost stays
/// unknown until a known one arrives, like `SUM`), minimums and maximums keep the smaller or
/// larger non-NULL value.
fn merge(col: &str) -> String {
    let (r, x) = (format!("session_rollups.{col}"), format!("excluded.{col}"));
    match col {
        "signals" | "regens" | "heavy" | "requests" | "isignals" | "iregens" | "iheavy"
        | "icont" => format!("{r} + {x}"),
        "cost" => format!("COALESCE({r} + {x}, {r}, {x})"),
        "first_signal_ms" | "model_min" | "provider_min" | "first_request_ms" | "ifirst_ms" => {
            format!("CASE WHEN {r} IS NULL OR {x} < {r} THEN {x} ELSE {r} END")
        }
        _ => format!("CASE WHEN {r} IS NULL OR {x} > {r} THEN {x} ELSE {r} END"),
    }
}

/// `SELECT`s one row per signal of `source` (a table or subquery with the columns `agent`,
/// `session_id`, `received_at_ms`, `action` and `edit_distance`), in the shape the aggregates
/// read: the columns `keys` (`agent, session_id` or `session_id`), `is_sig`, `sig_key` (the
/// time times 4 plus the class), `regen`, `heavy`, `sig_ms`, and the request columns as NULLs.
/// The statement may continue with a `WHERE`.
pub(crate) fn signal_rows(keys: &str, source: &str) -> String {
    format!(
        "SELECT {keys}, 1 AS is_sig, received_at_ms * 4 + {} AS sig_key, \
         CASE WHEN action = '{}' THEN 1 ELSE 0 END AS regen, \
         CASE WHEN action = '{}' AND edit_distance >= {HEAVY_EDIT_CHARS} THEN 1 ELSE 0 END AS heavy, \
         received_at_ms AS sig_ms, CAST(NULL AS TEXT) AS model, CAST(NULL AS TEXT) AS provider, \
         CAST(NULL AS TEXT) AS env, CAST(NULL AS TEXT) AS user_id, CAST(NULL AS BIGINT) AS cost, \
         CAST(NULL AS BIGINT) AS ttfb, CAST(NULL AS BIGINT) AS req_ms, {NO_IMPLICIT} \
         FROM {source}",
        class_case(),
        Action::Regenerated,
        Action::Edited,
    )
}

/// The implicit columns of a row that is not an implicit signal.
const NO_IMPLICIT: &str = "0 AS is_isig, CAST(NULL AS BIGINT) AS isig_key, 0 AS iregen, \
     0 AS iheavy, CAST(NULL AS BIGINT) AS isig_ms, 0 AS icont, CAST(NULL AS BIGINT) AS icont_key";

/// `SELECT`s one row per implicit signal of `source` (columns as for [`signal_rows`], and
/// `rule`) in the shape of [`signal_rows`]: its explicit columns empty, its own in `is_isig`,
/// `isig_key`, `iregen`, `iheavy` (an outcome: every rule but `continued`) or `icont`,
/// `icont_key` (`continued`), and `isig_ms` (its time). The statement may continue with a
/// `WHERE`.
pub(crate) fn implicit_rows(keys: &str, source: &str) -> String {
    let cont = Rule::Continued.name();
    format!(
        "SELECT {keys}, 0 AS is_sig, CAST(NULL AS BIGINT) AS sig_key, 0 AS regen, 0 AS heavy, \
         CAST(NULL AS BIGINT) AS sig_ms, CAST(NULL AS TEXT) AS model, \
         CAST(NULL AS TEXT) AS provider, CAST(NULL AS TEXT) AS env, \
         CAST(NULL AS TEXT) AS user_id, CAST(NULL AS BIGINT) AS cost, \
         CAST(NULL AS BIGINT) AS ttfb, CAST(NULL AS BIGINT) AS req_ms, \
         CASE WHEN rule = '{cont}' THEN 0 ELSE 1 END AS is_isig, \
         CASE WHEN rule = '{cont}' THEN NULL ELSE received_at_ms * 4 + {} END AS isig_key, \
         CASE WHEN action = '{}' AND rule <> '{cont}' THEN 1 ELSE 0 END AS iregen, \
         CASE WHEN action = '{}' AND edit_distance >= {HEAVY_EDIT_CHARS} THEN 1 ELSE 0 END \
         AS iheavy, received_at_ms AS isig_ms, \
         CASE WHEN rule = '{cont}' THEN 1 ELSE 0 END AS icont, \
         CASE WHEN rule = '{cont}' THEN received_at_ms * 4 + {} END AS icont_key \
         FROM {source}",
        class_case(),
        Action::Regenerated,
        Action::Edited,
        class_case(),
    )
}

/// `SELECT`s one row per request of `source` (a table or subquery with the columns of
/// `requests` the analytics read) in the shape of [`signal_rows`], alone or after it in a
/// `UNION ALL`. The statement may continue with a `WHERE`.
pub(crate) fn request_rows(keys: &str, source: &str) -> String {
    format!(
        "SELECT {keys}, 0 AS is_sig, CAST(NULL AS BIGINT) AS sig_key, 0 AS regen, \
         0 AS heavy, CAST(NULL AS BIGINT) AS sig_ms, COALESCE(answered_model, model) AS model, \
         provider, env, user_id, cost_micros AS cost, ttfb_ms AS ttfb, started_at_ms AS req_ms, \
         {NO_IMPLICIT} FROM {source}"
    )
}

/// The `INSERT INTO session_rollups` of the rows of `rows` (a subquery of the shape of
/// [`signal_rows`] with `agent`) grouped by agent and session, merged into the stored rows.
fn upsert(rows: &str) -> String {
    // `WHERE true`: SQLite needs it to read `ON CONFLICT` as the upsert, not as a join's `ON`.
    format!(
        "INSERT INTO session_rollups (agent, session_id, {}) \
         SELECT agent, session_id, {} FROM ({rows}) AS u WHERE true \
         GROUP BY agent, session_id {}",
        all_columns(),
        aggregates(),
        on_conflict()
    )
}

/// The `ON CONFLICT` clause that merges a new row into the stored one ([`merge`]).
fn on_conflict() -> String {
    let mut set: Vec<String> = COLUMNS
        .iter()
        .map(|c| format!("{c} = {}", merge(c)))
        .collect();
    let (sig_key, ttfb) = (merge("sig_key"), merge("ttfb"));
    set.push(format!(
        "({}) = ({})",
        DERIVED.join(", "),
        derived(&sig_key, &ttfb)
    ));
    format!(
        "ON CONFLICT (agent, session_id) DO UPDATE SET {}",
        set.join(", ")
    )
}

/// A `VALUES` list of `rows` rows of `cols` placeholders, as a subquery naming its columns.
fn values(backend: DatabaseBackend, rows: usize, cols: &[&str]) -> String {
    let mut sql = String::from("SELECT ");
    for (i, c) in cols.iter().enumerate() {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push_str(&format!("column{} AS {c}", i + 1));
    }
    sql.push_str(" FROM (VALUES ");
    push_value_rows(backend, &mut sql, rows, cols.len());
    sql.push_str(") AS v");
    sql
}

const REQUEST_VALUES: [&str; 10] = [
    "agent",
    "session_id",
    "started_at_ms",
    "answered_model",
    "model",
    "provider",
    "env",
    "user_id",
    "cost_micros",
    "ttfb_ms",
];

/// What signals add to a session's rollup, in the order [`signals_sql`] binds it.
const SIGNAL_COLUMNS: [&str; 11] = [
    "agent",
    "session_id",
    "signals",
    "sig_key",
    "regens",
    "heavy",
    "first_signal_ms",
    "requests",
    "last_active_ms",
    "cls",
    "week",
];

/// The upsert of `rows` sessions' new signals, folded beforehand ([`SignalSums`]): a plain
/// `VALUES` list, no grouping in the database (signals carry only integers).
fn signals_sql(backend: DatabaseBackend, rows: usize) -> String {
    let mut sql = insert_values(backend, "session_rollups", &SIGNAL_COLUMNS, rows);
    sql.push(' ');
    sql.push_str(&on_conflict());
    sql
}

/// The upsert of `rows` requests (bound in [`REQUEST_VALUES`] order).
///
/// **Lock order.** On PostgreSQL every transaction that writes `session_rollups` takes its row
/// locks in ascending `(agent, session_id)` byte order: [`add_signals`] binds its rows from a
/// `BTreeMap` (a `VALUES` list is processed in order), and this statement, which groups first,
/// sorts its groups the same way (`COLLATE "C"` compares bytes, like Rust's `String`), over
/// chunks cut from rows sorted likewise. Two writers touching the same sessions then wait for
/// each other instead of deadlocking. SQLite locks the whole database: no order needed.
fn requests_sql(backend: DatabaseBackend, rows: usize) -> String {
    let mut sql = upsert(&request_rows(
        "agent, session_id",
        &format!("({}) AS r", values(backend, rows, &REQUEST_VALUES)),
    ));
    if backend == DatabaseBackend::Postgres {
        let at = sql.find(" ON CONFLICT").unwrap_or(sql.len());
        sql.insert_str(at, r#" ORDER BY agent COLLATE "C", session_id COLLATE "C""#);
    }
    sql
}

/// One new signal, as the rollup sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SignalFacts<'a> {
    pub agent: &'a str,
    /// The signal's unit: the request id it names, else its session id.
    pub session_id: &'a str,
    pub received_at_ms: i64,
    pub action: Action,
    pub edit_distance: Option<i64>,
}

/// A session's new signals folded: the rollup's signal columns.
#[derive(Debug, Clone, Copy)]
struct SignalSums {
    signals: i64,
    sig_key: i64,
    regens: i64,
    heavy: i64,
    first_ms: i64,
    last_ms: i64,
}

/// The class of a signal (1 success, 2 abandoned, 0 other failure): [`class_case`] in Rust,
/// from the same [`is_success`].
fn class(action: Action, edit_distance: Option<i64>) -> i64 {
    let distance = edit_distance.and_then(|d| u64::try_from(d).ok());
    if is_success(action, distance) {
        1
    } else if action == Action::Abandoned {
        2
    } else {
        0
    }
}

/// Adds signals stored for the first time to their sessions' rollups.
pub(crate) async fn add_signals<C: ConnectionTrait>(
    db: &C,
    signals: &[SignalFacts<'_>],
) -> Result<()> {
    let mut sessions: BTreeMap<(&str, &str), SignalSums> = BTreeMap::new();
    for s in signals {
        let distance = s.edit_distance.and_then(|d| u64::try_from(d).ok());
        let sig_key = s.received_at_ms * 4 + class(s.action, s.edit_distance);
        let regen = i64::from(s.action == Action::Regenerated);
        let heavy = i64::from(s.action == Action::Edited && is_heavy_edit(distance));
        sessions
            .entry((s.agent, s.session_id))
            .and_modify(|x| {
                x.signals += 1;
                x.sig_key = x.sig_key.max(sig_key);
                x.regens += regen;
                x.heavy += heavy;
                x.first_ms = x.first_ms.min(s.received_at_ms);
                x.last_ms = x.last_ms.max(s.received_at_ms);
            })
            .or_insert(SignalSums {
                signals: 1,
                sig_key,
                regens: regen,
                heavy,
                first_ms: s.received_at_ms,
                last_ms: s.received_at_ms,
            });
    }
    let rows: Vec<_> = sessions.into_iter().collect();
    write_rows(
        db,
        &rows,
        SIGNAL_COLUMNS.len(),
        signals_sql,
        |((agent, session_id), x), values| {
            values.extend([
                Value::String(Some((*agent).to_owned())),
                Value::String(Some((*session_id).to_owned())),
                Value::BigInt(Some(x.signals)),
                Value::BigInt(Some(x.sig_key)),
                Value::BigInt(Some(x.regens)),
                Value::BigInt(Some(x.heavy)),
                Value::BigInt(Some(x.first_ms)),
                Value::BigInt(Some(0)),
                Value::BigInt(Some(x.last_ms)),
                // As [`derived`] computes them in SQL (the times are positive).
                Value::BigInt(Some(x.sig_key % 4)),
                Value::BigInt(Some((x.sig_key / 4 + 259_200_000) / 604_800_000)),
            ]);
        },
    )
    .await
}

/// One new implicit signal, as the rollup sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ImplicitFacts<'a> {
    pub agent: &'a str,
    /// The unit of the answer it judges ([`implicit_unit`]).
    pub unit: &'a str,
    pub received_at_ms: i64,
    pub rule: Rule,
    pub edit_distance: Option<i64>,
}

/// A unit's new implicit signals folded: the rollup's implicit columns.
#[derive(Debug, Clone, Copy, Default)]
struct ImplicitSums {
    signals: i64,
    sig_key: Option<i64>,
    regens: i64,
    heavy: i64,
    first_ms: i64,
    last_ms: i64,
    cont: i64,
    cont_key: Option<i64>,
}

/// What implicit signals add to a unit's rollup, in the order [`add_implicit`] binds it.
const IMPLICIT_COLUMNS: [&str; 14] = [
    "agent",
    "session_id",
    "signals",
    "regens",
    "heavy",
    "requests",
    "last_active_ms",
    "isignals",
    "isig_key",
    "iregens",
    "iheavy",
    "ifirst_ms",
    "icont",
    "icont_key",
];

/// Adds implicit signals stored for the first time to their units' rollups (rows in key
/// order, like [`add_signals`]).
pub(crate) async fn add_implicit<C: ConnectionTrait>(
    db: &C,
    signals: &[ImplicitFacts<'_>],
) -> Result<()> {
    let mut units: BTreeMap<(&str, &str), ImplicitSums> = BTreeMap::new();
    for s in signals {
        let action = s.rule.action();
        let key = s.received_at_ms * 4 + class(action, s.edit_distance);
        let distance = s.edit_distance.and_then(|d| u64::try_from(d).ok());
        let x = units
            .entry((s.agent, s.unit))
            .or_insert_with(|| ImplicitSums {
                first_ms: s.received_at_ms,
                last_ms: s.received_at_ms,
                ..ImplicitSums::default()
            });
        x.first_ms = x.first_ms.min(s.received_at_ms);
        x.last_ms = x.last_ms.max(s.received_at_ms);
        if s.rule == Rule::Continued {
            x.cont += 1;
            x.cont_key = x.cont_key.max(Some(key));
        } else {
            x.signals += 1;
            x.sig_key = x.sig_key.max(Some(key));
            x.regens += i64::from(action == Action::Regenerated);
            x.heavy += i64::from(action == Action::Edited && is_heavy_edit(distance));
        }
    }
    let rows: Vec<_> = units.into_iter().collect();
    let sql = |backend, size| {
        let mut sql = insert_values(backend, "session_rollups", &IMPLICIT_COLUMNS, size);
        sql.push(' ');
        sql.push_str(&on_conflict());
        sql
    };
    write_rows(
        db,
        &rows,
        IMPLICIT_COLUMNS.len(),
        sql,
        |((agent, unit), x), values| {
            values.extend([
                Value::String(Some((*agent).to_owned())),
                Value::String(Some((*unit).to_owned())),
                Value::BigInt(Some(0)),
                Value::BigInt(Some(0)),
                Value::BigInt(Some(0)),
                Value::BigInt(Some(0)),
                Value::BigInt(Some(x.last_ms)),
                Value::BigInt(Some(x.signals)),
                Value::BigInt(x.sig_key),
                Value::BigInt(Some(x.regens)),
                Value::BigInt(Some(x.heavy)),
                Value::BigInt(Some(x.first_ms)),
                Value::BigInt(Some(x.cont)),
                Value::BigInt(x.cont_key),
            ]);
        },
    )
    .await
}

/// Adds request records stored for the first time to their sessions' rollups; records without
/// an agent or a session are skipped (at no cost beyond looking at them).
pub(crate) async fn add_requests<C: ConnectionTrait>(
    db: &C,
    records: &[&RequestRecord],
) -> Result<()> {
    add_requests_named(db, records, &HashSet::new()).await
}

/// [`add_requests`], where the records of `named` (request ids some signal names) go to their
/// own unit instead of their session's (with or without a session).
pub(crate) async fn add_requests_named<C: ConnectionTrait>(
    db: &C,
    records: &[&RequestRecord],
    named: &HashSet<String>,
) -> Result<()> {
    let unit = |r: &RequestRecord| -> Option<String> {
        if named.contains(&r.request_id) {
            Some(r.request_id.clone())
        } else {
            r.session_id.as_ref().map(|s| s.as_str().to_owned())
        }
    };
    let mut rows: Vec<(&RequestRecord, String)> = records
        .iter()
        .copied()
        .filter(|r| r.agent.is_some())
        .filter_map(|r| Some((r, unit(r)?)))
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    // Row locks in key order (see `requests_sql`): chunks follow the sorted rows.
    rows.sort_by(|a, b| (&a.0.agent, &a.1).cmp(&(&b.0.agent, &b.1)));
    let count = |v: Option<u64>| Value::BigInt(v.map(|v| i64::try_from(v).unwrap_or(i64::MAX)));
    write_rows(
        db,
        &rows,
        REQUEST_VALUES.len(),
        requests_sql,
        |(r, unit), values| {
            values.extend([
                Value::String(r.agent.clone()),
                Value::String(Some(unit.clone())),
                Value::BigInt(Some(r.started_at_ms)),
                Value::String(r.usage.model.clone()),
                Value::String(r.model.clone()),
                Value::String(Some(r.provider.to_string())),
                Value::String(r.env.map(|e| e.as_str().to_owned())),
                Value::String(r.user_id.clone()),
                count(r.cost_micros),
                count(r.ttfb_ms),
            ]);
        },
    )
    .await
}

/// Writes `rows` in statements of at most [`chunks_of`] rows each: `sql` is the statement for
/// `n` rows of `width` values, `row` appends one row's values.
async fn write_rows<C: ConnectionTrait, T>(
    db: &C,
    rows: &[T],
    width: usize,
    sql: impl Fn(DatabaseBackend, usize) -> String,
    row: impl Fn(&T, &mut Vec<Value>),
) -> Result<()> {
    let backend = db.get_database_backend();
    for chunk in chunks_of(rows) {
        let mut values = Vec::with_capacity(chunk.len() * width);
        for r in chunk {
            row(r, &mut values);
        }
        db.execute_raw(Statement::from_sql_and_values(
            backend,
            sql(backend, chunk.len()),
            values,
        ))
        .await?;
    }
    Ok(())
}

/// Rebuilds the rows of `session_id`'s unit for `agent` and for every agent its signals were
/// stored with before they were re-attributed (their `agent_hint`), from the raw rows. Called
/// when the records ingest re-attributes signals: a maximum cannot be taken back, so the rows
/// are recomputed rather than adjusted.
pub(crate) async fn rebuild_session<C: ConnectionTrait>(
    db: &C,
    session_id: &str,
    agent: &str,
) -> Result<()> {
    rebuild_unit(db, Unit::Session(session_id), Some(agent)).await
}

/// Rebuilds the rows of `unit` for `agent` (when known) and for the `agent_hint` of every signal
/// of the unit, from the raw rows: the unit's explicit signals (by [`SIGNAL_UNIT`]), implicit
/// signals (by [`implicit_unit`]) and requests (by [`request_unit`]).
pub(crate) async fn rebuild_unit<C: ConnectionTrait>(
    db: &C,
    unit: Unit<'_>,
    agent: Option<&str>,
) -> Result<()> {
    let backend = db.get_database_backend();
    let id = unit.id().to_owned();
    let agents = |sql: &mut Sql| {
        sql.push(" IN (SELECT agent_hint FROM signals WHERE ");
        unit.push_signals(sql);
        sql.push(" AND agent_hint IS NOT NULL");
        if let Some(agent) = agent {
            sql.push(" UNION SELECT ").bind(agent.to_owned());
        }
        sql.push(")");
    };
    let mut delete = Sql::new(backend, "DELETE FROM session_rollups WHERE session_id = ");
    delete.bind(id.clone()).push(" AND agent");
    agents(&mut delete);
    db.execute_raw(delete.build()).await?;

    let mut insert = Sql::new(backend, "");
    insert.push(&format!(
        "INSERT INTO session_rollups (agent, session_id, {}) SELECT agent, session_id, \
         {} FROM ({} WHERE ",
        all_columns(),
        aggregates(),
        signal_rows(&format!("agent, {SIGNAL_UNIT} AS session_id"), "signals")
    ));
    unit.push_signals(&mut insert);
    insert.push(" AND agent");
    agents(&mut insert);
    insert.push(" UNION ALL ");
    insert.push(&implicit_rows(
        &format!("agent, {} AS session_id", implicit_unit("signals.")),
        "signals",
    ));
    insert.push(" WHERE ");
    unit.push_implicit(&mut insert);
    insert.push(" AND agent");
    agents(&mut insert);
    insert.push(" UNION ALL ");
    insert.push(&request_rows(
        &format!("agent, {} AS session_id", request_unit("requests.")),
        "requests",
    ));
    insert.push(" WHERE ");
    unit.push_requests(&mut insert);
    insert.push(" AND agent");
    agents(&mut insert);
    insert.push(") AS u GROUP BY agent, session_id");
    db.execute_raw(insert.build()).await?;
    Ok(())
}
