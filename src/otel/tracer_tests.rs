//! The gateway's tracer (`nm_dataplane::otel::span`) against the OpenTelemetry SDK it replaced:
//! the same sampling decisions, flags, trace state, parents, limits and ending, and the same
//! reading of a client's `traceparent`.

use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, UNIX_EPOCH};

use nm_dataplane::otel::span::{self, Backlog, SpanData, SpanQueue, Tracer};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    Link, Span as _, SpanBuilder, SpanContext, SpanId, SpanKind, Status, TraceContextExt,
    TraceFlags, TraceId, TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanProcessor};

/// Attributes as a span's bytes hold them.
fn encoded(attributes: &[KeyValue]) -> Vec<u8> {
    let mut out = Vec::new();
    for kv in attributes {
        nm_dataplane::otel::proto::attribute(
            &mut out,
            nm_dataplane::otel::proto::SPAN_ATTRIBUTE,
            kv,
        );
    }
    out
}

/// The SDK's ended spans.
#[derive(Debug, Default, Clone)]
struct Collect(Arc<Mutex<Vec<opentelemetry_sdk::trace::SpanData>>>);

impl SpanProcessor for Collect {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &Context) {}
    fn on_end(&self, span: opentelemetry_sdk::trace::SpanData) {
        if span.span_context.is_sampled()
            && let Ok(mut spans) = self.0.lock()
        {
            spans.push(span);
        }
    }
    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }
    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

fn ours(sampler: span::Sampler) -> (Tracer, Receiver<SpanData>) {
    let (tx, rx) = mpsc::sync_channel(1000);
    let queue = SpanQueue {
        spans: tx,
        backlog: Arc::new(Backlog::default()),
        batch: 512,
        wake: Box::new(|| {}),
        drops: Arc::new(|_, _| {}),
    };
    (Tracer::new(sampler, queue), rx)
}

fn theirs(sampler: Sampler) -> (SdkTracerProvider, Collect) {
    let collect = Collect::default();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(collect.clone())
        .with_sampler(sampler)
        .build();
    (provider, collect)
}

/// The samplers, ours and the SDK's.
fn samplers() -> Vec<(span::Sampler, Sampler)> {
    use span::Root;
    vec![
        (span::Sampler::AlwaysOn, Sampler::AlwaysOn),
        (span::Sampler::AlwaysOff, Sampler::AlwaysOff),
        (span::Sampler::Ratio(0.5), Sampler::TraceIdRatioBased(0.5)),
        (span::Sampler::Ratio(0.0), Sampler::TraceIdRatioBased(0.0)),
        (
            span::Sampler::ParentBased(Root::AlwaysOn),
            Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        ),
        (
            span::Sampler::ParentBased(Root::AlwaysOff),
            Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        ),
        (
            span::Sampler::ParentBased(Root::Ratio(0.25)),
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(0.25))),
        ),
    ]
}

/// Parent contexts: none, remote and local parents sampled or not, with and without trace
/// state, an invalid active span, over trace ids that spread across the ratio's range.
fn parents() -> Vec<Context> {
    let mut out = vec![Context::new()];
    let state: TraceState = "vendor=a,other=b".parse().unwrap_or_default();
    for i in 0..64u128 {
        let trace = TraceId::from((i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835));
        for (flags, remote) in [
            (TraceFlags::SAMPLED, true),
            (TraceFlags::default(), true),
            (TraceFlags::SAMPLED, false),
            (TraceFlags::new(0x03), false),
            (TraceFlags::default(), false),
        ] {
            let state = if i % 2 == 0 {
                state.clone()
            } else {
                TraceState::default()
            };
            let sc = SpanContext::new(trace, SpanId::from(i as u64 + 7), flags, remote, state);
            out.push(Context::new().with_remote_span_context(sc));
        }
    }
    // An active span whose context is not valid.
    out.push(Context::new().with_remote_span_context(SpanContext::new(
        TraceId::INVALID,
        SpanId::INVALID,
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    )));
    out
}

/// What must match between two spans made from the same parent (the ids are random).
fn shape(sc: &SpanContext, parent: &Context) -> (bool, u8, String, bool) {
    let span = parent.span();
    let p = span.span_context();
    let continues = if p.is_valid() {
        sc.trace_id() == p.trace_id()
    } else {
        sc.trace_id() != p.trace_id()
    };
    (
        sc.is_sampled(),
        sc.trace_flags().to_u8(),
        sc.trace_state().header(),
        continues && !sc.is_remote() && sc.is_valid(),
    )
}

#[test]
fn spans_are_sampled_flagged_and_parented_as_the_sdk_did() {
    for (our_sampler, their_sampler) in samplers() {
        let (tracer, rx) = ours(our_sampler);
        let (provider, collect) = theirs(their_sampler);
        let sdk = provider.tracer("t");
        // A root span's trace id is random: a ratio decides on it differently each time, so
        // ratios are compared under valid parents (their trace ids spread over the range).
        let ratio = matches!(
            our_sampler,
            span::Sampler::Ratio(_) | span::Sampler::ParentBased(span::Root::Ratio(_))
        );
        let parents = parents()
            .into_iter()
            .filter(|p| !ratio || p.span().span_context().is_valid());
        for parent in parents {
            let builder = || {
                SpanBuilder::from_name("op")
                    .with_kind(SpanKind::Client)
                    .with_start_time(UNIX_EPOCH + Duration::from_secs(1))
                    .with_attributes([KeyValue::new("a", 1_i64)])
            };
            let mut a = tracer.build_with_context(builder(), &parent);
            let mut b = sdk.build_with_context(builder(), &parent);
            assert_eq!(
                shape(a.span_context(), &parent),
                shape(b.span_context(), &parent),
                "{our_sampler:?} under {:?}",
                parent.span().span_context()
            );
            assert_eq!(a.is_recording(), b.is_recording());
            a.end_with_timestamp(UNIX_EPOCH + Duration::from_secs(2));
            b.end_with_timestamp(UNIX_EPOCH + Duration::from_secs(2));
        }
        let theirs = std::mem::take(&mut *collect.0.lock().unwrap_or_else(PoisonError::into_inner));
        let ours: Vec<SpanData> = rx.try_iter().collect();
        assert_eq!(ours.len(), theirs.len(), "{our_sampler:?}");
        for (o, t) in ours.iter().zip(&theirs) {
            assert_eq!(o.parent_span_id, t.parent_span_id);
            assert_eq!(o.parent_is_remote, t.parent_span_is_remote);
            assert_eq!(o.kind, t.span_kind);
            assert_eq!(o.name, t.name);
            assert_eq!((o.start, o.end), (t.start_time, t.end_time));
            assert_eq!(o.attributes, encoded(&t.attributes));
            // A child continues its parent's trace (a root's id is random).
            if o.parent_span_id != SpanId::INVALID {
                assert_eq!(o.context.trace_id(), t.span_context.trace_id());
            }
        }
    }
}

#[test]
fn limits_status_and_ending_follow_the_sdk() {
    let (tracer, rx) = ours(span::Sampler::AlwaysOn);
    let (provider, collect) = theirs(Sampler::AlwaysOn);
    let sdk = provider.tracer("t");
    let links: Vec<Link> = (0..200u64)
        .map(|i| {
            Link::new(
                SpanContext::new(
                    TraceId::from(u128::from(i) + 1),
                    SpanId::from(i + 1),
                    TraceFlags::SAMPLED,
                    true,
                    TraceState::default(),
                ),
                (0..130).map(|j| KeyValue::new("k", j as i64)).collect(),
                0,
            )
        })
        .collect();
    let builder = || {
        SpanBuilder::from_name("batch")
            .with_attributes((0..140).map(|j| KeyValue::new("b", j as i64)))
            .with_links(links.clone())
    };
    fn touch(span: &mut impl opentelemetry::trace::Span) {
        span.set_attribute(KeyValue::new("late", true));
        span.set_status(Status::Ok);
        span.set_status(Status::error("not after ok"));
        span.add_link(SpanContext::empty_context(), Vec::new());
        span.add_event("e", vec![KeyValue::new("x", 1_i64)]);
        span.update_name("renamed");
    }
    let mut a = tracer.build_with_context(builder(), &Context::new());
    let mut b = sdk.build_with_context(builder(), &Context::new());
    touch(&mut a);
    touch(&mut b);
    drop(a);
    drop(b);
    let theirs = std::mem::take(&mut *collect.0.lock().unwrap_or_else(PoisonError::into_inner));
    let ours: Vec<SpanData> = rx.try_iter().collect();
    assert_eq!(
        (ours.len(), theirs.len()),
        (1, 1),
        "each ended once, when dropped"
    );
    let (o, t) = (&ours[0], &theirs[0]);
    assert_eq!(o.name, t.name);
    assert_eq!(o.attributes, encoded(&t.attributes));
    assert_eq!(o.attribute_count as usize, t.attributes.len());
    assert_eq!(o.dropped_attributes, t.dropped_attributes_count);
    assert_eq!(o.links, t.links.links);
    assert_eq!(o.dropped_links, t.links.dropped_count);
    assert_eq!(o.events.len(), t.events.events.len());
    assert_eq!(o.status, t.status);
    assert!(o.end > o.start);
}

#[test]
fn a_request_span_ends_once_explicitly_or_with_its_last_handle() {
    let (tracer, rx) = ours(span::Sampler::AlwaysOn);
    let span = tracer.start(None, SpanKind::Server, 4);
    let other = span.clone();
    span.update(|s| s.str("k", "v"));
    span.end_at(UNIX_EPOCH + Duration::from_secs(5));
    other.end();
    drop((span, other));
    let ended: Vec<SpanData> = rx.try_iter().collect();
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].end, UNIX_EPOCH + Duration::from_secs(5));

    let span = tracer.start(None, SpanKind::Server, 4);
    let other = span.clone();
    drop(span);
    assert_eq!(rx.try_iter().count(), 0, "a handle is left");
    drop(other);
    let ended: Vec<SpanData> = rx.try_iter().collect();
    assert_eq!(ended.len(), 1);
    assert!(ended[0].end >= ended[0].start);

    let (tracer, rx) = ours(span::Sampler::AlwaysOff);
    let span = tracer.start(None, SpanKind::Server, 4);
    assert!(span.context().is_valid() && !span.context().is_sampled());
    span.end();
    assert_eq!(rx.try_iter().count(), 0, "an unsampled span is not queued");
}

#[test]
fn a_full_queue_drops_and_counts() {
    let (tx, rx) = mpsc::sync_channel(1);
    let dropped = Arc::new(Mutex::new(Vec::new()));
    let counted = dropped.clone();
    let woken = Arc::new(Mutex::new(0));
    let wake = woken.clone();
    let queue = SpanQueue {
        spans: tx,
        backlog: Arc::new(Backlog::default()),
        batch: 1,
        wake: Box::new(move || *wake.lock().unwrap_or_else(PoisonError::into_inner) += 1),
        drops: Arc::new(move |reason, n| {
            counted
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((reason, n));
        }),
    };
    let tracer = Tracer::new(span::Sampler::AlwaysOn, queue);
    for _ in 0..3 {
        tracer.start(None, SpanKind::Server, 0).end();
    }
    assert_eq!(rx.try_iter().count(), 1);
    assert_eq!(
        *dropped.lock().unwrap_or_else(PoisonError::into_inner),
        [("queue_full", 1), ("queue_full", 1)]
    );
    assert_eq!(
        *woken.lock().unwrap_or_else(PoisonError::into_inner),
        1,
        "woken once a batch"
    );
}

#[test]
fn a_clients_traceparent_is_read_as_the_sdk_read_it() {
    let ids = [
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "00000000000000000000000000000000",
        "4BF92F3577B34DA6A3CE929D0E0E4736",
        "4bf92f3577b34da6a3ce929d0e0e473",
        "+bf92f3577b34da6a3ce929d0e0e4736",
        "xyz",
    ];
    let spans = [
        "00f067aa0ba902b7",
        "0000000000000000",
        "00F067AA0BA902B7",
        "f067aa0ba902b7",
        "-1",
    ];
    let versions = ["00", "01", "fe", "ff", "0", "zz", "+0"];
    let flags = ["00", "01", "03", "09", "ff", "1", "0x", "01-extra", ""];
    let states = [None, Some("vendor=a,b=c"), Some("Bad Key=1"), Some("")];
    let propagator = TraceContextPropagator::new();
    let mut checked = 0;
    for v in versions {
        for t in ids {
            for s in spans {
                for f in flags {
                    for state in states {
                        for value in [
                            format!("{v}-{t}-{s}-{f}"),
                            format!(" {v}-{t}-{s}-{f} "),
                            format!("{v}-{t}-{s}-{f}-"),
                        ] {
                            let mut headers = http::HeaderMap::new();
                            if let Ok(h) = http::HeaderValue::from_str(&value) {
                                headers.insert("traceparent", h);
                            }
                            if let Some(st) = state
                                && let Ok(h) = http::HeaderValue::from_str(st)
                            {
                                headers.insert("tracestate", h);
                            }
                            let theirs = propagator.extract(&Headers(&headers));
                            let theirs = theirs.span().span_context().clone();
                            let ours = nm_dataplane::otel::extract(&headers)
                                .unwrap_or_else(SpanContext::empty_context);
                            assert_eq!(ours, theirs, "{value:?} {state:?}");
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 1000);
}

struct Headers<'a>(&'a http::HeaderMap);

impl opentelemetry::propagation::Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}
