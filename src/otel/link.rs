//! Trace context across the link between the halves: the dataplane's calls carry the current
//! OpenTelemetry context in gRPC metadata (W3C `traceparent`, whatever `OTEL_PROPAGATORS` says:
//! the link is ours), and the controlplane continues it with a SERVER span whose context carries
//! its tracer ([`SpanSource`]) down to the database spans.

use std::sync::Arc;

use nm_controlplane::otel::SpanSource;
use opentelemetry::Context;
use opentelemetry::KeyValue;
use opentelemetry::global::BoxedTracer;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanKind, TraceContextExt, Tracer};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};

/// Writes the current context into a call's metadata (nothing when no span is active).
pub fn inject(metadata: &mut MetadataMap) {
    let cx = Context::current();
    if cx.has_active_span() {
        TraceContextPropagator::new().inject_context(&cx, &mut MetadataInjector(metadata));
    }
}

/// The controlplane's side: a tracer for the link's calls.
#[derive(Clone)]
pub struct LinkTracing(Arc<BoxedTracer>);

impl std::fmt::Debug for LinkTracing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LinkTracing")
    }
}

impl LinkTracing {
    pub fn new(tracer: BoxedTracer) -> Self {
        Self(Arc::new(tracer))
    }

    /// The SERVER span of a link call `method`, continuing the caller's context from
    /// `metadata`; its context carries the tracer for the database spans below.
    pub fn server(&self, metadata: &MetadataMap, method: &'static str) -> Context {
        let parent = TraceContextPropagator::new().extract(&MetadataExtractor(metadata));
        let span = self
            .0
            .span_builder(format!("nm.link.v1.Link/{method}"))
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("rpc.system", "grpc"),
                KeyValue::new("rpc.service", "nm.link.v1.Link"),
                KeyValue::new("rpc.method", method),
            ])
            .start_with_context(self.0.as_ref(), &parent);
        parent
            .with_span(span)
            .with_value(SpanSource(self.0.clone()))
    }

    /// The dataplane's spans of the record batches it ships, from the same tracer.
    pub fn batches(&self) -> nm_dataplane::link::BatchSpans {
        nm_dataplane::link::BatchSpans::new(self.0.clone())
    }

    /// What the context of a call made in process (`serve`) needs for the database spans.
    pub fn source(&self) -> SpanSource {
        SpanSource(self.0.clone())
    }
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}
