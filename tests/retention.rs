//! Retention end to end, on SQLite and PostgreSQL: a gateway stores records and signals, some
//! are made old (their times moved back), and a gateway restarted on the same database with
//! `NM_RETENTION_RECORDS` / `NM_RETENTION_SIGNALS` deletes the old rows in the background while
//! the usage reports for those days stay the same (answered from the rollups). On SQLite, a file
//! made before retention is switched to incremental vacuum and gives its free pages back.

use std::time::Duration;

use nm_gateway::grpc::pb::{self, usage_client::UsageClient};
use sea_orm::{ConnectionTrait, Statement};

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Db, TestGateway, admin, fresh_postgres_db};
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
    for session in ["sess_ret1", "sess_ret3", "sess_ret5"] {
        let body = format!(r#"{{"session_id":"{session}","action":"accepted"}}"#);
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
    let before = answers(&gw).await;
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
