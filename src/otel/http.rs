//! The HTTP client of the `http/protobuf` exporter: hyper with rustls, so an `https://`
//! collector works (the SDK's own hyper client speaks plain HTTP only), trusting the public web
//! PKI and the CA certificates of `OTEL_EXPORTER_OTLP_CERTIFICATE`. It runs on the export
//! thread's runtime ([`super::export`]).

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry_http::{HttpClient, HttpError};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// The largest collector answer read (an OTLP answer is a few bytes; an error page more).
const MAX_ANSWER_BYTES: usize = 1024 * 1024;

#[derive(Debug, Clone)]
pub struct OtlpHttpClient {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
}

impl OtlpHttpClient {
    /// A client trusting the web PKI and `ca_pem`'s certificates, giving up on a request after
    /// `timeout`.
    pub fn new(ca_pem: Option<&[u8]>, timeout: Duration) -> Result<Self, String> {
        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        if let Some(pem) = ca_pem {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| format!("OTLP CA certificate: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("OTLP CA certificate: {e}"))?;
            }
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(timeout));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Self {
            client: Client::builder(TokioExecutor::new()).build(https),
            timeout,
        })
    }
}

#[async_trait::async_trait]
impl HttpClient for OtlpHttpClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let request = Request::from_parts(parts, Full::new(body));
        let exchange = async {
            let response = self.client.request(request).await?;
            let (parts, body) = response.into_parts();
            let body = Limited::new(body, MAX_ANSWER_BYTES)
                .collect()
                .await?
                .to_bytes();
            Ok::<_, HttpError>(Response::from_parts(parts, body))
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| HttpError::from(format!("no answer within {:?}", self.timeout)))?
    }
}
