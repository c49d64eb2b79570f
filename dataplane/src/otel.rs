//! The dataplane's exported spans (OpenTelemetry, GenAI semantic conventions). Only the spans
//! made here leave the process; the `tracing` spans behind the logs stay private.
//!
//! Each traced request has a fixed shape:
//! - a SERVER span for the client's HTTP request, opened by the trace layer (continuing an
//!   inbound `traceparent`) and ended when the answer's last byte has been passed on;
//! - for a proxied request that reached the point of calling the provider, a CLIENT span
//!   `{gen_ai.operation.name} {gen_ai.request.model}` for the upstream call, whose context is
//!   sent upstream in `traceparent` (unless the provider's `trace_context` is off), ended with
//!   the answer's usage, cost and ending.
//!
//! Both end exactly once: with the answer's end, else when their last handle is dropped (the
//! SDK's span ends itself then). With tracing off ([`Tracing`] absent) none of this runs and a
//! client's own `traceparent` passes upstream untouched.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use opentelemetry::global::BoxedTracer;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt, TraceId, Tracer,
};
use opentelemetry::{Context, KeyValue, Value};

use crate::providers::{Provider, WireFormat};

/// Longest message content put on a span (`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`).
pub const MAX_CONTENT_BYTES: usize = 16 * 1024;

/// The header that tells a client its request's trace id.
pub const TRACE_ID_HEADER: HeaderName = HeaderName::from_static("nm-trace-id");

/// The dataplane's tracer and propagator. Cheap to clone.
#[derive(Clone)]
pub struct Tracing {
    inner: Arc<Inner>,
}

struct Inner {
    tracer: BoxedTracer,
    /// Reads a client's context (every format `OTEL_PROPAGATORS` names).
    propagator: Box<dyn TextMapPropagator + Send + Sync>,
    /// Whether upstream calls get `traceparent`/`tracestate` (written here, see [`traceparent`]).
    trace_context: bool,
    /// The other formats written upstream (baggage), when named.
    other: Option<Box<dyn TextMapPropagator + Send + Sync>>,
    capture_content: bool,
}

/// The most attributes a SERVER span gets (`server_attributes`, then `attribute` or `signal`,
/// `respond`, and `error.type` once).
const SERVER_ATTRIBUTES: usize = 12;
/// The most attributes a CLIENT span gets (`client_attributes`, `answered`, `end`).
const CLIENT_ATTRIBUTES: usize = 24;

/// The headers of W3C trace context.
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

impl std::fmt::Debug for Tracing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracing")
            .field("capture_content", &self.inner.capture_content)
            .finish_non_exhaustive()
    }
}

/// A request's exported spans, carried in its extensions and then by its answer's body.
#[derive(Clone, Debug)]
pub struct RequestTrace {
    pub server: Context,
    pub client: Option<Context>,
    tracing: Tracing,
}

impl Tracing {
    /// `propagator` reads inbound context; upstream calls get W3C trace context when
    /// `trace_context`, and what `other` writes.
    pub fn new(
        tracer: BoxedTracer,
        propagator: Box<dyn TextMapPropagator + Send + Sync>,
        trace_context: bool,
        other: Option<Box<dyn TextMapPropagator + Send + Sync>>,
        capture_content: bool,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                tracer,
                propagator,
                trace_context,
                other,
                capture_content,
            }),
        }
    }

    /// Whether prompts and answers go on spans.
    pub fn captures_content(&self) -> bool {
        self.inner.capture_content
    }

    /// Opens the SERVER span of a request, continuing the client's trace context when it sent
    /// one. `route` is the low-cardinality template (None for an unknown path).
    pub fn server(
        &self,
        headers: &HeaderMap,
        method: &Method,
        route: Option<&'static str>,
        path: &str,
        request_id: &str,
    ) -> RequestTrace {
        let parent = self.inner.propagator.extract(&HeaderExtractor(headers));
        let tracer = &self.inner.tracer;
        // The sampler decides first (ours read neither name nor attributes): a span that is
        // not recorded costs no name and no attribute. The empty list handed to the SDK
        // becomes the span's own, room made once for every attribute it will get.
        let mut span = tracer
            .span_builder("")
            .with_kind(SpanKind::Server)
            .with_attributes(Vec::with_capacity(SERVER_ATTRIBUTES))
            .start_with_context(tracer, &parent);
        if span.is_recording() {
            span.update_name(server_name(method, route));
            span.set_attributes(server_attributes(method, route, path, request_id));
        }
        RequestTrace {
            server: parent.with_span(span),
            client: None,
            tracing: self.clone(),
        }
    }
}

/// `{method} {route}`, or the method alone for an unknown path.
fn server_name(method: &Method, route: Option<&'static str>) -> String {
    let known = known_method(method);
    match route {
        Some(r) => format!("{known} {r}"),
        None => known.to_owned(),
    }
}

fn server_attributes(
    method: &Method,
    route: Option<&'static str>,
    path: &str,
    request_id: &str,
) -> Vec<KeyValue> {
    let known = known_method(method);
    let mut attributes = Vec::with_capacity(6);
    attributes.push(KeyValue::new("http.request.method", known));
    if known == "_OTHER" {
        attributes.push(KeyValue::new(
            "http.request.method_original",
            method.as_str().to_owned(),
        ));
    }
    if let Some(r) = route {
        attributes.push(KeyValue::new("http.route", r));
    }
    attributes.push(KeyValue::new("url.path", path.to_owned()));
    attributes.push(KeyValue::new("nm.request_id", request_id.to_owned()));
    attributes
}

/// `http.request.method`: the standard methods, else `_OTHER` (the semantic conventions'
/// bound on a client-chosen value).
fn known_method(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "_OTHER",
    }
}

/// What the CLIENT span knows when the upstream call starts.
pub struct Call<'a> {
    pub provider: &'a Provider,
    pub native_path: &'a str,
    pub method: &'a Method,
    pub model: Option<&'a str>,
    pub max_tokens: Option<u64>,
    pub session: Option<&'a str>,
    /// The request body, for content capture.
    pub body: &'a [u8],
}

/// How an answer ended, for its spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Complete,
    UpstreamAborted,
    ClientDisconnected,
}

/// What the spans learn at the answer's end.
pub struct End<'a> {
    pub outcome: Outcome,
    pub at: SystemTime,
    pub status: u16,
    pub usage: &'a nm_types::Usage,
    pub cost_micros: Option<u64>,
    pub time_to_first_chunk: Option<Duration>,
    pub streamed: bool,
    /// The answer's first bytes, when content is captured.
    pub output: Option<&'a [u8]>,
}

impl RequestTrace {
    pub fn trace_id(&self) -> TraceId {
        self.server.span().span_context().trace_id()
    }

    /// The context of the span a log line or an upstream call belongs to.
    pub fn span_context(&self) -> SpanContext {
        self.client
            .as_ref()
            .unwrap_or(&self.server)
            .span()
            .span_context()
            .clone()
    }

    /// What the request record keeps of its trace: the span the record's batch links to (the
    /// CLIENT span while it is open or once ended, else the SERVER span). None unless sampled:
    /// a trace no backend has is no use to anyone.
    pub fn trace_ref(&self) -> Option<nm_types::record::TraceRef> {
        let cx = self.span_context();
        cx.is_sampled().then(|| nm_types::record::TraceRef {
            trace_id: cx.trace_id().to_bytes(),
            span_id: cx.span_id().to_bytes(),
        })
    }

    /// The SERVER span's ids when its context is valid, sampled or not: what the request's log
    /// lines name.
    pub fn log_ids(&self) -> Option<nm_types::record::TraceRef> {
        let cx = self.span_context();
        cx.is_valid().then(|| nm_types::record::TraceRef {
            trace_id: cx.trace_id().to_bytes(),
            span_id: cx.span_id().to_bytes(),
        })
    }

    /// Whether the spans are exported (sampled).
    pub fn is_sampled(&self) -> bool {
        self.server.span().span_context().is_sampled()
    }

    /// Whether prompts and answers go on the spans.
    pub fn captures_content(&self) -> bool {
        self.tracing.captures_content()
    }

    /// Attributes known once the request is attributed.
    pub fn attribute(&self, agent: Option<&str>, env: Option<&str>) {
        let span = self.server.span();
        if !span.is_recording() {
            return;
        }
        if let Some(a) = agent {
            span.set_attribute(KeyValue::new("nm.agent", a.to_owned()));
        }
        if let Some(e) = env {
            span.set_attribute(KeyValue::new("nm.env", e.to_owned()));
        }
    }

    /// Attributes of a `POST /v1/signal`.
    pub fn signal(&self, action: &'static str, agent: Option<&str>) {
        let span = self.server.span();
        if !span.is_recording() {
            return;
        }
        span.set_attribute(KeyValue::new("nm.signal.action", action));
        if let Some(a) = agent {
            span.set_attribute(KeyValue::new("nm.agent", a.to_owned()));
        }
    }

    /// Links the SERVER span to other traces' spans (a signal's to its session's requests).
    pub fn link(&self, spans: &[nm_types::record::TraceRef]) {
        let span = self.server.span();
        for t in spans {
            span.add_link(
                SpanContext::new(
                    TraceId::from_bytes(t.trace_id),
                    opentelemetry::trace::SpanId::from_bytes(t.span_id),
                    opentelemetry::trace::TraceFlags::SAMPLED,
                    true,
                    opentelemetry::trace::TraceState::default(),
                ),
                Vec::new(),
            );
        }
    }

    /// Sets the SERVER span's outcome from the answer's status; an error class for a 5xx
    /// (`error_type` when the gateway made the error, else the status code).
    pub fn respond(&self, status: u16, error_type: Option<&'static str>) {
        let span = self.server.span();
        if !span.is_recording() {
            return;
        }
        span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if status >= 500 {
            let error_type: Cow<'static, str> = match error_type {
                Some(e) => Cow::Borrowed(e),
                None => Cow::Owned(status.to_string()),
            };
            span.set_attribute(KeyValue::new("error.type", error_type));
            span.set_status(Status::error(""));
        }
    }

    /// Marks the SERVER span with the gateway's error code (its 5xx status is set with the
    /// answer).
    pub fn gateway_error(&self, code: &'static str, status: u16) {
        if status >= 500 {
            self.server
                .span()
                .set_attribute(KeyValue::new("error.type", code));
        }
    }

    /// Opens the CLIENT span of the upstream call.
    pub fn call(&mut self, call: &Call<'_>) {
        let tracer = &self.tracing.inner.tracer;
        let mut span = tracer
            .span_builder("")
            .with_kind(SpanKind::Client)
            .with_attributes(Vec::with_capacity(CLIENT_ATTRIBUTES))
            .start_with_context(tracer, &self.server);
        if span.is_recording() {
            let (name, attributes) = self.client_attributes(call);
            span.update_name(name);
            span.set_attributes(attributes);
        }
        self.client = Some(self.server.with_span(span));
    }

    /// The CLIENT span's name and first attributes.
    fn client_attributes(&self, call: &Call<'_>) -> (String, Vec<KeyValue>) {
        let operation = operation_name(call.provider.format, call.native_path);
        let name = match (operation, call.model) {
            (Some(op), Some(model)) => format!("{op} {model}"),
            (Some(op), None) => op.to_owned(),
            (None, _) => known_method(call.method).to_owned(),
        };
        let provider = call.provider;
        let mut attributes = Vec::with_capacity(10);
        if let Some(op) = operation {
            attributes.push(KeyValue::new("gen_ai.operation.name", op));
        }
        attributes.push(KeyValue::new(
            "gen_ai.provider.name",
            Value::String(provider.system.clone().into()),
        ));
        if let Some(m) = call.model {
            attributes.push(KeyValue::new("gen_ai.request.model", m.to_owned()));
        }
        if let Some(t) = call.max_tokens {
            attributes.push(KeyValue::new(
                "gen_ai.request.max_tokens",
                i64::try_from(t).unwrap_or(i64::MAX),
            ));
        }
        if let Some(s) = call.session {
            attributes.push(KeyValue::new("gen_ai.conversation.id", s.to_owned()));
        }
        attributes.push(KeyValue::new(
            "http.request.method",
            known_method(call.method),
        ));
        attributes.push(KeyValue::new(
            "server.address",
            provider.authority.host().to_owned(),
        ));
        let port = provider.authority.port_u16().unwrap_or(
            if provider.scheme == http::uri::Scheme::HTTPS {
                443
            } else {
                80
            },
        );
        attributes.push(KeyValue::new("server.port", i64::from(port)));
        if self.tracing.inner.capture_content {
            attributes.push(KeyValue::new("gen_ai.input.messages", capped(call.body)));
        }
        (name, attributes)
    }

    /// Writes the CLIENT span's context into the upstream request, in place of the client's own
    /// (the formats `OTEL_PROPAGATORS` names; with none, the client's headers pass untouched).
    pub fn inject(&self, headers: &mut HeaderMap) {
        let Some(cx) = &self.client else {
            return;
        };
        let inner = &self.tracing.inner;
        let span = cx.span();
        let sc = span.span_context();
        if inner.trace_context && sc.is_valid() {
            if let Ok(v) = HeaderValue::from_bytes(&traceparent(sc)) {
                headers.insert(TRACEPARENT, v);
            }
            // Ours carries the client's trace state on; a stale one must not ride along.
            let state = sc.trace_state().header();
            match HeaderValue::try_from(state) {
                Ok(v) if !v.is_empty() => {
                    headers.insert(TRACESTATE, v);
                }
                _ => {
                    headers.remove(TRACESTATE);
                }
            }
        }
        if let Some(other) = &inner.other {
            other.inject_context(cx, &mut HeaderInjector(headers));
        }
    }

    /// Ends the CLIENT span of a call that got no answer (refused, timed out, unreachable).
    pub fn call_failed(&mut self, error_type: &'static str) {
        if let Some(cx) = self.client.take() {
            let span = cx.span();
            span.set_attribute(KeyValue::new("error.type", error_type));
            span.set_status(Status::error(""));
            span.end();
        }
    }

    /// The answer's head arrived.
    pub fn answered(&self, status: u16, streamed: bool) {
        if let Some(cx) = &self.client {
            let span = cx.span();
            if span.is_recording() {
                span.set_attribute(KeyValue::new(
                    "http.response.status_code",
                    i64::from(status),
                ));
                span.set_attribute(KeyValue::new("gen_ai.request.stream", streamed));
            }
        }
    }

    /// Ends both spans at the answer's end, with what the answer reported.
    pub fn end(self, end: &End<'_>) {
        if !self.server.span().is_recording() {
            // Nothing to say on spans that are not recorded; ending them is all.
            if let Some(cx) = &self.client {
                cx.span().end_with_timestamp(end.at);
            }
            self.server.span().end_with_timestamp(end.at);
            return;
        }
        let error_type = match end.outcome {
            Outcome::Complete if end.status >= 400 => Some(Cow::Owned(end.status.to_string())),
            Outcome::Complete => None,
            Outcome::UpstreamAborted => Some(Cow::Borrowed("upstream_aborted")),
            Outcome::ClientDisconnected => Some(Cow::Borrowed("client_disconnected")),
        };
        if let Some(cx) = &self.client {
            let span = cx.span();
            let u = end.usage;
            let mut attributes = Vec::with_capacity(12);
            if let Some(m) = &u.model {
                attributes.push(KeyValue::new("gen_ai.response.model", m.clone()));
            }
            if let Some(id) = &u.response_id {
                attributes.push(KeyValue::new("gen_ai.response.id", id.clone()));
            }
            if let Some(r) = &u.finish_reason {
                attributes.push(KeyValue::new(
                    "gen_ai.response.finish_reasons",
                    Value::Array(vec![opentelemetry::StringValue::from(r.clone())].into()),
                ));
            }
            let count = |key: &'static str, n: Option<u64>, out: &mut Vec<KeyValue>| {
                if let Some(n) = n {
                    out.push(KeyValue::new(key, i64::try_from(n).unwrap_or(i64::MAX)));
                }
            };
            count("gen_ai.usage.input_tokens", u.input_tokens, &mut attributes);
            count(
                "gen_ai.usage.output_tokens",
                u.output_tokens,
                &mut attributes,
            );
            count(
                "gen_ai.usage.cache_read.input_tokens",
                u.cached_input_tokens,
                &mut attributes,
            );
            count(
                "gen_ai.usage.cache_creation.input_tokens",
                u.cache_write_tokens,
                &mut attributes,
            );
            count(
                "gen_ai.usage.reasoning.output_tokens",
                u.reasoning_tokens,
                &mut attributes,
            );
            if let Some(c) = end.cost_micros {
                attributes.push(KeyValue::new("nm.cost.usd", c as f64 / 1e6));
            }
            if end.streamed
                && let Some(t) = end.time_to_first_chunk
            {
                attributes.push(KeyValue::new(
                    "gen_ai.response.time_to_first_chunk",
                    t.as_secs_f64(),
                ));
            }
            if let Some(e) = &error_type {
                attributes.push(KeyValue::new("error.type", e.clone()));
            }
            if let Some(output) = end.output {
                attributes.push(KeyValue::new("gen_ai.output.messages", capped(output)));
            }
            span.set_attributes(attributes);
            if error_type.is_some() {
                span.set_status(Status::error(""));
            }
            span.end_with_timestamp(end.at);
        }
        let server = self.server.span();
        if end.outcome != Outcome::Complete {
            // The answer the client saw was cut short: an error whatever its status said.
            if let Some(e) = error_type {
                server.set_attribute(KeyValue::new("error.type", e));
            }
            server.set_status(Status::error(""));
        }
        server.end_with_timestamp(end.at);
    }
}

/// `traceparent` of a span: `00-{trace id}-{span id}-{flags}` (W3C Trace Context, version 00),
/// written without the formatting machinery (it is on every traced request's path).
fn traceparent(sc: &SpanContext) -> [u8; 55] {
    let mut out = *b"00-00000000000000000000000000000000-0000000000000000-00";
    hex_into(&sc.trace_id().to_bytes(), &mut out[3..35]);
    hex_into(&sc.span_id().to_bytes(), &mut out[36..52]);
    hex_into(&[sc.trace_flags().to_u8()], &mut out[53..55]);
    out
}

/// Lower-case hex of `bytes` into `out` (twice as long).
fn hex_into(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (b, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
}

/// A trace id as 32 lower-case hex digits (for headers, logs and exemplars).
pub fn trace_hex(id: TraceId) -> String {
    let mut out = [0u8; 32];
    hex_into(&id.to_bytes(), &mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// A span id as 16 lower-case hex digits.
pub fn span_hex(id: opentelemetry::trace::SpanId) -> String {
    let mut out = [0u8; 16];
    hex_into(&id.to_bytes(), &mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// `gen_ai.operation.name` of a provider's native path, when it is a GenAI operation.
pub fn operation_name(format: WireFormat, path: &str) -> Option<&'static str> {
    let path = path.trim_end_matches('/');
    match format {
        WireFormat::Openai => {
            if path.ends_with("/chat/completions") || path.ends_with("/responses") {
                Some("chat")
            } else if path.ends_with("/completions") {
                Some("text_completion")
            } else if path.ends_with("/embeddings") {
                Some("embeddings")
            } else {
                None
            }
        }
        WireFormat::Anthropic => {
            if path.ends_with("/messages") {
                Some("chat")
            } else if path.ends_with("/complete") {
                Some("text_completion")
            } else {
                None
            }
        }
        WireFormat::Gemini => {
            let method = path.rsplit_once(':').map(|(_, m)| m)?;
            match method {
                "generateContent" | "streamGenerateContent" => Some("generate_content"),
                "embedContent" | "batchEmbedContents" => Some("embeddings"),
                _ => None,
            }
        }
    }
}

/// Content for a span: at most [`MAX_CONTENT_BYTES`], cut on a character boundary.
fn capped(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX_CONTENT_BYTES + 4)]);
    if text.len() <= MAX_CONTENT_BYTES {
        return text.into_owned();
    }
    let mut end = MAX_CONTENT_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_names_follow_the_native_paths() {
        use WireFormat::*;
        for (format, path, op) in [
            (Openai, "/v1/chat/completions", Some("chat")),
            (Openai, "/v1/responses", Some("chat")),
            (Openai, "/v1/completions", Some("text_completion")),
            (Openai, "/v1/embeddings", Some("embeddings")),
            (Openai, "/v1/models", None),
            (Anthropic, "/v1/messages", Some("chat")),
            (Anthropic, "/v1/messages/count_tokens", None),
            (
                Gemini,
                "/v1beta/models/gemini-2.0-flash:generateContent",
                Some("generate_content"),
            ),
            (
                Gemini,
                "/v1beta/models/gemini-2.0-flash:streamGenerateContent",
                Some("generate_content"),
            ),
            (
                Gemini,
                "/v1beta/models/text-embedding-004:embedContent",
                Some("embeddings"),
            ),
            (Gemini, "/v1beta/models", None),
        ] {
            assert_eq!(operation_name(format, path), op, "{path}");
        }
    }

    #[test]
    fn captured_content_is_capped_on_a_character_boundary() {
        assert_eq!(capped(b"hello"), "hello");
        let long = "é".repeat(MAX_CONTENT_BYTES);
        let c = capped(long.as_bytes());
        assert!(c.len() <= MAX_CONTENT_BYTES + 3 && c.ends_with("..."));
    }

    #[test]
    fn traceparent_is_the_w3c_spelling() {
        let sc = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            opentelemetry::trace::SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            opentelemetry::trace::TraceFlags::SAMPLED,
            false,
            opentelemetry::trace::TraceState::default(),
        );
        assert_eq!(
            &traceparent(&sc)[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        assert_eq!(trace_hex(sc.trace_id()), sc.trace_id().to_string());
        assert_eq!(span_hex(sc.span_id()), sc.span_id().to_string());
    }

    #[test]
    fn unknown_methods_are_bounded() {
        assert_eq!(known_method(&Method::POST), "POST");
        assert_eq!(
            known_method(&Method::from_bytes(b"BREW").unwrap()),
            "_OTHER"
        );
    }
}
