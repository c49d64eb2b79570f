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

/// The keyed hasher of texts: the process's secret keys ([`std::hash::RandomState`]: SipHash-1-3
/// under keys drawn at random when the process starts).
pub type TextKeys = std::hash::RandomState;

/// An answer's text as it passes: its first [`MAX_KEPT_CHARS`] characters (when kept), its length
/// in characters and a keyed hash of all of it.
#[derive(Debug)]
pub struct AnswerText {
    kept: Option<String>,
    chars: u64,
    hash: std::hash::DefaultHasher,
}

/// What is left of an answer's text once it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Digest {
    /// The first [`MAX_KEPT_CHARS`] characters, when kept.
    pub kept: Option<String>,
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
            kept: keep.then(String::new),
            chars: 0,
            hash: keys.build_hasher(),
        }
    }

    /// Appends a piece of text.
    pub fn push(&mut self, piece: &str) {
        self.hash.write(piece.as_bytes());
        let n = piece.chars().count() as u64;
        if let Some(kept) = &mut self.kept {
            let room = MAX_KEPT_CHARS.saturating_sub(self.chars as usize);
            if room > 0 {
                let end = piece
                    .char_indices()
                    .nth(room)
                    .map_or(piece.len(), |(at, _)| at);
                kept.push_str(&piece[..end]);
            }
        }
        self.chars = self.chars.saturating_add(n);
    }

    /// Appends the text of a captured content value: a JSON string, or an array of parts whose
    /// text counts (`text` of a part typed `text` or `output_text`, or untyped and not a Gemini
    /// thought), in order. `null`, other values and malformed input have none.
    pub fn push_raw(&mut self, raw: &[u8]) {
        each_text(raw, &mut |piece| self.push(piece));
    }

    pub fn finish(self) -> Digest {
        Digest {
            kept: self.kept,
            chars: self.chars,
            hash: self.hash.finish(),
        }
    }
}

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
        let keys = TextKeys::new();
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
                .as_deref()
                .unwrap()
                .starts_with("Voilà — the config")
        );
        assert!(chat.kept.as_deref().unwrap().ends_with("Ελληνικά."));
        let anthropic = read(
            WireFormat::Anthropic,
            Framing::Json,
            include_bytes!("fixtures/anthropic.json"),
            7,
        );
        assert!(anthropic.kept.unwrap().starts_with("Here is the summary"));
        let responses = read(
            WireFormat::Openai,
            Framing::Json,
            include_bytes!("fixtures/openai_responses.json"),
            5,
        );
        assert!(responses.kept.unwrap().starts_with("Sure! Here's the plan"));
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
            assert!(whole.kept.as_deref().unwrap().starts_with(start));
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
        let keys = TextKeys::new();
        let long = "é".repeat(MAX_KEPT_CHARS + 10);
        let d = digest(&keys, &long, true);
        assert_eq!(
            d.kept.as_deref().map(|k| k.chars().count()),
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
