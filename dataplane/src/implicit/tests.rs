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
