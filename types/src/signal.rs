//! The end-user signal, as both halves speak it: what `POST /v1/signal` said, with the request's
//! id, key and time. The one shape from the dataplane's edge to the controlplane's `signals`
//! table (the link maps it to and from `nm.link.v1.Signal`, [`crate::link`]), and its caps,
//! declared once: the dataplane refuses a body over them with a contract code, the controlplane
//! re-checks every signal with [`Signal::check`] whatever adapter brought it.
//!
//! A signal names a session, an answer (the `NM-Request-Id` of a proxied request: it then counts
//! for that request alone) or both; at least one. Both ids are parsed where the signal enters
//! (the HTTP body, a link message): a [`SessionId`] or [`RequestId`] here is valid by
//! construction.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::{Action, SessionId, TIME_RANGE_MS, parse_agent};

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

/// What a `request_id` must look like: the gateway's own `NM-Request-Id` values only.
pub const REQUEST_ID_RULE: &str = "request_id must be an NM-Request-Id value: a UUIDv7 in \
     lowercase hyphenated form (36 characters, e.g. 01890a5d-ac96-774b-bcce-b302099a8057)";

/// The id of a proxied request (its `NM-Request-Id`): a UUIDv7 the gateway made, in canonical
/// form (lowercase hex, hyphens at 8, 13, 18 and 23, version 7, RFC 9562 variant). Anything else
/// is refused: a signal naming it could only name nothing. Held inline (its 36 bytes), so making
/// one costs no allocation: every implicit signal names one.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(RequestIdBytes);

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RequestId").field(&self.as_str()).finish()
    }
}

impl RequestId {
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// Whether `s` is a request id in the form the gateway writes it.
    pub fn is_valid(s: &str) -> bool {
        let Ok(b) = <&[u8; 36]>::try_from(s.as_bytes()) else {
            return false;
        };
        // Lowercase hex everywhere, then the four dashes over it: one pass without early exits.
        let hex = b.iter().fold(true, |ok, c| {
            ok & (c.is_ascii_digit() | (b'a'..=b'f').contains(c) | (*c == b'-'))
        });
        hex & (b[8] == b'-')
            & (b[13] == b'-')
            & (b[18] == b'-')
            & (b[23] == b'-')
            & (b.iter().filter(|&&c| c == b'-').count() == 4)
            & (b[14] == b'7')
            & matches!(b[19], b'8' | b'9' | b'a' | b'b')
    }
}

/// The 36 bytes of a [`RequestId`]'s canonical form (ASCII, in the order of the text), `Copy`:
/// what the implicit rules' memory holds many of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestIdBytes([u8; 36]);

impl RequestIdBytes {
    /// `s` as bytes, if it is a request id.
    pub fn parse(s: &str) -> Option<Self> {
        let bytes = <[u8; 36]>::try_from(s.as_bytes()).ok()?;
        RequestId::is_valid(s).then_some(Self(bytes))
    }

    pub fn as_str(&self) -> &str {
        // Checked to be ASCII when made.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }

    pub fn to_id(self) -> RequestId {
        RequestId(self)
    }
}

impl FromStr for RequestId {
    type Err = &'static str;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RequestIdBytes::parse(s).map(Self).ok_or(REQUEST_ID_RULE)
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rule by which the gateway infers a signal from what it saw itself (an *implicit* signal,
/// stored with `source = implicit` and the rule's name; what an application sends is
/// *explicit*). The dataplane applies the rules; the signal rides with the record of the request
/// that revealed it ([`crate::record::Inferred`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    /// The client left before a streamed answer ended: that answer was `abandoned`.
    ClientDisconnect,
    /// The session asked the same conversation again: the earlier answer was `regenerated`.
    Reask,
    /// The session's next request carried the answer back changed: `edited`, with the distance.
    HistoryEdit,
    /// The session's next request carried the answer back unchanged: a neutral event, counted
    /// as `accepted` only where the operator says so.
    Continued,
}

impl Rule {
    pub const ALL: [Rule; 4] = [
        Rule::ClientDisconnect,
        Rule::Reask,
        Rule::HistoryEdit,
        Rule::Continued,
    ];

    /// The rule's name, as stored, shown and configured.
    pub const fn name(self) -> &'static str {
        match self {
            Rule::ClientDisconnect => "client_disconnect",
            Rule::Reask => "reask",
            Rule::HistoryEdit => "history_edit",
            Rule::Continued => "continued",
        }
    }

    /// The action a signal of this rule records.
    pub const fn action(self) -> Action {
        match self {
            Rule::ClientDisconnect => Action::Abandoned,
            Rule::Reask => Action::Regenerated,
            Rule::HistoryEdit => Action::Edited,
            Rule::Continued => Action::Accepted,
        }
    }
}

impl FromStr for Rule {
    type Err = &'static str;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Rule::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or("rule must be client_disconnect, reask, history_edit or continued")
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What an end user did with an output, as the dataplane received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signal {
    /// The signal's id: the `NM-Request-Id` of the signal request.
    pub id: String,
    /// When the dataplane received it (Unix milliseconds).
    pub received_at_ms: i64,
    /// The session, when the client named it (else learnt from the request's record).
    pub session_id: Option<SessionId>,
    /// The answer the signal is about, when the client named it: the signal then counts for
    /// that request's model, provider and env alone.
    pub request_id: Option<RequestId>,
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
        if s.session_id.is_none() && s.request_id.is_none() {
            return Err("session_id or request_id is required");
        }
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
            session_id: "sess_1".parse().ok(),
            request_id: None,
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
        let broken: [(Signal, &str); 11] = [
            (
                Signal {
                    session_id: None,
                    ..signal()
                },
                "session_id or request_id",
            ),
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
        let by_request = Signal {
            session_id: None,
            request_id: "01890a5d-ac96-774b-bcce-b302099a8057".parse().ok(),
            ..signal()
        };
        assert_eq!(by_request.check(), Ok(()));
    }

    #[test]
    fn request_ids_are_the_gateways_own() {
        let made = uuid::Uuid::now_v7().hyphenated().to_string();
        assert!(RequestId::is_valid(&made), "{made}");
        assert!(RequestId::is_valid("01890a5d-ac96-774b-bcce-b302099a8057"));
        for bad in [
            "",
            "req_1",
            "01890A5D-AC96-774B-BCCE-B302099A8057",
            "01890a5d-ac96-474b-bcce-b302099a8057",
            "01890a5d-ac96-774b-0cce-b302099a8057",
            "01890a5dac96774bbcceb302099a8057",
            "{01890a5d-ac96-774b-bcce-b302099a8057}",
            "01890a5d-ac96-774b-bcce-b302099a8057 ",
            "01890a5d-ac96-774b-bcce-b302099a805g",
            "01890a5d_ac96-774b-bcce-b302099a8057",
            "01890a5d-ac96-774b-bcce-b302099a80570",
            "0189\u{e9}5d-ac96-774b-bcce-b302099a805",
        ] {
            assert_eq!(bad.parse::<RequestId>(), Err(REQUEST_ID_RULE), "{bad:?}");
        }
    }

    proptest::proptest! {
        /// Whatever passes is exactly a canonical UUIDv7 (uuid's parser agrees, and writes it
        /// back the same), so a stored request id is always one the gateway could have made.
        #[test]
        fn what_passes_is_a_canonical_uuid_v7(s in "[0-9a-fA-F-]{30,40}|.{0,40}") {
            if let Ok(id) = s.parse::<RequestId>() {
                let u = uuid::Uuid::parse_str(id.as_str());
                proptest::prop_assert!(u.is_ok());
                let u = u.unwrap_or_default();
                proptest::prop_assert_eq!(u.get_version_num(), 7);
                proptest::prop_assert_eq!(u.hyphenated().to_string(), s);
            }
        }

        #[test]
        fn every_uuid_v7_passes(bytes in proptest::array::uniform16(proptest::num::u8::ANY)) {
            let u = uuid::Builder::from_random_bytes(bytes)
                .with_version(uuid::Version::SortRand)
                .into_uuid();
            proptest::prop_assert!(RequestId::is_valid(&u.hyphenated().to_string()));
        }
    }
}
