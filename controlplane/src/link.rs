//! The link's rules: the one ingest path ([`Controlplane::ingest`]) and the one signal path
//! ([`Controlplane::record_signal`]) every record and signal from a dataplane takes, whatever
//! adapter brought it (the in-process link of `nm-gateway serve`, the gRPC link server of a
//! split deployment). So both shapes refuse exactly the same data:
//!
//! - a batch of more than [`MAX_INGEST_BATCH`] records is refused whole;
//! - a record or signal must name a key that was valid when its request was made (live now, or
//!   revoked after that time): a dataplane may deliver long after the request, from its spool;
//! - every field is checked against its cap ([`RequestRecord::check`], [`Signal::check`]); a
//!   record that breaks a rule is refused alone, the rest of its batch is stored;
//! - a record is stored once per request id, a signal once per id and once per (key,
//!   idempotency key): what a dataplane resends is harmless.
//!
//! What was parsed at the edge (a session id, an env, an action) arrives typed; the adapters
//! only map and authenticate.

use std::borrow::Cow;
use std::time::Duration;

use nm_types::record::{RequestRecord, TraceRef};
use nm_types::signal::Signal;
use tracing::warn;

use crate::error::{Error, Result};
use crate::records::IngestOutcome;
use crate::signals::Stored;
use crate::{Controlplane, store};

/// Largest batch of request records accepted in one call.
pub const MAX_INGEST_BATCH: usize = 10_000;
/// How many of a session's latest traced requests a signal's span links to.
const SESSION_SPANS: u32 = 8;

/// What [`Controlplane::record_signal`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalOutcome {
    pub stored: Stored,
    /// The exported spans of the signal's session's latest requests (empty unless the call is
    /// traced: its context carries a [`crate::otel::SpanSource`]).
    pub session_spans: Vec<TraceRef>,
}

/// The batch-size rule, for an adapter that counts a batch before reading its records.
pub fn check_batch_len(records: usize) -> Result<()> {
    if records > MAX_INGEST_BATCH {
        return Err(Error::InvalidArgument(format!(
            "at most {MAX_INGEST_BATCH} records per call"
        )));
    }
    Ok(())
}

impl Controlplane {
    /// Stores a batch of records from a dataplane: refuses, each alone, the records whose key
    /// was not valid at their request's time and those that break a rule; stores the rest in
    /// one transaction (redone on a conflict), each once per request id.
    pub async fn ingest(&self, batch: &[RequestRecord]) -> Result<IngestOutcome> {
        check_batch_len(batch.len())?;
        let uses: Vec<(&str, i64)> = batch
            .iter()
            .map(|r| (&*r.key_id, r.started_at_ms))
            .collect();
        let valid = self.keys.valid_at(&uses).await?;
        let mut rejected: Vec<(usize, String)> = valid
            .iter()
            .enumerate()
            .filter(|(_, ok)| !**ok)
            .map(|(i, _)| {
                let rule = "key_id must name a key that was valid when the request was made";
                (i, rule.to_owned())
            })
            .collect();
        // Almost every batch is all valid: it is stored as it came, without a copy.
        let (accepted, positions): (Cow<'_, [RequestRecord]>, Vec<usize>) = if rejected.is_empty() {
            (Cow::Borrowed(batch), (0..batch.len()).collect())
        } else {
            warn!(
                records = rejected.len(),
                "request records refused: unknown or revoked key"
            );
            let positions: Vec<usize> = (0..batch.len()).filter(|&i| valid[i]).collect();
            (
                positions.iter().map(|&i| batch[i].clone()).collect(),
                positions,
            )
        };
        let mut outcome = store::retry_conflicts(|| self.records.ingest(&accepted)).await?;
        // Each key's last use, in memory (written every few seconds, never per request).
        self.keys.note_used(
            accepted
                .iter()
                .enumerate()
                .filter(|(i, _)| !outcome.rejected.iter().any(|(r, _)| r == i))
                .map(|(_, r)| (&*r.key_id, r.started_at_ms)),
        );
        rejected.extend(
            outcome
                .rejected
                .drain(..)
                .map(|(i, reason)| (positions[i], reason)),
        );
        rejected.sort_by_key(|(i, _)| *i);
        outcome.rejected = rejected;
        Ok(outcome)
    }

    /// Stores one signal from a dataplane, once its key is found valid at the signal's time;
    /// resolves after the commit, which must begin within `commit_within` (else it is not
    /// stored). An error means it was not stored.
    pub async fn record_signal(
        &self,
        signal: Signal,
        commit_within: Duration,
    ) -> Result<SignalOutcome> {
        let valid = self
            .keys
            .valid_at(&[(&*signal.key_id, signal.received_at_ms)])
            .await?;
        if valid != [true] {
            return Err(Error::InvalidArgument(
                "key_id must name a key that was valid when the signal was sent".to_owned(),
            ));
        }
        let session = signal.session_id.clone();
        let stored = self.signals.record_within(signal, commit_within).await?;
        // A signal naming only an answer links to no session's spans.
        let session_spans = match &session {
            Some(session) => self.session_spans(session.as_str()).await,
            None => Vec::new(),
        };
        Ok(SignalOutcome {
            stored,
            session_spans,
        })
    }

    /// The spans of `session`'s latest traced requests, when the current call is traced (its
    /// context carries a tracer); a failed lookup only costs the links.
    async fn session_spans(&self, session: &str) -> Vec<TraceRef> {
        let cx = opentelemetry::Context::current();
        if cx.get::<crate::otel::SpanSource>().is_none() {
            return Vec::new();
        }
        match self.signals.session_spans(session, SESSION_SPANS).await {
            Ok(spans) => spans,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the session's traces");
                Vec::new()
            }
        }
    }
}
