//! The in-process adapter: the dataplane of `nm-gateway serve` calls its own controlplane
//! directly. Streams are the controlplane's own; records and signals are stored by reference.

use nm_controlplane::{Controlplane, NewSignal};
use nm_types::budget::Feed;
use nm_types::record::RequestRecord;
use nm_types::throttle::Throttle;
use nm_types::{KeyVerifiers, VerifierKey};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use super::{Ingested, LinkError, LinkStream, Port, SessionSpans};

#[derive(Debug, Clone)]
pub struct InProcess {
    cp: Controlplane,
    verifier: VerifierKey,
}

impl InProcess {
    pub fn new(cp: Controlplane, verifier: VerifierKey) -> Self {
        Self { cp, verifier }
    }
}

/// The one mapping of a controlplane error for an in-process caller: invalid data is refused
/// for good, anything else is "try again"; the database's text stays in the log (at most a line
/// a second: an outage fails every call).
fn link_error(e: nm_controlplane::Error) -> LinkError {
    static LOGGED: Throttle = Throttle::new(std::time::Duration::from_secs(1));
    match e {
        nm_controlplane::Error::InvalidArgument(m) => LinkError::Rejected(m),
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

    async fn ingest(&self, batch: &[RequestRecord]) -> Result<Ingested, LinkError> {
        let outcome = nm_controlplane::store::retry_conflicts(|| self.cp.records.ingest(batch))
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
        signal: NewSignal,
        commit_within: std::time::Duration,
    ) -> Result<SessionSpans, LinkError> {
        let session = signal.session_id.clone();
        self.cp
            .signals
            .record_within(signal, commit_within)
            .await
            .map_err(link_error)?;
        Ok(session_spans(&self.cp, &session).await)
    }
}

/// The spans of `session`'s latest traced requests, when the current call is traced (its
/// context carries a tracer); a failed lookup only costs the links.
pub(crate) async fn session_spans(
    cp: &nm_controlplane::Controlplane,
    session: &str,
) -> SessionSpans {
    let cx = opentelemetry::Context::current();
    if cx.get::<nm_controlplane::otel::SpanSource>().is_none() {
        return Vec::new();
    }
    match cp.signals.session_spans(session, 8).await {
        Ok(spans) => spans,
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the session's traces");
            Vec::new()
        }
    }
}
