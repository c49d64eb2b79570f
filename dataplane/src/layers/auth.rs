//! Checks `NM-Key` against the in-memory [`KeySet`] and stores the [`Principal`] as an extension:
//! unknown 401 `invalid_api_key`, expired (by this process's clock) 401 `expired_api_key`, a
//! role that may not use the dataplane (viewer) 403 `key_scope`. The key's scope (provider,
//! model, agent, env) is the proxy's to check, once it knows them. Which routes need no key is
//! [`crate::routes::TABLE`]'s to say.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use crate::body::GatewayBody;
use crate::error::ProxyError;
use crate::event::RequestStart;
use crate::keys::KeySet;

pub const NM_KEY: http::HeaderName = http::HeaderName::from_static("nm-key");

#[derive(Debug, Clone)]
pub struct AuthLayer {
    keys: KeySet,
}

impl AuthLayer {
    pub fn new(keys: KeySet) -> Self {
        Self { keys }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Auth {
            inner,
            keys: self.keys.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Auth<S> {
    inner: S,
    keys: KeySet,
}

impl<S, B> Service<Request<B>> for Auth<S>
where
    S: Service<Request<B>, Response = Response<GatewayBody>, Error = ProxyError>,
{
    type Response = Response<GatewayBody>;
    type Error = ProxyError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        if !RequestStart::route_of(&req).needs_key() {
            return ResponseFuture::Inner {
                inner: self.inner.call(req),
            };
        }
        let principal = match req.headers().get(&NM_KEY).map(|v| v.to_str()) {
            None => Err(ProxyError::MissingApiKey),
            // Before the first key snapshot no key can be judged: "try again", not "wrong key"
            // (SDKs give up on a 401 for good).
            Some(_) if !self.keys.is_loaded() => Err(ProxyError::Unavailable(
                "the gateway has not received its keys from the controlplane yet".to_owned(),
            )),
            Some(Err(_)) => Err(ProxyError::InvalidApiKey),
            Some(Ok(secret)) => match self.keys.check(secret.trim()) {
                None => Err(ProxyError::InvalidApiKey),
                // By this process's clock: an expiry holds without the controlplane.
                Some(p) if p.is_expired() => Err(ProxyError::ExpiredApiKey),
                Some(p) if !p.role.may_proxy() => Err(ProxyError::KeyScope(format!(
                    "role {}: a {} key may only call the admin APIs that read",
                    p.role, p.role
                ))),
                Some(p) => Ok(p),
            },
        };
        match principal {
            Ok(p) => {
                // The key id is logged by who uses the key: the proxy's access line (or its
                // error's span), the signal handler.
                req.extensions_mut().insert(p);
                ResponseFuture::Inner {
                    inner: self.inner.call(req),
                }
            }
            Err(e) => ResponseFuture::Refused { error: Some(e) },
        }
    }
}

pin_project! {
    #[project = ResponseFutureProj]
    pub enum ResponseFuture<F> {
        Inner { #[pin] inner: F },
        Refused { error: Option<ProxyError> },
    }
}

impl<F> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<GatewayBody>, ProxyError>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            ResponseFutureProj::Inner { inner } => inner.poll(cx),
            ResponseFutureProj::Refused { error } => {
                Poll::Ready(Err(error.take().unwrap_or_else(|| {
                    ProxyError::Internal("auth future polled after completion".to_owned())
                })))
            }
        }
    }
}
