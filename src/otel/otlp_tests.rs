//! The encoder against the exporter it replaced: opentelemetry-proto's conversion of the SDK's
//! spans, encoded by prost, must give the same bytes.

use std::borrow::Cow;
use std::time::{Duration, UNIX_EPOCH};

use opentelemetry::trace::{
    Event, Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Array, InstrumentationScope, KeyValue, StringValue, Value};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};
use prost::Message;

use super::Encoder;

fn the_exporters_bytes(spans: &[SpanData], resource: &Resource) -> Vec<u8> {
    let resource = ResourceAttributesWithSchema::from(resource);
    ExportTraceServiceRequest {
        resource_spans: group_spans_by_resource_and_scope(spans.to_vec(), &resource),
    }
    .encode_to_vec()
}

fn ours(spans: &[SpanData], resource: &Resource) -> Vec<u8> {
    let mut out = Vec::new();
    Encoder::new(resource).encode(spans, &mut out);
    out
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
fn rich(trace: u128, span: u64, scope: InstrumentationScope) -> SpanData {
    let mut events = SpanEvents::default();
    events.events = vec![
        Event::new(
            "exception",
            UNIX_EPOCH + Duration::from_nanos(1_500),
            vec![KeyValue::new("handled", false)],
            3,
        ),
        Event::new("empty", UNIX_EPOCH + Duration::from_nanos(1_600), vec![], 0),
    ];
    events.dropped_count = 4;
    let mut links = SpanLinks::default();
    links.links = vec![Link::new(
        context(7, 8, TraceFlags::SAMPLED, true, "vendor=link"),
        vec![KeyValue::new("link.attr", "linked")],
        5,
    )];
    links.dropped_count = 6;
    SpanData {
        span_context: context(
            trace,
            span,
            TraceFlags::SAMPLED,
            false,
            "vendor=span,other=x",
        ),
        parent_span_id: SpanId::from(0x8877_6655_4433_2211),
        parent_span_is_remote: true,
        span_kind: SpanKind::Client,
        name: Cow::Owned("chat gpt-4o-mini".to_owned()),
        start_time: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789),
        end_time: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_987_654_321),
        attributes: vec![
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
        dropped_attributes_count: 2,
        events,
        links,
        status: Status::error("upstream said no"),
        instrumentation_scope: scope,
    }
}

/// A root span as the gateway's are: no parent, no event, no link.
fn plain(trace: u128, span: u64, kind: SpanKind, status: Status) -> SpanData {
    SpanData {
        span_context: context(trace, span, TraceFlags::SAMPLED, false, ""),
        parent_span_id: SpanId::INVALID,
        parent_span_is_remote: false,
        span_kind: kind,
        name: Cow::Borrowed("POST /openai/{*path}"),
        start_time: UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        end_time: UNIX_EPOCH + Duration::from_secs(1_700_000_001),
        attributes: vec![KeyValue::new("http.request.method", "POST")],
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status,
        instrumentation_scope: InstrumentationScope::builder("nm-gateway").build(),
    }
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
    let resource = resource();
    let spans = vec![
        rich(1, 2, scope("nm-gateway")),
        plain(3, 4, SpanKind::Server, Status::Unset),
        rich(5, 6, scope("other")),
        plain(7, 8, SpanKind::Internal, Status::Ok),
        plain(9, 10, SpanKind::Producer, Status::error("")),
        plain(11, 12, SpanKind::Consumer, Status::Unset),
        rich(13, 14, scope("nm-gateway")),
    ];
    let ours = ours(&spans, &resource);
    assert_eq!(ours, the_exporters_bytes(&spans, &resource));
    // And it decodes to the spans, grouped by scope in the order of their first span.
    let decoded = ExportTraceServiceRequest::decode(ours.as_slice()).unwrap_or_default();
    let scopes: Vec<(&str, usize)> = decoded.resource_spans[0]
        .scope_spans
        .iter()
        .map(|s| {
            (
                s.scope.as_ref().map_or("", |s| s.name.as_str()),
                s.spans.len(),
            )
        })
        .collect();
    assert_eq!(scopes, [("nm-gateway", 2), ("nm-gateway", 4), ("other", 1)]);
}

#[test]
fn a_large_batch_and_a_long_value_encode_to_the_exporters_bytes() {
    // Lengths of two and three varint bytes, at every nesting level.
    let resource = resource();
    let mut big = plain(1, 2, SpanKind::Server, Status::Unset);
    big.attributes
        .push(KeyValue::new("gen_ai.input.messages", "é".repeat(20_000)));
    let mut spans = vec![big];
    spans.extend((0..600).map(|i| plain(i, i as u64 + 1, SpanKind::Client, Status::Unset)));
    assert_eq!(
        ours(&spans, &resource),
        the_exporters_bytes(&spans, &resource)
    );
}

#[test]
fn the_encoder_is_reused_across_batches() {
    let resource = resource();
    let mut encoder = Encoder::new(&resource);
    let mut out = Vec::new();
    let first = vec![rich(1, 2, scope("a")), rich(3, 4, scope("b"))];
    encoder.encode(&first, &mut out);
    let second = vec![plain(5, 6, SpanKind::Server, Status::Unset)];
    encoder.encode(&second, &mut out);
    assert_eq!(out, the_exporters_bytes(&second, &resource));
    let other = Resource::builder_empty().with_service_name("x").build();
    encoder.set_resource(&other);
    encoder.encode(&second, &mut out);
    assert_eq!(out, the_exporters_bytes(&second, &other));
}

#[test]
fn varint_lengths_are_the_bytes_written() {
    for v in [
        0,
        1,
        127,
        128,
        16_383,
        16_384,
        u64::from(u32::MAX),
        u64::MAX,
    ] {
        let mut out = Vec::new();
        super::varint(&mut out, v);
        assert_eq!(super::varint_len(v), out.len(), "{v}");
    }
}

#[test]
fn a_wrong_guess_of_a_batchs_size_still_gives_the_exporters_bytes() {
    // A batch of large spans, then one of a small span: the guess (from the last batch's bytes
    // per span) is too large, then too small.
    let resource = resource();
    let mut encoder = Encoder::new(&resource);
    let mut out = Vec::new();
    let mut big = plain(1, 2, SpanKind::Server, Status::Unset);
    big.attributes
        .push(KeyValue::new("gen_ai.input.messages", "x".repeat(40_000)));
    for batch in [
        vec![big.clone(), big.clone()],
        vec![plain(3, 4, SpanKind::Client, Status::Unset)],
        vec![big.clone(), big],
    ] {
        encoder.encode(&batch, &mut out);
        assert_eq!(out, the_exporters_bytes(&batch, &resource));
    }
}
