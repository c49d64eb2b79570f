//! The request record: what the dataplane tells the controlplane about each proxied request.
//! One type, built once by the dataplane as the request goes on, queued, shipped, spooled and
//! stored as it is; the link's protobuf mapping (the root's `grpc::convert`) and the
//! controlplane's row writer (`nm_controlplane::records`) are its only translations.
//!
//! Adding a field: add it here, to `RequestRecord` in `proto/nm/link/v1/link.proto` and its one
//! mapping, to a migration and the row cells beside the column list; set it where the dataplane
//! learns it.
//!
//! The caps below are the rules every record must meet to be stored ([`RequestRecord::check`]):
//! the controlplane checks them on every record, whoever sent it (a dataplane is trusted to be
//! ours, not to be bug-free). They keep one record small, so a batch of them is cut by size far
//! below the link's message limit, and keep the sums the usage reports take far from
//! overflowing a 64-bit integer.

use std::borrow::Cow;
use std::sync::Arc;

use crate::experiment::Variant;
use crate::signal::{MAX_EDIT_DISTANCE, RequestId, Rule};
use crate::{
    Env, MAX_AGENT_LEN, MAX_USER_LEN, SessionId, Usage, UsageStatus, has_control, printable_ok,
    text_ok,
};

/// Longest request id (a UUIDv7 is 36).
pub const MAX_REQUEST_ID_LEN: usize = 64;
/// Longest HTTP method.
pub const MAX_METHOD_LEN: usize = 16;
/// Longest native path kept in a record; [`shorten_path`] shortens longer ones.
pub const MAX_PATH_LEN: usize = 2048;
/// Most tokens of any kind one request may report.
pub const MAX_TOKENS: u64 = 1_000_000_000;
/// Largest cost or budget charge of one request, in micro-dollars ($1,000,000).
pub const MAX_MICROS: u64 = 1_000_000_000_000;
/// Longest latency or time to first byte (a week, in milliseconds).
pub const MAX_DURATION_MS: u64 = 7 * 24 * 3_600_000;
/// Most response bytes one request may report (1 PiB).
pub const MAX_RESPONSE_BYTES: u64 = 1 << 50;
pub use crate::{MAX_MODEL_LEN, MAX_NAME_LEN, TIME_RANGE_MS};
/// Most implicit signals one record may carry (one per rule).
pub const MAX_INFERRED: usize = Rule::ALL.len();

/// One proxied request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestRecord {
    /// The `NM-Request-Id` the client received.
    pub request_id: String,
    pub started_at_ms: i64,
    /// Id of the service key that authenticated the request.
    pub key_id: Arc<str>,
    /// Provider name as configured (aliases resolved).
    pub provider: Arc<str>,
    /// A standard method is held without an allocation.
    pub method: Cow<'static, str>,
    /// Native path without the query string (queries may carry credentials).
    pub path: String,
    /// Model named by the request body or path.
    pub model: Option<String>,
    pub agent: Option<String>,
    pub session_id: Option<SessionId>,
    pub env: Option<Env>,
    pub user_id: Option<String>,
    /// HTTP status returned to the client (the upstream's, or the gateway's own error).
    pub status: u16,
    /// From the request's arrival until its response body ended.
    pub latency_ms: u64,
    /// From arrival until the first response body byte, when one was sent.
    pub ttfb_ms: Option<u64>,
    /// Whether the answer was an event stream.
    pub streamed: bool,
    /// Gateway error code, or `client_disconnected` / `upstream_body_error`.
    pub error_code: Option<Cow<'static, str>>,
    /// Bytes of the response body delivered to the client.
    pub response_bytes: u64,
    /// Tokens, answered model and finish reason, as the provider reported them.
    pub usage: Usage,
    pub usage_status: UsageStatus,
    /// Cost in micro-dollars, when the usage and the model's price are known.
    pub cost_micros: Option<u64>,
    /// What the request counted against its end user's budget (None: not budgeted).
    pub budget_micros: Option<u64>,
    /// The request's exported span (its CLIENT span, else its SERVER span), when it was traced
    /// and sampled: the batch that ships the record links to it, and the controlplane keeps the
    /// trace id.
    pub trace: Option<TraceRef>,
    /// Implicit signals this request revealed (usually none): each judges one answer, this
    /// request's own (`client_disconnect`) or an earlier one of its session. Stored as signals
    /// with `source = implicit` when the record is stored, once, like the record.
    pub inferred: Vec<Inferred>,
    /// The experiment arm that served the request, when it was in an experiment.
    pub variant: Option<Variant>,
}

/// An implicit signal: what a rule inferred about one answer, carried by the record of the
/// request that revealed it. Its time, key, session and agent are that record's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inferred {
    pub rule: Rule,
    /// The answer judged (its `NM-Request-Id`).
    pub answer: RequestId,
    /// Characters changed between the answer and what came back (`history_edit` only).
    pub edit_distance: Option<u64>,
}

/// A span of an OpenTelemetry trace: the W3C trace id and span id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceRef {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
}

impl TraceRef {
    /// The trace id as 32 lower-case hex digits (the W3C and OTLP/JSON spelling).
    pub fn trace_hex(&self) -> String {
        self.trace_digits().as_str().to_owned()
    }

    /// The span id as 16 lower-case hex digits.
    pub fn span_hex(&self) -> String {
        self.span_digits().as_str().to_owned()
    }

    /// The trace id's hex digits, on the stack.
    pub fn trace_digits(&self) -> HexDigits<32> {
        HexDigits::of(&self.trace_id)
    }

    /// The span id's hex digits, on the stack.
    pub fn span_digits(&self) -> HexDigits<16> {
        HexDigits::of(&self.span_id)
    }

    /// Reads the hex spellings back; None unless both are lower-case hex of the right length
    /// and not all zero (an invalid id in W3C trace context).
    pub fn from_hex(trace_id: &str, span_id: &str) -> Option<Self> {
        let trace_id: [u8; 16] = unhex(trace_id)?;
        let span_id: [u8; 8] = unhex(span_id)?;
        (trace_id != [0; 16] && span_id != [0; 8]).then_some(Self { trace_id, span_id })
    }
}

/// The `N` lower-case hex digits of an `N / 2`-byte id, without a heap allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HexDigits<const N: usize>([u8; N]);

impl<const N: usize> HexDigits<N> {
    fn of(bytes: &[u8]) -> Self {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = [b'0'; N];
        for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
            pair[0] = DIGITS[usize::from(b >> 4)];
            pair[1] = DIGITS[usize::from(b & 0xf)];
        }
        Self(out)
    }

    pub fn as_str(&self) -> &str {
        // Hex digits are ASCII.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let bytes = s.as_bytes();
    if bytes.len() != N * 2 {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        out[i] = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(out)
}

/// Shortens a path longer than [`MAX_PATH_LEN`] on a character boundary, ending it with `...`,
/// so the record of a request with a huge path still meets the rules.
pub fn shorten_path(path: &mut String) {
    const MARK: &str = "...";
    if path.len() <= MAX_PATH_LEN {
        return;
    }
    let mut end = MAX_PATH_LEN - MARK.len();
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    path.truncate(end);
    path.push_str(MARK);
}

impl RequestRecord {
    /// The rule this record breaks, if any (the message names the field, never the value).
    pub fn check(&self) -> Result<(), &'static str> {
        let r = self;
        if !text_ok(&r.request_id, MAX_REQUEST_ID_LEN) {
            return Err("request_id must be 1 to 64 printable characters");
        }
        if !TIME_RANGE_MS.contains(&r.started_at_ms) {
            return Err("started_at must be between 1970 and 2100");
        }
        if !text_ok(&r.key_id, MAX_NAME_LEN) {
            return Err("key_id must be 1 to 64 printable characters");
        }
        if !text_ok(&r.provider, MAX_NAME_LEN) {
            return Err("provider must be 1 to 64 printable characters");
        }
        if r.method.is_empty()
            || r.method.len() > MAX_METHOD_LEN
            || !r
                .method
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err("method must be an HTTP method of at most 16 characters");
        }
        if r.path.len() > MAX_PATH_LEN || has_control(&r.path) {
            return Err("path must be at most 2048 bytes, without control characters");
        }
        for model in [&r.model, &r.usage.model].into_iter().flatten() {
            if !text_ok(model, MAX_MODEL_LEN) {
                return Err("model must be 1 to 256 printable characters");
            }
        }
        let names = [r.error_code.as_deref(), r.usage.finish_reason.as_deref()];
        if names
            .into_iter()
            .flatten()
            .any(|n| !text_ok(n, MAX_NAME_LEN))
        {
            return Err("error_code and finish_reason must be 1 to 64 printable characters");
        }
        // What `parse_agent` and `parse_user` accept, without their owned copies.
        if r.agent
            .as_deref()
            .is_some_and(|a| !printable_ok(a, MAX_AGENT_LEN))
        {
            return Err("agent must be 1 to 128 printable characters");
        }
        if r.user_id
            .as_deref()
            .is_some_and(|u| !printable_ok(u, MAX_USER_LEN))
        {
            return Err("user_id must be 1 to 256 printable characters");
        }
        if r.status > 999 {
            return Err("status must be at most 999");
        }
        if r.latency_ms > MAX_DURATION_MS || r.ttfb_ms.is_some_and(|t| t > MAX_DURATION_MS) {
            return Err("latency_ms and ttfb_ms must be at most a week");
        }
        if r.response_bytes > MAX_RESPONSE_BYTES {
            return Err("response_bytes must be at most 2^50");
        }
        let u = &r.usage;
        let tokens = [
            u.input_tokens,
            u.output_tokens,
            u.cached_input_tokens,
            u.cache_write_tokens,
            u.reasoning_tokens,
        ];
        if tokens.into_iter().flatten().any(|t| t > MAX_TOKENS) {
            return Err("token counts must be at most 10^9");
        }
        if [r.cost_micros, r.budget_micros]
            .into_iter()
            .flatten()
            .any(|m| m > MAX_MICROS)
        {
            return Err("cost_micros and budget_micros must be at most 10^12");
        }
        if r.inferred.len() > MAX_INFERRED {
            return Err("a record carries at most one inferred signal per rule");
        }
        for (i, s) in r.inferred.iter().enumerate() {
            if r.inferred[..i].iter().any(|o| o.rule == s.rule) {
                return Err("a record carries at most one inferred signal per rule");
            }
            if (s.rule == Rule::HistoryEdit) != s.edit_distance.is_some() {
                return Err("edit_distance comes with history_edit, and only with it");
            }
            if s.edit_distance.is_some_and(|d| d > MAX_EDIT_DISTANCE) {
                return Err("edit_distance must be at most 10^9");
            }
        }
        if let Some(v) = &r.variant {
            v.check()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_refs_read_back_only_valid_lower_case_hex() {
        let t = TraceRef {
            trace_id: *b"\x4b\xf9\x2f\x35\x77\xb3\x4d\xa6\xa3\xce\x92\x9d\x0e\x0e\x47\x36",
            span_id: *b"\x00\xf0\x67\xaa\x0b\xa9\x02\xb7",
        };
        assert_eq!(t.trace_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.span_hex(), "00f067aa0ba902b7");
        assert_eq!(TraceRef::from_hex(&t.trace_hex(), &t.span_hex()), Some(t));
        for (trace, span) in [
            ("4BF92F3577B34DA6A3CE929D0E0E4736", "00f067aa0ba902b7"),
            ("4bf92f3577b34da6a3ce929d0e0e473", "00f067aa0ba902b7"),
            ("00000000000000000000000000000000", "00f067aa0ba902b7"),
            ("4bf92f3577b34da6a3ce929d0e0e4736", "0000000000000000"),
            ("4bf92f3577b34da6a3ce929d0e0e473g", "00f067aa0ba902b7"),
        ] {
            assert_eq!(TraceRef::from_hex(trace, span), None, "{trace} {span}");
        }
    }

    fn record() -> RequestRecord {
        RequestRecord {
            request_id: "r".to_owned(),
            started_at_ms: 1,
            key_id: Arc::from("key_1"),
            provider: Arc::from("openai"),
            method: Cow::Borrowed("POST"),
            path: "/v1/chat/completions".to_owned(),
            status: 200,
            ..Default::default()
        }
    }

    #[test]
    fn long_paths_are_shortened_on_a_character_boundary() {
        let mut short = "/v1/chat".to_owned();
        shorten_path(&mut short);
        assert_eq!(short, "/v1/chat");
        for filler in ["a", "é", "🌍"] {
            let mut long = format!("/{}", filler.repeat(MAX_PATH_LEN));
            shorten_path(&mut long);
            assert!(
                long.len() <= MAX_PATH_LEN && long.ends_with("..."),
                "{filler}"
            );
            assert_eq!(
                RequestRecord {
                    path: long,
                    ..record()
                }
                .check(),
                Ok(())
            );
        }
    }

    fn inferred(rule: Rule, edit_distance: Option<u64>) -> Inferred {
        Inferred {
            rule,
            answer: "01890a5d-ac96-774b-bcce-b302099a8057".parse().unwrap(),
            edit_distance,
        }
    }

    #[test]
    fn every_cap_is_checked_and_its_limit_accepted() {
        assert_eq!(record().check(), Ok(()));
        let at_limits = RequestRecord {
            cost_micros: Some(MAX_MICROS),
            budget_micros: Some(MAX_MICROS),
            latency_ms: MAX_DURATION_MS,
            response_bytes: MAX_RESPONSE_BYTES,
            usage: Usage {
                input_tokens: Some(MAX_TOKENS),
                ..Usage::default()
            },
            inferred: Rule::ALL
                .into_iter()
                .map(|r| inferred(r, (r == Rule::HistoryEdit).then_some(MAX_EDIT_DISTANCE)))
                .collect(),
            ..record()
        };
        assert_eq!(at_limits.check(), Ok(()));
        let broken: Vec<(RequestRecord, &str)> = vec![
            (
                RequestRecord {
                    cost_micros: Some(u64::MAX),
                    ..record()
                },
                "cost_micros",
            ),
            (
                RequestRecord {
                    budget_micros: Some(MAX_MICROS + 1),
                    ..record()
                },
                "budget_micros",
            ),
            (
                RequestRecord {
                    usage: Usage {
                        reasoning_tokens: Some(MAX_TOKENS + 1),
                        ..Usage::default()
                    },
                    ..record()
                },
                "token",
            ),
            (
                RequestRecord {
                    path: "/".repeat(MAX_PATH_LEN + 1),
                    ..record()
                },
                "path",
            ),
            (
                RequestRecord {
                    path: "/a\nb".to_owned(),
                    ..record()
                },
                "path",
            ),
            (
                RequestRecord {
                    model: Some("m".repeat(MAX_MODEL_LEN + 1)),
                    ..record()
                },
                "model",
            ),
            (
                RequestRecord {
                    agent: Some("x".repeat(500)),
                    ..record()
                },
                "agent",
            ),
            (
                RequestRecord {
                    user_id: Some(String::new()),
                    ..record()
                },
                "user_id",
            ),
            (
                RequestRecord {
                    latency_ms: u64::MAX,
                    ..record()
                },
                "latency",
            ),
            (
                RequestRecord {
                    ttfb_ms: Some(MAX_DURATION_MS + 1),
                    ..record()
                },
                "ttfb",
            ),
            (
                RequestRecord {
                    started_at_ms: -1,
                    ..record()
                },
                "started_at",
            ),
            (
                RequestRecord {
                    started_at_ms: i64::MAX,
                    ..record()
                },
                "started_at",
            ),
            (
                RequestRecord {
                    status: 1000,
                    ..record()
                },
                "status",
            ),
            (
                RequestRecord {
                    method: Cow::Borrowed("GET /x"),
                    ..record()
                },
                "method",
            ),
            (
                RequestRecord {
                    key_id: Arc::from(""),
                    ..record()
                },
                "key_id",
            ),
            (
                RequestRecord {
                    provider: Arc::from("p".repeat(65)),
                    ..record()
                },
                "provider",
            ),
            (
                RequestRecord {
                    request_id: "r".repeat(65),
                    ..record()
                },
                "request_id",
            ),
            (
                RequestRecord {
                    response_bytes: u64::MAX,
                    ..record()
                },
                "response_bytes",
            ),
            (
                RequestRecord {
                    error_code: Some(Cow::Borrowed("e\n")),
                    ..record()
                },
                "error_code",
            ),
            (
                RequestRecord {
                    inferred: vec![inferred(Rule::Reask, None), inferred(Rule::Reask, None)],
                    ..record()
                },
                "one inferred signal per rule",
            ),
            (
                RequestRecord {
                    inferred: vec![inferred(Rule::HistoryEdit, None)],
                    ..record()
                },
                "edit_distance comes with history_edit",
            ),
            (
                RequestRecord {
                    inferred: vec![inferred(Rule::Continued, Some(1))],
                    ..record()
                },
                "edit_distance comes with history_edit",
            ),
            (
                RequestRecord {
                    inferred: vec![inferred(Rule::HistoryEdit, Some(MAX_EDIT_DISTANCE + 1))],
                    ..record()
                },
                "edit_distance must be at most",
            ),
        ];
        for (r, field) in broken {
            let why = r.check().err().unwrap_or_default();
            assert!(why.contains(field), "{field}: {why:?}");
        }
    }
}
