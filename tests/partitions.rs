//! PostgreSQL's day partitions (migration m0017, `nm_controlplane::partitions`) on a real
//! database (`NM_TEST_POSTGRES_URL`; skipped without): a database left by the version before
//! (m0016) with rows keeps every row when migrated, and a resent record or signal is still stored
//! once; a row of a day without a partition is kept in DEFAULT and moves into its day's partition
//! when that is made, and a missing day ahead is made again; retention drops whole old days (gone from `pg_inherits` and `pg_class`)
//! and the usage reports for those days stay the same, answered from the rollups.

use std::time::Duration;

use nm_controlplane::partitions::{self, REQUESTS, SIGNALS};
use nm_controlplane::retention::{Retainer, Retention};
use nm_controlplane::store::Migrator;
use nm_controlplane::usage::{Dimension, UsageFilter, UsageReports};
use nm_controlplane::{Budgets, Records, Signals, Store, Stored};
use nm_types::Action;
use nm_types::record::RequestRecord;
use nm_types::signal::Signal;
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};

use crate::common::gateway::{drop_postgres_db, fresh_postgres_db};

const DAY_MS: i64 = 86_400_000;
/// Days before today that hold rows in the old database (today holds some too).
const OLD_DAYS: [i64; 3] = [5, 4, 3];

async fn exec(db: &DatabaseConnection, sql: &str) {
    db.execute_unprepared(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn count(db: &DatabaseConnection, sql: &str) -> i64 {
    db.query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .unwrap_or_else(|| panic!("{sql}: no row"))
        .try_get_by_index::<i64>(0)
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Whether a table named `name` exists.
async fn exists(db: &DatabaseConnection, name: &str) -> bool {
    count(
        db,
        &format!("SELECT COUNT(*) FROM pg_class WHERE relname = '{name}'"),
    )
    .await
        > 0
}

/// Whether `name` is attached to `parent` as a partition.
async fn attached(db: &DatabaseConnection, parent: &str, name: &str) -> bool {
    count(
        db,
        &format!(
            "SELECT COUNT(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = '{parent}'::regclass AND c.relname = '{name}'"
        ),
    )
    .await
        > 0
}

fn record(id: &str, started_at_ms: i64) -> RequestRecord {
    RequestRecord {
        request_id: id.to_owned(),
        started_at_ms,
        key_id: "key_1".into(),
        provider: "openai".into(),
        method: "POST".into(),
        path: "/v1/chat/completions".to_owned(),
        model: Some("gpt-4o".to_owned()),
        agent: Some("writer".to_owned()),
        status: 200,
        ..RequestRecord::default()
    }
}

fn signal(id: &str, received_at_ms: i64, idempotency_key: &str) -> Signal {
    Signal {
        id: id.to_owned(),
        received_at_ms,
        session_id: "sess_parts".parse().ok(),
        request_id: None,
        action: Action::Accepted,
        edit_distance: None,
        custom_label: None,
        key_id: "key_1".into(),
        idempotency_key: Some(idempotency_key.to_owned()),
        agent_hint: None,
    }
}

/// Every usage report the test compares, each as a whole.
async fn reports(store: &Store) -> Vec<String> {
    let usage = UsageReports::new(store.clone());
    let mut out = Vec::new();
    for dims in [
        vec![],
        vec![Dimension::Day],
        vec![Dimension::Day, Dimension::User],
        vec![Dimension::Model, Dimension::Agent],
    ] {
        let r = usage
            .report(&dims, &UsageFilter::default(), 0)
            .await
            .unwrap_or_else(|e| panic!("{dims:?}: {e}"));
        out.push(format!("{dims:?} -> {r:?}"));
    }
    out
}

#[tokio::test]
async fn postgres_partitions_take_an_old_database_over_and_retention_drops_whole_days() {
    let Some(url) = fresh_postgres_db().await else {
        return;
    };
    let now = chrono::Utc::now().timestamp_millis();
    let today = partitions::day_of_ms(now);

    // A database as the version before left it, with records and signals of four days.
    let db = sea_orm::Database::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    Migrator::up_through(&db, "m0016_signals_by_time")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !partitions::is_partitioned(&db, "requests")
            .await
            .unwrap_or(true)
    );
    for back in OLD_DAYS.into_iter().chain([0]) {
        let at = (today - back) * DAY_MS + 1_000;
        for j in 0..2 {
            exec(
                &db,
                &format!(
                    "INSERT INTO requests (request_id, started_at_ms, key_id, provider, method, \
                     path, status, latency_ms, streamed, response_bytes, input_tokens, \
                     output_tokens, cost_micros, usage_status, agent, model, user_id) VALUES \
                     ('r{back}_{j}', {}, 'key_1', 'openai', 'POST', '/v1/chat/completions', 200, \
                     5, false, 10, {}, 50, {}, 'reported', 'writer', 'gpt-4o', 'u{j}')",
                    at + j,
                    100 + back,
                    1_000 * (j + 1) + back
                ),
            )
            .await;
        }
        exec(
            &db,
            &format!(
                "INSERT INTO signals (id, received_at_ms, session_id, action, key_id, \
                 idempotency_key, agent, attributed_by_session) VALUES \
                 ('s{back}', {at}, 'sess_parts', 'accepted', 'key_1', 'idem{back}', 'writer', true)"
            ),
        )
        .await;
    }
    let _ = db.close().await;

    // Migrated by the controlplane's start.
    let store = Store::connect(&url).await.unwrap_or_else(|e| panic!("{e}"));
    let db = store.conn().clone();
    assert!(
        partitions::is_partitioned(&db, "requests")
            .await
            .unwrap_or(false)
    );
    assert!(
        partitions::is_partitioned(&db, "signals")
            .await
            .unwrap_or(false)
    );
    assert_eq!(count(&db, "SELECT COUNT(*) FROM requests").await, 8);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM signals").await, 4);
    for back in OLD_DAYS.into_iter().chain([0]) {
        for p in [REQUESTS, SIGNALS] {
            let name = partitions::partition_name(p.table, today - back);
            assert!(attached(&db, p.table, &name).await, "{name}");
            assert!(
                count(&db, &format!("SELECT COUNT(*) FROM {name}")).await >= 1,
                "{name}"
            );
        }
    }
    for ahead in 1..=partitions::AHEAD_DAYS {
        let name = partitions::partition_name("requests", today + ahead);
        assert!(attached(&db, "requests", &name).await, "{name}");
    }
    assert_eq!(count(&db, "SELECT COUNT(*) FROM requests_default").await, 0);

    // Resent rows are still stored once: a record with its id and time, a signal with its
    // key and Idempotency-Key (under a new id and time, as a client's retry is).
    let records = Records::new(
        store.clone(),
        Budgets::load(store.clone(), 0)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    );
    let fresh = record("r_fresh", now);
    for _ in 0..2 {
        records
            .ingest(std::slice::from_ref(&fresh))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let migrated = record("r0_0", today * DAY_MS + 1_000);
    records
        .ingest(&[migrated])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(count(&db, "SELECT COUNT(*) FROM requests").await, 9);
    let signals = Signals::start(store.clone());
    let retried = signals
        .record(signal("s_retry", now, "idem0"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(retried, Stored::Duplicate);
    let new = signals
        .record(signal("s_new", now, "idem_new"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(new, Stored::New);
    let again = signals
        .record(signal("s_new", now, "idem_new"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again, Stored::Duplicate);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM signals").await, 5);

    // A record of a day without a partition is kept in DEFAULT, then moves into its partition.
    let far = today + partitions::AHEAD_DAYS + 30;
    records
        .ingest(&[record("r_far", far * DAY_MS + 5)])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        count(
            &db,
            "SELECT COUNT(*) FROM requests_default WHERE request_id = 'r_far'"
        )
        .await,
        1
    );
    assert_eq!(count(&db, "SELECT COUNT(*) FROM requests").await, 10);
    assert!(
        partitions::make_partition(&store, REQUESTS, far)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    );
    let far_name = partitions::partition_name("requests", far);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM requests_default").await, 0);
    assert_eq!(
        count(&db, &format!("SELECT COUNT(*) FROM {far_name}")).await,
        1
    );
    // Made once.
    assert!(
        !partitions::make_partition(&store, REQUESTS, far)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    );

    // The upkeep makes a missing day ahead again.
    let last = partitions::partition_name("signals", today + partitions::AHEAD_DAYS);
    exec(&db, &format!("DROP TABLE {last}")).await;
    assert!(!attached(&db, "signals", &last).await);
    let made = partitions::ensure_ahead(&store, now)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(made, 1);
    assert!(attached(&db, "signals", &last).await);

    // Retention of a day drops the three old days whole, records and signals.
    let before = reports(&store).await;
    let retainer = Retainer::new(
        store.clone(),
        Retention {
            records: Some(Duration::from_secs(86_400)),
            signals: Some(Duration::from_secs(86_400)),
        },
    );
    let (_stop, shutdown) = tokio::sync::watch::channel(false);
    let done = retainer
        .run(now, &shutdown)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(done.partitions, 6, "{done:?}");
    assert_eq!(done.records, 6, "{done:?}");
    assert_eq!(done.signals, 3, "{done:?}");
    for back in OLD_DAYS {
        for p in [REQUESTS, SIGNALS] {
            let name = partitions::partition_name(p.table, today - back);
            assert!(!attached(&db, p.table, &name).await, "{name}");
            assert!(!exists(&db, &name).await, "{name}");
        }
    }
    assert!(
        attached(
            &db,
            "requests",
            &partitions::partition_name("requests", today)
        )
        .await
    );
    assert_eq!(count(&db, "SELECT COUNT(*) FROM requests").await, 4);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM signals").await, 2);
    // The Idempotency-Keys of the signals gone are gone with them.
    assert_eq!(
        count(&db, "SELECT COUNT(*) FROM signal_idempotency").await,
        2
    );
    assert_eq!(reports(&store).await, before);
    store.close().await.unwrap_or_else(|e| panic!("{e}"));
    drop_postgres_db(&url).await;
}
