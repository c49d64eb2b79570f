//! OTLP protobuf, written straight from the gateway's ended spans
//! (`nm_dataplane::otel::span::SpanData`): an `ExportTraceServiceRequest`
//! (opentelemetry-proto's `collector/trace/v1`) encoded into one reused buffer, with no
//! intermediate message structs, no copied strings and no allocation per span.
//!
//! The bytes are the ones the OpenTelemetry exporter sent for the SDK's spans (its `SpanData` to
//! proto conversion, then prost): the same fields, in tag order as prost writes them, with
//! proto3's rule that a scalar at its default value is left out (a `oneof` member, a message that
//! is present and an `AnyValue` always written); a unit test compares the two on spans using
//! every field. One `ResourceSpans` per request, the process's resource; one `ScopeSpans`, the
//! gateway's one instrumentation scope; spans in their queue order.
//!
//! Why: converting a span to opentelemetry-proto's structs copied every key and value into new
//! `String`s and `Vec`s (and the exporter cloned the batch first), then prost walked the structs
//! computing each nested length again at every level. Here an attribute's length is computed
//! before it is written, and a larger message's is written in front of it once its content is,
//! in room reserved by a guess of its size (a wrong guess moves the content once).

use std::time::{SystemTime, UNIX_EPOCH};

use nm_dataplane::otel::proto::{
    LEN, attribute, bytes, fixed32, fixed64, key_value, nested, nested_sized, string, tag, uint,
    varint, varint_len,
};
use nm_dataplane::otel::span::SpanData;
use opentelemetry::InstrumentationScope;
use opentelemetry::trace::{SpanId, SpanKind, Status};
use opentelemetry_sdk::Resource;

/// The gRPC method spans are exported with.
pub const GRPC_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// `SpanFlags`: the parent's remoteness is known, and whether it is remote.
const CONTEXT_HAS_IS_REMOTE: u32 = 0x100;
const CONTEXT_IS_REMOTE: u32 = 0x200;

/// Encodes export requests for one resource (the process's) and one instrumentation scope.
#[derive(Debug, Default)]
pub struct Encoder {
    /// The `Resource` message's content.
    resource: Vec<u8>,
    /// `ResourceSpans.schema_url`.
    resource_schema: String,
    /// The `InstrumentationScope` message's content.
    scope: Vec<u8>,
    /// `ScopeSpans.schema_url`.
    scope_schema: String,
    /// The last batch's encoded bytes per span.
    bytes_per_span: usize,
}

impl Encoder {
    /// An encoder whose requests carry `resource`, and `scope` as every span's.
    pub fn new(resource: &Resource, scope: &InstrumentationScope) -> Self {
        let mut encoder = Self::default();
        for (k, v) in resource.iter() {
            key_value(&mut encoder.resource, 1, k.as_str(), v);
        }
        encoder.resource_schema = resource.schema_url().unwrap_or_default().to_owned();
        instrumentation_scope(&mut encoder.scope, scope);
        encoder.scope_schema = scope.schema_url().unwrap_or_default().to_owned();
        encoder
    }

    /// Writes the export request of `spans` into `out` (cleared first).
    pub fn encode(&mut self, spans: &[SpanData], out: &mut Vec<u8>) {
        out.clear();
        // The batch's two enclosing lengths are guessed from the last batch's bytes per span.
        let guess = varint_len((spans.len() * self.bytes_per_span) as u64);
        // ExportTraceServiceRequest.resource_spans
        nested_sized(out, 1, guess, |out| {
            // ResourceSpans.resource
            tag(out, 1, LEN);
            varint(out, self.resource.len() as u64);
            out.extend_from_slice(&self.resource);
            if !spans.is_empty() {
                // ResourceSpans.scope_spans
                nested_sized(out, 2, guess, |out| {
                    tag(out, 1, LEN);
                    varint(out, self.scope.len() as u64);
                    out.extend_from_slice(&self.scope);
                    for span in spans {
                        nested_sized(out, 2, 2, |out| self::span(out, span));
                    }
                    string(out, 3, &self.scope_schema);
                });
            }
            string(out, 3, &self.resource_schema);
        });
        if let Some(per_span) = out.len().checked_div(spans.len()) {
            self.bytes_per_span = per_span.max(1);
        }
    }
}

fn instrumentation_scope(out: &mut Vec<u8>, scope: &InstrumentationScope) {
    string(out, 1, scope.name());
    string(out, 2, scope.version().unwrap_or_default());
    for kv in scope.attributes() {
        attribute(out, 3, kv);
    }
}

fn span(out: &mut Vec<u8>, span: &SpanData) {
    let cx = &span.context;
    bytes(out, 1, &cx.trace_id().to_bytes());
    bytes(out, 2, &cx.span_id().to_bytes());
    string(out, 3, &cx.trace_state().header());
    if span.parent_span_id != SpanId::INVALID {
        bytes(out, 4, &span.parent_span_id.to_bytes());
    }
    string(out, 5, &span.name);
    uint(out, 6, kind(&span.kind));
    fixed64(out, 7, nanos(span.start));
    fixed64(out, 8, nanos(span.end));
    // Span.attributes: encoded as they were set.
    out.extend_from_slice(&span.attributes);
    uint(out, 10, u64::from(span.dropped_attributes));
    for event in &span.events {
        nested(out, 11, |out| {
            fixed64(out, 1, nanos(event.timestamp));
            string(out, 2, &event.name);
            for kv in &event.attributes {
                attribute(out, 3, kv);
            }
            uint(out, 4, u64::from(event.dropped_attributes_count));
        });
    }
    uint(out, 12, u64::from(span.dropped_events));
    for link in &span.links {
        nested(out, 13, |out| {
            let cx = &link.span_context;
            bytes(out, 1, &cx.trace_id().to_bytes());
            bytes(out, 2, &cx.span_id().to_bytes());
            string(out, 3, &cx.trace_state().header());
            for kv in &link.attributes {
                attribute(out, 4, kv);
            }
            uint(out, 5, u64::from(link.dropped_attributes_count));
            fixed32(out, 6, flags(cx.is_remote(), cx.trace_flags().to_u8()));
        });
    }
    uint(out, 14, u64::from(span.dropped_links));
    // Span.status: always present.
    nested(out, 15, |out| match &span.status {
        Status::Unset => {}
        Status::Ok => uint(out, 3, 1),
        Status::Error { description } => {
            string(out, 2, description);
            uint(out, 3, 2);
        }
    });
    fixed32(
        out,
        16,
        flags(span.parent_is_remote, cx.trace_flags().to_u8()),
    );
}

/// `Span.flags` and `Link.flags`: the W3C trace flags and the parent's remoteness.
fn flags(remote: bool, trace_flags: u8) -> u32 {
    let flags = u32::from(trace_flags) | CONTEXT_HAS_IS_REMOTE;
    if remote {
        flags | CONTEXT_IS_REMOTE
    } else {
        flags
    }
}

/// `Span.SpanKind`.
fn kind(kind: &SpanKind) -> u64 {
    match kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

/// Nanoseconds since the epoch; a time before it is 0.
fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
#[path = "otlp_tests.rs"]
mod tests;
