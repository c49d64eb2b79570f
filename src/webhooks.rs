//! The HTTP client that delivers alerts to webhooks: `nm_controlplane::alerts::Sender` over
//! hyper, HTTPS with the public web roots (or plain HTTP), HTTP/1.1, no redirects followed, a
//! 10 s limit for the whole exchange. The answer's body is read up to 64 KiB and dropped.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use nm_controlplane::alerts::{Post, Sender, Sent};

/// The whole exchange, connection included.
const TIMEOUT: Duration = Duration::from_secs(10);
/// The receiver's answer is read up to this much (then the connection is dropped).
const MAX_ANSWER_BYTES: usize = 64 * 1024;

type Https = hyper_rustls::HttpsConnector<HttpConnector>;

/// Delivers alerts over HTTP(S).
pub struct WebhookClient {
    client: Client<Https, Full<Bytes>>,
}

impl WebhookClient {
    pub fn new() -> anyhow::Result<Self> {
        let roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(TIMEOUT));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Self {
            client: Client::builder(TokioExecutor::new()).build(https),
        })
    }

    async fn send(&self, post: Post) -> Sent {
        let mut request = Request::post(post.url.as_str());
        for (name, value) in &post.headers {
            request = request.header(*name, value.as_str());
        }
        request = request.header(
            "user-agent",
            concat!("nm-gateway/", env!("CARGO_PKG_VERSION")),
        );
        let request = request
            .body(Full::new(Bytes::from(post.body)))
            .map_err(|e| format!("the webhook's URL cannot be used: {e}"))?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| format!("no answer: {e}"))?;
            let status = response.status().as_u16();
            // Read (a little of) the answer so the connection can be reused.
            let _ = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await;
            Ok(status)
        };
        tokio::time::timeout(TIMEOUT, exchange)
            .await
            .map_err(|_| format!("no answer within {} s", TIMEOUT.as_secs()))?
    }
}

impl Sender for WebhookClient {
    fn post(&self, post: Post) -> Pin<Box<dyn Future<Output = Sent> + Send + '_>> {
        Box::pin(self.send(post))
    }
}
