//! Experiments on the proxy path, through real processes: which requests are in one, the one
//! rewrite (the forwarded bytes diffed), cross-provider arms and their credentials, the opt-out,
//! `NM-Variant`, stickiness across dataplanes, weights, and the record.
//!
//! Most tests run real dataplanes (`app::start_dataplane`) against a stand-in controlplane
//! ([`StubLink`]) whose key snapshots carry the live experiments, so the set goes through the
//! link's gRPC mapping and the key watcher exactly as the controlplane's would. The last test
//! creates its experiment through `nm.v1.Experiments` on a real gateway.

use std::net::SocketAddr;

use bytes::Bytes;
use nm_types::Env;
use nm_types::experiment::{Live, LiveArm, Salt};

use crate::common::eventually;
use crate::common::http::{Answer, client, read, request, send};
use crate::common::mock::MockProvider;
use crate::common::stub_link::{STUB_KEY, StubLink};

fn arm(name: &str, weight: u32, provider: &str, model: &str) -> LiveArm {
    LiveArm {
        name: name.into(),
        weight,
        provider: provider.into(),
        model: model.into(),
    }
}

fn live(id: &str, agent: &str, arms: Vec<LiveArm>) -> Live {
    Live {
        id: id.into(),
        agent: agent.into(),
        env: None,
        salt: Salt::new(*b"0123456789abcdef"),
        arms,
    }
}

async fn call(
    http: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Answer {
    let mut h = vec![("nm-key", STUB_KEY), ("content-type", "application/json")];
    h.extend_from_slice(headers);
    let url = format!("http://{http}{path}");
    read(send(&client(), request("POST", &url, &h, body)).await).await
}

fn http_of(dp: &nm_gateway::app::Running) -> SocketAddr {
    dp.http_addr.unwrap_or_else(|| panic!("no http address"))
}

/// What the mock's answer says: a minimal OpenAI chat completion with usage.
fn openai_answer(model: &str) -> String {
    format!(
        r#"{{"id":"c1","object":"chat.completion","model":"{model}","choices":[{{"index":0,"message":{{"role":"assistant","content":"hi"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}}}"#
    )
}

/// A body a client might send: the model among other members, `"model"` keys nested in the
/// messages, escapes, odd whitespace.
const BODY: &str = "{\n  \"messages\": [{\"role\": \"user\", \"model\": \"not-this\", \
    \"content\": \"say \\\"model\\\": \\u00e9\"}],\r\n  \"model\" :\t\"gpt-4o-mini\" ,\
    \"metadata\": {\"model\": \"nor-this\"}, \"max_tokens\": 7}";

#[tokio::test]
async fn only_the_model_bytes_change_and_the_answer_names_the_variant() {
    let openai = MockProvider::json(openai_answer("gpt-4.1")).start().await;
    let stub = StubLink::start(vec![live(
        "exp-bytes",
        "bot",
        vec![arm("bigger", 1, "openai", "gpt-4.1")],
    )])
    .await;
    let (dp, _dir) = stub
        .dataplane(&[("NM_UPSTREAM_OPENAI", openai.url.as_str())])
        .await;
    let a = call(
        http_of(&dp),
        "/openai/v1/chat/completions",
        &[
            ("nm-agent", "bot"),
            ("nm-session", "sess_one"),
            ("authorization", "Bearer sk-client"),
        ],
        BODY,
    )
    .await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.header("nm-variant"), Some("exp-bytes/bigger"));

    let got = openai.last();
    let expected = BODY.replacen("\"gpt-4o-mini\"", "\"gpt-4.1\"", 1);
    assert_eq!(
        std::str::from_utf8(&got.body).ok(),
        Some(expected.as_str()),
        "only the top-level model's bytes differ"
    );
    // The byte diff: one run of differing bytes, inside the model's quotes.
    let (sent, received) = (BODY.as_bytes(), &got.body[..]);
    let head = sent
        .iter()
        .zip(received)
        .take_while(|(a, b)| a == b)
        .count();
    let tail = sent
        .iter()
        .rev()
        .zip(received.iter().rev())
        .take_while(|(a, b)| a == b)
        .count();
    assert_eq!(&sent[head..sent.len() - tail], b"o-mini");
    assert_eq!(&received[head..received.len() - tail], b".1");
    // Same provider: the client's own credential goes with it.
    assert_eq!(got.header("authorization"), Some("Bearer sk-client"));
    assert_eq!(
        got.header("content-length"),
        Some(expected.len().to_string().as_str())
    );

    let request_id = a.header("nm-request-id").unwrap_or_default().to_owned();
    let record = stub.record(&request_id).await;
    assert_eq!(record.model.as_deref(), Some("gpt-4.1"));
    assert_eq!(&*record.provider, "openai");
    let variant = record.variant.unwrap_or_else(|| panic!("no variant"));
    assert_eq!(
        (&*variant.experiment, &*variant.arm),
        ("exp-bytes", "bigger")
    );
    assert_eq!(variant.requested_model.as_deref(), Some("gpt-4o-mini"));
    // Cost follows the served model: gpt-4.1's price, not gpt-4o-mini's.
    let prices = nm_dataplane::pricing::PriceTable::builtin();
    let served = prices.cost("openai", Some("gpt-4.1"), &record.usage);
    let requested = prices.cost("openai", Some("gpt-4o-mini"), &record.usage);
    assert!(record.cost_micros.is_some());
    assert_eq!(record.cost_micros, served.micros());
    assert_ne!(record.cost_micros, requested.micros());
}

#[tokio::test]
async fn outside_experiments_requests_pass_byte_for_byte() {
    let openai = MockProvider::json(openai_answer("gpt-4o-mini"))
        .start()
        .await;
    let mut e = live("exp-out", "bot", vec![arm("b", 1, "openai", "gpt-4.1")]);
    e.env = Some(Env::Staging);
    let stub = StubLink::start(vec![e]).await;
    let (dp, _dir) = stub
        .dataplane(&[("NM_UPSTREAM_OPENAI", openai.url.as_str())])
        .await;
    let http = http_of(&dp);
    for (why, headers) in [
        (
            "no session",
            vec![("nm-agent", "bot"), ("nm-env", "staging")],
        ),
        (
            "another agent",
            vec![
                ("nm-agent", "other"),
                ("nm-session", "sess_x"),
                ("nm-env", "staging"),
            ],
        ),
        (
            "another env",
            vec![
                ("nm-agent", "bot"),
                ("nm-session", "sess_x"),
                ("nm-env", "production"),
            ],
        ),
        (
            "no env",
            vec![("nm-agent", "bot"), ("nm-session", "sess_x")],
        ),
        (
            "opted out",
            vec![
                ("nm-agent", "bot"),
                ("nm-session", "sess_x"),
                ("nm-env", "staging"),
                ("nm-experiment", "off"),
            ],
        ),
    ] {
        let a = call(http, "/openai/v1/chat/completions", &headers, BODY).await;
        assert_eq!(a.status, 200, "{why}");
        assert_eq!(a.header("nm-variant"), None, "{why}");
        assert_eq!(&openai.last().body[..], BODY.as_bytes(), "{why}");
        let record = stub
            .record(a.header("nm-request-id").unwrap_or_default())
            .await;
        assert!(record.variant.is_none(), "{why}");
        assert_eq!(record.model.as_deref(), Some("gpt-4o-mini"), "{why}");
    }
    // In: the same request with its session, agent and env.
    let a = call(
        http,
        "/openai/v1/chat/completions",
        &[
            ("nm-agent", "bot"),
            ("nm-session", "sess_x"),
            ("nm-env", "staging"),
        ],
        BODY,
    )
    .await;
    assert_eq!(a.header("nm-variant"), Some("exp-out/b"));
    // Any other value of NM-Experiment: a clear 400 in the provider's shape.
    let a = call(
        http,
        "/openai/v1/chat/completions",
        &[
            ("nm-agent", "bot"),
            ("nm-session", "sess_x"),
            ("nm-experiment", "maybe"),
        ],
        BODY,
    )
    .await;
    assert_eq!(a.status, 400);
    assert_eq!(a.header("nm-error"), Some("invalid_header"));
    let message = a.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(message.contains("NM-Experiment"), "{message}");
    assert!(message.contains("off"), "{message}");
}

#[tokio::test]
async fn a_gemini_arm_rewrites_the_path_segment() {
    let gemini = MockProvider::json(
        r#"{"candidates":[{"content":{"parts":[{"text":"hi"}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":3,"candidatesTokenCount":1},"modelVersion":"gemini-2.5-pro"}"#,
    )
    .start()
    .await;
    let stub = StubLink::start(vec![live(
        "exp-g",
        "bot",
        vec![arm("pro", 1, "gemini", "gemini-2.5-pro")],
    )])
    .await;
    let (dp, _dir) = stub
        .dataplane(&[("NM_UPSTREAM_GEMINI", gemini.url.as_str())])
        .await;
    let body = r#"{"contents":[{"parts":[{"text":"hi"}]}],"model":"untouched"}"#;
    let a = call(
        http_of(&dp),
        "/gemini/v1beta/models/gemini-2.0-flash:generateContent?alt=json&key=client-key",
        &[("nm-agent", "bot"), ("nm-session", "sess_g")],
        body,
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("nm-variant"), Some("exp-g/pro"));
    let got = gemini.last();
    assert_eq!(
        got.path_and_query,
        "/v1beta/models/gemini-2.5-pro:generateContent?alt=json&key=client-key"
    );
    assert_eq!(
        &got.body[..],
        body.as_bytes(),
        "a Gemini body is not touched"
    );
    let record = stub
        .record(a.header("nm-request-id").unwrap_or_default())
        .await;
    assert_eq!(record.model.as_deref(), Some("gemini-2.5-pro"));
    assert_eq!(
        record.variant.and_then(|v| v.requested_model).as_deref(),
        Some("gemini-2.0-flash")
    );
}

#[tokio::test]
async fn a_cross_provider_arm_gets_the_operators_credential_never_the_clients() {
    let openai = MockProvider::json(openai_answer("gpt-4o-mini"))
        .start()
        .await;
    let groq = MockProvider::json(openai_answer("llama-3.3-70b-versatile"))
        .start()
        .await;
    let stub = StubLink::start(vec![live(
        "exp-x",
        "bot",
        vec![arm("groq", 1, "groq", "llama-3.3-70b-versatile")],
    )])
    .await;
    let (dp, _dir) = stub
        .dataplane(&[
            ("NM_UPSTREAM_OPENAI", openai.url.as_str()),
            ("NM_UPSTREAM_GROQ", groq.url.as_str()),
            ("NM_PROVIDER_KEY_GROQ", "gsk-operator"),
        ])
        .await;
    let a = call(
        http_of(&dp),
        "/openai/v1/chat/completions?key=client-in-query&x=1",
        &[
            ("nm-agent", "bot"),
            ("nm-session", "sess_c"),
            ("authorization", "Bearer sk-client-openai"),
            ("api-key", "azure-client"),
            ("x-api-key", "anthropic-client"),
            ("x-goog-api-key", "goog-client"),
        ],
        BODY,
    )
    .await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.header("nm-variant"), Some("exp-x/groq"));
    assert!(
        openai.received().is_empty(),
        "nothing reached the addressed provider"
    );
    let got = groq.last();
    assert_eq!(got.path_and_query, "/v1/chat/completions?x=1");
    assert_eq!(got.header("authorization"), Some("Bearer gsk-operator"));
    for h in ["api-key", "x-api-key", "x-goog-api-key"] {
        assert_eq!(got.header(h), None, "{h} forwarded");
    }
    let text = format!("{:?}{}", got.headers, got.path_and_query);
    assert!(
        !text.contains("client"),
        "a client credential went to groq: {text}"
    );
    assert_eq!(
        &got.body[..],
        BODY.replacen("\"gpt-4o-mini\"", "\"llama-3.3-70b-versatile\"", 1)
            .as_bytes()
    );
    let record = stub
        .record(a.header("nm-request-id").unwrap_or_default())
        .await;
    assert_eq!(&*record.provider, "groq");
    assert_eq!(record.model.as_deref(), Some("llama-3.3-70b-versatile"));
}

#[tokio::test]
async fn an_arm_without_its_providers_credential_leaves_requests_unchanged() {
    let openai = MockProvider::json(openai_answer("gpt-4o-mini"))
        .start()
        .await;
    let groq = MockProvider::json(openai_answer("x")).start().await;
    let stub = StubLink::start(vec![live(
        "exp-nokey",
        "bot",
        vec![arm("groq", 1, "groq", "llama-3.3-70b-versatile")],
    )])
    .await;
    let (dp, _dir) = stub
        .dataplane(&[
            ("NM_UPSTREAM_OPENAI", openai.url.as_str()),
            ("NM_UPSTREAM_GROQ", groq.url.as_str()),
        ])
        .await;
    let a = call(
        http_of(&dp),
        "/openai/v1/chat/completions",
        &[
            ("nm-agent", "bot"),
            ("nm-session", "sess_c"),
            ("authorization", "Bearer sk-client-openai"),
        ],
        BODY,
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("nm-variant"), None);
    assert!(groq.received().is_empty());
    assert_eq!(&openai.last().body[..], BODY.as_bytes());
}

#[tokio::test]
async fn the_gateways_own_error_answer_names_the_variant_too() {
    // The arm's provider points at a port nobody listens on: a 502 of the gateway's.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let dead = format!(
        "http://{}",
        closed.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    drop(closed);
    let stub = StubLink::start(vec![live(
        "exp-err",
        "bot",
        vec![arm("a", 1, "openai", "gpt-4.1")],
    )])
    .await;
    let (dp, _dir) = stub
        .dataplane(&[("NM_UPSTREAM_OPENAI", dead.as_str())])
        .await;
    let a = call(
        http_of(&dp),
        "/openai/v1/chat/completions",
        &[("nm-agent", "bot"), ("nm-session", "sess_e")],
        BODY,
    )
    .await;
    assert_eq!(a.status, 502);
    assert_eq!(a.header("nm-error"), Some("upstream_unreachable"));
    assert_eq!(a.header("nm-variant"), Some("exp-err/a"));
    let record = stub
        .record(a.header("nm-request-id").unwrap_or_default())
        .await;
    assert_eq!(
        record.variant.map(|v| v.arm.to_string()).as_deref(),
        Some("a")
    );
}

#[tokio::test]
async fn the_requests_spans_name_the_experiment_and_arm() {
    use crate::common::otlp::{OtlpReceiver, SpanKind};

    let otlp = OtlpReceiver::start().await;
    let openai = MockProvider::json(openai_answer("gpt-4.1")).start().await;
    let stub = StubLink::start(vec![live(
        "exp-span",
        "bot",
        vec![arm("bigger", 1, "openai", "gpt-4.1")],
    )])
    .await;
    let endpoint = otlp.grpc_endpoint();
    let (dp, _dir) = stub
        .dataplane(&[
            ("NM_UPSTREAM_OPENAI", openai.url.as_str()),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "50"),
        ])
        .await;
    let a = call(
        http_of(&dp),
        "/openai/v1/chat/completions",
        &[("nm-agent", "bot"), ("nm-session", "sess_s")],
        BODY,
    )
    .await;
    assert_eq!(a.header("nm-variant"), Some("exp-span/bigger"));
    let trace = a.trace_id();
    let spans = otlp
        .wait_for("both spans", std::time::Duration::from_secs(15), |s| {
            s.iter()
                .filter(|s| s.trace_id == trace && s.str("nm.arm").is_some())
                .count()
                == 2
        })
        .await;
    for kind in [SpanKind::Server, SpanKind::Client] {
        let span = spans
            .iter()
            .find(|s| s.trace_id == trace && s.kind == kind)
            .unwrap_or_else(|| panic!("no {kind:?} span"));
        assert_eq!(span.str("nm.experiment"), Some("exp-span"), "{kind:?}");
        assert_eq!(span.str("nm.arm"), Some("bigger"), "{kind:?}");
    }
    let client = spans
        .iter()
        .find(|s| s.trace_id == trace && s.kind == SpanKind::Client);
    assert_eq!(
        client.and_then(|s| s.str("gen_ai.request.model")),
        Some("gpt-4.1"),
        "the CLIENT span names the model served"
    );
}

#[tokio::test]
async fn sessions_are_sticky_across_dataplanes_and_weights_hold() {
    let openai = MockProvider::json(openai_answer("m")).start().await;
    let stub = StubLink::start(vec![live(
        "exp-w",
        "bot",
        vec![
            arm("small", 1, "openai", "gpt-4o-mini"),
            arm("big", 3, "openai", "gpt-4.1"),
        ],
    )])
    .await;
    let env = [("NM_UPSTREAM_OPENAI", openai.url.as_str())];
    let (one, _d1) = stub.dataplane(&env).await;
    let (two, _d2) = stub.dataplane(&env).await;
    let n = 400;
    let mut big = 0;
    for i in 0..n {
        let session = format!("sess_{i:04}");
        let h = [("nm-agent", "bot"), ("nm-session", session.as_str())];
        let a = call(http_of(&one), "/openai/v1/chat/completions", &h, BODY).await;
        let b = call(http_of(&two), "/openai/v1/chat/completions", &h, BODY).await;
        let (va, vb) = (a.header("nm-variant"), b.header("nm-variant"));
        assert!(va.is_some());
        assert_eq!(va, vb, "{session} saw two arms");
        // And it got the arm's model.
        let model = if va == Some("exp-w/big") {
            big += 1;
            "gpt-4.1"
        } else {
            "gpt-4o-mini"
        };
        let sent = &openai.last().body;
        assert_eq!(
            &sent[..],
            BODY.replacen("\"gpt-4o-mini\"", &format!("\"{model}\""), 1)
                .as_bytes()
        );
    }
    // 3:1. The binomial standard deviation at n = 400 is 2.2 points; 9 points is over four.
    let share = f64::from(big) / f64::from(n);
    assert!((share - 0.75).abs() < 0.09, "big got {big} of {n}");

    // A snapshot without the experiment ends it on every dataplane.
    stub.set_experiments(Vec::new());
    for dp in [&one, &two] {
        eventually(
            std::time::Duration::from_secs(10),
            "experiment gone",
            || async {
                let a = call(
                    http_of(dp),
                    "/openai/v1/chat/completions",
                    &[("nm-agent", "bot"), ("nm-session", "sess_0001")],
                    BODY,
                )
                .await;
                a.header("nm-variant").is_none().then_some(())
            },
        )
        .await;
    }
    assert_eq!(&openai.last().body[..], BODY.as_bytes());
}

/// End to end: an experiment created over `nm.v1.Experiments` reaches the proxy through the key
/// stream, both arms serve, the records keep their variants and `GetExperiment` counts them; a
/// promotion sends every session to the winner.
#[tokio::test]
async fn an_experiment_created_over_grpc_reaches_the_proxy() {
    use crate::common::gateway::{TestGateway, admin};
    use nm_gateway::grpc::pb;

    let openai = MockProvider::json(openai_answer("gpt-4o-mini"))
        .start()
        .await;
    let groq = MockProvider::json(openai_answer("llama-3.3-70b-versatile"))
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", openai.url.as_str())
        .upstream("groq", groq.url.as_str())
        .env("NM_PROVIDER_KEY_GROQ", "gsk-operator")
        .run()
        .await;
    let mut client = pb::experiments_client::ExperimentsClient::new(gw.grpc_channel().await);
    let created = client
        .create_experiment(admin(pb::CreateExperimentRequest {
            agent: "bot".to_owned(),
            arms: vec![
                pb::ExperimentArmSpec {
                    name: "control".to_owned(),
                    provider: "openai".to_owned(),
                    model: "gpt-4o-mini".to_owned(),
                    weight: 1,
                },
                pb::ExperimentArmSpec {
                    name: "groq".to_owned(),
                    provider: "groq".to_owned(),
                    model: "llama-3.3-70b-versatile".to_owned(),
                    weight: 1,
                },
            ],
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("create: {e}"))
        .into_inner();
    let mut seen = std::collections::HashSet::new();
    for i in 0..40 {
        let session = format!("sess_{i}");
        let a = eventually(
            std::time::Duration::from_secs(10),
            "in the experiment",
            || {
                let session = session.clone();
                let gw = &gw;
                async move {
                    let a = gw
                        .post(
                            "/openai/v1/chat/completions",
                            &[("nm-agent", "bot"), ("nm-session", session.as_str())],
                            BODY,
                        )
                        .await;
                    a.header("nm-variant").is_some().then_some(a)
                }
            },
        )
        .await;
        let variant = a.header("nm-variant").unwrap_or_default().to_owned();
        assert!(
            variant.starts_with(&format!("{}/", created.id)),
            "{variant}"
        );
        seen.insert(variant);
    }
    assert_eq!(seen.len(), 2, "both arms served: {seen:?}");
    assert!(
        groq.received()
            .iter()
            .all(|r| r.header("authorization") == Some("Bearer gsk-operator"))
    );
    // The records keep their arms, and the report counts them.
    let report = eventually(std::time::Duration::from_secs(10), "40 sessions", || {
        let mut client = client.clone();
        let id = created.id.clone();
        async move {
            let r = client
                .get_experiment(admin(pb::GetExperimentRequest { id }))
                .await
                .ok()?
                .into_inner();
            (r.arms.iter().map(|a| a.sessions).sum::<u64>() == 40).then_some(r)
        }
    })
    .await;
    assert!(
        report
            .arms
            .iter()
            .all(|a| a.sessions > 0 && a.requests == a.sessions)
    );
    // Promoted: every session goes to the winner.
    client
        .promote_experiment(admin(pb::PromoteExperimentRequest {
            id: created.id.clone(),
            arm: "groq".to_owned(),
            reason: String::new(),
        }))
        .await
        .unwrap_or_else(|e| panic!("promote: {e}"));
    let winner = format!("{}/groq", created.id);
    for i in 0..10 {
        let session = format!("sess_after_{i}");
        eventually(std::time::Duration::from_secs(10), "promoted", || {
            let session = session.clone();
            let gw = &gw;
            let winner = winner.clone();
            async move {
                let a = gw
                    .post(
                        "/openai/v1/chat/completions",
                        &[("nm-agent", "bot"), ("nm-session", session.as_str())],
                        BODY,
                    )
                    .await;
                (a.header("nm-variant") == Some(winner.as_str())).then_some(())
            }
        })
        .await;
    }
}
