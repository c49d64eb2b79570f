//! The encoder against the exporter it replaced: opentelemetry-proto's conversion of the SDK's
//! spans, encoded by prost, must give the same bytes for the same spans.

use std::borrow::Cow;
use std::time::{Duration, UNIX_EPOCH};

use nm_dataplane::otel::span::SpanData;
use opentelemetry::trace::{
    Event, Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Array, InstrumentationScope, KeyValue, StringValue, Value};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
use prost::Message;

use super::Encoder;

/// A span, and the attributes its bytes hold.
#[derive(Clone)]
struct Spec(SpanData, Vec<KeyValue>);

impl Spec {
    fn new(mut span: SpanData, attributes: Vec<KeyValue>) -> Self {
        span.attributes.clear();
        for kv in &attributes {
            nm_dataplane::otel::proto::attribute(
                &mut span.attributes,
                nm_dataplane::otel::proto::SPAN_ATTRIBUTE,
                kv,
            );
        }
        span.attribute_count = attributes.len() as u32;
        Self(span, attributes)
    }

    fn push(&mut self, kv: KeyValue) {
        let mut attributes = std::mem::take(&mut self.1);
        attributes.push(kv);
        *self = Self::new(self.0.clone(), attributes);
    }
}

/// The SDK's span of the same content, in `scope`.
fn sdk(spec: &Spec, scope: &InstrumentationScope) -> opentelemetry_sdk::trace::SpanData {
    let span = &spec.0;
    let mut events = SpanEvents::default();
    events.events = span.events.clone();
    events.dropped_count = span.dropped_events;
    let mut links = SpanLinks::default();
    links.links = span.links.clone();
    links.dropped_count = span.dropped_links;
    opentelemetry_sdk::trace::SpanData {
        span_context: span.context.clone(),
        parent_span_id: span.parent_span_id,
        parent_span_is_remote: span.parent_is_remote,
        span_kind: span.kind.clone(),
        name: span.name.clone(),
        start_time: span.start,
        end_time: span.end,
        attributes: spec.1.clone(),
        dropped_attributes_count: span.dropped_attributes,
        events,
        links,
        status: span.status.clone(),
        instrumentation_scope: scope.clone(),
    }
}

fn the_exporters_bytes(
    spans: &[Spec],
    resource: &Resource,
    scope: &InstrumentationScope,
) -> Vec<u8> {
    let resource = ResourceAttributesWithSchema::from(resource);
    let spans = spans.iter().map(|s| sdk(s, scope)).collect();
    ExportTraceServiceRequest {
        resource_spans: group_spans_by_resource_and_scope(spans, &resource),
    }
    .encode_to_vec()
}

fn ours(spans: &[Spec], resource: &Resource, scope: &InstrumentationScope) -> Vec<u8> {
    let mut out = Vec::new();
    Encoder::new(resource, scope).encode(&spans_of(spans), &mut out);
    out
}

fn spans_of(specs: &[Spec]) -> Vec<SpanData> {
    specs.iter().map(|s| s.0.clone()).collect()
}

fn context(trace: u128, span: u64, flags: TraceFlags, remote: bool, state: &str) -> SpanContext {
    let state = if state.is_empty() {
        TraceState::default()
    } else {
        state.parse().unwrap_or_default()
    };
    SpanContext::new(
        TraceId::from(trace),
        SpanId::from(span),
        flags,
        remote,
        state,
    )
}

fn scope(name: &'static str) -> InstrumentationScope {
    InstrumentationScope::builder(name)
        .with_version("1.2.3")
        .with_schema_url("https://opentelemetry.io/schemas/1.37.0")
        .build()
}

/// A span with every kind of value, an event, a link and an error status.
fn rich(trace: u128, span: u64) -> Spec {
    let events = vec![
        Event::new(
            "exception",
            UNIX_EPOCH + Duration::from_nanos(1_500),
            vec![KeyValue::new("handled", false)],
            3,
        ),
        Event::new("empty", UNIX_EPOCH + Duration::from_nanos(1_600), vec![], 0),
    ];
    let links = vec![Link::new(
        context(7, 8, TraceFlags::SAMPLED, true, "vendor=link"),
        vec![KeyValue::new("link.attr", "linked")],
        5,
    )];
    let data = SpanData {
        context: context(
            trace,
            span,
            TraceFlags::SAMPLED,
            false,
            "vendor=span,other=x",
        ),
        parent_span_id: SpanId::from(0x8877_6655_4433_2211),
        parent_is_remote: true,
        kind: SpanKind::Client,
        name: Cow::Owned("chat gpt-4o-mini".to_owned()),
        start: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789),
        end: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_987_654_321),
        attributes: Vec::new(),
        attribute_count: 0,
        dropped_attributes: 2,
        events,
        dropped_events: 4,
        links,
        dropped_links: 6,
        status: Status::error("upstream said no"),
    };
    Spec::new(
        data,
        vec![
            KeyValue::new("str", "value"),
            KeyValue::new("empty", ""),
            KeyValue::new("owned", "x".repeat(300)),
            KeyValue::new("bool", true),
            KeyValue::new("false", false),
            KeyValue::new("int", 42_i64),
            KeyValue::new("zero", 0_i64),
            KeyValue::new("negative", -7_i64),
            KeyValue::new("float", 3.5_f64),
            KeyValue::new("float.zero", 0.0_f64),
            KeyValue::new(
                "strings",
                Value::Array(Array::String(vec![
                    StringValue::from("stop"),
                    StringValue::from(""),
                ])),
            ),
            KeyValue::new("bools", Value::Array(Array::Bool(vec![true, false]))),
            KeyValue::new("ints", Value::Array(Array::I64(vec![1, 0, -1]))),
            KeyValue::new("floats", Value::Array(Array::F64(vec![0.5]))),
            KeyValue::new("none", Value::Array(Array::I64(vec![]))),
        ],
    )
}

/// A root span as the gateway's are: no parent, no event, no link.
fn plain(trace: u128, span: u64, kind: SpanKind, status: Status) -> Spec {
    let data = SpanData {
        context: context(trace, span, TraceFlags::SAMPLED, false, ""),
        parent_span_id: SpanId::INVALID,
        parent_is_remote: false,
        kind,
        name: Cow::Borrowed("POST /openai/{*path}"),
        start: UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        end: UNIX_EPOCH + Duration::from_secs(1_700_000_001),
        attributes: Vec::new(),
        attribute_count: 0,
        dropped_attributes: 0,
        events: Vec::new(),
        dropped_events: 0,
        links: Vec::new(),
        dropped_links: 0,
        status,
    };
    Spec::new(data, vec![KeyValue::new("http.request.method", "POST")])
}

fn resource() -> Resource {
    Resource::builder_empty()
        .with_service_name("nm-gateway")
        .with_attributes([
            KeyValue::new("service.version", "0.1.0"),
            KeyValue::new("deployment.environment.name", "test"),
        ])
        .with_schema_url(
            [KeyValue::new("host.name", "h")],
            "https://opentelemetry.io/schemas/1.37.0",
        )
        .build()
}

#[test]
fn a_batch_encodes_to_the_exporters_bytes() {
    let (resource, scope) = (resource(), scope("nm-gateway"));
    let spans = vec![
        rich(1, 2),
        plain(3, 4, SpanKind::Server, Status::Unset),
        rich(5, 6),
        plain(7, 8, SpanKind::Internal, Status::Ok),
        plain(9, 10, SpanKind::Producer, Status::error("")),
        plain(11, 12, SpanKind::Consumer, Status::Unset),
        rich(13, 14),
    ];
    let ours = ours(&spans, &resource, &scope);
    assert_eq!(ours, the_exporters_bytes(&spans, &resource, &scope));
    // And it decodes to the spans, in their order, under the one scope.
    let decoded = ExportTraceServiceRequest::decode(ours.as_slice()).unwrap_or_default();
    let scopes = &decoded.resource_spans[0].scope_spans;
    assert_eq!(scopes.len(), 1);
    let ids: Vec<u8> = scopes[0].spans.iter().map(|s| s.span_id[7]).collect();
    assert_eq!(ids, [2, 4, 6, 8, 10, 12, 14]);
}

#[test]
fn a_scope_without_version_or_schema_encodes_to_the_exporters_bytes() {
    let resource = Resource::builder_empty().with_service_name("x").build();
    let scope = InstrumentationScope::builder("bare").build();
    let spans = vec![rich(1, 2)];
    assert_eq!(
        ours(&spans, &resource, &scope),
        the_exporters_bytes(&spans, &resource, &scope)
    );
}

#[test]
fn a_large_batch_and_a_long_value_encode_to_the_exporters_bytes() {
    // Lengths of two and three varint bytes, at every nesting level.
    let (resource, scope) = (resource(), scope("nm-gateway"));
    let mut big = plain(1, 2, SpanKind::Server, Status::Unset);
    big.push(KeyValue::new("gen_ai.input.messages", "é".repeat(20_000)));
    let mut spans = vec![big];
    spans.extend((0..600).map(|i| plain(i, i as u64 + 1, SpanKind::Client, Status::Unset)));
    assert_eq!(
        ours(&spans, &resource, &scope),
        the_exporters_bytes(&spans, &resource, &scope)
    );
}

#[test]
fn the_encoder_is_reused_across_batches() {
    let (resource, scope) = (resource(), scope("nm-gateway"));
    let mut encoder = Encoder::new(&resource, &scope);
    let mut out = Vec::new();
    let first = vec![rich(1, 2), rich(3, 4)];
    encoder.encode(&spans_of(&first), &mut out);
    let second = vec![plain(5, 6, SpanKind::Server, Status::Unset)];
    encoder.encode(&spans_of(&second), &mut out);
    assert_eq!(out, the_exporters_bytes(&second, &resource, &scope));
}

#[test]
fn a_wrong_guess_of_a_batchs_size_still_gives_the_exporters_bytes() {
    // A batch of large spans, then one of a small span: the guess (from the last batch's bytes
    // per span) is too large, then too small.
    let (resource, scope) = (resource(), scope("nm-gateway"));
    let mut encoder = Encoder::new(&resource, &scope);
    let mut out = Vec::new();
    let mut big = plain(1, 2, SpanKind::Server, Status::Unset);
    big.push(KeyValue::new("gen_ai.input.messages", "x".repeat(40_000)));
    for batch in [
        vec![big.clone(), big.clone()],
        vec![plain(3, 4, SpanKind::Client, Status::Unset)],
        vec![big.clone(), big],
    ] {
        encoder.encode(&spans_of(&batch), &mut out);
        assert_eq!(out, the_exporters_bytes(&batch, &resource, &scope));
    }
}

/// prost's bytes of opentelemetry-proto's `KeyValue` for `kv`, as a span's attribute.
fn prost_attribute(kv: &KeyValue) -> Vec<u8> {
    let pb = opentelemetry_proto::transform::common::tonic::Attributes::from([kv.clone()])
        .0
        .remove(0);
    let mut out = Vec::new();
    prost::encoding::message::encode(nm_dataplane::otel::proto::SPAN_ATTRIBUTE, &pb, &mut out);
    out
}

fn our_attribute(kv: &KeyValue) -> Vec<u8> {
    let mut out = vec![0xee];
    nm_dataplane::otel::proto::attribute(&mut out, nm_dataplane::otel::proto::SPAN_ATTRIBUTE, kv);
    out.split_off(1)
}

/// A string of `n` bytes, of one- and two-byte characters.
fn text(n: usize) -> String {
    let mut s = "é".repeat(n / 2);
    if n % 2 == 1 {
        s.push('x');
    }
    s
}

/// Every length where a varint grows, for the key and for a text value.
#[test]
fn an_attribute_encodes_to_prosts_bytes_at_every_length_class() {
    let lengths = [
        0, 1, 2, 100, 108, 109, 110, 111, 112, 113, 126, 127, 128, 129, 16_370, 16_371,
    ];
    let lengths = lengths
        .into_iter()
        .chain(16_372..16_390)
        .chain([20_000, 2_097_200]);
    for n in lengths {
        for key in [String::new(), "gen_ai.request.model".to_owned(), text(130)] {
            let kv = KeyValue::new(key.clone(), text(n));
            assert_eq!(
                our_attribute(&kv),
                prost_attribute(&kv),
                "key {} text {n}",
                key.len()
            );
        }
    }
}

proptest::proptest! {
    #[test]
    fn any_scalar_attribute_encodes_to_prosts_bytes(
        key in ".{0,40}",
        s in ".{0,300}",
        i in proptest::num::i64::ANY,
        f in proptest::num::f64::ANY,
        b in proptest::bool::ANY,
    ) {
        for kv in [
            KeyValue::new(key.clone(), s),
            KeyValue::new(key.clone(), i),
            KeyValue::new(key.clone(), f),
            KeyValue::new(key, b),
        ] {
            proptest::prop_assert_eq!(our_attribute(&kv), prost_attribute(&kv));
        }
    }
}
