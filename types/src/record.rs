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

use crate::{Env, SessionId, Usage, UsageStatus, parse_agent, parse_user};

/// Longest request id (a UUIDv7 is 36).
pub const MAX_REQUEST_ID_LEN: usize = 64;
/// Longest key id, provider name, error code or finish reason.
pub const MAX_NAME_LEN: usize = 64;
/// Longest HTTP method.
pub const MAX_METHOD_LEN: usize = 16;
/// Longest native path kept in a record; [`shorten_path`] shortens longer ones.
pub const MAX_PATH_LEN: usize = 2048;
/// Longest model name (requested or answered).
pub const MAX_MODEL_LEN: usize = 256;
/// Most tokens of any kind one request may report.
pub const MAX_TOKENS: u64 = 1_000_000_000;
/// Largest cost or budget charge of one request, in micro-dollars ($1,000,000).
pub const MAX_MICROS: u64 = 1_000_000_000_000;
/// Longest latency or time to first byte (a week, in milliseconds).
pub const MAX_DURATION_MS: u64 = 7 * 24 * 3_600_000;
/// Most response bytes one request may report (1 PiB).
pub const MAX_RESPONSE_BYTES: u64 = 1 << 50;
/// Times (Unix milliseconds) a record or signal may carry: from 1970 to the start of 2100. A
/// tighter window around the controlplane's clock would refuse spooled records of a dataplane
/// whose clock was wrong, for no gain: a time only places a record in reports.
pub const TIME_RANGE_MS: std::ops::Range<i64> = 0..4_102_444_800_000;

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

fn text_ok(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && !s.chars().any(char::is_control)
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
        if r.path.len() > MAX_PATH_LEN || r.path.chars().any(char::is_control) {
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
        if let Some(a) = &r.agent {
            parse_agent(a).map_err(|_| "agent must be 1 to 128 printable characters")?;
        }
        if let Some(u) = &r.user_id {
            parse_user(u).map_err(|_| "user_id must be 1 to 256 printable characters")?;
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        ];
        for (r, field) in broken {
            let why = r.check().err().unwrap_or_default();
            assert!(why.contains(field), "{field}: {why:?}");
        }
    }
}
