//! What a handler takes from its request, written once for the proxy and the signal route: the
//! body read under a size limit, and what the layers above attached (the principal, the request
//! id, the request's span). Each is taken, not cloned: nothing below the handler reads it.

use bytes::Bytes;
use http::{Extensions, HeaderMap, header};
use http_body_util::{BodyExt, Limited};

use crate::body::RequestBody;
use crate::error::ProxyError;
use crate::keys::Principal;
use crate::layers::RequestId;
use crate::layers::trace::RequestSpan;

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

/// The request's exported spans, when tracing is on.
pub fn take_trace(extensions: &mut Extensions) -> Option<crate::otel::RequestTrace> {
    extensions.remove::<crate::otel::RequestTrace>()
}

/// The request's span from the trace layer, or the current span outside the full stack.
pub fn take_span(extensions: &mut Extensions) -> tracing::Span {
    extensions
        .remove::<RequestSpan>()
        .map_or_else(tracing::Span::current, |s| s.0)
}
