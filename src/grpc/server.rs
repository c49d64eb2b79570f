//! The controlplane's gRPC server: the admin API (`nm.v1.Keys`, `Audit`, `Agents`, `Budgets`, `Usage`,
//! `Analytics` — in [`super::analytics`] —, `Experiments` — in [`super::experiments`] — and
//! `Status`, readiness without a key), the
//! internal link `nm.link.v1.Link` ([`super::link_server`], for dataplanes, behind the link
//! secret), `grpc.health.v1.Health` (NOT_SERVING while the database does not answer) and server
//! reflection; over TLS (and mTLS) when configured.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use nm_controlplane::agents::Scope;
use nm_controlplane::analytics::Evidence;
use nm_controlplane::audit::AuditQuery;
use nm_controlplane::signals::SignalFilter;
use nm_controlplane::{Controlplane, KeyChange, NewKey, Store, now_ms};
use nm_types::Env;
use nm_types::access::Role;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;
use tracing::{info, warn};

use crate::config::{Secret, ServerTls};

use super::analytics::AnalyticsService;
use super::experiments::ExperimentsService;
use super::link_pb::link_server::LinkServer;
use super::pb::agents_server::{Agents, AgentsServer};
use super::pb::alerts_server::AlertsServer;
use super::pb::analytics_server::AnalyticsServer;
use super::pb::audit_server::{Audit as AuditApi, AuditServer};
use super::pb::budgets_server::{Budgets as BudgetsApi, BudgetsServer};
use super::pb::experiments_server::ExperimentsServer;
use super::pb::keys_server::{Keys as KeysApi, KeysServer};
use super::pb::status_server::{Status as StatusApi, StatusServer};
use super::pb::usage_server::{Usage as UsageApi, UsageServer};
use super::{FILE_DESCRIPTOR_SET, convert, pb, require_admin, require_reader, status::to_status};

/// How often the key set is re-read from the database (changes by other replicas).
pub const KEY_REFRESH: Duration = Duration::from_secs(2);

/// How the server is exposed.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The link secret dataplanes must present; without it the link refuses every call.
    pub link_secret: Option<Secret>,
    /// TLS (and client CA for mTLS) of the gRPC port.
    pub tls: Option<ServerTls>,
    /// Server spans of the link's traced calls (tracing on).
    pub tracing: Option<crate::otel::link::LinkTracing>,
    /// The providers experiments' arms may name: the same provider settings as the
    /// dataplanes'.
    pub providers: Arc<nm_controlplane::experiments::Catalogue>,
}

// === impl Keys ===

#[derive(Debug, Clone)]
pub struct KeysService(pub Controlplane);

fn time_ms(t: Option<&prost_types::Timestamp>) -> Option<i64> {
    t.map(convert::timestamp_to_ms)
}

#[tonic::async_trait]
impl KeysApi for KeysService {
    async fn create_key(
        &self,
        req: Request<pb::CreateKeyRequest>,
    ) -> Result<Response<pb::CreateKeyResponse>, Status> {
        let admin = require_admin(&self.0.keys, &req)?;
        let r = req.into_inner();
        let role = match convert::role_from_pb(r.role()) {
            Some(role) => role,
            None if r.admin => Role::Admin,
            None => Role::Service,
        };
        let new = NewKey {
            role,
            scope: r
                .scope
                .map(convert::scope_from_pb)
                .transpose()?
                .unwrap_or_default(),
            labels: r.labels.into_iter().collect(),
            expires_at_ms: time_ms(r.expires_at.as_ref()),
            name: r.name,
        };
        let created = self
            .0
            .keys
            .create(&admin.id, new)
            .await
            .map_err(to_status)?;
        info!(by = %admin.id, key.id = %created.key.id, "key created over gRPC");
        Ok(Response::new(pb::CreateKeyResponse {
            key: Some(convert::api_key(created.key)),
            secret: created.secret,
        }))
    }

    async fn list_keys(
        &self,
        req: Request<pb::ListKeysRequest>,
    ) -> Result<Response<pb::ListKeysResponse>, Status> {
        require_reader(&self.0.keys, &req)?;
        let keys = self
            .0
            .keys
            .list(req.into_inner().include_revoked)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListKeysResponse {
            keys: keys.into_iter().map(convert::api_key).collect(),
        }))
    }

    async fn revoke_key(
        &self,
        req: Request<pb::RevokeKeyRequest>,
    ) -> Result<Response<pb::RevokeKeyResponse>, Status> {
        let admin = require_admin(&self.0.keys, &req)?;
        let id = req.into_inner().id;
        let key = self
            .0
            .keys
            .revoke(&admin.id, &id)
            .await
            .map_err(to_status)?;
        info!(by = %admin.id, key.id = %id, "key revoked over gRPC");
        Ok(Response::new(pb::RevokeKeyResponse {
            key: Some(convert::api_key(key)),
        }))
    }

    async fn rotate_key(
        &self,
        req: Request<pb::RotateKeyRequest>,
    ) -> Result<Response<pb::RotateKeyResponse>, Status> {
        let admin = require_admin(&self.0.keys, &req)?;
        let r = req.into_inner();
        let grace = Duration::from_secs(r.grace_seconds);
        let rotated = self
            .0
            .keys
            .rotate(&admin.id, &r.id, grace)
            .await
            .map_err(to_status)?;
        info!(by = %admin.id, key.id = %r.id, grace_secs = r.grace_seconds, "key rotated over gRPC");
        Ok(Response::new(pb::RotateKeyResponse {
            key: Some(convert::api_key(rotated.key)),
            secret: rotated.secret,
        }))
    }

    async fn update_key(
        &self,
        req: Request<pb::UpdateKeyRequest>,
    ) -> Result<Response<pb::UpdateKeyResponse>, Status> {
        let admin = require_admin(&self.0.keys, &req)?;
        let r = req.into_inner();
        if r.clear_expiry && r.expires_at.is_some() {
            return Err(Status::invalid_argument(
                "give expires_at or clear_expiry, not both",
            ));
        }
        let change = KeyChange {
            role: convert::role_from_pb(r.role()),
            scope: r.scope.map(convert::scope_from_pb).transpose()?,
            labels: r.labels.map(|l| l.labels.into_iter().collect()),
            expires_at_ms: if r.clear_expiry {
                Some(None)
            } else {
                time_ms(r.expires_at.as_ref()).map(Some)
            },
        };
        let key = self
            .0
            .keys
            .update(&admin.id, &r.id, change)
            .await
            .map_err(to_status)?;
        info!(by = %admin.id, key.id = %r.id, "key changed over gRPC");
        Ok(Response::new(pb::UpdateKeyResponse {
            key: Some(convert::api_key(key)),
        }))
    }
}

// === impl Audit ===

#[derive(Debug, Clone)]
pub struct AuditService(pub Controlplane);

#[tonic::async_trait]
impl AuditApi for AuditService {
    async fn list_audit_events(
        &self,
        req: Request<pb::ListAuditEventsRequest>,
    ) -> Result<Response<pb::ListAuditEventsResponse>, Status> {
        require_reader(&self.0.keys, &req)?;
        let r = req.into_inner();
        let (since_ms, until_ms) = convert::range_ms(r.range.as_ref());
        let page = self
            .0
            .audit
            .list(&AuditQuery {
                since_ms,
                until_ms,
                page_size: u64::from(r.page_size),
                page_token: Some(r.page_token).filter(|t| !t.is_empty()),
            })
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListAuditEventsResponse {
            events: page.events.into_iter().map(convert::audit_event).collect(),
            next_page_token: page.next_page_token.unwrap_or_default(),
        }))
    }
}

// === impl Budgets ===

#[derive(Debug, Clone)]
pub struct BudgetsService(pub Controlplane);

#[tonic::async_trait]
impl BudgetsApi for BudgetsService {
    async fn set_budget(
        &self,
        req: Request<pb::SetBudgetRequest>,
    ) -> Result<Response<pb::Budget>, Status> {
        let admin = require_admin(&self.0.keys, &req)?;
        let r = req.into_inner();
        let rule = nm_types::budget::BudgetRule {
            limit_micros: r.limit_micros,
            period: convert::period_from_pb(r.period()),
            requests_per_minute: r.requests_per_minute,
            limit_tokens: r.limit_tokens,
            tokens_per_minute: r.tokens_per_minute,
        };
        let subject = convert::subject_from_pb(&r.scope, &r.scope_value, r.user_id.as_deref())
            .map_err(Status::invalid_argument)?;
        let stored = self
            .0
            .budgets
            .set(&admin.id, subject, rule, now_ms())
            .await
            .map_err(to_status)?;
        info!(by = %admin.id, subject = ?stored.subject, ?rule, "budget set");
        Ok(Response::new(convert::budget_to_pb(&stored)))
    }

    async fn get_budget(
        &self,
        req: Request<pb::GetBudgetRequest>,
    ) -> Result<Response<pb::BudgetStatus>, Status> {
        require_reader(&self.0.keys, &req)?;
        let r = req.into_inner();
        let user = (!r.user_id.is_empty() || r.scope.is_empty()).then_some(r.user_id.as_str());
        let scope = match convert::subject_from_pb(&r.scope, &r.scope_value, user)
            .map_err(Status::invalid_argument)?
        {
            nm_types::budget::Subject::Scope(s) => s,
            _ => {
                return Err(Status::invalid_argument(
                    "show a scope's budget in force (a key, label, agent, model, env or end user); \
                     list shows the defaults",
                ));
            }
        };
        let s = self.0.budgets.status(&scope, now_ms()).map_err(to_status)?;
        let period = s
            .budget
            .as_ref()
            .map_or(nm_types::budget::Period::Day, |b| b.rule.period);
        let (scope_kind, scope_value) =
            convert::subject_to_pb(&nm_types::budget::Subject::Scope(s.scope.clone()));
        Ok(Response::new(pb::BudgetStatus {
            user_id: if s.scope.kind == nm_types::budget::ScopeKind::User {
                s.scope.value.clone()
            } else {
                String::new()
            },
            budget: s.budget.as_ref().map(convert::budget_to_pb),
            is_default: s.is_default,
            day_micros: s.day_micros,
            month_micros: s.month_micros,
            remaining_micros: s.remaining_micros,
            resets_at: s.resets_at_ms.map(convert::ms_to_timestamp),
            leased_micros: s.leased_micros,
            lease_holders: s.lease_holders,
            scope: scope_kind,
            scope_value,
            limits: s
                .limits
                .iter()
                .map(|l| pb::BudgetLimit {
                    limit: convert::limit_name(l.unit, period),
                    value: l.limit,
                    spent: l.spent,
                    remaining: l.remaining,
                    period_end: Some(convert::ms_to_timestamp(l.period_end_ms)),
                    leased: l.leased,
                    lease_holders: l.holders,
                })
                .collect(),
        }))
    }

    async fn list_budgets(
        &self,
        req: Request<pb::ListBudgetsRequest>,
    ) -> Result<Response<pb::ListBudgetsResponse>, Status> {
        use nm_types::budget::{ScopeKind, Subject};
        require_reader(&self.0.keys, &req)?;
        let all = self.0.budgets.list();
        Ok(Response::new(pb::ListBudgetsResponse {
            default_budget: all
                .iter()
                .find(|b| b.subject == Subject::DefaultUser)
                .map(convert::budget_to_pb),
            overrides: all
                .iter()
                .filter(|b| matches!(&b.subject, Subject::Scope(s) if s.kind == ScopeKind::User))
                .map(convert::budget_to_pb)
                .collect(),
            budgets: all.iter().map(convert::budget_to_pb).collect(),
        }))
    }

    async fn delete_budget(
        &self,
        req: Request<pb::DeleteBudgetRequest>,
    ) -> Result<Response<pb::DeleteBudgetResponse>, Status> {
        let admin = require_admin(&self.0.keys, &req)?;
        let r = req.into_inner();
        let subject = convert::subject_from_pb(&r.scope, &r.scope_value, r.user_id.as_deref())
            .map_err(Status::invalid_argument)?;
        let deleted = self
            .0
            .budgets
            .delete(&admin.id, &subject)
            .await
            .map_err(to_status)?;
        info!(by = %admin.id, ?subject, deleted, "budget deleted");
        Ok(Response::new(pb::DeleteBudgetResponse { deleted }))
    }
}

// === impl Usage ===

#[derive(Debug, Clone)]
pub struct UsageService(pub Controlplane);

#[tonic::async_trait]
impl UsageApi for UsageService {
    async fn get_usage(
        &self,
        req: Request<pb::GetUsageRequest>,
    ) -> Result<Response<pb::UsageReport>, Status> {
        require_reader(&self.0.keys, &req)?;
        let mut r = req.into_inner();
        let filter = r.filter.take();
        let (dims, filter) = usage_query(r.group_by(), r.range.as_ref(), filter)?;
        let report = self
            .0
            .usage
            .report(&dims, &filter, r.limit)
            .await
            .map_err(to_status)?;
        Ok(Response::new(convert::usage_report_to_pb(report)))
    }

    async fn get_latency(
        &self,
        req: Request<pb::GetLatencyRequest>,
    ) -> Result<Response<pb::LatencyReport>, Status> {
        require_reader(&self.0.keys, &req)?;
        let mut r = req.into_inner();
        let filter = r.filter.take();
        let (dims, filter) = usage_query(r.group_by(), r.range.as_ref(), filter)?;
        let report = self
            .0
            .usage
            .latency(&dims, &filter, r.limit)
            .await
            .map_err(to_status)?;
        Ok(Response::new(convert::latency_report_to_pb(report)))
    }
}

/// What a usage question (a report or latencies) asks: its groups, range and filter.
fn usage_query(
    group_by: impl Iterator<Item = pb::UsageDimension>,
    range: Option<&pb::TimeRange>,
    filter: Option<pb::UsageFilter>,
) -> Result<
    (
        Vec<nm_controlplane::usage::Dimension>,
        nm_controlplane::usage::UsageFilter,
    ),
    Status,
> {
    let dims = group_by
        .map(convert::dimension_from_pb)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((dims, usage_filter(range, filter.unwrap_or_default())))
}

fn usage_filter(
    range: Option<&pb::TimeRange>,
    f: pb::UsageFilter,
) -> nm_controlplane::usage::UsageFilter {
    let (since_ms, until_ms) = convert::range_ms(range);
    nm_controlplane::usage::UsageFilter {
        since_ms,
        until_ms,
        agent: f.agent,
        session_id: f.session_id,
        user_id: f.user_id,
        env: f.env,
        provider: f.provider,
        model: f.model,
    }
}

// === impl Agents ===

#[derive(Debug, Clone)]
pub struct AgentsService(pub Controlplane);

fn parse_env(env: Option<&str>) -> Result<Option<Env>, Status> {
    env.filter(|e| !e.is_empty())
        .map(|e| {
            e.parse::<Env>()
                .map_err(|err| Status::invalid_argument(format!("env: {err}")))
        })
        .transpose()
}

#[tonic::async_trait]
impl Agents for AgentsService {
    async fn list_agents(
        &self,
        req: Request<pb::ListAgentsRequest>,
    ) -> Result<Response<pb::ListAgentsResponse>, Status> {
        require_reader(&self.0.keys, &req)?;
        let r = req.into_inner();
        let env = parse_env(r.env.as_deref())?;
        let (since, until) = convert::range_ms(r.range.as_ref());
        let agents = self
            .0
            .signals
            .list_agents(env, since, until)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListAgentsResponse {
            agents: agents
                .into_iter()
                .map(|a| pb::AgentSummary {
                    unattributed: a.agent.is_none(),
                    agent: a.agent.unwrap_or_default(),
                    signals: a.signals,
                    sessions: a.sessions,
                    requests: a.requests,
                    last_activity: a.last_activity_ms.map(convert::ms_to_timestamp),
                })
                .collect(),
        }))
    }

    async fn get_agent_signals(
        &self,
        req: Request<pb::GetAgentSignalsRequest>,
    ) -> Result<Response<pb::AgentSignals>, Status> {
        require_reader(&self.0.keys, &req)?;
        let r = req.into_inner();
        if !r.unattributed && r.agent.trim().is_empty() {
            return Err(Status::invalid_argument(
                "agent is required (or set unattributed)",
            ));
        }
        let (since_ms, until_ms) = convert::range_ms(r.range.as_ref());
        let filter = SignalFilter {
            agent: (!r.unattributed).then(|| r.agent.trim().to_owned()),
            env: parse_env(r.env.as_deref())?,
            since_ms,
            until_ms,
        };
        let c = self
            .0
            .signals
            .agent_counts(&filter)
            .await
            .map_err(to_status)?;
        let by_source = self
            .0
            .agents
            .source_counts(&filter)
            .await
            .map_err(to_status)?;
        let (settings, agreement) = match &filter.agent {
            Some(agent) => {
                let s = self.0.agents.settings(agent).await.map_err(to_status)?;
                let a = self.0.agents.agreement(agent).await.map_err(to_status)?;
                (
                    Some(convert::agent_settings(agent, &s)),
                    convert::agreement(&a),
                )
            }
            None => (None, Vec::new()),
        };
        Ok(Response::new(pb::AgentSignals {
            by_source: convert::source_counts(&by_source),
            settings,
            agreement,
            agent: c.agent.unwrap_or_default(),
            total: c.total,
            by_action: Some(convert::action_counts(&c.by_action)),
            threshold: c.threshold,
            remaining: c.remaining,
            recommendations_unlocked: c.unlocked,
            progress: c.progress,
        }))
    }

    async fn get_session(
        &self,
        req: Request<pb::GetSessionRequest>,
    ) -> Result<Response<pb::SessionRecord>, Status> {
        require_reader(&self.0.keys, &req)?;
        let id = req.into_inner().session_id;
        let d = self.0.signals.session(&id).await.map_err(to_status)?;
        let by_source = self
            .0
            .agents
            .session_source_counts(&id)
            .await
            .map_err(to_status)?;
        let s = d.session;
        Ok(Response::new(pb::SessionRecord {
            by_source: convert::source_counts(&by_source),
            session_id: d.session_id,
            agent: s.as_ref().and_then(|s| s.agent.clone()),
            env: s.as_ref().and_then(|s| s.env.clone()),
            user_id: s.as_ref().and_then(|s| s.user_id.clone()),
            requests: s
                .as_ref()
                .map_or(0, |s| u64::try_from(s.request_count).unwrap_or(0)),
            first_seen: s
                .as_ref()
                .map(|s| convert::ms_to_timestamp(s.first_seen_ms)),
            last_seen: s.as_ref().map(|s| convert::ms_to_timestamp(s.last_seen_ms)),
            signals: d.signals.total(),
            by_action: Some(convert::action_counts(&d.signals)),
        }))
    }

    async fn get_agent_settings(
        &self,
        req: Request<pb::GetAgentSettingsRequest>,
    ) -> Result<Response<pb::AgentSettings>, Status> {
        require_reader(&self.0.keys, &req)?;
        let agent = req.into_inner().agent;
        let s = self.0.agents.settings(&agent).await.map_err(to_status)?;
        Ok(Response::new(convert::agent_settings(agent.trim(), &s)))
    }

    async fn set_agent_settings(
        &self,
        req: Request<pb::SetAgentSettingsRequest>,
    ) -> Result<Response<pb::AgentSettings>, Status> {
        let admin = require_admin(&self.0.keys, &req)?;
        let r = req.into_inner();
        let evidence = Evidence::parse(r.evidence.trim(), r.continued_counts).map_err(to_status)?;
        let s = self
            .0
            .agents
            .set_settings(&admin.id, &r.agent, evidence)
            .await
            .map_err(to_status)?;
        tracing::info!(
            by = %admin.id,
            nm.agent = %r.agent.trim(),
            evidence = evidence.stored(),
            continued_counts = evidence.continued,
            "agent settings changed"
        );
        Ok(Response::new(convert::agent_settings(r.agent.trim(), &s)))
    }

    async fn list_signals(
        &self,
        req: Request<pb::ListSignalsRequest>,
    ) -> Result<Response<pb::ListSignalsResponse>, Status> {
        require_reader(&self.0.keys, &req)?;
        let r = req.into_inner();
        let scope = match (r.agent.trim(), r.session_id.trim()) {
            (agent, "") if !agent.is_empty() => Scope::Agent(agent.to_owned()),
            ("", session) if !session.is_empty() => Scope::Session(session.to_owned()),
            _ => {
                return Err(Status::invalid_argument(
                    "name exactly one of agent and session_id",
                ));
            }
        };
        let page = self
            .0
            .agents
            .list_signals(&scope, r.source.as_deref(), r.page_size, &r.page_token)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListSignalsResponse {
            signals: page
                .signals
                .into_iter()
                .map(convert::stored_signal)
                .collect(),
            next_page_token: page.next_page_token.unwrap_or_default(),
        }))
    }
}

// === impl Status ===

#[derive(Debug, Clone)]
pub struct StatusService(pub Controlplane);

#[tonic::async_trait]
impl StatusApi for StatusService {
    async fn get_readiness(
        &self,
        _req: Request<pb::GetReadinessRequest>,
    ) -> Result<Response<pb::Readiness>, Status> {
        let store = &self.0.store;
        let reachable = store.ping().await;
        let current = match &reachable {
            Ok(()) => store.migrations_current().await,
            Err(_) => Ok(false),
        };
        let write_problem = store.writability().problem();
        // The database's own text stays in the log.
        let reason = match (&reachable, &current, write_problem) {
            (Err(e), _, _) => {
                warn!(error = %e, "readiness: database unreachable");
                "database unreachable".to_owned()
            }
            (Ok(()), Err(e), _) => {
                warn!(error = %e, "readiness: cannot read the migrations");
                "cannot read the database's migrations".to_owned()
            }
            (Ok(()), Ok(false), _) => "database migrations are not current".to_owned(),
            (Ok(()), Ok(true), Some(problem)) => problem.to_owned(),
            (Ok(()), Ok(true), None) => String::new(),
        };
        let database_reachable = reachable.is_ok();
        let migrations_current = matches!(current, Ok(true));
        let database_writable = write_problem.is_none();
        Ok(Response::new(pb::Readiness {
            ready: database_reachable && migrations_current && database_writable,
            database_reachable,
            migrations_current,
            database_writable,
            database: store.system().to_owned(),
            version: crate::VERSION.to_owned(),
            reason,
        }))
    }
}

/// Serves the controlplane on `listener` until `shutdown` completes.
pub async fn serve(
    cp: Controlplane,
    options: Options,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<KeysServer<KeysService>>().await;
    reporter.set_serving::<AuditServer<AuditService>>().await;
    reporter
        .set_serving::<AlertsServer<super::alerts::AlertsService>>()
        .await;
    reporter.set_serving::<AgentsServer<AgentsService>>().await;
    reporter
        .set_serving::<AnalyticsServer<AnalyticsService>>()
        .await;
    reporter.set_serving::<StatusServer<StatusService>>().await;
    reporter
        .set_serving::<ExperimentsServer<ExperimentsService>>()
        .await;
    reporter
        .set_serving::<LinkServer<super::link_server::LinkService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;

    // The first answer already follows the start-up write check: a database that refused it is
    // NOT_SERVING before the readiness task has looked (a probe racing it saw SERVING).
    if cp.store.writability().problem().is_some() {
        reporter
            .set_service_status("", ServingStatus::NotServing)
            .await;
    }
    let refresher = cp.keys.spawn_refresher(KEY_REFRESH);
    let readiness = spawn_readiness(cp.store.clone(), Arc::new(reporter));

    // `Server::tcp_nodelay` does not apply to an incoming stream of our own: the accepted
    // sockets get the option from `TcpIncoming`. Without it an answer's last frame can wait for
    // the client's delayed acknowledgement (40 ms).
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &options.tls {
        let mut config =
            ServerTlsConfig::new().identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem));
        if let Some(ca) = &tls.client_ca_pem {
            config = config.client_ca_root(Certificate::from_pem(ca));
        }
        builder = builder.tls_config(config)?;
    }
    let result = builder
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .add_service(health)
        .add_service(reflection)
        .add_service(KeysServer::new(KeysService(cp.clone())))
        .add_service(AuditServer::new(AuditService(cp.clone())))
        .add_service(super::pb::users_server::UsersServer::new(
            super::users::UsersService(cp.clone()),
        ))
        .add_service(AlertsServer::new(super::alerts::AlertsService(cp.clone())))
        .add_service(super::link_server::service(
            cp.clone(),
            options.link_secret,
            options.tracing,
        ))
        .add_service(AgentsServer::new(AgentsService(cp.clone())))
        .add_service(StatusServer::new(StatusService(cp.clone())))
        .add_service(BudgetsServer::new(BudgetsService(cp.clone())))
        .add_service(UsageServer::new(UsageService(cp.clone())))
        .add_service(ExperimentsServer::new(ExperimentsService {
            cp: cp.clone(),
            providers: options.providers,
        }))
        .add_service(AnalyticsServer::new(AnalyticsService {
            analytics: nm_controlplane::analytics::Analytics::new(cp.store.clone())
                .with_alerts(cp.alerts.clone()),
            cp: cp.clone(),
        }))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    refresher.abort();
    readiness.abort();
    result.map_err(Into::into)
}

/// Keeps `grpc.health.v1` truthful: the whole server is NOT_SERVING while the database does not
/// answer or does not take writes (the store's write probe and every write transaction keep the
/// latter current; a change is reported at once, the ping every 5 s).
fn spawn_readiness(
    store: Store,
    reporter: Arc<tonic_health::server::HealthReporter>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last = None;
        let mut writable = store.writability().subscribe();
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        let mut reachable = true;
        loop {
            tokio::select! {
                _ = tick.tick() => reachable = store.ping().await.is_ok(),
                changed = writable.changed() => if changed.is_err() { return },
            }
            let problem = *writable.borrow_and_update();
            let ok = reachable && problem.is_none();
            if last != Some(ok) {
                match (ok, reachable) {
                    (true, _) => info!("database reachable and writable; gRPC health is SERVING"),
                    (false, false) => warn!("database unreachable; gRPC health is NOT_SERVING"),
                    (false, true) => warn!(
                        reason = problem.unwrap_or_default(),
                        "database does not take writes; gRPC health is NOT_SERVING"
                    ),
                }
                let status = if ok {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                reporter.set_service_status("", status).await;
                last = Some(ok);
            }
        }
    })
}
