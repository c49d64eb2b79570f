//! Usage per UTC day, kept current at ingest: each new record's measures are added to its row of
//! `usage_rollups` (day, agent, end user, env, provider, model, key) in the batch's transaction
//! ([`add_totals`]), and m0023 added the records stored before it ([`backfill_sql`]). So the
//! table holds the usage of every record ever stored, whether retention has deleted it since or
//! not, and a report reads the whole days of its range there and only its ends (a range that
//! starts or ends mid-day) from the records ([`super::UsageReports::report`]).

use std::collections::HashMap;
use std::sync::LazyLock;

use nm_types::UsageStatus;
use nm_types::budget::DAY_MS;
use nm_types::record::RequestRecord;
use sea_orm::DatabaseBackend;

use super::{ERRORS, UNMETERED, UNPRICED};
use crate::error::Result;
use crate::sql::Cell;
use crate::store::WriteTxn;
use crate::store::upsert::Upsert;

/// The key columns of `usage_rollups` (m0014). An absent agent, end user, env or model is stored
/// as `''` (none of them can be empty) and read back as NULL.
const KEY_COLUMNS: [&str; 7] = [
    "day", "agent", "user_id", "env", "provider", "model", "key_id",
];

/// The measure columns of `usage_rollups`, in the order [`Measures`] holds them.
pub(crate) const MEASURE_COLUMNS: [&str; 9] = [
    "requests",
    "input_tokens",
    "output_tokens",
    "cached_input_tokens",
    "reasoning_tokens",
    "cost_micros",
    "unpriced",
    "unmetered",
    "errors",
];

/// One record's (or a group's) measures, in [`MEASURE_COLUMNS`] order: what the reports' SQL
/// sums over the stored rows ([`super::UNPRICED`], [`super::UNMETERED`], [`super::ERRORS`]).
type Measures = [i64; 9];

fn measures_of(r: &RequestRecord) -> Measures {
    let n = |v: Option<u64>| v.map_or(0, |v| i64::try_from(v).unwrap_or(i64::MAX));
    let u = &r.usage;
    let metered = u.input_tokens.is_some() || u.output_tokens.is_some();
    [
        1,
        n(u.input_tokens),
        n(u.output_tokens),
        n(u.cached_input_tokens),
        n(u.reasoning_tokens),
        n(r.cost_micros),
        i64::from(r.cost_micros.is_none() && metered),
        i64::from(r.usage_status != UsageStatus::NotApplicable && !metered),
        i64::from(r.status >= 400),
    ]
}

/// The `ON CONFLICT` clause that adds a row's measures to those already there.
pub(crate) fn add_on_conflict() -> String {
    format!(
        " ON CONFLICT ({}) DO UPDATE SET {}",
        KEY_COLUMNS.join(", "),
        MEASURE_COLUMNS
            .iter()
            .map(|c| format!("{c} = usage_rollups.{c} + excluded.{c}"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Adds the usage of `records` (new ones: each is counted once) to `usage_rollups`, one row per
/// key, in key order (concurrent batches lock rows in one order).
pub(crate) async fn add_totals(txn: &WriteTxn, records: &[&RequestRecord]) -> Result<()> {
    type Key<'a> = (i64, &'a str, &'a str, &'a str, &'a str, &'a str, &'a str);
    // Sized for a row per record (a batch's records mostly name different end users): grown
    // from empty, the map rehashed several times per batch.
    let mut sums: HashMap<Key<'_>, Measures> = HashMap::with_capacity(records.len());
    for r in records {
        let model = r
            .usage
            .model
            .as_deref()
            .or(r.model.as_deref())
            .unwrap_or("");
        let key = (
            r.started_at_ms / DAY_MS,
            r.agent.as_deref().unwrap_or(""),
            r.user_id.as_deref().unwrap_or(""),
            r.env.map_or("", |e| e.as_str()),
            &*r.provider,
            model,
            &*r.key_id,
        );
        let sum = sums.entry(key).or_default();
        for (s, v) in sum.iter_mut().zip(measures_of(r)) {
            *s = s.saturating_add(v);
        }
    }
    let mut rows: Vec<(Key<'_>, Measures)> = sums.into_iter().collect();
    rows.sort_unstable();
    let mut values = Vec::with_capacity(rows.len() * COLUMNS.len());
    for ((day, agent, user, env, provider, model, key), measures) in &rows {
        values.push(Cell::Int(Some(*day)));
        values.extend([agent, user, env, provider, model, key].map(|t| Cell::Text(Some(t))));
        values.extend(measures.iter().map(|m| Cell::Int(Some(*m))));
    }
    UPSERT.run(txn, &values).await
}

/// The columns of `usage_rollups` [`add_totals`] writes: its key, then its measures.
const COLUMNS: [&str; KEY_COLUMNS.len() + MEASURE_COLUMNS.len()] = {
    let mut columns = [""; KEY_COLUMNS.len() + MEASURE_COLUMNS.len()];
    let mut i = 0;
    while i < columns.len() {
        columns[i] = if i < KEY_COLUMNS.len() {
            KEY_COLUMNS[i]
        } else {
            MEASURE_COLUMNS[i - KEY_COLUMNS.len()]
        };
        i += 1;
    }
    columns
};

/// [`add_totals`]'s upsert.
static UPSERT: LazyLock<Upsert> =
    LazyLock::new(|| Upsert::new("usage_rollups", &COLUMNS, add_on_conflict()));

/// The statement that adds the stored records to `usage_rollups` (m0023 on an existing
/// database, whose rollups held only the records retention had deleted): what [`add_totals`]
/// would have added for each of them. `undo`: takes them away again (m0023's `down`; the rows
/// left at zero requests are then deleted).
pub fn backfill_sql(backend: DatabaseBackend, undo: bool) -> String {
    let sign = if undo { "-" } else { "" };
    let s = |e: &str| match backend {
        DatabaseBackend::Postgres => format!("{sign}CAST(COALESCE(SUM({e}), 0) AS BIGINT)"),
        _ => format!("{sign}COALESCE(SUM({e}), 0)"),
    };
    let measures = [
        match backend {
            DatabaseBackend::Postgres => format!("{sign}CAST(COUNT(*) AS BIGINT)"),
            _ => format!("{sign}COUNT(*)"),
        },
        s("input_tokens"),
        s("output_tokens"),
        s("cached_input_tokens"),
        s("reasoning_tokens"),
        s("cost_micros"),
        s(UNPRICED),
        s(UNMETERED),
        s(ERRORS),
    ];
    format!(
        "INSERT INTO usage_rollups ({}, {}) SELECT started_at_ms / {DAY_MS}, \
         COALESCE(agent, ''), COALESCE(user_id, ''), COALESCE(env, ''), provider, \
         COALESCE(answered_model, model, ''), key_id, {} FROM requests \
         GROUP BY 1, 2, 3, 4, 5, 6, 7{}",
        KEY_COLUMNS.join(", "),
        MEASURE_COLUMNS.join(", "),
        measures.join(", "),
        add_on_conflict()
    )
}

/// A time range as the day totals (`usage_rollups`, `latency_totals`) answer it: the whole UTC
/// days inside it, read from the totals, and what is left at its ends, read from the stored
/// records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct DaySplit {
    /// The whole days: `day >= from_day` (`None`: from the first), `day < to_day` (`None`: to
    /// the last).
    pub(super) from_day: Option<i64>,
    pub(super) to_day: Option<i64>,
    /// The ends, `[since, until)` in ms, each within one day.
    pub(super) edges: Vec<(i64, i64)>,
}

/// `[since, until)` split into whole UTC days and its ends; `None` when it holds no whole day
/// (read it from the records) or reaches before 1970 (a day is `ms / 86400000`, truncated:
/// whole days only from 1970 on).
pub(super) fn split_days(since: Option<i64>, until: Option<i64>) -> Option<DaySplit> {
    if since.is_some_and(|s| s < 0) || until.is_some_and(|u| u <= 0) {
        return None;
    }
    let from_day = since.map(|s| s / DAY_MS + i64::from(s % DAY_MS != 0));
    let to_day = until.map(|u| u / DAY_MS);
    if let (Some(from), Some(to)) = (from_day, to_day)
        && from >= to
    {
        return None;
    }
    let mut edges = Vec::new();
    if let (Some(s), Some(from)) = (since, from_day)
        && s < from * DAY_MS
    {
        edges.push((s, from * DAY_MS));
    }
    if let (Some(u), Some(to)) = (until, to_day)
        && to * DAY_MS < u
    {
        edges.push((to * DAY_MS, u));
    }
    Some(DaySplit {
        from_day,
        to_day,
        edges,
    })
}

#[cfg(test)]
pub(super) mod tests {
    use sea_orm::ConnectionTrait;

    use super::*;

    #[test]
    fn a_record_counts_as_the_reports_sql_counts_it() {
        let mut r = RequestRecord {
            status: 502,
            usage_status: UsageStatus::Missing,
            ..Default::default()
        };
        assert_eq!(measures_of(&r), [1, 0, 0, 0, 0, 0, 0, 1, 1]);
        r.status = 200;
        r.usage.input_tokens = Some(10);
        r.usage_status = UsageStatus::Reported;
        assert_eq!(measures_of(&r), [1, 10, 0, 0, 0, 0, 1, 0, 0]);
        r.cost_micros = Some(7);
        r.usage.output_tokens = Some(u64::MAX);
        assert_eq!(measures_of(&r), [1, 10, i64::MAX, 0, 0, 7, 0, 0, 0]);
        r.usage = Default::default();
        r.cost_micros = None;
        r.usage_status = UsageStatus::NotApplicable;
        assert_eq!(measures_of(&r), [1, 0, 0, 0, 0, 0, 0, 0, 0]);
    }

    /// Twelve batches of 150 random records over the ten days from `t0`: agents, end users,
    /// envs, models (as asked and as answered) absent or present, two keys and providers, error
    /// statuses, usage reported, partial, missing or not applicable, priced or not, latencies
    /// over five decades, some without a first byte. The day totals' tests ingest them.
    pub(in crate::usage) fn random_batches(t0: i64, seed: u64) -> Vec<Vec<RequestRecord>> {
        use crate::analytics::synthetic::Rng;
        use crate::records::Usage;
        let mut rng = Rng::new(seed);
        let mut batches = Vec::new();
        for b in 0..12 {
            let mut batch = Vec::new();
            for i in 0..150 {
                let mut pick = |n: u64| rng.below(n);
                let tokens = [None, Some(pick(5_000))][pick(4).min(1) as usize];
                let usage_status = match (tokens, pick(3)) {
                    (Some(_), 0) => UsageStatus::Partial,
                    (Some(_), _) => UsageStatus::Reported,
                    (None, 0) => UsageStatus::NotApplicable,
                    (None, _) => UsageStatus::Missing,
                };
                let latency = [100, 2_000, 60_000, 1_000_000][pick(4) as usize];
                let latency = pick(latency);
                batch.push(RequestRecord {
                    request_id: format!("r{b}-{i}"),
                    started_at_ms: t0 + i64::try_from(pick(10 * DAY_MS as u64)).unwrap(),
                    key_id: ["key_1", "key_2"][pick(2) as usize].into(),
                    provider: ["openai", "anthropic"][pick(2) as usize].into(),
                    method: "POST".into(),
                    path: "/v1/chat/completions".to_owned(),
                    model: [None, Some("m1"), Some("m2")][pick(3) as usize].map(str::to_owned),
                    agent: [None, Some("a"), Some("b")][pick(3) as usize].map(str::to_owned),
                    user_id: [None, Some("u1"), Some("u2"), Some("u3")][pick(4) as usize]
                        .map(str::to_owned),
                    session_id: Some(format!("sess_{}", pick(40)).parse().unwrap()),
                    env: [None, Some(nm_types::Env::Production)][pick(2) as usize],
                    status: [200, 200, 429, 502][pick(4) as usize],
                    latency_ms: latency,
                    ttfb_ms: (pick(3) > 0).then_some(latency / 3),
                    usage: Usage {
                        model: (pick(4) == 0).then(|| "m1-answered".to_owned()),
                        input_tokens: tokens,
                        output_tokens: tokens.map(|t| t / 3),
                        cached_input_tokens: tokens.map(|t| t / 5),
                        reasoning_tokens: tokens.map(|t| t / 7),
                        ..Default::default()
                    },
                    usage_status,
                    cost_micros: tokens.filter(|_| pick(5) > 0).map(|t| t * 3),
                    ..Default::default()
                });
            }
            batches.push(batch);
        }
        batches
    }

    /// The report from the day totals equals the report from the records alone, for groupings
    /// by every dimension but the session and ranges cutting days anywhere; a database filled
    /// before m0023 gets the same totals from its backfill, and its undo takes them away;
    /// deleting records (as retention does) leaves the whole days as they were.
    async fn totals_equal_rows_on(url: &str) {
        use crate::sql::Sql;
        use crate::store::Store;
        use crate::usage::{Dimension, UsageFilter, UsageReport, UsageReports};
        use crate::{Budgets, Records};
        let store = Store::connect(url).await.unwrap();
        let records = Records::new(
            store.clone(),
            Budgets::load(store.clone(), 0).await.unwrap(),
        );
        let t0 = DAY_MS * 20_770;
        let batches = random_batches(t0, 11);
        for batch in &batches {
            records.ingest(batch).await.unwrap();
        }
        // Resent: skipped, not counted again.
        records.ingest(&batches[3]).await.unwrap();
        let usage = UsageReports::new(store.clone());
        let d = DAY_MS;
        let ranges = [
            (None, None),
            (Some(t0 + 3 * d + 17), Some(t0 + 8 * d + 5)),
            (Some(t0 + 2 * d), Some(t0 + 6 * d)),
            (Some(t0 + d / 2), None),
            (None, Some(t0 + 4 * d + 1)),
        ];
        let groupings: [&[Dimension]; 7] = [
            &[],
            &[Dimension::Model],
            &[Dimension::Agent, Dimension::Env],
            &[Dimension::Provider, Dimension::Week],
            &[Dimension::Day, Dimension::Key],
            &[Dimension::User, Dimension::Model],
            &[
                Dimension::Day,
                Dimension::Model,
                Dimension::Provider,
                Dimension::Agent,
                Dimension::Key,
            ],
        ];
        // Groups of equal cost and requests may come in either order: compared sorted.
        let sorted = |mut r: UsageReport| {
            r.rows.sort_by(|a, b| a.key.cmp(&b.key));
            r.unpriced_models
                .sort_by(|a, b| (&a.provider, &a.model).cmp(&(&b.provider, &b.model)));
            r
        };
        let filters = [
            UsageFilter::default(),
            UsageFilter {
                agent: Some("a".to_owned()),
                ..Default::default()
            },
            UsageFilter {
                user_id: Some("u2".to_owned()),
                model: Some("m1-answered".to_owned()),
                ..Default::default()
            },
        ];
        let compare = |label: &'static str| {
            let usage = usage.clone();
            let filters = filters.clone();
            async move {
                for (since_ms, until_ms) in ranges {
                    for filter in &filters {
                        for dims in groupings {
                            let f = UsageFilter {
                                since_ms,
                                until_ms,
                                ..filter.clone()
                            };
                            let got = usage.report_with(dims, &f, 10_000, true).await.unwrap();
                            let want = usage.report_with(dims, &f, 10_000, false).await.unwrap();
                            assert_eq!(sorted(got), sorted(want), "{label}: {dims:?} {f:?}");
                        }
                    }
                }
            }
        };
        compare("kept by the ingest").await;
        let all = usage.report(&[], &UsageFilter::default(), 0).await.unwrap();
        assert_eq!(all.total.requests, 12 * 150);
        assert!(all.total.unpriced_requests > 0 && all.total.unmetered_requests > 0);
        assert!(all.total.errors > 0 && !all.unpriced_models.is_empty());
        // The backfill of m0023 gives the totals the ingest kept; its undo takes them away.
        let totals = |store: Store| async move {
            let columns = KEY_COLUMNS.iter().chain(&MEASURE_COLUMNS).copied();
            let rows = store
                .conn()
                .query_all_raw(
                    Sql::new(
                        store.backend(),
                        &format!(
                            "SELECT {} FROM usage_rollups ORDER BY 1, 2, 3, 4, 5, 6, 7",
                            columns.clone().collect::<Vec<_>>().join(", ")
                        ),
                    )
                    .build(),
                )
                .await
                .unwrap();
            rows.iter()
                .map(|r| {
                    columns
                        .clone()
                        .map(|c| match c {
                            "day"
                            | "requests"
                            | "input_tokens"
                            | "output_tokens"
                            | "cached_input_tokens"
                            | "reasoning_tokens"
                            | "cost_micros"
                            | "unpriced"
                            | "unmetered"
                            | "errors" => r.try_get::<i64>("", c).unwrap().to_string(),
                            _ => r.try_get::<String>("", c).unwrap(),
                        })
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        };
        let kept = totals(store.clone()).await;
        assert!(kept.len() > 100, "{} rows", kept.len());
        let db = store.conn();
        let backend = store.backend();
        db.execute_unprepared(&backfill_sql(backend, true))
            .await
            .unwrap();
        db.execute_unprepared("DELETE FROM usage_rollups WHERE requests = 0")
            .await
            .unwrap();
        assert_eq!(totals(store.clone()).await, Vec::<Vec<String>>::new());
        db.execute_unprepared(&backfill_sql(backend, false))
            .await
            .unwrap();
        assert_eq!(totals(store.clone()).await, kept);
        // Records deleted (as retention does): whole days still answer from the totals.
        let ten_days = UsageFilter {
            since_ms: Some(t0),
            until_ms: Some(t0 + 10 * d),
            ..Default::default()
        };
        let before = usage
            .report(&[Dimension::Day, Dimension::User], &ten_days, 0)
            .await
            .unwrap();
        db.execute_unprepared(&format!(
            "DELETE FROM requests WHERE started_at_ms < {}",
            t0 + 5 * d
        ))
        .await
        .unwrap();
        let after = usage
            .report(&[Dimension::Day, Dimension::User], &ten_days, 0)
            .await
            .unwrap();
        assert_eq!(sorted(before), sorted(after));
        store.close().await.unwrap();
    }

    #[tokio::test]
    async fn usage_totals_equal_the_records_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        totals_equal_rows_on(&format!("sqlite://{}/t.db?mode=rwc", dir.path().display())).await;
    }

    #[tokio::test]
    async fn usage_totals_equal_the_records_postgres() {
        let Some(db) = crate::scratch::ScratchPg::for_tests().await else {
            return;
        };
        totals_equal_rows_on(&db.url).await;
        crate::scratch::drop_test_db(&db.url).await;
    }

    #[test]
    fn ranges_split_into_whole_days_and_ends() {
        let d = DAY_MS;
        assert_eq!(
            split_days(Some(3 * d + 5), Some(7 * d + 9)),
            Some(DaySplit {
                from_day: Some(4),
                to_day: Some(7),
                edges: vec![(3 * d + 5, 4 * d), (7 * d, 7 * d + 9)],
            })
        );
        assert_eq!(
            split_days(Some(3 * d), None),
            Some(DaySplit {
                from_day: Some(3),
                to_day: None,
                edges: vec![],
            })
        );
        assert_eq!(split_days(Some(3 * d + 5), Some(4 * d + 9)), None);
        assert_eq!(split_days(Some(-5), Some(4 * d)), None);
    }
}
