//! The one place where a [`ProxyError`] becomes an HTTP response: in the provider's native error
//! shape on proxy routes, in the gateway envelope on the gateway's own ([`crate::routes`]). Also the one place
//! errors are logged, in the request's `request` span ([`crate::log::RequestLog`]): client errors
//! at debug, upstream errors and 503s at warn, other gateway errors at error.
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
use tracing::Level;

use crate::body::{GatewayBody, ReadToEnd, RequestBody};
use crate::edge;
use crate::error::{ErrorFlavor, ProxyError, Side};
use crate::event::RequestStart;
use crate::log::{AccessLog, RequestLog, Val};
use crate::pace::PaceLimits;
use crate::path::split_prefix;
use crate::providers::{Registry, WireFormat};

/// The target of the error lines (the filter's name for them).
const TARGET: &str = module_path!();

/// The 503 lines' allowance (see [`nm_types::throttle`]).
static UNAVAILABLE_LOGGED: Throttle = Throttle::new(std::time::Duration::from_secs(1));

#[derive(Debug, Clone)]
pub struct RescueLayer {
    registry: Arc<Registry>,
    /// How request bodies must keep moving ([`crate::pace`]).
    pace: PaceLimits,
    /// Where the error lines go.
    log: AccessLog,
}

impl RescueLayer {
    pub fn new(registry: Arc<Registry>, pace: PaceLimits, log: AccessLog) -> Self {
        Self {
            registry,
            pace,
            log,
        }
    }
}

impl<S> Layer<S> for RescueLayer {
    type Service = Rescue<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Rescue {
            inner,
            registry: self.registry.clone(),
            pace: self.pace,
            log: self.log.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Rescue<S> {
    inner: S,
    registry: Arc<Registry>,
    pace: PaceLimits,
    log: AccessLog,
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
        let request = edge::request_log(req.extensions());
        let (parts, body) = req.into_parts();
        let (body, read) = RequestBody::new(body, self.pace);
        ResponseFuture {
            inner: self.inner.call(Request::from_parts(parts, body)),
            flavor,
            read,
            log: request.map(|r| (r, self.log.clone())),
        }
    }
}

pin_project! {
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        flavor: ErrorFlavor,
        read: Option<ReadToEnd>,
        // The request's `request` span and where its error line goes.
        log: Option<(RequestLog, AccessLog)>,
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
        let line = |level, message, suppressed: Option<u64>| {
            let Some((request, out)) = this.log.as_ref() else {
                return;
            };
            request.know(|k| k.status = Some(status.as_u16()));
            let fields = [
                ("nm.error", Val::Str(code)),
                ("error", Val::Show(&err)),
                ("suppressed", Val::Num(suppressed.unwrap_or_default())),
            ];
            let own = if suppressed.is_some() { 3 } else { 2 };
            request.line(out, level, TARGET, message, &fields[..own]);
        };
        match side {
            Side::Client if tracing::enabled!(Level::DEBUG) => {
                line(Level::DEBUG, "request refused", None);
            }
            Side::Upstream if tracing::enabled!(Level::WARN) => {
                line(Level::WARN, "upstream failed", None);
            }
            // An outage answers every request 503: at most a line a second, with the count of
            // the others.
            Side::Gateway if status == http::StatusCode::SERVICE_UNAVAILABLE => {
                if let Some(suppressed) = UNAVAILABLE_LOGGED.allow()
                    && tracing::enabled!(Level::WARN)
                {
                    line(Level::WARN, "unavailable", Some(suppressed));
                }
            }
            Side::Gateway if tracing::enabled!(Level::ERROR) => {
                line(Level::ERROR, "gateway error", None);
            }
            Side::Client | Side::Upstream | Side::Gateway => {}
        }
        let mut resp = err.into_response(*this.flavor);
        // A request assigned an experiment's arm says which, whoever answered it.
        if let Some(variant) = this.log.as_ref().and_then(|(r, _)| r.variant_header()) {
            resp.headers_mut()
                .insert(crate::experiment::NM_VARIANT, variant);
        }
        if this.read.as_ref().is_some_and(|r| !r.get()) {
            // HTTP/2 drops the header; its streams are unaffected.
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        Poll::Ready(Ok(resp))
    }
}
