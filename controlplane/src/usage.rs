//! Usage and cost aggregates of the request records, grouped by any of agent, session, user,
//! env, provider, model, key, day and week, computed by the database in one `GROUP BY` per
//! report; and the latency percentiles of the same records ([`latency`]).
//!
//! The whole UTC days of a report's range are read from the day totals the ingest keeps
//! (`usage_rollups`, [`totals`]), its ends (a range that starts or ends mid-day) from the stored
//! records; a report by session, or of one session, reads the records alone.
//!
//! Unknown stays unknown: costs are summed over the records whose cost is known, and the report
//! counts apart the requests whose usage was reported but whose model has no price
//! (`unpriced`), and those whose answer carried no usage at all (`unmetered`).

use sea_orm::{ConnectionTrait, DatabaseBackend, QueryResult};

use crate::error::{Error, Result};
use crate::sql::{Sql, count};
use crate::store::Store;

pub mod latency;
pub mod totals;

/// Adds new records (each counted once) to the day totals, in the caller's transaction: their
/// usage to `usage_rollups` ([`totals`]) and their latencies to `latency_totals` ([`latency`]).
pub(crate) async fn add_day_totals(
    txn: &crate::store::WriteTxn,
    records: &[&nm_types::record::RequestRecord],
) -> Result<()> {
    totals::add_totals(txn, records).await?;
    latency::add_totals(txn, records).await
}

/// Most rows one report returns.
pub const MAX_ROWS: u32 = 10_000;
pub const DEFAULT_ROWS: u32 = 100;

/// What a usage report is grouped by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dimension {
    Agent,
    Session,
    User,
    Env,
    Provider,
    /// The model as answered, else as requested.
    Model,
    /// UTC day of the request's start, as `YYYY-MM-DD`.
    Day,
    /// The key's id.
    Key,
    /// The UTC week (from Monday) of the request's start, as the Monday's `YYYY-MM-DD`.
    Week,
}

impl Dimension {
    /// The SQL expression of the dimension: constants of ours, never user input.
    fn expr(self) -> &'static str {
        match self {
            Dimension::Agent => "agent",
            Dimension::Session => "session_id",
            Dimension::User => "user_id",
            Dimension::Env => "env",
            Dimension::Provider => "provider",
            Dimension::Model => "COALESCE(answered_model, model)",
            Dimension::Day => "(started_at_ms / 86400000)",
            Dimension::Key => "key_id",
            // The Monday's day: Unix day 0 is a Thursday.
            Dimension::Week => "((started_at_ms / 86400000 + 3) / 7 * 7 - 3)",
        }
    }

    /// The dimension's column in the union of records and rollups ([`push_union`]).
    fn column(self) -> &'static str {
        match self {
            Dimension::Agent => "agent",
            Dimension::Session => "session_id",
            Dimension::User => "user_id",
            Dimension::Env => "env",
            Dimension::Provider => "provider",
            Dimension::Model => "model",
            Dimension::Day => "day",
            Dimension::Key => "key_id",
            Dimension::Week => "((day + 3) / 7 * 7 - 3)",
        }
    }
}

/// Which records a report covers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageFilter {
    pub since_ms: Option<i64>,
    pub until_ms: Option<i64>,
    pub agent: Option<String>,
    pub session_id: Option<String>,
    pub user_id: Option<String>,
    pub env: Option<String>,
    pub provider: Option<String>,
    pub model: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageRow {
    /// One value per dimension asked for, in order.
    pub key: Vec<Option<String>>,
    pub requests: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_input_tokens: u64,
    pub reasoning_tokens: u64,
    pub cost_micros: u64,
    pub unpriced_requests: u64,
    pub unmetered_requests: u64,
    pub errors: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpricedModel {
    pub provider: String,
    pub model: String,
    pub requests: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageReport {
    pub rows: Vec<UsageRow>,
    pub truncated: bool,
    pub total: UsageRow,
    pub unpriced_models: Vec<UnpricedModel>,
}

/// A report's rows limit (0: the default; at most [`MAX_ROWS`]), once its dimensions are checked
/// (at most 7).
fn checked_limit(dims: &[Dimension], limit: u32) -> Result<u32> {
    if dims.len() > 7 {
        return Err(Error::InvalidArgument(
            "at most 7 group-by dimensions".to_owned(),
        ));
    }
    Ok(match limit {
        0 => DEFAULT_ROWS,
        n => n.min(MAX_ROWS),
    })
}

/// A sum that cannot overflow: exact while it fits a 64-bit integer (far beyond any real sum,
/// with every record's values capped by `nm_types::record`), saturating at `i64::MAX` beyond.
/// PostgreSQL sums bigints as `numeric`, clamped before the cast; SQLite's `SUM` fails on
/// overflow, so it adds with `TOTAL` (doubles: exact for integers below 2^53, 9 * 10^15) and
/// its cast to `INTEGER` saturates.
fn sum(backend: DatabaseBackend, expr: &str) -> String {
    match backend {
        DatabaseBackend::Sqlite => format!("CAST(MIN(TOTAL({expr}), 9.3e18) AS INTEGER)"),
        _ => format!("CAST(LEAST(COALESCE(SUM({expr}), 0), 9223372036854775807) AS BIGINT)"),
    }
}

/// A record whose usage was reported but whose model has no price: 1, else 0.
pub(crate) const UNPRICED: &str = "CASE WHEN cost_micros IS NULL AND (input_tokens IS NOT NULL OR output_tokens IS NOT NULL) THEN 1 ELSE 0 END";
/// A record whose answer should have carried usage but carried none: 1, else 0.
pub(crate) const UNMETERED: &str = "CASE WHEN usage_status <> 'not_applicable' AND input_tokens IS NULL AND output_tokens IS NULL THEN 1 ELSE 0 END";
/// A record of an answer with an error status: 1, else 0.
pub(crate) const ERRORS: &str = "CASE WHEN status >= 400 THEN 1 ELSE 0 END";

/// The measures of a group of `requests` rows, in the order [`measures`] reads them.
fn measures_sql(backend: DatabaseBackend) -> String {
    let s = |expr: &str| sum(backend, expr);
    format!(
        "COUNT(*) AS requests, {} AS input_tokens, {} AS output_tokens, \
         {} AS cached_input_tokens, {} AS reasoning_tokens, {} AS cost_micros, \
         {} AS unpriced, {} AS unmetered, {} AS errors",
        s("input_tokens"),
        s("output_tokens"),
        s("cached_input_tokens"),
        s("reasoning_tokens"),
        s("cost_micros"),
        s(UNPRICED),
        s(UNMETERED),
        s(ERRORS),
    )
}

/// The total row over the groups `g` (the same columns as [`measures_sql`]).
fn totals_sql(backend: DatabaseBackend) -> String {
    [
        "requests",
        "input_tokens",
        "output_tokens",
        "cached_input_tokens",
        "reasoning_tokens",
        "cost_micros",
        "unpriced",
        "unmetered",
        "errors",
    ]
    .iter()
    .map(|c| format!("{} AS {c}", sum(backend, c)))
    .collect::<Vec<_>>()
    .join(", ")
}

/// On SQLite, a time range wider than this share of the stored records' time span is read by
/// scanning the table: walking the time index and fetching each row costs more (about 2-4x
/// at 1M records) once a range holds more than a few tenths of the rows. PostgreSQL's planner
/// decides from its statistics.
const SQLITE_INDEX_MAX_SHARE: f64 = 0.25;

#[derive(Debug, Clone)]
pub struct UsageReports {
    store: Store,
}

impl UsageReports {
    pub fn new(store: Store) -> Self {
        Self { store }
    }

    /// How the time filter names the time column: plainly (index use allowed), or as
    /// `+started_at_ms` on SQLite when the range covers much of the stored span.
    async fn time_column(&self, f: &UsageFilter) -> Result<&'static str> {
        const INDEXED: &str = "started_at_ms";
        const SCANNED: &str = "+started_at_ms";
        let db = self.store.conn();
        if db.get_database_backend() != sea_orm::DatabaseBackend::Sqlite {
            return Ok(INDEXED);
        }
        let Some(since) = f.since_ms else {
            return Ok(SCANNED);
        };
        // MIN and MAX of an indexed column are one index probe each.
        let span = Sql::new(
            db.get_database_backend(),
            "SELECT MIN(started_at_ms) AS lo, MAX(started_at_ms) AS hi FROM requests",
        );
        let Some(row) = db.query_one_raw(span.build()).await? else {
            return Ok(INDEXED);
        };
        let (lo, hi): (Option<i64>, Option<i64>) = (row.try_get("", "lo")?, row.try_get("", "hi")?);
        let (Some(lo), Some(hi)) = (lo, hi) else {
            return Ok(INDEXED);
        };
        let until = f.until_ms.unwrap_or(hi).min(hi);
        let covered = (until - since.max(lo)).max(0) as f64;
        let stored = (hi - lo).max(1) as f64;
        Ok(if covered / stored > SQLITE_INDEX_MAX_SHARE {
            SCANNED
        } else {
            INDEXED
        })
    }

    /// Usage grouped by `dims` (none: one total row), largest cost first, at most `limit` rows.
    #[tracing::instrument(skip_all, fields(dims = ?dims, limit))]
    pub fn report<'a>(
        &'a self,
        dims: &'a [Dimension],
        filter: &'a UsageFilter,
        limit: u32,
    ) -> crate::BoxFuture<'a, Result<UsageReport>> {
        Box::pin(async move { self.report_with(dims, filter, limit, true).await })
    }

    /// [`UsageReports::report`], reading the day totals (`usage_rollups`) for the whole days of
    /// the range and the stored records for its ends, or (`totals` false: the tests' reference)
    /// the stored records alone.
    pub(crate) async fn report_with(
        &self,
        dims: &[Dimension],
        filter: &UsageFilter,
        limit: u32,
        totals: bool,
    ) -> Result<UsageReport> {
        let limit = checked_limit(dims, limit)?;
        // The day totals have no session: a report by session, or of one, reads the records.
        let by_session = dims.contains(&Dimension::Session) || filter.session_id.is_some();
        if totals
            && !by_session
            && let Some(split) = totals::split_days(filter.since_ms, filter.until_ms)
        {
            return self.report_from_totals(dims, filter, limit, &split).await;
        }
        let db = self.store.conn();
        let backend = db.get_database_backend();
        let time = self.time_column(filter).await?;

        let mut rows = Vec::new();
        let mut total = UsageRow::default();
        let mut truncated = false;
        if dims.is_empty() {
            let mut sql = Sql::new(
                backend,
                &format!("SELECT {} FROM requests WHERE 1 = 1", measures_sql(backend)),
            );
            push_filter(&mut sql, time, filter);
            if let Some(row) = db.query_one_raw(sql.build()).await? {
                total = measures(&row, Vec::new())?;
            }
        } else {
            // One pass over the records: the groups are computed once, then both the top rows
            // and the total over all groups are read from them.
            let keys: Vec<String> = dims
                .iter()
                .enumerate()
                .map(|(i, d)| format!("{} AS k{i}", d.expr()))
                .collect();
            let key_names: Vec<String> = (0..dims.len()).map(|i| format!("k{i}")).collect();
            let group: Vec<String> = (1..=dims.len()).map(|i| i.to_string()).collect();
            let mut sql = Sql::new(
                backend,
                &format!(
                    "WITH g AS MATERIALIZED (SELECT {}, {} FROM requests WHERE 1 = 1",
                    keys.join(", "),
                    measures_sql(backend)
                ),
            );
            push_filter(&mut sql, time, filter);
            sql.push(&format!(" GROUP BY {})", group.join(", ")));
            push_top_and_total(&mut sql, backend, dims.len(), limit);
            (rows, total, truncated) = grouped(
                db.query_all_raw(sql.build()).await?,
                dims,
                &key_names,
                limit,
            )?;
        }

        let mut sql = Sql::new(
            backend,
            "SELECT provider, COALESCE(answered_model, model) AS m, COUNT(*) AS n FROM requests \
             WHERE cost_micros IS NULL AND (input_tokens IS NOT NULL OR output_tokens IS NOT NULL)",
        );
        // Served by the partial index idx_requests_unpriced: only unpriced rows are read.
        push_filter(&mut sql, "started_at_ms", filter);
        sql.push(" GROUP BY 1, 2 ORDER BY n DESC LIMIT 100");
        let unpriced_models = unpriced(db.query_all_raw(sql.build()).await?)?;

        Ok(UsageReport {
            rows,
            truncated,
            total,
            unpriced_models,
        })
    }
}

impl UsageReports {
    /// [`UsageReports::report`] over the day totals of the range's whole days and the stored
    /// records of its ends.
    async fn report_from_totals(
        &self,
        dims: &[Dimension],
        filter: &UsageFilter,
        limit: u32,
        split: &totals::DaySplit,
    ) -> Result<UsageReport> {
        let db = self.store.conn();
        let backend = db.get_database_backend();
        let mut rows = Vec::new();
        let mut total = UsageRow::default();
        let mut truncated = false;
        let mut sql = Sql::new(backend, "WITH u AS (");
        push_union(&mut sql, filter, split);
        if dims.is_empty() {
            sql.push(&format!(") SELECT {} FROM u", totals_sql(backend)));
            if let Some(row) = db.query_one_raw(sql.build()).await? {
                total = measures(&row, Vec::new())?;
            }
        } else {
            let keys: Vec<String> = dims
                .iter()
                .enumerate()
                .map(|(i, d)| format!("{} AS k{i}", d.column()))
                .collect();
            let key_names: Vec<String> = (0..dims.len()).map(|i| format!("k{i}")).collect();
            let group: Vec<String> = (1..=dims.len()).map(|i| i.to_string()).collect();
            sql.push(&format!(
                "), g AS MATERIALIZED (SELECT {}, {} FROM u GROUP BY {})",
                keys.join(", "),
                totals_sql(backend),
                group.join(", ")
            ));
            push_top_and_total(&mut sql, backend, dims.len(), limit);
            (rows, total, truncated) = grouped(
                db.query_all_raw(sql.build()).await?,
                dims,
                &key_names,
                limit,
            )?;
        }
        let mut sql = Sql::new(backend, "WITH u AS (");
        push_union(&mut sql, filter, split);
        sql.push(&format!(
            ") SELECT provider, model AS m, {} AS n FROM u WHERE unpriced > 0 \
             GROUP BY 1, 2 ORDER BY n DESC LIMIT 100",
            sum(backend, "unpriced")
        ));
        let unpriced_models = unpriced(db.query_all_raw(sql.build()).await?)?;
        Ok(UsageReport {
            rows,
            truncated,
            total,
            unpriced_models,
        })
    }
}

/// The day totals of the range's whole days and the stored records of its ends as rows of one
/// shape: the dimensions' columns ([`Dimension::column`]) and the measures' (those
/// [`totals_sql`] sums).
fn push_union(sql: &mut Sql, f: &UsageFilter, split: &totals::DaySplit) {
    sql.push(
        "SELECT NULLIF(agent, '') AS agent, CAST(NULL AS TEXT) AS session_id, \
         NULLIF(user_id, '') AS user_id, NULLIF(env, '') AS env, provider, \
         NULLIF(model, '') AS model, key_id, day, requests, input_tokens, output_tokens, \
         cached_input_tokens, reasoning_tokens, cost_micros, unpriced, unmetered, errors \
         FROM usage_rollups WHERE 1 = 1",
    );
    if let Some(from) = split.from_day {
        sql.push(" AND day >= ").bind(from);
    }
    if let Some(to) = split.to_day {
        sql.push(" AND day < ").bind(to);
    }
    let eq = [
        ("agent", &f.agent),
        ("user_id", &f.user_id),
        ("env", &f.env),
        ("provider", &f.provider),
        ("model", &f.model),
    ];
    for (col, value) in eq {
        if let Some(v) = value {
            sql.push(&format!(" AND {col} = ")).bind(v.clone());
        }
    }
    for (since, until) in &split.edges {
        sql.push(&format!(
            " UNION ALL SELECT agent, session_id, user_id, env, provider, \
             COALESCE(answered_model, model) AS model, key_id, started_at_ms / 86400000 AS day, \
             1 AS requests, input_tokens, output_tokens, cached_input_tokens, reasoning_tokens, \
             cost_micros, {UNPRICED} AS unpriced, {UNMETERED} AS unmetered, {ERRORS} AS errors \
             FROM requests WHERE 1 = 1"
        ));
        let edge = UsageFilter {
            since_ms: Some(*since),
            until_ms: Some(*until),
            ..f.clone()
        };
        push_filter(sql, "started_at_ms", &edge);
    }
}

/// `time` is the time column as the query names it: `started_at_ms`, or `+started_at_ms` to keep
/// SQLite from walking the time index where reading the table is faster (see
/// [`UsageReports::time_column`]).
fn push_filter(sql: &mut Sql, time: &str, f: &UsageFilter) {
    if let Some(s) = f.since_ms {
        sql.push(&format!(" AND {time} >= ")).bind(s);
    }
    if let Some(u) = f.until_ms {
        sql.push(&format!(" AND {time} < ")).bind(u);
    }
    let eq = [
        ("agent", &f.agent),
        ("session_id", &f.session_id),
        ("user_id", &f.user_id),
        ("env", &f.env),
        ("provider", &f.provider),
    ];
    for (col, value) in eq {
        if let Some(v) = value {
            sql.push(&format!(" AND {col} = ")).bind(v.clone());
        }
    }
    if let Some(m) = &f.model {
        sql.push(" AND COALESCE(answered_model, model) = ")
            .bind(m.clone());
    }
}

/// A grouped report's query after its groups `g` (`groups` key columns): the first `limit` + 1
/// groups by cost, then the total over all groups (`total_row = 1`), as [`grouped`] reads them.
fn push_top_and_total(sql: &mut Sql, backend: DatabaseBackend, groups: usize, limit: u32) {
    sql.push(
        " SELECT 0 AS total_row, t.* FROM \
         (SELECT * FROM g ORDER BY cost_micros DESC, requests DESC LIMIT ",
    )
    .bind(i64::from(limit) + 1)
    .push(&format!(
        ") AS t UNION ALL SELECT 1, {}, {} FROM g",
        vec!["NULL"; groups].join(", "),
        totals_sql(backend)
    ));
}

/// The unpriced models' rows (`provider`, `m`, `n`).
fn unpriced(answer: Vec<QueryResult>) -> Result<Vec<UnpricedModel>> {
    answer
        .iter()
        .map(|row| {
            Ok(UnpricedModel {
                provider: row.try_get("", "provider")?,
                model: row
                    .try_get::<Option<String>>("", "m")?
                    .unwrap_or_else(|| "(unknown)".to_owned()),
                requests: count(row, "n")?,
            })
        })
        .collect()
}

/// A grouped report's answer: its rows (the first `limit`, and whether more were cut) and the
/// total row (`total_row = 1`).
fn grouped(
    answer: Vec<QueryResult>,
    dims: &[Dimension],
    key_names: &[String],
    limit: u32,
) -> Result<(Vec<UsageRow>, UsageRow, bool)> {
    let mut rows = Vec::new();
    let mut total = UsageRow::default();
    for row in answer {
        if row.try_get::<i32>("", "total_row")? == 1 {
            total = measures(&row, Vec::new())?;
            continue;
        }
        let key = dims
            .iter()
            .zip(key_names)
            .map(|(d, name)| key_value(&row, *d, name))
            .collect::<Result<Vec<_>>>()?;
        rows.push(measures(&row, key)?);
    }
    let truncated = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    Ok((rows, total, truncated))
}

fn key_value(row: &QueryResult, dim: Dimension, col: &str) -> Result<Option<String>> {
    Ok(match dim {
        Dimension::Day | Dimension::Week => row.try_get::<Option<i64>>("", col)?.map(|day| {
            let (y, m, d) = nm_types::budget::civil_from_day(day);
            format!("{y:04}-{m:02}-{d:02}")
        }),
        _ => row.try_get::<Option<String>>("", col)?,
    })
}

fn measures(row: &QueryResult, key: Vec<Option<String>>) -> Result<UsageRow> {
    Ok(UsageRow {
        key,
        requests: count(row, "requests")?,
        input_tokens: count(row, "input_tokens")?,
        output_tokens: count(row, "output_tokens")?,
        cached_input_tokens: count(row, "cached_input_tokens")?,
        reasoning_tokens: count(row, "reasoning_tokens")?,
        cost_micros: count(row, "cost_micros")?,
        unpriced_requests: count(row, "unpriced")?,
        unmetered_requests: count(row, "unmetered")?,
        errors: count(row, "errors")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{RequestRecord, Usage, UsageStatus};
    use crate::{Budgets, Records};

    fn rec(
        id: &str,
        agent: &str,
        model: &str,
        input: Option<u64>,
        cost: Option<u64>,
    ) -> RequestRecord {
        RequestRecord {
            request_id: id.to_owned(),
            started_at_ms: 86_400_000 * 20_779 + 1_000,
            key_id: "key_1".into(),
            provider: "openai".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".to_owned(),
            model: Some(model.to_owned()),
            agent: Some(agent.to_owned()),
            status: 200,
            usage: Usage {
                input_tokens: input,
                output_tokens: input.map(|i| i / 2),
                ..Default::default()
            },
            cost_micros: cost,
            usage_status: if input.is_some() {
                UsageStatus::Reported
            } else {
                UsageStatus::Missing
            },
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn groups_sums_and_keeps_unknowns_apart() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/u.db?mode=rwc", dir.path().display());
        let store = Store::connect(&url).await.unwrap();
        let records = Records::new(
            store.clone(),
            Budgets::load(store.clone(), 0).await.unwrap(),
        );
        records
            .ingest(&[
                rec("1", "a", "gpt-4o", Some(100), Some(500)),
                rec("2", "a", "gpt-4o", Some(300), Some(1500)),
                rec("3", "a", "mystery", Some(10), None),
                rec("4", "b", "gpt-4o", None, None),
            ])
            .await
            .unwrap();
        let usage = UsageReports::new(store);
        let r = usage
            .report(
                &[Dimension::Agent, Dimension::Model],
                &UsageFilter::default(),
                0,
            )
            .await
            .unwrap();
        assert_eq!(r.total.requests, 4);
        assert_eq!(r.total.cost_micros, 2000);
        assert_eq!(r.total.input_tokens, 410);
        assert_eq!(r.total.unpriced_requests, 1);
        assert_eq!(r.total.unmetered_requests, 1);
        assert_eq!(
            r.rows[0].key,
            vec![Some("a".to_owned()), Some("gpt-4o".to_owned())]
        );
        assert_eq!((r.rows[0].requests, r.rows[0].output_tokens), (2, 200));
        assert_eq!(
            r.unpriced_models,
            vec![UnpricedModel {
                provider: "openai".to_owned(),
                model: "mystery".to_owned(),
                requests: 1
            }]
        );

        let by_day = usage
            .report(
                &[Dimension::Day],
                &UsageFilter {
                    agent: Some("a".to_owned()),
                    ..Default::default()
                },
                1,
            )
            .await
            .unwrap();
        assert_eq!(by_day.rows[0].key, vec![Some("2026-11-22".to_owned())]);
        assert_eq!(by_day.rows[0].requests, 3);
        assert!(!by_day.truncated);
    }

    /// By key and by week, past the records' retention: the rollups of deleted records keep
    /// the key, and their day falls in its week.
    #[tokio::test]
    async fn by_key_and_week_include_the_rollups() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/k.db?mode=rwc", dir.path().display());
        let store = Store::connect(&url).await.unwrap();
        let records = Records::new(
            store.clone(),
            Budgets::load(store.clone(), 0).await.unwrap(),
        );
        // Day 20779 is Sunday 2026-11-22; day 20772 the Sunday before.
        records
            .ingest(&[rec("1", "a", "gpt-4o", Some(100), Some(500))])
            .await
            .unwrap();
        store
            .conn()
            .execute_unprepared(
                "INSERT INTO usage_rollups (day, agent, user_id, env, provider, model, key_id, \
                 requests, input_tokens, output_tokens, cached_input_tokens, reasoning_tokens, \
                 cost_micros, unpriced, unmetered, errors) VALUES \
                 (20772, 'a', '', '', 'openai', 'gpt-4o', 'key_2', 3, 30, 15, 0, 0, 900, 0, 0, 1)",
            )
            .await
            .unwrap();
        let r = UsageReports::new(store)
            .report(
                &[Dimension::Key, Dimension::Week],
                &UsageFilter {
                    since_ms: Some(86_400_000 * 20_700),
                    ..Default::default()
                },
                0,
            )
            .await
            .unwrap();
        let keys: Vec<(Option<String>, Option<String>, u64, u64)> = r
            .rows
            .iter()
            .map(|row| {
                (
                    row.key[0].clone(),
                    row.key[1].clone(),
                    row.requests,
                    row.cost_micros,
                )
            })
            .collect();
        assert_eq!(
            keys,
            vec![
                (
                    Some("key_2".to_owned()),
                    Some("2026-11-09".to_owned()),
                    3,
                    900
                ),
                (
                    Some("key_1".to_owned()),
                    Some("2026-11-16".to_owned()),
                    1,
                    500
                ),
            ]
        );
        assert_eq!((r.total.requests, r.total.errors), (4, 1));
    }

    /// Sums past a 64-bit integer saturate instead of failing the report (rows written
    /// straight into the table: the ingest's caps keep real sums far from this).
    async fn huge_sums_saturate_on(url: &str) {
        let store = Store::connect(url).await.unwrap();
        let records = Records::new(
            store.clone(),
            Budgets::load(store.clone(), 0).await.unwrap(),
        );
        records
            .ingest(&[rec("small", "a", "gpt-4o", Some(1), Some(1))])
            .await
            .unwrap();
        // Into both the records (read alone) and the day totals (read for whole days).
        let huge = 4_000_000_000_000_000_000_i64;
        for (day, id) in [(1, "h1"), (2, "h2"), (3, "h3")] {
            store
                .conn()
                .execute_unprepared(&format!(
                    "INSERT INTO requests (request_id, started_at_ms, key_id, provider, method, path, \
                     status, latency_ms, streamed, response_bytes, input_tokens, cost_micros, \
                     usage_status) VALUES ('{id}', 1, 'key_1', 'openai', 'POST', '/', 200, 1, \
                     false, 1, {huge}, {huge}, 'reported')"
                ))
                .await
                .unwrap();
            store
                .conn()
                .execute_unprepared(&format!(
                    "INSERT INTO usage_rollups (day, agent, user_id, env, provider, model, key_id, \
                     requests, input_tokens, output_tokens, cached_input_tokens, reasoning_tokens, \
                     cost_micros, unpriced, unmetered, errors) VALUES ({day}, '', '', '', \
                     'openai', '', 'key_1', 1, {huge}, 0, 0, 0, {huge}, 0, 0, 0)"
                ))
                .await
                .unwrap();
        }
        let usage = UsageReports::new(store.clone());
        for totals in [true, false] {
            for dims in [vec![], vec![Dimension::Agent]] {
                let r = usage
                    .report_with(&dims, &UsageFilter::default(), 0, totals)
                    .await
                    .unwrap();
                assert_eq!(r.total.requests, 4);
                assert_eq!(r.total.cost_micros, u64::try_from(i64::MAX).unwrap());
                assert_eq!(r.total.input_tokens, u64::try_from(i64::MAX).unwrap());
            }
        }
        store.close().await.unwrap();
    }

    #[tokio::test]
    async fn huge_sums_saturate_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        huge_sums_saturate_on(&format!("sqlite://{}/h.db?mode=rwc", dir.path().display())).await;
    }

    #[tokio::test]
    async fn huge_sums_saturate_postgres() {
        let Some(db) = crate::scratch::ScratchPg::for_tests().await else {
            return;
        };
        huge_sums_saturate_on(&db.url).await;
        crate::scratch::drop_test_db(&db.url).await;
    }
}
