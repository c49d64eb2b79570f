//! Latency percentiles of the stored request records (`latency_ms`, `ttfb_ms`), grouped like a
//! usage report, in one query on SQLite and PostgreSQL alike.
//!
//! SQLite has no `percentile_cont`, and sorting every value of a group to pick its ranks would
//! send a million values to the controlplane. So the database counts each group's values in a
//! histogram of fixed buckets two significant digits wide (the bucket of a value is its number
//! of decimal digits and its first two digits: 0-99 ms exact, 100-999 ms by 10 ms, 1,000-9,999 ms
//! by 100 ms, ...), at most 90 buckets a decade and 9 decades (a record's durations are at most
//! a week), and the percentiles are read from the cumulative counts here: the nearest rank's
//! bucket, reported as its middle, so within 5% of the exact value. The answer is bounded by
//! groups x buckets, whatever the number of records.
//!
//! The ingest also counts every new record's two values into `latency_totals` (m0022), in the
//! same buckets, per agent, UTC day, env, provider and model ([`add_totals`], in the batch's
//! transaction). A report grouped by those (or by week) and filtered by them reads the whole
//! days of its range there and only its ends (a range starting or ending mid-day) from the
//! records: the same histograms, so the same percentiles, from a few hundred rows instead of
//! every record, and they outlive the records' retention. A report by key, session or end user,
//! or of one session or end user, reads the stored records alone: its history ends at the
//! records' retention.

use std::collections::{BTreeMap, HashMap};

use nm_types::budget::DAY_MS;
use nm_types::record::RequestRecord;
use std::sync::LazyLock;

use sea_orm::ConnectionTrait;

use super::totals::{DaySplit, split_days};
use super::{Dimension, UsageFilter, UsageReports, checked_limit, key_value, push_filter};
use crate::error::Result;
use crate::sql::Cell;
use crate::sql::{Sql, count};
use crate::store::WriteTxn;
use crate::store::upsert::Upsert;

/// The columns of `latency_totals` (m0022): its key, then the count. An absent agent, env or
/// model is stored as `''` (none of them can be empty) and read back as NULL.
const TOTAL_COLUMNS: [&str; 8] = [
    "agent", "day", "env", "provider", "model", "metric", "bucket", "n",
];

/// [`bucket_sql`] of a value in Rust, the same for every `i64`; by arithmetic (the ingest
/// computes two per record), by the text for the negative values no record has.
pub(crate) fn bucket_of(v: i64) -> i64 {
    if v < 0 {
        let text = v.to_string();
        let lead: i64 = text[..text.len().min(2)].parse().unwrap_or(0);
        return i64::try_from(text.len()).unwrap_or(0) * 100 + lead;
    }
    let digits = v.checked_ilog10().map_or(1, |l| l + 1);
    let lead = if digits <= 2 {
        v
    } else {
        v / 10_i64.pow(digits - 2)
    };
    i64::from(digits) * 100 + lead
}

/// Adds the latencies and times to first byte of `records` (new ones: each is counted once) to
/// `latency_totals`, one row per key, in key order (concurrent batches lock rows in one order).
pub(crate) async fn add_totals(txn: &WriteTxn, records: &[&RequestRecord]) -> Result<()> {
    type Key<'a> = (&'a str, i64, &'a str, &'a str, &'a str, i64, i64);
    let mut sums: HashMap<Key<'_>, i64> = HashMap::new();
    for r in records {
        let agent = r.agent.as_deref().unwrap_or("");
        let env = r.env.map_or("", |e| e.as_str());
        let model = r
            .usage
            .model
            .as_deref()
            .or(r.model.as_deref())
            .unwrap_or("");
        let day = r.started_at_ms / DAY_MS;
        for (metric, v) in [(0, Some(r.latency_ms)), (1, r.ttfb_ms)] {
            let Some(v) = v else { continue };
            let v = i64::try_from(v).unwrap_or(i64::MAX);
            *sums
                .entry((agent, day, env, &r.provider, model, metric, bucket_of(v)))
                .or_default() += 1;
        }
    }
    let mut rows: Vec<(Key<'_>, i64)> = sums.into_iter().collect();
    rows.sort_unstable();
    let mut values = Vec::with_capacity(rows.len() * TOTAL_COLUMNS.len());
    for ((agent, day, env, provider, model, metric, bucket), n) in &rows {
        values.extend([
            Cell::Text(Some(agent)),
            Cell::Int(Some(*day)),
            Cell::Text(Some(env)),
            Cell::Text(Some(provider)),
            Cell::Text(Some(model)),
            Cell::Int(Some(*metric)),
            Cell::Int(Some(*bucket)),
            Cell::Int(Some(*n)),
        ]);
    }
    UPSERT.run(txn, &values).await
}

/// [`add_totals`]'s upsert: a row's count added to the one already there.
static UPSERT: LazyLock<Upsert> = LazyLock::new(|| {
    Upsert::new(
        "latency_totals",
        &TOTAL_COLUMNS,
        " ON CONFLICT (agent, day, env, provider, model, metric, bucket) \
         DO UPDATE SET n = latency_totals.n + excluded.n"
            .to_owned(),
    )
});

/// The statement that fills `latency_totals` from the stored records (m0022 on an existing
/// database): what [`add_totals`] would have added for each of them.
pub(crate) fn backfill_sql() -> String {
    format!(
        "INSERT INTO latency_totals ({}) SELECT agent, day, env, provider, model, m, {} AS b, \
         COUNT(*) FROM (SELECT COALESCE(agent, '') AS agent, started_at_ms / {DAY_MS} AS day, \
         COALESCE(env, '') AS env, provider, COALESCE(answered_model, model, '') AS model, \
         mm.m AS m, CASE WHEN mm.m = 0 THEN latency_ms ELSE ttfb_ms END AS v FROM requests \
         CROSS JOIN (SELECT 0 AS m UNION ALL SELECT 1 AS m) AS mm) AS x WHERE v IS NOT NULL \
         GROUP BY agent, day, env, provider, model, m, {}",
        TOTAL_COLUMNS.join(", "),
        bucket_sql("v"),
        bucket_sql("v")
    )
}

/// Nearest-rank percentiles of one group's values, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Percentiles {
    /// Values counted.
    pub count: u64,
    pub p50_ms: u64,
    pub p90_ms: u64,
    pub p99_ms: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LatencyRow {
    /// One value per dimension asked for, in order.
    pub key: Vec<Option<String>>,
    pub requests: u64,
    /// Start of the request to the end of its answer.
    pub latency: Percentiles,
    /// Start of the request to the answer's first byte (the records that have one).
    pub ttfb: Percentiles,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LatencyReport {
    /// Most requests first.
    pub rows: Vec<LatencyRow>,
    pub truncated: bool,
}

/// The histogram bucket of a non-negative integer `v`: its decimal digits * 100 + its first two
/// digits (`57` -> 257, `570` -> 357, `5` -> 105).
fn bucket_sql(v: &str) -> String {
    format!(
        "CAST(length(CAST({v} AS TEXT)) * 100 + CAST(substr(CAST({v} AS TEXT), 1, 2) AS INTEGER) \
         AS BIGINT)"
    )
}

/// The middle of a bucket (see [`bucket_sql`]), in the value's unit.
pub fn bucket_middle(bucket: i64) -> u64 {
    let digits = u32::try_from(bucket / 100).unwrap_or(0);
    let lead = u64::try_from(bucket % 100).unwrap_or(0);
    if digits <= 2 {
        return lead;
    }
    let step = 10_u64.saturating_pow(digits - 2);
    lead.saturating_mul(step).saturating_add(step / 2)
}

/// Nearest-rank percentiles of a histogram, `(bucket, count)` in bucket order.
pub fn percentiles(hist: &[(i64, u64)]) -> Percentiles {
    let n: u64 = hist.iter().map(|h| h.1).sum();
    if n == 0 {
        return Percentiles::default();
    }
    let at = |p: f64| {
        // The smallest value with at least ceil(p * n) values at or below it.
        let rank = ((p * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for &(b, c) in hist {
            seen += c;
            if seen >= rank {
                return bucket_middle(b);
            }
        }
        hist.last().map_or(0, |h| bucket_middle(h.0))
    };
    Percentiles {
        count: n,
        p50_ms: at(0.50),
        p90_ms: at(0.90),
        p99_ms: at(0.99),
    }
}

/// The histograms (`m`, `k0`.., `b`, `n`, one row per group and bucket, in that order) of the
/// stored records matching `filter` (its range on `time`), grouped by `dims`. One pass over the
/// records: each gives two values (metric 0, its latency; 1, its time to first byte).
/// `CROSS JOIN` keeps the records the outer loop on SQLite.
fn rows_sql(
    backend: sea_orm::DatabaseBackend,
    dims: &[Dimension],
    filter: &UsageFilter,
    time: &str,
) -> Sql {
    let mut sql = Sql::new(backend, "");
    push_rows(&mut sql, dims, filter, time);
    let group: String = (0..dims.len()).map(|i| format!(", k{i}")).collect();
    sql.push(&format!(" ORDER BY m{group}, b"));
    sql
}

/// [`rows_sql`] without its order.
fn push_rows(sql: &mut Sql, dims: &[Dimension], filter: &UsageFilter, time: &str) {
    let keys: String = dims
        .iter()
        .enumerate()
        .map(|(i, d)| format!(", {} AS k{i}", d.expr()))
        .collect();
    let group: String = (0..dims.len()).map(|i| format!(", k{i}")).collect();
    sql.push(&format!(
        "SELECT CAST(m AS BIGINT) AS m{group}, {} AS b, COUNT(*) AS n FROM (SELECT mm.m AS m{keys}, \
         CASE WHEN mm.m = 0 THEN latency_ms ELSE ttfb_ms END AS v FROM requests \
         CROSS JOIN (SELECT 0 AS m UNION ALL SELECT 1 AS m) AS mm WHERE 1 = 1",
        bucket_sql("v")
    ));
    push_filter(sql, time, filter);
    sql.push(&format!(") AS x WHERE v IS NOT NULL GROUP BY m{group}, b"));
}

/// The histograms of [`rows_sql`] from `latency_totals` for the range's whole days and from the
/// stored records for its ends (`dims` among agent, env, provider, model, day and week; no
/// session or end-user filter).
fn totals_sql(
    backend: sea_orm::DatabaseBackend,
    dims: &[Dimension],
    filter: &UsageFilter,
    split: &DaySplit,
) -> Sql {
    let keys: String = dims
        .iter()
        .enumerate()
        .map(|(i, d)| format!(", {} AS k{i}", d.column()))
        .collect();
    let group: String = (0..dims.len()).map(|i| format!(", k{i}")).collect();
    let mut sql = Sql::new(
        backend,
        &format!(
            "SELECT m{group}, b, CAST(SUM(n) AS BIGINT) AS n FROM (SELECT metric AS m{keys}, \
             bucket AS b, n FROM (SELECT NULLIF(agent, '') AS agent, NULLIF(env, '') AS env, \
             provider, NULLIF(model, '') AS model, day, metric, bucket, n FROM latency_totals \
             WHERE 1 = 1"
        ),
    );
    if let Some(from) = split.from_day {
        sql.push(" AND day >= ").bind(from);
    }
    if let Some(to) = split.to_day {
        sql.push(" AND day < ").bind(to);
    }
    let eq = [
        ("agent", &filter.agent),
        ("env", &filter.env),
        ("provider", &filter.provider),
        ("model", &filter.model),
    ];
    for (col, value) in eq {
        if let Some(v) = value {
            sql.push(&format!(" AND {col} = ")).bind(v.clone());
        }
    }
    sql.push(") AS d");
    for (since, until) in &split.edges {
        sql.push(" UNION ALL ");
        let edge = UsageFilter {
            since_ms: Some(*since),
            until_ms: Some(*until),
            ..filter.clone()
        };
        push_rows(&mut sql, dims, &edge, "started_at_ms");
    }
    sql.push(&format!(") AS t GROUP BY m{group}, b ORDER BY m{group}, b"));
    sql
}

impl UsageReports {
    /// Latency and time-to-first-byte percentiles of the stored records matching `filter`,
    /// grouped by `dims` (none: one row), most requests first, at most `limit` rows.
    #[tracing::instrument(skip_all, fields(dims = ?dims, limit))]
    pub fn latency<'a>(
        &'a self,
        dims: &'a [Dimension],
        filter: &'a UsageFilter,
        limit: u32,
    ) -> crate::BoxFuture<'a, Result<LatencyReport>> {
        Box::pin(async move { self.latency_with(dims, filter, limit, true).await })
    }

    /// [`UsageReports::latency`], reading `latency_totals` where they can answer, or (`totals`
    /// false: the tests' reference) the stored records alone.
    pub(crate) async fn latency_with(
        &self,
        dims: &[Dimension],
        filter: &UsageFilter,
        limit: u32,
        totals: bool,
    ) -> Result<LatencyReport> {
        let limit = checked_limit(dims, limit)?;
        let db = self.store.conn();
        let backend = db.get_database_backend();
        let answerable = dims.iter().all(|d| {
            matches!(
                d,
                Dimension::Agent
                    | Dimension::Env
                    | Dimension::Provider
                    | Dimension::Model
                    | Dimension::Day
                    | Dimension::Week
            )
        }) && filter.session_id.is_none()
            && filter.user_id.is_none();
        let split = if totals && answerable {
            split_days(filter.since_ms, filter.until_ms)
        } else {
            None
        };
        let sql = match &split {
            Some(split) => totals_sql(backend, dims, filter, split),
            None => {
                let time = self.time_column(filter).await?;
                rows_sql(backend, dims, filter, time)
            }
        };
        let key_names: Vec<String> = (0..dims.len()).map(|i| format!("k{i}")).collect();
        // Histograms by group key: (latency, ttfb), each in bucket order.
        type Hist = Vec<(i64, u64)>;
        let mut groups: BTreeMap<Vec<Option<String>>, (Hist, Hist)> = BTreeMap::new();
        for row in db.query_all_raw(sql.build()).await? {
            let key = dims
                .iter()
                .zip(&key_names)
                .map(|(d, name)| key_value(&row, *d, name))
                .collect::<Result<Vec<_>>>()?;
            let metric: i64 = row.try_get("", "m")?;
            let bucket: i64 = row.try_get("", "b")?;
            let n = count(&row, "n")?;
            let entry = groups.entry(key).or_default();
            let hist = if metric == 0 {
                &mut entry.0
            } else {
                &mut entry.1
            };
            hist.push((bucket, n));
        }
        let mut rows: Vec<LatencyRow> = groups
            .into_iter()
            .map(|(key, (mut lat, mut ttfb))| {
                // Sorted already by the query; sorted again so the reading never depends on it.
                lat.sort_unstable();
                ttfb.sort_unstable();
                let latency = percentiles(&lat);
                LatencyRow {
                    key,
                    requests: latency.count,
                    latency,
                    ttfb: percentiles(&ttfb),
                }
            })
            .collect();
        rows.sort_by(|a, b| b.requests.cmp(&a.requests).then_with(|| a.key.cmp(&b.key)));
        let truncated = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        Ok(LatencyReport { rows, truncated })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::RequestRecord;
    use crate::store::Store;
    use crate::{Budgets, Records};

    #[test]
    fn buckets_have_two_significant_digits() {
        assert_eq!(bucket_middle(105), 5);
        assert_eq!(bucket_middle(257), 57);
        assert_eq!(bucket_middle(357), 575);
        assert_eq!(bucket_middle(412), 1_250);
        assert_eq!(bucket_middle(599), 99_500);
        assert_eq!(
            percentiles(&[(105, 1), (257, 8), (357, 1)]),
            Percentiles {
                count: 10,
                p50_ms: 57,
                p90_ms: 57,
                p99_ms: 575
            }
        );
        assert_eq!(percentiles(&[]), Percentiles::default());
    }

    /// Exact nearest-rank percentile of `values` (sorted), rounded to its bucket's middle.
    fn exact(values: &[u64], p: f64) -> u64 {
        let rank = ((p * values.len() as f64).ceil() as usize).clamp(1, values.len());
        let v = values[rank - 1];
        let s = v.to_string();
        let lead: i64 = s[..s.len().min(2)].parse().unwrap();
        bucket_middle(s.len() as i64 * 100 + lead)
    }

    async fn percentiles_on(url: &str) {
        let store = Store::connect(url).await.unwrap();
        let records = Records::new(
            store.clone(),
            Budgets::load(store.clone(), 0).await.unwrap(),
        );
        // Two models; latencies spread over four decades, a third of them without a first byte.
        let mut batch = Vec::new();
        let mut fast = Vec::new();
        let mut slow = Vec::new();
        let mut slow_ttfb = Vec::new();
        for i in 0..600_u64 {
            let (model, latency) = if i % 3 == 0 {
                ("slow", 900 + (i * 7919) % 20_000)
            } else {
                ("fast", 3 + (i * 104_729) % 1_500)
            };
            let ttfb = (i % 2 == 0).then_some(latency / 3);
            if model == "fast" {
                fast.push(latency);
            } else {
                slow.push(latency);
                slow_ttfb.extend(ttfb);
            }
            batch.push(RequestRecord {
                request_id: format!("r{i}"),
                started_at_ms: 86_400_000 * 20_779 + i as i64,
                key_id: "key_1".into(),
                provider: "openai".into(),
                method: "POST".into(),
                path: "/v1/chat/completions".to_owned(),
                model: Some(model.to_owned()),
                agent: Some("a".to_owned()),
                status: 200,
                latency_ms: latency,
                ttfb_ms: ttfb,
                ..Default::default()
            });
        }
        records.ingest(&batch).await.unwrap();
        for v in [&mut fast, &mut slow, &mut slow_ttfb] {
            v.sort_unstable();
        }
        let usage = UsageReports::new(store.clone());
        let r = usage
            .latency(
                &[Dimension::Model, Dimension::Week],
                &UsageFilter {
                    agent: Some("a".to_owned()),
                    ..Default::default()
                },
                0,
            )
            .await
            .unwrap();
        assert!(!r.truncated);
        assert_eq!(r.rows.len(), 2);
        let row = |m: &str| {
            r.rows
                .iter()
                .find(|x| x.key[0].as_deref() == Some(m))
                .unwrap()
        };
        let (f, s) = (row("fast"), row("slow"));
        assert_eq!(f.key[1].as_deref(), Some("2026-11-16"), "the Monday");
        assert_eq!((f.requests, s.requests), (400, 200));
        for (got, want) in [
            (&f.latency, &fast),
            (&s.latency, &slow),
            (&s.ttfb, &slow_ttfb),
        ] {
            assert_eq!(got.count, want.len() as u64);
            assert_eq!(got.p50_ms, exact(want, 0.50));
            assert_eq!(got.p90_ms, exact(want, 0.90));
            assert_eq!(got.p99_ms, exact(want, 0.99));
        }
        // None: one row over everything; a limit cuts rows and says so.
        let all = usage
            .latency(&[], &UsageFilter::default(), 0)
            .await
            .unwrap();
        assert_eq!(all.rows.len(), 1);
        assert_eq!(all.rows[0].requests, 600);
        let cut = usage
            .latency(&[Dimension::Model], &UsageFilter::default(), 1)
            .await
            .unwrap();
        assert!(cut.truncated);
        assert_eq!(cut.rows[0].key, vec![Some("fast".to_owned())]);
        store.close().await.unwrap();
    }

    #[test]
    fn the_rust_bucket_is_the_sql_one() {
        for v in [
            0_i64,
            5,
            9,
            10,
            57,
            99,
            100,
            570,
            999,
            1_000,
            1_250,
            99_500,
            i64::MAX,
            -5,
            -57,
        ] {
            let s = v.to_string();
            let lead: i64 = s[..s.len().min(2)].parse().unwrap();
            assert_eq!(bucket_of(v), s.len() as i64 * 100 + lead, "{v}");
        }
        assert_eq!(bucket_of(57), 257);
        assert_eq!(bucket_of(570), 357);
        assert_eq!(bucket_of(5), 105);
    }

    /// Random records over ten days (`totals::tests::random_batches`, one batch resent) give
    /// the same latency reports from the totals as from the
    /// records alone, for every grouping the totals answer and ranges cutting days anywhere;
    /// a database filled before m0022 gets the same totals from its backfill; retention's
    /// deletion of records leaves the totals' whole days as they were.
    async fn totals_equal_rows_on(url: &str) {
        let store = Store::connect(url).await.unwrap();
        let records = Records::new(
            store.clone(),
            Budgets::load(store.clone(), 0).await.unwrap(),
        );
        let t0 = 86_400_000 * 20_770;
        let batches = super::super::totals::tests::random_batches(t0, 7);
        for batch in &batches {
            records.ingest(batch).await.unwrap();
        }
        // Resent: skipped, not counted again.
        records.ingest(&batches[3]).await.unwrap();
        let usage = UsageReports::new(store.clone());
        let d = 86_400_000;
        let ranges = [
            (None, None),
            (Some(t0 + 3 * d + 17), Some(t0 + 8 * d + 5)),
            (Some(t0 + 2 * d), Some(t0 + 6 * d)),
            (Some(t0 + d / 2), None),
            (None, Some(t0 + 4 * d + 1)),
        ];
        let groupings: [&[Dimension]; 6] = [
            &[],
            &[Dimension::Model],
            &[Dimension::Agent, Dimension::Env],
            &[Dimension::Provider, Dimension::Week],
            &[Dimension::Day],
            &[
                Dimension::Model,
                Dimension::Provider,
                Dimension::Env,
                Dimension::Week,
            ],
        ];
        let compare = |label: &'static str| {
            let usage = usage.clone();
            async move {
                for (since_ms, until_ms) in ranges {
                    for agent in [None, Some("a".to_owned())] {
                        for dims in groupings {
                            let f = UsageFilter {
                                since_ms,
                                until_ms,
                                agent: agent.clone(),
                                ..Default::default()
                            };
                            let got = usage.latency_with(dims, &f, 0, true).await.unwrap();
                            let want = usage.latency_with(dims, &f, 0, false).await.unwrap();
                            assert_eq!(got, want, "{label}: {dims:?} {f:?}");
                        }
                    }
                }
            }
        };
        compare("kept by the ingest").await;
        let all = usage
            .latency_with(&[], &UsageFilter::default(), 0, true)
            .await
            .unwrap();
        assert_eq!(all.rows[0].requests, 12 * 150);
        // The backfill of m0022 gives the totals the ingest kept.
        let totals = |store: Store| async move {
            let rows = store
                .conn()
                .query_all_raw(
                    Sql::new(
                        store.backend(),
                        "SELECT agent, day, env, provider, model, metric, bucket, n \
                         FROM latency_totals ORDER BY 1, 2, 3, 4, 5, 6, 7",
                    )
                    .build(),
                )
                .await
                .unwrap();
            rows.iter()
                .map(|r| {
                    (
                        r.try_get::<String>("", "agent").unwrap(),
                        r.try_get::<i64>("", "day").unwrap(),
                        r.try_get::<String>("", "model").unwrap(),
                        r.try_get::<i64>("", "metric").unwrap(),
                        r.try_get::<i64>("", "bucket").unwrap(),
                        r.try_get::<i64>("", "n").unwrap(),
                    )
                })
                .collect::<Vec<_>>()
        };
        let kept = totals(store.clone()).await;
        store
            .conn()
            .execute_unprepared("DELETE FROM latency_totals")
            .await
            .unwrap();
        store
            .conn()
            .execute_unprepared(&backfill_sql())
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
            .latency_with(&[Dimension::Day], &ten_days, 0, true)
            .await
            .unwrap();
        store
            .conn()
            .execute_unprepared(&format!(
                "DELETE FROM requests WHERE started_at_ms < {}",
                t0 + 5 * d
            ))
            .await
            .unwrap();
        let after = usage
            .latency_with(&[Dimension::Day], &ten_days, 0, true)
            .await
            .unwrap();
        assert_eq!(before, after);
        store.close().await.unwrap();
    }

    #[tokio::test]
    async fn latency_totals_equal_the_records_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        totals_equal_rows_on(&format!("sqlite://{}/t.db?mode=rwc", dir.path().display())).await;
    }

    #[tokio::test]
    async fn latency_totals_equal_the_records_postgres() {
        let Some(db) = crate::scratch::ScratchPg::for_tests().await else {
            return;
        };
        totals_equal_rows_on(&db.url).await;
        crate::scratch::drop_test_db(&db.url).await;
    }

    #[tokio::test]
    async fn latency_percentiles_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        percentiles_on(&format!("sqlite://{}/l.db?mode=rwc", dir.path().display())).await;
    }

    #[tokio::test]
    async fn latency_percentiles_postgres() {
        let Some(db) = crate::scratch::ScratchPg::for_tests().await else {
            return;
        };
        percentiles_on(&db.url).await;
        crate::scratch::drop_test_db(&db.url).await;
    }
}
