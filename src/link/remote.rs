//! The gRPC adapter: a dataplane talks to a controlplane in another process over
//! `nm.link.v1.Link`, presenting the link secret on every call (over TLS for an `https://`
//! controlplane URL; see [`crate::grpc::channel`]).

use nm_dataplane::link::{Ingested, LinkError, LinkStream, Port, SessionSpans};
use nm_types::KeyVerifiers;
use nm_types::budget::{Feed, LeaseRequest, LeaseResponse};
use nm_types::link;
use nm_types::record::RequestRecord;
use nm_types::signal::Signal;
use tokio_stream::StreamExt;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::grpc::link_pb::{self, link_client::LinkClient};
use crate::grpc::{LINK_SECRET_METADATA, MAX_LINK_MESSAGE_BYTES, NOT_STORED_METADATA};

/// Adds the link secret to every call.
#[derive(Clone)]
pub struct PresentSecret(MetadataValue<Ascii>);

impl std::fmt::Debug for PresentSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PresentSecret(..)")
    }
}

impl tonic::service::Interceptor for PresentSecret {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut()
            .insert(LINK_SECRET_METADATA, self.0.clone());
        Ok(req)
    }
}

type Transport = InterceptedService<Channel, PresentSecret>;
type Client = LinkClient<Transport>;

#[derive(Debug, Clone)]
pub struct Grpc {
    client: Client,
    /// `IngestRequests` without the generated client: its batch goes as bytes written straight
    /// from the records ([`link::encode_batch`]).
    ingest: tonic::client::Grpc<Transport>,
}

/// `nm.link.v1.Link/IngestRequests`.
const INGEST_PATH: &str = "/nm.link.v1.Link/IngestRequests";

/// The codec of [`Grpc::ingest`]: the request is an `IngestRequestsRequest` already encoded; the
/// answer is decoded by prost as the generated client would.
#[derive(Debug, Clone, Copy, Default)]
struct Encoded;

impl tonic::codec::Codec for Encoded {
    type Encode = bytes::Bytes;
    type Decode = link_pb::IngestRequestsResponse;
    type Encoder = Encoded;
    type Decoder = tonic_prost::ProstDecoder<link_pb::IngestRequestsResponse>;

    fn encoder(&mut self) -> Encoded {
        Encoded
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::new(tonic::codec::BufferSettings::default())
    }
}

impl tonic::codec::Encoder for Encoded {
    type Item = bytes::Bytes;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: bytes::Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl Grpc {
    /// A link over `channel` that presents `secret` (printable ASCII, checked at start).
    pub fn new(channel: Channel, secret: &str) -> anyhow::Result<Self> {
        let mut value: MetadataValue<Ascii> = secret
            .parse()
            .map_err(|_| anyhow::anyhow!("NM_LINK_SECRET is not a valid metadata value"))?;
        value.set_sensitive(true);
        let transport = InterceptedService::new(channel, PresentSecret(value));
        let client = LinkClient::new(transport.clone())
            .max_encoding_message_size(MAX_LINK_MESSAGE_BYTES)
            .max_decoding_message_size(MAX_LINK_MESSAGE_BYTES);
        let ingest = tonic::client::Grpc::new(transport)
            .max_encoding_message_size(MAX_LINK_MESSAGE_BYTES)
            .max_decoding_message_size(MAX_LINK_MESSAGE_BYTES);
        Ok(Self { client, ingest })
    }
}

/// The one mapping of a gRPC status for the link's client side.
fn link_error(status: tonic::Status) -> LinkError {
    let message = format!("{}: {}", status.code(), status.message());
    match status.code() {
        tonic::Code::InvalidArgument | tonic::Code::OutOfRange | tonic::Code::ResourceExhausted => {
            LinkError::Rejected(message)
        }
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
            LinkError::Unauthenticated(message)
        }
        _ => LinkError::Unavailable(message),
    }
}

/// A failed `RecordSignal`: "not stored" only when the controlplane said so (every error its
/// handler answers carries [`NOT_STORED_METADATA`]), when the call was refused at the door, or
/// when no connection could be made; otherwise (a connection lost mid-call, a reset stream) the
/// signal may have been stored.
fn signal_error(status: tonic::Status) -> LinkError {
    if status
        .metadata()
        .get(crate::grpc::status::ERROR_CODE_METADATA)
        .is_some_and(|v| v.as_bytes() == b"session_mismatch")
    {
        return LinkError::SessionMismatch(status.message().to_owned());
    }
    let never_sent =
        status.code() == tonic::Code::Unavailable && status.message().contains("connect");
    if status.metadata().contains_key(NOT_STORED_METADATA)
        || never_sent
        || matches!(
            status.code(),
            tonic::Code::InvalidArgument
                | tonic::Code::OutOfRange
                | tonic::Code::ResourceExhausted
                | tonic::Code::Unauthenticated
                | tonic::Code::PermissionDenied
        )
    {
        return link_error(status);
    }
    LinkError::Unconfirmed(format!("{}: {}", status.code(), status.message()))
}

#[async_trait::async_trait]
impl Port for Grpc {
    async fn watch_keys(&self, dataplane: &str) -> Result<LinkStream<KeyVerifiers>, LinkError> {
        let stream = self
            .client
            .clone()
            .watch_keys(link_pb::WatchKeysRequest {
                dataplane: dataplane.to_owned(),
            })
            .await
            .map_err(link_error)?
            .into_inner();
        Ok(Box::pin(stream.map(|item| {
            item.map_err(link_error).map(link::key_verifiers_from_pb)
        })))
    }

    async fn watch_budgets(&self, dataplane: &str) -> Result<LinkStream<Feed>, LinkError> {
        let stream = self
            .client
            .clone()
            .watch_budgets(link_pb::WatchBudgetsRequest {
                dataplane: dataplane.to_owned(),
            })
            .await
            .map_err(link_error)?
            .into_inner();
        Ok(Box::pin(stream.map(|item| {
            item.map_err(link_error).map(link::feed_from_pb)
        })))
    }

    async fn lease(&self, request: &LeaseRequest) -> Result<LeaseResponse, LinkError> {
        let resp = self
            .client
            .clone()
            .lease(link::lease_request_to_pb(request))
            .await
            .map_err(link_error)?
            .into_inner();
        Ok(link::lease_response_from_pb(resp))
    }

    async fn ingest(&self, batch: &[RequestRecord]) -> Result<Ingested, LinkError> {
        let mut req = tonic::Request::new(bytes::Bytes::from(link::encode_batch(batch)));
        crate::otel::link::inject(req.metadata_mut());
        req.extensions_mut()
            .insert(tonic::GrpcMethod::new("nm.link.v1.Link", "IngestRequests"));
        let mut ingest = self.ingest.clone();
        ingest.ready().await.map_err(|e| {
            let e: tonic::codegen::StdError = e.into();
            link_error(tonic::Status::unknown(format!(
                "Service was not ready: {e}"
            )))
        })?;
        let path = http::uri::PathAndQuery::from_static(INGEST_PATH);
        let resp = ingest
            .unary(req, path, Encoded)
            .await
            .map_err(link_error)?
            .into_inner();
        Ok(Ingested {
            epoch: resp.epoch,
            seq: resp.seq,
            rejected: resp
                .rejected
                .into_iter()
                .map(|r| (r.index as usize, r.reason))
                .collect(),
        })
    }

    async fn record_signal(
        &self,
        signal: Signal,
        commit_within: std::time::Duration,
    ) -> Result<SessionSpans, LinkError> {
        let mut req = tonic::Request::new(link_pb::RecordSignalRequest {
            signal: Some(link::signal_to_pb(signal)),
            commit_within_ms: u32::try_from(commit_within.as_millis()).unwrap_or(u32::MAX),
        });
        crate::otel::link::inject(req.metadata_mut());
        let resp = self
            .client
            .clone()
            .record_signal(req)
            .await
            .map_err(signal_error)?
            .into_inner();
        Ok(link::spans_from_pb(&resp.session_spans))
    }
}
