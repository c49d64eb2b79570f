//! Every proxied request becomes a record in the controlplane's database, with its attribution,
//! delivered asynchronously over gRPC; sessions learn their agent, env and user.

use std::time::Duration;

use sea_orm::{ConnectionTrait, Statement};

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Db, Shape, TestGateway};
use crate::common::mock::MockProvider;

async fn rows(gw: &TestGateway, sql: &str) -> Vec<sea_orm::QueryResult> {
    let db = gw.database().await;
    let backend = db.get_database_backend();
    let r = db
        .query_all_raw(Statement::from_string(backend, sql.to_owned()))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    let _ = db.close().await;
    r
}

async fn records_are_stored(db: Db, shape: Shape) {
    let mock = MockProvider::json(r#"{"id":"x"}"#).start().await;
    let Some(gw) = TestGateway::builder()
        .db(db)
        .shape(shape)
        .upstream("openai", &mock.url)
        .start()
        .await
    else {
        return;
    };

    let a = gw
        .post(
            "/openai/v1/chat/completions?key=secret-in-query",
            &[
                ("nm-agent", "support-bot"),
                ("nm-session", "sess_r1"),
                ("nm-env", "staging"),
                ("nm-user", "user-42"),
            ],
            r#"{"model":"gpt-4o-mini","messages":[]}"#,
        )
        .await;
    assert_eq!(a.status, 200);
    let request_id = a.header("nm-request-id").unwrap_or_default().to_owned();
    gw.post(
        "/openai/v1/chat/completions",
        &[("nm-session", "sess_r1")],
        "{}",
    )
    .await;
    // A gateway-made error after authentication is recorded too.
    let e = gw
        .post("/openai/v1/../x", &[("nm-agent", "support-bot")], "{}")
        .await;
    assert_eq!(e.status, 400);

    let found = eventually(Duration::from_secs(10), "three request records", || async {
        let r = rows(&gw, "SELECT request_id, provider, method, path, model, agent, session_id, env, user_id, status, streamed, error_code, response_bytes, key_id FROM requests ORDER BY request_id").await;
        (r.len() == 3).then_some(r)
    })
    .await;
    let first = found
        .iter()
        .find(|r| {
            r.try_get::<String>("", "request_id").ok().as_deref() == Some(request_id.as_str())
        })
        .unwrap_or_else(|| panic!("record {request_id} missing"));
    let s = |c: &str| first.try_get::<Option<String>>("", c).ok().flatten();
    assert_eq!(s("provider").as_deref(), Some("openai"));
    assert_eq!(s("method").as_deref(), Some("POST"));
    assert_eq!(
        s("path").as_deref(),
        Some("/v1/chat/completions"),
        "the query (which may hold credentials) is not stored"
    );
    assert_eq!(s("model").as_deref(), Some("gpt-4o-mini"));
    assert_eq!(s("agent").as_deref(), Some("support-bot"));
    assert_eq!(s("session_id").as_deref(), Some("sess_r1"));
    assert_eq!(s("env").as_deref(), Some("staging"));
    assert_eq!(s("user_id").as_deref(), Some("user-42"));
    assert!(s("key_id").is_some_and(|k| k.starts_with("key_")));
    assert_eq!(first.try_get::<i32>("", "status").ok(), Some(200));
    assert_eq!(first.try_get::<i64>("", "response_bytes").ok(), Some(10));
    assert_eq!(s("error_code"), None);
    let refused = found
        .iter()
        .find(|r| r.try_get::<i32>("", "status").ok() == Some(400))
        .unwrap_or_else(|| panic!("error record missing"));
    assert_eq!(
        refused
            .try_get::<Option<String>>("", "error_code")
            .ok()
            .flatten()
            .as_deref(),
        Some("invalid_path")
    );

    let sessions = rows(
        &gw,
        "SELECT session_id, agent, env, user_id, request_count FROM sessions",
    )
    .await;
    assert_eq!(sessions.len(), 1);
    let sess = &sessions[0];
    assert_eq!(
        sess.try_get::<Option<String>>("", "agent")
            .ok()
            .flatten()
            .as_deref(),
        Some("support-bot")
    );
    assert_eq!(
        sess.try_get::<Option<String>>("", "env")
            .ok()
            .flatten()
            .as_deref(),
        Some("staging")
    );
    assert_eq!(
        sess.try_get::<Option<String>>("", "user_id")
            .ok()
            .flatten()
            .as_deref(),
        Some("user-42")
    );
    assert_eq!(sess.try_get::<i64>("", "request_count").ok(), Some(2));
    gw.stop().await;
}

#[tokio::test]
async fn records_sqlite_serve() {
    records_are_stored(Db::Sqlite, Shape::Serve).await;
}

#[tokio::test]
async fn records_sqlite_split() {
    records_are_stored(Db::Sqlite, Shape::Split).await;
}

#[tokio::test]
async fn records_postgres_serve() {
    records_are_stored(Db::Postgres, Shape::Serve).await;
}

#[tokio::test]
async fn stream_outcomes_are_recorded() {
    let mock = MockProvider::trickle("data: {}\n\n", Duration::from_millis(20))
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let resp = gw
        .send(
            "POST",
            "/openai/v1/chat/completions",
            &[("nm-key", ADMIN_KEY), ("nm-session", "sess_cut")],
            "{}",
        )
        .await;
    let mut body = resp.into_body();
    let _ = http_body_util::BodyExt::frame(&mut body).await;
    drop(body);
    let r = eventually(
        Duration::from_secs(10),
        "the cut stream's record",
        || async {
            rows(&gw, "SELECT streamed, error_code, ttfb_ms FROM requests")
                .await
                .pop()
        },
    )
    .await;
    assert_eq!(r.try_get::<bool>("", "streamed").ok(), Some(true));
    assert_eq!(
        r.try_get::<Option<String>>("", "error_code")
            .ok()
            .flatten()
            .as_deref(),
        Some("client_disconnected")
    );
    assert!(
        r.try_get::<Option<i64>>("", "ttfb_ms")
            .ok()
            .flatten()
            .is_some()
    );
    gw.stop().await;
}

async fn count(gw: &TestGateway) -> usize {
    rows(gw, "SELECT request_id FROM requests").await.len()
}

/// While the controlplane is down the dataplane keeps serving from memory and spools its records
/// to disk; a dataplane restart in the middle loses none; when the controlplane is back every
/// record is stored exactly once.
#[tokio::test]
async fn a_controlplane_outage_keeps_keys_and_loses_no_records() {
    let mock = MockProvider::json("{}").start().await;
    let mut gw = TestGateway::builder()
        .shape(Shape::Split)
        .upstream("openai", &mock.url)
        .run()
        .await;
    assert_eq!(
        gw.post("/openai/v1/chat/completions", &[("nm-agent", "a")], "{}")
            .await
            .status,
        200
    );
    eventually(Duration::from_secs(10), "first record", || async {
        (count(&gw).await == 1).then_some(())
    })
    .await;

    gw.stop_controlplane().await;
    let health = eventually(
        Duration::from_secs(15),
        "/health 503 without a controlplane",
        || async {
            let h = gw.get("/health").await;
            (h.status == 503).then_some(h)
        },
    )
    .await;
    let body = health.json();
    assert_ne!(body["status"], "ok");
    assert!(
        body["reason"]
            .as_str()
            .is_some_and(|r| r.contains("controlplane")),
        "{body}"
    );

    // Keys stay in force from memory; records go to the spool on disk.
    for _ in 0..5 {
        assert_eq!(
            gw.post("/openai/v1/chat/completions", &[("nm-agent", "a")], "{}")
                .await
                .status,
            200
        );
    }
    eventually(Duration::from_secs(10), "records spooled", || async {
        let m = gw.get("/metrics").await;
        assert_eq!(m.status, 200);
        String::from_utf8_lossy(&m.body)
            .contains("nm_spool_records 5")
            .then_some(())
    })
    .await;
    assert_eq!(count(&gw).await, 1);

    // A dataplane restart while the controlplane is still away: the spool survives it.
    gw.restart_dataplane().await;
    gw.restart_controlplane().await;
    gw.wait_healthy().await;
    eventually(
        Duration::from_secs(15),
        "spooled records delivered",
        || async { (count(&gw).await == 6).then_some(()) },
    )
    .await;
    assert_eq!(
        rows(&gw, "SELECT DISTINCT request_id FROM requests")
            .await
            .len(),
        6
    );
    // The spool is popped right after the controlplane's acknowledgement.
    eventually(Duration::from_secs(10), "spool emptied", || async {
        let m = gw.get("/metrics").await;
        String::from_utf8_lossy(&m.body)
            .contains("nm_spool_records 0")
            .then_some(())
    })
    .await;
    gw.stop().await;
}
