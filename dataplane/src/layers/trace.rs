//! Opens the request's spans: the `request` span of its log lines ([`RequestLog`]: the request
//! id, the trace's ids, the method and route; what the request learns later is recorded there
//! by the paths that refuse or answer it, a proxied answer's access line is written from its
//! record, [`crate::event`]), and, with tracing on, its exported SERVER span ([`crate::otel`]).
//! It classifies the request's route, once, and hands it down with the spans
//! ([`RequestStart`]).
//!
//! The proxy hands the spans to the response body, so a streamed request's spans last until its
//! stream ends. Every answer to a traced (sampled) request carries `NM-Trace-Id`. The health probes and
//! `/metrics` are never traced.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use super::request_id::RequestId;
use std::time::Instant;

use crate::body::GatewayBody;
use crate::event::RequestStart;
use crate::log::RequestLog;
use crate::metrics::Metrics;
use crate::otel::{RequestTrace, TRACE_ID_HEADER, Tracing};
use crate::routes::{Own, Route};

#[derive(Debug, Clone)]
pub struct TraceLayer {
    tracing: Option<Tracing>,
    metrics: Metrics,
}

impl TraceLayer {
    /// `tracing`: the exported spans' tracer, None when tracing is off. `metrics` gets each
    /// answer's HTTP server duration (a proxied one's when its body ends, see [`crate::body`]).
    pub fn new(tracing: Option<Tracing>, metrics: Metrics) -> Self {
        Self { tracing, metrics }
    }
}

impl<S> Layer<S> for TraceLayer {
    type Service = Trace<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Trace {
            inner,
            tracing: self.tracing.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Trace<S> {
    inner: S,
    tracing: Option<Tracing>,
    metrics: Metrics,
}

impl<S, B> Service<Request<B>> for Trace<S>
where
    S: Service<Request<B>, Response = Response<GatewayBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Traced<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let id = req
            .extensions()
            .get::<RequestId>()
            .map(|r| r.0.as_str())
            .unwrap_or_default();
        // The one classification of the request's route: the layers below read it.
        let matched = Route::of(req.uri().path());
        let route = matched.template();
        // The probes and the scrape are never traced: they would bury the requests.
        let traced = !matches!(matched, Route::Own(Own::Ready | Own::Live | Own::Metrics));
        let exported = self
            .tracing
            .as_ref()
            .filter(|_| traced)
            .map(|t| t.server(req.headers(), req.method(), route, req.uri().path(), id));
        // The `request` span of the request's lines: held by the request, not by `tracing`
        // ([`crate::log::request`]); its trace ids are the SERVER span's, sampled or not.
        let log_ids = exported.as_ref().and_then(RequestTrace::log_ids);
        let log = RequestLog::new(id, log_ids, req.method(), route);
        let served = Served {
            started: Instant::now(),
            method: req.method().clone(),
            route: route.unwrap_or(""),
            metrics: self.metrics.clone(),
        };
        req.extensions_mut().insert(RequestStart {
            log,
            route: matched,
            trace: exported.clone(),
        });
        let fut = self.inner.call(req);
        Traced {
            inner: fut,
            exported,
            served,
        }
    }
}

pin_project! {
    /// The inner future; its answer gets `NM-Trace-Id` and sets the SERVER span's status.
    pub struct Traced<F> {
        #[pin]
        inner: F,
        exported: Option<RequestTrace>,
        served: Served,
    }
}

/// What the HTTP server duration of a gateway-made answer is recorded with.
struct Served {
    started: Instant,
    method: http::Method,
    route: &'static str,
    metrics: Metrics,
}

impl<F, E> Future for Traced<F>
where
    F: Future<Output = Result<Response<GatewayBody>, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut out = std::task::ready!(this.inner.poll(cx));
        if let Ok(resp) = out.as_ref()
            && matches!(resp.body(), GatewayBody::Full { .. })
        {
            let sampled = this.exported.as_ref().filter(|t| t.is_sampled());
            let trace_id = sampled.map(|t| crate::otel::trace_hex(t.trace_id()));
            let s = &this.served;
            s.metrics.http_server(
                &s.method,
                s.route,
                resp.status().as_u16(),
                s.started.elapsed(),
                trace_id.as_deref(),
            );
        }
        if let (Some(trace), Ok(resp)) = (this.exported.take(), out.as_mut()) {
            trace.respond(resp.status().as_u16(), None);
            // The id to look up in the tracing backend: only for a trace that reaches one.
            if trace.is_sampled()
                && let Ok(v) = HeaderValue::try_from(crate::otel::trace_hex(trace.trace_id()))
            {
                resp.headers_mut().insert(TRACE_ID_HEADER, v);
            }
            // A body of the gateway's own is already complete: the span ends with this answer.
            // A proxied body holds the span until its last byte.
            if matches!(resp.body(), GatewayBody::Full { .. }) {
                trace.server.end();
            }
        }
        Poll::Ready(out)
    }
}
