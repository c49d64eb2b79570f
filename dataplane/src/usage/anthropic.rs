//! The Anthropic messages dialect.
//!
//! A message answer has `model`, `stop_reason` and `usage` (`input_tokens`, `output_tokens`,
//! `cache_read_input_tokens`, `cache_creation_input_tokens`). Anthropic's `input_tokens` leaves
//! out the tokens read from and written to the cache, so the normalised input is the sum of the
//! three. Streamed, `message_start` carries the message (model, input usage, a first small
//! `output_tokens`) and `message_delta` the `stop_reason` and a usage whose counts are
//! cumulative: the last one is the total, never to be added up. Newer API versions repeat the
//! input and cache counts there too; like every count, the last one given wins. The
//! `content_block_*` events (the bulk of a stream), `ping` and `message_stop` carry nothing we
//! need and are not parsed; an `error` event carries no usage.

use serde::Deserialize;

use super::de::{Count, Text};
use super::json_scan::Select;
use super::text::AnswerText;
use super::{Field, Usage, capture_common, set_count, set_text, sum_known};

const MESSAGE: Select<Field> = Select::keys(&[
    ("id", Select::capture(Field::Id)),
    ("model", Select::capture(Field::Model)),
    ("stop_reason", Select::capture(Field::FinishReason)),
    ("usage", Select::capture(Field::Usage)),
]);

/// What the JSON scanner captures from a non-streamed answer.
pub(super) static SELECT: Select<Field> = Select::document(&MESSAGE);

const MESSAGE_TEXT: Select<Field> = Select::keys(&[
    ("id", Select::capture(Field::Id)),
    ("model", Select::capture(Field::Model)),
    ("stop_reason", Select::capture(Field::FinishReason)),
    ("usage", Select::capture(Field::Usage)),
    ("content", Select::capture(Field::Text)),
]);
/// The same, and the answer's `content` (its `text` blocks).
pub(super) static SELECT_TEXT: Select<Field> = Select::document(&MESSAGE_TEXT);

/// The event that streams text (`text_delta`, among other deltas).
pub(super) fn is_text_event(event: &[u8]) -> bool {
    event == b"content_block_delta"
}

/// Whether an SSE event can carry usage, model or stop reason.
pub(super) fn wants(event: &[u8]) -> bool {
    !matches!(
        event,
        b"content_block_start"
            | b"content_block_delta"
            | b"content_block_stop"
            | b"ping"
            | b"message_stop"
    )
}

/// Anthropic's input counts as reported, kept apart to be summed into [`Usage::input_tokens`].
#[derive(Debug, Default)]
pub(super) struct Reader {
    input: Option<u64>,
    cache_read: Option<u64>,
    cache_creation: Option<u64>,
}

impl Reader {
    /// One SSE event's data.
    pub(super) fn event(
        &mut self,
        name: &[u8],
        data: &[u8],
        usage: &mut Usage,
        text: Option<&mut AnswerText>,
    ) {
        if is_text_event(name) {
            if let Some(text) = text
                && let Ok(event) = serde_json::from_slice::<BlockDelta<'_>>(data)
                && event.delta.kind.0.as_deref() == Some("text_delta")
                && let Some(piece) = event.delta.text.0.as_deref()
            {
                text.push(piece);
            }
            return;
        }
        let Ok(event) = serde_json::from_slice::<Event<'_>>(data) else {
            return;
        };
        if let Some(message) = event.message {
            set_text(&mut usage.model, message.model.0.as_deref());
            set_text(&mut usage.response_id, message.id.0.as_deref());
            set_text(&mut usage.finish_reason, message.stop_reason.0.as_deref());
            if let Some(wire) = message.usage {
                self.apply(&wire, usage);
            }
        }
        if let Some(delta) = event.delta {
            set_text(&mut usage.finish_reason, delta.stop_reason.0.as_deref());
        }
        if let Some(wire) = event.usage {
            self.apply(&wire, usage);
        }
    }

    /// One value captured from a JSON answer.
    pub(super) fn capture(&mut self, field: Field, value: &[u8], usage: &mut Usage) {
        if let Some(wire) = capture_common::<WireUsage>(field, value, usage) {
            self.apply(&wire, usage);
        }
    }

    fn apply(&mut self, wire: &WireUsage, usage: &mut Usage) {
        set_count(&mut self.input, wire.input_tokens.0);
        set_count(&mut self.cache_read, wire.cache_read_input_tokens.0);
        set_count(&mut self.cache_creation, wire.cache_creation_input_tokens.0);
        set_count(&mut usage.output_tokens, wire.output_tokens.0);
        if let Some(input) = sum_known(&[self.input, self.cache_read, self.cache_creation]) {
            usage.input_tokens = Some(input);
        }
        usage.cached_input_tokens = self.cache_read;
        usage.cache_write_tokens = self.cache_creation;
    }
}

/// An SSE event: `message_start` has `message`, `message_delta` has `delta` and `usage`.
#[derive(Deserialize)]
struct Event<'a> {
    #[serde(borrow, default)]
    message: Option<Message<'a>>,
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    id: Text<'a>,
    #[serde(borrow, default)]
    model: Text<'a>,
    #[serde(borrow, default)]
    stop_reason: Text<'a>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

/// `content_block_delta`: `{"delta": {"type": "text_delta", "text": ..}}`.
#[derive(Deserialize)]
struct BlockDelta<'a> {
    #[serde(borrow)]
    delta: TextDelta<'a>,
}

#[derive(Deserialize)]
struct TextDelta<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Text<'a>,
    #[serde(borrow, default)]
    text: Text<'a>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(borrow, default)]
    stop_reason: Text<'a>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WireUsage {
    input_tokens: Count,
    output_tokens: Count,
    cache_read_input_tokens: Count,
    cache_creation_input_tokens: Count,
}
