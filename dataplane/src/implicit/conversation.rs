//! A request's conversation, as the implicit rules see it: the request scanner
//! ([`crate::forward::request_facts_with`]) hands each list of turns and the system prompt over
//! in place ([`Conversation::read`]), and [`walk`] reads a list's turns where the scanner would
//! otherwise have crossed it: one pass over the body, no copy. What is kept is two keyed hashes
//! and a byte range, never text.
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
//! hashed raw (a client resending a conversation sends the same bytes), in the order written,
//! each under its name's tag and its length, and each turn closed by a mark: one running keyed
//! hash over the whole list (under the process's keys), whose state after turn `n` is
//! `chain(n)`. Only the two states a [`Summary`] needs are finished, once, at the end.
//!
//! The [`Summary`]: `asked`, the hash of the system prompt and the chain up to and with the last
//! user-side turn (two requests asking the same); and `history`, when the turn right before that
//! last user-side turn is the model's: the hash of what preceded it (computed like `asked`, so
//! it equals the `asked` of the request that turn answered) and where its content lies in the
//! body. Turns after the last user-side turn (an assistant prefill) are in neither.

use std::hash::{BuildHasher, Hasher};
use std::ops::Range;

use memchr::memchr2;

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

/// A piece of a request the scanner hands over, as its raw JSON value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// A list of turns. `input` may also be a plain string (any value but an array): one user
    /// turn with that content.
    Turns(List),
    /// The system prompt (`system`, `systemInstruction`, `instructions`).
    System,
}

/// The fields of a turn that are hashed, by tag: `role`, `type` and the content (`content`, or
/// Gemini's `parts`) are also read; the others (OpenAI's tool calls, Responses' items) only
/// hashed.
pub const ROLE: u8 = 0;
pub const KIND: u8 = 1;
pub const CONTENT: u8 = 2;

/// The tag of a turn's member, by its key (as written: a key spelled with escapes is no field,
/// like every key the request scanner compares).
pub fn field_tag(key: &[u8]) -> Option<u8> {
    Some(match key {
        b"role" => ROLE,
        b"type" => KIND,
        b"content" | b"parts" => CONTENT,
        b"tool_calls" => 3,
        b"tool_call_id" => 4,
        b"name" => 5,
        b"function_call" => 6,
        b"call_id" => 7,
        b"arguments" => 8,
        b"output" => 9,
        _ => return None,
    })
}

/// What [`walk`] meets in a list of turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn<'r> {
    /// A field of the turn being read: its tag ([`field_tag`]) and raw value.
    Field(u8, &'r [u8]),
    /// A turn (an object of the list) ended.
    End,
}

/// How a [`walk`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walked {
    /// Where the list ended: after its closing bracket, or the end of the bytes.
    pub end: usize,
    /// Well-formed as far as the walk looked: nothing passed over but whitespace, every bracket
    /// closed by its own kind, the list closed. Then `end` is where the scanner, counting
    /// brackets outside strings, would have ended the value too.
    pub clean: bool,
}

/// Reads a list of turns, `raw` its value (`[` first) and what follows, telling `on` each field
/// and each turn's end, in order. Elements that are not objects are no turns.
///
/// One pass over bytes already in memory (the request body, whole): no stack, no copy. Lenient
/// exactly as the incremental [`crate::usage::Scanner`] is with a selection of each element's
/// fields (what read the turns before, and what the tests compare it with on any input): a
/// stray byte where a key, colon or comma is expected is passed over, a bracket of either kind
/// closes what is open, a truncated value is no field; [`Walked::clean`] says whether any of
/// that happened.
pub fn walk<'r>(raw: &'r [u8], on: &mut impl FnMut(Turn<'r>)) -> Walked {
    let mut clean = true;
    let mut i = 1;
    let ran_out = Walked {
        end: raw.len(),
        clean: false,
    };
    'elements: loop {
        // Expecting an element (`,` and `:` here are malformed and passed over).
        let Some(&b) = raw.get(i) else {
            return ran_out;
        };
        match b {
            b' ' | b'\t' | b'\n' | b'\r' => {
                i += 1;
                continue;
            }
            b',' | b':' => {
                clean = false;
                i += 1;
                continue;
            }
            b']' | b'}' => {
                return Walked {
                    end: i + 1,
                    clean: clean && b == b']',
                };
            }
            b'{' => match turn(raw, i + 1, on, &mut clean) {
                Some(end) => i = end,
                None => return ran_out,
            },
            _ => match value_end(raw, i) {
                Some(end) => i = end,
                None => return ran_out,
            },
        }
        // After an element: `,` or the list's end.
        loop {
            let Some(&b) = raw.get(i) else {
                return ran_out;
            };
            i += 1;
            match b {
                b',' => continue 'elements,
                b']' | b'}' => {
                    return Walked {
                        end: i,
                        clean: clean && b == b']',
                    };
                }
                b' ' | b'\t' | b'\n' | b'\r' => {}
                _ => clean = false,
            }
        }
    }
}

/// Reads one turn's members, from `raw[i]` (right after its `{`) to its end: where it ended, or
/// None when `raw` ended first (a turn never closed is no turn). Anything but whitespace passed
/// over, or a `]` closing it, makes the walk unclean.
fn turn<'r>(
    raw: &'r [u8],
    mut i: usize,
    on: &mut impl FnMut(Turn<'r>),
    clean: &mut bool,
) -> Option<usize> {
    loop {
        // Expecting a key or `}`.
        loop {
            let b = *raw.get(i)?;
            i += 1;
            match b {
                b'"' => break,
                b'}' => {
                    on(Turn::End);
                    return Some(i);
                }
                b' ' | b'\t' | b'\n' | b'\r' => {}
                _ => *clean = false,
            }
        }
        let key_from = i;
        let key_end = loop {
            let at = i + quote_or_backslash(raw.get(i..)?)?;
            if raw[at] == b'"' {
                i = at + 1;
                break at;
            }
            i = at + 2; // an escape: the next byte is the key's, whatever it is
        };
        let tag = field_tag(&raw[key_from..key_end]);
        // Expecting `:`.
        loop {
            let b = *raw.get(i)?;
            i += 1;
            match b {
                b':' => break,
                b'}' => {
                    *clean = false;
                    on(Turn::End);
                    return Some(i);
                }
                b' ' | b'\t' | b'\n' | b'\r' => {}
                _ => *clean = false,
            }
        }
        // Expecting the value.
        loop {
            match *raw.get(i)? {
                b' ' | b'\t' | b'\n' | b'\r' => i += 1,
                b',' | b':' => {
                    *clean = false;
                    i += 1;
                }
                b'}' | b']' => {
                    *clean = false;
                    on(Turn::End);
                    return Some(i + 1);
                }
                _ => break,
            }
        }
        let end = value_end(raw, i)?;
        if let Some(tag) = tag {
            on(Turn::Field(tag, &raw[i..end]));
        }
        i = end;
        // After the value: `,` or the turn's end.
        loop {
            let b = *raw.get(i)?;
            i += 1;
            match b {
                b',' => break,
                b'}' | b']' => {
                    *clean &= b == b'}';
                    on(Turn::End);
                    return Some(i);
                }
                b' ' | b'\t' | b'\n' | b'\r' => {}
                _ => *clean = false,
            }
        }
    }
}

/// Where the value starting at `raw[i]` (not whitespace or a delimiter) ends, as the scanner
/// crosses it: a string after its closing quote, a container after the bracket that brings the
/// count of open ones back to none (of either kind), a number or literal at the next delimiter.
/// None when `raw` ends first.
pub fn value_end(raw: &[u8], mut i: usize) -> Option<usize> {
    match *raw.get(i)? {
        b'"' => string_end(raw, i + 1),
        b'{' | b'[' => {
            let mut depth = 1u32;
            i += 1;
            loop {
                let b = *raw.get(i)?;
                i += 1;
                match b {
                    b'"' => i = string_end(raw, i)?,
                    b'{' | b'[' => depth = depth.saturating_add(1),
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i);
                        }
                    }
                    _ => {}
                }
            }
        }
        _ => raw
            .get(i..)?
            .iter()
            .position(|&b| {
                matches!(
                    b,
                    b' ' | b'\t' | b'\n' | b'\r' | b',' | b':' | b'{' | b'}' | b'[' | b']' | b'"'
                )
            })
            .map(|off| i + off),
    }
}

/// Where a string whose contents start at `raw[i]` ends (after its closing quote).
fn string_end(raw: &[u8], mut i: usize) -> Option<usize> {
    loop {
        let at = i + quote_or_backslash(raw.get(i..)?)?;
        if raw[at] == b'"' {
            return Some(at + 1);
        }
        i = at + 2;
    }
}

/// The first `"` or `\` in `bytes`. A request's keys and most of its strings are short:
/// eight bytes at a time in a word (a call into `memchr` costs more than it saves below a few
/// dozen bytes), then `memchr` for what is longer.
fn quote_or_backslash(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const QUOTES: u64 = ONES * b'"' as u64;
    const BACKSLASHES: u64 = ONES * b'\\' as u64;
    /// Words looked at before handing over to `memchr`.
    const WORDS: usize = 4;
    let (words, _) = bytes.as_chunks::<8>();
    for (n, word) in words.iter().take(WORDS).enumerate() {
        let w = u64::from_le_bytes(*word);
        // A byte of `x` is zero where `w` has the byte sought: the lowest such byte is found
        // exactly (borrows only spread above a zero byte).
        let zero = |x: u64| x.wrapping_sub(ONES) & !x & HIGH;
        let hits = zero(w ^ QUOTES) | zero(w ^ BACKSLASHES);
        if hits != 0 {
            return Some(n * 8 + (hits.trailing_zeros() / 8) as usize);
        }
    }
    let from = 8 * words.len().min(WORDS);
    let rest = &bytes[from..];
    let found = if rest.len() < 8 {
        rest.iter().position(|&b| b == b'"' || b == b'\\')
    } else {
        memchr2(b'"', b'\\', rest)
    };
    found.map(|at| from + at)
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

/// The mark that closes a turn in the chain (a field writes its tag and length, `< 2^56`,
/// shifted above a byte: never this).
const TURN_END: u64 = u64::MAX;

/// Reads a conversation part by part.
#[derive(Debug)]
pub struct Conversation<'a> {
    /// The body the parts are slices of (for the content's byte range).
    body: &'a [u8],
    keys: &'a TextKeys,
    system: TextHasher,
    turns: Turns,
}

/// The turns read so far.
#[derive(Debug, Clone)]
struct Turns {
    /// Every turn so far; its state is `chain(n)`.
    chain: TextHasher,
    /// `chain` when the turn being read began.
    start: TextHasher,
    role: Option<Side>,
    kind: Option<Side>,
    content: Option<Range<usize>>,
    /// The turn before: its side, the chain before it, its content.
    prev: Option<(Side, TextHasher, Option<Range<usize>>)>,
    /// The chain after the last user-side turn, and the previous answer it brought back.
    last_user: Option<(TextHasher, Option<Answered>)>,
}

/// The model's turn right before a user-side turn: the chain before it, its content.
type Answered = (TextHasher, Range<usize>);

impl<'a> Conversation<'a> {
    pub fn new(keys: &'a TextKeys, body: &'a [u8]) -> Self {
        let chain = keys.build_hasher();
        Self {
            body,
            keys,
            system: keys.build_hasher(),
            turns: Turns {
                start: chain.clone(),
                chain,
                role: None,
                kind: None,
                content: None,
                prev: None,
                last_user: None,
            },
        }
    }

    /// One part whose value starts at `rest[0]`, `rest` the body from there on (what the
    /// request scanner hands over, [`crate::usage::Select::walk`]): reads it in place, and
    /// returns how many bytes the value took, as the scanner counts them (brackets and quotes).
    ///
    /// A list is walked once. Only when the walk was not clean (malformed JSON) may its end
    /// differ from the scanner's: what it read is then forgotten, and the value, up to where
    /// the scanner ends it, read again ([`Conversation::feed`]), as if it had been captured.
    pub fn read(&mut self, part: Part, rest: &[u8]) -> usize {
        if let (Part::Turns(list), Some(b'[')) = (part, rest.first()) {
            let before = self.turns.clone();
            let body = self.body;
            let turns = &mut self.turns;
            let walked = walk(rest, &mut |turn| turns.told(turn, list, body));
            if walked.clean {
                return walked.end;
            }
            self.turns = before;
        }
        match value_end(rest, 0) {
            Some(end) => {
                self.feed(part, &rest[..end]);
                end
            }
            // Cut short: the scanner would have captured nothing.
            None => rest.len(),
        }
    }

    /// One part, `raw` its whole JSON value (a slice of the body).
    pub fn feed(&mut self, part: Part, raw: &[u8]) {
        match part {
            Part::Turns(list) => match raw.first() {
                Some(b'[') => {
                    let body = self.body;
                    let turns = &mut self.turns;
                    walk(raw, &mut |turn| turns.told(turn, list, body));
                }
                Some(_) if list == List::Input => {
                    self.turns.role = Some(Side::User);
                    self.turns.hash(CONTENT, raw);
                    self.turns.end(list);
                }
                _ => {}
            },
            Part::System => {
                self.system.write_usize(raw.len());
                self.system.write(raw);
            }
        }
    }

    fn mix(&self, a: u64, b: u64) -> u64 {
        let mut h = self.keys.build_hasher();
        h.write_u64(a);
        h.write_u64(b);
        h.finish()
    }

    pub fn finish(mut self) -> Summary {
        let Some((chain, history)) = self.turns.last_user.take() else {
            return Summary::default();
        };
        let system = self.system.finish();
        Summary {
            asked: Some(self.mix(system, chain.finish())),
            history: history.map(|(after, content)| History {
                after: self.mix(system, after.finish()),
                content,
            }),
        }
    }
}

impl Turns {
    fn told(&mut self, turn: Turn<'_>, list: List, body: &[u8]) {
        match turn {
            Turn::Field(tag, raw) => {
                match tag {
                    ROLE => self.role = side_of_role(raw),
                    KIND => self.kind = side_of_kind(raw),
                    CONTENT => self.content = range_of(body, raw),
                    _ => {}
                }
                self.hash(tag, raw);
            }
            Turn::End => self.end(list),
        }
    }

    fn hash(&mut self, tag: u8, raw: &[u8]) {
        self.chain
            .write_u64(u64::from(tag) | ((raw.len() as u64) << 8));
        self.chain.write(raw);
    }

    fn end(&mut self, list: List) {
        let role = self.role.take();
        let kind = self.kind.take();
        let content = self.content.take();
        let side = match (role, kind, list) {
            (Some(side), _, _) => side,
            (None, Some(side), List::Input) => side,
            (None, _, List::Contents) => Side::User,
            (None, _, _) => Side::Neither,
        };
        self.chain.write_u64(TURN_END);
        let before = std::mem::replace(&mut self.start, self.chain.clone());
        if side == Side::User {
            let history = match self.prev.take() {
                Some((Side::Model, after, Some(content))) => Some((after, content)),
                _ => None,
            };
            self.last_user = Some((self.chain.clone(), history));
        }
        self.prev = Some((side, before, content));
    }
}

/// Where `raw` lies in `body`, if it is a slice of it.
fn range_of(body: &[u8], raw: &[u8]) -> Option<Range<usize>> {
    let start = raw.as_ptr().addr().checked_sub(body.as_ptr().addr())?;
    let end = start.checked_add(raw.len())?;
    (end <= body.len()).then_some(start..end)
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
