//! Value types that both halves of nm-gateway speak: the attribution headers (`NM-Session`,
//! `NM-Env`, `NM-Agent`, `NM-User`), signal actions, and the service-key hash.
//!
//! The dataplane parses these from untrusted headers and bodies; the controlplane stores them.
//! Keeping the parsers in one place means both sides accept exactly the same values.

#![forbid(unsafe_code)]

pub mod budget;
#[cfg(feature = "link")]
pub mod link;
pub mod money;
pub mod record;
pub mod signal;
pub mod throttle;

use std::fmt;
use std::str::FromStr;

use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Longest accepted `NM-Agent` value, in bytes.
pub const MAX_AGENT_LEN: usize = 128;
/// Longest accepted `NM-User` value, in bytes.
pub const MAX_USER_LEN: usize = 256;
/// Longest accepted `<id>` part of a `sess_<id>` session id, in bytes.
pub const MAX_SESSION_ID_LEN: usize = 128;

/// Why a value from a client was refused. The message names the rule, never the value, so it
/// is safe to return to the client and to log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error(
        "session id must look like sess_<id>, where <id> is 1 to {MAX_SESSION_ID_LEN} characters of A-Z, a-z, 0-9, '_' or '-'"
    )]
    SessionId,
    #[error("env must be one of production, staging, development")]
    Env,
    #[error("agent name must be 1 to {MAX_AGENT_LEN} printable characters")]
    Agent,
    #[error("user id must be 1 to {MAX_USER_LEN} printable characters")]
    User,
    #[error(
        "action must be one of accepted, edited, regenerated, abandoned, thumbs_up, thumbs_down, published, sent"
    )]
    Action,
}

// === impl SessionId ===

/// A session identifier of the form `sess_<id>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct SessionId(String);

impl SessionId {
    pub const PREFIX: &'static str = "sess_";

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for SessionId {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let id = s.strip_prefix(Self::PREFIX).ok_or(ParseError::SessionId)?;
        let valid = !id.is_empty()
            && id.len() <= MAX_SESSION_ID_LEN
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if valid {
            Ok(Self(s.to_owned()))
        } else {
            Err(ParseError::SessionId)
        }
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

// === impl Env ===

/// The deployment environment a request was made from (`NM-Env`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Env {
    Production,
    Staging,
    Development,
}

impl Env {
    pub const ALL: [Env; 3] = [Env::Production, Env::Staging, Env::Development];

    pub fn as_str(self) -> &'static str {
        match self {
            Env::Production => "production",
            Env::Staging => "staging",
            Env::Development => "development",
        }
    }
}

impl FromStr for Env {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Env::ALL
            .into_iter()
            .find(|e| e.as_str() == s)
            .ok_or(ParseError::Env)
    }
}

impl fmt::Display for Env {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// === impl Action ===

/// What an end user did with an output (`POST /v1/signal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Accepted,
    Edited,
    Regenerated,
    Abandoned,
    ThumbsUp,
    ThumbsDown,
    Published,
    Sent,
}

impl Action {
    pub const ALL: [Action; 8] = [
        Action::Accepted,
        Action::Edited,
        Action::Regenerated,
        Action::Abandoned,
        Action::ThumbsUp,
        Action::ThumbsDown,
        Action::Published,
        Action::Sent,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Action::Accepted => "accepted",
            Action::Edited => "edited",
            Action::Regenerated => "regenerated",
            Action::Abandoned => "abandoned",
            Action::ThumbsUp => "thumbs_up",
            Action::ThumbsDown => "thumbs_down",
            Action::Published => "published",
            Action::Sent => "sent",
        }
    }
}

impl FromStr for Action {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Action::ALL
            .into_iter()
            .find(|a| a.as_str() == s)
            .ok_or(ParseError::Action)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// === free-form names ===

/// Validates an agent name (`NM-Agent`): 1..=128 bytes, no control characters.
pub fn parse_agent(s: &str) -> Result<String, ParseError> {
    printable(s, MAX_AGENT_LEN).ok_or(ParseError::Agent)
}

/// Validates an end-user id (`NM-User`): 1..=256 bytes, no control characters.
pub fn parse_user(s: &str) -> Result<String, ParseError> {
    printable(s, MAX_USER_LEN).ok_or(ParseError::User)
}

fn printable(s: &str, max: usize) -> Option<String> {
    let trimmed = s.trim();
    let ok = !trimmed.is_empty() && trimmed.len() <= max && !trimmed.chars().any(char::is_control);
    ok.then(|| trimmed.to_owned())
}

// === service keys ===

/// Prefix of every service API key the controlplane issues.
pub const KEY_PREFIX: &str = "nmk_";

/// SHA-256 of a service API key. Keys are 192-bit random strings, so a fast unsalted hash is
/// enough: it cannot be brute-forced, and the dataplane can check a key with one hash and one
/// map lookup.
pub type KeyHash = [u8; 32];

pub fn hash_key(secret: &str) -> KeyHash {
    Sha256::digest(secret.as_bytes()).into()
}

/// What a dataplane holds to check keys: an HMAC-SHA-256 of each key's [`KeyHash`] under a key
/// derived from the deployment's link secret. The key stream between the halves carries these
/// verifiers, never the plain hashes, so a reader of that stream (a log, a capture, a proxy)
/// has nothing to test guesses against without the link secret as well.
#[derive(Clone)]
pub struct VerifierKey(Hmac<Sha256>);

impl VerifierKey {
    /// Domain separation: the link secret also authenticates the dataplane; the verifier key is
    /// a different value derived from it.
    const CONTEXT: &'static [u8] = b"nm-gateway key verifier v1\0";

    pub fn from_link_secret(secret: &str) -> Self {
        let mut derive = Sha256::new();
        derive.update(Self::CONTEXT);
        derive.update(secret.as_bytes());
        let key: [u8; 32] = derive.finalize().into();
        Self(<Hmac<Sha256> as KeyInit>::new_from_slice(&key).unwrap_or_else(|_| unreachable!()))
    }

    /// The verifier of a stored key hash (the controlplane's side).
    pub fn of_hash(&self, hash: &KeyHash) -> KeyHash {
        let mut mac = self.0.clone();
        mac.update(hash);
        mac.finalize().into_bytes().into()
    }

    /// The verifier of a presented secret (the dataplane's side).
    pub fn of_secret(&self, secret: &str) -> KeyHash {
        self.of_hash(&hash_key(secret))
    }
}

impl fmt::Debug for VerifierKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("VerifierKey(..)")
    }
}

/// One version of the valid keys, as a dataplane needs them: by verifier (see [`VerifierKey`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyVerifiers {
    /// Grows whenever the key set changes.
    pub version: u64,
    pub keys: Vec<VerifiedKey>,
    /// Why the controlplane's database does not take writes now; `None` while it does. A
    /// dataplane is not ready (`/health` 503) while this is set: signals and records it sends
    /// would not be stored.
    pub write_problem: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedKey {
    pub id: String,
    pub verifier: KeyHash,
    pub admin: bool,
}

/// Compares two secrets without an early exit at the first differing byte: both are hashed, and
/// the digests compared in constant time.
pub fn secrets_equal(a: &str, b: &str) -> bool {
    use subtle::ConstantTimeEq;
    hash_key(a).ct_eq(&hash_key(b)).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn session_ids() {
        assert!("sess_abc-123_X".parse::<SessionId>().is_ok());
        for bad in [
            "", "sess_", "abc", "sess_a b", "sess_a/b", "SESS_abc", "sess_é", " sess_a",
        ] {
            assert_eq!(
                bad.parse::<SessionId>(),
                Err(ParseError::SessionId),
                "{bad:?}"
            );
        }
        let long = format!("sess_{}", "a".repeat(MAX_SESSION_ID_LEN + 1));
        assert!(long.parse::<SessionId>().is_err());
    }

    #[test]
    fn envs_and_actions_round_trip() {
        for e in Env::ALL {
            assert_eq!(e.as_str().parse::<Env>(), Ok(e));
        }
        for a in Action::ALL {
            assert_eq!(a.as_str().parse::<Action>(), Ok(a));
        }
        assert!("Production".parse::<Env>().is_err());
        assert!("thumbsup".parse::<Action>().is_err());
    }

    #[test]
    fn names() {
        assert_eq!(parse_agent(" support-bot ").as_deref(), Ok("support-bot"));
        assert!(parse_agent("").is_err());
        assert!(parse_agent("a\nb").is_err());
        assert!(parse_user(&"u".repeat(MAX_USER_LEN + 1)).is_err());
    }

    proptest! {
        #[test]
        fn session_parser_accepts_exactly_the_grammar(s in "\\PC{0,40}") {
            let expected = s.strip_prefix("sess_").is_some_and(|id| {
                !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            });
            prop_assert_eq!(s.parse::<SessionId>().is_ok(), expected);
        }

        #[test]
        fn agent_parser_never_keeps_control_chars(s in "\\PC*|[\\x00-\\x1f]{1,3}") {
            if let Ok(a) = parse_agent(&s) {
                prop_assert!(!a.chars().any(char::is_control));
                prop_assert!(!a.is_empty() && a.len() <= MAX_AGENT_LEN);
            }
        }
    }
}

/// How much of a request's token usage the dataplane learned from the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UsageStatus {
    /// The answer ended normally and reported its usage.
    Reported,
    /// The answer was cut short (client gone, upstream error); the usage seen so far.
    Partial,
    /// The answer carried no usage.
    Missing,
    /// No upstream answer to meter: the gateway answered itself.
    #[default]
    NotApplicable,
}

impl UsageStatus {
    /// The stored spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            UsageStatus::Reported => "reported",
            UsageStatus::Partial => "partial",
            UsageStatus::Missing => "missing",
            UsageStatus::NotApplicable => "not_applicable",
        }
    }
}

/// Token usage of one answer, normalised across providers. `None` means the provider did not
/// say (unknown), never zero.
///
/// - `input_tokens` counts every prompt token, including those read from or written to a cache
///   (Anthropic reports cache reads and writes apart from `input_tokens`; they are added here).
/// - `cached_input_tokens` and `cache_write_tokens` are the parts of `input_tokens` read from and
///   written to the provider's prompt cache.
/// - `output_tokens` counts every generated token, reasoning included (Gemini reports thoughts
///   apart from candidates; they are added here). `reasoning_tokens` is that part.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// The model as the provider answered (may differ from the one requested).
    pub model: Option<String>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cached_input_tokens: Option<u64>,
    pub cache_write_tokens: Option<u64>,
    pub reasoning_tokens: Option<u64>,
    /// The provider's own finish reason of the (first) choice, as it spelled it
    /// (`stop`, `length`, `end_turn`, `STOP`, ...).
    pub finish_reason: Option<String>,
    /// The provider's id of the answer (`gen_ai.response.id` on traces; not stored).
    pub response_id: Option<String>,
}

impl Usage {
    /// Whether the provider reported any token counts.
    pub fn is_known(&self) -> bool {
        self.input_tokens.is_some() || self.output_tokens.is_some()
    }
}
