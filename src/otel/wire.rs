//! What both OTLP protocols' senders ([`super::grpc`], [`super::http`]) share with the retrying
//! transport above them ([`super::transport`]): the exports' `User-Agent`, the errors, and the
//! collector's answer.

use std::time::Duration;

/// The `User-Agent` of the exports.
pub const USER_AGENT: &str = concat!("nm-gateway/", env!("CARGO_PKG_VERSION"));

/// Why the exporter could not be built (the settings were checked at start; these are what only
/// the transports can tell).
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("the OTLP endpoint is not a valid URI: {0}")]
    Endpoint(String),
    #[error("OTLP header {0:?} is not a valid header or gRPC metadata name")]
    HeaderName(String),
    #[error("the value of OTLP header {0:?} is not a valid header or gRPC metadata value")]
    HeaderValue(String),
    #[error("OTLP TLS: {0}")]
    Tls(String),
}

/// Why an attempt failed, and whether another may succeed.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// A transient failure (no answer, the collector unavailable): worth retrying.
    #[error("{0}")]
    Retryable(String),
    /// The collector asked to be left alone for `after`.
    #[error("{message} (the collector asks to wait {after:?})")]
    Throttled { after: Duration, message: String },
    /// Retrying cannot help (refused, unauthenticated, malformed).
    #[error("{0}")]
    Final(String),
}

/// `ExportTraceServiceResponse`: whether the collector rejected some spans.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportResponse {
    #[prost(message, optional, tag = "1")]
    pub partial_success: Option<PartialSuccess>,
}

/// `ExportTracePartialSuccess`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PartialSuccess {
    #[prost(int64, tag = "1")]
    pub rejected_spans: i64,
    #[prost(string, tag = "2")]
    pub error_message: String,
}
