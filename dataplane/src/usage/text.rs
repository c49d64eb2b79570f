//! The text of an answer, as the implicit `history_edit` and `continued` rules need it
//! ([`crate::implicit`]): read from the same frames and by the same pass as the usage, only
//! when a rule asks for it ([`super::Meter::with_text`]).
//!
//! "The text" is the concatenation of the answer's text parts, in order, of its first choice
//! (candidate): OpenAI chat `message.content` (streamed: `delta.content`), the Responses API's
//! `output_text` parts (streamed: `response.output_text.delta`), Anthropic's `text` blocks
//! (streamed: `text_delta`), Gemini's `parts[].text` that are not thoughts. Reasoning, tool calls
//! and thinking blocks are not text. [`AnswerText::push_raw`] reads a request's history turn by the same
//! definition, so what the gateway returned and what came back are compared alike.
//!
//! [`AnswerText`] never holds more than [`MAX_KEPT_CHARS`] characters: beyond, only the count of
//! characters and a keyed hash of the whole text go on.

use std::hash::{BuildHasher, Hasher};

use serde::Deserialize;

use super::de::Text;

/// Characters of an answer kept for comparison (and compared at most on each side).
pub const MAX_KEPT_CHARS: usize = 4096;

/// The keyed hash of texts and conversations: foldhash's quality variant under seeds drawn at
/// random when the process starts. Its hashes are compared only within the process (never
/// stored, sent or shown), so a non-cryptographic keyed hash does; SipHash-1-3 cost a fifth of
/// what the implicit rules cost a request.
#[derive(Debug, Clone, Default)]
pub struct TextKeys(foldhash::quality::RandomState);

impl BuildHasher for TextKeys {
    type Hasher = TextHasher;

    fn build_hasher(&self) -> TextHasher {
        TextHasher(self.0.build_hasher())
    }
}

/// A hasher made from [`TextKeys`] (its state is not shown: it is derived from the keys).
#[derive(Clone)]
pub struct TextHasher(foldhash::quality::FoldHasher<'static>);

impl std::fmt::Debug for TextHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TextHasher")
    }
}

impl Hasher for TextHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.0.write_u8(i);
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.0.write_u64(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.0.write_usize(i);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0.finish()
    }
}

/// An answer's text as it passes: its first [`MAX_KEPT_CHARS`] characters (when kept), its length
/// in characters and a keyed hash of all of it.
#[derive(Debug)]
pub struct AnswerText {
    kept: Option<Kept>,
    chars: u64,
    hash: TextHasher,
    /// The bytes not hashed yet: the hash takes whole blocks, so that it depends on the text
    /// alone, not on how it was cut into pieces (a streamed answer against the same text
    /// brought back whole).
    block: [u8; BLOCK],
    filled: usize,
}

/// The bytes the text's hash takes at a time.
const BLOCK: usize = 64;

/// The first characters of a text: UTF-8, as bytes. Made only of whole characters of text read
/// as valid, so that a plain ASCII string (most answers) is kept without being checked twice;
/// read back as text only where it is compared ([`Kept::as_str`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Kept(Vec<u8>);

impl Kept {
    pub fn as_str(&self) -> &str {
        // Whole characters of valid text, by construction.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What is left of an answer's text once it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Digest {
    /// The first [`MAX_KEPT_CHARS`] characters, when kept.
    pub kept: Option<Kept>,
    /// Its length in characters (Unicode scalar values).
    pub chars: u64,
    /// The keyed hash of the whole text.
    pub hash: u64,
}

impl AnswerText {
    /// `keep`: whether the first characters are kept (the `history_edit` rule), or only the
    /// length and hash (`continued`).
    pub fn new(keys: &TextKeys, keep: bool) -> Self {
        Self {
            kept: keep.then(Kept::default),
            chars: 0,
            hash: keys.build_hasher(),
            block: [0; BLOCK],
            filled: 0,
        }
    }

    /// Hashes `bytes` after those before it, a whole block at a time.
    fn hash(&mut self, mut bytes: &[u8]) {
        if self.filled > 0 {
            let take = bytes.len().min(BLOCK - self.filled);
            self.block[self.filled..self.filled + take].copy_from_slice(&bytes[..take]);
            self.filled += take;
            bytes = &bytes[take..];
            if self.filled < BLOCK {
                return;
            }
            self.hash.write(&self.block);
            self.filled = 0;
        }
        let mut blocks = bytes.chunks_exact(BLOCK);
        for block in &mut blocks {
            self.hash.write(block);
        }
        let rest = blocks.remainder();
        self.block[..rest.len()].copy_from_slice(rest);
        self.filled = rest.len();
    }

    /// Appends a piece of text.
    pub fn push(&mut self, piece: &str) {
        // ASCII (most answers) has as many characters as bytes: a check of a word at a time,
        // not a count of each character.
        self.push_valid(piece.as_bytes(), piece.is_ascii());
    }

    /// Appends a piece of text known to be valid UTF-8 (all ASCII when `ascii`).
    fn push_valid(&mut self, piece: &[u8], ascii: bool) {
        self.hash(piece);
        let n = if ascii {
            piece.len()
        } else {
            // Characters are the bytes that do not continue one.
            piece.iter().filter(|&&b| (b as i8) >= -0x40).count()
        } as u64;
        if let Some(Kept(kept)) = &mut self.kept {
            let room = MAX_KEPT_CHARS.saturating_sub(self.chars as usize);
            // Fewer bytes than room means fewer characters: the piece fits whole.
            if piece.len() <= room {
                // One allocation of the right size for a whole answer, not a buffer doubled
                // from empty.
                kept.reserve(piece.len());
                kept.extend_from_slice(piece);
            } else if room > 0 {
                // The first `room` characters: up to the start of the next one.
                let end = piece
                    .iter()
                    .enumerate()
                    .filter(|&(_, &b)| (b as i8) >= -0x40)
                    .nth(room)
                    .map_or(piece.len(), |(at, _)| at);
                kept.extend_from_slice(&piece[..end]);
            }
        }
        self.chars = self.chars.saturating_add(n);
    }

    /// Appends the text of a captured content value: a JSON string, or an array of parts whose
    /// text counts (`text` of a part typed `text` or `output_text`, or untyped and not a Gemini
    /// thought), in order. `null`, other values and malformed input have none.
    pub fn push_raw(&mut self, raw: &[u8]) {
        let raw = raw.trim_ascii_start();
        // A plain string of printable ASCII (the common answer) is taken as it is: the one
        // pass that looks for escapes also says it is ASCII, so it is not checked again.
        if let Some((inner, true)) = super::plain_string(raw) {
            self.push_valid(inner, true);
            return;
        }
        each_text(raw, &mut |piece| self.push(piece));
    }

    pub fn finish(mut self) -> Digest {
        self.hash.write(&self.block[..self.filled]);
        Digest {
            kept: self.kept,
            chars: self.chars,
            hash: self.hash.finish(),
        }
    }
}

/// The text pieces of a content value, in order (see [`AnswerText::push_raw`]).
fn each_text(raw: &[u8], f: &mut impl FnMut(&str)) {
    let raw = raw.trim_ascii_start();
    match raw.first() {
        Some(b'"') => {
            if let Some(s) = super::text(raw) {
                f(&s);
            }
        }
        Some(b'[') => {
            if let Ok(parts) = serde_json::from_slice::<Vec<Part<'_>>>(raw) {
                for part in &parts {
                    if let Some(text) = part.text() {
                        f(text);
                    }
                }
            }
        }
        _ => {}
    }
}

/// A part of a content array, any dialect's: `{"type": "text", "text": ..}` (OpenAI, Anthropic),
/// `{"type": "output_text", "text": ..}` (Responses API), `{"text": .., "thought": bool}`
/// (Gemini). Anything else reads as a part without text.
#[derive(Deserialize, Default)]
#[serde(default)]
pub(super) struct Part<'a> {
    #[serde(borrow, rename = "type")]
    kind: Text<'a>,
    #[serde(borrow)]
    text: Text<'a>,
    thought: Option<serde_json::Value>,
}

impl Part<'_> {
    pub(super) fn text(&self) -> Option<&str> {
        let typed_text = match self.kind.0.as_deref() {
            None => self.thought != Some(serde_json::Value::Bool(true)),
            Some(kind) => kind == "text" || kind == "output_text",
        };
        typed_text.then_some(self.text.0.as_deref()).flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digest of a whole text, as [`AnswerText`] would make it.
    fn digest(keys: &TextKeys, text: &str, keep: bool) -> Digest {
        let mut t = AnswerText::new(keys, keep);
        t.push(text);
        t.finish()
    }

    /// The text of a content value: a JSON string, or an array of parts whose text counts (`text`
    /// of a part typed `text` or `output_text`, or untyped and not a Gemini thought), concatenated.
    /// `null`, other values and malformed input have none.
    fn text_of(raw: &[u8]) -> String {
        let mut out = String::new();
        each_text(raw, &mut |piece| out.push_str(piece));
        out
    }

    use crate::providers::WireFormat;
    use crate::usage::{Framing, Meter};

    fn read(format: WireFormat, framing: Framing, bytes: &[u8], cut: usize) -> Digest {
        let keys = TextKeys::default();
        let mut meter = Meter::new(format, framing).with_text(AnswerText::new(&keys, true));
        for piece in bytes.chunks(cut.max(1)) {
            meter.feed(piece);
        }
        meter.finish_with_text().1.expect("text was read")
    }

    #[test]
    fn the_text_of_real_answers() {
        let chat = read(
            WireFormat::Openai,
            Framing::Json,
            include_bytes!("fixtures/openai_chat.json"),
            64,
        );
        assert!(
            chat.kept
                .as_ref()
                .unwrap()
                .as_str()
                .starts_with("Voilà — the config")
        );
        assert!(chat.kept.as_ref().unwrap().as_str().ends_with("Ελληνικά."));
        let anthropic = read(
            WireFormat::Anthropic,
            Framing::Json,
            include_bytes!("fixtures/anthropic.json"),
            7,
        );
        assert!(
            anthropic
                .kept
                .unwrap()
                .as_str()
                .starts_with("Here is the summary")
        );
        let responses = read(
            WireFormat::Openai,
            Framing::Json,
            include_bytes!("fixtures/openai_responses.json"),
            5,
        );
        assert!(
            responses
                .kept
                .unwrap()
                .as_str()
                .starts_with("Sure! Here's the plan")
        );
        // A function call is no text.
        let gemini = read(
            WireFormat::Gemini,
            Framing::Json,
            include_bytes!("fixtures/gemini.json"),
            9,
        );
        assert_eq!(gemini.chars, 0);
    }

    #[test]
    fn streamed_text_reads_the_same_however_the_frames_are_cut() {
        for (format, bytes, start) in [
            (
                WireFormat::Openai,
                &include_bytes!("fixtures/openai_chat_stream_usage.sse")[..],
                "Sure",
            ),
            (
                WireFormat::Anthropic,
                include_bytes!("fixtures/anthropic_stream.sse"),
                "",
            ),
            (
                WireFormat::Gemini,
                include_bytes!("fixtures/gemini_stream.sse"),
                "**Rust** makes",
            ),
            (
                WireFormat::Openai,
                include_bytes!("fixtures/openai_responses_stream.sse"),
                "",
            ),
        ] {
            let whole = read(format, Framing::Sse, bytes, bytes.len());
            assert!(whole.chars > 0, "{format:?}");
            assert!(whole.kept.as_ref().unwrap().as_str().starts_with(start));
            for cut in [1, 2, 3, 17, 100] {
                let cut_read = read(format, Framing::Sse, bytes, cut);
                // (Each read draws keys of its own: the hashes differ.)
                assert_eq!(
                    (cut_read.kept, cut_read.chars),
                    (whole.kept.clone(), whole.chars),
                    "{format:?} {cut}"
                );
            }
        }
    }

    #[test]
    fn kept_characters_stop_at_the_cap_but_length_and_hash_go_on() {
        let keys = TextKeys::default();
        let long = "é".repeat(MAX_KEPT_CHARS + 10);
        let d = digest(&keys, &long, true);
        assert_eq!(
            d.kept.as_ref().map(|k| k.as_str().chars().count()),
            Some(MAX_KEPT_CHARS)
        );
        assert_eq!(d.chars, (MAX_KEPT_CHARS + 10) as u64);
        let mut pieces = AnswerText::new(&keys, true);
        for c in long.chars() {
            pieces.push(&c.to_string());
        }
        assert_eq!(pieces.finish(), d);
        assert_eq!(digest(&keys, &long, false).kept, None);
    }

    proptest::proptest! {
        #[test]
        fn the_digest_depends_on_the_text_not_its_pieces(
            text in "[a-zé€😀 ]{0,300}",
            cuts in proptest::collection::vec(0usize..300, 0..12),
        ) {
            let keys = TextKeys::default();
            let whole = digest(&keys, &text, true);
            let mut at: Vec<usize> = cuts
                .into_iter()
                .map(|c| c.min(text.len()))
                .filter(|&c| text.is_char_boundary(c))
                .collect();
            at.sort_unstable();
            let mut pieces = AnswerText::new(&keys, true);
            let mut from = 0;
            for to in at.into_iter().chain([text.len()]) {
                pieces.push(&text[from..to]);
                from = to;
            }
            proptest::prop_assert_eq!(pieces.finish(), whole.clone());
            let other = digest(&keys, &format!("{text}."), true);
            proptest::prop_assert_ne!(other.hash, whole.hash);
        }
    }

    proptest::proptest! {
        /// A content string read raw (the answer's JSON, a history turn) gives the digest of
        /// its text, whether plain ASCII (taken as it is), other characters or escaped.
        #[test]
        fn a_raw_string_reads_as_its_text(
            text in "[a-z \"\\\\\n\t\u{7f}é€😀]{0,40}",
            repeat in 1usize..200,
        ) {
            let keys = TextKeys::default();
            let text = text.repeat(repeat);
            let raw = serde_json::to_vec(&text).unwrap();
            for keep in [true, false] {
                let mut read = AnswerText::new(&keys, keep);
                read.push_raw(&raw);
                proptest::prop_assert_eq!(read.finish(), digest(&keys, &text, keep));
            }
        }
    }

    #[test]
    fn a_raw_string_that_is_not_utf8_has_no_text() {
        let keys = TextKeys::default();
        let mut read = AnswerText::new(&keys, true);
        read.push_raw(b"\"caf\xe9\"");
        read.push_raw(b"\"\xff\xfe ascii\"");
        assert_eq!(read.finish(), digest(&keys, "", true));
    }

    #[test]
    fn content_values_of_every_shape() {
        assert_eq!(text_of(br#""a\"b""#), "a\"b");
        assert_eq!(
            text_of(br#"[{"type":"text","text":"a"},{"type":"image_url"},{"type":"output_text","text":"b"},{"text":"c"},{"text":"t","thought":true},{"type":"thinking","text":"x"}]"#),
            "abc"
        );
        assert_eq!(text_of(b"null"), "");
        assert_eq!(text_of(b"[1,2]"), "");
        assert_eq!(text_of(b"{\"text\":\"a\"}"), "");
    }
}
