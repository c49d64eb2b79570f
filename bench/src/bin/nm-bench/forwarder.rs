//! The baseline (`nm-bench forwarder`): a minimal hyper forwarder, bodies streamed both ways.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;

use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::header;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::processes::{announce, serve};

pub(crate) type Forwarded = Either<Incoming, Full<Bytes>>;

pub(crate) async fn forwarder(upstream: SocketAddr, port_file: &Path) -> anyhow::Result<()> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> =
        Client::builder(TokioExecutor::new()).build(connector);
    let listener = announce(port_file).await?;
    serve(listener, move |req| {
        let client = client.clone();
        async move { Ok::<_, Infallible>(forward(&client, upstream, req).await) }
    })
    .await
}

/// Method, path, headers and body go to the upstream; its response streams back as it comes.
pub(crate) async fn forward(
    client: &Client<HttpConnector, Incoming>,
    upstream: SocketAddr,
    req: Request<Incoming>,
) -> Response<Forwarded> {
    let (mut parts, body) = req.into_parts();
    let pq = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    parts.uri = match format!("http://{upstream}{pq}").parse::<Uri>() {
        Ok(uri) => uri,
        Err(e) => return bad_gateway(e),
    };
    parts.headers.remove(header::HOST);
    parts.headers.remove(header::CONNECTION);
    match client.request(Request::from_parts(parts, body)).await {
        Ok(resp) => resp.map(Either::Left),
        Err(e) => bad_gateway(e),
    }
}

pub(crate) fn bad_gateway(e: impl std::fmt::Display) -> Response<Forwarded> {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(e.to_string()))));
    *resp.status_mut() = StatusCode::BAD_GATEWAY;
    resp
}
