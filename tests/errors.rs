//! Gateway-made errors: native provider shapes, `NM-Error` codes, `NM-Request-Id` everywhere,
//! and nothing forwarded when a request is refused.

use std::time::Duration;

use crate::common::gateway::{ADMIN_KEY, TestGateway};
use crate::common::mock::MockProvider;

#[tokio::test]
async fn missing_and_invalid_keys_in_each_native_shape() {
    let mock = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .upstream("anthropic", &mock.url)
        .upstream("gemini", &mock.url)
        .run()
        .await;

    let a = gw
        .raw("POST", "/openai/v1/chat/completions", &[], "{}")
        .await;
    assert_eq!(
        (a.status, a.header("nm-error")),
        (401, Some("missing_api_key"))
    );
    let b = a.json();
    assert_eq!(b["error"]["type"], "authentication_error");
    assert_eq!(b["error"]["code"], "missing_api_key");
    assert!(
        b["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("NM-Key"))
    );

    let a = gw
        .raw(
            "POST",
            "/anthropic/v1/messages",
            &[("nm-key", "nmk_wrong")],
            "{}",
        )
        .await;
    assert_eq!(
        (a.status, a.header("nm-error")),
        (401, Some("invalid_api_key"))
    );
    let b = a.json();
    assert_eq!(b["type"], "error");
    assert_eq!(b["error"]["type"], "authentication_error");

    let a = gw
        .raw(
            "POST",
            "/gemini/v1/models/m:generateContent",
            &[("nm-key", "nmk_wrong")],
            "{}",
        )
        .await;
    assert_eq!(a.status, 401);
    let b = a.json();
    assert_eq!(b["error"]["code"], 401);
    assert_eq!(b["error"]["status"], "UNAUTHENTICATED");

    assert!(
        mock.received().is_empty(),
        "refused requests must never reach the provider"
    );
    gw.stop().await;
}

#[tokio::test]
async fn every_response_carries_a_request_id() {
    let mock = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let answers = [
        gw.get("/health").await,
        gw.raw("POST", "/openai/v1/chat/completions", &[], "{}")
            .await,
        gw.post("/openai/v1/chat/completions", &[], "{}").await,
        gw.post("/nope/v1/x", &[], "{}").await,
    ];
    let mut ids: Vec<String> = answers
        .iter()
        .map(|a| a.header("nm-request-id").unwrap_or_default().to_owned())
        .collect();
    assert!(
        ids.iter().all(|id| uuid::Uuid::parse_str(id).is_ok()),
        "{ids:?}"
    );
    ids.dedup();
    assert_eq!(ids.len(), 4, "ids must be unique");
    gw.stop().await;
}

#[tokio::test]
async fn unknown_provider_is_404() {
    let gw = TestGateway::builder().run().await;
    let a = gw
        .post("/notaprovider/v1/chat/completions", &[], "{}")
        .await;
    assert_eq!(
        (a.status, a.header("nm-error")),
        (404, Some("unknown_provider"))
    );
    assert_eq!(a.json()["error"]["code"], "unknown_provider");
    let a = gw.post("/", &[], "{}").await;
    assert_eq!(a.status, 404);
    gw.stop().await;
}

#[tokio::test]
async fn paths_that_leave_the_provider_api_are_refused_and_never_forwarded() {
    let mock = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .upstream("gemini", &mock.url)
        .run()
        .await;
    for path in [
        "/openai/v1/../../admin",
        "/openai/v1/%2e%2e/admin",
        "/gemini/v1beta/models/x%2F..%2F..%2Fadmin:generateContent",
        "/gemini/v1beta/models/a%2fb:generateContent",
        "/openai/v1/user@evil.example/x",
        "/openai//evil.example/v1",
        "/openai/http://evil.example/v1",
        "/openai/v1/a%5cb",
    ] {
        let a = gw.post(path, &[], "{}").await;
        assert_eq!(
            (a.status, a.header("nm-error")),
            (400, Some("invalid_path")),
            "{path}"
        );
    }
    assert!(
        mock.received().is_empty(),
        "no refused path may reach the provider: {:?}",
        mock.received()
    );
    gw.stop().await;
}

#[tokio::test]
async fn malformed_attribution_headers_are_400() {
    let mock = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    for (h, v) in [
        ("nm-session", "abc"),
        ("nm-session", "sess_"),
        ("nm-session", "sess_a b"),
        ("nm-env", "prod"),
        ("nm-env", "Production"),
    ] {
        let a = gw
            .post("/openai/v1/chat/completions", &[(h, v)], "{}")
            .await;
        assert_eq!(
            (a.status, a.header("nm-error")),
            (400, Some("invalid_header")),
            "{h}: {v}"
        );
        assert!(
            a.json()["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("NM-"))
        );
    }
    assert!(mock.received().is_empty());
    for env in ["production", "staging", "development"] {
        let a = gw
            .post(
                "/openai/v1/chat/completions",
                &[("nm-env", env), ("nm-session", "sess_ok-1")],
                "{}",
            )
            .await;
        assert_eq!(a.status, 200, "{env}");
    }
    gw.stop().await;
}

#[tokio::test]
async fn bodies_over_the_limit_are_413_in_native_shape() {
    let mock = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("anthropic", &mock.url)
        .env("NM_MAX_BODY_BYTES", "1024")
        .run()
        .await;
    let a = gw
        .post("/anthropic/v1/messages", &[], vec![b'x'; 1025])
        .await;
    assert_eq!(
        (a.status, a.header("nm-error")),
        (413, Some("payload_too_large"))
    );
    assert_eq!(a.json()["error"]["type"], "request_too_large");
    // The unread rest of the body ends the connection; the answer says so, so a pooling client
    // opens a new one for its next request.
    assert_eq!(a.header("connection"), Some("close"));
    let a = gw
        .post("/anthropic/v1/messages", &[], vec![b'x'; 1024])
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(mock.received().len(), 1);
    gw.stop().await;
}

#[tokio::test]
async fn errors_answered_before_the_body_is_read_close_the_connection() {
    let mock = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let big = vec![b' '; 256 * 1024];
    // A bad key, a path leaving the API, an unknown provider: the body is never read, so the
    // connection ends after the answer, and the answer says so.
    let bad_key = gw
        .raw(
            "POST",
            "/openai/v1/chat/completions",
            &[("nm-key", "nmk_not_a_key")],
            big.clone(),
        )
        .await;
    let bad_path = gw
        .post("/openai/v1/..%2F..%2Fadmin", &[], big.clone())
        .await;
    let unknown = gw.post("/nowhere/v1/chat", &[], big.clone()).await;
    for (a, status) in [(&bad_key, 401), (&bad_path, 400), (&unknown, 404)] {
        assert_eq!(a.status, status);
        assert_eq!(a.header("connection"), Some("close"), "{status}");
    }
    // Without a body there is nothing left unread: the connection is kept.
    let no_body = gw
        .raw(
            "POST",
            "/openai/v1/chat/completions",
            &[("nm-key", "nmk_not_a_key")],
            "",
        )
        .await;
    assert_eq!((no_body.status, no_body.header("connection")), (401, None));
    // The same client goes on working on a new connection.
    let a = gw.post("/openai/v1/chat/completions", &[], big).await;
    assert_eq!((a.status, a.header("connection")), (200, None));
    assert_eq!(mock.received().len(), 1);
    gw.stop().await;
}

#[tokio::test]
async fn unreachable_upstream_is_502() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(9);
    let gw = TestGateway::builder()
        .upstream("gemini", &format!("http://127.0.0.1:{port}"))
        .run()
        .await;
    let a = gw
        .post("/gemini/v1/models/m:generateContent", &[], "{}")
        .await;
    assert_eq!(
        (a.status, a.header("nm-error")),
        (502, Some("upstream_unreachable"))
    );
    let b = a.json();
    assert_eq!(b["error"]["status"], "UNAVAILABLE");
    assert_eq!(b["error"]["code"], 502);
    gw.stop().await;
}

#[tokio::test]
async fn a_dropped_upstream_connection_is_502() {
    let mock = MockProvider::drop_connection().start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let a = gw.post("/openai/v1/chat/completions", &[], "{}").await;
    assert_eq!(
        (a.status, a.header("nm-error")),
        (502, Some("upstream_unreachable"))
    );
    assert_eq!(a.json()["error"]["type"], "api_error");
    gw.stop().await;
}

#[tokio::test]
async fn a_slow_upstream_is_504() {
    let mock = MockProvider::json("{}")
        .delay(Duration::from_secs(5))
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("anthropic", &mock.url)
        .env("NM_HEADER_TIMEOUT_SECS", "1")
        .run()
        .await;
    let a = gw.post("/anthropic/v1/messages", &[], "{}").await;
    assert_eq!(
        (a.status, a.header("nm-error")),
        (504, Some("upstream_timeout"))
    );
    assert_eq!(a.json()["error"]["type"], "api_error");
    gw.stop().await;
}

#[tokio::test]
async fn health_needs_no_key_and_is_get_only() {
    let gw = TestGateway::builder().run().await;
    let a = gw.get("/health").await;
    assert_eq!(a.status, 200);
    assert_eq!(
        a.json(),
        serde_json::json!({"status": "ok", "version": env!("CARGO_PKG_VERSION")})
    );
    let a = gw
        .raw("POST", "/health", &[("nm-key", ADMIN_KEY)], "")
        .await;
    assert_eq!(a.status, 405);
    gw.stop().await;
}
