//! The in-process adapter: the dataplane of `nm-gateway serve` calls its own controlplane
//! directly, through the same ingest and signal paths as the gRPC link server. Streams are the
//! controlplane's own; records and signals are stored by reference.

use nm_controlplane::Controlplane;
use nm_controlplane::otel::SpanSource;
use nm_dataplane::link::{Ingested, LinkError, LinkStream, Port, SessionSpans};
use nm_types::budget::{Feed, LeaseRequest, LeaseResponse};
use nm_types::record::RequestRecord;
use nm_types::signal::Signal;
use nm_types::throttle::Throttle;
use nm_types::{KeyVerifiers, VerifierKey};
use opentelemetry::context::FutureExt as _;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

#[derive(Debug, Clone)]
pub struct InProcess {
    cp: Controlplane,
    verifier: VerifierKey,
    /// With tracing on, the tracer the controlplane's database spans are made with: every call
    /// carries it in its context, as the gRPC link server's span does in a split controlplane.
    source: Option<SpanSource>,
}

impl InProcess {
    pub fn new(cp: Controlplane, verifier: VerifierKey, source: Option<SpanSource>) -> Self {
        Self {
            cp,
            verifier,
            source,
        }
    }

    /// The caller's context, with the tracer for the controlplane's spans.
    fn context(&self) -> opentelemetry::Context {
        let cx = opentelemetry::Context::current();
        match &self.source {
            Some(s) => cx.with_value(s.clone()),
            None => cx,
        }
    }
}

/// The one mapping of a controlplane error for an in-process caller: invalid data is refused
/// for good, anything else is "try again"; the database's text stays in the log (at most a line
/// a second: an outage fails every call).
fn link_error(e: nm_controlplane::Error) -> LinkError {
    static LOGGED: Throttle = Throttle::new(std::time::Duration::from_secs(1));
    match e {
        nm_controlplane::Error::InvalidArgument(m) => LinkError::Rejected(m),
        nm_controlplane::Error::SessionMismatch(m) => LinkError::SessionMismatch(m),
        other => {
            if let Some(suppressed) = LOGGED.allow() {
                tracing::warn!(error = %other, suppressed, "controlplane could not store it");
            }
            LinkError::Unavailable("the controlplane could not store it".to_owned())
        }
    }
}

#[async_trait::async_trait]
impl Port for InProcess {
    async fn watch_keys(&self, dataplane: &str) -> Result<LinkStream<KeyVerifiers>, LinkError> {
        let rx = nm_controlplane::feeds::key_snapshots(
            &self.cp.keys,
            &self.cp.experiments,
            self.cp.store.writability(),
            self.verifier.clone(),
            dataplane.to_owned(),
            self.cp.shutdown(),
        );
        Ok(Box::pin(ReceiverStream::new(rx).map(Ok)))
    }

    async fn watch_budgets(&self, dataplane: &str) -> Result<LinkStream<Feed>, LinkError> {
        let rx = nm_controlplane::feeds::budget_feed(
            &self.cp.budgets,
            dataplane.to_owned(),
            self.cp.shutdown(),
        );
        Ok(Box::pin(ReceiverStream::new(rx).map(Ok)))
    }

    async fn lease(&self, request: &LeaseRequest) -> Result<LeaseResponse, LinkError> {
        Ok(self.cp.budgets.lease(request, nm_controlplane::now_ms()))
    }

    async fn ingest(&self, batch: &[RequestRecord]) -> Result<Ingested, LinkError> {
        let outcome = self
            .cp
            .ingest(batch)
            .with_context(self.context())
            .await
            .map_err(link_error)?;
        Ok(Ingested {
            epoch: outcome.epoch,
            seq: outcome.seq,
            rejected: outcome.rejected,
        })
    }

    async fn record_signal(
        &self,
        signal: Signal,
        commit_within: std::time::Duration,
    ) -> Result<SessionSpans, LinkError> {
        let outcome = self
            .cp
            .record_signal(signal, commit_within)
            .with_context(self.context())
            .await
            .map_err(link_error)?;
        Ok(outcome.session_spans)
    }
}
