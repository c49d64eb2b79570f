//! OTLP protobuf, written straight from the SDK's ended spans: an `ExportTraceServiceRequest`
//! (opentelemetry-proto's `collector/trace/v1`) encoded into one reused buffer, with no
//! intermediate message structs, no copied strings and no allocation per span.
//!
//! The bytes are the ones the OpenTelemetry exporter sent (its `SpanData` to proto conversion,
//! then prost): the same fields, in tag order as prost writes them, with proto3's rule that a scalar at its
//! default value is left out (a `oneof` member, a message that is present and an `AnyValue`
//! always written); a unit test compares the two on spans using every field. One
//! `ResourceSpans` per request, the process's resource; one `ScopeSpans` per instrumentation
//! scope, in the order of their first span; spans in their queue order.
//!
//! Why: converting a span to opentelemetry-proto's structs copied every key and value into new
//! `String`s and `Vec`s (and the exporter cloned the batch first), then prost walked the structs
//! computing each nested length again at every level. Here an attribute's length is computed
//! before it is written, and a larger message's is written in front of it once its content is,
//! in room reserved by a guess of its size (a wrong guess moves the content once).

use std::time::{SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{SpanId, SpanKind, Status};
use opentelemetry::{Array, InstrumentationScope, KeyValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SpanData;

/// The gRPC method spans are exported with.
pub const GRPC_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// `SpanFlags`: the parent's remoteness is known, and whether it is remote.
const CONTEXT_HAS_IS_REMOTE: u32 = 0x100;
const CONTEXT_IS_REMOTE: u32 = 0x200;

// Wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

/// Encodes export requests for one resource (the process's).
#[derive(Debug, Default)]
pub struct Encoder {
    /// The `Resource` message's content.
    resource: Vec<u8>,
    /// `ResourceSpans.schema_url`.
    resource_schema: String,
    /// Each span's scope group, reused between batches.
    groups: Vec<usize>,
    /// The last batch's encoded bytes per span.
    bytes_per_span: usize,
}

impl Encoder {
    /// An encoder whose requests carry `resource`.
    pub fn new(resource: &Resource) -> Self {
        let mut encoder = Self::default();
        encoder.set_resource(resource);
        encoder
    }

    pub fn set_resource(&mut self, resource: &Resource) {
        self.resource.clear();
        for (k, v) in resource.iter() {
            key_value(&mut self.resource, 1, k.as_str(), v);
        }
        self.resource_schema = resource.schema_url().unwrap_or_default().to_owned();
    }

    /// Writes the export request of `spans` into `out` (cleared first).
    pub fn encode(&mut self, spans: &[SpanData], out: &mut Vec<u8>) {
        out.clear();
        // The scopes in the order of their first span; each span's index among them.
        let mut scopes: Vec<&InstrumentationScope> = Vec::new();
        self.groups.clear();
        for span in spans {
            let scope = &span.instrumentation_scope;
            let group = match scopes.iter().position(|s| *s == scope) {
                Some(g) => g,
                None => {
                    scopes.push(scope);
                    scopes.len() - 1
                }
            };
            self.groups.push(group);
        }
        // The batch's two enclosing lengths are guessed from the last batch's bytes per span.
        let guess = varint_len((spans.len() * self.bytes_per_span) as u64);
        // ExportTraceServiceRequest.resource_spans
        nested_sized(out, 1, guess, |out| {
            // ResourceSpans.resource
            tag(out, 1, LEN);
            varint(out, self.resource.len() as u64);
            out.extend_from_slice(&self.resource);
            for (g, scope) in scopes.iter().enumerate() {
                // ResourceSpans.scope_spans
                nested_sized(out, 2, guess, |out| {
                    nested(out, 1, |out| instrumentation_scope(out, scope));
                    for (span, _) in spans.iter().zip(&self.groups).filter(|(_, i)| **i == g) {
                        nested_sized(out, 2, 2, |out| self::span(out, span));
                    }
                    string(out, 3, scope.schema_url().unwrap_or_default());
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
    let cx = &span.span_context;
    bytes(out, 1, &cx.trace_id().to_bytes());
    bytes(out, 2, &cx.span_id().to_bytes());
    string(out, 3, &cx.trace_state().header());
    if span.parent_span_id != SpanId::INVALID {
        bytes(out, 4, &span.parent_span_id.to_bytes());
    }
    string(out, 5, &span.name);
    uint(out, 6, kind(&span.span_kind));
    fixed64(out, 7, nanos(span.start_time));
    fixed64(out, 8, nanos(span.end_time));
    for kv in &span.attributes {
        attribute(out, 9, kv);
    }
    uint(out, 10, u64::from(span.dropped_attributes_count));
    for event in span.events.iter() {
        nested(out, 11, |out| {
            fixed64(out, 1, nanos(event.timestamp));
            string(out, 2, &event.name);
            for kv in &event.attributes {
                attribute(out, 3, kv);
            }
            uint(out, 4, u64::from(event.dropped_attributes_count));
        });
    }
    uint(out, 12, u64::from(span.events.dropped_count));
    for link in span.links.iter() {
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
    uint(out, 14, u64::from(span.links.dropped_count));
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
        flags(span.parent_span_is_remote, cx.trace_flags().to_u8()),
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

/// A `KeyValue` message as field `field`.
fn attribute(out: &mut Vec<u8>, field: u32, kv: &KeyValue) {
    key_value(out, field, kv.key.as_str(), &kv.value);
}

fn key_value(out: &mut Vec<u8>, field: u32, key: &str, value: &Value) {
    // The common values' lengths are known up front: written in one pass, no length patched.
    let scalar: Option<(u32, u32, &[u8], u64)> = match value {
        Value::String(s) => Some((1, LEN, s.as_str().as_bytes(), 0)),
        Value::Bool(b) => Some((2, VARINT, b"".as_slice(), u64::from(*b))),
        Value::I64(i) => Some((3, VARINT, b"".as_slice(), *i as u64)),
        Value::F64(f) => Some((4, FIXED64, b"".as_slice(), f.to_bits())),
        _ => None,
    };
    let Some((member, wire, text, number)) = scalar else {
        nested(out, field, |out| {
            string(out, 1, key);
            // KeyValue.value: always present.
            nested(out, 2, |out| any_value(out, value));
        });
        return;
    };
    // AnyValue: its one member (tags 1 to 4 are one byte).
    let any = 1 + match wire {
        LEN => varint_len(text.len() as u64) + text.len(),
        VARINT => varint_len(number),
        _ => 8,
    };
    let key_field = if key.is_empty() {
        0
    } else {
        1 + varint_len(key.len() as u64) + key.len()
    };
    let kv = key_field + 1 + varint_len(any as u64) + any;
    out.reserve(5 + varint_len(kv as u64) + kv);
    tag(out, field, LEN);
    varint(out, kv as u64);
    string(out, 1, key);
    tag(out, 2, LEN);
    varint(out, any as u64);
    tag(out, member, wire);
    match wire {
        LEN => {
            varint(out, text.len() as u64);
            out.extend_from_slice(text);
        }
        VARINT => varint(out, number),
        _ => out.extend_from_slice(&number.to_le_bytes()),
    }
}

/// An `AnyValue`'s content: its `oneof` member, written whatever its value.
fn any_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::String(s) => {
            tag(out, 1, LEN);
            varint(out, s.as_str().len() as u64);
            out.extend_from_slice(s.as_str().as_bytes());
        }
        Value::Bool(b) => {
            tag(out, 2, VARINT);
            varint(out, u64::from(*b));
        }
        Value::I64(i) => {
            tag(out, 3, VARINT);
            varint(out, *i as u64);
        }
        Value::F64(f) => {
            tag(out, 4, FIXED64);
            out.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::Array(array) => nested(out, 5, |out| array_value(out, array)),
        // `Value` is non-exhaustive: a kind this encoder does not know goes as an empty
        // `AnyValue` (the exporter it replaces could not have sent one either).
        _ => {}
    }
}

/// An `ArrayValue`'s content.
fn array_value(out: &mut Vec<u8>, array: &Array) {
    fn each<T>(out: &mut Vec<u8>, items: &[T], one: impl Fn(&T) -> Value) {
        for item in items {
            nested(out, 1, |out| any_value(out, &one(item)));
        }
    }
    match array {
        Array::Bool(v) => each(out, v, |b| Value::Bool(*b)),
        Array::I64(v) => each(out, v, |i| Value::I64(*i)),
        Array::F64(v) => each(out, v, |f| Value::F64(*f)),
        Array::String(v) => {
            for s in v {
                nested(out, 1, |out| {
                    tag(out, 1, LEN);
                    varint(out, s.as_str().len() as u64);
                    out.extend_from_slice(s.as_str().as_bytes());
                });
            }
        }
        _ => {}
    }
}

// === the wire ===

fn tag(out: &mut Vec<u8>, field: u32, wire: u32) {
    varint(out, u64::from((field << 3) | wire));
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A varint's bytes, for a length known only after its content.
fn varint_bytes(mut v: u64) -> ([u8; 10], usize) {
    let mut bytes = [0u8; 10];
    let mut n = 0;
    while v >= 0x80 {
        bytes[n] = (v as u8) | 0x80;
        v >>= 7;
        n += 1;
    }
    bytes[n] = v as u8;
    (bytes, n + 1)
}

/// A length-delimited field whose content `write` appends; its length is put in front once
/// known, in one reserved byte (widened when the content is 128 bytes or more).
fn nested(out: &mut Vec<u8>, field: u32, write: impl FnOnce(&mut Vec<u8>)) {
    nested_sized(out, field, 1, write);
}

/// [`nested`] with `guess` bytes reserved for the length: a guess that fits the content's
/// length class (2 for a span, more for a batch) leaves the content where it was written,
/// rather than moving all of it to make room.
fn nested_sized(out: &mut Vec<u8>, field: u32, guess: usize, write: impl FnOnce(&mut Vec<u8>)) {
    tag(out, field, LEN);
    let at = out.len();
    out.resize(at + guess, 0);
    write(out);
    let end = out.len();
    let len = end - at - guess;
    let (bytes, n) = varint_bytes(len as u64);
    if n != guess {
        // Move the content to fit the length's bytes.
        if n > guess {
            out.resize(end + n - guess, 0);
        }
        out.copy_within(at + guess..end, at + n);
        out.truncate(at + n + len);
    }
    out[at..at + n].copy_from_slice(&bytes[..n]);
}

/// How many bytes `v` takes as a varint.
fn varint_len(v: u64) -> usize {
    // 1 byte per 7 bits, at least 1.
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// A string field, left out when empty.
fn string(out: &mut Vec<u8>, field: u32, s: &str) {
    bytes(out, field, s.as_bytes());
}

/// A bytes field, left out when empty.
fn bytes(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    if !b.is_empty() {
        tag(out, field, LEN);
        varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }
}

/// A varint field (`uint32`, an enum), left out when 0.
fn uint(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        tag(out, field, VARINT);
        varint(out, v);
    }
}

fn fixed32(out: &mut Vec<u8>, field: u32, v: u32) {
    if v != 0 {
        tag(out, field, FIXED32);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

fn fixed64(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        tag(out, field, FIXED64);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

#[cfg(test)]
#[path = "otlp_tests.rs"]
mod tests;
