//! Spans of the record shipper's batches: a CLIENT span for each batch that carries traced
//! records, linked to their requests' spans (a batch serves many requests, so it is a trace of
//! its own). Untraced batches get no span. The adapter continues the span's context: over gRPC
//! in the call's metadata, in `serve` into the controlplane's database spans.

use std::sync::Arc;

use opentelemetry::global::BoxedTracer;
use opentelemetry::trace::{
    Link, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
};
use opentelemetry::{Context, KeyValue};

/// The tracer of the link's batch spans (tracing on).
#[derive(Clone)]
pub struct BatchSpans(Arc<BoxedTracer>);

impl std::fmt::Debug for BatchSpans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BatchSpans")
    }
}

impl BatchSpans {
    pub fn new(tracer: Arc<BoxedTracer>) -> Self {
        Self(tracer)
    }

    /// The CLIENT span of a batch call `method` carrying `records` records, linked to the
    /// spans of the traced ones; None when none is traced (an untraced batch is not worth a
    /// span).
    pub fn batch(
        &self,
        method: &'static str,
        records: usize,
        traced: impl Iterator<Item = nm_types::record::TraceRef>,
    ) -> Option<Context> {
        let links: Vec<Link> = traced
            .map(|t| {
                Link::with_context(SpanContext::new(
                    TraceId::from_bytes(t.trace_id),
                    SpanId::from_bytes(t.span_id),
                    TraceFlags::SAMPLED,
                    true,
                    TraceState::default(),
                ))
            })
            .collect();
        if links.is_empty() {
            return None;
        }
        let span = self
            .0
            .span_builder(format!("nm.link.v1.Link/{method}"))
            .with_kind(SpanKind::Client)
            .with_attributes([
                KeyValue::new("rpc.system", "grpc"),
                KeyValue::new("rpc.service", "nm.link.v1.Link"),
                KeyValue::new("rpc.method", method),
                KeyValue::new("nm.records", i64::try_from(records).unwrap_or(i64::MAX)),
            ])
            .with_links(links)
            .start_with_context(self.0.as_ref(), &Context::new());
        Some(Context::new().with_span(span))
    }
}
