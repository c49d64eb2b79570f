//! The controlplane's side of the internal link: `nm.link.v1.Link`, for dataplanes only.
//!
//! Every call must carry the deployment's link secret (metadata `nm-link-secret`), compared in
//! constant time ([`LinkAuth`]); without it the call fails with UNAUTHENTICATED before the
//! service sees it: nothing is revealed, nothing stored. A controlplane started without a
//! secret (allowed only on a loopback address) refuses every link call.
//!
//! Beyond the secret, what a dataplane sends is still checked: the ingest validates every field
//! (`nm_controlplane::records`), and a record or signal must name a key that was valid when the
//! request was made. This module only maps between protobuf and domain types and
//! authenticates; the streams and the storage are the controlplane crate's.

use std::pin::Pin;

use nm_controlplane::{Controlplane, feeds};
use nm_types::VerifierKey;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};
use tracing::warn;

use super::link_pb::{self, link_server::Link, link_server::LinkServer};
use super::status::to_status;
use super::{LINK_SECRET_METADATA, MAX_LINK_MESSAGE_BYTES, NOT_STORED_METADATA, convert};
use crate::config::Secret;
use crate::otel::link::LinkTracing;
use opentelemetry::context::FutureExt as _;

/// Largest batch of request records accepted in one call.
pub const MAX_INGEST_BATCH: usize = 10_000;
/// Longest dataplane name accepted (it only goes to logs).
const MAX_DATAPLANE_NAME: usize = 128;

/// Checks the link secret on every call, in constant time.
#[derive(Clone)]
pub struct LinkAuth {
    secret: Option<Secret>,
}

impl std::fmt::Debug for LinkAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkAuth")
            .field("configured", &self.secret.is_some())
            .finish()
    }
}

impl tonic::service::Interceptor for LinkAuth {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.secret else {
            return Err(Status::unauthenticated(
                "this controlplane accepts no dataplanes: it was started without NM_LINK_SECRET",
            ));
        };
        let presented = req
            .metadata()
            .get(LINK_SECRET_METADATA)
            .and_then(|v| v.to_str().ok());
        match presented {
            Some(p) if nm_types::secrets_equal(p, expected.expose()) => Ok(req),
            Some(_) => Err(Status::unauthenticated(
                "wrong link secret: set the controlplane's NM_LINK_SECRET on this dataplane",
            )),
            None => Err(Status::unauthenticated(
                "missing link secret: dataplanes present NM_LINK_SECRET",
            )),
        }
    }
}

/// The link service, wrapped in its authentication, with its message limit set.
pub fn service(
    cp: Controlplane,
    secret: Option<Secret>,
    tracing: Option<LinkTracing>,
) -> InterceptedService<LinkServer<LinkService>, LinkAuth> {
    // Without a secret no call gets through; the verifier key then only needs to be some key.
    let verifier = VerifierKey::from_link_secret(secret.as_ref().map_or("", Secret::expose));
    let server = LinkServer::new(LinkService {
        cp,
        verifier,
        tracing,
    })
    .max_decoding_message_size(MAX_LINK_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_LINK_MESSAGE_BYTES);
    InterceptedService::new(server, LinkAuth { secret })
}

#[derive(Debug, Clone)]
pub struct LinkService {
    cp: Controlplane,
    verifier: VerifierKey,
    /// Server spans for traced calls (tracing on).
    tracing: Option<LinkTracing>,
}

type Stream_<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

fn dataplane_name(name: String) -> Result<String, Status> {
    if name.len() > MAX_DATAPLANE_NAME || name.chars().any(char::is_control) {
        return Err(Status::invalid_argument(
            "dataplane: at most 128 printable characters",
        ));
    }
    Ok(name)
}

#[tonic::async_trait]
impl Link for LinkService {
    type WatchKeysStream = Stream_<link_pb::KeySnapshot>;
    type WatchBudgetsStream = Stream_<link_pb::BudgetFeed>;

    async fn watch_keys(
        &self,
        req: Request<link_pb::WatchKeysRequest>,
    ) -> Result<Response<Self::WatchKeysStream>, Status> {
        let name = dataplane_name(req.into_inner().dataplane)?;
        let rx = feeds::key_snapshots(
            &self.cp.keys,
            self.cp.store.writability(),
            self.verifier.clone(),
            name,
            self.cp.shutdown(),
        );
        let stream = ReceiverStream::new(rx).map(|k| Ok(convert::key_verifiers_to_pb(k)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn watch_budgets(
        &self,
        req: Request<link_pb::WatchBudgetsRequest>,
    ) -> Result<Response<Self::WatchBudgetsStream>, Status> {
        let name = dataplane_name(req.into_inner().dataplane)?;
        let rx = feeds::budget_feed(&self.cp.budgets, name, self.cp.shutdown());
        let stream = ReceiverStream::new(rx).map(|f| Ok(convert::feed_to_pb(f)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn ingest_requests(
        &self,
        req: Request<link_pb::IngestRequestsRequest>,
    ) -> Result<Response<link_pb::IngestRequestsResponse>, Status> {
        let cx = self
            .tracing
            .as_ref()
            .filter(|_| req.metadata().contains_key("traceparent"))
            .map(|t| t.server(req.metadata(), "IngestRequests"));
        let ingest = self.ingest(req.into_inner().records);
        match cx {
            Some(cx) => ingest.with_context(cx).await,
            None => ingest.await,
        }
    }

    async fn record_signal(
        &self,
        req: Request<link_pb::RecordSignalRequest>,
    ) -> Result<Response<link_pb::RecordSignalResponse>, Status> {
        let cx = self
            .tracing
            .as_ref()
            .map(|t| t.server(req.metadata(), "RecordSignal"));
        // Every error answered here means "not stored": say so, so the dataplane can tell it
        // from a call whose answer was lost.
        let stored = self.store_signal(req.into_inner());
        let stored = match cx {
            Some(cx) => stored.with_context(cx).await,
            None => stored.await,
        };
        stored.map_err(|mut status| {
            status
                .metadata_mut()
                .insert(NOT_STORED_METADATA, MetadataValue::from_static("1"));
            status
        })
    }
}

impl LinkService {
    async fn ingest(
        &self,
        batch: Vec<link_pb::RequestRecord>,
    ) -> Result<Response<link_pb::IngestRequestsResponse>, Status> {
        if batch.len() > MAX_INGEST_BATCH {
            return Err(Status::invalid_argument(format!(
                "at most {MAX_INGEST_BATCH} records per call"
            )));
        }
        let mut rejected = Vec::new();
        let mut readable = Vec::with_capacity(batch.len());
        for (i, r) in batch.into_iter().enumerate() {
            match convert::record_from_pb(r) {
                Ok(record) => readable.push((i, record)),
                Err(why) => rejected.push(link_pb::RejectedRecord {
                    index: i as u32,
                    reason: why.to_owned(),
                }),
            }
        }
        // A record must name a key that was valid when its request was made.
        let uses: Vec<(&str, i64)> = readable
            .iter()
            .map(|(_, r)| (&*r.key_id, r.started_at_ms))
            .collect();
        let valid = self.cp.keys.valid_at(&uses).await.map_err(to_status)?;
        let mut accepted = Vec::with_capacity(readable.len());
        let mut positions = Vec::with_capacity(readable.len());
        for ((i, record), ok) in readable.into_iter().zip(valid) {
            if ok {
                positions.push(i);
                accepted.push(record);
            } else {
                rejected.push(link_pb::RejectedRecord {
                    index: i as u32,
                    reason: "key_id must name a key that was valid when the request was made"
                        .to_owned(),
                });
            }
        }
        if !rejected.is_empty() {
            warn!(
                records = rejected.len(),
                "request records refused: unknown or revoked key"
            );
        }
        let outcome = nm_controlplane::store::retry_conflicts(|| self.cp.records.ingest(&accepted))
            .await
            .map_err(to_status)?;
        rejected.extend(
            outcome
                .rejected
                .into_iter()
                .map(|(i, reason)| link_pb::RejectedRecord {
                    index: positions[i] as u32,
                    reason,
                }),
        );
        rejected.sort_by_key(|r| r.index);
        Ok(Response::new(link_pb::IngestRequestsResponse {
            stored: outcome.stored,
            epoch: outcome.epoch,
            seq: outcome.seq,
            rejected,
        }))
    }

    async fn store_signal(
        &self,
        req: link_pb::RecordSignalRequest,
    ) -> Result<Response<link_pb::RecordSignalResponse>, Status> {
        let commit_within = match req.commit_within_ms {
            0 => nm_controlplane::signals::DEFAULT_COMMIT_WITHIN,
            ms => std::time::Duration::from_millis(u64::from(ms)),
        };
        let signal = req
            .signal
            .ok_or_else(|| Status::invalid_argument("signal is required"))?;
        let signal = convert::signal_from_pb(signal).map_err(to_status)?;
        let session = signal.session_id.clone();
        let valid = self
            .cp
            .keys
            .valid_at(&[(signal.key_id.as_str(), signal.received_at_ms)])
            .await
            .map_err(to_status)?;
        if valid != [true] {
            return Err(Status::invalid_argument(
                "key_id must name a key that was valid when the signal was sent",
            ));
        }
        let stored = self
            .cp
            .signals
            .record_within(signal, commit_within)
            .await
            .map_err(to_status)?;
        let session_spans = crate::link::local::session_spans(&self.cp, &session)
            .await
            .into_iter()
            .map(|t| link_pb::SpanRef {
                trace_id: t.trace_hex(),
                span_id: t.span_hex(),
            })
            .collect();
        Ok(Response::new(link_pb::RecordSignalResponse {
            duplicate: stored == nm_controlplane::Stored::Duplicate,
            session_spans,
        }))
    }
}
