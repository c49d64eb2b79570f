//! The OpenAI dialect, spoken by OpenAI and the OpenAI-compatible providers: chat completions
//! and legacy completions, embeddings and the Responses API, streamed and not.
//!
//! Where each shape keeps what we meter:
//! - Chat and legacy completions: `model`, `choices[0].finish_reason` and `usage`
//!   (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`,
//!   `completion_tokens_details.reasoning_tokens`). Streamed with
//!   `stream_options.include_usage`, usage comes on a last chunk whose `choices` is empty (the
//!   others carry `"usage": null`); without it a stream has no usage at all. Mistral, xAI,
//!   Together, Fireworks and OpenRouter put usage on their last chunk the same way; Groq streams
//!   it under `x_groq.usage`; DeepSeek counts cache hits as `prompt_cache_hit_tokens`.
//! - Embeddings: `{"object": "list", "usage": {"prompt_tokens", "total_tokens"}}`. Embeddings
//!   generate nothing, so such an answer reports 0 output tokens (rather than unknown): that is
//!   what the provider bills.
//! - Responses API: `{"object": "response", "model", "status", "incomplete_details", "usage":
//!   {"input_tokens", "output_tokens", "input_tokens_details", "output_tokens_details"}}`;
//!   streamed, the lifecycle events (`response.created` ... `response.completed`,
//!   `response.incomplete`, `response.failed`) carry that object as `response`, and the many
//!   delta events carry nothing we need. Its finish reason is the final `status`, or for an
//!   `incomplete` answer the reason given (`max_output_tokens`, `content_filter`); a status that
//!   is not final (`queued`, `in_progress`) is no finish reason.

use std::sync::LazyLock;

use memchr::memmem::Finder;
use serde::Deserialize;

use super::de::{Count, First, Text};
use super::json_scan::Select;
use super::text::AnswerText;
use super::{Field, Usage, set_count, set_text, text};

const CHOICE: Select<Field> =
    Select::keys(&[("finish_reason", Select::capture(Field::FinishReason))]);
const GROQ: Select<Field> = Select::keys(&[("usage", Select::capture(Field::Usage))]);
const INCOMPLETE: Select<Field> =
    Select::keys(&[("reason", Select::capture(Field::IncompleteReason))]);
const ANSWER: Select<Field> = Select::keys(&[
    ("id", Select::capture(Field::Id)),
    ("model", Select::capture(Field::Model)),
    ("object", Select::capture(Field::Object)),
    ("usage", Select::capture(Field::Usage)),
    ("x_groq", GROQ),
    ("choices", Select::first(&CHOICE)),
    ("status", Select::capture(Field::Status)),
    ("incomplete_details", INCOMPLETE),
]);

/// What the JSON scanner captures from a non-streamed answer.
pub(super) static SELECT: Select<Field> = Select::document(&ANSWER);

const MESSAGE_TEXT: Select<Field> = Select::keys(&[("content", Select::capture(Field::Text))]);
const CHOICE_TEXT: Select<Field> = Select::keys(&[
    ("finish_reason", Select::capture(Field::FinishReason)),
    ("message", MESSAGE_TEXT),
]);
const OUTPUT_ITEM: Select<Field> = Select::keys(&[("content", Select::capture(Field::Text))]);
const ANSWER_TEXT: Select<Field> = Select::keys(&[
    ("id", Select::capture(Field::Id)),
    ("model", Select::capture(Field::Model)),
    ("object", Select::capture(Field::Object)),
    ("usage", Select::capture(Field::Usage)),
    ("x_groq", GROQ),
    ("choices", Select::first(&CHOICE_TEXT)),
    ("status", Select::capture(Field::Status)),
    ("incomplete_details", INCOMPLETE),
    ("output", Select::each(&OUTPUT_ITEM)),
]);
/// The same, and the answer's text: chat's `choices[0].message.content`, the Responses API's
/// `output[].content` (its `output_text` parts).
pub(super) static SELECT_TEXT: Select<Field> = Select::document(&ANSWER_TEXT);

/// The Responses API's event that streams the answer's text.
pub(super) fn is_text_event(event: &[u8]) -> bool {
    event == b"response.output_text.delta"
}

/// Whether an SSE event can carry usage, model or finish reason: the Responses API's two-level
/// lifecycle events (`response.completed`) do, its deeper delta and item events
/// (`response.output_text.delta`) do not. Chat completions name no events.
pub(super) fn wants(event: &[u8]) -> bool {
    match event.strip_prefix(b"response.") {
        Some(rest) => !rest.contains(&b'.'),
        None => true,
    }
}

/// A chat chunk that only streams content: its finish reason and usage are null or absent, and
/// it is no Groq or Responses API event. Most chunks of a stream are these; once the model is
/// known, skipping their parse keeps the meter's cost per chunk to a few substring searches.
/// (A key's bytes `"usage"` cannot occur inside a JSON string, where quotes are escaped; a
/// string *value* `"usage"` makes this answer false, which only costs a parse.)
fn is_content_only(data: &[u8]) -> bool {
    // Searchers built once: building one costs more than a search through a chunk.
    static KEYS: LazyLock<[Finder<'static>; 4]> = LazyLock::new(|| {
        [
            Finder::new(b"\"finish_reason\""),
            Finder::new(b"\"usage\""),
            Finder::new(b"\"x_groq\""),
            Finder::new(b"\"response\""),
        ]
    });
    let [finish_reason, usage, groq, response] = &*KEYS;
    null_or_absent(data, finish_reason)
        && null_or_absent(data, usage)
        && groq.find(data).is_none()
        && response.find(data).is_none()
}

/// Whether `key` is absent from `data`, or every occurrence is followed by `: null`.
fn null_or_absent(data: &[u8], key: &Finder<'_>) -> bool {
    key.find_iter(data).all(|at| {
        let rest = &data[at + key.needle().len()..];
        let rest = rest.trim_ascii_start();
        rest.strip_prefix(b":")
            .is_some_and(|v| v.trim_ascii_start().starts_with(b"null"))
    })
}

/// What an OpenAI answer has told so far beyond [`Usage`].
#[derive(Debug, Default)]
pub(super) struct Reader {
    /// The answer is a list (`"object": "list"`): embeddings.
    list: bool,
    /// The Responses API's last `status` and `incomplete_details.reason`.
    status: Option<String>,
    incomplete_reason: Option<String>,
}

impl Reader {
    /// One SSE event's data: a chat (or legacy completion) chunk, or a Responses API event.
    /// With `text`, content-only chunks are parsed too, for their `delta.content`.
    pub(super) fn event(
        &mut self,
        name: &[u8],
        data: &[u8],
        usage: &mut Usage,
        text: Option<&mut AnswerText>,
    ) {
        if text.is_none() && usage.model.is_some() && is_content_only(data) {
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(data) else {
            return;
        };
        if let Some(text) = text {
            if is_text_event(name) {
                if let Some(delta) = chunk.delta.0.as_deref() {
                    text.push(delta);
                }
                return;
            }
            if let Some(choice) = &chunk.choices.0
                && choice.index.0.unwrap_or(0) == 0
                && let Some(content) = choice.delta.as_ref().and_then(|d| d.content.0.as_deref())
            {
                text.push(content);
            }
        }
        set_text(&mut usage.model, chunk.model.0.as_deref());
        set_text(&mut usage.response_id, chunk.id.0.as_deref());
        if let Some(choice) = chunk.choices.0 {
            // With `n > 1` each chunk carries one choice; only the first choice's reason counts.
            if choice.index.0.unwrap_or(0) == 0 {
                set_text(&mut usage.finish_reason, choice.finish_reason.0.as_deref());
            }
        }
        if let Some(wire) = chunk.usage {
            wire.apply(usage);
        }
        if let Some(wire) = chunk.x_groq.and_then(|groq| groq.usage) {
            wire.apply(usage);
        }
        if let Some(response) = chunk.response {
            set_text(&mut usage.model, response.model.0.as_deref());
            set_text(&mut usage.response_id, response.id.0.as_deref());
            if let Some(wire) = response.usage {
                wire.apply(usage);
            }
            self.status(response.status.0.as_deref(), usage);
            if let Some(details) = response.incomplete_details {
                self.incomplete_reason(details.reason.0.as_deref(), usage);
            }
        }
    }

    /// One value captured from a JSON answer.
    pub(super) fn capture(&mut self, field: Field, value: &[u8], usage: &mut Usage) {
        match field {
            Field::Model => set_text(&mut usage.model, text(value).as_deref()),
            Field::Id => set_text(&mut usage.response_id, text(value).as_deref()),
            Field::FinishReason => set_text(&mut usage.finish_reason, text(value).as_deref()),
            Field::Object => {
                self.list = text(value).as_deref() == Some("list");
                self.embeddings(usage);
            }
            Field::Usage => {
                if let Ok(wire) = serde_json::from_slice::<WireUsage>(value) {
                    wire.apply(usage);
                    self.embeddings(usage);
                }
            }
            Field::Status => self.status(text(value).as_deref(), usage),
            Field::IncompleteReason => self.incomplete_reason(text(value).as_deref(), usage),
            Field::Text => {}
        }
    }

    /// An embeddings answer generated nothing: 0 output tokens, not unknown. Checked after both
    /// `object` and `usage`, whichever comes last.
    fn embeddings(&self, usage: &mut Usage) {
        if self.list && usage.input_tokens.is_some() && usage.output_tokens.is_none() {
            usage.output_tokens = Some(0);
        }
    }

    fn status(&mut self, status: Option<&str>, usage: &mut Usage) {
        set_text(&mut self.status, status);
        self.finish(usage);
    }

    fn incomplete_reason(&mut self, reason: Option<&str>, usage: &mut Usage) {
        set_text(&mut self.incomplete_reason, reason);
        self.finish(usage);
    }

    /// The Responses API's finish reason, from its final status.
    fn finish(&self, usage: &mut Usage) {
        let reason = match self.status.as_deref() {
            Some("incomplete") => Some(self.incomplete_reason.as_deref().unwrap_or("incomplete")),
            Some(done @ ("completed" | "failed" | "cancelled")) => Some(done),
            _ => None,
        };
        set_text(&mut usage.finish_reason, reason);
    }
}

/// An SSE event: a chat or completion chunk, or a Responses API event.
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default)]
    id: Text<'a>,
    #[serde(borrow, default)]
    model: Text<'a>,
    #[serde(borrow, default)]
    choices: First<Choice<'a>>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    x_groq: Option<Groq>,
    /// The Responses API's lifecycle events carry the response so far.
    #[serde(borrow, default)]
    response: Option<Response<'a>>,
    /// The Responses API's `response.output_text.delta` carries a piece of text.
    #[serde(borrow, default)]
    delta: Text<'a>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: Count,
    #[serde(borrow, default)]
    finish_reason: Text<'a>,
    #[serde(borrow, default)]
    delta: Option<ChoiceDelta<'a>>,
}

#[derive(Deserialize)]
struct ChoiceDelta<'a> {
    #[serde(borrow, default)]
    content: Text<'a>,
}

#[derive(Deserialize)]
struct Groq {
    #[serde(default)]
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct Response<'a> {
    #[serde(borrow, default)]
    id: Text<'a>,
    #[serde(borrow, default)]
    model: Text<'a>,
    #[serde(borrow, default)]
    status: Text<'a>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(borrow, default)]
    incomplete_details: Option<Incomplete<'a>>,
}

#[derive(Deserialize)]
struct Incomplete<'a> {
    #[serde(borrow, default)]
    reason: Text<'a>,
}

/// `usage` in every OpenAI shape: chat and completions name counts `prompt_`/`completion_`,
/// the Responses API `input_`/`output_`.
#[derive(Deserialize, Default)]
#[serde(default)]
struct WireUsage {
    prompt_tokens: Count,
    completion_tokens: Count,
    input_tokens: Count,
    output_tokens: Count,
    prompt_tokens_details: Option<InputDetails>,
    input_tokens_details: Option<InputDetails>,
    completion_tokens_details: Option<OutputDetails>,
    output_tokens_details: Option<OutputDetails>,
    /// DeepSeek's count of cached prompt tokens (its misses are the rest of `prompt_tokens`).
    prompt_cache_hit_tokens: Count,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct InputDetails {
    cached_tokens: Count,
    /// Written to the cache (OpenRouter, for providers that bill cache writes).
    cache_write_tokens: Count,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct OutputDetails {
    reasoning_tokens: Count,
}

impl WireUsage {
    /// OpenAI's counts already include cached prompt tokens and reasoning, as [`Usage`] does.
    fn apply(&self, usage: &mut Usage) {
        let input = self
            .prompt_tokens_details
            .as_ref()
            .or(self.input_tokens_details.as_ref());
        let output = self
            .completion_tokens_details
            .as_ref()
            .or(self.output_tokens_details.as_ref());
        set_count(
            &mut usage.input_tokens,
            self.prompt_tokens.0.or(self.input_tokens.0),
        );
        set_count(
            &mut usage.output_tokens,
            self.completion_tokens.0.or(self.output_tokens.0),
        );
        set_count(
            &mut usage.cached_input_tokens,
            input
                .and_then(|d| d.cached_tokens.0)
                .or(self.prompt_cache_hit_tokens.0),
        );
        set_count(
            &mut usage.cache_write_tokens,
            input.and_then(|d| d.cache_write_tokens.0),
        );
        set_count(
            &mut usage.reasoning_tokens,
            output.and_then(|d| d.reasoning_tokens.0),
        );
    }
}

#[cfg(test)]
mod skip_tests {
    use super::*;

    #[test]
    fn only_pure_content_chunks_are_skipped() {
        let content = br#"{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"say \"usage\": {}"},"finish_reason":null}],"usage":null}"#;
        assert!(is_content_only(content));
        let spaced =
            br#"{"model": "m", "choices": [{"delta": {"content": "x"}, "finish_reason" : null}]}"#;
        assert!(is_content_only(spaced));
        for informative in [
            &br#"{"model":"m","choices":[{"delta":{},"finish_reason":"stop"}]}"#[..],
            br#"{"model":"m","choices":[{"delta":{}, "finish_reason": "length"}]}"#,
            br#"{"model":"m","choices":[],"usage":{"prompt_tokens":1}}"#,
            br#"{"model":"m","choices":[],"x_groq":{"usage":{"prompt_tokens":1}}}"#,
            br#"{"type":"response.completed","response":{"usage":{}}}"#,
        ] {
            assert!(
                !is_content_only(informative),
                "{}",
                String::from_utf8_lossy(informative)
            );
        }
    }
}
