//! The `http/protobuf` exporter: `POST` of the encoded request ([`super::otlp`]) to the traces
//! URL, over hyper with rustls, so an `https://` collector works, trusting the public web PKI and
//! the CA certificates of `OTEL_EXPORTER_OTLP_CERTIFICATE`. It runs on the export thread's
//! runtime ([`super::export`]).
//!
//! Failures are classified as OTLP/HTTP says (and as the OpenTelemetry exporter this replaces
//! did): no answer, 502 and 504 are retried, 429 and 503 too, after the `Retry-After` seconds
//! when the collector sends them; any other status is final. The answer's body is never put in
//! an error (it may echo a credential).

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use prost::Message as _;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use super::settings::Export;
use super::wire::{BuildError, ExportResponse, SendError, USER_AGENT};

/// The largest collector answer read (an OTLP answer is a few bytes; an error page more).
const MAX_ANSWER_BYTES: usize = 1024 * 1024;
/// The longest wait a collector's `Retry-After` may ask for.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(600);
const PROTOBUF: HeaderValue = HeaderValue::from_static("application/x-protobuf");

#[derive(Debug, Clone)]
pub struct OtlpHttpClient {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    endpoint: Uri,
    /// The request's headers: content type, user agent, then `OTEL_EXPORTER_OTLP_HEADERS`.
    headers: HeaderMap,
    timeout: Duration,
}

impl OtlpHttpClient {
    /// A client posting to `export.endpoint` with `export.headers`, trusting the web PKI and
    /// `export.ca_pem`'s certificates, giving up on a request after `export.timeout`.
    pub fn new(export: &Export) -> Result<Self, BuildError> {
        let endpoint: Uri = export
            .endpoint
            .parse()
            .map_err(|e: http::uri::InvalidUri| BuildError::Endpoint(e.to_string()))?;
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, PROTOBUF);
        headers.insert(
            http::header::USER_AGENT,
            HeaderValue::from_static(USER_AGENT),
        );
        for (k, v) in &export.headers {
            let name =
                HeaderName::try_from(k.as_str()).map_err(|_| BuildError::HeaderName(k.clone()))?;
            let value = HeaderValue::try_from(v.as_str())
                .map_err(|_| BuildError::HeaderValue(k.clone()))?;
            headers.insert(name, value);
        }
        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        if let Some(pem) = &export.ca_pem {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert =
                    cert.map_err(|e| BuildError::Tls(format!("OTLP CA certificate: {e}")))?;
                roots
                    .add(cert)
                    .map_err(|e| BuildError::Tls(format!("OTLP CA certificate: {e}")))?;
            }
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| BuildError::Tls(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(export.timeout));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Self {
            client: Client::builder(TokioExecutor::new()).build(https),
            endpoint,
            headers,
            timeout: export.timeout,
        })
    }

    /// One `POST` of `body`, an encoded `ExportTraceServiceRequest`.
    pub async fn send(&self, body: Bytes) -> Result<ExportResponse, SendError> {
        let mut request = Request::new(Full::new(body));
        *request.method_mut() = http::Method::POST;
        *request.uri_mut() = self.endpoint.clone();
        *request.headers_mut() = self.headers.clone();
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| SendError::Retryable(format!("HTTP export failed: {e}")))?;
            let (parts, body) = response.into_parts();
            if !parts.status.is_success() {
                return Err(classify(parts.status, parts.headers.get(RETRY_AFTER)));
            }
            let body = Limited::new(body, MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| {
                    if e.downcast_ref::<LengthLimitError>().is_some() {
                        SendError::Final(format!(
                            "the collector's answer is over {MAX_ANSWER_BYTES} bytes"
                        ))
                    } else {
                        SendError::Retryable(format!("HTTP export failed: {e}"))
                    }
                })?
                .to_bytes();
            // An answer that does not decode is no failure: the spans were accepted.
            Ok(ExportResponse::decode(body).unwrap_or_default())
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| SendError::Retryable(format!("no answer within {:?}", self.timeout)))?
    }
}

/// What a collector's refusal means for the batch.
fn classify(status: StatusCode, retry_after: Option<&HeaderValue>) -> SendError {
    let message = format!("HTTP export failed with status code: {}", status.as_u16());
    match status.as_u16() {
        429 | 503 => match retry_after
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            Some(secs) => SendError::Throttled {
                after: Duration::from_secs(secs).min(MAX_RETRY_AFTER),
                message,
            },
            None => SendError::Retryable(message),
        },
        502 | 504 => SendError::Retryable(message),
        _ => SendError::Final(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_classified_as_otlp_http_says() {
        let secs = HeaderValue::from_static("12");
        let date = HeaderValue::from_static("Fri, 31 Dec 1999 23:59:59 GMT");
        let huge = HeaderValue::from_static("86400");
        for (status, retry_after, expected) in [
            (429, Some(&secs), Some(Some(12))),
            (503, Some(&secs), Some(Some(12))),
            (503, Some(&huge), Some(Some(600))),
            (429, Some(&date), Some(None)),
            (503, None, Some(None)),
            (502, None, Some(None)),
            (504, None, Some(None)),
            (400, None, None),
            (401, Some(&secs), None),
            (500, None, None),
        ] {
            let got = classify(StatusCode::from_u16(status).unwrap(), retry_after);
            let got = match got {
                SendError::Throttled { after, .. } => Some(Some(after.as_secs())),
                SendError::Retryable(_) => Some(None),
                SendError::Final(_) => None,
            };
            assert_eq!(got, expected, "{status} {retry_after:?}");
        }
    }
}
