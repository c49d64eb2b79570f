//! The flow of one batch of records: checked one by one, new rows written by the database's
//! row writer, then folded into `sessions`, the analytics rollups, the spend rollups and the
//! day totals of usage and latency (`usage::add_day_totals`), signals that
//! came before their session or their request (a signal naming an answer) re-attributed, all
//! in one transaction.
//!
//! A signal that named an answer before its record arrived takes, when it arrives, the
//! request's agent, env, user and session. Had the signal named another session as well (a
//! conflict the signal endpoint could not see yet: it answers 409 `session_mismatch` only while
//! the record is known), the request wins: the signal was acknowledged and is kept, counted for
//! that request, under the request's own session; the disagreement is logged (warn).
//!
//! Each new record's implicit signals (`RequestRecord::inferred`, what the dataplane's rules
//! saw) become `signals` rows with `source = implicit` and their rule, in the same transaction:
//! id `<the record's request id>:<rule>` (so a resent batch, whose record is skipped, stores
//! them once; a record carries at most one signal per rule), the rule's action and edit
//! distance, `request_id` the answer judged, and the record's time, key, session, agent, env
//! and user. They join the rollup's implicit columns in the unit of the answer they judge
//! ([`rollup::add_implicit`]): whether the answer's record came before or comes after them
//! does not matter, their session and agent are the carrying record's.

use std::collections::{HashMap, HashSet};

use nm_types::signal::Rule;
use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, Statement, Value};
use tracing::warn;

use super::{InsertSql, RequestRecord, insert_new};
use crate::analytics::rollup::{self, ImplicitFacts};
use crate::budgets::{Budgets, SpendItem, add_to_rollup};
use crate::error::Result;
use crate::sql::{Sql, chunks_of, insert_values};
use crate::store::Store;
use crate::store::entity::signal::{EXPLICIT, IMPLICIT};
use crate::store::entity::{session, signal};

/// What [`Records::ingest`] did with a batch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IngestOutcome {
    /// Records stored for the first time.
    pub stored: u32,
    /// Records already stored (a resent batch).
    pub duplicates: u32,
    /// Records refused for breaking a rule: (index in the batch, the rule). A retry would not
    /// help them; the dataplane sets them aside.
    pub rejected: Vec<(usize, String)>,
    /// The budget feed position that includes this batch's spend.
    pub epoch: u64,
    pub seq: u64,
}

#[derive(Debug, Clone)]
pub struct Records {
    store: Store,
    budgets: Budgets,
    /// The batch INSERTs for this database (see [`super::row::insert_sql`]).
    insert_sql: std::sync::Arc<InsertSql>,
}

impl Records {
    pub fn new(store: Store, budgets: Budgets) -> Self {
        let insert_sql = InsertSql::new(store.backend()).into();
        Self {
            store,
            budgets,
            insert_sql,
        }
    }

    /// Stores a batch in one transaction. A record whose request id is already stored is skipped,
    /// so a dataplane may resend a batch it is unsure about.
    #[tracing::instrument(skip_all, fields(batch = batch.len()))]
    pub async fn ingest(&self, batch: &[RequestRecord]) -> Result<IngestOutcome> {
        let mut outcome = IngestOutcome::default();
        let mut valid = Vec::with_capacity(batch.len());
        for (i, record) in batch.iter().enumerate() {
            match record.check() {
                Ok(()) => valid.push(record),
                Err(why) => {
                    warn!(index = i, why, "request record rejected");
                    outcome.rejected.push((i, why.to_owned()));
                }
            }
        }
        let db = crate::otel::db_span(self.store.system(), "INSERT", "request_records");
        let txn = self.store.begin_write().await?;
        // Before any row lock: ordered against signal groups that name answers (PostgreSQL).
        crate::signals::answers_lock(&txn, false).await?;
        let new_ids = insert_new(&txn, &self.insert_sql, &valid)
            .await
            .inspect_err(|_| db.failed("insert_failed"))?;
        let fresh: Vec<&RequestRecord> = valid
            .iter()
            .copied()
            .filter(|r| new_ids.contains(&r.request_id))
            .collect();
        outcome.stored = u32::try_from(fresh.len()).unwrap_or(u32::MAX);
        outcome.duplicates = u32::try_from(valid.len() - fresh.len()).unwrap_or(u32::MAX);
        // Lock order (no deadlocks): the batch's sessions first, sorted by id, then their
        // rollup rows, sorted too; a session's row guards its rollups against other batches.
        let mut sessions = sessions_of(&fresh);
        sessions.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        upsert_sessions(&txn, &sessions).await?;
        // Requests some signal names (sent before their record) count in their own unit.
        let named = named_requests(&txn, &fresh).await?;
        rollup::add_requests_named(&txn, &fresh, &named).await?;
        for record in fresh.iter().filter(|r| named.contains(&r.request_id)) {
            attribute_request_signals(&txn, record).await?;
            rollup::rebuild_unit(
                &txn,
                rollup::Unit::Request(&record.request_id),
                record.agent.as_deref(),
            )
            .await?;
        }
        store_inferred(&txn, &fresh).await?;
        // Signals rarely arrive before their session's first request: one probe for the batch
        // finds the sessions that have such signals, and only those are re-attributed.
        for session_id in awaiting_attribution(&txn, &sessions).await? {
            if let Some(agent) = attribute_signals(&txn, &session_id).await? {
                rollup::rebuild_session(&txn, &session_id, &agent).await?;
            }
        }
        let spend: Vec<SpendItem> = fresh.iter().map(|r| spend_item(r)).collect();
        add_to_rollup(&txn, &spend).await?;
        crate::usage::add_day_totals(&txn, &fresh).await?;
        txn.commit().await?;
        (outcome.epoch, outcome.seq) = self.budgets.apply(&spend, crate::now_ms());
        Ok(outcome)
    }
}

/// What a record counts toward budgets: its key, agent, model, env and end user; what its end
/// user's budget counted (else its cost) and its metered tokens.
fn spend_item(r: &RequestRecord) -> SpendItem {
    use nm_types::budget::{Scope, ScopeKind};
    let mut scopes = vec![Scope::new(ScopeKind::Key, &*r.key_id)];
    if let Some(a) = &r.agent {
        scopes.push(Scope::new(ScopeKind::Agent, a.as_str()));
    }
    if let Some(m) = &r.model {
        scopes.push(Scope::new(ScopeKind::Model, m.as_str()));
    }
    if let Some(e) = r.env {
        scopes.push(Scope::new(ScopeKind::Env, e.as_str()));
    }
    if let Some(u) = &r.user_id {
        scopes.push(Scope::user(u.as_str()));
    }
    SpendItem {
        scopes,
        started_at_ms: r.started_at_ms,
        micros: r.budget_micros.or(r.cost_micros).unwrap_or(0),
        tokens: r
            .usage
            .input_tokens
            .unwrap_or(0)
            .saturating_add(r.usage.output_tokens.unwrap_or(0)),
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
    let mut index: HashMap<&str, usize> = HashMap::new();
    for r in records {
        let Some(id) = &r.session_id else { continue };
        let i = *index.entry(id.as_str()).or_insert_with(|| {
            let seen = SessionSeen {
                first_ms: r.started_at_ms,
                last_ms: r.started_at_ms,
                ..Default::default()
            };
            out.push((id.as_str().to_owned(), seen));
            out.len() - 1
        });
        let seen = &mut out[i].1;
        seen.agent = seen.agent.take().or_else(|| r.agent.clone());
        seen.env = seen
            .env
            .take()
            .or_else(|| r.env.map(|e| e.as_str().to_owned()));
        seen.user_id = seen.user_id.take().or_else(|| r.user_id.clone());
        seen.first_ms = seen.first_ms.min(r.started_at_ms);
        seen.last_ms = seen.last_ms.max(r.started_at_ms);
        seen.requests += 1;
    }
    out
}

/// `sessions` columns, in the order [`upsert_sessions`] binds them.
const SESSION_COLUMNS: [&str; 7] = [
    "session_id",
    "agent",
    "env",
    "user_id",
    "first_seen_ms",
    "last_seen_ms",
    "request_count",
];

/// What an upsert does to a session already stored: the first agent, env and user seen stick,
/// activity times widen, the request count grows.
const SESSION_MERGE: &str = " ON CONFLICT (session_id) DO UPDATE SET \
    agent = COALESCE(sessions.agent, excluded.agent), \
    env = COALESCE(sessions.env, excluded.env), \
    user_id = COALESCE(sessions.user_id, excluded.user_id), \
    first_seen_ms = CASE WHEN excluded.first_seen_ms < sessions.first_seen_ms \
        THEN excluded.first_seen_ms ELSE sessions.first_seen_ms END, \
    last_seen_ms = CASE WHEN excluded.last_seen_ms > sessions.last_seen_ms \
        THEN excluded.last_seen_ms ELSE sessions.last_seen_ms END, \
    request_count = sessions.request_count + excluded.request_count";

/// Adds a batch's requests to their sessions, a few multi-row statements for the whole batch
/// (each session appears once in `sessions`, as one statement may not update a row twice).
async fn upsert_sessions<C: ConnectionTrait>(
    db: &C,
    sessions: &[(String, SessionSeen)],
) -> Result<()> {
    let backend = db.get_database_backend();
    for chunk in chunks_of(sessions) {
        let size = chunk.len();
        let mut sql = insert_values(backend, "sessions", &SESSION_COLUMNS, size);
        sql.push_str(SESSION_MERGE);
        let mut values = Vec::with_capacity(size * SESSION_COLUMNS.len());
        for (id, seen) in chunk {
            values.extend([
                Value::String(Some(id.clone())),
                Value::String(seen.agent.clone()),
                Value::String(seen.env.clone()),
                Value::String(seen.user_id.clone()),
                Value::BigInt(Some(seen.first_ms)),
                Value::BigInt(Some(seen.last_ms)),
                Value::BigInt(Some(seen.requests)),
            ]);
        }
        db.execute_raw(Statement::from_sql_and_values(backend, sql, values))
            .await?;
    }
    Ok(())
}

/// The sessions among `sessions` with signals stored before the session was known (not yet
/// attributed by it), in the order given.
async fn awaiting_attribution<C: ConnectionTrait>(
    db: &C,
    sessions: &[(String, SessionSeen)],
) -> Result<Vec<String>> {
    let backend = db.get_database_backend();
    let mut found = HashSet::new();
    for chunk in chunks_of(sessions) {
        let mut sql = Sql::new(
            backend,
            "SELECT DISTINCT session_id FROM signals WHERE request_id IS NULL \
             AND attributed_by_session = ",
        );
        sql.bind(false).push(" AND session_id IN (");
        for (i, (id, _)) in chunk.iter().enumerate() {
            if i > 0 {
                sql.push(", ");
            }
            sql.bind(id.clone());
        }
        sql.push(")");
        for row in db.query_all_raw(sql.build()).await? {
            found.insert(row.try_get::<String>("", "session_id")?);
        }
    }
    Ok(sessions
        .iter()
        .filter(|(id, _)| found.contains(id))
        .map(|(id, _)| id.clone())
        .collect())
}

/// Gives signals that arrived before their session was known the session's agent, env and user.
/// Returns the session's agent when signals were re-attributed to it (their rollups then need
/// rebuilding).
async fn attribute_signals<C: ConnectionTrait>(db: &C, session_id: &str) -> Result<Option<String>> {
    let Some(s) = session::Entity::find_by_id(session_id.to_owned())
        .one(db)
        .await?
    else {
        return Ok(None);
    };
    if s.agent.is_none() && s.env.is_none() && s.user_id.is_none() {
        return Ok(None);
    }
    let mut update = signal::Entity::update_many()
        .col_expr(signal::Column::Env, Expr::value(s.env.clone()))
        .col_expr(signal::Column::UserId, Expr::value(s.user_id.clone()))
        .filter(signal::Column::SessionId.eq(session_id))
        .filter(signal::Column::RequestId.is_null())
        .filter(signal::Column::AttributedBySession.eq(false));
    if let Some(agent) = &s.agent {
        update = update
            .col_expr(signal::Column::Agent, Expr::value(agent.clone()))
            .col_expr(signal::Column::AttributedBySession, Expr::value(true));
    }
    let changed = update.exec(db).await?.rows_affected;
    Ok(s.agent.filter(|_| changed > 0))
}

/// The request ids among `records` that some stored explicit signal names (one probe per
/// chunk; signals naming an answer before its record are rare).
async fn named_requests<C: ConnectionTrait>(
    db: &C,
    records: &[&RequestRecord],
) -> Result<HashSet<String>> {
    let ids: Vec<&str> = records.iter().map(|r| r.request_id.as_str()).collect();
    explicitly_named(db, &ids).await
}

/// The request ids among `ids` that some stored explicit signal names.
async fn explicitly_named<C: ConnectionTrait>(db: &C, ids: &[&str]) -> Result<HashSet<String>> {
    let backend = db.get_database_backend();
    let mut found = HashSet::new();
    for chunk in chunks_of(ids) {
        let mut sql = Sql::new(
            backend,
            "SELECT DISTINCT request_id FROM signals WHERE source = 'explicit' AND request_id IN (",
        );
        for (i, r) in chunk.iter().enumerate() {
            if i > 0 {
                sql.push(", ");
            }
            sql.bind((*r).to_owned());
        }
        sql.push(")");
        for row in db.query_all_raw(sql.build()).await? {
            found.insert(row.try_get::<String>("", "request_id")?);
        }
    }
    Ok(found)
}

/// Gives the signals that named `record` before it arrived its agent (else they keep their
/// hint), env, user and session (else they keep the one they named).
async fn attribute_request_signals<C: ConnectionTrait>(
    db: &C,
    record: &RequestRecord,
) -> Result<()> {
    let own = record.session_id.as_ref().map(|s| s.as_str().to_owned());
    if let Some(own) = &own {
        let mut sql = Sql::new(
            db.get_database_backend(),
            "SELECT COUNT(*) AS n FROM signals WHERE source = 'explicit' AND request_id = ",
        );
        sql.bind(record.request_id.clone())
            .push(" AND attributed_by_session = ")
            .bind(false)
            .push(" AND session_id <> '' AND session_id <> ")
            .bind(own.clone());
        let others = match db.query_one_raw(sql.build()).await? {
            Some(row) => crate::sql::count(&row, "n")?,
            None => 0,
        };
        if others > 0 {
            warn!(
                signals = others,
                "signals named a request and another session than the request's; kept, counted \
                 for the request under its own session"
            );
        }
    }
    let mut update = signal::Entity::update_many()
        .col_expr(
            signal::Column::Env,
            Expr::value(record.env.map(|e| e.as_str().to_owned())),
        )
        .col_expr(signal::Column::UserId, Expr::value(record.user_id.clone()))
        .col_expr(signal::Column::AttributedBySession, Expr::value(true))
        .filter(signal::Column::RequestId.eq(record.request_id.as_str()))
        .filter(signal::Column::Source.eq(EXPLICIT))
        .filter(signal::Column::AttributedBySession.eq(false));
    if let Some(agent) = &record.agent {
        update = update.col_expr(signal::Column::Agent, Expr::value(agent.clone()));
    }
    if let Some(own) = own {
        update = update.col_expr(signal::Column::SessionId, Expr::value(own));
    }
    update.exec(db).await?;
    Ok(())
}

/// The id of the implicit signal of `rule` that the record of `request_id` carries.
fn implicit_id(request_id: &str, rule: Rule) -> String {
    format!("{request_id}:{}", rule.name())
}

/// `signals` columns of an implicit signal, in the order [`store_inferred`] binds them (the
/// others stay NULL: no label, no idempotency key, no hint).
const IMPLICIT_COLUMNS: [&str; 13] = [
    "id",
    "received_at_ms",
    "session_id",
    "request_id",
    "action",
    "edit_distance",
    "key_id",
    "agent",
    "env",
    "user_id",
    "attributed_by_session",
    "source",
    "rule",
];

/// Stores the implicit signals the new `records` carry (a few multi-row statements for the
/// batch) and adds them to their units' rollups.
async fn store_inferred<C: ConnectionTrait>(db: &C, records: &[&RequestRecord]) -> Result<()> {
    let rows: Vec<(&RequestRecord, &nm_types::record::Inferred)> = records
        .iter()
        .flat_map(|r| r.inferred.iter().map(move |i| (*r, i)))
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    let backend = db.get_database_backend();
    // The carrying records are new, so their signals are too; `ON CONFLICT DO NOTHING`
    // and `RETURNING` keep the rollup right whatever happens.
    let mut new_ids: HashSet<String> = HashSet::with_capacity(rows.len());
    for chunk in chunks_of(&rows) {
        let mut sql = insert_values(backend, "signals", &IMPLICIT_COLUMNS, chunk.len());
        sql.push_str(" ON CONFLICT DO NOTHING RETURNING id");
        let mut values = Vec::with_capacity(chunk.len() * IMPLICIT_COLUMNS.len());
        for (r, inf) in chunk {
            values.extend([
                Value::String(Some(implicit_id(&r.request_id, inf.rule))),
                Value::BigInt(Some(r.started_at_ms)),
                Value::String(Some(
                    r.session_id
                        .as_ref()
                        .map(|s| s.as_str().to_owned())
                        .unwrap_or_default(),
                )),
                Value::String(Some(inf.answer.as_str().to_owned())),
                Value::String(Some(inf.rule.action().as_str().to_owned())),
                Value::BigInt(
                    inf.edit_distance
                        .map(|d| i64::try_from(d).unwrap_or(i64::MAX)),
                ),
                Value::String(Some(r.key_id.to_string())),
                Value::String(r.agent.clone()),
                Value::String(r.env.map(|e| e.as_str().to_owned())),
                Value::String(r.user_id.clone()),
                // Placed by the record that carries it: never re-attributed.
                Value::Bool(Some(true)),
                Value::String(Some(IMPLICIT.to_owned())),
                Value::String(Some(inf.rule.name().to_owned())),
            ]);
        }
        for row in db
            .query_all_raw(Statement::from_sql_and_values(backend, sql, values))
            .await?
        {
            new_ids.insert(row.try_get::<String>("", "id")?);
        }
    }
    let answers: Vec<&str> = records
        .iter()
        .flat_map(|r| r.inferred.iter().map(|i| i.answer.as_str()))
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let named = explicitly_named(db, &answers).await?;
    let mut facts = Vec::new();
    for r in records {
        let Some(agent) = r.agent.as_deref() else {
            continue;
        };
        for inf in &r.inferred {
            if !new_ids.contains(&implicit_id(&r.request_id, inf.rule)) {
                continue;
            }
            let unit = if named.contains(inf.answer.as_str()) {
                inf.answer.as_str()
            } else {
                match &r.session_id {
                    Some(s) => s.as_str(),
                    None => continue,
                }
            };
            facts.push(ImplicitFacts {
                agent,
                unit,
                received_at_ms: r.started_at_ms,
                rule: inf.rule,
                edit_distance: inf
                    .edit_distance
                    .map(|d| i64::try_from(d).unwrap_or(i64::MAX)),
            });
        }
    }
    rollup::add_implicit(db, &facts).await
}
