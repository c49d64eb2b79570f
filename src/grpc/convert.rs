//! Conversions between protobuf messages and the halves' own types.

use std::time::UNIX_EPOCH;

use prost_types::Timestamp;

use nm_types::record::RequestRecord;

use super::{link_pb, pb};

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

pub fn api_key(m: nm_controlplane::store::entity::api_key::Model) -> pb::ApiKey {
    pb::ApiKey {
        id: m.id,
        name: m.name,
        admin: m.admin,
        display_prefix: m.display_prefix,
        created_at: Some(ms_to_timestamp(m.created_at_ms)),
        revoked_at: m.revoked_at_ms.map(ms_to_timestamp),
    }
}

/// The record on the wire (and in the spool). The one mapping, with [`record_from_pb`].
pub fn record_to_pb(r: &RequestRecord) -> link_pb::RequestRecord {
    use nm_types::UsageStatus as S;
    let usage_status = match r.usage_status {
        S::Reported => link_pb::UsageStatus::Reported,
        S::Partial => link_pb::UsageStatus::Partial,
        S::Missing => link_pb::UsageStatus::Missing,
        S::NotApplicable => link_pb::UsageStatus::NotApplicable,
    };
    let u = &r.usage;
    link_pb::RequestRecord {
        request_id: r.request_id.clone(),
        started_at: Some(ms_to_timestamp(r.started_at_ms)),
        key_id: r.key_id.to_string(),
        provider: r.provider.to_string(),
        method: r.method.to_string(),
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
    }
}

/// Wire -> record: the session id and env are parsed here (the rule they break is the error);
/// every other rule is [`RequestRecord::check`]'s. A status beyond `u16` becomes one the check
/// refuses, never a wrapped-around valid one.
pub fn record_from_pb(r: link_pb::RequestRecord) -> Result<RequestRecord, &'static str> {
    use nm_types::UsageStatus as S;
    let usage_status = match r.usage_status() {
        link_pb::UsageStatus::Reported => S::Reported,
        link_pb::UsageStatus::Partial => S::Partial,
        link_pb::UsageStatus::Missing => S::Missing,
        link_pb::UsageStatus::NotApplicable | link_pb::UsageStatus::Unspecified => S::NotApplicable,
    };
    let session_id = r
        .session_id
        .map(|s| s.parse::<nm_types::SessionId>())
        .transpose()
        .map_err(|_| "session_id must look like sess_<id>")?;
    let env = r
        .env
        .map(|e| e.parse::<nm_types::Env>())
        .transpose()
        .map_err(|_| "env must be production, staging or development")?;
    let trace =
        match (&r.trace_id, &r.span_id) {
            (None, None) => None,
            (Some(t), Some(s)) => Some(nm_types::record::TraceRef::from_hex(t, s).ok_or(
                "trace_id and span_id must be 32 and 16 lower-case hex digits, not all zero",
            )?),
            _ => return Err("trace_id and span_id come together"),
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
        usage: nm_types::Usage {
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
    })
}

/// Dataplane signal -> controlplane signal (the link's signal type).
pub fn signal_to_stored(s: nm_dataplane::SignalSubmission) -> nm_controlplane::NewSignal {
    nm_controlplane::NewSignal {
        id: s.id,
        received_at_ms: s
            .received_at
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        session_id: s.session_id.to_string(),
        action: s.action,
        edit_distance: s.edit_distance,
        custom_label: s.custom_label,
        key_id: s.key_id.to_string(),
        idempotency_key: s.idempotency_key,
        agent_hint: s.agent_hint,
    }
}

/// Controlplane signal -> wire.
pub fn signal_to_pb(s: nm_controlplane::NewSignal) -> link_pb::Signal {
    link_pb::Signal {
        session_id: s.session_id,
        action: s.action.as_str().to_owned(),
        edit_distance: s.edit_distance,
        custom_label_json: s.custom_label,
        agent_hint: s.agent_hint,
        idempotency_key: s.idempotency_key,
        key_id: s.key_id,
        request_id: s.id,
        received_at: Some(ms_to_timestamp(s.received_at_ms)),
    }
}

/// Wire -> controlplane signal; a bad action is an invalid argument.
pub fn signal_from_pb(
    s: link_pb::Signal,
) -> Result<nm_controlplane::NewSignal, nm_controlplane::Error> {
    let action = s
        .action
        .parse::<nm_types::Action>()
        .map_err(|e| nm_controlplane::Error::InvalidArgument(e.to_string()))?;
    Ok(nm_controlplane::NewSignal {
        id: s.request_id,
        received_at_ms: s
            .received_at
            .as_ref()
            .map_or_else(|| chrono::Utc::now().timestamp_millis(), timestamp_to_ms),
        session_id: s.session_id,
        action,
        edit_distance: s.edit_distance,
        custom_label: s.custom_label_json,
        key_id: s.key_id,
        idempotency_key: s.idempotency_key,
        agent_hint: s.agent_hint,
    })
}

// === key snapshots and the budget feed ===

pub fn key_verifiers_to_pb(k: nm_types::KeyVerifiers) -> link_pb::KeySnapshot {
    link_pb::KeySnapshot {
        version: k.version,
        keys: k
            .keys
            .into_iter()
            .map(|k| link_pb::KeyEntry {
                id: k.id,
                verifier: k.verifier.to_vec(),
                admin: k.admin,
            })
            .collect(),
        write_problem: k.write_problem.unwrap_or_default(),
    }
}

/// Wire -> key verifiers; an entry whose verifier is not 32 bytes is left out (it could match
/// nothing).
pub fn key_verifiers_from_pb(k: link_pb::KeySnapshot) -> nm_types::KeyVerifiers {
    nm_types::KeyVerifiers {
        version: k.version,
        keys: k
            .keys
            .into_iter()
            .filter_map(|e| {
                Some(nm_types::VerifiedKey {
                    verifier: e.verifier.as_slice().try_into().ok()?,
                    id: e.id,
                    admin: e.admin,
                })
            })
            .collect(),
        write_problem: Some(k.write_problem).filter(|p| !p.is_empty()),
    }
}

fn rule_to_pb(user_id: Option<String>, r: &nm_types::budget::BudgetRule) -> link_pb::BudgetRule {
    link_pb::BudgetRule {
        user_id,
        limit_micros: r.limit_micros,
        monthly: r.period == nm_types::budget::Period::Month,
        requests_per_minute: r.requests_per_minute,
    }
}

fn rule_from_link_pb(r: &link_pb::BudgetRule) -> nm_types::budget::BudgetRule {
    nm_types::budget::BudgetRule {
        limit_micros: r.limit_micros,
        period: if r.monthly {
            nm_types::budget::Period::Month
        } else {
            nm_types::budget::Period::Day
        },
        requests_per_minute: r.requests_per_minute,
    }
}

pub fn feed_to_pb(f: nm_types::budget::Feed) -> link_pb::BudgetFeed {
    let mut rules: Vec<_> = f.default.iter().map(|r| rule_to_pb(None, r)).collect();
    rules.extend(
        f.overrides
            .iter()
            .map(|(u, r)| rule_to_pb(Some(u.clone()), r)),
    );
    link_pb::BudgetFeed {
        epoch: f.epoch,
        seq: f.seq,
        full: f.full,
        rules,
        spend: f
            .spend
            .into_iter()
            .map(|(user_id, s)| link_pb::UserSpend {
                user_id,
                day_micros: s.day_micros,
                month_micros: s.month_micros,
                minute: s.minute,
                minute_requests: s.minute_requests,
            })
            .collect(),
        day: f.day,
        month: f.month,
    }
}

pub fn feed_from_pb(msg: link_pb::BudgetFeed) -> nm_types::budget::Feed {
    let mut default = None;
    let mut overrides = Vec::new();
    for r in &msg.rules {
        let rule = rule_from_link_pb(r);
        match &r.user_id {
            None => default = Some(rule),
            Some(u) => overrides.push((u.clone(), rule)),
        }
    }
    nm_types::budget::Feed {
        epoch: msg.epoch,
        seq: msg.seq,
        full: msg.full,
        default,
        overrides,
        spend: msg
            .spend
            .into_iter()
            .map(|s| {
                (
                    s.user_id,
                    nm_types::budget::Spend {
                        day_micros: s.day_micros,
                        month_micros: s.month_micros,
                        minute: s.minute,
                        minute_requests: s.minute_requests,
                    },
                )
            })
            .collect(),
        day: msg.day,
        month: msg.month,
    }
}

pub fn action_counts(c: &nm_controlplane::signals::ActionCounts) -> pb::ActionCounts {
    use nm_types::Action::*;
    pb::ActionCounts {
        accepted: c.get(Accepted),
        edited: c.get(Edited),
        regenerated: c.get(Regenerated),
        abandoned: c.get(Abandoned),
        thumbs_up: c.get(ThumbsUp),
        thumbs_down: c.get(ThumbsDown),
        published: c.get(Published),
        sent: c.get(Sent),
    }
}

/// A proto time range -> (since, until) in milliseconds.
pub fn range_ms(r: Option<&pb::TimeRange>) -> (Option<i64>, Option<i64>) {
    r.map_or((None, None), |r| {
        (
            r.since.as_ref().map(timestamp_to_ms),
            r.until.as_ref().map(timestamp_to_ms),
        )
    })
}

// === budgets ===

pub fn budget_to_pb(b: &nm_controlplane::budgets::StoredBudget) -> pb::Budget {
    pb::Budget {
        user_id: b.user_id.clone(),
        limit_micros: b.rule.limit_micros,
        period: period_to_pb(b.rule.period).into(),
        requests_per_minute: b.rule.requests_per_minute,
        updated_at: Some(ms_to_timestamp(b.updated_at_ms)),
    }
}

pub fn period_to_pb(p: nm_types::budget::Period) -> pb::BudgetPeriod {
    match p {
        nm_types::budget::Period::Day => pb::BudgetPeriod::Day,
        nm_types::budget::Period::Month => pb::BudgetPeriod::Month,
    }
}

/// A wire period; unspecified means a day.
pub fn period_from_pb(p: pb::BudgetPeriod) -> nm_types::budget::Period {
    match p {
        pb::BudgetPeriod::Month => nm_types::budget::Period::Month,
        pb::BudgetPeriod::Day | pb::BudgetPeriod::Unspecified => nm_types::budget::Period::Day,
    }
}

// === usage ===

pub fn dimension_from_pb(
    d: pb::UsageDimension,
) -> Result<nm_controlplane::usage::Dimension, tonic::Status> {
    use nm_controlplane::usage::Dimension as D;
    Ok(match d {
        pb::UsageDimension::Agent => D::Agent,
        pb::UsageDimension::Session => D::Session,
        pb::UsageDimension::User => D::User,
        pb::UsageDimension::Env => D::Env,
        pb::UsageDimension::Provider => D::Provider,
        pb::UsageDimension::Model => D::Model,
        pb::UsageDimension::Day => D::Day,
        pb::UsageDimension::Unspecified => {
            return Err(tonic::Status::invalid_argument(
                "group_by: unspecified dimension",
            ));
        }
    })
}

fn usage_row_to_pb(r: nm_controlplane::usage::UsageRow) -> pb::UsageRow {
    pb::UsageRow {
        key: r
            .key
            .into_iter()
            .map(|value| pb::UsageKey { value })
            .collect(),
        requests: r.requests,
        input_tokens: r.input_tokens,
        output_tokens: r.output_tokens,
        cached_input_tokens: r.cached_input_tokens,
        reasoning_tokens: r.reasoning_tokens,
        cost_micros: r.cost_micros,
        unpriced_requests: r.unpriced_requests,
        unmetered_requests: r.unmetered_requests,
        errors: r.errors,
    }
}

pub fn usage_report_to_pb(r: nm_controlplane::usage::UsageReport) -> pb::UsageReport {
    pb::UsageReport {
        rows: r.rows.into_iter().map(usage_row_to_pb).collect(),
        truncated: r.truncated,
        total: Some(usage_row_to_pb(r.total)),
        unpriced_models: r
            .unpriced_models
            .into_iter()
            .map(|m| pb::UnpricedModel {
                provider: m.provider,
                model: m.model,
                requests: m.requests,
            })
            .collect(),
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
}
