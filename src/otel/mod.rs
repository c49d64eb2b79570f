//! OpenTelemetry: the SDK and the OTLP exporter, set up from [`settings`] for one process shape.
//!
//! Nothing here is global: each started shape ([`crate::app`]) builds its own [`Telemetry`]
//! (so tests can run several in one process, each with its own `service.name`), hands its
//! tracer to the halves, and shuts it down last, flushing what is queued.
//!
//! Spans leave through [`export::Batching`], a bounded queue and an export thread of its own:
//! the request path never waits on the collector, and what cannot be queued or exported is
//! counted (`nm_otel_spans_dropped_total`).

pub mod export;
pub mod http;
pub mod link;
pub mod settings;

use std::collections::HashMap;

use opentelemetry::InstrumentationScope;
use opentelemetry::KeyValue;
use opentelemetry::global::BoxedTracer;
use opentelemetry::propagation::{TextMapCompositePropagator, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};

use self::export::{Batching, DropCounter, Schedule};
use self::settings::{Export, Protocol, Root};

/// The instrumentation scope of every span the gateway makes.
pub const SCOPE: &str = "nm-gateway";

/// A process shape's tracer provider.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    export: Export,
}

impl Telemetry {
    /// Starts exporting per `export`; `default_service` names the process shape when neither
    /// `OTEL_SERVICE_NAME` nor the resource attributes do. Drops are counted by `drops`.
    pub fn start(
        export: &Export,
        default_service: &'static str,
        drops: DropCounter,
    ) -> std::io::Result<Self> {
        let config = export.clone();
        let make = move || build_exporter(&config);
        let processor = Batching::start(
            Schedule {
                queue: export.queue,
                batch: export.batch,
                delay: export.schedule_delay,
                timeout: export.timeout,
            },
            make,
            drops,
        )?;
        let service = export
            .service_name
            .clone()
            .unwrap_or_else(|| default_service.to_owned());
        let resource = Resource::builder_empty()
            .with_detector(Box::new(
                opentelemetry_sdk::resource::TelemetryResourceDetector,
            ))
            .with_attributes(
                export
                    .resource
                    .iter()
                    .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
            )
            .with_service_name(service)
            .with_attribute(KeyValue::new("service.version", crate::VERSION))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(sampler(export.sampler))
            .with_resource(resource)
            .build();
        tracing::info!(endpoint = %export.endpoint, protocol = ?export.protocol, "exporting traces over OTLP");
        Ok(Self {
            provider,
            export: export.clone(),
        })
    }

    /// A tracer for the gateway's spans.
    pub fn tracer(&self) -> BoxedTracer {
        let scope = InstrumentationScope::builder(SCOPE)
            .with_version(crate::VERSION)
            .with_schema_url("https://opentelemetry.io/schemas/1.37.0")
            .build();
        BoxedTracer::new(Box::new(self.provider.tracer_with_scope(scope)))
    }

    /// The propagators `OTEL_PROPAGATORS` names (W3C trace context and baggage by default).
    pub fn propagator(&self) -> Box<dyn TextMapPropagator + Send + Sync> {
        let mut parts: Vec<Box<dyn TextMapPropagator + Send + Sync>> = Vec::new();
        if self.export.propagators.tracecontext {
            parts.push(Box::new(TraceContextPropagator::new()));
        }
        if self.export.propagators.baggage {
            parts.push(Box::new(BaggagePropagator::new()));
        }
        Box::new(TextMapCompositePropagator::new(parts))
    }

    /// The dataplane's handle.
    pub fn dataplane(&self) -> nm_dataplane::otel::Tracing {
        let p = self.export.propagators;
        let baggage: Option<Box<dyn TextMapPropagator + Send + Sync>> =
            p.baggage.then(|| Box::new(BaggagePropagator::new()) as _);
        nm_dataplane::otel::Tracing::new(
            self.tracer(),
            self.propagator(),
            p.tracecontext,
            baggage,
            self.export.capture_content,
        )
    }

    /// The controlplane's handle (the link's server spans, the database spans).
    pub fn link(&self) -> link::LinkTracing {
        link::LinkTracing::new(self.tracer())
    }

    /// Exports what is queued and stops the export thread. The SDK's shutdown blocks, so it
    /// runs off the runtime's threads.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        if let Ok(Err(e)) = done {
            tracing::warn!(error = %e, "OpenTelemetry shutdown did not finish cleanly");
        }
    }
}

fn sampler(s: settings::Sampler) -> Sampler {
    let root = |r: Root| match r {
        Root::AlwaysOn => Sampler::AlwaysOn,
        Root::AlwaysOff => Sampler::AlwaysOff,
        Root::Ratio(r) => Sampler::TraceIdRatioBased(r),
    };
    match s {
        settings::Sampler::AlwaysOn => Sampler::AlwaysOn,
        settings::Sampler::AlwaysOff => Sampler::AlwaysOff,
        settings::Sampler::Ratio(r) => Sampler::TraceIdRatioBased(r),
        settings::Sampler::ParentBased(r) => Sampler::ParentBased(Box::new(root(r))),
    }
}

/// Builds the OTLP exporter (on the export thread, inside its runtime).
fn build_exporter(export: &Export) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let built = match export.protocol {
        Protocol::Grpc => {
            let mut metadata = tonic::metadata::MetadataMap::new();
            for (k, v) in &export.headers {
                let key = tonic::metadata::MetadataKey::from_bytes(k.as_bytes())
                    .map_err(|_| format!("OTLP header {k:?} is not a valid gRPC metadata key"))?;
                let value = v
                    .parse()
                    .map_err(|_| format!("the value of OTLP header {k:?} is not valid metadata"))?;
                metadata.insert(key, value);
            }
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(export.endpoint.clone())
                .with_timeout(export.timeout)
                .with_metadata(metadata);
            if export.endpoint.starts_with("https://") {
                let mut tls = tonic::transport::ClientTlsConfig::new().with_webpki_roots();
                if let Some(pem) = &export.ca_pem {
                    tls = tls.ca_certificate(tonic::transport::Certificate::from_pem(pem));
                }
                builder = builder.with_tls_config(tls);
            }
            builder.build()
        }
        Protocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(http::OtlpHttpClient::new(
                export.ca_pem.as_deref(),
                export.timeout,
            )?)
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(export.endpoint.clone())
            .with_timeout(export.timeout)
            .with_headers(export.headers.iter().cloned().collect::<HashMap<_, _>>())
            .build(),
    };
    built.map_err(|e| e.to_string())
}
