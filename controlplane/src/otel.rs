//! Database spans (OpenTelemetry) for the writes a traced request or signal causes.
//!
//! The controlplane holds no tracer of its own: the caller's OpenTelemetry [`Context`] carries
//! one ([`SpanSource`]) next to the span to continue — the dataplane's in `serve`, the gRPC
//! link's server span in a split controlplane. Without one (tracing off, or an untraced call
//! such as an admin command) [`db_span`] does nothing.

use std::sync::Arc;

use opentelemetry::global::BoxedTracer;
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};

/// The tracer a context carries for the spans made below it.
#[derive(Clone)]
pub struct SpanSource(pub Arc<BoxedTracer>);

impl std::fmt::Debug for SpanSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SpanSource")
    }
}

/// A CLIENT span for one database operation, ended when dropped.
#[derive(Debug)]
pub struct DbSpan(Option<Context>);

/// Opens a database span under the current context, when it carries a tracer. `system` is
/// `db.system.name` (`sqlite`, `postgresql`); the span is named `{operation} {collection}`.
pub fn db_span(system: &'static str, operation: &'static str, collection: &'static str) -> DbSpan {
    let cx = Context::current();
    let Some(source) = cx.get::<SpanSource>() else {
        return DbSpan(None);
    };
    if !cx.has_active_span() {
        return DbSpan(None);
    }
    let tracer = &source.0;
    let span = tracer
        .span_builder(format!("{operation} {collection}"))
        .with_kind(SpanKind::Client)
        .with_attributes([
            KeyValue::new("db.system.name", system),
            KeyValue::new("db.operation.name", operation),
            KeyValue::new("db.collection.name", collection),
        ])
        .start_with_context(tracer.as_ref(), &cx);
    DbSpan(Some(cx.with_span(span)))
}

impl DbSpan {
    /// Marks the operation failed (`error.type` is the error's class, never its text).
    pub fn failed(&self, error_type: &'static str) {
        if let Some(cx) = &self.0 {
            let span = cx.span();
            span.set_attribute(KeyValue::new("error.type", error_type));
            span.set_status(Status::error(""));
        }
    }
}

impl Drop for DbSpan {
    fn drop(&mut self) {
        if let Some(cx) = self.0.take() {
            cx.span().end();
        }
    }
}
