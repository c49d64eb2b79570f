//! The link's wire format, once: the `nm.link.v1` protobuf messages (generated from
//! `proto/nm/link/v1/link.proto`, committed in `generated/`, [`pb`]) and the one mapping
//! between them and the types both halves speak: records, signals, key snapshots, the budget
//! feed. Both adapters use it (the root's gRPC client and server), and so do the dataplane's
//! spool and journal, which store a batch of records as its `IngestRequests` message
//! ([`encode_batch`], [`decode_batch`]).
//!
//! Parsing happens here, once, at the edge: a session id, env or action that does not parse is
//! the error (the rule it breaks); every other rule is [`RequestRecord::check`]'s and
//! [`Signal::check`]'s, run by the controlplane whatever adapter brought the data.
//!
//! Behind the `link` feature: the controlplane crate never needs it.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;
use prost_types::Timestamp;

use crate::access::{Role, Scope};
use crate::budget::{
    BudgetRule, Feed, LeaseClaim, LeaseKey, LeaseRequest, LeaseResponse, LeaseUnit, Period,
    Scope as BudgetScope, ScopeKind, Spend,
};
use crate::experiment::{Live, LiveArm, Salt, Variant};
use crate::record::{Inferred, RequestRecord, TraceRef};
use crate::signal::{RequestId, Signal};
use crate::{Action, Env, KeyVerifiers, SessionId, Usage, UsageStatus, VerifiedKey};

/// Code generated from `proto/nm/link/v1/link.proto`: the messages only (the root adds the
/// tonic service code over them). Committed (`generated/`): the root's test `grpc::codegen`
/// regenerates it and fails if it differs.
pub mod pb {
    #![allow(
        clippy::allow_attributes_without_reason,
        reason = "prost-generated code"
    )]
    include!("generated/nm.link.v1.rs");
}

mod record_wire;

/// Why a session id from the wire was refused.
const BAD_SESSION_ID: &str = "session_id must look like sess_<id>";

pub fn ms_to_timestamp(ms: i64) -> Timestamp {
    Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: (ms.rem_euclid(1000) * 1_000_000) as i32,
    }
}

pub fn timestamp_to_ms(ts: &Timestamp) -> i64 {
    ts.seconds
        .saturating_mul(1000)
        .saturating_add(i64::from(ts.nanos) / 1_000_000)
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

// === records ===

/// The record on the wire (and in the spool). The one mapping, with [`record_from_pb`].
pub fn record_to_pb(r: &RequestRecord) -> pb::RequestRecord {
    use UsageStatus as S;
    let usage_status = match r.usage_status {
        S::Reported => pb::UsageStatus::Reported,
        S::Partial => pb::UsageStatus::Partial,
        S::Missing => pb::UsageStatus::Missing,
        S::NotApplicable => pb::UsageStatus::NotApplicable,
    };
    let u = &r.usage;
    pb::RequestRecord {
        request_id: r.request_id.clone(),
        started_at: Some(ms_to_timestamp(r.started_at_ms)),
        // `String::from(&str)`, not `to_string()`: that goes through the formatter (`fmt::pad`),
        // a few hundred instructions a string on every record.
        key_id: String::from(&*r.key_id),
        provider: String::from(&*r.provider),
        method: String::from(&*r.method),
        path: r.path.clone(),
        model: r.model.clone(),
        agent: r.agent.clone(),
        session_id: r.session_id.as_ref().map(|s| s.as_str().to_owned()),
        env: r.env.map(|e| e.as_str().to_owned()),
        user_id: r.user_id.clone(),
        status: u32::from(r.status),
        latency_ms: r.latency_ms,
        ttfb_ms: r.ttfb_ms,
        streamed: r.streamed,
        error_code: r.error_code.as_deref().map(str::to_owned),
        response_bytes: r.response_bytes,
        answered_model: u.model.clone(),
        input_tokens: u.input_tokens,
        output_tokens: u.output_tokens,
        cached_input_tokens: u.cached_input_tokens,
        cache_write_tokens: u.cache_write_tokens,
        reasoning_tokens: u.reasoning_tokens,
        finish_reason: u.finish_reason.clone(),
        cost_micros: r.cost_micros,
        usage_status: usage_status.into(),
        budget_micros: r.budget_micros,
        trace_id: r.trace.map(|t| t.trace_hex()),
        span_id: r.trace.map(|t| t.span_hex()),
        inferred: r
            .inferred
            .iter()
            .map(|i| pb::InferredSignal {
                rule: i.rule.name().to_owned(),
                answer_request_id: i.answer.as_str().to_owned(),
                edit_distance: i.edit_distance,
            })
            .collect(),
        experiment_id: r.variant.as_ref().map(|v| String::from(&*v.experiment)),
        arm: r.variant.as_ref().map(|v| String::from(&*v.arm)),
        requested_model: r.variant.as_ref().and_then(|v| v.requested_model.clone()),
    }
}

/// Wire -> record: the session id and env are parsed here (the rule they break is the error);
/// every other rule is [`RequestRecord::check`]'s. A status beyond `u16` becomes one the check
/// refuses, never a wrapped-around valid one.
pub fn record_from_pb(r: pb::RequestRecord) -> Result<RequestRecord, &'static str> {
    use UsageStatus as S;
    let usage_status = match r.usage_status() {
        pb::UsageStatus::Reported => S::Reported,
        pb::UsageStatus::Partial => S::Partial,
        pb::UsageStatus::Missing => S::Missing,
        pb::UsageStatus::NotApplicable | pb::UsageStatus::Unspecified => S::NotApplicable,
    };
    let session_id = r
        .session_id
        .map(|s| s.parse::<SessionId>())
        .transpose()
        .map_err(|_| BAD_SESSION_ID)?;
    let env = r
        .env
        .map(|e| e.parse::<Env>())
        .transpose()
        .map_err(|_| "env must be production, staging or development")?;
    let trace =
        match (&r.trace_id, &r.span_id) {
            (None, None) => None,
            (Some(t), Some(s)) => Some(TraceRef::from_hex(t, s).ok_or(
                "trace_id and span_id must be 32 and 16 lower-case hex digits, not all zero",
            )?),
            _ => return Err("trace_id and span_id come together"),
        };
    let inferred = r
        .inferred
        .into_iter()
        .map(|i| {
            Ok(Inferred {
                rule: i.rule.parse()?,
                answer: i.answer_request_id.parse()?,
                edit_distance: i.edit_distance,
            })
        })
        .collect::<Result<_, &'static str>>()?;
    let variant = match (r.experiment_id, r.arm) {
        (None, None) if r.requested_model.is_none() => None,
        (Some(experiment), Some(arm)) => Some(Variant {
            experiment: experiment.into(),
            arm: arm.into(),
            requested_model: r.requested_model,
        }),
        _ => return Err("experiment_id and arm come together, requested_model only with them"),
    };
    Ok(RequestRecord {
        request_id: r.request_id,
        started_at_ms: r.started_at.as_ref().map_or(0, timestamp_to_ms),
        key_id: r.key_id.into(),
        provider: r.provider.into(),
        method: r.method.into(),
        path: r.path,
        model: r.model,
        agent: r.agent,
        session_id,
        env,
        user_id: r.user_id,
        status: u16::try_from(r.status).unwrap_or(u16::MAX),
        latency_ms: r.latency_ms,
        ttfb_ms: r.ttfb_ms,
        streamed: r.streamed,
        error_code: r.error_code.map(Into::into),
        response_bytes: r.response_bytes,
        usage: Usage {
            model: r.answered_model,
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            cached_input_tokens: r.cached_input_tokens,
            cache_write_tokens: r.cache_write_tokens,
            reasoning_tokens: r.reasoning_tokens,
            finish_reason: r.finish_reason,
            // The link does not carry it: nothing downstream of the dataplane uses it.
            response_id: None,
        },
        usage_status,
        cost_micros: r.cost_micros,
        budget_micros: r.budget_micros,
        trace,
        inferred,
        variant,
    })
}

/// A batch as the spool and the record journal store it and the ingest call sends it: its
/// `IngestRequests` message, written straight from the records ([`record_wire`]).
pub fn encode_batch(records: &[RequestRecord]) -> Vec<u8> {
    let mut out = Vec::with_capacity(records.len() * 512);
    record_wire::encode_batch_into(records, &mut out, &mut Vec::with_capacity(512));
    out
}

/// A stored batch read back: each record, or the rule it breaks on reading (a file of another
/// version). An error when the bytes are not such a message at all.
pub fn decode_batch(
    bytes: &[u8],
) -> Result<Vec<Result<RequestRecord, &'static str>>, prost::DecodeError> {
    let req = pb::IngestRequestsRequest::decode(bytes)?;
    Ok(req.records.into_iter().map(record_from_pb).collect())
}

// === signals ===

/// Signal -> wire.
pub fn signal_to_pb(s: Signal) -> pb::Signal {
    pb::Signal {
        session_id: s
            .session_id
            .map(|id| id.as_str().to_owned())
            .unwrap_or_default(),
        answer_request_id: s.request_id.map(|id| id.as_str().to_owned()),
        action: s.action.as_str().to_owned(),
        edit_distance: s.edit_distance,
        custom_label_json: s.custom_label,
        agent_hint: s.agent_hint,
        idempotency_key: s.idempotency_key,
        key_id: s.key_id.to_string(),
        request_id: s.id,
        received_at: Some(ms_to_timestamp(s.received_at_ms)),
    }
}

/// Wire -> signal: the session id, the request id and the action are parsed here (the rule
/// they break is the error; an empty session id is none); every other rule is
/// [`Signal::check`]'s. Without a time, the signal was received now.
pub fn signal_from_pb(s: pb::Signal) -> Result<Signal, String> {
    let session_id = match s.session_id.as_str() {
        "" => None,
        id => Some(
            id.parse::<SessionId>()
                .map_err(|_| BAD_SESSION_ID.to_owned())?,
        ),
    };
    let request_id = s
        .answer_request_id
        .map(|id| id.parse::<RequestId>())
        .transpose()
        .map_err(str::to_owned)?;
    let action = s.action.parse::<Action>().map_err(|e| e.to_string())?;
    Ok(Signal {
        id: s.request_id,
        received_at_ms: s.received_at.as_ref().map_or_else(now_ms, timestamp_to_ms),
        session_id,
        request_id,
        action,
        edit_distance: s.edit_distance,
        custom_label: s.custom_label_json,
        key_id: s.key_id.into(),
        idempotency_key: s.idempotency_key,
        agent_hint: s.agent_hint,
    })
}

/// Trace references -> wire (a signal's session's spans).
pub fn spans_to_pb(spans: &[TraceRef]) -> Vec<pb::SpanRef> {
    spans
        .iter()
        .map(|t| pb::SpanRef {
            trace_id: t.trace_hex(),
            span_id: t.span_hex(),
        })
        .collect()
}

/// Wire -> trace references; a malformed one is left out (it could link nothing).
pub fn spans_from_pb(spans: &[pb::SpanRef]) -> Vec<TraceRef> {
    spans
        .iter()
        .filter_map(|s| TraceRef::from_hex(&s.trace_id, &s.span_id))
        .collect()
}

// === key snapshots and the budget feed ===

pub fn key_verifiers_to_pb(k: KeyVerifiers) -> pb::KeySnapshot {
    pb::KeySnapshot {
        version: k.version,
        keys: k
            .keys
            .into_iter()
            .map(|k| pb::KeyEntry {
                id: k.id,
                verifier: k.verifier.to_vec(),
                admin: k.role == Role::Admin,
                role: match k.role {
                    Role::Admin => pb::KeyRole::Admin,
                    Role::Viewer => pb::KeyRole::Viewer,
                    Role::Service => pb::KeyRole::Service,
                } as i32,
                scope: k.scope.map(|s| pb::KeyScope {
                    providers: s.providers.clone(),
                    models: s.models.clone(),
                    agents: s.agents.clone(),
                    envs: s.envs.iter().map(|e| e.as_str().to_owned()).collect(),
                }),
                expires_at_ms: k.expires_at_ms.unwrap_or(0),
            })
            .collect(),
        write_problem: k.write_problem.unwrap_or_default(),
        experiments: k.experiments.into_iter().map(live_to_pb).collect(),
    }
}

fn live_to_pb(e: Live) -> pb::LiveExperiment {
    pb::LiveExperiment {
        id: e.id.to_string(),
        agent: e.agent.to_string(),
        env: e.env.map(|e| e.as_str().to_owned()),
        salt: e.salt.bytes().to_vec(),
        arms: e
            .arms
            .into_iter()
            .map(|a| pb::LiveArm {
                name: a.name.to_string(),
                weight: a.weight,
                provider: a.provider.to_string(),
                model: a.model.to_string(),
            })
            .collect(),
    }
}

/// Wire -> live experiment; `None` when its salt is not 16 bytes or its env unknown to this
/// build (it could not be applied as written; its requests then pass unchanged). The other
/// rules are [`Live::check`]'s, which the dataplane applies.
fn live_from_pb(e: pb::LiveExperiment) -> Option<Live> {
    let env = match e.env {
        None => None,
        Some(v) => Some(v.parse::<Env>().ok()?),
    };
    Some(Live {
        env,
        salt: Salt::new(e.salt.as_slice().try_into().ok()?),
        id: e.id.into(),
        agent: e.agent.into(),
        arms: e
            .arms
            .into_iter()
            .map(|a| LiveArm {
                name: a.name.into(),
                weight: a.weight,
                provider: a.provider.into(),
                model: a.model.into(),
            })
            .collect(),
    })
}

/// Wire -> key verifiers; an entry whose verifier is not 32 bytes is left out (it could match
/// nothing), and so is one whose scope names an env this build does not know (it could not be
/// enforced as written: refusing the key is the safe side).
pub fn key_verifiers_from_pb(k: pb::KeySnapshot) -> KeyVerifiers {
    KeyVerifiers {
        version: k.version,
        keys: k
            .keys
            .into_iter()
            .filter_map(|e| {
                let role = match e.role() {
                    pb::KeyRole::Admin => Role::Admin,
                    pb::KeyRole::Viewer => Role::Viewer,
                    pb::KeyRole::Service => Role::Service,
                    pb::KeyRole::Unspecified if e.admin => Role::Admin,
                    pb::KeyRole::Unspecified => Role::Service,
                };
                let scope = match e.scope {
                    None => None,
                    Some(s) => Some(Scope {
                        envs: s
                            .envs
                            .iter()
                            .map(|e| e.parse::<Env>().ok())
                            .collect::<Option<Vec<_>>>()?,
                        providers: s.providers,
                        models: s.models,
                        agents: s.agents,
                    }),
                };
                Some(VerifiedKey {
                    verifier: e.verifier.as_slice().try_into().ok()?,
                    id: e.id,
                    role,
                    scope: scope.filter(|s| !s.is_unrestricted()).map(Arc::new),
                    expires_at_ms: Some(e.expires_at_ms).filter(|t| *t != 0),
                })
            })
            .collect(),
        write_problem: Some(k.write_problem).filter(|p| !p.is_empty()),
        experiments: k.experiments.into_iter().filter_map(live_from_pb).collect(),
    }
}

fn scope_kind_from_pb(scope: &str) -> Result<ScopeKind, String> {
    if scope.is_empty() {
        Ok(ScopeKind::User)
    } else {
        scope.parse()
    }
}

fn rule_to_pb(user_id: Option<String>, scope: ScopeKind, r: &BudgetRule) -> pb::BudgetRule {
    pb::BudgetRule {
        user_id,
        limit_micros: r.limit_micros,
        monthly: r.period == Period::Month,
        requests_per_minute: r.requests_per_minute,
        scope: scope.as_str().to_owned(),
        weekly: r.period == Period::Week,
        limit_tokens: r.limit_tokens,
        tokens_per_minute: r.tokens_per_minute,
    }
}

fn rule_from_pb(r: &pb::BudgetRule) -> BudgetRule {
    BudgetRule {
        limit_micros: r.limit_micros,
        period: if r.weekly {
            Period::Week
        } else if r.monthly {
            Period::Month
        } else {
            Period::Day
        },
        requests_per_minute: r.requests_per_minute,
        limit_tokens: r.limit_tokens,
        tokens_per_minute: r.tokens_per_minute,
    }
}

pub fn feed_to_pb(f: Feed) -> pb::BudgetFeed {
    let mut rules: Vec<_> = f
        .default
        .iter()
        .map(|r| rule_to_pb(None, ScopeKind::User, r))
        .collect();
    rules.extend(
        f.default_key
            .iter()
            .map(|r| rule_to_pb(None, ScopeKind::Key, r)),
    );
    rules.extend(
        f.overrides
            .iter()
            .map(|(s, r)| rule_to_pb(Some(s.value.clone()), s.kind, r)),
    );
    pb::BudgetFeed {
        epoch: f.epoch,
        seq: f.seq,
        full: f.full,
        rules,
        spend: f
            .spend
            .into_iter()
            .map(|(scope, s)| pb::UserSpend {
                user_id: scope.value,
                day_micros: s.day_micros,
                month_micros: s.month_micros,
                minute: s.minute,
                minute_requests: s.minute_requests,
                scope: scope.kind.as_str().to_owned(),
                week_micros: s.week_micros,
                day_tokens: s.day_tokens,
                week_tokens: s.week_tokens,
                month_tokens: s.month_tokens,
                minute_tokens: s.minute_tokens,
            })
            .collect(),
        day: f.day,
        month: f.month,
        label_keys: f
            .label_keys
            .into_iter()
            .map(|(label, key_ids)| pb::LabelKeys { label, key_ids })
            .collect(),
    }
}

/// The feed a message carries; rules and spend of unknown scopes (a newer controlplane's) are
/// left out.
pub fn feed_from_pb(msg: pb::BudgetFeed) -> Feed {
    let mut default = None;
    let mut default_key = None;
    let mut overrides = Vec::new();
    for r in &msg.rules {
        let rule = rule_from_pb(r);
        let Ok(kind) = scope_kind_from_pb(&r.scope) else {
            continue;
        };
        match (&r.user_id, kind) {
            (None, ScopeKind::Key) => default_key = Some(rule),
            (None, _) => default = Some(rule),
            (Some(v), kind) => overrides.push((BudgetScope::new(kind, v.clone()), rule)),
        }
    }
    Feed {
        epoch: msg.epoch,
        seq: msg.seq,
        full: msg.full,
        default,
        default_key,
        overrides,
        label_keys: msg
            .label_keys
            .into_iter()
            .map(|l| (l.label, l.key_ids))
            .collect(),
        spend: msg
            .spend
            .into_iter()
            .filter_map(|s| {
                let kind = scope_kind_from_pb(&s.scope).ok()?;
                Some((
                    BudgetScope::new(kind, s.user_id),
                    Spend {
                        day_micros: s.day_micros,
                        month_micros: s.month_micros,
                        minute: s.minute,
                        minute_requests: s.minute_requests,
                        week_micros: s.week_micros,
                        day_tokens: s.day_tokens,
                        week_tokens: s.week_tokens,
                        month_tokens: s.month_tokens,
                        minute_tokens: s.minute_tokens,
                    },
                ))
            })
            .collect(),
        day: msg.day,
        month: msg.month,
    }
}

/// Claims a lease request may carry.
pub const MAX_LEASE_CLAIMS: usize = 100_000;

pub fn lease_request_to_pb(r: &LeaseRequest) -> pb::LeaseRequest {
    pb::LeaseRequest {
        dataplane: r.dataplane.clone(),
        instance: r.instance,
        claims: r
            .claims
            .iter()
            .map(|c| pb::LeaseClaim {
                user_id: c.key.scope.value.clone(),
                scope: c.key.scope.kind.as_str().to_owned(),
                unit: match c.key.unit {
                    LeaseUnit::Micros => pb::LeaseUnit::Micros,
                    LeaseUnit::Requests => pb::LeaseUnit::Requests,
                    LeaseUnit::Tokens => pb::LeaseUnit::Tokens,
                    LeaseUnit::MinuteTokens => pb::LeaseUnit::MinuteTokens,
                }
                .into(),
                period: c.key.period,
                claim: c.claim,
                want: c.want,
            })
            .collect(),
    }
}

/// The rule a lease request breaks, if any: too many claims, an unknown unit or a bad user id.
pub fn lease_request_from_pb(msg: pb::LeaseRequest) -> Result<LeaseRequest, String> {
    if msg.claims.len() > MAX_LEASE_CLAIMS {
        return Err(format!("at most {MAX_LEASE_CLAIMS} claims"));
    }
    let claims = msg
        .claims
        .into_iter()
        .map(|c| {
            let unit = match pb::LeaseUnit::try_from(c.unit) {
                Ok(pb::LeaseUnit::Micros) => LeaseUnit::Micros,
                Ok(pb::LeaseUnit::Requests) => LeaseUnit::Requests,
                Ok(pb::LeaseUnit::Tokens) => LeaseUnit::Tokens,
                Ok(pb::LeaseUnit::MinuteTokens) => LeaseUnit::MinuteTokens,
                _ => return Err("claim: unknown unit".to_owned()),
            };
            let kind = scope_kind_from_pb(&c.scope).map_err(|e| format!("claim: {e}"))?;
            crate::budget::check_scope_value(kind, &c.user_id)
                .map_err(|e| format!("claim: user_id: {e}"))?;
            Ok(LeaseClaim {
                key: LeaseKey {
                    scope: BudgetScope::new(kind, c.user_id),
                    unit,
                    period: c.period,
                },
                claim: c.claim,
                want: c.want,
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(LeaseRequest {
        dataplane: msg.dataplane,
        instance: msg.instance,
        claims,
    })
}

pub fn lease_response_to_pb(r: LeaseResponse) -> pb::LeaseResponse {
    pb::LeaseResponse {
        granted: r.granted,
        ttl_ms: r.ttl_ms,
    }
}

pub fn lease_response_from_pb(msg: pb::LeaseResponse) -> LeaseResponse {
    LeaseResponse {
        granted: msg.granted,
        ttl_ms: msg.ttl_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip() {
        for ms in [0, 1, 999, 1_700_000_000_123, -1] {
            assert_eq!(timestamp_to_ms(&ms_to_timestamp(ms)), ms);
        }
    }

    #[test]
    fn a_batch_reads_back_as_written() {
        let record = RequestRecord {
            request_id: "r1".to_owned(),
            started_at_ms: 1_700_000_000_123,
            key_id: "key_1".into(),
            provider: "openai".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".to_owned(),
            session_id: "sess_1".parse().ok(),
            env: Some(Env::Staging),
            inferred: vec![
                Inferred {
                    rule: crate::signal::Rule::Reask,
                    answer: "01890a5d-ac96-774b-bcce-b302099a8057".parse().unwrap(),
                    edit_distance: None,
                },
                Inferred {
                    rule: crate::signal::Rule::HistoryEdit,
                    answer: "01890a5d-ac96-774b-bcce-b302099a8058".parse().unwrap(),
                    edit_distance: Some(12),
                },
            ],
            ..RequestRecord::default()
        };
        let got = decode_batch(&encode_batch(std::slice::from_ref(&record))).unwrap();
        assert_eq!(got, vec![Ok(record)]);
        assert!(decode_batch(b"\xff\xff").is_err());
    }

    /// Arbitrary records: every field set or not, strings of any length (empty ones too),
    /// numbers over their whole range, times before 1970.
    fn any_record() -> impl proptest::strategy::Strategy<Value = RequestRecord> {
        use proptest::prelude::*;
        use proptest::{collection::vec, option::of};
        let text = || ".{0,40}";
        let id = || "[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}";
        let usage = (
            of(text()),
            [of(any::<u64>()), of(any::<u64>()), of(any::<u64>())],
            [of(any::<u64>()), of(any::<u64>())],
            of(text()),
        )
            .prop_map(|(model, [i, o, c], [w, r], finish)| Usage {
                model,
                input_tokens: i,
                output_tokens: o,
                cached_input_tokens: c,
                cache_write_tokens: w,
                reasoning_tokens: r,
                finish_reason: finish,
                response_id: None,
            });
        let inferred = (0..4usize, id(), of(any::<u64>())).prop_map(|(rule, answer, d)| Inferred {
            rule: [
                crate::signal::Rule::ClientDisconnect,
                crate::signal::Rule::Reask,
                crate::signal::Rule::HistoryEdit,
                crate::signal::Rule::Continued,
            ][rule],
            answer: answer.parse().unwrap(),
            edit_distance: d,
        });
        let variant = of((text(), text(), of(text()))).prop_map(|v| {
            v.map(|(experiment, arm, requested_model)| Variant {
                experiment: experiment.into(),
                arm: arm.into(),
                requested_model,
            })
        });
        let head = (
            text(),
            any::<i64>(),
            (text(), text(), text(), text()),
            (
                of(text()),
                of(text()),
                of("sess_[a-z0-9]{1,20}"),
                0..4usize,
                of(text()),
            ),
        );
        let tail = (
            (any::<u16>(), any::<u64>(), of(any::<u64>()), any::<bool>()),
            (of(text()), any::<u64>(), usage, 0..4usize),
            (of(any::<u64>()), of(any::<u64>())),
            of((any::<[u8; 16]>(), any::<[u8; 8]>())),
            (vec(inferred, 0..3), variant),
        );
        (head, tail).prop_map(
            |(
                (
                    request_id,
                    started_at_ms,
                    (key, provider, method, path),
                    (model, agent, session, env, user),
                ),
                (
                    (status, latency_ms, ttfb_ms, streamed),
                    (error_code, response_bytes, usage, usage_status),
                    (cost_micros, budget_micros),
                    trace,
                    (inferred, variant),
                ),
            )| RequestRecord {
                request_id,
                started_at_ms,
                key_id: key.into(),
                provider: provider.into(),
                method: method.into(),
                path,
                model,
                agent,
                session_id: session.map(|s| s.parse().unwrap()),
                env: [
                    None,
                    Some(Env::Production),
                    Some(Env::Staging),
                    Some(Env::Development),
                ][env],
                user_id: user,
                status,
                latency_ms,
                ttfb_ms,
                streamed,
                error_code: error_code.map(Into::into),
                response_bytes,
                usage,
                usage_status: [
                    UsageStatus::Reported,
                    UsageStatus::Partial,
                    UsageStatus::Missing,
                    UsageStatus::NotApplicable,
                ][usage_status],
                cost_micros,
                budget_micros,
                trace: trace.map(|(trace_id, span_id)| TraceRef { trace_id, span_id }),
                inferred,
                variant,
            },
        )
    }

    proptest::proptest! {
        /// The batch written straight from the records is, byte for byte, what prost writes for
        /// the generated messages, so the controlplane reads it as before.
        #[test]
        fn a_batch_is_written_as_prost_writes_it(records in proptest::collection::vec(any_record(), 0..4)) {
            let generated = pb::IngestRequestsRequest {
                records: records.iter().map(record_to_pb).collect(),
            }
            .encode_to_vec();
            proptest::prop_assert_eq!(encode_batch(&records), generated);
        }
    }

    #[test]
    fn a_signal_crosses_the_wire_unchanged() {
        let signal = Signal {
            id: "req_1".to_owned(),
            received_at_ms: 1_700_000_000_123,
            session_id: "sess_1".parse().ok(),
            request_id: "01890a5d-ac96-774b-bcce-b302099a8057".parse().ok(),
            action: Action::Edited,
            edit_distance: Some(3),
            custom_label: Some("{\"a\":1}".to_owned()),
            key_id: "key_1".into(),
            idempotency_key: Some("idem".to_owned()),
            agent_hint: Some("agent".to_owned()),
        };
        assert_eq!(
            signal_from_pb(signal_to_pb(signal.clone())),
            Ok(signal.clone())
        );
        let bad = pb::Signal {
            session_id: "nope".to_owned(),
            action: "accepted".to_owned(),
            ..Default::default()
        };
        assert_eq!(signal_from_pb(bad), Err(BAD_SESSION_ID.to_owned()));
        let by_request = Signal {
            session_id: None,
            ..signal.clone()
        };
        assert_eq!(
            signal_from_pb(signal_to_pb(by_request.clone())),
            Ok(by_request)
        );
        let bad = pb::Signal {
            answer_request_id: Some("01890A5D-AC96-774B-BCCE-B302099A8057".to_owned()),
            action: "accepted".to_owned(),
            ..Default::default()
        };
        assert_eq!(
            signal_from_pb(bad),
            Err(crate::signal::REQUEST_ID_RULE.to_owned())
        );
    }

    #[test]
    fn lease_requests_round_trip_and_bad_ones_are_refused() {
        let req = LeaseRequest {
            dataplane: "dp-1".to_owned(),
            instance: 7,
            claims: vec![
                LeaseClaim {
                    key: LeaseKey {
                        scope: BudgetScope::user("alice"),
                        unit: LeaseUnit::Micros,
                        period: 20_779,
                    },
                    claim: 12,
                    want: 24_000,
                },
                LeaseClaim {
                    key: LeaseKey {
                        scope: BudgetScope::new(ScopeKind::Agent, "bob"),
                        unit: LeaseUnit::MinuteTokens,
                        period: 29_921_760,
                    },
                    claim: 0,
                    want: 4,
                },
            ],
        };
        assert_eq!(
            lease_request_from_pb(lease_request_to_pb(&req)),
            Ok(req.clone())
        );
        let mut bad = lease_request_to_pb(&req);
        bad.claims[1].unit = 0;
        assert_eq!(
            lease_request_from_pb(bad),
            Err("claim: unknown unit".to_owned())
        );
        let mut bad = lease_request_to_pb(&req);
        bad.claims[0].user_id = "a\u{7}".to_owned();
        assert!(lease_request_from_pb(bad).is_err());
        let resp = LeaseResponse {
            granted: vec![24_000, 0],
            ttl_ms: 5_000,
        };
        assert_eq!(
            lease_response_from_pb(lease_response_to_pb(resp.clone())),
            resp
        );
    }
}
