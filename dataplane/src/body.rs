//! Response bodies. [`GatewayBody`] is either a small body the gateway made (errors, health) or
//! an upstream body passed through frame by frame ([`ObservedBody`]).
//!
//! `ObservedBody` never buffers or alters a frame: it forwards each one as it is polled (so
//! backpressure reaches the upstream), counts bytes, notes the first byte's time, and when the
//! body ends — completely, with an upstream error, or because the client went away and hyper
//! dropped it — it completes the request record and closes the request's span. Dropping it also
//! drops the upstream body, which closes the upstream stream: a client that disconnects cancels
//! the upstream request.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use pin_project_lite::pin_project;
use tracing::Span;

use crate::records::{RecordSink, RequestRecord};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// The body of every dataplane response.
    #[project = GatewayBodyProj]
    pub enum GatewayBody {
        Full { #[pin] inner: Full<Bytes> },
        Upstream { #[pin] inner: ObservedBody },
    }
}

impl GatewayBody {
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        GatewayBody::Full {
            inner: Full::new(bytes.into()),
        }
    }

    pub fn empty() -> Self {
        Self::full(Bytes::new())
    }
}

impl Body for GatewayBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project() {
            GatewayBodyProj::Full { inner } => inner.poll_frame(cx).map_err(|never| match never {}),
            GatewayBodyProj::Upstream { inner } => inner.poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            GatewayBody::Full { inner } => inner.is_end_stream(),
            GatewayBody::Upstream { inner } => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            GatewayBody::Full { inner } => inner.size_hint(),
            GatewayBody::Upstream { inner } => inner.size_hint(),
        }
    }
}

/// How a proxied body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Complete,
    UpstreamError,
    ClientGone,
}

/// What is needed to complete a request record once the body ends.
#[derive(Debug)]
pub struct Completion {
    pub record: RequestRecord,
    pub started: Instant,
    pub sink: RecordSink,
    pub span: Span,
}

impl Completion {
    fn finish(mut self, ending: Ending, first_byte: Option<Instant>, bytes: u64) {
        let r = &mut self.record;
        r.latency = self.started.elapsed();
        r.ttfb = first_byte.map(|t| t.duration_since(self.started));
        r.response_bytes = bytes;
        r.error_code = match ending {
            Ending::Complete => r.error_code,
            Ending::UpstreamError => Some("upstream_body_error"),
            Ending::ClientGone => Some("client_disconnected"),
        };
        let latency_ms = u64::try_from(r.latency.as_millis()).unwrap_or(u64::MAX);
        self.span.record("nm.latency_ms", latency_ms);
        self.span.in_scope(|| {
            tracing::info!(
                http.response.status_code = r.status,
                latency_ms,
                bytes,
                ending = ?ending,
                "request completed"
            );
        });
        self.sink.send(self.record);
    }
}

pin_project! {
    /// An upstream body passed through untouched while its progress is observed.
    pub struct ObservedBody {
        #[pin]
        inner: Incoming,
        completion: Option<Completion>,
        first_byte: Option<Instant>,
        bytes: u64,
    }

    impl PinnedDrop for ObservedBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(c) = this.completion.take() {
                let ending = if this.inner.is_end_stream() { Ending::Complete } else { Ending::ClientGone };
                c.finish(ending, *this.first_byte, *this.bytes);
            }
        }
    }
}

impl ObservedBody {
    pub fn new(inner: Incoming, completion: Completion) -> Self {
        Self {
            inner,
            completion: Some(completion),
            first_byte: None,
            bytes: 0,
        }
    }
}

impl Body for ObservedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_frame(cx);
        let ending = match &polled {
            Poll::Pending => return polled,
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if this.first_byte.is_none() && !data.is_empty() {
                        *this.first_byte = Some(Instant::now());
                    }
                    *this.bytes += data.len() as u64;
                }
                this.inner.is_end_stream().then_some(Ending::Complete)
            }
            Poll::Ready(Some(Err(_))) => Some(Ending::UpstreamError),
            Poll::Ready(None) => Some(Ending::Complete),
        };
        if let Some(ending) = ending
            && let Some(c) = this.completion.take()
        {
            c.finish(ending, *this.first_byte, *this.bytes);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
