//! Transparent forwarding: bodies byte for byte, paths, queries, headers, credentials, for each
//! built-in provider shape.

use crate::common::fixture;
use crate::common::gateway::{ADMIN_KEY, TestGateway};
use crate::common::mock::MockProvider;

#[tokio::test]
async fn openai_request_and_response_bytes_are_identical() {
    let response = fixture("openai/chat_response.json");
    let mock = MockProvider::json(response.clone())
        .header("x-request-id", "req_upstream_1")
        .header("openai-processing-ms", "42")
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;

    let body = fixture("openai/chat_request.json");
    let a = gw
        .post(
            "/openai/v1/chat/completions?api-version=2024-10&x=a%20b",
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer sk-client"),
                ("openai-organization", "org-1"),
            ],
            body.clone(),
        )
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(
        a.body, response,
        "response body must come back byte for byte"
    );
    assert_eq!(a.header("x-request-id"), Some("req_upstream_1"));
    assert_eq!(a.header("openai-processing-ms"), Some("42"));
    assert_eq!(a.header("content-type"), Some("application/json"));
    assert!(a.header("nm-request-id").is_some_and(|id| id.len() == 36));

    let got = mock.last();
    assert_eq!(
        got.body, body,
        "request body must be forwarded byte for byte"
    );
    assert_eq!(got.method, "POST");
    assert_eq!(
        got.path_and_query,
        "/v1/chat/completions?api-version=2024-10&x=a%20b"
    );
    assert_eq!(got.header("authorization"), Some("Bearer sk-client"));
    assert_eq!(got.header("openai-organization"), Some("org-1"));
    assert_eq!(
        got.headers.get("host").map(|v| v.as_bytes()),
        Some(mock.addr.to_string().as_bytes())
    );
    assert_eq!(
        got.headers.get("content-length").map(|v| v.as_bytes()),
        Some(body.len().to_string().as_bytes())
    );
    gw.stop().await;
}

#[tokio::test]
async fn nm_and_hop_by_hop_headers_are_not_forwarded() {
    let mock = MockProvider::json("{}")
        .header("x-upstream", "kept")
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let a = gw
        .post(
            "/openai/v1/chat/completions",
            &[
                ("nm-agent", "support-bot"),
                ("nm-session", "sess_abc"),
                ("nm-env", "production"),
                ("nm-user", "user-1"),
                ("nm-custom", "x"),
                ("connection", "keep-alive, x-secret-hop"),
                ("x-secret-hop", "1"),
                ("keep-alive", "timeout=5"),
                ("proxy-authorization", "Basic Zm9vOmJhcg=="),
                ("te", "trailers"),
                ("x-kept", "yes"),
            ],
            "{}",
        )
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("x-upstream"), Some("kept"));
    let got = mock.last();
    for h in [
        "nm-key",
        "nm-agent",
        "nm-session",
        "nm-env",
        "nm-user",
        "nm-custom",
        "x-secret-hop",
        "keep-alive",
        "proxy-authorization",
        "te",
    ] {
        assert!(
            got.headers.get(h).is_none(),
            "{h} must not reach the provider"
        );
    }
    assert_eq!(got.header("x-kept"), Some("yes"));
    gw.stop().await;
}

#[tokio::test]
async fn anthropic_gemini_and_groq_paths_map_to_their_bases() {
    let anthropic = MockProvider::json(fixture("anthropic/messages_response.json"))
        .start()
        .await;
    let gemini = MockProvider::json(fixture("gemini/generate_response.json"))
        .start()
        .await;
    let groq = MockProvider::json(fixture("openai/chat_response.json"))
        .start()
        .await;
    let mistral = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("anthropic", &anthropic.url)
        .upstream("gemini", &format!("{}/base", gemini.url))
        .upstream("groq", &groq.url)
        .upstream("mistral", &mistral.url)
        .run()
        .await;

    let body = fixture("anthropic/messages_request.json");
    let a = gw
        .post(
            "/anthropic/v1/messages",
            &[
                ("x-api-key", "sk-ant-client"),
                ("anthropic-version", "2023-06-01"),
                ("anthropic-beta", "tools-2024-04-04"),
            ],
            body.clone(),
        )
        .await;
    assert_eq!(
        (a.status, a.body.clone()),
        (200, fixture("anthropic/messages_response.json"))
    );
    let got = anthropic.last();
    assert_eq!(got.path_and_query, "/v1/messages");
    assert_eq!(got.body, body);
    assert_eq!(got.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(got.header("anthropic-beta"), Some("tools-2024-04-04"));
    assert_eq!(got.header("x-api-key"), Some("sk-ant-client"));

    let body = fixture("gemini/generate_request.json");
    for (prefix, path) in [
        ("gemini", "/v1/models/gemini-2.0-flash:generateContent"),
        (
            "google",
            "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse",
        ),
    ] {
        let a = gw
            .post(
                &format!("/{prefix}{path}"),
                &[("x-goog-api-key", "g-client")],
                body.clone(),
            )
            .await;
        assert_eq!(a.status, 200, "{prefix}{path}");
        let got = gemini.last();
        assert_eq!(got.path_and_query, format!("/base{path}"));
        assert_eq!(got.body, body);
    }

    let a = gw
        .post(
            "/groq/openai/v1/chat/completions",
            &[],
            fixture("openai/chat_request.json"),
        )
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(groq.last().path_and_query, "/openai/v1/chat/completions");

    let a = gw
        .raw("GET", "/mistral/v1/models", &[("nm-key", ADMIN_KEY)], "")
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(
        (
            mistral.last().method.as_str(),
            mistral.last().path_and_query.as_str()
        ),
        ("GET", "/v1/models")
    );
    gw.stop().await;
}

#[tokio::test]
async fn operator_credentials_are_added_only_when_the_client_has_none() {
    let openai = MockProvider::json("{}").start().await;
    let anthropic = MockProvider::json("{}").start().await;
    let gemini = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &openai.url)
        .upstream("anthropic", &anthropic.url)
        .upstream("gemini", &gemini.url)
        .env("NM_PROVIDER_KEY_OPENAI", "sk-operator")
        .env("NM_PROVIDER_KEY_ANTHROPIC", "sk-ant-operator")
        .env("NM_PROVIDER_KEY_GEMINI", "g-operator")
        .run()
        .await;

    gw.post("/openai/v1/chat/completions", &[], "{}").await;
    assert_eq!(
        openai.last().header("authorization"),
        Some("Bearer sk-operator")
    );
    gw.post(
        "/openai/v1/chat/completions",
        &[("authorization", "Bearer sk-mine")],
        "{}",
    )
    .await;
    assert_eq!(
        openai.last().header("authorization"),
        Some("Bearer sk-mine")
    );

    gw.post("/anthropic/v1/messages", &[], "{}").await;
    assert_eq!(
        anthropic.last().header("x-api-key"),
        Some("sk-ant-operator")
    );

    gw.post("/gemini/v1/models/m:generateContent", &[], "{}")
        .await;
    assert_eq!(gemini.last().header("x-goog-api-key"), Some("g-operator"));
    gw.post("/gemini/v1/models/m:generateContent?key=g-mine", &[], "{}")
        .await;
    let last = gemini.last();
    assert!(last.headers.get("x-goog-api-key").is_none());
    assert_eq!(
        last.path_and_query,
        "/v1/models/m:generateContent?key=g-mine"
    );
    gw.stop().await;
}

/// The gateway asks upstreams for identity encoding (it meters usage from the answer as it
/// streams by); an upstream that compresses anyway is passed through untouched, headers and all.
#[tokio::test]
async fn upstreams_are_asked_for_identity_and_gzip_answers_pass_untouched() {
    // Not real gzip on purpose: the gateway must not decode, re-encode or re-frame the body.
    let compressed =
        bytes::Bytes::from_static(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03opaque-bytes\x00\xff");
    let mock = MockProvider::json(compressed.clone())
        .header("content-encoding", "gzip")
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let a = gw
        .post(
            "/openai/v1/chat/completions",
            &[("accept-encoding", "gzip")],
            "{}",
        )
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("content-encoding"), Some("gzip"));
    assert_eq!(
        a.header("content-length"),
        Some(compressed.len().to_string().as_str())
    );
    assert_eq!(a.body, compressed);
    assert_eq!(mock.last().header("accept-encoding"), Some("identity"));
    gw.stop().await;
}

#[tokio::test]
async fn upstream_errors_come_back_unchanged() {
    let body = r#"{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
    let mock = MockProvider::json(body)
        .status(429)
        .header("retry-after", "7")
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let a = gw.post("/openai/v1/chat/completions", &[], "{}").await;
    assert_eq!(a.status, 429);
    assert_eq!(a.body, body.as_bytes());
    assert_eq!(a.header("retry-after"), Some("7"));
    assert!(
        a.header("nm-error").is_none(),
        "the provider's own error is not a gateway error"
    );
    gw.stop().await;
}

#[tokio::test]
async fn large_bodies_under_the_limit_pass() {
    let mock = MockProvider::json("{}").start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    // A 5 MiB "image" payload.
    let big = format!(
        "{{\"model\":\"gpt-4o\",\"image\":\"{}\"}}",
        "A".repeat(5 * 1024 * 1024)
    );
    let a = gw
        .post("/openai/v1/chat/completions", &[], big.clone())
        .await;
    assert_eq!(a.status, 200);
    assert_eq!(mock.last().body, big.as_bytes());
    gw.stop().await;
}

#[tokio::test]
async fn user_defined_providers_from_the_config_file() {
    let mock = MockProvider::json("{\"ok\":1}").start().await;
    let toml = format!(
        "[providers.acme]\nbase_url = \"{}/api\"\nauth = \"x_api_key\"\nerrors = \"anthropic\"\naliases = [\"acme-ai\"]\napi_key = \"acme-secret\"\n",
        mock.url
    );
    let gw = TestGateway::builder().config_toml(&toml).run().await;
    for prefix in ["acme", "acme-ai"] {
        let a = gw
            .post(&format!("/{prefix}/v2/complete"), &[], "{\"q\":1}")
            .await;
        assert_eq!((a.status, a.body.as_ref()), (200, &b"{\"ok\":1}"[..]));
        let got = mock.last();
        assert_eq!(got.path_and_query, "/api/v2/complete");
        assert_eq!(got.header("x-api-key"), Some("acme-secret"));
    }
    // Its errors come in the shape it declared (anthropic).
    let a = gw.raw("POST", "/acme/v2/complete", &[], "{}").await;
    assert_eq!(a.status, 401);
    assert_eq!(a.json()["type"], "error");
    gw.stop().await;
}

#[tokio::test]
async fn https_upstreams_use_http2_when_offered_and_a_configured_ca() {
    let response = fixture("openai/chat_response.json");
    let mock = MockProvider::json(response.clone()).start_tls().await;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, mock.ca_pem.clone().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .env("NM_TLS_CA_FILE", &ca.display().to_string())
        .run()
        .await;
    let body = fixture("openai/chat_request.json");
    for _ in 0..3 {
        let a = gw
            .post("/openai/v1/chat/completions", &[], body.clone())
            .await;
        assert_eq!((a.status, a.body.clone()), (200, response.clone()));
    }
    let got = mock.received();
    assert!(
        got.iter().all(|r| r.version == http::Version::HTTP_2),
        "ALPN must pick h2"
    );
    assert!(got.iter().all(|r| r.body == body));
    gw.stop().await;

    // Without the CA the certificate is refused: a TLS failure is 502 upstream_unreachable.
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;
    let a = gw.post("/openai/v1/chat/completions", &[], body).await;
    assert_eq!(
        (a.status, a.header("nm-error")),
        (502, Some("upstream_unreachable"))
    );
    gw.stop().await;
}
