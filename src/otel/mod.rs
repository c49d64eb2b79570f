//! OpenTelemetry: the SDK and the OTLP exporter, set up from [`settings`] for one process shape.
//!
//! Nothing here is global: each started shape ([`crate::app`]) builds its own [`Telemetry`]
//! (so tests can run several in one process, each with its own `service.name`), hands its
//! tracer to the halves, and shuts it down last, flushing what is queued.
//!
//! Spans are made by the OpenTelemetry SDK (sampling, ids, limits, context) and leave through
//! [`export::Batching`], a bounded queue and an export thread of its own: the request path never
//! waits on the collector, and what cannot be queued or exported is counted
//! (`nm_otel_spans_dropped_total`). The thread encodes each batch straight into OTLP protobuf
//! ([`otlp`]) and sends it over gRPC ([`grpc`]) or HTTP ([`http`]) ([`transport`]).

pub mod export;
pub mod grpc;
pub mod http;
pub mod link;
pub mod otlp;
pub mod settings;
pub mod transport;
pub mod wire;

use opentelemetry::InstrumentationScope;
use opentelemetry::KeyValue;
use opentelemetry::global::BoxedTracer;
use opentelemetry::propagation::{TextMapCompositePropagator, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};

use self::export::{Batching, DropCounter, Schedule};
use self::settings::{Export, Root};
use self::transport::Sender;

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
        let make = move || Sender::new(&config);
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
