//! Streams flow frame by frame: the first chunk reaches the client while the provider is still
//! generating, bytes are unchanged, and a client that leaves cancels the upstream request.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;

use crate::common::gateway::{ADMIN_KEY, TestGateway};
use crate::common::mock::MockProvider;
use crate::common::{fixture, sse_events};

async fn next_data(body: &mut hyper::body::Incoming) -> Option<Bytes> {
    loop {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .unwrap_or_else(|_| panic!("no frame within 10s"))?;
        let frame = frame.unwrap_or_else(|e| panic!("body error: {e}"));
        if let Ok(data) = frame.into_data() {
            return Some(data);
        }
    }
}

#[tokio::test]
async fn first_chunk_arrives_before_the_provider_sends_its_last() {
    let sse = fixture("openai/chat_stream.sse");
    let chunks = sse_events(&sse);
    assert!(chunks.len() >= 5);
    let mock = MockProvider::sse(chunks.clone()).hold_last().start().await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .run()
        .await;

    let resp = gw
        .send(
            "POST",
            "/openai/v1/chat/completions",
            &[("nm-key", ADMIN_KEY), ("nm-session", "sess_stream1")],
            r#"{"model":"gpt-4o-mini","stream":true}"#,
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers().get("content-type").map(|v| v.as_bytes()),
        Some(&b"text/event-stream"[..])
    );
    let mut body = resp.into_body();
    let mut got = BytesMut::new();
    // The mock is holding its last chunk until released: whatever we read now was streamed.
    let first = next_data(&mut body).await.unwrap_or_default();
    assert!(!first.is_empty());
    got.extend_from_slice(&first);
    while got.len() < sse.len() - chunks[chunks.len() - 1].len() {
        got.extend_from_slice(&next_data(&mut body).await.unwrap_or_default());
    }
    mock.release();
    while let Some(d) = next_data(&mut body).await {
        got.extend_from_slice(&d);
    }
    assert_eq!(got.freeze(), sse, "the stream must arrive byte for byte");
    gw.stop().await;
}

#[tokio::test]
async fn anthropic_and_gemini_streams_are_unchanged() {
    for (provider, path, fixture_name) in [
        (
            "anthropic",
            "/anthropic/v1/messages",
            "anthropic/messages_stream.sse",
        ),
        (
            "gemini",
            "/gemini/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse",
            "gemini/stream.sse",
        ),
    ] {
        let sse = fixture(fixture_name);
        // Split mid-event and mid-UTF-8 character too: the gateway must not care.
        let mut chunks = Vec::new();
        let mut rest = sse.clone();
        while rest.len() > 7 {
            chunks.push(rest.split_to(7));
        }
        chunks.push(rest);
        let mock = MockProvider::sse(chunks).start().await;
        let gw = TestGateway::builder()
            .upstream(provider, &mock.url)
            .run()
            .await;
        let a = gw.post(path, &[], "{}").await;
        assert_eq!(a.status, 200, "{provider}");
        assert_eq!(a.body, sse, "{provider}");
        gw.stop().await;
    }
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_the_upstream_request() {
    let mock = MockProvider::trickle("data: {\"x\":1}\n\n", Duration::from_millis(20))
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
            &[("nm-key", ADMIN_KEY)],
            "{}",
        )
        .await;
    let mut body = resp.into_body();
    assert!(next_data(&mut body).await.is_some());
    drop(body);
    tokio::time::timeout(Duration::from_secs(10), mock.cancelled())
        .await
        .unwrap_or_else(|_| panic!("the upstream stream was not cancelled after the client left"));
    gw.stop().await;
}

#[tokio::test]
async fn an_upstream_that_breaks_mid_stream_breaks_the_client_stream() {
    let sse = fixture("openai/chat_stream.sse");
    let chunks = sse_events(&sse);
    let mock = MockProvider::sse(chunks.clone())
        .fail_after(2)
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
            &[("nm-key", ADMIN_KEY)],
            "{}",
        )
        .await;
    assert_eq!(resp.status(), 200);
    let collected = resp.into_body().collect().await;
    assert!(
        collected.is_err(),
        "a broken upstream stream must not look complete to the client"
    );
    gw.stop().await;
}
