//! The controlplane's side of the internal link: `nm.link.v1.Link`, for dataplanes only.
//!
//! Every call must carry the deployment's link secret (metadata `nm-link-secret`), compared in
//! constant time ([`LinkAuth`]); without it the call fails with UNAUTHENTICATED before the
//! service sees it: nothing is revealed, nothing stored. A controlplane started without a
//! secret (allowed only on a loopback address) refuses every link call.
//!
//! Beyond the secret, what a dataplane sends is still checked, by the same rules as in `serve`:
//! the controlplane's one ingest path and one signal path (`nm_controlplane::link`) check every
//! field and that a record or signal names a key that was valid when the request was made. This
//! module only reads the messages (parsing what they carry as text: session ids, envs, actions),
//! maps the answers and authenticates; the rules, the streams and the storage are the
//! controlplane crate's.

use std::pin::Pin;

use nm_controlplane::{Controlplane, feeds};
use nm_types::VerifierKey;
use nm_types::link;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use super::link_pb::{self, link_server::Link, link_server::LinkServer};
use super::status::to_status;
use super::{LINK_SECRET_METADATA, MAX_LINK_MESSAGE_BYTES, NOT_STORED_METADATA};
use crate::config::Secret;
use crate::otel::link::LinkTracing;
use opentelemetry::context::FutureExt as _;

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
            &self.cp.experiments,
            self.cp.store.writability(),
            self.verifier.clone(),
            name,
            self.cp.shutdown(),
        );
        let stream = ReceiverStream::new(rx).map(|k| Ok(link::key_verifiers_to_pb(k)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn watch_budgets(
        &self,
        req: Request<link_pb::WatchBudgetsRequest>,
    ) -> Result<Response<Self::WatchBudgetsStream>, Status> {
        let name = dataplane_name(req.into_inner().dataplane)?;
        let rx = feeds::budget_feed(&self.cp.budgets, name, self.cp.shutdown());
        let stream = ReceiverStream::new(rx).map(|f| Ok(link::feed_to_pb(f)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn lease(
        &self,
        req: Request<link_pb::LeaseRequest>,
    ) -> Result<Response<link_pb::LeaseResponse>, Status> {
        let mut request =
            link::lease_request_from_pb(req.into_inner()).map_err(Status::invalid_argument)?;
        request.dataplane = dataplane_name(request.dataplane)?;
        let granted = self.cp.budgets.lease(&request, nm_controlplane::now_ms());
        Ok(Response::new(link::lease_response_to_pb(granted)))
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
    /// Reads the batch (a record whose session id, env or trace does not parse is refused
    /// alone), then hands it to the controlplane's one ingest path.
    async fn ingest(
        &self,
        batch: Vec<link_pb::RequestRecord>,
    ) -> Result<Response<link_pb::IngestRequestsResponse>, Status> {
        nm_controlplane::link::check_batch_len(batch.len()).map_err(to_status)?;
        let mut rejected = Vec::new();
        let mut readable = Vec::with_capacity(batch.len());
        let mut positions = Vec::with_capacity(batch.len());
        for (i, r) in batch.into_iter().enumerate() {
            match link::record_from_pb(r) {
                Ok(record) => {
                    positions.push(i);
                    readable.push(record);
                }
                Err(why) => rejected.push(link_pb::RejectedRecord {
                    index: i as u32,
                    reason: why.to_owned(),
                }),
            }
        }
        let outcome = self.cp.ingest(&readable).await.map_err(to_status)?;
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

    /// Reads the signal (its session id and action parsed here), then hands it to the
    /// controlplane's one signal path.
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
        let signal = link::signal_from_pb(signal).map_err(Status::invalid_argument)?;
        let outcome = self
            .cp
            .record_signal(signal, commit_within)
            .await
            .map_err(to_status)?;
        Ok(Response::new(link_pb::RecordSignalResponse {
            duplicate: outcome.stored == nm_controlplane::Stored::Duplicate,
            session_spans: link::spans_to_pb(&outcome.session_spans),
        }))
    }
}
