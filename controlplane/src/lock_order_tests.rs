//! Issue 21, 4: on PostgreSQL, signals and record ingest running at once over the same sessions
//! never deadlock. Every transaction that writes `sessions`, `session_rollups` or `user_spend`
//! takes its row locks in one order (see `analytics::rollup::requests_sql`); before, ingest
//! batches locked rollup rows in hash order and sessions in first-seen order, and a minute of
//! mixed load logged dozens of `deadlock detected` (one victim each: a signal answered 503, or
//! a batch sent back to the spool).
//!
//! The test counts the database's own deadlock counter (`pg_stat_database.deadlocks`), so a
//! deadlock that a retry hid would still fail it, and calls `Records::ingest` without the
//! link's conflict retry, so a deadlocked batch fails it too.

use std::time::Duration;

use nm_types::Action;
use sea_orm::{ConnectionTrait, Database, Statement};

use crate::records::{Records, RequestRecord};
use crate::signals::Signals;
use crate::store::Store;
use nm_types::signal::Signal;

const SESSIONS: usize = 60;

/// Session `k` of a batch in an order of its own: tasks walk the sessions in different
/// permutations, the way independent dataplanes' batches interleave.
fn session_at(task: usize, batch: usize, k: usize) -> String {
    let stride = [7, 11, 13, 17, 19, 23, 29, 31][(task + batch) % 8];
    format!("sess_{:03}", (k * stride + batch) % SESSIONS)
}

async fn deadlocks(url: &str) -> i64 {
    let db = Database::connect(url).await.unwrap();
    // Wait until the test's own connections are gone: a backend reports its counters as it
    // exits.
    for _ in 0..500 {
        let others: i64 = db
            .query_one_raw(Statement::from_string(
                db.get_database_backend(),
                "SELECT COUNT(*)::BIGINT AS n FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            ))
            .await
            .unwrap()
            .unwrap()
            .try_get("", "n")
            .unwrap();
        if others == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let n: i64 = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT deadlocks AS n FROM pg_stat_database WHERE datname = current_database()",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get("", "n")
        .unwrap();
    db.close().await.unwrap();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn signals_and_ingest_at_once_never_deadlock_on_postgres() {
    let Some(pg) = crate::scratch::ScratchPg::for_tests().await else {
        return;
    };
    let store = Store::connect(&pg.url).await.unwrap();
    let before = deadlocks(&pg.url).await;
    let budgets = crate::Budgets::load(store.clone(), 0).await.unwrap();
    let records = Records::new(store.clone(), budgets);
    let signals = Signals::start(store.clone());

    let mut tasks = Vec::new();
    for t in 0..4 {
        let records = records.clone();
        tasks.push(tokio::spawn(async move {
            for b in 0..25 {
                let batch: Vec<RequestRecord> = (0..SESSIONS * 2)
                    .map(|k| RequestRecord {
                        request_id: format!("r{t}-{b}-{k}"),
                        started_at_ms: 1_700_000_000_000 + k as i64,
                        key_id: "key_1".into(),
                        provider: "openai".into(),
                        method: "POST".into(),
                        session_id: Some(session_at(t, b, k).parse().unwrap()),
                        agent: Some(format!("agent-{}", k % 3)),
                        user_id: Some(format!("user-{}", k % 5)),
                        budget_micros: Some(10),
                        ..Default::default()
                    })
                    .collect();
                records
                    .ingest(&batch)
                    .await
                    .map_err(|e| format!("ingest: {e}"))?;
            }
            Ok::<(), String>(())
        }));
    }
    for t in 0..4 {
        let signals = signals.clone();
        tasks.push(tokio::spawn(async move {
            let mut waiting = Vec::new();
            for i in 0..150 {
                let signals = signals.clone();
                waiting.push(tokio::spawn(async move {
                    let s = Signal {
                        id: format!("s{t}-{i}"),
                        received_at_ms: 1_700_000_000_000 + i as i64,
                        session_id: session_at(t + 4, i, i).parse().ok(),
                        request_id: None,
                        action: Action::Accepted,
                        edit_distance: None,
                        custom_label: None,
                        key_id: "key_1".into(),
                        idempotency_key: None,
                        agent_hint: Some("agent-0".into()),
                    };
                    signals
                        .record_within(s, Duration::from_secs(60))
                        .await
                        .map(drop)
                        .map_err(|e| format!("signal: {e}"))
                }));
                if i % 10 == 9 {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            for w in waiting {
                w.await.map_err(|e| e.to_string())??;
            }
            Ok(())
        }));
    }
    let mut failures = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.unwrap() {
            failures.push(e);
        }
    }
    drop((records, signals));
    store.close().await.unwrap();
    let after = deadlocks(&pg.url).await;
    crate::scratch::drop_test_db(&pg.url).await;
    assert!(failures.is_empty(), "writes failed: {failures:?}");
    assert_eq!(
        after - before,
        0,
        "PostgreSQL detected {} deadlocks",
        after - before
    );
}
