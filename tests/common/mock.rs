//! Mock LLM providers: real HTTP servers on loopback that answer with recorded provider payloads
//! (JSON or SSE), can hold a stream before its last chunk, trickle until the client goes away,
//! delay, fail mid-body or drop the connection, and record every request byte for byte.
//!
//! `MockProvider::json(body).start().await` / `MockProvider::sse(chunks).hold_last().start()`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc};

type Body = BoxBody<Bytes, std::io::Error>;

#[derive(Debug, Clone)]
enum Reply {
    Full {
        status: u16,
        headers: Vec<(String, String)>,
        body: Bytes,
    },
    Sse {
        headers: Vec<(String, String)>,
        chunks: Vec<Bytes>,
        hold_last: bool,
        fail_after: Option<usize>,
    },
    Trickle {
        chunk: Bytes,
        every: Duration,
    },
    Drop,
}

/// What the mock received.
#[derive(Debug, Clone)]
pub struct Received {
    pub version: http::Version,
    pub method: String,
    pub path_and_query: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Received {
    /// A request header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

#[derive(Debug, Clone)]
pub struct MockProvider {
    reply: Reply,
    delay: Option<Duration>,
}

impl MockProvider {
    /// Answers 200 with `body` as `application/json`.
    pub fn json(body: impl Into<Bytes>) -> Self {
        Self {
            reply: Reply::Full {
                status: 200,
                headers: vec![("content-type".into(), "application/json".into())],
                body: body.into(),
            },
            delay: None,
        }
    }

    /// Answers with an event stream, one frame per chunk.
    pub fn sse(chunks: Vec<Bytes>) -> Self {
        Self {
            reply: Reply::Sse {
                headers: vec![
                    ("content-type".into(), "text/event-stream".into()),
                    ("cache-control".into(), "no-cache".into()),
                ],
                chunks,
                hold_last: false,
                fail_after: None,
            },
            delay: None,
        }
    }

    /// Sends `chunk` every `every` until the client goes away (see [`RunningMock::cancelled`]).
    pub fn trickle(chunk: impl Into<Bytes>, every: Duration) -> Self {
        Self {
            reply: Reply::Trickle {
                chunk: chunk.into(),
                every,
            },
            delay: None,
        }
    }

    /// Closes the connection without answering.
    pub fn drop_connection() -> Self {
        Self {
            reply: Reply::Drop,
            delay: None,
        }
    }

    pub fn status(mut self, s: u16) -> Self {
        if let Reply::Full { status, .. } = &mut self.reply {
            *status = s;
        }
        self
    }

    pub fn header(mut self, k: &str, v: &str) -> Self {
        match &mut self.reply {
            Reply::Full { headers, .. } | Reply::Sse { headers, .. } => {
                headers.retain(|(name, _)| !name.eq_ignore_ascii_case(k));
                headers.push((k.to_owned(), v.to_owned()));
            }
            Reply::Trickle { .. } | Reply::Drop => {}
        }
        self
    }

    /// Streams: send every chunk but the last, then wait for [`RunningMock::release`].
    pub fn hold_last(mut self) -> Self {
        if let Reply::Sse { hold_last, .. } = &mut self.reply {
            *hold_last = true;
        }
        self
    }

    /// Streams: break the connection after `n` chunks.
    pub fn fail_after(mut self, n: usize) -> Self {
        if let Reply::Sse { fail_after, .. } = &mut self.reply {
            *fail_after = Some(n);
        }
        self
    }

    /// Waits this long before answering.
    pub fn delay(mut self, d: Duration) -> Self {
        self.delay = Some(d);
        self
    }

    pub async fn start(self) -> RunningMock {
        self.start_with(None).await
    }

    /// Serves HTTPS (ALPN h2 and http/1.1) with a certificate for `localhost` and 127.0.0.1
    /// issued by a fresh CA, whose PEM is in [`RunningMock::ca_pem`].
    pub async fn start_tls(self) -> RunningMock {
        let ca_key = rcgen::KeyPair::generate().unwrap_or_else(|e| panic!("{e}"));
        let mut ca_params =
            rcgen::CertificateParams::new(Vec::<String>::new()).unwrap_or_else(|e| panic!("{e}"));
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key)
            .unwrap_or_else(|e| panic!("{e}"));
        let leaf_key = rcgen::KeyPair::generate().unwrap_or_else(|e| panic!("{e}"));
        let leaf =
            rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .and_then(|p| p.signed_by(&leaf_key, &ca))
                .unwrap_or_else(|e| panic!("{e}"));
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into());
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .and_then(|b| {
                b.with_no_client_auth()
                    .with_single_cert(vec![leaf.der().clone()], key)
            })
            .unwrap_or_else(|e| panic!("{e}"));
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let mut mock = self
            .start_with(Some(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(
                config,
            ))))
            .await;
        mock.url = format!("https://localhost:{}", mock.addr.port());
        mock.ca_pem = Some(ca.pem());
        mock
    }

    async fn start_with(self, tls: Option<tokio_rustls::TlsAcceptor>) -> RunningMock {
        let listener = match TcpListener::bind("127.0.0.1:0").await {
            Ok(l) => l,
            Err(e) => panic!("mock bind: {e}"),
        };
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("mock addr: {e}"));
        let state = Arc::new(State {
            mock: self,
            received: Mutex::default(),
            release: Notify::new(),
            cancelled: Notify::new(),
            first_chunk_sent: Notify::new(),
        });
        let task_state = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = task_state.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| handle(state.clone(), req));
                    let builder = auto::Builder::new(TokioExecutor::new());
                    match tls {
                        None => {
                            let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                        }
                        Some(tls) => {
                            if let Ok(stream) = tls.accept(stream).await {
                                let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                            }
                        }
                    }
                });
            }
        });
        RunningMock {
            addr,
            url: format!("http://{addr}"),
            ca_pem: None,
            state,
            task,
        }
    }
}

#[derive(Debug)]
struct State {
    mock: MockProvider,
    received: Mutex<Vec<Received>>,
    release: Notify,
    cancelled: Notify,
    first_chunk_sent: Notify,
}

#[derive(Debug)]
pub struct RunningMock {
    pub addr: SocketAddr,
    pub url: String,
    /// The CA that issued the certificate of a TLS mock.
    pub ca_pem: Option<String>,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RunningMock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RunningMock {
    /// Every request received so far.
    pub fn received(&self) -> Vec<Received> {
        self.state
            .received
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    pub fn last(&self) -> Received {
        match self.received().pop() {
            Some(r) => r,
            None => panic!("the mock received no request"),
        }
    }

    /// Lets a held stream send its last chunk.
    pub fn release(&self) {
        self.state.release.notify_one();
    }

    /// Completes once a trickling stream found its client gone.
    pub async fn cancelled(&self) {
        self.state.cancelled.notified().await;
    }

    /// Completes once a stream's first chunk was handed to the connection.
    pub async fn first_chunk_sent(&self) {
        self.state.first_chunk_sent.notified().await;
    }
}

async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Body>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_default();
    if let Ok(mut r) = state.received.lock() {
        r.push(Received {
            version: parts.version,
            method: parts.method.to_string(),
            path_and_query,
            headers: parts.headers,
            body,
        });
    }
    if let Some(d) = state.mock.delay {
        tokio::time::sleep(d).await;
    }
    let mut builder = Response::builder();
    let body: Body = match &state.mock.reply {
        Reply::Drop => return Err(std::io::Error::other("mock drops the connection")),
        Reply::Full {
            status,
            headers,
            body,
        } => {
            builder = builder.status(StatusCode::from_u16(*status).unwrap_or(StatusCode::OK));
            for (k, v) in headers {
                builder = builder.header(k, v);
            }
            Full::new(body.clone())
                .map_err(|never: Infallible| match never {})
                .boxed()
        }
        Reply::Sse {
            headers,
            chunks,
            hold_last,
            fail_after,
        } => {
            for (k, v) in headers {
                builder = builder.header(k, v);
            }
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(1);
            let (chunks, hold_last, fail_after) = (chunks.clone(), *hold_last, *fail_after);
            let st = state.clone();
            tokio::spawn(async move {
                let n = chunks.len();
                for (i, chunk) in chunks.into_iter().enumerate() {
                    if fail_after == Some(i) {
                        let _ = tx
                            .send(Err(std::io::Error::other("mock breaks the stream")))
                            .await;
                        return;
                    }
                    if hold_last && i + 1 == n {
                        st.release.notified().await;
                    }
                    if tx.send(Ok(Frame::data(chunk))).await.is_err() {
                        return;
                    }
                    if i == 0 {
                        st.first_chunk_sent.notify_one();
                    }
                }
            });
            StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed()
        }
        Reply::Trickle { chunk, every } => {
            builder = builder.header("content-type", "text/event-stream");
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(1);
            let (chunk, every) = (chunk.clone(), *every);
            let st = state.clone();
            tokio::spawn(async move {
                loop {
                    if tx.send(Ok(Frame::data(chunk.clone()))).await.is_err() {
                        st.cancelled.notify_one();
                        return;
                    }
                    st.first_chunk_sent.notify_one();
                    tokio::time::sleep(every).await;
                }
            });
            StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed()
        }
    };
    builder.body(body).map_err(std::io::Error::other)
}
