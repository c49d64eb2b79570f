//! The tracing harness itself: the OpenTelemetry SDK's own OTLP exporters, over gRPC and over
//! HTTP protobuf, against the in-process receiver (`common::otlp`), so a failing gateway
//! tracing test points at the gateway, not at the receiver.

use std::time::Duration;

use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanExporter as _};

use crate::common::otlp::{
    AttrValue, CollectedSpan, OtlpReceiver, SpanKind as Kind, Status, Transport,
};

const WAIT: Duration = Duration::from_secs(10);
const LINKED_TRACE: [u8; 16] = *b"\x0a\xf7\x65\x19\x16\xcd\x43\xdd\x84\x48\xeb\x21\x1c\x80\x31\x9c";
const LINKED_SPAN: [u8; 8] = *b"\xb7\xad\x6b\x71\x69\x20\x33\x31";

/// What [`emit`] made: (trace id, parent span id, child span id), in hex.
struct Emitted {
    trace_id: String,
    parent: String,
    child: String,
}

/// A parent span and a client child span with a string and an int attribute, an event and a
/// link, both ended.
fn emit(provider: &SdkTracerProvider) -> Emitted {
    let tracer = provider.tracer("nm-otel-harness");
    let parent = tracer.start("harness.parent");
    let parent_cx = Context::current_with_span(parent);
    let linked = SpanContext::new(
        TraceId::from_bytes(LINKED_TRACE),
        SpanId::from_bytes(LINKED_SPAN),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    let mut child = tracer
        .span_builder("chat harness-model")
        .with_kind(SpanKind::Client)
        .with_attributes([
            KeyValue::new("gen_ai.request.model", "harness-model"),
            KeyValue::new("gen_ai.usage.input_tokens", 42_i64),
        ])
        .with_links(vec![Link::with_context(linked)])
        .start_with_context(&tracer, &parent_cx);
    child.add_event("first_chunk", vec![]);
    let ids = Emitted {
        trace_id: child.span_context().trace_id().to_string(),
        parent: parent_cx.span().span_context().span_id().to_string(),
        child: child.span_context().span_id().to_string(),
    };
    child.end();
    parent_cx.span().end();
    ids
}

fn resource() -> Resource {
    Resource::builder_empty()
        .with_service_name("nm-otel-harness")
        .build()
}

/// Waits for `emitted`'s child span over `transport` and checks every field the SDK sent.
async fn assert_arrived(otlp: &OtlpReceiver, emitted: &Emitted, transport: Transport) {
    let spans = otlp
        .wait_for("the harness's child span", WAIT, |spans| {
            spans
                .iter()
                .any(|s| s.span_id == emitted.child && s.transport == transport)
        })
        .await;
    let child: &CollectedSpan = spans
        .iter()
        .find(|s| s.span_id == emitted.child)
        .unwrap_or_else(|| panic!("no child span"));
    assert_eq!(child.trace_id, emitted.trace_id);
    assert_eq!(child.trace_id.len(), 32);
    assert_eq!(child.span_id.len(), 16);
    assert_eq!(
        child.parent_span_id.as_deref(),
        Some(emitted.parent.as_str())
    );
    assert_eq!(child.name, "chat harness-model");
    assert_eq!(child.kind, Kind::Client);
    assert_eq!(child.str("gen_ai.request.model"), Some("harness-model"));
    assert_eq!(child.int("gen_ai.usage.input_tokens"), Some(42));
    assert!(!child.has("gen_ai.response.model"));
    assert_eq!(
        child.resource.get("service.name"),
        Some(&AttrValue::Str("nm-otel-harness".into()))
    );
    assert_eq!(child.scope, "nm-otel-harness");
    assert_eq!(child.status, Status::Unset);
    assert_eq!(
        child.links,
        vec![(
            "0af7651916cd43dd8448eb211c80319c".to_owned(),
            "b7ad6b7169203331".to_owned()
        )]
    );
    assert_eq!(child.events, vec!["first_chunk".to_owned()]);
    assert!(child.start_unix_nanos > 0 && child.end_unix_nanos >= child.start_unix_nanos);
    assert!(child.all_text().contains("harness-model"));

    let parent = spans
        .iter()
        .find(|s| s.span_id == emitted.parent)
        .unwrap_or_else(|| panic!("no parent span"));
    assert_eq!(parent.parent_span_id, None);
    assert_eq!(parent.kind, Kind::Internal);
}

/// OTLP/gRPC through the SDK's batch processor, flushed as the gateway will: `force_flush` blocks,
/// so from `spawn_blocking`.
#[tokio::test(flavor = "multi_thread")]
async fn sdk_batch_export_over_grpc_arrives_whole() {
    let otlp = OtlpReceiver::start().await;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(otlp.grpc_endpoint())
        .build()
        .unwrap_or_else(|e| panic!("exporter: {e}"));
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource())
        .build();
    let emitted = emit(&provider);
    let flushing = provider.clone();
    tokio::task::spawn_blocking(move || flushing.force_flush())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("force_flush: {e}"));
    assert_arrived(&otlp, &emitted, Transport::Grpc).await;
    assert!(otlp.exports() >= 1);
    tokio::task::spawn_blocking(move || provider.shutdown())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("shutdown: {e}"));
}

/// OTLP/HTTP protobuf. The SDK's hyper client needs a Tokio runtime on the exporting thread,
/// which the batch processor's own thread has not, so the SDK's spans are collected and handed
/// to the exporter here, on the runtime.
#[tokio::test(flavor = "multi_thread")]
async fn sdk_export_over_http_protobuf_arrives_whole() {
    let otlp = OtlpReceiver::start().await;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        // A client of the harness's own (the SDK's hyper client is not built in).
        .with_http_client(http_client(Duration::from_secs(10)))
        .with_protocol(Protocol::HttpBinary)
        // A programmatic endpoint is used as given; only OTEL_EXPORTER_OTLP_ENDPOINT gets
        // `/v1/traces` appended by the SDK.
        .with_endpoint(format!("{}/v1/traces", otlp.http_endpoint()))
        .build()
        .unwrap_or_else(|e| panic!("exporter: {e}"));
    let collected = collect::Collected::default();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(collected.clone())
        .with_resource(resource())
        .build();
    let emitted = emit(&provider);
    let batch = collected.take();
    // The provider hands its resource to processors; an exporter used directly is told here.
    let mut exporter = exporter;
    exporter.set_resource(&resource());
    exporter
        .export(batch)
        .await
        .unwrap_or_else(|e| panic!("export: {e}"));
    assert_arrived(&otlp, &emitted, Transport::Http).await;
    assert_eq!(otlp.exports(), 1);
}

#[tokio::test]
async fn http_receiver_refuses_other_paths_and_types() {
    let otlp = OtlpReceiver::start().await;
    let client = crate::common::http::client();
    let post = |path: &str, ctype: &str| {
        crate::common::http::request(
            "POST",
            &format!("{}{path}", otlp.http_endpoint()),
            &[("content-type", ctype)],
            "",
        )
    };
    for (req, want) in [
        (post("/v1/traces", "application/x-protobuf"), 200),
        (post("/v1/metrics", "application/x-protobuf"), 404),
        (post("/v1/traces", "application/json"), 415),
    ] {
        let a = crate::common::http::read(crate::common::http::send(&client, req).await).await;
        assert_eq!(a.status, want);
    }
    assert_eq!(otlp.exports(), 1, "only the good request is an export");
    assert!(otlp.spans().is_empty(), "an empty export has no spans");
}

/// A hung collector: the export is received and counted, never answered (the exporter times out),
/// and its spans are not kept; once answering again, the next export lands.
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_receiver_counts_exports_and_keeps_nothing() {
    let otlp = OtlpReceiver::start().await;
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(otlp.grpc_endpoint())
        .with_timeout(Duration::from_millis(300))
        .build()
        .unwrap_or_else(|e| panic!("exporter: {e}"));
    exporter.set_resource(&resource());
    let collected = collect::Collected::default();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(collected.clone())
        .build();

    let mut http_exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(http_client(Duration::from_millis(300)))
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(format!("{}/v1/traces", otlp.http_endpoint()))
        .with_timeout(Duration::from_millis(300))
        .build()
        .unwrap_or_else(|e| panic!("exporter: {e}"));
    http_exporter.set_resource(&resource());

    otlp.set_hang(true);
    emit(&provider);
    let hung = exporter.export(collected.take()).await;
    assert!(
        hung.is_err(),
        "a hung collector cannot acknowledge: {hung:?}"
    );
    emit(&provider);
    let hung = http_exporter.export(collected.take()).await;
    assert!(
        hung.is_err(),
        "a hung collector cannot acknowledge: {hung:?}"
    );
    assert_eq!(otlp.exports(), 2);
    assert!(otlp.spans().is_empty());

    otlp.set_hang(false);
    let emitted = emit(&provider);
    exporter
        .export(collected.take())
        .await
        .unwrap_or_else(|e| panic!("export: {e}"));
    assert_arrived(&otlp, &emitted, Transport::Grpc).await;
    assert_eq!(otlp.exports(), 3);
}

/// A real backend: the SDK's OTLP/gRPC export read back from Arize Phoenix's REST API (skipped
/// without `NM_TEST_PHOENIX`).
#[tokio::test(flavor = "multi_thread")]
async fn phoenix_shows_an_exported_span() {
    let Some(phoenix) = crate::common::phoenix::start().await else {
        return;
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(phoenix.grpc_endpoint())
        .build()
        .unwrap_or_else(|e| panic!("exporter: {e}"));
    // Phoenix files spans under the resource's `openinference.project.name`, not `service.name`.
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder_empty()
                .with_service_name("nm-otel-harness")
                .with_attribute(KeyValue::new("openinference.project.name", "nm-harness"))
                .build(),
        )
        .build();
    let emitted = emit(&provider);
    tokio::task::spawn_blocking(move || provider.shutdown())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("shutdown: {e}"));

    let spans = phoenix
        .wait_for_trace_spans(&emitted.trace_id, 2, Duration::from_secs(30))
        .await;
    let spans = spans.as_array().cloned().unwrap_or_default();
    let child = spans
        .iter()
        .find(|s| s["context"]["span_id"] == emitted.child.as_str())
        .unwrap_or_else(|| panic!("no child span in {spans:#?}"));
    assert_eq!(child["name"], "chat harness-model");
    assert_eq!(child["parent_id"], emitted.parent.as_str());
    assert_eq!(child["attributes"]["gen_ai.request.model"], "harness-model");
    assert_eq!(child["attributes"]["gen_ai.usage.input_tokens"], 42);
    // Phoenix's own reading of the GenAI attributes.
    assert_eq!(child["span_kind"], "LLM");
    assert_eq!(child["attributes"]["llm.model_name"], "harness-model");
    assert_eq!(child["events"][0]["name"], "first_chunk");
    assert!(phoenix.projects().await.contains(&"nm-harness".to_owned()));
    assert_eq!(
        phoenix
            .spans_in("nm-harness")
            .await
            .as_array()
            .map(Vec::len),
        Some(2)
    );
}

/// A span processor that keeps ended spans for a test to export itself.
mod collect {
    use std::sync::{Arc, Mutex};

    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::{Span, SpanData, SpanProcessor};

    #[derive(Debug, Clone, Default)]
    pub struct Collected(Arc<Mutex<Vec<SpanData>>>);

    impl Collected {
        pub fn take(&self) -> Vec<SpanData> {
            self.0
                .lock()
                .map(|mut v| std::mem::take(&mut *v))
                .unwrap_or_default()
        }
    }

    impl SpanProcessor for Collected {
        fn on_start(&self, _span: &mut Span, _cx: &opentelemetry::Context) {}

        fn on_end(&self, span: SpanData) {
            if let Ok(mut v) = self.0.lock() {
                v.push(span);
            }
        }

        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }

        fn shutdown_with_timeout(&self, _timeout: std::time::Duration) -> OTelSdkResult {
            Ok(())
        }
    }
}

fn http_client(timeout: Duration) -> harness_http::Client {
    harness_http::Client::new(timeout)
}

/// A plain-HTTP client for the SDK's OTLP/HTTP exporter (the SDK's own hyper client is not
/// built in): hyper, giving up after a timeout.
mod harness_http {
    use std::time::Duration;

    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client as Hyper;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    use opentelemetry_http::{HttpClient, HttpError};

    #[derive(Debug, Clone)]
    pub struct Client {
        hyper: Hyper<HttpConnector, Full<Bytes>>,
        timeout: Duration,
    }

    impl Client {
        pub fn new(timeout: Duration) -> Self {
            Self {
                hyper: Hyper::builder(TokioExecutor::new()).build_http(),
                timeout,
            }
        }
    }

    #[async_trait::async_trait]
    impl HttpClient for Client {
        async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
            let (parts, body) = request.into_parts();
            let request = Request::from_parts(parts, Full::new(body));
            let exchange = async {
                let response = self.hyper.request(request).await?;
                let (parts, body) = response.into_parts();
                let body = body.collect().await?.to_bytes();
                Ok::<_, HttpError>(Response::from_parts(parts, body))
            };
            tokio::time::timeout(self.timeout, exchange)
                .await
                .map_err(|_| HttpError::from(format!("no answer within {:?}", self.timeout)))?
        }
    }
}
