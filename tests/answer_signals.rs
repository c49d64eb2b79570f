//! Signals that name one answer (`request_id`, the answer's `NM-Request-Id`) end to end, in
//! `serve` and split shapes, on SQLite and PostgreSQL: after the answer's record (with and
//! without its session, a mismatching session refused 409), before it (accepted, attributed when
//! the record arrives, also when the record names another session), an id no request has, a
//! malformed one; and the analytics counting each signal for its answer's model only, in a
//! session that used two models.
//!
//! The records that arrive after their signals are crafted and sent through the dataplane's
//! own port (`nm_dataplane::link::Port`), as its shipper sends them: a proxied request's record
//! may reach the controlplane before or after a signal, and a test cannot hold it back.

use std::sync::Arc;
use std::time::Duration;

use nm_controlplane::{Controlplane, Store};
use nm_dataplane::link::Port;
use nm_gateway::grpc::pb::{self, analytics_client::AnalyticsClient, keys_client::KeysClient};
use nm_gateway::link::local::InProcess;
use nm_gateway::link::remote::Grpc;
use nm_types::VerifierKey;
use nm_types::record::RequestRecord;

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Db, LINK_SECRET, Shape, TestGateway, admin};
use crate::common::http::Answer;
use crate::common::mock::MockProvider;

async fn signal(gw: &TestGateway, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut h = vec![("nm-key", ADMIN_KEY), ("content-type", "application/json")];
    h.extend_from_slice(headers);
    gw.raw("POST", "/v1/signal", &h, body.to_owned()).await
}

fn ok(a: &Answer) {
    assert_eq!(
        (a.status, a.json()),
        (200, serde_json::json!({"ok": true})),
        "{:?}",
        String::from_utf8_lossy(&a.body)
    );
}

fn refused(a: &Answer, status: u16, code: &str) {
    assert_eq!(a.status, status, "{:?}", String::from_utf8_lossy(&a.body));
    let b = a.json();
    assert_eq!(
        (b["ok"].clone(), b["error"]["code"].clone()),
        (false.into(), code.into())
    );
    assert_eq!(a.header("nm-error"), Some(code));
}

/// A request id of the gateway's form that no request has.
pub(crate) fn fresh_request_id() -> String {
    uuid::Uuid::now_v7().hyphenated().to_string()
}

/// One signal row: (session_id, agent, attributed).
async fn stored(gw: &TestGateway, request_id: &str) -> Vec<(String, Option<String>, bool)> {
    use sea_orm::{ConnectionTrait, Statement};
    let db = gw.database().await;
    let backend = db.get_database_backend();
    let rows = db
        .query_all_raw(Statement::from_sql_and_values(
            backend,
            match backend {
                sea_orm::DatabaseBackend::Postgres => {
                    "SELECT session_id, agent, attributed_by_session FROM signals \
                     WHERE request_id = $1 ORDER BY id"
                }
                _ => {
                    "SELECT session_id, agent, attributed_by_session FROM signals \
                     WHERE request_id = ? ORDER BY id"
                }
            },
            [request_id.into()],
        ))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = db.close().await;
    rows.iter()
        .map(|r| {
            (
                r.try_get("", "session_id").unwrap_or_default(),
                r.try_get("", "agent").unwrap_or_default(),
                r.try_get("", "attributed_by_session").unwrap_or_default(),
            )
        })
        .collect()
}

/// Outcome rates of `agent` by model: (model, sessions, successes), sorted.
pub(crate) async fn by_model(gw: &TestGateway, agent: &str) -> Vec<(Option<String>, u64, u64)> {
    let mut rows: Vec<_> = AnalyticsClient::new(gw.grpc_channel().await)
        .get_outcome_rates(admin(pb::GetOutcomeRatesRequest {
            agent: agent.into(),
            group_by: vec![pb::OutcomeDimension::Model as i32],
            range: None,
            limit: 0,
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner()
        .rows
        .into_iter()
        .map(|r| (r.key[0].value.clone(), r.sessions, r.successes))
        .collect();
    rows.sort();
    rows
}

/// The port of `gw`'s shape: in `serve`, the in-process adapter over the gateway's database;
/// split, the gRPC adapter to its controlplane, with the link secret.
pub(crate) async fn port(
    gw: &TestGateway,
) -> (Arc<dyn Port>, Option<tokio::sync::watch::Sender<bool>>) {
    if gw.shape.is_split() {
        let grpc =
            Grpc::new(gw.grpc_channel().await, LINK_SECRET).unwrap_or_else(|e| panic!("{e}"));
        return (Arc::new(grpc), None);
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let store = Store::connect(&gw.db_url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let cp = Controlplane::open(store, stopped)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let local = InProcess::new(cp, VerifierKey::from_link_secret(LINK_SECRET), None);
    (Arc::new(local), Some(stop))
}

/// A live service key's id, made through the admin API (a record must name one).
pub(crate) async fn live_key(gw: &TestGateway) -> String {
    KeysClient::new(gw.grpc_channel().await)
        .create_key(admin(pb::CreateKeyRequest {
            name: "records".to_owned(),
            admin: false,
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("create: {e}"))
        .into_inner()
        .key
        .unwrap_or_else(|| panic!("no key"))
        .id
}

async fn answer_signals(db: Db, shape: Shape) {
    let mock = MockProvider::json("{}").start().await;
    let Some(gw) = TestGateway::builder()
        .db(db)
        .shape(shape)
        .upstream("openai", &mock.url)
        .start()
        .await
    else {
        return;
    };

    // --- After the record: a session that used two models, one answer each. ---
    let mut ids = Vec::new();
    for model in ["model-a", "model-b"] {
        let a = gw
            .post(
                "/openai/v1/chat/completions",
                &[("nm-agent", "two-models"), ("nm-session", "sess_two")],
                format!(r#"{{"model":"{model}","messages":[]}}"#),
            )
            .await;
        assert_eq!(a.status, 200);
        ids.push(
            a.header("nm-request-id")
                .unwrap_or_else(|| panic!("no NM-Request-Id"))
                .to_owned(),
        );
    }
    let (ra, rb) = (ids[0].clone(), ids[1].clone());
    gw.one_request_where(&format!("request_id = '{rb}'")).await;
    gw.one_request_where(&format!("request_id = '{ra}'")).await;

    // The request id alone: the session is learnt from the record.
    ok(&signal(
        &gw,
        &[],
        &format!(r#"{{"request_id":"{rb}","action":"accepted"}}"#),
    )
    .await);
    assert_eq!(
        stored(&gw, &rb).await,
        [("sess_two".to_owned(), Some("two-models".to_owned()), true)]
    );
    // Both ids, matching.
    ok(&signal(
        &gw,
        &[],
        &format!(r#"{{"session_id":"sess_two","request_id":"{ra}","action":"thumbs_down"}}"#),
    )
    .await);
    // Both ids, the request known under another session: refused, nothing stored.
    refused(
        &signal(
            &gw,
            &[],
            &format!(r#"{{"session_id":"sess_else","request_id":"{ra}","action":"accepted"}}"#),
        )
        .await,
        409,
        "session_mismatch",
    );
    assert_eq!(stored(&gw, &ra).await.len(), 1);
    // Malformed ids: refused at the edge; unknown fields still refused.
    for body in [
        r#"{"request_id":"req_1","action":"accepted"}"#.to_owned(),
        format!(
            r#"{{"request_id":"{}","action":"accepted"}}"#,
            ra.to_uppercase()
        ),
        format!(r#"{{"request_id":"{ra}","action":"accepted","request":1}}"#),
    ] {
        refused(&signal(&gw, &[], &body).await, 400, "invalid_field");
    }
    refused(
        &signal(&gw, &[], r#"{"action":"accepted"}"#).await,
        400,
        "missing_field",
    );

    // Each answer's signal counts for its own model; the session's mix counts for none.
    assert_eq!(
        by_model(&gw, "two-models").await,
        [
            (Some("model-a".to_owned()), 1, 0),
            (Some("model-b".to_owned()), 1, 1)
        ]
    );

    // --- An id no request has: accepted, waiting for its record. ---
    let unknown = fresh_request_id();
    ok(&signal(
        &gw,
        &[("nm-agent", "guess")],
        &format!(r#"{{"request_id":"{unknown}","action":"sent"}}"#),
    )
    .await);
    assert_eq!(
        stored(&gw, &unknown).await,
        [(String::new(), Some("guess".to_owned()), false)]
    );

    // --- Before the record: the signals wait, then count for the request that arrives. ---
    let early = fresh_request_id();
    let conflicting = fresh_request_id();
    ok(&signal(
        &gw,
        &[("nm-agent", "guess")],
        &format!(r#"{{"request_id":"{early}","action":"accepted"}}"#),
    )
    .await);
    // Named with a session its request turns out not to have: kept (it was acknowledged), and
    // counted for the request under the request's own session.
    ok(&signal(
        &gw,
        &[],
        &format!(
            r#"{{"session_id":"sess_claimed","request_id":"{conflicting}","action":"thumbs_up"}}"#
        ),
    )
    .await);
    assert_eq!(
        stored(&gw, &early).await,
        [(String::new(), Some("guess".to_owned()), false)]
    );
    let key = live_key(&gw).await;
    let (link, stop) = port(&gw).await;
    let now = chrono::Utc::now().timestamp_millis();
    let record = |id: &str, model: &str, session: &str| RequestRecord {
        request_id: id.to_owned(),
        started_at_ms: now,
        key_id: key.as_str().into(),
        provider: "openai".into(),
        method: "POST".into(),
        path: "/v1/chat/completions".to_owned(),
        status: 200,
        model: Some(model.to_owned()),
        agent: Some("late".to_owned()),
        session_id: session.parse().ok(),
        ..RequestRecord::default()
    };
    let ingested = link
        .ingest(&[
            record(&early, "model-c", "sess_late"),
            record(&conflicting, "model-d", "sess_late"),
            record(&fresh_request_id(), "model-e", "sess_late"),
        ])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(ingested.rejected.is_empty(), "{:?}", ingested.rejected);
    assert_eq!(
        stored(&gw, &early).await,
        [("sess_late".to_owned(), Some("late".to_owned()), true)]
    );
    assert_eq!(
        stored(&gw, &conflicting).await,
        [("sess_late".to_owned(), Some("late".to_owned()), true)]
    );
    assert_eq!(
        by_model(&gw, "late").await,
        [
            (Some("model-c".to_owned()), 1, 1),
            (Some("model-d".to_owned()), 1, 1)
        ],
        "the third request has no signal: its session counts for nothing"
    );
    // A signal after the record, with the request's session: straight to its answer.
    ok(&signal(
        &gw,
        &[],
        &format!(r#"{{"session_id":"sess_late","request_id":"{early}","action":"abandoned"}}"#),
    )
    .await);
    eventually(
        Duration::from_secs(5),
        "the last signal decides",
        || async {
            (by_model(&gw, "late").await[0] == (Some("model-c".to_owned()), 1, 0)).then_some(())
        },
    )
    .await;

    if let Some(stop) = stop {
        let _ = stop.send(true);
    }
    drop(link);
    gw.stop().await;
}

#[tokio::test]
async fn signals_name_one_answer_serve_sqlite() {
    answer_signals(Db::Sqlite, Shape::Serve).await;
}

#[tokio::test]
async fn signals_name_one_answer_serve_postgres() {
    answer_signals(Db::Postgres, Shape::Serve).await;
}

#[tokio::test]
async fn signals_name_one_answer_split_postgres() {
    answer_signals(Db::Postgres, Shape::Split).await;
}

/// An `Idempotency-Key` still counts a retried answer signal once.
#[tokio::test]
async fn a_retried_answer_signal_counts_once() {
    let gw = TestGateway::builder().run().await;
    let id = fresh_request_id();
    let body = format!(r#"{{"request_id":"{id}","action":"accepted"}}"#);
    for _ in 0..3 {
        ok(&signal(&gw, &[("idempotency-key", "answer-once")], &body).await);
    }
    assert_eq!(stored(&gw, &id).await.len(), 1);
    gw.stop().await;
}
