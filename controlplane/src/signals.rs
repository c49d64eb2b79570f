//! End-user signals: durable storage with group commit, attribution to agents, and the counts
//! read back per agent and per session.
//!
//! **Group commit.** [`Signals::record`] hands the signal to one writer task and waits for its
//! commit. The writer takes everything that queued up while the previous transaction was
//! committing and stores it in one transaction, so many concurrent signals share one disk sync
//! while each caller still hears "stored" only after its own signal is durable.
//!
//! **An error means not stored.** A signal from a dataplane comes with a deadline
//! ([`Signals::record_within`]; [`DEFAULT_COMMIT_WITHIN`] when the dataplane names none): the
//! time by which its commit must *begin*. Before it begins a
//! transaction, and again just before `COMMIT`, the writer sets aside every signal whose deadline
//! passed or whose caller stopped waiting (a dataplane that gave up, a cancelled gRPC call):
//! those are answered "not stored" (or not at all, the caller being gone) and the transaction
//! is rolled back and redone without them. So a signal is never committed after its caller was
//! told, or could have told its client, that it was not stored. What stays uncertain is only the
//! `COMMIT` itself: a caller that stops waiting while its commit is under way (a disk that
//! stalls mid-sync, a link lost mid-call) cannot know the outcome, and says so (the dataplane's
//! 503 then reads "may have been stored": a retry with the same `Idempotency-Key` counts once).
//!
//! **Conflicts are retried.** A transaction that lost a deadlock or a serialization conflict
//! (PostgreSQL) is redone, up to [`crate::store::CONFLICT_ATTEMPTS`] times in all. Every
//! transaction that writes signals, sessions or rollups takes its row locks in one order (rows
//! sorted by key, tables in the order of the records ingest), so conflicts are rare to begin with.
//! A failure is logged at most once a second (with a count), never once per signal.
//!
//! **Attribution.** A signal names its session, one answer (`request_id`, an `NM-Request-Id`), or
//! both. A signal naming an answer whose record is stored takes that request's session, agent,
//! env and user, and counts in the analytics for that request alone
//! ([`crate::analytics::rollup`]'s units); naming another session with it is refused
//! ([`Error::SessionMismatch`]: the request's record is the truth, decided here where it is
//! read, in the signal's own transaction). Otherwise a signal of a known session (a proxied
//! request carried `NM-Session`) is stored with the session's agent, env and user. Otherwise it
//! is stored with the `NM-Agent` hint (or none) and re-attributed by [`crate::records`] when the
//! session's first request, or the named request, arrives. Counts are then plain indexed
//! aggregates over `signals.agent`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;

use nm_types::signal::Signal;
use nm_types::{Action, Env, SessionId};
use sea_orm::sea_query::OnConflict;
use sea_orm::{
    ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect, Set,
    TryInsertResult,
};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use crate::analytics::rollup::{SignalFacts, Unit, add_signals, rebuild_unit};
use crate::error::{Error, Result};
use crate::sql::{Sql, chunks_of, count};
use crate::store::entity::{session, signal};
use crate::store::{Store, WriteTxn};
use nm_types::throttle::Throttle;

/// Signals an agent needs before recommendations are produced.
pub const RECOMMENDATION_THRESHOLD: u64 = 100;
/// Most signals committed in one transaction.
const MAX_GROUP: usize = 1024;
/// How long after it arrives a signal's commit may begin, when the caller names no deadline.
pub const DEFAULT_COMMIT_WITHIN: Duration = Duration::from_secs(4);
/// What a caller hears when its signal was not stored (our words: the database's text stays in
/// the log).
const NOT_STORED: &str = "the signal was not stored: the database could not take it in time";

/// Whether a signal was new or an idempotent replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    New,
    Duplicate,
}

/// Which signals to count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SignalFilter {
    /// `None` = the unattributed bucket.
    pub agent: Option<String>,
    pub env: Option<Env>,
    pub since_ms: Option<i64>,
    pub until_ms: Option<i64>,
}

/// Counts per action, in [`Action::ALL`] order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ActionCounts(pub [u64; 8]);

impl ActionCounts {
    pub fn get(&self, a: Action) -> u64 {
        Action::ALL
            .iter()
            .position(|x| *x == a)
            .map_or(0, |i| self.0[i])
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

/// One agent's signal counts and its progress toward recommendations.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentCounts {
    pub agent: Option<String>,
    pub total: u64,
    pub by_action: ActionCounts,
    pub threshold: u64,
    pub remaining: u64,
    pub unlocked: bool,
    pub progress: f64,
}

/// One row of the agent list.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AgentSummary {
    /// `None` = unattributed.
    pub agent: Option<String>,
    pub signals: u64,
    pub sessions: u64,
    pub requests: u64,
    pub last_activity_ms: Option<i64>,
}

/// One session with its requests and signals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionDetail {
    pub session: Option<session::Model>,
    pub session_id: String,
    pub signals: ActionCounts,
}

struct Pending {
    signal: Signal,
    /// The commit must begin before this, or the signal is not stored (`None`: no deadline).
    deadline: Option<Instant>,
    done: oneshot::Sender<Result<Stored>>,
}

impl Pending {
    /// Whether the signal may still be stored: its caller waits and its deadline has not passed.
    fn wanted(&self, now: Instant) -> bool {
        !self.done.is_closed() && self.deadline.is_none_or(|d| now < d)
    }

    /// Answers a signal set aside unstored (nobody hears it when the caller is gone).
    fn not_stored(self) {
        let _ = self
            .done
            .send(Err(Error::Unavailable(NOT_STORED.to_owned())));
    }
}

/// Signal storage and counts. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Signals {
    store: Store,
    writer: mpsc::Sender<Pending>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("signal", &self.signal.id)
            .finish()
    }
}

impl Signals {
    /// Starts the writer task. It ends when every `Signals` clone is dropped.
    pub fn start(store: Store) -> Self {
        let (writer, rx) = mpsc::channel(8 * MAX_GROUP);
        tokio::spawn(write_loop(store.clone(), rx));
        Self { store, writer }
    }

    /// Stores a signal, without a deadline; returns once it is committed. An error means it
    /// was not stored.
    pub async fn record(&self, signal: Signal) -> Result<Stored> {
        self.submit(signal, None).await
    }

    /// Stores a signal whose commit must begin within `commit_within`; returns once it is
    /// committed. An error means it was not stored, and dropping the future before it resolves
    /// (the caller gave up) keeps it from being stored unless its commit had already begun.
    pub async fn record_within(&self, signal: Signal, commit_within: Duration) -> Result<Stored> {
        self.submit(signal, Instant::now().checked_add(commit_within))
            .await
    }

    async fn submit(&self, signal: Signal, deadline: Option<Instant>) -> Result<Stored> {
        signal
            .check()
            .map_err(|why| Error::InvalidArgument(why.to_owned()))?;
        // From the hand-over to the writer until the commit: the signal's share of its batch.
        let db = crate::otel::db_span(self.store.system(), "INSERT", "signals");
        let (done, wait) = oneshot::channel();
        self.writer
            .send(Pending {
                signal,
                deadline,
                done,
            })
            .await
            .map_err(|_| Error::Unavailable("signal writer stopped".to_owned()))?;
        let stored = wait
            .await
            .map_err(|_| Error::Unavailable("signal writer stopped".to_owned()))?;
        if stored.is_err() {
            db.failed("not_stored");
        }
        stored
    }

    /// Counts for one agent (or the unattributed bucket).
    pub fn agent_counts<'a>(
        &'a self,
        f: &'a SignalFilter,
    ) -> crate::BoxFuture<'a, Result<AgentCounts>> {
        Box::pin(async move {
            let db = self.store.conn();
            let mut sql = Sql::new(db.get_database_backend(), "SELECT COUNT(*) AS total");
            for a in Action::ALL {
                // Constant action names from our own enum: no user input enters the SQL text.
                sql.push(&format!(
                ", CAST(COALESCE(SUM(CASE WHEN action = '{a}' THEN 1 ELSE 0 END), 0) AS BIGINT) AS {a}"
            ));
            }
            sql.push(" FROM signals WHERE ");
            match &f.agent {
                Some(agent) => sql.push("agent = ").bind(agent.clone()),
                None => sql.push("agent IS NULL"),
            };
            push_range(&mut sql, "received_at_ms", f.env, f.since_ms, f.until_ms);
            let row = db
                .query_one_raw(sql.build())
                .await?
                .ok_or_else(|| Error::Unavailable("count query returned no row".to_owned()))?;
            let mut by_action = ActionCounts::default();
            for (i, a) in Action::ALL.iter().enumerate() {
                by_action.0[i] = count(&row, a.as_str())?;
            }
            let total = count(&row, "total")?;
            Ok(AgentCounts {
                agent: f.agent.clone(),
                total,
                by_action,
                threshold: RECOMMENDATION_THRESHOLD,
                remaining: RECOMMENDATION_THRESHOLD.saturating_sub(total),
                unlocked: total >= RECOMMENDATION_THRESHOLD,
                progress: (total as f64 / RECOMMENDATION_THRESHOLD as f64).min(1.0),
            })
        })
    }

    /// Every agent with signals or sessions in the range, most signals first.
    pub fn list_agents(
        &self,
        env: Option<Env>,
        since_ms: Option<i64>,
        until_ms: Option<i64>,
    ) -> crate::BoxFuture<'_, Result<Vec<AgentSummary>>> {
        Box::pin(async move {
            let db = self.store.conn();
            let backend = db.get_database_backend();
            let mut sql = Sql::new(
                backend,
                "SELECT agent, COUNT(*) AS signals, MAX(received_at_ms) AS last FROM signals WHERE 1 = 1",
            );
            push_range(&mut sql, "received_at_ms", env, since_ms, until_ms);
            sql.push(" GROUP BY agent");
            let signal_rows = db.query_all_raw(sql.build()).await?;

            let mut sql = Sql::new(
                backend,
                "SELECT agent, COUNT(*) AS sessions, CAST(COALESCE(SUM(request_count), 0) AS BIGINT) AS requests, MAX(last_seen_ms) AS last \
             FROM sessions WHERE 1 = 1",
            );
            push_range(&mut sql, "last_seen_ms", env, since_ms, until_ms);
            sql.push(" GROUP BY agent");
            let session_rows = db.query_all_raw(sql.build()).await?;

            let mut by_agent: HashMap<Option<String>, AgentSummary> = HashMap::new();
            for row in signal_rows {
                let agent: Option<String> = row.try_get("", "agent")?;
                let e = by_agent
                    .entry(agent.clone())
                    .or_insert_with(|| AgentSummary {
                        agent,
                        ..Default::default()
                    });
                e.signals = count(&row, "signals")?;
                e.last_activity_ms = e.last_activity_ms.max(row.try_get("", "last")?);
            }
            for row in session_rows {
                let agent: Option<String> = row.try_get("", "agent")?;
                let e = by_agent
                    .entry(agent.clone())
                    .or_insert_with(|| AgentSummary {
                        agent,
                        ..Default::default()
                    });
                e.sessions = count(&row, "sessions")?;
                e.requests = count(&row, "requests")?;
                e.last_activity_ms = e.last_activity_ms.max(row.try_get("", "last")?);
            }
            let mut out: Vec<_> = by_agent.into_values().collect();
            out.sort_by(|a, b| {
                b.signals
                    .cmp(&a.signals)
                    .then_with(|| a.agent.cmp(&b.agent))
            });
            Ok(out)
        })
    }

    /// A session's record and its signals per action.
    pub fn session<'a>(
        &'a self,
        session_id: &'a str,
    ) -> crate::BoxFuture<'a, Result<SessionDetail>> {
        Box::pin(async move {
            session_id
                .parse::<SessionId>()
                .map_err(|e| Error::InvalidArgument(format!("session_id: {e}")))?;
            let db = self.store.conn();
            let session = session::Entity::find_by_id(session_id.to_owned())
                .one(db)
                .await?;
            let mut sql = Sql::new(
                db.get_database_backend(),
                "SELECT action, COUNT(*) AS n FROM signals WHERE session_id = ",
            );
            sql.bind(session_id.to_owned()).push(" GROUP BY action");
            let mut signals = ActionCounts::default();
            for row in db.query_all_raw(sql.build()).await? {
                let action: String = row.try_get("", "action")?;
                if let Some(i) = Action::ALL.iter().position(|a| a.as_str() == action) {
                    signals.0[i] = count(&row, "n")?;
                }
            }
            if session.is_none() && signals.total() == 0 {
                return Err(Error::NotFound(format!("no session {session_id:?}")));
            }
            Ok(SessionDetail {
                session,
                session_id: session_id.to_owned(),
                signals,
            })
        })
    }

    /// The exported spans of `session_id`'s latest traced requests, newest first, at most
    /// `limit` (what a signal's span links to).
    pub fn session_spans<'a>(
        &'a self,
        session_id: &'a str,
        limit: u32,
    ) -> crate::BoxFuture<'a, Result<Vec<nm_types::record::TraceRef>>> {
        Box::pin(async move {
            let db = self.store.conn();
            let mut sql = Sql::new(
                db.get_database_backend(),
                "SELECT trace_id, span_id FROM requests WHERE trace_id IS NOT NULL AND session_id = ",
            );
            sql.bind(session_id.to_owned())
                .push(" ORDER BY started_at_ms DESC LIMIT ")
                .bind(i64::from(limit));
            let mut spans = Vec::new();
            for row in db.query_all_raw(sql.build()).await? {
                let trace: String = row.try_get("", "trace_id")?;
                let span: Option<String> = row.try_get("", "span_id")?;
                if let Some(t) = span.and_then(|s| nm_types::record::TraceRef::from_hex(&trace, &s))
                {
                    spans.push(t);
                }
            }
            Ok(spans)
        })
    }
}

pub(crate) fn push_range(
    sql: &mut Sql,
    time_col: &str,
    env: Option<Env>,
    since: Option<i64>,
    until: Option<i64>,
) {
    if let Some(env) = env {
        sql.push(" AND env = ").bind(env.as_str());
    }
    if let Some(s) = since {
        sql.push(&format!(" AND {time_col} >= ")).bind(s);
    }
    if let Some(u) = until {
        sql.push(&format!(" AND {time_col} < ")).bind(u);
    }
}

/// The single writer: one transaction per group of queued signals.
async fn write_loop(store: Store, mut rx: mpsc::Receiver<Pending>) {
    let failures = Throttle::new(Duration::from_secs(1));
    while let Some(first) = rx.recv().await {
        let mut group = vec![first];
        while group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(p) => group.push(p),
                Err(_) => break,
            }
        }
        let mut conflicts = 0;
        loop {
            group = keep_wanted(group);
            if group.is_empty() {
                break;
            }
            // The transaction must be ready to commit before the first deadline of the group;
            // past it (the write lock held elsewhere, a database that does not answer), it is
            // dropped (rolled back) and the signals whose time is up are answered "not stored".
            let first_deadline = group.iter().filter_map(|p| p.deadline).min();
            let prepared = match first_deadline {
                Some(at) => tokio::time::timeout_at(at, write_group(&store, &group)).await,
                None => Ok(write_group(&store, &group).await),
            };
            let Ok(prepared) = prepared else {
                continue;
            };
            let outcome = match prepared {
                Ok((txn, results)) => {
                    // The last look before the commit: nothing is committed for a caller who
                    // has gone or whose deadline passed while the statements ran.
                    let now = Instant::now();
                    if group.iter().any(|p| !p.wanted(now)) {
                        drop(txn);
                        continue;
                    }
                    txn.commit().await.map(|()| results)
                }
                Err(e) => Err(e),
            };
            match outcome {
                Ok(results) => {
                    debug!(signals = group.len(), "signal group committed");
                    for (p, stored) in group.into_iter().zip(results) {
                        let _ = p.done.send(stored);
                    }
                    break;
                }
                Err(e)
                    if crate::store::is_conflict(&e)
                        && conflicts + 1 < crate::store::CONFLICT_ATTEMPTS =>
                {
                    conflicts += 1;
                    debug!(error = %e, attempt = conflicts, "signal group conflicted; redone");
                    tokio::time::sleep(crate::store::conflict_backoff(conflicts)).await;
                }
                Err(e) => {
                    if let Some(suppressed) = failures.allow() {
                        warn!(signals = group.len(), error = %e, suppressed, "signal group not stored");
                    }
                    for p in group {
                        p.not_stored();
                    }
                    // Do not spin against a failing database.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    break;
                }
            }
        }
    }
}

/// The signals that may still be stored; the others are answered "not stored".
fn keep_wanted(group: Vec<Pending>) -> Vec<Pending> {
    let now = Instant::now();
    let mut keep = Vec::with_capacity(group.len());
    for p in group {
        if p.wanted(now) {
            keep.push(p);
        } else {
            debug!(signal = %p.signal.id, "signal set aside unstored: its caller gave up or its deadline passed");
            p.not_stored();
        }
    }
    keep
}

/// What a signal that names an answer learns from that request's record, when it is stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Answer {
    session_id: Option<String>,
    agent: Option<String>,
    env: Option<String>,
    user_id: Option<String>,
}

/// How one signal of a group is stored: its session (given, or learnt from its request's
/// record), whether its answer's record is known, its agent; or why it is refused.
#[derive(Debug)]
struct Placed<'a> {
    session: Option<&'a str>,
    answer: Option<&'a Answer>,
    agent: Option<String>,
}

/// What the request's record says against what the signal says: the record's session wins;
/// a signal naming another session than its request's is refused (409 `session_mismatch`).
fn place<'a>(
    s: &'a Signal,
    answers: &'a HashMap<String, Answer>,
    sessions: &HashMap<String, session::Model>,
) -> Result<Placed<'a>> {
    let given = s.session_id.as_ref().map(|id| id.as_str());
    let answer = s.request_id.as_ref().and_then(|r| answers.get(r.as_str()));
    let Some(answer) = answer else {
        // About a session, or about an answer whose record has not arrived yet (the records
        // ingest attributes it then).
        let known = given.and_then(|id| sessions.get(id));
        let agent = if s.request_id.is_some() {
            s.agent_hint.clone()
        } else {
            agent_of(s, known)
        };
        return Ok(Placed {
            session: given,
            answer: None,
            agent,
        });
    };
    if let (Some(given), Some(own)) = (given, answer.session_id.as_deref())
        && given != own
    {
        return Err(Error::SessionMismatch(
            "request_id names a request made in another session than session_id; send the \
             answer's own session, or request_id alone"
                .to_owned(),
        ));
    }
    Ok(Placed {
        session: answer.session_id.as_deref().or(given),
        answer: Some(answer),
        agent: answer.agent.clone().or_else(|| s.agent_hint.clone()),
    })
}

/// Writes a group in a transaction and returns it uncommitted, with what each signal will be
/// (a signal refused for naming a request of another session is not written).
async fn write_group(store: &Store, group: &[Pending]) -> Result<(WriteTxn, Vec<Result<Stored>>)> {
    let txn = store.begin_write().await?;
    if group.iter().any(|p| p.signal.request_id.is_some())
        || has_unknown_session(&txn, group).await?
    {
        answers_lock(&txn, true).await?;
    }
    let answers = known_answers(
        &txn,
        group
            .iter()
            .filter_map(|p| p.signal.request_id.as_ref().map(|r| r.as_str())),
    )
    .await?;
    // Answers that implicit signals judge: the first explicit signal naming one moves those
    // implicit signals from their session's unit to the answer's (both rebuilt).
    let judged = judged_answers(
        &txn,
        group
            .iter()
            .filter_map(|p| p.signal.request_id.as_ref().map(|r| r.as_str())),
    )
    .await?;
    // Every session the group touches: given, or its answers' (their rollups are rebuilt).
    let session_ids: HashSet<&str> = group
        .iter()
        .filter_map(|p| p.signal.session_id.as_ref().map(|id| id.as_str()))
        .chain(answers.values().filter_map(|a| a.session_id.as_deref()))
        .chain(judged.values().flatten().map(|(_, s)| s.as_str()))
        .collect();
    let sessions = known_sessions(&txn, session_ids.into_iter()).await?;
    let placed: Vec<Result<Placed<'_>>> = group
        .iter()
        .map(|p| place(&p.signal, &answers, &sessions))
        .collect();
    let rows: Vec<signal::ActiveModel> = group
        .iter()
        .zip(&placed)
        .filter_map(|(p, placed)| Some(to_row(&p.signal, placed.as_ref().ok()?, &sessions)))
        .collect();
    // Multi-row inserts. ON CONFLICT without a target skips a row that breaks any unique index
    // (an idempotent replay); RETURNING names the rows that were new.
    let mut new_ids: HashSet<String> = HashSet::with_capacity(rows.len());
    for chunk in chunks_of(&rows) {
        let inserted = signal::Entity::insert_many(chunk.iter().cloned())
            .on_conflict(OnConflict::new().do_nothing().to_owned())
            .try_insert()
            .exec_with_returning_keys(&txn)
            .await?;
        if let TryInsertResult::Inserted(ids) = inserted {
            new_ids.extend(ids);
        }
    }
    // The new signals of known agents join their units' rollups (each id once): a session's,
    // or, for a signal naming an answer, that answer's. A signal naming an answer whose record
    // is known moves that request out of its session's unit into its own: both units are
    // rebuilt from the rows (once each, after the inserts).
    let mut added: HashSet<&str> = HashSet::with_capacity(new_ids.len());
    let mut facts: Vec<SignalFacts<'_>> = Vec::new();
    let mut rebuild: BTreeSet<(Option<&str>, bool, &str)> = BTreeSet::new();
    for (p, placed) in group.iter().zip(&placed) {
        let Ok(placed) = placed else { continue };
        if !new_ids.contains(&p.signal.id) || !added.insert(&p.signal.id) {
            continue;
        }
        match (&p.signal.request_id, placed.answer) {
            (Some(request), answer)
                if answer.is_some() || judged.contains_key(request.as_str()) =>
            {
                let agent = placed.agent.as_deref();
                rebuild.insert((agent, true, request.as_str()));
                if let Some(Answer {
                    session_id: Some(session),
                    agent: Some(agent),
                    ..
                }) = answer
                {
                    rebuild.insert((Some(agent.as_str()), false, session.as_str()));
                }
                for (agent, session) in judged.get(request.as_str()).into_iter().flatten() {
                    rebuild.insert((Some(agent.as_str()), true, request.as_str()));
                    rebuild.insert((Some(agent.as_str()), false, session.as_str()));
                }
            }
            (request, _) => {
                let (Some(agent), Some(unit)) = (
                    placed.agent.as_deref(),
                    request.as_ref().map(|r| r.as_str()).or(placed.session),
                ) else {
                    continue;
                };
                facts.push(SignalFacts {
                    agent,
                    session_id: unit,
                    received_at_ms: p.signal.received_at_ms,
                    action: p.signal.action,
                    edit_distance: edit_distance(&p.signal),
                });
            }
        }
    }
    add_signals(&txn, &facts).await?;
    for (agent, is_request, id) in rebuild {
        let unit = if is_request {
            Unit::Request(id)
        } else {
            Unit::Session(id)
        };
        rebuild_unit(&txn, unit, agent).await?;
    }
    let results = group
        .iter()
        .zip(placed)
        .map(|(p, placed)| {
            placed.map(|_| {
                if new_ids.contains(&p.signal.id) {
                    Stored::New
                } else {
                    Stored::Duplicate
                }
            })
        })
        .collect();
    Ok((txn, results))
}

/// The agent a signal is stored with: its session's when the session is known, else its
/// `NM-Agent` hint.
fn agent_of(s: &Signal, known: Option<&session::Model>) -> Option<String> {
    known
        .and_then(|k| k.agent.clone())
        .or_else(|| s.agent_hint.clone())
}

/// The stored edit distance of a signal.
fn edit_distance(s: &Signal) -> Option<i64> {
    s.edit_distance
        .map(|d| i64::try_from(d).unwrap_or(i64::MAX))
}

/// The row for a signal: with its answer's agent, env and user when it names a request whose
/// record is known, else with its session's when the session is known, else with its
/// `NM-Agent` hint (`placed.agent`). Its session is empty while a signal that named only an
/// answer waits for that answer's record.
fn to_row(
    s: &Signal,
    placed: &Placed<'_>,
    sessions: &HashMap<String, session::Model>,
) -> signal::ActiveModel {
    let (attributed, env, user_id) = match (placed.answer, &s.request_id) {
        (Some(a), _) => (true, a.env.clone(), a.user_id.clone()),
        (None, Some(_)) => (false, None, None),
        (None, None) => {
            let known = placed.session.and_then(|id| sessions.get(id));
            (
                known.and_then(|k| k.agent.as_ref()).is_some(),
                known.and_then(|k| k.env.clone()),
                known.and_then(|k| k.user_id.clone()),
            )
        }
    };
    signal::ActiveModel {
        id: Set(s.id.clone()),
        received_at_ms: Set(s.received_at_ms),
        session_id: Set(placed.session.unwrap_or_default().to_owned()),
        request_id: Set(s.request_id.as_ref().map(|r| r.as_str().to_owned())),
        action: Set(s.action.as_str().to_owned()),
        edit_distance: Set(edit_distance(s)),
        custom_label: Set(s.custom_label.clone()),
        key_id: Set(s.key_id.to_string()),
        idempotency_key: Set(s.idempotency_key.clone()),
        agent_hint: Set(s.agent_hint.clone()),
        attributed_by_session: Set(attributed),
        agent: Set(placed.agent.clone()),
        env: Set(env),
        user_id: Set(user_id),
        source: Set(signal::EXPLICIT.to_owned()),
        rule: Set(None),
    }
}

/// An arbitrary constant: the key of the PostgreSQL advisory lock of [`answers_lock`].
const ANSWERS_LOCK: i64 = 0x6e6d_5f61_6e73;

/// Orders a signal group that names answers (or a session not known yet) and a records batch on
/// PostgreSQL (SQLite runs one writer at a time): under READ COMMITTED, a signal group that
/// finds no record for its request (or session) and a batch that brings that record, running at
/// once, would each miss the other, leaving the signal waiting for ever. A group naming answers
/// or an unknown session takes this lock exclusively (`exclusive`)
/// before it reads the records; every batch takes it shared (batches never wait for each
/// other) before anything else, and looks for the signals naming its requests under it. Both
/// take it first, before any row lock: one lock order.
pub(crate) async fn answers_lock<C: ConnectionTrait>(db: &C, exclusive: bool) -> Result<()> {
    if db.get_database_backend() != sea_orm::DatabaseBackend::Postgres {
        return Ok(());
    }
    let sql = if exclusive {
        "SELECT 1 AS locked FROM (SELECT pg_advisory_xact_lock($1)) AS l"
    } else {
        "SELECT 1 AS locked FROM (SELECT pg_advisory_xact_lock_shared($1)) AS l"
    };
    db.query_one_raw(sea_orm::Statement::from_sql_and_values(
        sea_orm::DatabaseBackend::Postgres,
        sql,
        [ANSWERS_LOCK.into()],
    ))
    .await?;
    Ok(())
}

/// The records of the requests the group's signals name, where stored.
async fn known_answers<'a>(
    txn: &WriteTxn,
    ids: impl Iterator<Item = &'a str>,
) -> Result<HashMap<String, Answer>> {
    let ids: Vec<String> = ids
        .collect::<HashSet<&str>>()
        .into_iter()
        .map(str::to_owned)
        .collect();
    let mut out = HashMap::with_capacity(ids.len());
    for chunk in chunks_of(&ids) {
        let mut sql = Sql::new(
            txn.get_database_backend(),
            "SELECT request_id, session_id, agent, env, user_id FROM requests WHERE request_id IN (",
        );
        for (i, id) in chunk.iter().enumerate() {
            if i > 0 {
                sql.push(", ");
            }
            sql.bind(id.clone());
        }
        sql.push(")");
        for row in txn.query_all_raw(sql.build()).await? {
            out.insert(
                row.try_get::<String>("", "request_id")?,
                Answer {
                    session_id: row.try_get("", "session_id")?,
                    agent: row.try_get("", "agent")?,
                    env: row.try_get("", "env")?,
                    user_id: row.try_get("", "user_id")?,
                },
            );
        }
    }
    Ok(out)
}

/// For each of `ids` (answers) that implicit signals judge: the (agent, session) of those
/// signals.
async fn judged_answers<'a>(
    txn: &WriteTxn,
    ids: impl Iterator<Item = &'a str>,
) -> Result<HashMap<String, Vec<(String, String)>>> {
    let ids: Vec<String> = ids
        .collect::<HashSet<&str>>()
        .into_iter()
        .map(str::to_owned)
        .collect();
    let mut out: HashMap<String, Vec<(String, String)>> = HashMap::new();
    for chunk in chunks_of(&ids) {
        let mut sql = Sql::new(
            txn.get_database_backend(),
            "SELECT DISTINCT request_id, agent, session_id FROM signals \
             WHERE source = 'implicit' AND agent IS NOT NULL AND session_id <> '' \
             AND request_id IN (",
        );
        for (i, id) in chunk.iter().enumerate() {
            if i > 0 {
                sql.push(", ");
            }
            sql.bind(id.clone());
        }
        sql.push(")");
        for row in txn.query_all_raw(sql.build()).await? {
            out.entry(row.try_get::<String>("", "request_id")?)
                .or_default()
                .push((row.try_get("", "agent")?, row.try_get("", "session_id")?));
        }
    }
    Ok(out)
}

/// The group's sessions that are known. On PostgreSQL their rows are share-locked in id order
/// (byte order, like the records ingest's upsert): a session's row guards its rollups, so a
/// signal group and a records batch touching the same session take their locks in one order.
/// Whether a signal of the group names a session no stored request has brought yet (PostgreSQL
/// only; SQLite runs one writer at a time). Such a signal waits for its session's first record,
/// so it is ordered against record batches like a signal naming an answer ([`answers_lock`]):
/// otherwise a batch bringing the session's first record at the same moment would miss it, and
/// it would wait for the session's next record. A plain read (no row lock), so the lock is still
/// taken before any row lock.
async fn has_unknown_session(txn: &WriteTxn, group: &[Pending]) -> Result<bool> {
    if txn.get_database_backend() != sea_orm::DatabaseBackend::Postgres {
        return Ok(false);
    }
    let ids: HashSet<&str> = group
        .iter()
        .filter_map(|p| p.signal.session_id.as_ref().map(|id| id.as_str()))
        .collect();
    if ids.is_empty() {
        return Ok(false);
    }
    let known = session::Entity::find()
        .filter(session::Column::SessionId.is_in(ids.iter().copied()))
        .all(txn)
        .await?;
    Ok(known.len() < ids.len())
}

async fn known_sessions<'a>(
    txn: &WriteTxn,
    ids: impl Iterator<Item = &'a str>,
) -> Result<HashMap<String, session::Model>> {
    let ids: HashSet<&str> = ids.collect();
    let mut find = session::Entity::find().filter(session::Column::SessionId.is_in(ids));
    if txn.get_database_backend() == sea_orm::DatabaseBackend::Postgres {
        find = find
            .order_by(
                sea_orm::sea_query::Expr::cust(r#""session_id" COLLATE "C""#),
                sea_orm::Order::Asc,
            )
            .lock_shared();
    }
    let rows = find.all(txn).await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.session_id.clone(), r))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{Records, RequestRecord};

    const R: &str = "01890a5d-ac96-774b-bcce-b302099a8057";

    fn named(session: Option<&str>, hint: Option<&str>) -> Signal {
        Signal {
            id: "s".to_owned(),
            received_at_ms: 1,
            session_id: session.and_then(|s| s.parse().ok()),
            request_id: R.parse().ok(),
            action: Action::Accepted,
            edit_distance: None,
            custom_label: None,
            key_id: "key_1".into(),
            idempotency_key: None,
            agent_hint: hint.map(str::to_owned),
        }
    }

    /// Where `place` puts `s`: (session, answer known, agent), or the refusal.
    fn placed(
        s: Signal,
        answers: &HashMap<String, Answer>,
    ) -> Result<(Option<String>, bool, Option<String>)> {
        let sessions = HashMap::new();
        place(&s, answers, &sessions)
            .map(|p| (p.session.map(str::to_owned), p.answer.is_some(), p.agent))
    }

    /// The request's record decides a signal that names it: its session (a different one named
    /// with it is refused), its agent; an unknown request leaves the signal as sent.
    #[test]
    fn the_request_record_places_a_signal_that_names_it() {
        let own = |s: &str| Some(s.to_owned());
        let none = HashMap::new();
        assert_eq!(
            placed(named(None, Some("hint")), &none).ok(),
            Some((None, false, own("hint")))
        );
        assert_eq!(
            placed(named(Some("sess_x"), None), &none).ok(),
            Some((own("sess_x"), false, None))
        );

        let known = HashMap::from([(
            R.to_owned(),
            Answer {
                session_id: own("sess_a"),
                agent: own("bot"),
                env: None,
                user_id: None,
            },
        )]);
        for given in [None, Some("sess_a")] {
            assert_eq!(
                placed(named(given, Some("hint")), &known).ok(),
                Some((own("sess_a"), true, own("bot"))),
                "{given:?}"
            );
        }
        assert!(matches!(
            placed(named(Some("sess_b"), None), &known),
            Err(Error::SessionMismatch(_))
        ));

        // A request made without a session belongs to none: the session named is kept.
        let sessionless = HashMap::from([(R.to_owned(), Answer::default())]);
        assert_eq!(
            placed(named(Some("sess_b"), Some("hint")), &sessionless).ok(),
            Some((own("sess_b"), true, own("hint")))
        );
    }

    /// Signal groups (read sessions, then write) and record batches (write sessions) racing on
    /// one SQLite file must never fail with "database is locked".
    #[tokio::test]
    async fn concurrent_writers_on_sqlite_do_not_fail() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let url = format!("sqlite://{}/w.db?mode=rwc", dir.path().display());
        let store = Store::connect(&url).await.unwrap_or_else(|e| panic!("{e}"));
        let signals = Signals::start(store.clone());
        let budgets = crate::Budgets::load(store.clone(), 0).await.unwrap();
        let records = Records::new(store.clone(), budgets);
        let mut tasks = Vec::new();
        for t in 0..8 {
            let records = records.clone();
            tasks.push(tokio::spawn(async move {
                for b in 0..20 {
                    let batch = (0..10)
                        .map(|i| RequestRecord {
                            request_id: format!("r{t}-{b}-{i}"),
                            started_at_ms: 1,
                            key_id: "key_1".into(),
                            provider: "openai".into(),
                            method: "POST".into(),
                            session_id: format!("sess_{}", i % 4).parse().ok(),
                            agent: Some("a".into()),
                            ..Default::default()
                        })
                        .collect::<Vec<_>>();
                    records
                        .ingest(&batch)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())?;
                }
                Ok::<(), String>(())
            }));
            let signals = signals.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..100 {
                    let s = Signal {
                        id: format!("s{t}-{i}"),
                        received_at_ms: 1,
                        session_id: format!("sess_{}", i % 4).parse().ok(),
                        request_id: None,
                        action: Action::Accepted,
                        edit_distance: None,
                        custom_label: None,
                        key_id: "key_1".into(),
                        idempotency_key: None,
                        agent_hint: None,
                    };
                    signals
                        .record(s)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())?;
                }
                Ok(())
            }));
        }
        for t in tasks {
            t.await
                .unwrap_or_else(|e| panic!("{e}"))
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let counts = signals
            .agent_counts(&SignalFilter {
                agent: Some("a".into()),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(counts.total, 800);
    }
}
