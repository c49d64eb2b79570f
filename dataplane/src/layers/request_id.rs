//! Gives every request an id (a UUIDv7: time-ordered, so ids sort by arrival), stores it as a
//! [`RequestId`] extension for the layers below, and returns it in `NM-Request-Id` on every
//! response, errors included.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use tower::{Layer, Service};

pub const NM_REQUEST_ID: &str = "nm-request-id";

/// The request's id, as sent in `NM-Request-Id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(pub String);

#[derive(Debug, Clone, Copy, Default)]
pub struct RequestIdLayer;

impl<S> Layer<S> for RequestIdLayer {
    type Service = SetRequestId<S>;
    fn layer(&self, inner: S) -> Self::Service {
        SetRequestId { inner }
    }
}

#[derive(Debug, Clone)]
pub struct SetRequestId<S> {
    inner: S,
}

impl<S, B, RB> Service<Request<B>> for SetRequestId<S>
where
    S: Service<Request<B>, Response = Response<RB>, Error = Infallible>,
{
    type Response = Response<RB>;
    type Error = Infallible;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        // Encoded into a buffer on the stack, not through `Display`.
        let mut buf = uuid::Uuid::encode_buffer();
        let id: &str = uuid::Uuid::now_v7().hyphenated().encode_lower(&mut buf);
        let header = HeaderValue::from_str(id).ok();
        req.extensions_mut().insert(RequestId(id.to_owned()));
        ResponseFuture {
            inner: self.inner.call(req),
            header,
        }
    }
}

pin_project! {
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        header: Option<HeaderValue>,
    }
}

impl<F, RB> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<RB>, Infallible>>,
{
    type Output = Result<Response<RB>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut resp = match this.inner.poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Ok(resp)) => resp,
            Poll::Ready(Err(never)) => match never {},
        };
        if let Some(h) = this.header.take() {
            resp.headers_mut().insert(NM_REQUEST_ID, h);
        }
        Poll::Ready(Ok(resp))
    }
}
