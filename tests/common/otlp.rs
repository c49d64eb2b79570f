//! An in-process OTLP trace receiver on loopback, for asserting the spans the gateway exports:
//! OTLP/gRPC (`TraceService/Export`, tonic) and OTLP/HTTP protobuf (`POST /v1/traces`, hyper),
//! each on its own `127.0.0.1:0` port, both feeding one list of [`CollectedSpan`]s in arrival
//! order.
//!
//! `let otlp = OtlpReceiver::start().await;` then point an exporter at
//! [`OtlpReceiver::grpc_endpoint`] or [`OtlpReceiver::http_endpoint`] (a base URL, see there),
//! and wait with [`OtlpReceiver::wait_for`]. [`OtlpReceiver::set_hang`]
//! turns it into a collector that accepts connections and requests but never answers them (the
//! spans of a hung export are not kept: a dead collector stores nothing). Dropping the receiver
//! stops both servers and ends the hung requests.
//!
//! HTTP answers: 200 with an encoded `ExportTraceServiceResponse`; 404 for any other method or
//! path; 415 for a body that is not `application/x-protobuf` or is compressed (no gzip here: the
//! gRPC side accepts gzip, tonic decodes it); 400 for bytes that do not decode.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::status::StatusCode as ProtoStatusCode;
use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// A span as received, with ids in lower-case hex and attributes decoded.
#[derive(Debug, Clone)]
pub struct CollectedSpan {
    /// 32 lower-case hex digits.
    pub trace_id: String,
    /// 16 lower-case hex digits.
    pub span_id: String,
    /// `None` when the span is a root (empty on the wire).
    pub parent_span_id: Option<String>,
    pub name: String,
    pub kind: SpanKind,
    pub attributes: BTreeMap<String, AttrValue>,
    pub resource: BTreeMap<String, AttrValue>,
    /// The instrumentation scope's name.
    pub scope: String,
    pub status: Status,
    /// `(trace_id, span_id)` in hex.
    pub links: Vec<(String, String)>,
    /// Event names, in order.
    pub events: Vec<String>,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    pub transport: Transport,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Unspecified,
    Internal,
    Server,
    Client,
    Producer,
    Consumer,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    Unset,
    Ok,
    Error(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Grpc,
    Http,
}

/// An attribute value. A key-value list (rare in traces) arrives as `Str("{k=v, ..}")`.
#[derive(Debug, Clone, PartialEq)]
pub enum AttrValue {
    Str(String),
    Int(i64),
    Double(f64),
    Bool(bool),
    Array(Vec<AttrValue>),
    Bytes(Vec<u8>),
}

impl CollectedSpan {
    /// A string attribute.
    pub fn str(&self, key: &str) -> Option<&str> {
        match self.attributes.get(key) {
            Some(AttrValue::Str(s)) => Some(s),
            _ => None,
        }
    }

    /// An integer attribute.
    pub fn int(&self, key: &str) -> Option<i64> {
        match self.attributes.get(key) {
            Some(AttrValue::Int(i)) => Some(*i),
            _ => None,
        }
    }

    /// Whether the span has the attribute, of any type.
    pub fn has(&self, key: &str) -> bool {
        self.attributes.contains_key(key)
    }

    /// Every string anywhere in the span (attribute and resource values, arrays included, the
    /// name, the status message, event names), newline-separated: for "this secret never
    /// appears" checks.
    pub fn all_text(&self) -> String {
        fn push(out: &mut String, v: &AttrValue) {
            match v {
                AttrValue::Str(s) => {
                    out.push_str(s);
                    out.push('\n');
                }
                AttrValue::Array(items) => items.iter().for_each(|i| push(out, i)),
                AttrValue::Bytes(b) => {
                    out.push_str(&String::from_utf8_lossy(b));
                    out.push('\n');
                }
                AttrValue::Int(_) | AttrValue::Double(_) | AttrValue::Bool(_) => {}
            }
        }
        let mut out = format!("{}\n", self.name);
        for v in self.attributes.values().chain(self.resource.values()) {
            push(&mut out, v);
        }
        if let Status::Error(m) = &self.status {
            out.push_str(m);
            out.push('\n');
        }
        for e in &self.events {
            out.push_str(e);
            out.push('\n');
        }
        out
    }
}

// === impl OtlpReceiver ===

/// OTLP/gRPC and OTLP/HTTP trace receivers on loopback; `Drop` stops both.
#[derive(Debug)]
pub struct OtlpReceiver {
    grpc: SocketAddr,
    http: SocketAddr,
    /// Whether both servers speak TLS ([`OtlpReceiver::start_tls`]).
    tls: bool,
    state: Arc<State>,
    stop: watch::Sender<bool>,
}

#[derive(Debug)]
struct State {
    spans: Mutex<Vec<CollectedSpan>>,
    hang: AtomicBool,
    exports: AtomicUsize,
    stop: watch::Receiver<bool>,
}

impl OtlpReceiver {
    /// Starts both servers on `127.0.0.1:0`.
    pub async fn start() -> OtlpReceiver {
        Self::start_with(None).await
    }

    /// Both servers over TLS, with the server certificate of `pki` (for `localhost` and
    /// 127.0.0.1, issued by `pki.ca`); the endpoints are then `https://localhost:PORT`.
    pub async fn start_tls(pki: &super::pki::Pki) -> OtlpReceiver {
        let read = |p: &std::path::Path| std::fs::read(p).unwrap_or_else(|e| panic!("{e}"));
        let (cert, key) = (read(&pki.server_cert), read(&pki.server_key));
        let mut receiver = Self::start_with(Some((cert, key))).await;
        receiver.tls = true;
        receiver
    }

    async fn start_with(tls: Option<(Vec<u8>, Vec<u8>)>) -> OtlpReceiver {
        let (stop, stopped) = watch::channel(false);
        let state = Arc::new(State {
            spans: Mutex::default(),
            hang: AtomicBool::new(false),
            exports: AtomicUsize::new(0),
            stop: stopped,
        });
        let grpc_listener = bind().await;
        let grpc = local_addr(&grpc_listener);
        let service = TraceServiceServer::new(GrpcSink(state.clone()))
            .accept_compressed(tonic::codec::CompressionEncoding::Gzip);
        let mut until = state.stop.clone();
        let mut server = tonic::transport::Server::builder();
        if let Some((cert, key)) = &tls {
            let identity = tonic::transport::Identity::from_pem(cert, key);
            server = server
                .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
                .unwrap_or_else(|e| panic!("OTLP receiver TLS: {e}"));
        }
        tokio::spawn(server.add_service(service).serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(grpc_listener),
            async move {
                let _ = until.wait_for(|s| *s).await;
            },
        ));
        let http_listener = bind().await;
        let http = local_addr(&http_listener);
        let acceptor = tls.map(|(cert, key)| {
            use rustls::pki_types::pem::PemObject;
            let certs = rustls::pki_types::CertificateDer::pem_slice_iter(&cert)
                .collect::<Result<Vec<_>, _>>()
                .unwrap_or_else(|e| panic!("{e}"));
            let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(&key)
                .unwrap_or_else(|e| panic!("{e}"));
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .and_then(|b| b.with_no_client_auth().with_single_cert(certs, key))
                .unwrap_or_else(|e| panic!("{e}"));
            tokio_rustls::TlsAcceptor::from(Arc::new(config))
        });
        tokio::spawn(serve_http(http_listener, state.clone(), acceptor));
        OtlpReceiver {
            grpc,
            http,
            tls: false,
            state,
            stop,
        }
    }

    /// `http://127.0.0.1:PORT` of the OTLP/gRPC receiver.
    pub fn grpc_endpoint(&self) -> String {
        match self.tls {
            true => format!("https://localhost:{}", self.grpc.port()),
            false => format!("http://{}", self.grpc),
        }
    }

    /// `http://127.0.0.1:PORT` of the OTLP/HTTP receiver: a base. The SDK appends `/v1/traces`
    /// to `OTEL_EXPORTER_OTLP_ENDPOINT`, but uses a `with_endpoint(..)` URL as given: append
    /// `/v1/traces` yourself there.
    pub fn http_endpoint(&self) -> String {
        match self.tls {
            true => format!("https://localhost:{}", self.http.port()),
            false => format!("http://{}", self.http),
        }
    }

    /// Everything received so far, in arrival order.
    pub fn spans(&self) -> Vec<CollectedSpan> {
        self.state
            .spans
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// Polls every 20 ms until `pred(&spans)` holds and returns the spans then; after `timeout`
    /// panics naming `what` and listing every span received.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&[CollectedSpan]) -> bool,
    ) -> Vec<CollectedSpan> {
        let listing = || {
            let spans = self.spans();
            let lines: Vec<String> = spans
                .iter()
                .map(|s| {
                    format!(
                        "  {:?} {:?} trace={} span={} parent={} ({:?})",
                        s.name,
                        s.kind,
                        s.trace_id,
                        s.span_id,
                        s.parent_span_id.as_deref().unwrap_or("-"),
                        s.transport
                    )
                })
                .collect();
            format!(
                "{} span(s) in {} export(s):\n{}",
                spans.len(),
                self.exports(),
                lines.join("\n")
            )
        };
        super::eventually_with(timeout, what, listing, || {
            let spans = self.spans();
            let done = pred(&spans);
            async move { done.then_some(spans) }
        })
        .await
    }

    /// While on, both transports accept connections and requests but never answer; the spans
    /// of such exports are not kept. Requests already hung stay so until the receiver drops.
    pub fn set_hang(&self, on: bool) {
        self.state.hang.store(on, Ordering::SeqCst);
    }

    /// Export calls received (both transports, hung ones included).
    pub fn exports(&self) -> usize {
        self.state.exports.load(Ordering::SeqCst)
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn bind() -> TcpListener {
    TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("OTLP receiver bind: {e}"))
}

fn local_addr(l: &TcpListener) -> SocketAddr {
    l.local_addr()
        .unwrap_or_else(|e| panic!("OTLP receiver addr: {e}"))
}

impl State {
    /// Counts an export; if hanging, waits until the receiver stops and returns false.
    async fn admit(&self) -> bool {
        self.exports.fetch_add(1, Ordering::SeqCst);
        if !self.hang.load(Ordering::SeqCst) {
            return true;
        }
        let mut stop = self.stop.clone();
        let _ = stop.wait_for(|s| *s).await;
        false
    }

    fn collect(&self, req: ExportTraceServiceRequest, transport: Transport) {
        let spans = flatten(req, transport);
        if let Ok(mut all) = self.spans.lock() {
            all.extend(spans);
        }
    }
}

// === gRPC ===

#[derive(Debug)]
struct GrpcSink(Arc<State>);

#[tonic::async_trait]
impl TraceService for GrpcSink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        if !self.0.admit().await {
            return Err(tonic::Status::unavailable("receiver stopped"));
        }
        self.0.collect(request.into_inner(), Transport::Grpc);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

// === HTTP ===

async fn serve_http(
    listener: TcpListener,
    state: Arc<State>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let mut stop = state.stop.clone();
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
            _ = stop.wait_for(|s| *s) => return,
        };
        let state = state.clone();
        let mut stop = stop.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| handle_http(state.clone(), req));
            let builder = auto::Builder::new(TokioExecutor::new());
            // Dropping the connection on stop closes it.
            match tls {
                None => {
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = stop.wait_for(|s| *s) => {}
                    }
                }
                Some(acceptor) => {
                    let Ok(stream) = acceptor.accept(stream).await else {
                        return;
                    };
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = stop.wait_for(|s| *s) => {}
                    }
                }
            }
        });
    }
}

async fn handle_http(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.method() != Method::POST || req.uri().path() != "/v1/traces" {
        return Ok(plain(StatusCode::NOT_FOUND, "not found"));
    }
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_ascii_lowercase()
    };
    let protobuf = header("content-type")
        .split(';')
        .next()
        .is_some_and(|t| t.trim() == "application/x-protobuf");
    let encoding = header("content-encoding");
    if !protobuf || !(encoding.is_empty() || encoding == "identity") {
        return Ok(plain(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "only uncompressed application/x-protobuf",
        ));
    }
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(plain(StatusCode::BAD_REQUEST, "unreadable body")),
    };
    if !state.admit().await {
        return Ok(plain(StatusCode::SERVICE_UNAVAILABLE, "receiver stopped"));
    }
    let Ok(export) = ExportTraceServiceRequest::decode(body) else {
        return Ok(plain(
            StatusCode::BAD_REQUEST,
            "not an ExportTraceServiceRequest",
        ));
    };
    state.collect(export, Transport::Http);
    let mut resp = Response::new(Full::new(Bytes::from(
        ExportTraceServiceResponse::default().encode_to_vec(),
    )));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/x-protobuf"),
    );
    Ok(resp)
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *resp.status_mut() = status;
    resp
}

// === decoding ===

fn flatten(req: ExportTraceServiceRequest, transport: Transport) -> Vec<CollectedSpan> {
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let resource = rs
            .resource
            .map(|r| attributes(r.attributes))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            let scope = ss.scope.map(|s| s.name).unwrap_or_default();
            for span in ss.spans {
                let status = match span.status {
                    Some(s) if s.code == ProtoStatusCode::Error as i32 => Status::Error(s.message),
                    Some(s) if s.code == ProtoStatusCode::Ok as i32 => Status::Ok,
                    _ => Status::Unset,
                };
                out.push(CollectedSpan {
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: (!span.parent_span_id.is_empty())
                        .then(|| hex(&span.parent_span_id)),
                    name: span.name,
                    kind: match span.kind {
                        1 => SpanKind::Internal,
                        2 => SpanKind::Server,
                        3 => SpanKind::Client,
                        4 => SpanKind::Producer,
                        5 => SpanKind::Consumer,
                        _ => SpanKind::Unspecified,
                    },
                    attributes: attributes(span.attributes),
                    resource: resource.clone(),
                    scope: scope.clone(),
                    status,
                    links: span
                        .links
                        .iter()
                        .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                        .collect(),
                    events: span.events.into_iter().map(|e| e.name).collect(),
                    start_unix_nanos: span.start_time_unix_nano,
                    end_unix_nanos: span.end_time_unix_nano,
                    transport,
                });
            }
        }
    }
    out
}

fn attributes(kvs: Vec<KeyValue>) -> BTreeMap<String, AttrValue> {
    kvs.into_iter()
        .map(|kv| (kv.key, value(kv.value)))
        .collect()
}

fn value(v: Option<AnyValue>) -> AttrValue {
    use any_value::Value;
    match v.and_then(|v| v.value) {
        Some(Value::StringValue(s)) => AttrValue::Str(s),
        Some(Value::IntValue(i)) => AttrValue::Int(i),
        Some(Value::DoubleValue(d)) => AttrValue::Double(d),
        Some(Value::BoolValue(b)) => AttrValue::Bool(b),
        Some(Value::BytesValue(b)) => AttrValue::Bytes(b),
        Some(Value::ArrayValue(a)) => {
            AttrValue::Array(a.values.into_iter().map(|v| value(Some(v))).collect())
        }
        Some(Value::KvlistValue(l)) => AttrValue::Str(format!(
            "{{{}}}",
            l.values
                .into_iter()
                .map(|kv| format!("{}={:?}", kv.key, value(kv.value)))
                .collect::<Vec<_>>()
                .join(", ")
        )),
        // A reference into a profiles dictionary; never in traces.
        Some(Value::StringValueStrindex(i)) => AttrValue::Str(format!("#strindex {i}")),
        None => AttrValue::Str(String::new()),
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}
