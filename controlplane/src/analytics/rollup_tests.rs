//! The rollup-based analytics give exactly what grouping the raw rows gives (the statement the
//! analytics ran before `session_rollups`, kept here as the reference), on SQLite and
//! PostgreSQL: on seeded random traffic ingested through the real paths in shuffled order, with
//! resent record batches (whole and partial), retried signals, signals that arrive before their
//! session and are re-attributed, signals that name one answer (before and after its record,
//! with and without their session, or an answer that never arrives), sessions straddling every
//! window edge, unknown costs and sessions mixing models, providers and agents. And a database filled before the migration gets
//! the same rollup as one kept by the ingest.
//!
//! The PostgreSQL variants run when `NM_TEST_POSTGRES_URL` names a server (each in a fresh
//! `nm_test_*` database, dropped at the end); without it they print `SKIPPED` and pass.

use crate::store::MigratorTrait;
use sea_orm::{ConnectionTrait, Database, DatabaseConnection, QueryResult};

use super::evidence::Evidence;
use super::outcome::{HEAVY_EDIT_CHARS, class_case};
use super::query::{
    Aggregates, Dimension, Periods, REQUEST_LOOKBACK_MS, Source, aggregates_from, implicit_beside,
    outcome_rates_from,
};
use super::report::Window;
use super::rollup::{self, SignalFacts, request_unit};
use super::synthetic::Rng;
use crate::records::{RequestRecord, Usage};
use crate::sql::Sql;
use crate::store::{Migrator, Store};
use crate::{Budgets, Records, Signals};
use nm_types::Action;
use nm_types::signal::Signal;

const HOUR: i64 = 3_600_000;
const DAY: i64 = 24 * HOUR;
const T0: i64 = 1_800_000_000_000;
use crate::scratch::{ScratchPg, drop_test_db};

/// The per-unit table as the analytics computed it before the rollup: every signal of the
/// agent in the window and every request from a day before it, grouped by unit (a session, or
/// an answer some signal names: `rollup::Unit`).
fn raw_sessions(sql: &mut Sql, agent: &str, since: i64, until: i64) {
    sql.push(&format!(
        "WITH u AS (SELECT {} AS session_id, 1 AS is_sig, received_at_ms * 4 + {} AS sig_key, \
         CASE WHEN action = '{}' THEN 1 ELSE 0 END AS regen, \
         CASE WHEN action = '{}' AND edit_distance >= {HEAVY_EDIT_CHARS} THEN 1 ELSE 0 END AS heavy, \
         CAST(NULL AS TEXT) AS model, CAST(NULL AS TEXT) AS provider, CAST(NULL AS TEXT) AS env, \
         CAST(NULL AS TEXT) AS user_id, CAST(NULL AS BIGINT) AS cost, CAST(NULL AS BIGINT) AS ttfb \
         FROM signals WHERE source = 'explicit' AND agent = ",
        rollup::SIGNAL_UNIT,
        class_case(),
        Action::Regenerated,
        Action::Edited,
    ))
    .bind(agent.to_owned())
    .push(" AND received_at_ms >= ")
    .bind(since)
    .push(" AND received_at_ms < ")
    .bind(until)
    .push(&format!(
        " UNION ALL SELECT {} AS session_id, 0, NULL, 0, 0, COALESCE(answered_model, model), \
         provider, env, user_id, cost_micros, ttfb_ms FROM requests WHERE agent = ",
        request_unit("requests.")
    ))
    .bind(agent.to_owned())
    .push(" AND started_at_ms >= ")
    .bind(since - REQUEST_LOOKBACK_MS)
    .push(" AND started_at_ms < ")
    .bind(until)
    .push(&format!(" AND {} IS NOT NULL", request_unit("requests.")))
    .push(
        "), \
         s AS MATERIALIZED (SELECT MAX(sig_key) % 4 AS cls, MAX(sig_key) / 4 AS last_ms, \
         CAST(SUM(regen) AS BIGINT) AS regens, CAST(SUM(heavy) AS BIGINT) AS heavy, \
         CAST(SUM(is_sig) AS BIGINT) AS signals, \
         CASE WHEN MIN(model) = MAX(model) THEN MIN(model) END AS model, \
         CASE WHEN MIN(provider) = MAX(provider) THEN MIN(provider) END AS provider, \
         MAX(env) AS env, MAX(user_id) AS user_id, CAST(SUM(cost) AS BIGINT) AS cost, \
         MAX(ttfb) AS ttfb, CAST(SUM(1 - is_sig) AS BIGINT) AS requests \
         FROM u GROUP BY session_id) ",
    );
}

/// The per-unit table counting implicit evidence, from every row: the agent's explicit signals
/// by their unit, its implicit signals by the unit of the answer they judge, its requests by
/// theirs, folded by [`Evidence::session_from_rows`] (explicit wins).
fn raw_sessions_with(sql: &mut Sql, ev: Evidence, agent: &str, since: i64, until: i64) {
    let implicit_unit = rollup::implicit_unit("signals.");
    sql.push(&format!(
        "WITH u AS ({} WHERE source = 'explicit' AND agent = ",
        rollup::signal_rows(&format!("{} AS session_id", rollup::SIGNAL_UNIT), "signals")
    ))
    .bind(agent.to_owned())
    .push(" AND received_at_ms >= ")
    .bind(since)
    .push(" AND received_at_ms < ")
    .bind(until)
    .push(&format!(
        " UNION ALL {} WHERE source = 'implicit' AND {implicit_unit} <> '' AND agent = ",
        rollup::implicit_rows(&format!("{implicit_unit} AS session_id"), "signals")
    ))
    .bind(agent.to_owned())
    .push(" AND received_at_ms >= ")
    .bind(since)
    .push(" AND received_at_ms < ")
    .bind(until)
    .push(&format!(
        " UNION ALL {} WHERE agent = ",
        rollup::request_rows(
            &format!("{} AS session_id", request_unit("requests.")),
            "requests"
        )
    ))
    .bind(agent.to_owned())
    .push(" AND started_at_ms >= ")
    .bind(since - REQUEST_LOOKBACK_MS)
    .push(" AND started_at_ms < ")
    .bind(until)
    .push(&format!(" AND {} IS NOT NULL", request_unit("requests.")))
    .push(&format!(
        "), s AS MATERIALIZED (SELECT {} FROM u GROUP BY session_id) ",
        ev.session_from_rows()
    ));
}

const IMPLICIT: Evidence = Evidence {
    implicit: true,
    continued: false,
};
const CONTINUED: Evidence = Evidence {
    implicit: true,
    continued: true,
};

fn raw_sessions_implicit(sql: &mut Sql, agent: &str, since: i64, until: i64) {
    raw_sessions_with(sql, IMPLICIT, agent, since, until);
}

fn raw_sessions_continued(sql: &mut Sql, agent: &str, since: i64, until: i64) {
    raw_sessions_with(sql, CONTINUED, agent, since, until);
}

/// Each evidence with its reference.
const EVIDENCES: [(Evidence, super::query::PushSessions); 3] = [
    (Evidence::EXPLICIT, raw_sessions),
    (IMPLICIT, raw_sessions_implicit),
    (CONTINUED, raw_sessions_continued),
];

// === databases ===

/// A fresh SQLite file in `dir`.
fn sqlite_url(dir: &tempfile::TempDir, name: &str) -> String {
    format!("sqlite://{}/{name}.db?mode=rwc", dir.path().display())
}

/// A fresh PostgreSQL database, or `None` (with a notice) when no server is configured.
async fn postgres_url() -> Option<String> {
    Some(ScratchPg::for_tests().await?.url)
}

/// Drops a database made by [`postgres_url`] (best effort; `.ci/run` clears leftovers).
async fn drop_postgres(url: &str) {
    drop_test_db(url).await;
}

// === traffic ===

/// One step of the ingestion, in the order it happens.
#[derive(Debug, Clone)]
enum Step {
    Records(Vec<RequestRecord>),
    /// Signals sent concurrently (they share group commits).
    Signals(Vec<Signal>),
}

fn pick<'a, T>(rng: &mut Rng, items: &'a [T]) -> &'a T {
    &items[rng.below(items.len() as u64) as usize]
}

fn shuffle<T>(rng: &mut Rng, items: &mut [T]) {
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

/// The request id of request `k` of session `n`: of the gateway's form (a UUIDv7).
fn request_id(n: usize, k: u64) -> String {
    format!("{n:08x}-{k:04x}-7000-8000-000000000000")
}

/// Seeded traffic around [`T0`] (three days either side) of agents `a` and `b`, as a shuffled
/// sequence of ingest steps with replays; some signals name an answer.
fn traffic(seed: u64, sessions: usize) -> Vec<Step> {
    traffic_with(seed, sessions, true)
}

/// [`traffic`]; with `name_answers` false, every signal names only its session (the schema
/// before m0008 has no place for a request id).
fn traffic_with(seed: u64, sessions: usize, name_answers: bool) -> Vec<Step> {
    let mut rng = Rng::new(seed);
    let mut records = Vec::new();
    let mut signals = Vec::new();
    let models = [Some("m-1"), Some("m-2"), Some("m-3"), None];
    for n in 0..sessions {
        let session_id = format!("sess_r{n}");
        let agent = if rng.chance(0.8) { "a" } else { "b" };
        let start = T0 - 3 * DAY + rng.below(6 * DAY as u64) as i64;
        let span = match rng.below(10) {
            0 => rng.below(2 * DAY as u64),
            1 | 2 => rng.below(6 * HOUR as u64),
            _ => rng.below(600_000),
        } as i64;
        // Sessions mostly keep one model; some mix.
        let session_model = *pick(&mut rng, &models);
        let requests = rng.below(4);
        for k in 0..requests {
            let at = start + rng.below(span as u64 + 1) as i64;
            let model = if rng.chance(0.8) {
                session_model
            } else {
                *pick(&mut rng, &models)
            };
            records.push(RequestRecord {
                request_id: request_id(n, k),
                started_at_ms: at,
                key_id: "key_1".into(),
                provider: (*pick(&mut rng, &["openai", "anthropic"])).into(),
                method: "POST".into(),
                path: "/v1/chat/completions".to_owned(),
                model: model.map(str::to_owned),
                agent: match rng.below(20) {
                    0 => None,
                    1 => Some(if agent == "a" { "b" } else { "a" }.to_owned()),
                    _ => Some(agent.to_owned()),
                },
                // A few records without a session: never in the rollup.
                session_id: (!rng.chance(0.03)).then(|| session_id.parse().unwrap()),
                env: pick(&mut rng, &[Some("production"), Some("staging"), None])
                    .map(|e| e.parse().unwrap()),
                user_id: pick(&mut rng, &[Some("u-1"), Some("u-2"), Some("u-3"), None])
                    .map(str::to_owned),
                status: 200,
                ttfb_ms: rng.chance(0.8).then(|| rng.below(10_000)),
                usage: Usage {
                    model: rng
                        .chance(0.3)
                        .then(|| pick(&mut rng, &models).unwrap_or("m-4").to_owned()),
                    ..Usage::default()
                },
                cost_micros: rng.chance(0.7).then(|| rng.below(20_000)),
                inferred: if name_answers {
                    inferred(&mut rng, n, k)
                } else {
                    Vec::new()
                },
                ..RequestRecord::default()
            });
        }
        for k in 0..rng.below(4) {
            let mut at = start + rng.below(span as u64 + 1) as i64;
            if rng.chance(0.3) {
                // Several signals in one millisecond: the higher class wins.
                at -= at % 60_000;
            }
            let action = *pick(&mut rng, &Action::ALL);
            let edit_distance = if action == Action::Edited || rng.chance(0.2) {
                Some(rng.below(2 * HEAVY_EDIT_CHARS))
            } else {
                None
            };
            // A third of the signals name an answer: one of the session's (with or without the
            // session), or now and then one that never arrives.
            let named = name_answers && rng.chance(0.35);
            let request = named.then(|| {
                if requests > 0 && !rng.chance(0.1) {
                    request_id(n, rng.below(requests))
                } else {
                    request_id(n, 99)
                }
            });
            let with_session = !named || rng.chance(0.5);
            signals.push(Signal {
                id: format!("s{n}-{k}"),
                received_at_ms: at,
                session_id: with_session.then(|| session_id.parse().unwrap()),
                request_id: request.map(|r| r.parse().unwrap()),
                action,
                edit_distance,
                custom_label: None,
                key_id: "key_1".into(),
                idempotency_key: rng.chance(0.5).then(|| format!("idem-{n}-{k}")),
                // Used while the session is unknown: right, wrong or none.
                agent_hint: match rng.below(5) {
                    0 => None,
                    1 => Some("c".to_owned()),
                    _ => Some(agent.to_owned()),
                },
            });
        }
    }
    shuffle(&mut rng, &mut records);
    shuffle(&mut rng, &mut signals);

    let mut steps = Vec::new();
    let mut sent: Vec<RequestRecord> = Vec::new();
    let mut rest = records.as_slice();
    while !rest.is_empty() {
        let size = (1 + rng.below(40) as usize).min(rest.len());
        let (batch, tail) = rest.split_at(size);
        rest = tail;
        let mut batch = batch.to_vec();
        if !sent.is_empty() && rng.chance(0.2) {
            // A batch partly stored already (a replay merged with new records).
            for _ in 0..1 + rng.below(5) {
                batch.push(pick(&mut rng, &sent).clone());
            }
        }
        sent.extend(batch.iter().cloned());
        steps.push(Step::Records(batch.clone()));
        if rng.chance(0.15) {
            // A batch resent whole.
            steps.push(Step::Records(batch));
        }
    }
    let mut rest = signals.as_slice();
    while !rest.is_empty() {
        let size = (1 + rng.below(20) as usize).min(rest.len());
        let (chunk, tail) = rest.split_at(size);
        rest = tail;
        let mut chunk = chunk.to_vec();
        // Retries of signals with an Idempotency-Key: a new id, maybe a later time; counted once.
        let mut retries = Vec::new();
        for s in chunk.iter().filter(|s| s.idempotency_key.is_some()) {
            if rng.chance(0.2) {
                retries.push(Signal {
                    id: format!("{}-retry", s.id),
                    received_at_ms: s.received_at_ms + rng.below(3) as i64,
                    ..s.clone()
                });
            }
        }
        chunk.extend(retries);
        steps.push(Step::Signals(chunk));
    }
    shuffle(&mut rng, &mut steps);
    steps
}

/// What the rules might have inferred from request `k` of session `n`: about itself (the
/// client left) or an earlier answer of the session (asked again, carried back edited or
/// unchanged), now and then one whose record never arrives.
fn inferred(rng: &mut Rng, n: usize, k: u64) -> Vec<nm_types::record::Inferred> {
    use nm_types::signal::Rule;
    let mut out = Vec::new();
    for rule in Rule::ALL {
        if !rng.chance(0.3) {
            continue;
        }
        let answer = match rule {
            Rule::ClientDisconnect => k,
            _ if k == 0 || rng.chance(0.1) => 99,
            _ => rng.below(k),
        };
        out.push(nm_types::record::Inferred {
            rule,
            answer: request_id(n, answer).parse().unwrap(),
            edit_distance: (rule == Rule::HistoryEdit).then(|| rng.below(2 * HEAVY_EDIT_CHARS)),
        });
    }
    out
}

/// Ingests `steps` through [`Records::ingest`] and [`Signals::record`].
async fn ingest(store: &Store, steps: Vec<Step>) {
    let budgets = Budgets::load(store.clone(), T0).await.unwrap();
    let records = Records::new(store.clone(), budgets);
    let signals = Signals::start(store.clone());
    for step in steps {
        match step {
            Step::Records(batch) => {
                records.ingest(&batch).await.unwrap();
            }
            Step::Signals(chunk) => {
                let tasks: Vec<_> = chunk
                    .into_iter()
                    .map(|s| {
                        let signals = signals.clone();
                        tokio::spawn(async move { signals.record(s).await })
                    })
                    .collect();
                for t in tasks {
                    t.await.unwrap().unwrap();
                }
            }
        }
    }
}

// === comparisons ===

/// Windows `(since, until)` whose edges cut through sessions, and one holding everything.
fn windows() -> Vec<(i64, i64)> {
    vec![
        (T0 - DAY, T0 + DAY),
        (T0, T0 + 2 * DAY + 3 * HOUR),
        (T0 + 7 * HOUR, T0 + 9 * HOUR),
        (T0 - 2 * DAY - 5 * HOUR, T0 - 13 * HOUR),
        (T0 - 10 * DAY, T0 + 10 * DAY),
    ]
}

/// Asserts that every question the analytics ask has the same answer from the rollup as from
/// the raw rows, for each agent and window; returns the number of sessions seen, and of units
/// only implicit signals count in the implicit total beside explicit evidence.
async fn assert_rollup_matches_raw(store: &Store) -> (u64, u64) {
    let mut sessions = 0;
    let mut beside_sessions = 0;
    for agent in ["a", "b", "c"] {
        for ((since, until), (ev, raw)) in windows()
            .into_iter()
            .flat_map(|w| EVIDENCES.into_iter().map(move |e| (w, e)))
        {
            let recent = until - (until - since) / 3;
            let previous = recent - (until - since) / 3;
            let got = aggregates_with(
                store,
                Source::Rollup(ev),
                agent,
                since,
                until,
                recent,
                previous,
            )
            .await;
            let want = aggregates_with(
                store,
                Source::Rows(raw),
                agent,
                since,
                until,
                recent,
                previous,
            )
            .await;
            assert_eq!(
                got, want,
                "aggregates of {agent} over [{since}, {until}) counting {ev:?}"
            );
            sessions += got.total.sessions;
            if ev == Evidence::EXPLICIT {
                // The implicit total shown beside explicit evidence, from the explicit total.
                let window = Window {
                    since_ms: since,
                    until_ms: until,
                };
                let beside = implicit_beside(store, agent, window, &got.total)
                    .await
                    .unwrap();
                let want = outcome_rates_from(
                    store,
                    Source::Rows(raw_sessions_implicit),
                    agent,
                    &[],
                    since,
                    until,
                    0,
                )
                .await
                .unwrap()
                .into_iter()
                .next()
                .unwrap_or_default();
                assert_eq!(
                    beside, want,
                    "implicit total beside explicit evidence of {agent} over [{since}, {until})"
                );
                beside_sessions += beside.sessions - got.total.sessions;
            }
            for dims in [
                &[][..],
                &[Dimension::Model],
                &[Dimension::Provider, Dimension::Env],
                &[Dimension::Week],
                &[Dimension::User],
                &[Dimension::Model, Dimension::Env, Dimension::Week],
            ] {
                let got =
                    outcome_rates_from(store, Source::Rollup(ev), agent, dims, since, until, 0)
                        .await
                        .unwrap();
                let want =
                    outcome_rates_from(store, Source::Rows(raw), agent, dims, since, until, 0)
                        .await
                        .unwrap();
                assert_eq!(
                    got, want,
                    "rates of {agent} by {dims:?} over [{since}, {until}) counting {ev:?}"
                );
            }
        }
    }
    (sessions, beside_sessions)
}

async fn aggregates_with(
    store: &Store,
    source: Source,
    agent: &str,
    since: i64,
    until: i64,
    recent: i64,
    previous: i64,
) -> Aggregates {
    aggregates_from(
        store,
        source,
        agent,
        periods(since, until, recent, previous),
    )
    .await
    .unwrap()
}

fn periods(since: i64, until: i64, recent_since: i64, previous_since: i64) -> Periods {
    Periods {
        window: Window {
            since_ms: since,
            until_ms: until,
        },
        recent_since,
        previous_since,
    }
}

/// Rollup rows with rows on both sides of a window edge: the edge path must be exercised.
async fn straddling(store: &Store) -> u64 {
    let mut n = 0;
    for (since, until) in windows() {
        let request_since = since - REQUEST_LOOKBACK_MS;
        let mut sql = Sql::new(
            store.backend(),
            "SELECT COUNT(*) AS n FROM session_rollups WHERE (first_signal_ms < ",
        );
        sql.bind(since)
            .push(" AND sig_key >= ")
            .bind(since * 4)
            .push(") OR (first_request_ms < ")
            .bind(request_since)
            .push(" AND last_request_ms >= ")
            .bind(request_since)
            .push(") OR (COALESCE(first_signal_ms, first_request_ms) < ")
            .bind(until)
            .push(" AND last_active_ms >= ")
            .bind(until)
            .push(")");
        let row = store
            .conn()
            .query_one_raw(sql.build())
            .await
            .unwrap()
            .unwrap();
        n += crate::sql::count(&row, "n").unwrap();
    }
    n
}

async fn ingested_traffic_matches(url: &str, seed: u64) {
    let store = Store::connect(url).await.unwrap();
    let steps = traffic(seed, 400);
    let mut carried = std::collections::HashMap::new();
    for step in &steps {
        if let Step::Records(batch) = step {
            for r in batch {
                carried.insert(r.request_id.clone(), r.inferred.len() as u64);
            }
        }
    }
    let expected_implicit: u64 = carried.values().sum();
    ingest(&store, steps).await;
    assert!(
        straddling(&store).await > 0,
        "no session straddles a window edge"
    );
    let (sessions, beside) = assert_rollup_matches_raw(&store).await;
    assert!(
        beside > 10,
        "{beside} units counted by implicit signals alone"
    );
    assert!(sessions > 100, "{sessions} sessions compared");
    // Answers named by signals are units of their own, with their request's model.
    let row = store
        .conn()
        .query_one_raw(
            Sql::new(
                store.backend(),
                "SELECT COUNT(*) AS n FROM session_rollups WHERE session_id NOT LIKE 'sess_%' \
             AND signals > 0 AND requests = 1",
            )
            .build(),
        )
        .await
        .unwrap()
        .unwrap();
    let answers = crate::sql::count(&row, "n").unwrap();
    assert!(answers > 20, "{answers} answers with their own unit");
    // Implicit signals: stored once each (resent batches included), in units beside explicit
    // ones, some units with both kinds.
    let count_of = |sql: &str| {
        let store = store.clone();
        let sql = sql.to_owned();
        async move {
            let row = store
                .conn()
                .query_one_raw(Sql::new(store.backend(), &sql).build())
                .await
                .unwrap()
                .unwrap();
            crate::sql::count(&row, "n").unwrap()
        }
    };
    let implicit = count_of("SELECT COUNT(*) AS n FROM signals WHERE source = 'implicit'").await;
    assert!(implicit > 100, "{implicit} implicit signals");
    assert_eq!(
        implicit, expected_implicit,
        "implicit signals stored once each"
    );
    let both = count_of(
        "SELECT COUNT(*) AS n FROM session_rollups WHERE signals > 0 AND isignals + icont > 0",
    )
    .await;
    assert!(both > 10, "{both} units with both kinds");
    store.close().await.unwrap();
}

#[tokio::test]
async fn rollup_answers_equal_raw_rows_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    for seed in [1, 2] {
        ingested_traffic_matches(&sqlite_url(&dir, &format!("t{seed}")), seed).await;
    }
}

#[tokio::test]
async fn rollup_answers_equal_raw_rows_postgres() {
    for seed in [3, 4] {
        let Some(url) = postgres_url().await else {
            return;
        };
        ingested_traffic_matches(&url, seed).await;
        drop_postgres(&url).await;
    }
}

// === migration ===

/// The rows of `steps` as stored (each record and signal once, signals with their hint as
/// agent), inserted with plain SQL; with `keep_rollup`, the rollup is kept as the ingest keeps
/// it, in the same transaction.
async fn insert_rows(db: &DatabaseConnection, steps: &[Step], keep_rollup: bool) {
    use sea_orm::TransactionTrait;
    let backend = db.get_database_backend();
    let mut records: Vec<&RequestRecord> = Vec::new();
    let mut signals: Vec<&Signal> = Vec::new();
    for step in steps {
        match step {
            Step::Records(b) => records.extend(b),
            Step::Signals(c) => signals.extend(c.iter().filter(|s| !s.id.ends_with("-retry"))),
        }
    }
    let mut seen = std::collections::HashSet::new();
    records.retain(|r| seen.insert(r.request_id.clone()));
    let txn = db.begin().await.unwrap();
    for r in &records {
        let mut sql = Sql::new(
            backend,
            "INSERT INTO requests (request_id, started_at_ms, key_id, provider, method, path, \
             model, agent, session_id, env, user_id, status, latency_ms, ttfb_ms, streamed, \
             response_bytes, answered_model, cost_micros) VALUES (",
        );
        sql.bind(r.request_id.clone())
            .push(", ")
            .bind(r.started_at_ms)
            .push(", 'key_1', ")
            .bind(r.provider.to_string())
            .push(", 'POST', '/', ")
            .bind(r.model.clone())
            .push(", ")
            .bind(r.agent.clone())
            .push(", ")
            .bind(r.session_id.as_ref().map(|s| s.as_str().to_owned()))
            .push(", ")
            .bind(r.env.map(|e| e.as_str().to_owned()))
            .push(", ")
            .bind(r.user_id.clone())
            .push(", 200, 1, ")
            .bind(r.ttfb_ms.map(|v| v as i64))
            .push(", false, 0, ")
            .bind(r.usage.model.clone())
            .push(", ")
            .bind(r.cost_micros.map(|v| v as i64))
            .push(")");
        txn.execute_raw(sql.build()).await.unwrap();
    }
    for s in &signals {
        let mut sql = Sql::new(
            backend,
            "INSERT INTO signals (id, received_at_ms, session_id, action, edit_distance, key_id, \
             agent_hint, agent, attributed_by_session) VALUES (",
        );
        sql.bind(s.id.clone())
            .push(", ")
            .bind(s.received_at_ms)
            .push(", ")
            .bind(s.session_id.as_ref().unwrap().as_str().to_owned())
            .push(", ")
            .bind(s.action.as_str())
            .push(", ")
            .bind(s.edit_distance.map(|d| d as i64))
            .push(", 'key_1', ")
            .bind(s.agent_hint.clone())
            .push(", ")
            .bind(s.agent_hint.clone())
            .push(", false)");
        txn.execute_raw(sql.build()).await.unwrap();
    }
    if keep_rollup {
        rollup::add_requests(&txn, &records).await.unwrap();
        let facts: Vec<SignalFacts<'_>> = signals
            .iter()
            .filter_map(|s| {
                Some(SignalFacts {
                    agent: s.agent_hint.as_deref()?,
                    session_id: s.session_id.as_ref()?.as_str(),
                    received_at_ms: s.received_at_ms,
                    action: s.action,
                    edit_distance: s.edit_distance.map(|d| d as i64),
                })
            })
            .collect();
        rollup::add_signals(&txn, &facts).await.unwrap();
    }
    txn.commit().await.unwrap();
}

/// Every rollup row, as text, in key order.
async fn rollup_rows(store: &Store) -> Vec<String> {
    let names: Vec<&str> = rollup::COLUMNS
        .iter()
        .chain(&rollup::DERIVED)
        .copied()
        .collect();
    let columns = names.join(", ");
    let sql = Sql::new(
        store.backend(),
        &format!(
            "SELECT agent, session_id, {columns} FROM session_rollups ORDER BY agent, session_id"
        ),
    );
    let show = |row: &QueryResult| -> String {
        let mut out = vec![
            row.try_get::<String>("", "agent").unwrap(),
            row.try_get::<String>("", "session_id").unwrap(),
        ];
        for c in &names {
            let v = match row.try_get::<Option<i64>>("", c) {
                Ok(v) => format!("{v:?}"),
                Err(_) => format!("{:?}", row.try_get::<Option<String>>("", c).unwrap()),
            };
            out.push(format!("{c}={v}"));
        }
        out.join(" ")
    };
    store
        .conn()
        .query_all_raw(sql.build())
        .await
        .unwrap()
        .iter()
        .map(show)
        .collect()
}

/// A database filled before m0006 gets, from the migration, the rollup the ingest would have
/// kept, and answers exactly as from the raw rows.
async fn backfill_matches(before_url: &str, kept_url: &str) {
    let steps = traffic_with(9, 300, false);
    let db = Database::connect(before_url).await.unwrap();
    Migrator::up(&db, Some(5)).await.unwrap();
    insert_rows(&db, &steps, false).await;
    db.close().await.unwrap();
    let migrated = Store::connect(before_url).await.unwrap();

    let kept = Store::connect(kept_url).await.unwrap();
    insert_rows(kept.conn(), &steps, true).await;

    let (want, got) = (rollup_rows(&kept).await, rollup_rows(&migrated).await);
    assert!(want.len() > 100, "{} rollup rows", want.len());
    assert_eq!(got, want);
    assert!(assert_rollup_matches_raw(&migrated).await.0 > 100);
    migrated.close().await.unwrap();
    kept.close().await.unwrap();
}

#[tokio::test]
async fn migration_backfills_the_rollup_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    backfill_matches(&sqlite_url(&dir, "before"), &sqlite_url(&dir, "kept")).await;
}

#[tokio::test]
async fn migration_backfills_the_rollup_postgres() {
    let Some(before) = postgres_url().await else {
        return;
    };
    let Some(kept) = postgres_url().await else {
        return;
    };
    backfill_matches(&before, &kept).await;
    drop_postgres(&before).await;
    drop_postgres(&kept).await;
}

/// SQLite has no hash aggregate: it must read the sessions of the rollup through the covering
/// indexes whose order is the groups' (m0006), never sort them.
#[tokio::test]
async fn sqlite_groups_rollup_rows_in_index_order() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect(&sqlite_url(&dir, "plan")).await.unwrap();
    let plan = |stmt: sea_orm::Statement| {
        let store = store.clone();
        async move { crate::sql::query_plan(store.conn(), &stmt).await }
    };
    let backend = store.backend();
    // The implicit total beside explicit evidence reads the rollup through the partial index
    // of the rows with implicit signals only, covered for the rows inside the window.
    let beside = plan(super::query::implicit_beside_statement(
        backend,
        "a",
        Window {
            since_ms: T0,
            until_ms: T0 + DAY,
        },
    ))
    .await;
    let index = format!("COVERING INDEX {}", super::evidence::IMPLICIT_INDEX);
    assert!(beside.iter().any(|l| l.contains(&index)), "{beside:#?}");
    let through = beside
        .iter()
        .filter(|l| l.contains("session_rollups") && l.contains(super::evidence::IMPLICIT_INDEX))
        .count();
    let all_reads = beside
        .iter()
        .filter(|l| l.contains("session_rollups USING") || l.contains("SCAN session_rollups"))
        .count();
    assert_eq!(through, 2, "{beside:#?}");
    assert_eq!(all_reads, 2, "{beside:#?}");
    let aggregates = plan(super::query::aggregates_statement(
        backend,
        Source::Rollup(Evidence::EXPLICIT),
        "a",
        periods(T0, T0 + DAY, T0 + HOUR, T0),
    ))
    .await;
    let rates = plan(super::query::outcome_rates_statement(
        backend,
        Source::Rollup(Evidence::EXPLICIT),
        "a",
        &[Dimension::Model, Dimension::Env, Dimension::Week],
        T0,
        T0 + DAY,
        0,
    ))
    .await;
    for (plan, indexes) in [
        (
            &aggregates,
            &[
                "COVERING INDEX idx_session_rollups_cube",
                "COVERING INDEX idx_session_rollups_user",
                "COVERING INDEX idx_session_rollups_agent_active",
            ][..],
        ),
        (&rates, &["COVERING INDEX idx_session_rollups_cube"][..]),
    ] {
        for index in indexes {
            assert!(plan.iter().any(|l| l.contains(index)), "{index}: {plan:#?}");
        }
        // Only the edge sessions' lookup reads the table itself (by session id, few rows).
        let rollup_reads: Vec<_> = plan
            .iter()
            .filter(|l| l.contains("session_rollups") && !l.contains("COVERING INDEX"))
            .collect();
        assert_eq!(rollup_reads.len(), 1, "{plan:#?}");
    }
}

// === m0008: signals that name an answer ===

/// A database of the schema before m0008 (its signals name sessions only) moves over: every
/// signal keeps its session and names no answer, the rollup is the one a database of the new
/// schema keeps for the same rows, and the analytics answer as from the raw rows.
async fn m0008_moves_an_existing_database_over(before_url: &str, kept_url: &str) {
    let steps = traffic_with(11, 200, false);
    let db = Database::connect(before_url).await.unwrap();
    // An old schema, before signals could name an answer or had a source (its rollup is the
    // one m0006 fills from the rows: the ingest of the time kept the same).
    Migrator::up(&db, Some(5)).await.unwrap();
    insert_rows(&db, &steps, false).await;
    db.close().await.unwrap();
    let migrated = Store::connect(before_url).await.unwrap();
    let kept = Store::connect(kept_url).await.unwrap();
    insert_rows(kept.conn(), &steps, true).await;
    let row = migrated
        .conn()
        .query_one_raw(
            Sql::new(
                migrated.backend(),
                "SELECT COUNT(*) AS n FROM signals WHERE request_id IS NOT NULL",
            )
            .build(),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(crate::sql::count(&row, "n").unwrap(), 0);
    // m0009: every signal stored before is explicit, without a rule.
    let row = migrated
        .conn()
        .query_one_raw(
            Sql::new(
                migrated.backend(),
                "SELECT COUNT(*) AS n FROM signals WHERE source <> 'explicit' OR rule IS NOT NULL",
            )
            .build(),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(crate::sql::count(&row, "n").unwrap(), 0);
    let (want, got) = (rollup_rows(&kept).await, rollup_rows(&migrated).await);
    assert!(want.len() > 50, "{} rollup rows", want.len());
    assert_eq!(got, want);
    assert!(assert_rollup_matches_raw(&migrated).await.0 > 50);
    migrated.close().await.unwrap();
    kept.close().await.unwrap();
}

#[tokio::test]
async fn m0008_moves_an_existing_database_over_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    m0008_moves_an_existing_database_over(&sqlite_url(&dir, "before"), &sqlite_url(&dir, "kept"))
        .await;
}

#[tokio::test]
async fn m0008_moves_an_existing_database_over_postgres() {
    let Some(before) = postgres_url().await else {
        return;
    };
    let Some(kept) = postgres_url().await else {
        return;
    };
    m0008_moves_an_existing_database_over(&before, &kept).await;
    drop_postgres(&before).await;
    drop_postgres(&kept).await;
}
