//! `POST /v1/signal` end to end: every contract error, all eight actions, idempotency,
//! attribution (also when the signal comes first), durability across controlplane restarts and
//! outages, concurrency, and the counts read back over gRPC — on SQLite and PostgreSQL.

use std::time::Duration;

use nm_gateway::grpc::pb::{self, agents_client::AgentsClient, status_client::StatusClient};
use nm_types::Action;
use tonic::transport::Channel;

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Db, Shape, TestGateway, admin};
use crate::common::http::Answer;
use crate::common::mock::MockProvider;

const JSON: (&str, &str) = ("content-type", "application/json");

async fn signal(gw: &TestGateway, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut h = vec![("nm-key", ADMIN_KEY), JSON];
    h.extend_from_slice(headers);
    gw.raw("POST", "/v1/signal", &h, body.to_owned()).await
}

fn sig(session: &str, action: &str) -> String {
    if action
        .parse::<Action>()
        .is_ok_and(Action::requires_edit_distance)
    {
        format!(
            r#"{{"session_id":"{session}","action":"{action}","edit_distance":12,"custom_label":null}}"#
        )
    } else {
        format!(r#"{{"session_id":"{session}","action":"{action}","custom_label":null}}"#)
    }
}

async fn agents(gw: &TestGateway) -> AgentsClient<Channel> {
    AgentsClient::new(gw.grpc_channel().await)
}

async fn counts(gw: &TestGateway, agent: Option<&str>) -> pb::AgentSignals {
    let req = pb::GetAgentSignalsRequest {
        agent: agent.unwrap_or_default().to_owned(),
        unattributed: agent.is_none(),
        ..Default::default()
    };
    agents(gw)
        .await
        .get_agent_signals(admin(req))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner()
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
    assert_eq!(b["ok"], false);
    assert_eq!(b["error"]["code"], code);
    assert!(
        b["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
    assert_eq!(a.header("nm-error"), Some(code));
}

#[tokio::test]
async fn every_contract_error() {
    let gw = TestGateway::builder().run().await;
    let cases: &[(&str, u16, &str)] = &[
        ("not json", 400, "invalid_json"),
        ("", 400, "invalid_json"),
        ("[]", 400, "invalid_json"),
        (r#"{"action":"accepted"}"#, 400, "missing_field"),
        (r#"{"session_id":"sess_1"}"#, 400, "missing_field"),
        (
            r#"{"session_id":"1234","action":"accepted"}"#,
            400,
            "invalid_session_id",
        ),
        (
            r#"{"session_id":["sess_1"],"action":"accepted"}"#,
            400,
            "invalid_session_id",
        ),
        (
            r#"{"session_id":"sess_1","action":"loved"}"#,
            400,
            "invalid_action",
        ),
        (
            r#"{"session_id":"sess_1","action":"edited"}"#,
            400,
            "edit_distance_required",
        ),
        (
            r#"{"session_id":"sess_1","action":"edited","edit_distance":-3}"#,
            400,
            "invalid_edit_distance",
        ),
        (
            r#"{"session_id":"sess_1","action":"edited","edit_distance":2.5}"#,
            400,
            "invalid_edit_distance",
        ),
        (
            r#"{"session_id":"sess_1","action":"edited","edit_distance":"7"}"#,
            400,
            "invalid_edit_distance",
        ),
        (
            r#"{"session_id":"sess_1","action":"accepted","rating":5}"#,
            400,
            "invalid_field",
        ),
    ];
    for (body, status, code) in cases {
        refused(&signal(&gw, &[], body).await, *status, code);
    }
    let label = format!(
        r#"{{"session_id":"sess_1","action":"sent","custom_label":"{}"}}"#,
        "x".repeat(2000)
    );
    refused(&signal(&gw, &[], &label).await, 400, "invalid_field");

    let body = sig("sess_1", "accepted");
    refused(
        &gw.raw("POST", "/v1/signal", &[JSON], body.clone()).await,
        401,
        "missing_api_key",
    );
    refused(
        &gw.raw(
            "POST",
            "/v1/signal",
            &[JSON, ("nm-key", "nmk_nope")],
            body.clone(),
        )
        .await,
        401,
        "invalid_api_key",
    );
    refused(
        &gw.raw("POST", "/v1/signal", &[("nm-key", ADMIN_KEY)], body.clone())
            .await,
        415,
        "unsupported_media_type",
    );
    refused(
        &gw.raw(
            "POST",
            "/v1/signal",
            &[("nm-key", ADMIN_KEY), ("content-type", "text/plain")],
            body.clone(),
        )
        .await,
        415,
        "unsupported_media_type",
    );
    let huge = format!(
        r#"{{"session_id":"sess_1","action":"sent","pad":"{}"}}"#,
        "x".repeat(70 * 1024)
    );
    refused(&signal(&gw, &[], &huge).await, 413, "payload_too_large");
    refused(
        &signal(&gw, &[("nm-agent", "bad\tname")], &body).await,
        400,
        "invalid_field",
    );

    // Nothing refused was counted.
    assert_eq!(counts(&gw, None).await.total, 0);
    assert_eq!(counts(&gw, Some("x")).await.total, 0);
    gw.stop().await;
}

async fn all_actions_counted_exactly(db: Db) {
    let mock = MockProvider::json("{}").start().await;
    let Some(gw) = TestGateway::builder()
        .db(db)
        .upstream("openai", &mock.url)
        .start()
        .await
    else {
        return;
    };
    // The session belongs to agent "writer" in staging through a proxied request.
    let a = gw
        .post(
            "/openai/v1/chat/completions",
            &[
                ("nm-agent", "writer"),
                ("nm-session", "sess_w1"),
                ("nm-env", "staging"),
                ("nm-user", "u1"),
            ],
            "{}",
        )
        .await;
    assert_eq!(a.status, 200);
    eventually(Duration::from_secs(10), "session recorded", || async {
        let s = agents(&gw)
            .await
            .get_session(admin(pb::GetSessionRequest {
                session_id: "sess_w1".into(),
            }))
            .await
            .ok()?;
        (s.into_inner().agent.as_deref() == Some("writer")).then_some(())
    })
    .await;

    for (i, action) in Action::ALL.iter().enumerate() {
        for _ in 0..=i {
            ok(&signal(&gw, &[], &sig("sess_w1", action.as_str())).await);
        }
    }
    let c = counts(&gw, Some("writer")).await;
    assert_eq!(c.total, 36);
    let by = c.by_action.unwrap_or_default();
    assert_eq!(
        [
            by.accepted,
            by.edited,
            by.regenerated,
            by.abandoned,
            by.thumbs_up,
            by.thumbs_down,
            by.published,
            by.sent
        ],
        [1, 2, 3, 4, 5, 6, 7, 8]
    );
    assert_eq!(
        (c.threshold, c.remaining, c.recommendations_unlocked),
        (100, 64, false)
    );
    assert!((c.progress - 0.36).abs() < 1e-9);

    // Env filter and time range.
    let mut client = agents(&gw).await;
    let staging = client
        .get_agent_signals(admin(pb::GetAgentSignalsRequest {
            agent: "writer".into(),
            env: Some("staging".into()),
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(staging.total, 36);
    let prod = client
        .get_agent_signals(admin(pb::GetAgentSignalsRequest {
            agent: "writer".into(),
            env: Some("production".into()),
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(prod.total, 0);
    let future = prost_types::Timestamp {
        seconds: chrono::Utc::now().timestamp() + 3600,
        nanos: 0,
    };
    let later = client
        .get_agent_signals(admin(pb::GetAgentSignalsRequest {
            agent: "writer".into(),
            range: Some(pb::TimeRange {
                since: Some(future),
                until: None,
            }),
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(later.total, 0);
    let bad_env = client
        .get_agent_signals(admin(pb::GetAgentSignalsRequest {
            agent: "writer".into(),
            env: Some("prod".into()),
            ..Default::default()
        }))
        .await;
    assert_eq!(
        bad_env.err().map(|s| s.code()),
        Some(tonic::Code::InvalidArgument)
    );

    let list = client
        .list_agents(admin(pb::ListAgentsRequest::default()))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    let writer = list
        .agents
        .iter()
        .find(|a| a.agent == "writer")
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (writer.signals, writer.sessions, writer.requests),
        (36, 1, 1)
    );
    assert!(writer.last_activity.is_some());

    let session = client
        .get_session(admin(pb::GetSessionRequest {
            session_id: "sess_w1".into(),
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(
        (
            session.env.as_deref(),
            session.user_id.as_deref(),
            session.requests,
            session.signals
        ),
        (Some("staging"), Some("u1"), 1, 36)
    );
    let missing = client
        .get_session(admin(pb::GetSessionRequest {
            session_id: "sess_nobody".into(),
        }))
        .await;
    assert_eq!(missing.err().map(|s| s.code()), Some(tonic::Code::NotFound));
    let unauth = client
        .list_agents(tonic::Request::new(pb::ListAgentsRequest::default()))
        .await;
    assert_eq!(
        unauth.err().map(|s| s.code()),
        Some(tonic::Code::Unauthenticated)
    );
    gw.stop().await;
}

#[tokio::test]
async fn all_actions_counted_exactly_sqlite() {
    all_actions_counted_exactly(Db::Sqlite).await;
}

#[tokio::test]
async fn all_actions_counted_exactly_postgres() {
    all_actions_counted_exactly(Db::Postgres).await;
}

#[tokio::test]
async fn an_idempotency_key_counts_a_retried_signal_once() {
    let gw = TestGateway::builder().run().await;
    for _ in 0..3 {
        ok(&signal(
            &gw,
            &[("nm-agent", "idem"), ("idempotency-key", "retry-1")],
            &sig("sess_i", "accepted"),
        )
        .await);
    }
    ok(&signal(
        &gw,
        &[("nm-agent", "idem"), ("idempotency-key", "retry-2")],
        &sig("sess_i", "accepted"),
    )
    .await);
    ok(&signal(&gw, &[("nm-agent", "idem")], &sig("sess_i", "accepted")).await);
    ok(&signal(&gw, &[("nm-agent", "idem")], &sig("sess_i", "accepted")).await);
    assert_eq!(counts(&gw, Some("idem")).await.total, 4);
    refused(
        &signal(
            &gw,
            &[("idempotency-key", &"k".repeat(300))],
            &sig("sess_i", "accepted"),
        )
        .await,
        400,
        "invalid_field",
    );
    gw.stop().await;
}

async fn signals_before_their_session_are_attributed_later(db: Db) {
    let mock = MockProvider::json("{}").start().await;
    let Some(gw) = TestGateway::builder()
        .db(db)
        .upstream("openai", &mock.url)
        .start()
        .await
    else {
        return;
    };
    // No session yet: one without a hint (unattributed), one with a hint.
    ok(&signal(&gw, &[], &sig("sess_early", "accepted")).await);
    ok(&signal(
        &gw,
        &[("nm-agent", "guess")],
        &sig("sess_early", "thumbs_up"),
    )
    .await);
    ok(&signal(&gw, &[("nm-agent", "guess")], &sig("sess_never", "sent")).await);
    ok(&signal(&gw, &[], &sig("sess_orphan", "abandoned")).await);
    assert_eq!(counts(&gw, None).await.total, 2);
    assert_eq!(counts(&gw, Some("guess")).await.total, 2);

    // The session's first request names its real agent: both early signals move to it.
    let a = gw
        .post(
            "/openai/v1/chat/completions",
            &[
                ("nm-agent", "real"),
                ("nm-session", "sess_early"),
                ("nm-env", "production"),
            ],
            "{}",
        )
        .await;
    assert_eq!(a.status, 200);
    eventually(Duration::from_secs(10), "re-attribution", || async {
        (counts(&gw, Some("real")).await.total == 2).then_some(())
    })
    .await;
    assert_eq!(
        counts(&gw, None).await.total,
        1,
        "only the orphan stays unattributed"
    );
    assert_eq!(
        counts(&gw, Some("guess")).await.total,
        1,
        "the hint still counts where the session never showed up"
    );
    let c = counts(&gw, Some("real"))
        .await
        .by_action
        .unwrap_or_default();
    assert_eq!((c.accepted, c.thumbs_up), (1, 1));

    // Signals after the session is known go straight to its agent, whatever the hint says.
    ok(&signal(&gw, &[("nm-agent", "guess")], &sig("sess_early", "sent")).await);
    assert_eq!(counts(&gw, Some("real")).await.total, 3);
    let mut client = agents(&gw).await;
    let prod = client
        .get_agent_signals(admin(pb::GetAgentSignalsRequest {
            agent: "real".into(),
            env: Some("production".into()),
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(
        prod.total, 3,
        "re-attributed signals also learn the session's env"
    );
    gw.stop().await;
}

#[tokio::test]
async fn signals_before_their_session_are_attributed_later_sqlite() {
    signals_before_their_session_are_attributed_later(Db::Sqlite).await;
}

#[tokio::test]
async fn signals_before_their_session_are_attributed_later_postgres() {
    signals_before_their_session_are_attributed_later(Db::Postgres).await;
}

async fn nothing_acknowledged_is_lost_across_restarts(db: Db) {
    let Some(mut gw) = TestGateway::builder()
        .db(db)
        .shape(Shape::Split)
        .start()
        .await
    else {
        return;
    };
    for i in 0..25 {
        ok(&signal(
            &gw,
            &[("nm-agent", "durable")],
            &sig(&format!("sess_d{i}"), "accepted"),
        )
        .await);
    }
    gw.stop_controlplane().await;
    // While the controlplane is down: 503 unavailable with Retry-After, and nothing stored.
    let down = signal(
        &gw,
        &[("nm-agent", "durable")],
        &sig("sess_down", "accepted"),
    )
    .await;
    refused(&down, 503, "unavailable");
    assert!(
        down.header("retry-after")
            .is_some_and(|v| v.parse::<u32>().is_ok())
    );
    gw.restart_controlplane().await;
    gw.wait_healthy().await;
    let c = counts(&gw, Some("durable")).await;
    assert_eq!(
        c.total, 25,
        "every acknowledged signal survived, the refused one was not stored"
    );
    ok(&signal(
        &gw,
        &[("nm-agent", "durable")],
        &sig("sess_after", "accepted"),
    )
    .await);
    assert_eq!(counts(&gw, Some("durable")).await.total, 26);
    gw.stop().await;
}

#[tokio::test]
async fn nothing_acknowledged_is_lost_across_restarts_sqlite() {
    nothing_acknowledged_is_lost_across_restarts(Db::Sqlite).await;
}

#[tokio::test]
async fn nothing_acknowledged_is_lost_across_restarts_postgres() {
    nothing_acknowledged_is_lost_across_restarts(Db::Postgres).await;
}

#[tokio::test]
async fn many_concurrent_signals_are_all_committed() {
    let gw = TestGateway::builder().run().await;
    let gw = std::sync::Arc::new(gw);
    let mut tasks = Vec::new();
    for c in 0..32 {
        let gw = gw.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                let a = signal(
                    &gw,
                    &[
                        ("nm-agent", "busy"),
                        ("idempotency-key", &format!("c{c}-{i}")),
                    ],
                    &sig(
                        &format!("sess_c{c}"),
                        Action::ALL[i % Action::ALL.len()].as_str(),
                    ),
                )
                .await;
                assert_eq!(a.status, 200);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap_or_else(|e| panic!("{e}"));
    }
    let c = counts(&gw, Some("busy")).await;
    assert_eq!(c.total, 800);
    assert!(c.recommendations_unlocked);
    assert_eq!(c.remaining, 0);
    if let Ok(gw) = std::sync::Arc::try_unwrap(gw) {
        gw.stop().await;
    }
}

#[tokio::test]
async fn readiness_over_grpc() {
    let gw = TestGateway::builder().run().await;
    let ch = gw.grpc_channel().await;
    let r = StatusClient::new(ch.clone())
        .get_readiness(pb::GetReadinessRequest {})
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert!(
        r.ready && r.database_reachable && r.migrations_current,
        "{r:?}"
    );
    assert_eq!(
        (r.database.as_str(), r.version.as_str()),
        ("sqlite", env!("CARGO_PKG_VERSION"))
    );
    let health = tonic_health::pb::health_client::HealthClient::new(ch)
        .check(tonic_health::pb::HealthCheckRequest {
            service: "nm.v1.Agents".into(),
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    assert_eq!(
        health.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    gw.stop().await;
}

#[tokio::test]
async fn other_v1_paths_are_404_in_the_gateway_envelope() {
    let gw = TestGateway::builder().run().await;
    refused(
        &gw.raw("POST", "/v1/signals", &[("nm-key", ADMIN_KEY)], "{}")
            .await,
        404,
        "not_found",
    );
    refused(
        &gw.raw("GET", "/v1/signal", &[("nm-key", ADMIN_KEY)], "")
            .await,
        405,
        "method_not_allowed",
    );
    gw.stop().await;
}
