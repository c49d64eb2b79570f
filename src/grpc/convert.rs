//! Conversions between the admin API's protobuf messages and the controlplane's types. (The
//! link's mapping is `nm_types::link`, shared with the dataplane.)

use super::pb;

pub use nm_types::link::{ms_to_timestamp, timestamp_to_ms};

pub fn api_key(m: nm_controlplane::store::entity::api_key::Model) -> pb::ApiKey {
    use nm_controlplane::keys::{parse_labels, parse_role, parse_scope};
    let role = parse_role(&m.role).map_or(pb::KeyRole::Unspecified, role_to_pb);
    let scope = parse_scope(m.scope_json.as_deref())
        .ok()
        .filter(|s| !s.is_unrestricted())
        .map(|s| scope_to_pb(&s));
    // The replaced secret's end of grace, while it runs.
    let now = nm_controlplane::now_ms();
    pb::ApiKey {
        id: m.id,
        name: m.name,
        admin: m.role == "admin",
        display_prefix: m.display_prefix,
        created_at: Some(ms_to_timestamp(m.created_at_ms)),
        revoked_at: m.revoked_at_ms.map(ms_to_timestamp),
        role: role as i32,
        scope,
        labels: parse_labels(m.labels_json.as_deref()).into_iter().collect(),
        expires_at: m.expires_at_ms.map(ms_to_timestamp),
        last_used_at: m.last_used_at_ms.map(ms_to_timestamp),
        rotated_at: m.rotated_at_ms.map(ms_to_timestamp),
        previous_secret_valid_until: m
            .previous_valid_until_ms
            .filter(|t| *t > now)
            .map(ms_to_timestamp),
    }
}

pub fn role_to_pb(r: nm_types::access::Role) -> pb::KeyRole {
    use nm_types::access::Role;
    match r {
        Role::Admin => pb::KeyRole::Admin,
        Role::Viewer => pb::KeyRole::Viewer,
        Role::Service => pb::KeyRole::Service,
    }
}

/// `None` for unspecified (the caller decides the default).
pub fn role_from_pb(r: pb::KeyRole) -> Option<nm_types::access::Role> {
    use nm_types::access::Role;
    match r {
        pb::KeyRole::Unspecified => None,
        pb::KeyRole::Admin => Some(Role::Admin),
        pb::KeyRole::Viewer => Some(Role::Viewer),
        pb::KeyRole::Service => Some(Role::Service),
    }
}

pub fn scope_to_pb(s: &nm_types::access::Scope) -> pb::KeyScope {
    pb::KeyScope {
        providers: s.providers.clone(),
        models: s.models.clone(),
        agents: s.agents.clone(),
        envs: s.envs.iter().map(|e| e.as_str().to_owned()).collect(),
    }
}

pub fn scope_from_pb(s: pb::KeyScope) -> Result<nm_types::access::Scope, tonic::Status> {
    Ok(nm_types::access::Scope {
        envs: s
            .envs
            .iter()
            .map(|e| {
                e.trim()
                    .parse::<nm_types::Env>()
                    .map_err(|err| tonic::Status::invalid_argument(format!("scope.envs: {err}")))
            })
            .collect::<Result<_, _>>()?,
        providers: s.providers,
        models: s.models,
        agents: s.agents,
    })
}

pub fn audit_event(e: nm_controlplane::store::entity::audit_event::Model) -> pb::AuditEvent {
    pb::AuditEvent {
        id: e.id,
        at: Some(ms_to_timestamp(e.at_ms)),
        actor_key_id: e.actor_key_id,
        action: e.action,
        target: e.target,
        before_json: e.before_json.unwrap_or_default(),
        after_json: e.after_json.unwrap_or_default(),
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

/// Signal counts by source and rule.
pub fn source_counts(c: &[nm_controlplane::agents::SourceCount]) -> Vec<pb::SourceCounts> {
    c.iter()
        .map(|c| pb::SourceCounts {
            source: c.source.clone(),
            rule: c.rule.map(|r| r.name().to_owned()),
            total: c.total,
            by_action: Some(action_counts(&c.by_action)),
        })
        .collect()
}

/// An agent's settings.
pub fn agent_settings(
    agent: &str,
    s: &nm_controlplane::analytics::evidence::Setting,
) -> pb::AgentSettings {
    pb::AgentSettings {
        agent: agent.to_owned(),
        evidence: s.evidence.stored().to_owned(),
        continued_counts: s.evidence.continued,
        updated_at: s.updated_at_ms.map(ms_to_timestamp),
    }
}

/// An agent's agreement table.
pub fn agreement(cells: &[nm_controlplane::agents::AgreementCell]) -> Vec<pb::AgreementCell> {
    cells
        .iter()
        .map(|c| pb::AgreementCell {
            explicit_outcome: c.explicit.to_owned(),
            implicit_outcome: c.implicit.to_owned(),
            units: c.units,
        })
        .collect()
}

/// A stored signal.
pub fn stored_signal(s: nm_controlplane::agents::StoredSignal) -> pb::StoredSignal {
    pb::StoredSignal {
        id: s.id,
        source: s.source,
        rule: s.rule,
        request_id: s.request_id,
        action: s.action,
        edit_distance: s.edit_distance,
        received_at: Some(ms_to_timestamp(s.received_at_ms)),
        session_id: s.session_id,
        agent: s.agent,
        env: s.env,
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
    use nm_types::budget::{ScopeKind, Subject};
    let (scope, scope_value) = subject_to_pb(&b.subject);
    pb::Budget {
        user_id: match &b.subject {
            Subject::Scope(s) if s.kind == ScopeKind::User => Some(s.value.clone()),
            _ => None,
        },
        limit_micros: b.rule.limit_micros,
        period: period_to_pb(b.rule.period).into(),
        requests_per_minute: b.rule.requests_per_minute,
        updated_at: Some(ms_to_timestamp(b.updated_at_ms)),
        scope,
        scope_value,
        limit_tokens: b.rule.limit_tokens,
        tokens_per_minute: b.rule.tokens_per_minute,
    }
}

/// `(scope, scope_value)` of a budget's subject.
pub fn subject_to_pb(s: &nm_types::budget::Subject) -> (String, String) {
    use nm_types::budget::Subject;
    match s {
        Subject::DefaultUser => ("default".to_owned(), String::new()),
        Subject::DefaultKey => ("default-key".to_owned(), String::new()),
        Subject::Scope(s) => (s.kind.as_str().to_owned(), s.value.clone()),
    }
}

/// The subject a request names: by `scope` and `scope_value`, else (no scope) by `user_id`.
pub fn subject_from_pb(
    scope: &str,
    scope_value: &str,
    user_id: Option<&str>,
) -> Result<nm_types::budget::Subject, String> {
    use nm_types::budget::{Scope, ScopeKind, Subject};
    match (scope, user_id) {
        ("", Some(u)) => Ok(Subject::Scope(Scope::user(u))),
        ("" | "default", _) => Ok(Subject::DefaultUser),
        ("default-key", _) => Ok(Subject::DefaultKey),
        (kind, _) => Ok(Subject::Scope(Scope::new(
            kind.parse::<ScopeKind>()?,
            scope_value,
        ))),
    }
}

pub fn period_to_pb(p: nm_types::budget::Period) -> pb::BudgetPeriod {
    match p {
        nm_types::budget::Period::Day => pb::BudgetPeriod::Day,
        nm_types::budget::Period::Week => pb::BudgetPeriod::Week,
        nm_types::budget::Period::Month => pb::BudgetPeriod::Month,
    }
}

/// A wire period; unspecified means a day.
pub fn period_from_pb(p: pb::BudgetPeriod) -> nm_types::budget::Period {
    match p {
        pb::BudgetPeriod::Month => nm_types::budget::Period::Month,
        pb::BudgetPeriod::Week => nm_types::budget::Period::Week,
        pb::BudgetPeriod::Day | pb::BudgetPeriod::Unspecified => nm_types::budget::Period::Day,
    }
}

/// The name of one limit of a budget, as `BudgetLimit.limit` and the CLI give it.
pub fn limit_name(unit: nm_types::budget::LeaseUnit, period: nm_types::budget::Period) -> String {
    use nm_types::budget::LeaseUnit;
    match unit {
        LeaseUnit::Micros => format!("usd_per_{}", period.as_str()),
        LeaseUnit::Tokens => format!("tokens_per_{}", period.as_str()),
        LeaseUnit::Requests => "rpm".to_owned(),
        LeaseUnit::MinuteTokens => "tpm".to_owned(),
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
        pb::UsageDimension::Key => D::Key,
        pb::UsageDimension::Week => D::Week,
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

fn percentiles_to_pb(p: nm_controlplane::usage::latency::Percentiles) -> pb::LatencyPercentiles {
    pb::LatencyPercentiles {
        count: p.count,
        p50_ms: p.p50_ms,
        p90_ms: p.p90_ms,
        p99_ms: p.p99_ms,
    }
}

pub fn latency_report_to_pb(
    r: nm_controlplane::usage::latency::LatencyReport,
) -> pb::LatencyReport {
    pb::LatencyReport {
        rows: r
            .rows
            .into_iter()
            .map(|row| pb::LatencyRow {
                key: row
                    .key
                    .into_iter()
                    .map(|value| pb::UsageKey { value })
                    .collect(),
                requests: row.requests,
                latency: Some(percentiles_to_pb(row.latency)),
                ttfb: Some(percentiles_to_pb(row.ttfb)),
            })
            .collect(),
        truncated: r.truncated,
    }
}
