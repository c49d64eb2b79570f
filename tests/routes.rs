//! The gateway's own routes (`dataplane/src/routes.rs`): one table decides which need a key, which
//! names no provider may take, and that their errors come in the gateway's envelope; and the
//! hot path's mechanisms, each of which a benchmark may turn off, serve correctly when off.

use std::time::Duration;

use crate::common::gateway::{ADMIN_KEY, TestGateway};
use crate::common::http::Answer;
use crate::common::mock::MockProvider;
use crate::common::{eventually, fixture};

/// A gateway-made error in the gateway's envelope (never a provider's shape).
fn enveloped(a: &Answer, status: u16, code: &str) {
    assert_eq!(a.status, status, "{:?}", String::from_utf8_lossy(&a.body));
    let b = a.json();
    assert_eq!(b["ok"], false, "{b}");
    assert_eq!(b["error"]["code"], code, "{b}");
    assert_eq!(a.header("nm-error"), Some(code));
}

#[tokio::test]
async fn the_gateways_own_routes_and_names_answer_in_its_envelope() {
    let gw = TestGateway::builder().run().await;
    let key = [("nm-key", ADMIN_KEY)];
    // Wrong methods on the open routes.
    for path in ["/metrics", "/health", "/health/live"] {
        enveloped(
            &gw.raw("POST", path, &[], "{}").await,
            405,
            "method_not_allowed",
        );
    }
    // Under a reserved name but no route: the key is checked first, then 404.
    for path in ["/metrics/x", "/health/x", "/v1/nope"] {
        enveloped(&gw.raw("GET", path, &[], "").await, 401, "missing_api_key");
        enveloped(&gw.raw("GET", path, &key, "").await, 404, "not_found");
    }
    // The open routes need no key; a provider route still does, in its own shape.
    assert_eq!(gw.get("/metrics").await.status, 200);
    let a = gw
        .raw("POST", "/openai/v1/chat/completions", &[], "{}")
        .await;
    assert_eq!(a.status, 401);
    assert_eq!(a.json()["error"]["type"], "authentication_error");
    gw.stop().await;
}

#[tokio::test]
async fn no_provider_may_take_a_reserved_name() {
    for name in ["metrics", "health", "v1"] {
        let toml =
            format!("[providers.{name}]\nbase_url = \"http://127.0.0.1:9\"\nauth = \"bearer\"\n");
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("nm.toml");
        std::fs::write(&file, toml).unwrap_or_else(|e| panic!("{e}"));
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_nm-gateway"))
            .args(["serve", "--config", &file.to_string_lossy()])
            .env("NM_DATABASE_URL", "sqlite::memory:")
            .current_dir(dir.path())
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(out.status.code(), Some(64), "{name}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(name),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// With every hot-path mechanism off (`NM_HOT_PATH_OFF`), requests are served, metered and
/// recorded as with them on: the switches exist to measure, never to change behaviour.
#[tokio::test]
async fn every_hot_path_mechanism_can_be_turned_off() {
    let mock = MockProvider::json(fixture("openai/chat_response.json"))
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .env(
            "NM_HOT_PATH_OFF",
            "deferred_completion,key_cache,worker_pools,timer_tick",
        )
        .run()
        .await;
    let body = fixture("openai/chat_request.json");
    for _ in 0..20 {
        let a = gw
            .post(
                "/openai/v1/chat/completions",
                &[("nm-agent", "switches")],
                body.clone(),
            )
            .await;
        assert_eq!(a.status, 200);
    }
    // A wrong key is still refused with the cache off.
    let a = gw
        .raw(
            "POST",
            "/openai/v1/chat/completions",
            &[("nm-key", "nmk_not_a_key_at_all_0123456789abcdef")],
            "{}",
        )
        .await;
    assert_eq!(a.status, 401);
    let sql = "SELECT COUNT(*) AS n FROM requests WHERE agent = 'switches' AND input_tokens > 0";
    eventually(Duration::from_secs(10), "20 metered records", || async {
        (gw.count(sql).await == 20).then_some(())
    })
    .await;
    gw.stop().await;
}

#[tokio::test]
async fn an_unknown_mechanism_is_refused_at_start() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nm-gateway"))
        .arg("serve")
        .env("NM_DATABASE_URL", "sqlite::memory:")
        .env("NM_HOT_PATH_OFF", "key_cache,turbo")
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.status.code(), Some(64), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("NM_HOT_PATH_OFF"));
}
