//! Test harness: real gateways on loopback ports ([`gateway`]), mock LLM providers
//! ([`mock`]), and small HTTP helpers.

#![allow(
    dead_code,
    reason = "each test module uses a different part of the harness"
)]

pub mod child;
pub mod gateway;
pub mod http;
pub mod mock;
pub mod openmetrics;
pub mod otlp;
pub mod phoenix;
pub mod pki;
pub mod stub_link;

use std::future::Future;
use std::time::Duration;

/// Polls `cond` every 20 ms until it returns `Some`, or panics after `limit` naming `what`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, cond: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually_with(limit, what, String::new, cond).await
}

/// [`eventually`], whose panic adds what `detail` says of the state it gave up in (the spans
/// received, a child process's log).
pub async fn eventually_with<T, F, Fut>(
    limit: Duration,
    what: &str,
    detail: impl Fn() -> String,
    mut cond: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = cond().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}\n{}",
            detail()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fixture file's bytes, exactly as stored.
pub fn fixture(path: &str) -> bytes::Bytes {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(path);
    match std::fs::read(&full) {
        Ok(b) => bytes::Bytes::from(b),
        Err(e) => panic!("fixture {}: {e}", full.display()),
    }
}

/// An SSE body split into its events (each with its blank-line terminator).
pub fn sse_events(sse: &bytes::Bytes) -> Vec<bytes::Bytes> {
    String::from_utf8_lossy(sse)
        .split_inclusive("\n\n")
        .map(|e| bytes::Bytes::from(e.to_owned()))
        .collect()
}

/// A body cut into `n`-byte frames, regardless of events or UTF-8 characters.
pub fn cut_every(body: &bytes::Bytes, n: usize) -> Vec<bytes::Bytes> {
    body.chunks(n.max(1))
        .map(bytes::Bytes::copy_from_slice)
        .collect()
}
