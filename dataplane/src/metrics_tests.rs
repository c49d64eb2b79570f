//! Unit tests of [`super`]: names, labels, caps, buckets, exemplars.

use super::*;

#[test]
fn renders_counters_and_gauges() {
    let m = Metrics::default();
    m.records_dropped("spool_full", 3);
    m.budget_refused("spend");
    m.set_spool(7, 4096);
    m.set_budget_rules(2);
    let text = m.render();
    assert_has(&text, r#"nm_records_dropped_total{reason="spool_full"} 3"#);
    assert_has(&text, r#"nm_budget_refusals_total{reason="spend"} 1"#);
    assert_has(&text, "nm_spool_records 7");
    assert_has(&text, "nm_spool_bytes 4096");
    assert_has(&text, "nm_budget_rules 2");
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// A streamed chat that went well.
fn chat<'a>() -> Operation<'a> {
    Operation {
        operation: "chat",
        provider: "openai",
        request_model: Some("gpt-4o"),
        response_model: Some("gpt-4o-2024-08-06"),
        error_type: None,
        duration: Duration::from_millis(1500),
        time_to_first_chunk: Some(Duration::from_millis(300)),
        input_tokens: Some(12),
        output_tokens: Some(3),
        trace_id: Some(TRACE),
    }
}

/// Fails, showing the whole rendering, unless `text` contains `want`.
#[track_caller]
fn assert_has(text: &str, want: &str) {
    assert!(text.contains(want), "missing {want}\n{text}");
}

/// The rendered lines starting with `prefix`.
fn lines<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.starts_with(prefix)).collect()
}

/// The `le` bounds of the first series of a histogram, in order.
fn bounds(text: &str, histogram: &str) -> Vec<String> {
    let bucket = format!("{histogram}_bucket{{le=\"");
    let mut out = Vec::new();
    for line in lines(text, &bucket) {
        let le = &line[bucket.len()
            ..line[bucket.len()..]
                .find('"')
                .map_or(0, |i| i + bucket.len())];
        if out.first().is_some_and(|first| first == le) {
            break;
        }
        out.push(le.to_owned());
    }
    out
}

fn rendered(values: &[f64]) -> Vec<String> {
    let mut out: Vec<String> = values
        .iter()
        .map(|v| {
            let s = v.to_string();
            if s.contains('.') { s } else { format!("{s}.0") }
        })
        .collect();
    out.push("+Inf".to_owned());
    out
}

#[test]
fn new_families_are_declared_before_their_first_series() {
    let text = Metrics::default().render();
    for (name, kind) in [
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
    ] {
        assert!(
            text.contains(&format!("\n# TYPE {name} {kind}\n")),
            "{name}:\n{text}"
        );
        if name.ends_with("_seconds") {
            assert!(
                text.contains(&format!("\n# UNIT {name} seconds\n")),
                "{name}:\n{text}"
            );
        }
    }
    assert!(
        !text.contains("nm_gen_ai") && !text.contains("nm_http_server"),
        "{text}"
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
}

#[test]
fn an_operation_is_recorded_with_the_conventions_labels() {
    let m = Metrics::default();
    m.operation(&chat());
    let text = m.render();
    let labels = r#"gen_ai_operation_name="chat",gen_ai_provider_name="openai",gen_ai_request_model="gpt-4o",gen_ai_response_model="gpt-4o-2024-08-06""#;
    for line in [
        format!("gen_ai_client_operation_duration_seconds_count{{{labels}}} 1"),
        format!("gen_ai_client_operation_duration_seconds_sum{{{labels}}} 1.5"),
        format!("gen_ai_client_operation_time_to_first_chunk_seconds_sum{{{labels}}} 0.3"),
        format!(r#"gen_ai_client_token_usage_sum{{{labels},gen_ai_token_type="input"}} 12.0"#),
        format!(r#"gen_ai_client_token_usage_sum{{{labels},gen_ai_token_type="output"}} 3.0"#),
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
    }
    assert!(
        !text.contains("error_type"),
        "success has no error_type label:\n{text}"
    );
}

#[test]
fn a_label_set_seen_again_feeds_the_same_series_and_a_stream_adds_its_first_chunk_later() {
    let m = Metrics::default();
    let plain = Operation {
        time_to_first_chunk: None,
        ..chat()
    };
    m.operation(&plain);
    let text = m.render();
    assert!(
        lines(
            &text,
            "gen_ai_client_operation_time_to_first_chunk_seconds_count"
        )
        .is_empty(),
        "no first-chunk series without a stream:\n{text}"
    );
    m.operation(&plain);
    m.operation(&chat());
    let text = m.render();
    let labels = r#"gen_ai_operation_name="chat",gen_ai_provider_name="openai",gen_ai_request_model="gpt-4o",gen_ai_response_model="gpt-4o-2024-08-06""#;
    for line in [
        format!("gen_ai_client_operation_duration_seconds_count{{{labels}}} 3"),
        format!("gen_ai_client_operation_time_to_first_chunk_seconds_count{{{labels}}} 1"),
        format!(r#"gen_ai_client_token_usage_sum{{{labels},gen_ai_token_type="input"}} 36.0"#),
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
    }
}

#[test]
fn an_error_has_error_type_and_what_is_unknown_is_absent() {
    let m = Metrics::default();
    m.operation(&Operation {
        operation: "embeddings",
        provider: "anthropic",
        request_model: Some(""),
        response_model: None,
        error_type: Some("upstream_timeout"),
        duration: Duration::from_secs(30),
        trace_id: None,
        ..Operation::default()
    });
    let text = m.render();
    let line = r#"gen_ai_client_operation_duration_seconds_count{gen_ai_operation_name="embeddings",gen_ai_provider_name="anthropic",error_type="upstream_timeout"} 1"#;
    assert!(text.lines().any(|l| l == line), "{text}");
    assert!(
        lines(&text, "gen_ai_client_token_usage_").is_empty(),
        "{text}"
    );
    assert!(
        lines(&text, "gen_ai_client_operation_time_to_first_chunk").is_empty(),
        "{text}"
    );
}

#[test]
fn buckets_are_the_conventions_and_ours() {
    let m = Metrics::default();
    m.operation(&chat());
    m.http_server(
        &http::Method::GET,
        "/health",
        200,
        Duration::from_millis(1),
        None,
    );
    m.gateway_overhead("openai", Duration::from_micros(50));
    let text = m.render();
    let powers_of_4: Vec<f64> = (0..14).map(|i| 4_f64.powi(i)).collect();
    assert_eq!(
        bounds(&text, "gen_ai_client_token_usage"),
        rendered(&powers_of_4)
    );
    let seconds = rendered(&[
        0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
    ]);
    assert_eq!(
        bounds(&text, "gen_ai_client_operation_duration_seconds"),
        seconds
    );
    assert_eq!(
        bounds(&text, "gen_ai_client_operation_time_to_first_chunk_seconds"),
        seconds
    );
    assert_eq!(
        bounds(&text, "http_server_request_duration_seconds"),
        rendered(&[
            0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0
        ])
    );
    let overhead = bounds(&text, "nm_gateway_overhead_seconds");
    assert_eq!(overhead.first().map(String::as_str), Some("0.0001"));
    assert_eq!(
        overhead.get(overhead.len() - 2).map(String::as_str),
        Some("0.5")
    );
}

#[test]
fn model_names_are_capped_per_family_and_overflow_is_counted() {
    let m = Metrics::default();
    let names: Vec<String> = (0..LABEL_CAP + 2).map(|i| format!("model-{i}")).collect();
    for name in &names {
        m.operation(&Operation {
            request_model: Some(name),
            response_model: None,
            ..chat()
        });
    }
    // A kept name stays itself after the cap is reached.
    m.operation(&Operation {
        request_model: Some("model-0"),
        response_model: None,
        ..chat()
    });
    let text = m.render();
    let counts = lines(&text, "gen_ai_client_operation_duration_seconds_count");
    assert_eq!(counts.len(), LABEL_CAP + 1, "{text}");
    assert!(
        counts
            .iter()
            .any(|l| l.contains(r#"gen_ai_request_model="_other"} 2"#)),
        "{text}"
    );
    assert!(
        counts
            .iter()
            .any(|l| l.contains(r#"gen_ai_request_model="model-0"} 2"#)),
        "{text}"
    );
    assert!(!text.contains(&format!("model-{LABEL_CAP}\"")), "{text}");
    assert_has(
        &text,
        r#"nm_metric_label_overflow_total{label="gen_ai_model"} 2"#,
    );
    // The token and first-chunk families obey the same cap.
    assert_eq!(
        lines(
            &text,
            "gen_ai_client_operation_time_to_first_chunk_seconds_count"
        )
        .len(),
        LABEL_CAP + 1
    );
}

#[test]
fn unfit_names_become_other_and_odd_ones_are_escaped() {
    let m = Metrics::default();
    let long = "m".repeat(MAX_LABEL_VALUE_LEN + 1);
    for bad in [long.as_str(), "gpt\nhack", "_other", "_OTHER"] {
        m.operation(&Operation {
            request_model: Some(bad),
            response_model: None,
            ..chat()
        });
    }
    m.operation(&Operation {
        request_model: Some(r#"a"b\c"#),
        response_model: None,
        ..chat()
    });
    let text = m.render();
    assert!(
        text.contains(r#"gen_ai_request_model="_other"} 4"#),
        "every unfit name is _other:\n{text}"
    );
    assert_has(&text, r#"gen_ai_request_model="a\"b\\c"}"#);
    assert!(!text.contains(&long) && !text.contains("hack"), "{text}");
}

#[test]
fn providers_and_error_types_are_capped_too() {
    let m = Metrics::default();
    for i in 0..=LABEL_CAP {
        m.gateway_overhead(&format!("p{i}"), Duration::from_micros(10));
        m.operation(&Operation {
            error_type: Some(&format!("e{i}")),
            ..chat()
        });
    }
    let text = m.render();
    // One cap per label across families: `openai` (of the operations) took a place, so 2 of the
    // 66 providers overflowed.
    assert_has(
        &text,
        r#"nm_gateway_overhead_seconds_count{gen_ai_provider_name="_other"} 2"#,
    );
    assert_has(&text, r#"error_type="_OTHER"} 1"#);
    assert_has(
        &text,
        r#"nm_metric_label_overflow_total{label="gen_ai_provider_name"} 2"#,
    );
    assert_has(
        &text,
        r#"nm_metric_label_overflow_total{label="error_type"} 1"#,
    );
}

#[test]
fn http_methods_are_a_closed_set() {
    let m = Metrics::default();
    let d = Duration::from_millis(3);
    let ext = |s: &str| http::Method::from_bytes(s.as_bytes()).unwrap_or_default();
    m.http_server(&http::Method::POST, "/openai/{*path}", 200, d, None);
    m.http_server(&ext("QUERY"), "/metrics", 405, d, None);
    m.http_server(&ext("get"), "/metrics", 405, d, None);
    m.http_server(&ext("BREW"), "/metrics", 405, d, None);
    let text = m.render();
    let counts = lines(&text, "http_server_request_duration_seconds_count");
    for line in [
        r#"http_server_request_duration_seconds_count{http_request_method="POST",http_route="/openai/{*path}",http_response_status_code="200"} 1"#,
        r#"http_server_request_duration_seconds_count{http_request_method="QUERY",http_route="/metrics",http_response_status_code="405"} 1"#,
        r#"http_server_request_duration_seconds_count{http_request_method="_OTHER",http_route="/metrics",http_response_status_code="405"} 2"#,
    ] {
        assert!(counts.contains(&line), "missing {line}\n{text}");
    }
    assert_eq!(counts.len(), 3, "{text}");
}

#[test]
fn exemplars_carry_sampled_trace_ids_only() {
    let m = Metrics::default();
    m.operation(&chat());
    m.http_server(
        &http::Method::GET,
        "/health",
        200,
        Duration::from_millis(2),
        Some(TRACE),
    );
    let text = m.render();
    let with = |family: &str| {
        lines(&text, family)
            .into_iter()
            .filter(|l| l.contains(&format!(r#" # {{trace_id="{TRACE}"}} "#)))
            .count()
    };
    assert_eq!(
        with("gen_ai_client_operation_duration_seconds_bucket"),
        1,
        "{text}"
    );
    assert_eq!(
        with("http_server_request_duration_seconds_bucket"),
        1,
        "{text}"
    );
    // On the bucket the value fell in: 1.5 s is in (1.28, 2.56].
    assert!(
        lines(
            &text,
            r#"gen_ai_client_operation_duration_seconds_bucket{le="2.56""#
        )[0]
        .contains(&format!(r#"# {{trace_id="{TRACE}"}} 1.5 "#)),
        "{text}"
    );

    let m = Metrics::default();
    for bad in [
        "4BF92F3577B34DA6A3CE929D0E0E4736",
        "4bf92f3577b34da6a3ce929d0e0e473",
        "00000000000000000000000000000000",
        "4bf92f3577b34da6a3ce929d0e0e473g",
    ] {
        m.operation(&Operation {
            trace_id: Some(bad),
            ..chat()
        });
        m.http_server(
            &http::Method::GET,
            "/health",
            200,
            Duration::from_millis(2),
            Some(bad),
        );
    }
    assert!(!m.render().contains(" # {"), "{}", m.render());
}

#[test]
fn dropped_spans_are_counted_by_reason() {
    let m = Metrics::default();
    m.otel_spans_dropped("queue_full", 2);
    m.otel_spans_dropped("queue_full", 3);
    m.otel_spans_dropped("export_failed", 1);
    let text = m.render();
    assert_has(
        &text,
        r#"nm_otel_spans_dropped_total{reason="queue_full"} 5"#,
    );
    assert_has(
        &text,
        r#"nm_otel_spans_dropped_total{reason="export_failed"} 1"#,
    );
}

/// The cost of the request path's calls, for labels already seen:
/// `cargo test --release -p nm-dataplane metrics::tests::cost -- --ignored --nocapture`.
#[test]
#[ignore = "a timing, not a check: run it by hand in release"]
fn cost_per_call() {
    const N: u32 = 1_000_000;
    let m = Metrics::default();
    let op = chat();
    let time = |what: &str, f: &dyn Fn()| {
        f();
        let start = std::time::Instant::now();
        for _ in 0..N {
            f();
        }
        eprintln!(
            "{what}: {} ns/call",
            start.elapsed().as_nanos() / u128::from(N)
        );
    };
    time("operation (stream, tokens, exemplar)", &|| m.operation(&op));
    let plain = Operation {
        time_to_first_chunk: None,
        trace_id: None,
        ..chat()
    };
    time("operation (no stream, tokens, no exemplar)", &|| {
        m.operation(&plain)
    });
    time("gateway_overhead", &|| {
        m.gateway_overhead("openai", Duration::from_micros(90));
    });
    time("http_server (exemplar)", &|| {
        m.http_server(
            &http::Method::POST,
            "/openai/{*path}",
            200,
            Duration::from_millis(20),
            Some(TRACE),
        );
    });
    time("http_server (no exemplar)", &|| {
        m.http_server(
            &http::Method::POST,
            "/openai/{*path}",
            200,
            Duration::from_millis(20),
            None,
        );
    });
}
