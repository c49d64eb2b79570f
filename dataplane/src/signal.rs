//! `POST /v1/signal`: what an end user did with an output.
//!
//! The body is validated here, field by field, so every mistake gets its own contract code;
//! the signal is then handed to the controlplane through a [`SignalSink`] and the client hears
//! `{"ok": true}` only once the controlplane has committed it. If the controlplane cannot be
//! reached or its database fails, the answer is 503 `unavailable` with `Retry-After`, and nothing
//! was stored.
//!
//! A signal names a session (`session_id`), an answer (`request_id`, the answer's
//! `NM-Request-Id`: the signal then counts for that request alone), or both; one is required
//! (`missing_field`). A `request_id` must be the gateway's own form (a lowercase UUIDv7), else
//! `invalid_field`. Whether a request id belongs to the session named with it is decided by the
//! controlplane, which holds the records: 409 `session_mismatch`.
//!
//! Decisions where the contract is silent: unknown fields are refused (`invalid_field`), so a
//! typo such as `edit_distnace` cannot silently drop data; duplicate fields are refused too;
//! `edit_distance` may accompany any action but must always be a non-negative integer;
//! `custom_label` is kept as the exact JSON text sent (at most 1 KiB).
//!
//! [`SignalSink`]: crate::link::SignalSink

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, header};
use nm_types::signal::{
    MAX_CUSTOM_LABEL_BYTES, MAX_EDIT_DISTANCE, MAX_IDEMPOTENCY_KEY_LEN, REQUEST_ID_RULE, RequestId,
    Signal,
};
use nm_types::{Action, SessionId, parse_agent};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use crate::body::{GatewayBody, RequestBody};
use crate::edge;
use crate::error::ProxyError;
use crate::link::SubmitError;
use crate::log::Val;
use crate::state::State;
use opentelemetry::context::FutureExt as _;

/// Largest signal body.
pub const MAX_SIGNAL_BYTES: usize = 64 * 1024;

const FIELDS: [&str; 5] = [
    "session_id",
    "request_id",
    "action",
    "edit_distance",
    "custom_label",
];

/// What the gateway knows of a signal before its body is read: the request's id (the signal's
/// id), time, key and headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub id: String,
    pub received_at_ms: i64,
    pub key_id: Arc<str>,
    pub idempotency_key: Option<String>,
    pub agent_hint: Option<String>,
}

/// A refused body: the contract code and a message naming the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub code: &'static str,
    pub message: String,
}

/// An id field given as a JSON string (absent or null: None), or `bad` when it is not one.
fn optional_id<T: std::str::FromStr>(
    raw: Option<&RawValue>,
    bad: impl FnOnce() -> Invalid,
) -> Result<Option<T>, Invalid> {
    raw.map(|raw| {
        serde_json::from_str::<String>(raw.get())
            .ok()
            .and_then(|s| s.parse::<T>().ok())
            .ok_or_else(bad)
    })
    .transpose()
}

fn invalid(code: &'static str, message: impl Into<String>) -> Invalid {
    Invalid {
        code,
        message: message.into(),
    }
}

/// Validates a signal body (untrusted bytes): the signal of `head`.
pub fn parse_body(body: &[u8], head: Head) -> Result<Signal, Invalid> {
    let raw: &RawValue = serde_json::from_slice(body)
        .map_err(|e| invalid("invalid_json", format!("body is not valid JSON: {e}")))?;
    if !raw.get().starts_with('{') {
        return Err(invalid("invalid_json", "body must be a JSON object"));
    }
    let fields = parse_object(raw.get())?;
    if let Some((name, _)) = fields.iter().find(|(k, _)| !FIELDS.contains(&k.as_str())) {
        return Err(invalid(
            "invalid_field",
            format!("unknown field {name:?}; allowed: {}", FIELDS.join(", ")),
        ));
    }
    let get = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| *v)
            .filter(|v| v.get() != "null")
    };

    let session_id = optional_id::<SessionId>(get("session_id"), || {
        invalid(
            "invalid_session_id",
            nm_types::ParseError::SessionId.to_string(),
        )
    })?;
    let request_id = optional_id::<RequestId>(get("request_id"), || {
        invalid("invalid_field", REQUEST_ID_RULE)
    })?;
    if session_id.is_none() && request_id.is_none() {
        return Err(invalid(
            "missing_field",
            "session_id or request_id is required (the answer's NM-Request-Id names one answer)",
        ));
    }

    let action = get("action").ok_or_else(|| invalid("missing_field", "action is required"))?;
    let action = serde_json::from_str::<String>(action.get())
        .ok()
        .and_then(|s| s.parse::<Action>().ok())
        .ok_or_else(|| invalid("invalid_action", nm_types::ParseError::Action.to_string()))?;

    let edit_distance = match get("edit_distance") {
        None => None,
        Some(raw) => Some(
            non_negative_integer(raw.get())
                .filter(|d| *d <= MAX_EDIT_DISTANCE)
                .ok_or_else(|| {
                    invalid(
                        "invalid_edit_distance",
                        "edit_distance must be a non-negative integer of at most 10^9 (characters changed)",
                    )
                })?,
        ),
    };
    if action.requires_edit_distance() && edit_distance.is_none() {
        return Err(invalid(
            "edit_distance_required",
            format!(
                "edit_distance is required when action is {}",
                action.as_str()
            ),
        ));
    }

    let custom_label = get("custom_label").map(|raw| raw.get().to_owned());
    if custom_label
        .as_ref()
        .is_some_and(|l| l.len() > MAX_CUSTOM_LABEL_BYTES)
    {
        return Err(invalid(
            "invalid_field",
            format!("custom_label must be at most {MAX_CUSTOM_LABEL_BYTES} bytes of JSON"),
        ));
    }
    let Head {
        id,
        received_at_ms,
        key_id,
        idempotency_key,
        agent_hint,
    } = head;
    Ok(Signal {
        id,
        received_at_ms,
        session_id,
        request_id,
        action,
        edit_distance,
        custom_label,
        key_id,
        idempotency_key,
        agent_hint,
    })
}

/// A JSON integer literal >= 0 that fits u64: digits only (no sign, fraction or exponent).
fn non_negative_integer(raw: &str) -> Option<u64> {
    (!raw.is_empty() && raw.bytes().all(|b| b.is_ascii_digit()))
        .then(|| raw.parse().ok())
        .flatten()
}

/// Top-level fields of an object, in order, refusing duplicates.
fn parse_object(text: &str) -> Result<Vec<(String, &RawValue)>, Invalid> {
    struct Fields;
    impl<'de> Visitor<'de> for Fields {
        type Value = Vec<(String, &'de RawValue)>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out: Vec<(String, &'de RawValue)> = Vec::new();
            while let Some((k, v)) = map.next_entry::<String, &'de RawValue>()? {
                if out.iter().any(|(seen, _)| *seen == k) {
                    return Err(serde::de::Error::custom(format!("duplicate field {k:?}")));
                }
                out.push((k, v));
            }
            Ok(out)
        }
    }
    let mut de = serde_json::Deserializer::from_str(text);
    de.deserialize_map(Fields)
        .map_err(|e| invalid("invalid_field", e.to_string()))
}

/// Whether a `Content-Type` is JSON in UTF-8.
fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mut parts = ct.split(';').map(str::trim);
    let mime_ok = parts
        .next()
        .is_some_and(|m| m.eq_ignore_ascii_case("application/json"));
    let charset_ok = parts.all(|p| {
        p.split_once('=').is_none_or(|(k, v)| {
            !k.trim().eq_ignore_ascii_case("charset")
                || v.trim().trim_matches('"').eq_ignore_ascii_case("utf-8")
        })
    });
    mime_ok && charset_ok
}

/// Handles `POST /v1/signal`.
pub async fn handle(
    state: Arc<State>,
    mut req: Request<RequestBody>,
) -> Result<Response<GatewayBody>, ProxyError> {
    let received_at = SystemTime::now();
    let start = edge::take_start(&mut req);
    let (log, trace) = (start.log, start.trace);
    if req.method() != Method::POST {
        return Err(ProxyError::MethodNotAllowed(req.method().clone()));
    }
    let bad = |i: Invalid| ProxyError::InvalidSignal {
        code: i.code,
        message: i.message,
    };
    let principal = edge::take_principal(req.extensions_mut())?;
    log.know(|k| k.key_id = Some(principal.key_id.clone()));
    let id = edge::take_request_id(req.extensions_mut());
    let agent_hint = match header_str(req.headers(), "nm-agent")? {
        None => None,
        Some(a) => Some(
            parse_agent(a)
                .map_err(|e| bad(invalid("invalid_field", format!("NM-Agent header: {e}"))))?,
        ),
    };
    let idempotency_key = match header_str(req.headers(), "idempotency-key")? {
        None => None,
        Some(k) if !k.is_empty() && k.len() <= MAX_IDEMPOTENCY_KEY_LEN => Some(k.to_owned()),
        Some(_) => {
            return Err(bad(invalid(
                "invalid_field",
                format!(
                    "Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} visible ASCII characters"
                ),
            )));
        }
    };
    if !is_json(req.headers()) {
        return Err(ProxyError::UnsupportedMediaType);
    }
    let (parts, body) = req.into_parts();
    let body = edge::read_body(&parts.headers, body, MAX_SIGNAL_BYTES).await?;
    let head = Head {
        id,
        received_at_ms: crate::records::unix_ms(received_at),
        key_id: principal.key_id,
        idempotency_key,
        agent_hint,
    };
    let signal = parse_body(&body, head).map_err(bad)?;
    if let Some(session) = &signal.session_id {
        log.know(|k| k.session = Some(session.as_str().to_owned()));
    }
    let action = signal.action;
    if let Some(t) = &trace {
        t.signal(action.as_str(), signal.agent_hint.as_deref());
    }
    let submitted = state.signals.submit(signal);
    let submitted = match &trace {
        Some(t) => {
            // The controlplane's spans continue this request's trace.
            submitted.with_context(t.context()).await
        }
        None => submitted.await,
    };
    match submitted {
        Ok(spans) => {
            if let Some(t) = &trace {
                t.link(&spans);
            }
        }
        Err(SubmitError::Unavailable(why)) => return Err(ProxyError::Unavailable(why)),
        Err(SubmitError::Unconfirmed(why)) => return Err(ProxyError::Unconfirmed(why)),
        Err(SubmitError::Rejected(why)) => return Err(bad(invalid("invalid_field", why))),
        Err(SubmitError::SessionMismatch(why)) => return Err(ProxyError::SessionMismatch(why)),
    }
    log.know(|k| k.status = Some(200));
    if tracing::enabled!(tracing::Level::DEBUG) {
        let fields = [("action", Val::Bare(action.as_str()))];
        log.line(
            &state.access_log,
            tracing::Level::DEBUG,
            module_path!(),
            "signal stored",
            &fields,
        );
    }
    let mut resp = Response::new(GatewayBody::full(Bytes::from_static(br#"{"ok":true}"#)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

fn header_str<'a>(
    headers: &'a HeaderMap,
    name: &'static str,
) -> Result<Option<&'a str>, ProxyError> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim()))
            .map_err(|_| ProxyError::InvalidSignal {
                code: "invalid_field",
                message: format!("{name} header must be visible ASCII"),
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn head() -> Head {
        Head {
            id: "req_1".to_owned(),
            received_at_ms: 1_700_000_000_000,
            key_id: "key_1".into(),
            idempotency_key: None,
            agent_hint: None,
        }
    }

    fn code(body: &str) -> &'static str {
        match parse_body(body.as_bytes(), head()) {
            Ok(_) => "ok",
            Err(e) => e.code,
        }
    }

    #[test]
    fn every_action_and_the_edit_rule() {
        for a in Action::ALL {
            let body = format!(r#"{{"session_id":"sess_1","action":"{a}","edit_distance":3}}"#);
            assert_eq!(code(&body), "ok", "{a}");
        }
        assert_eq!(code(r#"{"session_id":"sess_1","action":"accepted"}"#), "ok");
        assert_eq!(
            code(
                r#"{"session_id":"sess_1","action":"accepted","edit_distance":null,"custom_label":null}"#
            ),
            "ok"
        );
        assert_eq!(
            code(r#"{"session_id":"sess_1","action":"edited"}"#),
            "edit_distance_required"
        );
        assert_eq!(
            code(r#"{"session_id":"sess_1","action":"edited","edit_distance":null}"#),
            "edit_distance_required"
        );
        assert_eq!(
            code(r#"{"session_id":"sess_1","action":"edited","edit_distance":0}"#),
            "ok"
        );
    }

    #[test]
    fn contract_codes() {
        let cases = [
            ("", "invalid_json"),
            ("{", "invalid_json"),
            ("[1]", "invalid_json"),
            ("\"x\"", "invalid_json"),
            (r#"{"action":"accepted"}"#, "missing_field"),
            (
                r#"{"session_id":null,"request_id":null,"action":"accepted"}"#,
                "missing_field",
            ),
            (
                r#"{"request_id":"01890a5d-ac96-774b-bcce-b302099a8057"}"#,
                "missing_field",
            ),
            (
                r#"{"request_id":"req_1","action":"accepted"}"#,
                "invalid_field",
            ),
            (
                r#"{"request_id":"01890A5D-AC96-774B-BCCE-B302099A8057","action":"accepted"}"#,
                "invalid_field",
            ),
            (r#"{"request_id":7,"action":"accepted"}"#, "invalid_field"),
            (
                r#"{"request_id":["01890a5d-ac96-774b-bcce-b302099a8057"],"action":"accepted"}"#,
                "invalid_field",
            ),
            (
                r#"{"session_id":"bad","request_id":"01890a5d-ac96-774b-bcce-b302099a8057","action":"accepted"}"#,
                "invalid_session_id",
            ),
            (r#"{"session_id":"sess_1"}"#, "missing_field"),
            (
                r#"{"session_id":null,"action":"accepted"}"#,
                "missing_field",
            ),
            (
                r#"{"session_id":"abc","action":"accepted"}"#,
                "invalid_session_id",
            ),
            (
                r#"{"session_id":42,"action":"accepted"}"#,
                "invalid_session_id",
            ),
            (
                r#"{"session_id":"sess_1","action":"liked"}"#,
                "invalid_action",
            ),
            (r#"{"session_id":"sess_1","action":7}"#, "invalid_action"),
            (
                r#"{"session_id":"sess_1","action":"Accepted"}"#,
                "invalid_action",
            ),
            (
                r#"{"session_id":"sess_1","action":"edited","edit_distance":-1}"#,
                "invalid_edit_distance",
            ),
            (
                r#"{"session_id":"sess_1","action":"edited","edit_distance":1.5}"#,
                "invalid_edit_distance",
            ),
            (
                r#"{"session_id":"sess_1","action":"edited","edit_distance":2.0}"#,
                "invalid_edit_distance",
            ),
            (
                r#"{"session_id":"sess_1","action":"edited","edit_distance":1e2}"#,
                "invalid_edit_distance",
            ),
            (
                r#"{"session_id":"sess_1","action":"edited","edit_distance":"3"}"#,
                "invalid_edit_distance",
            ),
            (
                r#"{"session_id":"sess_1","action":"edited","edit_distance":true}"#,
                "invalid_edit_distance",
            ),
            (
                r#"{"session_id":"sess_1","action":"edited","edit_distance":99999999999999999999999}"#,
                "invalid_edit_distance",
            ),
            (
                r#"{"session_id":"sess_1","action":"accepted","extra":1}"#,
                "invalid_field",
            ),
            (
                r#"{"session_id":"sess_1","action":"accepted","action":"sent"}"#,
                "invalid_field",
            ),
        ];
        for (body, want) in cases {
            assert_eq!(code(body), want, "{body}");
        }
        let big = format!(
            r#"{{"session_id":"sess_1","action":"sent","custom_label":"{}"}}"#,
            "x".repeat(1100)
        );
        assert_eq!(code(&big), "invalid_field");
    }

    #[test]
    fn a_signal_may_name_an_answer() {
        let id = "01890a5d-ac96-774b-bcce-b302099a8057";
        for body in [
            format!(r#"{{"request_id":"{id}","action":"accepted"}}"#),
            format!(r#"{{"session_id":null,"request_id":"{id}","action":"accepted"}}"#),
            format!(r#"{{"session_id":"sess_1","request_id":"{id}","action":"accepted"}}"#),
        ] {
            let s = parse_body(body.as_bytes(), head()).unwrap_or_else(|e| panic!("{e:?}"));
            assert_eq!(s.request_id.as_ref().map(RequestId::as_str), Some(id));
            assert_eq!(s.check(), Ok(()));
        }
        let s = parse_body(
            format!(r#"{{"session_id":"sess_1","request_id":"{id}","action":"sent"}}"#).as_bytes(),
            head(),
        );
        assert_eq!(
            s.ok()
                .and_then(|s| s.session_id)
                .map(|s| s.as_str().to_owned()),
            Some("sess_1".to_owned())
        );
        // The message says what is expected, never echoes the value.
        let got = parse_body(br#"{"request_id":"<script>","action":"accepted"}"#, head());
        assert!(got.is_err_and(|e| e.message == REQUEST_ID_RULE && !e.message.contains("script")));
    }

    #[test]
    fn custom_label_is_kept_as_sent() {
        let body =
            r#"{"custom_label": {"b":1, "a":[true, "ü"]} ,"session_id":"sess_1","action":"sent"}"#;
        let s = parse_body(body.as_bytes(), head()).ok();
        assert_eq!(
            s.and_then(|s| s.custom_label).as_deref(),
            Some(r#"{"b":1, "a":[true, "ü"]}"#)
        );
    }

    #[test]
    fn content_types() {
        let h = |v: &'static str| {
            let mut m = HeaderMap::new();
            m.insert(header::CONTENT_TYPE, HeaderValue::from_static(v));
            m
        };
        assert!(is_json(&h("application/json")));
        assert!(is_json(&h("Application/JSON; charset=UTF-8")));
        assert!(!is_json(&h("application/json; charset=latin1")));
        assert!(!is_json(&h("text/plain")));
        assert!(!is_json(&h("application/x-www-form-urlencoded")));
        assert!(!is_json(&HeaderMap::new()));
    }

    proptest! {
        /// Untrusted bytes never panic the parser, and whatever passes obeys every rule.
        #[test]
        fn arbitrary_bodies(body in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(s) = parse_body(&body, head()) {
                prop_assert!(s.action != Action::Edited || s.edit_distance.is_some());
            }
        }

        #[test]
        fn structured_bodies(
            sid in "(sess_[a-z0-9]{1,5}|[a-z]{1,5}|)",
            rid in proptest::option::of("(01890a5d-ac96-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}|[0-9a-fA-F-]{36}|x)"),
            action in "(accepted|edited|sent|nope)",
            ed in proptest::option::of(-5i64..5),
        ) {
            let mut body = format!(r#"{{"session_id":"{sid}","action":"{action}""#);
            if let Some(r) = &rid {
                body.push_str(&format!(r#","request_id":"{r}""#));
            }
            if let Some(d) = ed {
                body.push_str(&format!(r#","edit_distance":{d}"#));
            }
            body.push('}');
            let got = parse_body(body.as_bytes(), head());
            let rid_ok = rid.as_deref().is_none_or(RequestId::is_valid);
            let valid = sid.starts_with("sess_") && rid_ok && action != "nope" && ed.is_none_or(|d| d >= 0) && (action != "edited" || ed.is_some());
            prop_assert_eq!(got.is_ok(), valid, "{}", body);
            if let (Ok(s), Some(r)) = (&got, &rid) {
                prop_assert_eq!(s.request_id.as_ref().map(RequestId::as_str), Some(r.as_str()));
            }
        }
    }
}
