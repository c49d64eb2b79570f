use bytes::Bytes;
use nm_types::experiment::{LiveArm, Salt};
use proptest::prelude::*;

use super::*;
use crate::forward::{path_model_span, request_facts};
use crate::providers::builtin;

fn registry() -> Arc<Registry> {
    let specs = builtin().into_iter().map(|(n, mut s)| {
        if n == "groq" {
            s.api_key = Some("gsk-operator".to_owned());
        }
        (n.to_owned(), s)
    });
    Arc::new(Registry::build(specs).unwrap_or_default())
}

fn arm(name: &str, weight: u32, provider: &str, model: &str) -> LiveArm {
    LiveArm {
        name: name.into(),
        weight,
        provider: provider.into(),
        model: model.into(),
    }
}

fn live(id: &str, agent: &str, env: Option<Env>, arms: Vec<LiveArm>) -> Live {
    Live {
        id: id.into(),
        agent: agent.into(),
        env,
        salt: Salt::new([7; 16]),
        arms,
    }
}

fn two_arms() -> Vec<LiveArm> {
    vec![
        arm("control", 1, "openai", "gpt-4o-mini"),
        arm("groq", 1, "groq", "llama-3.3-70b-versatile"),
    ]
}

#[test]
fn applies_only_what_it_can_serve() {
    let e = Experiments::new(registry());
    e.apply(vec![
        live("ok", "bot", None, two_arms()),
        live(
            "unknown-provider",
            "a",
            None,
            vec![arm("x", 1, "nowhere", "m")],
        ),
        live(
            "mixed",
            "b",
            None,
            vec![arm("x", 1, "openai", "m"), arm("y", 1, "anthropic", "n")],
        ),
        live("bad id!", "c", None, two_arms()),
        live("no-arms", "d", None, Vec::new()),
        live("zero", "e", None, vec![arm("x", 0, "openai", "m")]),
    ]);
    assert_eq!(e.applied(), vec![Arc::<str>::from("ok")]);
    // An alias names a provider too.
    e.apply(vec![live(
        "alias",
        "bot",
        None,
        vec![arm("g", 1, "google", "gemini-2.5-flash")],
    )]);
    assert_eq!(e.applied(), vec![Arc::<str>::from("alias")]);
    // A snapshot replaces the whole set.
    e.apply(Vec::new());
    assert!(e.applied().is_empty());
    let s = Some("sess_1");
    assert!(e.assign(Some("bot"), None, s, WireFormat::Gemini).is_none());
}

#[test]
fn matches_agent_env_session_and_format() {
    let e = Experiments::new(registry());
    assert!(
        e.assign(Some("bot"), None, Some("s"), WireFormat::Openai)
            .is_none()
    );
    e.apply(vec![
        live("all-envs", "bot", None, two_arms()),
        live(
            "staging-only",
            "bot",
            Some(Env::Staging),
            vec![arm("only", 1, "openai", "gpt-4.1")],
        ),
    ]);
    let id = |a: Option<Assignment>| a.map(|a| a.id().to_string());
    let o = WireFormat::Openai;
    assert_eq!(
        id(e.assign(Some("bot"), None, Some("s"), o)).as_deref(),
        Some("all-envs")
    );
    assert_eq!(
        id(e.assign(Some("bot"), Some(Env::Production), Some("s"), o)).as_deref(),
        Some("all-envs")
    );
    // An env's own experiment wins over one of every env.
    assert_eq!(
        id(e.assign(Some("bot"), Some(Env::Staging), Some("s"), o)).as_deref(),
        Some("staging-only")
    );
    assert!(e.assign(None, None, Some("s"), o).is_none(), "no agent");
    assert!(e.assign(Some("bot"), None, None, o).is_none(), "no session");
    assert!(e.assign(Some("other"), None, Some("s"), o).is_none());
    assert!(
        e.assign(Some("Bot"), None, Some("s"), o).is_none(),
        "agents are exact"
    );
    assert!(
        e.assign(Some("bot"), None, Some("s"), WireFormat::Anthropic)
            .is_none(),
        "a provider of another wire format"
    );
}

#[test]
fn an_arm_is_sticky_and_knows_its_variant() {
    let e = Experiments::new(registry());
    e.apply(vec![live("exp-1", "bot", None, two_arms())]);
    for session in ["sess_a", "sess_b", "sess_c", "sess_d"] {
        let a = e.assign(Some("bot"), None, Some(session), WireFormat::Openai);
        let b = e.assign(Some("bot"), None, Some(session), WireFormat::Openai);
        let (Some(a), Some(b)) = (a, b) else {
            panic!("not assigned");
        };
        assert_eq!(a.arm, b.arm);
        let live = &a.experiment.live;
        assert!(std::ptr::eq(live.assign(session), &live.arms[a.arm]));
        let arm = a.arm();
        assert_eq!(
            arm.variant.to_str().ok(),
            Some(format!("exp-1/{}", arm.name).as_str())
        );
        let v = a.variant(Some("gpt-4o-mini".to_owned()));
        assert_eq!(
            v.requested_model.is_some(),
            *arm.model != *"gpt-4o-mini",
            "the requested model is kept only when the arm changed it"
        );
        assert_eq!(v.check(), Ok(()));
    }
}

#[test]
fn a_remembered_arm_follows_new_weights_and_other_experiments() {
    let e = Experiments::new(registry());
    let weighted = |a, b| vec![arm("a", a, "openai", "m1"), arm("b", b, "openai", "m2")];
    let arm_of = |session: &str| {
        e.assign(Some("bot"), None, Some(session), WireFormat::Openai)
            .map(|a| (a.id().to_string(), a.arm))
    };
    let sessions: Vec<String> = (0..200).map(|i| format!("sess_{i}")).collect();
    e.apply(vec![live("exp-1", "bot", None, weighted(1, 1))]);
    let first: Vec<_> = sessions.iter().map(|s| arm_of(s)).collect();
    assert!(first.iter().any(|a| a.as_ref().is_some_and(|a| a.1 == 0)));
    // Remembered on this thread: the same answers again.
    assert_eq!(
        sessions.iter().map(|s| arm_of(s)).collect::<Vec<_>>(),
        first
    );
    // Nearly all the weight on arm b: the sessions the new weights move are moved, none kept
    // by the memory (each answer is the rule's, computed afresh).
    let truth = |l: &Live, s: &str| l.arms.iter().position(|a| std::ptr::eq(a, l.assign(s)));
    let moved = live("exp-1", "bot", None, weighted(1, 1_000_000));
    e.apply(vec![moved.clone()]);
    let second: Vec<_> = sessions.iter().map(|s| arm_of(s)).collect();
    for (s, got) in sessions.iter().zip(&second) {
        assert_eq!(got.as_ref().map(|a| a.1), truth(&moved, s), "{s}");
    }
    assert!(first.iter().zip(&second).any(|(a, b)| a != b));
    // Another experiment on the agent: its own assignment, not the last one's.
    let other = live("exp-2", "bot", None, weighted(1_000_000, 1));
    e.apply(vec![other.clone()]);
    for s in &sessions {
        let got = arm_of(s);
        assert_eq!(got.as_ref().map(|a| a.0.as_str()), Some("exp-2"));
        assert_eq!(got.map(|a| a.1), truth(&other, s), "{s}");
    }
}

#[test]
fn weights_hold_over_many_sessions() {
    let e = Experiments::new(registry());
    e.apply(vec![live(
        "w",
        "bot",
        None,
        vec![
            arm("a", 1, "openai", "m1"),
            arm("b", 2, "openai", "m2"),
            arm("c", 1, "groq", "m3"),
        ],
    )]);
    let n = 20_000;
    let mut counts = [0u32; 3];
    for i in 0..n {
        let session = format!("sess_{i}");
        if let Some(a) = e.assign(Some("bot"), None, Some(&session), WireFormat::Openai) {
            counts[a.arm] += 1;
        }
    }
    assert_eq!(counts.iter().sum::<u32>(), n);
    // Binomial standard deviation at n = 20000 is at most 0.35%: 1.5 points is over 4 of them.
    for (count, share) in counts.iter().zip([0.25, 0.5, 0.25]) {
        let got = f64::from(*count) / f64::from(n);
        assert!((got - share).abs() < 0.015, "{counts:?}");
    }
}

#[test]
fn models_are_prepared_for_body_and_path() {
    let e = Experiments::new(registry());
    e.apply(vec![live(
        "x",
        "bot",
        None,
        vec![arm("q", 1, "openai", "we\"ird/m:od\\el é")],
    )]);
    let a = e.assign(Some("bot"), None, Some("s"), WireFormat::Openai);
    let Some(a) = a else { panic!("not assigned") };
    let arm = a.arm();
    assert_eq!(&arm.model_json[..], r#"we\"ird/m:od\\el é"#.as_bytes());
    assert_eq!(&*arm.model_path, "we%22ird%2Fm%3Aod%5Cel%20%C3%A9");
}

#[test]
fn rewrites_a_gemini_path_segment() {
    let path = "/v1beta/models/gemini-2.0-flash:streamGenerateContent";
    let span = path_model_span(path).unwrap_or_default();
    assert_eq!(
        rewrite_path(path, span, "gemini-2.5-pro"),
        "/v1beta/models/gemini-2.5-pro:streamGenerateContent"
    );
    let path = "/v1/models/m";
    let span = path_model_span(path).unwrap_or_default();
    assert_eq!(rewrite_path(path, span, "n"), "/v1/models/n");
}

#[test]
fn a_model_named_twice_or_not_as_a_string_has_no_span() {
    let span = |b: &'static str| request_facts(&Bytes::from_static(b.as_bytes()), "/").model_span;
    assert_eq!(span(r#"{"model":"m"}"#), Some(10..11));
    assert_eq!(span(r#"{"model":"a","model":"b"}"#), None);
    assert_eq!(span(r#"{"model":7}"#), None);
    assert_eq!(span(r#"{"messages":[{"model":"x"}]}"#), None);
    assert_eq!(span(r#"{"model":""}"#), Some(10..10));
}

// === the rewrite, property-tested ===

/// A JSON string's contents as a client might write them: plain text, every kind of escape.
fn string_contents() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-zA-Z0-9 ._:/-]{1,6}",
        Just(r#"\""#.to_owned()),
        Just(r"\\".to_owned()),
        Just(r"\/".to_owned()),
        Just(r"\n".to_owned()),
        Just(r"\u00e9".to_owned()),
        Just(r"\ud83d\ude00".to_owned()),
        Just("é€".to_owned()),
        Just("model".to_owned()),
    ];
    prop::collection::vec(piece, 0..6).prop_map(|p| p.concat())
}

fn ws() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![Just(" "), Just("\n"), Just("\t"), Just("\r\n")],
        0..3,
    )
    .prop_map(|w| w.concat())
}

/// One top-level member other than the model: nested "model" keys, strings mentioning it.
fn other_member() -> impl Strategy<Value = (String, String)> {
    let value = prop_oneof![
        string_contents().prop_map(|s| format!("\"{s}\"")),
        (string_contents(), string_contents()).prop_map(|(m, c)| format!(
            r#"[{{"role":"user","model":"{m}","content":"{c}"}}, {{"model" : {{"model":"{c}"}}}}]"#
        )),
        (0u32..100_000).prop_map(|n| n.to_string()),
        Just("{\"model\": null, \"x\": [1, 2.5e3, true]}".to_owned()),
    ];
    let key = prop_oneof![
        Just("messages".to_owned()),
        Just("max_tokens".to_owned()),
        Just("metadata".to_owned()),
        Just("modelx".to_owned()),
        Just("xmodel".to_owned()),
        "[a-z_]{1,8}".prop_filter("not the model", |k| k != "model"),
    ];
    (key, value)
}

/// A body: members in any order, whitespace anywhere, the model among them exactly once.
fn body() -> impl Strategy<Value = String> {
    (
        prop::collection::vec((other_member(), ws(), ws()), 0..5),
        string_contents(),
        any::<prop::sample::Index>(),
        ws(),
        ws(),
    )
        .prop_map(|(others, model, at, w1, w2)| {
            let mut members: Vec<String> = others
                .into_iter()
                .map(|((k, v), a, b)| format!("{a}\"{k}\"{b}:{a}{v}{b}"))
                .collect();
            let at = at.index(members.len() + 1);
            members.insert(at, format!("{w1}\"model\"{w2}:{w2}\"{model}\"{w1}"));
            // Keys repeated by the generator would make the comparison below ambiguous.
            let mut seen = std::collections::HashSet::new();
            members.retain(|m| seen.insert(m.split(':').next().map(str::trim).map(str::to_owned)));
            format!("{w1}{{{}}}{w2}", members.join(","))
        })
}

proptest! {
    #[test]
    fn the_rewrite_changes_only_the_model_bytes(body in body(), new in "[ -~é€😀]{0,12}") {
        let input = Bytes::from(body);
        let facts = request_facts(&input, "/v1/chat/completions");
        let span = facts.model_span.clone();
        prop_assert!(span.is_some(), "no span in {:?}", input);
        let span = span.unwrap_or_default();
        let json = serde_json::to_string(&new).unwrap_or_default();
        let model_json = &json.as_bytes()[1..json.len() - 1];
        let out = rewrite_body(&input, span.clone(), model_json);

        // Every byte outside the model's contents is the input's.
        prop_assert_eq!(&out[..span.start], &input[..span.start]);
        prop_assert_eq!(&out[span.start + model_json.len()..], &input[span.end..]);
        prop_assert_eq!(&out[span.start..span.start + model_json.len()], model_json);

        // And the output is the same JSON with the new model.
        let mut expected: serde_json::Value =
            serde_json::from_slice(&input).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(
            expected.get("model").and_then(|m| m.as_str()),
            facts.model.as_deref()
        );
        expected["model"] = serde_json::Value::String(new.clone());
        let got: serde_json::Value =
            serde_json::from_slice(&out).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(got, expected);
        prop_assert_eq!(request_facts(&out, "/").model, Some(new));
    }
}
