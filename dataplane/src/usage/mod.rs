//! Usage metering: what a provider says an answer cost in tokens, read from the response frames
//! as they flow to the client.
//!
//! [`Meter`] is fed every data frame of a response (`feed`) and never holds on to them: it keeps
//! only the incomplete tail of an SSE line or the little state a JSON scan needs, so metering adds
//! no copy of the body and no delay to any frame. [`Meter::finish`] returns the [`Usage`] seen so
//! far, which for a cancelled stream is the usage up to the cancellation.
//!
//! Two framings, one reader per dialect:
//! - SSE (`sse.rs`): each event's data is parsed with serde into small targeted structs (unknown
//!   fields skipped, strings borrowed). Events whose type says they carry only content deltas
//!   (Anthropic's `content_block_*`, the Responses API's `response.*.delta` and friends) are
//!   dropped unparsed.
//! - JSON (`json_scan.rs`): an incremental scanner captures only the raw bytes of the few values
//!   of interest (model, usage, finish reason) from a single answer or from Gemini's streamed
//!   array of answers, and serde parses just those.
//!
//! With [`Meter::with_text`] (an implicit rule needs the answer's text, [`crate::implicit`]) the
//! same pass also reads the answer's text parts (`text.rs`): the JSON selections grow by the
//! content's path and the content-only SSE events are parsed too. Without it nothing of the
//! text is read.
//!
//! Providers repeat themselves (usage on every Gemini chunk, cumulative Anthropic deltas, the
//! model on every OpenAI chunk): a later value replaces an earlier one, field by field, and
//! nothing is ever summed across events. Malformed input never fails a response: it yields less
//! usage (fields left `None`).

mod anthropic;
mod de;
mod gemini;
mod json_scan;
mod openai;
mod sse;
#[cfg(test)]
mod tests;
pub mod text;

pub(crate) use json_scan::{Scanner, Select};

use crate::providers::WireFormat;

/// How the response body is framed, from its `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `text/event-stream`.
    Sse,
    /// `application/json` (a single object, or Gemini's streamed array of objects).
    Json,
}

pub use nm_types::Usage;
use text::{AnswerText, Digest};

/// Reads usage from a response body frame by frame.
#[derive(Debug)]
pub struct Meter {
    reader: Reader,
    decoder: Decoder,
    usage: Usage,
    /// The answer's text, when a rule needs it.
    text: Option<AnswerText>,
}

impl Meter {
    /// The meter for a provider's answers: the one place a wire format picks its usage reader.
    pub fn new(format: WireFormat, framing: Framing) -> Self {
        let reader = match format {
            WireFormat::Openai => Reader::OpenAi(openai::Reader::default()),
            WireFormat::Anthropic => Reader::Anthropic(anthropic::Reader::default()),
            WireFormat::Gemini => Reader::Gemini(gemini::Reader::default()),
        };
        let decoder = match framing {
            Framing::Sse => Decoder::Sse(sse::Splitter::default()),
            Framing::Json => Decoder::Json(Scanner::new(reader.select())),
        };
        Self {
            reader,
            decoder,
            usage: Usage::default(),
            text: None,
        }
    }

    /// The same meter, reading the answer's text into `text` as well.
    pub fn with_text(mut self, text: AnswerText) -> Self {
        self.read_text(text);
        self
    }

    /// Reads the answer's text into `text` as well, from the first frame on (in place: a meter
    /// is a few hundred bytes, not moved again for this).
    pub fn read_text(&mut self, text: AnswerText) {
        if let Decoder::Json(scanner) = &mut self.decoder {
            scanner.reselect(self.reader.select_text());
        }
        self.text = Some(text);
    }

    /// Observes one data frame, in order.
    pub fn feed(&mut self, frame: &[u8]) {
        let Self {
            reader,
            decoder,
            usage,
            text,
        } = self;
        match decoder {
            Decoder::Sse(splitter) => splitter.feed(
                frame,
                &mut Events {
                    reader,
                    usage,
                    text: text.as_mut(),
                },
            ),
            Decoder::Json(scanner) => {
                scanner.feed(frame, &mut |field, value| match (field, text.as_mut()) {
                    (Field::Text, Some(text)) => text.push_raw(value),
                    (Field::Text, None) => {}
                    _ => reader.capture(field, value, usage),
                });
            }
        }
    }

    /// The usage seen so far.
    pub fn usage(&self) -> &Usage {
        &self.usage
    }

    /// The usage seen, once the body has ended (or was dropped).
    pub fn finish(self) -> Usage {
        self.finish_with_text().0
    }

    /// The usage seen and, when it was read, the answer's text.
    pub fn finish_with_text(mut self) -> (Usage, Option<Digest>) {
        if let Decoder::Sse(splitter) = &mut self.decoder {
            splitter.finish(&mut Events {
                reader: &mut self.reader,
                usage: &mut self.usage,
                text: self.text.as_mut(),
            });
        }
        (self.usage, self.text.map(AnswerText::finish))
    }
}

/// How the body is being taken apart.
#[derive(Debug)]
enum Decoder {
    Sse(sse::Splitter),
    Json(Scanner<Field>),
}

/// What a value captured from a JSON answer is; each dialect selects its own keys for these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Model,
    /// The answer's id (`id`, Gemini's `responseId`).
    Id,
    /// OpenAI's `object` (`"list"` marks embeddings).
    Object,
    Usage,
    FinishReason,
    /// The Responses API's `status`.
    Status,
    /// The Responses API's `incomplete_details.reason`.
    IncompleteReason,
    /// The answer's content (a string or an array of parts), read only by [`Meter::with_text`].
    Text,
}

/// A dialect's reader and what it has learnt beyond [`Usage`].
#[derive(Debug)]
enum Reader {
    OpenAi(openai::Reader),
    Anthropic(anthropic::Reader),
    Gemini(gemini::Reader),
}

impl Reader {
    fn select(&self) -> &'static Select<Field> {
        match self {
            Reader::OpenAi(_) => &openai::SELECT,
            Reader::Anthropic(_) => &anthropic::SELECT,
            Reader::Gemini(_) => &gemini::SELECT,
        }
    }

    /// The selection of a JSON answer's usage and text.
    fn select_text(&self) -> &'static Select<Field> {
        match self {
            Reader::OpenAi(_) => &openai::SELECT_TEXT,
            Reader::Anthropic(_) => &anthropic::SELECT_TEXT,
            Reader::Gemini(_) => &gemini::SELECT_TEXT,
        }
    }

    fn wants(&self, event: &[u8], text: bool) -> bool {
        match self {
            Reader::OpenAi(_) => openai::wants(event) || (text && openai::is_text_event(event)),
            Reader::Anthropic(_) => {
                anthropic::wants(event) || (text && anthropic::is_text_event(event))
            }
            Reader::Gemini(_) => true, // Gemini names no events: every chunk is an answer
        }
    }

    fn event(
        &mut self,
        name: &[u8],
        data: &[u8],
        usage: &mut Usage,
        text: Option<&mut AnswerText>,
    ) {
        match self {
            Reader::OpenAi(r) => r.event(name, data, usage, text),
            Reader::Anthropic(r) => r.event(name, data, usage, text),
            Reader::Gemini(r) => r.event(data, usage, text),
        }
    }

    fn capture(&mut self, field: Field, value: &[u8], usage: &mut Usage) {
        match self {
            Reader::OpenAi(r) => r.capture(field, value, usage),
            Reader::Anthropic(r) => r.capture(field, value, usage),
            Reader::Gemini(r) => r.capture(field, value, usage),
        }
    }
}

/// Hands SSE events to the reader.
struct Events<'a> {
    reader: &'a mut Reader,
    usage: &'a mut Usage,
    text: Option<&'a mut AnswerText>,
}

impl sse::Handler for Events<'_> {
    fn wants(&self, event: &[u8]) -> bool {
        self.reader.wants(event, self.text.is_some())
    }

    fn event(&mut self, event: &[u8], data: &[u8]) {
        // OpenAI's end-of-stream marker, not JSON.
        if data != b"[DONE]" {
            self.reader
                .event(event, data, self.usage, self.text.as_deref_mut());
        }
    }
}

// === shared by the readers ===

/// The part of a JSON capture every dialect shares: a `model` or finish reason goes straight
/// into `usage`; a `usage` object is parsed as the dialect's wire type `W` and handed back.
/// The other fields are selected by the OpenAI dialect only.
fn capture_common<W: serde::de::DeserializeOwned>(
    field: Field,
    value: &[u8],
    usage: &mut Usage,
) -> Option<W> {
    match field {
        Field::Model => set_text(&mut usage.model, text(value).as_deref()),
        Field::Id => set_text(&mut usage.response_id, text(value).as_deref()),
        Field::FinishReason => set_text(&mut usage.finish_reason, text(value).as_deref()),
        Field::Usage => return serde_json::from_slice(value).ok(),
        Field::Object | Field::Status | Field::IncompleteReason | Field::Text => {}
    }
    None
}

/// Replaces a count when the provider gave one.
fn set_count(slot: &mut Option<u64>, value: Option<u64>) {
    if value.is_some() {
        *slot = value;
    }
}

/// Replaces a text when the provider gave a non-empty one, without reallocating when it is
/// unchanged (OpenAI and Gemini repeat the model on every chunk).
fn set_text(slot: &mut Option<String>, value: Option<&str>) {
    match value {
        Some(v) if !v.is_empty() && slot.as_deref() != Some(v) => *slot = Some(v.to_owned()),
        _ => {}
    }
}

/// The sum of the counts given, or `None` when none is: a provider that leaves out one part
/// (no cache, no thinking) reports it as nothing, but one that reports no part reports nothing.
fn sum_known(parts: &[Option<u64>]) -> Option<u64> {
    parts.iter().flatten().fold(None, |sum: Option<u64>, n| {
        Some(sum.unwrap_or(0).saturating_add(*n))
    })
}

/// A captured JSON string, unescaped (borrowed when it has no escapes). Any other JSON value,
/// or malformed input, is `None`.
pub(crate) fn text(value: &[u8]) -> Option<std::borrow::Cow<'_, str>> {
    // The common case without serde: a plain string of printable characters. What has escapes
    // or control characters (invalid JSON) takes the full parse.
    if let Some((inner, _)) = plain_string(value) {
        return std::str::from_utf8(inner)
            .ok()
            .map(std::borrow::Cow::Borrowed);
    }
    serde_json::from_slice::<de::Text<'_>>(value).ok()?.0
}

/// The contents of a JSON string without escapes or control characters (`"..."`, nothing after
/// the closing quote), and whether they are all ASCII; None for any other value. One pass
/// without an early exit, which the compiler turns into a check of many bytes at a time.
pub(crate) fn plain_string(value: &[u8]) -> Option<(&[u8], bool)> {
    let [b'"', inner @ .., b'"'] = value else {
        return None;
    };
    let (odd, high) = inner.iter().fold((false, false), |(odd, high), &b| {
        (
            odd | (b == b'\\') | (b == b'"') | (b < 0x20),
            high | (b >= 0x80),
        )
    });
    (!odd).then_some((inner, !high))
}
