use std::future::Future;

use sea_orm::PaginatorTrait;

use super::*;

fn record(id: &str, session: Option<&str>, at: i64) -> RequestRecord {
    RequestRecord {
        request_id: id.to_owned(),
        started_at_ms: at,
        key_id: "key_1".into(),
        provider: "openai".into(),
        method: "POST".into(),
        path: "/v1/chat/completions".to_owned(),
        session_id: session.map(|s| s.parse().unwrap()),
        agent: Some("a".to_owned()),
        status: 200,
        ..Default::default()
    }
}

/// A store on `url` and its records, with budgets loaded.
async fn records_on(url: &str) -> (Store, Records) {
    let store = Store::connect(url).await.unwrap();
    let budgets = Budgets::load(store.clone(), 0).await.unwrap();
    (store.clone(), Records::new(store, budgets))
}

async fn stored_session(store: &Store, id: &str) -> session::Model {
    session::Entity::find_by_id(id.to_owned())
        .one(store.conn())
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("session {id} missing"))
}

/// Runs `test` on a fresh SQLite file and, when the test database is configured, on a fresh
/// PostgreSQL database.
async fn on_both<F: Future<Output = ()>>(test: impl Fn(String) -> F) {
    let dir = tempfile::tempdir().unwrap();
    test(format!("sqlite://{}/t.db?mode=rwc", dir.path().display())).await;
    if let Some(db) = crate::scratch::ScratchPg::for_tests().await {
        test(db.url.clone()).await;
        crate::scratch::drop_test_db(&db.url).await;
    }
}

/// Every value comes out of the database exactly as it went in: text with quotes, escapes and
/// non-ASCII, integers at the edges, nulls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_value_round_trips() {
    on_both(every_value_round_trips_on).await;
}

async fn every_value_round_trips_on(url: String) {
    let (store, records) = records_on(&url).await;
    let r = RequestRecord {
        request_id: "r-\"quoted\"-\\-é-🌍".to_owned(),
        started_at_ms: 1_763_800_000_123,
        key_id: "key_1".into(),
        provider: "openai".into(),
        method: "POST".into(),
        path: "/v1/chat/completions".to_owned(),
        model: Some("ft:gpt-4o:org:x".to_owned()),
        agent: Some("a 'b' \"c\"".to_owned()),
        user_id: Some("ユーザー".to_owned()),
        status: 429,
        latency_ms: nm_types::record::MAX_DURATION_MS,
        ttfb_ms: Some(7),
        streamed: true,
        error_code: None,
        response_bytes: 10,
        usage: Usage {
            input_tokens: Some(0),
            output_tokens: None,
            ..Default::default()
        },
        usage_status: UsageStatus::Partial,
        cost_micros: Some(123_456_789),
        trace: Some(nm_types::record::TraceRef {
            trace_id: [
                0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e,
                0x47, 0x36,
            ],
            span_id: [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7],
        }),
        ..Default::default()
    };
    let out = records.ingest(std::slice::from_ref(&r)).await.unwrap();
    assert_eq!(out.stored, 1);
    let mut sql = crate::sql::Sql::new(
        store.backend(),
        "SELECT trace_id, span_id FROM requests WHERE request_id = ",
    );
    sql.bind(r.request_id.clone());
    let row = store
        .conn()
        .query_one_raw(sql.build())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            row.try_get::<String>("", "trace_id").unwrap(),
            row.try_get::<String>("", "span_id").unwrap()
        ),
        (
            "4bf92f3577b34da6a3ce929d0e0e4736".to_owned(),
            "00f067aa0ba902b7".to_owned()
        )
    );
    let m = crate::store::entity::request::Entity::find_by_id(r.request_id.clone())
        .one(store.conn())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(m.agent, r.agent);
    assert_eq!(m.user_id, r.user_id);
    assert_eq!(m.model, r.model);
    assert_eq!(
        (m.status, m.latency_ms, m.ttfb_ms, m.streamed),
        (429, nm_types::record::MAX_DURATION_MS as i64, Some(7), true)
    );
    assert_eq!(
        (m.input_tokens, m.output_tokens, m.cost_micros),
        (Some(0), None, Some(123_456_789))
    );
    assert_eq!(m.usage_status, "partial");
    assert_eq!(m.error_code, None);
    store.close().await.unwrap();
}

/// A batch that repeats some stored records stores only the new ones, and says which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partly_resent_batch_stores_the_new_records() {
    on_both(a_partly_resent_batch_stores_the_new_records_on).await;
}

async fn a_partly_resent_batch_stores_the_new_records_on(url: String) {
    let (store, records) = records_on(&url).await;
    let batch = |from: i64, to: i64| -> Vec<RequestRecord> {
        (from..to)
            .map(|i| record(&format!("p{i}"), Some("sess_p"), i))
            .collect()
    };
    assert_eq!(records.ingest(&batch(0, 300)).await.unwrap().stored, 300);
    let out = records.ingest(&batch(200, 700)).await.unwrap();
    assert_eq!((out.stored, out.duplicates), (400, 100));
    let stored = crate::store::entity::request::Entity::find()
        .count(store.conn())
        .await
        .unwrap();
    assert_eq!(stored, 700);
    let s = stored_session(&store, "sess_p").await;
    assert_eq!(
        (s.request_count, s.first_seen_ms, s.last_seen_ms),
        (700, 0, 699)
    );
    store.close().await.unwrap();
}

/// Rows written through rusqlite belong to the SQLite write transaction: without a commit
/// they are gone, and the connection is usable afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_inserted_on_sqlite_roll_back_with_their_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/t.db?mode=rwc", dir.path().display());
    let store = Store::connect(&url).await.unwrap();
    let sql = InsertSql::new(store.backend());
    let batch: Vec<RequestRecord> = (0..50).map(|i| record(&format!("x{i}"), None, i)).collect();
    let refs: Vec<&RequestRecord> = batch.iter().collect();
    let count = |store: Store| async move {
        crate::store::entity::request::Entity::find()
            .count(store.conn())
            .await
            .unwrap()
    };

    let txn = store.begin_write().await.unwrap();
    assert!(matches!(txn, WriteTxn::Sqlite(_)));
    assert!(matches!(
        insert_new(&txn, &sql, &refs).await.unwrap(),
        Fresh::All
    ));
    drop(txn);
    assert_eq!(count(store.clone()).await, 0);

    let txn = store.begin_write().await.unwrap();
    assert!(matches!(
        insert_new(&txn, &sql, &refs).await.unwrap(),
        Fresh::All
    ));
    txn.commit().await.unwrap();
    assert_eq!(count(store.clone()).await, 50);
    store.close().await.unwrap();
}

#[tokio::test]
async fn a_resent_batch_is_stored_once_and_sessions_count_once() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = format!("sqlite://{}/r.db?mode=rwc", dir.path().display());
    let store = Store::connect(&url).await.unwrap_or_else(|e| panic!("{e}"));
    let budgets = Budgets::load(store.clone(), 0).await.unwrap();
    let records = Records::new(store.clone(), budgets);
    let mut batch: Vec<_> = (0..1200)
        .map(|i| record(&format!("r{i}"), Some(&format!("sess_{}", i % 3)), 1000 + i))
        .collect();
    batch.push(RequestRecord {
        cost_micros: Some(u64::MAX),
        ..record("bad", Some("sess_0"), 5)
    });
    let first = records
        .ingest(&batch)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        first,
        IngestOutcome {
            stored: 1200,
            duplicates: 0,
            rejected: vec![(
                1200,
                "cost_micros and budget_micros must be at most 10^12".to_owned()
            )],
            epoch: first.epoch,
            seq: 1,
        }
    );
    let again = records
        .ingest(&batch)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        again,
        IngestOutcome {
            stored: 0,
            duplicates: 1200,
            rejected: vec![(
                1200,
                "cost_micros and budget_micros must be at most 10^12".to_owned()
            )],
            epoch: first.epoch,
            seq: 2,
        }
    );
    let s = session::Entity::find_by_id("sess_0".to_owned())
        .one(store.conn())
        .await
        .ok()
        .flatten();
    let s = s.unwrap_or_else(|| panic!("session missing"));
    assert_eq!(
        (
            s.request_count,
            s.first_seen_ms,
            s.last_seen_ms,
            s.agent.as_deref()
        ),
        (400, 1000, 2197, Some("a"))
    );
}

/// Each record that breaks a rule is refused alone, by its index, with the rule (every rule
/// is tested in `nm_types::record`); the rest of the batch is stored, and nothing refused
/// reaches the sums (a forged `cost_micros` of 2^64-1 once made every usage query fail).
#[tokio::test]
async fn out_of_range_values_are_refused_one_by_one() {
    use nm_types::record::{MAX_MICROS, MAX_TOKENS};
    let dir = tempfile::tempdir().unwrap();
    let (store, records) =
        records_on(&format!("sqlite://{}/v.db?mode=rwc", dir.path().display())).await;
    let ok = |id: &str| record(id, Some("sess_v"), 1_000);
    let batch = vec![
        ok("good1"),
        RequestRecord {
            cost_micros: Some(u64::MAX),
            ..ok("f1")
        },
        RequestRecord {
            path: "/x".repeat(5_000),
            ..ok("f2")
        },
        ok("good2"),
    ];
    let out = records.ingest(&batch).await.unwrap();
    assert_eq!(out.stored, 2);
    let refused: Vec<_> = out.rejected.iter().map(|(i, _)| *i).collect();
    assert_eq!(refused, vec![1, 2]);
    assert!(out.rejected[0].1.contains("cost_micros"));
    assert!(out.rejected[1].1.contains("path"));
    // The caps at their limits are accepted, and the usage sums over them still work.
    let at_caps = RequestRecord {
        cost_micros: Some(MAX_MICROS),
        budget_micros: Some(MAX_MICROS),
        usage: Usage {
            input_tokens: Some(MAX_TOKENS),
            ..Default::default()
        },
        ..ok("caps")
    };
    assert_eq!(records.ingest(&[at_caps]).await.unwrap().stored, 1);
    let report = crate::usage::UsageReports::new(store.clone())
        .report(&[], &crate::usage::UsageFilter::default(), 0)
        .await
        .unwrap();
    assert_eq!(report.total.cost_micros, MAX_MICROS);
    assert_eq!(report.total.requests, 3);
    store.close().await.unwrap();
}

/// A session's later batches merge into it: the first agent, env and user seen stick (a
/// missing one is filled), its times widen, its requests add up; a batch with more sessions
/// than one statement holds stores every one of them.
async fn sessions_merge_across_batches(url: &str) {
    let (store, records) = records_on(url).await;
    let with =
        |id: &str, at: i64, agent: Option<&str>, env: Option<&str>, user: &str| RequestRecord {
            agent: agent.map(str::to_owned),
            env: env.map(|e| e.parse().unwrap()),
            user_id: Some(user.to_owned()),
            ..record(id, Some("sess_a"), at)
        };
    records
        .ingest(&[with("a1", 2000, None, None, "u1")])
        .await
        .unwrap();
    let mut second = vec![
        with("a2", 1000, Some("x"), Some("staging"), "u2"),
        with("a3", 3000, Some("y"), Some("production"), "u3"),
    ];
    second.extend((0..300).map(|i| record(&format!("o{i}"), Some(&format!("sess_o{i}")), i)));
    records.ingest(&second).await.unwrap();

    let a = stored_session(&store, "sess_a").await;
    assert_eq!(
        (a.agent.as_deref(), a.env.as_deref(), a.user_id.as_deref()),
        (Some("x"), Some("staging"), Some("u1"))
    );
    assert_eq!(
        (a.first_seen_ms, a.last_seen_ms, a.request_count),
        (1000, 3000, 3)
    );
    let others = session::Entity::find()
        .filter(session::Column::SessionId.starts_with("sess_o"))
        .all(store.conn())
        .await
        .unwrap();
    assert_eq!(others.len(), 300);
    assert!(
        others
            .iter()
            .all(|s| s.request_count == 1 && s.agent.as_deref() == Some("a"))
    );
    store.close().await.unwrap();
}

#[tokio::test]
async fn sessions_merge_across_batches_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    sessions_merge_across_batches(&format!("sqlite://{}/s.db?mode=rwc", dir.path().display()))
        .await;
}

#[tokio::test]
async fn sessions_merge_across_batches_postgres() {
    let Some(db) = crate::scratch::ScratchPg::for_tests().await else {
        return;
    };
    sessions_merge_across_batches(&db.url).await;
    crate::scratch::drop_test_db(&db.url).await;
}
