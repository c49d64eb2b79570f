//! The proxy route: `/<provider>/<native path>` forwarded to the provider, body byte for byte,
//! response streamed back frame by frame.
//!
//! Steps, in order: resolve the provider from the prefix, check the native path, parse the
//! attribution headers, read the body under the size limit (to learn the model and the answer's
//! length cap; the original bytes are what is sent), check the end user's budget and reserve
//! the request's estimated cost, build the upstream request, send it, and wrap the upstream body
//! so its frames are metered and its end completes the request record.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use http::{Request, Response, header};
use http_body_util::Full;

use crate::attribution::Attribution;
use crate::body::{Completion, GatewayBody, ObservedBody, RequestBody, UpstreamBody};
use crate::budget::{Refusal, Reservation};
use crate::edge;
use crate::error::ProxyError;
use crate::forward::{
    RequestFacts, request_facts, strip_response_headers, upstream_headers, upstream_uri,
};
use crate::otel::{Call, RequestTrace};
use crate::path::{check_native_path, split_prefix};
use crate::providers::Provider;
use crate::records::{self, RequestRecord};
use crate::state::State;
use crate::usage::{Framing, Meter};

/// Handles one proxy request. Gateway-made errors after authentication are recorded too, so the
/// controlplane sees every request a key made.
pub async fn handle(
    state: Arc<State>,
    mut req: Request<RequestBody>,
) -> Result<Response<GatewayBody>, ProxyError> {
    let started = Instant::now();
    let started_at = SystemTime::now();
    let span = edge::take_span(req.extensions_mut());
    let mut trace = edge::take_trace(req.extensions_mut());
    let principal = edge::take_principal(req.extensions_mut())?;
    let request_id = edge::take_request_id(req.extensions_mut());
    let path = req.uri().path();
    let (prefix, native) =
        split_prefix(path).ok_or_else(|| ProxyError::UnknownProvider(String::new()))?;
    let provider = state
        .registry
        .get(prefix)
        .cloned()
        .ok_or_else(|| ProxyError::UnknownProvider(prefix.to_owned()))?;
    span.record("gen_ai.provider.name", &*provider.name);
    span.record("http.route", crate::routes::PROXY_TEMPLATE);

    let mut record = records::started(
        request_id,
        started_at,
        principal.key_id,
        provider.name.clone(),
        req.method(),
        native.to_owned(),
    );

    let mut reservation = None;
    let result = forward(
        &state,
        &provider,
        req,
        &mut record,
        &mut reservation,
        &span,
        &mut trace,
    )
    .await;
    record.trace = trace.as_ref().and_then(RequestTrace::trace_ref);
    match result {
        Ok((resp, upstream_wait)) => {
            let (parts, upstream_body) = resp.into_parts();
            let framing = answer_framing(&parts.headers);
            record.streamed = framing == Some(Framing::Sse);
            if let Some(t) = &trace {
                t.answered(record.status, record.streamed);
            }
            let meter = framing.and_then(|f| meter_for(&provider, &parts.headers, f));
            let operation = crate::otel::operation_name(provider.format, &record.path);
            let completion = Completion {
                record,
                started,
                sink: state.records.clone(),
                span,
                prices: state.prices.clone(),
                reservation,
                trace,
                output: None,
                operation,
                system: provider.system.clone(),
                metrics: state.metrics.clone(),
            };
            let resp = Response::from_parts(
                parts,
                GatewayBody::Upstream {
                    inner: ObservedBody::new(upstream_body, completion, meter),
                },
            );
            // Time spent here up to the answer's head, less the wait on the provider.
            state.metrics.gateway_overhead(
                &provider.system,
                started.elapsed().saturating_sub(upstream_wait),
            );
            Ok(resp)
        }
        Err(e) => {
            let (status, code, _) = e.classify();
            if let Some(t) = trace.as_mut() {
                t.call_failed(code);
                t.gateway_error(code, status.as_u16());
            }
            if let Some(operation) = crate::otel::operation_name(provider.format, &record.path) {
                state.metrics.operation(&crate::metrics::Operation {
                    operation,
                    provider: &provider.system,
                    request_model: record.model.as_deref(),
                    error_type: Some(code),
                    duration: started.elapsed(),
                    trace_id: record.trace.map(|t| t.trace_hex()).as_deref(),
                    ..Default::default()
                });
            }
            record.status = status.as_u16();
            record.error_code = Some(Cow::Borrowed(code));
            record.latency_ms = records::millis(started.elapsed());
            if let Some(hold) = reservation {
                // Admitted, but nothing reached the provider: nothing to pay.
                hold.settle(0);
                record.budget_micros = Some(0);
            }
            // In `spool` durability the error is answered once its record is on disk, like
            // any other answer's end.
            if let Some(commit) = state.records.commit(record) {
                std::future::poll_fn(|cx| commit.poll(cx)).await;
            }
            Err(e)
        }
    }
}

/// How the answer's content type frames it: an SSE stream, JSON, or neither (None).
fn answer_framing(headers: &http::HeaderMap) -> Option<Framing> {
    let ct = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    let ct = ct.split(';').next()?.trim();
    if ct.eq_ignore_ascii_case("text/event-stream") {
        Some(Framing::Sse)
    } else if ct.eq_ignore_ascii_case("application/json") || ct.ends_with("+json") {
        Some(Framing::Json)
    } else {
        None
    }
}

/// A meter for the answer, when its provider and framing are ones we read usage from. A
/// compressed answer (the upstream ignored `Accept-Encoding: identity`) is not metered.
fn meter_for(provider: &Provider, headers: &http::HeaderMap, framing: Framing) -> Option<Meter> {
    if headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| v.as_bytes() != b"identity")
    {
        return None;
    }
    Some(Meter::new(provider.format, framing))
}

/// Prompt tokens assumed per body byte when estimating a reservation (JSON text runs about four
/// bytes a token; images and other overhead make this an over-estimate, which is the safe side).
const BYTES_PER_TOKEN: usize = 4;
/// Prompt tokens counted at most for a reservation (a large upload must not block its user's
/// concurrent requests for more than a long prompt's worth).
const MAX_RESERVED_INPUT_TOKENS: u64 = 200_000;

/// The end user's budget check: admits with a reservation of the request's estimated cost, or
/// refuses with 429 until the period resets.
fn check_budget(
    state: &State,
    provider: &Provider,
    facts: &RequestFacts,
    body_len: usize,
    user: &str,
    request_id: &str,
) -> Result<Option<Reservation>, ProxyError> {
    let input = (body_len.div_ceil(BYTES_PER_TOKEN) as u64).min(MAX_RESERVED_INPUT_TOKENS);
    let output = facts
        .max_output_tokens
        .unwrap_or(state.reserve_output_tokens);
    let estimate = facts
        .model
        .as_deref()
        .and_then(|m| {
            state
                .prices
                .estimate_micros(&provider.name, m, input, output)
        })
        .unwrap_or(0);
    let now_ms = SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    state
        .budgets
        .admit(user, request_id, estimate, now_ms)
        .map_err(|refusal| match refusal {
            Refusal::Spent { .. } | Refusal::Rate { .. } => {
                let reason = if matches!(refusal, Refusal::Spent { .. }) {
                    "spend"
                } else {
                    "rate"
                };
                state.metrics.budget_refused(reason);
                refusal_error(refusal)
            }
            Refusal::NotLoaded => refusal_error(refusal),
        })
}

fn refusal_error(refusal: Refusal) -> ProxyError {
    match refusal {
        Refusal::Spent {
            limit_micros,
            period,
            retry_after,
        } => ProxyError::BudgetExceeded {
            reason: format!(
                "this end user's budget of {} per {} is spent",
                nm_types::money::format_usd(limit_micros),
                period.as_str()
            ),
            retry_after,
        },
        Refusal::Rate { rpm, retry_after } => ProxyError::BudgetExceeded {
            reason: format!("this end user may start {rpm} requests per minute"),
            retry_after,
        },
        Refusal::NotLoaded => ProxyError::Unavailable(
            "end-user budgets not loaded from the controlplane yet".to_owned(),
        ),
    }
}

async fn forward(
    state: &State,
    provider: &Provider,
    req: Request<RequestBody>,
    record: &mut RequestRecord,
    reservation: &mut Option<Reservation>,
    span: &tracing::Span,
    trace: &mut Option<RequestTrace>,
) -> Result<(Response<UpstreamBody>, std::time::Duration), ProxyError> {
    check_native_path(&record.path)?;
    let attribution = Attribution::from_headers(req.headers())?;
    if let Some(a) = &attribution.agent {
        span.record("nm.agent", a.as_str());
    }
    if let Some(s) = &attribution.session {
        span.record("nm.session", s.as_str());
    }
    if let Some(e) = attribution.env {
        span.record("nm.env", e.as_str());
    }
    if let Some(t) = trace.as_ref() {
        t.attribute(
            attribution.agent.as_deref(),
            attribution.env.map(|e| e.as_str()),
        );
    }
    record.agent = attribution.agent;
    record.session_id = attribution.session;
    record.env = attribution.env;
    record.user_id = attribution.user;

    let (parts, body) = req.into_parts();
    let body = edge::read_body(&parts.headers, body, state.max_body_bytes).await?;
    let facts = request_facts(&body, &record.path);
    record.model = facts.model.clone();
    if let Some(m) = &record.model {
        span.record("gen_ai.request.model", m.as_str());
    }
    if let Some(user) = &record.user_id {
        *reservation = check_budget(
            state,
            provider,
            &facts,
            body.len(),
            user,
            &record.request_id,
        )?;
    }

    let query = parts.uri.query();
    let uri = upstream_uri(provider, &record.path, query)?;
    let mut headers = upstream_headers(&parts.headers, provider, query);
    if let Some(t) = trace.as_mut() {
        t.call(&Call {
            provider,
            native_path: &record.path,
            method: &parts.method,
            model: facts.model.as_deref(),
            max_tokens: facts.max_output_tokens,
            session: record.session_id.as_ref().map(|s| s.as_str()),
            body: &body,
        });
        if provider.trace_context {
            t.inject(&mut headers);
        }
    }
    let mut upstream_req = Request::builder()
        .method(parts.method)
        .uri(uri)
        .body(Full::new(body))
        .map_err(|e| ProxyError::Internal(format!("cannot build upstream request: {e}")))?;
    *upstream_req.headers_mut() = headers;

    let sent = Instant::now();
    let mut resp = state.upstream.send(upstream_req).await?;
    let waited = sent.elapsed();
    strip_response_headers(resp.headers_mut());
    record.status = resp.status().as_u16();
    span.record("http.response.status_code", record.status);
    Ok((resp, waited))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framing_of(content_type: Option<&'static str>) -> Option<Framing> {
        let mut headers = http::HeaderMap::new();
        if let Some(ct) = content_type {
            headers.insert(header::CONTENT_TYPE, http::HeaderValue::from_static(ct));
        }
        answer_framing(&headers)
    }

    #[test]
    fn the_media_type_decides_the_framing_whatever_its_case_and_parameters() {
        assert_eq!(framing_of(Some("text/event-stream")), Some(Framing::Sse));
        assert_eq!(
            framing_of(Some("Text/Event-Stream; charset=utf-8")),
            Some(Framing::Sse)
        );
        assert_eq!(
            framing_of(Some("application/json; charset=utf-8")),
            Some(Framing::Json)
        );
        assert_eq!(
            framing_of(Some("application/problem+json")),
            Some(Framing::Json)
        );
        assert_eq!(framing_of(Some("text/plain")), None);
        assert_eq!(framing_of(Some("text/event-streamish")), None);
        assert_eq!(framing_of(None), None);
    }
}
