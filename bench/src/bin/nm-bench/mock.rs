//! The mock upstream (`nm-bench mock`): canned chat completions, JSON or SSE, no delays.

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::Value;

use crate::processes::{announce, serve};
use crate::{STREAM_CHUNKS, UNMETERED_HEADER};

pub(crate) type MockBody = BoxBody<Bytes, Infallible>;

/// The mock's canned answers, also used to check every response the load generator reads.
pub(crate) struct Canned {
    pub(crate) json: Bytes,
    pub(crate) chunks: Vec<Bytes>,
}

impl Canned {
    pub(crate) fn new() -> Self {
        let json = Bytes::from_static(
            br#"{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Hello from the nm-bench mock upstream. This reply is canned."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":13,"total_tokens":25}}"#,
        );
        let mut chunks: Vec<Bytes> = (0..STREAM_CHUNKS)
            .map(|i| {
                Bytes::from(format!(
                    "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"gpt-4o-mini\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token{i:02} \"}},\"finish_reason\":null}}]}}\n\n"
                ))
            })
            .collect();
        // The end of an OpenAI stream with `stream_options.include_usage`.
        let tail = [
            r#"{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            r#"{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":20,"total_tokens":32}}"#,
            "[DONE]",
        ];
        chunks.extend(tail.map(|data| Bytes::from(format!("data: {data}\n\n"))));
        Self { json, chunks }
    }

    pub(crate) fn len(&self, stream: bool) -> usize {
        if stream {
            self.chunks.iter().map(Bytes::len).sum()
        } else {
            self.json.len()
        }
    }
}

pub(crate) async fn mock_server(port_file: &Path) -> anyhow::Result<()> {
    let canned = Arc::new(Canned::new());
    let listener = announce(port_file).await?;
    serve(listener, move |req| {
        let canned = canned.clone();
        async move { Ok::<_, Infallible>(mock_reply(req, &canned).await) }
    })
    .await
}

pub(crate) async fn mock_reply(req: Request<Incoming>, canned: &Canned) -> Response<MockBody> {
    if req.method() != Method::POST || req.uri().path() != "/v1/chat/completions" {
        return status_reply(StatusCode::NOT_FOUND, "no such route");
    }
    let unmetered = req
        .headers()
        .get(UNMETERED_HEADER)
        .is_some_and(|v| v.as_bytes() == b"1");
    let Ok(body) = req.into_body().collect().await else {
        return status_reply(StatusCode::BAD_REQUEST, "unreadable body");
    };
    let stream = serde_json::from_slice::<Value>(&body.to_bytes())
        .ok()
        .and_then(|v| v.get("stream").and_then(Value::as_bool))
        .unwrap_or(false);
    let (content_type, body) = if stream {
        // One body frame per chunk (so chunked transfer), all ready at once.
        let frames = canned
            .chunks
            .clone()
            .into_iter()
            .map(|c| Ok(Frame::data(c)));
        (
            "text/event-stream",
            StreamBody::new(tokio_stream::iter(frames)).boxed(),
        )
    } else {
        ("application/json", Full::new(canned.json.clone()).boxed())
    };
    let content_type = if unmetered {
        "application/octet-stream"
    } else {
        content_type
    };
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

pub(crate) fn status_reply(status: StatusCode, msg: &'static str) -> Response<MockBody> {
    let mut resp = Response::new(Full::new(Bytes::from_static(msg.as_bytes())).boxed());
    *resp.status_mut() = status;
    resp
}
