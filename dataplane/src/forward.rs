//! Building the upstream request and sending it.
//!
//! The body goes out as the exact bytes received. Headers are copied except hop-by-hop headers
//! (RFC 9110 §7.6.1, including any named in `Connection`), `Host` (the client sets it from the
//! upstream URL), `Content-Length` (recomputed from the same bytes) and every `NM-*` header.
//! When the client brought no provider credential and the operator configured one, it is added
//! the provider's own way. `Accept-Encoding` becomes `identity`, so the answer's usage can be read
//! as it streams by.

use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri};
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::body::UpstreamBody;
use crate::error::ProxyError;
use crate::implicit::conversation::{Conversation, List, Part};
use crate::pace::{PaceLimits, Paced};
use crate::providers::{AuthStyle, Provider};
use crate::usage::{Scanner, Select, text};

/// Hop-by-hop headers, never forwarded in either direction.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
const X_GOOG_API_KEY: HeaderName = HeaderName::from_static("x-goog-api-key");

type UpstreamClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The pooled HTTPS/HTTP client for all upstreams (HTTP/2 where the upstream offers it by ALPN).
/// Each HTTP worker thread has a pool of its own ([`crate::workers`]), so a request and the
/// upstream connection it uses run on the same thread.
#[derive(Clone, Debug)]
pub struct Upstream {
    clients: std::sync::Arc<[UpstreamClient]>,
    header_timeout: Duration,
    /// Longest wait for the next frame of an answer's body ([`crate::pace`]).
    body_idle_timeout: Duration,
}

/// Default longest wait for the next frame of an upstream answer (Envoy's stream idle default:
/// long enough for a model that thinks before it streams).
pub const DEFAULT_UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

impl Upstream {
    /// `extra_roots` are trusted beside the public web PKI (private endpoints, test servers).
    /// `pools`: how many clients (each with its connection pool) to make, one per HTTP worker;
    /// a request uses its worker's ([`crate::workers::current`]).
    pub fn new(
        connect_timeout: Duration,
        header_timeout: Duration,
        extra_roots: &[rustls::pki_types::CertificateDer<'static>],
        pools: usize,
    ) -> Result<Self, rustls::Error> {
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        for cert in extra_roots {
            roots.add(cert.clone())?;
        }
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        // Each worker's client gets a connector of its own, not a clone: the client clones its
        // connector on every request, and clones of one connector share their `Arc`s' counts
        // across the workers' CPUs.
        let clients = (0..pools.max(1))
            .map(|_| {
                let mut http = HttpConnector::new();
                http.enforce_http(false);
                http.set_nodelay(true);
                http.set_connect_timeout(Some(connect_timeout));
                http.set_keepalive(Some(Duration::from_secs(60)));
                let https = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config(tls.clone())
                    .https_or_http()
                    .enable_all_versions()
                    .wrap_connector(http);
                Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(Duration::from_secs(90))
                    .pool_max_idle_per_host(256)
                    .build(https)
            })
            .collect();
        Ok(Self {
            clients,
            header_timeout,
            body_idle_timeout: DEFAULT_UPSTREAM_IDLE_TIMEOUT,
        })
    }

    /// Answers whose body gives no frame for `idle` are given up (see [`crate::pace`]).
    pub fn with_body_idle_timeout(mut self, idle: Duration) -> Self {
        self.body_idle_timeout = idle;
        self
    }

    /// Sends the request and waits for the response head (not the body, which is given up if
    /// it then stalls for the body idle timeout).
    pub async fn send(
        &self,
        req: Request<Full<Bytes>>,
    ) -> Result<Response<UpstreamBody>, ProxyError> {
        let client = &self.clients[crate::workers::current() % self.clients.len()];
        let pace = PaceLimits {
            idle: self.body_idle_timeout,
            min_rate: 0,
        };
        match tokio::time::timeout(self.header_timeout, client.request(req)).await {
            Err(_) => Err(ProxyError::UpstreamTimeout(self.header_timeout)),
            Ok(Ok(resp)) => Ok(resp.map(|body| Paced::new(body, pace, "the upstream's answer"))),
            Ok(Err(e)) if e.is_connect() => Err(ProxyError::UpstreamUnreachable(source_chain(&e))),
            Ok(Err(e)) => Err(ProxyError::UpstreamUnreachable(format!(
                "connection failed before the response head: {}",
                source_chain(&e)
            ))),
        }
    }
}

/// `e: cause: cause` — hyper's top-level messages alone say little ("client error (Connect)").
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// The upstream URL: provider base + native path + the original query, untouched.
pub fn upstream_uri(
    provider: &Provider,
    native_path: &str,
    query: Option<&str>,
) -> Result<Uri, ProxyError> {
    let mut pq = String::with_capacity(
        provider.base_path.len() + native_path.len() + query.map_or(0, |q| q.len() + 1),
    );
    pq.push_str(&provider.base_path);
    pq.push_str(native_path);
    if let Some(q) = query {
        pq.push('?');
        pq.push_str(q);
    }
    Uri::builder()
        .scheme(provider.scheme.clone())
        .authority(provider.authority.clone())
        .path_and_query(pq)
        .build()
        .map_err(|e| ProxyError::Internal(format!("cannot build upstream URL: {e}")))
}

/// Copies request headers for the upstream, dropping hop-by-hop, `Host`, `Content-Length` and
/// `NM-*`, and adds the operator's credential when the client sent none.
pub fn upstream_headers(
    incoming: &HeaderMap,
    provider: &Provider,
    query: Option<&str>,
) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(incoming.len());
    let connection_named = connection_tokens(incoming);
    for (name, value) in incoming {
        let n = name.as_str();
        if n.starts_with("nm-")
            || name == header::HOST
            || name == header::CONTENT_LENGTH
            || HOP_BY_HOP.contains(name)
            || connection_named.iter().any(|c| c.eq_ignore_ascii_case(n))
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    // Usage is read from the answer as it streams by, so ask for it uncompressed (the client
    // then gets identity too: no stale Content-Encoding or Content-Length can reach it).
    out.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    if let Some(key) = &provider.api_key
        && !has_credential(&out, query)
    {
        let (name, value) = match provider.auth {
            AuthStyle::Bearer => (
                header::AUTHORIZATION,
                HeaderValue::try_from(format!("Bearer {key}")),
            ),
            AuthStyle::XApiKey => (X_API_KEY, HeaderValue::try_from(key.as_str())),
            AuthStyle::GoogApiKey => (X_GOOG_API_KEY, HeaderValue::try_from(key.as_str())),
        };
        if let Ok(mut value) = value {
            value.set_sensitive(true);
            out.insert(name, value);
        }
    }
    out
}

/// Drops hop-by-hop headers from an upstream response; everything else goes back unchanged.
pub fn strip_response_headers(headers: &mut HeaderMap) {
    // Most answers have none: one pass over the names spares a hash look-up per name below.
    if !headers.keys().any(|n| HOP_BY_HOP.contains(n)) {
        return;
    }
    let named = connection_tokens(headers);
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
    for n in named {
        headers.remove(n.as_str());
    }
}

/// Header names listed in `Connection` (they are hop-by-hop too).
fn connection_tokens(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect()
}

/// The headers a client may carry its provider credential in, of every style (OpenAI's, Azure's
/// `api-key`, Anthropic's, Gemini's).
const CREDENTIAL_HEADERS: [HeaderName; 4] = [
    header::AUTHORIZATION,
    X_API_KEY,
    X_GOOG_API_KEY,
    HeaderName::from_static("api-key"),
];

/// Drops every client credential from a request's headers: for a request an experiment sends to
/// another provider than the one the client addressed, which gets the operator's credential for
/// it instead, never the client's for the first.
pub fn strip_credentials(headers: &mut HeaderMap) {
    for name in &CREDENTIAL_HEADERS {
        headers.remove(name);
    }
}

/// The query without its `key=` parameters (Gemini's credential in the URL), for the same
/// requests as [`strip_credentials`]; None when nothing remains.
pub fn query_without_key(query: Option<&str>) -> Option<String> {
    let kept: Vec<&str> = query?
        .split('&')
        .filter(|kv| !kv.starts_with("key=") && *kv != "key")
        .collect();
    (!kept.is_empty()).then(|| kept.join("&"))
}

/// Whether the client already carries a provider credential of any style.
fn has_credential(headers: &HeaderMap, query: Option<&str>) -> bool {
    headers.contains_key(header::AUTHORIZATION)
        || headers.contains_key(&X_API_KEY)
        || headers.contains_key(&X_GOOG_API_KEY)
        || query.is_some_and(|q| q.split('&').any(|kv| kv.starts_with("key=")))
}

/// What the gateway reads from a request body (never changing it): the model, and the cap on
/// the answer's length that budget reservations are estimated from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestFacts {
    /// The body's top-level `"model"`, else a Gemini-style `models/{model}:method` path segment.
    pub model: Option<String>,
    /// `max_tokens` (OpenAI chat, Anthropic), `max_completion_tokens` (OpenAI reasoning models),
    /// `max_output_tokens` (Responses API) or `generationConfig.maxOutputTokens` (Gemini).
    pub max_output_tokens: Option<u64>,
    /// Where the body's top-level `"model"` string's contents lie (between its quotes, escapes
    /// as written): what an experiment's arm rewrites ([`crate::experiment::rewrite_body`]).
    /// None when the body names no model as a string, or names one more than once (which of
    /// them the provider reads is its own affair: such a request is left alone).
    pub model_span: Option<std::ops::Range<usize>>,
}

/// What [`request_facts`] picks out of a request body: the model, or an output cap ranked by
/// preference (the first present wins), `0..CAPS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fact {
    Model,
    Cap(usize),
    /// A piece of the conversation, for the implicit rules.
    Turn(Part),
}

/// How many output-cap fields [`REQUEST`] ranks.
const CAPS: usize = 4;

const GENERATION_CONFIG: Select<Fact> =
    Select::keys(&[("maxOutputTokens", Select::capture(Fact::Cap(3)))]);
static REQUEST: Select<Fact> = Select::keys(&[
    ("model", Select::capture(Fact::Model)),
    ("max_completion_tokens", Select::capture(Fact::Cap(0))),
    ("max_tokens", Select::capture(Fact::Cap(1))),
    ("max_output_tokens", Select::capture(Fact::Cap(2))),
    ("generationConfig", GENERATION_CONFIG),
]);

const SYSTEM: Select<Fact> = Select::walk(Fact::Turn(Part::System));
/// [`REQUEST`] and the conversation: every wire format's list of turns and system prompt.
static REQUEST_CONVERSATION: Select<Fact> = Select::keys(&[
    ("model", Select::capture(Fact::Model)),
    ("max_completion_tokens", Select::capture(Fact::Cap(0))),
    ("max_tokens", Select::capture(Fact::Cap(1))),
    ("max_output_tokens", Select::capture(Fact::Cap(2))),
    ("generationConfig", GENERATION_CONFIG),
    // Each list is handed over in place and read by the conversation, in the same pass
    // ([`Conversation::read`]).
    (
        "messages",
        Select::walk(Fact::Turn(Part::Turns(List::Messages))),
    ),
    (
        "contents",
        Select::walk(Fact::Turn(Part::Turns(List::Contents))),
    ),
    ("input", Select::walk(Fact::Turn(Part::Turns(List::Input)))),
    ("system", SYSTEM),
    ("systemInstruction", SYSTEM),
    ("system_instruction", SYSTEM),
    ("instructions", SYSTEM),
]);

/// Reads [`RequestFacts`] in one pass over the body's top-level fields, with the scanner that
/// meters answers (values nobody asked for are crossed, not parsed). Only a body that opens as
/// a JSON object is read: an upload (multipart, audio) is neither scanned through nor mined for
/// JSON-like bytes. Values of an unexpected type are ignored (the provider will judge them),
/// never an error.
/// The model a path names (`.../models/<model>:generateContent`), as written (still
/// percent-encoded, if it was).
pub fn path_model(native_path: &str) -> Option<&str> {
    native_path.get(path_model_span(native_path)?)
}

/// Where [`path_model`]'s model lies in the path (what an experiment's arm rewrites).
pub fn path_model_span(native_path: &str) -> Option<std::ops::Range<usize>> {
    // A byte loop over the (short) path: `str::split("/models/")` set up a substring searcher
    // (~470 instructions a request), `split('/')` an iterator per segment (~570).
    const SEGMENT: &[u8] = b"/models/";
    let bytes = native_path.as_bytes();
    let mut from = 0;
    let start = loop {
        let slash = from + bytes.get(from..)?.iter().position(|&b| b == b'/')?;
        if bytes[slash..].starts_with(SEGMENT) {
            break slash + SEGMENT.len();
        }
        from = slash + 1;
    };
    let rest = &bytes[start..];
    let end = rest
        .iter()
        .position(|&b| b == b':' || b == b'/')
        .unwrap_or(rest.len());
    // Both ends sit next to ASCII bytes (or the path's ends): character boundaries.
    (end > 0).then_some(start..start + end)
}

pub fn request_facts(body: &Bytes, native_path: &str) -> RequestFacts {
    request_facts_with(body, native_path, None)
}

/// [`request_facts`], the same pass also handing the conversation's turns to `conversation`
/// (the implicit rules), when given, in place: the body is never copied.
pub fn request_facts_with(
    body: &Bytes,
    native_path: &str,
    conversation: Option<&mut Conversation<'_>>,
) -> RequestFacts {
    let mut model = None;
    let mut model_span = None;
    let mut models = 0u32;
    let mut caps = [None; CAPS];
    if body.trim_ascii_start().starts_with(b"{") {
        let mut sink = |fact, raw: &[u8]| match fact {
            Fact::Model => {
                models += 1;
                model = text(raw).map(std::borrow::Cow::into_owned);
                model_span = model.as_ref().and_then(|_| string_contents(body, raw));
            }
            Fact::Cap(rank) => {
                caps[rank] = std::str::from_utf8(raw)
                    .ok()
                    .and_then(|n| n.parse::<u64>().ok());
            }
            Fact::Turn(_) => {} // walked, never captured
        };
        match conversation {
            Some(c) => Scanner::new(&REQUEST_CONVERSATION).feed_walking(
                body,
                &mut sink,
                &mut |fact, rest| match fact {
                    Fact::Turn(part) => Some(c.read(part, rest)),
                    _ => None,
                },
            ),
            None => Scanner::new(&REQUEST).feed(body, &mut sink),
        }
    }
    let model_span = model_span.filter(|_| models == 1);
    let model = model.or_else(|| path_model(native_path).map(str::to_owned));
    RequestFacts {
        model,
        max_output_tokens: caps.into_iter().flatten().next(),
        model_span,
    }
}

/// Where the contents of the JSON string `raw` (a capture, quotes included) lie in `body`:
/// the scanner hands a whole body's captures over as slices of it, so the place is the slice's
/// offset. None for a capture that is not a slice of `body` or not a quoted string.
fn string_contents(body: &[u8], raw: &[u8]) -> Option<std::ops::Range<usize>> {
    let from = raw.as_ptr().addr().checked_sub(body.as_ptr().addr())?;
    let to = from.checked_add(raw.len())?;
    let quoted = raw.len() >= 2 && raw.first() == Some(&b'"') && raw.last() == Some(&b'"');
    (to <= body.len() && quoted).then_some(from + 1..to - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::{Registry, WireFormat, builtin};

    fn provider(name: &str, key: Option<&str>) -> Provider {
        let specs = builtin().into_iter().map(|(n, mut s)| {
            s.api_key = key.map(str::to_owned);
            (n.to_owned(), s)
        });
        let reg = Registry::build(specs).unwrap_or_default();
        reg.get(name)
            .map(|p| (**p).clone())
            .unwrap_or_else(|| Provider {
                name: name.into(),
                scheme: http::uri::Scheme::HTTP,
                authority: http::uri::Authority::from_static("x"),
                base_path: String::new(),
                auth: AuthStyle::Bearer,
                format: WireFormat::Openai,
                api_key: None,
                system: name.into(),
                trace_context: true,
                server_address: "x".into(),
                server_port: 80,
            })
    }

    #[test]
    fn builds_urls() {
        let p = provider("groq", None);
        let uri = upstream_uri(&p, "/openai/v1/chat/completions", Some("a=1&b=%20"))
            .map(|u| u.to_string());
        assert_eq!(
            uri.ok().as_deref(),
            Some("https://api.groq.com/openai/v1/chat/completions?a=1&b=%20")
        );
        let p = provider("openrouter", None);
        let uri = upstream_uri(&p, "/v1/chat/completions", None).map(|u| u.to_string());
        assert_eq!(
            uri.ok().as_deref(),
            Some("https://openrouter.ai/api/v1/chat/completions")
        );
    }

    #[test]
    fn strips_and_keeps_headers() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("authorization", "Bearer sk-client"),
            ("anthropic-version", "2023-06-01"),
            ("nm-key", "nmk_x"),
            ("nm-agent", "a"),
            ("host", "gateway.local"),
            ("connection", "keep-alive, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("content-length", "10"),
            ("accept-encoding", "gzip"),
        ] {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        let out = upstream_headers(&h, &provider("openai", Some("sk-operator")), None);
        let names: Vec<_> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            ["authorization", "anthropic-version", "accept-encoding"]
        );
        assert_eq!(out[header::ACCEPT_ENCODING], "identity");
        assert_eq!(out[header::AUTHORIZATION], "Bearer sk-client");
    }

    #[test]
    fn injects_operator_key_only_when_client_has_none() {
        let h = HeaderMap::new();
        let out = upstream_headers(&h, &provider("anthropic", Some("sk-ant")), None);
        assert_eq!(
            out.get("x-api-key").map(|v| v.as_bytes()),
            Some(&b"sk-ant"[..])
        );
        let out = upstream_headers(&h, &provider("gemini", Some("g-key")), None);
        assert_eq!(
            out.get("x-goog-api-key").map(|v| v.as_bytes()),
            Some(&b"g-key"[..])
        );
        let out = upstream_headers(
            &h,
            &provider("gemini", Some("g-key")),
            Some("alt=sse&key=client"),
        );
        assert!(out.get("x-goog-api-key").is_none());
        let out = upstream_headers(&h, &provider("openai", Some("sk-op")), None);
        assert_eq!(
            out.get("authorization").map(|v| v.as_bytes()),
            Some(&b"Bearer sk-op"[..])
        );
    }

    fn model_of(body: &Bytes, path: &str) -> Option<String> {
        request_facts(body, path).model
    }

    #[test]
    fn finds_output_caps() {
        let cap = |b: &'static str| {
            request_facts(&Bytes::from_static(b.as_bytes()), "/").max_output_tokens
        };
        assert_eq!(cap(r#"{"model":"m","max_tokens":100}"#), Some(100));
        assert_eq!(
            cap(r#"{"max_tokens":100,"max_completion_tokens":300}"#),
            Some(300)
        );
        assert_eq!(cap(r#"{"max_output_tokens":50}"#), Some(50));
        assert_eq!(
            cap(r#"{"generationConfig":{"temperature":1,"maxOutputTokens":64}}"#),
            Some(64)
        );
        assert_eq!(cap(r#"{"model":"m"}"#), None);
        assert_eq!(cap(r#"{"max_tokens":-1}"#), None);
        let odd = request_facts(
            &Bytes::from_static(br#"{"model":"m","max_tokens":"9"}"#),
            "/",
        );
        assert_eq!(
            (odd.model.as_deref(), odd.max_output_tokens),
            (Some("m"), None)
        );
    }

    #[test]
    fn reads_facts_only_from_a_json_object() {
        // A multipart upload (audio transcription) whose file happens to hold JSON-like bytes:
        // not a JSON body, so nothing in it is read, and the model comes from the path or not
        // at all.
        let multipart = Bytes::from_static(
            b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\n\
              {\"model\":\"inside-the-file\",\"max_tokens\":7}\r\n--b--\r\n",
        );
        let facts = request_facts(&multipart, "/v1/audio/transcriptions");
        assert_eq!((facts.model, facts.max_output_tokens), (None, None));
        let facts = request_facts(
            &multipart,
            "/v1beta/models/gemini-2.5-flash:generateContent",
        );
        assert_eq!(facts.model.as_deref(), Some("gemini-2.5-flash"));
        // Leading whitespace before the object is still JSON.
        let spaced = Bytes::from_static(b" \n\t{\"model\":\"m\",\"max_tokens\":3}");
        let facts = request_facts(&spaced, "/");
        assert_eq!(
            (facts.model.as_deref(), facts.max_output_tokens),
            (Some("m"), Some(3))
        );
    }

    #[test]
    fn a_path_names_its_model() {
        for (path, model) in [
            (
                "/v1beta/models/gemini-2.0-flash:generateContent",
                Some("gemini-2.0-flash"),
            ),
            ("/v1/models/gemini-pro", Some("gemini-pro")),
            ("/v1/models/m/extra", Some("m")),
            ("/v1/models/", None),
            ("/v1/models", None),
            ("/v1/chat/completions", None),
            ("/v1/tunedModels/x:generateContent", None),
            ("/v1/models/a%2Db:x", Some("a%2Db")),
        ] {
            assert_eq!(path_model(path), model, "{path}");
        }
    }

    #[test]
    fn finds_models() {
        assert_eq!(
            model_of(
                &Bytes::from_static(br#"{"messages":[],"model":"gpt-4o"}"#),
                "/v1/chat/completions"
            )
            .as_deref(),
            Some("gpt-4o")
        );
        assert_eq!(
            model_of(
                &Bytes::new(),
                "/v1beta/models/gemini-2.0-flash:streamGenerateContent"
            )
            .as_deref(),
            Some("gemini-2.0-flash")
        );
        assert_eq!(
            model_of(&Bytes::from_static(b"not json"), "/v1/chat/completions"),
            None
        );
        assert_eq!(
            model_of(&Bytes::from_static(br#"{"model":"a\"b"}"#), "/").as_deref(),
            Some("a\"b")
        );
    }
}
