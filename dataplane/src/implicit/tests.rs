//! The rules end to end, without a network: request bodies of each wire format read by the
//! request scanner, answers (JSON and SSE) read by the usage meter, the memory between them.

use std::time::{Duration, Instant};

use bytes::Bytes;
use nm_types::record::Inferred;
use nm_types::signal::Rule;
use proptest::prelude::*;

use super::conversation::Conversation;
use super::*;
use crate::forward::request_facts_with;
use crate::providers::WireFormat;
use crate::usage::text::AnswerText;
use crate::usage::{Framing, Meter};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Chat,
    Anthropic,
    Gemini,
    Responses,
}

const FORMATS: [Format; 4] = [
    Format::Chat,
    Format::Anthropic,
    Format::Gemini,
    Format::Responses,
];

fn q(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

/// A request body: the system prompt, then turns `(is_user, text)`.
fn request(format: Format, turns: &[(bool, &str)]) -> String {
    let list: Vec<String> = turns
        .iter()
        .map(|(user, text)| match format {
            Format::Chat => format!(
                r#"{{"role":"{}","content":{}}}"#,
                if *user { "user" } else { "assistant" },
                q(text)
            ),
            Format::Anthropic => format!(
                r#"{{"role":"{}","content":[{{"type":"text","text":{}}}]}}"#,
                if *user { "user" } else { "assistant" },
                q(text)
            ),
            Format::Gemini if *user => format!(r#"{{"parts":[{{"text":{}}}]}}"#, q(text)),
            Format::Gemini => format!(
                r#"{{"role":"model","parts":[{{"text":{}}},{{"text":"hidden","thought":true}}]}}"#,
                q(text)
            ),
            Format::Responses if *user => format!(r#"{{"role":"user","content":{}}}"#, q(text)),
            Format::Responses => format!(
                r#"{{"type":"message","role":"assistant","content":[{{"type":"output_text","text":{}}}]}}"#,
                q(text)
            ),
        })
        .collect();
    let list = list.join(",");
    match format {
        Format::Chat => format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"Be brief."}},{list}],"stream":true}}"#
        ),
        Format::Anthropic => {
            format!(r#"{{"model":"m","max_tokens":9,"system":"Be brief.","messages":[{list}]}}"#)
        }
        Format::Gemini => format!(
            r#"{{"contents":[{list}],"systemInstruction":{{"parts":[{{"text":"Be brief."}}]}}}}"#
        ),
        Format::Responses => {
            format!(r#"{{"model":"m","instructions":"Be brief.","input":[{list}]}}"#)
        }
    }
}

/// An answer carrying `text`, JSON or streamed in pieces.
fn answer(format: Format, framing: Framing, text: &str) -> (WireFormat, Vec<String>) {
    let pieces: Vec<String> = {
        let chars: Vec<char> = text.chars().collect();
        chars.chunks(3).map(|c| c.iter().collect()).collect()
    };
    let wire = match format {
        Format::Chat | Format::Responses => WireFormat::Openai,
        Format::Anthropic => WireFormat::Anthropic,
        Format::Gemini => WireFormat::Gemini,
    };
    let frames = match (format, framing) {
        (Format::Chat, Framing::Json) => vec![format!(
            r#"{{"id":"c","object":"chat.completion","model":"m","choices":[{{"index":0,"message":{{"role":"assistant","content":{}}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":5,"completion_tokens":7}}}}"#,
            q(text)
        )],
        (Format::Chat, Framing::Sse) => pieces
            .iter()
            .map(|p| {
                format!(
                    "data: {{\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}},\"finish_reason\":null}}],\"usage\":null}}\n\n",
                    q(p)
                )
            })
            .chain(["data: [DONE]\n\n".to_owned()])
            .collect(),
        (Format::Anthropic, Framing::Json) => vec![format!(
            r#"{{"id":"msg","type":"message","model":"m","content":[{{"type":"thinking","thinking":"no"}},{{"type":"text","text":{}}}],"stop_reason":"end_turn","usage":{{"input_tokens":5,"output_tokens":7}}}}"#,
            q(text)
        )],
        (Format::Anthropic, Framing::Sse) => {
            let mut out = vec![
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"m\",\"usage\":{\"input_tokens\":5}}}\n\n".to_owned(),
                "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"no\"}}\n\n".to_owned(),
            ];
            out.extend(pieces.iter().map(|p| format!(
                "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":1,\"delta\":{{\"type\":\"text_delta\",\"text\":{}}}}}\n\n",
                q(p)
            )));
            out.push("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":7}}\n\n".to_owned());
            out
        }
        (Format::Gemini, Framing::Json) => vec![format!(
            r#"{{"candidates":[{{"content":{{"parts":[{{"text":"mulling","thought":true}},{{"text":{}}}],"role":"model"}},"index":0,"finishReason":"STOP"}}],"modelVersion":"m"}}"#,
            q(text)
        )],
        (Format::Gemini, Framing::Sse) => pieces
            .iter()
            .map(|p| {
                format!(
                    "data: {{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":{}}}],\"role\":\"model\"}},\"index\":0}}]}}\r\n\r\n",
                    q(p)
                )
            })
            .collect(),
        (Format::Responses, Framing::Json) => vec![format!(
            r#"{{"id":"r","object":"response","status":"completed","model":"m","output":[{{"type":"reasoning","summary":[]}},{{"type":"message","role":"assistant","content":[{{"type":"output_text","text":{}}}]}}],"usage":{{"input_tokens":5,"output_tokens":7}}}}"#,
            q(text)
        )],
        (Format::Responses, Framing::Sse) => pieces
            .iter()
            .map(|p| {
                format!(
                    "event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\"delta\":{}}}\n\n",
                    q(p)
                )
            })
            .chain(["event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"status\":\"completed\",\"usage\":{\"input_tokens\":5,\"output_tokens\":7}}}\n\n".to_owned()])
            .collect(),
    };
    (wire, frames)
}

fn id() -> String {
    uuid::Uuid::now_v7().hyphenated().to_string()
}

struct Gateway {
    implicit: Implicit,
    now: Instant,
}

impl Gateway {
    fn new(rules: Rules) -> Self {
        Self {
            implicit: Implicit::new(
                Settings {
                    rules,
                    ..Settings::default()
                },
                crate::metrics::Metrics::default(),
            ),
            now: Instant::now(),
        }
    }

    /// One request and its answer, as the proxy and the body's end do it: the inferred signals
    /// on its record, and its request id.
    fn exchange(
        &self,
        session: &str,
        body: &str,
        format: Format,
        framing: Framing,
        text: &str,
    ) -> (Vec<Inferred>, String) {
        let body = Bytes::from(body.to_owned());
        let rules = self.implicit.rules_for(Some("agent"));
        let mut inferred = Vec::new();
        let mut conversation = Conversation::new(self.implicit.keys(), &body);
        request_facts_with(&body, "/v1/chat/completions", Some(&mut conversation));
        let pending = self.implicit.infer(
            rules,
            self.implicit.session_key("key", session),
            &conversation.finish(),
            &body,
            self.now,
            &mut inferred,
        );
        let (wire, frames) = answer(format, framing, text);
        let mut meter = Meter::new(wire, framing);
        if let Some(keep) = pending.wants_text() {
            meter = meter.with_text(AnswerText::new(self.implicit.keys(), keep));
        }
        for frame in &frames {
            meter.feed(frame.as_bytes());
        }
        let (_, digest) = meter.finish_with_text();
        let request_id = id();
        self.implicit
            .remember(&pending, &request_id, true, true, digest, self.now);
        (inferred, request_id)
    }
}

const ANSWER: &str = "Voilà — the plan: 1. café ☕ 2. 日本語 \"quoted\" \\ done.";

#[test]
fn each_rule_in_each_format_json_and_streamed() {
    for format in FORMATS {
        for framing in [Framing::Json, Framing::Sse] {
            let gw = Gateway::new(Rules::ALL);
            let ctx = format!("{format:?} {framing:?}");
            let first = request(format, &[(true, "What is the plan?")]);
            let (inferred, a1) = gw.exchange("sess_a", &first, format, framing, ANSWER);
            assert!(inferred.is_empty(), "{ctx}: {inferred:?}");

            // The same conversation again: the first answer was regenerated.
            let (inferred, a2) = gw.exchange("sess_a", &first, format, framing, ANSWER);
            assert_eq!(rules_of(&inferred), [Rule::Reask], "{ctx}");
            assert_eq!(inferred[0].answer.as_str(), a1, "{ctx}");

            // The last answer (a2) comes back unchanged: continued.
            let next = request(
                format,
                &[
                    (true, "What is the plan?"),
                    (false, ANSWER),
                    (true, "And then?"),
                ],
            );
            let (inferred, a3) = gw.exchange("sess_a", &next, format, framing, "Then rest.");
            assert_eq!(rules_of(&inferred), [Rule::Continued], "{ctx}");
            assert_eq!(inferred[0].answer.as_str(), a2, "{ctx}");

            // a3 comes back edited: three characters changed.
            let edited = request(
                format,
                &[
                    (true, "What is the plan?"),
                    (false, ANSWER),
                    (true, "And then?"),
                    (false, "Then rest!!!"),
                    (true, "Thanks"),
                ],
            );
            let (inferred, _) = gw.exchange("sess_a", &edited, format, framing, "ok");
            assert_eq!(rules_of(&inferred), [Rule::HistoryEdit], "{ctx}");
            assert_eq!(inferred[0].answer.as_str(), a3, "{ctx}");
            assert_eq!(inferred[0].edit_distance, Some(3), "{ctx}");

            // Another session, another key: nothing is shared.
            let (inferred, _) = gw.exchange("sess_b", &first, format, framing, ANSWER);
            assert!(inferred.is_empty(), "{ctx}: {inferred:?}");
        }
    }
}

fn rules_of(inferred: &[Inferred]) -> Vec<Rule> {
    inferred.iter().map(|i| i.rule).collect()
}

#[test]
fn history_counts_only_when_it_follows_the_answered_conversation() {
    let gw = Gateway::new(Rules::ALL);
    let format = Format::Chat;
    let first = request(format, &[(true, "Q1")]);
    gw.exchange("sess_a", &first, format, Framing::Json, "A1");
    // A new thread in the same session whose assistant turn is some other text: not the
    // previous answer coming back.
    let other = request(format, &[(true, "Q9"), (false, "zzz"), (true, "Q10")]);
    let (inferred, _) = gw.exchange("sess_a", &other, format, Framing::Json, "A2");
    assert!(inferred.is_empty(), "{inferred:?}");
}

#[test]
fn rules_switched_off_leave_nothing() {
    let gw = Gateway::new(Rules::NONE.with(Rule::ClientDisconnect));
    let format = Format::Chat;
    let first = request(format, &[(true, "Q1")]);
    gw.exchange("sess_a", &first, format, Framing::Json, "A1");
    let (inferred, _) = gw.exchange("sess_a", &first, format, Framing::Json, "A1");
    assert!(inferred.is_empty());
    assert_eq!(gw.implicit.memory().sessions(), 0, "kept something");

    // history_edit off: `continued` alone keeps no text, and an edit is not judged.
    let gw = Gateway::new(Rules::NONE.with(Rule::Continued));
    gw.exchange("sess_a", &first, format, Framing::Json, "A1");
    let back = request(format, &[(true, "Q1"), (false, "A1"), (true, "Q2")]);
    let (inferred, _) = gw.exchange("sess_a", &back, format, Framing::Json, "A2");
    assert_eq!(rules_of(&inferred), [Rule::Continued]);
    let edited = request(
        format,
        &[
            (true, "Q1"),
            (false, "A1"),
            (true, "Q2"),
            (false, "A2!"),
            (true, "Q3"),
        ],
    );
    let (inferred, _) = gw.exchange("sess_a", &edited, format, Framing::Json, "A3");
    assert!(inferred.is_empty(), "{inferred:?}");
    assert!(
        gw.implicit.memory().bytes() < 1024,
        "text kept without history_edit"
    );
}

#[test]
fn rules_are_switched_off_per_agent() {
    let settings = Settings {
        off_by_agent: parse_off_by_agent("bot:reask, ops:team:all").unwrap(),
        ..Settings::default()
    };
    let implicit = Implicit::new(settings, crate::metrics::Metrics::default());
    assert!(!implicit.rules_for(Some("bot")).has(Rule::Reask));
    assert!(implicit.rules_for(Some("bot")).has(Rule::HistoryEdit));
    assert!(implicit.rules_for(Some("ops:team")).is_empty());
    assert_eq!(implicit.rules_for(Some("other")), Rules::ALL);
    assert_eq!(implicit.rules_for(None), Rules::ALL);
    assert!(parse_off_by_agent("bot").is_err());
    assert!(parse_off_by_agent("bot:nope").is_err());
    assert_eq!(Rules::parse("off"), Ok(Rules::NONE));
    assert_eq!(Rules::parse("all"), Ok(Rules::ALL));
    assert_eq!(
        Rules::parse("reask, continued"),
        Ok(Rules::NONE.with(Rule::Reask).with(Rule::Continued))
    );
    assert!(Rules::parse("reask,bogus").is_err());
    assert!(Rules::parse(" , ").is_err());
}

#[test]
fn a_reask_outside_the_window_is_none() {
    let mut gw = Gateway::new(Rules::ALL);
    let first = request(Format::Chat, &[(true, "Q1")]);
    gw.exchange("sess_a", &first, Format::Chat, Framing::Json, "A1");
    gw.now += DEFAULT_REASK_WINDOW + Duration::from_secs(1);
    let (inferred, _) = gw.exchange("sess_a", &first, Format::Chat, Framing::Json, "A1");
    assert!(inferred.is_empty(), "{inferred:?}");
}

#[test]
fn memory_stays_under_its_cap_and_counts_what_it_forgets() {
    let metrics = crate::metrics::Metrics::default();
    let cap = 256 * 1024;
    let implicit = Implicit::new(
        Settings {
            memory_bytes: cap,
            ..Settings::default()
        },
        metrics.clone(),
    );
    let gw = Gateway {
        implicit,
        now: Instant::now(),
    };
    let long = "x".repeat(5000);
    let first = request(Format::Chat, &[(true, "Q1")]);
    for n in 0..2000 {
        gw.exchange(
            &format!("sess_{n}"),
            &first,
            Format::Chat,
            Framing::Json,
            &long,
        );
        assert!(gw.implicit.memory().bytes() <= cap, "over the cap at {n}");
    }
    let text = metrics.render();
    let evicted: u64 = text
        .lines()
        .find(|l| l.starts_with("nm_implicit_memory_evicted_total{reason=\"cap\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0);
    let held = gw.implicit.memory().sessions() as u64;
    assert_eq!(evicted + held, 2000, "{text}");
    let gauge: i64 = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("nm_implicit_memory_bytes ")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(-1);
    assert_eq!(gauge, gw.implicit.memory().bytes() as i64, "{text}");
    // The newest session is still there: a reask of it is seen.
    let (inferred, _) = gw.exchange("sess_1999", &first, Format::Chat, Framing::Json, "x");
    assert_eq!(rules_of(&inferred), [Rule::Reask]);
}

#[test]
fn agentic_steps_are_no_reask() {
    // OpenAI tool loop: the user's question stays the last user message, but a tool result
    // follows: a new conversation each step.
    let gw = Gateway::new(Rules::ALL);
    let step1 = r#"{"messages":[{"role":"user","content":"weather?"}]}"#;
    let step2 = r#"{"messages":[{"role":"user","content":"weather?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"w","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1","content":"sunny"}]}"#;
    gw.exchange("sess_t", step1, Format::Chat, Framing::Json, "");
    let (inferred, _) = gw.exchange("sess_t", step2, Format::Chat, Framing::Json, "Sunny.");
    assert!(inferred.is_empty(), "{inferred:?}");
}

proptest! {
    /// Hostile bodies: the conversation reader never panics, whatever it is handed.
    #[test]
    fn any_body_is_read_without_harm(body in proptest::collection::vec(any::<u8>(), 0..400)) {
        let implicit = Implicit::new(Settings::default(), crate::metrics::Metrics::default());
        let body = Bytes::from(body);
        let mut c = Conversation::new(implicit.keys(), &body);
        request_facts_with(&body, "/", Some(&mut c));
        let summary = c.finish();
        if let Some(h) = summary.history {
            prop_assert!(h.content.end <= body.len());
        }
    }

    #[test]
    fn json_like_bodies_are_read_without_harm(text in r#"\{"(messages|contents|input|role|content|parts)":[\[\]{}",:a-z ]{0,200}"#) {
        let implicit = Implicit::new(Settings::default(), crate::metrics::Metrics::default());
        let body = Bytes::from(text);
        let mut c = Conversation::new(implicit.keys(), &body);
        request_facts_with(&body, "/", Some(&mut c));
        let _ = c.finish();
    }
}

#[test]
fn a_plain_string_input_is_one_user_turn() {
    let gw = Gateway::new(Rules::ALL);
    let body = r#"{"model":"m","instructions":"Be brief.","input":"What is the plan?"}"#;
    let (inferred, _) = gw.exchange("sess_i", body, Format::Responses, Framing::Json, "A1");
    assert!(inferred.is_empty(), "{inferred:?}");
    let (inferred, _) = gw.exchange("sess_i", body, Format::Responses, Framing::Json, "A1");
    assert_eq!(rules_of(&inferred), [Rule::Reask]);
    // Another system prompt is another conversation.
    let other = body.replace("Be brief.", "Be long.");
    let (inferred, _) = gw.exchange("sess_i", &other, Format::Responses, Framing::Json, "A1");
    assert!(inferred.is_empty(), "{inferred:?}");
}

// === the walk of a list of turns, against the scanner that read the turns before ===

use super::conversation::{List, Part, Turn, Walked, field_tag, value_end, walk};
use crate::forward::request_facts;
use crate::usage::{Scanner, Select};

/// What either reader tells of a list: each field's tag and raw value, each turn's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Told {
    Field(u8),
    End,
}

const fn old_field(tag: u8) -> Select<Told> {
    Select::capture(Told::Field(tag))
}

/// The selection of each turn's fields the request scanner walked before (session 24).
const OLD_TURN: &[(&str, Select<Told>)] = &[
    ("role", old_field(0)),
    ("type", old_field(1)),
    ("content", old_field(2)),
    ("parts", old_field(2)),
    ("tool_calls", old_field(3)),
    ("tool_call_id", old_field(4)),
    ("name", old_field(5)),
    ("function_call", old_field(6)),
    ("call_id", old_field(7)),
    ("arguments", old_field(8)),
    ("output", old_field(9)),
];
const OLD_ELEMENT: Select<Told> = Select::keys(OLD_TURN).ended(Told::End);
static OLD_LIST: Select<Told> = Select::each(&OLD_ELEMENT);

type Heard = Vec<(Told, Vec<u8>)>;

/// The list `raw` (`[` first) as the old scanner told it, and the containers it left open.
fn old_reading(raw: &[u8]) -> (Heard, usize) {
    let mut scanner = Scanner::with_limit(&OLD_LIST, raw.len());
    let mut out = Vec::new();
    scanner.feed(raw, &mut |told, value: &[u8]| {
        out.push((told, value.to_vec()))
    });
    (out, scanner.depth())
}

/// The list as [`walk`] tells it, and how the walk went.
fn new_reading(raw: &[u8]) -> (Heard, Walked) {
    let mut out = Vec::new();
    let walked = walk(raw, &mut |turn| match turn {
        Turn::Field(tag, value) => out.push((Told::Field(tag), value.to_vec())),
        Turn::End => out.push((Told::End, Vec::new())),
    });
    (out, walked)
}

/// Both readers tell the same of `raw` up to where the walk ended, and the scanner's list closed
/// there too when the walk says it did before the end of `raw`. A clean walk ended where the
/// scanner, counting brackets, ends the value.
fn same_reading(raw: &[u8]) -> Result<(), TestCaseError> {
    let (new, walked) = new_reading(raw);
    let end = walked.end;
    prop_assert!(end <= raw.len());
    let (old, open) = old_reading(&raw[..end]);
    prop_assert_eq!(&new, &old, "{}", String::from_utf8_lossy(raw));
    if end < raw.len() {
        prop_assert_eq!(open, 0, "{}", String::from_utf8_lossy(raw));
    }
    if walked.clean {
        prop_assert_eq!(
            value_end(raw, 0),
            Some(end),
            "{}",
            String::from_utf8_lossy(raw)
        );
    }
    Ok(())
}

/// The request scanner of before (session 24): each list of turns and the system prompt
/// captured whole, then read by [`Conversation::feed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Captured {
    Part(Part),
    Other,
}

const CAPTURED_SYSTEM: Select<Captured> = Select::capture(Captured::Part(Part::System));
const CAPTURED_CONFIG: Select<Captured> =
    Select::keys(&[("maxOutputTokens", Select::capture(Captured::Other))]);
static CAPTURED: Select<Captured> = Select::keys(&[
    ("model", Select::capture(Captured::Other)),
    ("max_completion_tokens", Select::capture(Captured::Other)),
    ("max_tokens", Select::capture(Captured::Other)),
    ("max_output_tokens", Select::capture(Captured::Other)),
    ("generationConfig", CAPTURED_CONFIG),
    (
        "messages",
        Select::capture(Captured::Part(Part::Turns(List::Messages))),
    ),
    (
        "contents",
        Select::capture(Captured::Part(Part::Turns(List::Contents))),
    ),
    (
        "input",
        Select::capture(Captured::Part(Part::Turns(List::Input))),
    ),
    ("system", CAPTURED_SYSTEM),
    ("systemInstruction", CAPTURED_SYSTEM),
    ("system_instruction", CAPTURED_SYSTEM),
    ("instructions", CAPTURED_SYSTEM),
]);

/// A body read in one pass ([`request_facts_with`]) gives the same conversation as its lists
/// captured and read apart, and the same facts as a scan without the conversation.
fn same_request(implicit: &Implicit, body: &[u8]) -> Result<(), TestCaseError> {
    let body = Bytes::copy_from_slice(body);
    let mut one_pass = Conversation::new(implicit.keys(), &body);
    let facts = request_facts_with(&body, "/", Some(&mut one_pass));
    prop_assert_eq!(facts, request_facts(&body, "/"));
    let mut apart = Conversation::new(implicit.keys(), &body);
    if body.trim_ascii_start().starts_with(b"{") {
        let mut scanner = Scanner::with_limit(&CAPTURED, body.len());
        scanner.feed(&body, &mut |captured, raw: &[u8]| {
            if let Captured::Part(part) = captured {
                apart.feed(part, raw);
            }
        });
    }
    prop_assert_eq!(
        one_pass.finish(),
        apart.finish(),
        "{}",
        String::from_utf8_lossy(&body)
    );
    Ok(())
}

#[test]
fn the_walk_reads_turns_as_the_scanner_did() {
    let lists: &[&str] = &[
        r#"[]"#,
        r#"[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"text","text":"a \"b\" ]}"}],"refusal":null},{"role":"tool","tool_call_id":"c1","content":"x"}]"#,
        r#"[ { "role" : "user" , "content" : "hi" } , "s", 5, [ {"role":"x"} ], {} , null ]"#,
        r#"[{"parts":[{"text":"q"}]},{"role":"model","parts":[{"text":"a"},{"text":"t","thought":true}]}]"#,
        r#"[{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c","output":"ok"}]"#,
        r#"[{"rol\u0065":"user","content":-1.5e3,"content":true,"name":{"a":[1,{"b":"]"}]}}]"#,
        // Malformed: stray bytes, missing colons and commas, brackets of the other kind.
        r#"[{"role" "user", "content":,"x" zz "name":1 ]"#,
        r#"[{role:"user"}, {"content":"a"} {"content":"b"}}"#,
        r#"[{"content":"a","#,
        r#"[{"content":"a\"#,
        r#"[{"content":tru"#,
        r#"[{"a\"b":"c","role":"user"}]"#,
    ];
    let implicit = Implicit::new(Settings::default(), crate::metrics::Metrics::default());
    for list in lists {
        if let Err(e) = same_reading(list.as_bytes()) {
            panic!("{e}");
        }
        for body in [
            format!(r#"{{"model":"m","messages":{list},"max_tokens":5}}"#),
            format!(r#"{{"input":{list},"model":"m","instructions":"x"}}"#),
            format!(r#"{{"contents":{list}}}"#),
        ] {
            if let Err(e) = same_request(&implicit, body.as_bytes()) {
                panic!("{e}");
            }
        }
    }
    let (told, walked) = new_reading(lists[1].as_bytes());
    assert_eq!(walked.end, lists[1].len());
    assert!(walked.clean);
    assert!(!new_reading(lists[6].as_bytes()).1.clean);
    assert_eq!(told.iter().filter(|(t, _)| *t == Told::End).count(), 3);
    assert_eq!(field_tag(b"parts"), field_tag(b"content"));
}

/// A JSON value whose objects' keys are mostly a turn's fields.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let key = prop_oneof![
        Just("role".to_owned()),
        Just("content".to_owned()),
        Just("parts".to_owned()),
        Just("type".to_owned()),
        Just("tool_calls".to_owned()),
        Just("name".to_owned()),
        Just("output".to_owned()),
        "[a-z_\"\\\\]{0,8}",
    ];
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(serde_json::Value::from),
        r#"[a-z"\\\[\]{},: é😀\n]{0,12}"#.prop_map(serde_json::Value::String),
        prop_oneof![Just("user"), Just("assistant"), Just("model"), Just("tool")]
            .prop_map(|r| serde_json::Value::String(r.to_owned())),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            proptest::collection::vec((key.clone(), inner), 0..6)
                .prop_map(|members| serde_json::Value::Object(members.into_iter().collect())),
        ]
    })
}

proptest! {
    /// Any JSON list, compact or pretty: the walk tells what the scanner told, and ends at the
    /// list's end.
    #[test]
    fn the_walk_reads_any_json_list_as_the_scanner_did(
        items in proptest::collection::vec(json_value(), 0..6),
        pretty in any::<bool>(),
    ) {
        let list = serde_json::Value::Array(items);
        let raw = if pretty {
            serde_json::to_vec_pretty(&list)
        } else {
            serde_json::to_vec(&list)
        }.unwrap();
        same_reading(&raw)?;
        prop_assert_eq!(new_reading(&raw).1, Walked { end: raw.len(), clean: true });
        let implicit = Implicit::new(Settings::default(), crate::metrics::Metrics::default());
        let list = String::from_utf8_lossy(&raw);
        same_request(&implicit, format!(r#"{{"messages":{list},"model":"m"}}"#).as_bytes())?;
    }

    /// A JSON list with a byte or two put in, taken out or changed (malformed input that is
    /// nearly right, where an unclean walk is easiest to miss): the same, in a request too.
    #[test]
    fn the_walk_reads_nearly_json_as_the_scanner_did(
        items in proptest::collection::vec(json_value(), 1..5),
        edits in proptest::collection::vec(
            (any::<prop::sample::Index>(), 0u8..3, prop::sample::select(br#"[]{}":,\ a"#.to_vec())),
            1..3,
        ),
    ) {
        let mut raw = serde_json::to_vec(&serde_json::Value::Array(items)).unwrap();
        for (at, how, byte) in edits {
            let at = at.index(raw.len());
            match how {
                0 => raw.insert(at, byte),
                1 if at > 0 => {
                    raw.remove(at);
                }
                _ => raw[at] = byte,
            }
        }
        if raw.first() == Some(&b'[') {
            same_reading(&raw)?;
        }
        let implicit = Implicit::new(Settings::default(), crate::metrics::Metrics::default());
        let mut body = br#"{"model":"m","messages":"#.to_vec();
        body.extend_from_slice(&raw);
        body.extend_from_slice(br#","max_tokens":7}"#);
        same_request(&implicit, &body)?;
    }

    /// Anything JSON-like after a `[`: the same, however malformed.
    #[test]
    fn the_walk_reads_json_like_garbage_as_the_scanner_did(
        text in r#"\[([\[\]{}",:\\ a-z0-9]|"(role|content|parts|type|name)"){0,80}"#,
    ) {
        same_reading(text.as_bytes())?;
    }

    /// JSON-like request bodies, however malformed: the one pass reads what the scanner and
    /// the lists captured apart read, and the model and caps are read alike with or without
    /// the conversation.
    #[test]
    fn json_like_requests_read_in_one_pass_as_apart(
        text in r#"\{("(messages|contents|input|system|instructions|model|max_tokens)":|\[\{"(role|content|parts|type|name)":|[\[\]{}",:\\ a-z0-9]){0,60}"#,
    ) {
        let implicit = Implicit::new(Settings::default(), crate::metrics::Metrics::default());
        same_request(&implicit, text.as_bytes())?;
    }

    /// Any bytes after a `[`: the same.
    #[test]
    fn the_walk_reads_any_bytes_as_the_scanner_did(
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
    ) {
        let mut raw = b"[".to_vec();
        raw.extend(bytes);
        same_reading(&raw)?;
    }

    /// However a conversation goes, the next request bringing its answer back is read as
    /// following it: its history names the conversation the answer answered, and lies where
    /// the answer's text is in the body.
    #[test]
    fn history_follows_the_conversation_it_answers(
        turns in proptest::collection::vec((any::<bool>(), "[a-z é\"]{0,12}"), 0..6),
        answer in "[a-z é\"]{1,12}",
        format_at in 0usize..4,
    ) {
        let format = FORMATS[format_at];
        let implicit = Implicit::new(Settings::default(), crate::metrics::Metrics::default());
        let summary = |body: &str| {
            let body = Bytes::from(body.to_owned());
            let mut c = Conversation::new(implicit.keys(), &body);
            request_facts_with(&body, "/", Some(&mut c));
            (c.finish(), body)
        };
        let mut asked: Vec<(bool, &str)> =
            turns.iter().map(|(u, t)| (*u, t.as_str())).collect();
        asked.push((true, "question"));
        let (first, _) = summary(&request(format, &asked));
        let mut next = asked.clone();
        next.push((false, &answer));
        next.push((true, "and then?"));
        same_request(&implicit, request(format, &next).as_bytes())?;
        let (second, body) = summary(&request(format, &next));
        let history = second.history.clone();
        prop_assert!(history.is_some());
        let history = history.unwrap();
        prop_assert_eq!(Some(history.after), first.asked);
        prop_assert_ne!(second.asked, first.asked);
        let mut text = AnswerText::new(implicit.keys(), true);
        text.push_raw(&body[history.content]);
        let kept = text.finish().kept;
        prop_assert_eq!(kept.as_ref().map(|k| k.as_str()), Some(answer.as_str()));
        // The same request again asks the same; another system prompt does not.
        prop_assert_eq!(summary(&request(format, &next)).0.asked, second.asked);
        let other = request(format, &next).replace("Be brief.", "Be long.");
        prop_assert_ne!(summary(&other).0.asked, second.asked);
    }
}
