//! Response bodies. [`GatewayBody`] is either a small body the gateway made (errors, health) or
//! an upstream body passed through frame by frame ([`ObservedBody`]).
//!
//! `ObservedBody` never buffers or alters a frame: it forwards each one as it is polled (so
//! backpressure reaches the upstream), counts bytes, notes the first byte's time, shows the
//! frame to the usage [`Meter`] (which reads it in place), and when the body ends — completely,
//! with an upstream error, or because the client went away and hyper dropped it — it completes
//! the request record (usage, cost, the budget's settlement) and closes the request's span.
//! Dropping it also drops the upstream body, which closes the upstream stream: a client that
//! disconnects cancels the upstream request.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use pin_project_lite::pin_project;
use tracing::Span;

use crate::budget::Reservation;
use crate::pricing::{Cost, PriceTable};
use crate::records::{RecordSink, RequestRecord, UsageStatus};
use crate::usage::Meter;

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
    pub prices: std::sync::Arc<PriceTable>,
    /// The end user's budget hold, settled when the body ends.
    pub reservation: Option<Reservation>,
}

impl Completion {
    fn finish(
        mut self,
        ending: Ending,
        first_byte: Option<Instant>,
        bytes: u64,
        meter: Option<Meter>,
    ) {
        let r = &mut self.record;
        r.latency = self.started.elapsed();
        r.ttfb = first_byte.map(|t| t.duration_since(self.started));
        r.response_bytes = bytes;
        r.error_code = match ending {
            Ending::Complete => r.error_code,
            Ending::UpstreamError => Some("upstream_body_error"),
            Ending::ClientGone => Some("client_disconnected"),
        };
        r.usage = meter.map(Meter::finish).unwrap_or_default();
        r.usage_status = match (ending, r.usage.is_known()) {
            (_, false) => UsageStatus::Missing,
            (Ending::Complete, true) => UsageStatus::Reported,
            (_, true) => UsageStatus::Partial,
        };
        let model = r.usage.model.as_deref().or(r.model.as_deref());
        r.cost_micros = match self.prices.cost(&r.provider, model, &r.usage) {
            Cost::Known { micros } => Some(micros),
            Cost::UnknownModel | Cost::UnknownUsage => None,
        };
        if let Some(hold) = self.reservation.take() {
            // Unknown is not free: a successful answer without usage counts its reservation.
            let charge = r.cost_micros.unwrap_or(if (200..300).contains(&r.status) {
                hold.reserved_micros()
            } else {
                0
            });
            hold.settle(charge);
            r.budget_micros = Some(charge);
        }
        if let Some(m) = &r.usage.model {
            self.span.record("gen_ai.response.model", m.as_str());
        }
        if let Some(t) = r.usage.input_tokens {
            self.span.record("gen_ai.usage.input_tokens", t);
        }
        if let Some(t) = r.usage.output_tokens {
            self.span.record("gen_ai.usage.output_tokens", t);
        }
        if let Some(c) = r.cost_micros {
            self.span.record("nm.cost_micros", c);
        }
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
        meter: Option<Meter>,
        first_byte: Option<Instant>,
        bytes: u64,
    }

    impl PinnedDrop for ObservedBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(c) = this.completion.take() {
                let ending = if this.inner.is_end_stream() { Ending::Complete } else { Ending::ClientGone };
                c.finish(ending, *this.first_byte, *this.bytes, this.meter.take());
            }
        }
    }
}

impl ObservedBody {
    /// `meter` reads usage from the frames; None when the answer cannot carry any we understand.
    pub fn new(inner: Incoming, completion: Completion, meter: Option<Meter>) -> Self {
        Self {
            inner,
            completion: Some(completion),
            meter,
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
                    if let Some(m) = this.meter.as_mut() {
                        m.feed(data);
                    }
                }
                this.inner.is_end_stream().then_some(Ending::Complete)
            }
            Poll::Ready(Some(Err(_))) => Some(Ending::UpstreamError),
            Poll::Ready(None) => Some(Ending::Complete),
        };
        if let Some(ending) = ending
            && let Some(c) = this.completion.take()
        {
            c.finish(ending, *this.first_byte, *this.bytes, this.meter.take());
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
