//! The one place where a [`ProxyError`] becomes an HTTP response: in the provider's native error
//! shape on proxy routes, in the gateway envelope on the gateway's own ([`crate::routes`]). Also the one place
//! errors are logged: client errors at debug, upstream and gateway errors at warn.
//!
//! It also hands the layers below the request body as a [`RequestBody`], which notes whether it
//! was read to the end. An error answered before then (a bad key, path or header, a body over
//! the limit) leaves the rest of the body unread on the connection, and hyper, which does not
//! read it either, closes the connection after the answer. So the answer says `Connection:
//! close`, and a pooling client does not send its next request on a connection about to end.
//! Errors after the body was read (a budget refusal, an upstream failure) keep the connection.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderValue, Request, Response, header};
use hyper::body::Incoming;
use nm_types::throttle::Throttle;
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use crate::body::{GatewayBody, ReadToEnd, RequestBody};
use crate::error::{ErrorFlavor, ProxyError, Side};
use crate::event::RequestStart;
use crate::pace::PaceLimits;
use crate::path::split_prefix;
use crate::providers::{Registry, WireFormat};

/// The 503 lines' allowance (see [`nm_types::throttle`]).
static UNAVAILABLE_LOGGED: Throttle = Throttle::new(std::time::Duration::from_secs(1));

#[derive(Debug, Clone)]
pub struct RescueLayer {
    registry: Arc<Registry>,
    /// How request bodies must keep moving ([`crate::pace`]).
    pace: PaceLimits,
}

impl RescueLayer {
    pub fn new(registry: Arc<Registry>, pace: PaceLimits) -> Self {
        Self { registry, pace }
    }
}

impl<S> Layer<S> for RescueLayer {
    type Service = Rescue<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Rescue {
            inner,
            registry: self.registry.clone(),
            pace: self.pace,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Rescue<S> {
    inner: S,
    registry: Arc<Registry>,
    pace: PaceLimits,
}

impl<S> Rescue<S> {
    /// The error shape for a request: the gateway envelope for its own routes and reserved names
    /// ([`crate::routes::Route`]), else its provider's. Unknown prefixes get the OpenAI shape,
    /// the one most clients parse.
    fn flavor<B>(&self, req: &Request<B>) -> ErrorFlavor {
        if RequestStart::route_of(req).gateway_shaped() {
            return ErrorFlavor::Gateway;
        }
        let style = split_prefix(req.uri().path())
            .and_then(|(prefix, _)| self.registry.get(prefix))
            .map_or(WireFormat::Openai, |p| p.format);
        ErrorFlavor::Provider(style)
    }
}

impl<S> Service<Request<Incoming>> for Rescue<S>
where
    S: Service<Request<RequestBody>, Response = Response<GatewayBody>, Error = ProxyError>,
{
    type Response = Response<GatewayBody>;
    type Error = Infallible;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Our inner services are always ready; an error here would be a gateway bug, and there is
        // no request to answer yet, so readiness errors cannot be rescued.
        match self.inner.poll_ready(cx) {
            Poll::Ready(Err(e)) => {
                tracing::error!(error = %e, "inner service failed readiness");
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Ok(())) => Poll::Ready(Ok(())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let flavor = self.flavor(&req);
        let (parts, body) = req.into_parts();
        let (body, read) = RequestBody::new(body, self.pace);
        ResponseFuture {
            inner: self.inner.call(Request::from_parts(parts, body)),
            flavor,
            read,
        }
    }
}

pin_project! {
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        flavor: ErrorFlavor,
        read: Option<ReadToEnd>,
    }
}

impl<F> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<GatewayBody>, ProxyError>>,
{
    type Output = Result<Response<GatewayBody>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let err = match this.inner.poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Ok(resp)) => return Poll::Ready(Ok(resp)),
            Poll::Ready(Err(e)) => e,
        };
        let (status, code, side) = err.classify();
        let span = tracing::Span::current();
        span.record("http.response.status_code", status.as_u16());
        match side {
            Side::Client => tracing::debug!(nm.error = code, error = %err, "request refused"),
            Side::Upstream => tracing::warn!(nm.error = code, error = %err, "upstream failed"),
            // An outage answers every request 503: at most a line a second, with the count of
            // the others.
            Side::Gateway if status == http::StatusCode::SERVICE_UNAVAILABLE => {
                if let Some(suppressed) = UNAVAILABLE_LOGGED.allow() {
                    tracing::warn!(nm.error = code, error = %err, suppressed, "unavailable");
                }
            }
            Side::Gateway => tracing::error!(nm.error = code, error = %err, "gateway error"),
        }
        let mut resp = err.into_response(*this.flavor);
        if this.read.as_ref().is_some_and(|r| !r.get()) {
            // HTTP/2 drops the header; its streams are unaffected.
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        Poll::Ready(Ok(resp))
    }
}
