//! The end-user signal, as both halves speak it: what `POST /v1/signal` said, with the request's
//! id, key and time. The one shape from the dataplane's edge to the controlplane's `signals`
//! table (the link maps it to and from `nm.link.v1.Signal`, [`crate::link`]), and its caps,
//! declared once: the dataplane refuses a body over them with a contract code, the controlplane
//! re-checks every signal with [`Signal::check`] whatever adapter brought it.
//!
//! The session id is parsed where the signal enters (the HTTP body, a link message): a
//! [`SessionId`] here is valid by construction.

use std::sync::Arc;

use crate::record::TIME_RANGE_MS;
use crate::{Action, SessionId, parse_agent};

/// Longest signal id (the `NM-Request-Id` of the signal request).
pub const MAX_SIGNAL_ID_LEN: usize = 64;
/// Longest key id a signal may name.
pub const MAX_KEY_ID_LEN: usize = 64;
/// Largest `custom_label`, as serialized JSON.
pub const MAX_CUSTOM_LABEL_BYTES: usize = 1024;
/// Longest `Idempotency-Key`.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;
/// Largest `edit_distance` (characters).
pub const MAX_EDIT_DISTANCE: u64 = 1_000_000_000;

/// What an end user did with an output, as the dataplane received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signal {
    /// The signal's id: the `NM-Request-Id` of the signal request.
    pub id: String,
    /// When the dataplane received it (Unix milliseconds).
    pub received_at_ms: i64,
    pub session_id: SessionId,
    pub action: Action,
    pub edit_distance: Option<u64>,
    /// `custom_label` as the exact JSON text the client sent.
    pub custom_label: Option<String>,
    /// The service key the signal was sent with.
    pub key_id: Arc<str>,
    pub idempotency_key: Option<String>,
    /// The `NM-Agent` header, used while the session is not known yet.
    pub agent_hint: Option<String>,
}

impl Signal {
    /// The rule this signal breaks, if any (the message names the field, never the value).
    pub fn check(&self) -> Result<(), &'static str> {
        let s = self;
        if s.id.is_empty() || s.id.len() > MAX_SIGNAL_ID_LEN {
            return Err("signal id must be 1 to 64 characters");
        }
        if s.key_id.is_empty()
            || s.key_id.len() > MAX_KEY_ID_LEN
            || s.key_id.chars().any(char::is_control)
        {
            return Err("key_id must be 1 to 64 printable characters");
        }
        if !TIME_RANGE_MS.contains(&s.received_at_ms) {
            return Err("received_at must be between 1970 and 2100");
        }
        if s.action == Action::Edited && s.edit_distance.is_none() {
            return Err("edit_distance is required when action is edited");
        }
        if s.edit_distance.is_some_and(|d| d > MAX_EDIT_DISTANCE) {
            return Err("edit_distance must be at most 10^9");
        }
        if let Some(label) = &s.custom_label
            && (label.len() > MAX_CUSTOM_LABEL_BYTES
                || serde_json::from_str::<serde::de::IgnoredAny>(label).is_err())
        {
            return Err("custom_label must be JSON of at most 1024 bytes");
        }
        if let Some(k) = &s.idempotency_key
            && (k.is_empty() || k.len() > MAX_IDEMPOTENCY_KEY_LEN)
        {
            return Err("idempotency key must be 1 to 255 characters");
        }
        if let Some(h) = &s.agent_hint
            && parse_agent(h).is_err()
        {
            return Err("agent name must be 1 to 128 printable characters");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signal() -> Signal {
        Signal {
            id: "req_1".to_owned(),
            received_at_ms: 1_700_000_000_000,
            session_id: "sess_1".parse().unwrap_or_else(|e| panic!("{e}")),
            action: Action::Accepted,
            edit_distance: None,
            custom_label: None,
            key_id: "key_1".into(),
            idempotency_key: None,
            agent_hint: None,
        }
    }

    #[test]
    fn each_cap_is_checked_at_its_edge() {
        assert_eq!(signal().check(), Ok(()));
        let at_caps = Signal {
            id: "i".repeat(MAX_SIGNAL_ID_LEN),
            key_id: "k".repeat(MAX_KEY_ID_LEN).into(),
            action: Action::Edited,
            edit_distance: Some(MAX_EDIT_DISTANCE),
            custom_label: Some(format!("\"{}\"", "x".repeat(MAX_CUSTOM_LABEL_BYTES - 2))),
            idempotency_key: Some("k".repeat(MAX_IDEMPOTENCY_KEY_LEN)),
            agent_hint: Some("a".repeat(crate::MAX_AGENT_LEN)),
            ..signal()
        };
        assert_eq!(at_caps.check(), Ok(()));
        let broken: [(Signal, &str); 10] = [
            (
                Signal {
                    id: "i".repeat(MAX_SIGNAL_ID_LEN + 1),
                    ..signal()
                },
                "signal id",
            ),
            (
                Signal {
                    key_id: "key\n".into(),
                    ..signal()
                },
                "key_id",
            ),
            (
                Signal {
                    received_at_ms: -1,
                    ..signal()
                },
                "received_at",
            ),
            (
                Signal {
                    action: Action::Edited,
                    ..signal()
                },
                "edit_distance is required",
            ),
            (
                Signal {
                    edit_distance: Some(MAX_EDIT_DISTANCE + 1),
                    ..signal()
                },
                "edit_distance must",
            ),
            (
                Signal {
                    custom_label: Some("{".to_owned()),
                    ..signal()
                },
                "custom_label",
            ),
            (
                Signal {
                    custom_label: Some(format!("\"{}\"", "x".repeat(MAX_CUSTOM_LABEL_BYTES))),
                    ..signal()
                },
                "custom_label",
            ),
            (
                Signal {
                    idempotency_key: Some(String::new()),
                    ..signal()
                },
                "idempotency key",
            ),
            (
                Signal {
                    idempotency_key: Some("k".repeat(MAX_IDEMPOTENCY_KEY_LEN + 1)),
                    ..signal()
                },
                "idempotency key",
            ),
            (
                Signal {
                    agent_hint: Some("a".repeat(crate::MAX_AGENT_LEN + 1)),
                    ..signal()
                },
                "agent name",
            ),
        ];
        for (s, rule) in broken {
            let got = s.check();
            assert!(got.is_err_and(|m| m.starts_with(rule)), "{rule}: {got:?}");
        }
    }
}
