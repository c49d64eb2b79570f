//! The proxy route: `/<provider>/<native path>` forwarded to the provider, body byte for byte,
//! response streamed back frame by frame.
//!
//! Steps, in order: resolve the provider from the prefix (and check it against the key's
//! scope), check the native path, parse the attribution headers (agent and env against the
//! scope), read the body under the size limit (to learn the model, checked against the scope,
//! and the answer's length cap, and with a session the conversation the implicit rules compare,
//! in the same scan; the original bytes are what is sent), find the request's experiment arm if
//! it is in one ([`crate::experiment`]: the model's bytes rewritten, maybe another provider with
//! the operator's credential, `NM-Variant` on the answer), check the end user's budget and
//! reserve the estimated cost of the model served, build the upstream request, send it, and wrap
//! the upstream body so its frames are metered. Each step fills the request's event ([`crate::event`]); the event
//! alone writes the record, the spans, the metrics, the log and the budget, when the request
//! ends.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use nm_types::throttle::Throttle;
use tracing::warn;

use http::{Request, Response, header};
use http_body_util::Full;

use nm_types::Usage;
use nm_types::access::Scope;

use crate::attribution::Attribution;
use crate::body::{GatewayBody, ObservedBody, RequestBody, UpstreamBody};
use crate::budget::{BudgetName, Estimate, Limit, Refusal, Reservation, Who};
use crate::edge;
use crate::error::ProxyError;
use crate::event::{Ending, RequestEvent};
use crate::experiment::{Arm, Assignment, NM_VARIANT, rewrite_body, rewrite_path};
use crate::forward::{
    path_model, path_model_span, query_without_key, request_facts, request_facts_with,
    strip_credentials, strip_response_headers, upstream_headers, upstream_uri,
};
use crate::implicit::conversation::Conversation;
use crate::implicit::{Implicit, Pending};
use crate::otel::{Call, RequestTrace};
use crate::path::{check_native_path, split_prefix};
use crate::pricing::Found;
use crate::providers::{Provider, WireFormat};
use crate::records;
use crate::state::State;
use crate::usage::{Framing, Meter};
use nm_types::budget::ScopeKind;

/// Handles one proxy request: its event is opened once the key and provider are known, filled
/// as the request goes, and ended by the answer's body (or here, when the gateway answers with
/// an error), so the controlplane sees every request a key made.
pub async fn handle(
    state: Arc<State>,
    mut req: Request<RequestBody>,
) -> Result<Response<GatewayBody>, ProxyError> {
    let started = Instant::now();
    let started_at = SystemTime::now();
    let start = edge::take_start(&mut req);
    let principal = edge::take_principal(req.extensions_mut())?;
    let request_id = edge::take_request_id(req.extensions_mut());
    let (prefix, native) =
        split_prefix(req.uri().path()).ok_or_else(|| ProxyError::UnknownProvider(String::new()))?;
    let provider = state
        .registry
        .get(prefix)
        .cloned()
        .ok_or_else(|| ProxyError::UnknownProvider(prefix.to_owned()))?;
    // The key's scope: the provider now (by its name or the prefix used), the rest as the
    // request reveals them. Refused requests are recorded like any other.
    let scope = principal.scope;
    let provider_refused = scope
        .as_deref()
        .and_then(|s| s.check_provider(&provider.name, [prefix]).err());
    let record = records::started(
        request_id,
        started_at,
        principal.key_id,
        provider.name.clone(),
        req.method(),
        native.to_owned(),
    );
    let route = start.route.template().unwrap_or_default();
    let mut event = RequestEvent::new(record, provider, route, started, start.log, start.trace);

    let result = match provider_refused {
        Some(refusal) => Err(refusal.into()),
        None => forward(&state, req, &mut event, scope.as_deref()).await,
    };
    event.record.trace = event.trace.as_ref().and_then(RequestTrace::trace_ref);
    match result {
        Ok((resp, upstream_wait)) => Ok(answer(&state, event, resp, upstream_wait)),
        Err(e) => {
            let (status, code, _) = e.classify();
            let refused = Ending::Refused {
                status: status.as_u16(),
                code,
            };
            // In `spool` durability the error is answered once its record is on disk, like
            // any other answer's end.
            let ended = Instant::now();
            if let Some(commit) = event.end(refused, ended, Usage::default(), state.sinks(), true) {
                std::future::poll_fn(|cx| commit.poll(cx)).await;
            }
            Err(e)
        }
    }
}

/// The answer's head arrived: its body passes through observed, and ends the event.
fn answer(
    state: &State,
    mut event: RequestEvent,
    resp: Response<UpstreamBody>,
    upstream_wait: Duration,
) -> Response<GatewayBody> {
    let (parts, upstream_body) = resp.into_parts();
    let framing = answer_framing(&parts.headers);
    event.record.streamed = framing == Some(Framing::Sse);
    let mut meter = framing.and_then(|f| meter_for(&event.provider, &parts.headers, f));
    if let (Some(m), Some(keep)) = (&mut meter, event.implicit.and_then(|p| p.wants_text())) {
        m.read_text(crate::usage::text::AnswerText::new(
            state.implicit.keys(),
            keep,
        ));
    }
    // Time spent here up to the answer's head, less the wait on the provider.
    event.overhead = Some(event.started.elapsed().saturating_sub(upstream_wait));
    let body = ObservedBody::new(upstream_body, event, meter, state.sink_handles());
    Response::from_parts(parts, GatewayBody::Upstream { inner: body })
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

/// How long a request whose end user's lease ran out waits for a lease round.
const LEASE_WAIT: Duration = Duration::from_secs(1);

/// The budget check of every budget that applies (key, labels, agent, model, env, end user):
/// admits with a reservation of the request's estimated cost and tokens, or refuses with 429
/// until the period (or minute) ends. The price the estimate found goes in `price`, for the
/// answer's cost.
fn check_budget(
    state: &State,
    provider: &Provider,
    who: &Who<'_>,
    max_output_tokens: Option<u64>,
    body_len: usize,
    request_id: &str,
    price: &mut Option<Found>,
) -> Result<Option<Reservation>, Refusal> {
    // Priced and timed only once a budget applies (most requests of most deployments: none).
    state.budgets.admit_with(who, request_id, || {
        let input = (body_len.div_ceil(BYTES_PER_TOKEN) as u64).min(MAX_RESERVED_INPUT_TOKENS);
        let output = max_output_tokens.unwrap_or(state.reserve_output_tokens);
        let found = state.prices.find(&provider.name, who.model);
        *price = Some(found);
        let micros = found.0.map_or(0, |p| p.estimate_micros(input, output));
        // Tokens: the prompt's estimate plus `max_tokens`, else the configured default.
        let tokens =
            input.saturating_add(max_output_tokens.unwrap_or(state.tpm_default_max_tokens));
        let now_ms = SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        Estimate {
            micros,
            tokens,
            now_ms,
        }
    })
}

/// The limit that refused a request (the refusals metric's `reason`); None when the budgets are
/// not loaded yet, which is no refusal of the user's.
fn refused_by(refusal: &Refusal) -> Option<&'static str> {
    match refusal {
        Refusal::Over { limit, .. } | Refusal::NoLease { limit, .. } => {
            Some(if limit.is_rate() { "rate" } else { "spend" })
        }
        Refusal::NotLoaded | Refusal::LeaseExpired => None,
    }
}

/// "this end user's budget", "the agent support budget", "the default key budget (key k1)".
fn budget_name(b: &BudgetName) -> String {
    match (b.scope.kind, b.default) {
        (ScopeKind::User, _) => "this end user's budget".to_owned(),
        (ScopeKind::Key, true) => format!("the default key budget (key {})", b.scope.value),
        (kind, _) => format!("the {} {} budget", kind.as_str(), b.scope.value),
    }
}

/// "$0.05 per day", "10000 tokens per week", "10 requests per minute".
fn limit_text(limit: Limit) -> String {
    match limit {
        Limit::Usd(micros, period) => format!(
            "{} per {}",
            nm_types::money::format_usd(micros),
            period.as_str()
        ),
        Limit::Tokens(n, period) => format!("{n} tokens per {}", period.as_str()),
        Limit::Rpm(n) => format!("{n} requests per minute"),
        Limit::Tpm(n) => format!("{n} tokens per minute"),
    }
}

fn refusal_error(refusal: Refusal) -> ProxyError {
    let reason = |budget: &BudgetName, limit: Limit, held: bool| {
        let rest = if held {
            " (this minute's rest is held by other dataplanes)"
        } else {
            ""
        };
        if limit.is_rate() {
            if budget.scope.kind == ScopeKind::User {
                format!("this end user may start {}{rest}", limit_text(limit))
            } else {
                format!("{} allows {}{rest}", budget_name(budget), limit_text(limit))
            }
        } else {
            let spent = if held {
                "is spent or held by other dataplanes"
            } else {
                "is spent"
            };
            format!("{} of {} {spent}", budget_name(budget), limit_text(limit))
        }
    };
    // A lease refused: the rest of the limit is held by other dataplanes.
    let held_elsewhere = matches!(refusal, Refusal::NoLease { .. });
    match refusal {
        Refusal::Over {
            budget,
            limit,
            retry_after,
        }
        | Refusal::NoLease {
            budget,
            limit,
            retry_after,
        } => {
            let reason = reason(&budget, limit, held_elsewhere);
            if limit.is_rate() {
                ProxyError::RateLimited {
                    reason,
                    retry_after,
                }
            } else {
                ProxyError::BudgetExceeded {
                    reason,
                    retry_after,
                }
            }
        }
        Refusal::NotLoaded => {
            ProxyError::Unavailable("budgets not loaded from the controlplane yet".to_owned())
        }
        Refusal::LeaseExpired => ProxyError::Unavailable(
            "this request's budgets cannot be checked: the controlplane has not renewed this \
             dataplane's budget leases"
                .to_owned(),
        ),
    }
}

/// The request's steps up to the answer's head: check the path, attribute, read the body, check
/// the budget, send. What they learn goes into the event.
async fn forward(
    state: &State,
    req: Request<RequestBody>,
    event: &mut RequestEvent,
    scope: Option<&Scope>,
) -> Result<(Response<UpstreamBody>, Duration), ProxyError> {
    let RequestEvent {
        record,
        provider,
        trace,
        reservation,
        reserved_price,
        budget_refused,
        implicit,
        ..
    } = event;
    check_native_path(&record.path)?;
    let attribution = Attribution::from_headers(req.headers())?;
    let opted_out = attribution.experiment_off;
    record.agent = attribution.agent;
    record.session_id = attribution.session;
    record.env = attribution.env;
    record.user_id = attribution.user;
    if let Some(scope) = scope {
        scope.check_agent(record.agent.as_deref())?;
        scope.check_env(record.env)?;
    }

    let (mut parts, body) = req.into_parts();
    let mut body = edge::read_body(&parts.headers, body, state.max_body_bytes).await?;
    let rules = state.implicit.rules_for(record.agent.as_deref());
    let facts = match &record.session_id {
        Some(session) if Implicit::reads_conversation(rules, true) => {
            let mut conversation = Conversation::new(state.implicit.keys(), &body);
            let facts = request_facts_with(&body, &record.path, Some(&mut conversation));
            *implicit = Some(state.implicit.infer(
                rules,
                state.implicit.session_key(&record.key_id, session.as_str()),
                &conversation.finish(),
                &body,
                Instant::now(),
                &mut record.inferred,
            ));
            facts
        }
        _ => {
            *implicit = (!rules.is_empty()).then(|| Pending::without_session(rules));
            request_facts(&body, &record.path)
        }
    };
    record.model = facts.model;
    if let Some(scope) = scope {
        // Before the budget's reservation and before anything is sent. The provider may read
        // the model from the path (Gemini) though the body names one too: both must be in
        // scope; a percent-encoded one is not compared (it could decode to anything).
        scope.check_model(record.model.as_deref())?;
        if let Some(in_path) = path_model(&record.path) {
            scope.check_model(Some(in_path).filter(|m| !m.contains('%')))?;
        }
    }
    // The experiment, before the budget's reservation (which prices the model served).
    let mut variant = None;
    let mut query = parts.uri.query().map(Cow::Borrowed);
    if !opted_out
        && let Some(assignment) = state.experiments.assign(
            record.agent.as_deref(),
            record.env,
            record.session_id.as_ref().map(|s| s.as_str()),
            provider.format,
        )
        && let Some((served, in_path)) = serve_arm(
            &assignment,
            provider,
            (record.model.as_deref(), facts.model_span),
            &mut body,
            &mut record.path,
        )
    {
        // The model the client named: the record's, unless the arm rewrote the path's.
        let requested = in_path.or_else(|| record.model.take());
        record.model = Some(String::from(&*served.model));
        record.variant = Some(assignment.variant(requested));
        if served.provider.name != provider.name {
            // The operator's credential for the arm's provider, never the client's for the
            // one it addressed.
            strip_credentials(&mut parts.headers);
            query = query_without_key(query.as_deref()).map(Cow::Owned);
            record.provider = served.provider.name.clone();
            *provider = served.provider.clone();
        }
        variant = Some(served.variant.clone());
    }
    {
        let who = Who {
            key: &record.key_id,
            agent: record.agent.as_deref(),
            model: record.model.as_deref(),
            env: record.env.map(|e| e.as_str()),
            user: record.user_id.as_deref(),
        };
        let mut check = || {
            check_budget(
                state,
                provider,
                &who,
                facts.max_output_tokens,
                body.len(),
                &record.request_id,
                reserved_price,
            )
        };
        *reservation = match check() {
            // This dataplane's lease is used up: one lease round (off the request path unless
            // the lease ran out), then the answer stands.
            Err(Refusal::NoLease { .. } | Refusal::LeaseExpired) => {
                state.budgets.wait_for_lease(LEASE_WAIT).await;
                check()
            }
            admitted => admitted,
        }
        .map_err(|refusal| {
            *budget_refused = refused_by(&refusal);
            refusal_error(refusal)
        })?;
    }

    let query = query.as_deref();
    let uri = upstream_uri(provider, &record.path, query)?;
    let mut headers = upstream_headers(&parts.headers, provider, query);
    if let Some(t) = trace.as_mut() {
        t.call(&Call {
            provider,
            native_path: &record.path,
            method: &parts.method,
            model: record.model.as_deref(),
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
    if let Some(v) = variant {
        resp.headers_mut().insert(NM_VARIANT, v);
    }
    record.status = resp.status().as_u16();
    Ok((resp, waited))
}

/// The lines saying an arm could not serve for want of its provider's credential.
static NO_CREDENTIAL: Throttle = Throttle::new(Duration::from_secs(1));

/// Makes `body` or `path` name the assigned arm's model; returns the arm (where the request
/// goes) and, when the arm rewrote the path, the model the client named there (else it named
/// `requested`). None (nothing changed) when the arm cannot serve this request: the model is not
/// named where the arm would rewrite it, or the arm's provider is another and has no operator
/// credential.
fn serve_arm<'a>(
    assignment: &'a Assignment,
    addressed: &Provider,
    (requested, model_span): (Option<&str>, Option<std::ops::Range<usize>>),
    body: &mut Bytes,
    path: &mut String,
) -> Option<(&'a Arm, Option<String>)> {
    let arm = assignment.arm();
    let elsewhere = arm.provider.name != addressed.name;
    if elsewhere && arm.provider.api_key.is_none() {
        if let Some(suppressed) = NO_CREDENTIAL.allow() {
            warn!(
                experiment = %assignment.id(),
                arm = %arm.name,
                provider = %arm.provider.name,
                suppressed,
                "an experiment's arm is on a provider without an operator credential \
                 (NM_PROVIDER_KEY_<NAME>); its requests pass unchanged"
            );
        }
        return None;
    }
    let requested = match addressed.format {
        WireFormat::Openai | WireFormat::Anthropic => {
            let (span, requested) = (model_span?, requested?);
            if requested != &*arm.model {
                *body = rewrite_body(body, span, &arm.model_json);
            }
            None
        }
        // The path names the model Gemini serves (a body's `model`, if any, is not read).
        WireFormat::Gemini => {
            let span = path_model_span(path)?;
            let requested = path.get(span.clone())?.to_owned();
            if requested != *arm.model_path {
                *path = rewrite_path(path, span, &arm.model_path);
            }
            Some(requested)
        }
    };
    Some((arm, requested))
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
