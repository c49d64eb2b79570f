//! The dataplane's error type and the one place that turns it into an HTTP response.
//!
//! Every error the gateway itself makes is classified by side (client 4xx, upstream 502/504,
//! ours 500), carries a contract code (sent as `NM-Error`), and is rendered in the shape the
//! caller's SDK understands: the provider's native error body on proxy routes, the
//! `{"ok": false, "error": {...}}` envelope on `/v1/...` routes.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::json;

use crate::body::GatewayBody;
use crate::providers::WireFormat;

/// Header naming the gateway's error code on every gateway-made error.
pub const NM_ERROR: &str = "nm-error";
/// `Retry-After` on 503 answers: the controlplane reconnects within about a second.
const RETRY_AFTER_SECS: &str = "1";

/// Everything that can go wrong while handling a request.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("missing NM-Key header: every request needs a service API key")]
    MissingApiKey,
    #[error("invalid NM-Key: the key is unknown or revoked")]
    InvalidApiKey,
    /// The key (or a rotated-out secret past its grace period) has expired.
    #[error("expired NM-Key: this key has expired; ask for a new key or a rotation")]
    ExpiredApiKey,
    /// The key may not make this request: its role, or the provider, model, agent or env
    /// outside its scope (the message names which).
    #[error("this key may not make this request: {0}")]
    KeyScope(String),
    #[error("invalid {header} header: {reason}")]
    InvalidHeader {
        header: &'static str,
        reason: String,
    },
    #[error("invalid path: {0}")]
    InvalidPath(#[from] crate::path::PathError),
    #[error("unknown provider {0:?}")]
    UnknownProvider(String),
    #[error("no route for {method} {path}")]
    NotFound { method: http::Method, path: String },
    #[error("method {0} is not allowed on this route")]
    MethodNotAllowed(http::Method),
    #[error("request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("could not read the request body: {0}")]
    RequestBody(String),
    /// The client stopped sending its request body (or sent it too slowly).
    #[error("{0}")]
    ClientTimeout(String),
    #[error("{message}")]
    InvalidSignal { code: &'static str, message: String },
    /// A signal's `request_id` names a request known under another session than its
    /// `session_id`.
    #[error("{0}")]
    SessionMismatch(String),
    #[error("unsupported media type: send Content-Type: application/json")]
    UnsupportedMediaType,
    #[error("temporarily unavailable, nothing was stored; retry later: {0}")]
    Unavailable(String),
    /// A signal whose commit the controlplane did not confirm in time.
    #[error(
        "temporarily unavailable: {0}; the signal may have been stored, so retry with the same \
         Idempotency-Key to have it counted once"
    )]
    Unconfirmed(String),
    #[error("budget exceeded: {reason}")]
    BudgetExceeded {
        reason: String,
        retry_after: Duration,
    },
    #[error("rate limited: {reason}")]
    RateLimited {
        reason: String,
        retry_after: Duration,
    },
    #[error("upstream unreachable: {0}")]
    UpstreamUnreachable(String),
    #[error("upstream did not answer within {0:?}")]
    UpstreamTimeout(Duration),
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<nm_types::access::ScopeRefusal> for ProxyError {
    fn from(r: nm_types::access::ScopeRefusal) -> Self {
        ProxyError::KeyScope(r.message)
    }
}

/// Which side caused an error: decides the log level and the status class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Upstream,
    Gateway,
}

/// How to render an error body for a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorFlavor {
    /// A provider route: the provider's native shape.
    Provider(WireFormat),
    /// A gateway API route (`/v1/...`, `/health`): `{"ok": false, "error": {...}}`.
    Gateway,
}

impl ProxyError {
    /// Status, contract code and side. Exhaustive on purpose: a new variant must be classified.
    pub fn classify(&self) -> (StatusCode, &'static str, Side) {
        use ProxyError::*;
        match self {
            MissingApiKey => (StatusCode::UNAUTHORIZED, "missing_api_key", Side::Client),
            InvalidApiKey => (StatusCode::UNAUTHORIZED, "invalid_api_key", Side::Client),
            ExpiredApiKey => (StatusCode::UNAUTHORIZED, "expired_api_key", Side::Client),
            KeyScope(_) => (StatusCode::FORBIDDEN, "key_scope", Side::Client),
            InvalidHeader { .. } => (StatusCode::BAD_REQUEST, "invalid_header", Side::Client),
            InvalidPath(_) => (StatusCode::BAD_REQUEST, "invalid_path", Side::Client),
            UnknownProvider(_) => (StatusCode::NOT_FOUND, "unknown_provider", Side::Client),
            NotFound { .. } => (StatusCode::NOT_FOUND, "not_found", Side::Client),
            MethodNotAllowed(_) => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                Side::Client,
            ),
            PayloadTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                Side::Client,
            ),
            RequestBody(_) => (StatusCode::BAD_REQUEST, "invalid_body", Side::Client),
            ClientTimeout(_) => (StatusCode::REQUEST_TIMEOUT, "request_timeout", Side::Client),
            InvalidSignal { code, .. } => (StatusCode::BAD_REQUEST, code, Side::Client),
            SessionMismatch(_) => (StatusCode::CONFLICT, "session_mismatch", Side::Client),
            UnsupportedMediaType => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                Side::Client,
            ),
            Unavailable(_) | Unconfirmed(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                Side::Gateway,
            ),
            BudgetExceeded { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "budget_exceeded",
                Side::Client,
            ),
            RateLimited { .. } => (StatusCode::TOO_MANY_REQUESTS, "rate_limited", Side::Client),
            UpstreamUnreachable(_) => (
                StatusCode::BAD_GATEWAY,
                "upstream_unreachable",
                Side::Upstream,
            ),
            UpstreamTimeout(_) => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_timeout",
                Side::Upstream,
            ),
            Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                Side::Gateway,
            ),
        }
    }

    pub fn code(&self) -> &'static str {
        self.classify().1
    }

    /// Renders the error for a client, in the given flavor, with `NM-Error` set.
    pub fn into_response(self, flavor: ErrorFlavor) -> Response<GatewayBody> {
        let (status, code, _) = self.classify();
        let message = self.to_string();
        let retry_after = match &self {
            ProxyError::BudgetExceeded { retry_after, .. }
            | ProxyError::RateLimited { retry_after, .. } => {
                // Whole seconds, rounded up: a client that waits that long finds the new period.
                Some(retry_after.as_millis().div_ceil(1000).max(1).to_string())
            }
            _ => None,
        };
        let body = match flavor {
            ErrorFlavor::Gateway => {
                json!({"ok": false, "error": {"code": code, "message": message}})
            }
            ErrorFlavor::Provider(WireFormat::Openai) => json!({
                "error": {"message": message, "type": openai_type(status), "param": null, "code": code}
            }),
            ErrorFlavor::Provider(WireFormat::Anthropic) => json!({
                "type": "error",
                "error": {"type": anthropic_type(status), "message": message}
            }),
            ErrorFlavor::Provider(WireFormat::Gemini) => json!({
                "error": {"code": status.as_u16(), "message": message, "status": google_status(status)}
            }),
        };
        let mut resp = Response::new(GatewayBody::full(Bytes::from(body.to_string())));
        *resp.status_mut() = status;
        let headers = resp.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(NM_ERROR, HeaderValue::from_static(code));
        if status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        if let Some(secs) = retry_after.and_then(|s| HeaderValue::from_str(&s).ok()) {
            headers.insert(header::RETRY_AFTER, secs);
        }
        resp
    }
}

/// OpenAI's `error.type` for a status (the Python and Node SDKs pick the exception by status).
fn openai_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Anthropic's documented `error.type` values.
fn anthropic_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// Google API `status` values (google.rpc.Code names) for an HTTP status.
fn google_status(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 413 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        405 => "UNIMPLEMENTED",
        429 => "RESOURCE_EXHAUSTED",
        502 | 503 => "UNAVAILABLE",
        504 => "DEADLINE_EXCEEDED",
        _ => "INTERNAL",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn render(e: ProxyError, flavor: ErrorFlavor) -> (StatusCode, String, serde_json::Value) {
        let resp = e.into_response(flavor);
        let status = resp.status();
        let code = resp.headers()[NM_ERROR]
            .to_str()
            .unwrap_or_default()
            .to_owned();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        (
            status,
            code,
            serde_json::from_slice(&bytes).unwrap_or_default(),
        )
    }

    #[tokio::test]
    async fn native_shapes() {
        let (s, c, b) = render(
            ProxyError::InvalidApiKey,
            ErrorFlavor::Provider(WireFormat::Openai),
        )
        .await;
        assert_eq!((s.as_u16(), c.as_str()), (401, "invalid_api_key"));
        assert_eq!(b["error"]["type"], "authentication_error");
        assert_eq!(b["error"]["code"], "invalid_api_key");

        let (s, _, b) = render(
            ProxyError::PayloadTooLarge { limit: 1 },
            ErrorFlavor::Provider(WireFormat::Anthropic),
        )
        .await;
        assert_eq!(s.as_u16(), 413);
        assert_eq!(b["type"], "error");
        assert_eq!(b["error"]["type"], "request_too_large");

        let (s, _, b) = render(
            ProxyError::UpstreamTimeout(Duration::from_secs(1)),
            ErrorFlavor::Provider(WireFormat::Gemini),
        )
        .await;
        assert_eq!(s.as_u16(), 504);
        assert_eq!(b["error"]["code"], 504);
        assert_eq!(b["error"]["status"], "DEADLINE_EXCEEDED");

        for (flavor, check) in [
            (
                WireFormat::Openai,
                (|b: &serde_json::Value| b["error"]["type"] == "permission_error")
                    as fn(&serde_json::Value) -> bool,
            ),
            (WireFormat::Anthropic, |b| {
                b["type"] == "error" && b["error"]["type"] == "permission_error"
            }),
            (WireFormat::Gemini, |b| {
                b["error"]["code"] == 403 && b["error"]["status"] == "PERMISSION_DENIED"
            }),
        ] {
            let (s, c, b) = render(
                ProxyError::KeyScope("model \"gpt-5\" is outside".to_owned()),
                ErrorFlavor::Provider(flavor),
            )
            .await;
            assert_eq!((s.as_u16(), c.as_str()), (403, "key_scope"));
            assert!(check(&b), "{flavor:?}: {b}");
        }
        let (s, c, _) = render(
            ProxyError::ExpiredApiKey,
            ErrorFlavor::Provider(WireFormat::Openai),
        )
        .await;
        assert_eq!((s.as_u16(), c.as_str()), (401, "expired_api_key"));

        let (_, _, b) = render(ProxyError::MissingApiKey, ErrorFlavor::Gateway).await;
        assert_eq!(b["ok"], false);
        assert_eq!(b["error"]["code"], "missing_api_key");
    }
}
