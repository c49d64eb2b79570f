//! The gateway's spans, made without the OpenTelemetry SDK: the values a span is made of
//! ([`SpanData`]), the tracer that starts them ([`Tracer`]: ids, sampler) and the bounded queue
//! an ended span goes into ([`SpanQueue`]), which the export thread (the root's `otel::export`)
//! drains and encodes straight into OTLP.
//!
//! Why: through the SDK a request's two spans cost about 10k instructions on the worker (a boxed
//! tracer, a sampler behind `dyn`, a `Context` with its span behind an `Arc` and a `Box`, the
//! span's data rebuilt at its end). Here a request's span is one allocation holding its data,
//! shared by the request's handles ([`Span`]) and moved into the queue when it ends.
//!
//! What the SDK (0.33) did is kept, rule for rule:
//! - **Ids**: a new span id for every span, a new trace id unless the parent's context is valid;
//!   from a per-thread `SmallRng` seeded by the OS, as the SDK's `RandomIdGenerator`.
//! - **Sampling** ([`Sampler`], `OTEL_TRACES_SAMPLER`): `always_on`, `always_off`,
//!   `traceidratio` (the trace id's low 63 bits below ratio × 2⁶³), `parentbased_*` (an active
//!   parent span decides by its sampled flag, else the root sampler). A sampled span takes the
//!   parent's flags with `sampled` set; an unsampled one has no flags and records nothing, but
//!   has ids (its context still travels). Both take the parent's trace state.
//! - **Limits**: 128 attributes, events and links per span, 128 attributes per event and link;
//!   beyond them, counted as dropped.
//! - **Status** only moves up: unset, error, ok.
//! - **Ending**: a span ends once, explicitly or when its last handle is dropped (then at that
//!   moment). Only sampled spans are queued; a full queue drops the span and counts it.
//!
//! Spans made off the request path (the controlplane's database spans, the link's) go through
//! the OpenTelemetry API instead (`BoxedTracer`, `Context`): [`Tracer`] implements it over the
//! same values ([`ApiSpan`]).

use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use opentelemetry::trace::{
    Event, Link, SpanBuilder, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags,
    TraceId, TraceState,
};
use opentelemetry::{Context, KeyValue};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::proto::{self, SPAN_ATTRIBUTE, Scalar};

/// Most attributes a span keeps (the SDK's default `SpanLimits`); so for events and links.
pub const MAX_ATTRIBUTES: usize = 128;
pub const MAX_EVENTS: usize = 128;
pub const MAX_LINKS: usize = 128;
/// Most attributes an event or a link keeps.
pub const MAX_ATTRIBUTES_PER_ITEM: usize = 128;

/// An ended span, or one being recorded: what the export thread encodes.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanData {
    pub context: SpanContext,
    /// `SpanId::INVALID` for a root span.
    pub parent_span_id: SpanId,
    pub parent_is_remote: bool,
    pub kind: SpanKind,
    pub name: Cow<'static, str>,
    pub start: SystemTime,
    pub end: SystemTime,
    /// The attributes, written as they were set: each an OTLP `Span.attributes` field (a
    /// `KeyValue` message, [`proto::SPAN_ATTRIBUTE`]), so nothing is copied into owned values
    /// and the export thread only copies these bytes.
    pub attributes: Vec<u8>,
    /// How many attributes [`SpanData::attributes`] holds.
    pub attribute_count: u32,
    pub dropped_attributes: u32,
    pub events: Vec<Event>,
    pub dropped_events: u32,
    pub links: Vec<Link>,
    pub dropped_links: u32,
    pub status: Status,
}

/// `OTEL_TRACES_SAMPLER`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampler {
    AlwaysOn,
    AlwaysOff,
    Ratio(f64),
    /// An active parent span decides; without one, the root sampler.
    ParentBased(Root),
}

/// The sampler of a `parentbased_*` sampler's root spans.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Root {
    AlwaysOn,
    AlwaysOff,
    Ratio(f64),
}

impl Sampler {
    /// Whether a span of trace `trace_id` is sampled; `parent` is the span active in the parent
    /// context, if there is one (valid or not, as the SDK's `Sampler::ParentBased` reads it).
    pub fn samples(self, parent: Option<&SpanContext>, trace_id: TraceId) -> bool {
        match self {
            Sampler::AlwaysOn => true,
            Sampler::AlwaysOff => false,
            Sampler::Ratio(r) => by_ratio(r, trace_id),
            Sampler::ParentBased(root) => match parent {
                Some(p) => p.is_sampled(),
                None => match root {
                    Root::AlwaysOn => true,
                    Root::AlwaysOff => false,
                    Root::Ratio(r) => by_ratio(r, trace_id),
                },
            },
        }
    }
}

/// `traceidratio`: the trace id's low 64 bits, shifted right once, below `ratio` × 2⁶³.
fn by_ratio(ratio: f64, trace_id: TraceId) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    let bound = (ratio.max(0.0) * (1u64 << 63) as f64) as u64;
    let low = (u128::from_be_bytes(trace_id.to_bytes()) & u128::from(u64::MAX)) as u64;
    (low >> 1) < bound
}

thread_local! {
    /// The ids' generator, one per thread (the SDK's `RandomIdGenerator`).
    static IDS: RefCell<SmallRng> = RefCell::new(SmallRng::from_os_rng());
}

fn new_span_id() -> SpanId {
    IDS.with(|r| SpanId::from(r.borrow_mut().random::<u64>()))
}

fn new_trace_id() -> TraceId {
    IDS.with(|r| TraceId::from(r.borrow_mut().random::<u128>()))
}

// === impl SpanQueue ===

/// Counts spans that were not exported, by reason.
pub type DropCounter = Arc<dyn Fn(&'static str, u64) + Send + Sync>;

/// What the queue shares with the export thread: how many spans wait, and whether the thread
/// was already woken for a batch of them.
#[derive(Debug, Default)]
pub struct Backlog {
    pub queued: AtomicUsize,
    pub batch_asked: AtomicBool,
}

/// Where ended spans go: a bounded queue the export thread drains. Pushing never waits: a full
/// queue drops the span and counts it (`queue_full`). The thread is not woken for each span, only
/// once a batch's worth waits (it also wakes on its schedule).
pub struct SpanQueue {
    pub spans: SyncSender<SpanData>,
    pub backlog: Arc<Backlog>,
    /// Spans in a batch.
    pub batch: usize,
    /// Wakes the export thread for a batch.
    pub wake: Box<dyn Fn() + Send + Sync>,
    pub drops: DropCounter,
}

impl std::fmt::Debug for SpanQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpanQueue")
            .field("backlog", &self.backlog)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl SpanQueue {
    fn push(&self, span: SpanData) {
        match self.spans.try_send(span) {
            Ok(()) => {
                let queued = self.backlog.queued.fetch_add(1, Ordering::Relaxed) + 1;
                if queued >= self.batch && !self.backlog.batch_asked.swap(true, Ordering::Relaxed) {
                    (self.wake)();
                }
            }
            Err(TrySendError::Full(_)) => (self.drops)("queue_full", 1),
            // The export thread is gone (shut down): nothing is exported any more.
            Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

// === impl Tracer ===

/// Starts spans: ids, the sampler, and the queue they end into. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Tracer(Arc<TracerInner>);

#[derive(Debug)]
struct TracerInner {
    sampler: Sampler,
    queue: SpanQueue,
}

impl Tracer {
    pub fn new(sampler: Sampler, queue: SpanQueue) -> Self {
        Self(Arc::new(TracerInner { sampler, queue }))
    }

    /// A new span's context, and its data when it is sampled (named `name`, with room for
    /// `attributes` attributes). `parent`: the span active in the parent context, if any.
    fn begin(
        &self,
        parent: Option<&SpanContext>,
        kind: SpanKind,
        name: Cow<'static, str>,
        attributes: Vec<u8>,
        start: SystemTime,
    ) -> (SpanContext, Option<Open>) {
        let span_id = new_span_id();
        let valid = parent.filter(|p| p.is_valid());
        let trace_id = valid.map_or_else(new_trace_id, SpanContext::trace_id);
        let trace_state = parent.map_or_else(TraceState::default, |p| p.trace_state().clone());
        if !self.0.sampler.samples(parent, trace_id) {
            let context =
                SpanContext::new(trace_id, span_id, TraceFlags::default(), false, trace_state);
            return (context, None);
        }
        let flags = valid.map_or(TraceFlags::default(), SpanContext::trace_flags);
        let context = SpanContext::new(
            trace_id,
            span_id,
            flags.with_sampled(true),
            false,
            trace_state,
        );
        let data = SpanData {
            context: context.clone(),
            parent_span_id: valid.map_or(SpanId::INVALID, SpanContext::span_id),
            parent_is_remote: valid.is_some_and(SpanContext::is_remote),
            kind,
            name,
            start,
            end: start,
            attributes,
            attribute_count: 0,
            dropped_attributes: 0,
            events: Vec::new(),
            dropped_events: 0,
            links: Vec::new(),
            dropped_links: 0,
            status: Status::Unset,
        };
        let open = Open {
            data,
            tracer: self.clone(),
        };
        (context, Some(open))
    }

    /// Starts a span of the request path, unnamed (an unsampled span needs no name: name it
    /// with [`Open::name`] when it records), with room for `bytes` bytes of attributes.
    pub fn start(&self, parent: Option<&SpanContext>, kind: SpanKind, bytes: usize) -> Span {
        let (context, open) = self.begin(
            parent,
            kind,
            Cow::Borrowed(""),
            Vec::with_capacity(bytes),
            SystemTime::now(),
        );
        Span(Arc::new(Shared {
            recording: open.is_some(),
            context,
            open: Mutex::new(open),
        }))
    }
}

// === impl Open ===

/// A recording span's data, until it ends.
#[derive(Debug)]
pub struct Open {
    data: SpanData,
    tracer: Tracer,
}

impl Open {
    pub fn name(&mut self, name: impl Into<Cow<'static, str>>) {
        self.data.name = name.into();
    }

    /// Whether one more attribute fits (counted as dropped when not).
    fn room(&mut self) -> bool {
        if (self.data.attribute_count as usize) < MAX_ATTRIBUTES {
            self.data.attribute_count += 1;
            true
        } else {
            self.data.dropped_attributes += 1;
            false
        }
    }

    pub fn set(&mut self, attribute: &KeyValue) {
        if self.room() {
            proto::attribute(&mut self.data.attributes, SPAN_ATTRIBUTE, attribute);
        }
    }

    /// A string attribute, written from the borrowed value.
    pub fn str(&mut self, key: &str, value: &str) {
        self.scalar(key, Scalar::Str(value));
    }

    pub fn int(&mut self, key: &str, value: i64) {
        self.scalar(key, Scalar::I64(value));
    }

    pub fn float(&mut self, key: &str, value: f64) {
        self.scalar(key, Scalar::F64(value));
    }

    pub fn bool(&mut self, key: &str, value: bool) {
        self.scalar(key, Scalar::Bool(value));
    }

    /// An attribute whose value is an array of strings.
    pub fn strs(&mut self, key: &str, values: &[&str]) {
        if self.room() {
            proto::strings_key_value(&mut self.data.attributes, SPAN_ATTRIBUTE, key, values);
        }
    }

    fn scalar(&mut self, key: &str, value: Scalar<'_>) {
        if self.room() {
            proto::scalar_key_value(&mut self.data.attributes, SPAN_ATTRIBUTE, key, value);
        }
    }

    /// Sets the status, unless it is already one that ranks higher (unset < error < ok).
    pub fn status(&mut self, status: Status) {
        if status > self.data.status {
            self.data.status = status;
        }
    }

    pub fn link(&mut self, context: SpanContext, mut attributes: Vec<KeyValue>) {
        if self.data.links.len() < MAX_LINKS {
            let dropped = cap(&mut attributes, MAX_ATTRIBUTES_PER_ITEM);
            self.data
                .links
                .push(Link::new(context, attributes, dropped));
        } else {
            self.data.dropped_links += 1;
        }
    }

    fn event(&mut self, name: Cow<'static, str>, at: SystemTime, mut attributes: Vec<KeyValue>) {
        if self.data.events.len() < MAX_EVENTS {
            let dropped = cap(&mut attributes, MAX_ATTRIBUTES_PER_ITEM);
            self.data
                .events
                .push(Event::new(name, at, attributes, dropped));
        } else {
            self.data.dropped_events += 1;
        }
    }

    /// Ends the span at `at` (None: now, unless an end was already set) and queues it.
    fn end(mut self, at: Option<SystemTime>) {
        match at {
            Some(at) => self.data.end = at,
            None if self.data.end == self.data.start => self.data.end = SystemTime::now(),
            None => {}
        }
        self.tracer.0.queue.push(self.data);
    }
}

// === impl Span ===

/// A span of the request path: cheap to clone, every clone the same span. It ends once: with
/// [`Span::end`] or [`Span::end_at`], else when its last clone is dropped.
#[derive(Debug, Clone)]
pub struct Span(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    context: SpanContext,
    recording: bool,
    open: Mutex<Option<Open>>,
}

impl Span {
    pub fn context(&self) -> &SpanContext {
        &self.0.context
    }

    /// Whether the span records (it was sampled): an unrecorded one takes no name or attribute.
    pub fn is_recording(&self) -> bool {
        self.0.recording
    }

    /// Records on the span, while it is open and recording.
    pub fn update(&self, record: impl FnOnce(&mut Open)) {
        if !self.0.recording {
            return;
        }
        let mut open = self.0.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(open) = open.as_mut() {
            record(open);
        }
    }

    /// Ends the span now.
    pub fn end(&self) {
        self.finish(None);
    }

    /// Ends the span at `at`.
    pub fn end_at(&self, at: SystemTime) {
        self.finish(Some(at));
    }

    fn finish(&self, at: Option<SystemTime>) {
        if !self.0.recording {
            return;
        }
        let open = self
            .0
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(open) = open {
            open.end(at);
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let open = self
            .open
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(open) = open {
            open.end(None);
        }
    }
}

// === the OpenTelemetry API ===

/// A span made through the OpenTelemetry API (off the request path); it ends when dropped, if
/// not before.
#[derive(Debug)]
pub struct ApiSpan {
    context: SpanContext,
    open: Option<Open>,
}

impl opentelemetry::trace::Tracer for Tracer {
    type Span = ApiSpan;

    fn build_with_context(&self, builder: SpanBuilder, parent_cx: &Context) -> ApiSpan {
        if parent_cx.is_telemetry_suppressed() {
            return ApiSpan {
                context: SpanContext::empty_context(),
                open: None,
            };
        }
        let active = parent_cx.span();
        let parent = parent_cx.has_active_span().then(|| active.span_context());
        let SpanBuilder {
            span_kind,
            name,
            start_time,
            attributes,
            events,
            links,
            ..
        } = builder;
        let (context, mut open) = self.begin(
            parent,
            span_kind.unwrap_or(SpanKind::Internal),
            name,
            Vec::new(),
            start_time.unwrap_or_else(SystemTime::now),
        );
        if let Some(open) = open.as_mut() {
            for kv in attributes.iter().flatten() {
                open.set(kv);
            }
            let mut links = links.unwrap_or_default();
            open.data.dropped_links = cap(&mut links, MAX_LINKS);
            for link in &mut links {
                link.dropped_attributes_count = cap(&mut link.attributes, MAX_ATTRIBUTES_PER_ITEM);
            }
            open.data.links = links;
            let mut events = events.unwrap_or_default();
            open.data.dropped_events = cap(&mut events, MAX_EVENTS);
            for event in &mut events {
                event.dropped_attributes_count =
                    cap(&mut event.attributes, MAX_ATTRIBUTES_PER_ITEM);
            }
            open.data.events = events;
        }
        ApiSpan { context, open }
    }
}

/// Keeps the first `max` items; returns how many were dropped (the OTLP `dropped_*` counts).
fn cap<T>(items: &mut Vec<T>, max: usize) -> u32 {
    let dropped = items.len().saturating_sub(max);
    items.truncate(max);
    u32::try_from(dropped).unwrap_or(u32::MAX)
}

impl opentelemetry::trace::Span for ApiSpan {
    fn add_event_with_timestamp<T>(
        &mut self,
        name: T,
        timestamp: SystemTime,
        attributes: Vec<KeyValue>,
    ) where
        T: Into<Cow<'static, str>>,
    {
        if let Some(open) = self.open.as_mut() {
            open.event(name.into(), timestamp, attributes);
        }
    }

    fn span_context(&self) -> &SpanContext {
        &self.context
    }

    fn is_recording(&self) -> bool {
        self.open.is_some()
    }

    fn set_attribute(&mut self, attribute: KeyValue) {
        if let Some(open) = self.open.as_mut() {
            open.set(&attribute);
        }
    }

    fn set_status(&mut self, status: Status) {
        if let Some(open) = self.open.as_mut() {
            open.status(status);
        }
    }

    fn update_name<T>(&mut self, new_name: T)
    where
        T: Into<Cow<'static, str>>,
    {
        if let Some(open) = self.open.as_mut() {
            open.name(new_name);
        }
    }

    fn add_link(&mut self, span_context: SpanContext, attributes: Vec<KeyValue>) {
        if let Some(open) = self.open.as_mut() {
            open.link(span_context, attributes);
        }
    }

    fn end_with_timestamp(&mut self, timestamp: SystemTime) {
        if let Some(open) = self.open.take() {
            open.end(Some(timestamp));
        }
    }
}

impl Drop for ApiSpan {
    fn drop(&mut self) {
        if let Some(open) = self.open.take() {
            open.end(None);
        }
    }
}

#[cfg(test)]
#[path = "span_tests.rs"]
mod tests;
