//! OpenTelemetry end to end: the spans a gateway exports, read back by a real OTLP receiver on
//! loopback (tests/common/otlp.rs), over gRPC and HTTP/protobuf.

use std::time::Duration;

use http_body_util::BodyExt;

use crate::common::gateway::{ADMIN_KEY, Builder, TestGateway};
use crate::common::mock::{MockProvider, RunningMock};
use crate::common::otlp::{CollectedSpan, OtlpReceiver, SpanKind, Status};
use crate::common::{fixture, sse_events};

const WAIT: Duration = Duration::from_secs(15);

/// A gateway exporting to `otlp` over gRPC, flushing every 50 ms.
fn traced(otlp: &OtlpReceiver) -> Builder {
    TestGateway::builder()
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.grpc_endpoint())
        .env("OTEL_BSP_SCHEDULE_DELAY", "50")
}

/// A mock `provider` answering the JSON fixture `answer`, and a traced gateway in front of it
/// (to finish with settings of the test's own).
async fn traced_json(otlp: &OtlpReceiver, provider: &str, answer: &str) -> (RunningMock, Builder) {
    let mock = MockProvider::json(fixture(answer)).start().await;
    let builder = traced(otlp).upstream(provider, &mock.url);
    (mock, builder)
}

fn find<'a>(spans: &'a [CollectedSpan], kind: SpanKind, trace: &str) -> Option<&'a CollectedSpan> {
    spans.iter().find(|s| s.kind == kind && s.trace_id == trace)
}

/// Both spans of the request whose answer carried `trace_id`.
async fn request_spans(otlp: &OtlpReceiver, trace_id: &str) -> (CollectedSpan, CollectedSpan) {
    let spans = otlp
        .wait_for("the SERVER and CLIENT spans", WAIT, |s| {
            find(s, SpanKind::Server, trace_id).is_some()
                && find(s, SpanKind::Client, trace_id).is_some()
        })
        .await;
    let server = find(&spans, SpanKind::Server, trace_id).cloned();
    let client = find(&spans, SpanKind::Client, trace_id).cloned();
    (
        server.unwrap_or_else(|| unreachable!()),
        client.unwrap_or_else(|| unreachable!()),
    )
}

struct Case {
    provider: &'static str,
    path: &'static str,
    body: &'static str,
    answer: &'static str,
    streamed: bool,
    system: &'static str,
    operation: &'static str,
    model: &'static str,
}

const CASES: &[Case] = &[
    Case {
        provider: "openai",
        path: "/openai/v1/chat/completions",
        body: r#"{"model":"gpt-4o-mini","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#,
        answer: "openai/chat_response.json",
        streamed: false,
        system: "openai",
        operation: "chat",
        model: "gpt-4o-mini",
    },
    Case {
        provider: "openai",
        path: "/openai/v1/chat/completions",
        body: r#"{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        answer: "openai/chat_stream.sse",
        streamed: true,
        system: "openai",
        operation: "chat",
        model: "gpt-4o-mini",
    },
    Case {
        provider: "anthropic",
        path: "/anthropic/v1/messages",
        body: r#"{"model":"claude-3-5-haiku-latest","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#,
        answer: "anthropic/messages_response.json",
        streamed: false,
        system: "anthropic",
        operation: "chat",
        model: "claude-3-5-haiku-latest",
    },
    Case {
        provider: "anthropic",
        path: "/anthropic/v1/messages",
        body: r#"{"model":"claude-3-5-haiku-latest","max_tokens":64,"stream":true,"messages":[]}"#,
        answer: "anthropic/messages_stream.sse",
        streamed: true,
        system: "anthropic",
        operation: "chat",
        model: "claude-3-5-haiku-latest",
    },
    Case {
        provider: "gemini",
        path: "/gemini/v1beta/models/gemini-2.0-flash:generateContent",
        body: r#"{"contents":[{"parts":[{"text":"hi"}]}]}"#,
        answer: "gemini/generate_response.json",
        streamed: false,
        system: "gcp.gemini",
        operation: "generate_content",
        model: "gemini-2.0-flash",
    },
    Case {
        provider: "gemini",
        path: "/gemini/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse",
        body: r#"{"contents":[{"parts":[{"text":"hi"}]}]}"#,
        answer: "gemini/stream.sse",
        streamed: true,
        system: "gcp.gemini",
        operation: "generate_content",
        model: "gemini-2.0-flash",
    },
    Case {
        provider: "groq",
        path: "/groq/openai/v1/chat/completions",
        body: r#"{"model":"llama-3.1-8b-instant","messages":[]}"#,
        answer: "openai/chat_response.json",
        streamed: false,
        system: "groq",
        operation: "chat",
        model: "llama-3.1-8b-instant",
    },
    Case {
        provider: "groq",
        path: "/groq/openai/v1/chat/completions",
        body: r#"{"model":"llama-3.1-8b-instant","stream":true,"messages":[]}"#,
        answer: "openai/chat_stream.sse",
        streamed: true,
        system: "groq",
        operation: "chat",
        model: "llama-3.1-8b-instant",
    },
    Case {
        provider: "mistral",
        path: "/mistral/v1/chat/completions",
        body: r#"{"model":"mistral-small-latest","messages":[]}"#,
        answer: "openai/chat_response.json",
        streamed: false,
        system: "mistral_ai",
        operation: "chat",
        model: "mistral-small-latest",
    },
    Case {
        provider: "mistral",
        path: "/mistral/v1/chat/completions",
        body: r#"{"model":"mistral-small-latest","stream":true,"messages":[]}"#,
        answer: "openai/chat_stream.sse",
        streamed: true,
        system: "mistral_ai",
        operation: "chat",
        model: "mistral-small-latest",
    },
];

async fn mock_for(case: &Case) -> crate::common::mock::RunningMock {
    if case.streamed {
        MockProvider::sse(sse_events(&fixture(case.answer)))
    } else {
        MockProvider::json(fixture(case.answer))
    }
    .start()
    .await
}

const ATTRIBUTION: &[(&str, &str)] = &[
    ("nm-agent", "support-bot"),
    ("nm-session", "sess_otel1"),
    ("nm-env", "production"),
];

#[tokio::test]
async fn each_provider_json_and_streamed_gives_a_server_and_a_client_span_of_fixed_shape() {
    let otlp = OtlpReceiver::start().await;
    for case in CASES {
        let mock = mock_for(case).await;
        let gw = traced(&otlp).upstream(case.provider, &mock.url).run().await;
        let answer = gw.post(case.path, ATTRIBUTION, case.body).await;
        let what = format!("{} {}", case.provider, case.path);
        assert_eq!(answer.status, 200, "{what}: {:?}", answer.body);
        let trace_id = answer
            .header("nm-trace-id")
            .unwrap_or_else(|| panic!("{what}: no NM-Trace-Id"))
            .to_owned();
        assert_eq!(trace_id.len(), 32, "{what}");
        let (server, client) = request_spans(&otlp, &trace_id).await;

        assert_eq!(server.name, "POST /{provider}/{*native_path}", "{what}");
        assert_eq!(server.parent_span_id, None, "{what}: a new trace");
        assert_eq!(server.str("http.request.method"), Some("POST"));
        assert_eq!(server.str("http.route"), Some("/{provider}/{*native_path}"));
        assert_eq!(server.int("http.response.status_code"), Some(200));
        assert_eq!(server.str("nm.agent"), Some("support-bot"));
        assert_eq!(server.str("nm.env"), Some("production"));
        assert_eq!(
            server.str("nm.request_id"),
            answer.header("nm-request-id"),
            "{what}"
        );
        assert_eq!(server.status, Status::Unset, "{what}");
        assert_eq!(
            server
                .resource
                .get("service.name")
                .map(|v| format!("{v:?}")),
            Some("Str(\"nm-gateway\")".to_owned())
        );
        assert!(server.resource.contains_key("service.version"));

        assert_eq!(
            client.name,
            format!("{} {}", case.operation, case.model),
            "{what}"
        );
        assert_eq!(
            client.parent_span_id.as_deref(),
            Some(server.span_id.as_str()),
            "{what}"
        );
        assert_eq!(
            client.str("gen_ai.operation.name"),
            Some(case.operation),
            "{what}"
        );
        assert_eq!(
            client.str("gen_ai.provider.name"),
            Some(case.system),
            "{what}"
        );
        assert_eq!(
            client.str("gen_ai.request.model"),
            Some(case.model),
            "{what}"
        );
        assert_eq!(
            client.str("gen_ai.conversation.id"),
            Some("sess_otel1"),
            "{what}"
        );
        assert_eq!(client.str("server.address"), Some("127.0.0.1"), "{what}");
        assert!(client.int("server.port").is_some_and(|p| p > 0), "{what}");
        assert_eq!(client.int("http.response.status_code"), Some(200), "{what}");
        assert!(
            client
                .int("gen_ai.usage.input_tokens")
                .is_some_and(|t| t > 0),
            "{what}: {client:?}"
        );
        assert!(
            client
                .int("gen_ai.usage.output_tokens")
                .is_some_and(|t| t > 0),
            "{what}: {client:?}"
        );
        assert!(client.has("gen_ai.response.model"), "{what}");
        assert!(client.has("gen_ai.response.finish_reasons"), "{what}");
        let answer_text = String::from_utf8_lossy(&fixture(case.answer)).into_owned();
        if answer_text.contains("\"id\"") || answer_text.contains("\"responseId\"") {
            assert!(client.has("gen_ai.response.id"), "{what}");
        }
        assert_eq!(
            client
                .attributes
                .get("gen_ai.request.stream")
                .map(|v| format!("{v:?}")),
            Some(format!("Bool({})", case.streamed)),
            "{what}"
        );
        if case.streamed {
            assert!(client.has("gen_ai.response.time_to_first_chunk"), "{what}");
        }
        assert!(!client.has("error.type"), "{what}");
        assert!(
            client.end_unix_nanos <= server.end_unix_nanos,
            "{what}: the CLIENT span outlived its parent"
        );

        // The usage on the span is the one the request record holds.
        let record = format!(
            "request_id = '{}' AND input_tokens = {} AND output_tokens = {}",
            server.str("nm.request_id").unwrap_or_default(),
            client.int("gen_ai.usage.input_tokens").unwrap_or_default(),
            client.int("gen_ai.usage.output_tokens").unwrap_or_default(),
        );
        gw.one_request_where(&record).await;
        gw.stop().await;
    }
}

#[tokio::test]
async fn an_inbound_traceparent_is_continued_and_the_upstream_gets_the_client_span_as_parent() {
    let otlp = OtlpReceiver::start().await;
    let (mock, builder) = traced_json(&otlp, "openai", "openai/chat_response.json").await;
    let gw = builder.run().await;
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let answer = gw
        .chat(&[("traceparent", parent), ("tracestate", "vendor=1")])
        .await;
    assert_eq!(
        answer.header("nm-trace-id"),
        Some("4bf92f3577b34da6a3ce929d0e0e4736")
    );
    let (server, client) = request_spans(&otlp, "4bf92f3577b34da6a3ce929d0e0e4736").await;
    assert_eq!(server.parent_span_id.as_deref(), Some("00f067aa0ba902b7"));
    let sent = mock.last();
    assert_eq!(
        sent.header("traceparent"),
        Some(format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{}-01", client.span_id).as_str()),
        "the upstream's parent is the CLIENT span"
    );
    assert_eq!(sent.header("tracestate"), Some("vendor=1"));
    gw.stop().await;
}

#[tokio::test]
async fn with_tracing_off_or_the_providers_switch_off_the_clients_traceparent_passes_untouched() {
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let otlp = OtlpReceiver::start().await;
    let mock = MockProvider::json(fixture("openai/chat_response.json"))
        .start()
        .await;
    let off = TestGateway::builder().upstream("openai", &mock.url);
    // On, but this provider is not sent the gateway's context.
    let switched = traced(&otlp).config_toml(&format!(
        "[providers.openai]\nbase_url = \"{}\"\ntrace_context = false\n",
        mock.url
    ));
    for (traced, builder) in [(false, off), (true, switched)] {
        let gw = builder.run().await;
        let answer = gw.chat(&[("traceparent", parent)]).await;
        assert_eq!(answer.status, 200);
        assert_eq!(
            mock.last().header("traceparent"),
            Some(parent),
            "traced: {traced}"
        );
        if traced {
            // Still traced, in the client's trace.
            request_spans(&otlp, "4bf92f3577b34da6a3ce929d0e0e4736").await;
        } else {
            assert_eq!(answer.header("nm-trace-id"), None);
        }
        gw.stop().await;
    }
}

#[tokio::test]
async fn gateway_made_errors_have_a_server_span_and_no_client_span_and_probes_none() {
    let otlp = OtlpReceiver::start().await;
    let gw = traced(&otlp)
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.http_endpoint())
        .run()
        .await;
    for _ in 0..100 {
        assert_eq!(gw.get("/health").await.status, 200);
    }
    gw.get("/health/live").await;
    gw.get("/metrics").await;
    let unauthorized = gw
        .raw(
            "POST",
            "/openai/v1/chat/completions",
            &[("nm-key", "nmk_wrong")],
            "{}",
        )
        .await;
    assert_eq!(unauthorized.status, 401);
    let trace_401 = unauthorized.header("nm-trace-id").map(str::to_owned);
    let not_found = gw
        .raw("GET", "/v1/nothing", &[("nm-key", ADMIN_KEY)], "")
        .await;
    assert_eq!(not_found.status, 404);
    let trace_404 = not_found.header("nm-trace-id").map(str::to_owned);
    let (Some(t401), Some(t404)) = (trace_401, trace_404) else {
        panic!("gateway-made errors carry NM-Trace-Id");
    };
    let spans = otlp
        .wait_for("the two error spans", WAIT, |s| {
            find(s, SpanKind::Server, &t401).is_some() && find(s, SpanKind::Server, &t404).is_some()
        })
        .await;
    assert_eq!(spans.len(), 2, "only the two errors are traced: {spans:#?}");
    let s401 = find(&spans, SpanKind::Server, &t401)
        .cloned()
        .unwrap_or_else(|| unreachable!());
    assert_eq!(s401.int("http.response.status_code"), Some(401));
    assert_eq!(s401.status, Status::Unset, "a 4xx is not a server error");
    let s404 = find(&spans, SpanKind::Server, &t404)
        .cloned()
        .unwrap_or_else(|| unreachable!());
    assert_eq!(s404.name, "GET");
    assert!(!s404.has("http.route"));
    assert!(
        spans
            .iter()
            .all(|s| s.transport == crate::common::otlp::Transport::Http)
    );
    gw.stop().await;
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_ends_both_spans_once_with_client_disconnected() {
    let otlp = OtlpReceiver::start().await;
    let mock = MockProvider::trickle(
        "data: {\"id\":\"c1\",\"model\":\"gpt-4o-mini\",\"choices\":[]}\n\n",
        Duration::from_millis(20),
    )
    .start()
    .await;
    let gw = traced(&otlp).upstream("openai", &mock.url).run().await;
    let resp = gw
        .send(
            "POST",
            "/openai/v1/chat/completions",
            &[("nm-key", ADMIN_KEY)],
            r#"{"model":"gpt-4o-mini","stream":true}"#,
        )
        .await;
    assert_eq!(resp.status(), 200);
    let trace_id = resp
        .headers()
        .get("nm-trace-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("a stream's head carries NM-Trace-Id"));
    let mut body = resp.into_body();
    let first = tokio::time::timeout(WAIT, body.frame()).await;
    assert!(matches!(first, Ok(Some(Ok(_)))), "a first chunk arrives");
    drop(body);
    tokio::time::timeout(WAIT, mock.cancelled())
        .await
        .unwrap_or_else(|_| panic!("the upstream request was not cancelled"));
    let (server, client) = request_spans(&otlp, &trace_id).await;
    for span in [&server, &client] {
        assert_eq!(
            span.str("error.type"),
            Some("client_disconnected"),
            "{span:?}"
        );
        assert!(matches!(span.status, Status::Error(_)), "{span:?}");
    }
    // Once: a second copy of either would be a second export of the same span id. Stopping
    // the gateway exports everything it still holds.
    gw.stop().await;
    let copies = otlp
        .spans()
        .iter()
        .filter(|s| s.trace_id == trace_id)
        .count();
    assert_eq!(copies, 2);
}

#[tokio::test]
async fn no_secret_or_prompt_reaches_an_exported_value() {
    let otlp = OtlpReceiver::start().await;
    let provider_key = "AIzaCANARYPROVIDERKEY0123456789";
    let (_mock, builder) = traced_json(&otlp, "gemini", "gemini/generate_response.json").await;
    let gw = builder
        .env("NM_PROVIDER_KEY_GEMINI", provider_key)
        .run()
        .await;
    let answer = gw
        .post(
            "/gemini/v1beta/models/gemini-2.0-flash:generateContent?key=CANARYQUERYKEY",
            &[("authorization", "Bearer CANARYBEARER")],
            r#"{"contents":[{"parts":[{"text":"CANARYPROMPT"}]}]}"#,
        )
        .await;
    assert_eq!(answer.status, 200);
    let trace_id = answer.trace_id();
    let (server, client) = request_spans(&otlp, &trace_id).await;
    for span in [server, client] {
        let text = span.all_text();
        for canary in [
            ADMIN_KEY,
            provider_key,
            "CANARYQUERYKEY",
            "CANARYBEARER",
            "CANARYPROMPT",
        ] {
            assert!(!text.contains(canary), "{canary} exported in {span:#?}");
        }
    }
    gw.stop().await;
}

#[tokio::test]
async fn message_content_is_exported_only_when_asked_and_capped() {
    let otlp = OtlpReceiver::start().await;
    let (_mock, builder) = traced_json(&otlp, "openai", "openai/chat_response.json").await;
    let gw = builder
        .env("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
        .run()
        .await;
    let long = "x".repeat(40_000);
    let body = format!(
        r#"{{"model":"gpt-4o-mini","messages":[{{"role":"user","content":"CAPTURED {long}"}}]}}"#
    );
    let answer = gw.post("/openai/v1/chat/completions", &[], body).await;
    let trace_id = answer.trace_id();
    let (_, client) = request_spans(&otlp, &trace_id).await;
    let input = client.str("gen_ai.input.messages").unwrap_or_default();
    assert!(input.contains("CAPTURED"));
    assert!(input.len() <= 16 * 1024 + 3, "{}", input.len());
    let output = client.str("gen_ai.output.messages").unwrap_or_default();
    assert_eq!(output.as_bytes(), &fixture("openai/chat_response.json")[..]);
    gw.stop().await;
}

#[tokio::test]
async fn a_hanging_collector_costs_requests_nothing_and_its_drops_are_counted() {
    let otlp = OtlpReceiver::start().await;
    otlp.set_hang(true);
    let (_mock, builder) = traced_json(&otlp, "openai", "openai/chat_response.json").await;
    let gw = builder
        .env("OTEL_BSP_MAX_QUEUE_SIZE", "4")
        .env("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
        .env("OTEL_EXPORTER_OTLP_TIMEOUT", "2000")
        .run()
        .await;
    for _ in 0..20 {
        let answer = tokio::time::timeout(Duration::from_secs(5), gw.chat(&[]))
            .await
            .unwrap_or_else(|_| panic!("a request waited on the collector"));
        assert_eq!(answer.status, 200);
    }
    let metrics = gw.get("/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    let dropped: u64 = text
        .lines()
        .find(|l| l.starts_with("nm_otel_spans_dropped_total{reason=\"queue_full\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        dropped >= 20,
        "40 spans, a queue of 4 and a hung export: {text}"
    );
    assert!(otlp.exports() >= 1);
    // Shutting down does not hang on the collector either (the flush is bounded).
    tokio::time::timeout(Duration::from_secs(30), gw.stop())
        .await
        .unwrap_or_else(|_| panic!("shutdown hung on the collector"));
}

#[tokio::test]
async fn a_signal_is_one_trace_from_the_dataplane_through_the_controlplane_to_its_database_write() {
    use crate::common::gateway::{Db, Shape};
    let otlp = OtlpReceiver::start().await;
    for (shape, db) in [
        (Shape::Serve, Db::Sqlite),
        (Shape::Split, Db::Sqlite),
        (Shape::Split, Db::Postgres),
    ] {
        let Some(gw) = traced(&otlp).shape(shape).db(db).start().await else {
            continue; // no PostgreSQL here: said by the builder
        };
        let answer = gw
            .raw(
                "POST",
                "/v1/signal",
                &[("nm-key", ADMIN_KEY), ("content-type", "application/json")],
                r#"{"session_id":"sess_traced1","action":"thumbs_up"}"#,
            )
            .await;
        assert_eq!(answer.status, 200, "{shape:?} {db:?}: {:?}", answer.body);
        let trace_id = answer.trace_id();
        // Each process exports on its own schedule: wait for both ends of the trace.
        let mut names = vec!["INSERT signals", "POST /v1/signal"];
        if shape.is_split() {
            names.push("nm.link.v1.Link/RecordSignal");
        }
        let spans = otlp
            .wait_for("the signal's spans in every process", WAIT, |s| {
                names
                    .iter()
                    .all(|name| s.iter().any(|x| x.trace_id == trace_id && x.name == *name))
            })
            .await;
        let of_trace: Vec<&CollectedSpan> =
            spans.iter().filter(|s| s.trace_id == trace_id).collect();
        let server = of_trace
            .iter()
            .find(|s| s.name == "POST /v1/signal")
            .unwrap_or_else(|| panic!("no dataplane span: {of_trace:#?}"));
        assert_eq!(server.str("nm.signal.action"), Some("thumbs_up"));
        let db_span = of_trace
            .iter()
            .find(|s| s.name == "INSERT signals")
            .unwrap_or_else(|| unreachable!());
        let system = if db == Db::Postgres {
            "postgresql"
        } else {
            "sqlite"
        };
        assert_eq!(db_span.str("db.system.name"), Some(system));
        assert_eq!(db_span.str("db.operation.name"), Some("INSERT"));
        assert_eq!(db_span.kind, SpanKind::Client);
        if shape.is_split() {
            let link = of_trace
                .iter()
                .find(|s| s.name == "nm.link.v1.Link/RecordSignal")
                .unwrap_or_else(|| panic!("no controlplane span: {of_trace:#?}"));
            assert_eq!(link.kind, SpanKind::Server);
            assert_eq!(
                link.resource.get("service.name").map(|v| format!("{v:?}")),
                Some("Str(\"nm-controlplane\")".to_owned())
            );
            assert_eq!(
                db_span.parent_span_id.as_deref(),
                Some(link.span_id.as_str())
            );
            // The link call's parent is in the dataplane's trace.
            assert!(link.parent_span_id.is_some());
        } else {
            assert_eq!(
                db_span.parent_span_id.as_deref(),
                Some(server.span_id.as_str())
            );
        }
        gw.stop().await;
    }
}

#[tokio::test]
async fn a_records_batch_links_to_each_request_and_the_signal_to_its_sessions_requests() {
    use crate::common::gateway::{Db, Shape};
    let otlp = OtlpReceiver::start().await;
    let mock = MockProvider::json(fixture("openai/chat_response.json"))
        .start()
        .await;
    for (shape, db) in [(Shape::Serve, Db::Sqlite), (Shape::Split, Db::Postgres)] {
        let Some(gw) = traced(&otlp)
            .upstream("openai", &mock.url)
            .shape(shape)
            .db(db)
            .start()
            .await
        else {
            continue;
        };
        let session = if shape.is_split() {
            "sess_linked2"
        } else {
            "sess_linked1"
        };
        let mut requests = Vec::new();
        for _ in 0..3 {
            let a = gw.chat(&[("nm-session", session)]).await;
            assert_eq!(a.status, 200);
            let trace = a.trace_id();
            let request_id = a.header("nm-request-id").unwrap_or_default().to_owned();
            // The controlplane keeps each request's trace id.
            gw.one_request_where(&format!(
                "request_id = '{request_id}' AND trace_id = '{trace}'"
            ))
            .await;
            requests.push(trace);
        }
        let (_, client) = request_spans(&otlp, &requests[0]).await;
        // The batch that shipped the records: a span of its own, linked to the requests' CLIENT
        // spans, continued down to the INSERT.
        let spans = otlp
            .wait_for("a records batch linking the first request", WAIT, |s| {
                s.iter().any(|x| {
                    x.name == "nm.link.v1.Link/IngestRequests"
                        && x.kind == SpanKind::Client
                        && x.links
                            .contains(&(client.trace_id.clone(), client.span_id.clone()))
                })
            })
            .await;
        let batch = spans
            .iter()
            .find(|x| {
                x.name == "nm.link.v1.Link/IngestRequests"
                    && x.links
                        .contains(&(client.trace_id.clone(), client.span_id.clone()))
            })
            .cloned()
            .unwrap_or_else(|| unreachable!());
        otlp.wait_for(
            "the batch's INSERT (split: and the controlplane's span)",
            WAIT,
            |s| {
                let insert = s
                    .iter()
                    .any(|x| x.trace_id == batch.trace_id && x.name == "INSERT request_records");
                let continued = !shape.is_split()
                    || s.iter().any(|x| {
                        x.trace_id == batch.trace_id
                            && x.name == "nm.link.v1.Link/IngestRequests"
                            && x.kind == SpanKind::Server
                    });
                insert && continued
            },
        )
        .await;
        // The signal's span links to the session's requests.
        let answer = gw
            .raw(
                "POST",
                "/v1/signal",
                &[("nm-key", ADMIN_KEY), ("content-type", "application/json")],
                format!(r#"{{"session_id":"{session}","action":"accepted"}}"#),
            )
            .await;
        assert_eq!(answer.status, 200);
        let signal_trace = answer.trace_id();
        // The dataplane's span (split, the controlplane's SERVER span is in the trace too).
        let is_signal =
            |x: &CollectedSpan| x.trace_id == signal_trace && x.name == "POST /v1/signal";
        let spans = otlp
            .wait_for("the signal's span", WAIT, |s| s.iter().any(is_signal))
            .await;
        let signal = spans
            .iter()
            .find(|x| is_signal(x))
            .cloned()
            .unwrap_or_else(|| unreachable!());
        let linked: Vec<&String> = signal.links.iter().map(|(t, _)| t).collect();
        for trace in &requests {
            assert!(
                linked.contains(&trace),
                "{shape:?}: signal links {linked:?}, not {trace}"
            );
        }
        gw.stop().await;
    }
}

/// A real OpenTelemetry backend (Arize Phoenix, installed by `.ci/run`): the request's trace is
/// there, readable back, with the GenAI attributes it shows as LLM traffic.
#[tokio::test]
async fn the_trace_reaches_a_real_backend_and_reads_back() {
    let Some(phoenix) = crate::common::phoenix::start().await else {
        return;
    };
    let mock = MockProvider::json(fixture("openai/chat_response.json"))
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &phoenix.grpc_endpoint())
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .run()
        .await;
    let answer = gw
        .post(
            "/openai/v1/chat/completions",
            &[("nm-session", "sess_phoenix1"), ("nm-agent", "support-bot")],
            r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .await;
    assert_eq!(answer.status, 200);
    let trace_id = answer.trace_id();
    let spans = phoenix
        .wait_for_trace_spans(&trace_id, 2, Duration::from_secs(60))
        .await;
    let spans = spans.as_array().cloned().unwrap_or_default();
    let llm = spans
        .iter()
        .find(|s| s["name"] == "chat gpt-4o-mini")
        .unwrap_or_else(|| panic!("no CLIENT span in Phoenix: {spans:#?}"));
    let attributes = &llm["attributes"];
    assert_eq!(attributes["gen_ai.request.model"], "gpt-4o-mini");
    assert_eq!(attributes["gen_ai.provider.name"], "openai");
    assert_eq!(attributes["gen_ai.conversation.id"], "sess_phoenix1");
    assert!(
        attributes["gen_ai.usage.input_tokens"]
            .as_i64()
            .is_some_and(|t| t > 0)
    );
    let server = spans
        .iter()
        .find(|s| s["name"] == "POST /{provider}/{*native_path}")
        .unwrap_or_else(|| panic!("no SERVER span in Phoenix: {spans:#?}"));
    assert_eq!(llm["parent_id"], server["context"]["span_id"]);
    gw.stop().await;
}

#[tokio::test]
async fn sampled_at_zero_nothing_is_exported_but_the_context_still_travels() {
    let otlp = OtlpReceiver::start().await;
    let (mock, builder) = traced_json(&otlp, "openai", "openai/chat_response.json").await;
    let gw = builder
        .env("OTEL_TRACES_SAMPLER", "traceidratio")
        .env("OTEL_TRACES_SAMPLER_ARG", "0")
        .run()
        .await;
    let answer = gw.chat(&[]).await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        answer.header("nm-trace-id"),
        None,
        "no id of a trace nobody has"
    );
    let sent = mock.last();
    let traceparent = sent.header("traceparent").unwrap_or_default();
    assert!(
        traceparent.starts_with("00-") && traceparent.ends_with("-00"),
        "an unsampled context still goes upstream: {traceparent:?}"
    );
    // The record keeps no trace either.
    let id = answer
        .header("nm-request-id")
        .unwrap_or_default()
        .to_owned();
    gw.one_request_where(&format!("request_id = '{id}' AND trace_id IS NULL"))
        .await;
    gw.stop().await;
    assert!(otlp.spans().is_empty(), "{:#?}", otlp.spans());
}

/// A collector behind TLS with a private CA (`OTEL_EXPORTER_OTLP_CERTIFICATE`), over both
/// protocols.
#[tokio::test]
async fn an_https_collector_with_a_private_ca_gets_the_spans_over_both_protocols() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let pki = crate::common::pki::Pki::create(dir.path());
    let otlp = OtlpReceiver::start_tls(&pki).await;
    let ca = pki.ca.display().to_string();
    for (protocol, endpoint) in [
        ("grpc", otlp.grpc_endpoint()),
        ("http/protobuf", otlp.http_endpoint()),
    ] {
        let (_mock, builder) = traced_json(&otlp, "openai", "openai/chat_response.json").await;
        let gw = builder
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
            .env("OTEL_EXPORTER_OTLP_CERTIFICATE", &ca)
            .run()
            .await;
        let answer = gw.chat(&[]).await;
        let trace_id = answer.trace_id();
        let (server, _) = request_spans(&otlp, &trace_id).await;
        let over = if protocol == "grpc" {
            crate::common::otlp::Transport::Grpc
        } else {
            crate::common::otlp::Transport::Http
        };
        assert_eq!(server.transport, over, "{protocol}");
        gw.stop().await;
    }
}
