//! Prometheus metrics of the dataplane, served at `GET /metrics` (OpenMetrics text, no key, like
//! `/health`): what a record's journey lost and why, the spool's backlog, budget refusals, and
//! the request path's latencies and token counts.
//!
//! Two kinds of names:
//! - `nm_*`: ours. Labels are closed sets of our own codes, never user input.
//! - The OpenTelemetry semantic conventions' metrics under their Prometheus names (dots to
//!   underscores, the unit `s` as `_seconds`, `{token}` dropped): `gen_ai_client_token_usage`,
//!   `gen_ai_client_operation_duration_seconds`,
//!   `gen_ai_client_operation_time_to_first_chunk_seconds` (GenAI client metrics, with the
//!   GenAI conventions' bucket boundaries; the last is defined in semantic-conventions-genai, for
//!   streams only) and `http_server_request_duration_seconds` (the stable HTTP conventions'
//!   buckets). A conditionally required attribute that does not apply (no model known, no
//!   error) is an absent label, as OpenTelemetry's Prometheus exporters write it; PromQL's
//!   `error_type=""` selects successes.
//!
//! What keeps the series count bounded, since model, provider and error names reach us from
//! requests, upstream answers and configuration:
//! - No label ever holds an end user, session, key or request id.
//! - Model names: at most [`LABEL_CAP`] distinct values per metric family, first come first
//!   kept (request and response models count together; one cap per label serves every family
//!   with it); later ones, and names that are too long or hold control characters, become
//!   `_other`. Providers (`gen_ai_provider_name`, also on `nm_gateway_overhead_seconds`) and
//!   error types have the same cap (error types fall back to `_OTHER`, the conventions' value).
//!   Each replacement counts in `nm_metric_label_overflow_total{label}`.
//! - HTTP methods: the conventions' known methods, anything else `_OTHER`; routes are templates
//!   (`&'static str`), status codes numbers.
//!
//! The duration histograms carry the request's trace id as an OpenMetrics exemplar when it was
//! sampled, so a slow bucket links to a trace. The new families are declared (`# TYPE`) before
//! their first series.
//!
//! The request path calls [`Metrics::operation`], [`Metrics::gateway_overhead`] and
//! [`Metrics::http_server`] once per request: for label values already seen they take read locks
//! and bump reference counts, and allocate nothing.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use prometheus_client::encoding::{
    EncodeLabelKey, EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelSetEncoder, MetricEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::exemplar::HistogramWithExemplars;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// `gen_ai.client.token.usage`'s bucket boundaries (powers of 4 from 1 to 4^13).
pub const TOKEN_BUCKETS: [f64; 14] = [
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];

/// `gen_ai.client.operation.duration`'s and `.time_to_first_chunk`'s bucket boundaries, seconds
/// (10 ms doubling to 81.92 s).
pub const GEN_AI_SECONDS_BUCKETS: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];

/// `http.server.request.duration`'s bucket boundaries, seconds.
pub const HTTP_SERVER_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];

/// `nm_gateway_overhead_seconds`' bucket boundaries: the gateway's own time is tens of
/// microseconds to a few milliseconds, far below the conventions' 5 ms first bucket.
pub const OVERHEAD_BUCKETS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5,
];

/// Distinct values a capped label keeps per metric family.
pub const LABEL_CAP: usize = 64;

/// A capped label value longer than this (bytes) is replaced: no real model name is this long.
pub const MAX_LABEL_VALUE_LEN: usize = 128;

/// The replacement for models and providers past the cap.
pub const OTHER: &str = "_other";

/// The replacement for unknown HTTP methods and error types past the cap (the conventions').
pub const OTHER_UPPER: &str = "_OTHER";

/// One GenAI operation as the request path saw it, for [`Metrics::operation`]. Attribute names
/// in the comments are the semantic conventions'.
#[derive(Debug, Clone, Copy, Default)]
pub struct Operation<'a> {
    /// `gen_ai.operation.name`: `chat`, `text_completion`, `embeddings`, `generate_content`, ..
    pub operation: &'static str,
    /// `gen_ai.provider.name`.
    pub provider: &'a str,
    /// `gen_ai.request.model`, when the request named one.
    pub request_model: Option<&'a str>,
    /// `gen_ai.response.model`, when the answer named one.
    pub response_model: Option<&'a str>,
    /// `error.type`: `None` on success.
    pub error_type: Option<&'a str>,
    /// From the request's arrival to the end of the answer.
    pub duration: Duration,
    /// Streams only: from the request's arrival to the first chunk of the answer.
    pub time_to_first_chunk: Option<Duration>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    /// The request's trace id (32 lower-case hex digits) when it was sampled: the exemplar.
    pub trace_id: Option<&'a str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabel {
    rule: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LabelName {
    label: &'static str,
}

/// The labels every GenAI family shares. Absent values are absent labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct GenAiLabels {
    operation: &'static str,
    provider: Arc<str>,
    request_model: Option<Arc<str>>,
    response_model: Option<Arc<str>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct TokenLabels {
    gen_ai: GenAiLabels,
    token_type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct DurationLabels {
    gen_ai: GenAiLabels,
    error_type: Option<Arc<str>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct ProviderLabels {
    provider: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    http_request_method: &'static str,
    http_route: &'static str,
    http_response_status_code: u16,
}

/// An exemplar's only label, `trace_id`: 32 lower-case hex digits, held inline.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct TraceExemplar([u8; 32]);

impl TraceExemplar {
    /// `Some` for a W3C trace id: 32 lower-case hex digits, not all zero.
    fn parse(id: &str) -> Option<Self> {
        let bytes: [u8; 32] = id.as_bytes().try_into().ok()?;
        // Folds without early exits, so the checks compile to a few vector instructions (this
        // runs twice on every traced request).
        let hex = bytes.iter().fold(true, |ok, b| {
            ok & (b.is_ascii_digit() | (b'a'..=b'f').contains(b))
        });
        let nonzero = bytes.iter().fold(false, |nz, b| nz | (*b != b'0'));
        (hex & nonzero).then_some(Self(bytes))
    }
}

/// Writes one `key="value"` label.
fn label(encoder: &mut LabelSetEncoder, key: &str, value: &str) -> Result<(), std::fmt::Error> {
    let mut label = encoder.encode_label();
    let mut key_encoder = label.encode_label_key()?;
    EncodeLabelKey::encode(&key, &mut key_encoder)?;
    let mut value_encoder = key_encoder.encode_label_value()?;
    EncodeLabelValue::encode(&value, &mut value_encoder)?;
    value_encoder.finish()
}

impl EncodeLabelSet for GenAiLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        label(encoder, "gen_ai_operation_name", self.operation)?;
        label(encoder, "gen_ai_provider_name", &self.provider)?;
        if let Some(model) = &self.request_model {
            label(encoder, "gen_ai_request_model", model)?;
        }
        if let Some(model) = &self.response_model {
            label(encoder, "gen_ai_response_model", model)?;
        }
        Ok(())
    }
}

impl EncodeLabelSet for TokenLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        self.gen_ai.encode(encoder)?;
        label(encoder, "gen_ai_token_type", self.token_type)
    }
}

impl EncodeLabelSet for DurationLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        self.gen_ai.encode(encoder)?;
        match &self.error_type {
            Some(error) => label(encoder, "error_type", error),
            None => Ok(()),
        }
    }
}

impl EncodeLabelSet for ProviderLabels {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        label(encoder, "gen_ai_provider_name", &self.provider)
    }
}

impl EncodeLabelSet for TraceExemplar {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        match std::str::from_utf8(&self.0) {
            Ok(id) => label(encoder, "trace_id", id),
            Err(_) => Ok(()),
        }
    }
}

/// The conventions' known HTTP methods (RFC 9110, PATCH, QUERY), case-sensitive; else `_OTHER`.
fn method_label(method: &http::Method) -> &'static str {
    match method.as_str() {
        "CONNECT" => "CONNECT",
        "DELETE" => "DELETE",
        "GET" => "GET",
        "HEAD" => "HEAD",
        "OPTIONS" => "OPTIONS",
        "PATCH" => "PATCH",
        "POST" => "POST",
        "PUT" => "PUT",
        "QUERY" => "QUERY",
        "TRACE" => "TRACE",
        _ => OTHER_UPPER,
    }
}

/// A metric whose `# HELP`, `# TYPE` (and `# UNIT`) lines are written before its first series
/// too (prometheus-client skips empty families), so scrapers and dashboards know the family
/// from the start. OpenMetrics allows a family without samples.
#[derive(Debug)]
struct Declared<M>(M);

impl<M: EncodeMetric> EncodeMetric for Declared<M> {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }

    fn is_empty(&self) -> bool {
        false
    }
}

// === impl Cap ===

/// The values one label of one family may take: the first [`LABEL_CAP`] acceptable ones seen,
/// shared as `Arc<str>` so a lookup of a known value allocates nothing.
#[derive(Debug)]
struct Cap {
    /// The overflow counter's `label` value.
    name: &'static str,
    other: Arc<str>,
    kept: RwLock<HashSet<Arc<str>, foldhash::fast::RandomState>>,
}

impl Cap {
    fn new(name: &'static str, other: &'static str) -> Self {
        Self {
            name,
            other: Arc::from(other),
            kept: RwLock::default(),
        }
    }

    /// `value` itself if kept or if there is room, else the replacement, counted in `overflow`.
    fn admit(&self, value: &str, overflow: &Family<LabelName, Counter>) -> Arc<str> {
        if let Ok(kept) = self.kept.read()
            && let Some(v) = kept.get(value)
        {
            return v.clone();
        }
        if acceptable(value)
            && let Ok(mut kept) = self.kept.write()
        {
            if let Some(v) = kept.get(value) {
                return v.clone();
            }
            if kept.len() < LABEL_CAP {
                let v: Arc<str> = Arc::from(value);
                kept.insert(v.clone());
                return v;
            }
        }
        overflow
            .get_or_create(&LabelName { label: self.name })
            .inc();
        self.other.clone()
    }
}

/// A label value worth keeping: short, printable, not one of our replacements.
fn acceptable(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= MAX_LABEL_VALUE_LEN
        && !value.chars().any(char::is_control)
        && value != OTHER
        && value != OTHER_UPPER
}

/// Cheap to clone; every clone updates the same metrics.
#[derive(Debug, Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    records_dropped: Family<Reason, Counter>,
    records_dead_lettered: Counter,
    alert_deliveries: Family<Outcome, Counter>,
    budget_refusals: Family<Reason, Counter>,
    spool_records: Gauge,
    spool_bytes: Gauge,
    budget_rules: Gauge,
    implicit_signals: Family<RuleLabel, Counter>,
    /// Each rule's series of `implicit_signals`, once it has one (a lookup by label hashes it).
    implicit_by_rule: [std::sync::OnceLock<Counter>; 4],
    implicit_memory_bytes: Gauge,
    implicit_memory_evicted: Family<Reason, Counter>,
    connections_closed: Family<Reason, Counter>,
    records_lost_in_crash: Counter,
    records_journal_replayed: Counter,
    otel_spans_dropped: Family<Reason, Counter>,
    log_lines_dropped: Counter,
    label_overflow: Family<LabelName, Counter>,
    gateway_overhead: Family<ProviderLabels, Histogram>,
    token_usage: Family<TokenLabels, Histogram>,
    operation_duration: Family<DurationLabels, HistogramWithExemplars<TraceExemplar>>,
    time_to_first_chunk: Family<GenAiLabels, Histogram>,
    http_server_duration: Family<HttpLabels, HistogramWithExemplars<TraceExemplar>>,
    caps: Caps,
    /// The series of each operation label set seen, found once ([`Metrics::operation`]).
    series: RwLock<SeriesCache>,
    /// The same for the gateway overhead (by provider as given) and the HTTP server duration
    /// (by method, route and status: closed sets).
    overhead_series:
        RwLock<std::collections::HashMap<Box<str>, Histogram, foldhash::fast::RandomState>>,
    http_series: RwLock<HttpCache>,
}

type HttpCache = std::collections::HashMap<
    (&'static str, &'static str, u16),
    HistogramWithExemplars<TraceExemplar>,
    foldhash::fast::RandomState,
>;

/// Most label sets whose series [`Metrics::operation`] remembers; beyond it, each call finds
/// its series in the families (slower, same result).
const MAX_CACHED_SERIES: usize = 4096;

/// An operation's labels as given, owned: the key of its cached series.
#[derive(Debug, PartialEq, Eq)]
struct OpKey {
    operation: &'static str,
    provider: Box<str>,
    request_model: Option<Box<str>>,
    response_model: Option<Box<str>>,
    error_type: Option<Box<str>>,
}

impl OpKey {
    fn of(op: &Operation<'_>) -> Self {
        Self {
            operation: op.operation,
            provider: op.provider.into(),
            request_model: op.request_model.map(Into::into),
            response_model: op.response_model.map(Into::into),
            error_type: op.error_type.map(Into::into),
        }
    }

    fn matches(&self, op: &Operation<'_>) -> bool {
        self.operation == op.operation
            && *self.provider == *op.provider
            && self.request_model.as_deref() == op.request_model
            && self.response_model.as_deref() == op.response_model
            && self.error_type.as_deref() == op.error_type
    }
}

/// The series one operation label set feeds, each taken from its family when first needed
/// (a non-streamed operation never creates a time-to-first-chunk series).
#[derive(Debug)]
struct OpSeries {
    gen_ai: GenAiLabels,
    duration: HistogramWithExemplars<TraceExemplar>,
    time_to_first_chunk: std::sync::OnceLock<Histogram>,
    input_tokens: std::sync::OnceLock<Histogram>,
    output_tokens: std::sync::OnceLock<Histogram>,
}

/// Series by a hash of their labels as given (collisions kept side by side).
#[derive(Debug, Default)]
struct SeriesCache {
    by_hash:
        std::collections::HashMap<u64, Vec<(OpKey, Arc<OpSeries>)>, foldhash::fast::RandomState>,
    len: usize,
}

/// The capped labels. One cap serves every family with that label, so each family sees at
/// most [`LABEL_CAP`] values of it, and one call admits each value once.
#[derive(Debug)]
struct Caps {
    /// `gen_ai_provider_name`, in the GenAI families and `nm_gateway_overhead_seconds`.
    provider: Cap,
    /// `gen_ai_request_model` and `gen_ai_response_model` together.
    model: Cap,
    /// `error_type` of `gen_ai_client_operation_duration_seconds`.
    error_type: Cap,
}

impl Default for Metrics {
    fn default() -> Self {
        // The semantic conventions' families go at the root, ours under `nm_`.
        let mut root = Registry::default();
        let registry = root.sub_registry_with_prefix("nm");
        let records_dropped = Family::<Reason, Counter>::default();
        registry.register(
            "records_dropped",
            "Request records lost before reaching the controlplane, by reason (queue_full, spool_full, spool_error, spool_undecodable)",
            records_dropped.clone(),
        );
        let records_dead_lettered = Counter::default();
        registry.register(
            "records_dead_lettered",
            "Request records the controlplane refused for good (invalid data), set aside in the dead-letter file beside the spool",
            records_dead_lettered.clone(),
        );
        let alert_deliveries = Family::<Outcome, Counter>::default();
        registry.register(
            "alert_deliveries",
            "Tries of alert deliveries to webhooks by the controlplane of this process (serve), by outcome (delivered, retried, failed)",
            alert_deliveries.clone(),
        );
        let budget_refusals = Family::<Reason, Counter>::default();
        registry.register(
            "budget_refusals",
            "Requests refused with 429 budget_exceeded (spend) or rate_limited (rate), by reason",
            budget_refusals.clone(),
        );
        let spool_records = Gauge::default();
        registry.register(
            "spool_records",
            "Request records waiting in the on-disk spool for the controlplane",
            spool_records.clone(),
        );
        let spool_bytes = Gauge::default();
        registry.register(
            "spool_bytes",
            "Bytes of the on-disk record spool",
            spool_bytes.clone(),
        );
        let budget_rules = Gauge::default();
        registry.register(
            "budget_rules",
            "End-user budget rules (default and overrides) this dataplane enforces, as last received",
            budget_rules.clone(),
        );
        let connections_closed = Family::<Reason, Counter>::default();
        registry.register(
            "connections_closed",
            "Client connections the gateway closed itself, by reason (header_timeout: no request head in time; idle_timeout: no request in flight for the header timeout after serving some; shed: idle the longest when the connection cap was reached; refused: at the cap with none idle)",
            connections_closed.clone(),
        );
        let records_lost_in_crash = Counter::default();
        registry.register(
            "records_lost_in_crash",
            "Request records the previous run of this dataplane had accepted and neither delivered nor spooled when it died (NM_RECORD_DURABILITY=memory), learned at start",
            records_lost_in_crash.clone(),
        );
        let records_journal_replayed = Counter::default();
        registry.register(
            "records_journal_replayed",
            "Request records a previous run journaled (NM_RECORD_DURABILITY=spool) and had not shipped when it ended (a crash, or a shipper stopped first), replayed at start",
            records_journal_replayed.clone(),
        );
        let otel_spans_dropped = Family::<Reason, Counter>::default();
        registry.register(
            "otel_spans_dropped",
            "Trace spans this dataplane made and never exported, by reason (e.g. queue_full: the exporter's queue was full; export_failed: the collector refused or did not answer)",
            Declared(otel_spans_dropped.clone()),
        );
        let log_lines_dropped = Counter::default();
        registry.register(
            "log_lines_dropped",
            "Log lines (access lines and others) this process dropped: its log output's queue was full (a stalled or slow stderr), or writing to stderr failed",
            log_lines_dropped.clone(),
        );
        let implicit_signals = Family::<RuleLabel, Counter>::default();
        registry.register(
            "implicit_signals",
            "Implicit signals this dataplane inferred and put on request records, by rule (client_disconnect, reask, history_edit, continued)",
            Declared(implicit_signals.clone()),
        );
        let implicit_memory_bytes = Gauge::default();
        registry.register(
            "implicit_memory_bytes",
            "Bytes the implicit rules' memory holds (conversation hashes; the last answers' first characters while history_edit is on), as counted against NM_IMPLICIT_MEMORY_BYTES",
            implicit_memory_bytes.clone(),
        );
        let implicit_memory_evicted = Family::<Reason, Counter>::default();
        registry.register(
            "implicit_memory_evicted",
            "Sessions the implicit rules forgot, by reason (cap: the oldest, over NM_IMPLICIT_MEMORY_BYTES; expired: untouched for NM_IMPLICIT_MEMORY_SECS)",
            Declared(implicit_memory_evicted.clone()),
        );
        let label_overflow = Family::<LabelName, Counter>::default();
        registry.register(
            "metric_label_overflow",
            "Observations whose label value was replaced by _other/_OTHER: past the per-family cap of distinct values (64), too long, or not printable; by label",
            Declared(label_overflow.clone()),
        );
        let gateway_overhead = Family::<ProviderLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(OVERHEAD_BUCKETS)
        });
        registry.register_with_unit(
            "gateway_overhead",
            "Time a proxied request spent in the gateway itself: its whole duration less the wait on the upstream, by provider",
            Unit::Seconds,
            Declared(gateway_overhead.clone()),
        );

        let token_usage = Family::<TokenLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(TOKEN_BUCKETS)
        });
        root.register(
            "gen_ai_client_token_usage",
            "Number of input and output tokens used (OpenTelemetry gen_ai.client.token.usage, unit {token})",
            Declared(token_usage.clone()),
        );
        let operation_duration =
            Family::<DurationLabels, HistogramWithExemplars<TraceExemplar>>::new_with_constructor(
                || HistogramWithExemplars::new(GEN_AI_SECONDS_BUCKETS.into_iter()),
            );
        root.register_with_unit(
            "gen_ai_client_operation_duration",
            "GenAI operation duration (OpenTelemetry gen_ai.client.operation.duration): from the request's arrival to the end of the answer, streams included",
            Unit::Seconds,
            Declared(operation_duration.clone()),
        );
        let time_to_first_chunk = Family::<GenAiLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(GEN_AI_SECONDS_BUCKETS)
        });
        root.register_with_unit(
            "gen_ai_client_operation_time_to_first_chunk",
            "Time to receive the first chunk of a streamed answer, from the request's arrival (OpenTelemetry gen_ai.client.operation.time_to_first_chunk); streams only",
            Unit::Seconds,
            Declared(time_to_first_chunk.clone()),
        );
        let http_server_duration =
            Family::<HttpLabels, HistogramWithExemplars<TraceExemplar>>::new_with_constructor(
                || HistogramWithExemplars::new(HTTP_SERVER_BUCKETS.into_iter()),
            );
        root.register_with_unit(
            "http_server_request_duration",
            "Duration of HTTP server requests (OpenTelemetry http.server.request.duration)",
            Unit::Seconds,
            Declared(http_server_duration.clone()),
        );
        Self {
            inner: Arc::new(Inner {
                otel_spans_dropped,
                log_lines_dropped,
                label_overflow,
                gateway_overhead,
                token_usage,
                operation_duration,
                time_to_first_chunk,
                http_server_duration,
                caps: Caps {
                    provider: Cap::new("gen_ai_provider_name", OTHER),
                    model: Cap::new("gen_ai_model", OTHER),
                    error_type: Cap::new("error_type", OTHER_UPPER),
                },
                series: RwLock::default(),
                overhead_series: RwLock::default(),
                http_series: RwLock::default(),
                registry: root,
                records_lost_in_crash,
                records_journal_replayed,
                connections_closed,
                records_dropped,
                records_dead_lettered,
                alert_deliveries,
                budget_refusals,
                spool_records,
                spool_bytes,
                budget_rules,
                implicit_signals,
                implicit_by_rule: Default::default(),
                implicit_memory_bytes,
                implicit_memory_evicted,
            }),
        }
    }
}

impl Metrics {
    pub fn records_dropped(&self, reason: &'static str, n: u64) {
        self.inner
            .records_dropped
            .get_or_create(&Reason { reason })
            .inc_by(n);
    }

    /// An implicit signal put on a record ([`crate::implicit`]).
    pub fn implicit_inferred(&self, rule: nm_types::signal::Rule) {
        let i = &self.inner;
        let index = nm_types::signal::Rule::ALL
            .iter()
            .position(|r| *r == rule)
            .unwrap_or_default();
        i.implicit_by_rule[index]
            .get_or_init(|| {
                i.implicit_signals
                    .get_or_create(&RuleLabel { rule: rule.name() })
                    .clone()
            })
            .inc();
    }

    /// The implicit rules' memory changed a session's size from `before` to `after` bytes.
    pub fn implicit_memory_changed(&self, before: usize, after: usize) {
        let gauge = &self.inner.implicit_memory_bytes;
        if after >= before {
            gauge.inc_by(i64::try_from(after - before).unwrap_or(i64::MAX));
        } else {
            gauge.dec_by(i64::try_from(before - after).unwrap_or(i64::MAX));
        }
    }

    /// A session the implicit rules' memory forgot (`cap` or `expired`).
    pub fn implicit_evicted(&self, reason: &'static str) {
        self.inner
            .implicit_memory_evicted
            .get_or_create(&Reason { reason })
            .inc();
    }

    pub fn records_dead_lettered(&self, n: u64) {
        self.inner.records_dead_lettered.inc_by(n);
    }

    /// One try of an alert delivery ended: `delivered`, `retried` (to be tried again) or
    /// `failed` (given up).
    pub fn alert_delivery(&self, outcome: &'static str) {
        self.inner
            .alert_deliveries
            .get_or_create(&Outcome { outcome })
            .inc();
    }

    pub fn budget_refused(&self, reason: &'static str) {
        self.inner
            .budget_refusals
            .get_or_create(&Reason { reason })
            .inc();
    }

    pub fn set_spool(&self, records: u64, bytes: u64) {
        self.inner
            .spool_records
            .set(i64::try_from(records).unwrap_or(i64::MAX));
        self.inner
            .spool_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    pub fn set_budget_rules(&self, rules: usize) {
        self.inner
            .budget_rules
            .set(i64::try_from(rules).unwrap_or(i64::MAX));
    }

    /// Records a crash of the previous run lost (see [`crate::journal`]).
    pub fn records_lost_in_crash(&self, n: u64) {
        self.inner.records_lost_in_crash.inc_by(n);
    }

    /// Records a previous run left in the journal, replayed.
    pub fn records_journal_replayed(&self, n: u64) {
        self.inner.records_journal_replayed.inc_by(n);
    }

    /// A client connection closed by the gateway (see [`crate::conns`]).
    pub fn connection_closed(&self, reason: &'static str) {
        self.inner
            .connections_closed
            .get_or_create(&Reason { reason })
            .inc();
    }

    /// Trace spans lost before export (see the exporter's `reason`s).
    pub fn otel_spans_dropped(&self, reason: &'static str, n: u64) {
        self.inner
            .otel_spans_dropped
            .get_or_create(&Reason { reason })
            .inc_by(n);
    }

    /// Brings the count of dropped log lines up to `total`, the log output's own count
    /// ([`crate::log::LogLines::dropped`]), read when the metrics are served.
    pub fn log_lines_dropped_to(&self, total: u64) {
        let counter = &self.inner.log_lines_dropped;
        counter.inc_by(total.saturating_sub(counter.get()));
    }

    /// One GenAI operation: its duration (with the trace id as exemplar), its time to first
    /// chunk when streamed, and its token counts when known.
    pub fn operation(&self, op: &Operation<'_>) {
        let series = self.series_of(op);
        if let Some(ttfc) = op.time_to_first_chunk {
            series
                .time_to_first_chunk
                .get_or_init(|| {
                    self.inner
                        .time_to_first_chunk
                        .get_or_create(&series.gen_ai)
                        .clone()
                })
                .observe(ttfc.as_secs_f64());
        }
        for (token_type, n, slot) in [
            ("input", op.input_tokens, &series.input_tokens),
            ("output", op.output_tokens, &series.output_tokens),
        ] {
            if let Some(n) = n {
                let labels = || TokenLabels {
                    gen_ai: series.gen_ai.clone(),
                    token_type,
                };
                // Exact below 2^53 tokens.
                slot.get_or_init(|| self.inner.token_usage.get_or_create(&labels()).clone())
                    .observe(n as f64);
            }
        }
        let exemplar = op.trace_id.and_then(TraceExemplar::parse);
        let timestamp = exemplar.as_ref().map(|_| SystemTime::now());
        series
            .duration
            .observe(op.duration.as_secs_f64(), exemplar, timestamp);
    }

    /// The series of `op`'s labels: remembered after the first call with the same labels (one
    /// hash and one shared lock, where finding them in the families takes a capped admission
    /// per label and a SipHash lookup per family).
    fn series_of(&self, op: &Operation<'_>) -> Arc<OpSeries> {
        use std::hash::BuildHasher;
        let inner = &*self.inner;
        let hash = {
            let cache = inner.series.read();
            let hash = cache.as_ref().map_or(0, |c| {
                c.by_hash.hasher().hash_one((
                    op.operation,
                    op.provider,
                    op.request_model,
                    op.response_model,
                    op.error_type,
                ))
            });
            if let Ok(cache) = cache
                && let Some(found) = cache
                    .by_hash
                    .get(&hash)
                    .and_then(|v| v.iter().find(|(k, _)| k.matches(op)))
            {
                return found.1.clone();
            }
            hash
        };
        let (series, replaced) = self.new_series(op);
        let series = Arc::new(series);
        // A label set with a replaced value is not remembered: each such call is counted.
        if !replaced
            && let Ok(mut cache) = inner.series.write()
            && cache.len < MAX_CACHED_SERIES
        {
            let slot = cache.by_hash.entry(hash).or_default();
            if let Some((_, found)) = slot.iter().find(|(k, _)| k.matches(op)) {
                return found.clone();
            }
            slot.push((OpKey::of(op), series.clone()));
            cache.len += 1;
        }
        series
    }

    /// Finds (or creates) the series of `op`'s labels in the families, the labels capped; true
    /// when a value was replaced (and counted as such).
    fn new_series(&self, op: &Operation<'_>) -> (OpSeries, bool) {
        let inner = &*self.inner;
        let (caps, overflow) = (&inner.caps, &inner.label_overflow);
        let gen_ai = GenAiLabels {
            operation: op.operation,
            provider: caps.provider.admit(op.provider, overflow),
            // An empty name is no name: an absent label, like `None`.
            request_model: op
                .request_model
                .filter(|m| !m.is_empty())
                .map(|m| caps.model.admit(m, overflow)),
            response_model: op
                .response_model
                .filter(|m| !m.is_empty())
                .map(|m| caps.model.admit(m, overflow)),
        };
        let labels = DurationLabels {
            gen_ai: gen_ai.clone(),
            error_type: op.error_type.map(|e| caps.error_type.admit(e, overflow)),
        };
        let replaced = Arc::ptr_eq(&gen_ai.provider, &caps.provider.other)
            || [&gen_ai.request_model, &gen_ai.response_model]
                .into_iter()
                .flatten()
                .any(|m| Arc::ptr_eq(m, &caps.model.other))
            || labels
                .error_type
                .as_ref()
                .is_some_and(|e| Arc::ptr_eq(e, &caps.error_type.other));
        let series = OpSeries {
            duration: inner.operation_duration.get_or_create(&labels).clone(),
            gen_ai,
            time_to_first_chunk: std::sync::OnceLock::new(),
            input_tokens: std::sync::OnceLock::new(),
            output_tokens: std::sync::OnceLock::new(),
        };
        (series, replaced)
    }

    /// The gateway's own share of a proxied request: its duration less the wait on the upstream.
    pub fn gateway_overhead(&self, provider: &str, overhead: Duration) {
        let inner = &*self.inner;
        let seconds = overhead.as_secs_f64();
        if let Ok(cache) = inner.overhead_series.read()
            && let Some(h) = cache.get(provider)
        {
            return h.observe(seconds);
        }
        let admitted = inner.caps.provider.admit(provider, &inner.label_overflow);
        let replaced = Arc::ptr_eq(&admitted, &inner.caps.provider.other);
        let labels = ProviderLabels { provider: admitted };
        let series = inner.gateway_overhead.get_or_create(&labels).clone();
        series.observe(seconds);
        // Only admitted names are remembered (a replaced one is counted at each call), and
        // never more than the cap allows.
        if !replaced
            && let Ok(mut cache) = inner.overhead_series.write()
            && cache.len() < LABEL_CAP
        {
            cache.insert(provider.into(), series);
        }
    }

    /// One HTTP request served, any route (`route` is the matched template).
    pub fn http_server(
        &self,
        method: &http::Method,
        route: &'static str,
        status: u16,
        duration: Duration,
        trace_id: Option<&str>,
    ) {
        let inner = &*self.inner;
        let key = (method_label(method), route, status);
        let exemplar = trace_id.and_then(TraceExemplar::parse);
        let timestamp = exemplar.as_ref().map(|_| SystemTime::now());
        let seconds = duration.as_secs_f64();
        if let Ok(cache) = inner.http_series.read()
            && let Some(h) = cache.get(&key)
        {
            return h.observe(seconds, exemplar, timestamp);
        }
        let labels = HttpLabels {
            http_request_method: key.0,
            http_route: key.1,
            http_response_status_code: key.2,
        };
        let series = inner.http_server_duration.get_or_create(&labels).clone();
        series.observe(seconds, exemplar, timestamp);
        if let Ok(mut cache) = inner.http_series.write()
            && cache.len() < MAX_CACHED_SERIES
        {
            cache.insert(key, series);
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.inner.registry);
        out
    }
}

#[cfg(test)]
#[path = "metrics_tests.rs"]
mod tests;
