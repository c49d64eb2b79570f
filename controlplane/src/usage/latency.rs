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
//! A trigger (m0019) counts every record's two values into `latency_totals` as it is stored,
//! per agent, UTC day, env, provider and model, in the same buckets: a report grouped by those
//! (and week) and filtered by them reads the range's whole days there and its ends (a range
//! that starts or ends mid-day) from the records, so the percentiles are the same as from the
//! records alone, and they outlive the records' retention. A report by key, session or end user
//! (or of one session or end user) reads the stored records alone: its history ends at the
//! records' retention.

use std::collections::BTreeMap;

use sea_orm::ConnectionTrait;

use super::{DEFAULT_ROWS, Dimension, MAX_ROWS, UsageFilter, UsageReports, key_value, push_filter};
use crate::error::{Error, Result};
use crate::sql::{Sql, count};

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

/// The histogram rows (`m`, `k0`.., `b`, `n`) of the raw records matching `filter` (the
/// columns `agent`, `env`, `provider`, `model`, `day`, `m`, `b`, `n`, one row per bucket).
fn push_raw_histogram(sql: &mut Sql, time: &str, filter: &UsageFilter) {
    sql.push(&format!(
        "SELECT agent, env, provider, model, day, m, {} AS b, COUNT(*) AS n FROM (SELECT \
         agent, env, provider, COALESCE(answered_model, model) AS model, \
         started_at_ms / 86400000 AS day, CAST(mm.m AS BIGINT) AS m, \
         CASE WHEN mm.m = 0 THEN latency_ms ELSE ttfb_ms END AS v FROM requests \
         CROSS JOIN (SELECT 0 AS m UNION ALL SELECT 1 AS m) AS mm WHERE 1 = 1",
        bucket_sql("v")
    ));
    push_filter(sql, time, filter);
    sql.push(") AS x WHERE v IS NOT NULL GROUP BY agent, env, provider, model, day, m, b");
}

/// The histograms by group from `latency_totals` for the range's whole days and from the
/// stored records for its ends (the dimensions are among agent, env, provider, model, day and
/// week; no session or user filter).
fn totals_sql(
    backend: sea_orm::DatabaseBackend,
    dims: &[Dimension],
    filter: &UsageFilter,
    split: &crate::signals::DaySplit,
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
            "SELECT m{keys}, b, CAST(SUM(n) AS BIGINT) AS n FROM (SELECT NULLIF(agent, '') AS \
             agent, NULLIF(env, '') AS env, provider, NULLIF(model, '') AS model, day, \
             metric AS m, bucket AS b, n FROM latency_totals WHERE 1 = 1"
        ),
    );
    crate::signals::push_whole_days(&mut sql, split);
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
    for (i, (since, until)) in split.edges.iter().enumerate() {
        sql.push(" UNION ALL SELECT * FROM (");
        push_raw_histogram(
            &mut sql,
            "started_at_ms",
            &UsageFilter {
                since_ms: Some(*since),
                until_ms: Some(*until),
                ..filter.clone()
            },
        );
        sql.push(&format!(") AS e{i}"));
    }
    sql.push(&format!(") AS t GROUP BY m{group}, b ORDER BY m{group}, b"));
    sql
}

impl UsageReports {
    /// The histograms by group (`m`, `k0`.., `b`, `n`) read from the stored records alone.
    async fn rows_sql(
        &self,
        backend: sea_orm::DatabaseBackend,
        dims: &[Dimension],
        filter: &UsageFilter,
    ) -> Result<Sql> {
        let time = self.time_column(filter).await?;
        let keys: String = dims
            .iter()
            .enumerate()
            .map(|(i, d)| format!(", {} AS k{i}", d.expr()))
            .collect();
        let group: String = (0..dims.len()).map(|i| format!(", k{i}")).collect();
        // One pass over the records: each gives two values (metric 0, its latency; 1, its time
        // to first byte), counted by group and bucket. `CROSS JOIN` keeps the records the outer
        // loop on SQLite.
        let mut sql = Sql::new(
            backend,
            &format!(
                "SELECT CAST(m AS BIGINT) AS m{group}, {} AS b, COUNT(*) AS n FROM (SELECT mm.m AS m{keys}, \
                 CASE WHEN mm.m = 0 THEN latency_ms ELSE ttfb_ms END AS v FROM requests \
                 CROSS JOIN (SELECT 0 AS m UNION ALL SELECT 1 AS m) AS mm WHERE 1 = 1",
                bucket_sql("v")
            ),
        );
        push_filter(&mut sql, time, filter);
        sql.push(&format!(
            ") AS x WHERE v IS NOT NULL GROUP BY m{group}, b ORDER BY m{group}, b"
        ));
        Ok(sql)
    }

    /// Latency and time-to-first-byte percentiles of the stored records matching `filter`,
    /// grouped by `dims` (none: one row), most requests first, at most `limit` rows.
    #[tracing::instrument(skip_all, fields(dims = ?dims, limit))]
    pub async fn latency(
        &self,
        dims: &[Dimension],
        filter: &UsageFilter,
        limit: u32,
    ) -> Result<LatencyReport> {
        self.latency_with(dims, filter, limit, true).await
    }

    /// [`UsageReports::latency`], with the running totals where they can answer or (`totals`
    /// false: the tests' reference) from the stored records alone.
    pub(crate) async fn latency_with(
        &self,
        dims: &[Dimension],
        filter: &UsageFilter,
        limit: u32,
        totals: bool,
    ) -> Result<LatencyReport> {
        if dims.len() > 7 {
            return Err(Error::InvalidArgument(
                "at most 7 group-by dimensions".to_owned(),
            ));
        }
        let limit = match limit {
            0 => DEFAULT_ROWS,
            n => n.min(MAX_ROWS),
        };
        let db = self.store.conn();
        let backend = db.get_database_backend();
        let totals = totals
            && dims.iter().all(|d| {
                matches!(
                    d,
                    Dimension::Agent
                        | Dimension::Env
                        | Dimension::Provider
                        | Dimension::Model
                        | Dimension::Day
                        | Dimension::Week
                )
            })
            && filter.session_id.is_none()
            && filter.user_id.is_none();
        let split = if totals {
            crate::signals::split_days(filter.since_ms, filter.until_ms)
        } else {
            None
        };
        let sql = match &split {
            Some(split) => totals_sql(backend, dims, filter, split),
            None => self.rows_sql(backend, dims, filter).await?,
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
