//! A plain HTTP/1.1 client for tests, and helpers to read answers.

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// A fully read answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        match serde_json::from_slice(&self.body) {
            Ok(v) => v,
            Err(e) => panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            ),
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// `NM-Trace-Id`, empty when absent.
    pub fn trace_id(&self) -> String {
        self.header("nm-trace-id").unwrap_or_default().to_owned()
    }
}

pub async fn read(resp: Response<Incoming>) -> Answer {
    let (parts, body) = resp.into_parts();
    let body = match body.collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => panic!("reading body: {e}"),
    };
    Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

pub async fn send(client: &TestClient, req: Request<Full<Bytes>>) -> Response<Incoming> {
    match client.request(req).await {
        Ok(r) => r,
        Err(e) => panic!("request failed: {e:?}"),
    }
}

/// A request builder with a body.
pub fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Request<Full<Bytes>> {
    let mut b = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    match b.body(Full::new(body.into())) {
        Ok(r) => r,
        Err(e) => panic!("bad test request: {e}"),
    }
}
