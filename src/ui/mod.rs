//! The web page: server-rendered HTML on its own listener (`NM_UI_ADDR`), for the people who
//! choose models. It is one more client of the admin gRPC services: every figure comes from a
//! call to the same service implementations the gRPC server runs ([`Services`]), in process,
//! with the signed-in key in `nm-key` metadata, so the page's numbers are the gRPC answers and
//! a viewer can do on the page exactly what a viewer can do over gRPC.
//!
//! - [`bind`]: the listener; a taken *default* address is one WARN and no page, an address the
//!   operator gave that cannot be bound stops the start (exit 64).
//! - Sign-in ([`session`]): POST an admin or viewer key, get a session cookie (random id,
//!   HttpOnly, SameSite=Strict, Max-Age; the key stays server-side). Sign-in and sign-out
//!   check `Origin`; sign-out also a per-session token. Service keys are refused.
//! - Pages ([`pages`]): `/agents`, `/agents/<agent>`, `/experiments`, `/usage`; read-only: the
//!   only POSTs are sign-in and sign-out. Charts are SVG drawn here ([`chart`]).
//! - Every answer carries a strict Content-Security-Policy (no script at all, styles and images
//!   from this origin), `X-Content-Type-Options`, `Referrer-Policy: same-origin` (not
//!   `no-referrer`: under it Chromium sends `Origin: null` on the page's own forms, which the
//!   Origin check must refuse) and `Cache-Control: no-store`. Assets (stylesheet, favicon) are embedded in the binary.
//! - Request bodies are capped ([`MAX_FORM_BYTES`]), headers by hyper's buffer; errors are a
//!   short page, never internal text.

pub mod chart;
pub mod html;
mod pages;
pub mod session;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use nm_controlplane::Controlplane;
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use crate::cli::UsageError;
use crate::config::UiSettings;
use crate::grpc::analytics::AnalyticsService;
use crate::grpc::experiments::ExperimentsService;
use crate::grpc::server::{AgentsService, BudgetsService, UsageService};

use self::html::{Nav, escape, page};
use self::session::Sessions;

/// Largest request body read (the sign-in form).
pub const MAX_FORM_BYTES: usize = 8 * 1024;
/// The session cookie's name.
pub const COOKIE: &str = "nm_ui_session";

const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
                   frame-ancestors 'none'; base-uri 'none'";
const STYLE: &str = include_str!("assets/style.css");
const FAVICON: &str = include_str!("assets/favicon.svg");

/// The admin services the page calls: the very structs the gRPC server serves.
#[derive(Debug, Clone)]
pub struct Services {
    pub agents: AgentsService,
    pub analytics: AnalyticsService,
    pub usage: UsageService,
    pub budgets: BudgetsService,
    pub experiments: ExperimentsService,
}

impl Services {
    pub fn new(cp: &Controlplane, providers: Arc<nm_controlplane::experiments::Catalogue>) -> Self {
        Self {
            agents: AgentsService(cp.clone()),
            analytics: AnalyticsService {
                analytics: nm_controlplane::analytics::Analytics::new(cp.store.clone())
                    .with_alerts(cp.alerts.clone()),
                cp: cp.clone(),
            },
            usage: UsageService(cp.clone()),
            budgets: BudgetsService(cp.clone()),
            experiments: ExperimentsService {
                cp: cp.clone(),
                providers,
            },
        }
    }
}

/// The page's state.
#[derive(Debug)]
pub struct Ui {
    services: Services,
    sessions: Sessions,
    trace_url: Option<String>,
}

impl Ui {
    pub fn new(services: Services, settings: &UiSettings) -> Self {
        Self {
            services,
            sessions: Sessions::default(),
            trace_url: settings.trace_url.clone(),
        }
    }
}

/// Binds the page's listener per `NM_UI_ADDR`: `None` when off, or when the default address is
/// taken (after one WARN line); an error (exit 64) when a given address cannot be bound.
pub async fn bind(settings: &UiSettings) -> anyhow::Result<Option<TcpListener>> {
    let Some(addr) = settings.addr else {
        return Ok(None);
    };
    match TcpListener::bind(addr).await {
        Ok(l) => Ok(Some(l)),
        Err(e) if !settings.explicit => {
            warn!(
                %addr,
                error = %e,
                "the web page's default address {addr} is taken (another gateway on this machine?): running without the page; set NM_UI_ADDR to another address or to off"
            );
            Ok(None)
        }
        Err(e) => Err(anyhow::Error::new(UsageError(format!(
            "NM_UI_ADDR: cannot listen on {addr}: {e}; give a free address or off"
        )))),
    }
}

/// Serves the page on `listener` until `shutdown` completes (connections in flight are told to
/// finish).
pub async fn serve(
    ui: Arc<Ui>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let addr = listener.local_addr().ok();
    info!(
        ?addr,
        "web page listening on {}",
        addr.map(|a| a.to_string()).unwrap_or_default()
    );
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    debug!(error = %e, "web page accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let ui = ui.clone();
        let service = hyper::service::service_fn(move |req| {
            let ui = ui.clone();
            async move { Ok::<_, Infallible>(handle(&ui, req, peer).await) }
        });
        let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .max_buf_size(64 * 1024)
            .header_read_timeout(Duration::from_secs(10))
            .timer(hyper_util::rt::TokioTimer::new());
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                debug!(error = %e, "web page connection ended");
            }
        });
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), graceful.shutdown()).await;
    info!("web page stopped");
}

/// An answer's body.
pub type Body = Full<Bytes>;

async fn handle(ui: &Ui, req: Request<Incoming>, _peer: SocketAddr) -> Response<Body> {
    let started = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let mut res = route(ui, req).await;
    secure(&mut res);
    debug!(%method, %path, status = res.status().as_u16(), ms = started.elapsed().as_millis() as u64, "web page request");
    res
}

/// The headers every answer carries.
fn secure(res: &mut Response<Body>) {
    let h = res.headers_mut();
    h.insert("content-security-policy", HeaderValue::from_static(CSP));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert("referrer-policy", HeaderValue::from_static("same-origin"));
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    h.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
}

async fn route(ui: &Ui, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    match (req.method(), path.as_str()) {
        (&Method::GET | &Method::HEAD, "/style.css") => asset("text/css; charset=utf-8", STYLE),
        (&Method::GET | &Method::HEAD, "/favicon.svg" | "/favicon.ico") => {
            asset("image/svg+xml", FAVICON)
        }
        (&Method::GET | &Method::HEAD, "/") => redirect("/agents", None),
        (&Method::GET | &Method::HEAD, "/sign-in") => sign_in_page(StatusCode::OK, &query),
        (&Method::POST, "/sign-in") => sign_in(ui, req).await,
        (&Method::POST, "/sign-out") => sign_out(ui, req).await,
        (&Method::GET | &Method::HEAD, p)
            if p == "/agents"
                || p.starts_with("/agents/")
                || p == "/experiments"
                || p == "/usage" =>
        {
            let Some((sid, s)) = session_of(ui, &req) else {
                let why = if cookie(&req).is_some() {
                    "?expired=1"
                } else {
                    ""
                };
                return redirect(&format!("/sign-in{why}"), None);
            };
            let signed = html::SignedIn {
                key_id: &s.key_id,
                role: &s.role,
                csrf: &s.csrf,
            };
            let answer = pages::render(ui, &s.secret, p, &query).await;
            match answer {
                Ok((title, nav, body)) => {
                    html_response(StatusCode::OK, &page(&title, nav, Some(&signed), &body))
                }
                Err(pages::PageError::SignedOut) => {
                    ui.sessions.end(&sid);
                    redirect("/sign-in?expired=1", Some(clear_cookie()))
                }
                Err(pages::PageError::Status(status, text)) => html_response(
                    status,
                    &page(
                        status.canonical_reason().unwrap_or("Error"),
                        Nav::None,
                        Some(&signed),
                        &format!(
                            "<p>{}</p><p><a href=\"/agents\">Back to the agents</a></p>",
                            escape(&text)
                        ),
                    ),
                ),
            }
        }
        (
            _,
            "/sign-in" | "/sign-out" | "/agents" | "/experiments" | "/usage" | "/style.css"
            | "/favicon.svg",
        ) => {
            let mut res = error_page(
                StatusCode::METHOD_NOT_ALLOWED,
                "This page only reads: that method is not allowed.",
            );
            let allow = if path == "/sign-in" {
                "GET, POST"
            } else if path == "/sign-out" {
                "POST"
            } else {
                "GET"
            };
            res.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(allow));
            res
        }
        _ => error_page(StatusCode::NOT_FOUND, "No such page."),
    }
}

fn asset(content_type: &'static str, body: &'static str) -> Response<Body> {
    let mut res = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    res.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    res.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=3600"),
    );
    res
}

fn html_response(status: StatusCode, body: &str) -> Response<Body> {
    let mut res = Response::new(Full::new(Bytes::from(body.to_owned())));
    *res.status_mut() = status;
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    res
}

fn error_page(status: StatusCode, text: &str) -> Response<Body> {
    html_response(
        status,
        &page(
            status.canonical_reason().unwrap_or("Error"),
            Nav::None,
            None,
            &format!(
                "<p>{}</p><p><a href=\"/agents\">To the agents</a></p>",
                escape(text)
            ),
        ),
    )
}

fn redirect(to: &str, cookie: Option<HeaderValue>) -> Response<Body> {
    let mut res = Response::new(Full::new(Bytes::new()));
    *res.status_mut() = StatusCode::SEE_OTHER;
    if let Ok(v) = HeaderValue::from_str(to) {
        res.headers_mut().insert(header::LOCATION, v);
    }
    if let Some(c) = cookie {
        res.headers_mut().insert(header::SET_COOKIE, c);
    }
    res
}

fn clear_cookie() -> HeaderValue {
    HeaderValue::from_static("nm_ui_session=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0")
}

/// The session cookie's value, if the request has one.
fn cookie<B>(req: &Request<B>) -> Option<String> {
    req.headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_owned())
        .filter(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn session_of<B>(ui: &Ui, req: &Request<B>) -> Option<(String, session::Session)> {
    let id = cookie(req)?;
    let s = ui.sessions.get(&id, Instant::now())?;
    Some((id, s))
}

/// A state-changing form comes from this page: its `Origin` (which browsers send on every
/// POST) names the host the request was sent to. A request without `Origin` is refused.
fn same_origin<B>(req: &Request<B>) -> bool {
    let Some(origin) = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some(host) = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
        .is_some_and(|o| o.eq_ignore_ascii_case(host))
}

/// Reads an `application/x-www-form-urlencoded` body of at most [`MAX_FORM_BYTES`].
async fn form(req: Request<Incoming>) -> Result<Vec<(String, String)>, Response<Body>> {
    let is_form = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    if !is_form {
        return Err(error_page(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Send the form as application/x-www-form-urlencoded.",
        ));
    }
    let body = match tokio::time::timeout(
        Duration::from_secs(10),
        Limited::new(req.into_body(), MAX_FORM_BYTES).collect(),
    )
    .await
    {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(_)) => {
            return Err(error_page(
                StatusCode::PAYLOAD_TOO_LARGE,
                "The form is too large.",
            ));
        }
        Err(_) => {
            return Err(error_page(
                StatusCode::REQUEST_TIMEOUT,
                "The form did not arrive in time.",
            ));
        }
    };
    Ok(parse_form(&body))
}

/// `a=1&b=x+y` into pairs, percent-decoded (invalid UTF-8 replaced).
pub fn parse_form(body: &[u8]) -> Vec<(String, String)> {
    let decode = |s: &[u8]| {
        let plus: Vec<u8> = s
            .iter()
            .map(|&b| if b == b'+' { b' ' } else { b })
            .collect();
        percent_encoding::percent_decode(&plus)
            .decode_utf8_lossy()
            .into_owned()
    };
    body.split(|&b| b == b'&')
        .filter(|p| !p.is_empty())
        .take(16)
        .map(|p| {
            let mut kv = p.splitn(2, |&b| b == b'=');
            let k = decode(kv.next().unwrap_or_default());
            let v = decode(kv.next().unwrap_or_default());
            (k, v)
        })
        .collect()
}

fn sign_in_page(status: StatusCode, query: &str) -> Response<Body> {
    let note = if query.split('&').any(|p| p == "expired=1") {
        "<p class=\"notice\" role=\"status\">Your session has ended. Sign in again.</p>"
    } else {
        ""
    };
    sign_in_form(status, note)
}

fn sign_in_form(status: StatusCode, note: &str) -> Response<Body> {
    let body = format!(
        "{note}<p>Sign in with an admin or viewer key (<code>nm-gateway keys create --role viewer</code>). \
         The page only reads; it changes nothing.</p>\
         <form method=\"post\" action=\"/sign-in\" class=\"signin\">\
         <label for=\"key\">Key</label> \
         <input id=\"key\" name=\"key\" type=\"password\" autocomplete=\"current-password\" required maxlength=\"200\"> \
         <button type=\"submit\">Sign in</button></form>"
    );
    html_response(status, &page("Sign in", Nav::None, None, &body))
}

async fn sign_in(ui: &Ui, req: Request<Incoming>) -> Response<Body> {
    if !same_origin(&req) {
        return error_page(
            StatusCode::FORBIDDEN,
            "The sign-in must come from this page's own form.",
        );
    }
    // Behind a TLS-terminating proxy (the page itself speaks plain HTTP), the cookie is Secure.
    let tls = req
        .headers()
        .get("x-forwarded-proto")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    let fields = match form(req).await {
        Ok(f) => f,
        Err(res) => return res,
    };
    let key = fields
        .iter()
        .find(|(k, _)| k == "key")
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_default();
    let refused = |text: &str| {
        sign_in_form(
            StatusCode::UNAUTHORIZED,
            &format!("<p class=\"error\" role=\"alert\">{}</p>", escape(text)),
        )
    };
    if key.is_empty() || key.len() > 200 {
        return refused("Give a key.");
    }
    let keys = &ui.services.agents.0.keys;
    let Some(info) = keys.authenticate(&key) else {
        return refused("This key is unknown or revoked.");
    };
    if info.is_expired(nm_controlplane::now_ms()) {
        return refused("This key has expired.");
    }
    if !info.role.may_read_admin() {
        return refused("A service key cannot sign in: use an admin or viewer key.");
    }
    let id = ui
        .sessions
        .start(key, info.id.clone(), info.role.to_string(), Instant::now());
    info!(key.id = %info.id, role = %info.role, "web page sign-in");
    let cookie = format!(
        "{COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{}",
        session::TTL.as_secs(),
        if tls { "; Secure" } else { "" }
    );
    redirect("/agents", HeaderValue::from_str(&cookie).ok())
}

async fn sign_out(ui: &Ui, req: Request<Incoming>) -> Response<Body> {
    if !same_origin(&req) {
        return error_page(
            StatusCode::FORBIDDEN,
            "The sign-out must come from this page's own form.",
        );
    }
    let session = session_of(ui, &req);
    let fields = match form(req).await {
        Ok(f) => f,
        Err(res) => return res,
    };
    if let Some((id, s)) = session {
        let token = fields
            .iter()
            .find(|(k, _)| k == "csrf")
            .map(|(_, v)| v.as_str());
        if token != Some(s.csrf.as_str()) {
            return error_page(
                StatusCode::FORBIDDEN,
                "The sign-out form is stale: reload the page.",
            );
        }
        ui.sessions.end(&id);
    }
    redirect("/sign-in", Some(clear_cookie()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_decode_and_are_bounded() {
        assert_eq!(
            parse_form(b"key=nmk_a%2Bb+c&x="),
            vec![
                ("key".into(), "nmk_a+b c".into()),
                ("x".into(), String::new())
            ]
        );
        assert_eq!(parse_form(&b"a=1&".repeat(100)).len(), 16);
        assert_eq!(
            parse_form(b"k=%ff").first().map(|p| p.1.as_str()),
            Some("\u{fffd}")
        );
    }

    #[test]
    fn only_a_well_formed_session_cookie_is_read() {
        let id = "a".repeat(64);
        let req = Request::builder()
            .header(header::COOKIE, format!("x=1; {COOKIE}={id}"))
            .body(())
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cookie(&req), Some(id));
        let req = Request::builder()
            .header(header::COOKIE, format!("{COOKIE}=../../etc"))
            .body(())
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cookie(&req), None);
    }

    #[test]
    fn origin_must_name_the_host() {
        let req = |origin: Option<&str>| {
            let mut b = Request::builder().header(header::HOST, "127.0.0.1:8090");
            if let Some(o) = origin {
                b = b.header(header::ORIGIN, o);
            }
            b.body(()).unwrap_or_else(|e| panic!("{e}"))
        };
        assert!(same_origin(&req(Some("http://127.0.0.1:8090"))));
        assert!(!same_origin(&req(Some("http://evil.example"))));
        assert!(!same_origin(&req(Some("null"))));
        assert!(!same_origin(&req(None)));
    }
}
