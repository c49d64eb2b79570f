//! `/metrics` is OpenMetrics a strict parser accepts: the dataplane's metrics with every family
//! fed (exemplars, capped and escaped labels included), and a live gateway's after proxied
//! requests. Needs `NM_TEST_METRICS_PYTHON` (see `common::openmetrics`), else SKIPPED.

use std::time::Duration;

use nm_dataplane::metrics::{LABEL_CAP, Metrics, Operation};

use crate::common::gateway::TestGateway;
use crate::common::mock::MockProvider;
use crate::common::openmetrics::{family_type, parse_strict, python};
use crate::common::{fixture, sse_events};

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// The families the request path feeds, as the parser names them (counters without `_total`).
const NEW_FAMILIES: [(&str, &str); 7] = [
    ("gen_ai_client_token_usage", "histogram"),
    ("gen_ai_client_operation_duration_seconds", "histogram"),
    (
        "gen_ai_client_operation_time_to_first_chunk_seconds",
        "histogram",
    ),
    ("http_server_request_duration_seconds", "histogram"),
    ("nm_gateway_overhead_seconds", "histogram"),
    ("nm_otel_spans_dropped", "counter"),
    ("nm_metric_label_overflow", "counter"),
];

#[tokio::test]
async fn every_family_fed_parses_strictly() {
    let Some(python) = python("strict OpenMetrics parse of Metrics::render") else {
        return;
    };
    let m = Metrics::default();
    let chat = Operation {
        operation: "chat",
        provider: "openai",
        request_model: Some("gpt-4o"),
        response_model: Some("gpt-4o-2024-08-06"),
        duration: Duration::from_millis(1500),
        time_to_first_chunk: Some(Duration::from_millis(250)),
        input_tokens: Some(12),
        output_tokens: Some(3),
        trace_id: Some(TRACE),
        ..Operation::default()
    };
    m.operation(&chat);
    m.operation(&Operation {
        operation: "generate_content",
        provider: "gcp.gemini",
        request_model: Some(r#"odd "model" \ name"#),
        response_model: None,
        error_type: Some("upstream_timeout"),
        time_to_first_chunk: None,
        input_tokens: None,
        output_tokens: None,
        ..chat
    });
    for i in 0..=LABEL_CAP {
        m.operation(&Operation {
            request_model: Some(&format!("model-{i}")),
            ..chat
        });
    }
    m.gateway_overhead("openai", Duration::from_micros(120));
    m.http_server(
        &http::Method::POST,
        "/openai/{*path}",
        200,
        Duration::from_millis(30),
        Some(TRACE),
    );
    m.http_server(
        &http::Method::from_bytes(b"BREW").unwrap_or_default(),
        "/health",
        405,
        Duration::from_micros(200),
        None,
    );
    m.otel_spans_dropped("queue_full", 4);
    m.records_dropped("spool_full", 1);

    let parsed = parse_strict(&python, &m.render()).await;
    for (family, kind) in NEW_FAMILIES {
        assert_eq!(family_type(&parsed, family), Some(kind), "{family}");
    }
    assert_eq!(
        parsed["gen_ai_client_operation_duration_seconds"]["unit"],
        "seconds"
    );
    let exemplars: Vec<&serde_json::Value> =
        parsed["gen_ai_client_operation_duration_seconds"]["samples"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| {
                s["exemplar"]
                    .as_object()
                    .map(|_| &s["exemplar"]["trace_id"])
            })
            .collect();
    assert!(!exemplars.is_empty() && exemplars.iter().all(|t| *t == TRACE));
    let odd = parsed["gen_ai_client_operation_duration_seconds"]["samples"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|s| s["labels"]["gen_ai_request_model"] == r#"odd "model" \ name"#);
    assert!(odd, "an escaped label value reads back as it was");
}

#[tokio::test]
async fn a_live_gateways_metrics_parse_strictly() {
    let Some(python) = python("strict OpenMetrics parse of a gateway's /metrics") else {
        return;
    };
    let openai = MockProvider::json(fixture("openai/chat_response.json"))
        .start()
        .await;
    let stream = MockProvider::sse(sse_events(&fixture("openai/chat_stream.sse")))
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &openai.url)
        .config_toml(&format!(
            "[providers.openai-stream]\nbase_url = \"{}\"\nauth = \"bearer\"\n",
            stream.url
        ))
        .run()
        .await;
    let json = [("content-type", "application/json")];
    let a = gw
        .post(
            "/openai/v1/chat/completions",
            &json,
            fixture("openai/chat_request.json"),
        )
        .await;
    assert_eq!(a.status, 200);
    let a = gw
        .post(
            "/openai-stream/v1/chat/completions",
            &json,
            r#"{"model":"gpt-4o-mini","stream":true}"#,
        )
        .await;
    assert_eq!(a.status, 200);

    let m = gw.get("/metrics").await;
    assert_eq!(m.status, 200);
    assert_eq!(
        m.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let text = String::from_utf8_lossy(&m.body);
    let parsed = parse_strict(&python, &text).await;
    // Declared from the start; fed once the request path calls them.
    for (family, kind) in NEW_FAMILIES {
        assert!(
            text.contains(&format!("\n# TYPE {family} {kind}\n")),
            "{family} not declared:\n{text}"
        );
        assert_eq!(family_type(&parsed, family), Some(kind), "{family}");
    }
    // Fed by the two requests, labelled as the conventions say and with nothing per request.
    let samples = |family: &str| -> Vec<serde_json::Value> {
        parsed[family]["samples"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    let chat_count = samples("gen_ai_client_operation_duration_seconds")
        .into_iter()
        .filter(|s| s["name"] == "gen_ai_client_operation_duration_seconds_count")
        .map(|s| (s["labels"].clone(), s["value"].as_f64().unwrap_or(0.0)))
        .collect::<Vec<_>>();
    assert!(
        chat_count
            .iter()
            .any(|(l, v)| l["gen_ai_operation_name"] == "chat"
                && l["gen_ai_provider_name"] == "openai"
                && l["gen_ai_request_model"] == "gpt-4o-mini"
                && l.get("error_type").is_none()
                && *v >= 1.0),
        "{chat_count:?}"
    );
    for (labels, _) in &chat_count {
        let keys: Vec<&String> = labels
            .as_object()
            .map(|o| o.keys().collect())
            .unwrap_or_default();
        for k in keys {
            assert!(
                [
                    "gen_ai_operation_name",
                    "gen_ai_provider_name",
                    "gen_ai_request_model",
                    "gen_ai_response_model",
                    "error_type"
                ]
                .contains(&k.as_str()),
                "unexpected label {k}"
            );
        }
    }
    let token_types: Vec<String> = samples("gen_ai_client_token_usage")
        .into_iter()
        .filter_map(|s| s["labels"]["gen_ai_token_type"].as_str().map(str::to_owned))
        .collect();
    assert!(token_types.iter().any(|t| t == "input") && token_types.iter().any(|t| t == "output"));
    assert!(
        samples("gen_ai_client_operation_time_to_first_chunk_seconds")
            .iter()
            .any(
                |s| s["name"] == "gen_ai_client_operation_time_to_first_chunk_seconds_count"
                    && s["value"].as_f64() == Some(1.0)
            ),
        "only the stream has a first chunk"
    );
    assert!(samples("http_server_request_duration_seconds").iter().any(
        |s| s["labels"]["http_route"] == "/{provider}/{*native_path}"
            && s["labels"]["http_response_status_code"] == "200"
    ));
    assert!(!samples("nm_gateway_overhead_seconds").is_empty());
    gw.stop().await;
}

#[tokio::test]
async fn a_sampled_request_leaves_its_trace_id_as_the_exemplar() {
    let Some(python) = python("exemplars of a traced gateway's /metrics") else {
        return;
    };
    let otlp = crate::common::otlp::OtlpReceiver::start().await;
    let openai = MockProvider::json(fixture("openai/chat_response.json"))
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &openai.url)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.grpc_endpoint())
        .run()
        .await;
    let a = gw.chat(&[]).await;
    let trace_id = a.trace_id();
    assert_eq!(trace_id.len(), 32);
    let m = gw.get("/metrics").await;
    let parsed = parse_strict(&python, &String::from_utf8_lossy(&m.body)).await;
    for family in [
        "gen_ai_client_operation_duration_seconds",
        "http_server_request_duration_seconds",
    ] {
        let exemplars: Vec<String> = parsed[family]["samples"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["exemplar"]["trace_id"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(exemplars, vec![trace_id.clone()], "{family}");
    }
    gw.stop().await;
}
