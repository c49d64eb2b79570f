//! The Gemini `generateContent` dialect.
//!
//! An answer (`GenerateContentResponse`) has `modelVersion`, `candidates[0].finishReason` and
//! `usageMetadata`: `promptTokenCount` (which already includes `cachedContentTokenCount`),
//! `toolUsePromptTokenCount` (prompt tokens of tool results, not included: added to input),
//! `candidatesTokenCount` and `thoughtsTokenCount` (thinking, not included in candidates: added
//! to output, and the reasoning part). `streamGenerateContent` sends a sequence of such answers,
//! as SSE events with `alt=sse` or as a JSON array without; each may repeat `usageMetadata` with
//! the counts so far, and the last one given wins.

use serde::Deserialize;

use super::de::{Count, First, Text};
use super::json_scan::Select;
use super::text::{AnswerText, Part};
use super::{Field, Usage, capture_common, set_count, set_text, sum_known};

const CANDIDATE: Select<Field> =
    Select::keys(&[("finishReason", Select::capture(Field::FinishReason))]);
const ANSWER: Select<Field> = Select::keys(&[
    ("responseId", Select::capture(Field::Id)),
    ("modelVersion", Select::capture(Field::Model)),
    ("usageMetadata", Select::capture(Field::Usage)),
    ("candidates", Select::first(&CANDIDATE)),
]);

/// What the JSON scanner captures from an answer or from each answer of a streamed array.
pub(super) static SELECT: Select<Field> = Select::document(&ANSWER);

const CONTENT_TEXT: Select<Field> = Select::keys(&[("parts", Select::capture(Field::Text))]);
const CANDIDATE_TEXT: Select<Field> = Select::keys(&[
    ("finishReason", Select::capture(Field::FinishReason)),
    ("content", CONTENT_TEXT),
]);
const ANSWER_TEXT: Select<Field> = Select::keys(&[
    ("responseId", Select::capture(Field::Id)),
    ("modelVersion", Select::capture(Field::Model)),
    ("usageMetadata", Select::capture(Field::Usage)),
    ("candidates", Select::first(&CANDIDATE_TEXT)),
]);
/// The same, and the first candidate's `content.parts` (text that is no thought).
pub(super) static SELECT_TEXT: Select<Field> = Select::document(&ANSWER_TEXT);

/// Gemini's counts as reported, kept apart to be summed into [`Usage`].
#[derive(Debug, Default)]
pub(super) struct Reader {
    prompt: Option<u64>,
    tool_prompt: Option<u64>,
    candidates: Option<u64>,
    thoughts: Option<u64>,
}

impl Reader {
    /// One SSE event's data: an answer.
    pub(super) fn event(&mut self, data: &[u8], usage: &mut Usage, text: Option<&mut AnswerText>) {
        let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(data) else {
            return;
        };
        if let Some(text) = text
            && let Ok(TextChunk {
                candidates: First(Some(candidate)),
            }) = serde_json::from_slice::<TextChunk<'_>>(data)
            && candidate.index.0.unwrap_or(0) == 0
        {
            for part in candidate.content.iter().flat_map(|c| &c.parts) {
                if let Some(piece) = part.text() {
                    text.push(piece);
                }
            }
        }
        set_text(&mut usage.model, chunk.model_version.0.as_deref());
        set_text(&mut usage.response_id, chunk.response_id.0.as_deref());
        if let Some(candidate) = chunk.candidates.0 {
            // With several candidates, only the first one's reason counts.
            if candidate.index.0.unwrap_or(0) == 0 {
                set_text(
                    &mut usage.finish_reason,
                    candidate.finish_reason.0.as_deref(),
                );
            }
        }
        if let Some(wire) = chunk.usage_metadata {
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
        set_count(&mut self.prompt, wire.prompt_token_count.0);
        set_count(&mut self.tool_prompt, wire.tool_use_prompt_token_count.0);
        set_count(&mut self.candidates, wire.candidates_token_count.0);
        set_count(&mut self.thoughts, wire.thoughts_token_count.0);
        set_count(
            &mut usage.cached_input_tokens,
            wire.cached_content_token_count.0,
        );
        if let Some(input) = sum_known(&[self.prompt, self.tool_prompt]) {
            usage.input_tokens = Some(input);
        }
        if let Some(output) = sum_known(&[self.candidates, self.thoughts]) {
            usage.output_tokens = Some(output);
        }
        usage.reasoning_tokens = self.thoughts;
    }
}

/// An SSE event: one `GenerateContentResponse`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Chunk<'a> {
    #[serde(borrow, default)]
    response_id: Text<'a>,
    #[serde(borrow, default)]
    model_version: Text<'a>,
    #[serde(borrow, default)]
    candidates: First<Candidate<'a>>,
    #[serde(default)]
    usage_metadata: Option<WireUsage>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Candidate<'a> {
    #[serde(default)]
    index: Count,
    #[serde(borrow, default)]
    finish_reason: Text<'a>,
}

/// A chunk's text, read apart (only when asked for) so that metering alone never builds the
/// list of parts.
#[derive(Deserialize)]
struct TextChunk<'a> {
    #[serde(borrow, default)]
    candidates: First<TextCandidate<'a>>,
}

#[derive(Deserialize)]
struct TextCandidate<'a> {
    #[serde(default)]
    index: Count,
    #[serde(borrow, default)]
    content: Option<TextContent<'a>>,
}

#[derive(Deserialize)]
struct TextContent<'a> {
    #[serde(borrow, default)]
    parts: Vec<Part<'a>>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct WireUsage {
    prompt_token_count: Count,
    tool_use_prompt_token_count: Count,
    cached_content_token_count: Count,
    candidates_token_count: Count,
    thoughts_token_count: Count,
}
