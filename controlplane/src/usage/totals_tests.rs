//! The running totals (m0019: `signal_totals`, `usage_totals`, `latency_totals`) answer exactly
//! what the stored rows answer: signal counts, usage reports and latency percentiles over ranges
//! of whole days and ranges that start or end mid-day, on SQLite and PostgreSQL; after the
//! migration fills them from rows already stored; after retention deleted rows (the totals keep
//! the deleted rows' history); after an end user is forgotten (no total keeps the id).

use std::collections::BTreeMap;
use std::time::Duration;

use nm_types::record::Inferred;
use nm_types::signal::{Rule, Signal};
use nm_types::{Action, Env};
use sea_orm::ConnectionTrait;
use sea_orm_migration::MigratorTrait;

use super::latency::LatencyReport;
use super::{Dimension, UsageFilter, UsageReport, UsageReports};
use crate::records::{RequestRecord, Usage, UsageStatus};
use crate::retention::{Retainer, Retention};
use crate::signals::{SignalFilter, Signals, counts_sql_with};
use crate::store::{Migrator, Store};
use crate::{Budgets, Records};

const DAY: i64 = 86_400_000;
/// The first day of the data: 2026-11-23, a Monday.
const D0: i64 = 20_780;
const DAYS: i64 = 4;
const RECORDS: i64 = 480;

/// A small deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn pick<'a, T>(&mut self, of: &'a [T]) -> &'a T {
        &of[(self.next() % of.len() as u64) as usize]
    }
}

fn request_id(i: i64) -> String {
    format!("01890a5d-ac96-774b-bcce-{i:012}")
}

fn record(i: i64, rng: &mut Rng) -> RequestRecord {
    let started = D0 * DAY + i * (DAYS * DAY / RECORDS) + (rng.next() % 1_000) as i64;
    let metered = !rng.next().is_multiple_of(5);
    let inferred = if i % 3 == 1 {
        vec![Inferred {
            rule: *rng.pick(&[Rule::Reask, Rule::HistoryEdit, Rule::Continued]),
            answer: request_id(i - 1).parse().unwrap(),
            edit_distance: Some(rng.next() % 40),
        }]
    } else {
        Vec::new()
    };
    RequestRecord {
        request_id: request_id(i),
        started_at_ms: started,
        key_id: (*rng.pick(&["key_1", "key_2"])).into(),
        provider: (*rng.pick(&["openai", "anthropic"])).into(),
        method: "POST".into(),
        path: "/v1/chat/completions".to_owned(),
        model: Some((*rng.pick(&["m1", "m2", "m3"])).to_owned()),
        agent: rng.pick(&[Some("a"), Some("b"), None]).map(str::to_owned),
        session_id: format!("sess_{}", i % 60).parse().ok(),
        env: *rng.pick(&[Some(Env::Production), Some(Env::Staging), None]),
        user_id: rng
            .pick(&[Some("alice"), Some("bob"), None])
            .map(str::to_owned),
        status: *rng.pick(&[200, 200, 200, 500]),
        latency_ms: 3 + rng.next() % 30_000,
        ttfb_ms: (!rng.next().is_multiple_of(3)).then(|| 1 + rng.next() % 3_000),
        streamed: true,
        response_bytes: 100,
        usage: Usage {
            model: rng
                .next()
                .is_multiple_of(4)
                .then(|| "m1-answered".to_owned()),
            input_tokens: metered.then(|| rng.next() % 1_000),
            output_tokens: metered.then(|| rng.next() % 500),
            cached_input_tokens: metered.then(|| rng.next() % 100),
            reasoning_tokens: None,
            ..Usage::default()
        },
        usage_status: if metered {
            UsageStatus::Reported
        } else {
            UsageStatus::Missing
        },
        cost_micros: (metered && !rng.next().is_multiple_of(4)).then(|| rng.next() % 10_000),
        inferred,
        ..Default::default()
    }
}

fn signal(
    id: &str,
    at: i64,
    session: Option<String>,
    request: Option<String>,
    rng: &mut Rng,
) -> Signal {
    Signal {
        id: id.to_owned(),
        received_at_ms: at,
        session_id: session.and_then(|s| s.parse().ok()),
        request_id: request.and_then(|r| r.parse().ok()),
        action: *rng.pick(&Action::ALL),
        edit_distance: Some(rng.next() % 50),
        custom_label: None,
        key_id: "key_1".into(),
        idempotency_key: None,
        agent_hint: rng.pick(&[Some("hint"), None]).map(str::to_owned),
    }
}

/// The ranges compared: everything, whole days, and ranges with ends mid-day.
fn ranges() -> Vec<(Option<i64>, Option<i64>)> {
    let at = |d: i64, frac: i64| Some((D0 + d) * DAY + frac * DAY / 8);
    vec![
        (None, None),
        (at(1, 0), None),
        (at(1, 3), None),
        (None, at(2, 5)),
        (at(0, 2), at(3, 1)),
        (at(1, 0), at(3, 0)),
        (at(1, 1), at(1, 6)),
        (at(-5, 0), at(9, 0)),
    ]
}

type Counts = BTreeMap<(String, Option<String>, String), i64>;

async fn signal_counts(store: &Store, f: &SignalFilter, totals: bool) -> Counts {
    let db = store.conn();
    let mut out = Counts::new();
    for row in db
        .query_all_raw(counts_sql_with(db.get_database_backend(), f, totals).build())
        .await
        .unwrap()
    {
        let n: i64 = row.try_get("", "n").unwrap();
        if n != 0 {
            out.insert(
                (
                    row.try_get("", "source").unwrap(),
                    row.try_get("", "rule").unwrap(),
                    row.try_get("", "action").unwrap(),
                ),
                n,
            );
        }
    }
    out
}

fn signal_filters() -> Vec<SignalFilter> {
    let mut out = Vec::new();
    for agent in [Some("a"), Some("b"), Some("hint"), None] {
        for env in [None, Some(Env::Production)] {
            for (since_ms, until_ms) in ranges() {
                out.push(SignalFilter {
                    agent: agent.map(str::to_owned),
                    env,
                    since_ms,
                    until_ms,
                });
            }
        }
    }
    out
}

const USAGE_DIMS: [&[Dimension]; 5] = [
    &[
        Dimension::Day,
        Dimension::Model,
        Dimension::Provider,
        Dimension::Agent,
        Dimension::Key,
    ],
    &[Dimension::User],
    &[],
    &[Dimension::Week, Dimension::Env],
    &[
        Dimension::Model,
        Dimension::Provider,
        Dimension::Env,
        Dimension::Week,
    ],
];

fn usage_filters() -> Vec<UsageFilter> {
    let mut out = Vec::new();
    for (since_ms, until_ms) in ranges() {
        let base = UsageFilter {
            since_ms,
            until_ms,
            ..Default::default()
        };
        out.push(base.clone());
        out.push(UsageFilter {
            agent: Some("a".to_owned()),
            ..base.clone()
        });
        out.push(UsageFilter {
            user_id: Some("alice".to_owned()),
            model: Some("m1-answered".to_owned()),
            ..base.clone()
        });
        out.push(UsageFilter {
            env: Some("staging".to_owned()),
            provider: Some("openai".to_owned()),
            ..base
        });
    }
    out
}

/// Whether the latency report is read from the totals (else from the rows alone: by key or end
/// user, or of one end user).
fn latency_from_totals(f: &UsageFilter, dims: &[Dimension]) -> bool {
    f.user_id.is_none()
        && !dims
            .iter()
            .any(|d| matches!(d, Dimension::Key | Dimension::User))
}

/// A report in an order that does not depend on ties.
fn sorted(mut r: UsageReport) -> UsageReport {
    r.rows.sort_by(|a, b| a.key.cmp(&b.key));
    r.unpriced_models
        .sort_by(|a, b| (&a.provider, &a.model).cmp(&(&b.provider, &b.model)));
    r
}

/// Every answer, from the totals (`true`) or the rows.
#[derive(Debug, PartialEq)]
struct Answers {
    signals: Vec<Counts>,
    agreement: Vec<Vec<crate::agents::AgreementCell>>,
    usage: Vec<UsageReport>,
    latency: Vec<LatencyReport>,
}

async fn answers(store: &Store, totals: bool) -> Answers {
    let usage = UsageReports::new(store.clone());
    let agents = crate::Agents::new(store.clone());
    let mut out = Answers {
        signals: Vec::new(),
        agreement: Vec::new(),
        usage: Vec::new(),
        latency: Vec::new(),
    };
    for f in signal_filters() {
        out.signals.push(signal_counts(store, &f, totals).await);
    }
    for agent in ["a", "b", "hint"] {
        out.agreement
            .push(agents.agreement_with(agent, totals).await.unwrap());
    }
    for f in usage_filters() {
        for dims in USAGE_DIMS {
            out.usage.push(sorted(
                usage.report_with(dims, &f, 10_000, totals).await.unwrap(),
            ));
            out.latency
                .push(usage.latency_with(dims, &f, 10_000, totals).await.unwrap());
        }
    }
    out
}

async fn one(store: &Store, sql: &str) -> i64 {
    let row = store
        .conn()
        .query_one_raw(sea_orm::Statement::from_string(
            store.backend(),
            sql.to_owned(),
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<i64>(0).unwrap()
}

async fn totals_equal_rows(url: &str) {
    let store = Store::connect(url).await.unwrap();
    let signals = Signals::start(store.clone());
    let records = Records::new(
        store.clone(),
        Budgets::load(store.clone(), 0).await.unwrap(),
    );
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Signals before their session's or their answer's record: stored with the hint (or no
    // agent), moved to the record's agent and env when it arrives.
    for i in 0..80 {
        let at = D0 * DAY + i * (DAYS * DAY / 80) + 7;
        let (session, request) = if i % 2 == 0 {
            (Some(format!("sess_{}", i % 60)), None)
        } else {
            (None, Some(request_id(i * 5 + 1)))
        };
        signals
            .record(signal(&format!("early{i}"), at, session, request, &mut rng))
            .await
            .unwrap();
    }
    let batch: Vec<RequestRecord> = (0..RECORDS / 2).map(|i| record(i, &mut rng)).collect();
    records.ingest(&batch).await.unwrap();

    // The migration fills the totals from the rows already stored.
    let before = answers(&store, false).await;
    assert_eq!(answers(&store, true).await, before);
    Migrator::down(store.conn(), Some(1)).await.unwrap();
    Migrator::up(store.conn(), None).await.unwrap();
    assert_eq!(answers(&store, true).await, before);

    // Then the triggers keep them.
    let batch: Vec<RequestRecord> = (RECORDS / 2..RECORDS)
        .map(|i| record(i, &mut rng))
        .collect();
    for i in 0..160 {
        let at = D0 * DAY + i * (DAYS * DAY / 160) + 11;
        let (session, request) = match i % 3 {
            0 => (Some(format!("sess_{}", i % 60)), None),
            1 => (None, Some(request_id(i * 3))),
            _ => (Some(format!("sess_new{i}")), None),
        };
        signals
            .record(signal(&format!("late{i}"), at, session, request, &mut rng))
            .await
            .unwrap();
    }
    records.ingest(&batch).await.unwrap();
    // A resent batch and a resent signal count once.
    records.ingest(&batch[..10]).await.unwrap();
    let stored = answers(&store, false).await;
    assert_eq!(answers(&store, true).await, stored);
    assert!(stored.signals[0].values().sum::<i64>() > 0, "{stored:?}");
    assert!(!stored.agreement[0].is_empty(), "{stored:?}");

    // Retention deletes the rows of the first day and a half: the totals keep them.
    let keep = Duration::from_secs(86_400);
    let cutoff = (D0 + 1) * DAY + DAY / 2;
    let retainer = Retainer::new(
        store.clone(),
        Retention {
            records: Some(keep),
            signals: Some(keep),
        },
    );
    let (_tx, rx) = tokio::sync::watch::channel(false);
    let deleted = retainer.run(cutoff + DAY, &rx).await.unwrap();
    assert!(deleted.records > 0 && deleted.signals > 0, "{deleted:?}");
    let kept = answers(&store, true).await;
    assert_eq!(kept.agreement, stored.agreement);
    // Ranges that begin before the cutoff mid-day lose their deleted edge; every other answer
    // is the one before retention.
    let unchanged =
        |(since, _): (Option<i64>, Option<i64>)| since.is_none_or(|s| s % DAY == 0 || s >= cutoff);
    for (i, f) in signal_filters().iter().enumerate() {
        if unchanged((f.since_ms, f.until_ms)) {
            assert_eq!(kept.signals[i], stored.signals[i], "{f:?}");
        }
    }
    for (i, f) in usage_filters().iter().enumerate() {
        for (j, dims) in USAGE_DIMS.iter().enumerate() {
            let at = i * USAGE_DIMS.len() + j;
            if !unchanged((f.since_ms, f.until_ms)) {
                continue;
            }
            assert_eq!(kept.usage[at], stored.usage[at], "{f:?} {dims:?}");
            if latency_from_totals(f, dims) {
                assert_eq!(kept.latency[at], stored.latency[at], "{f:?} {dims:?}");
            }
        }
    }
    // The usage reports from the rows and the rollups of the deleted records agree with them.
    assert_eq!(answers(&store, false).await.usage, kept.usage);

    // An end user forgotten: the totals keep the usage under the token, never the id.
    let users = crate::forget::Users::new(
        store.clone(),
        Budgets::load(store.clone(), 0).await.unwrap(),
    );
    let token = users.forget("key_admin", "alice").await.unwrap().token;
    assert_eq!(
        one(
            &store,
            "SELECT COUNT(*) FROM usage_totals WHERE user_id = 'alice'"
        )
        .await,
        0
    );
    assert!(
        one(
            &store,
            &format!("SELECT COUNT(*) FROM usage_totals WHERE user_id = '{token}'")
        )
        .await
            > 0
    );
    let after = answers(&store, true).await;
    assert_eq!(after.signals, kept.signals);
    assert_eq!(after.agreement, kept.agreement);
    for (i, f) in usage_filters().iter().enumerate() {
        for (j, dims) in USAGE_DIMS.iter().enumerate() {
            let at = i * USAGE_DIMS.len() + j;
            if latency_from_totals(f, dims) {
                assert_eq!(after.latency[at], kept.latency[at], "{f:?} {dims:?}");
            }
        }
    }
    assert_eq!(answers(&store, false).await.usage, after.usage);
    store.close().await.unwrap();
}

#[tokio::test]
async fn totals_equal_the_rows_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    totals_equal_rows(&format!("sqlite://{}/t.db?mode=rwc", dir.path().display())).await;
}

#[tokio::test]
async fn totals_equal_the_rows_postgres() {
    let Some(db) = crate::scratch::ScratchPg::for_tests().await else {
        return;
    };
    totals_equal_rows(&db.url).await;
    crate::scratch::drop_test_db(&db.url).await;
}

#[test]
fn ranges_split_into_whole_days_and_ends() {
    use crate::signals::{DaySplit, split_days};
    let d = |n: i64| n * DAY;
    assert_eq!(
        split_days(None, None),
        Some(DaySplit {
            from_day: None,
            to_day: None,
            edges: vec![]
        })
    );
    assert_eq!(
        split_days(Some(d(3) + 5), Some(d(6) + 7)),
        Some(DaySplit {
            from_day: Some(4),
            to_day: Some(6),
            edges: vec![(d(3) + 5, d(4)), (d(6), d(6) + 7)]
        })
    );
    assert_eq!(
        split_days(Some(d(3)), Some(d(5))),
        Some(DaySplit {
            from_day: Some(3),
            to_day: Some(5),
            edges: vec![]
        })
    );
    // No whole day inside, or before 1970: the rows answer.
    assert_eq!(split_days(Some(d(3) + 5), Some(d(4) + 7)), None);
    assert_eq!(split_days(Some(d(3) + 5), Some(d(3) + 7)), None);
    assert_eq!(split_days(Some(-5), None), None);
    assert_eq!(split_days(None, Some(0)), None);
}
