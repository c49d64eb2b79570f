//! OpenTelemetry: the tracer and the OTLP exporter, set up from [`settings`] for one process
//! shape.
//!
//! Nothing here is global: each started shape ([`crate::app`]) builds its own [`Telemetry`]
//! (so tests can run several in one process, each with its own `service.name`), hands its
//! tracer to the halves, and shuts it down last, exporting what is queued.
//!
//! Spans are the gateway's own values (`nm_dataplane::otel::span`: ids, sampling, limits as the
//! OpenTelemetry SDK had them): the request path makes them directly, everything else (the
//! controlplane's database spans, the link's) through the OpenTelemetry API (`BoxedTracer`,
//! `Context`) over the same tracer. Ended spans leave through a bounded queue and an export
//! thread of its own ([`export`]): the request path never waits on the collector, and what
//! cannot be queued or exported is counted (`nm_otel_spans_dropped_total`). The thread encodes
//! each batch straight into OTLP protobuf ([`otlp`]) and sends it over gRPC ([`grpc`]) or HTTP
//! ([`http`]) ([`transport`]). The SDK is left with the resource and the propagators.

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
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::BaggagePropagator;

use nm_dataplane::otel::span::Tracer;

use self::export::{DropCounter, Exporter, Schedule};
use self::otlp::Encoder;
use self::settings::Export;
use self::transport::Sender;

/// The instrumentation scope of every span the gateway makes.
pub const SCOPE: &str = "nm-gateway";

/// A process shape's tracer and export thread.
#[derive(Debug)]
pub struct Telemetry {
    tracer: Tracer,
    exporter: Exporter,
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
        let scope = InstrumentationScope::builder(SCOPE)
            .with_version(crate::VERSION)
            .with_schema_url("https://opentelemetry.io/schemas/1.37.0")
            .build();
        let (queue, exporter) = export::start(
            Schedule {
                queue: export.queue,
                batch: export.batch,
                delay: export.schedule_delay,
                timeout: export.timeout,
            },
            Encoder::new(&resource, &scope),
            make,
            drops,
        )?;
        tracing::info!(endpoint = %export.endpoint, protocol = ?export.protocol, "exporting traces over OTLP");
        Ok(Self {
            tracer: Tracer::new(export.sampler, queue),
            exporter,
            export: export.clone(),
        })
    }

    /// The tracer, through the OpenTelemetry API (for the spans made off the request path).
    pub fn tracer(&self) -> BoxedTracer {
        BoxedTracer::new(Box::new(self.tracer.clone()))
    }

    /// The dataplane's handle: the tracer, and the propagation `OTEL_PROPAGATORS` names (W3C
    /// trace context and baggage by default).
    pub fn dataplane(&self) -> nm_dataplane::otel::Tracing {
        let p = self.export.propagators;
        let baggage: Option<Box<dyn TextMapPropagator + Send + Sync>> =
            p.baggage.then(|| Box::new(BaggagePropagator::new()) as _);
        nm_dataplane::otel::Tracing::new(
            self.tracer.clone(),
            p.tracecontext,
            baggage,
            self.export.capture_content,
        )
    }

    /// The controlplane's handle (the link's server spans, the database spans).
    pub fn link(&self) -> link::LinkTracing {
        link::LinkTracing::new(self.tracer())
    }

    /// Exports what is queued and stops the export thread. That blocks, so it runs off the
    /// runtime's threads.
    pub async fn shutdown(self) {
        let exporter = self.exporter;
        let done = tokio::task::spawn_blocking(move || exporter.shutdown()).await;
        if let Ok(Err(e)) = done {
            tracing::warn!(error = %e, "OpenTelemetry shutdown did not finish cleanly");
        }
    }
}

#[cfg(test)]
#[path = "tracer_tests.rs"]
mod tracer_tests;
