//! Retention end to end, on SQLite and PostgreSQL: a gateway stores records and signals, some
//! are made old (their times moved back), and a gateway restarted on the same database with
//! `NM_RETENTION_RECORDS` / `NM_RETENTION_SIGNALS` deletes the old rows in the background while
//! the usage reports for those days stay the same (answered from the rollups), and so do the
//! agents' progress counts (from `signal_rollups`). On SQLite, a file made before retention is
//! switched to incremental vacuum and gives its free pages back. In process, on both databases
//! (on PostgreSQL through whole day partitions dropped and a batch of the cutoff's day): the
//! progress counts of each evidence setting are unchanged by retention, and a deleted day at the
//! start of the rate window counts whole.

use std::time::Duration;

use nm_controlplane::Store;
use nm_controlplane::analytics::report::{Progress, Status};
use nm_controlplane::analytics::{Analytics, Evidence, evidence};
use nm_controlplane::partitions::{self, SIGNALS};
use nm_controlplane::retention::{Retainer, Retention};
use nm_gateway::grpc::pb::{self, analytics_client::AnalyticsClient, usage_client::UsageClient};
use sea_orm::{ConnectionTrait, Statement};

use crate::common::eventually;
use crate::common::gateway::{
    ADMIN_KEY, Db, TestGateway, admin, drop_postgres_db, fresh_postgres_db,
};
use crate::common::mock::MockProvider;

const DAY_MS: i64 = 86_400_000;

async fn exec(gw: &TestGateway, sql: &str) {
    let db = gw.database().await;
    db.execute_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let _ = db.close().await;
}

/// Every report the test compares: its dimensions and filter, each answered as a whole.
fn reports() -> Vec<pb::GetUsageRequest> {
    use pb::UsageDimension as D;
    let by = |dims: &[D]| pb::GetUsageRequest {
        group_by: dims.iter().map(|d| (*d).into()).collect(),
        ..Default::default()
    };
    vec![
        by(&[]),
        by(&[D::Day]),
        by(&[D::Day, D::Agent]),
        by(&[D::Model]),
        by(&[D::User]),
        by(&[D::Provider, D::Env]),
        by(&[D::Agent, D::User, D::Model, D::Day]),
        pb::GetUsageRequest {
            group_by: vec![D::Day.into()],
            filter: Some(pb::UsageFilter {
                agent: Some("writer".to_owned()),
                ..Default::default()
            }),
            ..Default::default()
        },
    ]
}

async fn answers(gw: &TestGateway) -> Vec<String> {
    let mut client = UsageClient::new(gw.grpc_channel().await);
    let mut out = Vec::new();
    for r in reports() {
        let report = client
            .get_usage(admin(r.clone()))
            .await
            .unwrap_or_else(|e| panic!("{r:?}: {e}"))
            .into_inner();
        let mut rows: Vec<String> = report.rows.iter().map(|r| format!("{r:?}")).collect();
        rows.sort();
        out.push(format!(
            "{:?} -> rows {rows:?} total {:?} unpriced {:?}",
            r.group_by, report.total, report.unpriced_models
        ));
    }
    out
}

/// An agent's progress as `GetRecommendations` answers it: status, signals, the signals of the
/// last 7 days (the daily rate times the days it is over), first and last signal (ms).
async fn progress(gw: &TestGateway, agent: &str) -> (i32, u64, u64, i64, i64) {
    let a = AnalyticsClient::new(gw.grpc_channel().await)
        .get_recommendations(admin(pb::GetRecommendationsRequest {
            agent: agent.to_owned(),
            refresh: false,
        }))
        .await
        .unwrap_or_else(|e| panic!("{agent}: {e}"))
        .into_inner();
    let ms = |t: Option<&prost_types::Timestamp>| {
        t.map_or(0, nm_gateway::grpc::convert::timestamp_to_ms)
    };
    let p = a.progress.unwrap_or_default();
    let (first, at) = (ms(p.first_signal.as_ref()), ms(a.computed_at.as_ref()));
    let days = ((at - first) as f64 / DAY_MS as f64).clamp(1.0, 7.0);
    let recent = (p.daily_rate * days).round() as u64;
    (
        a.status,
        p.signals,
        recent,
        first,
        ms(p.last_signal.as_ref()),
    )
}

async fn retention_deletes_old_rows_and_keeps_the_reports(db: Db) {
    let openai = MockProvider::json(crate::common::fixture("openai/chat_response.json"))
        .start()
        .await;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = match db {
        Db::Sqlite => {
            // A file made before retention existed: no incremental vacuum yet.
            let url = format!("sqlite://{}/nm.db?mode=rwc", dir.path().display());
            let old = sea_orm::Database::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            old.execute_unprepared("CREATE TABLE before_retention (x INTEGER)")
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let _ = old.close().await;
            url
        }
        Db::Postgres => match fresh_postgres_db().await {
            Some(url) => url,
            None => return,
        },
    };
    // The first gateway keeps everything. (Started as "SQLite" so that stopping it leaves the
    // PostgreSQL database to the second.)
    let gw = TestGateway::builder()
        .db(Db::Sqlite)
        .env("NM_DATABASE_URL", &url)
        .upstream("openai", &openai.url)
        .run()
        .await;
    let calls = [
        ("writer", "u1", "sess_ret1"),
        ("writer", "u2", "sess_ret1"),
        ("writer", "u1", "sess_ret2"),
        ("coder", "u3", "sess_ret3"),
        ("coder", "u1", "sess_ret4"),
        ("writer", "u2", "sess_ret5"),
    ];
    for (agent, user, session) in calls {
        let a = gw
            .chat(&[
                ("nm-agent", agent),
                ("nm-user", user),
                ("nm-session", session),
            ])
            .await;
        assert_eq!(a.status, 200);
    }
    for (session, action) in [
        ("sess_ret1", "accepted"),
        ("sess_ret2", "regenerated"),
        ("sess_ret3", "accepted"),
        ("sess_ret5", "accepted"),
    ] {
        let body = format!(r#"{{"session_id":"{session}","action":"{action}"}}"#);
        let a = gw
            .raw(
                "POST",
                "/v1/signal",
                &[("nm-key", ADMIN_KEY), ("content-type", "application/json")],
                body,
            )
            .await;
        assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    }
    eventually(Duration::from_secs(15), "records stored", || async {
        (gw.count("SELECT COUNT(*) AS n FROM requests").await == 6).then_some(())
    })
    .await;
    eventually(Duration::from_secs(15), "signals attributed", || async {
        (gw.count("SELECT COUNT(*) AS n FROM signals WHERE agent IS NOT NULL")
            .await
            == 4)
            .then_some(())
    })
    .await;
    // Sessions 1 and 2 were three and two days ago, with their signals.
    for (session, days) in [("sess_ret1", 3), ("sess_ret2", 2)] {
        exec(
            &gw,
            &format!(
                "UPDATE requests SET started_at_ms = started_at_ms - {} WHERE session_id = '{session}'",
                days * DAY_MS
            ),
        )
        .await;
        exec(
            &gw,
            &format!(
                "UPDATE signals SET received_at_ms = received_at_ms - {} WHERE session_id = '{session}'",
                days * DAY_MS
            ),
        )
        .await;
    }
    // The ingest counted the records' usage under their real day: the day totals are made again
    // from the moved records (as m0023 makes them on a database filled before it).
    let conn = gw.database().await;
    let backfill = nm_controlplane::usage::totals::backfill_sql(conn.get_database_backend(), false);
    let _ = conn.close().await;
    exec(&gw, "DELETE FROM usage_rollups").await;
    exec(&gw, &backfill).await;
    let before = answers(&gw).await;
    let writer = progress(&gw, "writer").await;
    assert_eq!(
        (writer.1, writer.2),
        (3, 3),
        "three signals of the writer, all in the last 7 days: {writer:?}"
    );
    let coder = progress(&gw, "coder").await;
    gw.stop().await;

    // The second keeps one day of records and signals.
    let gw = TestGateway::builder()
        .db(db)
        .env("NM_DATABASE_URL", &url)
        .env("NM_RETENTION_RECORDS", "1d")
        .env("NM_RETENTION_SIGNALS", "1d")
        .upstream("openai", &openai.url)
        .run()
        .await;
    let old = format!(
        "started_at_ms < {}",
        chrono::Utc::now().timestamp_millis() - DAY_MS
    );
    eventually(Duration::from_secs(30), "old records deleted", || async {
        (gw.count(&format!("SELECT COUNT(*) AS n FROM requests WHERE {old}"))
            .await
            == 0)
            .then_some(())
    })
    .await;
    eventually(Duration::from_secs(30), "old signals deleted", || async {
        (gw.count("SELECT COUNT(*) AS n FROM signals").await == 2).then_some(())
    })
    .await;
    assert_eq!(gw.count("SELECT COUNT(*) AS n FROM requests").await, 3);
    assert!(gw.count("SELECT COUNT(*) AS n FROM usage_rollups").await >= 2);
    // The sessions' analytics rollups stay.
    assert_eq!(
        gw.count("SELECT COUNT(*) AS n FROM session_rollups WHERE session_id = 'sess_ret1'")
            .await,
        1
    );
    let after = answers(&gw).await;
    assert_eq!(before, after);
    // The agents' progress counts: the writer's two deleted signals live on in the rollup.
    assert_eq!(
        gw.count("SELECT COUNT(*) AS n FROM signals WHERE agent = 'writer'")
            .await,
        1
    );
    assert_eq!(progress(&gw, "writer").await, writer);
    assert_eq!(progress(&gw, "coder").await, coder);
    if db == Db::Sqlite {
        assert_eq!(
            gw.count("SELECT auto_vacuum AS n FROM pragma_auto_vacuum")
                .await,
            2
        );
    }
    gw.stop().await;
}

#[tokio::test]
async fn retention_deletes_old_rows_and_keeps_the_reports_sqlite() {
    retention_deletes_old_rows_and_keeps_the_reports(Db::Sqlite).await;
}

#[tokio::test]
async fn retention_deletes_old_rows_and_keeps_the_reports_postgres() {
    retention_deletes_old_rows_and_keeps_the_reports(Db::Postgres).await;
}

/// Signals of agent `writer` (and one without an agent) at `at`: an explicit one, an implicit
/// one of rule `regenerated` and one of rule `continued`.
async fn store_signals(db: &sea_orm::DatabaseConnection, tag: &str, at: i64) {
    let backend = db.get_database_backend();
    for (i, (agent, source, rule)) in [
        ("'writer'", "explicit", "NULL"),
        ("'writer'", "implicit", "'regenerated'"),
        ("'writer'", "implicit", "'continued'"),
        ("NULL", "explicit", "NULL"),
    ]
    .into_iter()
    .enumerate()
    {
        let sql = format!(
            "INSERT INTO signals (id, received_at_ms, session_id, action, key_id, agent, \
             attributed_by_session, source, rule) VALUES ('s{tag}_{i}', {}, 'sess_prog', \
             'accepted', 'key_1', {agent}, true, '{source}', {rule})",
            at + i as i64
        );
        db.execute_raw(Statement::from_string(backend, sql.clone()))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}

/// The progress of `writer` under each of the three evidence settings, and its status.
async fn every_progress(store: &Store, now: i64) -> Vec<(Progress, Status)> {
    let analytics = Analytics::new(store.clone());
    let mut out = Vec::new();
    for (implicit, continued) in [(false, false), (true, false), (true, true)] {
        evidence::save(
            store.conn(),
            "writer",
            Evidence {
                implicit,
                continued,
            },
            now,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let p = analytics
            .progress("writer", now)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let status = analytics
            .compute("writer", now)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .status;
        out.push((p, status));
    }
    out
}

async fn retention_keeps_the_progress_counts(db: Db) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let url = match db {
        Db::Sqlite => format!("sqlite://{}/nm.db?mode=rwc", dir.path().display()),
        Db::Postgres => match fresh_postgres_db().await {
            Some(url) => url,
            None => return,
        },
    };
    let store = Store::connect(&url).await.unwrap_or_else(|e| panic!("{e}"));
    let conn = store.conn().clone();
    // Noon today; signals at 02:00 and 11:00 of today and each of the 11 days before.
    let today = partitions::day_of_ms(chrono::Utc::now().timestamp_millis());
    let now = today * DAY_MS + 12 * 3_600_000;
    for back in 0..=11 {
        for hour in [2, 11] {
            let at = (today - back) * DAY_MS + hour * 3_600_000;
            store_signals(&conn, &format!("{back}_{hour}"), at).await;
        }
    }
    if db == Db::Postgres {
        for back in 1..=11 {
            partitions::make_partition(&store, SIGNALS, today - back)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    let count = |sql: &'static str| {
        let conn = conn.clone();
        async move {
            conn.query_one_raw(Statement::from_string(conn.get_database_backend(), sql))
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
                .map_or(0, |r| r.try_get_by_index::<i64>(0).unwrap_or(-1))
        }
    };
    assert_eq!(count("SELECT COUNT(*) FROM signals").await, 12 * 2 * 4);
    let before = every_progress(&store, now).await;
    // Each setting counts its own signals: 24, 48 and 72 in all.
    let totals: Vec<u64> = before.iter().map(|(p, _)| p.signals).collect();
    assert_eq!(totals, [24, 48, 72]);
    assert!(before.iter().all(|(_, s)| *s == Status::Collecting));

    // Signals kept 8 days and 6 hours: the cutoff is 06:00 eight days ago, so the days from
    // nine days ago are deleted whole (PostgreSQL: their partitions dropped) and the 02:00
    // signals of eight days ago by a batch. None of them is in the last 7 days.
    let (_stop, shutdown) = tokio::sync::watch::channel(false);
    let run = |hours: u64| {
        let store = store.clone();
        let shutdown = shutdown.clone();
        async move {
            Retainer::new(
                store,
                Retention {
                    records: None,
                    signals: Some(Duration::from_secs(hours * 3_600)),
                },
            )
            .run(now, &shutdown)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
        }
    };
    let done = run(8 * 24 + 6).await;
    assert_eq!(done.signals, (3 * 2 + 1) * 4, "{done:?}");
    if db == Db::Postgres {
        assert_eq!(done.partitions, 3, "{done:?}");
    }
    assert_eq!(
        count("SELECT COUNT(*) FROM signals").await,
        (12 - 3) * 2 * 4 - 4
    );
    assert_eq!(count("SELECT COUNT(*) FROM signal_rollups").await, 4);
    assert_eq!(every_progress(&store, now).await, before);

    // Signals kept 5 days: the day 7 days ago, whose noon starts the rate window, is deleted
    // whole and counts whole among the last 7 days: its 02:00 and 11:00 signals now count (2,
    // 4 and 6 more signals under the three settings).
    run(5 * 24).await;
    let after = every_progress(&store, now).await;
    for (settings, ((b, bs), (a, s))) in [1_u64, 2, 3].into_iter().zip(before.iter().zip(&after)) {
        assert_eq!(
            (a.signals, a.first_signal_ms, a.last_signal_ms, s),
            (b.signals, b.first_signal_ms, b.last_signal_ms, bs)
        );
        // The first signal is 11 days ago: the rate is over 7 days.
        let recent = |p: &Progress| (p.daily_rate * 7.0).round() as u64;
        assert_eq!(recent(a), recent(b) + 2 * settings, "{a:?} {b:?}");
    }
    store.close().await.unwrap_or_else(|e| panic!("{e}"));
    if db == Db::Postgres {
        drop_postgres_db(&url).await;
    }
}

#[tokio::test]
async fn retention_keeps_the_progress_counts_sqlite() {
    retention_keeps_the_progress_counts(Db::Sqlite).await;
}

#[tokio::test]
async fn retention_keeps_the_progress_counts_postgres() {
    retention_keeps_the_progress_counts(Db::Postgres).await;
}
