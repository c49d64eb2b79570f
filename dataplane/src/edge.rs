//! What a handler takes from its request, written once for the proxy and the signal route: the
//! body read under a size limit, and what the layers above attached (the principal, the request
//! id, the request's spans and route). Each is taken, not cloned: nothing below the handler
//! reads it.

use bytes::Bytes;
use http::{Extensions, HeaderMap, header};
use http_body_util::{BodyExt, Limited};

use crate::body::RequestBody;
use crate::error::ProxyError;
use crate::event::RequestStart;
use crate::keys::Principal;
use crate::layers::RequestId;

/// Reads a whole request body of at most `limit` bytes. A declared `Content-Length` over the
/// limit is refused before a byte is read; a body that grows past it is refused as it does
/// (413 either way). A body that stalls or trickles is a 408 ([`crate::pace`]); one the client
/// breaks off is a 400.
pub async fn read_body(
    headers: &HeaderMap,
    body: RequestBody,
    limit: usize,
) -> Result<Bytes, ProxyError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ProxyError::PayloadTooLarge { limit });
    }
    let collected = Limited::new(body, limit).collect().await.map_err(|e| {
        if e.is::<http_body_util::LengthLimitError>() {
            ProxyError::PayloadTooLarge { limit }
        } else if e.is::<crate::pace::BodyTimeout>() {
            ProxyError::ClientTimeout(e.to_string())
        } else {
            ProxyError::RequestBody(e.to_string())
        }
    })?;
    Ok(collected.to_bytes())
}

/// The service key's principal, which the auth layer attaches to every request it lets through
/// to a route that needs a key.
pub fn take_principal(extensions: &mut Extensions) -> Result<Principal, ProxyError> {
    extensions.remove::<Principal>().ok_or_else(|| {
        ProxyError::Internal("a keyed route was reached without a principal".to_owned())
    })
}

/// The request id the outermost layer attaches (empty outside the full stack, in unit tests).
pub fn take_request_id(extensions: &mut Extensions) -> String {
    extensions
        .remove::<RequestId>()
        .map(|r| r.0)
        .unwrap_or_default()
}

/// The request's `request` span, of its log lines (None outside the full stack).
pub fn request_log(extensions: &Extensions) -> Option<crate::log::RequestLog> {
    extensions.get::<RequestStart>().map(|s| s.log.clone())
}

/// What the trace layer opened for the request; outside the full stack, a `request` span and
/// the route of the request's path.
pub fn take_start<B>(req: &mut http::Request<B>) -> RequestStart {
    match req.extensions_mut().remove::<RequestStart>() {
        Some(start) => start,
        None => {
            let route = crate::routes::Route::of(req.uri().path());
            let id = req
                .extensions()
                .get::<RequestId>()
                .map(|r| r.0.as_str())
                .unwrap_or_default();
            RequestStart {
                log: crate::log::RequestLog::new(id, None, req.method(), route.template()),
                route,
                trace: None,
            }
        }
    }
}
