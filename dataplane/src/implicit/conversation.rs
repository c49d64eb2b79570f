//! A request's conversation, as the implicit rules see it: read from the parts the request
//! scanner hands over ([`crate::forward::request_facts_with`]), in one pass, turn by turn, and
//! kept as two keyed hashes and a byte range, never as text.
//!
//! Where each wire format keeps its turns:
//! - OpenAI chat and Anthropic messages: `messages[]`, each `{role, content, ..}` (`content` a
//!   string or an array of parts; OpenAI's `tool_calls`, `tool_call_id`, `name` are hashed too).
//!   Anthropic's system prompt is the top-level `system`.
//! - Gemini: `contents[]`, each `{role, parts}` (no role: `user`); the system prompt is
//!   `systemInstruction` (or `system_instruction`).
//! - OpenAI Responses: `input` (a string: one user turn; or an array of items, `{role,
//!   content}` or typed items such as `function_call`, `function_call_output`); the system
//!   prompt is `instructions`.
//!
//! Turns are classed by role: the user's side (`user`, and tool results: `tool`, `function`,
//! Responses' `function_call_output`), the model's (`assistant`, `model`, Responses'
//! `function_call` and `reasoning`), or neither (`system`, `developer`). Each turn's fields are
//! hashed raw (a client resending a conversation sends the same bytes), and the turns chained:
//! `chain(n) = H(chain(n-1), turn(n))`, under the process's keys.
//!
//! The [`Summary`]: `asked`, the hash of the system prompt and the chain up to and with the last
//! user-side turn (two requests asking the same); and `history`, when the turn right before that
//! last user-side turn is the model's: the hash of what preceded it (computed like `asked`, so
//! it equals the `asked` of the request that turn answered) and where its content lies in the
//! body. Turns after the last user-side turn (an assistant prefill) are in neither.

use std::hash::{BuildHasher, Hasher};
use std::ops::Range;

use crate::usage::text::{TextHasher, TextKeys};

/// Which list a turn came from (its format's defaults differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum List {
    /// OpenAI chat, Anthropic: `messages`.
    Messages,
    /// Gemini: `contents`.
    Contents,
    /// OpenAI Responses: `input`.
    Input,
}

/// A piece of a request the scanner hands over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// A turn's `role`.
    Role,
    /// A turn's `type` (Responses items).
    Kind,
    /// A turn's `content` (or Gemini's `parts`).
    Content,
    /// Another field of a turn, hashed under its number.
    Field(u8),
    /// A turn ended.
    End(List),
    /// The system prompt (`system`, `systemInstruction`, `instructions`).
    System,
    /// The Responses API's `input` given as a plain string: one user turn.
    Input,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    User,
    Model,
    Neither,
}

/// The previous answer as the request brings it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct History {
    /// The hash of the conversation it answered (compare with that request's [`Summary::asked`]).
    pub after: u64,
    /// Where its content lies in the body.
    pub content: Range<usize>,
}

/// What the rules keep of a request's conversation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    pub asked: Option<u64>,
    pub history: Option<History>,
}

/// Reads a conversation part by part.
#[derive(Debug)]
pub struct Conversation<'a> {
    keys: &'a TextKeys,
    /// The body the parts are slices of (for the content's byte range).
    body: &'a [u8],
    system: TextHasher,
    chain: u64,
    /// The turn being read.
    turn: TextHasher,
    role: Option<Side>,
    kind: Option<Side>,
    content: Option<Range<usize>>,
    /// The turn before: its side, the chain before it, its content.
    prev: Option<(Side, u64, Option<Range<usize>>)>,
    /// The chain after the last user-side turn, and the history before that turn.
    last_user: Option<(u64, Option<History>)>,
}

impl<'a> Conversation<'a> {
    pub fn new(keys: &'a TextKeys, body: &'a [u8]) -> Self {
        Self {
            keys,
            body,
            system: keys.build_hasher(),
            chain: 0,
            turn: keys.build_hasher(),
            role: None,
            kind: None,
            content: None,
            prev: None,
            last_user: None,
        }
    }

    /// One part, `raw` its JSON value (a slice of the body).
    pub fn feed(&mut self, part: Part, raw: &[u8]) {
        match part {
            Part::Role => {
                self.role = side_of_role(raw);
                self.field(0, raw);
            }
            Part::Kind => {
                self.kind = side_of_kind(raw);
                self.field(1, raw);
            }
            Part::Content => {
                self.content = self.range_of(raw);
                self.field(2, raw);
            }
            Part::Field(n) => self.field(n.saturating_add(3), raw),
            Part::End(list) => self.end(list),
            Part::System => {
                self.system.write_usize(raw.len());
                self.system.write(raw);
            }
            Part::Input => {
                self.role = Some(Side::User);
                self.field(2, raw);
                self.end(List::Input);
            }
        }
    }

    fn field(&mut self, tag: u8, raw: &[u8]) {
        self.turn.write_u8(tag);
        self.turn.write_usize(raw.len());
        self.turn.write(raw);
    }

    /// Where `raw` lies in the body, if it is a slice of it.
    fn range_of(&self, raw: &[u8]) -> Option<Range<usize>> {
        let base = self.body.as_ptr() as usize;
        let start = (raw.as_ptr() as usize).checked_sub(base)?;
        let end = start.checked_add(raw.len())?;
        (end <= self.body.len()).then_some(start..end)
    }

    fn end(&mut self, list: List) {
        let turn = std::mem::replace(&mut self.turn, self.keys.build_hasher()).finish();
        let role = self.role.take();
        let kind = self.kind.take();
        let content = self.content.take();
        let side = match (role, kind, list) {
            (Some(side), _, _) => side,
            (None, Some(side), List::Input) => side,
            (None, _, List::Contents) => Side::User,
            (None, _, _) => Side::Neither,
        };
        let before = self.chain;
        self.chain = self.mix(before, turn);
        if side == Side::User {
            let history = match self.prev.take() {
                Some((Side::Model, after, Some(content))) => Some(History { after, content }),
                _ => None,
            };
            self.last_user = Some((self.chain, history));
        }
        self.prev = Some((side, before, content));
    }

    fn mix(&self, a: u64, b: u64) -> u64 {
        let mut h = self.keys.build_hasher();
        h.write_u64(a);
        h.write_u64(b);
        h.finish()
    }

    pub fn finish(mut self) -> Summary {
        let system = self.system.finish();
        let Some((chain, history)) = self.last_user.take() else {
            return Summary::default();
        };
        Summary {
            asked: Some(self.mix(system, chain)),
            history: history.map(|h| History {
                after: self.mix(system, h.after),
                content: h.content,
            }),
        }
    }
}

fn side_of_role(raw: &[u8]) -> Option<Side> {
    Some(match raw {
        br#""user""# | br#""tool""# | br#""function""# => Side::User,
        br#""assistant""# | br#""model""# => Side::Model,
        _ => Side::Neither,
    })
}

fn side_of_kind(raw: &[u8]) -> Option<Side> {
    match raw {
        br#""function_call_output""# | br#""custom_tool_call_output""# => Some(Side::User),
        br#""function_call""# | br#""reasoning""# | br#""custom_tool_call""# => Some(Side::Model),
        _ => None,
    }
}
