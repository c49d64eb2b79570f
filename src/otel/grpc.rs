//! The `grpc` exporter: `TraceService/Export` calls over a tonic channel, their bodies the
//! encoded requests of [`super::otlp`] passed through as they are (a codec that copies bytes, not
//! a message type). The channel connects lazily and reconnects by itself; `https://` collectors
//! are checked against the public web PKI and `OTEL_EXPORTER_OTLP_CERTIFICATE`'s CAs.
//!
//! Failures are classified as the OTLP specification says (and as the OpenTelemetry exporter this
//! replaces did): `UNAVAILABLE` and a few transient codes are retried, `RESOURCE_EXHAUSTED` only
//! when the collector sends a `RetryInfo`, whose delay is honoured; the rest are final. The
//! collector's message is never put in an error (it may echo a credential).

use std::time::Duration;

use bytes::{BufMut as _, Bytes};
use http::uri::PathAndQuery;
use prost::Message as _;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, GrpcMethod, Status};

use super::settings::Export;
use super::wire::{BuildError, ExportResponse, SendError, USER_AGENT};

const SERVICE: &str = "opentelemetry.proto.collector.trace.v1.TraceService";
const PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";
/// The longest wait a collector's `RetryInfo` may ask for.
const MAX_RETRY_INFO_DELAY: Duration = Duration::from_secs(600);

/// A gRPC OTLP trace exporter.
#[derive(Debug, Clone)]
pub struct GrpcSender {
    client: tonic::client::Grpc<Channel>,
    metadata: MetadataMap,
}

impl GrpcSender {
    /// A sender to `export.endpoint` with `export.headers` as metadata; each call gives up after
    /// `export.timeout`. Must be called inside a Tokio runtime (the channel's).
    pub fn new(export: &Export) -> Result<Self, BuildError> {
        let mut metadata = MetadataMap::new();
        for (k, v) in &export.headers {
            let key = MetadataKey::from_bytes(k.as_bytes())
                .map_err(|_| BuildError::HeaderName(k.clone()))?;
            let value = MetadataValue::try_from(v.as_str())
                .map_err(|_| BuildError::HeaderValue(k.clone()))?;
            metadata.insert(key, value);
        }
        let mut endpoint = Endpoint::from_shared(export.endpoint.clone())
            .map_err(|e| BuildError::Endpoint(e.to_string()))?
            .user_agent(USER_AGENT)
            .map_err(|e| BuildError::Endpoint(e.to_string()))?;
        if export.endpoint.starts_with("https://") {
            let mut tls = ClientTlsConfig::new().with_webpki_roots();
            if let Some(pem) = &export.ca_pem {
                tls = tls.ca_certificate(Certificate::from_pem(pem));
            }
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| BuildError::Tls(e.to_string()))?;
        }
        let channel = endpoint.timeout(export.timeout).connect_lazy();
        Ok(Self {
            client: tonic::client::Grpc::new(channel),
            metadata,
        })
    }

    /// One `Export` call carrying `body`, an encoded `ExportTraceServiceRequest`.
    pub async fn send(&self, body: Bytes) -> Result<ExportResponse, SendError> {
        let mut client = self.client.clone();
        client
            .ready()
            .await
            .map_err(|e| SendError::Final(format!("the gRPC channel is not ready: {e}")))?;
        let mut request = tonic::Request::new(body);
        *request.metadata_mut() = self.metadata.clone();
        request
            .extensions_mut()
            .insert(GrpcMethod::new(SERVICE, "Export"));
        client
            .unary(request, PathAndQuery::from_static(PATH), Passthrough)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| classify(&status))
    }
}

/// What a failed call means for the batch.
fn classify(status: &Status) -> SendError {
    let code = status.code();
    // A status made by tonic itself (connect failure, DNS) says why in its source; one from the
    // collector only in its message, which stays out.
    let message = match std::error::Error::source(status) {
        Some(source) => format!("gRPC status {code:?}: {source}"),
        None => format!("gRPC status {code:?}"),
    };
    let delay = retry_delay(status.details()).map(|d| d.min(MAX_RETRY_INFO_DELAY));
    match code {
        Code::ResourceExhausted => match delay {
            Some(after) => SendError::Throttled { after, message },
            None => SendError::Final(message),
        },
        Code::Unavailable => match delay.filter(|d| !d.is_zero()) {
            Some(after) => SendError::Throttled { after, message },
            None => SendError::Retryable(message),
        },
        Code::Cancelled
        | Code::DeadlineExceeded
        | Code::Aborted
        | Code::OutOfRange
        | Code::DataLoss => SendError::Retryable(message),
        Code::Ok
        | Code::Unknown
        | Code::InvalidArgument
        | Code::NotFound
        | Code::AlreadyExists
        | Code::PermissionDenied
        | Code::FailedPrecondition
        | Code::Unimplemented
        | Code::Internal
        | Code::Unauthenticated => SendError::Final(message),
    }
}

/// `google.rpc.Status`, as carried in `grpc-status-details-bin`.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(message, repeated, tag = "3")]
    details: Vec<prost_types::Any>,
}

/// `google.rpc.RetryInfo`.
#[derive(Clone, PartialEq, prost::Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<prost_types::Duration>,
}

/// The delay of a `RetryInfo` among a status's details, when there is one.
fn retry_delay(details: &[u8]) -> Option<Duration> {
    if details.is_empty() {
        return None;
    }
    let status = RpcStatus::decode(details).ok()?;
    let info = status
        .details
        .iter()
        .find(|any| any.type_url == "type.googleapis.com/google.rpc.RetryInfo")?;
    let delay = RetryInfo::decode(info.value.as_slice()).ok()?.retry_delay?;
    Some(Duration::new(
        u64::try_from(delay.seconds).ok()?,
        u32::try_from(delay.nanos).ok()?,
    ))
}

/// The codec of pre-encoded request bytes and the decoded answer.
#[derive(Debug, Clone, Copy)]
struct Passthrough;

impl Codec for Passthrough {
    type Encode = Bytes;
    type Decode = ExportResponse;
    type Encoder = Passthrough;
    type Decoder = Passthrough;

    fn encoder(&mut self) -> Self::Encoder {
        Passthrough
    }

    fn decoder(&mut self) -> Self::Decoder {
        Passthrough
    }
}

impl Encoder for Passthrough {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for Passthrough {
    type Item = ExportResponse;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<ExportResponse>, Status> {
        ExportResponse::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(format!("undecodable answer: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_with_retry_info(code: Code, seconds: i64) -> Status {
        let info = RetryInfo {
            retry_delay: Some(prost_types::Duration { seconds, nanos: 0 }),
        };
        let details = RpcStatus {
            details: vec![prost_types::Any {
                type_url: "type.googleapis.com/google.rpc.RetryInfo".to_owned(),
                value: info.encode_to_vec(),
            }],
        };
        Status::with_details(code, "slow down", details.encode_to_vec().into())
    }

    #[test]
    fn failures_are_classified_as_the_otlp_specification_says() {
        assert!(matches!(
            classify(&Status::unavailable("down")),
            SendError::Retryable(_)
        ));
        assert!(matches!(
            classify(&Status::deadline_exceeded("slow")),
            SendError::Retryable(_)
        ));
        assert!(matches!(
            classify(&Status::resource_exhausted("full")),
            SendError::Final(_)
        ));
        assert!(matches!(
            classify(&Status::unauthenticated("who")),
            SendError::Final(_)
        ));
        match classify(&status_with_retry_info(Code::ResourceExhausted, 3)) {
            SendError::Throttled { after, .. } => assert_eq!(after, Duration::from_secs(3)),
            other => panic!("{other:?}"),
        }
        match classify(&status_with_retry_info(Code::Unavailable, 7200)) {
            SendError::Throttled { after, .. } => assert_eq!(after, MAX_RETRY_INFO_DELAY),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_collectors_message_stays_out_of_the_error() {
        let e = classify(&Status::permission_denied("token abc123 is not allowed"));
        assert!(!e.to_string().contains("abc123"), "{e}");
    }
}
