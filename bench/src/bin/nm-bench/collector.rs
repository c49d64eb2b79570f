//! The local OpenTelemetry collector of `nm-bench --tracing` (`nm-bench collector`, hidden): an
//! OTLP/gRPC trace receiver that decodes every export, as a collector must, and counts the
//! spans per `service.name` into `<port file>.spans` (JSON, rewritten at most every 100 ms), so
//! the bench can check that the traced gateway exported and the unsampled one did not.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;

use crate::processes::announce;

pub(crate) async fn collector(port_file: &Path) -> anyhow::Result<()> {
    let listener = announce(port_file).await?;
    let sink = Sink {
        counts: Mutex::new((BTreeMap::new(), None)),
        file: port_file.with_extension("spans"),
    };
    tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(sink))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
        .await?;
    Ok(())
}

/// The path of a collector's span counts, beside its port file.
pub(crate) fn counts_file(port_file: &Path) -> PathBuf {
    port_file.with_extension("spans")
}

struct Sink {
    /// Spans per service name, and when they were last written out.
    counts: Mutex<(BTreeMap<String, u64>, Option<Instant>)>,
    file: PathBuf,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut counted = Vec::new();
        for rs in &request.get_ref().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.as_ref())
                .map_or_else(String::new, |v| match v {
                    Value::StringValue(s) => s.clone(),
                    _ => String::new(),
                });
            let spans: usize = rs.scope_spans.iter().map(|s| s.spans.len()).sum();
            counted.push((service, spans as u64));
        }
        let snapshot = {
            let Ok(mut state) = self.counts.lock() else {
                return Err(tonic::Status::internal("poisoned"));
            };
            let (counts, written) = &mut *state;
            for (service, n) in counted {
                *counts.entry(service).or_default() += n;
            }
            let due = written.is_none_or(|w| w.elapsed() >= Duration::from_millis(100));
            due.then(|| {
                *written = Some(Instant::now());
                counts.clone()
            })
        };
        if let Some(counts) = snapshot {
            let tmp = self.file.with_extension("spans.tmp");
            if let Ok(text) = serde_json::to_string(&counts)
                && std::fs::write(&tmp, text).is_ok()
            {
                let _ = std::fs::rename(&tmp, &self.file);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}
