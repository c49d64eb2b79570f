//! Proxied-request records: validated, stored once per request id, folded into the `sessions`
//! table (so the controlplane knows which agent, env and end user each session belongs to) and
//! into the `user_spend` rollup that budgets read — all in the batch's one transaction.

use std::collections::{HashMap, HashSet};

use nm_types::{Env, SessionId};
use rusqlite::ToSql;
use rusqlite::types::{ToSqlOutput, ValueRef};
use sea_orm::sea_query::Expr;
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseBackend, DatabaseTransaction, EntityTrait, QueryFilter,
    Statement, TransactionTrait, Value,
};
use tracing::warn;

use crate::analytics::rollup;
use crate::budgets::{Budgets, SpendItem, add_to_rollup};
use crate::error::Result;
use crate::sql::{INSERT_CHUNK_SIZES, Sql, chunks_of, insert_values};
use crate::store::entity::{session, signal};
use crate::store::{Store, WriteTxn};

pub use nm_types::record::RequestRecord;
pub use nm_types::{Usage, UsageStatus};

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
    /// The batch INSERTs for this database (see [`insert_sql`]).
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
        let txn = self.store.begin_write().await?;
        let new_ids = insert_new(&txn, &self.insert_sql, &valid).await?;
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
        rollup::add_requests(&txn, &fresh).await?;
        // Signals rarely arrive before their session's first request: one probe for the batch
        // finds the sessions that have such signals, and only those are re-attributed.
        for session_id in awaiting_attribution(&txn, &sessions).await? {
            if let Some(agent) = attribute_signals(&txn, &session_id).await? {
                rollup::rebuild_session(&txn, &session_id, &agent).await?;
            }
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
            "SELECT DISTINCT session_id FROM signals WHERE attributed_by_session = ",
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
        .filter(signal::Column::AttributedBySession.eq(false));
    if let Some(agent) = &s.agent {
        update = update
            .col_expr(signal::Column::Agent, Expr::value(agent.clone()))
            .col_expr(signal::Column::AttributedBySession, Expr::value(true));
    }
    let changed = update.exec(db).await?.rows_affected;
    Ok(s.agent.filter(|_| changed > 0))
}

/// `requests` columns, in the order of [`row_cells`].
const COLUMNS: [&str; 26] = [
    "request_id",
    "started_at_ms",
    "key_id",
    "provider",
    "method",
    "path",
    "model",
    "agent",
    "session_id",
    "env",
    "user_id",
    "status",
    "latency_ms",
    "ttfb_ms",
    "streamed",
    "error_code",
    "response_bytes",
    "answered_model",
    "input_tokens",
    "output_tokens",
    "cached_input_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
    "finish_reason",
    "cost_micros",
    "usage_status",
];

/// One value of a `requests` row, borrowed from its record: bound by rusqlite on SQLite, turned
/// into sea-orm values on PostgreSQL.
#[derive(Debug, Clone, Copy)]
enum Cell<'a> {
    Text(Option<&'a str>),
    Int(Option<i64>),
    Int32(i32),
    Bool(bool),
}

/// One record's values in [`COLUMNS`] order.
fn row_cells(r: &RequestRecord) -> [Cell<'_>; COLUMNS.len()] {
    fn text(v: &Option<String>) -> Cell<'_> {
        Cell::Text(v.as_deref())
    }
    let count = |v: Option<u64>| Cell::Int(v.map(saturating_i64));
    let u = &r.usage;
    [
        Cell::Text(Some(&r.request_id)),
        Cell::Int(Some(r.started_at_ms)),
        Cell::Text(Some(&r.key_id)),
        Cell::Text(Some(&r.provider)),
        Cell::Text(Some(&r.method)),
        Cell::Text(Some(&r.path)),
        text(&r.model),
        text(&r.agent),
        Cell::Text(r.session_id.as_ref().map(SessionId::as_str)),
        Cell::Text(r.env.map(Env::as_str)),
        text(&r.user_id),
        Cell::Int32(i32::from(r.status)),
        count(Some(r.latency_ms)),
        count(r.ttfb_ms),
        Cell::Bool(r.streamed),
        Cell::Text(r.error_code.as_deref()),
        count(Some(r.response_bytes)),
        text(&u.model),
        count(u.input_tokens),
        count(u.output_tokens),
        count(u.cached_input_tokens),
        count(u.cache_write_tokens),
        count(u.reasoning_tokens),
        text(&u.finish_reason),
        count(r.cost_micros),
        Cell::Text(Some(r.usage_status.as_str())),
    ]
}

impl From<Cell<'_>> for Value {
    fn from(cell: Cell<'_>) -> Value {
        match cell {
            Cell::Text(s) => Value::String(s.map(str::to_owned)),
            Cell::Int(n) => Value::BigInt(n),
            Cell::Int32(n) => Value::Int(Some(n)),
            Cell::Bool(b) => Value::Bool(Some(b)),
        }
    }
}

impl ToSql for Cell<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(match *self {
            Cell::Text(Some(s)) => ValueRef::Text(s.as_bytes()),
            Cell::Text(None) | Cell::Int(None) => ValueRef::Null,
            Cell::Int(Some(n)) => ValueRef::Integer(n),
            Cell::Int32(n) => ValueRef::Integer(n.into()),
            Cell::Bool(b) => ValueRef::Integer(b.into()),
        }))
    }
}

/// The INSERT of `rows` records as one multi-row `VALUES` list of bound parameters. Resent
/// records are skipped (`ON CONFLICT DO NOTHING`); with `returning`, the statement names the new
/// ones.
///
/// On PostgreSQL a batch goes in as such statements, cut into a few fixed row counts
/// ([`INSERT_CHUNK_SIZES`]) so each connection caches a handful of prepared statements (an
/// earlier version sent the batch as one JSON parameter unpacked by `json_each`, and SQLite's JSON
/// path lookups were then 16% of the whole gateway's instructions under load). On SQLite only the
/// one-row statement is used, through rusqlite ([`insert_rows`]).
fn insert_sql(backend: DatabaseBackend, rows: usize, returning: bool) -> String {
    let mut sql = insert_values(backend, "requests", &COLUMNS, rows);
    sql.push_str(" ON CONFLICT (request_id) DO NOTHING");
    if returning {
        sql.push_str(" RETURNING request_id");
    }
    sql
}

/// The INSERT texts for each row count of [`INSERT_CHUNK_SIZES`], with and without `RETURNING`,
/// made once per [`Records`].
#[derive(Debug)]
struct InsertSql {
    backend: DatabaseBackend,
    by_size: Vec<(usize, bool, String)>,
    /// The one-row INSERT without `RETURNING` (SQLite's, see [`insert_rows`]).
    one_row: String,
}

impl InsertSql {
    fn new(backend: DatabaseBackend) -> Self {
        let by_size = INSERT_CHUNK_SIZES
            .iter()
            .flat_map(|&n| [false, true].map(|r| (n, r, insert_sql(backend, n, r))))
            .collect();
        Self {
            backend,
            by_size,
            one_row: insert_sql(backend, 1, false),
        }
    }

    /// The statement inserting `chunk`.
    fn statement(&self, chunk: &[&RequestRecord], returning: bool) -> Statement {
        let rows = chunk.len();
        let sql = self
            .by_size
            .iter()
            .find(|(n, r, _)| *n == rows && *r == returning)
            .map_or_else(
                || insert_sql(self.backend, rows, returning),
                |(_, _, sql)| sql.clone(),
            );
        let values = chunk.iter().flat_map(|r| row_cells(r).map(Value::from));
        Statement::from_sql_and_values(self.backend, sql, values)
    }
}

/// Which records of a batch were stored for the first time.
#[derive(Debug)]
enum Fresh {
    All,
    Only(HashSet<String>),
}

impl Fresh {
    fn contains(&self, request_id: &str) -> bool {
        match self {
            Fresh::All => true,
            Fresh::Only(ids) => ids.contains(request_id),
        }
    }
}

/// Writes request rows inside `txn` with the statements the ingest uses, skipping stored ones
/// (the synthetic data's direct path: rows without their sessions and spend).
pub(crate) async fn write_rows(txn: &WriteTxn, records: &[&RequestRecord]) -> Result<()> {
    let sql = InsertSql::new(txn.get_database_backend());
    insert_new(txn, &sql, records).await.map(drop)
}

/// Inserts the records not stored yet and says which they were.
async fn insert_new(txn: &WriteTxn, sql: &InsertSql, records: &[&RequestRecord]) -> Result<Fresh> {
    match txn {
        WriteTxn::Sqlite(txn) => {
            txn.with_rusqlite(|conn| insert_rows(conn, &sql.one_row, records))
                .await
        }
        WriteTxn::Pooled(txn) => insert_new_pooled(txn, sql, records).await,
    }
}

/// SQLite: the records one by one through a prepared one-row statement, bound from the records
/// themselves (see [`crate::store::SqliteWrite`]). A row that changed nothing was stored already.
fn insert_rows(
    conn: &rusqlite::Connection,
    sql: &str,
    records: &[&RequestRecord],
) -> rusqlite::Result<Fresh> {
    let mut stmt = conn.prepare(sql)?;
    let mut stored = Vec::with_capacity(records.len());
    for r in records {
        for (i, cell) in row_cells(r).iter().enumerate() {
            stmt.raw_bind_parameter(i + 1, cell)?;
        }
        stored.push(stmt.raw_execute()? == 1);
    }
    if stored.iter().all(|s| *s) {
        return Ok(Fresh::All);
    }
    let ids = records
        .iter()
        .zip(stored)
        .filter(|(_, s)| *s)
        .map(|(r, _)| r.request_id.clone())
        .collect();
    Ok(Fresh::Only(ids))
}

/// PostgreSQL: multi-row statements of [`INSERT_CHUNK_SIZES`].
///
/// A batch is almost always new, so it is first inserted without `RETURNING` inside a savepoint:
/// when every row went in, that is the answer. When some were stored already (a resent batch),
/// the savepoint is rolled back and the batch inserted again with `RETURNING`, which names the
/// new ones. Skipping `RETURNING` in the common case saves the database and the driver a result
/// row per record.
async fn insert_new_pooled(
    txn: &DatabaseTransaction,
    sql: &InsertSql,
    records: &[&RequestRecord],
) -> Result<Fresh> {
    let attempt = txn.begin().await?;
    let mut inserted = 0u64;
    for chunk in chunks_of(records) {
        inserted += attempt
            .execute_raw(sql.statement(chunk, false))
            .await?
            .rows_affected();
    }
    if inserted == records.len() as u64 {
        attempt.commit().await?;
        return Ok(Fresh::All);
    }
    attempt.rollback().await?;
    let mut ids = HashSet::with_capacity(records.len());
    for chunk in chunks_of(records) {
        for row in txn.query_all_raw(sql.statement(chunk, true)).await? {
            ids.insert(row.try_get::<String>("", "request_id")?);
        }
    }
    Ok(Fresh::Only(ids))
}

fn saturating_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use sea_orm::PaginatorTrait;

    use super::*;

    fn record(id: &str, session: Option<&str>, at: i64) -> RequestRecord {
        RequestRecord {
            request_id: id.to_owned(),
            started_at_ms: at,
            key_id: "key_1".into(),
            provider: "openai".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".to_owned(),
            session_id: session.map(|s| s.parse().unwrap()),
            agent: Some("a".to_owned()),
            status: 200,
            ..Default::default()
        }
    }

    /// A store on `url` and its records, with budgets loaded.
    async fn records_on(url: &str) -> (Store, Records) {
        let store = Store::connect(url).await.unwrap();
        let budgets = Budgets::load(store.clone(), 0).await.unwrap();
        (store.clone(), Records::new(store, budgets))
    }

    async fn stored_session(store: &Store, id: &str) -> session::Model {
        session::Entity::find_by_id(id.to_owned())
            .one(store.conn())
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("session {id} missing"))
    }

    /// Runs `test` on a fresh SQLite file and, when the test database is configured, on a fresh
    /// PostgreSQL database.
    async fn on_both<F: Future<Output = ()>>(test: impl Fn(String) -> F) {
        let dir = tempfile::tempdir().unwrap();
        test(format!("sqlite://{}/t.db?mode=rwc", dir.path().display())).await;
        if let Some(db) = crate::scratch::ScratchPg::for_tests().await {
            test(db.url.clone()).await;
            crate::scratch::drop_test_db(&db.url).await;
        }
    }

    /// Every value comes out of the database exactly as it went in: text with quotes, escapes and
    /// non-ASCII, integers at the edges, nulls.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_value_round_trips() {
        on_both(every_value_round_trips_on).await;
    }

    async fn every_value_round_trips_on(url: String) {
        let (store, records) = records_on(&url).await;
        let r = RequestRecord {
            request_id: "r-\"quoted\"-\\-é-🌍".to_owned(),
            started_at_ms: 1_763_800_000_123,
            key_id: "key_1".into(),
            provider: "openai".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".to_owned(),
            model: Some("ft:gpt-4o:org:x".to_owned()),
            agent: Some("a 'b' \"c\"".to_owned()),
            user_id: Some("ユーザー".to_owned()),
            status: 429,
            latency_ms: nm_types::record::MAX_DURATION_MS,
            ttfb_ms: Some(7),
            streamed: true,
            error_code: None,
            response_bytes: 10,
            usage: Usage {
                input_tokens: Some(0),
                output_tokens: None,
                ..Default::default()
            },
            usage_status: UsageStatus::Partial,
            cost_micros: Some(123_456_789),
            ..Default::default()
        };
        let out = records.ingest(std::slice::from_ref(&r)).await.unwrap();
        assert_eq!(out.stored, 1);
        let m = crate::store::entity::request::Entity::find_by_id(r.request_id.clone())
            .one(store.conn())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m.agent, r.agent);
        assert_eq!(m.user_id, r.user_id);
        assert_eq!(m.model, r.model);
        assert_eq!(
            (m.status, m.latency_ms, m.ttfb_ms, m.streamed),
            (429, nm_types::record::MAX_DURATION_MS as i64, Some(7), true)
        );
        assert_eq!(
            (m.input_tokens, m.output_tokens, m.cost_micros),
            (Some(0), None, Some(123_456_789))
        );
        assert_eq!(m.usage_status, "partial");
        assert_eq!(m.error_code, None);
        store.close().await.unwrap();
    }

    /// A batch that repeats some stored records stores only the new ones, and says which.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_partly_resent_batch_stores_the_new_records() {
        on_both(a_partly_resent_batch_stores_the_new_records_on).await;
    }

    async fn a_partly_resent_batch_stores_the_new_records_on(url: String) {
        let (store, records) = records_on(&url).await;
        let batch = |from: i64, to: i64| -> Vec<RequestRecord> {
            (from..to)
                .map(|i| record(&format!("p{i}"), Some("sess_p"), i))
                .collect()
        };
        assert_eq!(records.ingest(&batch(0, 300)).await.unwrap().stored, 300);
        let out = records.ingest(&batch(200, 700)).await.unwrap();
        assert_eq!((out.stored, out.duplicates), (400, 100));
        let stored = crate::store::entity::request::Entity::find()
            .count(store.conn())
            .await
            .unwrap();
        assert_eq!(stored, 700);
        let s = stored_session(&store, "sess_p").await;
        assert_eq!(
            (s.request_count, s.first_seen_ms, s.last_seen_ms),
            (700, 0, 699)
        );
        store.close().await.unwrap();
    }

    /// Rows written through rusqlite belong to the SQLite write transaction: without a commit
    /// they are gone, and the connection is usable afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn rows_inserted_on_sqlite_roll_back_with_their_transaction() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/t.db?mode=rwc", dir.path().display());
        let store = Store::connect(&url).await.unwrap();
        let sql = InsertSql::new(store.backend());
        let batch: Vec<RequestRecord> =
            (0..50).map(|i| record(&format!("x{i}"), None, i)).collect();
        let refs: Vec<&RequestRecord> = batch.iter().collect();
        let count = |store: Store| async move {
            crate::store::entity::request::Entity::find()
                .count(store.conn())
                .await
                .unwrap()
        };

        let txn = store.begin_write().await.unwrap();
        assert!(matches!(txn, WriteTxn::Sqlite(_)));
        assert!(matches!(
            insert_new(&txn, &sql, &refs).await.unwrap(),
            Fresh::All
        ));
        drop(txn);
        assert_eq!(count(store.clone()).await, 0);

        let txn = store.begin_write().await.unwrap();
        assert!(matches!(
            insert_new(&txn, &sql, &refs).await.unwrap(),
            Fresh::All
        ));
        txn.commit().await.unwrap();
        assert_eq!(count(store.clone()).await, 50);
        store.close().await.unwrap();
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
        batch.push(RequestRecord {
            cost_micros: Some(u64::MAX),
            ..record("bad", Some("sess_0"), 5)
        });
        let first = records
            .ingest(&batch)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            first,
            IngestOutcome {
                stored: 1200,
                duplicates: 0,
                rejected: vec![(
                    1200,
                    "cost_micros and budget_micros must be at most 10^12".to_owned()
                )],
                epoch: first.epoch,
                seq: 1,
            }
        );
        let again = records
            .ingest(&batch)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            again,
            IngestOutcome {
                stored: 0,
                duplicates: 1200,
                rejected: vec![(
                    1200,
                    "cost_micros and budget_micros must be at most 10^12".to_owned()
                )],
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

    /// Each record that breaks a rule is refused alone, by its index, with the rule (every rule
    /// is tested in `nm_types::record`); the rest of the batch is stored, and nothing refused
    /// reaches the sums (a forged `cost_micros` of 2^64-1 once made every usage query fail).
    #[tokio::test]
    async fn out_of_range_values_are_refused_one_by_one() {
        use nm_types::record::{MAX_MICROS, MAX_TOKENS};
        let dir = tempfile::tempdir().unwrap();
        let (store, records) =
            records_on(&format!("sqlite://{}/v.db?mode=rwc", dir.path().display())).await;
        let ok = |id: &str| record(id, Some("sess_v"), 1_000);
        let batch = vec![
            ok("good1"),
            RequestRecord {
                cost_micros: Some(u64::MAX),
                ..ok("f1")
            },
            RequestRecord {
                path: "/x".repeat(5_000),
                ..ok("f2")
            },
            ok("good2"),
        ];
        let out = records.ingest(&batch).await.unwrap();
        assert_eq!(out.stored, 2);
        let refused: Vec<_> = out.rejected.iter().map(|(i, _)| *i).collect();
        assert_eq!(refused, vec![1, 2]);
        assert!(out.rejected[0].1.contains("cost_micros"));
        assert!(out.rejected[1].1.contains("path"));
        // The caps at their limits are accepted, and the usage sums over them still work.
        let at_caps = RequestRecord {
            cost_micros: Some(MAX_MICROS),
            budget_micros: Some(MAX_MICROS),
            usage: Usage {
                input_tokens: Some(MAX_TOKENS),
                ..Default::default()
            },
            ..ok("caps")
        };
        assert_eq!(records.ingest(&[at_caps]).await.unwrap().stored, 1);
        let report = crate::usage::UsageReports::new(store.clone())
            .report(&[], &crate::usage::UsageFilter::default(), 0)
            .await
            .unwrap();
        assert_eq!(report.total.cost_micros, MAX_MICROS);
        assert_eq!(report.total.requests, 3);
        store.close().await.unwrap();
    }

    /// A session's later batches merge into it: the first agent, env and user seen stick (a
    /// missing one is filled), its times widen, its requests add up; a batch with more sessions
    /// than one statement holds stores every one of them.
    async fn sessions_merge_across_batches(url: &str) {
        let (store, records) = records_on(url).await;
        let with =
            |id: &str, at: i64, agent: Option<&str>, env: Option<&str>, user: &str| RequestRecord {
                agent: agent.map(str::to_owned),
                env: env.map(|e| e.parse().unwrap()),
                user_id: Some(user.to_owned()),
                ..record(id, Some("sess_a"), at)
            };
        records
            .ingest(&[with("a1", 2000, None, None, "u1")])
            .await
            .unwrap();
        let mut second = vec![
            with("a2", 1000, Some("x"), Some("staging"), "u2"),
            with("a3", 3000, Some("y"), Some("production"), "u3"),
        ];
        second.extend((0..300).map(|i| record(&format!("o{i}"), Some(&format!("sess_o{i}")), i)));
        records.ingest(&second).await.unwrap();

        let a = stored_session(&store, "sess_a").await;
        assert_eq!(
            (a.agent.as_deref(), a.env.as_deref(), a.user_id.as_deref()),
            (Some("x"), Some("staging"), Some("u1"))
        );
        assert_eq!(
            (a.first_seen_ms, a.last_seen_ms, a.request_count),
            (1000, 3000, 3)
        );
        let others = session::Entity::find()
            .filter(session::Column::SessionId.starts_with("sess_o"))
            .all(store.conn())
            .await
            .unwrap();
        assert_eq!(others.len(), 300);
        assert!(
            others
                .iter()
                .all(|s| s.request_count == 1 && s.agent.as_deref() == Some("a"))
        );
        store.close().await.unwrap();
    }

    #[tokio::test]
    async fn sessions_merge_across_batches_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        sessions_merge_across_batches(&format!("sqlite://{}/s.db?mode=rwc", dir.path().display()))
            .await;
    }

    #[tokio::test]
    async fn sessions_merge_across_batches_postgres() {
        let Some(db) = crate::scratch::ScratchPg::for_tests().await else {
            return;
        };
        sessions_merge_across_batches(&db.url).await;
        crate::scratch::drop_test_db(&db.url).await;
    }
}
