//! Opens the request's span. Fields known later (route, provider, agent, status, latency) are
//! declared `Empty` and recorded by the layers that learn them; the proxy hands the span to the
//! response body, so a streamed request's span lasts until its stream ends.

use std::task::{Context, Poll};

use http::Request;
use tower::{Layer, Service};
use tracing::instrument::{Instrument, Instrumented};
use tracing::{Span, field::Empty};

use super::RequestId;

#[derive(Debug, Clone, Copy, Default)]
pub struct TraceLayer;

impl<S> Layer<S> for TraceLayer {
    type Service = Trace<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Trace { inner }
    }
}

#[derive(Debug, Clone)]
pub struct Trace<S> {
    inner: S,
}

impl<S, B> Service<Request<B>> for Trace<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Instrumented<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let id = req
            .extensions()
            .get::<RequestId>()
            .map(|r| r.0.as_str())
            .unwrap_or_default();
        let span = tracing::info_span!(
            "request",
            nm.request_id = id,
            http.request.method = %req.method(),
            http.route = Empty,
            gen_ai.provider.name = Empty,
            gen_ai.request.model = Empty,
            nm.agent = Empty,
            nm.session = Empty,
            nm.env = Empty,
            nm.key_id = Empty,
            http.response.status_code = Empty,
            nm.latency_ms = Empty,
            gen_ai.response.model = Empty,
            gen_ai.usage.input_tokens = Empty,
            gen_ai.usage.output_tokens = Empty,
            nm.cost_micros = Empty,
        );
        req.extensions_mut().insert(RequestSpan(span.clone()));
        // Call inside the span, so what the inner layers do synchronously is attributed too.
        let fut = span.in_scope(|| self.inner.call(req));
        fut.instrument(span)
    }
}

/// The request's span, for code that outlives the request future (the response body).
#[derive(Debug, Clone)]
pub struct RequestSpan(pub Span);
