//! Implicit signals: what the gateway infers about an answer from what the client does next,
//! without the application sending anything. Four rules ([`Rule`]):
//!
//! | rule | action | when |
//! |---|---|---|
//! | `client_disconnect` | `abandoned` | the client left before a streamed answer (2xx) ended |
//! | `reask` | `regenerated` | a request of the same session has the same conversation (every turn up to and with the last user turn, and the system prompt) as an earlier answered one, within the reask window: that earlier answer was regenerated |
//! | `history_edit` | `edited` | the session's next request brings the previous answer back as its last assistant turn (right before its last user turn, after the very conversation that answer answered), changed: the distance in characters ([`distance`]) |
//! | `continued` | (neutral) | the same, unchanged |
//!
//! An inferred signal rides on the record of the request that revealed it
//! ([`nm_types::record::Inferred`]): `client_disconnect` on the abandoned request's own record,
//! the others on the later request's record, naming the earlier answer's request id. It shares
//! that record's queue, spool and idempotency, and costs no call of its own.
//!
//! What is read, and when: the request body is scanned once, by the same scanner that reads the
//! model and the output cap ([`crate::forward::request_facts`]); with a session and a rule that
//! needs it, the scan also walks the conversation's turns ([`conversation`]), hashing them under
//! keys drawn when the process starts. The answer's text is read by the usage meter's own pass
//! ([`crate::usage::text`]). Nothing is re-serialized or delayed; no database or network call.
//!
//! What is kept ([`memory`]): per session (itself a keyed hash of key id and `NM-Session`), the
//! hashes of recent conversations, and of the last answer its length, a keyed hash and (only
//! while `history_edit` is on) its first [`crate::usage::text::MAX_KEPT_CHARS`] characters. In
//! memory only, bounded in bytes and in time; never logged, exported, spanned or persisted. A
//! rule switched off (globally or for the agent) reads nothing, keeps nothing and infers nothing.
//!
//! A dataplane sees only its own requests: in a split deployment a session whose requests are
//! spread over dataplanes is judged only for consecutive requests that reach the same one.

pub mod conversation;
pub mod distance;
pub mod memory;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use nm_types::record::Inferred;
use nm_types::signal::{RequestIdBytes, Rule};

use crate::metrics::Metrics;
use crate::usage::text::{AnswerText, Digest, MAX_KEPT_CHARS, TextKeys};
use conversation::Summary;
use memory::{Asked, Last, Memory};

/// A set of rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rules(u8);

impl Rules {
    pub const NONE: Rules = Rules(0);
    pub const ALL: Rules = Rules(0b1111);

    fn bit(rule: Rule) -> u8 {
        match rule {
            Rule::ClientDisconnect => 1,
            Rule::Reask => 2,
            Rule::HistoryEdit => 4,
            Rule::Continued => 8,
        }
    }

    pub fn has(self, rule: Rule) -> bool {
        self.0 & Self::bit(rule) != 0
    }

    pub fn with(self, rule: Rule) -> Rules {
        Rules(self.0 | Self::bit(rule))
    }

    pub fn without(self, other: Rules) -> Rules {
        Rules(self.0 & !other.0)
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether a session's conversation must be read (every rule but `client_disconnect`).
    fn needs_session(self) -> bool {
        self.has(Rule::Reask) || self.needs_text()
    }

    /// Whether the answer's text must be read (`history_edit` or `continued`).
    pub fn needs_text(self) -> bool {
        self.has(Rule::HistoryEdit) || self.has(Rule::Continued)
    }

    /// Parses `all`, `off` (or `none`), or rule names separated by commas.
    pub fn parse(text: &str) -> Result<Rules, String> {
        match text.trim() {
            "all" => return Ok(Rules::ALL),
            "off" | "none" => return Ok(Rules::NONE),
            _ => {}
        }
        let mut rules = Rules::NONE;
        let mut named = false;
        for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            rules = rules.with(parse_rule(name)?);
            named = true;
        }
        if !named {
            return Err("name rules separated by commas, or all, or off".to_owned());
        }
        Ok(rules)
    }
}

fn parse_rule(name: &str) -> Result<Rule, String> {
    name.parse::<Rule>().map_err(|_| {
        let names: Vec<&str> = Rule::ALL.iter().map(|r| r.name()).collect();
        format!(
            "{name:?} is not a rule: name rules from {}",
            names.join(", ")
        )
    })
}

/// The implicit rules' settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The rules on for every agent (`NM_IMPLICIT_RULES`).
    pub rules: Rules,
    /// Rules off for some agents (`NM_IMPLICIT_RULES_OFF`).
    pub off_by_agent: HashMap<String, Rules>,
    /// How far back a `reask` looks (`NM_IMPLICIT_REASK_WINDOW_SECS`).
    pub reask_window: Duration,
    /// Most bytes the rules' memory holds (`NM_IMPLICIT_MEMORY_BYTES`).
    pub memory_bytes: usize,
    /// How long a session is remembered after its last request (`NM_IMPLICIT_MEMORY_SECS`).
    pub memory_ttl: Duration,
}

pub const DEFAULT_REASK_WINDOW: Duration = Duration::from_secs(600);
pub const DEFAULT_MEMORY_BYTES: usize = 64 * 1024 * 1024;
pub const DEFAULT_MEMORY_TTL: Duration = Duration::from_secs(1800);

impl Default for Settings {
    fn default() -> Self {
        Self {
            rules: Rules::ALL,
            off_by_agent: HashMap::new(),
            reask_window: DEFAULT_REASK_WINDOW,
            memory_bytes: DEFAULT_MEMORY_BYTES,
            memory_ttl: DEFAULT_MEMORY_TTL,
        }
    }
}

/// Parses `agent:rule` pairs separated by commas (`agent:all` for every rule). An agent name
/// may hold `:` (the last one separates the rule) but not `,`.
pub fn parse_off_by_agent(text: &str) -> Result<HashMap<String, Rules>, String> {
    let mut out: HashMap<String, Rules> = HashMap::new();
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((agent, rule)) = pair.rsplit_once(':') else {
            return Err(format!("{pair:?} is not agent:rule"));
        };
        let agent = agent.trim();
        if agent.is_empty() {
            return Err(format!("{pair:?} names no agent"));
        }
        let rules = match rule.trim() {
            "all" => Rules::ALL,
            name => Rules::NONE.with(parse_rule(name)?),
        };
        let entry = out.entry(agent.to_owned()).or_default();
        *entry = Rules(entry.0 | rules.0);
    }
    Ok(out)
}

/// The rules, their memory and the process's hash keys; one per dataplane process, shared by
/// its workers.
#[derive(Debug)]
pub struct Implicit {
    settings: Settings,
    keys: TextKeys,
    memory: Memory,
}

/// What a request's rules need at its end (carried by its event): the rules on, and with a
/// session read, the session it is remembered under and its conversation's hash.
#[derive(Debug, Clone, Copy)]
pub struct Pending {
    pub rules: Rules,
    session: Option<u64>,
    /// This request's conversation (to be regenerated by a later one, or continued).
    asked: Option<u64>,
}

impl Pending {
    /// A request whose conversation was not read (no session, or no rule needs it).
    pub fn without_session(rules: Rules) -> Self {
        Self {
            rules,
            session: None,
            asked: None,
        }
    }

    /// Whether the answer's text must be read, and whether its first characters are kept.
    pub fn wants_text(&self) -> Option<bool> {
        (self.session.is_some() && self.asked.is_some() && self.rules.needs_text())
            .then(|| self.rules.has(Rule::HistoryEdit))
    }
}

impl Implicit {
    pub fn new(settings: Settings, metrics: Metrics) -> Self {
        let memory = Memory::new(settings.memory_bytes, settings.memory_ttl, metrics);
        Self {
            settings,
            keys: TextKeys::default(),
            memory,
        }
    }

    /// The rules on for an agent's requests.
    pub fn rules_for(&self, agent: Option<&str>) -> Rules {
        let rules = self.settings.rules;
        if rules.is_empty() || self.settings.off_by_agent.is_empty() {
            return rules;
        }
        match agent.and_then(|a| self.settings.off_by_agent.get(a)) {
            Some(off) => rules.without(*off),
            None => rules,
        }
    }

    pub fn keys(&self) -> &TextKeys {
        &self.keys
    }

    pub fn memory(&self) -> &Memory {
        &self.memory
    }

    /// The key a session (of a service key) is remembered under: a keyed hash, never the ids.
    pub fn session_key(&self, key_id: &str, session: &str) -> u64 {
        self.memory.session_key(&self.keys, key_id, session)
    }

    /// Whether a request's conversation must be read: it has a session and a rule that needs it.
    pub fn reads_conversation(rules: Rules, has_session: bool) -> bool {
        has_session && rules.needs_session()
    }

    /// A request's conversation was read: what it reveals about earlier answers of its session,
    /// and what its end must remember. `body` is the request body the summary points into.
    pub fn infer(
        &self,
        rules: Rules,
        session: u64,
        summary: &Summary,
        body: &[u8],
        now: Instant,
        out: &mut Vec<Inferred>,
    ) -> Pending {
        let reask = summary.asked.filter(|_| rules.has(Rule::Reask));
        let recalled = self
            .memory
            .recall(session, reask, self.settings.reask_window, now);
        if let Some(answer) = recalled.regenerated {
            out.push(Inferred {
                rule: Rule::Reask,
                answer: answer.to_id(),
                edit_distance: None,
            });
        }
        if rules.needs_text()
            && let (Some(last), Some(history)) = (recalled.last, &summary.history)
            && history.after == last.asked
            && let Some(raw) = body.get(history.content.clone())
        {
            // Read as the answer was: streamed into its digest, never copied whole.
            let mut back = AnswerText::new(&self.keys, false);
            back.push_raw(raw);
            if let Some(inferred) = judge(&self.keys, rules, &last, back.finish(), raw) {
                out.push(inferred);
            }
        }
        Pending {
            rules,
            session: Some(session),
            asked: summary.asked,
        }
    }

    /// A request's end: what its answer leaves for the session's next request. Only an answer
    /// that was delivered (2xx) is remembered: a retry after an error is no regeneration.
    pub fn remember(
        &self,
        pending: &Pending,
        answer: &str,
        delivered: bool,
        complete: bool,
        text: Option<Digest>,
        now: Instant,
    ) {
        let Some(session) = pending.session.filter(|_| delivered) else {
            return;
        };
        let Some(answer) = RequestIdBytes::parse(answer) else {
            return;
        };
        let asked = pending
            .asked
            .filter(|_| pending.rules.has(Rule::Reask))
            .map(|key| Asked {
                key,
                answer,
                at: now,
            });
        let last = match (pending.asked, text) {
            (Some(asked), Some(text))
                if complete && pending.rules.needs_text() && text.chars > 0 =>
            {
                Some(Last {
                    answer,
                    asked,
                    chars: text.chars,
                    hash: text.hash,
                    kept: text.kept.filter(|_| pending.rules.has(Rule::HistoryEdit)),
                })
            }
            _ => None,
        };
        if asked.is_some() || last.is_some() {
            self.memory.remember(session, asked, last, now);
        }
    }
}

/// The previous answer `last` came back as `came` (the digest of `raw`, a content value):
/// unchanged (`continued`), or changed by some characters (`history_edit`), as far as the rules
/// on can tell. Only a changed answer's first characters are read out (again, under `keys`), to
/// be compared with those kept.
fn judge(keys: &TextKeys, rules: Rules, last: &Last, came: Digest, raw: &[u8]) -> Option<Inferred> {
    if came.chars == last.chars && came.hash == last.hash {
        return rules.has(Rule::Continued).then(|| Inferred {
            rule: Rule::Continued,
            answer: last.answer.to_id(),
            edit_distance: None,
        });
    }
    let kept = last
        .kept
        .as_ref()
        .filter(|_| rules.has(Rule::HistoryEdit))?
        .as_str();
    let mut again = AnswerText::new(keys, true);
    again.push_raw(raw);
    let came_kept = again.finish().kept.unwrap_or_default();
    // Beyond the characters compared, only the lengths' difference is counted: a lower bound.
    let beyond = |chars: u64| chars.saturating_sub(MAX_KEPT_CHARS as u64);
    let d = distance::levenshtein(kept, came_kept.as_str())
        .saturating_add(beyond(last.chars).abs_diff(beyond(came.chars)))
        .clamp(1, nm_types::signal::MAX_EDIT_DISTANCE);
    Some(Inferred {
        rule: Rule::HistoryEdit,
        answer: last.answer.to_id(),
        edit_distance: Some(d),
    })
}
