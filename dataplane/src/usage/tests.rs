//! Meter tests against recorded-realistic provider answers (`fixtures/`): what each shape must
//! yield, that cutting the bytes into frames anywhere changes nothing, and that no input panics.

use proptest::prelude::*;

use super::{Framing, Meter, Usage};
use crate::providers::WireFormat;

/// A recorded answer and how it is metered.
struct Fixture<'a> {
    dialect: WireFormat,
    framing: Framing,
    bytes: &'a [u8],
}

macro_rules! fixture {
    ($dialect:ident, $framing:ident, $file:literal) => {
        Fixture {
            dialect: WireFormat::$dialect,
            framing: Framing::$framing,
            bytes: include_bytes!(concat!("fixtures/", $file)),
        }
    };
}

const OPENAI_CHAT: Fixture<'static> = fixture!(Openai, Json, "openai_chat.json");
const OPENAI_CHAT_STREAM: Fixture<'static> = fixture!(Openai, Sse, "openai_chat_stream_usage.sse");
const OPENAI_CHAT_STREAM_NO_USAGE: Fixture<'static> =
    fixture!(Openai, Sse, "openai_chat_stream_no_usage.sse");
const OPENAI_RESPONSES: Fixture<'static> = fixture!(Openai, Json, "openai_responses.json");
const OPENAI_RESPONSES_STREAM: Fixture<'static> =
    fixture!(Openai, Sse, "openai_responses_stream.sse");
const OPENAI_EMBEDDINGS: Fixture<'static> = fixture!(Openai, Json, "openai_embeddings.json");
const GROQ_STREAM: Fixture<'static> = fixture!(Openai, Sse, "groq_stream.sse");
const DEEPSEEK: Fixture<'static> = fixture!(Openai, Json, "deepseek.json");
const MISTRAL_STREAM: Fixture<'static> = fixture!(Openai, Sse, "mistral_stream.sse");
const ANTHROPIC: Fixture<'static> = fixture!(Anthropic, Json, "anthropic.json");
const ANTHROPIC_STREAM: Fixture<'static> = fixture!(Anthropic, Sse, "anthropic_stream.sse");
const ANTHROPIC_STREAM_CUT: Fixture<'static> = fixture!(Anthropic, Sse, "anthropic_stream_cut.sse");
const GEMINI: Fixture<'static> = fixture!(Gemini, Json, "gemini.json");
const GEMINI_STREAM: Fixture<'static> = fixture!(Gemini, Sse, "gemini_stream.sse");
const GEMINI_ARRAY: Fixture<'static> = fixture!(Gemini, Json, "gemini_array.json");

const FIXTURES: [&Fixture<'static>; 15] = [
    &OPENAI_CHAT,
    &OPENAI_CHAT_STREAM,
    &OPENAI_CHAT_STREAM_NO_USAGE,
    &OPENAI_RESPONSES,
    &OPENAI_RESPONSES_STREAM,
    &OPENAI_EMBEDDINGS,
    &GROQ_STREAM,
    &DEEPSEEK,
    &MISTRAL_STREAM,
    &ANTHROPIC,
    &ANTHROPIC_STREAM,
    &ANTHROPIC_STREAM_CUT,
    &GEMINI,
    &GEMINI_STREAM,
    &GEMINI_ARRAY,
];

fn meter<'a>(
    dialect: WireFormat,
    framing: Framing,
    frames: impl IntoIterator<Item = &'a [u8]>,
) -> Usage {
    let mut meter = Meter::new(dialect, framing);
    for frame in frames {
        meter.feed(frame);
    }
    let mut usage = meter.finish();
    // Checked on its own (`every_shape_reads_the_answers_id`).
    usage.response_id = None;
    usage
}

impl Fixture<'_> {
    fn whole(&self) -> Usage {
        meter(self.dialect, self.framing, [self.bytes])
    }

    /// Fed in frames cut at `cuts` (any order, any value: taken modulo the length).
    fn cut(&self, cuts: &[usize]) -> Usage {
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (self.bytes.len() + 1)).collect();
        at.push(0);
        at.push(self.bytes.len());
        at.sort_unstable();
        meter(
            self.dialect,
            self.framing,
            at.windows(2).map(|w| &self.bytes[w[0]..w[1]]),
        )
    }
}

fn usage(
    model: &str,
    input: Option<u64>,
    output: Option<u64>,
    cached: Option<u64>,
    cache_write: Option<u64>,
    reasoning: Option<u64>,
    finish: Option<&str>,
) -> Usage {
    Usage {
        model: Some(model.to_owned()),
        input_tokens: input,
        output_tokens: output,
        cached_input_tokens: cached,
        cache_write_tokens: cache_write,
        reasoning_tokens: reasoning,
        finish_reason: finish.map(str::to_owned),
        response_id: None,
    }
}

#[test]
fn every_shape_reads_the_answers_id() {
    for (i, f) in FIXTURES.iter().enumerate() {
        let mut meter = Meter::new(f.dialect, f.framing);
        meter.feed(f.bytes);
        let id = meter.finish().response_id;
        if f.bytes == OPENAI_EMBEDDINGS.bytes {
            assert_eq!(id, None, "an embeddings list has no id");
            continue;
        }
        let id = id.unwrap_or_else(|| panic!("no id from fixture {i}"));
        let text = String::from_utf8_lossy(f.bytes);
        assert!(text.contains(&format!("\"{id}\"")), "fixture {i}: {id}");
    }
    let mut meter = Meter::new(WireFormat::Openai, Framing::Json);
    meter.feed(OPENAI_CHAT.bytes);
    assert_eq!(
        meter.finish().response_id.as_deref(),
        Some("chatcmpl-BxQ3kL9vZ2mN8pR4tY7uW1aE5cD0f")
    );
}

// === what each shape yields ===

#[test]
fn openai_chat() {
    let want = usage(
        "gpt-4o-2024-08-06",
        Some(2006),
        Some(300),
        Some(1920),
        None,
        Some(0),
        Some("stop"),
    );
    assert_eq!(OPENAI_CHAT.whole(), want);
}

#[test]
fn openai_chat_stream_with_usage() {
    let want = usage(
        "o4-mini-2025-04-16",
        Some(1187),
        Some(402),
        Some(1024),
        None,
        Some(320),
        Some("stop"),
    );
    assert_eq!(OPENAI_CHAT_STREAM.whole(), want);
}

#[test]
fn openai_chat_stream_without_usage() {
    let got = OPENAI_CHAT_STREAM_NO_USAGE.whole();
    assert_eq!(
        got,
        usage(
            "gpt-4.1-mini-2025-04-14",
            None,
            None,
            None,
            None,
            None,
            Some("length")
        )
    );
    assert!(!got.is_known());
}

#[test]
fn openai_responses() {
    let want = usage(
        "o3-2025-04-16",
        Some(5120),
        Some(1536),
        Some(4864),
        None,
        Some(1280),
        Some("completed"),
    );
    assert_eq!(OPENAI_RESPONSES.whole(), want);
}

#[test]
fn openai_responses_stream() {
    let want = usage(
        "gpt-5-mini-2025-08-07",
        Some(2311),
        Some(958),
        Some(2048),
        None,
        Some(704),
        Some("completed"),
    );
    assert_eq!(OPENAI_RESPONSES_STREAM.whole(), want);
}

#[test]
fn openai_responses_incomplete_gives_the_reason() {
    let stream = concat!(
        "event: response.created\n",
        r#"data: {"type":"response.created","response":{"model":"gpt-5","status":"in_progress","incomplete_details":null,"usage":null}}"#,
        "\n\nevent: response.incomplete\n",
        r#"data: {"type":"response.incomplete","response":{"model":"gpt-5","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"usage":{"input_tokens":10,"output_tokens":64}}}"#,
        "\n\n",
    );
    let got = meter(WireFormat::Openai, Framing::Sse, [stream.as_bytes()]);
    assert_eq!(
        got,
        usage(
            "gpt-5",
            Some(10),
            Some(64),
            None,
            None,
            None,
            Some("max_output_tokens")
        )
    );

    // A stream cut before the end has no finish reason: `in_progress` is not one.
    let cut = &stream[..stream.find("event: response.incomplete").unwrap()];
    let got = meter(WireFormat::Openai, Framing::Sse, [cut.as_bytes()]);
    assert_eq!(got, usage("gpt-5", None, None, None, None, None, None));

    let json = r#"{"object":"response","incomplete_details":{"reason":"content_filter"},"status":"incomplete","model":"gpt-5"}"#;
    let got = meter(WireFormat::Openai, Framing::Json, [json.as_bytes()]);
    assert_eq!(got.finish_reason.as_deref(), Some("content_filter"));
}

#[test]
fn openai_embeddings_have_no_output() {
    let want = usage(
        "text-embedding-3-small",
        Some(17),
        Some(0),
        None,
        None,
        None,
        None,
    );
    assert_eq!(OPENAI_EMBEDDINGS.whole(), want);
}

#[test]
fn embeddings_whatever_the_key_order() {
    let json =
        r#"{"usage":{"prompt_tokens":3,"total_tokens":3},"model":"e5","object":"list","data":[]}"#;
    let got = meter(WireFormat::Openai, Framing::Json, [json.as_bytes()]);
    assert_eq!(got, usage("e5", Some(3), Some(0), None, None, None, None));
}

#[test]
fn only_the_first_choice_finishes() {
    // With `n = 2`, each chunk carries one choice; the second choice's reason is not ours.
    let stream = concat!(
        r#"data: {"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
        "\n\n",
        r#"data: {"model":"m","choices":[{"index":1,"delta":{},"finish_reason":"length"}]}"#,
        "\n\n",
    );
    let got = meter(WireFormat::Openai, Framing::Sse, [stream.as_bytes()]);
    assert_eq!(got.finish_reason.as_deref(), Some("stop"));
}

#[test]
fn errors_and_strangers_yield_nothing() {
    let cases: [(WireFormat, Framing, &str); 5] = [
        (
            WireFormat::Anthropic,
            Framing::Sse,
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n",
        ),
        (
            WireFormat::Openai,
            Framing::Json,
            r#"{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#,
        ),
        (
            WireFormat::Gemini,
            Framing::Json,
            r#"[{"error":{"code":429,"status":"RESOURCE_EXHAUSTED"}}]"#,
        ),
        (
            WireFormat::Openai,
            Framing::Sse,
            "data: [DONE]\n\ndata: not json\n\n: comment\n\n",
        ),
        (
            WireFormat::Openai,
            Framing::Json,
            r#""just a string" 42 [1,2]"#,
        ),
    ];
    for (dialect, framing, body) in cases {
        assert_eq!(
            meter(dialect, framing, [body.as_bytes()]),
            Usage::default(),
            "{body}"
        );
    }
}

#[test]
fn odd_values_cost_only_themselves() {
    // Counts as strings or floats are read; a count of the wrong kind is unknown, not fatal.
    let json = r#"{"model":7,"usage":{"prompt_tokens":"12","completion_tokens":5.0,"completion_tokens_details":{"reasoning_tokens":{}}},"choices":[{"finish_reason":null}]}"#;
    let got = meter(WireFormat::Openai, Framing::Json, [json.as_bytes()]);
    let want = Usage {
        input_tokens: Some(12),
        output_tokens: Some(5),
        ..Usage::default()
    };
    assert_eq!(got, want);
}

#[test]
fn groq_stream_usage_under_x_groq() {
    let want = usage(
        "llama-3.3-70b-versatile",
        Some(58),
        Some(117),
        None,
        None,
        None,
        Some("stop"),
    );
    assert_eq!(GROQ_STREAM.whole(), want);
}

#[test]
fn deepseek_cache_hits() {
    let want = usage(
        "deepseek-reasoner",
        Some(1344),
        Some(486),
        Some(1280),
        None,
        Some(351),
        Some("stop"),
    );
    assert_eq!(DEEPSEEK.whole(), want);
}

#[test]
fn mistral_stream() {
    let want = usage(
        "mistral-large-2411",
        Some(31),
        Some(57),
        None,
        None,
        None,
        Some("stop"),
    );
    assert_eq!(MISTRAL_STREAM.whole(), want);
}

#[test]
fn anthropic_adds_cache_to_input() {
    let want = usage(
        "claude-opus-4-1-20250805",
        Some(12 + 1536 + 20480),
        Some(503),
        Some(20480),
        Some(1536),
        None,
        Some("end_turn"),
    );
    assert_eq!(ANTHROPIC.whole(), want);
}

#[test]
fn anthropic_stream_takes_the_last_cumulative_delta() {
    // Deltas say 10 then 25 output tokens: 25 in all, not 35 (nor 38 with message_start's 3).
    let want = usage(
        "claude-sonnet-4-5-20250929",
        Some(472 + 2048),
        Some(25),
        Some(2048),
        Some(0),
        None,
        Some("end_turn"),
    );
    assert_eq!(ANTHROPIC_STREAM.whole(), want);
}

#[test]
fn anthropic_stream_cut_keeps_the_usage_so_far() {
    let want = usage(
        "claude-sonnet-4-5-20250929",
        Some(472 + 2048),
        Some(3),
        Some(2048),
        Some(0),
        None,
        None,
    );
    assert_eq!(ANTHROPIC_STREAM_CUT.whole(), want);
}

#[test]
fn gemini_adds_thoughts_and_tool_prompts() {
    let want = usage(
        "gemini-2.5-pro",
        Some(4310 + 96),
        Some(210 + 812),
        Some(4096),
        None,
        Some(812),
        Some("STOP"),
    );
    assert_eq!(GEMINI.whole(), want);
}

#[test]
fn gemini_stream_takes_the_last_usage() {
    let want = usage(
        "gemini-2.5-flash",
        Some(1835),
        Some(36 + 411),
        Some(1536),
        None,
        Some(411),
        Some("STOP"),
    );
    assert_eq!(GEMINI_STREAM.whole(), want);
}

#[test]
fn gemini_array_stream() {
    let want = usage(
        "gemini-2.5-pro",
        Some(902),
        Some(61 + 187),
        None,
        None,
        Some(187),
        Some("MAX_TOKENS"),
    );
    assert_eq!(GEMINI_ARRAY.whole(), want);
}

#[test]
fn usage_so_far_is_visible_before_the_end() {
    let bytes = ANTHROPIC_STREAM.bytes;
    let mut meter = Meter::new(WireFormat::Anthropic, Framing::Sse);
    let first_event = bytes.windows(2).position(|w| w == b"\n\n").unwrap() + 2;
    meter.feed(&bytes[..first_event]);
    assert_eq!(meter.usage().output_tokens, Some(3));
    meter.feed(&bytes[first_event..]);
    assert_eq!(meter.usage().output_tokens, Some(25));
}

// === framing does not matter ===

#[test]
fn every_line_end_reads_the_same() {
    let lf = std::str::from_utf8(OPENAI_CHAT_STREAM.bytes).unwrap();
    let want = OPENAI_CHAT_STREAM.whole();
    for end in ["\r\n", "\r"] {
        let other = lf.replace('\n', end);
        assert_eq!(
            meter(WireFormat::Openai, Framing::Sse, [other.as_bytes()]),
            want,
            "{end:?}"
        );
    }
}

#[test]
fn every_fixture_read_byte_by_byte() {
    for fixture in FIXTURES {
        let bytes = meter(fixture.dialect, fixture.framing, fixture.bytes.chunks(1));
        assert_eq!(bytes, fixture.whole());
    }
}

fn cuts() -> impl Strategy<Value = Vec<usize>> {
    proptest::collection::vec(any::<usize>(), 0..40)
}

macro_rules! cut_anywhere {
    ($($test:ident: $fixture:ident),* $(,)?) => {
        proptest! {
            $(
                #[test]
                fn $test(cuts in cuts()) {
                    prop_assert_eq!($fixture.cut(&cuts), $fixture.whole());
                }
            )*
        }
    };
}

cut_anywhere! {
    cut_openai_chat: OPENAI_CHAT,
    cut_openai_chat_stream: OPENAI_CHAT_STREAM,
    cut_openai_chat_stream_no_usage: OPENAI_CHAT_STREAM_NO_USAGE,
    cut_openai_responses: OPENAI_RESPONSES,
    cut_openai_responses_stream: OPENAI_RESPONSES_STREAM,
    cut_openai_embeddings: OPENAI_EMBEDDINGS,
    cut_groq_stream: GROQ_STREAM,
    cut_deepseek: DEEPSEEK,
    cut_mistral_stream: MISTRAL_STREAM,
    cut_anthropic: ANTHROPIC,
    cut_anthropic_stream: ANTHROPIC_STREAM,
    cut_anthropic_stream_cut: ANTHROPIC_STREAM_CUT,
    cut_gemini: GEMINI,
    cut_gemini_stream: GEMINI_STREAM,
    cut_gemini_array: GEMINI_ARRAY,
}

// === no input panics ===

fn dialect() -> impl Strategy<Value = WireFormat> {
    prop_oneof![
        Just(WireFormat::Openai),
        Just(WireFormat::Anthropic),
        Just(WireFormat::Gemini)
    ]
}

fn framing() -> impl Strategy<Value = Framing> {
    prop_oneof![Just(Framing::Sse), Just(Framing::Json)]
}

proptest! {
    #[test]
    fn arbitrary_bytes(dialect in dialect(), framing in framing(), bytes in proptest::collection::vec(any::<u8>(), 0..2048), cut in any::<usize>()) {
        let at = cut % (bytes.len() + 1);
        meter(dialect, framing, [&bytes[..at], &bytes[at..]]);
    }

    #[test]
    fn fixture_prefixes(fixture in 0..FIXTURES.len(), dialect in dialect(), framing in framing(), end in any::<usize>(), cuts in cuts()) {
        let bytes = FIXTURES[fixture].bytes;
        let bytes = &bytes[..end % (bytes.len() + 1)];
        let prefix = Fixture { dialect, framing, bytes };
        prop_assert_eq!(prefix.cut(&cuts), prefix.whole());
    }

    #[test]
    fn mutated_fixtures(fixture in 0..FIXTURES.len(), edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), cuts in cuts()) {
        let original = FIXTURES[fixture];
        let mut bytes = original.bytes.to_vec();
        for (at, byte) in edits {
            let at = at % bytes.len();
            bytes[at] = byte;
        }
        let mutated = Fixture { bytes: &bytes, ..*original };
        prop_assert_eq!(mutated.cut(&cuts), mutated.whole());
    }
}

// === throughput, measured by hand ===

/// Feed throughput over ~1 MiB of OpenAI chat chunks, one event per frame and in 16 KiB frames.
/// Run with `cargo nextest run --workspace --release -E 'test(usage::)' --run-ignored all
/// --no-capture`; it asserts nothing about time.
#[test]
#[ignore = "a measurement, not a test"]
fn throughput() {
    let chunk = |i: usize| {
        format!(
            "data: {{\"id\":\"chatcmpl-C1a2b3c4d5e6f7g8h9i0jKLmNoPqR\",\"object\":\"chat.completion.chunk\",\"created\":1754321987,\"model\":\"gpt-4o-2024-08-06\",\"service_tier\":\"default\",\"system_fingerprint\":\"fp_07871e2ad8\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" token {i} — ünïcødé 🎉 \\\"quoted\\\"\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null,\"obfuscation\":\"Xq3v\"}}\n\n"
        )
    };
    let mut events = Vec::new();
    let mut total = 0;
    while total < (1 << 20) {
        let event = chunk(events.len());
        total += event.len();
        events.push(event);
    }
    let body: Vec<u8> = events.concat().into_bytes();
    let rounds = 20;
    let mb = (total * rounds) as f64 / 1e6;
    for (name, frames) in [
        (
            "one event per frame",
            events.iter().map(|e| e.as_bytes()).collect::<Vec<_>>(),
        ),
        ("16 KiB frames", body.chunks(16 * 1024).collect()),
    ] {
        let start = std::time::Instant::now();
        for _ in 0..rounds {
            let usage = meter(WireFormat::Openai, Framing::Sse, frames.iter().copied());
            assert_eq!(usage.model.as_deref(), Some("gpt-4o-2024-08-06"));
        }
        let secs = start.elapsed().as_secs_f64();
        eprintln!(
            "usage::Meter SSE, {name}: {:.0} MB/s ({} events)",
            mb / secs,
            events.len()
        );
    }
    // A ~1 MiB non-streamed answer: the scanner crosses the content without keeping it.
    let content = "Voilà — \\\"quoted\\\" text, {braces} [brackets] 日本語 🎉\\n".repeat(16 * 1024);
    let json = format!(
        "{{\"id\":\"chatcmpl-x\",\"object\":\"chat.completion\",\"model\":\"gpt-4o\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{content}\"}},\"finish_reason\":\"stop\"}}],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":2}}}}"
    );
    let start = std::time::Instant::now();
    for _ in 0..rounds {
        let usage = meter(
            WireFormat::Openai,
            Framing::Json,
            json.as_bytes().chunks(16 * 1024),
        );
        assert_eq!(usage.output_tokens, Some(2));
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "usage::Meter JSON, 16 KiB frames: {:.0} MB/s",
        (json.len() * rounds) as f64 / 1e6 / secs
    );
}

proptest! {
    /// The plain-string shortcut of `text` answers exactly as the full JSON parse does.
    #[test]
    fn text_matches_the_json_parse(raw in proptest::collection::vec(any::<u8>(), 0..40), s in "\\PC{0,20}") {
        let parsed = |v: &[u8]| serde_json::from_slice::<super::de::Text<'_>>(v).ok().and_then(|t| t.0).map(|c| c.into_owned());
        let quoted = [b"\"".as_slice(), &raw, b"\""].concat();
        for v in [&raw[..], &quoted[..], serde_json::to_string(&s).unwrap().as_bytes()] {
            prop_assert_eq!(super::text(v).map(|c| c.into_owned()), parsed(v));
        }
    }
}
