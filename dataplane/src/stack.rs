//! The dataplane service, top to bottom.
//!
//! | layer | adds / reads |
//! |---|---|
//! | [`RequestIdLayer`] | adds `RequestId`; sets `NM-Request-Id` on every response |
//! | [`TraceLayer`] | reads `RequestId`; classifies the route; adds `RequestStart` (the route, the request's log span and, with tracing on, its exported spans); sets `NM-Trace-Id` |
//! | [`RescueLayer`] | reads the route; turns every `ProxyError` below into a native-shaped response, logs it once |
//! | [`AuthLayer`] | reads the route and `NM-Key`; adds `Principal` (routes that need none: [`crate::routes`]) |
//! | [`Router`] | reads the route: the gateway's own routes ([`crate::routes::TABLE`]), else `/<provider>/...` ([`crate::proxy`]) |

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use serde_json::json;
use tower::{Service, ServiceBuilder};

use crate::body::{GatewayBody, RequestBody};
use crate::error::ProxyError;
use crate::event::RequestStart;
use crate::layers::{AuthLayer, RequestIdLayer, RescueLayer, TraceLayer};
use crate::routes::{Own, Route};
pub use crate::state::State;

/// Builds the dataplane service for one connection (cheap: clones of `Arc`s).
pub fn service(
    state: Arc<State>,
) -> impl Service<Request<Incoming>, Response = Response<GatewayBody>, Error = Infallible, Future: Send>
+ Clone
+ Send {
    ServiceBuilder::new()
        // Outermost, so even errors and health answers carry NM-Request-Id.
        .layer(RequestIdLayer)
        // The span wraps everything below, so every log line has the request id.
        .layer(TraceLayer::new(
            state.tracing.clone(),
            state.metrics.clone(),
        ))
        // Errors from auth, routing and forwarding become native-shaped responses here.
        .layer(RescueLayer::new(
            state.registry.clone(),
            crate::pace::PaceLimits {
                idle: state.conn_limits.body_idle_timeout,
                min_rate: state.conn_limits.body_min_rate,
            },
            state.access_log.clone(),
        ))
        // Before routing: no provider sees a request without a valid key.
        .layer(AuthLayer::new(state.keys.clone()))
        .service(Router { state })
}

/// Dispatches to the health check or the proxy.
#[derive(Debug, Clone)]
pub struct Router {
    state: Arc<State>,
}

impl Service<Request<RequestBody>> for Router {
    type Response = Response<GatewayBody>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<GatewayBody>, ProxyError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<RequestBody>) -> Self::Future {
        let state = self.state.clone();
        let method = req.method().clone();
        match RequestStart::route_of(&req) {
            Route::Own(Own::Ready) => {
                Box::pin(async move { health(&state, &method, Probe::Ready) })
            }
            Route::Own(Own::Live) => Box::pin(async move { health(&state, &method, Probe::Live) }),
            Route::Own(Own::Metrics) => Box::pin(async move { metrics(&state, &method) }),
            Route::Own(Own::Signal) => Box::pin(crate::signal::handle(state, req)),
            Route::Unknown => {
                let err = ProxyError::NotFound {
                    method,
                    path: req.uri().path().to_owned(),
                };
                Box::pin(async move { Err(err) })
            }
            Route::Proxy => Box::pin(crate::proxy::handle(state, req)),
        }
    }
}

/// `GET /metrics`: Prometheus text exposition.
fn metrics(state: &State, method: &Method) -> Result<Response<GatewayBody>, ProxyError> {
    if method != Method::GET {
        return Err(ProxyError::MethodNotAllowed(method.clone()));
    }
    if let Some(lines) = state.access_log.lines() {
        state.metrics.log_lines_dropped_to(lines.dropped());
    }
    let mut resp = Response::new(GatewayBody::full(state.metrics.render()));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    Ok(resp)
}

/// Which health question is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// `/health`: ready to serve (keys received, controlplane reachable, not draining).
    Ready,
    /// `/health/live`: the process serves HTTP. Never fails for the controlplane's sake, or an
    /// orchestrator would restart every dataplane during a controlplane outage.
    Live,
}

/// `GET /health`: 200 `{"status": "ok", "version"}`, or 503 with a status and a reason while the
/// controlplane is unreachable or the process is draining. `GET /health/live`: 200 whenever this
/// answer can be given at all.
fn health(
    state: &State,
    method: &Method,
    probe: Probe,
) -> Result<Response<GatewayBody>, ProxyError> {
    if method != Method::GET && method != Method::HEAD {
        return Err(ProxyError::MethodNotAllowed(method.clone()));
    }
    let verdict = match probe {
        Probe::Ready => state.health.status(),
        Probe::Live => Ok(()),
    };
    let (status, body) = match verdict {
        Ok(()) => (
            StatusCode::OK,
            json!({"status": "ok", "version": state.version}),
        ),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"status": "unavailable", "version": state.version, "reason": reason}),
        ),
    };
    let body = if method == Method::HEAD {
        Bytes::new()
    } else {
        Bytes::from(body.to_string())
    };
    let mut resp = Response::new(GatewayBody::full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(resp)
}
