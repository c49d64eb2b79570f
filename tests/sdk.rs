//! Official OpenAI, Anthropic and Gemini Python SDKs against the gateway, changing only their
//! base URL and adding `NM-Key` (tests/sdk/sdk_check.py). Needs a Python with the SDKs: the
//! interpreter named by `NM_TEST_SDK_PYTHON` (`.ci/run` builds a venv for it); without it the
//! test says SKIPPED.

use crate::common::fixture;
use crate::common::gateway::{ADMIN_KEY, TestGateway};
use crate::common::mock::MockProvider;

#[tokio::test]
async fn official_sdks_work_through_the_gateway() {
    let Ok(python) = std::env::var("NM_TEST_SDK_PYTHON") else {
        eprintln!(
            "SKIPPED official SDK check: set NM_TEST_SDK_PYTHON to a python with openai, anthropic and google-genai"
        );
        return;
    };
    let openai = MockProvider::json(fixture("openai/chat_response.json"))
        .start()
        .await;
    let sse = fixture("openai/chat_stream.sse");
    let events = String::from_utf8_lossy(&sse)
        .split_inclusive("\n\n")
        .map(|e| bytes::Bytes::from(e.to_owned()))
        .collect();
    let openai_stream = MockProvider::sse(events).start().await;
    let anthropic = MockProvider::json(fixture("anthropic/messages_response.json"))
        .start()
        .await;
    let gemini = MockProvider::json(fixture("gemini/generate_response.json"))
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &openai.url)
        .upstream("anthropic", &anthropic.url)
        .upstream("gemini", &gemini.url)
        .config_toml(&format!(
            "[providers.openai-stream]\nbase_url = \"{}\"\nauth = \"bearer\"\n",
            openai_stream.url
        ))
        .run()
        .await;

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk/sdk_check.py");
    let out = tokio::process::Command::new(&python)
        .arg(script)
        .env("NM_GATEWAY", gw.url(""))
        .env("NM_KEY", ADMIN_KEY)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "SDK check failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("all SDK checks passed"));

    // The SDKs sent what a direct call would: their own credential, their own paths.
    assert_eq!(openai.last().path_and_query, "/v1/chat/completions");
    assert_eq!(
        openai.last().header("authorization"),
        Some("Bearer sk-client")
    );
    assert_eq!(anthropic.last().path_and_query, "/v1/messages");
    assert!(
        gemini
            .last()
            .path_and_query
            .ends_with("/models/gemini-2.0-flash:generateContent")
    );
    gw.stop().await;
}
