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
//! Both end exactly once: with the answer's end, else when their last handle is dropped. The
//! spans are our own values ([`span`]), not the SDK's: no `Context`, no boxed tracer on the
//! request path. With tracing off ([`Tracing`] absent) none of this runs and a client's own
//! `traceparent` passes upstream untouched.

pub mod proto;
pub mod span;

use std::borrow::Cow;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
};

use self::span::{Span, Tracer};
use crate::providers::{Provider, WireFormat};

/// Longest message content put on a span (`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`).
pub const MAX_CONTENT_BYTES: usize = 16 * 1024;

/// The header that tells a client its request's trace id.
pub const TRACE_ID_HEADER: HeaderName = HeaderName::from_static("nm-trace-id");

/// The dataplane's tracer and propagation. Cheap to clone.
#[derive(Clone)]
pub struct Tracing {
    inner: Arc<Inner>,
}

struct Inner {
    tracer: Tracer,
    /// Whether W3C trace context is read from clients and written upstream (`OTEL_PROPAGATORS`
    /// names `tracecontext`).
    trace_context: bool,
    /// W3C baggage, read from clients and written upstream, when `OTEL_PROPAGATORS` names it.
    baggage: Option<Box<dyn TextMapPropagator + Send + Sync>>,
    capture_content: bool,
}

/// The room made for a SERVER span's encoded attributes (`server_attributes`, then
/// `attribute` or `signal`, `respond`, and `error.type`: about 300 bytes) and a CLIENT span's
/// (`client_attributes`, `answered`, `end`: about 600 bytes without content).
const SERVER_ATTRIBUTE_BYTES: usize = 384;
const CLIENT_ATTRIBUTE_BYTES: usize = 768;

/// The headers of W3C trace context and baggage.
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
const BAGGAGE: HeaderName = HeaderName::from_static("baggage");

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
    pub server: Span,
    pub client: Option<Span>,
    /// The client's baggage, when it sent some and it is propagated.
    baggage: Option<Context>,
    tracing: Tracing,
}

impl Tracing {
    /// Upstream calls get W3C trace context when `trace_context` (and clients' is continued),
    /// and the client's baggage through `baggage`.
    pub fn new(
        tracer: Tracer,
        trace_context: bool,
        baggage: Option<Box<dyn TextMapPropagator + Send + Sync>>,
        capture_content: bool,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                tracer,
                trace_context,
                baggage,
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
        let inner = &self.inner;
        let parent = if inner.trace_context {
            extract(headers)
        } else {
            None
        };
        let baggage = match &inner.baggage {
            Some(b) if headers.contains_key(BAGGAGE) => {
                Some(b.extract_with_context(&Context::new(), &HeaderExtractor(headers)))
            }
            _ => None,
        };
        // The sampler decides first (ours read neither name nor attributes): a span that is
        // not recorded costs no name and no attribute.
        let span = inner
            .tracer
            .start(parent.as_ref(), SpanKind::Server, SERVER_ATTRIBUTE_BYTES);
        span.update(|s| {
            s.name(server_name(method, route));
            server_attributes(s, method, route, path, request_id);
        });
        RequestTrace {
            server: span,
            client: None,
            baggage,
            tracing: self.clone(),
        }
    }
}

/// The client's W3C trace context, read as the SDK's `TraceContextPropagator` reads it: version
/// (two hex digits, not `ff`; version 00 has exactly four parts), lower-case trace and span ids
/// and flags (only `sampled` kept), an invalid `tracestate` read as empty; None unless the ids
/// are valid.
pub fn extract(headers: &HeaderMap) -> Option<SpanContext> {
    let value = headers
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .trim();
    let mut parts = value.split_terminator('-');
    let (Some(version), Some(trace), Some(span), Some(flags)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let version = u8::from_str_radix(version, 16).ok()?;
    if version > 254 || version == 0 && parts.next().is_some() {
        return None;
    }
    let lower = |s: &str| !s.chars().any(|c| c.is_ascii_uppercase());
    if !lower(trace) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    if !lower(span) {
        return None;
    }
    let span_id = SpanId::from_hex(span).ok()?;
    if !lower(flags) {
        return None;
    }
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()?) & TraceFlags::SAMPLED;
    let state = headers
        .get(TRACESTATE)
        .and_then(|v| v.to_str().ok())
        .map_or_else(TraceState::default, |s| {
            TraceState::from_str(s).unwrap_or_default()
        });
    let cx = SpanContext::new(trace_id, span_id, flags, true, state);
    cx.is_valid().then_some(cx)
}

/// `a b` (the spans' names), without the formatting machinery.
fn joined(a: &str, b: &str) -> String {
    let mut s = String::with_capacity(a.len() + 1 + b.len());
    s.push_str(a);
    s.push(' ');
    s.push_str(b);
    s
}

/// `{method} {route}`, or the method alone for an unknown path.
fn server_name(method: &Method, route: Option<&'static str>) -> Cow<'static, str> {
    let known = known_method(method);
    match route {
        Some(r) => Cow::Owned(joined(known, r)),
        None => Cow::Borrowed(known),
    }
}

fn server_attributes(
    span: &mut span::Open,
    method: &Method,
    route: Option<&'static str>,
    path: &str,
    request_id: &str,
) {
    let known = known_method(method);
    span.str("http.request.method", known);
    if known == "_OTHER" {
        span.str("http.request.method_original", method.as_str());
    }
    if let Some(r) = route {
        span.str("http.route", r);
    }
    span.str("url.path", path);
    span.str("nm.request_id", request_id);
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
        self.server.context().trace_id()
    }

    /// The context of the span a log line or an upstream call belongs to.
    pub fn span_context(&self) -> &SpanContext {
        self.client.as_ref().unwrap_or(&self.server).context()
    }

    /// The SERVER span's context as an OpenTelemetry [`Context`], for what runs under the
    /// request off its path (a signal's write in the controlplane continues its trace).
    pub fn context(&self) -> Context {
        let base = self.baggage.clone().unwrap_or_default();
        base.with_remote_span_context(self.server.context().clone())
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
        self.server.context().is_sampled()
    }

    /// Whether prompts and answers go on the spans.
    pub fn captures_content(&self) -> bool {
        self.tracing.captures_content()
    }

    /// Attributes known once the request is attributed.
    pub fn attribute(&self, agent: Option<&str>, env: Option<&str>) {
        self.server.update(|span| {
            if let Some(a) = agent {
                span.str("nm.agent", a);
            }
            if let Some(e) = env {
                span.str("nm.env", e);
            }
        });
    }

    /// The experiment and arm that served the request (`nm.experiment`, `nm.arm`), on the
    /// SERVER span and the upstream call's CLIENT span.
    pub fn variant(&self, experiment: &str, arm: &str) {
        let set = |span: &mut span::Open| {
            span.str("nm.experiment", experiment);
            span.str("nm.arm", arm);
        };
        self.server.update(set);
        if let Some(client) = &self.client {
            client.update(set);
        }
    }

    /// Attributes of a `POST /v1/signal`.
    pub fn signal(&self, action: &'static str, agent: Option<&str>) {
        self.server.update(|span| {
            span.str("nm.signal.action", action);
            if let Some(a) = agent {
                span.str("nm.agent", a);
            }
        });
    }

    /// Links the SERVER span to other traces' spans (a signal's to its session's requests).
    pub fn link(&self, spans: &[nm_types::record::TraceRef]) {
        self.server.update(|span| {
            for t in spans {
                span.link(
                    SpanContext::new(
                        TraceId::from_bytes(t.trace_id),
                        SpanId::from_bytes(t.span_id),
                        TraceFlags::SAMPLED,
                        true,
                        TraceState::default(),
                    ),
                    Vec::new(),
                );
            }
        });
    }

    /// Sets the SERVER span's outcome from the answer's status; an error class for a 5xx
    /// (`error_type` when the gateway made the error, else the status code).
    pub fn respond(&self, status: u16, error_type: Option<&'static str>) {
        self.server.update(|span| {
            span.int("http.response.status_code", i64::from(status));
            if status >= 500 {
                match error_type {
                    Some(e) => span.str("error.type", e),
                    None => span.str("error.type", &status.to_string()),
                }
                span.status(Status::error(""));
            }
        });
    }

    /// Marks the SERVER span with the gateway's error code (its 5xx status is set with the
    /// answer).
    pub fn gateway_error(&self, code: &'static str, status: u16) {
        if status >= 500 {
            self.server.update(|span| span.str("error.type", code));
        }
    }

    /// Opens the CLIENT span of the upstream call.
    pub fn call(&mut self, call: &Call<'_>) {
        let span = self.tracing.inner.tracer.start(
            Some(self.server.context()),
            SpanKind::Client,
            CLIENT_ATTRIBUTE_BYTES,
        );
        span.update(|span| self.client_attributes(span, call));
        self.client = Some(span);
    }

    /// The CLIENT span's name and first attributes.
    fn client_attributes(&self, span: &mut span::Open, call: &Call<'_>) {
        let operation = operation_name(call.provider.format, call.native_path);
        let name: Cow<'static, str> = match (operation, call.model) {
            (Some(op), Some(model)) => Cow::Owned(joined(op, model)),
            (Some(op), None) => Cow::Borrowed(op),
            (None, _) => Cow::Borrowed(known_method(call.method)),
        };
        span.name(name);
        let provider = call.provider;
        if let Some(op) = operation {
            span.str("gen_ai.operation.name", op);
        }
        span.str("gen_ai.provider.name", &provider.system);
        if let Some(m) = call.model {
            span.str("gen_ai.request.model", m);
        }
        if let Some(t) = call.max_tokens {
            span.int(
                "gen_ai.request.max_tokens",
                i64::try_from(t).unwrap_or(i64::MAX),
            );
        }
        if let Some(s) = call.session {
            span.str("gen_ai.conversation.id", s);
        }
        span.str("http.request.method", known_method(call.method));
        span.str("server.address", &provider.server_address);
        span.int("server.port", i64::from(provider.server_port));
        if self.tracing.inner.capture_content {
            span.str("gen_ai.input.messages", &capped(call.body));
        }
    }

    /// Writes the CLIENT span's context into the upstream request, in place of the client's own
    /// (the formats `OTEL_PROPAGATORS` names; with none, the client's headers pass untouched).
    pub fn inject(&self, headers: &mut HeaderMap) {
        let Some(client) = &self.client else {
            return;
        };
        let inner = &self.tracing.inner;
        let sc = client.context();
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
        if let (Some(propagator), Some(cx)) = (&inner.baggage, &self.baggage) {
            propagator.inject_context(cx, &mut HeaderInjector(headers));
        }
    }

    /// Ends the CLIENT span of a call that got no answer (refused, timed out, unreachable).
    pub fn call_failed(&mut self, error_type: &'static str) {
        if let Some(span) = self.client.take() {
            span.update(|span| {
                span.str("error.type", error_type);
                span.status(Status::error(""));
            });
            span.end();
        }
    }

    /// The answer's head arrived.
    pub fn answered(&self, status: u16, streamed: bool) {
        if let Some(span) = &self.client {
            span.update(|span| {
                span.int("http.response.status_code", i64::from(status));
                span.bool("gen_ai.request.stream", streamed);
            });
        }
    }

    /// Ends both spans at the answer's end, with what the answer reported.
    pub fn end(self, end: &End<'_>) {
        if !self.server.is_recording() {
            // Nothing to say on spans that are not recorded; ending them is all.
            if let Some(span) = &self.client {
                span.end_at(end.at);
            }
            self.server.end_at(end.at);
            return;
        }
        let error_type = match end.outcome {
            Outcome::Complete if end.status >= 400 => Some(Cow::Owned(end.status.to_string())),
            Outcome::Complete => None,
            Outcome::UpstreamAborted => Some(Cow::Borrowed("upstream_aborted")),
            Outcome::ClientDisconnected => Some(Cow::Borrowed("client_disconnected")),
        };
        if let Some(client) = &self.client {
            client.update(|span| client_end(span, end, error_type.as_ref()));
            client.end_at(end.at);
        }
        if end.outcome != Outcome::Complete {
            // The answer the client saw was cut short: an error whatever its status said.
            self.server.update(|span| {
                if let Some(e) = &error_type {
                    span.str("error.type", e);
                }
                span.status(Status::error(""));
            });
        }
        self.server.end_at(end.at);
    }
}

/// The CLIENT span's last attributes: the answer's usage, cost and ending.
fn client_end(span: &mut span::Open, end: &End<'_>, error_type: Option<&Cow<'static, str>>) {
    let u = end.usage;
    if let Some(m) = &u.model {
        span.str("gen_ai.response.model", m);
    }
    if let Some(id) = &u.response_id {
        span.str("gen_ai.response.id", id);
    }
    if let Some(r) = &u.finish_reason {
        span.strs("gen_ai.response.finish_reasons", &[r.as_str()]);
    }
    let mut count = |key: &'static str, n: Option<u64>| {
        if let Some(n) = n {
            span.int(key, i64::try_from(n).unwrap_or(i64::MAX));
        }
    };
    count("gen_ai.usage.input_tokens", u.input_tokens);
    count("gen_ai.usage.output_tokens", u.output_tokens);
    count(
        "gen_ai.usage.cache_read.input_tokens",
        u.cached_input_tokens,
    );
    count(
        "gen_ai.usage.cache_creation.input_tokens",
        u.cache_write_tokens,
    );
    count("gen_ai.usage.reasoning.output_tokens", u.reasoning_tokens);
    if let Some(c) = end.cost_micros {
        span.float("nm.cost.usd", c as f64 / 1e6);
    }
    if end.streamed
        && let Some(t) = end.time_to_first_chunk
    {
        span.float("gen_ai.response.time_to_first_chunk", t.as_secs_f64());
    }
    if let Some(e) = error_type {
        span.str("error.type", e);
    }
    if let Some(output) = end.output {
        span.str("gen_ai.output.messages", &capped(output));
    }
    if error_type.is_some() {
        span.status(Status::error(""));
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
    // Hex digits are ASCII: the check is one pass over 32 bytes, nothing is replaced.
    std::str::from_utf8(&out)
        .map(str::to_owned)
        .unwrap_or_default()
}

/// A span id as 16 lower-case hex digits.
pub fn span_hex(id: opentelemetry::trace::SpanId) -> String {
    let mut out = [0u8; 16];
    hex_into(&id.to_bytes(), &mut out);
    std::str::from_utf8(&out)
        .map(str::to_owned)
        .unwrap_or_default()
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
