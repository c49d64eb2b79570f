//! Proxied-request records: validated, stored once per request id, folded into the `sessions`
//! table (so the controlplane knows which agent, env and end user each session belongs to) and
//! into the `user_spend` rollup that budgets read — all in the batch's one transaction.

use std::collections::HashSet;

use nm_types::{Env, SessionId, parse_agent, parse_user};
use sea_orm::sea_query::{Expr, OnConflict};
use sea_orm::{ColumnTrait, DatabaseTransaction, EntityTrait, QueryFilter, Set, TryInsertResult};
use tracing::warn;

use crate::budgets::{Budgets, SpendItem, add_to_rollup};
use crate::error::Result;
use crate::sql::insert_chunks;
use crate::store::Store;
use crate::store::entity::{request, session, signal};

/// One proxied request, as a dataplane reports it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestRecord {
    pub request_id: String,
    pub started_at_ms: i64,
    pub key_id: String,
    pub provider: String,
    pub method: String,
    pub path: String,
    pub model: Option<String>,
    pub agent: Option<String>,
    pub session_id: Option<String>,
    pub env: Option<String>,
    pub user_id: Option<String>,
    pub status: u16,
    pub latency_ms: u64,
    pub ttfb_ms: Option<u64>,
    pub streamed: bool,
    pub error_code: Option<String>,
    pub response_bytes: u64,
    pub usage: RecordUsage,
    /// What the request counted against its end user's budget (None: not budgeted).
    pub budget_micros: Option<u64>,
}

/// Token usage and cost of one request (None: the provider did not say).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordUsage {
    pub answered_model: Option<String>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cached_input_tokens: Option<u64>,
    pub cache_write_tokens: Option<u64>,
    pub reasoning_tokens: Option<u64>,
    pub finish_reason: Option<String>,
    pub cost_micros: Option<u64>,
    pub status: UsageStatus,
}

pub use nm_types::UsageStatus;

/// What [`Records::ingest`] did with a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IngestOutcome {
    /// Records stored for the first time.
    pub stored: u32,
    /// Records already stored (a resent batch).
    pub duplicates: u32,
    /// Records refused for breaking a rule (logged); a retry would not help them.
    pub rejected: u32,
    /// The budget feed position that includes this batch's spend.
    pub epoch: u64,
    pub seq: u64,
}

#[derive(Debug, Clone)]
pub struct Records {
    store: Store,
    budgets: Budgets,
}

impl Records {
    pub fn new(store: Store, budgets: Budgets) -> Self {
        Self { store, budgets }
    }

    /// Stores a batch in one transaction. A record whose request id is already stored is skipped,
    /// so a dataplane may resend a batch it is unsure about.
    #[tracing::instrument(skip_all, fields(batch = batch.len()))]
    pub async fn ingest(&self, batch: Vec<RequestRecord>) -> Result<IngestOutcome> {
        let mut outcome = IngestOutcome::default();
        let mut valid = Vec::with_capacity(batch.len());
        for record in batch {
            match validate(&record) {
                Ok(()) => valid.push(record),
                Err(why) => {
                    warn!(request_id = %record.request_id, why, "request record rejected");
                    outcome.rejected += 1;
                }
            }
        }
        let txn = self.store.begin_write().await?;
        // Multi-row inserts; RETURNING names the rows that were new (not resent).
        let mut new_ids: HashSet<String> = HashSet::with_capacity(valid.len());
        let mut rest = valid.as_slice();
        for size in insert_chunks(valid.len()) {
            let (chunk, tail) = rest.split_at(size);
            rest = tail;
            let inserted = request::Entity::insert_many(chunk.iter().map(to_active))
                .on_conflict_do_nothing()
                .exec_with_returning_keys(&txn)
                .await?;
            if let TryInsertResult::Inserted(ids) = inserted {
                new_ids.extend(ids);
            }
        }
        let fresh: Vec<&RequestRecord> = valid
            .iter()
            .filter(|r| new_ids.contains(&r.request_id))
            .collect();
        outcome.stored = u32::try_from(fresh.len()).unwrap_or(u32::MAX);
        outcome.duplicates = u32::try_from(valid.len() - fresh.len()).unwrap_or(u32::MAX);
        for (session_id, seen) in sessions_of(&fresh) {
            upsert_session(&txn, &session_id, &seen).await?;
            attribute_signals(&txn, &session_id).await?;
        }
        let spend: Vec<SpendItem> = fresh
            .iter()
            .filter_map(|r| {
                Some(SpendItem {
                    user_id: r.user_id.clone()?,
                    started_at_ms: r.started_at_ms,
                    micros: r.budget_micros?,
                })
            })
            .collect();
        add_to_rollup(&txn, &spend).await?;
        txn.commit().await?;
        (outcome.epoch, outcome.seq) = self.budgets.apply(&spend, crate::now_ms());
        Ok(outcome)
    }
}

/// What one batch says about a session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct SessionSeen {
    agent: Option<String>,
    env: Option<String>,
    user_id: Option<String>,
    first_ms: i64,
    last_ms: i64,
    requests: i64,
}

/// Folds new records into one [`SessionSeen`] per session, in first-seen order.
fn sessions_of(records: &[&RequestRecord]) -> Vec<(String, SessionSeen)> {
    let mut out: Vec<(String, SessionSeen)> = Vec::new();
    for r in records {
        let Some(id) = &r.session_id else { continue };
        let i = match out.iter().position(|(s, _)| s == id) {
            Some(i) => i,
            None => {
                let seen = SessionSeen {
                    first_ms: r.started_at_ms,
                    last_ms: r.started_at_ms,
                    ..Default::default()
                };
                out.push((id.clone(), seen));
                out.len() - 1
            }
        };
        let seen = &mut out[i].1;
        seen.agent = seen.agent.take().or_else(|| r.agent.clone());
        seen.env = seen.env.take().or_else(|| r.env.clone());
        seen.user_id = seen.user_id.take().or_else(|| r.user_id.clone());
        seen.first_ms = seen.first_ms.min(r.started_at_ms);
        seen.last_ms = seen.last_ms.max(r.started_at_ms);
        seen.requests += 1;
    }
    out
}

/// Adds a batch's requests to their session: the first agent, env and user seen stick, activity
/// times widen, the request count grows.
async fn upsert_session<C: sea_orm::ConnectionTrait>(
    db: &C,
    session_id: &str,
    seen: &SessionSeen,
) -> Result<()> {
    let row = session::ActiveModel {
        session_id: Set(session_id.to_owned()),
        agent: Set(seen.agent.clone()),
        env: Set(seen.env.clone()),
        user_id: Set(seen.user_id.clone()),
        first_seen_ms: Set(seen.first_ms),
        last_seen_ms: Set(seen.last_ms),
        request_count: Set(seen.requests),
    };
    let on_conflict = OnConflict::column(session::Column::SessionId)
        .value(session::Column::Agent, Expr::cust(r#"COALESCE("sessions"."agent", "excluded"."agent")"#))
        .value(session::Column::Env, Expr::cust(r#"COALESCE("sessions"."env", "excluded"."env")"#))
        .value(session::Column::UserId, Expr::cust(r#"COALESCE("sessions"."user_id", "excluded"."user_id")"#))
        .value(
            session::Column::FirstSeenMs,
            Expr::cust(r#"CASE WHEN "excluded"."first_seen_ms" < "sessions"."first_seen_ms" THEN "excluded"."first_seen_ms" ELSE "sessions"."first_seen_ms" END"#),
        )
        .value(
            session::Column::LastSeenMs,
            Expr::cust(r#"CASE WHEN "excluded"."last_seen_ms" > "sessions"."last_seen_ms" THEN "excluded"."last_seen_ms" ELSE "sessions"."last_seen_ms" END"#),
        )
        .value(
            session::Column::RequestCount,
            Expr::cust(r#""sessions"."request_count" + "excluded"."request_count""#),
        )
        .to_owned();
    session::Entity::insert(row)
        .on_conflict(on_conflict)
        .exec_without_returning(db)
        .await?;
    Ok(())
}

/// Gives signals that arrived before their session was known the session's agent, env and user.
async fn attribute_signals(db: &DatabaseTransaction, session_id: &str) -> Result<()> {
    let Some(s) = session::Entity::find_by_id(session_id.to_owned())
        .one(db)
        .await?
    else {
        return Ok(());
    };
    if s.agent.is_none() && s.env.is_none() && s.user_id.is_none() {
        return Ok(());
    }
    let mut update = signal::Entity::update_many()
        .col_expr(signal::Column::Env, Expr::value(s.env.clone()))
        .col_expr(signal::Column::UserId, Expr::value(s.user_id.clone()))
        .filter(signal::Column::SessionId.eq(session_id))
        .filter(signal::Column::AttributedBySession.eq(false));
    if let Some(agent) = s.agent {
        update = update
            .col_expr(signal::Column::Agent, Expr::value(agent))
            .col_expr(signal::Column::AttributedBySession, Expr::value(true));
    }
    update.exec(db).await?;
    Ok(())
}

fn validate(r: &RequestRecord) -> Result<(), &'static str> {
    if r.request_id.is_empty() || r.request_id.len() > 64 {
        return Err("request_id must be 1 to 64 characters");
    }
    if r.provider.is_empty() || r.method.is_empty() {
        return Err("provider and method are required");
    }
    if let Some(s) = &r.session_id {
        s.parse::<SessionId>()
            .map_err(|_| "session_id must look like sess_<id>")?;
    }
    if let Some(e) = &r.env {
        e.parse::<Env>()
            .map_err(|_| "env must be production, staging or development")?;
    }
    if let Some(a) = &r.agent {
        parse_agent(a).map_err(|_| "agent must be 1 to 128 printable characters")?;
    }
    if let Some(u) = &r.user_id {
        parse_user(u).map_err(|_| "user_id must be 1 to 256 printable characters")?;
    }
    Ok(())
}

fn to_active(r: &RequestRecord) -> request::ActiveModel {
    request::ActiveModel {
        request_id: Set(r.request_id.clone()),
        started_at_ms: Set(r.started_at_ms),
        key_id: Set(r.key_id.clone()),
        provider: Set(r.provider.clone()),
        method: Set(r.method.clone()),
        path: Set(r.path.clone()),
        model: Set(r.model.clone()),
        agent: Set(r.agent.clone()),
        session_id: Set(r.session_id.clone()),
        env: Set(r.env.clone()),
        user_id: Set(r.user_id.clone()),
        status: Set(i32::from(r.status)),
        latency_ms: Set(saturating_i64(r.latency_ms)),
        ttfb_ms: Set(r.ttfb_ms.map(saturating_i64)),
        streamed: Set(r.streamed),
        error_code: Set(r.error_code.clone()),
        response_bytes: Set(saturating_i64(r.response_bytes)),
        answered_model: Set(r.usage.answered_model.clone()),
        input_tokens: Set(r.usage.input_tokens.map(saturating_i64)),
        output_tokens: Set(r.usage.output_tokens.map(saturating_i64)),
        cached_input_tokens: Set(r.usage.cached_input_tokens.map(saturating_i64)),
        cache_write_tokens: Set(r.usage.cache_write_tokens.map(saturating_i64)),
        reasoning_tokens: Set(r.usage.reasoning_tokens.map(saturating_i64)),
        finish_reason: Set(r.usage.finish_reason.clone()),
        cost_micros: Set(r.usage.cost_micros.map(saturating_i64)),
        usage_status: Set(r.usage.status.as_str().to_owned()),
    }
}

fn saturating_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, session: Option<&str>, at: i64) -> RequestRecord {
        RequestRecord {
            request_id: id.to_owned(),
            started_at_ms: at,
            key_id: "key_1".to_owned(),
            provider: "openai".to_owned(),
            method: "POST".to_owned(),
            path: "/v1/chat/completions".to_owned(),
            session_id: session.map(str::to_owned),
            agent: Some("a".to_owned()),
            status: 200,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_resent_batch_is_stored_once_and_sessions_count_once() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let url = format!("sqlite://{}/r.db?mode=rwc", dir.path().display());
        let store = Store::connect(&url).await.unwrap_or_else(|e| panic!("{e}"));
        let budgets = Budgets::load(store.clone(), 0).await.unwrap();
        let records = Records::new(store.clone(), budgets);
        let mut batch: Vec<_> = (0..1200)
            .map(|i| record(&format!("r{i}"), Some(&format!("sess_{}", i % 3)), 1000 + i))
            .collect();
        batch.push(record("bad", Some("not-a-session"), 5));
        let first = records
            .ingest(batch.clone())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            first,
            IngestOutcome {
                stored: 1200,
                duplicates: 0,
                rejected: 1,
                epoch: first.epoch,
                seq: 1,
            }
        );
        let again = records
            .ingest(batch)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            again,
            IngestOutcome {
                stored: 0,
                duplicates: 1200,
                rejected: 1,
                epoch: first.epoch,
                seq: 2,
            }
        );
        let s = session::Entity::find_by_id("sess_0".to_owned())
            .one(store.conn())
            .await
            .ok()
            .flatten();
        let s = s.unwrap_or_else(|| panic!("session missing"));
        assert_eq!(
            (
                s.request_count,
                s.first_seen_ms,
                s.last_seen_ms,
                s.agent.as_deref()
            ),
            (400, 1000, 2197, Some("a"))
        );
    }
}
