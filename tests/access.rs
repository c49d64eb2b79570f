//! Key roles, scopes and lifecycle, and the audit trail, through real gateways: each scope
//! refused in each wire format before anything is forwarded; expiry, rotation and a scope change
//! reaching two dataplanes within 5 s (and an expiry holding on a dataplane cut off from its
//! controlplane); a viewer that can read but change nothing; a service key kept out of the admin
//! APIs; every admin change in the audit trail, without secrets, over gRPC and the CLI.

use std::time::Duration;

use nm_gateway::grpc::pb::{
    self, analytics_client::AnalyticsClient, audit_client::AuditClient,
    budgets_client::BudgetsClient, keys_client::KeysClient, usage_client::UsageClient,
};
use tonic::Code;
use tonic::transport::Channel;

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Db, Shape, TestGateway, with_key};
use crate::common::http::Answer;
use crate::common::mock::MockProvider;

fn ok<T>(r: Result<tonic::Response<T>, tonic::Status>) -> T {
    r.unwrap_or_else(|e| panic!("{e}")).into_inner()
}

async fn create(
    keys: &mut KeysClient<Channel>,
    name: &str,
    role: pb::KeyRole,
    scope: Option<pb::KeyScope>,
    expires_in: Option<Duration>,
) -> (pb::ApiKey, String) {
    let expires_at = expires_in.map(|d| {
        let at = chrono::Utc::now() + chrono::Duration::from_std(d).unwrap_or_default();
        nm_gateway::grpc::convert::ms_to_timestamp(at.timestamp_millis())
    });
    let r = ok(keys
        .create_key(with_key(
            ADMIN_KEY,
            pb::CreateKeyRequest {
                name: name.into(),
                role: role as i32,
                scope,
                expires_at,
                ..Default::default()
            },
        ))
        .await);
    (r.key.unwrap_or_default(), r.secret)
}

/// One request of each wire format: (provider, path, body for `model`).
fn request_of(format: &str, model: &str) -> (&'static str, String, String) {
    match format {
        "openai" => (
            "openai",
            "/openai/v1/chat/completions".to_owned(),
            format!(r#"{{"model":"{model}","messages":[]}}"#),
        ),
        "anthropic" => (
            "anthropic",
            "/anthropic/v1/messages".to_owned(),
            format!(r#"{{"model":"{model}","max_tokens":8,"messages":[]}}"#),
        ),
        _ => (
            "gemini",
            format!("/gemini/v1beta/models/{model}:generateContent"),
            r#"{"contents":[]}"#.to_owned(),
        ),
    }
}

async fn call(
    gw: &TestGateway,
    at: std::net::SocketAddr,
    format: &str,
    model: &str,
    key: &str,
    extra: &[(&str, &str)],
) -> Answer {
    let (_, path, body) = request_of(format, model);
    let mut headers = vec![("nm-key", key), ("content-type", "application/json")];
    headers.extend_from_slice(extra);
    gw.raw_at(at, "POST", &path, &headers, body).await
}

/// A 403 `key_scope` in the provider's own error shape, naming `dim` in its message.
fn assert_scope_refusal(format: &str, a: &Answer, dim: &str) {
    assert_eq!(
        a.status,
        403,
        "{format}: {:?}",
        String::from_utf8_lossy(&a.body)
    );
    assert_eq!(a.header("nm-error"), Some("key_scope"), "{format}");
    let b = a.json();
    let message = match format {
        "openai" => {
            assert_eq!(b["error"]["type"], "permission_error", "{b}");
            assert_eq!(b["error"]["code"], "key_scope", "{b}");
            b["error"]["message"].clone()
        }
        "anthropic" => {
            assert_eq!(b["type"], "error", "{b}");
            assert_eq!(b["error"]["type"], "permission_error", "{b}");
            b["error"]["message"].clone()
        }
        _ => {
            assert_eq!(b["error"]["code"], 403, "{b}");
            assert_eq!(b["error"]["status"], "PERMISSION_DENIED", "{b}");
            b["error"]["message"].clone()
        }
    };
    let message = message.as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("{dim} ")) || message.contains(&format!("by {dim}")),
        "{format}: the message names the {dim} scope: {message}"
    );
}

#[tokio::test]
async fn each_scope_is_refused_in_each_wire_format_before_forwarding() {
    let mock = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .upstream("anthropic", &mock.url)
        .upstream("gemini", &mock.url)
        .run()
        .await;
    let mut keys = KeysClient::new(gw.grpc_channel().await);
    let scope = pb::KeyScope {
        providers: vec!["openai".into(), "anthropic".into(), "gemini".into()],
        models: vec![
            "gpt-4o*".into(),
            "claude-3-5-*".into(),
            "gemini-2.0-*".into(),
        ],
        agents: vec!["search".into()],
        envs: vec!["production".into()],
    };
    let (_, scoped) = create(&mut keys, "scoped", pb::KeyRole::Service, Some(scope), None).await;
    let only_mistral = pb::KeyScope {
        providers: vec!["mistral".into()],
        ..Default::default()
    };
    let (_, elsewhere) = create(
        &mut keys,
        "mistral-only",
        pb::KeyRole::Service,
        Some(only_mistral),
        None,
    )
    .await;
    let good = [("nm-agent", "search"), ("nm-env", "production")];
    let at = gw.http;
    eventually(Duration::from_secs(10), "scoped keys known", || async {
        (call(&gw, at, "openai", "gpt-4o-mini", &scoped, &good)
            .await
            .status
            == 200)
            .then_some(())
    })
    .await;
    eventually(Duration::from_secs(10), "second key known", || async {
        (call(&gw, at, "openai", "gpt-4o", &elsewhere, &good)
            .await
            .status
            == 403)
            .then_some(())
    })
    .await;

    for (format, model_in, model_out) in [
        ("openai", "gpt-4o-mini", "gpt-5"),
        ("anthropic", "claude-3-5-sonnet-20241022", "claude-opus-4"),
        ("gemini", "gemini-2.0-flash", "gemini-1.5-pro"),
    ] {
        let before = mock.received().len();
        let a = call(&gw, at, format, model_in, &scoped, &good).await;
        assert_eq!(a.status, 200, "{format} in scope");
        assert_eq!(mock.received().len(), before + 1, "{format}: forwarded");

        let refusals = [
            (
                call(&gw, at, format, model_out, &scoped, &good).await,
                "model",
            ),
            (
                call(
                    &gw,
                    at,
                    format,
                    model_in,
                    &scoped,
                    &[("nm-agent", "billing"), ("nm-env", "production")],
                )
                .await,
                "agent",
            ),
            (
                call(
                    &gw,
                    at,
                    format,
                    model_in,
                    &scoped,
                    &[("nm-env", "production")],
                )
                .await,
                "agent",
            ),
            (
                call(
                    &gw,
                    at,
                    format,
                    model_in,
                    &scoped,
                    &[("nm-agent", "search"), ("nm-env", "staging")],
                )
                .await,
                "env",
            ),
            (
                call(&gw, at, format, model_in, &elsewhere, &good).await,
                "provider",
            ),
        ];
        for (a, dim) in &refusals {
            assert_scope_refusal(format, a, dim);
        }
        assert_eq!(
            mock.received().len(),
            before + 1,
            "{format}: nothing refused reached the provider"
        );
    }
    // The refused requests are recorded with their code, like any other.
    gw.one_request_where(
        "error_code = 'key_scope' AND provider = 'gemini' AND model = 'gemini-1.5-pro'",
    )
    .await;
    gw.stop().await;
}

/// Waits (up to `limit`) until both dataplanes answer `key` with `want` and `code`.
async fn on_both(
    gw: &TestGateway,
    planes: [std::net::SocketAddr; 2],
    key: impl AsRef<str>,
    want: u16,
    code: Option<&str>,
    limit: Duration,
    what: &str,
) {
    for at in planes {
        eventually(limit, what, || async {
            let a = call(gw, at, "openai", "gpt-4o", key.as_ref(), &[]).await;
            (a.status == want && a.header("nm-error") == code).then_some(())
        })
        .await;
    }
}

async fn expiry_rotation_and_scope_changes_reach_two_dataplanes(db: Db) {
    let mock = MockProvider::json("{}").start().await;
    let Some(mut gw) = TestGateway::builder()
        .db(db)
        .shape(Shape::Split)
        .upstream("openai", &mock.url)
        .start()
        .await
    else {
        return;
    };
    let second = gw.add_dataplane().await;
    let planes = [gw.http, second];
    let mut keys = KeysClient::new(gw.grpc_channel().await);
    // Expiry: accepted until its time, refused (401 expired_api_key) within 5 s after it.
    let (_, expiring) = create(
        &mut keys,
        "expiring",
        pb::KeyRole::Service,
        None,
        Some(Duration::from_secs(4)),
    )
    .await;
    let expires = tokio::time::Instant::now() + Duration::from_secs(4);
    on_both(
        &gw,
        planes,
        expiring.clone(),
        200,
        None,
        Duration::from_secs(4),
        "expiring key accepted",
    )
    .await;
    let limit =
        expires.saturating_duration_since(tokio::time::Instant::now()) + Duration::from_secs(5);
    on_both(
        &gw,
        planes,
        expiring,
        401,
        Some("expired_api_key"),
        limit,
        "expired key refused",
    )
    .await;

    // Rotation with a grace period: both secrets accepted; then without one: only the newest.
    let (key, first) = create(&mut keys, "rotating", pb::KeyRole::Service, None, None).await;
    on_both(
        &gw,
        planes,
        first.clone(),
        200,
        None,
        Duration::from_secs(5),
        "first secret",
    )
    .await;
    let rotated = ok(keys
        .rotate_key(with_key(
            ADMIN_KEY,
            pb::RotateKeyRequest {
                id: key.id.clone(),
                grace_seconds: 3_600,
            },
        ))
        .await);
    let second_secret = rotated.secret.clone();
    assert_ne!(second_secret, first);
    let k = rotated.key.unwrap_or_default();
    assert_eq!(k.id, key.id, "same key id");
    assert!(k.previous_secret_valid_until.is_some());
    on_both(
        &gw,
        planes,
        second_secret.clone(),
        200,
        None,
        Duration::from_secs(5),
        "rotated secret",
    )
    .await;
    on_both(
        &gw,
        planes,
        first.clone(),
        200,
        None,
        Duration::from_secs(5),
        "old secret in its grace",
    )
    .await;
    let third = ok(keys
        .rotate_key(with_key(
            ADMIN_KEY,
            pb::RotateKeyRequest {
                id: key.id.clone(),
                grace_seconds: 0,
            },
        ))
        .await)
    .secret;
    on_both(
        &gw,
        planes,
        third.clone(),
        200,
        None,
        Duration::from_secs(5),
        "third secret",
    )
    .await;
    for old in [first, second_secret] {
        on_both(
            &gw,
            planes,
            old,
            401,
            Some("invalid_api_key"),
            Duration::from_secs(5),
            "old secrets refused",
        )
        .await;
    }

    // A scope change: refused on both within 5 s.
    ok(keys
        .update_key(with_key(
            ADMIN_KEY,
            pb::UpdateKeyRequest {
                id: key.id.clone(),
                scope: Some(pb::KeyScope {
                    models: vec!["o1*".into()],
                    ..Default::default()
                }),
                ..Default::default()
            },
        ))
        .await);
    on_both(
        &gw,
        planes,
        third.clone(),
        403,
        Some("key_scope"),
        Duration::from_secs(5),
        "scope change",
    )
    .await;

    // A dataplane cut off from its controlplane still stops accepting an expired key.
    let (_, short) = create(
        &mut keys,
        "cut-off",
        pb::KeyRole::Service,
        None,
        Some(Duration::from_secs(3)),
    )
    .await;
    let expires = tokio::time::Instant::now() + Duration::from_secs(3);
    on_both(
        &gw,
        planes,
        short.clone(),
        200,
        None,
        Duration::from_secs(3),
        "short key accepted",
    )
    .await;
    gw.stop_controlplane().await;
    let limit =
        expires.saturating_duration_since(tokio::time::Instant::now()) + Duration::from_secs(5);
    on_both(
        &gw,
        planes,
        short,
        401,
        Some("expired_api_key"),
        limit,
        "expired without the controlplane",
    )
    .await;
    gw.restart_controlplane().await;
    gw.stop().await;
}

#[tokio::test]
async fn expiry_rotation_and_scope_changes_reach_two_dataplanes_sqlite() {
    expiry_rotation_and_scope_changes_reach_two_dataplanes(Db::Sqlite).await;
}

#[tokio::test]
async fn expiry_rotation_and_scope_changes_reach_two_dataplanes_postgres() {
    expiry_rotation_and_scope_changes_reach_two_dataplanes(Db::Postgres).await;
}

#[tokio::test]
async fn a_viewer_reads_but_changes_nothing_and_a_service_key_reads_nothing() {
    let mock = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let channel = gw.grpc_channel().await;
    let mut keys = KeysClient::new(channel.clone());
    let (target, _) = create(&mut keys, "target", pb::KeyRole::Service, None, None).await;
    let (_, viewer) = create(&mut keys, "viewer", pb::KeyRole::Viewer, None, None).await;
    let (_, service) = create(&mut keys, "service", pb::KeyRole::Service, None, None).await;
    let mut budgets = BudgetsClient::new(channel.clone());
    let mut usage = UsageClient::new(channel.clone());
    let mut audit = AuditClient::new(channel.clone());
    let mut analytics = AnalyticsClient::new(channel.clone());
    let events_before = ok(audit
        .list_audit_events(with_key(ADMIN_KEY, pb::ListAuditEventsRequest::default()))
        .await)
    .events
    .len();

    // Reads: a viewer may, a service key may not.
    for (key, allowed) in [(viewer.as_str(), true), (service.as_str(), false)] {
        let codes = [
            keys.list_keys(with_key(key, pb::ListKeysRequest::default()))
                .await
                .err()
                .map(|s| s.code()),
            budgets
                .list_budgets(with_key(key, pb::ListBudgetsRequest {}))
                .await
                .err()
                .map(|s| s.code()),
            budgets
                .get_budget(with_key(
                    key,
                    pb::GetBudgetRequest {
                        user_id: "u1".into(),
                        ..Default::default()
                    },
                ))
                .await
                .err()
                .map(|s| s.code()),
            usage
                .get_usage(with_key(key, pb::GetUsageRequest::default()))
                .await
                .err()
                .map(|s| s.code()),
            audit
                .list_audit_events(with_key(key, pb::ListAuditEventsRequest::default()))
                .await
                .err()
                .map(|s| s.code()),
        ];
        for (i, code) in codes.into_iter().enumerate() {
            let want = (!allowed).then_some(Code::PermissionDenied);
            assert_eq!(
                code,
                want,
                "read #{i} with the {} key",
                if allowed { "viewer" } else { "service" }
            );
        }
    }
    // A viewer's key listing carries no secrets (there are none to carry) but every key.
    let listed = ok(keys
        .list_keys(with_key(&viewer, pb::ListKeysRequest::default()))
        .await);
    assert!(listed.keys.iter().any(|k| k.id == target.id));

    // Every change: refused to a viewer (and to a service key).
    for key in [viewer.as_str(), service.as_str()] {
        let denied = [
            keys.create_key(with_key(
                key,
                pb::CreateKeyRequest {
                    name: "x".into(),
                    ..Default::default()
                },
            ))
            .await
            .err()
            .map(|s| s.code()),
            keys.revoke_key(with_key(
                key,
                pb::RevokeKeyRequest {
                    id: target.id.clone(),
                },
            ))
            .await
            .err()
            .map(|s| s.code()),
            keys.rotate_key(with_key(
                key,
                pb::RotateKeyRequest {
                    id: target.id.clone(),
                    grace_seconds: 0,
                },
            ))
            .await
            .err()
            .map(|s| s.code()),
            keys.update_key(with_key(
                key,
                pb::UpdateKeyRequest {
                    id: target.id.clone(),
                    role: pb::KeyRole::Admin as i32,
                    ..Default::default()
                },
            ))
            .await
            .err()
            .map(|s| s.code()),
            budgets
                .set_budget(with_key(
                    key,
                    pb::SetBudgetRequest {
                        limit_micros: Some(1),
                        period: pb::BudgetPeriod::Day as i32,
                        ..Default::default()
                    },
                ))
                .await
                .err()
                .map(|s| s.code()),
            budgets
                .delete_budget(with_key(key, pb::DeleteBudgetRequest::default()))
                .await
                .err()
                .map(|s| s.code()),
            analytics
                .recompute(with_key(key, pb::RecomputeRequest::default()))
                .await
                .err()
                .map(|s| s.code()),
            analytics
                .get_recommendations(with_key(
                    key,
                    pb::GetRecommendationsRequest {
                        agent: "a".into(),
                        refresh: true,
                    },
                ))
                .await
                .err()
                .map(|s| s.code()),
        ];
        for (i, code) in denied.into_iter().enumerate() {
            assert_eq!(code, Some(Code::PermissionDenied), "change #{i}");
        }
    }
    let events_after = ok(audit
        .list_audit_events(with_key(ADMIN_KEY, pb::ListAuditEventsRequest::default()))
        .await)
    .events
    .len();
    assert_eq!(events_after, events_before, "nothing changed");
    assert_eq!(
        ok(keys
            .list_keys(with_key(ADMIN_KEY, pb::ListKeysRequest::default()))
            .await)
        .keys
        .iter()
        .find(|k| k.id == target.id)
        .map(|k| k.role()),
        Some(pb::KeyRole::Service)
    );

    // A viewer key does not proxy: 403 key_scope naming its role.
    let a = call(&gw, gw.http, "openai", "gpt-4o", &viewer, &[]).await;
    assert_eq!((a.status, a.header("nm-error")), (403, Some("key_scope")));
    assert!(
        a.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("viewer"))
    );
    let a = call(&gw, gw.http, "openai", "gpt-4o", &service, &[]).await;
    assert_eq!(a.status, 200);
    gw.stop().await;
}

/// Runs the binary as an admin CLI against `url` and reads its JSON output. Async: the gateway
/// runs on the test's runtime, which must keep serving meanwhile.
async fn run_cli(url: &str, args: &[&str]) -> serde_json::Value {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_nm-gateway"))
        .args(args)
        .env("NM_CONTROLPLANE_URL", url)
        .env("NM_ADMIN_KEY", ADMIN_KEY)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", String::from_utf8_lossy(&out.stdout)))
}

async fn audit_trail(db: Db, shape: Shape) {
    let Some(gw) = TestGateway::builder().db(db).shape(shape).start().await else {
        return;
    };
    let channel = gw.grpc_channel().await;
    let mut keys = KeysClient::new(channel.clone());
    let mut budgets = BudgetsClient::new(channel.clone());
    let mut audit = AuditClient::new(channel.clone());
    let started = chrono::Utc::now() - chrono::Duration::seconds(1);
    let admin_id = ok(keys
        .list_keys(with_key(ADMIN_KEY, pb::ListKeysRequest::default()))
        .await)
    .keys
    .into_iter()
    .find(|k| k.name == "bootstrap")
    .map(|k| k.id)
    .unwrap_or_default();

    let mut secrets = vec![ADMIN_KEY.to_owned()];
    let (key, secret) = create(
        &mut keys,
        "audited",
        pb::KeyRole::Service,
        Some(pb::KeyScope {
            providers: vec!["openai".into()],
            ..Default::default()
        }),
        Some(Duration::from_secs(3_600)),
    )
    .await;
    secrets.push(secret);
    ok(keys
        .update_key(with_key(
            ADMIN_KEY,
            pb::UpdateKeyRequest {
                id: key.id.clone(),
                scope: Some(pb::KeyScope {
                    models: vec!["gpt-4o*".into()],
                    ..Default::default()
                }),
                labels: Some(pb::KeyLabels {
                    labels: [("team".to_owned(), "search".to_owned())].into(),
                }),
                ..Default::default()
            },
        ))
        .await);
    secrets.push(
        ok(keys
            .rotate_key(with_key(
                ADMIN_KEY,
                pb::RotateKeyRequest {
                    id: key.id.clone(),
                    grace_seconds: 60,
                },
            ))
            .await)
        .secret,
    );
    ok(keys
        .revoke_key(with_key(
            ADMIN_KEY,
            pb::RevokeKeyRequest { id: key.id.clone() },
        ))
        .await);
    ok(budgets
        .set_budget(with_key(
            ADMIN_KEY,
            pb::SetBudgetRequest {
                user_id: Some("alice".into()),
                limit_micros: Some(5_000_000),
                period: pb::BudgetPeriod::Day as i32,
                requests_per_minute: None,
                ..Default::default()
            },
        ))
        .await);
    ok(budgets
        .delete_budget(with_key(
            ADMIN_KEY,
            pb::DeleteBudgetRequest {
                user_id: Some("alice".into()),
                ..Default::default()
            },
        ))
        .await);

    // Paged by two, from before the first change.
    let range = pb::TimeRange {
        since: Some(nm_gateway::grpc::convert::ms_to_timestamp(
            started.timestamp_millis(),
        )),
        until: None,
    };
    let mut events = Vec::new();
    let mut token = String::new();
    loop {
        let page = ok(audit
            .list_audit_events(with_key(
                ADMIN_KEY,
                pb::ListAuditEventsRequest {
                    range: Some(range),
                    page_size: 2,
                    page_token: std::mem::take(&mut token),
                },
            ))
            .await);
        assert!(page.events.len() <= 2);
        events.extend(page.events);
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let ours: Vec<&pb::AuditEvent> = events
        .iter()
        .filter(|e| e.actor_key_id == admin_id)
        .collect();
    let actions: Vec<(&str, &str)> = ours
        .iter()
        .map(|e| (e.action.as_str(), e.target.as_str()))
        .collect();
    assert_eq!(
        actions,
        [
            ("key.create", key.id.as_str()),
            ("key.update", key.id.as_str()),
            ("key.rotate", key.id.as_str()),
            ("key.revoke", key.id.as_str()),
            ("budget.set", "budget:user:alice"),
            ("budget.delete", "budget:user:alice"),
        ]
    );
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap_or_default();
    assert!(ours[0].before_json.is_empty());
    assert_eq!(json(&ours[0].after_json)["scope"]["providers"][0], "openai");
    assert_eq!(
        json(&ours[1].before_json)["scope"]["providers"][0],
        "openai"
    );
    assert_eq!(json(&ours[1].after_json)["scope"]["models"][0], "gpt-4o*");
    assert_eq!(json(&ours[1].after_json)["labels"]["team"], "search");
    assert!(json(&ours[2].after_json)["rotated_at_ms"].is_i64());
    assert!(json(&ours[3].before_json)["revoked_at_ms"].is_null());
    assert!(json(&ours[3].after_json)["revoked_at_ms"].is_i64());
    assert_eq!(json(&ours[4].after_json)["limit_micros"], 5_000_000);
    assert!(ours[5].after_json.is_empty());
    // No secret, no part of one, no hash.
    for e in &events {
        let text = format!("{}{}", e.before_json, e.after_json);
        for s in &secrets {
            let hash: String = nm_types::hash_key(s)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            for needle in [s.as_str(), &s[..12], &s[4..], hash.as_str()] {
                assert!(
                    !text.contains(needle),
                    "{} leaks a secret: {text}",
                    e.action
                );
            }
        }
    }
    // A range after everything is empty.
    let later = pb::TimeRange {
        since: Some(nm_gateway::grpc::convert::ms_to_timestamp(
            (chrono::Utc::now() + chrono::Duration::hours(1)).timestamp_millis(),
        )),
        until: None,
    };
    let none = ok(audit
        .list_audit_events(with_key(
            ADMIN_KEY,
            pb::ListAuditEventsRequest {
                range: Some(later),
                ..Default::default()
            },
        ))
        .await);
    assert!(none.events.is_empty() && none.next_page_token.is_empty());

    // The CLI, a real process: create with scope, labels and expiry, list, then the trail.
    let url = gw.grpc_url();
    let created = run_cli(
        &url,
        &[
            "keys",
            "create",
            "--name",
            "cli",
            "--providers",
            "openai,anthropic",
            "--models",
            "gpt-4o*",
            "--agents",
            "a,b",
            "--envs",
            "production",
            "--label",
            "team=search",
            "--expires-in",
            "30d",
            "--json",
        ],
    )
    .await;
    let id = created["key"]["id"].as_str().unwrap_or_default().to_owned();
    assert_eq!(created["key"]["role"], "service");
    assert_eq!(
        created["key"]["scope"]["providers"],
        serde_json::json!(["anthropic", "openai"])
    );
    assert_eq!(created["key"]["labels"]["team"], "search");
    assert!(created["key"]["expires_at"].is_string());
    let listed = run_cli(&url, &["keys", "list", "--json"]).await;
    assert!(
        listed
            .as_array()
            .is_some_and(|l| l.iter().any(|k| k["id"] == id.as_str()))
    );
    let rotated = run_cli(
        &url,
        &["keys", "rotate", id.as_str(), "--grace", "1h", "--json"],
    )
    .await;
    assert!(
        rotated["secret"]
            .as_str()
            .is_some_and(|s| s.starts_with("nmk_"))
    );
    let trail = run_cli(&url, &["audit", "--since", "1h", "--json"]).await;
    let trail = trail.as_array().cloned().unwrap_or_default();
    assert!(
        trail
            .iter()
            .any(|e| e["action"] == "key.create" && e["target"] == id.as_str())
    );
    assert!(
        trail
            .iter()
            .any(|e| e["action"] == "key.rotate" && e["target"] == id.as_str())
    );
    gw.stop().await;
}

#[tokio::test]
async fn the_audit_trail_records_each_change_without_secrets_sqlite() {
    audit_trail(Db::Sqlite, Shape::Serve).await;
}

#[tokio::test]
async fn the_audit_trail_records_each_change_without_secrets_postgres() {
    audit_trail(Db::Postgres, Shape::Split).await;
}
